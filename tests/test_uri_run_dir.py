"""Run directories that are URIs (gs://...) stay URIs: orbax gets them unchanged and the text/JSON
files (operative_config.gin, summary.json, metrics.jsonl, TensorBoard events) are written through
etils.epath. No network here: `epath.testing.mock_epath` serves `gs://bucket/...` from a local
directory, so every epath call on the URI lands there - and a URI mangled into a local path
(pathlib's `resolve()` makes `<cwd>/gs:/bucket/run`) would land somewhere else.
"""

from __future__ import annotations

import json
import os

import gin
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.data import synthetic
from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime.metrics import MetricsWriter, read_jsonl, read_scalars

URI = "gs://bucket/runs/r1"


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    """gs://<path> is served from tmp_path/gcs/<path>; the cwd is an empty directory, where a
    mangled URI would show up as gs:/..."""
    root = tmp_path / "gcs"
    root.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    # Orbax asks the GCS API (google-cloud-storage, a network call) whether a gs:// bucket has a
    # hierarchical namespace before listing steps; this bucket is a plain local directory.
    from orbax.checkpoint._src.path import gcs_utils
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)

    def local(p):
        s = os.fspath(p)
        return str(root / s[len("gs://"):]) if s.startswith("gs://") else s

    def back(p):
        s = os.fspath(p)
        return "gs://" + os.path.relpath(s, root) if s.startswith(str(root)) else s

    def one(fn, path, *args, **kwargs):
        return fn(local(path), *args, **kwargs)

    def two(fn, src, dst, *args, **kwargs):
        return fn(local(src), local(dst), *args, **kwargs)

    def glob(fn, pattern):
        return [back(p) for p in fn(local(pattern))]

    def walk(fn, top, **kwargs):
        for d, dirs, files in fn(local(top), **kwargs):
            yield back(d), dirs, files

    with epath_testing.mock_epath(open=one, exists=one, isdir=one, listdir=one, makedirs=one,
                                  mkdir=one, remove=one, rmtree=one, stat=one, rename=two,
                                  replace=two, copy=two, glob=glob, walk=walk):
        yield root
    assert not (cwd / "gs:").exists() and os.listdir(cwd) == [], os.listdir(cwd)


def test_resolve_run_dir_keeps_uris_and_absolutizes_local(tmp_path, monkeypatch):
    assert str(ckpt.resolve_run_dir(URI)) == URI
    assert os.fspath(ckpt.resolve_run_dir("s3://b/x/")).startswith("s3://b/x")
    monkeypatch.chdir(tmp_path)
    assert str(ckpt.resolve_run_dir("runs/a")) == str(tmp_path / "runs" / "a")
    assert ckpt.is_uri(URI) and not ckpt.is_uri("/gs/bucket") and not ckpt.is_uri("gs:/x")


def test_text_and_json_files_go_through_epath(fake_gcs):
    ckpt.write_text_atomic(ckpt.resolve_run_dir(URI) / "operative_config.gin", "a = 1\n")
    ckpt.save_json_atomic(f"{URI}/summary.json", {"last": {"reward": 0.5}})
    assert (fake_gcs / "bucket/runs/r1/operative_config.gin").read_text() == "a = 1\n"
    assert json.loads((fake_gcs / "bucket/runs/r1/summary.json").read_text()) == {
        "last": {"reward": 0.5}}


def test_metrics_writer_mirrors_and_uploads(fake_gcs, caplog):
    caplog.set_level("INFO", logger="sparrow_jax.runtime.metrics")
    with MetricsWriter(URI) as mw:
        mw.scalars(1, {"reward/mean": 0.25})
        mw.text(0, "config/operative_gin", "    a = 1")
    assert "local mirror" in caplog.text and mw.local_dir in caplog.text
    remote = fake_gcs / "bucket/runs/r1"
    assert read_scalars(remote)["reward/mean"] == [(1, 0.25)]  # events copied to the URI
    assert [r["step"] for r in read_jsonl(URI)] == [1]          # read back through epath
    # A resumed writer continues the URI's metrics.jsonl (object stores cannot append).
    with MetricsWriter(URI) as mw:
        mw.scalars(2, {"reward/mean": 0.5})
    assert [r["step"] for r in read_jsonl(remote)] == [1, 2]


def test_checkpoint_manager_hands_orbax_the_uri(fake_gcs):
    with ckpt.CheckpointManager(ckpt.resolve_run_dir(URI)) as m:
        assert m.directory == f"{URI}/checkpoints"
        assert m.orbax_directory == f"{URI}/checkpoints"  # what orbax (tensorstore) opens
        assert m.step_dir(3) == f"{URI}/checkpoints/3"
        assert m.latest_step() is None
    assert (fake_gcs / "bucket/runs/r1/checkpoints").is_dir()  # created through epath


def test_trainer_keeps_a_uri_run_dir(fake_gcs, tmp_path):
    """`sparrow train`'s setup with a gs:// run directory: everything it writes before the first
    step lands at the URI (checkpoint arrays go through orbax's tensorstore gcs driver, which
    needs a real bucket and is not exercised here)."""
    from sparrow_jax.train import Trainer, TrainConfig

    make_tiny_synthetic_model(tmp_path / "model")
    synthetic.write_jsonl(str(tmp_path / "train.jsonl"), 4, seed=0, k_range=(1, 1), num_letters=4)
    gin.clear_config()
    cli.parse_gin([], [f"TrainConfig.run_dir = '{URI}'",
                       f"TrainConfig.model_path = '{tmp_path / 'model'}'",
                       f"TrainConfig.train_data = '{tmp_path / 'train.jsonl'}'",
                       "TrainConfig.reward = 'synthetic_exact'",
                       "TrainConfig.reward_processes = 0",
                       "TrainConfig.rollout_mode = 'dense'",
                       "TrainConfig.adapt_schedule = False"])
    trainer = Trainer(TrainConfig())
    try:
        assert isinstance(trainer.run_dir, epath.Path) and str(trainer.run_dir) == URI
        assert trainer.ckpt.directory == f"{URI}/checkpoints"
        assert trainer.ckpt.orbax_directory == f"{URI}/checkpoints"
        trainer.writer.scalars(0, {"x": 1.0})
    finally:
        trainer.close()
    remote = fake_gcs / "bucket/runs/r1"
    assert "TrainConfig.run_dir = 'gs://bucket/runs/r1'" in (
        remote / "operative_config.gin").read_text()
    assert [r["step"] for r in read_jsonl(remote)] == [0]
    # The TensorBoard events reached the URI (the operative-config text is written by run(),
    # after a resume, so this setup-only check looks at the scalar it wrote).
    assert "x" in read_scalars(remote)
