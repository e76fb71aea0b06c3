"""Finding a model's config: :func:`resolve_config` turns anything a user may hold (a transformers
config, a dict, a ``config.json``, a model folder, a ``.gguf`` file, a kvbits offline-model name, a
hub id) into a config object or mapping, and a name for tables.

transformers is imported only when a config has to be built or loaded.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvbits.plan.shape import ModelShape

logger = logging.getLogger(__name__)

__all__ = ["GgufVocab", "gguf_problem", "gguf_tensor_types", "gguf_vocab", "resolve_config", "with_gguf_vocab"]

_OFFLINE_REGISTRY = "kvbits.evaluate.models"  # written by the evaluate stage; optional here


def resolve_config(source: Any) -> tuple[Any, str]:
    """Turn ``source`` into a config (a transformers config object or a plain mapping) and a name.

    Accepted, tried in this order for strings: a kvbits offline model name (``kvbits.evaluate.models``,
    when that module exists; before local paths, as ``kvbits eval`` resolves a model, so a folder of the
    same name in the working directory does not make ``plan`` and ``eval`` read two models); an
    existing ``.gguf`` file, ``*.json`` file or model folder (holding ``config.json`` or exactly one
    ``.gguf``); a Hugging Face hub id.

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


def _from_mapping(d: dict[str, Any], source: str = "the config dict") -> Any:
    """Build the transformers config class for ``d["model_type"]`` so that class defaults apply.

    A config.json may leave out fields whose class default matters (Gemma's ``head_dim=256``, the
    default ``layer_types``). Dicts without a ``model_type``, or whose type transformers does not know,
    are read as they are. A config its class refuses (a field of the wrong type, a field transformers
    divides by set to 0, too few ``layer_types``, an unknown dtype) is a ``ValueError`` naming ``source``
    (the file, in messages) and the field.
    """
    model_type = d.get("model_type")
    if not model_type:
        return d
    _check_fields(d, source)
    from transformers import CONFIG_MAPPING, AutoConfig

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        # AutoConfig's error for it lists every model type transformers knows (12,146 characters)
        logger.warning("transformers does not know model type %r; reading the dict as it is", model_type)
        return d
    rest = {k: v for k, v in d.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **rest)
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning(
            "transformers could not build a %r config (%s: %.300s); reading the dict as it is",
            model_type,
            type(exc).__name__,
            exc,
        )
        return d
    except _strict_errors() as exc:  # huggingface_hub's validation of the config dataclass
        raise ValueError(f"{source} is not a valid {model_type!r} config: {_refusal(d, exc)}") from exc
    except ZeroDivisionError as exc:
        zeros = _zero_counts(d)
        raise ValueError(
            f"{source} is not a valid {model_type!r} config: transformers divides by a field that is 0 "
            f"({', '.join(zeros) or 'a size or head count'}); expected a positive integer"
        ) from exc


_COUNT_WORDS = ("head", "layer", "size", "dim", "embd", "n_")
_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads")
_DTYPE_FIELDS = ("dtype", "torch_dtype")


def _is_count(key: str) -> bool:
    """True for config keys that hold a size or a count (``num_attention_heads``, ``hidden_size``, ...)."""
    return any(word in key for word in _COUNT_WORDS) and not key.endswith("_id")


def _zero_counts(d: dict[str, Any], prefix: str = "") -> list[str]:
    """The size and count fields of ``d`` (and of its sub-configs, dotted) that are 0."""
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _zero_counts(value, f"{prefix}{key}.")
        elif type(value) is int and value == 0 and _is_count(key):
            out.append(prefix + key)
    return out


def _check_fields(d: dict[str, Any], source: str, prefix: str = "") -> None:
    """``ValueError`` for fields transformers would fail on deep inside (ZeroDivisionError,
    AttributeError), naming ``source`` and the field: a head count below 1, an unknown dtype name; in
    sub-configs (``text_config``) too."""
    for key, value in d.items():
        if isinstance(value, dict):
            _check_fields(value, source, f"{prefix}{key}.")
        elif key in _HEAD_FIELDS and type(value) is int and value < 1:
            raise ValueError(
                f"{source}: {prefix}{key} must be a positive integer (the attention heads), got {value}"
            )
        elif key in _DTYPE_FIELDS and isinstance(value, str) and not _is_torch_dtype(value):
            raise ValueError(
                f"{source}: {prefix}{key} {value!r} is not a torch dtype; expected a name such as "
                "'float16', 'bfloat16' or 'float32'"
            )


def _refusal(d: dict[str, Any], exc: Exception) -> str:
    """Why transformers' validation refused ``d``, by field names where kvbits can tell (its own messages
    say "the hidden size" for ``hidden_size``)."""
    cause = str(exc.__cause__ if exc.__cause__ is not None else exc)
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    divides = type(hidden) is int and type(heads) is int and heads > 0 and hidden % heads == 0
    if "hidden size" in cause.lower() and type(hidden) is int and type(heads) is int and not divides:
        return f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})"
    return cause


def _is_torch_dtype(name: str) -> bool:
    """True when ``torch.<name>`` is a dtype; True as well without torch (transformers then keeps the
    name as it is)."""
    if importlib.util.find_spec("torch") is None:
        return True
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def _strict_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's strict-dataclass validation errors (transformers 5 configs), or none."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not validated
        return ()
    return (StrictDataclassError,)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, read as UTF-8 (JSON's encoding, RFC 8259; not the locale's, which under a C
    locale refused any non-ASCII byte); ``ValueError`` naming ``path`` when it is not UTF-8 JSON text (a
    safetensors file renamed, a UTF-16 export) or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not a UTF-8 JSON text file (a model config): {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (a model config), got {type(data).__name__}")  # noqa: TRY004 - bad file content
    return data


_GGUF_MAGIC = b"GGUF"


def _from_gguf(path: Path) -> Any:
    """The config transformers reads from the GGUF file ``path``; ``ValueError`` when the file is empty,
    not a GGUF file, cut short (a partial download: ``struct.error`` or a numpy reshape deep inside) or
    holds a model transformers can not read. The config says how the file stores its weights
    (:func:`_with_gguf_weights`). Llama and Qwen2 files are read from their header
    (:func:`kvbits.plan.gguf_config.gguf_config_from_file`: 0.05 s for Qwen2.5-Coder-0.5B's instead of AutoConfig's
    ~8 s, the same config); any other architecture, or a file that reader refuses, through AutoConfig."""
    from kvbits.plan.gguf_config import gguf_config_from_file

    config = gguf_config_from_file(path)
    if config is not None:
        return _with_gguf_weights(with_gguf_vocab(config, path), path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as exc:  # numpy's "cannot reshape array", transformers' own refusals
        problem = gguf_problem(path)
        message = f"{path} {problem}" if problem else f"could not read a model config from {path}: {exc}"
        raise ValueError(message) from exc
    except (struct.error, EOFError, IndexError) as exc:
        problem = gguf_problem(path)
        if problem is None:
            raise
        raise ValueError(f"{path} {problem}") from exc
    return _with_gguf_weights(with_gguf_vocab(config, path), path)


_GGUF_FLOATS = ("BF16", "F16", "F32", "F64")  # GGML types of plain floats; any other is a quantized block format


def _with_gguf_weights(config: Any, path: Path) -> Any:
    """``config`` (read from the GGUF file ``path``) saying how the file stores its weights, which the config
    transformers reads from a GGUF does not: a file holding quantized blocks (Q4_K, Q8_0, ...) gets a
    ``quantization_config`` ``{"quant_method": "gguf", "weight_types": [...]}`` (as transformers' own ``GgufConfig``
    on a model it loaded with the blocks kept), so the planner does not estimate its weights at the dtype's bytes
    per parameter (on the GPU they are the blocks, or floats of the dtype the loader dequantizes them to: float32
    by default); a file of plain floats without a dtype in its config gets the dtype transformers'
    ``dtype="auto"`` loads it in (its half type, else float32)."""
    types = gguf_tensor_types(path)
    blocks = sorted(t for t in types if t not in _GGUF_FLOATS)
    if blocks:
        if getattr(config, "quantization_config", None) is None:
            config.quantization_config = {"quant_method": "gguf", "gguf_file": path.name, "weight_types": blocks}
    elif types and getattr(config, "dtype", None) is None and getattr(config, "torch_dtype", None) is None:
        config.dtype = "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"
    return config


def gguf_tensor_types(path: Path) -> set[str]:
    """The GGML types of the tensors of the GGUF file ``path`` (``{"Q4_1", "Q8_0", "F32"}``), from its header
    (:func:`_gguf_header`: read once for this and :func:`gguf_vocab`)."""
    return set(_gguf_header(path).types)


class GgufVocab(NamedTuple):
    """What a GGUF file says about its vocabulary.

    Attributes:
        tokenizer: its ``tokenizer.ggml.model`` (``"gpt2"``, ``"llama"``), None where it has none.
        tokens: the length of its ``tokenizer.ggml.tokens``, None where it has none.
        stated: its ``<arch>.vocab_size``, else ``tokens`` (what transformers takes as the config's vocab size).
        tensor: ``(name, rows)`` of its ``token_embd.weight`` (else ``output.weight``) tensor, rows being the
            vocab size its weights have; None where it holds neither.
    """

    tokenizer: str | None
    tokens: int | None
    stated: int | None
    tensor: tuple[str, int] | None


_GGUF_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


class _GgufHeader(NamedTuple):
    """What kvbits reads from a GGUF file's header: its metadata (``tokenizer.ggml.tokens`` as its length), its
    tensors' shapes (torch order) and the GGML type names of its tensors."""

    metadata: Mapping[str, Any]
    shapes: Mapping[str, tuple[int, ...]]
    types: frozenset[str]


def _gguf_header_gguf(path: Path) -> _GgufHeader:
    """The header of ``path`` through gguf's ``GGUFReader`` (~4 s for SmolLM2-135M's: it reads every value)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata: dict[str, Any] = {}
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        field = reader.get_field(key)
        if field is not None:
            metadata[key] = field.contents() if key != "tokenizer.ggml.tokens" else len(field.data)
    arch = metadata.get("general.architecture")
    field = reader.get_field(f"{arch}.vocab_size")
    if field is not None:
        metadata[f"{arch}.vocab_size"] = int(field.contents())
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # ggml order reversed
    return _GgufHeader(metadata, shapes, frozenset(t.tensor_type.name for t in reader.tensors))


def _gguf_header(path: Path) -> _GgufHeader:
    """The header of the GGUF file ``path``, read once per file version (its real path, size and modification
    time): planning reads both its vocab (:func:`with_gguf_vocab`) and its tensor types (:func:`_with_gguf_weights`),
    and loading its vocab again (``check_gguf_tokenizer``). The walk :func:`kvbits.plan.gguf_config.read_gguf_table`
    also reads the config from (~40 ms), else gguf's ``GGUFReader`` (~4-11 s): a transformers without the walk's
    reader, or a type gguf's names do not cover, or a file cut short in its header.
    """
    stat = path.stat()
    return _gguf_header_cached(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_header_cached(path: str, size: int, mtime_ns: int) -> _GgufHeader:
    """``_gguf_header`` of the file at ``path`` (``size`` and ``mtime_ns`` key the cache alone)."""
    from kvbits.plan.gguf_config import read_gguf_table

    table = read_gguf_table(Path(path))
    if table is not None:
        return _GgufHeader(table.metadata, {name: shape for name, shape, *_ in table.tensors}, table.types)
    logger.debug("could not walk the GGUF header of %s; using gguf's reader", path)
    return _gguf_header_gguf(Path(path))


def gguf_vocab(path: Path) -> GgufVocab:
    """The vocabulary metadata and the embedding tensor's rows of the GGUF file ``path`` (its header alone:
    ~40 ms for SmolLM2-135M or Qwen2.5-Coder-0.5B with the header walk, ~4-11 s with gguf's ``GGUFReader``, which
    reads what the walk does not: a transformers without its reader, or a file cut short in its header: see
    :func:`_gguf_header`)."""
    metadata, shapes, _ = _gguf_header(path)
    tokens = metadata.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, int) or tokens is None else len(tokens)
    stated = metadata.get(f"{metadata.get('general.architecture')}.vocab_size", tokens)
    tensor = next(((n, int(shapes[n][0])) for n in _GGUF_VOCAB_TENSORS if shapes.get(n)), None)
    model = metadata.get("tokenizer.ggml.model")
    return GgufVocab(str(model) if model is not None else None, tokens, int(stated) if stated is not None else None,
                     tensor)


def with_gguf_vocab(config: Any, path: Path) -> Any:
    """``config`` (read by transformers from the GGUF file ``path``) with the vocab size of the file's weights
    where the file states none (no ``<arch>.vocab_size``, no ``tokenizer.ggml.tokens``: a GGUF written without
    its tokenizer), logged as a warning; transformers left its config class's default there (Llama: 32000).

    Raises:
        ValueError: the file states no vocab size and holds no ``token_embd.weight`` or ``output.weight``
            tensor to take it from.
    """
    vocab = gguf_vocab(path)
    if vocab.stated is not None:
        return config
    if vocab.tensor is None:
        raise ValueError(
            f"{path} states no vocab size (no <arch>.vocab_size or tokenizer.ggml.tokens metadata) and holds no "
            f"{' or '.join(_GGUF_VOCAB_TENSORS)} tensor to read it from"
        )
    name, rows = vocab.tensor
    logger.warning(
        "%s holds no tokenizer vocabulary (tokenizer.ggml.tokens) and no vocab_size: vocab_size %d taken from "
        "the shape of its %s tensor", path, rows, name,
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.vocab_size = rows
    return config


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole GGUF file (a phrase following the path), or None when gguf's reader
    reads it through (or the ``gguf`` package is not installed to tell)."""
    with path.open("rb") as f:
        head = f.read(len(_GGUF_MAGIC))
    if not head:
        return "is empty, not a GGUF file"
    if head != _GGUF_MAGIC:
        return f"is not a GGUF file: it does not start with the GGUF magic bytes (got {head!r})"
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    try:
        GGUFReader(path)
    except Exception:  # noqa: BLE001 - any failure to read the file through is the answer
        return (
            f"is not a complete GGUF file: its {path.stat().st_size} bytes end before the metadata and "
            "tensors it declares do, or it is corrupt (a download cut short? fetch it again)"
        )
    return None


def _from_string(spec: str) -> tuple[Any, str]:
    if not spec:
        raise ValueError("config must not be an empty string")
    if spec in _offline_names():  # before local paths, as kvbits eval's resolve_model: plan what eval runs
        offline = _offline_config(spec)
        if offline is not None:
            return offline, spec
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return _from_gguf(p), p.stem
        if p.suffix.lower() == ".json":
            name = p.resolve().parent.name if p.name == "config.json" else p.stem
            return _from_mapping(_read_json(p), str(p)), name
        raise ValueError(f"config file {spec!r}: expected a config.json (or other .json) or a .gguf file")
    if p.is_dir():
        if (p / "config.json").is_file():
            return _from_mapping(_read_json(p / "config.json"), str(p / "config.json")), p.resolve().name
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0]), ggufs[0].stem
        raise ValueError(
            f"model folder {spec!r} holds no config.json and {len(ggufs)} .gguf files; "
            "expected a config.json or exactly one .gguf file"
        )
    if spec.lower().endswith((".json", ".gguf")) or spec.startswith((".", "/", "~")):
        raise ValueError(f"config path {spec!r} does not exist")
    near = _near_offline_name(spec)
    if near is not None:
        raise ValueError(
            f"model {spec!r} is not a kvbits offline model; did you mean {near!r}? (taken as a Hugging Face hub id "
            "it would be fetched from the hub, with retries where there is no network; a hub id has the form "
            "org/name)"
        )
    return _from_hub(spec), spec


def _near_offline_name(spec: str) -> str | None:
    """The offline model name ``spec`` is a likely typo of (``kvbits.evaluate.models``), else None."""
    try:
        source = importlib.import_module("kvbits.evaluate.models.source")
    except ModuleNotFoundError:
        return None
    return source.near_registry_name(spec)


def _offline_config(name: str) -> Any | None:
    """The config of a kvbits offline model, or None if ``name`` is not one (or the registry is absent).

    A registry model held as a GGUF file is read as that file is (:func:`_from_gguf`: its quantized weight types,
    the 2-byte default dtype), fetched first where it is not cached; not from the float32 copy ``kvbits eval``
    converts it to, which would make the plan depend on whether that copy is in the cache (4-byte dtype and
    float32 weights when it is, 2 bytes when not)."""
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
    source = models.resolve_model(name)
    if source.gguf_file is not None:
        return _from_gguf(Path(source.path) / source.gguf_file)
    return models.load_config(source)


def _offline_names() -> list[str]:
    try:
        models = importlib.import_module(_OFFLINE_REGISTRY)
    except ModuleNotFoundError:
        return []
    return sorted(getattr(models, "OFFLINE_MODELS", {}))


def _from_hub(model_id: str) -> Any:
    from transformers import AutoConfig

    from kvbits._hub import hub_failure, hub_load_kwargs, hub_offline_if

    kwargs, unreachable = hub_load_kwargs(f"the config of {model_id!r}")
    try:
        with hub_offline_if(unreachable):
            return AutoConfig.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as exc:
        names = _offline_names()
        raise ValueError(
            f"could not load a config for {model_id!r}: it is not an existing file or folder"
            + (f", not a kvbits offline model ({', '.join(names)})" if names else "")
            + f", and loading it as a Hugging Face hub id failed ({hub_failure(exc, unreachable)}). "
            "Offline? Pass a config.json, a model folder or a .gguf file, or plan from dimensions "
            "(layers, kv_heads, head_dim)."
        ) from exc
