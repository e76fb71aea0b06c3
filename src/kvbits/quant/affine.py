"""Affine integer quantization: choose parameters, quantize, dequantize (pure torch reference).

Asymmetric codes (KIVI, the default): ``x ≈ code * scale + zero`` with ``zero`` the group minimum,
codes in ``[0, 2**b - 1]``. Symmetric codes: ``x ≈ (code - c) * scale`` with ``c = 2**(b-1) - 1``,
codes in ``[0, 2c]``. Scales and zero-points are stored in float16; they are rounded *outward*
(zero down, scale up) so the stored range always covers the data and the round-trip error stays
within ``scale / 2`` per element. Near float16's end the scale is capped instead (:func:`_stored_scale`):
rounded up, the top level of a group reaching 65504 would decode past it, to inf in float16 K/V. ``TensorSpec(scale_dtype="fp32")`` keeps them in float32, unrounded
(``meta=torch.float32``: the range ends and ``range / steps`` as computed, vLLM's per-token-head caches). An asymmetric group whose values all equal
one float16 value gets ``scale = 0`` and decodes exactly to it, and a group of zeros decodes to zeros under
any codes: no division by zero, no NaN. Any other constant group (a value float16 does not hold, 0.1 or
1000.3 in float32; symmetric codes) gets a nonzero scale and decodes within half a step, as any group.

Integer zero-points (``TensorSpec.integer_zero``, vLLM's ``int4_per_token_head``): ``x ≈ (code - z) * scale``
with ``z`` a code, stored as ``zero = -z * scale`` so the same decoder applies (:func:`integer_zero_qparams`).

Truncated symmetric codes (``TensorSpec(rounding="trunc")``, vLLM's ``int8_per_token_head``): codes rounded
toward zero from vLLM's float32 scale, the scale stored to the nearest float16, capped near float16's end as
above (:func:`trunc_symmetric`).
"""

from __future__ import annotations

import torch

from kvbits.quant.checks import FP16_MAX
from kvbits.quant.pack import check_bits

META_DTYPE = torch.float16


def broadcast_shape(*shapes: tuple[int, ...]) -> torch.Size:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes`` (ValueError where they do not).

    Plain Python: ``torch.broadcast_shapes`` goes through symbolic-shape checks that cost ~0.4 ms a call on
    CPU, more than dequantizing a decode step's history of a small layer.
    """
    n = max([len(s) for s in shapes]) if shapes else 0  # (no generator: dynamo traces this under torch.compile)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast (dim {i - n}: {out[i]} vs {d})")
                out[i] = d
    return torch.Size(out)


def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(META_DTYPE)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -float("inf"))), h)


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(META_DTYPE)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _check_meta(meta: torch.dtype) -> None:
    if meta not in (torch.float16, torch.float32):
        raise ValueError(f"scales are stored in float16 or float32, got meta={meta}")


def _stored_scale(
    scale: torch.Tensor, meta: torch.dtype, steps: float, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """A float32 ``scale`` as stored in ``meta``: float32 as computed; float16 rounded up, but at most the
    largest float16 whose top level ``steps * scale`` (``+ zero``, a stored float16 zero-point) stays within
    65504.

    Rounded up alone, a group whose largest value is within ~0.1 % of 65504 decoded its top level past
    65519, to inf in float16 K/V (int8 per token at ``|x|`` = 65480: ``127 * 516 = 65532``). The cap is at
    most one float16 step below the rounded-up scale, so the top value's code still rounds onto the top
    level (``steps * 2**-10 < 0.5`` for up to 9 bits; FP8's largest value saturates onto it) and the error
    stays within half a step. A scale beyond float16 stays inf: an asymmetric NUQ group spanning more than
    65504 is refused on it (``kvbits.quant.nuq.choose_nuq_params``), not stored clipped.
    """
    if meta == torch.float32:
        return scale
    return _fp16_capped(_round_up_fp16(scale), steps, zero)


def _fp16_capped(h: torch.Tensor, steps: float, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Float16 scales ``h`` lowered to the largest float16 whose top level ``steps * scale`` (``+ zero``) stays
    within 65504; an inf ``h`` stays inf (``_stored_scale``, ``trunc_symmetric``)."""
    top = torch.full_like(h, FP16_MAX, dtype=torch.float32) if zero is None else FP16_MAX - zero.float()
    return torch.where(torch.isinf(h), h, torch.minimum(h, _round_down_fp16(div_rn(top, steps))))


def div_rn(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d`` correctly rounded on every device (``x`` float32, ``d`` a Python number).

    On CUDA, torch divides a tensor by a Python number as ``x * (1 / d)``, which can land one float32 ulp
    away from ``x / d``; where that ulp crosses a float16 step, the scale rounded up from it differs. An
    H200 run (2026-11-30) found exactly that in 1552 of 32768 int4 group scales and in int8 and fp8 ones,
    each reproduced on CPU by the reciprocal product. A divisor tensor on ``x``'s device is divided
    exactly (IEEE), as on the CPU and in the Triton quantize kernel (``tl.math.div_rn``).
    """
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


def choose_qparams(
    x: torch.Tensor,
    bits: int,
    dims: tuple[int, ...],
    *,
    symmetric: bool = False,
    mask: torch.Tensor | None = None,
    meta: torch.dtype = META_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero-point) over ``dims`` of ``x``, keepdim, in ``meta`` (float16, or float32 unrounded).

    Args:
        x: any shape, floating.
        bits: code width.
        dims: the dimensions one scale reduces over.
        symmetric: symmetric codes (no zero-point).
        mask: optional bool tensor like ``x``; ``True`` marks elements excluded from the range
            (dense-and-sparse outliers stored elsewhere).

    Returns:
        ``(scale, zero)``, both keepdim over ``dims``; ``zero`` is ``None`` when symmetric.
    """
    check_bits(bits)  # 1-bit symmetric has no level (scale inf), > 8 bits overflow uint8
    steps = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1
    return range_qparams(x, dims, steps, symmetric=symmetric, mask=mask, meta=meta)


def range_qparams(
    x: torch.Tensor,
    dims: tuple[int, ...],
    steps: int,
    *,
    symmetric: bool = False,
    mask: torch.Tensor | None = None,
    meta: torch.dtype = META_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, zero)`` over ``dims`` of ``x``, keepdim, float16, rounded outward: ``zero`` = the group
    minimum rounded down and ``scale`` = ``(max - zero) / steps`` rounded up; symmetric: ``scale`` =
    the largest magnitude ``/ steps`` rounded up, ``zero`` None (a float16 scale capped where its top level
    would decode past 65504, :func:`_stored_scale`). ``meta=torch.float32``: the same in float32,
    not rounded (``zero`` the minimum itself; a code may then land a float32 ulp past the last level, which
    rounds back onto it). ``mask`` (bool like ``x``) marks elements excluded from the range. Affine codes
    take ``steps`` = the code levels (:func:`choose_qparams`), NUQ ``1`` (``kvbits.quant.nuq.choose_nuq_params``).
    """
    _check_meta(meta)
    empty = empty_groups(x, dims, symmetric, meta)
    if empty is not None:
        return empty
    xf = x.float()
    if symmetric:
        a = xf.abs() if mask is None else xf.abs().masked_fill(mask, 0.0)
        return _stored_scale(div_rn(a.amax(dim=dims, keepdim=True), steps), meta, steps), None
    lo, hi = masked_range(xf, dims, mask)
    zero = _round_down_fp16(lo) if meta == torch.float16 else lo
    zf = zero.float()  # once: the scale's range and its cap both take it (a float32 zero caps as its float16)
    return _stored_scale(div_rn((hi - zf).clamp_min(0.0), steps), meta, steps, zf), zero


INTEGER_ZERO_MIN_SCALE = 1e-6  # vLLM's int4_per_token_head floor: a zero-range group gets this scale


def integer_zero_bound(bits: int) -> float:
    """The largest ``|x|`` whose integer-zero codes (:func:`integer_zero_qparams`) decode within float16.

    A level the data reaches lies within half a step of the range (``code`` rounds ``(x - zero) / scale``
    onto the nearest level, or clamps inside it), and the step is at most ``2 * bound / (2**bits - 1)``,
    rounded up by at most ``2**-10`` of itself: ``bound * (1 + (1 + 2**-10) / (2**bits - 1)) = 65504``. Above
    it a row decoded past 65519, to inf in float16: int4 ``[-1000, 65504]`` (scale 4436, ``z`` 0) decoded its
    top value as ``15 * 4436 = 66540`` and ``[-65504, 0]`` stored the zero-point ``-15 * 4368``, -inf. The
    scale is not capped instead: a grid anchored at an integer ``z`` spanning ``[-65504, 65504]`` has one
    level past either end, so a cap on both would leave the range uncovered. 61406.25 at 4 bits.
    """
    check_bits(bits)
    return FP16_MAX / (1.0 + (1.0 + 2.0**-10) / (2**bits - 1))


def integer_zero_qparams(
    x: torch.Tensor, bits: int, dims: tuple[int, ...], *, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` over ``dims`` of ``x``, keepdim, float16, for codes whose zero-point is an integer code.

    As vLLM's ``int4_per_token_head`` write kernel: ``scale = max((max - min) / (2**bits - 1), 1e-6)``,
    ``z = round(-min / scale)`` (half away from zero) clamped to ``[0, 2**bits - 1]``, codes
    ``round(x / scale + z)`` clamped. Stored as float16 ``scale`` (rounded up) and ``zero = -z * scale``
    (nearest), so ``quantize_affine`` / ``dequantize_affine`` decode ``code * scale + zero = (code - z) *
    scale`` to within 1 % of a step of vLLM's float32 scale (int4) where the float16 scale is normal
    (``>= 2**-14``, about 6.1e-5: a range ``>= 9.2e-4`` at int4); a subnormal one is coarser (4.7 % of a
    step at scale 4.8e-6). Unlike :func:`range_qparams` the grid
    need not cover the range: an end may fall up to half a step inside it when ``z`` rounds (values there
    still round to it, within half a step; only an exact tie rounds past it), and a range that excludes 0
    (``z`` clamped) loses everything past the far end; ``quantize_affine`` counts what clips. The decode
    stays within float16 for ``|x| <=`` :func:`integer_zero_bound` (``quantize(validate=True)`` and the
    cache refuse more). ``mask`` (bool like ``x``) marks elements excluded from the range.
    """
    check_bits(bits)
    empty = empty_groups(x, dims, False)
    if empty is not None:
        return empty  # type: ignore[return-value]
    steps = 2**bits - 1
    lo, hi = masked_range(x.float(), dims, mask)
    scale = _round_up_fp16(div_rn(hi - lo, steps).clamp_min(INTEGER_ZERO_MIN_SCALE))
    v = -lo / scale.float()
    z = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(0, steps)
    return scale, (0.0 - z * scale.float()).to(META_DTYPE)  # 0 - (z * scale): +0.0 at z = 0, as the kernel's


TRUNC_MIN_SCALE = 1e-6  # vLLM's int8_per_token_head floor (``max(absmax / 127, 1e-6)``)


def trunc_symmetric(
    x: torch.Tensor,
    bits: int,
    dims: tuple[int, ...],
    *,
    mask: torch.Tensor | None = None,
    meta: torch.dtype = META_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, codes, clipped)`` of symmetric codes rounded toward zero, as vLLM's ``int8_per_token_head``.

    vLLM's write kernel computes, in float32, ``scale = max(absmax / c, 1e-6)`` (``c = 2**(bits-1) - 1``) and
    stores ``clamp(x * (1 / scale), -c - 1, c)`` into an int8 cache: Triton's float-to-int store cast
    truncates (``cvt.rzi``), so every value moves toward zero by up to a whole step (``tests/test_aot.py``
    compiles that store for sm_90 and reads the instruction). Here the codes come from that float32 scale
    (IEEE division and reciprocal; vLLM's ``div.full.f32`` may differ by an ulp or two, which moves a code only
    where ``x / scale`` lies that close to an integer, as the row maximum does); the scale is stored to the
    nearest float16, so for a normal float16 scale (``>= 2**-14``, about 6.1e-5: ``absmax >= 7.8e-3`` at INT8)
    ``(code - c) * scale`` decodes within ``c * 2**-11`` steps of vLLM's float32 decode (6.2 % of a step at
    INT8's largest code). A subnormal float16 scale is coarser (0.27 steps at ``absmax`` 2.2e-4). Near float16's
    end the scale is capped instead, as :func:`_stored_scale` caps (to the nearest it decoded ``|x|`` = 65504's
    code 127 as ``127 * 516 = 65532``, inf in float16): at most one float16 step below vLLM's, so within
    ``c * 2**-10`` steps. ``meta=torch.float32`` stores vLLM's float32 scale itself, so the decode is vLLM's.

    Args:
        x: any shape, floating.
        bits: code width.
        dims: the dimensions one scale reduces over (keepdim).
        mask: optional bool tensor like ``x``; ``True`` marks elements excluded from the range.

    Returns:
        ``scale`` (``meta``, keepdim over ``dims``), ``codes`` (uint8 like ``x``, offset by ``c`` as
        :func:`quantize_affine`'s symmetric codes) and ``clipped`` (bool like ``x``: beyond ``c`` steps, as a
        row whose largest magnitude is under ``c * 1e-6`` is beyond the floor scale, and clamped).
    """
    check_bits(bits)
    _check_meta(meta)
    c = 2 ** (bits - 1) - 1
    empty = empty_groups(x, dims, True, meta)
    if empty is not None:
        return empty[0], torch.full(x.shape, c, dtype=torch.uint8, device=x.device), torch.zeros(
            x.shape, dtype=torch.bool, device=x.device
        )
    xf = x.float()
    a = xf.abs() if mask is None else xf.abs().masked_fill(mask, 0.0)
    scale32 = div_rn(a.amax(dim=dims, keepdim=True), c).clamp_min(TRUNC_MIN_SCALE)
    q = torch.trunc(xf * torch.reciprocal(scale32))
    clipped = (q < -c) | (q > c)
    codes = (q.clamp(-c, c) + c).to(torch.uint8)
    if meta == torch.float32:
        return scale32, codes, clipped
    # nearest, but capped as _stored_scale caps: the top code c must decode within 65504 (an inf scale stays inf)
    return _fp16_capped(scale32.to(meta), c), codes, clipped


def empty_groups(
    x: torch.Tensor, dims: tuple[int, ...], symmetric: bool, meta: torch.dtype = META_DTYPE
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(scale, zero)`` of zeros (keepdim over ``dims``, in ``meta``) when a reduced dim of ``x`` is empty,
    else ``None``.

    A block of 0 tokens (or 0 heads) at head / tensor granularity reduces over nothing, where torch's
    min / max raise; it gets the range ``[0, 0]``, as ``masked_range`` gives a group whose elements are
    all masked.
    """
    if all(x.shape[d] for d in dims):
        return None
    shape = [1 if i in {d % x.dim() for d in dims} else n for i, n in enumerate(x.shape)]
    scale = torch.zeros(shape, dtype=meta, device=x.device)
    return scale, None if symmetric else scale.clone()


def masked_range(
    xf: torch.Tensor, dims: tuple[int, ...], mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``xf`` over ``dims`` (keepdim), ignoring elements where ``mask`` is True.

    A group whose elements are all masked gets the range ``[0, 0]``. A zero end is +0.0 (``+ 0.0``): which
    zero the min / max of a group mixing -0.0 and +0.0 returns depends on the reduction order, so torch's and
    the Triton quantize kernel's (``_group_params``, canonicalised the same way) differed in the sign bit of
    the stored zero-point (decoding the same), against the kernel's bit-for-bit claim.
    """
    if mask is None:
        if len(dims) == 1:  # one reduction for both ends (a flush's per-token range): the same min and max
            lo, hi = torch.aminmax(xf, dim=dims[0], keepdim=True)
            return lo + 0.0, hi + 0.0
        return xf.amin(dim=dims, keepdim=True) + 0.0, xf.amax(dim=dims, keepdim=True) + 0.0
    lo = xf.masked_fill(mask, float("inf")).amin(dim=dims, keepdim=True)
    hi = xf.masked_fill(mask, -float("inf")).amax(dim=dims, keepdim=True)
    empty = torch.isinf(lo)
    return lo.masked_fill(empty, 0.0) + 0.0, hi.masked_fill(empty, 0.0) + 0.0


def quantize_affine(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes (uint8, same shape as ``x``) and a bool mask of values clipped to the range.

    ``scale``/``zero`` broadcast against ``x`` (from ``choose_qparams`` or a calibration artifact).
    """
    check_bits(bits)
    s = scale.float()
    live = s > 0  # once for both wheres; Python-number branches need no filled tensor (same values, fewer kernels)
    safe = torch.where(live, s, 1.0)
    if zero is None:
        c = 2 ** (bits - 1) - 1
        q = torch.round(x.float() / safe) + c
        lo_code, hi_code = 0, 2 * c
    else:
        q = torch.round((x.float() - zero.float()) / safe)
        lo_code, hi_code = 0, 2**bits - 1
    q = torch.where(live, q, 0.0 if zero is not None else float(2 ** (bits - 1) - 1))
    clipped = (q < lo_code) | (q > hi_code)
    return q.clamp(lo_code, hi_code).to(torch.uint8), clipped


def dequantize_affine(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize_affine`` (computed in float32, returned in ``dtype``).

    In place on the float32 copy of ``codes`` (one full-size tensor, not three): the same operations in
    the same order, so the same roundings as ``q * scale + zero``; 1.7-3x faster on CPU for a whole history.
    ``out``: a float32 tensor (a strided view is fine) of the broadcast shape to hold that copy, returned
    (``dtype`` must be float32 then): a caller's preallocated place, no tensor allocated.
    """
    check_bits(bits)
    shape = broadcast_shape(codes.shape, scale.shape, *(() if zero is None else (zero.shape,)))
    if out is not None:
        if out.dtype != torch.float32 or dtype != torch.float32 or tuple(out.shape) != tuple(shape):
            raise ValueError(
                f"dequantize_affine out= must be float32 of shape {tuple(shape)} with dtype float32, "
                f"got {out.dtype} {tuple(out.shape)} for dtype {dtype}"
            )
        q = out.copy_(codes.expand(shape))
    else:
        q = codes.float()
        if q.data_ptr() == codes.data_ptr() or q.shape != shape:  # never write into the caller's tensor
            q = q.expand(shape).clone()
    if zero is None:
        return q.sub_(2 ** (bits - 1) - 1).mul_(scale.float()).to(dtype)
    return q.mul_(scale.float()).add_(zero.float()).to(dtype)
