"""Equivalent-FLOPs (eFLOPs) cost model of dense vs block-sparse decode (Kinetics style).

    cost = FLOPs + I * bytes,   I = peak_flops / hbm_bandwidth   (FLOPs per byte)

so a byte moved costs what the hardware could have computed while moving it. Per decode token
of one sequence, at context length ``ctx`` (tokens attended, the current one included):

- linear layers (q/k/v/o projections, gated MLP, LM head): ``2 * P`` FLOPs; their weights
  (``P * dtype_bytes``) are read once per decode step and shared by the ``batch`` sequences
  decoded together, so each token is charged ``P * dtype_bytes / batch`` bytes.
- dense attention, per layer: ``4 * Hq * ctx * D`` FLOPs (QK^T and PV) and the whole KV,
  ``2 * Hkv * ctx * D * dtype_bytes`` bytes.
- block-sparse attention (sparse layers only; ``dense_layers`` stay dense): when the sequence
  has more blocks than the budget, scoring reads one centroid per full block
  (``Hkv * (ctx // block) * D`` elements, ``2 *`` that many FLOPs) and attention reads
  ``budget`` tokens of KV; otherwise attention is exactly dense and costs the dense amount.
  Top-k selection over the ``ctx / block`` scores and the block-index traffic are ignored.

Prompt sharing within a GRPO group (``group_size`` samples of one prompt): the KV of the prompt
is *stored* once per group, but standard paged-attention decode kernels still *read* it once
per sequence, so by default every sequence pays its full reads (``prefix_sharing=False``,
matching the paper's SGLang/FlashInfer engines). With ``prefix_sharing=True`` (cascade /
shared-prefix kernels) the dense reads of the prompt KV, and the reads of the prompt's
centroids, are charged ``1 / group_size`` per sequence; the sparse gather of selected blocks is
per sequence either way because selections differ.

The bytes limit of a decode step (issue 55; `decode_step_bytes`): the bytes one step of a batch
must read - the weights once (shared by every row), each row's KV as attended (dense layers: the
row's cached length; sparse layers: min(budget, length) tokens plus one centroid per full block)
and the selection metadata (block ids; page-table entries on the paged engine) - divided by the
copy bandwidth measured on the same device is the shortest time the step can take. The benches
print a measured step's share of it. `learner_flops` counts the learner's model FLOPs (6 x params
per token and the causal attention terms) for its achieved FLOP/s against the device's peak.

Everything is host-side NumPy (float64): this is planning arithmetic, not a device kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from sparrow_jax.sparsity.schedule import DENSE_BUDGET, NUM_RESERVED_BLOCKS, Schedule

__all__ = [
    "ModelShape", "Hardware", "MODEL_SHAPES", "HARDWARE", "get_hardware", "hardware_for_device",
    "decode_token_cost", "StepBytes", "decode_step_bytes", "learner_flops", "rollout_cost",
    "predict_speedup", "choose_block_size",
]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Transformer shape for cost purposes (Qwen3-style GQA decoder with a gated MLP)."""

    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dense_layers: tuple[int, ...] = (0, 1)
    dtype_bytes: int = 2
    name: str = ""

    @property
    def linear_params(self) -> int:
        """Matmul parameters touched per decode token (layers + LM head; not the embedding)."""
        h, qd, kvd = self.hidden_size, self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * qd + 2 * h * kvd + qd * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer + h * self.vocab_size

    @property
    def num_dense_layers(self) -> int:
        return len({i for i in self.dense_layers if 0 <= i < self.num_layers})

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, dense_layers: Sequence[int] = (0, 1),
                       dtype_bytes: int | None = None, name: str = "") -> "ModelShape":
        """From a Hugging Face ``config.json`` dict (Qwen3/Llama field names)."""
        heads = int(config["num_attention_heads"])
        if dtype_bytes is None:
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
            dtype_bytes = _DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            num_q_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            dense_layers=tuple(int(i) for i in dense_layers),
            dtype_bytes=int(dtype_bytes),
            name=name or str(config.get("_name_or_path", "")),
        )

    @classmethod
    def named(cls, name: str) -> "ModelShape":
        key = name.strip().lower()
        if key not in MODEL_SHAPES:
            raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
        return MODEL_SHAPES[key]


def _qwen3(name: str, layers: int, hidden: int, q: int, inter: int) -> ModelShape:
    return ModelShape(layers, hidden, q, 8, 128, inter, 151936, (0, 1), 2, name)


# Public Qwen3 configs (all: 8 KV heads, head_dim 128, vocab 151936).
MODEL_SHAPES: dict[str, ModelShape] = {
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 28, 2048, 16, 6144),
    "qwen3-4b": _qwen3("qwen3-4b", 36, 2560, 32, 9728),
    "qwen3-8b": _qwen3("qwen3-8b", 36, 4096, 32, 12288),
    "qwen3-14b": _qwen3("qwen3-14b", 40, 5120, 40, 17408),
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: dense bf16 peak FLOP/s and HBM bandwidth (bytes/s), from the spec
    sheet; `measured_flops`: a bf16 matmul's FLOP/s measured on such a device, where one was
    (`measured_on` says where), which the learner's achieved FLOP/s is compared against;
    `device_kinds`: jax's `device_kind` strings of the device."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    measured_flops: float | None = None
    measured_on: str = ""
    device_kinds: tuple[str, ...] = ()

    @property
    def intensity(self) -> float:
        """I = FLOPs per byte: the equivalent-FLOPs price of one byte moved."""
        return self.peak_flops / self.hbm_bandwidth

    @property
    def learner_peak_flops(self) -> float:
        """The bf16 peak a learner's FLOP/s is a share of: measured where known, else the
        spec sheet's."""
        return self.measured_flops or self.peak_flops


# Public spec-sheet numbers (dense bf16, no sparsity; HBM bandwidth). The H200's bf16 matrix
# rate: ~790 TFLOP/s, an 8192^3 product on random data on the lent H200 machines (769-798 in the
# lender's machine notes; our copy kernel there: 3.59 TB/s, 2026-11-28). Our own device reports
# record it from the next run on: `sparrow doctor` prints `runtime.bandwidth.matmul_rate`.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 3.35e12,
                     device_kinds=("NVIDIA H100 80GB HBM3", "NVIDIA H100")),
    "h200": Hardware("h200", 989e12, 4.8e12, measured_flops=790e12,
                     measured_on="the lent H200 machines (8192^3 bf16, random data)",
                     device_kinds=("NVIDIA H200",)),
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 0.819e12, device_kinds=("TPU v5 lite", "TPU v5e")),
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 2.765e12, device_kinds=("TPU v5", "TPU v5p")),
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 1.64e12, device_kinds=("TPU v6 lite", "TPU v6e")),
}


def get_hardware(name: str | Hardware) -> Hardware:
    """By name: h100, h200, tpu-v5e / v5e, tpu-v5p / v5p, tpu-v6e / v6e."""
    if isinstance(name, Hardware):
        return name
    key = name.strip().lower()
    key = key if key in HARDWARE else f"tpu-{key}"
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]


def hardware_for_device(device_kind: str) -> Hardware | None:
    """The table's entry for a jax `device_kind` (e.g. "NVIDIA H200"), or None (a CPU, or a
    device the table does not know: no peak to compare against)."""
    kind = device_kind.strip().lower()
    for hw in HARDWARE.values():
        if any(kind == k.lower() for k in hw.device_kinds):
            return hw
    return None


def get_model_shape(model: ModelShape | str) -> ModelShape:
    """A shape as given, or by name from ``MODEL_SHAPES``."""
    return model if isinstance(model, ModelShape) else ModelShape.named(model)


def decode_token_cost(model: ModelShape | str, ctx: Any, budget: Any, *, block_size: int = 16,
                      batch: int = 1) -> dict[str, np.ndarray]:
    """Per-token decode cost components for one sequence.

    Args:
      model: shape (or a name from ``MODEL_SHAPES``).
      ctx: ``[N]`` context lengths attended (tokens, the current one included).
      budget: ``[N]`` (or scalar) KV budget in tokens for the sparse layers.
      block_size: KV block size (centroid count = ctx // block_size).
      batch: sequences decoded together (weight reads are shared by them).
    Returns:
      dict of ``[N]`` float64: ``linear_flops``, ``linear_bytes``, ``attn_flops``,
      ``kv_bytes``, ``centroid_flops``, ``centroid_bytes``, ``flops``, ``bytes``, plus
      ``full_kv_layers`` (layers reading the whole KV) and ``centroid_layers`` (layers
      scoring centroids), used for prefix-sharing corrections.
    """
    m = get_model_shape(model)
    ctx = np.asarray(ctx, np.float64)
    budget = np.broadcast_to(np.asarray(budget, np.float64), ctx.shape)
    hq, hkv, d, nbytes = m.num_q_heads, m.num_kv_heads, m.head_dim, m.dtype_bytes
    dense_flops = 4.0 * hq * d * ctx
    dense_bytes = m.kv_bytes_per_token * ctx
    # Sparse only when the sequence has more blocks than the budget: else it is exactly dense.
    budget_blocks = np.floor(budget / block_size)
    sparse_mode = np.ceil(ctx / block_size) > budget_blocks
    selected = budget_blocks * block_size
    centroids = np.floor(ctx / block_size)
    n_sparse, n_dense = m.num_sparse_layers, m.num_dense_layers
    out = {
        "linear_flops": np.full(ctx.shape, 2.0 * m.linear_params),
        "linear_bytes": np.full(ctx.shape, m.linear_params * nbytes / max(batch, 1)),
        "attn_flops": n_dense * dense_flops
        + n_sparse * np.where(sparse_mode, 4.0 * hq * d * selected, dense_flops),
        "kv_bytes": n_dense * dense_bytes
        + n_sparse * np.where(sparse_mode, m.kv_bytes_per_token * selected, dense_bytes),
        "centroid_flops": n_sparse * np.where(sparse_mode, 2.0 * hkv * d * centroids, 0.0),
        "centroid_bytes": n_sparse * np.where(sparse_mode, hkv * d * nbytes * centroids, 0.0),
        "full_kv_layers": n_dense + n_sparse * (~sparse_mode).astype(np.float64),
        "centroid_layers": n_sparse * sparse_mode.astype(np.float64),
    }
    out["flops"] = out["linear_flops"] + out["attn_flops"] + out["centroid_flops"]
    out["bytes"] = out["linear_bytes"] + out["kv_bytes"] + out["centroid_bytes"]
    return out


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step of a batch must read (`decode_step_bytes`)."""

    weights: float      # every matmul weight once (shared by the batch's rows)
    kv: float           # K and V as attended, every row and layer
    centroids: float    # the block centroids the sparse layers score
    metadata: float     # selected block ids; page-table entries (paged engine)

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.centroids + self.metadata

    def limit_seconds(self, bandwidth: float) -> float:
        """The bytes limit: the shortest time a step reading these bytes at `bandwidth`
        (bytes/s) can take."""
        return self.total / bandwidth

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "kv": self.kv, "centroids": self.centroids,
                "metadata": self.metadata, "total": self.total}


def decode_step_bytes(model: ModelShape | str, contexts: Any, budgets: Any = None, *,
                      block_size: int = 16, weight_bytes: int | None = None,
                      paged: bool = False) -> StepBytes:
    """The bytes one decode step of a batch must read (the module docstring's bytes limit).

    Args:
      model: shape (or a name from ``MODEL_SHAPES``); ``dense_layers`` stay dense in sparse
        decoding, ``dtype_bytes`` is the KV cache's element size.
      contexts: ``[B]`` tokens each row attends at this step (its cached tokens, the current
        one included).
      budgets: None for dense decoding (every layer reads each row's whole context), else
        ``[B]`` (or a scalar) KV budget in tokens of the sparse layers: a row with more blocks
        than its budget reads ``budget // block_size`` blocks and scores one centroid per full
        block (``decode_token_cost``'s rule); otherwise it reads its whole context.
      weight_bytes: bytes per weight as run (default ``dtype_bytes``); the LM head counts once
        (tied or not), the embedding's row gather not at all.
      paged: the paged engine: every layer also reads each row's page-table entries (int32,
        one per block of its context); the selected block ids (int32 per KV head) count in both
        engines.
    """
    m = get_model_shape(model)
    ctx = np.asarray(contexts, np.float64).reshape(-1)
    dense = budgets is None
    budget = np.broadcast_to(np.asarray(DENSE_BUDGET if dense else budgets, np.float64),
                             ctx.shape)
    per_row = decode_token_cost(m, ctx, budget, block_size=block_size)
    # Sparse layers in sparse mode read budget // block_size block ids per KV head.
    ids = per_row["centroid_layers"] * m.num_kv_heads * np.floor(budget / block_size) * 4
    table = m.num_layers * np.ceil(ctx / block_size) * 4 if paged else 0.0
    return StepBytes(
        weights=float(m.linear_params * (weight_bytes or m.dtype_bytes)),
        kv=float(per_row["kv_bytes"].sum()), centroids=float(per_row["centroid_bytes"].sum()),
        metadata=float(np.sum(ids + table)))


def learner_flops(model: ModelShape | str, rows: int, seq_len: int, *, passes: float = 1,
                  forwards: float = 0) -> float:
    """Model FLOPs of the learner over a batch of ``rows`` sequences of ``seq_len`` tokens
    (prompt + response, as padded):

        rows * seq_len * (passes * (6 N + 12 L Hq D c) + forwards * (2 N + 4 L Hq D c))

    N = ``linear_params`` (the LM head included, the embedding gather not), c = (seq_len + 1)
    / 2 the mean causal context of a token; ``passes`` forward+backward passes (3x a forward),
    ``forwards`` forward-only passes (an analysis pass, a sparse replay - counted as dense, an
    upper bound). Recomputation under remat is not counted: model FLOPs, as MFU counts them."""
    m = get_model_shape(model)
    c = (seq_len + 1) / 2.0
    attn = m.num_layers * m.num_q_heads * m.head_dim * c
    per_token = passes * (6.0 * m.linear_params + 12.0 * attn) \
        + forwards * (2.0 * m.linear_params + 4.0 * attn)
    return float(rows) * float(seq_len) * per_token


def _as_lengths(lengths: Any) -> np.ndarray:
    arr = np.asarray(lengths, np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.shape[0] == 0:
        raise ValueError(f"lengths must be a non-empty [N, 2] list of (prompt_len, response_len), got shape {arr.shape}")
    if (arr < 0).any():
        raise ValueError("lengths must be non-negative")
    return arr


def _schedule_budget(schedule: Schedule | None, cached: np.ndarray) -> np.ndarray:
    if schedule is None:
        return np.full(cached.shape, float(DENSE_BUDGET))
    table = np.asarray(schedule.budgets, np.float64)
    return table[np.minimum(cached // schedule.bin_size, schedule.num_bins - 1)]


def rollout_cost(model: ModelShape | str, hardware: Hardware | str, schedule: Schedule | None,
                 lengths: Any, *, batch: int = 256, group_size: int = 8,
                 prefix_sharing: bool = False, weights: Any = None) -> dict[str, float]:
    """Total decode cost of generating the given sequences (``schedule=None`` = dense).

    Args:
      lengths: ``[N, 2]`` (prompt_len, response_len) pairs; response token t (0-based) is
        decoded at context ``prompt_len + t + 1`` and uses the budget of that cached length.
      weights: optional ``[N]`` weights (a length distribution); default 1 each.
      batch, group_size, prefix_sharing: see the module docstring.
    Returns:
      dict of floats: totals of each ``decode_token_cost`` component, ``eflops``
      (= flops + I * bytes), ``seconds`` (= eflops / peak, one chip, ideal) and ``tokens``.
    """
    m, hw = get_model_shape(model), get_hardware(hardware)
    arr = _as_lengths(lengths)
    w = np.ones(len(arr)) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    prompt, resp = arr[:, 0], arr[:, 1]
    block = schedule.block_size if schedule is not None else 16
    ctx = np.arange(1, int((prompt + resp).max()) + 1)
    comp = decode_token_cost(m, ctx, _schedule_budget(schedule, ctx), block_size=block, batch=batch)

    def window_sum(x: np.ndarray) -> np.ndarray:
        # Per sequence: sum over ctx in (prompt, prompt + resp] via one cumulative sum.
        c = np.concatenate([[0.0], np.cumsum(x)])
        return c[prompt + resp] - c[prompt]

    totals = {k: float(np.dot(w, window_sum(v))) for k, v in comp.items() if not k.endswith("_layers")}
    if prefix_sharing and group_size > 1:
        share = 1.0 - 1.0 / group_size
        kv_saved = share * prompt * m.kv_bytes_per_token * window_sum(comp["full_kv_layers"])
        cent_saved = share * np.floor(prompt / block) * m.num_kv_heads * m.head_dim \
            * m.dtype_bytes * window_sum(comp["centroid_layers"])
        totals["kv_bytes"] -= float(np.dot(w, kv_saved))
        totals["centroid_bytes"] -= float(np.dot(w, cent_saved))
        totals["bytes"] -= float(np.dot(w, kv_saved + cent_saved))
    totals["eflops"] = totals["flops"] + hw.intensity * totals["bytes"]
    totals["seconds"] = totals["eflops"] / hw.peak_flops
    totals["tokens"] = float(np.dot(w, resp))
    return totals


def predict_speedup(model: ModelShape | str, hardware: Hardware | str, schedule: Schedule,
                    lengths: Any, *, batch: int = 256, group_size: int = 8,
                    prefix_sharing: bool = False, weights: Any = None) -> float:
    """Rollout decode speedup of ``schedule`` over dense: dense eFLOPs / sparse eFLOPs."""
    kw = dict(batch=batch, group_size=group_size, prefix_sharing=prefix_sharing, weights=weights)
    dense = rollout_cost(model, hardware, None, lengths, **kw)
    sparse = rollout_cost(model, hardware, schedule, lengths, **kw)
    return dense["eflops"] / sparse["eflops"]


def choose_block_size(model: ModelShape | str, hardware: Hardware | str, schedule: Schedule | int,
                      lengths: Any, *, candidates: Sequence[int] = (8, 16, 32, 64, 128),
                      schedules_by_block_size: Mapping[int, Schedule] | None = None,
                      batch: int = 256, group_size: int = 8,
                      prefix_sharing: bool = False) -> list[dict[str, Any]]:
    """Cost of each candidate block size, cheapest first.

    Without ``schedules_by_block_size`` every candidate gets the same token budgets
    (``schedule`` or a constant ``int`` budget, rounded up to whole blocks and >= 3 blocks):
    a pure *cost* comparison, in which larger blocks always win because fewer centroids are
    read. Block size also changes *quality* (coarser blocks waste budget on irrelevant
    tokens, so they need more tokens for the same tail alpha); pass quality-matched schedules
    (e.g. one calibration per block size) to compare at equal tail alpha, which is how the
    paper arrived at 16.

    Returns:
      list of dicts: ``block_size``, ``speedup``, ``eflops``, ``centroid_share`` (fraction
      of the sparse eFLOPs spent reading/scoring centroids), ``quality_matched``.
    """
    if isinstance(schedule, int):
        schedule = Schedule.constant(-(-schedule // 16) * 16)
    kw = dict(batch=batch, group_size=group_size, prefix_sharing=prefix_sharing)
    hw = get_hardware(hardware)
    dense = rollout_cost(model, hw, None, lengths, **kw)["eflops"]
    rows = []
    for bs in candidates:
        matched = schedules_by_block_size is not None and bs in schedules_by_block_size
        if matched:
            sched = schedules_by_block_size[bs]
        else:
            rounded = tuple(max(-(-min(b, DENSE_BUDGET // bs * bs) // bs), NUM_RESERVED_BLOCKS) * bs
                            for b in schedule.budgets)
            sched = Schedule(rounded, schedule.bin_size, bs, f"{schedule.name}@{bs}")
        cost = rollout_cost(model, hw, sched, lengths, **kw)
        centroid = cost["centroid_flops"] + hw.intensity * cost["centroid_bytes"]
        rows.append({"block_size": bs, "speedup": dense / cost["eflops"], "eflops": cost["eflops"],
                     "centroid_share": centroid / cost["eflops"], "quality_matched": matched})
    return sorted(rows, key=lambda r: r["eflops"])
