"""Checks on a model handed over as an object (``evaluate``, ``simulate``, ``stream_hidden``, ``use_fused_decode``).

A name or a path goes through ``kvbits.evaluate.models.load_model``; an object must already be a transformers
model: a ``torch.nn.Module`` with a ``config``, whose attention modules carry a ``layer_idx``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["attention_modules", "check_model", "check_model_arg"]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention modules (they carry a ``layer_idx`` and call the attention interface with ``self``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and "Attention" in type(m).__name__
    ]


def attending_layers(model: torch.nn.Module, n_layers: int) -> list[int]:
    """Indices in ``[0, n_layers)`` of the layers with an attention module: all of them, but for a hybrid model
    (LFM2, Jamba, Qwen3-Next, ...), whose convolution / linear-attention / state-space layers cache no K/V."""
    return sorted({m.layer_idx for m in attention_modules(model) if 0 <= m.layer_idx < n_layers})


def check_every_layer_attends(model: torch.nn.Module, n_layers: int, where: str, instead: str) -> None:
    """``ValueError`` for a hybrid model (:func:`attending_layers`) at an entry point ``where`` that runs the real
    cache, which holds attention layers only (transformers' hybrid caches keep the other layers' states);
    ``instead``: what the user can run."""
    attending = attending_layers(model, n_layers)
    if attending != list(range(n_layers)):
        raise ValueError(
            f"{where} runs the real cache, which holds attention layers only: {type(model).__name__} has layers "
            f"without attention (convolution, linear-attention or state-space; layers with attention: {attending} "
            f"of {n_layers}); {instead}"
        )


def check_model(model: Any, where: str = "", *, attention: bool = False, by_name: bool = False) -> None:
    """``TypeError`` unless ``model`` is a transformers model (a ``torch.nn.Module`` with a ``config``).

    ``where`` names the entry point at the head of the message (``"simulate"``), if given. ``attention``:
    also ``ValueError`` when the model has no attention modules with a ``layer_idx`` (a state-space model
    such as Mamba keeps no KV cache: there is nothing to quantize or to route through the fused kernel).
    ``by_name``: the message says that the entry point also takes a name or path and a ``LoadedModel``.
    """
    head = f"{where}: " if where else ""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        what = "None" if model is None else type(model).__name__
        also = "a model name or path, a LoadedModel, or " if by_name else ""
        raise TypeError(
            f"{head}model must be {also}a transformers model (a torch.nn.Module with a .config, e.g. from "
            f"AutoModelForCausalLM.from_pretrained or kvbits.evaluate.load_model(...).model), got {what}"
        )
    if attention and not attention_modules(model):
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
