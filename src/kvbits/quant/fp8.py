"""FP8 (E4M3, E5M2) storage through torch's float8 dtypes, with a scale: ``x ≈ fp8(x / s) * s``."""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 format must be one of {tuple(FP8_DTYPES)}, got {fmt!r}")
    return FP8_DTYPES[fmt]


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(fp8_dtype(fmt)).max)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and a mask of values that saturated (|x / s| beyond the format's largest finite)."""
    m = fp8_max(fmt)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = x.float() / safe
    clipped = y.abs() > m
    return y.clamp(-m, m).to(fp8_dtype(fmt)), clipped


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)
