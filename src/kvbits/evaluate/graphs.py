"""Decode steps replayed from one captured CUDA graph (``kvbits speed --graphs``, the device run's step 6).

A decode step of a cache whose step replays (``kvbits.cache.StaticQuantizedKVCache``, transformers' ``StaticCache``)
is recorded once and replayed for every later token: the token and its position are copied into the recorded
input tensors, then the recorded kernels run again on the same addresses, with no Python, no kvbits launch code and
no transformers code in between. That takes the host out of the step (BENCHMARKS.md §6z: the fused eager steps spent
4.8-9.5 ms on the GPU of 50-90 ms of wall time).

``GraphedDecode`` stands where a decode loop calls the model, with the same arguments. Its first ``eager`` calls run
the model as it is (Triton compiles its kernels, cuBLAS makes its handles, the fused path claims its layers: nothing
of that may happen inside a capture); the next call is captured, and every later one replays. How a step is
captured depends on the device (``CAPTURES``): on CUDA a ``torch.cuda.CUDAGraph``. Nothing is registered for other
devices; ``benchmarks/graph_replay.py``'s CPU emulation registers itself in tests and the benchmarks' CPU smoke runs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["CAPTURES", "GraphedDecode", "capture_cuda_graph", "graph_reason"]

Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]


def capture_cuda_graph(step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """Capture ``step()`` (one decode step, returning its logits) as a CUDA graph; return the captured logits tensor
    and the replay. A capture records kernels without running them, so the graph is replayed once here: the logits
    hold this step's result on return."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        logits = step()
    graph.replay()
    return logits, graph.replay


CAPTURES: dict[str, Capture] = {"cuda": capture_cuda_graph}  # device type -> capture


def graph_reason(device: torch.device) -> str | None:
    """Why decode steps on ``device`` can not be replayed from a captured graph (``None``: they can)."""
    if device.type not in CAPTURES:
        return f"CUDA graphs need a CUDA device; the model is on {device.type}"
    return None


class GraphedDecode:
    """Decode steps of ``model`` through one captured step (module docstring).

    Called as ``graphed(tok (B, 1), cache_position=(1,) int64, **model_kwargs)`` (the cache among the keyword
    arguments, the same at every call); returns an object whose ``logits`` ``(B, 1, V)`` are the captured output,
    overwritten by the next call (read it before calling again). Every sequence of the batch is at the same
    position (``position_ids`` is ``cache_position`` for all of them: no left padding).

    Args:
        model: a causal LM.
        eager: calls run as they are before the capture (at least 1: the first decode step sets the caches up).
        capture: how a step is captured (default: ``CAPTURES`` for the device of the first captured token).
    """

    def __init__(self, model: Any, eager: int = 2, capture: Capture | None = None) -> None:
        if isinstance(eager, bool) or not isinstance(eager, int) or eager < 1:
            raise ValueError(f"eager must be an int >= 1 (the first decode step sets the caches up), got {eager!r}")
        self.model, self.eager, self.calls = model, eager, 0
        self.capture = capture
        self.token: torch.Tensor | None = None
        self.position: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self._replay: Callable[[], None] | None = None

    @property
    def captured(self) -> bool:
        """Whether the step is captured (later calls replay it)."""
        return self._replay is not None

    def _forward(self, tok: torch.Tensor, position: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        return self.model(tok, cache_position=position, position_ids=position[None], **kwargs)

    def __call__(self, tok: torch.Tensor, *, cache_position: torch.Tensor, **kwargs: Any) -> Any:
        if tok.dim() != 2 or tok.shape[1] != 1 or cache_position.shape != (1,):
            raise ValueError(f"a decode step takes tokens (B, 1) and cache_position (1,), got {tuple(tok.shape)} and "
                             f"{tuple(cache_position.shape)}")  # fmt: skip
        self.calls += 1
        if self.calls <= self.eager:
            return self._forward(tok, cache_position, kwargs)
        if self._replay is None:
            capture = self.capture
            if capture is None:
                why = graph_reason(tok.device)
                if why is not None:
                    raise RuntimeError(why)
                capture = CAPTURES[tok.device.type]
            self.token, self.position = tok.clone(), cache_position.clone()
            self.logits, self._replay = capture(lambda: self._forward(self.token, self.position, kwargs).logits)
            return SimpleNamespace(logits=self.logits)
        if tok.shape != self.token.shape:
            raise ValueError(f"the captured step decodes tokens of shape {tuple(self.token.shape)}, got "
                             f"{tuple(tok.shape)}")  # fmt: skip
        self.token.copy_(tok)
        self.position.copy_(cache_position)
        self._replay()
        return SimpleNamespace(logits=self.logits)
