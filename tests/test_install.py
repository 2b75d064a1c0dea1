"""Installing sparrow-jax is quiet: building the package prints no deprecation warning of ours.

The build runs setuptools' PEP 517 backend (the one pyproject.toml names) directly on a copy of
the packaged files, offline and without build isolation, which is what `pip install` runs inside
its isolated environment. A planted old-style `license = { text = ... }` table must be caught, so
the check cannot pass by not seeing setuptools' output.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGED = ("pyproject.toml", "README.md", "sparrow_jax", "pallas_kernels")
BUILD = ("import os, sys; from setuptools import build_meta; os.makedirs('dist'); "
         "print('WHEEL', build_meta.build_wheel('dist'))")


def _build(src: Path) -> tuple[str, Path]:
    """Build a wheel from `src` with `python -W default`; (all console output, the wheel)."""
    r = subprocess.run([sys.executable, "-W", "default", "-c", BUILD], cwd=src,
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    name = re.search(r"^WHEEL (\S+)$", r.stdout, re.M).group(1)
    return out, src / "dist" / name


def _copy(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGED:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    return src


def our_deprecations(output: str) -> list[str]:
    """Lines of a build's output that report a deprecation about our project's configuration."""
    return [ln for ln in output.splitlines()
            if re.search(r"deprecat", ln, re.I)
            and re.search(r"license|pyproject|project\.", ln, re.I)]


def test_build_is_quiet_and_the_license_is_spdx(tmp_path):
    out, wheel = _build(_copy(tmp_path))
    assert not our_deprecations(out), out
    assert "SetuptoolsDeprecationWarning" not in out, out
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta.splitlines(), meta[:2000]


def test_the_check_sees_a_planted_license_table(tmp_path):
    src = _copy(tmp_path)
    text = (src / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text
    (src / "pyproject.toml").write_text(text.replace('license = "Apache-2.0"',
                                                     'license = { text = "Apache-2.0" }'))
    out, _ = _build(src)
    assert our_deprecations(out), f"the old license table built without a warning:\n{out}"


def test_every_upper_bound_says_why():
    """Each `<` bound on a dependency has a comment above it (in its block of requirements)."""
    lines = (REPO / "pyproject.toml").read_text().splitlines()
    project = tomllib.loads("\n".join(lines))["project"]
    deps = [*project["dependencies"], *(d for ds in project["optional-dependencies"].values()
                                        for d in ds)]
    assert any("<" in d for d in deps)
    bare = []
    for i, ln in enumerate(lines):
        m = re.match(r'^\s*"([^"]+)",?\s*$', ln)
        if not m or m.group(1) not in deps or not re.search(r"<|==", m.group(1)):
            continue
        k = i - 1   # walk up over the requirement lines that share one comment
        while k >= 0 and re.match(r'^\s*"[^"]+",?\s*$', lines[k]):
            k -= 1
        if k < 0 or not lines[k].strip().startswith("#"):
            bare.append(m.group(1))
    assert not bare, f"upper bounds without a comment saying why: {bare}"
