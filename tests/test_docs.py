"""The commands shown in README.md and docs/*.md work, and the console stays quiet.

Every command line in a fenced ``bash`` / ``sh`` / ``console`` block of README.md and docs/*.md
must be registered in COMMANDS below with how it is checked:

  Run()          the command itself runs, verbatim (cheap ones; in a temporary directory);
  Twin(name)     a CPU-sized twin: the same entry point with small arguments (test_twin[name]);
  ByTest(id)     an existing test runs it; the id is verified by collecting it with pytest;
  Hardware()     needs a GPU node or a TPU pod, which tests do not have. Checked honestly
                 without it: `bash -n` on the launcher, the files it names exist, and the gin
                 config it starts `sparrow train` with parses with the overrides shown (the
                 translation to `sparrow train` is checked against the launcher's own text).
                 Whether the job then runs on the hardware is NOT tested;
  CI()           the CI entry point itself (`.ci/run` is exactly `launch/local.sh test`);
  Usage()        a synopsis with placeholders: every --flag it names exists in the real parser
                 (paired with a ByTest that runs the command);
  OnPendingPage  marks a command of a page another change is adding: excused while that page
                 does not exist yet, checked like any other once it does.

On top of that, every `sparrow ...` command (also when started through a launcher) is parsed by
the real argument parser and its gin files + `--gin_param` overrides by gin, so a renamed flag
or setting fails here even when the command is too big to run. An unregistered command in the
docs fails, and so does a registry entry no doc shows. A block checked by anything but Run()
must be followed by a note that says so: "(CPU twin in tests: ...)", "(Checked in tests: ...)"
or "(Run in tests: ...)" - or, for commands only an existing test runs, the page names that
test's file. README.md carries no such notes (it stays a five-minute read): each command it shows
must also be shown on a docs/ page, where the note is required.

The console test reuses the demo twin's output: the default log level prints no orbax / absl /
jax INFO lines, one line per checkpoint saved; `--log_level DEBUG` brings them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gin
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "docs" / "devices").glob("*.md"))]
# Pages other engineers are writing now: links to them may dangle, and their CLI subcommands may
# be missing from sparrow_jax.cli, until they land. Once a page/command exists it is checked.
PENDING_PAGES: set[str] = set()
PENDING_SUBCOMMANDS: set[str] = set()
NOTE = re.compile(r"\((?:CPU twins? in tests|Checked in tests|Run in tests)\b", re.IGNORECASE)


# -- extraction ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DocCommand:
    file: str          # relative to the repo
    line: int          # 1-based line of the command's first line
    text: str          # normalized: shlex tokens, comments dropped, re-joined


def normalize(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


def _blocks(path: Path):
    """(lang, first body line index, body lines, index after the closing fence) per fence."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith("```"):
            j += 1
        yield m.group(1).lower(), i + 1, lines[i + 1:j], j + 1
        i = j + 1


def doc_commands(path: Path) -> list[tuple[DocCommand, int]]:
    """Commands of `path`'s bash/sh/console blocks, each with the index of its block's end."""
    rel = str(path.relative_to(REPO))
    out = []
    for lang, start, body, end in _blocks(path):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        buf, first = "", None
        for k, raw in enumerate(body):
            line = raw
            if lang == "console":
                if not line.startswith("$ ") and not buf:
                    continue  # program output
                line = line[2:] if not buf else line
            first = start + k if first is None else first
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            buf += line
            text = normalize(buf)
            if text:
                out.append((DocCommand(rel, first + 1, text), end))
            buf, first = "", None
    return out


def all_doc_commands() -> list[DocCommand]:
    return [c for path in DOCS for c, _ in doc_commands(path)]


# -- the registry -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
    pass


@dataclasses.dataclass(frozen=True)
class Twin:
    name: str


@dataclasses.dataclass(frozen=True)
class ByTest:
    nodeid: str


@dataclasses.dataclass(frozen=True)
class Hardware:
    pass


@dataclasses.dataclass(frozen=True)
class CI:
    pass


@dataclasses.dataclass(frozen=True)
class OnPendingPage:
    """The command is shown on a page another change is adding (PENDING_PAGES). Until that page
    exists the entry may be stale and its tests may be missing; once it exists, nothing is
    excused."""
    page: str

    def waiting(self) -> bool:
        return not (REPO / self.page).exists()


@dataclasses.dataclass(frozen=True)
class Usage:
    """A synopsis with placeholders (`sparrow export RUN_DIR [--step N] ...`): not runnable as
    written; every `--flag` it names must be an option of that subcommand's real parser."""


_ROLLOUT_BENCH = "sparrow bench rollout -- --json "
_DISTILL_TRAIN = ByTest("tests/test_distill.py::test_train_with_adapter_logs_checkpoints_resumes_and_exports")
_DISTILL_DEMO = ("launch/local.sh demo --gin_param 'TrainConfig.total_steps = 12' --gin_param 'TrainConfig.eval_every = 12' --gin_param 'TrainConfig.adapt_schedule = False' --gin_param 'make_schedule.budgets = [64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64]' ")
_REGISTRY = {
    # README.md, docs/training.md, docs/benchmarks.md
    "launch/local.sh demo": (Twin("demo"),),
    "launch/local.sh demo --gin_param 'TrainConfig.total_steps = 40'": (Twin("demo"),),
    "launch/local.sh sparrow --log_level DEBUG train configs/demo_cpu.gin": (Twin("demo_debug"),),
    # README.md, docs/testing.md
    "launch/local.sh test": (CI(), Twin("local_test")),
    "launch/local.sh test tests/test_rollout.py -x": (Twin("local_test"),),
    "launch/local.sh test tests/test_multihost_paged.py -s":
        (ByTest("tests/test_multihost_paged.py::test_two_process_paged_rollout_equals_one_process"),),
    "launch/local.sh test -m 'not slow'": (Twin("local_test"),),
    "launch/local.sh test --all":
        (ByTest("tests/test_docs.py::test_default_test_selection_skips_slow_tests_but_never_a_guard"),),
    "bash .ci/run": (CI(),),
    # README.md, docs/training.md: real hardware
    "launch/gpu.sh configs/qwen3_1p7b_gpu.gin "
    "--gin_param 'TrainConfig.model_path = \"/models/Qwen3-1.7B\"'": (Hardware(),),
    "launch/tpu_pod.sh my-v5p-32 us-east5-a configs/qwen3_8b_tpu.gin":
        (Hardware(), ByTest("tests/test_launch.py::test_tpu_pod_copies_tracked_files_and_starts_detached")),
    # README.md (Train a real model: install, doctor, data check, dryrun, train), docs/kernels.md,
    # docs/data.md
    "SPARROW_INSTALL_ONLY=1 launch/gpu.sh":
        (Hardware(), ByTest("tests/test_launch.py::test_install_only_stops_after_the_check"),
         ByTest("tests/test_launch.py::test_python_310_stops_with_one_clear_line"),
         ByTest("tests/test_launch.py::test_driver_version_selects_the_cuda_extra"),
         ByTest("tests/test_launch.py::test_jax_on_cpu_or_missing_gpus_stops_the_gpu_launcher")),
    "sparrow doctor":
        (ByTest("tests/test_doctor.py::test_doctor_passes_on_cpu"),
         ByTest("tests/test_doctor.py::test_doctor_fails_loudly_on_a_broken_kernel")),
    "sparrow data check /data/dapo_math_17k.parquet configs/qwen3_1p7b_gpu.gin "
    "--model /models/Qwen3-1.7B":
        (ByTest("tests/test_data_formats.py::test_data_check_good_and_bad_files"),),
    "COORDINATOR=node0:1234 NUM_NODES=2 NODE_RANK=0 launch/gpu.sh configs/qwen3_1p7b_gpu.gin":
        (Hardware(),),
    "COORDINATOR=node0:1234 NUM_NODES=2 NODE_RANK=1 launch/gpu.sh configs/qwen3_1p7b_gpu.gin":
        (Hardware(),),
    # docs/rollout.md
    "sparrow rollout --model /ckpt/Qwen3-1.7B --prompts prompts.jsonl --out samples.jsonl "
    "--schedule qwen3-1.7b-0.86 --group_size 8 --batch_size 4 --seed 0 "
    "--gin_param 'RolloutConfig.max_new_tokens = 8192'":
        (Twin("rollout"), ByTest("tests/test_rollout_cli.py::test_sparse_rollout_writes_one_row_per_sample")),
    # docs/mismatch.md
    "sparrow calibrate configs/calibrate_demo.gin":
        (ByTest("tests/test_calibrate.py::test_calibrate_end_to_end"),),
    "sparrow calibrate --model ckpt/ --prompts prompts.jsonl --out runs/cal "
    "--budgets 512 768 1024 1536 2048 3072 4096 --target 0.86 "
    "--gin_param 'RolloutConfig.max_budget = 4096'":
        (ByTest("tests/test_calibrate.py::test_calibrate_end_to_end"),
         ByTest("tests/test_calibrate.py::test_config_errors")),
    # docs/kernels.md
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m pallas_kernels.compile_check --targets tpu,cuda,jax_triton":
        (ByTest("tests/test_compile.py::test_real_compile"),),
    # docs/checkpoints.md, docs/data.md
    "launch/make_demo_checkpoint.sh":
        (Hardware(), ByTest("tests/test_sft.py::test_sft_command_writes_checkpoint")),
    "launch/local.sh sparrow sft configs/sft_demo.gin "
    "--gin_param 'SFTConfig.output_dir = \"runs/my_sft\"'":
        (ByTest("tests/test_sft.py::test_sft_command_writes_checkpoint"),),
    "python -m sparrow_jax.data.synthetic train.jsonl --n 512 --k-min 8 --k-max 13": (Run(),),
    # docs/benchmarks.md
    # docs/dryrun.md
    "sparrow dryrun configs/qwen3_8b_tpu.gin --target v5p-32 --preset qwen3-8b":
        (ByTest("tests/test_dryrun.py::test_argument_bytes_are_the_sharded_shapes"),
         ByTest("tests/test_dryrun.py::test_oversized_does_not_fit"),
         ByTest("tests/test_shipped_configs.py::test_shipped_configs_fit"),
         ByTest("tests/test_shipped_configs.py::test_every_real_config_names_its_target")),
    "sparrow dryrun configs/qwen3_1p7b_gpu.gin --target h100x8 --preset qwen3-1.7b --no_fit "
    "--no_cost --gin_param 'TrainConfig.rollout_mode = \"exact_sparse\"'":
        (ByTest("tests/test_dryrun.py::"
                "test_exact_sparse_paged_programs_compile_and_report_memory"),),
    "sparrow dryrun configs/qwen3_1p7b_gpu.gin --target h100x8 --preset qwen3-1.7b --no_fit "
    "--no_cost --kernels":
        (ByTest("tests/test_dryrun.py::test_dryrun_counts_decode_kernels"),
         ByTest("tests/test_decode_hlo.py::test_decode_step_kernels_do_not_grow")),
    # docs/devices/README.md: the train_real stage's settings on one H100
    "sparrow dryrun configs/qwen3_1p7b_gpu.gin --target h100x1 --preset qwen3-1.7b --no_cost "
    "--gin_param \"TrainConfig.prompts_per_step = 8\" --gin_param \"RolloutConfig.max_new_tokens = 4096\" "
    "--gin_param \"LearnerConfig.ppo_mini_batch_size = 0\" --gin_param \"TrainConfig.eval_data = ''\" "
    "--gin_param \"PromptFormat.use_chat_template = False\"":
        (ByTest("tests/test_shipped_configs.py::test_shipped_configs_fit"),
         ByTest("tests/test_config_smoke.py::test_overrides_bind_on_every_shipped_config")),
    # README.md (Train a real model)
    "sparrow dryrun configs/qwen3_1p7b_gpu.gin --target h100x8 --preset qwen3-1.7b":
        (ByTest("tests/test_shipped_configs.py::test_shipped_configs_fit"),),
    # docs/distill.md
    "launch/local.sh demo --gin_param 'DistillConfig.rank = 8'": (_DISTILL_TRAIN,),
    _DISTILL_DEMO + "--gin_param 'TrainConfig.run_dir = \"/tmp/distill_demo/base\"'":
        (Twin("demo"), _DISTILL_TRAIN),
    _DISTILL_DEMO + "--gin_param 'TrainConfig.run_dir = \"/tmp/distill_demo/lora\"' "
    "--gin_param 'DistillConfig.rank = 8' --gin_param 'DistillConfig.use_schedule = True'":
        (Twin("demo"), _DISTILL_TRAIN),
    # docs/evaluation.md, README.md: `sparrow eval` (tests/test_eval_command.py runs it on a tiny
    # model and on the demo checkpoint; the AIME command needs a GPU node and the data)
    "sparrow eval /models/Qwen3-1.7B /data/aime2024.parquet configs/qwen3_1p7b_gpu.gin --out "
    "runs/eval_aime24 --n 32 --k 1,8,32 --temperature 0.6 --top_p 0.95 --top_k 20 "
    "--max_new_tokens 38912":
        (ByTest("tests/test_eval_command.py::test_resume_after_kill_gives_identical_eval_json"),
         ByTest("tests/test_eval_command.py::test_demo_checkpoint_on_verl_parquet")),
    "sparrow eval checkpoints/demo_sft data/demo/eval.jsonl --out runs/eval_demo --n 8 --k 1,4,8 "
    "--max_new_tokens 1072 --scorer synthetic_exact":
        (ByTest("tests/test_eval_command.py::test_demo_checkpoint_on_verl_parquet"),),
    # docs/benchmarks.md: the sparsity-aware warm-up step
    "python -m sparrow_jax.bench.sft_step --model checkpoints/long_sft --steps 2":
        (ByTest("tests/test_sft.py::test_bench_sft_step_times_dense_and_sparse_steps"),),
    # docs/compression.md
    "python -m sparrow_jax.bench.compress":
        (ByTest("tests/test_compression.py::test_bench_command_prints_table"),),
    # docs/export.md (written with `sparrow export`; its tests are tests/test_export.py)
    "sparrow export RUN_DIR [--step N] --out DIR [--dtype float32|bfloat16] [--model_path BASE] "
    "[--overwrite]":
        (Usage(), OnPendingPage("docs/export.md"),
         ByTest("tests/test_export.py::test_export_matches_checkpoint_in_transformers_and_load_hf"),
         ByTest("tests/test_export.py::test_export_bfloat16_writes_bf16_tensors"),
         ByTest("tests/test_export.py::test_export_errors")),
    # docs/experiment.md
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_demo.gin "
    "configs/experiment_distill.gin":
        (ByTest("tests/test_experiment.py::test_distill_experiment_config_shares_the_controller_arm"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_demo.gin "
    "configs/experiment_replicate.gin":
        (ByTest("tests/test_experiment.py::test_replicate_experiment_config_adds_seeded_arms"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    "python -m sparrow_jax.data.synthetic data/demo/heldout64.jsonl --n 64 --seed 3 --k-min 10 "
    "--k-max 13": (Run(),),
    # docs/training.md: the demo's 128-prompt reference set (ReferenceEvalConfig.data)
    "python -m sparrow_jax.data.synthetic data/demo/heldout128.jsonl --n 128 --seed 5 --k-min 10 "
    "--k-max 13": (Run(),),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_paired.gin":
        (ByTest("tests/test_experiment_paired.py::test_paired_experiment_config_parses_every_arm"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_paired.gin --arms "
    "dense@0,controller@0,dense@1,controller@1,dense@2,controller@2 --gin_param "
    "\"ExperimentConfig.output_dir = 'runs/experiment_m025'\"":
        (ByTest("tests/test_experiment_paired.py::test_paired_experiment_config_parses_every_arm"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    # docs/experiment.md: the pre-registered experiment of issue 41
    "launch/local.sh sparrow calibrate configs/calibrate_demo.gin configs/controller_certified.gin "
    "--gin_param 'CalibrateConfig.output_dir = \"runs/calibrate_promise\"'":
        (ByTest("tests/test_calibrate.py::test_calibrate_end_to_end"),
         ByTest("tests/test_certified_calibration.py::test_certified_by_the_controllers_own_rule")),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/controller_certified.gin "
    "configs/experiment_promise.gin":
        (ByTest("tests/test_prereg.py::test_the_registered_config_parses_every_arm"),
         ByTest("tests/test_prereg.py::test_the_experiment_runner_writes_the_registered_report"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/controller_certified.gin "
    "configs/experiment_promise.gin --arms dense@11,controller@11,M@11 --gin_param "
    "\"ExperimentConfig.output_dir = 'runs/experiment_promise_reduced'\"":
        (ByTest("tests/test_prereg.py::test_the_registered_config_parses_every_arm"),
         ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume")),
    # docs/benchmarks.md: the long-context task's own model (issue 41)
    _ROLLOUT_BENCH + "--layers 4 --hidden 128 --heads 4 --kv_heads 2 --head_dim 32 "
    "--intermediate 384 --vocab 48 --context 2048 4608 --budget 256 512 --batch 32 "
    "--new_tokens 32 --repeats 3 --dense_layers 0 0,1 --dtype float32": (Twin("bench_rollout"),),
    # docs/experiment.md, docs/checkpoints.md: the long-context task (issue 41)
    "python -m sparrow_jax.data.synthetic data/long/heldout64.jsonl --n 64 --seed 33 --k-min 50 "
    "--k-max 55": (Run(),),
    "launch/make_long_checkpoint.sh":
        (Hardware(), ByTest("tests/test_sft.py::test_sft_command_writes_checkpoint"),
         ByTest("tests/test_sft.py::test_long_warmup_never_draws_the_long_task_prompts")),
    "launch/local.sh sparrow calibrate configs/calibrate_long.gin configs/controller_certified.gin":
        (ByTest("tests/test_calibrate.py::test_calibrate_end_to_end"),
         ByTest("tests/test_certified_calibration.py::test_certified_by_the_controllers_own_rule")),
    "launch/local.sh sparrow train configs/demo_long.gin": (Twin("demo_long"),),
    "launch/local.sh sparrow train configs/demo_long.gin --gin_param \"TrainConfig.total_steps = 2\" "
    "--gin_param \"TrainConfig.eval_every = 2\" --gin_param \"TrainConfig.checkpoint_every = 2\"":
        (Twin("demo_long"),),
    "launch/local.sh sparrow sft configs/sft_long.gin --gin_param \"SFTConfig.output_dir = "
    "'runs/long_sft2'\" --gin_param \"SFTConfig.init_from = 'checkpoints/long_sft'\" --gin_param "
    "\"SFTConfig.crop_steps = 0\" --gin_param \"SFTConfig.long_steps = 60\" --gin_param "
    "\"SFTConfig.learning_rate = 3e-4\" --gin_param \"SFTConfig.warmup_steps = 5\" --gin_param "
    "\"SFTConfig.seed = 22\" --gin_param \"SFTConfig.eval_problems = 4\"":
        (ByTest("tests/test_sft.py::test_sft_command_writes_checkpoint"),),
    # docs/experiment.md: the sparsity-aware warm-up, its control and its calibration (issue 41)
    "launch/local.sh sparrow sft configs/sft_long.gin configs/sft_long_sparse.gin --gin_param "
    "\"SFTConfig.output_dir = 'runs/long_sparse_sft'\"":
        (ByTest("tests/test_sft.py::test_sparse_warmup_configs_parse"),
         ByTest("tests/test_sft.py::test_sparse_loss_adds_the_block_sparse_forwards_cross_entropy")),
    "launch/local.sh sparrow sft configs/sft_long.gin configs/sft_long_sparse.gin --gin_param "
    "\"SFTConfig.output_dir = 'runs/long_dense_sft_control'\" --gin_param "
    "\"SFTConfig.sparse_loss_coef = 0.0\"":
        (ByTest("tests/test_sft.py::test_sparse_warmup_configs_parse"),),
    "launch/local.sh sparrow sft configs/sft_long.gin configs/sft_long_sparse.gin --gin_param "
    "\"SFTConfig.output_dir = 'runs/long_sparse1_sft'\" --gin_param \"SFTConfig.init_from = "
    "'runs/long_sparse_sft'\" --gin_param \"SFTConfig.sparse_dense_layers = (0,)\" --gin_param "
    "\"SFTConfig.long_steps = 40\" --gin_param \"SFTConfig.seed = 23\"":
        (ByTest("tests/test_sft.py::test_sparse_warmup_configs_parse"),
         ByTest("tests/test_sft.py::test_long_warmup_never_draws_the_long_task_prompts")),
    "python -m sparrow_jax.bench.selection_quality --model runs/long_sparse1_sft --rows 16 "
    "--budgets 128 256 512 --scorers centroid --dense_layers 0,1 0":
        (ByTest("tests/test_selection_quality.py::test_documented_command_parses"),),
    "launch/local.sh sparrow sft configs/sft_long.gin configs/sft_long_sparse.gin --gin_param "
    "\"SFTConfig.output_dir = 'runs/long_sparse2_sft'\" --gin_param \"SFTConfig.init_from = "
    "'runs/long_sparse_sft'\" --gin_param \"SFTConfig.sparse_dense_layers = (0,)\" --gin_param "
    "\"SFTConfig.long_steps = 40\" --gin_param \"SFTConfig.sparse_loss_coef = 0.5\" --gin_param "
    "\"SFTConfig.seed = 24\"":
        (ByTest("tests/test_sft.py::test_sparse_warmup_configs_parse"),
         ByTest("tests/test_sft.py::test_long_warmup_never_draws_the_long_task_prompts")),
    "python -m sparrow_jax.bench.selection_quality --model runs/long_sparse2_sft --rows 16 "
    "--budgets 128 256 512 --scorers centroid --dense_layers 0,1 0":
        (ByTest("tests/test_selection_quality.py::test_documented_command_parses"),),
    "python -m sparrow_jax.bench.selection_quality --model runs/long_sparse_sft --rows 16 "
    "--budgets 256 --scorers centroid --dense_layers 0,1":
        (ByTest("tests/test_selection_quality.py::test_documented_command_parses"),),
    "launch/local.sh sparrow calibrate configs/calibrate_long.gin configs/controller_certified.gin "
    "--gin_param \"CalibrateConfig.model_path = 'runs/long_sparse_sft'\" --gin_param "
    "\"CalibrateConfig.output_dir = 'runs/calibrate_long_sparse'\"":
        (ByTest("tests/test_calibrate.py::test_calibrate_end_to_end"),
         ByTest("tests/test_certified_calibration.py::test_certified_by_the_controllers_own_rule")),
    # docs/benchmarks.md: the long-context shape of issue 41
    _ROLLOUT_BENCH + "--layers 8 --hidden 128 --heads 4 --kv_heads 4 --head_dim 64 "
    "--intermediate 256 --vocab 43 --context 4096 8192 --budget 256 512 --batch 8 "
    "--new_tokens 32 --repeats 3 --dense_layers 0,1 --dtype float32": (Twin("bench_rollout"),),
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_demo.gin":
        (ByTest("tests/test_experiment.py::test_two_arms_write_comparison_and_resume"),
         ByTest("tests/test_experiment.py::test_demo_experiment_config_parses_every_arm")),
    "python -m sparrow_jax.bench.kernels": (Twin("bench_kernel"),),
    # docs/benchmarks.md: sort-free block selection (issue 30)
    "python -m sparrow_jax.bench.kernels --selection --batch 8": (Twin("bench_selection"),),
    _ROLLOUT_BENCH + "--context 8192 16384 --budget 1024 --batch 16 --new_tokens 64 --repeats 3 "
    "--before": (Twin("bench_rollout"),
                 ByTest("tests/test_record_topk.py::test_bench_rollout_before_and_after")),
    # docs/dryrun.md, docs/benchmarks.md: what the decode program lowers to on H100 / v5p
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m sparrow_jax.dryrun.hlo $REPO/configs/qwen3_1p7b_gpu.gin --target h100x8 "
    "--preset qwen3-1.7b --layers 3":
        (ByTest("tests/test_decode_hlo.py::test_paged_decode_has_no_sort_or_large_topk"),),
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m sparrow_jax.dryrun.hlo $REPO/configs/qwen3_1p7b_gpu.gin --target v5p-8 "
    "--preset qwen3-1.7b --layers 3":
        (ByTest("tests/test_decode_hlo.py::test_paged_decode_has_no_sort_or_large_topk"),),
    # docs/benchmarks.md: kernels per decode step (issue 55)
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m sparrow_jax.dryrun.hlo $REPO/configs/qwen3_1p7b_gpu.gin --target h100x8 "
    "--preset qwen3-1.7b --no_bytes --json":
        (ByTest("tests/test_decode_hlo.py::test_decode_step_kernels_do_not_grow"),),
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m sparrow_jax.dryrun.hlo $REPO/configs/qwen3_1p7b_gpu.gin --target h100x8 "
    "--preset qwen3-1.7b --no_bytes --json --gin_param 'TrainConfig.rollout_mode = \"dense\"'":
        (ByTest("tests/test_decode_hlo.py::test_decode_step_kernels_do_not_grow"),),
    _ROLLOUT_BENCH + "--context 8192 16384 --budget 1024 --dense_layers 0,1 none --batch 16 "
    "--new_tokens 256 --repeats 3": (Twin("bench_rollout"),),
    _ROLLOUT_BENCH + "--layers 28 --context 8192 16384 --budget 1024 --dense_layers 0,1 none "
    "--batch 4 --new_tokens 128 --repeats 3": (Twin("bench_rollout"),),
    _ROLLOUT_BENCH + "--context 8192 16384 --budget 1024 --dense_layers 0,1 none --batch 64 "
    "--new_tokens 64 --repeats 3": (Twin("bench_rollout"),),
    _ROLLOUT_BENCH + "--layers 28 --context 8192 --budget 1024 --dense_layers 0,1 none "
    "--batch 16 --new_tokens 64 --repeats 3": (Twin("bench_rollout"),),
    # docs/benchmarks.md, docs/devices/: the first GPU (H200, 2026-11-27)
    "launch/device_check.sh":
        (Hardware(), ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report")),
    "PYTHON=/usr/bin/python3 launch/device_check.sh --out OUT":
        (Hardware(), ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report")),
    _ROLLOUT_BENCH + "--preset qwen3-1.7b --dtype bfloat16 --context 8192 32768 --new_tokens 16 "
    "--repeats 2 --profile prof": (Twin("bench_rollout"),),
    # docs/devices/2026-11-28-nvidia-h200.md: the decode step at RL-like batches
    _ROLLOUT_BENCH + "--preset qwen3-1.7b --dtype bfloat16 --new_tokens 64 --repeats 2 "
    "--context 8192 --batch 32": (Twin("bench_rollout"),),
    _ROLLOUT_BENCH + "--preset qwen3-1.7b --dtype bfloat16 --new_tokens 64 --repeats 2 "
    "--context 32768 --batch 16": (Twin("bench_rollout"),),
    "python -m sparrow_jax.bench.xplane prof/8192-dense prof/8192-sparse_1024_0_1 "
    "prof/32768-dense prof/32768-sparse_1024_0_1":
        (ByTest("tests/test_docs.py::test_twin_bench_rollout"),
         ByTest("tests/test_xplane.py::test_breakdown_attributes_kernels_to_decode_phases_on_gpu_and_cpu")),
    "python -m sparrow_jax.bench.kernels --json --contexts 8192,32768 --models 1.7b "
    "--budgets 1024,2048": (Twin("bench_kernel"),),
    # docs/benchmarks.md, docs/devices/README.md: the bytes limit, gpu_limit (issue 55)
    _ROLLOUT_BENCH + "configs/qwen3_1p7b_gpu.gin --preset qwen3-1.7b --dtype bfloat16 "
    "--engine paged --schedule config --context 8192 32768 --batch 32 8 --new_tokens 65 "
    "--repeats 2":
        (ByTest("tests/test_bench_tools.py::test_bench_rollout_paged_engine_beside_its_bytes_limit"),
         ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report")),
    "sparrow bench kernel -- --json --contexts 8192,32768 --budgets 2048,4096 --models 1.7b "
    "--backend pallas_triton,jax_triton":
        (ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report"),),
    _ROLLOUT_BENCH + "configs/qwen3_1p7b_gpu.gin --preset qwen3-1.7b --dtype bfloat16 "
    "--workload rl --samples 32 --group 8 --prompt_len 2048 --mean_len 256 --new_tokens 1024 "
    "--repeats 1 --gin_param 'RolloutConfig.min_slots = 32'":
        (ByTest("tests/test_bench_tools.py::test_bench_rollout_rl_workload"),
         ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report")),
    "sparrow bench step configs/qwen3_1p7b_gpu.gin --preset qwen3-1.7b --layers 4 --steps 2 "
    "--prompts 2 --new_tokens 1024 --json":
        (ByTest("tests/test_config_smoke.py::"
                "test_bench_step_puts_dense_and_sparse_steps_side_by_side"),),
    "launch/device_check.sh --only gpu_limit":
        (Hardware(), ByTest("tests/test_device_check.py::test_quick_device_check_writes_its_report"),
         ByTest("tests/test_device_check.py::test_only_a_group_runs_its_stages"),
         ByTest("tests/test_device_check.py::test_the_stated_timeouts_are_the_stages_own")),
    # docs/devices/README.md: the fused decode's compile settings and the exact round (55, 57)
    "launch/device_check.sh --only decode_options":
        (Hardware(), ByTest("tests/test_device_check.py::"
                            "test_the_decode_options_and_exact_groups_each_fit_one_call"),),
    "launch/device_check.sh --only exact_gpu":
        (Hardware(), ByTest("tests/test_device_check.py::"
                            "test_the_decode_options_and_exact_groups_each_fit_one_call"),),
    # docs/devices/README.md, docs/experiment.md: the promise in one GPU call (issue 56)
    "launch/device_check.sh --only promise":
        (Hardware(), ByTest("tests/test_promise.py::test_the_cpu_twin_runs_end_to_end_and_two_runs_pool"),
         ByTest("tests/test_promise.py::test_the_promise_stage_runs_only_when_asked"),
         ByTest("tests/test_promise.py::test_the_time_plan_fits_one_nine_minute_call")),
    "sparrow promise configs/experiment_promise_gpu.gin --out DIR":
        (ByTest("tests/test_promise.py::test_the_cpu_twin_runs_end_to_end_and_two_runs_pool"),),
    "sparrow promise configs/experiment_promise_gpu.gin --plan":
        (ByTest("tests/test_promise.py::test_the_time_plan_fits_one_nine_minute_call"),),
    # docs/devices/README.md: a shipped config at its model's shape on random weights
    "python -m sparrow_jax.tools.config_smoke configs/qwen3_1p7b_gpu.gin --preset qwen3-1.7b":
        (ByTest("tests/test_config_smoke.py::test_the_gpu_config_runs_a_step_on_a_random_tiny_model"),),
    "cd /tmp && JAX_PLATFORMS=cpu PYTHONPATH=$REPO/.compile-env:$REPO $REPO/.venv/bin/python "
    "-m sparrow_jax.dryrun.hlo $REPO/configs/qwen3_1p7b_gpu.gin --target h100x1 "
    "--preset qwen3-1.7b --no_bytes --json --gin_param \"RolloutConfig.selection = 'xla'\"":
        (ByTest("tests/test_decode_hlo.py::test_paged_decode_has_no_sort_or_large_topk"),),
    "python -m sparrow_jax.bench.kernel_sweep --json":
        (ByTest("tests/test_bench_tools.py::test_kernel_sweep_times_each_setting_and_marks_the_default"),),
    # docs/benchmarks.md: dense vs approximate vs exact sparse rollout (issue 42)
    _ROLLOUT_BENCH + "--workload exact --context 8192 16384 32768 --budget 1024 --gamma 4 "
    "--dense_layers none 0,1 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 8192 16384 --budget 1024 --gamma 2 4 "
    "--dense_layers none --batch 4 --new_tokens 64 --repeats 3 --before":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 8192 16384 --budget 1024 --gamma 1 2 4 "
    "--dense_layers none --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 32768 --budget 1024 --gamma 1 2 "
    "--dense_layers none 0,1 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 16384 --budget 1024 --gamma 1 2 "
    "--dense_layers none --batch 16 --new_tokens 64 --repeats 2":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    # docs/benchmarks.md: exact sparse at the shipped configs' dense-layer fraction (issue 57)
    _ROLLOUT_BENCH + "--workload exact --layers 14 --context 8192 16384 --budget 1024 --gamma 2 4 "
    "--dense_layers 0 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --layers 14 --context 32768 --budget 1024 --gamma 2 4 "
    "--dense_layers 0 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    # docs/benchmarks.md: the planner against measured speed, 8K-32K (issue 57)
    _ROLLOUT_BENCH + "--workload exact --context 8192 16384 --budget 1024 --gamma 1 2 "
    "--dense_layers 0,1 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 32768 --budget 1024 --gamma 1 2 "
    "--dense_layers 0,1 --batch 4 --new_tokens 64 --repeats 3":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    # docs/benchmarks.md: verify-guided drafts on the long-task checkpoint (issue 57)
    "python -m sparrow_jax.bench.acceptance --model checkpoints/long_sft --prompts "
    "data/long/eval.jsonl --num_prompts 4 --samples 4 --budgets 64 128 --gamma 4 --bin_size 512 "
    "--max_new_tokens 4464 --dense_layers none --draft_scorer centroid verify":
        (ByTest("tests/test_exact_sparse.py::test_acceptance_bench_on_demo_model"),),
    "python -m sparrow_jax.bench.acceptance --model checkpoints/long_sft --prompts "
    "data/long/eval.jsonl --num_prompts 4 --samples 4 --budgets 256 --gamma 4 --bin_size 512 "
    "--max_new_tokens 4464 --dense_layers 0,1 --draft_scorer centroid verify":
        (ByTest("tests/test_exact_sparse.py::test_acceptance_bench_on_demo_model"),),
    _ROLLOUT_BENCH + "--workload exact --context 16384 --budget 1024 --gamma 2 "
    "--dense_layers none --batch 4 --new_tokens 64 --repeats 3 --gin_param "
    "\"RolloutConfig.draft_scorer = 'centroid'\"":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    _ROLLOUT_BENCH + "--workload exact --context 16384 --budget 1024 --gamma 2 "
    "--dense_layers none --batch 4 --new_tokens 64 --repeats 3 --gin_param "
    "\"RolloutConfig.draft_scorer = 'verify'\"":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    # docs/benchmarks.md: exact sparse acceptance vs alpha on the demo model (issue 42)
    "python -m sparrow_jax.bench.acceptance --num_prompts 16 --samples 4 --budgets 48 128 "
    "--dense_layers none --plot docs/images/exact_acceptance.png":
        (ByTest("tests/test_exact_sparse.py::test_acceptance_bench_on_demo_model"),),
    # docs/benchmarks.md: the one-pass dense baseline side by side at 16K (issue 57)
    _ROLLOUT_BENCH + "--workload exact --context 16384 --budget 1024 --gamma 1 2 "
    "--dense_layers 0,1 --batch 4 --new_tokens 64 --repeats 3 --before":
        (ByTest("tests/test_exact_sparse.py::test_bench_exact_workload"),),
    # docs/benchmarks.md: verify-guided vs centroid drafts on the demo model (issue 57)
    "python -m sparrow_jax.bench.acceptance --num_prompts 8 --samples 4 --budgets 64 128 "
    "--dense_layers none --draft_scorer centroid verify":
        (ByTest("tests/test_exact_sparse.py::test_acceptance_bench_on_demo_model"),),
    # docs/experiment.md: the block scorers' alpha tails on the long task (issue 41)
    "python -m sparrow_jax.bench.selection_quality --model checkpoints/long_sft "
    "--data data/long/heldout64.jsonl --rows 4 --budgets 256 512 --dense_layers 0,1 0":
        (ByTest("tests/test_selection_quality.py::test_documented_command_parses"),),
    # docs/experiment.md: an exact-sparse arm beside dense, paired seeds (issue 42)
    "launch/local.sh sparrow experiment configs/demo_cpu.gin configs/experiment_paired.gin "
    "configs/experiment_exact.gin":
        (ByTest("tests/test_experiment.py::test_exact_experiment_config_parses_every_arm"),
         ByTest("tests/test_experiment.py::test_exact_sparse_arm_beside_dense")),
    # docs/benchmarks.md, README.md: static vs paged engine on the long-tailed workload
    _ROLLOUT_BENCH + "--workload longtail --chunk_steps 16 32 64 --repeats 2":
        (Twin("bench_rollout_longtail"),),
    _ROLLOUT_BENCH + "--workload longtail --static_batch 8 --chunk_steps 16 --repeats 2":
        (Twin("bench_rollout_longtail"),),
    # docs/benchmarks.md: host ms per paged chunk with and without the overlap (issue 30)
    _ROLLOUT_BENCH + "--workload longtail --modes sparse --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 5 --before":
        (Twin("bench_rollout_longtail"),),
    # docs/benchmarks.md: coarse shape ladders vs the default ones (issue 43)
    _ROLLOUT_BENCH + "--workload longtail --samples 32 --new_tokens 512 --chunk_steps 32 "
    "--repeats 3 --ladders 8 8 4":
        (Twin("bench_rollout_longtail"),),
    _ROLLOUT_BENCH + "--workload longtail --modes sparse --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 3 --ladders 8 8 4":
        (Twin("bench_rollout_longtail"),),
    # docs/benchmarks.md: where the coarse ladders' cost comes from (slots vs page tables)
    _ROLLOUT_BENCH + "--workload longtail --modes sparse --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 3 --no_static --ladders 8 2 4 --ladders 2 8 4 --ladders 8 8 4":
        (Twin("bench_rollout_longtail"),),
    # docs/benchmarks.md: one page-table width and fine slots (the 1.7B config's ladders)
    _ROLLOUT_BENCH + "--workload longtail --modes sparse --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 5 --no_static --ladders 8 8 4 8 --ladders 2 2 100000 1 "
    "--ladders 2 2 100000 8":
        (Twin("bench_rollout_longtail"),),
    _ROLLOUT_BENCH + "--workload longtail --modes sparse --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 5 --no_static --ladders 8 8 4 8 --ladders 2 2 100000 4 "
    "--ladders 2 2 100000 1":
        (Twin("bench_rollout_longtail"),),
    _ROLLOUT_BENCH + "--workload longtail --modes sparse dense --samples 32 --new_tokens 512 "
    "--chunk_steps 32 --repeats 5 --no_static --ladders 2 2 100000 4":
        (Twin("bench_rollout_longtail"),),
    # docs/benchmarks.md: the same across 2 local processes (issue 30's multi-process overlap)
    _ROLLOUT_BENCH + "--workload longtail --processes 2 --modes sparse --samples 32 "
    "--new_tokens 512 --chunk_steps 32 --repeats 5":
        (Twin("bench_rollout_processes"),),
}
COMMANDS = {normalize(k): v for k, v in _REGISTRY.items()}
assert len(COMMANDS) == len(_REGISTRY), "two registry keys normalize to the same command"


def _waiting(text: str) -> bool:
    return any(isinstance(c, OnPendingPage) and c.waiting() for c in COMMANDS[text])


def _checks(kind: type) -> list:
    return sorted({c for t, checks in COMMANDS.items() if not _waiting(t)
                   for c in checks if isinstance(c, kind)}, key=repr)


# -- registry <-> docs ----------------------------------------------------------------------------

def test_every_doc_command_is_registered():
    shown = all_doc_commands()
    assert shown, "no commands found in the docs: is the extraction broken?"
    missing = [f"{c.file}:{c.line}: {c.text}" for c in shown if c.text not in COMMANDS]
    assert not missing, ("commands shown in the docs but not registered in tests/test_docs.py "
                         "COMMANDS (add each with how it is checked):\n" + "\n".join(missing))
    stale = sorted(t for t in set(COMMANDS) - {c.text for c in shown} if not _waiting(t))
    assert not stale, "registered commands no doc shows any more (remove them):\n" + "\n".join(stale)


def test_readme_starts_with_the_two_commands():
    """The README's first commands are the two, inside its first screen (40 lines), after a
    title and what the project is for."""
    text = (REPO / "README.md").read_text()
    shown = [c for c, _ in doc_commands(REPO / "README.md")]
    assert [c.text for c in shown[:2]] == ["launch/local.sh demo", "launch/local.sh test"], shown[:2]
    assert text.startswith("# ") and shown[1].line <= 40, shown[1]


def test_checks_other_than_running_are_stated_beside_the_command():
    """In docs/, right after each block. The README stays a short read: a command it shows must
    also be shown on a docs/ page, where this rule applies to it."""
    in_docs = {c.text for path in DOCS if path.name != "README.md" for c, _ in doc_commands(path)}
    missing = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for cmd, end in doc_commands(path):
            if all(isinstance(c, Run) for c in COMMANDS.get(cmd.text, (Run(),))):
                continue
            if path.name == "README.md" and cmd.text in in_docs:
                continue
            # The block's own comments, then the first paragraph after the block.
            k, para = end, []
            while k < len(lines) and not lines[k].strip():
                k += 1
            while k < len(lines) and lines[k].strip() and not lines[k].startswith("```"):
                para.append(lines[k])
                k += 1
            by_test = [c for c in COMMANDS.get(cmd.text, ()) if isinstance(c, ByTest)]
            only_tests = by_test and all(isinstance(c, (ByTest, Usage))
                                         for c in COMMANDS[cmd.text])
            named = only_tests and any(c.nodeid.split("::")[0] in "\n".join(lines) for c in by_test)
            if not NOTE.search(" ".join(para)) and not named:
                missing.append(f"{cmd.file}:{cmd.line}: {cmd.text}")
    assert not missing, ('say how these are checked right after their block, e.g. "(CPU twin in '
                         'tests: ...)":\n' + "\n".join(missing))


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    bad = []
    for path in DOCS:
        text = path.read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            dest = (path.parent / target).resolve() if target else path
            rel = os.path.relpath(dest, REPO)
            if not dest.exists():
                if rel not in PENDING_PAGES:
                    bad.append(f"{path.name}: {target}")
                continue
            if anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor[1:] not in heads:
                    bad.append(f"{path.name}: {target}{anchor} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_cli_table_names_real_subcommands():
    from sparrow_jax import cli
    names = re.findall(r"^\| `sparrow (\w+)", (REPO / "README.md").read_text(), re.M)
    assert {"train", "rollout", "calibrate", "bench", "sft", "dryrun", "export"} <= set(names)
    unknown = [n for n in names if n not in cli.COMMANDS and n != "bench"
               and n not in PENDING_SUBCOMMANDS]
    assert not unknown, f"README's CLI table names subcommands sparrow does not have: {unknown}"


# -- every sparrow command parses --------------------------------------------------------------

def _script(name: str) -> str:
    return (REPO / "launch" / name).read_text()


def as_sparrow_argv(text: str) -> list[str] | None:
    """The `sparrow` argv a doc command ends up running, or None if it runs no sparrow command.

    Launchers are translated by what they exec; each translation first checks the launcher
    still does exactly that, so this cannot drift from the scripts.
    """
    tokens = shlex.split(text)
    env = {}
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    head, rest = tokens[0], tokens[1:]
    if head == "sparrow":
        return rest
    if head == "launch/local.sh" and rest[:1] == ["demo"]:
        assert 'exec sparrow train configs/demo_cpu.gin "$@"' in _script("local.sh")
        return ["train", "configs/demo_cpu.gin", *rest[1:]]
    if head == "launch/local.sh" and rest[:1] == ["sparrow"]:
        assert 'exec sparrow "$@"' in _script("local.sh")
        return rest[1:]
    if head == "launch/gpu.sh":
        script = _script("gpu.sh")
        assert 'exec sparrow train "$@" "${multi[@]}"' in script
        extra = []
        if "COORDINATOR" in env:
            for binding in ("TrainConfig.distributed = True",
                            "TrainConfig.coordinator_address = '${COORDINATOR}'",
                            "TrainConfig.num_processes = ${NUM_NODES:?set NUM_NODES}",
                            "TrainConfig.process_id = ${NODE_RANK:?set NODE_RANK}"):
                assert f'"{binding}"' in script, binding
            extra = ["--gin_param", "TrainConfig.distributed = True",
                     "--gin_param", f"TrainConfig.coordinator_address = '{env['COORDINATOR']}'",
                     "--gin_param", f"TrainConfig.num_processes = {env['NUM_NODES']}",
                     "--gin_param", f"TrainConfig.process_id = {env['NODE_RANK']}"]
        return ["train", *rest, *extra]
    if head == "launch/tpu_pod.sh":
        script = _script("tpu_pod.sh")
        assert "tpu=$1; zone=$2; shift 2" in script
        assert "sparrow train$args --gin_param 'TrainConfig.distributed = True'" in script
        return ["train", *rest[2:], "--gin_param", "TrainConfig.distributed = True"]
    return None


SPARROW_COMMANDS = sorted(t for t in COMMANDS
                          if as_sparrow_argv(t) is not None and Usage() not in COMMANDS[t])


@pytest.mark.parametrize("text", sorted(t for t, c in COMMANDS.items()
                                        if Usage() in c and not _waiting(t)))
def test_usage_line_names_real_flags(text):
    from sparrow_jax import cli
    argv = as_sparrow_argv(text)
    command = argv[0]
    assert command in cli.COMMANDS, f"`{text}`: sparrow has no subcommand {command!r}"
    parser = cli.build_parser(command)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {o for a in subparsers.choices[command]._actions for o in a.option_strings}
    flags = {f for f in re.findall(r"(?<![\w-])--[\w-]+", text)}
    assert flags <= options, f"`{text}` names flags `sparrow {command}` does not have: {flags - options}"


@pytest.mark.parametrize("text", SPARROW_COMMANDS)
def test_sparrow_command_parses(text, monkeypatch):
    from sparrow_jax import cli
    from sparrow_jax.sparsity.schedule import load_schedule

    monkeypatch.chdir(REPO)  # config paths in the docs are relative to the repo root
    argv = as_sparrow_argv(text)
    try:
        if argv[:2] == ["bench", "rollout"]:
            from sparrow_jax.bench import rollout as bench
            args = bench.build_parser().parse_args(argv[3:] if argv[2:3] == ["--"] else argv[2:])
        elif argv[:2] == ["bench", "kernel"]:
            from sparrow_jax.bench import kernels as bench
            args = bench.parse_args(argv[3:] if argv[2:3] == ["--"] else argv[2:])
        elif argv[:2] == ["bench", "step"]:
            from sparrow_jax.tools import config_smoke
            args = config_smoke.build_parser(modes=True).parse_args(argv[2:])
            args.gin_files = [args.config]
        else:
            command = next(a for a in argv if a in cli.COMMANDS)
            args = cli.build_parser(command).parse_args(argv)
            # As cli.main: `sparrow data check FILE ...` sorts data paths from gin files.
            split = getattr(__import__(cli.COMMANDS[command][0], fromlist=["_"]),
                            "split_positionals", None)
            if split is not None:
                split(args)
    except SystemExit as e:  # argparse reports on stderr and exits 2
        pytest.fail(f"`{text}`: its arguments do not parse (exit {e.code})")
    for f in getattr(args, "gin_files", []):
        assert (REPO / f).is_file(), f"`{text}` names {f}, which does not exist"
    gin.clear_config()
    try:
        cli.parse_gin(getattr(args, "gin_files", []), getattr(args, "gin_param", []))
    finally:
        gin.clear_config()
    if getattr(args, "schedule", None) and args.schedule != "config":   # config: the gin's
        load_schedule(args.schedule)


# -- hardware launchers and CI, checked without the hardware ----------------------------------

@pytest.mark.parametrize("text", sorted(t for t, c in COMMANDS.items() if Hardware() in c))
def test_hardware_launcher_checked_without_hardware(text):
    tokens = [t for t in shlex.split(text) if not re.match(r"^[A-Z_]+=", t)]
    script = REPO / tokens[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{tokens[0]} is not an executable file"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, f"bash -n {tokens[0]}:\n{r.stderr}"
    for name in re.findall(r"\bconfigs/[\w./-]+\.gin\b", text + script.read_text()):
        assert (REPO / name).is_file(), f"{tokens[0]} names {name}, which does not exist"
    # The gin side of these commands is parsed by test_sparrow_command_parses (gpu/tpu) or run
    # by the ByTest entry beside it (make_demo_checkpoint.sh -> sparrow sft).


def test_ci_runs_the_readme_test_command():
    assert CI() in COMMANDS[normalize("launch/local.sh test")]
    lines = [ln for ln in (REPO / ".ci/run").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[-1].strip() == "exec bash launch/local.sh test", lines


def test_referenced_tests_exist():
    ids = sorted({c.nodeid for c in _checks(ByTest)})
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *ids], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = [ln.strip() for ln in r.stdout.splitlines()]
    for nodeid in ids:
        assert any(ln == nodeid or ln.startswith(nodeid + "[") for ln in collected), nodeid


# -- commands run verbatim -----------------------------------------------------------------------

@pytest.mark.parametrize("text", sorted(t for t, c in COMMANDS.items() if Run() in c))
def test_run_verbatim(text, tmp_path):
    argv = shlex.split(text)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "data/demo").mkdir(parents=True)
    (tmp_path / "data/long").mkdir(parents=True)
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"`{text}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    if "sparrow_jax.data.synthetic train.jsonl" in text:
        rows = (tmp_path / "train.jsonl").read_text().splitlines()
        assert len(rows) == 512 and {"prompt", "answer"} <= set(json.loads(rows[0]))
    shipped = re.search(r"(data/(?:demo|long)/heldout\d+\.jsonl)", text)
    if shipped:                                  # shipped sets are what they say
        made = (tmp_path / shipped.group(1)).read_text()
        assert made == (REPO / shipped.group(1)).read_text()


# -- CPU-sized twins ---------------------------------------------------------------------------

DEMO_TWIN = ["--gin_param", "TrainConfig.total_steps = 2", "--gin_param", "TrainConfig.eval_every = 2",
             "--gin_param", "TrainConfig.eval_prompts = 2", "--gin_param", "TrainConfig.prompts_per_step = 1",
             "--gin_param", "TrainConfig.group_size = 2", "--gin_param", "RolloutConfig.max_new_tokens = 24",
             "--gin_param", "LearnerConfig.micro_batch_size = 2",
             "--gin_param", "ReferenceEvalConfig.prompts = 2"]


def _launch(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    # timeout: a hang guard, not a speed check. The demo twin (`demo_run`) is ~55 CPU-s alone
    # but took 283 s of wall time on a loaded 2-core machine, too near the 300 s it had.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NO_COLOR")}
    env["JAX_PLATFORMS"] = "cpu"
    # Of the session's XLA flags only the quick LLVM codegen (tests/conftest.py: the same
    # computation, compiled in less than half the CPU time; the demo twin's programs are most of
    # its cost); no device count or other flag a developer may have set.
    quick = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_backend_optimization_level=")]
    if quick:
        env["XLA_FLAGS"] = " ".join(quick)
    return subprocess.run(["bash", "launch/local.sh", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`launch/local.sh demo` for 2 steps (24-token generations, 2 held-out prompts)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    # First bring .venv up to date (local.sh reinstalls when pyproject.toml changed), so that
    # pip's output cannot land in the console checked below.
    r = _launch(["sparrow", "--help"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _launch(["demo", *DEMO_TWIN, "--gin_param", f"TrainConfig.run_dir = '{run_dir}'"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return run_dir, r


def _log_lines(stderr: str) -> list[tuple[str | None, str, str]]:
    """(level tag or None, logger, message) of each log line; tqdm redraws are dropped."""
    out = []
    for raw in re.split(r"[\r\n]", stderr):
        line = raw.strip()
        if not line or re.match(r"^train:\s+\d+%\|", line):
            continue
        m = re.match(r"^(?:(WARNING|ERROR|CRITICAL) )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ([\w.]+): (.*)$",
                     line)
        assert m, f"console line that is neither a log line nor the progress bar: {line!r}"
        out.append(m.groups())
    return out


def test_twin_demo(demo_run):
    run_dir, r = demo_run
    for line in ("held-out reward (dense decoding)", "held-out reward (sparse decoding)",
                 "measured rollout speed, sparse vs dense", "final schedule (tokens per bin)",
                 "KV read over the run's rollouts, whole model (2 of 4 layers sparse): "):
        assert line in r.stdout, r.stdout
    assert "1073741824" not in r.stdout            # a dense bin prints `dense`
    kv = float(r.stdout.split("layers sparse): ")[1].split()[0])
    assert 0.5 <= kv <= 1.0, r.stdout              # 2 of 4 layers always read everything
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [0, 1, 2]
    for name in ("operative_config.gin", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "2").is_dir()


@pytest.mark.slow    # ~80 CPU-s (4.5K-token reference-eval programs): CI keeps the 1K demo's twin
def test_twin_demo_long(tmp_path):
    """configs/demo_long.gin (the long-context task, issue 41) for 2 steps at 24-token
    generations: its checkpoint, data, certified table and 2-of-4-dense-layer accounting load,
    and the summary shows the whole-model KV read and the side-by-side speed."""
    run_dir = tmp_path / "run"
    r = _launch(["sparrow", "train", "configs/demo_long.gin", *DEMO_TWIN,
                 "--gin_param", f"TrainConfig.run_dir = '{run_dir}'"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for line in ("measured rollout speed, sparse vs dense", "final schedule (tokens per bin)",
                 "KV read over the run's rollouts, whole model (2 of 4 layers sparse): "):
        assert line in r.stdout, r.stdout
    assert "1073741824" not in r.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [0, 1, 2] and rows[-1]["kv/read_model"] >= 0.5


def test_demo_console_is_quiet(demo_run):
    run_dir, r = demo_run
    lines = _log_lines(r.stderr)
    loggers = {name.split(".")[0] for _, name, _ in lines}
    assert loggers <= {"sparrow_jax", "pallas_kernels"}, f"library log lines on the console: {loggers}"
    assert not [x for x in lines if x[0]], f"warnings in a plain demo run: {[x for x in lines if x[0]]}"
    saved = [msg for _, _, msg in lines if msg.startswith("checkpoint saved at step")]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == len(steps) and saved[-1] == f"checkpoint saved at step {steps[-1]}", saved
    assert any(msg.startswith("eval at step 2:") for _, _, msg in lines)
    # Start-up names what the model sees (sparrow_jax.data.check.log_first_prompt).
    assert any(msg.startswith("first prompt (") for _, _, msg in lines)
    assert "train:" in r.stderr and "2/2" in r.stderr  # the progress bar


def test_twin_demo_debug(demo_run):
    """`--log_level DEBUG` gives the library loggers back. The twin re-runs the finished demo
    twin (it resumes at its last step and has nothing left to train: cheap), which is enough to
    see orbax's restore narrated through absl; resuming *and training on* is test_train's."""
    run_dir, _ = demo_run
    r = _launch(["sparrow", "--log_level", "DEBUG", "train", "configs/demo_cpu.gin", *DEMO_TWIN,
                 "--gin_param", f"TrainConfig.run_dir = '{run_dir}'"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resumed from" in r.stderr and " absl: " in r.stderr  # orbax logs through absl


def test_twin_local_test():
    """`launch/local.sh test [pytest args]`: args pass through; no tests collected fails."""
    r = _launch(["test", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                 "tests/test_schedule.py"])
    assert r.returncode == 0 and "tests collected" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = _launch(["test", "-q", "-p", "no:cacheprovider", "tests/test_schedule.py", "-k",
                 "no_test_has_this_name"])
    assert r.returncode == 1 and "collected no tests" in r.stdout, r.stdout[-2000:]


def test_default_test_selection_skips_slow_tests_but_never_a_guard():
    """`launch/local.sh test` (= CI) runs every test not marked `slow` and every `guard`, slow or
    not; `--all` runs the slow ones too."""
    files = ["tests/test_shipped_configs.py", "tests/test_faults.py"]
    r = _launch(["test", "--collect-only", "-q", "-p", "no:cacheprovider", *files])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_shipped_configs_fit[qwen3_8b_tpu.gin]" in r.stdout            # slow, a guard
    assert "test_damaged_latest_checkpoint_falls_back" in r.stdout               # slow, a guard
    assert "test_kill9_anywhere" not in r.stdout                                 # slow only
    r = _launch(["test", "--all", "--collect-only", "-q", "-p", "no:cacheprovider", *files])
    assert r.returncode == 0 and "test_kill9_anywhere" in r.stdout, r.stdout[-2000:]


def test_twin_rollout(tmp_path, capsys):
    from sparrow_jax import cli
    prompts = (REPO / "data/demo/eval.jsonl").read_text().splitlines()[:2]
    (tmp_path / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    gin.clear_config()
    try:
        rc = cli.main(["rollout", "--model", str(REPO / "checkpoints/demo_sft"),
                       "--prompts", str(tmp_path / "prompts.jsonl"),
                       "--out", str(tmp_path / "samples.jsonl"), "--schedule", "qwen3-1.7b-0.86",
                       "--group_size", "8", "--batch_size", "4", "--seed", "0",
                       "--gin_param", "RolloutConfig.max_new_tokens = 32"])
    finally:
        gin.clear_config()
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["response_length"] <= 32 for r in rows)


def test_twin_bench_rollout(capsys, tmp_path):
    from sparrow_jax import cli
    from sparrow_jax.bench import xplane
    argv = ["bench", "rollout", "--", "--json", "--layers", "3", "--hidden", "32", "--heads", "4",
            "--kv_heads", "2", "--head_dim", "16", "--vocab", "64", "--context", "96",
            "--budget", "48", "--schedule", "qwen3-1.7b-0.86", "--dense_layers", "0,1",
            "--batch", "2", "--new_tokens", "16", "--repeats", "1", "--dtype", "float32",
            "--profile", str(tmp_path), "--xla_selection"]
    assert cli.main(argv) == 0
    out_text = capsys.readouterr().out
    records = [json.loads(x) for x in out_text.splitlines() if x.startswith("{")]
    # budget 48 and the schedule, each against dense; the docs' `--dense_layers 0,1 none` (a
    # second sparse set, twice the compiles) is only parsed, by test_sparrow_command_parses
    # --xla_selection: each again with the selection in XLA (on CPU both are XLA's)
    assert len(records) == 4 and all(r["dense_tok_s"] > 0 and r["sparse_tok_s"] > 0 for r in records)
    assert [r["xla_selection"] for r in records] == [False, False, True, True]
    assert {r["selection"] for r in records} == {"xla"}
    # the bytes limit beside every timing (issue 55): % = the limit's time / the measured step's
    for r in records:
        for mode in ("dense", "sparse"):
            assert r[f"{mode}_pct_of_limit"] == pytest.approx(
                100 * r[f"{mode}_limit_ms"] / r[f"{mode}_ms_per_step"])
            assert r[f"{mode}_bytes_total"] == pytest.approx(sum(
                r[f"{mode}_bytes_{k}"] for k in ("weights", "kv", "centroids", "metadata")))
        assert r["copy_bw_gbs"] > 0 and r["sparse_bytes_kv"] <= r["dense_bytes_kv"]
    # budget 48 reads less KV at 96 tokens; the schedule's 512 covers them (dense reads)
    assert records[0]["sparse_bytes_kv"] < records[0]["dense_bytes_kv"]
    assert "bytes/step dense: weights" in out_text and "% limit" in out_text
    # --profile: a trace and the HLO per program, which the breakdown reads by decode phase
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == ["96-dense", "96-sparse_48_0_1", "96-sparse_48_0_1_xla_selection",
                       "96-sparse_qwen3-1.7b-0.86_0_1",
                       "96-sparse_qwen3-1.7b-0.86_0_1_xla_selection"]
    assert xplane.main([str(tmp_path / f) for f in folders]) == 0
    out = capsys.readouterr().out
    assert out.count("(/host:CPU)") == 5 and "mlp" in out and "sample" in out
    sparse = xplane.breakdown(*xplane.read_profile(str(tmp_path / "96-sparse_48_0_1")))
    assert {"block_select", "sparse_attention", "kv_write"} <= {r["phase"] for r in sparse["phases"]}


@pytest.mark.slow       # ~30 s: `launch/local.sh test --all`
def test_twin_bench_rollout_longtail(capsys):
    """The longtail workload at toy size: both engines, dense and sparse, the paged one with and
    without the host loop overlap (--before), the same samples, the paged pool exactly the
    static engine's KV bytes."""
    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", "--workload", "longtail", "--layers", "3",
            "--hidden", "32", "--heads", "4", "--kv_heads", "2", "--head_dim", "16", "--vocab",
            "64", "--samples", "8", "--group", "2", "--static_batch", "4", "--prompt_len", "32",
            "--new_tokens", "96", "--mean_len", "24", "--budget", "48", "--chunk_steps", "16",
            "--repeats", "1", "--dtype", "float32", "--before", "--ladders", "4", "4", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [(r["mode"], r["engine"]) for r in records] == [
        (m, e) for m in ("dense", "sparse")
        for e in ("static", "paged/chunk16", "paged/chunk16/sync", "paged/chunk16/L4x4")]
    assert all(r["same_samples"] and r["tok_s"] > 0 for r in records)
    assert all(len(r["cpu_s"]) == 1 and r["cpu_s"][0] > 0 for r in records)
    static, paged, sync, coarse = records[:4]
    # Coarser ladders (powers of 4, tables from 2 pages): the same samples from fewer programs.
    assert 0 < coarse["programs"] <= paged["programs"] and static["programs"] is None
    assert paged["kv_alloc_bytes"] <= static["kv_alloc_bytes"] and paged["kv_peak_bytes"] > 0
    assert paged["overlapped_chunks"] > 0 and sync["overlapped_chunks"] == 0
    assert paged["host_ms_per_chunk"] >= 0 and sync["host_ms_per_chunk"] > 0
    assert "response lengths: mean" in out


def test_twin_bench_rollout_processes(capfd):
    """The longtail bench across 2 local JAX processes at toy size: the paged engine overlapped
    and sync, the same samples on every process, continuations only in the overlapped loop.
    Process 0's output is the command's (the processes write to the inherited stdout: capfd)."""
    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", "--workload", "longtail", "--processes", "2",
            "--layers", "3", "--hidden", "32", "--heads", "4", "--kv_heads", "2", "--head_dim",
            "16", "--vocab", "64", "--samples", "8", "--group", "2", "--static_batch", "4",
            "--prompt_len", "32", "--new_tokens", "64", "--mean_len", "24", "--budget", "48",
            "--chunk_steps", "8", "--repeats", "1", "--dtype", "float32", "--modes", "sparse"]
    assert cli.main(argv) == 0
    out = capfd.readouterr().out
    records = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [r["engine"] for r in records] == ["paged/chunk8", "paged/chunk8/sync"], out
    overlap, sync = records
    assert all(r["processes"] == 2 and r["same_samples"] and r["tok_s"] > 0 for r in records)
    assert overlap["overlapped_chunks"] > 0 and sync["overlapped_chunks"] == 0
    assert overlap["generated_tokens"] == sync["generated_tokens"] > 0
    assert sync["host_ms_per_chunk"] > 0 and sync["guard_ms_per_chunk"] > 0
    assert "2 processes on this machine's CPU" in out


def test_twin_bench_kernel(capsys):
    from sparrow_jax.bench import kernels as bench
    assert bench.main(["--contexts", "256", "--budgets", "64", "--models", "1.7b", "--iters", "1"]) == 0
    assert "copy bandwidth" in capsys.readouterr().out


def test_twin_bench_selection(capsys):
    from sparrow_jax.bench import kernels as bench
    assert bench.main(["--selection", "--blocks", "64", "--select", "16", "--batch", "1",
                       "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "top_k+sort ms" in out and "False" not in out      # every radix: identical ids


def test_every_twin_is_tested():
    names = {c.name for c in _checks(Twin)}
    here = {n[len("test_twin_"):] for n in globals() if n.startswith("test_twin_")}
    assert names <= here, f"registry twins without a test_twin_<name>: {names - here}"


# -- console: logging setup --------------------------------------------------------------------

def test_library_loggers_quiet_by_default_and_restored_by_debug(restore_logging):
    from sparrow_jax import cli
    cli.setup_logging("INFO")
    for name in ("absl", "orbax", "jax", "etils", "grain"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name
    assert logging.getLogger("sparrow_jax.train.command").getEffectiveLevel() == logging.INFO
    cli.setup_logging("DEBUG")
    for name in ("absl", "orbax", "jax", "etils", "grain"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.DEBUG, name
    cli.setup_logging("ERROR")
    assert logging.getLogger("absl").getEffectiveLevel() == logging.ERROR


def test_warnings_start_with_their_level(restore_logging):
    from sparrow_jax import cli
    fmt = cli.ConsoleFormatter(color=False)

    def line(level):
        return fmt.format(logging.LogRecord("sparrow_jax.train.command", level, __file__, 1, "msg", None, None))

    assert line(logging.WARNING).startswith("WARNING ") and line(logging.ERROR).startswith("ERROR ")
    assert not line(logging.INFO).startswith(("INFO", "WARNING"))
    colored = cli.ConsoleFormatter(color=True).format(
        logging.LogRecord("x", logging.WARNING, __file__, 1, "msg", None, None))
    assert colored.startswith("\033[1;33mWARNING\033[0m ")
