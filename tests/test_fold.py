"""The folded-scale decode kernel (``kvbits.kernels.triton_fold``): accuracy, what it refuses, the dispatch.

Runs compiled on CUDA, else through Triton's interpreter (which takes the kernel's plain-arithmetic branch for the
inline-PTX code conversion; ``tests/test_aot.py`` compiles the PTX branch for sm_90). Accuracy criterion as in
``test_kernels.py``: the max error against float64 attention over the same quantized store is at most twice the
error of plain torch attention at float16.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from _launch import LaunchSpy
from _realmodel import unavailable
from test_kernels import (
    DEVICE,
    HAD,
    KIVI4_KEYS,
    KIVI4_VALUES,
    make_store,
    max_err,
    needs_triton,
    rotated_case,
    spec,
)

from kvbits.kernels import dispatch
from kvbits.kernels.reference import code_basis, decode_attention_reference, pack_store
from kvbits.quant import quantize
from kvbits.quant.rotate import unrotate

try:
    from kvbits.kernels import triton_decode, triton_fold  # the interpreter is enabled by test_kernels
except ImportError:  # Triton not installed (needs_triton skips)
    triton_decode = triton_fold = None


def token(bits: int, symmetric: bool = False, **kw):
    """One scale (and zero-point) per token row over all channels: what the folded kernel reads."""
    return spec(bits, "token", None, symmetric=symmetric, **kw)


FOLD_CASES = [  # (D, G, key spec, value spec, quantized slots, block_t, splits)
    (64, 7, token(4), token(4), 192, None, 3),  # Qwen2.5's GQA group, default tile (128)
    (128, 4, token(8, True), token(8, True), 192, 32, 2),  # Llama-3-8B's, vLLM's symmetric INT8 rows
    (64, 3, token(2), token(4, True), 160, 64, 4),  # mixed widths, 2-bit keys (4 parts per byte)
    (32, 1, token(4), token(8), 96, 16, 1),  # MHA, the narrowest INT4 rows (16 bytes)
    (16, 2, token(8), token(8), 64, 16, 2),  # the narrowest INT8 rows
    (256, 16, token(4), token(2), 96, None, 2),  # wide heads, 16 query heads per KV head
    # KIVI: keys per channel over 32 tokens (four scale rows per 128-token tile), values per 32 channels
    (64, 7, KIVI4_KEYS, KIVI4_VALUES, 192, None, 3),
    (128, 4, spec(2, "channel", 32), spec(2, "token", 32), 192, 64, 2),  # 8 rows of a 2-bit part per group
    (64, 3, spec(8, "channel", 128), token(8), 256, None, 2),  # int8-channel: one scale row per tile
    (64, 2, spec(4, "channel", 64, symmetric=True), spec(4, "token", 16, symmetric=True), 128, 32, 2),  # rows > tile
    (32, 2, spec(4, "channel", 8), spec(4, "token", 16), 64, 32, 2),  # 8-token key groups: an M side of 8
]


def fold_case(g: torch.Generator, D: int, ks, vs, T_q: int):
    block = max(32, ks.group_size or 0) if ks.granularity == "channel" else 32  # whole key scale groups
    store = make_store(g, D=D, key_spec=ks, value_spec=vs, T_q=T_q, quant_lens=[T_q, T_q // 2 - 3], full_lens=[40, 3],
                       block=block)  # fmt: skip
    store.quant_mask = torch.ones(2, T_q, dtype=torch.bool, device=store.device)
    store.quant_mask[1, :9] = False  # sequence 1 left-padded
    return store


@needs_triton
@pytest.mark.parametrize("D,G,ks,vs,T_q,block_t,splits", FOLD_CASES, ids=[f"D{c[0]}-G{c[1]}" for c in FOLD_CASES])
def test_fold_within_twice_torch_error(D, G, ks, vs, T_q, block_t, splits):
    """Ragged, left-padded, with a fp16 tail: within twice torch's float16 error, below the product kernel's
    (the codes enter the dots exactly and the scales are applied in float32)."""
    g = torch.Generator().manual_seed(D * 7 + G)
    store = fold_case(g, D, ks, vs, T_q)
    assert triton_fold.fold_supported(store) is None
    q = (torch.randn(2, 2 * G, 1, D, generator=g) * 1.5).to(DEVICE).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    out = triton_fold.decode_attention_fold(q, store, block_t=block_t, splits=splits)
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert max_err(out, truth) <= 2 * err_pt + 1e-6, (max_err(out, truth), err_pt)
    one_split = triton_fold.decode_attention_fold(q, store, splits=1)
    assert max_err(one_split, truth) <= 2 * err_pt + 1e-6


@needs_triton
def test_fold_scales_matter():
    """The scales and zero-points reach the scores and outputs: a store whose value zero-points are shifted, or
    whose key scales are doubled, gives another output (a kernel that ignored them would not)."""
    g = torch.Generator().manual_seed(5)
    store = fold_case(g, 64, token(4), token(4), 128)
    q = (torch.randn(2, 4, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    base = triton_fold.decode_attention_fold(q, store)
    store.value.zero.add_(1.0)
    shifted = triton_fold.decode_attention_fold(q, store)
    assert 0.1 < max_err(shifted, base) <= 1.01  # +1 times the quantized slots' attention weight (<= 1)
    store.value.zero.sub_(1.0)
    store.key.scale.mul_(2.0)
    assert max_err(triton_fold.decode_attention_fold(q, store), base) > 1e-2


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("magnitude", [5e-3, 5e-4])
def test_fold_small_values_keep_their_precision(bits: int, magnitude: float):
    """Values of small magnitude in per-row codes (scales of 1e-5 .. 1e-4): the probabilities times the scales
    enter the value dots in units of the tile's largest scale, so they stay float16 normals. Without the unit the
    error was 3x (INT8, 5e-3) and 20x (5e-4) float16 torch's, as ``p s`` fell among the subnormals."""
    g = torch.Generator().manual_seed(bits)
    D, T = 64, 512
    kq = torch.randn(1, 2, T, D, generator=g)
    vq = torch.randn(1, 2, T, D, generator=g) * magnitude
    ks, vs = token(bits), token(bits)
    kb = [quantize(kq[:, :, a : a + 32].to(DEVICE), ks) for a in range(0, T, 32)]
    vb = [quantize(vq[:, :, a : a + 32].to(DEVICE), vs) for a in range(0, T, 32)]
    store = pack_store(kb, vb, None, None, quant_lens=[T], full_lens=[0])
    assert float(store.value.scale.float().max()) < 40 * magnitude / (2**bits - 1)
    q = (torch.randn(1, 8, 1, D, generator=g) * 1.5).to(DEVICE).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    assert err_pt < 1e-2 * float(truth.abs().max())  # torch's float16 error scales with the values
    assert max_err(triton_fold.decode_attention_fold(q, store), truth) <= 2 * err_pt


def _assert_fold_finite_within_twice_torchs_error(q: torch.Tensor, store) -> None:
    """The folded kernel on ``store`` for ``q`` ``(B, Hq, 1, D)`` float16 is finite and within twice torch's float16
    attention's error of the float64 truth."""
    assert triton_fold.fold_supported(store, q) is None
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    out = triton_fold.decode_attention_fold(q, store, block_t=16, splits=1)
    assert torch.isfinite(out).all()
    assert max_err(out, truth) <= 2 * err_pt


@needs_triton
@pytest.mark.parametrize("bits,magnitude,D", [(2, 5e4, 64), (4, 6.5e4, 32)])
def test_fold_grouped_values_near_float16_max_stay_finite(bits: int, magnitude: float, D: int):
    """Values scaled per token over groups of 16 channels, of magnitude near float16's max: the float16 products of
    the centred codes and their scales (``(c - 2**(bits-1)) s``, up to ``2**(bits-1) s``) go through a power-of-two
    unit where they would pass 65504. Before, 2-bit values of 5e4 (scales 3.3e4) and 4-bit of 6.5e4 (8.7e3) attended
    to inf, where the values, torch's float16 attention and the product kernel are finite (error 8.1 / 8.4)."""
    g = torch.Generator().manual_seed(bits)
    T = 32
    k = torch.randn(1, 1, T, D, generator=g)
    v = (torch.rand(1, 1, T, D, generator=g) * 2 - 1) * magnitude
    v[..., 0, :], v[..., 1, :] = magnitude, -magnitude  # tokens 0 and 1 at +-magnitude: groups of them span it
    store = pack_store([quantize(k.to(DEVICE), token(4))], [quantize(v.to(DEVICE), spec(bits, "token", 16))], None,
                       None, quant_lens=[T], full_lens=[0])  # fmt: skip
    assert float(store.value.scale.float().max()) * 2 ** (bits - 1) > 65504
    q = torch.randn(1, 2, 1, D, generator=g).to(DEVICE).half()
    _assert_fold_finite_within_twice_torchs_error(q, store)


@needs_triton
@pytest.mark.parametrize("symmetric", [False, True])
def test_fold_8bit_grouped_values_spanning_float16_stay_finite(symmetric: bool):
    """8-bit values in groups of 16 channels spanning +-65504: the centred products ``(c - 128) s`` (scale 513.5)
    reached -65728, inf in float16; the scales enter halved and the output is doubled (exact). Before: inf where
    torch's float16 error was 11.8 and the float32 reference's 4.9; now 8.5."""
    g = torch.Generator().manual_seed(8)
    T, D = 32, 32
    k = torch.randn(1, 1, T, D, generator=g)
    v = (torch.rand(1, 1, T, D, generator=g) * 2 - 1) * 65504.0
    v[..., 0::16], v[..., 1::16] = 65504.0, -65504.0  # every group of every token spans +-65504
    store = pack_store([quantize(k.to(DEVICE), token(4))],
                       [quantize(v.to(DEVICE), spec(8, "token", 16, symmetric=symmetric))], None, None,
                       quant_lens=[T], full_lens=[0])  # fmt: skip
    q = torch.randn(1, 2, 1, D, generator=g).to(DEVICE).half()
    _assert_fold_finite_within_twice_torchs_error(q, store)


@needs_triton
@pytest.mark.parametrize("bits,qmag", [(4, 1.0), (4, 12.0), (2, 4.0)])
def test_fold_channel_keys_past_float16_in_q_times_s_stay_finite(bits: int, qmag: float):
    """Keys per channel spanning +-65504 (4-bit scales 8728, 2-bit 43648) under queries whose ``q s`` passes
    65504: the query enters the folded dots in a power-of-two unit (``_query_unit``). Before: NaN (float16 halves of
    ``q s`` = 1.0e5 were inf) where the float32 reference's error is 4.9e-4; now 7.3e-4. Torch's float16
    attention is NaN here (its scores overflow), so the bound is the float32 reference's."""
    g = torch.Generator().manual_seed(3)
    T, D = 32, 64
    k = (torch.rand(1, 1, T, D, generator=g) * 2 - 1) * 6e4
    k[..., 0, :], k[..., 1, :] = 65504.0, -65504.0  # every channel spans +-65504
    v = torch.randn(1, 1, T, D, generator=g)
    store = pack_store([quantize(k.to(DEVICE), spec(bits, "channel", 32))], [quantize(v.to(DEVICE), token(4))],
                       None, None, quant_lens=[T], full_lens=[0])  # fmt: skip
    q = (torch.randn(1, 2, 1, D, generator=g) * qmag / 3).to(DEVICE).half()
    q[..., 0] = qmag
    assert triton_fold.fold_supported(store, q) is None
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err32 = max_err(decode_attention_reference(q, store, dtype=torch.float32), truth)
    out = triton_fold.decode_attention_fold(q, store, block_t=32, splits=1)
    assert torch.isfinite(out).all()
    assert max_err(out, truth) <= 4 * err32 + 1e-3


@needs_triton
@pytest.mark.parametrize("meta32", [False, True])
def test_fold_meta32_reads_the_same_scales(meta32: bool):
    """Scales read as int32 words of two tokens (``meta32``) give the output of the 2-byte reads, padding and odd
    lengths included (a word's second row past a sequence's length is zeroed)."""
    g = torch.Generator().manual_seed(6)
    store = fold_case(g, 64, token(8), token(4), 128)
    q = (torch.randn(2, 4, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    store.value.scale[1, :, 61:] = float("nan")  # past sequence 1's 61 slots: never read into the output
    out = triton_fold.decode_attention_fold(q, store, meta32=meta32)
    assert torch.isfinite(out).all()
    assert torch.equal(out, triton_fold.decode_attention_fold(q, store, meta32=not meta32))


@needs_triton
def test_fold_word_reads_over_an_odd_slot_count(monkeypatch):
    """An odd number of slots (a growing cache every other step): slabs of per-token scales start in a word's
    middle alternately, and the word reads (``K_W32 == 2``) still give the 2-byte reads' output bit for bit."""
    spy = LaunchSpy(triton_fold._fold_kernel)
    monkeypatch.setattr(triton_fold, "_fold_kernel", spy)
    g = torch.Generator().manual_seed(7)
    store = fold_case(g, 64, token(8), token(8), 127)
    for m in (store.key.scale, store.key.zero, store.value.scale, store.value.zero):
        m[1, :, :9] = float("nan")  # sequence 1's left padding ...
        m[1, :, 127 // 2 - 3 :] = float("nan")  # ... and its slots past its length: never in the output
    q = (torch.randn(2, 4, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    words = triton_fold.decode_attention_fold(q, store, meta32=True)
    assert (spy.seen[-1]["K_W32"], spy.seen[-1]["V_W32"]) == (2, 2)
    assert torch.isfinite(words).all()
    assert torch.equal(words, triton_fold.decode_attention_fold(q, store, meta32=False))


@needs_triton
def test_fold_reads_only_the_used_slots():
    """Reserved slots past ``quant_used`` (a cache's ``max_cache_len``) and past each sequence's length are never
    read: NaN codes' scales there change nothing."""
    g = torch.Generator().manual_seed(11)
    store = fold_case(g, 64, KIVI4_KEYS, token(4), 192)
    store.quant_lens = torch.tensor([150, 61], dtype=torch.int32, device=store.device)
    store.quant_used = 150
    q = (torch.randn(2, 4, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    clean = triton_fold.decode_attention_fold(q, store)
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    store.key.scale[:, :, 150 // 32 + 1 :] = float("nan")  # key scale rows wholly past the used slots
    store.value.scale[:, :, 150:] = float("nan")
    store.value.scale[1, :, 61:] = float("nan")
    poisoned = triton_fold.decode_attention_fold(q, store)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)
    assert max_err(clean, truth) <= 2 * err_pt + 1e-6


@needs_triton
def test_fold_takes_uniform_lengths_as_integers(monkeypatch):
    """``PackedStore.uniform_lens``: the folded kernel takes ``quant_used`` and ``T_f`` (``UNIFORM``) instead of loading
    the length tensors, with their output bit for bit; the last of 3 splits is cut short by ``quant_used``, past which
    the reserved slots hold NaN scales, never read (as ``test_kernels``' check of the default kernel)."""
    g = torch.Generator().manual_seed(23)
    store = make_store(g, T_q=192, T_f=40, key_spec=token(4), value_spec=token(4))
    store = dataclasses.replace(store, quant_lens=torch.full_like(store.quant_lens, 160), quant_used=160)
    assert store.uniform_lens
    store.key.scale[:, :, 160:] = float("nan")
    store.value.scale[:, :, 160:] = float("nan")
    q = (torch.randn(2, 8, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    spy = LaunchSpy(triton_fold._fold_kernel)
    monkeypatch.setattr(triton_fold, "_fold_kernel", spy)
    out = triton_fold.decode_attention_fold(q, store, splits=3, block_t=32)
    loaded = triton_fold.decode_attention_fold(q, dataclasses.replace(store, uniform_lens=False), splits=3, block_t=32)
    assert [m["UNIFORM"] for m in spy.seen] == [True, False]
    assert torch.isfinite(out).all() and torch.equal(out, loaded)


@needs_triton
@pytest.mark.parametrize("which", ["both", "smooth-rotated"])
def test_fold_attends_rotated_and_smoothed_keys(which: str):
    """Rotated (Hadamard) sides and centred / smoothed keys: attended in the codes' basis (``code_basis``), within
    twice torch's error against the float64 attention over what the blocks decode to."""
    keys = token(4, **HAD) if which == "both" else token(4, centre=True, smooth=0.5, **HAD)
    q, store, truth = rotated_case(torch.Generator().manual_seed(36), keys, token(4, **HAD), G=4)
    q = q.half()
    assert triton_fold.fold_supported(store, q) is None
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    assert max_err(triton_fold.decode_attention_fold(q, store), truth) <= 2 * err_pt + 1e-6


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_fold_rotated_values_at_or_below_torch_error(seed: int):
    """Hadamard-rotated INT4 rows on both sides: the folded kernel's error is at most float16 torch's. The value codes
    enter centred (``c - 8``): on uncentred codes (all >= 0) the float16 rounding of ``p s``, shared by a token's
    channels, offset every output channel alike, and the output's rotation gathered it into one channel (1.23x /
    1.70x / 1.25x / 1.58x torch's error at seeds 0-3; centred 0.37-0.66x)."""
    q, store, _ = rotated_case(torch.Generator().manual_seed(seed), token(4, **HAD), token(4, **HAD), G=4)
    q = q.half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    assert max_err(triton_fold.decode_attention_fold(q, store), truth) <= err_pt


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_fold_symmetric_values_centre_on_their_zero(seed: int):
    """Symmetric 2-bit Hadamard-rotated value rows (codes 0..2, zero at 1): the codes enter the value dots centred on
    their zero (``c - 1``), so the float16 rounding of ``p s`` shared by a token's channels cancels between them
    instead of offsetting every channel alike, which the output's rotation gathers into one channel. Centred on
    ``2**(bits-1) = 2`` (codes -2..0) the error was 1.84x / 1.25x / 4.62x / 0.22x / 2.08x / 1.14x float16 torch's at
    seeds 0-5; on the zero 0.29-1.28x."""
    g = torch.Generator().manual_seed(seed)
    values = token(2, True, **HAD)
    store = make_store(g, B=1, H_kv=1, T_q=64, T_f=7, key_spec=token(4), value_spec=values, quant_lens=[64],
                       full_lens=[7])  # fmt: skip
    q = (torch.randn(1, 2, 1, 64, generator=g) * 1.5).to(DEVICE).half()
    assert triton_fold.fold_supported(store, q) is None
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err_pt = max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)
    assert max_err(triton_fold.decode_attention_fold(q, store), truth) <= 2 * err_pt


@needs_triton
@pytest.mark.parametrize("seed", range(4))
def test_fold_keeps_the_rotated_query_exact(seed: int):
    """Hadamard-rotated INT8 rows, sharp attention (queries x 6), no tail: the folded kernel attends with ``q' = q R``
    kept float32 (two float16 halves per key dot), so its error stays well under that of float64 attention with
    ``q'`` rounded to float16 once, the rounding it used to share with float16 torch (then 0.98-1.05x of it at seeds
    0-3; now 0.13-0.52x). On Qwen2.5's ``int4-token-hadamard`` cache that rounding alone put the kernel at 2.61x float16
    torch's error at one layer (``benchmarks/fold_real_kv.py``; 0.76x now)."""
    q, store, _ = rotated_case(torch.Generator().manual_seed(seed), token(8, **HAD), token(8, **HAD), G=4)
    store = dataclasses.replace(store, full_lens=torch.zeros_like(store.full_lens))
    q = (q * 6).half()
    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    qr, sr, out_rotate = code_basis(q, store)  # q' rounded to float16
    assert qr.dtype == torch.float16
    rounded = unrotate(decode_attention_reference(qr.double(), sr, dtype=torch.float64), out_rotate, torch.float64)
    err = max_err(triton_fold.decode_attention_fold(q, store), truth)
    assert err <= 0.75 * max_err(rounded, truth)
    assert err <= max_err(decode_attention_reference(q, store, dtype=torch.float16), truth)


@needs_triton
@pytest.mark.parametrize(
    "kw,q_dtype,reason",
    [
        ({"key_spec": spec(4, "token", 32)}, torch.float16, "keys: one scale per 1 tokens and 32 channels"),
        ({"value_spec": spec(4, "channel", 32)}, torch.float16, "values: one scale per 32 tokens and 1 channels"),
        ({"key_spec": spec(4, "channel", 32), "rope": True}, torch.float16, "pre-RoPE keys"),
        ({"key_spec": token(3)}, torch.float16, "3-bit codes"),
        ({"key_spec": spec(4, "token", None, outlier_frac=0.05)}, torch.float16, "sparse outliers"),
        ({}, torch.bfloat16, "float16 queries"),
        ({}, torch.float32, "float16 queries"),
        ({"D": 16, "key_spec": token(4)}, torch.float16, "rows of 8 bytes"),
    ],
)
def test_fold_refuses_what_it_cannot_read(kw: dict, q_dtype: torch.dtype, reason: str):
    g = torch.Generator().manual_seed(7)
    base = {"key_spec": token(4), "value_spec": token(4), "T_q": 64}
    store = make_store(g, **{**base, **kw})
    q = torch.randn(2, 4, 1, store.head_dim, generator=g).to(DEVICE).to(q_dtype)
    assert reason in (triton_fold.fold_supported(store, q) or "")
    with pytest.raises(NotImplementedError, match=reason.split(" (")[0]):
        triton_fold.decode_attention_fold(q, store)


@needs_triton
def test_fold_launch_arguments_are_checked():
    g = torch.Generator().manual_seed(8)
    store = make_store(g, key_spec=token(4), value_spec=token(4), T_q=64)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    with pytest.raises(ValueError, match="n_rows must be a power of two >= G=3"):
        triton_fold.decode_attention_fold(q, store, n_rows=2)
    with pytest.raises(ValueError, match="block_t one >= 16"):
        triton_fold.decode_attention_fold(q, store, block_t=8)
    with pytest.raises(ValueError, match="q must be"):
        triton_fold.decode_attention_fold(q[:, :5], store)


@needs_triton
def test_dequant_fold_takes_the_folded_kernel_where_it_can(monkeypatch):
    """``KVBITS_DEQUANT=fold``: a store of per-token rows goes to the folded kernel; a store it does not read
    (per-token keys in channel groups) to the float32 path, with the same output as without the mode."""
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    spy = LaunchSpy(triton_fold._fold_kernel)
    monkeypatch.setattr(triton_fold, "_fold_kernel", spy)
    g = torch.Generator().manual_seed(9)
    rows = make_store(g, key_spec=token(8, True), value_spec=token(8, True), T_q=64, T_f=16)
    kivi = make_store(g, key_spec=spec(4, "token", 32), T_q=64, T_f=16)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    default_rows = dispatch.decode_attention(q, rows)
    default_kivi = dispatch.decode_attention(q, kivi)
    monkeypatch.setenv("KVBITS_DEQUANT", "fold")
    folded = dispatch.decode_attention(q, rows)
    assert len(spy.seen) == 1 and max_err(folded, default_rows) < 2e-3
    assert torch.equal(dispatch.decode_attention(q, kivi), default_kivi) and len(spy.seen) == 1


@needs_triton
def test_fold_failure_falls_back_logged(monkeypatch, caplog):
    """On CUDA a folded launch that fails (a compile error) is logged, remembered and served by the float32 path;
    elsewhere (tests, the interpreter) the error is raised."""
    monkeypatch.setattr(triton_fold, "_fold_kernel", LaunchSpy(triton_fold._fold_kernel, fail=lambda meta: True))
    monkeypatch.setattr(triton_decode, "_FOLD_BROKEN", set())
    g = torch.Generator().manual_seed(10)
    store = make_store(g, key_spec=token(4), value_spec=token(4), T_q=64)
    q = torch.randn(2, 6, 1, 64, generator=g).to(DEVICE).half()
    want = triton_decode.decode_attention_triton(q, store)
    monkeypatch.setattr(triton_decode, "_compile_fallbacks", lambda q: False)
    with pytest.raises(RuntimeError, match="stand-in"):
        triton_decode.decode_attention_triton(q, store, dequant="fold")
    monkeypatch.setattr(triton_decode, "_compile_fallbacks", lambda q: True)
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.triton_decode"):
        out = triton_decode.decode_attention_triton(q, store, dequant="fold")
        again = triton_decode.decode_attention_triton(q, store, dequant="fold")
    assert torch.equal(out, want) and torch.equal(again, want)
    assert sum("dequant='fold' failed" in r.message for r in caplog.records) == 1
    assert len(triton_decode._FOLD_BROKEN) == 1


@needs_triton
@pytest.mark.realmodel
def test_fold_on_a_real_kivi_cache_within_twice_torch_error():
    """Qwen2.5-Coder-0.5B's own KIVI-4 cache after 2048 tokens of WikiText-2 (outlier key channels from k_proj's
    bias, attention sinks): at the first decode step, every layer's folded output is within twice float16 torch's
    error against float64 attention over the same store. One float16 rounding of ``q * s`` per key scale row (the
    kernel before the ``hi + lo`` split) was 4.9x here (2.9x at layer 7 with the float32 tail the CPU model leaves)."""
    from kvbits.cache import QuantizedKVCache, cache_kwargs, observe_fused_decode
    from kvbits.evaluate.data import load_text, make_windows, tokenize
    from kvbits.evaluate.models import load_model
    from kvbits.schemes import get_scheme

    try:
        lm = load_model("qwen2.5-coder-0.5b", device=DEVICE)
        text = load_text("wikitext2")
    except (RuntimeError, FileNotFoundError) as exc:
        unavailable(f"offline model or text not available: {exc}")
    ids = make_windows(tokenize(text, lm.tokenizer), 2049, 1).to(DEVICE)
    model, n_layers = lm.model, lm.model.config.num_hidden_layers
    cache = QuantizedKVCache(config=model.config, scheme=get_scheme("kivi-4"), fused_decode=True)
    ratios: list[float] = []

    def check(layer, query, store, scaling):
        q = query.half()
        # the tail as a float16 model holds it (the float32 model leaves it float32, which every kernel rounds)
        store = dataclasses.replace(store, key_full=store.key_full.half(), value_full=store.value_full.half())
        assert triton_fold.fold_supported(store, q) is None
        truth = decode_attention_reference(q.double(), store, scaling, dtype=torch.float64)
        err_pt = max_err(decode_attention_reference(q, store, scaling, dtype=torch.float16), truth)
        ratios.append(max_err(triton_fold.decode_attention_fold(q, store, scaling), truth) / err_pt)

    with torch.no_grad(), observe_fused_decode(model, check):
        model(ids[:, :-1], **cache_kwargs(cache, model), use_cache=True)
        model(ids[:, -1:], **cache_kwargs(cache, model), use_cache=True)
    assert len(ratios) == n_layers  # one fused step per layer
    assert max(ratios) <= 2.0, {i: round(r, 2) for i, r in enumerate(ratios) if r > 2.0}


def _run_ptx(asm: str, word: int) -> tuple[int, int]:
    """The PTX subset of ``triton_fold``'s conversion blocks (``mov`` / ``and`` / ``shr`` ``.b32``, ``prmt.b32`` in its
    default mode, ``sub.f16x2``) on 32-bit values: the block's outputs ``($0, $1)`` for input ``$2 = word``."""
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm
    regs = {"$2": word}

    def val(x: str) -> int:
        return int(x, 0) if x[0].isdigit() else regs[x]

    def f16(bits: int) -> np.float16:
        return np.array([bits], np.uint16).view(np.float16)[0]

    for stmt in filter(None, (x.strip() for x in body[1:-1].split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "shr.b32":  # .b32: a logical shift
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i) of {b, a}, a's bytes 0-3, b's 4-7
            src, sel, out = val(a[1]) | (val(a[2]) << 32), val(a[3]), 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                assert nib < 8, "sign-replicating selectors are not emulated"
                out |= ((src >> (8 * nib)) & 0xFF) << (8 * i)
            regs[a[0]] = out
        elif op == "sub.f16x2":  # per 16-bit half, IEEE float16 (numpy rounds each operation once)
            x, y, out = val(a[1]), val(a[2]), 0
            for sh in (0, 16):
                d = np.float16(f16((x >> sh) & 0xFFFF) - f16((y >> sh) & 0xFFFF))
                out |= int(np.array([d]).view(np.uint16)[0]) << sh
            regs[a[0]] = out
        else:
            raise AssertionError(f"unexpected PTX {stmt!r}")
    return regs["$0"], regs["$1"]


@needs_triton
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("center", [False, True])
def test_fold_ptx_conversion_gives_the_codes(bits: int, center: bool):
    """The inline-PTX blocks the compiled kernel converts codes with (never run by the interpreter), executed by a
    small PTX emulator: for every part ``k`` and 4 bytes per 32-bit register (Triton's ``pack=4``: element ``i`` in
    byte ``i``, outputs two float16 per register, low half first), the four float16 are the part's codes, less
    ``2**(bits-1)`` when centred, exactly: what the interpreter's branch computes."""
    rng = np.random.default_rng(bits * 2 + center)
    words = [0, 0xFFFFFFFF, 0x01234567, 0x89ABCDEF, *rng.integers(0, 2**32, 64).tolist()]
    m = triton_fold._PTX_M0 if not center else getattr(triton_fold, f"_PTX_M{bits}")
    off = (1 << (bits - 1)) if center else 0
    for k in range(8 // bits):
        part = getattr(triton_fold, f"_P{bits}_{k}")  # what _ptx_part(b, k, bits, m) assembles
        asm = triton_fold._PTX_HEAD.value + m.value + part.value + triton_fold._PTX_TAIL.value
        for w in words:
            lo, hi = _run_ptx(asm, w)
            got = [np.array([(r >> sh) & 0xFFFF], np.uint16).view(np.float16)[0] for r in (lo, hi) for sh in (0, 16)]
            want = [(((w >> (8 * i)) >> (k * bits)) & ((1 << bits) - 1)) - off for i in range(4)]
            assert [float(x) for x in got] == want, (bits, k, center, hex(w), got, want)


@needs_triton
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fold_ptx_conversion_centres_symmetric_codes_on_their_zero(bits: int):
    """The PTX blocks for symmetric value codes (``_PTX_S{bits}``) give the part's codes less ``2**(bits-1) - 1``,
    exactly (the emulator of ``test_fold_ptx_conversion_gives_the_codes``)."""
    rng = np.random.default_rng(bits)
    words = [0, 0xFFFFFFFF, 0x01234567, 0x89ABCDEF, *rng.integers(0, 2**32, 64).tolist()]
    m = getattr(triton_fold, f"_PTX_S{bits}")
    for k in range(8 // bits):
        asm = triton_fold._PTX_HEAD.value + m.value + getattr(triton_fold, f"_P{bits}_{k}").value
        asm += triton_fold._PTX_TAIL.value
        for w in words:
            lo, hi = _run_ptx(asm, w)
            got = [np.array([(r >> sh) & 0xFFFF], np.uint16).view(np.float16)[0] for r in (lo, hi) for sh in (0, 16)]
            want = [(((w >> (8 * i)) >> (k * bits)) & ((1 << bits) - 1)) - ((1 << (bits - 1)) - 1) for i in range(4)]
            assert [float(x) for x in got] == want, (bits, k, hex(w), got, want)
