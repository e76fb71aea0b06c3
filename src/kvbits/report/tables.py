"""A run's numbers: read ``summary.json`` into typed records, judge them, lay them out as tables.

Everything here is pure Python (no matplotlib); the Markdown/HTML renderer (:mod:`.render`), the
plots (:mod:`.plots`) and the CLI (:func:`print_summary`, via rich) all read the same records, so
the three can never disagree about a number.

Conventions of ``summary.json`` (written by :mod:`kvbits.evaluate.runner`): ``delta_rel`` and its
CI are *fractions* (``0.01`` = +1 % perplexity), ``top1`` is the fraction of positions whose argmax
matches the reference, ``kl`` is the mean KL(reference ‖ quantized) in nats per token. Missing
numbers (absent keys, ``null``, NaN) become NaN here and print as ``n/a``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    "fmt_bytes",
    "fmt_end",
    "fmt_kl",
    "fmt_pct",
    "fmt_pos",
    "metric_table",
    "overall_table",
    "print_summary",
    "verdict",
]

DEFAULT_THRESHOLD = 0.01  # "hurts" = perplexity more than 1 % above the unquantized reference
NA = "n/a"


# ------------------------------------------------------------------------------------ numbers


def _num(x: Any) -> float:
    """A float, or NaN for None / non-numbers."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _ok(x: float) -> bool:
    return not math.isnan(x) and not math.isinf(x)


def fmt_pos(n: int) -> str:
    """A token position as in the bucket names: multiples of 1024 as ``4K``, others verbatim."""
    if n and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def fmt_end(hi: int) -> str:
    """The exclusive end of a bucket. A window of ``T`` tokens has ``T - 1`` predicting positions, so
    its last bucket ends at ``T - 1``: an end one short of a multiple of 1024 prints as that multiple
    (``[4096, 8191)`` is ``4K–8K``, the rest of an 8K window)."""
    return fmt_pos(hi + 1) if hi > 0 and (hi + 1) % 1024 == 0 else fmt_pos(hi)


def bucket_label(lo: int, hi: int) -> str:
    """``0–1K``, ``4K–8K``, ``1000–1K`` (prefill), ``0–999`` (a 1000-token window)."""
    return f"{fmt_pos(lo)}–{fmt_end(hi)}"


def fmt_pct(frac: float, digits: int = 2) -> str:
    """A relative change (fraction) as a signed percentage: ``0.0042 -> '+0.42%'``."""
    if not _ok(frac):
        return NA
    pct = frac * 100
    d = 1 if abs(pct) >= 100 else digits
    if round(pct, d) == 0:
        pct = 0.0  # no "-0.00%" for a difference that rounds to nothing
    return f"{pct:+.{d}f}%"


def fmt_ci(ci: tuple[float, float]) -> str:
    """A 95 % CI of a relative change: ``[+0.10, +0.80]`` (percent), or '' when unknown."""
    lo, hi = ci
    if not (_ok(lo) and _ok(hi)):
        return ""
    return f"[{lo * 100:+.2f}, {hi * 100:+.2f}]"


def fmt_kl(x: float) -> str:
    """KL in nats: 4 decimals, or scientific below 1e-3 (0 prints as ``0``)."""
    if not _ok(x):
        return NA
    if x == 0:
        return "0"
    return f"{x:.2e}" if abs(x) < 1e-3 else f"{x:.4f}"


def fmt_frac(x: float) -> str:
    """A fraction as a percentage with two decimals (top-1 agreement)."""
    return NA if not _ok(x) else f"{x * 100:.2f}%"


def fmt_bytes(n: float) -> str:
    """A byte count in binary units: ``1288490188.8 -> '1.20 GiB'``, ``5242880 -> '5.00 MiB'``."""
    if not _ok(n):
        return NA
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_float(x: float, digits: int = 3) -> str:
    return NA if not _ok(x) else f"{x:.{digits}f}"


# ------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Bucket:
    """Metrics over the predicted-token positions ``[lo, hi)`` (averaged over all windows)."""

    lo: int
    hi: int
    tokens: int = 0
    ppl: float = math.nan
    ppl_ref: float = math.nan
    delta: float = math.nan  # relative ΔPPL, fraction
    ci: tuple[float, float] = (math.nan, math.nan)
    kl: float = math.nan
    top1: float = math.nan

    @property
    def label(self) -> str:
        return bucket_label(self.lo, self.hi)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Bucket:
        ppl, ppl_ref = _num(d.get("ppl")), _num(d.get("ppl_ref"))
        delta = _num(d.get("delta_rel"))
        if not _ok(delta) and _ok(ppl) and _ok(ppl_ref) and ppl_ref > 0:
            delta = ppl / ppl_ref - 1
        ci = d.get("delta_rel_ci") or (None, None)
        ci_t = (_num(ci[0]), _num(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else (math.nan,) * 2
        tokens = _num(d.get("tokens"))
        return cls(
            lo=int(d["lo"]), hi=int(d["hi"]), tokens=int(tokens) if _ok(tokens) else 0, ppl=ppl,
            ppl_ref=ppl_ref, delta=delta, ci=ci_t, kl=_num(d.get("kl")), top1=_num(d.get("top1")),
        )


@dataclass(frozen=True)
class AttnLayer:
    """Relative error of one sampled layer's attention output, per position bucket."""

    layer: int
    buckets: tuple[tuple[int, int, float], ...]  # (lo, hi, rel_err)


@dataclass(frozen=True)
class SchemeResult:
    """One scheme's results, overall and per position bucket."""

    name: str
    avg_bits: float = math.nan
    ppl: float = math.nan
    ppl_ref: float = math.nan
    kl: float = math.nan
    top1: float = math.nan
    seconds: float = math.nan
    buckets: tuple[Bucket, ...] = ()
    attn: tuple[AttnLayer, ...] = ()
    calibration: Mapping[str, Any] = field(default_factory=dict)  # as in summary.json (see .calibration)

    @property
    def delta(self) -> float:
        """Overall relative ΔPPL (fraction), from the overall PPLs."""
        if _ok(self.ppl) and _ok(self.ppl_ref) and self.ppl_ref > 0:
            return self.ppl / self.ppl_ref - 1
        return math.nan

    @property
    def is_baseline(self) -> bool:
        """True for an unquantized scheme (fp16, bf16, ...): it only checks the evaluation path."""
        from kvbits.schemes import get_scheme

        try:
            return bool(get_scheme(self.name).is_identity)
        except (ValueError, KeyError, TypeError):
            return _ok(self.avg_bits) and self.avg_bits >= 16

    @property
    def max_delta(self) -> float:
        vals = [b.delta for b in self.buckets if _ok(b.delta)]
        return max(vals) if vals else math.nan

    def first_failure(self, threshold: float = DEFAULT_THRESHOLD) -> Bucket | None:
        """The first position bucket whose ΔPPL exceeds ``threshold`` (a fraction), or None."""
        return next((b for b in self.buckets if _ok(b.delta) and b.delta > threshold), None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SchemeResult:
        buckets = tuple(sorted((Bucket.from_dict(b) for b in d.get("buckets") or ()), key=lambda b: b.lo))
        attn = tuple(
            AttnLayer(
                layer=int(a.get("layer", i)),
                buckets=tuple(
                    (int(b["lo"]), int(b["hi"]), _num(b.get("rel_err"))) for b in a.get("buckets") or ()
                ),
            )
            for i, a in enumerate(d.get("attn_error") or ())
        )
        return cls(
            name=str(d.get("scheme", "?")), avg_bits=_num(d.get("avg_bits")), ppl=_num(d.get("ppl")),
            ppl_ref=_num(d.get("ppl_ref")), kl=_num(d.get("kl")), top1=_num(d.get("top1")),
            seconds=_num(d.get("seconds")), buckets=buckets, attn=attn,
            calibration=dict(d.get("calibration") or {}) if isinstance(d.get("calibration"), Mapping) else {},
        )


@dataclass(frozen=True)
class RunSummary:
    """A whole ``summary.json``: the setting and one :class:`SchemeResult` per scheme."""

    model: str = "?"
    data: str = "?"
    context: int = 0
    semantics: str = "?"
    mode: str = "?"
    windows: int = 0
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    results: tuple[SchemeResult, ...] = ()
    reference_seconds: float = math.nan
    peak_rss_bytes: float = math.nan  # the evaluating process's peak resident set
    peak_cuda_bytes: float = math.nan  # torch's peak CUDA allocation over the run (CUDA runs only)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSummary:
        if not isinstance(d, Mapping):
            raise TypeError(f"summary must be a mapping (parsed summary.json), got {type(d).__name__}")
        ctx, win = _num(d.get("context")), _num(d.get("windows"))
        return cls(
            model=str(d.get("model", "?")), data=str(d.get("data", "?")),
            context=int(ctx) if _ok(ctx) else 0, semantics=str(d.get("semantics", "?")),
            mode=str(d.get("mode", "?")), windows=int(win) if _ok(win) else 0,
            fingerprint=dict(d.get("fingerprint") or {}),
            results=tuple(SchemeResult.from_dict(r) for r in d.get("results") or ()),
            reference_seconds=_num(d.get("reference_seconds")),
            peak_rss_bytes=_num(d.get("peak_rss_bytes")), peak_cuda_bytes=_num(d.get("peak_cuda_bytes")),
        )

    @classmethod
    def load(cls, path: str | Path) -> RunSummary:
        """Read a run folder's ``summary.json`` (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "summary.json"
        if not p.is_file():
            raise FileNotFoundError(f"no summary.json at {p}; is this an evaluation output folder?")
        return cls.from_dict(json.loads(p.read_text()))

    @classmethod
    def coerce(cls, summary: RunSummary | Mapping[str, Any] | str | Path) -> RunSummary:
        """A :class:`RunSummary` from a summary dict, a run folder, a summary.json path or itself."""
        if isinstance(summary, RunSummary):
            return summary
        if isinstance(summary, (str, Path)):
            return cls.load(summary)
        return cls.from_dict(summary)

    @property
    def bucket_spans(self) -> list[tuple[int, int]]:
        """All (lo, hi) bucket spans of any scheme, in position order."""
        return sorted({(b.lo, b.hi) for r in self.results for b in r.buckets})

    @property
    def ppl_ref(self) -> float:
        return next((r.ppl_ref for r in self.results if _ok(r.ppl_ref)), math.nan)

    @property
    def peak_memory(self) -> str:
        """``1.20 GiB resident (process peak), 3.50 GiB CUDA allocated (run peak)``: what the run
        recorded, or '' for neither (runs from before it was recorded)."""
        parts = []
        if _ok(self.peak_rss_bytes) and self.peak_rss_bytes > 0:
            parts.append(f"{fmt_bytes(self.peak_rss_bytes)} resident (process peak)")
        if _ok(self.peak_cuda_bytes) and self.peak_cuda_bytes > 0:
            parts.append(f"{fmt_bytes(self.peak_cuda_bytes)} CUDA allocated (run peak)")
        return ", ".join(parts)


def _bucket_at(r: SchemeResult, span: tuple[int, int]) -> Bucket | None:
    return next((b for b in r.buckets if (b.lo, b.hi) == span), None)


# ------------------------------------------------------------------------------------ verdict


def _join(names: list[str]) -> str:
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def verdict(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> str:
    """One paragraph, computed from the numbers: who stays within ``threshold`` ΔPPL in every
    position bucket, where each other scheme first exceeds it, the best bits/quality trade-off,
    and which schemes get worse along the context. Inline ``**bold**`` marks scheme names."""
    run = RunSummary.coerce(summary)
    thr = fmt_pct(threshold, 0).lstrip("+")
    parts: list[str] = []
    if not run.results:
        return "The run holds no results."
    quant = [r for r in run.results if not r.is_baseline]
    for r in run.results:
        if r.is_baseline and _ok(r.max_delta) and abs(r.max_delta) > 1e-4:
            parts.append(
                f"Warning: the unquantized **{r.name}** differs from the reference by up to "
                f"{fmt_pct(r.max_delta)}, so the evaluation path itself adds error."
            )
    no_data = [r for r in quant if not any(_ok(b.delta) for b in r.buckets)]
    judged = [r for r in quant if r not in no_data]
    passing = [r for r in judged if r.first_failure(threshold) is None]
    failing = [r for r in judged if r.first_failure(threshold) is not None]
    upto = f" up to {fmt_pos(run.context)} tokens" if run.context else ""
    if not quant:
        parts.append("Only unquantized schemes were evaluated; there is no quantization to judge.")
    elif passing:
        verb = "stays" if len(passing) == 1 else "stay"
        parts.append(
            f"{_join([f'**{r.name}**' for r in passing])} {verb} within {thr} ΔPPL of the unquantized "
            f"reference in every position bucket{upto}."
        )
    elif judged:
        parts.append(f"No quantized scheme stays within {thr} ΔPPL in every position bucket{upto}.")
    fails = []
    for r in failing:
        b = r.first_failure(threshold)
        assert b is not None
        where = f"already in the first bucket, {b.label}" if b is r.buckets[0] else f"at {b.label}"
        ci = f", 95% CI {fmt_pct(b.ci[0])} to {fmt_pct(b.ci[1])}" if _ok(b.ci[0]) and _ok(b.ci[1]) else ""
        fails.append(f"**{r.name}** {where} ({fmt_pct(b.delta)}{ci})")
    if fails:
        parts.append(f"First bucket above {thr}: " + "; ".join(fails) + ".")
    ranked = passing or sorted(judged, key=lambda r: r.max_delta)[:1]
    with_bits = [r for r in ranked if _ok(r.avg_bits)]
    if with_bits:
        best = min(with_bits, key=lambda r: (r.avg_bits, r.max_delta))
        ratio = f" ({16 / best.avg_bits:.1f}× smaller than fp16)" if best.avg_bits > 0 else ""
        lead = "Best bits/quality trade-off" if passing else "Least damaging quantized scheme"
        parts.append(
            f"{lead}: **{best.name}**, {best.avg_bits:.2f} bits per element{ratio}, worst bucket "
            f"{fmt_pct(best.max_delta)}, overall {fmt_pct(best.delta)}."
        )
    grows = []
    for r in judged:
        vals = [b for b in r.buckets if _ok(b.delta)]
        if len(vals) >= 2:
            first, last = vals[0].delta, vals[-1].delta
            if last - first > max(threshold / 4, abs(first)):
                grows.append(f"**{r.name}** ({fmt_pct(first)} at {vals[0].label} → {fmt_pct(last)} at {vals[-1].label})")
    if grows:
        parts.append("Damage grows along the context for " + ", ".join(grows) + ".")
    if no_data:
        parts.append(f"No bucket data for {_join([f'**{r.name}**' for r in no_data])}.")
    return " ".join(parts)


# ------------------------------------------------------------------------------------ tables


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
    if not _ok(delta):
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
            cells.append(Cell(fmt_pct(b.delta) + (f" {ci}" if ci else ""), _tone(b.delta, threshold)))
        rows.append(tuple(cells))
    return TableData(
        headers=("scheme", "bits", *(bucket_label(*s) for s in spans)), rows=tuple(rows),
        right=frozenset(range(1, 2 + len(spans))),
        caption=f"ΔPPL by position of the predicted token, % [95% CI]; above {fmt_pct(threshold, 0)} marked.",
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
    """One row per scheme: avg bits, PPL, reference PPL, ΔPPL %, KL, top-1, seconds."""
    run = RunSummary.coerce(summary)
    rows = [
        (
            Cell(r.name), Cell(fmt_float(r.avg_bits, 2)), Cell(fmt_float(r.ppl)), Cell(fmt_float(r.ppl_ref)),
            Cell(fmt_pct(r.delta), _tone(r.delta, threshold)), Cell(fmt_kl(r.kl)), Cell(fmt_frac(r.top1)),
            Cell(fmt_float(r.seconds, 1)),
        )
        for r in run.results
    ]
    ref_s = f" The unquantized reference pass took {run.reference_seconds:.1f} s." if _ok(run.reference_seconds) else ""
    return TableData(
        headers=("scheme", "avg bits", "PPL", "ref PPL", "ΔPPL", "KL", "top-1", "seconds"), rows=tuple(rows),
        right=frozenset(range(1, 8)), caption="Whole context, all windows." + ref_s,
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


def _fmt_err(x: float) -> str:
    if not _ok(x):
        return NA
    return "0" if x == 0 else (f"{x:.2e}" if x < 1e-3 else f"{x:.4f}")


# ------------------------------------------------------------------------------------ rich (CLI)

_RICH_TONE = {"good": "green", "bad": "bold red", "muted": "dim", "": ""}


def bucket_table(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> Table:
    """A rich table for the terminal: per scheme and position bucket, ΔPPL % (green within
    ``threshold``, red above), its 95 % CI, and KL / top-1 agreement on a dim second line."""
    from rich.table import Table
    from rich.text import Text

    run = RunSummary.coerce(summary)
    spans = run.bucket_spans
    title = f"ΔPPL by position — {run.model} on {run.data}, {fmt_pos(run.context)} context, {run.semantics}"
    table = Table(
        title=title,
        caption=f"ΔPPL (red above {fmt_pct(threshold, 0)}), its 95% CI, then KL (nats) · top-1 agreement",
    )
    table.add_column("scheme", style="bold")
    table.add_column("bits", justify="right")
    for span in spans:
        table.add_column(bucket_label(*span), justify="right")
    for r in run.results:
        cells: list[Any] = [r.name, fmt_float(r.avg_bits, 2)]
        for span in spans:
            b = _bucket_at(r, span)
            if b is None:
                cells.append(Text(NA, style="dim"))
                continue
            t = Text(fmt_pct(b.delta), style=_RICH_TONE[_tone(b.delta, threshold)])
            t.append(f"\n{fmt_ci(b.ci) or '[CI n/a]'}", style="dim")
            t.append(f"\n{fmt_kl(b.kl)} · {fmt_frac(b.top1)}", style="dim")
            cells.append(t)
        table.add_row(*cells)
    return table


def rich_table(data: TableData) -> Table:
    """Any :class:`TableData` as a rich table."""
    from rich.table import Table
    from rich.text import Text

    table = Table(caption=data.caption or None)
    for i, h in enumerate(data.headers):
        table.add_column(h, justify="right" if i in data.right else "left")
    for row in data.rows:
        table.add_row(*(Text(c.text, style=_RICH_TONE.get(c.tone, "")) for c in row))
    return table


def print_summary(
    summary: RunSummary | Mapping[str, Any] | str | Path,
    console: Console | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> None:
    """Print a run to the terminal: setting, bucket table, overall table and the verdict.

    ``summary`` is a parsed ``summary.json``, a :class:`RunSummary`, or a path to a run folder.
    """
    from rich.console import Console
    from rich.markup import escape

    run = RunSummary.coerce(summary)
    console = console or Console()
    console.print(
        f"[bold]{escape(run.model)}[/] on [bold]{escape(run.data)}[/]: context {run.context}, "
        f"{escape(run.semantics)} semantics, {escape(run.mode)} mode, {run.windows} window(s)"
        + (f"; peak memory {run.peak_memory}" if run.peak_memory else "")
    )
    console.print(bucket_table(run, threshold))
    console.print(rich_table(overall_table(run, threshold)))
    text = escape(verdict(run, threshold))
    console.print(_bold_markup(text, "[bold]", "[/bold]"))


def _bold_markup(text: str, start: str, end: str) -> str:
    """Replace ``**x**`` pairs in ``text`` by ``start x end``."""
    pieces = text.split("**")
    return "".join(p if i % 2 == 0 else f"{start}{p}{end}" for i, p in enumerate(pieces))

