"""RoPE exactly as transformers computes it, and its inverse, from a model config alone.

Pre-RoPE key quantization (KVQuant, Hooper et al. 2024, §3.2) stores keys *before* the rotary
embedding and re-applies it after dequantization: channel statistics are stable before RoPE and
smeared across each rotation pair after it. Attention modules of stock transformers models only see
post-RoPE keys, so we need the very cos/sin transformers used to (1) un-rotate post-RoPE keys into
pre-RoPE keys and (2) rotate dequantized pre-RoPE keys back.

``RotaryTables`` does not re-implement any RoPE variant: it instantiates the model family's own
``*RotaryEmbedding`` module (``transformers.models.<type>.modeling_<type>``) from the config and calls
its ``forward``, so ``rope_type`` ``default`` / ``linear`` / ``dynamic`` / ``yarn`` / ``longrope`` /
``llama3``, ``partial_rotary_factor`` and per-layer-type bases (Gemma3 local vs global layers) are
whatever the installed transformers implements. Works with transformers 5.x (``rope_parameters``).

Convention: "rotate-half" as transformers' ``apply_rotary_pos_emb``: channel ``i`` pairs with
``i + D_rot/2`` and only the first ``D_rot`` channels rotate (partial rotary). At construction the
convention is checked against the family's own ``apply_rotary_pos_emb`` when it has one; families
that rotate interleaved pairs (GLM, Cohere, GPT-J, ...) are refused with ``NotImplementedError`` (by name for
those the planner knows: ``kvbits.plan.positions.NOT_ROTATE_HALF``).

Dynamic RoPE (``rope_type="dynamic"``): transformers recomputes the frequencies from the longest
sequence its rotary module has seen (``max(position_ids) + 1`` of the forward call, growing across
calls until a short sequence resets it). These tables are *stateless*: ``cos_sin`` returns the tables
of a single forward whose sequence length is ``seq_len`` (default ``max(positions) + 1``). That is
exact for keys produced by one prefill pass; for keys cached during decoding past
``max_position_embeddings``, pass the ``seq_len`` the model had grown to when it produced them (and
note that transformers itself then mixes keys rotated with different frequencies in one cache).
``longrope`` is handled the same way (short or long factors chosen from ``seq_len``).

A cache un-rotates a block when it flushes it and rotates it back on every read, in other slices:
``framed_cos_sin`` gives it tables that depend on the slot alone, so the two always cancel. Slots
``[k W, (k + 1) W)`` take the tables of a forward of length ``(k + 1) W``, where ``W`` (``frame``, probed) is the
longest sequence still on the original frequencies (``max_position_embeddings`` for ``dynamic``,
``original_max_position_embeddings`` for ``longrope``): exactly the model's frame up to ``W``, within ``W``
tokens of the length a later token was decoded at beyond it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvbits.plan.config import latent_attention, latent_attention_message, layer_heads, text_config

# the torch-free config checks, shared with the planner, which refuses the same models for pre-RoPE schemes
from kvbits.plan.positions import (
    INTERLEAVED_SINUSOID,
    NON_TEXT_ROTARY,
    NOT_ROTATE_HALF,
    PER_LAYER_THETA,
    interleave_reason,
    layer_rope_theta,
    layer_rotates,
    modeling_family,
    mrope_section,
    no_rope_reason,
)

logger = logging.getLogger(__name__)

__all__ = ["RotaryTables", "apply_rope", "invert_rope", "rotate_half"]

# rope types whose frequencies depend on the sequence length of the forward call
_LENGTH_DEPENDENT = ("dynamic", "longrope")
# what positions may be (bool and complex are no positions; floats are refused rather than truncated)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dim (halves), as transformers' ``rotate_half``."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _broadcast_tables(
    cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T, D_rot)`` or ``(T, D_rot)`` tables → ``(B|1, 1, T, D_rot)`` for ``x`` ``(B, H, T, D)``."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H, T, D), got shape {tuple(x.shape)}")
    if not (x.dtype.is_floating_point and cos.dtype.is_floating_point and sin.dtype.is_floating_point):
        raise TypeError(f"x, cos and sin must be floating point, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3:
        raise ValueError(f"cos/sin must be (B, T, D_rot) or (T, D_rot), got shape {tuple(cos.shape)}")
    d_rot = cos.shape[-1]
    if d_rot > x.shape[-1] or d_rot % 2:
        raise ValueError(f"rotary dim {d_rot} must be even and at most the head dim {x.shape[-1]}")
    if cos.shape[1] != x.shape[2]:
        raise ValueError(f"cos/sin cover {cos.shape[1]} positions but x has T={x.shape[2]} tokens")
    if cos.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"cos/sin cover {cos.shape[0]} sequences but x has B={x.shape[0]} (positions (T,), (1, T) or (B, T))")
    return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, D)`` by the tables ``cos``/``sin`` ``(B, T, D_rot)``.

    Bit-for-bit the arithmetic of transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x)
    * sin`` in ``x``'s dtype); channels ``D_rot:`` (partial rotary) pass through unchanged.
    """
    cos, sin = _broadcast_tables(cos, sin, x)
    d_rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if d_rot == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :d_rot], x[..., d_rot:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo ``apply_rope`` with the same tables: ``x`` ``(B, H, T, D)`` post-RoPE → pre-RoPE.

    Each pair ``(a, b) = (x_i, x_{i+D_rot/2})`` was mapped by ``s·R(θ)``, a rotation scaled by the
    attention factor ``s`` (``cos² + sin² = s²``; ``s ≠ 1`` for yarn / longrope). The inverse is
    ``R(-θ) / s = (x·cos − rotate_half(x)·sin) / (cos² + sin²)``, computed in float32 and returned in
    ``x``'s dtype: exact up to rounding.
    """
    cos, sin = _broadcast_tables(cos, sin, x)
    d_rot = cos.shape[-1]
    c = cos.to(x.dtype).float()  # the tables as apply_rope used them
    s = sin.to(x.dtype).float()
    xr = x[..., :d_rot].float()
    out = (xr * c - rotate_half(xr) * s) / (c * c + s * s)
    out = out.to(x.dtype)
    if d_rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., d_rot:]), dim=-1)


def _refuse_without_rope(text: Any, model_type: str | None) -> None:
    """``ValueError`` (what a family without a rotary module gets) when ``no_rope_reason`` finds one."""
    why = no_rope_reason(text)
    if why is not None:
        raise ValueError(f"model_type {model_type!r} has no RoPE keys: {why}")


def _refuse_layout(text: Any, model_type: str | None) -> None:
    """``NotImplementedError`` for keys these tables can not reproduce although the family's rotary module and
    ``apply_rotary_pos_emb`` are rotate-half (so ``_check_convention`` passes): ``rope_interleave=True``
    (``kvbits.plan.positions.interleave_reason``: DeepSeek-V3, Mistral 4, GLM-4-MoE-Lite, ... rotate interleaved
    pairs by ``apply_rotary_pos_emb_interleave``), and multi-head latent attention (``kv_lora_rank`` in any layer),
    whose keys rotate only their last ``qk_rope_head_dim`` channels (the tables rotate the first ``D_rot``) and whose
    cache holds a compressed latent, not keys."""
    why = interleave_reason(text)
    if why is not None:
        raise NotImplementedError(
            f"model_type {model_type!r}: {why}; kvbits.quant.rope supports the rotate-half convention only"
        )
    if (latent := latent_attention(text)) is not None:
        why = (
            "its keys rotate only their last qk_rope_head_dim channels, which these tables (rotating the first D_rot "
            "channels of K heads) do not reproduce"
        )
        raise NotImplementedError(latent_attention_message(text, latent, type(text).__name__, "kvbits.quant.rope", why))


def _nope_type(text: Any, layer_type: str) -> bool:
    """Whether ``text``'s per-layer-type RoPE parameters give ``layer_type`` none (``rope_parameters[layer_type]``
    is ``None``): its layers rotate no keys (Beam's full-attention layers: the model hands them no cos/sin)."""
    params = getattr(text, "rope_parameters", None)
    return isinstance(params, Mapping) and layer_type in params and params[layer_type] is None


# ------------------------------------------------------------------------------- finding classes


def _modeling_module(model_type: str):
    """The transformers modeling module that runs ``model_type``'s models: its own, or for a config-only family
    the one of the model class transformers runs it with (``kvbits.plan.positions.modeling_family``: EXAONE ->
    Llama's); ``ValueError`` when there is none (a remote-code model: pass ``rotary=RotaryTables.from_model(model)``)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(modeling_family(model_type) or model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError as exc:
        raise ValueError(
            f"no transformers modeling module for model_type {model_type!r} (a remote-code model? build the "
            f"tables from the loaded model: RotaryTables.from_model(model)): {exc}"
        ) from exc


def _rotary_class(module: Any, model_type: str) -> type:
    """The text rotary-embedding class defined in a modeling module."""
    found = [
        obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and name.endswith("RotaryEmbedding")
        and isinstance(obj, type)
        and issubclass(obj, torch.nn.Module)
        and not any(tag in name for tag in NON_TEXT_ROTARY)
    ]
    if not found:
        raise ValueError(
            f"model_type {model_type!r} has no RoPE keys: its modeling file {module.__name__} defines no "
            "*RotaryEmbedding class (the model does not rotate its keys)"
        )
    text = [c for c in found if "Text" in c.__name__]
    pool = text or found
    return min(pool, key=lambda c: len(c.__name__))


# what a family's rotary module raises when built from, or run on, a config it was not written for
_MODULE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError)


def _unbuildable_reason(config: Any, exc: Exception) -> str:
    """Why a rotary module could not be built from ``config`` (``exc``: what its constructor raised)."""
    layer_types = getattr(config, "layer_types", None)
    if isinstance(exc, KeyError) and isinstance(layer_types, (list, tuple)) and exc.args and exc.args[0] in layer_types:
        params = getattr(config, "rope_parameters", None)
        known = sorted(params) if isinstance(params, Mapping) else params
        return (
            f"its layer_types name {exc.args[0]!r}, for which its rope_parameters (keys {known}) hold no RoPE "
            "parameters (an unknown layer type for this config)"
        )
    return (
        "it is not the text config of a decoder (a vision, audio, VQ or other sub-config?): pass the model's "
        "config or its text_config"
    )


def _pristine_copy(rotary: torch.nn.Module) -> torch.nn.Module:
    """A copy of a model's rotary module in eval mode, without its hooks, its dynamic RoPE state reset."""
    rotary = copy.deepcopy(rotary).eval()
    for hooks in (rotary._forward_hooks, rotary._forward_pre_hooks):
        hooks.clear()
    _reset_dynamic_state(rotary)
    return rotary


def _instantiate(
    cls: type, config: Any, device: torch.device | str | None, model_type: str | None = None
) -> torch.nn.Module:
    """``cls(config)`` on ``device``; ``ValueError`` naming ``model_type`` when the module can not be built from
    ``config`` (a vision / audio sub-config missing the text fields it reads, a layer type without RoPE
    parameters), not the constructor's own ``AttributeError`` / ``KeyError`` deep inside transformers."""
    try:
        module = cls(config)  # transformers 5.17 also takes device= (deprecated); 5.24 does not
    except _MODULE_ERRORS as exc:
        raise ValueError(
            f"model_type {model_type or getattr(config, 'model_type', None)!r}: its rotary module {cls.__name__} "
            f"can not be built from this {type(config).__name__} ({type(exc).__name__}: {exc}): "
            f"{_unbuildable_reason(config, exc)}"
        ) from exc
    if device is not None:
        module = module.to(device)
    return module.eval()


@functools.cache
def _undecorated_forward(cls: type) -> Any:
    """``cls.forward`` without transformers' ``dynamic_rope_update`` (the frequency update of length-dependent rope
    types) when that decorator is the outermost one, or under ``torch.no_grad()`` alone (transformers 5.17 puts it
    outside; ``_forward`` calls under ``no_grad`` anyway), else None."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    fwd = getattr(cls, "forward", None)
    wrapper = dynamic_rope_update(lambda *a, **k: None)  # every wrapper it returns shares this code object
    no_grad = torch.no_grad()(lambda: None).__code__  # and every function torch.no_grad() decorates, this one
    while getattr(fwd, "__code__", None) is no_grad:
        fwd = getattr(fwd, "__wrapped__", None)
    if getattr(fwd, "__code__", None) is not wrapper.__code__:
        return None
    return getattr(fwd, "__wrapped__", None)


def _unrunnable_reason(text: Any, rotary: torch.nn.Module) -> str:
    """Why a built rotary module fails on ``(x, position_ids)`` of text tokens."""
    if hasattr(rotary, "mrope_section") or mrope_section(text) is not None:
        section = getattr(rotary, "mrope_section", None)
        section = mrope_section(text) if section is None else section
        return (
            f"it rotates by multimodal RoPE (mrope_section {section}), which this config does not fit (the "
            "section must split the rotary frequencies)"
        )
    return "its forward does not take (x, position_ids) of a decoder's text tokens (not a text decoder's RoPE?)"


def _reset_dynamic_state(rotary: torch.nn.Module) -> None:
    """Undo what transformers' ``dynamic_rope_update`` grew: ``*inv_freq`` back to ``*original_inv_freq``."""
    for name, buf in list(rotary.named_buffers(recurse=False)):
        if name.endswith("original_inv_freq"):
            prefix = name[: -len("original_inv_freq")]
            rotary.register_buffer(f"{prefix}inv_freq", buf.clone(), persistent=False)
            if hasattr(rotary, "original_max_seq_len"):
                setattr(rotary, f"{prefix}max_seq_len_cached", rotary.original_max_seq_len)


# --------------------------------------------------------------------------------------- tables


@dataclass
class RotaryTables:
    """cos/sin tables of one model's RoPE, produced by transformers' own rotary module.

    Build with ``from_config`` (or ``from_model``); for models with different rotary bases per
    layer type (Gemma3 sliding vs full attention) or layers without RoPE (SmolLM3's NoPE layers)
    select a layer with ``tables_for_layer``.

    Attributes:
        config: the text config the module was built from.
        rotary: transformers' rotary-embedding module (kept pristine: length-dependent rope types
            are evaluated on a copy).
        model_type: ``config.model_type``.
        head_dim: ``D``, channels per head.
        rot_dim: ``D_rot``, channels that rotate (``D`` unless partial rotary; 0 for a NoPE layer).
        layer_type: the layer type these tables are for (per-layer-type modules only), else None.
        convention_checked: True when the rotate-half convention was verified against the family's
            own ``apply_rotary_pos_emb``; False when that function could not be probed.
        halves_equal: the tables repeat their first ``rot_dim / 2`` columns (``cat(freqs, freqs)``, as
            every rotate-half family builds them), probed at construction; the fused decode path then
            keeps half-width tables (``kvbits.cache.fused.RopeTableCache``).
        half_tables: the module returns the ``D / 2`` frequencies once (gpt-oss: its
            ``apply_rotary_pos_emb`` rotates the halves ``(x1, x2)`` by them, which is rotate-half with
            ``cat(cos, cos)``); :meth:`cos_sin` returns them duplicated, as every other family's.
    """

    config: Any
    rotary: torch.nn.Module
    model_type: str
    head_dim: int
    rot_dim: int
    layer_type: str | None = None
    convention_checked: bool = False
    halves_equal: bool = False
    half_tables: bool = False
    _module: Any = field(default=None, repr=False)
    # per-layer RoPE bases (Granite SWA): one rotary module per base, shared by every tables_for_layer of one model
    _theta_modules: dict = field(default_factory=dict, repr=False)

    def __deepcopy__(self, memo: dict) -> RotaryTables:
        """The tables themselves: a deep copy of a cache (transformers' prompt reuse: prefill once, deepcopy
        per continuation) shares them, as it shares the model. They never change after construction
        (``rotary`` is kept pristine; ``tables_for_layer`` and a cache moving devices build new tables),
        and ``_module`` is a Python module, which cannot be copied."""
        memo[id(self.rotary)] = self.rotary  # other references to the module in the same copy share it too
        return self

    # ---------------------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, config: Any, device: torch.device | str | None = None) -> RotaryTables:
        """Tables for the model described by ``config`` (a transformers ``PretrainedConfig``).

        Raises:
            ValueError: the model type has no RoPE module in transformers, or its config says this model
                rotates no keys (Falcon with ``alibi=True``, GraniteMoeHybrid without ``position_embedding_type="rope"``),
                or the family's rotary module can not be built from it (a vision / audio / VQ sub-config, not a
                decoder's text config; a layer type its ``rope_parameters`` give no parameters).
            NotImplementedError: the family rotates interleaved pairs (by name, or ``rope_interleave=True``), uses
                multi-head latent attention (``kv_lora_rank``), returns non-cos/sin tables, or its rotary module
                fails on text positions (multimodal RoPE whose ``mrope_section`` does not fit the config; a vision
                module whose ``forward`` takes no position ids).
        """
        text = text_config(config)
        model_type = getattr(text, "model_type", None)
        if not model_type:
            raise ValueError(f"config has no model_type: {type(config).__name__}")
        if model_type in INTERLEAVED_SINUSOID:
            raise NotImplementedError(
                f"model_type {model_type!r} rotates interleaved pairs from a fixed sinusoid table; "
                "kvbits.quant.rope supports the rotate-half convention only"
            )
        if model_type in NOT_ROTATE_HALF:  # what _check_convention finds, known without building the module
            raise NotImplementedError(
                f"model_type {model_type!r} applies RoPE in a layout other than rotate-half (e.g. interleaved pairs); "
                "kvbits.quant.rope supports the rotate-half convention only"
            )
        _refuse_layout(text, model_type)
        _refuse_without_rope(text, model_type)
        module = _modeling_module(model_type)
        rotary = _instantiate(_rotary_class(module, model_type), text, device, model_type)
        return cls._build(text, rotary, module)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> RotaryTables:
        """Tables for a loaded model, from a copy of the rotary module the model itself runs.

        Unlike ``from_config`` this keeps the model's own frequency buffers, which matters when
        the model was cast with ``model.to(torch.bfloat16)`` (that also rounds ``inv_freq``;
        ``from_pretrained(dtype=...)`` keeps them in float32). State a dynamic RoPE module grew
        during earlier forwards is reset to its original frequencies.
        """
        found = None
        for _name, sub in model.named_modules():
            cname = type(sub).__name__
            if cname.endswith("RotaryEmbedding") and not any(t in cname for t in NON_TEXT_ROTARY):
                found = sub
                break
        if found is None:
            return cls.from_config(model.config)
        text = getattr(found, "config", None) or text_config(model.config)
        _refuse_layout(text, getattr(text, "model_type", None))
        _refuse_without_rope(text, getattr(text, "model_type", None))
        tables = cls._build(text, _pristine_copy(found), inspect.getmodule(type(found)))
        if getattr(text, "model_type", None) in PER_LAYER_THETA:
            # the model's own module per base (model.rotary_embs), not ones rebuilt from the config in float32: a
            # model cast with .to(torch.bfloat16) rounded their inv_freq too (rebuilt ones re-rotated its keys
            # with up to 15 % of the largest key's error at 512 tokens)
            base = (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
            if base is not None:
                tables._rotary_for_theta(float(base))  # memoises the global base's module: tables.rotary
            for sub in model.modules():
                params = getattr(getattr(sub, "config", None), "rope_parameters", None)
                theta = params.get("rope_theta") if isinstance(params, Mapping) else None
                if type(sub) is type(found) and sub is not found and theta is not None:
                    tables._theta_modules.setdefault(float(theta), _pristine_copy(sub))
        return tables

    @classmethod
    def _build(cls, text: Any, rotary: torch.nn.Module, module: Any) -> RotaryTables:
        if not hasattr(rotary, "rope_type"):
            # GPT-J / CodeGen: a fixed sinusoid table returned as (sin, cos) for interleaved pairs
            # (rotate_every_two), not transformers' rope-type module; probing it would read sin as cos
            raise NotImplementedError(
                f"model_type {text.model_type!r}: {type(rotary).__name__} is not a transformers rope_type "
                "module (its family rotates interleaved pairs); kvbits.quant.rope supports the rotate-half "
                "convention only"
            )
        head_dim = layer_heads(text, 0)[2]  # the planner's rule (Gemma 4 sets head_dim per layer)
        per_type = isinstance(getattr(rotary, "rope_type", None), dict)
        layer_type = None
        if per_type:  # until tables_for_layer says otherwise: the first rotated layer's type (LFM3: not 'conv')
            types = [t for t in getattr(text, "layer_types", None) or () if t in rotary.rope_type]
            layer_type = (types or sorted(rotary.rope_type))[0]
        tables = cls(text, rotary, text.model_type, int(head_dim), 0, layer_type, _module=module)
        try:
            tables._probe()
        except NotImplementedError:  # _forward's own refusal (no (cos, sin) tables)
            raise
        except _MODULE_ERRORS as exc:  # the module's forward, deep inside transformers
            raise NotImplementedError(
                f"model_type {text.model_type!r}: its rotary module {type(rotary).__name__} fails on text positions "
                f"({type(exc).__name__}: {exc}): {_unrunnable_reason(text, rotary)}; kvbits.quant.rope supports "
                "the rotate-half RoPE of decoder text models"
            ) from exc
        tables.convention_checked = tables._check_convention()
        return tables

    def _probe(self) -> None:
        """``rot_dim`` and ``halves_equal`` from a few positions (construction time: may read the device)."""
        pos = torch.tensor([[0, 1, 7, 1000, 65535]])
        cos, sin = self._forward(pos, torch.float32, None)
        self.rot_dim = int(cos.shape[-1])
        h = self.rot_dim // 2
        self.halves_equal = self.rot_dim % 2 == 0 and all(
            torch.equal(t[..., :h], t[..., h : 2 * h]) for t in (cos, sin)
        )

    @property
    def frame(self) -> int | None:
        """Length-dependent rope types: ``W``, the longest forward whose tables are still the shortest one's
        (probed once by bisection on position 1: 24 forwards), ``None`` when they never change up to 2**24 or
        for other rope types (see the module docstring)."""
        if self.rot_dim == 0 or not self.length_dependent:
            return None
        cached = self.__dict__.get("_frame_probe")
        if cached is None:
            one = torch.ones((1, 1), dtype=torch.long)

            def same(n: int) -> bool:
                return all(torch.equal(a, b) for a, b in zip(self._forward(one, torch.float32, n), base))

            base = self._forward(one, torch.float32, 2)
            lo, hi = 2, 1 << 24  # same(lo); the answer is in [lo, hi]
            if same(hi):
                cached = (None,)
            else:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if same(mid) else (lo, mid)
                cached = (lo,)
            self.__dict__["_frame_probe"] = cached
        return cached[0]

    def framed_cos_sin(
        self, positions: torch.Tensor, slot0: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(B, n, D_rot)`` for ``positions`` ``(B, n)`` (``>= 0``, at most their slot index) held in
        cache slots ``slot0 ... slot0 + n - 1``, without a host sync: tables that depend on the slot, not on the
        slice asked for (module docstring), so a block un-rotated at a flush is rotated back exactly by any
        later read. Rope types whose tables do not depend on the length: ``cos_sin``'s tables."""
        if self.rot_dim == 0:  # a layer without RoPE: empty tables, as cos_sin's
            empty = torch.zeros((*positions.shape, 0), dtype=dtype, device=positions.device)
            return empty, empty.clone()
        W, n = self.frame, positions.shape[1]
        if W is None or n == 0:
            return self._forward(positions, dtype, None)
        parts = []
        for k in range(slot0 // W, (slot0 + n - 1) // W + 1):
            a, b = max(slot0, k * W) - slot0, min(slot0 + n, (k + 1) * W) - slot0
            parts.append(self._forward(positions[:, a:b], dtype, (k + 1) * W, framed=True))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts], dim=1), torch.cat([s_ for _, s_ in parts], dim=1)

    @property
    def length_dependent(self) -> bool:
        """Whether the tables depend on the sequence length of the forward call (``dynamic``, ``longrope``)."""
        return any(k in self.rope_type for k in _LENGTH_DEPENDENT)

    def fused_reason(self) -> str | None:
        """Why the fused decode kernel can not rotate pre-RoPE keys with these tables, or None: it rotates all ``D``
        channels by tables of the position alone. A layer without RoPE (``rot_dim`` 0) has nothing to rotate: None
        (``kvbits.cache.fused`` serves its keys without tables, ``kvbits.plan`` counts none)."""
        if self.rot_dim and self.rot_dim != self.head_dim:
            return f"partial rotary embedding ({self.rot_dim} of {self.head_dim} channels; the kernel rotates all)"
        if self.rot_dim and self.length_dependent:
            return f"rope_type {self.rope_type!r} (tables depend on the sequence length)"
        return None

    def tables_for_layer(self, layer_idx: int) -> RotaryTables:
        """The tables decoder layer ``layer_idx`` uses.

        Per-layer-type modules (Gemma3: ``config.layer_types[i]`` in ``sliding_attention`` /
        ``full_attention`` with their own ``rope_theta``) select that type; families with a base per layer
        (Granite SWA: ``layer_rope_theta[i]``, ``kvbits.plan.positions.PER_LAYER_THETA``) get that base's module;
        layers without RoPE
        (``kvbits.plan.positions.layer_rotates``: ``config.no_rope_layers[i] == 0``, SmolLM3 / Llama4;
        ``layer_rope_theta[i] == 0``; EXAONE 4's global layers and the other family rules of
        ``LAYER_ROTATES``) get ``rot_dim = 0`` (identity).
        """
        n_layers = getattr(self.config, "num_hidden_layers", None)
        if (
            not isinstance(layer_idx, int)
            or layer_idx < 0
            or (n_layers is not None and layer_idx >= n_layers)
        ):
            raise ValueError(f"layer_idx must be an int in [0, {n_layers}), got {layer_idx!r}")
        head_dim = layer_heads(self.config, layer_idx)[2]  # Gemma 4: global layers have their own
        if not layer_rotates(self.config, layer_idx):  # NoPE layers by config or family rule (positions.LAYER_ROTATES)
            return replace(self, head_dim=head_dim, rot_dim=0, halves_equal=False)
        theta = layer_rope_theta(self.config, layer_idx)  # Granite SWA: this layer's own base (positions.PER_LAYER_THETA)
        if theta is not None:
            rotary = self._rotary_for_theta(theta)
            if rotary is self.rotary and head_dim == self.head_dim:
                return self
            tables = replace(self, rotary=rotary, head_dim=head_dim)
            tables._probe()
            return tables
        if not isinstance(getattr(self.rotary, "rope_type", None), dict):
            return self if head_dim == self.head_dim else replace(self, head_dim=head_dim)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is None or layer_idx >= len(layer_types):
            raise ValueError(f"config has no layer_types entry for layer {layer_idx}")
        lt = layer_types[layer_idx]
        if lt not in self.rotary.rope_type and _nope_type(self.config, lt):  # Beam: NoPE full-attention layers
            return replace(self, head_dim=head_dim, layer_type=lt, rot_dim=0, halves_equal=False)
        if lt not in self.rotary.rope_type:
            raise ValueError(
                f"layer {layer_idx} has type {lt!r}; rotary module knows {sorted(self.rotary.rope_type)}"
            )
        if lt == self.layer_type and head_dim == self.head_dim:
            return self
        tables = replace(self, layer_type=lt, head_dim=head_dim)
        tables._probe()
        return tables

    def _rotary_for_theta(self, theta: float) -> torch.nn.Module:
        """The family's rotary module at base ``theta``, built as the model builds its per-base modules
        (``rope_parameters = {**rope_parameters, "rope_theta": theta}``, ``kvbits.plan.positions.PER_LAYER_THETA``);
        the module these tables were built with serves its own base. Memoised per model (ids key table caches)."""
        modules = self._theta_modules
        if not modules:
            params = getattr(getattr(self.rotary, "config", self.config), "rope_parameters", None)
            if isinstance(params, Mapping) and params.get("rope_theta") is not None:
                modules[float(params["rope_theta"])] = self.rotary
        if theta not in modules:
            cfg = copy.deepcopy(getattr(self.rotary, "config", self.config))
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": theta}
            modules[theta] = _instantiate(type(self.rotary), cfg, self.device)
        return modules[theta]

    # --------------------------------------------------------------------------------- tables

    @property
    def rope_type(self) -> str:
        """``rope_type`` of these tables (``default``, ``linear``, ``dynamic``, ``yarn``, ...)."""
        rt = self.rotary.rope_type
        return rt.get(self.layer_type, "none") if isinstance(rt, dict) else rt  # "none": a NoPE layer type (Beam)

    @property
    def device(self) -> torch.device:
        buf = next(self.rotary.buffers(), None)
        return buf.device if buf is not None else torch.device("cpu")

    def _length_module(self, seq_len: int | None) -> tuple[torch.nn.Module, Any]:
        """Length-dependent rope types: the rotary module to run a forward of length ``seq_len`` on, and what to call.

        The module recomputes its frequencies from each forward's ``max(position_ids) + 1``, so a forward runs on a
        copy of the pristine ``rotary``. ``seq_len=None`` (any length): a fresh copy, called with that update. A given
        ``seq_len`` (``framed_cos_sin``'s frame lengths, per decode read): one copy per length (per short / long switch
        for ``longrope``), kept after its first forward has set its frequencies for that length; later forwards call
        the undecorated forward, since transformers' ``dynamic_rope_update`` would set the same frequencies again (a
        dynamic module only grows past, or resets below, a length it has not seen; longrope picks its factors from
        ``seq_len > original_max_position_embeddings``). So a decode read deep-copies the module only when it reaches
        a new frame (before: every read, once per frame of the cache) and skips the update's host sync (``dynamic``:
        ``seq_len > max_seq_len_cached`` on a device tensor). A forward not decorated by ``dynamic_rope_update`` (a
        remote-code module) gets a fresh copy every time, as before."""
        if seq_len is None:
            fresh = copy.deepcopy(self.rotary)  # the module mutates its frequencies: stay stateless
            return fresh, fresh
        W = self.frame
        if self.rope_type == "longrope" and W is not None:  # short factors up to W, the long ones beyond
            seq_len = min(seq_len, W + 1)
        raw = _undecorated_forward(type(self.rotary))
        modules = self.__dict__.setdefault("_length_modules", {})  # not a field: replace() starts a new table
        key = (seq_len, self.device)
        hit = modules.get(key) if raw is not None else None
        if hit is not None:
            return hit, functools.partial(raw, hit)
        fresh = copy.deepcopy(self.rotary)
        if raw is not None:
            modules[key] = fresh  # its forward below sets its frequencies for seq_len
        return fresh, fresh

    def _forward(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int | None, *, framed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(B, T, D_rot)`` of one forward of the rotary module on ``positions`` ``(B, T)`` whose length
        is ``seq_len`` (``None``: ``max(positions) + 1``); ``framed``: ``seq_len`` is a frame length, whose module is
        kept (``_length_module``)."""
        pos = positions.to(self.device, torch.long)
        n_real = pos.shape[1]
        module, call = self.rotary, self.rotary
        if self.length_dependent:
            module, call = self._length_module(seq_len if framed else None)
            if seq_len is not None or n_real == 0:
                # one extra position makes the forward see max(position_ids) + 1 == seq_len (no positions:
                # any length, the module's max() needs one); tables are elementwise per position, so slicing
                # it off is exact
                last = (1 if seq_len is None else seq_len) - 1
                extra = torch.full((pos.shape[0], 1), last, dtype=pos.dtype, device=pos.device)
                pos = torch.cat((pos, extra), dim=1)
        if getattr(module, "mrope_section", None) is not None:  # multimodal RoPE (Qwen2-VL style): time, height and
            pos = pos[None].expand(3, -1, -1)  # width axes, equal for text; transformers 5.17's modules take only these
        x = torch.zeros((), dtype=dtype, device=pos.device)
        args = (x, pos) if self.layer_type is None else (x, pos, self.layer_type)
        with torch.no_grad():
            out = call(*args)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise NotImplementedError(
                f"{type(self.rotary).__name__} returns {type(out).__name__}, not (cos, sin) tables; "
                f"model_type {self.model_type!r} is not supported"
            )
        cos, sin = out
        if self.half_tables:  # gpt-oss: D / 2 frequencies once (class docstring)
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos[:, :n_real], sin[:, :n_real]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` ``(T,)`` or ``(B, T)``, each ``(B, T, D_rot)`` in ``dtype``.

        The same tensors transformers' rotary module returns for these ``position_ids`` (attention
        factor included), in ``dtype`` as the model casts them to its activations' dtype.

        Args:
            positions: absolute token positions (an integer tensor: int8 ... int64 or uint8).
            dtype: the model's activation dtype (floating point).
            seq_len: length-dependent rope types only (dynamic, longrope): the sequence length the
                rotary module had seen when the keys were produced; default ``max(positions) + 1``.

        Raises:
            TypeError: ``positions`` is no integer tensor (bool, float, complex, a list) or ``dtype`` no floating dtype.
            ValueError: ``positions`` has another shape or a negative entry, or ``seq_len < max(positions) + 1``.
        """
        if not isinstance(positions, torch.Tensor) or positions.dtype not in _INT_DTYPES:
            raise TypeError(f"positions must be an integer torch.Tensor, got {positions!r:.80}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype (the activations'), got {dtype}")
        if positions.dim() == 1:
            positions = positions[None]
        if positions.dim() != 2:
            raise ValueError(f"positions must be (T,) or (B, T), got shape {tuple(positions.shape)}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
        if seq_len is not None and positions.numel() and seq_len < int(positions.max()) + 1:
            raise ValueError(
                f"seq_len={seq_len} is shorter than max(positions) + 1 = {int(positions.max()) + 1}"
            )
        if self.rot_dim == 0:
            empty = torch.zeros((*positions.shape, 0), dtype=dtype, device=positions.device)
            return empty, empty.clone()
        return self._forward(positions, dtype, seq_len)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, seq_len: int | None = None) -> torch.Tensor:
        """``apply_rope`` of ``x`` ``(B, H, T, D)`` at ``positions`` ``(T,)`` or ``(B, T)``."""
        self._check_x(x)
        cos, sin = self.cos_sin(positions, x.dtype, seq_len=seq_len)
        return apply_rope(x, cos.to(x.device), sin.to(x.device))

    def unrotate(
        self, x: torch.Tensor, positions: torch.Tensor, *, seq_len: int | None = None
    ) -> torch.Tensor:
        """``invert_rope`` of post-RoPE ``x`` ``(B, H, T, D)`` at ``positions``."""
        self._check_x(x)
        cos, sin = self.cos_sin(positions, x.dtype, seq_len=seq_len)
        return invert_rope(x, cos.to(x.device), sin.to(x.device))

    def _check_x(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must be (B, H, T, D={self.head_dim}), got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be floating point (keys), got {x.dtype}")

    # ----------------------------------------------------------------------------- validation

    def _check_convention(self) -> bool:
        """Compare ``apply_rope`` with the family's ``apply_rotary_pos_emb`` on a random probe."""
        ref = getattr(self._module, "apply_rotary_pos_emb", None)
        if ref is None or self.rot_dim == 0:
            return False
        gen = torch.Generator().manual_seed(0)
        T = 5
        x = torch.randn(1, 2, T, self.head_dim, generator=gen).to(self.device)
        cos, sin = self.cos_sin(torch.arange(T, device=self.device) * 7)
        ours = apply_rope(x, cos, sin)
        got = None
        # (q, k, cos, sin) -> (q, k), or one tensor (x, cos, sin) -> x (Gemma 3n / 4, DeepSeek-V4); some families
        # slice the rotary part themselves
        calls = [(probe, (probe, probe, cos, sin)) for probe in (x, x[..., : self.rot_dim])]
        calls += [(probe, (probe, cos, sin)) for probe in (x, x[..., : self.rot_dim])]
        for probe, args in calls:
            try:
                out = ref(*args)
            except (
                TypeError,
                ValueError,
                RuntimeError,
                IndexError,
            ) as exc:  # not the signature/shape we probe
                logger.debug(
                    "probing apply_rotary_pos_emb (%d args) with D=%d failed: %s", len(args), probe.shape[-1], exc
                )
                continue
            if len(args) == 4 and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
                got = out[1]
            elif len(args) == 3 and isinstance(out, torch.Tensor) and out.shape[:-1] == probe.shape[:-1]:
                got = out
            else:
                continue
            if got.shape[-1] != self.head_dim:
                got = torch.cat((got, x[..., got.shape[-1] :]), dim=-1)
            break
        if got is None or got.shape != ours.shape:
            logger.debug("could not probe %s.apply_rotary_pos_emb", getattr(self._module, "__name__", "?"))
            return False
        if not torch.allclose(got, ours, atol=1e-5, rtol=1e-5):
            if self._half_tables_match(ref, x, cos, sin):
                return True
            raise NotImplementedError(
                f"model_type {self.model_type!r} applies RoPE in a layout other than rotate-half "
                "(e.g. interleaved pairs); kvbits.quant.rope supports the rotate-half convention only"
            )
        return True

    def _half_tables_match(self, ref: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Tables ``D / 2`` wide whose halves differ, which ``apply_rope`` read as partial rotary: if the
        family's ``apply_rotary_pos_emb`` rotates the halves by them (gpt-oss), they are rotate-half
        tables given once. Then :attr:`half_tables` is set (``cos_sin`` duplicates them) and True returned."""
        if self.half_tables or 2 * self.rot_dim != self.head_dim or self.halves_equal:
            return False
        try:
            got = ref(x, x, cos, sin)
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            logger.debug("probing apply_rotary_pos_emb with half-width tables failed: %s", exc)
            return False
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], torch.Tensor)):
            return False
        ours = apply_rope(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))
        if got[1].shape != ours.shape or not torch.allclose(got[1], ours, atol=1e-5, rtol=1e-5):
            return False
        self.half_tables = True
        self._probe()
        return True
