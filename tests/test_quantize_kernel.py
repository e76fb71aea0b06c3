"""Quantize-and-pack on append: the Triton kernel equals ``kvbits.quant.quantize`` bit for bit.

Compiled on CUDA, else through Triton's interpreter (set up by ``test_kernels``); skipped without Triton.
The interpreter computes in numpy (IEEE float32), so it checks the kernel's formulas, bit tricks and
layout; whether ``tl.math.div_rn`` and the float16 conversions round as on the GPU is checked by the same
test on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, needs_triton, spec, triton_decode

from kvbits.quant import quantize
from kvbits.schemes import TensorSpec

QUANT_SPECS = [
    spec(8, "token"),
    spec(4, "token", 32),
    spec(2, "token", 16),
    spec(4, "token", 64, symmetric=True),
    spec(2, "token", None, symmetric=True),
    spec(8, "channel", 32),
    spec(4, "channel", 32),
    spec(2, "channel", 128),
    spec(4, "channel", 32, symmetric=True),
    spec(4, "channel", None, static=True),
    spec(2, "channel", None, static=True),
    spec(8, "channel", None, static=True, symmetric=True),
    spec(3, "token"),  # 3-bit: 8 codes in 3 bytes
    spec(3, "token", 8, symmetric=True),
    spec(3, "channel", 32),
    spec(3, "channel", None, static=True),
]


def hard_block(g: torch.Generator, B: int = 2, H: int = 3, n: int = 128, D: int = 64) -> torch.Tensor:
    """K/V with the cases rounding code gets wrong: outlier channels, constant and zero groups, values
    exactly halfway between codes, negative ranges, tiny and large magnitudes."""
    x = torch.randn(B, H, n, D, generator=g)
    x[..., :4] *= 20  # outlier channels
    x[0, 0, :32] = 0.5  # constant tokens (per-token groups) and constant channel blocks
    x[0, 1, 5] = 0.0
    x[1, 0, :, 8:16] = torch.arange(n, dtype=torch.float32)[:, None] * 0.25  # halves after scaling
    x[1, 1] = -x[1, 1].abs() - 3  # all-negative groups
    x[1, 2, 64:] *= 1e-4  # tiny ranges: float16 subnormal scales
    return x


# every spec from float32 K/V; half-precision inputs (what a model's cache receives) on a few
BIT_CASES = [(s, torch.float32) for s in QUANT_SPECS] + [
    (QUANT_SPECS[i], dt) for i in (1, 6, 9) for dt in (torch.float16, torch.bfloat16)
]


@needs_triton
@pytest.mark.parametrize("s,dtype", BIT_CASES, ids=[f"{s}-{dt}" for s, dt in BIT_CASES])
def test_quantize_kernel_equals_reference_bit_for_bit(s: TensorSpec, dtype: torch.dtype):
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    g = torch.Generator().manual_seed(50)
    x = hard_block(g).to(dtype).to(DEVICE)
    kw = {}
    if s.static:  # calibrated on a narrower sample: some elements clip, and are counted
        lo, hi = x.float().amin(dim=(0, 2))[:, :] * 0.8, x.float().amax(dim=(0, 2)) * 0.8
        levels = 2 ** (s.bits - 1) - 1 if s.symmetric else 2**s.bits - 1
        width = torch.maximum(hi.abs(), lo.abs()) if s.symmetric else hi - lo
        kw = {"static_scale": (width / levels).half(), "static_zero": None if s.symmetric else lo.half()}
    want = quantize(x, s, **kw)
    got = quantize_pack_triton(x, s, **kw)
    assert got.data.dtype == torch.uint8 and torch.equal(got.data, want.data)
    assert got.scale.shape == want.scale.shape and torch.equal(got.scale, want.scale)
    assert (got.zero is None) == (want.zero is None)
    if want.zero is not None:
        assert torch.equal(got.zero, want.zero)
    assert got.clipped == want.clipped and (want.clipped > 0) == s.static
    assert (got.static, got.shape, got.nbytes) == (want.static, want.shape, want.nbytes)
    assert torch.equal(got.dequantize(), want.dequantize())


@needs_triton
def test_quantize_kernel_sync_free_count_and_unsupported():
    from kvbits.kernels.triton_quantize import quantize_pack_triton, supported

    x = hard_block(torch.Generator().manual_seed(51)).to(DEVICE)
    s = spec(4, "channel", None, static=True)
    scale, zero = torch.full((3, 64), 0.1).half(), torch.full((3, 64), -0.5).half()
    qt = quantize_pack_triton(x, s, static_scale=scale, static_zero=zero, sync=False)
    assert isinstance(qt.clipped, torch.Tensor) and qt.clipped.dtype == torch.int64
    assert int(qt.clipped) == quantize(x, s, static_scale=scale, static_zero=zero).clipped > 0
    # dynamic ranges cover their data: no counter on the device, a host 0 even without syncs (a per-token flush
    # launches no counter fill and no conversion), as the reference counts
    for dyn in (spec(8, "token"), spec(4, "channel", 32), TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token")):
        qt = quantize_pack_triton(x, dyn, sync=False)
        assert type(qt.clipped) is int and qt.clipped == 0 == quantize(x, dyn).clipped, dyn
    for bad in (
        spec(3, "token", 4),  # half a 3-bit packing unit per group
        spec(4, "tensor"),
        spec(4, "head"),
        spec(4, "channel", 48),
        spec(4, "token", integer_zero=True),  # the kernel chooses float zero-points (vllm-int4: the reference)
        spec(8, "token", symmetric=True, rounding="trunc"),  # the kernel rounds to nearest (vllm-int8: the reference)
    ):
        assert supported(x, bad) is not None
        with pytest.raises(NotImplementedError, match="quantize_pack_triton"):
            quantize_pack_triton(x, bad)
    assert "head_dim" in supported(torch.zeros(1, 1, 4, 48), spec(4, "token"))
    assert "integer zero-points" in supported(x, spec(4, "token", integer_zero=True))
    assert "trunc rounding" in supported(x, spec(8, "token", symmetric=True, rounding="trunc"))


def test_quantize_dispatch(monkeypatch, caplog):
    from kvbits.kernels import quantize as qmod

    x = hard_block(torch.Generator().manual_seed(52))
    monkeypatch.delenv("KVBITS_KERNEL", raising=False)
    assert qmod.resolve_quantize_kernel(x, spec(4, "token")) == "reference"  # CPU: torch
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    monkeypatch.setattr(qmod.dispatch, "_LOGGED_FALLBACKS", set())  # the fallback is logged once per process
    if triton_decode is not None:
        assert qmod.resolve_quantize_kernel(x, spec(4, "token")) == "triton"
        with caplog.at_level("INFO", logger="kvbits.kernels.quantize"):
            assert qmod.resolve_quantize_kernel(x, spec(4, "head")) == "reference"
        assert "head granularity" in caplog.text
        qt = qmod.quantize_pack(x, spec(4, "channel", 32))
        assert torch.equal(qt.data, quantize(x, spec(4, "channel", 32)).data)
        bad = x.clone()
        bad[0, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            qmod.quantize_pack(bad, spec(4, "token"))
    else:
        monkeypatch.setattr(qmod.dispatch, "triton_available", lambda: False)
        with pytest.raises(ImportError, match="pip install"):
            qmod.quantize_pack(x, spec(4, "token"))


@needs_triton
def test_forced_triton_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    """``KVBITS_KERNEL=triton`` with a format the quantize kernel does not write (head-wise ranges): the torch
    reference quantizes every block flush of every layer. Before, each flush logged that at info level (5 calls,
    5 identical lines); now each distinct reason is logged once per process (``dispatch.log_fallback_once``)."""
    from kvbits.kernels import quantize as qmod

    x = hard_block(torch.Generator().manual_seed(53)).to(DEVICE)
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    monkeypatch.setattr(qmod.dispatch, "_LOGGED_FALLBACKS", set())
    with caplog.at_level("DEBUG", logger=qmod.logger.name):
        assert [qmod.resolve_quantize_kernel(x, spec(4, "head")) for _ in range(5)] == ["reference"] * 5
        assert [qmod.resolve_quantize_kernel(x, spec(4, "token", integer_zero=True)) for _ in range(3)] == ["reference"] * 3
    lines = [r for r in caplog.records if r.name == qmod.logger.name]
    assert len(lines) == 2 and all(r.levelname == "INFO" for r in lines), [r.getMessage() for r in lines]
    assert "falls back to the torch reference" in lines[0].getMessage()
    assert "head granularity" in lines[0].getMessage() and "integer zero-points" in lines[1].getMessage()


@needs_triton
@pytest.mark.parametrize(
    "scheme",
    ["int4-kivi", "int4-prerope", "fp8-e4m3-token", "kvquant4-block", "kvquant4-static", "kvquant3-block"],
)
def test_cache_flushes_through_the_kernel_bit_for_bit(monkeypatch, scheme: str):
    """``KVBITS_KERNEL=triton``: the cache's flushes run the quantize kernel (interpreted on CPU) for both
    sides and store exactly the bytes the torch reference stores; generation is unchanged. The KVQuant
    layouts too: pre-RoPE NUQ keys with block or static ranges, NUQ values, 5 % outliers, 3 and 4 bits."""
    from unittest import mock

    from test_fused_cache import SCHEMES, build, code_flips, generate

    from kvbits.kernels import triton_quantize
    from kvbits.schemes import KVScheme

    sch = SCHEMES.get(scheme) or KVScheme(
        "t-kvquant4-block", key=nuq(4, "channel", 16, pre_rope=True, outlier_frac=0.05),
        value=nuq(4, "token", outlier_frac=0.05), sinks=2, residual=4, block=16,
    )  # fmt: skip
    model = build("llama")
    monkeypatch.setenv("KVBITS_KERNEL", "reference")
    seq_ref, logits_ref, ref = generate(model, sch, fused=False, attn=False, new=6)
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    fn = triton_quantize.quantize_pack_triton
    with mock.patch.object(triton_quantize, "quantize_pack_triton", wraps=fn) as kernel:
        seq, logits, cache = generate(model, sch, fused=False, attn=False, new=6)
    assert {call.args[1] for call in kernel.call_args_list} == {sch.key, sch.value}
    assert code_flips(ref, cache) == (0, code_flips(ref, ref)[1])
    for la, lb in zip(ref.layers, cache.layers):
        for sa, sb in ((la._k, lb._k), (la._v, lb._v)):
            for ca, cb in zip(sa.chunks, sb.chunks, strict=True):
                assert torch.equal(ca.scale, cb.scale) and (ca.zero is None or torch.equal(ca.zero, cb.zero))
    assert ref.memory_report() == cache.memory_report()
    assert torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)


FP8_SPECS = [
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token"),
    TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="token"),
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True),
    TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="tensor", static=True),
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="head", static=True),
]


@needs_triton
@pytest.mark.parametrize("s", FP8_SPECS, ids=str)
def test_quantize_kernel_fp8_equals_reference_bit_for_bit(s: TensorSpec):
    """FP8 codes assembled from the float32 fields equal torch's round-half-even casts: per-row scales
    (constant, zero and tiny rows included) and a static scale that saturates some elements."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    g = torch.Generator().manual_seed(53)
    x = hard_block(g).to(DEVICE)
    # a static scale small enough that the outlier channels (|x| ~ 80) saturate: 448 (e4m3), 57344 (e5m2)
    kw = {"static_scale": torch.tensor(0.05 if s.fmt == "e4m3" else 0.001)} if s.static else {}
    if s.granularity == "head":  # one scale per head, each read by its own programs (head 1's saturates)
        kw = {"static_scale": torch.tensor([0.5, 0.05, 2.0])}
    want, got = quantize(x, s, **kw), quantize_pack_triton(x, s, **kw)
    assert got.data.dtype == want.data.dtype and torch.equal(
        got.data.view(torch.uint8), want.data.view(torch.uint8)
    )
    assert (
        torch.equal(got.scale, want.scale) and got.clipped == want.clipped and (want.clipped > 0) == s.static
    )
    assert (got.static, got.nbytes) == (want.static, want.nbytes)


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_every_boundary(fmt: str):
    """Every float8 value, the midpoints between neighbours (ties to even) and one float32 step either
    side, through the kernel's conversion (static scale 1) against torch's cast."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton
    from kvbits.quant.fp8 import fp8_dtype

    dt = fp8_dtype(fmt)
    vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
    vals = vals[torch.isfinite(vals)].unique()  # sorted, -max .. max
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    pad = (-pts.numel()) % 64
    x = torch.cat([pts, torch.zeros(pad)]).reshape(1, 1, -1, 64).to(DEVICE)
    s = TensorSpec(kind="fp8", bits=8, fmt=fmt, granularity="tensor", static=True)
    got = quantize_pack_triton(x, s).data.view(torch.uint8)
    want = x.to(dt).view(torch.uint8)  # torch's cast (round half to even; |x| <= max here)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------
# NUQ codebooks and dense-and-sparse outliers (KVQuant), bit for bit
# --------------------------------------------------------------------------------------------------


def nuq(bits: int, gran: str = "token", group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="nuq", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


def warped_codebook(bits: int) -> torch.Tensor:
    """A non-uniform codebook (denser near 0, as Fisher-weighted k-means gives), float16, sorted."""
    u = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
    return (u.abs() ** 1.5 * u.sign()).half()


OUTLIER_CASES = [  # (spec, needs a codebook)
    nuq(4, "token"),
    nuq(2, "token", 32),
    nuq(4, "token", None, symmetric=True),
    nuq(4, "channel", 32),
    nuq(3, "channel", 16, outlier_frac=0.05),  # kvquant-3-block
    nuq(3, "token", None, outlier_frac=0.05),
    nuq(4, "channel", 32, outlier_frac=0.02),  # kvquant-*-block keys: block ranges + 1 % (here 2 %) outliers
    nuq(4, "token", None, outlier_frac=0.05),  # kvquant values
    nuq(2, "channel", None, static=True, outlier_frac=0.02),  # static kvquant keys: calibrated ranges
    nuq(4, "channel", None, static=True, symmetric=True),
    spec(4, "token", 32, outlier_frac=0.05),  # integer codes with outliers
    spec(2, "channel", 32, symmetric=True, outlier_frac=0.02),
    spec(4, "channel", None, static=True, outlier_frac=0.02),
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", outlier_frac=0.02),
    TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="tensor", static=True, outlier_frac=0.02),
]


def _static_kw(x: torch.Tensor, s: TensorSpec) -> dict:
    """Calibrated ranges 0.8x narrower than the data (some elements clip and are counted)."""
    if s.kind == "fp8":
        # saturates well inside the bulk (|x| > 22 for e4m3, > 11 for e5m2), beyond the few outliers
        return {"static_scale": torch.tensor(0.05 if s.fmt == "e4m3" else 0.0002)} if s.static else {}
    if not s.static:
        return {}
    lo, hi = x.float().amin(dim=(0, 2)) * 0.8, x.float().amax(dim=(0, 2)) * 0.8
    if s.kind == "nuq":  # NUQ ranges are the range itself (symmetric: the largest magnitude)
        width = torch.maximum(hi.abs(), lo.abs()) if s.symmetric else hi - lo
    else:
        levels = 2 ** (s.bits - 1) - 1 if s.symmetric else 2**s.bits - 1
        width = (torch.maximum(hi.abs(), lo.abs()) if s.symmetric else hi - lo) / levels
    return {"static_scale": width.half(), "static_zero": None if s.symmetric else lo.half()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0.0 for +0.0 and a NaN for no NaN's equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def assert_same_quantized(got, want) -> None:
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert got.scale.shape == want.scale.shape and same_bits(got.scale, want.scale)
    assert (got.zero is None) == (want.zero is None) and (want.zero is None or same_bits(got.zero, want.zero))
    assert (got.outlier_values is None) == (want.outlier_values is None)
    if want.outlier_values is not None:
        assert torch.equal(got.outlier_values, want.outlier_values)
        assert torch.equal(got.outlier_index, want.outlier_index)
    assert (got.codebook is None) == (want.codebook is None)
    assert got.clipped == want.clipped
    assert (got.static, got.shape, got.nbytes) == (want.static, want.shape, want.nbytes)
    assert torch.equal(got.dequantize(), want.dequantize())


@needs_triton
@pytest.mark.parametrize("s", OUTLIER_CASES, ids=str)
def test_quantize_kernel_nuq_and_outliers_bit_for_bit(s: TensorSpec):
    """NUQ codes (nearest codebook entry, ties to the lower) and outliers left out of the ranges and the
    clipped count: the kernel's ``QuantizedTensor`` is the reference's, byte for byte. The hard block has
    constant groups (outliers among equal magnitudes: ``torch.topk``'s ties) and static ranges that clip."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    x = hard_block(torch.Generator().manual_seed(54)).to(DEVICE)
    kw = _static_kw(x, s)
    if s.kind == "nuq":
        kw["codebook"] = warped_codebook(s.bits).to(DEVICE)
    want, got = quantize(x, s, **kw), quantize_pack_triton(x, s, **kw)
    assert_same_quantized(got, want)
    if s.outlier_frac:
        assert got.outlier_values is not None and got.outlier_values.shape[-1] >= 1
    assert (want.clipped > 0) == bool(s.static)


@needs_triton
def test_nuq_codes_at_exact_midpoints_go_to_the_lower_entry():
    """Values placed exactly on codebook midpoints (``u`` = midpoint with no rounding: range [0, 2], so
    ``u = x - 1``) take the lower entry in both paths, as ``torch.bucketize``; one float32 step above
    takes the upper one."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    cb = torch.linspace(-1, 1, 16, dtype=torch.float64).half()  # entries k/7.5 - 1 rounded to float16
    c = cb.float()
    mids = (c[1:] + c[:-1]) / 2
    row = torch.cat([torch.tensor([0.0, 2.0]), mids + 1, torch.nextafter(mids + 1, torch.tensor(3.0))])
    x = torch.cat([row, torch.ones(64 - row.numel())]).reshape(1, 1, 1, 64).repeat(1, 1, 16, 1).to(DEVICE)
    s = nuq(4, "token")
    want = quantize(x, s, codebook=cb.to(DEVICE))
    got = quantize_pack_triton(x, s, codebook=cb.to(DEVICE))
    assert_same_quantized(got, want)
    codes = want.dequantize().float()[0, 0, 0, 2 : 2 + 15]
    assert torch.equal(codes, c[:15].to(DEVICE) + 1)  # each midpoint decoded to its lower entry


@needs_triton
@pytest.mark.parametrize(
    "s", [spec(4, "channel", None, static=True), nuq(4, "channel", None, static=True, outlier_frac=0.02)], ids=str
)
def test_kernel_path_counts_what_zero_static_scales_clip(monkeypatch, s: TensorSpec):
    """The Triton kernel counts values beyond a range; values a zero static scale collapses onto its
    zero-point are counted beside it (outliers left out), so both paths report the same ``clipped``."""
    from kvbits.kernels import quantize as qmod

    x = hard_block(torch.Generator().manual_seed(55)).to(DEVICE)
    kw = _static_kw(x, s)
    kw["static_scale"][1, 3:7] = 0.0
    kw["static_zero"][1, 3:7] = 0.0
    if s.kind == "nuq":
        kw["codebook"] = warped_codebook(s.bits).to(DEVICE)
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    assert qmod.resolve_quantize_kernel(x, s) == "triton"
    want = quantize(x, s, **kw)
    got = qmod.quantize_pack(x, s, **kw)
    assert got.clipped == want.clipped
    kernel_only = qmod.quantize_pack(x, s, zero_scales=False, **kw).clipped  # the caller's promise
    assert 0 < kernel_only < want.clipped
    assert int(qmod.quantize_pack(x, s, sync=False, **kw).clipped) == want.clipped


OUT_SPECS = [
    spec(8, "token"),  # per-token scale and zero-point
    spec(4, "token", 32, symmetric=True),  # per-token groups, no zero-point
    spec(2, "channel", 32),  # per-channel ranges over 32-token groups (KIVI keys)
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` comparable with ``torch.equal``: one-byte codes (uint8, float8) as their bytes."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@needs_triton
@pytest.mark.parametrize("s", OUT_SPECS, ids=str)
def test_quantize_kernel_writes_into_a_token_range_in_place(s: TensorSpec):
    """``out``: a token range of larger tensors, as a cache's reserved slots hold them. The kernel writes the reference's
    codes and ranges there, bit for bit, returns views of them, and leaves every other slot as it was; a layout it
    would address wrongly (sequences interleaved with heads) is not taken: fresh tensors, the same values."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    x = hard_block(torch.Generator().manual_seed(53), n=64).to(DEVICE)  # 2 sequences x 3 heads
    want = quantize(x, s)
    C, at = 160, 64  # reserved tokens; the range [64, 128)
    names = ["data", "scale"] + ([] if want.zero is None else ["zero"])
    slots, views, ranges = {}, {}, {}
    for name in names:
        w = getattr(want, name)
        unit = want.n_tokens // w.shape[2]  # tokens per row of dim 2 (32 for per-channel group ranges)
        shape = (*w.shape[:2], C // unit, *w.shape[3:])
        slots[name] = (torch.full(shape, 7, dtype=torch.uint8).view(w.dtype) if w.dtype.itemsize == 1
                       else torch.full(shape, 7.0, dtype=w.dtype))  # fmt: skip
        ranges[name] = slice(at // unit, at // unit + w.shape[2])
        views[name] = slots[name][:, :, ranges[name]]
    before = {name: t.clone() for name, t in slots.items()}
    got = quantize_pack_triton(x, s, out=views)
    for name in names:
        g, v = getattr(got, name), views[name]
        assert g.data_ptr() == v.data_ptr() and g.stride() == v.stride(), name  # written in place
        assert torch.equal(_bytes(g), _bytes(getattr(want, name))), name
        rest = torch.ones(slots[name].shape[2], dtype=torch.bool)
        rest[ranges[name]] = False
        assert torch.equal(_bytes(slots[name])[:, :, rest], _bytes(before[name])[:, :, rest]), name  # untouched
    # sequences interleaved with heads (a (H, B, ...) store seen as (B, H, ...)): not slabs of (sequence, head)
    bad = dict(views)
    bad["data"] = slots["data"].transpose(0, 1).contiguous().transpose(0, 1)[:, :, ranges["data"]]
    kept = quantize_pack_triton(x, s, out=bad)
    assert kept.data.data_ptr() != bad["data"].data_ptr() and kept.scale.data_ptr() != views["scale"].data_ptr()
    assert torch.equal(_bytes(kept.data), _bytes(want.data)) and torch.equal(kept.scale, want.scale)


@needs_triton
@pytest.mark.parametrize("scheme", ["int8-token", "fp8-e4m3-token", "int4-kivi"])
def test_reserved_flushes_quantize_into_the_slots_bit_for_bit(monkeypatch, scheme: str):
    """A cache with reserved storage (``max_cache_len``) flushing through the kernel (``KVBITS_KERNEL=triton``,
    interpreted here): once the first flush of a side has allocated its slots, every later flush writes its codes
    and ranges straight into them (no copy), and the slots hold, bit for bit, what the torch reference's cache holds.
    The per-token schemes flush at every step."""
    from unittest import mock

    from test_fused_cache import SCHEMES

    from kvbits.cache import QuantizedKVCache
    from kvbits.kernels import triton_quantize

    sch = SCHEMES[scheme]
    g = torch.Generator().manual_seed(54)
    k, v = (torch.randn(2, 2, 48, 32, generator=g) for _ in range(2))

    def run(kernel: str) -> QuantizedKVCache:
        monkeypatch.setenv("KVBITS_KERNEL", kernel)
        cache = QuantizedKVCache(num_layers=1, scheme=sch, max_cache_len=48, checks="eager")
        cache.update(k[:, :, :24], v[:, :, :24], 0)
        for t in range(24, 48):
            cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        return cache

    ref = run("reference")
    in_place = []
    real = triton_quantize.quantize_pack_triton

    def spy(x, spec, **kw):
        qt = real(x, spec, **kw)
        out = kw.get("out")
        in_place.append(out is not None and qt.data.data_ptr() == out["data"].data_ptr())
        return qt

    with mock.patch.object(triton_quantize, "quantize_pack_triton", spy):
        got = run("triton")
    assert in_place.count(False) == 2 and len(in_place) > 2, in_place  # each side's first flush allocates
    if sch.residual == 0:
        assert len(in_place) == 2 * (1 + 24)  # the prefill's flush, then one per step
    for sa, sb in ((ref.layers[0]._k, got.layers[0]._k), (ref.layers[0]._v, got.layers[0]._v)):
        assert sa._slots.keys() == sb._slots.keys() and sa.n_quantized == sb.n_quantized > 0
        for name in sa._slots:
            assert torch.equal(_bytes(sa._slots[name]), _bytes(sb._slots[name])), name


FLOAT16_END_KERNEL_SPECS = [
    spec(8, "token"),
    spec(4, "token", 32, symmetric=True),
    spec(2, "channel", 32),
    spec(8, "channel", 32, symmetric=True),
    nuq(4, "token"),
    nuq(4, "channel", 32, symmetric=True),
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token"),
    TensorSpec(kind="fp8", bits=8, fmt="e5m2", granularity="token"),
]


@needs_triton
@pytest.mark.parametrize("s", FLOAT16_END_KERNEL_SPECS, ids=str)
def test_quantize_kernel_caps_scales_at_float16s_end_as_the_reference(s: TensorSpec):
    """Groups topped at 65504 / 65480: the kernel caps a float16 scale whose top level would decode past
    65504 as ``kvbits.quant.affine._stored_scale`` does, bit for bit, and the result decodes finite."""
    from test_quant import float16_end_block

    from kvbits.kernels.triton_quantize import quantize_pack_triton

    x = float16_end_block().to(DEVICE)
    kw = {"codebook": warped_codebook(s.bits).to(DEVICE)} if s.kind == "nuq" else {}
    if s.kind == "nuq" and not s.symmetric:
        x = x / 2  # asymmetric NUQ stores the range max - min: half of float16's end
    want, got = quantize(x, s, **kw), quantize_pack_triton(x, s, **kw)
    assert_same_quantized(got, want)
    assert got.clipped == want.clipped == 0
    assert bool(torch.isfinite(got.dequantize(torch.float16)).all())


SIGNED_ZERO_SPECS = [spec(4, "token", 16), spec(4, "channel", 16), nuq(4, "token", 16), nuq(4, "channel", 16),
                     spec(4, "channel", 16, outlier_frac=0.1)]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("s", SIGNED_ZERO_SPECS, ids=str)
def test_signed_zero_groups_store_the_same_bits(s: TensorSpec):
    """Groups mixing -0.0 and +0.0: the kernel's float16 scales and zero-points are the reference's bit for bit
    (``torch.equal`` takes -0.0 for +0.0, so compare the bits), all +0.0.

    Before, which zero a group's minimum came out as depended on the reduction order: through the
    interpreter 34 of 64 per-channel zero-points of such a block were +0.0 in the kernel and -0.0 in the
    reference (0x0000 vs 0x8000; decoding the same). Both now turn a zero end of the range into +0.0."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    g = torch.Generator().manual_seed(55)
    x = torch.where(torch.rand(1, 2, 32, 16, generator=g) < 0.5, -0.0, 0.0)
    x[0, 1, 20, 3], x[0, 1, 24, 5] = 1.0, -1.0  # groups with one value beside their signed zeros
    x[0, 0, :16] = -0.0  # groups of -0.0 only
    x = x.to(DEVICE)
    kw = {"codebook": warped_codebook(s.bits).to(DEVICE)} if s.kind == "nuq" else {}
    want, got = quantize(x, s, **kw), quantize_pack_triton(x, s, **kw)
    assert_same_quantized(got, want)
    for name in ("scale", "zero"):
        w, g16 = getattr(want, name), getattr(got, name).reshape(getattr(want, name).shape)
        assert torch.equal(g16.view(torch.int16), w.view(torch.int16)), name
        assert not (w.view(torch.int16) == -32768).any(), name  # no -0.0


@needs_triton
@pytest.mark.parametrize("s", [spec(4, "token", 16, static=True), spec(8, "token", None, static=True, symmetric=True)],
                         ids=str)
def test_static_per_token_scales_are_left_to_the_reference(monkeypatch, s: TensorSpec):
    """A static per-token spec (scales given by the caller; the per-token layout of the kernel computes each group's
    range from the data) goes to the torch reference: before, the kernel took it and ignored the static scale (other
    codes and scales, 0 clipped where the reference counted 1412 at a scale of 0.05)."""
    from kvbits.kernels import quantize as qmod
    from kvbits.kernels.triton_quantize import quantize_pack_triton, supported

    x = hard_block(torch.Generator().manual_seed(61), n=16).to(DEVICE)
    groups = 64 // (s.group_size or 64)
    scale = torch.full((1, 3, 1, groups, 1), 0.05, dtype=torch.float16, device=DEVICE)
    zero = None if s.symmetric else torch.full_like(scale, -0.4)
    assert "static token" in supported(x, s)
    with pytest.raises(NotImplementedError, match="static token"):
        quantize_pack_triton(x, s, static_scale=scale, static_zero=zero)
    monkeypatch.setenv("KVBITS_KERNEL", "triton")
    assert qmod.resolve_quantize_kernel(x, s) == "reference"
    got = qmod.quantize_pack(x, s, static_scale=scale, static_zero=zero)
    want = quantize(x, s, static_scale=scale, static_zero=zero)
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert got.clipped == want.clipped > 0


NAN_SPECS = [spec(4, "token", 16), spec(4, "token", 16, symmetric=True), spec(3, "channel", 8),
             spec(2, "channel", None, static=True), nuq(4, "token", 16), nuq(4, "channel", 8)]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("s", NAN_SPECS, ids=str)
def test_nan_groups_quantize_as_the_reference(s: TensorSpec):
    """A NaN in K/V under ``validate=False`` (the cache's path: its NaN check is lazy): the kernel stores what the
    reference stores, a NaN scale / zero-point for the NaN's group and the no-scale codes, so it decodes NaN
    (under a static range: code 0, as torch's clamp-then-cast gives).

    Before, ``tl.min`` / ``tl.max`` dropped the NaN: the group got a finite range (0.167 where the reference stored
    NaN), the NaN element a garbage code (an int32 cast of NaN packed into its byte's neighbours through the
    interpreter), and the group decoded finite: the NaN vanished from the cache."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(70))
    x[0, 0, 2, 3] = x[0, 1, 9, 0] = float("nan")
    x = x.to(DEVICE)
    kw: dict = {"codebook": warped_codebook(s.bits).to(DEVICE)} if s.kind == "nuq" else {}
    if s.static:
        kw = {"static_scale": torch.full((2, 16), 0.5, dtype=torch.float16, device=DEVICE),
              "static_zero": torch.full((2, 16), -1.0, dtype=torch.float16, device=DEVICE)}  # fmt: skip
    want, got = quantize(x, s, validate=False, **kw), quantize_pack_triton(x, s, **kw)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    for name in ("scale", "zero"):
        w, g16 = getattr(want, name), getattr(got, name)
        if w is not None:
            assert torch.equal(g16.isnan(), w.isnan()) and torch.equal(g16.nan_to_num(), w.nan_to_num()), name
    assert got.clipped == want.clipped
    dw, dg = want.dequantize(), got.dequantize()
    assert torch.equal(dg.isnan(), dw.isnan()) and torch.equal(dg.nan_to_num(), dw.nan_to_num())
    assert bool(dw.isnan().any()) != s.static  # a static range stays finite: the NaN gets code 0 in both


FP8_NAN_SPECS = [TensorSpec(kind="fp8", bits=8, fmt=f, granularity=g, static=g != "token", outlier_frac=o)
                 for f in ("e4m3", "e5m2") for g, o in (("token", 0.0), ("tensor", 0.0), ("token", 0.02))]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("s", FP8_NAN_SPECS, ids=str)
def test_fp8_nan_and_inf_rows_quantize_as_the_reference(s: TensorSpec):
    """NaN, +-inf and values past the format's max in K/V under ``validate=False`` (the cache's path): the FP8
    kernel stores the reference's bytes and scales. A NaN row's scale is NaN (the row encodes at scale 1, the NaN
    as the float8 NaN byte 0x7f with its sign); an inf row's scale is inf (its inf / inf is NaN, so that byte too).

    Before, ``tl.max`` dropped the NaN (row scale 0.00414 where the reference stored NaN, every byte of the row
    different) and a NaN ``y`` went through the finite bit assembly (inf / inf gave 0xb8 for e4m3, not 0xff)."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(71))
    x[0, 0, 2, 3] = x[0, 1, 9, 0] = float("nan")
    x[0, 0, 5, 7] = -float("nan")
    x[0, 0, 7, 1], x[0, 1, 3, 4] = float("inf"), -float("inf")
    x[0, 1, 11, 5], x[0, 1, 12, 6] = 1e4, -6e4  # past both formats' max at the static scale 1
    x = x.to(DEVICE)
    want, got = quantize(x, s, validate=False), quantize_pack_triton(x, s)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    w, g = want.scale.float(), got.scale.float()
    assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num())
    assert got.clipped == want.clipped
    if not s.static:  # outliers take the NaNs and infs out of the rows' ranges
        assert (int(w.isnan().sum()), int(w.isinf().sum())) == ((0, 0) if s.outlier_frac else (3, 2))
