"""Evaluation texts: registry, byte-exact loading, cached tokenization and context windows.

The texts live in ``shared/data`` beside the checkout (see its README). Tokenization, and so every
perplexity figure, depends on the exact bytes, so files are read as bytes, checked against their
sha256 and decoded as UTF-8 without touching line ends (WikiText-2 raw and *Moby-Dick* use CRLF); a leading
UTF-8 byte-order mark of a user's text file is dropped.

The data root is searched in this order (the first root holding the file wins):
``data_path`` argument, ``$KVBITS_DATA``, ``./../shared/data`` (from the current directory),
``<repo>/../shared/data`` (from this file), ``/work/shared/data``. A ``$KVBITS_DATA`` that is not a folder is
logged as a warning (once per value) naming it: the registry texts are checksummed, so the search goes on to the
default roots, but the user meant another one.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbits._files import atomic_path

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BOS_MODES",
    "TEXTS",
    "TextEntry",
    "TextSource",
    "bos_record",
    "check_bos",
    "data_search_path",
    "load_text",
    "make_windows",
    "resolve_bos",
    "text_content_id",
    "token_fingerprint",
    "tokenize",
]

_TOKEN_CACHE_VERSION = "2"  # 2: the tokenizer's splitting rules hashed too

_WARNED_ENV_ROOTS: set[str] = set()  # $KVBITS_DATA values already warned about (not a folder)


@dataclass(frozen=True)
class TextEntry:
    """A registered evaluation text.

    Attributes:
        name: registry name.
        relpath: path below the data root.
        sha256: hex sha256 of the file's bytes.
        n_bytes: size of the file in bytes.
        description: one line for listings.
    """

    name: str
    relpath: str
    sha256: str
    n_bytes: int
    description: str = ""


TEXTS: dict[str, TextEntry] = {
    e.name: e
    for e in (
        TextEntry("wikitext2", "wikitext-2-raw/wiki.test.raw",
                  "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c", 1_290_547,
                  "WikiText-2 raw, test split (short articles; CRLF line ends)"),
        TextEntry("war-and-peace", "gutenberg/war_and_peace.txt",
                  "dad0428404101a412ea924e47fd5735c2dea528502ecdcf3b45b698248f1691e", 3_227_325,
                  "Tolstoy, War and Peace (English): one very long document"),
        TextEntry("moby-dick", "gutenberg/moby-dick.txt",
                  "28ca0e0609fefbcf6d73db5fc9a90554f60c54502f7010328fda66690ec02fe4", 1_212_951,
                  "Melville, Moby-Dick (CRLF line ends)"),
        TextEntry("pride-and-prejudice", "gutenberg/pride_and_prejudice.txt",
                  "598a662b54193fed9ddc1065861f4a3ae206b22d449443e8c3ae6a6bf6b88e7b", 683_934,
                  "Austen, Pride and Prejudice"),
        TextEntry("ulysses", "gutenberg/ulysses.txt",
                  "3d9fabd9a4ff7269eeebbbc921c73b62e576a3de6d96a4c9d055b551c70734bb", 1_524_035,
                  "Joyce, Ulysses"),
    )
}


@dataclass(frozen=True)
class TextSource:
    """A loaded text.

    Attributes:
        name: registry name, file stem, or ``hub:...`` spec.
        text: the decoded text (line ends untouched).
        sha256: hex sha256 of the file's bytes (of the UTF-8 text for a hub dataset).
        path: the file read, or None for a hub dataset.
    """

    name: str
    text: str = field(repr=False)
    sha256: str
    path: str | None = None


# The data roots searched after a ``data_path`` argument, in order (the ``--data-path`` help lists these labels).
DEFAULT_DATA_ROOTS: tuple[str, ...] = ("$KVBITS_DATA", "./../shared/data", "<repo>/../shared/data", "/work/shared/data")
DATA_PATH_HELP = "folder searched first for registry texts (then " + ", then ".join(DEFAULT_DATA_ROOTS) + ")"


def _default_root(label: str) -> Path | None:
    """The root a :data:`DEFAULT_DATA_ROOTS` label names (``None``: ``$KVBITS_DATA`` unset)."""
    if label == "$KVBITS_DATA":
        env = os.environ.get("KVBITS_DATA")
        if not env:
            return None
        root = Path(env).expanduser()
        if not root.is_dir() and env not in _WARNED_ENV_ROOTS:
            _WARNED_ENV_ROOTS.add(env)  # once per value: every load_text searches the roots
            logger.warning("KVBITS_DATA=%s is not a folder (%s); searching the default data roots instead",
                           env, "a file" if root.exists() else "it does not exist")
        return root
    if label == "./../shared/data":
        return Path.cwd() / ".." / "shared" / "data"
    if label == "<repo>/../shared/data":
        return Path(__file__).resolve().parents[3] / ".." / "shared" / "data"  # <repo>/src/kvbits/evaluate/data.py
    return Path(label)


def data_search_path(data_path: str | os.PathLike[str] | None = None) -> list[Path]:
    """Candidate data roots, in search order, without duplicates (the default ones need not exist;
    a ``data_path`` given explicitly must be a folder: ``ValueError`` otherwise, rather than a silent
    fall back to the default roots; a ``$KVBITS_DATA`` that is not a folder is a logged warning, once per value)."""
    candidates: list[Path] = []
    if data_path is not None:
        given = Path(data_path).expanduser()
        if not given.is_dir():
            raise ValueError(
                f"data path {str(data_path)!r} is not a folder; expected the folder holding the registry "
                "texts (gutenberg/, wikitext-2-raw/), like ../shared/data"
            )
        candidates.append(given)
    for label in DEFAULT_DATA_ROOTS:  # the order the --data-path help states (DATA_PATH_HELP)
        root = _default_root(label)
        if root is not None:
            candidates.append(root)
    out: list[Path] = []
    seen: set[Path] = set()
    for c in candidates:
        key = c.resolve()
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


_UTF16_BOMS = ((codecs.BOM_UTF16_LE, "UTF-16 LE"), (codecs.BOM_UTF16_BE, "UTF-16 BE"))  # UTF-32 LE starts as LE
# file formats the loader does not read, by their first bytes: named in the "not UTF-8" error
_MAGIC = ((b"\x1f\x8b", "gzip-compressed: decompress it"), (b"BZh", "bzip2-compressed: decompress it"),
          (b"\xfd7zXZ\x00", "xz-compressed: decompress it"), (b"\x28\xb5\x2f\xfd", "zstd-compressed: decompress it"),
          (b"PK\x03\x04", "a zip archive: extract the text file"),
          (b"PAR1", "a Parquet file: give its text as a UTF-8 text file, or the dataset as hub:NAME"))
_JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
# tensor files (token ids saved by torch.save, np.save, safetensors): not text, named as such when not UTF-8
_TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".npz", ".safetensors")


def _decode(raw: bytes, where: str) -> str:
    """``raw`` decoded as UTF-8, line ends untouched; a leading UTF-8 byte-order mark (an editor's marker, not
    text: tokenized it would be 3 byte tokens and change the first word's token) is dropped, with a log line.
    ``ValueError`` for bytes that are not UTF-8, naming a UTF-16 byte-order mark where the file starts with one, and
    for a NUL character (UTF-16/32 without a byte-order mark: ``Hello`` as UTF-16 LE is valid UTF-8, ``H\\x00e\\x00...``)."""
    if raw.startswith(codecs.BOM_UTF8):
        logger.info("%s starts with a UTF-8 byte-order mark; dropped (it is not part of the text)", where)
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bom = next((name for mark, name in _UTF16_BOMS if raw.startswith(mark)), None)
        kind = next((what for magic, what in _MAGIC if raw.startswith(magic)), None)
        hint = f"; it starts with a {bom} byte-order mark: save it as UTF-8" if bom else f"; it is {kind}" if kind else ""
        raise ValueError(f"{where} is not valid UTF-8 text ({exc}){hint}") from None
    if (at := text.find("\x00")) >= 0:  # UTF-16/32 of ASCII text without a byte-order mark decodes as UTF-8
        raise ValueError(
            f"{where} holds a NUL character (at character {at}): not UTF-8 text but UTF-16 or UTF-32 saved without "
            "a byte-order mark, or a binary file; expected UTF-8 text: save it as UTF-8"
        )
    return text


def _check_has_text(text: str, what: str) -> str:
    """``text``, or ``ValueError`` naming ``what`` when it is empty or whitespace alone: it tokenizes to no window
    of any context, and would fail only after the model has loaded (minutes for a converted GGUF model)."""
    if not text or text.isspace():
        raise ValueError(
            f"{what} holds no text ({len(text)} characters{', whitespace alone' if text else ''}); expected a "
            "long natural-language text (thousands of tokens per window)"
        )
    return text


def _load_registered(entry: TextEntry, roots: list[Path]) -> TextSource:
    for root in roots:
        path = root / entry.relpath
        if path.is_file():
            break
    else:
        raise FileNotFoundError(
            f"text {entry.name!r} ({entry.relpath}) not found under any data root: "
            f"{[str(r) for r in roots]}; set KVBITS_DATA to the folder holding {entry.relpath.split('/')[0]}/"
        )
    with open(path, "rb") as f:
        raw = f.read()
    sha = hashlib.sha256(raw).hexdigest()
    if sha != entry.sha256:
        raise ValueError(
            f"{path} is not byte-exact: sha256 {sha} ({len(raw)} bytes), expected {entry.sha256} "
            f"({entry.n_bytes} bytes); restore the original file (line ends and encoding included)"
        )
    return TextSource(entry.name, _decode(raw, str(path)), sha, str(path.resolve()))


def _load_hub(spec: str) -> TextSource:
    """A ``hub:NAME[:CONFIG[:SPLIT]]`` text: the rows of its text column joined in order. Rows that all end in a
    line end (WikiText's) are joined with ``""``, so ``hub:wikitext:wikitext-2-raw-v1`` is the registry's
    ``wikitext2`` file line for line (LF line ends where that file has CRLF; its empty rows add nothing); other rows
    are joined with ``"\\n"``. This is not the published perplexity recipes' ``"\\n\\n".join(rows)`` (GPTQ, KVQuant,
    Hugging Face's perplexity guide), which adds a blank line after every row and an empty row's two line ends: other
    tokens, so perplexities near, not equal to, those tables'."""
    parts = spec.split(":")
    if len(parts) < 2 or len(parts) > 4 or not parts[1]:
        raise ValueError(f"hub text spec must be 'hub:NAME[:CONFIG[:SPLIT]]', got {spec!r}")
    name, config, split = parts[1], (parts[2] if len(parts) > 2 and parts[2] else None), (
        parts[3] if len(parts) > 3 and parts[3] else "test")
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"text {spec!r} needs the 'datasets' package (pip install datasets), which is not installed"
        ) from None
    from kvbits._hub import hub_failure, hub_offline, hub_unreachable

    unreachable = hub_unreachable()  # no network: the datasets cache alone, not ~24 s of retries
    if unreachable:
        logger.info("the Hugging Face hub is unreachable (%s): loading %s from the local cache only", unreachable, name)
    try:
        with hub_offline() if unreachable else contextlib.nullcontext():
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # any hub/network failure becomes one clear error (re-raised below)
        why = hub_failure(exc, unreachable) if unreachable else f"{type(exc).__name__}: {exc}"
        raise ValueError(
            f"could not load hub dataset {name!r} (config {config!r}, split {split!r}): {why}. Offline? Give the "
            f"text as a local file instead: a path to a UTF-8 text file, or one of {sorted(TEXTS)} (read from a data "
            f"root: --data-path, then {', then '.join(DEFAULT_DATA_ROOTS)}; 'wikitext2' is WikiText-2 raw, test split)"
        ) from exc
    # a feature's type: a Value has a dtype ("string"); a nested one (a dict of features, a list) has none
    kinds = {c: getattr((ds.features or {}).get(c), "dtype", None) for c in ds.column_names}
    column = next((c for c in ["text", *ds.column_names] if kinds.get(c) in ("string", "large_string")), None)
    if column is None:
        found = {c: k or type((ds.features or {}).get(c)).__name__ for c, k in kinds.items()}
        raise ValueError(
            f"hub dataset {name!r} has no text column: expected a column of strings ('text', or the first one of "
            f"string type); columns and their types: {found}"
        )
    rows = list(ds[column])
    if missing := sum(r is None for r in rows):  # a null in a string column: no text, as an empty row
        logger.warning("hub dataset %r: %d of %d rows of column %r are null; read as empty rows", name, missing,
                       len(rows), column)  # fmt: skip
        rows = ["" if r is None else r for r in rows]
    # WikiText rows keep their own line ends ("\n"): joined with "" they give the raw file's lines, but with LF ends
    # where the registry's wikitext-2-raw/wiki.test.raw ('wikitext2') has CRLF ones: not the same text or tokens
    sep = "" if all(r.endswith("\n") for r in rows if r) else "\n"
    text = _check_has_text(sep.join(rows), f"hub dataset {name!r} (column {column!r}, split {split!r})")
    return TextSource(spec, text, hashlib.sha256(text.encode("utf-8")).hexdigest(), None)


def load_text(spec: str, data_path: str | os.PathLike[str] | None = None) -> TextSource:
    """Load an evaluation text.

    Args:
        spec: a registry name (:data:`TEXTS`, checked against its sha256), a path to a UTF-8 text
            file, or ``hub:NAME[:CONFIG[:SPLIT]]`` for a Hugging Face dataset (needs ``datasets``
            and network; split defaults to ``test``).
        data_path: a data root searched before the default ones (see the module docstring).

    Raises:
        ValueError: unknown spec, a text file that does not exist, a registry file that is not
            byte-exact, text that is not UTF-8 (a NUL character included; a compressed, Parquet or tensor file
            is named), a ``.json``/``.jsonl`` file holding JSON, a text file or hub dataset that is empty or
            whitespace alone, a path that is not a regular file (a folder, a pipe, a device), or a ``data_path``
            that is not a folder.
        FileNotFoundError: a registry text missing from every data root.
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"text spec must be a non-empty str, got {spec!r}")
    roots = data_search_path(data_path)
    if spec in TEXTS:
        return _load_registered(TEXTS[spec], roots)
    if spec.startswith("hub:"):
        return _load_hub(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            raw = f.read()
        try:
            decoded = _decode(raw, str(path))
        except ValueError:
            if path.suffix.lower() not in _TENSOR_SUFFIXES:
                raise
            # torch.save's zip read "extract the text file", a safetensors header "UTF-16 saved without a byte-order mark"
            raise ValueError(
                f"text file {spec!r} is not text but a tensor file ({path.suffix}: token ids?): --data reads a UTF-8 "
                "text file; give token ids from Python, evaluate(model, ids, ...) with ids an integer tensor or NumPy "
                "array, (N,) or (W, context)"
            ) from None
        text = _check_has_text(decoded, f"text file {str(path)!r}")
        if path.suffix.lower() in _JSON_SUFFIXES and text.lstrip()[:1] in ("{", "["):
            # read as plain text, its keys, quotes and \u escapes would be tokenized into the perplexity
            raise ValueError(
                f"text file {spec!r} is JSON ({path.suffix}): it would be read as plain text, keys, quotes and escapes "
                "included; expected a plain UTF-8 text file: write the documents' text out to one"
            )
        return TextSource(path.stem, text, hashlib.sha256(raw).hexdigest(), str(path.resolve()))
    if path.is_dir():
        raise ValueError(f"text {spec!r} is a folder; expected a text file, or one of {sorted(TEXTS)}")
    if path.exists():  # a FIFO, /dev/stdin, a device: it exists, so "does not exist" would mislead
        raise ValueError(
            f"text {spec!r} is not a regular file (a pipe, a device or a socket); expected a UTF-8 text file: "
            "write the text out to one"
        )
    if "/" in spec or os.sep in spec or path.suffix:  # meant as a path: say the file is missing
        raise ValueError(
            f"text file {spec!r} does not exist; expected a path to a UTF-8 text file, or one of "
            f"{sorted(TEXTS)}"
        )
    raise ValueError(
        f"unknown text {spec!r}: expected one of {sorted(TEXTS)}, a path to a text file, or "
        f"'hub:NAME[:CONFIG[:SPLIT]]'; data roots searched: {', '.join(str(r.resolve()) for r in roots)}"
    )


def text_content_id(spec: str) -> str:
    """What a text spec holds, by content, without decoding it: ``sha256:<hex>`` of a registered
    text (its pinned hash: :func:`load_text` refuses any other bytes) or of a text file; the spec
    itself for a hub dataset, or for a path that does not exist (:func:`load_text` says why)."""
    if spec in TEXTS:
        return f"sha256:{TEXTS[spec].sha256}"
    path = Path(spec).expanduser()
    if spec.startswith("hub:") or not path.is_file():
        return spec
    from kvbits.evaluate.models.registry import file_sha256

    return f"sha256:{file_sha256(path)}"


# ---------------------------------------------------------------------------------- tokenization


def _cache_root() -> Path:
    env = os.environ.get("KVBITS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvbits"


def _tokenizer_rules(tokenizer: Any) -> str:
    """How ``tokenizer`` splits text beyond its vocabulary: a fast tokenizer's whole serialization (merges,
    normalizer, pre-tokenizer, added tokens: ``backend_tokenizer.to_str()``), a SentencePiece one's model, else
    ``""`` (the vocabulary alone then stands for it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "to_str", None)):
        return backend.to_str()
    sp = getattr(tokenizer, "sp_model", None)
    if sp is not None and callable(getattr(sp, "serialized_model_proto", None)):
        return hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    return ""


def token_fingerprint(text_source: TextSource, tokenizer: Any) -> str:
    """16 hex chars identifying (text bytes, tokenizer): the key of the token-id cache, and a run's ``tokens``
    fingerprint.

    Hashes the text's sha256, the tokenizer class, its size (``len(tokenizer)``, added tokens
    included), its sorted vocabulary and its splitting rules (``_tokenizer_rules``: two tokenizers of one
    vocabulary and other merges split text differently).
    """
    vocab = sorted(tokenizer.get_vocab().items())
    vocab_hash = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    rules_hash = hashlib.sha256(_tokenizer_rules(tokenizer).encode("utf-8")).hexdigest()
    key = "|".join([_TOKEN_CACHE_VERSION, text_source.sha256, type(tokenizer).__name__,
                    str(len(tokenizer)), vocab_hash, rules_hash])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tokenize(text_source: TextSource, tokenizer: Any, *, use_cache: bool = True) -> torch.Tensor:
    """Token ids of the whole text, shape ``(N,)``, dtype int64; no special tokens added.

    The text is tokenized in one call (``add_special_tokens=False``): splitting it into chunks could
    change tokens at the seams, and a fast tokenizer handles a few MB in seconds (WikiText-2 test,
    1.3 MB: ~1.5 s; War and Peace, 3.2 MB: ~4.5 s, on 2 cores). Results are cached in
    ``$KVBITS_CACHE/tokens/<token_fingerprint>.safetensors``; a cache that can not be written (read-only,
    full) is logged and the ids returned all the same.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    if tokenizer is None:
        raise ValueError(
            f"text {text_source.name!r} needs the model's tokenizer and the model has none (a model folder "
            "without tokenizer files, or a bare transformers module): add its tokenizer files, or give token ids"
        )
    fp = token_fingerprint(text_source, tokenizer)
    path = _cache_root() / "tokens" / f"{fp}.safetensors"
    if use_cache and path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                ids = f.get_tensor("ids")
            if meta.get("text_sha256") == text_source.sha256 and ids.dim() == 1:
                logger.debug("token ids for %s loaded from %s", text_source.name, path)
                return ids
            logger.warning("token cache %s does not match %s; re-tokenizing", path, text_source.name)
        except Exception as exc:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
            logger.warning("token cache %s unreadable (%s); re-tokenizing", path, exc)

    t0 = time.perf_counter()
    out = tokenizer(text_source.text, add_special_tokens=False, verbose=False)
    ids = torch.tensor(out["input_ids"], dtype=torch.long)
    logger.info("tokenized %s: %d chars -> %d tokens in %.1f s", text_source.name,
                len(text_source.text), ids.numel(), time.perf_counter() - t0)
    if use_cache:
        try:
            _save_token_cache(path, ids, text_source, tokenizer)
        except (OSError, SafetensorError) as exc:  # safetensors' own I/O errors are SafetensorError
            # a read-only or full cache costs the next run the tokenization, not this one its ids
            logger.warning("could not write the token cache %s (%s); the ids are not cached", path, exc)
    return ids


def _save_token_cache(path: Path, ids: torch.Tensor, text_source: TextSource, tokenizer: Any) -> None:
    """Write ``ids`` ``(N,)`` to the token cache file ``path`` atomically (a temporary file, then renamed)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # readable by another user of a shared cache, as a normally created file
        save_file({"ids": ids}, str(tmp), metadata={
            "version": _TOKEN_CACHE_VERSION, "text_name": text_source.name,
            "text_sha256": text_source.sha256, "tokenizer": type(tokenizer).__name__,
            "n_tokens": str(ids.numel()),
        })


BOS_MODES = ("auto", "always", "never")


def check_bos(mode: Any, model: Any = None) -> str:
    """Check a command's ``bos`` before its model loads, as every command that takes ``--bos`` does: ``mode`` one of
    ``BOS_MODES`` (``ValueError`` otherwise); with ``"always"`` and a ``model`` that already carries its tokenizer (a
    ``LoadedModel``: the tokenizer is had without loading weights), a tokenizer without a BOS is refused here, not
    once the model has loaded (``resolve_bos``'s message). Returns ``mode``."""
    if not isinstance(mode, str) or mode not in BOS_MODES:
        raise ValueError(f"bos must be one of {BOS_MODES}, got {mode!r}")
    tokenizer = getattr(model, "tokenizer", None) if model is not None and not isinstance(model, str) else None
    if mode == "always" and tokenizer is not None:
        resolve_bos(tokenizer, "always")
    return mode


def bos_token_text(tokenizer: Any, bos_id: int | None) -> str | None:
    """The text of the BOS ``bos_id`` (``"<|im_start|>"`` for SmolLM2-Instruct, ``"<s>"`` for Llama 2): the
    tokenizer's ``bos_token`` where its id is ``bos_id``, else ``convert_ids_to_tokens``; None without a BOS or a
    tokenizer, or where neither gives a string."""
    if bos_id is None or tokenizer is None:
        return None
    text = getattr(tokenizer, "bos_token", None)
    if isinstance(text, str) and getattr(tokenizer, "bos_token_id", None) == bos_id:
        return text
    try:
        text = tokenizer.convert_ids_to_tokens(int(bos_id))
    except Exception:  # noqa: BLE001 - a tokenizer without the method or the id: the token's text is not known
        return None
    return text if isinstance(text, str) else None


def bos_record(tokenizer: Any, bos_id: int | None) -> dict[str, Any]:
    """The ``"bos"`` fields of a summary (eval's ``summary.json``, ``speed.json``, ``needle.json``, the monitor's
    snapshot): ``{"bos": "never"}`` without a BOS, else ``{"bos": "always", "bos_token": <text or None>,
    "bos_token_id": <id>}`` (:func:`bos_token_text`)."""
    if bos_id is None:
        return {"bos": "never"}
    return {"bos": "always", "bos_token": bos_token_text(tokenizer, bos_id), "bos_token_id": int(bos_id)}


def resolve_bos(tokenizer: Any, mode: str = "auto") -> int | None:
    """The id every evaluation window starts with, or None for raw slices of the text.

    ``mode``: ``"never"`` (None), ``"always"`` (the tokenizer's ``bos_token_id``; ``ValueError`` when it has none),
    ``"auto"`` (what ``tokenizer(text)`` adds itself: its ``bos_token_id`` when a probe tokenized with special
    tokens starts with it and the same probe without them does not; Llama, Mistral and Gemma tokenizers add one,
    SmolLM2's and Qwen2.5's none). A tokenizer of None (token ids given) resolves ``"auto"`` to None.
    """
    if mode not in BOS_MODES:
        raise ValueError(f"bos must be one of {BOS_MODES}, got {mode!r}")
    if mode == "never" or (mode == "auto" and tokenizer is None):
        return None
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if mode == "always":
        if not isinstance(bos, int) or isinstance(bos, bool):
            raise ValueError(
                f"bos='always' needs a tokenizer with a BOS token; "
                f"{'no tokenizer was given' if tokenizer is None else type(tokenizer).__name__ + ' has no bos_token_id'}"
                ": use bos='never' (CLI: --bos never)"
            )
        return bos
    if not isinstance(bos, int) or isinstance(bos, bool):
        return None
    probe = "Hello world"
    try:
        with_special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        without = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    except Exception as exc:  # noqa: BLE001 - a tokenizer that can not be probed: its flag decides
        logger.debug("could not probe %s for a BOS (%s); reading add_bos_token", type(tokenizer).__name__, exc)
        return bos if getattr(tokenizer, "add_bos_token", False) is True else None
    adds = bool(with_special) and with_special[0] == bos and (not without or without[0] != bos)
    return bos if adds else None


def make_windows(
    ids: torch.Tensor, context: int, n_windows: int | None = None, bos_id: int | None = None
) -> torch.Tensor:
    """Cut token ids into non-overlapping windows from the start: window ``i`` is
    ``ids[i * context : (i + 1) * context]`` without a BOS; with ``bos_id`` it is ``bos_id`` followed by
    ``ids[i * (context - 1) : (i + 1) * (context - 1)]`` (the BOS is never a target: position 0 is not scored).

    Args:
        ids: token ids, shape ``(N,)``.
        context: tokens per window (a Python or NumPy integer), the BOS included.
        n_windows: how many windows (an integer); None for as many as fit. More than fit gives what fits and a
            logged warning.
        bos_id: the id each window starts with (:func:`resolve_bos`), or None for raw slices.

    Returns:
        A new tensor of shape ``(W, context)`` (a copy: later edits do not touch ``ids``).

    Raises:
        ValueError: bad ``context``/``n_windows``/``bos_id`` (``context`` must be >= 2 with a BOS), or fewer
            text tokens than one window holds.
        TypeError: ``ids`` is not a 1-D integer tensor.
    """
    import torch

    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.is_complex():
        got = f"{type(ids).__name__} {tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) \
            else type(ids).__name__
        raise TypeError(f"ids must be a 1-D integer tensor of shape (N,), got {got}")
    # a Python or NumPy integer (numbers.Integral: np.int64 from an array of lengths), not a bool
    if isinstance(context, bool) or not isinstance(context, numbers.Integral) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    if n_windows is not None and (isinstance(n_windows, bool) or not isinstance(n_windows, numbers.Integral)
                                  or n_windows < 1):
        raise ValueError(f"n_windows must be a positive int or None, got {n_windows!r}")
    if bos_id is not None and (isinstance(bos_id, bool) or not isinstance(bos_id, numbers.Integral) or bos_id < 0):
        raise ValueError(f"bos_id must be a token id (an int >= 0) or None, got {bos_id!r}")
    if bos_id is not None and context < 2:
        raise ValueError(f"context must be >= 2 with a BOS (the BOS and at least one text token), got {context}")
    context, n_windows = int(context), None if n_windows is None else int(n_windows)
    step = context - (bos_id is not None)  # text tokens per window
    fit = ids.numel() // step
    if fit == 0:
        bos_note = f" ({step} text tokens after the BOS)" if bos_id is not None else ""
        raise ValueError(
            f"text has {ids.numel()} tokens, fewer than one window of context={context} tokens{bos_note}"
        )
    if n_windows is None:
        n_windows = fit
    elif n_windows > fit:
        logger.warning("asked for %d windows of %d tokens but the text (%d tokens) holds only %d; "
                       "using %d", n_windows, context, ids.numel(), fit, fit)
        n_windows = fit
    text = ids[: n_windows * step].reshape(n_windows, step)
    if bos_id is None:
        return text.clone()
    return torch.cat([text.new_full((n_windows, 1), int(bos_id)), text], dim=1)


def check_token_ids(ids: torch.Tensor, model: Any = None, what: str = "token ids") -> None:
    """``TypeError`` unless ``ids`` is an integer tensor (float ids were truncated, bools read as 0 / 1);
    ``ValueError`` when an id is outside ``model``'s embedding table (torch's ``index out of range``
    otherwise, deep inside the first layer). ``model``: anything with ``get_input_embeddings()``, or None
    (no range check)."""
    import torch

    if not isinstance(ids, torch.Tensor) or ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.is_complex():
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{what} must be an integer tensor, got {got}")
    n = _embedding_size(model)
    if n is None or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n:
        raise ValueError(
            f"{what} must lie in [0, {n}) (the model's embedding table), got ids from {lo} to {hi}: "
            "token ids of another tokenizer?"
        )


def _embedding_size(model: Any) -> int | None:
    """Rows of ``model``'s input embedding table (``get_input_embeddings().num_embeddings``); None when unknown."""
    embed = getattr(model, "get_input_embeddings", lambda: None)() if model is not None else None
    n = getattr(embed, "num_embeddings", None)
    return int(n) if isinstance(n, int) else None


def check_tokenized(ids: torch.Tensor, tokenizer: Any, model: Any, what: str = "the text") -> None:
    """``ValueError`` when ``tokenizer`` wrote an id past ``model``'s embedding table (torch's ``IndexError:
    index out of range in self`` inside the first layer otherwise): a tokenizer with more ids than the model
    embeds. Once per tokenized text, on the host, before the first forward; ``ids`` any shape, int64.
    ``model`` without ``get_input_embeddings()`` (or None): nothing to check."""
    n = _embedding_size(model)
    if n is None or ids.numel() == 0:
        return
    flat = ids.reshape(-1)
    hi = int(flat.max())
    if hi < n:
        return
    at = int((flat >= n).nonzero()[0, 0])
    vocab = _vocab_size(tokenizer)
    raise ValueError(
        f"{what} tokenizes to id {int(flat[at])} (token {at}; the largest is {hi}), past the model's embedding table "
        f"of {n} ids: the tokenizer has {vocab} ids, more than the model embeds; use the model's own tokenizer"
    )


def _vocab_size(tokenizer: Any) -> str:
    """The tokenizer's id count with its added tokens (``len(tokenizer)``), else ``vocab_size``; ``"?"``."""
    try:
        return str(len(tokenizer))
    except TypeError:
        n = getattr(tokenizer, "vocab_size", None)
        return str(n) if isinstance(n, int) else "?"
