"""`StaticQuantizedKVCache`: quantized K/V in fixed slabs, so that a decode step can be captured as a CUDA graph.

A CUDA graph replays the kernels of one captured step on the same addresses with the same sizes and scalars, with
no Python in between (``torch.cuda.graph``, or ``torch.compile(mode="reduce-overhead")``). transformers'
``StaticCache`` is built for that; ``QuantizedKVCache`` is not (its layers keep lengths and flush points on the host,
and its fused step launches kernels sized by them: BENCHMARKS.md §6, sessions 47-48, and
``benchmarks/graph_replay.py``). This cache is the quantized counterpart of ``StaticCache``:

- each layer reserves, at its first ``update``, its quantized slots for ``max_cache_len`` tokens (packed codes and
  float16 or float32 scales and zero-points per side, in the decode kernels' layout, ``kvbits.kernels.reference``)
  and never reallocates them;
- the number of tokens written lives on the device (``length``, a 0-dim int64 tensor, as ``StaticLayer``'s
  ``cumulative_length``), and so does the number quantized (``qlen``);
- **per-token schemes** (``residual = 0``, ``block = 1``): an ``update`` of ``q`` tokens quantizes them
  (``kvbits.kernels.quantize_pack``: the Triton kernel on CUDA, ``kvbits.quant.quantize`` elsewhere, the same codes;
  no host sync) and writes them at slots ``length + arange(q)`` with ``index_copy_``;
- **windowed schemes** (KIVI: a full-precision residual window, tokens quantized ``block`` at a time, per-channel
  key groups within a block): a window of ``residual + block`` full-precision slots, used as a ring. A decode step
  writes its token at slot ``length % W``; when the window is then full (the flush: ``QuantizedKVCache`` flushes when
  its buffer holds ``residual + block`` tokens) it quantizes the window's oldest ``block`` tokens, writes them at
  quantized slots ``qlen`` on, and ``qlen`` advances by ``block``. Whether a step flushes is decided on the host from
  its counts (``tokens_written`` and the blocks flushed), so the other steps quantize nothing. Once a step has been
  traced (``torch.compile``) or captured as a CUDA graph without ``GraphedDecode``'s bookkeeping, its replays run no
  Python and the host's counts are no longer the device's (``host_counts``; for good: after ``reset()`` the graph may
  still be replayed): every step then
  quantizes the oldest block, a flush or not, and the write lands past ``qlen``, where nothing attends, until the
  flush rewrites it and ``qlen`` advances (a device ``where``, not a branch), so one captured step replays right
  across flushes. ``GraphedDecode`` instead captures the plain and the flushing step apart and counts its replays
  (``step_variant``, ``count_replayed_step``). An update of several tokens (a prefill) takes the lengths from the
  host's counts (else reads them once, a host sync) and flushes whole blocks at once;
- a decode step's attention sees every position: ``update`` returns ``(B, H_kv, max_cache_len, D)`` K/V (quantized
  slots dequantized, the window's tokens at their positions; the mask transformers builds for ``get_mask_sizes``'
  ``max_cache_len`` hides the rest; an eager update of several tokens, a prefill, gets only the positions written so
  far, and its mask is sized for them: none at all for a prompt on an empty cache), or, on decode steps of a model
  routed through ``kvbits_fused``
  (``use_fused_decode``), zero-byte placeholders: the fused kernel then reads the packed slots with each sequence's
  length taken from the device and the window as its full-precision tail (its slots masked unless they hold tokens
  not yet quantized), launched for all reserved slots (``PackedStore(uniform_lens=False)``), the same at every step;
- K/V checks are kept on the device (a running ``max |x|`` per side, NaN propagating) and read by ``check_inputs()``
  and ``memory_report()`` (``checks="lazy"``), or made before each write (``checks="eager"``: a host sync, so not
  inside a captured step); ``"auto"``: eager on CPU, lazy elsewhere.

Under ``torch.compile`` the cache is traced, not run eagerly (``QuantizedKVCache`` is: ``kvbits.cache.eager``): a
decode step with SDPA compiles as one graph, once for every step, and its slabs and counters are marked as static
addresses (``StaticLayer`` does the same), so ``mode="reduce-overhead"`` replays it as a CUDA graph. transformers'
``generate`` compiles so by itself on CUDA with a compileable cache. Traced steps attend over the K/V ``update``
returns, whatever the model's attention: ``kvbits_fused`` runs eagerly (``torch.compiler.disable``), so it cannot sit
inside such a graph; a fused step is captured whole with ``torch.cuda.graph`` instead
(``kvbits.evaluate.graphs``). Inside ``torch.compile`` the K/V checks are lazy whatever the mode (read by
``check_inputs()`` then, an eager cache's too), and the host's token count (below) is not kept.

Schemes (``static_reason``): INT2/3/4/8 and FP8 codes with one scale per token (whole rows or channel groups, affine or
symmetric, vLLM's rounding and integer zero-points, Hadamard rotations) or per-channel groups of tokens within the
flush block (KIVI's keys); static FP8 with one scale per tensor or per head (vLLM's ``fp8`` KV cache: 1.0 until
calibrated, ``calibration=`` or ``set_static_qparams``; values beyond it saturate and are counted on the device,
``clipped()``); float layers of a mixed scheme (``"kivi-4,0=fp16"``) keep float slabs. Per-token schemes may keep their
first ``sinks`` tokens in full precision (attention sinks): a sink slab of ``sinks`` slots, the kernels'
full-precision tail; quantized slot ``i`` then holds position ``sinks + i``. A decode step writes the sink or
quantizes the token as the host's counts say (a sink step is a step variant of its own, as a flush is), or, once those
counts are off, picks sink or slot on the device. Pre-RoPE keys (``int4-channel-prerope``; KVQuant §3.2) are un-rotated
before they are quantized and rotated back after, at positions kept on the device with fixed RoPE tables
(``kvbits.cache.static_rope``: a request's left padding is read from the position ids of its first update, and again at
later prefill chunks for rows that held only pads so far; ``track_positions`` hands them over on transformers that pass none); the fused kernels rotate them as they read them.
Calibrated parameters (``kvbits.cache.fixed``; ``calibration=``, ``install_calibration`` or ``set_static_qparams``,
before the first token; written in place after ``reset()``): static integer or NUQ ranges (KVQuant's per-channel keys:
one row per sequence in the kernels' layout), NUQ codebooks, dense-and-sparse outliers (a fixed number per token, in
slots like the codes), centred / smoothed keys; so KVQuant's recipe (``kvquant-4``: pre-RoPE NUQ keys, NUQ values, 1 %
outliers, a sink) and ``*-token-smooth[-prerope]`` are held. Values saturated against static ranges (or under vLLM's
integer zero-points, where a token's range excludes 0) are counted on the device when a token's codes are final
(``clipped()``; ``calibration_report()``, as ``QuantizedKVCache``'s, with the elements quantized and the positions past the
calibrated context). A cache reserving positions past the artifact's calibrated
context says so once, when the artifact is installed (replayed steps are not seen by the host). A windowed scheme may
keep sinks too (``kvquant-4-block``: KVQuant's per-channel keys over 128-token blocks, a sink): its full-precision slab
holds the ``sinks`` slots, then the window's ring; quantized slot ``i`` holds position ``sinks + i``. Hadamard-rotated
pre-RoPE keys and centred values stay with ``QuantizedKVCache``.

Bytes: the quantized slots are those ``kvbits.plan`` counts at ``max_cache_len`` (per-token schemes: exactly the
plan), plus, for a windowed scheme, one block written ahead of them; the window holds ``residual + block`` tokens
where the plan counts those left unquantized at ``max_cache_len`` (``residual`` to ``residual + block - 1``; a
``max_cache_len`` that never fills the window, so never flushes, gets only its positions, the plan's, and a pre-RoPE
key side then no RoPE tables, as the plan counts none: no slot it attends is quantized); a static
scale is also held in the kernels' layout, once per sequence (FP8: float32 per head; KVQuant's key ranges: float16 scale
and zero-point rows per head and channel). ``memory_report()`` counts what is held.

Hybrid models (``config=``): a ``conv`` / ``linear_attention`` layer (LFM2, Qwen3-Next) is transformers'
``LinearAttentionLayer``, a ``hybrid`` one (Zamba, Zamba2, Falcon-H1) fixed slabs plus such a state
(``kvbits.cache.static_state``), as transformers' ``StaticCache`` holds them: the states unquantized, reported apart
(``memory_report()``'s ``linear_state_bytes``); the cache-wide methods walk the K/V layers (``kv_layers``).
``hybrid_sliding`` layers are refused (``layer_types_refusal``).

What the host still tracks: ``tokens_written`` counts the tokens of eager ``update`` calls, to refuse a sequence
longer than ``max_cache_len`` with a clear error, and a windowed layer's flushed tokens. Replayed steps do not run
``update``: ``GraphedDecode`` counts them (``count_replayed_step``, which refuses a step past ``max_cache_len``);
another graph's caller keeps its positions below ``max_cache_len`` itself (as with ``StaticCache``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbits.cache import fused
from kvbits.cache.checks import (
    _host_maxima,
    check_channel_groups,
    check_incoming,
    check_mode,
    check_now,
    fmt_x,
    input_bound,
    write_maxima,
)
from kvbits.cache.fixed import (
    calibrated_length,
    channel_bound,
    check_calibrated_heads,
    check_installed_decode,
    check_param_shapes,
    checked_params,
    install_artifact,
    missing_params,
)
from kvbits.cache.layer import (
    BEAM_IDX_DTYPES,
    PACKED_STORAGE,
    cache_batch_size,
    check_beam_idx,
    find_position_ids,
    no_positions_message,
    offload_refusal,
    padded_sink_rows,
    padded_sinks_message,
    position_offset,
    repeated_positions,
    reread_offset,
)
from kvbits.cache.static_rope import StaticRope, check_rotary
from kvbits.kernels.quantize import quantize_pack
from kvbits.kernels.reference import (
    STATIC_TPS,
    PackedStore,
    PackedTensor,
    dequantize_packed,
    pack_side,
    word_rows,
)
from kvbits.quant.fp8 import static_fp8_scale
from kvbits.quant.tensor import FLOAT_DTYPES, quantize
from kvbits.schemes import get_scheme
from kvbits.schemes.accounting import PACKED_KINDS, token_split
from kvbits.schemes.spec import KVScheme, TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.quant.rope import RotaryTables

logger = logging.getLogger(__name__)

__all__ = ["StaticQuantizedKVCache", "StaticQuantizedLayer", "static_reason"]

_SLOT_FIELDS = ("codes", "scale", "zero", "outlier_values", "outlier_index")  # PackedTensor fields with a slot axis
SIDES = ("key", "value")
_FIXED_BATCH = (
    "StaticQuantizedKVCache cannot {1} (change its batch): its slabs hold the batch of {0} of their first update, "
    "at addresses a captured step reads (as transformers' StaticCache's); expand or select the inputs before "
    "the prefill into a new cache, or use QuantizedKVCache, which repeats and selects sequences"
)


def _offload_refusal(what: str, float_layer: bool = False) -> str:
    """``offload_refusal`` for the static cache; ``float_layer``: an fp16 / bf16 layer's plain float slabs."""
    storage = ("float slabs (key_full / value_full, reserved for max_cache_len at addresses a captured step reads; "
               "see memory_report())") if float_layer else PACKED_STORAGE  # fmt: skip
    return offload_refusal(what, "StaticQuantizedKVCache", "StaticCache", storage)


def static_layer_types() -> tuple[str, ...]:
    """The config layer types ``StaticQuantizedKVCache`` holds: ``full_attention``, and, on a transformers with
    ``LinearAttentionLayer`` (5.17 and later), ``conv`` / ``linear_attention`` states and ``hybrid`` layers
    (``kvbits.cache.static_state``), as transformers' ``StaticCache`` holds them."""
    from kvbits.cache.cache import _STATE_TYPES
    from kvbits.cache.hybrid import HYBRID_TYPES, hybrid_layer_class

    return ("full_attention", *((*_STATE_TYPES, *HYBRID_TYPES) if hybrid_layer_class() is not None else ()))


def layer_types_refusal(types: list[str]) -> str:
    """Why ``StaticQuantizedKVCache`` refuses a config whose layer ``types`` (one per layer) are not all of
    ``static_layer_types()``, naming the refused layers by type and what holds them: ``QuantizedKVCache(config=...)``
    when it holds every one (sliding / chunked windows, KV-sharing ``dummy`` layers), else no kvbits cache;
    transformers' ``StaticCache`` (unquantized) when it has a layer for each. The refusal named ``QuantizedKVCache``
    for a ``hybrid_sliding`` layer too, which it refuses."""
    from kvbits.cache.cache import _SLIDING_TYPES, _STATE_TYPES
    from kvbits.cache.hybrid import HYBRID_TYPES, hybrid_layer_class

    static_held = static_layer_types()
    by_type: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t not in static_held:
            by_type.setdefault(t, []).append(i)
    held = {*_SLIDING_TYPES, *_STATE_TYPES, *(HYBRID_TYPES if hybrid_layer_class() is not None else ()),
            *(("dummy",) if hasattr(cache_utils, "DummyLayer") else ())}  # what QuantizedKVCache._make_layer builds
    static_types = getattr(cache_utils, "STATIC_LAYER_TYPE_MAPPING", {})
    listed = ", ".join(f"{t!r} layers {idx}" for t, idx in by_type.items())
    beside = ", beside the states of conv, linear_attention and hybrid layers" if len(static_held) > 1 else ""
    msg = f"StaticQuantizedKVCache holds full-attention layers only{beside}; the config has {listed}. "
    unheld = [t for t in by_type if t not in held]
    if unheld:
        msg += (f"No kvbits cache holds {unheld} layers (QuantizedKVCache refuses them too); serve this model "
                "unquantized and price its attention layers with kvbits plan")
    else:
        msg += ("QuantizedKVCache(config=...) holds this model (max_cache_len= reserves its slots): it quantizes the "
                "K/V of its attention layers (sliding, chunked and the 'hybrid' layers of Zamba, Zamba2 and Falcon-H1: "
                "attention plus a Mamba state)")
        if any(t in (*_STATE_TYPES, *HYBRID_TYPES) for t in by_type):
            msg += (" and keeps the states of its hybrid, conv and linear_attention layers unquantized in "
                    "transformers' LinearAttentionLayer")
    if all(t in static_types for t in by_type):
        msg += "; transformers' StaticCache(config=...) holds every layer, unquantized"
    elif unheld:
        msg += " (DynamicCache(config=...))"
    return msg


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` on a build or machine without CUDA), as
    transformers asks it (``is_cuda_stream_capturing``)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a CPU build raises from its stub
        return False


def _side_reason(spec: TensorSpec, block: int, side: str) -> str | None:
    if spec.kind not in PACKED_KINDS:
        return f"kind {spec.kind!r} (int, NUQ and fp8 codes only)"
    if spec.kind == "fp8" and spec.static:  # one scale per tensor or head: 1.0 until calibrated (set_static_qparams)
        return None if block == 1 else "static FP8 scales in a windowed scheme"
    if spec.granularity == "channel" and spec.group_size is None and not spec.static:
        return "per-channel scales over every token without calibrated (static) ranges"
    if spec.granularity == "channel" and spec.group_size is not None and block % spec.group_size:
        return f"per-channel groups of {spec.group_size} tokens that do not divide the flush block of {block}"
    if spec.granularity not in ("token", "channel"):
        return f"{spec.granularity} granularity (one scale per token or per channel group only)"
    if spec.pre_rope and spec.rotate is not None:
        return f"pre-RoPE keys with a {spec.rotate} rotation (RoPE acts on the model's channel pairs, not the codes')"
    if side == "value" and spec.has_channel_transform:
        return "centred / smoothed values (the fused kernels move only the keys' query and tail into the codes' basis)"
    return None


def static_reason(scheme: KVScheme) -> str | None:
    """Why a (flat) scheme cannot be stored in fixed slabs (``None``: it can); see the module docstring."""
    if scheme.is_identity:
        return None
    for side, spec in (("key", scheme.key), ("value", scheme.value)):
        if spec.kind == "float":
            return f"{side}s kept in {spec.fmt} beside quantized {'values' if side == 'key' else 'keys'}"
        why = _side_reason(spec, scheme.block, side)
        if why is not None:
            return f"{side}s: {why}"
    return None


class StaticQuantizedLayer(CacheLayerMixin):
    """One full-attention layer's fixed slabs (see the module docstring).

    Attributes (after the first ``update``):
        key, value: ``PackedTensor`` slabs of quantized slots (quantized schemes), else ``None``.
        key_full, value_full: ``(B, H_kv, max_cache_len, D)`` float slabs (float schemes), a windowed scheme's
            ``(B, H_kv, sinks + residual + block, D)`` sinks and window, a per-token scheme's ``(B, H_kv, sinks, D)``
            sinks (positions ``0 .. sinks - 1``; quantized slot ``i`` then holds position ``sinks + i``), else
            ``None``.
        length, qlen: 0-dim int64, tokens written and tokens quantized (device); ``lens``: ``(B,)`` int32, the
            quantized slots each sequence attends (its written ones for float layers), for the kernels.
        window_pos: ``(sinks + residual + block,)`` int64, the position each full-precision slot of a windowed layer
            holds (``-1``: none yet).
        maxima: ``(2,)`` float32 running ``max |K|``, ``max |V|`` of the unchecked tokens (lazy checks).
        rope: pre-RoPE keys' tables and position offsets (``kvbits.cache.static_rope.StaticRope``), else ``None``.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(
        self, scheme: KVScheme, max_cache_len: int, layer_idx: int, *, fused_decode: fused.FusedMode = "auto",
        checks: str = "auto", num_key_value_heads: int | None = None, rotary: RotaryTables | None = None,
        rope_tables: fused.RopeTableCache | None = None, head_dim: int | None = None, head_repeat: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        reason = static_reason(scheme)
        if reason is not None:
            raise ValueError(
                f"layer {layer_idx}: scheme {scheme.name!r} cannot be stored in fixed slabs: {reason}; "
                "QuantizedKVCache (with max_cache_len=) serves it"
            )
        if not scheme.is_identity and scheme.sinks >= max_cache_len:
            raise ValueError(f"layer {layer_idx}: max_cache_len={max_cache_len} leaves no slot past the "
                             f"{scheme.sinks} sinks of {scheme.name!r}")  # fmt: skip
        self.rotary: RotaryTables | None = None  # pre-RoPE keys: the layer's RoPE tables (kvbits.cache.static_rope)
        if not scheme.is_identity and scheme.key.pre_rope:
            if rotary is None:
                raise ValueError(f"layer {layer_idx}: scheme {scheme.name!r} quantizes keys before RoPE: the layer "
                                 "needs the model's RoPE tables (give the cache config= or rotary=)")  # fmt: skip
            check_rotary(rotary, f"layer {layer_idx}")
            self.rotary = rotary if rotary.rot_dim else None  # a layer without RoPE: its keys are pre-RoPE already
        self._rope_tables = rope_tables if rope_tables is not None else fused.RopeTableCache()
        self.rope: StaticRope | None = None  # made with the slabs
        self.scheme, self.max_cache_len, self.layer_idx = scheme, max_cache_len, layer_idx
        self.num_key_value_heads = num_key_value_heads  # from the config, for checks before the first update
        # the config's head_dim, and how many times the model repeats each KV head before update (Falcon's
        # new_decoder_architecture before transformers 5.25: kvbits.cache.cache._head_repeat): the first K/V must match
        self.head_dim, self.head_repeat = head_dim, head_repeat
        self.checks = check_mode(checks)
        self.fused = fused.FusedState(mode=fused_decode)
        self.tokens_written = 0
        # the host's counts (tokens_written, _host_qlen) are the device's until a step is traced (torch.compile) or
        # captured (a CUDA graph) without GraphedDecode's bookkeeping, whose replays run no Python; for good, since
        # reset() does not stop those replays. While they hold, a windowed decode step quantizes its block only when
        # it flushes (decided here), and a prefill takes the lengths from them.
        self.host_counts = True
        self.graph_bookkeeping = False  # set by kvbits.evaluate.graphs.GraphedDecode while it captures a step
        self._host_qlen = 0  # tokens quantized, as the host counts them (windowed layers)
        self.key: PackedTensor | None = None
        self.value: PackedTensor | None = None
        self.key_full: torch.Tensor | None = None
        self.value_full: torch.Tensor | None = None
        self.length = torch.zeros((), dtype=torch.int64)
        self.qlen: torch.Tensor | None = None  # 0-dim int64: tokens quantized (windowed layers; else unused)
        self.window_pos: torch.Tensor | None = None  # (W,) int64: the position each window slot holds (-1: none)
        self.lens: torch.Tensor | None = None
        self.maxima: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self._shape: tuple[int, int, int] | None = None  # (B, H_kv, D)
        self._bounds: tuple[float, float] = (float("inf"), float("inf"))
        self._lazy = False
        self._checks_seen = False  # the cache read (or raised) the checks of the K/V held: reset() does not read them
        # calibrated parameters by side, as quantize takes them (kvbits.cache.fixed), on the K/V device from the first
        # update; a static FP8 side without an installed scale gets 1.0 there
        self._fixed: dict[str, dict[str, torch.Tensor]] = {side: {} for side in SIDES}
        self._fixed_given = self._fixed  # them as installed, before the slabs' defaults (release)
        self._zero_scales: dict[str, bool] = {}  # a static int/NUQ scale with a zero entry (the kernel counts its clips)
        self._why: tuple[str, str] = ("", "")  # the input bounds' reasons
        self.clipped: torch.Tensor | None = None  # (2,) int64: K, V values saturated (static scales, integer zero-points)

    # ------------------------------------------------------------------ allocation
    @property
    def batch_size(self) -> int | None:
        """Sequences the slabs hold (``None`` before the first update)."""
        return None if self._shape is None else self._shape[0]

    @property
    def windowed(self) -> bool:
        """Whether tokens pass through a full-precision window first (``residual > 0`` or ``block > 1``)."""
        return not self.scheme.is_identity and (self.scheme.residual > 0 or self.scheme.block > 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the slabs for ``key_states``' batch, heads, head dim, dtype and device (zeros); ``TypeError`` /
        ``ValueError`` first (host metadata only; ``kvbits.cache.checks.check_incoming``, as ``QuantizedKVLayer``'s)
        for K/V that are no ``(B, H_kv, q, D)`` float tensors of one dtype, or that differ from the config's KV heads
        or head dim: slabs made for them would refuse every later update. transformers' ``early_initialization``
        calls this directly (``q = 0``), without ``update``."""
        check_incoming(self, key_states, value_states)
        B, H, _, D = key_states.shape
        if value_states.shape[3] != D:
            raise ValueError(
                f"layer {self.layer_idx}: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} must "
                "share batch, heads and head dim"
            )
        check_calibrated_heads(self, H, D)
        self._fixed_given = {side: dict(params) for side, params in self._fixed.items()}  # for release()
        device = key_states.device
        self.device, self.dtype, self._shape = device, key_states.dtype, (B, H, D)
        self.length = self.length.to(device)
        self.qlen = torch.zeros((), dtype=torch.int64, device=device)
        self.lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.maxima = torch.zeros(2, dtype=torch.float32, device=device)
        self._step_max = torch.zeros(2, dtype=torch.float32, device=device)  # this update's, before the maximum
        self._other_lens = torch.zeros(B, dtype=torch.int32, device=device)  # the other side's: 0, or the window's
        self.clipped = torch.zeros(2, dtype=torch.int64, device=device)
        self._lazy = self.checks == "lazy" or (self.checks == "auto" and device.type != "cpu")
        if self.scheme.is_identity:  # fp16 / bf16 schemes store every token in their own format
            shape = (B, H, self.max_cache_len, D)
            self.key_full = torch.zeros(shape, dtype=FLOAT_DTYPES[self.scheme.key.fmt], device=device)
            self.value_full = torch.zeros(shape, dtype=FLOAT_DTYPES[self.scheme.value.fmt], device=device)
        else:
            check_channel_groups(self.scheme, D, D, f"layer {self.layer_idx}")
            for side in SIDES:  # installed without a config: their shapes checked against the first K/V's, named
                check_param_shapes(self._spec(side), f"layer {self.layer_idx} {side}", self._fixed[side], H, D,
                                   self.scheme.block)  # fmt: skip
            self._params_on(device, H)
            slots = self.max_cache_len - self.scheme.sinks
            if self.scheme.sinks:  # the first tokens, kept in the K/V dtype: the kernels' full-precision tail
                shape = (B, H, self.scheme.sinks, D)
                self.key_full = torch.zeros(shape, dtype=key_states.dtype, device=device)
                self.value_full = torch.zeros(shape, dtype=value_states.dtype, device=device)
            if self.windowed:  # the tokens quantized at max_cache_len, and one block written ahead of them
                S, R, blk = self.scheme.sinks, self.scheme.residual, self.scheme.block
                slots = token_split(self.scheme, self.max_cache_len).quantized + blk
                # the sinks, then the window: only max_cache_len's positions when they never fill it (no flush)
                tail = min(S + R + blk, self.max_cache_len)
                self.key_full = torch.zeros((B, H, tail, D), dtype=key_states.dtype, device=device)
                self.value_full = torch.zeros_like(self.key_full)
                self.window_pos = torch.full((tail,), -1, dtype=torch.int64, device=device)
                self._other_lens.fill_(tail)
            self.key = self._slab("key", key_states, slots)
            self.value = self._slab("value", value_states, slots)
            if self.rotary is not None:
                if self.rotary.head_dim != D:
                    raise ValueError(f"layer {self.layer_idx}: keys have head dim {D}, the RoPE tables "
                                     f"{self.rotary.head_dim} (a config of another model?)")  # fmt: skip
                # the slots a step attends (a windowed layer's block ahead is written, never attended): the tables
                # cover their positions, the rows plan(fused_decode=True) counts; none when no slot is attended (a
                # max_cache_len that never fills the window: no key is quantized, the plan counts no table, and
                # the block ahead, never attended, is quantized as it comes)
                attended = slots - self.scheme.block if self.windowed else slots
                if attended:
                    self.rope = StaticRope(self.rotary, self._rope_tables, self.scheme.sinks, attended, B, device)
        self._set_bounds(D)
        if not torch.compiler.is_compiling():  # fixed addresses for torch.compile's CUDA graphs, as StaticLayer's
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: the slabs (K/V) and the step's state (``state_tensors``)."""
        slabs = [t for p in (self.key, self.value) if p is not None for t in p.tensors()]
        slabs += [t for t in (self.key_full, self.value_full) if t is not None]
        slabs += [t for side in SIDES for t in self._fixed[side].values()]
        if self.rope is not None:  # shared with the cache's other layers
            slabs += [self.rope.cos, self.rope.sin]
        return slabs + self.state_tensors()

    def _template(self, side: str, like: torch.Tensor) -> PackedTensor:
        """One flush block of zeros (per-channel groups need their tokens) in the layout ``quantize`` + ``pack_side``
        give ``side``'s spec with the installed parameters; ``like``: ``(B, H_kv, *, D)`` K/V."""
        B, H, _, D = like.shape
        zeros = torch.zeros((B, H, self.scheme.block, D), dtype=like.dtype, device=like.device)
        return pack_side([quantize(zeros, self._spec(side), **self._fixed[side], validate=False, sync=False)])

    def _slab(self, side: str, like: torch.Tensor, slots: int) -> PackedTensor:
        """A zero ``PackedTensor`` of ``slots`` token slots in ``_template``'s layout (a static scale's one row as it
        is)."""
        B, H = like.shape[:2]
        one = self._template(side, like)
        fields = {}
        for name in _SLOT_FIELDS:
            t = getattr(one, name)
            if t is None:
                continue
            if name in ("scale", "zero") and one.tps == STATIC_TPS:  # one static row for every slot: kept as it is
                fields[name] = t.clone()
                continue
            rows = slots // one.tps if name in ("scale", "zero") else slots
            fields[name] = torch.zeros((B, H, rows, t.shape[3]), dtype=t.dtype, device=t.device)
        return replace(one, **fields)

    def _params_on(self, device: torch.device, heads: int) -> None:
        """The installed parameters on the K/V device (static FP8 without one: 1.0, vLLM's uncalibrated default);
        ``ValueError`` naming what a calibrated side still lacks."""
        missing = [m for side in SIDES for m in missing_params(self._spec(side), side, self._fixed[side])]
        if missing:
            raise ValueError(
                f"layer {self.layer_idx}: scheme {self.scheme.name!r} needs calibrated parameters ({', '.join(missing)}); "
                "run `kvbits calibrate` and pass calibration= (or install them with set_static_qparams()) before use"
            )
        for side in SIDES:
            spec, fixed = self._spec(side), self._fixed[side]
            for name, t in fixed.items():
                fixed[name] = t.to(device)
            if spec.kind == "fp8" and spec.static and "static_scale" not in fixed:
                fixed["static_scale"] = static_fp8_scale(torch.ones((), dtype=torch.float32, device=device),
                                                         spec.granularity, heads, f"{side} static FP8 scale")  # fmt: skip
            scale = fixed.get("static_scale")
            self._zero_scales[side] = scale is not None and spec.kind != "fp8" and bool((scale == 0).any())

    def _set_bounds(self, D: int) -> None:
        """Each side's input bound (``input_bound``), lowered for installed channel vectors (``channel_bound``)."""
        bounds = [channel_bound(*input_bound(self._spec(side), "quantized", D), self._fixed[side].get("channel_mean"),
                                self._fixed[side].get("channel_factor")) for side in SIDES]  # fmt: skip
        self._bounds = (bounds[0][0], bounds[1][0])
        self._why = (bounds[0][1], bounds[1][1])

    def set_static_qparams(
        self, side: str, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, *,
        codebook: torch.Tensor | None = None, mean: torch.Tensor | None = None, factor: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Install calibrated parameters for ``side``, as ``QuantizedKVLayer.set_static_qparams`` takes them
        (``kvbits.cache.fixed.checked_params``: static scales and zero-points, a NUQ codebook, channel means and
        smoothing factors; a static FP8 scale per tensor, or per head ``(H_kv,)``), checked once (one host sync).
        Before the first token only: codes already stored were taken under the old parameters. Once the slabs exist
        (``reset()`` since) they are written in place, so the addresses a captured step reads stay. A no-op for a layer
        kept in float."""
        if side not in SIDES:
            raise ValueError(f"side must be 'key' or 'value', got {side!r}")
        if self.scheme.is_identity:
            return
        if self.tokens_written:
            raise ValueError(f"layer {self.layer_idx}: static scales are installed before the first token; reset() first")
        given = [t for t in (scale, zero, codebook, mean, factor) if isinstance(t, torch.Tensor)]
        device = self.device if self._shape is not None else (given[0].device if given else torch.device("cpu"))
        heads = self.num_key_value_heads if self._shape is None else self._shape[1]
        params = checked_params(self._spec(side), f"layer {self.layer_idx} {side}", heads, device, scale=scale,
                                zero=zero, codebook=codebook, mean=mean, factor=factor)  # fmt: skip
        D = self.head_dim if self._shape is None else self._shape[2]  # the config's or the slabs' (None: at allocation)
        check_param_shapes(self._spec(side), f"layer {self.layer_idx} {side}", params, heads, D, self.scheme.block)
        fixed = self._fixed[side]
        # a scale, zero-points or codebook given alone pair with those installed (a scale alone keeps the zero-points)
        check_installed_decode(self._spec(side), f"layer {self.layer_idx} {side}", params, fixed,
                               scale_drops_zero=False)  # fmt: skip
        for name, t in params.items():
            old = fixed.get(name)
            if self._shape is not None and old is not None and old.shape == t.shape and old.dtype == t.dtype:
                old.copy_(t)  # allocated: the address a captured step reads stays
            else:
                fixed[name] = t
        if self._shape is not None:
            self._refresh(side)

    def _refresh(self, side: str) -> None:
        """Allocated slabs after an install: the parameters the slab holds itself (a static scale's row per sequence,
        the codebook, channel vectors) rewritten in place from a fresh zero block's layout; bounds and clip flags."""
        B, H, D = self._shape  # type: ignore[misc]
        self._params_on(self.device, H)
        slab = self.key if side == "key" else self.value
        fresh = self._template(side, torch.empty((B, H, 0, D), dtype=self.dtype, device=self.device))
        names = ("codebook", "channel_mean", "channel_factor")
        if slab.tps == STATIC_TPS:
            names += ("scale", "zero")
        for name in names:
            t = getattr(slab, name)
            if t is not None and t is not getattr(fresh, name):
                t.copy_(getattr(fresh, name))
        self._set_bounds(D)

    def _spec(self, side: str) -> TensorSpec:
        return self.scheme.key if side == "key" else self.scheme.value

    # ------------------------------------------------------------------ writing
    def _check_room(self, q: int) -> None:
        """``ValueError`` if ``q`` more tokens would pass ``max_cache_len`` (by the host's count)."""
        if self.tokens_written + q > self.max_cache_len:
            raise ValueError(
                f"layer {self.layer_idx}: {self.tokens_written} tokens cached + {q} new > max_cache_len="
                f"{self.max_cache_len} (the slabs are fixed: make the cache with a larger max_cache_len)"
            )

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Structural checks (host metadata only), the host's token count, and the K/V checks (eager: now)."""
        B, H, D = self._shape  # type: ignore[misc]
        for what, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (B, H, D):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[0] != B:  # another request's batch
                    raise ValueError(f"layer {self.layer_idx}: {what} {got}: "
                                     + _FIXED_BATCH.format(B, f"take {x.shape[0]} sequences"))  # fmt: skip
                raise ValueError(f"layer {self.layer_idx}: {what} must be (B={B}, H_kv={H}, q, D={D}), got {got}")
            if x.dtype != self.dtype or x.device != self.device:
                raise ValueError(
                    f"layer {self.layer_idx}: {what} is {x.dtype} on {x.device}; the slabs were made for {self.dtype} "
                    f"on {self.device} (reset() keeps them: make a new cache)"
                )
        q = key_states.shape[2]
        if value_states.shape[2] != q:
            raise ValueError(f"layer {self.layer_idx}: {q} keys but {value_states.shape[2]} values")
        self._check_room(q)
        if not self._lazy and key_states.numel() and value_states.numel():  # QuantizedKVLayer's check and bounds
            check_now((f"layer {self.layer_idx} keys", f"layer {self.layer_idx} values"), key_states, value_states,
                      ((self._bounds[0], self._why[0]), (self._bounds[1], self._why[1])))  # fmt: skip

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(B, H_kv, q, D)`` K/V at positions ``length + arange(q)``; return what attention reads.

        Returns every position's K/V ``(B, H_kv, max_cache_len, D)`` in the K/V dtype (quantized ones dequantized), or,
        on a claimed layer's decode step (``q == 1``, ``kvbits_fused``), tagged zero-byte placeholders of that shape.
        Device work only, no host read, unless ``checks`` is eager or, once the host's counts are off
        (``host_counts``), an update of ``q > 1`` tokens (a prefill) reads the length once. A first update that fails
        (too many tokens, K/V refused by the checks, position ids past the RoPE tables) leaves the layer unallocated
        (``release``), so a retry may bring another batch, dtype or device.
        """
        if self.is_initialized or torch.compiler.is_compiling():
            return self._update(key_states, value_states, args, kwargs)
        try:
            return self._update(key_states, value_states, args, kwargs)
        except BaseException:
            self.release()
            raise

    def release(self, fixed: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Drop the slabs and the step's state: the layer as made, before its first ``update`` (its installed
        parameters as they were before the slabs, without the defaults added for them; ``fixed``: those instead). For
        a failed first request only: a step captured or traced since would still address the dropped slabs."""
        self._fixed = self._fixed_given if fixed is None else fixed
        self.fused.claimed, self.fused.claimed_by = False, None
        self.key = self.value = self.key_full = self.value_full = None
        self.qlen = self.window_pos = self.lens = self.maxima = self.clipped = self.dtype = self._shape = None
        self.rope = None
        self.length = torch.zeros((), dtype=torch.int64)
        self.tokens_written, self._host_qlen, self._lazy = 0, 0, False
        self.is_initialized = False

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` on allocated slabs."""
        if not self.is_initialized:  # traced: allocated in the trace
            self.lazy_initialization(key_states, value_states)
        compiling = torch.compiler.is_compiling()  # traced once, replayed: the host's count and eager checks stay out
        if compiling or (self.host_counts and not self.graph_bookkeeping and stream_capturing()):
            self.host_counts = False  # its replays run no Python: the host's counts are not the device's from here on
        q = key_states.shape[2]
        if not compiling and not self.host_counts and q > 1:  # replays the host did not count: read the length (a prefill)
            self.tokens_written = int(self.length)
        if not compiling:
            self._check(key_states, value_states)
        if self.rope is not None and not compiling and self.tokens_written == 0:  # a request's first update
            offset = position_offset(args, kwargs, 0, key_states)
            self.rope.start(offset, None if offset is None else repeated_positions(args, kwargs, key_states))
        elif self.rope is not None and not compiling and self.rope.pad_rows is not None:
            if q > 1 or self.host_counts:  # rows that held only pads read their offset again (before the writes): a
                # later prefill chunk, or a first real token alone (a one-token last chunk; a prompt whose only real
                # token ended an all-pads chunk): one host read, only while some row is all pads (StaticRope._write)
                self.rope.reread(*reread_offset(args, kwargs, self.tokens_written, key_states, self.rope.offset,
                                                self.rope.pad_rows))  # fmt: skip
            if q == 1:  # a decode step (perhaps captured, then no host read): nothing read again from here on
                self.rope.pad_rows = None
        if not compiling:
            self.tokens_written += q
        if (self._lazy or compiling) and q:  # three kernels: max |K|, max |V| (NaN kept), the running maximum
            torch.maximum(self.maxima, write_maxima(self._step_max, key_states, value_states), out=self.maxima)
        if self.scheme.is_identity:
            pos = torch.arange(q, device=self.device) + self.length
            self.key_full.index_copy_(2, pos, key_states.to(self.key_full.dtype))
            self.value_full.index_copy_(2, pos, value_states.to(self.value_full.dtype))
            self.length.add_(q)
            self.lens.copy_(self.length.expand(self.lens.shape[0]))
        elif not self.windowed and self.scheme.sinks:  # the host says whether a decode step's token is a sink
            sink = self.tokens_written - 1 < self.scheme.sinks if q == 1 and self.host_counts else None
            self._write_with_sinks(key_states, value_states, sink)
        elif not self.windowed:  # every token quantized as it arrives
            self._write_codes(key_states, value_states, self.length)
            self.length.add_(q)
            self.lens.copy_(self.length.expand(self.lens.shape[0]))
        elif q == 1:
            self._window_step(key_states, value_states, self._host_flush() if self.host_counts else None)
        elif q:
            self._window_many(key_states, value_states)
        if compiling:  # traced: the compiled step attends over the K/V (the fused path runs outside graphs)
            return self.materialize()
        if q > 1:  # an eager prefill: the positions written so far, as get_mask_sizes announced
            keys, values = (t[:, :, : self.tokens_written] for t in self.materialize())
            return fused.tag(self, keys), values
        if q == 1 and self.fused.claimed and fused.serving(self):
            B, H, D = self._shape  # type: ignore[misc]
            keys = torch.empty((B, H, self.max_cache_len, D), dtype=self.dtype, device="meta")
            return fused.tag(self, keys, placeholder=True), torch.empty_like(keys)
        keys, values = self.materialize()
        return fused.tag(self, keys), values

    def _write_codes(
        self, k: torch.Tensor, v: torch.Tensor, slot0: torch.Tensor, final: torch.Tensor | None = None
    ) -> None:
        """Quantize ``(B, H_kv, n, D)`` K/V and write them at slots ``slot0 + arange(n)`` (``slot0`` a 0-dim tensor;
        scale rows ``slot0 / tps + arange(n / tps)``). ``final``: a 0-dim bool, whether these codes are the tokens'
        last (a decode step also writes codes that a later step rewrites: a sink's, a window's block before its flush);
        values saturated against static scales are counted only then (``None``: always)."""
        n = k.shape[2]
        slots = torch.arange(n, device=self.device) + slot0  # the same token slots for keys and values
        for i, (side, slab, x) in enumerate(zip(SIDES, (self.key, self.value), (k, v))):
            if i == 0 and self.rope is not None:  # pre-RoPE keys: un-rotated at the positions these slots hold
                x = self.rope.unrotate(x, slot0)
            static = slab.tps == STATIC_TPS  # the side's static scale: passed in, its row never rewritten
            spec = self._spec(side)
            qt = quantize_pack(x, spec, **self._fixed[side], validate=False, sync=False,
                               zero_scales=self._zero_scales[side])  # fmt: skip
            # values beyond the calibrated range saturate, and so do vLLM's integer zero-points' where a token's range
            # excludes 0 (the clamped zero-point loses its far end): counted on the device, as quantize counts them
            if spec.static or spec.integer_zero:
                self.clipped[i] += qt.clipped if final is None else qt.clipped * final
            new = pack_side([qt])  # Triton on CUDA: one launch
            rows = slots if slab.tps in (1, STATIC_TPS) else torch.arange(n // slab.tps, device=self.device) + slot0 // slab.tps
            for name in _SLOT_FIELDS:
                if getattr(slab, name) is not None and not (static and name in ("scale", "zero")):
                    getattr(slab, name).index_copy_(2, rows if name in ("scale", "zero") else slots, getattr(new, name))

    def _write_with_sinks(self, k: torch.Tensor, v: torch.Tensor, sink: bool | None) -> None:
        """Per-token scheme with sinks: positions ``< sinks`` go to the sink slabs, the others are quantized into slots
        ``position - sinks``. ``sink``: whether a decode step's token is a sink, from the host's counts; the step then
        does only that. ``None`` (the host's counts are not the device's, see ``update``): the step decides on the
        device alone, as a captured step replayed across the last sink must: it writes the sink slot
        ``min(length, sinks - 1)`` (its old value unless ``length < sinks``) and quantizes the token into slot
        ``max(length - sinks, 0)``, which nothing attends while ``length < sinks``. Several tokens at once (a prefill)
        take the length from the host's counts (else read it once, a host sync) and split exactly."""
        S, q = self.scheme.sinks, k.shape[2]
        if q == 1 and sink is not None:
            if sink:
                at = self.length.view(1)
                self.key_full.index_copy_(2, at, k.to(self.key_full.dtype))
                self.value_full.index_copy_(2, at, v.to(self.value_full.dtype))
                self._other_lens.add_(1)
            else:
                self._write_codes(k, v, self.length - S)
                self.lens.add_(1)
            self.length.add_(1)
            return
        if q == 1:
            at = self.length.clamp(max=S - 1).view(1)
            is_sink = self.length < S
            for slab, x in ((self.key_full, k), (self.value_full, v)):
                slab.index_copy_(2, at, torch.where(is_sink, x.to(slab.dtype), slab.index_select(2, at)))
            self._write_codes(k, v, (self.length - S).clamp(min=0), final=~is_sink)
        else:
            L0 = self.tokens_written - q if self.host_counts else int(self.length)
            n = max(0, min(q, S - L0))
            if n:
                at = torch.arange(L0, L0 + n, device=self.device)
                self.key_full.index_copy_(2, at, k[:, :, :n].to(self.key_full.dtype))
                self.value_full.index_copy_(2, at, v[:, :, :n].to(self.value_full.dtype))
            if q > n:
                slot0 = torch.full((), L0 + n - S, dtype=torch.int64, device=self.device)
                self._write_codes(k[:, :, n:], v[:, :, n:], slot0)
        self.length.add_(q)
        B = self.lens.shape[0]
        self.lens.copy_((self.length - S).clamp(min=0).expand(B))
        self._other_lens.copy_(self.length.clamp(max=S).expand(B))

    def _tail_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """The full-precision slots of positions ``pos`` (int64, any shape, ``>= sinks``): the window is a ring of
        ``W = residual + block`` slots after the ``sinks`` sink slots, position ``p`` at ``sinks + (p - sinks) % W``."""
        S, W = self.scheme.sinks, self.scheme.residual + self.scheme.block
        return torch.remainder(pos - S, W) + S if S else torch.remainder(pos, W)

    def _fills_window(self, tokens: int) -> bool:
        """Whether ``tokens`` written fill the window, by the host's count of those quantized (a windowed layer)."""
        return tokens - self.scheme.sinks - self._host_qlen >= self.scheme.residual + self.scheme.block

    def _host_flush(self) -> bool:
        """Whether the token just counted (``tokens_written``) fills the window, from the host's counts (which then
        count the flush): a windowed decode step's flush, decided without reading the device."""
        flush = self._fills_window(self.tokens_written)
        self._host_qlen += self.scheme.block if flush else 0
        return flush

    def next_step_differs(self) -> bool:
        """Whether the next one-token step is not the layer's plain one, by the host's counts: a windowed layer's flush,
        or a sink of a per-token layer (``False`` without the counts: the steps are then the same at every token)."""
        if not self.host_counts or self.scheme.is_identity:  # (before the first update too: it may be a sink)
            return False
        if not self.windowed:
            return self.tokens_written < self.scheme.sinks
        return self._fills_window(self.tokens_written + 1)

    def count_replayed_step(self) -> None:
        """Count on the host one decode step replayed from a captured graph (``GraphedDecode``'s bookkeeping): what
        ``update`` counts for one token. ``ValueError`` past ``max_cache_len`` (before anything is replayed)."""
        self._check_room(1)
        self.tokens_written += 1
        if self.windowed and self.host_counts:
            self._host_flush()

    def host_state(self) -> tuple[int, int]:
        """The host's counts (tokens written, tokens quantized), to be put back by ``restore_host_state``."""
        return self.tokens_written, self._host_qlen

    def restore_host_state(self, state: tuple[int, int]) -> None:
        """Put back counts from ``host_state``: a CUDA capture that failed part-way counted the step on the layers it
        passed, but ran nothing on the device (``kvbits.evaluate.graphs``)."""
        self.tokens_written, self._host_qlen = state

    def _window_step(self, k: torch.Tensor, v: torch.Tensor, flush: bool | None) -> None:
        """One token through the window, on the device alone (what a captured step replays).

        The token goes to its full-precision slot: sink slot ``length`` while ``length < sinks``, else window slot
        ``_tail_slots(length)``. When the window then holds ``W`` tokens (the flush), its oldest ``block`` tokens,
        positions ``sinks + qlen + arange(block)``, are quantized and written at quantized slots ``qlen`` on, and
        ``qlen`` advances by ``block``. ``flush``: whether this step flushes, decided by the host (``_host_flush``); the
        step then quantizes only when it does. ``None`` (the host's counts are not the device's: a traced or captured
        step whose replays run no Python): the block is quantized and written at every step, where nothing attends
        before the flush, which rewrites it, and ``qlen`` advances by a device ``where``."""
        S, W, blk = self.scheme.sinks, self.scheme.residual + self.scheme.block, self.scheme.block
        if S:
            slot = torch.where(self.length < S, self.length, self._tail_slots(self.length.clamp(min=S))).view(1)
        else:
            slot = self._tail_slots(self.length).view(1)
        self.key_full.index_copy_(2, slot, k)
        self.value_full.index_copy_(2, slot, v)
        self.window_pos.index_copy_(0, slot, self.length.view(1))
        self.length.add_(1)
        if flush is False:
            return
        oldest = self._tail_slots(torch.arange(blk, device=self.device) + self.qlen + S)
        if self.key_full.shape[2] < S + blk:  # a window cut to max_cache_len, never flushed: the block is never final
            oldest = oldest.clamp(max=self.key_full.shape[2] - 1)
        block_k, block_v = self.key_full.index_select(2, oldest), self.value_full.index_select(2, oldest)
        if flush:
            self._write_codes(block_k, block_v, self.qlen)
            self.qlen.add_(blk)
        else:
            full = self.length - self.qlen >= W + S
            self._write_codes(block_k, block_v, self.qlen, final=full)
            self.qlen.add_(full.to(torch.int64) * blk)
        self.lens.copy_(self.qlen.expand(self.lens.shape[0]))

    def _window_many(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """``q > 1`` tokens (a prefill): the first ``sinks`` positions to the sink slots, then whole blocks flushed, the
        rest kept in the window. The lengths come from the host's counts, else are read once (a host sync)."""
        S, blk, R, q = self.scheme.sinks, self.scheme.block, self.scheme.residual, k.shape[2]
        if self.host_counts:  # tokens_written already counts these q
            L0, Q0 = self.tokens_written - q, self._host_qlen
        else:
            L0, Q0 = int(self.length), int(self.qlen)
        n_sinks = max(0, min(q, S - L0))
        if n_sinks:
            at = torch.arange(L0, L0 + n_sinks, device=self.device)
            self.key_full.index_copy_(2, at, k[:, :, :n_sinks])
            self.value_full.index_copy_(2, at, v[:, :, :n_sinks])
            self.window_pos.index_copy_(0, at, at)
            k, v = k[:, :, n_sinks:], v[:, :, n_sinks:]
        held = self._tail_slots(torch.arange(S + Q0, max(L0, S + Q0), device=self.device))
        ks = torch.cat([self.key_full.index_select(2, held), k], dim=2)  # positions S + Q0 .. L0 + q - 1
        vs = torch.cat([self.value_full.index_select(2, held), v], dim=2)
        n = max(0, (ks.shape[2] - R) // blk) * blk
        if n:
            self._write_codes(ks[:, :, :n], vs[:, :, :n], self.qlen)
        pos = torch.arange(S + Q0 + n, max(L0 + q, S + Q0 + n), device=self.device)  # none: the prompt filled sinks only
        slots = self._tail_slots(pos)
        self.key_full.index_copy_(2, slots, ks[:, :, n:])
        self.value_full.index_copy_(2, slots, vs[:, :, n:])
        self.window_pos.index_copy_(0, slots, pos)
        self.length.fill_(L0 + q)
        self.qlen.fill_(Q0 + n)
        self._host_qlen = Q0 + n
        self.lens.copy_(self.qlen.expand(self.lens.shape[0]))

    # ------------------------------------------------------------------ reading
    def _in_window(self) -> torch.Tensor:
        """``(sinks + W,)`` bool: the full-precision slots attended: sinks written, and window slots holding tokens not
        yet quantized (positions in ``[sinks + qlen, length)``)."""
        S, pos = self.scheme.sinks, self.window_pos
        window = (pos >= (self.qlen + S if S else self.qlen)) & (pos < self.length)
        return window | ((pos >= 0) & (pos < S)) if S else window

    def materialize(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position, dequantized: K and V ``(B, H_kv, max_cache_len, D)`` in the K/V dtype (positions not
        written yet hold zeros or stale values; the attention mask hides them)."""
        if self.scheme.is_identity:
            return self.key_full.to(self.dtype), self.value_full.to(self.dtype)
        keys, values = dequantize_packed(self.key, self.dtype), dequantize_packed(self.value, self.dtype)
        if self.rope is not None:
            keys = self.rope.rotate(keys)
        if not self.windowed and self.scheme.sinks:  # positions 0 .. sinks - 1, then the quantized slots
            return (torch.cat((self.key_full.to(self.dtype), keys), 2),
                    torch.cat((self.value_full.to(self.dtype), values), 2))  # fmt: skip
        if not self.windowed:
            return keys, values
        T, S = self.max_cache_len, self.scheme.sinks
        n = min(T - S, keys.shape[2])  # quantized slot i holds position S + i
        at = torch.where(self._in_window(), self.window_pos, T)  # sinks and window at their positions; the rest: T
        out = []
        for dense_q, window in ((keys, self.key_full), (values, self.value_full)):  # one copy, zeros past the slots
            zeros = dense_q.new_zeros((*dense_q.shape[:2], T + 1 - n, dense_q.shape[3]))
            dense = torch.cat((zeros[:, :, :S], dense_q[:, :, :n], zeros[:, :, S:]), 2)
            dense.index_copy_(2, at, window.to(dense.dtype))
            out.append(dense[:, :, :T])
        return out[0], out[1]

    def fused_store(self, keep: torch.Tensor | None = None) -> PackedStore:
        """The slabs as the decode kernels read them, sized for ``max_cache_len`` whatever the length: the quantized
        slots with each sequence's length from the device (``lens``), and a windowed layer's window as the tail, its
        slots masked unless they hold tokens not yet quantized. ``keep`` ``(B, max_cache_len)`` bool (``False``: left
        padding) masks positions."""
        if self.scheme.is_identity:  # the tail's mask is read a byte at a time, in rows of max_cache_len
            mask = None if keep is None else keep.contiguous()
            return PackedStore(None, None, self.key_full, self.value_full, self._other_lens, self.lens, full_mask=mask)
        rope = {} if self.rope is None else {"rope_cos": self.rope.cos, "rope_sin": self.rope.sin,
                                             "quant_pos0": self.rope.pos0()}  # fmt: skip
        if not self.windowed and self.scheme.sinks:  # the sinks as the full-precision tail
            S = self.scheme.sinks
            qm = None if keep is None else word_rows(keep[:, S:], self.key.n_slots)
            fm = None if keep is None else keep[:, :S].contiguous()
            return PackedStore(self.key, self.value, self.key_full, self.value_full, self.lens, self._other_lens,
                               quant_mask=qm, full_mask=fm, **rope)  # fmt: skip
        if not self.windowed:
            mask = None if keep is None else word_rows(keep)
            return PackedStore(self.key, self.value, None, None, self.lens, self._other_lens, quant_mask=mask, **rope)
        B = self.lens.shape[0]
        in_window = self._in_window().expand(B, -1)
        quant_mask = None
        if keep is not None:
            S = self.scheme.sinks
            quant_mask = word_rows(keep[:, S : S + self.key.n_slots], self.key.n_slots)
            at = self.window_pos.clamp(0, keep.shape[1] - 1).expand(B, -1)
            in_window = in_window & keep.gather(1, at)
        return PackedStore(self.key, self.value, self.key_full, self.value_full, self.lens, self._other_lens,
                           quant_mask=quant_mask, full_mask=in_window.contiguous(), **rope)  # fmt: skip

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens written, as the device tensor (``StaticLayer`` does the same: no host read)."""
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: Any = None, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask transformers builds: ``(max_cache_len, 0)`` for a decode step (every
        slot, the same at every step), and for an eager update of several tokens (a prefill) ``(tokens so far + q,
        0)``, the K/V ``update`` then returns: a prompt on an empty cache needs no mask at all (causal SDPA), where
        ``(B, 1, q, max_cache_len)`` booleans would be 8.6 GB at batch 8 and 32K."""
        q = query_length if isinstance(query_length, int) else None
        if q is not None and q > 1 and not torch.compiler.is_compiling():  # without the host's counts: read (a sync)
            return (self.tokens_written if self.host_counts or not self.is_initialized else int(self.length)) + q, 0
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers before 5.16's name
        return self.max_cache_len

    @property
    def reads_positions(self) -> bool:
        """Whether the next update reads the model's position ids (pre-RoPE keys): a request's first, or a chunked
        prefill's later chunk while some row held only pads (``StaticRope.pad_rows``). The cache adds tracked ids
        to those updates."""
        return self.rotary is not None and (
            self.tokens_written == 0 or (self.rope is not None and self.rope.pad_rows is not None)
        )

    def quantized_tokens(self, length: int | None = None) -> int:
        """Tokens of each sequence held quantized now (one host read): the flushed blocks of a windowed layer, else
        every token past the sinks; 0 before the first update and for a float layer. ``length``: ``self.length``
        already read back by the caller (``calibration_report``), not read again."""
        if not self.is_initialized or self.scheme.is_identity:
            return 0
        if self.windowed:
            return int(self.qlen)
        return max(0, (int(self.length) if length is None else length) - self.scheme.sinks)

    def state_tensors(self) -> list[torch.Tensor]:
        """The counters, lengths, window positions and check maxima: the step's state, not K/V."""
        ts = (self.length, self.qlen, self.lens, self._other_lens, self.window_pos, self.maxima, self._step_max,
              self.clipped, None if self.rope is None else self.rope.offset)
        return [t for t in ts if t is not None]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``quantized`` (codes, scales, zero-points, outliers of every slot; a static scale in the kernels'
        layout, once per sequence: its row), ``full`` (float slabs, a windowed layer's window) and ``fixed`` (the
        calibrated parameters as installed, and any copy the slabs keep of a codebook or channel vectors: the plan's
        ``fixed``), each storage counted once."""
        seen: set[int] = set()

        def count(ts: Any) -> int:
            n = 0
            for t in ts:
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    n += t.nbytes
            return n

        slabs = [p for p in (self.key, self.value) if p is not None]
        quantized = count(getattr(p, name) for p in slabs for name in _SLOT_FIELDS)
        full = count((self.key_full, self.value_full))
        fixed = count(t for side in SIDES for t in self._fixed[side].values())
        fixed += count(getattr(p, name) for p in slabs for name in ("codebook", "channel_mean", "channel_factor"))
        return {"quantized": quantized, "full": full, "fixed": fixed}

    @property
    def checks_to_read(self) -> bool:
        """Whether ``maxima`` holds lazy K/V checks to read: a lazy layer's, or, once a step was traced
        (``torch.compile``) or captured since the slabs were made (``host_counts`` off), an eager one's (those steps'
        checks are lazy whatever the mode, ``update``)."""
        return self.is_initialized and (self._lazy or not self.host_counts)

    def check_failure(self, k: float, v: float) -> str | None:
        """The error for the running maxima ``max |K|``, ``max |V|`` read back from ``maxima`` (host floats), or
        ``None``: NaN / inf, or ``|x|`` past a side's bound (``fmt_x``: the dynamic cache's digits)."""
        for what, m, bound in (("keys", k, self._bounds[0]), ("values", v, self._bounds[1])):
            if not math.isfinite(m) or m > bound:
                held = f"|x| up to {fmt_x(m)}" if math.isfinite(m) else "NaN or inf"
                return (f"layer {self.layer_idx}: {what} written to the cache held {held} (bound {fmt_x(bound)}): they "
                        "were stored as unusable codes; reset() the cache")  # fmt: skip
        return None

    def read_checks(self) -> None:
        """Read the lazy K/V checks (one host sync, when ``checks_to_read``); ``ValueError`` naming the side."""
        if self.checks_to_read and (error := self.check_failure(*self.maxima.tolist())) is not None:
            raise ValueError(error)

    def reset(self) -> None:
        """Back to no tokens, in place (the slabs keep their addresses, so a captured graph stays valid). The host's
        counts restart too, but stay unused once a step was traced or captured without bookkeeping
        (``host_counts``): that graph's replays, which the host does not see, may go on after the reset.

        Lazy checks still unread (``checks_to_read``) are read first, one host sync, and bad K/V they find are logged
        (WARNING) instead of being zeroed unseen, as ``StaticQuantizedKVCache.reset()`` does for all layers at once
        (it reads them together and marks them read, so they are neither read nor logged again here); ``reset()``
        never raises for them."""
        seen, self._checks_seen = self._checks_seen, False
        if not seen and self.checks_to_read and (error := self.check_failure(*self.maxima.tolist())) is not None:
            logger.warning("StaticQuantizedLayer.reset(): the pending lazy K/V check failed: %s. The layer is emptied "
                           "now; the outputs of the request just reset were computed from these K/V", error)  # fmt: skip
        self.tokens_written, self._host_qlen = 0, 0
        self.length.zero_()
        # a new request asks again at its first call, also a one-token prompt's (claim holds a decline for q == 1)
        self.fused.claimed, self.fused.claimed_by, self.fused.declined = False, None, None
        if not self.is_initialized:
            return
        self.lens.zero_()
        if not self.windowed and not self.scheme.is_identity and self.scheme.sinks:  # the sinks written (a window's: fixed)
            self._other_lens.zero_()
        self.qlen.zero_()
        self.clipped.zero_()
        self.maxima.zero_()
        if self.rope is not None:
            self.rope.offset.zero_()
            self.rope.pad_rows = None
        if self.window_pos is not None:
            self.window_pos.fill_(-1)
        for p in (self.key, self.value):
            if p is not None:
                for name in _SLOT_FIELDS:
                    if name in ("scale", "zero") and p.tps == STATIC_TPS:
                        continue  # the calibrated (or FP8's default) static row, not slot data: written once
                    if getattr(p, name) is not None:
                        getattr(p, name).zero_()
        for t in (self.key_full, self.value_full):
            if t is not None:
                t.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``b`` takes what sequence ``beam_idx[b]`` holds (``beam_idx`` ``(B,)`` int64 or int32,
        the cached batch, on any device; ``ValueError`` / ``TypeError`` for another shape or dtype, and ``ValueError``
        for an index outside ``[0, B)`` held on the CPU, where reading it costs no device sync), gathered and copied back in place: codes, scales, zero-points, outliers, float slabs, the
        window, lengths and pre-RoPE position offsets; the slabs keep their addresses. Device work only (no host
        read); a no-op before the first update. It raised ``NotImplementedError`` after the beams' prefill."""
        if not self.is_initialized:
            return
        B = self._shape[0]  # type: ignore[index]
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dim() != 1 or beam_idx.shape[0] != B:
            got = tuple(beam_idx.shape) if isinstance(beam_idx, torch.Tensor) else type(beam_idx).__name__
            raise ValueError(f"layer {self.layer_idx}: beam_idx must be ({B},), one index per cached sequence, got {got}")
        if beam_idx.dtype not in BEAM_IDX_DTYPES:  # host metadata: index_select said only "Expected dtype int32 or int64"
            raise TypeError(f"layer {self.layer_idx}: beam_idx must hold integer batch indices (torch.long), got dtype "
                            f"{beam_idx.dtype}")  # fmt: skip
        if beam_idx.device.type == "cpu":  # on the host already: the range check reads no device
            # (index_select said only "index out of range in self"; a CUDA index is left to its device-side assert)
            check_beam_idx(beam_idx, B, f"layer {self.layer_idx} reorder_cache")
        idx = beam_idx.to(self.device)  # an index on another device is copied over
        for t in self._per_sequence():
            t.copy_(t.index_select(0, idx))
        if self.rope is not None and self.rope.pad_rows is not None:  # between prefill chunks: not a slab, replaced
            self.rope.pad_rows = self.rope.pad_rows.index_select(0, idx)

    def _per_sequence(self) -> list[torch.Tensor]:
        """The tensors with a row per sequence (dim 0): slot data, float slabs, lengths, pre-RoPE offsets."""
        ts = [getattr(p, name) for p in (self.key, self.value) if p is not None for name in _SLOT_FIELDS]
        ts += [self.key_full, self.value_full, self.lens, self._other_lens, None if self.rope is None else self.rope.offset]
        return [t for t in ts if t is not None]

    def offload(self) -> None:
        """Refused: ``NotImplementedError`` (``QuantizedKVLayer.offload``'s message). transformers' layer offloading
        moves ``keys`` / ``values``, which this layer does not have (its slabs are ``key`` / ``value`` and
        ``key_full`` / ``value_full``, at addresses a captured step reads); it raised ``AttributeError: 'NoneType'
        object has no attribute 'to'`` here. Nothing is moved."""
        raise NotImplementedError(_offload_refusal(f"layer {self.layer_idx}", self.scheme.is_identity))

    def prefetch(self) -> None:
        """Refused as ``offload`` (``NotImplementedError``): a ``StaticQuantizedLayer`` is never offloaded."""
        raise NotImplementedError(_offload_refusal(f"layer {self.layer_idx}", self.scheme.is_identity))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``NotImplementedError`` once the slabs exist (a no-op before, as ``DynamicLayer``'s on an empty cache)."""
        if self.is_initialized and repeats != 1:
            raise NotImplementedError(_FIXED_BATCH.format(self.batch_size, f"batch_repeat_interleave({repeats})"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """``NotImplementedError`` once the slabs exist (a no-op before, as ``DynamicLayer``'s on an empty cache)."""
        if self.is_initialized:
            raise NotImplementedError(_FIXED_BATCH.format(self.batch_size, "batch_select_indices"))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "StaticQuantizedKVCache cannot be cropped (its slabs keep no rollback, so assisted and prompt-lookup "
            "decoding are refused); QuantizedKVCache crops the tokens it still holds in full precision (all of them "
            "with an fp16 / bf16 scheme, which assisted decoding runs through)"
        )


class StaticQuantizedKVCache(Cache):
    """A transformers ``Cache`` of fixed quantized slabs that a CUDA graph can replay (see the module docstring).

    A scheme's sinks are its first ``scheme.sinks`` slots of every row, fixed with the slabs: a left-padded row's
    sinks hold its pads and its first real tokens are quantized, which a WARNING says once per cache
    (``QuantizedKVCache`` widens a left-padded request's sinks instead, ``QuantizedKVLayer.widen_sinks``).

    Args:
        config: the model's config: its layers and their count (full attention; a hybrid model's ``conv`` /
            ``linear_attention`` states in transformers' ``LinearAttentionLayer`` and its ``hybrid`` layers as
            ``kvbits.cache.static_state.StaticQuantizedHybridLayer``, the states unquantized).
        scheme: a per-token or windowed (KIVI-style) scheme (``static_reason``): preset name, dict, path or
            ``KVScheme``; mixed schemes may keep whole layers in float (``"int4-token,0=fp16"``).
        max_cache_len: slots per sequence (prompt + generated tokens), reserved at each layer's first ``update``.
        num_layers: layer count without a config.
        fused_decode: as ``QuantizedKVCache``'s (``"auto"``: the fused kernel on CUDA with Triton, when the model's
            attention is ``kvbits_fused``).
        checks: ``"auto"`` (eager on CPU, lazy elsewhere), ``"eager"`` (a host sync per update: not for captured
            steps) or ``"lazy"`` (read by ``check_inputs()`` and ``memory_report()``).
        calibration: a ``kvbits.calibrate`` artifact or the folder it wrote, for static FP8 scales (default 1.0,
            vLLM's); ``set_static_qparams`` installs one layer's by hand.
        rotary: RoPE tables for pre-RoPE key schemes (``RotaryTables.from_model(model)``); default: built from
            ``config`` on the K/V device (``kvbits.cache.static_rope``).
    """

    def __init__(
        self, config: Any = None, scheme: str | dict | KVScheme = "int8-token", *, max_cache_len: int,
        num_layers: int | None = None, fused_decode: bool | str = "auto", checks: str = "auto", calibration: Any = None,
        rotary: Any = None,
    ) -> None:  # fmt: skip
        from kvbits.cache.cache import (
            _STATE_TYPES,
            _head_repeat,
            _layer_types,
            _state_layer,
            attention_shape,
            rotary_for,
        )
        from kvbits.cache.hybrid import HYBRID_TYPES
        from kvbits.cache.layer import check_max_cache_len
        from kvbits.plan.config import layer_heads, text_config

        self.scheme = get_scheme(scheme)
        self._config = config
        if check_max_cache_len(max_cache_len) is None:
            raise ValueError("max_cache_len is required: the slabs are reserved for it")
        self._max_len = max_cache_len
        self.fused_decode = fused.check_mode(fused_decode)
        # per layer, as the planner counts the heads (a DeciLM block's own; none checked for a block without KV)
        heads: list[dict[str, Any]] = []
        types: list[str] = []  # per layer, with config=: full_attention, or a state layer's type (static_layer_types)
        type_kwargs: list[dict] = []
        if config is not None:
            n_layers = attention_shape(config)[0]
            for i in range(n_layers):
                q, kv, d = layer_heads(config, i)
                heads.append({"num_key_value_heads": kv, "head_dim": d,
                              "head_repeat": _head_repeat(text_config(config), q, kv)} if kv else {})  # fmt: skip
            types, type_kwargs = _layer_types(text_config(config), n_layers)
            held = static_layer_types()
            if any(t not in held for t in types):
                raise NotImplementedError(layer_types_refusal(types))
            if num_layers is not None and num_layers != n_layers:
                raise ValueError(f"num_layers={num_layers} but the config describes {n_layers} layers")
            num_layers = n_layers
        if num_layers is None or isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"give config= or a positive num_layers, got num_layers={num_layers!r}")
        self.scheme.check_layer_count(num_layers, "the cache's")
        types = types or ["full_attention"] * num_layers
        type_kwargs = type_kwargs or [{} for _ in types]
        for i in (i for i, t in enumerate(types) if t not in _STATE_TYPES):  # before the RoPE tables are asked for
            if (why := static_reason(self.scheme.for_layer(i))) is not None:
                raise ValueError(f"layer {i}: scheme {self.scheme.name!r} cannot be stored in fixed slabs: {why}; "
                                 "QuantizedKVCache (with max_cache_len=) serves it")  # fmt: skip
        self._rotary, self._rotary_owned = rotary_for(self.scheme, config, rotary)
        self._rope_tables = fused.RopeTableCache()
        self.position_ids_hint: torch.Tensor | None = None  # set by kvbits.cache.track_positions (transformers 5.17)
        self._told_padded_sinks = False  # the padded-sinks warning (kvbits.cache.layer.padded_sink_rows), once
        self._told_no_positions = False  # the no-position-ids INFO (kvbits.cache.layer.no_positions_message), once
        layers = []
        for i, (t, kw) in enumerate(zip(types, type_kwargs)):
            if t in _STATE_TYPES:  # no attention: transformers' LinearAttentionLayer, as its StaticCache holds it
                layers.append(_state_layer(i, t, kw))
                continue
            cls, extra = StaticQuantizedLayer, {}
            if t in HYBRID_TYPES:  # attention plus a Mamba state (kvbits.cache.static_state)
                from kvbits.cache.static_state import StaticQuantizedHybridLayer

                cls, extra = StaticQuantizedHybridLayer, {"number_of_states": kw.get("number_of_states", 1)}
            layers.append(cls(self.scheme.for_layer(i), max_cache_len, i, fused_decode=self.fused_decode,
                              checks=checks, **(heads[i] if heads else {}), rope_tables=self._rope_tables,
                              rotary=None if self._rotary is None else self._rotary.tables_for_layer(i), **extra))  # fmt: skip
        super().__init__(layers=layers)
        # the layers holding K/V (StaticQuantizedLayer, hybrid ones too): what every cache-wide K/V method walks
        self.kv_layers: list[StaticQuantizedLayer] = [x for x in layers if isinstance(x, StaticQuantizedLayer)]
        self._fresh: list[bool] = []  # per layer, whether the current request allocated its slabs (_undo_request)
        self._checks_raised = False  # check_inputs raised for the K/V held now (reset does not log it again)
        self.calibration: Any = None  # the installed artifact (install_calibration)
        if calibration is not None:
            self.install_calibration(calibration)

    def __repr__(self) -> str:
        return f"StaticQuantizedKVCache(scheme={self.scheme.name!r}, layers={len(self.layers)}, max_cache_len={self._max_len})"

    @property
    def max_cache_len(self) -> int:
        return self._max_len

    def _look_for_padded_sinks(self, key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Warn, once per cache, when a request's first update ``key_states`` ``(B, H_kv, q, D)`` brings left-padded
        rows to a scheme that keeps sinks: their sink slots hold pads (``padded_sink_rows``; one host read at the
        request's first layer, none after the warning)."""
        if self._told_padded_sinks:
            return
        sinks = max((layer.scheme.sinks for layer in self.kv_layers if not layer.scheme.is_identity), default=0)
        if not sinks or key_states.shape[0] < 2:  # sinks first: key_states is not checked yet (the layer's update is)
            return
        rows = padded_sink_rows(args, kwargs, key_states, sinks, self.position_ids_hint)
        if rows:
            self._told_padded_sinks = True
            logger.warning(padded_sinks_message(self.scheme.name, sinks, rows, key_states.shape[0]))

    @property
    def batch_size(self) -> int:
        """Sequences the slabs hold, ``-1`` before the first update (transformers' ``Cache.batch_size``, as
        ``StaticCache``'s; it gave -1 after updates too)."""
        return cache_batch_size(self.kv_layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V ``(B, H_kv, q, D)`` of layer ``layer_idx`` (``StaticQuantizedLayer.update``). A pre-RoPE layer's
        first update of a request also gets the RoPE tables made on the K/V device (as the model computes them), and
        each update that reads positions (``StaticQuantizedLayer.reads_positions``) the ``position_ids``
        ``track_positions`` saw, when transformers passed none. ``ValueError`` for a ``layer_idx``
        that is not one of the cache's layers (a config of fewer layers than the model). A request's first update that
        fails leaves the cache as before the request (``_undo_request``): a retry needs no ``reset()``, and may bring
        another batch, dtype or device if the slabs were made for the failed one. A forward that failed after its K/V
        updates (a later layer's kernel) is refused at the next forward's first layer (``_check_complete``)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"layer_idx must be an int in [0, {len(self.layers)}): this cache has {len(self.layers)} layers "
                f"(made from a config of fewer layers than the model?), got {layer_idx!r}"
            )
        layer = self.layers[layer_idx]
        if not isinstance(layer, StaticQuantizedLayer):  # a layer_idx of the wrong layer
            raise ValueError(  # noqa: TRY004 - a bad index, as the range check above
                f"layer {layer_idx} keeps a convolution / linear-attention state and no K/V (its config type is not "
                f"an attention one): update() takes the K/V of attention layers {[x.layer_idx for x in self.kv_layers]}"
            )
        compiling = torch.compiler.is_compiling()
        if self._rotary is not None and not compiling:
            if layer.rotary is not None and layer.tokens_written == 0:
                self._rotary_on(key_states.device)
            hint = self.position_ids_hint
            if layer.reads_positions and find_position_ids(args, kwargs) is None:
                if hint is not None:
                    kwargs = {**kwargs, "position_ids": hint}
                elif layer.tokens_written == 0 and key_states.shape[0] > 1 and not self._told_no_positions:
                    self._told_no_positions = True  # as QuantizedKVCache: offsets 0, said once per cache
                    logger.info(no_positions_message("StaticQuantizedKVCache", key_states.shape[0]))
        if not compiling and layer is self.kv_layers[0]:  # a forward's first K/V layer: the last one ended the
            self._check_complete(layer)  # previous forward (traced: nothing read, no guard on counts)
        if layer.tokens_written or not layer.host_counts or compiling:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        # a request's first update of this layer: if it fails, the request's other layers are undone too
        if not any(other.tokens_written for other in self.kv_layers):  # the request's first layer
            self._fresh = [not other.is_initialized for other in self.kv_layers]
            self._look_for_padded_sinks(key_states, args, kwargs)
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self._undo_request()
            raise

    def _check_complete(self, first: StaticQuantizedLayer) -> None:
        """``ValueError`` when a forward starts (``first``: the first K/V layer) on a cache whose last forward stopped
        midway: an exception after some K/V layers were written (a hybrid model's Mamba or convolution kernel, a later
        layer's module) left its first K/V layer holding more tokens than its last. ``_undo_request`` undoes failures
        in the K/V updates only; a retry appended to the written layers (and to the states) or failed deep in the
        model (``The size of tensor a (12) must match the size of tensor b (24)``). Host ints only, no sync; not
        seen: a failure after the last K/V layer (its states only). Not called while traced (``update``): reading the
        counts there would guard the graph on them and recompile it once they stop counting."""
        last = self.kv_layers[-1]
        if first is last or not (first.host_counts and last.host_counts):
            return
        if first.tokens_written != last.tokens_written:
            counts = {x.layer_idx: x.tokens_written for x in self.kv_layers}
            raise ValueError(
                f"StaticQuantizedKVCache holds an incomplete forward: its K/V layers hold {counts} tokens (layer: "
                "tokens), expected the same count in every layer, so the previous forward failed after writing some "
                "layers; call cache.reset() (or make a new cache) and run the request again"
            )

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Refused: ``NotImplementedError``, as ``offload(layer_idx)`` (``StaticQuantizedLayer.offload``): this cache
        never offloads, so transformers' prefetch (which needs the ``offloading=True`` stream) has nothing to bring
        back; it raised ``AttributeError`` (no ``prefetch_stream``) here."""
        known = isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers)
        layer = self.layers[layer_idx] if known else None
        raise NotImplementedError(_offload_refusal(f"prefetch({layer_idx})", isinstance(layer, StaticQuantizedLayer)
                                                   and layer.scheme.is_identity))  # fmt: skip

    def _no_state(self, call: str, layer_idx: int) -> NotImplementedError:
        """The model asked layer ``layer_idx`` for a convolution / recurrent state (a hybrid model: LFM2, Qwen3-Next,
        Zamba, Falcon-H1, ...) of a cache made without ``config=``, whose layers hold attention K/V only;
        transformers raised ``ValueError: Cannot get conv state for non linear attention layer 0 of type
        StaticQuantizedLayer`` deep in the model's forward, naming no cache that holds the model."""
        return NotImplementedError(
            f"{call}(layer {layer_idx}): the model keeps a convolution / recurrent state in this layer (a hybrid "
            "model), which this StaticQuantizedKVCache does not hold: made without config=, its layers hold "
            "full-attention K/V only; StaticQuantizedKVCache(config=model.config, ...) or "
            "QuantizedKVCache(config=model.config) holds the states beside the quantized K/V, transformers' "
            "StaticCache(config=model.config) holds the model unquantized"
        )

    def _state_holder(self, call: str, layer_idx: int, state_idx: int = 0, new: Any = None) -> None:
        """``_no_state`` unless layer ``layer_idx`` holds a state (a ``LinearAttentionLayer`` or a hybrid layer);
        for an update, ``ValueError`` when ``new`` (a conv state ``(B, ...)``, or a recurrent one or a list of them)
        brings another batch than the state held since the cache's first request (a ``reset()`` keeps it, as it
        keeps the K/V slabs): transformers' in-place ``copy_`` raised a bare ``RuntimeError`` (``The size of tensor a
        (2) must match the size of tensor b (3)``) from the model's conv layer. Host metadata only, no sync."""
        from kvbits.cache.cache import _holds_state

        if not (isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers)):
            return
        layer = self.layers[layer_idx]
        if not _holds_state(layer):
            raise self._no_state(call, layer_idx)
        if new is None:
            return
        held = (layer.conv_states if call == "update_conv_state" else layer.recurrent_states).get(state_idx)
        x = new if isinstance(new, torch.Tensor) else new[-1] if isinstance(new, (list, tuple)) and new else None
        if isinstance(held, torch.Tensor) and isinstance(x, torch.Tensor) and x.dim() and x.shape[0] != held.shape[0]:
            raise ValueError(f"{call}(layer {layer_idx}): a state of {x.shape[0]} sequences: "
                             + _FIXED_BATCH.format(held.shape[0], f"take {x.shape[0]} sequences"))  # fmt: skip

    # transformers' linear-attention calls: the state layers' (transformers' Cache), else refused (``_no_state``)
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._state_holder("get_conv_state", layer_idx)
        return super().get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        self._state_holder("update_conv_state", layer_idx, state_idx, conv_states)
        return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._state_holder("get_recurrent_state", layer_idx)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        self._state_holder("update_recurrent_state", layer_idx, state_idx, recurrent_states)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """transformers 5.17's models ask this first (5.25's ask ``get_conv_state``): refused as the others for a
        layer that holds no state (``_no_state``), where transformers raised a bare ``ValueError``."""
        if layer_idx is not None:
            self._state_holder("has_previous_state", layer_idx)
        return super().has_previous_state(layer_idx, state_idx)

    def _undo_request(self) -> None:
        """A request's first update of a layer failed: the layers it wrote go back to before the request (those it
        allocated are released, so a retry may bring another batch, dtype or device; the others reset in place). A
        hybrid model's states, written by the request's layers before the failing one, are undone too
        (``static_state.reset_states``: remade on the cache's first request, else reset)."""
        from kvbits.cache.cache import _is_state_layer
        from kvbits.cache.static_state import StaticQuantizedHybridLayer, reset_states

        fresh = self._fresh or [False] * len(self.kv_layers)
        for was_fresh, layer in zip(fresh, self.kv_layers):
            if was_fresh and layer.is_initialized:
                layer.release()
            elif layer.tokens_written:
                StaticQuantizedLayer.reset(layer)
        first = all(fresh)  # the cache's first request: no slab was made before it
        for i, layer in enumerate(self.layers):
            if _is_state_layer(layer):
                self.layers[i] = reset_states(layer, first)
            elif isinstance(layer, StaticQuantizedHybridLayer):
                layer.linear = reset_states(layer.linear, first)

    def _rotary_on(self, device: torch.device) -> None:
        """Tables built from the config are remade on the K/V device before any layer allocates its own."""
        if not self._rotary_owned or self._rotary.device == device or any(layer.rope is not None for layer in self.kv_layers):
            return
        from kvbits.quant.rope import RotaryTables

        self._rotary = RotaryTables.from_config(self._config, device=device)
        for layer in self.kv_layers:
            if layer.rotary is not None:
                layer.rotary = self._rotary.tables_for_layer(layer.layer_idx)

    def step_variant(self) -> tuple[int, ...]:
        """The layers whose next one-token decode step is not their plain one (a flush, a sink), by the host's counts:
        ``()`` at most steps. ``GraphedDecode`` captures one step per variant and replays the one called for."""
        return tuple(layer.layer_idx for layer in self.kv_layers if layer.next_step_differs())

    def count_replayed_step(self) -> None:
        """Count on every layer's host a decode step replayed from a captured graph (``GraphedDecode``);
        ``ValueError`` if it would pass ``max_cache_len`` (nothing counted)."""
        for layer in self.kv_layers:  # every layer holds as many tokens: the first refuses before any counts
            layer.count_replayed_step()

    def _check_failures(self) -> list[str]:
        """Read every layer's lazy K/V checks together (one host sync per device, none when no layer has any to read:
        ``checks_to_read``): the errors of the layers that failed, in layer order."""
        layers = [layer for layer in self.kv_layers if layer.checks_to_read]
        maxima = _host_maxima([layer.maxima for layer in layers]) if layers else []
        return [e for layer, m in zip(layers, maxima) if (e := layer.check_failure(*m)) is not None]

    def check_inputs(self) -> None:
        """Read every layer's lazy K/V checks (a host sync); ``ValueError`` for NaN, inf or ``|x|`` past a bound,
        naming the first failed layer (and the others)."""
        errors = self._check_failures()
        if errors:
            self._checks_raised = True  # seen by the caller: reset() does not log it again
            more = ", ".join(e.split(":", 1)[0].removeprefix("layer ") for e in errors[1:])
            raise ValueError(errors[0] + (f" [also failed: layers {more}]" if more else ""))

    def reset(self) -> None:
        """Back to no tokens in every layer, in place (``StaticQuantizedLayer.reset``: the slabs and check maxima keep
        their addresses for captured steps). Lazy checks still unread (a request's last steps) are read first, one
        host sync per device: bad K/V they find are logged (WARNING, naming the layers) instead of being zeroed
        unseen, as ``QuantizedKVCache.reset()`` does; ``reset()`` itself never raises for them, and does not repeat
        a failure ``check_inputs()`` (or a report) already raised."""
        errors = [] if self._checks_raised else self._check_failures()
        if errors:
            logger.warning("StaticQuantizedKVCache.reset(): the pending lazy K/V check failed: %s. The cache is emptied "
                           "now; the outputs of the request just reset were computed from these K/V",
                           "; ".join(errors))  # fmt: skip
        self._checks_raised = False
        for layer in self.kv_layers:  # read above (or raised by check_inputs): the layers' reset does not read again
            layer._checks_seen = True
        super().reset()

    def memory_report(self) -> dict[str, Any]:
        """Bytes of the slabs (every reserved slot: what ``kvbits.plan`` counts at ``max_cache_len``, see the module
        docstring for what a windowed scheme and static FP8 scales add), by kind, after the lazy checks.
        ``state_bytes``: the counters, lengths, window positions, check maxima, clip counts and pre-RoPE position
        offsets (and, between a chunked prefill's chunks, a bool per sequence: ``StaticRope.pad_rows``), reported apart
        (not K/V); ``rope_table_bytes``: pre-RoPE keys' float32 RoPE tables, shared by the
        layers, apart too (``kvbits.plan(..., fused_decode=True)`` counts them). A hybrid model's convolution /
        linear-attention / Mamba states (its ``conv``, ``linear_attention`` and ``hybrid`` layers: ``linear_layers``)
        are no K/V either: ``linear_state_bytes`` counts them apart, unquantized, in the model's dtype, as
        ``QuantizedKVCache.memory_report`` does (``kvbits.cache.cache.linear_state_bytes``)."""
        from kvbits.cache.cache import _holds_state, linear_state_bytes

        self.check_inputs()
        parts = {k: sum(layer.nbytes()[k] for layer in self.kv_layers) for k in ("quantized", "full", "fixed")}
        state = sum(t.nbytes for layer in self.kv_layers if layer.is_initialized
                    for t in layer.state_tensors())  # fmt: skip
        state += sum(layer.rope.pad_rows.nbytes for layer in self.kv_layers  # between a chunked prefill's chunks
                     if layer.rope is not None and layer.rope.pad_rows is not None)  # fmt: skip
        return {"scheme": self.scheme.name, "total_bytes": sum(parts.values()), "quantized_bytes": parts["quantized"],
                "full_bytes": parts["full"], "fixed_bytes": parts["fixed"], "state_bytes": state,
                "rope_table_bytes": self._rope_tables.nbytes, "max_cache_len": self._max_len,
                "linear_state_bytes": linear_state_bytes(self),
                "linear_layers": [i for i, layer in enumerate(self.layers) if _holds_state(layer)]}  # fmt: skip

    def fused_report(self) -> dict[str, Any]:
        """Fused decode per layer, as ``QuantizedKVCache.fused_report``: claimed, the decode steps attended over the
        packed slabs, fallbacks, why a layer was not claimed; a float (fp16 / bf16) layer of a mixed scheme included,
        whose steps the kernel serves too (``kvbits speed`` sets the sum beside layers x steps). Steps replayed from a captured graph run no
        Python and are not counted (the captured step is). ``rope_table_bytes``: the float32 RoPE tables of pre-RoPE
        keys (``kvbits.cache.static_rope``; made with the slabs, for the SDPA path too). Runs the lazy K/V checks
        first."""
        self.check_inputs()
        rows = [
            {"layer": layer.layer_idx, "claimed": layer.fused.claimed, "steps": layer.fused.steps,
             "fallbacks": layer.fused.fallbacks, "declined": layer.fused.declined}
            for layer in self.kv_layers
        ]  # fmt: skip
        return {"mode": self.fused_decode, "fused_steps": sum(r["steps"] for r in rows),
                "fallback_steps": sum(r["fallbacks"] for r in rows), "rope_table_bytes": self._rope_tables.nbytes,
                "layers": rows}  # fmt: skip

    def clipped(self) -> list[dict[str, int]]:
        """Per layer, the keys and values that saturated so far (one host sync), as ``QuantizedKVCache``'s
        ``calibration_report()`` counts them: against static scales (FP8, integer or NUQ ranges: served beyond the
        calibrated range), and under vLLM's integer zero-points (``integer_zero``) where a token's range excludes 0
        (``kvbits.quant.affine.integer_zero_qparams``). Other dynamic scales cover their data and never clip."""
        return [{"layer": layer.layer_idx, "clipped_keys": int(layer.clipped[0]), "clipped_values": int(layer.clipped[1])}
                for layer in self.kv_layers if layer.is_initialized]  # fmt: skip

    @property
    def max_calibrated_length(self) -> int | None:
        """The longest context the installed calibration artifact saw (``None``: no artifact, or it does not say)."""
        return calibrated_length(self.calibration)

    def calibration_report(self) -> dict[str, Any]:
        """Calibration/serving mismatch per layer, in ``QuantizedKVCache.calibration_report``'s form (``add_clipping``
        and the reports read either): ``clipped_keys`` / ``clipped_values`` as ``clipped()`` counts them, out of the
        elements held quantized now (``quantized_keys`` / ``quantized_values``: tokens past the sinks and out of the
        window x batch x KV heads x head dim; ``QuantizedKVCache`` counts those quantized so far, the same until a
        sliding window drops some, which this cache has none of), the last position written and, with a calibration
        artifact installed, how many positions lie beyond its calibrated length. Runs the lazy checks first; reads
        the device counters back (per layer: its length, then its clipped pair)."""
        self.check_inputs()
        longest = self.max_calibrated_length
        rows = []
        for layer in self.kv_layers:
            seen = int(layer.length) if layer.is_initialized else 0
            per_token = 0 if layer._shape is None else layer._shape[0] * layer._shape[1] * layer._shape[2]
            tokens = layer.quantized_tokens(seen)  # the length read once, above
            clipped_keys, clipped_values = layer.clipped.tolist() if layer.is_initialized else (0, 0)  # one read
            row = {
                "layer": layer.layer_idx,
                "clipped_keys": clipped_keys,
                "clipped_values": clipped_values,
                "quantized_keys": tokens * per_token if layer.scheme.key.is_quantized else 0,
                "quantized_values": tokens * per_token if layer.scheme.value.is_quantized else 0,
                "max_position": seen - 1,
            }
            if longest is not None:
                row["positions_beyond_calibrated"] = max(0, seen - longest)
            rows.append(row)
        return {"scheme": self.scheme.name, "max_calibrated_length": longest, "layers": rows}

    def set_static_qparams(
        self, layer_idx: int, side: str, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, *,
        codebook: torch.Tensor | None = None, mean: torch.Tensor | None = None, factor: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Install calibrated parameters of one layer's side (``StaticQuantizedLayer.set_static_qparams``)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.layers)}), got {layer_idx!r}")
        if not isinstance(self.layers[layer_idx], StaticQuantizedLayer):
            raise ValueError(f"layer {layer_idx} keeps a convolution / linear-attention state and no K/V: static "  # noqa: TRY004
                             f"parameters go to attention layers {[x.layer_idx for x in self.kv_layers]}")  # fmt: skip
        self.layers[layer_idx].set_static_qparams(side, scale, zero, codebook=codebook, mean=mean, factor=factor)

    def install_calibration(self, artifact: Any) -> None:
        """Install a ``kvbits calibrate`` artifact (or the folder it wrote) made for this scheme, layer by layer: static
        scales and zero-points (``CalibrationArtifact.static_qparams``), NUQ codebooks and channel vectors."""
        from kvbits.calibrate import checked_artifact

        artifact = checked_artifact(artifact, self.scheme, self._config, len(self.layers))
        self.calibration = artifact  # calibration_report's max_calibrated_length
        longest = calibrated_length(artifact)
        if longest is not None and self._max_len > longest and "length" not in artifact.logged:
            artifact.logged.add("length")  # once per artifact, as QuantizedKVCache says it
            from kvbits.report.calibration import cover_advice

            logger.warning(
                "StaticQuantizedKVCache (scheme %s): max_cache_len=%d reserves positions past the %d-token context its "
                "calibration artifact was calibrated on (max_calibrated_length): they would be served with statistics "
                "extrapolated from shorter contexts (calibration_report() counts what saturates). Replayed steps are not seen by "
                "the host, so this is said here, once per artifact. %s",
                self.scheme.name, self._max_len, longest, cover_advice(self._max_len),
            )  # fmt: skip
        for layer in self.kv_layers:
            install_artifact(layer, artifact, check_heads=self._config is None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search (``StaticQuantizedLayer.reorder_cache``): the K/V layers first, whose checks of ``beam_idx``
        refuse before anything moves, then a hybrid model's convolution / linear-attention states, in place
        (``static_state.reorder_states``; transformers' ``LinearAttentionLayer`` reassigns them)."""
        from kvbits.cache.cache import _is_state_layer
        from kvbits.cache.static_state import reorder_states

        for layer in self.kv_layers:
            layer.reorder_cache(beam_idx)
        if any(layer.is_initialized for layer in self.kv_layers):
            for layer in self.layers:
                if _is_state_layer(layer):
                    reorder_states(layer, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused (``StaticQuantizedLayer.crop``'s ``NotImplementedError``) before any layer changes: transformers'
        ``Cache.crop`` reached a hybrid model's convolution layer first (``RuntimeError`` from
        ``LinearAttentionLayer.crop``)."""
        if self.kv_layers:
            self.kv_layers[0].crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``StaticQuantizedLayer.batch_repeat_interleave`` on the K/V layers (refused once the slabs exist);
        transformers' ``LinearAttentionLayer`` has none (``AttributeError``), so the state layers are skipped."""
        for layer in self.kv_layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """As ``batch_repeat_interleave``: the K/V layers' (refused once the slabs exist)."""
        for layer in self.kv_layers:
            layer.batch_select_indices(indices)
