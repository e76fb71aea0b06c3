"""A seeded random scenario for the dynamic cache and an independent model of what it must hold and return.

``run_scenario(seed)`` draws a scheme (per-token / per-channel-block int, FP8, NUQ, static scales, centre / smooth
vectors, dense-and-sparse outliers, pre-RoPE keys, Hadamard rotation, integer zero-points, fp32 scales; sometimes a
second scheme for layer 1), a batch, dtype, ``max_cache_len``, workspace, lazy or eager checks, Falcon-style
repeated K/V heads and a left-padded batch, then feeds a ``QuantizedKVCache`` of three layers (two full attention,
one sliding window) a prefill, decode steps and a second chunk, with crops, reorders, batch repeats / selects and a
``hold_full_precision`` in between. After every update of every layer it checks, against the model below:

- the K/V returned (and ``materialize``): sinks and the residual window exact, every other token quantized once in
  its ``block`` (``kvbits.quant.quantize`` of that block alone, un-rotated at its model positions for pre-RoPE keys),
  the sliding layer's window, the repeated heads;
- the token split the layer reports (sinks / quantized / full / dropped), counted here from the scheme's numbers;
- the bytes: ``report()`` against the storages actually held (walked), and against ``kvbits.plan``'s
  ``layer_bytes`` where no reservation or hold changes them.

It returns the features the scenario exercised (``FEATURES``), so a test can pin seeds that cover them all.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from kvbits.cache import QuantizedKVCache
from kvbits.cache.store import mergeable
from kvbits.quant import quantize
from kvbits.schemes.accounting import layer_bytes, token_split
from kvbits.schemes.spec import KVScheme, TensorSpec

D, H = 16, 2  # head dim, stored K/V heads
FIXED = ("static_scale", "static_zero", "codebook", "channel_mean", "channel_factor")
FEATURES = frozenset({
    "int-token", "int-channel", "fp8", "nuq", "static", "centre-smooth", "outliers", "rotate", "integer-zero",
    "fp32-scales", "float-side", "pre-rope", "mixed-layers", "sliding-quantized", "sliding-fallback",
    "reservation-outgrown", "workspace", "hold", "crop", "reorder", "repeat", "select", "head-repeat", "left-pad",
    "lazy-checks", "lazy-check-ran",
})  # fmt: skip


# ------------------------------------------------------------------------------------------------ random scheme
def _rand_spec(rng: random.Random, block: int) -> TensorSpec:
    c = rng.choice(["tok", "tokg", "chan", "fp8", "head", "tensor", "float", "fp8s", "nuq", "static", "centre",
                    "rot", "izero", "fp32"])  # fmt: skip
    of = rng.choice([0.0, 0.0, 0.1])
    chan_groups = [g for g in (2, 4, 8, 16) if block % g == 0]
    if c == "fp8s":
        return TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity=rng.choice(["tensor", "head"]), static=True)
    if c == "nuq" and chan_groups:
        return TensorSpec(kind="nuq", bits=rng.choice([2, 3]), fmt=None, granularity="channel",
                          group_size=rng.choice(chan_groups[:3]), symmetric=True, outlier_frac=of)  # fmt: skip
    if c == "static":
        return TensorSpec(kind="int", bits=rng.choice([4, 8]), fmt=None, granularity="channel", static=True,
                          symmetric=True, outlier_frac=of)  # fmt: skip
    if c == "centre":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="token", centre=True, smooth=rng.choice([None, 0.5]))
    if c == "tokg":
        return TensorSpec(kind="int", bits=rng.choice([2, 4]), fmt=None, granularity="token",
                          group_size=rng.choice([4, 8]), outlier_frac=of)  # fmt: skip
    if c == "chan" and chan_groups:
        return TensorSpec(kind="int", bits=rng.choice([2, 4]), fmt=None, granularity="channel",
                          group_size=rng.choice(chan_groups), symmetric=True, outlier_frac=of)  # fmt: skip
    if c == "fp8":
        return TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", scale_dtype=rng.choice(["fp16", "fp32"]))
    if c == "head":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="head", outlier_frac=of)
    if c == "tensor":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="tensor")
    if c == "float":
        return TensorSpec()
    if c == "rot":
        return TensorSpec(kind="int", bits=rng.choice([2, 4]), fmt=None, granularity="token", rotate="hadamard")
    if c == "izero":
        return TensorSpec(kind="int", bits=4, fmt=None, granularity="token", integer_zero=True)
    if c == "fp32":
        return TensorSpec(kind="int", bits=rng.choice([4, 8]), fmt=None, granularity="token", scale_dtype="fp32")
    return TensorSpec(kind="int", bits=rng.choice([2, 4, 8]), fmt=None, granularity="token", outlier_frac=of)


def _rand_scheme(rng: random.Random, name: str) -> KVScheme:
    block = rng.choice([1, 2, 4, 8, 16])
    key = _rand_spec(rng, block)
    if key.kind in ("int", "nuq") and not key.static and key.rotate is None and rng.random() < 0.4:
        key = dataclasses.replace(key, pre_rope=True)
    return KVScheme(name, key=key, value=_rand_spec(rng, block), sinks=rng.randint(0, 5),
                    residual=rng.randint(0, 40), block=block)  # fmt: skip


def _spec_features(spec: TensorSpec) -> set[str]:
    f = set()
    if spec.kind == "float":
        f.add("float-side")
    if spec.kind == "int" and spec.granularity == "token" and not spec.static:
        f.add("int-token")
    if spec.kind == "int" and spec.granularity == "channel" and not spec.static:
        f.add("int-channel")
    for cond, name in ((spec.kind == "fp8", "fp8"), (spec.kind == "nuq", "nuq"), (spec.static, "static"),
                       (spec.centre or spec.smooth is not None, "centre-smooth"), (spec.outlier_frac > 0, "outliers"),
                       (spec.pre_rope, "pre-rope"), (spec.rotate is not None, "rotate"),
                       (spec.integer_zero, "integer-zero"), (spec.scale_dtype == "fp32", "fp32-scales")):  # fmt: skip
        if cond:
            f.add(name)
    return f


def _install(cache: QuantizedKVCache, scheme: KVScheme) -> None:
    """Calibrated parameters for every side that needs them (random, fixed by the seed)."""
    for li, layer in enumerate(cache.layers):
        for side in ("key", "value"):
            spec = getattr(scheme.for_layer(li), side)
            kw = {}
            if spec.kind == "nuq":
                kw["codebook"] = torch.linspace(-1, 1, 2**spec.bits).half()
            if spec.static and spec.kind == "int":
                kw["scale"] = (torch.rand(H, D) * 0.05 + 0.02).half()
            if spec.centre:
                kw["mean"] = (torch.randn(H, D) * 0.1).half()
            if spec.smooth is not None:
                kw["factor"] = (torch.rand(H, D) + 0.5).half()
            if kw:
                layer.set_static_qparams(side, **kw)


# ------------------------------------------------------------------------------------------------ the model
@dataclass
class RefLayer:
    """What one layer was given: K/V ``(B, H, T, D)`` of every token seen, and where it stopped quantizing."""

    scheme: KVScheme
    window: int | None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    held_at: int | None = None

    @property
    def quantizes(self) -> bool:
        """Not an identity scheme, nor a window kept in full precision (its buffer alone could outgrow it)."""
        s, W = self.scheme, self.window
        return not s.is_identity and (W is None or s.residual + s.block - 1 <= W - 1)

    @property
    def n(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def map_batch(self, fn) -> None:
        if self.k is not None:
            self.k, self.v = fn(self.k), fn(self.v)

    def split(self) -> tuple[int, int, int, int]:
        """``(sink, quantized, full, dropped)``: counted from the scheme's numbers, not ``token_split``."""
        s, n = self.scheme, self.n
        if not self.quantizes:  # every token kept as it came (a window: its last W - 1)
            keep = n if self.window is None else min(n, self.window - 1)
            return 0, 0, keep, n - keep
        if self.window is not None:
            W = self.window
            flushed = s.block * max(0, (n - s.residual) // s.block)
            dropped = min(flushed, max(0, n - W + 1) // s.block * s.block)
            return 0, flushed - dropped, n - flushed, dropped
        sink = min(n, s.sinks)
        upto = n if self.held_at is None else self.held_at  # a held layer flushes nothing after held_at
        flushed = s.block * max(0, (upto - min(upto, s.sinks) - s.residual) // s.block)
        return sink, flushed, n - sink - flushed, 0

    def expected(self, side: str, store, rotary, offset: torch.Tensor | None) -> torch.Tensor:
        """Every token seen, ``(B, H, T, D)``: quantized block by block where the split says (pre-RoPE keys
        un-rotated at the model's positions: cache index minus the sequence's ``offset``, clamped at 0)."""
        spec, x = getattr(self.scheme, side), (self.k if side == "key" else self.v)
        sink, quantized, _, dropped = self.split()
        out = x.clone()
        if not self.quantizes:
            quantized = dropped = 0
        kw = {name: getattr(store, name) for name in FIXED if getattr(store, name) is not None}
        for a in range(sink, sink + quantized + dropped, self.scheme.block):
            blk = x[:, :, a : a + self.scheme.block]
            if spec.pre_rope:
                pos = torch.arange(a, a + blk.shape[2])[None].expand(x.shape[0], -1)
                if offset is not None:
                    pos = (pos - offset[:, None]).clamp_min(0)
                blk = rotary.unrotate(blk, pos)
                out[:, :, a : a + blk.shape[2]] = rotary.rotate(quantize(blk, spec, **kw).dequantize(x.dtype), pos)
            else:
                out[:, :, a : a + blk.shape[2]] = quantize(blk, spec, **kw).dequantize(x.dtype)
        if self.scheme.is_identity:  # stored in the scheme's float format, returned in the incoming dtype
            fmt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[spec.fmt]
            out = out.to(fmt).to(x.dtype)
        return out


def walked_bytes(layer) -> int:
    """Bytes of every distinct storage the layer's two sides hold (sinks, buffer, chunks, reserved slots, fixed)."""
    seen, total = set(), 0
    for store in (layer._k, layer._v):
        tensors = [store.sinks, store.buffer] + [getattr(store, n) for n in FIXED]
        for chunk in store.chunks:
            tensors += list(chunk.stored_tensors())
        if store._slots:
            tensors += list(store._slots.values())
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


# ------------------------------------------------------------------------------------------------ the scenario
@dataclass
class Scenario:
    """A running scenario: the cache, the model of each layer, the batch's left pads (``None``: none) per row."""

    seed: int
    cache: QuantizedKVCache
    refs: list[RefLayer]
    rotary: object
    pads: torch.Tensor | None
    repeat: int
    features: set[str] = field(default_factory=set)
    ops: list = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.refs[0].k.shape[0]

    def map_batch(self, fn) -> None:
        for ref in self.refs:
            ref.map_batch(fn)
        if self.pads is not None:
            self.pads = fn(self.pads)


def _batch_op(rng: random.Random, sc: Scenario) -> None:
    """Maybe a crop, reorder, batch repeat / select or hold before the next update (as the harness drew them)."""
    cache, r, B = sc.cache, rng.random(), sc.batch
    if r < 0.1:
        idx = torch.tensor([rng.randrange(B) for _ in range(B)])
        sc.ops.append(("reorder", idx.tolist()))
        cache.reorder_cache(idx)
        sc.map_batch(lambda t: t[idx])
        sc.features.add("reorder")
    elif r < 0.2:
        n = sc.refs[0].n
        c = -rng.randint(1, 5) if rng.random() < 0.7 else rng.randint(1, n + 2)
        try:
            cache.crop(c)
        except ValueError as e:  # refused (a flush since, a quantized token): the cache is left as it was
            sc.ops.append(("crop refused", c, str(e)[:60]))
            return
        sc.ops.append(("crop", c))
        sc.features.add("crop")
        keep = n + c if c < 0 else min(c, n)
        for ref in sc.refs:
            ref.k, ref.v = ref.k[:, :, :keep], ref.v[:, :, :keep]
            if ref.held_at is not None:
                ref.held_at = min(ref.held_at, keep)
    elif r < 0.25 and B == 3:
        idx = torch.tensor([0, 2])
        sc.ops.append(("select", [0, 2]))
        cache.batch_select_indices(idx)
        sc.map_batch(lambda t: t[idx])
        sc.features.add("select")
    elif r < 0.3 and B == 1:
        sc.ops.append(("repeat", 2))
        cache.batch_repeat_interleave(2)
        sc.map_batch(lambda t: t.repeat_interleave(2, 0))
        sc.features.add("repeat")
    elif r < 0.33:
        sc.ops.append(("hold", 0))
        if cache.layers[0].hold_full_precision() and sc.refs[0].held_at is None:
            sc.refs[0].held_at = sc.refs[0].n
            sc.features.add("hold")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.numel():
        err = (got.float() - want.float()).abs()
        if err.max() > 1e-2:
            raise AssertionError(f"{what}: max error {err.max():.4g} at {(err > 1e-2).nonzero()[:3].tolist()}")


def _update_layer(sc: Scenario, li: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                  mcl: int | None) -> None:  # fmt: skip
    """One update of layer ``li`` with ``k`` / ``v`` ``(B, H, q, D)`` (handed over repeated, with position ids
    where the batch is left-padded), checked against the model."""
    cache, ref, layer, g = sc.cache, sc.refs[li], sc.cache.layers[li], sc.repeat
    q, n_before = k.shape[2], ref.n
    where = f"seed {sc.seed} layer {li} after {len(sc.ops)} ops (n={n_before + q}, ops={sc.ops[-4:]})"
    mask_len = cache.get_mask_sizes(q, li)[0]
    extra = () if positions is None else ({"position_ids": positions},)
    ko, vo = cache.update(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), li, *extra)
    ref.k = k if ref.k is None else torch.cat([ref.k, k], 2)
    ref.v = v if ref.v is None else torch.cat([ref.v, v], 2)
    offsets = sc.pads if ref.scheme.key.pre_rope else None
    ek = ref.expected("key", layer._k, sc.rotary, offsets)
    ev = ref.expected("value", layer._v, sc.rotary, None)
    if ref.window is not None:  # what DynamicSlidingWindowLayer returns: the last W - 1 cached tokens and the new
        start = max(0, n_before - ref.window + 1)
        ek, ev = ek[:, :, start:], ev[:, :, start:]
    ek, ev = ek.repeat_interleave(g, 1), ev.repeat_interleave(g, 1)
    _close(ko, ek, f"{where}: keys")
    _close(vo, ev, f"{where}: values")
    assert mask_len == ko.shape[2], f"{where}: get_mask_sizes {mask_len}, update returned {ko.shape[2]} tokens"
    mk, mv = cache.materialize(li)
    visible = ko.shape[2] if ref.window is None else min(ref.n, ref.window - 1)
    assert torch.equal(mk, ko[:, :, ko.shape[2] - visible :]), f"{where}: materialize keys != update's"
    assert torch.equal(mv, vo[:, :, vo.shape[2] - visible :]), f"{where}: materialize values != update's"
    rep = layer.report()
    got = (rep["sink_tokens"], rep["quantized_tokens"], rep["full_tokens"], rep["dropped_tokens"])
    assert got == ref.split(), f"{where}: split (sink, quantized, full, dropped) {got}, expected {ref.split()}"
    held = rep["key_bytes"] + rep["value_bytes"]
    walked = walked_bytes(layer)
    assert held == walked, f"{where}: report() says {held} bytes, the storages hold {walked}"
    if mcl is None and ref.held_at is None:
        plan = layer_bytes(ref.scheme, ref.n, batch=ref.k.shape[0], n_heads=H, head_dim=D,
                           full_dtype_bytes=k.element_size(), sliding_window=ref.window)  # fmt: skip
        assert held == plan["key"] + plan["value"], f"{where}: report() says {held} bytes, the plan {plan}"


def run_scenario(seed: int) -> Scenario:
    """Run the seeded scenario; ``AssertionError`` naming the seed, layer, ops and what differed."""
    from transformers import LlamaConfig

    from kvbits.quant.rope import RotaryTables

    rng = random.Random(seed)
    torch.manual_seed(seed)
    feat: set[str] = set()
    scheme = _rand_scheme(rng, f"fz{seed}a")
    if rng.random() < 0.4:
        scheme = dataclasses.replace(scheme, name=f"fz{seed}m", layers=((1, _rand_scheme(rng, f"fz{seed}b")),))
        feat.add("mixed-layers")
    B = rng.choice([1, 3])
    dtype = rng.choice([torch.float16, torch.float32, torch.bfloat16])
    mcl = rng.choice([None, None, 200, 50, 17])
    workspace = rng.random() < 0.3
    lazy = rng.random() < 0.4
    repeat = rng.choice([1, 1, 2])
    pads = torch.tensor([rng.randint(0, 4) for _ in range(B)]) if B > 1 and rng.random() < 0.5 else None
    W = rng.choice([8, 17, 33, 64])
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H, num_hidden_layers=3,
                      vocab_size=32, intermediate_size=16)  # fmt: skip
    rotary = RotaryTables.from_config(cfg)
    cache = QuantizedKVCache(scheme=scheme, num_layers=3, workspace=workspace, max_cache_len=mcl, fused_decode=False,
                             rotary=rotary, checks="lazy" if lazy else "eager", check_every=rng.choice([1, 3, 64]))  # fmt: skip
    # the layers a config would make: H stored heads, each handed over `repeat` times (Falcon's new architecture
    # before transformers 5.25), layer 2 a sliding window
    cache.num_key_value_heads, cache.head_repeat, cache.head_dim = H, repeat, D
    cache.layers[:] = [cache._make_layer(0, "full_attention", {}), cache._make_layer(1, "full_attention", {}),
                       cache._make_layer(2, "sliding_attention", {"sliding_window": W})]  # fmt: skip
    _install(cache, scheme)
    refs = [RefLayer(scheme.for_layer(li), None if li < 2 else W) for li in range(3)]
    widen = 0 if pads is None else int(pads.max())  # a left-padded request's sinks: scheme.sinks + the most pads
    for ref in refs[:2]:
        if widen and ref.scheme.sinks and ref.quantizes:
            ref.scheme = dataclasses.replace(ref.scheme, sinks=ref.scheme.sinks + widen)
    sc = Scenario(seed, cache, refs, rotary, pads, repeat, feat)
    if not refs[2].scheme.is_identity:
        feat.add("sliding-quantized" if cache.layers[2].mode == "quantized" else "sliding-fallback")
    for cond, name in ((workspace, "workspace"), (lazy, "lazy-checks"), (repeat > 1, "head-repeat")):
        if cond:
            feat.add(name)

    steps = [rng.choice([1, 3, 7, 13, 33, 41, 65])] + [1] * rng.randint(0, 30) + [rng.randint(2, 40)]
    steps += [1] * rng.randint(0, 10)
    if pads is not None:
        steps[0] = max(steps[0], int(pads.max()) + 1)  # each row's newest prefill token is a real one
    for si, q in enumerate(steps):
        if si:
            _batch_op(rng, sc)
        B = B if refs[0].k is None else sc.batch
        n_before = cache.get_seq_length()
        positions = None
        if sc.pads is not None:  # as generate computes them from the attention mask: pads at 1
            idx = torch.arange(n_before, n_before + q)[None] - sc.pads[:, None]
            positions = torch.where(idx < 0, torch.ones_like(idx), idx)
        sc.ops.append(("update", q))
        for li in range(3):
            k = torch.randn(B, H, q, D).to(dtype) * (1 + li)
            v = torch.randn(B, H, q, D).to(dtype)
            _update_layer(sc, li, k, v, positions, mcl)
        assert cache.get_seq_length() == n_before + q
    for li, ref in enumerate(refs):  # a spec counts where the layer quantized with it
        for spec, store in ((ref.scheme.key, cache.layers[li]._k), (ref.scheme.value, cache.layers[li]._v)):
            if store.elements_quantized:
                feat |= _spec_features(spec)
                if spec.pre_rope and sc.pads is not None and bool(sc.pads.any()):
                    feat.add("left-pad")
        reserved = 0 if mcl is None or ref.scheme.is_identity else token_split(ref.scheme, mcl).quantized
        if ref.window is None and mergeable(ref.scheme.key) and 0 < reserved < ref.split()[1]:
            feat.add("reservation-outgrown")
    if lazy and any(layer.checks.checked_steps for layer in cache.layers):
        feat.add("lazy-check-ran")
    report = cache.memory_report()  # runs the pending lazy checks
    assert report["total_bytes"] == sum(lay["key_bytes"] + lay["value_bytes"] for lay in report["layers"])
    return sc
