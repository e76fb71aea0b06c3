"""The passkey-retrieval report (``kvbits needle``): Markdown, a heatmap figure, the output folder.

``write_needle(summary, out_dir)`` writes ``needle.json`` (the summary of
``kvbits.evaluate.needle_run.needle_eval``, every trial included), ``report.md`` and, with matplotlib,
``needle.png``: one panel per run (the reference, then each scheme), contexts down, depths across, each
cell the fraction of trials that retrieved the key. ``load_needle(path)`` reads a ``needle.json`` back,
checked (:func:`check_needle`): a hand-edited or foreign file is a ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbits._json import check, checked_object, entries, field
from kvbits.report.fmt import bos_phrase, fmt_frac, fmt_kl, fmt_pos, merged_runs_table
from kvbits.report.inline import code
from kvbits.report.markdown import md_cell
from kvbits.report.render import check_out_folder, write_json_report
from kvbits.report.summary import read_json

__all__ = [
    "NEEDLE_FILES", "READS_VERSION", "check_needle", "check_needle_out", "load_needle", "needle_markdown",
    "plot_needle", "trial_counts", "write_needle",
]  # fmt: skip

NEEDLE_FILES = ("needle.json", "report.md", "needle.png")

READS_VERSION = 1
"""The ``needle.json`` version this report reads: ``kvbits.evaluate.needle_run.NEEDLE_VERSION`` (not imported
from there, which needs torch; a test keeps the two equal)."""

_SEMANTICS = {
    "prefill": "the document (haystack and needle) prefilled in full precision and stored in each scheme's real "
    "cache; the question and the key decoded token by token over it",
    "decode": "every token, the document's included, attends over the quantized history (token-by-token "
    "generation, one-pass simulator)",
}


def _pct(x: float | None) -> str:
    """A fraction of trials as a whole percentage; one short of all never prints as ``100%``, nor one above none as
    ``0%`` (:func:`~kvbits.report.fmt.fmt_frac`: 219 of 220 is ``99%``)."""
    return "n/a" if x is None or not math.isfinite(x) else fmt_frac(x, 0)


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials (95 % for the default ``z``); ``n`` > 0.
    Unlike ``p ± z·se`` it stays within [0, 1] and is not empty at 0 or ``n`` successes."""
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def kept_count(summary: Mapping[str, Any], scheme: str) -> tuple[int, int]:
    """(trials ``scheme`` kept, trials the reference retrieved), counted from ``summary["records"]``."""
    ref_ok = [rec["reference"]["retrieved"] for rec in summary["records"]]
    got = [rec["schemes"][scheme]["retrieved"] for rec in summary["records"]]
    return sum(g and ok for g, ok in zip(got, ref_ok)), sum(ref_ok)


def kept_cell(summary: Mapping[str, Any], scheme: str) -> str:
    """``75% (9/12; 47–91%)``: the trials ``scheme`` kept, counted, with its 95 % Wilson interval."""
    return _count(*kept_count(summary, scheme), interval=True)


def _count(k: int, n: int, interval: bool = False) -> str:
    """``75% (9/12)``; with ``interval``, its 95 % Wilson interval too: ``75% (9/12; 47–91%)``; ``n/a``
    for no trials."""
    if n == 0:
        return "n/a"
    if not interval:
        return f"{_pct(k / n)} ({k}/{n})"
    lo, hi = wilson_interval(k, n)
    return f"{_pct(k / n)} ({k}/{n}; {100 * lo:.0f}–{100 * hi:.0f}%)"


def _fixed(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec`` (``"+.3f"``), ``n/a`` for null or NaN (a mean over no finite values); a signed
    figure that rounds to zero prints as ``+0.000``, not ``-0.000``."""
    if x is None or not math.isfinite(x):
        return "n/a"
    text = format(x, spec)
    return format(0.0, spec) if float(text) == 0 else text


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _grid_table(summary: Mapping[str, Any]) -> list[str]:
    """One row per (run, context), one column per depth: the fraction of trials retrieved."""
    contexts, depths = summary["contexts"], summary["depths"]
    runs = [("unquantized", summary["reference"]["grid"])] + [
        (r["scheme"], r["grid"]) for r in summary["results"]
    ]
    lines = [
        (
            "*Fraction of trials that retrieved the key, by context and needle depth (0: start of the haystack, "
            "1: just before the question).*"
        ),
        "",
        "| scheme | context | " + " | ".join(f"{d:g}" for d in depths) + " |",
        "|:---|---:|" + "---:|" * len(depths),
    ]
    for name, grid in runs:
        for c, row in zip(contexts, grid):
            lines.append(f"| {md_cell(str(name))} | {fmt_pos(c)} | " + " | ".join(_pct(x) for x in row) + " |")
    return lines + [""]


def needle_markdown(summary: Mapping[str, Any], *, figure: bool = True) -> str:
    """The report as Markdown: the setting, one overall table, the per-context table, and a
    (context × depth) retrieval table for the reference and each scheme; ``figure``: link needle.png."""
    task, contexts, depths = summary["task"], summary["contexts"], summary["depths"]
    ref = summary["reference"]
    n = len(summary["records"])
    merged = summary.get("merged_from")
    when = (
        f"- **Merged** from {len(merged)} runs (below) on {summary.get('merge_date', 'n/a')}"
        if isinstance(merged, list)
        else f"- **Date:** {summary.get('date', 'n/a')}; **commit:** {code(str((summary.get('commit') or {}).get('sha', 'n/a')))}"
    )
    lines = [
        f"# Passkey retrieval: {md_cell(str(summary['model']))} on {md_cell(str(summary['data']))}",
        "",
        f"- **Model:** {code(str(summary['model']))} (fingerprint {code(str(summary['fingerprint']['model']))})"
        + (f", {code(str(summary['dtype']))}" if summary.get("dtype") else ""),
        f"- **Haystack:** {code(str(summary['data']))} (tokens fingerprint {code(str(summary['fingerprint']['tokens']))})"
        + ("" if (bos := bos_phrase(summary)) is None else f"; each trial starts with {bos}, then the haystack one "
           "token shorter"),
        (
            f"- **Contexts:** {', '.join(fmt_pos(c) for c in contexts)} tokens; **depths** "
            f"{', '.join(f'{d:g}' for d in depths)}; {_trials_per_cell(summary)} trial(s) per cell, {n} in all "
            f"(seed {summary['seed']})"
        ),
        f"- **Semantics:** {code(str(summary['semantics']))}: {_SEMANTICS.get(summary['semantics'], '')}",
        (
            f'- **Needle:** "{md_cell(task["needle"])}" ({task["digits"]}-digit key); **question:** '
            f'"{md_cell(task["question"])}"'
        ),
        when,
        "",
        (
            "A trial is *retrieved* when the argmax at every key position is the key's token, which is exactly "
            "when greedy decoding writes the key. *Kept*: of the trials the unquantized model retrieved, the "
            "fraction the scheme retrieved too. ΔNLL: the key's mean NLL per token minus the reference's (nats); "
            "KL: mean KL(reference ‖ scheme) at the key positions."
        ),
        "",
        "## Overall",
        "",
    ]
    records = summary["records"]
    ref_ok = [rec["reference"]["retrieved"] for rec in records]
    m = sum(ref_ok)
    step = 100 / m if m else 0.0  # under a point from 201 trials: "0 points" said one trial moves nothing
    moves = f" (of {m} trials, one moves it by {step:.0f} points)" if step >= 1 else (
        f" (of {m} trials, one moves it by {step:.1g} points)" if m else "")
    lines += [
        (
            f"*Trials retrieved and kept, counted; kept with its 95 % Wilson interval{moves}: schemes whose "
            "intervals overlap widely are not told apart by these trials.*"
        ),
        "",
        "| scheme | avg bits | retrieved | kept | ΔNLL key | KL key | seconds |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    seconds = _fixed(summary["reference_seconds"], ".1f")
    lines.append(f"| unquantized | — | {_count(m, n)} | | | | {seconds} |")
    for r in summary["results"]:
        got = sum(rec["schemes"][r["scheme"]]["retrieved"] for rec in records)
        lines.append(
            f"| {md_cell(str(r['scheme']))} | {_fixed(r['avg_bits'], '.2f')} | {_count(got, n)} | "
            f"{kept_cell(summary, r['scheme'])} | "
            f"{_fixed(r['delta_nll'], '+.3f')} | {fmt_kl(math.nan if r['kl'] is None else r['kl'])} | "
            f"{_fixed(r['seconds'], '.1f')} |"
        )
    by_context_note = (
        "*Retrieved (reference → scheme), key NLL (reference → scheme), and with prefill semantics the MiB the "
        "scheme's real cache held at the end of the longest trial, of the reference's float cache.*"
    )
    lines += ["", "## By context", "", by_context_note, ""]
    lines += [
        "| scheme | " + " | ".join(fmt_pos(c) for c in contexts) + " |",
        "|:---|" + "---:|" * len(contexts),
    ]
    for r in summary["results"]:
        cells = []
        for b in r["by_context"]:
            cell = (
                f"{_pct(b['retrieved_ref'])} → {_pct(b['retrieved'])}; "
                f"NLL {_fixed(b['nll_ref'], '.2f')} → {_fixed(b['nll'], '.2f')}"
            )
            if b.get("cache_bytes") is not None:
                cell += f"; {_mib(b['cache_bytes'])} of {_mib(b.get('cache_bytes_ref'))} MiB"
            cells.append(cell)
        lines.append(f"| {md_cell(str(r['scheme']))} | " + " | ".join(cells) + " |")
    lines += ["", "## By context and depth", ""]
    if figure:
        lines += ["![retrieval by context and depth](needle.png)", ""]
    lines += _grid_table(summary)
    if any(x is None for row in ref["grid"] for x in row):
        lines += ["*n/a: no run measured that context at that depth.*", ""]
    lost = [
        (rec["context"], rec["depth"], rec["index"], name)
        for rec in summary["records"]
        for name, s in rec["schemes"].items()
        if rec["reference"]["retrieved"] and not s["retrieved"]
    ]
    if lost:
        lines += [
            "## Trials lost",
            "",
            "*Retrieved by the reference, not by the scheme: context, depth, trial.*",
            "",
        ]
        for name in [r["scheme"] for r in summary["results"]]:
            mine = [f"{fmt_pos(c)} @ {d:g} #{i}" for c, d, i, nm in lost if nm == name]
            if mine:
                lines.append(f"- **{md_cell(str(name))}** ({len(mine)}): " + ", ".join(mine))
        lines.append("")
    if isinstance(merged, list):
        lines += _merged_table(merged)
    return "\n".join(lines) + "\n"


def trial_counts(records: Sequence[Mapping[str, Any]]) -> Counter[tuple[int, float]]:
    """Trials per measured ``(context, depth)`` cell of a run's records."""
    return Counter((int(r["context"]), float(r["depth"])) for r in records)


def _trials_per_cell(summary: Mapping[str, Any]) -> str:
    """Trials per measured (context, depth) cell: ``"2"``, or ``"1–2"`` when merged runs differ."""
    counts = trial_counts(summary["records"])
    lo, hi = (min(counts.values()), max(counts.values())) if counts else (summary["trials"],) * 2
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _merged_table(merged: list[Mapping[str, Any]]) -> list[str]:
    """The runs a merged report was made of, with what each measured and where it ran."""
    return merged_runs_table(merged, [
        ("contexts", ":---", lambda m: ", ".join(fmt_pos(c) for c in m.get("contexts") or [])),
        ("depths", ":---", lambda m: ", ".join(f"{d:g}" for d in m.get("depths") or [])),
        ("trials", "---:", lambda m: str(m.get("trials"))),
        ("schemes", ":---", lambda m: ", ".join(md_cell(str(s)) for s in m.get("schemes") or [])),
    ])  # fmt: skip


def plot_needle(summary: Mapping[str, Any], path: Path) -> Path:
    """One panel per run (the unquantized model first): contexts × depths, colour = fraction retrieved."""
    import numpy as np

    from kvbits.report.plots.figure import new_figure, save_png, text_label

    contexts, depths = summary["contexts"], summary["depths"]
    panels = [("unquantized", summary["reference"]["grid"])] + [
        (r["scheme"], r["grid"]) for r in summary["results"]
    ]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(max(4.0, 2.3 * cols + 1.2), max(2.4, (0.35 * len(contexts) + 1.3) * rows))
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(-1)
    im = None
    for ax, (name, grid) in zip(axes, panels):
        g = np.array([[np.nan if x is None else x for x in row] for row in grid], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(g), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for (i, j), v in np.ndenumerate(g):
            ax.text(
                j,
                i,
                _pct(v),
                ha="center",
                va="center",
                fontsize=7,
            )
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(contexts)), [fmt_pos(c) for c in contexts], fontsize=7)
        ax.set_title(text_label(str(name)), fontsize=9)
        ax.set_xlabel("needle depth", fontsize=8)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes[: len(panels)]), fraction=0.03)
        cb.set_label("fraction retrieved", fontsize=8)
    fig.suptitle(f"Passkey retrieval, {text_label(str(summary['model']))} ({summary['semantics']} semantics)", fontsize=10)
    return save_png(fig, path)


def _check_grid(d: Mapping[str, Any], where: str, contexts: Sequence[int], depths: Sequence[float]) -> None:
    """``d["grid"]``: one row per context, one fraction (or null) per depth."""
    rows = entries(d, "grid", "list", where)
    if len(rows) != len(contexts) or any(len(row) != len(depths) for row in rows):
        raise ValueError(
            f"{where}.grid is not {len(contexts)} × {len(depths)} (contexts × depths): it does not match the run's "
            "contexts and depths"
        )
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            check(v, "mean", f"{where}.grid[{i}][{j}]")


def _check_version(summary: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``version`` is :data:`READS_VERSION` (as ``kvbits needle`` has always written it)."""
    version = field(summary, "version", "whole")
    if version != READS_VERSION:
        raise ValueError(
            f"version is {version}; this kvbits reads needle.json version {READS_VERSION} (a newer kvbits wrote it? "
            "upgrade kvbits, or run kvbits needle again)"
        )


def _check_result(r: Mapping[str, Any], where: str, contexts: Sequence[int], depths: Sequence[float]) -> None:
    """One entry of ``results``: a scheme's overall, per-context and per-cell figures."""
    field(r, "scheme", "text", where)
    for key in ("avg_bits", "seconds"):
        field(r, key, "number", where)
    for key in ("retrieved", "kept", "delta_nll", "kl"):
        field(r, key, "mean", where)
    by_context = entries(r, "by_context", "object", where)
    if len(by_context) != len(contexts):
        raise ValueError(
            f"{where}.by_context has {len(by_context)} entries; expected one per context ({len(contexts)})"
        )
    for i, b in enumerate(by_context):
        at = f"{where}.by_context[{i}]"
        if field(b, "context", "whole", at, default=contexts[i]) != contexts[i]:  # the table puts it in that column
            raise ValueError(f"{at}.context is {b['context']}; expected {contexts[i]} (contexts[{i}])")
        for key in ("retrieved", "retrieved_ref", "nll", "nll_ref"):
            field(b, key, "mean", at)
        for key in ("cache_bytes", "cache_bytes_ref"):
            field(b, key, "bytes", at, default=None)
    _check_grid(r, where, contexts, depths)


def _check_record(rec: Mapping[str, Any], where: str) -> None:
    """One trial of ``records``: where it was, and whether the reference and each scheme retrieved the key."""
    field(rec, "context", "whole", where)
    field(rec, "depth", "number", where)
    field(rec, "index", "whole", where)
    field(field(rec, "reference", "object", where), "retrieved", "flag", f"{where}.reference")
    for name, score in field(rec, "schemes", "object", where).items():
        at = f"{where}.schemes.{name}"
        field(check(score, "object", at), "retrieved", "flag", at)


def _check_needle_fields(s: Mapping[str, Any]) -> None:
    """Every field :func:`needle_markdown` and :func:`plot_needle` read, of the kind they need."""
    _check_version(s)
    for key in ("model", "data", "semantics"):
        field(s, key, "text")
    task = field(s, "task", "object")
    for key in ("needle", "question"):
        field(task, key, "text", "task")
    field(task, "digits", "whole", "task")
    fingerprint = field(s, "fingerprint", "object")
    for key in ("model", "tokens"):
        field(fingerprint, key, "text", "fingerprint")
    contexts, depths = entries(s, "contexts", "whole"), entries(s, "depths", "number")
    for key in ("trials", "seed"):
        field(s, key, "whole")
    field(s, "reference_seconds", "number")
    reference = field(s, "reference", "object")
    field(reference, "retrieved", "mean", "reference")
    _check_grid(reference, "reference", contexts, depths)
    for i, r in enumerate(entries(s, "results", "object")):
        _check_result(r, f"results[{i}]", contexts, depths)
    names = [r["scheme"] for r in entries(s, "results", "object")]
    for i, rec in enumerate(entries(s, "records", "object")):
        _check_record(rec, f"records[{i}]")
        if rec["context"] not in contexts or rec["depth"] not in depths:  # the grid would leave it out, overall not
            raise ValueError(
                f"records[{i}] is at context {rec['context']}, depth {rec['depth']}: not among the run's contexts "
                f"{list(contexts)} and depths {list(depths)}"
            )
        missing = [n for n in names if n not in rec["schemes"]]
        if missing:  # the overall table counts every scheme on every trial
            raise ValueError(f"records[{i}].schemes has no {', '.join(map(repr, missing))} (a scheme of results)")
    if s.get("commit") is not None:
        field(s, "commit", "object")
    if s.get("merged_from") is not None:
        entries(s, "merged_from", "object")


def check_needle(summary: Any, source: str | os.PathLike[str]) -> None:
    """``ValueError`` naming ``source`` (the file) and the field unless ``summary`` is a ``needle.json`` this
    kvbits reports: the version it reads, and every field the report uses, of the kind it uses."""
    checked_object(summary, source, "a kvbits needle summary", _check_needle_fields)


def load_needle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``needle.json`` read back and checked (:func:`check_needle`)."""
    return read_json(Path(path), check_needle)


def check_needle_out(out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """``out_dir`` as a ``Path`` if a needle run may be written there (see :func:`write_needle`), else
    ``ValueError``; call it before the trials run, so a wrong folder fails in a moment."""
    return check_out_folder(out_dir, "needle", NEEDLE_FILES, overwrite=overwrite)


def write_needle(
    summary: Mapping[str, Any], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Write ``needle.json``, ``report.md`` and (with matplotlib) ``needle.png`` into ``out_dir``.

    A non-empty folder that holds no ``needle.json`` is refused (``ValueError``) unless ``overwrite``;
    then only the files named in :data:`NEEDLE_FILES` are replaced, nothing else is deleted.
    """
    return write_json_report(summary, out_dir, "needle", NEEDLE_FILES, needle_markdown, plot_needle,
                             overwrite=overwrite)  # fmt: skip
