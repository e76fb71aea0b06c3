"""`QuantizedKVCache` served beyond its calibration, and the arguments transformers hands it.

- Past the calibration artifact's ``max_calibrated_length`` the cache logs one warning per artifact (not per
  cache, layer or step: a server makes a cache per request), through ``generate`` or direct ``update`` calls; clipping more than ``CLIP_WARN_FRAC`` of
  a layer's keys or values against static scales is logged once too (eager and lazy checks), and so is clipping
  under vLLM's integer zero-points (a token whose range excludes 0), in its own words, once per cache.
- ``crop`` / ``reorder_cache`` (cache and layer) refuse what transformers never passes with a ``TypeError`` /
  ``ValueError`` saying what was expected, and leave the cache as it was; what transformers allows (a
  ``beam_idx`` of another length, a positive crop past the end) still works.
"""

from __future__ import annotations

import functools
import inspect
import logging

import numpy as np
import pytest
import torch
import transformers
from _tinyllama import tiny_llama
from transformers import DynamicCache

from kvbits.cache import QuantizedKVCache, QuantizedKVLayer, StaticQuantizedKVCache
from kvbits.cache import checks as kv_checks
from kvbits.schemes import KVScheme, TensorSpec, get_scheme

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")

CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
# static per-tensor FP8 scales (calibrated: amax / 448), every token flushed
STATIC = get_scheme("fp8-e4m3")
CALIBRATED = 24  # the artifact's max_calibrated_length


def rand_kv(B: int, T: int, seed: int, H: int = 2, D: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(seed))


@functools.cache
def model_and_artifact():
    """The tiny Llama and an artifact for ``STATIC`` fitted on its K/V over 64 tokens (post-RoPE keys, as stored;
    ranges widened 2x so quantized inputs never clip), recorded as calibrated up to ``CALIBRATED`` tokens."""
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    model = tiny_llama()
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids(64), **{CACHE_KW: ref})
    keys = [torch.cat([layer.keys, 2 * layer.keys], dim=2) for layer in ref.layers]
    values = [torch.cat([layer.values, 2 * layer.values], dim=2) for layer in ref.layers]
    meta = {"model": describe_model(model.config), "data": {"name": "t", "tokens": 128, "context": CALIBRATED}}
    art = artifact_from_samples(STATIC, keys, values, meta=meta)
    assert art.max_calibrated_length == CALIBRATED
    return model, art


def sample_artifact(context: int = CALIBRATED):
    """A ``STATIC`` artifact from random samples (2 layers, 2 heads of 16 channels), no model."""
    from kvbits.calibrate import artifact_from_samples

    k, v = rand_kv(1, 64, seed=3)
    meta = {"data": {"name": "t", "tokens": 64, "context": context}}
    return artifact_from_samples(STATIC, [4 * k, 4 * k], [4 * v, 4 * v], meta=meta)


def warnings_of(caplog, text: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ------------------------------------------------------------------------------- beyond the calibrated length
@torch.no_grad()
def test_generate_past_calibrated_length_warns_once(caplog):
    """``generate`` with a calibrated cache: nothing logged up to the calibrated length; past it one warning
    for the whole cache (2 layers, 11 more steps), naming the length reached, the calibrated length, the
    scheme and what to do."""
    model, art = model_and_artifact()
    kw = {"do_sample": False, "pad_token_id": 0}
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        within = QuantizedKVCache(config=model.config, scheme=STATIC, calibration=art)
        model.generate(ids(16), **{CACHE_KW: within}, max_new_tokens=9, **kw)  # 16 + 8 cached = 24
        assert within.get_seq_length() == CALIBRATED
        assert warnings_of(caplog) == []
        past = QuantizedKVCache(config=model.config, scheme=STATIC, calibration=art)
        model.generate(ids(16), **{CACHE_KW: past}, max_new_tokens=20, **kw)  # 16 + 19 cached = 35
    assert past.get_seq_length() == 35
    msgs = warnings_of(caplog)
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert msg.startswith("QuantizedKVCache (scheme fp8-e4m3): 25 tokens cached, past the 24-token context")
    assert "calibration_report()" in msg and "positions_beyond_calibrated" in msg
    assert "Calibrate with --context at the longest context served to cover every position." in msg
    assert "once per calibration artifact" in msg
    rows = past.calibration_report()["layers"]
    assert [r["positions_beyond_calibrated"] for r in rows] == [11, 11]
    assert [r["clipped_keys"] for r in rows] == [0, 0]  # the widened ranges: no clipping warning either


def test_length_warning_once_per_cache_and_artifact(caplog):
    """Direct ``update`` calls: exactly at the calibrated length nothing, one token past it one warning
    (the prefill that crosses it names its length), none for later steps, other layers, ``reset()`` and a
    new request; installing an artifact again arms it again. No artifact: no length, nothing said."""
    cache = QuantizedKVCache(scheme=STATIC, num_layers=2, calibration=sample_artifact())
    k, v = rand_kv(1, 60, seed=4)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        for layer in (0, 1):
            cache.update(k[:, :, :CALIBRATED], v[:, :, :CALIBRATED], layer)
        assert warnings_of(caplog, "tokens cached") == []
        for t in range(CALIBRATED, 40):
            for layer in (0, 1):
                cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], layer)
        assert len(warnings_of(caplog, "tokens cached")) == 1
        assert "25 tokens cached, past the 24-token context" in warnings_of(caplog, "tokens cached")[0]
        cache.reset()
        for layer in (0, 1):
            cache.update(k, v, layer)
        assert len(warnings_of(caplog, "tokens cached")) == 1  # once per artifact
        again = QuantizedKVCache(scheme=STATIC, num_layers=2, calibration=cache.calibration)  # the next request
        for layer in (0, 1):
            again.update(k, v, layer)
        assert len(warnings_of(caplog, "tokens cached")) == 1
        assert again.calibration_report()["layers"][0]["positions_beyond_calibrated"] == 60 - CALIBRATED
        caplog.clear()
        cache.install_calibration(sample_artifact(context=50))
        cache.update(k[:, :, :1], v[:, :, :1], 0)  # 61 tokens: past the new 50
        assert [m.split(",")[0] for m in warnings_of(caplog, "tokens cached")] == [
            "QuantizedKVCache (scheme fp8-e4m3): 61 tokens cached"
        ]
        caplog.clear()
        plain = QuantizedKVCache(scheme="kivi-2", num_layers=1)
        plain.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), 0)
        assert plain.max_calibrated_length is None and warnings_of(caplog) == []


def test_length_check_is_one_int_comparison():
    """The per-step cost: without an artifact, or once warned, ``update`` compares against ``sys.maxsize``."""
    import sys

    cache = QuantizedKVCache(scheme=STATIC, num_layers=2, calibration=sample_artifact())
    assert cache._warn_past == CALIBRATED
    k, v = rand_kv(1, 30, seed=5)
    cache.update(k, v, 0)
    assert cache._warn_past == sys.maxsize
    assert QuantizedKVCache(scheme="kivi-2", num_layers=1)._warn_past == sys.maxsize


def test_calibration_of_another_layer_count_is_refused(caplog):
    """A 2-layer artifact: a cache that knows its layers (``num_layers=``) and has another count refuses it when it is
    installed, before anything is logged (not silently for fewer layers, not "layer must be an int in [0, 2)" for
    more); a lazy cache (no config, no ``num_layers``) refuses the first layer the artifact has no parameters for."""
    from kvbits.cache.static import StaticQuantizedKVCache

    art = sample_artifact(context=8)  # shorter than the static cache's reservation: it would warn
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        for n in (1, 3):
            with pytest.raises(ValueError, match=f"calibration has 2 layers; this cache has {n} "):
                QuantizedKVCache(scheme=STATIC, num_layers=n, calibration=art)
            with pytest.raises(ValueError, match=f"calibration has 2 layers; this cache has {n} "):
                StaticQuantizedKVCache(None, STATIC, max_cache_len=64, num_layers=n, calibration=art)
    assert warnings_of(caplog) == [] and art.logged == set()
    lazy = QuantizedKVCache(scheme=STATIC, calibration=art)
    k, v = rand_kv(1, 4, seed=7)
    for layer in (0, 1):
        lazy.update(k, v, layer)
    with pytest.raises(ValueError, match=r"calibration has 2 layers; this model has at least 3 \(the cache is creating "
                       r"layer 2\)"):
        lazy.update(k, v, 2)


@pytest.mark.parametrize("scheme", ["fp8-e4m3-head", "fp8-e4m3", "int4-token-smooth"])
def test_calibration_of_another_head_count_is_refused_without_a_config(scheme):
    """An artifact calibrated on 1 KV head, served by a cache without a config (lazy, or ``num_layers=``) to a model
    of 2: refused at the layer's first update. Before, its per-tensor / per-head scales or per-channel vectors broadcast over
    both heads and one head's ranges were served to the other without a word (a config caught it already)."""
    from kvbits.cache.static import StaticQuantizedKVCache
    from kvbits.calibrate import artifact_from_samples

    sch = get_scheme(scheme)
    k1, v1 = rand_kv(1, 64, seed=3, H=1)
    art = artifact_from_samples(sch, [4 * k1, 4 * k1], [4 * v1, 4 * v1], meta={"data": {"name": "t", "context": 64}})
    assert (art.num_kv_heads, art.head_dim) == (1, 16)
    k, v = rand_kv(1, 4, seed=7)  # 2 heads of 16 channels
    caches = [QuantizedKVCache(scheme=sch, calibration=art), QuantizedKVCache(scheme=sch, num_layers=2, calibration=art)]
    if sch.key.kind == "fp8":  # the static cache holds FP8 static scales
        caches.append(StaticQuantizedKVCache(None, sch, max_cache_len=16, num_layers=2, calibration=art))
    for cache in caches:
        with pytest.raises(ValueError, match=r"made for 1 KV heads of dim 16; layer 0 of this model has 2 KV heads of "
                                             r"dim 16: re-run kvbits calibrate"):  # fmt: skip
            cache.update(k, v, 0)
    same = QuantizedKVCache(scheme=sch, calibration=art)
    same.update(k[:, :1], v[:, :1], 0)  # the artifact's own shape: served
    assert same.get_seq_length() == 4


# ------------------------------------------------------------------------------- clipping against static scales
def test_clipping_warning_eager_once(caplog):
    """FP8 E4M3 with its uncalibrated scale 1.0 saturates beyond 448. Under the warning level (one value of
    2560): nothing; over it: one warning for the cache, naming layer, side and fraction, not repeated by
    more clipping steps in any layer. The counts stay in ``calibration_report()``."""
    k, v = rand_kv(1, 40, seed=6, D=64)
    cache = QuantizedKVCache(scheme="fp8-e4m3", num_layers=2, checks="eager")
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        one = k[:, :, :20].clone()
        one[0, 0, 3, 5] = 1000.0
        cache.update(one, v[:, :, :20], 0)
        cache.update(k[:, :, :20], v[:, :, :20], 1)
        assert cache.calibration_report()["layers"][0]["clipped_keys"] == 1
        assert warnings_of(caplog) == []  # 1 / 2560 is under 0.1 %
        for t in range(20, 40):
            for layer in (0, 1):
                cache.update(k[:, :, t : t + 1] * 1000, v[:, :, t : t + 1], layer)
    msgs = warnings_of(caplog)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("QuantizedKVCache (scheme fp8-e4m3): layer 0 clipped ")
    assert "% of its keys (" in msgs[0] and "of 2688 quantized values) against their static scales" in msgs[0]
    assert "(warning level 0.1%)" in msgs[0] and "calibration_report()" in msgs[0]
    assert all(layer.clip_watch is None for layer in cache.layers)  # said: no more cost per flush


def test_clipping_warning_lazy_at_the_check(caplog):
    """Lazy checks keep the counts on the device: nothing is read per step; the warning comes with the
    lazy check (every ``check_every`` steps), once, and reports do not repeat it."""
    k, v = rand_kv(1, 10, seed=7, D=64)
    cache = QuantizedKVCache(scheme="fp8-e4m3", num_layers=2, checks="lazy", check_every=4)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        for t in range(4):
            for layer in (0, 1):
                cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1] * (1000 if layer else 1), layer)
        assert warnings_of(caplog) == []  # not checked yet
        cache.update(k[:, :, 4:5], v[:, :, 4:5], 0)  # 4 steps since the last check: the lazy check runs
        assert len(warnings_of(caplog)) == 1
        assert "layer 1 clipped" in warnings_of(caplog)[0] and "% of its values (" in warnings_of(caplog)[0]
        cache.update(k[:, :, 4:5], v[:, :, 4:5] * 1000, 1)
        cache.calibration_report()
        cache.check_inputs()
    assert len(warnings_of(caplog)) == 1
    assert isinstance(cache.layers[1].clipped_counts()[1], torch.Tensor)  # kept on the device (no sync per step)


def test_clipping_warning_once_per_artifact(caplog):
    """Two caches (two requests) serving one artifact past its ranges: one clipping warning in all; both
    reports still count their own clipped values. Another artifact is said again."""
    k, v = rand_kv(1, 20, seed=11)
    art = sample_artifact(context=100)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        caches = [QuantizedKVCache(scheme=STATIC, num_layers=2, calibration=art, checks="eager") for _ in range(2)]
        for cache in caches:
            for layer in (0, 1):
                cache.update(k * 1000, v, layer)
        assert len(warnings_of(caplog, "clipped")) == 1
        assert all(c.calibration_report()["layers"][0]["clipped_keys"] > 0 for c in caches)
        other = QuantizedKVCache(scheme=STATIC, num_layers=2, calibration=sample_artifact(context=100), checks="eager")
        other.update(k * 1000, v, 0)
    assert len(warnings_of(caplog, "clipped")) == 2


INT_ZERO = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", integer_zero=True)  # vllm-int4's, unrotated


@pytest.mark.parametrize("checks", ["eager", "lazy"])
def test_integer_zero_point_clipping_is_warned_in_its_own_words(caplog, checks):
    """vLLM's integer zero-points (dynamic, no calibration) clip a token whose range excludes 0: keys in [5, 6]
    clamp their zero-point code to 0 and decode up to 5.3 off. ``calibration_report()`` counted every key, yet the
    cache watched static specs only and said nothing; it now warns once, saying why, not "static scales", and
    "once per cache" (there is no artifact). Values around 0 are kept: no clip, no warning about them. A float
    zero-point (int4-token) never clips: no watch, no cost."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.rand(1, 2, 40, 16, generator=g) + 5.0, torch.randn(1, 2, 40, 16, generator=g)
    cache = QuantizedKVCache(num_layers=1, scheme=KVScheme("vz", key=INT_ZERO, value=INT_ZERO), checks=checks)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        got, _ = cache.update(k, v, 0)
        cache.check_inputs()
    assert (got - k).abs().max() > 4  # the top of each key's range is lost
    report = cache.calibration_report()["layers"][0]
    assert report["clipped_keys"] == 1280 and report["clipped_values"] == 0
    msgs = warnings_of(caplog, "clipped")
    assert len(msgs) == 1, msgs
    assert "layer 0 clipped 100.000% of its keys (1280 of 1280 quantized values) under integer zero-points" in msgs[0]
    assert "range excludes 0" in msgs[0] and "static scales" not in msgs[0] and "recalibrate" not in msgs[0]
    assert msgs[0].endswith("Logged once per cache.")
    plain = QuantizedKVCache(num_layers=1, scheme="int4-token", checks=checks)
    plain.update(k, v, 0)
    assert not plain.layers[0].can_clip and plain.layers[0].clip_watch is None


def test_clip_watch_costs_two_int_comparisons_per_flush():
    """Eager flushes call the cache's clipping look only when a count passed its floor (nothing clipped: never)."""
    k, v = rand_kv(1, 30, seed=10, D=64)
    cache = QuantizedKVCache(scheme="fp8-e4m3", num_layers=1, checks="eager")
    calls: list = []
    cache.layers[0].clip_watch = calls.append
    for t in range(29):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    assert calls == []
    cache.update(k[:, :, 29:] * 1000, v[:, :, 29:], 0)
    assert calls == [cache.layers[0]]


def test_a_cache_is_made_where_transformers_declares_max_cache_len_read_only(monkeypatch):
    """transformers 5.17's ``Cache`` has a read-only ``max_cache_len`` property (deprecated; gone by 5.24):
    ``QuantizedKVCache.__init__`` assigned the attribute, so no cache could be made there (AttributeError:
    property 'max_cache_len' of 'QuantizedKVCache' object has no setter), the GPU machine's version
    included. The property is declared on the installed ``Cache`` here to stand in for 5.17's."""
    from transformers import cache_utils

    monkeypatch.setattr(cache_utils.Cache, "max_cache_len", property(lambda self: -1), raising=False)
    for reserve in (None, 48):
        cache = QuantizedKVCache(scheme="int8-token", num_layers=1, max_cache_len=reserve)
        assert cache.max_cache_len == reserve
        k, v = rand_kv(1, 40, seed=3, D=64)
        cache.update(k, v, 0)
        assert cache.layers[0].max_cache_len == reserve and cache.get_seq_length(0) == 40


def test_clip_warn_frac_is_the_reports():
    from kvbits.report.calibration import CLIP_WARN_FRAC

    assert kv_checks.CLIP_WARN_FRAC == CLIP_WARN_FRAC


# ------------------------------------------------------------------------------- crop
def _filled(T: int = 40) -> QuantizedKVCache:
    cache = QuantizedKVCache(scheme="kivi-2", num_layers=2)  # residual 128: nothing quantized at 40
    k, v = rand_kv(1, T, seed=8, D=64)
    for layer in (0, 1):
        cache.update(k, v, layer)
    return cache


@pytest.mark.parametrize("bad", [1.5, -2.0, True, False, "3", None, torch.tensor(-3.0), torch.tensor([-3]), torch.tensor(True), [3]])
def test_crop_refuses_non_ints(bad):
    cache = _filled()
    before = cache.materialize(0)
    for target in (cache, cache.layers[0]):
        with pytest.raises(TypeError, match=rf"crop\(tokens_to_remove\) takes an int .*got {type(bad).__name__} "):
            target.crop(bad)
    assert cache.get_seq_length() == 40 and all(torch.equal(a, b) for a, b in zip(cache.materialize(0), before))
    with pytest.raises(TypeError, match="takes an int"):  # also with no layer to ask (lazily created layers)
        QuantizedKVCache(scheme="int8-token").crop(bad)


def test_crop_takes_a_0d_integer_tensor():
    """transformers 5.17's assisted decoding rolls rejected drafts back with ``crop(tensor(-3))``, which
    ``DynamicCache`` takes; so do the cache and its layers (before: a TypeError, once identity layers were croppable)."""
    cache = _filled()
    cache.crop(torch.tensor(-3))
    assert cache.get_seq_length() == 37
    cache.layers[0].crop(torch.tensor(-2, dtype=torch.int32))
    assert cache.layers[0].get_seq_length() == 35


def test_crop_range():
    """Removing more tokens than cached: ``ValueError``, nothing cropped. transformers' own meanings stay: a
    positive argument keeps that absolute length (5.17; past the end a no-op), 0 is a no-op, numpy ints
    are ints, and a layer holding nothing yet ignores the crop (``DynamicLayer`` too)."""
    cache = _filled()
    for target in (cache, cache.layers[1]):
        with pytest.raises(ValueError, match=r"layer \d: crop\(-41\) would remove 41 tokens but the layer holds 40"):
            target.crop(-41)
    assert [cache.get_seq_length(i) for i in (0, 1)] == [40, 40]
    cache.crop(0)
    cache.crop(100)
    assert cache.get_seq_length() == 40
    cache.crop(np.int64(-2))
    cache.crop(30)
    assert [cache.get_seq_length(i) for i in (0, 1)] == [30, 30]
    cache.crop(-30)
    assert cache.get_seq_length() == 0
    empty = QuantizedKVLayer(get_scheme("kivi-2"))
    empty.crop(-3)
    assert empty.get_seq_length() == 0


# ------------------------------------------------------------------------------- reorder_cache
def _batch3() -> QuantizedKVCache:
    cache = QuantizedKVCache(scheme="kivi-2", num_layers=2)  # nothing quantized: exact
    k, v = rand_kv(3, 10, seed=9, D=64)
    for layer in (0, 1):
        cache.update(k, v, layer)
    return cache


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ([0, 1, 2], TypeError, "beam_idx must be a 1-D integer torch.Tensor .*got list"),
        (np.array([0, 1, 2]), TypeError, "beam_idx must be a 1-D integer torch.Tensor .*got ndarray"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, r"integer batch indices \(torch.long\), got dtype torch.float32"),
        (torch.tensor([True, False, True]), TypeError, "got dtype torch.bool"),
        (torch.tensor([[0, 1, 2]]), ValueError, r"beam_idx must be 1-D .*got shape \(1, 3\)"),
        (torch.tensor(1), ValueError, r"beam_idx must be 1-D .*got shape \(\)"),
        (torch.tensor([0, 3, 1]), ValueError, r"cached batch of 3 sequences \(0..2\), got indices from 0 to 3"),
        (torch.tensor([0, -1, 1]), ValueError, "got indices from -1 to 1"),
    ],
)
def test_reorder_cache_refuses(bad, error, match):
    cache = _batch3()
    before = [cache.materialize(i) for i in (0, 1)]
    with pytest.raises(error, match="QuantizedKVCache.reorder_cache: .*" + match):
        cache.reorder_cache(bad)
    with pytest.raises(error, match="layer 1 reorder_cache: .*" + match):
        cache.layers[1].reorder_cache(bad)
    for i in (0, 1):  # checked before any layer changed
        assert all(torch.equal(a, b) for a, b in zip(cache.materialize(i), before[i]))


def test_reorder_cache_allows_what_transformers_allows():
    """A ``beam_idx`` of another length changes the batch, as ``DynamicLayer.index_select`` does; int32
    indices work; a layer holding nothing checks the type only."""
    cache, ref = _batch3(), DynamicCache()
    k, v = rand_kv(3, 10, seed=9, D=64)
    for layer in (0, 1):
        ref.update(k, v, layer)
    for idx in (torch.tensor([2, 0]), torch.tensor([1, 1, 0, 0, 1], dtype=torch.int32)):
        cache.reorder_cache(idx)
        ref.reorder_cache(idx)
        assert cache.memory_report()["batch"] == ref.layers[0].keys.shape[0] == idx.numel()
        for i in (0, 1):
            assert torch.equal(cache.materialize(i)[0], ref.layers[i].keys)
    empty = QuantizedKVLayer(get_scheme("kivi-2"))
    empty.reorder_cache(torch.tensor([5, 7]))  # nothing cached: no batch to index
    with pytest.raises(TypeError, match="got dtype torch.float32"):
        empty.reorder_cache(torch.tensor([0.0]))


def test_calibration_warnings_off_for_a_caller_that_reports_them(caplog):
    """``calibration_warnings=False`` (kvbits' runners, which warn once per run): past the calibrated length and
    clipping heavily, the cache logs nothing; ``calibration_report()`` still counts both."""
    k, v = rand_kv(1, 60, seed=12)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        cache = QuantizedKVCache(
            scheme=STATIC, num_layers=2, calibration=sample_artifact(), checks="eager", calibration_warnings=False
        )
        for layer in (0, 1):
            cache.update(k * 1000, v, layer)
    assert warnings_of(caplog) == []
    row = cache.calibration_report()["layers"][0]
    assert row["positions_beyond_calibrated"] == 60 - CALIBRATED and row["clipped_keys"] > 0
    with pytest.raises(TypeError, match="calibration_warnings must be True or False"):
        QuantizedKVCache(scheme=STATIC, num_layers=1, calibration_warnings="no")


@pytest.mark.parametrize("scheme", ["kivi-2", "kvquant-4"])
def test_constructor_refuses_a_rotary_that_is_no_tables_and_a_bool_layer_count(scheme):
    """``rotary=3`` raised ``AttributeError: 'int' object has no attribute 'tables_for_layer'`` from inside the
    cache for a pre-RoPE scheme (kvquant-4; kivi-2 took it silently); ``num_layers=True`` built one layer."""
    from kvbits.cache import StaticQuantizedKVCache

    with pytest.raises(TypeError, match=r"rotary must be None or kvbits\.quant\.rope\.RotaryTables.*got int 3"):
        QuantizedKVCache(scheme=scheme, num_layers=1, rotary=3)
    with pytest.raises(TypeError, match="rotary must be None or"):
        StaticQuantizedKVCache(None, scheme, max_cache_len=64, num_layers=1, rotary="rope")
    for bad in (True, False):
        with pytest.raises(ValueError, match=f"num_layers must be a positive int, got {bad}"):
            QuantizedKVCache(scheme="kivi-2", num_layers=bad)


STATIC_CHANNEL = KVScheme(
    "t-static-channel", key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", static=True, symmetric=True),
    value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"), residual=20, block=4,
)  # fmt: skip


@pytest.mark.parametrize(
    "scheme, params, match",
    [(STATIC_CHANNEL, {"scale": torch.ones(3, 64)}, "static_scale of shape \\(3, 64\\) does not broadcast"),
     (STATIC_CHANNEL, {"scale": torch.ones(2, 32)}, "static_scale of shape \\(2, 32\\) does not broadcast"),
     # broadcastable, but not one calibrated value per (head, channel): a (1, H, block, D) fitted block-sized flushes
     # only (a prefill's larger flush refused it part-way through an update), (D,) and (1, 1, 1, 1) spread silently
     *((STATIC_CHANNEL, {"scale": torch.ones(shape)}, ("static_scale of a static per-channel spec must be "
        f"\\(H_kv, D\\) = \\(2, 64\\) or \\(1, 2, 1, 64\\), got shape \\({', '.join(map(str, shape))},?\\)"))
       for shape in ((1, 2, 4, 64), (64,), (1, 1, 1, 1))),
     ("int8-token-smooth", {"mean": torch.zeros(2, 32), "factor": torch.ones(2, 32)},
      "channel_mean must be \\(H_kv, D\\) = \\(2, 64\\)")],
)  # fmt: skip
def test_misshapen_fixed_params_are_refused_before_anything_is_stored(scheme, params, match):
    """Static scales or channel vectors that do not fit the layer's ``(H_kv, D)``: refused at install when a config
    gives the shapes, else by the first update before it stores anything, naming the layer. Before, the first flush
    refused them (``residual + block`` = 24 tokens into the request), unnamed, with the tokens already stored."""
    B, H, D = 1, 2, 64
    with pytest.raises(ValueError, match=f"layer 0 key: {match}"):
        QuantizedKVLayer(get_scheme(scheme), checks="eager", num_key_value_heads=H, head_dim=D).set_static_qparams(
            "key", **params
        )
    layer = QuantizedKVLayer(get_scheme(scheme), checks="eager")  # no config: the shapes come with the first K/V
    layer.set_static_qparams("key", **params)
    with pytest.raises(ValueError, match=f"layer 0 key: {match}"):
        layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    assert layer.tokens_seen == 0 and not layer.is_initialized


def test_zero_points_installed_apart_from_their_scale_are_kept():
    """``set_static_qparams(side, zero=...)`` after the scale: the zero-points are installed (before, they were
    checked and dropped, and the layer went on saying they were missing); a new scale drops them again."""
    scheme = KVScheme(
        "t-static-asym", key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", static=True),
        value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"), block=4,
    )  # fmt: skip
    layer = QuantizedKVLayer(scheme, checks="eager", num_key_value_heads=2, head_dim=64)
    layer.set_static_qparams("key", scale=torch.ones(2, 64))
    assert layer.needs_calibration() == ["key static zero-points"]
    layer.set_static_qparams("key", zero=torch.full((2, 64), -1.0))
    assert layer.needs_calibration() == []
    k = torch.linspace(-1, 1, 64).expand(1, 2, 4, 64).contiguous()
    keys, _ = layer.update(k, torch.randn(1, 2, 4, 64))
    assert layer._k.n_quantized == 4 and (keys - k).abs().max() < 0.5  # codes cover [-1, 14] in steps of 1
    layer.set_static_qparams("key", scale=torch.ones(2, 64))
    assert layer.needs_calibration() == ["key static zero-points"]
    # checked with the scale they pair with: 15 * 4400 + 0 decoded a key of 65504 as 66000, inf in float16
    layer.set_static_qparams("key", scale=torch.full((2, 64), 4400.0))
    with pytest.raises(ValueError, match=r"layer 0 key static scale: 128 of 128 entries decode past float16 \(e\.g\. "
                                         r"scale 4400 with zero-point 0 decodes 65504 as 66000"):
        layer.set_static_qparams("key", zero=torch.zeros(2, 64))
    assert layer.needs_calibration() == ["key static zero-points"]


def _static_pair_layers(spec: TensorSpec) -> list:
    from kvbits.cache.static import StaticQuantizedLayer

    scheme = KVScheme("t-static-pair", key=spec, value=TensorSpec(kind="int", bits=4, fmt=None), residual=0, block=4)
    return [QuantizedKVLayer(scheme, checks="eager", num_key_value_heads=2, head_dim=8),
            StaticQuantizedLayer(scheme, 16, 0, checks="eager", num_key_value_heads=2, head_dim=8)]  # fmt: skip


def test_static_params_installed_apart_are_checked_with_those_installed():
    """A scale, zero-points or NUQ codebook given alone pair with the others installed before, which the install's
    own check never saw: StaticQuantizedLayer kept its zero-points of 0 under a new scale of 4400 (int4 asymmetric: a
    key of 65504 decoded as 66000, inf) and took zero-points of 6000 for its scale of 4000 (66000 too); both layers
    took a codebook reaching 1 for an asymmetric NUQ scale 60000 with zero-point 10000 checked with one reaching 0.5
    (65504 decoded as 66001). Refused now, the installed parameters left as they were."""
    spec = TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", static=True, symmetric=False)
    match = r"layer 0 key static scale: 16 of 16 entries decode past float16 \(e\.g\. scale {} with zero-point {} "
    static = _static_pair_layers(spec)[1]
    static.set_static_qparams("key", torch.ones(2, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match=match.format(4400, 0) + "decodes 65504 as 66000"):
        static.set_static_qparams("key", scale=torch.full((2, 8), 4400.0))  # keeps the zero-points of 0
    static.set_static_qparams("key", scale=torch.full((2, 8), 4000.0))
    with pytest.raises(ValueError, match=match.format(4000, 6000) + "decodes 65504 as 66000"):
        static.set_static_qparams("key", zero=torch.full((2, 8), 6000.0))
    assert float(static._fixed["key"]["static_zero"].max()) == 0.0
    static.set_static_qparams("key", zero=torch.full((2, 8), 2000.0))  # 15 * 4000 + 2000 = 62000: within
    keys, _ = static.update(torch.full((1, 2, 4, 8), 65504.0), torch.zeros(1, 2, 4, 8))
    assert torch.isfinite(keys).all()

    nuq = TensorSpec(kind="nuq", bits=4, fmt=None, granularity="channel", static=True, symmetric=False)
    narrow, wide = torch.linspace(-0.5, 0.5, 16).half(), torch.linspace(-1, 1, 16).half()
    for layer in _static_pair_layers(nuq):
        layer.set_static_qparams("key", torch.full((2, 8), 60000.0), torch.full((2, 8), 10000.0), codebook=narrow)
        with pytest.raises(ValueError, match=match.format(60000, 10000) + "decodes 65504 as 66001"):
            layer.set_static_qparams("key", codebook=wide)


@pytest.mark.parametrize(
    ("heads", "head_dim", "dtype", "error", "match"),
    [
        (3, 16, torch.float32, ValueError, r"layer 0: key_states \(1, 3, 0, 16\).*num_key_value_heads=2 and head_dim=16"),
        (2, 8, torch.float32, ValueError, r"layer 0: key_states \(1, 2, 0, 8\).*head_dim=16"),
        (2, 16, torch.int64, TypeError, "layer 0 key_states must be a floating tensor, got torch.int64"),
    ],
)
def test_early_initialization_refuses_what_update_would(heads, head_dim, dtype, error, match):
    """transformers' ``early_initialization`` calls ``lazy_initialization`` directly, without ``update``'s checks:
    3 heads for a config of 2, 8 channels for 16, or int64 K/V were set up silently, and the model's first forward
    then failed with "key_states (1, 2, 12, 16) does not match the cached (B, H_kv, *, D) = (1, 3, '*', 16)" about a
    cache holding nothing (or, for int64, "K/V changed from torch.int64 ... reset() the cache first"). Refused now,
    with ``update``'s message, before anything is set up: the cache then serves the model as if never touched."""
    model = tiny_llama()
    cache = QuantizedKVCache(config=model.config, scheme="int4-token")
    with pytest.raises(error, match=match):
        cache.early_initialization(1, heads, head_dim, dtype, torch.device("cpu"))
    assert not any(layer.is_initialized for layer in cache.layers) and cache.batch_size == -1
    with torch.no_grad():
        model(ids(12), **{CACHE_KW: cache})
    assert cache.get_seq_length() == 12 and cache.batch_size == 1
    rep = cache.memory_report()
    assert rep["total_bytes"] == sum(t.nbytes for layer in cache.layers for ts in layer.components().values() for t in ts)
    good = QuantizedKVCache(config=model.config, scheme="int4-token")  # the right shape is still taken
    good.early_initialization(1, 2, 16, torch.float32, torch.device("cpu"))
    assert all(layer.is_initialized for layer in good.layers) and good.memory_report()["total_bytes"] == 0


@pytest.mark.parametrize("make", [
    lambda checks: QuantizedKVCache(num_layers=1, scheme="fp16", checks=checks),
    lambda checks: StaticQuantizedKVCache(num_layers=1, scheme="fp16", max_cache_len=8, checks=checks),
], ids=["dynamic", "static"])
@pytest.mark.parametrize("checks", ["eager", "lazy"])
def test_kv_on_two_devices_or_without_channels_are_refused(make, checks):
    """K/V of one ``(B, H_kv, q)`` whose values have 0 channels were taken by ``QuantizedKVCache``: the K/V check
    skipped both sides for the empty values, so NaN keys were stored and returned silently. K on the CPU and V on
    another device crashed deep in the store ("cross-device copies are not allowed"), prefill or decode. Both are
    refused now, naming the layer, before anything is stored, in either cache."""
    nan_keys = torch.full((1, 2, 3, 32), float("nan"))
    cache = make(checks)
    with pytest.raises(ValueError, match=r"layer 0: key_states \(1, 2, 3, 32\) and value_states \(1, 2, 3, 0\).*D >= 1"):
        cache.update(nan_keys, torch.randn(1, 2, 3, 0), 0)
    k = torch.randn(1, 2, 3, 32)
    with pytest.raises(ValueError, match="layer 0: key_states on cpu but value_states on meta"):
        cache.update(k, torch.randn(1, 2, 3, 32, device="meta"), 0)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="layer 0: .*value_states (is torch.float32 )?on meta"):
        cache.update(k[:, :, :1], torch.randn(1, 2, 1, 32, device="meta"), 0)
    cache.check_inputs()
    assert cache.get_seq_length() == 3


def test_lazy_check_after_a_crop_names_the_positions_of_the_kept_sequence():
    """A lazy check failing after ``crop`` named token positions from before the crop: 4 tokens checked, cropped to 1,
    a NaN at position 1 was reported at "token positions 4..1". Now the window starts where the kept tokens end."""
    cache = QuantizedKVCache(num_layers=1, scheme="fp16", checks="lazy", check_every=4)
    for _ in range(4):
        cache.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), 0)
    cache.check_inputs()
    cache.crop(-3)
    bad = torch.randn(1, 2, 1, 32)
    bad[0, 0, 0, 0] = float("nan")
    cache.update(bad, torch.randn(1, 2, 1, 32), 0)
    with pytest.raises(ValueError, match=r"key_states contain NaN .* update steps 4\.\.4 \(token positions 1\.\.1\)"):
        cache.check_inputs()


def test_lazy_check_words_a_value_past_the_bound_as_the_bound_is_worded():
    """A lazy check of keys reaching 65505 (past the float16 bound 65504) said "reach |x| = 6.55e+04 (K/V must be
    finite with |x| <= 65504 ...)", which reads as within the bound; it now says 65505, as the eager check does."""
    k, v = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    k[0, 0, 3, 3] = 65505.0
    for checks in ("eager", "lazy"):
        cache = QuantizedKVCache(num_layers=1, scheme="kivi-2", checks=checks)
        with pytest.raises(ValueError, match=r"layer 0 key_states (has|reach) \|x\| (up to|=) 65505\b.*65504") as err:
            cache.update(k, v, 0)
            cache.check_inputs()
        assert "e+04" not in str(err.value)


def test_reset_logs_a_failed_lazy_check_it_would_have_dropped(caplog):
    """A NaN stored in a generation's last steps (after the last lazy check) was forgotten by ``reset()``: the pending
    maxima were cleared unread, so the request's invalid outputs went unreported, where eager checks refuse the K/V.
    ``reset()`` now runs the pending check and logs the failure (WARNING, naming the layer and steps); it does not
    raise, and the cache serves the next request. Nothing pending, or a failure already raised: nothing logged."""
    cache = QuantizedKVCache(num_layers=2, scheme="int4-token", checks="lazy", check_every=64)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), layer)
    cache.check_inputs()
    for step in range(3):
        for layer in range(2):
            k = torch.randn(1, 2, 1, 32)
            if step == 1 and layer == 1:
                k[0, 1, 0, 5] = float("nan")
            cache.update(k, torch.randn(1, 2, 1, 32), layer)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        cache.reset()
    msgs = warnings_of(caplog, "reset()")
    assert len(msgs) == 1 and "layer 1 key_states contain NaN" in msgs[0] and "update steps 1..3" in msgs[0], msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbits.cache"):
        cache.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), 0)
        cache.check_inputs()  # the next request is served and checked afresh
        cache.reset()  # nothing failed: nothing logged
        bad = torch.full((1, 2, 1, 32), float("inf"))
        cache.update(bad, bad, 0)
        with pytest.raises(ValueError, match="contain inf"):
            cache.check_inputs()
        cache.reset()  # the failure was raised already: not logged again
    assert warnings_of(caplog) == []
