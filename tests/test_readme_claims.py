"""What the README and the package docstrings say about the code, held to the code: the schemes table's storage and
average bits, the stages it names, and the ``bits_at_context`` example it gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvbits
from kvbits.schemes import average_bits, list_schemes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "kvbits"

# SmolLM2-135M's published config (what the planner reads: 30 layers x 3 KV heads x 64 channels).
SMOLLM2 = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
}  # fmt: skip


def schemes_table() -> dict[str, tuple[str, ...]]:
    """The README's ``## Schemes`` table: name -> (sinks, residual, block, bits at D=128, bits at D=64)."""
    section = README.read_text().split("## Schemes", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \|.*?\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \(([\d.]+)\) \|", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_the_schemes_table_lists_every_preset_with_its_windows_and_average_bits() -> None:
    """README: "avg bits D=128 (D=64)": at head dim 128 / 8 KV heads and 64 / 2 heads, as ``kvbits schemes`` counts."""
    table = schemes_table()
    presets = {s.name: s for s in list_schemes()}
    assert sorted(table) == sorted(presets), "the README's schemes table and the registered presets differ"
    for name, row in table.items():
        s = presets[name]
        want = (
            str(s.sinks), str(s.residual), str(s.block),
            f"{average_bits(s, head_dim=128, n_heads=8):.2f}", f"{average_bits(s, head_dim=64, n_heads=2):.2f}",
        )  # fmt: skip
        assert row == want, f"README's row for {name}: {row}, the library: {want}"


def stage_folders() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("stage", stage_folders())
def test_every_stage_folder_is_named_in_the_package_docstring_and_the_readme(stage: str) -> None:
    """``help(kvbits)`` and the README's stages table ("one folder each under src/kvbits/") name every subpackage:
    the package docstring had left out ``tune`` and ``export``."""
    assert f"``{stage}``" in (kvbits.__doc__ or ""), f"kvbits' docstring does not name the {stage} stage"
    assert f"| `{stage}/` |" in README.read_text(), f"the README's stages table has no row for {stage}/"


def test_the_bits_at_context_example_names_the_dtype_it_holds_in() -> None:
    """README's ``evaluate/`` row: kivi-2's ``bits_at_context`` at 128 tokens depends on the dtype the model runs in
    (full-precision tokens are counted in it): 16 in bfloat16, 32 in float32, ``kvbits eval``'s default. The README
    said "16 at 128 tokens" alone, which a default run does not report."""
    m = re.search(
        r"kivi-2 is ([\d.]+) bits in the long run, (\d+) at (\d+) tokens in bfloat16 and (\d+) in float32",
        " ".join(README.read_text().split()),
    )
    assert m, "the README's bits_at_context example for kivi-2 names no dtype"
    long_run, bf16, tokens, fp32 = float(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
    for dtype_bytes, stated in ((2, bf16), (4, fp32)):
        (p,) = kvbits.plan(SMOLLM2, context=tokens, batch=1, scheme=["kivi-2"], dtype_bytes=dtype_bytes)
        assert p["avg_bits"] == pytest.approx(stated), (dtype_bytes, p["avg_bits"], stated)
    assert average_bits(kvbits.get_scheme("kivi-2"), head_dim=64, n_heads=3) == pytest.approx(long_run)


def _pre_rope_section() -> str:
    """The README's bullet on the models pre-RoPE schemes refuse (``Pre-RoPE keys need rotate-half RoPE``)."""
    text = README.read_text(encoding="utf-8")
    assert "**Pre-RoPE keys need rotate-half RoPE.**" in text, "the README says which models pre-RoPE schemes refuse"
    return text.split("**Pre-RoPE keys need rotate-half RoPE.**", 1)[1].split("\n- ", 1)[0]


@pytest.mark.parametrize(
    ("named", "model_type", "fields"),
    [
        ("learned positions", "gpt2", {}),
        ("ALiBi", "bloom", {}),
        ("Zamba,", "zamba", {}),
        ("`use_mem_rope`", "zamba2", {"use_mem_rope": False}),
        ("`rope_theta=None`", "olmo_hybrid", {"rope_parameters": {"rope_type": "default", "rope_theta": None}}),
        ("GPT-J", "gptj", {}),
        ("`rope_interleave=True`", "deepseek_v3", {"rope_interleave": True}),
        ("HunYuan", "hunyuan_v1_dense", {}),
    ],
)
def test_the_models_the_readme_says_pre_rope_schemes_refuse_are_refused(named: str, model_type: str, fields: dict) -> None:
    """Each family the README names as refused for pre-RoPE keys is refused by ``pre_rope_problem`` (the planner's
    check, before any forward pass), and the planner's message suggests a post-RoPE scheme as the README says."""
    import transformers

    from kvbits.plan.positions import pre_rope_problem

    assert named in _pre_rope_section()
    config = transformers.AutoConfig.for_model(model_type)
    for k, v in fields.items():
        setattr(config, k, v)
    assert pre_rope_problem(config) is not None, f"{model_type} {fields}: README says pre-RoPE keys are refused"


def test_the_nope_layers_the_readme_names_keep_their_keys_as_they_come() -> None:
    """SmolLM3's ``no_rope_layers`` and EXAONE 4's full layers (with ``sliding_window`` set) rotate no keys
    (``layer_rotates`` False), while their other layers do, as the README's pre-RoPE bullet says."""
    import transformers

    from kvbits.plan.positions import layer_rotates

    section = _pre_rope_section()
    assert "SmolLM3's `no_rope_layers`" in section and "EXAONE 4's full layers" in section
    smol = transformers.AutoConfig.for_model("smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    assert [layer_rotates(smol, i) for i in range(4)] == [True, True, True, False]
    exa = transformers.AutoConfig.for_model(
        "exaone4", num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]
    )
    assert [layer_rotates(exa, i) for i in range(4)] == [True, True, True, False]


def test_eval_help_says_which_cache_its_kivi2_example_is() -> None:
    """``kvbits eval --help``'s bits_at_context paragraph gave "kivi-2 is 3.0 and, at 128 tokens, 16 in bfloat16" under
    "for a peer cache", which read as a peer named kivi-2 (kivi-2 is a kvbits preset; the peers are hf-quanto-*): the
    example now sits with kvbits' schemes, its figures as kvbits plan counts them, and the peer clause names the peers."""
    from kvbits.evaluate.cli import EPILOG

    text = " ".join(EPILOG.split())
    peer = text[text.index("for a peer cache"):text.index("wall_seconds:")]
    assert "kivi-2" not in peer and "hf-quanto-int2" in peer
    m = re.search(r"kvbits' kivi-2 preset stores ([\d.]+) in the long run and, at (\d+) tokens, where nothing is "
                  r"quantized yet, (\d+) in bfloat16, (\d+) in float32", text)
    assert m
    long_run, tokens, bf16, fp32 = float(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
    for dtype_bytes, stated in ((2, bf16), (4, fp32)):
        (p,) = kvbits.plan(SMOLLM2, context=tokens, batch=1, scheme=["kivi-2"], dtype_bytes=dtype_bytes)
        assert p["avg_bits"] == pytest.approx(stated)
    assert average_bits(kvbits.get_scheme("kivi-2"), head_dim=64, n_heads=3) == pytest.approx(long_run)


def test_the_monitor_metrics_the_readme_names_are_exported_with_the_scheme_label() -> None:
    """The README's *Monitor and fall back* paragraph names ``kvbits_clipped_values_estimated`` and the ``scheme``
    label: a monitored cache's Prometheus text has every ``kvbits_*`` metric it names, each sample labelled with the
    cache's scheme."""
    import inspect

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbits.cache import QuantizedKVCache
    from kvbits.monitor import CacheMonitor, FallbackPolicy

    text = " ".join(README.read_text().split())
    paragraph = text.split("**Monitor and fall back.**", 1)[1].split("```", 1)[0]
    names = set(re.findall(r"`(kvbits_[a-z_]+)`", paragraph))
    assert "kvbits_clipped_values_estimated" in names
    assert "every series carries the label `scheme`" in paragraph
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    cache = QuantizedKVCache(config=cfg, scheme="int8-token")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.9, sample_every=2), labels={"request": "r1"})
    cache_kw = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, 200)), use_cache=True, **{cache_kw: cache})
    samples = [line for line in mon.prometheus().splitlines() if line.startswith("kvbits_")]
    exported = {line.split("{", 1)[0] for line in samples}
    assert names <= exported, names - exported
    assert all('scheme="int8-token"' in line for line in samples)


def test_the_verdict_check_sentence_the_readme_describes() -> None:
    """README's report row: the verdict adds a `Check:` sentence for a bucket more than 1 % below the reference whose
    whole 95 % CI lies below zero: the bound is verdict.IMPLAUSIBLE_GAIN."""
    from kvbits.report.verdict import IMPLAUSIBLE_GAIN

    text = " ".join(README.read_text().split())
    assert (f"the verdict adds a `Check:` sentence for a quantized scheme more than {100 * IMPLAUSIBLE_GAIN:g} % below "
            "the unquantized reference in a bucket whose whole 95 % CI lies below zero") in text  # fmt: skip


def test_an_edited_calibration_json_is_refused_as_the_readme_says(tmp_path) -> None:
    """README's calibrate row: calibration.json's meta_sha256 covers its fields less created and timing_s; an edit is
    refused naming both hashes, and the refusal says to delete meta_sha256 to load an edit made on purpose."""
    from kvbits.calibrate.artifact import _check_meta_sha256, meta_sha256

    text = " ".join(README.read_text().split())
    assert ("`calibration.json` records `meta_sha256`, the sha256 of its own fields less `created` and `timing_s`: one "
            "edited by hand is refused at load, naming both hashes; to load an edit made on purpose, delete its "
            "`meta_sha256`") in text  # fmt: skip
    meta = {"data": {"context": 128}, "created": "2026-12-07", "timing_s": {"fit": 1.0}}
    meta["meta_sha256"] = meta_sha256(meta)
    _check_meta_sha256({**meta, "created": "2020-01-01", "timing_s": {}}, tmp_path / "calibration.json")
    edited = {**meta, "data": {"context": 4096}}
    with pytest.raises(ValueError, match=rf"hash to meta_sha256 {meta_sha256(edited)}, it records '{meta['meta_sha256']}'.*delete its meta_sha256"):
        _check_meta_sha256(edited, tmp_path / "calibration.json")


def test_reset_logs_a_pending_lazy_check_as_the_readme_says(caplog) -> None:
    """README's range paragraph: reset() of a lazily checked cache reads the check still pending and logs the bad K/V
    it finds (WARNING) instead of forgetting them, never raising; the four classes it names have such a reset (a lone
    ``StaticQuantizedLayer``'s since c058b66)."""
    import logging

    import torch

    from kvbits.cache import QuantizedKVCache, QuantizedKVLayer, StaticQuantizedKVCache
    from kvbits.cache.static import StaticQuantizedLayer

    text = " ".join(README.read_text().split())
    assert ("`reset()` of `QuantizedKVCache`, `StaticQuantizedKVCache` or a lone `QuantizedKVLayer` or "
            "`StaticQuantizedLayer` reads a check still pending and logs the bad K/V it finds as a WARNING instead of "
            "forgetting them, never raising") in text  # fmt: skip
    for cls in (QuantizedKVCache, StaticQuantizedKVCache, QuantizedKVLayer, StaticQuantizedLayer):
        assert "WARNING" in (cls.reset.__doc__ or ""), cls
    cache = QuantizedKVCache(num_layers=1, scheme="int4-token", checks="lazy", check_every=64)
    k, v = torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    k[:, :, 8] = float("nan")
    cache.update(k, v, 0)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        cache.reset()
    assert any("pending lazy K/V check failed" in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)


def test_plan_reads_a_llama_gguf_header_without_gguf_reader_as_the_readme_says(tmp_path, monkeypatch) -> None:
    """README's Models paragraph: ``kvbits plan --model`` reads the GGUF file's header, and for a Llama or Qwen2 file
    one walk of it gives config, vocab and tensor types without gguf's ``GGUFReader`` (0fbda1e; a Q5_0 tensor sent
    the tensor types to a GGUFReader before)."""
    gguf = pytest.importorskip("gguf")
    from test_plan import write_tiny_gguf

    from kvbits.plan import load_shape, sources

    text = " ".join(README.read_text().split())
    assert ("`kvbits plan --model` reads the GGUF file's header itself (no tensor data; for a Llama or Qwen2 file one "
            "walk of its metadata and tensor table gives the config, the vocab and the tensor types, without gguf's "
            "`GGUFReader`)") in text  # fmt: skip
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0")
    built = []
    original = gguf.GGUFReader.__init__

    def counted(self, *args, **kwargs):
        built.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    sources._gguf_header_cached.cache_clear()
    shape = load_shape(path)
    assert len(shape.layers) == 3 and shape.weights_quantized == "gguf Q5_0"
    assert sources.gguf_tensor_types(path) == {"F32", "Q5_0"} and sources.gguf_vocab(path).tensor is not None
    assert built == []


def test_monitor_refuses_a_pre_rope_scheme_before_the_weights_as_the_readme_says(tmp_path, monkeypatch) -> None:
    """README's pre-RoPE bullet names `monitor` among the commands that refuse pre-RoPE keys on a model that rotates
    none before their first forward pass: ``watch`` checks the config before the weights load (9db5017)."""
    import torch
    import transformers

    from kvbits.monitor import watch

    assert "`eval`, `needle`, `speed`, `monitor` and `calibrate` before their first forward pass" in " ".join(
        _pre_rope_section().split()
    )
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=128, vocab_size=64, n_positions=512)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match="quantizes keys before RoPE.*learned absolute position embeddings"):
        watch(str(tmp_path / "gpt2"), torch.randint(0, 64, (200,)), 64, "int4-channel-prerope")


def test_the_bos_mismatch_warning_the_readme_names_is_given_by_needle_and_a_reused_eval() -> None:
    """README's CLI section: `kvbits eval` (also when `--out` reuses a finished run) and `kvbits needle` warn when a
    calibration was cut with another BOS choice (002d8aa, ff8ad86): both paths call ``warn_bos_mismatch``, needle's
    naming its trials (test_bos.py runs them)."""
    import inspect

    from kvbits.evaluate import needle_run, runner

    text = " ".join(README.read_text().split())
    assert ("`kvbits eval` (also when `--out` reuses a finished run) and `kvbits needle` warn when a calibration was "
            "cut with another BOS choice than their windows or trials") in text  # fmt: skip
    assert "warn_bos_mismatch(" in inspect.getsource(runner._reused)
    assert 'served_as="this run\'s trials"' in inspect.getsource(needle_run.needle_eval)
