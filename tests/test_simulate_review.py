"""Simulator review: ``simulate`` computes what the model's own attention (and so the cache, ``stream``) computes
(``kvbits.evaluate.simulate``)."""

from __future__ import annotations

import pytest
import torch

from kvbits.evaluate.simulate import simulate
from kvbits.evaluate.stream import stream_hidden

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=20, attn_logit_softcapping=5.0, max_position_embeddings=256,
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg).eval()


@torch.no_grad()
def test_softcapped_attention_follows_the_models_dtypes():
    """Gemma 2 caps its attention logits; the simulator computed those scores in float32 where the model's eager
    attention (which the cache runs through) scales and caps them in the model's dtype, softmax in float32. So the
    ``bf16`` scheme on a bfloat16 Gemma 2, which changes nothing (stream mode: exactly the model), was 9.5e-3
    (relative, hidden states of 70 tokens) from the model in simulate mode: a nonzero KL for a no-op scheme."""
    model = _gemma2().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    ref = model.model(ids).last_hidden_state
    with simulate(model, "bf16", chunk_size=16):
        h_sim = model.model(ids).last_hidden_state
    h_stream = stream_hidden(model, ids, "bf16")
    torch.testing.assert_close(h_stream, ref, rtol=0, atol=0)
    torch.testing.assert_close(h_sim, ref, rtol=0, atol=0)
