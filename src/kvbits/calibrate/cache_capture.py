"""K/V read where the cache receives them, for an attention block several layers share (Zamba, Zamba2).

Zamba's and Zamba2's ``hybrid`` layers call one attention block (:func:`kvbits._model.shared_attention`), each passing
its own index to ``cache.update(k, v, layer_idx)``. A hook on the block's ``k_proj`` (:mod:`kvbits.analyze.taps`) can
not tell those calls apart, and Zamba2 adds a per-layer LoRA adapter to ``k_proj``'s / ``v_proj``'s output (and
rotates its keys with ``use_mem_rope``) before the cache sees them. :class:`CacheKVCapture` hands the model a
``DynamicCache`` whose ``update`` keeps each layer's ``(k, v)`` as given: the tensors ``QuantizedKVCache`` stores for
that layer, by construction (no probe like :func:`kvbits.analyze.verify.verify_taps` is needed).

Keys come back *pre-RoPE* as :class:`~kvbits.calibrate.observers.KVCapture` gives them: un-rotated by the cache's own
:func:`kvbits.cache.store.rope_at` (``inverse=True``, positions ``0 .. T-1`` of the window) with the layer's tables,
in the dtype the model ran in, which is how ``QuantizedKVCache`` brings a pre-RoPE key spec's keys into its frame
before it quantizes them. A layer without tables (a model without RoPE: Zamba) keeps the keys as cached. Key
gradients are un-rotated alike (a rotation's adjoint is its inverse; with a RoPE attention factor ``s != 1`` they
are off by ``s**2`` everywhere, which leaves the Fisher-weighted k-means unchanged), by the same tables in the
model's dtype but in float32 arithmetic with a float32 result: un-rotated into bfloat16, a bfloat16 model's key
gradients took one more rounding (0.15 % per element, 0.5 % on a channel's summed squared gradient) on top of the
backward pass's own. A float32 model's are unchanged, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvbits._model import hybrid_layers, shared_attention
from kvbits.cache.compat import cache_kwarg
from kvbits.plan.config import layer_heads

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Self

__all__ = ["CacheKVCapture", "CacheSite", "shared_attention_sites"]


@dataclass(frozen=True)
class CacheSite:
    """One layer whose K/V are read at ``cache.update`` (:class:`CacheKVCapture`).

    Attributes:
        layer_idx: the layer's index in the model (its cache layer).
        num_kv_heads, head_dim: ``H_kv`` and ``D`` (``kvbits.plan.config.layer_heads``).
        name: qualified name of the shared attention module as this layer reaches it
            (``model.layers.2.shared_transf.self_attn``).
    """

    layer_idx: int
    num_kv_heads: int
    head_dim: int
    name: str


def shared_attention_sites(model: torch.nn.Module) -> list[CacheSite]:
    """One :class:`CacheSite` per ``hybrid`` layer of a model whose hybrid layers call a
    :func:`~kvbits._model.shared_attention` block (Zamba, Zamba2), ordered by layer; ``[]`` for any other model.

    Raises:
        ValueError: the model has a shared block but its config types no layer ``hybrid`` (the layers calling the
            block can not be told), or a hybrid layer reaches no shared block by name.
    """
    shared = shared_attention(model)
    if not shared:
        return []
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__}'s attention block {type(shared[0]).__name__} is shared by several layers, and "
            "its config's layer_types name no 'hybrid' layer: expected the layers that call it typed 'hybrid'"
        )
    names: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if not any(mod is s for s in shared):
            continue
        parts = name.split(".")
        for j in range(len(parts) - 1):
            if parts[j] == "layers" and parts[j + 1].isdigit():
                names.setdefault(int(parts[j + 1]), name)
                break
    missing = [i for i in layers if i not in names]
    if missing:
        raise ValueError(
            f"{type(model).__name__}'s hybrid layers {missing} reach no shared attention block named "
            "'...layers.<i>....' (expected each hybrid layer to hold the shared block, as Zamba's and Zamba2's do)"
        )
    config = model.config
    sites = []
    for i in layers:
        _, n_kv, head_dim = layer_heads(config, i)
        sites.append(CacheSite(i, n_kv, head_dim, names[i]))
    return sites


class _RecordingCache(DynamicCache):
    """``DynamicCache`` that shows every ``update``'s ``(key_states, value_states, layer_idx)`` to ``record`` first."""

    def __init__(self, record: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._record = record

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):  # type: ignore[override]
        self._record(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class CacheKVCapture:
    """Context manager: every forward of ``model`` inside it runs with a fresh recording ``DynamicCache``
    (``use_cache=True``, whatever the call asked), which keeps each site's latest ``(k, v)`` ``(B, H_kv, T, D)`` as
    the cache receives them. The interface of :class:`kvbits.calibrate.observers.KVCapture`.

    Args:
        model: a causal LM with a :func:`~kvbits._model.shared_attention` block.
        sites: :func:`shared_attention_sites` of ``model``.
        tables: per site, its ``RotaryTables`` (``tables_for_layer``) or None (keys not rotated: kept as cached);
            ``None`` as a whole: keys kept as cached.
        retain_grad: also keep the gradients of ``k`` / ``v`` after ``backward()`` (inside
            ``kvbits.calibrate.fisher.activation_gradients``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sites: list[CacheSite],
        tables: list[Any] | None = None,
        *,
        retain_grad: bool = False,
    ) -> None:
        self.model, self.sites, self.retain_grad = model, sites, retain_grad
        self._tables = {s.layer_idx: (None if tables is None else tables[j]) for j, s in enumerate(sites)}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handle: Any = None
        self._kwarg = cache_kwarg(model)

    def _record(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer_idx not in self._tables:
            return
        if self.retain_grad:
            for t in (k, v):
                if t.requires_grad:
                    t.retain_grad()
        self._outputs[layer_idx] = (k, v) if self.retain_grad else (k.detach(), v.detach())

    def _pre_forward(self, _m: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        kwargs.pop("past_key_values", None)
        kwargs[self._kwarg] = _RecordingCache(self._record, config=self.model.config)
        kwargs["use_cache"] = True
        return args, kwargs

    def __enter__(self) -> Self:
        self._handle = self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hook and drop captured tensors (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._outputs.clear()

    def reset(self) -> None:
        """Forget captured tensors (call between windows to free memory)."""
        self._outputs.clear()

    def _get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._outputs[layer]
        except KeyError:
            raise RuntimeError(
                f"no K/V captured for layer {layer}: run a forward pass inside the context (the layer must call "
                "cache.update with its index)"
            ) from None

    def _pre_rope(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``k`` ``(B, H_kv, T, D)`` at positions ``0 .. T-1`` un-rotated as the cache un-rotates it, float32."""
        from kvbits.cache.store import rope_at

        tables = self._tables[layer]
        if tables is not None and tables.rot_dim:
            k = rope_at(tables, k, 0, inverse=True)
        return k.float()

    def _pre_rope_grad(self, layer: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient ``g`` ``(B, H_kv, T, D)`` of the cached keys at positions ``0 .. T-1`` un-rotated by the tables
        in ``g``'s dtype (those the model rotated with), in float32 arithmetic, float32: not rounded back to
        ``g``'s dtype (for float32 ``g``: ``_pre_rope``'s result bit for bit)."""
        from kvbits.quant.rope import invert_rope

        tables = self._tables[layer]
        if tables is None or not tables.rot_dim:
            return g.float()
        tables._check_x(g)
        pos = torch.arange(g.shape[2], device=g.device)[None]
        cos, sin = tables.framed_cos_sin(pos, 0, g.dtype)  # as rope_at(tables, g, 0) takes them
        return invert_rope(g.float(), cos.to(g.device), sin.to(g.device))

    def activations(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K pre-RoPE, V)`` of ``layer`` from the last forward, each ``(B, H_kv, T, D)`` float32, detached."""
        k, v = self._get(layer)
        with torch.no_grad():
            return self._pre_rope(layer, k.detach()), v.detach().float()

    def gradients(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dL/dK pre-RoPE, dL/dV)`` of ``layer`` after ``backward()``, each ``(B, H_kv, T, D)`` float32."""
        out = []
        for t in self._get(layer):
            if t.grad is None:
                raise RuntimeError(
                    f"layer {layer}: no gradient; capture with retain_grad=True inside activation_gradients(model) "
                    "and call backward()"
                )
            out.append(t.grad)
        with torch.no_grad():
            return self._pre_rope_grad(layer, out[0]), out[1].float()
