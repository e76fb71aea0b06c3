"""Several ``kvbits needle`` folders of the same model, text and task as one passkey grid.

A 32K trial of a 0.5B model takes minutes per scheme on a CPU, so the long contexts are often run apart
from the short ones, and a scheme added later runs on the trials already measured. ``kvbits report A B
--out C`` (with needle folders) puts them in one report. A trial is identified by ``(context, depth,
index)``: with the same seed, two runs build the same trial (the same key, haystack offset and needle
position), so the merge checks, before it writes anything:

- the same model and tokens (fingerprints), text, task, semantics, seed and summary version;
- for a trial both runs hold: the same trial, and the same unquantized result (retrieved, predicted
  tokens, cache bytes; the key's NLL within ``NLL_ATOL`` nats, the rounding of another machine);
- every (trial, scheme) from one run only, and every scheme measured on every trial of the merged grid,
  so each scheme's overall figures are over the same trials as the reference's;
- a scheme measured in several runs: the same average bits, and the same calibration artifact (its id).

A scheme's ``calibration`` record is that of the run with the longest context (its ``positions_beyond_calibrated``
is the merged grid's; its clip counts are of that run's trials alone); a scheme measured in several runs also has
``calibration_by_run``: ``[{"run", "contexts", "calibration"}]``, each run's own record.

Contexts and depths are the union of the runs' (two depths that round to the same 1e-4 are refused: they seed the
same trials, which would be counted twice); a (context, depth) cell no run measured reads ``n/a``.
The overall, per-context and per-cell figures are computed again from the merged trial records with the
functions ``kvbits needle`` uses (so merging runs of disjoint contexts gives what one run of all the
contexts gives, timings aside). Seconds are summed, the peak RSS is the largest; ``merged_from`` lists each
run's folder, contexts, depths, trials, schemes, date, commit and versions.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbits._json import field
from kvbits.report.merge import (
    check_fingerprints,
    check_run_folders,
    check_same,
    json_run_meta,
    load_json_run,
    write_json_merge,
)

logger = logging.getLogger(__name__)

__all__ = ["NLL_ATOL", "merge_needle", "merge_needle_runs"]

NLL_ATOL = 1e-4
"""Largest difference of the unquantized key NLL (nats per key token) of one trial between merged runs."""

_SAME = ("version", "model", "data", "task", "semantics", "seed")
_SCORES = ("nll", "kl", "token_acc")  # of each scheme on each trial: the merged figures are means of them
_TRIAL = ("depth_actual", "key", "offset", "needle_at", "needle_len", "doc_len", "answer_start")
TrialId = tuple[int, float, int]


def _load(folder: Path) -> dict[str, Any]:
    """A folder's ``needle.json``, checked field by field (:func:`kvbits.report.needle.check_needle`)."""
    from kvbits.report.needle import check_needle

    summary = load_json_run(
        folder, "needle", lambda s: isinstance(s.get("records"), list) and isinstance(s.get("results"), list)
        and bool(s["records"]) and bool(s["results"]), "no trials or no scheme results",
    )  # fmt: skip
    check_needle(summary, folder / "needle.json")
    try:  # what the merge computes the figures again from, beyond what the report reads
        for i, rec in enumerate(summary["records"]):
            field(rec["reference"], "nll", "number", f"records[{i}].reference")
            for name, score in rec["schemes"].items():
                for key in _SCORES:
                    field(score, key, "number", f"records[{i}].schemes.{name}")
    except ValueError as exc:
        raise ValueError(f"{folder / 'needle.json'}: {exc}") from None
    return summary


def _trial_id(record: Mapping[str, Any]) -> TrialId:
    return int(record["context"]), float(record["depth"]), int(record["index"])


def _cell(tid: TrialId) -> str:
    return f"context {tid[0]}, depth {tid[1]:g}, trial {tid[2]}"


def _check_setting(names: Sequence[str], summaries: Sequence[Mapping[str, Any]]) -> None:
    first = summaries[0]
    for name, s in zip(names[1:], summaries[1:]):
        check_same(names[0], first, name, s, _SAME,
                   "only passkey runs of the same model, text, task, semantics and seed share a report")  # fmt: skip
        check_same(names[0], first, name, s, ("dtype",),  # runs from before session 53 record none
                   "a passkey grid compares schemes on one model as it ran, in one dtype", recorded_only=True)
        if first.get("bos", "never") != s.get("bos", "never"):  # a record without "bos": raw slices (before --bos)
            raise ValueError(
                f"runs differ in their bos: {first.get('bos', 'never')} in {names[0]}, {s.get('bos', 'never')} in "
                f"{name}: a trial that starts with the BOS is another trial; merge runs with the same --bos"
            )
        check_fingerprints(names[0], first, name, s, "needle")


def _check_depths(names: Sequence[str], summaries: Sequence[Mapping[str, Any]], depths: list[float]) -> list[float]:
    """``depths`` (the union of the runs'), unless two of them seed the same trials (``ValueError``): a trial's key
    and haystack offset come from its depth rounded to 1e-4 (``kvbits.evaluate.needle.check_depths``, which refuses
    such depths within one run), so 0.5 in one run and 0.50001 in another are the same trials counted twice."""
    from kvbits.evaluate.needle import check_depths

    try:
        return check_depths(depths)
    except ValueError as exc:
        runs = ", ".join(f"{n}: {', '.join(f'{d!r}' for d in s['depths'])}" for n, s in zip(names, summaries))
        raise ValueError(f"the runs' depths can not share one grid ({runs}): {exc}") from None


def _same_reference(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if (a.get("retrieved"), a.get("pred"), a.get("cache_bytes")) != (b.get("retrieved"), b.get("pred"), b.get("cache_bytes")):
        return False
    x, y = a.get("nll"), b.get("nll")
    if x is None or y is None:
        return x is y
    return math.isclose(float(x), float(y), rel_tol=0.0, abs_tol=NLL_ATOL)


def _merge_records(
    names: Sequence[str], summaries: Sequence[Mapping[str, Any]], order: list[str]
) -> list[dict[str, Any]]:
    """The union of the runs' trial records, each with the schemes of every run that measured it."""
    merged: dict[TrialId, dict[str, Any]] = {}
    source: dict[tuple[TrialId, str], str] = {}
    first_run: dict[TrialId, str] = {}
    for name, s in zip(names, summaries):
        for rec in s["records"]:
            tid = _trial_id(rec)
            have = merged.get(tid)
            if have is None:
                merged[tid] = {**rec, "schemes": {}}
                first_run[tid] = name
            else:
                diff = [k for k in _TRIAL if have.get(k) != rec.get(k)]
                if diff:
                    raise ValueError(
                        f"{_cell(tid)} is a different trial in {first_run[tid]} and {name} (its {', '.join(diff)} "
                        "differ): the runs did not build the same trials"
                    )
                if not _same_reference(have["reference"], rec["reference"]):
                    raise ValueError(
                        f"the unquantized model's result on {_cell(tid)} differs between {first_run[tid]} and "
                        f"{name} (retrieved, predicted tokens, cache bytes, or the key's NLL by more than "
                        f"{NLL_ATOL} nats): the runs did not measure the same reference; run the schemes together"
                    )
            for scheme, score in rec["schemes"].items():
                if (tid, scheme) in source:
                    raise ValueError(
                        f"scheme {scheme!r} was measured on {_cell(tid)} in both {source[(tid, scheme)]} and "
                        f"{name}; a merged report holds each trial's scheme once (merge without one of them)"
                    )
                source[(tid, scheme)] = name
                merged[tid]["schemes"][scheme] = score
    records = [merged[t] for t in sorted(merged)]
    for rec in records:
        missing = [n for n in order if n not in rec["schemes"]]
        if missing:
            raise ValueError(
                f"scheme(s) {', '.join(missing)} were not measured on {_cell(_trial_id(rec))} (a trial of "
                f"{first_run[_trial_id(rec)]}); every scheme of a merged report must cover every trial, so "
                "that its figures compare with the reference's: run it there too, or merge fewer runs"
            )
        rec["schemes"] = {n: rec["schemes"][n] for n in order}
    return records


def _artifact_id(result: Mapping[str, Any]) -> str | None:
    """The id of the calibration artifact that served a scheme's result (``calibration.artifact.id``), None for none."""
    art = (result.get("calibration") or {}).get("artifact")
    return art.get("id") if isinstance(art, Mapping) else None


def _decode_counts(results: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
    """The summed fused / fallback decode-step counters, None when no run recorded them."""
    counts = [r.get("decode") for r in results if isinstance(r.get("decode"), Mapping)]
    if not counts:
        return None
    keys = dict.fromkeys(k for c in counts for k in c)
    return {k: sum(int(c.get(k) or 0) for c in counts) for k in keys}


def merge_needle(summaries: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One ``kvbits needle`` summary from several (module docstring); ``names`` label the runs in errors
    and in ``merged_from`` (default ``run 1``, ``run 2``, ...). ``ValueError`` when they can not merge."""
    from kvbits.evaluate.needle_run import reference_result, scheme_result
    from kvbits.report.needle import trial_counts

    names = list(names) if names is not None else [f"run {i + 1}" for i in range(len(summaries))]
    if len(summaries) < 2 or len(names) != len(summaries):
        raise ValueError(f"merging needs two or more needle summaries (and a name each), got {len(summaries)}")
    _check_setting(names, summaries)
    order = list(dict.fromkeys(str(r["scheme"]) for s in summaries for r in s["results"]))
    records = _merge_records(names, summaries, order)
    contexts = sorted({int(r["context"]) for r in records})
    depths = _check_depths(names, summaries, sorted({float(r["depth"]) for r in records}))

    results = []
    for name in order:
        mine = [(s, r) for s in summaries for r in s["results"] if r["scheme"] == name]
        bits = [float(r["avg_bits"]) for _, r in mine]
        if not all(math.isclose(b, bits[0], rel_tol=1e-9) for b in bits):
            raise ValueError(f"scheme {name!r} has different average bits in the runs ({bits}): not the same scheme")
        artifacts = {_artifact_id(r) for _, r in mine}
        if len(artifacts) > 1:
            raise ValueError(
                f"scheme {name!r} was served by different calibrations in the runs "
                f"({', '.join(sorted(str(a) for a in artifacts))}): not the same scheme; run it with one calibration"
            )
        res = scheme_result(name, bits[0], records, contexts, depths)
        longest = max(mine, key=lambda sr: max(sr[0]["contexts"]))  # calibration mismatch: the longest context
        res["calibration"] = longest[1].get("calibration", {})
        if len(mine) > 1:  # each run's own record: the clip counts above are the longest run's trials alone
            res["calibration_by_run"] = [
                {"run": run, "contexts": list(s["contexts"]), "calibration": r.get("calibration", {})}
                for run, s in zip(names, summaries) for r in s["results"] if r["scheme"] == name
            ]
        res["seconds"] = sum(float(r.get("seconds") or 0.0) for _, r in mine)
        res["decode"] = _decode_counts([r for _, r in mine])
        results.append(res)

    first = summaries[0]
    return {
        **{k: first[k] for k in ("version", "task", "model", "data", "semantics")},
        **{k: first[k] for k in ("bos", "bos_token", "bos_token_id") if k in first},
        **({"dtype": dt} if (dt := next((s["dtype"] for s in summaries if s.get("dtype")), None)) else {}),
        "contexts": contexts,
        "depths": depths,
        "trials": max(trial_counts(records).values()),
        "seed": first["seed"],
        "fingerprint": dict(first["fingerprint"]),
        "reference": reference_result(records, contexts, depths),
        "results": results,
        "records": records,
        "reference_seconds": sum(float(s.get("reference_seconds") or 0.0) for s in summaries),
        **json_run_meta(names, summaries, _measured),
    }


def _measured(s: Mapping[str, Any]) -> dict[str, Any]:
    """What one needle run measured, for ``merged_from``."""
    return {**{k: s.get(k) for k in ("contexts", "depths", "trials")}, "schemes": [str(r["scheme"]) for r in s["results"]]}


def merge_needle_runs(
    runs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Merge two or more ``kvbits needle`` folders into ``out_dir`` (``needle.json``, ``report.md``, the figure).

    Args:
        runs: the needle folders; schemes appear in the order the runs first name them.
        out_dir: a new or empty folder, or one an earlier merge wrote (``overwrite``: any other; only the
            needle files are replaced).

    Raises:
        FileNotFoundError: a folder without ``needle.json``.
        ValueError: fewer than two runs, runs that can not share one grid (module docstring; the message
            names the field, the trial and both folders), or a bad ``out_dir``.
    """
    from kvbits.report.needle import NEEDLE_FILES, write_needle

    folders = check_run_folders(runs)
    summaries = [_load(f) for f in folders]
    merged = merge_needle(summaries, [str(f) for f in folders])
    out = write_json_merge(merged, Path(out_dir), folders, "needle", NEEDLE_FILES, write_needle, overwrite=overwrite)
    logger.info("merged %d needle runs (%d trials, %d schemes) into %s", len(folders), len(merged["records"]),
                len(merged["results"]), out)  # fmt: skip
    return out
