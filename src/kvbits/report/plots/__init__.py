"""The report's figures (matplotlib, Agg, imported lazily), each saved as a PNG.

1. :func:`plot_ppl_position` (:mod:`.position`): PPL and ΔPPL vs position (per-token running means
   when the run saved per-token arrays, bucket means otherwise).
2. :func:`plot_delta_heatmap` (:mod:`.heatmap`): ΔPPL % scheme × bucket, annotated.
3. :func:`plot_kl` (:mod:`.kl`): KL by bucket, log scale.
4. :func:`plot_tradeoff` (:mod:`.tradeoff`): average bits vs ΔPPL (overall and worst bucket).
5. :func:`plot_attn_error` (:mod:`.attn`): attention-output relative error by bucket, one panel per
   sampled layer.

:func:`make_plots` draws every figure a run has data for. What the figures share (matplotlib
import, PNG saving, colours, running means, axis helpers) is in :mod:`.figure`. Figures are built
on :class:`matplotlib.figure.Figure` directly (never pyplot), so plotting changes no global backend
or state. Zeros and NaN never reach a log axis: they are masked, and a series with nothing left to
draw says so in its legend entry.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from kvbits.report.fmt import DEFAULT_THRESHOLD
from kvbits.report.plots.attn import plot_attn_error
from kvbits.report.plots.figure import INSTALL_HINT, TokenArrays, require_matplotlib, running_mean
from kvbits.report.plots.heatmap import plot_delta_heatmap
from kvbits.report.plots.kl import plot_kl
from kvbits.report.plots.position import plot_ppl_position
from kvbits.report.plots.tradeoff import plot_tradeoff
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
