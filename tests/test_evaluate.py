"""Evaluator: the one-pass simulator equals the token-by-token cache; metrics, buckets, outputs, CLI.

Tiny random-weight models built from configs (no network) cover full attention with GQA and MHA
(Llama), sliding-window layers with qkv bias and MQA (Qwen2) and hybrid sliding/full layers with
logit soft-capping (Gemma 3). One real-model check (``-m realmodel``) runs SmolLM2 from its wheel.

Tolerance of "simulate == stream": the simulator computes K/V of all positions in one forward, the
cache gets them one token per forward. In float32 the two differ by rounding (~1e-7 relative),
which can flip a code sitting on a rounding boundary; a flipped code moves one element by one
quantization step, the next layers' K/V move by a fraction of a step, more codes flip, and the
difference cascades (on SmolLM2 with int4 per-token keys, single tokens end up differing by nats
while every average agrees). So the exact check runs in float64: there the two orders of
summation differ by ~1e-16, far below the float32 grid the quantizer rounds its input to, codes
are identical and the results agree to ~1e-12. Float32 is checked statistically.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbits.evaluate import metrics as M
from kvbits.evaluate.outputs import OtherRunError
from kvbits.evaluate.runner import default_attn_layers, evaluate
from kvbits.evaluate.simulate import IMPLEMENTATION, quantized_bounds, simulate, simulated_kv
from kvbits.evaluate.stream import PEER_SCHEMES, base_model, cache_bytes, resolve_scheme, stream_hidden
from kvbits.schemes import KVScheme, TensorSpec, get_scheme
from kvbits.schemes.accounting import flushed_tokens

VOCAB = 101

# Schemes beyond the presets: sinks + residual window + blocks, per-channel keys in small groups,
# head granularity (one scale per head and block), and an exact identity.
SINKS = get_scheme("int4-token").replace(name="t-sinks", sinks=4, residual=16, block=8)
KIVI_R32 = get_scheme("kivi-2").replace(name="kivi-2-r32", residual=32)
CHANNEL = KVScheme(
    "t-channel",
    key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=8),
    value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=16),
    sinks=2,
    residual=8,
    block=16,
)
HEAD = KVScheme(
    "t-head",
    key=TensorSpec(kind="int", bits=4, fmt=None, granularity="head"),
    value=TensorSpec(kind="int", bits=3, fmt=None, granularity="tensor"),
    residual=5,
    block=4,
)
# per-layer mixed: sinks + window in layer 0, pre-RoPE per-channel keys in layer 1, the rest per-token int2
MIXED = get_scheme("int2-token").replace(
    name="t-mixed",
    layers=(
        (0, SINKS),
        (1, CHANNEL.replace(name="t-prerope", key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel",
                                                              group_size=8, pre_rope=True))),
    ),
)  # fmt: skip
# dense-and-sparse outliers chosen per flushed block (per-channel keys, per-token values) and token groups with
# sinks and a block of 3 (not a divisor of anything in sight): the families the presets reach only calibrated
OUTLIERS = KVScheme(
    "t-outliers",
    key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=8, outlier_frac=0.06),
    value=TensorSpec(kind="int", bits=4, fmt=None, outlier_frac=0.1),
    sinks=1,
    residual=3,
    block=8,
)
GROUPS = KVScheme(
    "t-groups",
    key=TensorSpec(kind="int", bits=4, fmt=None, group_size=8),
    value=TensorSpec(kind="int", bits=2, fmt=None, group_size=16),
    sinks=5,
    residual=6,
    block=3,
)
FP32 = KVScheme(
    "t-fp32",
    key=TensorSpec(kind="float", bits=32, fmt="fp32"),
    value=TensorSpec(kind="float", bits=32, fmt="fp32"),
)


def _llama(kv_heads: int = 2, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(cfg).eval()


def _qwen2(layers: int = 3):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=40,
        max_window_layers=1,
        max_position_embeddings=2048,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=2048,
        final_logit_softcapping=30.0,
    )
    return Gemma3ForCausalLM(cfg).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


MODELS = {
    "llama": _llama,
    "llama-mha": lambda: _llama(kv_heads=4),
    "qwen2": _qwen2,
    "gemma3": _gemma3,
    "gpt2": _gpt2,
}


@pytest.fixture(scope="module")
def models():
    built: dict = {}

    def get(name, dtype=torch.float32):
        if (name, dtype) not in built:
            built[(name, dtype)] = MODELS[name]().to(dtype)
        return built[(name, dtype)]

    return get


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def _agreement(h_sim: torch.Tensor, h_stream: torch.Tensor) -> tuple[float, float]:
    """Median and max over positions of the per-position max error, relative to the hidden-state scale."""
    scale = h_stream.abs().amax().item()
    err = (h_sim - h_stream).abs().amax(dim=-1)[0] / scale
    return err.median().item(), err.max().item()


def _assert_agree(h_sim: torch.Tensor, h_stream: torch.Tensor, what: str) -> None:
    """Float64 runs: identical codes, so only summation order differs (~1e-16 relative)."""
    med, worst = _agreement(h_sim, h_stream)
    assert worst < 1e-9, f"{what}: median {med:.2e}, max {worst:.2e} (relative to the hidden-state scale)"


# --------------------------------------------------------------------------- simulate == stream

CASES = [
    ("llama", "int4-token", "decode"),
    ("llama", "int4-token", "prefill"),
    ("llama", SINKS, "decode"),
    ("llama", SINKS, "prefill"),
    ("llama", CHANNEL, "decode"),
    ("llama", CHANNEL, "prefill"),
    ("llama", HEAD, "decode"),
    ("llama", "fp8-e4m3-token", "decode"),
    ("llama", "int4-token-hadamard", "decode"),
    ("qwen2", "int2-token-hadamard", "prefill"),
    ("llama", MIXED, "decode"),
    ("qwen2", MIXED, "prefill"),
    ("gemma3", "int4-token,0=fp16", "decode"),
    ("llama", "fp16", "decode"),
    ("llama-mha", SINKS, "decode"),
    ("qwen2", SINKS, "decode"),
    ("qwen2", CHANNEL, "prefill"),
    ("qwen2", HEAD, "decode"),
    ("gemma3", SINKS, "decode"),
    ("gemma3", SINKS, "prefill"),
    ("gemma3", "int4-token", "decode"),
    ("gpt2", SINKS, "prefill"),
    ("qwen2", OUTLIERS, "decode"),
    ("gemma3", OUTLIERS, "prefill"),
    ("llama", GROUPS, "prefill"),
]


@torch.no_grad()
@pytest.mark.parametrize("model_name,scheme,semantics", CASES, ids=lambda x: getattr(x, "name", x))
def test_simulate_equals_stream(models, model_name, scheme, semantics):
    model = models(model_name, torch.float64)
    base = base_model(model)
    ids = _ids(90, seed=3)
    prompt = 37 if semantics == "prefill" else None
    ref = base(ids).last_hidden_state
    with simulate(model, scheme, semantics=semantics, prompt_len=prompt) as sim:
        h_sim = base(ids).last_hidden_state
    assert sim.calls == model.config.num_hidden_layers
    h_stream = stream_hidden(model, ids, scheme, semantics=semantics, prompt_len=prompt)
    name = getattr(scheme, "name", scheme)
    _assert_agree(h_sim, h_stream, f"{model_name}/{name}/{semantics}")
    # and the scheme does something (a test that cannot fail would pass without quantization too)
    scale = ref.abs().max()
    assert (h_sim - ref).abs().max() > (1e-6 if resolve_scheme(scheme).is_identity else 1e-3) * scale
    if semantics == "prefill":  # the prompt is exact: positions before it equal the reference
        torch.testing.assert_close(h_sim[:, :prompt], ref[:, :prompt], rtol=0, atol=1e-12 * float(scale))


@torch.no_grad()
@pytest.mark.parametrize(
    "model_name,scheme", [("llama", SINKS), ("gemma3", CHANNEL)], ids=lambda x: getattr(x, "name", x)
)
def test_simulate_equals_stream_float32(models, model_name, scheme):
    """Float32: rounding may flip a few codes (see the module docstring); the runs stay close."""
    model = models(model_name)
    ids = _ids(90, seed=3)
    with simulate(model, scheme):
        h_sim = model.model(ids).last_hidden_state
    med, worst = _agreement(h_sim, stream_hidden(model, ids, scheme))
    assert med < 1e-4 and worst < 1e-2, (med, worst)


@torch.no_grad()
@pytest.mark.parametrize("semantics", ["decode", "prefill"])
def test_stream_reserves_the_window_and_changes_no_result(models, monkeypatch, semantics):
    """Stream mode builds each cache with ``max_cache_len`` = the window's tokens, as a server reserves a
    request: flushes write in place; the hidden states and the bytes at the end are those of a growing cache."""
    from kvbits.evaluate import stream as stream_mod
    from kvbits.plan import plan

    model = models("llama", torch.float64)
    ids, prompt = _ids(60, seed=5), (23 if semantics == "prefill" else None)
    caches: list = []
    reserved = stream_hidden(model, ids, "int4-token", semantics=semantics, prompt_len=prompt, on_cache=caches.append)
    make = stream_mod.make_cache
    monkeypatch.setattr(stream_mod, "make_cache", lambda *a, max_cache_len=None, **kw: make(*a, **kw))
    grown = stream_hidden(model, ids, "int4-token", semantics=semantics, prompt_len=prompt, on_cache=caches.append)
    assert torch.equal(reserved, grown)
    res, grow = caches
    assert res.max_cache_len == ids.shape[1] and grow.max_cache_len is None
    rep = res.memory_report()
    assert all(r["reserved_tokens"] > 0 for r in rep["layers"])
    assert rep["total_bytes"] == grow.memory_report()["total_bytes"]
    assert rep["total_bytes"] == plan(model.config, context=60, batch=1, scheme="int4-token", dtype_bytes=8)["total_bytes"]


@torch.no_grad()
@pytest.mark.parametrize(
    "scheme,semantics", [(SINKS, "decode"), (CHANNEL, "prefill")], ids=["sinks", "channel"]
)
def test_stream_fused_decode_equals_dequantized_path(models, monkeypatch, scheme, semantics):
    """Stream mode through the fused decode path (forced on CPU: the torch reference over the packed
    store) gives the hidden states of the dequantize-then-SDPA path; every decode step after the first
    is fused; the model's attention implementation is restored; "auto" on CPU is the plain path."""
    from unittest import mock

    from kvbits.kernels import dispatch

    monkeypatch.setenv("KVBITS_KERNEL", "reference")
    model = models("llama", torch.float64)
    ids = _ids(60, seed=4)
    prompt = 23 if semantics == "prefill" else None
    plain = stream_hidden(model, ids, scheme, semantics=semantics, prompt_len=prompt, fused_decode=False)
    auto = stream_hidden(model, ids, scheme, semantics=semantics, prompt_len=prompt)
    assert torch.equal(auto, plain)
    with mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel:
        fused = stream_hidden(model, ids, scheme, semantics=semantics, prompt_len=prompt, fused_decode=True)
    # the first decode step claims each layer (SDPA over real K/V); every later one is fused
    first = 1 if semantics == "decode" else prompt + 1
    assert kernel.call_count == (ids.shape[1] - first) * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"
    scale = plain.abs().max()
    assert (fused - plain).abs().max() < 1e-5 * scale  # the reference attends in float32
    assert not torch.equal(fused, plain)  # it really took the other path


@torch.no_grad()
def test_agreement_check_can_fail(models):
    """Simulating a scheme off by one token (residual 17 instead of 16, or one sink fewer) against
    the real cache must fail the agreement check used above (and by far)."""
    model = models("llama", torch.float64)
    ids = _ids(90, seed=3)
    h_stream = stream_hidden(model, ids, SINKS)
    for wrong in (SINKS.replace(residual=17), SINKS.replace(sinks=3)):
        with simulate(model, wrong):
            h_sim = model.model(ids).last_hidden_state
        med, worst = _agreement(h_sim, h_stream)
        assert med > 1e-4 and worst > 1e-3, (wrong, med, worst)


@torch.no_grad()
def test_simulate_equals_stream_prerope_calibrated(models):
    """Pre-RoPE per-channel keys with calibrated static scales and NUQ codebooks (kvquant-4)."""
    from transformers import DynamicCache

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model
    from kvbits.quant.rope import RotaryTables

    model = models("llama", torch.float64)
    scheme = get_scheme("kvquant-4")
    ids = _ids(120, seed=4)
    full = DynamicCache()
    model.model(
        _ids(200, seed=9), use_cache=True, **{"cache" if _has_cache_kw(model) else "past_key_values": full}
    )
    tables = RotaryTables.from_config(model.config)
    keys, values = [], []
    for i, layer in enumerate(full.layers):
        pos = torch.arange(scheme.sinks, layer.keys.shape[2])
        keys.append(tables.tables_for_layer(i).unrotate(layer.keys[:, :, scheme.sinks :], pos))
        values.append(layer.values[:, :, scheme.sinks :])
    art = artifact_from_samples(scheme, keys, values, meta={"model": describe_model(model.config)})
    with pytest.raises(ValueError, match="calibrat"), simulate(model, scheme):
        pass
    with simulate(model, scheme, calibration=art):
        h_sim = model.model(ids).last_hidden_state
    _assert_agree(h_sim, stream_hidden(model, ids, scheme, calibration=art), "llama/kvquant-4")


@torch.no_grad()
@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
def test_simulate_equals_stream_centred_smoothed_keys(models, pre_rope: bool):
    """Per-token keys centred and smoothed with calibrated channel vectors (int4-token-smooth, and the same before
    RoPE with vectors fitted on pre-RoPE keys: the cache un-rotates, transforms, quantizes and rotates back, as the
    simulator does); and the transform changes what is computed."""
    import dataclasses

    from transformers import DynamicCache

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model
    from kvbits.quant.rope import RotaryTables

    model = models("llama", torch.float64)
    scheme = get_scheme("int4-token-smooth")
    if pre_rope:
        scheme = scheme.replace(name="t-smooth-prerope", key=dataclasses.replace(scheme.key, pre_rope=True))
    full = DynamicCache()
    model.model(
        _ids(200, seed=9), use_cache=True, **{"cache" if _has_cache_kw(model) else "past_key_values": full}
    )
    keys = [layer.keys for layer in full.layers]  # post-RoPE, as the cache stores them
    if pre_rope:
        tables = RotaryTables.from_config(model.config)
        keys = [tables.tables_for_layer(i).unrotate(k, torch.arange(k.shape[2])) for i, k in enumerate(keys)]
    art = artifact_from_samples(scheme, keys, [layer.values for layer in full.layers],
                                meta={"model": describe_model(model.config)})  # fmt: skip
    ids = _ids(120, seed=4)
    with simulate(model, scheme, calibration=art):
        h_sim = model.model(ids).last_hidden_state
    _assert_agree(h_sim, stream_hidden(model, ids, scheme, calibration=art), f"llama/{scheme.name}")
    with simulate(model, "int4-token"):
        h_plain = model.model(ids).last_hidden_state
    assert _agreement(h_sim, h_plain)[1] > 1e-3


def _has_cache_kw(model) -> bool:
    from kvbits.cache import cache_kwarg

    return cache_kwarg(model.model) == "cache"


# ------------------------------------------------------------------------------------ identity


@torch.no_grad()
@pytest.mark.parametrize("model_name", ["llama", "qwen2", "gemma3"])
def test_identity_fp32_equals_plain_model(models, model_name):
    model = models(model_name)
    ids = _ids(300, seed=5)
    assert FP32.is_identity
    ref = model(ids).logits
    with simulate(model, FP32, chunk_size=64, attn_layers=[0]) as sim:
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert sim.attn_error[0].max() < 1e-5


@torch.no_grad()
def test_bounds_follow_flush_rule():
    scheme = SINKS
    t = torch.arange(200)
    lo, hi = quantized_bounds(scheme, t, 200)
    assert lo == 4
    for ti in (0, 3, 4, 19, 20, 27, 28, 35, 36, 199):
        assert int(hi[ti]) == 4 + flushed_tokens(scheme, max(0, ti + 1 - 4))
    lo, hi = quantized_bounds(scheme, t, 200, prompt_len=50)
    assert (hi[:50] == lo).all() and int(hi[50]) == 4 + flushed_tokens(scheme, 47)
    # sliding layers: no sinks; a window the buffer could outgrow falls back to full precision
    lo, hi = quantized_bounds(scheme, t, 200, sliding_window=64)
    assert lo == 0 and int(hi[-1]) == flushed_tokens(scheme, 200)
    assert int(quantized_bounds(scheme, t, 200, sliding_window=16)[1].max()) == 0
    # identity: every visible token is cast
    assert torch.equal(quantized_bounds(get_scheme("fp16"), t, 200)[1], t + 1)


def test_blocks_quantized_independently():
    """Folding blocks into the batch equals quantizing each block alone (head granularity reduces
    over a whole block, so any mixing across blocks would show)."""
    from kvbits.quant import fake_quantize

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 40, 32, generator=g) * torch.linspace(0.1, 5, 40)[None, None, :, None]
    kq, vq = simulated_kv(HEAD, k, k, 0, 40)
    for b in range(10):
        sl = slice(4 * b, 4 * b + 4)
        torch.testing.assert_close(kq[:, :, sl], fake_quantize(k[:, :, sl], HEAD.key), rtol=0, atol=0)
        torch.testing.assert_close(vq[:, :, sl], fake_quantize(k[:, :, sl], HEAD.value), rtol=0, atol=0)


# -------------------------------------------------------------------------- context manager


@torch.no_grad()
def test_context_manager_leaves_nothing_behind(models):
    model = models("llama")
    ids = _ids(50)
    before = model.config._attn_implementation
    ref = model(ids).logits
    with simulate(model, "int2-token"):
        assert model.config._attn_implementation == IMPLEMENTATION
        assert (model(ids).logits - ref).abs().max() > 1e-3
    assert model.config._attn_implementation == before
    with pytest.raises(ZeroDivisionError), simulate(model, "int2-token"):
        raise ZeroDivisionError
    assert model.config._attn_implementation == before
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    # the registered function refuses to run outside a context (a model switched by hand)
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        with pytest.raises(RuntimeError, match="outside"):
            model(ids)
    finally:
        model.set_attn_implementation(before)
    # padding is refused, not silently ignored
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with simulate(model, "int8-token"), pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=mask)
    assert model.config._attn_implementation == before


def test_bad_arguments(models):
    model = models("llama")
    with pytest.raises(ValueError, match="semantics"), simulate(model, "int8-token", semantics="greedy"):
        pass
    with pytest.raises(ValueError, match="prompt_len"), simulate(model, "int8-token", semantics="prefill"):
        pass
    with pytest.raises(ValueError, match="stream"):
        evaluate(model, _ids(64)[0], 32, ["hf-quanto-int4"])
    with pytest.raises(ValueError, match="listed twice"):
        evaluate(model, _ids(64)[0], 32, ["int8-token", "int8-token"])
    with pytest.raises(ValueError, match=r"attn_layers=\[1\] needs mode='simulate'"):  # not silently dropped
        evaluate(model, _ids(64)[0], 32, ["int8-token"], mode="stream", attn_layers=[1])
    with pytest.raises(ValueError, match="unknown scheme"):
        resolve_scheme("int5-token")


def test_missing_calibration_is_refused_before_anything_loads():
    """A scheme that needs ``kvbits calibrate``'s parameters, given none, is refused up front: the model
    named here does not exist, so reaching the loading (or the reference pass) would fail otherwise."""
    from kvbits.schemes import get_scheme

    assert get_scheme("kvquant-4").needs_calibration() == ["key", "value"]  # static NUQ keys, NUQ values
    assert get_scheme("kvquant-2-block").needs_calibration() == ["key", "value"]  # codebooks only
    assert get_scheme("kivi-4").needs_calibration() == [] and get_scheme("fp16").needs_calibration() == []
    with pytest.raises(ValueError, match=r"not given for: kvquant-4 \(key and value\).*\(calibration=DIR\)"):
        evaluate("no-such-model-anywhere", _ids(64)[0], 32, ["kivi-4", "kvquant-4"])


def test_settings_simulate_would_ignore_are_refused_before_anything_loads(tmp_path):
    """``fused_decode`` only acts in stream mode, and ``data_path`` only when it is a folder: both were
    silently ignored (a run with other settings than asked). The model named here does not exist."""
    for fused in (True, False):
        with pytest.raises(ValueError, match=rf"fused_decode={fused} needs mode='stream'"):
            evaluate("no-such-model-anywhere", _ids(64)[0], 32, ["int8-token"], fused_decode=fused)
    with pytest.raises(ValueError, match="is not a folder"):
        evaluate("no-such-model-anywhere", "wikitext2", 32, ["int8-token"], data_path=tmp_path / "nope")


# --------------------------------------------------------------------------------- metrics


def _scaled_logits_model(arch: str):
    """A tiny Granite (``logits / logits_scaling``) or Cohere (``logits * logit_scale``) model: families whose
    logits are rescaled after the head."""
    import transformers

    name, seed, extra = {"granite": ("Granite", 5, {"logits_scaling": 8.0}),
                         "cohere": ("Cohere", 6, {"logit_scale": 0.25})}[arch]  # fmt: skip
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, **extra,
    )  # fmt: skip
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


def _granite():
    return _scaled_logits_model("granite")


def _cohere():
    return _scaled_logits_model("cohere")


@pytest.mark.parametrize("build", [_granite, _cohere], ids=["granite-logits_scaling", "cohere-logit_scale"])
@torch.no_grad()
def test_reference_ppl_is_the_models_own(build):
    """Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale: the metrics must too."""
    model = build()
    model.get_output_embeddings().weight.mul_(40)  # logits large enough for the scaling to matter
    ids = _ids(128, seed=3)
    own = math.exp(float(model(input_ids=ids, labels=ids).loss))
    s = evaluate(model, ids[0], 128, ["int8-token"], attn_layers=[])
    assert s["results"][0]["ppl_ref"] == pytest.approx(own, rel=1e-4)


@torch.no_grad()
def test_unknown_logit_post_processing_is_refused(models, tmp_path, monkeypatch):
    from kvbits.evaluate import runner

    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    out = tmp_path / "run"
    evaluate(models("llama"), _ids(128)[0], 128, ["int8-token"], attn_layers=[], out_dir=out)
    model = copy.deepcopy(models("llama"))

    def rescale(module, args, kwargs, out):  # a family kvbits does not know: logits * 3
        out.logits = out.logits * 3.0
        return out

    model.register_forward_hook(rescale, with_kwargs=True)
    with pytest.raises(RuntimeError, match="post-processes its logits"):
        evaluate(model, _ids(128)[0], 128, ["int8-token"], attn_layers=[], out_dir=out, overwrite=True)
    assert (out / "DONE").is_file()  # refused before the stored run was cleared


def test_two_calibrations_for_one_scheme_are_refused(models):
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    model = models("llama")
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 32, 32, generator=g) for _ in range(2)]
    arts = [
        artifact_from_samples("kvquant-4", [k * f for k in keys], keys, meta={"model": describe_model(model.config)})
        for f in (1.0, 2.0)
    ]
    with pytest.raises(ValueError, match="two calibrations were given for scheme 'kvquant-4'"):
        evaluate(model, _ids(64)[0], 64, ["kvquant-4"], calibration=arts)


def test_bucket_bounds_exact():
    assert M.bucket_bounds(8191) == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8191)]
    assert M.bucket_bounds(32767)[-1] == (16384, 32767)
    assert M.bucket_bounds(70000)[-1] == (65536, 70000)
    assert M.bucket_bounds(1500, first=1100) == [(1100, 1500)]
    assert M.bucket_bounds(3000, first=500) == [(500, 1024), (1024, 2048), (2048, 3000)]
    assert M.bucket_bounds(99) == [(0, 99)]


def test_summarize_by_hand():
    rng = np.random.default_rng(0)
    W, N = 3, 2500
    nll_ref = rng.uniform(1, 4, (W, N))
    nll = nll_ref + rng.normal(0.05, 0.2, (W, N))
    per = {
        "nll": nll,
        "nll_ref": nll_ref,
        "kl": rng.uniform(0, 0.1, (W, N)),
        "top1": (rng.random((W, N)) > 0.1) * 1.0,
    }
    s = M.summarize(per, first=100)
    assert [(b["lo"], b["hi"], b["tokens"]) for b in s["buckets"]] == [
        (100, 1024, 3 * 924),
        (1024, 2048, 3 * 1024),
        (2048, 2500, 3 * 452),
    ]
    b = s["buckets"][1]
    assert b["ppl"] == pytest.approx(math.exp(nll[:, 1024:2048].mean()))
    assert b["ppl_ref"] == pytest.approx(math.exp(nll_ref[:, 1024:2048].mean()))
    assert b["delta_rel"] == pytest.approx(b["ppl"] / b["ppl_ref"] - 1)
    assert b["kl"] == pytest.approx(per["kl"][:, 1024:2048].mean())
    assert b["top1"] == pytest.approx(per["top1"][:, 1024:2048].mean())
    assert s["tokens"] == 3 * 2400 and s["ppl"] == pytest.approx(math.exp(nll[:, 100:].mean()))
    for b in s["buckets"]:
        lo, hi = b["delta_rel_ci"]
        assert lo < b["delta_rel"] < hi
    # more data, narrower interval; same seed, same interval
    d = nll - nll_ref
    wide = M.bootstrap_delta_rel(d[:1, :512])
    narrow = M.bootstrap_delta_rel(d)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert M.bootstrap_delta_rel(d) == narrow
    recs = M.bucket_records("x", per, first=100)
    assert len(recs) == 3 * 3 and sum(r.tokens for r in recs) == 3 * 2400
    assert sum(r.nll_sum for r in recs) == pytest.approx(nll[:, 100:].sum())


def test_summarize_an_nll_past_floats_range_is_infinite(recwarn):
    """A mean NLL above ~709 nats (a broken scheme on a model with large logits) is an infinite PPL and ΔPPL, as
    the report prints them, not an ``OverflowError`` after every forward pass has run, with its interval; a good
    bucket beside it is unaffected. No overflow warnings."""
    nll_ref = np.full((1, 2048), 3.0)
    nll = nll_ref.copy()
    nll[:, 1024:] = 800.0
    nll[:, 1024:1034] = 3.0  # resampled chunks of 128 tokens: 800 nats or just under
    per = {"nll": nll, "nll_ref": nll_ref, "kl": np.ones_like(nll), "top1": np.zeros_like(nll)}
    s = M.summarize(per)
    good, bad = s["buckets"]
    assert good["ppl"] == pytest.approx(math.exp(3.0)) and good["delta_rel"] == 0 and good["delta_rel_ci"] == [0, 0]
    assert bad["ppl"] == math.inf == bad["delta_rel"] and bad["ppl_ref"] == pytest.approx(math.exp(3.0))
    assert bad["delta_rel_ci"] == [math.inf, math.inf]
    assert s["ppl"] == pytest.approx(math.exp(nll.mean()))  # ~401 nats: still a float
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@torch.no_grad()
def test_token_metrics_match_full_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h_ref, h = torch.randn(70, 16), torch.randn(70, 16)
    tgt = torch.randint(0, 50, (70,))
    (rec,) = M.token_metrics(head, h_ref, [h], tgt, softcap=5.0, chunk=16)
    lp_ref = torch.log_softmax(torch.tanh(head(h_ref) / 5) * 5, -1)
    lp = torch.log_softmax(torch.tanh(head(h) / 5) * 5, -1)
    torch.testing.assert_close(rec["nll_ref"], -lp_ref.gather(1, tgt[:, None])[:, 0])
    torch.testing.assert_close(rec["nll"], -lp.gather(1, tgt[:, None])[:, 0])
    torch.testing.assert_close(rec["kl"], (lp_ref.exp() * (lp_ref - lp)).sum(-1), rtol=1e-4, atol=1e-6)
    assert torch.equal(rec["top1"], (lp.argmax(-1) == lp_ref.argmax(-1)).float())
    (same,) = M.token_metrics(head, h_ref, [h_ref], tgt)
    assert same["kl"].abs().max() < 1e-6 and same["top1"].min() == 1


# ---------------------------------------------------------------------------------- runner


SUMMARY_KEYS = {
    "model",
    "data",
    "context",
    "semantics",
    "mode",
    "windows",
    "bos",
    "fingerprint",
    "results",
    "reference_seconds",
    "wall_seconds",
    "world_size",
    "peak_rss_bytes",
    "run_peak_rss_bytes",
    "peak_cuda_bytes",
}
RESULT_KEYS = {
    "scheme",
    "avg_bits",
    "bits_at_context",
    "ppl",
    "ppl_ref",
    "kl",
    "top1",
    "buckets",
    "attn_error",
    "attn_entropy",
    "generation",
    "calibration",
    "seconds",
    "decode",
}
BUCKET_KEYS = {"lo", "hi", "tokens", "ppl", "ppl_ref", "delta_rel", "delta_rel_ci", "kl", "top1"}


@pytest.fixture(scope="module")
def errors_run(models):
    ids = _ids(2 * 1100, seed=7)[0]
    return evaluate(models("llama"), ids, 1100, ["int8-token", "int2-token", "fp16"], windows=2)


def test_errors_visible_and_ordered(errors_run):
    r = {x["scheme"]: x for x in errors_run["results"]}
    assert r["int2-token"]["kl"] > r["int8-token"]["kl"] > r["fp16"]["kl"] > 0
    assert r["int2-token"]["top1"] < r["int8-token"]["top1"] <= 1
    for layer in range(2):
        e2, e8 = (
            next(a for a in r[s]["attn_error"] if a["layer"] == layer) for s in ("int2-token", "int8-token")
        )
        for b2, b8 in zip(e2["buckets"], e8["buckets"]):
            assert b2["rel_err"] > b8["rel_err"] > 0
    ppl_ref = {x["ppl_ref"] for x in errors_run["results"]}
    assert len(ppl_ref) == 1  # one reference, shared


def test_bits_at_context_are_what_the_cache_stores_there(models):
    """``avg_bits`` is the long-run figure (the full-precision window amortised away): kivi-2 read 3.0 bits at a
    128-token context, where its cache holds every token in full precision. ``bits_at_context`` is ``kvbits
    plan``'s ``avg_bits`` at the run's context, full precision counted in the dtype the model runs in: 16.0 there
    for a bfloat16 model, 32.0 for a float32 one (it read 16.0, from a config that names no dtype, while the cache
    held 32 bits per element), and the real cache's ``memory_report()["avg_bits"]`` at 160 tokens (one 32-token
    block quantized); the same as ``avg_bits`` for a scheme without a window."""
    model, ids = models("llama"), _ids(160, seed=1)[0]
    r = {x["scheme"]: x for x in evaluate(model, ids[:128], 128, ["kivi-2", "int4-token"], attn_layers=[])["results"]}
    assert r["kivi-2"]["avg_bits"] == 3.0 and r["kivi-2"]["bits_at_context"] == 32.0
    assert r["int4-token"]["bits_at_context"] == pytest.approx(r["int4-token"]["avg_bits"])
    (half,) = evaluate(models("llama", torch.bfloat16), ids[:128], 128, ["kivi-2"], attn_layers=[])["results"]
    assert half["bits_at_context"] == 16.0
    (k,) = evaluate(model, ids, 160, ["kivi-2"], attn_layers=[])["results"]
    caches = []
    stream_hidden(model, ids[None], "kivi-2", on_cache=caches.append, fused_decode=False)
    assert k["bits_at_context"] == pytest.approx(caches[0].memory_report()["avg_bits"])
    assert 3.0 < k["bits_at_context"] < 32.0


@torch.no_grad()
def test_length_dependent_rope_past_its_frame_is_said(models, caplog):
    """``dynamic`` RoPE changes its frequencies with the forward's length past ``max_position_embeddings`` (32
    here): one forward over an 80-token window (the reference, the simulator) rotates keys differently from
    token-by-token decoding, so an fp16 stream's KL is not its quantization's (hidden states 1.6e-3 apart, median
    relative, against int4-token's 2.2e-2; the simulator's fp16 4e-5). Runs reported it without a word; now a
    warning says so, naming the mode, and none within the frame or for a plain-RoPE model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = _ids(80, seed=3)[0]
    for mode, context, said in (("stream", 40, True), ("simulate", 80, True), ("simulate", 32, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvbits"):
            evaluate(model, ids[:context], context, ["fp16"], mode=mode, attn_layers=[])
        assert ("changes its frequencies with the forward's length past 32 tokens" in caplog.text) is said, mode
        if said:
            assert ("fp16 too" in caplog.text) is (mode == "stream")
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits"):
        evaluate(models("llama"), _ids(80, seed=3)[0], 80, ["fp16"], attn_layers=[])
    assert "RoPE" not in caplog.text


def test_a_scheme_that_quantizes_nothing_scored_is_named(models, caplog):
    """``kivi-2`` keeps its last 128 tokens in full precision and flushes 32 at a time: at a context of 128 (up to
    160) no scored prediction attended to a quantized key, and the run reported the unquantized model's numbers
    (KL 0.0, top-1 1.0, PPL 102.2987 = the reference's, tiny Llama) as kivi-2's at 3.0 bits, without a word. Now
    a warning names the scheme and the shortest context that quantizes anything (161, where the KL is positive),
    in either mode; where every layer's sliding window is shorter than the buffer, no context does."""
    model, ids = models("llama"), _ids(161, seed=1)[0]
    for mode in ("simulate", "stream"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvbits"):
            r = evaluate(model, ids[:160], 160, ["kivi-2", "int4-token"], mode=mode, attn_layers=[])["results"]
        if mode == "simulate":
            assert r[0]["kl"] == 0 and r[0]["ppl"] == r[0]["ppl_ref"]
        assert r[0]["kl"] < 1e-6 < r[1]["kl"]  # stream: token-by-token rounding only
        assert "kivi-2 quantizes no key or value that a window of 160 tokens scores (it keeps 0 sink token(s) and " \
               "the last 128 token(s) in full precision, flushing 32 at a time)" in caplog.text
        assert "the shortest context at which it quantizes anything is 161" in caplog.text
        assert "int4-token" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits"):
        (r,) = evaluate(model, ids, 161, ["kivi-2"], attn_layers=[])["results"]
    assert r["kl"] > 0 and "quantizes no key" not in caplog.text
    # sinks count as exact; a sliding layer (window 40) too short for 128 + 32 tokens stays in full precision
    from kvbits.evaluate.simulate import first_quantizing_context, quantized_keys_seen

    kivi = get_scheme("kivi-2")
    assert first_quantizing_context(model, kivi.replace(name="k", sinks=4)) == 165
    assert first_quantizing_context(models("qwen2"), kivi) == 161  # layer 0 is a full one
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=40, max_window_layers=0)  # fmt: skip
    sliding = Qwen2ForCausalLM(cfg).eval()
    assert first_quantizing_context(sliding, kivi) is None and quantized_keys_seen(sliding, kivi, 1000) == 0
    assert first_quantizing_context(sliding, SINKS) == 16 + 8 + 1  # no sinks in a sliding layer
    # Mistral passes its window at call time only (no layer_types): the sliding reading, which quantizes earlier
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=40))  # fmt: skip
    assert first_quantizing_context(mistral, SINKS) == 16 + 8 + 1
    with simulate(mistral, SINKS), torch.no_grad():  # and the simulator does quantize what position 23 sees
        h = mistral.model(_ids(25)).last_hidden_state
    assert not torch.equal(h[0, 23], mistral.model(_ids(25)).last_hidden_state[0, 23])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_cuda_bytes_on_cuda(models):
    model = models("llama").to("cuda")
    s = evaluate(model, _ids(300, seed=3)[0], 300, ["int4-token"], device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert isinstance(s["peak_cuda_bytes"], int) and s["peak_cuda_bytes"] >= weights > 0
    assert s["peak_rss_bytes"] is None or s["peak_rss_bytes"] > 0


def test_cast_keeps_rotary_tables_float32(models):
    """Casting a float32 model to bfloat16 must not round the RoPE frequencies (as loading with
    dtype= does not): positions would drift at long context."""
    from kvbits.evaluate.inputs import cast_model

    model = copy.deepcopy(models("llama"))
    inv = model.model.rotary_emb.inv_freq.clone()
    assert inv.dtype == torch.float32 and not torch.equal(inv, inv.to(torch.bfloat16).float())
    cast_model(model, torch.bfloat16, None)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv, rtol=0, atol=0)
    assert "inv_freq" in dict(model.model.rotary_emb.named_buffers())  # still a buffer


def test_run_peak_rss_excludes_what_came_before():
    """The run's own resident peak starts at the reset: a large allocation freed before it is not
    counted in run_peak_rss_bytes, but is in the process peak. In a fresh interpreter: in this one, memory
    freed by earlier tests but kept resident by the allocator would absorb the allocation."""
    from kvbits.evaluate import measures

    if measures._vm_hwm_bytes() is None:
        pytest.skip("no /proc/self/status VmHWM here")
    code = (
        "import json, torch\n"
        "from kvbits.evaluate import measures\n"
        "big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched\n"
        "del big\n"
        "before = measures._reset_peak_rss()\n"
        "run = measures._run_peak_rss_bytes(before) if before is not None else None\n"
        "print(json.dumps([before, run, measures._run_peak_rss_bytes(None)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    before, run, none = json.loads(out.stdout.strip().splitlines()[-1])
    if before is None:
        pytest.skip("/proc/self/clear_refs not writable here")
    assert run is not None and before >= run + 200 * 2**20, (before, run)
    assert none is None


def test_summary_schema_and_buckets(errors_run):
    s = errors_run
    assert set(s) == SUMMARY_KEYS and set(s["fingerprint"]) == {"model", "tokens"}
    assert s["windows"] == 2 and s["context"] == 1100 and s["mode"] == "simulate"
    computed = s["reference_seconds"] + sum(r["seconds"] for r in s["results"])
    assert s["world_size"] == 1 and 0 < computed <= s["wall_seconds"]  # one process: the loop holds all
    json.dumps(s, allow_nan=False)
    if sys.platform.startswith("linux"):  # getrusage reports it here; None where it cannot
        assert isinstance(s["peak_rss_bytes"], int) and s["peak_rss_bytes"] > 50 * 2**20  # torch alone
        if s["run_peak_rss_bytes"] is not None:  # /proc/self/clear_refs may be unavailable (sandboxes)
            assert 0 < s["run_peak_rss_bytes"] <= s["peak_rss_bytes"]
    assert s["peak_cuda_bytes"] is None  # a CPU run
    for r in s["results"]:
        assert set(r) == RESULT_KEYS
        assert [(b["lo"], b["hi"], b["tokens"]) for b in r["buckets"]] == [(0, 1024, 2048), (1024, 1099, 150)]
        for b in r["buckets"]:
            assert set(b) == BUCKET_KEYS
            assert b["delta_rel_ci"][0] <= b["delta_rel"] <= b["delta_rel_ci"][1]
        assert [a["layer"] for a in r["attn_error"]] == [0, 1]
        assert {tuple(sorted(b)) for a in r["attn_error"] for b in a["buckets"]} == {("hi", "lo", "rel_err")}
    bits = {r["scheme"]: r["avg_bits"] for r in s["results"]}
    assert bits == {
        "int8-token": 9.0,
        "int2-token": 3.0,
        "fp16": 16.0,
    }  # D=32: scale + zero (fp16) per 32 codes
    assert default_attn_layers(30) == [0, 14, 29] and default_attn_layers(2) == [0, 1]


def test_out_dir_skip_overwrite_and_mismatch(models, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from kvbits.evaluate import runner

    reports = []
    monkeypatch.setattr(runner, "_write_report", lambda out: reports.append(out))
    model = models("llama")
    ids = _ids(400, seed=8)[0]
    out = tmp_path / "run"
    args = {"windows": 2, "out_dir": out, "attn_layers": [1]}
    s1 = evaluate(model, ids, 200, ["int4-token", SINKS], **args)
    cfg = json.loads((out / "config.json").read_text())
    assert (out / "DONE").read_text().strip() == cfg["config_hash"]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s1))
    assert {"versions", "date", "commit", "fingerprint", "args"} <= set(cfg) and cfg["versions"]["torch"]
    lines = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 1 and {x["tokens"] for x in lines} == {199}
    arrays = load_file(str(out / "tokens" / "t-sinks.safetensors"))
    assert set(arrays) == {"nll", "nll_ref", "kl", "top1"} and arrays["nll"].shape == (2, 199)
    row = next(x for x in lines if x["scheme"] == "t-sinks" and x["window"] == 1)
    assert row["nll_sum"] == pytest.approx(float(arrays["nll"][1].astype(np.float64).sum()), rel=1e-6)
    assert reports == [out]

    skipped = []
    monkeypatch.setattr(runner, "simulate", lambda *a, **k: pytest.fail("a finished run was recomputed"))
    s2 = evaluate(model, ids, 200, ["int4-token", SINKS], on_skip=skipped.append, **args)
    assert s2 == json.loads(json.dumps(s1)) and len(skipped) == 1
    with pytest.raises(OtherRunError, match="different configuration") as refused:
        evaluate(model, ids, 200, ["int4-token"], **args)
    assert refused.value.differs == ["schemes"]  # what the demo names when it recomputes its own folder
    monkeypatch.undo()
    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    s3 = evaluate(model, ids, 200, ["int4-token"], overwrite=True, **args)
    assert [r["scheme"] for r in s3["results"]] == ["int4-token"]
    assert not (out / "tokens" / "t-sinks.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["config_hash"] != cfg["config_hash"]


def test_out_dir_foreign_folder_is_never_cleaned(models, tmp_path, monkeypatch):
    """A non-empty folder kvbits did not write is refused; with overwrite only kvbits' files are replaced."""
    from kvbits.evaluate import runner

    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    model = models("llama")
    out = tmp_path / "proj"
    (out / "tokens").mkdir(parents=True)
    (out / "tokens" / "my_vocab.txt").write_text("precious")
    (out / "summary.json").write_text('{"mine": 1}')
    (out / "notes.txt").write_text("hello")
    before = {p: p.read_text() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="holds no kvbits eval run"):
        evaluate(model, _ids(200)[0], 100, ["int4-token"], out_dir=out)
    # a run refused for its inputs (the text is shorter than one window) deletes nothing either
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate(model, _ids(50)[0], 100, ["int4-token"], out_dir=out, overwrite=True)
    assert {p: p.read_text() for p in out.rglob("*") if p.is_file()} == before
    evaluate(model, _ids(200)[0], 100, ["int4-token"], out_dir=out, overwrite=True, attn_layers=[])
    assert (out / "notes.txt").read_text() == "hello" and (out / "tokens" / "my_vocab.txt").read_text() == "precious"
    assert (out / "tokens" / "int4-token.safetensors").is_file() and "results" in json.loads(
        (out / "summary.json").read_text()
    )


def test_out_dir_old_run_kept_when_new_inputs_fail(models, tmp_path, monkeypatch):
    """overwrite clears a kvbits run folder only once the new run's inputs loaded."""
    from kvbits.evaluate import runner

    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    model = models("llama")
    out = tmp_path / "run"
    evaluate(model, _ids(200)[0], 100, ["int4-token"], out_dir=out, attn_layers=[])
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    with pytest.raises(ValueError, match="attn_layers"):
        evaluate(model, _ids(200)[0], 100, ["int8-token"], out_dir=out, overwrite=True, attn_layers=[7])
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) == files
    evaluate(model, _ids(200)[0], 100, ["int8-token"], out_dir=out, overwrite=True, attn_layers=[])
    assert sorted(p.name for p in (out / "tokens").iterdir()) == ["int8-token.safetensors"]


def test_out_dir_old_report_removed_with_the_old_run(models, tmp_path, monkeypatch):
    """Rerunning into a run folder cleared the old summary, records and arrays but not report.md, report.html
    and the figures: a report rewrite that failed (only logged) left the old run's report beside the new one."""
    from kvbits.evaluate import runner

    def old_report(out: Path) -> None:
        for name in ("report.md", "report.html", "kl_by_bucket.png"):
            (out / name).write_text("int4-token's report")

    monkeypatch.setattr(runner, "_write_report", old_report)
    model = models("llama")
    out = tmp_path / "run"
    evaluate(model, _ids(200)[0], 100, ["int4-token"], out_dir=out, attn_layers=[])
    monkeypatch.setattr(runner, "_write_report", lambda out: None)  # the new report failed
    evaluate(model, _ids(200)[0], 100, ["int8-token"], out_dir=out, overwrite=True, attn_layers=[])
    left = sorted(p.name for p in out.iterdir())
    assert left == ["DONE", "config.json", "records.jsonl", "summary.json", "tokens"], left


def _local_model_and_text(models, tmp_path, monkeypatch, words: int) -> tuple[Path, Path]:
    """A tiny Llama saved as a local folder (with a word-level tokenizer) and a text file of ``words``
    words, as a user's own model and text; runs write no report, and hashes go to a private cache."""
    from _wordlevel import save_word_tokenizer, write_word_text

    from kvbits.evaluate import runner

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    models("llama").save_pretrained(folder)
    return folder, write_word_text(tmp_path / "book.txt", words)


def test_out_dir_not_reused_after_the_text_or_model_changed(models, tmp_path, monkeypatch):
    """The config hash holds the text's and the model folder's content, not their paths."""
    from _wordlevel import write_word_text

    folder, text = _local_model_and_text(models, tmp_path, monkeypatch, 400)
    out = tmp_path / "run"
    kw = {"out_dir": out, "attn_layers": []}
    first = evaluate(str(folder), str(text), 100, ["int4-token"], **kw)
    skipped = []
    assert evaluate(str(folder), str(text), 100, ["int4-token"], on_skip=skipped.append, **kw) == first
    assert skipped
    write_word_text(text, 400, seed=1)  # same path, other words
    with pytest.raises(ValueError, match="differs in data"):
        evaluate(str(folder), str(text), 100, ["int4-token"], **kw)
    fresh = evaluate(str(folder), str(text), 100, ["int4-token"], overwrite=True, **kw)
    assert fresh["fingerprint"]["tokens"] != first["fingerprint"]["tokens"]
    other = _llama()
    with torch.no_grad():
        other.lm_head.weight.mul_(2.0)
    other.save_pretrained(folder)  # same path and config, other weights
    with pytest.raises(ValueError, match="differs in model"):
        evaluate(str(folder), str(text), 100, ["int4-token"], **kw)


def test_reproduce_command_of_a_run_started_from_python(models, tmp_path, monkeypatch):
    """The report's command line for a Python run is one `kvbits eval` runs with the same settings."""
    import shlex

    from kvbits.cli import build_parser
    from kvbits.report.inputs import load_config, reproduce_command
    from kvbits.report.summary import RunSummary

    folder, text = _local_model_and_text(models, tmp_path, monkeypatch, 300)
    scheme_file = tmp_path / "mine.json"
    scheme_file.write_text(json.dumps(SINKS.replace(name="mine").to_dict()))
    out = tmp_path / "run"
    evaluate(str(folder), str(text), 100, ["int4-token", str(scheme_file)], windows=2, out_dir=out,
             attn_layers=[1], chunk_size=32, seed=5)  # fmt: skip
    line = reproduce_command(load_config(out), RunSummary.load(out), out)
    args = build_parser(only="eval").parse_args(shlex.split(line)[1:])
    assert (args.model, args.data, args.context, args.windows) == (str(folder), str(text), 100, 2)
    assert args.scheme == ["int4-token", str(scheme_file)] and args.attn_layers == [1]
    assert (args.chunk_size, args.seed, args.out) == (32, 5, str(out))
    from kvbits.evaluate.data import load_text
    from kvbits.evaluate.inputs import _data_arg, _model_arg
    from kvbits.evaluate.models import load_model

    # objects: the folder and the file they were loaded from
    assert _model_arg(load_model(str(folder)), "model") == str(folder.resolve())
    assert _data_arg(load_text(str(text)), "book") == str(text.resolve())


@torch.no_grad()
def test_runner_prefill_and_stream_agree(models):
    model = models("qwen2")
    ids = _ids(2 * 120, seed=10)[0]
    kw = {"windows": 2, "semantics": "prefill", "prompt_len": 50}
    sim = evaluate(model, ids, 120, [SINKS, "int8-token"], **kw)
    st = evaluate(model, ids, 120, [SINKS, "int8-token"], mode="stream", **kw)
    for a, b in zip(sim["results"], st["results"]):
        assert [(x["lo"], x["hi"], x["tokens"]) for x in a["buckets"]] == [(50, 119, 2 * 69)]
        assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-4) and a["kl"] == pytest.approx(
            b["kl"], rel=1e-2, abs=1e-7
        )
        assert a["ppl_ref"] == b["ppl_ref"]
        assert b["attn_error"] == []
        # on CPU the stream decodes over dequantized K/V ("auto"): no fused steps; simulate has no decode path
        assert a["decode"] is None and b["decode"] == {"fused_steps": 0, "fallback_steps": 0}
    fused = evaluate(model, ids, 120, [SINKS], mode="stream", fused_decode=True, **kw)
    full = model.config.layer_types.count("full_attention")  # the sliding layers are declined (kept on SDPA)
    assert full == 1 and len(model.config.layer_types) == 3
    # every decode step after the first one after the prompt, in each window and full layer, was fused
    assert fused["results"][0]["decode"] == {"fused_steps": 2 * (120 - 50 - 1) * full, "fallback_steps": 0}
    assert fused["results"][0]["ppl"] == pytest.approx(st["results"][0]["ppl"], rel=1e-4)


@torch.no_grad()
def test_peer_quanto_stream(models):
    pytest.importorskip("optimum.quanto", reason="hf-quanto peers need optimum-quanto")
    model = models("llama")
    assert PEER_SCHEMES["hf-quanto-int4"].avg_bits == 4.5 and PEER_SCHEMES["hf-quanto-int2"].avg_bits == 2.5
    s = evaluate(model, _ids(200, seed=11)[0], 200, ["hf-quanto-int2", "int8-token"], mode="stream")
    r = {x["scheme"]: x for x in s["results"]}
    assert r["hf-quanto-int2"]["decode"] is None  # a peer's cache: no kvbits decode path to report
    # quanto keeps its scales and zero-points in the model's dtype: float32 here, 2 + 2 * 32 / 64 bits
    assert r["hf-quanto-int2"]["avg_bits"] == 3.0
    # bits_at_context was None for a peer; now its cache's real bytes at the window's 200 tokens, read here from the
    # cache itself: 129 tokens quantized (the first at once, then 128 at the residual's flush), 71 in the float32
    # residual; a little over the nominal 3 bits for the quantized ones (quanto packs 4 int2 groups per byte row)
    caches: list = []
    stream_hidden(model, _ids(200, seed=11), "hf-quanto-int2", on_cache=caches.append)
    layers = caches[0].layers
    assert [(lay._quantized_keys.shape[2], lay.keys.shape[2]) for lay in layers] == [(129, 71)] * len(layers)
    cfg = model.config
    elements = 2 * 200 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    held = 8 * cache_bytes(caches[0]) / elements
    assert r["hf-quanto-int2"]["bits_at_context"] == pytest.approx(held)
    assert held == pytest.approx((129 * 3.0 + 71 * 32) / 200, rel=0.01)
    assert r["hf-quanto-int2"]["kl"] > r["int8-token"]["kl"] > 0


# ------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2_window():
    from kvbits.evaluate.data import load_text, make_windows, tokenize
    from kvbits.evaluate.models import load_model

    lm = load_model("smollm2-135m")
    return lm, make_windows(tokenize(load_text("wikitext2"), lm.tokenizer), 200, 1)


@pytest.mark.realmodel
@torch.no_grad()
def test_realmodel_simulate_equals_stream(smollm2_window):
    """SmolLM2-135M, first WikiText-2 tokens, per-token NLL of simulate vs stream, in float64.

    KIVI-2 with a 32-token residual window (``KIVI_R32``: the preset keeps 128, which would need 160
    token-by-token steps before its first flush) flushes its first 32-token block at 64 tokens; t-sinks
    has 4 sinks, a 16-token residual window and 8-token blocks; int4-token quantizes every token at
    once (on the first 80, 56 and 48 tokens, to keep the token-by-token runs short).

    Tolerance 1e-4 nats. The two runs are not bit-identical even in float64: transformers' RMSNorm
    computes in float32 whatever the model dtype, so the ~1e-14 by which a batched and a one-row
    float64 matmul differ sometimes crosses a float32 rounding boundary there. A plain
    ``DynamicCache`` decoded token by token differs from one forward by up to 5e-6 in the hidden
    states on an AMD EPYC with AVX-512 (0.0 on the machine this test was first run on); simulate
    and stream then differ by up to 2.9e-6 nats for the preset kivi-2 (1.4e-6 here). A simulator that
    flushes one token early (or late) misses by 0.21 (0.19) nats on KIVI_R32 and by 0.29 (0.25) on
    t-sinks (measured by patching ``_flushed``).
    """
    lm, ids = smollm2_window
    model = lm.model.to(torch.float64)
    try:
        head = model.get_output_embeddings()
        h_ref = model.model(ids).last_hidden_state[0, :-1]
        for scheme, n in ((KIVI_R32, 80), ("int4-token", 48), (SINKS, 56)):
            x = ids[:, :n]
            with simulate(model, scheme):
                h_sim = model.model(x).last_hidden_state[0, :-1]
            h_st = stream_hidden(model, x, scheme)[0, :-1]
            sim, st = M.token_metrics(head, h_ref[: n - 1], [h_sim, h_st], x[0, 1:])
            name = getattr(scheme, "name", scheme)
            assert (sim["nll"] - st["nll"]).abs().max() < 1e-4, name
            assert sim["kl"].mean() > 1e-3, name  # the scheme visibly quantizes
    finally:
        lm.model.to(torch.float32)


@pytest.mark.realmodel
@torch.no_grad()
def test_realmodel_float32_agrees_on_average(smollm2_window):
    """Float32, int8 per-token, 128 tokens: single tokens may differ (a flipped code cascades, up to
    ~0.2 nats measured on 200 tokens), but the mean NLL agrees to 0.2% and the mean KL to 25%."""
    lm, ids = smollm2_window
    ids = ids[:, :128]
    model = lm.model
    head = model.get_output_embeddings()
    h_ref = model.model(ids).last_hidden_state[0, :-1]
    with simulate(model, "int8-token"):
        h_sim = model.model(ids).last_hidden_state[0, :-1]
    h_st = stream_hidden(model, ids, "int8-token")[0, :-1]
    sim, st = M.token_metrics(head, h_ref, [h_sim, h_st], ids[0, 1:])
    assert sim["nll"].mean() == pytest.approx(st["nll"].mean().item(), rel=2e-3)
    assert sim["kl"].mean() == pytest.approx(st["kl"].mean().item(), rel=0.25)


@pytest.mark.realmodel
def test_realmodel_cli_json(tmp_path, capsys):
    from kvbits.cli import main

    argv = [
        "eval",
        "--model",
        "smollm2-135m",
        "--data",
        "wikitext2",
        "--context",
        "256",
        "--scheme",
        "int4-token",
        "--scheme",
        "kivi-4",
        "--json",
        "--no-progress",
        "--out",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s) == SUMMARY_KEYS and [r["scheme"] for r in s["results"]] == ["int4-token", "kivi-4"]
    assert s["results"][0]["avg_bits"] == 4.5 and s["results"][0]["kl"] > 0
    assert (tmp_path / "r" / "DONE").is_file()
    assert main(argv) == 0  # rerun: skipped, same JSON
    assert json.loads(capsys.readouterr().out) == s


def _narrow_kvquant(context: int):
    """The tiny Llama, kvquant-4, and an artifact for it calibrated on keys far narrower than those served,
    recorded as calibrated over ``context`` tokens."""
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    model = _llama()
    scheme = get_scheme("kvquant-4")
    g = torch.Generator().manual_seed(0)
    keys = [0.01 * torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]  # far narrower than served
    values = [torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]
    art = artifact_from_samples(scheme, keys, values, meta={"model": describe_model(model.config)})
    art.meta["data"]["context"] = context
    return model, scheme, art


def test_served_beyond_calibration_and_clipping_are_logged(caplog):
    from kvbits.evaluate.measures import _warn_mismatch

    model, scheme, art = _narrow_kvquant(64)
    with caplog.at_level("WARNING", logger="kvbits"):
        s = evaluate(model, _ids(128)[0], 128, [scheme], calibration=art, attn_layers=[])
    cal = s["results"][0]["calibration"]
    assert cal["positions_beyond_calibrated"] == 64 and cal["clipped_keys_frac"] > 0.01
    text = caplog.text
    # the report's words (kvbits.report.calibration.calibration_issues), plus what to do about it
    assert "kvquant-4 serves 64 of 128 positions per window beyond the 64 tokens it was calibrated on; clips " in text
    assert "% of its keys against the calibrated ranges (warning level 0.1%). Calibrate with --context 128 " in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits"):  # within the calibrated length, under the warning level
        _warn_mismatch("x", {"positions_beyond_calibrated": 0, "clipped_keys_frac": 1e-5}, 128)
    assert caplog.text == ""


@pytest.mark.parametrize("mode", ["simulate", "stream"])
def test_integer_zero_point_clips_are_reported_as_such(caplog, mode):
    """vLLM's integer zero-points (vllm-int4's spec, unrotated here) clip a token whose range excludes 0: values
    shifted to [~20 +- 3] lose the top of each token's range. The run counted them (simulate and stream) but said
    "clips ...% of its values against the calibrated ranges" of a scheme that calibrates nothing; the record now
    lists the integer-zero sides, and the run's warning and the report say why they clipped. vllm-int4 is listed
    as such even where nothing clipped (its rotation spreads a shift over signs)."""
    from kvbits.report.calibration import CALIBRATION_NOTE, calibration_rows, calibration_warnings

    model = _llama()
    for layer in model.model.layers:  # every value positive: each token's range excludes 0
        layer.self_attn.v_proj.register_forward_hook(lambda mod, args, out: out + 20.0)
    spec = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", integer_zero=True)
    with caplog.at_level("WARNING", logger="kvbits"):
        s = evaluate(model, _ids(64)[0], 64, [KVScheme("iz", key=spec, value=spec), "vllm-int4"], mode=mode,
                     attn_layers=[])  # fmt: skip
    cal, vllm = (r["calibration"] for r in s["results"])
    assert cal["clipped_values_frac"] > 0.5 and cal["integer_zero"] == ["keys", "values"]
    assert vllm["integer_zero"] == ["keys", "values"]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "clips" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("iz clips "), warned
    assert "% of its values under integer zero-points (tokens whose range excludes 0 lose its far end)" in warned[0]
    assert "calibrated ranges" not in warned[0]
    assert [row.scheme for row in calibration_rows(s)] == ["iz"]
    assert "under integer zero-points" in calibration_warnings(calibration_rows(s))[0]
    assert "integer zero-points" in CALIBRATION_NOTE


def test_stream_mode_counts_what_the_real_cache_clipped(caplog):
    """Stream mode recorded no clipping (simulate mode only): the real caches' counts
    (``calibration_report()``) now fill the same fields, over every quantized element, and agree in size
    with the simulator's on the same narrow calibration; a dynamic scheme clips nothing. The run warns once for the
    windows and once for the generated positions (the runner's words); the caches it drives say nothing of their own
    (they said it three times)."""
    model, scheme, art = _narrow_kvquant(64)
    caplog.clear()  # the fit's own warning (99.9 % of 64 samples is the max): not the run's
    with caplog.at_level("WARNING", logger="kvbits"):
        # int4-token: a dynamic scheme that quantizes every token (kivi-4 here kept all 128 in its residual window,
        # so its "clips nothing" held by quantizing nothing)
        s = evaluate(model, _ids(128)[0], 128, [scheme, "int4-token"], calibration=art, mode="stream", generate=4)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # the window's positions past the calibration, then the generated ones (--generate 4 reaches 132)
    assert len(warned) == 2 and warned[0].startswith("kvquant-4 serves 64 of 128 positions"), warned
    assert warned[1].startswith("kvquant-4 (generation: 4 tokens after each 128-token window) serves 68 of 132"), warned
    cal, plain = (r["calibration"] for r in s["results"])
    assert 0.01 < cal["clipped_keys_frac"] <= 1 and cal["clipped_keys"] > 0
    assert plain["clipped_keys"] == plain["clipped_values"] == 0 and plain["clipped_keys_frac"] == 0.0
    # decode semantics: the cache flushes every token past the sink as the simulator quantizes it (2 layers x 2
    # KV heads x 127 tokens x 32 channels), so the counts are the same to the element
    sim = evaluate(model, _ids(128)[0], 128, [scheme], calibration=art, attn_layers=[])["results"][0]["calibration"]
    assert (cal["clipped_keys"], cal["clipped_keys_frac"]) == (sim["clipped_keys"], sim["clipped_keys_frac"])
    assert round(cal["clipped_keys"] / cal["clipped_keys_frac"]) == 2 * 2 * 127 * 32


@torch.no_grad()
def test_simulate_counts_clipping_against_calibrated_ranges(models):
    """A calibration on narrower data than what is served must show up as clipped values."""
    from transformers import DynamicCache

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model
    from kvbits.evaluate.measures import _mismatch
    from kvbits.evaluate.request import _calibration_id
    from kvbits.quant.rope import RotaryTables

    model = models("llama", torch.float64)
    scheme = get_scheme("kvquant-4")
    full = DynamicCache()
    model.model(
        _ids(200, seed=9), use_cache=True, **{"cache" if _has_cache_kw(model) else "past_key_values": full}
    )
    tables = RotaryTables.from_config(model.config)
    clipped = {}
    for shrink in (1.0, 0.25):  # 0.25: calibrated on keys 4x smaller than those served
        keys, values = [], []
        for i, layer in enumerate(full.layers):
            pos = torch.arange(scheme.sinks, layer.keys.shape[2])
            keys.append(shrink * tables.tables_for_layer(i).unrotate(layer.keys[:, :, scheme.sinks :], pos))
            values.append(layer.values[:, :, scheme.sinks :])
        art = artifact_from_samples(scheme, keys, values, meta={"model": describe_model(model.config)})
        with simulate(model, scheme, calibration=art) as sim:
            model.model(_ids(120, seed=4))
        clipped[shrink] = dict(sim.clipped)
    n = (
        model.config.num_hidden_layers * 2 * 119 * model.config.head_dim
    )  # layers x kv heads x quantized tokens x D
    assert clipped[1.0]["keys_elements"] == clipped[0.25]["keys_elements"] == n
    assert clipped[0.25]["keys"] > 10 * max(1, clipped[1.0]["keys"])
    report = _mismatch(clipped[0.25], art, 4096, "simulate")
    assert 0 < report["clipped_keys_frac"] <= 1 and report["clipped_values"] == clipped[0.25]["values"]
    assert report["positions_beyond_calibrated"] == max(0, 4096 - art.max_calibrated_length)
    assert report["artifact"] == {
        "id": _calibration_id(art),
        "path": None,
        "data": "samples",
        "context": art.max_calibrated_length,
        "tokens": art.meta["data"]["tokens"],
    }


@torch.no_grad()
def test_mixed_scheme_evaluates_with_its_layer_average_bits():
    """A per-layer mix runs through evaluate() in both modes alike; its bits are its layers' average, and
    holding the more damaged layer at 8 bits lowers the KL of the all-int2 scheme."""
    from kvbits.schemes import average_bits

    model, ids = _llama(), _ids(96, seed=2)[0]
    out = {}
    for mode in ("simulate", "stream"):
        s = evaluate(model, ids, 96, ["int2-token", "int2-token,0-1=int8-token", "int2-token,1=int8-token"], mode=mode,
                     attn_layers=[] if mode == "stream" else None, progress=False)  # fmt: skip
        out[mode] = {r["scheme"]: r for r in s["results"]}
    for name, r in out["simulate"].items():
        assert r["kl"] == pytest.approx(out["stream"][name]["kl"], rel=1e-3, abs=1e-6)
    mixed = out["simulate"]["int2-token,1=int8-token"]
    assert mixed["avg_bits"] == pytest.approx(average_bits(get_scheme("int2-token,1=int8-token"), 32, 2, n_layers=2))
    assert out["simulate"]["int2-token,0-1=int8-token"]["kl"] < mixed["kl"] < out["simulate"]["int2-token"]["kl"]


def test_the_process_peak_survives_high_water_mark_resets():
    """Each evaluation resets Linux's resident high-water mark to measure its own peak; the reset also lowers
    getrusage's ru_maxrss, so a second evaluation in one process reported a process peak without the first's
    (414 MiB after a 909 MiB one). The peaks a reset lowered are kept."""
    from kvbits.evaluate import measures

    if measures._vm_hwm_bytes() is None or measures._peak_rss_bytes() is None:
        pytest.skip("needs Linux's /proc/self/status and getrusage")
    big = torch.ones(256 * 2**20 // 4)
    big += 1  # touched: resident
    del big
    peak = measures._peak_rss_bytes()
    for _ in range(2):  # two runs in one process
        assert measures._reset_peak_rss() is not None
        assert measures._peak_rss_bytes() >= peak


def test_an_installed_package_records_no_commit(monkeypatch, tmp_path):
    """The run's commit came from ``git rev-parse`` four folders above the module: for an installed package that
    is ``lib/python3.11``, so a venv inside any git repository recorded that repository's HEAD as kvbits'. Only a
    checkout (``<root>/src/kvbits`` beside ``pyproject.toml``) records one."""
    import subprocess

    from kvbits.evaluate import outputs

    got = outputs._git_commit()
    assert got is not None and len(got["sha"]) == 40  # this checkout
    venv = tmp_path / "project" / ".venv" / "lib" / "python3.11" / "site-packages" / "kvbits" / "evaluate"
    venv.mkdir(parents=True)
    project = str(tmp_path / "project")
    subprocess.run(["git", "init", "-q", project], check=True)
    subprocess.run(["git", "-C", project, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "--allow-empty",
                    "-m", "another project"], check=True)  # fmt: skip
    monkeypatch.setattr(outputs, "__file__", str(venv / "outputs.py"))
    assert outputs._git_commit() is None


@torch.no_grad()
def test_avg_bits_of_a_mix_count_the_layers_that_grow(models):
    """``avg_bits`` is the long-run figure: on a model with sliding-window layers only the full-attention ones
    grow, so a mix holding them at 8 bits and the sliding ones at 2 tends to the full layer's 9.0 bits (per-token
    float16 scale and zero-point on 32 channels), not the layers' plain average, 5.0, which it reported."""
    from kvbits.plan.config import load_shape
    from kvbits.plan.planner import plan_shape

    model, ids = models("gemma3"), _ids(48, seed=3)[0]  # layers: sliding (W=24), full, sliding
    name = "int2-token,1=int8-token"
    (r,) = evaluate(model, ids, 48, [name], attn_layers=[], progress=False)["results"]
    assert r["avg_bits"] == pytest.approx(9.0)
    assert plan_shape(load_shape(model.config), name, context=1 << 24)["avg_bits"] == pytest.approx(9.0, abs=1e-3)


@torch.no_grad()
def test_simulate_prerope_keys_at_offset_positions_equal_the_cache(models):
    """A window passed with ``position_ids`` starting at 50 (not its token indices): the cache un-rotates pre-RoPE keys
    at the model's positions (``position_offset``), the simulator un-rotated them at 0..T-1, a frame off by 50, and
    differed from the cache by 3.2e-3 of the hidden-state scale (the scheme's own effect: 3.1e-2). Now equal."""
    from kvbits.cache import QuantizedKVCache

    model = models("llama", torch.float64)
    scheme = CHANNEL.replace(name="t-prerope-offset", key=TensorSpec(kind="int", bits=4, fmt=None,
                                                                     granularity="channel", group_size=8, pre_rope=True))  # fmt: skip
    ids, T = _ids(60, seed=3), 60
    pos = torch.arange(T)[None] + 50
    with simulate(model, scheme):
        h_sim = model.model(ids, position_ids=pos).last_hidden_state
    cache = QuantizedKVCache(model.config, scheme)
    kw = "cache" if _has_cache_kw(model) else "past_key_values"
    steps = [model.model(ids[:, t : t + 1], use_cache=True, position_ids=pos[:, t : t + 1], **{kw: cache},
                         cache_position=torch.tensor([t])).last_hidden_state for t in range(T)]  # fmt: skip
    _assert_agree(h_sim, torch.cat(steps, dim=1), "llama/pre-RoPE at positions 50..109")


def test_simulated_kv_refuses_what_it_cannot_give():
    """``simulated_kv`` answered a range past the tokens with fewer tokens than asked ([0, 12) of 10: 10), a reversed
    range with none, K and V of different lengths with tensors of different lengths, part of a flush block with an
    ``AssertionError`` and pre-RoPE keys without tables with ``AttributeError``: now each a ``ValueError`` saying what
    was expected. And ``simulate(chunk_size=True)`` ran with chunks of 1."""
    k = torch.randn(1, 2, 10, 64)
    pre_rope = get_scheme("int4-token").replace(name="t", key=TensorSpec(kind="int", bits=4, fmt=None, pre_rope=True))
    for args, match in (
        ((get_scheme("int4-token"), k, k, 0, 12), "lo <= hi <= T"),
        ((get_scheme("int4-token"), k, k, 5, 2), "lo <= hi <= T"),
        ((get_scheme("int4-token"), k, k[:, :, :9], 0, 9), "same B, H_kv and T"),
        ((get_scheme("int4-token"), k[0], k[0], 0, 9), r"\(B, H_kv, T, D\)"),
        ((get_scheme("int4-channel"), k, k, 0, 10), "whole flush blocks of 128"),
        ((pre_rope, k, k, 0, 10), "rotary="),
    ):
        with pytest.raises(ValueError, match=match):
            simulated_kv(*args)
    with pytest.raises(ValueError, match="chunk_size"), simulate(_llama(), "int4-token", chunk_size=True):
        pass
