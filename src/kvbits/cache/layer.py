"""`QuantizedKVLayer`: one attention layer's quantized KV cache, a transformers ``CacheLayerMixin``.

Per layer, for K and for V (shapes ``(B, H_kv, T, D)``):

- the first ``scheme.sinks`` tokens stay in full precision forever (attention sinks, IntactKV): the first cache
  slots of every row, the same for all rows; for a left-padded batch ``QuantizedKVCache`` widens them per request
  (``widen_sinks``: ``scheme.sinks`` + the most pads of a row, ``left_pads``), so every row's first
  ``scheme.sinks`` real tokens stay in full precision;
- later tokens enter a full-precision buffer; whenever it holds ``residual + block`` tokens its
  oldest ``block`` tokens are quantized once (``kvbits.quant.quantize``) and appended to the
  quantized store (KIVI's residual window; history is never re-quantized, unlike transformers'
  ``QuantizedCache``);
- ``update`` returns dequantized store + sinks + buffer in token order, *including* the tokens just
  flushed, so a single prefill already attends to quantized K/V.

This is exactly what ``kvbits.schemes.accounting.token_split`` counts. Pre-RoPE key specs are
un-rotated before quantization and rotated back after (``SideStore``). Identity schemes (``fp16``,
``bf16``) store every token in their float format. Sliding-window layers (window ``W``) keep no
sinks, drop quantized blocks whose tokens all left the last ``W - 1`` positions, fall back to a
full-precision window when the buffer alone could outgrow it (``sliding_falls_back``), and return
exactly the tokens ``DynamicSlidingWindowLayer`` returns, so its mask sizes apply unchanged.
"""

from __future__ import annotations

import functools
import logging
import numbers
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvbits.cache import checks as kv_checks
from kvbits.cache import fused
from kvbits.cache.fixed import (
    PARAM_NAMES,
    channel_bound,
    check_calibrated_heads,
    check_installed_decode,
    check_param_shapes,
    checked_params,
    missing_params,
)
from kvbits.cache.store import SideStore, flush_pair, mergeable
from kvbits.quant.fp8 import static_fp8_scale
from kvbits.quant.tensor import FLOAT_DTYPES
from kvbits.schemes.accounting import sliding_falls_back, token_split
from kvbits.schemes.spec import KVScheme, TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.quant.rope import RotaryTables

logger = logging.getLogger(__name__)

# (layer, side, x, qt): QuantizedKVLayer.observe_flushes
FlushObserver = Callable[[Any, str, torch.Tensor, Any], None]

__all__ = [
    "QuantizedKVLayer", "find_position_ids", "left_pads", "padded_sink_rows", "position_offset", "repeated_positions", "reread_offset",
]


def _fixed_scale(spec: TensorSpec, n_heads: int | None) -> torch.Tensor | None:
    """A static FP8 spec's scale until calibrated: float32 1.0 (vLLM's uncalibrated default), ``()`` per
    tensor, ``(1, H_kv, 1, 1)`` per head (``()`` until ``H_kv`` is known: repeated per head at the first
    update, ``SideStore.init``)."""
    if spec.kind == "fp8" and spec.static:  # TensorSpec: FP8 tensor/head scales are static
        one = torch.ones((), dtype=torch.float32)
        return one if n_heads is None else static_fp8_scale(one, spec.granularity, n_heads, "FP8 scale")
    return None


def find_position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``position_ids`` tensor among ``Cache.update``'s extra arguments (``kwargs=...``, a keyword, or
    a positional dict such as ``cache_kwargs``), or ``None``."""
    for source in (kwargs.get("kwargs"), kwargs, *(a for a in args if isinstance(a, dict))):
        if isinstance(source, dict) and isinstance(source.get("position_ids"), torch.Tensor):
            return source["position_ids"]
    return None


def position_offset(
    args: tuple, kwargs: dict, n_before: int, key_states: torch.Tensor
) -> torch.Tensor | None:
    """``(B,)`` cache index minus the model's position of each sequence's newest token, from the
    ``position_ids`` transformers passes to ``Cache.update`` (``kwargs=...``); ``None`` when absent.

    Left padding is the case it is for: the pads take cache slots, the model's positions start after
    them, and pre-RoPE keys must be un-rotated at the model's positions; the newest token is not a pad,
    so its position is exact. A right-padded row (``generate`` warns against it, and gives pads position
    0, 1 in older versions) ends in pads: where the newest position is below the row's largest, and the
    largest first occurs past the row's first token (the last real token; a left-padded row of one token
    whose pads sit at 1 has it first), that token sets the offset instead. The generated tokens that follow
    the pads are then un-rotated a pad count away from their positions: a frame off by that much, not a
    wrong attention (``rope_at`` rotates them back at the same positions). Device ops only (no sync).

    Read from a request's first update, and again by ``reread_offset`` for rows that update showed nothing but
    one repeated position (``repeated_positions``: pads): a chunked prefill (``generate(prefill_chunk_size=...)``)
    whose first chunk holds only a row's pads gives that row the pads' offset (left-padded by 9, chunks of 4: 3).
    """
    pos = _model_positions(args, kwargs, key_states)
    if pos is None:
        return None
    B, _, q, _ = key_states.shape
    last = pos[:, -1]
    top, at = pos.max(dim=1)  # first occurrence of the largest position
    right_padded = (top > last) & (at > 0)
    offset = torch.where(right_padded, n_before + at - top, (n_before + q - 1) - last)
    return offset.expand(B).contiguous()


def _model_positions(args: tuple, kwargs: dict, key_states: torch.Tensor) -> torch.Tensor | None:
    """The update's ``position_ids`` ``(1 or B, q)`` as int64 on the K/V device, or ``None`` when absent, empty,
    floating point or multi-axis (e.g. mrope): the offsets then stay cache indices, as before."""
    pos = find_position_ids(args, kwargs)
    B, _, q, _ = key_states.shape
    if pos is None or pos.dim() != 2 or pos.shape[1] != q or q == 0 or pos.shape[0] not in (1, B):
        return None
    if pos.is_floating_point():
        return None
    return pos.to(key_states.device, torch.long)


def repeated_positions(args: tuple, kwargs: dict, key_states: torch.Tensor) -> torch.Tensor | None:
    """``(B,)`` bool: the rows to which this update of ``q > 1`` tokens gives one repeated position, which real
    tokens never share: a left-padded row's pads (transformers gives them position 0, or 1 in older versions), at
    most its first real token after them (position 0, its offset already exact). ``None`` for a single token (it
    cannot tell) or without usable position ids. Device ops only (no sync)."""
    pos = _model_positions(args, kwargs, key_states)
    if pos is None or pos.shape[1] < 2:
        return None
    return (pos == pos[:, :1]).all(dim=1).expand(key_states.shape[0]).contiguous()


def padded_sink_rows(args: tuple, kwargs: dict, key_states: torch.Tensor, sinks: int, hint: torch.Tensor | None) -> int:
    """How many rows of a request's first update ``key_states`` ``(B, H_kv, q, D)`` would keep pads in their
    ``sinks`` full-precision sink slots: rows whose first ``min(q, sinks)`` position ids are not ``0, 1, ...``
    (left padding: transformers gives pads position 0, or 1 in older versions). Sinks are counted from each row's
    first cache slot, the same for every row, so such a row's sinks hold its pads and its first real tokens are
    quantized. Position ids from ``Cache.update``'s arguments, else ``hint`` (``track_positions``); 0 without any.
    One host read (a prefill's, once per request)."""
    pos = _model_positions(args, {**kwargs, "position_ids": hint} if hint is not None and find_position_ids(
        args, kwargs) is None else kwargs, key_states)  # fmt: skip
    if pos is None or sinks < 1:
        return 0
    B, take = key_states.shape[0], min(pos.shape[1], sinks)
    want = torch.arange(take, device=pos.device)
    return int((pos[:, :take] != want).any(dim=1).expand(B).sum())


def left_pads(
    args: tuple, kwargs: dict, key_states: torch.Tensor, hint: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's left padding in a request's first update ``key_states`` ``(B, H_kv, q, D)``: ``(pads, unsure)``,
    both ``(B,)``: ``pads`` (int64) the slots before the row's first real token (left padding: the real tokens'
    positions end at the last slot, ``q - 1 - last position``; 0 for an unpadded or a right-padded row, as
    ``position_offset`` tells them), ``unsure`` (bool) rows of ``q > 1`` slots sharing one position, which are all
    pads or pads and one real token (a chunked prefill's first chunk cannot tell). Position ids from
    ``Cache.update``'s arguments, else ``hint`` (``track_positions``); ``None`` without any. Device ops only."""
    if hint is not None and find_position_ids(args, kwargs) is None:
        kwargs = {**kwargs, "position_ids": hint}
    pos = _model_positions(args, kwargs, key_states)
    if pos is None:
        return None
    B, q = key_states.shape[0], pos.shape[1]
    last = pos[:, -1]
    top, at = pos.max(dim=1)
    right_padded = (top > last) & (at > 0)
    pads = torch.where(right_padded, torch.zeros_like(last), (q - 1 - last).clamp_min(0))
    unsure = (pos == pos[:, :1]).all(dim=1) if q > 1 else torch.zeros_like(last, dtype=torch.bool)
    return pads.expand(B).contiguous(), unsure.expand(B).contiguous()


def no_positions_message(cache: str, batch: int) -> str:
    """The once-per-cache INFO of a pre-RoPE cache (``cache``: its class name) whose request's first update of a batch
    of ``batch`` rows brings no ``position_ids`` (neither ``Cache.update``'s nor ``track_positions``'s)."""
    return (
        f"{cache}: pre-RoPE keys of a batch of {batch}: no position_ids reached the cache, so keys are un-rotated at "
        "cache indices; with left padding call kvbits.cache.track_positions(model) first"
    )


def padded_sinks_message(scheme_name: str, sinks: int, rows: int, batch: int, why: str = "") -> str:
    """The once-per-cache warning ``padded_sink_rows`` leads to (``StaticQuantizedKVCache``; ``QuantizedKVCache`` where
    it cannot widen the sinks, ``why``)."""
    return (
        f"scheme {scheme_name!r} keeps the first {sinks} tokens of each sequence in full precision (attention sinks), "
        f"counted from the first cache slot of every row: {rows} of the {batch} rows of this batch are left-padded, "
        "so their sink slots hold pads and their first real tokens are quantized (measured: a tiny Llama, 2-bit K/V "
        "with 4 sinks, a row left-padded by 8: its logits 0.22 from the row run alone, against 0.08 between that run "
        "and fp16)" + (f" ({why})" if why else "") + ". Run such rows unpadded (batch by length) or use a scheme without "
        "sinks for padded batches. Logged once per cache"
    )


def reread_offset(
    args: tuple, kwargs: dict, n_before: int, key_states: torch.Tensor, offset: torch.Tensor, pad_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A later update of a request whose rows ``pad_rows`` ``(B,)`` bool had nothing but pads so far
    (``repeated_positions`` at every update): ``offset`` ``(B,)`` read again (``position_offset``) for those rows,
    kept for the others, and the rows this update leaves all pads (``None``: none can be told any more).

    A chunked prefill (``generate(prefill_chunk_size=4)``, a row left-padded by 9) reads 3, then 7, then the row's
    real offset 9 from the chunk that holds its first real tokens, before that chunk is flushed; its keys are then
    quantized in the frame of an unchunked prefill. The pads already flushed were un-rotated at the old offset and
    are rotated back at the new one: with transformers' pad position 0 both clamp to position 0 (``rope_at``), the
    same values; with position 1 (older versions) a pad's key may come back rotated, a masked key either way.
    Device ops only (no sync)."""
    new = position_offset(args, kwargs, n_before, key_states)
    if new is None:
        return offset, None
    still = repeated_positions(args, kwargs, key_states)
    return torch.where(pad_rows, new, offset), (None if still is None else pad_rows & still)


def _repeats_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """Whether ``x`` ``(B, g * H, q, D)`` is ``H`` heads each repeated ``g`` times in a row (heads
    ``i*g ... i*g + g - 1`` equal; NaN never equals, so such K/V count as not repeated), as a bool
    tensor on ``x``'s device (no host sync: the caller reads K's and V's answers at once)."""
    B, Hg, q, D = x.shape
    groups = x.view(B, Hg // g, g, q, D) if x.is_contiguous() else x.reshape(B, Hg // g, g, q, D)
    return (groups == groups[:, :, :1]).all()


def check_crop_arg(tokens_to_remove: Any) -> int:
    """``crop``'s argument as an ``int``: ``TypeError`` for anything else (a bool, float, str, a tensor of more than one
    element or not of integers, ...). A 0-d integer tensor is read (one host sync, once per crop): transformers 5.17's
    assisted decoding rolls rejected drafts back with ``crop(tensor(-3))``."""
    if (
        isinstance(tokens_to_remove, torch.Tensor)
        and tokens_to_remove.dim() == 0
        and tokens_to_remove.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
    ):
        return int(tokens_to_remove)
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
        raise TypeError(
            "crop(tokens_to_remove) takes an int (negative: remove that many tokens from the end; positive: keep "
            f"that absolute length), got {type(tokens_to_remove).__name__} {tokens_to_remove!r}"
        )
    return int(tokens_to_remove)


BEAM_IDX_DTYPES = (torch.int64, torch.int32)  # what index_select takes


def cache_batch_size(layers: Any) -> int:
    """transformers' ``Cache.batch_size`` over a cache's ``layers``: the batch they hold, ``-1`` before any holds K/V
    (as a fresh ``StaticCache`` or ``DynamicCache``); layers not yet updated (``batch_size`` None) or without one
    (``DummyLayer``) are skipped, as transformers skips lazily initialized layers. ``ValueError`` when they disagree."""
    values = [b for b in (getattr(layer, "batch_size", None) for layer in layers) if b is not None]
    if len(set(values)) > 1:
        raise ValueError(f"The batch size is not consistent across layers: {values}")
    return values[0] if values else -1


def check_beam_idx(beam_idx: Any, batch: int | None, where: str) -> None:
    """``reorder_cache``'s ``beam_idx``: a 1-D int64 / int32 tensor of batch indices, each in ``[0, batch)`` when the
    cached ``batch`` is known (``None``: nothing cached yet, not checked). Its length may differ from ``batch``:
    transformers' layers ``index_select`` any number of rows. ``TypeError`` / ``ValueError`` saying what was
    expected; the range check reads the indices' minimum and maximum back (one host sync)."""
    if not isinstance(beam_idx, torch.Tensor):
        raise TypeError(
            f"{where}: beam_idx must be a 1-D integer torch.Tensor of batch indices (transformers passes a "
            f"LongTensor), got {type(beam_idx).__name__}"
        )
    if beam_idx.dtype not in BEAM_IDX_DTYPES:
        raise TypeError(f"{where}: beam_idx must hold integer batch indices (torch.long), got dtype {beam_idx.dtype}")
    if beam_idx.dim() != 1:
        raise ValueError(
            f"{where}: beam_idx must be 1-D (the cached row each new row takes), got shape {tuple(beam_idx.shape)}"
        )
    if batch is None or beam_idx.numel() == 0:
        return
    lo, hi = torch.aminmax(beam_idx.detach())
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= batch:
        raise ValueError(
            f"{where}: beam_idx must index the cached batch of {batch} sequences (0..{batch - 1}), got indices "
            f"from {lo} to {hi}"
        )


PACKED_STORAGE = "packed quantized storage (codes, scales, full-precision buffer; see memory_report())"


def offload_refusal(
    what: str, cache: str = "QuantizedKVCache", unquantized: str = "DynamicCache", storage: str = PACKED_STORAGE
) -> str:
    """Why ``offload`` / ``prefetch`` of ``what`` (a layer or the cache ``cache``) is refused, and what to use instead
    (an ``unquantized`` transformers cache with ``offloading=True``). ``storage``: what the layer's K/V are (a float
    layer's are no quantized storage, and hold no fraction of fp16's bytes)."""
    keep = ("Keep the quantized cache on the device (it already holds a fraction of fp16's bytes)"
            if storage == PACKED_STORAGE else f"Keep the {cache} on the device")  # fmt: skip
    return (
        f"{cache} {what}: CPU offloading (offload / prefetch) is not supported: the layer's K/V are {storage}, not "
        "the keys / values tensors transformers' offloading moves, and they stay on the device they came on. "
        f"{keep}, or offload an unquantized transformers {unquantized}(config=..., offloading=True) instead"
    )


def check_max_cache_len(value: Any) -> int | None:
    """``max_cache_len`` as given (a positive int or ``None``); ``ValueError`` otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_cache_len must be a positive int (tokens per sequence) or None, got {value!r}")
    return value


class QuantizedKVLayer(CacheLayerMixin):
    """Quantized K/V of one attention layer (full attention or sliding window).

    Args:
        scheme: the ``KVScheme`` to follow.
        layer_idx: index in the model (named in error messages and reports).
        sliding_window: ``W`` for a sliding-window layer, ``None`` for full attention.
        workspace: keep the dequantized history too (faster decode; reported apart, never in
            ``total_bytes``); results are identical either way for schemes without a rotation, and equal to
            rounding for rotated ones (each flush is inverse-rotated on its own: ``QuantizedKVCache``).
        num_key_value_heads: ``H_kv`` of the model (from its config), or ``None`` (taken from the first update).
        head_repeat: ``g``: the model's attention hands ``update`` each of its ``H_kv`` heads repeated ``g``
            times in a row, ``(B, g * H_kv, q, D)`` (transformers' Falcon with ``new_decoder_architecture``
            before 5.25 broadcasts its KV heads to every query head). The layer then stores every ``g``-th
            head, ``H_kv`` heads as the planner counts them, and repeats them back in what ``update`` /
            ``materialize`` return, after checking once per request (its first update with tokens) that the
            groups really are copies; when they are not, it logs a warning and stores all ``g * H_kv`` heads.
            K/V arriving with ``H_kv`` heads (not repeated: Falcon from 5.25) are stored and returned as they
            are. Needs ``num_key_value_heads``.
        head_dim: ``D`` from the model config, to check the scheme's channel groups against it now
            (``None``: checked against the K/V of the first update).
        rotary: this layer's RoPE tables (``RotaryTables.tables_for_layer``), needed by ``pre_rope`` keys.
        fused_decode: ``True`` / ``"auto"`` (CUDA with Triton) / ``False``: whether decode steps may skip
            dequantization for the ``kvbits_fused`` attention function (``kvbits.cache.fused``).
        rope_tables: float32 RoPE tables shared with the cache's other layers (fused pre-RoPE keys).
        checks: how incoming K/V are checked for NaN / inf / the float16 range (where float16 holds them
            or their metadata; ``kvbits.cache.checks``): ``"eager"`` before storing them (one host sync per
            step), ``"lazy"`` on the device, read every
            ``check_every`` update steps and by ``materialize()`` (no sync per step), ``"auto"`` (default):
            eager on CPU, lazy on CUDA and other accelerators.
        check_every: update steps between lazy checks (default 64).
        max_cache_len: tokens per sequence to reserve quantized storage for (``None``: none reserved). A
            full-attention layer whose key or value spec keeps one growing chunk (``store.mergeable``)
            allocates it at the first flush for the tokens ``token_split`` quantizes at ``max_cache_len``
            and writes later flushes in place: no copy of the history per flush, and from then on the bytes
            ``kvbits.plan`` counts at that context (see ``kvbits.cache.store``). Past it, logged, the layer
            grows by copying as without it. Sliding-window layers reserve nothing.

    Calibrated parameters (static scales, NUQ codebooks) are installed with ``set_static_qparams``.

    ``keys`` / ``values`` (transformers' attributes) stay ``None``: the storage is not one tensor.
    Use ``materialize()`` for what attention sees and ``memory_report()`` for the bytes. transformers' CPU
    offloading (``offload`` / ``prefetch``, which move those attributes) is refused with ``NotImplementedError``.
    """

    is_compileable = False

    def __init__(
        self,
        scheme: KVScheme,
        *,
        layer_idx: int = 0,
        sliding_window: int | None = None,
        workspace: bool = False,
        num_key_value_heads: int | None = None,
        head_repeat: int = 1,
        head_dim: int | None = None,
        rotary: RotaryTables | None = None,
        fused_decode: bool | str = "auto",
        rope_tables: fused.RopeTableCache | None = None,
        checks: str = "auto",
        check_every: int = kv_checks.DEFAULT_CHECK_EVERY,
        max_cache_len: int | None = None,
    ) -> None:
        super().__init__()
        self.max_cache_len = check_max_cache_len(max_cache_len)
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.scheme = scheme
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        if isinstance(head_repeat, bool) or not isinstance(head_repeat, int) or head_repeat < 1:
            raise ValueError(f"head_repeat must be a positive int, got {head_repeat!r}")
        if head_repeat > 1 and num_key_value_heads is None:
            raise ValueError(f"layer {layer_idx}: head_repeat={head_repeat} needs num_key_value_heads")
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim  # D from the config (what kvbits plan counts), checked at every update
        self.head_repeat = head_repeat
        # what the stored heads are repeated by in update's K/V: head_repeat once the first update with
        # tokens found the groups to be copies, else 1 (decided per request by lazy_initialization)
        self.repeat = 1
        self._repeat_pending = False  # initialized from zero-token K/V (early_initialization): not checked yet
        self.workspace = workspace
        if scheme.is_identity:
            self.mode = "identity"
        elif self.is_sliding and sliding_falls_back(scheme, sliding_window):
            self.mode = "fallback"  # QuantizedKVCache logs it once for all such layers
        else:
            self.mode = "quantized"
        quantized = self.mode == "quantized"
        if quantized and head_dim is not None:
            kv_checks.check_channel_groups(scheme, head_dim, head_dim, f"layer {layer_idx}")
        if quantized and scheme.key.pre_rope and rotary is None:
            raise ValueError(
                f"layer {layer_idx}: scheme {scheme.name!r} quantizes keys before RoPE and needs the model's RoPE "
                "tables: build the cache with config= (or rotary=kvbits.quant.rope.RotaryTables.from_model(model))"
            )
        self._k = SideStore(
            scheme.key, name=f"layer {layer_idx} keys", workspace=workspace and quantized,
            static_scale=_fixed_scale(scheme.key, num_key_value_heads) if quantized else None, rotary=rotary if quantized else None,
        )
        self._v = SideStore(
            scheme.value, name=f"layer {layer_idx} values", workspace=workspace and quantized,
            static_scale=_fixed_scale(scheme.value, num_key_value_heads) if quantized else None,
        )
        self.pad_sinks = 0  # full-precision sink slots added for this request (widen_sinks); reset() zeroes it
        self._reserve_for_request()
        self.fused = fused.FusedState(fused.check_mode(fused_decode), rope_tables or fused.RopeTableCache())
        self.checks = kv_checks.InputChecks(kv_checks.check_mode(checks), kv_checks.check_every_arg(check_every))
        # specs that store more than |x| in float16 (NUQ ranges, un-rotated keys, rotations) accept less;
        # bf16/fp32 more
        self._head_dims = (head_dim, head_dim)  # the K and V head dims, once known (the config, or the first K/V)
        self._set_bounds(*self._head_dims)
        self.tokens_seen = 0
        self.dropped_tokens = 0
        # a full-precision sliding window (identity scheme, fallback) keeps what it held since the last crop until
        # the next crop, which trims it back to the window (activate_past_recording, as DynamicSlidingWindowLayer)
        self.record_past = False
        self.held_at: int | None = None  # tokens seen when hold_full_precision() stopped flushing; None: quantizing
        self._flushing = False  # inside update's flushes (hold_full_precision then releases after them)
        self.resets = 0  # reset() calls: requests served before the current one
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        # called with this layer after a flush whose clipped counts (host ints: eager checks) passed clip_floor, by
        # QuantizedKVCache's once-per-cache clipping warning (set only where a spec can clip: can_clip); None: no cost
        self.clip_watch: Callable[[QuantizedKVLayer], None] | None = None
        # (keys, values) clipped counts at or under which the warning cannot be due (CLIP_WARN_FRAC of the elements
        # quantized when clip_watch last looked; they only grow): a flush compares two ints, most call nothing
        self.clip_floor: tuple[float, float] = (0.0, 0.0)

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can always undo the last updates (transformers asks after the prefill, for assisted and
        prompt-lookup decoding): a layer that keeps its tokens as they came, as ``DynamicLayer`` and
        ``DynamicSlidingWindowLayer`` do: an identity scheme (``fp16``, ``bf16``), or a sliding layer that falls back to
        full precision. A sliding one rolls back past its window only after ``activate_past_recording()``, which
        transformers calls before assisted decoding (as for ``DynamicSlidingWindowLayer``). A quantizing layer rolls
        back only while no block was flushed since the removed tokens arrived, so it does not claim it."""
        return self.mode != "quantized"

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Let ``crop`` roll a full-precision sliding window back (transformers calls it before assisted decoding:
        ``Cache.activate_past_recording``, with ``recurrent_states_to_keep`` from 5.24, ignored here): ``update``
        keeps every token held since the last ``crop`` instead of trimming to the last ``W - 1``, and ``crop`` (also
        ``crop(0)``) trims after removing, as ``DynamicSlidingWindowLayer``. What ``update`` returns is unchanged.
        Until that ``crop`` the layer holds (and ``memory_report()`` counts) every token the forwards since the last
        ``crop`` added, past its ``W - 1``: transformers crops after each verified draft, but a cache reused for plain
        decoding after an assisted ``generate`` keeps growing by a token per step (as ``DynamicSlidingWindowLayer``
        does) until ``crop(0)`` trims it or ``reset()`` turns recording off. A no-op for full-attention and quantizing
        layers (a quantized window drops whole blocks, and its rollback is bounded by flushes anyway)."""
        if self.is_sliding and self.mode != "quantized":
            self.record_past = True

    def offload(self) -> None:
        """Refused: ``NotImplementedError``. transformers' layer offloading moves ``keys`` / ``values``, which this
        layer leaves ``None`` (its K/V are packed codes, scales, buffers, ...: ``components()``); it raised
        ``AttributeError: 'NoneType' object has no attribute 'to'`` here. Nothing is moved."""
        raise NotImplementedError(offload_refusal(f"layer {self.layer_idx}"))

    def prefetch(self) -> None:
        """Refused as ``offload`` (``NotImplementedError``): a ``QuantizedKVLayer`` is never offloaded."""
        raise NotImplementedError(offload_refusal(f"layer {self.layer_idx}"))

    def __repr__(self) -> str:
        kind = f"sliding={self.sliding_window}" if self.is_sliding else "full"
        return f"QuantizedKVLayer(layer={self.layer_idx}, scheme={self.scheme.name!r}, {kind}, mode={self.mode})"

    # --------------------------------------------------------------- set-up
    def set_static_qparams(
        self,
        side: str,
        scale: torch.Tensor | None = None,
        zero: torch.Tensor | None = None,
        *,
        codebook: torch.Tensor | None = None,
        mean: torch.Tensor | None = None,
        factor: torch.Tensor | None = None,
    ) -> None:
        """Install calibrated fixed parameters for ``side`` (``"key"`` or ``"value"``).

        ``scale``/``zero``: static specs (and FP8 per-tensor scales), broadcastable to the grouped view
        ``quantize`` uses (static per-channel: ``(H_kv, D)``); ``codebook``: NUQ specs, float16
        ``(2**bits,)``; ``mean`` / ``factor``: ``centre`` / ``smooth`` specs, ``(H_kv, D)`` (or
        ``(1, H_kv, 1, D)``) channel means and smoothing factors (``> 0``), stored float16 ``(H_kv, D)``.
        They are owned by the layer and reported as ``fixed`` bytes. A no-op for layers that quantize
        nothing (identity schemes, sliding fallback). A ``scale`` replaces the zero-points with ``zero`` (none when
        not given); ``zero`` alone replaces the zero-points of the installed scale.

        Scales must be finite and ``>= 0`` (FP8: ``> 0``), zero-points finite, in the dtype they are
        stored in (float16; FP8 scales float32): checked here, once (one host sync), since the per-step
        path does not re-check them. A zero int/NUQ scale (a channel constant during calibration) is
        accepted; the values it collapses onto the zero-point are counted in ``clipped()``.
        """
        store = {"key": self._k, "value": self._v}.get(side)
        if store is None:
            raise ValueError(f"side must be 'key' or 'value', got {side!r}")
        given = [t for t in (scale, zero, codebook, mean, factor) if isinstance(t, torch.Tensor)]
        device = self.device or (given[0].device if given else torch.device("cpu"))
        params = checked_params(store.spec, f"layer {self.layer_idx} {side}", self._stored_heads(), device,
                                scale=scale, zero=zero, codebook=codebook, mean=mean, factor=factor)  # fmt: skip
        if self.mode != "quantized":
            return
        D = self._head_dims[0 if side == "key" else 1]  # the config's, or the first K/V's (None: checked then)
        check_param_shapes(store.spec, f"layer {self.layer_idx} {side}", params, self._stored_heads(), D,
                           self.scheme.block)  # fmt: skip
        # zero-points or a codebook given apart from their scale: checked with the installed one, before any is set
        check_installed_decode(store.spec, f"layer {self.layer_idx} {side}", params,
                               {name: getattr(store, name) for name in PARAM_NAMES}, scale_drops_zero=True)  # fmt: skip
        for name in ("channel_mean", "channel_factor"):
            if name in params:
                setattr(store, name, params[name])
        if "channel_mean" in params or "channel_factor" in params:  # the float16 scales cover (x - mean) / factor
            self._set_bounds(*self._head_dims)
        if "static_scale" in params:  # a new scale drops the old zero-points: they belong to the old scale
            store.static_scale, store.static_zero = params["static_scale"], params.get("static_zero")
            # the kernel path counts what a zero scale clips only when there is one (no cost otherwise)
            store.zero_scales = bool((store.static_scale == 0).any())
        elif "static_zero" in params:  # zero-points alone (their scale installed before): dropped silently before
            store.static_zero = params["static_zero"]
        if "codebook" in params:
            store.codebook = params["codebook"]

    def _set_bounds(self, key_dim: int | None, value_dim: int | None) -> None:
        """The input bounds (``checks.bounds``) of both sides: ``kv_checks.input_bound`` at head dims ``key_dim``
        / ``value_dim`` (``None``: not known yet; a rotated side's bound is set once they are), lowered for
        installed channel vectors: ``|(x - mean) / factor|`` stays within the spec's bound when
        ``|x| <= bound * min(factor) - max |mean|`` (one host sync per side with vectors)."""
        bounds = []
        for store, D in ((self._k, key_dim), (self._v, value_dim)):
            bound, why = kv_checks.input_bound(store.spec, self.mode, D)
            bounds.append(channel_bound(bound, why, store.channel_mean, store.channel_factor))
        self.checks.bounds = (bounds[0], bounds[1])

    def set_rotary(self, rotary: RotaryTables) -> None:
        """Replace this layer's RoPE tables (e.g. the same tables built on the K/V device)."""
        if self._k.rotary is not None:
            self._k.rotary = rotary

    def _stored_heads(self) -> int | None:
        """``H_kv`` as stored: the initialized storage's, else the config's (``None``: not known yet)."""
        if self._k.sinks is not None:
            return self._k.sinks.shape[1]
        return self.num_key_value_heads

    def needs_calibration(self) -> list[str]:
        """What is still missing before this layer can quantize (empty when ready)."""
        if self.mode != "quantized":
            return []
        missing = []
        for side, store in (("key", self._k), ("value", self._v)):
            have = {name: getattr(store, name) for name in PARAM_NAMES}
            missing += missing_params(store.spec, side, have)
        return missing

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty storage for K/V like ``key_states`` / ``value_states`` ``(B, H, q, D)`` as ``update`` receives
        them (``q`` may be 0: transformers' ``early_initialization``); decides ``repeat`` (``head_repeat``).
        ``TypeError`` / ``ValueError`` (``kv_checks.check_incoming``) for K/V that ``update`` would refuse: not
        floating, or without the config's heads / head dim, before anything is set up."""
        kv_checks.check_incoming(self, key_states, value_states)
        self.repeat = self._choose_repeat(key_states, value_states)
        key_states, value_states = self._unique_heads(key_states), self._unique_heads(value_states)
        if self.mode == "quantized":
            check_calibrated_heads(self, key_states.shape[1], key_states.shape[-1])
            kv_checks.check_channel_groups(
                self.scheme, key_states.shape[-1], value_states.shape[-1], f"layer {self.layer_idx}"
            )
            for side, store, x in (("key", self._k, key_states), ("value", self._v, value_states)):
                # parameters installed before the shapes were known: refused now, before anything is stored
                have = {name: getattr(store, name) for name in PARAM_NAMES}
                check_param_shapes(store.spec, f"layer {self.layer_idx} {side}", have, x.shape[1], x.shape[-1],
                                   self.scheme.block)  # fmt: skip
        self.dtype, self.device = key_states.dtype, key_states.device
        self.checks.resolve(self.device)
        k_store, v_store = key_states.dtype, value_states.dtype
        if self.mode == "identity":  # fp16 / bf16 schemes store every token in their own format
            k_store, v_store = FLOAT_DTYPES[self.scheme.key.fmt], FLOAT_DTYPES[self.scheme.value.fmt]
        self._k.init(key_states, k_store, sync=not self.checks.lazy)
        self._v.init(value_states, v_store, sync=not self.checks.lazy)
        self.is_initialized = True

    def _choose_repeat(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """The factor the incoming heads ``(B, H, q, D)`` repeat ``H / head_repeat`` unique heads by
        (``head_repeat`` or 1). Checks that each group of ``head_repeat`` consecutive heads holds one head's
        copies (a comparison of the K/V, one host sync, once per request); K/V without tokens cannot
        tell, so the next update with tokens checks (``_repeat_pending``)."""
        g = self.head_repeat
        self._repeat_pending = False
        if g == 1 or key_states.shape[1] != self.num_key_value_heads * g:
            return 1  # nothing repeated (e.g. the model hands over its H_kv heads as they are)
        if key_states.shape[2] == 0:
            self._repeat_pending = True
            return g
        if bool(_repeats_heads(key_states, g) & _repeats_heads(value_states, g)):  # the one host sync
            return g
        logger.warning(
            "layer %d: the %d K/V heads are not %d copies of each of %d heads (as num_kv_heads and "
            "new_decoder_architecture say): storing all %d heads, %dx the bytes the planner counts",
            self.layer_idx, key_states.shape[1], g, self.num_key_value_heads, key_states.shape[1], g,
        )  # fmt: skip
        return 1

    def _unique_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, repeat * H, q, D)`` -> the stored heads ``(B, H, q, D)`` (a view)."""
        return x if self.repeat == 1 else x[:, :: self.repeat]

    def _repeat_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Stored heads ``(B, H, T, D)`` -> what the model's attention expects, ``(B, repeat * H, T, D)``."""
        return x if self.repeat == 1 else x.repeat_interleave(self.repeat, dim=1)

    # --------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V ``(B, H_kv, q, D)`` and return the K/V attention uses ``(B, H_kv, kv_length, D)``.

        With ``head_repeat`` ``g``, K/V come as ``(B, g * H_kv, q, D)``, ``H_kv`` heads are stored, and the
        returned K/V are ``(B, g * H_kv, kv_length, D)`` again (``repeat``).

        Full attention: all ``T`` tokens seen. Sliding window: the last ``min(T_before, W - 1)`` cached
        tokens plus the ``q`` new ones, as ``DynamicSlidingWindowLayer`` (``get_mask_sizes`` agrees).
        Decode steps of a layer claimed by ``kvbits_fused`` return zero-byte placeholders instead, while the
        model's attention is still ``kvbits_fused`` (``kvbits.cache.fused``). With lazy checks
        (``kvbits.cache.checks``) nothing here waits for the device.
        """
        kv_checks.validate(self, key_states, value_states)
        if not self.is_initialized:
            self.checks.resolve(key_states.device)
            dims = (key_states.shape[-1], value_states.shape[-1])
            if self.mode == "quantized" and dims != self._head_dims:  # a rotated side's bound depends on D
                self._head_dims = dims
                self._set_bounds(*dims)
        elif self.checks.due:  # a layer used on its own (QuantizedKVCache checks all its layers at once)
            kv_checks.run_checks([self])
        self.checks.observe(f"layer {self.layer_idx}", key_states, value_states)
        if not self.is_initialized or (self._repeat_pending and key_states.shape[2] and self.tokens_seen == 0):
            self.lazy_initialization(key_states, value_states)
        key_states, value_states = self._unique_heads(key_states), self._unique_heads(value_states)
        n_before, q = self.tokens_seen, key_states.shape[2]
        dropped_before = self.dropped_tokens
        if self.mode == "quantized" and self.scheme.key.pre_rope and self.reads_positions:
            self._read_offsets(args, kwargs, n_before, key_states)
        take = 0
        if self.mode == "quantized" and not self.is_sliding:
            take = max(0, min(q, self.sinks - self._k.n_sinks))
        for store, x in ((self._k, key_states), (self._v, value_states)):
            store.append_sinks(x[:, :, :take])
            store.append_buffer(x[:, :, take:])
        self.tokens_seen = n = n_before + q
        if self.mode == "quantized" and self.held_at is None:
            excess = self._k.n_buffer - self.scheme.residual
            n_flush = 0 if excess < self.scheme.block else self.scheme.block * (excess // self.scheme.block)
            self._flushing = True  # a monitor may hold the layer from inside these flushes (observe_flushes)
            try:
                flush_pair(self._k, self._v, n_flush, self.scheme.block)  # one quantize call where K and V can share it
            finally:
                self._flushing = False
            if self.held_at is not None:  # held during the flushes, which reserved their slots again: give them back
                self._release_reservations()
            if (
                n_flush and self.clip_watch is not None and self._k.sync  # eager: the counts are host ints
                and (self._k.clipped > self.clip_floor[0] or self._v.clipped > self.clip_floor[1])
            ):  # fmt: skip
                self.clip_watch(self)
        if self.fused.claimed and q == 1 and fused.serving(self):
            return fused.placeholders(self)  # kvbits_fused attends over packed_store(self): no dequantization
        # view: with a reserved workspace, the returned K/V view it (no copy of the history; used at once)
        keys, values = self._k.materialize(self.dtype, view=True), self._v.materialize(self.dtype, view=True)
        if self.is_sliding:
            start = max(0, n_before - self.sliding_window + 1) - dropped_before
            keys, values = keys[:, :, start:], values[:, :, start:]
            if not self.record_past:  # else the next crop trims (activate_past_recording)
                self._trim_window(n)
        return fused.tag(self, self._repeat_heads(keys)), self._repeat_heads(values)

    @property
    def sinks(self) -> int:
        """Full-precision sink slots of every row in this request: ``scheme.sinks`` plus ``pad_sinks``
        (``widen_sinks``); 0 for a layer that keeps none (sliding, identity, fallback)."""
        return self.scheme.sinks + self.pad_sinks if self.keeps_sinks else 0

    def widen_sinks(self, pads: int) -> None:
        """Keep ``scheme.sinks + pads`` full-precision sink slots for this request (``reset()`` goes back to
        ``scheme.sinks``): a left-padded batch whose rows hold up to ``pads`` pads before their first real token then
        keeps every row's first ``scheme.sinks`` real tokens in full precision (rows with fewer pads keep a few more
        real tokens). Before the request's first token only (``ValueError`` after); a no-op where no sinks are kept."""
        if isinstance(pads, bool) or not isinstance(pads, int) or pads < 0:
            raise ValueError(f"pads must be a non-negative int, got {pads!r}")
        if self.tokens_seen:
            raise ValueError(f"layer {self.layer_idx}: sinks are widened before a request's first token, "
                             f"not after {self.tokens_seen}")  # fmt: skip
        self.pad_sinks = pads if self.keeps_sinks else 0
        self._reserve_for_request()

    def _reserve_for_request(self) -> None:
        """Size the quantized slots reserved for ``max_cache_len`` (a full-attention quantizing layer's mergeable
        sides; none otherwise) by this request's split (``_split_scheme``): the tokens ``token_split`` quantizes at
        ``max_cache_len`` with ``sinks`` full-precision slots, so a widened request (``widen_sinks``) reserves
        ``pad_sinks`` fewer quantized slots than ``scheme.sinks`` would, the slots its extra sinks replace. Host ints
        only; the slots themselves are allocated at the first flush (``SideStore._reserve``), after any widening."""
        if self.mode != "quantized" or self.is_sliding or self.max_cache_len is None:
            return
        reserve = token_split(self._split_scheme, self.max_cache_len).quantized
        for store in (self._k, self._v):
            store.reserve_tokens = reserve if mergeable(store.spec) else 0
            store.reserve_total = self.max_cache_len  # a workspace spans every token (materialize's layout)

    @property
    def _split_scheme(self) -> KVScheme:
        """The scheme ``token_split`` counts this request with: ``scheme`` with this request's ``sinks``."""
        return replace(self.scheme, sinks=self.sinks) if self.pad_sinks else self.scheme

    @property
    def keeps_sinks(self) -> bool:
        """Whether this layer keeps its first ``scheme.sinks`` tokens in full precision (a quantizing full-attention layer
        of a scheme with sinks; sliding layers keep none)."""
        return self.mode == "quantized" and not self.is_sliding and self.scheme.sinks > 0

    @property
    def reads_positions(self) -> bool:
        """Whether the next update reads the model's position ids: a request's first, or a later one while some
        row held nothing but pads (``pad_rows``, a chunked prefill). The cache adds tracked ids to those updates."""
        return self.tokens_seen == 0 or self._k.pad_rows is not None

    def _read_offsets(self, args: tuple, kwargs: dict, n_before: int, key_states: torch.Tensor) -> None:
        """Pre-RoPE keys' ``pos_offset`` from the position ids: read at a request's first update, then kept (every
        block is un-rotated and rotated back with the same offsets), except for rows that held nothing but pads so
        far (``pad_rows``, a chunked prefill), read again (``reread_offset``) until the first single-token update
        (a decode step: from there on no update costs more than this attribute test). Device ops only."""
        k, q = self._k, key_states.shape[2]
        if n_before == 0:
            k.pos_offset = position_offset(args, kwargs, n_before, key_states)
            k.pad_rows = None if k.pos_offset is None else repeated_positions(args, kwargs, key_states)
        elif k.pos_offset is None:  # pad_rows without offsets: cleared with them, kept out of here
            k.pad_rows = None
        else:
            k.pos_offset, rows = reread_offset(args, kwargs, n_before, key_states, k.pos_offset, k.pad_rows)
            k.pad_rows = rows if q > 1 else None

    def _trim_window(self, n: int) -> None:
        """Forget what the next step can no longer attend to (``token_split`` with a window)."""
        W, block = self.sliding_window, self.scheme.block
        keep_from = max(0, n - W + 1)
        if self.mode == "quantized":
            n_blocks = (self.dropped_tokens + self._k.n_quantized) // block  # flushed_tokens(n) unless cropped
            target = min(n_blocks, keep_from // block) * block
            for store in (self._k, self._v):
                store.drop_quantized_front(target - self.dropped_tokens)
            self.dropped_tokens = target
        else:
            for store in (self._k, self._v):
                store.keep_buffer_tail(n - keep_from)
            self.dropped_tokens = keep_from

    # ----------------------------------------------------------- transformers
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the tensors the next ``update`` returns."""
        if not self.is_sliding:
            return self.tokens_seen + query_length, 0
        W, n = self.sliding_window, self.tokens_seen
        kv_offset = max(n - W + 1, 0)
        kv_length = (W - 1 + query_length) if n >= W else n + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        """Empty the layer for a new request. A lazy check still pending (a layer used on its own: ``QuantizedKVCache``
        has already run its layers' checks) runs first, one host sync, and bad K/V it finds are logged (WARNING)
        instead of being forgotten with the tokens, as ``QuantizedKVCache.reset`` does; ``reset()`` never raises."""
        if self.checks.pending and self.checks.error is None:
            try:
                kv_checks.run_checks([self])
            except ValueError as exc:
                logger.warning("QuantizedKVLayer.reset(): the pending lazy K/V check failed: %s. The layer is emptied "
                               "now; the outputs of the request just reset were computed from these K/V", exc)  # fmt: skip
        self._k.clear()
        self._v.clear()
        self.tokens_seen = self.dropped_tokens = 0
        self.pad_sinks = 0  # a new request: its first update decides again (QuantizedKVCache)
        self._reserve_for_request()  # ... and its reservation with scheme.sinks again
        self.record_past = False  # a new request: generate activates it again for assisted decoding
        self.held_at = None
        self.resets += 1  # a new request (kvbits.monitor forgets the last one's crossings)
        self.is_initialized = False
        self.repeat, self._repeat_pending = 1, False
        # a new request asks again at its first call, also a one-token prompt's (claim holds a decline for q == 1)
        self.fused.claimed, self.fused.declined = False, None
        self.checks.reset()
        self.clip_floor = (0.0, 0.0)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end: negative = that many tokens, positive = keep that absolute length
        (transformers 5.17's legacy meaning; a no-op when not shorter than the cache, as there), 0 or a layer
        holding nothing yet: a no-op (as transformers' ``DynamicLayer``). A full-precision sliding window
        recording its past (``activate_past_recording``) is then trimmed back to its last ``W - 1`` tokens, also by
        ``crop(0)``, as ``DynamicSlidingWindowLayer``.

        Only tokens still in full precision can be removed (the buffer, or the sinks when nothing was
        quantized yet): quantized blocks are never dequantized and re-split. Anything else raises
        ``ValueError`` (also removing more tokens than the layer holds, which transformers' slicing would
        silently turn into an empty or wrong-length cache), and the layer is left as it was; an argument that
        is not an int (a bool, float, str or tensor) raises ``TypeError``.
        """
        r = self.tokens_to_crop(tokens_to_remove)
        if r:
            self._k.crop_tail(r)
            self._v.crop_tail(r)
            self.tokens_seen -= r
            # lazy checks: the next window's token positions start where the kept tokens end
            self.checks.checked_tokens = min(self.checks.checked_tokens, self.tokens_seen)
            if self.held_at is not None:
                self.held_at = min(self.held_at, self.tokens_seen)
        if self.record_past and self.is_sliding and self.is_initialized:  # back to the window update() keeps
            self._trim_window(self.tokens_seen)

    def observe_flushes(self, fn: FlushObserver | None) -> None:
        """Call ``fn(layer, side, x, qt)`` for every chunk this layer quantizes from now on (``None``: stop):
        ``side`` is ``"key"`` or ``"value"``, ``x`` ``(B, H_kv, n, D)`` the tokens as quantized (un-rotated for
        pre-RoPE keys), ``qt`` their ``QuantizedTensor``. Called inside ``update``, before the chunk joins the
        store; used by ``kvbits.monitor`` for its online error signal."""
        for side, store in (("key", self._k), ("value", self._v)):
            store.observer = None if fn is None else functools.partial(fn, self, side)

    @property
    def flushes_observed(self) -> bool:
        """Whether ``observe_flushes`` has a function set (a monitor is attached)."""
        return self._k.observer is not None or self._v.observer is not None

    def hold_full_precision(self) -> bool:
        """Stop quantizing this layer for the rest of the request: later tokens stay in the full-precision
        buffer, which is no longer flushed (the monitor's fallback, ``kvbits.monitor``). What is already
        quantized stays as it is (its precision is gone); ``reset()`` (a new request) quantizes again.

        Memory grows by the incoming dtype's bytes per token from here on, and ``memory_report()`` counts
        them (``full_tokens``, ``held_at``). Quantized slots reserved for ``max_cache_len`` past the tokens
        already quantized are released (``SideStore.release_reservation``): they would never be written.
        Returns whether the layer now holds: ``False`` for a layer that does not quantize (identity scheme,
        sliding fallback) and for sliding-window layers, whose buffer would outgrow the window.
        """
        if self.mode != "quantized" or self.is_sliding:
            return False
        if self.held_at is None:
            self.held_at = self.tokens_seen
            if not self._flushing:  # else a flush observer called: update releases once its flushes are done
                self._release_reservations()
        return True

    def _release_reservations(self) -> None:
        """A held layer gives back the slots reserved for ``max_cache_len`` past the tokens already quantized: they
        would never be written (``hold_full_precision``)."""
        freed = self._k.release_reservation() + self._v.release_reservation()
        logger.info("layer %d: held in full precision from token %d on%s", self.layer_idx, self.held_at,
                    f" ({freed} reserved bytes released)" if freed else "")  # fmt: skip

    def tokens_to_crop(self, tokens_to_remove: int) -> int:
        """How many tokens ``crop(tokens_to_remove)`` removes (0: none); ``ValueError`` when it cannot. Changes
        nothing (``QuantizedKVCache.crop`` asks every layer before cropping any); ``TypeError`` unless an int."""
        tokens_to_remove = check_crop_arg(tokens_to_remove)
        n = self.tokens_seen
        if tokens_to_remove > 0:
            if tokens_to_remove >= n:
                return 0
            r = n - tokens_to_remove
        else:
            r = -tokens_to_remove
        if r == 0 or not self.is_initialized:
            return 0
        if r > n:
            raise ValueError(
                f"layer {self.layer_idx}: crop({tokens_to_remove}) would remove {r} tokens but the layer holds {n}"
            )
        if self.is_sliding and self.dropped_tokens > max(0, n - r - self.sliding_window + 1):
            hint = ""
            if self.mode != "quantized" and not self.record_past:
                hint = " (activate_past_recording() before the updates to be rolled back keeps them)"
            raise ValueError(
                f"layer {self.layer_idx}: cannot crop {r} tokens from a sliding-window layer that already dropped "
                f"{self.dropped_tokens} tokens the shorter sequence would need{hint}"
            )
        removable = self._k.n_buffer + (self._k.n_sinks if self._k.n_quantized == 0 else 0)
        if r > removable:
            raise ValueError(
                f"layer {self.layer_idx}: cannot crop {r} tokens; only the last {removable} of {n} tokens are "
                "still in full precision (quantized blocks are never dequantized and re-split)"
            )
        if self.mode == "quantized" and self.held_at is None:
            # the shorter sequence's split: a block flushed by the updates being rolled back stays quantized, which
            # a cache that never saw them would still hold in full precision (fewer than `residual` recent tokens)
            want = token_split(self._split_scheme, n - r, self.sliding_window)
            if self._k.n_quantized + self.dropped_tokens > want.quantized + want.dropped:
                raise ValueError(
                    f"layer {self.layer_idx}: cannot crop {r} tokens; a block was quantized since they arrived (the "
                    f"layer holds {self._k.n_quantized} quantized tokens, a {n - r}-token sequence {want.quantized}): "
                    "a rollback is exact only when no flush happened since the removed tokens arrived"
                )
        return r

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select sequences ``beam_idx`` (beam search) in every stored tensor, scales included: row ``i`` becomes
        cached row ``beam_idx[i]``. ``beam_idx``: a 1-D int64 (or int32) tensor, each index in ``[0, batch)``;
        its length is the new batch and may differ from the old one (as transformers' ``index_select``). Anything
        else raises ``TypeError`` / ``ValueError`` (``check_beam_idx``: one host sync for the range) and leaves
        the layer as it was. A layer holding nothing yet checks the type and shape only."""
        check_beam_idx(beam_idx, self.batch_size, f"layer {self.layer_idx} reorder_cache")
        self._reorder(beam_idx)

    def _reorder(self, beam_idx: torch.Tensor) -> None:
        """``reorder_cache`` with ``beam_idx`` already checked (``QuantizedKVCache`` checks once for all layers)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            self._map_batch(lambda t: t.index_select(0, idx))

    @property
    def batch_size(self) -> int | None:
        """Sequences cached (``None`` before the first update)."""
        return None if self._k.buffer is None else self._k.buffer.shape[0]

    @property
    def can_clip(self) -> bool:
        """Whether flushes can count clipped values: a quantizing layer with a static (fixed-scale) spec, or with
        vLLM's integer zero-points (``integer_zero``: a token whose range excludes 0 clamps its zero-point code and
        loses the far end of its range, ``kvbits.quant.affine.integer_zero_qparams``)."""
        return self.mode == "quantized" and any(s.static or s.integer_zero for s in (self.scheme.key, self.scheme.value))

    def quantized_elements(self) -> tuple[int, int]:
        """K and V elements quantized so far, including blocks a sliding window dropped since (what ``clipped()``
        counts against). Counted as they were quantized, as ``clipped()`` is: a batch op (``reorder_cache``,
        ``batch_repeat_interleave``, ``batch_select_indices``) changes neither, so their ratio stays the fraction
        of what was quantized that clipped (computed from the batch held after such an op, the totals tripled or
        shrank against unchanged counts)."""
        return self._k.elements_quantized, self._v.elements_quantized

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices, ...])

    def _map_batch(self, fn) -> None:
        self._k.map_batch(fn)
        self._v.map_batch(fn)

    # ---------------------------------------------------------------- reading
    def materialize(self, *, check: bool = True, view: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V attention would see now, ``(B, H_kv, T_visible, D)`` in the incoming dtype (the stored
        heads repeated back as ``update`` returns them: ``(B, repeat * H_kv, T_visible, D)``).

        Full attention: every token; sliding window: the last ``min(T, W - 1)`` tokens (what
        ``DynamicSlidingWindowLayer`` holds). ``check``: run the pending lazy K/V check first (one host
        sync; ``False`` on per-step paths, which leave it to the periodic check). ``view``: where a reserved
        workspace holds them, views of it that later steps overwrite (``SideStore.materialize``), for K/V
        used at once; by default new tensors.
        """
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} holds no tokens yet")
        if check:
            kv_checks.run_checks([self])
        keys, values = self._k.materialize(self.dtype, view=view), self._v.materialize(self.dtype, view=view)
        if self.is_sliding:
            visible = min(self.tokens_seen, self.sliding_window - 1)
            keys, values = keys[:, :, keys.shape[2] - visible :], values[:, :, values.shape[2] - visible :]
        return self._repeat_heads(keys), self._repeat_heads(values)

    def report(self) -> dict:
        """Bytes and token split of this layer (one entry of ``memory_report()["layers"]``)."""
        sinks = self._k.n_sinks
        quant = self._k.n_quantized
        full = self._k.n_buffer
        stored = min(self.tokens_seen, self.sliding_window - 1) if self.is_sliding else self.tokens_seen
        return {
            "layer": self.layer_idx,
            "key_bytes": self._k.nbytes(),
            "value_bytes": self._v.nbytes(),
            "tokens_seen": self.tokens_seen,
            "sink_tokens": sinks,
            "quantized_tokens": quant,
            "reserved_tokens": max(self._k.reserved_slots, self._v.reserved_slots),  # max_cache_len: slots held
            "full_tokens": full,
            "dropped_tokens": self.dropped_tokens,
            "sliding_window": self.sliding_window,
            "mode": self.mode,
            "held_at": self.held_at,
            "kv_heads": 0 if self._k.buffer is None else self._k.buffer.shape[1],
            "head_repeat": self.repeat,
            "batch": self.batch_size or 0,
            "workspace_bytes": self._k.workspace_bytes() + self._v.workspace_bytes(),
            "position_bytes": sum(0 if t is None else t.nbytes for t in (self._k.pos_offset, self._k.pad_rows)),
            # K + V elements an fp16 cache holds at this length (kvbits.plan's ``elements``: a sliding layer keeps
            # W - 1 tokens), whatever this layer still holds of blocks partly out of its window
            "fp16_elements": sum(
                0 if s.buffer is None else stored * s.buffer.shape[0] * s.buffer.shape[1] * s.buffer.shape[3]
                for s in (self._k, self._v)
            ),
        }

    def components(self) -> dict[str, list[torch.Tensor]]:
        """Every stored tensor of K and V by kind (see ``SideStore.components``)."""
        k, v = self._k.components(), self._v.components()
        return {name: k[name] + v[name] for name in k}

    def clipped_counts(self) -> tuple[int | torch.Tensor, int | torch.Tensor]:
        """``clipped()`` as kept: host ints (eager checks) or 0-dim int64 device tensors (lazy; no sync here)."""
        return self._k.clipped, self._v.clipped

    def clipped(self) -> tuple[int, int]:
        """Values that saturated against their (static) scales so far, for keys and values (exact; with
        lazy checks the counts live on the device and reading them is a host sync)."""
        return int(self._k.clipped), int(self._v.clipped)

    def expected_split(self):
        """``token_split`` for the tokens seen (what this layer's report must equal until a ``crop``); a held
        layer (``hold_full_precision``) keeps every token since ``held_at`` in full precision: in the sinks while
        they are not complete (``update`` fills them whether held or not), in the buffer after."""
        if self.held_at is None:
            return token_split(self._split_scheme, self.tokens_seen, self.sliding_window)
        split = token_split(self._split_scheme, self.held_at, self.sliding_window)
        since = self.tokens_seen - self.held_at
        to_sinks = min(since, self.sinks - split.sink)  # held layers are full attention: sinks kept
        return replace(split, sink=split.sink + to_sinks, full=split.full + since - to_sinks)
