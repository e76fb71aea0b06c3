"""The longest context a GPU budget holds: :func:`max_context`.

A sequence grows one token at a time, and a quantized cache's bytes do not grow monotonically with it:
each flush turns a block of full-precision tokens into codes (the bytes drop), sliding-window layers drop
blocks that left the window. So the longest context is defined by the first length that does *not* fit:
``max_context`` is the largest ``T`` such that ``batch`` sequences fit at **every** length ``1..T``.

It is found exactly, without scanning every length: the bytes are a rising trend with a bounded sawtooth,
so once a length ``t`` fits, no length below ``t - M`` can fail, where ``M`` (:func:`_margin`) follows from
each layer's full-precision buffer, its quantized bytes per token and the sliding layers' largest bytes.
A doubling search and a bisection find a length that fits followed by one that does not, and the ``M``
lengths below are checked one by one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from kvbits.plan.shape import LayerShape, ModelShape
from kvbits.schemes import KVScheme, layer_bytes, token_split
from kvbits.schemes.accounting import PACKED_KINDS, rope_table_bytes

__all__ = ["LIMIT", "fused_rope_table_bytes", "max_concurrency", "max_context", "total_bytes"]

LIMIT = 1 << 40
"""Contexts beyond this are not searched: a budget that still fits there is reported as unbounded (None)."""

_Group = tuple[KVScheme, LayerShape]


def fused_pre_rope(scheme: KVScheme) -> bool:
    """Pre-RoPE keys the fused kernel reads from its packed layout (and rotates from RoPE tables); it declines
    rotated pre-RoPE keys and centred / smoothed values (``kvbits.cache.fused.layout_reason``): no tables."""
    return (
        scheme.key.pre_rope and scheme.key.kind in PACKED_KINDS and scheme.value.kind in PACKED_KINDS
        and scheme.key.rotate is None and not scheme.value.has_channel_transform
    )  # fmt: skip


def fused_rope_table_bytes(layers: Iterable[tuple[KVScheme, LayerShape]], n_tokens: int) -> int:
    """The RoPE tables fused decode keeps for ``(layer scheme, layer shape)`` pairs after ``n_tokens`` tokens:
    one float32 cos/sin pair per head dim and table width (``LayerShape.rope_tables``: none for a layer without
    RoPE or one the fused path declines), covering the positions the quantized pre-RoPE keys reach
    (``RopeTableCache.get(rotary, n_sinks + n_dropped + T_q, ...)``), full-attention layers only."""
    positions: dict[tuple[int, str], int] = {}  # (head dim, table width) -> positions the tables must cover
    for s, layer in layers:
        if layer.attention == "full" and layer.rope_tables != "none" and fused_pre_rope(s):
            split = token_split(s, n_tokens)
            if split.quantized:
                key = (layer.head_dim, layer.rope_tables)
                positions[key] = max(positions.get(key, 0), split.sink + split.quantized)
    return sum(rope_table_bytes(n, d // 2 if kind == "half" else d) for (d, kind), n in positions.items())


def _groups(shape: ModelShape, scheme: KVScheme) -> Counter[_Group]:
    """Layers that hold the same bytes at every length: ``(layer scheme, layer shape) -> count``."""
    return Counter(
        (scheme.for_layer(i), layer) for i, layer in enumerate(shape.layers) if layer.attention != "none"
    )


def _layer_total(group: _Group, n: int, batch: int, dtype_bytes: int) -> int:
    s, layer = group
    b = layer_bytes(
        s, n, batch=batch, n_heads=layer.kv_heads, head_dim=layer.head_dim, full_dtype_bytes=dtype_bytes,
        sliding_window=layer.window,
    )  # fmt: skip
    return b["key"] + b["value"]


def total_bytes(
    shape: ModelShape, scheme: KVScheme, context: int, batch: int, *, fused_decode: bool = False
) -> int:
    """``plan(...)["total_bytes"]`` at ``context``, computed once per distinct layer (fast; tested equal)."""
    return _total_fn(shape, scheme, batch, fused_decode)(context)


def _total_fn(shape: ModelShape, scheme: KVScheme, batch: int, fused_decode: bool) -> Callable[[int], int]:
    groups = _groups(shape, scheme)

    def total(n: int) -> int:
        out = sum(c * _layer_total(g, n, batch, shape.dtype_bytes) for g, c in groups.items())
        return out + (fused_rope_table_bytes(groups, n) if fused_decode else 0)

    return total


def _margin(shape: ModelShape, scheme: KVScheme, batch: int) -> int | None:
    """``M``: once a length ``t`` fits, every length ``<= t - M`` fits too; None without full-attention layers
    (the bytes are then bounded, see :func:`max_context`).

    Per full layer, with ``rate`` its bytes per token over whole quantized blocks (metadata included), ``fb``
    the bytes of one full-precision token and ``R = sinks + residual + block`` (more than the sinks and the
    buffer ever hold): from ``u`` to ``t > u`` the layer gains at least ``(t - u) * rate - R * fb`` bytes. A
    sliding layer may lose at most its largest bytes. ``M`` makes the sum of gains non-negative.
    """
    rate = 0  # bytes per token the full layers add over whole blocks
    slack = 0  # bytes a shorter length may hold above that trend
    for (s, layer), count in _groups(shape, scheme).items():
        def total(n: int, g: _Group = (s, layer)) -> int:
            return _layer_total(g, n, batch, shape.dtype_bytes)

        if layer.attention == "sliding":
            span = layer.window + 2 * (s.sinks + s.residual + s.block)  # steady state, one period past it
            slack += count * max(total(n) for n in range(span + 1))
        elif s.is_identity:
            rate += count * (total(1) - total(0))
        else:
            start, n_blocks = s.sinks + s.residual + s.block, 64  # the first flush: whole blocks from here on
            rate += count * (total(start + n_blocks * s.block) - total(start)) / (n_blocks * s.block)
            fb = batch * layer.kv_heads * layer.head_dim * 2 * shape.dtype_bytes
            slack += count * (s.sinks + s.residual + s.block) * fb
    if rate <= 0:
        return None
    return math.ceil(slack / rate) + 1


def _bounded_span(shape: ModelShape, scheme: KVScheme) -> int:
    """Lengths ``1..span`` reach the largest bytes of a model whose bytes are bounded (sliding layers only)."""
    return max(
        (2 * (layer.window or 0) + 4 * (s.sinks + s.residual + s.block) for s, layer in _groups(shape, scheme)),
        default=0,
    )


def _peak_candidates(shape: ModelShape, scheme: KVScheme, context: int) -> range:
    """Lengths ``<= context`` among which the bytes reach their largest over ``1..context`` (at any batch)."""
    margin = _margin(shape, scheme, 1)  # batch cancels out: the trend and the slack both scale with it
    if margin is None:
        return range(1, min(context, _bounded_span(shape, scheme)) + 1)
    return range(max(1, context - margin), context + 1)


def max_concurrency(
    shape: ModelShape,
    scheme: KVScheme,
    context: int,
    *,
    free_bytes: int,
    fused_decode: bool = False,
) -> tuple[int, int]:
    """``(per_request, concurrency)``: how many sequences fit in ``free_bytes`` at every length ``1..context``.

    ``per_request`` is the most bytes one sequence adds at any length ``<= context`` (a flush makes the bytes
    drop, so the length just before one may hold more than ``context`` does); the per-layer constants and the
    RoPE tables, held once whatever the batch, are not in it. ``concurrency`` is the largest batch that fits
    at every such length (at least 0), so it agrees with :func:`max_context`: ``concurrency >= batch``
    exactly when ``max_context(..., batch=batch) >= context``.
    """
    per_seq = _total_fn(shape, scheme, 1, False)
    fixed = per_seq(0)  # per-layer constants: the bytes at 0 tokens
    groups = _groups(shape, scheme)
    concurrency, peak = None, 0
    for n in _peak_candidates(shape, scheme, context):
        request = per_seq(n) - fixed
        rope = fused_rope_table_bytes(groups, n) if fused_decode else 0
        fit = max(0, (free_bytes - fixed - rope) // request)
        concurrency = fit if concurrency is None else min(concurrency, fit)
        peak = max(peak, request)
    assert concurrency is not None
    return peak, concurrency


def max_context(
    shape: ModelShape,
    scheme: KVScheme,
    *,
    batch: int,
    free_bytes: int,
    fused_decode: bool = False,
) -> int | None:
    """The largest ``T`` such that ``batch`` sequences fit in ``free_bytes`` at every length ``1..T``.

    Args:
        shape: the model (``kvbits.plan.load_shape``).
        scheme: the scheme (a mixed scheme is per layer).
        batch: sequences held at once, all of the same length.
        free_bytes: what the KV cache may hold: GPU memory less weights and reserve.
        fused_decode: count the RoPE tables fused pre-RoPE decode keeps (as :func:`kvbits.plan.plan`).

    Returns:
        ``T`` (0 when not even one token per sequence fits), or None when every length fits: a model whose
        layers all slide (their bytes stop growing) or that stores no K/V, or a budget beyond ``LIMIT`` tokens.
    """
    f = _total_fn(shape, scheme, batch, fused_decode)
    margin = _margin(shape, scheme, batch)
    if margin is None:  # bounded bytes: sliding layers only (or none), whose largest is reached early
        span = _bounded_span(shape, scheme)
        first = next((n for n in range(1, span + 1) if f(n) > free_bytes), None)
        return None if first is None else first - 1
    if f(1) > free_bytes:
        return 0
    lo, hi = 1, 2
    while f(hi) <= free_bytes:
        lo, hi = hi, hi * 2
        if hi > LIMIT:
            return None
    while hi - lo > 1:  # f(lo) fits, f(hi) does not
        mid = (lo + hi) // 2
        if f(mid) <= free_bytes:
            lo = mid
        else:
            hi = mid
    # lo fits, so no length below lo - margin fails; the first failure is in (lo - margin, hi]
    return next(n for n in range(max(1, lo - margin + 1), hi + 1) if f(n) > free_bytes) - 1
