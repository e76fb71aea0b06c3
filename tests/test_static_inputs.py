"""``StaticQuantizedKVCache``'s refusals of bad input, checked where the slabs are made (``lazy_initialization``).

Reproduced defects (review session, the static cache): the first update's K/V were taken as they came, so a 3-D or
non-tensor K/V crashed in tuple unpacking, integer or float8 K/V under lazy checks (the default on CUDA) crashed
inside ``torch.linalg.vector_norm``, and under eager checks they left slabs of that dtype behind, which refused every
later, correct update; K/V of another model than the cache's config (other KV heads or head dim) were stored without
a word, in slabs whose bytes were not the plan's for the config (``QuantizedKVCache`` refuses them).
"""

from __future__ import annotations

import pytest
import torch
from test_fused_cache import build

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("checks", ["eager", "lazy"])
@pytest.mark.parametrize("scheme", ["int8-token", "kivi-2", "fp16"])
def test_first_update_refuses_what_is_no_float_kv_tensor_and_keeps_the_cache_usable(scheme: str, checks: str):
    """A first update of no ``(B, H_kv, q, D)`` float K/V is refused as ``QuantizedKVCache`` refuses it, before any
    slab is made: the same cache then takes the right K/V."""
    k = torch.randn(1, 2, 3, 32)
    cache = StaticQuantizedKVCache(num_layers=1, scheme=scheme, max_cache_len=8, checks=checks)
    for bad, error, words in ((k[0], ValueError, r"key_states must have 4 dims \(B, H_kv, T, D\), got shape \(2, 3, 32\)"),
                              ([1.0], TypeError, "key_states must be a torch.Tensor, got list"),
                              (k.int(), TypeError, "key_states must be a floating tensor, got torch.int32"),
                              (k.to(torch.float8_e4m3fn), TypeError, "key_states must be float16, bfloat16, float32 or float64")):  # fmt: skip
        with pytest.raises(error, match=f"layer 0 {words}"):
            cache.update(bad, bad, 0)
        assert not cache.layers[0].is_initialized
    with pytest.raises(ValueError, match="layer 0 value_states must have 4 dims"):
        cache.update(k, k[0], 0)
    keys, _ = cache.update(k, k, 0)
    assert keys.dtype == torch.float32 and cache.layers[0].tokens_written == 3


@pytest.mark.parametrize("scheme", ["int8-token", "fp8-e4m3-head", "int4-channel-prerope", "fp16"])
def test_first_update_refuses_kv_of_another_model_than_the_config(scheme: str):
    """Made with a config (2 KV heads of dim 32), the cache refuses K/V with other heads or another head dim, naming
    the config's, as ``QuantizedKVCache`` does: they were stored in slabs of other bytes than the plan's (or, with
    per-head FP8 scales installed for the config, refused for the scales' shape)."""
    model = build("llama")
    ok = torch.randn(2, 2, 3, 32)
    for shape in ((2, 4, 3, 32), (2, 1, 3, 32), (2, 2, 3, 16)):
        bad = torch.randn(shape)
        with pytest.raises(ValueError, match="config('s| has) (num_key_value_heads=2|head_dim=32)"):
            QuantizedKVCache(config=model.config, scheme=scheme).update(bad, bad, 0)
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=8)
        if scheme == "fp8-e4m3-head":
            cache.set_static_qparams(0, "key", torch.tensor([0.5, 2.0]))
        with pytest.raises(ValueError, match=r"config's num_key_value_heads=2 and head_dim=32"):
            cache.update(bad, bad, 0)
        assert not cache.layers[0].is_initialized
        cache.update(ok, ok, 0)
        assert cache.layers[0].tokens_written == 3
    # without a config the first K/V set the shape, as before
    free = StaticQuantizedKVCache(num_layers=1, scheme="int8-token", max_cache_len=8)
    free.update(torch.randn(2, 4, 3, 16), torch.randn(2, 4, 3, 16), 0)
    assert free.layers[0].key.codes.shape[:3] == (2, 4, 8)



def test_both_caches_refuse_kv_of_another_model_with_one_message():
    """The check of K/V against the config's KV heads and head dim is one (``kvbits.cache.checks.check_config_shape``):
    both caches give the same message for the same K/V. Before, the two were written twice and read "got 4 KV heads
    ... but the config has num_key_value_heads=2" in one cache and "K/V ... do not have the config's
    num_key_value_heads=2 and head_dim=32: the slabs would hold ..." in the other."""
    model = build("llama")
    for shape in ((2, 4, 3, 32), (2, 2, 3, 16)):
        bad = torch.randn(shape)
        messages = []
        for cache in (QuantizedKVCache(config=model.config, scheme="int8-token"),
                      StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=8)):  # fmt: skip
            with pytest.raises(ValueError) as err:
                cache.update(bad, bad, 0)
            messages.append(str(err.value))
        assert messages[0] == messages[1]
        assert f"key_states {shape} and value_states {shape} (expected (B, H_kv, T, D)) do not have the config's " \
               "num_key_value_heads=2 and head_dim=32 channels" in messages[0]

def test_speed_static_refuses_a_model_the_static_cache_cannot_hold_before_any_run(monkeypatch):
    """``speed_eval(static=True)`` (``kvbits speed --static``) on a model with sliding-window layers: refused before
    the prefill and every run. It timed the warm-up, ``DynamicCache`` and ``StaticCache`` runs first and failed at the
    first kvbits cache (``NotImplementedError``), so no summary came of them."""
    from kvbits.evaluate import speed

    model = build("gemma3")
    ids = torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(0))
    runs, run_one = [], speed._run_one
    monkeypatch.setattr(speed, "_run_one", lambda *a, **k: runs.append(speed._cache_name(a[1])) or run_one(*a, **k))
    with pytest.raises(ValueError, match=r"static=True: 'int8-token': StaticQuantizedKVCache holds full-attention "
                                         r"layers only, beside the states of conv, linear_attention and hybrid "
                                         r"layers; the config has 'sliding_attention' layers \[0\]\. "
                                         r"QuantizedKVCache\(config=\.\.\.\) holds this model"):  # fmt: skip
        speed.speed_eval(model, 32, ["int8-token"], static=True, tokens=2, warmup=1, data=ids, progress=False)
    assert runs == []


@pytest.mark.parametrize("scheme", ["int8-token", "kivi-2", "fp16"])
def test_static_lazy_initialization_refuses_kv_of_two_dtypes(scheme: str):
    """``lazy_initialization`` (which transformers' ``early_initialization`` calls directly, without ``update``) runs
    ``QuantizedKVLayer``'s checks (``kvbits.cache.checks.check_incoming``). It took float32 keys with float16 values
    and made float32 slabs, and ``update`` then refused the request with "value_states is torch.float16 on cpu; the
    slabs were made for torch.float32 ... (reset() keeps them: make a new cache)", though the failed request had left
    the cache as before it. Now ``TypeError`` naming both dtypes, before any slab is made; the cache then takes K/V of
    one dtype."""
    model = build("llama")
    k = torch.randn(1, 2, 3, 32)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=8)
    with pytest.raises(TypeError, match="layer 0: key dtype torch.float32 != value dtype torch.float16"):
        cache.layers[0].lazy_initialization(k[:, :, :0], k[:, :, :0].half())
    assert not cache.layers[0].is_initialized
    with pytest.raises(TypeError, match="layer 0: key dtype torch.float32 != value dtype torch.float16"):
        cache.update(k, k.half(), 0)
    assert not cache.layers[0].is_initialized
    cache.early_initialization(1, 2, 32, torch.float32, torch.device("cpu"))
    assert cache.is_initialized and cache.get_seq_length() == 0
    cache.update(k, k, 0)
    assert cache.layers[0].tokens_written == 3


@pytest.mark.parametrize("scheme", ["int8-token", "kivi-2", "fp16", "int8-token,1=fp16"])
def test_static_offload_and_prefetch_are_refused_and_change_nothing(scheme: str):
    """transformers' ``Cache.offload(i)`` / ``prefetch(i)`` raised ``AttributeError`` ("'NoneType' object has no
    attribute 'to'": a ``StaticQuantizedLayer`` has no ``keys`` / ``values``; "no attribute 'prefetch_stream'"), as
    on ``QuantizedKVCache`` before. Both now refuse with ``QuantizedKVLayer``'s ``NotImplementedError``, naming this
    cache and transformers' ``StaticCache`` as what offloads, and the slabs stay as they were. A float layer's
    refusal says its K/V are float slabs (it said "packed quantized storage" and "a fraction of fp16's bytes")."""
    cache = StaticQuantizedKVCache(num_layers=2, scheme=scheme, max_cache_len=16)
    k = torch.randn(1, 2, 10, 32)
    for i in range(2):
        cache.update(k, k, i)
    before = [t.clone() for t in cache.layers[1].materialize()]
    calls = (lambda: cache.offload(1), lambda: cache.prefetch(1), cache.layers[1].offload, cache.layers[1].prefetch)
    for call in calls:
        with pytest.raises(NotImplementedError, match=r"StaticQuantizedKVCache .*offloading.*not supported.*"
                                                      r"StaticCache\(config=\.\.\., offloading=True\)") as err:  # fmt: skip
            call()
        float_layer = cache.layers[1].scheme.is_identity
        assert ("float slabs" in str(err.value)) == float_layer
        assert ("quantized storage" in str(err.value)) == ("fraction of fp16" in str(err.value)) == (not float_layer)
    assert all(torch.equal(a, b) for a, b in zip(cache.layers[1].materialize(), before))
    cache.update(k[:, :, :1], k[:, :, :1], 1)
    assert cache.layers[1].tokens_written == 11


def test_static_scales_of_the_wrong_shape_are_refused_at_install_naming_the_layer():
    """A static scale that fits no ``(H_kv, D)`` of the layer: refused at install when the config gives the heads
    (``QuantizedKVLayer``'s check), else at the first update naming the layer and side, the layer left unallocated
    (before, a (3, 8) scale for 2 heads was taken and the first update failed inside quantize, naming no layer). A
    ``True`` layer_idx installed into layer 1; refused now, as ``update`` refuses it."""
    from kvbits.cache.static import StaticQuantizedLayer
    from kvbits.schemes import KVScheme, TensorSpec

    spec = TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", static=True, symmetric=True)
    scheme = KVScheme("t-static", key=spec, value=TensorSpec(kind="int", bits=4, fmt=None), residual=0, block=4)
    match = r"layer 0 key: static_scale of shape \(3, 8\) does not broadcast.*\(2 KV heads of dim 8, 4-token blocks\)"
    with pytest.raises(ValueError, match=match):
        StaticQuantizedLayer(scheme, 16, 0, num_key_value_heads=2, head_dim=8).set_static_qparams("key", torch.ones(3, 8))
    layer = StaticQuantizedLayer(scheme, 16, 0, checks="eager")  # no config: checked with the first K/V
    layer.set_static_qparams("key", torch.ones(3, 8))
    with pytest.raises(ValueError, match=match):
        layer.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    assert not layer.is_initialized
    layer.set_static_qparams("key", torch.ones(2, 8))
    keys, _ = layer.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    assert layer.tokens_written == 4 and torch.isfinite(keys).all()
    cache = StaticQuantizedKVCache(scheme=scheme, num_layers=2, max_cache_len=16)
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\), got True"):
        cache.set_static_qparams(True, "key", torch.ones(2, 8))
    assert "static_scale" not in cache.layers[1]._fixed["key"]


@pytest.mark.parametrize("checks", ["eager", "lazy"])
def test_eager_checks_take_the_bounds_the_lazy_ones_and_the_dynamic_cache_take(checks: str):
    """Eager checks refused every ``|x| > 65504`` (``check_kv``'s float16 range) even on sides stored in bf16, which
    hold any finite value: bf16 K/V of 1e5 were refused by ``checks="eager"`` and taken by ``checks="lazy"`` and by
    ``QuantizedKVCache`` either way. Now eager checks use the sides' bounds as the lazy ones do (float16 sides still
    refuse 1e5), and float64 K/V beyond the float32 range are refused for that, not for a float16 range."""
    big = torch.full((1, 2, 3, 32), 1e5, dtype=torch.bfloat16)
    for make in (lambda: StaticQuantizedKVCache(num_layers=1, scheme="bf16", max_cache_len=8, checks=checks),
                 lambda: QuantizedKVCache(num_layers=1, scheme="bf16", checks=checks)):  # fmt: skip
        cache = make()
        keys, _ = cache.update(big, big, 0)
        cache.check_inputs()
        assert keys[0, 0, 0, 0].item() == big[0, 0, 0, 0].item()
    cache = StaticQuantizedKVCache(num_layers=1, scheme="int8-token", max_cache_len=8, checks=checks)
    with pytest.raises(ValueError, match=r"layer 0.*(65504|6\.55e\+04)"):
        cache.update(big, big, 0)
        cache.check_inputs()
    if checks == "eager":
        huge = torch.full((1, 2, 3, 32), 1e300, dtype=torch.float64)
        for cache, name in ((StaticQuantizedKVCache(num_layers=1, scheme="bf16", max_cache_len=8), "keys"),
                            (QuantizedKVCache(num_layers=1, scheme="bf16"), "key_states")):  # fmt: skip
            with pytest.raises(ValueError, match=f"layer 0 {name} has .*1e\\+300, beyond the float32 range"):
                cache.update(huge, huge, 0)
