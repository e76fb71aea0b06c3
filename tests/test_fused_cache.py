"""Fused decode through `QuantizedKVCache`: the ``kvbits_fused`` attention over the packed store.

Tiny random-weight models built from configs (Llama and Qwen2 with GQA 2:1, head dim 32; Gemma 3 with
a sliding and a full layer). Greedy generation with the fused path forced on CPU (``fused_decode=True``,
``KVBITS_KERNEL=reference``: the torch reference over the packed store; one case through Triton's
interpreter) must give the tokens and float32 logits of the same cache attended the usual way
(dequantize, then SDPA), with every decode step counted as fused, and the cache holding exactly the
same bytes. Unsupported schemes, sliding layers and padded batches fall back, logged, and still match.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from unittest import mock

import pytest
import torch
import transformers
from _basis import parts_that_matter, skipping
from _launch import LaunchSpy
from test_cache import storage_bytes, walk_tensors
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvbits.cache import (
    FUSED_ATTENTION,
    QuantizedKVCache,
    observe_fused_decode,
    track_positions,
    use_fused_decode,
)
from kvbits.cache import fused as fused_mod
from kvbits.cache.compat import cache_kwargs
from kvbits.cache.layer import position_offset
from kvbits.calibrate.fit import tie_rope_pairs
from kvbits.kernels import dispatch
from kvbits.plan import plan
from kvbits.schemes import KVScheme, TensorSpec, get_scheme, token_split

transformers.logging.set_verbosity_error()

VOCAB = 128
PROMPT, NEW = 40, 20
ATOL = 1e-5  # float32 logits: the torch reference's einsum vs SDPA, nothing else differs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "reference")


@functools.cache
def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            sliding_window=16, layer_types=["sliding_attention", "full_attention"], **common
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def spec(bits: int, gran: str, group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


# small blocks and windows so that blocks are flushed during the 20 decode steps
KIVI4 = KVScheme("t-int4-kivi", key=spec(4, "channel", 16), value=spec(4, "token", 16), residual=8, block=16)
PRE_ROPE = KVScheme(
    "t-int4-prerope", key=spec(4, "channel", 16, pre_rope=True), value=spec(4, "token", 16),
    sinks=2, residual=4, block=16,
)  # fmt: skip


def nuq(bits: int, gran: str, group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="nuq", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


# KVQuant's ingredients (pre-RoPE NUQ keys per channel, NUQ values per token, 5 % sparse outliers, sinks)
KVQUANT3 = KVScheme(
    "t-kvquant3-block", key=nuq(3, "channel", 16, pre_rope=True, outlier_frac=0.05),
    value=nuq(3, "token", outlier_frac=0.05), sinks=2, residual=4, block=16,
)  # fmt: skip
# ... with KVQuant's static (calibrated) per-channel key ranges
KVQUANT4_STATIC = KVScheme(
    "t-kvquant4-static", key=nuq(4, "channel", None, static=True, pre_rope=True, outlier_frac=0.05),
    value=nuq(4, "token", outlier_frac=0.05), sinks=1, residual=0, block=8,
)  # fmt: skip
# Hadamard-rotated sides (QuaRot), attended in the codes' basis: the preset rotates both and flushes every
# token (no tail); these rotate one side each, with sinks and a residual window (a rotated tail too)
HAD = {"rotate": "hadamard"}
ROT_KEYS = KVScheme("t-int4-rot-keys", key=spec(4, "token", **HAD), value=spec(4, "token", 16),
                    sinks=2, residual=4, block=16)  # fmt: skip
ROT_VALUES = KVScheme("t-int4-rot-values", key=spec(4, "channel", 16), value=spec(4, "token", 16, **HAD),
                      sinks=2, residual=4, block=16)  # fmt: skip
# keys centred and smoothed with calibrated channel vectors (install: a mean and a factor per channel), moved
# into the codes' basis at each step (q * factor, tail (k - mean) / factor); the preset flushes every token, this
# one keeps sinks and a residual window (a tail to move too)
SMOOTH_TAIL = KVScheme("t-int4-smooth-tail", key=spec(4, "token", centre=True, smooth=0.5), value=spec(4, "token", 16),
                       sinks=2, residual=4, block=16)  # fmt: skip
# ... before RoPE: a factor tied over RoPE pairs (as kvbits calibrate fits it) moves into the query and tail, the
# kernel decodes code + mean / factor and rotates; an untied factor stays in the kernel (code * factor + mean)
SMOOTH_PRE_ROPE = KVScheme("t-int4-smooth-prerope", key=spec(4, "token", centre=True, smooth=0.5, pre_rope=True),
                           value=spec(4, "token", 16), sinks=2, residual=4, block=16)  # fmt: skip
SMOOTH_PRE_ROPE_UNTIED = SMOOTH_PRE_ROPE.replace(name="t-int4-smooth-prerope-untied")
SCHEMES = {"int8-token": get_scheme("int8-token"), "int4-kivi": KIVI4, "int2-token": get_scheme("int2-token"),
           "int4-prerope": PRE_ROPE, "kvquant3-block": KVQUANT3, "kvquant4-static": KVQUANT4_STATIC,
           "fp8-e4m3-token": get_scheme("fp8-e4m3-token"), "fp8-e4m3": get_scheme("fp8-e4m3"),
           "fp8-e4m3-head": get_scheme("fp8-e4m3-head"), "int4-hadamard": get_scheme("int4-token-hadamard"),
           "fp8-hadamard": get_scheme("fp8-e4m3-hadamard"), "rot-keys": ROT_KEYS, "rot-values": ROT_VALUES,
           "int4-smooth": get_scheme("int4-token-smooth"), "smooth-tail": SMOOTH_TAIL,
           "smooth-prerope": SMOOTH_PRE_ROPE, "smooth-prerope-untied": SMOOTH_PRE_ROPE_UNTIED,
           "vllm-int4": get_scheme("vllm-int4"), "vllm-int8": get_scheme("vllm-int8"),
           "vllm-fp8-token": get_scheme("vllm-fp8-token")}  # fmt: skip


def install(cache: QuantizedKVCache, scheme: KVScheme, n_layers: int = 2, H_kv: int = 2, D: int = 32) -> None:
    """What a calibration artifact would install: NUQ codebooks (non-uniform), static key ranges, FP8
    per-head scales (a different one per head: the kernel must read each head's own)."""
    for side, spec in (("key", scheme.key), ("value", scheme.value)):
        if spec.has_channel_transform:  # a mean and a factor per (head, channel), different per layer
            for i in range(n_layers):
                grid = torch.linspace(0, 1, H_kv * D).reshape(H_kv, D)
                factor = 0.5 + 1.5 * grid.flip(-1)
                if spec.pre_rope and not scheme.name.endswith("-untied"):  # tied over RoPE pairs, as calibrated
                    factor = tie_rope_pairs(factor)
                cache.set_static_qparams(i, side, mean=((grid - 0.5) * (i + 1)).half(), factor=factor.half())
        if spec.kind == "fp8" and spec.granularity == "head":
            for i in range(n_layers):
                cache.set_static_qparams(i, side, torch.linspace(0.004, 0.012, H_kv) * (i + 1))
        if spec.kind != "nuq":
            continue
        u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
        cb = (u.abs() ** 1.5 * u.sign()).half()
        for i in range(n_layers):
            scale = zero = None
            if (
                spec.static
            ):  # pre-RoPE keys of these tiny models stay within about +-3: a range that clips a little
                scale, zero = torch.full((H_kv, D), 4.0).half(), torch.full((H_kv, D), -2.0).half()
            cache.set_static_qparams(i, side, scale, zero, codebook=cb)


def prompt(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        1, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(seed)
    )  # no pad id 0


@contextlib.contextmanager
def attention(model: torch.nn.Module, fused: bool):
    """The model's attention is ``kvbits_fused`` (or plain SDPA) inside, SDPA again after."""
    if fused:
        assert use_fused_decode(model) == "sdpa"
        assert model.config._attn_implementation == FUSED_ATTENTION
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


@torch.no_grad()
def generate(model, scheme, *, fused: bool | str, attn: bool, new: int = NEW, ids=None, **kw):
    """Greedy generation; returns (sequences, logits (new, B, V), cache)."""
    ids = prompt() if ids is None else ids
    cache = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused)
    install(cache, scheme)
    with attention(model, attn):
        out = model.generate(ids, **cache_kwargs(cache, model), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, **kw)  # fmt: skip
    return out.sequences, torch.stack(out.logits), cache


def code_flips(a: QuantizedKVCache, b: QuantizedKVCache, *, edges: bool = False) -> tuple[int, int]:
    """(stored code bytes that differ between two caches of one generation, code bytes in all).

    Codes truncated toward zero (``vllm-int8``) put each row's largest value on a code boundary (``x / scale``
    is 127 up to float rounding), so float-level differences between the two paths move it between 126 and 127
    (as they would in vLLM); those are counted only with ``edges``. Every other flip is."""
    flips = total = 0
    for la, lb in zip(a.layers, b.layers):
        for sa, sb in ((la._k, lb._k), (la._v, lb._v)):
            for ca, cb in zip(sa.chunks, sb.chunks):
                da, db = ca.data.view(torch.uint8), cb.data.view(torch.uint8)
                differ = da != db
                if not edges and sa.spec.rounding == "trunc" and sa.spec.bits == 8:  # a code per byte, offset 127
                    ma, mb = (da.long() - 127).abs(), (db.long() - 127).abs()
                    differ &= ~((torch.minimum(ma, mb) == 126) & (torch.maximum(ma, mb) == 127))
                flips += int(differ.sum())
                total += da.numel()
    return flips, total


def assert_same_bytes(a: QuantizedKVCache, b: QuantizedKVCache) -> None:
    """Same memory report, and the fused cache holds no tensor beyond it (+ its RoPE tables and position offsets).
    The offsets (``position_bytes``, apart from ``total_bytes``) may differ: transformers 5.17 hands the cache no
    position ids, so there only a generation through kvbits' attention (``track_positions``) records them; which
    one did depended on the tests run before it in the process."""
    ra, rb = a.memory_report(), b.memory_report()
    assert {k: v for k, v in ra.items() if k != "position_bytes"} == {k: v for k, v in rb.items() if k != "position_bytes"}
    extra = b.fused_report()["rope_table_bytes"] + rb["position_bytes"]
    assert storage_bytes(walk_tensors(b)) == rb["total_bytes"] + extra


# --------------------------------------------------------------------------------------------------
# Fused == dequantize + SDPA
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_matches_dequantized_path(arch: str, scheme: str):
    model, sch = build(arch), SCHEMES[scheme]
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False)
    with mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel:
        seq, logits, cache = generate(model, sch, fused=True, attn=True)
    n_layers = model.config.num_hidden_layers
    rep = cache.fused_report()
    # every decode step of every layer went through the kernel entry point, none fell back
    assert kernel.call_count == rep["fused_steps"] == (NEW - 1) * n_layers, rep
    assert rep["fallback_steps"] == 0 and all(r["claimed"] for r in rep["layers"])
    assert torch.equal(seq, seq_ref)
    # The two paths differ by float32 rounding (~1e-7) only; a code that lands on a quantization boundary
    # can round the other way (seen with static fp8, a coarse grid) and shift later logits by ~1e-4.
    flips, n_codes = code_flips(ref, cache)
    assert flips <= max(2, n_codes // 10_000), (flips, n_codes)
    moved = code_flips(ref, cache, edges=True)[0]
    torch.testing.assert_close(logits, logits_ref, atol=ATOL if moved == 0 else 1e-3, rtol=0)
    # the kernel read quantized slots, and blocks were flushed while decoding (new packed views)
    assert 0 < token_split(sch, PROMPT).quantized < token_split(sch, PROMPT + NEW - 1).quantized
    assert (
        cache.memory_report()["layers"][0]["quantized_tokens"] == token_split(sch, PROMPT + NEW - 1).quantized
    )
    assert_same_bytes(ref, cache)
    assert (rep["rope_table_bytes"] > 0) == sch.key.pre_rope
    for _, cos, sin in cache._fused_tables._tables.values():  # rotate-half tables: the first half only
        assert cos.shape[1] == sin.shape[1] == 32 // 2 and rep["rope_table_bytes"] == 2 * cos.numel() * 4
    # the planner, told the cache decodes fused, counts the RoPE tables too: every byte the cache holds
    planned = plan(model.config, context=PROMPT + NEW - 1, batch=seq.shape[0], scheme=sch, dtype_bytes=4,
                   fused_decode=True)  # fmt: skip
    assert planned["rope_table_bytes"] == rep["rope_table_bytes"]
    assert planned["total_bytes"] == cache.memory_report()["total_bytes"] + rep["rope_table_bytes"]


@torch.no_grad()
def test_observer_sees_every_fused_step_and_is_removed():
    """``observe_fused_decode``: each fused step's (layer, query, store, scaling), in layer order, before the kernel
    attends over that very store; afterwards the observer is gone and SDPA is back, also after an exception."""
    model, sch = build("llama"), SCHEMES["int4-kivi"]
    cache = QuantizedKVCache(config=model.config, scheme=sch, fused_decode=True)
    install(cache, sch)
    seen: list[tuple[int, tuple[int, ...], int]] = []
    stores: list[object] = []

    def observer(layer, query, store, scaling):
        seen.append((layer, tuple(query.shape), int(store.quant_lens.max())))
        stores.append(store)

    ids = prompt()
    steps = 3
    wrapped = mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention)
    with wrapped as kernel, observe_fused_decode(model, observer):
        assert model.config._attn_implementation == FUSED_ATTENTION
        model(ids, **cache_kwargs(cache, model), use_cache=True)  # prefill: SDPA, nothing observed
        assert seen == []
        nxt = ids[:, -1:]
        for _ in range(steps):
            model(nxt, **cache_kwargs(cache, model), use_cache=True)
    assert model.config._attn_implementation == "sdpa"
    n_layers = model.config.num_hidden_layers
    assert [layer for layer, _, _ in seen] == list(range(n_layers)) * steps
    assert all(shape == (ids.shape[0], 4, 1, 32) for _, shape, _ in seen)
    assert seen[0][2] == token_split(sch, PROMPT + 1).quantized > 0
    # the observer saw the kernel's own store object, call by call
    assert [c.args[1] for c in kernel.call_args_list] == stores

    def broken(*args):
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"), observe_fused_decode(model, broken):
        model(ids[:, -1:], **cache_kwargs(cache, model), use_cache=True)
    assert model.config._attn_implementation == "sdpa"
    from kvbits.cache import attention as attention_mod

    assert attention_mod._OBSERVERS == []


def test_rope_tables_keep_full_width_unless_the_halves_repeat():
    """``RopeTableCache`` keeps half-width tables only where ``RotaryTables.halves_equal`` says the
    halves repeat; otherwise full tables (same values either way for the kernel)."""
    from dataclasses import replace

    from kvbits.cache.fused import RopeTableCache
    from kvbits.quant.rope import RotaryTables

    rot = RotaryTables.from_config(build("llama").config)
    assert rot.halves_equal and rot.rot_dim == 32
    half, full = RopeTableCache(), RopeTableCache()
    c_half, s_half = half.get(rot, 100, torch.device("cpu"))
    c_full, s_full = full.get(replace(rot, halves_equal=False), 100, torch.device("cpu"))
    assert c_half.shape == (1024, 16) and c_full.shape == (1024, 32) and full.nbytes == 2 * half.nbytes
    assert torch.equal(torch.cat([c_half, c_half], 1), c_full) and torch.equal(torch.cat([s_half, s_half], 1), s_full)


def test_cpu_default_keeps_the_dequantized_path():
    """``fused_decode="auto"`` on CPU (and ``False`` anywhere): kvbits_fused is plain SDPA, bit for bit."""
    model = build("llama")
    seq_ref, logits_ref, _ = generate(model, KIVI4, fused="auto", attn=False)
    for mode in ("auto", False):
        with mock.patch.object(dispatch, "decode_attention") as kernel:
            seq, logits, cache = generate(model, KIVI4, fused=mode, attn=True)
        assert kernel.call_count == 0 and cache.fused_report()["fused_steps"] == 0
        assert not any(r["claimed"] for r in cache.fused_report()["layers"])
        assert torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)


@torch.no_grad()
def test_attention_that_does_not_dispatch_is_refused_or_logged(monkeypatch, caplog):
    """A model whose attention does not dispatch through the AttentionInterface keeps its implementation when
    asked for another (transformers logs it; Falcon before 5.25): ``use_fused_decode`` said "sdpa" as if done
    and every decode step attended over dequantized K/V, with no fused and no fallback step counted. It is
    refused, the implementation untouched; runners refuse it under ``fused_decode=True`` and, under ``"auto"``,
    log it once and decode over dequantized K/V (the same hidden states as ``fused_decode=False``)."""
    from kvbits.cache import UnsupportedAttention
    from kvbits.cache import fused as fused_mod
    from kvbits.evaluate import stream

    model = build("llama")
    monkeypatch.setattr(model, "set_attn_implementation", lambda impl: None)  # kept, as transformers keeps it
    with pytest.raises(UnsupportedAttention, match="LlamaForCausalLM did not accept attn_implementation='kvbits_"):
        use_fused_decode(model)
    assert model.config._attn_implementation == "sdpa"
    ids = prompt()
    with pytest.raises(UnsupportedAttention, match="AttentionInterface"):
        stream.stream_hidden(model, ids, KIVI4, fused_decode=True)
    want = stream.stream_hidden(model, ids, KIVI4, fused_decode=False)
    monkeypatch.setattr(fused_mod, "wants", lambda mode, device: True)  # "auto" as on CUDA with Triton
    monkeypatch.setattr(stream, "_UNFUSABLE_SAID", set())
    stats: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="kvbits.evaluate.stream"):
        for _ in range(2):
            got = stream.stream_hidden(model, ids, KIVI4, fused_decode="auto", stats=stats)
    assert torch.equal(got, want) and stats.get("fused_steps", 0) == 0
    assert caplog.text.count("did not accept") == 1 and "decoding over dequantized K/V" in caplog.text


@torch.no_grad()
def test_attention_sdpa_can_not_compute_is_refused():
    """gpt-oss's attention adds per-head sinks (``s_aux``) that transformers' SDPA drops without a word (its
    models set ``_supports_sdpa = False``); kvbits_fused attends through SDPA outside fused steps, so under
    ``use_fused_decode`` every prefill and decode step lost the sinks: logits 0.71 away from the model's own,
    with no fused step counted. Refused now (runners then decode through the model's own attention), and a call
    that passes sinks raises rather than dropping them."""
    from kvbits.cache import UnsupportedAttention
    from kvbits.cache.attention import fused_attention

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=8)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedAttention, match="GptOssForCausalLM does not support SDPA"):
        use_fused_decode(model)
    assert model.config._attn_implementation == before
    q = torch.randn(1, 4, 1, 16)
    kv = torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match=r"passes s_aux \(attention sinks\)"):
        fused_attention(model.model.layers[0].self_attn, q, kv, kv, None, s_aux=torch.zeros(4))


@torch.no_grad()
def test_falcon_decode_is_fused_where_its_attention_dispatches():
    """transformers' Falcon dispatches its attention through the AttentionInterface from 5.25: its decode steps
    are fused (the same tokens as dequantizing, every step through the kernel); before, it is refused."""
    from packaging.version import Version

    from kvbits.cache import UnsupportedAttention

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_kv_heads=2, new_decoder_architecture=True, bias=False)  # fmt: skip
    model = transformers.FalconForCausalLM(cfg).eval()
    if Version(transformers.__version__) < Version("5.25"):
        with pytest.raises(UnsupportedAttention, match="FalconForCausalLM did not accept"):
            use_fused_decode(model)
        return
    seq_ref, logits_ref, _ = generate(model, KIVI4, fused=False, attn=False)
    seq, logits, cache = generate(model, KIVI4, fused=True, attn=True)
    rep = cache.fused_report()
    assert rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)


def test_unsupported_scheme_falls_back_logged(caplog):
    """Float keys beside integer values: nothing to unpack on the key side; declined, logged, identical."""
    model = build("qwen2")
    sch = KVScheme("t-float-keys", key=TensorSpec(kind="float", bits=16, fmt="fp16"), value=spec(4, "token"),
                   residual=0, block=1)  # fmt: skip
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, new=6)
    with caplog.at_level(logging.INFO, logger="kvbits.cache.fused"):
        seq, logits, cache = generate(model, sch, fused=True, attn=True, new=6)
    rep = cache.fused_report()
    assert rep["fused_steps"] == 0 and all(r["declined"] for r in rep["layers"]), rep
    assert "falls back to SDPA" in caplog.text and "key kind 'float'" in caplog.text
    assert torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)
    assert_same_bytes(ref, cache)


@pytest.mark.parametrize("scheme", ["int4-hadamard", "rot-keys", "rot-values", "vllm-int4"])
def test_rotated_scheme_is_served_fused(caplog, scheme: str):
    """Hadamard-rotated sides (codes of x @ R) are served by the kernel in the codes' basis: every decode
    step fused, nothing declined, the packed store carries each side's rotation and the tail as the model's
    K/V; tokens and logits those of the dequantized path (which rotates the history back), same bytes. The
    test can fail: leaving the query, the tail or the output unrotated changes the logits."""
    model, sch = build("qwen2"), SCHEMES[scheme]
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False)
    with (
        caplog.at_level(logging.INFO, logger="kvbits.cache.fused"),
        mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel,
    ):
        seq, logits, cache = generate(model, sch, fused=True, attn=True)
    rep = cache.fused_report()
    assert kernel.call_count == rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0, rep
    assert all(r["claimed"] and not r["declined"] for r in rep["layers"]) and "falls back" not in caplog.text
    store = kernel.call_args.args[1]
    assert (store.key.rotate, store.value.rotate) == (sch.key.rotate, sch.value.rotate)
    has_tail = sch.sinks + sch.residual > 0
    assert (store.key_full is not None) == has_tail
    if has_tail:  # the model's K/V: what the dequantized path attends besides the quantized slots
        layer = cache.layers[1]
        keys, _ = layer.materialize(check=False)
        T_q, S = store.key.n_slots, layer._k.n_sinks
        assert torch.equal(store.key_full, torch.cat([keys[:, :, :S], keys[:, :, S + T_q :]], 2))
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)
    assert_same_bytes(ref, cache)
    parts = parts_that_matter(sch.key.rotate is not None, sch.value.rotate is not None, has_tail)
    assert len(parts) >= 2
    for part in parts:
        with skipping(part):
            _, bad, _ = generate(model, sch, fused=True, attn=True, new=3)
        assert (bad[1:] - logits_ref[1:3]).abs().max() > 1e-3, part  # logits[0] come from the prefill


@pytest.mark.parametrize("scheme", ["int4-smooth", "smooth-tail", "smooth-prerope", "smooth-prerope-untied"])
def test_smoothed_keys_are_served_fused(scheme: str):
    """Centred / smoothed keys (codes of (k - mean) / factor) are served by the kernel: post-RoPE in the
    codes' basis; pre-RoPE with a factor tied over RoPE pairs in the query and tail and ``mean / factor``
    decoded before RoPE, with an untied factor both vectors decoded before RoPE. Every decode step fused, the
    packed keys carry the layer's vectors, tokens and logits those of the dequantized path, same bytes. The
    test can fail: leaving the query unscaled, the tail in the model's basis or (pre-RoPE) the vectors out
    changes the logits."""
    model, sch = build("qwen2"), SCHEMES[scheme]
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False)
    with mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel:
        seq, logits, cache = generate(model, sch, fused=True, attn=True)
    rep = cache.fused_report()
    assert kernel.call_count == rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0, rep
    store = kernel.call_args.args[1]
    layer = cache.layers[1]
    assert store.key.channel_mean is layer._k.channel_mean and store.key.channel_factor is layer._k.channel_factor
    assert not store.value.has_channel_transform
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)
    assert_same_bytes(ref, cache)
    untied = scheme.endswith("-untied")
    parts = parts_that_matter(not untied, False, sch.sinks + sch.residual > 0 and not untied,
                              key_channels=sch.key.pre_rope)  # fmt: skip
    assert parts == {"int4-smooth": ["query"], "smooth-tail": ["query", "tail"],
                     "smooth-prerope": ["query", "tail", "channels"], "smooth-prerope-untied": ["channels"]}[scheme]
    for part in parts:
        with skipping(part):
            _, bad, _ = generate(model, sch, fused=True, attn=True, new=3)
        assert (bad[1:] - logits_ref[1:3]).abs().max() > 1e-3, part  # logits[0] come from the prefill


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["int4-prerope", "smooth-prerope"])
def test_pre_rope_keys_of_a_nope_layer_are_served_fused(caplog, scheme: str):
    """SmolLM3 with a NoPE layer (``no_rope_layers``): its pre-RoPE keys are un-rotated by nothing, so the kernel
    serves them as post-RoPE keys, without tables. Before, the layer was declined as "partial rotary embedding (0 of
    32 channels)", a reason that does not hold, and every step of it attended over dequantized K/V."""
    torch.manual_seed(0)
    cfg = transformers.SmolLM3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=0,
                                     no_rope_layers=[1, 0])  # layer 1 has no RoPE  # fmt: skip
    model, sch = transformers.SmolLM3ForCausalLM(cfg).eval(), SCHEMES[scheme]
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, new=6)
    with caplog.at_level(logging.INFO, logger="kvbits.cache.fused"):
        seq, logits, cache = generate(model, sch, fused=True, attn=True, new=6)
    rep = cache.fused_report()
    assert all(r["claimed"] and r["declined"] is None for r in rep["layers"]), rep
    assert rep["fused_steps"] == 5 * 2 and rep["fallback_steps"] == 0 and "falls back" not in caplog.text
    assert fused_mod.packed_store(cache.layers[1]).rope_cos is None  # the NoPE layer: no tables
    assert fused_mod.packed_store(cache.layers[0]).rope_cos is not None
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)
    assert_same_bytes(ref, cache)


ROPE_CONFIGS = {  # tiny configs of each way a model's RoPE reaches the fused path's tables
    "llama": lambda c: transformers.LlamaConfig(**c),
    "qwen2": lambda c: transformers.Qwen2Config(**c),
    "phi-partial": lambda c: transformers.PhiConfig(**{k: v for k, v in c.items() if k != "head_dim"},
                                                    partial_rotary_factor=0.5),  # declined: 8 of 16 channels
    "llama-dynamic": lambda c: transformers.LlamaConfig(
        **c, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),  # declined
    "smollm3": lambda c: transformers.SmolLM3Config(**c, no_rope_layers=[1, 0]),  # layer 1: no RoPE, no tables
    "smollm3-nope": lambda c: transformers.SmolLM3Config(**c, no_rope_layers=[0, 0]),
}  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("arch", list(ROPE_CONFIGS))
def test_planned_rope_tables_are_the_cache_s(arch: str):
    """``plan(config, fused_decode=True)`` counts the RoPE tables ``QuantizedKVCache(fused_decode=True)`` really
    holds: none for partial rotary and length-dependent rope (the fused path declines those layers), for NoPE
    layers (served without tables) and for rotated pre-RoPE keys (declined). Before, the planner counted half-width
    tables for every pre-RoPE layer: Phi 65,536 bytes, dynamic rope and an all-NoPE SmolLM3 131,072, cache 0."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "pad_token_id": 0}  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(ROPE_CONFIGS[arch](common)).eval()
    rotated = KVScheme("t-prerope-rot", key=spec(4, "channel", 16, pre_rope=True, **HAD),
                       value=spec(4, "token", 16), sinks=2, residual=4, block=16)  # fmt: skip
    for sch in [PRE_ROPE, rotated] if arch == "llama" else [PRE_ROPE]:
        seq, _, cache = generate(model, sch, fused=True, attn=True, new=4)
        rep = cache.fused_report()
        planned = plan(model.config, context=PROMPT + 3, batch=seq.shape[0], scheme=sch, dtype_bytes=4,
                       fused_decode=True)  # fmt: skip
        assert planned["rope_table_bytes"] == rep["rope_table_bytes"], (sch.name, rep)
        assert planned["total_bytes"] == cache.memory_report()["total_bytes"] + rep["rope_table_bytes"]
        holds = arch in ("llama", "qwen2", "smollm3") and sch is PRE_ROPE
        assert (rep["rope_table_bytes"] > 0) == holds, rep


def test_pre_rope_rotated_keys_fall_back_logged(caplog):
    """Pre-RoPE keys stored rotated: the kernel would apply RoPE to codes in the rotated basis. Declined with
    the reason logged; every step attends over dequantized K/V, identical to the plain path, same bytes."""
    model = build("llama")
    sch = KVScheme("t-prerope-rot", key=spec(4, "channel", 16, pre_rope=True, **HAD),
                   value=spec(4, "token", 16, **HAD), sinks=2, residual=4, block=16)  # fmt: skip
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, new=6)
    with caplog.at_level(logging.INFO, logger="kvbits.cache.fused"):
        seq, logits, cache = generate(model, sch, fused=True, attn=True, new=6)
    rep = cache.fused_report()
    assert rep["fused_steps"] == 0 and not any(r["claimed"] for r in rep["layers"]), rep
    reason = "pre-RoPE keys with a hadamard rotation (the kernel applies RoPE to the dequantized codes"
    assert all(r["declined"].startswith(reason) for r in rep["layers"]), rep
    assert "falls back to SDPA" in caplog.text and reason in caplog.text
    assert torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)
    assert_same_bytes(ref, cache)
    q = torch.randn(2, 4, 1, 32)
    with pytest.raises(NotImplementedError, match="pre-RoPE keys stored with a 'hadamard' rotation"):
        dispatch.decode_attention(q, fused_mod.packed_store(cache.layers[0]))


def test_sliding_layer_falls_back_full_layer_fused():
    """Gemma 3: the sliding layer is declined, the full-attention layer is served by the kernel."""
    model = build("gemma3")
    seq_ref, logits_ref, _ = generate(model, KIVI4, fused=False, attn=False)
    seq, logits, cache = generate(model, KIVI4, fused=True, attn=True)
    sliding, full = cache.fused_report()["layers"]
    assert not sliding["claimed"] and "sliding" in sliding["declined"] and sliding["steps"] == 0
    assert full["claimed"] and full["steps"] == NEW - 1
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="layer 0 is a sliding-window layer: the packed layout serves full-attention"):
        fused_mod.packed_store(cache.layers[0])  # a direct call is refused, not served past the window
    assert fused_mod.packed_store(cache.layers[1]).key is not None


def padded_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by 7 (more than the sinks: pads reach the quantized slots)."""
    ids = prompt()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("scheme", ["int4-prerope", "kvquant3-block"])
def test_padded_batch_is_fused_with_slot_masks(scheme: str):
    """Left padding leaves a boolean mask at every decode step: it becomes per-slot masks of the packed
    store and every step stays fused. The request's sinks widen by the most pads of a row (``widen_sinks``: 2 + 7),
    so row 1's 7 pads sit in its full-precision sink slots, its first 2 real tokens after them, and no pad among
    the quantized slots."""
    model, sch = build("llama"), SCHEMES[scheme]
    track_positions(model)  # both paths un-rotate at the model's positions, whatever transformers passes
    ids, mask = padded_prompt()
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, ids=ids, attention_mask=mask)
    with mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel:
        seq, logits, cache = generate(model, sch, fused=True, attn=True, ids=ids, attention_mask=mask)
    rep = cache.fused_report()
    assert rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0, rep
    store = kernel.call_args.args[1]
    assert store.quant_mask is not None and store.full_mask is not None
    pads, n_sinks = 7, sch.sinks + 7
    assert all(layer.sinks == n_sinks for layer in cache.layers)
    assert not store.full_mask[1, :pads].any() and store.full_mask[1, pads:].all() and store.full_mask[0].all()
    assert store.quant_mask.all()
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)
    assert_same_bytes(ref, cache)


def test_padded_batch_without_the_masks_would_differ():
    """The masks matter: the same padded batch with the masks dropped changes the logits."""
    model = build("llama")
    ids, mask = padded_prompt()
    _, logits_ref, _ = generate(model, PRE_ROPE, fused=False, attn=False, ids=ids, attention_mask=mask, new=4)
    real = fused_mod.packed_store
    with mock.patch.object(fused_mod, "packed_store", lambda layer, keep=None: real(layer)):
        _, logits, _ = generate(model, PRE_ROPE, fused=True, attn=True, ids=ids, attention_mask=mask, new=4)
    assert (logits[1:, 1] - logits_ref[1:, 1]).abs().max() > 1e-3  # sequence 1 attends its pads
    torch.testing.assert_close(logits[:, 0], logits_ref[:, 0], atol=ATOL, rtol=0)  # sequence 0 has none


def test_float_mask_falls_back_logged(caplog):
    """A non-boolean mask at a decode step (e.g. an additive bias) is not a slot mask: SDPA, logged."""
    model = build("llama")
    cache = QuantizedKVCache(config=model.config, scheme=KIVI4, fused_decode=True)
    from kvbits.cache.attention import fused_attention

    with attention(model, True), torch.no_grad():  # placeholders only while the model's attention is fused
        model(prompt(), **cache_kwargs(cache, model))
        layer = cache.layers[0]
        k, v = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
        pk, pv = cache.update(k, v, 0)
        q = torch.randn(2, 4, 1, 32)
        bias = torch.zeros(2, 1, 1, PROMPT + 1)
        with caplog.at_level(logging.INFO, logger="kvbits.cache.attention"):
            out, _ = fused_attention(model.model.layers[0].self_attn, q, pk, pv, bias)
    assert layer.fused.fallbacks == 1 and "non-boolean attention mask" in caplog.text
    keys, values = layer.materialize()
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------
# The cache side of the protocol
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_claimed_decode_steps_return_placeholders():
    model = build("llama")
    cache = QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=True)
    with attention(model, True):  # placeholders only while the model's attention is fused
        model(prompt(), **cache_kwargs(cache, model))
        layer = cache.layers[0]
        assert layer.fused.claimed
        k, v = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
        pk, pv = cache.update(k, v, 0)
    assert pk.is_meta and pv.is_meta and pk.shape == pv.shape == (2, 2, PROMPT + 1, 32)
    assert fused_mod.tag_of(pk) == (layer, True)
    # the packed store holds the same tokens materialize() dequantizes; pre-RoPE slot 0 is position `sinks`
    store = fused_mod.packed_store(layer)
    keys, values = layer.materialize()
    assert store.key.n_slots + store.key_full.shape[2] == keys.shape[2] == PROMPT + 1
    assert store.quant_pos0.tolist() == [PRE_ROPE.sinks] * 2
    assert (
        store.key.codes.untyped_storage().data_ptr() == layer._k.chunks[0].data.untyped_storage().data_ptr()
    )
    q = torch.randn(2, 4, 1, 32)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    torch.testing.assert_close(dispatch.decode_attention(q, store), want, atol=1e-5, rtol=1e-5)
    cache.reset()
    assert not layer.fused.claimed  # the next prefill claims again


@torch.no_grad()
def test_switching_away_from_fused_attention_mid_generation(caplog):
    """A cache ``kvbits_fused`` has claimed, continued with the model back on SDPA: its next decode step
    returns dequantized K/V (logged) and generation goes on as an unfused one would; back on ``kvbits_fused``
    the layers are claimed anew and decode fused again."""
    model, n_layers = build("llama"), 2
    seq_ref, logits_ref, _ = generate(model, PRE_ROPE, fused=False, attn=False, new=NEW + 5)
    seq, _, cache = generate(model, PRE_ROPE, fused=True, attn=True)  # the model is back on SDPA after it
    assert all(r["claimed"] for r in cache.fused_report()["layers"])
    kw = {"do_sample": False, "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}
    with caplog.at_level(logging.INFO, logger="kvbits.cache"):
        out = model.generate(seq, **cache_kwargs(cache, model), max_new_tokens=5, **kw)
    assert torch.equal(out.sequences, seq_ref)
    torch.testing.assert_close(torch.stack(out.logits), logits_ref[NEW:], atol=1e-3, rtol=0)
    assert any("changed from 'kvbits_fused' to 'sdpa'" in r.getMessage() for r in caplog.records)
    rep = cache.fused_report()
    assert not any(r["claimed"] for r in rep["layers"]) and rep["fused_steps"] == (NEW - 1) * n_layers
    with attention(model, True):
        model.generate(out.sequences, **cache_kwargs(cache, model), max_new_tokens=3, **kw)
    rep = cache.fused_report()
    assert all(r["claimed"] for r in rep["layers"]) and rep["fused_steps"] == (NEW - 1 + 2) * n_layers


@torch.no_grad()
def test_deepcopy_of_a_claimed_cache_decodes_fused():
    """Prompt reuse (prefill once, ``copy.deepcopy`` per continuation) with pre-RoPE keys: each copy stays
    claimed, decodes through the kernel exactly like a cache that prefilled the prompt itself, holds the same
    bytes and RoPE tables, and leaves the original as it was."""
    model = build("llama")
    ids = prompt(batch=1)
    with attention(model, True):
        base = QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=True)
        model(ids, **cache_kwargs(base, model))
        for seed in (2, 3):
            x = torch.cat([ids, prompt(batch=1, seed=seed)[:, :4]], 1)
            copied = copy.deepcopy(base)
            fresh = QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=True)
            model(ids, **cache_kwargs(fresh, model))
            outs = [
                model.generate(x, **cache_kwargs(c, model), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
                for c in (copied, fresh)
            ]  # fmt: skip
            assert torch.equal(outs[0].sequences, outs[1].sequences)
            assert torch.equal(torch.stack(outs[0].logits), torch.stack(outs[1].logits))
            rep, want = copied.fused_report(), fresh.fused_report()
            assert rep == want and rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0
            assert_same_bytes(fresh, copied)
            assert base.get_seq_length() == PROMPT and all(layer.fused.claimed for layer in base.layers)
        assert base.fused_report()["fused_steps"] == 0


def test_modes_and_device_policy(monkeypatch):
    with pytest.raises(ValueError, match="fused_decode"):
        QuantizedKVCache(num_layers=1, fused_decode="yes")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert fused_mod.wants("auto", torch.device("cuda")) and not fused_mod.wants("auto", torch.device("cpu"))
    assert fused_mod.wants(True, torch.device("cpu")) and not fused_mod.wants(False, torch.device("cuda"))
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert not fused_mod.wants("auto", torch.device("cuda"))


def _head_dim_48_as_on_cuda(monkeypatch) -> LlamaForCausalLM:
    """A 2-layer Llama of head dim 48 (the Triton kernel takes powers of two) under ``KVBITS_KERNEL=auto``, with
    ``fused_decode`` wanting the fused path as on CUDA with Triton (its kernels interpreted on CPU)."""
    use_triton(monkeypatch)  # kernel_reason imports the Triton kernels: interpreted on CPU
    monkeypatch.setenv("KVBITS_KERNEL", "auto")
    monkeypatch.setattr(fused_mod, "wants", lambda mode, device: True)  # as on CUDA with Triton
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=48)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_a_declined_layer_is_not_asked_again_at_every_decode_step(monkeypatch, caplog):
    """``fused_decode="auto"`` on CUDA under ``KVBITS_KERNEL=auto`` and a head dim the Triton kernel does not take
    (48): ``claim`` declined the layers at the prefill, then asked again at every decode step of every layer,
    building a packed store each time (``kernel_reason``) for the same answer: 40 stores for 2 layers and 20 calls,
    ~43 us of host time per layer and step. Now the decline holds for the request's decode steps (2 stores), is
    logged once, and the tokens are SDPA's."""
    model = _head_dim_48_as_on_cuda(monkeypatch)
    cfg = model.config
    seq_ref, _, _ = generate(model, KIVI4, fused=False, attn=False)
    real = fused_mod.packed_store
    with (
        mock.patch.object(fused_mod, "packed_store", side_effect=real) as stores,
        caplog.at_level(logging.INFO, logger="kvbits.cache.fused"),  # its own level: a CLI test may have set kvbits'
    ):
        seq, _, cache = generate(model, KIVI4, fused="auto", attn=True)
    assert stores.call_count == cfg.num_hidden_layers  # the prefill's claim, per layer
    rep = cache.fused_report()
    assert rep["fused_steps"] == 0 and all("power of two" in r["declined"] for r in rep["layers"])
    assert caplog.text.count("fused decode falls back to SDPA") == cfg.num_hidden_layers
    assert torch.equal(seq, seq_ref)


@torch.no_grad()
def test_a_decline_does_not_outlive_the_request(monkeypatch):
    """A layer declined at one request's prefill (head dim 48 under ``KVBITS_KERNEL=auto``, ``fused_decode="auto"``
    as on CUDA) kept its decline through ``reset()``: the next request, under ``KVBITS_KERNEL=reference`` (which
    serves head dim 48 from the packed store), was never asked again when its prompt was one token (``q == 1`` at its
    prefill too): 0 fused steps, where a two-token prompt gets 4 per layer. Now ``reset()`` forgets the decline."""
    model = _head_dim_48_as_on_cuda(monkeypatch)
    cfg = model.config
    cache = QuantizedKVCache(config=cfg, scheme=KIVI4, fused_decode="auto")
    kw = {**cache_kwargs(cache, model), "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with attention(model, True):
        model.generate(prompt(), **kw)
        assert all("power of two" in r["declined"] for r in cache.fused_report()["layers"])
        cache.reset()
        assert all(r["declined"] is None for r in cache.fused_report()["layers"])
        monkeypatch.setenv("KVBITS_KERNEL", "reference")
        seq = model.generate(prompt()[:, :1], **kw)
    rep = cache.fused_report()
    assert rep["fused_steps"] == 4 * cfg.num_hidden_layers and all(r["claimed"] for r in rep["layers"])
    seq_ref, _, _ = generate(model, KIVI4, fused=False, attn=False, new=5, ids=prompt()[:, :1])
    assert torch.equal(seq, seq_ref)


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [3, PROMPT])
def test_a_prefill_without_codes_is_claimed_as_one_with_codes(monkeypatch, prompt_len: int):
    """``fused_decode="auto"`` as on CUDA, ``KVBITS_KERNEL=auto``, FP8 codes in a format the Triton kernel does not
    read (``KIND_CODES`` without e5m2 here) behind a residual window of 4 tokens: a 3-token prompt stores no codes
    yet, and ``supported`` skips the sides it has no codes of, so the claim took the layers for the kernel while a
    40-token prompt's was declined; their decode steps, with codes by then, went to the torch reference, not the
    kernel nor SDPA. Now ``kernel_reason`` reads the codes' kind from the scheme: declined either way."""
    use_triton(monkeypatch)  # kernel_reason imports the Triton kernels: interpreted on CPU
    from kvbits.kernels import triton_decode

    monkeypatch.setenv("KVBITS_KERNEL", "auto")
    monkeypatch.setattr(fused_mod, "wants", lambda mode, device: True)  # as on CUDA with Triton
    monkeypatch.setattr(triton_decode, "KIND_CODES", {k: c for k, c in triton_decode.KIND_CODES.items()
                                                      if k != ("fp8", "e5m2")})  # fmt: skip
    e5m2 = TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="token")
    sch = KVScheme("t-fp8-e5m2-tail", key=e5m2, value=e5m2, residual=4, block=4)
    model, ids = build("llama"), prompt()[:, :prompt_len]
    seq, _, cache = generate(model, sch, fused="auto", attn=True, ids=ids)
    assert cache.layers[0]._k.n_quantized > 0  # codes by the last step
    rep = cache.fused_report()
    assert rep["fused_steps"] == 0 and all("e5m2 codes" in r["declined"] for r in rep["layers"])
    seq_ref, _, _ = generate(model, sch, fused=False, attn=False, ids=ids)
    assert torch.equal(seq, seq_ref)


# --------------------------------------------------------------------------------------------------
# Through the Triton kernel (interpreted on CPU)
# --------------------------------------------------------------------------------------------------


def use_triton(monkeypatch) -> None:
    """Decode through the Triton kernel: on the GPU, else Triton's interpreter (skip without Triton)."""
    if not torch.cuda.is_available():
        try:
            from kvbits.kernels.interpret import enable_interpreter

            enable_interpreter()
        except ImportError as exc:
            pytest.skip(f"Triton is not importable: {exc}")
    if not dispatch.triton_available():
        pytest.skip("Triton is not importable")
    monkeypatch.setenv("KVBITS_KERNEL", "triton")


@pytest.mark.parametrize(
    "scheme,padded",
    [("int4-prerope", False), ("kvquant3-block", True), ("fp8-e4m3-token", True), ("rot-keys", True),
     ("rot-values", False), ("fp8-hadamard", True), ("smooth-prerope", True), ("smooth-prerope-untied", False),
     ("vllm-int4", True), ("vllm-int8", True), ("vllm-fp8-token", False)],
)  # fmt: skip
def test_fused_decode_triton_kernel(monkeypatch, scheme: str, padded: bool):
    """Through the Triton kernel itself: pre-RoPE keys with sinks (RoPE in-kernel, gather path); KVQuant's
    NUQ codes with sparse outliers and FP8 codes, in a left-padded batch (slot masks); Hadamard-rotated keys
    or values with a tail (the wrapper's basis change); static FP8 after a rotation (fp8-e4m3-hadamard);
    pre-RoPE centred / smoothed keys (``mean / factor`` decoded in the kernel before RoPE, the tied factor in
    the query), left-padded, and with an untied factor (both decoded in the kernel)."""
    use_triton(monkeypatch)
    from kvbits.kernels import triton_decode

    model, sch = build("qwen2"), SCHEMES[scheme]
    kw = dict(zip(("ids", "attention_mask"), padded_prompt())) if padded else {}
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, new=5, **kw)
    with mock.patch.object(
        triton_decode, "decode_attention_triton", wraps=triton_decode.decode_attention_triton
    ) as k:
        seq, logits, cache = generate(model, sch, fused=True, attn=True, new=5, **kw)
    assert k.call_count == cache.fused_report()["fused_steps"] == 4 * 2
    assert (k.call_args.args[1].quant_mask is not None) == padded
    assert torch.equal(seq, seq_ref) and code_flips(ref, cache)[0] == 0
    moved = code_flips(ref, cache, edges=True)[0]  # vllm-int8's row maxima, on their truncation boundary
    torch.testing.assert_close(logits, logits_ref, atol=ATOL if moved == 0 else 1e-3, rtol=0)


@torch.no_grad()
def test_forced_triton_refuses_a_head_dim_it_cannot_take_at_the_claim(monkeypatch):
    """``KVBITS_KERNEL=triton`` with a head dim of 80 (not a power of two): the cache claimed the layers anyway
    (``kernel_reason`` asked nothing unless ``KVBITS_KERNEL=auto``), ran the whole prefill, stored the first new
    token and raised at the first decode step from the kernel's dispatch. Now the claim (layer 0's prefill call)
    raises, naming the layer, the head dim and what to set instead; ``KVBITS_KERNEL=auto`` decodes it (the torch
    reference here) as before."""
    use_triton(monkeypatch)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=160, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=80)  # fmt: skip
    model, ids = Qwen2ForCausalLM(cfg).eval(), prompt()
    sch = get_scheme("int4-token")
    cache = QuantizedKVCache(config=cfg, scheme=sch, fused_decode=True)
    with attention(model, True), pytest.raises(
        NotImplementedError, match=r"layer 0: KVBITS_KERNEL=triton.*head_dim .*got 80; set KVBITS_KERNEL=auto"
    ):
        model.generate(ids, **cache_kwargs(cache, model), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cache.layers[0].tokens_seen == ids.shape[1] and not cache.layers[0].fused.claimed  # no decode step
    monkeypatch.setenv("KVBITS_KERNEL", "auto")
    seq, _, cache = generate(model, sch, fused=True, attn=True, new=3)
    seq_ref, _, _ = generate(model, sch, fused=False, attn=False, new=3)
    assert torch.equal(seq, seq_ref) and cache.fused_report()["fused_steps"] == 2 * 2


def test_fused_decode_triton_f16_dequant(monkeypatch):
    """``KVBITS_DEQUANT=f16`` through the cache: a float16 model's decode steps take the float16
    dequantization for both sides of KIVI's layout (packed blocks as the cache stores them, scale groups of
    16 tokens under 64-token tiles) and give the tokens and logits of the float32-dequantizing kernel."""
    use_triton(monkeypatch)
    from kvbits.kernels import triton_decode

    model = copy.deepcopy(build("llama")).half()
    spy = LaunchSpy(triton_decode._decode_kernel)
    seen = spy.seen
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    seq32, logits32, _ = generate(model, KIVI4, fused=True, attn=True, new=5)
    assert seen and not any(m.get("F16_K") or m.get("F16_V") for m in seen)
    seen.clear()
    monkeypatch.setenv("KVBITS_DEQUANT", "f16")
    seq16, logits16, cache = generate(model, KIVI4, fused=True, attn=True, new=5)
    assert len(seen) == cache.fused_report()["fused_steps"] == 4 * 2
    assert all(m.get("F16_K") and m.get("F16_V") for m in seen)
    assert torch.equal(seq16, seq32)
    torch.testing.assert_close(logits16.float(), logits32.float(), atol=2e-2, rtol=0)
    if not torch.cuda.is_available():  # interpreted: both paths give the same float16 K/V, so the same logits
        assert torch.equal(logits16, logits32)


def test_fused_decode_triton_autotuned(monkeypatch, tmp_path):
    """``KVBITS_AUTOTUNE=on`` through the cache: the float16 model's first fused decode step tunes its launch key
    (two candidates here, both timed), every later step of every layer takes the chosen launch without timing
    again, and the tokens are the default launch's (logits up to the tolerance the tuner allows)."""
    use_triton(monkeypatch)
    from kvbits.kernels import autotune

    model = copy.deepcopy(build("llama")).half()
    seq0, logits0, _ = generate(model, KIVI4, fused=True, attn=True, new=5)
    by = {c.name: c for c in autotune.CANDIDATES}
    monkeypatch.setattr(autotune, "CANDIDATES", (by["default"], by["f16-w2-s3"]))
    monkeypatch.setattr(autotune, "_TUNERS", {})
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "on")
    monkeypatch.setenv(autotune.FILE_ENV, str(tmp_path / "decode.json"))
    tune = autotune.DecodeTuner.tune
    with mock.patch.object(autotune.DecodeTuner, "tune", autospec=True, side_effect=tune) as tunes:
        seq, logits, cache = generate(model, KIVI4, fused=True, attn=True, new=5)
    assert cache.fused_report()["fused_steps"] == 4 * 2 and tunes.call_count == 1
    (entry,) = autotune.read_tunings(tmp_path / "decode.json").values()
    assert set(entry.ms) == {"default", "f16-w2-s3"} and entry.rejected == {}
    assert torch.equal(seq, seq0)
    torch.testing.assert_close(logits.float(), logits0.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("scheme", ["int4-kivi", "vllm-int8", "smooth-tail"])
def test_fused_decode_triton_fold(monkeypatch, scheme: str):
    """``KVBITS_DEQUANT=fold`` through the cache: a float16 model's every fused decode step takes the folded-scale
    kernel (KIVI's groups; vLLM's truncated INT8 rows with float32 scales; smoothed keys with sinks and a residual
    window; rotated sides are tested in tests/test_fold.py), with the tokens of the default float32-dequantizing kernel and its logits up to float16
    rounding: until a step whose two best logits are that close (a near tie of this random model), after which
    the inputs differ."""
    use_triton(monkeypatch)
    from kvbits.kernels import triton_fold

    model, sch = copy.deepcopy(build("llama")).half(), SCHEMES[scheme]
    seq32, logits32, _ = generate(model, sch, fused=True, attn=True, new=5)
    spy = LaunchSpy(triton_fold._fold_kernel)
    monkeypatch.setattr(triton_fold, "_fold_kernel", spy)
    monkeypatch.setenv("KVBITS_DEQUANT", "fold")
    seq, logits, cache = generate(model, sch, fused=True, attn=True, new=5)
    assert len(spy.seen) == cache.fused_report()["fused_steps"] == 4 * 2
    new = seq.shape[1] - logits.shape[0]
    same = int((seq[:, new:] == seq32[:, new:]).all(dim=0).long().cumprod(0).sum())  # steps before a divergence
    torch.testing.assert_close(logits[: same + 1].float(), logits32[: same + 1].float(), atol=2e-2, rtol=0)
    if same < logits.shape[0]:  # a flip only at a near tie
        top2 = logits32[same].float().topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) < 4e-2, (scheme, same)
    assert same >= 3, (scheme, same)


# --------------------------------------------------------------------------------------------------
# Lazy K/V checks (the default on CUDA) through fused generation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int4-kivi", "int4-prerope"])
def test_lazy_checks_fused_generation_matches_eager(scheme: str):
    """Lazy checks forced on CPU (a check every 4 steps during the 20): same tokens, logits, bytes and
    fused steps as the eager checks."""
    model, sch = build("llama"), SCHEMES[scheme]
    out = {}
    for mode in ("eager", "lazy"):
        cache = QuantizedKVCache(
            config=model.config, scheme=sch, fused_decode=True, checks=mode, check_every=4
        )
        with attention(model, True), torch.no_grad():
            gen = model.generate(prompt(), **cache_kwargs(cache, model), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        assert cache.layers[0].checks.lazy == (mode == "lazy")
        out[mode] = (gen.sequences, torch.stack(gen.logits), cache.memory_report(), cache.fused_report())
    assert torch.equal(out["eager"][0], out["lazy"][0]) and torch.equal(out["eager"][1], out["lazy"][1])
    assert out["eager"][2:] == out["lazy"][2:]
    assert out["lazy"][3]["fused_steps"] == (NEW - 1) * 2


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_nan_during_fused_generation_is_caught(mode: str):
    """A NaN in layer 1's keys at decode step 3: eager checks refuse it at once; lazy checks
    (check_every=8) let it through to the next check, at step 8, and name layer 1 and the steps."""
    model = build("llama")
    k_proj = model.model.layers[1].self_attn.k_proj
    calls = []

    def poison(module, args, output):
        calls.append(output.shape[1])
        if len(calls) == 4:  # prefill is step 0
            output = output.clone()
            output[0, -1, 5] = float("nan")
        return output

    cache = QuantizedKVCache(config=model.config, scheme=KIVI4, fused_decode=True, checks=mode, check_every=8)
    handle = k_proj.register_forward_hook(poison)
    try:
        with attention(model, True), torch.no_grad(), pytest.raises(ValueError) as err:
            model.generate(
                prompt(), **cache_kwargs(cache, model), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
    finally:
        handle.remove()
    if mode == "eager":
        assert len(calls) == 4 and "layer 1 key_states contains non-finite values (2 NaN" in str(
            err.value
        )  # RoPE pairs channel 5 and 21
    else:
        assert len(calls) == 8  # raised by the check before layer 0 stores step 8
        assert "layer 1 key_states contain NaN" in str(err.value) and "update steps 0..7" in str(err.value)
        assert "also failed" not in str(err.value)  # layer 0, below the NaN, stayed clean
        with pytest.raises(ValueError, match="layer 1 key_states contain NaN"):
            cache.fused_report()


# --------------------------------------------------------------------------------------------------
# Pre-RoPE keys of a left-padded batch are quantized in the model's own pre-RoPE frame
# --------------------------------------------------------------------------------------------------


def _strip_update_positions(monkeypatch) -> list[bool]:
    """Make ``QuantizedKVCache.update`` see no ``position_ids`` from transformers (as on 5.17); returns a
    list that records, per call, whether transformers had passed some."""
    from kvbits.cache.layer import find_position_ids

    seen: list[bool] = []
    original = QuantizedKVCache.update

    def update(self, k, v, layer_idx, *args, **kwargs):
        seen.append(find_position_ids(args, kwargs) is not None)
        inner = kwargs.get("kwargs")
        if isinstance(inner, dict):
            kwargs = {**kwargs, "kwargs": {n: x for n, x in inner.items() if n != "position_ids"}}
        kwargs.pop("position_ids", None)
        return original(self, k, v, layer_idx, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "update", update)
    return seen


@torch.no_grad()
@pytest.mark.parametrize("source", ["update", "tracked", "none"])
def test_padded_pre_rope_keys_are_the_models(monkeypatch, caplog, source: str):
    """What the cache quantizes for pre-RoPE keys must be ``k_proj``'s output (KVQuant §3.2). With left
    padding the model's positions start after the pads; the cache reads them from the position ids
    (``pos_offset``): those transformers passes to ``Cache.update`` (``update``, transformers 5.24), or,
    where it passes none (5.17, simulated here), those ``track_positions(model)`` takes from the model's
    call (``tracked``). With neither (``none``, the control) keys are un-rotated at cache indices: the
    padded sequence's keys stay rotated by the pad count, far from the model's pre-RoPE keys, and the
    cache says so once."""
    model = build.__wrapped__("llama")  # a model of its own: no tracking left by other tests
    sch = KVScheme("t-int8-prerope", key=spec(8, "channel", 8, pre_rope=True), value=spec(8, "token"),
                   residual=0, block=8)  # fmt: skip
    ids, mask = padded_prompt()
    captured = []
    k_proj = model.model.layers[0].self_attn.k_proj
    hooks = [k_proj.register_forward_hook(lambda m, a, out: captured.append(out))]
    seen = _strip_update_positions(monkeypatch) if source != "update" else None
    if source == "tracked":
        hooks.append(track_positions(model))
    cache = QuantizedKVCache(config=model.config, scheme=sch)
    try:
        with caplog.at_level(logging.INFO, logger="kvbits.cache.cache"):
            model.generate(ids, attention_mask=mask, **cache_kwargs(cache, model), max_new_tokens=1, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    B, T = ids.shape
    store = cache.layers[0]._k
    if source == "update" and store.pos_offset is None:
        pytest.skip(f"transformers {transformers.__version__} passes no position_ids to Cache.update")
    want = captured[0].view(B, T, 2, 32).transpose(1, 2)  # (B, H_kv, T, D): k_proj before RoPE
    assert store.n_quantized == T  # the whole prompt was flushed at prefill
    got = torch.cat([c.dequantize() for c in store.chunks], dim=2)[:, :, :T]
    err = [(got[b, :, p:] - want[b, :, p:]).norm() / want[b, :, p:].norm() for b, p in ((0, 0), (1, 7))]
    assert err[0] < 0.02  # the unpadded sequence: int8 error only, either way
    told = [r for r in caplog.records if "no position_ids reached the cache" in r.getMessage()]
    if source == "none":
        assert err[1] > 0.1  # rotated by 7 positions
        assert store.pos_offset is None and len(told) == 1  # said once for the cache, not per layer
    else:
        assert err[1] < 0.02 and torch.equal(store.pos_offset, torch.tensor([0, 7]))
        assert not told
    if seen is not None:
        assert seen  # the updates went through the stripping wrapper
    assert cache.position_ids_hint is None  # forgotten when the call returned


def test_track_positions_hands_the_calls_positions_only_during_the_call():
    """The hint exists while ``model(...)`` runs (what the layers read), is cleared after it (also when
    the call raises), tracking is idempotent and removable, and other caches are left alone."""
    model = build.__wrapped__("llama")  # a model of its own: the tracking stays on it
    cache = QuantizedKVCache(config=model.config, scheme=PRE_ROPE)
    during = []
    probe = model.model.register_forward_pre_hook(lambda m, a: during.append(cache.position_ids_hint))
    tracking = track_positions(model)
    assert track_positions(model) is tracking
    pos = torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        model(torch.ones(1, 5, dtype=torch.long), **cache_kwargs(cache, model), position_ids=pos)
    assert during and torch.equal(during[-1], pos) and cache.position_ids_hint is None

    def boom(m, a):
        raise RuntimeError("boom")

    failing = model.model.embed_tokens.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(torch.ones(1, 5, dtype=torch.long), **cache_kwargs(cache, model), position_ids=pos + 5)
    failing.remove()
    assert torch.equal(during[-1], pos + 5) and cache.position_ids_hint is None
    tracking.remove()
    with torch.no_grad():
        model(torch.ones(1, 1, dtype=torch.long), **cache_kwargs(cache, model), position_ids=pos[:, :1] + 5)
    assert during[-1] is None  # no tracking: no hint
    probe.remove()
    assert track_positions(model) is not tracking  # tracks again after remove()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        track_positions("not a model")


@torch.no_grad()
def _decode_at(model, cache, ids: torch.Tensor, start: int, fused: bool, prefill: int = PROMPT) -> torch.Tensor:
    """Logits ``(steps, B, V)`` of a prefill then one-token steps whose position ids start at ``start``."""
    outs = []
    with attention(model, fused):
        pos = torch.arange(start, start + ids.shape[1])[None]
        outs.append(model(ids[:, :prefill], **cache_kwargs(cache, model), position_ids=pos[:, :prefill]).logits[:, -1])
        for i in range(prefill, ids.shape[1]):
            outs.append(model(ids[:, i : i + 1], **cache_kwargs(cache, model), position_ids=pos[:, i : i + 1]).logits[:, -1])
    return torch.stack(outs)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_positions_ahead_of_the_cache_are_covered_by_the_rope_tables(monkeypatch, kernel: str):
    """Position ids that start far past the cache indices (a request given its own positions): pre-RoPE
    keys were un-rotated there, so the fused path's RoPE tables must reach them. Before, the tables covered
    the cache indices only: the reference clamped the positions (logits off by ~5e-3) and the Triton kernel
    read past the tables' end (off by ~0.6 through the interpreter)."""
    if kernel == "triton":
        use_triton(monkeypatch)
    model, start = build("llama"), 3000
    ids = prompt(batch=1)[:, : PROMPT if kernel == "reference" else 24]
    ids = torch.cat([ids, prompt(batch=1, seed=2)[:, : 20 if kernel == "reference" else 3]], dim=1)
    prefill = ids.shape[1] - (20 if kernel == "reference" else 3)
    want = _decode_at(model, QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=False), ids,
                      start, fused=False, prefill=prefill)  # fmt: skip
    cache = QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=True)
    got = _decode_at(model, cache, ids, start, fused=True, prefill=prefill)
    assert cache.fused_report()["fused_steps"] == 2 * (ids.shape[1] - prefill)
    assert cache.layers[0]._k.positions_ahead() == start
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_positions_below_zero_are_clamped_alike_on_every_path(monkeypatch, kernel: str):
    """Position ids that start below 0 put unmasked keys at negative positions: the stores un-rotated them
    there while the kernels clamp positions at 0 (logits off by ~1e-3). ``rope_at`` now clamps
    as the kernels do, so every path un-rotates and rotates back at the same positions."""
    if kernel == "triton":
        use_triton(monkeypatch)
    model, n_new = build("llama"), (20 if kernel == "reference" else 3)
    ids = torch.cat([prompt(batch=1)[:, : PROMPT if kernel == "reference" else 24], prompt(batch=1, seed=2)[:, :n_new]], 1)
    prefill = ids.shape[1] - n_new
    want = _decode_at(model, QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=False), ids,
                      -5, fused=False, prefill=prefill)  # fmt: skip
    cache = QuantizedKVCache(config=model.config, scheme=PRE_ROPE, fused_decode=True)
    got = _decode_at(model, cache, ids, -5, fused=True, prefill=prefill)
    assert cache.fused_report()["fused_steps"] == 2 * n_new
    assert cache.layers[0]._k.pos_offset.tolist() == [5]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_right_padded_batch_is_fused_and_exact():
    """A right-padded prompt (generate warns, and gives the pads position 0): the offset comes from the
    last real token, not the newest pad. Before, sequence 1's offset was 39 (every quantized key at a
    negative position, un-rotated there but rotated back at 0 by the fused path: logits off by 0.66)."""
    model = build("llama")
    ids = prompt()
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    _, logits_ref, ref = generate(model, PRE_ROPE, fused=False, attn=False, ids=ids, attention_mask=mask)
    _, logits, cache = generate(model, PRE_ROPE, fused=True, attn=True, ids=ids, attention_mask=mask)
    assert cache.fused_report()["fused_steps"] == (NEW - 1) * 2
    assert cache.layers[0]._k.pos_offset.tolist() == [0, 0] == ref.layers[0]._k.pos_offset.tolist()
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=0)


def test_position_offset_rules():
    """Offsets of rows as generate pads them: left padding (pads at 0, or 1 in older transformers; the
    newest token sets it), right padding (the last real token does), explicit positions (either)."""
    k = torch.randn(1, 2, 6, 32)

    def offset(row: list[int], n_before: int = 0) -> int:
        pos = torch.tensor([row])
        return int(position_offset((), {"kwargs": {"position_ids": pos}}, n_before, k)[0])

    assert offset([0, 0, 0, 0, 1, 2]) == 3 == offset([1, 1, 1, 0, 1, 2])  # left padded by 3
    assert offset([1, 1, 1, 1, 1, 0]) == 5 == offset([0, 0, 0, 0, 0, 0])  # one real token after 5 pads
    assert offset([0, 1, 2, 3, 0, 0]) == 0 == offset([0, 1, 2, 3, 1, 1])  # right padded by 2
    assert offset([0, 1, 2, 3, 4, 5], n_before=7) == 7 and offset([10, 11, 12, 13, 14, 15]) == -10
    empty = torch.zeros(1, 0, dtype=torch.long)  # a zero-token update (it raised IndexError)
    assert position_offset((), {"kwargs": {"position_ids": empty}}, 0, k[:, :, :0]) is None


def test_position_offsets_are_read_once_per_request():
    """Offsets come from the first update's position ids (the prefill) and stay: later position ids that
    stop following the cache cannot re-rotate blocks un-rotated with the old ones; reset() forgets them."""
    cache = QuantizedKVCache(config=build("llama").config, scheme=PRE_ROPE)
    k = torch.randn(2, 2, 12, 32)
    # what generate passes for a batch whose sequence 1 has 5 pads: pads at position 1, then 0..6
    pos = torch.stack([torch.arange(12), torch.cat([torch.ones(5, dtype=torch.long), torch.arange(7)])])
    cache.update(k, k, 0, kwargs={"position_ids": pos})
    offsets = cache.layers[0]._k.pos_offset.clone()
    assert offsets.tolist() == [0, 5]
    cache.update(k[:, :, :1], k[:, :, :1], 0, kwargs={"position_ids": torch.tensor([[100], [3]])})
    assert torch.equal(cache.layers[0]._k.pos_offset, offsets)
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # no position ids at all: unchanged
    assert torch.equal(cache.layers[0]._k.pos_offset, offsets)
    cache.reset()
    cache.update(k, k, 0)
    assert cache.layers[0]._k.pos_offset is None  # no position ids: cache indices, as before


@torch.no_grad()
def test_attention_arguments_the_kernel_does_not_take_fall_back():
    """T5's decoder passes ``position_bias`` to the attention function: SDPA adds it, the fused step dropped it
    (fp16 storage: logits 0.14 away from the non-fused path). A step with an argument the kernel does not take
    now attends over the store through SDPA, logged as a fallback: the same logits."""
    from transformers import DynamicCache, EncoderDecoderCache

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, caches = {}, {}
    for fused in (False, True):
        caches[fused] = QuantizedKVCache(scheme="fp16", num_layers=2, fused_decode=fused)
        previous = use_fused_decode(model) if fused else None
        try:
            out = model.generate(ids, **cache_kwargs(EncoderDecoderCache(caches[fused], DynamicCache()), model),
                                 max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        finally:
            if fused:
                model.set_attn_implementation(previous)
        logits[fused] = torch.stack(out.logits)
    rep = caches[True].fused_report()
    assert rep["fused_steps"] == 0 and torch.equal(logits[True], logits[False])
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.25"):  # T5 on 5.17 never hands the layers over: nothing to fuse
        assert rep["fallback_steps"] > 0


@torch.no_grad()
def test_sparse_attention_indices_are_refused_and_a_sliced_prompt_gets_its_causal_mask():
    """DeepSeek-V3.2 applies its top-k mask only under "eager" / "sdpa" and otherwise passes ``indices`` for
    FlashMLA, which SDPA dropped: dense attention, logits 0.31 off. Refused. Gemma 4's KV-shared layers slice the
    prompt to ``logits_to_keep`` queries with no mask except under "sdpa": torch's top-left ``is_causal`` then cut
    the keys (logits 0.17 off); the bottom-right causal mask is built instead."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, index_topk=4, index_head_dim=32, index_n_heads=2,
    )  # fmt: skip
    model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    ids = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    previous = use_fused_decode(model)
    try:
        with pytest.raises(NotImplementedError, match=r"passes indices \(sparse attention's top-k indices"):
            model(ids)
    finally:
        model.set_attn_implementation(previous)
    types = ["sliding_attention", "full_attention"] * 3
    cfg = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, layer_types=types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=16,
        attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    want = model(ids, **cache_kwargs(transformers.DynamicCache(config=cfg), model)).logits[:, -8:]
    previous = use_fused_decode(model)
    try:
        got = model(ids, logits_to_keep=8, **cache_kwargs(transformers.DynamicCache(config=cfg), model)).logits
    finally:
        model.set_attn_implementation(previous)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("name", "value"), [("KVBITS_KERNEL", "trition"), ("KVBITS_DEQUANT", "f8"), ("KVBITS_AUTOTUNE", "maybe")]
)
def test_fused_decode_true_refuses_bad_kernel_settings_at_construction(monkeypatch, name: str, value: str):
    """``fused_decode=True`` with a misspelt kernel setting: refused when the cache is made. Before, the
    error came at the first fused decode step, after the whole prefill had run."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        QuantizedKVCache(build("qwen2").config, "kivi-4", fused_decode=True)
    QuantizedKVCache(build("qwen2").config, "kivi-4", fused_decode=False)  # never reads them


@torch.no_grad()
def test_logit_softcapping_is_refused():
    """Gemma 2 caps its attention logits (``attn_logit_softcapping``). transformers 5.25 marks it
    ``_supports_sdpa = False``; 5.17 did not, and its SDPA dropped the softcap without a word, so
    ``use_fused_decode`` took the model and every step lost the softcap: logits 0.62 off the model's eager attention on
    this tiny Gemma 2 (q/k weights scaled so that the cap bites). Refused now on any version (the runners then decode
    through the model's own attention), and a call passing a softcap raises rather than dropping it."""
    from kvbits.cache import UnsupportedAttention
    from kvbits.cache.attention import fused_attention

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=48,
                                    attn_logit_softcapping=0.5, attn_implementation="eager")  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    refused = pytest.raises(UnsupportedAttention, match=r"caps its logits \(attn_logit_softcapping=0.5\)")
    with mock.patch.object(type(model), "_supports_sdpa", True), refused:  # _supports_sdpa: as transformers 5.17 said
        use_fused_decode(model)
    assert model.config._attn_implementation == "eager"
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match=r"passes softcap \(attention logit softcapping"):
        fused_attention(model.model.layers[0].self_attn, q, kv, kv, None, softcap=0.5)


def test_inkling2_sinks_are_refused():
    """Inkling 2 passes its per-token attention sinks as ``sinks=`` (gpt-oss's are ``s_aux=``). ``kvbits_fused`` (reached
    through ``from_pretrained(attn_implementation="kvbits_fused")``, which skips ``use_fused_decode``'s refusal) handed
    them to SDPA, whose ``**kwargs`` dropped them: the output was SDPA's without sinks, exactly. Raises now."""
    from kvbits.cache.attention import fused_attention

    module = torch.nn.Module()
    q = k = v = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match=r"passes sinks \(per-token attention sinks"):
        fused_attention(module, q, k, v, None, scaling=8**-0.5, sinks=torch.full((1, 2, 5, 1), 5.0))
