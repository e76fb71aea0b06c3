"""Kernel layer: the packed layout, the torch reference, the Triton kernels and the dispatcher.

Triton tests run compiled on CUDA, else through Triton's interpreter (``TRITON_INTERPRET=1``, set by
``enable_interpreter()`` before the kernel module is imported); they skip when Triton is missing.
Accuracy criterion of the flash-attention tests: the kernel's max error against a float64 reference
is at most twice the error of plain torch attention at the kernel's precision.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from _basis import parts_that_matter, skipping
from _launch import LaunchSpy

from kvbits.calibrate.fit import tie_rope_pairs
from kvbits.kernels import dispatch
from kvbits.kernels.reference import (
    PackedStore,
    PackedTensor,
    _head_slots,
    apply_rope_at,
    code_basis,
    decode_attention_reference,
    dequantize_packed,
    materialize,
    pack_store,
    rope_pairs_tied,
    used_slots,
    word_rows,
)
from kvbits.quant import quantize, unpack_bits
from kvbits.schemes import TensorSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

try:
    if DEVICE == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    from kvbits.kernels import triton_decode
except ImportError as exc:  # Triton not installed
    triton_decode = None
    TRITON_SKIP = f"Triton is not importable ({exc}); pip install triton"
else:
    TRITON_SKIP = ""
needs_triton = pytest.mark.skipif(triton_decode is None, reason=TRITON_SKIP or "n/a")


def spec(bits: int, gran: str = "token", group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


def rope_tables(T: int, D: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables ``(T, D)`` (RoFormer, Su et al. 2021; transformers' default rope)."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().float(), emb.sin().float()


KIVI4_KEYS = spec(4, "channel", 32)
KIVI4_VALUES = spec(4, "token", 32)


def make_store(
    gen: torch.Generator,
    *,
    B: int = 2,
    H_kv: int = 2,
    D: int = 64,
    T_q: int = 160,
    T_f: int = 40,
    key_spec: TensorSpec | None = KIVI4_KEYS,
    value_spec: TensorSpec | None = KIVI4_VALUES,
    quant_lens: list[int] | None = None,
    full_lens: list[int] | None = None,
    block: int = 32,
    rope: bool = False,
    device: str = DEVICE,
) -> PackedStore:
    """A random layer store: quantized blocks of ``block`` tokens (keys with channel outliers) + fp16 tail."""
    kq = torch.randn(B, H_kv, T_q, D, generator=gen)
    kq[..., : D // 8] *= 6  # a few outlier key channels, as in real models
    vq = torch.randn(B, H_kv, T_q, D, generator=gen)
    kb, vb = [], []
    if T_q:
        cuts = range(0, T_q, block)
        kb = [quantize(kq[:, :, a : a + block].to(device), key_spec, **extras(key_spec, kq)) for a in cuts]
        vb = [
            quantize(vq[:, :, a : a + block].to(device), value_spec, **extras(value_spec, vq)) for a in cuts
        ]
    kf = vf = None
    if T_f:
        kf = (torch.randn(B, H_kv, T_f, D, generator=gen) * 2).half().to(device)
        vf = torch.randn(B, H_kv, T_f, D, generator=gen).half().to(device)
    kw = {}
    if rope:
        cos, sin = rope_tables(T_q + T_f + 8, D)
        kw = {"rope_cos": cos.to(device), "rope_sin": sin.to(device), "quant_pos0": [4] * B}
    return pack_store(kb, vb, kf, vf, quant_lens=quant_lens, full_lens=full_lens, **kw)


CODEBOOKS: dict[int, torch.Tensor] = {}


def codebook(bits: int) -> torch.Tensor:
    """A non-uniform sorted float16 codebook in [-1, 1], denser near 0 (like a Fisher-weighted k-means one)."""
    if bits not in CODEBOOKS:
        u = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
        CODEBOOKS[bits] = (u.abs() ** 1.6 * u.sign()).to(torch.float16)
    return CODEBOOKS[bits]


def extras(s: TensorSpec, x: torch.Tensor) -> dict:
    """``quantize`` keyword arguments a spec needs: a NUQ codebook; static ranges from all of ``x``; centred /
    smoothed channel vectors from all of ``x`` (``channel_kwargs``)."""
    kw: dict = {}
    if s.kind == "nuq":
        kw["codebook"] = codebook(s.bits).to(x.device)
    if s.has_channel_transform:
        kw.update({n: v.to(x.device) for n, v in channel_kwargs(s, x).items()})
    if s.static and s.kind in ("int", "nuq"):  # calibrated per-channel range (H, D), a bit narrow: clips
        lo, hi = x.amin(dim=(0, 2), keepdim=True) * 0.9, x.amax(dim=(0, 2), keepdim=True) * 0.9  # (1, H, 1, D)
        kw["static_scale"] = ((hi - lo) / (1 if s.kind == "nuq" else 2**s.bits - 1)).half().to(x.device)
        kw["static_zero"] = lo.half().to(x.device)
    if s.static and s.kind == "fp8":
        kw["static_scale"] = torch.tensor(x.abs().max().item() / 300.0)
    return kw


def nuq(bits: int, gran: str = "token", group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="nuq", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


def fp8(fmt: str = "e4m3", gran: str = "token", **kw) -> TensorSpec:
    return TensorSpec(kind="fp8", bits=8, fmt=fmt, granularity=gran, **kw)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# --------------------------------------------------------------------------------------------------
# Layout and reference (no Triton needed)
# --------------------------------------------------------------------------------------------------

LAYOUT_SPECS = [
    (spec(2, "channel", 32), 32, 1),
    (spec(4, "channel", 16), 16, 1),
    (spec(8, "token"), 1, 64),
    (spec(4, "token", 32), 1, 32),
    (spec(3, "token", 16, symmetric=True), 1, 16),
    (spec(4, "head"), 32, 64),
    (spec(8, "tensor", symmetric=True), 32, 64),
]


@pytest.mark.parametrize("s,tps,cps", LAYOUT_SPECS, ids=str)
def test_pack_store_layout_equals_quantized_blocks(s: TensorSpec, tps: int, cps: int):
    g = torch.Generator().manual_seed(0)
    B, H, D = 2, 3, 64
    xs = [torch.randn(B, H, 32, D, generator=g) for _ in range(3)]
    blocks = [quantize(x, s) for x in xs]
    store = pack_store(blocks, blocks)
    p = store.key
    assert (p.tps, p.cps, p.bits, p.symmetric) == (tps, cps, s.bits, s.symmetric)
    assert p.codes.shape == (B, H, 96, math.ceil(D * s.bits / 8)) and p.codes.dtype == torch.uint8
    assert p.scale.shape == (B, H, 96 // tps, D // cps) and p.scale.dtype == torch.float16
    assert torch.equal(
        unpack_bits(p.codes, s.bits, D), torch.cat([unpack_bits(b.data, s.bits, D) for b in blocks], 2)
    )
    # the layout decodes to exactly what QuantizedTensor decodes (same float32 formulas)
    assert torch.equal(dequantize_packed(p), torch.cat([b.dequantize() for b in blocks], 2))
    # slots cut mid scale row (``used_slots``): each slot still reads its own row (the gathered path)
    assert torch.equal(dequantize_packed(_head_slots(p, 70)), dequantize_packed(p)[:, :, :70])
    assert p.nbytes == sum(b.nbytes for b in blocks) + (
        0 if s.granularity != "tensor" else (H - 1) * B * 3 * 2  # tensor scales repeated per head
    )


def test_static_scales_are_materialised():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 32, 64, generator=g)
    # static per-channel keys (KVQuant): one calibrated (H, D) scale for every token of the layer
    s = spec(8, "channel", None, static=True)
    scale = torch.rand(1, 2, 1, 64, generator=g) * 0.05 + 0.01
    zero = torch.full((1, 2, 1, 64), -3.0)
    blocks = [quantize(x[:, :, i : i + 8], s, static_scale=scale, static_zero=zero) for i in (0, 8, 16)]
    p = pack_store(blocks, blocks).key
    assert p.scale.shape == (1, 2, 1, 64) and p.tps == 2**30
    assert torch.equal(dequantize_packed(p), torch.cat([b.dequantize() for b in blocks], 2))


# NUQ, FP8 and dense-and-sparse outliers in the packed layout (KVQuant's ingredients, vLLM's FP8)
KIND_SPECS = [
    nuq(4, "token"),
    nuq(3, "token", symmetric=True),
    nuq(2, "channel", 32, outlier_frac=0.05),
    nuq(4, "channel", None, static=True, outlier_frac=0.02),  # kvquant-4 keys (before the pre-RoPE part)
    spec(4, "token", 32, outlier_frac=0.05),
    spec(2, "channel", 32, outlier_frac=0.02),
    fp8("e4m3", "token"),
    fp8("e5m2", "token", outlier_frac=0.02),
    fp8("e4m3", "tensor", static=True),
    # float32 scales and zero-points (scale_dtype="fp32": vLLM's per-token-head caches)
    fp8("e4m3", "token", scale_dtype="fp32"),
    spec(8, "token", symmetric=True, rounding="trunc", scale_dtype="fp32"),
    spec(4, "channel", 32, scale_dtype="fp32"),
]


@pytest.mark.parametrize("s", KIND_SPECS, ids=str)
def test_pack_store_kinds_decode_like_quantized_blocks(s: TensorSpec):
    g = torch.Generator().manual_seed(30)
    B, H, D = 2, 3, 64
    xs = [torch.randn(B, H, 32, D, generator=g) * (1 + 4 * (torch.arange(D) < 4)) for _ in range(3)]
    kw = extras(s, torch.cat(xs, 2))
    blocks = [quantize(x, s, **kw) for x in xs]
    p = pack_store(blocks, blocks).key
    assert (p.kind, p.n_outliers > 0) == (s.kind, s.outlier_frac > 0)
    wide = s.scale_dtype == "fp32" or (s.kind == "fp8" and s.static)  # kept float32, not cast to float16
    assert p.scale.dtype == (torch.float32 if wide else torch.float16)
    assert p.zero is None or p.zero.dtype == p.scale.dtype
    want = torch.cat([b.dequantize() for b in blocks], 2)
    assert torch.equal(dequantize_packed(p), want)
    # every stored byte is read, nothing more (static scales are per layer: counted once per sequence/head)
    extra = 0 if not s.static else p.scale.nbytes + (p.zero.nbytes if p.zero is not None else 0)
    assert p.nbytes == sum(b.nbytes for b in blocks) + extra + (
        p.codebook.nbytes if p.codebook is not None else 0
    )
    # the quantizer quantized: the error is visible, and outliers are exact
    assert 0 < max_err(want, torch.cat(xs, 2))
    if s.outlier_frac:
        idx = p.outlier_index.long()
        assert torch.equal(want.gather(-1, idx), torch.cat(xs, 2).gather(-1, idx).half().float())


def test_reference_equals_sdpa_on_dense_ragged():
    g = torch.Generator().manual_seed(2)
    store = make_store(g, device="cpu", quant_lens=[160, 96], full_lens=[40, 13])
    B, H_kv, G, D = 2, 2, 3, 64
    q = torch.randn(B, H_kv * G, 1, D, generator=g)
    k, v, mask = materialize(store, torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask[:, None, None, :]
    )
    got = decode_attention_reference(q.double(), store, dtype=torch.float64)
    assert max_err(got, want) < 1e-12
    # padding slots are never read: garbage there changes nothing
    store.key.codes[1, :, 96:] = 255
    store.value_full[1, :, 13:] = 1e4
    assert max_err(decode_attention_reference(q.double(), store, dtype=torch.float64), got) == 0


def test_reference_pre_rope_equals_rotated_keys():
    g = torch.Generator().manual_seed(3)
    store = make_store(g, device="cpu", rope=True, T_f=0)
    q = torch.randn(2, 6, 1, 64, generator=g, dtype=torch.float64)
    # the same keys, rotated up front and stored as a float64 tail
    k = apply_rope_at(
        dequantize_packed(store.key, torch.float64),
        store.rope_cos.double(),
        store.rope_sin.double(),
        store.quant_pos0,
    )
    dense = pack_store([], [], k, dequantize_packed(store.value, torch.float64))
    want = decode_attention_reference(q, dense, dtype=torch.float64)
    assert max_err(decode_attention_reference(q, store, dtype=torch.float64), want) < 1e-12
    # and rotating matters (guards against the tables being ignored)
    store_no_rope = PackedStore(store.key, store.value, None, None, store.quant_lens, store.full_lens)
    assert max_err(decode_attention_reference(q, store_no_rope, dtype=torch.float64), want) > 1e-3


def test_pack_store_rejects_what_the_layout_cannot_hold():
    x = torch.randn(1, 2, 32, 64)
    with pytest.raises(NotImplementedError, match="float"):
        qt = quantize(x, TensorSpec(kind="float", bits=16, fmt="fp16"))
        pack_store([qt], [qt])
    with pytest.raises(ValueError, match="share its codebook"):
        s = nuq(4)
        a, b = quantize(x, s, codebook=codebook(4)), quantize(x, s, codebook=torch.linspace(-1, 1, 16).half())
        pack_store([a, b], [a, b])
    p = pack_store([quantize(x, spec(4))], [quantize(x, spec(4))]).key
    with pytest.raises(ValueError, match="needs a \\(16,\\) codebook"):
        PackedTensor(p.codes, p.scale, p.zero, 4, 1, 64, 64, kind="nuq")
    with pytest.raises(ValueError, match="fp8 PackedTensor needs bits=8"):
        PackedTensor(p.codes, p.scale, p.zero, 4, 1, 64, 64, kind="fp8", fmt="e4m3")
    with pytest.raises(ValueError, match="both be given"):
        PackedTensor(p.codes, p.scale, p.zero, 4, 1, 64, 64, outlier_values=torch.zeros(1, 2, 32, 1))
    with pytest.raises(ValueError, match="kind must be one of"):
        PackedTensor(p.codes, p.scale, p.zero, 4, 1, 64, 64, kind="float")
    qt = quantize(x, spec(4))
    with pytest.raises(ValueError, match="quant_mask must be a bool tensor of shape"):
        pack_store([qt], [qt], quant_mask=torch.ones(1, 31, dtype=torch.bool))
    with pytest.raises(ValueError, match="quant_lens must be in"):
        pack_store([qt], [qt], quant_lens=[33])
    with pytest.raises(ValueError, match="at least one token"):
        pack_store([qt], [qt], quant_lens=[0])
    with pytest.raises(ValueError, match="as many key blocks"):
        pack_store([qt], [])
    with pytest.raises(ValueError, match="rope tables cover"):
        pack_store([qt], [qt], rope_cos=torch.ones(8, 64), rope_sin=torch.ones(8, 64))


# --------------------------------------------------------------------------------------------------
# Rotated sides (Hadamard, QuaRot): the codes hold x @ R
# --------------------------------------------------------------------------------------------------

HAD = {"rotate": "hadamard"}
ROTATED_SPECS = [
    spec(4, "token", **HAD),
    spec(2, "channel", 32, **HAD),
    spec(3, "token", 16, symmetric=True, **HAD),
    nuq(4, "token", outlier_frac=0.05, **HAD),
    fp8("e4m3", "token", **HAD),
]
# (keys, values): both rotated (the *-token-hadamard presets), keys only, values only
ROTATED_SIDES = {
    "both": (spec(4, "token", **HAD), spec(4, "token", 32, **HAD)),
    "keys": (spec(4, "token", **HAD), KIVI4_VALUES),
    "values": (KIVI4_KEYS, spec(4, "token", 32, **HAD)),
    # keys centred / smoothed with channel vectors (codes of (k - mean) / factor), alone and then rotated
    "smooth-keys": (spec(4, "token", centre=True, smooth=0.5), KIVI4_VALUES),
    "smooth-rotated": (spec(4, "token", centre=True, smooth=0.5, **HAD), spec(4, "token", 32, **HAD)),
}


def key_basis_changed(s: TensorSpec) -> bool:
    """Whether keys of ``s`` are attended in another basis (a query and key tail to move)."""
    return s.rotate is not None or s.has_channel_transform


def channel_kwargs(s: TensorSpec, k: torch.Tensor) -> dict:
    """Channel vectors for ``s`` from keys ``k`` ``(B, H, T, D)``: the mean, and the spread ** 0.5 about it."""
    kw = {}
    m = k.mean(dim=(0, 2))
    if s.centre:
        kw["channel_mean"] = m.half()
    if s.smooth is not None:
        spread = (k - (m if s.centre else torch.zeros_like(m))[None, :, None, :]).abs().amax(dim=(0, 2))
        kw["channel_factor"] = spread.pow(s.smooth).half()
    return kw


@pytest.mark.parametrize("s", ROTATED_SPECS, ids=str)
def test_rotated_blocks_dequantize_like_quantized_blocks(s: TensorSpec):
    """``pack_side`` keeps a rotated spec's rotation, and ``dequantize_packed`` rotates back exactly as
    ``QuantizedTensor.dequantize`` does; the same codes read as unrotated are far off. No byte is added."""
    g = torch.Generator().manual_seed(32)
    xs = [torch.randn(2, 3, 32, 64, generator=g) * (1 + 4 * (torch.arange(64) < 4)) for _ in range(3)]
    kw = extras(s, torch.cat(xs, 2))
    blocks = [quantize(x, s, **kw) for x in xs]
    p = pack_store(blocks, blocks).key
    assert p.rotate == "hadamard" and pack_store(blocks, blocks).rotated
    assert torch.equal(dequantize_packed(p), torch.cat([b.dequantize() for b in blocks], 2))
    # float64: the packed codes decode in float64 where QuantizedTensor decodes NUQ in float32
    want64 = torch.cat([b.dequantize(torch.float64) for b in blocks], 2)
    assert max_err(dequantize_packed(p, torch.float64), want64) < 1e-5
    assert max_err(dequantize_packed(replace(p, rotate=None)), dequantize_packed(p)) > 1.0
    assert p.nbytes == sum(b.nbytes for b in blocks) + (p.codebook.nbytes if p.codebook is not None else 0)
    with pytest.raises(ValueError, match="power of two"):
        PackedTensor(p.codes, p.scale, p.zero, p.bits, p.tps, p.cps, 48, kind=p.kind, fmt=p.fmt,
                     codebook=p.codebook, rotate="hadamard")  # fmt: skip
    with pytest.raises(ValueError, match="unknown rotation"):
        replace(p, rotate="givens")


def rotated_case(
    g: torch.Generator, keys: TensorSpec, values: TensorSpec, *, device: str = DEVICE, G: int = 3
) -> tuple[torch.Tensor, PackedStore, torch.Tensor]:
    """``(q, store, truth)``: float32 queries ``(2, 2 * G, 1, 64)``, a ragged store of 96 quantized (keys
    with outlier channels) and 24 fp16 tail slots, and float64 attention over the K/V the blocks decode to
    (``QuantizedTensor.dequantize``, which rotates back) and the tail: what the store must give."""
    B, H, D, T_q, T_f = 2, 2, 64, 96, 24
    k = torch.randn(B, H, T_q, D, generator=g)
    k[..., : D // 8] *= 6
    k[..., D // 8 : D // 4] += 5  # an offset channel band (a k_proj bias), for the centred keys
    v = torch.randn(B, H, T_q, D, generator=g)
    kw = {n: t.to(device) for n, t in channel_kwargs(keys, k).items()}
    kb = [quantize(k[:, :, a : a + 32].to(device), keys, **kw) for a in range(0, T_q, 32)]
    vb = [quantize(v[:, :, a : a + 32].to(device), values) for a in range(0, T_q, 32)]
    kf = (torch.randn(B, H, T_f, D, generator=g) * 2 + 5 * (torch.arange(D) // (D // 8) == 1)).half().to(device)
    vf = torch.randn(B, H, T_f, D, generator=g).half().to(device)
    ql, fl = [96, 64], [24, 7]
    store = pack_store(kb, vb, kf, vf, quant_lens=ql, full_lens=fl)
    q = (torch.randn(B, H * G, 1, D, generator=g) * 1.5).to(device)
    K = torch.cat([b.dequantize(torch.float64) for b in kb] + [kf.double()], 2)
    V = torch.cat([b.dequantize(torch.float64) for b in vb] + [vf.double()], 2)
    return q, store, ragged_attention(q, K, V, T_q, ql, fl)


def ragged_attention(
    q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, T_q: int, ql: list[int], fl: list[int]
) -> torch.Tensor:
    """Float64 attention of ``q (B, H_kv * G, 1, D)`` over ``K``, ``V`` ``(B, H_kv, T_q + T_f, D)``: the first
    ``T_q`` slots quantized, the rest the tail, of which sequence ``b`` attends ``ql[b]`` and ``fl[b]``."""
    T_f, G = K.shape[2] - T_q, q.shape[1] // K.shape[1]
    mask = torch.cat([torch.arange(T_q)[None] < torch.tensor(ql)[:, None],
                      torch.arange(T_f)[None] < torch.tensor(fl)[:, None]], 1).to(q.device)  # fmt: skip
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), K.repeat_interleave(G, 1), V.repeat_interleave(G, 1), attn_mask=mask[:, None, None, :]
    )


@pytest.mark.parametrize("sides", list(ROTATED_SIDES))
def test_reference_over_rotated_store_equals_attention_over_dequantized_kv(monkeypatch, sides: str):
    """The reference attends a rotated store in the codes' basis (query and tail rotated in, output rotated
    out): the attention over the dequantized K/V, float64 to 1e-12, float32 (also through the dispatcher)
    to float32's error; and leaving out any part of the basis change is far off."""
    monkeypatch.setenv("KVBITS_KERNEL", "reference")
    key_spec, value_spec = ROTATED_SIDES[sides]
    q, store, truth = rotated_case(torch.Generator().manual_seed(33), key_spec, value_spec, device="cpu")
    assert (store.key.rotate, store.value.rotate) == (key_spec.rotate, value_spec.rotate)
    assert max_err(decode_attention_reference(q.double(), store, dtype=torch.float64), truth) < 1e-12
    assert max_err(decode_attention_reference(q, store), truth) < 1e-5
    assert max_err(dispatch.decode_attention(q, store), truth) < 1e-5
    k, v, mask = materialize(store, torch.float64)  # the model's K/V, rotated back
    dense = pack_store([], [], k, v, full_mask=mask)
    assert max_err(decode_attention_reference(q.double(), dense, dtype=torch.float64), truth) < 1e-12
    parts = parts_that_matter(key_basis_changed(key_spec), value_spec.rotate is not None, True)
    assert ("query" in parts) == (sides != "values")
    assert ("output" in parts) == (sides in ("both", "values", "smooth-rotated"))
    for part in parts:
        with skipping(part):
            bad = decode_attention_reference(q.double(), store, dtype=torch.float64)
        assert max_err(bad, truth) > 1e-2, part


@pytest.mark.parametrize("sides", ["keys", "smooth-rotated", "values"])
def test_code_basis_query_dtype_sets_the_query_alone(sides: str):
    """``code_basis(..., query_dtype=float32)`` (the folded kernel's call) keeps a changed ``q'`` float32, the same
    products as the default call before its float16 rounding, and leaves the tail's dtype as the default's; a query
    the store does not change (rotated values only) comes back as is."""
    q, store, _ = rotated_case(torch.Generator().manual_seed(35), *ROTATED_SIDES[sides], device="cpu")
    q = q.half()
    q16, s16, r16 = code_basis(q, store)
    q32, s32, r32 = code_basis(q, store, query_dtype=torch.float32)
    assert r16 == r32 and s32.key_full.dtype == s16.key_full.dtype == torch.float16
    if sides == "values":
        assert q16 is q and q32 is q
    else:
        assert q16.dtype == torch.float16 and q32.dtype == torch.float32
        assert torch.equal(q32.half(), q16) and not torch.equal(q32, q16.float())


def test_pre_rope_rotated_keys_are_refused():
    """Pre-RoPE keys stored rotated: the kernels would apply RoPE to codes in the rotated basis. Refused by
    every entry point (``materialize`` still decodes them right: rotated back, then RoPE). Rotated values
    beside pre-RoPE keys are fine."""
    g = torch.Generator().manual_seed(34)
    rotated = spec(4, "token", **HAD)
    store = make_store(g, rope=True, device="cpu", key_spec=rotated, value_spec=rotated)
    q = torch.randn(2, 6, 1, 64, generator=g)
    with pytest.raises(NotImplementedError, match="pre-RoPE keys stored with a 'hadamard' rotation"):
        decode_attention_reference(q, store)
    with pytest.raises(NotImplementedError, match="pre-RoPE keys stored with a 'hadamard' rotation"):
        dispatch.decode_attention(q, store)
    if triton_decode is not None:
        with pytest.raises(NotImplementedError, match="pre-RoPE keys stored with a 'hadamard' rotation"):
            triton_decode.decode_attention_triton(q.to(DEVICE), store)
    cos, sin = store.rope_cos.double(), store.rope_sin.double()
    k = apply_rope_at(dequantize_packed(store.key, torch.float64), cos, sin, store.quant_pos0)
    assert max_err(materialize(store, torch.float64)[0][:, :, :160], k) == 0
    values_only = make_store(torch.Generator().manual_seed(34), rope=True, device="cpu", value_spec=rotated)
    k, v, mask = materialize(values_only, torch.float64)
    dense = pack_store([], [], k, v, full_mask=mask)
    want = decode_attention_reference(q.double(), dense, dtype=torch.float64)
    assert max_err(decode_attention_reference(q.double(), values_only, dtype=torch.float64), want) < 1e-12


# pre-RoPE keys centred / smoothed (int*-token-smooth-prerope): codes of (k - mean) / factor before RoPE,
# decoded to code * factor + mean, then rotated; 4-bit per token, 2-bit groups of 32 channels, smoothed only.
# (spec, factor tied over RoPE pairs): tied factors move into the query (code_basis), untied ones stay in the kernel
SMOOTH_PRE_ROPE = {
    "int4-token": (spec(4, "token", centre=True, smooth=0.5, pre_rope=True), False),
    "int4-token-tied": (spec(4, "token", centre=True, smooth=0.5, pre_rope=True), True),
    "int2-group-tied": (spec(2, "token", 32, centre=True, smooth=0.5, pre_rope=True), True),
    "int8-smooth-only": (spec(8, "token", smooth=0.5, pre_rope=True), False),
    "int8-smooth-only-tied": (spec(8, "token", smooth=0.5, pre_rope=True), True),
}


def smooth_pre_rope_case(
    g: torch.Generator, key_spec: TensorSpec, tied: bool, *, device: str = DEVICE, G: int = 3
) -> tuple[torch.Tensor, PackedStore, torch.Tensor]:
    """``(q, store, truth)`` for pre-RoPE centred / smoothed keys: float32 queries ``(2, 2 * G, 1, 64)``, a
    ragged store of 96 quantized slots (pre-RoPE keys with outlier channels and an offset band, quantized with
    their channel vectors, the factor ``tied`` over RoPE pairs or not; first position 4) and 24 fp16 tail
    slots (post-RoPE, as the cache keeps them), and float64 attention over RoPE of the K the blocks decode to
    (``code * f + m``) and the tail."""
    B, H, D, T_q, T_f = 2, 2, 64, 96, 24
    k = torch.randn(B, H, T_q, D, generator=g)
    k[..., : D // 8] *= 6
    k[..., D // 8 : D // 4] += 5  # an offset band (a k_proj bias): what the mean takes out
    v = torch.randn(B, H, T_q, D, generator=g)
    kw = {n: t.to(device) for n, t in channel_kwargs(key_spec, k).items()}
    if tied:
        kw["channel_factor"] = tie_rope_pairs(kw["channel_factor"].float()).half()
    assert rope_pairs_tied(kw["channel_factor"]) == tied
    kb = [quantize(k[:, :, a : a + 32].to(device), key_spec, **kw) for a in range(0, T_q, 32)]
    vb = [quantize(v[:, :, a : a + 32].to(device), KIVI4_VALUES) for a in range(0, T_q, 32)]
    kf = (torch.randn(B, H, T_f, D, generator=g) * 2).half().to(device)
    vf = torch.randn(B, H, T_f, D, generator=g).half().to(device)
    ql, fl, pos0 = [96, 64], [24, 7], [4, 4]
    cos, sin = rope_tables(T_q + 8, D)
    store = pack_store(kb, vb, kf, vf, quant_lens=ql, full_lens=fl, rope_cos=cos.to(device),
                       rope_sin=sin.to(device), quant_pos0=pos0)  # fmt: skip
    q = (torch.randn(B, H * G, 1, D, generator=g) * 1.5).to(device)
    K_pre = torch.cat([b.dequantize(torch.float64) for b in kb], 2)  # code * f + m, the model's pre-RoPE keys
    K = torch.cat([apply_rope_at(K_pre, cos.double().to(device), sin.double().to(device),
                                 torch.tensor(pos0, device=device)), kf.double()], 2)  # fmt: skip
    V = torch.cat([b.dequantize(torch.float64) for b in vb] + [vf.double()], 2)
    return q, store, ragged_attention(q, K, V, T_q, ql, fl)


def smooth_pre_rope_parts(key_spec: TensorSpec, tied: bool) -> list[str]:
    """The parts of ``code_basis`` a pre-RoPE centred / smoothed store needs: a tied factor moves into the query
    and the tail (what stays with the codes: ``m / f`` if centred); an untied one stays with the codes."""
    return parts_that_matter(tied, False, tied, key_channels=key_spec.centre or not tied)


@pytest.mark.parametrize("name", list(SMOOTH_PRE_ROPE))
def test_reference_pre_rope_smoothed_keys_decode_before_rope(monkeypatch, name: str):
    """Pre-RoPE centred / smoothed keys decode to ``code * f + m`` before RoPE. ``code_basis`` moves a factor
    tied over RoPE pairs into the query and tail (the codes then decode to ``code + m / f``) and leaves any
    other with the codes (RoPE mixes each pair at its position's angle). The reference is the float64
    attention over those keys rotated, to 1e-12, float32 (and the dispatcher) to float32's error; leaving
    out any part is far off."""
    monkeypatch.setenv("KVBITS_KERNEL", "reference")
    key_spec, tied = SMOOTH_PRE_ROPE[name]
    q, store, truth = smooth_pre_rope_case(torch.Generator().manual_seed(36), key_spec, tied, device="cpu")
    assert store.pre_rope and store.key.has_channel_transform
    q2, store2, out_rotate = code_basis(q, store)
    assert out_rotate is None
    if tied:  # q * f, tail / f, codes + m / f
        f = store.key.channel_factor.float().repeat_interleave(3, 0)
        assert torch.equal(q2, q * f[None, :, None, :]) and store2.key.channel_factor is None
        assert max_err(store2.key_full, store.key_full.float() / store.key.channel_factor.float()[:, None]) < 1e-6
        if key_spec.centre:
            want = store.key.channel_mean.float() / store.key.channel_factor.float()
            assert max_err(store2.key.channel_mean, want) == 0
    else:
        assert q2 is q and store2 is store
    assert max_err(decode_attention_reference(q.double(), store, dtype=torch.float64), truth) < 1e-12
    assert max_err(decode_attention_reference(q, store), truth) < 1e-5
    assert max_err(dispatch.decode_attention(q, store), truth) < 1e-5
    parts = smooth_pre_rope_parts(key_spec, tied)
    assert parts == {"int4-token": ["channels"], "int8-smooth-only": ["channels"],
                     "int8-smooth-only-tied": ["query", "tail"]}.get(name, ["query", "tail", "channels"])  # fmt: skip
    for part in parts:
        with skipping(part):
            bad = decode_attention_reference(q.double(), store, dtype=torch.float64)
        assert max_err(bad, truth) > 1e-2, part


def test_rope_pairs_tied_is_memoised_per_tensor_version():
    """``rope_pairs_tied`` compares the halves once per tensor (one host sync per installed vector, not per
    decode step) and again after an in-place change; an odd head dim is never tied."""
    f = torch.ones(2, 8)
    assert rope_pairs_tied(f)
    f[0, 1] = 2.0  # in place: a new version, compared again
    assert not rope_pairs_tied(f)
    f[0, 5] = 2.0
    assert rope_pairs_tied(f)
    assert not rope_pairs_tied(torch.ones(2, 7))
    g = torch.rand(3, 16) + 0.5
    assert rope_pairs_tied(tie_rope_pairs(g)) and not rope_pairs_tied(g)
    assert torch.equal(tie_rope_pairs(g)[:, :8], torch.maximum(g[:, :8], g[:, 8:]))


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------


def test_import_kvbits_does_not_import_triton():
    code = "import sys, kvbits, kvbits.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dispatch_cpu_auto_uses_reference(monkeypatch):
    monkeypatch.delenv("KVBITS_KERNEL", raising=False)
    g = torch.Generator().manual_seed(4)
    store = make_store(g, device="cpu")
    q = torch.randn(2, 6, 1, 64, generator=g)
    assert dispatch.resolve_kernel(q, store) == "reference"
    assert torch.equal(dispatch.decode_attention(q, store), decode_attention_reference(q, store))
    monkeypatch.setenv("KVBITS_KERNEL", "fast")
    with pytest.raises(ValueError, match="reference"):
        dispatch.decode_attention(q, store)


def test_dispatch_forced_triton_without_triton_raises(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    store = make_store(torch.Generator().manual_seed(5), device="cpu")
    with pytest.raises(ImportError, match="pip install"):
        dispatch.decode_attention(torch.randn(2, 6, 1, 64), store)


def test_every_triton_kernel_module_is_guarded_by_enable_interpreter():
    """A module that decorates ``@triton.jit`` kernels at import must be in ``TRITON_KERNEL_MODULES``, so that
    importing it before ``enable_interpreter()`` (a test module doing so at top level) is refused by name."""
    from pathlib import Path

    import kvbits.kernels
    from kvbits.kernels.interpret import TRITON_KERNEL_MODULES

    folder = Path(kvbits.kernels.__file__).parent
    decorator = re.compile(r"^@triton\.jit\b", re.MULTILINE)
    jitted = {f"kvbits.kernels.{p.stem}" for p in folder.glob("*.py") if decorator.search(p.read_text())}
    assert jitted and jitted == set(TRITON_KERNEL_MODULES)


@needs_triton
@pytest.mark.parametrize("module", ["kvbits.kernels.triton_decode", "kvbits.kernels.triton_quantize"])
def test_enable_interpreter_refuses_a_kernel_module_imported_before_it(module):
    """Importing a kernel module first decorates its kernels compiled; enable_interpreter then raises, naming
    it (before: only triton_decode was checked, and an early triton_quantize import made 66 interpreter tests
    of the same xdist worker fail far from the cause). In a fresh interpreter without TRITON_INTERPRET."""
    code = (
        f"import {module}\n"
        "from kvbits.kernels.interpret import enable_interpreter\n"
        "try:\n    enable_interpreter()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("REFUSED") and module in out.stdout, out.stdout


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors through the interpreter")
def test_triton_interpret_true_is_the_interpreter_too(monkeypatch):
    """Triton takes ``TRITON_INTERPRET=true`` (``on``, ``yes``, ``y``, any case) for its interpreter; kvbits took only
    ``1``: under ``true`` ``KVBITS_KERNEL=triton`` refused CPU queries ("without it") and ``dequant="f16"`` emitted
    inline PTX, which the interpreter rejects (``inline_asm not supported in interpreter mode``)."""
    from kvbits.kernels.interpret import interpreting

    for value, on in (("1", True), ("true", True), ("On", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is on, value
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    g = torch.Generator().manual_seed(12)
    store = make_store(g, B=1, T_q=64, T_f=8, device="cpu")
    q = torch.randn(1, 6, 1, 64, generator=g).half()
    out = dispatch.decode_attention(q, store)
    f16 = triton_decode.decode_attention_triton(q, store, dequant="f16")
    assert max_err(f16, out) < 2e-3


@needs_triton
def test_forced_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    """``KVBITS_KERNEL=triton`` with CPU tensors and no interpreter: a ValueError saying what to do, before
    any launch (Triton's own error would be "0 active drivers"), for decode attention and quantize-and-pack."""
    from kvbits.kernels import quantize as qmod

    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(7)
    store = make_store(g, T_q=64, T_f=16, device="cpu")
    q = torch.randn(2, 6, 1, 64, generator=g)
    x = torch.randn(1, 2, 32, 64, generator=g)
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*got the query on cpu.*KVBITS_KERNEL=reference"):
        dispatch.decode_attention(q, store)
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*got a K/V block on cpu"):
        qmod.quantize_pack(x, KIVI4_VALUES)
    from kvbits.kernels import aot

    monkeypatch.setattr(aot, "_COMPILING", 1)  # inside aot.compile_only launches compile CPU tensors
    assert dispatch.resolve_kernel(q, store) == "triton"
    monkeypatch.setattr(aot, "_COMPILING", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted: CPU tensors are fine
    assert dispatch.resolve_kernel(q, store) == "triton"
    assert qmod.resolve_quantize_kernel(x, KIVI4_VALUES) == "triton"


@needs_triton
def test_dispatch_forced_triton_runs_the_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    g = torch.Generator().manual_seed(6)
    store = make_store(g, T_q=64, T_f=16)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    assert dispatch.resolve_kernel(q, store) == "triton"
    out = dispatch.decode_attention(q, store)
    assert max_err(out, decode_attention_reference(q, store)) < 1e-5
    # unsupported stores are refused, not silently computed by the reference
    monkeypatch.setattr(store.key, "head_dim", 48)
    with pytest.raises(NotImplementedError, match="power of two"):
        dispatch.resolve_kernel(q, store)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the automatic choice's device check, without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


@needs_triton
def test_auto_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    """``KVBITS_KERNEL=auto`` on CUDA with a store the Triton kernel refuses (a head dim of 48: a cache made with
    ``fused_decode=True`` claims such a layer) falls back to the torch reference at every decode step of every
    layer. Before, each call logged the fallback at info level: 5 calls, 5 identical lines (24 layers x 100
    tokens: 2,400). Now each distinct reason is logged once per process."""
    monkeypatch.delenv("KVBITS_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "_LOGGED_FALLBACKS", set(), raising=False)
    store = make_store(torch.Generator().manual_seed(8), T_q=64, T_f=8, device="cpu")
    monkeypatch.setattr(store.key, "head_dim", 48)
    q = torch.randn(2, 6, 1, 64).as_subclass(_CudaLooking)
    with caplog.at_level("DEBUG", logger=dispatch.logger.name):
        assert [dispatch.resolve_kernel(q, store) for _ in range(5)] == ["reference"] * 5
        monkeypatch.setattr(store.key, "head_dim", 64)
        monkeypatch.setattr(store.key, "bits", 5)  # a second reason: logged once too
        assert [dispatch.resolve_kernel(q, store) for _ in range(3)] == ["reference"] * 3
    lines = [r for r in caplog.records if "falls back to the torch reference" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelname == "INFO" for r in lines), [r.getMessage() for r in lines]
    assert "got 48" in lines[0].getMessage() and "5-bit" in lines[1].getMessage()


@needs_triton
@pytest.mark.parametrize("part", ["tail", "codes", "used_slots"])
def test_triton_refuses_views_it_would_misread(monkeypatch, part: str):
    """The kernels address every store tensor as contiguous ``(sequence, head)`` slabs. Before, a store holding a
    view with other strides (a slice of a longer tail, codes cut from a wider buffer, ``used_slots``' first slots)
    was read at other elements' addresses without a word: max error 0.62 (tail) and 3.02 (codes) against float64,
    where the contiguous store's is 0.0014. Now ``supported`` names the tensor: ``KVBITS_KERNEL=triton`` and direct
    calls raise, the automatic choice falls back to the torch reference, which reads any strides."""
    g = torch.Generator().manual_seed(44)
    store = make_store(g, T_q=64, T_f=8)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    if part == "tail":
        wide = [torch.cat([t, torch.randn_like(t)], dim=2)[:, :, :8] for t in (store.key_full, store.value_full)]
        view = replace(store, key_full=wide[0], value_full=wide[1])
    elif part == "codes":
        wide = torch.cat([store.key.codes, store.key.codes.flip(2)], dim=2)[:, :, :64]
        view = replace(store, key=replace(store.key, codes=wide))
    else:
        view = used_slots(replace(store, quant_used=32))
        store = replace(store, quant_used=32)
    assert max_err(decode_attention_reference(q.float(), view), decode_attention_reference(q.float(), store)) == 0
    assert "not contiguous" in triton_decode.supported(view, q)
    with pytest.raises(NotImplementedError, match="contiguous"):
        triton_decode.decode_attention_triton(q, view)
    from kvbits.kernels import triton_fold

    assert "not contiguous" in triton_fold.fold_supported(view, q)
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    with pytest.raises(NotImplementedError, match="contiguous"):
        dispatch.decode_attention(q, view)
    assert triton_decode.supported(store, q) is None  # the contiguous store still runs


@needs_triton
@pytest.mark.parametrize("block_t", [0, 8, 48, 32.0])
def test_decode_launch_refuses_tiles_the_kernel_cannot_take(block_t):
    """``block_t`` must be a power of two (``tl.arange``) of 16 at least (the value dot's inner size, ``p @ v``:
    Triton refuses less on NVIDIA GPUs). Before, 0 failed with a ZeroDivisionError inside the wrapper, 48 inside the
    kernel (Triton: "arange's range must be a power of 2"), and 8 ran in the interpreter only."""
    store = make_store(torch.Generator().manual_seed(46), T_q=64, T_f=8)
    q = torch.randn(2, 6, 1, 64).to(DEVICE).half()
    with pytest.raises(ValueError, match=r"block_t must be a power of two >= 16"):
        triton_decode.decode_attention_triton(q, store, block_t=block_t)


def test_packed_store_refuses_inconsistent_parts():
    """A ``PackedStore`` built by hand with parts that do not fit together is refused when it is made. Before, the
    Triton kernel attended such stores without a word (a store without its value side: outputs up to 26400 from the
    pointer standing in for the missing side; value codes or a value tail shorter than the keys': NaN from reads past
    their end) and the reference failed deep inside (``AttributeError``, an ``einsum`` size error)."""
    store = make_store(torch.Generator().manual_seed(45), T_q=64, T_f=8, device="cpu")
    fields = {f.name: getattr(store, f.name) for f in dataclasses.fields(store) if f.init}
    short_v = replace(store.value, codes=store.value.codes[:, :, :32].contiguous(),
                      scale=store.value.scale[:, :, :32].contiguous(), zero=store.value.zero[:, :, :32].contiguous())  # fmt: skip
    bad = {
        "no value side": ({"value": None}, "both quantized sides or neither"),
        "no value tail": ({"value_full": None}, "both tails or neither"),
        "shorter value codes": ({"value": short_v}, "key and value codes"),
        "shorter value tail": ({"value_full": store.value_full[:, :, :4]}, "tails must be"),
        "lengths of another batch": ({"quant_lens": store.quant_lens[:1]}, "B=1 as quant_lens"),
        "2-D lengths": ({"quant_lens": store.quant_lens[:, None]}, r"quant_lens must be \(B,\)"),
        "full lengths": ({"full_lens": store.full_lens[:1]}, r"full_lens must be \(2,\)"),
        "mask": ({"quant_mask": torch.ones(2, 63, dtype=torch.bool)}, r"quant_mask must be \(2, 64\)"),
        "empty": ({"key": None, "value": None, "key_full": None, "value_full": None}, "empty PackedStore"),
    }
    for change, match in bad.values():
        with pytest.raises(ValueError, match=match):
            PackedStore(**{**fields, **change})
    PackedStore(**fields)  # the consistent store itself


def test_packed_store_refuses_other_dtypes():
    """Slot masks, lengths and RoPE tables of another dtype are refused when the store is made. Before, an int32
    slot mask went to the Triton kernel as bytes (four per slot; outputs 1.3 off those of the bool mask, here 0.4
    for a float tail mask) and the reference failed in ``masked_fill_``; float64 tables or float positions failed
    inside the kernel launch; tables of the wrong width were read without a word."""
    g = torch.Generator().manual_seed(46)
    store = make_store(g, T_q=64, T_f=8, device="cpu", rope=True)
    mask = torch.ones(2, 64, dtype=torch.bool)
    masked = replace(store, quant_mask=mask, full_mask=torch.ones(2, 8, dtype=torch.bool))  # accepted
    fields = {f.name: getattr(masked, f.name) for f in dataclasses.fields(masked) if f.init}
    bad = {
        "int32 slot mask": ({"quant_mask": mask.int()}, TypeError, "quant_mask must be torch.bool, got torch.int32"),
        "float tail mask": ({"full_mask": torch.ones(2, 8)}, TypeError, "full_mask must be torch.bool"),
        "float lengths": ({"quant_lens": store.quant_lens.float()}, TypeError, "quant_lens must be torch.int32 or"),
        "float positions": ({"quant_pos0": store.quant_pos0.float()}, TypeError, "quant_pos0 must be"),
        "float64 tables": ({"rope_cos": store.rope_cos.double(), "rope_sin": store.rope_sin.double()}, TypeError,
                           "rope_cos must be torch.float32, got torch.float64"),
        "one table": ({"rope_sin": None}, ValueError, "rope_cos and rope_sin must both be None or both"),
        "tables of another width": ({"rope_cos": store.rope_cos[:, :20], "rope_sin": store.rope_sin[:, :20]},
                                    ValueError, r"\(T_pos, D=64\) or half-width \(T_pos, 32\)"),
    }  # fmt: skip
    for change, error, match in bad.values():
        with pytest.raises(error, match=match):
            PackedStore(**{**fields, **change})
    long = replace(masked, quant_lens=store.quant_lens.long(), quant_pos0=store.quant_pos0.long())  # int64: accepted
    q = torch.randn(2, 6, 1, 64, generator=g)
    assert torch.equal(decode_attention_reference(q, long), decode_attention_reference(q, masked))


def test_packed_store_refuses_unreadable_rope_tables():
    """RoPE tables without ``quant_pos0`` were accepted: the Triton kernel then loaded each sequence's first position
    from a one-byte placeholder, the reference failed in ``apply_rope_at`` (``'NoneType' object has no attribute
    'long'``); tables without rows were read before their start. Both are refused when the store is made."""
    g = torch.Generator().manual_seed(47)
    store = make_store(g, T_q=64, T_f=8, device="cpu", rope=True)
    fields = {f.name: getattr(store, f.name) for f in dataclasses.fields(store) if f.init}
    cos, sin = store.rope_cos, store.rope_sin
    with pytest.raises(ValueError, match="RoPE tables need quant_pos0"):
        PackedStore(**{**fields, "quant_pos0": None})
    with pytest.raises(ValueError, match="no rows"):
        PackedStore(**{**fields, "rope_cos": cos[:0], "rope_sin": sin[:0]})
    PackedStore(**{**fields, "rope_cos": cos[:1], "rope_sin": sin[:1]})  # one row: read at every position


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
def test_kernel_clamps_positions_past_short_rope_tables(vectorized: bool | None):
    """A hand-built store whose RoPE tables are shorter than its positions (here 20 rows, keys at positions 4...163;
    ``kvbits.cache`` sizes its tables, but checking a store's device positions would cost a sync per decode step):
    the kernel read past the tables' end (interpreted: outputs 2.7 off the reference). It reads their last row
    there now, as the reference clamps: the two agree."""
    g = torch.Generator().manual_seed(21)
    store = make_store(g, rope=True, quant_lens=[160, 64], full_lens=[40, 9])
    short = replace(store, rope_cos=store.rope_cos[:20].contiguous(), rope_sin=store.rope_sin[:20].contiguous())
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    truth = decode_attention_reference(q.double(), short, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q.half(), short, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), short, splits=2, vectorized=vectorized)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)


@needs_triton
def test_dispatch_passes_the_dequant_mode(monkeypatch):
    """``KVBITS_DEQUANT=f16`` reaches the kernel (float16 queries); anything else but f32/f16 is refused."""
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    seen: list[str] = []
    real = triton_decode.decode_attention_triton
    monkeypatch.setattr(triton_decode, "decode_attention_triton",
                        lambda q, store, scale=None, **kw: seen.append(kw["dequant"]) or real(q, store, scale, **kw))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    store = make_store(g, T_q=64, T_f=16)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    ref = dispatch.decode_attention(q, store)
    monkeypatch.setenv("KVBITS_DEQUANT", "f16")
    out = dispatch.decode_attention(q, store)
    assert seen == ["f32", "f16"] and max_err(out, ref) < 1e-3
    monkeypatch.setenv("KVBITS_DEQUANT", "int4")
    with pytest.raises(ValueError, match="KVBITS_DEQUANT must be one of"):
        dispatch.decode_attention(q, store)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_kernel_unpacks_exact_codes(bits: int):
    g = torch.Generator().manual_seed(10 + bits)
    x = torch.randn(2, 2, 24, 64, generator=g).to(DEVICE)  # 24 rows: a partial tile
    qt = quantize(x, spec(bits, "token", 16, symmetric=bits == 3))
    p = pack_store([qt], [qt]).key
    assert torch.equal(triton_decode.unpack_codes_triton(p), unpack_bits(p.codes, bits, 64))
    # same float32 formula as the reference; a fused multiply-add may move the last bit on a GPU
    torch.testing.assert_close(
        triton_decode.dequantize_packed_triton(p), dequantize_packed(p), rtol=2e-7, atol=1e-7
    )


@needs_triton
@pytest.mark.parametrize("s", KIND_SPECS, ids=str)
@pytest.mark.parametrize("vectorized", [False, True], ids=["gather", "rows"])
def test_kernel_decodes_kinds_like_the_reference(s: TensorSpec, vectorized: bool):
    if vectorized and s.bits == 3:
        pytest.skip("3-bit codes are read per element only")
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(2, 2, 64, 64, generator=g) * (1 + 4 * (torch.arange(64) < 4))).to(DEVICE)
    qt = quantize(x, s, **extras(s, x))
    p = pack_store([qt], [qt]).key
    torch.testing.assert_close(
        triton_decode.dequantize_packed_triton(p, vectorized=vectorized),
        dequantize_packed(p),
        rtol=2e-7,
        atol=1e-7,
    )


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_fp8_decoding_is_exact_for_every_byte(fmt: str):
    """All 256 float8 bit patterns, subnormals, NaN and (e5m2) infinities included, against torch's casts."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 4, 64).to(DEVICE)
    ones = torch.ones(1, 1, 4, 1, dtype=torch.float16, device=DEVICE)

    p = PackedTensor(codes, ones, None, 8, 1, 64, 64, kind="fp8", fmt=fmt)
    got = triton_decode.dequantize_packed_triton(p)
    want = codes.view(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


# (name, make_store kwargs, splits, vectorized): vectorized=None reads whole packed rows (the default,
# 2/4/8-bit), False one gather per element (the path of 3-bit codes and pre-RoPE keys)
ATTENTION_CASES = [
    ("int8-kivi", {"key_spec": spec(8, "channel", 32), "value_spec": spec(8, "token", 32)}, 3, None),
    ("int4-kivi", {"key_spec": spec(4, "channel", 32), "value_spec": spec(4, "token", 32)}, 2, None),
    ("int2-kivi", {"key_spec": spec(2, "channel", 32), "value_spec": spec(2, "token", 32)}, 3, None),
    ("int4-kivi-gather", {"key_spec": spec(4, "channel", 32), "value_spec": spec(4, "token", 32)}, 2, False),
    ("int2-token-keys-gather", {"key_spec": spec(2, "token"), "value_spec": spec(2, "token")}, 2, False),
    ("int4-token-keys", {"key_spec": spec(4, "token"), "value_spec": spec(4, "token")}, 2, None),
    (
        "int2-channel16-mha",
        {"key_spec": spec(2, "channel", 16), "value_spec": spec(2, "token"), "H_kv": 3, "G": 1},
        1,
        None,
    ),
    (
        "int3-sym-head",
        {"key_spec": spec(3, "token", 32, symmetric=True), "value_spec": spec(4, "head")},
        2,
        None,
    ),
    ("tail-only", {"T_q": 0, "T_f": 150}, 2, None),
    (
        "kvquant-4-block-outliers",
        {
            "key_spec": nuq(4, "channel", 32, outlier_frac=0.03),
            "value_spec": nuq(4, "token", outlier_frac=0.03),
        },
        2,
        None,
    ),
    (
        "nuq3-static-keys",
        {"key_spec": nuq(3, "channel", None, static=True), "value_spec": nuq(3, "token")},
        2,
        None,
    ),
    ("fp8-e4m3-token", {"key_spec": fp8("e4m3"), "value_spec": fp8("e4m3")}, 2, None),
    (
        "fp8-e5m2-static-outliers",
        {"key_spec": fp8("e5m2", "tensor", static=True), "value_spec": fp8("e5m2", outlier_frac=0.03)},
        3,
        None,
    ),
    (
        "int4-outliers-gather",
        {"key_spec": spec(4, "channel", 32, outlier_frac=0.03), "value_spec": spec(4, "token", 32)},
        2,
        False,
    ),
    ("no-tail-d128-g4", {"T_f": 0, "D": 128, "G": 4, "B": 1}, 2, None),
    (
        "vllm-int8-fp32-scales",
        {"key_spec": spec(8, "token", symmetric=True, rounding="trunc", scale_dtype="fp32"),
         "value_spec": spec(8, "token", symmetric=True, rounding="trunc", scale_dtype="fp32")},
        2,
        None,
    ),
    (
        "int4-kivi-fp32-scales",
        {"key_spec": spec(4, "channel", 32, scale_dtype="fp32"), "value_spec": spec(4, "token", 32, scale_dtype="fp32")},
        2,
        None,
    ),
]


@needs_triton
@pytest.mark.parametrize("name,kw,splits,vectorized", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_kernel_within_twice_torch_error_fp16(name: str, kw: dict, splits: int, vectorized: bool | None):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    kw = dict(kw)
    G = kw.pop("G", 3)
    B, H_kv = kw.get("B", 2), kw.get("H_kv", 2)
    T_q, T_f = kw.get("T_q", 160), kw.get("T_f", 40)
    ragged = {"quant_lens": [T_q, T_q * 3 // 5], "full_lens": [T_f, T_f // 3 + 1]}
    store = make_store(g, **ragged, **kw) if B == 2 else make_store(g, **kw)
    D = store.head_dim
    q = (torch.randn(B, H_kv * G, 1, D, generator=g) * 1.5).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    torch_fp16 = decode_attention_reference(q.half(), store, dtype=torch.float16)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=splits, vectorized=vectorized)
    assert out.shape == (B, H_kv * G, 1, D) and out.dtype == torch.float16
    err, err_pt = max_err(out, truth), max_err(torch_fp16, truth)
    assert err <= 2 * err_pt + 1e-6, f"{name}: kernel error {err:.3g} > 2 x torch fp16 error {err_pt:.3g}"


@needs_triton
@pytest.mark.parametrize("rope", [False, True], ids=["kivi", "pre-rope"])
def test_kernel_bf16_queries(rope: bool):
    """bfloat16 queries (how Llama-3-class models are served) stay within twice torch's bfloat16 error.
    Before session 10 the interpreter multiplied bfloat16 dot operands as integers, so this never ran."""
    g = torch.Generator().manual_seed(11 + rope)
    store = make_store(g, rope=rope, quant_lens=[160, 96], full_lens=[40, 9])
    q = (torch.randn(2, 6, 1, 64, generator=g) * 1.5).to(DEVICE).bfloat16()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.bfloat16), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=2)
    assert out.dtype == torch.bfloat16
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)


@needs_triton
def test_float32_to_bfloat16_casts_round_to_nearest_even():
    """``x.to(tl.bfloat16)`` rounds to nearest, ties to even, as the GPU (``cvt.rn``) and torch do; Triton's
    interpreter truncated (1 + 2^-8 + 2^-10 became 1.0), and bfloat16 attention through it measured about twice
    its compiled error (0.0056 against torch bfloat16's 0.0028), near the 2x bound of the tests."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))

    g = torch.Generator().manual_seed(7)
    special = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10, -(1 + 2**-8 + 2**-10), 3.3895e38, 3.4e38, -3.4e38,
               float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39]  # fmt: skip
    x = torch.cat([torch.tensor(special), torch.randn(256 - len(special), generator=g) * 10]).float().to(DEVICE)
    y = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    cast[(1,)](x, y, N=256)
    want = x.bfloat16()
    assert torch.equal(y.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(y[fin].view(torch.int16), want[fin].view(torch.int16))


@needs_triton
def test_integer_to_bfloat16_casts_convert_values():
    """``i.to(tl.bfloat16)`` of an integer converts its value, as on the GPU; Triton's interpreter reinterpreted the
    integer's bits (7 became 6.4e-40, -3 NaN), so a kernel that casts its codes straight to bfloat16 (``K_ROWS``
    goes through float32 for that reason) measured garbage only on CPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))

    g = torch.Generator().manual_seed(8)
    special = torch.tensor([0, 1, -1, 7, -3, 127, -128, 255, 257, 99999, -(2**24), 2**24 - 1])
    for dtype in (torch.int32, torch.int8, torch.int16):
        info = torch.iinfo(dtype)
        x = torch.cat([special.clamp(info.min, info.max),
                       torch.randint(info.min, info.max, (64 - len(special),), generator=g)]).to(dtype)  # fmt: skip
        y = torch.empty(64, dtype=torch.bfloat16, device=DEVICE)
        cast[(1,)](x.to(DEVICE), y, N=64)
        assert torch.equal(y.cpu().view(torch.int16), x.bfloat16().view(torch.int16)), dtype


@needs_triton
@pytest.mark.parametrize("seed", range(3))
def test_kernel_bf16_per_token_int8_keys(seed: int):
    """bfloat16 queries over symmetric int8 per-token keys (``K_ROWS``: the codes enter the dots exactly, each
    token's scale applies to its float32 score) are no less accurate than bfloat16 torch, which rounds the keys and
    the scores to bfloat16 (0.4-0.6x its error over 12 seeds). Interpreted with truncating float32 → bfloat16
    casts the kernel's error was 0.8-1.8x torch's (1.81x, 1.23x, 1.79x at these seeds)."""
    g = torch.Generator().manual_seed(30 + seed)
    s8 = spec(8, "token", symmetric=True)
    store = make_store(g, key_spec=s8, value_spec=s8, T_q=64, T_f=8, quant_lens=[64, 40], full_lens=[8, 3])
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).bfloat16()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.bfloat16), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=2)
    assert out.dtype == torch.bfloat16
    assert max_err(out, truth) <= err_pt, (max_err(out, truth), err_pt)


@needs_triton
def test_kernel_fp32_queries_and_many_splits():
    g = torch.Generator().manual_seed(20)
    store = make_store(g, quant_lens=[160, 40], full_lens=[40, 1])  # short sequence: empty splits
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=5, block_t=32)
    assert out.dtype == torch.float32
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
@pytest.mark.parametrize("tables", ["full", "half", "distinct-halves"])
def test_kernel_pre_rope_keys(vectorized: bool | None, tables: str):
    """Pre-RoPE keys rotated in the kernel: whole rows split into halves in registers (default) or the
    per-element gathers with the partner channel read again; full or half-width tables, and full tables
    whose halves differ (each channel must read its own column)."""
    g = torch.Generator().manual_seed(21)
    store = make_store(g, rope=True, quant_lens=[160, 64], full_lens=[40, 9])
    if tables == "half":
        store = replace(store, rope_cos=store.rope_cos[:, :32].contiguous(), rope_sin=store.rope_sin[:, :32].contiguous())  # fmt: skip
    elif tables == "distinct-halves":
        cos = torch.rand(store.rope_cos.shape, generator=g) * 2 - 1
        sin = torch.rand(store.rope_sin.shape, generator=g) * 2 - 1
        store = replace(store, rope_cos=cos.to(DEVICE), rope_sin=sin.to(DEVICE))
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q.half(), store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=2, vectorized=vectorized)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    # the rotation matters: the same store read as post-RoPE keys is far off
    plain = replace(store, rope_cos=None, rope_sin=None, quant_pos0=None)
    assert max_err(decode_attention_reference(q.double(), plain, dtype=torch.float64), truth) > 1e-2


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_half_width_rope_tables_read_the_same_values(path: str):
    """Rotate-half tables repeat their halves; the cache keeps the first half only (``RopeTableCache``).
    Both paths read channel ``d`` at column ``d mod D/2``: the output is identical to full-width tables,
    bit for bit, and a half table of the wrong width is refused."""
    if path == "triton" and triton_decode is None:
        pytest.skip("Triton not importable")
    g = torch.Generator().manual_seed(23)
    full = make_store(g, rope=True, quant_lens=[160, 64], full_lens=[40, 9])
    h = full.head_dim // 2
    assert torch.equal(full.rope_cos[:, :h], full.rope_cos[:, h:])
    half = replace(full, rope_cos=full.rope_cos[:, :h].contiguous(), rope_sin=full.rope_sin[:, :h].contiguous())  # fmt: skip
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    if path == "reference":
        run = lambda st: decode_attention_reference(q.float(), st)
    else:
        run = lambda st: triton_decode.decode_attention_triton(q, st, splits=2)
    assert torch.equal(run(half), run(full))
    # a table that is not rotate-half's repeated half gives another result (the halves are really read)
    skew = replace(half, rope_sin=half.rope_sin.roll(1, dims=1))
    assert not torch.equal(run(skew), run(full))
    kb = [quantize(torch.randn(1, 1, 32, 64, generator=g), KIVI4_KEYS)]
    vb = [quantize(torch.randn(1, 1, 32, 64, generator=g), KIVI4_VALUES)]
    cos, sin = rope_tables(40, 64)
    assert pack_store(kb, vb, rope_cos=cos[:, :h], rope_sin=sin[:, :h]).rope_cos.shape == (40, h)
    with pytest.raises(ValueError, match="half-width"):
        pack_store(kb, vb, rope_cos=cos[:, : h - 1], rope_sin=sin[:, : h - 1])


def _masked_store(g: torch.Generator, **kw) -> PackedStore:
    """A store whose sequence 1 is left-padded: its first quantized and tail slots must not be attended."""
    store = make_store(g, **kw)
    B, T_q, T_f = store.batch, store.key.n_slots, store.key_full.shape[2]
    qm = torch.ones(B, T_q, dtype=torch.bool)
    fm = torch.ones(B, T_f, dtype=torch.bool)
    qm[1, :70], fm[1, :5] = False, False  # left padding: sinks and the first quantized slots
    qm[0, 17] = False  # any other slot too
    return replace(store, quant_mask=qm.to(DEVICE), full_mask=fm.to(DEVICE))


def test_reference_masked_slots_are_not_attended():
    g = torch.Generator().manual_seed(40)
    store = _masked_store(g, device="cpu")
    q = torch.randn(2, 6, 1, 64, generator=g, dtype=torch.float64)
    k, v, mask = materialize(store, torch.float64)
    assert not mask[1, :70].any() and mask[1, 70:160].all() and not mask[1, 160:165].any()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask[:, None, None, :]
    )
    got = decode_attention_reference(q, store, dtype=torch.float64)
    assert max_err(got, want) < 1e-12
    store.value.codes[1, :, :70] = 255  # garbage in masked slots changes nothing
    store.value_full[1, :, :5] = 1e4
    assert max_err(decode_attention_reference(q, store, dtype=torch.float64), got) == 0


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
def test_kernel_masked_slots(vectorized: bool | None):
    g = torch.Generator().manual_seed(41)
    store = _masked_store(g)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q.half(), store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=3, vectorized=vectorized)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    # the masks matter (guards against them being ignored)
    unmasked = replace(store, quant_mask=None, full_mask=None)
    assert max_err(decode_attention_reference(q.double(), unmasked, dtype=torch.float64), truth) > 1e-2


@needs_triton
@pytest.mark.parametrize("dequant", ["f32", "fold"])
def test_kernel_reads_a_tail_mask_of_padded_rows(dequant: str):
    """A ``full_mask`` that is a view of wider rows (``word_rows``: rows padded to 4 bytes, here 8 for 5 slots) was
    read at ``b * T_f``: the second sequence's mask came from the first row's padding (NaN: every slot masked).
    The launchers pack it first; the result is the contiguous mask's."""
    g = torch.Generator().manual_seed(43)
    B, T_f, D = 2, 5, 64
    kf, vf = (torch.randn(B, 1, T_f, D, generator=g).half().to(DEVICE) for _ in range(2))
    keep = torch.tensor([[True] * 5, [False, False, True, True, True]], device=DEVICE)
    padded = word_rows(keep)
    assert padded.stride(0) == 8 and not padded.is_contiguous()
    lens = torch.zeros(B, dtype=torch.int32, device=DEVICE), torch.full((B,), T_f, dtype=torch.int32, device=DEVICE)
    store = PackedStore(None, None, kf, vf, *lens, full_mask=padded)
    q = torch.randn(B, 3, 1, D, generator=g).half().to(DEVICE)
    truth = decode_attention_reference(q.double(), replace(store, full_mask=keep), dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=1, dequant=dequant)
    assert not out.isnan().any() and max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)


@needs_triton
def test_kernel_pre_rope_nuq_keys_with_outliers():
    """kvquant-*-block's keys: pre-RoPE, NUQ, per-channel over 32-token blocks, sparse outliers."""
    g = torch.Generator().manual_seed(42)
    kw = {
        "key_spec": nuq(3, "channel", 32, outlier_frac=0.03),
        "value_spec": nuq(3, "token", outlier_frac=0.03),
    }
    store = make_store(g, rope=True, quant_lens=[160, 96], full_lens=[40, 9], **kw)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q.half(), store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=2)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
@pytest.mark.parametrize("sides", list(ROTATED_SIDES))
def test_kernel_rotated_store(monkeypatch, sides: str, vectorized: bool | None):
    """The Triton wrapper attends a rotated store in the codes' basis, unchanged kernels: float16 queries
    within twice torch's float16 error of the float64 attention over the dequantized K/V, float32 queries
    within float32's, also through the dispatcher; its dequantization rotates back like the reference's;
    and leaving out any part of the basis change is far off."""
    key_spec, value_spec = ROTATED_SIDES[sides]
    q, store, truth = rotated_case(torch.Generator().manual_seed(35), key_spec, value_spec)
    err_pt = max_err(decode_attention_reference(q.half(), store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=2, vectorized=vectorized)
    assert out.dtype == torch.float16
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    out32 = triton_decode.decode_attention_triton(q, store, splits=2, vectorized=vectorized)
    assert out32.dtype == torch.float32 and max_err(out32, truth) < 1e-5
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    assert max_err(dispatch.decode_attention(q, store), truth) < 1e-5
    for p in (store.key, store.value):
        if p.rotate is not None or p.has_channel_transform:
            got = triton_decode.dequantize_packed_triton(p, vectorized=vectorized is None)
            torch.testing.assert_close(got, dequantize_packed(p), rtol=1e-6, atol=1e-5)
    for part in parts_that_matter(key_basis_changed(key_spec), value_spec.rotate is not None, True):
        with skipping(part):
            bad = triton_decode.decode_attention_triton(q.half(), store, splits=2, vectorized=vectorized)
        assert max_err(bad, truth) > 1e-2, part


@needs_triton
@pytest.mark.parametrize("seed", range(4))
def test_kernel_keeps_the_rotated_query_exact(monkeypatch, seed: int):
    """Hadamard-rotated INT8 rows, sharp attention (float16 queries x 6), no tail: the kernel attends with ``q' = q R``
    kept float32 (two float16 halves per key dot, ``Q_SPLIT``), so what is left is its float16 keys' rounding, as in
    float16 torch, which also rounds ``q'``: at most 0.8x torch's error (0.27-0.62x; with ``q'`` rounded 0.50-1.06x,
    seeds 0 and 2 above 0.8). On Qwen2.5's ``int8-token-hadamard`` cache that rounding put the kernel at 1.78x float16
    torch's error at one layer (``benchmarks/fold_real_kv.py``)."""
    g = torch.Generator().manual_seed(seed)
    q, store, _ = rotated_case(g, spec(8, "token", **HAD), spec(8, "token", **HAD), G=4)
    store = replace(store, full_lens=torch.zeros_like(store.full_lens))
    q = (q * 6).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    out = triton_decode.decode_attention_triton(q, store)
    assert out.dtype == torch.float16 and spy.seen[-1]["Q_SPLIT"] and not spy.seen[-1]["IEEE"]
    assert max_err(out, truth) <= 0.8 * max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)


ROW_KEYS = {  # per-token integer keys the kernel reads as codes (K_ROWS)
    "int4": spec(4), "int8": spec(8), "int8-sym": spec(8, symmetric=True), "int2": spec(2),
}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(ROW_KEYS))
def test_per_token_keys_enter_the_dots_as_codes(monkeypatch, name: str, seed: int):
    """Keys with one scale per token: the codes are the dots' operand (exact in float16) and ``s_t (q . c_t) +
    z_t sum(q)`` the score, in float32 (``K_ROWS``). What is left is the values' and probabilities' rounding: at
    most 0.5x float16 torch's error (0.18-0.47x here), and never above the kernel with its keys dequantized and
    rounded to float16 (``row_keys=False``: 0.32-0.92x, int4 seeds 0 and 3 above 0.5x). On SmolLM2's real INT4
    per-token caches that rounding put single decode steps at up to 3.1x float16 torch's error
    (``benchmarks/fold_real_kv.py``, BENCHMARKS.md §6 session 43). A ragged batch, INT8 values, no tail."""
    g = torch.Generator().manual_seed(seed)
    store = make_store(g, key_spec=ROW_KEYS[name], value_spec=spec(8), T_f=0, quant_lens=[160, 137],
                       full_lens=[0, 0])  # fmt: skip
    q = (torch.randn(2, 8, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    out = triton_decode.decode_attention_triton(q, store, splits=2)
    assert spy.seen[-1]["K_ROWS"] and out.dtype == torch.float16
    rounded = triton_decode.decode_attention_triton(q, store, splits=2, row_keys=False)
    assert not spy.seen[-1]["K_ROWS"]
    assert max_err(out, truth) <= 0.5 * err_pt, (max_err(out, truth), err_pt)
    assert max_err(out, truth) <= max_err(rounded, truth) + 1e-6


@needs_triton
def test_per_token_keys_as_codes_in_bfloat16_and_through_padding(monkeypatch):
    """``K_ROWS`` with bfloat16 queries (codes up to 255 are exact in bfloat16), a Hadamard-rotated store (a float32
    ``q'`` split in two halves, both in ``sum(q')``), and a left-padded batch over reserved slots holding NaN scales:
    within twice torch's error at the query's precision, nothing leaks from the masked slots."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(5)
    store = make_store(g, key_spec=spec(4), value_spec=spec(4), quant_lens=[160, 96], full_lens=[40, 9])
    store.quant_mask = torch.ones(2, 160, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :20] = False  # sequence 1 left-padded
    store.key.scale[1, :, 96:] = float("nan")  # slots past sequence 1's length: never read
    q = (torch.randn(2, 6, 1, 64, generator=g) * 1.5).to(DEVICE)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        err_pt = max_err(decode_attention_reference(q.to(dtype), store, dtype=dtype), truth)
        out = triton_decode.decode_attention_triton(q.to(dtype), store, splits=3)
        assert spy.seen[-1]["K_ROWS"] and out.isfinite().all()
        assert max_err(out, truth) <= 2 * err_pt, (dtype, max_err(out, truth), err_pt)
    q2, rot, _ = rotated_case(g, spec(4, "token", **HAD), spec(8, "token", **HAD), G=4)
    truth = decode_attention_reference(q2.half().double(), rot, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q2.half(), rot, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q2.half(), rot)
    assert spy.seen[-1]["K_ROWS"] and spy.seen[-1]["Q_SPLIT"]
    assert max_err(out, truth) <= err_pt, (max_err(out, truth), err_pt)


@needs_triton
@pytest.mark.parametrize(
    "key_spec,kw",
    [
        (spec(4, "channel", 32), {}),  # KIVI's per-channel keys: a scale per channel
        (spec(4, "token", 32), {}),  # per-token groups of 32 channels: several scales per row
        (spec(4, "token", outlier_frac=0.03), {}),  # outliers written back into the rows
        (nuq(4, "token"), {}),  # codebook values
        (fp8(), {}),
        (spec(4), {"rope": True}),  # pre-RoPE keys: RoPE rotates the dequantized rows
        (spec(4), {"float32": True}),  # float32 queries: the dots are exact float32 already
        (spec(4), {"row_keys": False}),
        (spec(4), {"vectorized": False}),  # the gather path
    ],
    ids=["channel", "token-g32", "outliers", "nuq", "fp8", "pre-rope", "float32", "off", "gather"],
)
def test_keys_outside_k_rows_keep_the_dequantized_path(monkeypatch, key_spec, kw: dict):
    """Only whole-row integer keys with one scale per token and no outliers take ``K_ROWS``; the rest dequantize as
    before, and stay within twice torch's error."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(11)
    store = make_store(g, key_spec=key_spec, value_spec=spec(4, "token", 32), rope=kw.get("rope", False))
    dtype = torch.float32 if kw.get("float32") else torch.float16
    q = (torch.randn(2, 4, 1, 64, generator=g) * 1.5).to(DEVICE).to(dtype)
    call = {k: v for k, v in kw.items() if k in ("row_keys", "vectorized")}
    out = triton_decode.decode_attention_triton(q, store, splits=2, **call)
    assert not spy.seen[-1].get("K_ROWS", False)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=dtype), truth)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
@pytest.mark.parametrize("name", list(SMOOTH_PRE_ROPE))
def test_kernel_pre_rope_smoothed_keys(monkeypatch, name: str, vectorized: bool | None):
    """The Triton kernel decodes pre-RoPE centred / smoothed keys to ``code * f + m`` in registers (a factor
    tied over RoPE pairs moved into the query instead: ``code + m / f``), then applies RoPE (whole rows, or per
    element with the partner channel's own vectors): float16 queries within twice torch's float16 error of
    the float64 attention over those keys, float32 within float32's, also through the dispatcher; leaving out
    any part (the in-kernel vectors: ``K_MEAN`` / ``K_FACTOR`` off) far off."""
    key_spec, tied = SMOOTH_PRE_ROPE[name]
    q, store, truth = smooth_pre_rope_case(torch.Generator().manual_seed(37), key_spec, tied)
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    err_pt = max_err(decode_attention_reference(q.half(), store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q.half(), store, splits=2, vectorized=vectorized)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    meta = spy.seen[-1]
    assert meta["ROPE"] and meta["K_MEAN"] == key_spec.centre and meta["K_FACTOR"] == (not tied)
    assert meta["VEC_K"] == (vectorized is None)
    out32 = triton_decode.decode_attention_triton(q, store, splits=3, vectorized=vectorized)
    assert max_err(out32, truth) < 1e-5
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    assert max_err(dispatch.decode_attention(q, store), truth) < 1e-5
    for part in smooth_pre_rope_parts(key_spec, tied):
        with skipping(part):
            bad = triton_decode.decode_attention_triton(q.half(), store, splits=2, vectorized=vectorized)
        if part == "channels":
            assert not spy.seen[-1]["K_MEAN"] and not spy.seen[-1]["K_FACTOR"]
        assert max_err(bad, truth) > 1e-2, part


def near_limit_pre_rope_case(tied: bool, *, device: str = DEVICE) -> tuple[torch.Tensor, PackedStore, torch.Tensor]:
    """``(q, store, truth)``: pre-RoPE int2 smoothed keys of which every third token is ``-52384`` on every channel
    (within the bound the cache accepts), factors ``0.8`` / ``1.5`` over the halves (``tied``: ``0.8`` everywhere,
    folded into the query), float16 queries ``(1, 2, 1, 64)`` small enough for float16 scores. The 1.5 channels
    decode to ``-98256``, saturated to ``-65504``; RoPE turns a pair at 45 degrees into ``-92k``, saturated again.
    ``truth``: float64 attention over the keys so saturated (tied: the folded keys ``k / f``, as the float16 dot
    holds them, so ``+-65504 f``)."""
    g = torch.Generator().manual_seed(53)
    D, T = 64, 32
    key_spec = spec(2, "token", symmetric=True, centre=True, smooth=0.5, pre_rope=True)
    f = torch.full((1, D), 0.8)
    if not tied:
        f[:, D // 2 :] = 1.5
    k = torch.randn(1, 1, T, D, generator=g)
    k[:, :, ::3] = -52384.0
    kw = {"channel_factor": f.half().to(device), "channel_mean": torch.zeros(1, D).half().to(device)}
    kb = [quantize(k.half().to(device), key_spec, **kw)]
    vb = [quantize(torch.randn(1, 1, T, D, generator=g).to(device), KIVI4_VALUES)]
    cos, sin = rope_tables(T, D)
    store = pack_store(kb, vb, rope_cos=cos.to(device), rope_sin=sin.to(device), quant_pos0=[0])
    assert rope_pairs_tied(store.key.channel_factor) == tied
    top = 65504.0 * (f.double() if tied else torch.ones(1, D, dtype=torch.float64)).to(device)
    K = torch.maximum(torch.minimum(kb[0].dequantize(torch.float64), top), -top)
    K = apply_rope_at(K, cos.double().to(device), sin.double().to(device), torch.zeros(1, dtype=torch.long, device=device))
    K = torch.maximum(torch.minimum(K, top), -top)
    q = (torch.randn(1, 2, 1, D, generator=g) * 1e-3).half().to(device)
    return q, store, ragged_attention(q, K, vb[0].dequantize(torch.float64), T, [T], [0])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_reference_saturates_pre_rope_keys_before_and_after_rope(tied: bool):
    """Pre-RoPE smoothed keys near float16's limit: ``materialize`` in float16 saturates them to +-65504 before
    RoPE (as ``QuantizedTensor.dequantize``) and after it (a pair within 65504 rotates to up to ``sqrt(2)`` times
    it: inf before, NaN in attention), so the float16 reference is finite and near the saturated truth."""
    q, store, truth = near_limit_pre_rope_case(tied, device="cpu")
    k16 = materialize(code_basis(q, store, torch.float16)[1], torch.float16)[0]
    assert k16.isfinite().all() and k16.abs().max() == 65504
    out = decode_attention_reference(q, store, dtype=torch.float16)
    assert out.isfinite().all() and max_err(out, truth) < 0.02, max_err(out, truth)


@pytest.mark.parametrize("centre", [False, True], ids=["smooth", "centre-smooth"])
def test_folded_keys_at_the_cache_bound_stay_within_float16(centre: bool):
    """A tied factor folded into the query leaves float16 keys ``k / f``, saturated at ``+-65504`` (``+-65504 f``
    in the model's units, harsher than the unfolded path's where ``f < 1``, as calibrated factors, normalised to
    mean 1, always have somewhere). Keys the cache accepts never get there: its bound ``65504 / sqrt(2) min(f) -
    max |m|`` (``channel_bound``) keeps ``|k / f|`` under 65504 before RoPE and after it, so the fold is kept for
    float16 queries (refusing it where ``min(f) < 1`` would refuse it for every calibrated layer). Post-RoPE keys
    all at that bound, un-rotated, quantized (int4 per token): the folded float16 keys stay below 65504."""
    from kvbits.cache.checks import input_bound
    from kvbits.cache.fixed import channel_bound

    g = torch.Generator().manual_seed(61)
    D, T = 64, 64
    key_spec = spec(4, "token", centre=centre, smooth=0.5, pre_rope=True)
    f = tie_rope_pairs(torch.rand(1, D, generator=g) + 0.3)
    f = (f / f.mean()).half()
    kw = {"channel_factor": f} | ({"channel_mean": (torch.randn(1, D, generator=g) * 100).half()} if centre else {})
    bound = channel_bound(*input_bound(key_spec, "quantized", D), kw.get("channel_mean"), f)[0]
    cos, sin = rope_tables(T, D)
    x = (torch.sign(torch.randn(1, 1, T, D, generator=g)) * bound).half().double()  # post-RoPE, all at the bound
    k = apply_rope_at(x, cos.double(), -sin.double(), torch.zeros(1, dtype=torch.long))  # un-rotated, as cached
    kb = [quantize(k.half(), key_spec, **kw)]
    vb = [quantize(torch.randn(1, 1, T, D, generator=g), KIVI4_VALUES)]
    store = pack_store(kb, vb, rope_cos=cos, rope_sin=sin, quant_pos0=[0])
    assert float(f.min()) < 0.6 and rope_pairs_tied(store.key.channel_factor)
    q = torch.randn(1, 2, 1, D, generator=g).half()
    folded = code_basis(q, store, torch.float16)[1]
    assert folded.key.channel_factor is None  # folded into the query
    pre = kb[0].dequantize(torch.float64) / f.double()  # what the float16 keys hold before RoPE
    post = materialize(folded, torch.float64)[0]  # and after it (no saturation at float64)
    assert pre.abs().max() < 65504 and post.abs().max() < 65504, (pre.abs().max(), post.abs().max())


@needs_triton
@pytest.mark.parametrize("vectorized", [None, False], ids=["rows", "gather"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_kernel_saturates_pre_rope_smoothed_keys_like_the_reference(monkeypatch, tied: bool, vectorized: bool | None):
    """The kernel's float32 keys ``code * f + m`` (tied: ``code + m / f``), then RoPE, were cast to float16 for the
    dot: ``-98256`` and the rotated pairs became inf, NaN outputs. With ``K_SAT`` (pre-RoPE centred / smoothed keys,
    float16 queries only) they are clamped to +-65504 before and after RoPE, as the reference: within twice its
    error of the saturated truth; float32 and bfloat16 queries compile without it."""
    q, store, truth = near_limit_pre_rope_case(tied)
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=1, vectorized=vectorized)
    assert out.isfinite().all() and max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    assert spy.seen[-1]["K_SAT"] and spy.seen[-1]["K_FACTOR"] == (not tied)
    for dt in (torch.float32, torch.bfloat16):
        triton_decode.decode_attention_triton(q.to(dt), store, splits=1, vectorized=vectorized)
        assert not spy.seen[-1]["K_SAT"]


@needs_triton
@pytest.mark.parametrize(
    "D,kw,launch,want",
    [
        # (head dim, make_store kwargs, decode kwargs, (BLOCK_T, VEC_K, VEC_V) launched or an error)
        (
            128,
            {
                "key_spec": nuq(4, "channel", 32, outlier_frac=0.01),
                "value_spec": nuq(4, "token", outlier_frac=0.01),
            },
            {},
            (32, True, True),
        ),  # kvquant-4-block at Llama's D: whole rows need 32-token tiles
        (128, {}, {}, (32, True, True)),  # kivi-4: the default tile already holds 32 tokens
        (256, {}, {}, (16, False, False)),  # 32-token rows would pass the tile budget: gather at 16
        (128, {"key_spec": spec(3, "channel", 32)}, {}, (16, False, False)),  # a gather side: gather both
        (
            64,
            {"key_spec": spec(3, "channel", 32)},
            {},
            (32, False, True),
        ),  # 32-token tiles: rows where they can
        (128, {}, {"block_t": 16}, (16, False, False)),  # a 16-token tile asked for: the gather path
        (128, {}, {"block_t": 16, "vectorized": True}, ValueError),
    ],
    ids=["kvquant-d128", "kivi-d128", "kivi-d256", "mixed-3bit-d128", "mixed-3bit-d64", "bt16", "bt16-rows"],
)
def test_whole_row_path_never_runs_16_token_tiles(monkeypatch, D: int, kw: dict, launch: dict, want):
    """The whole-row path at 16-token tiles gave wrong attention on an H200 (max error ~4 against
    float64 on every store at D = 128; the interpreter gets it right, so only the rule is testable here):
    the launch must use 32-token tiles or the gather path instead (``MIN_VEC_BLOCK_T``)."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    seen = spy.seen
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(D)
    store = make_store(g, B=1, H_kv=1, D=D, T_q=64, T_f=8, quant_lens=[64], full_lens=[8], **kw)
    q = torch.randn(1, 2, 1, D, generator=g).to(DEVICE).half()
    if want is ValueError:
        with pytest.raises(ValueError, match="block_t >= 32"):
            triton_decode.decode_attention_triton(q, store, **launch)
        return
    out = triton_decode.decode_attention_triton(q, store, **launch)
    assert [(m["BLOCK_T"], m["VEC_K"], m["VEC_V"]) for m in seen] == [want]
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    assert max_err(out, truth) <= 2 * err_pt + 1e-6


F16_SPECS = [  # (spec, block_t): one scale row per tile, several per tile, per token, static, per block
    (spec(4, "channel", 32), 32),
    (spec(4, "channel", 32), 64),
    (spec(2, "channel", 32), 64),
    (spec(8, "channel", 16), 32),
    (spec(4, "token", 32), 32),
    (spec(2, "token", 16), 64),
    (spec(8, "token"), 32),
    (spec(4, "token", 32, symmetric=True), 32),
    (spec(2, "channel", None, static=True), 32),
    (spec(4, "head"), 32),
    (spec(8, "tensor", symmetric=True), 64),
]


@needs_triton
@pytest.mark.parametrize(
    "s,block_t", F16_SPECS, ids=[f"{s.granularity}{s.group_size or ''}-int{s.bits}-bt{b}" for s, b in F16_SPECS]
)
def test_f16_dequant_rounds_once_to_float16(s: TensorSpec, block_t: int):
    """``_load_rows16`` (``dequant="f16"``): int32 words, magic-number codes, one float16 fused multiply-add:
    every value is the exact ``code * scale + zero`` rounded once to float16, at every slot of a 96-token
    store (a partial last tile at ``block_t = 64``)."""
    g = torch.Generator().manual_seed(7 * s.bits + block_t)
    x = (torch.randn(2, 2, 96, 64, generator=g) * (1 + 4 * (torch.arange(64) < 4))).to(DEVICE)
    n = s.group_size if s.granularity == "channel" and s.group_size else 16  # tokens per quantized block
    blocks = [quantize(x[:, :, a : a + n], s, **extras(s, x)) for a in range(0, 96, n)]
    p = pack_store(blocks, blocks).key
    assert triton_decode.f16_ok(p, block_t, torch.float16)
    got = triton_decode.dequantize_packed_triton(p, block_t=block_t, dequant="f16")
    want = dequantize_packed(p, dtype=torch.float64).half()
    assert torch.equal(got.half(), want), float((got - want.float()).abs().max())


@needs_triton
def test_f16_dequant_declines_float32_scales():
    """``dequant="f16"`` reads float16 metadata (as int32 words, a float16 multiply-add): a side with float32
    scales and zero-points (``scale_dtype="fp32"``) keeps the float32 path, the same layout otherwise."""
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for s, ok in ((spec(4, "token", 32), True), (spec(4, "token", 32, scale_dtype="fp32"), False)):
        p = pack_store([quantize(x, s)], [quantize(x, s)]).key
        assert triton_decode.f16_ok(p, 32, torch.float16) is ok, s


F16_CASES = [  # (name, make_store kwargs, query dtype, (F16_K, F16_V) expected)
    ("int4-kivi", {"key_spec": spec(4, "channel", 32), "value_spec": spec(4, "token", 32)}, torch.float16,
     (True, True)),
    ("int8-kivi", {"key_spec": spec(8, "channel", 32), "value_spec": spec(8, "token", 32)}, torch.float16,
     (True, True)),
    ("int2-kivi-d128", {"key_spec": spec(2, "channel", 32), "value_spec": spec(2, "token", 32), "D": 128},
     torch.float16, (True, True)),
    ("int4-token-keys", {"key_spec": spec(4, "token"), "value_spec": spec(4, "token")}, torch.float16, (True, True)),
    ("pre-rope-keys", {"key_spec": spec(4, "channel", 32), "value_spec": spec(4, "token", 32), "rope": True},
     torch.float16, (False, True)),  # RoPE rotates float32 rows: keys stay on _load_rows
    ("outlier-keys", {"key_spec": spec(4, "channel", 32, outlier_frac=0.03), "value_spec": spec(4, "token", 32)},
     torch.float16, (False, True)),
    ("nuq-values", {"key_spec": spec(4, "channel", 32), "value_spec": nuq(4, "token")}, torch.float16, (True, False)),
    ("bf16-queries", {"key_spec": spec(4, "channel", 32), "value_spec": spec(4, "token", 32)}, torch.bfloat16,
     (False, False)),
]


@needs_triton
@pytest.mark.parametrize("name,kw,dtype,want", F16_CASES, ids=[c[0] for c in F16_CASES])
def test_decode_f16_dequant(monkeypatch, name: str, kw: dict, dtype: torch.dtype, want: tuple[bool, bool]):
    """``dequant="f16"`` takes the sides it can (and only those) and stays within twice torch's error at
    float16; on a ragged, left-padded batch it equals the float32 dequantization up to the dots' rounding."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    store = make_store(g, quant_lens=[160, 96], full_lens=[40, 9], **kw)
    store.quant_mask = torch.ones(2, 160, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :20] = False  # sequence 1 left-padded
    D = store.head_dim
    q = (torch.randn(2, 6, 1, D, generator=g) * 1.5).to(DEVICE).to(dtype)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=dtype), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=2, dequant="f16")
    assert (spy.seen[-1].get("F16_K", False), spy.seen[-1].get("F16_V", False)) == want
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    # the float32 dequantization, keys rounded to float16 for the dots as here (row_keys=False: per-token keys
    # would otherwise enter as exact codes, K_ROWS)
    ref32 = triton_decode.decode_attention_triton(q, store, splits=2, row_keys=False)
    assert max_err(out, ref32) <= err_pt + 1e-6


F16_SHAPES = [  # (D, G, key spec, value spec, block_t, splits): head dims, GQA groups, groups and tiles
    (32, 1, spec(2, "channel", 16), spec(2, "token", 16), 32, 1),
    (32, 7, spec(4, "channel", 64), spec(8, "token"), 64, 3),
    (256, 2, spec(8, "channel", 32), spec(4, "token", 64), 32, 2),
    (128, 16, spec(4, "channel", None, static=True), spec(2, "token", 32, symmetric=True), 64, 4),
    (64, 8, spec(8, "token", symmetric=True), spec(4, "token", 16), 32, 5),
]


@needs_triton
@pytest.mark.parametrize("D,G,ks,vs,block_t,splits", F16_SHAPES, ids=[f"D{c[0]}-G{c[1]}" for c in F16_SHAPES])
def test_decode_f16_dequant_shapes(D: int, G: int, ks: TensorSpec, vs: TensorSpec, block_t: int, splits: int):
    """``dequant="f16"`` across head dims 16-256, GQA groups 1-16 (G_PAD up to 16), scale groups that are
    whole tiles, parts of tiles or static, symmetric codes, several splits, ragged and left-padded rows:
    within twice torch's float16 error, and equal to the float32 path up to the dots' rounding."""
    g = torch.Generator().manual_seed(D * 31 + G)
    block = max(32, ks.group_size or 0) if ks.granularity == "channel" else 32  # whole key scale groups
    store = make_store(g, D=D, key_spec=ks, value_spec=vs, T_q=192, quant_lens=[192, 70], full_lens=[40, 3],
                       block=block)  # fmt: skip
    store.quant_mask = torch.ones(2, 192, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :9] = False
    assert triton_decode.f16_ok(store.key, block_t, torch.float16)
    assert triton_decode.f16_ok(store.value, block_t, torch.float16)
    q = (torch.randn(2, 2 * G, 1, D, generator=g) * 1.5).to(DEVICE).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    out = triton_decode.decode_attention_triton(q, store, splits=splits, block_t=block_t, dequant="f16")
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    ref32 = triton_decode.decode_attention_triton(q, store, splits=splits, block_t=block_t)
    assert max_err(out, ref32) <= err_pt + 1e-6


@needs_triton
def test_f16_dequant_declines_head_dim_16():
    """Head dim 16 keeps the float32 path under ``dequant="f16"`` (the H200 computed a wrong f16 output there,
    session 37): ``f16_ok`` says no and the output is the float32 path's, bit for bit."""
    g = torch.Generator().manual_seed(16 * 31 + 1)
    store = make_store(g, D=16, key_spec=spec(2, "channel", 16), value_spec=spec(2, "token", 16), T_q=192,
                       quant_lens=[192, 70], full_lens=[40, 3])  # fmt: skip
    assert not triton_decode.f16_ok(store.key, 32, torch.float16)
    assert not triton_decode.f16_ok(store.value, 32, torch.float16)
    q = (torch.randn(2, 2, 1, 16, generator=g) * 1.5).to(DEVICE).half()
    out = triton_decode.decode_attention_triton(q, store, splits=1, block_t=32, dequant="f16")
    assert torch.equal(out, triton_decode.decode_attention_triton(q, store, splits=1, block_t=32))
    wider = make_store(g, D=32, key_spec=spec(2, "channel", 16), value_spec=spec(2, "token", 16), T_q=192)
    assert triton_decode.f16_ok(wider.key, 32, torch.float16)


@needs_triton
def test_f16_compile_failure_falls_back_logged(monkeypatch, caplog):
    """Where launches fall back (CUDA), a configuration whose f16 variant does not compile is logged,
    remembered and dequantized in float32 (the same output); elsewhere the error is raised."""
    no_f16 = LaunchSpy(triton_decode._decode_kernel, fail=lambda meta: meta.get("F16_K") or meta.get("F16_V"))
    g = torch.Generator().manual_seed(12)
    store = make_store(g)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    want = triton_decode.decode_attention_triton(q, store)
    monkeypatch.setattr(triton_decode, "_decode_kernel", no_f16)
    monkeypatch.setattr(triton_decode, "_F16_BROKEN", set())
    monkeypatch.setattr(triton_decode, "_compile_fallbacks", lambda q: False)
    with pytest.raises(RuntimeError, match="stand-in"):
        triton_decode.decode_attention_triton(q, store, dequant="f16")
    monkeypatch.setattr(triton_decode, "_compile_fallbacks", lambda q: True)
    no_f16.seen.clear()
    with caplog.at_level("WARNING", logger="kvbits.kernels.triton_decode"):
        out = triton_decode.decode_attention_triton(q, store, dequant="f16")
        again = triton_decode.decode_attention_triton(q, store, dequant="f16")
    tried = [bool(m.get("F16_K") or m.get("F16_V")) for m in no_f16.seen]
    assert tried == [True, False, False]  # the failed configuration is not tried again
    assert torch.equal(out, want) and torch.equal(again, want)
    assert "dequant='f16' failed to compile (RuntimeError); dequantizing in float32" in caplog.text
    assert len(triton_decode._F16_BROKEN) == 1


@needs_triton
def test_dequant_mode_is_checked():
    g = torch.Generator().manual_seed(3)
    store = make_store(g)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    with pytest.raises(ValueError, match="dequant must be one of"):
        triton_decode.decode_attention_triton(q, store, dequant="fp16")
    with pytest.raises(ValueError, match="cannot read this side"):
        triton_decode.dequantize_packed_triton(
            make_store(g, key_spec=spec(3, "channel", 32)).key, dequant="f16"
        )


# --------------------------------------------------------------------------------------------------
# The GPU benchmark script runs (tiny sizes, CPU: reference timings + interpreter checks)
# --------------------------------------------------------------------------------------------------


def _update_gets_position_ids() -> bool:
    """Whether this transformers passes ``position_ids`` to ``Cache.update`` (5.24 does, 5.17 does not)."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from kvbits.cache.layer import find_position_ids

    seen = []

    class Probe(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            seen.append(find_position_ids(args, kwargs))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    config = Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(torch.zeros(1, 3, dtype=torch.long), **{kw: Probe(config=config)})
    return seen[0] is not None


def test_gpu_benchmark_timings_carry_their_spread(monkeypatch):
    """Each timing keeps the 10th and 90th percentiles of its reps beside the median (what tells a real
    difference between two variants from noise). A fake clock: each rep takes 2, 4, ..., 10 ms, twice."""
    import types

    bench = _load_bench()
    from gpu_bench import common

    now = [0.0]
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    cfg = bench.Config(device=torch.device("cpu"), contexts=[], batches=[], reps=10, warmup=0, max_bytes=0.0,
                       smoke=True, kernel="reference")  # fmt: skip
    delays = iter([0.002 * (i % 5 + 1) for i in range(10)])

    def rep() -> None:
        now[0] += next(delays)

    spread: dict = {}
    ms, graph = common.time_ms(rep, cfg, None, spread=spread)
    assert not graph and ms == pytest.approx(6.0)  # the median of 2..10 ms, twice
    # statistics.quantiles (exclusive method) of [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]: 2.0 and 10.0
    assert spread["ms_p10"] == pytest.approx(2.0) and spread["ms_p90"] == pytest.approx(10.0), spread


def test_gpu_benchmark_times_on_its_own_device_not_the_current_one(monkeypatch):
    """``time_ms`` with ``cfg.device`` cuda:1 (cuda:0 current): ``fn`` (whose Triton kernels launch on the current
    device's stream) runs with cuda:1 current, and the side stream, the graph's capture stream, the events' stream
    and the synchronize are cuda:1's. At the base commit they were the current device's (cuda:0), and
    ``torch.cuda.graph`` captured on its class-wide default stream. No GPU: ``torch.cuda``'s pieces are recorders;
    untested on a multi-GPU machine."""
    import contextlib
    import types

    bench = _load_bench()
    from gpu_bench import common

    dev = torch.device("cuda", 1)
    current: list[object] = []
    seen: dict[str, list] = {"fn": [], "stream": [], "current_stream": [], "graph": [], "record": [], "sync": []}

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d).index)
        yield
        current.pop()

    class Stream:
        def __init__(self, device=None):
            seen["stream"].append(device)

        def wait_stream(self, other):
            pass

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            seen["record"].append(stream)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    class Graph:
        def replay(self):
            seen["fn"].append(current[-1] if current else None)

    @contextlib.contextmanager
    def graph(g, stream=None, **_):
        seen["graph"].append(stream)
        yield

    main = types.SimpleNamespace(wait_stream=lambda other: None)  # cuda:1's current stream
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: seen["current_stream"].append(d) or main)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: seen["sync"].append(d))
    cfg = bench.Config(device=dev, contexts=[], batches=[], reps=3, warmup=1, max_bytes=0.0, smoke=True,
                       kernel="triton")  # fmt: skip

    ms, used_graph = common.time_ms(lambda: seen["fn"].append(current[-1] if current else None), cfg, None)
    assert used_graph and ms == 1.0
    assert seen["fn"] and set(seen["fn"]) == {1}, seen["fn"]  # warmup, side-stream run, capture, 3 replays
    assert seen["stream"] == [dev] and seen["sync"] == [dev]
    assert seen["current_stream"] and set(seen["current_stream"]) == {dev}
    assert len(seen["graph"]) == 1 and isinstance(seen["graph"][0], Stream)  # the side stream, on cuda:1
    assert seen["record"] == [main] * 6  # start and end of 3 reps, on cuda:1's current stream
    assert current == []


@needs_triton
def test_uniform_lengths_are_taken_as_integers(monkeypatch):
    """A store whose lengths are the host's integers (``PackedStore.uniform_lens``: the cache's ``packed_store``,
    ``pack_store`` without lengths, the GPU benchmark's stores) launches with ``UNIFORM``: the kernel takes
    ``quant_used`` (else ``T_q``) and ``T_f`` instead of loading ``quant_lens`` / ``full_lens``, with the output of
    loading them bit for bit (3 splits of 64 slots over the 160 used quantized slots, the last cut short by
    ``quant_used``, and 2 over the 40 tail slots; the reserved slots past ``quant_used`` hold NaN scales, never
    read). ``pack_store`` declares uniform lengths only when it makes them."""
    g = torch.Generator().manual_seed(21)
    store = make_store(g, T_q=192, T_f=40, key_spec=spec(4), value_spec=KIVI4_VALUES)
    assert store.uniform_lens and store.quant_slots_used == 192
    store = replace(store, quant_lens=torch.full_like(store.quant_lens, 160), quant_used=160)
    store.key.scale[:, :, 160:] = float("nan")  # the reserved, unwritten slots' per-token scales
    store.value.scale[:, :, 160:] = float("nan")
    q = torch.randn(2, 8, 1, 64, generator=g).to(DEVICE).half()
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    out = triton_decode.decode_attention_triton(q, store, splits=3, block_t=32)
    loaded = triton_decode.decode_attention_triton(q, replace(store, uniform_lens=False), splits=3, block_t=32)
    assert [m["UNIFORM"] for m in spy.seen] == [True, False]
    assert torch.isfinite(out).all() and torch.equal(out, loaded)
    assert max_err(out, decode_attention_reference(q.double(), store, dtype=torch.float64)) < 0.02
    assert not make_store(g, T_q=64, T_f=8, quant_lens=[64, 64]).uniform_lens  # lengths given: loaded


@needs_triton
def test_split_merge_over_many_chunks():
    """``reduce_splits`` (``_reduce_kernel``) merges more splits than one chunk holds (150 = 3 chunks of 64) with a
    running maximum: the largest split last (every earlier sum rescaled), empty splits (``m`` = -1e30, ``l`` = 0,
    as a padded or short split leaves them) and a row whose first two chunks are all empty, all within float32
    rounding of the float64 merge ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. Dropping the rescale fails
    it."""
    g = torch.Generator().manual_seed(3)
    rows, n_split, D = 3, 150, 16
    assert n_split > 2 * triton_decode.REDUCE_BLOCK_S
    m = torch.randn(rows, n_split, generator=g) * 4
    m[:, -1] = 20.0  # the maximum in the last chunk: the first chunks' sums must be scaled down to it
    l_ = torch.rand(rows, n_split, generator=g) * 9 + 1
    acc = torch.randn(rows, n_split, D, generator=g) * l_[..., None]
    empty = torch.rand(rows, n_split, generator=g) < 0.2
    empty[2, :128] = True  # row 2: only its last chunk holds anything
    empty[:, -1] = False
    m[empty], l_[empty], acc[empty] = -1.0e30, 0.0, 0.0
    m, l_, acc = (x.to(DEVICE) for x in (m, l_, acc))
    out = triton_decode.reduce_splits(m, l_, acc, torch.empty(rows, D, device=DEVICE))
    md, ld, ad = m.double(), l_.double(), acc.double()
    w = torch.exp2(md - md.max(1, keepdim=True).values)
    ref = (w[..., None] * ad).sum(1) / (w * ld).sum(1, keepdim=True)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), float((out.double() - ref).abs().max())


def test_split_merge_benchmark_smoke_on_cpu(tmp_path):
    """``benchmarks/reduce_ab.py --smoke --device cpu``: the merge before and after session 45 on the same partials,
    both within float16 rounding of the float64 merge, at the default launch's split counts (Qwen2.5's 32K at batch
    1: more than two chunks)."""
    import json
    from pathlib import Path

    if triton_decode is None:
        pytest.skip(TRITON_SKIP)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import reduce_ab

    out = tmp_path / "reduce_ab.json"
    result = reduce_ab.main(["--smoke", "--device", DEVICE, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and result["complete"]
    (qwen, llama) = result["rows"]
    assert qwen["n_split"] > 2 * triton_decode.REDUCE_BLOCK_S and llama["n_split"] < 16
    for row in result["rows"]:
        assert row["max_err_two_pass"] < 4e-3 and row["max_err_one_pass"] < 4e-3, row
        assert row["ms_two_pass"] > 0 and row["ms_one_pass"] > 0


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    import json

    bench = _load_bench()
    out = tmp_path / "gpu_decode.json"
    bench.main(["--smoke", "--device", "cpu", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["smoke"] and data["copy_gbps"] > 0
    assert bool(data["checks"]) == (triton_decode is not None) and all(c["ok"] for c in data["checks"])
    if triton_decode is not None:  # the quantize kernel, bit for bit on this device (interpreter here)
        assert len(data["quantize"]) == 10 and all(r["bit_exact"] for r in data["quantize"])
        # step 2c: a growing and a reserved cache decode alike, every step of both layers fused
        grow = data["growing_vs_reserved"]
        assert grow["fused_steps"] == [4, 4] and grow["logits_bit_identical"] and grow["greedy_tokens_equal"], grow
    need = {"kernel", "scheme", "shape", "context", "batch", "ms", "gbps", "frac_of_copy", "speedup_vs_fp16"}
    assert data["records"] and all(need <= set(r) for r in data["records"])
    assert all(r["ms_p10"] <= r["ms"] <= r["ms_p90"] for r in data["records"])
    schemes = {(r["kernel"], r["scheme"]) for r in data["records"]}
    assert {
        ("sdpa-gqa", "fp16"),
        ("sdpa-gqa-no-cudnn", "fp16"),  # SDPA kept off cuDNN's backend: a second fp16 baseline
        ("reference", "int8"),
        ("reference", "int4"),
        ("reference", "int2"),
    } <= schemes
    # bytes read shrink with the bits (metadata included)
    by = {
        r["scheme"]: r["bytes_read"]
        for r in data["records"]
        if r["kernel"] == "reference" and r["context"] == 512 and r["shape"] == "llama-3-8b"
    }
    assert by["fp16"] > by["int8"] > by["int4"] > by["int2"]
    # the same store, plus the rows of the float32 RoPE tables the kernel reads for pre-RoPE keys: cos and sin,
    # (T_q, D / 2) each (the 128-token fp16 tail is post-RoPE)
    assert all(by[f"int{b}-prerope"] == by[f"int{b}"] + (512 - 128) * 128 * 4 for b in (8, 4, 2))
    ms = {r["scheme"]: r["ms"] for r in data["records"] if r["kernel"] == "reference" and r["context"] == 512}
    assert all(ms[f"int{b}-prerope"] > 0 for b in (8, 4, 2))
    assert by["int4"] < by["nuq4-outl"] < by["int8"]  # a codebook and 1 % outliers cost less than 4 more bits
    # per-token int4, plain and Hadamard-rotated, at the smoke's one batch: the rotation stores no byte
    # (one scale and zero per token and head: less metadata than KIVI's groups of 32)
    assert by["int4-token-hadamard"] == by["int4-token"] < by["int4"]
    rotated = [c for c in data["checks"] if c["variant"] == "int4-token-hadamard"]
    assert (triton_decode is None) or (len(rotated) == 1 and rotated[0]["ok"])
    assert {b["scheme"] for b in data["break_even"]} == {
        "fp16",
        "int8",
        "int4",
        "int2",
        "nuq4-outl",
        "fp8-e4m3",
        "int8-prerope",
        "int4-prerope",
        "int2-prerope",
        "int4-token",
        "int4-token-hadamard",
        "int4-token-smooth",
        "int4-token-smooth-prerope",
        "int4-token-smooth-prerope-tied",
    }
    # the centred / smoothed keys read the bytes of int4-token (the layer's channel vectors are not per token), before
    # RoPE plus its tables
    assert by["int4-token-smooth"] == by["int4-token"]
    assert by["int4-token-smooth-prerope"] == by["int4-token-smooth-prerope-tied"] == by["int4-token"] + (512 - 128) * 128 * 4
    # end to end (step 6): a whole model decoding through each cache; the fused rows really were fused
    e2e = {(r["cache"], r["scheme"]): r for r in data["e2e"]}
    fp16 = e2e[("dynamic-fp16", "fp16")]
    assert fp16["tokens_per_s"] > 0 and fp16["context"] == 256
    # DynamicCache again, SDPA kept off cuDNN's backend (a graph per sequence length): the same bytes; each row's
    # speed-up against the faster of the two as well
    no_cudnn = e2e[("dynamic-fp16-no-cudnn", "fp16")]
    assert no_cudnn["tokens_per_s"] > 0 and no_cudnn["cache_bytes"] == fp16["cache_bytes"]
    assert no_cudnn["note"].startswith("SDPA without its cuDNN backend")
    best = min(fp16["ms_per_step"], no_cudnn["ms_per_step"])  # the speed-ups: ratios of the times (one batch)
    kivi4 = e2e[("kvbits-fused", "kivi-4")]
    assert kivi4["speedup_vs_best_fp16"] == round(best / kivi4["ms_per_step"], 3)
    assert kivi4["speedup_vs_fp16"] == round(fp16["ms_per_step"] / kivi4["ms_per_step"], 3)
    table = bench.markdown(data["records"], data["break_even"], data["copy_gbps"], data["e2e"])
    row = next(line for line in table.splitlines() if line.startswith("| kvbits-fused | kivi-4 |"))
    assert f"| {kivi4['speedup_vs_fp16']:.2f}x | {kivi4['speedup_vs_best_fp16']:.2f}x |" in row, row
    for scheme in ("int8-token", "kivi-4", "kivi-2", "kvquant-4-block", "fp8-e4m3-token"):
        row = e2e[("kvbits-fused", scheme)]
        # (1 warm-up + 4 timed + 1 profiled) x 2 layers
        assert row["tokens_per_s"] > 0 and row["note"] == "12 fused steps"
        assert 0 <= row["final_sync_ms"] < row["ms_per_step"] * 4  # a CPU has nothing queued to wait for
        assert row["cache_bytes"] < fp16["cache_bytes"]
        # the profiled step says where its time went (CPU operators here; kernels on CUDA)
        prof = row["profile"]
        assert prof["wall_ms"] > 0 and prof["device_ms"] is None and len(prof["top"]) == 10
        # and what the host spent (on a CPU the same operators: all of it is host time)
        assert 0 < prof["host_ms"] and prof["top_host"] == prof["top"]
        assert all(t["calls"] >= 1 and t["self_ms"] >= 0 for t in prof["top"])
        assert [t["self_ms"] for t in prof["top"]] == sorted(
            (t["self_ms"] for t in prof["top"]), reverse=True
        )
    assert e2e[("kvbits-dequant-sdpa", "kivi-4")]["note"].startswith("0 fused steps")
    # int8-token also runs growing: the same bytes at the end (the fused rows reserve exactly the run's tokens)
    growing = e2e[("kvbits-fused-growing", "int8-token")]
    assert growing["note"] == "12 fused steps; no reservation (max_cache_len=None); greedy tokens equal to fused: True"
    assert growing["cache_bytes"] == e2e[("kvbits-fused", "int8-token")]["cache_bytes"]
    # the planner agrees with what each cache stores (GPU-held bytes are measured on CUDA only)
    # (fused pre-RoPE keys: their float32 RoPE tables too, which memory_report() leaves out)
    # and nothing else is held but, for pre-RoPE keys, one 8-byte position offset per sequence and layer,
    # kept where position ids reach the cache (transformers 5.24 passes them to Cache.update; on 5.17 the
    # benchmark's calls bring none, so keys are un-rotated at cache indices, the same for unpadded rows)
    offsets = 16 if _update_gets_position_ids() else 0
    for (cache, scheme), row in e2e.items():
        if cache.startswith("kvbits"):
            assert row["planned_bytes"] == row["cache_bytes"] + row["rope_table_bytes"]
            assert row["resident_bytes"] is None and row["extra_bytes"] == (offsets if scheme == "kvquant-4-block" else 0)
    assert e2e[("kvbits-fused", "kvquant-4-block")]["rope_table_bytes"] > 0  # pre-RoPE keys
    assert e2e[("kvbits-fused", "int8-token")]["rope_table_bytes"] == 0
    assert fp16["planned_bytes"] * 2 == fp16["cache_bytes"]  # plan's fp16 is 2 bytes; the CPU model is float32
    assert data["complete"] and data["skipped"] == [] and data["budget_s"] == 290


def test_gpu_benchmark_e2e_runs_only_what_is_named(tmp_path):
    """``--e2e-runs`` keeps step 6 to the named runs (a second device call for transformers' QuantizedCache peers,
    which a whole step 6 never reached); a misspelt one stops the script before any step."""
    import json

    bench = _load_bench()
    from gpu_bench.e2e import wanted_runs

    out = tmp_path / "e2e.json"
    bench.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs",
                "dynamic-fp16,kvbits-fused:kivi-4,kvbits-fused-growing", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["e2e"]
    assert [(r["cache"], r["scheme"]) for r in rows] == [
        ("dynamic-fp16", "fp16"), ("kvbits-fused", "kivi-4"), ("kvbits-fused-growing", "int8-token")
    ]
    assert rows[1]["speedup_vs_fp16"] > 0 and rows[2]["note"].startswith("12 fused steps")
    wanted = wanted_runs(["hf-quantized-quanto:2", "kvbits-fused"])
    assert wanted("hf-quantized-quanto", 2) and not wanted("hf-quantized-quanto", 4)
    assert wanted("kvbits-fused", "kivi-2") and not wanted("dynamic-fp16", "fp16") and wanted_runs(None)("x", 1)
    with pytest.raises(SystemExit, match="unknown step-6 caches"):
        bench.main(["--smoke", "--device", "cpu", "--e2e-runs", "kvbits-fussed", "--out", str(out)])



def test_gpu_benchmark_static_graphs_baseline_runs_when_named(tmp_path):
    """``static-fp16-graphs`` (transformers' StaticCache, decode steps through ``torch.compile(mode="reduce-overhead")``)
    runs only when ``--e2e-runs`` names it. It holds the same fp16 bytes as ``DynamicCache`` after the same steps, does
    not become the eager loop's fp16 baseline, and every timed row gets its speed-up against it. On the CPU the
    compile runs without CUDA graphs."""
    import json

    bench = _load_bench()
    from gpu_bench.e2e import STATIC_GRAPHS, wanted_runs

    assert not wanted_runs(None)(STATIC_GRAPHS, "fp16") and wanted_runs([STATIC_GRAPHS])(STATIC_GRAPHS, "fp16")
    out = tmp_path / "e2e.json"
    bench.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs",
                f"dynamic-fp16,kvbits-fused:kivi-4,{STATIC_GRAPHS}", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["e2e"]
    assert [r["cache"] for r in rows] == ["dynamic-fp16", "kvbits-fused", STATIC_GRAPHS]
    dynamic, fused, static = rows
    assert static["tokens_per_s"] > 0 and static["cache_bytes"] == dynamic["cache_bytes"]
    assert static["planned_bytes"] == dynamic["planned_bytes"]
    assert static["speedup_vs_best_fp16"] == static["speedup_vs_fp16"]  # against DynamicCache, not itself
    assert static["speedup_vs_static_graphs"] == 1.0
    assert fused["speedup_vs_static_graphs"] == round(static["ms_per_step"] / fused["ms_per_step"], 3)
    assert fused["speedup_vs_best_fp16"] == round(dynamic["ms_per_step"] / fused["ms_per_step"], 3)

def test_gpu_benchmark_times_the_static_kvbits_cache_eager_and_from_one_captured_step(tmp_path):
    """Step 6's ``kvbits-static-fused`` and ``kvbits-static-graphs`` (``StaticQuantizedKVCache``, opt-in): fused steps
    run eagerly, and the same steps replayed from one captured step (``GraphedDecode``; on the CPU the replay is
    ``graph_replay.py``'s emulation). Both decode the greedy tokens of ``QuantizedKVCache``'s fused int8-token run,
    hold what ``kvbits.plan`` says of their ``max_cache_len`` (KIVI-4: one block and a whole window more), and every
    layer went through the fused path. A scheme outside ``E2E_STATIC`` runs when named with it: KVQuant's block
    recipe (a sink beside the flush window, stand-in codebooks) replays ``QuantizedKVCache``'s greedy tokens."""
    import json

    bench = _load_bench()
    from gpu_bench.e2e import STATIC_KVBITS, wanted_runs

    assert not any(wanted_runs(None)(name, "int8-token") for name in STATIC_KVBITS)
    out = tmp_path / "e2e.json"
    runs = ("kvbits-fused:int8-token,kvbits-static-fused:int8-token,kvbits-static-graphs,kvbits-fused:kvquant-4-block,"
            "kvbits-static-graphs:kvquant-4-block")
    bench.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs", runs, "--out", str(out)])
    rows = json.loads(out.read_text())["e2e"]
    assert [(r["cache"], r["scheme"]) for r in rows] == [
        ("kvbits-fused", "int8-token"), ("kvbits-fused", "kvquant-4-block"), ("kvbits-static-fused", "int8-token"),
        ("kvbits-static-graphs", "int8-token"), ("kvbits-static-graphs", "kivi-4"),
        ("kvbits-static-graphs", "kvquant-4-block"),
    ]  # fmt: skip
    eager, graphed, kivi, kvquant = rows[2:]
    assert "greedy tokens equal to kvbits-fused: True" in kvquant["note"], kvquant["note"]
    for r in (eager, graphed):
        assert r["tokens_per_s"] > 0 and r["cache_bytes"] == r["planned_bytes"], r
        assert "greedy tokens equal to kvbits-fused: True" in r["note"], r["note"]
    assert "then 3 of 4 replayed from 1 captured step(s)" in graphed["note"] and kivi["tokens_per_s"] > 0
    # KIVI's window: one block ahead of the planned quantized slots, and a whole window of full-precision tokens
    assert kivi["planned_bytes"] < kivi["cache_bytes"], kivi


def _load_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
    mod_spec = importlib.util.spec_from_file_location("gpu_decode_bench", path)
    bench = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = bench  # dataclasses look their module up there
    try:
        mod_spec.loader.exec_module(bench)
    finally:
        del sys.modules[mod_spec.name]
    return bench


@pytest.mark.parametrize("scheme", ["kvquant-4-block", "int4-token-smooth", "int4-token-smooth-prerope"])
def test_gpu_benchmark_e2e_cache_installs_what_an_artifact_would(scheme):
    """Step 6's ``kvbits_cache`` serves calibrated presets without an artifact: stand-in codebooks and channel
    vectors (untied over RoPE pairs) are installed, and a model decodes through the fused path at every step."""
    _load_bench()  # puts benchmarks/ on the path
    from gpu_bench import e2e
    from gpu_bench.common import Config

    from kvbits.cache import use_fused_decode
    from kvbits.kernels.reference import rope_pairs_tied

    cfg = Config(device=torch.device("cpu"), contexts=[64], batches=[1], reps=1, warmup=0, max_bytes=1e9,
                 smoke=True, kernel="reference")  # fmt: skip
    model = e2e.e2e_model(cfg, 64, 3)
    use_fused_decode(model)
    cache = e2e.kvbits_cache(model, scheme, fused=True)
    key = cache.layers[0]._k
    if cache.scheme.key.has_channel_transform:
        assert key.channel_factor is not None and not rope_pairs_tied(key.channel_factor)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    r = e2e.decode_run(cfg, model, cache, ids, tokens=2, warmup=1, profile=False)
    fr = cache.fused_report()
    assert fr["fused_steps"] == r["steps"] * model.config.num_hidden_layers and fr["fallback_steps"] == 0


def test_gpu_benchmark_budget_skips_and_still_writes(tmp_path):
    """Past ``--budget-s`` no sweep combo or e2e run starts: each is listed as skipped and the file is
    complete; a run killed midway leaves ``complete: false`` with what it had (written after each step)."""
    import json

    bench = _load_bench()
    out = tmp_path / "gpu_decode.json"
    bench.main(["--smoke", "--device", "cpu", "--check", "no", "--budget-s", "0", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] and data["records"] == [] and data["copy_gbps"] > 0
    assert len(data["skipped"]) == 2 * 2 and {s["reason"] for s in data["skipped"]} == {"time budget (--budget-s)"}
    assert data["e2e"] and all(r["skipped"] == "time budget (--budget-s)" for r in data["e2e"])

    calls = []
    real_sweep = bench.sweep

    class Killed(BaseException):  # a kill, not an error: `guarded` records an Exception and the run goes on
        pass

    def die() -> None:
        raise Killed

    def killed(cfg, decode, copy_gbps, progress, skipped):  # dies in the sweep after its first combo was saved
        real_sweep(cfg, decode, copy_gbps, lambda rows: (progress(rows), calls.append(1), die()), skipped)

    bench.sweep = killed
    with pytest.raises(Killed):
        bench.main(["--smoke", "--device", "cpu", "--check", "no", "--e2e", "no", "--out", str(out)])
    data = json.loads(out.read_text())
    assert calls == [1] and not data["complete"] and data["records"] and data["copy_gbps"] > 0
    assert {r["context"] for r in data["records"]} == {256}  # the first combo only


def test_gpu_benchmark_json_survives_a_kill_during_a_save_and_a_failure_before_the_first_step(tmp_path, monkeypatch):
    """device_run.sh kills gpu_decode.py with ``timeout`` when it overruns, and the JSON is rewritten after every
    step: a kill during a write left the file truncated (every figure lost; 5123 bytes of invalid JSON here). The
    write is atomic now. And the file holds the run's environment before its first step (prewarm, copy
    bandwidth): a failure there left no file at all."""
    import json
    from pathlib import Path

    bench = _load_bench()
    out = tmp_path / "gpu_decode.json"
    args = ["--smoke", "--device", "cpu", "--kernel", "reference", "--check", "no", "--e2e", "no", "--out", str(out)]
    with monkeypatch.context() as m:  # killed in step 1 (an error there is guarded: the next test)
        m.setattr(bench, "copy_bandwidth", lambda cfg: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
        with pytest.raises(KeyboardInterrupt, match="killed"):
            bench.main(args)
    data = json.loads(out.read_text())
    assert not data["complete"] and data["env"]["device"] and data["records"] == []

    real, writes = Path.write_text, []

    def killed_on_the_third(self, text, *a, **k):  # half the text written, then the process "dies"
        writes.append(self.name)
        if len(writes) == 3:
            real(self, text[: len(text) // 2], *a, **k)
            raise KeyboardInterrupt("killed during a save")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", killed_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    monkeypatch.undo()
    data = json.loads(out.read_text())  # the last complete save: the copy bandwidth measured, no record yet
    assert not data["complete"] and data["copy_gbps"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_decode.json"]  # no temporary file left beside it


def test_gpu_benchmark_json_is_strict_with_non_finite_figures(tmp_path):
    """The device run's JSON (``_provenance.write_json``: gpu_decode, the failure map, reduce_ab, autotune_decode) is
    strict JSON, as kvbits writes its own: a check's ``inf`` gap (``nan_to_num(inf)`` of a NaN output) and a NaN
    ``max_diff_vs_default`` were written as the bare tokens ``Infinity`` / ``NaN``, which jq rejects."""
    import json

    _load_bench()  # puts benchmarks/ on sys.path
    import _provenance

    from kvbits._json import loads

    out = tmp_path / "r.json"
    _provenance.write_json(out, {"max": float("inf"), "rows": [{"max_diff_vs_default": float("nan")}], "ms": 1.5})

    def bare(token: str):
        raise AssertionError(f"bare {token} in the JSON")

    data = json.loads(out.read_text(), parse_constant=bare)
    assert data == {"max": "+Inf", "rows": [{"max_diff_vs_default": "NaN"}], "ms": 1.5}
    back = loads(out.read_text())
    assert back["max"] == float("inf") and back["rows"][0]["max_diff_vs_default"] != back["rows"][0]["max_diff_vs_default"]


def test_gpu_benchmark_copy_bandwidth_failure_is_recorded_and_the_steps_after_it_run(tmp_path, monkeypatch):
    """Step 1 (the copy bandwidth: one 2 GiB copy_ into a second 2 GiB buffer) is guarded like the steps after it:
    an error there (out of memory) is recorded under ``failures``, the sweep still runs with ``frac_of_copy`` None,
    and the script exits non-zero at the end. Before, its raise ended the run with no record at all (0 rows)."""
    import json

    bench = _load_bench()
    out = tmp_path / "gpu_decode.json"
    monkeypatch.setattr(bench, "copy_bandwidth", lambda cfg: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: \(1\) copy bandwidth: RuntimeError: out of memory"):
        bench.main(["--smoke", "--device", "cpu", "--kernel", "reference", "--check", "no", "--e2e", "no",
                    "--out", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["complete"] and data["copy_gbps"] is None
    assert [f["step"] for f in data["failures"]] == ["(1) copy bandwidth"]
    assert data["records"] and all(r["frac_of_copy"] is None and r["gbps"] >= 0 for r in data["records"] if "ms" in r)
    assert data["break_even"]
    assert "not measured" in bench.markdown(data["records"], data["break_even"], None)


def test_gpu_benchmark_times_the_issues_cells_before_the_other_kernel_paths(monkeypatch):
    """The sweep times, per cell, fp16 SDPA and the fused kernel's default launch at every scheme (issue 5's table)
    before any other kernel path: a time budget that runs out cuts the extra paths (gathered unpacking, float16
    dequantization, the folded kernel, the per-token layouts), never a batch-32 cell of the issue's. Before, each
    cell ran every variant and the cells went batch by batch, so a budget the sweep's ~1,040 cells outgrew cut the
    largest batch's cells whole. Here the budget ends right after the first pass."""
    import itertools

    bench = _load_bench()  # puts benchmarks/ on sys.path
    from gpu_bench import common, sweep

    reference = bench._decoder(bench.Config(device=torch.device("cpu"), contexts=[256], batches=[1], reps=1,
                                            warmup=0, max_bytes=1e9, smoke=True, kernel="reference"))  # fmt: skip
    cfg = bench.Config(device=torch.device("cpu"), contexts=[256, 512], batches=[1, 2], reps=1, warmup=0,
                       max_bytes=1e9, smoke=True, kernel="triton")  # fmt: skip
    first_pass = len(cfg.contexts) * len(cfg.batches) * len(common.SHAPES)
    calls = itertools.count()
    monkeypatch.setattr(sweep, "out_of_time", lambda cfg: next(calls) >= first_pass)
    skipped: list[dict] = []
    records = sweep.sweep(cfg, lambda q, store, **kw: reference(q, store), 10.0, skipped=skipped)
    cells = {(shape, b, c) for shape in common.SHAPES for b in cfg.batches for c in cfg.contexts}
    want = {"fp16", *common.SCHEMES, *(name + common.ROPE_SUFFIX for name in common.PRE_ROPE)}
    for cell in cells:
        got = {r["scheme"] for r in records if (r["shape"], r["batch"], r["context"]) == cell and r["kernel"] == "triton"}
        assert got == want, (cell, want ^ got)  # the fused kernel over an fp16 store too
    assert {r["kernel"] for r in records} == {"sdpa-gqa", "sdpa-gqa-no-cudnn", "sdpa-expand", "triton"}
    assert {(s["shape"], s["batch"], s["context"]) for s in skipped} == cells
    assert {s.get("pass") for s in skipped} == {"other kernel paths"}


def test_gpu_benchmark_records_launches_that_do_not_start():
    """A kernel variant the GPU refuses (Triton's ``OutOfResources``: more shared memory than a block gets)
    is a result of that variant, not the end of a one-shot run: the correctness step and the sweep record
    the error and go on; break-even ignores it; the table shows it."""
    bench = _load_bench()
    reference = bench._decoder(bench.Config(device=torch.device("cpu"), contexts=[256], batches=[1], reps=1,
                                            warmup=0, max_bytes=1e9, smoke=True, kernel="reference"))  # fmt: skip

    def refuse(q, store, **kw):
        if store.pre_rope:
            raise RuntimeError("out of resource: shared memory, Required: 288768, Hardware limit: 232448")
        return reference(q, store, **kw)

    cfg = bench.Config(device=torch.device("cpu"), contexts=[256], batches=[1], reps=1, warmup=0, max_bytes=1e9,
                       smoke=True, kernel="reference")  # fmt: skip
    checks = bench.check_variants(cfg, refuse)
    assert [c["variant"] for c in checks if "error" in c] == ["int4-pre-rope"]  # smoke: 3 variants
    assert all(c["ok"] for c in checks if "error" not in c) and len(checks) == 4
    records = bench.sweep(cfg, refuse, copy_gbps=10.0)
    failed = {r["scheme"] for r in records if "error" in r}
    assert failed == {"int8-prerope", "int4-prerope", "int2-prerope", "int4-token-smooth-prerope",
                      "int4-token-smooth-prerope-tied"}  # fmt: skip
    assert all(r["error"].startswith("RuntimeError: out of resource") for r in records if "error" in r)
    assert {b["scheme"] for b in bench.break_even(records)} & failed == set()
    assert {"int4", "int8", "fp16"} <= {r["scheme"] for r in records if "ms" in r}
    assert "did not launch: RuntimeError: out of resource" in bench.markdown(records, bench.break_even(records), 10.0)


def test_gpu_benchmark_break_even_from_times_not_rounded_speedups():
    """Break-even compares each row's ms with its cell's fp16 ms: a kernel 0.03 % slower than fp16 SDPA has a
    3-decimal speed-up of 1.0 and does not break even (before: it did, at the first such context)."""
    _load_bench()
    from gpu_bench import sweep

    def row(context: int, ms: float, fp16_ms: float) -> dict:
        return sweep._record("triton", "int4", "qwen", context, 1, ms, False, 1000, {}, fp16_ms, 10.0)

    slower = row(4096, 1.0003, 1.0)
    assert slower["speedup_vs_fp16"] == 1.0 and slower["fp16_ms"] == 1.0
    rows = [slower, row(8192, 1.5, 2.0), row(16384, 2.0, 4.0)]
    assert [b["break_even_context"] for b in sweep.break_even(rows)] == [8192]
    rows[0] = row(4096, 1.0, 1.0)  # a tie breaks even
    assert [b["break_even_context"] for b in sweep.break_even(rows)] == [4096]
    # records written before ``fp16_ms`` keep the rounded ratio
    old = [{k: v for k, v in r.items() if k != "fp16_ms"} for r in rows]
    old[0]["speedup_vs_fp16"] = 0.999
    assert [b["break_even_context"] for b in sweep.break_even(old)] == [8192]


def _int4_row(context: int, fp16_over_ms: float | None) -> dict:
    """A sweep record of int4 at Qwen2.5's shape, batch 1: ``fp16_over_ms`` its speed-up over fp16, ``None`` a
    launch that did not start (an error row). After ``_load_bench()`` (``gpu_bench`` on the path)."""
    from gpu_bench import sweep

    if fp16_over_ms is None:
        return {"kernel": "triton", "scheme": "int4", "shape": "qwen", "context": context, "batch": 1,
                "error": "RuntimeError: out of resource"}  # fmt: skip
    return sweep._record("triton", "int4", "qwen", context, 1, 1.0, False, 1000, {}, fp16_over_ms, 10.0)


def test_gpu_benchmark_break_even_is_not_read_across_a_launch_that_did_not_start():
    """``break_even`` dropped the rows that did not launch, then read the break-even across them: int4 faster than
    fp16 at 4096 and 16384 and not launched at 8192 reported 4096 (8192 unmeasured); slower at 4096, not launched at
    8192, faster at 16384 reported 16384 (the break-even may be 8192). Now it is ``None`` with
    ``break_even_measured`` ``False`` and the table says "not measured"; a failure below the last losing context,
    or above the longest measured one when none breaks even ("> max measured"), changes nothing."""
    bench = _load_bench()
    from gpu_bench import sweep


    def be(*speedups: float | None) -> dict:
        (b,) = sweep.break_even([_int4_row(4096 << i, s) for i, s in enumerate(speedups)])
        return b

    for speedups in ((2.0, None, 2.0), (0.5, None, 2.0), (2.0, None), (0.5, 2.0, None)):
        b = be(*speedups)
        assert b["break_even_context"] is None and not b["break_even_measured"], speedups
        assert b["not_launched"] == [4096 << speedups.index(None)]
        table = bench.markdown([], [b], 10.0)
        assert f"| not measured (did not launch at {4096 << speedups.index(None)}) |" in table
    b = be(None, 0.5, 2.0)  # below the last context that loses: the break-even is 16384 all the same
    assert (b["break_even_context"], b["break_even_measured"], b["not_launched"]) == (16384, True, [4096])
    b = be(0.5, None)  # no break-even up to 4096, and 8192 unknown: "> 4096" holds
    assert (b["break_even_context"], b["break_even_measured"]) == (None, True)
    assert "| > 4096 |" in bench.markdown([], [b], 10.0)
    b = be(2.0, 2.0)
    assert (b["break_even_context"], b["break_even_measured"], b["not_launched"]) == (4096, True, [])


def test_gpu_benchmark_break_even_is_not_read_across_a_context_the_sweep_skipped_whole():
    """A context the sweep skipped whole (its fp16 baseline failed, or the time budget cut it) leaves no row, so
    ``break_even`` saw nothing there: int4 faster than fp16 at 4096 and 16384 with 8192 skipped reported 4096, and
    faster at 4096 with 8192 cut by the time budget reported 4096 too. Given the sweep's intended contexts per
    (shape, batch) (``sweep_contexts``, as gpu_decode.py passes them) a context with no row for a key is treated
    like a launch that did not start: ``not_run``, ``break_even_measured`` ``False``, the table says "not run at".
    Contexts above the memory budget are outside the sweep, not gaps; without the contexts (older results) the
    records alone decide, as before."""
    bench = _load_bench()
    from gpu_bench import sweep
    from gpu_bench.common import SHAPES, Config


    intended = {("qwen", 1): [4096, 8192, 16384]}
    rows = [_int4_row(4096, 2.0), _int4_row(16384, 2.0)]  # 8192: no row at all
    (old,) = sweep.break_even(rows)  # the records alone: read across the gap, as before
    assert (old["break_even_context"], old["break_even_measured"], old["not_run"]) == (4096, True, [])
    (b,) = sweep.break_even(rows, intended)
    assert (b["break_even_context"], b["break_even_measured"], b["not_run"]) == (None, False, [8192])
    assert "| not measured (not run at 8192) |" in bench.markdown([], [b], 10.0)
    (b,) = sweep.break_even([_int4_row(4096, 2.0)], intended)  # cut by the time budget after 4096
    assert (b["break_even_context"], b["break_even_measured"], b["not_run"]) == (None, False, [8192, 16384])
    (b,) = sweep.break_even([_int4_row(4096, 2.0), _int4_row(8192, None)], intended)  # both kinds of gap, both listed
    assert "| not measured (did not launch at 8192; not run at 16384) |" in bench.markdown([], [b], 10.0)
    (b,) = sweep.break_even([_int4_row(4096, 0.5), _int4_row(16384, 2.0)], intended)  # the break-even may be 8192
    assert (b["break_even_context"], b["break_even_measured"]) == (None, False)
    (b,) = sweep.break_even([_int4_row(8192, 0.5), _int4_row(16384, 2.0)], intended)  # a gap below the last loser: 16384 holds
    assert (b["break_even_context"], b["break_even_measured"], b["not_run"]) == (16384, True, [4096])
    (b,) = sweep.break_even([_int4_row(4096, 0.5)], intended)  # no break-even up to 4096: "> 4096" holds
    assert (b["break_even_context"], b["break_even_measured"]) == (None, True)
    (b,) = sweep.break_even([_int4_row(c, 2.0) for c in (4096, 8192, 16384)], intended)
    assert (b["break_even_context"], b["break_even_measured"], b["not_run"]) == (4096, True, [])
    # a result written before ``not_run`` renders as before
    (legacy,) = sweep.break_even([_int4_row(4096, 2.0), _int4_row(8192, None)])
    legacy = {k: v for k, v in legacy.items() if k != "not_run"}
    assert "| not measured (did not launch at 8192) |" in bench.markdown([], [legacy], 10.0)
    # the memory budget bounds the intended contexts (a cell over --max-gb is outside the sweep)
    shp = SHAPES["llama-3-8b"]
    cap = 2 * 8 * shp["H_kv"] * 4096 * shp["D"] * 2  # batch 8's fp16 K/V at 4096
    got = sweep.sweep_contexts(Config(torch.device("cpu"), [4096, 8192], [1, 8], 1, 1, cap, True, "reference"))
    assert got[("llama-3-8b", 1)] == [4096, 8192] and got[("llama-3-8b", 8)] == [4096]
    assert got[("qwen2.5-0.5b", 8)] == [4096, 8192]


def test_gpu_benchmark_run_passes_the_sweeps_contexts_to_break_even(tmp_path, monkeypatch):
    """gpu_decode.py hands ``break_even`` the sweep's intended contexts: a smoke run whose fp16 baseline fails at
    512 (the cell skipped whole, no row) saves every key's break-even with ``not_run`` [512] (before: no such
    field, the gap unseen)."""
    import json

    bench = _load_bench()
    from gpu_bench import sweep

    real = sweep.fp16_baselines

    def failing(cfg, q, h_kv, context, *args, **kwargs):
        if context == 512:
            raise RuntimeError("out of memory")
        return real(cfg, q, h_kv, context, *args, **kwargs)

    monkeypatch.setattr(sweep, "fp16_baselines", failing)
    out = tmp_path / "gpu_decode.json"
    bench.main(["--smoke", "--device", "cpu", "--kernel", "reference", "--check", "no", "--e2e", "no",
                "--out", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["break_even"] and all(b["not_run"] == [512] for b in data["break_even"]), data["break_even"]
    assert {s["context"] for s in data["skipped"]} == {512}


def test_gpu_benchmark_tune_grid_starts_at_the_defaults():
    """The tuning grid times the default launch first, then its nearest neighbours: a run cut short by the
    time budget still compares the default with single changes of it."""
    pytest.importorskip("triton")
    from kvbits.kernels import triton_decode as td

    _load_bench()  # puts benchmarks/ on the path
    from gpu_bench.sweep import (
        TUNE_F16_STAGES,
        TUNE_F16_WARPS,
        TUNE_PROGRAMS_PER_SM,
        TUNE_R128_LAUNCHES,
        tune_grid,
        tune_grid_f16,
        tune_grid_for,
        tune_launches,
    )

    for D in (64, 128):
        grid = tune_grid(D)
        d = td.launch_defaults(D)
        default = (d["block_t"], d["num_warps"], d["num_stages"])
        n_splits = len(TUNE_PROGRAMS_PER_SM)
        # the default, then the default at other split counts, then the rest nearest first
        assert grid[: 1 + n_splits] == [(*default, None)] + [(*default, p) for p in TUNE_PROGRAMS_PER_SM]
        rest = [c[:3] for c in grid[1 + n_splits :]]
        assert all(c[3] is None for c in grid[1 + n_splits :])
        dist = [sum(x != y for x, y in zip(c, default, strict=True)) for c in rest]
        assert dist == sorted(dist) and 0 not in dist and len(set(rest)) == len(rest) == 3 * 2 * 3 - 1
        assert tune_launches(D) == [default] + rest
        # dequant="f16": the same default first, then block_t x num_warps x num_stages, nearest first
        f16 = tune_grid_f16(D)
        assert f16[0] == (*default, None) and all(c[3] is None for c in f16)
        dist = [sum(x != y for x, y in zip(c[:3], default, strict=True)) for c in f16]
        n = 3 * len(TUNE_F16_WARPS) * len(TUNE_F16_STAGES)
        assert dist == sorted(dist) and dist.count(0) == 1 and len(set(f16)) == len(f16) == n
        assert {c[0] for c in f16} == {32, 64, 128} and {c[1] for c in f16} == {2, 4} and {c[2] for c in f16} == {2, 3}
        assert tune_launches(D, "f16") == [c[:3] for c in f16]
        assert tune_launches(D, "f16-r128") == [c[:3] for c in f16[:TUNE_R128_LAUNCHES]]  # its nearest only
        # the folded kernel: its own default (128-token tiles at INT4), its split counts, then its grid nearest first
        fold = tune_grid_for(D, "fold")
        assert fold[: 1 + n_splits] == [(128, 4, 2, None)] + [(128, 4, 2, p) for p in TUNE_PROGRAMS_PER_SM]
        dist = [sum(x != y for x, y in zip(c[:3], (128, 4, 2), strict=True)) for c in fold[1 + n_splits :]]
        assert dist == sorted(dist) and 0 not in dist and len(dist) == 3 * 2 * 2 - 1
    assert td.launch_defaults(64)["block_t"] == 64 and td.launch_defaults(128)["block_t"] == 32


@needs_triton
def test_gpu_benchmark_measures_f16_dequant(monkeypatch):
    """``dequant="f16"`` wherever the benchmark measures the default path: step 2 checks it (and 64-token
    tiles) on stores whose sides it really reads in float16, the sweep times it as kernel ``triton-f16`` for
    the integer schemes (break-even and the table included), and prewarm compiles those launches and step
    3b's. A stand-in decoder (torch reference) records the launches: no kernel runs here."""
    bench = _load_bench()
    import prewarm
    from gpu_bench import common, sweep

    seen: list[tuple[str, dict, tuple]] = []

    def record(q, store, **kw):
        bt = kw.get("block_t") or triton_decode.launch_defaults(store.head_dim)["block_t"]
        sides = (store.key, store.value) if store.key is not None else ()
        seen.append((kw, tuple(triton_decode.f16_ok(p, bt, q.dtype) and not (p is store.key and store.pre_rope)
                                for p in sides)))  # fmt: skip
        return decode_attention_reference(q, store)

    cpu = torch.device("cpu")
    cfg = bench.Config(device=cpu, contexts=[256], batches=[1], reps=1, warmup=0, max_bytes=1e9, smoke=True,
                       kernel="triton")  # fmt: skip
    # step 2: the CPU smoke subset is unchanged; the full list ends with the f16 and 64-token-tile variants
    assert [c["variant"] for c in bench.check_variants(cfg, decode_attention_reference)] == [
        "int4-kivi", "int4-pre-rope", "fp16-tail-only", "int4-token-hadamard"]  # fmt: skip
    full = bench.Config(**{**cfg.__dict__, "smoke": False})
    checks = bench.check_variants(full, record, shapes=["llama-3-8b"])
    assert all(c["ok"] for c in checks) and len(checks) == len(seen) == 37
    new = [(c["variant"], kw) for c, (kw, _) in zip(checks, seen, strict=True)][12:19]
    assert new == [("int8-kivi-f16", {"dequant": "f16"}), ("int4-kivi-f16", {"dequant": "f16"}),
                   ("int2-kivi-f16", {"dequant": "f16"}), ("int2-token-keys-f16", {"dequant": "f16"}),
                   ("int4-kivi-masked-f16", {"dequant": "f16"}), ("int4-kivi-bt64", {"block_t": 64}),
                   ("int4-kivi-f16-bt64", {"dequant": "f16", "block_t": 64})]  # fmt: skip
    # then bfloat16 queries, judged against torch at bfloat16
    assert [(c["variant"], c["query_dtype"]) for c in checks[19:21]] == [
        ("int4-kivi-bf16", "bfloat16"), ("int4-pre-rope-bf16", "bfloat16")]  # fmt: skip
    assert {c["query_dtype"] for c in checks[:19] + checks[21:]} == {"float16"}
    # then Hadamard-rotated per-token sides (default launch), then centred / smoothed per-token keys, post-
    # and pre-RoPE
    assert [c["variant"] for c in checks[21:26]] == [
        "int8-token-hadamard", "int4-token-hadamard", "int4-token-smooth", "int4-token-smooth-pre-rope",
        "int4-token-smooth-pre-rope-tied"]  # fmt: skip
    # then the folded-scale kernel (dequant="fold"): KIVI's groups, per-token rows, rotated and smoothed sides
    fold = [(c["variant"], kw) for c, (kw, _) in zip(checks, seen, strict=True)][26:]
    assert [v for v, _ in fold] == [
        "int8-kivi-fold", "int4-kivi-fold", "int2-kivi-fold", "int4-kivi-masked-fold", "int8-token-sym-fold",
        "int4-token-fold", "int2-token-fold", "int4-token-hadamard-fold", "int4-token-smooth-fold",
        "int4-kivi-fold-bt64-2w", "int4-kivi-fold-bt256-3s"]  # fmt: skip
    assert all(kw["dequant"] == "fold" for _, kw in fold)
    assert all(f16 == (True, True) for kw, f16 in seen if kw.get("dequant") == "f16")  # both sides in float16
    # step 3: kernel "triton-f16" for the integer schemes; break-even and the table carry it
    records = bench.sweep(cfg, lambda q, store, **kw: decode_attention_reference(q, store), copy_gbps=10.0)
    f16 = {(r["shape"], r["scheme"]) for r in records if r["kernel"] == "triton-f16"}
    assert f16 == {(shape, s) for shape in common.SHAPES for s in ("int8", "int4", "int2")}
    assert all("ms" in r and r["cuda_graph"] is False for r in records if r["kernel"] == "triton-f16")
    be = bench.break_even(records)
    assert {(b["scheme"], b["kernel"]) for b in be if b["kernel"] == "triton-f16"} == {
        (s, "triton-f16") for s in ("int8", "int4", "int2")}  # fmt: skip
    assert "| triton-f16 | int4 |" in bench.markdown(records, be, 10.0)
    # and the folded-scale kernel (kernel "triton-fold"): the integer KIVI schemes, the per-token layouts but pre-RoPE
    fold = {(r["shape"], r["scheme"]) for r in records if r["kernel"] == "triton-fold"}
    token = [name for name, ts in common.TOKEN_SCHEMES.items() if not ts.pre_rope]
    assert fold == {(shape, s) for shape in common.SHAPES for s in ("int8", "int4", "int2", *token)}
    # and, apart (split_sweep), int4 through both kernels at 8 programs per SM in every cell the sweep timed
    # (kernels "triton-p8", "triton-fold-p8"), against that cell's fastest fp16 SDPA, each with its break-even; the
    # split count reaches the decoder as target_programs (off CUDA: 8 programs in all)
    p8 = sweep.SPLIT_PROGRAMS_PER_SM
    seen.clear()
    split = sweep.split_sweep(cfg, record, 10.0, records)
    fp16 = {(r["shape"], r["batch"], r["context"]): r["ms"] for r in records if r["kernel"] == "sdpa-gqa"}
    for kernel in (f"triton-p{p8}", f"triton-fold-p{p8}"):
        rows = [r for r in split if r["kernel"] == kernel]
        assert {(r["shape"], r["batch"], r["context"], r["scheme"]) for r in rows} == {(*c, "int4") for c in fp16}
        best = {c: min(r["ms"] for r in records if r["kernel"].startswith("sdpa") and (r["shape"], r["batch"],
                r["context"]) == c) for c in fp16}  # fmt: skip
        # the rows keep ms rounded to 5 decimals, the speed-up is taken before that rounding
        assert all(r["speedup_vs_fp16"] == pytest.approx(best[r["shape"], r["batch"], r["context"]] / r["ms"], rel=5e-3,
                                                         abs=1e-3) for r in rows)  # fmt: skip
        assert (kernel, "int4") in {(b["kernel"], b["scheme"]) for b in bench.break_even(records + split)}
    assert sorted((kw.get("dequant", "f32"), kw["target_programs"]) for kw, _ in seen) == sorted(
        [("f32", p8), ("fold", p8)] * len(fp16))  # fmt: skip
    cfg.deadline = 0.0  # past: the split counts stop before their first cell, and the sweep's rows are kept
    assert sweep.split_sweep(cfg, record, 10.0, records) == []
    cfg.deadline = None
    # prewarm: the sweep's f16 variants and step 3b's f16 launches, compiled as the benchmark launches them
    jobs = prewarm.jobs()
    assert {j[1:] for j in jobs if j[0] == "sweep" and j[4] == "f16"} == {
        (shape, s, False, "f16") for shape in common.SHAPES for s in ("int8", "int4", "int2")}  # fmt: skip
    assert {j[1:] for j in jobs if j[0] == "sweep" and j[4] == "fold"} == {
        (shape, s, False, "fold") for shape in common.SHAPES for s in ("int8", "int4", "int2", *token)}  # fmt: skip
    for shape, shp in common.SHAPES.items():
        tunes = [j[2:] for j in jobs if j[0] == "tune" and j[1] == shape]
        assert [j[2:] for j in tunes if j[1] == "f16"] == sweep.tune_launches(shp["D"], "f16")
        assert all(not rope for rope, dequant, *_ in tunes if dequant == "f16")
        assert [j[2:] for j in tunes if j[:2] == (True, "f32")] == sweep.tune_launches(shp["D"])
        assert [j[2:] for j in tunes if j[1] == "f16-r128"] == sweep.tune_launches(shp["D"], "f16-r128")
        assert tunes[:4] == [(False, "f32", *sweep.tune_launches(shp["D"])[0]), (True, "f32", *sweep.tune_launches(
            shp["D"])[0]), (False, "f16", *sweep.tune_launches(shp["D"], "f16")[0]),
            (False, "f16-r128", *sweep.tune_launches(shp["D"], "f16")[0])]  # round robin, defaults first
    launched: list[dict] = []
    monkeypatch.setattr(triton_decode, "decode_attention_triton", lambda q, store, **kw: launched.append(kw))
    monkeypatch.setattr(common, "BATCHES", (1,))
    monkeypatch.setattr(common, "CONTEXTS", (4096,))
    prewarm._run_job(("sweep", "llama-3-8b", "int4", False, "f16"), programs=264)
    prewarm._run_job(("tune", "llama-3-8b", False, "f16", 64, 4, 3), programs=264)
    prewarm._run_job(("tune", "llama-3-8b", True, "f32", 64, 4, 3), programs=264)
    prewarm._run_job(("tune", "llama-3-8b", False, "f16-r128", 32, 4, 2), programs=264)
    assert launched == [{"target_programs": 264, "dequant": "f16"},
                        {"target_programs": 264, "block_t": 64, "num_warps": 4, "num_stages": 3, "dequant": "f16"},
                        {"target_programs": 264, "block_t": 64, "num_warps": 4, "num_stages": 3},
                        {"target_programs": 264, "block_t": 32, "num_warps": 4, "num_stages": 2, "dequant": "f16",
                         "maxnreg": 128}]  # fmt: skip


@needs_triton
def test_gpu_benchmark_tuning_step(monkeypatch):
    """Step 3b times the kernel at other launch parameters (one tiny config here, interpreter), records a
    launch the device refuses instead of stopping, and stops at the sweep's deadline; the reference
    decoder is not tuned."""
    import time

    bench = _load_bench()
    from gpu_bench import sweep

    monkeypatch.setattr(sweep, "TUNE_BLOCK_T", (32,))
    monkeypatch.setattr(sweep, "TUNE_WARPS", (4,))
    monkeypatch.setattr(sweep, "TUNE_STAGES", (2,))
    monkeypatch.setattr(sweep, "SHAPES", {"qwen2.5-0.5b": sweep.SHAPES["qwen2.5-0.5b"]})
    cfg = bench.Config(device=torch.device("cpu"), contexts=[512], batches=[1], reps=1, warmup=0,
                       max_bytes=1e9, smoke=True, kernel="triton")  # fmt: skip
    monkeypatch.setattr(sweep, "TUNE_PROGRAMS_PER_SM", (8,))
    launches: list[dict] = []

    def counted(q, store, **kw):
        launches.append(kw)
        return bench._decoder(cfg)(q, store, **kw)

    rows = bench.tune(cfg, counted, copy_gbps=10.0)
    assert sum(not kw for kw in launches) == 6  # the default launch (no keywords): once per case, not per row
    # round robin over int4, int4-prerope and int4 dequantized in float16 (its grid: block_t x num_stages), with
    # and without the 128-register cap (which the interpreter ignores), and int4 with 2-byte scale reads
    assert [(r["scheme"], r["dequant"], r["block_t"], r["num_warps"], r["num_stages"], r["programs_per_sm"])
            for r in rows] == [
        ("int4", "f32", 64, 4, 2, None), ("int4-prerope", "f32", 64, 4, 2, None), ("int4-f16", "f16", 64, 4, 2, None),
        ("int4-f16-r128", "f16-r128", 64, 4, 2, None), ("int4-halves", "f32-halves", 64, 4, 2, None),
        ("int4-fold", "fold", 128, 4, 2, None),
        ("int4", "f32", 64, 4, 2, 8), ("int4-prerope", "f32", 64, 4, 2, 8), ("int4-f16", "f16", 32, 4, 2, None),
        ("int4-f16-r128", "f16-r128", 32, 4, 2, None), ("int4-fold", "fold", 128, 4, 2, 8)]  # fmt: skip
    assert all(r["ms"] > 0 and r["context"] == 512 for r in rows)
    assert rows[4]["max_diff_vs_default"] == 0.0  # 2-byte scale reads (meta32=False): the same values
    # each launch's output is compared with the default launch's: equal here, a number a wrong launch would show
    # (the f16 rows against the default float32-dequantizing launch: float16 rounding apart)
    assert all(r["max_diff_vs_default"] == 0.0 for r in rows[:2]) and all(
        r["max_diff_vs_default"] < 1e-2 for r in rows
    )

    monkeypatch.setattr(sweep, "TUNE_CASES", sweep.TUNE_CASES[:2])  # the rest: fewer interpreted launches

    def wrong(
        q, store, **kw
    ):  # a launch that computes something else (as the 16-token tiles did on the H200)
        out = bench._decoder(cfg)(q, store, **kw)
        return out + 1 if kw.get("target_programs") else out

    rows = bench.tune(cfg, wrong, copy_gbps=10.0)
    assert [r["max_diff_vs_default"] >= 1 for r in rows] == [False, False, True, True]

    def refuse(q, store, **kw):  # what Triton raises when a launch needs more shared memory than a block gets
        if store.pre_rope:
            raise RuntimeError("out of resource: shared memory, Required: 288768, Hardware limit: 232448")
        return bench._decoder(cfg)(q, store, **kw)

    rows = bench.tune(cfg, refuse, copy_gbps=10.0)
    assert "ms" in rows[0] and rows[1]["error"].startswith("RuntimeError: out of resource: shared memory")
    assert "ms" in rows[2] and "error" in rows[3] and len(rows) == 4
    cfg.deadline = time.monotonic() - 1
    assert bench.tune(cfg, bench._decoder(cfg), copy_gbps=10.0) == []
    assert bench.tune(bench.Config(**{**cfg.__dict__, "kernel": "reference"}), None, copy_gbps=10.0) == []


META32_CASES = [  # (D, key spec, value spec, block_t, dequant, want (K_W32, V_W32))
    (64, KIVI4_KEYS, KIVI4_VALUES, 32, "f32", (True, True)),
    (64, KIVI4_KEYS, KIVI4_VALUES, 64, "f16", (True, True)),  # 2 key scale rows per tile (R = 2)
    (128, spec(2, "channel", 64), spec(8, "token", 32, symmetric=True), 32, "f16", (True, True)),
    (32, spec(8, "token"), spec(4, "token", 16), 32, "f32", (True, True)),  # one scale per row: words across tokens
    (64, spec(8, "token"), spec(2, "token"), 64, "f16", (True, True)),
]


@needs_triton
@pytest.mark.parametrize("D,ks,vs,block_t,dequant,want", META32_CASES, ids=[f"case{i}" for i in range(len(META32_CASES))])
def test_meta32_word_reads_give_the_same_output(monkeypatch, D: int, ks: TensorSpec, vs: TensorSpec, block_t: int,
                                                 dequant: str, want: tuple[bool, bool]):  # fmt: skip
    """Scales and zero-points (and the padding mask) read as int32 words (``meta32``, the default;
    prefetchable by ``cp.async``) are the same values as the 2-byte (1-byte) reads: identical outputs, bit
    for bit, on a ragged, left-padded batch; sides whose rows hold an odd number of values keep the 2-byte
    reads (``_words_ok``)."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(D + block_t)
    store = make_store(g, D=D, key_spec=ks, value_spec=vs, T_q=192, quant_lens=[192, 70], full_lens=[40, 3],
                       block=max(32, ks.group_size or 0))  # fmt: skip
    store.quant_mask = torch.ones(2, 192, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :9] = False
    q = (torch.randn(2, 4, 1, D, generator=g) * 1.5).to(DEVICE).half()
    words = triton_decode.decode_attention_triton(q, store, splits=3, block_t=block_t, dequant=dequant)
    assert (spy.seen[-1]["K_W32"], spy.seen[-1]["V_W32"], spy.seen[-1]["QMASK_W32"]) == (*want, True)
    halves = triton_decode.decode_attention_triton(q, store, splits=3, block_t=block_t, dequant=dequant, meta32=False)
    assert (spy.seen[-1]["K_W32"], spy.seen[-1]["V_W32"], spy.seen[-1]["QMASK_W32"]) == (False, False, False)
    assert torch.equal(words, halves)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    assert max_err(words, truth) <= 2 * max_err(decode_attention_reference(q, store, dtype=torch.float16), truth) + 1e-6


ODD_CASES = [  # (D, key spec, value spec, dequant): one float16 value per token row on at least one side
    (64, spec(8, "token"), spec(8, "token"), "f32"),  # int8-token, the end-to-end benchmark's INT8
    (64, spec(8, "token"), spec(2, "token"), "f16"),
    (32, spec(4, "token", symmetric=True), spec(8, "token"), "f32"),  # symmetric keys: scales alone
]


@needs_triton
@pytest.mark.parametrize("T_q", [191, 63])
@pytest.mark.parametrize("D,ks,vs,dequant", ODD_CASES, ids=[f"case{i}" for i in range(len(ODD_CASES))])
def test_word_reads_over_an_odd_slot_count(monkeypatch, T_q: int, D: int, ks: TensorSpec, vs: TensorSpec,
                                           dequant: str):  # fmt: skip
    """A growing cache holds an odd number of slots every other step, and a reservation may: then every other
    (sequence, head) slab of one-value-per-token scales starts in the middle of a word. Word reads there
    (``_token_words(ODD=True)``, ``K_W32 == 2``) give the 2-byte reads' output bit for bit, with NaN scales in
    the slots no sequence reads (past a length, left padding) that a word brings along."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(T_q + D)
    store = make_store(g, D=D, key_spec=ks, value_spec=vs, T_q=T_q, quant_lens=[T_q, T_q // 2 + 1],
                       full_lens=[40, 3], block=32)  # fmt: skip
    store.quant_mask = torch.ones(2, T_q, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :9] = False
    for p in (store.key, store.value):
        for m in (p.scale, p.zero):
            if m is not None:
                m[1, :, T_q // 2 + 1 :] = float("nan")
                m[1, :, :9] = float("nan")
    q = (torch.randn(2, 4, 1, D, generator=g) * 1.5).to(DEVICE).half()
    words = triton_decode.decode_attention_triton(q, store, splits=3, dequant=dequant)
    assert (spy.seen[-1]["K_W32"], spy.seen[-1]["V_W32"]) == (2, 2)
    halves = triton_decode.decode_attention_triton(q, store, splits=3, dequant=dequant, meta32=False)
    assert (spy.seen[-1]["K_W32"], spy.seen[-1]["V_W32"]) == (0, 0)
    assert torch.isfinite(words).all()
    assert torch.equal(words, halves)


@needs_triton
@pytest.mark.parametrize("T_q", [97, 98, 99])
def test_mask_words_at_any_slot_count(monkeypatch, T_q: int):
    """``pack_store`` (and the cache) hold a slot mask as rows of whole int32 words (``word_rows``), so the
    kernels read a left-padded batch's mask as words (``QMASK_W32``) at slot counts that are not multiples of
    4 too, where byte loads used to stay synchronous in the tile loop; the output is the byte reads', bit
    for bit."""
    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(T_q)
    store = make_store(g, key_spec=spec(8, "token"), value_spec=spec(4, "token", 16), T_q=T_q, block=4,
                       quant_lens=[T_q // 2, T_q], full_lens=[5, 13])  # fmt: skip
    mask = torch.ones(2, T_q, dtype=torch.bool)
    mask[1, :9] = False
    store = dataclasses.replace(store, quant_mask=word_rows(mask.to(DEVICE)))
    assert store.quant_mask.stride(0) % 4 == 0 and torch.equal(store.quant_mask.cpu(), mask)
    q = (torch.randn(2, 6, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    words = triton_decode.decode_attention_triton(q, store, splits=2, block_t=32)
    assert spy.seen[-1]["QMASK_W32"] and spy.seen[-1]["HAS_QMASK"]
    plain = dataclasses.replace(store, quant_mask=mask.to(DEVICE))  # contiguous rows of T_q bytes
    halves = triton_decode.decode_attention_triton(q, plain, splits=2, block_t=32)
    assert not spy.seen[-1]["QMASK_W32"]
    assert torch.equal(words, halves)
    truth = decode_attention_reference(q.double(), plain, dtype=torch.float64)
    assert max_err(words, truth) <= 2 * max_err(decode_attention_reference(q, plain, dtype=torch.float16), truth) + 1e-6


@needs_triton
def test_words_ok_refuses_what_words_can_not_read():
    """Word reads need float16 metadata, 4-byte alignment and whole words: an even number of values per row,
    or one per token over an even number of rows; anything else keeps the 2-byte reads."""
    from types import SimpleNamespace

    def side(shape, dtype=torch.float16, offset=0, tps=1):
        flat = torch.zeros(offset + math.prod(shape), dtype=dtype)
        return SimpleNamespace(scale=flat[offset:].view(shape), zero=None, tps=tps)

    ok = triton_decode._words_ok
    assert ok(side((2, 2, 6, 4))) == ok(side((2, 2, 6, 1))) == 1
    assert ok(side((2, 2, 5, 1))) == 2  # one per token, odd row count: slabs start in a word's middle alternately
    assert ok(side((1, 1, 5, 1))) == 0  # ... and an odd count in all: the last word would leave the tensor
    assert ok(side((2, 2, 5, 4))) == 1  # several per token: words along each row, whatever the row count
    assert not ok(side((2, 2, 5, 3)))  # odd columns per row
    cut = SimpleNamespace(scale=torch.zeros(2, 2, 6, 1, dtype=torch.float16)[:, :, :5], zero=None, tps=1)
    assert not ok(cut)  # odd rows, not contiguous: the slabs' parity does not alternate
    assert not ok(side((2, 2, 6, 1), tps=32))  # one per block of tokens: not contiguous per token
    assert not ok(side((2, 2, 6, 4), offset=1))  # 2-byte aligned only
    assert not ok(side((2, 2, 6, 4), dtype=torch.float32))  # fp8's float32 static scales
    assert not ok(None)


def test_decode_attention_refuses_integer_queries_and_gives_zeros_where_every_slot_is_masked():
    """An integer query came back as integer attention output (the reference casts to ``q.dtype``); a sequence whose
    every slot is masked got NaN from both paths (softmax's 0 / 0). Now a ``TypeError``, and zeros for that sequence
    as torch's SDPA gives, the other sequence untouched and a NaN query still NaN."""
    g = torch.Generator().manual_seed(0)
    store = make_store(g, T_q=64, T_f=8)
    q = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE)
    with pytest.raises(TypeError, match="q must be a floating-point tensor .*got torch.int64"):
        dispatch.decode_attention(q.long(), store)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        decode_attention_reference(q.int(), store)
    one_hidden = replace(store, quant_mask=torch.tensor([[True] * 64, [False] * 64], device=DEVICE),
                         full_mask=torch.tensor([[True] * 8, [False] * 8], device=DEVICE))  # fmt: skip
    nan_q = q.clone()
    nan_q[0, 0, 0, 0] = math.nan
    paths = [decode_attention_reference]
    if triton_decode is not None:
        paths.append(triton_decode.decode_attention_triton)
    for attend in paths:
        out = attend(q, one_hidden)
        assert torch.equal(out[1], torch.zeros_like(out[1])), attend.__name__
        assert out[0].isfinite().all() and out[0].abs().max() > 0.1, attend.__name__
        assert out[0].sub(decode_attention_reference(q, store)[0]).abs().max() < 1e-5  # the visible sequence
        nan_out = attend(nan_q, store)
        assert nan_out[0, 0].isnan().all() and nan_out[1].isfinite().all(), attend.__name__


def test_decode_entry_points_name_the_query_shape_for_another_rank():
    """A query without its ``q_len`` dim, ``(B, H_q, D)``, failed in every entry point with Python's "not enough values
    to unpack (expected 4, got 3)" (the first line of each unpacked ``q.shape``); now the ``ValueError`` says which
    shape is expected and which was given."""
    g = torch.Generator().manual_seed(0)
    store = make_store(g, B=2, T_q=32, T_f=4, key_spec=spec(8, "token"), value_spec=spec(8, "token"))
    q = torch.randn(2, 4, 64, generator=g).to(DEVICE)
    paths = [dispatch.decode_attention, decode_attention_reference]
    if triton_decode is not None:
        from kvbits.kernels.triton_fold import decode_attention_fold

        paths += [triton_decode.decode_attention_triton, decode_attention_fold]
    for attend in paths:
        for bad in (q.half(), q.half()[None, None]):
            with pytest.raises(ValueError, match=r"q must be \(B=2, .*got \(.*2, 4, 64\)"):
                attend(bad, store)


@needs_triton
@pytest.mark.parametrize("dequant", ["f32", "f16", "fold"])
def test_kernel_over_an_empty_batch_returns_an_empty_output(dequant: str):
    """A store of no sequences (``B = 0``) made every Triton launch divide by zero in ``_num_splits`` (splits per
    ``B * H_kv`` programs), where the reference returns a ``(0, H_q, 1, D)`` output; now the kernel paths return it
    too (no program is launched: an empty grid)."""
    g = torch.Generator().manual_seed(0)
    store = make_store(g, B=0, T_q=64, T_f=5, key_spec=spec(4, "token"), value_spec=spec(4, "token"))
    q = torch.randn(0, 4, 1, 64, generator=g).half().to(DEVICE)
    want = decode_attention_reference(q, store)
    out = triton_decode.decode_attention_triton(q, store, dequant=dequant)
    assert out.shape == want.shape == (0, 4, 1, 64) and out.dtype == torch.float16


def test_packed_tensor_refuses_codes_and_scales_the_kernels_would_misread():
    """A ``PackedTensor`` whose codes are not uint8 rows of ``ceil(D * bits / 8)`` bytes, or whose scales are not
    ``(B, H_kv, T_q // tps, D / cps)``, was accepted: the Triton kernel read it by those sizes without a word (int8
    codes, half-width rows, 8 bits said of 4-bit rows, two scale columns for one: outputs 2.3-2.8 off the true
    store's; half the scale rows: reads past their end), where the reference failed deep inside. Now a
    ``ValueError`` at construction names the expected shape."""
    g = torch.Generator().manual_seed(0)
    p = make_store(g, B=1, H_kv=1, T_q=64, T_f=3, key_spec=spec(4, "token"), value_spec=spec(4, "token")).key
    assert replace(p).codes is p.codes  # the layout pack_side gives passes
    for bad, match in (
        ({"codes": p.codes.view(torch.int8)}, r"must be uint8 \(B, H_kv, T_q, 32\), got torch.int8"),
        ({"codes": p.codes[..., :16].contiguous()}, r"\(B, H_kv, T_q, 32\), got torch.uint8 \(1, 1, 64, 16\)"),
        ({"bits": 8}, r"8-bit codes of head dim 64 must be uint8 \(B, H_kv, T_q, 64\)"),
        ({"scale": p.scale.expand(-1, -1, -1, 2), "zero": p.zero.expand(-1, -1, -1, 2)}, r"scale must be .* got \(1, 1, 64, 2\)"),
        ({"scale": p.scale[:, :, :32], "zero": p.zero[:, :, :32]}, r"scale must be \(B, H_kv, >= 64, 1\)"),
        ({"zero": p.zero[:, :, :32]}, r"zero must be"),
        ({"cps": 48}, "cps must be positive and cps divide head dim 64"),
    ):
        with pytest.raises(ValueError, match=match):
            replace(p, **bad)
    static = replace(p, tps=2**30, scale=p.scale[:, :, :1], zero=p.zero[:, :, :1])  # one static row: accepted
    assert static.scale.shape[2] == 1
