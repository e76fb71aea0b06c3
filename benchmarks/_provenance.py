"""Where a benchmark result came from: the commit and the host, written beside the figures."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from kvbits._json import dumps


def commit() -> str:
    """``$KVBITS_COMMIT`` when set (``device_run.sh`` sets it from its argument: the device's copy of the tree has
    no ``.git``), else the short hash of HEAD (``"unknown"`` outside a git checkout)."""
    if os.environ.get("KVBITS_COMMIT"):
        return os.environ["KVBITS_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def host() -> str:
    """``"x86_64 2 threads, torch 2.13.0+cpu"``."""
    return f"{platform.processor() or platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"


def write_results(
    path: str | Path, args: argparse.Namespace, models: list[dict], rev: str | None = None
) -> None:
    """``{"date", "commit", "host", "args", "models"}`` as JSON at ``path`` (folders created); ``rev``:
    the commit the run started at (default HEAD now: take it before a long run, HEAD may move)."""
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": rev or commit(),
        "host": host(),
        "args": vars(args),
        "models": models,
    }
    write_json(path, out)


def write_json(path: str | Path, obj: object) -> None:
    """``obj`` as indented JSON at ``path`` (folders created), atomically: written to a temporary file beside it,
    then renamed over it. The device run's scripts rewrite their JSON after every step and are killed by
    ``timeout`` when they overrun; a kill during a plain ``write_text`` left the file truncated (the figures of
    every earlier step lost with it), a kill now leaves the previous complete version. Strict JSON
    (``kvbits._json.dumps``, as kvbits writes its own): a non-finite float (the ``inf`` gap of a check whose output
    held NaN, a NaN ``max_diff_vs_default``) is the string ``"NaN"`` / ``"+Inf"`` / ``"-Inf"``, not a bare token
    that jq and ``JSON.parse`` reject."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(dumps(obj, indent=1) + "\n")
        os.replace(tmp, path)
    finally:  # an exception mid-write leaves no stray file in $OUT (a device call returns at most 8 files)
        tmp.unlink(missing_ok=True)
