"""``kvbits.plan.limits``: the max-context and max-concurrency searches against a length-by-length reference.

The search solves the bytes' sawtooth (``limits._sawtooth``) instead of scanning lengths: its two facts are
checked by brute force here, and its answers held equal to the previous search (``_plan_limits_reference``,
which checked every length within a margin, and up to twice the window for layers that all slide) on random
small configs: windows, blocks, sinks, residual windows, mixed layers and schemes, batch, fused RoPE tables.
"""

from __future__ import annotations

import dataclasses
import random

import _plan_limits_reference as reference
import pytest

from kvbits.plan import DEFAULT_SCHEMES, ModelShape, limits, plan
from kvbits.plan.shape import LayerShape
from kvbits.schemes import KVScheme, get_scheme

_PRESETS = (
    "fp16", "fp8-e4m3", "int8-token", "int4-g64", "kivi-2", "kvquant-4", "int4-channel-prerope", "kvquant-4-block",
    "int4-token-smooth-prerope",
)  # fmt: skip


def _random_scheme(rng: random.Random) -> KVScheme:
    """A preset with random sinks, residual window and block (per-channel groups resized to divide the block)."""
    s = get_scheme(rng.choice(_PRESETS))
    if s.is_identity:
        return s
    group = rng.choice([3, 4, 5, 8])
    sides = {}
    for side in ("key", "value"):
        spec = getattr(s, side)
        if spec.kind != "float" and spec.granularity == "channel" and spec.group_size is not None:
            sides[side] = dataclasses.replace(spec, group_size=group)
    block = group * rng.randint(1, 4) if sides else rng.randint(1, 24)
    return dataclasses.replace(s, sinks=rng.randint(0, 5), residual=rng.randint(0, 40), block=block, **sides)


def _random_case(rng: random.Random) -> tuple[ModelShape, KVScheme]:
    layers = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["full", "sliding", "sliding", "none"])
        layers.append(LayerShape(
            rng.randint(1, 2), rng.choice([64, 128]), kind, rng.randint(2, 300) if kind == "sliding" else None,
            rope_tables=rng.choice(["half", "full", "none"]),
        ))  # fmt: skip
    if all(layer.attention == "none" for layer in layers):
        layers[0] = LayerShape(1, 64, "sliding", rng.randint(2, 300))
    scheme = _random_scheme(rng)
    if rng.random() < 0.4:  # mixed: some layers stored by other schemes (other blocks, sinks, residual windows)
        picked = rng.sample(range(len(layers)), rng.randint(1, len(layers)))
        subs = tuple((i, dataclasses.replace(_random_scheme(rng), name=f"sub{i}")) for i in sorted(picked))
        scheme = dataclasses.replace(scheme, layers=subs)
    return ModelShape(layers=tuple(layers), dtype_bytes=rng.choice([2, 4])), scheme


def _span(shape: ModelShape, scheme: KVScheme) -> int:
    """Lengths past which nothing new happens in a small random config (windows, first flushes, a few periods)."""
    period, _ = limits._sawtooth(shape, scheme)
    reach = max(s.sinks + s.residual + s.block for s in [scheme, *(sub for _, sub in scheme.layers)])
    return 2 * max(layer.window or 0 for layer in shape.layers) + 4 * reach + 3 * period


@pytest.mark.parametrize("seed", range(40))
def test_the_bytes_sawtooth_facts_hold(seed):
    """``f(n + period) >= f(n)`` at every length, and ``f(n + 1) >= f(n)`` except at the drops ``_sawtooth`` names."""
    rng = random.Random(seed)
    shape, scheme = _random_case(rng)
    batch, fused = rng.randint(1, 3), rng.random() < 0.5
    period, drops = limits._sawtooth(shape, scheme)
    f = limits._total_fn(shape, scheme, batch, fused)
    held = [f(n) for n in range(_span(shape, scheme) + period + 2)]
    for n in range(len(held) - period):
        assert held[n + period] >= held[n], (scheme, shape, n)
    for n in range(len(held) - 1):
        dropping = any((n + 1) % block == residue for block, residue in drops)
        assert dropping or held[n + 1] >= held[n], (scheme, shape, n)


@pytest.mark.parametrize("seed", range(60))
def test_max_context_and_concurrency_equal_the_length_by_length_search(seed):
    rng = random.Random(1000 + seed)
    shape, scheme = _random_case(rng)
    batch, fused = rng.randint(1, 3), rng.random() < 0.5
    span = _span(shape, scheme)
    f = limits._total_fn(shape, scheme, batch, fused)
    budgets = {f(1) - 1, f(1), max(f(n) for n in range(1, span + 1))}
    for t in rng.choices(range(1, span + 1), k=8):
        budgets |= {f(t) - 1, f(t), f(t) + 1}
    for free in sorted(budgets):
        want = reference.max_context(shape, scheme, batch=batch, free_bytes=free, fused_decode=fused)
        got = limits.max_context(shape, scheme, batch=batch, free_bytes=free, fused_decode=fused)
        assert got == want, (scheme, shape, batch, fused, free)
    per_seq = limits._total_fn(shape, scheme, 1, False)
    for context in [1, 2, span, *rng.choices(range(1, span + 1), k=6)]:
        for free in {per_seq(context) * batch, per_seq(context - 1) * batch + 1, 3 * per_seq(context) + 7}:
            want = reference.max_concurrency(shape, scheme, context, free_bytes=free, fused_decode=fused)
            got = limits.max_concurrency(shape, scheme, context, free_bytes=free, fused_decode=fused)
            assert got == want, (scheme, shape, context, fused, free)


@pytest.mark.parametrize("window", [262_144, 1 << 20])
def test_huge_windows_are_planned_from_a_few_lengths(window, monkeypatch):
    """A model whose layers all slide with a huge window (Phi-3-128k style), or full-attention layers beside
    sliding ones of that window: the search used to read every length up to about twice the window (12.6 s
    per scheme at 131,072 tokens, fp16, batch 1). Now a layer's bytes are evaluated a few hundred times per plan."""
    calls = 0
    layer_bytes = limits.layer_bytes

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return layer_bytes(*args, **kwargs)

    monkeypatch.setattr(limits, "layer_bytes", counted)
    slides = ModelShape.from_dims(32, 32, 96, sliding_window=window)
    mixed = ModelShape(layers=(LayerShape(8, 128, "sliding", window), LayerShape(8, 128)) * 4, dtype_bytes=2)
    for shape in (slides, mixed):
        for scheme in (*DEFAULT_SCHEMES, "kvquant-4", "int4-channel-prerope"):
            calls = 0
            r = plan(shape, context=131_072, scheme=scheme, gpu_mem_gib=80, weights_gib=8, fused_decode=True)
            assert calls < 1000, (scheme, calls)  # a few hundred; a length-by-length search: millions
            if scheme == "fp16" and shape is slides:  # 24 KiB per layer and token, 72 GiB free
                held = min(window - 1, 72 * 2**30 // (32 * 2 * 32 * 96 * 2))
                assert r["max_context"] == (None if held == window - 1 else held)
