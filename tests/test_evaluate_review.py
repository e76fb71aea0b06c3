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
