"""Hand the model's ``position_ids`` to a ``QuantizedKVCache`` or ``StaticQuantizedKVCache`` on transformers (or model
families) that do not pass them.

Pre-RoPE keys are un-rotated at the model's positions. transformers 5.24 passes ``position_ids`` to
``Cache.update`` (``kwargs=...``) for most families (Llama, Qwen, Gemma, Mistral, Phi); 5.17 passes nothing, and
neither do Falcon, GPT-NeoX, StableLM or Persimmon on 5.25, so a left-padded sequence would be un-rotated at
cache indices: still exact attention after re-rotation, but its keys quantized in a frame rotated by the
pad count, which blurs the outlier channels per-channel quantization relies on. ``track_positions(model)``
registers a forward pre-hook on the model that gives the cache of each call the ``position_ids`` the
call received (``generate`` computes them from the attention mask); the cache uses them only where
``Cache.update`` brings none, and forgets them when the call returns.
"""

from __future__ import annotations

from typing import Any

import torch

_ATTR = "_kvbits_position_hooks"


class PositionTracking:
    """The hooks of ``track_positions``; ``remove()`` takes them off the model."""

    def __init__(self, module: torch.nn.Module, handles: list[Any]) -> None:
        self._module = module
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self._module, _ATTR, None) is self:
            delattr(self._module, _ATTR)


def _call_cache(kwargs: dict) -> Any:
    from kvbits.cache.cache import QuantizedKVCache
    from kvbits.cache.static import StaticQuantizedKVCache

    for name in ("past_key_values", "cache"):
        cache = kwargs.get(name)
        if isinstance(cache, (QuantizedKVCache, StaticQuantizedKVCache)):
            return cache
    return None


def _before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = _call_cache(kwargs)
    if cache is not None:
        pos = kwargs.get("position_ids")
        cache.position_ids_hint = pos if isinstance(pos, torch.Tensor) else None


def _after(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _call_cache(kwargs)
    if cache is not None:
        cache.position_ids_hint = None


def track_positions(model: torch.nn.Module) -> PositionTracking:
    """Give each ``QuantizedKVCache`` or ``StaticQuantizedKVCache`` passed to ``model(...)`` (``past_key_values=`` or ``cache=``) the
    call's ``position_ids`` ``(B, q)``. Idempotent: a second call returns the first tracking."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"track_positions expects a torch.nn.Module (a transformers model), got {type(model).__name__}"
        )
    existing = getattr(model, _ATTR, None)
    if isinstance(existing, PositionTracking):
        return existing
    handles = [
        model.register_forward_pre_hook(_before, with_kwargs=True),
        model.register_forward_hook(_after, with_kwargs=True, always_call=True),
    ]
    tracking = PositionTracking(model, handles)
    setattr(model, _ATTR, tracking)
    return tracking
