"""Diagonal Fisher information of the K/V activations (KVQuant §3.3).

KVQuant weights each calibration activation by ``F_ii ≈ g_i**2``, the squared gradient of the
language-model loss with respect to that activation, so the codebook minimises an approximation of
the loss increase rather than plain MSE. Here: one forward and backward pass per calibration window
with the model's weights frozen (no weight gradients: they would cost a model-sized buffer) and the
input embeddings turned into a leaf that requires grad, so gradients reach every K/V activation
through the whole network; ``KVCapture(retain_grad=True)`` keeps them.

Cost on CPU in float32: about 3x a forward pass; memory: the activations of one window (for
SmolLM2-135M at 2,048 tokens, ~2 GB, dominated by the logits).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)


@contextmanager
def activation_gradients(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``backward()`` gives gradients for activations but not for weights.

    Freezes every parameter and makes the input-embedding output a grad-requiring leaf; restores the
    parameters' ``requires_grad`` flags and removes the hook on exit (also on error).
    """
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        raise ValueError(
            f"{type(model).__name__} has no get_input_embeddings(); can not compute Fisher weights"
        )

    def leaf(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output.detach().requires_grad_(True)

    handle = None
    try:
        for p in params:
            p.requires_grad_(False)
        handle = embed.register_forward_hook(leaf)
        yield
    finally:
        if handle is not None:
            handle.remove()
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def window_loss(model: torch.nn.Module, ids: torch.Tensor, *, backward: bool) -> float:
    """Mean next-token loss of ``ids`` ``(B, T)``; with ``backward=True`` also back-propagates it.

    Run inside ``activation_gradients(model)`` (and a ``KVCapture(retain_grad=True)``) to collect K/V
    gradients; without ``backward`` the pass runs under ``torch.no_grad``.
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    if not backward:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    with torch.enable_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        if not loss.requires_grad:
            raise RuntimeError("loss does not require grad; run inside activation_gradients(model)")
        loss.backward()
        value = float(loss.detach())
    del out, loss
    return value
