"""Attention sinks (``KVScheme(sinks=N)``) in a left-padded batch.

Sinks are the first ``N`` cache slots of every row, the same for all rows: a left-padded row's first slots hold its
pads, so at 7bf0aa9 its first real tokens were quantized (a tiny Llama, 2-bit K/V with 4 sinks, a row left-padded by
8: logits 0.20 from the row run alone, 0.095 between that run and fp16) and both caches only warned.
``QuantizedKVCache`` now widens a left-padded request's sinks to ``N`` + the most pads of a row (read once at the
prefill from the position ids: ``Cache.update``'s, or ``track_positions``'s), same slots for every row, so every row's
first ``N`` real tokens stay exact (that row: 1.5e-7 from the row run alone). ``StaticQuantizedKVCache`` (fixed
slabs) still warns, as does the dynamic cache where it cannot tell a row's padding or the pads pass
``MAX_PAD_SINKS``.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_fused_cache import VOCAB, build

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache, track_positions
from kvbits.cache import cache as cache_module
from kvbits.cache.compat import cache_kwargs
from kvbits.plan import plan
from kvbits.schemes import KVScheme, TensorSpec, token_split

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, PADS = 12, 5
SINKS = KVScheme("t-int8-sinks", key=TensorSpec(kind="int", bits=8, fmt=None, granularity="token"),
                 value=TensorSpec(kind="int", bits=8, fmt=None, granularity="token"), sinks=4)  # fmt: skip


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "reference")


def batch(pads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, position_ids)`` ``(2, PROMPT)``: row 0 unpadded, row 1 left-padded by ``pads``."""
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    ids[1, :pads] = 0
    mask = (ids != 0).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "attention sinks" in r.getMessage()]


@torch.no_grad()
def test_left_padded_rows_meeting_sinks_are_warned_about_once_by_the_static_cache(caplog):
    """``StaticQuantizedKVCache`` (fixed slabs: sinks not widened): one WARNING naming the scheme, the sinks and the
    padded rows; an unpadded batch says nothing, and a second padded request to the same cache nothing more."""
    model = build.__wrapped__("llama")
    track_positions(model)  # transformers 5.17 passes no position ids to Cache.update

    def new_cache():
        return StaticQuantizedKVCache(config=model.config, scheme=SINKS, max_cache_len=PROMPT + 4)

    caplog.set_level(logging.WARNING)
    cache = new_cache()
    ids, mask, pos = batch(0)
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model))
    assert warnings_of(caplog) == []
    cache = new_cache()
    ids, mask, pos = batch(PADS)
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model))
    said = warnings_of(caplog)
    assert len(said) == 1 and "'t-int8-sinks'" in said[0] and "first 4 tokens" in said[0] and "1 of the 2 rows" in said[0]
    cache.reset()
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model))
    assert len(warnings_of(caplog)) == 1


TWO_BIT = TensorSpec(kind="int", bits=2, fmt=None, granularity="token")
INT2_SINKS = KVScheme("t-int2-sinks", key=TWO_BIT, value=TWO_BIT, sinks=4, residual=0, block=1)  # every token flushed
_spec = importlib.util.spec_from_file_location("update_ops", Path(__file__).parents[1] / "benchmarks" / "update_ops.py")
update_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_ops)


def padded_pair(prompt: int, pads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, position_ids)`` ``(2, prompt)``: row 0 unpadded, row 1 left-padded by ``pads``."""
    ids = torch.randint(1, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(5))
    ids[1, :pads] = 0
    mask = (ids != 0).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def test_left_padded_row_keeps_its_first_real_tokens_as_sinks(caplog):
    """The measured case: a row left-padded by 8, 2-bit K/V, 4 sinks. Its logits were 0.20 from the row run alone at
    7bf0aa9 (its 4 sink slots held pads); now the request keeps 4 + 8 sink slots per row and the logits are the row's
    alone (float noise). memory_report counts the real bytes (the 12 full-precision slots), the report's split is
    ``expected_split``, the widening is said once (INFO) and ``reset()`` goes back to 4 sinks."""
    model = build.__wrapped__("llama")
    track_positions(model)
    ids, mask, pos = padded_pair(20, 8)
    caplog.set_level(logging.INFO, logger="kvbits.cache.cache")
    cache = QuantizedKVCache(config=model.config, scheme=INT2_SINKS)
    got = model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model)).logits[1, 8:]
    alone_cache = QuantizedKVCache(config=model.config, scheme=INT2_SINKS)
    alone = model(ids[1:, 8:], **cache_kwargs(alone_cache, model)).logits[0]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    assert warnings_of(caplog) == []
    said = [r.getMessage() for r in caplog.records if "widened from 4 to 12" in r.getMessage()]
    assert len(said) == 1 and "1 of the 2 rows" in said[0]
    report = cache.memory_report()
    for layer, rep in zip(cache.layers, report["layers"]):
        assert rep["sink_tokens"] == 12 and layer.sinks == 12
        split = layer.expected_split()
        assert (rep["sink_tokens"], rep["quantized_tokens"], rep["full_tokens"]) == (split.sink, split.quantized, split.full)
        assert layer._k.sinks.shape[2] == layer._v.sinks.shape[2] == 12
    held = sum(t.numel() * t.element_size() for layer in cache.layers for ts in layer.components().values() for t in ts)
    assert report["total_bytes"] == held
    sink_bytes = sum(x.nbytes for layer in cache.layers for x in (layer._k.sinks, layer._v.sinks))
    assert sink_bytes == 2 * 2 * (2 * 12 * 2 * 32) * 4  # layers * (K, V) * (B * slots * H_kv * D) * float32
    cache.reset()
    unpadded, mask, pos = padded_pair(20, 0)
    model(unpadded, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model))
    assert [layer.sinks for layer in cache.layers] == [4, 4]


@torch.no_grad()
def test_unpadded_batch_is_unchanged_bit_for_bit(monkeypatch):
    """An unpadded batch widens nothing: the logits of a cache whose layers cannot widen their sinks, bit for bit."""
    model = build.__wrapped__("llama")
    track_positions(model)
    ids, mask, pos = padded_pair(20, 0)
    cache = QuantizedKVCache(config=model.config, scheme=INT2_SINKS)
    got = model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache, model)).logits
    assert [layer.sinks for layer in cache.layers] == [4, 4]
    monkeypatch.setattr(cache_module.QuantizedKVLayer, "widen_sinks", lambda self, pads: None)
    base = QuantizedKVCache(config=model.config, scheme=INT2_SINKS)
    want = model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(base, model)).logits
    assert torch.equal(got, want)


def _decode_step_count(pads: int) -> tuple[int, int]:
    """Host reads of the prefill (16 tokens, batch 2, row 1 left-padded by ``pads``) and of one decode step of
    layer 0 of the benchmark's eager cache (``update_ops.Counter``)."""
    cache = QuantizedKVCache(update_ops.config(), INT2_SINKS, checks="lazy")
    pos = torch.arange(16).repeat(2, 1)
    pos[1] = (pos[1] - pads).clamp_min(0)
    k, v = torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)
    with update_ops.Counter() as prefill:
        cache.update(k, v, 0, position_ids=pos)
    cache.update(k, v, 1, position_ids=pos)
    one = torch.randn(2, 2, 1, 64)
    for _ in range(3):
        cache.update(one, one, 0)
    with update_ops.Counter() as step:
        cache.update(one, one, 0)
    assert cache.layers[0].sinks == cache.layers[1].sinks == 4 + pads
    return prefill.syncs, step.syncs


@torch.no_grad()
def test_no_host_read_per_decode_step():
    """Widening costs one host read at the prefill of the request's first layer, none per decode step."""
    (prefill_0, step_0), (prefill_5, step_5) = _decode_step_count(0), _decode_step_count(5)
    assert step_5 == step_0 == 0
    assert prefill_5 <= prefill_0 + 1


@torch.no_grad()
def test_unknown_or_too_wide_padding_keeps_the_sinks_and_warns(caplog, monkeypatch):
    """A first chunk holding only a row's pads (its padding unknown) or pads past ``MAX_PAD_SINKS``: the sinks stay
    ``scheme.sinks`` and the WARNING says why, once per cache."""
    caplog.set_level(logging.WARNING)
    k = torch.randn(2, 2, 4, 64)
    cache = QuantizedKVCache(update_ops.config(), INT2_SINKS)
    chunk = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 0]])  # row 1: pads only so far
    cache.update(k, k, 0, position_ids=chunk)
    assert cache.layers[0].sinks == 4
    said = warnings_of(caplog)
    assert len(said) == 1 and "padding is unknown" in said[0]
    monkeypatch.setattr(cache_module, "MAX_PAD_SINKS", 2)
    cache = QuantizedKVCache(update_ops.config(), INT2_SINKS)
    k = torch.randn(2, 2, 5, 64)
    cache.update(k, k, 0, position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]))  # row 1: 3 pads
    assert cache.layers[0].sinks == 4
    said = warnings_of(caplog)
    assert len(said) == 2 and "left-padded by 3, more than the 2" in said[1]


def test_widen_sinks_refuses_after_the_first_token():
    """``widen_sinks`` is for a request's first update only (the store's sinks are already cut)."""
    cache = QuantizedKVCache(update_ops.config(), INT2_SINKS)
    cache.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 0)
    with pytest.raises(ValueError, match="before a request's first token"):
        cache.layers[0].widen_sinks(2)


def _reserved_run(pads: int, total: int = 32, prompt: int = 16, *, reserve: bool = True) -> QuantizedKVCache:
    """A cache reserved for ``total`` tokens (``max_cache_len``; none with ``reserve=False``) filled with them: a
    ``prompt``-token prefill of batch 2, row 1 left-padded by ``pads``, then single-token decode steps
    (``INT2_SINKS``: every token flushed)."""
    gen = torch.Generator().manual_seed(3)
    cache = QuantizedKVCache(update_ops.config(), INT2_SINKS, max_cache_len=total if reserve else None, checks="eager")
    pos = torch.arange(prompt).repeat(2, 1)
    pos[1] = (pos[1] - pads).clamp_min(0)
    for idx in range(2):
        cache.update(torch.randn(2, 2, prompt, 64, generator=gen), torch.randn(2, 2, prompt, 64, generator=gen), idx,
                     position_ids=pos)  # fmt: skip
    for _ in range(total - prompt):
        for idx in range(2):
            cache.update(torch.randn(2, 2, 1, 64, generator=gen), torch.randn(2, 2, 1, 64, generator=gen), idx)
    return cache


@torch.no_grad()
def test_widened_sinks_reserve_only_the_quantized_slots_they_use():
    """With ``max_cache_len`` the quantized slots were reserved for ``scheme.sinks`` (4) even where the request kept
    4 + 5 sinks: at a6a17ad 28 slots per layer and side held for 23 quantized tokens, memory_report 45824 bytes where
    44224 are needed (1600 more: 5 slots of 2 rows, K and V, 2 layers, 40 bytes each). Now the reservation follows the
    request's sinks: at ``max_cache_len`` the report is the held storage and ``plan`` with 4 + 5 sinks, i.e. plan's
    bytes + the 5 extra full-precision sink slots - the 5 quantized slots they replace; ``reset()`` reserves for 4
    sinks again and an unpadded batch is unchanged. The reservation changes no code or scale (the same run without
    one, bit for bit)."""
    cfg, total, pads = update_ops.config(), 32, 5
    cache = _reserved_run(pads, total)
    report = cache.memory_report()
    held = sum(t.numel() * t.element_size() for layer in cache.layers for ts in layer.components().values() for t in ts)
    widened = plan(cfg, context=total, batch=2, scheme=replace(INT2_SINKS, sinks=4 + pads), dtype_bytes=4)
    base = plan(cfg, context=total, batch=2, scheme=INT2_SINKS, dtype_bytes=4)
    per_slot_full = 2 * 2 * 2 * 2 * 64 * 4  # layers * (K, V) * B * H_kv * D * float32
    per_slot_quant = 2 * 2 * 2 * (2 * 64 * 2 // 8 + 2 * 2 * 2)  # layers * (K, V) * B * (H_kv codes + scale, zero)
    assert report["total_bytes"] == held == widened["total_bytes"] == 44224
    assert report["total_bytes"] == base["total_bytes"] + pads * (per_slot_full - per_slot_quant)
    for layer, rep in zip(cache.layers, report["layers"]):
        assert rep["reserved_tokens"] == rep["quantized_tokens"] == token_split(INT2_SINKS, total).quantized - pads
        assert layer.sinks == 4 + pads
    cache.reset()
    assert [layer._k.reserve_tokens for layer in cache.layers] == [token_split(INT2_SINKS, total).quantized] * 2
    unpadded = _reserved_run(0, total)
    assert unpadded.memory_report()["total_bytes"] == base["total_bytes"]
    for la in unpadded.layers:
        assert la._k.reserved_slots == token_split(INT2_SINKS, total).quantized and la.sinks == 4
    for pad in (0, pads):  # reserved or not, the same codes and metadata bit for bit
        for la, lb in zip(_reserved_run(pad, total).layers, _reserved_run(pad, total, reserve=False).layers):
            for sa, sb in ((la._k, lb._k), (la._v, lb._v)):
                for name in ("data", "scale", "zero"):
                    assert torch.equal(getattr(sa.chunks[0], name), getattr(sb.chunks[0], name))
                assert torch.equal(sa.sinks, sb.sinks) and sa.sinks.shape[2] == 4 + pad
