"""The launchers on a stock machine, without network or pip: stub `python3`, `nvidia-smi`, jax
and `gcloud` on a PATH that holds nothing else (launch/lib.sh's real logic runs; installs are
printed by SPARROW_LAUNCH_DRY_RUN=1, training is never started)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("dirname", "head", "tail", "tr", "grep", "sed", "mktemp", "rm", "cat", "wc", "mkdir",
         "git", "tar", "gzip", "env", "hostname", "cp")

PYTHON_STUB = r"""#!/bin/bash
# Answers the launchers' probes; records anything else.
case "$*" in
  *version_info*) echo "$STUB_PY_VERSION" ;;
  *jaxlib*) if [ -n "${STUB_PREINSTALLED:-}" ]; then echo "sparrow-jax: $STUB_PREINSTALLED";
            else echo "ModuleNotFoundError: No module named 'jax'" >&2; exit 1; fi ;;
  *local_device_count*) [ -n "${STUB_JAX_WARN:-}" ] && echo "$STUB_JAX_WARN" >&2
                        echo "sparrow-jax: $STUB_JAX" ;;
  *sysconfig*) echo /nonexistent ;;
  *) echo "python $*" >> "$STUB_LOG" ;;
esac
"""
NVIDIA_SMI_STUB = r"""#!/bin/bash
case "$*" in
  *driver_version*) echo "$STUB_DRIVER" ;;
  -L) for i in $(seq 0 $((STUB_GPUS - 1))); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: x)"; done ;;
esac
"""
GCLOUD_STUB = r"""#!/bin/bash
echo "gcloud $*" >> "$STUB_LOG"
if [ "$4" = scp ]; then cp "${@: -2:1}" "$STUB_OUT/copied.tgz"; fi
if [ "$4" = ssh ] && [ -n "${STUB_SSH_FAIL:-}" ]; then exit 1; fi
exit 0
"""


@pytest.fixture
def sandbox(tmp_path):
    """A bin directory with the stubs and the few real tools the scripts use - no python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS + ("seq",):
        real = shutil.which(tool)
        assert real, tool
        (bin_dir / tool).symlink_to(real)
    for name, text in (("python3", PYTHON_STUB), ("nvidia-smi", NVIDIA_SMI_STUB),
                       ("gcloud", GCLOUD_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "out").mkdir()
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "STUB_LOG": str(tmp_path / "log"),
           "STUB_OUT": str(tmp_path / "out"), "STUB_PY_VERSION": "3.11", "STUB_DRIVER": "580.82.07",
           "STUB_GPUS": "8", "STUB_JAX": "gpu 8", "SPARROW_LAUNCH_DRY_RUN": "1"}
    return tmp_path, env


def launch(script: str, args: list[str], env: dict, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(REPO / "launch" / script), *args], cwd=REPO,
                          env={**env, **extra}, capture_output=True, text=True, timeout=60)


def last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script", ["gpu.sh", "tpu_setup.sh"])
def test_python_310_stops_with_one_clear_line(sandbox, script):
    _, env = sandbox
    r = launch(script, ["configs/qwen3_1p7b_gpu.gin"], env, STUB_PY_VERSION="3.10")
    assert r.returncode == 1
    line = last_line(r)
    assert re.match(rf"\[{re.escape(script)}[^\]]*\] ERROR: no Python >= 3\.11 found \(python3 is "
                    r"3\.10;", line), r.stderr
    assert "uv python install 3.11" in line and "PYTHON=/path/to/python3.11" in line
    r = launch(script, ["configs/qwen3_1p7b_gpu.gin"], env, STUB_PY_VERSION="3.10",
               PYTHON="python3")
    assert r.returncode == 1 and "PYTHON=python3 is Python 3.10" in last_line(r)


def test_local_launcher_without_a_venv_needs_python_311(sandbox):
    """launch/local.sh builds ./.venv with the same Python search (a copy of the launcher in a
    fresh directory: the repo's own .venv exists)."""
    tmp, env = sandbox
    (tmp / "proj" / "launch").mkdir(parents=True)
    for name in ("local.sh", "lib.sh"):
        shutil.copy(REPO / "launch" / name, tmp / "proj" / "launch" / name)
    r = subprocess.run(["/bin/bash", str(tmp / "proj/launch/local.sh"), "demo"], cwd=tmp,
                       env={**env, "STUB_PY_VERSION": "3.10"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "[local.sh] ERROR: no Python >= 3.11 found" in last_line(r)
    assert not (tmp / "proj" / ".venv").exists()


FINDER = """import importlib.util, sys
ROOT = {root!r}
class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "sparrow_jax":
            return importlib.util.spec_from_file_location(
                name, ROOT + "/sparrow_jax/__init__.py", submodule_search_locations=[ROOT + "/sparrow_jax"])
def install():
    sys.meta_path.append(_Finder)
"""


def test_local_launcher_refuses_to_repoint_a_shared_venv(tmp_path):
    """A second checkout whose .venv links to another checkout's venv (a git worktree): local.sh
    must not `pip install -e .` into it (that re-points the shared editable install) but stop
    naming both checkouts and the deliberate command. A fake layout: a pip-less venv whose
    sparrow_jax is an editable install - setuptools' finder, or a plain .pth path line."""
    venv, first, second = tmp_path / "venv", tmp_path / "first", tmp_path / "second"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    site = next(venv.glob("lib/python*/site-packages"))
    for checkout in (first, second):
        (checkout / "sparrow_jax").mkdir(parents=True)
        (checkout / "sparrow_jax" / "__init__.py").write_text("raise RuntimeError('imported')\n")
        (checkout / "launch").mkdir()
        for name in ("local.sh", "lib.sh"):
            shutil.copy(REPO / "launch" / name, checkout / "launch" / name)
        (checkout / "pyproject.toml").write_text("")
    (second / ".venv").symlink_to(venv)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(second)}

    def elsewhere(checkout: Path) -> str:
        return subprocess.run(
            ["/bin/bash", "-c", '. launch/lib.sh; sparrow_editable_elsewhere "$0" "$1"',
             str(second / ".venv/bin/python"), str(checkout)], cwd=second, env=env,
            capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    assert elsewhere(second) == ""                        # not installed: a fresh venv installs
    for style in ("finder", "pth"):
        for old in site.glob("*sparrow*"):
            old.unlink()
        if style == "finder":
            (site / "_fake_sparrow_finder.py").write_text(FINDER.format(root=str(first)))
            (site / "_fake_sparrow.pth").write_text("import _fake_sparrow_finder; "
                                                    "_fake_sparrow_finder.install()\n")
        else:
            (site / "_fake_sparrow.pth").write_text(f"{first}\n")
        # PYTHONPATH (second) and the working directory (second) must not hide the install.
        assert elsewhere(second) == str(first), style
        assert elsewhere(first) == "", style              # its own checkout: install as today
        r = subprocess.run(["/bin/bash", str(second / "launch/local.sh"), "demo"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "installing sparrow-jax" not in out, out
        line = last_line(r)
        assert line.startswith("[local.sh] ERROR: .venv's sparrow-jax is an editable install of "
                               f"{first}, not of this checkout {second}"), line
        assert f"pip install --no-deps -e {second}" in line
        assert not (venv / ".sparrow-installed").exists()


@pytest.mark.parametrize("driver,extra", [("580.82.07", "cuda13"), ("575.57.08", "cuda12"),
                                          ("535.104.05", "cuda12")])
def test_driver_version_selects_the_cuda_extra(sandbox, driver, extra):
    _, env = sandbox
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env, STUB_DRIVER=driver)
    assert r.returncode == 0, r.stderr
    pip = [ln for ln in r.stderr.splitlines() if "pip install -q -c launch/constraints.txt" in ln]
    assert pip and pip[0].endswith(f"-e . jax[{extra}] jax-triton"), r.stderr
    assert "jax on gpu with 8 local device(s): OK" in r.stderr
    assert last_line(r) == "[gpu.sh] dry run: sparrow train configs/qwen3_1p7b_gpu.gin"


def test_install_only_stops_after_the_check(sandbox):
    _, env = sandbox
    r = launch("gpu.sh", [], env, SPARROW_INSTALL_ONLY="1")
    assert r.returncode == 0, r.stderr
    assert "jax on gpu with 8 local device(s): OK" in r.stderr
    assert last_line(r).startswith("[gpu.sh] installed and checked; next: ")
    assert last_line(r).endswith("sparrow doctor") and "sparrow train" not in r.stderr
    r = launch("gpu.sh", [], env, SPARROW_INSTALL_ONLY="1", STUB_JAX="cpu 1")
    assert r.returncode == 1 and "jax runs on 'cpu'" in last_line(r)


def test_old_driver_is_refused(sandbox):
    _, env = sandbox
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env, STUB_DRIVER="470.57.02")
    assert r.returncode == 1 and "NVIDIA driver 470.57.02 is too old" in last_line(r)


def test_jax_on_cpu_or_missing_gpus_stops_the_gpu_launcher(sandbox):
    _, env = sandbox
    warn = ("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not "
            "installed. Falling back to cpu.")
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env, STUB_JAX="cpu 1", STUB_JAX_WARN=warn)
    assert r.returncode == 1, r.stderr
    assert last_line(r).startswith(f"[gpu.sh] ERROR: jax runs on 'cpu', not 'gpu' ({warn});")
    assert "dry run: sparrow train" not in r.stderr           # never a silent CPU run
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env, STUB_JAX="gpu 4")
    assert r.returncode == 1 and "jax sees 4 gpu device(s) but this host has 8" in last_line(r)
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env, STUB_JAX="gpu 2",
               CUDA_VISIBLE_DEVICES="0,1")
    assert r.returncode == 0, r.stderr


def test_preinstalled_jax_gets_every_other_dependency(sandbox):
    _, env = sandbox
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env,
               STUB_PREINSTALLED="0.10.2 0.10.2 gpu")
    assert r.returncode == 0, r.stderr
    assert "using the preinstalled jax 0.10.2 (jaxlib 0.10.2)" in r.stderr
    # A venv that sees the image's packages, so nothing is installed into the image's Python.
    assert "-m venv --system-site-packages .venv-gpu-image" in r.stderr
    pip = [ln for ln in r.stderr.splitlines() if "pip install" in ln]
    assert len(pip) == 2 and pip[0].endswith(" -e .") and "--no-deps" not in pip[0], pip
    # jax-triton where a release fits the image's jax (pinned to it); the version is tested.
    assert pip[1].endswith(" jax-triton") and "-c /" in pip[1], pip
    assert "jax 0.10.2 is the tested version" in r.stderr


def test_an_untested_image_jax_is_named_and_the_wheelhouse_used_offline(sandbox, tmp_path):
    _, env = sandbox
    house = tmp_path / "wheels"
    house.mkdir()
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env,
               STUB_PREINSTALLED="0.11.1 0.11.1 gpu", SPARROW_WHEELHOUSE=str(house))
    assert r.returncode == 0, r.stderr
    assert "WARNING: jax 0.11.1 is NOT the tested version (0.10.2" in r.stderr
    pip = [ln for ln in r.stderr.splitlines() if "pip install" in ln]
    assert len(pip) == 2 and all(f"--no-index --find-links {house}" in ln for ln in pip), pip
    # The CUDA venv and the TPU set-up install from it too, and never upgrade pip online.
    for script, args, extra in (("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], {}),
                                ("tpu_setup.sh", ["configs/qwen3_8b_tpu.gin"],
                                 dict(STUB_JAX="tpu 4", TPU_CHIPS_PER_HOST="4"))):
        r = launch(script, args, env, SPARROW_WHEELHOUSE=str(house), **extra)
        assert r.returncode == 0, r.stderr
        pip = [ln for ln in r.stderr.splitlines() if "pip install" in ln]
        assert len(pip) == 1 and f"--no-index --find-links {house} -c launch/constraints.txt" \
            in pip[0] and "--upgrade" not in pip[0], pip
    r = launch("gpu.sh", ["configs/qwen3_1p7b_gpu.gin"], env,
               SPARROW_WHEELHOUSE=str(tmp_path / "missing"))
    assert r.returncode == 1 and "is not a directory" in last_line(r)


def test_wheelhouse_downloads_every_target_for_both_pythons(sandbox, tmp_path):
    _, env = sandbox
    r = launch("wheelhouse.sh", [str(tmp_path / "house")], env)
    assert r.returncode == 0, r.stderr
    runs = [ln for ln in r.stderr.splitlines() if "pip download" in ln]
    assert len(runs) == 6, runs          # cuda12, cuda13, tpu x Python 3.11, 3.12
    for target, pv in [(t, v) for t in ("cuda12", "cuda13", "tpu") for v in ("3.11", "3.12")]:
        line = [ln for ln in runs if f"--python-version {pv} " in ln
                and (f"jax[{target}]" in ln or (target == "tpu" and ".whl[tpu]" in ln))]
        assert len(line) == 1, (target, pv, runs)
        assert "--only-binary=:all: --platform manylinux_2_31_x86_64" in line[0]
        assert "-c launch/constraints.txt" in line[0] and "sparrow_jax-0.1.0-py3-none-any.whl" \
            in line[0]
    assert "pip wheel -q --no-deps" in r.stderr
    r = launch("wheelhouse.sh", [str(tmp_path / "h"), "--targets", "rocm"], env)
    assert r.returncode == 1 and "unknown target 'rocm'" in last_line(r)


def test_tpu_setup_checks_jax_and_the_paths_on_the_worker(sandbox):
    tmp, env = sandbox
    r = launch("tpu_setup.sh", ["configs/qwen3_8b_tpu.gin"], env, STUB_JAX="tpu 4",
               TPU_CHIPS_PER_HOST="4")
    assert r.returncode == 0, r.stderr
    assert "pip install -q -c launch/constraints.txt -e .[tpu]" in r.stderr
    assert "python -m sparrow_jax.train.host_check configs/qwen3_8b_tpu.gin" in \
        (tmp / "log").read_text()
    r = launch("tpu_setup.sh", ["configs/qwen3_8b_tpu.gin"], env, STUB_JAX="cpu 1")
    assert r.returncode == 1 and "jax runs on 'cpu', not 'tpu'" in last_line(r)


def test_tpu_pod_copies_tracked_files_and_starts_detached(sandbox):
    tmp, env = sandbox
    r = launch("tpu_pod.sh", ["my-tpu", "us-east5-a", "configs/qwen3_8b_tpu.gin"], env)
    assert r.returncode == 0, r.stderr
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    with tarfile.open(tmp / "out" / "copied.tgz") as tar:
        copied = set(tar.getnames())
    assert copied and copied <= tracked, copied - tracked
    assert not [n for n in copied if n.startswith((".venv", "runs/", ".compile-env"))]
    calls = (tmp / "log").read_text().split("gcloud compute tpus tpu-vm ")[1:]
    assert [c.split()[0] for c in calls] == ["scp", "ssh", "ssh"], calls
    setup, start = calls[1:]
    assert "bash launch/tpu_setup.sh configs/qwen3_8b_tpu.gin" in setup
    assert ("nohup sparrow train configs/qwen3_8b_tpu.gin --gin_param 'TrainConfig.distributed "
            "= True' > logs/train-$(hostname).log 2>&1 < /dev/null &") in start
    # A worker whose set-up fails (no Python, jax on CPU, a missing path) starts nothing.
    (tmp / "log").unlink()
    r = launch("tpu_pod.sh", ["my-tpu", "us-east5-a", "configs/qwen3_8b_tpu.gin"], env,
               STUB_SSH_FAIL="1")
    assert r.returncode == 1 and "nothing was started" in last_line(r)
    assert "nohup" not in (tmp / "log").read_text()


def test_host_check_names_the_missing_paths(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sparrow_jax.train.host_check",
                        "configs/qwen3_8b_tpu.gin", "--gin_param",
                        "TrainConfig.run_dir = '%s'" % (tmp_path / "run")],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "/mnt/models/Qwen3-8B" in r.stderr and "/mnt/data/dapo_math_17k.parquet" in r.stderr


def test_constraints_pin_the_tested_versions():
    """One place states the tested stack, and it is what this repo runs and compiles with."""
    import jax
    pins = dict(ln.split("==") for ln in (REPO / "launch/constraints.txt").read_text().splitlines()
                if ln and not ln.startswith("#"))
    assert pins["jax"] == pins["jaxlib"] == jax.__version__
    assert pins["jax-cuda13-plugin"] == pins["jax-cuda12-plugin"] == jax.__version__
    compile_env = REPO / ".compile-env"
    if compile_env.is_dir():      # built by launch/local.sh test (.ci/compile_env.sh)
        for name in ("libtpu", "jax_triton", "triton", "jax_cuda13_plugin", "jax_cuda13_pjrt"):
            found = [p.name for p in compile_env.glob(f"{name}-*.dist-info")]
            if found:
                version = found[0][len(name) + 1:-len(".dist-info")]
                assert pins[name.replace("_", "-")] == version, (name, version)
    assert pins["jax-cuda13-pjrt"] == pins["jax-cuda12-pjrt"] == jax.__version__
    # The CUDA 12 set is stated as resolved against the index only, not compiled or run.
    text = (REPO / "launch/constraints.txt").read_text()
    assert "jax-cuda12-plugin/pjrt RESOLVED ONLY" in text
    # pyproject's extras: CUDA 13 (`gpu`) and CUDA 12 (`gpu-cuda12`), the same jax range.
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["gpu"][0].startswith("jax[cuda13]") and extras["gpu-cuda12"][0].startswith(
        "jax[cuda12]") and extras["gpu"][0][11:] == extras["gpu-cuda12"][0][11:]
    for script in ("gpu.sh", "tpu_setup.sh"):
        assert '-c "$SPARROW_CONSTRAINTS"' in (REPO / "launch" / script).read_text()
    assert "pip install -q -c launch/constraints.txt" in (REPO / "launch/local.sh").read_text()


def test_compile_tests_wait_for_the_background_install(tmp_path, monkeypatch):
    """`launch/local.sh test` installs the compile environment in the background: a compile test
    waits for the installer's exit status, passes when it installed, and fails with the log's
    tail (not a missing-folder message) when it failed."""
    import threading

    from _pytest.outcomes import Failed

    from hf_fixtures import require_compile_env

    env_dir, done, log = tmp_path / "ce", tmp_path / "exit_status", tmp_path / "install.log"
    env_dir.mkdir()
    monkeypatch.setenv("SPARROW_COMPILE_ENV_DONE", str(done))
    monkeypatch.setenv("SPARROW_COMPILE_ENV_LOG", str(log))

    def finish():                           # the installer ends while the test waits
        (env_dir / ".sparrow-compile-env").write_text("stamp")
        done.write_text("0\n")
    timer = threading.Timer(1.0, finish)
    timer.start()
    require_compile_env(env_dir, timeout_s=60)
    timer.join()
    assert done.exists()

    done.write_text("1\n")
    log.write_text("ERROR: No matching distribution found for libtpu==0.0.42.*\n")
    with pytest.raises(Failed, match=r"(?s)installing the compile environment failed \(exit 1\).*libtpu"):
        require_compile_env(env_dir, timeout_s=60)

    done.unlink()
    with pytest.raises(Failed, match="ran over 1 s"):
        require_compile_env(env_dir, timeout_s=1)
