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
per-head masks, ``output_attentions`` — is SDPA over dequantized K/V, as before. Models whose attention SDPA
can not compute (``_supports_sdpa = False``: attention sinks; attention modules with an
``attn_logit_softcapping``: Gemma 2, whose 5.17 said it supports SDPA) are refused by ``use_fused_decode``, and a
call passing sinks (``s_aux``, Inkling 2's ``sinks``) or a softcap raises: SDPA would drop them without a word (5.17) or fail.

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


# attention keyword arguments a fused decode step may receive: they change nothing the kernel computes (the
# positions are the cache's; a sliding window arrives in the boolean mask too)
STEP_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "sliding_window", "is_causal", "past_key_values", "cache", "layer_idx",
})  # fmt: skip
# what transformers' SDPA drops without a word, by the models that pass it
SDPA_DROPS = {
    "s_aux": "attention sinks",
    "sinks": "per-token attention sinks, Inkling 2",  # gpt-oss's are s_aux; SDPA's **kwargs took these too
    "softcap": "attention logit softcapping, Gemma 2",  # transformers 5.25's SDPA raises on it, 5.17's dropped it
    "indices": "sparse attention's top-k indices, DeepSeek-V3.2",
    "block_indices": "sparse attention's block indices",
}


class UnsupportedAttention(ValueError):
    """The model's attention does not dispatch through transformers' ``AttentionInterface`` (e.g. Falcon before
    transformers 5.25), or computes what SDPA does not (``_supports_sdpa = False``: gpt-oss's sinks, Gemma 2's
    softcapping), so ``kvbits_fused`` can not serve its decode steps."""


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
    # anything else the model passes changes what attention computes (T5's position_bias): SDPA takes it, the
    # kernel does not, so the step falls back rather than dropping it
    other = sorted(k for k, v in kwargs.items() if v is not None and k not in STEP_KWARGS)
    if other:
        return f"attention arguments the fused kernel does not take: {', '.join(other)}"
    return None


def _causal_mask(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, kwargs: dict,
                 module: torch.nn.Module) -> Any:  # fmt: skip
    """``attention_mask``, or where it is None for ``q > 1`` queries over ``T > q`` keys of a causal module, the
    bottom-right causal mask ``(1, 1, q, T)`` (bool): torch's ``is_causal`` aligns the triangle top-left, so
    transformers' SDPA, given no mask there, let query ``i`` see keys ``0..i`` only. Models that leave the mask
    out under another implementation name than "sdpa" (Gemma 4's KV-shared layers with ``logits_to_keep > 1``:
    logits 0.17 off) get the mask their queries need."""
    q, T = query.shape[2], key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is not None or q <= 1 or T <= q or not causal:
        return attention_mask
    return torch.ones(q, T, dtype=torch.bool, device=query.device).tril(T - q)[None, None]


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
    dropped = [k for k in SDPA_DROPS if kwargs.get(k) is not None]
    if dropped:  # transformers' SDPA would drop them without a word
        raise NotImplementedError(
            f"{type(module).__name__} passes {', '.join(dropped)} ({SDPA_DROPS[dropped[0]]}), which kvbits_fused "
            "(SDPA and the fused kernel) does not compute; use the model's own attention implementation"
        )
    attention_mask = _causal_mask(query, key, attention_mask, kwargs, module)
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
    # not only decoder-only LMs: a cache serves the self-attention it is handed, e.g. T5's decoder through an
    # EncoderDecoderCache(QuantizedKVCache, DynamicCache); kvbits' measurements are what refuse such models
    check_model(model, "use_fused_decode", attention=True, causal=False)
    from kvbits.cache.positions import track_positions

    softcaps = {getattr(m, "attn_logit_softcapping", None) for m in model.modules()} - {None}
    if softcaps:  # Gemma 2 on 5.25 says _supports_sdpa = False; on 5.17 it did not, and SDPA dropped the softcap
        raise UnsupportedAttention(
            f"{type(model).__name__}'s attention caps its logits (attn_logit_softcapping={min(softcaps)}), which "
            "neither SDPA nor the fused kernel computes, and kvbits_fused attends through SDPA outside fused steps: "
            "its decode steps attend over dequantized K/V through the model's own attention (fused_decode=False, "
            "`--fused-decode off`)"
        )
    if getattr(model, "_supports_sdpa", True) is False:
        import transformers

        raise UnsupportedAttention(
            f"{type(model).__name__} does not support SDPA (transformers {transformers.__version__}: its attention "
            "computes what SDPA does not, e.g. gpt-oss's attention sinks or Gemma 2's logit softcapping), and "
            "kvbits_fused attends through SDPA outside fused steps: its decode steps attend over dequantized K/V "
            "through the model's own attention (fused_decode=False, `--fused-decode off`)"
        )

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
