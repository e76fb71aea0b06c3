"""Centred and smoothed keys (``TensorSpec.centre`` / ``smooth``, the ``int*-token-smooth`` presets).

The codes are those of ``(x - mean) / factor`` with calibrated per-(head, channel) vectors; dequantizing
multiplies and shifts back. Tested: the identity transform gives the plain codes; on keys with a biased and
an outlier channel the transform cuts the per-token error several-fold; bad parameters are refused; the
bytes (two float16 ``(H_kv, D)`` vectors per layer) are counted by the planner and held by the cache; the
calibration fits and stores them; the fused path and the quantize kernel leave such sides to the torch path.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from _tinyllama import tiny_llama
from transformers import LlamaForCausalLM

from kvbits.cache import QuantizedKVCache
from kvbits.calibrate import calibrate, load_calibration
from kvbits.calibrate.fit import SMOOTH_FLOOR, fit_side
from kvbits.plan import plan
from kvbits.quant.tensor import quantize
from kvbits.schemes import KVScheme, TensorSpec, get_scheme
from kvbits.schemes.accounting import fixed_layer_bytes

CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
INT4 = TensorSpec(kind="int", bits=4, fmt=None, granularity="token")
SMOOTH4 = dataclasses.replace(INT4, centre=True, smooth=0.5)


def biased_keys(B: int = 2, H: int = 2, n: int = 256, D: int = 64, seed: int = 0) -> torch.Tensor:
    """Gaussian keys ``(B, H, n, D)`` with channel 3 offset by 40 (a ``k_proj`` bias) and channel 7 spread 12x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, n, D, generator=g)
    x[..., 3] += 40.0
    x[..., 7] *= 12.0
    return x


def token_ids(n: int = 1200, seed: int = 0) -> torch.Tensor:
    """``(n,)`` calibration text for ``tiny_llama``."""
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fitted(spec: TensorSpec, x: torch.Tensor, **kw) -> dict[str, torch.Tensor]:
    """``quantize`` keyword arguments fitted on ``x`` ``(B, H, n, D)`` as ``kvbits calibrate`` would."""
    tensors, _ = fit_side(spec, x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3]), **kw)
    return {f"channel_{k}": v for k, v in tensors.items()}


def test_identity_transform_gives_the_plain_codes():
    x = biased_keys()
    H, D = x.shape[1], x.shape[3]
    plain = quantize(x, INT4)
    same = quantize(x, SMOOTH4, channel_mean=torch.zeros(H, D).half(), channel_factor=torch.ones(H, D).half())
    assert torch.equal(plain.data, same.data) and torch.equal(plain.scale, same.scale)
    assert torch.equal(plain.dequantize(), same.dequantize())


@pytest.mark.parametrize("bits", [8, 4])
def test_centring_and_smoothing_cut_the_error_of_biased_outlier_channels(bits: int):
    x = biased_keys(seed=bits)
    calib, test = x[:, :, :128], x[:, :, 128:]  # fitted on one half, measured on the other
    plain = dataclasses.replace(INT4, bits=bits)
    centre = dataclasses.replace(plain, centre=True)
    both = dataclasses.replace(plain, centre=True, smooth=0.5)
    err = {
        name: rel_err(quantize(test, spec, **(fitted(spec, calib) if spec.centre else {})).dequantize(), test)
        for name, spec in (("plain", plain), ("centre", centre), ("both", both))
    }
    assert err["centre"] < err["plain"] / 1.5, err  # the offset no longer takes the range
    assert err["both"] < err["plain"] / 4, err  # nor does the outlier channel
    assert err["both"] > 0  # still quantized


def test_smoothing_alone_divides_by_the_spread_of_each_channel():
    x = biased_keys()
    spec = dataclasses.replace(INT4, smooth=1.0)
    kw = fitted(spec, x)
    assert set(kw) == {"channel_factor"}
    f = kw["channel_factor"].float()  # (H, D); mean 1 over the layer
    assert abs(float(f.mean()) - 1) < 1e-2
    assert bool((f[:, 3] > 3 * f[:, 10]).all()) and bool((f[:, 7] > 3 * f[:, 10]).all())
    y = quantize(x, spec, **kw).dequantize()
    assert rel_err(y, x) < rel_err(quantize(x, INT4).dequantize(), x)


def test_pre_rope_factors_are_tied_over_rope_pairs_on_request():
    """``tie_rope``: a pre-RoPE spec gets one factor per RoPE pair (channels d and d + D/2, the larger spread:
    QServe's rule), which fused decode moves into the query; without it, and for post-RoPE specs, one per
    channel. Channel 7's spread then sets channel 39's factor too; the means stay per channel."""
    x = biased_keys()
    pre = dataclasses.replace(SMOOTH4, pre_rope=True)
    tied, untied, post = fitted(pre, x, tie_rope=True), fitted(pre, x), fitted(SMOOTH4, x, tie_rope=True)
    f, g = tied["channel_factor"].float(), untied["channel_factor"].float()
    assert torch.equal(f[:, :32], f[:, 32:]) and not torch.equal(g[:, :32], g[:, 32:])
    assert torch.equal(untied["channel_factor"], post["channel_factor"])  # post-RoPE: never tied
    assert bool((f[:, 39] > 3 * f[:, 40]).all()) and bool((g[:, 39] < 2 * g[:, 40]).all())
    assert torch.equal(tied["channel_mean"], untied["channel_mean"])
    y = quantize(x, pre, **tied).dequantize()
    assert rel_err(y, x) < 0.5 * rel_err(quantize(x, INT4).dequantize(), x)


def test_calibration_ties_rope_pairs_records_it_and_checks_it(tmp_path):
    """``calibrate(..., tie_rope_pairs=True)`` fits tied pre-RoPE factors, records ``tie_rope_pairs`` and the
    artifact's check refuses factors that differ within a pair; a scheme without smoothed pre-RoPE keys is
    refused before any pass."""
    model = tiny_llama()
    art = calibrate(model, token_ids(), "int4-token-smooth-prerope", context=128, windows=2, tie_rope_pairs=True,
                    out_dir=str(tmp_path / "c"))  # fmt: skip
    assert art.meta["tie_rope_pairs"] is True
    D = art.head_dim
    for i in range(model.config.num_hidden_layers):
        f = art.tensors[f"layers.{i}.key_factor"]
        assert torch.equal(f[:, : D // 2], f[:, D // 2 :])
    loaded = load_calibration(tmp_path / "c", model_config=model.config, scheme="int4-token-smooth-prerope")
    assert loaded.meta["tie_rope_pairs"] is True
    art.tensors["layers.1.key_factor"][0, 0] *= 2
    with pytest.raises(ValueError, match="differs between RoPE pair channels"):
        art.validate()
    with pytest.raises(ValueError, match="has none"):
        calibrate(model, token_ids(), "int4-token-smooth", context=128, windows=2, tie_rope_pairs=True)


def test_a_constant_channel_gets_a_floored_factor():
    x = biased_keys()
    x[..., 5] = 2.0  # constant over every sample: spread 0
    kw = fitted(SMOOTH4, x)
    f = kw["channel_factor"].float()
    ratio = f[:, 5] / f.amax(dim=-1)  # the floor: SMOOTH_FLOOR of the head's largest spread, to the power 0.5
    assert torch.allclose(ratio, torch.full_like(ratio, SMOOTH_FLOOR**0.5), rtol=2e-2), ratio
    y = quantize(x, SMOOTH4, **kw).dequantize()
    assert bool(torch.isfinite(y).all())


def test_a_constant_head_gets_factor_one_logged_and_stays_exact(caplog):
    """A dead head (every sample equal: an all-zero ``k_proj`` head) has no range to smooth: logged with its
    layer and side, factor 1, and the centred head codes to exact zeros."""
    x = biased_keys()
    x[:, 1] = 0.0  # head 1 of 2 is dead
    for spec in (SMOOTH4, dataclasses.replace(INT4, smooth=0.5)):  # centred or not
        with caplog.at_level("WARNING", logger="kvbits.calibrate.fit"):
            tensors, stats = fit_side(spec, x.transpose(0, 1).reshape(2, -1, 64), where="layer 3 key")
        assert "layer 3 key: KV head(s) [1]" in caplog.text and stats["constant_heads"] == 1
        f = tensors["factor"].float()
        assert bool(torch.isfinite(f).all()) and torch.allclose(f[1], f[1, :1].expand(64))  # one value: 1 / mean
        kw = {f"channel_{k}": v for k, v in tensors.items()}
        y = quantize(x, spec, **kw).dequantize()
        assert torch.equal(y[:, 1], x[:, 1]) and rel_err(y[:, 0], x[:, 0]) < 0.1
        caplog.clear()


def test_a_far_quieter_live_head_keeps_a_nonzero_factor():
    """The floor is per head, the mean over the layer: a live head whose spread was 1e-9 of the other's got, at
    ``smooth=1``, a normalised factor ~1e-9 that float16 rounded to 0 (``fit_side`` then raised ZeroDivisionError
    computing ``smooth_spread_db``, and ``x / 0`` would have coded inf). Now at least float16's smallest normal."""
    x = biased_keys()
    x[:, 1] *= 1e-9
    spec = dataclasses.replace(SMOOTH4, smooth=1.0)
    tensors, stats = fit_side(spec, x.transpose(0, 1).reshape(2, -1, 64))
    f = tensors["factor"].float()
    assert float(f.min()) >= torch.finfo(torch.float16).tiny and math.isfinite(stats["smooth_spread_db"])
    y = quantize(x, spec, **{f"channel_{k}": v for k, v in tensors.items()}).dequantize()
    assert bool(torch.isfinite(y).all()) and rel_err(y[:, 0], x[:, 0]) < 0.1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_calibration_samples_are_refused_not_fitted_to_nan(bad: float):
    """One NaN (or inf) sample made the fitted mean of its channel NaN and, through the layer's mean factor,
    every one of the 2 x 64 smoothing factors NaN, returned without a word (``smooth_spread_db`` nan)."""
    x = biased_keys().transpose(0, 1).reshape(2, -1, 64)
    x[0, 5, 3] = bad
    for spec in (SMOOTH4, dataclasses.replace(INT4, smooth=0.5)):
        with pytest.raises(ValueError, match=r"layer 2 key: samples contain non-finite values"):
            fit_side(spec, x, where="layer 2 key")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["int", "nuq"])
def test_non_finite_samples_for_static_ranges_are_named_not_called_an_overflow(kind: str, bad: float):
    """A static int / NUQ spec without smoothing given one NaN (or inf) sample said "1 channel range(s) overflow
    them (head 0 channel 3: [-2.5, nan])" and told to scale the samples down: the samples hold NaN / inf."""
    spec = TensorSpec(kind=kind, bits=4, granularity="channel", static=True)
    x = biased_keys().transpose(0, 1).reshape(2, -1, 64)
    x[0, 5, 3] = bad
    counts = "1 NaN, 0 inf" if math.isnan(bad) else "0 NaN, 1 inf"
    with pytest.raises(ValueError, match=rf"layer 2 key: samples contain non-finite values \({counts}\); static {kind} "):
        fit_side(spec, x, where="layer 2 key")


def test_a_channel_mean_past_float16_is_refused_naming_it():
    """A channel whose mean is past 65504 was stored as an inf float16 mean, and every factor of the layer came
    back NaN (``artifact_from_samples`` then said only "key_mean holds non-finite values")."""
    x = biased_keys().transpose(0, 1).reshape(2, -1, 64)
    x[1, :, 9] += 7e4
    with pytest.raises(ValueError, match=r"layer 2 key: channel means .*\(head 1 channel 9"):
        fit_side(SMOOTH4, x, where="layer 2 key")


def test_missing_or_bad_parameters_are_refused():
    x = biased_keys(n=8)
    H, D = x.shape[1], x.shape[3]
    mean, factor = torch.zeros(H, D).half(), torch.ones(H, D).half()
    with pytest.raises(ValueError, match="needs channel_mean"):
        quantize(x, SMOOTH4, channel_factor=factor)
    with pytest.raises(ValueError, match="needs channel_factor"):
        quantize(x, SMOOTH4, channel_mean=mean)
    with pytest.raises(ValueError, match=r"channel_factor must be \(2, 64\)"):
        quantize(x, SMOOTH4, channel_mean=mean, channel_factor=torch.ones(3, D))
    bad = factor.clone()
    bad[1, 4] = 0
    with pytest.raises(ValueError, match="channel_factor must be finite and > 0"):
        quantize(x, SMOOTH4, channel_mean=mean, channel_factor=bad)
    nan = mean.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="channel_mean"):
        quantize(x, SMOOTH4, channel_mean=nan, channel_factor=factor)


def test_values_the_transform_takes_past_float16_are_refused():
    """A small factor can take (x - mean) / factor past what float16 scales hold (inf scale, NaN rows): refused by
    ``quantize`` and, with the bound lowered at install, by the cache before anything is stored."""
    x = biased_keys(n=8) * 100  # |x| up to a few thousand
    H, D = x.shape[1], x.shape[3]
    tiny = torch.full((H, D), 0.01).half()
    with pytest.raises(ValueError, match=r"as coded, \(x - channel_mean\) / channel_factor.*beyond float16"):
        quantize(x, SMOOTH4, channel_mean=torch.zeros(H, D).half(), channel_factor=tiny)
    model = tiny_llama()
    cache = QuantizedKVCache(config=model.config, scheme="int4-token-smooth")
    Hm, Dm = model.config.num_key_value_heads, model.config.head_dim
    for i in range(model.config.num_hidden_layers):
        cache.set_static_qparams(i, "key", mean=torch.full((Hm, Dm), 5.0), factor=torch.full((Hm, Dm), 0.01))
    bound, why = cache.layers[0].checks.bounds[0]
    assert bound == pytest.approx(65504 * 0.01 - 5.0, rel=1e-3) and "covers (x - mean) / factor" in why
    k = torch.full((1, Hm, 3, Dm), 1000.0)  # within float16, beyond what the factors leave
    with pytest.raises(ValueError, match="covers \\(x - mean\\) / factor"):
        cache.update(k, torch.zeros_like(k), 0)
    cache.update(k / 10, torch.zeros_like(k), 1)  # below the bound: stored


def test_spec_checks_and_json():
    for kind in ({"kind": "fp8", "bits": 8, "fmt": "e4m3"}, {"kind": "nuq", "bits": 4, "fmt": None}, {}):
        with pytest.raises(ValueError, match="centre / smooth apply to integer specs"):
            TensorSpec(**kind, centre=True)
    for alpha in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"smooth is an exponent alpha in \(0, 1\]"):
            dataclasses.replace(INT4, smooth=alpha)
    with pytest.raises(TypeError, match="smooth must be a number"):
        dataclasses.replace(INT4, smooth="0.5")
    with pytest.raises(TypeError, match="centre must be a bool"):
        dataclasses.replace(INT4, centre="yes")
    scheme = get_scheme("int4-token-smooth")
    assert KVScheme.from_json(scheme.to_json()) == scheme
    assert scheme.key.to_dict()["centre"] is True and scheme.key.to_dict()["smooth"] == 0.5
    # specs without the fields keep their JSON (and so the hashes of runs and artifacts made before)
    assert "centre" not in INT4.to_dict() and "smooth" not in INT4.to_dict()
    assert scheme.needs_calibration() == ["key"]


def test_the_vectors_are_counted_once_per_layer_and_held_by_the_cache():
    model = tiny_llama()
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    scheme = get_scheme("int4-token-smooth")
    assert fixed_layer_bytes(scheme.key, H, D) == 2 * H * D * 2 and fixed_layer_bytes(scheme.value, H, D) == 0
    ids = token_ids(200, seed=1)[None]
    art = calibrate(model, token_ids(), scheme, context=128, windows=2)
    cache = QuantizedKVCache(config=cfg, scheme=scheme, calibration=art)
    with torch.no_grad():
        model(ids, **{CACHE_KW: cache}, use_cache=True)
    rep = cache.memory_report()
    planned = plan(cfg, context=ids.shape[1], batch=1, scheme=scheme, dtype_bytes=4)
    assert rep["total_bytes"] == planned["total_bytes"]
    fixed = cache.layers[0].components()["fixed"]
    assert sorted(tuple(t.shape) for t in fixed) == [(H, D), (H, D)] and all(t.dtype == torch.float16 for t in fixed)


def test_calibration_fits_stores_and_checks_the_vectors(tmp_path):
    model = tiny_llama()
    art = calibrate(model, token_ids(), "int4-token-smooth", context=128, windows=2, out_dir=str(tmp_path / "c"))
    n = model.config.num_hidden_layers
    assert sorted(art.tensors) == sorted(f"layers.{i}.key_{w}" for i in range(n) for w in ("factor", "mean"))
    assert all("key_smooth_spread_db" in row for row in art.layer_stats)
    loaded = load_calibration(tmp_path / "c", model_config=model.config, scheme="int4-token-smooth")
    mean, factor = loaded.channel_transform(1, "key")
    assert mean.shape == factor.shape == (1, model.config.num_key_value_heads, 1, art.head_dim)
    assert loaded.channel_transform(1, "value") == (None, None)
    art.tensors["layers.0.key_factor"][0, 0] = 0
    with pytest.raises(ValueError, match="factors <= 0"):
        art.validate()


def test_a_cache_without_the_vectors_refuses_to_quantize():
    model = tiny_llama()
    cache = QuantizedKVCache(config=model.config, scheme="int4-token-smooth")
    assert cache.layers[0].needs_calibration() == ["key channel means", "key smoothing factors"]
    H, D = model.config.num_key_value_heads, model.config.head_dim
    with pytest.raises(ValueError, match="channel means need a centre spec"):
        cache.set_static_qparams(0, "value", mean=torch.zeros(H, D))
    with pytest.raises(ValueError, match=r"channel_factor must be \(H_kv, D\)"):
        cache.set_static_qparams(0, "key", mean=torch.zeros(H, D), factor=torch.ones(H + 1, D))
    with pytest.raises(ValueError, match="smoothing factor must be finite and > 0"):
        cache.set_static_qparams(0, "key", mean=torch.zeros(H, D), factor=-torch.ones(H, D))
    with pytest.raises(ValueError, match="calibrat"), torch.no_grad():
        model(token_ids(64)[None], **{CACHE_KW: cache})


def test_the_quantize_kernel_leaves_the_transform_to_torch_and_fused_decode_takes_keys_only():
    """The Triton flush kernel does not transform channels (the torch reference quantizes such blocks); fused
    decode serves centred / smoothed keys, post-RoPE (``code_basis``) and pre-RoPE (decoded with their vectors
    before RoPE; tests/test_fused_cache.py), and declines smoothed values, whose output it would not move
    back."""
    from kvbits.cache.fused import layout_reason
    from kvbits.kernels.triton_quantize import supported

    assert "centred / smoothed" in supported(biased_keys(n=32).half(), SMOOTH4)
    model = tiny_llama()
    smooth_values = KVScheme("t-smooth-values", key=INT4, value=SMOOTH4)
    smooth_prerope = KVScheme("t-smooth-prerope", key=dataclasses.replace(SMOOTH4, pre_rope=True), value=INT4)
    reasons = {}
    for scheme in (get_scheme("int4-token-smooth"), smooth_values, smooth_prerope):
        cache = QuantizedKVCache(config=model.config, scheme=scheme)
        H, D = model.config.num_key_value_heads, model.config.head_dim
        for i in range(model.config.num_hidden_layers):
            side = "value" if scheme is smooth_values else "key"
            cache.set_static_qparams(i, side, mean=torch.zeros(H, D), factor=torch.ones(H, D))
        with torch.no_grad():
            model(token_ids(40, seed=2)[None], **{CACHE_KW: cache}, use_cache=True)
        reasons[scheme.name] = layout_reason(cache.layers[0])
    assert reasons["int4-token-smooth"] is None
    assert reasons["t-smooth-values"].startswith("centred / smoothed values")
    assert reasons["t-smooth-prerope"] is None


def test_smoothed_decode_saturates_to_float16_range():
    """A row's scale comes from its smoothed absmax (the channel with the small factor); a channel with a large
    factor reaching the top level is multiplied by it: int2 decoded ``[-52384, -52384]`` (within the bound the cache
    accepts for these vectors) to ``[-52384, -inf]``, NaN in attention. Now saturated at -65504, in the torch
    decode and the packed reference alike; float32 keeps the unsaturated value."""
    from kvbits.cache.checks import input_bound
    from kvbits.cache.fixed import channel_bound
    from kvbits.kernels.reference import dequantize_packed, pack_side

    spec = TensorSpec(kind="int", bits=2, fmt=None, granularity="token", symmetric=True, centre=True, smooth=0.5)
    factor, mean = torch.tensor([[0.8, 1.5]]).half(), torch.zeros(1, 2).half()
    x = torch.full((1, 1, 1, 2), -52384.0).half()
    assert 52384.0 <= channel_bound(input_bound(spec, "quantized", 2)[0], "", mean, factor)[0]
    q = quantize(x, spec, channel_mean=mean, channel_factor=factor)
    assert q.dequantize(torch.float16).flatten().tolist() == [-52384.0, -65504.0]
    out = torch.empty(1, 1, 1, 2, dtype=torch.float16)
    assert q.dequantize(torch.float16, out=out).flatten().tolist() == [-52384.0, -65504.0]
    assert q.dequantize(torch.bfloat16).isfinite().all()
    assert q.dequantize(torch.float32)[0, 0, 0, 1] < -65504  # float32 holds it: not clamped
    packed = pack_side([q], "key")
    assert dequantize_packed(packed, torch.float16).flatten().tolist() == [-52384.0, -65504.0]
    # NaN is not hidden by the saturation
    nan_mean = dataclasses.replace(q, channel_mean=torch.tensor([[0.0, float("nan")]]).half())
    assert nan_mean.dequantize(torch.float16)[0, 0, 0, 1].isnan()
