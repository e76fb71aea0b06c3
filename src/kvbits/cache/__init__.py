"""Drop-in transformers cache with quantized K/V: `QuantizedKVCache` made of `QuantizedKVLayer`s.

``use_fused_decode(model)`` routes the model's attention through ``kvbits_fused``, which serves decode
steps of a ``QuantizedKVCache`` from its packed store with the fused kernel (``kvbits.cache.attention``);
``observe_fused_decode(model, observer)`` also shows each fused step's kernel inputs to ``observer``.
``track_positions(model)`` hands the model's position ids to the cache where transformers does not
(pre-RoPE keys of left-padded batches on transformers 5.17; ``kvbits.cache.positions``).
``cache_kwargs(cache, model)`` passes a cache by the keyword the installed transformers takes (``cache=`` from
5.24, ``past_key_values=`` before; ``kvbits.cache.compat``).
"""

from kvbits.cache.attention import IMPLEMENTATION as FUSED_ATTENTION
from kvbits.cache.attention import (
    UnsupportedAttention,
    observe_fused_decode,
    register_fused_attention,
    use_fused_decode,
)
from kvbits.cache.cache import QuantizedKVCache, attention_shape
from kvbits.cache.compat import cache_kwarg, cache_kwargs
from kvbits.cache.layer import QuantizedKVLayer
from kvbits.cache.positions import track_positions
from kvbits.cache.static import StaticQuantizedKVCache, static_reason

__all__ = [
    "FUSED_ATTENTION",
    "QuantizedKVCache",
    "QuantizedKVLayer",
    "StaticQuantizedKVCache",
    "UnsupportedAttention",
    "attention_shape",
    "cache_kwarg",
    "cache_kwargs",
    "observe_fused_decode",
    "register_fused_attention",
    "static_reason",
    "track_positions",
    "use_fused_decode",
]
