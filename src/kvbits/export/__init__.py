"""Hand calibrated parameters to serving engines: ``export_vllm`` writes FP8 KV-cache scales in the
format vLLM loads (see :mod:`kvbits.export.vllm`); ``vllm_cache_args`` gives vLLM's KV-cache settings for a
scheme it stores as kvbits measured it (:mod:`kvbits.export.vllm_flags`)."""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
    from kvbits.export.vllm import (
        KV_CACHE_SCHEME,
        export_vllm,
        kv_cache_scheme,
        quantization_config,
        vllm_scales,
    )
    from kvbits.export.vllm_flags import VllmCacheArgs, vllm_cache_args

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "KV_CACHE_SCHEME": "vllm",
        "export_vllm": "vllm",
        "kv_cache_scheme": "vllm",
        "quantization_config": "vllm",
        "vllm_scales": "vllm",
        "VllmCacheArgs": "vllm_flags",
        "vllm_cache_args": "vllm_flags",
    },
)

__all__ = [
    "KV_CACHE_SCHEME", "VllmCacheArgs", "export_vllm", "kv_cache_scheme", "quantization_config", "vllm_cache_args",
    "vllm_scales",
]  # fmt: skip
