"""The planner's picture of a model: one :class:`LayerShape` per decoder layer, in a :class:`ModelShape`.

Read from a config by :func:`kvbits.plan.config.model_shape`, or built from dimensions
(:meth:`ModelShape.from_dims`); pure Python, no transformers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from kvbits.schemes.presets import MAX_LAYERS

__all__ = [
    "ATTENTION_KINDS", "MAX_LAYERS", "MIN_WINDOW", "ROPE_TABLES", "ConfigLike", "LayerShape", "ModelShape",
    "dtype_bytes_of",
]  # fmt: skip

ATTENTION_KINDS = ("full", "sliding", "none")
ROPE_TABLES = ("half", "full", "none")
"""``LayerShape.rope_tables``: the float32 RoPE tables fused decode keeps for the layer's pre-RoPE keys."""

_DTYPE_BYTES = {
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float32": 4, "float": 4, "fp32": 4, "float64": 8, "double": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}  # fmt: skip

MIN_WINDOW = 2
"""The smallest sliding window planned: a window ``W`` keeps the last ``W - 1`` tokens, so a window of 1 keeps
none (no bytes to plan, and 0 bits per element is no figure)."""


def check_window(value: Any, what: str) -> int:
    """``value`` as a sliding window: an int >= ``MIN_WINDOW``; ``TypeError`` / ``ValueError`` naming ``what``."""
    _check_int(value, what)
    if value < MIN_WINDOW:
        raise ValueError(
            f"{what} must be >= {MIN_WINDOW} (a window of W tokens keeps the last W - 1, so {value} keeps none), "
            f"got {value!r}"
        )
    return value


def check_layer_count(value: Any, what: str) -> int:
    """``value`` as a layer count: an int in ``[1, MAX_LAYERS]``; ``TypeError`` / ``ValueError`` naming ``what``."""
    _check_int(value, what)
    if not 1 <= value <= MAX_LAYERS:
        raise ValueError(
            f"{what} must be between 1 and {MAX_LAYERS} (kvbits takes at most {MAX_LAYERS} layers; the deepest "
            f"models have a few hundred), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class LayerShape:
    """The KV cache of one decoder layer.

    Attributes:
        kv_heads: ``H_kv``, key/value heads stored per token.
        head_dim: ``D``, channels per head.
        attention: ``"full"`` (keeps every token), ``"sliding"`` (window ``W >= 2``: keeps at most the last
            ``W - 1`` tokens, as transformers' ``DynamicSlidingWindowLayer``), or ``"none"`` (stores
            no KV: linear attention, SSM, MLP-only, or KV shared with an earlier layer).
        window: ``W`` for sliding layers, else None.
        rope_tables: the RoPE tables fused decode keeps for the layer's pre-RoPE keys
            (``kvbits.cache.fused.RopeTableCache``): ``"half"`` (rotate-half RoPE over the whole head, tables
            ``D / 2`` wide: the default, assumed when the model's RoPE is not known), ``"full"`` (``D`` wide: tables
            whose halves differ) or ``"none"`` (a layer without RoPE, served without tables, or one whose keys
            the fused path declines: partial rotary, a length-dependent rope type). Read from the model's own
            rotary module by ``load_shape(config, rope=True)``.
    """

    kv_heads: int
    head_dim: int
    attention: str = "full"
    window: int | None = None
    rope_tables: str = "half"

    def __post_init__(self) -> None:
        _check_int(self.kv_heads, "kv_heads")
        _check_int(self.head_dim, "head_dim")
        if self.window is not None:
            _check_int(self.window, "window")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"LayerShape.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.rope_tables not in ROPE_TABLES:
            raise ValueError(f"LayerShape.rope_tables must be one of {ROPE_TABLES}, got {self.rope_tables!r}")
        if self.attention != "none" and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError(
                f"need kv_heads >= 1 and head_dim >= 1, got kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}"
            )
        if self.attention == "sliding":
            if self.window is None:
                raise ValueError("a sliding layer needs a window, got None")
            check_window(self.window, "a sliding layer's window")
        if self.attention != "sliding" and self.window is not None:
            raise ValueError(
                f"only sliding layers have a window; got attention={self.attention!r}, window={self.window}"
            )


@dataclass(frozen=True)
class ModelShape:
    """Everything the planner reads from a model config.

    Attributes:
        layers: one :class:`LayerShape` per decoder layer.
        dtype_bytes: bytes per element of the model's float dtype (full-precision K/V, weights).
        name: for tables (file stem, folder, registry name, hub id or ``model_type``).
        max_context: ``max_position_embeddings`` when known (the planner's default context).
        params: estimated parameter count by part (:func:`estimate_params`), None when unknown.
        weights_quantized: how the config's ``quantization_config`` stores the weights (``"mxfp4"``, ``"gptq
            4-bit"``), None when they are floats of ``dtype_bytes``: quantized, their bytes are not ``params`` times
            ``dtype_bytes``, so the planner needs ``weights_gib`` for a GPU budget.
        pre_rope_problem: why the model can not cache its keys before RoPE (``kvbits.plan.positions.pre_rope_problem``:
            it does not rotate them, GPT-2 or BLOOM, or rotates them in a way pre-RoPE keys do not support), read
            from a transformers config; the planner then refuses pre-RoPE schemes, as the cache does. None when it can,
            or nobody knows (planned from dimensions or a plain mapping).
    """

    layers: tuple[LayerShape, ...]
    dtype_bytes: int = 2
    name: str = ""
    max_context: int | None = None
    params: Mapping[str, int] | None = field(default=None, compare=False)
    weights_quantized: str | None = field(default=None, compare=False)
    pre_rope_problem: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer, got 0")
        check_layer_count(len(self.layers), "the number of layers")
        if not any(layer.attention != "none" for layer in self.layers):
            raise ValueError(f"none of the {len(self.layers)} layers stores a KV cache; nothing to plan")
        _check_dtype_bytes(self.dtype_bytes)
        if self.max_context is not None:
            _check_int(self.max_context, "max_context")

    @classmethod
    def from_dims(
        cls,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype_bytes: int = 2,
        sliding_window: int | None = None,
        layer_types: Sequence[str] | None = None,
        name: str = "",
        n_params: int | None = None,
    ) -> ModelShape:
        """A uniform model from its dimensions.

        Args:
            layers: number of decoder layers, at most ``MAX_LAYERS``.
            kv_heads: KV heads per layer.
            head_dim: channels per head.
            dtype_bytes: model dtype bytes (2 for fp16/bf16).
            sliding_window: window of the sliding layers (every layer when ``layer_types`` is None), at
                least ``MIN_WINDOW`` (2).
            layer_types: optional per-layer ``"full"`` / ``"sliding"`` / ``"none"``.
            name: for tables.
            n_params: parameter count, if known (enables weights memory without ``weights_gib``).
        """
        check_layer_count(layers, "layers")
        if sliding_window is not None:  # 0 used to mean "no window" silently; None says that
            check_window(sliding_window, "sliding_window")
        if layer_types is None:
            layer_types = ["sliding" if sliding_window else "full"] * layers
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected one per layer ({layers})")
        shapes = tuple(
            LayerShape(kv_heads, head_dim, t, sliding_window if t == "sliding" else None) for t in layer_types
        )
        params = {"total": int(n_params)} if n_params is not None else None
        return cls(shapes, dtype_bytes=dtype_bytes, name=name, params=params)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_params(self) -> int | None:
        """Estimated parameter count (sum of :attr:`params`), None when unknown."""
        return None if self.params is None else int(sum(self.params.values()))

    def replace(self, **changes: Any) -> ModelShape:
        """A copy with some fields changed (the dataclass is frozen)."""
        return dataclasses.replace(self, **changes)

    def with_overrides(
        self,
        *,
        layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype_bytes: int | None = None,
    ) -> ModelShape:
        """Override dimensions read from a config (what-if planning: "same model with 8 KV heads").

        ``kv_heads`` / ``head_dim`` apply to every layer that stores KV. ``layers`` needs a model whose
        layers are all alike (it repeats layer 0). The parameter estimate is dropped when the shape
        changes, since it no longer describes the model.
        """
        out = self
        if layers is not None and layers != self.n_layers:
            check_layer_count(layers, "layers")
            if len(set(self.layers)) != 1:
                raise ValueError(
                    f"can not override the layer count of a model with mixed layers ({self.describe()}: "
                    f"{_unlike_layer_0(self.layers)}); override kv_heads/head_dim only, or plan from dimensions"
                )
            out = out.replace(layers=(self.layers[0],) * layers, params=None)
        if kv_heads is not None or head_dim is not None:
            new = tuple(
                layer
                if layer.attention == "none"
                else dataclasses.replace(
                    layer,
                    kv_heads=layer.kv_heads if kv_heads is None else kv_heads,
                    head_dim=layer.head_dim if head_dim is None else head_dim,
                )
                for layer in out.layers
            )
            if new != out.layers:
                out = out.replace(layers=new, params=None)
        if dtype_bytes is not None:
            out = out.replace(dtype_bytes=dtype_bytes)
        return out

    def describe(self) -> str:
        """One line for people: ``32 layers (24 sliding W=4096), 8 KV heads, head dim 128, 2-byte dtype``."""
        kinds = [layer.attention for layer in self.layers]
        parts = [f"{self.n_layers} layers"]
        extra = []
        if kinds.count("sliding"):
            windows = sorted({layer.window for layer in self.layers if layer.attention == "sliding"})
            extra.append(f"{kinds.count('sliding')} sliding W={'/'.join(map(str, windows))}")
        if kinds.count("none"):
            extra.append(f"{kinds.count('none')} without KV")
        if extra:
            parts[0] += f" ({', '.join(extra)})"
        kv = sorted({layer.kv_heads for layer in self.layers if layer.attention != "none"})
        hd = sorted({layer.head_dim for layer in self.layers if layer.attention != "none"})
        parts.append(f"{'/'.join(map(str, kv))} KV heads")
        parts.append(f"head dim {'/'.join(map(str, hd))}")
        parts.append(f"{self.dtype_bytes}-byte dtype")
        return ", ".join(parts)


def _unlike_layer_0(layers: tuple[LayerShape, ...]) -> str:
    """How ``layers`` differ from layer 0, field by field: ``rope_tables 'none' at layers 3, 7 (layer 0:
    'half')`` (a NoPE layer is the whole difference ``describe`` does not show)."""
    first, parts = layers[0], []
    for attr in dataclasses.fields(LayerShape):
        own, others = getattr(first, attr.name), {}
        for i, layer in enumerate(layers):
            if (value := getattr(layer, attr.name)) != own:
                others.setdefault(value, []).append(i)
        for value, idx in others.items():
            listed = ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")
            parts.append(f"{attr.name} {value!r} at layer{'s' if len(idx) > 1 else ''} {listed} (layer 0: {own!r})")
    return "; ".join(parts)


ConfigLike = Union[ModelShape, Mapping[str, Any], str, os.PathLike, Any]  # noqa: UP007
"""Anything :func:`load_shape` accepts: a ModelShape, a dict, a path, a name, a transformers config."""


def _check_int(value: Any, what: str) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool, not a float such as 8.5 KV heads)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")


def _check_dtype_bytes(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be one of 1, 2, 4, 8, got {value!r}")


def dtype_bytes_of(dtype: Any) -> int | None:
    """Bytes per element of a dtype given as a torch dtype or its name (``"bfloat16"``); None if unknown."""
    if dtype is None:
        return None
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
