"""sparrow_jax.sparsity.cost_model: eFLOPs accounting, monotonicity, speedup limits."""

import numpy as np
import pytest

from sparrow_jax.sparsity.cost_model import (
    HARDWARE, MODEL_SHAPES, ModelShape, StepBytes, choose_block_size, decode_step_bytes,
    decode_token_cost, get_hardware, hardware_for_device, learner_flops, predict_speedup,
    rollout_cost,
)
from sparrow_jax.sparsity.schedule import Schedule

M = MODEL_SHAPES["qwen3-1.7b"]


def test_named_shapes_and_hf_config():
    hf = {"num_hidden_layers": 28, "hidden_size": 2048, "num_attention_heads": 16,
          "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
          "vocab_size": 151936, "torch_dtype": "bfloat16"}
    shape = ModelShape.from_hf_config(hf, name="qwen3-1.7b")
    assert shape == M
    # Qwen3-1.7B has ~1.7B parameters counting the (tied) embedding once.
    assert 1.5e9 < M.linear_params < 2.1e9
    assert MODEL_SHAPES["qwen3-14b"].num_sparse_layers == 38
    assert ModelShape.from_hf_config({**hf, "head_dim": None, "torch_dtype": "float32"}).dtype_bytes == 4
    assert ModelShape.named("QWEN3-8B").hidden_size == 4096
    with pytest.raises(ValueError, match="known"):
        ModelShape.named("llama-70b")


def test_hardware():
    assert get_hardware("v5e") is HARDWARE["tpu-v5e"]
    assert get_hardware("H200").intensity == pytest.approx(989e12 / 4.8e12)
    with pytest.raises(ValueError, match="h100"):
        get_hardware("a100")


def test_decode_cost_by_hand():
    m = ModelShape(4, 64, 4, 2, 16, 128, 100, dense_layers=(0,), dtype_bytes=2)
    lin = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 100
    c = decode_token_cost(m, [100, 100], [1000, 48], block_size=16, batch=4)
    assert c["linear_flops"][0] == 2 * lin and c["linear_bytes"][0] == lin * 2 / 4
    dense_attn = 4 * 4 * 16 * 100
    assert c["attn_flops"][0] == 4 * dense_attn and c["centroid_bytes"][0] == 0
    # Budget 48 < 100: 3 sparse layers attend 48 tokens and score 6 centroids.
    assert c["attn_flops"][1] == dense_attn + 3 * 4 * 4 * 16 * 48
    assert c["kv_bytes"][1] == 2 * 2 * 16 * 2 * (100 + 3 * 48)
    assert c["centroid_bytes"][1] == 3 * 2 * 16 * 2 * 6
    assert c["full_kv_layers"].tolist() == [4, 1] and c["centroid_layers"].tolist() == [0, 3]


def test_step_bytes_by_hand():
    """The bytes one decode step must read (issue 55's bytes limit), counted by hand for a tiny
    shape: 4 layers (layer 0 dense), hidden 64, 4 query / 2 KV heads of 16, MLP 128, vocab 100,
    bf16; two rows at contexts 100 and 40, budget 48 tokens (3 blocks of 16)."""
    m = ModelShape(4, 64, 4, 2, 16, 128, 100, dense_layers=(0,), dtype_bytes=2)
    # weights: per layer q 64x64 + k, v 2 x 64x32 + o 64x64 + gate/up/down 3 x 64x128, then the
    # LM head 64x100 once (tied or not; the embedding's row gather is not counted)
    weights = (4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 100) * 2
    assert weights == 307_712
    kv_token = 2 * 2 * 16 * 2          # K and V x 2 KV heads x 16 x 2 bytes = 128 per layer
    # row 0 (100 tokens = 7 blocks > 3): layer 0 reads 100 tokens, layers 1-3 read 48 each and
    # score floor(100 / 16) = 6 centroids (2 heads x 16 x 2 bytes each) and read 3 block ids
    # per KV head (int32); row 1 (40 tokens = 3 blocks, not more than 3): dense in all 4
    kv = kv_token * (100 + 3 * 48) + kv_token * 4 * 40
    centroids = 3 * 2 * 16 * 2 * 6
    ids = 3 * 2 * 3 * 4
    sparse = decode_step_bytes(m, [100, 40], 48)
    assert sparse == StepBytes(weights=weights, kv=kv, centroids=centroids, metadata=ids)
    assert (kv, centroids, ids) == (51_712, 1_152, 72)
    assert sparse.total == 307_712 + 51_712 + 1_152 + 72
    # dense: every layer reads each row's whole context; nothing is selected
    assert decode_step_bytes(m, [100, 40]) == StepBytes(weights, kv_token * 4 * 140, 0, 0)
    # paged: every layer also reads each row's page-table entries, ceil(ctx / 16) int32
    paged = decode_step_bytes(m, [100, 40], 48, paged=True)
    assert paged.metadata == ids + 4 * (7 + 3) * 4
    # weights as run: f32 weights over a bf16 cache
    assert decode_step_bytes(m, [100], weight_bytes=4).weights == 2 * weights
    # the limit: bytes over the bandwidth
    assert sparse.limit_seconds(1e9) == pytest.approx(sparse.total / 1e9)


def test_step_bytes_match_the_h200_arithmetic():
    """SPEC section 4: Qwen3-1.7B bf16, batch 32 at 8K: 3.44 GB of weights, 30.1 GB of KV
    dense (9.3 ms at 3.59 TB/s); budget 1024 on 26 sparse layers + 2 dense + centroids ~2.8 ms."""
    dense = decode_step_bytes(M, [8192] * 32)
    sparse = decode_step_bytes(M, [8192] * 32, 1024)
    assert dense.weights == pytest.approx(3.44e9, rel=1e-3)
    assert dense.kv == pytest.approx(30.06e9, rel=1e-3)
    assert dense.limit_seconds(3.59e12) == pytest.approx(9.33e-3, rel=1e-2)
    assert sparse.limit_seconds(3.59e12) == pytest.approx(2.77e-3, rel=1e-2)


def test_learner_flops_by_hand():
    m = ModelShape(2, 8, 2, 1, 4, 16, 10, dtype_bytes=2)
    n = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16) + 8 * 10      # 1168 matmul weights
    c = (6 + 1) / 2                                                # mean causal context
    attn = 2 * 2 * 4 * c                                           # layers x Hq x D x c
    assert learner_flops(m, 3, 6) == 3 * 6 * (6 * n + 12 * attn)
    assert learner_flops(m, 3, 6, passes=2, forwards=1) == 3 * 6 * (
        2 * (6 * n + 12 * attn) + 2 * n + 4 * attn)


def test_hardware_by_device_kind():
    h200 = hardware_for_device("NVIDIA H200")
    assert h200 is HARDWARE["h200"] and h200.learner_peak_flops == 790e12    # measured there
    assert hardware_for_device("NVIDIA H100 80GB HBM3").learner_peak_flops == 989e12
    assert hardware_for_device("cpu") is None and hardware_for_device("TPU v5 lite").name == "tpu-v5e"


def test_monotone_in_budget_and_context():
    ctx = np.array([4000, 8000, 16000, 32000])
    for hw in HARDWARE:
        costs = [rollout_cost(M, hw, Schedule.constant(b), [(500, 8000)])["eflops"]
                 for b in (256, 512, 1024, 2048, 4096, 8192)]
        assert np.all(np.diff(costs) > 0), hw
    c = decode_token_cost(M, ctx, 1024)
    e = c["flops"] + HARDWARE["h100"].intensity * c["bytes"]
    assert np.all(np.diff(e) > 0)
    d = decode_token_cost(M, ctx, 1 << 30)
    ed = d["flops"] + HARDWARE["h100"].intensity * d["bytes"]
    assert np.all(ed > e) and np.all(np.diff(ed / e) > 0)  # gap widens with context
    short = rollout_cost(M, "h200", None, [(500, 1000)])["eflops"]
    long = rollout_cost(M, "h200", None, [(500, 2000)])["eflops"]
    assert long > 2 * short  # per-token cost grows with context


def test_speedup_limits():
    lengths = [(300, 20000), (300, 30000), (1000, 8000)]
    for name in MODEL_SHAPES:
        s = predict_speedup(name, "h200", Schedule.named(f"{name}-0.86"), lengths)
        assert 1.3 < s < 20, (name, s)
    # Budget covering the whole context: exactly dense.
    assert predict_speedup(M, "h100", Schedule.constant(4096), [(100, 3000)]) == pytest.approx(1.0)
    assert predict_speedup(M, "h100", Schedule.dense(), lengths) == pytest.approx(1.0)
    # Bigger batches amortise weights, so attention (what sparsity saves) dominates more.
    s = Schedule.named("qwen3-1.7b-0.86")
    assert predict_speedup(M, "h200", s, lengths, batch=1024) > predict_speedup(M, "h200", s, lengths, batch=8)


def test_prefix_sharing_and_weights():
    s = Schedule.constant(1024)
    base = rollout_cost(M, "h200", s, [(8000, 4000)], group_size=8)
    shared = rollout_cost(M, "h200", s, [(8000, 4000)], group_size=8, prefix_sharing=True)
    assert shared["bytes"] < base["bytes"] and shared["flops"] == base["flops"]
    assert rollout_cost(M, "h200", s, [(8000, 4000)], group_size=1, prefix_sharing=True) == base
    # Dense with sharing: the prompt KV read is divided by the group size, exactly.
    d0 = rollout_cost(M, "h200", None, [(8000, 10)], group_size=4)
    d1 = rollout_cost(M, "h200", None, [(8000, 10)], group_size=4, prefix_sharing=True)
    assert d0["kv_bytes"] - d1["kv_bytes"] == pytest.approx(
        0.75 * 8000 * M.kv_bytes_per_token * M.num_layers * 10)
    two = rollout_cost(M, "h200", s, [(100, 5000), (100, 9000)], weights=[1, 3])
    one = rollout_cost(M, "h200", s, [(100, 5000), (100, 9000), (100, 9000), (100, 9000)])
    assert two["eflops"] == pytest.approx(one["eflops"]) and two["tokens"] == 32000
    with pytest.raises(ValueError, match="prompt_len, response_len"):
        rollout_cost(M, "h200", s, [100, 200])


def test_choose_block_size():
    lengths = [(300, 24000)]
    rows = choose_block_size(M, "h200", Schedule.named("qwen3-1.7b-0.86"), lengths)
    assert sorted(r["block_size"] for r in rows) == [8, 16, 32, 64, 128]
    by = {r["block_size"]: r for r in rows}
    # Equal token budgets: bigger blocks read fewer centroids.
    assert by[8]["centroid_share"] > by[16]["centroid_share"] > by[64]["centroid_share"]
    assert rows[0]["eflops"] <= rows[-1]["eflops"] and not rows[0]["quality_matched"]
    # Quality-matched: if 64-token blocks need 2x the tokens, 16 wins.
    sched16 = Schedule.constant(2048)
    rows = choose_block_size(M, "h200", sched16, lengths, candidates=(16, 64),
                             schedules_by_block_size={16: sched16,
                                                      64: Schedule.constant(4096, block_size=64)})
    assert rows[0]["block_size"] == 16 and rows[0]["quality_matched"]
    assert choose_block_size(M, "h200", 1000, lengths, candidates=(16,))[0]["speedup"] > 1


def test_matmul_rate_is_a_rate_on_data():
    """`runtime.bandwidth.matmul_rate` (what `sparrow doctor` prints on an accelerator): chained
    products stay finite (rescaled each time) and the rate is FLOPs over a positive time."""
    import math

    import jax.numpy as jnp

    from sparrow_jax.runtime.bandwidth import matmul_rate
    rate = matmul_rate(n=128, products=3, iters=2, dtype=jnp.float32)
    assert math.isfinite(rate) and rate > 0
