"""Falcon's new decoder architecture (Falcon-40B/180B): K/V heads repeated by the model, stored once.

transformers' Falcon with ``new_decoder_architecture`` before 5.25 broadcasts its ``num_kv_heads`` K/V
heads to all ``num_attention_heads`` query heads before ``Cache.update`` (heads ``i*g ... i*g + g - 1``
are copies of KV head ``i``). ``QuantizedKVCache`` stores each KV head once, as the planner counts them,
and hands the model the repeated heads back: the same tokens and logits as storing every copy, ``g``
times fewer bytes. From 5.25 Falcon hands over its KV heads as they are (``test_cache``'s
``test_falcon_kv_head_layouts``); the model tests here then hand the cache what older Falcon did
(``as_older_falcon``), so the repeated-heads path is tested whichever transformers is installed.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers
from test_cache import CACHE_KW, VOCAB, falcon_repeats_kv_heads, storage_bytes, tokens, walk_tensors

from kvbits.cache import QuantizedKVCache, QuantizedKVLayer
from kvbits.cache import fused as fused_mod
from kvbits.kernels import dispatch
from kvbits.plan import plan
from kvbits.schemes import get_scheme

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
G = HEADS // KV_HEADS
PROMPT, NEW = 40, 12
SCHEMES = ["int8-token", "kivi-2", "fp16"]


@functools.cache
def falcon() -> torch.nn.Module:
    """A 2-layer random-weight Falcon with the new decoder architecture: 8 query heads share 2 KV heads."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=2, num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS, new_decoder_architecture=True, bias=False, alibi=False, parallel_attn=True,
    )  # fmt: skip
    return transformers.FalconForCausalLM(cfg).eval()


def as_older_falcon(cache: QuantizedKVCache) -> QuantizedKVCache:
    """``cache``, handed K/V as Falcon before transformers 5.25 hands them: each KV head repeated ``G``
    times, in a row. Where the installed Falcon hands over its ``KV_HEADS`` heads as they are, ``update``
    repeats them before the cache and gives the model one copy of each back (which its attention repeats
    itself); where it repeats them already, ``cache`` is returned as it is."""
    if falcon_repeats_kv_heads():
        return cache
    update = cache.update

    def repeating_update(key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = update(key_states.repeat_interleave(G, dim=1), value_states.repeat_interleave(G, dim=1),
                              layer_idx, *args, **kwargs)  # fmt: skip
        assert keys.shape[1] == values.shape[1] == HEADS  # the cache hands back what it was handed
        return keys[:, ::G], values[:, ::G]

    cache.update = repeating_update
    return cache


def storing_every_copy(scheme: str) -> QuantizedKVCache:
    """A cache that stores every head the model hands it (no config: layers take ``(B, H, *, D)`` from their
    first update), as ``QuantizedKVCache(config=...)`` did for this model before it knew of repeated heads."""
    return as_older_falcon(QuantizedKVCache(num_layers=2, scheme=scheme))


def storing_once(scheme: str) -> QuantizedKVCache:
    """The cache under test: built from the model's config, so it knows the KV heads come repeated."""
    return as_older_falcon(QuantizedKVCache(config=falcon().config, scheme=scheme))


@torch.no_grad()
def generate(model: torch.nn.Module, cache: QuantizedKVCache, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(
        tokens(2, PROMPT), **{CACHE_KW: cache}, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True, **kw,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_repeated_heads_are_stored_once_with_the_same_logits(scheme: str):
    """Each KV head is stored once: the model gets exactly the K/V it got when every copy was stored
    (same tokens, logits equal), in 1/g of the bytes, which are what the planner counts."""
    model = falcon()
    every = storing_every_copy(scheme)
    seq_ref, logits_ref = generate(model, every)
    cache = storing_once(scheme)
    seq, logits = generate(model, cache)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=0, rtol=0)

    rep, rep_every = cache.memory_report(), every.memory_report()
    T = PROMPT + NEW - 1
    planned = plan(model.config, context=T, batch=2, scheme=scheme, dtype_bytes=4)
    assert rep["total_bytes"] == planned["total_bytes"] > 0
    assert rep_every["total_bytes"] == G * rep["total_bytes"]
    assert rep["avg_bits"] == rep_every["avg_bits"]
    assert (cache.num_key_value_heads, cache.head_repeat) == (KV_HEADS, G)
    assert [(r["kv_heads"], r["head_repeat"]) for r in rep["layers"]] == [(KV_HEADS, G)] * 2
    # every byte the cache holds is reported, none pinned through a view of the model's repeated K/V
    assert storage_bytes(walk_tensors(cache)) == rep["total_bytes"] + rep["position_bytes"]
    keys, values = cache.materialize(0)  # what attention sees: the repeated heads
    ref_keys, ref_values = every.materialize(0)
    assert keys.shape == (2, HEADS, T, HEAD_DIM)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


def test_beam_search_reorders_the_stored_heads():
    """Beam search expands and reorders the batch (``batch_repeat_interleave``, ``reorder_cache``): the
    same beams as storing every copy."""
    model = falcon()
    every = storing_every_copy("kivi-2")
    seq_ref, logits_ref = generate(model, every, num_beams=3)
    cache = storing_once("kivi-2")
    seq, logits = generate(model, cache, num_beams=3)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=0, rtol=0)
    assert every.memory_report()["total_bytes"] == G * cache.memory_report()["total_bytes"]


def _layer(**kw) -> QuantizedKVLayer:
    return QuantizedKVLayer(get_scheme("int8-token"), num_key_value_heads=KV_HEADS, head_repeat=G, **kw)


def _repeated(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``(B, G * KV_HEADS, T, D)`` whose heads repeat ``KV_HEADS`` heads ``G`` times each, as Falcon's."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, KV_HEADS, T, HEAD_DIM, generator=g) for _ in range(2))
    return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)


@torch.no_grad()
def test_heads_that_are_not_copies_are_all_stored(caplog):
    """K/V whose head groups differ are not what ``head_repeat`` promises: logged, every head stored, and
    attention sees exactly what a layer without ``head_repeat`` gives it."""
    k, v = _repeated(1, 30, seed=1)
    v = v.clone()
    v[:, 1, 5, 0] += 1e-3  # one value of one copy differs
    plain, layer = QuantizedKVLayer(get_scheme("int8-token")), _layer()
    with caplog.at_level(logging.WARNING, logger="kvbits.cache.layer"):
        got = layer.update(k, v)
    assert "not 4 copies of each of 2 heads" in caplog.text and "storing all 8 heads" in caplog.text
    want = plain.update(k, v)
    assert layer.repeat == 1 and layer._k.buffer.shape[1] == HEADS
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for step in range(3):  # later steps: no new check, every head kept
        k1, v1 = _repeated(1, 1, seed=10 + step)
        assert all(torch.equal(a, b) for a, b in zip(layer.update(k1, v1), plain.update(k1, v1)))
    assert layer.report()["key_bytes"] == plain.report()["key_bytes"]
    assert caplog.text.count("not 4 copies") == 1
    layer.reset()  # a new request is checked anew
    layer.update(*_repeated(1, 30, seed=2))
    assert layer.repeat == G and layer._k.buffer.shape[1] == KV_HEADS


@torch.no_grad()
def test_head_counts_the_layer_accepts():
    """Repeated heads, or the KV heads as they are (a model that does not repeat them); anything else, or
    a change of layout mid-request, is a clear error."""
    layer = _layer()
    k, v = _repeated(1, 5, seed=3)
    plain = layer.update(k[:, ::G], v[:, ::G])  # not repeated: stored and returned as they come
    assert layer.repeat == 1 and plain[0].shape == (1, KV_HEADS, 5, HEAD_DIM)
    with pytest.raises(ValueError, match=r"does not match the cached \(B, H_kv, \*, D\) = \(1, 2, '\*', 32\)"):
        layer.update(k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="num_key_value_heads=2, or each repeated 4 times: 8"):
        _layer().update(k[:, :4], v[:, :4])
    layer = _layer()
    layer.update(k, v)
    with pytest.raises(ValueError, match=r"= \(1, 8, '\*', 32\) \(2 stored heads, each repeated 4 times\)"):
        layer.update(k[:, ::G, :1], v[:, ::G, :1])
    with pytest.raises(ValueError, match="needs num_key_value_heads"):
        QuantizedKVLayer(get_scheme("int8-token"), head_repeat=2)
    with pytest.raises(ValueError, match="head_repeat must be a positive int"):
        QuantizedKVLayer(get_scheme("int8-token"), num_key_value_heads=2, head_repeat=0)


@torch.no_grad()
@pytest.mark.parametrize("copies", [True, False])
def test_early_initialization_checks_at_the_first_tokens(copies: bool):
    """transformers' ``early_initialization`` hands zero-token K/V, which cannot show copies: the first
    update with tokens checks, and stores every head when they are not copies."""
    layer = _layer()
    empty = torch.zeros(1, HEADS, 0, HEAD_DIM)
    layer.lazy_initialization(empty, empty)
    assert layer.is_initialized and layer.repeat == G and layer._k.buffer.shape[1] == KV_HEADS
    k, v = _repeated(1, 20, seed=4)
    if not copies:
        k = k + torch.randn(k.shape, generator=torch.Generator().manual_seed(5))
    keys, _ = layer.update(k, v)
    assert torch.equal(keys, QuantizedKVLayer(get_scheme("int8-token")).update(k, v)[0])
    assert layer._k.buffer.shape[1] == (KV_HEADS if copies else HEADS)


@torch.no_grad()
def test_fused_decode_attends_the_stored_heads():
    """A claimed layer's decode placeholders have the repeated head count the model expects; the kernel
    attends query head ``j`` to stored head ``j // G``, exactly SDPA over the repeated K/V."""
    layer = _layer(fused_decode=True)
    k, v = _repeated(2, 40, seed=6)
    layer.update(k, v)
    query = torch.randn(2, HEADS, 1, HEAD_DIM)
    assert fused_mod.claim(layer, query)
    pk, pv = layer.update(*_repeated(2, 1, seed=7))
    assert pk.is_meta and pk.shape == pv.shape == (2, HEADS, 41, HEAD_DIM)
    store = fused_mod.packed_store(layer)
    assert store.key.codes.shape[1] == KV_HEADS
    keys, values = layer.materialize()
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values)
    torch.testing.assert_close(dispatch.decode_attention(query, store), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_copy_check_reads_the_device_once():
    """Checking that the head groups are copies reads one answer back per layer and request, for K and V
    together (it compared K and V with ``torch.equal`` each: two host syncs per layer on CUDA). Counted
    as the ops that read a tensor back to the host, with lazy checks (nothing else reads back)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {torch.ops.aten.equal.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.is_nonzero.default}  # fmt: skip

    class HostReads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in reads
            return func(*args, **(kwargs or {}))

    k, v = _repeated(1, 30, seed=8)
    layer = _layer(checks="lazy")
    with HostReads() as counted:
        layer.update(k, v)
        layer.update(*_repeated(1, 1, seed=9))  # a decode step: none
    assert layer.repeat == G and counted.n == 1
