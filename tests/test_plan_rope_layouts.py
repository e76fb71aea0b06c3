"""The planner refuses pre-RoPE schemes where the quantized caches do: RoPE layouts other than rotate-half (Cohere,
GLM, ...) and multimodal RoPE from a family's default ``mrope_section`` (Qwen2-VL without RoPE parameters).

The sweep over every decoder model type (plan versus ``QuantizedKVCache`` / ``StaticQuantizedKVCache``) that found
them is kept as a reproducer under the review's notes; these tests pin what it found, with tiny configs.
"""

from __future__ import annotations

import importlib
import re

import pytest

transformers = pytest.importorskip("transformers")

from kvbits.plan import plan
from kvbits.plan.positions import NOT_ROTATE_HALF, default_mrope_section

SMALL = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "intermediate_size": 128, "max_position_embeddings": 256,
}  # fmt: skip


def _config(model_type, **extra):
    return transformers.CONFIG_MAPPING[model_type](**{**SMALL, **extra})


@pytest.mark.parametrize("model_type", ["cohere", "cohere2", "glm", "glm4", "helium"])
def test_pre_rope_plans_refused_for_rope_layouts_the_cache_refuses(model_type):
    """The cache refuses pre-RoPE keys of these families (their RoPE is not rotate-half); the planner used to price
    them all the same (Cohere with kvquant-4 at 128 tokens: 13,848 bytes, GLM: 77,376). Now it refuses, naming the
    model type and why, with or without fused decode; post-RoPE schemes still plan."""
    from kvbits.cache import QuantizedKVCache

    config = _config(model_type)
    config._name_or_path = "org/some-model"  # the message names the model type, not just the model
    with pytest.raises(NotImplementedError, match="layout other than rotate-half"):
        QuantizedKVCache(config, "kvquant-4")
    for scheme in ("kvquant-4", "int4-channel-prerope"):
        for fused in (False, True):
            with pytest.raises(ValueError, match=rf"model_type '{model_type}'\) applies RoPE in a layout other than "
                                                 r"rotate-half.*post-RoPE keys"):  # fmt: skip
                plan(config, scheme=scheme, context=128, fused_decode=fused)
    assert plan(config, scheme="int8-token", context=128)["total_bytes"] > 0


def test_pre_rope_plans_refused_for_a_default_mrope_section():
    """A Qwen2-VL config without ``mrope_section`` in its RoPE parameters still rotates by multimodal RoPE: its
    rotary module falls back to [16, 24, 24]. The planner priced kvquant-4 (13,848 bytes at 128 tokens) and the
    cache failed deep inside the rotary module (RuntimeError: split_with_sizes ... [16, 24, 24]) at a head dim the
    default does not fit; both now refuse it with the section and why."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.static import StaticQuantizedKVCache

    config = _config("qwen2_vl")
    assert default_mrope_section("qwen2_vl_text") == [16, 24, 24]
    assert default_mrope_section("llama") is None and default_mrope_section(None) is None
    with pytest.raises(ValueError, match=r"model_type 'qwen2_vl_text'\) rotates its keys by multimodal RoPE "
                                         r"\(mrope_section \[16, 24, 24\]\)"):  # fmt: skip
        plan(config, scheme="kvquant-4", context=128)
    for build in (lambda: QuantizedKVCache(config, "kvquant-4"),
                  lambda: StaticQuantizedKVCache(config, "kvquant-4", max_cache_len=64)):  # fmt: skip
        with pytest.raises(ValueError, match=r"multimodal RoPE \(mrope_section \[16, 24, 24\]\)"):
            build()
    assert plan(config, scheme="int8-token", context=128)["total_bytes"] > 0


@pytest.mark.parametrize("model_type", ["glm_ocr", "ernie4_5_vl_moe"])
def test_multimodal_rope_in_another_layout_is_refused_for_the_same_primary_reason(model_type):
    """GLM-OCR and ERNIE 4.5 VL rotate by multimodal RoPE in a layout other than rotate-half: the planner said only
    "layout other than rotate-half" while the cache said "multimodal RoPE" for the same refusal. Now the planner
    leads with the multimodal RoPE, as the cache does, and names the layout too."""
    from kvbits.cache import QuantizedKVCache

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    config = transformers.CONFIG_MAPPING[model_type]()
    with pytest.raises(ValueError, match=r"rotates its keys by multimodal RoPE \(mrope_section"):
        QuantizedKVCache(config, "int4-channel-prerope")
    with pytest.raises(ValueError, match=r"\) rotates its keys by multimodal RoPE \(mrope_section \[[\d, ]+\]\).*; it "
                                         r"also applies RoPE in a layout other than rotate-half"):  # fmt: skip
        plan(config, scheme="int4-channel-prerope", context=128)


@pytest.mark.parametrize("model_type", NOT_ROTATE_HALF)
def test_the_refused_layouts_are_what_the_cache_s_probe_refuses(model_type):
    """Each family of ``NOT_ROTATE_HALF`` (refused by name by the planner and ``RotaryTables``) is refused by the
    probe of its own ``apply_rotary_pos_emb`` too, in the installed transformers: the list is not stale."""
    import torch  # noqa: F401 - the probe builds the family's rotary module

    from kvbits.quant import rope

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    text = transformers.CONFIG_MAPPING[model_type]()
    try:
        module = rope._modeling_module(model_type)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} ships no modeling file for {model_type!r}")
    rotary = rope._instantiate(rope._rotary_class(module, model_type), text, None)
    with pytest.raises(NotImplementedError):
        rope.RotaryTables._build(text, rotary, importlib.import_module(module.__name__))
    with pytest.raises(NotImplementedError, match="layout other than rotate-half"):
        rope.RotaryTables.from_config(text)


@pytest.mark.parametrize("layer_params", [False, True], ids=["default-section", "per-type-section"])
def test_pre_rope_refused_for_per_layer_type_multimodal_rope(layer_params):
    """Cohere Compass keeps its RoPE parameters per layer type and its rotary module recomposes every layer type's
    tables by multimodal RoPE (``mrope_section`` of that type, else [24, 20, 20]; [22, 22, 20] in transformers 5.17).
    The planner priced kvquant-4 and both caches failed deep inside the module (KeyError: 'full_attention' from the
    default config's empty ``rope_parameters``). Now both refuse it as multimodal RoPE, with the section: the
    family's default, or the one the config gives its layer type."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.static import StaticQuantizedKVCache

    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 4, 4]}}
    config = _config("cohere_compass_text", head_dim=32, **({"rope_parameters": rope} if layer_params else {}))
    default = default_mrope_section("cohere_compass_text")  # read from the installed modeling file
    assert default in ([24, 20, 20], [22, 22, 20])  # transformers 5.25; 5.17 (the GPU image)
    section = re.escape(str([8, 4, 4] if layer_params else default))
    with pytest.raises(ValueError, match=rf"'cohere_compass_text'\)? rotates its keys by multimodal RoPE "
                                         rf"\(mrope_section {section}\)"):  # fmt: skip
        plan(config, scheme="kvquant-4", context=128)
    for build in (lambda: QuantizedKVCache(config, "kvquant-4"),
                  lambda: StaticQuantizedKVCache(config, "kvquant-4", max_cache_len=64)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"multimodal RoPE \(mrope_section {section}\)"):
            build()
    assert plan(config, scheme="int8-token", context=128)["total_bytes"] > 0


def test_pre_rope_keys_of_nope_layer_types_are_cached_as_planned():
    """Beam's full-attention layers have no RoPE (``rope_parameters["full_attention"] is None``). The planner priced
    kvquant-4 while ``QuantizedKVCache`` failed ("layer 1 has type 'full_attention'; rotary module knows
    ['sliding_attention']"). Now the cache keeps those layers' keys as they come (identity tables), a forward
    through it stays close to ``DynamicCache``'s, and it holds the bytes the planner counts."""
    import torch

    from kvbits.cache import QuantizedKVCache, cache_kwargs

    if "beam" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no 'beam'")
    config = _config(
        "beam", num_hidden_layers=3, head_dim=16, sliding_window=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()  # 2 bytes, as planned
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(transformers.DynamicCache(config=config), model)).logits
        cache = QuantizedKVCache(config, "int4-channel-prerope")
        out = model(ids, **cache_kwargs(cache, model)).logits
    assert [cache._rotary.tables_for_layer(i).rot_dim for i in range(3)] == [16, 0, 16]
    assert (out.float() - ref.float()).abs().max() < 0.1 * ref.float().abs().max()
    assert cache.memory_report()["total_bytes"] == plan(config, scheme="int4-channel-prerope", context=24)["total_bytes"]


@pytest.mark.parametrize("model_type", ["exaone", "param2moe"])
def test_pre_rope_keys_of_config_only_families_are_cached_as_planned(model_type):
    """transformers ships some families as a config alone and runs them with another family's model class (EXAONE,
    InternLM3, IQuest-Coder: ``LlamaForCausalLM``; Param2MoE, Sarvam-MoE: ``Glm4MoeForCausalLM``). The planner priced
    pre-RoPE schemes on them while both caches refused ("needs a model with RoPE keys: no transformers modeling module
    for model_type 'exaone'"): 20 of the sweep's 34 mismatches. Now the RoPE tables come from the modeling file that
    runs the family (``modeling_family``), equal to those of the model itself; a forward through the cache stays close
    to ``DynamicCache``'s and holds the bytes the planner counts."""
    import torch

    from kvbits.cache import QuantizedKVCache, cache_kwargs
    from kvbits.cache.static import StaticQuantizedKVCache
    from kvbits.plan.positions import modeling_family
    from kvbits.quant.rope import RotaryTables

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    config = _config(model_type, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    family = modeling_family(model_type)
    assert family is not None and modeling_family("llama") == "llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    pos = torch.arange(32)[None]
    mine, its = RotaryTables.from_config(config), RotaryTables.from_model(model)  # float32 frequencies, both
    assert all(torch.equal(a, b) for a, b in zip(mine.cos_sin(pos), its.cos_sin(pos)))
    model = model.to(torch.bfloat16)  # 2 bytes, as planned
    StaticQuantizedKVCache(config, "int4-channel-prerope", max_cache_len=64)
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(transformers.DynamicCache(config=config), model)).logits
        cache = QuantizedKVCache(config, "int4-channel-prerope")
        out = model(ids, **cache_kwargs(cache, model)).logits
    assert (out.float() - ref.float()).abs().max() < 0.1 * ref.float().abs().max()
    assert cache.memory_report()["total_bytes"] == plan(config, scheme="int4-channel-prerope", context=24)["total_bytes"]
