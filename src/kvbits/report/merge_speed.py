"""Several ``kvbits speed`` folders of the same model, machine and setting as one decode-speed report.

Long contexts take long on a CPU, so they are often timed apart from the short ones (or another batch
later). ``kvbits report A B --out C`` (with speed folders) puts them in one report. A step time is only
comparable with times taken in the same run: a shared machine's speed drifts between runs (this project's
VM by up to 1.4x in one session). So a (context, batch) cell is merged whole, from one run: its
``DynamicCache`` baseline and every scheme timed together, its speed-up against its own baseline. Before
it writes anything the merge checks:

- the same summary version, model (fingerprint), prompts' text, dtype, device (type, name, threads),
  BOS choice (``bos``; ``never`` before it was recorded), layers, timed and warm-up steps, fused-decode,
  workspace and reservation setting (a run from before
  ``reserve`` existed counts as growing), static caches and CUDA graphs (``static``, ``graphs``; off before
  they existed), SDPA's backends (``sdpa``; ``auto`` before it was recorded), and
  decode-kernel settings (``KVBITS_KERNEL``, ``KVBITS_DEQUANT``,
  ``KVBITS_AUTOTUNE``; a run from before they were recorded counts as the defaults);
- the same schemes in every run (name, average bits, peer or not, decode path), in the same order;
- every (context, batch) cell in one run only.

Contexts and batches are the union of the runs'; a cell no run timed reads ``n/a``. Seconds are summed,
the peak RSS is the largest; ``merged_from`` lists each run's folder, contexts, batches, date, commit and
versions.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbits.report.merge import (
    check_fingerprints,
    check_run_folders,
    check_same,
    json_run_meta,
    load_json_run,
    write_json_merge,
)

logger = logging.getLogger(__name__)

__all__ = ["merge_speed", "merge_speed_runs"]

_SAME = ("version", "model", "data", "dtype", "device", "layers", "tokens", "warmup", "fused_decode", "workspace",
         "reserve", "static", "graphs", "sdpa", "kernel_settings")
_SCHEME = ("scheme", "peer", "path")


def _load(folder: Path) -> dict[str, Any]:
    """A folder's ``speed.json``, checked field by field (:func:`kvbits.report.speed.check_speed`)."""
    from kvbits.report.speed import check_speed

    summary = load_json_run(
        folder, "speed", lambda s: isinstance(s.get("runs"), list) and bool(s["runs"])
        and isinstance(s.get("schemes"), list), "no timed runs",
    )  # fmt: skip
    check_speed(summary, folder / "speed.json")
    summary.setdefault("reserve", False)  # runs from before the option: growing caches
    summary.setdefault("sdpa", "auto")  # runs from before the option: torch's choice of SDPA backend
    summary.setdefault("static", False)  # runs from before the options: QuantizedKVCache, no graphs
    summary.setdefault("graphs", False)
    summary.setdefault("baselines", ["DynamicCache"])
    from kvbits.kernels.dispatch import DEFAULT_SETTINGS

    summary.setdefault("kernel_settings", dict(DEFAULT_SETTINGS))  # runs from before the field: the defaults
    return summary


def _check_setting(names: Sequence[str], summaries: Sequence[Mapping[str, Any]]) -> None:
    first = summaries[0]
    for name, s in zip(names[1:], summaries[1:]):
        check_same(names[0], first, name, s, _SAME, "only speed runs of the same model, prompts, machine and setting "
                   "share a report (step times from other settings do not compare)")  # fmt: skip
        check_fingerprints(names[0], first, name, s, "speed", keys=("model",))
        if first.get("bos", "never") != s.get("bos", "never"):  # a record without "bos": raw slices (before --bos)
            raise ValueError(
                f"runs differ in their bos: {first.get('bos', 'never')} in {names[0]}, {s.get('bos', 'never')} in "
                f"{name}: prompts that start with the BOS are other prompts; merge runs with the same --bos"
            )
        a, b = ([{k: x.get(k) for k in _SCHEME} for x in t["schemes"]] for t in (first, s))
        bits_a, bits_b = ([x.get("avg_bits") for x in t["schemes"]] for t in (first, s))
        same_bits = len(bits_a) == len(bits_b) and all(
            (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9))
            for x, y in zip(bits_a, bits_b)
        )
        if a != b or not same_bits:
            raise ValueError(
                f"runs timed other schemes: {[x['scheme'] for x in a]} in {names[0]}, {[x['scheme'] for x in b]} "
                f"in {name} (or the same names with other bits or decode paths); a merged report holds the same "
                "caches in every cell: time the same schemes"
            )


def _cells(names: Sequence[str], summaries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every run's timed runs, each (context, batch) cell from one run only."""
    owner: dict[tuple[int, int], str] = {}
    runs = []
    for name, s in zip(names, summaries):
        mine = {(int(r["context"]), int(r["batch"])) for r in s["runs"]}
        for cell in sorted(mine):
            if cell in owner:
                raise ValueError(
                    f"context {cell[0]} x batch {cell[1]} was timed in both {owner[cell]} and {name}; a merged "
                    "report takes each cell's baseline and schemes from one run (their times compare only "
                    "with each other): merge without one of them"
                )
            owner[cell] = name
        runs += [dict(r) for r in s["runs"]]
    return sorted(runs, key=lambda r: (int(r["batch"]), int(r["context"])))


def merge_speed(summaries: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One ``kvbits speed`` summary from several (module docstring); ``names`` label the runs in errors and
    in ``merged_from`` (default ``run 1``, ``run 2``, ...). ``ValueError`` when they can not merge."""
    names = list(names) if names is not None else [f"run {i + 1}" for i in range(len(summaries))]
    if len(summaries) < 2 or len(names) != len(summaries):
        raise ValueError(f"merging needs two or more speed summaries (and a name each), got {len(summaries)}")
    _check_setting(names, summaries)
    runs = _cells(names, summaries)
    first = summaries[0]
    longest = max(summaries, key=lambda s: max(int(c) for c in s["contexts"]))  # calibration mismatch there

    prompts: dict[str, Any] = {}
    for s in summaries:
        prompts.update((s.get("fingerprint") or {}).get("prompts") or {})
    return {
        **{k: first[k] for k in _SAME if k in first},
        **{k: first[k] for k in ("bos", "bos_token", "bos_token_id") if k in first},  # the report's Prompts line
        "baselines": list(first.get("baselines") or ["DynamicCache"]),
        "contexts": sorted({int(r["context"]) for r in runs}),
        "batches": sorted({int(r["batch"]) for r in runs}),
        "schemes": [dict(x) for x in longest["schemes"]],
        "tuned_launches": {k: v for s in summaries for k, v in (s.get("tuned_launches") or {}).items()},
        "runs": runs,
        "fingerprint": {"model": first["fingerprint"]["model"], "prompts": prompts},
        **json_run_meta(names, summaries, lambda s: {k: s.get(k) for k in ("contexts", "batches")}),
    }


def merge_speed_runs(
    runs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Merge two or more ``kvbits speed`` folders into ``out_dir`` (``speed.json``, ``report.md``, the figure).

    Args:
        runs: the speed folders.
        out_dir: a new or empty folder, or one an earlier merge wrote (``overwrite``: any other; only the
            speed files are replaced).

    Raises:
        FileNotFoundError: a folder without ``speed.json``.
        ValueError: fewer than two runs, runs that can not share one report (module docstring; the message
            names the field or the cell and both folders), or a bad ``out_dir``.
    """
    from kvbits.report.speed import SPEED_FILES, write_speed

    folders = check_run_folders(runs)
    summaries = [_load(f) for f in folders]
    merged = merge_speed(summaries, [str(f) for f in folders])
    out = write_json_merge(merged, Path(out_dir), folders, "speed", SPEED_FILES, write_speed, overwrite=overwrite)
    logger.info("merged %d speed runs (%d timed runs) into %s", len(folders), len(merged["runs"]), out)
    return out
