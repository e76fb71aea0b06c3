"""Primitive and quantizer layer: `kvbits.quant` and `kvbits.schemes`.

Layer 1 (primitives): exact codes against hand-written references, pack/unpack bijection, round-trip
error <= scale/2, degenerate inputs. Layer 2 (quantizers): SQNR floors on seeded data and relations
between schemes ("more bits => higher SQNR", "per-channel keys beat per-token keys on outlier
channels", "dense-and-sparse helps on heavy tails"). Plus byte accounting and scheme serialisation.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbits.quant import QuantizedTensor, pack_bits, packed_size, quantize, unpack_bits
from kvbits.quant.affine import broadcast_shape, choose_qparams, dequantize_affine, quantize_affine
from kvbits.schemes import (
    KVScheme,
    TensorSpec,
    average_bits,
    get_scheme,
    layer_bytes,
    list_schemes,
    token_split,
)
from kvbits.schemes.accounting import per_block_meta_bytes, quantized_bytes


def int_spec(bits: int, granularity: str = "token", group_size: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity=granularity, group_size=group_size, **kw)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, ``10 log10(sum x^2 / sum (x - y)^2)`` in float64."""
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x**2).sum() / ((x - y) ** 2).sum()))


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def element_scale(qt: QuantizedTensor) -> torch.Tensor:
    """The scale that covers each element, broadcast to ``(B, H, n, D)`` (written out independently
    of ``kvbits.quant.tensor._group`` so the test checks the granularity semantics)."""
    B, H, n, D = qt.shape
    s, spec = qt.scale.float(), qt.spec
    if spec.granularity == "token":
        g = spec.group_size or D
        return s.expand(B, H, n, D // g, g).reshape(B, H, n, D)
    if spec.granularity == "channel":
        G = spec.group_size
        return s.expand(B, H, n // G, G, D).reshape(B, H, n, D)
    return s.expand(B, H, n, D)  # head (B, H, 1, 1) / tensor (B, 1, 1, 1)


# --------------------------------------------------------------------------------------------------
# Layer 1: exact codes against hand-written references (1 x 1 x 2 x 4 tensors, two tokens)
# --------------------------------------------------------------------------------------------------

# (bits, x rows, expected codes, expected scale per token, expected zero-point per token)
# Asymmetric: zero = row min, scale = (max - min) / (2^b - 1), code = round((x - zero) / scale).
ASYM_TOKEN_CASES = [
    (2, [[0, 2.2, 0.4, 3], [-2, 1.5, -0.5, 4]], [[0, 2, 0, 3], [0, 2, 1, 3]], [1, 2], [0, -2]),
    (4, [[0, 7.4, 1, 15], [27, -3, 0.2, 4.6]], [[0, 7, 1, 15], [15, 0, 2, 4]], [1, 2], [0, -3]),
    (8, [[0.26, 0, 127.5, 63.9], [-1, 254, 10.3, 0]], [[1, 0, 255, 128], [0, 255, 11, 1]], [0.5, 1], [0, -1]),
]
# Symmetric: c = 2^(b-1) - 1, scale = amax / c, code = round(x / scale) + c.
SYM_TOKEN_CASES = [
    (2, [[-3, -1, 1.2, 3], [0.5, -0.5, 0.1, -0.2]], [[0, 1, 1, 2], [2, 0, 1, 1]], [3, 0.5]),
    (4, [[-7, -2.4, 0.3, 5.6], [14, 1.2, -3.4, 0]], [[0, 5, 7, 13], [14, 8, 5, 7]], [1, 2]),
    (
        8,
        [[-254, 1.2, 100.9, 254], [0.25, -31.75, 3, 10]],
        [[0, 128, 177, 254], [128, 0, 139, 167]],
        [2, 0.25],
    ),
]


@pytest.mark.parametrize("bits,x,codes,scale,zero", ASYM_TOKEN_CASES)
def test_asymmetric_per_token_codes_by_hand(bits, x, codes, scale, zero):
    xt = torch.tensor(x, dtype=torch.float32).reshape(1, 1, 2, 4)
    qt = quantize(xt, int_spec(bits))
    got = unpack_bits(qt.data, bits, 4).reshape(2, 4)
    assert got.tolist() == codes
    assert qt.scale.dtype == torch.float16 and qt.zero.dtype == torch.float16
    assert qt.scale.flatten().float().tolist() == scale
    assert qt.zero.flatten().float().tolist() == zero
    expected = torch.tensor(codes).float() * torch.tensor(scale)[:, None] + torch.tensor(zero)[:, None]
    assert torch.equal(qt.dequantize().reshape(2, 4), expected)


@pytest.mark.parametrize("bits,x,codes,scale", SYM_TOKEN_CASES)
def test_symmetric_per_token_codes_by_hand(bits, x, codes, scale):
    xt = torch.tensor(x, dtype=torch.float32).reshape(1, 1, 2, 4)
    qt = quantize(xt, int_spec(bits, symmetric=True))
    assert qt.zero is None
    assert unpack_bits(qt.data, bits, 4).reshape(2, 4).tolist() == codes
    assert qt.scale.flatten().float().tolist() == scale
    c = 2 ** (bits - 1) - 1
    expected = (torch.tensor(codes).float() - c) * torch.tensor(scale)[:, None]
    assert torch.equal(qt.dequantize().reshape(2, 4), expected)


def test_packed_bytes_by_hand():
    # 2-bit rows [0,2,0,3], [0,2,1,3]: code i at bits [2i, 2i+2) -> 0 + 2<<2 + 0<<4 + 3<<6 = 200, ... = 216
    x = torch.tensor(ASYM_TOKEN_CASES[0][1]).reshape(1, 1, 2, 4)
    assert quantize(x, int_spec(2)).data.flatten().tolist() == [200, 216]
    # 4-bit row [0,7,1,15] -> bytes 0x70, 0xF1; row [15,0,2,4] -> 0x0F, 0x42
    x = torch.tensor(ASYM_TOKEN_CASES[1][1]).reshape(1, 1, 2, 4)
    assert quantize(x, int_spec(4)).data.flatten().tolist() == [0x70, 0xF1, 0x0F, 0x42]
    # 3-bit codes [0, 0, 7]: bits 6, 7, 8 set -> bytes 0xC0, 0x01 (ceil(9/8) = 2 bytes)
    assert pack_bits(torch.tensor([0, 0, 7]), 3).tolist() == [0xC0, 0x01]
    assert pack_bits(torch.tensor([5, 0, 0, 0, 0, 0, 0, 1]), 3).tolist() == [5, 0, 0x20]


def test_per_channel_codes_by_hand():
    # tokens x channels; one scale per channel over the 3-token group (KIVI keys).
    x = torch.tensor([[0, -1, 5, 2], [3, 2, 5, 0.5], [1, 0, 5, 2]]).reshape(1, 1, 3, 4)
    qt = quantize(x, int_spec(2, "channel", 3))
    assert unpack_bits(qt.data, 2, 4).reshape(3, 4).tolist() == [[0, 0, 0, 3], [3, 3, 0, 0], [1, 1, 0, 3]]
    assert qt.scale.shape == (1, 1, 1, 1, 4)  # (B, H, n/G, 1, D)
    assert qt.scale.flatten().float().tolist() == [1, 1, 0, 0.5]  # constant channel 2 -> scale 0
    assert qt.zero.flatten().float().tolist() == [0, -1, 5, 0.5]
    assert torch.equal(qt.dequantize(), x)  # every value is on its grid


@pytest.mark.parametrize("shapes", [((1, 2, 1, 64), (1, 2, 1, 1)), ((3, 1), (4,)), ((2, 0, 5), (1, 5)), ((), (2, 3)),
                                    ((1, 4, 8, 2, 16), (1, 4, 8, 1, 16), (4, 8, 2, 1))])
def test_broadcast_shape_is_torchs(shapes):
    assert broadcast_shape(*shapes) == torch.broadcast_shapes(*shapes)


def test_broadcast_shape_refuses_what_torch_refuses():
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes((2, 3), (3, 3))
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shape((2, 3), (3, 3))


def test_affine_primitives_by_hand():
    x = torch.tensor([[-1.0, 0.0, 2.0]])
    scale, zero = choose_qparams(x, 2, (-1,))
    assert scale.item() == 1.0 and zero.item() == -1.0
    codes, clipped = quantize_affine(torch.tensor([[-1.0, 0.4, 2.0, 5.0, -3.0]]), scale, zero, 2)
    assert codes.tolist() == [[0, 1, 3, 3, 0]]
    assert clipped.tolist() == [[False, False, False, True, True]]
    assert dequantize_affine(codes, scale, zero, 2, torch.float32).tolist() == [[-1, 0, 2, 2, -1]]


# --------------------------------------------------------------------------------------------------
# Layer 1: bit packing
# --------------------------------------------------------------------------------------------------


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "spec,steps",
    [
        (TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=32), 15),
        (TensorSpec(kind="int", bits=8, fmt=None, granularity="token", group_size=None), 255),
        (TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", group_size=None), 448),
    ],
    ids=["int4-token-g32", "int8-token", "fp8-e4m3-token"],
)
def test_scales_round_up_the_exact_quotient_on_every_device(device: str, spec: TensorSpec, steps: int):
    """Scale = the smallest float16 >= the correctly rounded float32 ``range / steps`` on every device.

    torch on CUDA computes ``tensor / python_number`` as ``tensor * (1 / number)``; on the H200 that moved
    1552 of 32768 int4 group scales by one float16 step away from the CPU's and the Triton kernel's.
    Here the reciprocal product is shown to matter for this data (so the check can fail), then each
    device's scales are compared with the exact quotient computed in float64.
    """
    from kvbits.quant.affine import _round_down_fp16, _round_up_fp16

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 64, 128, generator=g)
    x[..., :4] *= 20
    x = x.half()
    xf = x.float()
    if spec.kind == "fp8":
        span = xf.abs().amax(-1)
    else:
        grouped = xf.reshape(*x.shape[:3], -1, spec.group_size or x.shape[-1])
        span = grouped.amax(-1) - _round_down_fp16(grouped.amin(-1)).float()
    exact = _round_up_fp16((span.double() / steps).float())
    reciprocal = _round_up_fp16(span * torch.tensor(1 / steps, dtype=torch.float32))
    assert (exact != reciprocal).any(), "this data does not tell the two divisions apart"
    got = quantize(x.to(device), spec).scale.cpu().reshape(exact.shape)
    assert torch.equal(got, exact)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 5, 7, 9, 13, 63, 65])
def test_pack_unpack_bijection(bits, n):
    g = torch.Generator().manual_seed(1000 * bits + n)
    codes = torch.randint(0, 2**bits, (3, 2, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, math.ceil(n * bits / 8)) and packed_size(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    # injective: changing one code changes the packed bytes
    other = codes.clone()
    other[0, 0, n // 2] ^= 1
    assert not torch.equal(pack_bits(other, bits), packed)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_byte_pattern_unpacks_and_repacks(bits):
    # n a multiple of 8: no padding bits, so pack o unpack is the identity on all byte strings.
    n = 16
    packed = torch.randint(
        0, 256, (5, packed_size(n, bits)), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8
    )
    assert torch.equal(pack_bits(unpack_bits(packed, bits, n), bits), packed)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 65])
def test_bytewise_unpack_reads_the_little_endian_words(bits, n):
    """2- and 4-bit codes are unpacked byte by byte (no 64-bit words); the layout is still ``pack_bits``'s
    word layout: code ``i`` of each 8-code word at bits ``[b*i, b*(i+1))`` of its little-endian bytes."""
    packed = torch.randint(0, 256, (2, 3, packed_size(n, bits)), generator=torch.Generator().manual_seed(n),
                           dtype=torch.uint8)  # fmt: skip
    flat = packed.reshape(-1, packed.shape[-1]).tolist()
    want = []
    for row in flat:
        value = int.from_bytes(bytes(row), "little")  # the whole row as one little-endian integer
        want.append([(value >> (bits * i)) & ((1 << bits) - 1) for i in range(n)])
    got = unpack_bits(packed, bits, n)
    assert got.dtype == torch.uint8 and got.is_contiguous() and got.shape == (2, 3, n)
    assert got.reshape(-1, n).tolist() == want


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 5)
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="packed bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 4)
    # a scalar has no last dim to pack along, and a row can not hold -2 codes: IndexError / "expected -1 packed
    # bytes" before
    for bits in (3, 8):
        with pytest.raises(ValueError, match="codes must have at least 1 dim"):
            pack_bits(torch.tensor(5), bits)
    with pytest.raises(ValueError, match="packed must have at least 1 dim"):
        unpack_bits(torch.tensor(5, dtype=torch.uint8), 4, 2)
    with pytest.raises(ValueError, match=r"n \(codes per row\) must be >= 0, got -2"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 4, -2)


@pytest.mark.parametrize(
    "bits,codes",
    [(2, [5, 0, 0, 0]), (4, [3, 17, 0, 0]), (3, [-1, 0, 0, 0, 0, 0, 0, 0]), (8, [300, 0]), (8, [-2, 0])],
)
def test_pack_rejects_codes_out_of_range(bits, codes):
    """An out-of-range code used to spill into its neighbours' bits (2-bit [5, 0] unpacked as [1, 1])."""
    with pytest.raises(ValueError, match=rf"{bits}-bit codes must be in \[0, {2**bits - 1}\]"):
        pack_bits(torch.tensor([codes]), bits)
    # the opt-out (quantize's hot path, whose codes are clamped) packs without reading the values
    assert pack_bits(torch.tensor([codes]), bits, check_range=False).dtype == torch.uint8


@pytest.mark.parametrize("bits", [0, 1, 5, 9, 16, 2.0, True])
def test_affine_primitives_reject_unsupported_bits(bits):
    """1-bit symmetric codes have no level (scale inf, NaN out); 9+ bits overflow the uint8 codes."""
    x = torch.linspace(-1, 1, 16).reshape(1, 16)
    scale, zero = torch.ones(1, 1, dtype=torch.float16), torch.full((1, 1), -1.0, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 8\)"):
        choose_qparams(x, bits, (-1,))
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_affine(x, scale, zero, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        dequantize_affine(torch.zeros(1, 16, dtype=torch.uint8), scale, zero, bits, torch.float32)


# --------------------------------------------------------------------------------------------------
# Layer 1: round-trip error bound for every granularity
# --------------------------------------------------------------------------------------------------

GRANULARITIES = [
    ("token", None),
    ("token", 16),
    ("channel", 8),
    ("channel", 32),
    ("head", None),
    ("tensor", None),
]


@pytest.mark.parametrize("gran,group", GRANULARITIES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip_error_within_half_scale(gran, group, bits, symmetric):
    x = gaussian(2, 3, 32, 64, seed=bits) * 3 + 0.5
    qt = quantize(x, int_spec(bits, gran, group, symmetric=symmetric))
    assert qt.clipped == 0  # dynamic scales cover the data
    err = (qt.dequantize() - x).abs()
    bound = element_scale(qt) / 2
    # fp32 slack: (x - zero) / scale and code * scale + zero are each rounded once in float32
    assert bool((err <= bound * (1 + 1e-5) + 1e-6 * (1 + x.abs())).all()), float((err - bound).max())


# --------------------------------------------------------------------------------------------------
# Layer 2: SQNR floors and relations
# --------------------------------------------------------------------------------------------------

# Measured on gaussian(2, 4, 128, 64, seed=0), torch 2.13 CPU (asymmetric / symmetric, dB):
#   per-token      int8 45.6/44.5  int4 21.0/19.4  int3 14.3/12.0  int2 7.0/2.9
#   token g32      int8 46.7/45.5  int4 22.1/20.3  int3 15.5/12.9  int2 8.1/3.7
#   channel G32    int8 46.7/45.4  int4 22.1/20.2  int3 15.5/12.9  int2 8.1/3.6
#   head           int8 41.1/40.6  int4 16.5/15.5  int3  9.8/ 8.1  int2 2.3/0.6
#   tensor         int8 40.3/39.9  int4 15.7/14.7  int3  9.0/ 7.3  int2 1.3/0.4
# Floors sit ~2-3 dB under the measured values (asymmetric).
SQNR_FLOORS = {
    ("token", None): {8: 43, 4: 18, 3: 12, 2: 5},
    ("token", 32): {8: 44, 4: 19, 3: 13, 2: 6},
    ("channel", 32): {8: 44, 4: 19, 3: 13, 2: 6},
    ("head", None): {8: 38, 4: 14, 3: 7.5, 2: 1},
    ("tensor", None): {8: 38, 4: 13, 3: 7, 2: 0.5},
}


@pytest.mark.parametrize("gran,group", list(SQNR_FLOORS))
def test_sqnr_floors_and_more_bits_is_better(gran, group):
    x = gaussian(2, 4, 128, 64, seed=0)
    got = {b: sqnr_db(x, quantize(x, int_spec(b, gran, group)).dequantize()) for b in (8, 4, 3, 2)}
    for b, floor in SQNR_FLOORS[(gran, group)].items():
        assert got[b] > floor, f"int{b} {gran}: {got[b]:.2f} dB <= floor {floor} dB"
    # each extra bit is worth ~6 dB (uniform quantizer); require at least 4 dB per bit
    assert got[8] - got[4] > 16 and got[4] - got[3] > 4 and got[3] - got[2] > 4, got


def test_symmetric_sqnr_floors():
    x = gaussian(2, 4, 128, 64, seed=0)
    floors = {8: 42, 4: 17, 3: 10, 2: 1.5}
    for b, floor in floors.items():
        s = sqnr_db(x, quantize(x, int_spec(b, symmetric=True)).dequantize())
        assert s > floor, (b, s)


def outlier_channel_keys(seed: int = 0) -> torch.Tensor:
    """Keys ``(1, 4, 128, 64)`` with four channels scaled x20 (the structure of real keys, KIVI §3)."""
    x = gaussian(1, 4, 128, 64, seed=seed)
    x[..., [3, 17, 40, 51]] *= 20
    return x


@pytest.mark.parametrize("bits,margin", [(8, 4.0), (4, 4.0), (2, 4.0)])
def test_per_channel_keys_beat_per_token_on_outlier_channels(bits, margin):
    # measured (dB, per-token vs per-channel G=32): int8 40.1 vs 46.6, int4 15.4 vs 22.0, int2 1.5 vs 8.0
    x = outlier_channel_keys()
    tok = sqnr_db(x, quantize(x, int_spec(bits)).dequantize())
    chan = sqnr_db(x, quantize(x, int_spec(bits, "channel", 32)).dequantize())
    assert chan > tok + margin, (tok, chan)


def test_dense_and_sparse_outliers_exact_and_helpful():
    # heavy-tailed rows: Student-t with 2 dof = z / sqrt(chi2_2 / 2), seeded; values rounded to fp16
    # so "exact" means bit-exact
    g = torch.Generator().manual_seed(7)
    z = torch.randn(1, 2, 64, 64, generator=g)
    chi2 = torch.randn(1, 2, 64, 64, 2, generator=g).pow(2).sum(-1)
    x = (z / (chi2 / 2).sqrt()).half().float()
    plain = quantize(x, int_spec(4))
    sparse = quantize(x, int_spec(4, outlier_frac=0.05))  # ceil(0.05 * 64) = 4 per row
    assert sparse.outlier_values.shape == (1, 2, 64, 4) and sparse.outlier_index.dtype == torch.uint8
    deq = sparse.dequantize()
    idx = sparse.outlier_index.long()
    assert torch.equal(deq.gather(-1, idx), x.gather(-1, idx))
    # the kept entries are the top-|x| of each row
    assert torch.equal(x.abs().gather(-1, idx).amin(-1), x.abs().topk(4, dim=-1).values.amin(-1))
    # measured: 16.7 dB plain vs ~27 dB with 5% outliers
    assert sqnr_db(x, deq) > sqnr_db(x, plain.dequantize()) + 5


def test_outliers_are_kept_in_float16_not_exactly():
    """Outliers are stored in float16 (2 bytes each, as the byte accounting counts them): exact for float16 K/V
    only. The docs said "kept exactly"; a float32 outlier 1000.3 came back as 1000.5 (0.2 off, while the dense
    int8 entries of that row were within 5.3e-5), and a rotated spec's outliers (float32 basis) were rounded too
    (up to 0.026 off at 700). Documentation fix: this pins the float16 storage the docs now describe."""
    from kvbits.quant import outliers

    assert "kept in float16" in outliers.__doc__ and "exactly" not in outliers.__doc__
    x = torch.full((1, 1, 1, 16), 0.01)
    x[..., 5] = 1000.3
    qt = quantize(x, int_spec(8, outlier_frac=1 / 16))
    assert qt.outlier_values.dtype == torch.float16
    assert qt.dequantize(torch.float32)[0, 0, 0, 5].item() == 1000.5 == float(torch.tensor(1000.3).half())
    assert qt.outlier_values.nbytes == 2 * qt.outlier_values.numel()


# --------------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,mant_bits,min_sub", [("e4m3", 3, 2.0**-9), ("e5m2", 2, 2.0**-16)])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3])
def test_fp8_token_round_trip(fmt, mant_bits, min_sub, magnitude):
    x = gaussian(2, 2, 16, 64, seed=3) * magnitude
    qt = quantize(x, TensorSpec(kind="fp8", bits=8, fmt=fmt, granularity="token"))
    assert qt.data.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    assert qt.clipped == 0  # dynamic per-token scales cover the row maximum
    err = (qt.dequantize() - x).abs()
    # round-to-nearest: relative error <= 2^-(m+1) for normals, half a subnormal step below them
    bound = x.abs() * 2.0 ** -(mant_bits + 1) + qt.scale.float() * min_sub / 2
    assert bool((err <= bound * (1 + 1e-3)).all())
    assert sqnr_db(x, qt.dequantize()) > {"e4m3": 30, "e5m2": 24}[fmt]  # measured 32.1 / 26.0


@pytest.mark.parametrize("fmt,fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_fp8_static_saturation_is_counted(fmt, fmax):
    spec = TensorSpec(kind="fp8", bits=8, fmt=fmt, granularity="tensor", static=True)
    x = gaussian(1, 2, 8, 16, seed=4)
    x[0, 0, 0, :3] = torch.tensor([2 * fmax, -3 * fmax, fmax * 1.5]) / 16  # within fp16, beyond fp8/scale
    scale = torch.tensor(1 / 16)
    qt = quantize(x, spec, static_scale=scale)
    assert qt.clipped == 3
    assert qt.dequantize()[0, 0, 0, :3].tolist() == [fmax / 16, -fmax / 16, fmax / 16]  # saturated, not inf
    assert qt.nbytes == x.numel()  # static scale is the layer's, not the block's
    assert quantize(x[:, :, 1:], spec, static_scale=scale).clipped == 0


# --------------------------------------------------------------------------------------------------
# Degenerate and invalid inputs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = gaussian(1, 1, 4, 8)
    x[0, 0, 1, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, int_spec(4))


def test_out_of_fp16_range_and_wrong_rank_raise():
    with pytest.raises(ValueError, match="float16 range"):
        quantize(torch.full((1, 1, 2, 4), 1e6), int_spec(4))
    with pytest.raises(ValueError, match=r"\(B, H_kv, T, D\)"):
        quantize(torch.zeros(2, 4), int_spec(4))


ALL_INT_SPECS = [
    int_spec(b, g, gs, symmetric=s) for b in (2, 3, 4, 8) for g, gs in GRANULARITIES for s in (False, True)
]


@pytest.mark.parametrize(
    "spec",
    ALL_INT_SPECS
    + [
        TensorSpec(kind="fp8", bits=8, fmt=f, granularity=g, static=g == "tensor")
        for f in ("e4m3", "e5m2")
        for g in ("token", "tensor")
    ],
    ids=str,
)
@pytest.mark.parametrize("value", [0.0, 0.75, -3.25])  # float16-representable constants
def test_constant_and_zero_inputs(spec, value):
    x = torch.full((1, 2, 32, 64), value)
    deq = quantize(x, spec).dequantize()
    assert bool(torch.isfinite(deq).all())
    if value == 0.0 or (spec.kind == "int" and not spec.symmetric):
        # asymmetric: constant group -> scale 0, zero = value; zero input -> 0 under every format
        assert torch.equal(deq, x)
    else:  # symmetric int: within scale/2; fp8: round-to-nearest with 3 (e4m3) or 2 (e5m2) mantissa bits
        rtol = {"int": 1e-3, "fp8": 2.0 ** -(4 if spec.fmt == "e4m3" else 3)}[spec.kind]
        assert torch.allclose(deq, x, rtol=rtol, atol=0), (deq.flatten()[0], value)


def float16_end_block() -> torch.Tensor:
    """``(2, 2, 32, 64)`` float16 K/V whose groups reach float16's end: rows and channels topped at 65504,
    65480 (within a scale rounding of it) and -65504, asymmetric ranges on either side of 0."""
    x = torch.randn(2, 2, 32, 64, generator=torch.Generator().manual_seed(7))
    x = x / x.abs().amax() * 60000
    x[0, 0, :, 0] = 65504.0  # a channel at the end, every token
    x[0, 1, 3, :] = 65480.0  # a token row of it
    x[1, 0, 5, 7] = -65504.0
    x[1, 1] = x[1, 1].abs() * 1.09  # an all-positive range up to 65400
    return x.clamp(-65504, 65504).half()


FLOAT16_END_SPECS = [int_spec(b, g, gs, symmetric=s) for b in (2, 4, 8) for g, gs in GRANULARITIES for s in (False, True)] + [
    TensorSpec(kind="fp8", bits=8, fmt=f, granularity="token") for f in ("e4m3", "e5m2")
] + [TensorSpec(kind="nuq", bits=4, fmt=None, granularity=g, group_size=gs, symmetric=True) for g, gs in GRANULARITIES[:3]]


@pytest.mark.parametrize("spec", FLOAT16_END_SPECS, ids=str)
def test_groups_at_float16s_end_decode_finite_within_half_a_step(spec):
    """README, "Range of the stored values": K/V up to 65504 are stored, never decoded to inf. A float16 scale
    rounded up let a group's top level decode past 65519 (int8 per token at 65480: ``127 * 516 = 65532``, inf
    in float16); it is now capped a step lower, where the top value still rounds onto the top level: nothing
    is clipped and the error stays within half a step."""
    from kvbits.quant.nuq import uniform_codebook

    x = float16_end_block()
    qt = quantize(x, spec, **({"codebook": uniform_codebook(4)} if spec.kind == "nuq" else {}))
    y16 = qt.dequantize(torch.float16)
    assert bool(torch.isfinite(y16).all()), f"{int((~torch.isfinite(y16)).sum())} decoded to inf"
    assert qt.clipped == 0
    err = (qt.dequantize().float() - x.float()).abs()
    if spec.kind == "int":
        steps = 2 ** (spec.bits - 1) - 1 if spec.symmetric else 2**spec.bits - 1
        top = (qt.scale.float() * steps + (0 if qt.zero is None else qt.zero.float())).amax()
        assert float(top) <= 65504.0
        half = qt.scale.float().flatten(2).amax(-1)[..., None, None] / 2  # each (sequence, head)'s largest half step
        assert bool((err <= half * 1.001).all())
    elif spec.kind == "fp8":  # round to nearest: within 2**-4 (e4m3) / 2**-3 (e5m2) of |x|, below float16's end
        assert bool((err <= x.float().abs() * 2.0 ** -(4 if spec.fmt == "e4m3" else 3) + 1e-3).all())


@pytest.mark.parametrize(
    "spec",
    [int_spec(4), TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token"), TensorSpec()],
    ids=str,
)
def test_no_channels_is_a_clear_error(spec):
    """D = 0 used to die in a modulo by zero (int) or an empty amax (fp8)."""
    with pytest.raises(ValueError, match=r"head_dim D >= 1, got shape \(1, 2, 4, 0\)"):
        quantize(torch.zeros(1, 2, 4, 0), spec)


@pytest.mark.parametrize("shape", [(1, 2, 0, 64), (1, 0, 4, 64), (0, 2, 4, 64)], ids=str)
@pytest.mark.parametrize("gran", ["head", "tensor", "token"])
@pytest.mark.parametrize("kind,symmetric", [("int", False), ("int", True), ("nuq", False), ("nuq", True)])
def test_empty_blocks_quantize_at_every_granularity(shape, gran, kind, symmetric):
    """No tokens (or heads, or sequences): head / tensor scales reduce over an empty dim, where torch's
    min / max raise; the group gets the range [0, 0], as a fully masked group does."""
    from kvbits.quant.nuq import uniform_codebook

    spec = TensorSpec(kind=kind, bits=4, fmt=None, granularity=gran, symmetric=symmetric)
    x = torch.zeros(shape)
    qt = quantize(x, spec, **({"codebook": uniform_codebook(4)} if kind == "nuq" else {}))
    assert qt.dequantize().shape == shape and qt.clipped == 0
    assert not bool(qt.scale.any()) and (qt.zero is None) == symmetric
    B, H, n, D = shape
    assert qt.nbytes == B * (quantized_bytes(spec, n, H, D) + per_block_meta_bytes(spec, H))


def test_static_scales_are_constants_of_the_head_and_channel_not_of_the_block():
    """A static scale (or zero-point) that broadcast to the block was taken: a per-channel one of shape (1, H, n, D)
    quantized an n-token block with a different scale per token (and was refused only at a flush of another
    size), one of (D,) or (1, 1, 1, 1) spread over heads and channels it did not cover; a static per-token one of
    (1, H, n, groups, 1) varied over the tokens. Now each is refused, saying what was expected."""
    x = gaussian(1, 2, 4, 8)
    channel = int_spec(4, "channel", None, static=True, symmetric=True)
    for shape in ((1, 2, 4, 8), (8,), (1, 1, 1, 1)):
        with pytest.raises(ValueError, match=r"static per-channel spec must be \(H_kv, D\) = \(2, 8\) or \(1, 2, 1, 8\)"):
            quantize(x, channel, static_scale=torch.full(shape, 0.5))
    asym = int_spec(4, "channel", None, static=True)
    with pytest.raises(ValueError, match=r"static_zero of a static per-channel spec must be"):
        quantize(x, asym, static_scale=torch.full((2, 8), 0.5), static_zero=torch.zeros(1, 2, 4, 8))
    for good in ((2, 8), (1, 2, 1, 8), (2, 1, 8)):  # the calibrated layouts (leading 1s optional)
        quantize(x, channel, static_scale=torch.full(good, 0.5))
    token = int_spec(4, "token", 4, static=True, symmetric=True)  # groups (1, 2, 4, 2, 4): one scale per 4 channels
    with pytest.raises(ValueError, match=r"varies over the batch, the tokens or within a token group"):
        quantize(x, token, static_scale=torch.full((1, 2, 4, 2, 1), 0.5))
    with pytest.raises(ValueError, match=r"varies over the batch, the tokens or within a token group"):
        quantize(x, token, static_scale=torch.full((1, 2, 1, 2, 4), 0.5))
    quantize(x, token, static_scale=torch.full((1, 2, 1, 2, 1), 0.5))  # per (head, channel group)


@pytest.mark.parametrize(("group", "symmetric"), [(4, True), (4, False), (None, True)])
def test_static_token_scales_are_counted_per_head_and_channel_group(group, symmetric):
    """A static per-token spec with ``group_size`` takes a scale per (head, channel group), ``(1, H, 1, D/g, 1)``, as
    ``quantize`` groups the channels; the planner (``fixed_layer_bytes``) counted one per head, 4 fixed bytes where
    ``memory_report`` counted 16 (H=2, D=16, groups of 4)."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.schemes.accounting import fixed_layer_bytes

    H, D = 2, 16
    spec = int_spec(4, "token", group, static=True, symmetric=symmetric)
    cache = QuantizedKVCache(scheme=KVScheme("s", key=spec, value=int_spec(4), block=4), num_layers=1)
    groups = D // (group or D)
    cache.layers[0].set_static_qparams("key", torch.full((1, H, 1, groups, 1), 0.5),
                                       None if symmetric else torch.full((1, H, 1, groups, 1), -1.0))  # fmt: skip
    x = torch.randn(1, H, 8, D)
    cache.update(x, x, 0)
    assert fixed_layer_bytes(spec, H, D) == cache.memory_report()["components"]["fixed"] == \
        H * groups * 2 * (1 if symmetric else 2)


@pytest.mark.parametrize("bad", [float("nan"), -0.4, float("inf"), 1e6])  # 1e6: inf in float16
def test_static_scales_must_be_finite_and_non_negative(bad):
    """NaN / inf scales decoded to NaN and negative ones mirrored the grid, with clipped == 0. A finite 1e6 overflows
    the float16 it is stored in: named as given (it was refused as "(e.g. inf)")."""
    spec = int_spec(4, "channel", None, static=True)
    x, zero = gaussian(1, 2, 16, 8), torch.full((2, 8), -3.0).half()
    over = r": 16 of 16 entries overflow float16, which stores them \(e\.g\. 1e\+06 given"
    with pytest.raises(ValueError, match="static_scale" + (over if bad == 1e6 else " must be finite and >= 0")):
        quantize(x, spec, static_scale=torch.full((2, 8), bad), static_zero=zero)
    if not math.isfinite(bad) or bad > 65504:  # zero-points may be negative, not non-finite
        with pytest.raises(ValueError, match="static_zero" + (over if bad == 1e6 else " must be finite")):
            quantize(x, spec, static_scale=torch.full((2, 8), 0.5), static_zero=torch.full((2, 8), bad))
    fp8 = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True)
    for s in (bad, 0.0):  # an FP8 scale divides: 0 is refused too
        if math.isfinite(s) and s > 0:
            continue
        with pytest.raises(ValueError, match="static FP8 scale must be finite and > 0"):
            quantize(x, fp8, static_scale=torch.tensor(s))


@pytest.mark.parametrize(
    ("spec", "given"),
    [
        (int_spec(4), "codebook"),  # a calibrated codebook to a scheme without one: coded uniformly, no word
        (int_spec(4), "static_scale"),  # static scales to a dynamic spec: the data's own ranges used
        (int_spec(4, "channel", None, static=True, symmetric=True), "static_zero"),
        (int_spec(4), "channel_mean"),
        (int_spec(4), "channel_factor"),
        (TensorSpec(kind="fp8", bits=8, fmt="e4m3"), "static_scale"),  # per-token FP8 scales come from the data
        (TensorSpec(), "static_scale"),
    ],
)
def test_parameters_the_spec_does_not_use_are_refused(spec, given):
    """quantize silently ignored a calibrated parameter its spec does not use (a codebook passed with an int spec
    coded the block as if uncalibrated, 0 warnings); now a ValueError naming it, with or without validate."""
    from kvbits.kernels.quantize import quantize_pack
    from kvbits.quant.nuq import uniform_codebook

    x = gaussian(1, 2, 16, 8)
    value = {"codebook": uniform_codebook(4), "static_scale": torch.full((2, 8), 0.5)}.get(given, torch.ones(2, 8))
    for validate in (True, False):
        for fn in (quantize, quantize_pack):
            with pytest.raises(ValueError, match=f"{given} given for a spec that does not use it"):
                fn(x, spec, validate=validate, **{given: value})


@pytest.mark.parametrize("symmetric", [False, True])
def test_zero_static_scale_counts_what_it_clips(symmetric):
    """A static scale of 0 (a channel constant during calibration) collapses the channel onto its
    zero-point: accepted, and every value it changes is counted as clipped (it used to count 0)."""
    spec = int_spec(4, "channel", None, static=True, symmetric=symmetric)
    x = gaussian(1, 2, 16, 8).clamp(-2, 2)
    x[0, 0, :, 0] = 0.0  # this channel really is constant: kept exactly, not clipped
    scale, zero = torch.full((2, 8), 0.5).half(), torch.full((2, 8), -4.0).half()
    scale[0, :4] = 0.0
    zero[0, :4] = 0.0
    qt = quantize(x, spec, static_scale=scale, static_zero=None if symmetric else zero)
    assert qt.clipped == 3 * 16  # channels 1..3 of head 0; the others fit their ranges
    assert not bool(qt.dequantize()[0, 0, :, :4].any())


def test_per_channel_group_of_one_rejected():
    for gs in (1, None):
        with pytest.raises(ValueError, match="group_size must be >= 2"):
            TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=gs)


def test_per_channel_block_must_be_whole_groups():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize(gaussian(1, 1, 10, 8), int_spec(4, "channel", 4))


# --------------------------------------------------------------------------------------------------
# Byte accounting: real bytes == the planner's formula
# --------------------------------------------------------------------------------------------------

EXTRA_SPECS = [
    int_spec(4, outlier_frac=0.02),
    int_spec(3, "token", 32, symmetric=True),
    int_spec(4, "head"),
    int_spec(8, "tensor", symmetric=True),
    int_spec(2, "channel", 16, outlier_frac=0.05),
    TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="token", outlier_frac=0.01),
]


def _check_nbytes(qt: QuantizedTensor, spec: TensorSpec, B: int, H: int, n: int, D: int) -> None:
    stored = sum(t.numel() * t.element_size() for t in qt.stored_tensors())
    assert qt.nbytes == stored
    assert qt.nbytes == B * (quantized_bytes(spec, n, H, D) + per_block_meta_bytes(spec, H)), spec


def calibration_kwargs(spec: TensorSpec, H: int, D: int) -> dict:
    """What a calibration artifact would supply: static scales (and zero-points), NUQ codebooks."""
    kw: dict = {}
    if spec.static and spec.kind in ("int", "nuq"):
        shape = (1, H, 1, D) if spec.granularity == "channel" else (1, H, 1, 1)
        kw["static_scale"] = torch.full(shape, 0.25)
        if spec.has_zero_point:
            kw["static_zero"] = torch.full(shape, -4.0)
    if spec.kind == "nuq":
        from kvbits.quant.nuq import uniform_codebook

        kw["codebook"] = uniform_codebook(spec.bits)
    if spec.centre:  # centred / smoothed keys: a channel mean and a factor per (head, channel)
        kw["channel_mean"] = torch.linspace(-2, 2, H * D).reshape(H, D).half()
    if spec.smooth is not None:
        kw["channel_factor"] = torch.linspace(0.5, 2, H * D).reshape(H, D).half()
    return kw


@pytest.mark.parametrize("scheme", list_schemes(), ids=lambda s: s.name)
@pytest.mark.parametrize("D", [64, 128])
def test_nbytes_matches_accounting_for_every_preset(scheme: KVScheme, D: int):
    B, H = 2, 3
    n = max(scheme.block, 2)
    x = gaussian(B, H, n, D, seed=D)
    for spec in (scheme.key, scheme.value):
        qt = quantize(x, spec, **calibration_kwargs(spec, H, D))
        _check_nbytes(qt, spec, B, H, n, D)
        if spec.kind == "int":
            assert qt.data.shape == (B, H, n, packed_size(D, spec.bits))


@pytest.mark.parametrize("spec", EXTRA_SPECS, ids=str)
def test_nbytes_matches_accounting_extra_specs(spec: TensorSpec):
    B, H, n, D = 2, 3, 32, 64
    _check_nbytes(quantize(gaussian(B, H, n, D), spec), spec, B, H, n, D)


# --------------------------------------------------------------------------------------------------
# dequantize(out=): into a slice of a larger history, the same bits
# --------------------------------------------------------------------------------------------------

ROTATED = int_spec(4, "token", rotate="hadamard")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "spec",
    [s for scheme in list_schemes() for s in (scheme.key, scheme.value)] + EXTRA_SPECS + [ROTATED],
    ids=str,
)
def test_dequantize_into_a_history_slice_is_bit_identical(spec: TensorSpec, dtype: torch.dtype):
    """Decoded into the middle of a ``(B, H, 5 + n + 7, D)`` tensor (a strided view): equal bit for bit to
    ``dequantize()``, and the tokens on either side untouched."""
    B, H, n, D = 2, 3, 128, 64  # 128: whole per-channel blocks of every preset
    x = gaussian(B, H, n, D, seed=n)
    qt = quantize(x, spec, **calibration_kwargs(spec, H, D))
    want = qt.dequantize(dtype)
    history = torch.full((B, H, 5 + n + 7, D), 7.0, dtype=dtype)
    got = qt.dequantize(dtype, out=history[:, :, 5 : 5 + n])
    assert got.data_ptr() == history[:, :, 5:].data_ptr()
    assert torch.equal(history[:, :, 5 : 5 + n].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip
    assert (history[:, :, :5] == 7).all() and (history[:, :, 5 + n :] == 7).all()


def test_dequantize_out_must_match_shape_and_dtype():
    qt = quantize(gaussian(1, 2, 8, 16), int_spec(4))
    with pytest.raises(ValueError, match=r"must be torch.float32 of shape \(1, 2, 8, 16\)"):
        qt.dequantize(torch.float32, out=torch.empty(1, 2, 9, 16))
    with pytest.raises(ValueError, match="got torch.float16"):
        qt.dequantize(torch.float32, out=torch.empty(1, 2, 8, 16, dtype=torch.float16))
    codes = torch.zeros(1, 2, 8, 1, 16, dtype=torch.uint8)  # grouped: one scale per token
    with pytest.raises(ValueError, match="out= must be float32"):
        dequantize_affine(codes, qt.scale, qt.zero, 4, torch.float32, out=torch.empty(codes.shape, dtype=torch.half))


# --------------------------------------------------------------------------------------------------
# Schemes: serialisation and lookup
# --------------------------------------------------------------------------------------------------


def test_accounting_refuses_token_groups_that_do_not_divide_head_dim():
    """quantize refuses such a block; the byte formula used to round the group count up instead."""
    spec = int_spec(4, "token", 32)
    with pytest.raises(ValueError, match="token group size 32 must divide head_dim 80"):
        quantize(gaussian(1, 1, 2, 80), spec)
    with pytest.raises(ValueError, match="per-token groups of 32 channels do not divide head_dim 80"):
        quantized_bytes(spec, 4, 2, 80)
    assert quantized_bytes(spec, 4, 2, 96) == 4 * 2 * (48 + 3 * 4)  # codes + 3 groups of scale and zero


@pytest.mark.parametrize("scheme", list_schemes(), ids=lambda s: s.name)
def test_scheme_json_round_trip(scheme: KVScheme, tmp_path):
    text = scheme.to_json()
    assert json.loads(text)["version"] == scheme.version
    assert KVScheme.from_json(text) == scheme
    path = tmp_path / f"{scheme.name}.json"
    path.write_text(text)
    assert get_scheme(str(path)) == scheme
    assert get_scheme(scheme.name) is scheme


def test_unknown_scheme_lists_presets():
    with pytest.raises(ValueError) as exc:
        get_scheme("int5-magic")
    msg = str(exc.value)
    assert "int5-magic" in msg
    for s in list_schemes():
        assert s.name in msg


def test_scheme_json_rejects_unknown_fields_and_versions():
    d = get_scheme("kivi-2").to_dict()
    with pytest.raises(ValueError, match="unknown KVScheme fields"):
        KVScheme.from_dict({**d, "bogus": 1})
    with pytest.raises(ValueError, match="version"):
        KVScheme.from_dict({**d, "version": 99})


@pytest.mark.parametrize(
    "side,field,value,match",
    [
        ("key", "bits", 2.0, "bits must be an int"),
        ("key", "bits", True, "bits must be an int"),
        ("key", "group_size", 32.0, "group_size must be an int or None"),
        ("key", "symmetric", "false", "symmetric must be a bool"),
        ("value", "static", 0, "static must be a bool"),
        ("value", "outlier_frac", "0.01", "outlier_frac must be a number"),
        ("value", "granularity", None, "granularity must be a str"),
        (None, "residual", 127.5, "residual must be an int"),
        (None, "sinks", "1", "sinks must be an int"),
        (None, "block", 32.0, "block must be an int"),
    ],
)
def test_scheme_json_rejects_wrong_types(side, field, value, match):
    """A JSON scheme with ``2.0`` bits or ``"false"`` flags used to load and then plan fractional bytes
    or quantize with the string's truthiness; the type is checked at load now."""
    d = json.loads(get_scheme("kivi-2").to_json())
    (d if side is None else d[side])[field] = value
    with pytest.raises(TypeError, match=match):
        KVScheme.from_dict(d)


def test_scheme_json_file_with_wrong_types_is_a_value_error(tmp_path):
    d = json.loads(get_scheme("kivi-2").to_json())
    d["key"]["bits"] = 2.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="not a valid kvbits scheme JSON.*bits must be an int"):
        get_scheme(str(path))


def test_fp8_tensor_granularity_needs_static():
    """FP8 has no dynamic per-tensor scale: static=False used to quantize with a silent scale of 1.0."""
    with pytest.raises(ValueError, match="needs static=True"):
        TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor")
    assert TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True).static


def test_fp8_head_granularity_is_static_per_kv_head():
    """fp8 per head (vLLM's attn_head): calibrated, one float32 scale per KV head; a dynamic one or a
    static per-token one is refused (each would quantize with a silent 1.0)."""
    with pytest.raises(ValueError, match="needs static=True"):
        TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="head")
    with pytest.raises(ValueError, match="use static=False"):
        TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", static=True)
    spec = get_scheme("fp8-e4m3-head").key
    assert (spec.granularity, spec.static, spec.calibratable, spec.calibrated) == ("head", True, True, False)
    from kvbits.schemes.accounting import fixed_layer_bytes

    assert fixed_layer_bytes(spec, n_heads=8, head_dim=128) == 8 * 4
    assert fixed_layer_bytes(get_scheme("fp8-e4m3").key, n_heads=8, head_dim=128) == 4


def test_fp8_per_head_scales_quantize_each_head_on_its_own_grid():
    """Heads 10^5 apart: each head's own scale keeps every head at FP8's relative precision; the
    per-tensor scale of the largest head puts the small head's values among the subnormals (FP8 is
    floating point: a head only 100x smaller still keeps its precision under one scale)."""
    from kvbits.quant.fp8 import static_fp8_scale

    g = torch.Generator().manual_seed(7)
    mag = torch.tensor([1e-5, 1.0, 1.0]).view(1, 3, 1, 1)
    x = torch.randn(2, 3, 40, 16, generator=g) * mag
    amax = x.abs().amax(dim=(0, 2, 3))
    head, tensor = get_scheme("fp8-e4m3-head").key, get_scheme("fp8-e4m3").key
    per_head = quantize(x, head, static_scale=amax / 448)
    per_tensor = quantize(x, tensor, static_scale=amax.max() / 448)
    assert per_head.scale.shape == (1, 3, 1, 1) and per_head.clipped == per_tensor.clipped == 0

    def rel(qt: QuantizedTensor) -> torch.Tensor:
        err = (qt.dequantize(torch.float32) - x).square().sum(dim=(0, 2, 3)).sqrt()
        return err / x.square().sum(dim=(0, 2, 3)).sqrt()

    assert rel(per_head).max() < 0.04  # e4m3: 3 mantissa bits
    assert rel(per_tensor)[0] > 3 * rel(per_head)[0]  # the small head lost precision
    assert torch.allclose(rel(per_tensor)[1:], rel(per_head)[1:], rtol=0.3)
    # shapes: (H,), (H, 1, 1) and (1, H, 1, 1) are the same scales; one number repeats; others refuse
    for shape in ((3,), (3, 1, 1), (1, 3, 1, 1)):
        assert torch.equal(quantize(x, head, static_scale=(amax / 448).reshape(shape)).data.view(torch.uint8),
                           per_head.data.view(torch.uint8))  # fmt: skip
    assert static_fp8_scale(torch.tensor(2.0), "head", 3, "s").shape == (1, 3, 1, 1)
    for bad in (torch.ones(2), torch.ones(3, 16), torch.ones(1, 3, 1, 16)):
        with pytest.raises(ValueError, match="per-head FP8 scale must be"):
            quantize(x, head, static_scale=bad)
    with pytest.raises(ValueError, match="one number"):
        quantize(x, tensor, static_scale=torch.ones(3))


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": "fp8", "bits": 8, "fmt": "e4m3", "granularity": "token", "group_size": 32},
        {"kind": "fp8", "bits": 8, "fmt": "e5m2", "granularity": "tensor", "static": True, "group_size": 16},
        {"kind": "int", "bits": 4, "fmt": None, "granularity": "head", "group_size": 16},
        {"kind": "int", "bits": 4, "fmt": None, "granularity": "tensor", "group_size": 16},
        {"kind": "nuq", "bits": 4, "fmt": None, "granularity": "head", "group_size": 16},
        {"kind": "float", "bits": 16, "fmt": "fp16", "group_size": 32},
    ],
    ids=str,
)
def test_group_size_rejected_where_it_would_be_ignored(kw):
    """group_size was accepted and ignored (same scales, same bytes) for these specs."""
    with pytest.raises(ValueError, match="group_size applies to int/nuq specs"):
        TensorSpec(**kw)


def test_per_token_group_of_one_channel_rejected():
    """The mirror of the per-channel rule: a per-token group of one channel stores every value exactly, and so
    does an asymmetric group of two (its minimum and scale are the two values: int2 at 18 bits per value came
    back within float16's rounding); a symmetric group of two still quantizes one of them."""
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        int_spec(2, "token", 1)
    for granularity in ("token", "channel"):
        with pytest.raises(ValueError, match="an asymmetric group of 2 is lossless"):
            int_spec(2, granularity, 2)
        with pytest.raises(ValueError, match="an asymmetric group of 2 is lossless"):
            TensorSpec(kind="nuq", bits=4, fmt=None, granularity=granularity, group_size=2)
    assert int_spec(2, "token", 3).group_size == 3
    sym = TensorSpec(kind="int", bits=2, fmt=None, group_size=2, symmetric=True)
    x = torch.tensor([1.0, 0.3] * 8).reshape(1, 1, 1, 16)
    assert not torch.equal(quantize(x, sym).dequantize(torch.float32), x)  # 0.3 is not on its 1-step grid


# ------------------------------------------------------------------------------ Hadamard rotation


def test_rotation_matrix_is_orthogonal_hadamard_with_signs():
    from kvbits.quant.rotate import rotation_matrix

    for D in (2, 64, 128):
        r = rotation_matrix(D, dtype=torch.float64)
        torch.testing.assert_close(r @ r.T, torch.eye(D, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.all(r.abs() == 1 / math.sqrt(D))  # every entry +-1/sqrt(D): a channel spreads evenly
        assert rotation_matrix(D).dtype == torch.float32
    r = rotation_matrix(64, dtype=torch.float64)
    h = r * math.sqrt(64)
    # the signs are a fixed function of D (seed 0), not all +1: rows of the plain Sylvester matrix flipped
    assert 0 < int((h[:, 0] < 0).sum()) < 64
    for D in (80, 96, 1):
        with pytest.raises(ValueError, match="power of two"):
            rotation_matrix(D)
    with pytest.raises(ValueError, match="unknown rotation"):
        rotation_matrix(64, "givens")


def test_hadamard_spreads_an_outlier_channel_for_per_token_scales():
    """One channel 20x the others (the keys' outlier channels): per-token INT4 after a Hadamard rotation
    loses far less than without, stores exactly the same bytes, and still quantizes (error > 0)."""
    x = gaussian(2, 2, 256, 64, seed=1)
    x[..., 5] *= 20
    plain, rot = int_spec(4), int_spec(4, rotate="hadamard")
    qp, qr = quantize(x, plain), quantize(x, rot)
    assert qr.nbytes == qp.nbytes == 2 * (quantized_bytes(rot, 256, 2, 64) + per_block_meta_bytes(rot, 2))
    sp, sr = sqnr_db(x, qp.dequantize()), sqnr_db(x, qr.dequantize())
    assert sr > sp + 6, (sp, sr)
    assert 0 < float((qr.dequantize() - x).abs().max())
    # on isotropic data the rotation neither helps nor hurts much
    g = gaussian(2, 2, 256, 64, seed=2)
    assert abs(sqnr_db(g, quantize(g, rot).dequantize()) - sqnr_db(g, quantize(g, plain).dequantize())) < 1.5


@pytest.mark.parametrize(
    "spec",
    [
        int_spec(2, rotate="hadamard"),
        int_spec(4, group_size=32, rotate="hadamard", outlier_frac=0.05),
        int_spec(4, "channel", group_size=16, rotate="hadamard"),
        TensorSpec(kind="fp8", bits=8, fmt="e4m3", rotate="hadamard"),
        TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True, rotate="hadamard"),
    ],
    ids=["int2", "int4-g32-outliers", "int4-channel", "fp8-token", "fp8-tensor"],
)
def test_rotated_specs_round_trip_in_the_original_basis(spec):
    """Dequantizing a rotated block gives back x's basis and dtype: the error is the quantization error of
    x @ R rotated back (the same norm, R being orthogonal), checked against an independent reference."""
    from kvbits.quant.rotate import rotation_matrix

    x = gaussian(1, 2, 32, 64, seed=3)
    r = rotation_matrix(64, dtype=torch.float64)
    qt = quantize(x.half(), spec)
    y = qt.dequantize(torch.float16)
    assert y.dtype == torch.float16 and y.shape == x.shape
    unrot = TensorSpec(**{**spec.to_dict(), "rotate": None})
    want = quantize((x.half().double() @ r).float(), unrot).dequantize(torch.float64) @ r.T
    torch.testing.assert_close(y.double(), want, rtol=0, atol=2e-3)
    assert float((y.double() - x.double()).norm()) > 0
    assert json.loads(json.dumps(spec.to_dict()))["rotate"] == "hadamard"


@pytest.mark.parametrize("bits,symmetric", [(2, True), (2, False), (4, True), (8, False)])
def test_rotated_decode_of_the_largest_accepted_input_stays_finite(bits, symmetric):
    """A rotated spec accepts ``|x| <= 65504 / sqrt(D)`` (``input_bound``): ``x @ R`` then stays within float16,
    and so does the float16 decode rotated back. Rows at the bound (all signs +-bound, random sign patterns) and
    the worst row a hill-climb found (D = 4, int2 symmetric: 65472, the bound's 2 x 32752) decode finitely."""
    from kvbits.cache.checks import input_bound

    spec = int_spec(bits, symmetric=symmetric, rotate="hadamard")
    for D in (4, 16, 64, 128):
        bound = torch.tensor(input_bound(spec, "quantized", D)[0]).half()
        if float(bound) > input_bound(spec, "quantized", D)[0]:  # the float16 at or below the bound
            bound = bound.float().nextafter(torch.tensor(0.0)).half()
        g = torch.Generator().manual_seed(D)
        signs = torch.randint(0, 2, (1, 1, 64, D), generator=g).half() * 2 - 1
        signs[..., 0, :] = 1
        x = signs * bound
        if D == 4:
            x[..., 1, :] = torch.tensor([-32752.0, -10952.0, 32704.0, -32736.0]).half()
        y = quantize(x, spec).dequantize(torch.float16)
        assert y.isfinite().all(), (D, float(bound))


def test_rotate_field_validation_and_json():
    with pytest.raises(ValueError, match="rotate must be None or one of"):
        int_spec(4, rotate="random")
    with pytest.raises(ValueError, match="quantized specs"):
        TensorSpec(rotate="hadamard")
    with pytest.raises(TypeError, match="rotate must be a str or None"):
        int_spec(4, rotate=True)
    # specs without rotation keep the JSON they had before the field existed (run and artifact hashes)
    assert "rotate" not in int_spec(4).to_dict()
    s = get_scheme("int4-token-hadamard")
    assert KVScheme.from_json(s.to_json()) == s and s.key.rotate == s.value.rotate == "hadamard"
    with pytest.raises(ValueError, match="power of two"):
        quantize(gaussian(1, 1, 4, 80), s.key)


# ------------------------------------------------------------------------- per-layer mixed precision


def test_mixed_scheme_resolves_per_layer_and_round_trips():
    from kvbits.schemes.presets import mixed_scheme

    m = get_scheme("int4-token,0-1=int8-token,5=fp16")
    assert m.is_mixed and [i for i, _ in m.layers] == [0, 1, 5]
    assert m.for_layer(0) == m.for_layer(1) == get_scheme("int8-token") and m.for_layer(5).name == "fp16"
    flat = m.for_layer(2)
    assert not flat.is_mixed and (flat.key, flat.value) == (get_scheme("int4-token").key, get_scheme("int4-token").value)
    assert mixed_scheme("int4-token", {0: "int8-token", 1: "int8-token", 5: "fp16"}) == m  # one name, mixed_name
    d = json.loads(m.to_json())
    assert set(d["layers"]) == {"0", "1", "5"} and "layers" not in get_scheme("int4-token").to_dict()
    assert KVScheme.from_json(m.to_json()) == m
    assert not m.is_identity and get_scheme("fp16,0=bf16").is_identity
    # average bits over the model's layers: 2 of 6 at int8, 1 at fp16, 3 at int4
    want = (2 * average_bits(get_scheme("int8-token"), 64, 2) + 16 + 3 * average_bits(get_scheme("int4-token"), 64, 2)) / 6
    assert average_bits(m, 64, 2, n_layers=6) == pytest.approx(want)
    with pytest.raises(ValueError, match="need n_layers"):
        average_bits(m, 64, 2)
    with pytest.raises(ValueError, match=r"overrides layers \[5\], beyond the model's 4"):
        average_bits(m, 64, 2, n_layers=4)
    with pytest.raises(ValueError, match="counts one layer"):
        layer_bytes(m, 10, batch=1, n_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="per layer"):
        token_split(m, 10)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("int4-token,x=int8-token", "expected BASE,LAYER=SCHEME"),
        ("int4-token,3-1=int8-token", "is empty"),
        ("int4-token,0-2=int8-token,2=fp16", "layer 2 is given twice"),
        ("int4-token,0=no-such-scheme", "unknown scheme 'no-such-scheme'"),
        # a typo in a part was refused as "unknown scheme 'fp61'", not naming the string it came from
        ("int4-token,0=fp61", r"^mixed scheme 'int4-token,0=fp61': unknown scheme 'fp61'"),
        ("int4-tokn,0=fp16", r"^mixed scheme 'int4-tokn,0=fp16': unknown scheme 'int4-tokn' \(did you mean"),
    ],
)
def test_mixed_scheme_strings_are_checked(spec, match):
    with pytest.raises(ValueError, match=match):
        get_scheme(spec)


def test_every_spelling_of_a_mixed_scheme_string_gets_one_name():
    """The name was the string as typed: ``"int4-token, 0 = fp16"`` was named so (and refused by ``kvbits eval``
    as no file name), ``"int4-token,1=fp16,0=fp16"`` and ``"int4-token,0-1=fp16"`` were two names of one scheme,
    so duplicate checks let it be evaluated twice and reports showed two rows for it."""
    from kvbits.plan import ModelShape, plan

    for spec in ("int4-token, 0 = fp16 ", "int4-token,00=fp16"):
        assert get_scheme(spec).name == "int4-token,0=fp16"
    one = {get_scheme(s).name for s in ("int4-token,1=fp16,0=fp16", "int4-token,0-1=fp16", "int4-token, 0-0=fp16,1 =fp16")}
    assert one == {"int4-token,0-1=fp16"}
    m = get_scheme("int4-token,5=fp16,0-1=int8-token,2=fp16,3=fp16")
    assert m.name == "int4-token,0-1=int8-token,2-3=fp16,5=fp16" and get_scheme(m.name) == m
    with pytest.raises(ValueError, match="'int4-token,0=fp16' is listed twice"):
        plan(ModelShape.from_dims(2, 2, 64), context=100, scheme=["int4-token,0=fp16", "int4-token, 0=fp16"])


def test_mixed_scheme_fields_are_checked():
    base, sub = get_scheme("int4-token"), get_scheme("int8-token")
    with pytest.raises(ValueError, match="listed twice"):
        base.replace(layers=((0, sub), (0, sub)))
    with pytest.raises(ValueError, match="indices must be ints >= 0"):
        base.replace(layers=((-1, sub),))
    with pytest.raises(TypeError, match="needs a KVScheme"):
        base.replace(layers=((0, "int8-token"),))
    with pytest.raises(ValueError, match="overrides of its own"):
        base.replace(layers=((0, base.replace(layers=((1, sub),))),))
    with pytest.raises(TypeError, match="must be an object"):
        KVScheme.from_dict({**base.to_dict(), "layers": [1]})
    with pytest.raises(ValueError, match="keys are layer indices"):
        KVScheme.from_dict({**base.to_dict(), "layers": {"first": sub.to_dict()}})


def test_tiny_values_meet_float16s_smallest_scale_not_zero():
    """README, "Range of the stored values": a scale rounds up to float16's smallest step (2**-24), never to
    0; down to |x| ~ 1e-5 the relative error is the scheme's own, below it the absolute error is at most
    half that step."""
    x0 = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(0))
    for name in ("int8-token", "int4-token", "kivi-4"):
        spec = get_scheme(name).key
        base = float((quantize(x0, spec).dequantize().float() - x0).norm() / x0.norm())
        for m, ratio in ((1e-5, 1.2), (1e-4, 1.2)):
            x = x0 * m
            y = quantize(x, spec).dequantize().float()
            assert float((y - x).norm() / x.norm()) < ratio * base, (name, m)
        for m in (1e-8, 1e-9):
            qt = quantize(x0 * m, spec)
            assert float(qt.scale.float().min()) == 2**-24, (name, m)  # rounded up, not underflowed to 0
            assert float((qt.dequantize().float() - x0 * m).abs().max()) <= 2**-25 * 1.001, (name, m)


def test_float8_kv_and_a_list_of_scales_are_refused_by_type():
    """float8 K/V passed ``is_floating_point`` and failed inside torch ('"isfinite" not implemented for
    Float8_e4m3fn', 'Promotion for Float8 Types is not supported'); a list as static_scale raised AttributeError."""
    from kvbits.cache import QuantizedKVCache

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.randn(1, 2, 4, 8).to(dtype)
        with pytest.raises(TypeError, match=f"K/V block must be float16, bfloat16, float32 or float64, got {dtype}"):
            quantize(x, int_spec(4))
        with pytest.raises(TypeError, match="layer 0 key_states must be float16, bfloat16, float32 or float64"):
            QuantizedKVCache(scheme="int4-token", num_layers=1).update(x, x, 0)
    static = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", static=True, symmetric=True)
    with pytest.raises(TypeError, match="static_scale must be a torch.Tensor, got list"):
        quantize(torch.randn(1, 2, 4, 8), static, static_scale=[0.5] * 8)
