"""Fused decode attention over the packed KV cache: Triton split-K ("flash-decoding") kernels.

Reads the layout of ``kvbits.kernels.reference`` (packed codes + float16 scales/zero-points + a
full-precision tail, ragged lengths) and never materialises dequantized K/V: codes are unpacked and
dequantized in registers, right before the dot products.

Work decomposition (Flash-Decoding, Dao et al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
one program per (sequence ``b``, KV head ``h``, split of the tokens). A program serves **all**
``G = H_q / H_kv`` query heads of its KV head, so every KV byte is read from memory once per step
(GQA packing, as vLLM/lightllm decode kernels do); the ``G`` query rows are padded to 16 for
``tl.dot``. Splits ``[0, n_split_q)`` cover the quantized slots and splits ``[n_split_q, n_split)`` the
full-precision tail. Each writes a partial online-softmax state ``(m, l, acc)`` (Milakov &
Gimelshein 2018; FlashAttention-2, Dao 2023, Alg. 1) in base 2 (``exp2``, scores pre-multiplied by
``log2 e``); ``_reduce_kernel`` merges the splits: ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``.

Formats (``reference`` module docstring): per side, integer codes (2/3/4/8-bit, affine or symmetric),
NUQ codes looked up in a 2**bits-entry codebook (KVQuant), or FP8 bytes decoded from their bit fields
(``_fp8_to_f32``: exact, no float8 type needed); then up to ``NOUT`` sparse outliers per row replace
their channels (``_outliers``). Slot masks (``quant_mask`` / ``full_mask``, left padding) narrow
``valid``, the same predicate that hides slots past a sequence's length. Rotated sides (Hadamard,
``PackedTensor.rotate``) need nothing of the kernels but the query's precision: ``decode_attention_triton``
rotates the query and the tail into the codes' basis and the output back (``reference.code_basis``), and for
float16 queries keeps the rotated (or smoothed) query ``q'`` float32, which the kernel takes as two float16
halves in every key dot (``Q_SPLIT``, ``_halves``): one float16 rounding of ``q'`` is shared by every score of a
query, and cost up to 1.78x float16 torch's error on a real rotated cache (BENCHMARKS.md §6, session 40). Keys with
one scale per token (whole 2/4/8-bit integer rows, no outliers, not pre-RoPE) are not dequantized at all: the query
multiplies their codes, exact in float16, and each token's scale and zero-point apply to its score in float32,
``s_t (q . c_t) + z_t sum(q)`` (``K_ROWS``); dequantized and rounded to float16 they cost single decode steps of
real per-token INT4 caches up to 3.1x float16 torch's error (session 43).

Precision follows the query dtype: float16/bfloat16 queries use tensor-core dots on dequantized K/V
and probabilities cast to that dtype with float32 accumulation (FlashAttention's recipe); float32
queries use IEEE float32 dots (slow; for tests and debugging).

This module imports Triton at import time; import it through ``kvbits.kernels.dispatch``.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from kvbits.kernels import aot, interpret
from kvbits.kernels.dispatch import DEQUANT_MODES
from kvbits.kernels.reference import PackedStore, PackedTensor, code_basis
from kvbits.quant.rotate import unrotate
from kvbits.quant.tensor import from_channel_basis

__all__ = [
    "DEQUANT_MODES",
    "decode_attention_triton",
    "dequantize_packed_triton",
    "f16_ok",
    "launch_defaults",
    "layout_reason",
    "supported",
    "unpack_codes_triton",
]

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
_VEC_BROKEN: set[tuple] = set()  # kernel configurations whose vectorised variant did not compile
_F16_BROKEN: set[tuple] = set()  # ... whose dequant="f16" variant did not compile
F16_MIN_HEAD_DIM = 32  # f16_ok: below it the float32 path (a wrong output on the H200 at head dim 16)
_FOLD_BROKEN: set[tuple] = set()  # (G, D, key bits, value bits) whose dequant="fold" launch failed on CUDA
TRITON_BITS = (2, 3, 4, 8)
# The whole-row path (``_load_rows``, then ``tl.trans``) needs tiles of 32 tokens at least: on an H200
# (Triton 3.6, sm_90) every 16-token launch of it at D = 128 returned wrong attention (max error 3.8-4.6
# against float64, whatever the codes, outliers, RoPE, warps, stages or splits), while the gather path at
# 16 tokens and the whole-row path at 32 and 64 matched the reference (``benchmarks/kernel_diag.py``,
# BENCHMARKS.md §6). The Triton interpreter on CPU computes the 16-token variant correctly.
MIN_VEC_BLOCK_T = 32
KIND_CODES = {("int", None): 0, ("nuq", None): 1, ("fp8", "e4m3"): 2, ("fp8", "e5m2"): 3}  # K_KIND / V_KIND


def _kind_code(p: PackedTensor) -> int:
    return KIND_CODES[(p.kind, p.fmt if p.kind == "fp8" else None)]


# --------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _unpack(codes_ptr, t, d, mask, ROW, BITS: tl.constexpr):
    """Integer codes at (token ``t``, channel ``d``) (broadcastable int tensors) of rows of ``ROW`` bytes.

    Channel ``d`` of a row starts at bit ``d * BITS``, little-endian (``kvbits.quant.pack``); a 3-bit
    code may continue into the next byte.
    """
    bit = d * BITS
    byte_idx = bit // 8
    word = tl.load(codes_ptr + t * ROW + byte_idx, mask=mask, other=0).to(tl.int32)
    if BITS == 3:
        nxt = tl.load(codes_ptr + t * ROW + byte_idx + 1, mask=mask & (byte_idx + 1 < ROW), other=0)
        word = word | (nxt.to(tl.int32) << 8)
    return (word >> (bit % 8)) & ((1 << BITS) - 1)


# fmt: off
@triton.jit
def _fp8_to_f32(code, KIND: tl.constexpr):
    """float8 bytes (int32 in [0, 256)) → float32, exactly: e4m3fn (``KIND == 2``) or e5m2 (``KIND == 3``).

    Built from the bit fields (no float8 type needed, so the interpreter runs it too):
    e4m3fn: bias 7, 3 mantissa bits, no infinities, ``S.1111.111`` is NaN; e5m2: bias 15, 2 mantissa bits,
    exponent 31 is inf (mantissa 0) or NaN. Normal numbers are assembled as float32 bit patterns,
    subnormals as ``mantissa * 2^(1 - bias - mantissa_bits)``.
    """
    sign = code >> 7
    if KIND == 2:
        e = (code >> 3) & 15
        m = code & 7
        normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # 2^-9
        x = tl.where(e == 0, tl.where(sign == 1, -sub, sub), normal)
        x = tl.where((e == 15) & (m == 7), float("nan"), x)
    else:
        e = (code >> 2) & 31
        m = code & 3
        normal = ((sign << 31) | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # 2^-16
        x = tl.where(e == 0, tl.where(sign == 1, -sub, sub), normal)
        inf = tl.where(sign == 1, float("-inf"), float("inf"))
        x = tl.where(e == 31, tl.where(m == 0, inf, float("nan")), x)
    return x


@triton.jit
def _decode(code, s, z, cb_ptr, BITS: tl.constexpr, SYM: tl.constexpr, KIND: tl.constexpr):
    """Codes (int32) with their float32 scale ``s`` and zero-point ``z`` → float32 values.

    ``KIND`` 0 int (``kvbits.quant.affine``), 1 NUQ (``kvbits.quant.nuq``: ``u = codebook[code]``), 2/3 fp8.
    """
    if KIND == 0:
        if SYM:
            x = (code - ((1 << (BITS - 1)) - 1)).to(tl.float32) * s
        else:
            x = code.to(tl.float32) * s + z
    elif KIND == 1:
        u = tl.load(cb_ptr + code).to(tl.float32)
        if SYM:
            x = u * s
        else:
            x = z + (u + 1.0) * (s * 0.5)
    else:
        x = _fp8_to_f32(code, KIND) * s
    return x


@triton.jit
def _outliers(x, ov_ptr, oi_ptr, t, d, mask, NOUT: tl.constexpr):
    """Write the ``NOUT`` sparse outliers of each row back into ``x`` (``t``, ``d`` broadcast like ``x``)."""
    for j in tl.static_range(NOUT):
        idx = tl.load(oi_ptr + t * NOUT + j, mask=mask, other=0).to(tl.int32)
        val = tl.load(ov_ptr + t * NOUT + j, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(d == idx, val, x)
    return x


@triton.jit
def _load_kv(codes_ptr, scale_ptr, zero_ptr, cb_ptr, ov_ptr, oi_ptr, t, d, mask, ROW, SCOLS,
             BITS: tl.constexpr, TPS: tl.constexpr, CPS: tl.constexpr, SYM: tl.constexpr,
             KIND: tl.constexpr, NOUT: tl.constexpr):
    """A float32 tile of K or V at (``t``, ``d``); ``BITS == 16`` reads a float tail row of ``ROW`` elements.

    Quantized: element (t, d) uses ``scale[t // TPS, d // CPS]`` (``SCOLS`` scale columns per row),
    decoded by ``_decode``; then the row's ``NOUT`` outliers replace their channels.
    """
    if BITS == 16:
        x = tl.load(codes_ptr + t * ROW + d, mask=mask, other=0.0).to(tl.float32)
    else:
        code = _unpack(codes_ptr, t, d, mask, ROW, BITS)
        s_off = (t // TPS) * SCOLS + d // CPS
        s = tl.load(scale_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        z = s
        if not SYM:
            z = tl.load(zero_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        x = _decode(code, s, z, cb_ptr, BITS, SYM, KIND)
        if NOUT > 0:
            x = _outliers(x, ov_ptr, oi_ptr, t, d, mask, NOUT)
    return x


@triton.jit
def _meta_words(ptr, rows, mask_r, SCOLS, NC: tl.constexpr, R: tl.constexpr):
    """Float16 metadata rows ``rows (R,)`` (``NC`` stored columns, ``SCOLS`` per row) as ``(R, NC)`` float16,
    read as int32 words of two values each.

    A 2-byte load per value is too narrow for ``cp.async``: Triton's pipeliner then leaves it a
    synchronous load inside the tile loop, and each iteration waits a full memory round trip for it (the
    H200 runs of session 9 spent about 3 µs per tile whatever its bytes; BENCHMARKS.md §6). Words are
    prefetched with the codes. Needs even ``NC`` and ``SCOLS`` and a 4-byte-aligned base (``_words_ok``).
    """
    words = ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(words + rows[:, None] * (SCOLS // 2) + tl.arange(0, NC // 2)[None, :], mask=mask_r[:, None], other=0)
    return tl.reshape(_f16_pairs(w), (R, NC))


@triton.jit
def _token_words(ptr, t, mask_t, BLOCK_T: tl.constexpr, ODD: tl.constexpr = False):
    """One float16 value per token (``D / CPS == 1``: a scale for the whole row) for tokens ``t (BLOCK_T,)``
    (consecutive, ``t[0]`` even), read as int32 words of two tokens each: ``(BLOCK_T,)`` float16. The values of
    consecutive tokens are contiguous, so the words are too (``_meta_words`` reads along a row instead).

    A word read for a valid token also brings its pair, which may be a slot past the sequence's length
    (padding, reserved slots): that half is zeroed, as a masked load reads it. Kept, a NaN or inf there
    would reach the output through ``p = 0`` times NaN (found with NaN-filled padding, tests/test_reserve.py).

    ``ODD``: the slabs hold an odd number of slots (a growing cache every other step, an odd reservation), so
    every other ``(sequence, head)`` slab ``ptr`` starts in the high half of a word. Such a slab's pair
    ``(t, t + 1)`` is the high half of word ``t / 2`` and the low half of the next (counted from ``ptr - 1``),
    joined by shifts; slabs that start on a word read one word per pair (the second load is off), as without
    ``ODD``. The tensor must start on a word and hold an even number of values (``_words_ok``), so no word
    leaves it.
    """
    if ODD:
        first, _ = tl.split(tl.reshape(t, (BLOCK_T // 2, 2)))
        ok0, ok1 = tl.split(tl.reshape(mask_t, (BLOCK_T // 2, 2)))
        par = ((ptr.to(tl.int64) >> 1) & 1).to(tl.int32)  # 1: the slab starts in a word's high half
        words = (ptr - par).to(tl.pointer_type(tl.int32))
        a = tl.load(words + first // 2, mask=ok0 | ok1, other=0).to(tl.uint32, bitcast=True)
        b = tl.load(words + first // 2 + 1, mask=ok1 & (par == 1), other=0).to(tl.uint32, bitcast=True)
        w = ((a >> (16 * par).to(tl.uint32)) | (b << 16)).to(tl.int32, bitcast=True)  # b = 0 where par = 0
    else:
        first = tl.min(tl.reshape(t, (BLOCK_T // 2, 2)), axis=1)
        ok = tl.max(tl.reshape(mask_t.to(tl.int32), (BLOCK_T // 2, 2)), axis=1) > 0
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + first // 2, mask=ok, other=0)
    vals = tl.reshape(_f16_pairs(w), (BLOCK_T,))
    return tl.where(mask_t, vals, tl.zeros_like(vals))


@triton.jit
def _mask_words(ptr, start, n, BLOCK_T: tl.constexpr):
    """``BLOCK_T`` uint8 slot-mask bytes from ``ptr + start`` (4-byte aligned) as int32 ``(BLOCK_T,)``, read as
    ``BLOCK_T / 4`` int32 words: one-byte loads stay synchronous in the tile loop (too narrow for ``cp.async``),
    words are prefetched (``_meta_words``). Only the words holding one of the first ``n`` bytes (the tile's slots
    before the split's end) are read, the rest are 0: the mask's rows are whole words (``_slot_mask``), so
    no word leaves the row. Reading the whole tile read up to ``BLOCK_T - 4`` bytes past the last row's end
    when the slot count is not a multiple of the tile (``tests/test_bounds.py``)."""
    words = ptr.to(tl.pointer_type(tl.int32))
    j = tl.arange(0, BLOCK_T // 4)
    w = tl.load(words + start // 4 + j, mask=4 * j < n, other=0)
    return tl.reshape(_tree4(w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, (w >> 24) & 0xFF), (BLOCK_T,))


@triton.jit
def _meta_rows(ptr, t, mask_t, SCOLS, D: tl.constexpr, BLOCK_T: tl.constexpr, TPS: tl.constexpr,
               CPS: tl.constexpr, W32: tl.constexpr = False):
    """Scales (or zero-points) of rows ``t (BLOCK_T,)`` expanded to ``(BLOCK_T, D)`` float32.

    Loads the ``D / CPS`` stored columns of each row (contiguous) and repeats each ``CPS`` times. ``W32``
    (float16 metadata in int32-aligned rows, ``_words_ok``: 1, or 2 for one value per token over an odd slot
    count): per-token rows are read as int32 words (``_meta_words``, ``_token_words``).
    """
    NC: tl.constexpr = D // CPS
    if TPS == 1 and W32 and NC == 1:
        m = _token_words(ptr, t, mask_t, BLOCK_T, W32 == 2).to(tl.float32)[:, None]
    elif TPS == 1 and W32:
        m = _meta_words(ptr, t, mask_t, SCOLS, NC, BLOCK_T).to(tl.float32)
    else:
        offs_c = tl.arange(0, NC)
        m = tl.load(ptr + (t // TPS)[:, None] * SCOLS + offs_c[None, :], mask=mask_t[:, None], other=0.0)
        m = m.to(tl.float32)
    if CPS > 1:
        m = tl.reshape(tl.broadcast_to(m[:, :, None], (BLOCK_T, NC, CPS)), (BLOCK_T, D))
    return m


@triton.jit
def _row_codes(codes_ptr, t, mask_t, ROW, D: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr):
    """The 2/4/8-bit codes of whole rows ``t (BLOCK_T,)`` → ``(BLOCK_T, D)`` int32 in channel order.

    Each packed row is read once as ``D * BITS / 8`` contiguous bytes; the codes of a byte are split
    with shifts and put back in channel order with ``tl.interleave`` (``interleave(a, b)[2i] = a[i]``,
    ``[2i+1] = b[i]``): 4-bit ``(lo, hi)``; 2-bit ``((c0, c2), (c1, c3))``.
    """
    offs_b = tl.arange(0, (D * BITS) // 8)
    byte = tl.load(codes_ptr + t[:, None] * ROW + offs_b[None, :], mask=mask_t[:, None], other=0).to(tl.int32)
    if BITS == 8:
        code = byte
    elif BITS == 4:
        code = tl.interleave(byte & 15, byte >> 4)
    else:
        even = tl.interleave(byte & 3, (byte >> 4) & 3)  # codes 0, 2 of each byte
        odd = tl.interleave((byte >> 2) & 3, byte >> 6)  # codes 1, 3
        code = tl.interleave(even, odd)
    return code


@triton.jit
def _sym_zero(s, BITS: tl.constexpr):
    """The additive term of symmetric codes: ``(c - (2**(BITS-1) - 1)) s = c s + z`` with ``z = -(2**(BITS-1) - 1) s``."""
    return s * (-((1 << (BITS - 1)) - 1))


@triton.jit
def _scale_zero(s_ptr, z_ptr, offs, mask, BITS: tl.constexpr, SYM: tl.constexpr):
    """Scales and additive terms at ``offs`` (any shape), float32 (symmetric codes: ``_sym_zero``); elements outside
    ``mask`` read 0 (their probability is 0: never NaN times 0)."""
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SYM:
        z = _sym_zero(s, BITS)
    else:
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _row_meta(s_ptr, z_ptr, t, valid, BITS: tl.constexpr, SYM: tl.constexpr, W32: tl.constexpr,
              BLOCK_T: tl.constexpr):
    """Scale and additive term ``(s_t, z_t)`` of rows ``t`` (consecutive, ``t[0]`` even) with one value each (``TPS ==
    1``, ``CPS == D``), float32, as ``_scale_zero``; ``x = c s_t + z_t``. Read by the folded kernel and by ``K_ROWS``.
    ``W32`` (``_words_ok``: 1, or 2 over an odd slot count): float16 values read as int32 words of two tokens
    (``_token_words``), which ``cp.async``
    prefetches with the codes, where 2-byte loads stay synchronous in the tile loop (their latency can overlap
    the key dots, issued before the scales are needed). Compiled for sm_90 the words cost 6-8 more instructions
    per token and 30-70 more registers (BENCHMARKS.md §6, session 38): an option for the device run to time."""
    if not W32:
        return _scale_zero(s_ptr, z_ptr, t, valid, BITS, SYM)
    s = _token_words(s_ptr, t, valid, BLOCK_T, W32 == 2).to(tl.float32)
    if SYM:
        z = _sym_zero(s, BITS)
    else:
        z = _token_words(z_ptr, t, valid, BLOCK_T, W32 == 2).to(tl.float32)
    return s, z


@triton.jit
def _load_rows(codes_ptr, scale_ptr, zero_ptr, cb_ptr, ov_ptr, oi_ptr, t, mask_t, ROW, SCOLS, D: tl.constexpr,
               BLOCK_T: tl.constexpr, BITS: tl.constexpr, TPS: tl.constexpr, CPS: tl.constexpr,
               SYM: tl.constexpr, KIND: tl.constexpr, NOUT: tl.constexpr, W32: tl.constexpr = False):
    """Vectorised ``_load_kv`` for 2/4/8-bit codes: whole rows ``t (BLOCK_T,)`` → ``(BLOCK_T, D)`` float32
    (``_row_codes``, then each code's scale and zero-point)."""
    code = _row_codes(codes_ptr, t, mask_t, ROW, D, BLOCK_T, BITS)
    s = _meta_rows(scale_ptr, t, mask_t, SCOLS, D, BLOCK_T, TPS, CPS, W32)
    z = s
    if not SYM:
        z = _meta_rows(zero_ptr, t, mask_t, SCOLS, D, BLOCK_T, TPS, CPS, W32)
    x = _decode(code, s, z, cb_ptr, BITS, SYM, KIND)
    if NOUT > 0:
        x = _outliers(x, ov_ptr, oi_ptr, t[:, None], tl.arange(0, D)[None, :], mask_t[:, None], NOUT)
    return x


@triton.jit
def _magic(w, j: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """``((w >> j * BITS) & mask) | 0x64006400`` on int32 words, ``mask`` the low code of each 16-bit half.

    The float16 bit pattern ``0x6400 | c`` is exactly ``1024 + c`` for ``c < 1024`` (the "magic number"
    conversion of FasterTransformer / Marlin): each result holds two float16 codes, no integer-to-float
    conversion instruction (those run at a quarter of the integer rate). ``ASM``: the mask-and-or as one
    ``lop3`` (ptxas keeps the two constants' operations apart otherwise); the interpreter takes the
    expression.
    """
    x = w >> (j * BITS)
    if ASM:
        if BITS == 8:
            m = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00FF00FF, 0x64006400, 0xea;", "=r,r", [x],
                                          dtype=tl.int32, is_pure=True, pack=1)
        elif BITS == 4:
            m = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xea;", "=r,r", [x],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            m = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00030003, 0x64006400, 0xea;", "=r,r", [x],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        M: tl.constexpr = (1 << BITS) - 1
        m = (x & (M | (M << 16))) | 0x64006400
    return m


@triton.jit
def _lo(m):
    """The low float16 of each int32 (as int16 bits)."""
    return m.to(tl.int16)


@triton.jit
def _hi(m):
    """The high float16 of each int32 (as int16 bits)."""
    return (m >> 16).to(tl.int16)


@triton.jit
def _f16_pairs(w):
    """The two float16 values of each int32 in ``w``, low half first: shape ``(*w.shape, 2)``."""
    return tl.join(_lo(w), _hi(w)).to(tl.float16, bitcast=True)


@triton.jit
def _tree4(a0, a1, a2, a3):
    """``a0..a3`` joined so that their index is the fastest of two new axes: ``(..., 4)`` order 0, 1, 2, 3
    after a reshape (``tl.join`` appends its axis last, so the inner joins pair 0 with 2 and 1 with 3)."""
    return tl.join(tl.join(a0, a2), tl.join(a1, a3))


@triton.jit
def _codes16(w, BITS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """Packed rows as int32 words ``w (BLOCK_T, D * BITS / 32)`` → float16 ``1024 + code`` ``(BLOCK_T, D)``
    in **pair order**: column ``c`` holds channel ``pair_channels(BITS)[c]``.

    A 16-bit half holds ``P = 16 / BITS`` codes; ``_magic(j)`` gives code ``j`` of both halves of every
    word, i.e. channels ``P * (2i + h) + j`` for half ``h`` of word ``i``, as one int32. The tiles are
    joined with ``h`` as the fastest index, so each int32 stays one register pair of float16 values (no
    byte permutes, as channel order would need); ``j`` comes next, through a tree that pairs ``j`` with
    ``j + P/2`` first (``tl.join`` puts each new axis last). Column ``c = 2 * (P * i + j) + h``.
    """
    if BITS == 8:
        m0, m1 = _magic(w, 0, 8, ASM), _magic(w, 1, 8, ASM)
        x = tl.join(tl.join(_lo(m0), _lo(m1)), tl.join(_hi(m0), _hi(m1)))
    elif BITS == 4:
        m0, m1, m2, m3 = _magic(w, 0, 4, ASM), _magic(w, 1, 4, ASM), _magic(w, 2, 4, ASM), _magic(w, 3, 4, ASM)
        x = tl.join(_tree4(_lo(m0), _lo(m1), _lo(m2), _lo(m3)), _tree4(_hi(m0), _hi(m1), _hi(m2), _hi(m3)))
    else:
        m0, m1, m2, m3 = _magic(w, 0, 2, ASM), _magic(w, 1, 2, ASM), _magic(w, 2, 2, ASM), _magic(w, 3, 2, ASM)
        m4, m5, m6, m7 = _magic(w, 4, 2, ASM), _magic(w, 5, 2, ASM), _magic(w, 6, 2, ASM), _magic(w, 7, 2, ASM)
        lo = tl.join(_tree4(_lo(m0), _lo(m2), _lo(m4), _lo(m6)), _tree4(_lo(m1), _lo(m3), _lo(m5), _lo(m7)))
        hi = tl.join(_tree4(_hi(m0), _hi(m2), _hi(m4), _hi(m6)), _tree4(_hi(m1), _hi(m3), _hi(m5), _hi(m7)))
        x = tl.join(lo, hi)
    return tl.reshape(x, (BLOCK_T, D)).to(tl.float16, bitcast=True)


@triton.jit
def _pair_channels(D: tl.constexpr, BITS: tl.constexpr):
    """Channel of each pair-order column ``c`` (``_codes16``): ``P * (2 * (c // 2P) + c % 2) + (c // 2) % P``,
    ``P = 16 / BITS``; ``(D,)`` int32. ``BITS == 0``: channel order."""
    c = tl.arange(0, D)
    if BITS == 0:
        return c
    P: tl.constexpr = 16 // BITS
    return P * (2 * (c // (2 * P)) + c % 2) + (c // 2) % P


@triton.jit
def _pair_rows(m, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Rows ``m (R, D)`` in channel order → the pair order of ``BITS``-bit codes (``_pair_channels``): channel
    ``2P g + P h + j`` goes to column ``2P g + 2 j + h`` (``P = 16 / BITS``), a ``(2, P) -> (P, 2)`` transpose
    within each group of ``2P`` channels."""
    P: tl.constexpr = 16 // BITS
    return tl.reshape(tl.permute(tl.reshape(m, (R, D // (2 * P), 2, P)), (0, 1, 3, 2)), (R, D))


@triton.jit
def _meta16(ptr, t0, t, mask_t, end, SCOLS, D: tl.constexpr, BLOCK_T: tl.constexpr, TPS: tl.constexpr,
            CPS: tl.constexpr, BITS: tl.constexpr, W32: tl.constexpr = False):
    """Scales (or zero-points) of the tile ``t = t0 + arange(BLOCK_T)`` as float16 ``(BLOCK_T, D)``, in the
    pair order of ``BITS``-bit codes.

    Loads only the stored values: per token ``(BLOCK_T, D / CPS)`` (``TPS == 1``); one row when a scale
    group holds the whole tile (``TPS % BLOCK_T == 0``: tiles start at multiples of ``BLOCK_T``); else
    the tile's ``BLOCK_T / TPS`` rows. Then repeats them over channels and tokens in registers. Channel
    groups of ``CPS >= 32 / BITS`` channels (whole words) are contiguous in pair order too; a scale per
    channel (``CPS == 1``) is read at ``_pair_channels``. ``W32`` (``_words_ok``): per-token rows and
    per-channel rows are read as int32 words (``_meta_words``), per-channel ones in channel order and put in
    pair order in registers (``_pair_rows``).
    """
    NC: tl.constexpr = D // CPS
    if CPS == 1:
        offs_c = _pair_channels(D, BITS)
    else:
        offs_c = tl.arange(0, NC)
    if TPS == 1 and CPS > 1:  # per token, groups of whole words: build each float16 pair as one int32
        if W32 and NC == 1:
            m = _token_words(ptr, t, mask_t, BLOCK_T, W32 == 2)[:, None]
        elif W32:
            m = _meta_words(ptr, t, mask_t, SCOLS, NC, BLOCK_T)
        else:
            m = tl.load(ptr + t[:, None] * SCOLS + offs_c[None, :], mask=mask_t[:, None], other=0.0).to(tl.float16)
        b = m.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        pair = tl.reshape(tl.broadcast_to((b | (b << 16))[:, :, None], (BLOCK_T, NC, CPS // 2)), (BLOCK_T, D // 2))
        m = tl.reshape(_f16_pairs(pair), (BLOCK_T, D))
    elif TPS == 1:
        m = tl.load(ptr + t[:, None] * SCOLS + offs_c[None, :], mask=mask_t[:, None], other=0.0).to(tl.float16)
    elif TPS % BLOCK_T == 0:
        if W32 and CPS == 1:
            row = tl.full([1], 0, tl.int32) + t0 // TPS
            m = _pair_rows(_meta_words(ptr, row, row >= 0, SCOLS, NC, 1), 1, D, BITS)
        else:
            m = tl.load(ptr + (t0 // TPS) * SCOLS + offs_c[None, :]).to(tl.float16)  # (1, NC)
        if CPS > 1:
            m = tl.reshape(tl.broadcast_to(m[:, :, None], (1, NC, CPS)), (1, D))
        m = tl.broadcast_to(m, (BLOCK_T, D))
    else:
        R: tl.constexpr = BLOCK_T // TPS
        offs_r = tl.arange(0, R)
        if W32 and CPS == 1:
            m = _pair_rows(_meta_words(ptr, t0 // TPS + offs_r, t0 + offs_r * TPS < end, SCOLS, NC, R), R, D, BITS)
        else:
            m = tl.load(ptr + (t0 // TPS + offs_r)[:, None] * SCOLS + offs_c[None, :],
                        mask=(t0 + offs_r * TPS < end)[:, None], other=0.0).to(tl.float16)
        if CPS > 1:
            m = tl.reshape(tl.broadcast_to(m[:, :, None], (R, NC, CPS)), (R, D))
        m = tl.reshape(tl.broadcast_to(m[:, None, :], (R, TPS, D)), (BLOCK_T, D))
    return m


@triton.jit
def _load_rows16(codes_ptr, scale_ptr, zero_ptr, t0, t, mask_t, end, ROW, SCOLS, D: tl.constexpr,
                 BLOCK_T: tl.constexpr, BITS: tl.constexpr, TPS: tl.constexpr, CPS: tl.constexpr,
                 SYM: tl.constexpr, ASM: tl.constexpr, W32: tl.constexpr = False):
    """Whole rows of 2/4/8-bit integer codes → float16 ``(BLOCK_T, D)`` in pair order (``_codes16``), for
    float16 queries (``dequant="f16"``).

    Rows are read as int32 words, turned into exact float16 ``1024 + code``, then dequantized with one
    float16 fused multiply-add, ``(x - 1024) * s + z`` (``x - 1024`` is exact, so one rounding, as
    ``_load_rows`` then a cast to float16); symmetric: ``(x - 1024 - (2**(BITS-1) - 1)) * s``. The caller
    reads the queries (keys) or writes the output (values) at ``_pair_channels(D, BITS)``.
    """
    NW: tl.constexpr = D * BITS // 32
    words = codes_ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(words + t[:, None] * (ROW // 4) + tl.arange(0, NW)[None, :], mask=mask_t[:, None], other=0)
    x = _codes16(w, BITS, BLOCK_T, D, ASM)
    s = _meta16(scale_ptr, t0, t, mask_t, end, SCOLS, D, BLOCK_T, TPS, CPS, BITS, W32)
    if SYM:
        return (x - (1024.0 + ((1 << (BITS - 1)) - 1))) * s
    z = _meta16(zero_ptr, t0, t, mask_t, end, SCOLS, D, BLOCK_T, TPS, CPS, BITS, W32)
    return tl.fma(x - 1024.0, s, z)


@triton.jit
def _rope_rows(x, cos_ptr, sin_ptr, pos, valid, ROPE_W: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rotate-half RoPE of whole key rows ``x (BLOCK_T, D)`` at positions ``pos (BLOCK_T,)``, in registers.

    The halves ``x1 = x[:, :D/2]``, ``x2 = x[:, D/2:]`` come from one reshape/permute/split (no second
    read of the codes): ``(x1 * c - x2 * s, x2 * c + x1 * s)``, written as the gather path computes
    ``x * cos + rotate_half(x) * sin``; tables ``(P, ROPE_W)``, ``ROPE_W`` = ``D`` or ``D / 2``.
    """
    H: tl.constexpr = D // 2
    x1, x2 = tl.split(tl.permute(tl.reshape(x, (BLOCK_T, 2, H)), (0, 2, 1)))
    offs = pos[:, None] * ROPE_W + tl.arange(0, H)[None, :]
    c1 = tl.load(cos_ptr + offs, mask=valid[:, None], other=0.0)
    s1 = tl.load(sin_ptr + offs, mask=valid[:, None], other=0.0)
    c2 = c1
    s2 = s1
    if ROPE_W == D:  # full-width tables: the second half's own columns
        c2 = tl.load(cos_ptr + offs + H, mask=valid[:, None], other=0.0)
        s2 = tl.load(sin_ptr + offs + H, mask=valid[:, None], other=0.0)
    y1 = x1 * c1 + (-x2) * s1
    y2 = x2 * c2 + x1 * s2
    return tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (BLOCK_T, D))


@triton.jit
def _sat(x):
    """Float32 ``x`` clamped to float16's finite range, +-65504 (``kvbits.quant.tensor.saturate``)."""
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0)


@triton.jit
def _halves(x):
    """Float32 ``x`` as two float16, ``hi + lo == x`` to float32's precision (``lo``: the rounding of ``hi``)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _query_halves(x, SPLIT: tl.constexpr):
    """``(hi, lo)`` of a query tile: ``_halves(x)`` of a float32 ``q'`` if ``SPLIT``, else ``(x, x)`` (``lo`` unread)."""
    if SPLIT:
        return _halves(x)
    else:
        return x, x


@triton.jit
def _scores(q, q_lo, k, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """``q @ k``, float32 ``(G_PAD, BLOCK_T)``, for ``q (G_PAD, D)`` and ``k (D, BLOCK_T)``: in float32 (``IEEE``),
    else with ``k`` in the query's dtype on the tensor cores. ``SPLIT``: the query is ``q + q_lo`` (float16 halves
    of a float32 query), two dots into one accumulator."""
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    elif SPLIT:
        k16 = k.to(q.dtype)
        s = tl.dot(q_lo, k16, tl.dot(q, k16))
    else:
        s = tl.dot(q, k.to(q.dtype))
    return s


@triton.jit
def _attend(q, q_lo, k, v, valid, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """One online-softmax step: ``q (G_PAD, D)``, ``k (D, BLOCK_T)``, ``v (BLOCK_T, D)`` float32 tiles. ``SPLIT``:
    the query is ``q + q_lo`` (float16 halves of a float32 query), two dots into one accumulator."""
    return _online(_scores(q, q_lo, k, IEEE, SPLIT), q, v, valid, m_i, l_i, acc, qk_scale, IEEE)


@triton.jit
def _online(s, q, v, valid, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """The online-softmax step of ``_attend`` from its scores ``s (G_PAD, BLOCK_T)`` (before ``qk_scale``); ``q``
    gives the dtype of the value dot's operands."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv
# fmt: on


@triton.jit
def _tail_loop(q, q_lo, m_i, l_i, acc, KF, VF, FLEN, FMASK, b, bh, T_f, start, chunk_f, qk_scale, D: tl.constexpr,
               BLOCK_T: tl.constexpr, HAS_FMASK: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
               UNIFORM: tl.constexpr = False):
    """The online-softmax state ``(m_i, l_i, acc)`` of queries ``q (G_PAD, D)`` carried over the full-precision tail
    slots ``[start, start + chunk_f)`` of sequence ``b`` (``(B*H_kv, T_f, D)`` rows from slab ``bh``), in
    ``BLOCK_T``-token tiles (``FMASK``: its ``(B, T_f)`` slot mask). ``SPLIT``: float16 queries ``q + q_lo``
    (``_attend``). ``UNIFORM``: every sequence holds all ``T_f`` slots (``PackedStore.uniform_lens``), so ``FLEN``
    is not read. Shared by ``_decode_kernel`` and ``triton_fold._fold_kernel``."""
    if UNIFORM:
        n_f = T_f
    else:
        n_f = tl.load(FLEN + b)
    end = tl.minimum(start + chunk_f, n_f)
    kf = KF + bh * T_f * D
    vf = VF + bh * T_f * D
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + offs_t
        valid = t < end
        if HAS_FMASK:
            valid = valid & (tl.load(FMASK + b * T_f + t, mask=valid, other=0) != 0)
        k = _load_kv(kf, kf, kf, kf, kf, kf, t[None, :], offs_d[:, None], valid[None, :], D, 1,
                     16, 1, 1, True, 0, 0)
        v = _load_kv(vf, vf, vf, vf, vf, vf, t[:, None], offs_d[None, :], valid[:, None], D, 1,
                     16, 1, 1, True, 0, 0)
        m_i, l_i, acc = _attend(q, q_lo, k, v, valid, m_i, l_i, acc, qk_scale, IEEE, SPLIT)
    return m_i, l_i, acc


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


# The slot counts T_q / T_f only offset each (sequence, head) slab (times a row size that keeps the
# alignment) and index the padding masks; the split counts n_split_q / n_split only pick the branch and
# the partials' row: none is specialised, so decode steps whose residual window length (every step) or
# split count (as a short context grows) changes divisibility by 16 reuse the compiled kernel.
# fmt: off
@triton.jit(do_not_specialize=["T_q", "T_f", "n_split_q", "n_split", "QM_ROW", "q_used", "T_pos"])
def _decode_kernel(
    Q, M_OUT, L_OUT, ACC_OUT,                      # queries (B*H_q, D); partial outputs
    KC, KS, KZ, VC, VS, VZ, QLEN,                  # quantized store: codes, scales, zero-points; lengths
    KCB, KOV, KOI, VCB, VOV, VOI,                  # NUQ codebooks; sparse outlier values and indices
    KF, VF, FLEN,                                  # full-precision tail; lengths
    QMASK, FMASK,                                  # (B, T_q) / (B, T_f) uint8 slot masks (padding)
    COS, SIN, POS0,                                # pre-RoPE keys: tables (T_pos, D or D/2), first positions
    KMEAN, KFACTOR,                                # pre-RoPE centred / smoothed keys: float32 (H_kv, D) vectors
    qk_scale, H_kv, T_q, T_f,
    K_ROW, K_SROWS, K_SCOLS, V_ROW, V_SROWS, V_SCOLS,
    n_split_q, n_split, chunk_q, chunk_f, QM_ROW,   # QM_ROW: QMASK's row stride (rows of whole words)
    q_used,                                        # UNIFORM: every sequence's quantized length (QLEN not read)
    T_pos,                                         # ROPE: rows of COS / SIN (positions past them read the last)
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    K_BITS: tl.constexpr, K_TPS: tl.constexpr, K_CPS: tl.constexpr, K_SYM: tl.constexpr,
    K_KIND: tl.constexpr, K_NOUT: tl.constexpr,
    V_BITS: tl.constexpr, V_TPS: tl.constexpr, V_CPS: tl.constexpr, V_SYM: tl.constexpr,
    V_KIND: tl.constexpr, V_NOUT: tl.constexpr,
    HAS_QMASK: tl.constexpr, HAS_FMASK: tl.constexpr,
    ROPE: tl.constexpr, ROPE_W: tl.constexpr, IEEE: tl.constexpr, VEC_K: tl.constexpr, VEC_V: tl.constexpr,
    F16_K: tl.constexpr = False, F16_V: tl.constexpr = False, ASM: tl.constexpr = False,
    K_W32: tl.constexpr = False, V_W32: tl.constexpr = False, QMASK_W32: tl.constexpr = False,
    K_MEAN: tl.constexpr = False, K_FACTOR: tl.constexpr = False, Q_SPLIT: tl.constexpr = False,
    K_ROWS: tl.constexpr = False, UNIFORM: tl.constexpr = False, K_SAT: tl.constexpr = False,
):
    """Grid ``(B * H_kv, n_split)``; writes ``M/L (B*H_q, n_split)`` and ``ACC (B*H_q, n_split, D)``.
    ``UNIFORM`` (``PackedStore.uniform_lens``): every sequence's lengths are ``q_used`` and ``T_f``, so ``QLEN`` and
    ``FLEN`` are not read and a split's first tile loads need not wait for them.
    ``Q_SPLIT``: ``Q`` is the float32 ``q'`` of a rotated / smoothed store for float16 queries, taken as two
    float16 halves (``_halves``) in every key dot. ``K_ROWS`` (whole-row integer keys with one scale per token,
    no RoPE, no outliers): the query multiplies the codes, exact in float16, and each token's scale and
    zero-point apply to its score, ``s_t (q . c_t) + z_t sum(q)``, in float32; dequantized keys would be
    rounded to float16 for the dot. ``K_SAT`` (pre-RoPE centred / smoothed keys, float16 queries): the decoded keys
    are clamped to +-65504 before RoPE and after it (``_sat``), as ``reference.materialize`` saturates them, so
    their cast to float16 for the dot gives no inf (NaN in attention)."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_kv
    h = pid_bh % H_kv
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    gmask = offs_g < G
    row = b * (H_kv * G) + h * G + offs_g  # rows of (B * H_q): query heads h*G .. h*G+G-1 (repeat_kv order)
    q, q_lo = _query_halves(tl.load(Q + row[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0), Q_SPLIT)
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)  # finite: an empty split yields weight 0, not NaN
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    bh = pid_bh.to(tl.int64)  # (b, h) slabs can pass 2^31 bytes at long contexts and large batches
    acc_cols = offs_d
    if pid_s < n_split_q:
        start = pid_s * chunk_q
        if UNIFORM:
            n_q = q_used
        else:
            n_q = tl.load(QLEN + b)
        end = tl.minimum(start + chunk_q, n_q)
        kc = KC + bh * T_q * K_ROW
        ks = KS + bh * K_SROWS * K_SCOLS
        kz = KZ + bh * K_SROWS * K_SCOLS
        kov = KOV + bh * T_q * K_NOUT
        koi = KOI + bh * T_q * K_NOUT
        vc = VC + bh * T_q * V_ROW
        vs = VS + bh * V_SROWS * V_SCOLS
        vz = VZ + bh * V_SROWS * V_SCOLS
        vov = VOV + bh * T_q * V_NOUT
        voi = VOI + bh * T_q * V_NOUT
        qk, qk_lo = q, q_lo
        if K_ROWS:  # sum(q') for the zero-points' term of the scores (both halves of a split query)
            q_sum = tl.sum(q.to(tl.float32), 1)
            if Q_SPLIT:
                q_sum += tl.sum(q_lo.to(tl.float32), 1)
        if F16_K:  # the key tiles' columns are in pair order: so are the queries' channels
            qk, qk_lo = _query_halves(tl.load(Q + row[:, None] * D + _pair_channels(D, K_BITS)[None, :],
                                              mask=gmask[:, None], other=0.0), Q_SPLIT)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + offs_t
            valid = t < end
            if HAS_QMASK:
                if QMASK_W32:
                    valid = valid & (_mask_words(QMASK, b * QM_ROW + t0, end - t0, BLOCK_T) != 0)
                else:
                    valid = valid & (tl.load(QMASK + b * QM_ROW + t, mask=valid, other=0) != 0)
            # keys as a transposed (D, BLOCK_T) tile for q @ k
            if F16_K:  # float16 queries, plain integer codes: dequantized in float16, pair order (no RoPE)
                kr = _load_rows16(kc, ks, kz, t0, t, valid, end, K_ROW, K_SCOLS, D, BLOCK_T, K_BITS, K_TPS,
                                  K_CPS, K_SYM, ASM, K_W32)
                k = tl.trans(kr)
            elif K_ROWS:  # the codes themselves, exact in the dots' type (symmetric ones: z_t = -(2^(b-1) - 1) s_t)
                kr = _row_codes(kc, t, valid, K_ROW, D, BLOCK_T, K_BITS)
                # through float32: the interpreter converts int32 to bfloat16 as a bit pattern (Triton 3.6)
                k = tl.trans(kr.to(tl.float32))
                k_s, k_z = _row_meta(ks, kz, t, valid, K_BITS, K_SYM, K_W32, BLOCK_T)
            elif VEC_K:
                kr = _load_rows(kc, ks, kz, KCB, kov, koi, t, valid, K_ROW, K_SCOLS, D, BLOCK_T,
                                K_BITS, K_TPS, K_CPS, K_SYM, K_KIND, K_NOUT, K_W32)
                if ROPE:  # pre-RoPE keys (KVQuant §3.2): rotate the dequantized rows in registers
                    if K_FACTOR:  # pre-RoPE centred / smoothed keys: code * f + m, then RoPE
                        kr = kr * tl.load(KFACTOR + h * D + offs_d)[None, :]
                    if K_MEAN:
                        kr = kr + tl.load(KMEAN + h * D + offs_d)[None, :]
                    if K_SAT:
                        kr = _sat(kr)
                    # pad slots (masked) may sit before position 0; past the tables (a hand-built store): their last row, as
                    # the reference clamps (read past their end before: outputs 2.7 off the reference's)
                    pos = tl.minimum(tl.maximum(tl.load(POS0 + b) + t, 0), T_pos - 1)
                    kr = _rope_rows(kr, COS, SIN, pos, valid, ROPE_W, D, BLOCK_T)
                    if K_SAT:
                        kr = _sat(kr)
                k = tl.trans(kr)
            else:
                k = _load_kv(kc, ks, kz, KCB, kov, koi, t[None, :], offs_d[:, None], valid[None, :], K_ROW,
                             K_SCOLS, K_BITS, K_TPS, K_CPS, K_SYM, K_KIND, K_NOUT)
            if ROPE and not VEC_K:
                # pre-RoPE keys (KVQuant §3.2): rotate after dequantization, rotate-half convention
                # k * cos + rotate_half(k) * sin, rotate_half(k)[d] = -k[d + D/2] (d < D/2), k[d - D/2]
                # else. The partner channel is dequantized again from the same (cached) bytes.
                partner = (offs_d + D // 2) % D
                kp = _load_kv(kc, ks, kz, KCB, kov, koi, t[None, :], partner[:, None], valid[None, :], K_ROW,
                              K_SCOLS, K_BITS, K_TPS, K_CPS, K_SYM, K_KIND, K_NOUT)
                if K_FACTOR:  # centred / smoothed: code * f + m, each channel and its partner
                    k = k * tl.load(KFACTOR + h * D + offs_d)[:, None]
                    kp = kp * tl.load(KFACTOR + h * D + partner)[:, None]
                if K_MEAN:
                    k = k + tl.load(KMEAN + h * D + offs_d)[:, None]
                    kp = kp + tl.load(KMEAN + h * D + partner)[:, None]
                if K_SAT:
                    k = _sat(k)
                    kp = _sat(kp)
                # pad slots (masked) may sit before position 0; past the tables: their last row (see above)
                pos = tl.minimum(tl.maximum(tl.load(POS0 + b) + t, 0), T_pos - 1)
                cs_off = pos[None, :] * ROPE_W + (offs_d % ROPE_W)[:, None]  # ROPE_W = D or D / 2 (halves repeat)
                cos = tl.load(COS + cs_off, mask=valid[None, :], other=0.0)
                sin = tl.load(SIN + cs_off, mask=valid[None, :], other=0.0)
                k = k * cos + tl.where((offs_d < D // 2)[:, None], -kp, kp) * sin
                if K_SAT:
                    k = _sat(k)
            if F16_V:
                v = _load_rows16(vc, vs, vz, t0, t, valid, end, V_ROW, V_SCOLS, D, BLOCK_T, V_BITS, V_TPS, V_CPS,
                                 V_SYM, ASM, V_W32)
            elif VEC_V:
                v = _load_rows(vc, vs, vz, VCB, vov, voi, t, valid, V_ROW, V_SCOLS, D, BLOCK_T, V_BITS, V_TPS,
                               V_CPS, V_SYM, V_KIND, V_NOUT, V_W32)
            else:
                v = _load_kv(vc, vs, vz, VCB, vov, voi, t[:, None], offs_d[None, :], valid[:, None], V_ROW,
                             V_SCOLS, V_BITS, V_TPS, V_CPS, V_SYM, V_KIND, V_NOUT)
            if K_ROWS:
                sc = _scores(qk, qk_lo, k, IEEE, Q_SPLIT) * k_s[None, :] + k_z[None, :] * q_sum[:, None]
                m_i, l_i, acc = _online(sc, qk, v, valid, m_i, l_i, acc, qk_scale, IEEE)
            else:
                m_i, l_i, acc = _attend(qk, qk_lo, k, v, valid, m_i, l_i, acc, qk_scale, IEEE, Q_SPLIT)
        if F16_V:  # the accumulator's columns are in the values' pair order
            acc_cols = _pair_channels(D, V_BITS)
    else:
        m_i, l_i, acc = _tail_loop(q, q_lo, m_i, l_i, acc, KF, VF, FLEN, FMASK, b, bh, T_f,
                                   (pid_s - n_split_q) * chunk_f, chunk_f, qk_scale, D, BLOCK_T, HAS_FMASK, IEEE,
                                   Q_SPLIT, UNIFORM)
    out = row * n_split + pid_s
    tl.store(M_OUT + out, m_i, mask=gmask)
    tl.store(L_OUT + out, l_i, mask=gmask)
    tl.store(ACC_OUT + out[:, None] * D + acc_cols[None, :], acc, mask=gmask[:, None])
# fmt: on


REDUCE_BLOCK_S = 64  # splits per chunk of _reduce_kernel: one chunk up to 64 splits, 5 at the most a default launch makes


@triton.jit(do_not_specialize=["n_split"])
def _reduce_kernel(M, L, ACC, OUT, n_split, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Grid ``(B * H_q,)``: merge the split partials of one query row (log-sum-exp rescaling).

    One pass over the splits in ``BLOCK_S`` chunks with a running maximum: each chunk's ``M``, ``L`` and ``ACC``
    loads are issued together, and the sums so far are rescaled when the maximum grows (FlashAttention's online
    softmax over the splits). One compiled kernel for any number of splits. Until session 45 the kernel made two
    passes in 16-split chunks, the row maximum first: compiled for sm_90 every chunk was a synchronous round trip
    to memory, 18 of them at Qwen2.5's 130-odd splits (batch 1, 32K), and the H200's profile of a decode step timed it at
    6.1 µs against the decode kernel's 12 (BENCHMARKS.md §6, session 45); 64-split chunks make that 3.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D)
    m_run = tl.max(tl.full([BLOCK_S], -1.0e30, tl.float32), 0)  # finite: empty splits weigh 0, not NaN
    num = tl.zeros([D], tl.float32)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    for s0 in range(0, n_split, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        sm = offs < n_split
        m = tl.load(M + row * n_split + offs, mask=sm, other=-1.0e30)
        l_s = tl.load(L + row * n_split + offs, mask=sm, other=0.0)
        a = tl.load(ACC + (row * n_split + offs)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)  # the sums so far, to the new maximum (1 while it holds)
        w = tl.where(sm, tl.exp2(m - m_new), 0.0)
        num = num * alpha + tl.sum(w[:, None] * a, 0)
        den = den * alpha + tl.sum(w * l_s, 0)
        m_run = m_new
    # no slot to attend to (every one masked): 0, as torch's SDPA gives, not 0 / 0; a NaN den stays NaN
    tl.store(OUT + row * D + offs_d, tl.where(den == 0.0, 0.0, num / den).to(OUT.dtype.element_ty))


def reduce_splits(m: torch.Tensor, l_: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split partials ``m, l_ (rows, n_split)`` and ``acc (rows, n_split, D)`` float32 into ``out
    (rows, D)`` (``_reduce_kernel``; ``out``'s dtype) and return ``out``."""
    rows, n_split, D = acc.shape
    _reduce_kernel[(rows,)](m, l_, acc, out, n_split, BLOCK_S=REDUCE_BLOCK_S, D=D, num_warps=4)
    return out


@triton.jit
def _unpack_kernel(C, OUT, T, ROW, D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(B * H, cdiv(T, BLOCK_T))``: codes ``(B, H, T, D)`` uint8 through ``_unpack`` (tests)."""
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    mask = (t < T)[:, None]
    code = _unpack(C + bh * T * ROW, t[:, None], d[None, :], mask, ROW, BITS)
    tl.store(OUT + bh * T * D + t[:, None] * D + d[None, :], code.to(tl.uint8), mask=mask)


# fmt: off
@triton.jit
def _dequant_kernel(C, S, Z, CB, OV, OI, OUT, T, ROW, SROWS, SCOLS, D: tl.constexpr, BITS: tl.constexpr,
                    TPS: tl.constexpr, CPS: tl.constexpr, SYM: tl.constexpr, KIND: tl.constexpr,
                    NOUT: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr, F16: tl.constexpr = False,
                    ASM: tl.constexpr = False):
    """Grid ``(B * H, cdiv(T, BLOCK_T))``: float32 ``(B, H, T, D)`` through ``_load_kv`` / ``_load_rows`` /
    ``_load_rows16`` (tests)."""
    bh = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    mask = (t < T)[:, None]
    c, s, z = C + bh * T * ROW, S + bh * SROWS * SCOLS, Z + bh * SROWS * SCOLS
    ov, oi = OV + bh * T * NOUT, OI + bh * T * NOUT
    if F16:  # pair order: columns go back to their channels
        x = _load_rows16(c, s, z, t0, t, t < T, T, ROW, SCOLS, D, BLOCK_T, BITS, TPS, CPS, SYM, ASM).to(tl.float32)
        d = _pair_channels(D, BITS)
    elif VEC:
        x = _load_rows(c, s, z, CB, ov, oi, t, t < T, ROW, SCOLS, D, BLOCK_T, BITS, TPS, CPS, SYM, KIND, NOUT)
    else:
        x = _load_kv(c, s, z, CB, ov, oi, t[:, None], d[None, :], mask, ROW, SCOLS, BITS, TPS, CPS, SYM, KIND,
                     NOUT)
    tl.store(OUT + bh * T * D + t[:, None] * D + d[None, :], x, mask=mask)
# fmt: on


# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << (max(n, 1) - 1).bit_length()


def supported(store: PackedStore, q: torch.Tensor | None = None) -> str | None:
    """``None`` when the Triton kernels handle ``store`` (and ``q``), else the reason they do not."""
    D = store.head_dim
    if D < 16 or D & (D - 1):
        return f"head_dim must be a power of two >= 16 for the Triton kernel, got {D}"
    for side in (store.key, store.value):
        if side is None:
            continue
        if side.bits not in TRITON_BITS:
            return f"{side.bits}-bit codes are not supported by the Triton kernel (supported: {TRITON_BITS})"
        if (side.kind, side.fmt if side.kind == "fp8" else None) not in KIND_CODES:
            return f"{side.kind} {side.fmt or ''} codes are not supported by the Triton kernel"
    if q is not None and q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"queries must be float16, bfloat16 or float32, got {q.dtype}"
    return _read_layout_reason(store)


def _read_layout_reason(store: PackedStore) -> str | None:
    """``layout_reason``, except inside ``aot.compile_only``: launches there compile and read nothing, so stand-in
    tensors (``benchmarks/kernel_resources.py``'s stride-0 broadcasts) compile the kernels a real store would."""
    return None if aot.compiling() else layout_reason(store)


def layout_reason(store: PackedStore) -> str | None:
    """Why the kernels would misread ``store``'s tensors (``None``: they would not). They address every tensor as
    contiguous rows (a slab per ``(sequence, KV head)`` at ``bh * T * row``, the layout of ``reference``'s module
    docstring), so a view with other strides (``reference.used_slots``' first slots of a wider store, a slice of a
    longer tail) would be read at other elements' addresses, without a word; the torch reference reads any strides.
    The slot masks are exempt: the launchers take their row stride, or pack them. Asked up to three times per
    decode step (dispatch, the launch, the fold kernel's check): answered once per store."""
    if store._layout is None:
        k, v = store.key, store.value
        ts = (store.key_full, store.value_full, store.quant_lens, store.full_lens, store.rope_cos, store.rope_sin,
              store.quant_pos0)  # fmt: skip
        for p in (k, v):
            if p is not None:
                ts += (p.codes, p.scale, p.zero, p.codebook, p.outlier_values, p.outlier_index)
        if all(t is None or t.is_contiguous() for t in ts):  # every store the cache builds
            store._layout = (None,)
            return None
        parts = [("key_full", store.key_full), ("value_full", store.value_full), ("quant_lens", store.quant_lens),
                 ("full_lens", store.full_lens), ("rope_cos", store.rope_cos), ("rope_sin", store.rope_sin),
                 ("quant_pos0", store.quant_pos0)]  # fmt: skip
        for side, p in (("key", store.key), ("value", store.value)):
            if p is not None:
                parts += [(f"{side}.codes", p.codes), (f"{side}.scale", p.scale), (f"{side}.zero", p.zero),
                          (f"{side}.codebook", p.codebook), (f"{side}.outlier_values", p.outlier_values),
                          (f"{side}.outlier_index", p.outlier_index)]  # fmt: skip
        bad = [f"{name} {tuple(t.shape)} strides {t.stride()}" for name, t in parts
               if t is not None and not t.is_contiguous()]  # fmt: skip
        store._layout = (
            (f"the Triton kernels read contiguous tensors; {', '.join(bad)} not contiguous (the torch reference "
             "reads them, or pass .contiguous() copies)") if bad else None,
        )  # fmt: skip
    return store._layout[0]


def _num_splits(store: PackedStore, device: torch.device, target_programs: int | None) -> int:
    """Splits per (sequence, KV head): about two programs per SM on a GPU, a few on the interpreter. An empty batch
    (``B = 0``: no program to launch) gets 1, where it divided by zero."""
    if target_programs is None:
        target_programs = 2 * _sm_count(device) if device.type == "cuda" else 4
    return max(1, math.ceil(target_programs / max(1, store.batch * store.n_kv_heads)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (read once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A one-byte tensor on ``device`` standing for the pointer arguments a launch does not read (one per device,
    kept: it is never written or read)."""
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.empty(1, device=device, dtype=torch.uint8)
    return t


TILE_ELEMENTS = 4096  # block_t * D of the default tile: 64 tokens at D = 64, 32 at D = 128, 16 at D = 256
DEFAULT_WARPS = 4
DEFAULT_STAGES = 2


def launch_defaults(D: int, per_element: bool = False, ieee: bool = False) -> dict[str, int]:
    """``block_t``, ``num_warps``, ``num_stages`` of a decode launch at head dim ``D``.

    Chosen from the compiled kernels' resources (``benchmarks/kernel_resources.py``, BENCHMARKS.md §6) before
    any GPU timing; the H200's step 3b (2026-11-30, 32K, batch 8) then found them the fastest launch timed
    for pre-RoPE int4 at both head dims and within 5 % for int4 at D = 64, while int4 at D = 128 ran
    1.39x faster with 64-token tiles (not adopted: that launch's output was not checked on the device):

    - tiles of 4096 elements (64 tokens at D = 64, 32 at 128, 16 at 256), 2048 where a side is read per
      element (``per_element``: 3-bit codes, the gather path, sparse outliers, each a pass over the tile)
      or the queries are float32 (``ieee``: exact products on the CUDA cores, held in registers);
    - 4 warps; 8 for float32 queries and where the 16-token minimum tile exceeds the budget (per-element
      reads at D = 256); 16 warps would cap registers at 64 per thread and spill;
    - a 2-deep software pipeline;
    - ``decode_attention_triton`` then keeps the whole-row path at 32 tokens or more (``MIN_VEC_BLOCK_T``):
      32-token tiles where these defaults give 16 at D <= 128 (sparse outliers), the gather path at D = 256.

    On sm_90 every preset at D = 64, 128 and 256 then compiles without register spills (float16 / bfloat16
    queries; float32 ones still spill 150-200 bytes per thread at D = 256) and keeps 8-20 warps resident
    per SM. The previous launch (64-token tiles, Triton's 3 stages) spilled at D = 128, held one pre-RoPE
    program per SM, and needed 282 KiB of shared memory on the gather path: over the 227 KiB an H100/H200
    grants a block, so it would not have launched.
    """
    tile = TILE_ELEMENTS // (2 if per_element or ieee else 1)
    block_t = max(16, min(64, tile // D))  # tl.dot needs 16 rows at least: D = 256 can exceed the tile
    warps = 2 * DEFAULT_WARPS if ieee or block_t * D > tile else DEFAULT_WARPS  # 16 warps cap registers at 64
    return {"block_t": block_t, "num_warps": warps, "num_stages": DEFAULT_STAGES}


def whole_row_block_t(D: int) -> int:
    """Tokens per tile of the default launch over whole-row sides (2/4/8-bit codes, no outliers) at head dim ``D``:
    ``launch_defaults``' tile, at least ``MIN_VEC_BLOCK_T``."""
    return max(MIN_VEC_BLOCK_T, launch_defaults(D)["block_t"])


def _compile_fallbacks(q: torch.Tensor) -> bool:
    """Whether a launch that fails to compile falls back to a plainer variant (logged): on CUDA, where the
    product runs. Elsewhere (the interpreter, ``aot.compile_only``) the error is raised: those are tests."""
    return q.is_cuda


def _asm_ok() -> bool:
    """Whether kernels are compiled (inline PTX allowed), not run by Triton's interpreter."""
    return not interpret.interpreting()


def f16_ok(p: PackedTensor | None, block_t: int, q_dtype: torch.dtype) -> bool:
    """Whether ``dequant="f16"`` (``_load_rows16``) can read side ``p`` with ``block_t``-token tiles.

    Float16 queries; integer codes of 2, 4 or 8 bits without sparse outliers, in int32-aligned rows; float16
    scales and zero-points; scale groups that are whole tiles, several per tile, or per token; a power-of-two number of scale columns;
    head dim 32 or more: at head dim 16 the H200 (Triton 3.6, sm_90) computed a wrong output (max 2.77 from the
    float32 path, one query per KV head; BENCHMARKS.md §6z), which Triton's interpreter computes right, so that
    shape keeps the float32 path until ``benchmarks/kernel_failure_map.py`` has located the fault on a GPU.
    """
    if p is None or q_dtype != torch.float16 or p.kind != "int" or p.bits not in (2, 4, 8) or p.n_outliers:
        return False
    if p.head_dim < F16_MIN_HEAD_DIM:
        return False
    if any(m is not None and m.dtype != torch.float16 for m in (p.scale, p.zero)):
        return False  # float32 scales (scale_dtype="fp32"): the float32 path reads them
    if p.codes.shape[-1] % 4 or p.codes.data_ptr() % 4:
        return False
    tps_ok = p.tps == 1 or p.tps % block_t == 0 or block_t % p.tps == 0
    cps_ok = p.cps == 1 or p.cps % (32 // p.bits) == 0  # per channel, or whole int32 words per group
    return tps_ok and cps_ok and _pow2(p.head_dim // p.cps) == p.head_dim // p.cps


def _words_ok(p: PackedTensor | None) -> int:
    """How side ``p``'s float16 scales and zero-points can be read as int32 words (the ``K_W32`` / ``V_W32``
    constexpr): 1 for an even number of stored columns per row (``_meta_words``) or one value per token over
    an even number of rows (``_token_words``); 2 for one value per token over an odd number of rows
    (``_token_words(ODD=True)``: slabs alternate between starting on a word and in its middle), where the
    tensor is contiguous and holds an even number of values; 0 (2-byte reads) otherwise: float32 metadata,
    a base not 4-byte aligned, odd rows of several columns."""
    if p is None:
        return 0
    metas = [m for m in (p.scale, p.zero) if m is not None]
    if not metas or not all(m.dtype == torch.float16 and m.data_ptr() % 4 == 0 for m in metas):
        return 0
    if all(m.shape[-1] % 2 == 0 for m in metas):
        return 1
    if p.tps != 1 or any(m.shape[-1] != 1 for m in metas):
        return 0
    if all(m.shape[-2] % 2 == 0 for m in metas):
        return 1
    return 2 if all(m.is_contiguous() and m.numel() % 2 == 0 for m in metas) else 0


def _slot_mask(mask: torch.Tensor | None, dummy: torch.Tensor, block_t: int) -> tuple[torch.Tensor, int, bool]:
    """A ``(B, T)`` bool slot mask as the kernels take it: the uint8 tensor (rows of contiguous bytes), its row
    stride (``QM_ROW``) and whether its rows can be read as int32 words (``_mask_words``: whole words, 4-byte
    aligned, as ``reference.word_rows`` holds them at any ``T``; tiles start at multiples of ``block_t``);
    ``(dummy, 0, False)`` without a mask."""
    if mask is None:
        return dummy, 0, False
    m = (mask if mask.stride(1) == 1 else mask.contiguous()).view(torch.uint8)
    return m, m.stride(0), m.stride(0) % 4 == 0 and block_t % 4 == 0 and m.data_ptr() % 4 == 0


def _chunk(T: int, splits: int, block_t: int) -> tuple[int, int]:
    """(number of splits, tokens per split, a multiple of ``block_t``) covering ``T`` slots."""
    if T == 0:
        return 0, block_t
    splits = max(1, min(splits, math.ceil(T / block_t)))
    chunk = math.ceil(math.ceil(T / splits) / block_t) * block_t
    return math.ceil(T / chunk), chunk


def decode_attention_triton(
    q: torch.Tensor,
    store: PackedStore,
    scale: float | None = None,
    *,
    block_t: int | None = None,
    splits: int | None = None,
    target_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    vectorized: bool | None = None,
    dequant: str = "f32",
    maxnreg: int | None = None,
    meta32: bool = True,
    row_keys: bool = True,
) -> torch.Tensor:
    """Fused decode attention: ``q (B, H_q, 1, D)`` over ``store`` → ``(B, H_q, 1, D)`` in ``q.dtype``.

    Args:
        q: post-RoPE queries of the new token; ``H_q`` a multiple of the store's ``H_kv``.
        store: ``PackedStore`` (``reference.pack_store``), on ``q``'s device, its tensors contiguous (views with
            other strides are refused: ``layout_reason``). Rotated sides are attended in
            the codes' basis (``reference.code_basis``: ``q @ R_K`` and the rotated tail in, the output
            times ``R_V^T`` out, in float32 before the one cast to ``q.dtype``); pre-RoPE rotated keys are
            refused (``NotImplementedError``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        block_t, num_warps, num_stages: tokens per inner tile, warps per program, software-pipelining
            depth of the tile loop; each defaults to ``launch_defaults(D)``.
        splits: splits per (sequence, KV head) of the quantized slots (default: from ``target_programs``).
        target_programs: programs to aim for (default: 2 per SM on CUDA, 4 elsewhere).
        vectorized: read whole packed rows and unpack with ``tl.interleave`` (``_load_rows``) where the
            format allows (2/4/8-bit codes; pre-RoPE keys rotated in registers), instead of one gather per element
            (``_load_kv``). Default: yes, falling back to the gather path if that variant fails to
            compile on this Triton/GPU; and on tiles of fewer than ``MIN_VEC_BLOCK_T``
            tokens, which it computes wrongly on sm_90 (``True`` with such a ``block_t`` is refused).
            Unless ``block_t`` is given, a side the whole-row path can read gets 32-token tiles at
            D <= 128 and the gather path at D = 256.
        dequant: ``"fold"``: stores ``triton_fold.fold_supported`` accepts (2/4/8-bit integer codes with one scale
            per token row, keys per channel over token groups, values per channel group; float16 queries) go to
            ``triton_fold.decode_attention_fold`` (scales folded out of the tiles; ``block_t``, ``num_warps``,
            ``num_stages``, ``splits`` passed on, its own defaults otherwise); others take the ``"f32"`` path (the
            reason logged at debug level). ``"f32"`` (default) dequantizes in float32 and casts to the dots' type;
            ``"f16"``, with float16 queries, dequantizes the sides that are whole-row 2/4/8-bit integer codes without
            outliers or pre-RoPE rotation directly in float16 (``_load_rows16``: int32 word reads,
            magic-number conversion, one fused multiply-add); other sides keep ``"f32"``. Same rounding
            (one, to float16) and 21-37 % fewer instructions per token in sm_90 code
            (``benchmarks/kernel_resources.py``); not yet timed or checked on a GPU (BENCHMARKS.md §6). On
            CUDA, a configuration whose f16 variant fails to compile is logged and dequantized in float32.
        maxnreg: registers per thread the compiler may use (Triton's ``maxnreg``; default: its choice). At
            Llama-3-8B's shape ``dequant="f16"`` takes 160, three blocks per SM where the default path's 128
            allow four; ``maxnreg=128`` restores four at a few spilled bytes (a device-tuning knob).
        meta32: read float16 scales and zero-points as int32 words where a side allows it (``_words_ok``):
            per-token metadata (and, with ``dequant="f16"``, per-channel rows; one value per token over an odd
            slot count too, a growing cache's every other step), and the quantized slots' padding
            mask (``_slot_mask``). Two-byte (one-byte) loads
            are too narrow for ``cp.async``, so compiled for sm_90 they stayed synchronous loads inside
            the tile loop; as words they are prefetched with the codes (``benchmarks/kernel_cost.py``).
            Same values either way; ``False`` restores the 2-byte loads (the code session 9's H200 ran).
        row_keys: keys with one scale per token (2/4/8-bit integer codes read as whole rows, no outliers, not
            pre-RoPE; float16 or bfloat16 queries) enter the key dots as their codes, exact in the dots' type, and
            each token's scale and zero-point apply to its score in float32 (``K_ROWS``). ``False``: dequantized in
            float32 and rounded to the dots' type, as float16 torch rounds them; on SmolLM2's real per-token INT4
            caches that rounding put single decode steps at up to 3.1x float16 torch's error (BENCHMARKS.md §6,
            session 43).
    """
    if dequant not in DEQUANT_MODES:
        raise ValueError(f"dequant must be one of {DEQUANT_MODES}, got {dequant!r}")
    reason = supported(store, q)
    if reason:
        raise NotImplementedError(reason)
    if dequant == "fold":
        from kvbits.kernels.triton_fold import decode_attention_fold, fold_supported

        why = fold_supported(store, q)
        key = (q.shape[1] // store.n_kv_heads, store.head_dim, store.key.bits if store.key is not None else 0,
               store.value.bits if store.value is not None else 0)  # fmt: skip
        if why is None and key not in _FOLD_BROKEN:
            try:
                return decode_attention_fold(q, store, scale, block_t=block_t, splits=splits,
                                             target_programs=target_programs, num_warps=num_warps,
                                             num_stages=num_stages)  # fmt: skip
            except Exception as exc:  # the opt-in kernel failed: the float32 path (raised off CUDA)
                if not _compile_fallbacks(q):
                    raise
                _FOLD_BROKEN.add(key)
                logger.warning("dequant='fold' failed (%s: %s); dequantizing in float32", type(exc).__name__, exc)
        else:
            logger.debug("dequant='fold' does not read this store (%s): the float32 path", why or "failed before")
        dequant = "f32"
    H_kv = store.n_kv_heads
    B, H_q, one, D = q.shape if q.dim() == 4 else (-1, -1, -1, -1)  # any other rank: the message below
    if one != 1 or B != store.batch or D != store.head_dim or H_q % H_kv:
        raise ValueError(f"q must be (B={store.batch}, k*{H_kv}, 1, {store.head_dim}), got {tuple(q.shape)}")
    G = H_q // H_kv
    dev = q.device
    out_dtype = q.dtype
    # rotated / smoothed keys: the step in the codes' basis, q' = q R (q f) kept float32 for float16 queries and
    # split into two float16 halves in the kernel (Q_SPLIT): one float16 rounding of q', shared by every score,
    # put this kernel at 1.78x float16 torch's error at one of Qwen2.5's layers (int8-token-hadamard)
    # pre-RoPE centred / smoothed keys for float16 queries: saturated to float16's range before and after RoPE, as
    # the reference (materialize) saturates them (a tied factor moved into the query leaves no vector to tell)
    k_sat = store.pre_rope and store.key is not None and store.key.has_channel_transform and out_dtype == torch.float16
    q, store, out_rotate = code_basis(q, store, query_dtype=torch.float32 if out_dtype == torch.float16 else None)
    q_split = q.dtype != out_dtype  # only a float16 query's q' comes back float32

    def vec_ok(p: PackedTensor | None) -> bool:
        return p is not None and p.bits in (2, 4, 8) and _pow2(D // p.cps) == D // p.cps

    sides = [p for p in (store.key, store.value) if p is not None]
    ieee = out_dtype == torch.float32
    heavy = vectorized is False or any(not vec_ok(p) or p.n_outliers for p in sides)
    defaults = launch_defaults(D, per_element=heavy, ieee=ieee)
    if block_t is None:
        block_t = defaults["block_t"]
        if vectorized is not False and any(vec_ok(p) for p in sides) and block_t < MIN_VEC_BLOCK_T:
            if all(vec_ok(p) for p in sides) and MIN_VEC_BLOCK_T * D <= TILE_ELEMENTS and not ieee:
                block_t = MIN_VEC_BLOCK_T  # D <= 128: whole rows in 32-token tiles
            elif vectorized is None:  # 32-token tiles would pass launch_defaults' budget: gather at 16
                vectorized = False
                defaults = launch_defaults(D, per_element=True, ieee=ieee)
    if isinstance(block_t, bool) or not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16 (tl.arange's and tl.dot's sizes), got {block_t!r}")
    if block_t < MIN_VEC_BLOCK_T:
        if vectorized:
            raise ValueError(
                f"the whole-row (vectorized) path needs block_t >= {MIN_VEC_BLOCK_T}, got {block_t} "
                "(16-token tiles of it give wrong results on sm_90; see MIN_VEC_BLOCK_T)"
            )
        vectorized = False
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q2 = q.reshape(B * H_q, D).contiguous()
    if splits is None:
        splits = _num_splits(store, dev, target_programs)
    T_q = store.key.n_slots if store.key is not None else 0
    T_f = store.key_full.shape[2] if store.key_full is not None else 0
    # reserved slots past quant_used are never read: split only the used ones (T_q still strides the slabs)
    n_q, chunk_q = _chunk(store.quant_slots_used, splits, block_t)
    n_f, chunk_f = _chunk(T_f, splits, block_t)
    n_split = n_q + n_f
    m = torch.empty(B * H_q, n_split, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H_q, n_split, D, device=dev, dtype=torch.float32)
    dummy = _dummy(dev)  # never read
    k, v = store.key, store.value
    kf = store.key_full if store.key_full is not None else dummy
    vf = store.value_full if store.value_full is not None else dummy

    def side(p: PackedTensor | None) -> tuple:
        """Pointers (codes, scale, zero, codebook, outlier values, indices), strides, constexprs."""
        if p is None:
            return (dummy,) * 6, (1, 1, 1), (8, 1, 1, True, 0, 0)
        z = p.zero if p.zero is not None else p.scale
        cb = p.codebook if p.codebook is not None else dummy
        ov = p.outlier_values if p.outlier_values is not None else dummy
        oi = p.outlier_index if p.outlier_index is not None else dummy
        return (
            (p.codes, p.scale, z, cb, ov, oi),
            (p.codes.shape[-1], p.scale.shape[2], p.scale.shape[3]),
            (p.bits, p.tps, p.cps, p.zero is None, _kind_code(p), p.n_outliers),
        )

    k_ptrs, (k_row, k_srows, k_scols), k_const = side(k)
    v_ptrs, (v_row, v_srows, v_scols), v_const = side(v)
    kc, ks, kz, kcb, kov, koi = k_ptrs
    vc, vs, vz, vcb, vov, voi = v_ptrs
    rope = store.pre_rope
    cos = store.rope_cos if rope else dummy
    sin = store.rope_sin if rope else dummy
    pos0 = store.quant_pos0 if rope else dummy
    # pre-RoPE centred / smoothed keys (code_basis leaves them): the kernel decodes code * f + m, then RoPE
    k_mean = k.channel_mean if rope and k is not None else None
    k_factor = k.channel_factor if rope and k is not None else None
    kmean = k_mean.reshape(H_kv, D).float().contiguous() if k_mean is not None else dummy
    kfactor = k_factor.reshape(H_kv, D).float().contiguous() if k_factor is not None else dummy
    qmask, qm_row, qmask_words = _slot_mask(store.quant_mask, dummy, block_t)
    # rows read at b * T_f: a view of wider rows (word_rows) is packed first (no copy when already contiguous)
    fmask = store.full_mask.contiguous().view(torch.uint8) if store.full_mask is not None else dummy

    # fmt: off
    args = (
        q2, m, l_, acc,
        kc, ks, kz, vc, vs, vz, store.quant_lens,
        kcb, kov, koi, vcb, vov, voi,
        kf, vf, store.full_lens,
        qmask, fmask,
        cos, sin, pos0,
        kmean, kfactor,
        scale * LOG2E, H_kv, T_q, T_f,
        k_row, k_srows, k_scols, v_row, v_srows, v_scols,
        n_q, n_split, chunk_q, chunk_f, qm_row,
        store.quant_slots_used, cos.shape[0] if rope else 1,
    )
    meta = {
        "G": G, "G_PAD": max(16, _pow2(G)), "D": D, "BLOCK_T": block_t,
        **dict(zip(("K_BITS", "K_TPS", "K_CPS", "K_SYM", "K_KIND", "K_NOUT"), k_const)),
        **dict(zip(("V_BITS", "V_TPS", "V_CPS", "V_SYM", "V_KIND", "V_NOUT"), v_const)),
        "HAS_QMASK": store.quant_mask is not None, "HAS_FMASK": store.full_mask is not None,
        "ROPE": rope, "ROPE_W": cos.shape[1] if rope else D, "IEEE": ieee, "Q_SPLIT": q_split,
        "K_W32": _words_ok(k) if meta32 else 0, "V_W32": _words_ok(v) if meta32 else 0,
        "QMASK_W32": bool(meta32) and qmask_words,
        "K_MEAN": k_mean is not None, "K_FACTOR": k_factor is not None, "UNIFORM": store.uniform_lens,
        "K_SAT": k_sat,
        "num_warps": num_warps, "num_stages": num_stages,
    }
    if maxnreg is not None:
        meta["maxnreg"] = int(maxnreg)
    # fmt: on
    def config() -> tuple:  # the launch's key in the sets of variants that failed to compile (rarely needed)
        return tuple(sorted(meta.items()))

    use_vec = vectorized is not False and not (_VEC_BROKEN and config() in _VEC_BROKEN)
    vec_k, vec_v = use_vec and vec_ok(k), use_vec and vec_ok(v)
    f16_k, f16_v = (
        dequant == "f16" and vec and f16_ok(p, block_t, out_dtype) and not (p is k and rope)
        for vec, p in ((vec_k, k), (vec_v, v))
    )
    # per-token integer keys read as whole rows: the codes enter the key dots, their scales the scores (K_ROWS)
    rows_ok = (
        row_keys and vec_k and not f16_k and not ieee and not rope and k is not None
        and k.kind == "int" and k.tps == 1 and k.cps == D and not k.n_outliers
    )  # fmt: skip
    grid = (B * H_kv, n_split)
    fall_back = _compile_fallbacks(q)
    launched = False
    if (f16_k or f16_v) and not (_F16_BROKEN and config() in _F16_BROKEN):
        try:
            _decode_kernel[grid](*args, VEC_K=vec_k, VEC_V=vec_v, F16_K=f16_k, F16_V=f16_v, ASM=_asm_ok(),
                                 K_ROWS=rows_ok, **meta)
            launched = True
        except Exception as exc:  # a compile error of the opt-in path: keep the float32 one (re-raised off CUDA)
            if not fall_back:
                raise
            _F16_BROKEN.add(config())
            logger.warning("dequant='f16' failed to compile (%s); dequantizing in float32", type(exc).__name__)
    if not launched:
        if (vec_k or vec_v) and vectorized is None and fall_back:
            try:
                _decode_kernel[grid](*args, VEC_K=vec_k, VEC_V=vec_v, K_ROWS=rows_ok, **meta)
            except Exception as exc:  # noqa: BLE001 - any compile error of the interleave path: keep the gather path
                _VEC_BROKEN.add(config())
                logger.warning(
                    "vectorised unpacking failed to compile (%s); using per-element loads", type(exc).__name__
                )
                _decode_kernel[grid](*args, VEC_K=False, VEC_V=False, **meta)
        else:
            _decode_kernel[grid](*args, VEC_K=vec_k, VEC_V=vec_v, K_ROWS=rows_ok, **meta)
    # rotated values: the merged output stays float32 until it is rotated back (one rounding to the query's dtype)
    out = torch.empty(B * H_q, D, device=dev, dtype=out_dtype if out_rotate is None else torch.float32)
    out = reduce_splits(m, l_, acc, out).reshape(B, H_q, 1, D)
    return out if out_rotate is None else unrotate(out, out_rotate, out_dtype)


def unpack_codes_triton(p: PackedTensor, block_t: int = 32) -> torch.Tensor:
    """Codes ``(B, H_kv, T_q, D)`` uint8 unpacked by the kernels' own helper (for exact tests)."""
    B, H, T, row = p.codes.shape
    out = torch.empty(B, H, T, p.head_dim, dtype=torch.uint8, device=p.codes.device)
    _unpack_kernel[(B * H, triton.cdiv(T, block_t))](
        p.codes, out, T, row, D=p.head_dim, BITS=p.bits, BLOCK_T=block_t
    )
    return out


def dequantize_packed_triton(
    p: PackedTensor, block_t: int = 32, vectorized: bool = False, dequant: str = "f32"
) -> torch.Tensor:
    """Dequantized ``(B, H_kv, T_q, D)`` float32 through the kernels' own helpers (tests; unfused baseline).

    ``vectorized``: whole-row reads (``_load_rows``, 2/4/8-bit with a power-of-two number of scale
    columns) instead of per-element gathers (``_load_kv``). ``dequant="f16"``: ``_load_rows16`` (float16
    values, returned as float32; ``ValueError`` unless ``f16_ok(p, block_t, torch.float16)``). A rotated side
    (``p.rotate``) is rotated back after the kernel, and a centred / smoothed one multiplied and shifted back,
    like ``reference.dequantize_packed``.
    """
    if dequant not in ("f32", "f16"):
        raise ValueError(f"dequant must be 'f32' or 'f16' here (the folded kernel never dequantizes), got {dequant!r}")
    f16 = dequant == "f16"
    if f16 and not f16_ok(p, block_t, torch.float16):
        raise ValueError(f"dequant='f16' cannot read this side with block_t={block_t} (see f16_ok)")
    B, H, T, row = p.codes.shape
    out = torch.empty(B, H, T, p.head_dim, dtype=torch.float32, device=p.codes.device)
    dummy = torch.empty(1, device=p.codes.device, dtype=torch.uint8)
    z = p.zero if p.zero is not None else p.scale
    _dequant_kernel[(B * H, triton.cdiv(T, block_t))](
        p.codes, p.scale, z,
        p.codebook if p.codebook is not None else dummy,
        p.outlier_values if p.outlier_values is not None else dummy,
        p.outlier_index if p.outlier_index is not None else dummy,
        out, T, row, p.scale.shape[2], p.scale.shape[3],
        D=p.head_dim, BITS=p.bits, TPS=p.tps, CPS=p.cps, SYM=p.zero is None, KIND=_kind_code(p),
        NOUT=p.n_outliers, BLOCK_T=block_t, VEC=vectorized, F16=f16, ASM=f16 and _asm_ok(),
    )  # fmt: skip
    if p.rotate is not None:
        out = unrotate(out, p.rotate)
    return out if not p.has_channel_transform else from_channel_basis(out, p.channel_mean, p.channel_factor)
