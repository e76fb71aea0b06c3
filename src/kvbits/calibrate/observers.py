"""Where K/V come from in a transformers model, hooks that capture them, and per-channel statistics.

Keys are captured *before RoPE* (KVQuant §3.2): at the output of ``k_proj``, or of the key norm
for models that normalise keys before rotating them (``k_norm``: Qwen3, Gemma3, OLMo2;
``k_layernorm``: Phi, StableLM), since that is the tensor the cache stores. Values at ``v_proj``
(``v_norm`` when present). Which norms exist, how their inputs are laid out and the hooks that read
them are :mod:`kvbits.analyze.taps`; which modules are sites, and their ``(H_kv, D)``, is
:mod:`kvbits.analyze.sites`; both are shared with ``kvbits analyze``. Capturing module outputs needs
no forked modeling code and works for every architecture whose attention has ``k_proj``/``v_proj``
submodules. Hooks are removed on exit, also on error.

Statistics are computed from a bounded subsample of tokens per layer (the caller picks the same
positions for K, V and their gradients), so memory is ``layers x max_tokens x H_kv x D`` floats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvbits.analyze.sites import KVSite, attention_sites
from kvbits.analyze.taps import KVTap
from kvbits.plan.config import attention_heads, text_config

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Self

logger = logging.getLogger(__name__)


def config_head_dim(config: Any) -> int:
    """``D`` as the planner and ``QuantizedKVCache`` read it (``kvbits.plan.config.attention_heads``)."""
    return attention_heads(text_config(config))[2]


def config_kv_heads(config: Any) -> int:
    """``H_kv`` as the planner and ``QuantizedKVCache`` count it (``kvbits.plan.config.attention_heads``):
    also ``num_kv_heads`` / ``multi_query`` (Falcon), so calibrated ``(H_kv, D)`` scales match the stored
    heads (Falcon's new architecture before transformers 5.25 repeats its KV heads before caching; the cache
    stores them once)."""
    return attention_heads(text_config(config))[1]


def find_kv_sites(model: torch.nn.Module) -> list[KVSite]:
    """The sites calibration reads: :func:`kvbits.analyze.sites.attention_sites` (the rule ``kvbits analyze``
    uses too), which must be exactly the layers that store K/V (``kvbits.calibrate.artifact.model_kv_layers``:
    every layer ``0 .. N-1`` but a hybrid model's convolution / linear-attention / state-space layers and
    KV-sharing layers), since an artifact holds parameters for each cache layer that quantizes K/V.

    Raises:
        ValueError: as ``attention_sites``; or the sites are not on the layers that store K/V (a layer that
            caches K/V without a ``k_proj`` / ``v_proj`` site, or a config the planner can not read whose
            layers are not all sites).
    """
    from kvbits.calibrate.artifact import model_kv_layers

    sites = attention_sites(model)
    config = getattr(model, "config", None)
    n_layers = getattr(text_config(config), "num_hidden_layers", None) if config is not None else None
    expected = list(range(n_layers if isinstance(n_layers, int) else len(sites)))
    kv_layers = model_kv_layers(config) if config is not None else None
    got = [s.layer_idx for s in sites]
    if got != (expected if kv_layers is None else kv_layers):
        if kv_layers is None:
            raise ValueError(
                f"calibration needs the K/V of every layer 0..{len(expected) - 1} (an artifact holds each cache "
                f"layer's parameters); {type(model).__name__} has attention sites on layers {got}, none on "
                f"{sorted(set(expected) - set(got))}"
            )
        raise ValueError(
            f"calibration needs the K/V of every layer that caches them, {kv_layers} (an artifact holds each "
            f"quantized cache layer's parameters); {type(model).__name__} has attention sites on layers {got}"
            + (f", none on {sorted(set(kv_layers) - set(got))}" if set(kv_layers) - set(got) else "")
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
