"""Exact sparse rollout (rollout/speculative.py, rollout/exact.py): the acceptance rule gives the
dense policy's distribution (chi-square at scale on a toy autoregressive model, and the same
test rejects a planted bug), greedy tokens equal dense greedy, sampled tokens pass a PIT test
against a teacher-forced dense pass, and recorded logprobs equal that pass to 1e-5."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hf_fixtures import copies_of_shape, make_sharp_tiny_model, random_prompts, spy_compiled_text
from sparrow_jax.rollout import RolloutConfig, dense_attention, exact, generate, speculative
from sparrow_jax.rollout.sampling import sampling_logprobs
from sparrow_jax.rollout.teacher_forced import replay_logprobs, trajectory_hidden

# -- the rule at scale, on a toy autoregressive model -----------------------------------------
V, M, GAMMA, DEPTH = 4, 4099, 3, 3


def _toy_tables(top_k: int):
    """p(.|prefix) and q(.|prefix) from tables indexed by a hash of the prefix; q is p's
    logits plus noise (alpha ~0.8). Returns sampled log-prob tables [M, V] each."""
    r = np.random.default_rng(7)
    wp = 1.5 * r.standard_normal((M, V))
    wq = wp + 0.9 * r.standard_normal((M, V))
    logp = sampling_logprobs(jnp.asarray(wp, jnp.float32), temperature=1.0, top_k=top_k)
    logq = sampling_logprobs(jnp.asarray(wq, jnp.float32), temperature=1.0, top_k=top_k)
    return logp, logq


def _push(h, tok):
    return (h * 31 + tok + 1) % M


def _simulate(logp, logq, n: int, seed: int, limits: bool = False, depth: int = DEPTH,
              stats: dict | None = None) -> np.ndarray:
    """n continuations by draft + verify rounds until each has `depth` tokens -> [n, depth];
    limits: each row offers a random 0..GAMMA of its drafts per round (a per-bin gamma).
    stats["bonus_first"]: rows whose first round accepted all GAMMA drafts (token GAMMA + 1
    is then that round's bonus, sampled from p)."""
    key = jax.random.key(seed)
    h = jnp.zeros((n,), jnp.int32)
    out = jnp.zeros((n, depth + GAMMA + 1), jnp.int32)
    count = jnp.zeros((n,), jnp.int32)
    rows = jnp.arange(n)[:, None]
    for round_no in range(depth):                           # every round gains >= 1 token
        key, kd, ku, kg = jax.random.split(key, 4)
        hs, drafts = [h], []
        for j in range(GAMMA):
            x = jax.random.categorical(jax.random.fold_in(kd, j), logq[hs[-1]])
            drafts.append(x)
            hs.append(_push(hs[-1], x))
        drafts = jnp.stack(drafts, 1)
        p_logp = jnp.stack([logp[x] for x in hs], 1)                    # [n, G+1, V]
        q_logp = jnp.stack([logq[x] for x in hs[:-1]], 1)               # [n, G, V]
        limit = (jax.random.randint(jax.random.fold_in(ku, 1), (n,), 0, GAMMA + 1)
                 if limits else None)
        num, nxt, _ = speculative.speculative_accept(
            p_logp, q_logp, drafts, jax.random.uniform(ku, (n, GAMMA)),
            jax.random.gumbel(kg, (n, GAMMA + 1, V)), limit=limit)
        if round_no == 0 and stats is not None:
            stats["bonus_first"] = int(jnp.sum(num == GAMMA))
        j = jnp.arange(GAMMA + 1)[None]
        new = jnp.where(j < num[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
        keep = (j <= num[:, None]) & (count[:, None] + j < depth)
        out = out.at[rows, jnp.where(keep, count[:, None] + j, out.shape[1])].set(new,
                                                                                mode="drop")
        for jj in range(GAMMA + 1):
            h = jnp.where(keep[:, jj], _push(h, new[:, jj]), h)
        count = count + keep.sum(1)
    assert bool(jnp.all(count == depth))
    return np.asarray(out[:, :depth])


def _dense_probs(logp, depth: int = DEPTH) -> np.ndarray:
    """Exact P(x1, .., x_depth) of dense sampling, [V**depth] in itertools.product order."""
    lp = np.asarray(logp, np.float64)
    probs = []
    for seq in itertools.product(range(V), repeat=depth):
        h, total = 0, 0.0
        for t in seq:
            total += lp[h, t]
            h = (h * 31 + t + 1) % M
        probs.append(np.exp(total))
    return np.asarray(probs)


def _chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    depth = samples.shape[1]
    cells = (samples * (V ** np.arange(depth - 1, -1, -1))).sum(1)
    counts = np.bincount(cells, minlength=V ** depth).astype(np.float64)
    expected = probs / probs.sum() * len(samples)
    live = expected > 0
    if counts[~live].sum():
        return 0.0                            # samples outside the reference's support
    small = live & (expected < 5)           # pool sparse cells so the chi-square is valid
    obs = np.append(counts[live & ~small], counts[small].sum())
    exp = np.append(expected[live & ~small], expected[small].sum())
    return float(stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue)


N_SCALE = 40_000


@pytest.mark.parametrize("top_k,limits", [(0, False), (3, True)])
def test_accept_rule_first_three_tokens_match_dense_sampling(top_k, limits):
    """limits: rows offer a random 0..GAMMA of their drafts per round (a per-bin gamma, 0 = a
    dense step): the token after the last offered draft is p's bonus, so it stays dense."""
    logp, logq = _toy_tables(top_k)
    samples = _simulate(logp, logq, N_SCALE, seed=1, limits=limits)
    assert _chi_square_p(samples, _dense_probs(logp)) > 1e-3
    # ... and they differ from the draft's own distribution (the test has power).
    assert _chi_square_p(samples, _dense_probs(logq)) < 1e-6


def test_accept_rule_bonus_token_matches_dense_sampling():
    """The joint law of the first GAMMA + 1 = 4 tokens at top_k = 0: a first round that
    accepts all 3 drafts ends with the bonus token sampled from p_gamma, which a 3-token test
    never sees. It must keep the joint law dense too (and that case must occur often)."""
    logp, logq = _toy_tables(0)
    stats = {}
    samples = _simulate(logp, logq, N_SCALE, seed=3, depth=GAMMA + 1, stats=stats)
    assert stats["bonus_first"] > N_SCALE // 10           # the bonus is the 4th token often
    assert _chi_square_p(samples, _dense_probs(logp, GAMMA + 1)) > 1e-3
    assert _chi_square_p(samples, _dense_probs(logq, GAMMA + 1)) < 1e-6


def test_chi_square_catches_planted_bug(monkeypatch):
    """The same test with the classic bug, accepting with min(1, q/p): rejected decisively."""
    monkeypatch.setattr(speculative, "accept_probability",
                        lambda p_x, q_x: jnp.minimum(1.0, q_x / jnp.maximum(p_x, 1e-30)))
    logp, logq = _toy_tables(0)
    samples = _simulate(logp, logq, N_SCALE, seed=1)
    assert _chi_square_p(samples, _dense_probs(logp)) < 1e-6


def test_first_draft_acceptance_rate_is_alpha():
    logp, logq = _toy_tables(0)
    n = 20_000
    h = jnp.asarray(np.random.default_rng(3).integers(0, M, n), jnp.int32)
    key = jax.random.key(4)
    x = jax.random.categorical(key, logq[h])
    num, _, alpha = speculative.speculative_accept(
        jnp.stack([logp[h], logp[_push(h, x)]], 1), logq[h][:, None], x[:, None],
        jax.random.uniform(jax.random.key(5), (n, 1)), jax.random.gumbel(key, (n, 2, V)))
    rate, a = float(jnp.mean(num)), float(jnp.mean(alpha))
    assert abs(rate - a) < 4 * np.sqrt(a * (1 - a) / n)
    assert 0.5 < a < 0.95
    # The prediction (1 - a^(g+1)) / (1 - a) at its ends.
    assert float(speculative.expected_tokens_per_pass(1.0, 4)) == 5.0
    assert float(speculative.expected_tokens_per_pass(0.0, 4)) == pytest.approx(1.0)


def test_greedy_accept_rule():
    logits = jnp.asarray([[[0, 5, 1], [2, 2, 0], [0, 0, 9]],      # argmaxes 1, 0 (tie), 2
                          [[0, 5, 1], [2, 2, 0], [0, 0, 9]]], jnp.float32)
    num, nxt = speculative.greedy_accept(logits, jnp.asarray([[1, 0], [1, 1]]))
    assert num.tolist() == [2, 1] and nxt.tolist() == [2, 0]


@pytest.mark.parametrize("one_pass", [True, False])
def test_verify_attention_cascade_equals_causal_attention(one_pass, monkeypatch):
    """The verify pass's cascade (the prefix in one XLA pass, or through the dense decode
    kernel, + causal attention among the new tokens, merged by log-sum-exp) == plain masked
    causal attention over the cache; an empty prefix (row 0) too."""
    if not one_pass:
        monkeypatch.setattr(dense_attention, "ONE_PASS_BYTES", 0)
    b, c, hq, hkv, d, s = 3, 5, 4, 2, 16, 64
    r = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(r[0], (b, c, hq, d))
    k = jax.random.normal(r[1], (b, hkv, s, d))
    v = jax.random.normal(r[2], (b, hkv, s, d))
    starts = jnp.asarray([0, 30, 59])
    k_new = jnp.stack([k[i, :, int(t):int(t) + c] for i, t in enumerate(starts)]).transpose(0, 2, 1, 3)
    v_new = jnp.stack([v[i, :, int(t):int(t) + c] for i, t in enumerate(starts)]).transpose(0, 2, 1, 3)
    got = exact.verify_attention(q, k, v, starts, k_new, v_new, backend="xla")
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    scores = jnp.einsum("bckgd,bksd->bckgs", qg, k) * d ** -0.5
    visible = jnp.arange(s)[None, None, :] <= (starts[:, None] + jnp.arange(c))[..., None]
    p = jax.nn.softmax(jnp.where(visible[:, :, None, None], scores, -jnp.inf), axis=-1)
    want = jnp.einsum("bckgs,bksd->bckgd", p, v).reshape(b, c, hq, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


# -- the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """hf_fixtures.make_sharp_tiny_model: drafts at a 3-block budget get rejected."""
    return make_sharp_tiny_model(tmp_path_factory.mktemp("tiny_sharp"))



BUDGETS = np.full(8, 48, np.int32)           # 3 blocks: sink + 2 local
KW = dict(backend="xla", max_budget=64, dense_layers=())


@pytest.mark.slow
@pytest.mark.guard      # the exactness of exact sparse rollout is checked in CI
def test_greedy_exact_sparse_equals_dense_greedy(sharp):
    """Ragged prompts, a stop (token 18 ends row 2 at its 21st token: found from this
    fixture's dense greedy output) and long tails to max_new_tokens; sparse greedy differs
    from dense on ~30% of these tokens, so drafts get rejected."""
    toks, lens = random_prompts([40, 70, 9, 23], seed=2)
    kw = dict(max_new_tokens=48, temperature=0.0, stop_token_ids=(18,), **KW)
    dense = generate(sharp, toks, lens, cfg=RolloutConfig(mode="dense", **kw), budgets=BUDGETS)
    # A gamma per 24-token bin (0: dense steps), so rows cross bins and rounds mix them (two
    # branches: each distinct gamma compiles one more round into the program).
    plan = (2, 0, 2)
    ex = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, cfg=RolloutConfig(
        mode="exact_sparse", gamma=2, gamma_by_bin=plan, **kw))
    np.testing.assert_array_equal(np.asarray(ex.tokens), np.asarray(dense.tokens))
    np.testing.assert_array_equal(np.asarray(ex.response_lengths),
                                  np.asarray(dense.response_lengths))
    np.testing.assert_allclose(np.asarray(ex.logprobs), np.asarray(dense.logprobs), atol=1e-5)
    lens_out = np.asarray(dense.response_lengths)
    assert lens_out.min() < 30 and lens_out.max() == 48
    acc, mask = np.asarray(ex.accepted), np.asarray(ex.mask)
    assert 0 < acc.sum() < mask.sum() - mask.shape[0] - 10     # > 10 rejections
    rows = exact.acceptance_by_bin(ex, gamma=plan, bin_size=24)
    for r in rows:        # no round offers more drafts than its bin's gamma; dense bins none
        assert r["gamma"] == plan[min(r["bin"], 2)] and r["tokens_per_pass"] <= r["gamma"] + 1
    dense_bin = next(r for r in rows if r["bin"] == 1)      # dense steps: 1 token a round
    assert dense_bin["rounds"] > 20 and dense_bin["tokens_per_pass"] == 1.0


@pytest.mark.slow
def test_verify_guided_drafts_and_a_mixed_plan_keep_verified_tokens_dense_greedy(sharp):
    """Verify-guided drafts (the blocks the last verify pass attended most): greedy tokens
    still equal dense greedy, and the drafts differ from the centroid-scored ones (other
    alphas). A mixed plan - bin 0 dense steps, bin 1 gamma 2, bins 2+ approximate
    sparse - keeps every token before a row's first approximate bin dense greedy's; the
    approximate tokens are unverified drafts recording their budget, no acceptance, no
    alpha."""
    toks, lens = random_prompts([40, 70, 9, 23], seed=2)
    kw = dict(max_new_tokens=48, temperature=0.0, stop_token_ids=(18,), **KW)
    dense = generate(sharp, toks, lens, cfg=RolloutConfig(mode="dense", **kw), budgets=BUDGETS)
    cfg = RolloutConfig(mode="exact_sparse", gamma=2, **kw)
    four = np.full(8, 64, np.int32)        # 4 blocks: one chosen besides sink + 2 local
    centroid = generate(sharp, toks, lens, budgets=four, cfg=cfg)
    guided = generate(sharp, toks, lens, budgets=four,
                      cfg=dataclasses.replace(cfg, draft_scorer="verify"))
    np.testing.assert_array_equal(np.asarray(guided.tokens), np.asarray(dense.tokens))
    np.testing.assert_allclose(np.asarray(guided.logprobs), np.asarray(dense.logprobs),
                               atol=1e-5)
    fin = np.isfinite(np.asarray(centroid.alpha))      # the drafts' distributions differ
    assert np.abs(np.asarray(guided.alpha)[fin] - np.asarray(centroid.alpha)[fin]).max() > 1e-3
    mixed = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=32, cfg=dataclasses.replace(
        cfg, gamma_by_bin=(0, 2, 1), approximate_from_bin=2, draft_scorer="verify"))
    plen = np.asarray(lens)
    t = np.arange(48)[None]
    m = np.asarray(mixed.mask)
    approx = ((plen[:, None] + t) // 32 >= 2) & m        # cached length at the token's round
    budgets = np.asarray(mixed.budgets)
    first = np.argmax(approx | ~m, axis=1)              # a row's first approximate token
    for r in range(4):
        np.testing.assert_array_equal(np.asarray(mixed.tokens)[r, :first[r]],
                                      np.asarray(dense.tokens)[r, :first[r]])
    assert approx.sum() > 40 and (budgets[~approx & m] == 0).all()
    # A round that started in bin 1 may run over into bin 2 (its tokens verified); from a
    # row's first unverified token on, every token is an approximate draft.
    unverified = budgets > 0
    assert unverified.sum() > 30 and (budgets[unverified] == 48).all()
    assert not np.asarray(mixed.accepted)[unverified].any()
    assert np.isnan(np.asarray(mixed.alpha)[unverified]).all()
    # Verified rounds: dense steps in bin 0; in the approximate bins only the dense steps the
    # batch ran for a row still in bin 0 (an approximate row takes that round's dense token).
    rows = exact.acceptance_by_bin(mixed, gamma=(0, 2, 1), bin_size=32)
    assert rows[1]["bin"] == 1 and rows[1]["tokens_per_pass"] > 1
    assert all(r["tokens_per_pass"] == 1.0 for r in rows if r["bin"] != 1)


@pytest.mark.slow
@pytest.mark.guard
def test_sampled_tokens_are_dense_samples_and_logprobs_are_dense(sharp):
    """Randomised PIT: for tokens sampled from the dense conditionals, F(x-) + u p(x) is i.i.d.
    uniform; the conditionals come from a teacher-forced dense pass over the trajectories."""
    toks, lens = random_prompts([40, 65, 12, 30], seed=1)
    cfg = RolloutConfig(mode="exact_sparse", gamma=3, max_new_tokens=48, temperature=1.0,
                        record_topk=4, **KW)
    traj = generate(sharp, toks, lens, cfg=cfg, budgets=BUDGETS, group_size=12,
                    rng=jax.random.key(2))
    mask = np.asarray(traj.mask)
    replay = np.asarray(replay_logprobs(sharp, traj))
    np.testing.assert_allclose(replay[mask], np.asarray(traj.logprobs)[mask], atol=1e-5)
    hidden = trajectory_hidden(sharp, traj)
    probs = np.asarray(jax.nn.softmax(sharp.logits(hidden), -1), np.float64)     # [B, T, V]
    tok = np.asarray(traj.tokens)
    cdf_before = np.take_along_axis(np.cumsum(probs, -1) - probs, tok[..., None], -1)[..., 0]
    p_tok = np.take_along_axis(probs, tok[..., None], -1)[..., 0]
    u = cdf_before + np.random.default_rng(0).random(tok.shape) * p_tok
    counts = np.histogram(u[mask], bins=20, range=(0, 1))[0]
    assert mask.sum() > 2000
    assert stats.chisquare(counts).pvalue > 1e-3
    # Per-token records: drafts were rejected sometimes; alpha is a probability where defined.
    acc, alpha = np.asarray(traj.accepted), np.asarray(traj.alpha)
    assert 0.3 < acc[mask].mean() < 0.75
    fin = np.isfinite(alpha) & mask
    assert fin.sum() > mask.sum() / 2 and ((alpha[fin] > 0) & (alpha[fin] <= 1 + 1e-5)).all()
    assert np.asarray(traj.budgets).max() == 0
    rows = exact.acceptance_by_bin(traj, gamma=3, bin_size=2000)
    assert rows[0]["rounds"] > 100 and 1 <= rows[0]["tokens_per_pass"] <= 4


def test_bad_settings():
    with pytest.raises(ValueError, match="gamma"):
        RolloutConfig(mode="exact_sparse", gamma=0)
    with pytest.raises(ValueError, match="static engine only"):
        RolloutConfig(mode="compress", engine="paged")
    with pytest.raises(ValueError, match="mode must be one of"):
        RolloutConfig(mode="exactsparse")
    with pytest.raises(ValueError, match=r"gamma=4 must be their largest \(2"):
        RolloutConfig(mode="exact_sparse", gamma_by_bin=(2, 0))
    with pytest.raises(ValueError, match="draft_scorer must be one of"):
        RolloutConfig(mode="exact_sparse", draft_scorer="attention")
    with pytest.raises(ValueError, match="approximate_from_bin=-1: a bin index"):
        RolloutConfig(mode="exact_sparse", approximate_from_bin=-1)
    cfg = RolloutConfig(mode="exact_sparse", gamma=2, gamma_by_bin=(2, 0, 2, 1))
    assert cfg.round_gammas == (0, 1, 2) and cfg.plans_per_bin
    # Bins 2.. approximate: their gammas never run.
    mixed = RolloutConfig(mode="exact_sparse", engine="paged", gamma=2, gamma_by_bin=(0, 2, 1),
                          approximate_from_bin=2)
    assert mixed.round_gammas == (0, 2) and mixed.plans_per_bin
    assert not RolloutConfig(mode="exact_sparse", gamma=2).plans_per_bin


@pytest.mark.slow
def test_bench_exact_workload(capsys):
    """`sparrow bench rollout --workload exact` at toy size: dense, sparse and exact side by
    side, with tokens per pass, alpha, KV bytes per token and the round's cost breakdown."""
    import json
    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", "--workload", "exact", "--layers", "2",
            "--hidden", "32", "--heads", "4", "--kv_heads", "2", "--head_dim", "16", "--vocab",
            "64", "--context", "160", "--budget", "48", "--gamma", "2", "--dense_layers", "none",
            "--batch", "2", "--new_tokens", "12", "--repeats", "1", "--dtype", "float32",
            "--before"]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["mode"] for r in records] == ["dense", "dense (chunked kernel)", "sparse",
                                            "exact_sparse", "exact_sparse (kernel prefix)",
                                            "plan"]
    dense, dense_before, sparse, ex, before, plan = records
    # --before: the former dense baseline (chunked kernel), its ratio against the one-pass one.
    assert dense_before["ratio"] == pytest.approx(dense["ms_per_step"]
                                                  / dense_before["ms_per_step"])
    assert dense_before["kv_bytes_per_token"] == dense["kv_bytes_per_token"]
    # The cost model's pick from the costs measured alone: gamma 2 when it predicts a gain.
    assert set(plan["predicted_ratio"]) == {"2"} and plan["measured_best_gamma"] == 2
    assert plan["measured_ratio"]["2"] == ex["ratio"]
    # In lock step (the batch waits for its slowest row) the prediction can only be lower.
    assert 0 < plan["predicted_lockstep_ratio"]["2"] < plan["predicted_ratio"]["2"]
    if plan["predicted_ratio"]["2"] > 1:
        assert plan["chosen_gamma"] == 2
        assert plan["chosen_predicted"] == pytest.approx(plan["predicted_ratio"]["2"])
    else:
        assert plan["chosen_gamma"] == 0 and plan["chosen_predicted"] == 1.0
    records = records[:5]
    # The profile's phases cover the round: draft + verify + accept + other = ms per round.
    for r in (ex, before):
        phases = r["draft_ms"] + r["verify_ms"] + r["accept_ms"] + r["other_ms"]
        assert phases == pytest.approx(r["ms_per_round"], rel=1e-6)
        assert r["verify_ms"] > 0 and r["draft_ms"] > 0
    assert all(r["tok_s"] > 0 for r in records)
    assert sparse["kv_bytes_per_token"] < dense["kv_bytes_per_token"]
    assert 1 <= ex["tokens_per_pass"] <= 3 and 0 < ex["mean_alpha"] <= 1 + 1e-5
    assert ex["rounds"] >= 11 / 3 and ex["verify_ms"] > 0 and ex["draft_ms"] > 0


@pytest.mark.slow
def test_acceptance_bench_on_demo_model(tmp_path, capsys):
    """`python -m sparrow_jax.bench.acceptance` (docs/benchmarks.md's acceptance vs alpha on the
    demo checkpoint) at CPU-twin size: per bin, measured tokens per pass beside the prediction,
    every row's rounds accounted for, a table and a plot."""
    import json
    from pathlib import Path

    from sparrow_jax.bench import acceptance
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "acc.json"
    acceptance.main(["--model", str(repo / "checkpoints/demo_sft"), "--prompts",
                     str(repo / "data/demo/eval.jsonl"), "--num_prompts", "2", "--samples", "2",
                     "--budgets", "48", "--max_new_tokens", "64", "--bin_size", "32",
                     "--dense_layers", "none", "--draft_scorer", "centroid", "verify",
                     "--json", str(out), "--plot", str(tmp_path / "acc.png")])
    text = capsys.readouterr().out
    assert "| all |" in text and "bins within 10%" in text and "scored by verify" in text
    results = json.loads(out.read_text())
    assert [r["draft_scorer"] for r in results] == ["centroid", "verify"]
    for res in results:
        assert res["rows"] == 4 and res["rounds"] == sum(b["rounds"] for b in res["bins"]) > 8
        for b in res["bins"]:
            assert 1.0 <= b["tokens_per_pass"] <= 5.0 and 1.0 <= b["predicted"] <= 5.0
            assert b["rel_diff"] == pytest.approx(b["tokens_per_pass"] / b["predicted"] - 1)
    assert (tmp_path / "acc.png").stat().st_size > 5_000


def test_acceptance_metrics_with_a_gamma_per_bin():
    """A hand-made row (bins of 4 tokens, plan (2, 0, 2)): a 2-token round in bin 0, three
    dense steps in bin 1, a 3-token round in bin 2, then a round cut after one accepted draft
    (its last verified round: left out, it would count 1 token for a round that had more
    coming) and two unverified tokens of an approximate bin (they record a budget: no
    rounds); metrics per bin with each bin's gamma."""
    from sparrow_jax.rollout.state import Trajectories
    from sparrow_jax.train import exact_step
    t = 12
    acc = np.array([[0, 1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0]], bool)
    nan = np.nan
    alpha = np.array([[nan, .5, .5, nan, nan, nan, .9, .9, nan, .9, nan, nan]], np.float32)
    z = jnp.zeros((1, t), jnp.int32)
    traj = Trajectories(prompt_tokens=jnp.zeros((1, 3), jnp.int32),
                        prompt_lengths=jnp.asarray([3]), tokens=z, logprobs=z.astype(jnp.float32),
                        topk_logprobs=jnp.zeros((1, t, 0)),
                        topk_ids=jnp.zeros((1, t, 0), jnp.int32),
                        budgets=z.at[:, 10:].set(8), cached_lengths=jnp.asarray(3 + np.arange(t))[None],
                        mask=jnp.ones((1, t), bool), response_lengths=jnp.asarray([t]),
                        accepted=jnp.asarray(acc), alpha=jnp.asarray(alpha))
    kw = dict(bin_size=4, num_layers=4, num_sparse_layers=4)
    budgets = np.array([8, 8, 8], np.int32)
    m = exact_step.acceptance_metrics(traj, budgets, gamma=(2, 0, 2), **kw)
    assert [m[f"exact_gamma/bin_0{k}"] for k in range(3)] == [2.0, 0.0, 2.0]
    assert [m[f"exact_tokens_per_pass/bin_0{k}"] for k in range(3)] == [2.0, 1.0, 3.0]
    assert m["exact_predicted/bin_00"] == pytest.approx(1.75)       # (1 - .5^3) / .5
    assert m["exact_predicted/bin_01"] == 1.0                       # dense steps
    assert m["exact_predicted/bin_02"] == pytest.approx(2.71, abs=1e-5)
    assert m["exact_rounds/bin_02"] == 1.0          # the cut round is not counted
    assert m["exact/tokens_per_pass"] == pytest.approx(8 / 5)
    assert m["exact/approximate_frac"] == pytest.approx(2 / 12)
    # The KV-read model's gamma is the rounds' mean (0.8): against the same rows at gamma 1.
    one = exact_step.acceptance_metrics(traj, budgets, gamma=1, **kw)
    draft = 1.6 * one["exact/kv_read_model"] - 1.0
    assert m["exact/kv_read_model"] == pytest.approx((0.8 * draft + 1.0) / 1.6)


def test_verify_guided_drafts_are_refused_on_the_fused_gpu_decode(sharp, monkeypatch):
    """The fused GPU decode (Pallas Triton: `fused.fewest_kernels`, here pretended on CPU) hands
    its layers raw heads, which the guided layers cannot take yet: both exact engines stop with
    one line naming the setting when the program is built, not a wrong answer."""
    from sparrow_jax.rollout import fused
    monkeypatch.setattr(fused, "fewest_kernels", lambda backend: True)
    toks, lens = random_prompts([9, 12], seed=0)
    cfg = RolloutConfig(mode="exact_sparse", gamma=2, max_new_tokens=8, temperature=0.0,
                        draft_scorer="verify", **KW)
    for engine in ("static", "paged"):
        with pytest.raises(ValueError, match="draft_scorer = 'verify' does not run on the fus"):
            generate(sharp, toks, lens, cfg=dataclasses.replace(cfg, engine=engine),
                     budgets=BUDGETS)


@pytest.mark.slow       # ~30 s: three decode programs compile
def test_traced_gamma_table_gives_the_static_plans_samples(sharp):
    """Re-planning (`RolloutConfig.replan_gammas`) makes the per-bin gamma table an input of
    the decode program: for the same plan it draws the same samples as the plan compiled in
    (one more, unused, branch), counts its rounds per branch, and a second plan runs in the
    same program (no compile)."""
    from sparrow_jax.runtime.compile_cache import count_compiles
    toks, lens = random_prompts([40, 70, 9, 23], seed=3)
    kw = dict(max_new_tokens=40, temperature=1.0, gamma=2, **KW)
    rng = jax.random.key(4)
    compiled_in = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, rng=rng,
                           cfg=RolloutConfig(mode="exact_sparse", gamma_by_bin=(2, 0, 2), **kw))
    traced_cfg = RolloutConfig(mode="exact_sparse", gamma_by_bin=(2, 0, 2),
                               replan_gammas=(0, 1, 2), **kw)
    assert traced_cfg.round_branches == ("gamma_0", "gamma_1", "gamma_2")
    traced = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, rng=rng, cfg=traced_cfg)
    for field in ("tokens", "logprobs", "accepted", "response_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(traced, field)),
                                      np.asarray(getattr(compiled_in, field)), err_msg=field)
    assert compiled_in.round_counts is None
    counts = np.asarray(traced.round_counts)
    assert counts.shape == (4, 3) and (counts == counts[0]).all()
    assert counts[0, 1] == 0 and counts[0, 0] > 0 and counts[0, 2] > 0   # gamma 1: no bin
    with count_compiles() as compiled:
        other = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, rng=rng,
                         cfg=dataclasses.replace(traced_cfg, gamma_by_bin=(1, 1, 0)))
    assert not [n for n in compiled if "decode" in n or "prefill" in n], compiled
    c = np.asarray(other.round_counts)[0]
    assert c[1] > 0 and c[2] == 0
    rows = exact.acceptance_by_bin(other, gamma=(1, 1, 0), bin_size=24)
    assert all(r["tokens_per_pass"] <= r["gamma"] + 1 for r in rows)


def test_replan_settings_are_refused_by_name():
    base = dict(mode="exact_sparse", gamma=2)
    with pytest.raises(ValueError, match=r"replan_every=2 needs RolloutConfig.replan_gammas"):
        RolloutConfig(replan_every=2, **base)
    with pytest.raises(ValueError, match="replan_every=-1 must be >= 0"):
        RolloutConfig(replan_every=-1, **base)
    with pytest.raises(ValueError, match="at least two distinct draft lengths"):
        RolloutConfig(replan_gammas=(2,), **base)
    with pytest.raises(ValueError, match="at least two distinct draft lengths"):
        RolloutConfig(replan_gammas=(0, 2, 2), **base)
    with pytest.raises(ValueError, match=r"gamma=2 must be their largest \(4; it sizes the cache"):
        RolloutConfig(replan_gammas=(0, 4), **base)
    with pytest.raises(ValueError, match=r"gamma_by_bin runs gamma \[1\], not in "
                                         r"RolloutConfig.replan_gammas=\(0, 2\)"):
        RolloutConfig(replan_gammas=(0, 2), gamma_by_bin=(2, 1), **base)
    with pytest.raises(ValueError, match="replan_min_rounds=0"):
        RolloutConfig(replan_gammas=(0, 2), replan_min_rounds=0, **base)
    # A plan below gamma is fine when re-planning (a later plan may use gamma).
    cfg = RolloutConfig(replan_gammas=(0, 1, 2), gamma_by_bin=(1, 0), replan_every=3, **base)
    assert cfg.replans and cfg.round_gammas == (0, 1, 2) and cfg.plans_per_bin
    prog, table = cfg.traced_plan(4)
    assert prog.gamma_by_bin == () and table.tolist() == [1, 0, 0, 0]
    assert prog == dataclasses.replace(cfg, gamma_by_bin=(2, 2)).traced_plan(4)[0]
    # Outside exact_sparse the programs take no table (train/plan.py refuses the setting).
    assert not RolloutConfig(replan_gammas=(0, 4)).replans


def test_a_per_bin_plan_updates_the_cache_in_place(sharp, monkeypatch):
    """A plan with several round branches (per-bin gamma, approximate bins, a traced table)
    must not copy the KV cache per round: under `lax.switch` XLA gave every branch its own
    copy of each K/V buffer it writes (24 cache-sized copies in this program, the whole cache
    per round); `verify.run_one_branch` runs the picked branch as a one-trip while loop, which
    aliases the cache (tests/test_paged_exact.py: the paged twin, slow)."""
    compiled: list = []
    spy_compiled_text(monkeypatch, exact, "decode_program_for", compiled,
                      lambda args: args[2].cache.k[0].shape)
    toks, lens = random_prompts([40, 70, 9, 23], seed=2)
    kw = dict(max_new_tokens=16, temperature=0.0, **KW)
    # Four branches (dense steps, gamma 1, gamma 2, approximate); one program for CI time.
    generate(sharp, toks, lens, budgets=BUDGETS, bin_size=32, cfg=RolloutConfig(
        mode="exact_sparse", gamma=2, gamma_by_bin=(0, 2, 1), approximate_from_bin=3, **kw))
    assert len(compiled) == 1
    for hlo, cache_shape in compiled:
        assert "while" in hlo and copies_of_shape(hlo, cache_shape) == 0, cache_shape
