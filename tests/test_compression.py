"""KV-cache compression (RolloutConfig.mode = "compress"): R-KV / SnapKV scores == a NumPy float64
reference; budget >= every length == dense rollout; the cache really is bounded (array shapes and
live slots); the teacher-forced replay (direct and through the learner) reproduces the recorded
logprobs; groups + stop tokens; 8-device sharded == unsharded."""

import json
import os

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from hf_fixtures import make_tiny_qwen3, random_prompts, run_on_cpu_devices
from sparrow_jax.model import load_hf
from sparrow_jax.rollout import RolloutConfig, generate, start
from sparrow_jax.rollout import compress
from sparrow_jax.sparsity import compression

BIG = np.full(20, 4096, np.int32)
HERE = os.path.dirname(os.path.abspath(__file__))


# -- scores vs a float64 reference --------------------------------------------------------------
def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference(q_win, keys, length, window, lam, kernel=7, threshold=0.5):
    """One row, written from the method's description with loops: (rkv [H, n], snapkv [H, n])
    over the n = length - window candidates."""
    w, hq, d = q_win.shape
    hkv = keys.shape[0]
    g = hq // hkv
    n = length - window
    imp = np.zeros((hkv, n))
    red = np.zeros((hkv, n))
    for h in range(hkv):
        k = keys[h, :length]
        for j in range(w):
            logits = np.max([q_win[j, h * g + i] @ k[:n].T for i in range(g)], axis=0) / np.sqrt(d)
            imp[h] += _softmax(logits) / w
        imp[h] = [imp[h, max(0, t - kernel // 2):t + kernel // 2 + 1].max() for t in range(n)]
        kn = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
        sim = kn @ kn.T
        np.fill_diagonal(sim, 0.0)
        for r in range(length):
            dups = np.flatnonzero(sim[r] > threshold)
            sim[r, dups.max() if dups.size else 0] = 0.0     # R-KV: no duplicate -> column 0
        red[h] = _softmax(sim.mean(axis=0))[:n]
    return lam * imp - (1 - lam) * red, imp


@pytest.mark.parametrize("scorer", ["rkv", "snapkv"])
def test_scores_equal_numpy_float64_reference(scorer):
    rng = np.random.default_rng(0)
    b, w, hq, hkv, s, d = 3, 8, 4, 2, 48, 16
    keys = rng.standard_normal((b, hkv, s, d))
    # Near-duplicates (cosine > 0.5) so the "keep the newest copy" rule matters.
    keys[:, :, 20:30] = keys[:, :, 5:15] + 0.3 * rng.standard_normal((b, hkv, 10, d))
    q_win = rng.standard_normal((b, w, hq, d))
    lengths = np.asarray([48, 31, 17], np.int32)
    got = compression.scores(scorer, jnp.asarray(q_win, jnp.float32),
                             jnp.asarray(keys, jnp.float32), jnp.asarray(lengths), window=w,
                             lam=0.1)
    got = np.asarray(got)
    for r, n in enumerate(lengths):
        rkv, snap = _reference(q_win[r], keys[r], n, w, 0.1)
        want = rkv if scorer == "rkv" else snap
        np.testing.assert_allclose(got[r, :, :n - w], want, rtol=1e-5, atol=1e-6)
        assert np.isneginf(got[r, :, n - w:]).all()
        # The kept set: the top (budget - window) candidates by the head-summed score, then the
        # window.
        budget = n - w // 2 if n - w // 2 > w else n
        keep = np.asarray(compression.kept_slots(jnp.asarray(got[r:r + 1]), jnp.asarray([n]),
                                                 budget=budget, window=w))[0]
        top = np.sort(np.argsort(-want.sum(0), kind="stable")[:budget - w])
        np.testing.assert_array_equal(keep, np.concatenate([top, np.arange(n - w, n)]))


# -- rollouts on a tiny model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return load_hf(path, dtype=jnp.float32)



def _cfg(**kw):
    base = dict(max_new_tokens=150, temperature=1.0, mode="compress", backend="xla",
                kv_budget=48, compress_every=16, window=8)
    return RolloutConfig(**{**base, **kw})


def test_budget_above_every_length_equals_dense(tiny):
    toks, lens = random_prompts([7, 40])
    rng = jax.random.key(3)
    dense = generate(tiny, toks, lens, cfg=RolloutConfig(mode="dense", max_new_tokens=60,
                                                          backend="xla"),
                     budgets=BIG, group_size=2, rng=rng)
    # 40 + 60 = 100 tokens at most; the 112-token budget is below the 128-slot dense cache, so
    # the compaction is compiled in and checked every 16 steps, but never triggers.
    cfg = _cfg(max_new_tokens=60, kv_budget=112)
    assert cfg.kv_budget < cfg.cache_slots(64)
    comp = generate(tiny, toks, lens, cfg=cfg, budgets=BIG, group_size=2, rng=rng)
    np.testing.assert_array_equal(np.asarray(comp.tokens), np.asarray(dense.tokens))
    np.testing.assert_allclose(np.asarray(comp.logprobs), np.asarray(dense.logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(comp.topk_ids), np.asarray(dense.topk_ids))
    # Nothing evicted: every token saw its whole cached length.
    budgets, mask = np.asarray(comp.budgets), np.asarray(comp.mask)
    np.testing.assert_array_equal(budgets[:, 1:][mask[:, 1:]],
                                  np.asarray(comp.cached_lengths)[:, 1:][mask[:, 1:]])
    assert (np.asarray(comp.evicted_at) == compress.NEVER).all()


@pytest.mark.parametrize("scorer", ["rkv", "snapkv"])
def test_cache_is_bounded_and_replay_reproduces_logprobs(tiny, scorer):
    toks, lens = random_prompts([20, 37, 60], seed=1)
    cfg = _cfg(compress_scorer=scorer)
    state = start(tiny, toks, lens, cfg=cfg, group_size=2, rng=jax.random.key(1))
    plen = state.prompt_tokens.shape[1]                      # the prompt bucket (64)
    bound = max(plen, cfg.kv_budget) + cfg.compress_every     # 80: not prompt + 150 new tokens
    assert all(x.shape[2] == bound for x in state.cache.k + state.cache.v)
    traj, cache = compress.decode(tiny, state, cfg=cfg, return_cache=True)
    # The arrays: every layer's K and V hold `bound` slots per row, nothing else grows.
    assert all(x.shape == (6, 2, bound, 16) for x in cache.k + cache.v)
    assert all(x.shape[2] == 0 for x in cache.centroids)
    # The live slots, from the recorded counts and independently from the eviction record.
    budgets = np.asarray(traj.budgets)
    np.testing.assert_array_equal(compress.visible_counts(traj), budgets)
    row_plen = np.asarray(traj.prompt_lengths)
    row_bound = np.maximum(row_plen, cfg.kv_budget) + cfg.compress_every
    assert (budgets.max(axis=1) <= row_bound).all()
    assert (budgets[row_plen <= cfg.kv_budget].max() <= cfg.kv_budget + cfg.compress_every)
    assert (np.asarray(cache.lengths) <= row_bound).all()
    # Compression really happened: contexts reach 20 + 150 tokens, the caches hold <= 64.
    assert int(np.asarray(traj.cached_lengths).max()) > 200 and budgets.max() <= 76
    assert (np.asarray(traj.evicted_at) < compress.NEVER).sum(axis=-1).min() > 100
    # Exact teacher-forced replay of the compressed decode.
    replay = compress.replay_logprobs(tiny, traj)
    np.testing.assert_allclose(np.asarray(replay), np.asarray(traj.logprobs), atol=1e-5)
    # ... and it is not the dense policy: evictions changed the distribution.
    from sparrow_jax.rollout.teacher_forced import replay_logprobs as dense_replay
    gap = np.abs(np.asarray(dense_replay(tiny, traj)) - np.asarray(traj.logprobs)).max()
    assert gap > 1e-3


def test_learner_analysis_replays_compressed_rollout(tiny):
    from sparrow_jax.rl.learner import Learner, LearnerConfig, SparseReplay
    toks, lens = random_prompts([20, 37], seed=2)
    traj = generate(tiny, toks, lens, cfg=_cfg(max_new_tokens=100), budgets=BIG, group_size=2,
                    rng=jax.random.key(4))
    learner = Learner(tiny, LearnerConfig(alpha_mode="full", attention_chunk=32), group_size=2)
    replay = SparseReplay(bin_size=2000, max_selected=1, mode="compress")
    out = learner.analyze(traj, None, replay)
    mask = np.asarray(traj.mask)
    np.testing.assert_allclose(np.asarray(out.logp_sparse_replay)[mask],
                               np.asarray(traj.logprobs)[mask], atol=1e-5)
    alpha = np.asarray(out.alpha)[mask]
    assert (alpha <= 1 + 1e-6).all() and alpha.min() < 0.999     # evictions cost some alpha


def test_groups_and_stop_tokens(tiny):
    toks, lens = random_prompts([20, 37], seed=3)
    rng = jax.random.key(5)
    free = generate(tiny, toks, lens, cfg=_cfg(), budgets=BIG, group_size=3, rng=rng)
    # A stop id that row 0 first samples after its first compression (step >= 32): the same
    # rng replays the run up to there, so row 0 must stop exactly at that token.
    row0 = np.asarray(free.tokens[0])
    stop = next(int(t) for i, t in enumerate(row0) if i >= 40 and t not in row0[:i])
    first = int(np.flatnonzero(row0 == stop)[0])
    traj = generate(tiny, toks, lens, cfg=_cfg(stop_token_ids=(stop,)), budgets=BIG,
                    group_size=3, rng=rng)
    resp, mask = np.asarray(traj.response_lengths), np.asarray(traj.mask)
    assert resp[0] == first + 1 and np.asarray(traj.tokens)[0, first] == stop
    for r in range(6):
        toks_r = np.asarray(traj.tokens[r])
        hits = np.flatnonzero(toks_r[:resp[r]] == stop)
        assert hits.size == 0 or hits[0] == resp[r] - 1          # stops at its first stop id
        assert (np.asarray(traj.budgets)[r, resp[r]:] == 0).all()
    # Group rows share their prompt; the record still replays exactly with ragged ends.
    np.testing.assert_array_equal(np.asarray(traj.prompt_lengths), np.repeat(lens, 3))
    np.testing.assert_array_equal(np.asarray(traj.tokens)[0, :first + 1], row0[:first + 1])
    replay = compress.replay_logprobs(tiny, traj)
    np.testing.assert_allclose(np.asarray(replay)[mask], np.asarray(traj.logprobs)[mask],
                               atol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="compress_scorer"):
        _cfg(compress_scorer="h2o")
    with pytest.raises(ValueError, match="window"):
        _cfg(kv_budget=8)
    with pytest.raises(ValueError, match="compress_every"):
        _cfg(compress_every=4)
    with pytest.raises(ValueError, match="mode"):
        RolloutConfig(mode="evict")


@pytest.mark.slow       # ~30 s: `launch/local.sh test --all`
def test_sharded_equals_unsharded(tmp_path):
    rows = run_on_cpu_devices([os.path.join(HERE, "compression_sharded_check.py"), str(tmp_path)])
    assert len(rows) == 2
    for r in rows:
        assert r["tokens_equal"] and r["budgets_equal"] and r["evicted_equal"], r
        assert r["max_logprob_diff"] <= 1e-5, r
        assert r["tokens_sharding"] == "P('data',)", r
        assert r["compressed"], r


def test_bench_command_prints_table(capsys):
    """CPU twin of docs/compression.md's `python -m sparrow_jax.bench.compress` (the
    demo checkpoint and prompts; 2 prompts, 48 new tokens, budget 64, compressing every 16)."""
    from sparrow_jax.bench import compress as compress_bench
    repo = os.path.dirname(HERE)
    compress_bench.main(["--model", os.path.join(repo, "checkpoints/demo_sft"),
                         "--prompts", os.path.join(repo, "data/demo/eval.jsonl"),
                         "--num_prompts", "2", "--budgets", "64", "--max_new_tokens", "48",
                         "--compress_every", "16", "--bin_size", "64", "--num_bins", "3"])
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [r["arm"] for r in rows] == ["dense", "block top-k 64", "R-KV 64", "SnapKV 64"]
    table = [x for x in out.splitlines() if x.startswith("| ")]
    assert len(table) == 5 and "p5 alpha 0-64" in table[0]
    dense = rows[0]
    assert dense["alpha_mean"] > 0.9999
    for r in rows[2:]:     # compressed: a smaller cache than dense, fewer keys per token
        assert r["kv_bytes_per_sample"] < dense["kv_bytes_per_sample"], r
        assert r["keys_per_token"] < dense["keys_per_token"], r


def test_train_with_compressed_rollout(tmp_path):
    """`sparrow train` with TrainConfig.rollout_mode = 'compress': the learner's alpha replays the
    evictions (alpha = 1 would mean the replay ignored them), evaluation reports the mode."""
    import gin
    from hf_fixtures import make_tiny_synthetic_model
    from sparrow_jax import cli
    from sparrow_jax.data import synthetic
    from sparrow_jax.runtime.metrics import read_jsonl

    make_tiny_synthetic_model(tmp_path / "model")
    synthetic.write_jsonl(str(tmp_path / "train.jsonl"), 8, seed=0, k_range=(1, 1), num_letters=4)
    synthetic.write_jsonl(str(tmp_path / "eval.jsonl"), 2, seed=1, k_range=(1, 1), num_letters=4)
    run = tmp_path / "run"
    bindings = [
        f"TrainConfig.run_dir = '{run}'", f"TrainConfig.model_path = '{tmp_path / 'model'}'",
        f"TrainConfig.train_data = '{tmp_path / 'train.jsonl'}'",
        f"TrainConfig.eval_data = '{tmp_path / 'eval.jsonl'}'", "TrainConfig.eval_every = 2",
        "TrainConfig.reward = 'synthetic_exact'", "TrainConfig.reward_processes = 0",
        "TrainConfig.prompts_per_step = 2", "TrainConfig.group_size = 2",
        "TrainConfig.total_steps = 2", "TrainConfig.rollout_mode = 'compress'",
        "RolloutConfig.max_new_tokens = 64", "RolloutConfig.kv_budget = 32",
        "RolloutConfig.compress_every = 16", "RolloutConfig.backend = 'xla'",
        "LearnerConfig.learning_rate = 1e-3"]
    gin.clear_config()
    assert cli.main(["train", *[x for b in bindings for x in ("--gin_param", b)]]) == 0
    rows = read_jsonl(run)
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2
    assert all(r["alpha/alpha_min"] < 1.0 for r in steps), steps   # evictions change the actor
    assert "eval_compress/reward" in rows[-1] and "eval_dense/reward" in rows[-1]
