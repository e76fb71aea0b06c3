"""Integer zero-points (``TensorSpec.integer_zero``) and the ``vllm-int4`` preset (vLLM's int4_per_token_head).

The reference below is vLLM's write kernel (``_reshape_cache_int4_kernel``) restated in float64 torch: a
float32 scale ``max((max - min) / 15, 1e-6)``, an integer zero-point ``round(-min / scale)`` and codes
``round(x / scale + zp)``, both rounded half away from zero and clamped to ``[0, 15]``.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvbits.cli import _spec_str
from kvbits.quant import quantize, unpack_bits
from kvbits.quant.rotate import rotate, rotation_matrix, unrotate
from kvbits.schemes import KVScheme, TensorSpec, get_scheme
from kvbits.schemes.accounting import quantized_bytes

INT_ZERO = TensorSpec(kind="int", bits=4, fmt=None, integer_zero=True)
FLOAT_ZERO = TensorSpec(kind="int", bits=4, fmt=None)


def half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def vllm_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's per-(token, head) INT4 write for ``x`` ``(..., D)``: ``(codes, zp, scale, unclamped codes)``."""
    xf = x.double()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).float().clamp_min(1e-6).double()
    zp = half_away(-lo / scale).clamp(0, 15)
    raw = half_away(xf / scale + zp)
    return raw.clamp(0, 15), zp, scale, raw


def rows(seed: int = 0) -> torch.Tensor:
    """``(1, 4, 64, 32)``: Gaussian rows around 0, rows shifted so their range excludes 0 on either side,
    a constant row and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 64, 32, generator=g)
    x[:, 1] = x[:, 1] * 0.3 + torch.linspace(-0.5, 0.5, 64)[:, None]  # ranges that straddle 0 unevenly
    x[:, 2, :8] = x[:, 2, :8].abs() + 2.0  # all positive: zp clamps to 0
    x[:, 2, 8:16] = -x[:, 2, 8:16].abs() - 2.0  # all negative: zp clamps to 15
    x[:, 3, 0] = 0.75  # constant row: range 0, scale 1e-6
    x[:, 3, 1] = 0.0
    return x


def codes_of(qt) -> torch.Tensor:
    return unpack_bits(qt.data, 4, qt.shape[-1]).long()


def test_codes_and_zero_points_follow_vllms_write_kernel():
    x = rows()
    qt = quantize(x, INT_ZERO)
    want, zp, scale, _ = vllm_int4(x)
    got = codes_of(qt)
    # float16 scale (rounded up) against vLLM's float32: a code may differ by one where x sits on a tie
    diff = (got - want.long()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (diff > 0).float().mean()
    # the stored zero is -zp * scale in float16: zp to within 15 * 2**-11
    z = (-qt.zero.double() / qt.scale.double()).reshape(zp.shape)
    assert (z - zp).abs().max() < 0.01
    # decoded: (code - zp) * scale within 2 % of a step of vLLM's where the codes agree, rows with a range
    # (the constant row's 1e-6 scale is a float16 subnormal: 7 % off, 1e-7 in all)
    dec = qt.dequantize(torch.float64)
    want_dec = (want - zp) * scale
    close = (dec - want_dec).abs() <= 0.02 * scale.expand_as(dec)
    assert close[(diff == 0) & (scale > 1e-4)].all() and (dec - want_dec)[diff == 0].abs().max() < 0.02


def test_a_zero_point_of_code_zero_is_positive_zero():
    """Rows whose minimum is 0 or above have ``z = 0``: the stored zero-point is +0.0. Before, ``-z * scale``
    stored -0.0 (sign bit set) on the torch path, where the Triton kernel stores +0.0, so the two paths' bytes
    differed on every such row (``torch.equal`` reads them as equal and did not see it)."""
    x = torch.rand(2, 3, 5, 16, generator=torch.Generator().manual_seed(3)) + 0.5  # every row > 0: z = 0
    qt = quantize(x, INT_ZERO)
    assert (qt.zero == 0).all()
    assert not (qt.zero.view(torch.int16) == -32768).any(), "a -0.0 zero-point"


def vllm_signs(d: int) -> torch.Tensor:
    """vLLM's RHT signs restated: ``2 * bernoulli(0.5) - 1`` from a CPU generator seeded ``0x9E3779B9``."""
    gen = torch.Generator(device="cpu").manual_seed(0x9E3779B9)
    return (2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0).double()


def butterfly(y: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform over the last dim (vLLM's ``fast_hadamard_transform``
    torch fallback, tier 3), in float64."""
    y, d, h = y.double(), y.shape[-1], 1
    while h < d:
        yv = y.view(*y.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack([yv[..., 0, :] + yv[..., 1, :], yv[..., 0, :] - yv[..., 1, :]], dim=-2).reshape(y.shape)
        h <<= 1
    return y


def vllm_rht(x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``single_rht``: ``H (s * x)``; its inverse is ``H y * s``, then divided by ``D``."""
    return butterfly(x.double() * vllm_signs(x.shape[-1]))


@pytest.mark.parametrize("d", [64, 128])
def test_hadamard_vllm_is_vllms_transform(d):
    """``rotate(x, "hadamard-vllm")`` is vLLM's RHT divided by ``sqrt(D)``; kvbits' own signs are another
    matrix (the same rows up to sign)."""
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    torch.testing.assert_close(rotate(x, "hadamard-vllm") * d**0.5, vllm_rht(x), rtol=0, atol=1e-10)
    torch.testing.assert_close(unrotate(rotate(x, "hadamard-vllm"), "hadamard-vllm"), x, rtol=0, atol=1e-12)
    ours = rotation_matrix(d, "hadamard", dtype=torch.float64)
    theirs = rotation_matrix(d, "hadamard-vllm", dtype=torch.float64)
    torch.testing.assert_close(ours.abs(), theirs.abs())
    assert not torch.equal(ours, theirs)


def test_vllm_int4_preset_stores_vllms_codes():
    """The preset's codes of ``x`` are vLLM's codes of its rotated ``x`` (to a tie; vLLM's scale is
    ``sqrt(D)`` larger and float32, which moves no code but at a tie), and decode back to ``x``'s basis."""
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(7))
    spec = get_scheme("vllm-int4").key
    qt = quantize(x, spec)
    want, zp, scale, _ = vllm_int4(vllm_rht(x))
    diff = (codes_of(qt) - want.long()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (diff > 0).float().mean()
    # what vLLM's attention reads back in x's basis: its inverse RHT (the butterfly, then the signs) over D
    vllm_dec = butterfly((want - zp) * scale) * vllm_signs(64) / 64
    dec = qt.dequantize(torch.float64)
    err = (dec - x.double()).pow(2).mean()
    assert 0 < err < 0.02 * x.pow(2).mean()  # INT4: a real error
    # and the same one as vLLM's, to the odd tie code (another sign vector's error is independent: 2x err)
    assert (dec - vllm_dec).pow(2).mean() < 0.05 * err


def test_ranges_that_exclude_zero_clip_and_are_counted():
    """A row whose values share a sign gets zp clamped to 0 or 15: everything past 15 steps from 0 clips to
    the last code. The clipped count is the reference's out-of-range codes; the error is seen, not hidden."""
    x = rows()
    qt = quantize(x, INT_ZERO)
    _, _, scale, raw = vllm_int4(x)
    out_of_range = ((raw < 0) | (raw > 15)).sum().item()
    assert out_of_range > 0 and int(qt.clipped) == out_of_range
    err = (qt.dequantize(torch.float32) - x).abs()
    # the shifted rows lose about their offset (2.0 and more); the float zero-point (the minimum) keeps
    # every row within half a step
    assert err[0, 2, :16].amax(-1).min() > 1.5  # each row's largest |x| decodes about 2.0 short
    ref = quantize(x, FLOAT_ZERO)
    assert int(ref.clipped) == 0
    assert (ref.dequantize(torch.float32) - x).abs()[0, 2, :16].max() < 0.6 * scale[0, 2, :16].max()


def test_ranges_around_zero_stay_within_half_a_step():
    """Where a row's range holds 0, the grid anchored at 0 still covers it to within half a step (a little
    more for the float16 zero): the end a rounded zp shortens loses less than half a step, which rounds to
    the last code (only an exact tie rounds past it, and is counted); a constant row decodes to about 0
    (vLLM's 1e-6 floor)."""
    x = rows()[:, :2]
    around = (x.amin(-1) < 0) & (x.amax(-1) > 0)
    assert around.float().mean() > 0.9  # some of head 1's shifted rows lie above 0: left out
    qt = quantize(x, INT_ZERO)
    err = (qt.dequantize(torch.float32) - x).abs()
    step = qt.scale.float().reshape(1, 2, 64, 1)
    assert (err <= 0.51 * step)[around].all()
    assert ((err > 0.51 * step).any(-1) == ~around).all()  # the others: clipped past the grid's far end
    const = quantize(rows()[:, 3:, :2], INT_ZERO).dequantize(torch.float32)
    assert const[0, 0, 1].abs().max() == 0  # the zero row
    assert const[0, 0, 0].abs().max() < 1e-4  # 0.75 everywhere: codes clamp, as vLLM's do


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rows_within_the_input_bound_decode_within_float16(bits):
    """A level the codes reach lies up to half a step past the range, so an integer-zero spec's input bound is
    65504 / (1 + (1 + 2**-10) / (2**bits - 1)) (61406 at 4 bits), and within it every row decodes finite.

    Before, the bound was float16's 65504 and rows it accepted decoded to inf: int4 ``[-1000, 65504]`` (scale
    4436, ``z`` 0) decoded 65504 as 66540, inf in float16; ``[-65504, 0]`` stored the zero-point -65520, -inf,
    and the whole row decoded to -inf. Now ``quantize`` and the cache refuse them, naming the bound."""
    from kvbits.cache import QuantizedKVLayer
    from kvbits.cache.checks import input_bound
    from kvbits.quant.affine import integer_zero_bound

    spec = TensorSpec(kind="int", bits=bits, fmt=None, integer_zero=True)
    bound = integer_zero_bound(bits)
    assert input_bound(spec)[0] == bound < 65504.0 and input_bound(FLOAT_ZERO)[0] == 65504.0
    assert round(integer_zero_bound(4), 2) == 61406.25
    g = torch.Generator().manual_seed(bits)
    b = bound * (1 - 2.0**-23)  # the bound, as a float32 at most it
    lo, hi = -torch.rand(4096, generator=g) * b, torch.rand(4096, generator=g) * b
    lo[:1024], hi[1024:2048] = -b, b  # one end at the bound, the other anywhere
    lo[2048:3072] = torch.rand(1024, generator=g) * b  # ranges that exclude 0: z clamps to 0 or to the top
    hi[3072:] = -torch.rand(1024, generator=g) * b
    x = torch.stack([torch.minimum(lo, hi), torch.maximum(lo, hi)], -1).reshape(1, 1, 4096, 2)
    x = torch.cat([x, torch.zeros(1, 1, 4096, 14)], -1)
    for xx in (x, x.half().float().clamp(-b, b)):
        qt = quantize(xx, spec)
        assert torch.isfinite(qt.zero).all() and torch.isfinite(qt.dequantize(torch.float16)).all()
    for row in ((-1000.0, 65504.0), (-65504.0, 0.0)):
        k = torch.zeros(1, 1, 1, 16)
        k[..., :2] = torch.tensor(row)
        with pytest.raises(ValueError, match=f"beyond {bound:.6g}: integer zero-points"):
            quantize(k, spec)
        layer = QuantizedKVLayer(KVScheme("iz", key=spec, value=spec), fused_decode=False, checks="eager")
        with pytest.raises(ValueError, match="integer zero-points put a level"):
            layer.update(k, torch.zeros_like(k))
    # the float zero-point format still takes float16's whole range
    assert torch.isfinite(quantize(k, FLOAT_ZERO).dequantize(torch.float16)).all()


def test_bytes_are_vllms_four_bits_and_one_float32_per_token_and_head():
    B, H, n, D = 2, 3, 16, 64
    x = torch.randn(B, H, n, D)
    for spec in (INT_ZERO, get_scheme("vllm-int4").key):
        qt = quantize(x, spec)
        assert qt.nbytes == quantized_bytes(spec, n, H, D) * B == B * H * n * (D // 2 + 4)
        assert qt.nbytes == quantize(x, FLOAT_ZERO).nbytes


def test_vllm_int4_preset_is_rotated_and_decodes_close():
    """The preset quantizes the Hadamard-rotated rows with integer zero-points and rotates back; its error is
    that of the float zero-point format to within a few percent (the grids differ by a shift)."""
    s = get_scheme("vllm-int4")
    assert s.key == s.value and s.key.rotate == "hadamard-vllm" and s.key.integer_zero
    assert (s.sinks, s.residual, s.block) == (0, 0, 1)
    x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(3))
    mse = {
        name: (quantize(x, spec).dequantize(torch.float32) - x).pow(2).mean().item()
        for name, spec in (("int", s.key), ("float", get_scheme("int4-token-hadamard").key))
    }
    assert 0 < mse["int"] < 1.1 * mse["float"], mse
    assert mse["int"] > 0.9 * mse["float"], mse


def test_spec_rules_and_json():
    for kw in (
        {"kind": "nuq", "bits": 4, "fmt": None},
        {"kind": "fp8", "bits": 8, "fmt": "e4m3"},
        {"kind": "int", "bits": 4, "fmt": None, "symmetric": True},
        {"kind": "int", "bits": 4, "fmt": None, "granularity": "channel", "static": True},
    ):
        with pytest.raises(ValueError, match="integer_zero applies to dynamic asymmetric integer specs"):
            TensorSpec(**kw, integer_zero=True)
    with pytest.raises(TypeError, match="integer_zero must be a bool"):
        TensorSpec(kind="int", bits=4, fmt=None, integer_zero="true")
    assert "integer_zero" not in FLOAT_ZERO.to_dict()  # older specs keep their JSON and hashes
    assert INT_ZERO.to_dict()["integer_zero"] is True
    scheme = KVScheme("x", key=INT_ZERO, value=FLOAT_ZERO)
    assert KVScheme.from_json(scheme.to_json()) == scheme
    assert json.loads(scheme.to_json())["key"]["integer_zero"] is True
    assert _spec_str(get_scheme("vllm-int4").key) == "int4 asym int-zero per-token +hadamard-vllm"

