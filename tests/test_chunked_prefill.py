"""Pre-RoPE keys through a chunked prefill (``generate(prefill_chunk_size=...)``) of a left-padded batch.

Each row's position offset (``kvbits.cache.layer.position_offset``: cache index minus the model's position, the
row's left padding) is read from the position ids of the request's first update. A first chunk holding nothing but
a row's pads gave that row the pads' offset (left-padded by 9, chunks of 4: 3 instead of 9), so its real keys were
quantized in a frame shifted by 6 positions (attention stays exact, the quantization frame does not). Rows that held
only pads so far now read their offset again at later updates (``reread_offset``), before the chunk that holds their
first real tokens is flushed: the chunked run stores the unchunked run's codes and generates its tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_cache import VOCAB, build

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache, track_positions
from kvbits.cache.compat import cache_kwargs
from kvbits.schemes import KVScheme, TensorSpec

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, PADS, CHUNK, NEW = 20, 9, 4, 4
# pre-RoPE INT8 keys per channel over blocks of 4 (the chunk size: each chunk is flushed as it arrives), INT8 values
INT8_CHANNEL_PREROPE = KVScheme(
    "t-int8-channel-prerope", key=TensorSpec(kind="int", bits=8, fmt=None, granularity="channel", group_size=4,
                                             pre_rope=True),
    value=TensorSpec(kind="int", bits=8, fmt=None, granularity="token"), residual=0, block=4,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "reference")


def tracked_llama() -> torch.nn.Module:
    """A tiny Llama of its own whose calls hand their position ids to the cache (``track_positions``): transformers
    5.17 (the GPU machine's) passes none to ``Cache.update``, 5.24+ does; either way the cache reads them."""
    model = build.__wrapped__("llama")
    track_positions(model)
    return model


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``(2, PROMPT)``: row 0 unpadded, row 1 left-padded by ``PADS`` (more than a chunk)."""
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    ids[1, :PADS] = 0
    return ids, (ids != 0).long()


@torch.no_grad()
def run(model, cache, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` of ``NEW`` tokens: ``(sequences, logits (NEW, B, V))``."""
    ids, mask = padded_batch()
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache, model), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def test_chunked_prefill_reads_a_padded_rows_offset_from_its_first_real_tokens():
    """Before: offsets ``[0, 3]`` after the chunked prefill (``[0, 9]`` unchunked), row 1's real keys quantized 6
    positions off (49 % of their codes the unchunked run's, logits 1.9e-4 away). Now the chunked run's offsets, codes,
    tokens and logits are the unchunked run's (measured: every code, logits 0.0 away)."""
    model = tracked_llama()
    runs = {}
    for chunk in (None, CHUNK):
        cache = QuantizedKVCache(config=model.config, scheme=INT8_CHANNEL_PREROPE)
        runs[chunk] = (cache, *run(model, cache, chunk))
    (whole, want_seq, want), (chunked, seq, got) = runs[None], runs[CHUNK]
    for a, b in zip(whole.layers, chunked.layers):
        assert a._k.pos_offset.tolist() == b._k.pos_offset.tolist() == [0, PADS]
        assert b._k.pad_rows is None  # dropped at the first decode step: nothing read again from there on
        qa, qb = a._k.chunks[0], b._k.chunks[0]
        # row 1's real keys: the same pre-RoPE codes (at base: another frame, most codes differ)
        same = (qa.data[1, :, PADS:PROMPT] == qb.data[1, :, PADS:PROMPT]).float().mean()
        assert same > 0.99, float(same)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@torch.no_grad()
def test_offsets_follow_a_beam_reorder_between_chunks_and_restart_after_reset():
    """``reorder_cache`` between chunks moves each row's offset and its still-all-pads mark with it; the
    memory report counts the mark while it is held; ``reset`` forgets both, and the next request reads its own."""
    model = tracked_llama()
    ids, mask = padded_batch()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # generate's position ids: pads at 0
    cache = QuantizedKVCache(config=model.config, scheme=INT8_CHANNEL_PREROPE)
    kw = cache_kwargs(cache, model)
    model(ids[:, :CHUNK], position_ids=pos[:, :CHUNK], **kw)
    store = cache.layers[0]._k
    assert store.pos_offset.tolist() == [0, CHUNK - 1] and store.pad_rows.tolist() == [False, True]
    assert cache.memory_report()["position_bytes"] == 2 * len(cache.layers) * (8 + 1)
    beam = torch.tensor([1, 0])
    cache.reorder_cache(beam)
    assert store.pos_offset.tolist() == [CHUNK - 1, 0] and store.pad_rows.tolist() == [True, False]
    ids, pos = ids[beam], pos[beam]
    for a in range(CHUNK, PROMPT, CHUNK):
        model(ids[:, a : a + CHUNK], position_ids=pos[:, a : a + CHUNK], **kw)
    assert store.pos_offset.tolist() == [PADS, 0] and store.pad_rows.tolist() == [False, False]
    model(ids[:, -1:], position_ids=pos[:, -1:] + 1, **kw)  # a decode step: the mark is dropped
    assert store.pad_rows is None and store.pos_offset.tolist() == [PADS, 0]
    cache.reset()
    assert store.pos_offset is None and store.pad_rows is None
    model(ids[:1], position_ids=torch.arange(PROMPT)[None], **kw)
    assert cache.layers[0]._k.pos_offset.tolist() == [0] and cache.layers[0]._k.pad_rows.tolist() == [False]


def test_static_cache_chunked_prefill_reads_the_offset_again():
    """``StaticQuantizedKVCache`` (its ``StaticRope.start`` read the first chunk only, alike): the chunked run's
    offsets, tokens and logits are the unchunked run's."""
    model = tracked_llama()
    scheme = KVScheme("t-int8-token-prerope", key=TensorSpec(kind="int", bits=8, fmt=None, granularity="token",
                                                             pre_rope=True),
                      value=TensorSpec(kind="int", bits=8, fmt=None, granularity="token"))  # fmt: skip
    runs = {}
    for chunk in (None, CHUNK):
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=PROMPT + NEW + 4)
        runs[chunk] = (cache, *run(model, cache, chunk))
    (whole, want_seq, want), (chunked, seq, got) = runs[None], runs[CHUNK]
    for a, b in zip(whole.layers, chunked.layers):
        assert a.rope.offset.tolist() == b.rope.offset.tolist() == [0, PADS]
        assert b.rope.pad_rows is None
    chunked.reset()  # a first chunk again, then a beam reorder: the mark moves with the rows
    ids, mask = padded_batch()
    with torch.no_grad():
        model(ids[:, :CHUNK], position_ids=(mask.cumsum(-1) - 1).clamp_min(0)[:, :CHUNK], **cache_kwargs(chunked, model))
    rope = chunked.layers[0].rope
    assert rope.offset.tolist() == [0, CHUNK - 1] and rope.pad_rows.tolist() == [False, True]
    chunked.reorder_cache(torch.tensor([1, 0]))
    assert rope.offset.tolist() == [CHUNK - 1, 0] and rope.pad_rows.tolist() == [True, False]
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_static_cache_reads_the_offset_of_a_first_real_token_alone_in_a_one_token_chunk():
    """A row left-padded by 8 of a 9-token prompt, chunks of 4: its only real token comes alone in the last chunk.
    Before, ``StaticQuantizedKVCache`` took that one-token update for a decode step and kept the pads' offset
    (``[0, 7]``, logits 3.9e-4 from the unchunked run's); now it reads it there (``[0, 8]``, as ``QuantizedKVCache``),
    and a batch without all-pads rows drops ``pad_rows`` at the prefill (its decode steps read nothing again)."""
    model = tracked_llama()
    scheme = KVScheme("t-int8-token-prerope", key=TensorSpec(kind="int", bits=8, fmt=None, granularity="token",
                                                             pre_rope=True),
                      value=TensorSpec(kind="int", bits=8, fmt=None, granularity="token"))  # fmt: skip
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    ids[1, :8] = 0
    mask = (ids != 0).long()
    runs = {}
    for chunk in (None, CHUNK):
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=9 + NEW + 4)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache, model), max_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0, prefill_chunk_size=chunk, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        runs[chunk] = (cache, out.sequences, torch.stack(out.logits))
    (whole, want_seq, want), (chunked, seq, got) = runs[None], runs[CHUNK]
    for a, b in zip(whole.layers, chunked.layers):
        assert a.rope.offset.tolist() == b.rope.offset.tolist() == [0, 8]
        assert b.rope.pad_rows is None
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    chunked.reset()  # an unpadded first chunk: no all-pads row, nothing kept to read again
    with torch.no_grad():
        model(ids[:, CHUNK:2 * CHUNK], position_ids=torch.arange(CHUNK).expand(2, CHUNK), **cache_kwargs(chunked, model))
    assert chunked.layers[0].rope.pad_rows is None
