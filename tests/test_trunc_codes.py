"""Codes rounded toward zero (``TensorSpec(rounding="trunc")``) and the ``vllm-int8`` preset (vLLM's
``int8_per_token_head``).

The reference below is vLLM's write kernel (``_reshape_cache_per_token_head``) restated in float32 torch: a
scale ``max(absmax / 127, 1e-6)`` per token and head, then ``clamp(x * (1 / scale), -128, 127)`` stored into
an int8 cache, which Triton's float-to-int cast truncates (``tests/test_aot.py`` reads that instruction from
the sm_90 compile).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvbits.cli import _spec_str
from kvbits.export import vllm_cache_args
from kvbits.quant import quantize, unpack_bits
from kvbits.schemes import KVScheme, TensorSpec, get_scheme
from kvbits.schemes.accounting import quantized_bytes

TRUNC = TensorSpec(kind="int", bits=8, fmt=None, symmetric=True, rounding="trunc")
VLLM8 = dataclasses.replace(TRUNC, scale_dtype="fp32")  # the preset: vLLM's float32 scale kept as it is
NEAREST = TensorSpec(kind="int", bits=8, fmt=None, symmetric=True)


def vllm_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-(token, head) INT8 write for ``x`` ``(..., D)``: ``(signed codes, float32 scale)``."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-6)
    return torch.trunc((xf * (1.0 / scale)).clamp(-128.0, 127.0)), scale


def rows(seed: int = 0) -> torch.Tensor:
    """``(1, 3, 64, 64)``: Gaussian rows, rows with one large channel (Qwen2-like keys), a zero row and a
    row whose magnitudes lie under ``127 * 1e-6`` (vLLM's floor scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, 64, 64, generator=g)
    x[:, 1, :, 5] += 40.0
    x[:, 2, 0] = 0.0
    x[:, 2, 1] = torch.linspace(-5e-5, 5e-5, 64)
    return x


def codes_of(qt) -> torch.Tensor:
    return unpack_bits(qt.data, 8, qt.shape[-1]).long() - 127


def test_codes_are_vllms_truncated_codes():
    x = rows()
    qt = quantize(x, TRUNC)
    want, scale = vllm_int8(x)
    assert torch.equal(codes_of(qt), want.long())
    # nearest rounding would differ in about half the codes: the test can tell the two apart
    assert (codes_of(quantize(x, NEAREST)) != want.long()).float().mean() > 0.3
    # the scale is vLLM's float32 scale stored to the nearest float16
    assert torch.equal(qt.scale.reshape(scale.shape), scale.to(torch.float16))


def test_decode_is_vllms_within_six_percent_of_a_step():
    """The float16 scale (nearest) is within 2**-11 of vLLM's float32 one: 127 * 2**-11 = 6.2 % of a step at
    the largest code."""
    x = rows(1)
    qt = quantize(x, TRUNC)
    want, scale = vllm_int8(x)
    dec = qt.dequantize(torch.float64)
    normal = scale.expand_as(dec) > 1e-4  # float16 subnormal scales (the near-zero rows) are coarser
    gap = ((dec - want.double() * scale.double()).abs() / scale.double())[normal]
    assert 127 * 2.0**-12 < gap.max() <= 127 * 2.0**-11 * 1.001, gap.max()


def test_float32_scales_decode_as_vllm_bit_for_bit():
    """``scale_dtype="fp32"`` (the preset) stores vLLM's float32 scale itself: same codes, same scale, and
    ``(code - 127) * scale`` is vLLM's decode exactly, the floor-scale rows included."""
    x = rows(1)
    qt = quantize(x, VLLM8)
    want, scale = vllm_int8(x)
    assert qt.scale.dtype == torch.float32 and torch.equal(qt.scale.reshape(scale.shape), scale)
    assert torch.equal(codes_of(qt), want.long())
    assert torch.equal(qt.dequantize(torch.float32), want * scale)
    # the float16-scale variant does not (the test can tell them apart)
    assert not torch.equal(quantize(x, TRUNC).dequantize(torch.float32), want * scale)


def test_float16_scales_are_capped_near_float16s_end():
    """The float16 scale decodes the top code within 65504, as every other float16 scale (``_stored_scale``).

    Before, vLLM's float32 scale went to the *nearest* float16 uncapped: a row with ``|x|`` = 65504 stored
    516.0 (65504 / 127 = 515.78), code 127 decoded to ``127 * 516 = 65532``, inf in float16 K/V (and -inf for
    -65504). Now the scale is 515.5 (65468.5, 65472 in float16); the codes stay vLLM's, and the decode stays
    within ``127 * 2**-10`` steps of vLLM's (the cap is one float16 step below the nearest at most)."""
    tops = torch.linspace(65000.0, 65504.0, 64)
    x = torch.zeros(1, 1, 64, 16)
    x[0, 0, :, 0], x[0, 0, :, 1], x[0, 0, :, 2] = tops, -tops, tops / 3
    x16 = x.half()
    for inp in (x16, x):
        qt = quantize(inp, TRUNC)
        assert torch.isfinite(qt.dequantize(torch.float16)).all()
        assert (qt.scale.float() * 127 <= 65504).all()
        want, scale = vllm_int8(inp)
        assert torch.equal(codes_of(qt), want.long())
        gap = (qt.dequantize(torch.float64) - want.double() * scale.double()).abs() / scale.double()
        assert gap.max() <= 127 * 2.0**-10, gap.max()
    qt = quantize(x16[:, :, -1:], TRUNC)  # |x| = 65504 exactly
    assert qt.scale.item() == 515.5 and qt.dequantize(torch.float16)[0, 0, 0, :2].tolist() == [65472.0, -65472.0]


def test_decode_bound_holds_for_normal_float16_scales_only():
    """The ``c * 2**-11`` steps of ``trunc_symmetric``'s docstring hold where the float16 scale is normal
    (``>= 2**-14``, ``absmax >= 127 * 2**-14`` = 7.8e-3); it stated them for every scale, but a subnormal one is
    coarser: 0.27 steps at ``absmax`` 2.2e-4 (documentation fix: the decode itself is unchanged)."""
    amax = torch.logspace(-4, 1, 200)
    x = torch.linspace(-1.0, 1.0, 16) * amax[:, None]
    qt = quantize(x.reshape(1, 1, 200, 16), TRUNC)
    want, scale = vllm_int8(x.reshape(1, 1, 200, 16))
    gap = ((qt.dequantize(torch.float64) - want.double() * scale.double()).abs() / scale.double()).amax(-1)
    normal = (qt.scale.float() >= 2.0**-14).reshape(gap.shape)
    assert normal.any() and (~normal).any()
    assert gap[normal].max() <= 127 * 2.0**-11 * 1.001, gap[normal].max()
    assert gap[~normal].max() > 0.2  # the subnormal scales: far past the bound


def test_truncation_moves_every_value_toward_zero_by_up_to_a_step():
    """|decoded| <= |x| (to the float16 scale's rounding), the error is below one step, its mean is half a
    step toward zero, and the squared error is about 4x that of nearest rounding (uniform on a step against
    uniform on half a step either side: 1/3 against 1/12)."""
    x = rows(2)[:, :2]  # the Gaussian rows and the outlier-channel rows
    step = x.abs().amax(-1, keepdim=True) / 127
    dec = quantize(x, TRUNC).dequantize(torch.float64)
    err = (dec - x.double()) / step.double()
    assert (dec.abs() <= x.double().abs() * (1 + 2.0**-11) + 1e-12).all()
    assert err.abs().max() < 1.0 + 127 * 2.0**-11  # a step, plus the float16 scale's rounding at code 127
    toward = (-torch.sign(x.double()) * err)[x != 0]
    assert 0.45 < toward.mean().item() < 0.55, toward.mean()
    near = (quantize(x, NEAREST).dequantize(torch.float64) - x.double()) / step.double()
    ratio = err.pow(2).mean() / near.pow(2).mean()
    assert 3.5 < ratio.item() < 4.5, ratio
    assert near.abs().max() <= 0.5 + 2.0**-6  # nearest: half a step (its scale is rounded up)


def test_floor_scale_rows_clip_and_are_counted():
    """A row whose largest magnitude is under 127 * 1e-6 gets vLLM's floor scale 1e-6, so its codes are
    x / 1e-6 truncated; a row of zeros decodes to zeros."""
    x = torch.zeros(1, 1, 3, 64)
    x[0, 0, 1] = torch.linspace(-5e-5, 5e-5, 64)
    x[0, 0, 2] = torch.linspace(-3e-4, 3e-4, 64)  # max 3e-4 > 1.27e-4: a scale of its own
    qt = quantize(x, TRUNC)
    codes = codes_of(qt)[0, 0]
    assert (codes[0] == 0).all() and (qt.dequantize(torch.float32)[0, 0, 0] == 0).all()
    assert torch.equal(codes[1], torch.trunc(x[0, 0, 1].float() * (1.0 / torch.tensor(1e-6))).long())
    assert codes[1].abs().max() == 50 and qt.clipped == 0


def test_bytes_and_preset():
    s = get_scheme("vllm-int8")
    assert s.key == s.value == VLLM8 and (s.sinks, s.residual, s.block) == (0, 0, 1)
    B, H, n, D = 2, 3, 16, 64
    x = torch.randn(B, H, n, D)
    qt = quantize(x, s.key)
    # one byte per element and a float32 scale per token and head, as vLLM's cache holds them
    assert qt.nbytes == quantized_bytes(s.key, n, H, D) * B == B * H * n * (D + 4)
    # the float16-scale variants: 2 bytes less per token and head
    for spec in (TRUNC, NEAREST):
        assert quantize(x, spec).nbytes == quantized_bytes(spec, n, H, D) * B == B * H * n * (D + 2)


def test_cache_serves_the_preset_with_its_error():
    """Through the cache (flushes, torch reference on CPU) the preset's history equals quantizing it at once,
    and its error is visible: larger than nearest rounding's."""
    from transformers import LlamaConfig

    from kvbits.cache import QuantizedKVCache

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=32)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    errs = {}
    for name, spec in (("trunc", TRUNC), ("nearest", NEAREST)):
        cache = QuantizedKVCache(config=cfg, scheme=KVScheme(name, key=spec, value=spec))
        kk, vv = cache.update(k[:, :, :32], v[:, :, :32], 0)
        kk, vv = cache.update(k[:, :, 32:], v[:, :, 32:], 0)
        assert torch.equal(kk, quantize(k, spec).dequantize(kk.dtype))
        errs[name] = (kk - k).pow(2).mean().item() + (vv - v).pow(2).mean().item()
    assert errs["trunc"] > 3 * errs["nearest"] > 0, errs


def test_spec_rules_json_and_export():
    for kw in (
        {"kind": "int", "bits": 8, "fmt": None},  # asymmetric
        {"kind": "nuq", "bits": 4, "fmt": None, "symmetric": True},
        {"kind": "fp8", "bits": 8, "fmt": "e4m3"},
        {"kind": "int", "bits": 8, "fmt": None, "symmetric": True, "granularity": "channel", "static": True},
    ):
        with pytest.raises(ValueError, match="rounding='trunc' applies to dynamic symmetric integer specs"):
            TensorSpec(**kw, rounding="trunc")
    with pytest.raises(ValueError, match="rounding must be one of"):
        TensorSpec(kind="int", bits=8, fmt=None, symmetric=True, rounding="floor")
    with pytest.raises(TypeError, match="rounding must be a str"):
        TensorSpec(kind="int", bits=8, fmt=None, symmetric=True, rounding=None)
    assert "rounding" not in NEAREST.to_dict()  # older specs keep their JSON and hashes
    scheme = KVScheme("x", key=TRUNC, value=NEAREST)
    assert KVScheme.from_json(scheme.to_json()) == scheme
    assert json.loads(scheme.to_json())["key"]["rounding"] == "trunc"
    assert _spec_str(TRUNC) == "int8 sym trunc per-token"
    assert _spec_str(VLLM8) == "int8 sym trunc fp32-scales per-token"
    args = vllm_cache_args("vllm-int8,0=fp16")
    assert args.cli() == ["--kv-cache-dtype", "int8_per_token_head", "--kv-cache-dtype-skip-layers", "0",
                          "--attention-backend", "TRITON_ATTN"]  # fmt: skip
    assert any("toward zero" in n and "float32" in n for n in args.notes)
    with pytest.raises(ValueError, match="no KV-cache format"):  # rounded INT8 is not what vLLM stores
        vllm_cache_args(KVScheme("int8-round", key=NEAREST, value=NEAREST))
