"""The docs stand alone: no path outside the repository, no dangling link, no unrecorded number.

- README.md and docs/**/*.md: every relative markdown link names a file of this repository that
  exists; no `../` path leaves the repository; no mention of notes that live outside it.
- Source, configs, launchers and CI files: no path into a sibling `shared` directory.
- Every number in README.md (prose, tables, output blocks; not commands, code names or link
  targets) occurs in a docs/*.md section that carries a date, i.e. in a dated record.

Each check is also run on a planted violation, so it cannot pass by seeing nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Spelled in pieces so that this file does not match its own checks.
OUTSIDE_NOTES = ("SPEC" + ".md", "DEMO" + "_NOTES", "../" + "shared", "shared" + "/")
MACHINE_ROOT = "/" + "work/"    # where this project was developed: no file may depend on it
CODE_SUFFIXES = {".py", ".sh", ".gin", ".toml", ".cfg", ".txt", ".yml", ".yaml", ".json", ".md", ""}


def doc_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _outside(path: Path, target: str, root: Path) -> bool:
    dest = (path.parent / target).resolve()
    return dest != root and root not in dest.parents


def page_problems(path: Path, root: Path = REPO) -> list[str]:
    """What in one markdown page points outside `root` or at nothing."""
    text = path.read_text()
    rel = path.relative_to(root)
    bad = []
    for note in OUTSIDE_NOTES[:2]:
        if note in text:
            bad.append(f"{rel}: mentions {note}, which is not in this repository")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        if target.startswith("/") or _outside(path, target, root):
            bad.append(f"{rel}: link {target} leaves the repository")
        elif not (path.parent / target).exists():
            bad.append(f"{rel}: link {target} names a file that does not exist")
    # Paths outside links, e.g. in backticks: any ../ that climbs out of the repository.
    for target in re.findall(r"(?<![\w.])((?:\.\./)+[\w.\-/]*)", text):
        if _outside(path, target, root):
            bad.append(f"{rel}: path {target} leaves the repository")
    return sorted(set(bad))


def code_problems(files: list[Path], root: Path = REPO) -> list[str]:
    bad = []
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for note in (OUTSIDE_NOTES[2], OUTSIDE_NOTES[0], OUTSIDE_NOTES[1], MACHINE_ROOT):
            if note in text:
                bad.append(f"{f.relative_to(root)}: mentions {note}")
    return bad


def tracked_files() -> list[Path]:
    r = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        names = r.stdout.splitlines()
    else:   # not a git checkout (a source tree copied without .git): walk it
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                 and not any(part.startswith(".venv") or part == ".git" for part in p.parts)]
    return [REPO / n for n in names
            if Path(n).suffix in CODE_SUFFIXES and (REPO / n).is_file()
            and not n.startswith(("data/", "checkpoints/"))]


def test_docs_stay_inside_the_repository_and_links_resolve():
    bad = [p for page in doc_pages() for p in page_problems(page)]
    assert not bad, "\n".join(bad)


def test_code_does_not_point_outside_the_repository():
    files = [f for f in tracked_files() if f != Path(__file__).resolve()]
    assert len(files) > 50, "found almost no files: is the listing broken?"
    bad = code_problems(files)
    assert not bad, "\n".join(bad)


def test_link_checks_catch_planted_violations(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("# ok\n")
    (tmp_path / "README.md").write_text(
        "[fine](docs/ok.md) [web](https://example.org/x.md)\n"
        "[up](../shared/notes.md) [gone](docs/missing.md) see `../../etc/passwd`\n"
        "as in " + OUTSIDE_NOTES[0] + "\n")
    bad = page_problems(tmp_path / "README.md", tmp_path)
    assert any("../shared/notes.md leaves" in b for b in bad), bad
    assert any("docs/missing.md names a file that does not exist" in b for b in bad), bad
    assert any("../../etc/passwd leaves" in b for b in bad), bad
    assert any("mentions " + OUTSIDE_NOTES[0] in b for b in bad), bad
    assert not any("ok.md" in b or "example.org" in b for b in bad), bad
    (tmp_path / "a.py").write_text("# see " + OUTSIDE_NOTES[2] + "/x\n")
    (tmp_path / "b.sh").write_text("cd " + MACHINE_ROOT + "main\n")
    (tmp_path / "c.py").write_text("x = 1\n")
    found = code_problems([tmp_path / n for n in ("a.py", "b.sh", "c.py")], tmp_path)
    assert [f.split(":")[0] for f in found] == ["a.py", "b.sh"], found


# -- every number in the README is in a dated record -------------------------------------------

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DURATION = re.compile(r"(?<![\w.])\d+ min(?: \d+ s)?\b")
NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?![\d.]*\d)")
# Numbers that are names, not measurements, each with why.
NOT_MEASUREMENTS = {
    "2606.08446",   # the paper's arXiv id
    "3.11",         # the oldest supported Python version
}


def readme_numbers(text: str) -> list[tuple[int, str]]:
    """(line, number) for each number of README prose, tables and output blocks.

    Left out, being names or commands rather than claims: fenced bash/sh blocks (commands; tests/
    test_docs.py runs or checks them), inline code spans (config names, settings), link targets,
    headings' anchors, and digits inside identifiers (Qwen3, H100, v5p-32, 1.7B).
    """
    out, fence = [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\S*)", line)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            continue
        if fence in ("bash", "sh", "shell"):
            continue
        if fence is None:
            line = re.sub(r"`[^`]*`", " ", line)                 # code spans
            line = re.sub(r"\]\([^)]*\)", "]", line)              # link targets
            line = re.sub(r"!\[[^\]]*\]", " ", line)              # image alt text
        # digits glued to letters or hyphen-names are identifiers: Qwen3-1.7B, v5p-32, 8B, 32K
        line = re.sub(r"[A-Za-z_][\w]*(?:[-.][\w]+)*", lambda w: " " if re.search(r"\d", w.group())
                      else w.group(), line)
        line = DATE.sub(" ", line)                                # dates say when, not what
        # a duration such as "4 min 9 s" is one claim: it must occur as written
        for dur in DURATION.findall(line):
            out.append((i, dur))
        line = DURATION.sub(" ", line)
        line = re.sub(r"\b\d+(?:\.\d+)?(?!x\b)[A-Za-z]\w*", " ", line)  # 1.7B, 32K, 80GB, 4x
        for num in NUMBER.findall(line):
            if num not in NOT_MEASUREMENTS:
                out.append((i, num))
    return out


def dated_sections(pages: list[Path]) -> list[str]:
    """The text of every section (heading to next heading) of `pages` that names a date."""
    out = []
    for page in pages:
        for sec in re.split(r"^#{1,6} ", page.read_text(), flags=re.M):
            if DATE.search(sec):
                out.append(sec)
    return out


def unrecorded(numbers: list[tuple[int, str]], sections: list[str]) -> list[str]:
    missing = []
    for line, num in numbers:
        pat = re.compile(r"(?<![\d.])" + re.escape(num) + r"(?!\.?\d)")
        if not any(pat.search(s) for s in sections):
            missing.append(f"README.md:{line}: {num}")
    return missing


def test_every_readme_number_is_in_a_dated_record():
    numbers = readme_numbers((REPO / "README.md").read_text())
    assert len(numbers) > 10, numbers
    missing = unrecorded(numbers, dated_sections(sorted((REPO / "docs").rglob("*.md"))))
    assert not missing, ("numbers in README.md that no dated docs/ section records (add the "
                         "record with its date and command, or fix the number):\n"
                         + "\n".join(missing))


def test_number_check_catches_a_planted_number():
    text = (REPO / "README.md").read_text() + "\nThe demo reached 0.7312 in 3 min 7 s.\n"
    sections = dated_sections(sorted((REPO / "docs").rglob("*.md")))
    missing = unrecorded(readme_numbers(text), sections)
    assert any(m.endswith(": 0.7312") for m in missing), missing
    assert any(m.endswith(": 3 min 7 s") for m in missing), missing
    assert readme_numbers("`configs/qwen3_1p7b_gpu.gin` on Qwen3-1.7B, v5p-32, H100 80GB "
                          "(arXiv 2606.08446)\n```bash\nsparrow x --n 512\n```\n") == []
    assert [n for _, n in readme_numbers("held out 0.085 -> 0.133 (+- 0.013), 4.2x, 24%")] == [
        "0.085", "0.133", "0.013", "4.2", "24"]


def test_readme_is_a_five_minute_read():
    """At most 220 lines; its first 40 say what the project is for (linking the method page),
    give the two commands (tests/test_docs.py checks which) and what the demo shows, with its
    time."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines (at most 220)"
    first = "\n".join(lines[:40])
    assert lines[0].startswith("# ") and "(docs/method.md)" in first, first
    assert "## What the demo shows" in first and re.search(r"\d+ min", first), first
    # how each command is checked is said in docs/ (tests/test_docs.py), not in the README
    asides = re.findall(r"\((?:CPU twins? in tests|Checked in tests|Run in tests)\b", "\n".join(lines))
    assert not asides, asides


def test_method_page_states_the_code_defaults():
    """docs/method.md quotes these settings; each is read here from the code, so a changed
    default fails until the page says the new value."""
    import inspect

    from sparrow_jax.rl.distill import DistillConfig
    from sparrow_jax.rl.grpo import LossConfig
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.sparsity import compression, mismatch
    from sparrow_jax.sparsity.controller import ControllerConfig
    from sparrow_jax.sparsity.schedule import NUM_RESERVED_BLOCKS, PAPER_SCHEDULES

    text = (REPO / "docs" / "method.md").read_text()
    loss, distill = LossConfig(), DistillConfig()
    rollout, ctrl = RolloutConfig(), ControllerConfig()
    tail = inspect.signature(mismatch.tail_by_bin).parameters
    g = lambda x: f"{x:g}"   # noqa: E731 - 0.2, 3, 0.001 as the page writes them
    expected = {
        "asymmetric clip": f"clip(ratio, 1 - {g(loss.clip_low)}, 1 + {g(loss.clip_high)})",
        "dual-clip": f"min( pg, {loss.dual_clip:.1f} |A| )",
        "TIS cap": f"C = {g(loss.tis_cap)}",
        "aggregation": loss.aggregation,
        "block size": f"blocks of {rollout.block_size} tokens",
        "dense layers": f"`RolloutConfig.dense_layers = {rollout.dense_layers}`",
        "reserved blocks": f"at least {NUM_RESERVED_BLOCKS * rollout.block_size} tokens",
        "tail bins": f"bin_size={tail['bin_size'].default}, quantile={g(tail['quantile'].default)}",
        "confidence": f"level {g(ctrl.confidence)}",
        "decay": f"({g(ctrl.decay)} by",
        "lower margin": f"x q ({g(ctrl.lower_margin)} by default",
        "unit": f'`ControllerConfig.unit = "{ctrl.unit}"`',
        "raise rule": f'default, `raise_on = "{ctrl.raise_on}"`',
        "adapter lr": f"`DistillConfig.lr_scale = {g(distill.lr_scale)}`",
        "adapter kl": f"`DistillConfig.kl_coef` ({g(distill.kl_coef)})",
        "compress every": f"`compress_every` ({rollout.compress_every})",
        "kv budget": f"`kv_budget` ({rollout.kv_budget})",
        "window": f"`window` ({rollout.window})",
        "r-kv lambda": f"lambda = {g(rollout.rkv_lambda)}",
        "pool kernel": f"(kernel {compression.POOL_KERNEL})",
        "1.7b schedule": " | ".join(str(b) for b in PAPER_SCHEDULES["qwen3-1.7b-0.86"][:10]),
    }
    flat = re.sub(r"\s+", " ", text)
    missing = {k: v for k, v in expected.items() if v not in flat}
    assert not missing, f"docs/method.md does not state the code's value of: {missing}"
