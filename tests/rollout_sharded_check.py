"""Sharded vs unsharded rollout on 8 host CPU devices (run by test_rollout_sharded.py).

XLA_FLAGS must be set before jax is imported, so this runs as its own process:
    python tests/rollout_sharded_check.py OUT_DIR
It prints one JSON line per (case, mode) comparing a data=2 x model=4 mesh rollout with the
single-device rollout of the same checkpoint, rng and prompts.
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
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from hf_fixtures import make_tiny_qwen3  # noqa: E402
from sparrow_jax.model import load_hf  # noqa: E402
from sparrow_jax.rl import learner_programs  # noqa: E402
from sparrow_jax.rl.learner import Learner, LearnerBatch, LearnerConfig  # noqa: E402
from sparrow_jax.rollout import RolloutConfig, continuous, generate, page_pool  # noqa: E402
from sparrow_jax.rollout.teacher_forced import build_sequences  # noqa: E402
from sparrow_jax.runtime.sharding import RESIDUAL_AXES, ShardingSpec, make_mesh  # noqa: E402

# (name, query heads, kv heads): 4 KV heads shard over model=4; 2 KV heads cannot, so the
# cache and the decode attention replicate heads while batch still shards over data.
CASES = (("kv4_sharded_heads", 8, 4), ("kv2_replicated_heads", 4, 2))
# Budgets of 4 then 6 blocks (bin of 48 tokens) against contexts up to ~157 tokens (10 blocks):
# selection really drops blocks, and the per-bin lookup is exercised.
BUDGETS = np.asarray([64] + [96] * 19, np.int32)


def prompts() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = np.asarray([20, 37], np.int32)
    toks = np.zeros((2, 37), np.int32)
    for i, n in enumerate(lengths):
        toks[i, :n] = rng.integers(3, 96, n)
    return toks, lengths


def gap_to_dense(by_mode: dict) -> float:
    """Largest |logprob| difference between the sparse and dense rollouts (same rng) over the
    positions before each row's first differing token: > 0 only if selection dropped blocks."""
    (dt, dl), (st, sl) = by_mode["dense"], by_mode["sparse"]
    gap = 0.0
    for row in range(dt.shape[0]):
        diff = np.flatnonzero(dt[row] != st[row])
        stop = diff[0] + 1 if diff.size else dt.shape[1]  # the first differing token included
        gap = max(gap, float(np.abs(dl[row, :stop] - sl[row, :stop]).max()))
    return gap


def compare(out_dir: str) -> list[dict]:
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()}"
    mesh = make_mesh(2, 4)
    spec = ShardingSpec.create(mesh)
    toks, lens = prompts()
    results = []
    for name, heads, kv_heads in CASES:
        path = os.path.join(out_dir, name)
        make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=heads, kv_heads=kv_heads,
                        head_dim=16, intermediate=80)
        single = load_hf(path, dtype=jnp.float32)
        sharded = load_hf(path, dtype=jnp.float32, mesh=mesh)
        # Distinct slices of an MLP kernel: 4 when it is really split over the model axis.
        kernel = sharded.layers[0].mlp.up_proj.kernel[...]
        model_shards = len({str(sh.index) for sh in kernel.addressable_shards})
        by_mode, refs = {}, {}
        # The reference of every run is the unsharded *static* rollout of its mode: the paged
        # engine gives the static engine's samples (tests/test_paged.py, unsharded), so the
        # sharded paged runs are held to it directly and no unsharded paged run is needed.
        # On the mesh: the paged engine (what the shipped configs run) in sparse mode on both
        # head layouts and in dense mode once (the replicated-heads dense path is the sparse
        # one's minus selection); the static engine once, sparse with sharded heads.
        modes = ("dense", "sparse") if name == "kv4_sharded_heads" else ("sparse",)
        runs = [("paged", mode) for mode in modes]
        if name == "kv4_sharded_heads":
            runs.append(("static", "sparse"))
        for engine, mode in runs:
            # The paged runs: a pool of 14 pages per data shard, which holds one group (2 samples
            # of ~10 pages each): preemption on the mesh too.
            extra = dict(engine="paged", max_slots=8, chunk_steps=32,
                         pool_bytes=14 * page_pool.page_bytes(single.config, jnp.float32, 16)
                         // (4 if name == "kv4_sharded_heads" else 1)) if engine == "paged" else {}
            base = dict(max_new_tokens=120, temperature=1.0, mode=mode, backend="xla",
                        max_budget=128, stop_token_ids=())
            kw = dict(cfg=RolloutConfig(**base, **extra), budgets=BUDGETS, bin_size=48,
                      group_size=2, rng=jax.random.key(5))
            if mode not in refs:
                ref = generate(single, toks, lens, **{**kw, "cfg": RolloutConfig(**base)})
                refs[mode] = ref
                by_mode[mode] = (np.asarray(ref.tokens), np.asarray(ref.logprobs))
            ref = refs[mode]
            got = generate(sharded, toks, lens, spec=spec, **kw)
            results.append({
                "case": name, "mode": mode, "engine": engine,
                "preemptions": continuous.LAST_STATS.preemptions if engine == "paged" else 0,
                "pools": continuous.LAST_STATS.pools if engine == "paged" else 0,
                "tokens_equal": bool(np.array_equal(np.asarray(ref.tokens),
                                                    np.asarray(got.tokens))),
                "mask_equal": bool(np.array_equal(np.asarray(ref.mask), np.asarray(got.mask))),
                "budgets_equal": bool(np.array_equal(np.asarray(ref.budgets),
                                                     np.asarray(got.budgets))),
                "max_logprob_diff": float(np.max(np.abs(np.asarray(ref.logprobs)
                                                        - np.asarray(got.logprobs)))),
                "max_cached_length": int(np.asarray(ref.cached_lengths).max()),
                "tokens_sharding": str(got.tokens.sharding.spec),
                "param_model_shards": model_shards,
                "gap_to_dense": gap_to_dense(by_mode) if len(by_mode) == 2 else None,
            })
    return results


def learner_update(out_dir: str) -> dict:
    """One GRPO step on the data=2 x model=4 mesh vs on one device, from the same rollout.

    Also checks where the Adam state lives: moments sharded like their parameter, the step
    counter replicated over the mesh (not parked on device 0)."""
    mesh = make_mesh(2, 4)
    spec = ShardingSpec.create(mesh)
    path = os.path.join(out_dir, CASES[0][0])     # written by compare()
    toks, lens = prompts()
    cfg = RolloutConfig(max_new_tokens=24, temperature=1.0, mode="dense", backend="xla",
                        stop_token_ids=())
    kw = dict(cfg=cfg, budgets=BUDGETS, bin_size=48, group_size=2, rng=jax.random.key(3))
    rewards = np.asarray([1.0, 0.0, 0.0, 1.0], np.float32)
    after, learners, grads, layout = {}, {}, {}, {}
    for name, mesh_or_none in (("single", None), ("sharded", mesh)):
        model = load_hf(path, dtype=jnp.float32, mesh=mesh_or_none)
        traj = generate(model, toks, lens, spec=spec if mesh_or_none else None, **kw)
        learner = Learner(model, LearnerConfig(learning_rate=1e-2, micro_batch_size=2),
                          group_size=2)
        batch = LearnerBatch(traj=traj, logp_old=learner.analyze(traj).logp_old,
                             advantages=learner.advantages(rewards))
        grads[name] = jax.tree.leaves(learner.grads(batch)[0])
        if mesh_or_none is not None:
            # Each micro-batch takes one row from each data shard (split_micro_batches'
            # row_shards=2); the contiguous layout (row_shards=1) must give the same gradient.
            layout["spread"] = learner.micro_batch_layout(traj.tokens)
            layout["contiguous"] = {**layout["spread"], "row_shards": 1}
            grads["spread"] = grads.pop(name)
            grads[name] = jax.tree.leaves(learner_programs.grads_program(
                learner.params, learner.rest, batch, jnp.zeros((1,), jnp.int32), jnp.int32(0),
                graphdef=learner.graphdef, opts=learner.opts, loss_cfg=learner.loss_cfg,
                replay=None, num_mini=1, **layout["contiguous"])[0])
        learner.update(batch)
        after[name] = jax.tree.leaves(learner.params)
        learners[name] = learner
    param_shardings = [x.sharding for x in jax.tree.leaves(learners["sharded"].params)]
    adam = next(x for x in jax.tree.leaves(learners["sharded"].opt_state,
                                           is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(x, optax.ScaleByAdamState))
    moments_like_params = all(
        m.sharding.is_equivalent_to(s, m.ndim)
        for tree in (adam.mu, adam.nu) for m, s in zip(jax.tree.leaves(tree), param_shardings))
    before = jax.tree.leaves(nnx.state(load_hf(path, dtype=jnp.float32), nnx.Param))
    seq_len = build_sequences(traj)[0].shape[1]
    return {"case": "learner_update", "moments_like_params": moments_like_params,
            # sequence-parallel residuals: tokens over `model` (constrained when they divide)
            "residual_spec": str(learners["sharded"].opts.residual_spec.sharding(RESIDUAL_AXES, (4, 64, 48)).spec),
            "seq_len_divides": seq_len % 4 == 0, "single_residual": str(
                learners["single"].opts.residual_spec),
            "counter_devices": len(adam.count.sharding.device_set),
            "max_param_diff": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                  for a, b in zip(after["single"], after["sharded"])),
            "max_param_step": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                  for a, b in zip(after["single"], before)),
            "layout": layout,
            "grad_scale": max(float(np.abs(np.asarray(g)).max()) for g in grads["single"]),
            **{f"max_grad_diff_{k}": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                         for a, b in zip(grads["single"], grads[k]))
               for k in ("sharded", "spread")}}


if __name__ == "__main__":
    for row in compare(sys.argv[1]):
        print(json.dumps(row), flush=True)
    print(json.dumps(learner_update(sys.argv[1])), flush=True)
