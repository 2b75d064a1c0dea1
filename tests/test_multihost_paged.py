"""Paged rollouts across processes (issue #31): 2 JAX processes x 4 CPU devices joined by
jax.distributed, as hosts of a pod slice are, each running the same host scheduler.

- the rows each process gets back equal a one-process paged rollout of all prompts (sampled
  sparse with preemptions from a tight pool, a stop token mid-sequence and GRPO groups; greedy
  dense);
- the host loop overlaps across processes (continuations dispatched while a chunk runs: the
  digest check is exchanged on the host, not by a device program);
- a process whose scheduler decides differently is caught before the next dispatch, with the
  chunk and each process's digest, on every process; one that skips a host exchange makes the
  others raise PeerTimeout naming it;
- a killed process makes the other exit non-zero within a stated bound (no hang).
Training and resuming on the paged engine across processes: tests/test_multihost.py.
"""

import json
import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from hf_fixtures import make_tiny_synthetic_model, start_workers

WORKER = Path(__file__).with_name("multihost_paged_worker.py")
NPROC = 2
MAX_NEW = 40
# A dead peer: the survivor exits within the worker's heartbeat timeout (10 s) plus the time to
# notice and tear down; generous for a CI machine with 2 cores.
DEAD_PEER_BOUND_S = 60


def _launch(role: str, root: Path, timeout: float = 600
            ) -> tuple[list[int], list[str], list[float]]:
    """Runs NPROC workers; (exit codes, logs, wall-clock time each one exited)."""
    # Compiling dominates these tests: later launches reuse the first one's programs.
    cache = {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                         str(root / "jax_cache")),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    procs, logs = start_workers(WORKER, role, root, NPROC, extra_env=cache)
    codes: list[int | None] = [None] * NPROC
    ended = [0.0] * NPROC
    deadline = time.time() + timeout
    try:
        while None in codes and time.time() < deadline:
            for i, p in enumerate(procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i], ended[i] = p.returncode, time.time()
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    texts = [log.read_text() for log in logs]
    if None in codes:
        pytest.fail(f"{role}: workers still running after {timeout} s (exit codes {codes})\n"
                    + "\n".join(f"--- process {i}:\n{t[-3000:]}" for i, t in enumerate(texts)))
    return codes, texts, ended


def _fail(role, codes, texts):
    pytest.fail(f"{role}: exit codes {codes}\n" + "\n".join(
        f"--- process {i}:\n{t[-4000:]}" for i, t in enumerate(texts)))


def _case(name, **cfg):
    base = dict(max_new_tokens=MAX_NEW, backend="xla", chunk_steps=8, engine="paged",
                stop_token_ids=[])
    return {"name": name, "cfg": {**base, **cfg}, "budgets": [48] * 20, "bin_size": 16,
            "group_size": 2, "seed": 7}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The model, 4 ragged prompts (2 per process; process 1's narrower) and the cases, with a
    stop token that ends some rows mid-sequence (found from a free-running reference)."""
    from sparrow_jax.model import load_hf
    from sparrow_jax.rollout import page_pool
    root = tmp_path_factory.mktemp("multihost_paged")
    make_tiny_synthetic_model(root / "model", heads=4, kv_heads=2)
    rng = np.random.default_rng(0)
    lengths = np.asarray([40, 23, 17, 9], np.int32)
    tokens = np.zeros((4, 40), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, 40, n)
    np.savez(root / "prompts.npz", tokens=tokens, lengths=lengths)
    model = load_hf(root / "model")
    # 8 pages per pool (2 KV heads do not divide the workers' model=4: whole pages per device),
    # the least that holds one sample: 4 samples per pool cannot all grow without preemptions.
    tight = 8 * page_pool.page_bytes(model.config, model.dtype, 16)
    sampled = _case("sampled", mode="sparse", temperature=1.0, max_budget=48, pool_bytes=tight)
    greedy = _case("greedy", mode="dense", temperature=0.0, max_budget=48)
    free = _reference(model, root, sampled)
    sampled["cfg"]["stop_token_ids"] = [_mid_sequence_stop(np.asarray(free.tokens))]
    # A random tiny model decodes greedily by repeating one token per prompt: stopping on the
    # third prompt's ends its samples at their first token (in the prefill program).
    free = np.asarray(_reference(model, root, greedy).tokens)
    assert free[4, 0] not in free[:4, :] and free[4, 0] not in free[6:, :]
    greedy["cfg"]["stop_token_ids"] = [int(free[4, 0])]
    (root / "cases.json").write_text(json.dumps([sampled, greedy]))
    return root


def _mid_sequence_stop(tokens: np.ndarray) -> int:
    """A token that some row first draws mid-sequence and some row never draws."""
    for t in range(3, int(tokens.max()) + 1):
        first = [np.flatnonzero(r == t) for r in tokens]
        if any(f.size == 0 for f in first) and any(f.size and 5 <= f[0] < MAX_NEW - 8
                                                    for f in first):
            return t
    raise AssertionError("no token ends a row mid-sequence; change the prompts' seed")


def _reference(model, root: Path, case: dict, **override):
    """One process, no mesh, all prompts at once (the roomy default pool)."""
    from sparrow_jax.rollout import RolloutConfig, generate
    cfg = {**case["cfg"], "pool_bytes": 0, **override}
    cfg["stop_token_ids"] = tuple(cfg["stop_token_ids"])
    prompts = np.load(root / "prompts.npz")
    return generate(model, prompts["tokens"], prompts["lengths"], cfg=RolloutConfig(**cfg),
                    budgets=np.asarray(case["budgets"]), bin_size=case["bin_size"],
                    group_size=case["group_size"], rng=jax.random.key(case["seed"]))


@pytest.mark.slow
def test_two_process_paged_rollout_equals_one_process(root):
    from sparrow_jax.model import load_hf
    codes, texts, _ = _launch("rollout", root)
    if any(codes):
        _fail("rollout", codes, texts)
    model = load_hf(root / "model")
    for case in json.loads((root / "cases.json").read_text()):
        ref = _reference(model, root, case)
        stats = [json.loads((root / f"{case['name']}_{i}.json").read_text())
                 for i in range(NPROC)]
        for st in stats:
            print(f"{case['name']}: {st}")
            for key in ("sync_ms_per_chunk", "guard_ms_per_chunk", "host_ms_per_chunk",
                        "seconds"):
                del st[key]
        assert stats[0] == stats[1], stats             # one schedule, replicated
        # The host loop overlaps across processes too: continuations dispatched while their
        # predecessor ran (the digest check does not wait for the running chunk).
        assert stats[0]["overlapped_chunks"] > 0, stats
        assert stats[0]["global_rows"] == 8 and stats[0]["pools"] == 2
        lengths = np.asarray(ref.response_lengths)
        assert lengths.min() < MAX_NEW and lengths.max() == MAX_NEW    # a stop, a full row
        for i in range(NPROC):
            rows = np.load(root / f"{case['name']}_{i}.npz")
            mine = slice(4 * i, 4 * (i + 1))            # 2 prompts x group 2: row block i
            m = np.asarray(ref.mask)[mine]
            np.testing.assert_array_equal(rows["tokens"], np.asarray(ref.tokens)[mine])
            np.testing.assert_array_equal(rows["response_lengths"],
                                          np.asarray(ref.response_lengths)[mine])
            np.testing.assert_array_equal(rows["mask"], m)
            np.testing.assert_array_equal(rows["budgets"], np.asarray(ref.budgets)[mine])
            np.testing.assert_allclose(rows["logprobs"][m], np.asarray(ref.logprobs)[mine][m],
                                       atol=1e-5)
        if case["name"] == "sampled":
            assert stats[0]["preemptions"] > 0          # the tight pool forced recomputes
            assert (np.asarray(ref.budgets) == 48).any()  # sparse selection really bound
    # Compiled: the same rows again, and what the coordination costs per decode chunk (2
    # processes on one CPU machine).
    for i in range(NPROC):
        rows, first = np.load(root / f"again_{i}.npz"), np.load(root / f"sampled_{i}.npz")
        np.testing.assert_array_equal(rows["tokens"], first["tokens"])
        print(f"steady state, process {i}:", (root / f"again_{i}.json").read_text())
        print(f"coordination per chunk, process {i}:",
              (root / f"coordination_{i}.json").read_text())
    timeout = (root / "peer_timeout.txt").read_text()
    assert "'skipped_by_1' #0: process(es) [1] did not arrive within 1 s" in timeout, timeout


@pytest.mark.slow
def test_divergent_scheduler_is_caught_on_every_process(root):
    codes, texts, _ = _launch("diverge", root)
    assert all(codes), f"both processes must fail, got exit codes {codes}"
    for t in texts:
        # The first chunk ran everywhere; process 1 reorders its slots for the second.
        assert "SchedulerDivergence" in t, t[-3000:]
        assert "diverged before the decode program of decode chunk 1" in t, t[-3000:]
        assert "process 0: 0x" in t and "process 1: 0x" in t, t[-3000:]
    print(next(line for line in texts[0].splitlines() if "SchedulerDivergence:" in line))


@pytest.mark.slow
def test_killed_process_makes_the_other_exit(root):
    codes, texts, ended = _launch("kill", root)
    assert codes[1] == -9, (codes, texts[1][-2000:])
    killed_at = float((root / "killed_at").read_text())
    assert codes[0] != 0, texts[0][-3000:]
    waited = ended[0] - killed_at
    assert waited < DEAD_PEER_BOUND_S, f"survivor took {waited:.0f} s to exit:\n{texts[0][-3000:]}"
    print(f"survivor exited with {codes[0]} {waited:.1f} s after its peer was killed")
