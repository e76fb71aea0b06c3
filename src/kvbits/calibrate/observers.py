"""Where K/V come from in a transformers model, hooks that capture them, and per-channel statistics.

Keys are captured *before RoPE* (KVQuant §3.2): at the output of ``k_proj``, or of the key norm
for models that normalise keys before rotating them (``k_norm``: Qwen3, Gemma3, OLMo2;
``k_layernorm``: Phi, StableLM), since that is the tensor the cache stores. Values at ``v_proj``
(``v_norm`` when present). Which norms exist, how their inputs are laid out and the hooks that read
them are :mod:`kvbits.analyze.taps`, shared with ``kvbits analyze``. Capturing module outputs needs no forked modeling code and works for every
architecture whose attention has ``k_proj``/``v_proj`` submodules. Hooks are removed on exit, also
on error.

Statistics are computed from a bounded subsample of tokens per layer (the caller picks the same
positions for K, V and their gradients), so memory is ``layers x max_tokens x H_kv x D`` floats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvbits.analyze.taps import KVTap, capture_point
from kvbits.plan.config import attention_heads

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Self

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSite:
    """One attention layer's K/V capture points.

    Attributes:
        layer_idx: the layer's index in the model (its cache layer).
        key_module: module whose output is the pre-RoPE keys (the key norm if present, else ``k_proj``).
        value_module: module whose output is the values (``v_norm`` if present, else ``v_proj``).
        num_kv_heads, head_dim: ``H_kv`` and ``D``.
        name: qualified name of the attention module (for messages).
        key_proj, value_proj: the projection feeding ``key_module``/``value_module`` when that is a
            norm (its output tells the norm's input layout apart), else None.
    """

    layer_idx: int
    key_module: torch.nn.Module
    value_module: torch.nn.Module
    num_kv_heads: int
    head_dim: int
    name: str
    key_proj: torch.nn.Module | None = None
    value_proj: torch.nn.Module | None = None


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) transformers config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def config_head_dim(config: Any) -> int:
    cfg = text_config(config)
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def config_kv_heads(config: Any) -> int:
    """``H_kv`` as the planner and ``QuantizedKVCache`` count it (``kvbits.plan.config.attention_heads``):
    also ``num_kv_heads`` / ``multi_query`` (Falcon), so calibrated ``(H_kv, D)`` scales match the stored
    heads (Falcon's new architecture repeats its KV heads before caching; the cache stores them once)."""
    return attention_heads(text_config(config))[1]


def _out_features(module: torch.nn.Module) -> int | None:
    n = getattr(module, "out_features", None)
    return int(n) if n is not None else None


def find_kv_sites(model: torch.nn.Module) -> list[KVSite]:
    """Every attention layer's K/V capture points, ordered by layer index.

    Raises:
        ValueError: no attention module with ``k_proj`` and ``v_proj`` (e.g. GPT-2's fused ``c_attn``).
    """
    config = getattr(model, "config", None)
    sites: list[KVSite] = []
    for name, mod in model.named_modules():
        k_proj, v_proj = getattr(mod, "k_proj", None), getattr(mod, "v_proj", None)
        if not isinstance(k_proj, torch.nn.Module) or not isinstance(v_proj, torch.nn.Module):
            continue
        head_dim = getattr(mod, "head_dim", None)
        if head_dim is None:
            if config is None:
                raise ValueError(
                    f"{name}: can not tell the head dim (no head_dim attribute, no model.config)"
                )
            head_dim = config_head_dim(config)
        head_dim = int(head_dim)
        out = _out_features(k_proj)
        if out is not None:
            if out % head_dim:
                raise ValueError(f"{name}.k_proj has {out} outputs, not a multiple of head_dim {head_dim}")
            n_kv = out // head_dim
        elif config is not None:
            n_kv = config_kv_heads(config)
        else:
            raise ValueError(f"{name}: can not tell the number of KV heads")
        key_module, key_proj = capture_point(mod, "key")
        value_module, value_proj = capture_point(mod, "value")
        idx = getattr(mod, "layer_idx", None)
        sites.append(
            KVSite(
                layer_idx=int(idx) if idx is not None else len(sites),
                key_module=key_module,
                value_module=value_module,
                num_kv_heads=n_kv,
                head_dim=head_dim,
                name=name,
                key_proj=key_proj,
                value_proj=value_proj,
            )
        )
    if not sites:
        raise ValueError(
            f"{type(model).__name__}: found no attention module with k_proj and v_proj submodules; "
            "calibration supports Llama/Mistral/Qwen/Gemma-style attention (not fused QKV like GPT-2's c_attn)"
        )
    sites.sort(key=lambda s: s.layer_idx)
    if [s.layer_idx for s in sites] != list(range(len(sites))):
        raise ValueError(
            f"attention layer indices are not 0..{len(sites) - 1}: {[s.layer_idx for s in sites]}"
        )
    return sites


class KVCapture:
    """Context manager: forward hooks keeping each layer's latest K (pre-RoPE) and V outputs.

    ``retain_grad=True`` also keeps their gradients after ``loss.backward()`` (the activations must
    require grad: see ``kvbits.calibrate.fisher.activation_gradients``).

    Example::

        with KVCapture(model, sites, retain_grad=True) as cap:
            model(input_ids=ids, labels=ids).loss.backward()
            k, v = cap.activations(0)    # (B, H_kv, T, D) float32 each
            gk, gv = cap.gradients(0)
    """

    def __init__(
        self, model: torch.nn.Module, sites: list[KVSite] | None = None, *, retain_grad: bool = False
    ):
        self.sites = sites if sites is not None else find_kv_sites(model)
        self.retain_grad = retain_grad
        self._outputs: dict[tuple[int, str], torch.Tensor] = {}
        self._taps: dict[tuple[int, str], KVTap] = {}
        self._handles: list[Any] = []

    def _keep(self, key: tuple[int, str]) -> Callable[[torch.Tensor, str], None]:
        def keep(t: torch.Tensor, layout: str) -> None:
            if self.retain_grad and t.requires_grad:
                t.retain_grad()
            self._outputs[key] = t if self.retain_grad else t.detach()

        return keep

    def __enter__(self) -> Self:
        try:
            for s in self.sites:
                for side, module, proj in (
                    ("key", s.key_module, s.key_proj),
                    ("value", s.value_module, s.value_proj),
                ):
                    key = (s.layer_idx, side)
                    tap = KVTap(module, proj, side, s.num_kv_heads, s.head_dim, s.name, self._keep(key))
                    self._taps[key] = tap
                    self._handles += tap.register()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and drop captured tensors (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._outputs.clear()
        self._taps.clear()

    def reset(self) -> None:
        """Forget captured tensors (call between windows to free memory)."""
        self._outputs.clear()

    def _heads(self, layer: int, side: str, t: torch.Tensor) -> torch.Tensor:
        return self._taps[(layer, side)].heads(t).float()

    def _get(self, layer: int, side: str) -> torch.Tensor:
        try:
            return self._outputs[(layer, side)]
        except KeyError:
            raise RuntimeError(
                f"no {side} captured for layer {layer}: run a forward pass inside the context"
            ) from None

    def activations(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of ``layer`` from the last forward, each ``(B, H_kv, T, D)`` float32, detached."""
        return tuple(self._heads(layer, side, self._get(layer, side).detach()) for side in ("key", "value"))  # type: ignore[return-value]

    def gradients(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dL/dK, dL/dV)`` of ``layer`` after ``backward()``, each ``(B, H_kv, T, D)`` float32."""
        out = []
        for side in ("key", "value"):
            g = self._get(layer, side).grad
            if g is None:
                raise RuntimeError(
                    f"layer {layer} {side}: no gradient; capture with retain_grad=True inside "
                    "activation_gradients(model) and call backward()"
                )
            out.append(self._heads(layer, side, g))
        return out[0], out[1]


def channel_percentiles(x: torch.Tensor, percentile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(head, channel) lower and upper percentiles of ``x`` ``(H_kv, N, D)`` over its ``N`` tokens.

    Returns ``(lo, hi)``, float32 ``(H_kv, D)``, at ``100 - percentile`` and ``percentile`` (linear
    interpolation between order statistics; ``percentile=100`` gives min and max). Sorting instead of
    ``torch.quantile``, which refuses inputs above 16M elements.
    """
    if not 50.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must be in [50, 100], got {percentile}")
    if x.dim() != 3 or x.shape[1] == 0:
        raise ValueError(f"expected samples (H_kv, N, D) with N >= 1, got {tuple(x.shape)}")
    xs = x.float().sort(dim=1).values
    n = xs.shape[1]

    def at(q: float) -> torch.Tensor:
        pos = q * (n - 1)
        i0 = int(pos)
        i1 = min(i0 + 1, n - 1)
        f = pos - i0
        return xs[:, i0] * (1 - f) + xs[:, i1] * f

    return at(1.0 - percentile / 100.0), at(percentile / 100.0)


def sample_positions(n_tokens: int, start: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` sorted distinct positions in ``[start, n_tokens)`` (all of them when fewer), seeded."""
    avail = max(0, n_tokens - start)
    if count >= avail:
        return torch.arange(start, n_tokens)
    return torch.randperm(avail, generator=generator)[:count].sort().values + start
