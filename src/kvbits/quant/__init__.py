"""Pure-torch quantization primitives: qparams, quantize/dequantize, bit packing, FP8, outliers."""

from kvbits.quant.affine import choose_qparams, dequantize_affine, quantize_affine
from kvbits.quant.pack import pack_bits, packed_size, unpack_bits
from kvbits.quant.tensor import QuantizedTensor, fake_quantize, quantize

__all__ = [
    "QuantizedTensor",
    "choose_qparams",
    "dequantize_affine",
    "fake_quantize",
    "pack_bits",
    "packed_size",
    "quantize",
    "quantize_affine",
    "unpack_bits",
]
