"""An evaluation's inputs: the model, the token windows and the calibration artifacts."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvbits._model import check_model
from kvbits._spelling import spell
from kvbits.evaluate.request import _ids_fingerprint, _model_fingerprint

logger = logging.getLogger(__name__)

__all__: list[str] = []


def check_int(name: str, value: Any, lo: int) -> int:
    """``value`` as an int ``>= lo`` (a Python or NumPy integer, not a bool); ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def check_ints(name: str, values: Sequence[int] | int, lo: int) -> list[int]:
    """Sorted distinct ints ``>= lo`` (each a ``name``: context lengths, batch sizes) from one int or a
    sequence of them; ``ValueError`` for anything else, an empty sequence included."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = [values]
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{name} must be an int or a list of ints, got {values!r}") from None
    if not items:
        raise ValueError(f"give at least one {name}")
    return sorted({check_int(name, v, lo) for v in items})


def check_layer_indices(name: str, values: Sequence[int]) -> list[int]:
    """``values`` as a list of ints (Python or NumPy integers): ``ValueError`` naming ``name`` for anything else,
    a float or a bool included (``int(0.7)`` would have picked layer 0 without a word)."""
    items = list(values)
    if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in items):
        raise ValueError(f"{name} must be layer indices (ints), got {items}")
    return [int(x) for x in items]


def cast_model(model: torch.nn.Module, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
    """``model.to(device, dtype)`` that keeps float32 buffers float32 (rotary ``inv_freq`` tables).

    A plain ``.to(torch.bfloat16)`` also rounds the RoPE frequencies to bfloat16, so positions drift
    at long context (Qwen2.5 at 32K: reference PPL 35.642 instead of 35.669); loading with
    ``dtype=`` keeps them float32, and a cast must agree with loading.
    """
    keep = {n: b for n, b in model.named_buffers() if b.dtype == torch.float32} if dtype is not None else {}
    model = model.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        setattr(mod, attr, buf.to(device=getattr(mod, attr).device))
    return model


def _load_model(
    model: Any, dtype: torch.dtype | None, device: str | None, check_config: Callable[[Any], None] | None = None
):
    """``(model, tokenizer, name, fingerprint)`` from a spec string, a ``LoadedModel`` or a model;
    ``check_config``: ``load_model``'s, for a spec string (its config checked before the weights load)."""
    from kvbits.evaluate.models import LoadedModel, load_model

    if isinstance(model, str):
        model = load_model(model, dtype=dtype, device=device or "cpu", check_config=check_config)
    elif isinstance(model, LoadedModel) and (dtype is not None or device is not None):
        cast_model(model.model, dtype, device)
    if isinstance(model, LoadedModel):
        check_model(model.model, attention=True)
        return model.model.eval(), model.tokenizer, model.source.name, model.fingerprint
    check_model(model, attention=True, by_name=True)
    if dtype is not None or device is not None:
        model = cast_model(model, dtype, device)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return model.eval(), None, name, _model_fingerprint(model)


def _model_arg(model: Any, name: str) -> str:
    """``--model`` for a model given as a spec or a ``LoadedModel`` (else its name, for the record)."""
    if isinstance(model, str):
        return model
    source = getattr(model, "source", None)
    if source is None:
        return name
    from kvbits.evaluate.models import OFFLINE_MODELS

    if source.name in OFFLINE_MODELS:
        return source.name
    return os.path.join(source.path, source.gguf_file) if source.gguf_file else source.path


def _data_arg(data: Any, name: str) -> str:
    """``--data`` for a text given as a spec or a ``TextSource`` (else its name, for the record)."""
    if isinstance(data, str):
        return data
    from kvbits.evaluate.data import TEXTS

    path = getattr(data, "path", None)
    return name if name in TEXTS or not isinstance(path, str) else path


def check_data_arg(data: Any) -> Any:
    """``evaluate``'s ``data`` as ``_load_windows`` takes it, checked before the model loads: a text spec (a ``str``;
    a path-like is taken as its path), a ``TextSource``, or token ids as an integer ``torch.Tensor`` ``(N,)`` /
    ``(W, context)`` (a NumPy integer array, as ``np.load`` gives it, is taken as that tensor, int64). ``TypeError``
    for anything else and for ids that are not integers: both failed only once the model had loaded, a NumPy array
    or a path as "text spec must be a non-empty str" (or "this model has no tokenizer"). The ids' range is checked
    against the model's embedding table once it is loaded (``_load_windows``)."""
    from kvbits.evaluate.data import TextSource, check_token_ids

    if isinstance(data, os.PathLike):
        return os.fspath(data)
    if isinstance(data, np.ndarray):
        if data.dtype.kind not in "iu":
            raise TypeError(f"token ids must be an integer array, got a NumPy array of {data.dtype}")
        data = torch.from_numpy(np.ascontiguousarray(data, dtype=np.int64))
    if isinstance(data, torch.Tensor):
        check_token_ids(data)
        return data
    if isinstance(data, (str, TextSource)):
        return data
    raise TypeError(
        f"data must be a text spec (a registry name, a text file's path, 'hub:NAME'), a TextSource, or token ids "
        f"(an integer tensor or NumPy array, (N,) or (W, context)), got {type(data).__name__}"
    )


def _load_windows(
    data: Any, tokenizer: Any, context: int, windows: int, data_path: str | None, model: Any = None,
    bos: str = "never",
):
    """``(windows (W, context) int64, data name, token fingerprint, BOS id or None)``; token ids given as ``data``
    must be integers within ``model``'s embedding table (``check_token_ids``), and so must the ids text tokenizes to
    (``check_tokenized``). ``bos`` (``data.BOS_MODES``): whether each window starts with the tokenizer's BOS
    (``resolve_bos``; token ids: only ``"always"``, and only for ``(N,)`` ids). The token fingerprint of windows
    with a BOS names it (``+bos<id>``): another input than the raw slices."""
    from kvbits.evaluate.data import (
        TextSource,
        check_token_ids,
        check_tokenized,
        load_text,
        make_windows,
        resolve_bos,
        token_fingerprint,
        tokenize,
    )

    if isinstance(data, torch.Tensor):
        check_token_ids(data, model)
        ids = data.detach().cpu().long()
        bos_id = resolve_bos(tokenizer, "always") if bos == "always" else None
        if bos_id is not None and ids.dim() == 2:
            raise ValueError(
                f"bos='always' (CLI: --bos always) with token windows (W, T) = {tuple(ids.shape)}: rows given as "
                "windows are evaluated as they are; give (N,) ids to have each window start with the BOS, or "
                "put the BOS in the rows yourself and use bos='never'"
            )
        if ids.dim() == 2:
            if ids.shape[1] != context:
                raise ValueError(f"token windows have {ids.shape[1]} tokens, context is {context}")
            if ids.shape[0] == 0:
                raise ValueError(f"token windows (W, T) = {tuple(ids.shape)}: no window; expected at least one row")
            if ids.shape[0] < windows:  # as make_windows says it for 1-D ids
                logger.warning("asked for %d windows but the token data holds only %d rows; using %d", windows,
                               ids.shape[0], ids.shape[0])  # fmt: skip
            win = ids[:windows].clone()
        elif ids.dim() == 1:
            win = make_windows(ids, context, windows, bos_id)
        else:
            raise ValueError(f"token data must be (N,) or (W, T), got shape {tuple(ids.shape)}")
        return win, "tokens", _ids_fingerprint(win), bos_id
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer (a bare transformers module, or a model folder without tokenizer "
            "files): pass token ids (a tensor) as data, or add the tokenizer files to the folder"
        )
    source = data if isinstance(data, TextSource) else load_text(data, data_path)
    bos_id = resolve_bos(tokenizer, bos)
    ids = tokenize(source, tokenizer)
    check_tokenized(ids, tokenizer, model, f"the text {source.name!r}")
    fp = token_fingerprint(source, tokenizer) + ("" if bos_id is None else f"+bos{bos_id}")
    return make_windows(ids, context, windows, bos_id), source.name, fp, bos_id


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
            name = art.scheme.name
            if name in out:  # which one was meant is not ours to guess
                where = [str(getattr(a, "path", None) or "<in memory>") for a in (out[name], art)]
                raise ValueError(
                    f"two calibrations were given for scheme {name!r} ({where[0]} and {where[1]}); "
                    "give one per scheme"
                )
            out[name] = art
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(
            f"calibration given for {', '.join(unknown)}, which is not among the schemes evaluated "
            f"({', '.join(names)}); a calibration serves the scheme it was made for"
        )
    return out


def _check_calibrated(schemes: list, calibrations: dict[str, Any]) -> None:
    """``ValueError`` before anything is loaded when a scheme needs ``kvbits calibrate``'s parameters
    (static scales, NUQ codebooks) and none were given for it (otherwise the reference pass would run
    first, minutes at long contexts, and the scheme fail after it)."""
    missing = [
        f"{s.name} ({' and '.join(s.needs_calibration())})"
        for s in schemes
        if hasattr(s, "needs_calibration") and s.needs_calibration() and s.name not in calibrations
    ]
    if missing:
        raise ValueError(
            f"calibrated parameters (static scales or NUQ codebooks) are needed and were not given for: "
            f"{', '.join(missing)}; create them with `kvbits calibrate --scheme NAME --out DIR` and pass the "
            f"folder ({spell('calibration=DIR', '--calibration DIR')})"
        )


def _check_calibration_models(calibrations: dict[str, Any], model_spec: Any, config: Any, model_fp: str) -> None:
    """Each artifact must fit the loaded model: its shape always, its weights where both sides pin them.

    ``model_spec`` is what the caller asked for (a spec string or a ``LoadedModel`` pins weights by
    content); an artifact fitted on a bare module records ``"config:<hash>"``, which pins only the
    architecture. A model given as a module has no content id: it is checked by shape, and an artifact that
    pins weights says so (a WARNING) rather than passing silently.
    """
    loaded = isinstance(model_spec, str) or isinstance(getattr(model_spec, "fingerprint", None), str)
    for art in calibrations.values():
        pins = not str(getattr(art, "fingerprint", "config:")).startswith("config:")
        art.check_model(config, fingerprint=model_fp if loaded and pins else None)
        if pins and not loaded:  # a module has no content id to match: say so, do not pass it silently
            logger.warning(
                "calibration%s was made for the weights with fingerprint %s; a model given as a module can not be "
                "matched to them (only its shape was checked): give it by spec or as a LoadedModel to have them "
                "compared", "" if getattr(art, "path", None) is None else f" in {art.path}", art.fingerprint,
            )  # fmt: skip


def _check_before_loading(
    schemes: list, calibration: Any, data_path: str | None, dtype: Any, device: Any
) -> tuple[torch.dtype | None, str | None, dict[str, Any]]:
    """What an evaluation can refuse before the model loads: a ``data_path`` that is no folder, the dtype,
    the device, and the calibrations (each matched to its scheme; none missing for a calibrated scheme).
    Returns ``(torch dtype, dtype name for the record, calibrations by scheme name)``."""
    from kvbits.evaluate.data import data_search_path
    from kvbits.evaluate.request import _resolve_dtype, check_device

    if data_path is not None:
        data_search_path(data_path)
    torch_dtype, dtype_name = _resolve_dtype(dtype)
    check_device(device)
    calibrations = _calibrations(calibration, schemes)
    _check_calibrated(schemes, calibrations)
    return torch_dtype, dtype_name, calibrations


def _run_dtype(model: torch.nn.Module, dtype_name: str | None) -> str:
    """The dtype a ``kvbits speed`` / ``needle`` run records, the one the model ran in: as asked
    (``_check_before_loading``'s name; the model is cast to it), else the loaded model's own (its first floating
    parameter's, ``floating_dtype``; its first parameter's where it has none).

    ``kvbits eval`` records only the dtype asked for (``request["dtype"]``, None for the model's own): its request is
    hashed before the model loads, to find a stored run, and the loaded dtype in it would change the hash of every
    stored run made without ``--dtype``."""
    from kvbits.evaluate.measures import floating_dtype

    if dtype_name:
        return dtype_name
    dtype = floating_dtype(model) or next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def _load_checked_model(
    model: Any,
    torch_dtype: torch.dtype | None,
    device: Any,
    calibrations: dict[str, Any],
    check_config: Callable[[Any], None] | None = None,
):
    """``_load_model`` (``check_config`` run on the config before the weights load), then each calibration
    artifact checked against the model loaded (``_check_calibration_models``): ``(model, tokenizer, name,
    fingerprint)``."""
    loaded, tokenizer, name, fingerprint = _load_model(model, torch_dtype, device, check_config)
    _check_calibration_models(calibrations, model, loaded.config, fingerprint)
    return loaded, tokenizer, name, fingerprint


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
