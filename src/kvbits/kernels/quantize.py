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
from kvbits.quant.tensor import QuantizedTensor, quantize
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
    if mode == "triton":  # forced: unsupported formats still quantize, through the reference (logged)
        logger.info("quantize-and-pack: %s; the torch reference quantizes it", reason)
    return "reference"


def quantize_pack(
    x: torch.Tensor,
    spec: TensorSpec,
    *,
    static_scale: torch.Tensor | None = None,
    static_zero: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    validate: bool = True,
    sync: bool = True,
) -> QuantizedTensor:
    """``kvbits.quant.quantize`` with the same arguments, through the Triton kernel where it applies.

    ``validate`` is the reference's input check (finite values, float16 range); the kernel path runs the
    same check when asked (the cache checks K/V itself, eagerly or lazily, and passes ``False``).
    """
    if resolve_quantize_kernel(x, spec) == "triton":
        if validate:
            from kvbits.quant.checks import check_kv

            check_kv(x, "K/V block")
        from kvbits.kernels.triton_quantize import quantize_pack_triton

        return quantize_pack_triton(
            x, spec, static_scale=static_scale, static_zero=static_zero, codebook=codebook, sync=sync
        )
    kw = {"codebook": codebook} if codebook is not None else {}
    return quantize(
        x, spec, static_scale=static_scale, static_zero=static_zero, validate=validate, sync=sync, **kw
    )
