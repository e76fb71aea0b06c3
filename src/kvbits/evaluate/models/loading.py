"""Loading a model for evaluation: its config alone (for planning) or the model and tokenizer.

GGUF weights are dequantized by transformers to float (through the cached converted copy, see
:mod:`.gguf`); KV-cache quantization is then measured against this float model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbits._hub import hub_load_kwargs, hub_offline_if
from kvbits._model import check_causal_lm, check_weights_loaded
from kvbits.evaluate.models.gguf import (
    _conversion_record,
    _convert_gguf,
    _gguf_sha256,
    _valid_conversion,
    check_gguf_tokenizer,
    converted_dir,
    gguf_parse_errors,
)
from kvbits.evaluate.models.registry import OFFLINE_MODELS, cached_file_sha256
from kvbits.evaluate.models.source import ModelSource, _hub_error, resolve_model
from kvbits.plan.config import check_causal_config, max_positions
from kvbits.plan.sources import with_gguf_vocab

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "load_config", "load_model", "model_content_id"]


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    Attributes:
        model: the ``transformers`` causal LM, in eval mode.
        tokenizer: its tokenizer; None for a model folder without tokenizer files (token ids only:
            text data raises where it is tokenized).
        source: where it came from (``max_context`` filled from the config when it was unknown).
        fingerprint: 16 hex chars identifying the weights: the sha256 of the GGUF file or of a
            folder's weight files (plus the config), or hub id + config.
    """

    model: Any
    tokenizer: Any
    source: ModelSource
    fingerprint: str


# the files a tokenizer's vocabulary comes from (tokenizer.json, tokenizer.model, vocab.json + merges.txt,
# vocab.txt, spiece.model, tekken.json, *.tiktoken); tokenizer_config.json and special_tokens_map.json hold none:
# from them alone transformers builds a tokenizer of 1-3 tokens that encodes any text to no ids
_VOCABULARY_FILES = ("tokenizer.json", "vocab*", "*.model", "tekken.json", "*.tiktoken")
_TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")


def _has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary. Its config files without one are logged (a warning)
    and the model loads without a tokenizer: text then fails where it is tokenized, saying why."""
    if any(p.is_file() for pattern in _VOCABULARY_FILES for p in folder.glob(pattern)):
        return True
    configs = [name for name in _TOKENIZER_CONFIG_FILES if (folder / name).is_file()]
    if configs:
        logger.warning(
            "%s holds %s but no tokenizer vocabulary (expected one of %s): loading it without a tokenizer",
            folder, ", ".join(configs), ", ".join(_VOCABULARY_FILES),
        )
    return False


def _config_fingerprint(config: Any) -> str:
    d = config.to_dict()
    for key in ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "_commit_hash",
                "attn_implementation", "_attn_implementation_autoset", "quantization_config"):
        d.pop(key, None)
    return json.dumps(d, sort_keys=True, default=str)


def _weight_files(folder: Path) -> list[Path]:
    """The files transformers reads a folder's weights from: its ``.safetensors`` files when there
    are any (it prefers them), else its PyTorch ``.bin`` files."""
    safetensors = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    return safetensors or sorted(p for p in folder.glob("*.bin") if p.is_file())


def _fingerprint(source: ModelSource, config: Any) -> str:
    """16 hex chars identifying the weights: the GGUF file's sha256; for a local folder the sha256 of
    its weight files (by content: a renamed copy matches, other weights under the same name and config
    do not) plus the config; for a hub id (not hashed locally) the id plus the config."""
    if source.gguf_file is not None:
        key = f"gguf:{_gguf_sha256(source)}"
    elif source.is_local and (files := _weight_files(Path(source.path))):
        weights = [[f.name, cached_file_sha256(f)] for f in files]
        key = f"hf-weights:{json.dumps(weights)}:{_config_fingerprint(config)}"
    else:
        if source.is_local:
            logger.warning(
                "%s holds no .safetensors or .bin weight files: its fingerprint covers the name and "
                "config only", source.path,
            )
        key = f"hf:{source.name}:{_config_fingerprint(config)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def model_content_id(spec: str) -> str | None:
    """What a local model spec holds, by content, without loading it; None for registry names and hub
    ids (the registry pins its GGUF file's sha256; a hub id can not be hashed offline).

    ``gguf:<sha256>`` of a GGUF file; for a model folder ``files:`` + a hash of the sha256 of every
    file in it (weights, config, tokenizer, generation config; ``*.md`` and hidden files left out),
    so a run stored for this spec is not reused once any of them changed. Weight hashes are
    remembered (:func:`~kvbits.evaluate.models.registry.cached_file_sha256`).
    """
    if spec in OFFLINE_MODELS or not Path(spec).expanduser().exists():
        return None
    source = resolve_model(spec, download=False)
    if source.gguf_file is not None:
        return f"gguf:{_gguf_sha256(source)}"
    folder = Path(source.path)
    files = sorted(
        f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix != ".md"
    )
    listing = json.dumps([[f.name, cached_file_sha256(f)] for f in files])
    return "files:" + hashlib.sha256(listing.encode()).hexdigest()[:16]


def _check_finite_in(model: Any, dtype: torch.dtype, name: str) -> None:
    """``ValueError`` when a parameter of ``model`` (loaded in ``dtype``) is not finite, where ``dtype`` has a
    smaller range than float32 (float16: 65504): a weight beyond it became inf in the cast (a NaN logit at
    the first forward pass). One pass over the weights at load time; nothing for float32 and bfloat16."""
    import torch

    if not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(torch.float32).max:
        return
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(
            f"model {name!r} loaded in {dtype} has non-finite weights in {len(bad)} tensors ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): weights beyond {dtype}'s largest value "
            f"{torch.finfo(dtype).max:g} overflow it; load it in torch.float32 or torch.bfloat16"
        )


def load_config(spec: str | ModelSource, *, download: bool = True) -> Any:
    """Load only the ``transformers`` config of a model (for memory planning; no weights loaded).

    For GGUF models the config comes from the converted folder when present, else from the GGUF
    metadata (the file must be present; registry models are fetched as in :func:`resolve_model`).
    """
    from transformers import AutoConfig

    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, download=download)
    hub_kwargs, unreachable = ({}, None) if source.is_local else hub_load_kwargs(f"the config of {source.path!r}")
    try:
        if source.gguf_file is not None:
            folder = converted_dir(_gguf_sha256(source))
            if _valid_conversion(folder, _conversion_record(source, _gguf_sha256(source))):
                return AutoConfig.from_pretrained(folder)
            path = Path(source.path) / source.gguf_file
            with gguf_parse_errors(path):
                return with_gguf_vocab(AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file), path)
        with hub_offline_if(unreachable):
            return AutoConfig.from_pretrained(source.path, **hub_kwargs)
    except (OSError, ValueError) as exc:
        if source.is_local:
            raise
        raise _hub_error(source, exc, unreachable) from exc


def load_model(
    spec: str | ModelSource,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    download: bool = True,
    convert: bool = True,
    check_config: Callable[[Any], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer (None for a model folder without tokenizer files: its
    evaluations take token ids). An encoder or encoder-decoder is refused (``ValueError``,
    ``kvbits._model.check_causal_lm``), from its config before its weights load.

    GGUF weights are dequantized by transformers to float; KV-cache quantization is then measured
    against this float model, so the weight format does not bias comparisons.

    Args:
        spec: anything :func:`resolve_model` accepts, or a :class:`ModelSource`.
        dtype: parameter dtype (default ``torch.float32``).
        device: where to place the model.
        download: allow fetching registry models.
        convert: for GGUF sources, load from the verified float32 transformers copy in the cache
            (made on first use); False loads straight from the GGUF file (~25x slower, same tensors).
        check_config: called with the model's config before its weights load (where the config is read
            first: not for ``convert=False`` GGUF loads), to refuse what the config already rules out (a
            scheme's groups that do not divide the head dim) without the load.

    Returns:
        A :class:`LoadedModel`, the model in eval mode with attention implementation ``sdpa``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, download=download)
    t0 = time.perf_counter()
    path: str | Path = source.path
    kwargs: dict[str, Any] = {}
    unreachable = None
    if not source.is_local:
        kwargs, unreachable = hub_load_kwargs(f"model {source.path!r}")
    if source.gguf_file is not None:
        if convert:
            path = _convert_gguf(source)
        else:
            kwargs["gguf_file"] = source.gguf_file
    parsing = gguf_parse_errors(Path(path) / kwargs["gguf_file"]) if "gguf_file" in kwargs else contextlib.nullcontext()
    with_tokenizer = source.gguf_file is not None or not source.is_local or _has_tokenizer_files(Path(path))
    if not with_tokenizer:
        logger.info("%s holds no tokenizer files: loading it without a tokenizer (token ids only)", path)
    if "gguf_file" not in kwargs:  # an encoder or encoder-decoder is refused before its weights load
        try:
            with hub_offline_if(unreachable):
                config = AutoConfig.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as exc:
            if source.is_local:
                raise
            raise _hub_error(source, exc, unreachable) from exc
        check_causal_config(config, what=f"{source.name} ({type(config).__name__})")
        if check_config is not None:
            check_config(config)
    try:
        with parsing, hub_offline_if(unreachable):
            if "gguf_file" in kwargs:  # transformers' error for a GGUF without one names no file
                check_gguf_tokenizer(Path(path) / kwargs["gguf_file"])
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs) if with_tokenizer else None
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True, **kwargs
            )
    except (OSError, ValueError) as exc:
        if source.is_local:
            raise
        raise _hub_error(source, exc, unreachable) from exc
    check_weights_loaded(info, str(Path(path) / kwargs["gguf_file"]) if "gguf_file" in kwargs else str(path))
    check_causal_lm(model)
    _check_finite_in(model, dtype, source.name)
    model = model.to(device).eval()
    if source.max_context is None:
        ctx = max_positions(model.config)  # the text config's, as the planner reads it
        source = dataclasses.replace(source, max_context=ctx or None)
    fingerprint = _fingerprint(source, model.config)
    logger.info(
        "loaded %s (%s, %.1fM parameters) in %.1f s", source.name, dtype,
        sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - t0,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, fingerprint=fingerprint)
