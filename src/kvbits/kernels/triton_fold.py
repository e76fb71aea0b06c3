"""Fused decode attention with the scales folded out of the tiles: a leaner Triton kernel for integer codes.

A row with one scale (and zero-point) over all ``D`` channels (``tps == 1``, ``cps == D``: ``int8-token``,
``int4-token-hadamard``, vLLM's ``int8_per_token_head`` as ``vllm-int8``) decodes to ``x = c * s_t + z_t``
(symmetric codes: ``z_t = -(2**(bits-1) - 1) * s_t``), so

- scores ``q . k_t = s_t (q . c_t) + z_t sum(q)``: a dot of the query with the **raw codes**, then one multiply-add
  per score instead of one per code;
- values ``sum_t p_t v_t = sum_t (p_t s_t) c_t + (sum_t p_t z_t) 1``: the scales go into the probabilities (as
  float16 ``p_t s_t / u`` in units ``u`` of the tile's largest scale, so small values stay clear of the subnormals).
  The value codes enter centred, ``c - o`` with ``o = 2**(bits-1)`` (``2**(bits-1) - 1``, their zero, for symmetric
  codes; free in the conversion below), their row term ``z_t + o s_t`` in float32: the rounding of ``p_t s_t`` is
  shared by a token's channels, and on uncentred codes (all >= 0) it was a common offset of the output's channels,
  which a Hadamard-rotated store's output rotation gathers into one channel (``int4-token-hadamard`` on Qwen2.5:
  1.56x float16 torch's error, 1.00x centred; ``benchmarks/fold_real_kv.py``; symmetric 2-bit rows centred on 2
  instead of their zero 1: up to 4.6x, ``tests/test_fold.py``).

Keys scaled per channel over ``TPS`` tokens (KIVI, ``int4-channel``, static rows): the scale row folds into the
query instead, ``(q * s_j) . c_t + q . z_j`` for the tokens of row ``j`` (a batched dot when a tile spans several
rows; ``q * s_j`` split into two float16 halves, as one float16 rounding shared by the row's tokens was too coarse
on real caches). Values scaled per token over groups of ``C`` channels (KIVI's values): the codes are multiplied by their
float16 scales in the tile (one rounding, as a float16 dequantization) and the zero-points summed per group.

The codes become float16 exactly (``1024 + c`` is the float16 with bit pattern ``0x6400 | c``; one subtraction of
1024 is exact), four per 32-bit register through one inline-PTX block (mask, two byte permutes onto the ``0x64``
exponent byte, two packed subtractions: FasterTransformer's conversion, Kim et al. 2022), with no layout work on
the codes: the stored little-endian rows (``kvbits.quant.pack``) hold, in part ``k`` of each byte (bits
``[k bits, (k + 1) bits)``), the channels ``P i + k`` (``P = 8 / bits`` codes per byte), so a byte tile gives ``P``
code tiles of ``W = D / P`` channels each by a shift and a mask, and ``q . c = sum_k q[P i + k] . part_k``: the
query is read at those strided channels, and each part's output rows are written back to them.

Orientation: the codes are the tensor cores' row operand, ``S^T (BLOCK_T, N) = part_k(K) (BLOCK_T, W) @ q_k^T (W, N)``
and ``acc_k^T (W, N) += part_k(V)^T (W, BLOCK_T) @ (p s)^T (BLOCK_T, N)``, with the ``G`` query heads of the
KV head as the narrow ``N`` side (padded to 8 at least, not 16).

Rotated (Hadamard) keys and centred / smoothed ones are attended in the codes' basis (``reference.code_basis``), with
``q' = q R`` (``q f``) kept float32 and split into two float16 halves for every key dot (``Q_SPLIT``; the tail's too;
as the product kernel does): one float16 rounding of ``q'``, shared by every score of a query, was 2.61x float16
torch's error at one of Qwen2.5's layers (``int4-token-hadamard``; 0.76x split; BENCHMARKS.md §6, session 40), for
+0.9 to +5.0 warp-instructions per token on sm_90.

Compiled for sm_90 (``tests/test_aot.py``; BENCHMARKS.md §6, sessions 38-39) the tile loop issues 22-37 warp-instructions
per token on per-token rows and 29-56 on KIVI's groups, against the product kernel's float32 path's 38-85 (Llama-3-8B's
shape, INT4: 31 / 49 against 76 / 83). Not yet run on a GPU: opt-in (``KVBITS_DEQUANT=fold``,
``decode_attention_triton(dequant="fold")``) until the device run has checked and timed it. Sides it cannot read
(NUQ, FP8, 3-bit codes, outliers, pre-RoPE keys, keys in per-token channel groups, values per channel, float16
dots narrower than 16 bytes of codes, bfloat16 / float32 queries) go to the product kernel (``fold_supported``
says why).

The full-precision tail (sinks, residual window) is attended in its own splits with the product kernel's helpers,
and the partials are merged by its ``_reduce_kernel`` (``reduce_splits``). This module imports Triton; import it through
``kvbits.kernels.dispatch`` / ``triton_decode``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvbits.kernels.reference import STATIC_TPS, PackedStore, PackedTensor, code_basis
from kvbits.kernels.triton_decode import (
    LOG2E,
    _asm_ok,
    _chunk,
    _dummy,
    _halves,
    _mask_words,
    _num_splits,
    _pow2,
    _query_halves,
    _read_layout_reason,
    _row_meta,
    _scale_zero,
    _slot_mask,
    _tail_loop,
    _words_ok,
    reduce_splits,
)
from kvbits.quant.rotate import unrotate

__all__ = ["FOLD_BITS", "decode_attention_fold", "fold_defaults", "fold_supported"]

FOLD_BITS = (2, 4, 8)
FOLD_TILE_BYTES = 16384  # block_t * W of the default tile: 128 tokens up to D = 128 at INT8


# the inline-PTX conversion of four bytes (``$2``) into four exact float16 codes (``$0``, ``$1``): after ``t`` holds the
# part's codes, one per byte, two byte permutes put 0x64 above each (float16 ``1024 + c``) and two packed
# subtractions take ``m`` off: 1024 (``_PTX_M0``), or 1024 + 2**(bits-1) for centred codes ``c - 2**(bits-1)``
# (``_PTX_M{bits}``), or 1024 + 2**(bits-1) - 1 for symmetric codes centred on their zero (``_PTX_S{bits}``)
_PTX_HEAD = tl.constexpr("{ .reg .b32 m, t; ")
_PTX_M0 = tl.constexpr("mov.b32 m, 0x64006400; ")
_PTX_M2 = tl.constexpr("mov.b32 m, 0x64026402; ")
_PTX_M4 = tl.constexpr("mov.b32 m, 0x64086408; ")
_PTX_M8 = tl.constexpr("mov.b32 m, 0x64806480; ")
_PTX_S2 = tl.constexpr("mov.b32 m, 0x64016401; ")
_PTX_S4 = tl.constexpr("mov.b32 m, 0x64076407; ")
_PTX_S8 = tl.constexpr("mov.b32 m, 0x647F647F; ")
_PTX_TAIL = tl.constexpr(" prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342;"
                         " sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }")
# part k of BITS-bit codes into t, one per byte (``tests/test_fold.py`` runs these strings through a PTX emulator)
_P8_0 = tl.constexpr("mov.b32 t, $2;")
_P4_0 = tl.constexpr("and.b32 t, $2, 0x0F0F0F0F;")
_P4_1 = tl.constexpr("shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F;")
_P2_0 = tl.constexpr("and.b32 t, $2, 0x03030303;")
_P2_1 = tl.constexpr("shr.b32 t, $2, 2; and.b32 t, t, 0x03030303;")
_P2_2 = tl.constexpr("shr.b32 t, $2, 4; and.b32 t, t, 0x03030303;")
_P2_3 = tl.constexpr("shr.b32 t, $2, 6; and.b32 t, t, 0x03030303;")


# fmt: off
@triton.jit
def _ptx_codes(b, M: tl.constexpr, PART: tl.constexpr):
    """Four bytes of ``b`` per 32-bit register (``$2``) → four float16 (``$0``, ``$1``): ``PART`` leaves the part's
    codes in ``t``, one per byte; ``_PTX_TAIL`` turns them into float16 less ``M``'s offset."""
    return tl.inline_asm_elementwise(_PTX_HEAD + M + PART + _PTX_TAIL, "=r,=r,r", [b], dtype=tl.float16,
                                     is_pure=True, pack=4)


@triton.jit
def _ptx_part(b, k: tl.constexpr, BITS: tl.constexpr, M: tl.constexpr):
    """``_ptx_codes`` of part ``k`` of ``BITS``-bit codes (``_P{BITS}_{k}``)."""
    if BITS == 8:
        return _ptx_codes(b, M, _P8_0)
    elif BITS == 4:
        if k == 0:
            return _ptx_codes(b, M, _P4_0)
        else:
            return _ptx_codes(b, M, _P4_1)
    elif k == 0:
        return _ptx_codes(b, M, _P2_0)
    elif k == 1:
        return _ptx_codes(b, M, _P2_1)
    elif k == 2:
        return _ptx_codes(b, M, _P2_2)
    else:
        return _ptx_codes(b, M, _P2_3)


@triton.jit
def _codes(b, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, OFF: tl.constexpr):
    """Part ``k`` of packed bytes ``b`` (uint8, any shape): the codes at bits ``[k BITS, (k + 1) BITS)`` as exact
    float16, less ``OFF``: 0, ``2**(BITS-1)`` (centred) or ``2**(BITS-1) - 1`` (symmetric codes centred on their
    zero). ``ASM``: four bytes per 32-bit register in one PTX block (``_ptx_codes``); else the same arithmetic per
    element (the interpreter)."""
    if ASM:
        if OFF == 0:
            return _ptx_part(b, k, BITS, _PTX_M0)
        elif OFF == (1 << (BITS - 1)):
            if BITS == 8:
                return _ptx_part(b, k, BITS, _PTX_M8)
            elif BITS == 4:
                return _ptx_part(b, k, BITS, _PTX_M4)
            else:
                return _ptx_part(b, k, BITS, _PTX_M2)
        elif BITS == 8:
            return _ptx_part(b, k, BITS, _PTX_S8)
        elif BITS == 4:
            return _ptx_part(b, k, BITS, _PTX_S4)
        else:
            return _ptx_part(b, k, BITS, _PTX_S2)
    else:
        c = (b.to(tl.int16) >> (k * BITS)) & ((1 << BITS) - 1)
        return (c | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFF)


@triton.jit
def _unit_probs(p, s):
    """``p (BLOCK_T, N) * s (BLOCK_T,)`` as float16 in units of ``u = max(s)`` (1 where every scale is 0), and ``u``:
    the products enter the value dots as ``(p s / u) @ codes`` and the float32 result is multiplied by ``u``. Without
    the unit, ``p s`` of small values (scales of 1e-4, a probability of 1e-2) falls among float16's subnormals, and the
    output's error grows as the values shrink (INT8 rows of values of magnitude 5e-3: 3x float16 torch's error;
    of 5e-4: 20x; ``tests/test_fold.py::test_fold_small_values_keep_their_precision``)."""
    u = tl.max(s, 0)
    u = tl.where(u > 0, u, 1.0)
    return (p * (s * (1.0 / u))[:, None]).to(tl.float16), u


@triton.jit
def _group_unit(s, BITS: tl.constexpr):
    """The units ``u (BLOCK_T,)`` of value rows scaled per channel group, from their scales ``s (BLOCK_T, VG)``
    (float32): ``_scaled``'s float16 products ``(c - o) (s / u)`` (``|c - o| <= 2**(BITS-1)``) stay finite, and the
    probabilities enter the dots as ``p u`` (at most ``2**(BITS-1)``). 1 (the products as before) unless ``2**(BITS-1)
    max(s)`` over the row passes float16's 65504, else ``2**(BITS-1)`` (a power of two: exact, but for scales whose
    ``s / u`` falls among the subnormals). Without it values of magnitude 5e4 in 2-bit groups of 16 (scales of 3.3e4,
    ``(0 - 2) s`` = -6.7e4) attended to inf where the values, torch's float16 attention and the product kernel are
    finite (``tests/test_fold.py``). Per row, not per tile: a reduction over the tile spilled 424-432 bytes on sm_90
    (KIVI INT8 at D = 128, against 352; ``tests/test_aot.py``). Only for 2- and 4-bit codes: the units cost INT8 KIVI at
    Llama-3-8B's shape 0.715 of the float32 path's instructions per token, against 0.65 without (bound 0.7); 8-bit
    products, which pass 65520 only for a row spanning within 0.2% of +-65504 (scales over 511.9), take their scales
    halved instead (``V_HALF`` in ``_fold_kernel``: exact, no reduction)."""
    big = tl.max(s, 1) * (1 << (BITS - 1)) > 65504.0
    return tl.where(big, float(1 << (BITS - 1)), 1.0)


@triton.jit
def _query_unit(qmax):
    """The unit ``u`` (float32 scalar) of per-channel key dots for queries of largest magnitude ``qmax``: 1 where
    ``qmax <= 1``, else the power of two above it, so ``|q / u| <= 1`` and the float16 halves of ``(q / u) s``
    (``_chan_scores``) stay finite for every float16 scale. Without it a query of 12 over 4-bit keys spanning
    +-65504 (scales 8728) split ``q s`` = 1.0e5 into inf halves: NaN attention where the float32 reference's error
    was 4.9e-4 (``tests/test_fold.py``). Once per program, outside the tile loop."""
    qm = tl.minimum(qmax, 65504.0)  # float16 queries: the exponent below stays finite
    up = ((qm.to(tl.int32, bitcast=True) & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
    return tl.where(qm > 1.0, up, 1.0)


@triton.jit
def _q_part(Q, row, gmask, k: tl.constexpr, P: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """``q_k^T (W, N)``: the queries at channels ``P i + k`` (part ``k`` of a packed byte)."""
    ch = tl.arange(0, W) * P + k
    return tl.load(Q + row[None, :] * D + ch[:, None], mask=gmask[None, :], other=0.0)


@triton.jit
def _scores_part(kb, qk, qk_lo, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr):
    """``part_k(kb) (BLOCK_T, W) @ q_k^T (W, N)``: the codes' dot with the query, float32; ``SPLIT``: the query is
    ``qk + qk_lo`` (float16 halves of a float32 query, ``_halves``), two dots into one accumulator."""
    c = _codes(kb, k, BITS, ASM, 0)
    if SPLIT:
        return tl.dot(c, qk_lo, tl.dot(c, qk))
    return tl.dot(c, qk)


@triton.jit
def _scaled(vb, s3, k: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, VG: tl.constexpr, RPG: tl.constexpr,
            VW: tl.constexpr, BLOCK_T: tl.constexpr, OFF: tl.constexpr):
    """Part ``k`` of value bytes ``vb (VW, BLOCK_T)``, less ``OFF`` (``_codes``), times its float16 scales
    ``s3 (VG, 1, BLOCK_T)``: row ``i`` of the part is channel ``P i + k``, in scale group ``i // RPG``.
    ``(VW, BLOCK_T)`` float16."""
    c = tl.reshape(_codes(vb, k, BITS, ASM, OFF), (VG, RPG, BLOCK_T))
    return tl.reshape(c * s3, (VW, BLOCK_T))


@triton.jit
def _part(x, k: tl.constexpr, P: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """Columns ``P i + k`` (``i < W``) of rows ``x (R, P W)`` in channel order: ``(R, W)``, part ``k`` of ``P``-code bytes."""
    if P == 1:
        return x
    elif P == 2:
        even, odd = tl.split(tl.reshape(x, (R, W, 2)))
        return odd if k == 1 else even
    else:  # channel 4 i + 2 a + c: split c, then a; k = 2 a + c
        c0, c1 = tl.split(tl.reshape(x, (R, W, 2, 2)))
        a0, a1 = tl.split(c1 if k % 2 == 1 else c0)
        return a1 if k // 2 == 1 else a0


@triton.jit
def _chan_scores(kb, qk, sc, zc, k: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
                 W: tl.constexpr, R: tl.constexpr, TPS: tl.constexpr, BLOCK_T: tl.constexpr, N: tl.constexpr):
    """Scores of part ``k`` for keys scaled per channel (one row of ``D`` scales per ``TPS`` tokens), float32
    ``(BLOCK_T, N)``: the tile's ``R`` scale and additive rows ``sc, zc (R, D)`` float32, read whole (contiguous, so
    ``cp.async`` prefetches them with the codes, where reading part ``k``'s channels ``P i + k`` apart took 2-byte
    loads that stayed synchronous in the tile loop), give the part's columns (``_part``), which fold into the query,
    ``(q_k * s) @ part_k + q_k . z``; ``R > 1`` is a batched dot over the rows' ``TPS``-token groups. ``q * s``
    enters as two float16 halves, ``hi + lo`` (two dots into one float32 accumulator: exact to float32's
    precision). One float16 rounding of ``q * s``, shared by every token of the row, was up to 3.75x float16
    torch's error on Qwen2.5's KIVI cache (``benchmarks/fold_real_kv.py``; BENCHMARKS.md §6, session 39); the
    second dot costs 3 warp-instructions per token at Qwen2.5's shape, 5-7 at Llama-3-8B's."""
    sc = _part(sc, k, P, R, W)  # (R, W)
    zc = _part(zc, k, P, R, W)
    qf = qk.to(tl.float32)  # (W, N)
    if R == 1:
        hi, lo = _halves(qf * tl.reshape(sc, (W,))[:, None])
        bias = tl.sum(qf * tl.reshape(zc, (W,))[:, None], 0)
        c = _codes(kb, k, BITS, ASM, 0)
        return tl.dot(c, lo, tl.dot(c, hi)) + bias[None, :]
    else:
        hi, lo = _halves(qf[None, :, :] * sc[:, :, None])  # (R, W, N)
        bias = tl.sum(qf[None, :, :] * zc[:, :, None], 1)  # (R, N)
        c3 = tl.reshape(_codes(kb, k, BITS, ASM, 0), (R, TPS, W))
        return tl.reshape(tl.dot(c3, lo, tl.dot(c3, hi)) + bias[:, None, :], (BLOCK_T, N))


@triton.jit(do_not_specialize=["T_q", "T_f", "n_split_q", "n_split", "K_SROWS", "QM_ROW", "q_used"])
def _fold_kernel(
    Q, M_OUT, L_OUT, ACC_OUT,
    KC, KS, KZ, VC, VS, VZ, QLEN, KF, VF, FLEN, QMASK, FMASK,
    qk_scale, H_kv, T_q, T_f, n_split_q, n_split, chunk_q, chunk_f, K_SROWS, QM_ROW, q_used,
    G: tl.constexpr, N: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    K_BITS: tl.constexpr, K_SYM: tl.constexpr, V_BITS: tl.constexpr, V_SYM: tl.constexpr,
    HAS_QMASK: tl.constexpr, HAS_FMASK: tl.constexpr, QMASK_W32: tl.constexpr, ASM: tl.constexpr,
    K_W32: tl.constexpr, V_W32: tl.constexpr, K_TPS: tl.constexpr, K_CPS: tl.constexpr, V_CPS: tl.constexpr,
    K_R: tl.constexpr, Q_SPLIT: tl.constexpr, UNIFORM: tl.constexpr = False,
):
    """Grid ``(B * H_kv, n_split)``: splits ``[0, n_split_q)`` over the quantized slots (folded scales), the rest
    over the full-precision tail (``triton_decode``'s helpers). Writes ``M/L (B*H_q, n_split)`` and
    ``ACC (B*H_q, n_split, D)`` as ``triton_decode._decode_kernel`` does, for its ``_reduce_kernel``.

    Quantized codes ``(B*H_kv, T_q, D * bits / 8)`` uint8. Keys: one scale (and zero-point) per row
    (``K_CPS == D``: ``(B*H_kv, T_q)``), or per channel over ``K_TPS`` tokens (``K_CPS == 1``:
    ``(B*H_kv, K_SROWS, D)``). Values: per row, or per token and ``V_CPS`` channels (``(B*H_kv, T_q, D / V_CPS)``).
    Queries ``(B*H_q, D)`` float16, or float32 with ``Q_SPLIT`` (``q'`` of a rotated / smoothed store, ``code_basis``:
    per-row key dots take it as two float16 halves, per-channel ones fold it into ``q * s`` in float32 anyway).
    ``UNIFORM`` (``PackedStore.uniform_lens``): every sequence's lengths are ``q_used`` and ``T_f`` (``QLEN`` and
    ``FLEN`` not read), as in ``_decode_kernel``.
    """
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_kv
    h = pid_bh % H_kv
    bh = pid_bh.to(tl.int64)
    KP: tl.constexpr = 8 // K_BITS
    KW: tl.constexpr = D // KP
    VP: tl.constexpr = 8 // V_BITS
    VW: tl.constexpr = D // VP
    VG: tl.constexpr = D // V_CPS  # value scale groups per row
    RPG: tl.constexpr = VW // VG  # rows of a part's accumulator per value group
    # value codes enter the dots centred, c - V_OFF (``_codes``): on 2**(V_BITS-1), or on symmetric codes' zero
    # 2**(V_BITS-1) - 1 (their row term z + V_OFF s is then 0)
    V_OFF: tl.constexpr = (1 << (V_BITS - 1)) - V_SYM
    if pid_s < n_split_q:
        offs_n = tl.arange(0, N)
        gmask = offs_n < G
        row = b * (H_kv * G) + h * G + offs_n  # rows of (B * H_q), repeat_kv order
        q0 = _q_part(Q, row, gmask, 0, KP, KW, D)
        q1 = q0
        q2 = q0
        q3 = q0
        if KP > 1:
            q1 = _q_part(Q, row, gmask, 1, KP, KW, D)
        if KP > 2:
            q2 = _q_part(Q, row, gmask, 2, KP, KW, D)
            q3 = _q_part(Q, row, gmask, 3, KP, KW, D)
        # a float32 query (Q_SPLIT) as float16 halves q_k + q_kl for the per-row key dots (per-channel ones fold it
        # into q * s in float32)
        SPLIT_K: tl.constexpr = Q_SPLIT and K_CPS == D
        q0, q0l = _query_halves(q0, SPLIT_K)
        q1, q1l = _query_halves(q1, SPLIT_K)
        q2, q2l = _query_halves(q2, SPLIT_K)
        q3, q3l = _query_halves(q3, SPLIT_K)
        qall = tl.load(Q + row[None, :] * D + tl.arange(0, D)[:, None], mask=gmask[None, :],
                       other=0.0).to(tl.float32)  # (D, N)
        qsum = tl.sum(qall, 0)  # (N,)
        k_u = tl.full([], 1.0, tl.float32)
        if K_CPS != D:  # per-channel keys: (q / k_u) s within float16 (_query_unit), the scores times k_u
            k_u = _query_unit(tl.max(tl.max(tl.abs(qall), 1), 0))
            q0 = (q0.to(tl.float32) * (1.0 / k_u)).to(q0.dtype)  # a power of two: exact (bar float16 subnormals)
            q1 = (q1.to(tl.float32) * (1.0 / k_u)).to(q1.dtype)
            q2 = (q2.to(tl.float32) * (1.0 / k_u)).to(q2.dtype)
            q3 = (q3.to(tl.float32) * (1.0 / k_u)).to(q3.dtype)
        s_scale = qk_scale * k_u
        m_i = tl.full([N], -1.0e30, tl.float32)  # finite: an empty split yields weight 0, not NaN
        l_i = tl.zeros([N], tl.float32)
        a0 = tl.zeros([VW, N], tl.float32)
        if VG == 1:
            az = tl.zeros([N], tl.float32)  # sum_t p_t z_t: the values' additive terms, on every channel
        else:  # per value group g (the rows of each part whose channels P i + k lie in it)
            az = tl.zeros([VG, N], tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        start = pid_s * chunk_q
        if UNIFORM:
            n_q = q_used
        else:
            n_q = tl.load(QLEN + b)
        end = tl.minimum(start + chunk_q, n_q)
        kc = KC + bh * T_q * KW
        vc = VC + bh * T_q * VW
        ks = KS + bh * K_SROWS * (D // K_CPS)
        kz = KZ + bh * K_SROWS * (D // K_CPS)
        vs = VS + bh * T_q * VG
        vz = VZ + bh * T_q * VG
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + offs_t
            valid = t < end
            if HAS_QMASK:
                if QMASK_W32:
                    valid = valid & (_mask_words(QMASK, b * QM_ROW + t0, end - t0, BLOCK_T) != 0)
                else:
                    valid = valid & (tl.load(QMASK + b * QM_ROW + t, mask=valid, other=0) != 0)
            kb = tl.load(kc + t[:, None] * KW + tl.arange(0, KW)[None, :], mask=valid[:, None], other=0)
            if K_CPS == D:  # one scale per row: s_t (q . c_t) + z_t sum(q)
                s = _scores_part(kb, q0, q0l, 0, K_BITS, ASM, Q_SPLIT)
                if KP > 1:
                    s += _scores_part(kb, q1, q1l, 1, K_BITS, ASM, Q_SPLIT)
                if KP > 2:
                    s += _scores_part(kb, q2, q2l, 2, K_BITS, ASM, Q_SPLIT)
                    s += _scores_part(kb, q3, q3l, 3, K_BITS, ASM, Q_SPLIT)
                k_s, k_z = _row_meta(ks, kz, t, valid, K_BITS, K_SYM, K_W32, BLOCK_T)
                s = s * k_s[:, None] + k_z[:, None] * qsum[None, :]  # (BLOCK_T, N)
            else:  # per channel: the tile's scale rows fold into the query
                rows = t0 // K_TPS + tl.arange(0, K_R)
                mask_r = t0 + tl.arange(0, K_R) * K_TPS < end
                sc, zc = _scale_zero(ks, kz, rows[:, None] * D + tl.arange(0, D)[None, :], mask_r[:, None], K_BITS,
                                     K_SYM)  # (K_R, D): the tile's scale rows, whole
                s = _chan_scores(kb, q0, sc, zc, 0, KP, K_BITS, ASM, KW, K_R, K_TPS, BLOCK_T, N)
                if KP > 1:
                    s += _chan_scores(kb, q1, sc, zc, 1, KP, K_BITS, ASM, KW, K_R, K_TPS, BLOCK_T, N)
                if KP > 2:
                    s += _chan_scores(kb, q2, sc, zc, 2, KP, K_BITS, ASM, KW, K_R, K_TPS, BLOCK_T, N)
                    s += _chan_scores(kb, q3, sc, zc, 3, KP, K_BITS, ASM, KW, K_R, K_TPS, BLOCK_T, N)
            s = tl.where(valid[:, None], s * s_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
            if VG == 1:  # one scale per row: into the probabilities
                v_s, v_z = _row_meta(vs, vz, t, valid, V_BITS, V_SYM, V_W32, BLOCK_T)
                az = az * alpha + tl.sum(p * (v_z + V_OFF * v_s)[:, None], 0)  # centred codes' row term
                ps, v_u = _unit_probs(p, v_s)  # (BLOCK_T, N) float16, in units of the tile's largest scale
                vb = tl.load(vc + t[None, :] * VW + tl.arange(0, VW)[:, None], mask=valid[None, :], other=0)
                a0 = a0 * alpha[None, :] + tl.dot(_codes(vb, 0, V_BITS, ASM, V_OFF), ps) * v_u
                if VP > 1:
                    a1 = a1 * alpha[None, :] + tl.dot(_codes(vb, 1, V_BITS, ASM, V_OFF), ps) * v_u
                if VP > 2:
                    a2 = a2 * alpha[None, :] + tl.dot(_codes(vb, 2, V_BITS, ASM, V_OFF), ps) * v_u
                    a3 = a3 * alpha[None, :] + tl.dot(_codes(vb, 3, V_BITS, ASM, V_OFF), ps) * v_u
            else:  # VG scale groups per row: the codes scaled in float16 (one rounding, as a float16 dequantization)
                vsc, vzc = _scale_zero(vs, vz, t[:, None] * VG + tl.arange(0, VG)[None, :], valid[:, None], V_BITS,
                                       V_SYM)  # (BLOCK_T, VG)
                az = az * alpha[None, :] + tl.sum(p[:, None, :] * (vzc + V_OFF * vsc)[:, :, None], 0)  # (VG, N)
                if V_BITS < 8:  # 1, or 2**(V_BITS-1) where a code times its scale could pass 65504 (_group_unit)
                    v_u = _group_unit(vsc, V_BITS)
                    s3 = tl.trans(vsc * (1.0 / v_u)[:, None]).to(tl.float16)[:, None, :]  # (VG, 1, BLOCK_T)
                    p16 = (p * v_u[:, None]).to(tl.float16)  # <= 2**(V_BITS-1): the unit goes back in with p
                else:  # 8-bit: the scales halved (exact), the accumulators doubled at the end (V_HALF)
                    s3 = tl.trans(vsc * 0.5).to(tl.float16)[:, None, :]
                    p16 = p.to(tl.float16)
                vb = tl.load(vc + t[None, :] * VW + tl.arange(0, VW)[:, None], mask=valid[None, :], other=0)
                a0 = a0 * alpha[None, :] + tl.dot(_scaled(vb, s3, 0, V_BITS, ASM, VG, RPG, VW, BLOCK_T, V_OFF), p16)
                if VP > 1:
                    a1 = a1 * alpha[None, :] + tl.dot(_scaled(vb, s3, 1, V_BITS, ASM, VG, RPG, VW, BLOCK_T, V_OFF), p16)
                if VP > 2:
                    a2 = a2 * alpha[None, :] + tl.dot(_scaled(vb, s3, 2, V_BITS, ASM, VG, RPG, VW, BLOCK_T, V_OFF), p16)
                    a3 = a3 * alpha[None, :] + tl.dot(_scaled(vb, s3, 3, V_BITS, ASM, VG, RPG, VW, BLOCK_T, V_OFF), p16)
        out = row * n_split + pid_s
        tl.store(M_OUT + out, m_i, mask=gmask)
        tl.store(L_OUT + out, l_i, mask=gmask)
        acc_p = ACC_OUT + out[None, :] * D + tl.arange(0, VW)[:, None] * VP  # part k: channels P i + k
        gm = gmask[None, :]
        if VG == 1:
            azw = az[None, :]
        else:
            azw = tl.reshape(tl.broadcast_to(az[:, None, :], (VG, RPG, N)), (VW, N))
        # 8-bit values in channel groups entered with their scales halved: |c - 128| s reached 65760 (inf in
        # float16) for a group spanning +-65504 (scale 513.5); 128 s / 2 stays finite, and the doubling is exact
        V_HALF: tl.constexpr = 2.0 if (VG > 1 and V_BITS == 8) else 1.0
        tl.store(acc_p, a0 * V_HALF + azw, mask=gm)
        if VP > 1:
            tl.store(acc_p + 1, a1 * V_HALF + azw, mask=gm)
        if VP > 2:
            tl.store(acc_p + 2, a2 * V_HALF + azw, mask=gm)
            tl.store(acc_p + 3, a3 * V_HALF + azw, mask=gm)
    else:  # the full-precision tail: triton_decode's loop (float16 dots, float32 accumulation); own names, as
        # Triton needs a variable to keep one type across the branches
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        fmask_g = offs_g < G
        frow = b * (H_kv * G) + h * G + offs_g
        fq, fq_lo = _query_halves(tl.load(Q + frow[:, None] * D + offs_d[None, :], mask=fmask_g[:, None], other=0.0),
                                  Q_SPLIT)  # float32 q' of a rotated / smoothed store: two float16 halves here too
        fm = tl.full([G_PAD], -1.0e30, tl.float32)
        fl = tl.zeros([G_PAD], tl.float32)
        facc = tl.zeros([G_PAD, D], tl.float32)
        fm, fl, facc = _tail_loop(fq, fq_lo, fm, fl, facc, KF, VF, FLEN, FMASK, b, bh, T_f,
                                  (pid_s - n_split_q) * chunk_f, chunk_f, qk_scale, D, BLOCK_F, HAS_FMASK, False, Q_SPLIT,
                                  UNIFORM)
        fout = frow * n_split + pid_s
        tl.store(M_OUT + fout, fm, mask=fmask_g)
        tl.store(L_OUT + fout, fl, mask=fmask_g)
        tl.store(ACC_OUT + fout[:, None] * D + offs_d[None, :], facc, mask=fmask_g[:, None])
# fmt: on


def _side_ok(p: PackedTensor | None, which: str) -> str | None:
    if p is None:
        return f"the {which} have no quantized side"
    if p.kind != "int" or p.bits not in FOLD_BITS:
        return f"{which}: {p.kind} {p.bits}-bit codes (the folded kernel reads 2/4/8-bit integer codes)"
    D, P = p.head_dim, 8 // p.bits
    row = p.tps == 1 and p.cps == D
    if which == "keys" and not (row or (p.cps == 1 and p.tps & (p.tps - 1) == 0)):
        return (f"keys: one scale per {p.tps} tokens and {p.cps} channels (the folded kernel reads one per token row, "
                "or per channel over a power-of-two number of tokens)")  # fmt: skip
    if which == "values" and not (row or (p.tps == 1 and p.cps & (p.cps - 1) == 0 and p.cps >= P)):
        return (f"values: one scale per {p.tps} tokens and {p.cps} channels (the folded kernel reads one per token "
                f"row, or per token over power-of-two groups of {P} channels or more)")  # fmt: skip
    if p.n_outliers:
        return f"{which}: sparse outliers"
    if p.head_dim * p.bits < 128:
        return f"{which}: rows of {p.head_dim * p.bits // 8} bytes (the folded kernel's dots need 16 at least)"
    if p.codes.shape[-1] != p.head_dim * p.bits // 8:
        return f"{which}: codes rows of {p.codes.shape[-1]} bytes, expected {p.head_dim * p.bits // 8}"
    return None


def fold_supported(store: PackedStore, q: torch.Tensor | None = None) -> str | None:
    """``None`` when ``decode_attention_fold`` reads ``store`` (and ``q``), else why not."""
    if q is not None and q.dtype != torch.float16:
        return f"the folded kernel takes float16 queries, got {q.dtype}"
    D = store.head_dim
    if D < 16 or D & (D - 1):
        return f"head_dim must be a power of two >= 16, got {D}"
    if store.pre_rope:
        return "pre-RoPE keys (the folded kernel does not rotate keys)"
    for p, which in ((store.key, "keys"), (store.value, "values")):
        reason = _side_ok(p, which)
        if reason:
            return reason
    return _read_layout_reason(store)


def fold_defaults(D: int, k_bits: int, v_bits: int, G: int) -> dict[str, int]:
    """``block_t``, ``num_warps``, ``num_stages``, ``n_rows`` of a folded launch: 128-token tiles (fewer where a
    row is wider than 128 bytes), 4 warps, 2 stages, the ``G`` query heads padded to a power of two, 8 at least.
    Chosen from sm_90 compiles (registers, spills, instructions per token; BENCHMARKS.md §6 session 38), not yet
    from a GPU timing."""
    W = D * max(k_bits, v_bits) // 8
    return {"block_t": max(16, min(128, FOLD_TILE_BYTES // W)), "num_warps": 4, "num_stages": 2,
            "n_rows": max(8, _pow2(G))}  # fmt: skip


def decode_attention_fold(
    q: torch.Tensor,
    store: PackedStore,
    scale: float | None = None,
    *,
    block_t: int | None = None,
    splits: int | None = None,
    target_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    n_rows: int | None = None,
    meta32: bool = False,
) -> torch.Tensor:
    """Fused decode attention with folded scales: ``q (B, H_q, 1, D)`` float16 over ``store`` → ``(B, H_q, 1, D)``.

    Same contract as ``triton_decode.decode_attention_triton`` (rotated sides attended in the codes' basis,
    ragged lengths, slot masks, the full-precision tail) for stores ``fold_supported`` accepts
    (``NotImplementedError`` with its reason otherwise). ``block_t``, ``num_warps``, ``num_stages``, ``n_rows``
    (query rows per tile, ``>= G``) default to ``fold_defaults``; ``splits`` / ``target_programs`` as there.
    ``meta32``: read float16 scales and zero-points as int32 words of two tokens (``_row_meta``; over an odd slot
    count too, ``_words_ok`` 2).
    """
    reason = fold_supported(store, q)
    if reason:
        raise NotImplementedError(reason)
    H_kv = store.n_kv_heads
    B, H_q, one, D = q.shape if q.dim() == 4 else (-1, -1, -1, -1)  # any other rank: the message below
    if one != 1 or B != store.batch or D != store.head_dim or H_q % H_kv:
        raise ValueError(f"q must be (B={store.batch}, k*{H_kv}, 1, {store.head_dim}), got {tuple(q.shape)}")
    G = H_q // H_kv
    # a rotated / smoothed store's q' = q R (q f) stays float32: one float16 rounding of it, shared by every key
    # score, was 2.6x float16 torch's error at one of Qwen2.5's layers (int4-token-hadamard; fold_real_kv.py)
    q, store, out_rotate = code_basis(q, store, query_dtype=torch.float32)
    k, v = store.key, store.value
    d = fold_defaults(D, k.bits, v.bits, G)
    block_t = d["block_t"] if block_t is None else int(block_t)
    n_rows = d["n_rows"] if n_rows is None else int(n_rows)
    if n_rows < G or n_rows & (n_rows - 1) or block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"n_rows must be a power of two >= G={G} and block_t one >= 16, got {n_rows}, {block_t}")
    dev = q.device
    q2 = q.reshape(B * H_q, D).contiguous()
    if splits is None:
        splits = _num_splits(store, dev, target_programs)
    T_q = k.n_slots
    T_f = store.key_full.shape[2] if store.key_full is not None else 0
    block_f = max(16, min(64, 4096 // D))
    n_q, chunk_q = _chunk(store.quant_slots_used, splits, block_t)
    n_f, chunk_f = _chunk(T_f, splits, block_f)
    n_split = n_q + n_f
    m = torch.empty(B * H_q, n_split, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H_q, n_split, D, device=dev, dtype=torch.float32)
    dummy = _dummy(dev)  # never read
    kf = store.key_full if store.key_full is not None else dummy
    vf = store.value_full if store.value_full is not None else dummy
    qmask, qm_row, qmask_words = _slot_mask(store.quant_mask, dummy, block_t)
    # rows read at b * T_f: a view of wider rows (word_rows) is packed first (no copy when already contiguous)
    fmask = store.full_mask.contiguous().view(torch.uint8) if store.full_mask is not None else dummy
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    _fold_kernel[(B * H_kv, n_split)](
        q2, m, l_, acc,
        k.codes, k.scale, k.zero if k.zero is not None else k.scale,
        v.codes, v.scale, v.zero if v.zero is not None else v.scale,
        store.quant_lens, kf, vf, store.full_lens, qmask, fmask,
        scale * LOG2E, H_kv, T_q, T_f, n_q, n_split, chunk_q, chunk_f, k.scale.shape[2], qm_row,
        store.quant_slots_used, UNIFORM=store.uniform_lens,
        G=G, N=n_rows, G_PAD=max(16, _pow2(G)), D=D, BLOCK_T=block_t, BLOCK_F=block_f,
        K_BITS=k.bits, K_SYM=k.zero is None, V_BITS=v.bits, V_SYM=v.zero is None,
        HAS_QMASK=store.quant_mask is not None, HAS_FMASK=store.full_mask is not None,
        QMASK_W32=qmask_words, ASM=_asm_ok(),
        K_W32=_words_ok(k) if meta32 else 0, V_W32=_words_ok(v) if meta32 else 0,
        K_TPS=min(k.tps, STATIC_TPS), K_CPS=k.cps, V_CPS=v.cps, K_R=max(1, block_t // k.tps),
        Q_SPLIT=q.dtype == torch.float32,
        num_warps=d["num_warps"] if num_warps is None else num_warps,
        num_stages=d["num_stages"] if num_stages is None else num_stages,
    )  # fmt: skip
    out = torch.empty(B * H_q, D, device=dev, dtype=torch.float16 if out_rotate is None else torch.float32)
    out = reduce_splits(m, l_, acc, out).reshape(B, H_q, 1, D)
    return out if out_rotate is None else unrotate(out, out_rotate, torch.float16)
