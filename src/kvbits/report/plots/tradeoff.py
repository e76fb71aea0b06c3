"""Figure ``bits_vs_delta``: average bits per cached element vs ΔPPL %, overall and in the worst
bucket, with the Pareto front."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from kvbits.report.fmt import DEFAULT_THRESHOLD, fmt_budget
from kvbits.report.plots.figure import new_figure, percent_axis, save_png, scheme_colors, text_label
from kvbits.report.summary import RunSummary

__all__ = ["infinite_points", "nan_points", "plot_tradeoff"]


def _pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points no other point beats on both bits (fewer) and ΔPPL (lower), by increasing bits."""
    front: list[tuple[float, float, str]] = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def _undrawn(run: RunSummary, missing: Callable[[float], bool], *, bucketless: bool) -> list[str]:
    """One phrase per scheme with bits whose overall and/or worst-bucket ΔPPL ``missing`` picks; ``bucketless``:
    whether a scheme with no buckets at all counts as missing its worst bucket."""
    out = []
    for r in run.results:
        if not math.isfinite(r.avg_bits):
            continue  # a scheme without bits is not on this figure at all
        which = [w for w, v, ok in (("overall", r.delta, True), ("worst bucket", r.max_delta, bucketless or bool(r.buckets)))
                 if ok and missing(v)]
        if which:
            out.append(f"{r.name} ({' and '.join(which)})")
    return out


def infinite_points(run: RunSummary) -> list[str]:
    """The points :func:`plot_tradeoff` can not draw because their ΔPPL is +inf (a perplexity that overflowed: worse
    than any budget, off every axis), one phrase per scheme with bits: ``"int2 (overall and worst bucket)"``,
    ``"int3 (worst bucket)"``. The figure's legend and the report's caption name them; they are not left out unsaid."""
    return _undrawn(run, lambda v: v == math.inf, bucketless=True)


def nan_points(run: RunSummary) -> list[str]:
    """The points :func:`plot_tradeoff` can not draw because their ΔPPL is NaN (no overall perplexity, or no judged
    bucket), phrased as :func:`infinite_points`: ``"int2 (overall)"``. A scheme that recorded no buckets at all is not
    named for its worst bucket (the run has none to draw). The legend and the caption name them too."""
    return _undrawn(run, math.isnan, bucketless=False)


def plot_tradeoff(run: RunSummary, path: Path, *, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Average bits per element vs ΔPPL %: overall (filled) and worst bucket (hollow), Pareto front."""
    colors = scheme_colors(run)
    fig = new_figure(7.5, 5.0)
    ax = fig.subplots()
    pts = []
    ys: list[float] = []
    for r in run.results:
        if not math.isfinite(r.avg_bits):
            continue
        c = colors[r.name]
        overall = r.delta * 100 if math.isfinite(r.delta) else math.nan
        worst = r.max_delta * 100 if math.isfinite(r.max_delta) else math.nan
        if math.isfinite(overall):
            ax.plot([r.avg_bits], [overall], "o", color=c, ms=8, zorder=4)
            pts.append((r.avg_bits, overall, r.name))
            ys.append(overall)
        if math.isfinite(worst):
            ax.plot([r.avg_bits], [worst], "o", mfc="white", mec=c, mew=1.8, ms=8, zorder=4)
            ys.append(worst)
            if math.isfinite(overall):
                ax.plot([r.avg_bits] * 2, [overall, worst], color=c, lw=1, zorder=3)
        y_lab = overall if math.isfinite(overall) else worst
        if math.isfinite(y_lab):
            ax.annotate(text_label(r.name), (r.avg_bits, y_lab), xytext=(8, 4), textcoords="offset points",
                        fontsize=9, color=c, zorder=5,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    front = _pareto(pts)
    if len(front) > 1:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="#999999", lw=1,
                ls="--", zorder=2, label="Pareto front (overall)")
    ax.axhline(threshold * 100, color="#d62728", lw=1, ls=":", label=f"{fmt_budget(threshold)} budget")
    ax.axhline(0, color="black", lw=0.8)
    ax.plot([], [], "o", color="#444", label="overall ΔPPL")
    ax.plot([], [], "o", mfc="white", mec="#444", label="worst bucket")
    off = infinite_points(run)
    if off:
        ax.plot([], [], " ", label=text_label("ΔPPL +inf, not drawn: " + ", ".join(off)))
    off_nan = nan_points(run)
    if off_nan:
        ax.plot([], [], " ", label=text_label("ΔPPL NaN, not drawn: " + ", ".join(off_nan)))
    percent_axis(ax, ys)
    ax.set_xlabel("average bits per K/V element (incl. scales; lower = smaller cache)")
    ax.set_ylabel("ΔPPL vs reference (%)")
    ax.set_title("Memory vs quality", fontsize=11)
    if pts:
        xs = [p[0] for p in pts]
        pad = max(0.5, 0.08 * (max(xs) - min(xs)))
        ax.set_xlim(min(xs) - pad, max(xs) + 3 * pad)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return save_png(fig, path)
