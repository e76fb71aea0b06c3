"""What a report reads from a run folder besides ``summary.json``, and what it derives from it.

Input (written by :mod:`kvbits.evaluate.runner`)::

    DIR/config.json                    optional: run arguments, versions, commit, date
    DIR/tokens/<scheme>.safetensors    optional: per-token nll, nll_ref, kl, top1, shape (W, T-1)

:func:`run_commit` and :func:`reproduce_command` turn ``config.json`` into the report's commit line
and the command line that re-runs the evaluation.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbits._json import loads
from kvbits.report.summary import RunSummary

logger = logging.getLogger(__name__)

__all__ = [
    "KL_FLOAT64_VERSION",
    "READS_VERSION",
    "EvalSource",
    "check_output_versions",
    "eval_sources",
    "float32_kl_sources",
    "load_config",
    "load_token_arrays",
    "reproduce_command",
    "run_commit",
]

KL_FLOAT64_VERSION = 2
"""The first ``kvbits eval`` output version (``config.json["version"]``, ``OUTPUT_VERSION``) whose KL comes from
float64 log-probabilities; version 1 took them in float32, which overstates a KL below about 1e-5 by tens of percent
per token (the committed ``benchmarks/results`` are version 1)."""

READS_VERSION = 2
"""The newest ``kvbits eval`` output version (``OUTPUT_VERSION`` of :mod:`kvbits.evaluate.request`, not imported here:
it pulls in torch) this report reads; a run of a newer one is refused (:func:`check_output_versions`)."""


@dataclass(frozen=True)
class EvalSource:
    """One ``kvbits eval`` run behind a report: its folder (``""`` for the report's own), its schemes (None: all of
    the report's) and its output version (None where ``config.json`` records none)."""

    path: str
    schemes: tuple[str, ...] | None
    version: int | None


def _output_version(config: Mapping[str, Any]) -> int | None:
    request = config.get("request") if isinstance(config.get("request"), Mapping) else {}
    for v in (config.get("version"), request.get("version")):
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


def eval_sources(config: Mapping[str, Any], path: str = "") -> list[EvalSource]:
    """The evaluations behind a folder's ``config.json``: the run itself, or each run a merged folder
    (``merged_from``, :mod:`kvbits.report.merge`) was made from, those of a merge merged again included. A merged
    folder's own ``version`` is that of its config format, not an output version: it is not read."""
    sources = config.get("merged_from")
    if not isinstance(sources, list):
        return [EvalSource(path, None, _output_version(config))]
    out = []
    for src in sources:
        if not isinstance(src, Mapping):
            continue
        cfg = src.get("config") if isinstance(src.get("config"), Mapping) else {}
        name = str(src.get("path", "?"))
        if isinstance(cfg.get("merged_from"), list):
            out += eval_sources(cfg, name)
        else:
            out.append(EvalSource(name, tuple(str(x) for x in src.get("schemes") or ()), _output_version(cfg)))
    return out


def float32_kl_sources(config: Mapping[str, Any]) -> tuple[list[EvalSource], bool]:
    """The runs behind a report whose KL is from float32 log-probabilities (output version below
    :data:`KL_FLOAT64_VERSION`), and whether every run behind it is such a run (a version not recorded counts as
    neither: ``False`` then)."""
    sources = eval_sources(config)
    old = [s for s in sources if s.version is not None and s.version < KL_FLOAT64_VERSION]
    return old, bool(old) and len(old) == len(sources)


def check_output_versions(config: Mapping[str, Any], where: str | Path) -> None:
    """``ValueError`` when a run behind ``config`` (its own, or each of a merged folder's, :func:`eval_sources`)
    records an output version newer than :data:`READS_VERSION`: a newer kvbits wrote it, in a format this one would
    read as its own. ``where``: the folder, for the message."""
    newer = [s for s in eval_sources(config) if s.version is not None and s.version > READS_VERSION]
    if newer:
        runs = ", ".join(f"{s.path or where} (version {s.version})" for s in newer)
        raise ValueError(
            f"{where}: kvbits eval output version {max(s.version or 0 for s in newer)} is newer than this kvbits reads "
            f"(output version {READS_VERSION}): {runs}; a newer kvbits wrote it: upgrade kvbits to report it"
        )


def load_config(out_dir: str | Path) -> dict[str, Any]:
    """``DIR/config.json`` as a dict, or ``{}`` when it is missing or unreadable (logged)."""
    p = Path(out_dir) / "config.json"
    if not p.is_file():
        return {}
    try:
        data = loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", p, exc)
        return {}
    return data if isinstance(data, dict) else {}


def load_token_arrays(out_dir: str | Path, schemes: list[str]) -> dict[str, dict[str, Any]]:
    """Per-token arrays of each scheme from ``DIR/tokens/<scheme>.safetensors`` (numpy, no torch).

    Schemes without a file, and unreadable files (logged), are simply absent from the result.
    """
    tok_dir = Path(out_dir) / "tokens"
    if not tok_dir.is_dir():
        return {}
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    out: dict[str, dict[str, Any]] = {}
    for name in schemes:
        p = tok_dir / f"{name}.safetensors"
        if not p.is_file():
            continue
        try:
            out[name] = dict(load_file(str(p)))
        except (OSError, SafetensorError) as exc:  # an optional file: skip it, keep the report
            logger.warning("ignoring unreadable per-token file %s: %s", p, exc)
    return out


def _args(config: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("args", "arguments", "run", "params"):
        if isinstance(config.get(key), Mapping):
            return config[key]
    return {}


def run_commit(config: Mapping[str, Any]) -> str:
    """The commit ``config.json`` records (``sha``, `` (dirty tree)`` when it was dirty), or ``""``."""
    c = config.get("commit") or config.get("git_commit") or ""
    if isinstance(c, Mapping):
        sha = str(c.get("sha") or c.get("hash") or c.get("commit") or "")
        return sha + (" (dirty tree)" if c.get("dirty") else "")
    return str(c)


# `kvbits eval --scheme A --scheme B --calibration X --calibration Y` (action="append")
_REPEATED_FLAGS = {"schemes": "--scheme", "scheme": "--scheme", "calibration": "--calibration"}


def reproduce_command(config: Mapping[str, Any], run: RunSummary, out_dir: str | Path | None = None) -> str:
    """The command line that re-runs this evaluation, from ``config.json``.

    Uses the recorded command line (``argv``, or ``command``) when there is one; otherwise (a run
    started from Python) rebuilds ``kvbits eval --flag value ...`` from the recorded arguments, or
    from the summary itself when ``config.json`` is missing. ``--out`` is the report's folder.
    """
    cmd = config.get("command")
    if isinstance(cmd, str) and cmd.strip():
        return cmd.strip()
    argv = config.get("argv") if isinstance(config.get("argv"), list) else cmd if isinstance(cmd, list) else None
    if argv:
        argv = [str(a) for a in argv]
        if Path(argv[0]).name in ("kvbits", "__main__.py", "cli.py", "python", "python3"):
            argv = argv[1:]
        return shlex.join(["kvbits", *argv])
    args = dict(_args(config))
    if not args:
        args = {
            "model": run.model, "data": run.data, "context": run.context, "windows": run.windows,
            "schemes": [r.name for r in run.results], "mode": run.mode, "semantics": run.semantics,
        }
    if out_dir is not None and "out" not in args and "out_dir" not in args:
        args["out"] = str(out_dir)
    parts = ["kvbits", "eval"]
    for key, value in args.items():
        if key in _REPEATED_FLAGS and isinstance(value, (list, tuple)):
            for v in value:
                parts += [_REPEATED_FLAGS[key], str(v)]
            continue
        flag = "--" + ("out" if key == "out_dir" else str(key)).replace("_", "-")
        if value is None or value is False or isinstance(value, Mapping):
            continue  # unset, off, or nested settings without a flag form
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts += [flag, *(str(v) for v in value)]  # an empty list is the bare flag ("none")
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)
