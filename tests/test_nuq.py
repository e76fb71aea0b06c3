"""Non-uniform quantization (`kvbits.quant.nuq`) through `quantize`, static per-channel scales, the
outlier score, the kvquant presets and their byte accounting.

Layer 1: exact codes against hand-written references, packing, degenerate groups. Layer 2: a
uniform codebook reproduces the integer quantizer; static scales do not depend on the block length
(so tokens can be flushed one at a time); clipping against a static range is counted.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbits.quant import quantize, unpack_bits
from kvbits.quant.nuq import check_codebook, uniform_codebook
from kvbits.quant.tensor import codebook_inputs, fake_quantize
from kvbits.schemes import KVScheme, TensorSpec, average_bits, get_scheme, layer_bytes
from kvbits.schemes.accounting import fixed_layer_bytes, per_block_meta_bytes, quantized_bytes

CB2 = torch.tensor([-1.0, -0.25, 0.5, 1.0], dtype=torch.float16)


def nuq(bits: int, granularity: str = "token", group_size: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="nuq", bits=bits, fmt=None, granularity=granularity, group_size=group_size, **kw)


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x.double() - y.double()) ** 2).mean())


# ------------------------------------------------------------------------------ exact codes by hand


def test_nuq_codes_by_hand_per_token():
    # row 0: zero 0, range 4  -> u = [-1, -0.5, 0, 1]     -> midpoints [-0.625, 0.125, 0.75] -> [0, 1, 1, 3]
    # row 1: zero -2, range 8 -> u = [-1, -0.75, 0.25, 1]                                  -> [0, 0, 2, 3]
    x = torch.tensor([[0.0, 1, 2, 4], [-2, -1, 3, 6]]).reshape(1, 1, 2, 4)
    qt = quantize(x, nuq(2), codebook=CB2)
    codes = unpack_bits(qt.data, 2, 4)
    assert codes.reshape(2, 4).tolist() == [[0, 1, 1, 3], [0, 0, 2, 3]]
    assert qt.scale.flatten().tolist() == [4, 8] and qt.zero.flatten().tolist() == [0, -2]
    assert qt.dequantize().reshape(2, 4).tolist() == [[0, 1.5, 1.5, 4], [-2, -2, 4, 6]]
    assert qt.clipped == 0


def test_nuq_codes_by_hand_symmetric_and_ties():
    # symmetric: scale = max|x| = 2 -> u = [-1, 0.5, 0.25, 1, 0.125]; 0.125 is a midpoint -> lower entry
    x = torch.tensor([-2.0, 1, 0.5, 2, 0.25, 0, 0, 0]).reshape(1, 1, 1, 8)
    qt = quantize(x, nuq(2, symmetric=True), codebook=CB2)
    assert qt.zero is None and qt.scale.flatten().tolist() == [2]
    assert unpack_bits(qt.data, 2, 8).flatten().tolist() == [0, 2, 2, 3, 1, 1, 1, 1]
    assert qt.dequantize().flatten().tolist() == [-2, 1, 1, 2, -0.5, -0.5, -0.5, -0.5]


def test_nuq_codes_match_reference_and_pack_round_trip():
    x = gaussian(2, 3, 5, 20)
    for bits in (2, 3, 4):
        cb = torch.sort(
            torch.rand(2**bits, generator=torch.Generator().manual_seed(bits)) * 2 - 1
        ).values.half()
        qt = quantize(x, nuq(bits), codebook=cb)
        assert qt.data.dtype == torch.uint8 and qt.data.shape == (2, 3, 5, math.ceil(20 * bits / 8))
        codes = unpack_bits(qt.data, bits, 20)
        zero, scale = qt.zero.float().reshape(2, 3, 5, 1), qt.scale.float().reshape(2, 3, 5, 1)
        u = (x - zero) * 2 / scale - 1
        ref = (u.unsqueeze(-1) - cb.float()).abs().argmin(-1)  # nearest entry, without bucketize
        assert torch.equal(codes.long(), ref)
        from kvbits.quant import pack_bits

        assert torch.equal(pack_bits(codes, bits), qt.data)


def test_constant_and_zero_groups_decode_exactly():
    cb = uniform_codebook(3)
    for value in (0.0, 1.5, -3.25):
        x = torch.full((1, 2, 4, 16), value)
        for spec in (nuq(3), nuq(3, "channel", 4), nuq(3, symmetric=True)):
            deq = quantize(x, spec, codebook=cb).dequantize()
            assert bool(torch.isfinite(deq).all())
            assert torch.equal(deq, x), (spec, value)


def test_codebook_required_and_validated():
    x = gaussian(1, 1, 2, 8)
    with pytest.raises(ValueError, match="needs codebook="):
        quantize(x, nuq(2))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        quantize(x, nuq(2), codebook=uniform_codebook(3))
    with pytest.raises(TypeError, match="float16"):
        quantize(x, nuq(2), codebook=uniform_codebook(2).float())
    with pytest.raises(ValueError, match="sorted"):
        check_codebook(CB2.flip(0), 2)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        check_codebook(CB2 * 2, 2)
    qt = quantize(x, nuq(2), codebook=CB2)
    qt.codebook = None
    with pytest.raises(ValueError, match="needs codebook="):
        qt.dequantize()
    assert torch.equal(qt.dequantize(codebook=CB2), quantize(x, nuq(2), codebook=CB2).dequantize())


# ------------------------------------------------------------------------- uniform codebook == int


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("gran", [("token", None), ("token", 16), ("channel", 32)])
def test_uniform_codebook_reproduces_int(bits, gran):
    x = gaussian(2, 4, 64, 64, seed=bits)
    ispec = TensorSpec(kind="int", bits=bits, fmt=None, granularity=gran[0], group_size=gran[1])
    qi = quantize(x, ispec)
    qn = quantize(x, nuq(bits, *gran), codebook=uniform_codebook(bits))
    e_int, e_nuq = mse(x, qi.dequantize()), mse(x, qn.dequantize())
    # measured ratios 0.99-1.01: float16 entries (e.g. 2/7) and range-vs-step rounding differ slightly
    assert 0.97 < e_nuq / e_int < 1.03, (e_nuq, e_int)
    same = (unpack_bits(qi.data, bits, 64) == unpack_bits(qn.data, bits, 64)).float().mean()
    assert same > 0.99
    assert qn.nbytes == qi.nbytes  # same codes, same metadata (scale + zero-point per group)


def test_error_within_half_gap():
    x = gaussian(1, 2, 8, 32)
    cb = torch.tensor([-1, -0.8, -0.3, 0, 0.1, 0.4, 0.9, 1.0], dtype=torch.float16)
    qt = quantize(x, nuq(3), codebook=cb)
    half_gap = float((cb[1:].float() - cb[:-1].float()).max()) / 2
    bound = half_gap * qt.scale.float().reshape(1, 2, 8, 1) / 2 * (1 + 1e-3)
    assert bool(((qt.dequantize() - x).abs() <= bound).all())


# ----------------------------------------------------------------------- static per-channel scales

STATIC_K = nuq(4, "channel", static=True, outlier_frac=0.01, pre_rope=True)


def _static_params(H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lo = -(torch.rand(H, D, generator=g) + 0.5) * 3
    return (-2 * lo).half(), lo.half()  # range, minimum: channel ranges [lo, -lo]


def test_static_channel_spec_validation():
    with pytest.raises(ValueError, match="group_size must be None"):
        nuq(4, "channel", 32, static=True)
    KVScheme("t", key=STATIC_K, block=1)  # no token group: any block size is fine
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        nuq(4, "channel")  # dynamic per-channel still needs a token group


def test_static_scales_do_not_depend_on_block_length():
    B, H, n, D = 2, 3, 9, 64
    x = gaussian(B, H, n, D)
    scale, zero = _static_params(H, D)
    cb = uniform_codebook(4)
    whole = quantize(x, STATIC_K, static_scale=scale, static_zero=zero, codebook=cb)
    one_by_one = torch.cat(
        [
            quantize(
                x[:, :, t : t + 1],
                STATIC_K,
                static_scale=scale.reshape(1, H, 1, D),
                static_zero=zero.reshape(1, H, 1, D),
                codebook=cb,
            ).dequantize()
            for t in range(n)
        ],
        dim=2,
    )
    assert torch.equal(whole.dequantize(), one_by_one)
    assert whole.static and whole.nbytes == B * quantized_bytes(STATIC_K, n, H, D)
    with pytest.raises(ValueError, match="does not broadcast"):
        quantize(x, STATIC_K, static_scale=scale[:, :10], static_zero=zero[:, :10], codebook=cb)
    with pytest.raises(ValueError, match="static_zero"):
        quantize(x, STATIC_K, static_scale=scale, codebook=cb)


def test_static_clipping_is_counted():
    H, D = 2, 64
    scale, zero = _static_params(H, D)
    spec = nuq(4, "channel", static=True)  # no outliers: every out-of-range entry clips
    x = torch.zeros(1, H, 3, D)
    x[0, 0, 0, 5] = 100.0
    x[0, 0, 0, 6] = 10.0  # same row: beyond the range, but less far out than the 100
    x[0, 1, 1, 9] = float(zero[1, 9]) - 0.01  # just below the calibrated minimum
    qt = quantize(x, spec, static_scale=scale, static_zero=zero, codebook=uniform_codebook(4))
    assert qt.clipped == 3
    deq = qt.dequantize()
    assert deq[0, 0, 0, 5] == pytest.approx(float(zero[0, 5]) + float(scale[0, 5]), rel=1e-3)  # saturates
    # with 1% outliers (1 per 64-channel row) the farthest entry of each row is kept exactly instead
    qo = quantize(x, STATIC_K, static_scale=scale, static_zero=zero, codebook=uniform_codebook(4))
    assert qo.clipped == 1 and qo.dequantize()[0, 0, 0, 5] == 100.0
    assert qo.dequantize()[0, 1, 1, 9] == pytest.approx(float(zero[1, 9]) - 0.01, abs=1e-2)


def test_static_outlier_score_uses_calibrated_ranges():
    # channel 0 is wide (range [-100, 100]), channel 1 narrow ([-1, 1]); the entry 50 in channel 0
    # is in range, the entry 3 in channel 1 is 3 half-ranges out: it is the outlier, not the 50.
    H, D = 1, 8
    lo = torch.full((H, D), -1.0)
    lo[0, 0] = -100
    scale, zero = (-2 * lo).half(), lo.half()
    x = torch.zeros(1, H, 1, D)
    x[..., 0], x[..., 1] = 50.0, 3.0
    spec = nuq(4, "channel", static=True, outlier_frac=0.1)  # 1 outlier per 8 channels
    qt = quantize(x, spec, static_scale=scale, static_zero=zero, codebook=uniform_codebook(4))
    assert qt.outlier_index.flatten().tolist() == [1] and qt.clipped == 0
    dyn = quantize(x, nuq(4, outlier_frac=0.1), codebook=uniform_codebook(4))
    assert dyn.outlier_index.flatten().tolist() == [0]  # per-token values: largest |x|
    # int static specs use the same score
    ispec = TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", static=True, outlier_frac=0.1)
    qi = quantize(x, ispec, static_scale=(scale.float() / 15).half(), static_zero=zero)
    assert qi.outlier_index.flatten().tolist() == [1]


def test_codebook_inputs_are_what_quantize_codes():
    # calibration fits codebooks to codebook_inputs(): it must see exactly the values quantize codes
    x = gaussian(1, 2, 16, 64) * 2
    scale, zero = _static_params(2, 64)
    u, kept = codebook_inputs(x, STATIC_K, static_scale=scale, static_zero=zero)
    cb = uniform_codebook(4)
    qt = quantize(x, STATIC_K, static_scale=scale, static_zero=zero, codebook=cb)
    outliers = torch.zeros_like(kept).scatter_(-1, qt.outlier_index.long(), True)
    assert torch.equal(~kept, outliers)
    nearest = (u.clamp(-1, 1).unsqueeze(-1) - cb.float()).abs().argmin(-1)
    assert torch.equal(unpack_bits(qt.data, 4, 64).long()[kept], nearest[kept])
    assert qt.clipped == int((u[kept].abs() > 1).sum()) > 0


# ---------------------------------------------------------------------- presets and byte accounting


@pytest.mark.parametrize(
    "name,D,bits",
    [
        ("kvquant-4", 64, 4.625),
        ("kvquant-4", 128, 4.5),
        ("kvquant-3", 64, 3.625),
        ("kvquant-3", 128, 3.5),
        ("kvquant-2", 64, 2.625),
        ("kvquant-2", 128, 2.5),
        ("int4-channel-prerope", 64, 4.375),
        ("int4-channel-prerope", 128, 4.25),
        ("int3-channel-prerope", 64, 3.375),
        ("int3-channel-prerope", 128, 3.25),
    ],
)
def test_new_presets_average_bits(name, D, bits):
    # kvquant-4 at D=128: keys 4 + 2 outliers x 24 bits / 128 = 4.375; values 4 + 32/128 (min, range)
    # + 0.375 = 4.625; mean 4.5 (KVQuant reports 4.32 with a cheaper sparse format)
    assert average_bits(get_scheme(name), head_dim=D, n_heads=8) == pytest.approx(bits)


@pytest.mark.parametrize("name", ["kvquant-4", "kvquant-3", "kvquant-2"])
@pytest.mark.parametrize("D", [64, 128])
def test_kvquant_bytes_match_accounting(name, D):
    s = get_scheme(name)
    assert s.key.pre_rope and s.key.static and s.block == 1 and s.sinks == 1 and s.residual == 0
    B, H, n = 2, 3, 5
    scale, zero = _static_params(H, D)
    stored = 0
    for spec, kw in ((s.key, {"static_scale": scale, "static_zero": zero}), (s.value, {})):
        cb = uniform_codebook(spec.bits)
        qt = quantize(gaussian(B, H, n, D), spec, codebook=cb, **kw)
        assert qt.nbytes == B * (quantized_bytes(spec, n, H, D) + per_block_meta_bytes(spec, H))
        stored += qt.nbytes
    # per-layer constants: key scales + zero-points (H x D float16 each) and both codebooks
    fixed = scale.numel() * 2 + zero.numel() * 2 + 2 * (2**s.key.bits) * 2
    assert fixed_layer_bytes(s.key, H, D) + fixed_layer_bytes(s.value, H, D) == fixed
    # the whole layer: 1 sink token in full precision (fp16), every other token flushed at once
    lb = layer_bytes(s, n + 1, batch=B, n_heads=H, head_dim=D)
    assert lb["quantized"] == stored and lb["fixed"] == fixed and lb["full"] == 2 * B * H * D * 2


def test_fake_quantize_passes_codebook():
    x = gaussian(1, 2, 4, 64)
    y = fake_quantize(x, nuq(4), codebook=uniform_codebook(4))
    assert y.dtype == x.dtype and mse(x, y) < 0.02  # step ~ 5/15: uniform error ~ step^2 / 12 = 0.009


def test_asymmetric_range_beyond_float16_is_a_clear_error():
    """The scale of an asymmetric NUQ group is its whole range: [-40000, 40000] overflowed float16 to inf
    and the row decoded to NaN. The stored format stays float16 (the kernels read it): refused instead."""
    x = torch.tensor([-40000.0, 0.0, 1.0, 40000.0]).reshape(1, 1, 1, 4)
    with pytest.raises(ValueError, match="a group spans 80000, beyond float16's 65504"):
        quantize(x, nuq(4), codebook=uniform_codebook(4))
    with pytest.raises(ValueError, match="a group spans 80000"):  # also when only sync is allowed
        quantize(x, nuq(4), codebook=uniform_codebook(4), validate=False)
    edge = torch.tensor([-32752.0, 0.0, 1.0, 32752.0]).reshape(1, 1, 1, 4)  # spans exactly 65504
    assert bool(torch.isfinite(quantize(edge, nuq(4), codebook=uniform_codebook(4)).dequantize()).all())
    sym = quantize(x, nuq(4, symmetric=True), codebook=uniform_codebook(4)).dequantize()
    assert bool(torch.isfinite(sym).all())


def test_a_group_past_float16_itself_says_its_span_not_inf():
    """Values around 4e4 * randn (min below -65504): the float16 zero-point rounded down to -inf and the message
    said "a group spans inf" with advice (symmetric NUQ) alone. Now the span from the data, the group's ends,
    that the values are past float16 themselves, and the choices."""
    from kvbits.quant.nuq import choose_nuq_params

    x = torch.tensor([[-70000.0, 0.0, 1.0, 30000.0], [-1.0, 0.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match="a group spans 100000, beyond float16's 65504 \\(min -70000, max 30000") as info:
        choose_nuq_params(x, (1,))
    said = str(info.value)
    assert "inf" not in said.split("NaN")[0] and "values reach |x| = 70000, past float16's range" in said
    assert "symmetric NUQ" in said and "scale_dtype='fp32'" in said


def test_zero_static_nuq_scale_counts_what_it_clips():
    """kvquant-4 keys with calibrated scales of 0 everywhere: every kept value collapses onto the zero-point
    (4032 of 4096; 64 outliers are stored exactly) and clipped reported 0. Now it reports them."""
    spec = get_scheme("kvquant-4").key
    x = torch.randn(1, 2, 16, 128, generator=torch.Generator().manual_seed(3))
    zeros = torch.zeros(2, 128, dtype=torch.float16)
    qt = quantize(x, spec, static_scale=zeros, static_zero=zeros, codebook=uniform_codebook(4))
    n_outliers = qt.outlier_values.numel()
    assert n_outliers == 2 * 16 * 2
    assert qt.clipped == x.numel() - n_outliers
    assert int((qt.dequantize() == 0).sum()) == qt.clipped  # collapsed onto the zero-point


@pytest.mark.parametrize("lo,hi", [(0.5, 65504.0), (100.0, 65500.0), (3.0, 65504.0)])
def test_dynamic_ranges_at_float16s_end_clip_nothing(lo: float, hi: float):
    """An asymmetric NUQ range reaching float16's end gets its scale capped a float16 step below the range
    (``_stored_scale``: zero + scale within 65504), so the top value lies up to 2**-9 past it in ``u`` and
    decodes to the last entry, 32 away at 65504. That is rounding, as the integer codes' top level: ``clipped``
    counted the row's top values as clipped (2 of 8 here) against a dynamic range, which the Triton quantize
    kernel counts as 0. Now 0, with the same codes and error."""
    x = torch.cat([torch.tensor([lo, hi]), torch.linspace(lo, hi, 6)]).reshape(1, 1, 1, 8).half()
    qt = quantize(x, nuq(4), codebook=uniform_codebook(4))
    assert float(qt.zero) + float(qt.scale) < hi  # the capped scale: the range ends below the top value
    assert qt.clipped == 0
    assert unpack_bits(qt.data, 4, 8).flatten()[1] == 15  # the top value on the last entry
    y = qt.dequantize(torch.float16)
    assert bool(torch.isfinite(y).all())
    assert float((y.float() - x.float()).abs().max()) <= 32.0
    lazy = quantize(x, nuq(4), codebook=uniform_codebook(4), validate=False, sync=False)
    assert int(lazy.clipped) == 0
