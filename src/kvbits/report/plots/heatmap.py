"""Figure ``delta_heatmap``: ΔPPL % scheme × position bucket, annotated with the 95% CI."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvbits.report.fmt import DEFAULT_THRESHOLD, bucket_label, fmt_budget, fmt_ci, fmt_judged, fmt_pct
from kvbits.report.plots.figure import new_figure, require_matplotlib, save_png, text_label
from kvbits.report.summary import RunSummary

__all__ = ["plot_delta_heatmap"]

# ΔPPL colour bins of the heatmap, in budgets: greens within it (at a 1 % budget: below 0.1, 0.5, 1 %), then worse and
# worse reds (2, 5, 10 %, beyond)
_DELTA_BINS = (-1e9, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 1e9)
_DELTA_COLORS = ("#1a9850", "#91cf60", "#d9ef8b", "#fee08b", "#fc8d59", "#e34a33", "#b30000")


def plot_delta_heatmap(run: RunSummary, path: Path, *, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Scheme × bucket ΔPPL % as coloured, annotated cells (NaN cells grey, 'n/a'; +inf in the worst colour)."""
    require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    spans = run.bucket_spans
    names = [r.name for r in run.results]
    frac = np.full((len(names), len(spans)), np.nan)  # ΔPPL as the fractions the verdict judges
    ci = {}
    for i, r in enumerate(run.results):
        for b in r.buckets:
            j = spans.index((b.lo, b.hi))
            frac[i, j] = b.delta
            ci[i, j] = b.ci
    grid = frac * 100
    cmap = ListedColormap(_DELTA_COLORS).with_extremes(bad="#e0e0e0")
    budget = threshold * 100  # the bins scale with the budget: a cell above it is never green
    bins = [b if abs(b) == 1e9 else b * budget for b in _DELTA_BINS]
    # coloured on the fractions the verdict judges (a ΔPPL above the threshold fails), not on ΔPPL·100: a bin
    # holds [lo, hi), so the budget's edge is the first fraction above it and a bucket exactly at the budget is
    # within (green), as the verdict and the tables judge it
    frac_bins = [b if abs(b) == 1e9 else b * threshold for b in _DELTA_BINS]
    frac_bins[3] = math.nextafter(threshold, math.inf)
    norm = BoundaryNorm(frac_bins, cmap.N)
    fig = new_figure(max(5.5, 1.45 * len(spans) + 3.2), max(2.4, 0.55 * len(names) + 1.6))
    ax = fig.subplots()
    shown = np.where(np.isposinf(frac), frac_bins[-2] * 2, frac)  # +inf: the worst bin, not masked
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if v == math.inf:
            ax.text(j, i, fmt_pct(v), ha="center", va="center", fontsize=8, color="white")
            continue
        if not math.isfinite(v):
            ax.text(j, i, "n/a", ha="center", va="center", fontsize=8, color="#555555")
            continue
        lo, hi = ci.get((i, j), (math.nan, math.nan))
        txt = fmt_judged(frac[i, j], threshold)
        if math.isfinite(lo) and math.isfinite(hi):
            txt += f"\n{fmt_ci((lo, hi))}"
        dark = v >= 5 * budget or v < 0.1 * budget
        ax.text(j, i, txt, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(spans)), [bucket_label(lo, hi) for lo, hi in spans])
    ax.set_yticks(range(len(names)), [text_label(n) for n in names])
    ax.set_xlabel("position bucket")
    ax.set_title(f"ΔPPL % by position (95% CI); budget {fmt_budget(threshold)}", fontsize=11)
    # the colour boundaries at this budget, labelled with what they are (in %)
    cb = fig.colorbar(im, ax=ax, ticks=frac_bins[1:-1], fraction=0.05)
    cb.ax.set_yticklabels([f"{round(t, 6):g}%" for t in bins[1:-1]], fontsize=8)
    return save_png(fig, path)
