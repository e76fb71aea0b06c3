"""Drop-in transformers cache with quantized K/V: `QuantizedKVCache` made of `QuantizedKVLayer`s."""

from kvbits.cache.cache import QuantizedKVCache, attention_shape
from kvbits.cache.layer import QuantizedKVLayer

__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "attention_shape"]
