"""Where a transformers model's K/V come from, layer by layer: the one rule ``kvbits analyze``
(:mod:`kvbits.analyze.collect`) and ``kvbits calibrate`` (:mod:`kvbits.calibrate.observers`) share.

- **Where**: the decoder whose K/V the cache holds, ``model.get_decoder()`` when that is a submodule of the
  model (the language model of a vision-language model: the attention modules of a vision tower, such as
  Gemma 3's SigLIP or LLaVA's CLIP, cache nothing; the decoder stack of an encoder-decoder model); else
  the whole model.
- **Sites**: every module there with ``k_proj`` and ``v_proj`` submodules (Llama/Mistral/Qwen/Gemma-style
  attention; fused QKV projections such as GPT-2's ``c_attn`` are not supported), or with ``k_proj``
  and ``v_proj = None`` (Gemma 4's global layers with ``attention_k_eq_v``: the values are the keys'
  projection, through ``v_norm``). Keys are read at
  the key norm when there is one, values at ``v_norm`` when there is one (:mod:`kvbits.analyze.taps`).
- **Layer**: the module's ``layer_idx`` (else its position among the sites). Indices may skip layers
  that cache no K/V of their own (linear-attention or convolution layers of hybrid models, Gemma 4's
  KV-sharing layers); two sites on one layer are refused (the cross-attention of encoder-decoder
  models shares its layer's index; its K/V are the encoder's, not the decoder's cache), and so is an attention
  block that several layers call (Zamba's and Zamba2's hybrid layers: :func:`kvbits._model.shared_attention`;
  ``kvbits analyze`` and ``kvbits calibrate`` read those at ``cache.update`` instead:
  :mod:`kvbits.calibrate.cache_capture`).
- **Heads** ``(H_kv, D)``: the layer's as the planner counts them and ``QuantizedKVCache`` sizes its
  layers (:func:`kvbits.plan.config.layer_heads`: the decoder's text config, an explicit ``head_dim``
  such as Gemma's or Llama 3.2's, ``num_key_value_heads`` for GQA, one head for ``multi_query``,
  per-layer configs of heterogeneous models). The module must agree with them: its ``head_dim`` and
  ``num_key_value_heads`` attributes where it has them, and ``H_kv x D`` outputs of ``k_proj`` and
  ``v_proj``. A model without a config falls back to the module's ``head_dim`` and ``k_proj``'s size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbits._model import check_causal_lm, shared_attention_note
from kvbits.analyze.taps import capture_point
from kvbits.analyze.taps import value_proj as _value_proj
from kvbits.plan.config import latent_attention, latent_attention_message, layer_heads, text_config

__all__ = ["KVSite", "attention_sites"]


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


def _int_attr(module: torch.nn.Module, name: str) -> int | None:
    v = getattr(module, name, None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _heads(name: str, attention: torch.nn.Module, layer_idx: int, config: Any) -> tuple[int, int]:
    """``(H_kv, D)`` of one attention module, checked against the module (see the module docstring)."""
    own_kv, own_d = _int_attr(attention, "num_key_value_heads"), _int_attr(attention, "head_dim")
    k_out = _int_attr(attention.k_proj, "out_features")
    if config is not None:
        try:
            _, n_kv, head_dim = layer_heads(config, layer_idx)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        source = f"the config's layer {layer_idx}"
        if own_d is not None and own_d != head_dim:
            raise ValueError(f"{name} has head_dim {own_d}, expected {head_dim} from {source}")
    else:
        if own_d is None:
            raise ValueError(f"{name}: can not tell the head dim (no head_dim attribute and no model.config)")
        head_dim, source = own_d, "the module"
        if own_kv is not None:
            n_kv = own_kv
        elif k_out is not None and k_out % head_dim == 0:
            n_kv = k_out // head_dim
        else:
            raise ValueError(
                f"{name}: can not tell the number of KV heads (no num_key_value_heads attribute, no model.config, "
                f"k_proj outputs {k_out} for head_dim {head_dim})"
            )
    if own_kv is not None and own_kv != n_kv:
        raise ValueError(f"{name} has num_key_value_heads {own_kv}, expected {n_kv} from {source}")
    for proj in ("k_proj", "v_proj"):
        out = _int_attr(getattr(attention, proj, None), "out_features")
        if out is not None and out != n_kv * head_dim:
            raise ValueError(
                f"{name}.{proj} has {out} outputs, expected num_key_value_heads x head_dim = "
                f"{n_kv} x {head_dim} = {n_kv * head_dim} from {source}"
            )
    return n_kv, head_dim


def _check_not_latent(model: torch.nn.Module, config: Any) -> None:
    """Refuse multi-head latent attention (``kv_lora_rank`` in any layer's config: DeepSeek-V2/V3 style) by name,
    as the caches and the planner do: its attention has no ``k_proj``/``v_proj`` (a compressed latent and a rotary
    key part are cached instead), which the site search would otherwise blame on fused QKV projections."""
    if config is None:
        return
    text = text_config(config)
    if (latent := latent_attention(text)) is not None:
        why = "its attention has no k_proj/v_proj for the K/V site search to read"
        raise ValueError(latent_attention_message(text, latent, type(model).__name__, "kvbits", why))


def _decoder(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """``(qualified name, module)`` of the decoder whose K/V the cache holds: ``model.get_decoder()`` (the
    language model of a vision-language model such as ``Gemma3ForConditionalGeneration`` or Qwen2-VL, whose
    vision tower's attention modules are not cached; the decoder stack of an encoder-decoder model), when
    it is a submodule of ``model``; else ``("", model)``."""
    get = getattr(model, "get_decoder", None)
    if not callable(get):
        return "", model
    try:
        decoder = get()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return "", model
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return "", model
    for name, mod in model.named_modules():
        if mod is decoder:
            return name, decoder
    return "", model


def attention_sites(model: torch.nn.Module) -> list[KVSite]:
    """Every attention layer's K/V capture points, ordered by layer index (rules: the module docstring).

    Raises:
        ValueError: not a decoder-only causal LM (``kvbits._model.check_causal_lm``: an encoder, an
            encoder-decoder); multi-head latent attention (``kv_lora_rank``: DeepSeek-V2/V3); an attention block
            shared by several layers (Zamba, Zamba2); no attention module
            with ``k_proj`` and ``v_proj``; two on one layer; a module whose head dim or KV heads disagree with
            the config.
    """
    check_causal_lm(model)
    shared = shared_attention_note(model)
    if shared:  # Zamba's sites were numbered by discovery ("sites on layers [0, 1], none on [2, 4]")
        raise ValueError(f"expected one K/V site per layer: {shared}")
    config = getattr(model, "config", None)
    _check_not_latent(model, config)
    prefix, decoder = _decoder(model)
    found: list[tuple[str, torch.nn.Module, int]] = []
    for name, mod in decoder.named_modules(prefix=prefix):
        if not isinstance(getattr(mod, "k_proj", None), torch.nn.Module) or _value_proj(mod) is None:
            continue
        idx = getattr(mod, "layer_idx", None)
        found.append((name or type(mod).__name__, mod, len(found) if idx is None else int(idx)))
    if not found:
        where = f" (in its decoder {prefix})" if prefix else ""
        raise ValueError(
            f"{type(model).__name__} has no attention module with separate k_proj and v_proj submodules{where}; "
            "models with fused QKV projections (GPT-2 c_attn, Phi-3 qkv_proj) are not supported"
        )
    seen: dict[int, str] = {}
    for name, _, idx in found:
        if idx in seen:
            why = (
                "an attention block shared by several layers (Zamba2's, layer_idx -1) is not supported" if idx < 0
                else "cross-attention of encoder-decoder models is not supported"
            )
            raise ValueError(
                f"{seen[idx]} and {name} are both attention layer {idx}; expected one K/V site per layer ({why})"
            )
        seen[idx] = name
    sites = []
    for name, mod, idx in sorted(found, key=lambda f: f[2]):
        n_kv, head_dim = _heads(name, mod, idx, config)
        key_module, key_proj = capture_point(mod, "key")
        value_module, value_proj = capture_point(mod, "value")
        sites.append(KVSite(idx, key_module, value_module, n_kv, head_dim, name, key_proj, value_proj))
    return sites
