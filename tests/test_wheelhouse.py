"""An offline install from a wheelhouse (launch/lib.sh's sparrow_pip_install, which the GPU and
TPU launchers call): two locally built wheels, one depending on the other, into a fresh venv
with every network route of pip broken (a dead proxy and index); and without a wheelhouse the
same install fails with the line that says how to make one. (~20 s alone, more on a loaded machine: a venv and two wheels; marked slow.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEAD = "http://127.0.0.1:9"          # the discard port: nothing answers
OFFLINE = {"HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD,
           "PIP_INDEX_URL": DEAD + "/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _package(root: Path, name: str, deps: list[str]) -> Path:
    src = root / name
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text(f"WHO = {name!r}\n")
    quoted = ", ".join(f'"{d}"' for d in deps)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "1.0"\ndependencies = [{quoted}]\n'
        f'[tool.setuptools]\npackages = ["{name}"]\n')
    return src


def _sh(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **OFFLINE, **env})


@pytest.mark.slow
def test_offline_install_from_a_wheelhouse_into_a_fresh_venv(tmp_path):
    house = tmp_path / "house"
    for name, deps in (("sparrowtesta", ["sparrowtestb>=1"]), ("sparrowtestb", [])):
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(house),
                            str(_package(tmp_path / "src", name, deps))],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, **OFFLINE})
        assert r.returncode == 0, r.stderr[-2000:]
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"

    install = f'. launch/lib.sh; sparrow_pip_install "{py}" sparrowtesta'
    r = _sh(install, {"SPARROW_WHEELHOUSE": str(house)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = subprocess.run([str(py), "-c", "import sparrowtesta, sparrowtestb; "
                          "print(sparrowtesta.WHO, sparrowtestb.WHO)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["sparrowtesta", "sparrowtestb"], out.stderr

    # No wheelhouse: pip reaches for the (dead) index and the launcher says what to do.
    r = _sh(f'. launch/lib.sh; sparrow_pip_install "{py}" sparrowtestc', {})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "ERROR: pip install sparrowtestc failed" in last and \
        "launch/wheelhouse.sh DIR" in last and "SPARROW_WHEELHOUSE=DIR" in last, last
    # A wheelhouse without the wheel: named as such, nothing fetched from the network.
    r = _sh(install.replace("sparrowtesta", "sparrowtestc"), {"SPARROW_WHEELHOUSE": str(house)})
    assert r.returncode == 1 and "from the wheelhouse" in r.stderr.strip().splitlines()[-1]
