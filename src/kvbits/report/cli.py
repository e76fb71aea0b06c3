"""``kvbits report``: write an evaluation folder's report again, or merge several evaluations of the same
model, text and setting into one report (thin wrapper over :func:`kvbits.report.write_report` and
:func:`kvbits.report.merge.merge_runs`; needle and speed folders: :mod:`kvbits.report.merge_needle`,
:mod:`kvbits.report.merge_speed`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from kvbits._json import dumps

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  kvbits report runs/smollm2-wp-8k                                  # report.md/.html again (after an upgrade)
  kvbits report runs/smollm2-wp-8k --threshold 0.5                  # judged against a 0.5 % ΔPPL budget
  kvbits report runs/qwen-4k runs/qwen-4k-hadamard --out runs/qwen-4k-all   # one report, both runs' schemes
  kvbits report runs/needle-smollm2                                 # a needle or speed run: report.md again
  kvbits report runs/needle-4k-16k runs/needle-32k --out runs/needle-all   # one passkey grid from needle runs
  kvbits report runs/speed-4k runs/speed-32k --out runs/speed-all          # one speed report from speed runs

Merging checks that the runs share the model and tokens (fingerprints), context, windows, semantics, mode,
dtype and prompt length, and the unquantized reference in every position bucket (within 0.01 %), and that
no scheme is in two runs; the merged folder keeps each run's config.json under merged_from. Needle runs merge
when they share the model and tokens, task, semantics and seed: trials both runs hold must be the same trials
with the same unquantized result, and every scheme must cover every trial of the merged grid. Speed runs
merge when they share the model, prompts' text, dtype, device and threads, steps and schemes; each
(context, batch) cell comes whole from one run (step times compare only within a run).
A run written in an output version newer than this kvbits reads is refused, naming both versions.
--json prints {"out", "merged_from", "files"}.
"""


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage such as 1 or 0.5, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a percentage > 0, got {text!r}")
    return value / 100


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="write an evaluation's report again, or merge several evaluations into one report",
        description="Write report.md, report.html and the figures of a kvbits eval folder again, or merge "
        "several kvbits eval folders of the same model, text and setting (checked, reference included) into a "
        "new folder with one report of all their schemes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN",
        help="kvbits eval output folder(s), or kvbits needle folders, or kvbits speed folders",
    )  # fmt: skip
    p.add_argument(
        "--out", metavar="DIR", help="with two or more runs: the folder for the merged run and report"
    )
    p.add_argument(
        "--overwrite", action="store_true",
        help="with two or more runs: merge into a non-empty --out folder that holds no merged report (only the merged "
        "files are replaced); refused with one run, whose report is always written again in place",
    )  # fmt: skip
    p.add_argument(
        "--threshold", type=_percent, default=None, metavar="PCT",
        help="ΔPPL budget in percent the verdict and tables judge against (default 1)",
    )  # fmt: skip
    p.add_argument("--no-plots", action="store_true", help="write no figures (those an earlier report drew in the folder are removed)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvbits.report import print_summary, write_report
    from kvbits.report.fmt import DEFAULT_THRESHOLD
    from kvbits.report.merge import merge_runs, other_run_kind

    threshold = args.threshold if args.threshold is not None else DEFAULT_THRESHOLD
    if len(args.runs) == 1:
        if args.out is not None:
            raise ValueError(
                "--out is for merging two or more runs; to write one run's report again, name the run alone"
            )
        if args.overwrite:  # it was accepted and did nothing: a run's report is always written again in place
            raise ValueError(
                "--overwrite is for merging two or more runs into a non-empty --out folder; one run's report is "
                "always written again in place (name the run alone)"
            )
        out = Path(args.runs[0])
        other = other_run_kind(out)
        if other is not None:
            return _rewrite_json_run(out, other, args)
        if not (out / "summary.json").is_file():
            raise FileNotFoundError(
                f"no summary.json in {out}; expected a kvbits eval output folder (or a kvbits needle / speed folder)"
            )
        merged_from: list[str] = []
    else:
        if args.out is None:
            raise ValueError(
                f"merging {len(args.runs)} runs needs --out DIR, a new folder for the merged report"
            )
        kinds = {other_run_kind(Path(r)) for r in args.runs}
        if kinds in ({"needle"}, {"speed"}):
            return _merge_json_runs(args, kinds.pop())
        if kinds != {None}:
            raise ValueError(
                "kvbits report merges kvbits eval folders with each other, kvbits needle folders with each "
                f"other, or kvbits speed folders with each other; these runs are of kinds "
                f"{sorted(k or 'eval' for k in kinds)}"
            )
        out = merge_runs(args.runs, args.out, overwrite=args.overwrite)
        merged_from = [str(Path(r)) for r in args.runs]
    files = write_report(out, threshold=threshold, plots=False if args.no_plots else None)
    if args.json:
        record = {"out": str(out), "merged_from": merged_from, "files": {k: str(v) for k, v in files.items()}}
        sys.stdout.write(dumps(record, indent=2) + "\n")
        return 0
    print_summary(out, threshold=threshold)
    print(f"report: {files['markdown']}, {files['html']}")
    return 0


def _merge_json_runs(args: argparse.Namespace, kind: str) -> int:
    """``kvbits report RUN1 RUN2 ... --out DIR`` for needle folders (one passkey grid) or speed folders (one
    decode-speed report)."""
    from pathlib import Path

    from kvbits.report.merge_needle import merge_needle_runs
    from kvbits.report.merge_speed import merge_speed_runs

    if args.threshold is not None or args.no_plots:
        raise ValueError(f"--threshold and --no-plots apply to kvbits eval runs; these are kvbits {kind} runs")
    merge = merge_needle_runs if kind == "needle" else merge_speed_runs
    out = merge(args.runs, args.out, overwrite=args.overwrite)
    return _print_json_run(out, kind, args, [str(Path(r)) for r in args.runs])


def _rewrite_json_run(out: Any, command: str, args: argparse.Namespace) -> int:
    """``report.md`` and the figure of a ``kvbits needle`` or ``kvbits speed`` folder, again from its JSON."""
    from kvbits.report.needle import load_needle, write_needle
    from kvbits.report.speed import load_speed, write_speed

    if args.threshold is not None or args.no_plots:
        raise ValueError(f"--threshold and --no-plots apply to kvbits eval runs; {out} holds a kvbits {command} run")
    path = out / f"{command}.json"
    # checked field by field before anything is written: a field missing or of another type is named, not a traceback
    summary = load_needle(path) if command == "needle" else load_speed(path)
    (write_needle if command == "needle" else write_speed)(summary, out)
    return _print_json_run(out, command, args, [])


def _print_json_run(out: Any, command: str, args: argparse.Namespace, merged_from: list[str]) -> int:
    """What a ``kvbits needle`` or ``speed`` folder's report holds: ``--json``'s record, or a ``report:`` line."""
    files = {"markdown": str(out / "report.md")}
    png = out / f"{command}.png"
    if png.is_file():
        files["figure"] = str(png)
    if args.json:
        sys.stdout.write(dumps({"out": str(out), "merged_from": merged_from, "files": files}, indent=2) + "\n")
    else:
        print(f"report: {', '.join(files.values())}")
    return 0
