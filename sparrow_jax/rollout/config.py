"""`RolloutConfig`: the static settings of a rollout (engine, mode, sampling, kernels, pool)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import gin
import numpy as np

from sparrow_jax.rollout.sampling import SamplingParams
from sparrow_jax.runtime.choices import Choice
from sparrow_jax.runtime.shapes import bucket_length, default_buckets
from sparrow_jax.sparsity.compression import CompressScorer
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule
from sparrow_jax.sparsity.mismatch import AlphaMode

log = logging.getLogger(__name__)

class RolloutMode(Choice):
    """How the rollout attends to its KV cache (docs/rollout.md)."""
    SPARSE = "sparse"                # block top-k under the schedule's per-bin budgets
    DENSE = "dense"                  # every key
    COMPRESS = "compress"            # KV eviction (R-KV / SnapKV), rollout/compress.py
    EXACT_SPARSE = "exact_sparse"    # sparse drafts verified densely: the dense policy's samples


class Engine(Choice):
    STATIC = "static"                # one cache row per sample (rollout/static.py)
    PAGED = "paged"                  # page pools, continuous batching (rollout/continuous.py)


class DraftScorer(Choice):
    """How exact_sparse drafts choose their KV blocks (docs/rollout.md, "Verify-guided drafts")."""
    CENTROID = "centroid"            # the draft query against each block's mean key (sparse mode's)
    VERIFY = "verify"                # the attention mass the last dense verify pass gave each block


class SelectionBackend(Choice):
    AUTO = "auto"                    # where the attention kernel runs (a Triton kernel on GPUs)
    XLA = "xla"                      # the XLA form everywhere (for comparison)


class CommandBuffers(Choice):
    """Which kernels of a GPU decode program XLA records into CUDA graphs (command buffers),
    which the GPU then runs without a launch from the host per kernel."""
    DEFAULT = "default"              # XLA's own set (its fusions, gemms, custom calls)
    OFF = "off"                      # none: the host launches every kernel
    LOOP = "loop"                    # also the loops and branches: a whole decode step one graph


# The XLA option values of each CommandBuffers setting (DEFAULT: no option given).
COMMAND_BUFFER_TYPES = {CommandBuffers.OFF: "",
                        CommandBuffers.LOOP: "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                                             "CONDITIONAL"}


MODES = RolloutMode.values()


def padded_length(n: int, block_size: int) -> int:
    return -(-n // block_size) * block_size


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static settings of the rollout program (changing one recompiles)."""
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    mode: RolloutMode = RolloutMode.SPARSE   # "sparse" | "dense" | "compress" (Sparse-RL's KV
    #                                      eviction) | "exact_sparse" (sparse drafts, dense verify)
    gamma: int = 4                       # exact_sparse: tokens drafted per dense verify pass
    # exact_sparse: the draft length per length bin (the bins of the budgets; the last entry
    # holds beyond), 0 = dense decoding in that bin (no draft), e.g. the plan of
    # sparsity/exact_cost.choose_per_bin; () = `gamma` in every bin. gamma must be the largest
    # entry (the cache slack), unless every entry is 0 (dense in every bin). One program holds
    # a branch per distinct entry: keep the set small, e.g. {0, 1, 2, 4}.
    gamma_by_bin: tuple[int, ...] = ()
    # exact_sparse: bins from this one on (>= 1; 0 = none) decode approximately sparse: the
    # drafts are kept unverified, recorded with the draft's log-probs and budget (the learner's
    # TIS corrects them, as in mode "sparse"). A suffix of the bins, so that every verified
    # token before it is the dense policy's (exact_cost.plan_modes chooses it per bin).
    approximate_from_bin: int = 0
    # exact_sparse: how the drafts pick their blocks - "centroid" (sparse mode's scoring) or
    # "verify" (the per-block attention mass of the last verify pass, per KV head; a row's
    # first round, and each paged decode chunk's, scores centroids).
    draft_scorer: DraftScorer = DraftScorer.CENTROID
    # exact_sparse: re-planning the per-bin gamma inside a training run (docs/rollout.md,
    # "Re-planning in a run"). replan_gammas: the draft lengths the decode programs compile a
    # round for (0: a dense step), e.g. (0, 1, 2, 4); set, the per-bin gamma table is an input
    # of the programs (`traced_plan`), so a new plan among these gammas runs without a compile.
    # gamma must be their largest (it sizes the cache slack); gamma_by_bin (or gamma) is the
    # first plan, its gammas among these.
    # replan_every: `sparrow train` re-fits the plan every this many steps from the run's
    # measured alpha and round costs (0: never; needs replan_gammas); a bin keeps its gamma
    # until it saw replan_min_rounds verify rounds since the last re-fit.
    # replan_probe_after: a dense bin (gamma 0) drafts nothing, so nothing measures whether
    # drafts would now pay there: a bin with traffic that stayed dense through this many
    # re-fits runs the next interval at the smallest compiled draft length, to measure its
    # alpha again (0: never; a dense bin then stays dense).
    replan_gammas: tuple[int, ...] = ()
    replan_every: int = 0
    replan_min_rounds: int = 32
    replan_probe_after: int = 4
    dense_layers: tuple[int, ...] = (0, 1)
    block_size: int = 16
    max_budget: int = 4096               # static selection width in tokens (>= any schedule budget)
    record_topk: int = 20                # per-token vocabulary top-k (0 = none; for_alpha_mode)
    prefill_chunk: int = 2048
    backend: str = "auto"                # kernel backend, see pallas_kernels.block_sparse_decode
    # Block selection: "auto" runs it where the attention kernel runs (one Pallas Triton kernel
    # on a GPU, `selection.selection_backend`); "xla" the XLA form everywhere (for comparison).
    selection: SelectionBackend = SelectionBackend.AUTO
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    scorer: str = "centroid"
    # Prompt widths are padded up to one of these (static shapes: one prefill/decode program per
    # bucket touched); () = two buckets per octave from 64 tokens (sparrow_jax.runtime.shapes).
    prompt_buckets: tuple[int, ...] = ()
    # mode = "compress" (sparrow_jax.rollout.compress, docs/compression.md): every
    # `compress_every` steps a row holding more than `kv_budget` tokens keeps `kv_budget` of them
    # (the last `window` always) by `compress_scorer` ("rkv" | "snapkv"); R-KV mixes with lambda.
    kv_budget: int = 512
    compress_every: int = 128
    window: int = 8
    compress_scorer: CompressScorer = CompressScorer.RKV
    rkv_lambda: float = 0.1
    # engine = "paged" (sparrow_jax.rollout.continuous, docs/rollout.md): KV in pages of block_size
    # tokens, continuous batching in compiled decode chunks of `chunk_steps` steps, GRPO groups
    # share their prompt's pages, preemption when the pool runs out. "static": one cache row per
    # sample sized for the longest possible row, one while_loop until the slowest row ends.
    engine: Engine = Engine.STATIC
    max_slots: int = 0           # samples decoded at once (0 = all); a multiple of the data axis
    chunk_steps: int = 32
    overlap_chunks: bool = True  # dispatch chunk i+1 before reading chunk i back (rollout/continuous.py)
    pool_bytes: int = 0          # page pool bytes per device (0 and pool_fraction 0: enough for
    pool_fraction: float = 0.0   # every row at full length); or a fraction of device memory
    # Shape ladders of the paged engine's programs (rollout/continuous_state.py; the compile plan,
    # train/compile_plan.py, counts them): running slots and prefill rows per pool in powers of
    # `slot_ladder`; page-table widths in powers of `page_ladder` from `min_table_pages`.
    # Coarser ladders: fewer programs (minutes each at full depth), more padded work. A
    # min_table_pages at or above a sample's page cap gives one table width, the cap (the decode
    # kernels and the XLA path loop to the rows' lengths; the centroid scoring reads the width).
    slot_ladder: int = 2
    page_ladder: int = 2
    min_table_pages: int = 4
    # The fewest running slots per pool a decode program has (prefill rows are not floored):
    # the last few samples decode in min_slots rows (empty rows cost little where a step is
    # bound by the weights' reads, an accelerator's small batches), one decode slot bucket
    # fewer per factor of the ladder.
    min_slots: int = 1
    # Paged engine, mode "dense": decode in the sparse mode's programs with every budget bin at
    # the dense rung (every row attends to all its keys: dense attention, up to the float
    # rounding of the order blocks are summed in), so that a sparse run's dense evaluation
    # compiles no decode programs of its own (Trainer.evaluate sets it).
    dense_via_sparse: bool = False
    # GPU decode compiles (docs/dryrun.md, "Kernels per decode step"): which kernels become
    # CUDA graphs, and the split-K of the decode's gemms - 0: XLA's choice (its heuristics, or
    # its autotuner on a GPU: skinny decode gemms get split-K); 1: none, which saves the kernels
    # that add the partial sums (3 per layer on the 1.7B H100 step) but runs each gemm on fewer
    # SMs. Which is faster is for a GPU to time (the device check); the defaults are XLA's own.
    # Applied to the decode programs only (`decode_compiler_options`).
    decode_command_buffers: CommandBuffers = CommandBuffers.DEFAULT
    decode_split_k: int = 0

    def __post_init__(self):
        # gin binds plain strings: each mode becomes its enum here, or fails naming the choices.
        for name, choice in (("mode", RolloutMode), ("engine", Engine),
                             ("selection", SelectionBackend), ("compress_scorer", CompressScorer),
                             ("draft_scorer", DraftScorer),
                             ("decode_command_buffers", CommandBuffers)):
            object.__setattr__(self, name, choice.parse(getattr(self, name),
                                                        f"RolloutConfig.{name}"))
        if self.gamma < 1:
            raise ValueError(f"RolloutConfig.gamma (tokens drafted per verify) must be >= 1, "
                             f"got {self.gamma}")
        if self.mode == RolloutMode.COMPRESS:
            self._check_compress()
        if self.mode == RolloutMode.EXACT_SPARSE and self.gamma_by_bin:
            self._check_gamma_by_bin()
        self._check_replan()
        if self.approximate_from_bin < 0:      # read by exact_sparse only (as gamma_by_bin)
            raise ValueError(f"RolloutConfig.approximate_from_bin={self.approximate_from_bin}: "
                             "a bin index >= 1 of an exact_sparse plan (0: none)")
        if self.engine == Engine.PAGED and self.mode == RolloutMode.COMPRESS:
            raise ValueError(f"mode={self.mode!r} runs on the static engine only (the paged "
                             "engine does not implement it); set engine='static'")
        if self.engine == Engine.PAGED and self.mode == RolloutMode.EXACT_SPARSE and \
                self.chunk_steps < self.gamma + 1:
            raise ValueError(f"paged exact_sparse: chunk_steps={self.chunk_steps} must be >= "
                             f"gamma + 1 = {self.gamma + 1} (a chunk runs chunk_steps // "
                             "(gamma + 1) verify rounds)")
        if self.chunk_steps <= 0 or self.max_slots < 0 or self.pool_bytes < 0 or not (
                0 <= self.pool_fraction < 1):
            raise ValueError(f"bad paged-engine settings chunk_steps={self.chunk_steps} "
                             f"max_slots={self.max_slots} pool_bytes={self.pool_bytes} "
                             f"pool_fraction={self.pool_fraction}")
        if (self.slot_ladder < 2 or self.page_ladder < 2 or self.min_table_pages < 1
                or self.min_slots < 1):
            raise ValueError(f"bad paged-engine ladders slot_ladder={self.slot_ladder} "
                             f"page_ladder={self.page_ladder} (each >= 2), min_table_pages="
                             f"{self.min_table_pages}, min_slots={self.min_slots} (each >= 1)")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.decode_split_k < 0:
            raise ValueError(f"RolloutConfig.decode_split_k must be >= 0 (0: XLA's choice), got "
                             f"{self.decode_split_k}")
        if self.record_topk < 0:
            raise ValueError(f"record_topk must be >= 0, got {self.record_topk}")
        if self.max_budget % self.block_size or self.max_budget < 3 * self.block_size:
            raise ValueError(f"max_budget={self.max_budget} must be a multiple of block_size="
                             f"{self.block_size} and >= 3 blocks (sink + 2 local)")
        SamplingParams(self.temperature, self.top_k, self.top_p)   # validates
        if self.prefill_chunk <= 0 or self.prefill_chunk % self.block_size:
            raise ValueError(f"RolloutConfig.prefill_chunk={self.prefill_chunk} must be a positive "
                             f"multiple of block_size={self.block_size}")
        if any(b <= 0 or b % self.block_size for b in self.prompt_buckets):
            raise ValueError(f"RolloutConfig.prompt_buckets {self.prompt_buckets} must be positive "
                             f"multiples of block_size={self.block_size}")
        if self.scorer != "centroid":
            raise ValueError(f"rollout scorer {self.scorer!r} not supported (the cache keeps "
                             "centroids only); use scorer='centroid'")

    def _check_compress(self) -> None:
        """Raises on compress-mode settings that cannot work (rollout/compress.py runs them)."""
        if self.window < 1 or self.kv_budget <= self.window:
            raise ValueError(f"compress mode needs 1 <= window < kv_budget, got "
                             f"window={self.window}, kv_budget={self.kv_budget}")
        if self.compress_every < self.window:
            raise ValueError(f"compress_every={self.compress_every} must be >= "
                             f"window={self.window} (the observation window's queries are the last decode steps')")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"rkv_lambda must be in [0, 1], got {self.rkv_lambda}")

    def _check_gamma_by_bin(self) -> None:
        """Raises on a per-bin gamma plan the exact_sparse engines cannot run."""
        plan = self.gamma_by_bin
        # A plan dense in every bin (all 0, as calibration may find) drafts nothing: any gamma
        # runs it (gamma only sizes the cache slack then). Re-planning may raise a bin's gamma
        # up to `gamma` later: the plan may stay below it.
        top_ok = max(plan) <= self.gamma if self.replan_gammas else max(plan) == self.gamma
        if min(plan) < 0 or (not top_ok and max(plan) > 0):
            raise ValueError(f"RolloutConfig.gamma_by_bin={plan}: entries must be >= 0 and "
                             f"RolloutConfig.gamma={self.gamma} must be their largest "
                             f"({max(plan)}; it sizes the cache slack): set "
                             f"RolloutConfig.gamma = {max(plan)}")

    def _check_replan(self) -> None:
        """Raises on re-planning settings that cannot work (refused outside exact_sparse by
        the run plan, train/plan.py, as gamma_by_bin is: gin may set the mode elsewhere)."""
        cand, name = self.replan_gammas, "RolloutConfig.replan_gammas"
        if self.replan_every < 0 or self.replan_min_rounds < 1:
            raise ValueError(f"RolloutConfig.replan_every={self.replan_every} must be >= 0 (0: "
                             f"never) and replan_min_rounds={self.replan_min_rounds} >= 1")
        if self.replan_probe_after < 0:
            raise ValueError(f"RolloutConfig.replan_probe_after={self.replan_probe_after} must "
                             "be >= 0 (0: a dense bin is never probed)")
        if self.replan_every and not cand:
            raise ValueError(f"RolloutConfig.replan_every={self.replan_every} needs {name}: the "
                             "draft lengths the decode programs compile, e.g. (0, 1, 2, 4)")
        if not cand or self.mode != RolloutMode.EXACT_SPARSE:
            return
        if len(set(cand)) != len(cand) or len(cand) < 2 or min(cand) < 0:
            raise ValueError(f"{name}={cand}: at least two distinct draft lengths >= 0 (0: a "
                             "dense step), e.g. (0, 1, 2, 4)")
        if max(cand) != self.gamma:
            raise ValueError(f"{name}={cand}: RolloutConfig.gamma={self.gamma} must be their "
                             f"largest ({max(cand)}; it sizes the cache slack): set "
                             f"RolloutConfig.gamma = {max(cand)}")
        # The first plan's verified bins (gamma, the largest candidate, without a plan).
        missing = sorted(set(self.gamma_by_bin[:self.approximate_from_bin or None]) - set(cand))
        if missing:
            raise ValueError(f"RolloutConfig.gamma_by_bin runs gamma {missing}, not in {name}="
                             f"{cand} (the rounds the programs compile): add it to {name}")

    @property
    def replans(self) -> bool:
        """Whether the exact_sparse programs take the per-bin gamma table as an input
        (`replan_gammas` set): their round branches are the candidates, whatever the plan."""
        return bool(self.replan_gammas) and self.mode == RolloutMode.EXACT_SPARSE

    @property
    def round_gammas(self) -> tuple[int, ...]:
        """The draft lengths an exact_sparse round can run: `replan_gammas` when re-planning,
        else the distinct gamma_by_bin entries of the verified bins (0: a dense step), or
        (gamma,)."""
        if self.replans:
            return tuple(sorted(self.replan_gammas))
        verified = self.gamma_by_bin[:self.approximate_from_bin or None]
        return tuple(sorted(set(verified))) or (self.gamma,)

    @property
    def plans_per_bin(self) -> bool:
        """Whether an exact_sparse round's rows may differ in what they run (a gamma per bin,
        or approximate bins): the engines then pick each round's branch per batch."""
        return len(self.round_gammas) > 1 or bool(self.approximate_from_bin)

    @property
    def round_branches(self) -> tuple[str, ...]:
        """The names of an exact_sparse program's round branches, in branch order (what
        `Trajectories.round_counts` counts): "gamma_<g>" per round gamma, then "approximate"
        (unverified drafts) when the plan has approximate bins."""
        names = tuple(f"gamma_{g}" for g in self.round_gammas)
        return names + (("approximate",) if self.approximate_from_bin else ())

    def gamma_table(self, num_bins: int) -> tuple[int, ...]:
        """The gamma of each of num_bins length bins (or more, when gamma_by_bin is longer):
        gamma_by_bin with its last entry held beyond, or gamma in every bin."""
        plan = self.gamma_by_bin or (self.gamma,)
        return tuple(plan[min(j, len(plan) - 1)] for j in range(max(num_bins, len(plan))))

    def traced_plan(self, num_bins: int) -> tuple["RolloutConfig", np.ndarray | None]:
        """(the exact_sparse programs' static config, their per-bin gamma table input).
        Re-planning (`replans`): this config without gamma_by_bin - one program whatever the
        plan - and `gamma_table(num_bins)` as an int32 array [bins]; otherwise (self, None):
        the table is a constant of the program, as before re-planning existed."""
        if not self.replans:
            return self, None
        return self.without_traced_plan, np.asarray(self.gamma_table(num_bins), np.int32)

    @property
    def without_traced_plan(self) -> "RolloutConfig":
        """The static config a program of this rollout compiles with: re-planning, without
        gamma_by_bin (the exact programs take it as an input; no other program reads it), so
        that a new plan compiles nothing; otherwise self."""
        return dataclasses.replace(self, gamma_by_bin=()) if self.replans else self

    @property
    def decode_compiler_options(self) -> tuple[tuple[str, str], ...]:
        """The XLA options the decode programs compile with (`runtime.compiler_options`): none
        at the defaults. GPU options: other compilers ignore them."""
        options = []
        if self.decode_command_buffers != CommandBuffers.DEFAULT:
            options.append(("xla_gpu_enable_command_buffer",
                            COMMAND_BUFFER_TYPES[self.decode_command_buffers]))
        if self.decode_split_k:
            options.append(("xla_gpu_experimental_force_split_k", str(self.decode_split_k)))
        return tuple(options)

    @property
    def selection_backend(self) -> str:
        """The backend block selection is asked to run on (`selection.select_blocks`)."""
        return self.backend if self.selection == "auto" else "xla"

    def sparse_layer(self, i: int) -> bool:
        """Whether decoder layer i decodes block-sparse (sparse mode, or exact_sparse's draft;
        not in dense_layers)."""
        return (self.mode in (RolloutMode.SPARSE, RolloutMode.EXACT_SPARSE)
                and i not in self.dense_layers)

    def num_sparse_layers(self, num_layers: int) -> int:
        return sum(self.sparse_layer(i) for i in range(num_layers))

    def for_alpha_mode(self, alpha_mode: str) -> "RolloutConfig":
        """This config recording the vocabulary top-k per token only where the learner reads it:
        `LearnerConfig.alpha_mode == "topk"` (the paper's lower bound) keeps `record_topk`; "full"
        and "none" never read it, so they record width 0 (a top-k over the vocabulary every
        decode step is a full sort on GPU, and its [B, T, k] record a host copy)."""
        if alpha_mode == AlphaMode.TOPK:
            if self.record_topk <= 0:
                raise ValueError("LearnerConfig.alpha_mode='topk' needs RolloutConfig.record_topk"
                                 f" > 0, got {self.record_topk}")
            return self
        return dataclasses.replace(self, record_topk=0)

    def fit_selection_width(self, budgets: Sequence[int], *, also: int = 0
                            ) -> tuple["RolloutConfig", str | None]:
        """This config with `max_budget` - the static selection width, the tokens a sparse
        decode step gathers per KV head whatever the live budget - narrowed to the largest
        finite budget in `budgets` (and `also`, e.g. the controller's highest finite rung),
        rounded up to whole blocks and at least 3 (sink + 2 local). A wider width only gathers
        padding (measured: at 8K context a 1K budget under a 4K width cost more than dense
        attention). DENSE_BUDGET entries are always reachable: rows whose budget covers their
        length take the dense path. The one rule of the trainer, the dryrun, `sparrow rollout`
        and the benches.

        Returns (config, a log line saying what changed, or None). Raises ValueError when a
        finite budget exceeds `max_budget`; with no finite budget and no `also`, the config is
        returned as it is (nothing sparse to size)."""
        finite = [int(b) for b in budgets if b < DENSE_BUDGET]
        if finite and max(finite) > self.max_budget:
            raise ValueError(f"schedule budgets reach {max(finite)} tokens but RolloutConfig."
                             f"max_budget = {self.max_budget} (the selection width): raise "
                             "max_budget")
        top = max(finite + [also])
        if top <= 0:
            return self, None
        top = max(padded_length(top, self.block_size), 3 * self.block_size)
        if top >= self.max_budget:
            return self, None
        return (dataclasses.replace(self, max_budget=top),
                f"selection width: RolloutConfig.max_budget {self.max_budget} -> {top} tokens "
                "(the largest budget this run can reach)")

    @property
    def sampling(self) -> SamplingParams:
        """The sampled distribution; the learner takes it from here (one source of truth)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def cache_slots(self, prompt_width: int) -> int:
        """KV slots per row: prompt + generation; compress mode: its bound (see compress.py);
        exact_sparse: gamma more (a draft runs gamma tokens past the last recorded one)."""
        extra = self.gamma if self.mode == RolloutMode.EXACT_SPARSE else 0
        dense = padded_length(prompt_width + self.max_new_tokens + extra, self.block_size)
        if self.mode != RolloutMode.COMPRESS:
            return dense
        bound = max(prompt_width, self.kv_budget) + self.compress_every
        return min(padded_length(bound, self.block_size), dense)

    @property
    def prompt_ladder(self) -> tuple[int, ...]:
        """The prompt-width buckets: `prompt_buckets`, or two per octave from 64 tokens."""
        return self.prompt_buckets or default_buckets(1 << 17, multiple=self.block_size)

    def prompt_width(self, width: int) -> int:
        """The static prompt width (a bucket) for prompts of up to `width` tokens."""
        return bucket_length(width, self.prompt_ladder, multiple=self.block_size)


def rollout_config(schedule: Schedule, stop_ids: tuple[int, ...], pad_id: int, prompt_width: int,
                   *, max_new_tokens: int | None = None, mode: str | None = None
                   ) -> tuple[RolloutConfig, np.ndarray]:
    """RolloutConfig (gin + these settings) for generating with `schedule`, and the budgets
    array [num_bins] int32 handed to the engine (`sparrow rollout`, `sparrow eval`).

    mode None: RolloutConfig.mode, or dense when the schedule is dense. The static selection
    width is shrunk to the largest budget any sequence of this run can reach (prompt_width +
    max_new_tokens tokens): the sparse kernels gather `max_budget` tokens per KV head per step
    whatever the live budget is, so a wider width is pure waste. ValueError on a bad setting.
    """
    try:
        cfg = RolloutConfig()  # gin bindings apply here
    except ValueError as e:
        raise ValueError(f"bad RolloutConfig: {e}") from None
    overrides: dict = {"pad_token_id": pad_id,
                       "stop_token_ids": tuple(dict.fromkeys(cfg.stop_token_ids + stop_ids))}
    if max_new_tokens is not None:
        overrides["max_new_tokens"] = max_new_tokens
    mode = mode or ("dense" if schedule.is_dense else cfg.mode)
    if mode == RolloutMode.SPARSE and schedule.is_dense:
        raise ValueError("--mode sparse needs a sparse schedule (--schedule NAME|JSON or gin "
                         "make_schedule.name); the current schedule is dense")
    try:
        cfg = dataclasses.replace(cfg, mode=mode, **overrides)
    except ValueError as e:
        raise ValueError(f"bad RolloutConfig: {e}") from None
    budgets = np.asarray(schedule.budgets, np.int64)
    max_context = prompt_width + cfg.max_new_tokens
    if mode == RolloutMode.DENSE:
        return cfg, np.minimum(budgets, np.iinfo(np.int32).max).astype(np.int32)
    if schedule.block_size != cfg.block_size:
        raise ValueError(f"schedule block_size {schedule.block_size} != RolloutConfig.block_size "
                         f"{cfg.block_size}")
    finite = budgets[budgets < DENSE_BUDGET]     # the dense rung is always allowed
    if finite.size and finite.max() > cfg.max_budget:
        raise ValueError(
            f"schedule {schedule.name or ''} budget {int(finite.max())} exceeds "
            f"RolloutConfig.max_budget={cfg.max_budget} (the static selection width); pass "
            f"--gin_param 'RolloutConfig.max_budget = {int(finite.max())}' or a smaller schedule")
    # Bins beyond reach are never looked up: they take the last reachable bin's budget, so the
    # selection width (the shared rule, RolloutConfig.fit_selection_width) is sized by what
    # this run's sequences can reach.
    last_bin = min(max_context // schedule.bin_size, len(budgets) - 1)
    budgets[last_bin + 1:] = budgets[last_bin]
    cfg, note = cfg.fit_selection_width(budgets)
    if note:
        log.info("%s (within %d tokens)", note, max_context)
    return cfg, np.minimum(budgets, np.iinfo(np.int32).max).astype(np.int32)
