"""Checks on a model handed over as an object (``evaluate``, ``simulate``, ``stream_hidden``, ``use_fused_decode``).

A name or a path goes through ``kvbits.evaluate.models.load_model``; an object must already be a transformers
model: a ``torch.nn.Module`` with a ``config``, whose attention modules carry a ``layer_idx``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "attention_modules", "check_causal_lm", "check_model", "check_model_arg", "check_weights_loaded", "hybrid_layers",
    "shared_attention",
]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention modules (they carry a ``layer_idx`` and call the attention interface with ``self``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and "Attention" in type(m).__name__
    ]


def shared_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention blocks that several decoder layers call (Zamba's, Zamba2's: the hybrid layers share one block).
    Such a block takes the calling layer's index as a ``forward`` argument and has no index of its own (its
    ``layer_idx`` is None in Zamba, -1 in Zamba2), so nothing that hooks the module per layer can tell which layer
    a call belongs to; the real cache can (the model passes the layer to ``cache.update``)."""
    found = []
    for m in model.modules():
        own = getattr(m, "layer_idx", "absent")
        if "Attention" not in type(m).__name__ or own == "absent" or (isinstance(own, int) and own >= 0):
            continue
        try:
            takes = "layer_idx" in inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            found.append(m)
    return found


def hybrid_layers(model: torch.nn.Module) -> list[int]:
    """The layers ``model``'s config types ``hybrid`` (attention plus a linear state: Zamba's, Zamba2's, which call
    its :func:`shared_attention` block), ascending; ``[]`` without ``layer_types``."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return [i for i, t in enumerate(types or ()) if t == "hybrid"]


def shared_attention_note(model: torch.nn.Module) -> str:
    """What a per-layer measure can not do on a model with a :func:`shared_attention` block and what runs it
    instead; ``""`` when the model has none."""
    shared = shared_attention(model)
    if not shared:
        return ""
    hybrid = hybrid_layers(model)
    by = f"layers {hybrid}" if hybrid else "several layers"
    if any(getattr(m, "layer_idx", None) is None for m in shared):  # Zamba: the simulator finds no module at all
        sim = "evaluate's mode='simulate'"
    else:  # Zamba2 (layer_idx -1): one scheme for every call
        sim = (
            "in evaluate's mode='simulate' mixed and calibrated schemes (hence kvbits tune) and the attention "
            "error / entropy"
        )
    return (
        f"{type(model).__name__}'s attention block {type(shared[0]).__name__} is shared by its hybrid {by} and "
        "has no per-layer layer_idx (the calling layer passes it), so the measures that hook attention modules "
        f"per layer ({sim}) are not supported; the real cache holds it "
        "(QuantizedKVCache, evaluate's mode='stream': `kvbits eval --mode stream`), and kvbits calibrate and "
        "kvbits analyze read its K/V where the cache receives them"
    )


def check_causal_lm(model: torch.nn.Module, where: str = "") -> None:
    """``ValueError`` unless ``model`` is a decoder-only causal LM, the one check every entry point makes (a model
    loaded by ``load_model``, one handed over as an object, the sites ``analyze`` / ``calibrate`` read): its config
    passes ``kvbits.plan.config.check_causal_config`` (no encoder-decoder, no encoder), and no attention module
    with a ``layer_idx`` has ``is_causal`` False (a bidirectional encoder's attention, or the cross-attention of an
    encoder-decoder's decoder, e.g. ``BartForCausalLM``, ``WhisperForCausalLM``). ``where`` heads the message."""
    from kvbits.plan.config import SUPPORTED_MODELS, check_causal_config

    head = f"{where}: " if where else ""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None:
        try:
            check_causal_config(config, what=name)
        except ValueError as exc:
            raise ValueError(f"{head}{exc}") from None
    modules = attention_modules(model)
    both_ways = [m for m in modules if getattr(m, "is_causal", None) is False]
    if not both_ways:
        return
    if len(both_ways) == len(modules):
        why = "its attention is bidirectional (is_causal False: an encoder), so it keeps no KV cache while decoding"
    else:
        cross = sorted({m.layer_idx for m in both_ways})
        why = (
            f"its layers {cross[:4]}{' ...' if len(cross) > 4 else ''} also attend to an encoder's output "
            f"(cross-attention, is_causal False: the decoder of an encoder-decoder model), whose K/V kvbits "
            "neither stores nor quantizes"
        )
    raise ValueError(f"{head}{name} is not a decoder-only causal LM: {why}; {SUPPORTED_MODELS}")


def check_weights_loaded(loading_info: dict[str, Any], source: str) -> None:
    """``ValueError`` when ``from_pretrained(..., output_loading_info=True)`` of ``source`` (a GGUF file or model
    folder) left parameters out: transformers initialises a weight the checkpoint lacks at random and only logs
    it, so a GGUF whose tensors it does not map (or a folder missing a shard) would be evaluated as a random model.
    ``loading_info``: its ``missing_keys`` (the parameter names not in the checkpoint)."""
    missing = sorted(loading_info.get("missing_keys") or ())
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): transformers would initialise them at random; expected a "
            "checkpoint holding every weight of its architecture (a file cut short, a shard missing, or tensor "
            "names transformers does not map)"
        )


def attending_layers(model: torch.nn.Module, n_layers: int) -> list[int]:
    """Indices in ``[0, n_layers)`` of the layers with an attention module: all of them, but for a hybrid model
    (LFM2, Jamba, Qwen3-Next, ...), whose convolution / linear-attention / state-space layers cache no K/V."""
    return sorted({m.layer_idx for m in attention_modules(model) if 0 <= m.layer_idx < n_layers})


def check_cache_holds(model: torch.nn.Module, where: str) -> None:
    """``ValueError`` at an entry point ``where`` that prefills into and decodes through the real cache, before any
    forward pass, when ``QuantizedKVCache(config=model.config)`` can not hold ``model``'s layers (its
    ``NotImplementedError``: ``hybrid_sliding`` layers, a sliding window plus a state in one layer). A hybrid
    model's ``conv`` / ``linear_attention`` layers are held (their states kept as ``DynamicCache`` keeps them), and
    Zamba's / Falcon-H1's ``hybrid`` layers (``QuantizedHybridLayer``: quantized K/V plus the state)."""
    from kvbits.cache import QuantizedKVCache

    try:
        QuantizedKVCache(config=model.config, scheme="fp16")  # stores nothing until its first update
    except NotImplementedError as exc:
        raise ValueError(f"{where} runs the real cache, which can not hold {type(model).__name__}: {exc}") from None


def check_model(
    model: Any, where: str = "", *, attention: bool = False, by_name: bool = False, causal: bool | None = None
) -> None:
    """``TypeError`` unless ``model`` is a transformers model (a ``torch.nn.Module`` with a ``config``).

    ``where`` names the entry point at the head of the message (``"simulate"``), if given. ``attention``:
    also ``ValueError`` when the model has no attention modules with a ``layer_idx`` (a state-space model
    such as Mamba keeps no KV cache: there is nothing to quantize or to route through the fused kernel).
    ``by_name``: the message says that the entry point also takes a name or path and a ``LoadedModel``.
    ``causal`` (default: ``attention``): also :func:`check_causal_lm` (encoders and encoder-decoders are refused).
    A :func:`shared_attention` block (Zamba's, no ``layer_idx``) counts as attention: the real cache holds it.
    """
    head = f"{where}: " if where else ""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        what = "None" if model is None else type(model).__name__
        also = "a model name or path, a LoadedModel, or " if by_name else ""
        raise TypeError(
            f"{head}model must be {also}a transformers model (a torch.nn.Module with a .config, e.g. from "
            f"AutoModelForCausalLM.from_pretrained or kvbits.evaluate.load_model(...).model), got {what}"
        )
    if attention if causal is None else causal:
        check_causal_lm(model, where)
    if attention and not attention_modules(model) and not shared_attention(model):
        raise ValueError(
            f"{head}{type(model).__name__} has no attention modules with a layer_idx, so it keeps no KV cache "
            "for kvbits to quantize (state-space and convolutional models such as Mamba are not supported)"
        )


def check_model_arg(model: Any, where: str) -> None:
    """``check_model`` for an entry point that also takes a name / path (``str``) or a ``LoadedModel``
    (those are checked once loaded); called before anything reads the model."""
    from kvbits.evaluate.models import LoadedModel

    if isinstance(model, (str, LoadedModel)):
        return
    check_model(model, where, attention=True, by_name=True)
