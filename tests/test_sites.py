"""Where K/V are read (`kvbits.analyze.sites`): ``kvbits analyze`` and ``kvbits calibrate`` find the same
attention sites with the same ``(H_kv, D)`` as the cache stores and the planner counts, and refuse the
same models with the same messages. Tiny random-weight models built from configs."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvbits.analyze import analyze, attention_sites
from kvbits.calibrate.artifact import describe_model
from kvbits.calibrate.observers import KVCapture, find_kv_sites
from kvbits.plan import model_shape

logging.getLogger("transformers").setLevel(logging.ERROR)
pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build(cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def described(sites):
    return [(s.layer_idx, s.num_kv_heads, s.head_dim) for s in sites]


def planned(config) -> list[tuple[int, int, int]]:
    """``(layer, H_kv, D)`` of every cached layer as the planner counts them."""
    return [(i, layer.kv_heads, layer.head_dim) for i, layer in enumerate(model_shape(config).layers)]


def captured_and_cached(model, sites) -> list[tuple]:
    """``(site, (K, V) captured at the site, the model's own cache layer)`` after one 12-token forward."""
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with KVCapture(model, sites) as cap, torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        return [(s, cap.activations(s.layer_idx), out.past_key_values.layers[s.layer_idx]) for s in sites]


ARCHITECTURES = {
    # Llama 3.2 style: head_dim 32 stated, not hidden_size / heads = 16
    "llama-gqa-explicit-head_dim": lambda: transformers.LlamaConfig(**BASE, head_dim=32),
    "llama-mqa": lambda: transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 1}),
    "qwen2": lambda: transformers.Qwen2Config(**BASE),
    "qwen3-k_norm": lambda: transformers.Qwen3Config(**BASE, head_dim=16),
    # sliding and full layers, head_dim 32 with hidden 64 and 4 heads
    "gemma3-sliding": lambda: transformers.Gemma3TextConfig(
        **{**BASE, "num_hidden_layers": 3}, head_dim=32, sliding_window=8, layer_types=None
    ),
}


@pytest.mark.parametrize("make", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_analyze_and_calibrate_read_the_heads_the_cache_stores(make):
    from kvbits.cache import QuantizedKVCache

    cfg = make()
    model = build(cfg)
    analyzed, calibrated = attention_sites(model), find_kv_sites(model)
    plan = planned(cfg)
    assert described(analyzed) == described(calibrated) == plan
    assert [s.key_module for s in analyzed] == [s.key_module for s in calibrated]
    cache = QuantizedKVCache(config=cfg)
    assert {(cache.num_key_value_heads, cache.head_dim)} == {(kv, d) for _, kv, d in plan}
    record = describe_model(cfg)
    assert {(record["num_kv_heads"], record["head_dim"])} == {(kv, d) for _, kv, d in plan}
    # the captured tensors have the (B, H_kv, ., D) of what the cache stores (a sliding layer keeps fewer tokens)
    for s, (k, v), stored in captured_and_cached(model, calibrated):
        for got, kept in ((k, stored.keys), (v, stored.values)):
            assert (got.shape[:2], got.shape[3]) == (kept.shape[:2], kept.shape[3]) == ((1, s.num_kv_heads), s.head_dim)


def test_per_layer_head_dims_are_the_planners():
    """Gemma 4's global layers have a wider head (``global_head_dim``, in ``per_layer_config``)."""
    cfg = transformers.Gemma4TextConfig(**{**BASE, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32)
    model = build(cfg)
    plan = planned(cfg)
    assert described(attention_sites(model)) == described(find_kv_sites(model)) == plan
    assert plan[-1] == (3, 2, 32) and plan[0] == (0, 2, 16)


def test_values_from_the_key_projection_are_a_site():
    """Gemma 4's global layers with ``attention_k_eq_v`` have ``v_proj = None``: their values are ``v_norm``
    of ``k_proj``'s output, and the cache stores them (1 KV head of 32 here). They were no site: analyze
    left those layers out without a word, calibration called them layers without K/V."""
    cfg = transformers.Gemma4TextConfig(
        **{**BASE, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32, sliding_window=16,
        attention_k_eq_v=True, num_global_key_value_heads=1,
    )  # fmt: skip
    model = build(cfg)
    plan = planned(cfg)
    assert plan[-1] == (3, 1, 32) and model.model.layers[3].self_attn.v_proj is None
    sites = find_kv_sites(model)
    assert described(attention_sites(model)) == described(sites) == plan
    for _, (_, v), stored in captured_and_cached(model, sites):  # values are stored as captured (no RoPE)
        torch.testing.assert_close(v, stored.values)
    result = analyze(model, torch.randint(0, 64, (1, 16)), sample_tokens=16, channel_group=8)
    assert [la.layer for la in result.layers] == [0, 1, 2, 3]


def test_plot_head_is_checked_against_the_plotted_layers_heads(tmp_path):
    """``kvbits analyze --plot-head`` was checked against the fewest KV heads of any layer: on Gemma 4 with one KV
    head in its global layer 3 and two in its sliding layers, ``--plot-layer 0 --plot-head 1`` (and
    ``--plot-head 1`` alone) was refused ("must be a KV head in [0, 1)") though layer 0 has that head. Now the
    plotted layer's own count, or any layer's when none is given (the heatmap then picks a layer that has it)."""
    import argparse

    from kvbits.analyze.cli import _check_plot_args
    from kvbits.analyze.plots import plot_key_heatmaps

    cfg = transformers.Gemma4TextConfig(
        **{**BASE, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32, sliding_window=16,
        attention_k_eq_v=True, num_global_key_value_heads=1,
    )  # fmt: skip
    model = build(cfg)
    assert [s.num_kv_heads for s in attention_sites(model)] == [2, 2, 2, 1]
    for layer in (0, None):
        _check_plot_args(model, argparse.Namespace(plot_layer=layer, plot_head=1))
    with pytest.raises(ValueError, match=r"--plot-head must be a KV head of layer 3 in \[0, 1\), got 1"):
        _check_plot_args(model, argparse.Namespace(plot_layer=3, plot_head=1))
    with pytest.raises(ValueError, match=r"--plot-head must be a KV head in \[0, 2\), got 2"):
        _check_plot_args(model, argparse.Namespace(plot_layer=None, plot_head=2))
    result = analyze(model, torch.randint(0, 64, (1, 16)), sample_tokens=16, channel_group=8, keep_samples=True)
    assert plot_key_heatmaps(result, tmp_path / "heat.png", head=1).exists()


def test_calibrate_refuses_layers_of_different_shapes_saying_so():
    """Gemma 4's global layer 3 caches heads of 32 channels, its sliding ones 16: calibrate refused it for
    "attention modules (4 layers, (H_kv, D) in {(2, 32), (2, 16)}) disagree with the config (4 layers, 2 KV heads,
    head dim 16)", though they agree layer by layer. Now it says the layers differ, where, and why that is
    refused (an artifact holds one (H_kv, D) for every layer)."""
    from kvbits.calibrate import calibrate

    cfg = transformers.Gemma4TextConfig(**{**BASE, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32)
    with pytest.raises(ValueError, match=r"layers cache K/V of different shapes \(2 KV heads of dim 16 on layers "
                                         r"\[0, 1, 2\]; 2 KV heads of dim 32 on layers \[3\]\): a calibration "
                                         r"artifact holds one \(H_kv, D\)"):  # fmt: skip
        calibrate(build(cfg), torch.randint(0, 64, (256,)), "kvquant-4", context=64, windows=1)


def test_layers_without_kv_are_skipped_by_analyze_and_calibrate():
    """A hybrid model (LFM2: convolution layers 0 and 2, attention layers 1 and 3) caches K/V on some
    layers only: analyze reports those layers under their own index, and calibration reads exactly those (an
    artifact holds parameters for the layers that store K/V, format 2)."""
    cfg = transformers.Lfm2Config(**{**BASE, "num_hidden_layers": 4}, layer_types=["conv", "full_attention"] * 2)
    model = build(cfg)
    assert described(attention_sites(model)) == [(1, 2, 16), (3, 2, 16)]
    result = analyze(model, torch.randint(0, 64, (1, 16)), sample_tokens=16, channel_group=8)
    assert [la.layer for la in result.layers] == [1, 3]
    assert [site.layer_idx for site in find_kv_sites(model)] == [1, 3]


TINY_BART = {  # an encoder-decoder whose decoder layers hold self- and cross-attention
    "vocab_size": 64, "d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
}  # fmt: skip


def _same_layer_twice():
    model = build(transformers.LlamaConfig(**BASE))
    model.model.layers[1].self_attn.layer_idx = 0
    return model, r"model\.layers\.0\.self_attn and model\.layers\.1\.self_attn are both attention layer 0"


def _shared_attention():
    """Zamba2-like: one attention block shared by layers (``layer_idx`` -1). Before, the message blamed cross-attention
    of an encoder-decoder model (found by a review session)."""
    model = build(transformers.LlamaConfig(**BASE))
    for layer in model.model.layers:
        layer.self_attn.layer_idx = -1
    return model, r"both attention layer -1; .*\(an attention block shared by several layers .* is not supported\)"


def _cross_attention():
    cfg = transformers.BartConfig(**TINY_BART)
    torch.manual_seed(0)
    model = transformers.BartForCausalLM(cfg).eval()
    # refused by the shared check (kvbits._model.check_causal_lm) before the sites are compared
    return model, r"BartForCausalLM is not a decoder-only causal LM: its layers \[0, 1\] also attend to an encoder"


def _head_dim_attribute():
    model = build(transformers.LlamaConfig(**BASE))
    model.model.layers[0].self_attn.head_dim = 8  # the config: 64 / 4 = 16
    return model, r"model\.layers\.0\.self_attn has head_dim 8, expected 16 from the config's layer 0"


def _k_proj_size():
    model = build(transformers.LlamaConfig(**BASE))
    attn = model.model.layers[1].self_attn
    attn.k_proj = attn.v_proj = torch.nn.Linear(64, 64)  # 4 heads of 16, the config says 2
    return model, r"layers\.1\.self_attn\.k_proj has 64 outputs, expected num_key_value_heads x head_dim = 2 x 16"


def _v_head_dim():
    cfg = transformers.MiMoV2FlashConfig(**BASE, head_dim=16, v_head_dim=8)  # values narrower than keys
    return build(cfg), r"layers\.0\.self_attn\.v_proj has 16 outputs, expected .* = 2 x 16 = 32"


def _layer_beyond_the_config():
    model = build(transformers.LlamaConfig(**BASE))
    model.model.layers[1].self_attn.layer_idx = 7
    return model, r"model\.layers\.1\.self_attn: layer 7 is not a layer of the config, which has 2 layers"


REFUSED = {
    "same-layer-twice": _same_layer_twice,
    "shared-attention": _shared_attention,
    "cross-attention": _cross_attention,
    "head_dim-attribute": _head_dim_attribute,
    "k_proj-size": _k_proj_size,
    "v_head_dim": _v_head_dim,
    "layer-beyond-config": _layer_beyond_the_config,
}


@pytest.mark.parametrize("make", REFUSED.values(), ids=REFUSED.keys())
def test_both_commands_refuse_sites_that_disagree_with_the_cache(make):
    """Sites the cache would not store as found (two on one layer, or heads other than the config's)
    are refused by analyze and calibrate alike, when the sites are found, naming the module."""
    model, message = make()
    for find in (attention_sites, find_kv_sites):
        with pytest.raises(ValueError, match=message):
            find(model)


def test_model_without_config_reads_the_modules():
    """Bare modules (no ``config``): ``head_dim`` from the attention module, ``H_kv`` from ``k_proj``."""
    model = build(transformers.LlamaConfig(**BASE, head_dim=32))
    bare = torch.nn.ModuleList(layer.self_attn for layer in model.model.layers)
    assert described(attention_sites(bare)) == described(find_kv_sites(bare)) == [(0, 2, 32), (1, 2, 32)]


def test_calibrate_reads_the_decoder_of_a_composite_config():
    """A config holding a text encoder and a decoder (MusicGen) is described by its decoder, the part the
    KV cache holds (``get_text_config()`` without ``decoder=True`` refuses it as ambiguous)."""
    decoder = transformers.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64
    )
    cfg = transformers.MusicgenConfig(
        text_encoder=transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16).to_dict(),
        audio_encoder=transformers.EncodecConfig().to_dict(),
        decoder=decoder.to_dict(),
    )
    record = describe_model(cfg)
    assert (record["num_layers"], record["num_kv_heads"], record["head_dim"]) == (3, 4, 16)
    assert model_shape(cfg).n_layers == 3


def _gemma3_vlm():
    """Gemma-3-4B's architecture (SigLIP vision tower, Gemma 3 decoder), tiny."""
    text = transformers.Gemma3TextConfig(
        **{**BASE, "num_hidden_layers": 3}, head_dim=32, sliding_window=8, layer_types=None
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
    )
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval(), "model.language_model"


def _llava():
    """LLaVA: a CLIP vision tower (attention with k_proj/v_proj) and a Llama decoder."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
    )
    cfg = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**BASE, head_dim=32).to_dict(), vision_config=vision.to_dict()
    )
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(cfg).eval(), "model.language_model"


VISION_LANGUAGE = {"gemma3": _gemma3_vlm, "llava": _llava}


@pytest.mark.parametrize("make", VISION_LANGUAGE.values(), ids=VISION_LANGUAGE.keys())
def test_vision_language_models_are_read_at_their_language_decoder(make):
    """The vision tower's attention modules (k_proj and v_proj too, layer indices from 0) cache nothing:
    the sites are the language decoder's layers, with the heads the planner counts from the text config.
    They were refused as cross-attention (vision layer 0 and decoder layer 0 both "attention layer 0")."""
    model, decoder = make()
    assert any("vision_tower" in n and hasattr(m, "k_proj") for n, m in model.named_modules())
    analyzed, calibrated = attention_sites(model), find_kv_sites(model)
    plan = planned(model.config)
    assert described(analyzed) == described(calibrated) == plan
    assert len(plan) == model.config.get_text_config(decoder=True).num_hidden_layers
    assert all(s.name == f"{decoder}.layers.{s.layer_idx}.self_attn" for s in analyzed)
    for _, (k, v), stored in captured_and_cached(model, calibrated):
        assert (k.shape[:2], k.shape[3]) == (stored.keys.shape[:2], stored.keys.shape[3])
        kept = stored.values.shape[2]  # a sliding layer keeps its window's last tokens
        torch.testing.assert_close(v[:, :, -kept:], stored.values.float())
    result = analyze(model, torch.randint(0, 64, (1, 16)), sample_tokens=16, channel_group=8)
    assert [la.layer for la in result.layers] == list(range(len(plan)))


def test_encoder_decoder_cross_attention_is_still_refused():
    """The decoder of an encoder-decoder model holds self- and cross-attention on each layer: refused, as
    for the decoder alone (``BartForCausalLM``, in the refusals above), not read from the decoder's
    self-attention only."""
    cfg = transformers.BartConfig(**TINY_BART)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    message = r"BartForConditionalGeneration is not a decoder-only causal LM but an encoder-decoder model"
    for find in (attention_sites, find_kv_sites):
        with pytest.raises(ValueError, match=message):
            find(model)


def test_latent_attention_is_refused_by_name():
    """DeepSeek-V2/V3's multi-head latent attention (``kv_lora_rank``) has no ``k_proj``/``v_proj``: ``kvbits
    analyze`` and ``kvbits calibrate`` refused it with "models with fused QKV projections (GPT-2 c_attn, Phi-3
    qkv_proj) are not supported", which it does not have. Now named as the caches and the planner name it."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    message = r"DeepseekV3ForCausalLM uses multi-head latent attention \(kv_lora_rank=32 in layer 0.*MHA/GQA/MQA"
    for find in (attention_sites, find_kv_sites, lambda m: analyze(m, torch.randint(0, 64, (1, 16)))):
        with pytest.raises(ValueError, match=message):
            find(model)
