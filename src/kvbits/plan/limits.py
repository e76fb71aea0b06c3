"""The longest context a GPU budget holds: :func:`max_context`.

A sequence grows one token at a time, and a quantized cache's bytes do not grow monotonically with it:
each flush turns a block of full-precision tokens into codes (the bytes drop), sliding-window layers drop
blocks that left the window. So the longest context is defined by the first length that does *not* fit:
``max_context`` is the largest ``T`` such that ``batch`` sequences fit at **every** length ``1..T``.

It is found exactly, without scanning lengths, from two facts about the bytes ``f(n)`` at length ``n``
(:func:`_sawtooth`; ``tests/test_plan_limits.py`` checks both by brute force and holds the search equal to
a length-by-length one):

- ``f(n + P) >= f(n)`` for every ``n``, ``P`` the least common multiple of the quantizing layers' blocks: one
  period on, each layer holds the same full-precision tokens and as many or more quantized blocks (a sliding
  layer as many, once its window is full). So the largest bytes over ``1..n`` are reached in ``n - P < t <= n``.
- ``f(n + 1) >= f(n)`` unless a layer flushes a block or drops one from its window at ``n + 1``, which happens
  at lengths of known residues modulo its block. So within ``n - P < t <= n`` the largest bytes are at ``n`` or
  just before such a drop: a few lengths per period.

The peak over ``1..n`` is then monotone in ``n`` and cheap, and a doubling search and a bisection on it find the
first length that does not fit; :func:`max_concurrency` reads the same few lengths below the context.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from kvbits.plan.shape import LayerShape, ModelShape
from kvbits.schemes import KVScheme, layer_bytes, token_split
from kvbits.schemes.accounting import PACKED_KINDS, rope_table_bytes, sliding_falls_back

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


def _sawtooth(shape: ModelShape, scheme: KVScheme) -> tuple[int, list[tuple[int, int]]]:
    """``(period, drops)``: the bytes at ``n + period`` are at least those at ``n``, and the bytes at ``n + 1`` are
    at least those at ``n`` unless ``n + 1 ≡ residue (mod block)`` for some ``(block, residue)`` in ``drops``.

    A layer that quantizes nothing (an identity scheme, or a sliding window its scheme keeps in full precision:
    ``sliding_falls_back``) only grows, or stays level once its window is full. A full-attention layer drops when
    it flushes, at ``n = sinks + residual + k * block``; a sliding one when it flushes (``n = residual + k * block``:
    it keeps no sinks) and when a block leaves its window (``n = window - 1 + k * block``). The fused RoPE tables
    only grow. ``period`` is the least common multiple of the quantizing layers' blocks (1 when none quantize).
    """
    period, drops = 1, set()
    for s, layer in _groups(shape, scheme):
        if s.is_identity or (layer.attention == "sliding" and sliding_falls_back(s, layer.window)):
            continue
        period = math.lcm(period, s.block)
        if layer.attention == "sliding":
            drops |= {(s.block, s.residual % s.block), (s.block, (layer.window - 1) % s.block)}
        else:
            drops.add((s.block, (s.sinks + s.residual) % s.block))
    return period, sorted(drops)


def _peak_lengths(period: int, drops: list[tuple[int, int]], n: int) -> list[int]:
    """Lengths in ``max(1, n - period + 1)..n`` among which the bytes (and the smallest batch that fits) reach their
    extremes over ``1..n``: ``n`` and the length before each drop (:func:`_sawtooth`)."""
    lo = max(1, n - period + 1)
    ends = {n}
    for block, residue in drops:
        first = lo + 1 + (residue - lo - 1) % block  # the first length > lo of this residue
        ends.update(range(first - 1, n, block))
    return sorted(ends)


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
    for n in _peak_lengths(*_sawtooth(shape, scheme), context):
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
    period, drops = _sawtooth(shape, scheme)

    def fits(n: int) -> bool:  # at every length 1..n
        return all(f(t) <= free_bytes for t in _peak_lengths(period, drops, n))

    if fits(LIMIT):  # the bytes stay bounded (layers that all slide, or none) or the budget is beyond LIMIT
        return None
    lo, hi = 0, 1  # 1..lo fits (none when 0), 1..hi does not
    while fits(hi):
        lo, hi = hi, min(2 * hi, LIMIT)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
