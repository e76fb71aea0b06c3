"""Schemes: what to quantize and how (`TensorSpec`, `KVScheme`), presets, exact byte accounting."""

from kvbits.schemes.accounting import TokenSplit, average_bits, layer_bytes, token_split
from kvbits.schemes.presets import check_unique_names, get_scheme, list_schemes, mixed_scheme, register
from kvbits.schemes.spec import KVScheme, TensorSpec

__all__ = [
    "KVScheme",
    "TensorSpec",
    "TokenSplit",
    "average_bits",
    "check_unique_names",
    "get_scheme",
    "layer_bytes",
    "list_schemes",
    "mixed_scheme",
    "register",
    "token_split",
]
