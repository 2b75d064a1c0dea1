"""Tests for sparrow_jax.runtime.checkpoint: round trips, retention, crash safety, resharding, preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hf_fixtures import cpu_devices_flags
from sparrow_jax.runtime.checkpoint import (
    CheckpointManager,
    abstract_like,
    decode_extra,
    encode_extra,
    save_json_atomic,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state_and_opt(seed: int = 0, din: int = 4, dout: int = 3):
    """An NNX Linear state and an adamw state after one update (so mu/nu/count are non-trivial)."""
    params = nnx.state(nnx.Linear(din, dout, rngs=nnx.Rngs(seed)))
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


def _run_py(code: str, env_extra: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_roundtrip_nnx_state_adamw_and_extra(tmp_path):
    params, opt_state = _state_and_opt()
    key = jax.random.key(7)
    extra = {
        "data_iter": b"\x00\xff{grain-state}",
        "controller": {"budget_per_bin": [64, 128], "ema": 0.25, "bins": (1, 2)},
        "rng": key,
        "legacy_rng": jax.random.PRNGKey(3),
        "step": 5,
    }
    with CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() is None
        assert mngr.save(5, params, opt_state, extra, operative_config="train.lr = 0.01\n")
    with CheckpointManager(tmp_path) as mngr:  # a fresh process would do exactly this
        p2, o2, e2 = mngr.restore(None, abstract_like(params), abstract_like(opt_state))
    assert isinstance(p2, nnx.State)
    _assert_trees_equal(params, p2)
    _assert_trees_equal(opt_state, o2)
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(p2)))
    assert e2["data_iter"] == extra["data_iter"]
    assert e2["controller"] == {"budget_per_bin": [64, 128], "ema": 0.25, "bins": [1, 2]}
    np.testing.assert_array_equal(jax.random.key_data(e2["rng"]), jax.random.key_data(key))
    # The restored key draws the same numbers as the original.
    np.testing.assert_array_equal(jax.random.uniform(e2["rng"], (3,)), jax.random.uniform(key, (3,)))
    np.testing.assert_array_equal(e2["legacy_rng"], np.asarray(jax.random.PRNGKey(3)))
    assert e2["step"] == 5


def test_restore_subsets_and_errors(tmp_path):
    params, opt_state = _state_and_opt()
    with CheckpointManager(tmp_path) as mngr:
        with pytest.raises(FileNotFoundError):
            mngr.restore()
        mngr.save(1, params, opt_state, {"a": 1})
        p, o, e = mngr.restore(1)  # extra only: e.g. for a summary of the run
        assert p is None and o is None and e == {"a": 1}
        p, o, _ = mngr.restore(1, abstract_like(params))
        assert o is None
        _assert_trees_equal(params, p)
        with pytest.raises(FileNotFoundError):
            mngr.restore(2)
        assert not mngr.save(1, params, opt_state, {"a": 2}, force=True)  # never overwrites


def test_max_to_keep_interval_and_latest_step(tmp_path):
    params, opt_state = _state_and_opt()
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as mngr:
        saved = [s for s in range(1, 8) if mngr.save(s, params, opt_state, {"s": s})]
        assert saved == [1, 2, 4, 6]  # the first save of a run always writes (orbax InitialSavePolicy)
        assert mngr.should_save(8) and not mngr.should_save(9)
        assert mngr.save(7, params, opt_state, {"s": 7}, force=True)
        assert mngr.all_steps() == [6, 7] and mngr.latest_step() == 7
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6", "7"]
    with CheckpointManager(tmp_path, max_to_keep=2) as mngr:
        assert mngr.latest_step() == 7 and mngr.restore()[2] == {"s": 7}


def test_operative_config_per_step(tmp_path):
    params, opt_state = _state_and_opt()
    with CheckpointManager(tmp_path, max_to_keep=None) as mngr:
        for s in (1, 2):
            mngr.save(s, params, opt_state, {}, operative_config=f"train.steps = {s}\n")
        mngr.save(3, params, opt_state, {})
        for s in (1, 2):
            path = tmp_path / "checkpoints" / str(s) / "operative_config" / "operative_config.gin"
            assert path.read_text() == f"train.steps = {s}\n"
            assert mngr.read_operative_config(s) == f"train.steps = {s}\n"
        assert mngr.read_operative_config() is None  # step 3 was saved without one


def test_async_save_then_close(tmp_path):
    params, opt_state = _state_and_opt()
    with CheckpointManager(tmp_path, enable_async=True, max_to_keep=1) as mngr:
        for s in (1, 2):
            mngr.save(s, params, opt_state, {"s": s}, operative_config="x = 1\n")
    with CheckpointManager(tmp_path) as mngr:
        assert mngr.all_steps() == [2] and mngr.read_operative_config() == "x = 1\n"
        p, _, e = mngr.restore(2, abstract_like(params))
    _assert_trees_equal(params, p)
    assert e == {"s": 2}


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    params, opt_state = _state_and_opt()
    with CheckpointManager(tmp_path) as mngr:
        mngr.save(1, params, opt_state, {"s": 1})
    # What a killed writer leaves behind: a half-written step under orbax's tmp name.
    junk = tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp"
    (junk / "params").mkdir(parents=True)
    (junk / "params" / "partial").write_bytes(b"\x00" * 10)
    with CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() == 1 and mngr.restore()[2] == {"s": 1}
        assert mngr.save(9, params, opt_state, {"s": 9})  # waits for the tmp cleanup first
        assert mngr.all_steps() == [1, 9]
    assert not junk.exists()


def test_resume_after_real_crash_mid_save(tmp_path):
    """A process killed inside save() (os._exit, no cleanup) must leave step 2 as the latest."""
    code = f"""
        import os
        import jax.numpy as jnp
        from sparrow_jax.runtime import checkpoint as ck
        params, opt = {{"w": jnp.arange(6.0)}}, {{"m": jnp.zeros(6)}}
        mngr = ck.CheckpointManager({str(tmp_path)!r}, max_to_keep=1)
        for s in (1, 2):
            mngr.save(s, {{"w": params["w"] * s}}, opt, {{"s": s}})
        def crash(self, directory, args):  # runs inside the step-3 save, after params started
            os._exit(17)
        ck.TextHandler.save = crash
        mngr.save(3, {{"w": params["w"] * 3}}, opt, {{"s": 3}}, operative_config="boom")
        print("UNREACHABLE")
    """
    proc = _run_py(code)
    assert proc.returncode == 17, proc.stdout + proc.stderr
    leftovers = [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("3.")]
    assert leftovers, os.listdir(tmp_path / "checkpoints")  # the crash left a tmp dir
    target = {"w": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    with CheckpointManager(tmp_path, max_to_keep=1) as mngr:
        assert mngr.all_steps() == [2]
        p, _, e = mngr.restore(None, target)
        np.testing.assert_array_equal(p["w"], np.arange(6.0) * 2)
        assert e == {"s": 2}
        assert mngr.save(3, p, {"m": jnp.zeros(6)}, {"s": 3})
        assert mngr.all_steps() == [3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_restore_onto_2x4_mesh_of_8_devices(tmp_path):
    """Save from one device here; restore sharded on a 2x4 mesh in a process with 8 CPU devices."""
    params, opt_state = _state_and_opt(seed=1, din=8, dout=16)
    with CheckpointManager(tmp_path) as mngr:
        mngr.save(3, params, opt_state, {"rng": jax.random.key(5)})
    code = f"""
        import numpy as np, jax, optax
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from flax import nnx
        from sparrow_jax.runtime.checkpoint import CheckpointManager, abstract_like, abstract_with_shardings
        assert jax.device_count() == 8
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
        spec = {{2: P("data", "model"), 1: P("model"), 0: P()}}
        def shard(tree):
            return jax.tree.map(lambda x: NamedSharding(mesh, spec[len(x.shape)]), tree)
        abs_params = nnx.state(nnx.eval_shape(lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0))))
        abs_opt = jax.eval_shape(optax.adamw(1e-2).init, abs_params)
        target_p = abstract_with_shardings(abs_params, shard(abs_params))
        target_o = abstract_with_shardings(abs_opt, shard(abs_opt))
        with CheckpointManager({str(tmp_path)!r}) as mngr:
            p, o, e = mngr.restore(None, target_p, target_o)
        k = p["kernel"][...]
        assert k.sharding == NamedSharding(mesh, P("data", "model")), k.sharding
        assert k.addressable_shards[0].data.shape == (4, 4)
        assert p["bias"][...].sharding == NamedSharding(mesh, P("model"))
        for leaf, ref in zip(jax.tree.leaves(o), jax.tree.leaves(target_o)):
            assert leaf.sharding == ref.sharding
        np.savez({str(tmp_path / "restored.npz")!r}, kernel=np.asarray(k), mu=np.asarray(o[0].mu["kernel"][...]),
                 rng=np.asarray(jax.random.key_data(e["rng"])))
        # And back: save the sharded state, restore it onto a single device.
        with CheckpointManager({str(tmp_path / "resharded")!r}) as mngr:
            mngr.save(0, p, o, {{}})
            one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            p1, _, _ = mngr.restore(0, abstract_with_shardings(abstract_like(p), one))
        assert p1["kernel"][...].sharding == one
        np.testing.assert_array_equal(np.asarray(p1["kernel"][...]), np.asarray(k))
        print("MESH_OK")
    """
    proc = _run_py(code, {"XLA_FLAGS": cpu_devices_flags(8)})
    assert proc.returncode == 0 and "MESH_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    got = np.load(tmp_path / "restored.npz")
    np.testing.assert_array_equal(got["kernel"], np.asarray(params["kernel"][...]))
    np.testing.assert_array_equal(got["mu"], np.asarray(opt_state[0].mu["kernel"][...]))
    np.testing.assert_array_equal(got["rng"], np.asarray(jax.random.key_data(jax.random.key(5))))


def test_sigterm_turns_into_preemption_stop(tmp_path):
    params, opt_state = _state_and_opt()
    before = signal.getsignal(signal.SIGTERM)
    mngr = CheckpointManager(tmp_path, save_interval_steps=100, catch_sigterm=True)
    try:
        assert mngr.save(1, params, opt_state, {})  # initial save; later ones follow the interval
        assert not mngr.should_stop_for_preemption(3) and not mngr.should_save(3)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while not mngr.should_stop_for_preemption(3) and time.time() < deadline:
            time.sleep(0.01)  # Python runs signal handlers between bytecodes of the main thread
        assert mngr.should_stop_for_preemption(3)
        assert mngr.stop_exit_code == 143      # `sparrow train` then exits 128 + SIGTERM
        assert mngr.save(3, params, opt_state, {"preempted": True})  # off-interval, still saved
        assert mngr.latest_step() == 3
    finally:
        mngr.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_encode_extra_and_save_json_atomic(tmp_path):
    obj = {"b": b"\x01\x02", "t": (1, 2), "a": np.arange(4, dtype=np.int16).reshape(2, 2), "f": np.float32(0.5),
           "nested": [{"k": jax.random.key(1)}]}
    enc = encode_extra(obj)
    json.dumps(enc)  # plain JSON now
    dec = decode_extra(json.loads(json.dumps(enc)))
    assert dec["b"] == b"\x01\x02" and dec["t"] == [1, 2] and dec["f"] == 0.5
    assert dec["a"].dtype == np.int16 and dec["a"].shape == (2, 2)
    assert jax.dtypes.issubdtype(dec["nested"][0]["k"].dtype, jax.dtypes.prng_key)
    with pytest.raises(TypeError, match="str"):
        encode_extra({1: "x"})
    path = tmp_path / "sub" / "state.json"
    save_json_atomic(path, {"v": 1})
    save_json_atomic(path, {"v": 2, "b": b"z"})
    assert decode_extra(json.loads(path.read_text())) == {"v": 2, "b": b"z"}
    assert os.listdir(path.parent) == ["state.json"]  # no temp files left behind


def test_a_run_stopped_by_a_signal_exits_nonzero(monkeypatch, capsys):
    """A run that saved a step and stopped on Ctrl-C / SIGTERM is resumable, not finished: a
    Kubernetes Job or SLURM requeue, `sparrow train && sparrow export` and `sparrow experiment`
    all read exit status 0 as "done". (The whole path, with signals to a real run:
    tests/test_run_safety.py.)"""
    from sparrow_jax.runtime import faults
    from sparrow_jax.train import command

    def stopped():
        raise faults.RunStopped(7, "interrupted (Ctrl-C)", 130)
    monkeypatch.setattr(command, "train", stopped)
    assert command.main(None) == 130
    err = capsys.readouterr().err
    assert ("sparrow train: interrupted (Ctrl-C): saved step 7 and stopped before the run's last "
            "step; the same command resumes from it (exit status 130)") in err
