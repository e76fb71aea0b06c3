"""``kvbits.cache.cache_kwargs``: a cache passed by the keyword the installed transformers takes."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvbits.cache import QuantizedKVCache, cache_kwarg, cache_kwargs


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_the_keyword_is_the_one_forward_declares():
    model = tiny()
    declared = inspect.signature(model.forward).parameters
    want = "cache" if "cache" in declared else "past_key_values"
    assert want in declared  # one of the two, whichever transformers this is
    assert cache_kwarg(model) == cache_kwarg(model.model) == want
    assert cache_kwargs("C", model) == {want: "C"}
    # something without a forward signature to read: the older name, which every 5.x accepts
    assert cache_kwarg(object()) == "past_key_values"


def test_the_cache_is_filled_and_no_deprecation_is_raised():
    model = tiny()
    ids = torch.randint(0, 64, (1, 12))
    caches = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "quantized": lambda: QuantizedKVCache(config=model.config, scheme="int8-token"),
    }
    for make in caches.values():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*past_key_values.*deprecated")
            with torch.no_grad():
                model(ids, use_cache=True, **cache_kwargs(forward := make(), model))
                model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                               **cache_kwargs(gen := make(), model))  # fmt: skip
        assert forward.get_seq_length() == 12
        assert gen.get_seq_length() == 12 + 3 - 1  # the prompt and the generated tokens but the last
