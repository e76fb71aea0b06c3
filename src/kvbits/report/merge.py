"""Several evaluation folders of the same model, text and setting as one run folder, for one report.

Schemes are often evaluated a few at a time (a scheme added a week later, a calibrated scheme run
apart); ``kvbits report A B --out C`` puts them in one table. That is only honest when every run
measured its schemes against the same unquantized reference, so :func:`merge_runs` checks, before it
writes anything:

- the same model and the same tokens (the ``fingerprint`` of each ``summary.json``), the same context,
  windows, semantics and mode, and (from ``config.json``, where both runs name it: None is the model's own)
  the same model dtype and scored prompt length;
- the same reference: every position bucket's unquantized perplexity equal within ``REF_RTOL``
  (a different device, torch or kvbits version may move it by float rounding; more is another setting);
- scheme names that appear in one run only;
- greedy continuations (``--generate``) of the same length, with the same reference tokens.

Runs of another output version (``config.json["version"]``) do merge: version 1 (the committed results) took KL
from float32 log-probabilities, version 2 from float64; merging the two logs a warning, and the report names the
schemes whose KL is float32 (:func:`kvbits.report.document.kl_precision_note`).

The merged folder holds what a report reads (``summary.json`` with the results in the order of the runs,
``tokens/<scheme>.safetensors``, ``records.jsonl``, ``generations.jsonl``) and a ``config.json`` that
keeps every run's own configuration under ``merged_from``; it has no ``DONE``, so ``kvbits eval`` never
takes it for one of its runs. Runs evaluated on other numbers of ranks merge (their numbers are a single
process's), but their seconds are summed over their own ranks: ``summary.json``'s ``merged_from`` records each
run's ``world_size``, and ``world_size`` is null when they differ (the report then says it per run). Each run made
its own reference pass: ``reference_seconds`` is the first's, ``merged_from`` records each run's (the report lists them).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbits._files import write_text_atomic
from kvbits._json import dumps, field, json_object
from kvbits.report.inputs import KL_FLOAT64_VERSION, check_output_versions, eval_sources, load_config
from kvbits.report.summary import RunSummary, read_json

logger = logging.getLogger(__name__)

__all__ = [
    "MERGED_FILES",
    "REF_RTOL",
    "check_fingerprints",
    "check_run_folders",
    "check_same",
    "is_merged",
    "json_run_meta",
    "load_json_run",
    "merge_runs",
    "other_run_kind",
    "refuse_out_among",
    "write_json_merge",
]

REF_RTOL = 1e-4
"""Largest relative difference of a bucket's reference perplexity between merged runs (0.01 %, the
precision the report prints ΔPPL with)."""

MERGED_FILES = (
    "DONE",
    "config.json",
    "summary.json",
    "records.jsonl",
    "generations.jsonl",
    "report.md",
    "report.html",
)
"""The files :func:`merge_runs` writes, replaces or removes (``DONE``, an eval run's mark; besides ``tokens/`` and
the figures)."""

_SETTING = ("model", "context", "windows", "semantics", "mode")
_REQUEST_SETTING = ("dtype", "prompt_len")


def is_merged(config: Mapping[str, Any]) -> bool:
    """Whether ``config.json`` is that of a merged folder (it lists the runs under ``merged_from``)."""
    return isinstance(config.get("merged_from"), list)


def other_run_kind(folder: Path) -> str | None:
    """``"needle"`` or ``"speed"`` for a folder that holds such a run and no evaluation, else None."""
    if (folder / "summary.json").is_file():
        return None
    return next((kind for kind in ("needle", "speed") if (folder / f"{kind}.json").is_file()), None)


def _load_run(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(summary.json, config.json or {})`` of an evaluation folder."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; expected a kvbits eval output folder")
    if not (folder / "summary.json").is_file():
        other = other_run_kind(folder)
        hint = {
            "needle": " (it holds a kvbits needle run: needle runs merge with each other, "
            "kvbits.report.merge_needle.merge_needle_runs)",
            "speed": " (it holds a kvbits speed run: speed runs merge with each other, "
            "kvbits.report.merge_speed.merge_speed_runs)",
        }.get(other or "", "")
        raise FileNotFoundError(f"no summary.json in {folder}; expected a kvbits eval output folder{hint}")
    summary = read_json(folder / "summary.json")
    if (
        not isinstance(summary, dict)
        or not isinstance(summary.get("results"), list)
        or not summary["results"]
    ):
        raise ValueError(f"{folder / 'summary.json'} holds no scheme results; nothing to merge")
    RunSummary.parse(summary, folder / "summary.json")  # a malformed field: ValueError naming it, not a KeyError
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    return summary, config if isinstance(config, dict) else {}


def _reference_buckets(summary: Mapping[str, Any]) -> dict[tuple[int, int], float]:
    """``(lo, hi) -> reference perplexity`` of a run, from its first result (all share the reference): each
    position bucket, and the whole window as ``(0, -1)``."""
    first = summary["results"][0]
    out = {}
    try:
        out[(0, -1)] = float(first["ppl_ref"])  # the whole window
    except (KeyError, TypeError, ValueError):
        pass
    for b in first.get("buckets") or ():
        try:
            out[(int(b["lo"]), int(b["hi"]))] = float(b["ppl_ref"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _spans(ref: Mapping[tuple[int, int], float]) -> list[tuple[int, int]]:
    return sorted(k for k in ref if k != (0, -1))


def _rel_diff(a: float, b: float) -> float:
    """``|b / a - 1|``; 0 when both are the same non-finite value, inf when only one is finite or ``a <= 0``."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else math.inf
    return abs(b / a - 1) if a > 0 else (0.0 if a == b else math.inf)


def check_run_folders(runs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The run folders as paths; ``ValueError`` for fewer than two or one named twice."""
    folders = [Path(r) for r in runs]
    if len(folders) < 2:
        raise ValueError(f"merging needs at least two run folders, got {len(folders)}")
    if len({f.resolve() for f in folders}) != len(folders):
        raise ValueError("the same run folder is named twice")
    return folders


def refuse_out_among(out: Path, folders: Sequence[Path]) -> None:
    """``ValueError`` when the merged report would be written into one of the runs being merged."""
    if out.resolve() in {f.resolve() for f in folders}:
        raise ValueError(
            f"--out {out} is one of the runs being merged; write the merged report to a new folder"
        )


def json_run_meta(
    names: Sequence[str], summaries: Sequence[Mapping[str, Any]], measured: Callable[[Mapping[str, Any]], dict]
) -> dict[str, Any]:
    """The bookkeeping of a merged needle or speed summary: summed ``wall_seconds``, the largest
    ``peak_rss_bytes``, the latest ``date``, ``commit`` and ``versions`` where all runs agree (else None),
    ``merged_from`` (each run's folder, ``measured(summary)``, date, commit, versions) and ``merge_date``."""

    def common(key: str) -> Any:
        values = [s.get(key) for s in summaries]
        return values[0] if all(v == values[0] for v in values) else None

    dates = [str(s["date"]) for s in summaries if s.get("date")]
    return {
        "wall_seconds": sum(float(s.get("wall_seconds") or 0.0) for s in summaries),
        "peak_rss_bytes": _max_field(summaries, "peak_rss_bytes"),
        "date": max(dates) if dates else None,
        "commit": common("commit"),
        "versions": common("versions"),
        "merged_from": [
            {"path": name, **measured(s), **{k: s.get(k) for k in ("date", "commit", "versions")}}
            for name, s in zip(names, summaries)
        ],
        "merge_date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json_merge(
    merged: Mapping[str, Any], out: Path, folders: Sequence[Path], kind: str, files: Sequence[str],
    write: Callable[..., Path], *, overwrite: bool,
) -> Path:  # fmt: skip
    """Write a merged needle or speed summary with ``write`` into ``out``: refused when ``out`` is one of the
    runs, or holds a run of its own (not an earlier merge) and ``overwrite`` is not given."""
    refuse_out_among(out, folders)
    existing = out / files[0]
    if existing.is_file() and not overwrite:
        previous = read_json(existing)
        if not (isinstance(previous, dict) and isinstance(previous.get("merged_from"), list)):
            raise ValueError(
                f"--out {out} holds a kvbits {kind} run of its own, not a merged one; choose another folder or "
                f"pass --overwrite (only {', '.join(files)} would be replaced)"
            )
    return write(merged, out, overwrite=overwrite)


def check_same(
    first_name: object, first: Mapping[str, Any], name: object, summary: Mapping[str, Any], keys: Sequence[str],
    hint: str = "", *, recorded_only: bool = False,
) -> None:  # fmt: skip
    """``ValueError`` naming the field and both runs (then ``hint``) unless the summaries agree on ``keys``;
    ``recorded_only``: a key either leaves unrecorded (None: a run from before the field, or the model's own
    default) is not compared."""
    for key in keys:
        a, b = first.get(key), summary.get(key)
        if a != b and not (recorded_only and (a is None or b is None)):
            raise ValueError(
                f"runs differ in {key}: {a!r} in {first_name}, {b!r} in {name}" + (f"; {hint}" if hint else "")
            )


def load_json_run(folder: Path, kind: str, ok: Callable[[Any], bool], empty: str) -> dict[str, Any]:
    """The ``<kind>.json`` summary of a ``kvbits needle`` / ``speed`` folder: ``FileNotFoundError`` without one,
    ``ValueError`` (``"<path> holds <empty>"``) unless ``ok(summary)``."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; expected a kvbits {kind} output folder")
    path = folder / f"{kind}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no {kind}.json in {folder}; expected a kvbits {kind} output folder")
    summary = read_json(path)
    if not (isinstance(summary, dict) and ok(summary)):
        raise ValueError(f"{path} holds {empty}; nothing to merge")
    return summary


def check_fingerprints(
    first_name: object, first: Mapping[str, Any], name: object, summary: Mapping[str, Any], command: str = "eval",
    keys: Sequence[str] = ("model", "tokens"),
) -> None:  # fmt: skip
    """``ValueError`` unless both run summaries record the same ``fingerprint`` entries ``keys`` (a speed run's
    prompts are fingerprinted per cell, so it checks the model only)."""
    for key in keys:
        a, b = ((s.get("fingerprint") or {}).get(key) for s in (first, summary))
        if not a or not b:
            raise ValueError(
                f"{first_name if not a else name} records no {key} fingerprint: kvbits can not tell that the runs "
                f"measured the same model on the same tokens (re-run it with a current kvbits {command})"
            )
        if a != b:
            what = "model weights" if key == "model" else "tokens (text, tokenizer or data file)"
            raise ValueError(f"runs differ in their {what}: {key} fingerprint {a} in {first_name}, {b} in {name}")


def _request(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """An evaluation folder's ``request`` (its settings, ``config.json``); a merged folder's is that of the runs it
    merged, which agreed on ``_REQUEST_SETTING`` when they were merged (``{}`` when none is recorded)."""
    if config.get("request"):
        return config["request"]
    merged = [src.get("config") or {} for src in config.get("merged_from") or []]
    return next((r for r in map(_request, merged) if r), {})


def _check_comparable(
    folders: Sequence[Path], summaries: Sequence[Mapping[str, Any]], configs: Sequence[Mapping[str, Any]]
) -> None:
    """``ValueError`` naming the field and the runs when the runs can not share one report."""
    first, first_dir = summaries[0], folders[0]
    for folder, summary, config in zip(folders[1:], summaries[1:], configs[1:]):
        check_same(first_dir, first, folder, summary, _SETTING, "only runs of the same model, text and setting share a report")
        check_fingerprints(first_dir, first, folder, summary)
        check_same(first_dir, _request(configs[0]), folder, _request(config), _REQUEST_SETTING, recorded_only=True)
        ref0, ref = _reference_buckets(first), _reference_buckets(summary)
        if not ref0 or not ref:
            raise ValueError(
                f"{first_dir if not ref0 else folder} records no reference perplexity: kvbits can not check that "
                "the runs measured against the same unquantized model"
            )
        if set(ref0) != set(ref):
            raise ValueError(
                f"runs have different position buckets ({_spans(ref0)} in {first_dir}, {_spans(ref)} in {folder})"
            )
        worst = max((_rel_diff(ref0[s], ref[s]) for s in ref0), default=0.0)
        if worst > REF_RTOL:
            raise ValueError(
                f"the unquantized reference differs between {first_dir} and {folder} by up to {worst:.3%} of a "
                f"bucket's perplexity (at most {REF_RTOL:.2%} allowed): the runs did not measure the same thing "
                "(another device, dtype or prompt length?); evaluate the schemes together instead"
            )
    seen: dict[str, Path] = {}
    for folder, summary in zip(folders, summaries):
        for r in summary["results"]:
            name = str(r.get("scheme"))
            if name in seen:
                raise ValueError(
                    f"scheme {name!r} is in both {seen[name]} and {folder}; a merged report holds each scheme once "
                    "(merge the runs without one of them)"
                )
            seen[name] = folder
    gens = [
        (folder, r["generation"]) for folder, s in zip(folders, summaries) for r in s["results"]
        if isinstance(r.get("generation"), Mapping)
    ]  # fmt: skip
    for folder, g in gens[1:]:
        for key in ("new_tokens", "prompt_tokens"):
            if g.get(key) != gens[0][1].get(key):
                raise ValueError(
                    f"greedy continuations differ in {key}: {gens[0][1].get(key)} in {gens[0][0]}, {g.get(key)} "
                    f"in {folder}"
                )


def _warn_mixed_kl(folders: Sequence[Path], configs: Sequence[Mapping[str, Any]]) -> None:
    """Log a warning when runs whose KL is from float32 log-probabilities (output version below
    ``KL_FLOAT64_VERSION``) are merged with float64 ones: allowed (the committed results are version 1), and the
    report says which schemes, but their small KLs do not compare."""
    sources = [s for folder, c in zip(folders, configs) for s in eval_sources(c, str(folder))]
    old = [s for s in sources if s.version is not None and s.version < KL_FLOAT64_VERSION]
    if old and any(s.version is not None and s.version >= KL_FLOAT64_VERSION for s in sources):
        logger.warning(
            "merging runs whose KL is from float32 log-probabilities (output version below %d: %s) with float64 ones; "
            "a KL below about 1e-5 is overstated by tens of percent in the former (the report says which schemes)",
            KL_FLOAT64_VERSION, ", ".join(s.path for s in old),
        )  # fmt: skip


def _generation_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``generations.jsonl``; ``ValueError`` naming the file and the line for one that is not
    JSON, not an object, or a reference row without its ``window`` (a whole number) and ``tokens`` (a list)."""
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)  # token ids and text: no numbers to read back
        except ValueError as exc:
            raise ValueError(f"{path}, line {i}, is not valid JSON ({exc}); was the run interrupted while writing "
                             "it?") from None  # fmt: skip
        json_object(row, f"{path}, line {i},", "a greedy continuation")
        if row.get("scheme") == "reference":
            try:
                field(row, "window", "whole")
                field(row, "tokens", "list")
            except ValueError as exc:
                raise ValueError(f"{path}, line {i}: {exc}") from None
        rows.append(row)
    return rows


def _generation_lines(folders: Sequence[Path]) -> list[str] | None:
    """``generations.jsonl`` of the merged runs: the reference rows once, then each run's scheme rows;
    ``ValueError`` when two runs' reference continuations differ; None when no run generated."""
    reference: dict[int, list[int]] | None = None
    ref_lines: list[str] = []
    scheme_lines: list[str] = []
    for folder in folders:
        path = folder / "generations.jsonl"
        if not path.is_file():
            continue
        rows = _generation_rows(path)
        ref = {int(r["window"]): list(r["tokens"]) for r in rows if r.get("scheme") == "reference"}
        if reference is None:
            reference = ref
            ref_lines = [dumps(r) + "\n" for r in rows if r.get("scheme") == "reference"]
        elif ref != reference:
            raise ValueError(
                f"the reference's greedy continuations in {folder} differ from those of the first run that "
                "generated: the runs' references are not the same"
            )
        scheme_lines += [dumps(r) + "\n" for r in rows if r.get("scheme") != "reference"]
    return None if reference is None else ref_lines + scheme_lines


def _check_out(out: Path, folders: Sequence[Path], overwrite: bool) -> None:
    refuse_out_among(out, folders)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite and not is_merged(load_config(out)):
        raise ValueError(
            f"--out {out} is a non-empty folder that holds no merged kvbits report; choose another folder or "
            f"pass --overwrite (only {', '.join(MERGED_FILES)}, tokens/ and the figures would be replaced)"
        )


def _ranks(summary: Mapping[str, Any]) -> int | None:
    """The ranks that evaluated a run (``world_size``; 1 for a run from before it was recorded); None for an earlier
    merge of runs of different rank counts."""
    k = summary.get("world_size")
    if k is None and isinstance(summary.get("merged_from"), list):
        return None
    return int(k) if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1


def _max_field(summaries: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [
        float(s[key]) for s in summaries if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])
    ]
    return max(vals) if vals else None


def merge_runs(
    runs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Merge two or more ``kvbits eval`` output folders into ``out_dir`` (then :func:`kvbits.report.write_report`).

    Args:
        runs: the evaluation folders, in the order their schemes should appear.
        out_dir: a new or empty folder, or one an earlier merge wrote (``overwrite`` for any other).
        overwrite: write into a non-empty folder; only the merged files are replaced.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileNotFoundError: a run folder without ``summary.json``.
        ValueError: fewer than two runs, runs that do not share the model, tokens, setting and reference
            (the message names the field and both folders), a scheme in two runs, or a bad ``out_dir``.
    """
    folders = check_run_folders(runs)
    loaded = [_load_run(f) for f in folders]
    summaries = [s for s, _ in loaded]
    configs = [c for _, c in loaded]
    for folder, config in zip(folders, configs):
        check_output_versions(config, folder)
    _check_comparable(folders, summaries, configs)
    _warn_mixed_kl(folders, configs)
    generations = _generation_lines(folders)
    out = Path(out_dir)
    _check_out(out, folders, overwrite)

    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens"
    if tokens.is_dir():
        for f in tokens.glob("*.safetensors"):
            f.unlink()
    for name in ("DONE", "records.jsonl", "generations.jsonl"):  # DONE: an eval run's, so eval never takes this
        (out / name).unlink(missing_ok=True)
    for folder, summary in zip(folders, summaries):
        for r in summary["results"]:
            src = folder / "tokens" / f"{r['scheme']}.safetensors"
            if src.is_file():
                tokens.mkdir(exist_ok=True)
                shutil.copy2(src, tokens / src.name)
    records = [folder / "records.jsonl" for folder in folders if (folder / "records.jsonl").is_file()]
    if records:
        write_text_atomic(out / "records.jsonl", "".join(p.read_text(encoding="utf-8") for p in records))
    if generations is not None:
        write_text_atomic(out / "generations.jsonl", "".join(generations))

    merged: dict[str, Any] = {k: v for k, v in summaries[0].items() if k != "results"}
    merged["results"] = [r for s in summaries for r in s["results"]]
    for key in ("peak_rss_bytes", "run_peak_rss_bytes", "peak_cuda_bytes"):  # the largest any run reached
        if key in merged or any(key in s for s in summaries):
            merged[key] = _max_field(summaries, key)
    if "wall_seconds" in merged:
        merged["wall_seconds"] = sum(float(s.get("wall_seconds") or 0.0) for s in summaries)
    sources = [
        {"path": str(f), "schemes": [str(r["scheme"]) for r in s["results"]], "config": c}
        for f, s, c in zip(folders, summaries, configs)
    ]
    ranks = [_ranks(s) for s in summaries]  # seconds are summed over each run's ranks: said per run where they differ
    merged["world_size"] = ranks[0] if len(set(ranks)) == 1 else None
    merged["merged_from"] = [
        {"path": src["path"], "schemes": src["schemes"], "world_size": k, "reference_seconds": s.get("reference_seconds")}
        for src, k, s in zip(sources, ranks, summaries)
    ]  # reference_seconds: each run made its own reference pass; the merged summary's is the first's
    config = {
        "version": 1,
        "merged_from": sources,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    write_text_atomic(out / "config.json", dumps(config, indent=2) + "\n")
    write_text_atomic(out / "summary.json", dumps(merged, indent=2) + "\n")
    logger.info("merged %d runs (%d schemes) into %s", len(folders), len(merged["results"]), out)
    return out

