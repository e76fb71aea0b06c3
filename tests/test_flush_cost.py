"""Per-step cost of a one-token flush (``QuantizedKVCache.update`` of a per-token scheme): the aten ops it runs,
each a kernel launch on a GPU. Pinned as an upper bound on the op count (not a timing), with the stored codes,
scales and returned K/V checked bit for bit against a reference computed once."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbits.cache import QuantizedKVCache
from kvbits.quant import quantize
from kvbits.quant.pack import pack_bits, unpack_bits
from kvbits.schemes import get_scheme
from kvbits.schemes.spec import KVScheme, TensorSpec

transformers = pytest.importorskip("transformers")


# the benchmark that records these counts (BENCHMARKS.md §6 "Session 62"): its counter, config and caches pinned here
_spec = importlib.util.spec_from_file_location("update_ops", Path(__file__).parents[1] / "benchmarks" / "update_ops.py")
update_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_ops)
_Count, _config = update_ops.Counter, update_ops.config


def _one_token_update(cache: QuantizedKVCache) -> Any:
    """Layer 0 of ``cache`` after 4 untimed one-token updates: the ``update_ops.Counter`` of one more."""
    k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    for _ in range(4):
        cache.update(k, v, 0)
    with _Count() as c:
        cache.update(k, v, 0)
    return c


def test_int8_token_one_token_flush_op_count():
    """int8-token, one token per side: ``quantize`` took 53 aten ops and a whole decode ``update`` (both sides'
    flushes, the eager check, the returned K/V) 159 at e45df0d; fewer now (a shared ``s > 0`` mask, one ``aminmax``
    for the range, the zero-point's float32 copy made once). 153 at 8e23df1, 104 since K and V share one
    ``quantize`` call (``kvbits.cache.store.flush_pair``)."""
    x = torch.randn(1, 2, 1, 64)
    spec = get_scheme("int8-token").key
    quantize(x, spec, validate=False, sync=False)
    with _Count() as c:
        quantize(x, spec, validate=False, sync=False)
    assert c.ops <= 50, f"{c.ops} aten ops to quantize one int8 token"
    c = _one_token_update(QuantizedKVCache(_config(), "int8-token", checks="eager"))
    assert c.ops <= 104, f"{c.ops} aten ops per one-token int8-token update"


@pytest.mark.parametrize("bits", [2, 4])
def test_bytewise_pack_matches_word_layout(bits):
    """``pack_bits`` of 2- and 4-bit codes (uint8 shifts) gives the bytes of the 32-bit word layout: code ``i`` at
    bits ``[b*i, b*(i+1))`` little-endian, the last word zero-padded."""
    torch.manual_seed(0)
    for n in (1, 3, 5, 8, 13, 64):
        codes = torch.randint(0, 1 << bits, (2, 3, n), dtype=torch.int64)
        word = sum(int(c) << (bits * i) for i, c in enumerate(codes[1, 2].tolist()))
        want = [(word >> (8 * j)) & 0xFF for j in range((n * bits + 7) // 8)]
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.is_contiguous()
        assert packed[1, 2].tolist() == want
        assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.uint8))


# sha256 (first 16 hex) of every stored code / scale / zero-point and the returned K/V over a prefill of 200 tokens and
# 40 decode steps (seeded), taken at e45df0d: the op savings must not move a bit (elementwise ops and min / max only,
# exact in IEEE arithmetic whatever the CPU)
DIGESTS = {
    "int8-token": "fc327beb03182e76",
    "int4-token": "ffb7f89e1274fdf2",
    "int2-token": "d47d1b2717bfca00",
    "kivi-2": "33fdadda503a97a3",
    "kivi-4": "57bc22493cbf3931",
}  # no pre-RoPE scheme: its cos/sin tables may differ in the last bit between CPUs' vector math libraries


def _digest(scheme: str) -> str:
    torch.manual_seed(0)
    cache = QuantizedKVCache(_config(), scheme, checks="eager")
    h = hashlib.sha256()
    for t in range(41):
        q = 200 if t == 0 else 1
        # integer draws scaled by a power of two: the same floats on every CPU (randn's vector path may not be)
        k = torch.randint(-3 * 2**12, 3 * 2**12, (2, 2, q, 64)) / 2**12
        v = torch.randint(-(2**12), 2**12, (2, 2, q, 64)) / 2**12
        keys, values = cache.update(k, v, 0)
        h.update(keys.numpy().tobytes())
        h.update(values.numpy().tobytes())
    layer = cache.layers[0]
    for store in (layer._k, layer._v):
        for chunk in store.chunks:
            for t in chunk.stored_tensors():
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("scheme", sorted(DIGESTS))
def test_flush_results_bit_identical(scheme):
    assert _digest(scheme) == DIGESTS[scheme]


def _run_pair(scheme: str | KVScheme, monkeypatch, joint: bool, **kw) -> tuple[list, list, dict]:
    """Stored tensors, returned K/V, observer calls and the memory report of a seeded run, K and V quantized in one
    call (``joint``) or each apart."""
    import kvbits.cache.store as store_mod

    with monkeypatch.context() as m:
        if not joint:
            m.setattr(store_mod, "joint_flush", lambda *a: False)
        torch.manual_seed(0)
        cache = QuantizedKVCache(_config(), scheme, checks="eager", **kw)
        seen = []
        cache.layers[0].observe_flushes(lambda layer, side, x, qt: seen.append((side, x.clone(), qt.dequantize())))
        out = []
        for t in range(12):
            q = 20 if t == 0 else 1
            out += cache.update(torch.randn(2, 2, q, 64), torch.randn(2, 2, q, 64) * 3, 0)
        layer = cache.layers[0]
        stored = [t.clone() for s in (layer._k, layer._v) for c in s.chunks for t in c.stored_tensors()]
        return stored + out, seen, cache.memory_report() | {"clipped": layer.clipped()}


# per-channel groups of 4 tokens on both sides: joint too (each group reduces within one batch row)
CHANNEL = KVScheme("test-channel-both", key=TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=4),
                   value=TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=4), residual=4, block=4)  # fmt: skip


@pytest.mark.parametrize("scheme", ["int4-token", CHANNEL])
@pytest.mark.parametrize("kw", [{}, {"max_cache_len": 64}, {"workspace": True}])
def test_joint_flush_matches_separate(monkeypatch, kw, scheme):
    """K and V quantized in one call (``flush_pair``) give what two calls give bit for bit: codes, scales, returned
    K/V, the observer's per-side ``x`` / ``qt``, clip counts and the memory report (real bytes)."""
    import kvbits.cache.store as store_mod

    calls = []
    real = store_mod.quantize_pack
    monkeypatch.setattr(store_mod, "quantize_pack", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    a, seen_a, rep_a = _run_pair(scheme, monkeypatch, True, **kw)
    n_joint = len(calls)
    b, seen_b, rep_b = _run_pair(scheme, monkeypatch, False, **kw)
    assert n_joint * 2 == len(calls) - n_joint  # one call per flush instead of two
    assert set(calls[:n_joint]) == {4}  # K and V of the batch of 2, stacked
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert [s for s, *_ in seen_a] == [s for s, *_ in seen_b] and len(seen_a) == 2 * n_joint
    assert all(torch.equal(x, y) and torch.equal(p, q) for (_, x, p), (_, y, q) in zip(seen_a, seen_b))
    assert rep_a == rep_b


def test_joint_flush_scope_and_clip_fallback(monkeypatch):
    """Specs that differ per side (kivi-2) or lazy checks (device clip counts) flush each side apart; a joint clip
    count above 0 (which side clipped is unknown) re-quantizes each side apart, so the per-side counts stay exact."""
    import kvbits.cache.store as store_mod

    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    for scheme, checks in (("kivi-2", "eager"), ("int8-token", "lazy")):
        layer = QuantizedKVCache(_config(), scheme, checks=checks).layers[0]
        layer.update(k, v)
        assert not store_mod.joint_flush(layer._k, layer._v, 1)
    empty = QuantizedKVCache(_config(), "int8-token", checks="eager").layers[0]  # a batch of 0: split had one part
    assert [t.shape for t in empty.update(k[:0], v[:0])] == [torch.Size([0, 2, 40, 64])] * 2
    real = store_mod.quantize_pack

    def clipping(x, spec, **kw):  # pretend the joint call clipped once
        qt = real(x, spec, **kw)
        qt.clipped = 1 if x.shape[0] == 2 else qt.clipped
        return qt

    monkeypatch.setattr(store_mod, "quantize_pack", clipping)
    layer = QuantizedKVCache(_config(), "int8-token", checks="eager").layers[0]
    keys, values = layer.update(k, v)
    ref = QuantizedKVCache(_config(), "int8-token", checks="eager").layers[0]
    monkeypatch.setattr(store_mod, "quantize_pack", real)
    rk, rv = ref.update(k, v)
    assert torch.equal(keys, rk) and torch.equal(values, rv) and layer.clipped() == (0, 0)
    assert layer._k.n_quantized == layer._v.n_quantized == 40


def _kvquant4_cache() -> QuantizedKVCache:
    """An eager ``kvquant-4`` cache of the tiny config, calibrated on random K/V (pre-RoPE keys as sampled)."""
    torch.manual_seed(0)
    return update_ops.make_cache("kvquant-4")


@torch.no_grad()
def test_kvquant4_one_token_update_syncs():
    """Eager ``kvquant-4``, one token per side: an ``update`` read the device back 19 times at 9f27485 (the layer's
    fixed codebook re-validated at every flush and every dequantization, 4 reads each, K and V; the asymmetric NUQ
    span check the eager input bound already covers; a dynamic range's clip count, known to be 0), in 325 aten ops.
    Now once: the static keys' clip count (a host int with eager checks), in 253 ops."""
    cache = _kvquant4_cache()
    cache.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), 0)
    c = _one_token_update(cache)
    assert c.syncs <= 1, f"{c.syncs} host reads per one-token kvquant-4 update"
    assert c.ops <= 260, f"{c.ops} aten ops per one-token kvquant-4 update"
    assert isinstance(cache.layers[0]._k.clipped, int) and isinstance(cache.layers[0]._v.clipped, int)


@torch.no_grad()
def test_kvquant4_eager_errors_at_the_step():
    """The checks the flush no longer repeats are the eager input check's: a value past asymmetric NUQ's bound
    (65504 / 2) or a NaN is still refused at its step, with the input check's message, and nothing is stored."""
    cache = _kvquant4_cache()
    cache.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), 0)
    for bad, said in ((40000.0, "beyond 32752"), (float("nan"), "1 NaN")):
        v = torch.randn(1, 2, 1, 64)
        v[0, 1, 0, 3] = bad
        with pytest.raises(ValueError, match=f"layer 0 value_states .*{said}"):
            cache.update(torch.randn(1, 2, 1, 64), v, 0)
    assert cache.layers[0].tokens_seen == 200
