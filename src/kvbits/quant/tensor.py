"""`QuantizedTensor`: one quantized block of K or V, with every byte it stores.

``quantize(x, spec)`` turns a block ``x`` of shape ``(B, H_kv, n, D)`` into packed codes plus
metadata following a ``TensorSpec``; ``.dequantize()`` gives it back; ``.nbytes`` is the exact sum
of the stored tensors' bytes (codes, scales, zero-points, sparse outliers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbits.quant.affine import (
    META_DTYPE,
    _stored_scale,
    broadcast_shape,
    choose_qparams,
    dequantize_affine,
    div_rn,
    integer_zero_bound,
    integer_zero_qparams,
    quantize_affine,
    trunc_symmetric,
)
from kvbits.quant.checks import FP16_MAX, check_kv
from kvbits.quant.fp8 import dequantize_fp8, quantize_fp8, static_fp8_scale
from kvbits.quant.nuq import (
    CODEBOOK_DTYPE,
    check_codebook,
    choose_nuq_params,
    dequantize_nuq,
    nuq_normalize,
    nuq_outlier_score,
    quantize_nuq,
)
from kvbits.quant.outliers import gather_outliers, scatter_outliers
from kvbits.quant.pack import pack_bits, unpack_bits
from kvbits.quant.rotate import check_rotatable, rotate, unrotate
from kvbits.schemes.accounting import outlier_count
from kvbits.schemes.spec import TensorSpec

FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class QuantizedTensor:
    """A quantized ``(B, H_kv, n, D)`` block.

    Attributes:
        spec: the ``TensorSpec`` it follows.
        shape: logical shape ``(B, H_kv, n, D)``.
        data: packed uint8 codes ``(B, H_kv, n, ceil(D*bits/8))``, fp8 codes ``(B, H_kv, n, D)``, or
            float values for ``kind="float"``.
        scale, zero: float16 metadata (float32: ``spec.scale_dtype="fp32"`` and static FP8 scales), keepdim
            shapes of the granularity (``zero`` only asymmetric).
        outlier_values, outlier_index: sparse exact values ``(B, H_kv, n, k)`` float16 and their
            channel indices (uint8 / int16), or ``None``.
        clipped: how many elements saturated against static scales (calibration mismatch signal),
            including those a static scale of 0 collapses onto its zero-point (``zero_scale_clipped``), or
            under integer zero-points (``integer_zero``) where a token's range excludes 0;
            a 0-dim int64 tensor on the block's device when quantized with ``sync=False``. A chunk held by
            ``kvbits.cache.store.SideStore`` keeps 0 here: its count went into the store's ``clipped`` at the flush.
        codebook: ``kind="nuq"``: the layer's float16 codebook (a reference; owned and counted by the
            layer, like static scales, not by the block).
        channel_mean, channel_factor: ``centre`` / ``smooth`` specs: the layer's ``(H_kv, D)`` (or
            ``(1, H_kv, 1, D)``) vectors the codes were taken under (references owned by the layer, like the codebook);
            ``dequantize`` returns ``dequant * channel_factor + channel_mean``.
    """

    spec: TensorSpec
    shape: tuple[int, int, int, int]
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    outlier_values: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None
    clipped: int | torch.Tensor = 0
    static: bool = field(default=False)
    codebook: torch.Tensor | None = None
    channel_mean: torch.Tensor | None = None
    channel_factor: torch.Tensor | None = None

    def stored_tensors(self) -> list[torch.Tensor]:
        """The tensors this block owns (static scales are owned by the layer, not the block)."""
        out = [self.data]
        if not self.static:
            out += [t for t in (self.scale, self.zero) if t is not None]
        out += [t for t in (self.outlier_values, self.outlier_index) if t is not None]
        return out

    @property
    def nbytes(self) -> int:
        """Exact bytes stored: codes + scales + zero-points + outliers."""
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())

    @property
    def n_tokens(self) -> int:
        return self.shape[2]

    def dequantize(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        codebook: torch.Tensor | None = None,
        sync: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Back to floats, ``(B, H_kv, n, D)`` in ``dtype`` (``codebook`` overrides ``self.codebook``).

        ``sync=False``: no host-device sync (the codebook's values are not re-checked, see ``quantize``).
        A rotated spec (``spec.rotate``) is decoded in float32 (float64 for float64), rotated back, then cast;
        so is a ``centre`` / ``smooth`` spec, multiplied by ``channel_factor`` and shifted by ``channel_mean``
        after the rotation back, then saturated to a float16 / bfloat16 ``dtype``'s finite range
        (``saturate``: a large factor times a top level can pass 65504 for inputs the cache accepts).
        ``out``: a ``(B, H_kv, n, D)`` tensor of ``dtype`` (a slice of a larger history is fine) the values
        are written into and returned, bit for bit those returned without it. Integer codes without
        outliers or rotation are decoded in it directly (float32) or cast once into it; the rest are
        computed as without ``out`` and copied in.
        """
        spec = self.spec
        _, _, n, D = self.shape
        if out is not None and (tuple(out.shape) != tuple(self.shape) or out.dtype != dtype):
            raise ValueError(f"dequantize out= must be {dtype} of shape {tuple(self.shape)}, got {out.dtype} "
                             f"{tuple(out.shape)}")  # fmt: skip
        if out is not None:
            if spec.kind == "int" and self.outlier_values is None and spec.rotate is None \
                    and not spec.has_channel_transform:
                if dtype != torch.float32:  # decoded in float32 as always, cast once while copied in
                    return out.copy_(self.dequantize(torch.float32))
                target = _group(out, spec)
                if target.data_ptr() == out.data_ptr():  # a view of out, not a copy reshape made
                    codes = _group(unpack_bits(self.data, spec.bits, D), spec)
                    dequantize_affine(codes, self.scale, self.zero, spec.bits, torch.float32, out=target)
                    return out
            return out.copy_(self.dequantize(dtype, codebook=codebook, sync=sync))
        final = dtype
        if spec.rotate is not None or spec.has_channel_transform:
            dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if spec.kind == "float":
            out = self.data.to(dtype)
        elif spec.kind == "fp8":
            out = dequantize_fp8(self.data, self.scale, dtype)
        elif spec.kind == "int":
            codes = unpack_bits(self.data, spec.bits, D)
            out = _ungroup(
                dequantize_affine(_group(codes, spec), self.scale, self.zero, spec.bits, torch.float32), spec, n, D
            ).to(dtype)
        elif spec.kind == "nuq":
            cb = _codebook(codebook if codebook is not None else self.codebook, spec.bits, sync)
            codes = unpack_bits(self.data, spec.bits, D)
            out = _ungroup(
                dequantize_nuq(_group(codes, spec), self.scale, self.zero, cb, torch.float32), spec, n, D
            ).to(dtype)
        else:
            raise NotImplementedError(f"dequantize for kind={spec.kind!r} is not implemented")
        if self.outlier_values is not None:
            out = scatter_outliers(out, self.outlier_values, self.outlier_index)
        if spec.rotate is not None:
            out = unrotate(out, spec.rotate, dtype)
        if spec.has_channel_transform:
            mean, factor = channel_params(out, spec, self.channel_mean, self.channel_factor)
            out = saturate(from_channel_basis(out, mean, factor), final)
        return out.to(final)


def _channel_vector(t: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """``t`` ``(H_kv, D)`` / ``(1, H_kv, 1, D)`` as a ``(1, H_kv, 1, D)`` tensor on ``x``'s device, float32
    (float64 for float64 ``x``), for ``x`` ``(B, H_kv, n, D)``; ``ValueError`` when it does not fit."""
    if t is None:
        return None
    H, D = x.shape[1], x.shape[3]
    if not isinstance(t, torch.Tensor) or t.numel() != H * D or t.shape[-1] != D:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be ({H}, {D}) or (1, {H}, 1, {D}) for this block, got {got}")
    return t.reshape(1, H, 1, D).to(x.device, torch.float64 if x.dtype == torch.float64 else torch.float32)


def channel_params(
    x: torch.Tensor, spec: TensorSpec, channel_mean: torch.Tensor | None, channel_factor: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``centre`` / ``smooth`` vectors of ``spec`` for block ``x``, ``(1, H_kv, 1, D)`` float32 each (None
    where the spec has none); ``ValueError`` when the spec needs one that is missing or misshapen."""
    if spec.centre and channel_mean is None:
        raise ValueError("a centre spec needs channel_mean (from a calibration artifact)")
    if spec.smooth is not None and channel_factor is None:
        raise ValueError("a smooth spec needs channel_factor (from a calibration artifact)")
    mean = _channel_vector(channel_mean, x, "channel_mean") if spec.centre else None
    factor = _channel_vector(channel_factor, x, "channel_factor") if spec.smooth is not None else None
    return mean, factor


def to_channel_basis(x: torch.Tensor, mean: torch.Tensor | None, factor: torch.Tensor | None) -> torch.Tensor:
    """``(x - mean) / factor`` in float32 (float64 for float64 ``x``), ``x`` ``(B, H_kv, n, D)``, the vectors
    ``(H_kv, D)`` or ``(1, H_kv, 1, D)`` (None: left out): what a ``centre`` / ``smooth`` spec codes."""
    out = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if mean is not None:
        out = out - _channel_vector(mean, out, "channel_mean")
    if factor is not None:
        out = out / _channel_vector(factor, out, "channel_factor")
    return out


def from_channel_basis(y: torch.Tensor, mean: torch.Tensor | None, factor: torch.Tensor | None) -> torch.Tensor:
    """``y * factor + mean`` (the inverse of ``to_channel_basis``), ``(B, H_kv, n, D)``, in ``y``'s dtype."""
    if factor is not None:
        y = y * _channel_vector(factor, y, "channel_factor").to(y.dtype)
    if mean is not None:
        y = y + _channel_vector(mean, y, "channel_mean").to(y.dtype)
    return y


def saturate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` (float32 / float64, any shape) clamped in place to ``dtype``'s finite range when ``dtype`` is float16
    or bfloat16, so the cast to it gives no inf (NaN stays NaN); ``y`` as is for other dtypes. A ``y`` of ``dtype``
    itself has its inf clamped to ``+-max`` (pre-RoPE keys rotated in float16, ``reference.materialize``).

    For decoded ``centre`` / ``smooth`` values, ``code * factor + mean``: a row's scale comes from its smoothed
    absmax (a channel with a small factor), and a channel with a large factor whose code reaches the top level
    is multiplied by its factor, past 65504 for inputs the cache accepts (int2 symmetric, factors ``[0.8, 1.5]``:
    ``[-52384, -52384]`` decoded to ``[-52384, -inf]``, NaN in attention). The inputs were within the float16
    range there, so the saturated value is nearer them than the overflow.
    """
    if dtype in (torch.float16, torch.bfloat16):
        top = torch.finfo(dtype).max
        return y.clamp_(-top, top)
    return y


def _codebook(codebook: torch.Tensor | None, bits: int, sync: bool) -> torch.Tensor:
    """``check_codebook``; with ``sync=False`` only what needs no host sync (present, float16, ``2**bits``
    entries): the caller checked the values once (``QuantizedKVLayer.set_static_qparams``)."""
    if sync or not (
        isinstance(codebook, torch.Tensor) and codebook.dtype == CODEBOOK_DTYPE and codebook.shape == (2**bits,)
    ):
        return check_codebook(codebook, bits)
    return codebook


def _group(x: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """View ``(B, H, n, D)`` so that one scale covers the trailing reduced dims (see ``_reduce_dims``)."""
    B, H, n, D = x.shape
    if spec.granularity == "token":
        g = spec.group_size or D
        if D % g:
            raise ValueError(f"token group size {g} must divide head_dim {D}")
        return x.reshape(B, H, n, D // g, g)
    if spec.granularity == "channel":
        G = spec.group_size
        if G is None:  # static per-channel: one calibrated scale per (head, channel), shape (1, H, 1, D)
            return x
        if n % G:
            raise ValueError(f"per-channel block of {n} tokens is not a multiple of the group size {G}")
        return x.reshape(B, H, n // G, G, D)
    return x


def _ungroup(x: torch.Tensor, spec: TensorSpec, n: int, D: int) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], n, D)


def _reduce_dims(spec: TensorSpec) -> tuple[int, ...]:
    return {"token": (-1,), "channel": (-2,), "head": (-2, -1), "tensor": (-3, -2, -1)}[spec.granularity]


def quantize(
    x: torch.Tensor,
    spec: TensorSpec,
    *,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    channel_mean: torch.Tensor | None = None,
    channel_factor: torch.Tensor | None = None,
    validate: bool = True,
    sync: bool = True,
) -> QuantizedTensor:
    """Quantize one block ``x`` of shape ``(B, H_kv, n, D)`` following ``spec``.

    Args:
        x: the block; per-channel specs need ``n`` to be a multiple of ``spec.group_size``.
        spec: how to store it.
        static_scale, static_zero: for ``spec.static``: scales from calibration, broadcastable to the
            grouped view, of size 1 over the batch, the tokens and within a group (``static_param_shape``).
            Static per-channel specs (no token group) take ``(1, H_kv, 1, D)`` (leading 1s optional) or ``(H_kv, D)`` and
            do not depend on ``n``; outliers are then the entries farthest from their
            channel's calibrated range centre, in units of that range.
        codebook: ``kind="nuq"`` (required): float16 ``(2**bits,)`` sorted entries in ``[-1, 1]``.
        channel_mean, channel_factor: ``spec.centre`` / ``spec.smooth`` (required there): calibrated
            ``(H_kv, D)`` or ``(1, H_kv, 1, D)`` vectors; the codes are those of ``(x - mean) / factor``
            (before any ``spec.rotate``), in float32.
            A parameter the spec does not use is a ``ValueError`` (``check_unused_params``), not ignored.
        validate: check finiteness and range (``ValueError`` on NaN/inf), and that static scales are
            finite and ``>= 0`` (FP8: ``> 0``) with finite zero-points, channel means finite and smoothing
            factors finite and ``> 0`` (``check_block``).
        sync: ``False``: never wait for the device (``kvbits.cache`` per-step path): ``clipped`` stays a
            0-dim int64 tensor on ``x``'s device (a dynamic NUQ range clips nothing: a host 0 either way, as
            the Triton kernel reports dynamic ranges), the codebook's values are not re-checked (its dtype
            and shape are) and neither are asymmetric NUQ ranges (``choose_nuq_params``: a ``ValueError``
            otherwise when a group spans more than float16 holds); pair with ``validate=False``.
    """
    check_unused_params(spec, static_scale, static_zero, codebook, channel_mean, channel_factor)
    if validate:
        check_block(x, spec, static_scale, static_zero, channel_mean, channel_factor)
    _check_head_dim(x)
    B, H, n, D = x.shape
    shape = (B, H, n, D)
    if spec.has_channel_transform:  # (x - mean) / factor: everything below lives in that basis
        mean, factor = channel_params(x, spec, channel_mean, channel_factor)
        x = to_channel_basis(x, mean, factor)
    if spec.rotate is not None:  # everything below (scales, outliers, codes) lives in the rotated basis
        check_rotatable(D, spec.rotate)
        x = rotate(x, spec.rotate)
    if spec.kind == "float":
        return QuantizedTensor(spec, shape, x.to(FLOAT_DTYPES[spec.fmt]).contiguous())
    if spec.kind == "nuq":
        _codebook(codebook, spec.bits, sync)
    static_qp = _static_qparams(x, spec, static_scale, static_zero) if spec.kind in ("int", "nuq") else None
    o_vals, o_idx, mask = select_outliers(x, spec, static_qp)
    if spec.kind == "fp8":
        if spec.static:  # TensorSpec: FP8 tensor/head scales are static, token scales dynamic
            scale = static_scale if static_scale is not None else torch.ones((), dtype=torch.float32)
            # () per tensor, (1, H_kv, 1, 1) per head: a shape check, no device read
            scale = static_fp8_scale(scale.to(x.device, torch.float32), spec.granularity, H, "static FP8 scale")
        else:
            amax = x.float().abs().amax(dim=-1, keepdim=True)
            if mask is not None:
                amax = x.float().abs().masked_fill(mask, 0).amax(dim=-1, keepdim=True)
            from kvbits.quant.fp8 import fp8_max

            # Round the float16 scale *up* (as affine scales are): rounding to nearest could land
            # below amax / fp8_max, so the row maximum saturated and was counted in `clipped`, and a
            # tiny amax (e5m2: below ~3e-3) underflowed to scale 0 and decoded the row to zeros.
            # float32 scales (scale_dtype="fp32") are vLLM's amax / fp8_max as computed. Near 65504 the float16
            # scale is capped a step lower (_stored_scale), so fp8_max * scale still decodes within float16.
            scale = _stored_scale(div_rn(amax, fp8_max(spec.fmt)), _meta_dtype(spec), fp8_max(spec.fmt))
        codes, clipped = quantize_fp8(x, scale, spec.fmt)
        if not spec.static:
            # a dynamic row's maximum lands within a float32 ulp of fp8_max (float32 scales: amax / (amax /
            # fp8_max)) or, under a capped float16 scale, within 2**-10 of it, and saturates onto it, as in
            # vLLM: rounding, not a value beyond the range its scale was taken from
            clipped = clipped & (x.float().abs() > amax)
        if mask is not None:
            clipped = clipped & ~mask
        return QuantizedTensor(
            spec, shape, codes, scale=scale, outlier_values=o_vals, outlier_index=o_idx,
            clipped=_count(clipped, sync), static=spec.static,
        )
    if spec.kind not in ("int", "nuq"):
        raise NotImplementedError(f"quantize for kind={spec.kind!r} is not implemented")
    xg = _group(x, spec)
    mg = _group(mask, spec) if mask is not None else None
    trunc = None
    if static_qp is not None:
        scale, zero = static_qp
    elif spec.integer_zero:
        scale, zero = integer_zero_qparams(xg, spec.bits, _reduce_dims(spec), mask=mg)
    elif spec.rounding == "trunc":  # codes from vLLM's float32 scale, whichever dtype stores it
        scale, *trunc = trunc_symmetric(xg, spec.bits, _reduce_dims(spec), mask=mg, meta=_meta_dtype(spec))
        zero = None
    elif spec.kind == "int":
        scale, zero = choose_qparams(
            xg, spec.bits, _reduce_dims(spec), symmetric=spec.symmetric, mask=mg, meta=_meta_dtype(spec)
        )
    else:  # the range check reads the device: not with sync=False (the cache bounds |x| instead)
        scale, zero = choose_nuq_params(
            xg, _reduce_dims(spec), symmetric=spec.symmetric, mask=mg, check=validate or sync
        )
    if trunc is not None:
        codes, clipped = trunc
    elif spec.kind == "int":
        codes, clipped = quantize_affine(xg, scale, zero, spec.bits)
    else:
        codes, clipped = quantize_nuq(xg, scale, zero, codebook)
    if static_qp is not None:  # dynamic scales are 0 only for a group equal to its zero-point
        clipped = clipped | zero_scale_clipped(xg, scale, zero)
    elif spec.kind == "nuq":
        # a dynamic range is its group's own: only a scale capped at float16's end (_stored_scale, one float16
        # step) leaves the top value past it, by up to 2**-9 in u, and it decodes to the last entry: rounding,
        # not a clip (as the integer codes' top level and the Triton kernel, which counts dynamic ranges as 0)
        # (counted as 0 on the host, whatever ``sync``: reading back a sum known to be 0 would be a sync for nothing)
        clipped = None
    if mg is not None and clipped is not None:
        clipped = clipped & ~mg
    packed = pack_bits(_ungroup(codes, spec, n, D), spec.bits, check_range=False)  # clamped: no sync
    return QuantizedTensor(
        spec, shape, packed, scale=scale, zero=zero, outlier_values=o_vals, outlier_index=o_idx,
        clipped=0 if clipped is None else _count(clipped, sync), static=spec.static, codebook=codebook if spec.kind == "nuq" else None,
        # the caller's tensors (the layer's), not float32 copies: a block holds references, no bytes
        channel_mean=channel_mean if spec.centre else None, channel_factor=channel_factor if spec.smooth is not None else None,
    )


def check_unused_params(
    spec: TensorSpec,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    channel_mean: torch.Tensor | None = None,
    channel_factor: torch.Tensor | None = None,
) -> None:
    """``ValueError`` for a calibrated parameter ``spec`` does not use: ``quantize`` would ignore it and code the
    block without it (a codebook given to an int spec, static scales to a dynamic one), silently uncalibrated.
    Only ``None`` checks: no host sync."""
    unused = [
        name for name, t, used in (
            ("static_scale", static_scale, spec.static),
            ("static_zero", static_zero, spec.static and spec.has_zero_point),
            ("codebook", codebook, spec.kind == "nuq"),
            ("channel_mean", channel_mean, spec.centre),
            ("channel_factor", channel_factor, spec.smooth is not None),
        ) if t is not None and not used
    ]  # fmt: skip
    if unused:
        raise ValueError(
            f"{', '.join(unused)} given for a spec that does not use {'them' if len(unused) > 1 else 'it'} "
            f"(kind={spec.kind!r}, static={spec.static}, symmetric={spec.symmetric}, centre={spec.centre}, "
            f"smooth={spec.smooth}) and would be ignored; pass only what the spec uses (static_scale: static specs; "
            "static_zero: static asymmetric int/NUQ; codebook: NUQ; channel_mean / channel_factor: centre / smooth)"
        )


def check_block(
    x: torch.Tensor,
    spec: TensorSpec,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
    channel_mean: torch.Tensor | None = None,
    channel_factor: torch.Tensor | None = None,
) -> None:
    """What ``quantize(validate=True)`` checks before quantizing ``x`` ``(B, H_kv, n, D)`` (and what
    ``kvbits.kernels.quantize_pack`` checks before its kernel): finite K/V within float16 (``check_kv``),
    ``D >= 1``, and the calibrated parameters' values: static scales finite and ``>= 0`` (FP8: ``> 0``), held by
    float16 (``to_float16``) and decoding the largest K/V within float16 (``check_static_decode``),
    finite zero-points, finite channel means, finite smoothing factors ``> 0``; a centred / smoothed or rotated
    spec's coded block (``(x - mean) / factor``, then ``@ R``) within float16 too, and an ``integer_zero`` spec's
    within ``kvbits.quant.affine.integer_zero_bound``. Host syncs: for checks,
    not for the per-step path."""
    check_kv(x, "K/V block")
    _check_head_dim(x)
    coded = x
    if spec.has_channel_transform:
        mean, factor = channel_params(x, spec, channel_mean, channel_factor)
        if mean is not None:
            check_finite(mean, "channel_mean")
        if factor is not None:
            check_static_scale(factor, "channel_factor", positive=True)
        # what the float16 scales cover is (x - mean) / factor: a small factor can take it past float16
        coded = to_channel_basis(x, mean, factor)
        check_kv(coded, "K/V block as coded, (x - channel_mean) / channel_factor,")
    if spec.rotate is not None:  # x @ R can gather a row's whole norm in one channel: up to sqrt(D) max |x|
        check_rotatable(x.shape[3], spec.rotate)
        coded = rotate(coded.float(), spec.rotate)
        check_kv(coded, f"K/V block as coded, rotated ({spec.rotate}),")
    if spec.integer_zero and coded.numel():  # a level the codes reach may lie half a step past the range
        amax, bound = float(coded.detach().abs().max()), integer_zero_bound(spec.bits)
        if amax > bound:
            raise ValueError(
                f"K/V block as coded has |x| up to {amax:.6g}, beyond {bound:.6g}: integer zero-points "
                f"({spec.bits}-bit) reach a level half a step past the range, which would decode past float16"
            )
    if spec.kind == "fp8":
        if static_scale is not None:
            check_static_scale(static_scale, "static FP8 scale", positive=True)
            check_static_decode(spec, static_scale, None, "static FP8 scale")
    elif spec.kind in ("int", "nuq"):
        _static_qparams(x, spec, static_scale, static_zero, check=True)


def _check_head_dim(x: torch.Tensor) -> None:
    """``ValueError`` for a block with no channels (``D = 0``): nothing to scale, no row to pack. Empty
    batches, heads or token counts are fine (``check_kv`` lets them through too)."""
    if x.dim() != 4 or x.shape[3] < 1:
        raise ValueError(f"K/V block must be (B, H_kv, T, D) with head_dim D >= 1, got shape {tuple(x.shape)}")


def _meta_dtype(spec: TensorSpec) -> torch.dtype:
    """What ``spec``'s dynamic scales and zero-points are stored in (``TensorSpec.scale_dtype``)."""
    return FLOAT_DTYPES[spec.scale_dtype]


def _count(mask: torch.Tensor, sync: bool) -> int | torch.Tensor:
    """Number of True entries: a host int, or (``sync=False``) a 0-dim int64 tensor on the device."""
    n = mask.sum()
    return int(n) if sync else n


def check_static_scale(scale: torch.Tensor, what: str, *, positive: bool = False) -> None:
    """``ValueError`` unless every entry of ``scale`` is finite and ``>= 0`` (``positive``: ``> 0``).

    One host sync. A NaN or inf scale decodes to NaN, a negative one mirrors the grid; integer / NUQ
    scales may be 0 (a channel constant during calibration: its values decode to the zero-point, and
    values elsewhere count as clipped), an FP8 scale may not (it divides).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(scale).__name__}")
    s = scale.detach().float()
    bad = ~torch.isfinite(s) | ((s <= 0) if positive else (s < 0))
    if bool(bad.any()):
        allowed = "finite and > 0" if positive else "finite and >= 0"
        first = float(s.flatten()[bad.flatten()][0])
        raise ValueError(f"{what} must be {allowed}; {int(bad.sum())} of {s.numel()} entries are not (e.g. {first})")


SCALE_UNDERFLOW = ("a scale of 0 collapses its channel onto the zero-point: give 0 for a constant channel, or a scale "
                   "float16 holds")


def to_float16(t: torch.Tensor, what: str, *, nonzero: str | None = None) -> torch.Tensor:
    """``t`` cast to float16 (a static scale, zero-point or channel vector as stored), ``ValueError`` when a finite
    value overflows float16 (beyond 65504 it becomes inf: named as given, not as the inf it became) or, with
    ``nonzero`` (scales, smoothing factors: why a 0 is wrong, said in the error), when a nonzero value underflows to
    0 (below ~2.98e-8): a static scale of 0 collapses its whole channel onto the zero-point, seen only in the clipped
    count (``SCALE_UNDERFLOW``). NaN / inf given stay as they are, for the caller's checks. One host sync."""
    h = t.to(torch.float16)
    if t.dtype == torch.float16:
        return h
    f = t.detach().float()
    over = torch.isfinite(f) & torch.isinf(h)
    under = (f != 0) & (h == 0) if nonzero is not None else torch.zeros_like(over)
    n_over, n_under = int(over.sum()), int(under.sum())
    if n_over:
        first = float(f[over].flatten()[0])
        raise ValueError(f"{what}: {n_over} of {f.numel()} entries overflow float16, which stores them (e.g. {first:g} "
                         f"given; float16 holds |x| up to {FP16_MAX:g})")
    if n_under:
        first = float(f[under].flatten()[0])
        tiny = float(torch.finfo(torch.float16).smallest_normal) * 2**-10
        raise ValueError(f"{what}: {n_under} of {f.numel()} entries are nonzero but round to 0 in float16, which stores "
                         f"them (e.g. {first:g} given; float16's smallest is {tiny:.3g}): {nonzero}")
    return h


def check_static_decode(
    spec: TensorSpec,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    what: str,
    codebook: torch.Tensor | None = None,
) -> None:
    """``ValueError`` when static ``scale`` (and ``zero``) of ``spec`` (int, NUQ or FP8) code the largest K/V
    (``+-65504``, what ``check_kv`` lets through) onto a level that decodes past float16: inf in float16 K/V, NaN in
    attention (symmetric 3-bit scale 21840 decodes -65504 as ``-3 * 21840 = -65520``; an E4M3 scale of 150 decodes
    65504 as ``448 * 150``). Exact: codes are monotone in ``x``, so these two probes decode to the extremes; a
    scale that large but whose level nearest 65504 stays within float16 passes. A NUQ scale without its
    ``codebook`` is probed with the entries ``+-1``, the farthest a codebook reaches. Non-finite scales are left to
    ``check_static_scale``. One host sync."""
    s = scale.detach().float()
    z = None if zero is None or not spec.has_zero_point else zero.detach().to(s.device, torch.float32)
    try:
        shape = broadcast_shape(s.shape, *(() if z is None else (z.shape,)))
    except ValueError:  # misshapen: refused by the shape checks (static_param_shape), which name the shapes expected
        return
    x = torch.tensor([FP16_MAX, -FP16_MAX], device=s.device).reshape(2, *([1] * len(shape))).expand(2, *shape)
    if spec.kind == "fp8":
        out = dequantize_fp8(quantize_fp8(x, s, spec.fmt)[0], s, torch.float32)
    elif spec.kind == "int":
        out = dequantize_affine(quantize_affine(x, s, z, spec.bits)[0], s, z, spec.bits, torch.float32)
    else:
        cb = torch.tensor([-1.0, 1.0]) if codebook is None else codebook.detach().to(s.device, torch.float32)
        out = dequantize_nuq(quantize_nuq(x, s, z, cb)[0], s, z, cb, torch.float32)
    bad = torch.isinf(out.to(torch.float16)) & torch.isfinite(out)
    n_bad = int(bad.any(0).sum())
    if n_bad:
        i = tuple(int(j) for j in bad.nonzero()[0])
        given = f"scale {float(s.expand(shape)[i[1:]]):g}" + (
            "" if z is None else f" with zero-point {float(z.expand(shape)[i[1:]]):g}")
        raise ValueError(
            f"{what}: {n_bad} of {out[0].numel()} entries decode past float16 (e.g. {given} decodes "
            f"{float(x[i]):g} as {float(out[i]):g}; float16 holds |x| up to {FP16_MAX:g}): inf in float16 K/V, NaN "
            "in attention; a static scale must keep the levels K/V reach within float16"
        )


def check_finite(t: torch.Tensor, what: str) -> None:
    """``ValueError`` unless every entry of ``t`` (e.g. a static zero-point) is finite; one host sync."""
    n_bad = int((~torch.isfinite(t)).sum())
    if n_bad:
        raise ValueError(f"{what} must be finite, got {n_bad} non-finite entries")


def zero_scale_clipped(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """Bool like ``x``: elements of groups with scale 0 that differ from the one value such a group decodes
    to (its zero-point; 0 when symmetric). A static scale of 0 collapses the whole calibrated channel onto
    that value, so every other value is clipped, and counted like values beyond a nonzero range."""
    target = zero.float() if zero is not None else torch.zeros((), device=x.device)
    return (scale == 0) & (x.float() != target)


def static_param_shape(t: torch.Tensor, name: str, x: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Static scale or zero-point ``t`` of ``spec`` as it broadcasts to ``_group(x)`` for a block ``x`` ``(B, H_kv, n,
    D)`` (a static per-channel ``(H_kv, D)`` viewed as ``(1, H_kv, 1, D)``); ``TypeError`` / ``ValueError`` when it
    does not, when a static per-channel one is not ``(H_kv, D)`` or ``(1, H_kv, 1, D)`` (leading 1s optional), or
    when it varies over the batch, the tokens or within a group (size 1 there: it would fit one block shape only).
    Shapes only: ``x`` may be a ``meta`` tensor (``kvbits.cache.fixed.check_param_shapes``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    H, D = x.shape[1], x.shape[3]
    per_channel = spec.granularity == "channel" and spec.group_size is None
    if per_channel and tuple(t.shape) == (H, D):
        t = t.reshape(1, H, 1, D)
    grouped = _group(x, spec).shape
    try:
        ok = broadcast_shape(t.shape, grouped) == grouped
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to the {spec.granularity} "
                         f"groups {tuple(grouped)} of a block {tuple(x.shape)}")
    # a calibrated constant: one per head and channel (per channel), never per sequence or token position. A
    # (1, H, n, D) fitted a block of n tokens only (refused at the first flush of another size, part-way through
    # an update) and a (D,) or (1, 1, 1, 1) one broadcast silently over the heads and channels it did not cover
    if per_channel and (1,) * (4 - t.dim()) + tuple(t.shape) != (1, H, 1, D):
        raise ValueError(f"{name} of a static per-channel spec must be (H_kv, D) = ({H}, {D}) or (1, {H}, 1, {D}), "
                         f"got shape {tuple(t.shape)}")
    shape = (1,) * (len(grouped) - t.dim()) + tuple(t.shape)
    reduced = {d % len(grouped) for d in _reduce_dims(spec)}
    if any(shape[d] != 1 for d in {0, 2} | reduced):  # the batch, the tokens and what one scale covers
        raise ValueError(f"{name} of shape {tuple(t.shape)} varies over the batch, the tokens or within a "
                         f"{spec.granularity} group of the groups {tuple(grouped)} of a block {tuple(x.shape)}; a static "
                         "parameter has size 1 there")
    return t


def _static_qparams(
    x: torch.Tensor,
    spec: TensorSpec,
    static_scale: torch.Tensor | None,
    static_zero: torch.Tensor | None,
    *,
    check: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Calibrated ``(scale, zero)`` for an int/NUQ static spec, float16, shaped for ``_group(x)``.

    ``check``: also the values (``to_float16``, ``check_static_scale``; finite zero-points;
    ``check_static_decode``), host syncs."""
    if not spec.static:
        return None
    if static_scale is None:
        raise ValueError("a static spec needs static_scale (from a calibration artifact)")
    if spec.has_zero_point and static_zero is None:
        raise ValueError("an asymmetric static spec needs static_zero as well as static_scale")
    out = []
    for name, t in (("static_scale", static_scale), ("static_zero", static_zero if spec.has_zero_point else None)):
        if t is None:
            out.append(None)
            continue
        t = static_param_shape(t, name, x, spec)
        if check:  # a float32 value float16 does not hold: named as given, not as the inf / 0 it became
            t = to_float16(t, name, nonzero=SCALE_UNDERFLOW if name == "static_scale" else None)
        t = t.to(x.device, META_DTYPE)
        if check and name == "static_scale":
            check_static_scale(t, name)
        elif check:
            check_finite(t, name)
        out.append(t)
    if check:
        check_static_decode(spec, out[0], out[1], "static_scale")
    return out[0], out[1]


def select_outliers(
    x: torch.Tensor, spec: TensorSpec, static_qp: tuple[torch.Tensor, torch.Tensor | None] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The dense-and-sparse outliers ``quantize`` keeps for block ``x`` ``(B, H_kv, n, D)``: ``(values,
    index, mask)`` of ``gather_outliers`` (``None`` thrice when the spec keeps none). Ranked by magnitude,
    or under static int/NUQ ranges (``static_qp``, from ``_static_qparams``) by ``_static_score``."""
    n, D = x.shape[2], x.shape[3]
    k = outlier_count(D, spec.outlier_frac)
    if not k:
        return None, None, None
    score = None if static_qp is None else _ungroup(_static_score(_group(x, spec), spec, *static_qp), spec, n, D)
    return gather_outliers(x, k, score=score)


def _static_score(
    xg: torch.Tensor, spec: TensorSpec, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """Outlier selection score under static scales: distance from the calibrated range centre in
    half-ranges (KVQuant §3.5: outliers relative to the offline per-channel thresholds)."""
    if spec.kind == "int":  # express the integer grid as a range: [zero, zero + scale (2^b - 1)]
        scale = scale.float() * (2 ** (spec.bits - 1) - 1 if zero is None else 2**spec.bits - 1)
    return nuq_outlier_score(xg, scale, zero)


def codebook_inputs(
    x: torch.Tensor,
    spec: TensorSpec,
    *,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a NUQ codebook is applied to for block ``x`` ``(B, H_kv, n, D)`` under a NUQ ``spec``.

    Returns ``(u, kept)``: ``u`` float32 ``(B, H_kv, n, D)``, the normalised values (``[-1, 1]``
    inside the range, beyond it where a static scale clips) and ``kept`` bool, False for the
    dense-and-sparse outliers (stored in float16, never coded). Calibration fits codebooks to these,
    so the codebook is trained on exactly what ``quantize`` will code (a rotated spec: of ``x @ R``).
    """
    if spec.kind != "nuq":
        raise ValueError(f"codebook_inputs needs a nuq spec, got kind={spec.kind!r}")
    _check_head_dim(x)
    n, D = x.shape[2], x.shape[3]
    if spec.rotate is not None:  # as quantize: the codes are of x @ R
        check_rotatable(D, spec.rotate)
        x = rotate(x, spec.rotate)
    static_qp = _static_qparams(x, spec, static_scale, static_zero, check=True)
    xg = _group(x, spec)
    mask = select_outliers(x, spec, static_qp)[2]
    mg = _group(mask, spec) if mask is not None else None
    if static_qp is not None:
        scale, zero = static_qp
    else:
        scale, zero = choose_nuq_params(xg, _reduce_dims(spec), symmetric=spec.symmetric, mask=mg)
    u = _ungroup(nuq_normalize(xg, scale, zero), spec, n, D)
    kept = torch.ones_like(u, dtype=torch.bool) if mask is None else ~mask
    return u, kept


def fake_quantize(x: torch.Tensor, spec: TensorSpec, **kwargs) -> torch.Tensor:
    """``quantize`` then ``dequantize`` in ``x``'s dtype: what attention sees (simulated quantization)."""
    return quantize(x, spec, **kwargs).dequantize(x.dtype)
