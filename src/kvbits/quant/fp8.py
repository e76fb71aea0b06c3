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


def static_fp8_scale(scale: torch.Tensor, granularity: str, n_heads: int | None, what: str) -> torch.Tensor:
    """A static FP8 scale in the shape ``quantize`` broadcasts over ``(B, H_kv, n, D)`` blocks.

    ``granularity="tensor"``: one number, returned as a ``()`` tensor. ``"head"`` (vLLM's ``attn_head``):
    ``(H_kv,)``, ``(H_kv, 1, 1)`` (llm-compressor's layout) or ``(1, H_kv, 1, 1)``, returned as
    ``(1, H_kv, 1, 1)``; one number is repeated per head (the uncalibrated 1.0). ``n_heads``: ``H_kv``
    when known (``None``: taken from ``scale``). ``ValueError`` for any other shape.
    """
    if granularity == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"{what}: a per-tensor FP8 scale is one number, got shape {tuple(scale.shape)}")
        return scale if scale.dim() == 0 else scale.reshape(())  # the same tensor when it already fits
    if granularity != "head":
        raise ValueError(f"{what}: static FP8 scales are per 'tensor' or per 'head', got {granularity!r}")
    h = scale.numel()
    if h == 1 and n_heads is not None:  # one number for every head (the uncalibrated 1.0)
        if n_heads == 1 and scale.dim() == 4:
            return scale  # already (1, 1, 1, 1): the same tensor, not a copy per flush
        return scale.reshape(1, 1, 1, 1).expand(1, n_heads, 1, 1).clone()
    shapes = {(h,), (h, 1, 1), (1, h, 1, 1)}
    if tuple(scale.shape) not in shapes or (n_heads is not None and h != n_heads):
        want = "H_kv" if n_heads is None else n_heads
        raise ValueError(
            f"{what}: a per-head FP8 scale must be ({want},), ({want}, 1, 1) or (1, {want}, 1, 1), "
            f"got shape {tuple(scale.shape)}"
        )
    return scale if scale.dim() == 4 else scale.reshape(1, h, 1, 1)  # the same tensor when it already fits
