"""Dense-and-sparse outliers (KVQuant §3.5): the ``k`` largest-magnitude entries of each row are
kept in float16 in a sparse side store and excluded from the quantization range.

float16, not the input dtype: exact for float16 K/V, rounded to float16 otherwise (float32 or bfloat16 K/V,
and rotated or centred / smoothed specs, whose coded basis is float32: 1000.3 is kept as 1000.5), which is
what ``kvbits.schemes.accounting`` counts (2 bytes a value)."""

from __future__ import annotations

import torch

from kvbits.quant.affine import META_DTYPE


def gather_outliers(
    x: torch.Tensor, k: int, score: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` entries per row of ``x`` ``(..., D)`` by ``score`` (like ``x``; default ``|x|``).

    Under static per-channel scales the score is the deviation from the channel's calibrated range
    centre in units of that range, so an entry large only for a wide channel is not an outlier.

    Returns ``(values float16 (..., k), index (..., k) uint8|int16, mask bool like x)``.
    """
    D = x.shape[-1]
    if not 0 < k < D:
        raise ValueError(f"outlier count must be in (0, {D}), got {k}")
    if score is not None and score.shape != x.shape:
        raise ValueError(f"outlier score must have the shape of x {tuple(x.shape)}, got {tuple(score.shape)}")
    idx = (x.abs() if score is None else score).topk(k, dim=-1).indices
    vals = torch.gather(x, -1, idx).to(META_DTYPE)
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    idx_dtype = torch.uint8 if D <= 256 else torch.int16
    return vals, idx.to(idx_dtype), mask


def scatter_outliers(dense: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Write the sparse values back into ``dense`` ``(..., D)`` (returns a new tensor)."""
    return dense.scatter(-1, index.long(), values.to(dense.dtype))
