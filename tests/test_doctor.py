"""`sparrow doctor` on CPU: every Pallas kernel in interpret mode against the XLA reference
(itself against float64 NumPy) on Qwen3 head shapes with bf16 page pools, ragged and empty rows,
plus a short rollout on both engines; a broken kernel fails loudly with exit status 1."""

from __future__ import annotations


import gin
import jax.numpy as jnp
import pytest

from sparrow_jax import cli




def _doctor(argv, capsys):
    gin.clear_config()
    try:
        rc = cli.main(["doctor", *argv])
    finally:
        gin.clear_config()
    return rc, capsys.readouterr().out


def _rows(out):
    return [line.split() for line in out.splitlines() if " PASS " in line or " FAIL " in line
            or " SKIP " in line]


@pytest.mark.slow
def test_doctor_passes_on_cpu(capsys, restore_logging):
    rc, out = _doctor([], capsys)
    assert rc == 0, out
    rows = _rows(out)
    for model in ("qwen3-1.7b", "qwen3-8b"):
        for kind in ("sparse", "dense"):
            got = {r[4]: r[5] for r in rows if r[0] == model and r[1] == kind}
            assert got == {"xla": "PASS", "pallas_tpu": "PASS", "pallas_triton": "PASS",
                           "jax_triton": "SKIP"}, (model, kind, out)
    assert "rollout static vs paged samples" in out and "100% of tokens equal" in out
    assert "block selection 4 x 24 -> 8" in out and "same ids as xla (interpret)" in out
    assert out.rstrip().endswith("doctor: PASS (0 failed, 16 passed, 4 skipped)")


def test_doctor_catches_a_wrong_block_selection(monkeypatch):
    """A selection kernel that picks a wrong block does not crash: the doctor must say so."""
    from pallas_kernels import pallas_triton_select
    from sparrow_jax.tools import doctor
    real = pallas_triton_select.select_ids_triton

    def off_by_one(*args, **kwargs):
        ids, num = real(*args, **kwargs)
        return ids.at[:, 1].add(1), num

    monkeypatch.setattr(pallas_triton_select, "select_ids_triton", off_by_one)
    [row] = doctor.check_selection("cpu")
    assert (row.backend, row.status, row.detail) == ("pallas_triton", "FAIL",
                                                     "ids differ from the XLA selection")


def test_doctor_fails_loudly_on_a_broken_kernel(capsys, monkeypatch, restore_logging):
    import pallas_kernels.pallas_triton as triton

    real = triton.paged_block_sparse_decode_triton

    def broken(*args, **kwargs):      # a plausible bug: the output of the wrong KV head group
        out, lse = real(*args, **kwargs)
        return jnp.roll(out, 1, axis=1), lse

    monkeypatch.setattr(triton, "paged_block_sparse_decode_triton", broken)
    rc, out = _doctor(["--backends", "pallas_triton", "--skip_rollout"], capsys)
    assert rc == 1, out
    failed = [r for r in _rows(out) if r[5] == "FAIL"]
    assert len(failed) == 4 and all(r[4] == "pallas_triton" for r in failed), out
    assert "max |out - ref|" in out and "doctor: FAIL (4 failed" in out


def test_backends_and_sizes_per_platform():
    """What the doctor runs where (no hardware needed to decide it)."""
    from sparrow_jax.tools import doctor
    runnable = {p: [n for n, _, skip in doctor.backends_for(p) if not skip]
                for p in ("cpu", "gpu", "tpu")}
    assert runnable["cpu"] == ["pallas_tpu", "pallas_triton"]          # interpret mode
    assert runnable["tpu"] == ["pallas_tpu"]
    assert "pallas_triton" in runnable["gpu"] and "pallas_tpu" not in runnable["gpu"]
    assert all(not interpret for _, interpret, _ in doctor.backends_for("gpu"))
    big = doctor.sizes_for("gpu")
    assert big.context >= 4096 and big.selected * doctor.BLOCK >= 1024 and big.rows >= 8
    assert doctor.HEADS == {"qwen3-1.7b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
