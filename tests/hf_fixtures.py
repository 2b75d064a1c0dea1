"""Builds tiny random Qwen3 checkpoints with transformers + PyTorch (the independent reference)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def make_tiny_qwen3(path: Path, *, vocab=96, hidden=48, layers=3, heads=4, kv_heads=2,
                    head_dim=16, intermediate=80, tie=True, seed=0, dtype="float32"):
    """Saves a random Qwen3ForCausalLM to `path`; returns the torch model (eval mode)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie,
                      max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF init leaves norms at 1; randomise them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def make_tiny_synthetic_model(path: Path, *, hidden=32, intermediate=64, layers=3, heads=2,
                              kv_heads=1, head_dim=16, chat_template: str | None = None,
                              rope_theta: float = 10000.0, seed: int = 0):
    """A random Qwen3 with the synthetic task's word-level tokenizer, saved as an HF directory.

    Layers 0 and 1 stay dense in sparse rollouts, so 3 layers give one sparse layer.
    """
    from flax import nnx

    from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
    from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM, save_hf

    tok = build_synthetic_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True,
                      rope_theta=rope_theta, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=tok)
    return path


# -- tiny `sparrow train` runs ------------------------------------------------------------------
# The settings every tiny training test shares: a 3-layer random model with the synthetic
# tokenizer, 2 prompts x 2 samples per step, 40-token generations in 16-token length bins, the
# XLA kernels. Values are gin literals; a test overrides or adds bindings by name.
TINY_TRAIN = {
    "TrainConfig.reward": "'synthetic_exact'",
    "TrainConfig.reward_processes": "0",
    "TrainConfig.prompts_per_step": "2",
    "TrainConfig.group_size": "2",
    "TrainConfig.checkpoint_every": "2",
    "RolloutConfig.max_new_tokens": "40",
    "RolloutConfig.max_budget": "64",
    "RolloutConfig.backend": "'xla'",
    "make_schedule.budgets": str([48] * 20),
    "make_schedule.bin_size": "16",
    "ControllerConfig.min_budget": "48",
    "ControllerConfig.max_budget": "64",
    "LearnerConfig.learning_rate": "1e-3",
}


def make_tiny_run(root: Path, *, train_rows: int = 16, eval_rows: int = 4) -> Path:
    """root/model (random tiny Qwen3), root/train.jsonl and root/eval.jsonl (1-cycle synthetic
    tasks over 4 letters: ~40-token scratchpads); returns root."""
    from sparrow_jax.data import synthetic

    make_tiny_synthetic_model(root / "model")
    synthetic.write_jsonl(str(root / "train.jsonl"), train_rows, seed=0, k_range=(1, 1),
                          num_letters=4)
    if eval_rows:
        synthetic.write_jsonl(str(root / "eval.jsonl"), eval_rows, seed=1, k_range=(1, 1),
                              num_letters=4)
    return root


def tiny_train_bindings(root: Path, run: str | None = "run", steps: int | None = None,
                        **overrides: str) -> dict[str, str]:
    """TINY_TRAIN + the paths of `make_tiny_run(root)` (+ run_dir root/run, total_steps) +
    overrides given as `Config__field="gin literal"` (or None to drop a binding)."""
    binds = {"TrainConfig.model_path": repr(str(root / "model")),
             "TrainConfig.train_data": repr(str(root / "train.jsonl")), **TINY_TRAIN}
    if run is not None:
        binds["TrainConfig.run_dir"] = repr(str(root / run))
    if steps is not None:
        binds["TrainConfig.total_steps"] = str(steps)
    for key, value in overrides.items():
        name = key.replace("__", ".")
        if value is None:
            binds.pop(name, None)
        else:
            binds[name] = value
    return binds


def gin_argv(bindings: dict[str, str], extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`--gin_param 'k = v'` pairs for the `sparrow` CLI; `extra` are whole bindings."""
    out: list[str] = []
    for binding in [f"{k} = {v}" for k, v in bindings.items()] + list(extra):
        out += ["--gin_param", binding]
    return out


def gin_text(bindings: dict[str, str]) -> str:
    """The same bindings as a gin file."""
    return "".join(f"{k} = {v}\n" for k, v in bindings.items())


# -- processes ----------------------------------------------------------------------------------
def group_left(pgid: int, timeout: float = 20) -> list[int]:
    """Live (not zombie) processes of group `pgid` still there after `timeout` s: [] once every
    one is gone. Read from /proc: an orphaned zombie that no init reaps is not a process left."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                left.append(int(stat.parent.name))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# -- several CPU devices -----------------------------------------------------------------------
def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` host CPU devices, keeping the session's other
    flags (tests/conftest.py)."""
    import os
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def run_on_cpu_devices(args: list[str], *, devices: int = 8, timeout: float = 900,
                       cwd: str | None = None, env: dict[str, str] | None = None
                       ) -> list[dict]:
    """Runs `python ARGS` in a subprocess with `devices` host CPU devices (XLA_FLAGS must be set
    before jax is first imported, and this test process already imported jax with one device).
    Fails the test with the output tail on a non-zero exit; returns the JSON lines it printed."""
    import json
    import os
    import subprocess
    import sys

    full_env = {**os.environ, "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": cpu_devices_flags(devices), **(env or {})}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, (f"{' '.join(args)} failed on {devices} CPU devices:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (a multi-process run's coordinator)."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def require_compile_env(path: Path, timeout_s: float = 1800) -> None:
    """Fails the test unless the compile-only toolchains (`.ci/compile_env.sh`) are at `path`.

    `launch/local.sh test` installs them in the background while the tests that need none run
    (minutes of downloads, otherwise idle CPU): it names a file the installer writes its exit
    status to when done (SPARROW_COMPILE_ENV_DONE) and its log (SPARROW_COMPILE_ENV_LOG). A test
    that needs them waits for that file, then fails with the log's tail if the install failed.
    """
    import os
    import time

    import pytest

    done = os.environ.get("SPARROW_COMPILE_ENV_DONE")
    if done:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(done):
            if time.monotonic() > deadline:
                pytest.fail(f"the compile environment's install ran over {timeout_s:.0f} s "
                            f"(log: {os.environ.get('SPARROW_COMPILE_ENV_LOG')})")
            time.sleep(1.0)
        status = Path(done).read_text().strip()
        if status != "0":
            log = Path(os.environ.get("SPARROW_COMPILE_ENV_LOG", "/nonexistent"))
            tail = log.read_text()[-3000:] if log.is_file() else "(no log)"
            pytest.fail(f"installing the compile environment failed (exit {status}):\n{tail}")
    if not (path / ".sparrow-compile-env").exists():
        pytest.fail(f"compile environment missing at {path}: run `bash .ci/compile_env.sh` "
                    "(launch/local.sh test installs it)")


def make_sharp_tiny_model(path: Path):
    """The tiny Qwen3 (3 layers, vocab 96) with its q/k norms x3, loaded in f32: peaked attention,
    so a 3-block draft budget changes many greedy tokens and exact-sparse drafts get rejected (a
    random tiny model's sparse and dense decodes agree otherwise)."""
    import jax.numpy as jnp

    from sparrow_jax.model import load_hf

    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    model = load_hf(path, dtype=jnp.float32)
    for layer in model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.set_value(norm.weight.get_value() * 3.0)
    return model


# -- prompts and references shared by the rollout tests ----------------------------------------
def random_prompts(lengths, seed: int = 0, vocab: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded random prompts [B, max(lengths)] int32 (ids from 3: past pad/bos/eos) and
    their lengths [B]."""
    rng = np.random.default_rng(seed)
    toks = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        toks[i, :n] = rng.integers(3, vocab, n)
    return toks, np.asarray(lengths, np.int32)


def assert_greedy_matches_torch(traj, torch_model, toks, lens, new_tokens: int) -> None:
    """Each row's greedy tokens equal transformers' `generate` on the same prompt (no stop)."""
    import torch
    for i, n in enumerate(lens):
        with torch.no_grad():
            ref = torch_model.generate(torch.tensor(toks[i:i + 1, :n], dtype=torch.long),
                                       max_new_tokens=new_tokens, do_sample=False,
                                       eos_token_id=None, pad_token_id=0).numpy()[0, n:]
        assert np.asarray(traj.tokens[i]).tolist() == ref.tolist(), i


# -- several local processes (jax.distributed over 127.0.0.1) ---------------------------------
def start_workers(worker: Path, role: str, root: Path, nproc: int, *, devices: int = 4,
                  extra_args=(), extra_env: dict | None = None) -> tuple[list, list[Path]]:
    """Starts `nproc` copies of the script `worker` as one jax.distributed job on a free local
    port (argv: role root index nproc port *extra_args), each with `devices` CPU devices and
    its output in ROOT/<role>_<i>.log; returns (processes, log paths)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_devices_flags(devices),
           "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    port = free_port()
    logs = [root / f"{role}_{i}.log" for i in range(nproc)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), role, str(root), str(i), str(nproc), str(port),
                 *extra_args], env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def process_prompts(root: Path, pid: int, nproc: int) -> tuple[np.ndarray, np.ndarray]:
    """Process `pid`'s share of ROOT/prompts.npz (tokens, lengths): its rows, cut to its own
    longest prompt (processes pass ragged, differently wide prompt batches)."""
    prompts = np.load(root / "prompts.npz")
    per = prompts["tokens"].shape[0] // nproc
    mine = slice(pid * per, (pid + 1) * per)
    lengths = prompts["lengths"][mine]
    return prompts["tokens"][mine][:, : int(lengths.max())], lengths



def copies_of_shape(hlo: str, shape: tuple[int, ...]) -> int:
    """How many `copy` instructions in an optimised HLO text produce an array of `shape` (any
    dtype and layout): e.g. a KV cache or page pool copied instead of updated in place."""
    import re
    dims = ",".join(str(int(d)) for d in shape)
    return len(re.findall(rf"= [a-z0-9]+\[{dims}\]\{{[^}}]*\}} copy\(", hlo))


def spy_compiled_text(monkeypatch, module, name: str, out: list, shape_of) -> None:
    """Replaces `module.name` (a `*_program_for(cfg)` factory of a jitted program) so every
    program it returns also appends (its optimised HLO text, shape_of(args)) to `out` when
    called (compiled once more for the text: tests only)."""
    real = getattr(module, name)

    def factory(cfg):
        program = real(cfg)

        def call(*args, **kwargs):
            out.append((program.lower(*args, **kwargs).compile().as_text(), shape_of(args)))
            return program(*args, **kwargs)
        return call
    monkeypatch.setattr(module, name, factory)
