"""``kvbits calibrate`` and ``kvbits analyze`` on Zamba / Zamba2, whose hybrid layers share one attention block: K/V
read at ``cache.update`` (``kvbits.calibrate.cache_capture``), where each layer passes its own index. Tiny random
models."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import transformers
from test_cache_hybrid import _zamba
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM

from kvbits._model import hybrid_layers, shared_attention
from kvbits.calibrate.cache_capture import CacheKVCapture, shared_attention_sites
from kvbits.quant.rope import RotaryTables, apply_rope

CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _zamba2():
    """RoPE on the shared block (``use_mem_rope``) and per-layer LoRA adapters after ``k_proj`` / ``v_proj``."""
    return transformers.Zamba2Config(
        vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
        use_mem_rope=True, use_shared_attention_adapter=True, adapter_rank=8,
    )  # fmt: skip


def _model(make):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make()).eval()
    if getattr(model.config, "use_shared_attention_adapter", False):  # random adapters (their init is zero-ish)
        for name, p in model.named_parameters():
            if "adapter" in name:
                torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("make", [_zamba, _zamba2], ids=["zamba", "zamba2"])
def test_cache_capture_reads_each_hybrid_layers_kv_as_the_cache_receives_them(make):
    """Was: no way to read a shared block's K/V per layer (hooks on its ``k_proj`` can not tell the calling layers
    apart; Zamba2's adapters add to ``k_proj``'s output before the cache). Now, per hybrid layer: the values equal
    what ``DynamicCache`` holds bit for bit, the keys re-rotated equal the cached keys, and the pre-RoPE keys equal
    the block's own ``k_proj(h) + adapter(h)`` for that layer's input (not ``k_proj(h)`` alone)."""
    model = _model(make)
    sites = shared_attention_sites(model)
    assert [s.layer_idx for s in sites] == hybrid_layers(model) and len(sites) == 2
    ids = torch.randint(1, 96, (1, 12))
    inputs: dict[int, tuple[torch.nn.Module, torch.Tensor]] = {}  # layer -> (the block it called, its input)

    def keep(block, args, kwargs):
        bound = inspect.signature(block.forward).bind(*args, **kwargs).arguments
        inputs[bound["layer_idx"]] = (block, bound["hidden_states"])

    handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in shared_attention(model)]
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{CACHE_KW: ref})
    for h in handles:
        h.remove()
    rope = getattr(model.config, "use_mem_rope", False)
    tables = [RotaryTables.from_model(model).tables_for_layer(s.layer_idx) if rope else None for s in sites]
    with CacheKVCapture(model, sites, tables) as cap, torch.no_grad():
        model(input_ids=ids, use_cache=False)  # the capture runs it with its own cache
        got = {s.layer_idx: cap.activations(s.layer_idx) for s in sites}
    for j, s in enumerate(sites):
        i = s.layer_idx
        k, v = got[i]
        assert k.shape == v.shape == (1, s.num_kv_heads, 12, s.head_dim)
        assert torch.equal(v, ref.layers[i].values)
        cos, sin = tables[j].cos_sin(torch.arange(12), torch.float32) if rope else (None, None)
        post = apply_rope(k, cos, sin) if rope else k
        torch.testing.assert_close(post, ref.layers[i].keys, atol=1e-5, rtol=0)
        block, h = inputs[i]
        with torch.no_grad():
            own = block.k_proj(h)
            if rope:
                own = own + block.linear_k_adapter_list[block.layer_dic[i]](h)
                alone = block.k_proj(h).view(1, 12, -1, s.head_dim).transpose(1, 2)
                assert (alone - k).abs().max() > 1e-2  # k_proj's output is not what the cache stores here
        torch.testing.assert_close(k, own.view(1, 12, -1, s.head_dim).transpose(1, 2), atol=1e-5, rtol=0)
    assert not model._forward_pre_hooks  # removed on exit
    assert sorted(inputs) == [s.layer_idx for s in sites]


@pytest.mark.parametrize(
    "make, scheme, fisher", [(_zamba, "fp8-e4m3", False), (_zamba2, "kvquant-4", True)], ids=["zamba", "zamba2"]
)
def test_zamba_calibrates_its_hybrid_layers_and_the_stream_runs_the_artifact(tmp_path, make, scheme, fisher):
    """Was: ``calibrate`` refused Zamba / Zamba2 ('the measures that hook attention modules per layer (kvbits
    calibrate, ...) are not supported'). Now it calibrates the hybrid layers (the artifact holds their indices and
    one module name each; Zamba2 with Fisher weights through its Mamba layers) and ``evaluate(mode='stream')``
    runs with the artifact's folder."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate.runner import evaluate

    model = _model(make)
    ids = torch.randint(1, 96, (80,))
    art = calibrate(model, ids, scheme, context=32, windows=2, fisher=fisher, out_dir=tmp_path / "cal")
    layers = hybrid_layers(model)
    assert art.kv_layers == layers
    assert art.meta["fisher"] is fisher
    names = art.meta["model"]["attention_modules"]
    assert len(set(names)) == len(layers) and all(f"layers.{i}." in n for i, n in zip(layers, names))
    out = evaluate(model, ids, 32, ["fp16", scheme], mode="stream", calibration={scheme: str(tmp_path / "cal")})
    ppl = [r["ppl"] for r in out["results"]]
    assert all(math.isfinite(p) for p in ppl) and ppl[0] != ppl[1]


def _zamba2_default():
    """Zamba2 as its config defaults it: ``use_mem_rope=False``, so its shared attention block rotates no keys (and
    no adapters)."""
    config = _zamba2()
    config.use_mem_rope = config.use_shared_attention_adapter = False
    return config


def test_zamba2_without_mem_rope_has_no_rope_tables():
    """Zamba2 applies RoPE in its shared block only with ``use_mem_rope=True`` (the config's default is False), but
    its modeling file defines ``Zamba2RotaryEmbedding``: ``RotaryTables`` were built for the default config
    (rot_dim 32), so ``QuantizedKVCache`` accepted ``int4-channel-prerope`` and un-rotated keys that were never
    rotated, and the planner priced it. Now the ValueError of a model without RoPE, saying why and naming the
    post-RoPE variant; ``use_mem_rope=True`` still gets its tables."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.plan import plan
    from kvbits.plan.positions import pre_rope_problem

    cfg = _zamba2_default()
    assert "use_mem_rope=False" in pre_rope_problem(cfg)
    with pytest.raises(ValueError, match=r"has no RoPE keys.*use_mem_rope=False"):
        RotaryTables.from_config(cfg)
    with pytest.raises(ValueError, match=r"has no RoPE keys.*use_mem_rope=False"):
        RotaryTables.from_model(_model(_zamba2_default))
    advice = r"post-RoPE keys \(pre_rope=False\), e\.g\. 'int4-channel' instead of 'int4-channel-prerope'"
    with pytest.raises(ValueError, match=rf"needs a model with RoPE keys.*use_mem_rope=False.*{advice}"):
        QuantizedKVCache(config=cfg, scheme="int4-channel-prerope")
    with pytest.raises(ValueError, match=rf"quantizes keys before RoPE.*use_mem_rope=False.*{advice}"):
        plan(cfg, scheme="int4-channel-prerope", context=100)
    QuantizedKVCache(config=cfg, scheme="int4-channel")  # post-RoPE keys are unaffected
    assert RotaryTables.from_config(_zamba2()).rot_dim == 32  # use_mem_rope=True


@pytest.mark.parametrize("make", [_zamba, _zamba2_default], ids=["zamba", "zamba2-no-mem-rope"])
def test_pre_rope_schemes_are_refused_before_any_forward_on_zambas_without_rope(make):
    """Pre-RoPE schemes on Zamba (no RoPE) and a default Zamba2: ``evaluate(mode='stream')``, ``speed_eval`` and
    ``calibrate('kvquant-4')`` ran on Zamba2 (un-rotating keys never rotated; calibrate wrote an artifact the cache
    refuses), ``mode='simulate'`` failed with "layer_idx must be an int in [0, 4), got -1" after the reference pass,
    and on Zamba the stream and speed failed after 1-2 forwards with "has no *RotaryEmbedding class ... does this
    model use RoPE?". Now each refuses before any forward pass with the planner's message (why, and the post-RoPE
    variant to use)."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate.runner import evaluate
    from kvbits.evaluate.speed import speed_eval

    model = _model(make)
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    ids = torch.randint(1, 96, (80,))
    why = r"quantizes keys before RoPE, but the model 'zamba2?' does not rotate its keys.*post-RoPE keys \(pre_rope=False\)"
    runs = [
        lambda: evaluate(model, ids, 32, ["int4-channel-prerope"], attn_layers=[]),
        lambda: evaluate(model, ids, 32, ["int4-channel-prerope"], mode="stream", attn_layers=[]),
        lambda: speed_eval(model, 16, ["int4-channel-prerope"], tokens=1, warmup=0, data=ids),
        lambda: calibrate(model, ids, "kvquant-4", context=32, windows=2, fisher=False),
    ]
    for run in runs:
        with pytest.raises(ValueError, match=why):
            run()
    assert forwards == []


def _cached_kv(model, windows):
    """Per hybrid layer, the ``(keys, values)`` ``DynamicCache`` holds after each window's forward, ``(W, H_kv, T, D)``
    float32 (keys as cached: rotated where the model rotates them)."""
    out: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for w in range(windows.shape[0]):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=windows[w : w + 1], use_cache=True, **{CACHE_KW: cache})
        for i in hybrid_layers(model):
            out.setdefault(i, []).append((cache.layers[i].keys.float(), cache.layers[i].values.float()))
    return {i: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])) for i, kv in out.items()}


@pytest.mark.parametrize("make", [_zamba, _zamba2], ids=["zamba", "zamba2"])
def test_analyze_reads_each_hybrid_layers_kv_as_the_cache_receives_them(make):
    """Was: ``analyze`` refused Zamba / Zamba2 ('expected one K/V site per layer: ... attention block ... is shared
    ... (kvbits analyze, ...) are not supported'). Now it reports one row per hybrid layer with the statistics of
    the K/V the cache receives there: the values' and (post-RoPE) keys' per-channel absmax equal the cached
    tensors', the pre-RoPE keys' equal the cached keys un-rotated (Zamba2: after its adapters, not ``k_proj``'s
    output); Zamba, which rotates no keys, gets no post-RoPE row and its pre-RoPE keys are the cached ones, as
    any model without RoPE."""
    from kvbits.analyze import analysis_sites, analyze
    from kvbits.cache.store import rope_at

    model = _model(make)
    windows = torch.randint(1, 96, (2, 16))
    layers = hybrid_layers(model)
    assert [s.layer_idx for s in analysis_sites(model)] == layers
    result = analyze(model, windows, sample_tokens=16, channel_group=8)
    assert [la.layer for la in result.layers] == layers
    assert result.recommendation["scheme"]
    rope = getattr(model.config, "use_mem_rope", False)
    tables = RotaryTables.from_model(model) if rope else None
    cached = _cached_kv(model, windows)
    for la in result.layers:
        k, v = cached[la.layer]
        assert torch.equal(la.value.absmax, v.abs().amax(dim=(0, 2)))
        assert not la.keys_rotated_unseen
        if rope:
            assert la.rot_dim == tables.rot_dim > 0 and la.key_post_rope is not None
            torch.testing.assert_close(la.key_post_rope.absmax, k.abs().amax(dim=(0, 2)), atol=1e-5, rtol=0)
            pre = rope_at(tables.tables_for_layer(la.layer), k, 0, inverse=True)
            torch.testing.assert_close(la.key_pre_rope.absmax, pre.abs().amax(dim=(0, 2)), atol=1e-5, rtol=0)
        else:
            assert la.rot_dim == 0 and la.key_post_rope is None
            assert torch.equal(la.key_pre_rope.absmax, k.abs().amax(dim=(0, 2)))
        assert (la.to_dict()["key_outliers_smeared_by_rope"] is None) is (not rope)
    assert not model._forward_pre_hooks and not any(m._forward_hooks for m in model.modules())


def test_analyze_keeps_zamba2s_unrotated_keys_as_cached_without_rope():
    """Zamba2 with ``use_mem_rope=False`` rotates no keys: as for any model without RoPE (Falcon's ALiBi, Granite's
    NoPE), ``analyze`` reports the cached keys as they are and no post-RoPE statistics, none invented."""
    from kvbits.analyze import analyze

    config = _zamba2()
    config.use_mem_rope = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError):  # no tables: kvbits.plan.positions.no_rope_reason reads use_mem_rope
        RotaryTables.from_model(model)
    windows = torch.randint(1, 96, (1, 16))
    result = analyze(model, windows, sample_tokens=16, channel_group=8)
    cached = _cached_kv(model, windows)
    assert [la.layer for la in result.layers] == hybrid_layers(model)
    for la in result.layers:
        assert la.rot_dim == 0 and la.key_post_rope is None
        assert torch.equal(la.key_pre_rope.absmax, cached[la.layer][0].abs().amax(dim=(0, 2)))


def test_zamba2_simulates_pre_rope_schemes_as_the_stream_runs_them():
    """Was: every pre-RoPE scheme in ``evaluate(mode='simulate')`` on a Zamba2 with ``use_mem_rope=True`` failed
    after the reference pass with "layer_idx must be an int in [0, 4), got -1" (the simulator asked RoPE tables for
    the shared block's layer_idx -1). Now the block's calls take the tables its hybrid layers share, and the
    simulated PPL equals the stream's (97.7733 both, context 160)."""
    from kvbits.evaluate.runner import evaluate

    model = _model(_zamba2)
    ids = torch.randint(1, 96, (170,))
    ppl = {
        mode: evaluate(model, ids, 160, ["int4-channel-prerope"], mode=mode)["results"][0]["ppl"]
        for mode in ("simulate", "stream")
    }
    assert math.isclose(ppl["simulate"], ppl["stream"], rel_tol=1e-5)


def test_zamba2_simulate_refuses_calibrated_schemes_it_would_run_without_their_artifact(tmp_path):
    """Was: ``evaluate(mode='simulate', calibration=...)`` on Zamba2 looked up the shared block's layer_idx -1 in an
    artifact of hybrid layers [1, 3], found nothing and quantized without it: the artifact's scales x1000 changed
    no logit, and ``kvquant-4`` failed deep inside. Now evaluate refuses before any forward pass, and ``simulate``
    itself refuses, both pointing to mode='stream' (which runs the artifact)."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate.runner import evaluate
    from kvbits.evaluate.simulate import simulate

    model = _model(_zamba2)
    ids = torch.randint(1, 96, (80,))
    calibrate(model, ids, "fp8-e4m3", context=32, windows=2, fisher=False, out_dir=tmp_path / "cal")
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"mode='simulate'.*'fp8-e4m3'.*calibrated.*mode='stream'"):
        evaluate(model, ids, 32, ["fp8-e4m3"], mode="simulate", calibration={"fp8-e4m3": str(tmp_path / "cal")})
    assert forwards == []
    with (
        pytest.raises(ValueError, match=r"calibrated parameters per layer.*layers \[1, 3\].*mode='stream'"),
        simulate(model, "fp8-e4m3", calibration=tmp_path / "cal"),
    ):
        pass
    with simulate(model, "fp8-e4m3"):  # uncalibrated (dynamic scales): one scheme for every call, as before
        model(input_ids=ids[None, :16])


def test_bf16_key_gradients_are_unrotated_in_float32():
    """Was: ``CacheKVCapture.gradients`` un-rotated a bfloat16 model's post-RoPE key gradients into bfloat16 (then
    float32), one more rounding on top of the backward pass's: 0.13 % per element (median), 0.3 % on a channel's
    summed squared gradient (the Fisher weight) on this tiny Zamba2. Now they are un-rotated by the model's own
    (bfloat16) tables in float32: equal to the float64 inverse to float32 rounding; a float32 model's unchanged."""
    from kvbits.calibrate.fisher import activation_gradients, window_loss
    from kvbits.quant.rope import invert_rope

    model = _model(_zamba2).to(torch.bfloat16)
    sites = shared_attention_sites(model)
    rotary = RotaryTables.from_model(model)
    tables = [rotary.tables_for_layer(s.layer_idx) for s in sites]
    ids = torch.randint(1, 96, (1, 32), generator=torch.Generator().manual_seed(0))
    with CacheKVCapture(model, sites, tables, retain_grad=True) as cap:
        with activation_gradients(model):
            window_loss(model, ids, backward=True)
        for j, s in enumerate(sites):
            gk, gv = cap.gradients(s.layer_idx)
            post, v = cap._get(s.layer_idx)
            assert gk.dtype == gv.dtype == torch.float32 and torch.equal(gv, v.grad.float())
            cos, sin = tables[j].cos_sin(torch.arange(32), torch.bfloat16)
            ref = invert_rope(post.grad.double(), cos.double(), sin.double())
            torch.testing.assert_close(gk.double(), ref, rtol=1e-6, atol=1e-12)
            fisher = gk.double().square().sum(dim=(0, 2))
            assert ((fisher - ref.square().sum(dim=(0, 2))).abs() / fisher).max() < 1e-5
