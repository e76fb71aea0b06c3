"""Plan: KV-cache memory and concurrency from a model config, before loading any weights.

``plan(config, context=32768, batch=8, scheme=["fp16", "kivi-2"], gpu_mem_gib=80)`` sums the exact
bytes of :func:`kvbits.schemes.layer_bytes` over the model's layers (MHA, GQA, MQA, sliding-window
and mixed layers). See :mod:`kvbits.plan.planner` for every field's definition; with a GPU budget,
:func:`max_context` (:mod:`kvbits.plan.limits`) adds the longest context the batch can grow to.
"""

import sys as _sys
import types as _types

from kvbits.plan.config import (
    LayerShape,
    ModelShape,
    estimate_params,
    load_shape,
    model_shape,
    resolve_config,
)
from kvbits.plan.limits import max_context
from kvbits.plan.planner import DEFAULT_SCHEMES, GIB, long_run_bits, plan, plan_shape

__all__ = [
    "DEFAULT_SCHEMES",
    "GIB",
    "LayerShape",
    "ModelShape",
    "estimate_params",
    "load_shape",
    "long_run_bits",
    "max_context",
    "model_shape",
    "plan",
    "plan_shape",
    "resolve_config",
]


class _CallablePlanModule(_types.ModuleType):
    """``kvbits.plan`` is both this package and the function: importing the package (which Python
    binds as the attribute ``kvbits.plan``) must not stop ``kvbits.plan(config, ...)`` working."""

    def __call__(self, *args, **kwargs):  # same signature as plan()
        return plan(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallablePlanModule
