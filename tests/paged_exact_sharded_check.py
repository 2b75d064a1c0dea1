"""Exact sparse on the paged engine on a data=2 x model=4 mesh of 8 host CPU devices vs the
unsharded static engine's exact sparse rollout (run by test_paged_exact.py).

XLA_FLAGS must be set before jax is imported, so this runs as its own process:
    python tests/paged_exact_sharded_check.py OUT_DIR
It prints one JSON line per case: 4 KV heads (sharded over model) and 2 (replicated).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hf_fixtures import make_tiny_qwen3  # noqa: E402
from sparrow_jax.model import load_hf  # noqa: E402
from sparrow_jax.rollout import RolloutConfig, continuous, generate, page_pool  # noqa: E402
from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh  # noqa: E402

BUDGETS = np.asarray([64] + [96] * 19, np.int32)      # 4 then 6 blocks per 48-token bin


def main(out_dir: str) -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()}"
    mesh = make_mesh(2, 4)
    spec = ShardingSpec.create(mesh)
    r = np.random.default_rng(0)
    lens = np.asarray([20, 37], np.int32)
    toks = np.zeros((2, 37), np.int32)
    for i, n in enumerate(lens):
        toks[i, :n] = r.integers(3, 96, n)
    for name, heads, kv_heads in (("kv4_sharded_heads", 8, 4), ("kv2_replicated_heads", 4, 2)):
        path = os.path.join(out_dir, name)
        make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=heads, kv_heads=kv_heads,
                        head_dim=16, intermediate=80)
        single = load_hf(path, dtype=jnp.float32)
        sharded = load_hf(path, dtype=jnp.float32, mesh=mesh)
        base = dict(max_new_tokens=60, temperature=1.0, mode="exact_sparse", gamma=3,
                    backend="xla", max_budget=128, dense_layers=())
        kw = dict(budgets=BUDGETS, bin_size=48, group_size=2, rng=jax.random.key(5))
        ref = generate(single, toks, lens, cfg=RolloutConfig(**base), **kw)
        # 9 pages per data shard (a page's bytes per device: its heads' share): a group of 2
        # samples of ~7 pages each does not fit at once, so samples are preempted.
        pool = 9 * page_pool.page_bytes(single.config, jnp.float32, 16) // (
            4 if kv_heads == 4 else 1)
        cfg = RolloutConfig(**base, engine="paged", max_slots=8, chunk_steps=8, pool_bytes=pool)
        got = generate(sharded, toks, lens, spec=spec, cfg=cfg, **kw)
        m = np.asarray(ref.mask)
        print(json.dumps({
            "case": name, "pools": continuous.LAST_STATS.pools,
            "preemptions": continuous.LAST_STATS.preemptions,
            "tokens_equal": bool(np.array_equal(np.asarray(ref.tokens), np.asarray(got.tokens))),
            "mask_equal": bool(np.array_equal(m, np.asarray(got.mask))),
            "accepted_equal": bool(np.array_equal(np.asarray(ref.accepted),
                                                  np.asarray(got.accepted))),
            "max_logprob_diff": float(np.abs(np.asarray(ref.logprobs)[m]
                                             - np.asarray(got.logprobs)[m]).max()),
            "accept_rate": float(np.asarray(got.accepted)[m].mean()),
            "tokens_sharding": str(got.tokens.sharding.spec)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
