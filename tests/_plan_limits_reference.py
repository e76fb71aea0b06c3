"""The max-context search ``kvbits.plan.limits`` used before its sawtooth was solved (test-only reference).

It bounds the sawtooth by a margin ``M`` and checks the ``M`` lengths below a bisected length one by one (and,
for layers that all slide, scans every length up to twice the largest window): exact but slow for large
windows (12.6 s per scheme at a 131,072-token window). ``tests/test_plan_limits.py`` holds the fast search equal
to it on random small configs.
"""

from __future__ import annotations

import math

from kvbits.plan.limits import LIMIT, _Group, _groups, _layer_total, _total_fn, fused_rope_table_bytes
from kvbits.plan.shape import ModelShape
from kvbits.schemes import KVScheme


def _margin(shape: ModelShape, scheme: KVScheme, batch: int) -> int | None:
    rate = 0
    slack = 0
    for (s, layer), count in _groups(shape, scheme).items():
        def total(n: int, g: _Group = (s, layer)) -> int:
            return _layer_total(g, n, batch, shape.dtype_bytes)

        if layer.attention == "sliding":
            span = layer.window + 2 * (s.sinks + s.residual + s.block)
            slack += count * max(total(n) for n in range(span + 1))
        elif s.is_identity:
            rate += count * (total(1) - total(0))
        else:
            start, n_blocks = s.sinks + s.residual + s.block, 64
            rate += count * (total(start + n_blocks * s.block) - total(start)) / (n_blocks * s.block)
            fb = batch * layer.kv_heads * layer.head_dim * 2 * shape.dtype_bytes
            slack += count * (s.sinks + s.residual + s.block) * fb
    if rate <= 0:
        return None
    return math.ceil(slack / rate) + 1


def _bounded_span(shape: ModelShape, scheme: KVScheme) -> int:
    return max(
        (2 * (layer.window or 0) + 4 * (s.sinks + s.residual + s.block) for s, layer in _groups(shape, scheme)),
        default=0,
    )


def _peak_candidates(shape: ModelShape, scheme: KVScheme, context: int) -> range:
    margin = _margin(shape, scheme, 1)
    if margin is None:
        return range(1, min(context, _bounded_span(shape, scheme)) + 1)
    return range(max(1, context - margin), context + 1)


def max_concurrency(
    shape: ModelShape, scheme: KVScheme, context: int, *, free_bytes: int, fused_decode: bool = False
) -> tuple[int, int]:
    per_seq = _total_fn(shape, scheme, 1, False)
    fixed = per_seq(0)
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
    shape: ModelShape, scheme: KVScheme, *, batch: int, free_bytes: int, fused_decode: bool = False
) -> int | None:
    f = _total_fn(shape, scheme, batch, fused_decode)
    margin = _margin(shape, scheme, batch)
    if margin is None:
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
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) <= free_bytes:
            lo = mid
        else:
            hi = mid
    return next(n for n in range(max(1, lo - margin + 1), hi + 1) if f(n) > free_bytes) - 1
