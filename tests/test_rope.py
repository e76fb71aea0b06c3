"""`kvbits.quant.rope`: the cos/sin transformers uses, rebuilt from a config, and their inverse.

Ground truth comes from real forwards of tiny random-weight models: pre-RoPE keys from a forward
hook on ``k_proj`` (or the ``k_norm`` applied before RoPE), post-RoPE keys from the cache the
attention module wrote them into.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvbits.quant.rope import RotaryTables, apply_rope, invert_rope

logging.getLogger("transformers").setLevel(logging.ERROR)

TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
}
ATOL = 1e-5


def _config(name: str, **kw):
    cls = getattr(transformers, name)
    args = dict(TINY)
    args.update(kw)
    return cls(**args)


@contextlib.contextmanager
def _capture_pre_rope(model, keys: dict[int, torch.Tensor]):
    """Record pre-RoPE keys ``(B, H_kv, T, D)`` per layer; hooks removed on exit, even on error."""
    handles = []
    try:
        for name, mod in model.named_modules():
            if not hasattr(mod, "k_proj") or not hasattr(mod, "layer_idx"):
                continue
            idx = mod.layer_idx
            n_kv = (
                mod.config.num_key_value_heads if hasattr(mod, "config") else model.config.num_key_value_heads
            )
            head_dim = (
                getattr(mod, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
            )
            src = getattr(mod, "k_norm", None) or getattr(mod, "k_layernorm", None) or mod.k_proj

            def hook(_m, _inp, out, idx=idx, n_kv=n_kv, head_dim=head_dim):
                # k_proj gives (B, T, H*D); norms see (B, T, H, D) or (B, H, T, D) depending on the
                # family: tell them apart by shape (the tests keep T != H_kv)
                if out.dim() == 3:
                    out = out.reshape(out.shape[0], out.shape[1], n_kv, head_dim)
                if out.shape[1] != n_kv:
                    out = out.transpose(1, 2)
                keys[idx] = out.detach().clone()

            handles.append(src.register_forward_hook(hook))
        yield keys
    finally:
        for h in handles:
            h.remove()


def _forward_keys(config, T: int = 12, seed: int = 0, dtype=torch.float32):
    """(model, {layer: pre-RoPE keys}, {layer: post-RoPE keys}) from one prefill of T tokens."""
    torch.manual_seed(seed)
    model = (
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).eval()
    )
    ids = torch.randint(0, config.vocab_size, (2, T))
    pre: dict[int, torch.Tensor] = {}
    with torch.no_grad(), _capture_pre_rope(model, pre):
        out = model(input_ids=ids, use_cache=True)
    cache = out.get("cache") or out.get("past_key_values")
    post = {i: layer.keys for i, layer in enumerate(cache.layers) if hasattr(layer, "keys")}  # LFM3's conv: none
    assert len(pre) == len(post)
    return model, pre, post


def _check_roundtrip(config, T: int = 12, atol: float = ATOL, **cos_kw):
    model, pre, post = _forward_keys(config, T)
    tables = RotaryTables.from_config(config)
    positions = torch.arange(T)
    for layer in range(config.num_hidden_layers):
        t = tables.tables_for_layer(layer)
        cos, sin = t.cos_sin(positions, torch.float32, **cos_kw)
        torch.testing.assert_close(apply_rope(pre[layer], cos, sin), post[layer], atol=atol, rtol=1e-5)
        torch.testing.assert_close(invert_rope(post[layer], cos, sin), pre[layer], atol=atol, rtol=1e-5)
        assert not torch.equal(pre[layer], post[layer]) or t.rot_dim == 0
    return tables, model


def test_llama_plain_matches_model_forward():
    tables, _ = _check_roundtrip(_config("LlamaConfig"))
    assert tables.rope_type == "default" and tables.rot_dim == tables.head_dim == 16
    assert tables.convention_checked and tables.halves_equal


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ],
    ids=lambda r: r["rope_type"],
)
def test_llama_rope_scaling(rope):
    cfg = _config("LlamaConfig", max_position_embeddings=64, rope_parameters={"rope_theta": 10000.0, **rope})
    tables, _ = _check_roundtrip(cfg, T=20)
    assert tables.rope_type == rope["rope_type"]
    if rope["rope_type"] == "yarn":  # attention factor != 1: cos² + sin² = s², undone by invert_rope
        cos, sin = tables.cos_sin(torch.arange(4))
        assert not torch.allclose(cos**2 + sin**2, torch.ones_like(cos))


def test_llama_dynamic_beyond_max_positions_and_stateless():
    cfg = _config(
        "LlamaConfig",
        max_position_embeddings=16,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
    )
    tables, _ = _check_roundtrip(cfg, T=24)  # 24 > 16: frequencies recomputed from seq_len 24
    short, _ = tables.cos_sin(torch.arange(24)[:8])
    grown, _ = tables.cos_sin(torch.arange(8), seq_len=24)  # same positions, model had seen 24 tokens
    assert not torch.allclose(short, grown)
    torch.testing.assert_close(grown, tables.cos_sin(torch.arange(24))[0][:, :8])
    again, _ = tables.cos_sin(torch.arange(8))  # no state carried over from the longer call
    torch.testing.assert_close(again, short, atol=0, rtol=0)
    with pytest.raises(ValueError, match="seq_len"):
        tables.cos_sin(torch.arange(8), seq_len=4)


LENGTH_DEPENDENT = {
    "dynamic": ("LlamaConfig", {"max_position_embeddings": 16,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
    "longrope": ("Phi3Config", {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                                    "original_max_position_embeddings": 16}}),
}  # fmt: skip


@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_length_dependent_tables_are_framed_by_slot(rope: str):
    """``frame`` is the longest forward on the original frequencies (16 for both); ``framed_cos_sin`` gives a
    slot the same tables whatever slice asks for it: the model's own up to the frame, a forward of the
    frame's multiple beyond it."""
    name, kw = LENGTH_DEPENDENT[rope]
    tables = RotaryTables.from_config(_config(name, head_dim=16, **kw))
    assert tables.frame == 16
    pos = torch.arange(48)[None]
    whole = tables.framed_cos_sin(pos, 0, torch.float32)
    for a, b in ((0, 5), (5, 17), (17, 48), (30, 33)):
        part = tables.framed_cos_sin(pos[:, a:b], a, torch.float32)
        assert all(torch.equal(w[:, a:b], p) for w, p in zip(whole, part)), (a, b)
    torch.testing.assert_close(whole[0][:, :16], tables.cos_sin(torch.arange(16))[0], atol=0, rtol=0)
    torch.testing.assert_close(whole[0][:, 16:32], tables.cos_sin(torch.arange(32))[0][:, 16:], atol=0, rtol=0)
    # dynamic frequencies keep changing with the length (each frame its own); longrope's long factors do not
    assert torch.equal(whole[0][:, 16:32], tables.cos_sin(torch.arange(48))[0][:, 16:32]) == (rope == "longrope")
    assert RotaryTables.from_config(_config("LlamaConfig")).frame is None  # default rope: one table for all


def test_qwen2_with_kv_bias():
    tables, model = _check_roundtrip(
        _config("Qwen2Config", rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    )
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert tables.model_type == "qwen2"


@pytest.mark.parametrize("name,factor", [("StableLmConfig", 0.25), ("PhiConfig", 0.5)])
def test_partial_rotary(name, factor):
    kw = {"partial_rotary_factor": factor}
    if name == "PhiConfig":
        kw["num_key_value_heads"] = 4
    tables, _ = _check_roundtrip(_config(name, **kw))
    assert tables.rot_dim == int(tables.head_dim * factor) < tables.head_dim
    x = torch.randn(1, 2, 5, tables.head_dim)
    y = tables.rotate(x, torch.arange(5) + 3)
    torch.testing.assert_close(y[..., tables.rot_dim :], x[..., tables.rot_dim :], atol=0, rtol=0)


def test_gemma3_local_and_global_bases():
    cfg = _config(
        "Gemma3TextConfig",
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    tables, _ = _check_roundtrip(cfg, T=16)  # pre-RoPE keys hooked after k_norm
    local, glob = tables.tables_for_layer(0), tables.tables_for_layer(1)
    assert (local.layer_type, glob.layer_type) == ("sliding_attention", "full_attention")
    assert not torch.allclose(local.cos_sin(torch.arange(16))[0], glob.cos_sin(torch.arange(16))[0])


def test_gemma4_global_layers_have_their_own_head_dim():
    """Gemma 4's global layers have their own head_dim (and "proportional" RoPE): each layer's tables
    take the planner's per-layer head_dim. Before, reading the config's head_dim raised transformers'
    AmbiguousGlobalPerLayerAttributeError, so no pre-RoPE scheme could be built for Gemma 4."""
    cfg = _config(
        "Gemma4TextConfig",
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=3,
        sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    tables, _ = _check_roundtrip(cfg, T=16)
    assert [tables.tables_for_layer(i).head_dim for i in range(3)] == [16, 16, 32]
    assert tables.tables_for_layer(2).rot_dim == 32


def test_nope_layers_are_identity():
    cfg = _config(
        "SmolLM3Config",
        num_hidden_layers=4,
        no_rope_layers=[1, 1, 1, 0],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    tables, _ = _check_roundtrip(cfg)
    assert [tables.tables_for_layer(i).rot_dim for i in range(4)] == [16, 16, 16, 0]


def test_batched_positions_and_bfloat16():
    tables = RotaryTables.from_config(_config("LlamaConfig"))
    pos = torch.stack([torch.arange(6), torch.arange(6) + 100])
    cos, sin = tables.cos_sin(pos, torch.bfloat16)
    assert cos.shape == (2, 6, 16) and cos.dtype == torch.bfloat16
    x = torch.randn(2, 3, 6, 16, dtype=torch.bfloat16)
    back = invert_rope(apply_rope(x, cos, sin), cos, sin)
    torch.testing.assert_close(back, x, atol=3e-2, rtol=2e-2)  # bf16 rounding of the rotated keys
    # different positions per sequence really differ
    assert not torch.allclose(
        apply_rope(x, cos, sin)[0], apply_rope(x[1:].expand(2, -1, -1, -1), cos, sin)[1]
    )


def test_bfloat16_model_matches_exactly():
    cfg = _config("LlamaConfig")
    model, pre, post = _forward_keys(cfg, T=10, dtype=torch.bfloat16)  # model.to(bf16) rounds inv_freq too
    cos, sin = RotaryTables.from_model(model).cos_sin(torch.arange(10), torch.bfloat16)
    torch.testing.assert_close(apply_rope(pre[0], cos, sin), post[0], atol=0, rtol=0)


def test_from_model_equals_from_config_and_leaves_no_hooks():
    cfg = _config(
        "LlamaConfig",
        max_position_embeddings=8,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # grows the model's dynamic frequencies; from_model must not inherit that
        model(input_ids=torch.zeros(1, 20, dtype=torch.long))
    t1, t2 = RotaryTables.from_model(model), RotaryTables.from_config(cfg)
    pos = torch.arange(12)  # 8 < 12 < 20: a grown module would keep its 20-token frequencies
    torch.testing.assert_close(t1.cos_sin(pos)[0], t2.cos_sin(pos)[0], atol=0, rtol=0)
    with torch.no_grad(), _capture_pre_rope(model, {}):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())


def test_errors():
    tables = RotaryTables.from_config(_config("LlamaConfig"))
    with pytest.raises(TypeError):
        tables.cos_sin(torch.arange(4.0))
    with pytest.raises(ValueError, match="layer_idx"):
        tables.tables_for_layer(2)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.randn(1, 1, 4, 16), *tables.cos_sin(torch.arange(5)))
    with pytest.raises(ValueError, match="D=16"):
        tables.rotate(torch.randn(1, 1, 4, 8), torch.arange(4))
    with pytest.raises(ValueError, match="RoPE|Rotary"):
        RotaryTables.from_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(NotImplementedError, match="rotate-half"):
        RotaryTables.from_config(_config("CohereConfig"))  # interleaved pairs


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_interleaved_sinusoid_families_are_refused(model_type):
    """GPT-J / CodeGen rotary modules have no rope_type and return (sin, cos) for interleaved pairs:
    they raised AttributeError from deep inside; the documented NotImplementedError now."""
    cfg = transformers.AutoConfig.for_model(model_type, n_layer=2, n_embd=256, n_head=4, rotary_dim=32)
    with pytest.raises(NotImplementedError, match=rf"model_type '{model_type}'.*rotate-half convention only"):
        RotaryTables.from_config(cfg)


@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_pre_rope_keys_past_the_original_context_come_back_as_stored(rope: str):
    """A length-dependent rope past its original context (16): pre-RoPE keys were un-rotated at a flush with the
    tables of the flushed block's length and rotated back on each read with those of the slice read (the whole
    history), so the two no longer cancelled: 11-113 % key error on every history read (5e-3 with
    ``workspace=True``, which decodes each block once). Both now give INT8's error at every position."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.compat import cache_kwargs
    from kvbits.schemes import KVScheme, TensorSpec

    name, kw = LENGTH_DEPENDENT[rope]
    cfg = _config(name, head_dim=16, attn_implementation="sdpa", pad_token_id=0, bos_token_id=0, eos_token_id=0, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, 128, (1, 40))
    spec = TensorSpec(kind="int", bits=8, fmt=None, granularity="token")
    scheme = KVScheme("int8-prerope-keys", key=dataclasses.replace(spec, pre_rope=True), value=spec)
    caches = [DynamicCache(config=cfg)] + [QuantizedKVCache(cfg, scheme, fused_decode=False, workspace=w) for w in (False, True)]
    with torch.no_grad():
        for c in caches:
            model(ids[:, :8], use_cache=True, **cache_kwargs(c, model))  # prefill within the original context
            for t in range(8, 40):  # decode past it
                model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(c, model))
    want = caches[0].layers[1].keys
    for c in caches[1:]:
        got = c.materialize(1)[0]
        err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).amax()
        assert float(err) < 0.02, (c.layers[1]._k.work is not None, float(err))


def _gpt_oss_config(**kw):
    return transformers.GptOssConfig(**{**TINY, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                        "sliding_window": 64, **kw})  # fmt: skip


def test_gpt_oss_half_width_tables_are_rotate_half():
    """gpt-oss's rotary module returns the D/2 frequencies once and its ``apply_rotary_pos_emb`` rotates the
    halves by them: rotate-half with ``cat(cos, cos)``. It was read as partial rotary over D/2 channels, then
    refused as "interleaved pairs", so no pre-RoPE scheme could run on gpt-oss."""
    tables, _ = _check_roundtrip(_gpt_oss_config())
    assert tables.half_tables and tables.convention_checked
    assert tables.rot_dim == tables.head_dim == 16 and tables.halves_equal


def test_gpt_oss_pre_rope_keys_come_back_as_the_model_wrote_them():
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.compat import cache_kwargs
    from kvbits.schemes import KVScheme, TensorSpec

    cfg = _gpt_oss_config(attn_implementation="eager", pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, 128, (1, 24))
    spec = TensorSpec(kind="int", bits=8, fmt=None, granularity="token")
    scheme = KVScheme("int8-prerope-keys", key=dataclasses.replace(spec, pre_rope=True), value=spec)
    caches = [DynamicCache(config=cfg), QuantizedKVCache(cfg, scheme, fused_decode=False)]
    with torch.no_grad():
        for c in caches:
            model(ids[:, :8], use_cache=True, **cache_kwargs(c, model))
            for t in range(8, 24):
                model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(c, model))
    for layer in range(cfg.num_hidden_layers):
        want = caches[0].layers[layer].keys
        got = caches[1].materialize(layer)[0]
        err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).amax()
        assert 0 < float(err) < 0.02, (layer, float(err))


def _falcon_alibi(alibi: bool):
    return transformers.FalconConfig(vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     multi_query=True, alibi=alibi, max_position_embeddings=512)  # fmt: skip


def _granite_hybrid(kind: str | None):
    return transformers.GraniteMoeHybridConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["attention"], num_local_experts=0, shared_intermediate_size=64,
        mamba_d_head=32, mamba_n_heads=4, mamba_expand=2, position_embedding_type=kind,
    )  # fmt: skip


@pytest.mark.parametrize(
    "config,model_cls,why",
    [
        (lambda: _falcon_alibi(True), "FalconForCausalLM", "alibi=True"),
        (lambda: _granite_hybrid(None), "GraniteMoeHybridForCausalLM", "position_embedding_type=None"),
    ],
    ids=["falcon-alibi", "granite-4-h-nope"],
)
def test_models_whose_config_turns_rope_off_are_refused(config, model_cls, why):
    """Falcon with ``alibi=True`` and GraniteMoeHybrid without ``position_embedding_type="rope"`` (Granite 4.0-H's
    default: NoPE) never rotate their keys, but their modeling files define a rotary module: the tables were built
    anyway (rot_dim 16), so a pre-RoPE cache scheme was accepted and "un-rotated" keys that were never rotated
    (quantized in a frame that does not exist: 2-bit per-channel key error 0.400 -> 0.434 on a Falcon with an
    outlier channel), and calibrating Granite failed with "transforms its keys after RoPE ... 129.9%". Now the
    ValueError of a family without RoPE: the cache refuses pre-RoPE schemes, calibrate / analyze take the keys as
    cached."""
    from kvbits.cache import QuantizedKVCache

    cfg = config()
    with pytest.raises(ValueError, match=f"has no RoPE keys.*{why}"):
        RotaryTables.from_config(cfg)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with pytest.raises(ValueError, match=f"has no RoPE keys.*{why}"):
        RotaryTables.from_model(model)
    with pytest.raises(ValueError, match=f"needs a model with RoPE keys.*{why}"):
        QuantizedKVCache(config=cfg, scheme="int4-channel-prerope")
    QuantizedKVCache(config=cfg, scheme="int4-channel")  # post-RoPE schemes are unaffected


@pytest.mark.parametrize("config", [lambda: _falcon_alibi(False), lambda: _granite_hybrid("rope")], ids=["falcon", "granite"])
def test_the_same_families_with_rope_still_get_tables(config):
    assert RotaryTables.from_config(config()).rot_dim == 16


def test_tables_of_another_batch_and_nope_frames_are_refused_or_empty():
    """Positions for 3 sequences against keys of 2 died in torch's broadcasting (RuntimeError "The size of
    tensor a (2) must match ..."); now a ValueError naming both. And ``framed_cos_sin`` of a layer without
    RoPE (``rot_dim`` 0, SmolLM3's NoPE layers) returned the model's full tables, where ``cos_sin`` (as its
    docstring says it does) returns empty ones, which rotate nothing."""
    tables = RotaryTables.from_config(_config("LlamaConfig"))
    x = torch.randn(2, 2, 5, tables.head_dim)
    with pytest.raises(ValueError, match=r"cover 3 sequences but x has B=2"):
        tables.rotate(x, torch.arange(5).repeat(3, 1))
    with pytest.raises(ValueError, match=r"cover 3 sequences but x has B=2"):
        invert_rope(x, *tables.cos_sin(torch.arange(5).repeat(3, 1)))
    back = tables.unrotate(tables.rotate(x, torch.arange(5).repeat(2, 1)), torch.arange(5)[None])  # (B, T), (1, T)
    torch.testing.assert_close(back, x, atol=ATOL, rtol=1e-5)
    nope = dataclasses.replace(tables, rot_dim=0, halves_equal=False)
    for cos, sin in (nope.cos_sin(torch.arange(4)), nope.framed_cos_sin(torch.arange(4)[None], 0, torch.float32)):
        assert cos.shape == sin.shape == (1, 4, 0)
        assert torch.equal(apply_rope(x[:, :, :4], cos, sin), x[:, :, :4])


def _config_class(model_type: str):
    """``CONFIG_MAPPING[model_type]``, skipping where the installed transformers predates the family (5.17 has no
    beam or lfm3)."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    return transformers.CONFIG_MAPPING[model_type]


def test_nope_layer_types_of_per_type_rope_are_identity():
    """Beam gives its full-attention layers no RoPE parameters (``rope_parameters["full_attention"] is None``: NoPE,
    the model hands them no cos/sin): their tables are the identity, not 'rotary module knows [...]'."""
    cfg = _config_class("beam")(
        **TINY | {"num_hidden_layers": 3}, head_dim=16, sliding_window=64, pad_token_id=0, bos_token_id=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], eos_token_id=2,
    )  # fmt: skip
    assert cfg.rope_parameters["full_attention"] is None
    tables, _ = _check_roundtrip(cfg)
    assert [tables.tables_for_layer(i).rot_dim for i in range(3)] == [16, 0, 16]
    assert tables.tables_for_layer(1).frame is None and tables.tables_for_layer(1).fused_reason() is None


def test_per_type_rope_with_layers_of_no_attention():
    """LFM3's first layers are 'conv' (no attention, no RoPE entry): the tables start at its first rotated layer
    type instead of a KeyError 'conv', and every attention layer's match the model's forward."""
    cfg = _config_class("lfm3")(
        **TINY | {"num_hidden_layers": 3}, head_dim=16, sliding_window=64, pad_token_id=0, bos_token_id=1,
        layer_types=["conv", "full_attention", "sliding_attention"], eos_token_id=2,
    )  # fmt: skip
    _, pre, post = _forward_keys(cfg, T=12)
    tables = RotaryTables.from_config(cfg)
    assert tables.layer_type == "full_attention"
    for layer in (1, 2):
        t = tables.tables_for_layer(layer)
        cos, sin = t.cos_sin(torch.arange(12), torch.float32)
        torch.testing.assert_close(apply_rope(pre[layer], cos, sin), post[layer], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(invert_rope(post[layer], cos, sin), pre[layer], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_length_dependent_tables_of_no_positions_are_empty(rope: str):
    """No positions (an empty slice of keys) gave every other rope type empty tables but crashed ``dynamic`` /
    ``longrope`` inside transformers' frequency update (RuntimeError "max(): Expected reduction dim ...", from
    ``torch.max`` of no position ids), in ``cos_sin``, ``unrotate`` and ``framed_cos_sin``'s own ``n == 0`` branch."""
    name, kw = LENGTH_DEPENDENT[rope]
    tables = RotaryTables.from_config(_config(name, head_dim=16, **kw))
    none = torch.zeros((2, 0), dtype=torch.long)
    for cos, sin in (tables.cos_sin(none, torch.bfloat16), tables.framed_cos_sin(none, 40, torch.bfloat16)):
        assert cos.shape == sin.shape == (2, 0, 16) and cos.dtype == torch.bfloat16
    x = torch.randn(2, 2, 0, 16)
    assert tables.unrotate(x, none).shape == tables.rotate(x, none[0]).shape == x.shape
    # and a non-empty call after it still gets the model's tables
    torch.testing.assert_close(tables.cos_sin(torch.arange(4))[0], tables.cos_sin(torch.arange(4), seq_len=4)[0])


def test_non_integer_positions_and_non_float_dtypes_are_refused():
    """Boolean positions were read as 0 / 1 and complex ones died in ``min()`` (NotImplementedError "min_all");
    an integer ``dtype`` gave tables rounded to 0 / +-1 and ``rotate`` / ``apply_rope`` of integer keys (or with
    integer tables) returned those silently: ``rotate`` of int64 keys of 100 gave 100 at position 0 and all zeros at
    positions 1 and 2 (float keys: -30 ... 138). All are now a TypeError saying what was expected."""
    tables = RotaryTables.from_config(_config("LlamaConfig"))
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.complex64), torch.arange(3.0)):
        with pytest.raises(TypeError, match="positions must be an integer"):
            tables.cos_sin(bad)
    for ok in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(tables.cos_sin(torch.arange(3, dtype=ok))[0], tables.cos_sin(torch.arange(3))[0])
    for dtype in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match="dtype must be a floating-point"):
            tables.cos_sin(torch.arange(3), dtype)
    keys = torch.ones(1, 1, 3, 16, dtype=torch.long)
    for fn in (tables.rotate, tables.unrotate):
        with pytest.raises(TypeError, match="x must be floating point"):
            fn(keys, torch.arange(3))
    cos, sin = tables.cos_sin(torch.arange(3))
    for fn in (apply_rope, invert_rope):
        with pytest.raises(TypeError, match="must be floating point"):
            fn(keys, cos, sin)
        with pytest.raises(TypeError, match="must be floating point"):
            fn(keys.float(), cos.long(), sin.long())


_MLA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 64, "vocab_size": 128, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1}  # fmt: skip


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mistral4", "youtu", "glm4_moe_lite"])
def test_rope_interleave_configs_are_refused(model_type):
    """``rope_interleave=True`` (the default of DeepSeek-V3, Mistral 4, Youtu, GLM-4-MoE-Lite) rotates interleaved
    pairs by ``apply_rotary_pos_emb_interleave`` while the family's ``apply_rotary_pos_emb`` is rotate-half: the tables
    were built and ``convention_checked`` True, yet re-rotating a tiny DeepSeek-V3's un-rotated ``k_rot`` missed the
    ``k_rot`` it cached by 0.44 (its largest entry: 0.37). They are refused now, by the flag, as the planner's
    ``pre_rope_problem`` does."""
    from kvbits.plan.positions import pre_rope_problem

    cfg = transformers.AutoConfig.for_model(model_type, **_MLA)
    assert cfg.rope_interleave is True
    with pytest.raises(NotImplementedError, match=rf"model_type '{model_type}'.*rope_interleave=True"):
        RotaryTables.from_config(cfg)
    assert "rope_interleave=True" in pre_rope_problem(cfg)


def test_latent_attention_models_are_refused_before_a_forward():
    """Multi-head latent attention caches a compressed latent and rotates only the last ``qk_rope_head_dim`` key
    channels: ``RotaryTables.from_model`` of a DeepSeek-V3 (even with ``rope_interleave=False``) built tables, and a
    lazy ``QuantizedKVCache(rotary=...)`` ran the forward un-rotating the first 8 channels of the latent as keys.
    Refused now when the tables are built, before any forward."""
    from transformers import AutoModelForCausalLM

    cfg = transformers.AutoConfig.for_model("deepseek_v3", rope_interleave=False, **_MLA)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for build in (lambda: RotaryTables.from_config(cfg), lambda: RotaryTables.from_model(model)):
        with pytest.raises(NotImplementedError, match="multi-head latent attention.*kv_lora_rank=16"):
            build()


_MLA_FAMILIES = ["deepseek_v2", "deepseek_v32", "axk2", "bailing_hybrid", "dots3_note", "longcat_flash", "minicpm3"]


@pytest.mark.parametrize("model_type", _MLA_FAMILIES)
def test_pre_rope_problem_names_latent_attention(model_type):
    """Multi-head latent attention families without ``rope_interleave`` (DeepSeek-V2, DeepSeek-V3.2, AXK2, ...):
    ``pre_rope_problem`` returned None, so ``check_pre_rope_config`` (eval, speed, needle, calibrate) accepted
    ``kvquant-4`` while ``RotaryTables`` and the caches refuse the model. Now it names the latent attention with the
    shared wording, and the refusal does not advise a post-RoPE scheme (the caches refuse those too)."""
    from transformers import CONFIG_MAPPING

    from kvbits.plan.config import text_config
    from kvbits.plan.planner import check_pre_rope_config
    from kvbits.plan.positions import pre_rope_problem
    from kvbits.schemes import get_scheme

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    cfg = text_config(CONFIG_MAPPING[model_type]())  # class defaults (Dots3 Note: its text config)
    with pytest.raises(NotImplementedError, match=r"multi-head latent attention \(kv_lora_rank=\d+ in layer 0"):
        RotaryTables.from_config(cfg)
    problem = pre_rope_problem(cfg)
    assert problem is not None and problem.startswith("uses multi-head latent attention (kv_lora_rank=")
    assert "MHA/GQA/MQA attention only" in problem
    with pytest.raises(ValueError, match=r"'kvquant-4' quantizes keys before RoPE.*latent attention.*post-RoPE keys$"):
        check_pre_rope_config(get_scheme("kvquant-4"), cfg)
    check_pre_rope_config(get_scheme("int4-channel"), cfg)  # post-RoPE keys: not this check's to refuse


_SWA = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_IDX = ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"]


@pytest.mark.parametrize(
    ("model_type", "kw", "rot_dims"),
    [
        ("exaone4", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}, [16] * 4),
        ("exaone_moe", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("kolibri1", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("kolibri1_1", {"layer_types": _IDX, "index_num_heads": 2, "kv_source_layers": [0, 1, 2, 3]}, [16, 0, 16, 0]),
        ("afmoe", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("flint", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("lara_mini", {"layer_types": _SWA}, [16, 0, 16, 0]),
        ("granite_swa", {"layer_types": _SWA, "layer_rope_theta": [10000.0, 0, 10000.0, 0]}, [16, 0, 16, 0]),
    ],
)
def test_layers_a_family_rule_leaves_unrotated_are_identity(model_type: str, kw: dict, rot_dims: list[int]):
    """EXAONE 4 rotates only its sliding layers when ``sliding_window`` is set (a rule in its attention forward, not a
    config list), AFMoE / Flint / Lara-mini / Kolibri only their sliding layers, Granite SWA none whose
    ``layer_rope_theta`` is 0: their other layers cache pre-RoPE keys, which the tables rotated by 16 channels
    (pre-RoPE keys quantized in a frame the model never used). Checked against the model's own cached keys."""
    cfg = _config_class(model_type)(
        **TINY | {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 64} | kw, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    tables, _ = _check_roundtrip(cfg)
    assert [tables.tables_for_layer(i).rot_dim for i in range(4)] == rot_dims


@pytest.mark.parametrize("model_type", ["granite_swa", "granitemoe_swa"])
def test_per_layer_rope_theta_gets_its_own_base(model_type: str):
    """Granite SWA builds one rotary module per non-zero ``layer_rope_theta`` and rotates layer ``i`` by base
    ``layer_rope_theta[i]``: tables built from the global ``rope_theta`` alone were off by up to 0.68 on layers with
    another base (keys re-rotated in the wrong frame). Checked against the model's cached keys, from the config and
    from the loaded model (whose first rotary module, at the global base, is one the model never uses)."""
    cfg = _config_class(model_type)(
        **TINY | {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 64, "layer_types": _SWA},
        layer_rope_theta=[500000.0, 0, 1000.0, 500000.0], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    tables, model = _check_roundtrip(cfg)
    assert [tables.tables_for_layer(i).rot_dim for i in range(4)] == [16, 0, 16, 16]
    assert tables.tables_for_layer(0).rotary is tables.tables_for_layer(3).rotary  # one module per base
    _, pre, post = _forward_keys(cfg)
    from_model = RotaryTables.from_model(model)
    for layer in (0, 2, 3):
        cos, sin = from_model.tables_for_layer(layer).cos_sin(torch.arange(12))
        torch.testing.assert_close(apply_rope(pre[layer], cos, sin), post[layer], atol=ATOL, rtol=1e-5)


def test_olmo_hybrid_without_rope_theta_is_refused_as_no_rope():
    """OLMo-Hybrid's released checkpoints set ``rope_theta=None``: the model builds no rotary module (no key is
    rotated), but the planner passed pre-RoPE schemes and ``RotaryTables`` crashed inside transformers' rotary
    module with "unsupported operand type(s) for ** or pow(): 'NoneType' and 'Tensor'". Now the ValueError of a
    model without RoPE, from the config and the loaded model, and the planner's and cache's refusal of pre-RoPE
    schemes; post-RoPE schemes are unaffected."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.plan import plan
    from kvbits.plan.positions import pre_rope_problem

    cfg = _config_class("olmo_hybrid")(**TINY | {"num_hidden_layers": 4}, rope_theta=None, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2)  # fmt: skip
    why = r"rope_parameters\['rope_theta'\] is None"
    assert "rope_theta'] is None" in pre_rope_problem(cfg)
    with pytest.raises(ValueError, match=rf"has no RoPE keys.*{why}"):
        RotaryTables.from_config(cfg)
    with pytest.raises(ValueError, match=rf"has no RoPE keys.*{why}"):
        RotaryTables.from_model(transformers.AutoModelForCausalLM.from_config(cfg))
    with pytest.raises(ValueError, match=rf"needs a model with RoPE keys.*{why}"):
        QuantizedKVCache(config=cfg, scheme="int4-channel-prerope")
    with pytest.raises(ValueError, match=rf"quantizes keys before RoPE.*{why}"):
        plan(cfg, scheme="int4-channel-prerope", context=100)
    QuantizedKVCache(config=cfg, scheme="int4-channel")
    rotating = _config_class("olmo_hybrid")(**TINY | {"num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2)  # fmt: skip
    assert pre_rope_problem(rotating) is None and RotaryTables.from_config(rotating).rot_dim > 0


@pytest.mark.parametrize("family", ["muse_spark", "muse_glimmer"])
def test_muse_layer_rope_theta_tables_reproduce_every_layers_cached_keys(family):
    """Muse Spark / Glimmer carry ``layer_rope_theta`` (0: NoPE) but rotate every other layer by their one global
    rotary module, whatever its non-zero entry (``kvbits.plan.positions.PER_LAYER_THETA`` leaves them out).
    AutoModelForCausalLM does not load their text config; ``<Family>TextModel`` does. Their keys go through a
    scale-less ``qk_norm`` shared with the queries before RoPE (the hook keeps its call with the K/V head count).
    Checked by a review session: the tables reproduced every layer's cached keys exactly; pinned here."""

    mod = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")  # transformers 5.17 lacks muse_spark
    prefix = "MuseSpark" if family == "muse_spark" else "MuseGlimmer"
    config_cls = getattr(transformers, f"{prefix}TextConfig")
    extra = {"mlp_layer_types": ["dense"] * 5} if family == "muse_spark" else {}  # 256 experts by default
    cfg = config_cls(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=64, bos_token_id=None, eos_token_id=None,
        layer_rope_theta=[10000.0, 0, 500.0, 10000.0, 0], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(mod, f"{prefix}TextModel")(cfg).eval()
    pre: dict[int, torch.Tensor] = {}
    handles = []
    for attn in (m for m in model.modules() if hasattr(m, "qk_norm") and hasattr(m, "layer_idx")):

        def hook(_m, _inp, out, idx=attn.layer_idx):
            if out.shape[1] == cfg.num_key_value_heads:  # (B, H, T, D): the keys' call, not the queries' (4 heads)
                pre[idx] = out.detach().clone()

        handles.append(attn.qk_norm.register_forward_hook(hook))
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (2, 12)), use_cache=True)
    for h in handles:
        h.remove()
    cache = out.get("cache") or out.get("past_key_values")
    for tables in (RotaryTables.from_config(cfg), RotaryTables.from_model(model)):
        for layer in range(5):
            t = tables.tables_for_layer(layer)
            assert t.rot_dim == (0 if layer in (1, 4) else 16)
            cos, sin = t.cos_sin(torch.arange(12), torch.float32)
            torch.testing.assert_close(apply_rope(pre[layer], cos, sin), cache.layers[layer].keys, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "gemma3n_text", "gemma4_text"])
def test_one_tensor_apply_rotary_pos_emb_is_probed(model_type):
    """Families whose ``apply_rotary_pos_emb`` takes one tensor (``x, cos, sin``) were never probed: DeepSeek-V4's
    (interleaved pairs on the trailing 64 of 512 channels) got rotate-half tables on the first 32 channels,
    ``convention_checked=False``, and its rotation differed from the model's by up to 3.6 on 96 channels. Now its
    probe refuses it (and the planner by name); the rotate-half Gemma 3n / 4 pass the probe."""
    from kvbits.plan.positions import NOT_ROTATE_HALF
    from kvbits.quant import rope

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    text = transformers.CONFIG_MAPPING[model_type]()
    module = rope._modeling_module(model_type)
    rotary = rope._instantiate(rope._rotary_class(module, model_type), text, None)
    if model_type == "deepseek_v4":
        assert model_type in NOT_ROTATE_HALF
        with pytest.raises(NotImplementedError, match="layout other than rotate-half"):
            RotaryTables._build(text, rotary, module)
    else:
        assert RotaryTables._build(text, rotary, module).convention_checked


@torch.no_grad()
@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_length_dependent_frame_modules_are_kept_not_copied_per_read(rope: str, monkeypatch):
    """A pre-RoPE-keys cache reads ``framed_cos_sin`` on every decode step, and each read deep-copied the rotary
    module once per frame of the cache (2 layers, 1024 tokens, frame 256: 24 deepcopies and 13-15 ms of a 14 ms
    step on CPU). Each frame's module is now kept after its first forward: over 200 decode steps crossing the frame
    (16 = ``original_max_position_embeddings``) a dozen times, a module is copied only when a read first reaches a
    new frame, and the K/V served and the key codes stored equal, bit for bit, those of a fresh copy per forward."""
    import copy

    import kvbits.quant.rope as rope_mod
    from kvbits.cache import QuantizedKVCache
    from kvbits.schemes import KVScheme, TensorSpec

    name, kw = LENGTH_DEPENDENT[rope]
    cfg = _config(name, head_dim=16, **kw)
    scheme = KVScheme(
        "test-prerope-frames",
        key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=8, pre_rope=True),
        value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"),
        sinks=1, residual=4, block=8,
    )  # fmt: skip
    copies = [0]
    deepcopy = copy.deepcopy

    def counting(obj, *args, **kwargs):
        copies[0] += type(obj).__name__.endswith("RotaryEmbedding")
        return deepcopy(obj, *args, **kwargs)

    def decode() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        cache = QuantizedKVCache(config=cfg, scheme=scheme)
        gen = torch.Generator().manual_seed(0)
        served, per_step = [], []
        for step in range(201):
            n = 8 if step == 0 else 1
            k, v = torch.randn(2, 2, n, 16, generator=gen) * 3, torch.randn(2, 2, n, 16, generator=gen)
            before = copies[0]
            served += [t.clone() for t in cache.update(k, v, 0)]
            per_step.append(copies[0] - before)
        return served, [c.data.clone() for c in cache.layers[0]._k.chunks], per_step

    monkeypatch.setattr(copy, "deepcopy", counting)
    served, codes, per_step = decode()
    assert sum(per_step[40:]) <= (208 - 40) // 16 + 1  # at most one per new frame (base: one per frame per step)
    monkeypatch.setattr(rope_mod, "_undecorated_forward", lambda cls: None, raising=False)  # a fresh copy each time
    served_ref, codes_ref, per_step_ref = decode()
    assert sum(per_step_ref[40:]) > 10 * sum(per_step[40:])
    assert len(served) == len(served_ref) and all(torch.equal(a, b) for a, b in zip(served, served_ref))
    assert len(codes) == len(codes_ref) >= 1 and all(torch.equal(a, b) for a, b in zip(codes, codes_ref))


# (model_type, error, what the message says) of configs from_config crashed on deep inside transformers (the
# defaults of each class, as AutoConfig.for_model builds them): vision / audio / VQ sub-configs and other configs the
# family's text rotary module reads fields they do not have, a per-layer-type config without RoPE parameters for its
# layer type, vision rotary modules whose forward takes no position ids, multimodal RoPE that does not fit the config
_NOT_TEXT = "not the text config of a decoder"
_UNBUILDABLE = [
    ("qwen2_vl_vision", ValueError, _NOT_TEXT),  # AttributeError: no 'max_position_embeddings'
    ("gemma3n_audio", ValueError, _NOT_TEXT),
    ("chameleon_vqgan", ValueError, _NOT_TEXT),
    ("llama4_vision_model", ValueError, _NOT_TEXT),
    ("gemma4_vision", ValueError, _NOT_TEXT),  # AttributeError: no 'layer_types'
    ("sam3_vision_model", ValueError, _NOT_TEXT),  # AttributeError: no 'rope_parameters'
    ("moshi_depth", ValueError, _NOT_TEXT),
    ("blt", ValueError, _NOT_TEXT),  # AttributeError: no 'hidden_size'
    ("muse_spark_vision", ValueError, _NOT_TEXT),  # KeyError: 'axial'
    ("cohere_compass", ValueError, r"layer_types name 'full_attention'.*unknown layer type"),  # KeyError
    ("efficientloftr", NotImplementedError, r"forward does not take \(x, position_ids\)"),  # TypeError
    ("eomt_dinov3", NotImplementedError, r"forward does not take \(x, position_ids\)"),
    ("glm4v", NotImplementedError, r"multimodal RoPE \(mrope_section \[8, 12, 12\]\)"),  # RuntimeError: split sizes
    ("hunyuan_vl", NotImplementedError, r"multimodal RoPE \(mrope_section None\)"),  # TypeError: len(None)
]


@pytest.mark.parametrize("model_type,error,why", _UNBUILDABLE, ids=[m for m, _, _ in _UNBUILDABLE])
def test_configs_the_rotary_module_can_not_use_are_refused_by_name(model_type, error, why):
    """A sweep of ``from_config`` over every config class of transformers 5.25 found 80 crashing deep inside the
    family's rotary module (AttributeError ``'Qwen2VLVisionConfig' object has no attribute 'max_position_embeddings'``,
    ``KeyError: 'full_attention'`` for Cohere Compass, ``RuntimeError: split_with_sizes`` for GLM-4V, a ``TypeError``
    from a vision module's ``forward``). Each is now the module's ValueError (the module can not be built from the
    config) or NotImplementedError (it can not run on text positions), naming the model type, the module, what it
    raised and why."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    cfg = transformers.AutoConfig.for_model(model_type)
    with pytest.raises(error, match=rf"model_type '{model_type}[\w]*': its rotary module \w+ .*{why}"):
        RotaryTables.from_config(cfg)


@pytest.mark.parametrize("model_type", ["granite_swa", "granitemoe_swa"])
def test_per_layer_rope_theta_tables_of_a_bf16_cast_model_are_its_own(model_type: str):
    """Was: ``RotaryTables.from_model`` of a Granite SWA model cast with ``.to(torch.bfloat16)`` rebuilt the per-base
    rotary modules from the config in float32, while the model's own ``rotary_embs`` had their ``inv_freq`` rounded
    to bfloat16 by the cast: its pre-RoPE keys re-rotated by the tables were off by up to 15 % of the largest key at
    512 tokens (pre-RoPE keys quantized in a frame the model never used). Now the tables take the model's own
    modules: its cached keys bit for bit."""
    cfg = _config_class(model_type)(
        **TINY | {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 1024, "layer_types": _SWA},
        layer_rope_theta=[500000.0, 0, 1000.0, 500000.0], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model, pre, post = _forward_keys(cfg, T=512, dtype=torch.bfloat16)
    tables = RotaryTables.from_model(model)
    assert tables.tables_for_layer(0).rotary is tables.tables_for_layer(3).rotary  # one module per base
    for layer in (0, 2, 3):
        cos, sin = tables.tables_for_layer(layer).cos_sin(torch.arange(512), torch.bfloat16)
        assert torch.equal(apply_rope(pre[layer], cos, sin), post[layer])
