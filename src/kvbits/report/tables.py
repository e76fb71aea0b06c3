"""A run's numbers laid out as tables: renderer-neutral :class:`TableData` (Markdown, HTML) and
rich tables for the terminal (:func:`bucket_table`, :func:`print_summary`).

Pure Python (no matplotlib). The records, number formats and verdict live in :mod:`.summary`,
:mod:`.fmt` and :mod:`.verdict`; their names are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbits._console import fold_columns
from kvbits.report.fmt import (
    DEFAULT_THRESHOLD,
    NA,
    _ok,
    bucket_label,
    fmt_budget,
    fmt_bytes,
    fmt_ci,
    fmt_end,
    fmt_float,
    fmt_frac,
    fmt_judged,
    fmt_kl,
    fmt_pct,
    fmt_pos,
)
from kvbits.report.inline import hide_escapes, show_escapes
from kvbits.report.summary import AttnLayer, Bucket, Generation, RunSummary, SchemeResult, _bucket_at
from kvbits.report.verdict import verdict

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "DEFAULT_THRESHOLD",
    "AttnLayer",
    "Bucket",
    "Cell",
    "RunSummary",
    "SchemeResult",
    "TableData",
    "attn_table",
    "bucket_label",
    "bucket_table",
    "delta_table",
    "entropy_table",
    "fmt_bytes",
    "fmt_end",
    "fmt_kl",
    "fmt_pct",
    "fmt_pos",
    "generation_table",
    "metric_table",
    "overall_table",
    "print_summary",
    "verdict",
]


@dataclass(frozen=True)
class Cell:
    """A table cell: its text and a tone (``good``, ``bad``, ``muted`` or '') for styling."""

    text: str
    tone: str = ""


@dataclass(frozen=True)
class TableData:
    """A renderer-neutral table: header texts, rows of cells, and right-aligned column indices."""

    headers: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    right: frozenset[int] = frozenset()
    caption: str = ""


def _tone(delta: float, threshold: float) -> str:
    """``muted`` for an unknown (NaN) ΔPPL, ``bad`` above ``threshold`` (+inf included), else ``good``."""
    if math.isnan(delta):
        return "muted"
    return "bad" if delta > threshold else "good"


def delta_table(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> TableData:
    """Scheme × position bucket: ΔPPL % with its 95 % CI; cells above ``threshold`` toned ``bad``."""
    run = RunSummary.coerce(summary)
    spans = run.bucket_spans
    rows = []
    for r in run.results:
        cells = [Cell(r.name), Cell(fmt_float(r.avg_bits, 2))]
        for span in spans:
            b = _bucket_at(r, span)
            if b is None:
                cells.append(Cell(NA, "muted"))
                continue
            ci = fmt_ci(b.ci)
            cells.append(Cell(fmt_judged(b.delta, threshold) + (f" {ci}" if ci else ""), _tone(b.delta, threshold)))
        rows.append(tuple(cells))
    return TableData(
        headers=("scheme", "bits", *(bucket_label(*s) for s in spans)), rows=tuple(rows),
        right=frozenset(range(1, 2 + len(spans))),
        caption=f"ΔPPL by position t in the context (predicting token t + 1), % [95% CI]; above {fmt_budget(threshold)} marked.",
    )


def metric_table(summary: RunSummary | Mapping[str, Any], metric: str) -> TableData:
    """Scheme × position bucket for ``metric`` in ``kl``, ``top1``, ``ppl`` (plus a reference row)."""
    fmts = {"kl": fmt_kl, "top1": fmt_frac, "ppl": fmt_float}
    if metric not in fmts:
        raise ValueError(f"metric must be one of {sorted(fmts)}, got {metric!r}")
    run = RunSummary.coerce(summary)
    spans = run.bucket_spans
    rows = []
    if metric == "ppl":
        ref = []
        for span in spans:
            vals = [b.ppl_ref for r in run.results if (b := _bucket_at(r, span)) and _ok(b.ppl_ref)]
            ref.append(Cell(fmt_float(vals[0]) if vals else NA, "muted"))
        rows.append((Cell("reference", "muted"), *ref))
    for r in run.results:
        found = [_bucket_at(r, span) for span in spans]
        rows.append((Cell(r.name), *(Cell(fmts[metric](getattr(b, metric)) if b else NA) for b in found)))
    captions = {
        "kl": "Mean KL(reference ‖ quantized) per token by position, nats.",
        "top1": "Top-1 agreement with the reference by position.",
        "ppl": "Perplexity by position.",
    }
    return TableData(
        headers=("scheme", *(bucket_label(*s) for s in spans)), rows=tuple(rows),
        right=frozenset(range(1, 1 + len(spans))), caption=captions[metric],
    )


def overall_table(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> TableData:
    """One row per scheme: avg bits, bits at the run's context (runs that record it), PPL, reference PPL, ΔPPL %,
    KL, top-1, seconds."""
    run = RunSummary.coerce(summary)
    at_ctx = any(_ok(r.bits_at_context) for r in run.results)  # runs from before the field: no column
    rows = [
        (
            Cell(r.name), Cell(fmt_float(r.avg_bits, 2)),
            *((Cell(fmt_float(r.bits_at_context, 2)),) if at_ctx else ()),
            Cell(fmt_float(r.ppl)), Cell(fmt_float(r.ppl_ref)),
            Cell(fmt_judged(r.delta, threshold), _tone(r.delta, threshold)), Cell(fmt_kl(r.kl)), Cell(fmt_frac(r.top1)),
            Cell(fmt_float(r.seconds, 1)),
        )
        for r in run.results
    ]
    ref_s = f" The unquantized reference pass took {run.reference_seconds:.1f} s." if _ok(run.reference_seconds) else ""
    if ref_s and len(run.merged_reference_seconds) > 1:  # each merged run made its own; the summary keeps the first's
        each = ", ".join(fmt_float(x, 1) for x in run.merged_reference_seconds)
        ref_s = (f" The unquantized reference pass took {run.reference_seconds:.1f} s in the first merged run "
                 f"(each run made its own: {each} s).")  # fmt: skip
    if run.merged_ranks:
        each = [f"{k or 'several'} for {', '.join(names)}" + (" and the reference pass" if i == 0 else "")
                for i, (names, k) in enumerate(run.merged_ranks)]  # fmt: skip
        ref_s += (" The merged runs split their windows over different numbers of ranks; seconds are summed over "
                  f"each run's: {'; '.join(each)}.")  # fmt: skip
    elif run.world_size > 1:
        ref_s += f" Seconds are summed over the {run.world_size} ranks that split the windows."
    return TableData(
        headers=("scheme", "avg bits", *(("bits at context",) if at_ctx else ()), "PPL", "ref PPL", "ΔPPL", "KL",
                 "top-1", "seconds"),
        rows=tuple(rows), right=frozenset(range(1, 8 + at_ctx)),
        caption="Whole context, all windows." + (
            " avg bits: bits per element in the long run (the full-precision window and sinks amortised); bits at "
            "context: what the cache stores per element at this run's context, metadata and full-precision tokens "
            "included, in the dtype the model ran in (kvbits plan's avg_bits with that dtype's --dtype-bytes: 4 for "
            "float32)." if at_ctx else "") + ref_s,
    )


def attn_table(summary: RunSummary | Mapping[str, Any]) -> TableData | None:
    """Scheme × sampled layer rows, position-bucket columns: attention-output relative error."""
    run = RunSummary.coerce(summary)
    spans = sorted({(lo, hi) for r in run.results for a in r.attn for lo, hi, _ in a.buckets})
    if not spans:
        return None
    rows = []
    for r in run.results:
        for i, a in enumerate(sorted(r.attn, key=lambda a: a.layer)):
            by_span = {(lo, hi): e for lo, hi, e in a.buckets}
            cells = [Cell(r.name if i == 0 else ""), Cell(str(a.layer))]
            cells += [Cell(_fmt_err(by_span.get(s, math.nan))) for s in spans]
            rows.append(tuple(cells))
    return TableData(
        headers=("scheme", "layer", *(bucket_label(*s) for s in spans)), rows=tuple(rows),
        right=frozenset(range(1, 2 + len(spans))),
        caption="Relative error ‖o − o_ref‖ / ‖o_ref‖ of the attention output, by position.",
    )


def entropy_table(summary: RunSummary | Mapping[str, Any]) -> TableData | None:
    """Scheme × sampled layer rows, position-bucket columns: attention entropy with the quantized
    K/V and, in parentheses, its difference from exact K/V; None when the run measured none."""
    run = RunSummary.coerce(summary)
    spans = sorted({(b[0], b[1]) for r in run.results for e in r.entropy for b in e.buckets})
    if not spans:
        return None
    rows = []
    for r in run.results:
        for i, e in enumerate(sorted(r.entropy, key=lambda e: e.layer)):
            by_span = {(lo, hi): (h, d) for lo, hi, h, _, d in e.buckets}
            cells = [Cell(r.name if i == 0 else ""), Cell(str(e.layer))]
            for span in spans:
                h, d = by_span.get(span, (math.nan, math.nan))
                cells.append(Cell(f"{fmt_float(h)} ({fmt_kl(d, signed=True)})" if _ok(h) else NA))
            rows.append(tuple(cells))
    return TableData(
        headers=("scheme", "layer", *(bucket_label(*s) for s in spans)), rows=tuple(rows),
        right=frozenset(range(1, 2 + len(spans))),
        caption="Entropy of the attention distribution with the quantized cache, nats (mean over query heads "
        "and positions), and in parentheses its difference from exact K/V for the same queries: above 0 the "
        "quantized attention is flatter, below 0 sharper. summary.json holds both entropies.",
    )


def generation_table(summary: RunSummary | Mapping[str, Any]) -> TableData | None:
    """Greedy continuations: a reference row, then per scheme rep-n, agreement with the reference and
    the first divergence per window; None when the run generated nothing."""
    run = RunSummary.coerce(summary)
    gens = [(r.name, r.generation) for r in run.results if r.generation is not None]
    if not gens:
        return None
    ns = sorted({n for _, g in gens for n in (*g.rep, *g.rep_ref)})
    first = gens[0][1]
    rows = [(Cell("reference", "muted"), *(Cell(fmt_float(first.rep_ref.get(n, math.nan))) for n in ns),
             Cell("—", "muted"), Cell("—", "muted"))]  # fmt: skip
    for name, g in gens:
        rows.append((
            Cell(name), *(Cell(fmt_float(g.rep.get(n, math.nan))) for n in ns), Cell(fmt_frac(g.agreement)),
            Cell(_fmt_divergence(g), "good" if g.first_divergence and min(g.first_divergence) == g.new_tokens else ""),
        ))  # fmt: skip
    n_new = first.new_tokens
    return TableData(
        headers=("continuation", *(f"rep-{n}" for n in ns), "agreement", f"first divergence (of {n_new})"),
        rows=tuple(rows), right=frozenset(range(1, 3 + len(ns))),
        caption=f"Greedy continuation of {n_new} tokens after each {first.prompt_tokens}-token window, with the "
        "unquantized model (reference) and with each scheme's cache. rep-n = 1 − distinct n-grams / n-grams "
        "(higher: more repetition; means over windows); agreement = fraction of positions where the scheme "
        f"generated the reference's token; first divergence = first position that differs, per window ({n_new}: "
        "never). The texts are in generations.jsonl.",
    )


def _fmt_divergence(g: Generation) -> str:
    div = g.first_divergence
    if not div:
        return NA
    if len(div) <= 8:
        return ", ".join(str(x) for x in div)
    return f"mean {sum(div) / len(div):.1f}, min {min(div)}"


def _fmt_err(x: float) -> str:
    if not _ok(x):
        return NA
    return "0" if x == 0 else (f"{x:.2e}" if x < 1e-3 else f"{x:.4f}")


# ------------------------------------------------------------------------------------ rich (CLI)

_RICH_TONE = {"good": "green", "bad": "bold red", "muted": "dim", "": ""}


def bucket_table(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> Table:
    """A rich table for the terminal: per scheme and position bucket, ΔPPL % (green within
    ``threshold``, red above), its 95 % CI, and KL / top-1 agreement on a dim second line."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    run = RunSummary.coerce(summary)
    spans = run.bucket_spans
    # names from summary.json are text, not rich markup ("[/tmp]" in a path raised MarkupError; "[bold]" vanished)
    title = escape(f"ΔPPL by position — {run.model} on {run.data}, {fmt_pos(run.context)} context, {run.semantics}")
    table = Table(
        title=title,
        caption=f"ΔPPL (red above {fmt_budget(threshold)}), its 95% CI, then KL (nats) · top-1 agreement",
    )
    table.add_column("scheme", style="bold")
    table.add_column("bits", justify="right")
    for span in spans:
        table.add_column(bucket_label(*span), justify="right")
    for r in run.results:
        cells: list[Any] = [Text(r.name), fmt_float(r.avg_bits, 2)]
        for span in spans:
            b = _bucket_at(r, span)
            if b is None:
                cells.append(Text(NA, style="dim"))
                continue
            t = Text(fmt_judged(b.delta, threshold), style=_RICH_TONE[_tone(b.delta, threshold)])
            t.append(f"\n{fmt_ci(b.ci) or '[CI n/a]'}", style="dim")
            t.append(f"\n{fmt_kl(b.kl)} · {fmt_frac(b.top1)}", style="dim")
            cells.append(t)
        table.add_row(*cells)
    return fold_columns(table)


def rich_table(data: TableData) -> Table:
    """Any :class:`TableData` as a rich table."""
    from rich.table import Table
    from rich.text import Text

    table = Table(caption=data.caption or None)
    for i, h in enumerate(data.headers):
        table.add_column(h, justify="right" if i in data.right else "left")
    for row in data.rows:
        table.add_row(*(Text(c.text, style=_RICH_TONE.get(c.tone, "")) for c in row))
    return fold_columns(table)


def print_summary(
    summary: RunSummary | Mapping[str, Any] | str | Path,
    console: Console | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    *,
    calibration_warnings: bool = True,
) -> None:
    """Print a run to the terminal: setting, bucket table, overall table, calibration warnings (served
    beyond the calibrated length, clipping above ``CLIP_WARN_FRAC``) and the verdict.

    ``summary`` is a parsed ``summary.json``, a :class:`RunSummary`, or a path to a run folder.
    ``calibration_warnings=False`` leaves those warnings out, for a caller that logged them already (``kvbits eval``
    logs them on stderr as the run ends, or as it reuses a finished run): said once, not again on stdout.
    """
    from rich.markup import escape

    from kvbits._console import stdout_console

    run = RunSummary.coerce(summary)
    console = console or stdout_console()
    console.print(
        f"[bold]{escape(run.model)}[/] on [bold]{escape(run.data)}[/]: context {run.context}, "
        f"{escape(run.semantics)} semantics, {escape(run.mode)} mode, {run.windows} window(s)"
        + ("" if (bos := run.bos_phrase(markdown=False)) is None else f", each starting with {escape(bos)}")
        + (f"; peak memory {run.peak_memory}" if run.peak_memory else "")
    )
    console.print(bucket_table(run, threshold))
    console.print(rich_table(overall_table(run, threshold)))
    gen = generation_table(run)
    if gen is not None:
        console.print(rich_table(gen))
    from kvbits.report.calibration import calibration_rows
    from kvbits.report.calibration import calibration_warnings as warning_lines  # it imports this module

    for line in warning_lines(calibration_rows(run)) if calibration_warnings else ():
        console.print(_bold_markup(line, "[bold yellow]", "[/bold yellow]"), style="yellow")
    console.print(_bold_markup(verdict(run, threshold), "[bold]", "[/bold]"))


def _bold_markup(text: str, start: str, end: str) -> str:
    """``text`` (inline Markdown without code spans) as rich markup: ``**x**`` pairs as ``start x end``, the rest
    as text (a name's escaped backtick or ``*`` shown as it is, ``[`` not read as markup)."""
    from rich.markup import escape

    pieces = [escape(show_escapes(p)) for p in hide_escapes(text).split("**")]
    return "".join(p if i % 2 == 0 else f"{start}{p}{end}" for i, p in enumerate(pieces))
