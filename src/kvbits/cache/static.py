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
  writes its token at slot ``length % W``, then quantizes the window's oldest ``block`` tokens and writes them at
  quantized slots ``qlen`` on, at every step: when the window is full that is the flush, and ``qlen`` advances by
  ``block`` (a device ``where``, not a branch); before, the write lands past ``qlen``, where nothing attends, and the
  flush rewrites it. So every step launches the same work, flush or not, and stores what ``QuantizedKVCache``
  stores (it flushes when its buffer holds ``residual + block`` tokens). An update of several tokens (a prefill)
  reads the lengths once (a host sync) and flushes whole blocks at once;
- attention sees every position: ``update`` returns ``(B, H_kv, max_cache_len, D)`` K/V (quantized slots
  dequantized, the window's tokens at their positions; the mask transformers builds for ``get_mask_sizes``'
  ``max_cache_len`` hides the rest), or, on decode steps of a model routed through ``kvbits_fused``
  (``use_fused_decode``), zero-byte placeholders: the fused kernel then reads the packed slots with each sequence's
  length taken from the device and the window as its full-precision tail (its slots masked unless they hold tokens
  not yet quantized), launched for all reserved slots (``PackedStore(uniform_lens=False)``), the same at every step;
- K/V checks are kept on the device (a running ``max |x|`` per side, NaN propagating) and read by ``check_inputs()``
  and ``memory_report()`` (``checks="lazy"``), or made before each write (``checks="eager"``: a host sync, so not
  inside a captured step); ``"auto"``: eager on CPU, lazy elsewhere. Inside ``torch.compile`` they are lazy whatever
  the mode, and the host's token count (below) is not kept.

Schemes (``static_reason``): INT2/3/4/8 and FP8 codes with one scale per token (whole rows or channel groups, affine or
symmetric, vLLM's rounding and integer zero-points, Hadamard rotations) or per-channel groups of tokens within the
flush block (KIVI's keys); float layers of a mixed scheme (``"kivi-4,0=fp16"``) keep float slabs. Sinks, pre-RoPE
keys, outliers and calibrated parameters (static scales, NUQ codebooks, centring) need positions or statistics the
host tracks: ``QuantizedKVCache`` serves them.

Bytes: the quantized slots are those ``kvbits.plan`` counts at ``max_cache_len`` (per-token schemes: exactly the
plan), plus, for a windowed scheme, one block written ahead of them; the window holds ``residual + block`` tokens
where the plan counts those left unquantized at ``max_cache_len`` (``residual`` to ``residual + block - 1``).
``memory_report()`` counts what is held.

What the host still tracks: ``tokens_written`` counts the tokens of eager ``update`` calls, to refuse a sequence
longer than ``max_cache_len`` with a clear error. Replayed steps do not run ``update``, so a graph's caller keeps
its positions below ``max_cache_len`` itself (as with ``StaticCache``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbits.cache import fused
from kvbits.cache.checks import check_channel_groups, check_mode, input_bound, write_maxima
from kvbits.kernels.quantize import quantize_pack
from kvbits.kernels.reference import PackedStore, PackedTensor, dequantize_packed, pack_side, word_rows
from kvbits.quant.checks import check_kv
from kvbits.quant.tensor import FLOAT_DTYPES, quantize
from kvbits.schemes import get_scheme
from kvbits.schemes.accounting import PACKED_KINDS, token_split
from kvbits.schemes.spec import KVScheme, TensorSpec

__all__ = ["StaticQuantizedKVCache", "StaticQuantizedLayer", "static_reason"]

_SLOT_FIELDS = ("codes", "scale", "zero", "outlier_values", "outlier_index")  # PackedTensor fields with a slot axis


def _side_reason(spec: TensorSpec, block: int) -> str | None:
    if spec.kind not in PACKED_KINDS or spec.kind == "nuq":
        return f"kind {spec.kind!r} (int and fp8 codes only; NUQ codebooks are calibrated)"
    if spec.granularity == "channel" and (spec.group_size is None or block % spec.group_size):
        return "per-channel scales without a token group dividing the flush block (static ranges are calibrated)"
    if spec.granularity not in ("token", "channel"):
        return f"{spec.granularity} granularity (one scale per token or per channel group only)"
    if spec.static:
        return "static (calibrated) scales"
    if spec.pre_rope:
        return "pre-RoPE keys (un-rotated at positions the host tracks)"
    if spec.outlier_frac:
        return "dense-and-sparse outliers"
    if spec.has_channel_transform:
        return "centred / smoothed channels (calibrated vectors)"
    return None


def static_reason(scheme: KVScheme) -> str | None:
    """Why a (flat) scheme cannot be stored in fixed slabs (``None``: it can); see the module docstring."""
    if scheme.is_identity:
        return None
    if scheme.sinks:
        return f"sinks={scheme.sinks} (attention sinks kept apart; none here)"
    for side, spec in (("key", scheme.key), ("value", scheme.value)):
        if spec.kind == "float":
            return f"{side}s kept in {spec.fmt} beside quantized {'values' if side == 'key' else 'keys'}"
        why = _side_reason(spec, scheme.block)
        if why is not None:
            return f"{side}s: {why}"
    return None


class StaticQuantizedLayer(CacheLayerMixin):
    """One full-attention layer's fixed slabs (see the module docstring).

    Attributes (after the first ``update``):
        key, value: ``PackedTensor`` slabs of quantized slots (quantized schemes), else ``None``.
        key_full, value_full: ``(B, H_kv, max_cache_len, D)`` float slabs (float schemes), a windowed scheme's
            ``(B, H_kv, residual + block, D)`` window, else ``None``.
        length, qlen: 0-dim int64, tokens written and tokens quantized (device); ``lens``: ``(B,)`` int32, the
            quantized slots each sequence attends (its written ones for float layers), for the kernels.
        window_pos: ``(residual + block,)`` int64, the position each window slot holds (``-1``: none yet).
        maxima: ``(2,)`` float32 running ``max |K|``, ``max |V|`` of the unchecked tokens (lazy checks).
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(
        self, scheme: KVScheme, max_cache_len: int, layer_idx: int, *, fused_decode: fused.FusedMode = "auto",
        checks: str = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        reason = static_reason(scheme)
        if reason is not None:
            raise ValueError(
                f"layer {layer_idx}: scheme {scheme.name!r} cannot be stored in fixed slabs: {reason}; "
                "QuantizedKVCache (with max_cache_len=) serves it"
            )
        self.scheme, self.max_cache_len, self.layer_idx = scheme, max_cache_len, layer_idx
        self.checks = check_mode(checks)
        self.fused = fused.FusedState(mode=fused_decode)
        self.tokens_written = 0
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

    # ------------------------------------------------------------------ allocation
    @property
    def windowed(self) -> bool:
        """Whether tokens pass through a full-precision window first (``residual > 0`` or ``block > 1``)."""
        return not self.scheme.is_identity and (self.scheme.residual > 0 or self.scheme.block > 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the slabs for ``key_states``' batch, heads, head dim, dtype and device (zeros)."""
        B, H, _, D = key_states.shape
        if value_states.shape[:2] != (B, H) or value_states.shape[3] != D:
            raise ValueError(
                f"layer {self.layer_idx}: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} must "
                "share batch, heads and head dim"
            )
        device = key_states.device
        self.device, self.dtype, self._shape = device, key_states.dtype, (B, H, D)
        self.length = self.length.to(device)
        self.qlen = torch.zeros((), dtype=torch.int64, device=device)
        self.lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.maxima = torch.zeros(2, dtype=torch.float32, device=device)
        self._step_max = torch.zeros(2, dtype=torch.float32, device=device)  # this update's, before the maximum
        self._other_lens = torch.zeros(B, dtype=torch.int32, device=device)  # the other side's: 0, or the window's
        self._lazy = self.checks == "lazy" or (self.checks == "auto" and device.type != "cpu")
        if self.scheme.is_identity:  # fp16 / bf16 schemes store every token in their own format
            shape = (B, H, self.max_cache_len, D)
            self.key_full = torch.zeros(shape, dtype=FLOAT_DTYPES[self.scheme.key.fmt], device=device)
            self.value_full = torch.zeros(shape, dtype=FLOAT_DTYPES[self.scheme.value.fmt], device=device)
        else:
            check_channel_groups(self.scheme, D, D, f"layer {self.layer_idx}")
            slots = self.max_cache_len
            if self.windowed:  # the tokens quantized at max_cache_len, and one block written ahead of them
                slots = token_split(self.scheme, self.max_cache_len).quantized + self.scheme.block
                window = self.scheme.residual + self.scheme.block
                self.key_full = torch.zeros((B, H, window, D), dtype=key_states.dtype, device=device)
                self.value_full = torch.zeros_like(self.key_full)
                self.window_pos = torch.full((window,), -1, dtype=torch.int64, device=device)
                self._other_lens.fill_(window)
            self.key = self._slab(self.scheme.key, key_states, slots)
            self.value = self._slab(self.scheme.value, value_states, slots)
        self._bounds = (input_bound(self.scheme.key, "quantized", D)[0], input_bound(self.scheme.value, "quantized", D)[0])
        self.is_initialized = True

    def _slab(self, spec: TensorSpec, like: torch.Tensor, slots: int) -> PackedTensor:
        """A zero ``PackedTensor`` of ``slots`` token slots in the layout ``quantize`` + ``pack_side`` give ``spec``."""
        B, H, _, D = like.shape
        n = self.scheme.block  # a whole flush block: per-channel groups need their tokens
        one = pack_side([quantize(torch.zeros((B, H, n, D), dtype=like.dtype, device=like.device), spec,
                                  validate=False, sync=False)])  # fmt: skip
        fields = {}
        for name in _SLOT_FIELDS:
            t = getattr(one, name)
            if t is not None:
                rows = slots // one.tps if name in ("scale", "zero") else slots
                fields[name] = torch.zeros((B, H, rows, t.shape[3]), dtype=t.dtype, device=t.device)
        return replace(one, **fields)

    # ------------------------------------------------------------------ writing
    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Structural checks (host metadata only), the host's token count, and the K/V checks (eager: now)."""
        B, H, D = self._shape  # type: ignore[misc]
        for what, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (B, H, D):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"layer {self.layer_idx}: {what} must be (B={B}, H_kv={H}, q, D={D}), got {got}")
            if x.dtype != self.dtype or x.device != self.device:
                raise ValueError(
                    f"layer {self.layer_idx}: {what} is {x.dtype} on {x.device}; the slabs were made for {self.dtype} "
                    f"on {self.device} (reset() keeps them: make a new cache)"
                )
        q = key_states.shape[2]
        if value_states.shape[2] != q:
            raise ValueError(f"layer {self.layer_idx}: {q} keys but {value_states.shape[2]} values")
        if self.tokens_written + q > self.max_cache_len:
            raise ValueError(
                f"layer {self.layer_idx}: {self.tokens_written} tokens cached + {q} new > max_cache_len="
                f"{self.max_cache_len} (the slabs are fixed: make the cache with a larger max_cache_len)"
            )
        if not self._lazy:
            for what, x, bound in (("keys", key_states, self._bounds[0]), ("values", value_states, self._bounds[1])):
                check_kv(x, f"layer {self.layer_idx} {what}")
                if bound < float("inf") and x.numel() and float(x.detach().abs().amax()) > bound:
                    raise ValueError(
                        f"layer {self.layer_idx} {what}: |x| up to {float(x.abs().amax()):.4g}, beyond {bound:.4g} "
                        f"({input_bound(self.scheme.key if what == 'keys' else self.scheme.value, 'quantized', x.shape[3])[1]})"
                    )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(B, H_kv, q, D)`` K/V at positions ``length + arange(q)``; return what attention reads.

        Returns every position's K/V ``(B, H_kv, max_cache_len, D)`` in the K/V dtype (quantized ones dequantized), or,
        on a claimed layer's decode step (``q == 1``, ``kvbits_fused``), tagged zero-byte placeholders of that shape.
        Device work only, no host read, unless ``checks`` is eager or a windowed layer gets ``q > 1`` tokens at once
        (a prefill: it reads the lengths once).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        compiling = torch.compiler.is_compiling()  # traced once, replayed: the host's count and eager checks stay out
        if not compiling:
            self._check(key_states, value_states)
        q = key_states.shape[2]
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
        elif not self.windowed:  # every token quantized as it arrives
            self._write_codes(key_states, value_states, self.length)
            self.length.add_(q)
            self.lens.copy_(self.length.expand(self.lens.shape[0]))
        elif q == 1:
            self._window_step(key_states, value_states)
        elif q:
            self._window_many(key_states, value_states)
        if q == 1 and self.fused.claimed and fused.serving(self):
            B, H, D = self._shape  # type: ignore[misc]
            keys = torch.empty((B, H, self.max_cache_len, D), dtype=self.dtype, device="meta")
            return fused.tag(self, keys, placeholder=True), torch.empty_like(keys)
        keys, values = self.materialize()
        return fused.tag(self, keys), values

    def _write_codes(self, k: torch.Tensor, v: torch.Tensor, slot0: torch.Tensor) -> None:
        """Quantize ``(B, H_kv, n, D)`` K/V and write them at slots ``slot0 + arange(n)`` (``slot0`` a 0-dim tensor;
        scale rows ``slot0 / tps + arange(n / tps)``)."""
        n = k.shape[2]
        for slab, x, spec in ((self.key, k, self.scheme.key), (self.value, v, self.scheme.value)):
            new = pack_side([quantize_pack(x, spec, validate=False, sync=False)])  # Triton on CUDA: one launch
            slots = torch.arange(n, device=self.device) + slot0
            rows = slots if slab.tps == 1 else torch.arange(n // slab.tps, device=self.device) + slot0 // slab.tps
            for name in _SLOT_FIELDS:
                if getattr(slab, name) is not None:
                    getattr(slab, name).index_copy_(2, rows if name in ("scale", "zero") else slots, getattr(new, name))

    def _window_step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token through the window, on the device alone (what a captured step replays).

        The token goes to window slot ``length % W`` (``W = residual + block``). Then the oldest ``block`` tokens of
        the window, positions ``qlen + arange(block)``, are quantized and written at quantized slots ``qlen`` on, at
        every step: when the window holds ``W`` tokens that is the flush and ``qlen`` advances by ``block``; before,
        the write lands past ``qlen``, where nothing attends, and the flush rewrites it."""
        W, blk = self.key_full.shape[2], self.scheme.block
        slot = torch.remainder(self.length, W).view(1)
        self.key_full.index_copy_(2, slot, k)
        self.value_full.index_copy_(2, slot, v)
        self.window_pos.index_copy_(0, slot, self.length.view(1))
        self.length.add_(1)
        oldest = torch.remainder(torch.arange(blk, device=self.device) + self.qlen, W)
        self._write_codes(self.key_full.index_select(2, oldest), self.value_full.index_select(2, oldest), self.qlen)
        self.qlen.add_((self.length - self.qlen >= W).to(torch.int64) * blk)
        self.lens.copy_(self.qlen.expand(self.lens.shape[0]))

    def _window_many(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """``q > 1`` tokens (a prefill): the lengths read once (a host sync), whole blocks flushed, the rest kept."""
        W, blk, R = self.key_full.shape[2], self.scheme.block, self.scheme.residual
        L0, Q0 = int(self.length), int(self.qlen)
        held = torch.remainder(torch.arange(Q0, L0, device=self.device), W)
        ks = torch.cat([self.key_full.index_select(2, held), k], dim=2)  # positions Q0 .. L0 + q - 1
        vs = torch.cat([self.value_full.index_select(2, held), v], dim=2)
        n = max(0, (ks.shape[2] - R) // blk) * blk
        if n:
            self._write_codes(ks[:, :, :n], vs[:, :, :n], self.qlen)
        pos = torch.arange(Q0 + n, L0 + k.shape[2], device=self.device)
        slots = torch.remainder(pos, W)
        self.key_full.index_copy_(2, slots, ks[:, :, n:])
        self.value_full.index_copy_(2, slots, vs[:, :, n:])
        self.window_pos.index_copy_(0, slots, pos)
        self.length.fill_(L0 + k.shape[2])
        self.qlen.fill_(Q0 + n)
        self.lens.copy_(self.qlen.expand(self.lens.shape[0]))

    # ------------------------------------------------------------------ reading
    def _in_window(self) -> torch.Tensor:
        """``(W,)`` bool: the window slots holding tokens not yet quantized (positions in ``[qlen, length)``)."""
        return (self.window_pos >= self.qlen) & (self.window_pos < self.length)

    def materialize(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position, dequantized: K and V ``(B, H_kv, max_cache_len, D)`` in the K/V dtype (positions not
        written yet hold zeros or stale values; the attention mask hides them)."""
        if self.scheme.is_identity:
            return self.key_full.to(self.dtype), self.value_full.to(self.dtype)
        keys, values = dequantize_packed(self.key, self.dtype), dequantize_packed(self.value, self.dtype)
        if not self.windowed:
            return keys, values
        T = self.max_cache_len
        n = min(T, keys.shape[2])
        at = torch.where(self._in_window(), self.window_pos, T)  # the window's tokens at their positions; the rest: T
        out = []
        for dense_q, window in ((keys, self.key_full), (values, self.value_full)):
            dense = dense_q.new_zeros((*dense_q.shape[:2], T + 1, dense_q.shape[3]))
            dense[:, :, :n] = dense_q[:, :, :n]
            dense.index_copy_(2, at, window.to(dense.dtype))
            out.append(dense[:, :, :T])
        return out[0], out[1]

    def fused_store(self, keep: torch.Tensor | None = None) -> PackedStore:
        """The slabs as the decode kernels read them, sized for ``max_cache_len`` whatever the length: the quantized
        slots with each sequence's length from the device (``lens``), and a windowed layer's window as the tail, its
        slots masked unless they hold tokens not yet quantized. ``keep`` ``(B, max_cache_len)`` bool (``False``: left
        padding) masks positions."""
        if self.scheme.is_identity:
            mask = None if keep is None else word_rows(keep)
            return PackedStore(None, None, self.key_full, self.value_full, self._other_lens, self.lens, full_mask=mask)
        if not self.windowed:
            mask = None if keep is None else word_rows(keep)
            return PackedStore(self.key, self.value, None, None, self.lens, self._other_lens, quant_mask=mask)
        B = self.lens.shape[0]
        in_window = self._in_window().expand(B, -1)
        quant_mask = None
        if keep is not None:
            quant_mask = word_rows(keep[:, : self.key.n_slots], self.key.n_slots)
            at = self.window_pos.clamp(0, keep.shape[1] - 1).expand(B, -1)
            in_window = in_window & keep.gather(1, at)
        return PackedStore(self.key, self.value, self.key_full, self.value_full, self.lens, self._other_lens,
                           quant_mask=quant_mask, full_mask=in_window.contiguous())  # fmt: skip

    def fused_reason(self, query: torch.Tensor) -> str | None:
        """Why the fused path would not take this layer for ``query`` (``"auto"`` on CUDA: what Triton declines)."""
        if self.fused.mode != "auto" or fused.dispatch.kernel_mode() != "auto":
            return None
        from kvbits.kernels.triton_decode import TRITON_BITS, supported

        for side, spec in (("key", self.scheme.key), ("value", self.scheme.value)):
            if spec.kind == "int" and spec.bits not in TRITON_BITS:
                return f"{side}: {spec.bits}-bit codes (Triton kernel: {TRITON_BITS})"
        return supported(self.fused_store(), query)

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens written, as the device tensor (``StaticLayer`` does the same: no host read)."""
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(max_cache_len, 0)``: attention spans every slot (transformers 5.17 and 5.25 call this differently)."""
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers before 5.16's name
        return self.max_cache_len

    def state_tensors(self) -> list[torch.Tensor]:
        """The counters, lengths, window positions and check maxima: the step's state, not K/V."""
        ts = (self.length, self.qlen, self.lens, self._other_lens, self.window_pos, self.maxima, self._step_max)
        return [t for t in ts if t is not None]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``quantized`` (codes, scales, zero-points) and ``full`` (float slabs, a windowed layer's
        window)."""
        quantized = sum(p.nbytes for p in (self.key, self.value) if p is not None)
        full = sum(t.nbytes for t in (self.key_full, self.value_full) if t is not None)
        return {"quantized": quantized, "full": full}

    def read_checks(self) -> None:
        """Read the lazy K/V checks (one host sync); ``ValueError`` naming the side. Eager layers: nothing."""
        if not self.is_initialized or not self._lazy:
            return
        k, v = (float(x) for x in self.maxima.tolist())
        for what, m, bound in (("keys", k, self._bounds[0]), ("values", v, self._bounds[1])):
            if not math.isfinite(m) or m > bound:
                held = f"|x| up to {m:.4g}" if math.isfinite(m) else "NaN or inf"
                raise ValueError(
                    f"layer {self.layer_idx}: {what} written to the cache held {held} (bound {bound:.4g}): they were "
                    "stored as unusable codes; reset() the cache"
                )

    def reset(self) -> None:
        """Back to no tokens, in place (the slabs keep their addresses, so a captured graph stays valid)."""
        self.tokens_written = 0
        self.length.zero_()
        self.fused.claimed, self.fused.claimed_by = False, None
        if not self.is_initialized:
            return
        self.lens.zero_()
        self.qlen.zero_()
        self.maxima.zero_()
        if self.window_pos is not None:
            self.window_pos.fill_(-1)
        for p in (self.key, self.value):
            if p is not None:
                for name in _SLOT_FIELDS:
                    if getattr(p, name) is not None:
                        getattr(p, name).zero_()
        for t in (self.key_full, self.value_full):
            if t is not None:
                t.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("StaticQuantizedKVCache does not reorder beams; QuantizedKVCache does")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("StaticQuantizedKVCache cannot be cropped; QuantizedKVCache can")


class StaticQuantizedKVCache(Cache):
    """A transformers ``Cache`` of fixed quantized slabs that a CUDA graph can replay (see the module docstring).

    Args:
        config: the model's config: its layers (full attention only) and their count.
        scheme: a per-token or windowed (KIVI-style) scheme (``static_reason``): preset name, dict, path or
            ``KVScheme``; mixed schemes may keep whole layers in float (``"int4-token,0=fp16"``).
        max_cache_len: slots per sequence (prompt + generated tokens), reserved at each layer's first ``update``.
        num_layers: layer count without a config.
        fused_decode: as ``QuantizedKVCache``'s (``"auto"``: the fused kernel on CUDA with Triton, when the model's
            attention is ``kvbits_fused``).
        checks: ``"auto"`` (eager on CPU, lazy elsewhere), ``"eager"`` (a host sync per update: not for captured
            steps) or ``"lazy"`` (read by ``check_inputs()`` and ``memory_report()``).
    """

    def __init__(
        self, config: Any = None, scheme: str | dict | KVScheme = "int8-token", *, max_cache_len: int,
        num_layers: int | None = None, fused_decode: bool | str = "auto", checks: str = "auto",
    ) -> None:  # fmt: skip
        from kvbits.cache.cache import _layer_types, attention_shape
        from kvbits.cache.layer import check_max_cache_len
        from kvbits.plan.config import text_config

        self.scheme = get_scheme(scheme)
        if check_max_cache_len(max_cache_len) is None:
            raise ValueError("max_cache_len is required: the slabs are reserved for it")
        self._max_len = max_cache_len
        self.fused_decode = fused.check_mode(fused_decode)
        if config is not None:
            n_layers = attention_shape(config)[0]
            types, _ = _layer_types(text_config(config), n_layers)
            other = sorted({t for t in types if t != "full_attention"})
            if other:
                raise NotImplementedError(
                    f"StaticQuantizedKVCache holds full-attention layers only; the config has {other} layers "
                    "(QuantizedKVCache serves sliding and chunked layers)"
                )
            if num_layers is not None and num_layers != n_layers:
                raise ValueError(f"num_layers={num_layers} but the config describes {n_layers} layers")
            num_layers = n_layers
        if num_layers is None or isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"give config= or a positive num_layers, got num_layers={num_layers!r}")
        self.scheme.check_layer_count(num_layers, "the cache's")
        layers = [StaticQuantizedLayer(self.scheme.for_layer(i), max_cache_len, i, fused_decode=self.fused_decode,
                                       checks=checks) for i in range(num_layers)]  # fmt: skip
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return f"StaticQuantizedKVCache(scheme={self.scheme.name!r}, layers={len(self.layers)}, max_cache_len={self._max_len})"

    @property
    def max_cache_len(self) -> int:
        return self._max_len

    def check_inputs(self) -> None:
        """Read every layer's lazy K/V checks (a host sync); ``ValueError`` for NaN, inf or ``|x|`` past a bound."""
        for layer in self.layers:
            layer.read_checks()

    def memory_report(self) -> dict[str, Any]:
        """Bytes of the slabs (every reserved slot: what ``kvbits.plan`` counts at ``max_cache_len``), after the
        lazy checks. ``state_bytes``: the length counters and check maxima, reported apart (not K/V)."""
        self.check_inputs()
        quantized = sum(layer.nbytes()["quantized"] for layer in self.layers)
        full = sum(layer.nbytes()["full"] for layer in self.layers)
        state = sum(t.nbytes for layer in self.layers if layer.is_initialized
                    for t in layer.state_tensors())  # fmt: skip
        return {"scheme": self.scheme.name, "total_bytes": quantized + full, "quantized_bytes": quantized,
                "full_bytes": full, "state_bytes": state, "max_cache_len": self._max_len}  # fmt: skip
