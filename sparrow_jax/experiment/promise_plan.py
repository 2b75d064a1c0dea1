"""The time plan of `sparrow promise` on one device, and a decode step's bytes-vs-launches balance.

Both are host-side arithmetic from the numbers measured so far on the lent H200 (no device is
touched): the bytes one decode step must read (`sparsity.cost_model.decode_step_bytes`) at the
measured copy bandwidth and the decode kernels' share of it, the kernel launches per step of the
2026-11-28 census (docs/benchmarks.md, "Kernels per decode step": 17 per dense layer, 30 per
sparse layer, ~27 outside the layers) at a measured cost per launch, the compile plan's program
counts (`train.compile_plan`) at per-layer compile seconds from the H200 device checks, and the
learner's model FLOPs (`cost_model.learner_flops`) at a share of the H200's measured bf16 peak.
`DeviceNumbers` holds each assumption with its source; `time_plan` turns a registered config
into expected seconds per part, which docs/devices/README.md lists and the stage's timeouts
bound.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from sparrow_jax.sparsity.cost_model import ModelShape, decode_step_bytes, learner_flops

__all__ = ["DeviceNumbers", "H200", "Balance", "step_balance", "decode_step_seconds",
           "rollout_seconds", "answer_lengths", "PlannedPart", "TimePlan", "time_plan"]


@dataclasses.dataclass(frozen=True)
class DeviceNumbers:
    """What the plan assumes of the device, each from a measurement (the sources in comments
    are docs/devices/2026-11-28-nvidia-h200.md and docs/benchmarks.md)."""
    name: str = "h200"
    copy_bandwidth: float = 3.59e12      # bytes/s: the H200's copy kernel, 2026-11-28
    decode_bw_share: float = 0.55        # the decode attention kernel's share of it (dense 50% at
                                         # 8K, 62% at 32K; sparse 30-50%: 0.55 over a step)
    launch_s: float = 5e-6               # seconds per kernel launch of a small model's decode
                                         # step: the 11-28 profile's 2.5 us idle gap per launch
                                         # plus ~2.5 us for a kernel of a few KB
    dense_layer_launches: int = 17       # the 2026-11-28 census, per decode step
    sparse_layer_launches: int = 30
    step_launches: int = 28              # outside the layers (27.4 per step in 32-step chunks)
    learner_flops_per_s: float = 790e12 * 0.25   # a quarter of the measured bf16 peak: a small
                                         # model's learner is bound by its many small kernels
    process_start_s: float = 12.0        # a `sparrow` child: Python, jax, the CUDA context, model
    # Compile seconds per decoder layer (decode programs of the 1.7B model on 11-28: dense 6.0-
    # 6.8 s, sparse 30.0-30.5 s, prefill 7.8-9.2 s at 28 layers; the learner's "minutes at full
    # depth" of the device-check notes taken as 3 s a layer)
    compile_per_layer: tuple[tuple[str, float], ...] = (
        ("rollout/paged_decode:dense", 0.25), ("rollout/paged_decode:sparse", 1.1),
        ("rollout/paged_decode:exact_sparse", 1.4), ("rollout/paged_prefill", 0.32),
        ("learner/grads", 3.0), ("learner/analyze", 1.2), ("learner/apply", 0.1),
        ("eval/reference", 1.0))
    compile_base_s: float = 2.0          # per program, whatever its depth
    reward_s_per_token: float = 0.15e-6  # the synthetic rewards' decode + compare, per token
    exact_acceptance: float = 0.8        # exact sparse: the draft's acceptance per token (CPU demo
                                         # runs: 0.80; the long task's drafts are not measured)

    def compile_seconds(self, program: str, layers: int) -> float:
        per = dict(self.compile_per_layer)
        return self.compile_base_s + per.get(program, per.get(program.split(":")[0], 1.0)) * layers


H200 = DeviceNumbers()


@dataclasses.dataclass(frozen=True)
class Balance:
    """One decode step's bytes against its launches (`step_balance`)."""
    kv_bytes: float
    weight_bytes: float
    other_bytes: float             # centroids and block ids / page tables
    bytes_limit_s: float           # every byte at the decode kernels' bandwidth
    launches: int
    launch_floor_s: float          # launches x the cost of one

    @property
    def kv_share(self) -> float:
        """The KV's share of the step's bytes."""
        return self.kv_bytes / max(self.kv_bytes + self.weight_bytes + self.other_bytes, 1.0)

    @property
    def bytes_over_launches(self) -> float:
        """> 1: the step is bound by its bytes; < 1: by its launches."""
        return self.bytes_limit_s / max(self.launch_floor_s, 1e-12)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "kv_share": self.kv_share,
                "bytes_over_launches": self.bytes_over_launches}


def launches_per_step(shape: ModelShape, sparse: bool, dev: DeviceNumbers = H200) -> int:
    """Kernels one decode step launches: every layer dense, or `shape.dense_layers` dense and
    the rest sparse."""
    if not sparse:
        return dev.step_launches + shape.num_layers * dev.dense_layer_launches
    return (dev.step_launches + shape.num_dense_layers * dev.dense_layer_launches
            + shape.num_sparse_layers * dev.sparse_layer_launches)


def step_balance(shape: ModelShape, contexts, budgets=None, *, dev: DeviceNumbers = H200,
                 block_size: int = 16) -> Balance:
    """The bytes vs launches of one paged decode step of rows at `contexts` ([B] tokens
    attended); `budgets` None = dense, else the sparse layers' budget per row (or one)."""
    b = decode_step_bytes(shape, contexts, budgets, block_size=block_size, paged=True)
    n = launches_per_step(shape, budgets is not None, dev)
    return Balance(kv_bytes=b.kv, weight_bytes=b.weights, other_bytes=b.centroids + b.metadata,
                   bytes_limit_s=b.total / (dev.copy_bandwidth * dev.decode_bw_share),
                   launches=n, launch_floor_s=n * dev.launch_s)


def decode_step_seconds(balance: Balance) -> float:
    """A step's expected seconds: its bytes and its launches, not overlapped (a small model's
    kernels are too short to hide launch gaps behind)."""
    return balance.bytes_limit_s + balance.launch_floor_s


def answer_lengths(rows: int, k_range: tuple[int, int], group_size: int = 1) -> np.ndarray:
    """Generated tokens per row of the synthetic task at K in `k_range` (81 per cycle + 2 +
    <eos>), K spread evenly over the range per group: the rollout's expected lengths."""
    from sparrow_jax.data.synthetic import target_tokens
    groups = max(1, rows // max(group_size, 1))
    ks = np.round(np.linspace(k_range[0], k_range[1], groups)).astype(int)
    return np.repeat([target_tokens(int(k)) + 1 for k in ks], max(group_size, 1))[:rows]


def rollout_seconds(shape: ModelShape, lengths: Sequence[int], prompt_len: int, *,
                    mode: str, budget_at=None, gamma: int = 4, dev: DeviceNumbers = H200,
                    stride: int = 64) -> float:
    """Seconds of a paged rollout of rows generating `lengths` tokens after `prompt_len`:
    every step's `decode_step_seconds` over the rows still running (sampled every `stride`
    steps). mode dense | sparse | exact_sparse; `budget_at(context) -> budget` of the sparse
    layers (sparse and exact_sparse's drafts). Exact sparse: gamma draft steps and one dense
    verify per round, (1 - a^(gamma+1)) / (1 - a) tokens per round at the assumed acceptance."""
    lengths = np.asarray(lengths)
    total = 0.0
    for t in range(0, int(lengths.max()), stride):
        ctx = prompt_len + t + 1 + np.zeros(int((lengths > t).sum()))
        dense = decode_step_seconds(step_balance(shape, ctx, None, dev=dev))
        if mode == "dense":
            step = dense
        else:
            budgets = np.asarray([budget_at(int(c)) for c in ctx])
            sparse = decode_step_seconds(step_balance(shape, ctx, budgets, dev=dev))
            if mode == "sparse":
                step = sparse
            else:
                a = dev.exact_acceptance
                per_round = (1 - a ** (gamma + 1)) / (1 - a)
                step = (gamma * sparse + dense) / per_round
        total += step * min(stride, int(lengths.max()) - t)
    return total


@dataclasses.dataclass(frozen=True)
class PlannedPart:
    part: str
    seconds: float
    basis: str


@dataclasses.dataclass(frozen=True)
class TimePlan:
    parts: tuple[PlannedPart, ...]
    limit_s: float

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.parts)

    def lines(self) -> list[str]:
        rows = [f"| {p.part} | {p.seconds:.0f} s | {p.basis} |" for p in self.parts]
        return (["| part | expected | where the seconds go |", "|---|---|---|", *rows,
                 f"| **total** | **{self.total:.0f} s** | of the {self.limit_s:.0f} s limit |"])

    def as_dict(self) -> dict:
        return {"parts": [dataclasses.asdict(p) for p in self.parts], "total_s": self.total,
                "limit_s": self.limit_s}


@dataclasses.dataclass(frozen=True)
class ArmShape:
    """What one arm's seconds depend on: its mode, the programs its compile plan counts before
    step 1 (name -> count; names as `compile_plan` gives them, decode programs suffixed with
    the mode), and whether it evaluates at step 0."""
    name: str
    mode: str
    programs: tuple[tuple[str, int], ...]
    eval_at_start: bool


def time_plan(shape: ModelShape, arms: Sequence[ArmShape], *, rows: int, group_size: int,
              k_range: tuple[int, int], prompt_len: int, steps: int, budget_at, gamma: int,
              warmup_s: float, limit_s: float, references: int, reference_len: int,
              cached: Sequence[str] = (), dev: DeviceNumbers = H200) -> TimePlan:
    """Expected seconds of each part of `sparrow promise` (module docstring). `cached`: program
    names that a later arm loads from the persistent compile cache once an earlier one compiled
    them (the learner's and the references' are the same programs in every arm)."""
    lengths = answer_lengths(rows, k_range, group_size)
    seq = prompt_len + int(lengths.max())
    parts = [PlannedPart("start, data", 5.0, "the command's imports; the task's prompt files"),
             PlannedPart("warm-up", dev.process_start_s + warmup_s + 5.0,
                         f"`sparrow sft`: start {dev.process_start_s:.0f} s, "
                         f"SFTConfig.max_seconds = {warmup_s:.0f} (compiles inside), save and "
                         "pack ~5 s")]
    learner_s = learner_flops(shape, rows, seq, passes=1) / dev.learner_flops_per_s
    analyze_s = learner_flops(shape, rows, seq, passes=0, forwards=1) / dev.learner_flops_per_s
    ref_s = 2 * learner_flops(shape, references, reference_len, passes=0, forwards=1) \
        / dev.learner_flops_per_s
    reward_s = rows * lengths.mean() * dev.reward_s_per_token
    seen: set[str] = set()
    for arm in arms:
        compile_s = 0.0
        for program, count in arm.programs:
            if program in seen and program.split(":")[0] in cached:
                continue
            compile_s += count * dev.compile_seconds(program, shape.num_layers)
        seen.update(p for p, _ in arm.programs)
        roll = rollout_seconds(shape, lengths, prompt_len, mode=arm.mode, budget_at=budget_at,
                               gamma=gamma, dev=dev)
        probe = analyze_s if arm.mode == "sparse" else 0.0
        step = roll + reward_s + learner_s + probe + ref_s
        evals = (steps + int(arm.eval_at_start)) * ref_s
        seconds = dev.process_start_s + compile_s + steps * step + evals
        parts.append(PlannedPart(
            f"arm {arm.name}", seconds,
            f"start {dev.process_start_s:.0f} s; compiles {compile_s:.0f} s "
            f"({', '.join(f'{n} x{c}' for n, c in arm.programs)}); {steps} RL steps of "
            f"{step:.0f} s (rollout {roll:.0f}, reward {reward_s:.1f}, learner {learner_s:.1f}"
            + (f", probe {probe:.1f}" if probe else "") + f"); held-out references "
            f"{steps + int(arm.eval_at_start)} x {ref_s:.1f} s"))
    parts.append(PlannedPart("report", 3.0, "metrics read, report and pooled results written"))
    return TimePlan(tuple(parts), limit_s)
