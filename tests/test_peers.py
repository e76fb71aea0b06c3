"""Peer caches (transformers' ``QuantizedCache``, ``kvbits.evaluate.stream.PeerScheme``): their bits and bytes are
read from the tensors the cache holds, a backend that is not installed names its own package, and a model the peer
refuses is said before any forward pass."""

from __future__ import annotations

import pytest
import torch
import transformers
from _tinyllama import tiny_llama

from kvbits.evaluate.stream import PEER_SCHEMES, PeerScheme, cache_bytes, check_schemes_fit

pytestmark = pytest.mark.usefixtures("one_thread")


def _quanto_parts(q) -> int:
    """Bytes of a quanto ``WeightQBitsTensor`` spelled out: packed codes, scales, zero-points."""
    return sum(t.numel() * t.element_size() for t in (q._data._data, q._scale, q._shift))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["hf-quanto-int4", "hf-quanto-int2"])
def test_peer_bits_are_what_its_quanto_tensors_hold(name, dtype):
    """quanto stores a scale and a zero-point per group in the K/V's dtype: on a float32 model int4 is 5.0 bits per
    element (2.5 was reported for int2 at 3.0 held, 4.5 for int4 at 5.0)."""
    pytest.importorskip("optimum.quanto")
    peer = PEER_SCHEMES[name]
    cache = peer.make_cache(tiny_llama().config)
    k = torch.randn(1, 2, 256, 64, dtype=dtype)  # 256 x 64 channels: whole groups, whole packed bytes
    cache.update(k, k.clone(), 0)
    q = cache.layers[0]._quantized_keys
    held = _quanto_parts(q) * 8 / k.numel()
    assert held == peer.bits(k.element_size()) == {"hf-quanto-int4": 4, "hf-quanto-int2": 2}[name] + (
        1.0 if dtype == torch.float32 else 0.5
    )
    assert peer.avg_bits == peer.bits(2)  # the float16 / bfloat16 figure


def test_peer_avg_bits_follow_the_models_dtype():
    from kvbits.evaluate import measures

    peer = PEER_SCHEMES["hf-quanto-int4"]
    lm = tiny_llama()
    shape = measures.plan_shape_of(lm.config, lm)  # float32: read from the model, not the config
    assert measures.long_run_avg_bits(peer, shape, 16, 2, 2) == 5.0
    lm.to(torch.bfloat16)
    assert measures.long_run_avg_bits(peer, measures.plan_shape_of(lm.config, lm), 16, 2, 2) == 4.5


def test_cache_bytes_of_a_peer_are_its_codes_scales_and_residual():
    """``cache_bytes`` of transformers' ``QuantizedCache`` counted nothing (None); it is now every tensor the cache
    holds: quanto's codes, scales and zero-points and the full-precision residual."""
    pytest.importorskip("optimum.quanto")
    lm = tiny_llama()
    cache = PEER_SCHEMES["hf-quanto-int4"].make_cache(lm.config)
    k = torch.randn(1, 2, 256, 16)  # prefill: all quantized; then 10 decode steps in the residual
    for i in range(2):
        cache.update(k, k.clone(), i)
        for _ in range(10):
            cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), i)
    quantized = sum(_quanto_parts(q) for layer in cache.layers for q in (layer._quantized_keys, layer._quantized_values))
    residual = 2 * 2 * (2 * 10 * 16 * 4)  # layers x (K, V) x float32 residual of 10 tokens
    assert quantized == 2 * 2 * (256 * 2 * 16 // 2 + 2 * (256 * 2 * 16 // 64) * 4)  # 4-bit codes + f32 scale, shift
    assert cache_bytes(cache) == quantized + residual


def test_tensor_bytes_counts_each_tensor_once():
    from kvbits.evaluate.stream import tensor_bytes

    t = torch.zeros(10, dtype=torch.float16)
    assert tensor_bytes((t, [t, {"a": torch.zeros(3)}], "x", None)) == 20 + 12


def test_missing_backend_names_its_own_package(monkeypatch):
    """An HQQ peer without hqq said ``pip install optimum-quanto``."""
    import importlib

    real = importlib.import_module

    def no_hqq(name, *a, **k):
        if name == "hqq":
            raise ImportError("No module named 'hqq'")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_hqq)
    with pytest.raises(RuntimeError, match=r"'hf-hqq-int4' needs hqq, which is not installed: pip install hqq") as e:
        PeerScheme("hf-hqq-int4", "hqq", 4).make_cache(tiny_llama().config)
    assert "quanto" not in str(e.value)
    with pytest.raises(ValueError, match="backend must be one of"):
        PeerScheme("hf-x", "awq", 4)


def test_peer_refused_by_the_model_before_any_forward():
    """transformers' ``QuantizedCache`` refuses sliding layers: said up front naming the peer, not after the
    reference's and the other schemes' forward passes of the first window."""
    pytest.importorskip("optimum.quanto")
    from kvbits.evaluate import evaluate

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=16, max_window_layers=1)  # fmt: skip
    lm = transformers.Qwen2ForCausalLM(cfg).eval()
    assert "sliding_attention" in lm.config.layer_types
    calls = []
    lm.model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"'hf-quanto-int4': transformers' QuantizedCache refuses it here.*sliding"):
        check_schemes_fit([PEER_SCHEMES["hf-quanto-int4"]], lm.config)
    with pytest.raises(ValueError, match=r"'hf-quanto-int4'.*sliding"):
        evaluate(lm, torch.randint(0, 64, (80,)), 40, ["int8-token", "hf-quanto-int4"], mode="stream")
    assert calls == []


def test_quanto_peer_refuses_a_layer_it_can_not_group():
    """One KV head of 80 channels: quanto's groups of 64 fail on 3 tokens ("Group size (64) must be a divisor of
    (240)") deep inside the first window's peer run; refused up front, naming the layer's width."""
    pytest.importorskip("optimum.quanto")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=160, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=80)  # fmt: skip
    with pytest.raises(ValueError, match=r"'hf-quanto-int4'.*layer 0 \(and 1 more\) has H_kv x D = 80.*multiple of 4"):
        check_schemes_fit([PEER_SCHEMES["hf-quanto-int4"]], cfg)
    cfg.num_key_value_heads = cfg.num_attention_heads = 4  # 4 x 80 = 5 groups of 64 per token
    cfg.hidden_size = 320
    check_schemes_fit([PEER_SCHEMES["hf-quanto-int4"]], cfg)


def test_quanto_groups_each_sequence_so_the_width_check_ignores_the_batch():
    """quanto groups each batch row of a layer's K/V apart (transformers quantizes along axis 0): 4 sequences of one
    80-channel KV head x 3 tokens hold 960 elements, 15 whole groups of 64, and still fail as one sequence does. The
    up-front check is therefore per sequence, and its message says the batch does not help."""
    pytest.importorskip("optimum.quanto")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=160, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=80)  # fmt: skip
    peer = PEER_SCHEMES["hf-quanto-int4"]
    for batch in (1, 4):
        k = torch.randn(batch, 1, 3, 80)
        with pytest.raises(ValueError, match=r"Group size \(64\) must be a divisor of \(240\)"):
            peer.make_cache(cfg).update(k, k.clone(), 0)
    k = torch.randn(4, 1, 4, 80)  # 320 per sequence: 5 whole groups each
    peer.make_cache(cfg).update(k, k.clone(), 0)
    with pytest.raises(ValueError, match=r"each sequence \(the batch size does not help\)"):
        check_schemes_fit([peer], cfg)
