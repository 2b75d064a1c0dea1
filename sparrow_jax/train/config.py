"""`TrainConfig`: what one `sparrow train` run is (gin-configurable), validated on creation."""

from __future__ import annotations

import dataclasses

import gin
import jax.numpy as jnp

from sparrow_jax.rollout.config import RolloutMode

ROLLOUT_MODES = RolloutMode.values()


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"
    model_path: str = ""              # local Hugging Face directory (weights + tokenizer)
    # JSONL / Parquet prompts with answers: a file, directory, glob or a list of them
    # (sparrow_jax.data.rows.expand_paths)
    train_data: str | tuple[str, ...] = ""
    eval_data: str | tuple[str, ...] = ""   # held-out prompts ("" = no validation)
    reward: str = "math_verify"       # name in the reward registry (sparrow_jax.rewards)
    diagnostic_rewards: tuple[str, ...] = ()
    reward_processes: int = 4         # 0 = score in-process (cheap rewards)
    reward_timeout_s: float = 10.0
    # The share of a step's rewards that may raise an error (scored 0, reward/error_share)
    # before the run stops with the first error's traceback and row; in the run's first step
    # any error stops it (a reward that fails at once is a bug). 1.0 never stops.
    max_reward_error_share: float = 0.01
    prompts_per_step: int = 4
    group_size: int = 8
    total_steps: int = 100
    # The run's rollout mode: "sparse" (block top-k) | "dense" | "compress" (KV eviction,
    # RolloutConfig.kv_budget / compress_scorer) | "exact_sparse" (sparse drafts verified densely:
    # the dense policy's samples, docs/rollout.md). It is RolloutConfig.mode too: bind either
    # one; binding both to different modes is refused (sparrow_jax.train.plan.run_mode).
    rollout_mode: RolloutMode = RolloutMode.SPARSE
    adapt_schedule: bool = True       # online schedule controller on the measured tail
    tail_quantile: float = 0.05       # the per-bin tail statistic the controller targets
    eval_every: int = 10
    eval_prompts: int = 32
    eval_temperature: float = 0.0     # 0 = greedy validation
    # Samples per held-out prompt; > 1 also logs avg@n and pass@k (k = 1, 2, 4, ... <= n) as
    # `sparrow eval` computes them (use with eval_temperature > 0).
    eval_samples: int = 1
    # Evaluate once before step 1 (the run's starting point). False skips it - the last
    # evaluation still runs, and its tokens/s then include the eval programs' compile time. An
    # experiment's arms start from the same checkpoint, so one arm's step-0 evaluation serves all.
    eval_at_start: bool = True
    # Paged engine: compile the programs the compile plan counts before step 1 (the first
    # rollout's prefill and decode grid, the evaluation's) up front, one progress line each
    # (sparrow_jax.rollout.warmup), instead of inside a silent first step.
    warmup: bool = False
    checkpoint_every: int = 10
    max_to_keep: int = 3
    seed: int = 0
    dtype: str = "auto"               # compute dtype of rollout and learner forwards:
                                      # "auto" = bf16 on accelerators, f32 on CPU
    param_dtype: str = "float32"      # master weights and AdamW moments (bf16 cannot hold an
                                      # lr-1e-6 update); the rollout gets a compute-dtype copy
    rollout_batch_prompts: int = 0    # prompts per rollout program call (0 = prompts_per_step):
                                      # a step's rollout runs in sequential calls of this size
    mesh_model: int = 1               # model-parallel axis size; the rest of the devices is data
    distributed: bool = False         # multi-host: jax.distributed.initialize() (TPU pods, SLURM)
    # Explicit multi-process launch where no cluster is auto-detected (plain GPU nodes, local
    # tests): all three set, or none. Each process's prompts_per_step is its own share.
    coordinator_address: str = ""     # "host:port" of process 0
    num_processes: int = 0
    process_id: int = -1
    # A step whose loss or gradient is not finite skips its update (parameters and optimizer
    # state untouched); after this many in a row the run saves and stops (0 = never stops).
    max_consecutive_skips: int = 5
    # Persistent XLA compilation cache (sparrow_jax.runtime.compile_cache): "auto" = jax's own
    # JAX_COMPILATION_CACHE_DIR if set, else on for GPU/TPU in ~/.cache/sparrow-jax/xla (or
    # $SPARROW_COMPILE_CACHE) and off on CPU; a directory = on there (any platform); "" = off.
    compile_cache_dir: str = "auto"
    # Settings that may differ from the run's saved ones on resume (evaluation and checkpoint
    # cadence and the like: sparrow_jax.train.resume_config.OVERRIDABLE), e.g.
    # ('TrainConfig.eval_every',). What is trained (model, dtypes, data, reward, optimizer,
    # schedule, batch layout) never changes within a run; total_steps may change (down to the
    # run's step).
    resume_overrides: tuple[str, ...] = ()

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ConfigError(problems, "TrainConfig")
        object.__setattr__(self, "rollout_mode", RolloutMode(self.rollout_mode))

    def problems(self) -> list[str]:
        """Every setting that cannot work, each named with its value (one error lists all)."""
        out = []
        missing = [f for f in ("model_path", "train_data") if not getattr(self, f)]
        if missing:
            out.append(f"set {missing} (e.g. --gin_param 'TrainConfig.{missing[0]} = \"...\"')")
        if not str(self.run_dir).strip():
            out.append("TrainConfig.run_dir is empty: name the run's directory (an empty one "
                       "would train into the current directory)")
        if self.rollout_mode not in ROLLOUT_MODES:
            out.append(f"TrainConfig.rollout_mode must be one of {ROLLOUT_MODES}, got "
                       f"{self.rollout_mode!r}")
        # Counts and cadences where 0 (or less) means nothing: caught here instead of as a
        # ZeroDivisionError after a full RL step, a "disk full" or a silent no-op.
        for name in ("total_steps", "eval_every", "checkpoint_every", "max_to_keep",
                     "prompts_per_step", "mesh_model", "eval_prompts", "eval_samples"):
            value = getattr(self, name)
            if value < 1:
                why = (" (0 would keep no checkpoint: the run could neither resume nor be "
                       "exported)" if name == "max_to_keep" else "")
                out.append(f"TrainConfig.{name} must be >= 1, got {value}{why}")
        for name in ("reward_processes", "max_consecutive_skips"):
            if getattr(self, name) < 0:
                out.append(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.reward_timeout_s > 0:
            out.append(f"TrainConfig.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if not 0 <= self.max_reward_error_share <= 1:
            out.append(f"TrainConfig.max_reward_error_share must be in [0, 1], got "
                       f"{self.max_reward_error_share}")
        if not 0 < self.tail_quantile < 1:
            out.append(f"TrainConfig.tail_quantile must be in (0, 1), got {self.tail_quantile}")
        explicit = (bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0)
        if any(explicit) and not all(explicit):
            out.append("set TrainConfig.coordinator_address, num_processes and process_id "
                       "together (or none of them, for cluster auto-detection)")
        if all(explicit) and not self.distributed:
            out.append("TrainConfig.coordinator_address/num_processes/process_id need "
                       "distributed = True")
        if self.group_size < 2:
            out.append(f"GRPO needs group_size >= 2, got {self.group_size}")
        if self.rollout_batch_prompts < 0 or (
                self.rollout_batch_prompts > 0 and self.prompts_per_step > 0
                and self.prompts_per_step % self.rollout_batch_prompts):
            out.append(f"TrainConfig.rollout_batch_prompts={self.rollout_batch_prompts} must "
                       f"divide prompts_per_step={self.prompts_per_step}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value != "auto" or name == "param_dtype":
                try:
                    jnp.dtype(value)
                except TypeError:
                    out.append(f"TrainConfig.{name} = {value!r} is not a dtype name (float32, "
                               f"bfloat16, ...)")
                    continue
                if jnp.dtype(value) == jnp.float16:
                    # Its range (6.5e4) overflows these models' activations: every step was
                    # skipped as non-finite, reported with a loss of 0.0 (issue #45).
                    out.append(f"TrainConfig.{name} = {value!r}: float16 overflows in these "
                               f"models (largest value 65504), so every update would be "
                               f"non-finite; use 'bfloat16' (same size, float32's range) or "
                               f"'float32'")
        return out


class ConfigError(ValueError):
    """Settings that cannot work, all of them in one message (``problems`` lists them)."""

    def __init__(self, problems: list[str], what: str = "configuration"):
        self.problems = list(problems)
        super().__init__(f"{what}: " + "; ".join(self.problems))


def gin_value(name: str):
    """The value gin binds to `name`, or None when it is not bound."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return None
