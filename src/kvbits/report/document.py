"""The report as a document: a short list of blocks (heading, paragraph, metadata, table, figure,
code) built once from a run, then written as Markdown (:mod:`.markdown`) and as one HTML page
(:mod:`.html_page`), so the two always say the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbits.report.calibration import (
    CALIBRATION_NOTE,
    calibration_rows,
    calibration_table,
    calibration_warnings,
)
from kvbits.report.fmt import fmt_budget, fmt_pos
from kvbits.report.inline import code, split_code_spans, text
from kvbits.report.inputs import KL_FLOAT64_VERSION, float32_kl_sources, reproduce_command, run_commit
from kvbits.report.plots import PLOT_FILES
from kvbits.report.plots.tradeoff import infinite_points, nan_points
from kvbits.report.summary import RunSummary
from kvbits.report.tables import (
    Cell,
    TableData,
    attn_table,
    delta_table,
    entropy_table,
    generation_table,
    metric_table,
    overall_table,
)
from kvbits.report.verdict import verdict

__all__ = ["Block", "Code", "Figure", "Heading", "Meta", "Para", "Table", "build_document", "split_code_spans"]


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str  # inline **bold** and `code` allowed


@dataclass(frozen=True)
class Meta:
    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Table:
    data: TableData


@dataclass(frozen=True)
class Figure:
    path: Path
    alt: str
    caption: str


@dataclass(frozen=True)
class Code:
    text: str


Block = Heading | Para | Meta | Table | Figure | Code

FIGURE_TEXT = {
    "ppl_vs_position": "Perplexity (top) and ΔPPL against the unquantized reference (bottom) along the "
    "context; the dotted red line is the {budget} budget.",
    "delta_heatmap": "ΔPPL % per scheme and position bucket, with 95% confidence intervals.",
    "kl_by_bucket": "KL divergence from the reference per position bucket (log scale; zeros are not drawn).",
    "bits_vs_delta": "Memory against quality: average bits per cached element vs ΔPPL, overall (filled) "
    "and in the worst bucket (hollow).",
    "attn_error": "Relative error of the attention output per sampled layer and position bucket.",
}


def decode_note(run: RunSummary) -> str | None:
    """How a stream run's decode steps were attended, per kvbits scheme (``results[].decode``), or None."""
    parts = []
    for r in run.results:
        if not r.decode:
            continue
        fused, fallback = int(r.decode.get("fused_steps", 0)), int(r.decode.get("fallback_steps", 0))
        if fused:
            how = f"{fused:,} layer-steps through the fused kernel over the packed cache"
            how += f", {fallback:,} over dequantized K/V after a fallback" if fallback else ""
        else:
            how = "dequantized K/V + SDPA (no fused decode)"
        parts.append(f"**{text(r.name)}**: {how}")
    return ("*Decode path (stream mode):* " + "; ".join(parts) + ".") if parts else None


def kl_precision_note(config: Mapping[str, Any]) -> str | None:
    """What the report must say of its KL when runs of an output version before :data:`KL_FLOAT64_VERSION`
    (float32 log-probabilities) are behind it: a note when all are, a ``Warning:`` naming the runs and schemes
    when a merge mixes them with float64 runs (their small KLs do not compare); None when none is."""
    old, every = float32_kl_sources(config)
    if not old:
        return None
    cost = "a KL below about 1e-5 is overstated by tens of percent per token"
    if every:
        return (f"*KL computed from float32 log-probabilities (kvbits eval output version below {KL_FLOAT64_VERSION}): "
                f"{cost}; a current `kvbits eval` computes it in float64.*")  # fmt: skip
    schemes = ", ".join(f"**{text(n)}**" for s in old for n in s.schemes or ())
    runs = ", ".join(f"{code(s.path)} (version {s.version})" for s in old)
    return (
        f"Warning: the KL of {schemes} comes from runs of kvbits eval output version below {KL_FLOAT64_VERSION} "
        f"({runs}), computed from float32 log-probabilities, the other schemes' from float64: {cost}, so small KLs "
        "do not compare between the two; evaluate those schemes again with a current `kvbits eval` to compare them."
    )


def _merged_sources(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The runs a merged folder was made from (``config.json["merged_from"]``, see
    :mod:`kvbits.report.merge`); empty for an ordinary run."""
    sources = config.get("merged_from")
    return [s for s in sources if isinstance(s, Mapping)] if isinstance(sources, list) else []


def merged_runs_table(sources: list[Mapping[str, Any]]) -> TableData:
    """One row per merged run: its folder, schemes, date, commit and versions."""
    rows = []
    for src in sources:
        cfg = src.get("config") if isinstance(src.get("config"), Mapping) else {}
        versions = cfg.get("versions") if isinstance(cfg.get("versions"), Mapping) else {}
        rows.append((
            Cell(str(src.get("path", "?"))), Cell(", ".join(str(x) for x in src.get("schemes") or ())),
            Cell(str(cfg.get("date") or "n/a")), Cell(run_commit(cfg) or "n/a"),
            Cell(", ".join(f"{k} {v}" for k, v in versions.items()) or "n/a"),
        ))  # fmt: skip
    return TableData(
        headers=("run folder", "schemes", "date", "commit", "versions"), rows=tuple(rows),
        caption="The evaluations merged into this report (`kvbits report ... --out`): same model and tokens "
        "(fingerprints), context, windows, semantics and mode, and the same unquantized reference in every bucket.",
    )  # fmt: skip


def _merged_commands(sources: list[Mapping[str, Any]], run: RunSummary, out_dir: Path | str) -> str:
    """Each merged run's command line, then the ``kvbits report`` line that merges them; a run that is itself a merge
    gives its own runs' lines and its ``kvbits report`` line (it was given a ``kvbits eval`` of all its schemes into
    its folder, a command that never ran)."""
    import shlex

    lines = []
    for src in sources:
        cfg = src.get("config") if isinstance(src.get("config"), Mapping) else {}
        names = set(src.get("schemes") or ())
        sub = dataclasses.replace(run, results=tuple(r for r in run.results if r.name in names))
        inner = _merged_sources(cfg)
        if inner:
            lines.append(_merged_commands(inner, sub, str(src.get("path", "?"))))
            continue
        lines.append(reproduce_command(cfg, sub, src.get("path")))
    paths = [str(src.get("path", "?")) for src in sources]
    lines.append(shlex.join(["kvbits", "report", *paths, "--out", str(out_dir)]))
    return "\n".join(lines)


def build_document(
    run: RunSummary, config: Mapping[str, Any], figures: Mapping[str, Path], failed: Mapping[str, str],
    plot_note: str, threshold: float, out_dir: Path, has_tokens: bool,
) -> list[Block]:
    ctx = fmt_pos(run.context)
    ctx = "unknown context" if not run.context else f"{ctx} context" if "K" in ctx else f"{ctx}-token context"
    blocks: list[Block] = [Heading(1, f"KV-cache quantization report: {text(run.model)} on {text(run.data)}, {ctx}")]
    fp = run.fingerprint or {}
    sources = _merged_sources(config)
    versions = None if sources else config.get("versions")
    bos = run.bos_phrase()
    meta = [
        ("Model", code(run.model) + (f" (fingerprint {code(str(fp['model']))})" if fp.get("model") else "")),
        ("Data", code(run.data) + (f" (tokens fingerprint {code(str(fp['tokens']))})" if fp.get("tokens") else "")),
        ("Context", f"{run.context} tokens per window, {run.windows} window(s)"
                    + ("" if bos is None else f" (each {bos} and the next context - 1 text tokens; the BOS not scored)")),
        ("Semantics", f"{code(run.semantics)}, {code(run.mode)} mode"),
    ]
    if run.peak_memory:
        meta.append(
            ("Peak memory", run.peak_memory + (" (the largest of the merged runs)" if sources else ""))
        )
    if sources:
        merged_on = text(str(config.get("date") or "n/a"))  # config.json is text, not Markdown
        meta.append(("Runs", f"{len(sources)} evaluations merged on {merged_on} (see *Runs merged*)"))
    else:
        meta += [
            ("Date", text(str(config.get("date") or config.get("timestamp") or "n/a"))),
            ("Commit", code(run_commit(config)) if run_commit(config) else "n/a"),
        ]
    if isinstance(versions, Mapping) and versions:
        meta.append(("Versions", text(", ".join(f"{k} {v}" for k, v in versions.items()))))
    blocks += [Meta(tuple(meta)), Heading(2, "Verdict"), Para(verdict(run, threshold))]
    if plot_note:
        blocks.append(Para(plot_note))

    def fig(key: str) -> None:
        if key in figures:
            caption = FIGURE_TEXT[key].format(budget=fmt_budget(threshold, sign=False))
            off = infinite_points(run) if key == "bits_vs_delta" else []
            if off:  # an infinite ΔPPL has no place on the axis: say whose points are missing
                caption += " Not drawn, ΔPPL +inf: " + ", ".join(text(p) for p in off) + "."
            off_nan = nan_points(run) if key == "bits_vs_delta" else []
            if off_nan:  # nor has a NaN one (no perplexity, no judged bucket)
                caption += " Not drawn, ΔPPL NaN: " + ", ".join(text(p) for p in off_nan) + "."
            blocks.append(Figure(figures[key], PLOT_FILES[key], caption))
        elif key in failed:
            blocks.append(Para(f"*The figure `{key}.png` could not be drawn: {text(failed[key])}.*"))

    kl_note = kl_precision_note(config)
    blocks.append(Heading(2, "Where along the context it hurts"))
    if run.bucket_spans:
        fig("ppl_vs_position")
        if "ppl_vs_position" in figures and not has_tokens:
            blocks.append(Para("*No per-token arrays in `tokens/`: the curves are bucket means.*"))
        blocks += [Table(delta_table(run, threshold)), Table(metric_table(run, "ppl"))]
        fig("delta_heatmap")
        blocks += [
            Heading(2, "KL divergence and top-1 agreement"),
            Table(metric_table(run, "kl")),
        ]
        if kl_note:
            blocks.append(Para(kl_note))
        fig("kl_by_bucket")
        blocks.append(Table(metric_table(run, "top1")))
    else:
        blocks.append(Para("The run recorded no position buckets."))
    blocks += [Heading(2, "Overall"), Table(overall_table(run, threshold))]
    if kl_note and not run.bucket_spans:
        blocks.append(Para(kl_note))
    note = decode_note(run)
    if note:
        blocks.append(Para(note))
    fig("bits_vs_delta")
    blocks.append(Heading(2, "Attention-output error"))
    at = attn_table(run)
    if at is None:
        blocks.append(Para("Not measured in this run."))
    else:
        blocks.append(Table(at))
        fig("attn_error")
    et = entropy_table(run)
    if et is not None:
        blocks += [Heading(2, "Attention entropy"), Table(et)]
    gt = generation_table(run)
    if gt is not None:
        blocks += [Heading(2, "Greedy generation"), Table(gt)]
    cal = calibration_rows(run, config, out_dir)
    if cal:
        blocks += [Heading(2, "Calibration"), Para(CALIBRATION_NOTE), Table(calibration_table(cal))]
        blocks += [Para(w) for w in calibration_warnings(cal)]
    if sources:
        blocks += [
            Heading(2, "Runs merged"), Table(merged_runs_table(sources)),
            Heading(2, "How to reproduce"), Code(_merged_commands(sources, run, out_dir)),
        ]  # fmt: skip
        return blocks
    blocks += [
        Heading(2, "How to reproduce"),
        Code(reproduce_command(config, run, out_dir)),
    ]
    commit = run_commit(config)
    if commit:
        blocks.append(Para(f"at commit {code(commit.split()[0])} of kvbits."))
    return blocks
