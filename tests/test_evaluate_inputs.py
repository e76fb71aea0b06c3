"""Bad input to the evaluation entry points, refused with a message instead of a wrong number or a torch
error from inside the model. Tiny random-weight Llama (vocabulary 101)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from test_evaluate import VOCAB, _ids, _llama

from kvbits.calibrate import calibrate
from kvbits.evaluate import evaluate, stream_hidden
from kvbits.evaluate.simulate import simulate as simulate_fn
from kvbits.evaluate.speed import speed_eval

pytestmark = pytest.mark.usefixtures("one_thread")


def test_simulate_from_the_package_is_the_function_even_after_its_module_loads():
    """Loading the submodule kvbits.evaluate.simulate bound it over the function of the same name, so
    ``from kvbits.evaluate import simulate`` gave a module ('module' object is not callable)."""
    import kvbits.evaluate as pkg
    from kvbits.evaluate import simulate

    assert simulate is simulate_fn and pkg.simulate is simulate_fn  # the submodule is loaded by now
    assert isinstance(sys.modules["kvbits.evaluate.simulate"], types.ModuleType)
    code = (  # a fresh interpreter: the runner loads the submodule first
        "import kvbits.evaluate.runner, types\n"
        "from kvbits.evaluate import simulate\n"
        "import kvbits.evaluate as e\n"
        "assert callable(simulate) and not isinstance(simulate, types.ModuleType), simulate\n"
        "assert e.simulate is simulate and e.simulate is simulate\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        (torch.full((64,), VOCAB), ValueError, rf"must lie in \[0, {VOCAB}\).*from {VOCAB} to {VOCAB}"),
        (torch.full((64,), -1), ValueError, r"from -1 to -1"),
        (torch.rand(64) * 99, TypeError, "must be an integer tensor, got torch.float32"),
        (torch.ones(64, dtype=torch.bool), TypeError, "must be an integer tensor, got torch.bool"),
    ],
)
def test_token_ids_outside_the_vocabulary_or_not_integers_are_refused(ids, error, message):
    """Float ids were truncated and bools read as 0 / 1 (evaluate ran and reported a perplexity); ids past
    the embedding table raised torch's 'index out of range in self' from the first layer."""
    model = _llama()
    with pytest.raises(error, match=message):
        evaluate(model, ids, 16, ["int4-token"])
    with pytest.raises(error, match=message):
        calibrate(model, ids, "kvquant-4", context=16, windows=1)
    with pytest.raises(error, match=message):
        stream_hidden(model, ids.reshape(1, -1)[:, :8], "int4-token")
    with pytest.raises(error, match=message):
        speed_eval(model, 16, ["int4-token"], data=ids, tokens=2, warmup=0)


def test_a_tokenizer_with_more_ids_than_the_embedding_table_is_named(tmp_path, capsys):
    """Text tokenized by a tokenizer of 256 ids for a model embedding 101 raised torch's 'IndexError: index out of
    range in self' from inside the first layer (evaluate, calibrate, speed, needle, monitor); ``kvbits analyze``
    said the windows were outside the table without naming the tokenizer. Now one check, after tokenizing."""
    from _bytelevel import byte_tokenizer, save_byte_tokenizer, write_sentences

    from kvbits.cli import main
    from kvbits.evaluate.models import LoadedModel, ModelSource
    from kvbits.evaluate.needle_run import needle_eval
    from kvbits.monitor.watch import watch

    path = write_sentences(tmp_path / "hay.txt", 200)
    text = str(path)
    lm = LoadedModel(_llama(layers=1), byte_tokenizer(), ModelSource(name="t", path="t"), "0" * 16)
    first = byte_tokenizer()(path.read_text())["input_ids"]
    at = next(i for i, t in enumerate(first) if t >= VOCAB)
    message = rf"id {first[at]} \(token {at};.*embedding table of {VOCAB} ids: the tokenizer has 256 ids"
    for call in (
        lambda: evaluate(lm, text, 16, ["int4-token"]),
        lambda: calibrate(lm, text, "kvquant-4", context=16, windows=1, fisher=False),
        lambda: speed_eval(lm, 16, ["int4-token"], data=text, tokens=2, warmup=0),
        lambda: needle_eval(lm, 300, ["int4-token"], data=text, depths=[0.5]),
        lambda: watch(lm, text, 16, "int4-token"),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    lm.model.save_pretrained(tmp_path / "model")
    save_byte_tokenizer(tmp_path / "model")
    assert main(["analyze", "--model", str(tmp_path / "model"), "--data", text, "--context", "64"]) == 2
    assert "the tokenizer has 256 ids" in capsys.readouterr().err


def test_no_token_window_is_refused_before_the_model_runs():
    """``(0, T)`` token windows raised torch's 'cannot reshape tensor of 0 elements' inside the model (evaluate)
    or ZeroDivisionError (calibrate)."""
    model, empty = _llama(), torch.zeros((0, 16), dtype=torch.long)
    for call in (lambda: evaluate(model, empty, 16, ["int4-token"]),
                 lambda: calibrate(model, empty, "kvquant-4", context=16, windows=1),
                 lambda: speed_eval(model, 16, ["int4-token"], data=empty, tokens=2, warmup=0)):  # fmt: skip
        with pytest.raises(ValueError, match=r"token windows \(W, T\) = \(0, 16\): no window"):
            call()


def test_non_finite_logits_of_the_unquantized_model_are_named():
    """A NaN in the output embedding (hidden states finite, logits NaN) was reported as a logit post-processing
    kvbits does not reproduce; NaN hidden states of the unquantized model are named as such too."""
    model = _llama()
    with torch.no_grad():
        model.lm_head.weight[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match="model's own logits hold NaN or inf at 64 of 64 positions"):
        evaluate(model, _ids(64), 64, ["int4-token"], attn_layers=[])
    model, ids = _llama(), _ids(128)
    bad = int(ids[0, 100])
    ids[0, :100][ids[0, :100] == bad] = (bad + 1) % VOCAB  # only at 100: past the head check's 64-token prefix
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite hidden states of the unquantized model in window 0"):
        evaluate(model, ids, 128, ["int4-token"], attn_layers=[])


def test_a_scheme_that_can_not_store_the_head_dim_is_refused_before_any_forward_pass():
    """kivi-2's values are grouped in 32 channels; at head_dim 16 evaluate ran the reference and int8-token (and
    speed_eval timed DynamicCache and int8-token) before failing at kivi-2's cache."""
    from _tinyllama import tiny_llama

    model, calls = tiny_llama(), []
    model.register_forward_hook(lambda *_: calls.append(1))
    ids = _ids(256)[0] % model.config.vocab_size
    message = "scheme 'kivi-2' can not store head_dim 16: values: per-token groups of 32 channels"
    with pytest.raises(ValueError, match=message):
        evaluate(model, ids, 128, ["int8-token", "kivi-2"], attn_layers=[])
    with pytest.raises(ValueError, match=message):
        speed_eval(model, 64, ["int8-token", "kivi-2"], data=ids, tokens=2, warmup=1)
    assert calls == []


def test_a_scheme_that_can_not_store_a_later_layers_head_dim_is_refused_before_any_forward_pass():
    """Gemma 4's global layers are wider than its sliding ones: the entry points checked the schemes against layer
    0's head_dim (64) alone, so int4-g64 passed; evaluate then failed inside the simulator after the reference
    pass ("token group size 64 must divide head_dim 96", no scheme or layer named), speed_eval after timing
    int8-token. Now each layer's head dim is checked up front; a mixed scheme storing layer 1 otherwise runs."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=96,
                           sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                           hidden_size_per_layer_input=0)  # fmt: skip
    torch.manual_seed(0)
    model, calls = Gemma4ForCausalLM(cfg).eval(), []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    ids = _ids(128)[0]
    message = (r"scheme 'int4-g64' can not store head_dim 96 of layer 1 \(other layers: head_dim 64\): keys: "
               "per-token groups of 64 channels do not divide head_dim 96")  # fmt: skip
    for call in (lambda: evaluate(model, ids, 64, ["int8-token", "int4-g64"], attn_layers=[]),
                 lambda: evaluate(model, ids, 64, ["int8-token", "int4-g64"], mode="stream"),
                 lambda: speed_eval(model, 32, ["int8-token", "int4-g64"], data=ids, tokens=2, warmup=0)):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"'int8-token,1=int4-g64' can not store head_dim 96 of layer 1 "):
        evaluate(model, ids, 64, ["int8-token,1=int4-g64"], attn_layers=[])
    assert calls == []
    hook.remove()
    out = evaluate(model, ids, 64, ["int4-g64,1=int8-token"], attn_layers=[])  # layer 1 stored in int8
    assert out["windows"] == 1


def test_a_sliding_layer_kept_in_full_precision_is_not_checked_up_front():
    """Layer 0 slides over 16 tokens, which kivi-2 (residual 128) keeps in full precision: the cache builds that
    layer as a ``fallback`` and quantizes nothing there, yet the up-front check refused "int8-token,0=kivi-2" as
    unable to store layer 0's head_dim 16. It now skips the layers the cache's own rule (``sliding_falls_back``)
    keeps in full precision; a layer that quantizes is still checked."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from kvbits.cache import QuantizedKVCache

    def gemma(window: int):
        cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                               sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                               hidden_size_per_layer_input=0)  # fmt: skip
        torch.manual_seed(0)
        return Gemma4ForCausalLM(cfg).eval()

    model, ids = gemma(16), _ids(128)[0]
    assert [layer.mode for layer in QuantizedKVCache(model.config, "int8-token,0=kivi-2").layers] == ["fallback", "quantized"]
    assert evaluate(model, ids, 64, ["int8-token,0=kivi-2"], attn_layers=[])["windows"] == 1
    assert evaluate(model, ids, 64, ["int8-token,0=kivi-2"], mode="stream")["windows"] == 1
    with pytest.raises(ValueError, match=r"'int8-token,0=kivi-4' can not store head_dim 16 of layer 0 "):
        evaluate(gemma(512), ids, 64, ["int8-token,0=kivi-4"], attn_layers=[])  # a window kivi-4 quantizes in


def test_one_scheme_given_bare_is_refused_with_how_to_pass_it():
    """evaluate(model, ids, 16, "int4-token") read the string letter by letter: "unknown scheme 'i'"."""
    model = _llama()
    for call in (lambda: evaluate(model, _ids(64)[0], 16, "int4-token"),
                 lambda: speed_eval(model, 16, "int4-token", data=_ids(64)[0], tokens=2, warmup=0)):  # fmt: skip
        with pytest.raises(TypeError, match=r"schemes must be a list .* pass \['int4-token'\]"):
            call()


def test_simulated_prefill_longer_than_the_forward_is_refused():
    """prompt_len >= T put every query in the exact prefill: logits equal to the unquantized model's."""
    model = _llama()
    with simulate_fn(model, "int2-token", semantics="prefill", prompt_len=100), pytest.raises(
        ValueError, match="no query comes after the prompt"
    ):
        model(_ids(40))
    with simulate_fn(model, "int2-token", semantics="prefill", prompt_len=20):  # shorter: quantizes
        out = model(_ids(40)).logits
    assert not torch.equal(out, model(_ids(40)).logits)


def test_a_context_past_a_learned_position_table_is_refused_before_the_run(caplog):
    """GPT-2 has no embedding past n_positions: kvbits warned "extrapolation", then torch raised 'index out
    of range'. RoPE models still run there, with the warning."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvbits.plan.config import check_context_fits

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()
    ids = _ids(300)[0]
    with pytest.raises(ValueError, match="exceeds the 64 positions of this gpt2 model's learned position table"):
        evaluate(gpt2, ids, 100, ["int4-token"])
    with pytest.raises(ValueError, match="learned position table"):
        speed_eval(gpt2, 100, ["int4-token"], data=ids, tokens=2, warmup=0)
    check_context_fits(gpt2.config, 64)  # within the table: fine
    llama = _llama()
    with caplog.at_level("WARNING"):
        check_context_fits(llama.config, 10 * llama.config.max_position_embeddings)  # RoPE: warned, not refused
    assert "extrapolation" in caplog.text


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4))


@pytest.mark.parametrize("bad", [None, "module", "config-less"])
def test_something_other_than_a_model_is_refused_by_every_entry_point(bad):
    """None (or a module without a config) raised AttributeError from kvbits' own code ('NoneType' object has
    no attribute 'config' / 'modules') in evaluate, simulate, stream_hidden and use_fused_decode."""
    from kvbits.cache import use_fused_decode
    from kvbits.evaluate import needle_eval

    model = {"module": torch.nn.Linear(2, 2), "config-less": object()}.get(bad)
    got = "None" if model is None else type(model).__name__
    ids = _ids(64)
    calls = {
        "evaluate": lambda: evaluate(model, ids, 16, ["int4-token"]),
        "speed_eval": lambda: speed_eval(model, 16, ["int4-token"], data=ids, tokens=2, warmup=0),
        "needle_eval": lambda: needle_eval(model, [64], ["int4-token"]),
        "simulate": lambda: simulate_fn(model, "int4-token").__enter__(),
        "stream_hidden": lambda: stream_hidden(model, ids.reshape(1, -1)[:, :8], "int4-token"),
        "use_fused_decode": lambda: use_fused_decode(model),
    }
    for where, call in calls.items():
        also = "a model name or path, a LoadedModel, or " if where in ("evaluate", "speed_eval", "needle_eval") else ""
        with pytest.raises(TypeError, match=rf"^{where}: model must be {also}a transformers model .*, got {got}$"):
            call()


def test_a_model_without_attention_layers_is_refused_not_switched():
    """A Mamba model keeps no KV cache: use_fused_decode switched its attention implementation anyway (and
    returned as if done); stream_hidden / evaluate failed inside the cache with advice to pass num_layers=."""
    from kvbits.cache import use_fused_decode

    model = _mamba()
    before = model.config._attn_implementation
    ids = _ids(64)
    message = r"MambaForCausalLM has no attention modules .* no KV cache for kvbits to quantize"
    with pytest.raises(ValueError, match="use_fused_decode: " + message):
        use_fused_decode(model)
    assert model.config._attn_implementation == before
    for where, call in {
        "evaluate": lambda: evaluate(model, ids, 16, ["int4-token"]),
        "simulate": lambda: simulate_fn(model, "int4-token").__enter__(),
        "stream_hidden": lambda: stream_hidden(model, ids.reshape(1, -1)[:, :8], "int4-token"),
    }.items():
        with pytest.raises(ValueError, match=f"{where}: " + message):
            call()


def test_a_calibration_for_no_scheme_evaluated_is_named_plainly():
    """The message read "calibration given for ['kvquant-4'], ... (['kivi-2'])": list reprs."""
    from kvbits.calibrate import artifact_from_samples

    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=g) for _ in range(2)]
    art = artifact_from_samples("kvquant-4", k, k)
    with pytest.raises(ValueError, match=r"^calibration given for kvquant-4, which is not among the schemes evaluated "
                       r"\(kivi-2, int4-token\); a calibration serves the scheme it was made for$"):
        evaluate(_llama(), _ids(64), 16, ["kivi-2", "int4-token"], calibration=art)


def test_a_calibration_pinned_to_weights_says_a_module_can_not_be_matched(caplog):
    """A calibration made for a loaded model's weights (its fingerprint) served to a model given as a module: the
    module has no content id, so only its shape can be checked; before, that passed in silence (a same-shaped
    model B served model A's calibration unnoticed). Now a WARNING says so; a calibration that pins only the
    architecture (fitted on a module: "config:<hash>") says nothing."""
    from dataclasses import replace

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    model = _llama()
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 32, generator=g) for _ in range(2)]
    arch = artifact_from_samples("kvquant-4", k, k, meta={"model": describe_model(model.config)})
    pinned = replace(arch, meta={**arch.meta, "model": {**arch.meta["model"], "fingerprint": "0123456789abcdef"}})
    for art, said in ((arch, False), (pinned, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvbits.evaluate"):
            evaluate(model, _ids(64), 64, ["kvquant-4"], calibration=art, attn_layers=[])
        warned = [r.getMessage() for r in caplog.records if "can not be matched" in r.getMessage()]
        message = (
            "calibration was made for the weights with fingerprint 0123456789abcdef; a model given as a module can not "
            "be matched to them (only its shape was checked): give it by spec or as a LoadedModel to have them compared"
        )
        assert warned == ([message] if said else [])


def _falcon(**layout):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    bias=False, **layout)  # fmt: skip
    return transformers.FalconForCausalLM(cfg).eval()


@torch.no_grad()
def test_an_alibi_model_is_refused_by_the_simulator_and_runs_in_stream_mode():
    """Falcon with ALiBi adds its position bias to the attention mask, which the simulator does not build:
    transformers 5.25's Falcon (which dispatches through the AttentionInterface) failed inside its forward
    ('NoneType' object has no attribute 'dtype'). Refused before the run, naming the mode that works."""
    model = _falcon(alibi=True, new_decoder_architecture=False, multi_query=False)
    ids = _ids(64)[0]
    with pytest.raises(ValueError, match=r"ALiBi position bias .* mode='stream'"):
        evaluate(model, ids, 64, ["int4-token"], attn_layers=[])
    out = evaluate(model, ids, 64, ["int4-token"], mode="stream", attn_layers=[])
    assert out["results"][0]["kl"] > 0


def _llama4(chunk: int = 16):
    """A 4-layer Llama 4 text model: layers 0-2 chunked attention (chunks of ``chunk`` tokens), layer 3 full."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=chunk, num_local_experts=1,
        max_position_embeddings=512, interleave_moe_layer_step=0, moe_layers=[],
    )  # fmt: skip
    model = transformers.Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharper predictions: a wrong attention shows in the KL
    return model


def test_a_causal_lm_whose_base_model_is_itself_is_evaluated_through_its_decoder():
    """Llama4ForCausalLM names a base_model_prefix ('language_model') it does not hold, so transformers' base_model
    and get_decoder() return the causal LM itself: evaluate and stream_hidden called it for last_hidden_state and
    failed with "'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'". Its ``model`` is the
    decoder; the real cache of an exact float32 'scheme' then measures nothing (KL 3e-8), int8 a little."""
    from test_evaluate import FP32

    from kvbits.evaluate.stream import base_model

    model = _llama4()
    assert base_model(model) is model.model
    ids = _ids(40)[0]
    exact, int8 = evaluate(model, ids, 40, [FP32, "int8-token"], mode="stream", attn_layers=[])["results"]
    assert exact["kl"] < 1e-6 and exact["top1"] == 1 and int8["kl"] > 10 * exact["kl"]
    assert exact["ppl_ref"] == pytest.approx(float(torch.exp(model(ids[None], labels=ids[None]).loss)), rel=1e-5)


@torch.no_grad()
def test_chunked_attention_past_one_chunk_is_refused_by_the_simulator():
    """A query of a chunked-attention layer (Llama 4) sees its own chunk, from the chunk's start; the simulator
    attended through a sliding window of the chunk size, into the previous chunk: an exact float32 'scheme'
    measured KL 1.44 nats and top-1 0.51 against the model (chunks of 16, 80 tokens), without a word. Refused
    now beyond one chunk, naming mode='stream'; within one chunk the two masks agree and so do the models."""
    from test_evaluate import FP32

    model, ids = _llama4(chunk=16), _ids(80)
    with simulate_fn(model, FP32):  # one chunk: exact
        h = model.model(ids[:, :16]).last_hidden_state
    torch.testing.assert_close(h, model.model(ids[:, :16]).last_hidden_state, rtol=1e-5, atol=1e-5)
    refused = r"layer 0 attends in chunks of 16 tokens .* mode='stream'"
    with pytest.raises(ValueError, match=refused), simulate_fn(model, FP32):  # 80 tokens: 5 chunks
        model.model(ids)


def test_the_simulator_refuses_pre_rope_keys_where_the_cache_does():
    """HunYuan normalises its keys after RoPE, so the cache refuses pre-RoPE schemes (no pre-RoPE frame to
    un-rotate to). The simulator, which stands for that cache in mode='simulate', built the tables anyway and
    measured a cache that can not be made. Refused now with the cache's reason; post-RoPE schemes still run."""
    import transformers

    from kvbits.schemes import get_scheme

    cfg = transformers.HunYuanDenseV1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    model = transformers.HunYuanDenseV1ForCausalLM(cfg).eval()
    ids = _ids(40)
    refused = r"normalises its keys after RoPE.*pre_rope=False"
    with pytest.raises(ValueError, match=refused), simulate_fn(model, get_scheme("int4-channel-prerope")):
        model.model(ids)
    with simulate_fn(model, get_scheme("int4-channel")), torch.no_grad():
        assert torch.isfinite(model.model(ids).last_hidden_state).all()


def test_a_model_that_keeps_its_attention_is_refused_naming_stream_mode(monkeypatch):
    """A model whose attention does not dispatch through the AttentionInterface keeps its implementation when
    asked for another (transformers logs it): the simulator can not see its K/V, and says which mode can."""
    model = _llama()
    monkeypatch.setattr(model, "set_attn_implementation", lambda impl: None)
    with pytest.raises(RuntimeError, match=r"did not accept attn_implementation='kvbits_simulate'.*mode='stream'"):
        evaluate(model, _ids(64)[0], 64, ["int4-token"], attn_layers=[])
    assert model.config._attn_implementation == "sdpa"


def test_a_scheme_listed_twice_is_named_in_words_by_every_runner():
    """evaluate said "scheme names must be unique, repeated: ['int4-token']", needle and speed "schemes must
    have distinct names, got [...]"; plan named the scheme in words. One wording for all (before any model
    loads: no model at "nowhere")."""
    from kvbits.evaluate import needle_eval

    twice = ["int4-token", "kivi-2", "int4-token"]
    with pytest.raises(ValueError, match=r"^scheme 'int4-token' is listed twice; each scheme is evaluated"):
        evaluate(_llama(), _ids(64)[0], 64, twice, attn_layers=[])
    with pytest.raises(ValueError, match=r"^scheme 'int4-token' is listed twice; each scheme is measured"):
        needle_eval("nowhere", [1024], twice)


def test_numpy_prompt_len_fractional_layers_and_short_token_windows(caplog):
    """A NumPy ``prompt_len`` was refused as out of range ("needs 0 < prompt_len < 63, got np.int64(20)");
    ``attn_layers=[0.7]`` measured layer 0 without a word (``int(0.7)``); 2-D token data of 1 row with
    ``windows=3`` ran 1 window silently, where 1-D data of too few tokens says so."""
    import logging

    import numpy as np

    model, ids = _llama(), _ids(32)
    out = evaluate(model, ids, 32, ["int4-token"], semantics="prefill", prompt_len=np.int64(20), attn_layers=[])
    assert out["windows"] == 1
    for bad in ([0.7], [True], ["0"]):
        with pytest.raises(ValueError, match=r"attn_layers must be layer indices \(ints\), got"):
            evaluate(model, ids, 32, ["int4-token"], attn_layers=bad)
    with caplog.at_level(logging.WARNING, logger="kvbits"):
        assert evaluate(model, ids, 32, ["int4-token"], windows=3, attn_layers=[np.int64(1)])["windows"] == 1
    assert "asked for 3 windows but the token data holds only 1 rows; using 1" in caplog.text


def test_simulate_and_stream_take_prompt_len_and_attn_layers_as_evaluate_does():
    """``simulate(attn_layers=[0.7])`` recorded layer 0 (``int(0.7)``) and ``attn_layers=[5]`` of a 2-layer model
    recorded nothing, both without a word; a NumPy ``prompt_len`` was refused by both ("needs 0 < prompt_len <
    T=16, got np.int64(8)"), ``stream_hidden`` prefilled 1 token for ``prompt_len=True`` and ignored a
    ``prompt_len`` given with ``semantics='decode'``. Now as ``evaluate()`` takes them."""
    import numpy as np

    model, ids = _llama(), _ids(16)
    for bad, message in (([0.7], r"must be layer indices \(ints\), got \[0.7\]"), ([5], r"must be in \[0, 2\), got \[5\]")):
        with pytest.raises(ValueError, match=f"attn_layers {message}"), simulate_fn(model, "int4-token", attn_layers=bad):
            pass
    with simulate_fn(model, "int4-token", semantics="prefill", prompt_len=np.int64(8), attn_layers=[np.int64(1)]) as sim:
        model(ids)
    assert sim.prompt_len == 8 and set(sim.attn_error) == {1}
    prefilled = stream_hidden(model, ids, "int4-token", semantics="prefill", prompt_len=np.int64(8))
    assert torch.equal(prefilled, stream_hidden(model, ids, "int4-token", semantics="prefill", prompt_len=8))
    with pytest.raises(ValueError, match=r"needs 0 < prompt_len < T=16, got True"):
        stream_hidden(model, ids, "int4-token", semantics="prefill", prompt_len=True)
    with pytest.raises(ValueError, match=r"prompt_len is only used with semantics='prefill', got prompt_len=8"):
        stream_hidden(model, ids, "int4-token", prompt_len=8)


def _int8_first(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (float32) with an int8 parameter registered first, as a quantized weight or index table is."""
    model.model.register_parameter("qweight", torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    assert next(model.parameters()).dtype == torch.int8
    return model


def test_a_float32_model_whose_first_parameter_is_int8_runs_as_float32(monkeypatch):
    """The dtype of a run was read from the model's first parameter: an int8 one first made a float32 model
    record dtype "int8" (``_run_dtype``, speed and needle summaries) and check its logit head at the half-precision
    tolerance 3e-2 instead of float32's 1e-3. Both now read the first floating parameter (``floating_dtype``)."""
    from kvbits.evaluate import runner
    from kvbits.evaluate.inputs import _run_dtype

    model = _int8_first(_llama())
    tolerances = []
    real = runner.check_logit_head

    def spy(*args, **kwargs):
        tolerances.append(kwargs["tolerance"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "check_logit_head", spy)
    evaluate(model, _ids(200)[0], 64, ["int4-token"], windows=1)
    assert tolerances == [1e-3]
    assert _run_dtype(model, None) == "float32" and _run_dtype(model, "bfloat16") == "bfloat16"  # else as asked


@pytest.mark.parametrize("bad", [torch.int8, torch.complex64, 16])
def test_a_dtype_that_is_no_floating_torch_dtype_is_refused_before_the_model_loads(bad, tmp_path):
    """A dtype given as a torch dtype was not checked: torch.int8 failed only after the model loaded (in
    ``Module.to``), torch.complex64 deep in the first forward (softmax not implemented for ComplexFloat)."""
    from kvbits.calibrate import collect_samples

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="or a floating torch dtype, got"):
        evaluate(missing, "pride-and-prejudice", 64, ["int4-token"], dtype=bad)
    with pytest.raises(ValueError, match="or a floating torch dtype, got"):
        collect_samples(missing, "pride-and-prejudice", context=64, windows=1, dtype=bad)


def test_a_scheme_name_too_long_for_a_file_name_is_refused_before_the_run(tmp_path):
    """A 341-character mixed scheme string (``int4-token,0=int8-token,2=int8-token,...``) passed the name check, ran
    every window, then failed writing ``tokens/<name>.safetensors``: OSError 'File name too long'."""
    from kvbits.schemes import get_scheme

    long = get_scheme("int4-token").replace(name="int4-token-" + "x" * 240)
    with pytest.raises(ValueError, match=r"has 251 characters, too long for a file name .* at most 200"):
        evaluate(_llama(), _ids(64), 64, [long], out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
