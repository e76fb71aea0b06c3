"""A GGUF file's transformers config for planning, built from the header kvbits already read.

``AutoConfig.from_pretrained(dir, gguf_file=...)`` sends the architectures transformers' own fast path does not
cover (Llama and Qwen2 among them, transformers 5.25) through ``load_gguf_checkpoint``, which builds gguf's full
``GGUFReader``: it parses every metadata value element by element (SmolLM2-135M's 49,152-token vocabulary) and
every tensor's info, 4.4 s of the 7.1 s ``kvbits plan --model smollm2-135m`` spent reading its config. For the
architectures in :data:`FAST_ARCHITECTURES` the config dict is rebuilt here from the file's metadata, read by
transformers' header reader (``read_gguf_metadata``: ~40 ms, string arrays as their length; it reads the metadata
and tensor names whatever the tensor types, where its ``GgufHeader`` refuses Q5_0 in the Qwen2.5 Q4_K_M file),
with transformers' own tables (``GGUF_CONFIG_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``), as
``load_gguf_checkpoint`` does for them. Any other architecture, a file that reader can not read (transformers
then says why), or a transformers without that reader or those tables gives None, and the caller asks
transformers.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

__all__ = ["FAST_ARCHITECTURES", "GgufTable", "gguf_config_dict", "gguf_config_from_file", "read_gguf_table"]

# architectures ``load_gguf_checkpoint`` treats with no special case (no renaming, no values from tensors beyond
# ``output.weight``, no post-processing) and the real-model tests compare against transformers' config
FAST_ARCHITECTURES = frozenset({"llama", "qwen2"})


def gguf_config_dict(metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any] | None:
    """The config dict ``load_gguf_checkpoint(..., return_tensors=False)["config"]`` gives for a file with this
    ``metadata`` (transformers' header reader's: string arrays as their length) and these tensors, or None
    where this module does not rebuild it (an architecture outside :data:`FAST_ARCHITECTURES`, a Llama file
    transformers reads as Mistral, a transformers without the mapping tables)."""
    architecture = metadata.get("general.architecture")
    if architecture not in FAST_ARCHITECTURES:
        return None
    name = metadata.get("general.name")
    if architecture == "llama" and isinstance(name, str) and "mistral" in name:  # transformers renames it
        return None
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError:
        return None
    if architecture not in GGUF_CONFIG_MAPPING:
        return None
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renames = GGUF_CONFIG_MAPPING.get(prefix)
        if not renames or rest not in renames:
            continue
        target = renames[rest]
        if target is None or target == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        config[target] = value
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return config


def gguf_config_from_file(path: Path) -> Any | None:
    """The transformers config ``AutoConfig.from_pretrained(path.parent, gguf_file=path.name)`` builds for the GGUF
    file ``path`` (:func:`gguf_config_dict`, through the same ``from_dict``), or None where this module does not
    rebuild it (see the module's docstring)."""
    header = _read_header(path)
    if header is None:
        return None
    metadata, tensor_names = header
    config_dict = gguf_config_dict(metadata, tensor_names)
    if config_dict is None:
        return None
    from transformers import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    return CONFIG_MAPPING[model_type].from_dict(config_dict, name_or_path=str(path.parent), _from_auto=True)


class GgufTable(NamedTuple):
    """A GGUF file's header, read by :func:`read_gguf_table` (no tensor data).

    Attributes:
        metadata: its metadata, string arrays (``tokenizer.ggml.tokens``) as their length.
        tensors: ``(name, shape, ggml type id, offset in the data section)`` of each tensor, its shape in torch
            order (ggml's reversed): ``token_embd.weight`` is ``(vocab, hidden)``.
        types: the GGML type names of its tensors (``{"Q5_0", "Q8_0", "F32"}``), as the ``gguf`` package names them.
        complete: whether the file is long enough to hold the tensor data its table declares (False: a download cut
            short in its tensor data).
    """

    metadata: dict[str, Any]
    tensors: tuple[tuple[str, tuple[int, ...], int, int], ...]
    types: frozenset[str]
    complete: bool


def read_gguf_table(path: Path) -> GgufTable | None:
    """The header of the GGUF file ``path``, walked once per file version (its real path, size and modification
    time: planning reads the config here and the vocab and tensor types through ``kvbits.plan.sources``) with
    transformers' header reader's metadata and tensor-table parsers and sized with the ``gguf`` package's block sizes (so any type gguf knows, Q5_0 included, which
    transformers' ``GgufHeader`` refuses: ~40 ms for Qwen2.5-Coder-0.5B's Q4_K_M file where gguf's ``GGUFReader``
    takes ~8 s; transformers 5.17 and 5.25 both have that reader and give the same table). None where it can not
    tell: a transformers without that reader, a file that is empty, not GGUF or cut short in its header, or a tensor
    type gguf does not name (the callers then ask transformers or gguf's reader, which say why)."""
    stat = os.stat(path)
    return _read_gguf_table_cached(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf_table_cached(path: str, size: int, mtime_ns: int) -> GgufTable | None:
    """:func:`read_gguf_table` of the file at ``path`` (``size`` and ``mtime_ns`` key the cache alone)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table
    except ImportError:
        return None
    try:
        blob = _mapped(str(path))
        metadata, tensor_count, pos = _read_metadata(blob, str(path))
        entries, pos = _read_tensor_table(blob, tensor_count, pos)
        alignment = int(metadata.get("general.alignment", 32))
        if alignment < 1:
            raise ValueError(f"general.alignment {alignment} is not a positive integer")
        data_start = (pos + alignment - 1) // alignment * alignment
        end = data_start
        types = set()
        for _, shape, ggml_type, offset in entries:
            ggml = GGMLQuantizationType(ggml_type)
            types.add(ggml.name)
            block, block_bytes = GGML_QUANT_SIZES[ggml]
            end = max(end, data_start + offset + math.prod(shape) // block * block_bytes)
    except (ValueError, KeyError, IndexError, TypeError, struct.error, UnicodeDecodeError) as exc:
        logger.debug("could not walk the GGUF header of %s (%s)", path, exc)
        return None
    return GgufTable(metadata, tuple(entries), frozenset(types), end <= len(blob))


def _read_header(path: Path) -> tuple[dict[str, Any], set[str]] | None:
    """``(metadata, tensor names)`` of the GGUF file ``path`` (:func:`read_gguf_table`), or None where it can not
    tell them or the file ends before the tensor data its table declares (a download cut short: transformers'
    reader, then gguf's, say so)."""
    table = read_gguf_table(path)
    if table is None or not table.complete:
        return None
    return table.metadata, {name for name, *_ in table.tensors}
