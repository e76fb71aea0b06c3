"""Figure ``ppl_vs_position``: PPL and ΔPPL along the context, per-token running means when the run
saved per-token arrays, bucket means otherwise."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvbits.report.fmt import DEFAULT_THRESHOLD, fmt_budget
from kvbits.report.plots.figure import (
    TokenArrays,
    new_figure,
    percent_axis,
    position_ticks,
    running_mean,
    save_png,
    scheme_colors,
    text_label,
    unique_legend,
    window_mean,
)
from kvbits.report.summary import RunSummary

__all__ = ["plot_ppl_position"]


def plot_ppl_position(
    run: RunSummary, tokens: TokenArrays | None, path: Path, *, smooth: int = 256,
    threshold: float = DEFAULT_THRESHOLD,
) -> Path:
    """Two panels sharing the position axis: PPL (with the reference) and ΔPPL %.

    With per-token arrays: ``exp`` of a ``smooth``-token running mean of the window-averaged NLL
    (top) and of ``nll − nll_ref`` (bottom), a shorter one (a quarter of the scored positions) where the
    window is short, and the title names the length drawn; bucket means with their CI are overlaid as
    points. Without: bucket means as steps.
    """
    tokens = tokens or {}
    colors = scheme_colors(run)
    fig = new_figure(10, 7.2)
    ax_p, ax_d = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.15))
    spans = run.bucket_spans
    xmax = float(max((hi for _, hi in spans), default=run.context or 1))
    first = min((lo for lo, _ in spans), default=0)
    deltas: list[float] = []
    ppls: list[float] = []
    ref_drawn = False
    windows: set[int] = set()  # the running-mean lengths drawn: ``smooth``, or less for a short window
    for r in run.results:
        c = colors[r.name]
        arr = tokens.get(r.name) or {}
        if "nll" in arr and "nll_ref" in arr:
            # entry t of the arrays is query position t (predicting token t + 1), as the buckets;
            # positions before the first bucket were not scored (prefill semantics) and are masked
            nll, ref = window_mean(arr["nll"]), window_mean(arr["nll_ref"])
            nll[:first], ref[:first] = np.nan, np.nan
            k = min(smooth, max(1, (nll.size - first) // 4))
            x, m = running_mean(nll, k)
            ax_p.plot(x, np.exp(m), color=c, lw=1.2, label=text_label(r.name))
            ppls += list(np.exp(m[np.isfinite(m)]))
            if not ref_drawn:
                _, mr = running_mean(ref, k)
                ax_p.plot(x, np.exp(mr), color="black", lw=1.4, ls="--", label="reference", zorder=5)
                ref_drawn = True
            _, md = running_mean(nll - ref, k)
            d = (np.exp(md) - 1) * 100
            ax_d.plot(x, d, color=c, lw=1.1, alpha=0.85, label=text_label(r.name))
            deltas += list(d[np.isfinite(d)])
            windows.add(k)
        else:
            for b in r.buckets:
                ax_p.hlines(b.ppl, b.lo, b.hi, color=c, lw=2, label=text_label(r.name) if b is r.buckets[0] else None)
                ppls.append(b.ppl)
            if r.buckets:
                xs = [b.lo for b in r.buckets] + [r.buckets[-1].hi]
                ys = [b.delta * 100 for b in r.buckets]
                ax_d.step(xs, ys + ys[-1:], where="post", color=c, lw=1.6, label=text_label(r.name))
        # bucket means with their 95% CI as points, over the curve of either kind
        known = [b for b in r.buckets if math.isfinite(b.delta)]
        if known:
            by = [b.delta * 100 for b in known]
            err_lo = [max(0.0, (b.delta - b.ci[0]) * 100) if math.isfinite(b.ci[0]) else 0.0 for b in known]
            err_hi = [max(0.0, (b.ci[1] - b.delta) * 100) if math.isfinite(b.ci[1]) else 0.0 for b in known]
            ax_d.errorbar([(b.lo + b.hi) / 2 for b in known], by, yerr=[err_lo, err_hi], fmt="o", ms=5,
                          color=c, mec="white", capsize=3, zorder=6)
            deltas += by
    if not ref_drawn:
        for i, (lo, hi) in enumerate(spans):
            refs = [b.ppl_ref for r in run.results for b in r.buckets if (b.lo, b.hi) == (lo, hi)]
            refs = [v for v in refs if math.isfinite(v)]
            if refs:
                ax_p.hlines(refs[0], lo, hi, color="black", lw=1.6, ls="--",
                            label="reference" if i == 0 else None, zorder=5)
    finite_ppl = [p for p in ppls if math.isfinite(p) and p > 0]
    if finite_ppl and max(finite_ppl) / min(finite_ppl) > 4:
        ax_p.set_yscale("log")
    ax_p.set_ylabel("perplexity")
    span = f"{min(windows)}" if len(windows) == 1 else f"{min(windows)}–{max(windows)}" if windows else ""
    how = f"{span}-token running mean, averaged over windows" if windows else "bucket means"
    ax_p.set_title(f"Perplexity ({how})", fontsize=10)
    ax_d.axhline(0, color="black", lw=0.8)
    ax_d.axhline(threshold * 100, color="#d62728", lw=1, ls=":", label=f"{fmt_budget(threshold)} budget")
    percent_axis(ax_d, deltas)
    ax_d.set_ylabel("ΔPPL vs reference (%)")
    ax_d.set_xlabel("position in the window (query t, predicting token t + 1)")
    ax_d.set_title("ΔPPL against the reference (points: bucket means with 95% CI)", fontsize=10)
    handles, names = unique_legend([ax_p, ax_d])
    fig.legend(handles, names, loc="outside lower center", ncol=min(7, len(names)), fontsize=8)
    fig.suptitle(f"{text_label(run.model)} on {text_label(run.data)}: quality along the context", fontsize=11)
    for ax in (ax_p, ax_d):
        ax.grid(alpha=0.3, axis="y")
        position_ticks(ax, run, xmax)
    return save_png(fig, path)
