"""Calibration/serving mismatch of a run, as the report shows it.

Schemes with static scales, NUQ codebooks (``kvquant-*``) or channel vectors (``*-token-smooth``) serve
constants fitted offline by ``kvbits calibrate``. The evaluator records, per scheme, in ``summary.json``
``results[].calibration`` (see ``kvbits.evaluate.measures._mismatch``):

- ``clipped_keys`` / ``clipped_values`` and their ``*_frac``: cached elements that fell outside the
  calibrated range and were saturated to it (simulate mode: every element the simulator quantized; stream
  mode and ``kvbits needle``: what the real caches quantized, from ``QuantizedKVCache.calibration_report()``;
  runs from before stream mode counted them have none);
- ``integer_zero``: the sides (``"keys"``, ``"values"``) stored under vLLM's integer zero-points (``vllm-int4``,
  nothing calibrated), whose clips are tokens whose range excludes 0 (the zero-point code clamps, the far end of
  the range is lost); absent for other schemes;
- ``max_calibrated_length`` and ``positions_beyond_calibrated``: the longest context the calibration
  saw, and how many positions of each window lie past it;
- ``generation_positions_beyond_calibrated`` (``--generate N`` runs; absent in other runs and those from before it):
  how many of the ``context + N`` positions a window and its greedy continuation reach lie past the calibrated length;
- ``calibrated_on_eval_text`` and ``calibration_overlap_tokens``: the calibration's data is the evaluated text (same
  sha256; its figures are flattered: the report marks the row and warns) and how many evaluated tokens lie in its
  calibration windows (``kvbits.evaluate.calib_text``; null where not recorded, absent in runs from before it);
- ``artifact``: ``{"id", "path", "data", "context", "windows", "tokens"}`` (runs from before it was
  recorded fall back to ``config.json``: the artifact ids of ``request.calibration`` and the folders
  of ``args.calibration``, whose ``calibration.json`` is read when it is still there, as recorded or relative to
  the run folder, and matches; one not found is named so in the row).

Pure Python: the rows feed both the Markdown/HTML renderer and any other consumer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbits._json import loads
from kvbits.report.fmt import NA, _num, _ok
from kvbits.report.inline import text
from kvbits.report.summary import RunSummary, SchemeResult, calibration_record
from kvbits.report.tables import Cell, TableData

__all__ = [
    "CALIBRATION_NOTE",
    "CLIP_WARN_FRAC",
    "CalibrationRow",
    "calibration_advice",
    "calibration_issues",
    "calibration_row",
    "calibration_rows",
    "calibration_table",
    "calibration_warnings",
    "cover_advice",
    "generation_warning",
]

logger = logging.getLogger(__name__)

CLIP_WARN_FRAC = 0.001  # warn when more than 0.1 % of the cached keys or values were clipped (also the cache's level)

CALIBRATION_NOTE = (
    "Schemes with static scales, NUQ codebooks or channel means and smoothing factors serve constants fitted "
    "offline by `kvbits calibrate`. "
    "*Clipped* is the fraction of the cached key/value elements that fell outside the calibrated range "
    "and were saturated to it (counted in simulate mode; n/a where not measured), or, under vLLM's integer "
    "zero-points (`vllm-int4`, nothing calibrated), lay past the far end of a token's range that excludes 0; "
    "*beyond calibrated* is "
    "the number of positions in each window past the longest context the calibration saw, where its "
    "statistics are extrapolated. Either is a sign that what is served differs from what was calibrated."
)


@dataclass(frozen=True)
class CalibrationRow:
    """One calibrated scheme: which artifact, what it saw, and the mismatch measured when serving."""

    scheme: str
    artifact: str = NA  # folder name and short id
    data: str = NA  # "pride-and-prejudice, 2 windows of 512 tokens"
    calibrated_length: int | None = None
    clipped_keys_frac: float = math.nan
    clipped_values_frac: float = math.nan
    clipped_keys: int | None = None
    clipped_values: int | None = None
    beyond: int | None = None  # positions per window past calibrated_length
    generation_beyond: int | None = None  # of the window plus its continuation (--generate), past calibrated_length
    context: int = 0
    integer_zero: tuple[str, ...] = ()  # sides ("keys", "values") stored under integer zero-points (vllm-int4)
    on_eval_text: bool | None = None  # calibrated on the evaluated text (same sha256); None: not recorded
    overlap_tokens: int | None = None  # evaluated tokens inside its calibration windows


# ------------------------------------------------------------------------------------ inputs


def _config_calibration(config: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """``(scheme -> artifact id, artifact folders)`` recorded in ``config.json`` (of every run, for a
    merged folder's ``merged_from``)."""
    if isinstance(config.get("merged_from"), list):
        ids: dict[str, str] = {}
        paths: list[str] = []
        for src in config["merged_from"]:
            ok = isinstance(src, Mapping) and isinstance(src.get("config"), Mapping)
            sub = src["config"] if ok else {}
            i, p = _config_calibration(sub)
            ids.update(i)
            paths += p
        return ids, paths
    request = config.get("request") if isinstance(config.get("request"), Mapping) else {}
    ids = request.get("calibration") if isinstance(request.get("calibration"), Mapping) else {}
    args = config.get("args") if isinstance(config.get("args"), Mapping) else {}
    paths = args.get("calibration") if isinstance(args.get("calibration"), list) else []
    return {str(k): str(v) for k, v in ids.items()}, [str(p) for p in paths if p]


def _candidates(path: str, run_dir: Path | None) -> list[Path]:
    """Where a recorded calibration folder may be now: as recorded (relative to the working directory), and, for a
    relative one, relative to the run folder and each folder above it (a run evaluated from the project root with
    ``--out runs/X --calibration runs/cal`` records ``runs/cal``), then beside the run folder (a results folder
    moved or copied with its calibrations)."""
    p = Path(path)
    out = [p]
    if run_dir is not None and not p.is_absolute():
        here = Path(run_dir).absolute()
        out += [a / p for a in (here, *here.parents)]
        out.append(here.parent / p.name)
    return out


def _artifact_from_folder(
    paths: list[str], scheme: str, artifact_id: str | None, run_dir: Path | None = None
) -> dict[str, Any] | None:
    """The artifact record of ``scheme`` from a recorded calibration folder, when one is still there
    and is the artifact the run used (same scheme; same tensor sha256 when the id is one). A relative folder is
    looked up as recorded, then relative to ``run_dir`` (the run folder) and the folders above it, then beside it
    (:func:`_candidates`); ``path`` stays the folder as recorded."""
    for p in paths:
        for folder in _candidates(p, run_dir):
            rec = _record_from(folder / "calibration.json", p, scheme, artifact_id)
            if rec is not None:
                return rec
    return None


def _record_from(meta_path: Path, p: str, scheme: str, artifact_id: str | None) -> dict[str, Any] | None:
    """The artifact record from ``meta_path`` when it is ``scheme``'s artifact of id ``artifact_id``, else None."""
    try:
        meta = loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    # a file that is not a calibration record (hand-edited, another tool's) is not this scheme's artifact: the
    # report names the calibration as not found rather than failing on it
    recorded = meta.get("scheme") if isinstance(meta, Mapping) else None
    if not isinstance(recorded, Mapping) or recorded.get("name") != scheme:
        return None
    files = meta.get("files") if isinstance(meta.get("files"), Mapping) else {}
    shas = {f"sha256:{f.get('sha256')}" for f in files.values() if isinstance(f, Mapping)}
    if artifact_id and artifact_id.startswith("sha256:") and artifact_id not in shas:
        return None  # the folder now holds another calibration
    data = meta.get("data") if isinstance(meta.get("data"), Mapping) else {}
    rec: dict[str, Any] = {"id": artifact_id, "path": p}
    for key in ("name", "context", "windows", "tokens"):
        if data.get(key) is not None:
            rec["data" if key == "name" else key] = data[key]
    return rec


def _short_id(artifact_id: Any) -> str:
    s = str(artifact_id or "")
    kind, _, digest = s.partition(":")
    return f"{kind}:{digest[:12]}" if digest else s


def _artifact_text(rec: Mapping[str, Any]) -> str:
    name = Path(str(rec["path"])).name if rec.get("path") else ""
    sid = _short_id(rec.get("id"))
    if rec.get("not_found"):
        return f"{sid or NA} (calibration folder gone or replaced)"
    if name and sid:
        return f"{name} ({sid})"
    return name or sid or NA


def _data_text(rec: Mapping[str, Any]) -> str:
    ctx, win = _num(rec.get("context")), _num(rec.get("windows"))
    shape = ""
    if _ok(ctx) and _ok(win):
        shape = f"{int(win)} window{'' if int(win) == 1 else 's'} of {int(ctx)} tokens"
    elif _ok(ctx):
        shape = f"{int(ctx)}-token windows"
    parts = [str(rec["data"])] if rec.get("data") else []
    if shape:
        parts.append(shape)
    return ", ".join(parts) or NA


def _count(x: Any) -> int | None:
    v = _num(x)
    return int(v) if _ok(v) else None


def _is_calibrated(r: SchemeResult, ids: Mapping[str, str]) -> bool:
    c = r.calibration
    clipped = any((_count(c.get(k)) or 0) > 0 for k in ("clipped_keys", "clipped_values"))
    return r.name in ids or "artifact" in c or "max_calibrated_length" in c or clipped


def calibration_rows(
    summary: RunSummary | Mapping[str, Any], config: Mapping[str, Any] | None = None, run_dir: Path | None = None
) -> list[CalibrationRow]:
    """One row per scheme served with a calibration (or that clipped values against static scales);
    empty when no scheme was. ``config`` is ``config.json`` (for runs that predate the artifact
    record in ``summary.json``: their calibration folders, as recorded, are looked up also relative to
    ``run_dir``, the run folder, see :func:`_artifact_from_folder`; one not found is said in the row and logged)."""
    run = RunSummary.coerce(summary)
    ids, paths = _config_calibration(config or {})
    rows = []
    for r in run.results:
        if not _is_calibrated(r, ids):
            continue
        fallback = None
        if not isinstance(r.calibration.get("artifact"), Mapping) and r.name in ids:
            fallback = _artifact_from_folder(paths, r.name, ids[r.name], run_dir)
            if fallback is None and paths:  # folders were recorded (not artifacts given as objects): say so
                where = "" if run_dir is None else f", relative to the run folder {run_dir} and those above it, beside it"
                logger.warning(
                    "the calibration of %s (%s) is recorded only in config.json, and none of the calibration folders it "
                    "records (%s) holds it (looked up from the working directory %s%s): the report has no calibrated "
                    "length or data for it", r.name, _short_id(ids[r.name]), ", ".join(paths) or "none", Path.cwd(), where,
                )  # fmt: skip
                fallback = {"id": ids[r.name], "not_found": True}
            fallback = fallback or {"id": ids[r.name]}
        rows.append(calibration_row(r.name, r.calibration, run.context, fallback))
    return rows


def calibration_row(
    scheme: str, record: Mapping[str, Any], context: int, artifact: Mapping[str, Any] | None = None
) -> CalibrationRow:
    """The row of one scheme from its calibration record (``results[].calibration``) and the run's
    context; ``artifact`` stands in for the record's ``artifact`` when it has none. ``ValueError`` naming the field
    of a malformed record (:func:`~.summary.calibration_record`)."""
    record = calibration_record(record, f"{scheme}: calibration")
    rec = record.get("artifact") if isinstance(record.get("artifact"), Mapping) else artifact
    rec = rec or {}
    length = _count(record.get("max_calibrated_length"))
    if length is None:
        length = _count(rec.get("context"))
    beyond = _count(record.get("positions_beyond_calibrated"))
    if beyond is None and length is not None and context:
        beyond = max(0, context - length)  # as the evaluator computes it
    return CalibrationRow(
        scheme=scheme,
        artifact=_artifact_text(rec),
        data=_data_text(rec),
        calibrated_length=length,
        clipped_keys_frac=_num(record.get("clipped_keys_frac")),
        clipped_values_frac=_num(record.get("clipped_values_frac")),
        clipped_keys=_count(record.get("clipped_keys")),
        clipped_values=_count(record.get("clipped_values")),
        beyond=beyond,
        context=context,
        integer_zero=tuple(x for x in record.get("integer_zero") or () if x in ("keys", "values")),
        on_eval_text=record.get("calibrated_on_eval_text") if isinstance(record.get("calibrated_on_eval_text"), bool)
        else None,
        overlap_tokens=_count(record.get("calibration_overlap_tokens")),
        generation_beyond=_count(record.get("generation_positions_beyond_calibrated")),
    )


# ------------------------------------------------------------------------------------ output


def _clip_pct(frac: float, clip_threshold: float) -> str:
    """A clipping rate as a percentage with 3 decimals, or as many more (up to 6) as it takes not to print as the
    warning level itself when it is not: at a 0.1 % level ``0.0010004 -> '0.10004%'`` (marked), ``0.0009996 ->
    '0.09996%'`` (not), where three decimals printed both as ``0.100%`` (the rule :func:`~.fmt.fmt_judged` applies
    to a ΔPPL against its budget)."""
    digits = 3
    if _ok(clip_threshold) and frac != clip_threshold:
        pct, level = frac * 100, clip_threshold * 100
        while digits < 6 and round(pct, digits) == round(level, digits):
            digits += 1
    return f"{frac * 100:.{digits}f}%"


def _fmt_clip(frac: float, n: int | None, clip_threshold: float = CLIP_WARN_FRAC) -> str:
    if not _ok(frac):
        return NA
    if frac == 0:
        return "0"
    pct = _clip_pct(frac, clip_threshold)
    if float(pct[:-1]) == 0:  # some clipped: not "0.000%", which reads as none
        pct = "<0.001%"
    return pct + (f" ({n:,})" if n is not None else "")


def _fmt_beyond(row: CalibrationRow) -> str:
    if row.beyond is None:
        return NA
    return f"{row.beyond:,} of {row.context:,}" if row.context else f"{row.beyond:,}"


def _clip_tone(frac: float, threshold: float) -> str:
    return "muted" if not _ok(frac) else "bad" if frac > threshold else "good"


def calibration_table(rows: list[CalibrationRow], clip_threshold: float = CLIP_WARN_FRAC) -> TableData:
    """Scheme, artifact, calibration data, calibrated length, clipped keys/values, positions beyond."""
    out = []
    for row in rows:
        keys = _fmt_clip(row.clipped_keys_frac, row.clipped_keys, clip_threshold)
        values = _fmt_clip(row.clipped_values_frac, row.clipped_values, clip_threshold)
        beyond_tone = "muted" if row.beyond is None else "bad" if row.beyond > 0 else "good"
        out.append(
            (
                Cell(row.scheme),
                Cell(row.artifact),
                Cell(row.data + (" (the evaluated text)" if row.on_eval_text else ""), "bad" if row.on_eval_text else ""),
                Cell(f"{row.calibrated_length:,}" if row.calibrated_length is not None else NA),
                Cell(keys, _clip_tone(row.clipped_keys_frac, clip_threshold)),
                Cell(values, _clip_tone(row.clipped_values_frac, clip_threshold)),
                Cell(_fmt_beyond(row), beyond_tone),
            )
        )
    return TableData(
        headers=(
            "scheme", "artifact", "calibrated on", "calibrated length", "clipped keys", "clipped values",
            "positions beyond calibrated",
        ),
        rows=tuple(out),
        right=frozenset({3, 4, 5, 6}),
        caption=f"Calibration served per scheme; clipping above {clip_threshold * 100:g}% and any position "
        "beyond the calibrated length marked.",
    )


def calibration_issues(row: CalibrationRow, clip_threshold: float = CLIP_WARN_FRAC) -> list[str]:
    """What is wrong with one scheme's calibration, as phrases following its name: served past its
    calibrated length, clipping above ``clip_threshold`` (a fraction) of its keys or values."""
    issues = []
    if row.beyond:
        known = row.calibrated_length is not None
        length = f"the {row.calibrated_length:,} tokens" if known else "the context"
        of = f" of {row.context:,}" if row.context else ""
        issues.append(f"serves {row.beyond:,}{of} positions per window beyond {length} it was calibrated on")
    for side, frac in (("keys", row.clipped_keys_frac), ("values", row.clipped_values_frac)):
        if _ok(frac) and frac > clip_threshold:
            how = (
                "under integer zero-points (tokens whose range excludes 0 lose its far end)"
                if side in row.integer_zero else "against the calibrated ranges"
            )
            issues.append(f"clips {_clip_pct(frac, clip_threshold)} of its {side} {how} (warning level {clip_threshold * 100:g}%)")
    return issues


def cover_advice(context: int | None) -> str:
    """What to do about positions served beyond the calibrated length, as one sentence: calibrate again with
    ``--context`` the longest context served (``context`` tokens; None or 0: not known, then said in words). The
    same words in ``kvbits eval``'s log, the report's warning and the caches' warnings."""
    if context:
        return f"Calibrate with --context {int(context)} to cover every position."
    return "Calibrate with --context at the longest context served to cover every position."


def _advised_context(row: CalibrationRow) -> int | None:
    """The ``--context`` that covers every position ``row`` served: the run's context, or, where it is not
    recorded, the calibrated length plus the positions beyond it; None where neither is known."""
    if row.context:
        return row.context
    if row.calibrated_length is not None and row.beyond:
        return row.calibrated_length + row.beyond
    return None


def calibration_advice(row: CalibrationRow) -> str:
    """:func:`cover_advice` for a row served beyond its calibrated length, else ``""``."""
    return cover_advice(_advised_context(row)) if row.beyond else ""


def generation_warning(row: CalibrationRow) -> str:
    """What follows the scheme's name when its greedy continuations (``--generate N``) reach past the calibrated
    length, with the ``--context`` that covers the window and its continuation: ``"(generation: 16 tokens after
    each 64-token window) serves 16 of 80 positions per window beyond the 64 tokens it was calibrated on. Calibrate
    with --context 80 to cover every position."``; ``""`` when they do not or it is not recorded. The same words in
    ``kvbits eval``'s log and the report."""
    beyond, longest = row.generation_beyond, row.calibrated_length
    if not beyond or beyond <= 0 or longest is None:
        return ""
    reach = longest + beyond  # the window and its continuation
    gen = CalibrationRow(row.scheme, calibrated_length=longest, beyond=beyond, context=reach)
    head = f"generation: {reach - row.context:,} tokens after each {row.context:,}-token window" if row.context \
        else "generation"  # fmt: skip
    return f"({head}) {'; '.join(calibration_issues(gen))}. {calibration_advice(gen)}"


def calibration_warnings(rows: list[CalibrationRow], clip_threshold: float = CLIP_WARN_FRAC) -> list[str]:
    """One warning line per scheme with :func:`calibration_issues`, ending with :func:`calibration_advice` where it
    served positions beyond its calibrated length, and one more where its continuations did
    (:func:`generation_warning`); inline ``**bold**`` marks the scheme."""
    lines = []
    for row in rows:
        issues = calibration_issues(row, clip_threshold)
        if row.on_eval_text:  # said apart from calibration_issues: kvbits eval logs it before the run, not after
            shared = f" ({row.overlap_tokens:,} of the evaluated tokens lie in its calibration windows)" \
                if row.overlap_tokens else ""  # fmt: skip
            issues.append(f"was calibrated on the evaluated text{shared}, so its figures flatter it")
        if issues:
            advice = calibration_advice(row)
            lines.append(f"Warning: **{text(row.scheme)}** " + "; ".join(issues) + "." + (f" {advice}" if advice else ""))
        gen = generation_warning(row)
        if gen:
            lines.append(f"Warning: **{text(row.scheme)}** {gen}")
    return lines
