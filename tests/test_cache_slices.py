"""Long flushes and long histories are quantized and decoded ``SLICE_TOKENS`` tokens at a time
(``kvbits.cache.store``): the same bits as one call, and a working set of one slice beside what a step
returns."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvbits.cache import QuantizedKVCache
from kvbits.cache import store as store_mod
from kvbits.evaluate.livebytes import LiveBytes
from kvbits.schemes import KVScheme, TensorSpec, get_scheme, list_schemes

CFG = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
HEAD_BLOCKS = KVScheme(  # head granularity: one chunk per block (decoded in groups of blocks)
    "test-head",
    key=TensorSpec(kind="int", bits=4, fmt=None, granularity="head"),
    value=TensorSpec(kind="int", bits=3, fmt=None, granularity="tensor", symmetric=True),
    sinks=2, residual=8, block=8,
)  # fmt: skip
PRE_ROPE_SINKS = KVScheme(
    "test-prerope-sinks",
    key=TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=16, pre_rope=True,
                   outlier_frac=0.05),
    value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=32),
    sinks=3, residual=16, block=32,
)  # fmt: skip
FLOAT_VALUES = KVScheme(  # a float side flushes too
    "test-float-values",
    key=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"),
    value=TensorSpec(kind="float", bits=32, fmt="fp32"),  # float32 K/V: quantize may return x itself
    residual=8, block=8,
)  # fmt: skip
SCHEMES = [s for s in list_schemes() if not s.needs_calibration()] + [HEAD_BLOCKS, PRE_ROPE_SINKS, FLOAT_VALUES]


def _run(scheme: KVScheme, slice_tokens: int, patch: pytest.MonkeyPatch, T: int = 333, steps: int = 40):
    """A 1-layer cache fed a ``T``-token prefill (two sequences) and ``steps`` single tokens: every step's
    returned K/V, the stored chunks at the end, the bytes, and the quantize and decode calls made."""
    with patch.context() as monkeypatch:
        return _run_patched(scheme, slice_tokens, monkeypatch, T, steps)


def _run_patched(scheme: KVScheme, slice_tokens: int, monkeypatch: pytest.MonkeyPatch, T: int, steps: int):
    monkeypatch.setattr(store_mod, "SLICE_TOKENS", slice_tokens)
    calls = {"quantize": 0, "decode": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(store_mod, "quantize_pack", counted("quantize", store_mod.quantize_pack))
    monkeypatch.setattr(store_mod, "_stack_blocks", counted("decode", store_mod._stack_blocks))
    monkeypatch.setattr(store_mod.SideStore, "_dequantize", counted("decode", store_mod.SideStore._dequantize))
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, T + steps, 64, generator=g) * 2 + torch.randn(1, 2, 1, 64, generator=g)
    v = torch.randn(2, 2, T + steps, 64, generator=g)
    cache = QuantizedKVCache(config=CFG, scheme=scheme)
    outs = [cache.update(k[:, :, :T], v[:, :, :T], 0)]
    for t in range(T, T + steps):
        outs.append(cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0))
    layer = cache.layers[0]
    stored = [[t.clone() for c in s.chunks for t in c.stored_tensors()] for s in (layer._k, layer._v)]
    return outs, stored, cache.memory_report()["total_bytes"], calls


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_slices_give_the_same_bits(scheme: KVScheme, monkeypatch):
    """Slices of 16 tokens (whole blocks and scale groups) against one call: every step's K/V, the stored
    codes and metadata, and the bytes are equal bit for bit, sinks, pre-RoPE keys and per-block chunks
    included."""
    one_call = _run(scheme, 10**9, monkeypatch)
    sliced = _run(scheme, 16, monkeypatch)
    for (ka, va), (kb, vb) in zip(one_call[0], sliced[0], strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    for a, b in zip(one_call[1], sliced[1], strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert one_call[2] == sliced[2]
    if scheme.key.kind != "float":  # the history really was decoded in slices
        assert sliced[3]["decode"] > one_call[3]["decode"]
    if scheme.key.kind != "float" and store_mod.mergeable(scheme.key):  # and the prefill's flush quantized so
        assert sliced[3]["quantize"] > one_call[3]["quantize"]  # (other specs quantize each block apart anyway)


def _working_set(scheme_name: str, T: int, monkeypatch, dtype=torch.bfloat16) -> tuple[int, int, int, int]:
    """``(prefill peak, decode-step peak, bytes a step returns, bytes the cache holds)`` of one layer."""
    monkeypatch.setattr(store_mod, "SLICE_TOKENS", 256)
    scheme = get_scheme(scheme_name)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, T + 1, 64, generator=g).to(dtype) for _ in range(2))
    cache = QuantizedKVCache(config=CFG, scheme=scheme)
    with LiveBytes() as prefill:
        out = cache.update(k[:, :, :T], v[:, :, :T], 0)
        del out
    with LiveBytes() as step:
        kk, vv = cache.update(k[:, :, T:], v[:, :, T:], 0)
        returned = kk.untyped_storage().nbytes() + vv.untyped_storage().nbytes()
        del kk, vv
    return prefill.peak, step.peak, returned, cache.memory_report()["total_bytes"]


@pytest.mark.parametrize("scheme", ["int4-token", "kivi-2", "int8-channel"])
def test_a_step_works_in_one_slice_beside_what_it_returns(scheme: str, monkeypatch):
    """bfloat16 K/V, 4K tokens, slices of 256: a decode step allocates the K/V it returns (the whole history,
    in bfloat16) and at most 30 % more, plus a copy of the codes when it flushes (the chunk grows by a
    concatenation); the prefill as much (the full-precision copy of the tokens is freed before the K/V it
    returns are decoded). Decoding and quantizing a side in one call (the code before slicing) allocated
    its float32 copies beside them: 2.3-2.6x the returned bytes for a step, 3.4-5.8x for the prefill."""
    T = 4096 + 128  # kivi: 128 tokens left in the residual window; the others flush every token
    prefill, step, returned, held = _working_set(scheme, T, monkeypatch)
    assert returned == 2 * T * 2 * 64 * 2 + 2 * 2 * 64 * 2  # (T + 1) tokens, both sides, bfloat16
    print(scheme, step / returned, prefill / returned, held / returned)
    assert returned < step < 1.3 * returned + held, (step / returned)  # a flushing step copies the codes once
    assert prefill < 1.3 * returned + held, (prefill / returned)  # the buffer's copy is freed before it returns
