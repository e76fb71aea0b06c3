"""Turn an evaluation output folder into ``report.md``, ``report.html`` and PNG figures.

:func:`write_report` is the entry point: it reads the run (:class:`~.summary.RunSummary` from
``summary.json``; ``config.json`` and per-token arrays through :mod:`.inputs`), draws the figures
(:mod:`.plots`), builds the report once as a list of blocks (:mod:`.document`) and writes it twice,
as Markdown (:mod:`.markdown`) and as one self-contained HTML page (:mod:`.html_page`), so the two
always say the same thing.

Input (written by :mod:`kvbits.evaluate.runner`)::

    DIR/summary.json                   required: the numbers
    DIR/config.json                    optional: run arguments, versions, commit, date
    DIR/tokens/<scheme>.safetensors    optional: per-token nll, nll_ref, kl, top1, shape (W, T-1)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvbits._files import write_text_atomic
from kvbits._json import dumps
from kvbits.report.document import Heading, build_document
from kvbits.report.fmt import DEFAULT_THRESHOLD
from kvbits.report.html_page import to_html
from kvbits.report.inputs import check_output_versions, load_config, load_token_arrays, reproduce_command
from kvbits.report.markdown import to_markdown
from kvbits.report.plots import PLOT_FILES
from kvbits.report.summary import RunSummary, log_non_finite

logger = logging.getLogger(__name__)

__all__ = [
    "check_out_folder",
    "load_config",
    "load_token_arrays",
    "reproduce_command",
    "write_json_report",
    "write_report",
]


def check_out_folder(out_dir: str | os.PathLike[str], command: str, files: tuple[str, ...], *,
                     overwrite: bool = False) -> Path:  # fmt: skip
    """``out_dir`` as a ``Path`` if a ``kvbits <command>`` run may be written there, else ``ValueError``.

    ``files[0]`` is the JSON that marks a folder as one of this command's runs: a non-empty folder without it
    is refused unless ``overwrite``, in which case only ``files`` are replaced. Call it before the work runs,
    so a wrong folder fails in a moment.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / files[0]).is_file() and not overwrite:
        raise ValueError(
            f"--out {out} is a non-empty folder that holds no kvbits {command} run; choose another folder or pass "
            f"--overwrite (only {', '.join(files[:-1])} and {files[-1]} would be replaced)"
        )
    return out


def write_json_report(
    summary: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    command: str,
    files: tuple[str, str, str],
    markdown: Callable[..., str],
    plot: Callable[[Mapping[str, Any], Path], Path],
    *,
    overwrite: bool = False,
) -> Path:
    """Write a command's ``files`` (its JSON summary, ``report.md`` from ``markdown(summary, figure=...)``,
    and with matplotlib the PNG ``plot`` draws) into ``out_dir`` (``check_out_folder``'s rules). Without
    matplotlib a warning says so, and a PNG of that name left by an earlier run is removed: it would show that
    run's figure beside this run's JSON."""
    out = check_out_folder(out_dir, command, files, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    json_name, md_name, png_name = files
    write_text_atomic(out / json_name, dumps(summary, indent=2) + "\n")
    try:
        plot(summary, out / png_name)
        figure = True
    except ImportError as exc:
        figure = False
        (out / png_name).unlink(missing_ok=True)
        logger.warning("no %s: %s", png_name, exc)
    write_text_atomic(out / md_name, markdown(summary, figure=figure))
    return out


def _remove_stale_figures(out: Path, drawn: Mapping[str, Path]) -> None:
    """Remove the figures (``<key>.png`` of :data:`~.plots.PLOT_FILES`) an earlier report left in ``out`` that this
    one did not draw (no matplotlib, ``plots=False``, a figure that failed or has no data): beside this run's
    ``report.md`` they would pass for its figures (``kvbits eval --overwrite`` without matplotlib kept the last run's)."""
    stale = [out / f"{key}.png" for key in PLOT_FILES if key not in drawn and (out / f"{key}.png").is_file()]
    for path in stale:
        path.unlink()
    if stale:
        logger.info("removed %s: figures of an earlier report that this one did not draw", ", ".join(p.name for p in stale))


def write_report(
    out_dir: str | Path,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    plots: bool | None = None,
    smooth: int = 256,
    strict: bool = False,
) -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and the figures (PNG) of an evaluation folder.

    Args:
        out_dir: the evaluator's output folder; it must hold ``summary.json``. ``config.json`` and
            ``tokens/*.safetensors`` are used when present.
        threshold: the ΔPPL budget (fraction) the verdict and the tables judge against.
        plots: True: draw figures (ImportError with an install hint without matplotlib);
            False: none; None: draw them when matplotlib is installed, else say so in the report. A figure
            an earlier report left in ``out_dir`` that this one does not draw is removed.
        smooth: tokens in the running mean of the per-token curves.
        strict: raise when a figure fails instead of noting it in the report.

    Returns:
        ``{"markdown": ..., "html": ..., <figure key>: ...}`` with each file's path; figure keys
        are the PNG stems (``ppl_vs_position``, ``delta_heatmap``, ``kl_by_bucket``,
        ``bits_vs_delta``, ``attn_error``), present only when drawn.

    Raises:
        FileNotFoundError: ``out_dir`` has no ``summary.json``.
        ValueError: ``threshold`` is not a finite number > 0 (a bool is refused), or ``summary.json`` is not a kvbits
            eval summary (no ``results``) or has a malformed field.
    """
    # as the CLI's --threshold: a finite number > 0; True is no budget (it was taken as 1 = 100 %), inf judges nothing
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
        math.isfinite(threshold) and threshold > 0
    ):
        raise ValueError(f"threshold must be a finite positive fraction (0.01 = 1%), got {threshold!r}")
    if plots not in (True, False, None):
        raise TypeError(f"plots must be True, False or None, got {plots!r}")
    out = Path(out_dir)
    run = RunSummary.load(out)
    log_non_finite(run, out / "summary.json")
    config = load_config(out)
    check_output_versions(config, out)
    tokens = load_token_arrays(out, [r.name for r in run.results])

    figures: dict[str, Path] = {}
    failed: dict[str, str] = {}
    note = ""
    if plots is not False:
        from kvbits.report import plots as plots_mod

        try:
            plots_mod.require_matplotlib()
        except ImportError:
            if plots:
                raise
            note = f"*Figures skipped: {plots_mod.INSTALL_HINT}.*"
            logger.warning(plots_mod.INSTALL_HINT)
        else:
            figures, failed = plots_mod.make_plots(
                run, out, tokens, threshold=threshold, smooth=smooth, strict=strict
            )
    _remove_stale_figures(out, figures)

    blocks = build_document(run, config, figures, failed, note, threshold, out, bool(tokens))
    title = blocks[0].text if isinstance(blocks[0], Heading) else "kvbits report"
    paths: dict[str, Path] = {
        "markdown": write_text_atomic(out / "report.md", to_markdown(blocks, out)),
        "html": write_text_atomic(out / "report.html", to_html(blocks, title)),
    }
    paths.update(figures)
    logger.info("report written to %s", paths["markdown"])
    return paths
