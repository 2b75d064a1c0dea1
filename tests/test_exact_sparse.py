"""Exact sparse rollout (rollout/speculative.py, rollout/exact.py): the acceptance rule gives the
dense policy's distribution (chi-square at scale on a toy autoregressive model, and the same
test rejects a planted bug), greedy tokens equal dense greedy, sampled tokens pass a PIT test
against a teacher-forced dense pass, and recorded logprobs equal that pass to 1e-5."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hf_fixtures import make_sharp_tiny_model, random_prompts
from sparrow_jax.rollout import RolloutConfig, exact, generate, speculative
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


def _simulate(logp, logq, n: int, seed: int, limits: bool = False) -> np.ndarray:
    """n continuations by draft + verify rounds until each has DEPTH tokens -> [n, DEPTH];
    limits: each row offers a random 0..GAMMA of its drafts per round (a per-bin gamma)."""
    key = jax.random.key(seed)
    h = jnp.zeros((n,), jnp.int32)
    out = jnp.zeros((n, DEPTH + GAMMA + 1), jnp.int32)
    count = jnp.zeros((n,), jnp.int32)
    rows = jnp.arange(n)[:, None]
    for _ in range(DEPTH):                                  # every round gains >= 1 token
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
        j = jnp.arange(GAMMA + 1)[None]
        new = jnp.where(j < num[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
        keep = (j <= num[:, None]) & (count[:, None] + j < DEPTH)
        out = out.at[rows, jnp.where(keep, count[:, None] + j, out.shape[1])].set(new,
                                                                                mode="drop")
        for jj in range(GAMMA + 1):
            h = jnp.where(keep[:, jj], _push(h, new[:, jj]), h)
        count = count + keep.sum(1)
    assert bool(jnp.all(count == DEPTH))
    return np.asarray(out[:, :DEPTH])


def _dense_probs(logp) -> np.ndarray:
    """Exact P(x1, x2, x3) of dense sampling, [V**DEPTH] in itertools.product order."""
    lp = np.asarray(logp, np.float64)
    probs = []
    for seq in itertools.product(range(V), repeat=DEPTH):
        h, total = 0, 0.0
        for t in seq:
            total += lp[h, t]
            h = (h * 31 + t + 1) % M
        probs.append(np.exp(total))
    return np.asarray(probs)


def _chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    cells = (samples * (V ** np.arange(DEPTH - 1, -1, -1))).sum(1)
    counts = np.bincount(cells, minlength=V ** DEPTH).astype(np.float64)
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
        monkeypatch.setattr(exact, "ONE_PASS_BYTES", 0)
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
    with pytest.raises(ValueError, match="static engine only"):
        RolloutConfig(mode="exact_sparse", engine="paged", gamma=2, gamma_by_bin=(2, 0))
    assert RolloutConfig(mode="exact_sparse", gamma=2, gamma_by_bin=(2, 0, 2, 1)
                         ).round_gammas == (0, 1, 2)


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
    assert [r["mode"] for r in records] == ["dense", "sparse", "exact_sparse",
                                            "exact_sparse (kernel prefix)", "plan"]
    dense, sparse, ex, before, plan = records
    # The cost model's pick from the costs measured alone: gamma 2 when it predicts a gain.
    assert set(plan["predicted_ratio"]) == {"2"} and plan["measured_best_gamma"] == 2
    assert plan["measured_ratio"]["2"] == ex["ratio"]
    if plan["predicted_ratio"]["2"] > 1:
        assert plan["chosen_gamma"] == 2
        assert plan["chosen_predicted"] == pytest.approx(plan["predicted_ratio"]["2"])
    else:
        assert plan["chosen_gamma"] == 0 and plan["chosen_predicted"] == 1.0
    records = records[:4]
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
                     "--dense_layers", "none", "--json", str(out),
                     "--plot", str(tmp_path / "acc.png")])
    text = capsys.readouterr().out
    assert "| all |" in text and "bins within 10%" in text
    res, = json.loads(out.read_text())
    assert res["rows"] == 4 and res["rounds"] == sum(b["rounds"] for b in res["bins"]) > 8
    for b in res["bins"]:
        assert 1.0 <= b["tokens_per_pass"] <= 5.0 and 1.0 <= b["predicted"] <= 5.0
        assert b["rel_diff"] == pytest.approx(b["tokens_per_pass"] / b["predicted"] - 1)
    assert (tmp_path / "acc.png").stat().st_size > 5_000


def test_acceptance_metrics_with_a_gamma_per_bin():
    """A hand-made row (bins of 4 tokens, plan (2, 0, 2)): a 2-token round in bin 0, three
    dense steps in bin 1, a 3-token round in bin 2; metrics per bin with each bin's gamma."""
    from sparrow_jax.rollout.state import Trajectories
    from sparrow_jax.train import exact_step
    t = 9
    acc = np.array([[0, 1, 0, 0, 0, 0, 1, 1, 0]], bool)
    nan = np.nan
    alpha = np.array([[nan, .5, .5, nan, nan, nan, .9, .9, nan]], np.float32)
    z = jnp.zeros((1, t), jnp.int32)
    traj = Trajectories(prompt_tokens=jnp.zeros((1, 3), jnp.int32),
                        prompt_lengths=jnp.asarray([3]), tokens=z, logprobs=z.astype(jnp.float32),
                        topk_logprobs=jnp.zeros((1, t, 0)),
                        topk_ids=jnp.zeros((1, t, 0), jnp.int32),
                        budgets=z, cached_lengths=jnp.asarray(3 + np.arange(t))[None],
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
    assert m["exact/tokens_per_pass"] == pytest.approx(8 / 5)
    # The KV-read model's gamma is the rounds' mean (0.8): against the same rows at gamma 1.
    one = exact_step.acceptance_metrics(traj, budgets, gamma=1, **kw)
    draft = 1.6 * one["exact/kv_read_model"] - 1.0
    assert m["exact/kv_read_model"] == pytest.approx((0.8 * draft + 1.0) / 1.6)
