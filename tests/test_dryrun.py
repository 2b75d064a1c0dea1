"""`sparrow dryrun`: whole-RL-step compiles for TPU slices / GPU nodes without the hardware.

Every test runs the command in a subprocess with the compile environment (.compile-env, from
`bash .ci/compile_env.sh`) on PYTHONPATH, from a directory outside the repo (a `libtpu` folder in
the working directory would shadow the package), like tests/test_compile.py. A tiny model keeps
the unit tests to seconds of compiling; the shipped configs' guard (which compiles the real configs
for their targets) is tests/test_shipped_configs.py, a file of its own so that CI's other worker
takes these tests while one worker compiles the guard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hf_fixtures import require_compile_env

from sparrow_jax.dryrun import kernel_census
from sparrow_jax.dryrun import report as report_text
from sparrow_jax.model.config import Qwen3Config

REPO = Path(__file__).resolve().parents[1]
COMPILE_ENV = REPO / ".compile-env"
pytestmark = pytest.mark.compile

TINY = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Three layers, but 1.2B parameters: f32 master + AdamW + a bf16 copy cannot fit a v5e chip.
FAT = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=False)
GIN = """
TrainConfig.model_path = "{model}"
TrainConfig.train_data = "unused.jsonl"
TrainConfig.prompts_per_step = 4
TrainConfig.group_size = 4
TrainConfig.rollout_batch_prompts = 2
TrainConfig.mesh_model = 1
RolloutConfig.max_new_tokens = 64
RolloutConfig.max_budget = 64
RolloutConfig.prefill_chunk = 64
make_schedule.budgets = [48, 48, 48, 48, 48, 48, 48, 48, 48, 48,
                         48, 48, 48, 48, 48, 48, 48, 48, 48, 48]
make_schedule.bin_size = 32
ControllerConfig.min_budget = 48
ControllerConfig.max_budget = 64
LearnerConfig.micro_batch_size = 8
LearnerConfig.attention_chunk = 32
DryrunConfig.prompt_length = 64
"""


def dryrun_env(compile_env: bool = True) -> dict[str, str]:
    """The environment of a `sparrow dryrun` subprocess: CPU host, the compile-only toolchains
    (compile_env) and this checkout on PYTHONPATH, no test XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(COMPILE_ENV), str(REPO)] if compile_env
                                          else [str(REPO)]))
    return env


def run_dryrun(*argv: str, compile_env: bool = True, env: dict | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    if os.environ.get("SPARROW_SKIP_COMPILE_CHECK") == "1":
        pytest.skip("SPARROW_SKIP_COMPILE_CHECK=1")
    require_compile_env(COMPILE_ENV)
    with tempfile.TemporaryDirectory(prefix="sparrow-dryrun-test-") as cwd:
        return subprocess.run([sys.executable, "-m", "sparrow_jax.cli", "dryrun", *argv],
                              cwd=cwd, env={**dryrun_env(compile_env), **(env or {})},
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dryrun")
    paths = {}
    for name, cfg in (("tiny", TINY), ("fat", FAT)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        paths[name] = str(root / name)
    (root / "tiny.gin").write_text(GIN.format(model=paths["tiny"]))
    paths["gin"] = str(root / "tiny.gin")
    return paths


def _report(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.strip().startswith("{"), r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.slow       # ~40 s: `launch/local.sh test --all`
def test_argument_bytes_are_the_sharded_shapes(tiny):
    """Compiled per-device argument bytes = the abstract shards the dryrun reports, and those are
    the parameter / optimizer / KV-cache sizes computed independently."""
    r = run_dryrun(tiny["gin"], "--target", "h100x8", "--json", "--no_fit", "--no_cost")
    report = _report(r)
    assert r.returncode == 0 and report["fits"], r.stderr[-3000:]
    progs = {p["name"]: p for p in report["programs"]}
    assert {"rollout.prefill", "rollout.decode", "rollout.join", "learner.apply"} <= set(progs)
    for p in progs.values():           # GPU buffers are unpadded: exact; jit drops unused args
        total = p["persistent_args"] + p["step_args"] + p["local_args"]
        if p["name"] in ("rollout.prefill", "rollout.decode", "rollout.join", "learner.apply"):
            assert p["argument"] == total, p
        assert 0.9 * total <= p["argument"] <= total, p
    n = TINY.num_params()
    pers = report["persistent"]
    assert pers["master_params"] == 4 * n and pers["rollout_params"] == 2 * n
    assert 8 * n <= pers["optimizer_state"] <= 8 * n + 64          # mu, nu (+ step counters)
    assert progs["learner.apply"]["argument"] == 4 * n + pers["optimizer_state"] + 4 * n
    # The decode's own arguments: the KV cache of one call (8 rows, 1 per device) + its buffers.
    rows, s_max, t = 8, 64 + 64, 64
    per_token = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * TINY.head_dim * 2
    cache = rows * s_max * per_token * (1 + 1 / 32) / 8            # + centroids, bf16, / 8
    # tokens, logprobs, budgets; no top-k: alpha_mode "full" reads none (record_topk 0)
    record = rows * t * (4 + 4 + 4)
    # The cache is row-sharded (8 x smaller than replicated); the prefill leaves the layout of
    # the record buffers to XLA, which may replicate them.
    local = progs["rollout.decode"]["local_args"]
    assert cache + record / 8 <= local <= cache + record + 4096, (local, cache, record)


def test_eight_way_data_parallel_rows_per_device(tiny):
    """v5e-8 (one host, 8 chips), mesh_model 1: every batch is split 8 ways."""
    report = _report(run_dryrun(tiny["gin"], "--target", "v5e-8", "--json", "--no_fit"))
    assert report["mesh"] == {"data": 8, "model": 1}
    s = report["shape"]
    assert (s["rows_step"], s["rows_call"], s["rollout_calls"]) == (16, 8, 2)
    assert s["rows_call_per_device"] == 1.0
    progs = {p["name"]: p for p in report["programs"]}
    assert progs["rollout.decode"]["rows_per_device"] == 1.0
    assert progs["learner.grads[fused analysis]"]["rows_per_device"] == 1.0   # micro 8 / 8
    assert report["toolchain"].startswith("libtpu")
    # The 1-step decode probe's cost analysis (skipped by --no_cost, as CI's shipped guard does).
    cost = report["cost_check"]
    assert cost["compiled_bytes"] > 0 and cost["probe_compile_s"] > 0, cost
    # Per decode step, what block selection costs beside the attention's K/V reads (issue 30),
    # for the one sparse layer (2 dense): both counted, the selection compiled for the target.
    sel = report["decode_step_bytes"]
    assert sel["sparse_layers"] == 1 and sel["max_selected"] == 4, sel
    assert sel["rows_per_device"] == 1 and sel["blocks_per_row"] == 8, sel
    assert sel["selection_sort_free"] > 0 and sel["selection_top_k_sort"] > 0, sel
    kv_token = 2 * TINY.num_key_value_heads * TINY.head_dim * 2          # bf16 K and V
    assert sel["attention_kv_at_max_budget"] == 1 * 4 * 16 * kv_token, sel
    assert "TPU v5 lite" in report["target_description"] or "V5E" in report["target_description"]


@pytest.mark.slow       # ~130 s loaded (~40 s alone): `launch/local.sh test --all`
def test_exact_sparse_paged_programs_compile_and_report_memory(tiny):
    """`TrainConfig.rollout_mode = "exact_sparse"` on the paged engine: the dryrun compiles the
    exact decode chunk (draft + verify rounds, rollout/paged_exact.py) for H100s, reports its
    memory, and the pool's per-sample maximum has gamma (4) slots of slack: 64 prompt + 63 fed
    + 4 = 131 tokens -> 9 pages of 16 (the sparse mode's 127 fit 8)."""
    r = run_dryrun(tiny["gin"], "--target", "h100x8", "--json", "--no_fit", "--no_cost",
                   *(x for p in ("TrainConfig.rollout_mode = 'exact_sparse'",
                                 "RolloutConfig.engine = 'paged'", "RolloutConfig.chunk_steps = 8",
                                 "RolloutConfig.pool_bytes = 1048576",
                                 "RolloutConfig.max_slots = 32") for x in ("--gin_param", p)))
    report = _report(r)
    assert r.returncode == 0 and report["fits"], r.stderr[-3000:]
    assert report["shape"]["rollout_mode"] == "exact_sparse"
    progs = {p["name"]: p for p in report["programs"]}
    decode = progs["rollout.paged_decode[exact_sparse]"]
    assert decode["error"] is None and decode["peak"] > report["paged_pool"]["bytes_per_device"]
    assert report["paged_pool"]["max_tokens_per_sample"] == 144


@pytest.mark.slow       # ~85 s: `launch/local.sh test --all`
def test_dryrun_counts_decode_kernels(tiny):
    """`--kernels` (GPU targets): the report counts the kernels of one decode step per dense
    layer, per sparse layer and outside (layer 0 dense, so the tiny model's 3 layers hold both
    kinds twice: compiled at 2 and 3 layers), and prints the line; a TPU target is refused."""
    r = run_dryrun(tiny["gin"], "--target", "h100x8", "--json", "--no_fit", "--no_cost",
                   "--kernels", "--gin_param", "RolloutConfig.dense_layers = (0,)")
    report = _report(r)
    assert r.returncode == 0, r.stderr[-3000:]
    k = report["decode_kernels"]
    assert k["layers"] == 3 and k["sparse_layers"] == 2 and k["flags"] == [], k
    assert k["per_dense_layer"] > 0 and k["per_sparse_layer"] > k["per_dense_layer"], k
    assert k["per_step"] == pytest.approx(
        k["outside"] + k["per_dense_layer"] + 2 * k["per_sparse_layer"]), k
    assert "pallas sparrow_select_pages_triton" in k["sparse_layer_kernels"], k
    line = kernel_census.format_line(k)
    assert line.startswith(f"decode step kernels: {k['per_dense_layer']} per dense layer"), line
    assert line in report_text.format_report(report).splitlines()
    r = run_dryrun(tiny["gin"], "--target", "v5e-8", "--kernels")
    assert r.returncode != 0 and "--kernels counts the kernels of a GPU decode step" in r.stderr


def test_model_axis_across_hosts_is_an_error(tiny):
    """v5p hosts have 4 chips: a model axis of 8 would span two hosts. Run from the plain venv:
    the command re-executes itself in the compile environment."""
    r = run_dryrun(tiny["gin"], "--target", "v5p-32", "--gin_param", "TrainConfig.mesh_model = 8",
                   compile_env=False)
    assert r.returncode != 0
    assert "re-running" in r.stderr
    assert re.search(r"mesh_model = 8 does not fit v5p-32 \(4 host\(s\) of 4", r.stderr), r.stderr
    assert "divides 4" in r.stderr


def test_missing_toolchain_names_the_install(tiny):
    r = run_dryrun(tiny["gin"], "--target", "v5e-8", compile_env=False,
                   env={"SPARROW_DRYRUN_CHILD": "1"})          # no re-exec: report instead
    assert r.returncode != 0
    assert "needs libtpu" in r.stderr and "bash .ci/compile_env.sh" in r.stderr


@pytest.mark.slow
@pytest.mark.guard      # the 8B guard compiles its rollout at 4 and 5 layers on this basis
def test_depth_extrapolation_equals_full_depth(tmp_path):
    """`--rollout_depth 3 --depth 4` on a 7-layer paged config: the rollout programs compiled at
    3 and 4 layers (the pool keeps the full model's pages), the learner's (gradients with the
    fused alpha replay, update) at 4 and 5, each extrapolated, give the full-depth compile's
    arguments and outputs to 1%, temporaries never under-estimated, the same step peak. CI's
    shipped-config guard relies on the rollout's; the learner's holds on this tiny model only
    (at Qwen3-0.6B's shapes the update's temporaries came out 22% low, docs/dryrun.md), so the
    guard compiles the learner at full depth."""
    seven = dataclasses.replace(TINY, num_hidden_layers=7)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(seven.to_hf_dict()))
    gin = tmp_path / "paged.gin"
    gin.write_text(GIN.format(model=tmp_path / "m") + "RolloutConfig.engine = 'paged'\n"
                   "RolloutConfig.chunk_steps = 8\nRolloutConfig.pool_bytes = 1048576\n"
                   "RolloutConfig.max_slots = 32\n")   # v5e-8: 8 data shards x group 4
    out = {}
    for name, extra in (("full", []), ("extrapolated", ["--rollout_depth", "3", "--depth", "4"])):
        r = subprocess.run(    # one after another: compiles side by side starve each other
            [sys.executable, "-m", "sparrow_jax.cli", "dryrun", str(gin), "--target", "v5e-8",
             "--json", "--no_fit", "--no_cost", *extra], cwd=tmp_path, env=dryrun_env(),
            capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = json.loads(r.stdout)
    full, est = ({p["name"]: p for p in out[k]["programs"]} for k in ("full", "extrapolated"))
    # One mini-batch: the alpha replay is fused into the gradient program (no separate analysis
    # compile, which CI time would pay three times).
    assert set(full) >= {"rollout.paged_decode", "learner.grads[fused analysis]",
                         "learner.apply"} and set(full) == set(est)
    assert out["extrapolated"]["depth"] == ("rollout compiled at 3 and 4 layers, extrapolated "
                                            "to 7; learner compiled at 4 and 5 layers, "
                                            "extrapolated to 7")
    assert out["full"]["paged_pool"] == out["extrapolated"]["paged_pool"]
    for name, p in full.items():
        for key in ("argument", "output", "temp", "peak"):
            got, want = est[name][key], p[key]
            if key in ("argument", "output"):
                assert abs(got - want) <= 0.01 * want + 4096, (name, key, got, want)
            else:
                # Temporaries: never under-estimated; on this tiny model the resume prefill's
                # were over-estimated by a third (at the 8B pod's shapes every rollout program
                # came within 1%, docs/dryrun.md).
                assert 0.99 * want - 4096 <= got <= 1.35 * want + 4096, (name, key, got, want)
    assert abs(out["extrapolated"]["peak_bytes"] - out["full"]["peak_bytes"]) <= \
        0.01 * out["full"]["peak_bytes"]


def test_oversized_does_not_fit(tiny):
    """1.2B parameters with f32 master weights + AdamW, replicated on 16 GiB v5e chips."""
    r = run_dryrun(tiny["gin"], "--target", "v5e-8", "--model_config", tiny["fat"], "--no_fit",
                   "--no_cost")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DOES NOT FIT" in r.stdout
    assert "FITS" not in r.stdout.replace("DOES NOT FIT", "")


def test_selection_line_says_which_form_runs_on_the_target():
    """On a GPU the rollout selects blocks with one Pallas Triton kernel, whose bytes XLA's cost
    analysis cannot count: the decode line says so instead of describing the XLA form."""
    from sparrow_jax.dryrun import selection_cost
    from sparrow_jax.dryrun.targets import TARGETS
    from sparrow_jax.rollout.config import RolloutConfig
    auto, xla = RolloutConfig(mode="sparse"), RolloutConfig(mode="sparse", selection="xla")
    assert selection_cost.selection_form(auto, TARGETS["h100x1"]) == "pallas_triton"
    assert selection_cost.selection_form(xla, TARGETS["h100x1"]) == "xla"
    assert selection_cost.selection_form(auto, TARGETS["v5e-8"]) == "xla"
    b = {"selection_sort_free": 2e6, "selection_top_k_sort": 3e6, "sparse_layers": 26,
         "attention_kv_at_max_budget": 5e8, "max_selected": 64}
    assert "one Pallas Triton kernel" in selection_cost.format_line(
        4, 512, b | {"selection_form": "pallas_triton"})
    line = selection_cost.format_line(4, 512, b | {"selection_form": "xla"})
    assert "selection 0.002 GB sort-free" in line and "Pallas" not in line
