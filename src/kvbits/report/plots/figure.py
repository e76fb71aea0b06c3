"""What every report figure shares: matplotlib import, figure/PNG plumbing, scheme colours, the
running means of per-token curves and the axis helpers (position ticks, ΔPPL % axis, log lines,
one legend for several axes).

Figures are built on :class:`matplotlib.figure.Figure` directly (never pyplot), so plotting changes
no global backend or state.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvbits._files import atomic_path
from kvbits.report.fmt import fmt_end, fmt_pos
from kvbits.report.summary import RunSummary

__all__ = [
    "BASELINE_COLOR",
    "DPI",
    "INSTALL_HINT",
    "PALETTE",
    "TokenArrays",
    "log_lines",
    "new_figure",
    "percent_axis",
    "position_ticks",
    "require_matplotlib",
    "running_mean",
    "save_png",
    "scheme_colors",
    "text_label",
    "unique_legend",
    "window_mean",
]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39")  # fmt: skip
"""One colour per quantized scheme, in order; unquantized runs are grey (``BASELINE_COLOR``)."""
BASELINE_COLOR = "#7f7f7f"
INSTALL_HINT = "plots need matplotlib: pip install 'kvbits[plot]' (or pip install matplotlib)"
DPI = 110

TokenArrays = Mapping[str, Mapping[str, np.ndarray]]


def require_matplotlib() -> Any:
    """Import matplotlib (Agg figures only); ImportError with an install hint when it is missing."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:  # pragma: no cover - matplotlib is a test dependency
        raise ImportError(INSTALL_HINT) from exc
    return matplotlib


def new_figure(w: float, h: float) -> Any:
    """A ``w`` × ``h`` inch figure at :data:`DPI`, constrained layout."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=DPI, layout="constrained")


def save_png(fig: Any, path: Path) -> Path:
    """Save ``fig`` as a PNG at ``path`` atomically (:func:`kvbits._files.atomic_path`: no half-written PNG, and two
    processes saving one name do not share a temporary file)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, facecolor="white", format="png")
    return path


def text_label(name: str) -> str:
    """``name`` (a scheme, model or data name of ``summary.json``) as matplotlib must be given it to show it as it is:
    each ``$`` escaped, so ``k$4$v2`` is not typeset as mathtext (shown ``k4v2``; an invalid formula raised and cost
    the figure), and a leading ``_`` behind a zero-width space, so a legend does not drop the series (matplotlib
    leaves out every label that starts with ``_``)."""
    s = name.replace("$", r"\$")
    return "\u200b" + s if s.startswith("_") else s


def _distinct_colors(n: int) -> tuple[str, ...]:
    """``n`` colours for more quantized schemes than :data:`PALETTE` holds: hues evenly spaced around the colour
    wheel, every other one darker, so neighbours differ in hue and lightness (and none is the baseline's grey)."""
    out = []
    for i in range(n):
        r, g, b = colorsys.hsv_to_rgb(i / n, 0.85, 0.9 if i % 2 == 0 else 0.6)
        out.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return tuple(out)


def scheme_colors(run: RunSummary) -> dict[str, str]:
    """One stable colour per scheme across all figures, a different one for each quantized scheme (:data:`PALETTE`
    while it is enough, else :func:`_distinct_colors`: cycling the palette gave a 13th scheme the 1st one's colour,
    two lines a legend could not tell apart); unquantized schemes are grey."""
    quantized = sum(not r.is_baseline for r in run.results)
    palette = PALETTE if quantized <= len(PALETTE) else _distinct_colors(quantized)
    out, i = {}, 0
    for r in run.results:
        if r.is_baseline:
            out[r.name] = BASELINE_COLOR
        else:
            out[r.name] = palette[i]
            i += 1
    return out


# ------------------------------------------------------------------------------------ curves


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


def window_mean(a: np.ndarray) -> np.ndarray:
    """(W, T-1) or (T-1,) per-token values → (T-1,) mean over windows, NaN-aware."""
    a = np.asarray(a, dtype=np.float64)
    a = a.reshape(1, -1) if a.ndim == 1 else a.reshape(a.shape[0], -1)
    valid = np.isfinite(a)
    cnt = valid.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, np.where(valid, a, 0).sum(0) / np.maximum(cnt, 1), np.nan)


# ------------------------------------------------------------------------------------ axes


def position_ticks(ax: Any, run: RunSummary, xmax: float) -> None:
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


def percent_axis(ax: Any, values: list[float], lin: float = 1.0) -> None:
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


def log_lines(ax: Any, series: dict[str, list[float]], colors: dict[str, str], labels: list[str]) -> None:
    """Lines on a log y-axis, zeros/NaN/+inf masked; series with nothing positive noted in the legend, and +inf
    values (a KL that overflowed: the tables print ``inf``) named there as not drawn, not passed for missing."""
    x = np.arange(len(labels))
    any_pos = False
    for name, ys in series.items():
        y = np.array(ys, dtype=np.float64)
        pos = np.isfinite(y) & (y > 0)
        n_inf = int(np.isposinf(y).sum())
        if not pos.any():
            what = "+inf, not drawn" if n_inf else "all zero" if np.any(y == 0) else "no data"
            ax.plot([], [], color=colors[name], marker="o", ls="", label=f"{text_label(name)} ({what})")
            continue
        any_pos = True
        label = text_label(name) + (f" (+inf at {n_inf} of {y.size}, not drawn)" if n_inf else "")
        ax.plot(x, np.where(pos, y, np.nan), color=colors[name], marker="o", lw=1.5, label=label)
    if any_pos:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no finite value above 0 to draw (see the legend)", transform=ax.transAxes, ha="center",
                color="#555")
    ax.set_xticks(x, labels)
    if len(labels) == 1:
        ax.set_xlim(-0.5, 0.5)
    ax.grid(alpha=0.3, which="both", axis="y")


def unique_legend(axes: Any) -> tuple[list[Any], list[str]]:
    """The legend handles and labels of several axes, each label once (first handle kept)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(n, h)
    return list(seen.values()), list(seen)
