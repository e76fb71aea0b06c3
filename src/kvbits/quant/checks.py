"""Input validation shared by the quantizers: finite, floating, representable in float16 metadata."""

from __future__ import annotations

import torch

FP16_MAX = 65504.0
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what K/V may arrive in (not float8)


def check_kv(x: torch.Tensor, what: str = "tensor", *, ndim: int | None = 4) -> None:
    """Raise a clear error for K/V that can not be quantized faithfully.

    Expects a floating tensor (``(B, H_kv, T, D)`` when ``ndim=4``) with only finite values whose
    magnitude fits float16 metadata.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating tensor, got {x.dtype}")
    if x.dtype not in KV_DTYPES:  # float8: torch has no isfinite / max / promotion for it
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{what} must have {ndim} dims (B, H_kv, T, D), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return
    if not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(f"{what} contains non-finite values ({n_nan} NaN, {n_inf} inf); refusing to quantize")
    amax = float(x.detach().abs().max())
    if amax > FP16_MAX:
        raise ValueError(f"{what} has |x| up to {amax:.4g}, beyond float16 range ({FP16_MAX}) used for scales")
