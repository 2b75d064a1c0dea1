"""Faults and bad input in `sparrow train` (subprocesses on a tiny model, see fault_worker.py).

- kill -9 at random moments (rollout, reward, learner, inside a checkpoint write), re-run until
  done: parameters, optimizer state, data order, controller state and metrics.jsonl equal an
  uninterrupted run's;
- NaN steps are skipped and counted, K in a row stop the run with the last good state saved;
- damaged checkpoints fall back to the previous step, none restorable is a clear error;
- bad input (tokenizer vs vocabulary, over-long prompts, hostile reward functions, gin values of
  the wrong type, unwritable run directory, a disk that fills during a save): a clear message or
  a counted skip, never a traceback or a hang.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hf_fixtures import gin_argv, make_tiny_qwen3, make_tiny_run, tiny_train_bindings

# The subprocess tests (the unit tests at the end are quick): slow, and guards too - the faults a
# user meets run in CI (`launch/local.sh test`); only kill -9's many runs wait for `--all`.
def slow(test):
    return pytest.mark.guard(pytest.mark.slow(test))


TESTS = Path(__file__).parent
STEPS = 6
TIMING = ("time", "time/", "tokens_per_s", "/seconds")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("faults"), eval_rows=0)


def _argv(root: Path, run: str, steps: int, extra=()) -> list[str]:
    binds = tiny_train_bindings(root, run, steps,
                                TrainConfig__reward="'fault_worker:varied'",
                                TrainConfig__eval_every="1000",
                                TrainConfig__checkpoint_every="1",
                                TrainConfig__max_to_keep="10",
                                ControllerConfig__min_budget="32",
                                ControllerConfig__min_tokens="1",
                                LearnerConfig__micro_batch_size="2")
    return ["train", *gin_argv(binds, extra)]


def _env(root: Path, faults: dict | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu", "NO_COLOR": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
        # Restarts reuse compiled programs (the same executables: no effect on the numbers): the
        # test session's shared cache (tests/conftest.py), which also holds test_run_safety's
        # programs (the same settings), else one of this module's own.
        "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                    str(root / "jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "SPARROW_FAULTS": json.dumps(faults or {}),
    })
    return env


def _launch(root: Path, argv: list[str], faults: dict | None = None, log_name: str = "log"
            ) -> subprocess.Popen:
    log = open(root / f"{log_name}.stderr", "ab")
    return subprocess.Popen([sys.executable, str(TESTS / "fault_worker.py"), *argv],
                            env=_env(root, faults), stdout=subprocess.DEVNULL, stderr=log)


def _run(root: Path, argv: list[str], faults: dict | None = None, timeout: float = 240
         ) -> tuple[int, str]:
    name = f"run-{time.monotonic_ns()}"
    proc = _launch(root, argv, faults, name)
    rc = proc.wait(timeout=timeout)
    return rc, (root / f"{name}.stderr").read_text(errors="replace")


def _clean_error(rc: int, err: str, *needles: str) -> None:
    """Exit status 1, every needle in the message, no traceback on the console."""
    assert rc == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, (needle, err[-3000:])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not (k == "time" or k.startswith("time/") or k.endswith("tokens_per_s")
                    or k.endswith("/seconds"))}


def _checkpoint(run: Path, step: int | None = None) -> tuple[dict, dict, dict]:
    """(params, opt_state, extra) of a step as NumPy leaves keyed by path (latest by default)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    ckpts = run / "checkpoints"
    step = step if step is not None else max(int(p.name) for p in ckpts.iterdir()
                                             if p.name.isdigit())
    out = []
    for item in ("params", "opt_state"):
        path = epath.Path(ckpts / str(step) / item)
        meta = ocp.StandardCheckpointHandler().metadata(path).tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
        tree = ocp.StandardCheckpointer().restore(path, target)
        out.append({jax.tree_util.keystr(k): np.asarray(v)
                    for k, v in jax.tree_util.tree_leaves_with_path(tree)})
    extra = json.loads((ckpts / str(step) / "extra" / "metadata").read_text())
    return out[0], out[1], extra


def _assert_same_arrays(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k   # bit-identical


def _batches(trace: Path) -> dict[int, str]:
    """Prompt ids of each step's batch (the last time the step ran)."""
    out = {}
    for line in trace.read_text().splitlines():
        if line.startswith("batch "):
            _, step, ids = line.split(" ", 2)
            out[int(step)] = ids
    return out


@pytest.fixture(scope="module")
def reference(root):
    """An uninterrupted run of STEPS steps (kill -9's reference; slow, so not in CI)."""
    rc, err = _run(root, _argv(root, "ref", STEPS), {"trace": str(root / "ref.trace")})
    assert rc == 0, err[-3000:]
    return root / "ref"


# -- kill -9 and resume ---------------------------------------------------------------------------


def _wait_for(trace: Path, offset: int, wanted: str, proc: subprocess.Popen,
              timeout: float = 120) -> bool:
    """Waits until `wanted` is a line of `trace` after byte `offset`; False if the process
    ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = trace.read_text()[offset:] if trace.exists() else ""
        if wanted in text.splitlines():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise TimeoutError(f"no {wanted!r} in {trace} after {timeout}s")


@pytest.mark.slow       # ~60 s of runs: `launch/local.sh test --all`, not CI
def test_kill9_anywhere_then_resume_equals_uninterrupted_run(root, reference):
    rng = random.Random(17)
    trace = root / "killed.trace"
    argv = _argv(root, "killed", STEPS)
    # The checkpoint write (inside orbax's save, in the config item) and the reward function
    # sleep a little, so kills aimed at them land inside; this only stretches time.
    faults = {"trace": str(trace), "slow_save_s": 0.3, "slow_reward_s": 0.05}
    phases = ["rollout", "reward", "learner", "checkpoint"]
    kills, landed = [], []
    started = time.monotonic()
    while len(kills) < 5:
        done = [int(line.split()[1]) for line in (trace.read_text().splitlines()
                                                  if trace.exists() else [])
                if line.startswith("saved ")]
        next_step = (max(done) if done else 0) + 1
        if next_step > STEPS:
            break
        phase = phases[len(kills) % len(phases)]
        step = min(STEPS, next_step + rng.randint(0, 1))
        offset = trace.stat().st_size if trace.exists() else 0
        proc = _launch(root, argv, faults, "killed")
        if not _wait_for(trace, offset, f"{phase} {step}", proc):
            break                                   # finished before reaching the target
        # Inside the phase: at once (rollout/learner compile or load their programs first after
        # a restart), or anywhere in the slowed-down reward scoring and checkpoint write.
        time.sleep(rng.uniform(0.0, {"rollout": 0.01, "reward": 0.1, "learner": 0.01,
                                     "checkpoint": 0.25}[phase]))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last = trace.read_text().splitlines()[-1]
        kills.append(f"{phase} {step}")
        landed.append(last)
    assert len(kills) >= 5, kills
    assert len({line.split()[0] for line in landed}) >= 3, landed   # in different phases
    # Re-run the same command until it finishes.
    rc, err = _run(root, argv, faults)
    assert rc == 0, err[-3000:]
    print(f"kills aimed at {kills}, landed after {landed}, "
          f"{time.monotonic() - started:.0f} s in all")
    killed = root / "killed"

    # metrics.jsonl: one line per step, values equal to the uninterrupted run's (but timing).
    got, want = _metrics(killed), _metrics(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [_untimed(r) for r in got] == [_untimed(r) for r in want]
    # Parameters and optimizer state bit-identical; data position and controller state equal.
    p1, o1, e1 = _checkpoint(killed)
    p2, o2, e2 = _checkpoint(reference)
    assert e1["step"] == e2["step"] == STEPS
    _assert_same_arrays(p1, p2)
    _assert_same_arrays(o1, o2)
    for key in ("data", "controller", "faults", "checksums"):
        assert e1[key] == e2[key], key
    # The same prompts in the same order at every step.
    assert _batches(trace) == _batches(root / "ref.trace")
    assert not list((killed / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


# -- numerical faults -----------------------------------------------------------------------------


@slow
def test_nan_steps_are_skipped_and_too_many_stop_the_run(root):
    argv = _argv(root, "nan", 8, ["TrainConfig.max_consecutive_skips = 2"])
    rc, err = _run(root, argv, {"nan_steps": [2, 4, 5]})
    _clean_error(rc, err, "stopping: 2 consecutive steps (4..5) had a non-finite loss",
                 "step 2: non-finite loss or gradient")
    rows = {r["step"]: r for r in _metrics(root / "nan")}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s]["learner/skipped_updates"] for s in range(1, 6)] == [0, 1, 0, 1, 1]
    assert [rows[s]["train/skipped_steps"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    # A skipped step leaves parameters and optimizer state bit-identical; the stop saved the
    # last good state (step 3's) as step 5.
    for before, after in ((1, 2), (3, 5)):
        pa, oa, _ = _checkpoint(root / "nan", before)
        pb, ob, extra = _checkpoint(root / "nan", after)
        _assert_same_arrays(pa, pb)
        _assert_same_arrays(oa, ob)
    assert extra["faults"]["consecutive"] == 2 and extra["faults"]["total"] == 3
    p1, _, _ = _checkpoint(root / "nan", 1)
    assert any(not np.array_equal(p1[k], pb[k]) for k in p1)   # good steps did train


# -- damaged checkpoints --------------------------------------------------------------------------


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@slow
def test_damaged_latest_checkpoint_falls_back_and_none_is_a_clear_error(root):
    run = root / "damaged"
    rc, err = _run(root, _argv(root, "damaged", 3))
    assert rc == 0, err[-3000:]
    uninterrupted = _metrics(run)       # this run's own rows, before any damage
    # Silent corruption: array files that decode cleanly but hold other values (step 2's
    # parameters under step 3's fingerprint) - orbax restores them; the fingerprint does not.
    # (Flipping bytes in the largest data file was not deterministic: depending on what the
    # flip hit, orbax decoded it silently or failed by itself.)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "3" / "params")
    shutil.copytree(ckpts / "2" / "params", ckpts / "3" / "params")
    # The same command again: the finished run restores its latest step, which is damaged.
    rc, err = _run(root, _argv(root, "damaged", 3))
    assert rc == 0, err[-3000:]
    assert "checkpoints/3 does not restore" in err and "the files are corrupted" in err, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / '2'} at step 2" in err
    assert len(list((run / "damaged_checkpoints").iterdir())) == 1      # kept for inspection
    # Step 3 was redone from step 2: one line, equal to the uninterrupted run's step 3 (CI runs
    # no separate uninterrupted run for this: the run's rows before the damage are one).
    got = _metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [_untimed(r) for r in got] == [_untimed(r) for r in uninterrupted]
    # Now truncate a file in every step: no restorable step -> a clear error naming the dir.
    for step_dir in (run / "checkpoints").iterdir():
        f = _largest_file(step_dir)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    rc, err = _run(root, _argv(root, "damaged", 5))
    _clean_error(rc, err, f"no restorable checkpoint in {run / 'checkpoints'}")


# -- bad input ------------------------------------------------------------------------------------


@slow
def test_tokenizer_that_does_not_fit_the_model(root):
    bad = root / "small_vocab_model"
    make_tiny_qwen3(bad, vocab=16, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                    intermediate=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "model" / name, bad / name)
    rc, err = _run(root, _argv(root, "vocab", 1, [f"TrainConfig.model_path = '{bad}'"]))
    _clean_error(rc, err, "vocab_size is 16", "do not belong together")


@slow
def test_prompts_longer_than_the_rollout_capacity_are_dropped(root):
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    long_row = dict(rows[0], id="too-long", prompt=" ".join([rows[0]["prompt"]] * 4000))
    path = root / "with_long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [long_row, *rows, long_row]))
    argv = _argv(root, "long", 1, [f"TrainConfig.train_data = '{path}'"])
    rc, err = _run(root, argv)
    assert rc == 0, err[-3000:]
    assert "16/18 prompts loaded" in err and "2 too long dropped" in err, err[-3000:]
    # Nothing fits: a clear error (a new run directory: changing a setting of the finished run
    # above would be refused as a changed setting on resume, before the data loads).
    argv = _argv(root, "long_none_fit", 1, [f"TrainConfig.train_data = '{path}'"])
    rc, err = _run(root, argv + ["--gin_param", "make_prompt_iterator.max_prompt_len = 2"])
    _clean_error(rc, err, "no usable prompts", "18 too long dropped")


@slow
def test_reward_errors_stop_the_run_with_traceback_and_row_unless_allowed(root):
    """Issue #45 list 7: a reward with the wrong signature is refused before the model loads;
    one that raises in the first step stops the run before its update (its traceback and row
    shown, nothing saved); TrainConfig.max_reward_error_share = 1.0 trains on, counting."""
    rc, err = _run(root, _argv(root, "signature", 1,
                               ["TrainConfig.reward = 'fault_worker:wrong_signature'"]))
    _clean_error(rc, err, "TrainConfig.reward = 'fault_worker:wrong_signature': the reward "
                 "function cannot be called as fn(completion_text, ground_truth",
                 "its signature is wrong_signature(completion_text")
    assert "precision:" not in err, "the model loaded"
    hostile = "TrainConfig.reward = 'fault_worker:hostile'"
    rc, err = _run(root, _argv(root, "hostile_stop", 1, [hostile]))
    assert rc == 1, err[-3000:]
    message = err[err.index("sparrow train: step 1: "):]
    for needle in ("rewards raised an error", "nothing of it is saved", "First failure: row ",
                   "(prompt id ", "Traceback (most recent call last)"):
        assert needle in message, (needle, err[-3000:])
    assert err.count("Traceback") == 1, err[-3000:]     # the reward's, inside the message
    assert not list((root / "hostile_stop" / "checkpoints").glob("[0-9]*"))
    rc, err = _run(root, _argv(root, "hostile", 1, [hostile,
                                                    "TrainConfig.max_reward_error_share = 1.0"]))
    assert rc == 0, err[-3000:]
    rows = _metrics(root / "hostile")
    assert sum(r["reward/errors"] for r in rows) > 0
    assert all(0 <= r["reward/error_share"] <= 1 for r in rows)
    assert all(r["reward/mean"] in (0.0, 0.125, 0.25, 0.375, 0.5) for r in rows)  # 0.5 or 0
    assert "reward errors" in err, err[-3000:]


@slow
@pytest.mark.parametrize("binding, needle", [
    ("TrainConfig.total_steps = 'ten'", "TrainConfig.total_steps = 'ten': expected int, got str"),
    ("LearnerConfig.learning_rate = '1e-3'", "LearnerConfig.learning_rate = '1e-3': expected "
                                             "float, got str"),
])
def test_gin_value_of_the_wrong_type(root, binding, needle):
    rc, err = _run(root, _argv(root, "gin_type", 1, [binding]))
    _clean_error(rc, err, needle)


@slow
def test_run_dir_that_is_not_writable(root):
    blocker = root / "a_file"
    blocker.write_text("not a directory")
    rc, err = _run(root, _argv(root, "a_file/run", 1))
    _clean_error(rc, err, f"run directory {blocker / 'run'} is not writable")


@slow
def test_disk_full_during_a_checkpoint_write(root):
    """ENOSPC injected inside the write of step 2's checkpoint (after its arrays)."""
    run = root / "enospc"
    rc, err = _run(root, _argv(root, "enospc", 3), {"enospc_step": 2})
    _clean_error(rc, err, "could not write checkpoint step 2", "the disk is full",
                 "Finalized checkpoints are intact (steps [1])")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]  # no half step
    rc, err = _run(root, _argv(root, "enospc", 3))
    assert rc == 0 and "at step 1" in err, err[-3000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]


@slow
def test_disk_full_on_a_real_small_filesystem(root):
    """A 3 MiB tmpfs (user + mount namespace) filled up after the first checkpoint."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {root}"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode()[:200]}")
    mnt, trace, out = root / "tmpfs", root / "tmpfs.trace", root / "tmpfs_out"
    mnt.mkdir()
    argv = _argv(mnt, "run", 5)
    argv = [a.replace(f"'{mnt / 'model'}'", f"'{root / 'model'}'")
            .replace(f"'{mnt / 'train.jsonl'}'", f"'{root / 'train.jsonl'}'") for a in argv]
    worker = f"{sys.executable} {TESTS / 'fault_worker.py'}"
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)
    script = f"""
        mount -t tmpfs -o size=3m tmpfs {mnt} || exit 99
        {worker} {quoted} 2> {root}/tmpfs1.err &
        pid=$!
        while ! grep -qs "^saved 1$" {trace}; do sleep 0.05; done
        dd if=/dev/zero of={mnt}/filler bs=16k 2>/dev/null
        wait $pid; echo $? > {root}/tmpfs1.rc
        rm {mnt}/filler
        {worker} {quoted} 2> {root}/tmpfs2.err; echo $? > {root}/tmpfs2.rc
        cp -r {mnt}/run {out}
    """
    env = _env(root, {"trace": str(trace)})
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                   env=env, timeout=240, check=True)
    rc1 = int((root / "tmpfs1.rc").read_text())
    _clean_error(rc1, (root / "tmpfs1.err").read_text(), "full", "intact")
    rc2 = int((root / "tmpfs2.rc").read_text())
    assert rc2 == 0, (root / "tmpfs2.err").read_text()[-3000:]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4, 5]


# -- quick unit tests of the pieces -----------------------------------------------------------------


def test_apply_program_skips_non_finite_steps_bit_identically():
    import jax.numpy as jnp
    import optax

    from sparrow_jax.rl.learner_programs import apply_program

    tx = optax.adamw(1e-2)
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7, "b": jnp.ones((3,))}
    state = tx.init(params)
    good = {"w": jnp.full((2, 3), 0.5), "b": jnp.full((3,), -0.25)}
    p1, s1, _, applied = apply_program(params, state, good, jnp.float32(1.0), tx=tx)
    assert bool(applied)
    for bad_grads, loss in (({"w": good["w"].at[0, 1].set(jnp.nan), "b": good["b"]}, 1.0),
                            ({"w": good["w"], "b": good["b"].at[2].set(jnp.inf)}, 1.0),
                            (good, jnp.nan)):
        before = [np.asarray(x).copy() for x in jax_leaves((p1, s1))]
        p2, s2, _, applied = apply_program(p1, s1, bad_grads, jnp.float32(loss), tx=tx)
        assert not bool(applied)
        after = [np.asarray(x) for x in jax_leaves((p2, s2))]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        p1, s1 = p2, s2


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_checksums_catch_one_flipped_bit_and_agree_across_layouts():
    import jax.numpy as jnp

    from sparrow_jax.runtime import faults

    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    tree = {"a": jnp.asarray(x), "b": jnp.asarray(x[:2]).astype(jnp.bfloat16),
            "n": jnp.arange(5, dtype=jnp.int32)}
    sums = faults.tree_checksums(tree)
    assert sums == faults.tree_checksums(jax_tree_copy(tree))
    flipped = x.copy()
    flipped.view(np.uint32)[3, 5] ^= 1 << 7
    assert faults.tree_checksums({**tree, "a": jnp.asarray(flipped)})[0] != sums[0]
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert faults.tree_checksums({**tree, "a": jnp.asarray(swapped)})[0] != sums[0]
    faults.verify_checksums(1, {"params": tree}, {"params": sums})
    with pytest.raises(faults.DamagedCheckpointError, match="corrupted"):
        faults.verify_checksums(1, {"params": {**tree, "a": jnp.asarray(flipped)}},
                                {"params": sums})


def jax_tree_copy(tree):
    import jax
    return jax.tree.map(lambda v: v.copy(), tree)


def test_metrics_truncate_after_drops_later_and_torn_lines(tmp_path):
    from sparrow_jax.runtime.metrics import MetricsWriter, read_jsonl, read_scalars

    with MetricsWriter(tmp_path) as w:
        for step in (1, 2, 3):
            w.scalars(step, {"x": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x": ')          # torn by a kill
    with MetricsWriter(tmp_path) as w:
        assert w.truncate_after(1) == 3
        w.scalars(2, {"x": 20.0})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path)] == [(1, 1.0), (2, 20.0)]
    # TensorBoard: the superseded points of the first file are purged by the START marker.
    assert read_scalars(tmp_path)["x"] == [(1, 1.0), (2, 20.0)]


def test_reward_results_must_be_numbers():
    from sparrow_jax.rewards.pool import RewardPool

    values = iter([1, True, np.float32(0.5), "1", None, float("nan"), [1.0]])
    with RewardPool(lambda *a, **k: next(values), processes=0) as pool:
        report = pool.score([("x", "y")] * 7)
    assert report.rewards.tolist() == [1.0, 1.0, 0.5, 0, 0, 0, 0]
    assert report.errors == 4 and report.failed == (3, 4, 5, 6)


def test_config_check_types():
    from sparrow_jax import cli
    from sparrow_jax.runtime import config_check

    cli.parse_gin([], ["TrainConfig.total_steps = 3", "LearnerConfig.learning_rate = 1",
                       "LearnerConfig.length_buckets = [16, 32]",
                       "make_prompt_iterator.max_prompt_len = None",
                       "TrainConfig.diagnostic_rewards = ('a', 'b')"])
    config_check.check_bindings()
    cli.parse_gin([], ["TrainConfig.eval_every = True", "RolloutConfig.max_new_tokens = 4.5",
                       "make_schedule.budgets = [48, 'x']", "RewardPool.timeout_s = 'a'"])
    with pytest.raises(TypeError) as e:
        config_check.check_bindings()
    for needle in ("TrainConfig.eval_every = True: expected int, got bool",
                   "RolloutConfig.max_new_tokens = 4.5: expected int, got float",
                   "make_schedule.budgets = [48, 'x']", "RewardPool.timeout_s = 'a'"):
        assert needle in str(e.value)
    import gin
    gin.clear_config()
