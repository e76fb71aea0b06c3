"""Figure ``attn_error``: attention-output relative error by position bucket, one panel per sampled
layer."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvbits.report.fmt import bucket_label
from kvbits.report.plots.figure import log_lines, new_figure, save_png, scheme_colors, unique_legend
from kvbits.report.summary import RunSummary

__all__ = ["plot_attn_error"]


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
    fig = new_figure(max(5.0, 3.6 * ncols), 2.9 * nrows + 0.6)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    colors = scheme_colors(run)
    for ax, layer in zip(axes, layers):
        series = {}
        for r in run.results:
            a = next((a for a in r.attn if a.layer == layer), None)
            if a is None:
                continue
            by = {(lo, hi): e for lo, hi, e in a.buckets}
            series[r.name] = [by.get(s, math.nan) for s in spans]
        log_lines(ax, series, colors, labels)
        ax.set_title(f"layer {layer}", fontsize=10)
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    handles, names = unique_legend(axes[: len(layers)])
    fig.legend(handles, names, loc="outside lower center", ncol=min(6, len(names)), fontsize=8)
    fig.suptitle("Attention-output relative error ‖o − o_ref‖/‖o_ref‖ by position", fontsize=11)
    return save_png(fig, path)
