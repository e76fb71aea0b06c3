"""Decode-attention kernels over the packed KV cache.

``reference`` (pure torch: the layout, ``pack_store`` and the reference attention), ``triton_decode``
(fused Triton split-K kernels, imported lazily), ``dispatch`` (picks one). Importing this package
never imports Triton.
"""

from kvbits.kernels.dispatch import decode_attention, resolve_kernel, triton_available
from kvbits.kernels.reference import (
    PackedStore,
    PackedTensor,
    decode_attention_reference,
    dequantize_packed,
    pack_store,
)

__all__ = [
    "PackedStore",
    "PackedTensor",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_packed",
    "pack_store",
    "resolve_kernel",
    "triton_available",
]
