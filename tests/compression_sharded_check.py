"""Compress-mode rollout on a data=2 x model=4 mesh of 8 host CPU devices vs one device (run by
tests/test_compression.py::test_sharded_equals_unsharded).

XLA_FLAGS must be set before jax is imported, so this runs as its own process:
    python tests/compression_sharded_check.py OUT_DIR
One JSON line per case: KV heads sharded over model (4 KV heads) and replicated (2).
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
from sparrow_jax.rollout import RolloutConfig, generate  # noqa: E402
from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh  # noqa: E402

CASES = (("kv4_sharded_heads", 8, 4), ("kv2_replicated_heads", 4, 2))


def main(out_dir: str) -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()}"
    spec = ShardingSpec.create(make_mesh(2, 4))
    rng = np.random.default_rng(0)
    lens = np.asarray([20, 37], np.int32)
    toks = np.zeros((2, 37), np.int32)
    for i, n in enumerate(lens):
        toks[i, :n] = rng.integers(3, 96, n)
    cfg = RolloutConfig(max_new_tokens=100, temperature=1.0, mode="compress", backend="xla",
                        kv_budget=48, compress_every=16, window=8, compress_scorer="rkv")
    kw = dict(cfg=cfg, budgets=np.full(20, 4096, np.int32), group_size=2,
              rng=jax.random.key(5))
    for name, heads, kv_heads in CASES:
        path = os.path.join(out_dir, name)
        make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=heads, kv_heads=kv_heads,
                        head_dim=16, intermediate=80)
        ref = generate(load_hf(path, dtype=jnp.float32), toks, lens, **kw)
        got = generate(load_hf(path, dtype=jnp.float32, mesh=spec.mesh), toks, lens, spec=spec,
                       **kw)
        same = lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))  # noqa: E731
        print(json.dumps({
            "case": name,
            "tokens_equal": same(ref.tokens, got.tokens),
            "budgets_equal": same(ref.budgets, got.budgets),
            "evicted_equal": same(ref.evicted_at, got.evicted_at),
            "max_logprob_diff": float(np.max(np.abs(np.asarray(ref.logprobs)
                                                    - np.asarray(got.logprobs)))),
            "tokens_sharding": str(got.tokens.sharding.spec),
            "compressed": bool(int(np.asarray(ref.budgets).max()) <= 64
                               and int(np.asarray(ref.cached_lengths).max()) > 100),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
