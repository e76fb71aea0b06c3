"""kvbits: quantize the KV cache of long-context language models, and prove it.

Stages, one folder each: ``schemes`` (what), ``quant`` (primitives), ``cache`` (drop-in transformers
cache), ``plan`` (memory), ``analyze``, ``calibrate``, ``tune`` (per-layer mixes), ``evaluate``, ``report``,
``monitor``, ``export`` (serving engines), ``kernels``.
Heavy dependencies (transformers, triton, matplotlib) are imported lazily.
"""

from kvbits.schemes import KVScheme, TensorSpec, get_scheme, list_schemes

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy re-exports keep `import kvbits` fast
    if name == "QuantizedKVCache":
        from kvbits.cache import QuantizedKVCache

        return QuantizedKVCache
    if name == "plan":
        import kvbits.plan as plan_module  # a callable module: kvbits.plan(config, ...) runs plan()

        return plan_module
    raise AttributeError(f"module 'kvbits' has no attribute {name!r}")


__all__ = ["KVScheme", "QuantizedKVCache", "TensorSpec", "__version__", "get_scheme", "list_schemes", "plan"]
