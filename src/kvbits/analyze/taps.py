"""Forward hooks that read the K or V tensor an attention module hands to its cache.

That tensor is the output of ``k_proj``/``v_proj``, or of the norm some families apply right
after the projection (keys: ``k_norm`` in Qwen3, Gemma3, OLMo2, ``k_layernorm`` in Phi, StableLM;
values: ``v_norm``). A projection's output is ``(B, T, H*D)``; a norm keeps the layout of its
input, which depends on the family (``(B, T, H*D)``, ``(B, T, H, D)`` or ``(B, H, T, D)``), so the
layout is identified by matching the norm's input to the projection's output, not guessed from
shapes. :class:`KVTap` pairs the two hooks; ``kvbits analyze`` (:mod:`kvbits.analyze.collect`) and
calibration (:mod:`kvbits.calibrate.observers`) both read K/V through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

KEY_NORMS = ("k_norm", "k_layernorm")
VALUE_NORMS = ("v_norm",)


def _norm(mod: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module | None:
    for n in names:
        sub = getattr(mod, n, None)
        if isinstance(sub, torch.nn.Module):
            return sub
    return None


def kv_norm(attention: torch.nn.Module, kind: str) -> torch.nn.Module | None:
    """The norm an attention module applies to its keys (``kind="key"``: one of :data:`KEY_NORMS`,
    before RoPE) or values (``"value"``: :data:`VALUE_NORMS`) after the projection, or None. Its
    output, not the projection's, is what the cache stores."""
    if kind not in ("key", "value"):
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
    return _norm(attention, KEY_NORMS if kind == "key" else VALUE_NORMS)


def norm_layout(inp: torch.Tensor, proj_out: torch.Tensor, n_heads: int, head_dim: int, where: str) -> str:
    """How a K/V norm's input ``inp`` lays out the projection's output ``proj_out`` ``(B, T, H*D)``:
    ``"flat"`` (``(B, T, H*D)``), ``"bthd"`` or ``"bhtd"``; matched by value, not guessed from shapes
    (``T == H`` would make shapes ambiguous). ``where`` names the site in the error.

    Raises:
        ValueError: ``inp`` is none of the three (an unsupported model family).
    """
    if inp.dim() == 3:
        return "flat"
    B, T = proj_out.shape[0], proj_out.shape[1]
    bthd = proj_out.reshape(B, T, n_heads, head_dim)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        # equal element for element, NaN where NaN (torch.equal: never, and a NaN / inf projection, the model's own
        # overflow, was refused as "not supported"; verify_taps then names it)
        return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)

    if same(inp, bthd):
        return "bthd"
    if same(inp, bthd.transpose(1, 2)):
        return "bhtd"
    raise ValueError(
        f"{where}: the norm's input {tuple(inp.shape)} is not a reshape of the projection's output "
        f"{tuple(proj_out.shape)}; this model family is not supported"
    )


def to_bhtd(x: torch.Tensor, layout: str, n_heads: int, head_dim: int) -> torch.Tensor:
    """``x`` (a projection or norm output in ``layout``, see :func:`norm_layout`) as ``(B, H_kv, T, D)``."""
    if layout == "flat":
        return x.reshape(x.shape[0], x.shape[1], n_heads, head_dim).transpose(1, 2)
    if layout == "bthd":
        return x.transpose(1, 2)
    if layout == "bhtd":
        return x
    raise ValueError(f"layout must be 'flat', 'bthd' or 'bhtd', got {layout!r}")


def value_proj(attention: torch.nn.Module) -> torch.nn.Module | None:
    """The projection an attention module's values come from: ``v_proj``; ``k_proj`` when ``v_proj`` is
    None (Gemma 4's global layers with ``attention_k_eq_v``: the values are ``v_norm`` of the keys'
    projection); None when the module has neither."""
    v = getattr(attention, "v_proj", None)
    if isinstance(v, torch.nn.Module):
        return v
    k = getattr(attention, "k_proj", None)
    if hasattr(attention, "v_proj") and v is None and isinstance(k, torch.nn.Module):
        return k
    return None


def capture_point(attention: torch.nn.Module, kind: str) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``(module, proj)`` for an attention module's keys (``kind="key"``) or values: the module whose
    output the cache stores (the norm after the projection when there is one, else the projection)
    and the projection feeding it when that is a norm, else None (the first two :class:`KVTap` args).
    Values without a ``v_proj`` of their own come from ``k_proj`` (:func:`value_proj`)."""
    proj = attention.k_proj if kind == "key" else value_proj(attention)
    norm = kv_norm(attention, kind)
    return (proj, None) if norm is None else (norm, proj)


class KVTap:
    """Forward hooks on one K or V capture point: ``module``'s every output goes to ``on_output``.

    Args:
        module: the module whose output the cache stores: the projection, or the norm after it.
        proj: the projection feeding ``module`` when that is a norm, else None. It is hooked only
            until the norm's first call has told its input layout apart.
        kind: ``"key"`` or ``"value"`` (for messages).
        n_heads, head_dim: ``H_kv`` and ``D``.
        where: names the attention site in errors (a module name, ``"layer 3"``).
        on_output: called as ``on_output(x, layout)`` with ``module``'s output as it is (not detached,
            not reshaped) and its layout (see :meth:`heads`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        proj: torch.nn.Module | None,
        kind: str,
        n_heads: int,
        head_dim: int,
        where: str,
        on_output: Callable[[torch.Tensor, str], None],
    ) -> None:
        self.module, self.proj, self.kind = module, proj, kind
        self.n_heads, self.head_dim, self.where = n_heads, head_dim, where
        self.on_output = on_output
        self.layout: str | None = "flat" if proj is None else None  # "flat", "bthd" or "bhtd"
        self._proj_out: torch.Tensor | None = None

    def register(self) -> list[RemovableHandle]:
        """Register the hooks; the caller removes the returned handles."""
        handles = []
        if self.proj is not None:
            handles.append(self.proj.register_forward_hook(self._on_proj))
        handles.append(self.module.register_forward_hook(self._on_module))
        return handles

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (an output of ``module``, or its gradient) as ``(B, H_kv, T, D)``."""
        if self.layout is None:
            raise RuntimeError(f"{self.where}: no {self.kind} captured yet, the layout is unknown")
        return to_bhtd(x, self.layout, self.n_heads, self.head_dim)

    def _on_proj(self, _m: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        if self.layout is None:
            self._proj_out = out.detach()

    def _on_module(self, _m: torch.nn.Module, args: tuple, output: Any) -> None:
        x = output[0] if isinstance(output, tuple) else output
        if self.layout is None:
            proj_out, self._proj_out = self._proj_out, None
            if proj_out is None:
                raise RuntimeError(f"{self.where}: the {self.kind} norm ran before its projection")
            where = f"{self.where}: the {self.kind} norm"
            self.layout = norm_layout(args[0], proj_out, self.n_heads, self.head_dim, where)
        self.on_output(x, self.layout)
