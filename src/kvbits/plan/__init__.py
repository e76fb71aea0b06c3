"""Plan: KV-cache memory and concurrency from a model config, before loading any weights.

``plan(config, context=32768, batch=8, scheme=["fp16", "kivi-2"], gpu_mem_gib=80)`` sums the exact
bytes of :func:`kvbits.schemes.layer_bytes` over the model's layers (MHA, GQA, MQA, sliding-window
and mixed layers). See :mod:`kvbits.plan.planner` for every field's definition.
"""

from kvbits.plan.config import (
    LayerShape,
    ModelShape,
    estimate_params,
    load_shape,
    model_shape,
    resolve_config,
)
from kvbits.plan.planner import DEFAULT_SCHEMES, GIB, plan, plan_shape

__all__ = [
    "DEFAULT_SCHEMES",
    "GIB",
    "LayerShape",
    "ModelShape",
    "estimate_params",
    "load_shape",
    "model_shape",
    "plan",
    "plan_shape",
    "resolve_config",
]
