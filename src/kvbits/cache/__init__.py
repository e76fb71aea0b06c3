"""Drop-in transformers cache with quantized K/V: `QuantizedKVCache` made of `QuantizedKVLayer`s.

``use_fused_decode(model)`` routes the model's attention through ``kvbits_fused``, which serves decode
steps of a ``QuantizedKVCache`` from its packed store with the fused kernel (``kvbits.cache.attention``).
"""

from kvbits.cache.attention import IMPLEMENTATION as FUSED_ATTENTION
from kvbits.cache.attention import register_fused_attention, use_fused_decode
from kvbits.cache.cache import QuantizedKVCache, attention_shape
from kvbits.cache.layer import QuantizedKVLayer

__all__ = [
    "FUSED_ATTENTION",
    "QuantizedKVCache",
    "QuantizedKVLayer",
    "attention_shape",
    "register_fused_attention",
    "use_fused_decode",
]
