"""``run_eagerly``: kvbits functions that a compiled model calls but never traces (``torch.compiler.disable``).

``QuantizedKVCache.update`` and the ``kvbits_fused`` attention function keep host state (lengths, flush points, the
fused path's tagged placeholders) and quantize exactly as in eager mode, so ``torch.compile`` breaks the model's
graph around them (BENCHMARKS.md §6, session 47). ``fullgraph=True`` cannot break it and raises; the reason given
here is what that error shows (torch 2.7 and later; earlier torch takes no reason and says less).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["EAGER_REASON", "run_eagerly"]

F = TypeVar("F", bound=Callable)

EAGER_REASON = (
    "kvbits runs its cache's update and fused decode attention eagerly inside a compiled model (host-side state, "
    "quantization exactly as in eager mode): compile the model without fullgraph=True, which graph-breaks there"
)


def run_eagerly(fn: F) -> F:
    """``fn`` wrapped in ``torch.compiler.disable`` with ``EAGER_REASON`` (without it on torch that takes none)."""
    try:
        return torch.compiler.disable(fn, reason=EAGER_REASON)
    except TypeError:  # torch before 2.7: no reason argument
        return torch.compiler.disable(fn)
