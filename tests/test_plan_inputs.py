"""The planner refuses malformed inputs with a clear ``ValueError``: config files transformers refuses deep
inside, truncated GGUF files, absurd memory budgets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_plan import write_tiny_gguf

from kvbits.plan import ModelShape, plan
from kvbits.plan.planner import MAX_GIB


def llama_dict(**overrides):
    d = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    d.update(overrides)
    return d


# ------------------------------------------------------------------------------ malformed config.json


@pytest.mark.parametrize(
    "config, match",
    [
        # ZeroDivisionError inside LlamaConfig
        (llama_dict(num_attention_heads=0), r"num_attention_heads must be a positive integer .*got 0"),
        # huggingface_hub StrictDataclass*ValidationError
        (llama_dict(hidden_size=250), r"'llama' config: hidden_size \(250\) is not a multiple of num_attention_heads"),
        (llama_dict(num_hidden_layers=2.5), r"'llama' config: .*'num_hidden_layers' expected int, got float"),
        (llama_dict(num_hidden_layers="2"), r"'num_hidden_layers' expected int, got str"),
        (
            {"model_type": "gemma3_text", "num_hidden_layers": 4, "layer_types": ["sliding_attention"]},
            r"'gemma3_text' config: `num_hidden_layers` \(4\) must be equal to the number of `layer_types` \(1\)",
        ),
        # AttributeError: module 'torch' has no attribute 'weird'
        (llama_dict(torch_dtype="weird"), r"torch_dtype 'weird' is not a torch dtype"),
        (llama_dict(dtype="weird"), r"dtype 'weird' is not a torch dtype"),
    ],
    ids=["zero-heads", "hidden-not-multiple", "float-layers", "str-layers", "few-layer-types", "torch_dtype",
         "dtype"],
)  # fmt: skip
def test_malformed_config_file_is_a_value_error_naming_file_and_field(tmp_path, config, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match) as info:
        plan(str(path), context=100)
    assert str(info.value).startswith(str(path))
    with pytest.raises(ValueError, match=match):  # a folder holding config.json names that file
        plan(str(tmp_path), context=100)
    with pytest.raises(ValueError, match=match):  # a dict: named as such
        plan(config, context=100)


def test_zero_in_a_sub_config_is_named(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": {"num_attention_heads": 0}}))
    with pytest.raises(ValueError, match=r"cfg\.json: text_config\.num_attention_heads must be a positive"):
        plan(str(path), context=100)


def test_a_valid_config_file_still_plans(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(llama_dict(torch_dtype="bfloat16")))
    r = plan(str(path), context=100)
    assert r["total_bytes"] == 2 * (2 * 2 * 64 * 100 * 2)  # 2 layers, K and V, 2 heads x 64, bf16


def test_a_config_file_that_is_not_text_is_named_in_the_error(tmp_path):
    """A config.json holding binary bytes (a gzip or safetensors file renamed) failed with a bare
    ``UnicodeDecodeError: 'utf-8' codec can't decode byte 0x8b``, naming no file."""
    path = tmp_path / "config.json"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"config\.json is not a UTF-8 JSON text file") as info:
        plan(str(path), context=100)
    assert not isinstance(info.value, UnicodeDecodeError)


def test_a_utf8_config_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    """JSON is UTF-8 (RFC 8259); the config was read in the locale's encoding, so under ``LC_ALL=C`` (ASCII) a
    config.json with one non-ASCII byte (a name, a chat template) could not be planned."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama_dict(_name_or_path="café"), ensure_ascii=False), encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = (
        "import sys; from kvbits.plan.sources import _read_json; from pathlib import Path; "
        "assert _read_json(Path(sys.argv[1]))['_name_or_path'] == 'caf\\u00e9'"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-500:]


# ------------------------------------------------------------------------------ truncated GGUF


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    path = tmp_path / "whole" / "tiny.gguf"
    path.parent.mkdir()
    return write_tiny_gguf(path)


def test_truncated_gguf_is_not_a_complete_gguf_file(tiny_gguf, tmp_path):
    """A 50 KB prefix of a real GGUF raised struct.error, a 2 MB one numpy's 'cannot reshape array'."""
    data = tiny_gguf.read_bytes()
    assert plan(tiny_gguf, context=10)["total_bytes"] > 0
    cuts = {"magic": 4, "header": 20, "metadata": 200, "tensor-info": len(data) - 16 * 256 * 4 - 8,
            "tensor-data": len(data) // 2, "last-byte": len(data) - 1}  # fmt: skip
    for what, n in cuts.items():
        cut = tmp_path / f"cut-{what}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match=rf"cut-{what}\.gguf is not a complete GGUF file: its {n} bytes"):
            plan(cut, context=10)


@pytest.mark.parametrize(
    "content, match",
    [(b"", "is empty"), (b"hello, world", "is not a GGUF file: it does not start with the GGUF magic")],
)
def test_empty_or_foreign_file_is_not_a_gguf_file(tmp_path, content, match):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"x\.gguf {match}"):
        plan(path, context=10)


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Counts the calls of ``owner.name`` (a class's ``__init__``, or a classmethod) from now on."""
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, classmethod(lambda cls, *a, **k: counted(*a, **k))
                        if isinstance(owner.__dict__.get(name), classmethod) else counted)
    return calls


def _plan_reads(path: Path) -> set[str]:
    """What planning from the GGUF file ``path`` reads of its header after transformers built the config
    (``_from_gguf``'s tail): its vocab size, then its tensor types."""
    from kvbits.plan import gguf_config, sources

    for cached in (getattr(sources, "_gguf_header_cached", None), getattr(gguf_config, "_read_gguf_table_cached", None)):
        if cached is not None:
            cached.cache_clear()
    sources.with_gguf_vocab(SimpleNamespace(vocab_size=32000), path)  # a config transformers read
    return sources.gguf_tensor_types(path)


def test_planning_from_a_gguf_reads_its_header_once(tiny_gguf, monkeypatch):
    """Planning from a GGUF read its header twice, for its vocab (with_gguf_vocab) and for its tensor types
    (_with_gguf_weights): with transformers 5.17, whose reader refuses Q4_1, that was gguf's GGUFReader twice
    (`kvbits plan SmolLM2-135M-Instruct.Q4_1.gguf --context 4096`: 3 GGUFReaders, 24-29 s on a loaded 2-core
    machine; now 2, the other being transformers' config loader's, 15-17 s). Now one read serves both."""
    gguf = pytest.importorskip("gguf")
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    walks = _count_calls(monkeypatch, reader, "_read_tensor_table")
    assert _plan_reads(tiny_gguf) == {"F32"} and walks == [1]  # the header walk (kvbits.plan.gguf_config)

    def refuse(*args, **kwargs):
        raise ValueError("a table the walk can not read (as with a transformers without the walk's reader)")

    monkeypatch.setattr(reader, "_read_tensor_table", refuse)
    readers = _count_calls(monkeypatch, gguf.GGUFReader, "__init__")
    assert _plan_reads(tiny_gguf) == {"F32"} and readers == [1]  # gguf's reader, the fallback
    assert _plan_reads(tiny_gguf) == {"F32"} and readers == [2]  # the cache was cleared: read again
    from kvbits.plan.sources import gguf_tensor_types, gguf_vocab

    assert gguf_vocab(tiny_gguf).tensor == ("token_embd.weight", 16) and readers == [2]  # cached
    write_tiny_gguf(tiny_gguf, "Q8_0")  # the file changed (size, modification time): read again
    assert gguf_tensor_types(tiny_gguf) == {"F32", "Q8_0"} and readers == [3]


# ------------------------------------------------------------------------------ memory budgets


@pytest.mark.parametrize("field", ["gpu_mem_gib", "weights_gib", "reserve_gib"])
@pytest.mark.parametrize("value", [1e308, 1.7e299, MAX_GIB + 1])
def test_absurd_memory_amounts_are_refused(field, value):
    """--gpu-mem 1e308 raised OverflowError (the bytes overflowed a float)."""
    kwargs = {"gpu_mem_gib": 80, "weights_gib": 1, field: value}
    with pytest.raises(
        ValueError, match=rf"{field} must be at most {MAX_GIB} GiB .*got {re.escape(repr(value))}"
    ):
        plan(ModelShape.from_dims(2, 2, 64), context=1024, **kwargs)


def test_the_largest_memory_amount_plans():
    r = plan(ModelShape.from_dims(2, 2, 64), context=1024, gpu_mem_gib=MAX_GIB, weights_gib=1)
    assert r["gpu_mem_bytes"] == MAX_GIB * (1 << 30) and r["fits"]


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [({"weights_gib": 10}, "weights_gib=10 applies"), ({"reserve_gib": 3}, "reserve_gib=3 applies"),
     ({"weights_gib": 1.5, "reserve_gib": 2}, "weights_gib=1.5 and reserve_gib=2 apply")],
)
def test_budget_amounts_without_a_gpu_budget_are_refused(kwargs, said):
    """``plan(weights_gib=10)`` without ``gpu_mem_gib`` returned a plan with no budget in it (the value only logged
    at INFO as ignored; ``reserve_gib`` not even that), while ``kvbits plan --weights-gib`` refuses it."""
    with pytest.raises(ValueError, match=rf"{re.escape(said)} to the GPU budget alone: pass gpu_mem_gib"):
        plan(ModelShape.from_dims(2, 2, 64), context=1024, **kwargs)
    assert "weights_bytes" not in plan(ModelShape.from_dims(2, 2, 64), context=1024, reserve_gib=0)


def test_a_reserve_above_the_gpu_is_refused_naming_both(capsys):
    """``--reserve-gib 100 --gpu-mem 80`` was planned as "fits: no, max concurrency 0" without a word: a reserve is
    memory kept free on that GPU, so one larger than it is an input mistake (most likely the two swapped)."""
    from kvbits.cli import main

    shape = ModelShape.from_dims(32, 32, 128)
    with pytest.raises(ValueError, match=r"reserve_gib \(100 GiB.*at most gpu_mem_gib \(80 GiB"):
        plan(shape, context=32768, gpu_mem_gib=80, weights_gib=10, reserve_gib=100)
    dims = ["--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--context", "32k", "--scheme", "fp16"]
    assert main(["plan", *dims, "--gpu-mem", "80", "--weights-gib", "10", "--reserve-gib", "100"]) == 2
    err = capsys.readouterr().err
    assert "--reserve-gib" in err and "--gpu-mem" in err and "80 GiB" in err
    edge = plan(shape, context=32768, gpu_mem_gib=80, weights_gib=0, reserve_gib=80)  # the whole GPU kept free: allowed
    assert edge["max_concurrency"] == 0 and edge["max_context"] == 0


def test_weights_beyond_the_gpu_plan_zero_concurrency_and_say_why(caplog):
    """Weights (and reserve) larger than the GPU are a real answer (the model does not fit), planned as concurrency 0;
    they used to be reported without saying that nothing was left for the KV cache."""
    with caplog.at_level("WARNING", logger="kvbits.plan.planner"):
        r = plan(ModelShape.from_dims(32, 8, 128), context=4096, gpu_mem_gib=80, weights_gib=75, reserve_gib=10)
    assert r["max_concurrency"] == 0 and r["max_context"] == 0 and not r["fits"]
    assert "exceed gpu_mem_gib (80 GiB) by 5 GiB: no room is left for the KV cache" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.plan.planner"):
        plan(ModelShape.from_dims(32, 8, 128), context=4096, gpu_mem_gib=80, weights_gib=70, reserve_gib=10)
    assert "no room" not in caplog.text  # exactly full: not beyond


# ------------------------------------------------------------------------------ repeated schemes


def _write_scheme(path: Path, scheme, **changes) -> str:
    from kvbits.schemes import get_scheme

    path.write_text(get_scheme(scheme).replace(**changes).to_json())
    return str(path)


def test_a_repeated_scheme_is_refused_naming_it(tmp_path):
    from kvbits.schemes import get_scheme

    shape = ModelShape.from_dims(2, 2, 64)
    with pytest.raises(ValueError, match=r"scheme 'fp16' is listed twice; .*typo"):
        plan(shape, context=100, scheme=["fp16", "fp16"])
    with pytest.raises(ValueError, match=r"scheme 'kivi-2' is listed twice"):
        plan(shape, context=[100, 200], scheme=("kivi-2", "fp16", "kivi-2"))
    # two spellings of one scheme: the preset, a JSON file of it (a description does not change the
    # storage), the KVScheme object
    path = _write_scheme(tmp_path / "fp16.json", "fp16", description="my copy")
    with pytest.raises(ValueError, match=rf"scheme 'fp16' is listed twice \(given as 'fp16' and '{re.escape(path)}'\)"):
        plan(shape, context=100, scheme=["fp16", path])
    with pytest.raises(ValueError, match=r"'int4-token' is listed twice \(given as KVScheme 'int4-token' and 'int4"):
        plan(shape, context=100, scheme=[get_scheme("int4-token"), "int4-token"])
    # distinct schemes still plan, one row each, in order
    rows = plan(shape, context=100, scheme=["fp16", "kivi-2"])
    assert [r["scheme"] for r in rows] == ["fp16", "kivi-2"]


def test_two_different_schemes_of_one_name_are_refused(tmp_path):
    a = _write_scheme(tmp_path / "a.json", "int4-token", name="custom")
    b = _write_scheme(tmp_path / "b.json", "int8-token", name="custom")
    with pytest.raises(ValueError, match=r"two different schemes are named 'custom' .*rename one"):
        plan(ModelShape.from_dims(2, 2, 64), context=100, scheme=[a, b])
    # the same content under another name is another row (a name the user chose)
    c = _write_scheme(tmp_path / "c.json", "int4-token", name="custom-int4")
    assert len(plan(ModelShape.from_dims(2, 2, 64), context=100, scheme=[a, c])) == 2


def test_cli_refuses_a_repeated_scheme(capsys):
    from kvbits.cli import main

    dims = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "100"]
    assert main(["plan", *dims, "--scheme", "kivi-2", "--scheme", "kivi-2"]) == 2
    err = capsys.readouterr().err
    assert "kvbits plan: error: scheme 'kivi-2' is listed twice" in err


def test_a_repeated_context_is_refused_naming_it(capsys):
    """plan(context=[4096, 4096]) returned two identical rows per scheme; '4k' and '4096' are one context."""
    from kvbits.cli import main

    shape = ModelShape.from_dims(2, 2, 64)
    with pytest.raises(ValueError, match=r"context 4096 is listed twice \(\[4096, 1024, 4096\]\); .*typo"):
        plan(shape, context=[4096, 1024, 4096], scheme="fp16")
    assert [r["context"] for r in plan(shape, context=[4096, 1024], scheme="fp16")] == [4096, 1024]
    dims = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--scheme", "fp16"]
    assert main(["plan", *dims, "--context", "4k", "--context", "4096"]) == 2
    assert "kvbits plan: error: context 4096 is listed twice" in capsys.readouterr().err


def test_a_near_miss_of_an_offline_model_name_is_refused_at_once(capsys):
    """`kvbits plan --model smollm2` tried the hub (35 s of retries offline) before failing."""
    from kvbits.cli import main

    assert main(["plan", "--model", "smollm2", "--context", "128", "--scheme", "fp16"]) == 2
    assert "model 'smollm2' is not a kvbits offline model; did you mean 'smollm2-135m'?" in capsys.readouterr().err


def test_a_window_of_one_is_refused_everywhere_a_window_enters(capsys):
    """A sliding window of 1 keeps W - 1 = 0 tokens: plan crashed with ZeroDivisionError (avg_bits over 0 elements,
    and the budget over 0 bytes per request) from ModelShape.from_dims, a MistralConfig and --sliding-window 1."""
    import transformers

    from kvbits.cli import main
    from kvbits.plan.shape import LayerShape

    with pytest.raises(ValueError, match=r"sliding_window must be >= 2 .*so 1 keeps none\), got 1"):
        ModelShape.from_dims(2, 2, 64, sliding_window=1)
    with pytest.raises(ValueError, match=r"a sliding layer's window must be >= 2"):
        LayerShape(2, 64, "sliding", 1)
    mistral = transformers.MistralConfig(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"config field sliding_window must be >= 2"):
        plan(mistral, context=5, scheme="fp16")
    with pytest.raises(ValueError, match=r"config field attention_chunk_size must be >= 2"):
        plan(llama_dict(attention_chunk_size=1), context=5, scheme="fp16")
    dims = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "5"]
    assert main(["plan", *dims, "--sliding-window", "1"]) == 2
    assert "sliding_window must be >= 2" in capsys.readouterr().err
    # the smallest window plans: one token per sequence and layer
    r = plan(ModelShape.from_dims(2, 2, 64, sliding_window=2), context=5, scheme="fp16", gpu_mem_gib=1, weights_gib=0)
    assert r["total_bytes"] == 2 * 2 * 2 * 64 * 2 and r["avg_bits"] == 16 and r["max_concurrency"] > 0


def test_the_layer_count_is_capped(capsys):
    """--layers had no upper bound: a million layers took 38 s and 1.1 GB to plan (one LayerShape and one
    layer_bytes per layer); a config's num_hidden_layers too. Now at most MAX_LAYERS (65,536), as scheme strings."""
    from kvbits.cli import main
    from kvbits.schemes.presets import MAX_LAYERS

    with pytest.raises(ValueError, match=rf"layers must be between 1 and {MAX_LAYERS} .*got 1000000"):
        ModelShape.from_dims(1_000_000, 8, 128)
    with pytest.raises(ValueError, match=rf"num_hidden_layers must be between 1 and {MAX_LAYERS} .*got 1000000"):
        plan(llama_dict(num_hidden_layers=1_000_000), context=5, scheme="fp16")
    with pytest.raises(ValueError, match=rf"layers must be between 1 and {MAX_LAYERS}"):
        ModelShape.from_dims(2, 2, 64).with_overrides(layers=MAX_LAYERS + 1)
    assert main(["plan", "--layers", "1000000", "--kv-heads", "8", "--head-dim", "128", "--context", "8k"]) == 2
    assert f"layers must be between 1 and {MAX_LAYERS}" in capsys.readouterr().err
    assert ModelShape.from_dims(MAX_LAYERS, 1, 64).n_layers == MAX_LAYERS


@pytest.mark.parametrize("field", ["max_position_embeddings", "num_hidden_layers", "head_dim", "sliding_window",
                                   "num_key_value_heads", "hidden_size"])  # fmt: skip
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_integer_field_is_named(tmp_path, field, value):
    """A config.json (without a model_type transformers validates) holding NaN in an integer field failed with
    'cannot convert float NaN to integer', infinity with an OverflowError traceback: neither named the field."""
    base = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": 1000, "intermediate_size": 512, "max_position_embeddings": 4096}  # fmt: skip
    path = tmp_path / "config.json"
    if field == "hidden_size":
        del base["head_dim"]  # else hidden_size is read for the weights estimate alone, which may fail (logged)
    path.write_text(json.dumps({**base, field: value}))  # json writes NaN / Infinity, as Python's json reads them
    with pytest.raises(ValueError, match=rf"config field {field} must be an integer, got {value!r}"):
        plan(str(path), context=100, scheme="fp16")


def test_a_context_beyond_2_to_the_40_is_refused(capsys):
    """--context 99999999999999999999k planned 1.0e23 tokens without a word; 2**40 is the max-context search's bound."""
    from kvbits.cli import main
    from kvbits.plan.limits import LIMIT
    from kvbits.plan.planner import plan_shape

    shape = ModelShape.from_dims(2, 2, 64)
    with pytest.raises(ValueError, match=r"context must be at most 2\*\*40 = 1,099,511,627,776 tokens"):
        plan(shape, context=[1024, LIMIT + 1], scheme="fp16")
    with pytest.raises(ValueError, match=r"context must be at most 2\*\*40"):
        plan_shape(shape, "fp16", context=LIMIT + 1)
    assert plan(shape, context=LIMIT, scheme="fp16")["total_bytes"] == 2 * 2 * 2 * 64 * 2 * LIMIT
    dims = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--scheme", "fp16"]
    assert main(["plan", *dims, "--context", "99999999999999999999k"]) == 2
    assert "kvbits plan: error: context must be at most 2**40" in capsys.readouterr().err
