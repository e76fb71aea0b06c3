"""Float32 scales and zero-points (``TensorSpec(scale_dtype="fp32")``): what vLLM's per-token-head caches store.

The default keeps every dynamic scale and zero-point in float16, rounded outward; ``"fp32"`` keeps them in
float32 as computed (4 bytes each), for dynamic integer and FP8 specs. Checked here: the spec's rules and JSON,
that the quantizer stores float32 metadata and decodes within its grid, that bytes follow (quantized blocks, the
planner's formula, the cache's memory report), and that the Triton quantize kernel leaves these specs to the
torch reference. The fused decode over them is in tests/test_kernels.py and tests/test_fused_cache.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvbits.cli import _spec_str
from kvbits.quant import quantize
from kvbits.schemes import KVScheme, TensorSpec, get_scheme, layer_bytes, token_split
from kvbits.schemes.accounting import per_block_meta_bytes, quantized_bytes


def ispec(bits: int, gran: str = "token", group: int | None = None, **kw) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity=gran, group_size=group, **kw)


WIDE = [
    ispec(4, "token", 32, scale_dtype="fp32"),  # asymmetric: scale and zero-point in float32
    ispec(2, "channel", 16, scale_dtype="fp32"),  # KIVI keys
    ispec(8, "token", symmetric=True, scale_dtype="fp32"),
    ispec(4, "head", scale_dtype="fp32"),
    TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="token", scale_dtype="fp32"),
]


def test_rules_and_json():
    for kw in (
        {"kind": "float", "bits": 16, "fmt": "fp16"},
        {"kind": "nuq", "bits": 4, "fmt": None},
        {"kind": "int", "bits": 8, "fmt": None, "granularity": "channel", "static": True},
        {"kind": "fp8", "bits": 8, "fmt": "e4m3", "granularity": "tensor", "static": True},
        {"kind": "int", "bits": 4, "fmt": None, "integer_zero": True},
    ):
        with pytest.raises(ValueError, match="scale_dtype='fp32' applies to dynamic integer"):
            TensorSpec(**kw, scale_dtype="fp32")
    with pytest.raises(ValueError, match=r"scale_dtype must be one of \('fp16', 'fp32'\)"):
        ispec(8, scale_dtype="bf16")
    with pytest.raises(TypeError, match="scale_dtype must be a str"):
        ispec(8, scale_dtype=32)
    assert "scale_dtype" not in ispec(8).to_dict()  # older specs keep their JSON, run and artifact hashes
    scheme = KVScheme("x", key=WIDE[1], value=WIDE[0], block=16)
    assert KVScheme.from_json(scheme.to_json()) == scheme
    assert json.loads(scheme.to_json())["key"]["scale_dtype"] == "fp32"
    assert (WIDE[0].scale_bytes, ispec(4).scale_bytes) == (4, 2)
    assert _spec_str(WIDE[0]) == "int4 asym fp32-scales per-token g32"


@pytest.mark.parametrize("s", WIDE, ids=_spec_str)
def test_float32_metadata_decodes_within_its_grid_and_bytes_follow(s: TensorSpec):
    g = torch.Generator().manual_seed(3)
    B, H, n, D = 2, 3, 32, 64
    x = torch.randn(B, H, n, D, generator=g) * (1 + 6 * (torch.arange(D) < 4))  # outlier channels
    qt = quantize(x, s)
    narrow = quantize(x, dataclasses.replace(s, scale_dtype="fp16"))
    assert qt.scale.dtype == torch.float32 and (qt.zero is None or qt.zero.dtype == torch.float32)
    assert qt.clipped == 0  # a dynamic range covers its group
    # bytes: the formula, and 2 more per scale / zero-point than the float16 spec holds
    n_meta = qt.scale.numel() + (qt.zero.numel() if qt.zero is not None else 0)
    planned = B * (quantized_bytes(s, n, H, D) + per_block_meta_bytes(s, H))  # head: one scale set per block
    assert qt.nbytes == planned == narrow.nbytes + 2 * n_meta
    err = (qt.dequantize(torch.float64) - x.double()).abs()
    assert err.max() > 0  # it quantized
    if s.kind == "int" and s.granularity == "token":  # within half a step of the float32 scale (+ rounding)
        g = s.group_size or D
        step = qt.scale.double().reshape(B, H, n, D // g, 1)
        assert (err.reshape(B, H, n, D // g, g) <= step * (0.5 + 1e-5) + 1e-6).all()
    if s.kind == "int":  # float16 scales are rounded up (a coarser step): float32's error is not larger
        assert err.pow(2).mean() <= (narrow.dequantize(torch.float64) - x.double()).pow(2).mean() * (1 + 1e-6)


def test_constant_and_empty_blocks():
    s = WIDE[0]
    x = torch.full((1, 2, 4, 64), 0.1234567)  # not a float16 value: float32 zero-points hold it exactly
    qt = quantize(x, s)
    assert torch.equal(qt.dequantize(torch.float32), x) and qt.clipped == 0
    empty = quantize(torch.zeros(1, 2, 0, 64), s)
    assert empty.dequantize(torch.float32).shape == (1, 2, 0, 64) and empty.nbytes == 0
    fp8 = quantize(torch.zeros(1, 1, 2, 64), WIDE[-1])  # a zero row: scale 0, decodes to zeros
    assert torch.equal(fp8.dequantize(torch.float32), torch.zeros(1, 1, 2, 64)) and fp8.clipped == 0


def test_cache_holds_the_planned_bytes():
    """Through ``QuantizedKVCache`` (sinks, residual window, flushes): the memory report equals the planner's
    formula, and the cache holds float32 scales for the float32 sides only."""
    from transformers import LlamaConfig

    from kvbits.cache import QuantizedKVCache

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=32)  # fmt: skip
    scheme = KVScheme("wide", key=WIDE[1], value=ispec(4, "token", 32), sinks=2, residual=8, block=16)
    cache = QuantizedKVCache(config=cfg, scheme=scheme)
    g = torch.Generator().manual_seed(0)
    T = 75
    cache.update(torch.randn(1, 2, T, 32, generator=g), torch.randn(1, 2, T, 32, generator=g), 0)
    rep = cache.memory_report()
    assert token_split(scheme, T).quantized > 0
    want = layer_bytes(scheme, T, batch=1, n_heads=2, head_dim=32, full_dtype_bytes=4)
    assert rep["total_bytes"] == want["key"] + want["value"]
    narrow = layer_bytes(scheme.replace(key=dataclasses.replace(WIDE[1], scale_dtype="fp16")), T, batch=1,
                         n_heads=2, head_dim=32, full_dtype_bytes=4)  # fmt: skip
    assert want["key"] > narrow["key"] and want["value"] == narrow["value"]
    layer = cache.layers[0]
    assert {c.scale.dtype for c in layer._k.chunks} == {torch.float32}
    assert {c.scale.dtype for c in layer._v.chunks} == {torch.float16}


def test_presets_and_the_triton_quantize_kernel():
    from kvbits.kernels.triton_quantize import supported

    for name in ("vllm-int8", "vllm-fp8-token"):
        s = get_scheme(name)
        assert s.key.scale_dtype == s.value.scale_dtype == "fp32"
        assert supported(torch.zeros(1, 1, 16, 64), s.key) is not None  # vllm-int8: its truncation, first
    assert "fp32 scales" in supported(torch.zeros(1, 1, 16, 64), WIDE[-1])
    assert get_scheme("fp8-e4m3-token").key.scale_dtype == "fp16"
    assert supported(torch.zeros(1, 1, 16, 64), get_scheme("fp8-e4m3-token").key) is None
