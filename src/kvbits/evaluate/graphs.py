"""Decode steps replayed from captured CUDA graphs (``kvbits speed --graphs``, the device run's step 6).

A decode step of a cache whose step replays (``kvbits.cache.StaticQuantizedKVCache``, transformers' ``StaticCache``)
is recorded once and replayed for every later token: the token and its position are copied into the recorded
input tensors, then the recorded kernels run again on the same addresses, with no Python, no kvbits launch code and
no transformers code in between. That takes the host out of the step (BENCHMARKS.md §6z: the fused eager steps spent
4.8-9.5 ms on the GPU of 50-90 ms of wall time).

``GraphedDecode`` stands where a decode loop calls the model, with the same arguments. Its first ``eager`` calls run
the model as it is (Triton compiles its kernels, cuBLAS makes its handles, the fused path claims its layers: nothing
of that may happen inside a capture); the next call is captured, and every later one replays. How a step is
captured depends on the device (``CAPTURES``): on CUDA a ``torch.cuda.CUDAGraph``, captured and replayed on the
tokens' device (which need not be the current one). Nothing is registered for other
devices; ``benchmarks/graph_replay.py``'s CPU emulation registers itself in tests and the benchmarks' CPU smoke runs.

Steps that differ: a ``StaticQuantizedKVCache`` with a flush window quantizes a block only at the steps that flush
(one in ``block``), which its host counts decide (``step_variant``). ``GraphedDecode`` keeps one captured step per
variant (the plain step and the flushing one), replays the one the cache's counts call for, and counts each replay on
the cache's host (``count_replayed_step``: so the counts stay the device's, and a step past ``max_cache_len`` is
refused; a capture that fails counts nothing, having run nothing on the device). A variant is captured the second time
it comes, after one eager run (its kernels compiled outside the capture). A step captured without this bookkeeping (a plain ``torch.cuda.graph``) makes the cache quantize the block
at every step, which replays right across flushes; a ``GraphedDecode`` whose cache has had such a step since its
capture refuses to replay (its variants no longer match the cache's steps). A per-token scheme's sink steps are a
variant of their own likewise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from kvbits.cache.cache import _holds_state

__all__ = ["CAPTURES", "GraphedDecode", "capture_cuda_graph", "graph_reason", "state_reason"]

Capture = Callable[[Callable[[], torch.Tensor], torch.device], tuple[torch.Tensor, Callable[[], None]]]


def capture_cuda_graph(step: Callable[[], torch.Tensor], device: torch.device | None = None,
                       ) -> tuple[torch.Tensor, Callable[[], None]]:  # fmt: skip
    """Capture ``step()`` (one decode step, returning its logits) as a CUDA graph; return the captured logits tensor
    and the replay. A capture records kernels without running them, so the graph is replayed once here: the logits
    hold this step's result on return.

    ``device``: the step's (its tokens', the model's; default: the current CUDA device). The synchronize, the capture
    (on a stream of ``device``) and every replay run under ``torch.cuda.device(device)``: a model on ``cuda:1`` while
    ``cuda:0`` is current launches its kernels on ``cuda:1``'s capturing stream, not outside the capture."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(device):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)
        # a stream of this device: torch.cuda.graph's default one is made once, on the device current at its first use
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            logits = step()
        graph.replay()

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return logits, replay


CAPTURES: dict[str, Capture] = {"cuda": capture_cuda_graph}  # device type -> capture


def graph_reason(device: torch.device) -> str | None:
    """Why decode steps on ``device`` can not be replayed from a captured graph (``None``: they can)."""
    if device.type not in CAPTURES:
        return f"CUDA graphs need a CUDA device; the model is on {device.type}"
    return None


def state_reason(cache: Any, holder: str | None = None) -> str | None:
    """Why a decode step of ``cache`` is not captured (``None``: nothing here refuses it): a hybrid model's
    convolution / linear-attention / Mamba states (its ``LinearAttentionLayer`` and hybrid layers, held by
    ``StaticQuantizedKVCache`` and ``StaticCache``). Their in-place updates keep their addresses, but a captured replay
    of them (and of the model's state kernels, or their PyTorch fallbacks) has not been checked against eager decoding
    on a GPU, so it is refused rather than served unverified. ``holder``: what the message says holds the layers
    (default: ``cache``'s class; ``speed_eval`` probes a throwaway ``StaticCache`` and names the model instead)."""
    held = [i for i, layer in enumerate(getattr(cache, "layers", None) or []) if _holds_state(layer)]
    if not held:
        return None
    return (f"layers {held} of {holder or type(cache).__name__} keep convolution / linear-attention / Mamba states (a hybrid "
            "model): replaying their updates from a captured CUDA graph is not verified; decode them eagerly "
            "(graphs=False, kvbits speed --static without --graphs)")  # fmt: skip


class GraphedDecode:
    """Decode steps of ``model`` through one captured step (module docstring).

    Called as ``graphed(tok (B, 1), cache_position=(1,) int64, **model_kwargs)`` (the cache among the keyword
    arguments, the same at every call: another cache is refused once a step is captured; the other keyword arguments
    are the captured call's from then on); returns an object whose ``logits`` ``(B, 1, V)`` are the captured output,
    overwritten by the next call (read it before calling again). Without ``position_ids`` every sequence is at
    ``cache_position``. A left-padded batch passes its ``position_ids`` ``(B, 1)`` and its ``attention_mask`` ``(B, L)``
    (``L`` cache positions so far, as ``generate`` grows it) at every call: the captured step reads them from tensors of
    its own, the mask one of the cache's full length (``max_cache_len``; positions not written yet are hidden by the
    causal mask), into which each call copies the caller's before the replay. Under a CUDA capture transformers builds
    the mask without reading it back (``is_cuda_stream_capturing``), so the captured step holds no host read.

    Args:
        model: a causal LM.
        eager: calls run as they are before the capture (at least 1: the first decode step sets the caches up).
        capture: how a step is captured, called as ``capture(step, device)`` with the tokens' device (default:
            ``CAPTURES`` for that device's type).

    Attributes:
        calls, replays: calls so far, and those replayed; ``captured_at``: the call (1-based) at which each variant
            (module docstring) was captured; the other calls ran eagerly.
    """

    def __init__(self, model: Any, eager: int = 2, capture: Capture | None = None) -> None:
        if isinstance(eager, bool) or not isinstance(eager, int) or eager < 1:
            raise ValueError(f"eager must be an int >= 1 (the first decode step sets the caches up), got {eager!r}")
        self.model, self.eager, self.calls, self.replays = model, eager, 0, 0
        self.capture = capture
        self.token: torch.Tensor | None = None
        self.position: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None  # (B, 1), when the caller passes them
        self.mask: torch.Tensor | None = None  # (B, max_cache_len), when the caller passes a padding mask
        self.logits: torch.Tensor | None = None  # the last replayed or captured step's
        self.captured_at: dict[Any, int] = {}
        self._graphs: dict[Any, tuple[torch.Tensor, Callable[[], None]]] = {}  # variant -> (logits, replay)
        self._seen: set[Any] = set()  # variants run eagerly
        self._counted = False  # captured while the cache's host counts held

    @property
    def captured(self) -> bool:
        """Whether a step is captured (later calls of its variant replay it)."""
        return bool(self._graphs)

    def _forward(self, tok: torch.Tensor, position: torch.Tensor, kwargs: dict[str, Any],
                 position_ids: torch.Tensor | None = None) -> Any:  # fmt: skip
        return self.model(tok, cache_position=position, position_ids=position[None] if position_ids is None else position_ids,
                          **kwargs)  # fmt: skip

    def __call__(
        self, tok: torch.Tensor, *, cache_position: torch.Tensor, position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        if tok.dim() != 2 or tok.shape[1] != 1 or cache_position.shape != (1,):
            raise ValueError(f"a decode step takes tokens (B, 1) and cache_position (1,), got {tuple(tok.shape)} and "
                             f"{tuple(cache_position.shape)}")  # fmt: skip
        B = tok.shape[0]
        if position_ids is not None and tuple(position_ids.shape) != (B, 1):
            raise ValueError(f"position_ids must be (B, 1) = ({B}, 1), got {tuple(position_ids.shape)}")
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B):
            raise ValueError(f"attention_mask must be (B, L) with B = {B} (a 2-D padding mask), got "
                             f"{tuple(attention_mask.shape)}")  # fmt: skip
        cache = _cache_of(kwargs)
        variant = cache.step_variant() if hasattr(cache, "step_variant") else None
        self.calls += 1
        try:  # a refused or failed call is not counted
            return self._step(tok, cache_position, position_ids, attention_mask, kwargs, cache, variant)
        except BaseException:
            self.calls -= 1
            raise

    def _step(
        self, tok: torch.Tensor, cache_position: torch.Tensor, position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None, kwargs: dict[str, Any], cache: Any, variant: Any,
    ) -> Any:  # fmt: skip
        """This call's step: eager, captured or replayed (``__call__`` has counted it)."""
        if self.calls <= self.eager or (variant not in self._graphs and variant not in self._seen):
            mask = {} if attention_mask is None else {"attention_mask": attention_mask}
            out = self._forward(tok, cache_position, {**kwargs, **mask}, position_ids)
            self._seen.add(variant)  # a variant's first step runs eagerly: its kernels compile outside a capture
            return out
        if not self._graphs:
            return self._capture(tok, cache_position, position_ids, attention_mask, kwargs, variant, cache)
        if tok.shape != self.token.shape or (attention_mask is None) != (self.mask is None) or (
            (position_ids is None) != (self.position_ids is None)
        ):  # fmt: skip
            raise ValueError(
                f"the captured step decodes tokens {tuple(self.token.shape)}, "
                f"{'with' if self.mask is not None else 'without'} an attention mask and "
                f"{'with' if self.position_ids is not None else 'without'} position_ids; got {tuple(tok.shape)}, "
                f"{'with' if attention_mask is not None else 'without'} and "
                f"{'with' if position_ids is not None else 'without'}"
            )
        if cache is not _cache_of(self._kwargs):  # the captured step writes the slabs it was captured on
            raise ValueError(
                f"the captured step writes the cache it was captured with ({type(_cache_of(self._kwargs)).__name__} at "
                f"{id(_cache_of(self._kwargs)):#x}), got another ({type(cache).__name__} at {id(cache):#x}); reset() "
                "that one for a new request, or make a new GraphedDecode for this cache"
            )
        if attention_mask is not None:  # refused before anything is counted or replayed
            self._copy_mask(attention_mask)
        self.token.copy_(tok)
        self.position.copy_(cache_position)
        if position_ids is not None:
            self.position_ids.copy_(position_ids)
        if variant not in self._graphs:
            return self._capture_variant(variant, cache)
        if hasattr(cache, "count_replayed_step"):  # past max_cache_len it refuses: nothing replayed
            if self._counted and not _host_counted(cache):
                raise RuntimeError(
                    "the cache's host counts are off since this step was captured (a step of it was traced by "
                    "torch.compile or captured as a plain CUDA graph): its captured variants no longer say which step "
                    "comes next; make a new GraphedDecode and cache"
                )
            cache.count_replayed_step()
        self.logits, replay = self._graphs[variant]
        replay()
        self.replays += 1
        return SimpleNamespace(logits=self.logits)

    def _capture(
        self, tok: torch.Tensor, cache_position: torch.Tensor, position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None, kwargs: dict[str, Any], variant: Any, cache: Any,
    ) -> Any:  # fmt: skip
        """The first capture: the step's input tensors (the token, its position, position ids, the padding mask) are
        made here, and every captured variant reads them. ``ValueError`` for a cache holding a hybrid model's states
        (``state_reason``), before anything is captured."""
        if (why := state_reason(cache)) is not None:
            raise ValueError(f"GraphedDecode: {why}")
        self.token, self.position = tok.clone(), cache_position.clone()
        self.position_ids = None if position_ids is None else position_ids.clone()
        self.mask = None  # not a failed earlier capture's: a step captured without a mask must refuse one
        if attention_mask is not None:  # the cache's full length: the captured step's mask never changes shape
            size = _cache_length(kwargs)
            self.mask = torch.ones((tok.shape[0], size), dtype=attention_mask.dtype, device=attention_mask.device)
            self._copy_mask(attention_mask)
            kwargs = {**kwargs, "attention_mask": self.mask}
        self._kwargs = kwargs
        self._counted = _host_counted(cache)  # the variants are told apart by the host's counts
        return self._capture_variant(variant, cache)

    def _capture_variant(self, variant: Any, cache: Any) -> Any:
        """Capture this call's step (its inputs already in the step's tensors) as ``variant``'s."""
        capture = self.capture
        if capture is None:
            why = graph_reason(self.token.device)
            if why is not None:
                raise RuntimeError(why)
            capture = CAPTURES[self.token.device.type]
        layers = [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "host_state")]
        counts = [layer.host_state() for layer in layers]
        try:
            with _bookkeeping(cache):
                self.logits, replay = capture(
                    lambda: self._forward(self.token, self.position, self._kwargs, self.position_ids).logits,
                    self.token.device,
                )
        except BaseException:  # a capture runs nothing on the device: the step the layers passed is not counted
            for layer, state in zip(layers, counts):
                layer.restore_host_state(state)
            raise
        self._graphs[variant] = (self.logits, replay)
        self.captured_at[variant] = self.calls
        return SimpleNamespace(logits=self.logits)

    def _copy_mask(self, attention_mask: torch.Tensor) -> None:
        L = attention_mask.shape[1]
        if L > self.mask.shape[1]:
            raise ValueError(f"attention_mask covers {L} positions, past the cache's {self.mask.shape[1]} slots")
        self.mask[:, :L].copy_(attention_mask)


def _cache_of(kwargs: dict[str, Any]) -> Any:
    """The cache among a step's keyword arguments (``None`` if none)."""
    return kwargs.get("past_key_values", kwargs.get("cache"))


@contextlib.contextmanager
def _bookkeeping(cache: Any) -> Iterator[None]:
    """While a step is captured, the cache's layers know that its replays will be counted (``count_replayed_step``),
    so they keep their host counts and capture the step their counts call for."""
    layers = [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "graph_bookkeeping")]
    for layer in layers:
        layer.graph_bookkeeping = True
    try:
        yield
    finally:
        for layer in layers:
            layer.graph_bookkeeping = False


def _host_counted(cache: Any) -> bool:
    """Whether every layer of ``cache`` that keeps host counts (``StaticQuantizedKVCache``'s) still has them."""
    return any(hasattr(layer, "host_counts") for layer in getattr(cache, "layers", [])) and all(
        getattr(layer, "host_counts", True) for layer in cache.layers
    )


def _cache_length(kwargs: dict[str, Any]) -> int:
    """The slots per sequence of the cache among a step's keyword arguments (a static cache: ``max_cache_len``)."""
    cache = _cache_of(kwargs)
    for name in ("max_cache_len", "get_max_cache_shape"):
        value = getattr(cache, name, None)
        value = value() if callable(value) else value
        if isinstance(value, int) and value > 0:
            return value
    sizes = [getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", [])]  # transformers 5.25's
    if sizes and all(isinstance(n, int) and n > 0 for n in sizes):
        return max(sizes)
    raise ValueError(
        "a captured step with an attention mask needs a cache of fixed length among its arguments (past_key_values= "
        f"a StaticCache or StaticQuantizedKVCache), got {type(cache).__name__}"
    )
