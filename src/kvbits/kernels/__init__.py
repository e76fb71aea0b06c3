"""Decode-attention kernels over the packed KV cache.

``reference`` (pure torch: the layout, ``pack_store`` and the reference attention), ``triton_decode``
(fused Triton split-K kernels, imported lazily), ``dispatch`` (picks one); ``triton_quantize`` (the
quantize-and-pack kernel of the cache's flushes) and ``quantize`` (picks it or ``kvbits.quant.quantize``).
Importing this package never imports Triton.
"""

from kvbits.kernels.dispatch import decode_attention, resolve_kernel, triton_available
from kvbits.kernels.quantize import quantize_pack
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
    "quantize_pack",
    "resolve_kernel",
    "triton_available",
]
