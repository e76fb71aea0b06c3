"""Attention sinks (``KVScheme(sinks=N)``) in a left-padded batch.

Sinks are the first ``N`` cache slots of every row, the same for all rows: a left-padded row's sinks hold its pads
and its first real tokens are quantized (a tiny Llama, 2-bit K/V with 4 sinks, a row left-padded by 8: logits 0.22
from the row run alone, 0.08 between that run and fp16). Per-row sinks would change the store's layout and its
accounting, so the caches say so instead: a WARNING, once per cache, when a request's first update brings
left-padded rows (read from the position ids: ``Cache.update``'s, or ``track_positions``'s) to a scheme with sinks.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_fused_cache import VOCAB, build

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache, track_positions
from kvbits.cache.compat import cache_kwargs
from kvbits.schemes import KVScheme, TensorSpec

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


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_left_padded_rows_meeting_sinks_are_warned_about_once(caplog, static):
    """Before: nothing said. Now: one WARNING naming the scheme, the sinks and the padded rows; an unpadded batch says
    nothing, and a second padded request to the same cache nothing more."""
    model = build.__wrapped__("llama")
    track_positions(model)  # transformers 5.17 passes no position ids to Cache.update

    def new_cache():
        if static:
            return StaticQuantizedKVCache(config=model.config, scheme=SINKS, max_cache_len=PROMPT + 4)
        return QuantizedKVCache(config=model.config, scheme=SINKS)

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
