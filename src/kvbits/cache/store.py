"""`SideStore`: what one layer holds for one of K or V.

Token order inside a store is ``sinks | quantized chunks | buffer``: the first ``sinks`` tokens in
full precision, then the flushed blocks (packed codes + float16 metadata, ``QuantizedTensor``), then
the full-precision buffer of not-yet-flushed tokens. Every tensor here has the batch in dim 0 and the
tokens in dim 2, ``(B, H_kv, T, D)`` for dense tensors.

Flushed blocks are quantized once and never touched again. To keep the number of Python objects
small, consecutive blocks whose quantization is independent per token group (``token`` and
``channel`` granularity, or static scales) are concatenated into one growing chunk: quantizing
``m`` blocks in one call gives bit-identical codes and scales to ``m`` separate calls, because each
scale only reduces over one token, or over a group of tokens inside one block (``block`` is a multiple
of the channel group, see ``KVScheme``). Head / tensor granularity reduce over a whole block, so each
block stays its own chunk.

Growing that one chunk by concatenation copies the layer's whole quantized history at every flush: at
every decode step for per-token schemes (``block = 1``), more bytes than the fused kernel reads. A store
with ``reserve_tokens`` (``QuantizedKVCache(max_cache_len=...)``) allocates the chunk's tensors for that
many tokens at its first flush, zero-filled, and writes each flush in place; the chunk views the slots in
use. The held bytes are then the reservation (``components``), which at ``max_cache_len`` tokens is what
``kvbits.plan`` counts for that context. A dequantized workspace is reserved alike (``workspace_bytes``), for
every token of the layer (``reserve_total``) laid out as ``materialize`` returns them, so a decode step hands
attention a view of it (``materialize(view=True)``) instead of a new copy of the history.
Past the reservation it is released (logged) and the chunk grows by concatenation again.

A long flush (a prefill) is quantized, and a long quantized history decoded, ``SLICE_TOKENS`` tokens at a
time (whole blocks; whole scale groups): the same bits as one call, with the float32 working copies of
one slice instead of the whole history beside what the store holds and returns.

Flushes go through ``kvbits.kernels.quantize.quantize_pack``: one Triton quantize-and-pack kernel on
CUDA for the integer formats it covers, ``kvbits.quant.quantize`` otherwise; both give the same
codes and metadata bit for bit.

Pre-RoPE keys (KVQuant §3.2): the store receives post-RoPE keys; a flushed block is un-rotated at its
absolute positions (``kvbits.quant.rope.RotaryTables``), quantized, and rotated back after
dequantization. Positions are token indices in the cache (``sinks + dropped + quantized`` before
the block), as ``kvbits.evaluate.simulate`` assumes (unpadded rows), minus ``pos_offset`` per
sequence when the model's position ids say otherwise (left padding: ``QuantizedKVLayer.update``
reads them), so every sequence's keys are quantized in their own pre-RoPE frame.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvbits.kernels.quantize import quantize_pack, resolve_quantize_kernel
from kvbits.quant import QuantizedTensor
from kvbits.quant.fp8 import static_fp8_scale
from kvbits.quant.rope import apply_rope, invert_rope
from kvbits.quant.tensor import saturate
from kvbits.schemes.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.kernels.reference import PackedTensor
    from kvbits.quant.rope import RotaryTables

logger = logging.getLogger(__name__)

__all__ = ["SLICE_TOKENS", "SideStore", "flush_pair", "joint_flush", "mergeable", "rope_at"]

SLICE_TOKENS = 4096
"""Tokens quantized (at a flush) or decoded (at a step) in one call, rounded to whole blocks and scale
groups: bounds the float32 working copies to one slice. At 32K tokens a side takes 8 calls instead of 1."""
FIXED_TENSORS = ("static_scale", "static_zero", "codebook", "channel_mean", "channel_factor")
"""The layer-owned parameters a side quantizes with: ``fixed`` bytes, counted once per layer, not per token."""


def mergeable(spec: TensorSpec) -> bool:
    """Whether blocks of ``spec`` may be quantized together and stored as one chunk."""
    return spec.granularity in ("token", "channel") or spec.static or spec.kind == "float"


def rope_at(
    rotary: RotaryTables, x: torch.Tensor, p0: int, *, inverse: bool = False, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """``rotary.rotate`` (``unrotate`` with ``inverse``) of ``x`` ``(B, H, n, D)`` at positions ``p0 ... p0+n-1``,
    without a host sync: the same tables (``RotaryTables`` computes them with the model's rotary module)
    minus ``cos_sin``'s ``positions >= 0`` check, which reads the positions back from the device and is
    true here by construction. ``offset`` ``(B,)``: sequence ``b``'s tokens sit at ``p - offset[b]``
    (left padding: the model's position ids start after the pads; pad tokens get negative positions).
    Negative positions are taken as 0, as the fused decode kernels read them (``kvbits.kernels``): a
    block is un-rotated and rotated back at the same clamped positions on every path, so attention stays
    exact; only the frame such tokens are quantized in differs (pads, which are masked, or position ids
    that start below 0). Length-dependent rope types (``dynamic``, ``longrope``) take tables that depend on the
    slot alone (``RotaryTables.framed_cos_sin``): a block un-rotated when it was flushed is rotated back by the
    same tables on every read, whatever slice the read decodes. (Tables of the slice's length let the two differ
    once a sequence passed the original context: 11-113 % key error on every read without the workspace.)
    The rotation (not the inverse) of float16 / bfloat16 keys is saturated to the dtype's finite range (``saturate``,
    device work only): a dequantized pair within 65504 can rotate to up to ``sqrt(2)`` times it, inf in float16 and
    NaN in attention, where ``kvbits.kernels.reference.materialize`` and the fused kernel (``K_SAT``) saturate too;
    values that stay in range are unchanged bit for bit."""
    rotary._check_x(x)
    n = x.shape[2]
    if rotary.rot_dim == 0:  # a layer without RoPE: empty tables, as cos_sin returns them
        cos = sin = torch.zeros((1, n, 0), dtype=x.dtype, device=x.device)
    else:
        pos = torch.arange(p0, p0 + n, device=x.device)[None]
        if offset is not None:
            pos = (pos - offset.to(x.device)[:, None]).clamp_min(0)  # (B, n), as the kernels clamp
        cos, sin = rotary.framed_cos_sin(pos, p0, x.dtype)
    if inverse:
        return invert_rope(x, cos.to(x.device), sin.to(x.device))
    return saturate(apply_rope(x, cos.to(x.device), sin.to(x.device)), x.dtype)  # a fresh tensor: clamped in place


def _slice_tokens(t: torch.Tensor, n_tokens: int, start: int, stop: int, copy: bool = True) -> torch.Tensor:
    """Tokens ``[start, stop)`` of a tensor whose dim 2 covers ``n_tokens`` tokens in equal units (a clone,
    or with ``copy=False`` a view)."""
    unit = n_tokens // t.shape[2]
    if unit * t.shape[2] != n_tokens or start % unit or stop % unit:
        raise AssertionError(
            f"slice [{start}, {stop}) does not align with {t.shape[2]} groups of {n_tokens} tokens"
        )
    view = t[:, :, start // unit : stop // unit]
    return view.clone() if copy else view


def _token_tensors(qt: QuantizedTensor) -> list[str]:
    """The names of a chunk's tensors that run along its tokens and batch (static scales do not)."""
    names = ["data", "outlier_values", "outlier_index"] + ([] if qt.static else ["scale", "zero"])
    return [n for n in names if getattr(qt, n) is not None]


def _slice_chunk(qt: QuantizedTensor, start: int, stop: int, copy: bool = True) -> QuantizedTensor:
    """Tokens ``[start, stop)`` of a chunk, as a new chunk owning its own (cloned) storage, or with
    ``copy=False`` viewing the chunk's."""
    own = {name: _slice_tokens(getattr(qt, name), qt.n_tokens, start, stop, copy) for name in _token_tensors(qt)}
    B, H, _, D = qt.shape
    return replace(qt, shape=(B, H, stop - start, D), **own)


def _slice_step(qt: QuantizedTensor, tokens: int) -> int:
    """The largest number of tokens, at most ``tokens`` (at least one unit), that slices every tensor of ``qt``
    along whole rows: a multiple of each tensor's tokens per row (a per-channel scale group, ...)."""
    unit = math.lcm(*(qt.n_tokens // getattr(qt, n).shape[2] for n in _token_tensors(qt)))
    return max(unit, tokens // unit * unit)


def _host_zero(clipped: int | torch.Tensor) -> bool:
    """Whether a clip count is the host 0 a dynamic range reports (adding it would launch a kernel for nothing)."""
    return isinstance(clipped, int) and clipped == 0


def _cat_chunks(*chunks: QuantizedTensor) -> QuantizedTensor:
    """One chunk holding the chunks' tokens in order (all of one ``mergeable`` spec)."""
    first = chunks[0]
    if len(chunks) == 1:
        return first
    cat = {name: torch.cat([getattr(c, name) for c in chunks], dim=2) for name in _token_tensors(first)}
    B, H, _, D = first.shape  # stored chunks keep no clip count (SideStore._commit): the merged one neither
    return replace(first, shape=(B, H, sum(c.n_tokens for c in chunks), D), **cat)


def _map_chunk(qt: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
    """Apply a batch-dimension map (index_select, repeat_interleave, ...) to every per-sequence tensor."""
    new = {name: fn(getattr(qt, name)) for name in _token_tensors(qt)}
    data = new["data"]
    return replace(qt, shape=(data.shape[0], *qt.shape[1:]), **new)


def _stack_blocks(chunks: list[QuantizedTensor]) -> QuantizedTensor:
    """Equal-sized chunks stacked along the batch dim (block-major), to dequantize them in one call:
    every granularity reduces within one block of one sequence, so dequantization is unchanged."""
    first = chunks[0]
    if any(c.n_tokens != first.n_tokens for c in chunks):
        raise AssertionError("only equal-sized chunks can be stacked")
    stacked = {n: torch.cat([getattr(c, n) for c in chunks], dim=0) for n in _token_tensors(first)}
    B, H, n, D = first.shape
    return replace(first, shape=(B * len(chunks), H, n, D), **stacked)


class SideStore:
    """Sinks, quantized chunks and full-precision buffer of one of K or V in one layer.

    Args:
        spec: how flushed tokens are stored.
        name: for error messages (``"layer 3 keys"``).
        workspace: also keep the dequantized chunks (in the dtype of the incoming K/V) so that a
            decode step dequantizes only what was flushed since the previous one.
        static_scale, static_zero, codebook: fixed quantization parameters owned by the layer (FP8
            per-tensor scale, calibrated scales, NUQ codebook); passed to ``quantize`` and counted as
            ``fixed`` bytes; so are ``channel_mean`` / ``channel_factor`` (``centre`` / ``smooth`` specs,
            float16 ``(H_kv, D)``), set by ``QuantizedKVLayer.set_static_qparams``.
        rotary: RoPE tables of this layer, for a ``pre_rope`` spec.
    """

    def __init__(
        self,
        spec: TensorSpec,
        *,
        name: str,
        workspace: bool = False,
        static_scale: torch.Tensor | None = None,
        static_zero: torch.Tensor | None = None,
        codebook: torch.Tensor | None = None,
        rotary: RotaryTables | None = None,
    ) -> None:
        self.spec = spec
        self.codebook = codebook
        self.rotary = rotary
        self.name = name
        self.use_workspace = workspace
        self.static_scale = static_scale
        self.static_zero = static_zero
        self.channel_mean: torch.Tensor | None = None
        self.channel_factor: torch.Tensor | None = None
        # False once the static scale is known to have no zero entry (QuantizedKVLayer.set_static_qparams):
        # the kernel path then skips counting what zero scales clip (quantize_pack's zero_scales)
        self.zero_scales = True
        self.sinks: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.chunks: list[QuantizedTensor] = []
        self.work: torch.Tensor | None = None
        # values clipped by every flush so far, a 0-dim int64 device tensor when not `sync`: the one count per side (the
        # chunks' own `clipped` are folded in at each flush and set to 0, so the store holds O(1) counters)
        self.clipped: int | torch.Tensor = 0
        self.sync = True  # False: the flush path never waits for the device (lazy checks)
        self.n_dropped = 0  # quantized tokens forgotten from the front (sliding window)
        # elements quantized so far (what `clipped` counts against), counted as they were quantized: a batch op
        # (map_batch) changes neither, where B * H * tokens * D of the mapped batch would not match the counts
        self.elements_quantized = 0
        # (B,) cache index minus model position per sequence (left padding), pre-RoPE keys; None: 0
        self._pos_offset: torch.Tensor | None = None
        self._positions_ahead: int | None = None  # host copy of -min(pos_offset, 0), read when first needed
        # (B,) bool: sequences whose every update so far held only pads (a chunked prefill), whose pos_offset a later
        # update reads again (kvbits.cache.layer.reread_offset); None: no offset changes any more
        self.pad_rows: torch.Tensor | None = None
        self._packed: PackedTensor | None = None  # kernel-layout view of the chunks (fused decode)
        # quantized slots to allocate once, at the first flush (QuantizedKVLayer's max_cache_len); 0: the one chunk
        # of a mergeable spec grows by concatenation, a copy of the whole history at every flush
        self.reserve_tokens = 0
        # tokens per sequence the layer holds at max_cache_len (sinks + quantized + buffer); 0: none. A reserved
        # workspace spans them all, laid out as materialize returns them (sinks | dequantized | buffer), so a step
        # returns a view of it instead of copying the history (materialize(view=True))
        self.reserve_total = 0
        # the reserved storage: each token tensor of the chunk for reserve_tokens slots (zeros past the chunk,
        # which views its first n_quantized); None: no reservation held
        self._slots: dict[str, torch.Tensor] | None = None
        # the workspace's reserved (B, H, reserve_total, D): `work` views tokens n_sinks... of it (materialize's layout)
        self._work_slots: torch.Tensor | None = None
        self._told_exceeded = False
        # called with (x, qt) for each chunk a flush quantizes: x (B, H_kv, n, D) the tokens as quantized (un-rotated
        # for pre-RoPE keys), qt their QuantizedTensor (kvbits.monitor's online error signal); None: no cost
        self.observer: Callable[[torch.Tensor, QuantizedTensor], None] | None = None

    # ------------------------------------------------------------------ state
    def init(self, like: torch.Tensor, buffer_dtype: torch.dtype, *, sync: bool = True) -> None:
        """Empty storage for K/V shaped like ``like`` ``(B, H_kv, *, D)``; the buffer in ``buffer_dtype``.

        ``sync=False``: flushes and dequantization never wait for the device (``quantize(sync=False)``:
        ``clipped`` accumulates on the device; the codebook was checked when installed).
        """
        self.sync = sync
        B, H, _, D = like.shape
        self.sinks = like.new_empty((B, H, 0, D))
        self.buffer = torch.empty((B, H, 0, D), dtype=buffer_dtype, device=like.device)
        self.chunks = []
        self.work = like.new_empty((B, H, 0, D)) if self.use_workspace else None
        self.clipped = self.n_dropped = self.elements_quantized = 0
        self._packed = self._slots = self._work_slots = None
        self._told_exceeded = False
        self.pos_offset = self.pad_rows = None
        for name in FIXED_TENSORS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(like.device))
        if self.static_scale is not None and self.spec.kind == "fp8" and self.spec.granularity == "head":
            # one scale per stored head: the uncalibrated 1.0 is repeated, a calibrated one must match
            self.static_scale = static_fp8_scale(self.static_scale, "head", H, f"{self.name} static FP8 scale")

    def clear(self) -> None:
        self.sinks = self.buffer = self.work = None
        self.chunks = []
        self.clipped = self.n_dropped = self.elements_quantized = 0
        self._packed = self._slots = self._work_slots = None
        self.pos_offset = self.pad_rows = None

    @property
    def pos_offset(self) -> torch.Tensor | None:
        """``(B,)`` cache index minus the model's position per sequence (pre-RoPE keys); ``None``: 0."""
        return self._pos_offset

    @pos_offset.setter
    def pos_offset(self, value: torch.Tensor | None) -> None:
        self._pos_offset, self._positions_ahead = value, None

    def positions_ahead(self) -> int:
        """How far the model's positions run ahead of the cache indices at most (``max(-pos_offset)``, 0
        when none does: left padding puts them behind). Read from the device once per offsets (one host
        sync per request, by the fused path's RoPE tables, which must cover those positions)."""
        if self._pos_offset is None:
            return 0
        if self._positions_ahead is None:
            self._positions_ahead = max(0, int(-self._pos_offset.min()))
        return self._positions_ahead

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def n_quantized(self) -> int:
        return sum(c.n_tokens for c in self.chunks)

    @property
    def reserved_slots(self) -> int:
        """Quantized slots allocated by a reservation (``reserve_tokens`` once held), 0 when none is held."""
        return self.reserve_tokens if self._slots is not None else 0

    @property
    def n_buffer(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[2]

    # ------------------------------------------------------------- appending
    def append_sinks(self, x: torch.Tensor) -> None:
        """Append ``x`` ``(B, H_kv, n, D)`` to the full-precision sinks."""
        if x.shape[2]:
            self.sinks = torch.cat([self.sinks, x], dim=2)

    def append_buffer(self, x: torch.Tensor) -> None:
        """Append ``x`` ``(B, H_kv, n, D)`` to the buffer (cast to the buffer's dtype)."""
        if x.shape[2]:
            self.buffer = torch.cat([self.buffer, x.to(self.buffer.dtype)], dim=2)

    def flush(self, n_tokens: int, block: int) -> None:
        """Quantize the ``n_tokens`` oldest buffer tokens (a whole number of ``block``-token blocks).

        Each block is quantized exactly once; with a ``mergeable`` spec the blocks go through one
        ``quantize`` call and are appended to the last chunk.
        """
        if n_tokens <= 0:
            return
        assert n_tokens % block == 0 and n_tokens <= self.n_buffer
        p0 = self.n_sinks + self.n_dropped + self.n_quantized
        # sync=False even with eager checks: the codebook's values were checked once when installed (fixed.py) and
        # the eager check bounded the K/V (checks.input_bound) before this flush, so quantize need not re-read
        # either; the clip count is read back here instead (one sync, a static side's only one)
        kw = {"static_scale": self.static_scale, "static_zero": self.static_zero, "sync": False}
        if self.static_scale is not None:
            kw["zero_scales"] = self.zero_scales
        for name in ("codebook", "channel_mean", "channel_factor"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        # whole blocks per quantize call; mergeable blocks up to SLICE_TOKENS at a time, then one chunk
        step = max(block, SLICE_TOKENS // block * block) if mergeable(self.spec) else block
        # reserved slots already allocated that hold these tokens: the quantize kernel may write straight into them
        have = self.n_quantized
        slots = self._slots
        in_place = mergeable(self.spec) and slots is not None and have + n_tokens <= self.reserve_tokens
        new = []
        for i in range(0, n_tokens, step):
            x = self.buffer[:, :, i : min(n_tokens, i + step)]
            if self.spec.kind == "float" and step >= n_tokens:  # quantize may return a view of x, which would
                x = x.clone()  # pin the old buffer (several slices are concatenated into a new tensor anyway)
            if self.spec.pre_rope:
                x = rope_at(self.rotary, x, p0 + i, inverse=True, offset=self.pos_offset)
            # Finiteness and range: checked on the incoming K/V, eagerly or lazily (kvbits.cache.checks).
            out = None
            if in_place:  # the slots of these tokens (_write_slots then finds them written, or copies)
                a, b = have + i, have + i + x.shape[2]
                out = {name: _slice_tokens(t, self.reserve_tokens, a, b, copy=False) for name, t in slots.items()}
            qt = quantize_pack(x, self.spec, validate=False, out=out, **kw)
            if self.sync and isinstance(qt.clipped, torch.Tensor):  # eager: clip counts are host ints
                qt.clipped = int(qt.clipped)
            if self.observer is not None:
                self.observer(x, qt)
            new.append(qt)
        self._commit(n_tokens, new, p0, slots)

    def _commit(self, n_tokens: int, new: list[QuantizedTensor], p0: int, slots: dict[str, torch.Tensor] | None) -> None:
        """Store the chunks ``new`` quantized from the ``n_tokens`` oldest buffer tokens (the first at position
        ``p0``; ``slots``: the reserved slots before the flush) and drop those tokens from the buffer."""
        B, H, _, D = self.buffer.shape
        self.elements_quantized += B * H * n_tokens * D
        for qt in new:
            if not _host_zero(qt.clipped):  # dynamic ranges report a host 0: no add kernel
                self.clipped += qt.clipped
                # counted in the store's total: the stored chunk keeps none of its own (lazy checks: a 0-dim device
                # tensor per block for head / tensor granularity, one allocation each, counted nowhere)
                qt.clipped = 0
            if self.work is not None:
                self._append_work(self._dequantize(qt, p0, self.work.dtype))
            p0 += qt.n_tokens
        if mergeable(self.spec):
            self._append_merged(new)
        else:
            self.chunks += new
        if slots is None or self._slots is not slots:
            # the kernel-layout view covers every reserved slot (packed()): a flush into the same slots leaves it as
            # it was, so a per-token scheme does not rebuild it at every step; new or released slots, or new chunks,
            # need a new one
            self._packed = None
        # clone: a view would keep the flushed tokens' full-precision storage alive; an emptied buffer (every token
        # flushed, as a per-token scheme does at each step) needs no copy kernel, only an empty tensor
        if n_tokens == self.n_buffer:
            self.buffer = self.buffer.new_empty((B, H, 0, D))
        else:
            self.buffer = self.buffer[:, :, n_tokens:].clone()

    def _append_merged(self, new: list[QuantizedTensor]) -> None:
        """Append the slices one flush quantized to the one chunk of a ``mergeable`` spec: written into the
        reserved slots when they hold them (no copy of the history), else concatenated into a new chunk."""
        have, n_new = self.n_quantized, sum(qt.n_tokens for qt in new)
        if not self._reserve(new[0], have + n_new):
            self.chunks = [_cat_chunks(*self.chunks, *new)]
            return
        at = have
        for qt in new:
            self._write_slots(qt, at)
            at += qt.n_tokens
        views = {name: _slice_tokens(t, self.reserve_tokens, 0, at, copy=False) for name, t in self._slots.items()}
        B, H, _, D = new[0].shape
        self.chunks = [replace(new[0], shape=(B, H, at, D), **views)]  # clipped: 0, in the store's total

    def _write_slots(self, qt: QuantizedTensor, at: int) -> None:
        """Write chunk ``qt``'s token tensors into the reserved slots, from quantized token ``at`` on; those the
        quantize kernel already wrote there (``quantize_pack``'s ``out``) are left as they are."""
        for name in _token_tensors(qt):
            dst = _slice_tokens(self._slots[name], self.reserve_tokens, at, at + qt.n_tokens, copy=False)
            src = getattr(qt, name)
            if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride() and src.dtype == dst.dtype:
                continue  # written in place: the same elements
            dst.copy_(src)

    def _append_work(self, x: torch.Tensor) -> None:
        """Append dequantized tokens ``x`` ``(B, H, n, D)`` to the workspace: into its reserved slots while they
        hold them (allocated at the first append, like the chunk's, for all ``reserve_total`` tokens, the
        workspace from slot ``n_sinks`` on), else by concatenation."""
        have, S, n = self.work.shape[2], self.n_sinks, x.shape[2]
        if not 0 < S + have + n <= self.reserve_total:
            self._work_slots = None
            self.work = torch.cat([self.work, x], dim=2)
            return
        if self._work_slots is None:
            B, H, _, D = x.shape
            self._work_slots = x.new_zeros((B, H, self.reserve_total, D), dtype=self.work.dtype)
            self._work_slots[:, :, S : S + have].copy_(self.work)
        self._work_slots[:, :, S + have : S + have + n].copy_(x)
        self.work = self._work_slots[:, :, S : S + have + n]

    def _workspace_view(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``materialize(dtype)``'s values as a view of the reserved workspace, the sinks and buffer copied into
        their slots (a few tokens: the history stays where it is), or ``None`` where the slots cannot hold them:
        no reservation, another dtype, or more tokens than reserved. ``work`` views slots ``n_sinks...`` whenever
        the slots are held (``_append_work``; every other writer of ``work`` drops them), and the sinks are
        complete before the first flush, so the layout needs no check here."""
        slots = self._work_slots
        if slots is None or slots.dtype != dtype or self.buffer.dtype != dtype:
            return None
        S, Q, nb = self.n_sinks, self.work.shape[2], self.n_buffer
        if S + Q + nb > slots.shape[2]:
            return None
        slots[:, :, :S].copy_(self.sinks)
        slots[:, :, S + Q : S + Q + nb].copy_(self.buffer)
        return slots[:, :, : S + Q + nb]

    def _reserve(self, like: QuantizedTensor, needed: int) -> bool:
        """Whether the reserved slots (allocated here, zero-filled, from ``like``'s shapes, the chunk so far copied
        in) hold ``needed`` quantized tokens. Beyond the reservation it is released (logged once per request): the
        chunk is concatenated as without one, so the held bytes again follow the tokens."""
        C = self.reserve_tokens
        if C <= 0:
            return False
        if needed > C:
            if not self._told_exceeded:
                logger.warning(
                    "%s: %d quantized tokens exceed the %d reserved for max_cache_len; the reservation is released "
                    "and the history grows by copying, as without one", self.name, needed, C,
                )  # fmt: skip
                self._told_exceeded = True
            self._slots = None
            return False
        if self._slots is None:
            slots = {}
            for name in _token_tensors(like):
                t = getattr(like, name)
                unit = like.n_tokens // t.shape[2]
                if C % unit:
                    raise AssertionError(f"{self.name}: {C} reserved tokens are not whole groups of {unit}")
                slots[name] = t.new_zeros((*t.shape[:2], C // unit, *t.shape[3:]))
            self._slots = slots
            if self.chunks:  # reserved after the chunk began (a batch map released the slots): copy it in once
                self._write_slots(self.chunks[0], 0)
        return True

    def release_reservation(self) -> int:
        """Give back the reserved slots the store will not fill: the chunk (and a reserved workspace) is copied
        into tensors of the tokens in use and the reservation dropped, so the held bytes follow the tokens
        again. For a layer that stops quantizing mid-request (``QuantizedKVLayer.hold_full_precision``): its
        later tokens stay in full precision, so the slots past ``n_quantized`` would never be written. A flush
        after this reserves again (as after a batch map). Returns the bytes given back (0 when none was held)."""
        before = self.nbytes() + self.workspace_bytes()
        if self._slots is not None:
            self._slots = self._packed = None
            if self.chunks:
                self.chunks = [_slice_chunk(self.chunks[0], 0, self.chunks[0].n_tokens)]
        if self._work_slots is not None:
            self._work_slots, self.work = None, self.work.clone()
        return before - self.nbytes() - self.workspace_bytes()

    # -------------------------------------------------------------- removing
    def drop_quantized_front(self, n_tokens: int) -> None:
        """Forget the ``n_tokens`` oldest quantized tokens (whole blocks; sliding-window layers)."""
        if n_tokens <= 0:
            return
        self._packed = self._slots = self._work_slots = None  # what is left is copies (_slice_chunk, clone)
        left = n_tokens
        while left and self.chunks and self.chunks[0].n_tokens <= left:
            left -= self.chunks.pop(0).n_tokens
        if left:
            first = self.chunks[0]
            self.chunks[0] = _slice_chunk(first, left, first.n_tokens)
        if self.work is not None:
            self.work = self.work[:, :, n_tokens:].clone()
        self.n_dropped += n_tokens

    def keep_buffer_tail(self, n_tokens: int) -> None:
        """Keep only the ``n_tokens`` most recent buffer tokens (full-precision sliding window)."""
        if n_tokens < self.n_buffer:
            self.buffer = self.buffer[:, :, self.n_buffer - n_tokens :].clone()

    def crop_tail(self, n_tokens: int) -> None:
        """Remove the ``n_tokens`` most recent tokens, from the buffer then the sinks (caller checks)."""
        from_buffer = min(n_tokens, self.n_buffer)
        self.buffer = self.buffer[:, :, : self.n_buffer - from_buffer].clone()
        rest = n_tokens - from_buffer
        if rest:
            assert not self.chunks and rest <= self.n_sinks
            self.sinks = self.sinks[:, :, : self.n_sinks - rest].clone()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch dimension of every per-sequence tensor (beam search, expansion)."""
        if self.buffer is None:
            return
        self._packed = self._slots = self._work_slots = None  # mapped: new storage; the next flush reserves again
        self.sinks, self.buffer = fn(self.sinks), fn(self.buffer)
        if self.pos_offset is not None:
            self.pos_offset = fn(self.pos_offset)
        if self.pad_rows is not None:
            self.pad_rows = fn(self.pad_rows)
        if self.work is not None:
            self.work = fn(self.work)
        self.chunks = [_map_chunk(c, fn) for c in self.chunks]

    # --------------------------------------------------------------- reading
    def _dequantize(
        self, qt: QuantizedTensor, p0: int, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One chunk back to ``dtype`` (rotated back to its positions ``p0...`` for pre-RoPE keys), written
        into ``out`` ``(B, H_kv, qt.n_tokens, D)`` when given."""
        if not self.spec.pre_rope:
            return qt.dequantize(dtype, sync=False, out=out)  # codebook checked when installed
        rotated = rope_at(self.rotary, qt.dequantize(dtype, sync=False), p0, offset=self.pos_offset)
        return rotated if out is None else out.copy_(rotated)

    def materialize(self, dtype: torch.dtype, *, view: bool = False) -> torch.Tensor:
        """Every stored token in order, in ``dtype``: ``(B, H_kv, sinks + quantized + buffer, D)``.

        One tensor is allocated and each part written into its place (the codes decoded straight into
        it where ``QuantizedTensor.dequantize`` can), not decoded apart and concatenated: the same values,
        one full-history copy fewer per call. With nothing to decode (no sinks, nothing quantized) and the
        buffer already in ``dtype``, a view of the buffer: no copy at all.

        ``view=True`` (a decode step's K/V, used at once): with a reserved workspace (``reserve_total``), a
        view of it, only the sinks and buffer copied in: the same values, no copy of the history. The view's
        buffer slots are overwritten later (by the tokens' dequantized values when they are flushed), as
        transformers' ``StaticCache`` returns its own tensors; keep a ``clone()`` to hold on to it.
        """
        if view and (mirrored := self._workspace_view(dtype)) is not None:
            return mirrored
        B, H, _, D = self.buffer.shape
        S, Q = self.n_sinks, (self.work.shape[2] if self.work is not None else self.n_quantized)
        if S == Q == 0 and self.buffer.dtype == dtype:
            # nothing decoded (fp16, or a residual window not yet flushed): a view of the buffer, no copy, as
            # DynamicCache returns its own tensors. Safe: the buffer is only ever replaced, never written
            return self.buffer[:]
        out = torch.empty(B, H, S + Q + self.n_buffer, D, dtype=dtype, device=self.buffer.device)
        out[:, :, :S].copy_(self.sinks)
        middle = out[:, :, S : S + Q]
        if self.work is not None:
            middle.copy_(self.work)
        elif len(self.chunks) > 1:  # one block per chunk (head / tensor granularity): one call per slice
            blk = self.chunks[0].n_tokens
            per = max(1, SLICE_TOKENS // blk)
            for i in range(0, len(self.chunks), per):
                group = self.chunks[i : i + per]
                decoded = _stack_blocks(group).dequantize(dtype, sync=False)  # (nb * B, H, block, D)
                n = len(group) * blk  # not -1: an empty batch (B = 0) leaves it ambiguous to reshape
                decoded = decoded.reshape(len(group), B, H, blk, D).permute(1, 2, 0, 3, 4).reshape(B, H, n, D)
                if self.spec.pre_rope:
                    decoded = rope_at(self.rotary, decoded, S + self.n_dropped + i * blk, offset=self.pos_offset)
                middle[:, :, i * blk : i * blk + decoded.shape[2]].copy_(decoded)
        elif self.chunks:
            qt, p0 = self.chunks[0], S + self.n_dropped
            step = _slice_step(qt, SLICE_TOKENS)
            for a in range(0, Q, step):
                b = min(Q, a + step)
                part = qt if (a, b) == (0, Q) else _slice_chunk(qt, a, b, copy=False)
                self._dequantize(part, p0 + a, dtype, out=middle[:, :, a:b])
        out[:, :, S + Q :].copy_(self.buffer)
        return out

    def packed(self, every_slot: bool = True) -> PackedTensor | None:
        """The quantized chunks in the decode-kernel layout (``kvbits.kernels.reference.pack_side``), or
        ``None`` when nothing is quantized. NotImplementedError for specs the layout cannot hold. With
        reserved slots (``reserve_tokens``) it covers all of them, ``n_slots >= n_quantized``: the slots past
        ``n_quantized`` are zeros the kernels never read (``kvbits.cache.fused.packed_store`` sets the lengths).
        ``every_slot=False``: the ``n_quantized`` slots in use only, ``n_slots == n_quantized`` (for a layer
        whose other side holds no reservation: the kernels take one slot count for K and V); a copy where the
        slots' view is not contiguous, and never kept (the next flush outgrows it).

        A single chunk (every ``mergeable`` spec) is handed over without a copy and the view is kept until
        the chunks change; several chunks (head / tensor granularity) are concatenated on every call and
        the copy is not kept, so the store never holds a second copy of its codes.
        """
        if not self.chunks:
            return None
        reserved = every_slot and self._slots is not None
        if self._packed is not None and (reserved or self._slots is None):  # kept: every slot, or the chunk
            return self._packed
        from kvbits.kernels.reference import pack_side

        chunks = self.chunks
        if reserved:  # every reserved slot: the kernels read the first n_quantized (quant_lens)
            B, H, _, D = chunks[0].shape
            chunks = [replace(chunks[0], shape=(B, H, self.reserve_tokens, D), **self._slots)]
        p = pack_side(chunks, self.name)
        if self._slots is not None and not reserved:
            return p
        own = {t.untyped_storage().data_ptr() for c in self.chunks for t in c.stored_tensors()}
        if all(t.untyped_storage().data_ptr() in own for t in (p.codes, p.scale, p.zero) if t is not None):
            self._packed = p  # views of the chunk: keeping them costs nothing
        return p

    def full_tail(self) -> torch.Tensor | None:
        """Sinks then buffer ``(B, H_kv, n_sinks + n_buffer, D)`` in the buffer's dtype (the buffer itself,
        no copy, when there are no sinks), or ``None`` when both are empty."""
        if self.buffer is None or self.n_sinks + self.n_buffer == 0:
            return None
        if self.n_sinks == 0:
            return self.buffer
        return torch.cat([self.sinks.to(self.buffer.dtype), self.buffer], dim=2)

    def components(self) -> dict[str, list[torch.Tensor]]:
        """The stored tensors by kind: codes, scales, zero_points, outliers, full_precision, fixed."""
        out: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("codes", "scales", "zero_points", "outliers", "full_precision", "fixed")
        }
        out["fixed"] = [getattr(self, n) for n in FIXED_TENSORS if getattr(self, n) is not None]
        if self.buffer is None:
            return out
        out["full_precision"] = [self.sinks, self.buffer]
        if self._slots is not None:  # what is allocated: every reserved slot, used or not
            kinds = {"data": "codes", "scale": "scales", "zero": "zero_points"}
            for name, t in self._slots.items():
                out[kinds.get(name, "outliers")].append(t)
            return out
        for c in self.chunks:
            out["codes"].append(c.data)
            if not c.static:
                out["scales"] += [c.scale] if c.scale is not None else []
                out["zero_points"] += [c.zero] if c.zero is not None else []
            out["outliers"] += [t for t in (c.outlier_values, c.outlier_index) if t is not None]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.components().values() for t in ts)

    def workspace_bytes(self) -> int:
        if self._work_slots is not None:  # allocated: every reserved slot
            return self._work_slots.numel() * self._work_slots.element_size()
        return 0 if self.work is None else self.work.numel() * self.work.element_size()


def joint_flush(k: SideStore, v: SideStore, n_tokens: int) -> bool:
    """Whether ``flush_pair`` may quantize the ``n_tokens`` oldest K and V buffer tokens in one call, K and V stacked
    along the batch: the same spec on both sides (dynamic affine integer codes of ``token`` / ``channel``
    granularity, whose every scale reduces within one batch row, so the codes and scales are those of two calls bit
    for bit), with no per-side state (static scales, codebooks, channel vectors, rotations, pre-RoPE keys, outliers,
    vLLM's integer zero-points that clip routinely), K and V of one shape and dtype and a batch (``split`` of an
    empty one returns one part), host clip counts (eager checks:
    a joint count is split only when it is 0), the reference quantizer (the Triton kernel writes each side into its
    reserved slots in place) and at most half a slice (``SLICE_TOKENS``: the float32 working copies stay within one
    slice's). Host attributes only: no device work."""
    spec = k.spec
    return (
        0 < n_tokens <= SLICE_TOKENS // 2 and spec == v.spec and spec.kind == "int" and not spec.static
        and spec.granularity in ("token", "channel") and spec.outlier_frac == 0 and not spec.pre_rope
        and spec.rotate is None and not spec.has_channel_transform and not spec.integer_zero and k.sync and v.sync
        and k.buffer.shape == v.buffer.shape and k.buffer.dtype == v.buffer.dtype and k.buffer.shape[0] > 0
        and resolve_quantize_kernel(k.buffer, spec) == "reference"
    )  # fmt: skip


def flush_pair(k: SideStore, v: SideStore, n_tokens: int, block: int) -> None:
    """``k.flush(n_tokens, block)`` then ``v.flush(n_tokens, block)``, in one ``quantize`` call where ``joint_flush``
    allows: K and V ``(B, H_kv, n, D)`` stacked into ``(2B, H_kv, n, D)``, quantized once and split back into each
    side's chunk (views of the joint tensors; each side's bytes as before). Per decode step of ``int8-token`` it runs
    about 45 fewer aten ops and one host read of a clip count fewer, with eager checks and the reference quantizer
    only (a CPU; on a GPU with Triton each side's kernel writes its reserved slots, and lazy checks keep two calls). The same codes, scales,
    workspace, clip counts (each 0) and observer calls (``x`` and ``qt`` of one side, after both are quantized) as
    the two flushes; a joint clip count above 0 cannot be split per side, so that flush quantizes each side apart."""
    if not joint_flush(k, v, n_tokens):
        k.flush(n_tokens, block)
        v.flush(n_tokens, block)
        return
    assert n_tokens % block == 0 and n_tokens <= k.n_buffer
    B = k.buffer.shape[0]
    whole = n_tokens == k.n_buffer
    x = torch.cat([k.buffer if whole else k.buffer[:, :, :n_tokens], v.buffer if whole else v.buffer[:, :, :n_tokens]])
    qt = quantize_pack(x, k.spec, validate=False, sync=True)
    if qt.clipped:  # a host int (sync): which side clipped is not known, so quantize each apart (exact counts)
        k.flush(n_tokens, block)
        v.flush(n_tokens, block)
        return
    halves = {name: getattr(qt, name).split(B) for name in _token_tensors(qt)}
    xs = x.split(B) if k.observer is not None or v.observer is not None else (None, None)
    for i, store in enumerate((k, v)):
        part = replace(qt, shape=(B, *qt.shape[1:]), clipped=0, **{name: h[i] for name, h in halves.items()})
        if store.observer is not None:
            store.observer(xs[i], part)
        p0 = store.n_sinks + store.n_dropped + store.n_quantized
        store._commit(n_tokens, [part], p0, store._slots)
