"""Finding a model's config: :func:`resolve_config` turns anything a user may hold (a transformers
config, a dict, a ``config.json``, a model folder, a ``.gguf`` file, a kvbits offline-model name, a
hub id) into a config object or mapping, and a name for tables.

transformers is imported only when a config has to be built or loaded.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbits.plan.shape import ModelShape

logger = logging.getLogger(__name__)

__all__ = ["resolve_config"]

_OFFLINE_REGISTRY = "kvbits.evaluate.models"  # written by the evaluate stage; optional here


def resolve_config(source: Any) -> tuple[Any, str]:
    """Turn ``source`` into a config (a transformers config object or a plain mapping) and a name.

    Accepted, tried in this order for strings: an existing ``.gguf`` file, ``*.json`` file or model
    folder (holding ``config.json`` or exactly one ``.gguf``); a kvbits offline model name
    (``kvbits.evaluate.models``, when that module exists); a Hugging Face hub id.

    Raises:
        ValueError: nothing matched, or a file is not a usable config.
        TypeError: ``source`` is of an unsupported type.
    """
    if isinstance(source, ModelShape):
        return source, source.name
    if isinstance(source, Mapping):
        return _from_mapping(dict(source)), str(source.get("_name_or_path") or source.get("model_type") or "")
    if isinstance(source, (str, os.PathLike)):
        return _from_string(os.fspath(source))
    if isinstance(source, (bytes, int, float, list, tuple)) or source is None:
        raise TypeError(
            "config must be a transformers PretrainedConfig, a dict, a path to config.json / a model "
            "folder / "
            f"a .gguf file, an offline model name or a hub id; got {type(source).__name__}"
        )
    name = getattr(source, "_name_or_path", "") or getattr(source, "model_type", "") or ""
    return source, str(name)


def _from_mapping(d: dict[str, Any]) -> Any:
    """Build the transformers config class for ``d["model_type"]`` so that class defaults apply.

    A config.json may leave out fields whose class default matters (Gemma's ``head_dim=256``, the
    default ``layer_types``). Dicts without a ``model_type``, or that transformers refuses, are read
    as they are.
    """
    model_type = d.get("model_type")
    if not model_type:
        return d
    from transformers import AutoConfig

    rest = {k: v for k, v in d.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **rest)
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning(
            "transformers could not build a %r config (%s: %s); reading the dict as it is",
            model_type,
            type(exc).__name__,
            exc,
        )
        return d


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (a model config), got {type(data).__name__}")  # noqa: TRY004 - bad file content
    return data


def _from_gguf(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def _from_string(spec: str) -> tuple[Any, str]:
    if not spec:
        raise ValueError("config must not be an empty string")
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return _from_gguf(p), p.stem
        if p.suffix.lower() == ".json":
            name = p.parent.name if p.name == "config.json" else p.stem
            return _from_mapping(_read_json(p)), name
        raise ValueError(f"config file {spec!r}: expected a config.json (or other .json) or a .gguf file")
    if p.is_dir():
        if (p / "config.json").is_file():
            return _from_mapping(_read_json(p / "config.json")), p.resolve().name
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0]), ggufs[0].stem
        raise ValueError(
            f"model folder {spec!r} holds no config.json and {len(ggufs)} .gguf files; "
            "expected a config.json or exactly one .gguf file"
        )
    if spec.endswith((".json", ".gguf")) or spec.startswith((".", "/", "~")):
        raise ValueError(f"config path {spec!r} does not exist")
    offline = _offline_config(spec)
    if offline is not None:
        return offline, spec
    return _from_hub(spec), spec


def _offline_config(name: str) -> Any | None:
    """The config of a kvbits offline model, or None if ``name`` is not one (or the registry is absent)."""
    try:
        models = importlib.import_module(_OFFLINE_REGISTRY)
    except ModuleNotFoundError as exc:
        if exc.name in ("kvbits.evaluate", _OFFLINE_REGISTRY):
            logger.debug("kvbits.evaluate.models is not available; skipping offline model names")
            return None
        raise
    registry = getattr(models, "OFFLINE_MODELS", None)
    if registry is not None and name not in registry:
        return None
    return models.load_config(name)


def _offline_names() -> list[str]:
    try:
        models = importlib.import_module(_OFFLINE_REGISTRY)
    except ModuleNotFoundError:
        return []
    return sorted(getattr(models, "OFFLINE_MODELS", {}))


def _from_hub(model_id: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as exc:
        names = _offline_names()
        first_line = (str(exc).splitlines() or [""])[0]
        raise ValueError(
            f"could not load a config for {model_id!r}: it is not an existing file or folder"
            + (f", not a kvbits offline model ({', '.join(names)})" if names else "")
            + f", and loading it as a Hugging Face hub id failed ({type(exc).__name__}: {first_line}). "
            "Offline? Pass a config.json, a model folder or a .gguf file, or plan from dimensions "
            "(layers, kv_heads, head_dim)."
        ) from exc
