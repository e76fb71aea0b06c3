"""A hybrid model's states in `StaticQuantizedKVCache`: conv / linear-attention layers and ``hybrid`` layers.

transformers' ``StaticCache`` holds a ``conv`` or ``linear_attention`` layer (LFM2, Qwen3-Next) in
``LinearAttentionLayer`` (its convolution / recurrent states: fixed shapes, written in place, at addresses a captured
step reads) and a ``hybrid`` layer (Zamba, Zamba2, Falcon-H1: attention plus a Mamba state) in
``LinearAttentionAndStaticFullAttentionLayer``. ``StaticQuantizedKVCache`` holds them alike: the state layers are
transformers' own ``LinearAttentionLayer`` (``state_layer``), unquantized, in the model's dtype, and a hybrid layer
is a ``StaticQuantizedHybridLayer``: the fixed quantized K/V slabs of a ``StaticQuantizedLayer`` plus the state in a
``LinearAttentionLayer`` of its own (``self.linear``), as ``kvbits.cache.hybrid.QuantizedHybridLayer`` keeps it
beside a growing ``QuantizedKVLayer``. The two parts share no attribute (both keep a ``device`` and a ``dtype``).
The states are no K/V: ``memory_report()`` counts them apart (``linear_state_bytes``), as ``QuantizedKVCache``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import cache_utils

from kvbits.cache.hybrid import LinearStateAPI
from kvbits.cache.static import StaticQuantizedLayer

__all__ = ["StaticQuantizedHybridLayer", "reorder_states", "reset_states"]

_Mixin: Any = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)


def reorder_states(linear: Any, beam_idx: torch.Tensor) -> None:
    """Beam search on a ``LinearAttentionLayer``'s states: sequence ``b`` takes sequence ``beam_idx[b]``'s, copied in
    place (transformers' ``reorder_cache`` reassigns them, which a captured step would not see); ``beam_idx`` ``(B,)``
    is checked by the K/V layers first. A layer recording its past (assisted decoding, refused by this cache) keeps
    transformers' own reorder."""
    if getattr(linear, "record_past", False):
        linear.reorder_cache(beam_idx)
        return
    for i in range(linear.number_of_states):
        for states, ready in ((linear.conv_states, linear.is_conv_states_initialized),
                              (linear.recurrent_states, linear.is_recurrent_states_initialized)):  # fmt: skip
            if ready[i]:
                t = states[i]
                t.copy_(t.index_select(0, beam_idx.to(t.device)))


def reset_states(linear: Any, fresh: bool) -> Any:
    """A failed request's states, undone: a new ``LinearAttentionLayer`` when the request was the cache's first
    (``fresh``: a retry may bring another batch, dtype or device, as the K/V slabs are released then), else the same
    one reset in place (zeros, no previous state). Returns the layer to keep."""
    if fresh:
        return cache_utils.LinearAttentionLayer(number_of_states=linear.number_of_states)
    linear.reset()
    return linear


class StaticQuantizedHybridLayer(LinearStateAPI, StaticQuantizedLayer, *(() if _Mixin is None else (_Mixin,))):  # type: ignore[misc]
    """Fixed quantized K/V slabs of a full-attention layer plus its linear state (``self.linear``: a
    ``LinearAttentionLayer``; the static counterpart of ``kvbits.cache.hybrid.QuantizedHybridLayer``).

    Args:
        scheme, max_cache_len, layer_idx, **kwargs: as ``StaticQuantizedLayer``.
        number_of_states: conv / recurrent states the layer keeps (``LinearAttentionLayer``'s).

    An instance of ``LinearAttentionCacheLayerMixin`` (so ``Cache`` routes conv / recurrent state calls to it) and of
    ``CacheLayerMixin`` (``Cache.is_linear`` False, as for transformers' ``LinearAttentionAndStaticFullAttentionLayer``).
    """

    def __init__(self, scheme: Any, max_cache_len: int, layer_idx: int, *, number_of_states: int = 1,
                 **kwargs: Any) -> None:  # fmt: skip
        self.linear = cache_utils.LinearAttentionLayer(number_of_states=number_of_states)
        StaticQuantizedLayer.__init__(self, scheme, max_cache_len, layer_idx, **kwargs)

    # transformers' linear-attention layer API: LinearStateAPI (from self.linear); record_past read-only here
    @property
    def record_past(self) -> bool:
        return self.linear.record_past

    def activate_past_recording(self, **kwargs: Any) -> None:
        """The linear state's (transformers' ``LinearAttentionLayer``); the slabs keep no past (``crop`` refuses)."""
        self.linear.activate_past_recording(**kwargs)

    # ------------------------------------------------------------------ both parts
    def reset(self) -> None:
        StaticQuantizedLayer.reset(self)
        self.linear.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """The K/V (``StaticQuantizedLayer.reorder_cache``, which checks ``beam_idx``), then the state, in place."""
        StaticQuantizedLayer.reorder_cache(self, beam_idx)
        if self.is_initialized:
            reorder_states(self.linear, beam_idx)
