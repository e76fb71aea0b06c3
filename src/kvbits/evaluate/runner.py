"""The evaluation runner: text -> windows -> reference and scheme runs -> per-token records -> buckets.

``evaluate(model, data, context, schemes, ...)`` returns the summary (the JSON of ``kvbits eval
--json``). The reference (the unquantized model, a plain forward) is computed once per window and
shared by every scheme; each scheme runs either through the one-pass simulator (``mode="simulate"``)
or the real cache token by token (``mode="stream"``, the ground truth; slow).

With ``out_dir`` the run is written as::

    DIR/config.json                 arguments, fingerprints, versions, git commit, date, config_hash
    DIR/summary.json                the summary
    DIR/records.jsonl               one line per scheme x window x bucket: sums of nll, nll_ref, kl, top1
    DIR/tokens/<scheme>.safetensors per-token nll, nll_ref, kl, top1, float32 (W, T - 1)
    DIR/DONE                        the config hash, written last

A rerun with the same configuration finds ``DONE`` and returns the stored summary without loading
the model (``overwrite=True`` recomputes); a folder written by another configuration is refused.
Batch = 1, unpadded windows: perplexity windows are raw slices of one text.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbits.evaluate.metrics import (
    TOKEN_FIELDS,
    attn_error_buckets,
    bucket_records,
    summarize,
    token_metrics,
)
from kvbits.evaluate.simulate import simulate
from kvbits.evaluate.stream import PeerScheme, base_model, resolve_scheme, stream_hidden
from kvbits.schemes.accounting import average_bits
from kvbits.schemes.spec import KVScheme

logger = logging.getLogger(__name__)

__all__ = ["MODES", "OUTPUT_VERSION", "config_hash", "default_attn_layers", "evaluate"]

MODES = ("simulate", "stream")
SEMANTICS = ("decode", "prefill")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OUTPUT_VERSION = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


# ------------------------------------------------------------------------------------ identities


def _sha16(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _ids_fingerprint(ids: torch.Tensor) -> str:
    return _sha16(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())


def _model_fingerprint(model: Any) -> str:
    """Config plus a checksum of every parameter, for models handed over as objects."""
    cfg = (
        model.config.to_json_string(use_diff=False)
        if hasattr(model.config, "to_json_string")
        else repr(model.config)
    )
    with torch.no_grad():
        sums = [float(p.detach().double().sum()) for p in model.parameters()]
    return _sha16(cfg + json.dumps(sums))


def config_hash(config: dict[str, Any]) -> str:
    """16 hex chars identifying what a run computes (arguments and input fingerprints)."""
    return _sha16(json.dumps(config, sort_keys=True, default=str))


def default_attn_layers(n_layers: int, count: int = 3) -> list[int]:
    """``count`` layers evenly spaced from the first to the last."""
    if n_layers <= count:
        return list(range(n_layers))
    return sorted({round(x) for x in np.linspace(0, n_layers - 1, count)})


def _git_commit() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[3]
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


# ------------------------------------------------------------------------------------ validation


def _scheme_name(s: KVScheme | PeerScheme) -> str:
    return s.name


def _scheme_dict(s: KVScheme | PeerScheme) -> dict[str, Any]:
    return s.to_dict()


def _check_args(context, windows, mode, semantics, prompt_len, schemes) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an int >= 2, got {context!r}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a positive int, got {windows!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if semantics == "prefill":
        if (
            isinstance(prompt_len, bool)
            or not isinstance(prompt_len, int)
            or not 0 < prompt_len < context - 1
        ):
            raise ValueError(
                f"semantics='prefill' needs prompt_len with 0 < prompt_len < context - 1 = {context - 1}, got {prompt_len!r}"
            )
    elif prompt_len is not None:
        raise ValueError(f"prompt_len is only used with semantics='prefill', got prompt_len={prompt_len!r}")
    if not schemes:
        raise ValueError("give at least one scheme")
    names = [_scheme_name(s) for s in schemes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"scheme names must be unique, repeated: {dup}")
    for n in names:
        if not _SAFE_NAME.match(n):
            raise ValueError(
                f"scheme name {n!r} is not usable as a file name (letters, digits, . _ + - only)"
            )
    peers = [n for n, s in zip(names, schemes) if isinstance(s, PeerScheme)]
    if peers and mode != "stream":
        raise ValueError(
            f"{', '.join(peers)}: peer caches exist only as a cache (no simulator); use mode='stream' (--mode stream)"
        )


# ----------------------------------------------------------------------------------- the output


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check_out_dir(out: Path, chash: str, overwrite: bool) -> dict[str, Any] | None:
    """The stored summary when ``out`` holds a finished run of this config; else prepare ``out``."""
    done, cfg_path = out / "DONE", out / "config.json"
    stored = _read_json(cfg_path) if cfg_path.is_file() else None
    if not overwrite and stored is not None:
        other = stored.get("config_hash")
        if other != chash:
            raise ValueError(
                f"{out} holds a run with a different configuration (config hash {other}, this run {chash}); "
                "use another output folder or overwrite=True (--overwrite)"
            )
        if done.is_file() and done.read_text().strip() == chash:
            summary = _read_json(out / "summary.json")
            if summary is not None:
                logger.info(
                    "%s: finished run with the same configuration found; skipping (overwrite to redo)", out
                )
                return summary
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a folder")
    for name in ("DONE", "summary.json", "records.jsonl"):
        (out / name).unlink(missing_ok=True)
    if (out / "tokens").is_dir():
        shutil.rmtree(out / "tokens")
    out.mkdir(parents=True, exist_ok=True)
    return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_outputs(out: Path, chash: str, summary: dict, records: list, tokens: dict, meta: dict) -> None:
    from safetensors.numpy import save_file

    (out / "tokens").mkdir(exist_ok=True)
    for name, arrays in tokens.items():
        save_file(
            {k: np.ascontiguousarray(arrays[k], dtype=np.float32) for k in TOKEN_FIELDS},
            str(out / "tokens" / f"{name}.safetensors"),
            metadata={k: str(v) for k, v in {**meta, "scheme": name}.items()},
        )
    _atomic_write(out / "records.jsonl", "".join(json.dumps(r.to_dict()) + "\n" for r in records))
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    _atomic_write(out / "DONE", chash + "\n")


def _mismatch(clipped: dict[str, int], artifact: Any, context: int, mode: str) -> dict[str, Any]:
    """Calibration/serving mismatch, measured: values clipped by their scales (simulate mode) and
    positions beyond the longest calibrated length (with a calibration artifact)."""
    out: dict[str, Any] = {}
    if mode == "simulate":
        for side in ("keys", "values"):
            n, total = clipped.get(side, 0), clipped.get(side + "_elements", 0)
            out[f"clipped_{side}"] = n
            out[f"clipped_{side}_frac"] = n / total if total else 0.0
    if artifact is not None:
        longest = int(artifact.max_calibrated_length)
        out["max_calibrated_length"] = longest
        out["positions_beyond_calibrated"] = max(0, context - longest)
        out["artifact"] = _artifact_record(artifact)
    return out


def _artifact_record(art: Any) -> dict[str, Any]:
    """Which calibration served a scheme: its id (as in ``config.json``), folder, and the data it saw."""
    data = (getattr(art, "meta", None) or {}).get("data") or {}
    path = getattr(art, "path", None)
    rec: dict[str, Any] = {"id": _calibration_id(art), "path": None if path is None else str(path)}
    for key in ("name", "context", "windows", "tokens"):
        if isinstance(data, dict) and data.get(key) is not None:
            rec["data" if key == "name" else key] = data[key]
    return rec


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


# ------------------------------------------------------------------------------------ the inputs


def _load_model(model: Any, dtype: torch.dtype | None, device: str | None):
    """``(model, tokenizer, name, fingerprint)`` from a spec string, a ``LoadedModel`` or a model."""
    from kvbits.evaluate.models import LoadedModel, load_model

    if isinstance(model, str):
        model = load_model(model, dtype=dtype, device=device or "cpu")
    elif isinstance(model, LoadedModel) and (dtype is not None or device is not None):
        model.model.to(device=device, dtype=dtype)
    if isinstance(model, LoadedModel):
        return model.model.eval(), model.tokenizer, model.source.name, model.fingerprint
    if not hasattr(model, "config"):
        raise TypeError(
            f"model must be a name/path, a LoadedModel or a transformers model, got {type(model).__name__}"
        )
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return model.eval(), None, name, _model_fingerprint(model)


def _load_windows(data: Any, tokenizer: Any, context: int, windows: int, data_path: str | None):
    """``(windows (W, context) int64, data name, token fingerprint)``."""
    from kvbits.evaluate.data import TextSource, load_text, make_windows, token_fingerprint, tokenize

    if isinstance(data, torch.Tensor):
        ids = data.detach().cpu().long()
        if ids.dim() == 2:
            if ids.shape[1] != context:
                raise ValueError(f"token windows have {ids.shape[1]} tokens, context is {context}")
            win = ids[:windows].clone()
        elif ids.dim() == 1:
            win = make_windows(ids, context, windows)
        else:
            raise ValueError(f"token data must be (N,) or (W, T), got shape {tuple(ids.shape)}")
        return win, "tokens", _ids_fingerprint(win)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids (a tensor) as data")
    source = data if isinstance(data, TextSource) else load_text(data, data_path)
    ids = tokenize(source, tokenizer)
    return make_windows(ids, context, windows), source.name, token_fingerprint(source, tokenizer)


def _calibrations(calibration: Any, schemes: list) -> dict[str, Any]:
    """Scheme name -> calibration artifact, from a mapping or from artifacts/folders matched by the
    scheme each was calibrated for."""
    if calibration is None:
        return {}
    from kvbits.calibrate import load_calibration

    def load(x: Any) -> Any:
        return load_calibration(x) if isinstance(x, (str, os.PathLike)) else x

    names = [s.name for s in schemes]
    if isinstance(calibration, dict):
        out = {str(k): load(v) for k, v in calibration.items()}
    else:
        items = (
            [calibration]
            if isinstance(calibration, (str, os.PathLike)) or hasattr(calibration, "scheme")
            else list(calibration)
        )
        out = {}
        for item in items:
            art = load(item)
            out[art.scheme.name] = art
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(
            f"calibration given for {unknown}, which is not among the schemes evaluated ({names})"
        )
    return out


def _calibration_paths(calibration: Any) -> list[str] | None:
    """The calibration folders as given (for ``config.json``), or None when given as objects."""
    if calibration is None:
        return None
    items = (
        calibration.values()
        if isinstance(calibration, dict)
        else (
            [calibration]
            if isinstance(calibration, (str, os.PathLike)) or hasattr(calibration, "scheme")
            else calibration
        )
    )
    paths = [
        str(x) if isinstance(x, (str, os.PathLike)) else str(getattr(x, "path", None) or "<object>")
        for x in items
    ]
    return paths or None


def _calibration_id(art: Any) -> str:
    files = (getattr(art, "meta", None) or {}).get("files") or {}
    sha = next((f.get("sha256") for f in files.values() if isinstance(f, dict) and f.get("sha256")), None)
    if sha:
        return f"sha256:{sha}"
    tensors = getattr(art, "tensors", {}) or {}
    return "tensors:" + _sha16(json.dumps({k: float(v.double().sum()) for k, v in sorted(tensors.items())}))


def _request(
    model,
    data,
    context,
    windows,
    schemes,
    mode,
    semantics,
    prompt_len,
    attn_layers,
    data_path,
    dtype_name,
    device,
    chunk_size,
    seed,
    calibrations,
) -> dict[str, Any]:
    """What the run computes, JSON-able; its hash decides whether a stored run can be reused."""
    if isinstance(model, str):
        model_id = model
    else:
        fp = getattr(model, "fingerprint", None)
        model_id = f"fingerprint:{fp}" if isinstance(fp, str) else f"fingerprint:{_model_fingerprint(model)}"
    if isinstance(data, torch.Tensor):
        data_id = f"tokens:{_ids_fingerprint(data)}"
    elif isinstance(data, str):
        data_id = data
    else:
        data_id = f"text:{getattr(data, 'sha256', '?')}"
    return {
        "version": OUTPUT_VERSION,
        "model": model_id,
        "data": data_id,
        "data_path": data_path,
        "context": context,
        "windows": windows,
        "schemes": [_scheme_dict(s) for s in schemes],
        "mode": mode,
        "semantics": semantics,
        "prompt_len": prompt_len,
        "attn_layers": None if attn_layers is None else [int(x) for x in attn_layers],
        "dtype": dtype_name,
        "device": device,
        "chunk_size": chunk_size,
        "seed": seed,
        "calibration": {k: _calibration_id(v) for k, v in sorted(calibrations.items())} or None,
    }


# ----------------------------------------------------------------------------------------- runs


def _progress(enabled: bool, total: int):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def _peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes since it started (``getrusage``), or None
    where the platform does not report it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    try:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (OSError, ValueError):
        return None
    if peak <= 0:
        return None
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _peak_cuda_bytes(dev: torch.device) -> int | None:
    """Peak bytes allocated by torch on ``dev`` since its peak was last reset, or None off CUDA."""
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(dev))


@torch.no_grad()
def _hidden_plain(base: Any, ids: torch.Tensor) -> torch.Tensor:
    return base(input_ids=ids, use_cache=False).last_hidden_state


def evaluate(
    model: Any,
    data: Any,
    context: int,
    schemes: Sequence[str | dict | KVScheme | PeerScheme],
    windows: int = 1,
    mode: str = "simulate",
    semantics: str = "decode",
    prompt_len: int | None = None,
    attn_layers: Sequence[int] | None = None,
    *,
    calibration: Any = None,
    data_path: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    chunk_size: int = 256,
    seed: int = 0,
    progress: bool = False,
    argv: Sequence[str] | None = None,
    on_skip: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Measure each scheme against the unquantized model, by position bucket.

    Args:
        model: registry name / path (``load_model``), a ``LoadedModel``, or a transformers causal LM.
        data: text spec (``load_text``), a ``TextSource``, or token ids ``(N,)`` / ``(W, context)``.
        context: tokens per window.
        schemes: kvbits schemes (names, dicts, JSON paths, objects) or peers (``hf-quanto-int4``).
        windows: how many windows (fewer if the text is shorter; the summary says how many ran).
        mode: ``"simulate"`` (one pass per window) or ``"stream"`` (the cache, token by token).
        semantics: ``"decode"`` or ``"prefill"`` (needs ``prompt_len``; only positions
            ``t >= prompt_len`` are scored).
        attn_layers: layers whose attention-output error is recorded (simulate mode); default three
            evenly spaced layers; ``[]`` for none.
        calibration: ``kvbits calibrate`` artifacts (objects or folders) for schemes with static scales
            or NUQ codebooks, matched to schemes by the scheme each was made for; or a mapping
            scheme name -> artifact.
        data_path: a data root for registry texts.
        out_dir: write the run there (see the module docstring).
        overwrite: recompute even when ``out_dir`` holds this run, or another one.
        dtype: model dtype (``"float32"``, ``"bfloat16"``) when loading or converting the model.
        device: ``"cpu"`` or ``"cuda"``.
        chunk_size: queries per attention chunk in the simulator.
        seed: bootstrap seed.
        progress: show a rich progress bar on stderr.
        argv: the command line, recorded in ``config.json``.
        on_skip: called with the stored summary when a finished run is reused.

    Returns:
        The summary: ``{"model", "data", "context", "semantics", "mode", "windows", "fingerprint":
        {"model", "tokens"}, "results": [...], "reference_seconds", "peak_rss_bytes",
        "peak_cuda_bytes"}`` (see ``kvbits eval --help``). ``peak_rss_bytes`` is the process's peak
        resident set (``getrusage`` ``ru_maxrss`` in bytes; everything the process did before the run
        included; None where unavailable); ``peak_cuda_bytes`` is ``torch.cuda.max_memory_allocated``
        over the run (its peak counter is reset once the model is loaded; it counts the weights and
        what the run adds, not the loading) on CUDA, None otherwise.
    """
    resolved = [resolve_scheme(s) for s in schemes]
    _check_args(context, windows, mode, semantics, prompt_len, resolved)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        torch_dtype, dtype_name = DTYPES[dtype], dtype
    else:
        torch_dtype, dtype_name = dtype, (str(dtype).removeprefix("torch.") if dtype is not None else None)
    if device is not None and device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    calibrations = _calibrations(calibration, resolved)
    request = _request(
        model,
        data,
        context,
        windows,
        resolved,
        mode,
        semantics,
        prompt_len,
        attn_layers,
        data_path,
        dtype_name,
        device,
        chunk_size,
        seed,
        calibrations,
    )
    chash = config_hash(request)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        stored = _check_out_dir(out, chash, overwrite)
        if stored is not None:
            if on_skip:
                on_skip(stored)
            return stored

    model_spec = model
    model, tokenizer, model_name, model_fp = _load_model(model, torch_dtype, device)
    win, data_name, tokens_fp = _load_windows(data, tokenizer, context, windows, data_path)
    loaded = isinstance(model_spec, str) or isinstance(getattr(model_spec, "fingerprint", None), str)
    for art in calibrations.values():
        # Made for these weights? Only when both sides pin weights: an artifact fitted on a bare module
        # records "config:<hash>", which pins the architecture (its shape is still checked).
        pinned = loaded and not str(getattr(art, "fingerprint", "config:")).startswith("config:")
        art.check_model(model.config, fingerprint=model_fp if pinned else None)
    from kvbits.cache import attention_shape

    n_layers, _, kv_heads, head_dim = attention_shape(model.config)
    max_ctx = getattr(model.config, "max_position_embeddings", None)
    if isinstance(max_ctx, int) and context > max_ctx:
        logger.warning(
            "context %d exceeds the model's max_position_embeddings %d: positions beyond it are extrapolation",
            context,
            max_ctx,
        )
    layers = default_attn_layers(n_layers) if attn_layers is None else sorted({int(x) for x in attn_layers})
    if any(not 0 <= x < n_layers for x in layers):
        raise ValueError(f"attn_layers must be in [0, {n_layers}), got {list(attn_layers or [])}")
    if mode == "stream":
        layers = []  # the attention error needs the simulator's two attention paths
    base = base_model(model)
    dev = next(model.parameters()).device
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(dev)  # the run's peak: the weights, then what the run adds
    W, T = win.shape
    first = prompt_len if semantics == "prefill" else 0
    names = [_scheme_name(s) for s in resolved]
    fingerprint = {"model": model_fp, "tokens": tokens_fp}
    if out is not None:
        config = {
            "version": OUTPUT_VERSION,
            "config_hash": chash,
            "request": request,
            "args": {
                "model": request["model"] if isinstance(model_spec, str) else model_name,
                "data": data_name,
                "context": context,
                "windows": windows,
                "schemes": names,
                "mode": mode,
                "semantics": semantics,
                "prompt_len": prompt_len,
                "attn_layers": layers,
                "dtype": dtype_name,
                "device": device,
                "data_path": data_path,
                "calibration": _calibration_paths(calibration),
            },
            "argv": list(argv) if argv is not None else None,
            "fingerprint": fingerprint,
            "windows_run": W,
            "versions": _versions(),
            "commit": _git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        _atomic_write(out / "config.json", json.dumps(config, indent=2) + "\n")

    head = model.get_output_embeddings()
    softcap = getattr(
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
        "final_logit_softcapping",
        None,
    )
    per_token = {n: {k: np.zeros((W, T - 1), dtype=np.float32) for k in TOKEN_FIELDS} for n in names}
    attn_err = {n: {layer: np.zeros((W, T), dtype=np.float32) for layer in layers} for n in names}
    seconds = dict.fromkeys(names, 0.0)
    clipped: dict[str, dict[str, int]] = {n: {} for n in names}
    ref_seconds = 0.0
    units = W * T * (1 + len(names))
    with _progress(progress, units) as bar:
        task = bar.add_task("evaluating", total=units) if bar is not None else None

        def advance(n: int, what: str | None = None) -> None:
            if bar is not None:
                bar.update(task, advance=n, description=what) if what else bar.update(task, advance=n)

        for w in range(W):
            ids = win[w : w + 1].to(dev)
            t0 = time.perf_counter()
            h_ref = _hidden_plain(base, ids)[0]
            ref_seconds += time.perf_counter() - t0
            advance(T, f"window {w + 1}/{W}: reference")
            hs = []
            for scheme, name in zip(resolved, names):
                advance(0, f"window {w + 1}/{W}: {name}")
                t0 = time.perf_counter()
                if mode == "simulate":
                    with simulate(
                        model,
                        scheme,
                        semantics=semantics,
                        prompt_len=prompt_len,
                        attn_layers=layers,
                        chunk_size=chunk_size,
                        calibration=calibrations.get(name),
                    ) as sim:
                        h = _hidden_plain(base, ids)[0]
                    if sim.calls == 0:
                        raise RuntimeError(
                            f"{type(model).__name__}: the simulated attention was never called"
                        )
                    for k, n in sim.clipped.items():
                        clipped[name][k] = clipped[name].get(k, 0) + n
                    for layer in layers:
                        if layer in sim.attn_error:
                            attn_err[name][layer][w] = sim.attn_error[layer][0].cpu().numpy()
                    advance(T)
                else:
                    h = stream_hidden(
                        model,
                        ids,
                        scheme,
                        semantics=semantics,
                        prompt_len=prompt_len,
                        progress=advance,
                        calibration=calibrations.get(name),
                    )[0]
                seconds[name] += time.perf_counter() - t0
                if not bool(torch.isfinite(h).all()):
                    raise RuntimeError(
                        f"{name}: non-finite hidden states in window {w} (NaN/inf in the model or K/V)"
                    )
                hs.append(h[:-1])
            metrics = token_metrics(head, h_ref[:-1], hs, win[w, 1:], softcap=softcap)
            for name, rec in zip(names, metrics):
                for k in TOKEN_FIELDS:
                    per_token[name][k][w] = rec[k].numpy()
    logger.info("reference: %.1f s for %d window(s) of %d tokens", ref_seconds, W, T)

    results, records = [], []
    for scheme, name in zip(resolved, names):
        s = summarize(per_token[name], first=first, seed=seed)
        bits = (
            scheme.avg_bits
            if isinstance(scheme, PeerScheme)
            else average_bits(scheme, head_dim=head_dim, n_heads=kv_heads)
        )
        results.append(
            {
                "scheme": name,
                "avg_bits": bits,
                "ppl": s["ppl"],
                "ppl_ref": s["ppl_ref"],
                "kl": s["kl"],
                "top1": s["top1"],
                "buckets": s["buckets"],
                "attn_error": attn_error_buckets(attn_err[name], T - 1, first) if layers else [],
                "calibration": _mismatch(clipped[name], calibrations.get(name), T, mode),
                "seconds": seconds[name],
            }
        )
        records += bucket_records(name, per_token[name], first)
        logger.info(
            "%s: %.1f s, ppl %.4f (reference %.4f), kl %.5f",
            name,
            seconds[name],
            s["ppl"],
            s["ppl_ref"],
            s["kl"],
        )
    summary = {
        "model": model_name,
        "data": data_name,
        "context": context,
        "semantics": semantics,
        "mode": mode,
        "windows": W,
        "fingerprint": fingerprint,
        "results": results,
        "reference_seconds": ref_seconds,
        "peak_rss_bytes": _peak_rss_bytes(),
        "peak_cuda_bytes": _peak_cuda_bytes(dev),
    }
    if out is not None:
        meta = {
            "version": OUTPUT_VERSION,
            "first_scored": first,
            "model_fingerprint": model_fp,
            "tokens_fingerprint": tokens_fp,
            "context": context,
        }
        _write_outputs(out, chash, summary, records, per_token, meta)
        _write_report(out)
    return summary
