"""The dynamic cache against an independent model of its scheme: which tokens stay in full precision (sinks, the
last residual window), which are quantized in whole blocks, and the bytes held, across appends and batch ops."""

from __future__ import annotations

import torch

from kvbits.cache import QuantizedKVCache
from kvbits.schemes.spec import KVScheme, TensorSpec

INT4 = TensorSpec(kind="int", bits=4, fmt=None, granularity="token")


def test_held_layer_split_counts_sinks_filled_after_the_hold():
    """A layer held before its sinks are complete still fills them (``update`` does), and ``expected_split`` says so:
    it counted those tokens as buffer (sink 2, full 1 where the layer holds 3 sinks)."""
    cache = QuantizedKVCache(scheme=KVScheme("s4", key=INT4, value=INT4, sinks=4, residual=2, block=2), num_layers=1)
    layer = cache.layers[0]
    cache.update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), 0)
    assert layer.hold_full_precision()
    for _ in range(5):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    rep = layer.report()
    split = layer.expected_split()
    assert (rep["sink_tokens"], rep["quantized_tokens"], rep["full_tokens"]) == (4, 0, 3)
    assert (split.sink, split.quantized, split.full) == (4, 0, 3)
