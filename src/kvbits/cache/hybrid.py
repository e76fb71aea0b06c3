"""`QuantizedHybridLayer`: one decoder layer that attends and also keeps a state-space / linear-attention state.

Zamba, Zamba2 and Falcon-H1 give such layers the config type ``"hybrid"``; transformers holds them in
``LinearAttentionAndFullAttentionLayer`` (a ``DynamicLayer`` and a ``LinearAttentionLayer`` in one object). Here the
attention part is a ``QuantizedKVLayer`` (K/V quantized as the scheme says, the bytes ``kvbits.plan`` counts) and the
convolution / recurrent states live in transformers' own ``LinearAttentionLayer`` (``self.linear``), unquantized, in
the model's dtype, as ``DynamicCache(config=...)`` keeps them. The two share no attribute: the layer answers
transformers' linear-attention calls (``Cache.update_conv_state``, ``get_conv_state``, ``increase_count``,
``is_recording_past``, ...) from ``self.linear`` and its ``update`` from the quantized K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import cache_utils

from kvbits.cache.layer import QuantizedKVLayer

__all__ = [
    "HYBRID_TYPES", "LinearStateAPI", "QuantizedHybridLayer", "hybrid_layer_class", "map_state_batch",
    "repeat_state_batch", "select_state_batch",
]

# config layer types of a layer that attends (full attention) and keeps a linear state
HYBRID_TYPES = ("hybrid",)

_Mixin: Any = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)


def hybrid_layer_class() -> type | None:
    """``QuantizedHybridLayer``, or ``None`` for a transformers without ``LinearAttentionLayer`` (before 5.17)."""
    return QuantizedHybridLayer if _Mixin is not None and hasattr(cache_utils, "LinearAttentionLayer") else None


def map_state_batch(linear: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply ``fn`` (a batch-dim map: ``repeat_interleave`` / index select, ``(B, ...)`` -> ``(B', ...)``) to every
    conv / recurrent state a ``LinearAttentionLayer`` holds (and the recurrent states it records for ``crop``), so
    ``batch_repeat_interleave`` / ``batch_select_indices`` keep them aligned with the K/V rows; transformers'
    ``LinearAttentionLayer`` has neither method (``AttributeError``). States not yet made stay ``None``."""
    for states in (linear.conv_states, linear.recurrent_states):
        for i, t in states.items():
            if isinstance(t, torch.Tensor):
                states[i] = fn(t)
    history = getattr(linear, "recurrent_states_history", None)
    for i, past in (history or {}).items():
        history[i] = [fn(t) for t in past]


def repeat_state_batch(linear: Any, repeats: int) -> None:
    """``map_state_batch`` of ``batch_repeat_interleave``: each row's states ``repeats`` times."""
    map_state_batch(linear, lambda t: t.repeat_interleave(repeats, dim=0))


def select_state_batch(linear: Any, indices: torch.Tensor) -> None:
    """``map_state_batch`` of ``batch_select_indices``: the rows ``indices`` (a tensor moved to each state's device)."""
    map_state_batch(linear, lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices, ...])


class LinearStateAPI:
    """transformers' linear-attention layer API answered from ``self.linear`` (a ``LinearAttentionLayer``): the
    conv / recurrent states of a layer that also holds K/V (``QuantizedHybridLayer``, and the static cache's
    ``StaticQuantizedHybridLayer``). First among a layer's bases, so these names win over the K/V layer's and
    ``LinearAttentionCacheLayerMixin``'s."""

    linear: Any

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:
        return self.linear.conv_states

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:
        return self.linear.recurrent_states

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return self.linear.has_previous_state

    @property
    def number_of_states(self) -> int:
        return self.linear.number_of_states

    @property
    def recurrent_states_to_keep(self) -> int:
        return getattr(self.linear, "recurrent_states_to_keep", None) or 0

    @property
    def recurrent_states_history(self) -> dict[int, list[torch.Tensor]] | None:
        return getattr(self.linear, "recurrent_states_history", None)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self.linear.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Any, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self.linear.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def increase_count(self, state_idx: int) -> None:
        self.linear.increase_count(state_idx)


class QuantizedHybridLayer(LinearStateAPI, QuantizedKVLayer, *(() if _Mixin is None else (_Mixin,))):  # type: ignore[misc]
    """Quantized K/V of a full-attention layer plus its linear state (``self.linear``: a ``LinearAttentionLayer``).

    Args:
        scheme, **kwargs: as ``QuantizedKVLayer`` (full attention only: no ``sliding_window``).
        number_of_states: conv / recurrent states the layer keeps (``LinearAttentionLayer``'s).

    An instance of transformers' ``LinearAttentionCacheLayerMixin`` (so ``Cache`` routes conv / recurrent state
    calls to it) and of ``CacheLayerMixin`` (so ``Cache.is_linear`` is False, as for transformers' own hybrid
    layer). ``record_past`` is the linear state's (``Cache.is_recording_past``: whether the model hands its conv
    state to the cache every step); a full-attention ``QuantizedKVLayer`` records nothing itself.
    """

    def __init__(self, scheme: Any, *, number_of_states: int = 1, **kwargs: Any) -> None:
        if kwargs.get("sliding_window") is not None:
            raise ValueError("QuantizedHybridLayer holds full attention only (no sliding_window)")
        self.linear = cache_utils.LinearAttentionLayer(number_of_states=number_of_states)
        QuantizedKVLayer.__init__(self, scheme, **kwargs)

    # the attention part's own record_past (QuantizedKVLayer: a full-precision sliding window) is always False here
    @property
    def record_past(self) -> bool:  # type: ignore[override]
        return self.linear.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        if value:  # QuantizedKVLayer sets it for sliding windows only
            raise ValueError("QuantizedHybridLayer's attention part keeps no past; record_past is the linear state's")

    # ------------------------------------------------------------------ both parts
    def activate_past_recording(self, **kwargs: Any) -> None:
        """The linear state keeps its past for ``crop`` (transformers' ``LinearAttentionLayer``); the quantized
        full-attention part needs nothing (``QuantizedKVLayer.activate_past_recording``: a no-op)."""
        self.linear.activate_past_recording(**kwargs)

    def reset(self) -> None:
        QuantizedKVLayer.reset(self)
        self.linear.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Both parts; ``QuantizedKVCache.crop`` checks the linear state's conditions (a negative count, after
        ``activate_past_recording``) and the K/V's (``tokens_to_crop``) before any layer changes."""
        QuantizedKVLayer.crop(self, tokens_to_remove)
        self.linear.crop(tokens_to_remove)

    def _reorder(self, beam_idx: torch.Tensor) -> None:
        QuantizedKVLayer._reorder(self, beam_idx)
        self.linear.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Both parts (the K/V's alone left the state with the old batch: K/V rows and states misaligned)."""
        QuantizedKVLayer.batch_repeat_interleave(self, repeats)
        repeat_state_batch(self.linear, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Both parts, as ``batch_repeat_interleave``."""
        QuantizedKVLayer.batch_select_indices(self, indices)
        select_state_batch(self.linear, indices)

    def __repr__(self) -> str:
        return "QuantizedHybridLayer(" + QuantizedKVLayer.__repr__(self).split("(", 1)[1]
