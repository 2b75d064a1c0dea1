"""comparison.png of `sparrow experiment`: one panel per metric, one line per run.

Runs are named `arm` or `arm@seed`. Each gets its own (colour, line style, marker): one colour
per arm and one (line style, marker) per seed, so the arms and the seeds both read off the
figure whatever their count - matplotlib's default cycle repeats after 10 lines, and a 12-run
experiment drew two runs in each colour.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "p", "h")
# Seed styles, 48 distinct (line style, marker) pairs: the first 12 each differ from the next in
# both; then the markers come round again against shifted line styles.
STYLES = tuple((LINESTYLES[(k % 12 + k // 12) % 4], MARKERS[k % 12]) for k in range(48))


def _colours(n_arms: int) -> list[str]:
    """tab10 up to 10 arms, else tab20 (its pairs are a dark and a light shade of one hue)."""
    if n_arms <= 10:
        return [f"C{i}" for i in range(10)]
    import matplotlib
    return [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors]


def run_styles(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """{run name: matplotlib line kwargs (color, linestyle, marker)}, distinct for every run.

    The arm (the name before `@`) picks the colour, the seed (after `@`; none counts as one seed)
    picks the style, both in order of first appearance. Arms past the palette's size wrap to its
    first colour with the next block of seed styles, so no two runs share (colour, style) until
    palette x 48 styles runs, where it warns."""
    arms = list(dict.fromkeys(n.split("@", 1)[0] for n in names))
    seeds = list(dict.fromkeys(n.split("@", 1)[1] if "@" in n else "" for n in names))
    colours = _colours(len(arms))
    if len(seeds) * (1 + (len(arms) - 1) // len(colours)) > len(STYLES):
        log.warning("comparison.png: %d arms x %d seeds is more than its %d colours x %d styles "
                    "tell apart; some runs share a colour and style", len(arms), len(seeds),
                    len(colours), len(STYLES))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        arm, _, seed = name.partition("@")
        a, s = arms.index(arm), seeds.index(seed)
        ls, mk = STYLES[(s + len(seeds) * (a // len(colours))) % len(STYLES)]
        out[name] = {"color": colours[a % len(colours)], "linestyle": ls, "marker": mk}
    return out


def plot_comparison(png: Path, series: Mapping[str, Mapping[str, tuple[list[int], list[float]]]],
                    panels: Sequence[tuple[str, str]], threshold: float,
                    threshold_panel: str = "alpha/tail_min") -> Path:
    """Writes `png`: a 2 x 3 grid of `panels` ((key, title)), each run's `series[run][key]`
    ((steps, values)) against step, a red dashed line at `threshold` in `threshold_panel`, and
    one legend of the runs beside the grid (it covered the panels at 12 runs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = run_styles(list(series))
    ncols = 1 + (len(series) - 1) // 24                  # ~24 entries a legend column
    fig, axes = plt.subplots(2, 3, figsize=(15 + 2.2 * ncols, 8), layout="constrained")
    handles: dict[str, object] = {}
    for ax, (key, title) in zip(axes.ravel(), panels):
        for name, runs in series.items():
            steps, values = runs[key]
            if steps:
                (line,) = ax.plot(steps, values, markersize=3, linewidth=1.2, label=name,
                                  **styles[name])
                handles.setdefault(name, line)
        if key == threshold_panel:
            ax.axhline(threshold, color="red", linestyle="--", linewidth=1,
                       label=f"threshold {threshold}")
            ax.legend(handles=ax.get_lines()[-1:], fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if handles:
        title = "arm@seed" if any("@" in n for n in handles) else "arm"
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8,
                   ncols=ncols, title=title)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
