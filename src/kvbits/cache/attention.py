"""The ``kvbits_fused`` transformers attention function: fused decode steps over `QuantizedKVCache`.

Usage::

    from kvbits.cache import QuantizedKVCache, use_fused_decode

    use_fused_decode(model)              # model.set_attn_implementation("kvbits_fused")
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")   # fused_decode="auto"
    model.generate(**inputs, cache=cache)   # past_key_values=cache before transformers 5.24

``kvbits_fused`` is transformers' SDPA attention (same mask function, same call) except for decode steps
(one query token per sequence) of layers a ``QuantizedKVCache`` has handed over (``kvbits.cache.fused``):
those call ``kvbits.kernels.decode_attention`` on the layer's packed store, never materialising
dequantized K/V. A boolean padding mask at a decode step (a left-padded batch) becomes per-slot masks of
the store (``fused.slot_masks``): the kernel skips the masked slots. Everything else — prefill,
``q_len > 1``, other caches, schemes outside the packed layout (float sides, sliding windows), float or
per-head masks, ``softcap`` / ``s_aux`` / ``output_attentions`` — is SDPA over dequantized K/V, as before.

Registered under a new name through transformers' public ``AttentionInterface`` (and the SDPA mask
builder under the same name in ``AttentionMaskInterface``); nothing of transformers is replaced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvbits._model import check_model
from kvbits.cache import fused
from kvbits.cache.eager import run_eagerly
from kvbits.kernels import dispatch
from kvbits.kernels.reference import PackedStore

logger = logging.getLogger(__name__)

__all__ = [
    "IMPLEMENTATION",
    "DecodeObserver",
    "UnsupportedAttention",
    "fused_attention",
    "observe_fused_decode",
    "register_fused_attention",
    "use_fused_decode",
]

IMPLEMENTATION = "kvbits_fused"

DecodeObserver = Callable[[int, torch.Tensor, PackedStore, "float | None"], None]
"""``observer(layer_idx, query (B, H_q, 1, D), store, scaling)``: a fused step's kernel inputs (see
:func:`observe_fused_decode`)."""

_OBSERVERS: list[DecodeObserver] = []


class UnsupportedAttention(ValueError):
    """The model's attention does not dispatch through transformers' ``AttentionInterface`` (e.g. Falcon before
    transformers 5.25), so ``kvbits_fused`` can not serve its decode steps."""


def _sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping["sdpa"](*args, **kwargs)


def _step_reason(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Any,
                 dropout: float, kwargs: dict) -> str | None:  # fmt: skip
    """Why this call cannot be a fused decode step (``None``: it can)."""
    if query.shape[2] != 1:
        return f"{query.shape[2]} query tokens"
    if attention_mask is not None:
        B, T = key.shape[0], key.shape[2]
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            return f"a non-boolean attention mask ({getattr(attention_mask, 'dtype', type(attention_mask).__name__)})"
        if (
            attention_mask.dim() != 4
            or tuple(attention_mask.shape[1:]) != (1, 1, T)
            or attention_mask.shape[0] not in (1, B)
        ):
            return f"an attention mask of shape {tuple(attention_mask.shape)} (expected ({B}, 1, 1, {T}))"
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            return f"{name}"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if dropout and module.training:
        return "attention dropout in training mode"
    return None


@run_eagerly
def fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``kvbits_fused`` attention function (transformers' attention-interface signature).

    ``query`` ``(B, H_q, q, D)`` post-RoPE; ``key`` / ``value`` ``(B, H_kv, T, D)`` as the cache's
    ``update`` returned them (placeholders on claimed decode steps). Returns ``((B, q, H_q, D), None)``
    like ``sdpa_attention_forward``. Runs eagerly under ``torch.compile``, as ``QuantizedKVCache.update``
    does (the fused step's store and launch depend on the layer's host state).
    """
    tagged = fused.tag_of(key)
    if tagged is None:  # not from a QuantizedKVLayer: plain SDPA
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer, placeholder = tagged
    if not placeholder:  # real K/V (prefill, unclaimed layer): SDPA, and claim the layer for decode steps
        fused.claim(layer, query, module)
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    reason = _step_reason(module, query, key, attention_mask, dropout, kwargs)
    if reason is None:
        keep = None
        if attention_mask is not None:  # (B, 1, 1, T) bool, True = attend: left padding
            keep = attention_mask[:, 0, 0, :].expand(key.shape[0], -1)
        # a StaticQuantizedLayer's slabs (kvbits.cache.static) come as they are, sized for its max_cache_len
        store = layer.fused_store(keep) if hasattr(layer, "fused_store") else fused.packed_store(layer, keep)
        for observe in _OBSERVERS:
            observe(layer.layer_idx, query, store, scaling)
        out = dispatch.decode_attention(query, store, scaling)  # (B, H_q, 1, D)
        layer.fused.steps += 1
        return out.transpose(1, 2).contiguous(), None
    # a claimed layer whose step cannot be fused: attend over exactly what update() would have returned
    if layer.fused.fallbacks == 0:
        logger.info("layer %d: decode step attends over dequantized K/V: %s", layer.layer_idx, reason)
    layer.fused.fallbacks += 1
    keys, values = layer.materialize(check=False, view=True)  # per step: the lazy K/V check stays periodic (no sync)
    return _sdpa(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_fused_attention() -> str:
    """Register ``kvbits_fused`` with transformers (idempotent; a new name, nothing replaced); returns it.

    After this, ``from_pretrained(..., attn_implementation="kvbits_fused")`` also works.
    """
    from transformers import AttentionInterface

    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, fused_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - older transformers without a mask table
        return IMPLEMENTATION
    if IMPLEMENTATION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(IMPLEMENTATION, AttentionMaskInterface._global_mapping["sdpa"])
    return IMPLEMENTATION


def use_fused_decode(model: Any) -> str:
    """Route ``model``'s attention through ``kvbits_fused``; returns the previous implementation.

    ``model.set_attn_implementation(previous)`` undoes it. With it, ``QuantizedKVCache`` decode steps
    run the fused kernel on CUDA (``fused_decode="auto"``, the default) or, on request
    (``fused_decode=True``), the torch reference elsewhere; other caches and steps are unchanged SDPA.
    Also ``track_positions(model)`` (``kvbits.cache.positions``), so pre-RoPE keys of a left-padded batch
    are un-rotated at the model's positions on transformers that do not pass them to the cache.

    Raises:
        UnsupportedAttention: the model's attention does not dispatch through transformers'
            ``AttentionInterface`` (transformers then keeps its implementation): its decode steps would
            attend over dequantized K/V whatever the cache's ``fused_decode`` says.
    """
    check_model(model, "use_fused_decode", attention=True)
    from kvbits.cache.positions import track_positions

    register_fused_attention()
    previous = model.config._attn_implementation
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise TypeError(f"{type(model).__name__} has no set_attn_implementation(): not a transformers model?")
    setter(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:  # transformers logged and kept the previous one
        import transformers

        raise UnsupportedAttention(
            f"{type(model).__name__} did not accept attn_implementation={IMPLEMENTATION!r}: its attention "
            "does not dispatch through transformers' AttentionInterface (transformers "
            f"{transformers.__version__}), so kvbits can not fuse its decode steps; they attend over "
            "dequantized K/V (fused_decode=False, `--fused-decode off`)"
        )
    track_positions(model)
    return previous


@contextlib.contextmanager
def observe_fused_decode(model: Any, observer: DecodeObserver) -> Iterator[None]:
    """Fused decode through ``model`` inside the block, each fused step's kernel inputs shown to ``observer`` first.

    ``observer(layer_idx, query, store, scaling)`` gets the layer's index, the post-RoPE query
    ``(B, H_q, 1, D)``, the layer's :class:`~kvbits.kernels.reference.PackedStore` and the attention scaling,
    before ``kvbits.kernels.decode_attention`` attends over that store; it must not modify them. For
    diagnostics on a real model's own caches: hold a kernel against a float64 reference at every layer
    (``benchmarks/fold_real_kv.py``). On exit the observer is removed and the model's previous attention
    implementation restored, also when the block raises.
    """
    previous = use_fused_decode(model)
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)
        model.set_attn_implementation(previous)
