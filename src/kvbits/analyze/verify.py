"""Are the K/V the hooks read the K/V the model caches? One short forward says.

``kvbits analyze`` and ``kvbits calibrate`` read keys at ``k_proj`` (or the key norm a family applies before
RoPE) and rotate them with :class:`kvbits.quant.rope.RotaryTables`; values at ``v_proj`` (or ``v_norm``). A
family that changes its keys after RoPE (HunYuan's ``key_layernorm``) or its values after the projection
caches something else, and every statistic, scale and recommendation drawn from the hooks would describe
tensors the cache never holds (85 % off on HunYuan-Dense). :func:`verify_taps` runs the first tokens of a
window once with the model's own cache and compares, per layer, the hooked tensors (keys rotated) with the
cached ones; a layer whose relative error exceeds :data:`TOLERANCE` is refused, naming the layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvbits.analyze.stats import NonFiniteKV
from kvbits.quant.rope import apply_rope

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "verify_taps"]

# relative error ||hooked - cached|| / ||cached||: a bfloat16 model rotating in its own dtype stays near 2**-8
TOLERANCE = 0.05
PROBE_TOKENS = 16


def _relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.float()
    return float((mine - theirs).norm() / theirs.norm().clamp_min(torch.finfo(torch.float32).tiny))


@torch.no_grad()
def verify_taps(model: torch.nn.Module, ids: torch.Tensor, key_tables: Sequence[Any] | None) -> None:
    """Compare the hooked K/V of one forward over ``ids[:1, :16]`` with the cache the model fills.

    Args:
        model: a transformers causal LM.
        ids: token ids ``(W, T)``; the first window's first tokens are run.
        key_tables: per attention site (``kvbits.analyze.sites.attention_sites`` order), the layer's
            ``RotaryTables`` or None for a layer without RoPE (its cached keys are the hooked ones); ``None``
            as a whole: RoPE kvbits can not reproduce (interleaved pairs), keys are not compared.

    Raises:
        NonFiniteKV: a layer's cached keys or values hold NaN / inf (the relative error would be NaN, and the
            family blamed for the model's overflow).
        ValueError: a layer's hooked keys (rotated) or values differ from the cached ones by more than
            ``TOLERANCE`` (relative): the family transforms them where kvbits does not look.
    """
    from kvbits.analyze.collect import kv_hooks, last_logits_only

    n = min(int(ids.shape[-1]), PROBE_TOKENS)
    got: dict[tuple[int, str], torch.Tensor] = {}

    def keep(layer: int, kind: str, x: torch.Tensor) -> None:
        got[layer, kind] = x.float()

    device = next(model.parameters()).device
    with kv_hooks(model, keep) as sites:
        out = model(input_ids=ids[:1, :n].to(device), use_cache=True, **last_logits_only(model))
    # "cache" from transformers 5.24, "past_key_values" before: asking for the old name first (even `in`) logs
    # transformers' deprecation warning on every kvbits analyze and calibrate run
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if layers is None:
        logger.debug("the model returned no cache with layers (%s): hooks not verified", type(cache).__name__)
        return
    for j, site in enumerate(sites):
        i = site.layer_idx
        held = layers[i] if i < len(layers) else None
        keys, values = getattr(held, "keys", None), getattr(held, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.numel() == 0:
            continue  # a layer type that caches no K/V of its own here
        k, v = got.get((i, "key")), got.get((i, "value"))
        if k is None or v is None:
            continue
        m = keys.shape[2]  # a sliding layer keeps its last tokens
        pairs = [("values", v[:, :, n - m :], values)]
        rope = False  # were the hooked keys rotated before the comparison (for the message)
        if key_tables is not None:
            tables = key_tables[j]
            if tables is not None:
                rope = tables.rot_dim > 0
                cos, sin = tables.cos_sin(torch.arange(n), torch.float32)
                k = apply_rope(k, cos.to(k.device), sin.to(k.device))
            pairs.insert(0, ("keys", k[:, :, n - m :], keys))
        for what, mine, theirs in pairs:
            if mine.shape != theirs.shape:
                logger.debug("layer %d %s: hooked %s vs cached %s, not compared", i, what, mine.shape, theirs.shape)
                continue
            bad = int((~torch.isfinite(theirs)).sum())
            if bad:  # a NaN relative error would blame the family for the model's own overflow
                raise NonFiniteKV(
                    f"{site.name} (layer {i}): {bad} non-finite {what} (NaN / inf) in the model's cache over the first "
                    f"{n} tokens of the first window; expected finite activations (a float16 overflow? try --dtype "
                    "float32 or bfloat16; or weights holding NaN / inf)"
                )
            err = _relative(mine, theirs.to(mine.device))
            if not err <= TOLERANCE:
                where = "after RoPE, " if what == "keys" and rope else ""
                rotated = ", rotated by the model's RoPE tables" if what == "keys" and rope else ""
                raise ValueError(
                    f"{site.name} (layer {i}): the {what} kvbits reads ({_source(site, what)}{rotated}) differ "
                    f"from the {what} the model caches by {err:.1%} (relative); this family transforms its {what} "
                    f"{where}where kvbits does not read them (e.g. HunYuan's key_layernorm after RoPE), so its "
                    f"statistics and scales would describe tensors the cache never holds: not supported"
                )


def _source(site: Any, what: str) -> str:
    """Which module's output the hooks read for ``what`` (``"keys"`` / ``"values"``), for messages."""
    module = site.key_module if what == "keys" else site.value_module
    return f"the output of its {type(module).__name__}"
