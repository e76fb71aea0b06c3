"""Hand calibrated parameters to serving engines: ``export_vllm`` writes FP8 KV-cache scales in the
format vLLM loads (see :mod:`kvbits.export.vllm`); ``vllm_cache_args`` gives vLLM's KV-cache settings for a
scheme it stores as kvbits measured it (:mod:`kvbits.export.vllm_flags`)."""

from kvbits.export.vllm import KV_CACHE_SCHEME, export_vllm, kv_cache_scheme, quantization_config, vllm_scales
from kvbits.export.vllm_flags import VllmCacheArgs, vllm_cache_args

__all__ = [
    "KV_CACHE_SCHEME", "VllmCacheArgs", "export_vllm", "kv_cache_scheme", "quantization_config", "vllm_cache_args",
    "vllm_scales",
]  # fmt: skip
