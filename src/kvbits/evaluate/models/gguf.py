"""The float32 transformers copy of a GGUF model, made once, verified and cached.

transformers parses the whole GGUF metadata (vocabulary and merges included) once for the config,
once for the tokenizer and twice for the weights: ~25 s for SmolLM2-135M on 2 cores, of which
dequantization is ~2 s. So the dequantized float32 model is saved once as a plain transformers
folder (safetensors + config.json + tokenizer.json) keyed by the GGUF sha256 and the transformers
version, verified tensor-by-tensor against the GGUF load, and loaded from there in ~1 s.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbits._model import check_weights_loaded
from kvbits.evaluate.models.locking import cache_lock, remove_leftovers
from kvbits.evaluate.models.registry import cache_dir, cached_file_sha256
from kvbits.evaluate.models.source import ModelSource
from kvbits.plan.sources import gguf_problem, gguf_vocab

logger = logging.getLogger(__name__)

__all__ = ["check_gguf_tokenizer", "converted_dir", "gguf_parse_errors"]

_CONVERSION_MARKER = "kvbits_conversion.json"
_CONVERSION_VERSION = 2  # 2: the marker records each file's sha256


def _gguf_sha256(source: ModelSource) -> str:
    assert source.gguf_file is not None
    return source.sha256 or cached_file_sha256(Path(source.path) / source.gguf_file)


def converted_dir(gguf_sha256: str) -> Path:
    """Folder holding the float32 transformers copy of the GGUF file with this sha256."""
    return cache_dir() / "converted" / gguf_sha256[:16]


def _conversion_record(source: ModelSource, sha: str) -> dict[str, Any]:
    import transformers

    return {
        "version": _CONVERSION_VERSION,
        "gguf_sha256": sha,
        "gguf_file": source.gguf_file,
        "transformers_version": transformers.__version__,
    }


_NOT_IDENTITY = ("files", "gguf_file")  # the folder's own files; the GGUF's name (its sha256 says what it holds)


def _identity(record: dict[str, Any]) -> dict[str, Any]:
    """What a conversion is made from and by: ``record`` less the file name the GGUF had (a renamed or copied
    file of the same sha256 converts to the same folder) and the converted files' hashes."""
    return {k: v for k, v in record.items() if k not in _NOT_IDENTITY}


def _valid_conversion(folder: Path, record: dict[str, Any]) -> bool:
    """Whether ``folder`` holds the conversion ``record`` describes, its files as written: the marker's
    ``files`` (name -> sha256, recorded at conversion) checked through ``cached_file_sha256``, which hashes a
    file again once it was written to (a damaged or truncated copy is converted again, not loaded)."""
    try:
        marker = json.loads((folder / _CONVERSION_MARKER).read_text(encoding="utf-8"))
        if not isinstance(marker, dict) or _identity(marker) != _identity(record):
            return False
        for name, sha in (marker.get("files") or {}).items():
            if cached_file_sha256(folder / name) != sha:
                logger.warning("%s changed since it was converted; converting again", folder / name)
                return False
        return True
    except (OSError, ValueError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def gguf_parse_errors(path: Path) -> Iterator[None]:
    """Around transformers' reading of GGUF file ``path``: an error it raises on a truncated or damaged
    file (a ``struct.error`` from a header-only file, a reshape error from a cut-off tensor) becomes a
    ``ValueError`` that names the file and says it is incomplete or not GGUF. Other errors (an
    architecture or tokenizer transformers does not support) pass unchanged: the file is read through
    with ``gguf`` first (:func:`kvbits.plan.sources.gguf_problem`, as ``kvbits plan`` does)."""
    try:
        yield
    except Exception as exc:
        problem = gguf_problem(path)
        if problem is None:
            raise
        raise ValueError(f"{path} {problem}") from exc


def check_gguf_tokenizer(path: Path) -> None:
    """``ValueError`` naming the GGUF file ``path`` when it holds no tokenizer (no ``tokenizer.ggml.model`` or
    ``tokenizer.ggml.tokens`` metadata: written without one). transformers' own error ("Cannot build a tokenizer
    from a GGUF file stating tokenizer None") names no file and comes after it read the whole metadata."""
    vocab = gguf_vocab(path)
    if vocab.tokenizer is None or vocab.tokens is None:
        missing = " and ".join(k for k, v in (("tokenizer.ggml.model", vocab.tokenizer),
                                              ("tokenizer.ggml.tokens", vocab.tokens)) if v is None)
        raise ValueError(
            f"{path} holds no tokenizer (no {missing} metadata): evaluating it needs one to tokenize text; use a "
            "GGUF file written with its tokenizer, or the model's transformers folder (kvbits plan reads this "
            "file as it is, its vocab size from the shape of its token_embd or output tensor)"
        )


def _convert_gguf(source: ModelSource) -> Path:
    """Return a verified float32 transformers folder for GGUF ``source``, converting once if needed."""
    sha = _gguf_sha256(source)
    final = converted_dir(sha)
    record = _conversion_record(source, sha)
    if _valid_conversion(final, record):
        return final
    # one process converts, the others wait and load its folder: a second conversion finishing later
    # would replace the folder the first process is loading from
    with cache_lock(cache_dir(), f"convert-{sha[:16]}", f"converting {source.gguf_file}") as held:
        if _valid_conversion(final, record):
            logger.info("%s was converted by another process: %s", source.gguf_file, final)
            return final
        if held:  # the temporary folder of a conversion that was killed
            remove_leftovers(final.parent, (f"{final.name}.*.tmp",))
        return _convert_locked(source, final, record)


def _convert_locked(source: ModelSource, final: Path, record: dict[str, Any]) -> Path:
    """Convert GGUF ``source`` into ``final`` (no valid copy there; the caller holds its cache lock)."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 transformers folder (once; a minute or more)",
                source.gguf_file)
    t0 = time.perf_counter()
    with gguf_parse_errors(Path(source.path) / source.gguf_file):
        check_gguf_tokenizer(Path(source.path) / source.gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        model, info = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                           dtype=torch.float32, output_loading_info=True)
    check_weights_loaded(info, str(Path(source.path) / source.gguf_file))
    config = copy.deepcopy(model.config)
    # the weights are now plain floats: without this the folder would load as a GGUF-quantized model
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # verify: the folder must give back exactly the tensors transformers dequantized
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).state_dict()
        expected = model.state_dict()
        bad = [k for k in expected if k not in reloaded or not torch.equal(expected[k], reloaded[k])]
        if bad or set(reloaded) != set(expected):
            raise RuntimeError(
                f"converted copy of {source.gguf_file} differs from the GGUF load in tensors "
                f"{(bad or sorted(set(reloaded) ^ set(expected)))[:5]}"
            )
        files = {p.name: cached_file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / _CONVERSION_MARKER).write_text(json.dumps({**record, "files": files}, indent=1), encoding="utf-8")
        if final.exists():  # stale: another transformers version, or a conversion cut short
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _valid_conversion(final, record):  # a concurrent run did not finish it either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s: %s", source.gguf_file, time.perf_counter() - t0, final)
    return final
