"""``StaticQuantizedKVCache`` on hybrid decoders (LFM2, Qwen3-Next: conv / linear-attention layers; Zamba2, Falcon-H1:
``hybrid`` layers, attention plus a Mamba state): the states held as transformers' ``StaticCache`` holds them
(``LinearAttentionLayer``), the attention K/V in fixed quantized slabs (``kvbits.cache.static_state``). It refused
every such config (``NotImplementedError: StaticQuantizedKVCache holds full-attention layers only``)."""

from __future__ import annotations

import pytest
import torch
from test_cache_hybrid import CACHE_KW, _falcon_h1, _lfm2, _qwen3_next, _zamba2
from transformers import AutoModelForCausalLM, StaticCache
from transformers.cache_utils import LinearAttentionLayer

from kvbits.cache.cache import linear_state_bytes
from kvbits.cache.static import StaticQuantizedKVCache, StaticQuantizedLayer
from kvbits.plan import plan

MAX_LEN = 16


def _model(make):
    cfg = make()
    torch.manual_seed(0)
    return cfg, AutoModelForCausalLM.from_config(cfg).eval(), torch.randint(1, 96, (2, 9))


def _generate(model, ids, cache):
    """Greedy ids ``(2, 15)`` and each step's logits ``(6, 2, V)``."""
    out = model.generate(ids, **{CACHE_KW: cache}, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("make", [_lfm2, _qwen3_next, _zamba2, _falcon_h1], ids=["lfm2", "qwen3_next", "zamba2", "falcon_h1"])
def test_hybrid_models_generate_as_static_cache_with_the_plans_kv_bytes(make):
    """fp16 generates transformers' ``StaticCache``'s tokens (logits to fp16 rounding), int8-token quantizes (its
    logits move further), the K/V bytes are ``kvbits.plan``'s at ``max_cache_len`` and the states are reported apart
    (``linear_state_bytes``: StaticCache's); ``reset()`` serves the next request the same tokens, ``reorder_cache``
    moves the K/V and the states alike, in place."""
    from kvbits.cache.static_state import StaticQuantizedHybridLayer

    cfg, model, ids = _model(make)
    ref = StaticCache(config=cfg, max_cache_len=MAX_LEN)
    want, want_logits = _generate(model, ids, ref)
    kinds = {"full_attention": StaticQuantizedLayer, "hybrid": StaticQuantizedHybridLayer}
    logits = {}
    for scheme in ("fp16", "int8-token"):
        cache = StaticQuantizedKVCache(config=cfg, scheme=scheme, max_cache_len=MAX_LEN)
        assert [type(x) for x in cache.layers] == [kinds.get(t, LinearAttentionLayer) for t in cfg.layer_types]
        got, logits[scheme] = _generate(model, ids, cache)
        if scheme == "fp16":
            assert torch.equal(got, want)
            torch.testing.assert_close(logits[scheme], want_logits, atol=2e-3, rtol=0)  # float32 K/V held in fp16
        report = cache.memory_report()
        assert report["total_bytes"] == plan(cfg, context=MAX_LEN, batch=2, scheme=scheme)["total_bytes"] > 0
        assert report["linear_state_bytes"] == linear_state_bytes(ref) > 0
        assert report["linear_layers"] == [i for i, t in enumerate(cfg.layer_types) if t != "full_attention"]
        assert [r["layer"] for r in cache.fused_report()["layers"]] == [x.layer_idx for x in cache.kv_layers]
        assert cache.batch_size == 2 and cache.step_variant() == ()
        cache.reset()
        again, _ = _generate(model, ids, cache)
        assert torch.equal(again, got), scheme
    err = {k: (v - want_logits).abs().max() for k, v in logits.items()}
    assert err["int8-token"] > err["fp16"]  # int8 codes, not the float K/V
    kv = cache.kv_layers[0]
    state_layer = next(x for x in cache.layers if isinstance(x, (LinearAttentionLayer, StaticQuantizedHybridLayer)))
    conv, codes = state_layer.conv_states[0], kv.key.codes
    before_conv, before_codes = conv.clone(), codes.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert state_layer.conv_states[0] is conv and kv.key.codes is codes  # in place: the addresses a graph reads
    assert torch.equal(conv, before_conv[[1, 0]]) and torch.equal(codes, before_codes[[1, 0]])


def test_cache_wide_methods_walk_the_attention_layers_and_refuse_state_layers_by_name():
    """Every cache-wide method skips or forwards LFM2's conv layers 0 and 2: the reports list attention layers 1 and
    3, ``crop`` / ``batch_repeat_interleave`` refuse as the static cache does (not transformers' ``RuntimeError`` /
    ``AttributeError`` from the conv layer first), and K/V or static parameters for a conv layer are refused naming
    the attention layers."""
    cfg, model, ids = _model(_lfm2)
    cache = StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=MAX_LEN)
    assert cache.batch_size == -1 and cache.memory_report()["total_bytes"] == 0
    model(ids, **{CACHE_KW: cache})
    cache.check_inputs()
    assert [r["layer"] for r in cache.clipped()] == [1, 3]
    report = cache.calibration_report()
    assert [r["layer"] for r in report["layers"]] == [1, 3] and report["layers"][0]["max_position"] == 8
    cache.count_replayed_step()
    assert [x.tokens_written for x in cache.kv_layers] == [10, 10]
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(NotImplementedError, match=r"cannot batch_repeat_interleave\(2\)"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match=r"layer 0 keeps a convolution .* attention layers \[1, 3\]"):
        cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
    with pytest.raises(ValueError, match=r"layer 2 keeps a convolution .* attention layers \[1, 3\]"):
        cache.set_static_qparams(2, "key", torch.ones(2))


def test_a_failed_first_request_leaves_the_states_as_before():
    """A prompt past ``max_cache_len`` fails at the first attention layer, after conv layer 0 wrote its state: the
    K/V layers and the states are undone, so a retry (another batch) generates ``StaticCache``'s tokens."""
    cfg, model, ids = _model(_lfm2)
    cache = StaticQuantizedKVCache(config=cfg, scheme="fp16", max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="max_cache_len"):
        model(torch.randint(1, 96, (3, MAX_LEN + 1)), **{CACHE_KW: cache})
    assert not any(x.is_initialized for x in cache.kv_layers)
    assert not any(cache.layers[i].has_previous_state[0] for i in (0, 2))
    got, _ = _generate(model, ids, cache)
    want, _ = _generate(model, ids, StaticCache(config=cfg, max_cache_len=MAX_LEN))
    assert torch.equal(got, want)


def test_graphed_decode_refuses_a_hybrid_models_states(monkeypatch):
    """Capturing a decode step of a cache holding conv / Mamba states is refused before anything is captured (its
    replay is not verified on a GPU), naming the layers."""
    from pathlib import Path

    from kvbits.evaluate.graphs import GraphedDecode

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    cfg, model, ids = _model(_lfm2)
    cache = StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=MAX_LEN)
    tok = model(ids, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
    step = GraphedDecode(model, eager=1, capture=tape_capture)
    step(tok, cache_position=torch.tensor([9]), **{CACHE_KW: cache})
    with pytest.raises(ValueError, match=r"GraphedDecode: layers \[0, 2\] of StaticQuantizedKVCache keep convolution"):
        step(tok, cache_position=torch.tensor([10]), **{CACHE_KW: cache})


@pytest.mark.parametrize("make", [_lfm2, _qwen3_next, _zamba2, _falcon_h1], ids=["lfm2", "qwen3_next", "zamba2", "falcon_h1"])
def test_a_request_of_another_batch_after_reset_is_refused_by_name(make):
    """``reset()`` keeps the slabs and the states of the first request's batch (2): a request of 3 sequences was a bare
    ``RuntimeError: The size of tensor a (2) must match the size of tensor b (3)`` from transformers' in-place copy
    into a conv / Mamba state; now the ``ValueError`` the K/V slabs give, before anything is written, and the cache
    still serves a batch of 2."""
    cfg, model, ids = _model(make)
    cache = StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=MAX_LEN)
    first = model(ids, **{CACHE_KW: cache}).logits
    cache.reset()
    with pytest.raises(ValueError, match="cannot take 3 sequences .*batch of 2"):
        model(torch.randint(1, 96, (3, 7)), **{CACHE_KW: cache})
    cache.reset()
    torch.testing.assert_close(model(ids, **{CACHE_KW: cache}).logits, first, atol=0, rtol=0)


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_a_forward_that_failed_after_some_kv_layers_is_refused_at_the_next(step):
    """LFM2 (conv, attention, conv, attention): a convolution kernel failing in layer 2 after attention layer 1 was
    written left the K/V layers at {1: 9, 3: 0} tokens (a prefill) or {1: 9, 3: 8} (a decode step);
    ``_undo_request`` covers failures in K/V updates only. The retried prefill was refused as "layer 1: 9 tokens
    cached + 9 new > max_cache_len=16" (with room: "The size of tensor a (12) must match the size of tensor b (24)"
    deep in the model), the retried decode step ran on, layer 1 holding the failed step's token twice. Now the next
    forward is refused at its first K/V layer, naming the counts; ``reset()`` then serves the request as a fresh
    cache does."""
    cfg, model, ids = _model(_lfm2)
    kw = {"config": cfg, "scheme": "int8-token", "max_cache_len": MAX_LEN}
    with torch.no_grad():
        fresh = model(ids, **{CACHE_KW: StaticQuantizedKVCache(**kw)}, use_cache=True).logits
        cache = StaticQuantizedKVCache(**kw)
        if step == "decode":
            model(ids[:, :-1], **{CACHE_KW: cache}, use_cache=True)
        conv = model.model.layers[2].conv
        conv.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("conv kernel failed"))
        with pytest.raises(RuntimeError, match="conv kernel failed"):
            model(ids if step == "prefill" else ids[:, -1:], **{CACHE_KW: cache}, use_cache=True)
        del conv.forward  # the module's own forward again
        held = r"\{1: 9, 3: 0\}" if step == "prefill" else r"\{1: 9, 3: 8\}"
        with pytest.raises(ValueError, match=r"incomplete forward: its K/V layers hold " + held + ".*reset"):
            model(ids if step == "prefill" else ids[:, -1:], **{CACHE_KW: cache}, use_cache=True)
        cache.reset()
        torch.testing.assert_close(model(ids, **{CACHE_KW: cache}, use_cache=True).logits, fresh)
