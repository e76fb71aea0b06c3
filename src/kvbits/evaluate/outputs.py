"""An evaluation's output folder::

    DIR/config.json                 arguments, fingerprints, versions, git commit, date, config_hash
    DIR/summary.json                the summary
    DIR/records.jsonl               one line per scheme x window x bucket: sums of nll, nll_ref, kl, top1
    DIR/tokens/<scheme>.safetensors per-token nll, nll_ref, kl, top1, float32 (W, T - 1)
    DIR/generations.jsonl           with generate=N: one line per window x continuation (reference, schemes)
    DIR/DONE                        the config hash, written last

then the report (``kvbits.report.write_report``). A folder whose ``DONE`` holds this run's config hash
is reused, unless its ``config.json`` records another kvbits version (``versions.kvbits``: the quantizers
may have changed since; recomputed, logged); a folder written by another configuration is refused unless overwritten, and so is a
non-empty folder kvbits eval did not write. Only files kvbits eval writes are ever deleted, and only
once the run's inputs have loaded.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbits._files import atomic_path, write_text_atomic
from kvbits._json import dumps, loads
from kvbits._spelling import spell
from kvbits.evaluate.metrics import TOKEN_FIELDS
from kvbits.evaluate.request import OUTPUT_VERSION

logger = logging.getLogger(__name__)

__all__ = ["OtherRunError"]


class OtherRunError(ValueError):
    """The output folder holds a kvbits eval run of another configuration (``overwrite`` replaces it);
    ``differs``: the request fields that differ (empty when the stored run does not say)."""

    def __init__(self, message: str, differs: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.differs = list(differs)


def _git_commit() -> dict[str, Any] | None:
    """The kvbits checkout's HEAD and whether tracked files differ, or None for an installed package (not in
    ``<checkout>/src/kvbits``): there ``git`` would name the commit of whatever repository holds the environment."""
    here = Path(__file__).resolve()
    root = here.parents[3]
    if here.parents[2] != root / "src" or not (root / "pyproject.toml").is_file():
        return None
    try:
        run = {"cwd": root, "capture_output": True, "text": True, "timeout": 10}
        sha = subprocess.run(["git", "rev-parse", "HEAD"], check=False, **run)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, **run)
        return {"sha": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    import transformers

    from kvbits import __version__

    return {"kvbits": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _stored_kvbits_version(stored: Any) -> str | None:
    """The kvbits version a stored ``config.json`` records (``versions.kvbits``), or None where it records none."""
    versions = stored.get("versions") if isinstance(stored, dict) else None
    version = versions.get("kvbits") if isinstance(versions, dict) else None
    return version if isinstance(version, str) else None


def _read_done(path: Path) -> str | None:
    """The config hash a ``DONE`` file holds, or None when it can not be read as text (a corrupt file)."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


_RUN_FILES = (
    "DONE", "summary.json", "records.jsonl", "generations.jsonl", "config.json", "report.md", "report.html",
)


def _report_files() -> tuple[str, ...]:
    """The files ``kvbits.report.write_report`` writes in an evaluation folder: the report and its figures."""
    try:
        from kvbits.report.plots import PLOT_FILES
    except ImportError:  # no report module: no figures of it either
        return ("report.md", "report.html")
    return ("report.md", "report.html", *(f"{key}.png" for key in PLOT_FILES))


def _is_run_folder(out: Path, stored: Any) -> bool:
    """Whether ``out`` was written by ``kvbits eval``: a ``config.json`` of ours, or a ``DONE``."""
    ours = isinstance(stored, dict) and isinstance(stored.get("config_hash"), str) and "request" in stored
    return ours or (out / "DONE").is_file()


def _differences(old: Any, new: dict[str, Any]) -> list[str]:
    """The request fields in which a stored run differs from this one (for the refusal message)."""
    if not isinstance(old, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _older_version(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a stored request's output ``version`` is a whole number below this run's (a newer one is refused)."""
    v, ours = old.get("version"), new.get("version")
    return all(isinstance(x, int) and not isinstance(x, bool) for x in (v, ours)) and v < ours


def _check_out_dir(
    out: Path, chash: str, overwrite: bool, request: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The stored summary when ``out`` holds a finished run of this config, else None once the run may
    write there. Deletes nothing: :func:`_prepare_out_dir` clears the old run after the inputs loaded.

    A finished run whose request differs only in an older output ``version`` (``OUTPUT_VERSION``: numbers
    computed differently since) is not reused: None, so the run recomputes it there (logged); nor is a finished
    run of this config hash whose ``config.json`` records another kvbits version (``versions.kvbits``; logged).

    Refused (``ValueError``): a path that is not a folder; a folder holding another kvbits eval run
    (unless ``overwrite``); a non-empty folder that kvbits eval did not write (unless ``overwrite``,
    which replaces only the files kvbits eval writes and keeps everything else).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a folder")
    if not out.is_dir():
        return None
    cfg_path, done = out / "config.json", out / "DONE"
    stored = _read_json(cfg_path) if cfg_path.is_file() else None
    if not _is_run_folder(out, stored):
        present = sorted(p.name for p in out.iterdir())
        if present and not overwrite:
            raise ValueError(
                f"{out} is not empty ({', '.join(present[:5])}{', ...' if len(present) > 5 else ''}) and "
                "holds no kvbits eval run (no config.json or DONE written by kvbits eval); use a new or empty "
                f"folder, or {spell('overwrite=True', '--overwrite')} to write the run into it (only the files kvbits eval "
                f"writes would be replaced: {', '.join(_RUN_FILES)}, tokens/<scheme>.safetensors, figures)"
            )
        return None
    if overwrite:
        return None
    other = stored.get("config_hash") if isinstance(stored, dict) else None
    if other is None and done.is_file():
        other = _read_done(done)
    if other != chash:
        old = stored.get("request") if isinstance(stored, dict) else None
        diff = _differences(old, request or {})
        if diff == ["version"] and _older_version(old, request or {}):
            logger.warning(
                "%s holds this run from an older kvbits (output version %s, this one %s%s); recomputing it",
                out, old.get("version"), (request or {}).get("version"),
                ": its KL was from float32 log-probabilities" if old.get("version") == 1 else "",
            )  # fmt: skip
            return None
        raise OtherRunError(
            f"{out} holds a run with a different configuration (config hash "
            f"{'unreadable' if other is None else other}, this run {chash}"
            f"{'; it differs in ' + ', '.join(diff) if diff else ''}); use another output folder or "
            f"{spell('overwrite=True', '--overwrite')}",
            diff,
        )
    if done.is_file() and _read_done(done) == chash:
        from kvbits import __version__ as ours

        theirs = _stored_kvbits_version(stored)
        if theirs is not None and theirs != ours:
            logger.warning(
                "%s holds this run's configuration computed by kvbits %s, this is kvbits %s (its quantizers may "
                "compute other numbers); not reused, recomputing it (overwrite to redo regardless)", out, theirs, ours,
            )  # fmt: skip
            return None
        summary = _read_json(out / "summary.json")
        if summary is not None:
            logger.info(
                "%s: finished run with the same configuration found; skipping (overwrite to redo)", out
            )
            return summary
    return None


def _prepare_out_dir(out: Path, schemes: Sequence[str]) -> None:
    """Clear what an earlier kvbits eval run left in ``out`` before this run writes there, so a run
    that stops half-way never leaves a mix of two runs; called once the inputs are loaded and checked
    (a run refused for its inputs deletes nothing). Only files kvbits eval writes are removed:
    ``DONE`` (first: a folder without it is never reused), ``summary.json``, ``records.jsonl``,
    ``generations.jsonl``, ``tokens/*.safetensors`` and the report (``report.md``, ``report.html``, its
    figures): the report is rewritten at the end, but a rewrite that fails is only logged, and the old run's
    report then stood beside the new summary. In a folder kvbits eval did not write (``overwrite``), nothing
    is removed and the files this run writes replace those of the same name."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens"
    stored = _read_json(out / "config.json") if (out / "config.json").is_file() else None
    if _is_run_folder(out, stored):
        for name in ("DONE", "summary.json", "records.jsonl", "generations.jsonl", *_report_files()):
            (out / name).unlink(missing_ok=True)
        if tokens.is_dir():
            for f in tokens.glob("*.safetensors"):
                f.unlink()
    else:
        replaced = [n for n in _RUN_FILES if (out / n).exists()]
        replaced += [f"tokens/{n}.safetensors" for n in schemes if (tokens / f"{n}.safetensors").exists()]
        if replaced:
            logger.warning(
                "%s: replacing %s (overwrite; the folder's other files are kept)", out, ", ".join(replaced)
            )
    if tokens.is_dir() and not any(tokens.iterdir()):
        tokens.rmdir()


def _run_config(
    chash: str,
    request: dict[str, Any],
    args: dict[str, Any],
    argv: Sequence[str] | None,
    fingerprint: dict[str, str],
    windows_run: int,
    world_size: int = 1,
) -> dict[str, Any]:
    """The ``config.json`` record of a run; ``world_size``: how many ranks evaluated it (not part of
    the config hash: the ranks split the windows, the numbers are a single process's)."""
    return {
        "version": OUTPUT_VERSION,
        "config_hash": chash,
        "request": request,
        "args": args,
        "argv": list(argv) if argv is not None else None,
        "fingerprint": fingerprint,
        "windows_run": windows_run,
        "world_size": world_size,
        "versions": _versions(),
        "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_outputs(out: Path, chash: str, summary: dict, records: list, tokens: dict, meta: dict) -> None:
    from safetensors.numpy import save_file

    (out / "tokens").mkdir(exist_ok=True)
    for name, arrays in tokens.items():
        with atomic_path(out / "tokens" / f"{name}.safetensors") as tmp:
            save_file(
                {k: np.ascontiguousarray(arrays[k], dtype=np.float32) for k in TOKEN_FIELDS},
                str(tmp),
                metadata={k: str(v) for k, v in {**meta, "scheme": name}.items()},
            )
    write_text_atomic(out / "records.jsonl", "".join(dumps(r.to_dict()) + "\n" for r in records))
    write_text_atomic(out / "summary.json", dumps(summary, indent=2) + "\n")
    write_text_atomic(out / "DONE", chash + "\n")


def _write_generations(out: Path, labels: Sequence[str], tokens: np.ndarray, tokenizer: Any = None) -> None:
    """``DIR/generations.jsonl``: one line ``{"window", "scheme", "tokens", "text"}`` per window and
    continuation. ``labels``: ``"reference"`` then the scheme names, one per row of ``tokens``
    ``(1 + schemes, W, N)``; ``text`` is the tokenizer's decoding (null without a tokenizer)."""
    lines = []
    for w in range(tokens.shape[1]):
        for label, row in zip(labels, tokens[:, w]):
            ids = [int(t) for t in row]
            text = tokenizer.decode(ids) if tokenizer is not None else None
            lines.append(json.dumps({"window": w, "scheme": label, "tokens": ids, "text": text}) + "\n")
    write_text_atomic(out / "generations.jsonl", "".join(lines))


def _write_report(out: Path) -> None:
    try:
        from kvbits.report import write_report
    except ImportError as exc:
        logger.info("kvbits.report is not available (%s); no report written", exc)
        return
    try:
        paths = write_report(out)
        logger.info("report written: %s", ", ".join(str(p) for p in paths.values()))
    except Exception as exc:  # noqa: BLE001 - the results are on disk; a failed report must not lose them
        logger.warning("writing the report in %s failed: %s: %s", out, type(exc).__name__, exc)
