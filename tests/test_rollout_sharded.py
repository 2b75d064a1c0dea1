"""Rollout and one learner step on a data=2 x model=4 mesh of 8 CPU devices equal the single-device ones.

The comparison runs in a subprocess (tests/rollout_sharded_check.py) because the 8 host devices
come from XLA_FLAGS, which must be set before jax is first imported - and this test process has
already imported jax with one device.
"""

import os

import pytest

from hf_fixtures import run_on_cpu_devices

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    rows = run_on_cpu_devices([os.path.join(HERE, "rollout_sharded_check.py"), str(out)])
    return {(r["case"], r.get("mode"), r.get("engine", "static")): r for r in rows}


def test_sharded_static_rollout_equals_unsharded(results):
    """The static engine on the mesh (sparse, heads sharded over model; the paged engine's
    runs below cover both head layouts and dense mode)."""
    case, mode = "kv4_sharded_heads", "sparse"
    r = results[(case, mode, "static")]
    assert r["tokens_equal"], r
    assert r["mask_equal"] and r["budgets_equal"], r
    assert r["max_logprob_diff"] <= 1e-5, r
    # The run really was sharded: rows over data, MLP weights split 4 ways over model.
    assert r["tokens_sharding"] == "P('data',)" and r["param_model_shards"] == 4, r
    # Long enough for sparsity to bind (~157 tokens = 10 blocks vs 4-6 block budgets): the
    # sparse logprobs move away from the dense ones drawn with the same rng.
    assert r["max_cached_length"] > 150, r
    assert r["gap_to_dense"] > 1e-3, r


@pytest.mark.parametrize("case,mode", [("kv4_sharded_heads", "dense"),
                                       ("kv4_sharded_heads", "sparse"),
                                       ("kv2_replicated_heads", "sparse")])
def test_sharded_paged_rollout_equals_unsharded(results, case, mode):
    """The paged engine on the 2x4 mesh (a pool per data shard, KV heads over model where they
    divide it, preemption on both) gives the unsharded static engine's samples (the unsharded
    paged engine gives those too: tests/test_paged.py)."""
    r = results[(case, mode, "paged")]
    assert r["tokens_equal"] and r["mask_equal"] and r["budgets_equal"], r
    assert r["max_logprob_diff"] <= 1e-5, r
    assert r["tokens_sharding"].startswith("P('data'") and r["pools"] == 2, r
    assert r["preemptions"] > 0 and r["max_cached_length"] > 150, r


def test_sharded_learner_update_equals_unsharded(results):
    r = results[("learner_update", None, "static")]
    assert r["max_param_step"] > 1e-4, r             # the step really changed the weights
    # Adam's first step is ~lr * sign(grad): reduction-order noise on near-zero gradients moves
    # a few weights by a fraction of the step, nothing more.
    assert r["max_param_diff"] <= 0.01 * r["max_param_step"], r
    assert r["moments_like_params"], r                # Adam moments sharded like their weight
    assert r["counter_devices"] == 8, r               # step counter replicated, not on device 0
    # Micro-batches of contiguous rows, and of one row from each data shard: both give the
    # full-batch gradient of one device.
    assert r["layout"] == {"contiguous": {"num_micro": 2, "row_shards": 1},
                           "spread": {"num_micro": 2, "row_shards": 2}}, r
    for k in ("sharded", "spread"):
        assert r[f"max_grad_diff_{k}"] <= 1e-4 * r["grad_scale"], r
    # ... with the residual stream between layers split over the model axis (sequence
    # parallelism: 1/4 of each row's saved activations per device); one device: no constraint.
    assert r["residual_spec"] == "P('data', 'model', None)", r
    assert r["seq_len_divides"] and r["single_residual"] == "None", r
