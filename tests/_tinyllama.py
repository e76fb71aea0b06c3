"""A tiny random-weight Llama over the byte-level vocabulary (``_bytelevel``) and two test schemes, shared by
the tests that run whole decode loops (needle, speed)."""

from __future__ import annotations

import torch
import transformers
from _bytelevel import VOCAB

from kvbits.schemes import KVScheme, TensorSpec

EXACT = KVScheme(
    "exact32",
    key=TensorSpec(kind="float", bits=32, fmt="fp32"),
    value=TensorSpec(kind="float", bits=32, fmt="fp32"),
)
# flushes 8-token blocks behind a 16-token window: a few dozen decoded tokens see flushes happen
SMALL_KIVI = KVScheme(
    "t-kivi",
    key=TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=8),
    value=TensorSpec(kind="int", bits=2, fmt=None, granularity="token", group_size=16),
    residual=16,
    block=8,
)


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """2 layers, 4 query heads over 2 KV heads of 16 channels, SDPA attention."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()
