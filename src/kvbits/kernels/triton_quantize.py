"""Quantize-and-pack on append: one Triton kernel from new K/V tokens to the packed store.

``quantize_pack_triton(x, spec)`` returns the ``QuantizedTensor`` that ``kvbits.quant.quantize(x, spec)``
returns (the torch reference beside it), **bit for bit**: same packed codes, same float16 scales and
zero-points, same clipped count (0 for dynamic ranges, which cover their data: only a static spec's kernel keeps a
counter, so a per-token flush launches no counter fill and reads back no count). One program reads a tile of ``x`` once and writes its codes and
metadata; no float32 copy of ``x``, no separate min/max, divide, round, clamp and pack passes.

Exactness follows the reference's formulas (``kvbits.quant.affine``) operation by operation:

- ranges in float32; zero-point rounded *down* and scale rounded *up* to float16 (``_fp16_down`` /
  ``_fp16_up``: round to nearest, then one float16 step outward when that landed inside, as
  ``torch.nextafter`` does), the scale capped where its top level would decode past 65504 (``_fp16_capped``);
- IEEE divisions (``tl.math.div_rn``; Triton's plain ``/`` is approximate on GPUs);
- round half to even (``_rint``, as ``torch.round``), clamp, then the little-endian bit packing of
  ``kvbits.quant.pack`` (code ``k`` of a byte at bits ``[k * bits, (k + 1) * bits)``).

Formats: integer codes of 2, 3, 4 or 8 bits, asymmetric or symmetric, per token (groups of ``g``
channels), per channel over groups of ``G`` tokens (KIVI keys, block-wise KVQuant ranges), or static
per-channel ranges from a calibration (clipped elements counted with one atomic add per program);
FP8 e4m3 / e5m2 with one scale per token row or one static scale (``_fp8_kernel``: the float8 bits are
assembled from the float32 fields with round half to even, as torch's casts). NUQ codes (KVQuant) in
the same layouts: the index of the nearest codebook entry, as ``torch.bucketize`` over the entries'
midpoints. Dense-and-sparse outliers with any of these: chosen by the reference's ``select_outliers``
(``torch.topk``; ties resolve as there), then left out of the ranges and clipped counts in the kernel.
Codes of 2, 3 (8 codes in 3 bytes), 4 or 8 bits. Head / tensor integer granularity is left to the torch
reference by ``kvbits.kernels.quantize.quantize_pack``.

This module imports Triton at import time; import it through ``kvbits.kernels.quantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbits.quant.tensor import QuantizedTensor, _codebook, _static_qparams, select_outliers
from kvbits.schemes import TensorSpec

__all__ = ["quantize_pack_triton", "supported"]

TOKEN_ROWS = 16  # tokens per program for per-token scales
MODE_TOKEN, MODE_CHANNEL, MODE_STATIC = 0, 1, 2


@triton.jit
def _fp16_up(x):
    """The smallest float16 >= ``x`` (float32), as ``kvbits.quant.affine._round_up_fp16``."""
    h = x.to(tl.float16)
    hf = h.to(tl.float32)
    b = h.to(tl.int16, bitcast=True)
    nxt = tl.where(hf > 0, b + 1, tl.where(hf < 0, b - 1, 1)).to(tl.int16)  # toward +inf; +-0 -> 2^-24
    return tl.where(hf < x, nxt.to(tl.float16, bitcast=True), h)


@triton.jit
def _fp16_down(x):
    """The largest float16 <= ``x`` (float32), as ``kvbits.quant.affine._round_down_fp16``."""
    h = x.to(tl.float16)
    hf = h.to(tl.float32)
    b = h.to(tl.int16, bitcast=True)
    nxt = tl.where(hf > 0, b - 1, tl.where(hf < 0, b + 1, -32767)).to(tl.int16)  # toward -inf; +-0 -> -2^-24
    return tl.where(hf > x, nxt.to(tl.float16, bitcast=True), h)


@triton.jit
def _fp16_capped(scale, zero, steps):
    """float16 ``scale`` capped so its top level ``steps * scale + zero`` (float32 ``zero``; 0 when symmetric)
    stays within 65504, as ``kvbits.quant.affine._stored_scale`` (an inf scale stays inf)."""
    # a top above 65504 * steps caps at 65504 either way; bounded, its cast to float16 does not overflow
    cap = _fp16_down(tl.math.div_rn(tl.minimum(65504.0 - zero, 65504.0 * steps), steps))
    return tl.where(scale.to(tl.float32) > 65504.0, scale, tl.minimum(scale, cap))


@triton.jit
def _rint(y):
    """Round half to even (``torch.round``), exact for every float32: ``y - floor(y)`` is exact."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _codes(x, s, z, BITS: tl.constexpr, SYM: tl.constexpr):
    """Integer codes (int32) and a clipped mask of ``x`` under float32 ``s`` / ``z`` (``quantize_affine``)."""
    safe = tl.where(s > 0, s, 1.0)
    if SYM:
        c: tl.constexpr = (1 << (BITS - 1)) - 1
        q = _rint(tl.math.div_rn(x, safe)) + c
        q = tl.where(s > 0, q, c)
        hi: tl.constexpr = 2 * c
    else:
        q = _rint(tl.math.div_rn(x - z, safe))
        q = tl.where(s > 0, q, 0.0)
        hi: tl.constexpr = (1 << BITS) - 1
    clipped = (q < 0) | (q > hi)
    return tl.minimum(tl.maximum(q, 0.0), hi).to(tl.int32), clipped


@triton.jit
def _qparams(lo, hi, amax, BITS: tl.constexpr, SYM: tl.constexpr):
    """float16 ``(scale, zero)`` of a group from its float32 range (``choose_qparams``); ``zero`` = scale when SYM."""
    if SYM:
        steps = ((1 << (BITS - 1)) - 1) * 1.0
        scale = _fp16_capped(_fp16_up(tl.math.div_rn(amax, steps)), 0.0 * amax, steps)
        zero = scale
    else:
        steps = ((1 << BITS) - 1) * 1.0
        zero = _fp16_down(lo)
        zf = zero.to(tl.float32)
        scale = _fp16_capped(_fp16_up(tl.math.div_rn(tl.maximum(hi - zf, 0.0), steps)), zf, steps)
    return scale, zero


@triton.jit
def _nuq_codes(x, s, z, MIDS, BITS: tl.constexpr, SYM: tl.constexpr):
    """NUQ codes (int32) and a clipped mask (``quantize_nuq``): ``u`` as ``nuq_normalize`` computes it, then
    the number of codebook midpoints ``MIDS`` (float32, ``2**BITS - 1``, sorted) strictly below ``u``
    (``torch.bucketize``: ties go to the lower entry), found by ``BITS`` steps of binary lifting."""
    safe = tl.where(s > 0, s, 1.0)
    if SYM:
        u = tl.where(s > 0, tl.math.div_rn(x, safe), 0.0)
    else:
        u = tl.where(s > 0, tl.math.div_rn(2.0 * (x - z), safe) - 1.0, -1.0)
    code = tl.zeros_like(u).to(tl.int32)
    for step in tl.static_range(BITS):
        # no constexpr annotation: compiled Triton refuses to re-declare one in each unrolled step
        half = 1 << (BITS - 1 - step)
        m = tl.load(MIDS + code + (half - 1))
        code = tl.where(m < u, code + half, code)
    return code, tl.abs(u) > 1.000001  # quantize_nuq's float32 tolerance 1 + 1e-6


@triton.jit
def _nuq_qparams(lo, hi, amax, SYM: tl.constexpr):
    """float16 ``(scale, zero)`` of a NUQ group (``choose_nuq_params``): the range itself, no levels."""
    if SYM:
        scale = _fp16_capped(_fp16_up(amax), 0.0 * amax, 1.0)
        zero = scale
    else:
        zero = _fp16_down(lo)
        zf = zero.to(tl.float32)
        scale = _fp16_capped(_fp16_up(tl.maximum(hi - zf, 0.0)), zf, 1.0)
    return scale, zero


@triton.jit
def _group_params(x, out, AXIS: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, NUQ: tl.constexpr):
    """float16 ``(scale, zero)`` over ``AXIS`` (keep_dims) of float32 ``x``, ignoring entries where ``out``
    (dense-and-sparse outliers) is true; a group of outliers only gets the range ``[0, 0]``
    (``masked_range``). A zero end is +0.0, as there: which zero ``tl.min`` / ``tl.max`` return for a group
    mixing -0.0 and +0.0 depends on the reduction order (a select, which no float fast-math folds away)."""
    lo = tl.min(tl.where(out, float("inf"), x), axis=AXIS, keep_dims=True)
    hi = tl.max(tl.where(out, -float("inf"), x), axis=AXIS, keep_dims=True)
    amax = tl.max(tl.where(out, 0.0, tl.abs(x)), axis=AXIS, keep_dims=True)
    empty = lo == float("inf")
    lo = tl.where(empty | (lo == 0.0), 0.0, lo)
    hi = tl.where(empty | (hi == 0.0), 0.0, hi)
    if NUQ:
        scale, zero = _nuq_qparams(lo, hi, amax, SYM)
    else:
        scale, zero = _qparams(lo, hi, amax, BITS, SYM)
    # a NaN (not an outlier) makes the reference's range NaN (torch's amin / amax propagate it), so its scale and
    # zero-point are NaN and its codes the no-scale ones; tl.min / tl.max drop NaNs, which gave a finite range
    nan = tl.max(((x != x) & ~out).to(tl.int32), axis=AXIS, keep_dims=True) != 0  # noqa: PLR0124 - the NaN test (no isnan in tl)
    scale = tl.where(nan, float("nan"), scale.to(tl.float32)).to(tl.float16)
    zero = tl.where(nan, float("nan"), zero.to(tl.float32)).to(tl.float16)
    return scale, zero


@triton.jit
def _any_codes(x, s, z, MIDS, BITS: tl.constexpr, SYM: tl.constexpr, NUQ: tl.constexpr):
    if NUQ:
        code, clipped = _nuq_codes(x, s, z, MIDS, BITS, SYM)
    else:
        code, clipped = _codes(x, s, z, BITS, SYM)
    return code, clipped


@triton.jit
def _pack_store(ptr, code, t, tmask, NU: tl.constexpr, CPW: tl.constexpr, BPU: tl.constexpr,
                BITS: tl.constexpr):  # fmt: skip
    """Store ``(R, NU, CPW)`` codes of rows ``t`` as ``kvbits.quant.pack`` lays them out: units of ``CPW``
    codes (code ``k`` at bits ``[k * BITS, (k + 1) * BITS)``) written as ``BPU`` little-endian bytes
    (2/4/8-bit: one byte of 4/2/1 codes; 3-bit: 8 codes in 3 bytes). ``ptr``: the ``(n, NU * BPU)`` rows."""
    shift = tl.arange(0, CPW) * BITS
    units = tl.sum(code << shift[None, None, :], axis=2)  # (R, NU) int32, disjoint bits: sum == or
    offs_u = tl.arange(0, NU)
    for j in tl.static_range(BPU):
        byte = ((units >> (8 * j)) & 255).to(tl.uint8)
        tl.store(ptr + t[:, None] * (NU * BPU) + offs_u[None, :] * BPU + j, byte, mask=tmask[:, None])


# fmt: off
@triton.jit(do_not_specialize=["OUT_T"])
def _quantize_kernel(
    X, CODES, SCALE, ZERO, SS, SZ, CLIP,   # x (B*H, n, D); codes (B*H, OUT_T, NB); scale/zero out; static (H, D); count
    OM, MIDS,                              # outlier mask (B*H, n, D) uint8; NUQ codebook midpoints float32
    n, H, OUT_T,                           # OUT_T: tokens per (sequence, head) slab of the outputs (n, or reserved slots)
    D: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, GC: tl.constexpr, MODE: tl.constexpr,
    SYM: tl.constexpr, NUQ: tl.constexpr, OUTL: tl.constexpr, CPW: tl.constexpr, BPU: tl.constexpr,
):
    """Grid ``(B * H_kv, cdiv(n, ROWS))``: ``ROWS`` tokens of one (sequence, head) per program.

    ``MODE`` 0: per-token scales over groups of ``GC`` channels (scale ``(B*H, n, D / GC)``); 1: per-channel
    scales over the ``ROWS`` tokens of the program (scale ``(B*H, n / ROWS, D)``); 2: static per-channel
    ``SS`` / ``SZ`` ``(H, D)`` float16. ``NUQ``: codebook codes (``MIDS``) instead of integer ones.
    ``OUTL``: entries flagged in ``OM`` (outliers, stored apart) are left out of the ranges and of the
    clipped count (their codes are written, as the reference writes them). Clipped elements are added
    to ``CLIP``. Codes are packed in units of ``CPW`` codes / ``BPU`` bytes (``_pack_store``). The outputs
    (codes, per-token or per-group scales and zero-points) hold ``OUT_T`` tokens per (sequence, head), of which
    these are the first ``n`` (``OUT_T > n``: a token range of a cache's reserved slots, written in place).
    """
    NU: tl.constexpr = D // CPW  # packing units per row
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    t = blk * ROWS + tl.arange(0, ROWS)
    tmask = t < n
    x_row = X + bh * n * D
    c_row = CODES + bh * OUT_T * (NU * BPU)
    if MODE == 0:
        # (ROWS, NG, GC / CPW, CPW): channel d = g * GC + j * CPW + k
        NG: tl.constexpr = D // GC
        offs_g = tl.arange(0, NG)
        offs_j = tl.arange(0, GC // CPW)
        offs_k = tl.arange(0, CPW)
        d = offs_g[None, :, None, None] * GC + offs_j[None, None, :, None] * CPW + offs_k[None, None, None, :]
        m4 = tmask[:, None, None, None]
        offs = t[:, None, None, None] * D + d
        x = tl.load(x_row + offs, mask=m4, other=0.0).to(tl.float32)
        out = tl.zeros_like(x) != 0.0
        if OUTL:
            out = tl.load(OM + bh * n * D + offs, mask=m4, other=0) != 0
        # (ROWS, NG, GC / CPW * CPW) -> one group per (row, g): reduce the last two axes through a reshape
        xg = tl.reshape(x, (ROWS, NG, GC))
        og = tl.reshape(out, (ROWS, NG, GC))
        scale, zero = _group_params(xg, og, 2, BITS, SYM, NUQ)  # (ROWS, NG, 1) float16
        scale = tl.reshape(scale, (ROWS, NG, 1, 1))
        zero = tl.reshape(zero, (ROWS, NG, 1, 1))
        code, clipped = _any_codes(x, scale.to(tl.float32), zero.to(tl.float32), MIDS, BITS, SYM, NUQ)
        clipped = clipped & ~out
        n_clip = tl.sum(tl.sum(tl.sum(tl.sum((clipped & m4).to(tl.int32), axis=3), axis=2), axis=1), axis=0)
        _pack_store(c_row, tl.reshape(code, (ROWS, NU, CPW)), t, tmask, NU, CPW, BPU, BITS)
        s_off = (bh * OUT_T + t[:, None]) * NG + offs_g[None, :]
        s_mask = tmask[:, None]
        tl.store(SCALE + s_off, tl.reshape(scale, (ROWS, NG)), mask=s_mask)
        if not SYM:
            tl.store(ZERO + s_off, tl.reshape(zero, (ROWS, NG)), mask=s_mask)
    else:
        # (ROWS, NU, CPW): channel d = u * CPW + k
        offs_k = tl.arange(0, CPW)
        d = tl.arange(0, NU)[None, :, None] * CPW + offs_k[None, None, :]
        m3 = tmask[:, None, None]
        offs = t[:, None, None] * D + d
        x = tl.load(x_row + offs, mask=m3, other=0.0).to(tl.float32)
        out = tl.zeros_like(x) != 0.0
        if OUTL:
            out = tl.load(OM + bh * n * D + offs, mask=m3, other=0) != 0
        if MODE == 1:
            scale, zero = _group_params(x, out, 0, BITS, SYM, NUQ)  # (1, NU, CPW)
            s_off = (bh * (OUT_T // ROWS) + blk) * D + d
            tl.store(SCALE + s_off, scale)
            if not SYM:
                tl.store(ZERO + s_off, zero)
            code, clipped = _any_codes(x, scale.to(tl.float32), zero.to(tl.float32), MIDS, BITS, SYM, NUQ)
        else:
            h = bh % H
            s = tl.load(SS + h * D + d).to(tl.float32)
            z = s
            if not SYM:
                z = tl.load(SZ + h * D + d).to(tl.float32)
            code, clipped = _any_codes(x, s, z, MIDS, BITS, SYM, NUQ)
        clipped = clipped & ~out
        n_clip = tl.sum(tl.sum(tl.sum((clipped & m3).to(tl.int32), axis=2), axis=1), axis=0)
        _pack_store(c_row, code, t, tmask, NU, CPW, BPU, BITS)
    if MODE == 2:  # dynamic ranges clip nothing (scale rounded up, zero down): only static ones count (CLIP unread else)
        tl.atomic_add(CLIP, n_clip)
# fmt: on


@triton.jit
def _to_fp8_bits(y, FMT: tl.constexpr):
    """float32 ``y`` (finite, ``|y| <=`` the format's max) → float8 bytes (int32), round half to even.

    e4m3fn (``FMT == 0``: bias 7, 3 mantissa bits, subnormal step 2^-9) or e5m2 (``FMT == 1``: bias 15,
    2 mantissa bits, step 2^-16), as torch's casts. Normal numbers: the float32 exponent ``e`` and
    ``q = rint((|y| * 2^-e - 1) * 2^M)`` (exact scalings), ``q == 2^M`` carrying into the exponent;
    subnormals: ``q = rint(|y| / step)``, whose carry to ``2^M`` is already the smallest normal's bits.
    """
    if FMT == 0:
        M: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        STEP: tl.constexpr = 512.0  # 1 / 2^-9
    else:
        M: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        STEP: tl.constexpr = 65536.0  # 1 / 2^-16
    a = tl.abs(y)
    sign = ((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7  # the sign bit: -0.0 stays -0.0, as in torch
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 a) for normal float32
    inv_pow_e = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e (finite for every finite a)
    q = _rint((a * inv_pow_e - 1.0) * (1 << M)).to(tl.int32)  # exact scalings by powers of two
    carry = q == (1 << M)
    e = tl.where(carry, e + 1, e)
    q = tl.where(carry, 0, q)
    normal = ((e + BIAS) << M) | q
    # exact scaling; 2^M when it rounds up to the smallest normal. Only used below the smallest normal:
    # the clamp keeps the unused lanes' int conversion in range
    sub = _rint(tl.minimum(a, 1.0) * STEP).to(tl.int32)
    bits = tl.where(e + BIAS >= 1, normal, sub)
    return bits | sign


# fmt: off
@triton.jit(do_not_specialize=["OUT_T"])
def _fp8_kernel(X, CODES, SCALE, SS, CLIP, OM, n, H, OUT_T, D: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr,
                STATIC: tl.constexpr, FMAX: tl.constexpr, OUTL: tl.constexpr):
    """Grid ``(B * H_kv, cdiv(n, ROWS))``: FP8 codes ``(B*H, n, D)`` (uint8) with one float16 scale per
    row (``SCALE (B*H, n)``: ``amax / FMAX`` rounded up) or a static float32 scale per head ``SS (H,)``
    (a per-tensor scale repeated). ``OUTL``:
    entries flagged in ``OM`` are left out of the row maximum and of the clipped count. Codes and per-row scales
    hold ``OUT_T`` tokens per (sequence, head), of which these are the first ``n`` (as ``_quantize_kernel``)."""
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    tmask = t < n
    offs = bh * n * D + t[:, None] * D + d[None, :]
    x = tl.load(X + offs, mask=tmask[:, None], other=0.0).to(tl.float32)
    out = tl.zeros_like(x) != 0.0
    if OUTL:
        out = tl.load(OM + offs, mask=tmask[:, None], other=0) != 0
    if STATIC:
        s = tl.load(SS + bh % H).to(tl.float32)
    else:
        amax = tl.max(tl.where(out, 0.0, tl.abs(x)), axis=1, keep_dims=True)  # (ROWS, 1)
        sh = _fp16_capped(_fp16_up(tl.math.div_rn(amax, FMAX)), 0.0 * amax, FMAX)
        # a NaN (not an outlier) makes the reference's amax, so its row's scale, NaN (the row then encodes at
        # scale 1, as `s > 0` fails); tl.max drops NaNs, which gave the row a finite scale
        nan = tl.max(((x != x) & ~out).to(tl.int32), axis=1, keep_dims=True) != 0  # noqa: PLR0124 - the NaN test (no isnan in tl)
        sh = tl.where(nan, float("nan"), sh.to(tl.float32)).to(tl.float16)
        tl.store(SCALE + bh * OUT_T + t[:, None], sh, mask=tmask[:, None])
        s = sh.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s > 0, s, 1.0))
    clipped = (tl.abs(y) > FMAX) & tmask[:, None] & ~out
    # a NaN y (a NaN x, or inf / inf under an inf scale) casts to the float8 NaN byte 0x7f with its sign, as
    # torch's clamp (which keeps NaN) then cast; taken before the clamp, whose tl.maximum may drop a NaN
    nan_code = (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7) | 127
    y_nan = y != y  # noqa: PLR0124 - the NaN test (no isnan in tl)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    code = tl.where(y_nan, nan_code, _to_fp8_bits(y, FMT))
    tl.store(CODES + bh * OUT_T * D + t[:, None] * D + d[None, :], code.to(tl.uint8), mask=tmask[:, None])
    if STATIC:  # a row's own scale covers its maximum (rounded up): only static scales clip (CLIP unread else)
        tl.atomic_add(CLIP, tl.sum(tl.sum(clipped.to(tl.int32), axis=1), axis=0))
# fmt: on


def _slab_tokens(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, unit: int) -> int | None:
    """Tokens per (sequence, head) slab of ``t`` when it can take an output of ``shape`` and ``dtype`` in place: a
    token range (dim 2, ``unit`` tokens per row) of a tensor that is contiguous apart from that dimension's length,
    as a cache's reserved slots are; else ``None``. Any other layout would be written wrongly by the kernels, which
    address their outputs as ``(B * H, slab, ...)`` rows."""
    if t is None or t.dtype != dtype or tuple(t.shape) != shape:
        return None
    inner = 1
    for size, stride in zip(reversed(shape[3:]), reversed(t.stride()[3:])):
        if size != 1 and stride != inner:
            return None
        inner *= size
    B, H, rows = shape[:3]
    if (rows > 1 and t.stride(2) != inner) or t.stride(1) % inner or (B > 1 and t.stride(0) != H * t.stride(1)):
        return None
    slab = t.stride(1) // inner if H > 1 or B > 1 else rows  # a single slab: its length is all that is read
    return slab * unit if slab >= rows else None


def _outputs(
    out: dict[str, torch.Tensor] | None, wanted: dict[str, tuple[tuple[int, ...], torch.dtype, int]], n: int,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], int]:
    """The caller's ``out`` tensors for the outputs ``wanted`` (``{name: (shape, dtype, tokens per row)}``) and their
    slab length in tokens, when every one of them can be written in place with one common slab (``_slab_tokens``)
    on ``device``; else fresh contiguous tensors and ``n``."""
    if out:
        slabs = {name: _slab_tokens(out.get(name), *spec) for name, spec in wanted.items()}
        same_device = all(out[name].device == device for name in wanted if out.get(name) is not None)
        if same_device and None not in slabs.values() and len(set(slabs.values())) == 1:
            return {name: out[name] for name in wanted}, next(iter(slabs.values()))
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype, _) in wanted.items()}, n


def _clip_count(clip: torch.Tensor, sync: bool) -> int | torch.Tensor:
    """The kernels' int32 clipped counter as ``quantize`` reports it: a host int, or (``sync=False``) a
    0-dim int64 device tensor."""
    n = clip[0].to(torch.int64)
    return int(n) if sync else n


def _packing(bits: int) -> tuple[int, int]:
    """(codes, bytes) per packing unit of ``kvbits.quant.pack``: 8 codes in 3 bytes at 3 bits."""
    return (8, 3) if bits == 3 else (8 // bits, 1)


def _warps(elements: int) -> int:
    """Warps for a program holding ``elements`` values of ``x``: 4 up to 1024, else 8.

    Compiled for sm_90 (``benchmarks/kernel_resources.py``), a 128-token x 128-channel block (per-channel
    keys) spilled 1.7-1.9 KiB of registers per thread with 4 warps, 48-152 B with 8, and 16 warps capped
    the registers at 128 per thread and spilled the per-token layouts (up to 760 B); 8 warps left every
    per-token layout without spills.
    """
    return 4 if elements <= 1024 else 8


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(x: torch.Tensor, spec: TensorSpec) -> str | None:
    """``None`` when ``quantize_pack_triton`` handles ``x`` ``(B, H_kv, n, D)`` under ``spec``, else why not."""
    if spec.kind not in ("int", "nuq", "fp8") or (spec.kind != "fp8" and spec.bits not in (2, 3, 4, 8)):
        return f"{spec.kind} {spec.bits}-bit codes (the quantize kernel writes 2/3/4/8-bit integer/NUQ and FP8 codes)"
    if spec.rotate is not None:
        return f"{spec.rotate} rotation (the torch reference rotates, then quantizes)"
    if spec.integer_zero:
        return "integer zero-points (the torch reference chooses them)"
    if spec.rounding != "nearest":
        return f"{spec.rounding} rounding (the torch reference rounds toward zero from a float32 scale)"
    if spec.scale_dtype != "fp16":
        return f"{spec.scale_dtype} scales (the kernel writes float16 ones; the torch reference keeps float32)"
    if spec.has_channel_transform:
        return "centred / smoothed channels (the torch reference transforms, then quantizes)"
    if x.dim() != 4 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x must be a float16/bfloat16/float32 (B, H_kv, n, D) tensor, got {x.dtype} {tuple(x.shape)}"
    D, n = x.shape[3], x.shape[2]
    if not _is_pow2(D) or D < 16:
        return f"head_dim {D} (a power of two >= 16)"
    if spec.kind == "fp8":
        return None  # per-row or one static scale: both handled by _fp8_kernel
    if spec.static and not (spec.granularity == "channel" and spec.group_size is None):
        # the per-token layout computes each group's range from the data: a static token scale would be ignored
        return f"static {spec.granularity} scales (the kernel reads static per-channel ranges only)"
    if spec.granularity == "token":
        g = spec.group_size or D
        if not _is_pow2(g) or g < _packing(spec.bits)[0] or D % g:
            return f"token group size {g} (a power of two dividing {D}, of whole packing units)"
    elif spec.granularity == "channel" and not spec.static:
        G = spec.group_size
        if G is None or not _is_pow2(G) or G > 256 or n % G:
            return f"per-channel groups of {G} tokens over a block of {n} (a power of two <= 256 dividing it)"
    elif not (spec.granularity == "channel" and spec.static and spec.group_size is None):
        return f"{spec.granularity} granularity"
    return None


def quantize_pack_triton(
    x: torch.Tensor,
    spec: TensorSpec,
    *,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    sync: bool = True,
    out: dict[str, torch.Tensor] | None = None,
) -> QuantizedTensor:
    """``kvbits.quant.quantize(x, spec, ...)`` in one kernel: the same ``QuantizedTensor``, bit for bit.

    Dense-and-sparse outliers are chosen by the reference's own ``select_outliers`` (``torch.topk``, so
    ties resolve identically); the kernel leaves them out of the ranges and the clipped count.

    Args:
        x: ``(B, H_kv, n, D)`` new tokens, finite and within float16's range (``check_block``, which
            ``quantize_pack`` and the cache run; not checked here: a bfloat16/float32 value beyond 65504 gives
            inf scales and NaN decodes where ``quantize`` raises ``ValueError``; a NaN gives its group (FP8: row) the NaN
            range and codes ``quantize(..., validate=False)`` gives it).
        spec: a spec ``supported`` accepts.
        static_scale, static_zero: static specs: the calibrated ``(H_kv, D)`` (or ``(1, H_kv, 1, D)``) ranges.
        codebook: NUQ specs: the float16 ``(2**bits,)`` codebook (as ``quantize``).
        sync: ``False`` keeps the clipped count a 0-dim int64 device tensor (no host sync).
        out: where to write the codes (``"data"``) and per-token or per-group ``"scale"`` / ``"zero"``: a token range
            of tensors that are contiguous apart from their token dimension (a cache's reserved slots,
            ``kvbits.cache.store``), so a flush needs no copy into them. Taken only when every output it names has
            the expected shape, dtype, device and such a layout (``_slab_tokens``), with one slab length; else the
            outputs are fresh tensors, as without it. The returned tensor then views them.
    """
    reason = supported(x, spec)
    if reason:
        raise NotImplementedError(f"quantize_pack_triton: {reason}")
    if spec.kind == "fp8":
        return _quantize_fp8(x, spec, static_scale, sync, out)
    B, H, n, D = x.shape
    bits, sym, nuq = spec.bits, spec.symmetric, spec.kind == "nuq"
    dev = x.device
    xc = x.contiguous()
    mids = torch.empty(1, dtype=torch.float32, device=dev)
    if nuq:
        codebook = _codebook(codebook, bits, sync)
        c = codebook.to(dev, torch.float32)
        mids = ((c[1:] + c[:-1]) / 2).contiguous()  # as quantize_nuq computes them
    dummy = torch.empty(1, dtype=torch.float16, device=dev)
    # dynamic ranges clip nothing, so only a static spec's kernel counts (no counter, no count to read back else)
    clip = torch.zeros(1, dtype=torch.int32, device=dev) if spec.static else dummy
    wanted = {"data": ((B, H, n, D * bits // 8), torch.uint8, 1)}  # name: (shape, dtype, tokens per row of dim 2)
    ss = sz = dummy
    if spec.granularity == "token":
        g = spec.group_size or D
        mode, rows, gc = 0, TOKEN_ROWS, g
        meta = ((B, H, n, D // g, 1), torch.float16, 1)
    elif not spec.static:
        G = spec.group_size
        mode, rows, gc = 1, G, 1
        meta = ((B, H, n // G, 1, D), torch.float16, G)
    else:
        mode, rows, gc = 2, TOKEN_ROWS, 1
    if mode != 2:  # the kernel writes the ranges it computes
        wanted.update({"scale": meta, **({} if sym else {"zero": meta})})
    outs, out_t = _outputs(out, wanted, n, dev)
    codes, scale, zero = outs["data"], outs.get("scale"), outs.get("zero")
    if mode == 2:
        scale, zero = _static_qparams(
            x, spec, static_scale, static_zero
        )  # (1, H, 1, D)-broadcastable float16
        ss = scale.expand(1, H, 1, D).reshape(H, D).contiguous()
        sz = zero.expand(1, H, 1, D).reshape(H, D).contiguous() if zero is not None else dummy
    o_vals, o_idx, mask = select_outliers(x, spec, (scale, zero) if mode == 2 else None)
    om = dummy if mask is None else mask.contiguous().view(torch.uint8)
    if n:
        _quantize_kernel[(B * H, triton.cdiv(n, rows))](
            xc, codes, scale if mode != 2 else dummy, zero if (zero is not None and mode != 2) else dummy,
            ss, sz, clip, om, mids, n, H, out_t,
            D=D, BITS=bits, ROWS=rows, GC=gc, MODE=mode, SYM=sym, NUQ=nuq, OUTL=mask is not None,
            CPW=_packing(bits)[0], BPU=_packing(bits)[1], num_warps=_warps(rows * D),
        )  # fmt: skip
    clipped = _clip_count(clip, sync) if spec.static else 0
    return QuantizedTensor(
        spec, (B, H, n, D), codes, scale=scale, zero=zero, outlier_values=o_vals, outlier_index=o_idx,
        clipped=clipped, static=spec.static, codebook=codebook if nuq else None,
    )  # fmt: skip


def _quantize_fp8(
    x: torch.Tensor, spec: TensorSpec, static_scale: torch.Tensor | None, sync: bool,
    out: dict[str, torch.Tensor] | None = None,
) -> QuantizedTensor:
    """FP8 through ``_fp8_kernel``: what ``kvbits.quant.quantize`` stores for ``kind="fp8"``."""
    from kvbits.quant.fp8 import fp8_dtype, fp8_max, static_fp8_scale

    B, H, n, D = x.shape
    dev = x.device
    static = spec.static  # TensorSpec: FP8 tensor/head scales are static, token scales dynamic
    fp8 = fp8_dtype(spec.fmt)
    wanted = {"data": ((B, H, n, D), fp8, 1), **({} if static else {"scale": ((B, H, n, 1), torch.float16, 1)})}
    outs, out_t = _outputs(out, wanted, n, dev)
    codes, out_scale = outs["data"].view(torch.uint8), outs.get("scale")
    clip = torch.zeros(1, dtype=torch.int32, device=dev) if static else codes  # dynamic: never counted, never read
    if static:  # quantize's rule: the static scale, else 1; the kernel reads one float32 per head
        scale = static_scale if static_scale is not None else torch.ones((), dtype=torch.float32)
        scale = static_fp8_scale(scale.to(dev, torch.float32), spec.granularity, H, "static FP8 scale")
        ss = scale.reshape(-1).expand(H).contiguous()
    else:
        ss = torch.empty(H, dtype=torch.float32, device=dev)
    o_vals, o_idx, mask = select_outliers(x, spec, None)
    om = codes if mask is None else mask.contiguous().view(torch.uint8)  # OUTL=False: never read
    if n:
        _fp8_kernel[(B * H, triton.cdiv(n, TOKEN_ROWS))](
            x.contiguous(), codes, out_scale if out_scale is not None else ss, ss, clip, om, n, H, out_t,
            D=D, ROWS=TOKEN_ROWS, FMT=0 if spec.fmt == "e4m3" else 1, STATIC=static, FMAX=fp8_max(spec.fmt),
            OUTL=mask is not None,
        )  # fmt: skip
    clipped = _clip_count(clip, sync) if static else 0
    return QuantizedTensor(
        spec, (B, H, n, D), codes.view(fp8), scale=scale if static else out_scale,
        outlier_values=o_vals, outlier_index=o_idx, clipped=clipped, static=static,
    )  # fmt: skip
