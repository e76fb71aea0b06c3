"""Write the committed reports under ``benchmarks/results`` again, in place, from their committed JSON.

    PYTHONPATH=src python benchmarks/regen_reports.py            # every committed report (report.md, report.html)
    PYTHONPATH=src python benchmarks/regen_reports.py --check    # list the stale ones, write nothing (exit 1 if any)
    PYTHONPATH=src python benchmarks/regen_reports.py benchmarks/results/qwen-wiki-4k ...   # only these folders

Each folder holding a ``report.md`` beside a ``summary.json`` (a ``kvbits eval`` run), a ``needle.json`` or a
``speed.json`` gets its report rendered by the current renderer (:func:`kvbits.report.document.build_document`,
:func:`~kvbits.report.needle.needle_markdown`, :func:`~kvbits.report.speed.speed_markdown`), the same text
``kvbits report DIR`` writes, with these differences that keep it to the committed files:

- nothing is recomputed and no figure is drawn: the PNGs in the folder are linked (and embedded in ``report.html``)
  as they are; a figure the folder lacks is not linked (a report never points at a missing file);
- ``report.html`` is written only where one is committed;
- an eval run's per-token arrays (``tokens/``) are never committed, but most committed ``ppl_vs_position.png`` were
  drawn from them when the run was evaluated: the report says "No per-token arrays ... bucket means" only where
  its previous ``report.md`` said so (a merged folder, whose figures ``kvbits report --out`` drew from bucket means),
  so the caption keeps describing the committed figure. A local ``tokens/`` folder is ignored;
- a run from before ``summary.json`` recorded its calibration artifact names it from the calibration folder its
  ``config.json`` recorded (``runs/<name>``, not committed), looked up as ``benchmarks/results/<name>`` (same sha256);
  where that is not committed either, the report, which holds what the folder said, is kept and named.

Reports are rendered with the default 1 % ΔPPL budget (every committed report uses it). The folder path in a
report (a merged run's ``kvbits report ... --out`` line) is the folder relative to the repository root.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NO_TOKENS_LINE = "*No per-token arrays in `tokens/`"

__all__ = ["committed_reports", "main", "number_changes", "render"]

# a number as a report prints it: sign, digits with thousands commas, decimals, exponent, percent or ×
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?[%×x]?")


def committed_reports(root: Path = RESULTS) -> list[Path]:
    """The folders under ``root`` that hold a ``report.md`` and the JSON it is rendered from, sorted."""
    return sorted(
        d for d in root.iterdir()
        if (d / "report.md").is_file() and any((d / n).is_file() for n in ("summary.json", "needle.json", "speed.json"))
    )  # fmt: skip


def _shown(folder: Path) -> Path:
    """``folder`` as a report names it: relative to the repository root when inside it."""
    try:
        return folder.resolve().relative_to(REPO)
    except ValueError:
        return folder


class NotFromCommittedFiles(Exception):
    """A report that needs a file the repository does not hold (it is kept as it is)."""


def _committed_calibration(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each recorded calibration folder (``args.calibration``, of every merged run too) that is not
    there (``runs/<name>``, where the run was evaluated) replaced by ``benchmarks/results/<name>`` where that is
    committed: runs that predate the artifact record in ``summary.json`` name their artifact from its folder's
    ``calibration.json`` (the renderer checks its sha256 against the one the run recorded)."""
    config = dict(config)
    args = config.get("args")
    if isinstance(args, dict) and isinstance(args.get("calibration"), list):
        paths = [str(p) for p in args["calibration"]]
        committed = [RESULTS / Path(p).name for p in paths]
        args = dict(args, calibration=[
            str(_shown(c)) if not Path(p).exists() and (c / "calibration.json").is_file() else p
            for p, c in zip(paths, committed)
        ])  # fmt: skip
        config["args"] = args
    if isinstance(config.get("merged_from"), list):
        config["merged_from"] = [
            dict(s, config=_committed_calibration(s["config"])) if isinstance(s, dict) and isinstance(s.get("config"), dict) else s
            for s in config["merged_from"]
        ]  # fmt: skip
    return config


def _render_eval(folder: Path) -> dict[str, str]:
    from kvbits.report.calibration import _artifact_from_folder, _config_calibration
    from kvbits.report.document import Heading, build_document
    from kvbits.report.fmt import DEFAULT_THRESHOLD
    from kvbits.report.html_page import to_html
    from kvbits.report.inputs import load_config
    from kvbits.report.markdown import to_markdown
    from kvbits.report.plots import PLOT_FILES
    from kvbits.report.summary import RunSummary

    out = _shown(folder)
    run = RunSummary.load(folder)
    config = _committed_calibration(load_config(folder))
    ids, paths = _config_calibration(config)  # a run from before summary.json recorded the artifact: its folder
    missing = [
        r.name for r in run.results
        if r.name in ids and not isinstance(r.calibration.get("artifact"), dict)
        and _artifact_from_folder(paths, r.name, ids[r.name]) is None
    ]  # fmt: skip
    if missing:
        raise NotFromCommittedFiles(
            f"{_shown(folder)}: the calibration of {', '.join(missing)} is recorded in neither summary.json nor a "
            "committed calibration folder (its report names what the run's folder held)"
        )
    figures = {key: folder / f"{key}.png" for key in PLOT_FILES if (folder / f"{key}.png").is_file()}
    # the committed ppl_vs_position.png was drawn from per-token arrays unless the last report said otherwise
    previous = (folder / "report.md").read_text(encoding="utf-8")
    has_tokens = NO_TOKENS_LINE not in previous
    blocks = build_document(run, config, figures, {}, "", DEFAULT_THRESHOLD, out, has_tokens)
    texts = {"report.md": to_markdown(blocks, folder)}  # figures linked relative to the folder
    if (folder / "report.html").is_file():
        title = blocks[0].text if isinstance(blocks[0], Heading) else "kvbits report"
        texts["report.html"] = to_html(blocks, title)
    return texts


def render(folder: Path) -> dict[str, str]:
    """``{file name: text}`` of ``folder``'s report as rendered now from its committed JSON (see the module's
    docstring); ``report.html`` only where the folder has one. Nothing is written."""
    from kvbits.report.merge import other_run_kind
    from kvbits.report.needle import load_needle, needle_markdown
    from kvbits.report.speed import load_speed, speed_markdown

    kind = other_run_kind(folder)
    if kind is None:
        if not (folder / "summary.json").is_file():
            raise FileNotFoundError(f"{folder}: expected summary.json, needle.json or speed.json beside report.md")
        return _render_eval(folder)
    load, markdown = (load_needle, needle_markdown) if kind == "needle" else (load_speed, speed_markdown)
    summary = load(folder / f"{kind}.json")
    return {"report.md": markdown(summary, figure=(folder / f"{kind}.png").is_file())}


def number_changes(old: str, new: str) -> tuple[Counter[str], Counter[str]]:
    """``(removed, added)``: the numbers (:data:`_NUMBER`, counted) of ``old`` that ``new`` lacks, and those of
    ``new`` that ``old`` lacks; both empty when a report changed only in wording or layout."""
    before, after = Counter(_NUMBER.findall(old)), Counter(_NUMBER.findall(new))
    return before - after, after - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", type=Path, help="result folders (default: every committed report)")
    p.add_argument("--check", action="store_true", help="write nothing; list stale reports and exit 1 if any")
    p.add_argument("--numbers", action="store_true",
                   help="for each stale report.md, list the numbers the new text drops or adds (none: wording only)")
    args = p.parse_args(argv)
    folders = args.folders or committed_reports()
    stale = []
    kept = []
    for folder in folders:
        try:
            texts = render(folder)
        except NotFromCommittedFiles as exc:
            kept.append(str(exc))
            continue
        for name, text in texts.items():
            path = folder / name
            if path.read_text(encoding="utf-8") == text:
                continue
            stale.append(path)
            if args.numbers and name == "report.md":
                removed, added = number_changes(path.read_text(encoding="utf-8"), text)
                if removed or added:
                    print(f"{_shown(path)}: numbers removed {sorted(removed.elements())}, added {sorted(added.elements())}")
            if not args.check:
                path.write_text(text, encoding="utf-8")
    verb = "stale" if args.check else "written again"
    for why in kept:
        print(f"kept as committed: {why}")
    print(f"{len(stale)} of the reports of {len(folders)} folders {verb}" + "".join(f"\n  {_shown(p)}" for p in stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
