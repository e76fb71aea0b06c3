"""Fused decode attention over a `QuantizedKVLayer`'s packed store: the cache side.

One decode step (``q_len == 1``) of one *claimed* layer:

1. ``QuantizedKVLayer.update`` stores the new token as always (sinks, buffer, flush of whole blocks)
   but does not dequantize the history: it returns zero-byte placeholders (``meta`` tensors shaped
   ``(B, H_kv, T, D)``) tagged with the layer (``tag_of``);
2. the ``kvbits_fused`` attention function (``kvbits.cache.attention``) sees the tag and calls
   ``kvbits.kernels.decode_attention`` on ``packed_store(layer)``: the codes and float16 metadata as the
   layer stores them (views, not copies, for every one-chunk spec) plus sinks and buffer as the
   full-precision tail. Triton kernel on CUDA, torch reference elsewhere (``KVBITS_KERNEL``).

A layer is *claimed* by ``kvbits_fused`` the first time that function receives the layer's ordinary,
dequantized K/V (the prefill, normally): only then can ``update`` be sure its placeholders reach an
attention function that understands them. A cache used with any other attention implementation is
never claimed and behaves exactly as before. The claim needs the cache's ``fused_decode`` mode to want
the device (``wants``: ``True`` anywhere, ``"auto"`` on CUDA with Triton, ``False`` never) and a layer
whose scheme fits the packed layout (``layout_reason``); ``reset()`` releases it, and so does the model
switching to another attention implementation mid-generation (``serving``: its next decode step gets
dequantized K/V again, logged).

Rotated sides (``TensorSpec.rotate``, the ``*-hadamard`` presets): ``packed_store`` hands over the codes as
stored (of ``x @ R``) and the tail as the model's K/V; the decode entry points rotate the query and tail
into the codes' basis and the output back (``kvbits.kernels.reference.code_basis``: ``R`` is orthogonal),
so the history is never dequantized and no byte is added. Post-RoPE keys only: pre-RoPE rotated keys are
declined (``layout_reason``). Centred / smoothed keys (``TensorSpec.centre`` / ``smooth``, the
``*-token-smooth`` presets) likewise: the query is scaled by the factors and the tail moved to
``(k - mean) / factor`` (``code_basis``). Pre-RoPE centred / smoothed keys (``*-token-smooth-prerope``)
cannot move into the query (RoPE mixes channel pairs at each position's angle): the kernel decodes
``code * factor + mean`` in registers before it applies RoPE. Centred / smoothed values are declined.

Pre-RoPE keys: the kernel rotates quantized slot ``t`` of sequence ``b`` to position
``n_sinks + n_dropped + t - pos_offset[b]``, where ``SideStore`` un-rotated it (the model's position:
``pos_offset`` is the left padding read from the position ids; pad slots get negative positions and are
masked; negative positions are clamped at 0 here and in ``SideStore``'s rotations alike). Position ids that start past the cache indices make ``pos_offset`` negative: the tables then
cover ``max(-pos_offset)`` more positions (``SideStore.positions_ahead``, read once per request). A layer
without RoPE (SmolLM3's and Llama 4's NoPE layers: ``rot_dim`` 0) un-rotates nothing: its pre-RoPE keys are
stored as they came and served as post-RoPE keys, without tables.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvbits.kernels import dispatch
from kvbits.kernels.reference import PACKED_KINDS, PackedStore, word_rows
from kvbits.schemes.accounting import rope_table_positions

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.cache.layer import QuantizedKVLayer
    from kvbits.quant.rope import RotaryTables
    from kvbits.schemes.spec import KVScheme

logger = logging.getLogger(__name__)

__all__ = [
    "FusedState",
    "RopeTableCache",
    "check_mode",
    "claim",
    "kernel_reason",
    "layout_reason",
    "packed_store",
    "placeholders",
    "serving",
    "slot_masks",
    "tag",
    "tag_of",
    "wants",
]

TAG = "_kvbits_fused"  # attribute set on the key tensor update() returns: (layer, is_placeholder)
FusedMode = bool | str


def check_mode(mode: Any) -> FusedMode:
    """``True``, ``False`` or ``"auto"``; ``ValueError`` for anything else."""
    if mode is True or mode is False or mode == "auto":
        return mode
    raise ValueError(f"fused_decode must be True, False or 'auto', got {mode!r}")


class RopeTableCache:
    """float32 cos/sin tables ``(P, D)`` for pre-RoPE keys, one pair per rotary module and layer type.

    Shared by the layers of a cache; grown (to 1.25x what is needed, a multiple of 1024 positions:
    ``kvbits.schemes.accounting.rope_table_positions``) when a step needs more positions. Not KV storage:
    not in ``memory_report()`` (see ``nbytes``); ``kvbits.plan(..., fused_decode=True)`` counts them.
    Where the tables repeat their halves (``RotaryTables.halves_equal``: rotate-half RoPE) only the first
    half is kept, ``(P, D / 2)``: the kernel reads channel ``d`` at column ``d mod D / 2``.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def get(
        self, rotary: RotaryTables, n_positions: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables ``(P, D)`` or ``(P, D / 2)`` covering positions ``[0, P)``, ``P >= n_positions``, on ``device``."""
        key = (id(rotary.rotary), rotary.layer_type, rotary.rot_dim, str(device))
        entry = self._tables.get(key)
        if entry is None or entry[0] is not rotary.rotary or entry[1].shape[0] < n_positions:
            P = rope_table_positions(n_positions)  # the planner counts the same rows (plan(fused_decode=True))
            # RotaryTables.cos_sin minus its positions >= 0 check (a host sync; true for an arange)
            cos, sin = rotary._forward(torch.arange(P, device=rotary.device)[None], torch.float32, None)
            cos, sin = cos[0], sin[0]
            if rotary.halves_equal:
                cos, sin = cos[:, : cos.shape[1] // 2], sin[:, : sin.shape[1] // 2]
            entry = (rotary.rotary, cos.to(device).contiguous(), sin.to(device).contiguous())
            self._tables[key] = entry  # keeps the module alive: its id stays unique
        return entry[1], entry[2]

    def clear(self) -> None:
        self._tables.clear()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes + s.nbytes for _, c, s in self._tables.values())


@dataclass
class FusedState:
    """Per-layer fused-decode state.

    Attributes:
        mode: the cache's ``fused_decode`` (``True``, ``False``, ``"auto"``).
        tables: RoPE tables shared by the cache's layers (pre-RoPE keys).
        claimed: decode steps return placeholders for ``kvbits_fused`` (see the module docstring).
        steps: decode steps attended by ``decode_attention`` over the packed store.
        fallbacks: claimed decode steps that attended over dequantized K/V instead (e.g. padding masks).
        declined: why the layer was not claimed, or ``None``.
        claimed_by: ``(weakref to the claiming attention module's config, its _attn_implementation)``, so
            ``update`` notices when the model stops routing attention through ``kvbits_fused`` (``serving``).
    """

    mode: FusedMode = "auto"
    tables: RopeTableCache = field(default_factory=RopeTableCache)
    claimed: bool = False
    steps: int = 0
    fallbacks: int = 0
    declined: str | None = None
    claimed_by: tuple[weakref.ref, str] | None = None


def wants(mode: FusedMode, device: torch.device) -> bool:
    """Whether ``mode`` asks for the fused path on ``device`` (``"auto"``: CUDA with Triton importable)."""
    if mode == "auto":
        return device.type == "cuda" and dispatch.triton_available()
    return bool(mode)


def layout_reason(layer: QuantizedKVLayer) -> str | None:
    """Why ``layer`` cannot be served from the packed layout (``None``: it can)."""
    if layer.is_sliding:
        return "sliding-window layer (the kernel attends to every cached token)"
    if layer.mode == "identity":
        return (
            None if layer._k.buffer.shape[3] == layer._v.buffer.shape[3] else "key and value head dims differ"
        )
    if layer.mode != "quantized":
        return f"layer mode {layer.mode!r}"
    for side, spec in (("key", layer.scheme.key), ("value", layer.scheme.value)):
        if spec.kind not in PACKED_KINDS:
            return f"{side} kind {spec.kind!r} (the packed layout holds {', '.join(PACKED_KINDS)} codes)"
    if layer.scheme.value.has_channel_transform:
        return "centred / smoothed values (the kernels move only the keys' query and tail into the codes' basis)"
    if layer._k.buffer.shape[3] != layer._v.buffer.shape[3]:
        return "key and value head dims differ"
    if layer.scheme.key.pre_rope and layer._k.rotary.rot_dim:  # a NoPE layer (rot_dim 0) un-rotates nothing
        if layer.scheme.key.rotate is not None:
            return (
                f"pre-RoPE keys with a {layer.scheme.key.rotate} rotation (the kernel applies RoPE to the "
                "dequantized codes, which are in the rotated basis)"
            )
        return layer._k.rotary.fused_reason()
    return None


def kernel_reason(
    mode: FusedMode, scheme: KVScheme, store: Callable[[], PackedStore], query: torch.Tensor
) -> str | None:
    """Why the Triton kernel would not take a layer stored by ``scheme``: asked where it is the kernel the layer's
    decode steps would get, that is under ``KVBITS_KERNEL=triton`` (``claim`` then raises) and for ``"auto"`` on CUDA
    under ``KVBITS_KERNEL=auto`` (SDPA then stays faster); ``None`` elsewhere. ``store()`` builds the layer's packed
    store, asked only then (``packed_store``, or a static layer's ``fused_store``). ``KVBITS_KERNEL=triton`` without
    Triton, or on a device it cannot launch on: ``dispatch.require_triton``'s error. The codes' bits and kind are read
    from ``scheme``, so that a store without codes yet (a prompt shorter than ``sinks + residual``) gets the answer its
    decode steps' stores will."""
    kernel = dispatch.kernel_mode()
    if kernel == "reference" or (kernel == "auto" and mode != "auto"):
        return None
    if kernel == "triton":
        dispatch.require_triton(query)
    from kvbits.kernels.triton_decode import KIND_CODES, TRITON_BITS, supported

    # what supported() checks on the codes, from the scheme: a prefill shorter than sinks + residual has none yet,
    # and the claim made there holds for the request (a decline is not asked again at decode steps)
    for side, spec in (("key", scheme.key), ("value", scheme.value)):  # float sides: nothing to check here
        if spec.kind in ("int", "nuq") and spec.bits not in TRITON_BITS:
            return f"{side}: {spec.bits}-bit codes (Triton kernel: {TRITON_BITS})"
        if spec.kind in PACKED_KINDS and (spec.kind, spec.fmt if spec.kind == "fp8" else None) not in KIND_CODES:
            kinds = ", ".join(kind if fmt is None else f"{kind} {fmt}" for kind, fmt in KIND_CODES)
            return f"{side}: {spec.kind} {spec.fmt or ''} codes (Triton kernel: {kinds})"
    return supported(store(), query)


def claim(layer: QuantizedKVLayer, query: torch.Tensor, module: torch.nn.Module | None = None) -> bool:
    """Claim ``layer`` for fused decode steps if its mode wants ``query``'s device and it fits (logged once).
    ``KVBITS_KERNEL=triton`` and a layer the packed layout holds but the Triton kernel does not take (``kernel_reason``:
    a head dim that is not a power of two, 5-bit codes): ``NotImplementedError`` naming the layer and why, here (the
    prefill) rather than at its first decode step.

    A layer declined once is not asked again at decode steps (``q == 1``): only at the next multi-token call, or the
    next request's first call (``reset()`` forgets the decline: a one-token prompt is asked too).

    ``module``: the attention module calling; its config's ``_attn_implementation`` is remembered so that
    ``serving`` can tell when the model switched to another attention implementation.
    """
    state = layer.fused
    if state.claimed:
        return True
    if not wants(state.mode, query.device):
        return False
    if state.declined is not None and query.shape[2] == 1:
        # declined at this request's prefill: a decode step would get the same answer, at the cost of a packed store
        # built per layer and step (kernel_reason); the next prefill (q > 1) or request (reset) asks again
        return False
    layout = None
    if hasattr(layer, "fused_store"):  # a StaticQuantizedLayer (kvbits.cache.static): its own layout
        reason = kernel_reason(state.mode, layer.scheme, layer.fused_store, query)
    else:  # a layout the packed store cannot hold: SDPA whatever the kernel
        layout = layout_reason(layer)
        reason = layout or kernel_reason(state.mode, layer.scheme, lambda: packed_store(layer), query)
    if reason is not None:
        if dispatch.kernel_mode() == "triton" and not layout:  # forced: refused now, not at every decode step
            raise NotImplementedError(
                f"layer {layer.layer_idx}: {dispatch.KERNEL_ENV}=triton, but the Triton decode kernel cannot serve "
                f"this layer: {reason}; set {dispatch.KERNEL_ENV}=auto or reference to decode it without the Triton "
                "kernel, or make the cache with fused_decode=False"
            )
        if state.declined != reason:
            logger.info(
                "layer %d: fused decode falls back to SDPA over dequantized K/V: %s", layer.layer_idx, reason
            )
        state.declined = reason
        return False
    state.claimed, state.declined = True, None
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    state.claimed_by = None if implementation is None else (weakref.ref(config), implementation)
    return True


def serving(layer: QuantizedKVLayer) -> bool:
    """Whether the claimed ``layer``'s decode steps still reach the attention that claimed it. When the model
    was switched to another implementation (``set_attn_implementation("sdpa")``), placeholders would reach
    an attention function that cannot read them: release the claim (logged), so ``update`` returns
    dequantized K/V again; the next ``kvbits_fused`` call claims the layer anew. No device work."""
    state = layer.fused
    if state.claimed_by is None:
        return True
    ref, implementation = state.claimed_by
    config = ref()
    now = None if config is None else getattr(config, "_attn_implementation", None)
    if config is None or now == implementation:
        return True
    logger.info(
        "layer %d: the model's attention changed from %r to %r: decode steps return dequantized K/V",
        layer.layer_idx, implementation, now,
    )  # fmt: skip
    state.claimed, state.claimed_by = False, None
    return False


def tag(layer: QuantizedKVLayer, keys: torch.Tensor, placeholder: bool = False) -> torch.Tensor:
    """Mark ``keys`` (returned by ``layer.update``) for ``kvbits_fused``; a no-op when fused decode is off."""
    if layer.fused.mode is not False:
        setattr(keys, TAG, (layer, placeholder))
    return keys


def tag_of(keys: Any) -> tuple[QuantizedKVLayer, bool] | None:
    """``(layer, is_placeholder)`` when ``keys`` came from a ``QuantizedKVLayer.update``, else ``None``."""
    return getattr(keys, TAG, None)


def placeholders(layer: QuantizedKVLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-byte ``meta`` K/V ``(B, H, T, D)`` standing for every cached token; keys tagged. ``H`` is what
    ``update`` returns otherwise: the stored ``H_kv`` heads times ``layer.repeat`` (the kernel attends query
    head ``j`` to stored head ``j // G``, which is where a head repeated in a row came from)."""
    B, H, _, Dk = layer._k.buffer.shape
    H *= layer.repeat
    Dv = layer._v.buffer.shape[3]
    T = layer.tokens_seen
    keys = torch.empty((B, H, T, Dk), dtype=layer.dtype, device="meta")
    values = torch.empty((B, H, T, Dv), dtype=layer.dtype, device="meta")
    return tag(layer, keys, placeholder=True), values


def slot_masks(
    layer: QuantizedKVLayer, keep: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``keep`` ``(B, T)`` bool over the layer's cache positions → ``(quant_mask, full_mask)`` in slot order.

    Cache position ``i`` is sink ``i`` (``i < n_sinks``), quantized slot ``i - n_sinks`` or buffer slot
    ``i - n_sinks - T_q``; the tail is sinks then buffer (``packed_store``). Device ops only (no sync).
    ``quant_mask`` is a view of ``keep`` (``packed_store`` copies it into rows of whole words).
    """
    k = layer._k
    S, T_q = k.n_sinks, k.n_quantized
    quant = keep[:, S : S + T_q] if T_q else None
    full = torch.cat([keep[:, :S], keep[:, S + T_q :]], dim=1) if keep.shape[1] > T_q else None
    return quant, full


def packed_store(layer: QuantizedKVLayer, keep: torch.Tensor | None = None) -> PackedStore:
    """The layer's tokens in the decode-kernel layout (``kvbits.kernels.reference``), no validation syncs.

    Quantized slots: the stored chunks (``SideStore.packed``: all reserved slots when the cache has
    ``max_cache_len``, of which ``quant_lens`` and ``quant_used`` say the first ``n_quantized``); tail: sinks then buffer
    (``SideStore.full_tail``). Every sequence has the same lengths; pre-RoPE keys start at position
    ``n_sinks + n_dropped``. ``keep`` ``(B, tokens_seen)`` bool: the cache positions each sequence may
    attend to (``False``: left padding), turned into slot masks (``slot_masks``).
    """
    if layer.is_sliding:  # a direct call: the kernel would attend past the window (and build uncounted RoPE tables)
        raise ValueError(
            f"layer {layer.layer_idx} is a sliding-window layer: the packed layout serves full-attention layers only "
            "(layout_reason declines it; decode it through QuantizedKVCache, which falls back to SDPA)"
        )
    k, v = layer._k, layer._v
    # one slot count for K and V: every reserved slot where both sides hold the reservation (or neither does), the
    # slots in use where one side is per block (head / tensor granularity: not mergeable, nothing reserved)
    every_slot = k.reserved_slots == v.reserved_slots
    key, value = k.packed(every_slot), v.packed(every_slot)
    key_full, value_full = k.full_tail(), v.full_tail()
    ref = key_full if key_full is not None else key.codes
    B, device = ref.shape[0], ref.device
    T_q = k.n_quantized if key is not None else 0  # slots in use; key.n_slots more with a reservation
    slots = 0 if key is None else key.n_slots
    T_f = 0 if key_full is None else key_full.shape[2]
    quant_lens = torch.full((B,), T_q, dtype=torch.int32, device=device)
    full_lens = torch.full((B,), T_f, dtype=torch.int32, device=device)
    cos = sin = pos0 = None
    if key is not None and layer.mode == "quantized" and layer.scheme.key.pre_rope and k.rotary.rot_dim:
        p0 = k.n_sinks + k.n_dropped
        # positions reach p0 + T_q - 1 - pos_offset[b]: ahead of the cache indices when the model's position
        # ids start past them (explicit position_ids); the kernel reads the tables without a bound check
        cos, sin = layer.fused.tables.get(k.rotary, p0 + T_q + k.positions_ahead(), device)
        pos0 = torch.full((B,), p0, dtype=torch.int32, device=device)
        if k.pos_offset is not None:  # left padding: the model's positions (SideStore.pos_offset)
            pos0 = (pos0 - k.pos_offset.to(device)).to(torch.int32)
    quant_mask = full_mask = None
    if keep is not None:
        quant_mask, full_mask = slot_masks(layer, keep)
        if quant_mask is not None:  # rows of whole words; reserved slots: the mask spans them all (never read)
            quant_mask = word_rows(quant_mask, slots)
    return PackedStore(
        key, value, key_full, value_full, quant_lens, full_lens, cos, sin, pos0, quant_mask, full_mask,
        quant_used=T_q if slots > T_q else None, uniform_lens=True,
    )  # fmt: skip
