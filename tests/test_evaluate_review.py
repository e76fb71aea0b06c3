"""Evaluation core, second review: inputs refused with a clear error instead of a crash deep inside
or a setting silently ignored (``kvbits.evaluate.runner``, ``metrics``)."""

from __future__ import annotations

import pytest
import torch

from kvbits.evaluate.metrics import LogitHead
from kvbits.evaluate.runner import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(0))


def test_a_model_without_an_output_embedding_is_refused():
    """A bare decoder (``LlamaModel``) computes no logits: ``evaluate`` failed on it with "'BaseModelOutputWithPast'
    object has no attribute 'logits'" from inside its logits check; now a ValueError names what it needs."""
    decoder = _llama().model
    assert decoder.get_output_embeddings() is None
    with pytest.raises(ValueError, match=r"LlamaModel has no output embedding.*\*ForCausalLM"):
        LogitHead.from_model(decoder)
    with pytest.raises(ValueError, match=r"LlamaModel has no output embedding"):
        evaluate(decoder, _ids(64), 32, ["int4-token"])


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_a_bad_chunk_size_is_refused_before_anything_loads(bad):
    """``simulate()`` refused ``chunk_size=0`` only once the model had loaded and the first window's reference
    pass had run (and ``mode='stream'`` took any value); the model named here does not exist."""
    with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1, got"):
        evaluate("no-such-model-anywhere", _ids(64), 32, ["int8-token"], chunk_size=bad)


def test_chunk_size_in_stream_mode_is_refused_not_ignored():
    """``chunk_size`` sets the simulator's query chunks; ``mode='stream'`` never runs the simulator, so
    ``--chunk-size 64 --mode stream`` ran with the setting silently ignored (as ``fused_decode`` is refused in
    simulate mode)."""
    with pytest.raises(ValueError, match=r"chunk_size=64 needs mode='simulate'"):
        evaluate("no-such-model-anywhere", _ids(64), 32, ["int8-token"], mode="stream", chunk_size=64)
    # the default, and any value in simulate mode, still run
    model = _llama()
    for mode, chunk in (("stream", 256), ("simulate", 7)):
        summary = evaluate(model, _ids(64), 32, ["int4-token"], mode=mode, chunk_size=chunk, attn_layers=[])
        assert summary["results"][0]["kl"] > 0


def _lfm2():
    """A hybrid model (LFM2): convolution layers 0 and 2, attention layers 1 and 3."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    torch.manual_seed(0)
    cfg = Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, layer_types=["conv", "full_attention"] * 2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_attention_error_and_entropy_only_for_layers_with_attention():
    """The default attn_layers (first, middle, last layer) of a hybrid model picked LFM2's convolution layers 0
    and 2, which have no attention: the summary reported their attention error and entropy as 0.0 (as if the
    scheme changed nothing there). Now the default is spread over the layers with attention, and a layer without
    is refused by name."""
    model = _lfm2()
    summary = evaluate(model, _ids(64), 64, ["int4-token"])
    result = summary["results"][0]
    assert [e["layer"] for e in result["attn_error"]] == [1, 3]
    assert [e["layer"] for e in result["attn_entropy"]] == [1, 3]
    assert all(b["rel_err"] > 0 for e in result["attn_error"] for b in e["buckets"])
    assert all(b["entropy"] > 0 for e in result["attn_entropy"] for b in e["buckets"])
    with pytest.raises(ValueError, match=r"attn_layers \[0, 2\] have no attention .* layers with attention: \[1, 3\]"):
        evaluate(model, _ids(64), 64, ["int4-token"], attn_layers=[0, 1, 2])


def test_mixed_average_bits_count_only_the_layers_that_cache_kv():
    """A mixed scheme's ``avg_bits`` averaged its layers over every layer of the model, those of a hybrid model
    that cache nothing included: on LFM2 (convolution layers 0, 2) ``int4-token,0=fp16`` was reported at 8.5 bits
    though it stores exactly what ``int4-token`` stores (6.0: both attention layers int4), and
    ``int4-token,1=fp16`` at 8.5 instead of 11.0 (one fp16 and one int4 attention layer)."""
    summary = evaluate(_lfm2(), _ids(64), 64, ["int4-token", "int4-token,0=fp16", "int4-token,1=fp16"], attn_layers=[])
    bits = {r["scheme"]: r["avg_bits"] for r in summary["results"]}
    assert bits == {"int4-token": 6.0, "int4-token,0=fp16": 6.0, "int4-token,1=fp16": 11.0}
