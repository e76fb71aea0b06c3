"""The report's figures (matplotlib, Agg, imported lazily), each saved as a PNG.

1. :func:`plot_ppl_position`: PPL and ΔPPL vs position (per-token running means when the run
   saved per-token arrays, bucket means otherwise).
2. :func:`plot_delta_heatmap`: ΔPPL % scheme × bucket, annotated.
3. :func:`plot_kl`: KL by bucket, log scale.
4. :func:`plot_tradeoff`: average bits vs ΔPPL (overall and worst bucket).
5. :func:`plot_attn_error`: attention-output relative error by bucket, one panel per sampled layer.

Figures are built on :class:`matplotlib.figure.Figure` directly (never pyplot), so plotting changes
no global backend or state. Zeros and NaN never reach a log axis: they are masked, and a series
with nothing left to draw says so in its legend entry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvbits.report.fmt import DEFAULT_THRESHOLD, bucket_label, fmt_end, fmt_pct, fmt_pos
from kvbits.report.summary import RunSummary

logger = logging.getLogger(__name__)

__all__ = [
    "INSTALL_HINT",
    "PLOT_FILES",
    "make_plots",
    "plot_attn_error",
    "plot_delta_heatmap",
    "plot_kl",
    "plot_ppl_position",
    "plot_tradeoff",
    "require_matplotlib",
    "running_mean",
]

INSTALL_HINT = "plots need matplotlib: pip install 'kvbits[plot]' (or pip install matplotlib)"
DPI = 110
# ΔPPL % colour bins of the heatmap: green within the usual 1 % budget, then worse and worse reds.
_DELTA_BINS = (-1e9, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 1e9)
_DELTA_COLORS = ("#1a9850", "#91cf60", "#d9ef8b", "#fee08b", "#fc8d59", "#e34a33", "#b30000")

TokenArrays = Mapping[str, Mapping[str, np.ndarray]]


def require_matplotlib() -> Any:
    """Import matplotlib (Agg figures only); ImportError with an install hint when it is missing."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:  # pragma: no cover - matplotlib is a test dependency
        raise ImportError(INSTALL_HINT) from exc
    return matplotlib


def _figure(w: float, h: float) -> Any:
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=DPI, layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=DPI, facecolor="white")
    tmp.replace(path)
    return path


def _colors(run: RunSummary) -> dict[str, str]:
    """One stable colour per scheme across all figures; unquantized schemes are grey."""
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39")
    out, i = {}, 0
    for r in run.results:
        if r.is_baseline:
            out[r.name] = "#7f7f7f"
        else:
            out[r.name] = palette[i % len(palette)]
            i += 1
    return out


def running_mean(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """NaN-aware running mean of a 1-D array over ``k`` samples ('valid' part only).

    Returns ``(centre_index, mean)`` with ``len(x) - k + 1`` entries (``k`` clipped to ``len(x)``).
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    if x.size == 0:
        return np.zeros(0), np.zeros(0)
    k = max(1, min(int(k), x.size))
    valid = np.isfinite(x)
    s = np.concatenate([[0.0], np.cumsum(np.where(valid, x, 0.0))])
    n = np.concatenate([[0], np.cumsum(valid)])
    cnt = n[k:] - n[:-k]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(cnt > 0, (s[k:] - s[:-k]) / np.maximum(cnt, 1), np.nan)
    return np.arange(mean.size) + (k - 1) / 2, mean


def _window_mean(a: np.ndarray) -> np.ndarray:
    """(W, T-1) or (T-1,) per-token values → (T-1,) mean over windows, NaN-aware."""
    a = np.asarray(a, dtype=np.float64)
    a = a.reshape(1, -1) if a.ndim == 1 else a.reshape(a.shape[0], -1)
    valid = np.isfinite(a)
    cnt = valid.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, np.where(valid, a, 0).sum(0) / np.maximum(cnt, 1), np.nan)


def _position_ticks(ax: Any, run: RunSummary, xmax: float) -> None:
    """Ticks and faint vertical lines at the bucket edges, labelled like the buckets."""
    spans = run.bucket_spans
    if not spans:
        ax.set_xlim(0, xmax)
        return
    starts = sorted({lo for lo, _ in spans})
    end = max(hi for _, hi in spans)
    ticks = [0, *[e for e in starts if e > 0], end] if starts[0] > 0 else [*starts, end]
    labels = [fmt_pos(e) for e in ticks[:-1]] + [fmt_end(end)]
    ax.set_xticks(ticks, labels)
    ax.set_xlim(0, max(xmax, end))
    for e in ticks[1:-1]:
        ax.axvline(e, color="#cccccc", lw=0.8, zorder=0)


_PCT_TICKS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _percent_axis(ax: Any, values: list[float], lin: float = 1.0) -> None:
    """A ΔPPL % y-axis: linear while all |values| ≤ 5·``lin``, else symlog (linear within ±``lin``,
    so a few huge values do not flatten the interesting ones); ticks read as percentages."""
    from matplotlib.ticker import FuncFormatter

    finite = [v for v in values if math.isfinite(v)]
    if finite and max(abs(v) for v in finite) > 5 * lin:
        ax.set_yscale("symlog", linthresh=lin, linscale=1.0)
        top, bottom = max(max(finite), lin), min(min(finite), 0.0)
        ticks = [0.0] + [t for t in _PCT_TICKS if t <= top * 1.05 and (t >= lin or t in (0.5,))]
        ticks += [-t for t in _PCT_TICKS if -t >= bottom * 1.05 and t >= lin]
        ax.set_yticks(sorted(ticks))
        ax.set_ylim(min(bottom * 1.3, -0.15 * lin), top * 1.4)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))


def plot_ppl_position(
    run: RunSummary, tokens: TokenArrays | None, path: Path, *, smooth: int = 256,
    threshold: float = DEFAULT_THRESHOLD,
) -> Path:
    """Two panels sharing the position axis: PPL (with the reference) and ΔPPL %.

    With per-token arrays: ``exp`` of a ``smooth``-token running mean of the window-averaged NLL
    (top) and of ``nll − nll_ref`` (bottom); bucket means with their CI are overlaid as points.
    Without: bucket means as steps.
    """
    tokens = tokens or {}
    colors = _colors(run)
    fig = _figure(10, 7.2)
    ax_p, ax_d = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.15))
    spans = run.bucket_spans
    xmax = float(max((hi for _, hi in spans), default=run.context or 1))
    first = min((lo for lo, _ in spans), default=0)
    deltas: list[float] = []
    ppls: list[float] = []
    ref_drawn = False
    smoothed_any = False
    for r in run.results:
        c = colors[r.name]
        arr = tokens.get(r.name) or {}
        if "nll" in arr and "nll_ref" in arr:
            # entry t of the arrays is query position t (predicting token t + 1), as the buckets;
            # positions before the first bucket were not scored (prefill semantics) and are masked
            nll, ref = _window_mean(arr["nll"]), _window_mean(arr["nll_ref"])
            nll[:first], ref[:first] = np.nan, np.nan
            k = min(smooth, max(1, (nll.size - first) // 4))
            x, m = running_mean(nll, k)
            ax_p.plot(x, np.exp(m), color=c, lw=1.2, label=r.name)
            ppls += list(np.exp(m[np.isfinite(m)]))
            if not ref_drawn:
                _, mr = running_mean(ref, k)
                ax_p.plot(x, np.exp(mr), color="black", lw=1.4, ls="--", label="reference", zorder=5)
                ref_drawn = True
            _, md = running_mean(nll - ref, k)
            d = (np.exp(md) - 1) * 100
            ax_d.plot(x, d, color=c, lw=1.1, alpha=0.85, label=r.name)
            deltas += list(d[np.isfinite(d)])
            smoothed_any = True
        else:
            for b in r.buckets:
                ax_p.hlines(b.ppl, b.lo, b.hi, color=c, lw=2, label=r.name if b is r.buckets[0] else None)
                ppls.append(b.ppl)
            if r.buckets:
                xs = [b.lo for b in r.buckets] + [r.buckets[-1].hi]
                ys = [b.delta * 100 for b in r.buckets]
                ax_d.step(xs, ys + ys[-1:], where="post", color=c, lw=1.6, label=r.name)
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
    how = f"{smooth}-token running mean, averaged over windows" if smoothed_any else "bucket means"
    ax_p.set_title(f"Perplexity ({how})", fontsize=10)
    ax_d.axhline(0, color="black", lw=0.8)
    ax_d.axhline(threshold * 100, color="#d62728", lw=1, ls=":", label=f"{fmt_pct(threshold, 0)} budget")
    _percent_axis(ax_d, deltas)
    ax_d.set_ylabel("ΔPPL vs reference (%)")
    ax_d.set_xlabel("position in the window (query t, predicting token t + 1)")
    ax_d.set_title("ΔPPL against the reference (points: bucket means with 95% CI)", fontsize=10)
    handles, names = _unique_legend([ax_p, ax_d])
    fig.legend(handles, names, loc="outside lower center", ncol=min(7, len(names)), fontsize=8)
    fig.suptitle(f"{run.model} on {run.data}: quality along the context", fontsize=11)
    for ax in (ax_p, ax_d):
        ax.grid(alpha=0.3, axis="y")
        _position_ticks(ax, run, xmax)
    return _save(fig, path)


def plot_delta_heatmap(run: RunSummary, path: Path, *, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Scheme × bucket ΔPPL % as coloured, annotated cells (NaN cells grey, 'n/a')."""
    require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    spans = run.bucket_spans
    names = [r.name for r in run.results]
    grid = np.full((len(names), len(spans)), np.nan)
    ci = {}
    for i, r in enumerate(run.results):
        for b in r.buckets:
            j = spans.index((b.lo, b.hi))
            grid[i, j] = b.delta * 100
            ci[i, j] = b.ci
    cmap = ListedColormap(_DELTA_COLORS).with_extremes(bad="#e0e0e0")
    norm = BoundaryNorm(_DELTA_BINS, cmap.N)
    fig = _figure(max(5.5, 1.45 * len(spans) + 3.2), max(2.4, 0.55 * len(names) + 1.6))
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not math.isfinite(v):
            ax.text(j, i, "n/a", ha="center", va="center", fontsize=8, color="#555555")
            continue
        lo, hi = ci.get((i, j), (math.nan, math.nan))
        txt = fmt_pct(v / 100)
        if math.isfinite(lo) and math.isfinite(hi):
            txt += f"\n[{lo * 100:+.2f}, {hi * 100:+.2f}]"
        dark = v >= 5 or v < 0.1
        ax.text(j, i, txt, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(spans)), [bucket_label(lo, hi) for lo, hi in spans])
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("position bucket")
    ax.set_title(f"ΔPPL % by position (95% CI); budget {fmt_pct(threshold, 0)}", fontsize=11)
    cb = fig.colorbar(im, ax=ax, ticks=_DELTA_BINS[1:-1], fraction=0.05)
    cb.ax.set_yticklabels([f"{t:g}%" for t in _DELTA_BINS[1:-1]], fontsize=8)
    return _save(fig, path)


def _log_lines(ax: Any, run: RunSummary, series: dict[str, list[float]], colors: dict[str, str],
               labels: list[str]) -> None:
    """Lines on a log y-axis, zeros/NaN masked; series with nothing positive noted in the legend."""
    x = np.arange(len(labels))
    any_pos = False
    for name, ys in series.items():
        y = np.array(ys, dtype=np.float64)
        pos = np.isfinite(y) & (y > 0)
        if not pos.any():
            zero = bool(np.any(y == 0))
            ax.plot([], [], color=colors[name], marker="o", ls="", label=f"{name} ({'all zero' if zero else 'no data'})")
            continue
        any_pos = True
        ax.plot(x, np.where(pos, y, np.nan), color=colors[name], marker="o", lw=1.5, label=name)
    if any_pos:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "all values are 0 or missing", transform=ax.transAxes, ha="center", color="#555")
    ax.set_xticks(x, labels)
    if len(labels) == 1:
        ax.set_xlim(-0.5, 0.5)
    ax.grid(alpha=0.3, which="both", axis="y")


def plot_kl(run: RunSummary, path: Path) -> Path:
    """Mean KL(reference ‖ quantized) per bucket, one line per scheme, log scale."""
    spans = run.bucket_spans
    labels = [bucket_label(lo, hi) for lo, hi in spans]
    series = {}
    for r in run.results:
        by = {(b.lo, b.hi): b.kl for b in r.buckets}
        series[r.name] = [by.get(s, math.nan) for s in spans]
    fig = _figure(max(6.0, 1.2 * len(spans) + 3), 4.4)
    ax = fig.subplots()
    _log_lines(ax, run, series, _colors(run), labels)
    ax.set_xlabel("position bucket")
    ax.set_ylabel("KL (nats per token, log)")
    ax.set_title("KL divergence from the reference by position", fontsize=11)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def _pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points no other point beats on both bits (fewer) and ΔPPL (lower), by increasing bits."""
    front: list[tuple[float, float, str]] = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def plot_tradeoff(run: RunSummary, path: Path, *, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Average bits per element vs ΔPPL %: overall (filled) and worst bucket (hollow), Pareto front."""
    colors = _colors(run)
    fig = _figure(7.5, 5.0)
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
            ax.annotate(r.name, (r.avg_bits, y_lab), xytext=(8, 4), textcoords="offset points",
                        fontsize=9, color=c, zorder=5,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    front = _pareto(pts)
    if len(front) > 1:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="#999999", lw=1,
                ls="--", zorder=2, label="Pareto front (overall)")
    ax.axhline(threshold * 100, color="#d62728", lw=1, ls=":", label=f"{fmt_pct(threshold, 0)} budget")
    ax.axhline(0, color="black", lw=0.8)
    ax.plot([], [], "o", color="#444", label="overall ΔPPL")
    ax.plot([], [], "o", mfc="white", mec="#444", label="worst bucket")
    _percent_axis(ax, ys)
    ax.set_xlabel("average bits per K/V element (incl. scales; lower = smaller cache)")
    ax.set_ylabel("ΔPPL vs reference (%)")
    ax.set_title("Memory vs quality", fontsize=11)
    if pts:
        xs = [p[0] for p in pts]
        pad = max(0.5, 0.08 * (max(xs) - min(xs)))
        ax.set_xlim(min(xs) - pad, max(xs) + 3 * pad)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def plot_attn_error(run: RunSummary, path: Path, *, max_panels: int = 9) -> Path | None:
    """Attention-output relative error by bucket: one panel per sampled layer, a line per scheme.

    Returns None (and writes nothing) when the run measured no attention error.
    """
    layers = sorted({a.layer for r in run.results for a in r.attn})
    if not layers:
        return None
    if len(layers) > max_panels:  # evenly spaced subset; the table in the report keeps them all
        idx = np.linspace(0, len(layers) - 1, max_panels).round().astype(int)
        layers = [layers[i] for i in sorted(set(idx))]
    spans = sorted({(lo, hi) for r in run.results for a in r.attn for lo, hi, _ in a.buckets})
    labels = [bucket_label(lo, hi) for lo, hi in spans]
    ncols = min(3, len(layers))
    nrows = math.ceil(len(layers) / ncols)
    fig = _figure(max(5.0, 3.6 * ncols), 2.9 * nrows + 0.6)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    colors = _colors(run)
    for ax, layer in zip(axes, layers):
        series = {}
        for r in run.results:
            a = next((a for a in r.attn if a.layer == layer), None)
            if a is None:
                continue
            by = {(lo, hi): e for lo, hi, e in a.buckets}
            series[r.name] = [by.get(s, math.nan) for s in spans]
        _log_lines(ax, run, series, colors, labels)
        ax.set_title(f"layer {layer}", fontsize=10)
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    handles, names = _unique_legend(axes[: len(layers)])
    fig.legend(handles, names, loc="outside lower center", ncol=min(6, len(names)), fontsize=8)
    fig.suptitle("Attention-output relative error ‖o − o_ref‖/‖o_ref‖ by position", fontsize=11)
    return _save(fig, path)


def _unique_legend(axes: Any) -> tuple[list[Any], list[str]]:
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(n, h)
    return list(seen.values()), list(seen)


PLOT_FILES = {  # key (also the file stem) → what the figure shows, for captions and alt text
    "ppl_vs_position": "PPL and ΔPPL along the context",
    "delta_heatmap": "ΔPPL % by scheme and position bucket",
    "kl_by_bucket": "KL divergence by position bucket",
    "bits_vs_delta": "average bits vs ΔPPL",
    "attn_error": "attention-output relative error by position",
}


def make_plots(
    run: RunSummary, out_dir: Path, tokens: TokenArrays | None = None, *,
    threshold: float = DEFAULT_THRESHOLD, smooth: int = 256, strict: bool = False,
) -> tuple[dict[str, Path], dict[str, str]]:
    """Write every figure that the run has data for into ``out_dir``.

    Returns ``(written, failed)``: figure key (a :data:`PLOT_FILES` key, also the PNG's stem) →
    path, and figure key → error message. A figure that raises is logged and listed in ``failed``
    (the report says so) unless ``strict``, where it raises: one odd number should not cost a user
    the report of a long evaluation.
    """
    require_matplotlib()
    out_dir = Path(out_dir)
    jobs: dict[str, Any] = {}
    if run.bucket_spans:
        jobs["ppl_vs_position"] = lambda p: plot_ppl_position(
            run, tokens, p, smooth=smooth, threshold=threshold)
        jobs["delta_heatmap"] = lambda p: plot_delta_heatmap(run, p, threshold=threshold)
        jobs["kl_by_bucket"] = lambda p: plot_kl(run, p)
    if any(math.isfinite(r.avg_bits) for r in run.results):
        jobs["bits_vs_delta"] = lambda p: plot_tradeoff(run, p, threshold=threshold)
    jobs["attn_error"] = lambda p: plot_attn_error(run, p)
    written: dict[str, Path] = {}
    failed: dict[str, str] = {}
    for key, job in jobs.items():
        try:
            path = job(out_dir / f"{key}.png")
        except Exception as exc:  # deliberately broad: see the docstring
            if strict:
                raise
            logger.exception("could not draw %s.png; the report goes on without it", key)
            failed[key] = f"{type(exc).__name__}: {exc}"
            continue
        if path is not None:
            written[key] = path
    return written, failed
