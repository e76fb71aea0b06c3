"""Step 6's ``kvbits-static-graphs``: decode steps replayed from one captured step, kvbits' cache inside it.

``GraphedDecode`` stands where ``decode_run`` calls a compiled model (``step_model``): the same call, one decode
step. It is ``kvbits.evaluate.graphs.GraphedDecode`` (what ``kvbits speed --graphs`` replays): on CUDA the capture is
a ``torch.cuda.CUDAGraph``; elsewhere it is ``benchmarks/graph_replay.py``'s emulation (the recording runs the step),
so the CPU smoke run exercises the same calls. The cache must be one whose step replays: ``StaticQuantizedKVCache``
(``kvbits.cache.static``) or transformers' ``StaticCache``.
"""

from __future__ import annotations

from typing import Any

from kvbits.evaluate.graphs import GraphedDecode as _GraphedDecode


def GraphedDecode(model: Any, eager: int = 2) -> _GraphedDecode:
    """A ``kvbits.evaluate.graphs.GraphedDecode`` of ``model``, captured by the tape emulation off CUDA."""
    if next(model.parameters()).device.type == "cuda":
        return _GraphedDecode(model, eager)
    from graph_replay import tape_capture

    return _GraphedDecode(model, eager, capture=tape_capture)
