"""The keyword a transformers model takes its cache by: ``cache`` from 5.24, ``past_key_values`` before.

transformers 5.24 renamed ``past_key_values=`` to ``cache=`` in every model's ``forward`` (and so in ``generate``);
the old name warns there and goes in 5.40. kvbits supports 5.17 (the GPU image) to the newest 5.x, so callers
pass the cache through ``cache_kwargs(cache, model)``::

    out = model(ids, use_cache=True, **cache_kwargs(cache, model))
    out = model.generate(**inputs, max_new_tokens=32, **cache_kwargs(cache, model))
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwarg", "cache_kwargs"]


def cache_kwarg(model: Any) -> str:
    """``"cache"`` when ``model.forward`` takes ``cache`` (transformers >= 5.24), else ``"past_key_values"``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache: Any, model: Any) -> dict[str, Any]:
    """``{cache_kwarg(model): cache}``, to splat into ``model(...)`` or ``model.generate(...)``."""
    return {cache_kwarg(model): cache}
