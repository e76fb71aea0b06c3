"""A seeded random scenario for ``StaticQuantizedKVCache``, checked against ``_cache_reference``'s independent model.

``run_static_scenario(seed)`` draws a scheme the static cache holds (``static_reason`` is ``None``: per-token int
2/3/4/8 codes, whole rows or channel groups, vLLM integer zero-points, Hadamard rotations, FP8 e4m3 / e5m2, static FP8
per tensor / head, static int and NUQ ranges, NUQ codes, centred / smoothed keys, pre-RoPE keys, outliers, fp32
scales, sinks, KIVI-style windows of ``residual + block`` tokens with per-channel key groups; sometimes a layer kept
in fp16), a batch, a dtype, ``max_cache_len``, eager or lazy checks and a left-padded batch, then feeds the cache a
prefill, decode steps and further chunks, with ``reorder_cache``, ``reset()`` (a new request, the slabs kept) and the
host's counts switched off (``host_counts``: what a traced or captured step's replays leave) in between. After every
update of every layer it checks, against ``RefLayer`` (every token seen; sinks and the window exact, every other token
quantized once in its ``block`` by ``kvbits.quant.quantize``, pre-RoPE keys un-rotated at the model's positions):

- the K/V ``update`` returns at the positions written (a decode step returns ``max_cache_len`` positions, a prefill
  those written so far), and ``materialize``'s;
- ``get_mask_sizes`` against the length returned, and ``get_seq_length``.

Reproduce a failure with ``PYTHONPATH=src:tests python -c "import _static_reference as r; r.run_static_scenario(S)"``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch
from _cache_reference import FIXED, RefLayer

from kvbits.cache import StaticQuantizedKVCache, static_reason
from kvbits.cache.fixed import checked_params
from kvbits.schemes.spec import KVScheme, TensorSpec

D, H, NL = 16, 2, 2
TOL = 1e-2  # relative to the block's largest |x| (clamped at 1); the codes are the same, so exact in practice
FEATURES = frozenset({
    "per-token", "windowed", "sinks", "static-fp8", "static-range", "nuq", "pre-rope", "left-pad", "float-layer",
    "reorder", "reset", "host-counts-off", "decode", "chunk", "decode-across-sinks",
})  # fmt: skip


def _rand_spec(rng: random.Random, block: int, side: str) -> TensorSpec:
    c = rng.choice(["tok", "tokg", "chan", "fp8", "fp8s", "nuq", "nuqs", "static", "smooth", "had", "vllm"])
    of = rng.choice([0.0, 0.0, 0.1])
    if c == "fp8s":
        return TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity=rng.choice(["tensor", "head"]),
                          static=True)  # fmt: skip
    if c == "nuq":
        return TensorSpec(kind="nuq", bits=rng.choice([2, 3, 4]), fmt=None, granularity="token",
                          outlier_frac=of)  # fmt: skip
    if c == "nuqs":  # KVQuant's keys: static per-channel ranges and a codebook
        return TensorSpec(kind="nuq", bits=rng.choice([2, 3, 4]), fmt=None, granularity="channel", static=True,
                          outlier_frac=of)  # fmt: skip
    if c == "static":
        return TensorSpec(kind="int", bits=rng.choice([4, 8]), fmt=None, granularity="channel", static=True,
                          symmetric=True, outlier_frac=of)  # fmt: skip
    if c == "smooth" and side == "key":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="token", centre=rng.random() < 0.5,
                          smooth=rng.choice([None, 0.5]))  # fmt: skip
    if c == "tokg":
        return TensorSpec(kind="int", bits=rng.choice([2, 4]), fmt=None, granularity="token",
                          group_size=rng.choice([4, 8]), outlier_frac=of)  # fmt: skip
    if c == "had":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="token", rotate="hadamard")
    if c == "vllm":
        return TensorSpec(kind="int", bits=rng.choice([4, 8]), fmt=None, granularity="token", integer_zero=True,
                          rounding=rng.choice(["nearest", "half_even"]))  # fmt: skip
    if c == "chan":
        groups = [g for g in (2, 4, 8) if block % g == 0]
        if groups:
            return TensorSpec(kind="int", bits=rng.choice([2, 4]), fmt=None, granularity="channel",
                              group_size=rng.choice(groups), symmetric=rng.random() < 0.5, outlier_frac=of)  # fmt: skip
    if c == "fp8":
        return TensorSpec(kind="fp8", bits=8, fmt=rng.choice(["e4m3", "e5m2"]), granularity="token")
    return TensorSpec(kind="int", bits=rng.choice([2, 3, 4, 8]), fmt=None, granularity="token",
                      symmetric=rng.random() < 0.3, outlier_frac=of)  # fmt: skip


def rand_static_scheme(rng: random.Random, name: str) -> KVScheme:
    """A scheme ``StaticQuantizedKVCache`` holds (drawn until ``static_reason`` says so)."""
    while True:
        block, residual = rng.choice([1, 1, 2, 4, 8]), rng.choice([0, 0, 3, 7])
        try:
            key, value = _rand_spec(rng, block, "key"), _rand_spec(rng, block, "value")
            if key.kind in ("int", "nuq") and rng.random() < 0.4:
                key = dataclasses.replace(key, pre_rope=True)
            if key.kind == "int" and rng.random() < 0.15:
                key = dataclasses.replace(key, scale_dtype="fp32")
            scheme = KVScheme(name, key=key, value=value, sinks=rng.choice([0, 0, 1, 3]), residual=residual,
                              block=block)  # fmt: skip
        except (ValueError, TypeError):
            continue
        if static_reason(scheme) is None:
            return scheme


def _params(rng: random.Random, spec: TensorSpec) -> dict[str, torch.Tensor]:
    """Calibrated parameters for a side, as ``set_static_qparams`` takes them (random, from the seed)."""
    kw = {}
    if spec.kind == "nuq":
        u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
        kw["codebook"] = (u.abs() ** 1.5 * u.sign()).half()
    if spec.static and spec.kind == "nuq":
        kw["scale"], kw["zero"] = torch.full((H, D), 6.0).half(), torch.full((H, D), -3.0).half()
    elif spec.static and spec.kind == "int":
        kw["scale"] = (torch.rand(H, D) * 0.05 + 0.3).half()
    elif spec.static:  # FP8: per tensor or per head
        per_head = torch.rand(H) * 0.02 + 0.005
        kw["scale"] = torch.tensor(rng.uniform(0.005, 0.02)) if spec.granularity == "tensor" else per_head
    if spec.centre:
        kw["mean"] = (torch.randn(H, D) * 0.1).half()
    if spec.smooth is not None:  # pre-RoPE keys: tied over RoPE's channel pairs (rotate-half: c and c + D/2)
        f = torch.rand(H, D // 2) + 0.5
        kw["factor"] = torch.cat([f, f], -1).half()
    return kw


@dataclass
class StaticScenario:
    seed: int
    cache: StaticQuantizedKVCache
    refs: list[RefLayer]
    pads: torch.Tensor | None
    fixed: list[dict[str, object]]  # per layer and side: a store holding the parameters quantize takes
    features: set[str] = field(default_factory=set)
    ops: list = field(default_factory=list)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.numel():
        err = (got.float() - want.float()).abs()
        tol = TOL * float(want.float().abs().amax().clamp(min=1))
        if err.max() > tol:
            at = (err > tol).nonzero()[:3].tolist()
            raise AssertionError(f"{what}: max error {err.max():.4g} (> {tol:.3g}) at {at}")


def run_static_scenario(seed: int) -> StaticScenario:
    """Run the seeded scenario; ``AssertionError`` naming the seed, layer, ops and what differed."""
    from transformers import LlamaConfig

    from kvbits.quant.rope import RotaryTables

    rng = random.Random(seed)
    torch.manual_seed(seed)
    scheme = rand_static_scheme(rng, f"sf{seed}")
    feat: set[str] = set()
    if rng.random() < 0.25:
        fp16 = KVScheme("f", key=TensorSpec(), value=TensorSpec())
        scheme = dataclasses.replace(scheme, name=f"sf{seed}m", layers=((rng.randrange(NL), fp16),))
        feat.add("float-layer")
    B = rng.choice([1, 3])
    dtype = rng.choice([torch.float16, torch.float32, torch.bfloat16])
    T = rng.choice([9, 17, 31, 50]) + scheme.sinks
    pads = torch.tensor([rng.choice([0, 1, 3]) for _ in range(B)]) if B > 1 and rng.random() < 0.5 else None
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H, num_hidden_layers=NL,
                      vocab_size=32, intermediate_size=16)  # fmt: skip
    rotary = RotaryTables.from_config(cfg)
    cache = StaticQuantizedKVCache(num_layers=NL, scheme=scheme, max_cache_len=T, fused_decode=False, rotary=rotary,
                                   checks=rng.choice(["eager", "lazy"]))  # fmt: skip
    fixed = []
    for li in range(NL):
        sch, stores = scheme.for_layer(li), {}
        for side in ("key", "value"):
            spec = getattr(sch, side)
            kw = {} if sch.is_identity else _params(rng, spec)
            if kw:
                cache.set_static_qparams(li, side, **kw)
            q = checked_params(spec, side, H, torch.device("cpu"), **kw) if kw else {}
            stores[side] = type("Store", (), {name: q.get(name) for name in FIXED})()
        fixed.append(stores)
    refs = [RefLayer(scheme.for_layer(li), None) for li in range(NL)]
    sc = StaticScenario(seed, cache, refs, pads, fixed, feat)
    base = scheme.for_layer(0) if not scheme.for_layer(0).is_identity else scheme.for_layer(1)
    for cond, name in ((base.residual or base.block > 1, "windowed"), (not (base.residual or base.block > 1), "per-token"),
                       (base.sinks, "sinks"), (base.key.pre_rope, "pre-rope"),
                       (any(s.kind == "fp8" and s.static for s in (base.key, base.value)), "static-fp8"),
                       (any(s.kind != "fp8" and s.static for s in (base.key, base.value)), "static-range"),
                       (any(s.kind == "nuq" for s in (base.key, base.value)), "nuq"),
                       (base.key.pre_rope and pads is not None and bool(pads.any()), "left-pad")):  # fmt: skip
        if cond:
            feat.add(name)

    for _ in range(rng.randint(8, 40)):
        n = refs[0].n
        r = rng.random()
        if n and r < 0.06:
            sc.ops.append("reset")
            cache.reset()
            for ref in refs:
                ref.k = ref.v = None
            feat.add("reset")
            continue
        if n and r < 0.14 and B > 1:
            idx = torch.tensor([rng.randrange(B) for _ in range(B)])
            sc.ops.append(("reorder", idx.tolist()))
            cache.reorder_cache(idx)
            for ref in refs:
                ref.map_batch(lambda t, idx=idx: t[idx])
            if sc.pads is not None:
                sc.pads = sc.pads[idx]
            feat.add("reorder")
            continue
        if n and r < 0.18 and cache.layers[0].host_counts:  # a step traced / captured without GraphedDecode's
            sc.ops.append("host_counts off")
            for layer in cache.layers:
                layer.host_counts = False
            feat.add("host-counts-off")
            continue
        q = 1 if n and rng.random() < 0.7 else rng.choice([1, 2, 3, 5, 9, 13])
        if n + q > T:
            q = T - n
            if q == 0:
                sc.ops.append("full: reset")
                cache.reset()
                for ref in refs:
                    ref.k = ref.v = None
                continue
        if pads is not None and n == 0:
            q = max(q, int(sc.pads.max()) + 1)  # each row's newest prefill token is a real one
        if n:
            feat.add("decode" if q == 1 else "chunk")
        if q == 1 and 0 < n < base.sinks:
            feat.add("decode-across-sinks")
        sc.ops.append(("update", q))
        extra = {}
        if sc.pads is not None:  # as generate computes them from the attention mask: pads at 1
            idx = torch.arange(n, n + q)[None] - sc.pads[:, None]
            extra = {"position_ids": torch.where(idx < 0, torch.ones_like(idx), idx)}
        for li in range(NL):
            _update_layer(sc, li, (torch.randn(B, H, q, D) * (1 + li)).to(dtype), torch.randn(B, H, q, D).to(dtype),
                          extra, T)  # fmt: skip
        got = int(cache.get_seq_length())
        assert got == n + q, f"seed {seed}: get_seq_length {got}, expected {n + q}"
    return sc


def _update_layer(sc: StaticScenario, li: int, k: torch.Tensor, v: torch.Tensor, extra: dict, T: int) -> None:
    cache, ref = sc.cache, sc.refs[li]
    q, n = k.shape[2], ref.n
    where = f"seed {sc.seed} layer {li} (n={n + q}, ops={sc.ops[-5:]})"
    mask_len = cache.get_mask_sizes(q, li)[0]
    ko, vo = cache.update(k, v, li, dict(extra))
    ref.k = k if ref.k is None else torch.cat([ref.k, k], 2)
    ref.v = v if ref.v is None else torch.cat([ref.v, v], 2)
    want_len = T if q == 1 else n + q
    assert ko.shape[2] == want_len, f"{where}: update returned {ko.shape[2]} positions, expected {want_len}"
    assert mask_len == ko.shape[2], f"{where}: get_mask_sizes {mask_len}, update returned {ko.shape[2]}"
    offsets = sc.pads if ref.scheme.key.pre_rope else None
    ek = ref.expected("key", sc.fixed[li]["key"], cache.layers[li].rotary, offsets)
    ev = ref.expected("value", sc.fixed[li]["value"], None, None)
    _close(ko[:, :, : n + q], ek, f"{where}: keys")
    _close(vo[:, :, : n + q], ev, f"{where}: values")
    mk, mv = cache.layers[li].materialize()
    assert torch.equal(mk[:, :, : n + q], ko[:, :, : n + q]), f"{where}: materialize keys != update's"
    assert torch.equal(mv[:, :, : n + q], vo[:, :, : n + q]), f"{where}: materialize values != update's"
