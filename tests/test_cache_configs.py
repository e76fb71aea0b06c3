"""The caches built from configs transformers reads per layer, and ``Cache`` properties on them.

Heterogeneous configs (``per_layer_config``: Step3p7's sliding layers with fewer query heads, Dots3 Note's
SWA layers with their own latent attention) refuse global reads of their per-layer attributes with
``AmbiguousGlobalPerLayerAttributeError``; the caches read them per layer, as ``kvbits.plan`` does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbits.cache import QuantizedKVCache, attention_shape, cache_kwargs
from kvbits.cache.static import StaticQuantizedKVCache
from kvbits.plan.config import model_shape


def _step3p7_config():
    step3p7 = pytest.importorskip("transformers.models.step3p7.configuration_step3p7")
    cfg = step3p7.Step3p7TextConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, vocab_size=100, sliding_window=8, per_layer_config={1: {"num_attention_heads": 4}},
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, share_expert_dim=32,
        mlp_layer_types=["dense", "dense"],
    )  # fmt: skip
    assert cfg.is_heterogeneous
    return cfg


def test_heterogeneous_config_builds_both_caches_as_the_planner_reads_it():
    """Step3p7 with layer 1's query heads in ``per_layer_config``: ``kvbits plan`` read it, but both caches
    failed with AmbiguousGlobalPerLayerAttributeError ("'num_attention_heads' is a per-layer attribute") from
    ``attention_shape``. Now built, and a forward through each matches ``DynamicCache``."""
    modeling = pytest.importorskip("transformers.models.step3p7.modeling_step3p7")
    cfg = _step3p7_config()
    assert attention_shape(cfg) == (2, 8, 2, 16)
    assert [(s.kv_heads, s.head_dim) for s in model_shape(cfg).layers] == [(2, 16), (2, 16)]
    torch.manual_seed(0)
    model = modeling.Step3p7TextModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(DynamicCache(config=cfg), model)).last_hidden_state
        for cache in (QuantizedKVCache(config=cfg, scheme="int8-token"),
                      StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=16)):  # fmt: skip
            out = model(ids, **cache_kwargs(cache, model)).last_hidden_state
            assert cache.get_seq_length() == 12
            assert (out - ref).abs().max() < 0.05


def test_heterogeneous_latent_attention_is_refused_clearly():
    """Dots3 Note keeps ``kv_lora_rank`` per layer (its SWA layers have their own): the caches raised
    AmbiguousGlobalPerLayerAttributeError; now the ValueError for multi-head latent attention, as for DeepSeek-V3."""
    dots3 = pytest.importorskip("transformers.models.dots3_note.configuration_dots3_note")
    cfg = dots3.Dots3NoteTextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    head_dim=16)  # fmt: skip
    for make in (lambda: QuantizedKVCache(config=cfg), lambda: StaticQuantizedKVCache(config=cfg, max_cache_len=16)):
        with pytest.raises(ValueError, match=r"multi-head latent attention \(kv_lora_rank=\d+ in layer 0.*MHA/GQA/MQA"):
            make()


def test_heterogeneous_latent_attention_is_refused_by_the_planner_too():
    """``model_shape`` read ``kv_lora_rank`` from the global config alone, where a heterogeneous one (Dots3 Note)
    has none: with head dims that agree (16 for K and V in every layer) it planned 4 layers of 4 ordinary KV
    heads, a cache the model does not hold and that ``QuantizedKVCache`` refuses. Now refused as latent attention,
    naming the layer."""
    dots3 = pytest.importorskip("transformers.models.dots3_note.configuration_dots3_note")
    cfg = dots3.Dots3NoteTextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    head_dim=16, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
                                    swa_qk_nope_head_dim=8, swa_num_attention_heads=4,
                                    swa_num_key_value_heads=4)  # fmt: skip
    assert {(c.head_dim, c.v_head_dim) for c in cfg.per_layer_config} == {(16, 16)}
    with pytest.raises(ValueError, match=r"multi-head latent attention \(kv_lora_rank=\d+ in layer 0; .*MHA/GQA/MQA attention only"):
        model_shape(cfg)


def test_batch_size_is_what_transformers_caches_report():
    """transformers' ``Cache.batch_size`` is -1 before any layer holds K/V (``StaticCache``, ``DynamicCache``),
    skipping layers not yet updated. A fresh ``QuantizedKVCache`` gave None and raised "The batch size is not
    consistent across layers: [3, None]" after layer 0's update; ``StaticQuantizedKVCache`` gave -1 even with
    3 sequences stored. Now -1, then 3, as ``StaticCache``."""
    from transformers import LlamaConfig, StaticCache

    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip
    kv = torch.randn(3, 2, 5, 16)
    for cache in (StaticCache(config=cfg, max_cache_len=16), QuantizedKVCache(config=cfg), QuantizedKVCache(),
                  StaticQuantizedKVCache(config=cfg, max_cache_len=16)):  # fmt: skip
        seen = [cache.batch_size]
        for layer_idx in (0, 1):
            cache.update(kv, kv, layer_idx)
            seen.append(cache.batch_size)
        assert seen == [-1, 3, 3], type(cache).__name__
    assert DynamicCache(config=cfg).batch_size == -1
    cache = QuantizedKVCache(config=cfg)
    cache.update(kv, kv, 0)
    cache.reset()
    assert cache.batch_size == -1


def test_a_config_dict_is_refused_naming_the_config_object():
    """The cache needs the config object (its layer types come from transformers' resolver): a dict was refused as
    having "no num_hidden_layers / num_attention_heads" although it had both; now a TypeError saying what to pass."""
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    for make in (lambda: QuantizedKVCache(config=config), lambda: StaticQuantizedKVCache(config=config, max_cache_len=8)):
        with pytest.raises(TypeError, match=r"needs the model's transformers config \(model.config.*got a dict"):
            make()


def test_latent_attention_with_a_pre_rope_scheme_says_latent_attention():
    """DeepSeek-V2 with a pre-RoPE scheme: ``QuantizedKVCache`` asked its rotary module for tables before reading the
    shape and failed with "DeepseekV2RotaryEmbedding returns Tensor, not (cos, sin) tables"; now the shape is read
    first and the error is the one for multi-head latent attention, as the static cache and the planner give."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["deepseek_v2"](num_hidden_layers=2, hidden_size=64, num_attention_heads=4, kv_lora_rank=32,
                                       q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)  # fmt: skip
    for scheme in ("kvquant-4", "int4-channel-prerope", "int8-token"):
        with pytest.raises(ValueError, match=r"multi-head latent attention \(kv_lora_rank=32 in layer 0.*MHA/GQA/MQA"):
            QuantizedKVCache(config=cfg, scheme=scheme)


def test_values_of_another_head_dim_are_refused_when_built():
    """MiMo-V2-Flash caches keys of head_dim channels and values of ``v_head_dim`` (192 and 128). The planner refuses
    it; ``QuantizedKVCache`` built and refused at the model's first ``update`` (value_states (1, 2, 20, 32) "do not
    have the config's ... head_dim=48"), ``kivi-2`` with a group size error. Now both caches refuse it when built,
    naming the layer and both dims, as the planner does."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["mimo_v2_flash"](num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=48, v_head_dim=32,
                                         layer_types=["full_attention", "full_attention"])  # fmt: skip
    with pytest.raises(ValueError, match=r"keys of head_dim 48 channels and values of v_head_dim 32"):
        model_shape(cfg)
    for make in (lambda: QuantizedKVCache(config=cfg, scheme="int8-token"),
                 lambda: StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=16)):  # fmt: skip
        with pytest.raises(ValueError, match=r"layer 0 caches keys of head_dim 48 channels and values of v_head_dim "
                                             r"32: .*one head dim"):  # fmt: skip
            make()
    same = CONFIG_MAPPING["mimo_v2_flash"](num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, v_head_dim=16,
                                          layer_types=["full_attention", "full_attention"])  # fmt: skip
    assert attention_shape(same) == (2, 4, 2, 16)


def test_latent_attention_is_refused_alike_by_the_caches_the_planner_the_sites_and_rope():
    """Four places refused multi-head latent attention, each reading ``kv_lora_rank`` and wording it its own way: the
    planner named neither the rank nor the model type ("multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3
    style) ..."), ``kvbits.quant.rope`` no layer. One check now (``kvbits.plan.config.latent_attention``) and one
    wording: each names the rank, the layer, the model type and what kvbits supports, with its own error type."""
    import transformers

    from kvbits.analyze.sites import attention_sites
    from kvbits.quant.rope import RotaryTables

    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
        intermediate_size=64, vocab_size=128, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, rope_interleave=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    message = r"multi-head latent attention \(kv_lora_rank=16 in layer 0; model_type 'deepseek_v3'.*MHA/GQA/MQA attention only"
    sites = [
        (ValueError, lambda: attention_shape(cfg)),
        (ValueError, lambda: QuantizedKVCache(config=cfg)),
        (ValueError, lambda: StaticQuantizedKVCache(config=cfg, max_cache_len=8)),
        (ValueError, lambda: model_shape(cfg)),
        (ValueError, lambda: attention_sites(model)),
        (NotImplementedError, lambda: RotaryTables.from_config(cfg)),
        (NotImplementedError, lambda: RotaryTables.from_model(model)),
    ]
    for error, call in sites:
        with pytest.raises(error, match=message):
            call()
