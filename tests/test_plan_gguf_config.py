"""kvbits plan reads a Llama or Qwen2 GGUF's config from its header (kvbits.plan.gguf_config), not through
``AutoConfig.from_pretrained(gguf_file=...)``, which builds gguf's full GGUFReader for them: 7.1 s of the 8.7 s
``kvbits plan --model smollm2-135m`` took, ~8-10 s for Qwen2.5-Coder-0.5B's config. The config must be
transformers' own, field for field; any other architecture still goes through transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plan import write_tiny_gguf

from kvbits.plan import gguf_config, load_shape
from kvbits.plan.gguf_config import gguf_config_dict, gguf_config_from_file, read_gguf_table


def _transformers_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def _no_autoconfig(monkeypatch) -> None:
    from transformers import AutoConfig

    def refuse(*args, **kwargs):
        raise AssertionError("AutoConfig.from_pretrained was called for a Llama/Qwen2 GGUF")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)


def test_llama_gguf_config_is_read_from_its_header_as_transformers_reads_it(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    want = _transformers_config(path)
    got = gguf_config_from_file(path)
    assert type(got) is type(want) and got.to_dict() == want.to_dict()
    _no_autoconfig(monkeypatch)
    shape = load_shape(path)
    assert (shape.n_layers, shape.layers[0].kv_heads, shape.layers[0].head_dim) == (3, 2, 64)
    assert shape.weights_quantized == "gguf Q8_0" and shape.max_context == 2048


def test_unknown_architecture_falls_back_to_transformers(tmp_path, monkeypatch):
    assert gguf_config_dict({"general.architecture": "gemma3", "gemma3.block_count": 2}, set()) is None
    # a Llama file transformers reads as Mistral (it renames the architecture by the file's name)
    assert gguf_config_dict({"general.architecture": "llama", "general.name": "mistral-7b"}, set()) is None
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    calls = []
    # _from_gguf imports it when called: a reader that does not know the file (None) sends it to AutoConfig
    monkeypatch.setattr(gguf_config, "gguf_config_from_file", lambda p: calls.append(p))
    shape = load_shape(path)  # through AutoConfig
    assert calls == [path] and shape.n_layers == 3


def test_a_gguf_cut_short_in_its_tensor_data_is_left_to_transformers(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1])
    assert gguf_config_from_file(cut) is None
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert gguf_config_from_file(tmp_path / "empty.gguf") is None


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_gguf_config_from_header_equals_transformers(name, monkeypatch):
    """Every config field (so every one the planner reads) equals transformers' for both shared GGUF models,
    and planning them no longer calls AutoConfig.from_pretrained."""
    models = pytest.importorskip("kvbits.evaluate.models")
    path = models.fetch_offline_model(name)
    want = _transformers_config(path)
    got = gguf_config_from_file(path)
    assert got is not None and type(got) is type(want)
    assert got.to_dict() == want.to_dict()
    want_shape = load_shape(want.to_dict())
    _no_autoconfig(monkeypatch)
    shape = load_shape(path)
    assert shape.layers == want_shape.layers and shape.max_context == want_shape.max_context
    assert shape.n_params == want_shape.n_params


def _count_gguf_readers(monkeypatch) -> list[int]:
    gguf = pytest.importorskip("gguf")
    calls = [0]
    original = gguf.GGUFReader.__init__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    return calls


def test_header_walk_sizes_the_types_transformers_header_reader_refuses(tmp_path, monkeypatch):
    """sources._gguf_header_cached read a GGUF's vocab and tensor types through transformers' ``GgufHeader``, which
    refuses Q5_0 (ggml type 6; Qwen2.5-Coder-0.5B's Q4_K_M file holds some): gguf's full GGUFReader then read the
    header again, ~8 s of the ~9 s ``kvbits plan --model qwen2.5-coder-0.5b`` took. Now the walk gguf_config reads
    the config with serves both, and no GGUFReader is built."""
    from kvbits.plan import sources

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0")
    table = read_gguf_table(path)
    assert table is not None and table.complete and table.types == {"F32", "Q5_0"}
    sources._gguf_header_cached.cache_clear()
    readers = _count_gguf_readers(monkeypatch)
    assert sources.gguf_tensor_types(path) == {"F32", "Q5_0"}
    assert sources.gguf_vocab(path).tensor == ("token_embd.weight", 16) and readers == [0]


def test_header_walk_refuses_a_zero_alignment(tmp_path):
    """A file stating ``general.alignment`` 0 raised ZeroDivisionError out of the walk (and out of ``kvbits plan``)
    instead of leaving the file to transformers, which says what is wrong."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    path = tmp_path / "zero.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
                     + string("general.architecture") + struct.pack("<I", 8) + string("llama")
                     + string("general.alignment") + struct.pack("<II", 4, 0))
    assert read_gguf_table(path) is None


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_gguf_header_walk_equals_gguf_reader(name, monkeypatch):
    """The vocab, tensor shapes and tensor type names planning takes from the header walk equal gguf's GGUFReader's
    for both shared GGUF models, and planning them builds no GGUFReader (Qwen2.5-Coder's Q5_0 tensors sent it to
    one: ~8 s)."""
    from kvbits.plan import sources

    models = pytest.importorskip("kvbits.evaluate.models")
    path = models.fetch_offline_model(name)
    sources._gguf_header_cached.cache_clear()
    readers = _count_gguf_readers(monkeypatch)
    load_shape(path)
    assert readers == [0]
    walked = sources._gguf_header(path)
    from_gguf = sources._gguf_header_gguf(path)
    assert walked.types == from_gguf.types and dict(walked.shapes) == dict(from_gguf.shapes)
    for key, value in from_gguf.metadata.items():
        assert walked.metadata[key] == value, key
