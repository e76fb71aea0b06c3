"""Hand calibrated parameters to serving engines: ``export_vllm`` writes FP8 KV-cache scales in the
format vLLM loads (see :mod:`kvbits.export.vllm`)."""

from kvbits.export.vllm import KV_CACHE_SCHEME, export_vllm, kv_cache_scheme, quantization_config, vllm_scales

__all__ = ["KV_CACHE_SCHEME", "export_vllm", "kv_cache_scheme", "quantization_config", "vllm_scales"]
