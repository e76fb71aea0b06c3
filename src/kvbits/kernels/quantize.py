"""Quantize-and-pack on append: the Triton kernel on CUDA, ``kvbits.quant.quantize`` elsewhere.

Both return the same ``QuantizedTensor`` bit for bit (``kvbits.kernels.triton_quantize``), so the choice
changes speed, never results. ``KVBITS_KERNEL=reference|triton`` overrides the automatic choice, as for
decode attention (``kvbits.kernels.dispatch``); Triton is imported lazily.
"""

from __future__ import annotations

import logging

import torch

from kvbits.kernels import dispatch
from kvbits.kernels.dispatch import INSTALL_HINT, KERNEL_ENV, kernel_mode
from kvbits.quant.tensor import (
    QuantizedTensor,
    _count,
    check_block,
    check_unused_params,
    quantize,
    zero_scale_clipped,
)
from kvbits.schemes import TensorSpec

logger = logging.getLogger(__name__)

__all__ = ["quantize_pack", "resolve_quantize_kernel"]


def resolve_quantize_kernel(x: torch.Tensor, spec: TensorSpec) -> str:
    """``"triton"`` or ``"reference"``: what ``quantize_pack`` runs for ``x`` under ``spec``."""
    mode = kernel_mode()
    if mode == "reference" or (mode == "auto" and not x.is_cuda):
        return "reference"
    if not dispatch.triton_available():  # Triton imports (both kernel modules need only it)
        if mode == "triton":
            raise ImportError(f"{KERNEL_ENV}=triton but Triton is not importable; {INSTALL_HINT}")
        return "reference"
    if mode == "triton":
        dispatch.check_triton_device(x, "a K/V block")
    from kvbits.kernels.triton_quantize import supported

    reason = supported(x, spec)
    if reason is None:
        return "triton"
    if mode == "triton":  # forced: unsupported formats still quantize, through the reference (logged once)
        dispatch.log_fallback_once(logger, "quantize-and-pack", reason)
    return "reference"


def quantize_pack(
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
    zero_scales: bool = True,
    out: dict[str, torch.Tensor] | None = None,
) -> QuantizedTensor:
    """``kvbits.quant.quantize`` with the same arguments, through the Triton kernel where it applies.

    ``validate`` is the reference's input check (finite values, float16 range, static scale values); the
    kernel path runs the same check when asked (the cache checks K/V itself, eagerly or lazily, and its
    static scales once when installed, and passes ``False``).

    ``zero_scales``: static int/NUQ specs only: ``False`` promises the static scale has no zero entry (the
    cache knows from installing it), which spares the kernel path counting the values such a scale clips
    (``zero_scale_clipped``, a few kernels per flush: the Triton kernel counts only values beyond a
    range). The reference path counts them anyway.

    ``out``: tensors to write the codes and per-token or per-group ranges into where they can be written in place (a
    cache's reserved slots; ``quantize_pack_triton``'s ``out``). The Triton path takes them when their layout allows;
    the reference path never does. Either way the returned tensor's values are the same: check whether they landed
    there (``data_ptr``) before copying them in.
    """
    if resolve_quantize_kernel(x, spec) == "triton":
        check_unused_params(spec, static_scale, static_zero, codebook, channel_mean, channel_factor)
        if validate:
            check_block(x, spec, static_scale, static_zero)  # what the reference checks
        from kvbits.kernels.triton_quantize import quantize_pack_triton

        qt = quantize_pack_triton(
            x, spec, static_scale=static_scale, static_zero=static_zero, codebook=codebook, sync=sync, out=out
        )
        if zero_scales and spec.static and spec.kind in ("int", "nuq"):
            qt.clipped = qt.clipped + _count(_zero_scale_clips(x, qt), sync)
        return qt
    kw = {
        n: t for n, t in (("codebook", codebook), ("channel_mean", channel_mean), ("channel_factor", channel_factor))
        if t is not None
    }
    return quantize(
        x, spec, static_scale=static_scale, static_zero=static_zero, validate=validate, sync=sync, **kw
    )


def _zero_scale_clips(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """``zero_scale_clipped`` of ``x`` ``(B, H_kv, n, D)`` under the static per-channel ``qt.scale`` /
    ``qt.zero`` (``(1, H_kv, 1, D)``, the only static layout the kernel takes), outliers left out."""
    clipped = zero_scale_clipped(x, qt.scale, qt.zero)
    if qt.outlier_index is not None:  # stored apart (float16): never clipped
        clipped = clipped.scatter(-1, qt.outlier_index.long(), False)
    return clipped
