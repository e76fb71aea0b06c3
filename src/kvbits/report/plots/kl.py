"""Figure ``kl_by_bucket``: KL divergence from the reference per position bucket, log scale."""

from __future__ import annotations

import math
from pathlib import Path

from kvbits.report.fmt import bucket_label
from kvbits.report.plots.figure import log_lines, new_figure, save_png, scheme_colors
from kvbits.report.summary import RunSummary

__all__ = ["plot_kl"]


def plot_kl(run: RunSummary, path: Path) -> Path:
    """Mean KL(reference ‖ quantized) per bucket, one line per scheme, log scale."""
    spans = run.bucket_spans
    labels = [bucket_label(lo, hi) for lo, hi in spans]
    series = {}
    for r in run.results:
        by = {(b.lo, b.hi): b.kl for b in r.buckets}
        series[r.name] = [by.get(s, math.nan) for s in spans]
    fig = new_figure(max(6.0, 1.2 * len(spans) + 3), 4.4)
    ax = fig.subplots()
    log_lines(ax, series, scheme_colors(run), labels)
    ax.set_xlabel("position bucket")
    ax.set_ylabel("KL (nats per token, log)")
    ax.set_title("KL divergence from the reference by position", fontsize=11)
    ax.legend(fontsize=8, loc="best")
    return save_png(fig, path)
