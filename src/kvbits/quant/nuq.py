"""Non-uniform quantization (NUQ) with a per-layer codebook (KVQuant §3.3, Hooper et al. 2024).

A group is normalised like the asymmetric integer path, from its minimum ``zero`` and its range
``scale`` (both float16, rounded outward so the stored range covers the data)::

    u = 2 * (x - zero) / scale - 1            in [-1, 1]

and ``u`` is replaced by the index of the nearest of ``2**bits`` sorted float16 codebook entries in
``[-1, 1]``; dequantization is ``zero + (codebook[code] + 1) * scale / 2``. Symmetric NUQ keeps no
zero-point: ``scale`` is the group's largest magnitude and ``u = x / scale``.

The codebook is a per-layer constant found offline (``kvbits.calibrate``: k-means on calibration
activations weighted by diagonal Fisher information). The uniform codebook
``linspace(-1, 1, 2**bits)`` places its entries exactly on the integer grid, so it reproduces the
asymmetric integer quantizer (up to float16 rounding of the entries): the NUQ machinery adds no
error of its own.

Codes are ``uint8`` in ``[0, 2**bits)``, bit-packed like integer codes (``kvbits.quant.pack``).
"""

from __future__ import annotations

import torch

from kvbits.quant.affine import masked_range, range_qparams

CODEBOOK_DTYPE = torch.float16


def uniform_codebook(bits: int) -> torch.Tensor:
    """``2**bits`` evenly spaced entries over ``[-1, 1]`` (float16): NUQ's integer-equivalent codebook."""
    if bits < 1 or bits > 8:
        raise ValueError(f"codebook bits must be in [1, 8], got {bits}")
    return torch.linspace(-1.0, 1.0, 2**bits, dtype=torch.float64).to(CODEBOOK_DTYPE)


def check_codebook(codebook: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Validate a NUQ codebook and return it (unchanged).

    A codebook is a 1-D float16 tensor of ``2**bits`` finite entries, sorted ascending, in ``[-1, 1]``.
    """
    if codebook is None:
        raise ValueError(
            f"kind='nuq' needs codebook= (a float16 tensor of {2**bits} sorted entries in [-1, 1], from a "
            "calibration artifact or kvbits.quant.nuq.uniform_codebook)"
        )
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"codebook must be a torch.Tensor, got {type(codebook).__name__}")
    if codebook.dtype != CODEBOOK_DTYPE:
        raise TypeError(
            f"codebook must be float16 (it is stored and counted as float16), got {codebook.dtype}"
        )
    if codebook.shape != (2**bits,):
        raise ValueError(f"a {bits}-bit codebook needs shape ({2**bits},), got {tuple(codebook.shape)}")
    c = codebook.float()
    if not bool(torch.isfinite(c).all()) or float(c.min()) < -1.0 or float(c.max()) > 1.0:
        raise ValueError(f"codebook entries must be finite and in [-1, 1], got {codebook.tolist()}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"codebook entries must be sorted ascending, got {codebook.tolist()}")
    return codebook


def choose_nuq_params(
    x: torch.Tensor,
    dims: tuple[int, ...],
    *,
    symmetric: bool = False,
    mask: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Range ``scale`` (and minimum ``zero``) over ``dims`` of ``x``, keepdim, float16.

    Asymmetric: ``zero`` = group minimum rounded down, ``scale`` = ``max - zero`` rounded up, so every
    element maps into ``[-1, 1]``. Symmetric: ``scale`` = largest magnitude rounded up, no zero.
    ``mask`` (bool like ``x``) marks elements excluded from the range (dense-and-sparse outliers).

    Raises:
        ValueError: (``check``, one host sync) an asymmetric group spans more than float16's 65504, so
            its scale would be inf and the group would decode to NaN (the stored format is float16: the
            kernels read it). ``check=False`` leaves that to the caller (``kvbits.cache`` bounds its
            inputs by ``|x| <= 65504 / 2`` instead, without a sync per step).
    """
    scale, zero = range_qparams(x, dims, 1, symmetric=symmetric, mask=mask)
    if check and zero is not None and scale.numel() and bool(torch.isinf(scale).any()):
        raise ValueError(_span_message(*masked_range(x.float(), dims, mask)))
    return scale, zero


def _span_message(lo: torch.Tensor, hi: torch.Tensor) -> str:
    """Why an asymmetric group's float16 scale overflowed, from the groups' float32 ``lo`` / ``hi`` (any shape),
    and what to do. The span is taken from the data: one from the stored float16 zero-point read ``inf`` once
    the minimum itself was past -65504 (the zero-point rounded down to -inf)."""
    f16 = torch.finfo(torch.float16).max
    worst = int((hi - lo).flatten().argmax())
    g_lo, g_hi = float(lo.flatten()[worst]), float(hi.flatten()[worst])
    peak = float(torch.maximum(lo.abs(), hi.abs()).max())
    said = (f"asymmetric NUQ stores each group's minimum as a float16 zero-point and its range max - min as a "
            f"float16 scale; a group spans {g_hi - g_lo:.6g}, beyond float16's {f16:g} (min {g_lo:.6g}, max "
            f"{g_hi:.6g}; it would decode to NaN)")  # fmt: skip
    if peak > f16:
        said += f", and values reach |x| = {peak:.6g}, past float16's range themselves"
    return (said + f": keep |x| within {f16 / 2:g} (scale the input down), use symmetric NUQ (its scale is the "
            f"largest |x|, values past {f16:g} clip), or a dynamic int or FP8 spec with scale_dtype='fp32' (NUQ has "
            "no float32 scales)")


def nuq_normalize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``u`` (float32, like ``x``): ``2 (x - zero) / scale - 1``, or ``x / scale`` when symmetric.

    In ``[-1, 1]`` for data inside the range; beyond it for data a static scale does not cover. A
    group of range 0 (constant) maps to ``-1`` (asymmetric) or ``0`` (symmetric) and decodes exactly.
    """
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if zero is None:
        return torch.where(s > 0, x.float() / safe, torch.zeros_like(x, dtype=torch.float32))
    u = 2.0 * (x.float() - zero.float()) / safe - 1.0
    return torch.where(s > 0, u, torch.full_like(u, -1.0))


def nuq_outlier_score(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``|u|``: an element's distance from the centre of its range in half-ranges (outlier selection).

    Under static per-channel key scales this ranks entries by their deviation in units of the
    calibrated channel range, ``|x - center_c| / (range_c / 2)``, rather than by raw magnitude.
    """
    s = scale.float()
    tiny = torch.finfo(torch.float32).tiny
    if zero is None:
        return x.float().abs() / s.clamp_min(tiny)
    half = (s / 2).clamp_min(tiny)
    return (x.float() - (zero.float() + s / 2)).abs() / half


def quantize_nuq(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, codebook: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, like ``x``): index of the nearest codebook entry to ``u``; and a bool mask of
    elements outside the range (``|u| > 1``: clipped against a static scale).

    Ties between two entries go to the lower one. ``scale``/``zero`` broadcast against ``x``.
    """
    u = nuq_normalize(x, scale, zero)
    c = codebook.to(u.device, torch.float32)
    mid = (c[1:] + c[:-1]) / 2
    codes = torch.bucketize(u.contiguous(), mid)
    # tolerance: float32 evaluation of u for data exactly on the (float16) range ends
    clipped = u.abs() > 1.0 + 1e-6
    return codes.to(torch.uint8), clipped


def dequantize_nuq(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    codebook: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of ``quantize_nuq`` (computed in float32, returned in ``dtype``)."""
    u = codebook.to(codes.device, torch.float32)[codes.long()]
    if zero is None:
        out = u * scale.float()
    else:
        out = zero.float() + (u + 1.0) * (scale.float() / 2)
    return out.to(dtype)


__all__ = [
    "CODEBOOK_DTYPE",
    "check_codebook",
    "choose_nuq_params",
    "dequantize_nuq",
    "nuq_normalize",
    "nuq_outlier_score",
    "quantize_nuq",
    "uniform_codebook",
]
