"""What an evaluation computes: its arguments, checked, and its identity.

``_request`` records, JSON-able, everything that decides the numbers (model and data identities,
by content where they are local files; schemes, mode, semantics, calibration ids, ...); :func:`config_hash` of it decides whether a
stored run can be reused (:mod:`.outputs`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import numpy as np
import torch

from kvbits._argtypes import MODEL_DTYPES
from kvbits._spelling import spell
from kvbits.evaluate.stream import PeerScheme
from kvbits.schemes import check_unique_names
from kvbits.schemes.spec import KVScheme

__all__ = [
    "DTYPES",
    "MODES",
    "OUTPUT_VERSION",
    "SEMANTICS",
    "check_device",
    "config_hash",
    "default_attn_layers",
]

MODES = ("simulate", "stream")
SEMANTICS = ("decode", "prefill")
DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}
# 2: KL(ref || scheme) from float64 log-probabilities (version 1 took them in float32, which overstated a KL
# of 2.5e-7 by a median 50 % per token); a finished version-1 run of the same request is recomputed (.outputs)
OUTPUT_VERSION = 2
# ',' and '=' for per-layer mixes ("int4-token,0=int8-token"): portable in file names, like the rest
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+,=-]*$")
# a scheme's per-token arrays go to tokens/<name>.safetensors, written through a temporary
# <name>.safetensors.<8 random>.tmp: 25 characters past the name, within the usual 255-byte file name limit
MAX_NAME_CHARS = 200


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


def _object_runs_in(model: Any, dtype_name: str | None, device: Any) -> tuple[str | None, Any]:
    """``(dtype, device)`` a run records for ``model`` given as an object (a ``LoadedModel`` or a module), which
    runs as it is where ``dtype`` / ``device`` are not given: its own floating dtype, and its device type where
    that is not the CPU (None stands for the CPU, as for a spec, which loads there; ``"cuda"``, not ``"cuda:1"``:
    the ranks of a distributed run, each on its own GPU, compute one run). A ``LoadedModel``'s
    fingerprint identifies its weight files, not the dtype it was loaded in or cast to (``evaluate(...,
    dtype=...)`` casts it in place), so without this a float32 run was reused for the same model in bfloat16."""
    inner = getattr(model, "model", None)
    module = inner if isinstance(inner, torch.nn.Module) and hasattr(model, "fingerprint") else model
    if not isinstance(module, torch.nn.Module):
        return dtype_name, device
    if dtype_name is None:
        dtype = next((p.dtype for p in module.parameters() if p.dtype.is_floating_point), None)
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
    if device is None:
        on = next((p.device for p in module.parameters()), None)
        device = None if on is None or on.type == "cpu" else on.type  # not its index: each rank has its own
    return dtype_name, device


def config_hash(config: dict[str, Any]) -> str:
    """16 hex chars identifying what a run computes (arguments and input fingerprints)."""
    return _sha16(json.dumps(config, sort_keys=True, default=str))


def default_attn_layers(n_layers: int, count: int = 3) -> list[int]:
    """``count`` layers evenly spaced from the first to the last."""
    if n_layers <= count:
        return list(range(n_layers))
    return sorted({round(x) for x in np.linspace(0, n_layers - 1, count)})


def _calibration_id(art: Any) -> str:
    files = (getattr(art, "meta", None) or {}).get("files") or {}
    sha = next((f.get("sha256") for f in files.values() if isinstance(f, dict) and f.get("sha256")), None)
    if sha:
        return f"sha256:{sha}"
    tensors = getattr(art, "tensors", {}) or {}
    return "tensors:" + _sha16(json.dumps({k: float(v.double().sum()) for k, v in sorted(tensors.items())}))


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
    check_unique_names(names, "evaluated")
    for n in names:
        if not _SAFE_NAME.match(n):
            raise ValueError(
                f"scheme name {n!r} is not usable as a file name (letters, digits, . _ + , = - only)"
            )
        if len(n) > MAX_NAME_CHARS:  # refused before the model loads: the write failed after every window had run
            raise ValueError(
                f"scheme name {n[:40]}... has {len(n)} characters, too long for a file name (tokens/<name>.safetensors); "
                f"expected at most {MAX_NAME_CHARS}: give the scheme a shorter name (a scheme JSON file's \"name\", or "
                "mixed_scheme(..., name=...))"
            )
    peers = [n for n, s in zip(names, schemes) if isinstance(s, PeerScheme)]
    if peers and mode != "stream":
        raise ValueError(
            f"{', '.join(peers)}: peer caches exist only as a cache (no simulator); use "
            + spell("mode='stream'", "--mode stream")
        )


def _resolve_dtype(dtype: str | torch.dtype | None) -> tuple[torch.dtype | None, str | None]:
    """``(torch dtype, name for the record)`` of a dtype given by name (``DTYPES``) or as a floating torch dtype.

    Anything else is refused here, before a model loads: ``torch.int8`` failed only after loading, in
    ``Module.to``, ``torch.complex64`` deep in the first forward (softmax not implemented for ComplexFloat)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype], dtype
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be one of {tuple(DTYPES)} or a floating torch dtype, got {dtype!r}")
    return dtype, (str(dtype).removeprefix("torch.") if dtype is not None else None)


def check_device(device: str | torch.device | None, types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """``ValueError`` unless ``device`` (None: the default) is of one of ``types`` and usable by this
    torch: checked before any model loads, since torch's own failure on a CPU-only build is an
    ``AssertionError`` deep inside the first ``.to("cuda")``."""
    if device is None:
        return
    allowed = " or ".join(repr(t) for t in types) + (" (or 'cuda:N')" if "cuda" in types else "")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be {allowed}, got {device!r}") from None
    if dev.type not in types:
        raise ValueError(f"device must be {allowed}, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is visible"
            )
            raise ValueError(f"device {str(device)!r}: {why} (torch {torch.__version__}); use device 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"device {str(device)!r}: MPS is not available in this torch build or on this machine"
        )


# ------------------------------------------------------------------------------------ the request


def _request(
    *,
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
    """What the run computes, JSON-able; its hash decides whether a stored run can be reused.

    Keyword-only: fifteen values of which several share a type (``context``/``windows``,
    ``mode``/``semantics``); a swapped positional pair would silently change the config hash.
    """
    if isinstance(model, str):
        # by content where it can be hashed: a stored run of the same path must not be reused once
        # the folder's weights or tokenizer changed (registry names and hub ids pin their content)
        from kvbits.evaluate.models import model_content_id

        model_id = model_content_id(model) or model
    else:
        fp = getattr(model, "fingerprint", None)
        model_id = f"fingerprint:{fp}" if isinstance(fp, str) else f"fingerprint:{_model_fingerprint(model)}"
        dtype_name, device = _object_runs_in(model, dtype_name, device)
    if isinstance(data, torch.Tensor):
        data_id = f"tokens:{_ids_fingerprint(data)}"
    elif isinstance(data, str):
        from kvbits.evaluate.data import text_content_id

        data_id = text_content_id(data)  # by content, as the model: an edited text is another run
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
        "dtype": dtype_name,  # as asked, None: the model's own (speed and needle record the dtype loaded, _run_dtype)
        "device": device,
        "chunk_size": chunk_size,
        "seed": seed,
        "calibration": {k: _calibration_id(v) for k, v in sorted(calibrations.items())} or None,
    }
