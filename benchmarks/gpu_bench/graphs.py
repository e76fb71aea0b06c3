"""Step 6's ``kvbits-static-graphs``: decode steps replayed from one captured step, kvbits' cache inside it.

``GraphedDecode`` stands where ``decode_run`` calls a compiled model (``step_model``): the same call, one decode
step. Its first ``eager`` calls run the model as it is (Triton compiles its kernels, cuBLAS makes its handles, the
fused path claims its layers: nothing of that may happen inside a capture). The next call is captured, and every
later one copies its token and position into the captured inputs and replays the capture. On CUDA the capture is a
``torch.cuda.CUDAGraph`` (a capture records kernels without running them, so it is replayed once at once); elsewhere
it is ``benchmarks/graph_replay.py``'s emulation (the recording runs the step), so the CPU smoke run exercises the
same calls. The cache must be one whose step replays: ``StaticQuantizedKVCache`` (``kvbits.cache.static``) or
transformers' ``StaticCache``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


class GraphedDecode:
    """Decode steps of ``model`` through one captured step (see the module docstring).

    Called as ``graphed(tok (B, 1), cache_position=(1,), **model_kwargs)``; returns an object whose ``logits`` are the
    captured output ``(B, 1, V)``, overwritten by the next call (read it before calling again)."""

    def __init__(self, model: Any, eager: int = 2) -> None:
        self.model, self.eager, self.calls = model, eager, 0
        self.token: torch.Tensor | None = None
        self.position: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self._replay: Any = None

    def _forward(self, tok: torch.Tensor, position: torch.Tensor, kwargs: dict) -> Any:
        return self.model(tok, cache_position=position, position_ids=position[None], **kwargs)

    def __call__(self, tok: torch.Tensor, *, cache_position: torch.Tensor, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.eager:
            return self._forward(tok, cache_position, kwargs)
        if self._replay is None:
            self.token, self.position = tok.clone(), cache_position.clone()
            self._capture(kwargs)
            return SimpleNamespace(logits=self.logits)
        self.token.copy_(tok)
        self.position.copy_(cache_position)
        self._replay()
        return SimpleNamespace(logits=self.logits)

    def _capture(self, kwargs: dict) -> None:
        if self.token.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.logits = self._forward(self.token, self.position, kwargs).logits
            self._replay = graph.replay
            graph.replay()  # the capture recorded the step without running it
            return
        from graph_replay import OpTape, replay, triton_on_tape

        tape = OpTape()
        with tape, triton_on_tape(tape):  # the recording runs the step
            self.logits = self._forward(self.token, self.position, kwargs).logits
        if tape.host_reads:
            raise RuntimeError(f"the captured decode step read {tape.host_reads} host values (a CUDA capture refuses them)")
        self._replay = lambda: replay(tape)
