"""Reported bytes == held bytes == ``kvbits.plan``, swept over attention layouts and cache kinds.

Tiny transformers models (Llama MHA / GQA / MQA, Mistral with a sliding window, Gemma 2 alternating sliding and
full layers, LFM2's conv + attention hybrid), a 37-token prefill then 20 decode steps (crossing KIVI-style windows
is left to ``test_cache``), with and without sinks: ``memory_report()``'s K/V bytes plus what it reports apart
(workspace, positions, RoPE tables, device state) equal the distinct storages the cache holds (walked
independently), and ``total_bytes`` equals ``kvbits.plan`` where the plan is exact (``QuantizedKVCache``; a
per-token ``StaticQuantizedKVCache`` at ``max_cache_len`` without static scales). The full sweep over every preset
(1,554 cases, review session "bytesfuzz") found no mismatch; this keeps a fast slice of it.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import transformers
from test_cache import CACHE_KW, storage_bytes, walk_tensors
from transformers import AutoModelForCausalLM

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache
from kvbits.plan import plan
from kvbits.schemes import get_scheme

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PREFILL, DECODE, BATCH = 96, 37, 20, 2
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "head_dim": 64}  # fmt: skip
LAYOUTS = {
    "llama_mha": lambda: transformers.LlamaConfig(num_key_value_heads=4, **COMMON),
    "llama_gqa": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "llama_mqa": lambda: transformers.LlamaConfig(num_key_value_heads=1, **COMMON),
    "mistral_swa": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=24, **COMMON),
    "gemma2_alt": lambda: transformers.Gemma2Config(num_key_value_heads=2, sliding_window=24, **COMMON),
    "lfm2": lambda: transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=1,
        num_key_value_heads=1, layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
}
SLIDING = {"mistral_swa", "gemma2_alt"}  # StaticQuantizedKVCache refuses sliding layers
SCHEMES = ["int4-token", "int4-g64", "fp8-e4m3-token", "vllm-int4", "int3-token-hadamard"]


def _model(layout: str) -> tuple:
    cfg = LAYOUTS[layout]()
    torch.manual_seed(0)
    return cfg, AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@torch.no_grad()
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reported_bytes_are_held_bytes_and_the_plan(layout):
    cfg, model = _model(layout)
    ids = torch.randint(1, VOCAB, (BATCH, PREFILL + DECODE), generator=torch.Generator().manual_seed(1))
    T = ids.shape[1]
    logging.disable(logging.WARNING)
    try:
        for name in SCHEMES:
            for sinks in (0, 3):
                scheme = get_scheme(name)
                scheme = dataclasses.replace(scheme, name=f"{name}+s{sinks}", sinks=sinks) if sinks else scheme
                kinds = ["dynamic"] + ([] if layout in SLIDING else ["static"])
                for kind in kinds:
                    if kind == "dynamic":
                        cache = QuantizedKVCache(config=cfg, scheme=scheme)
                    else:
                        cache = StaticQuantizedKVCache(config=cfg, scheme=scheme, max_cache_len=T)
                    model(ids[:, :PREFILL], **{CACHE_KW: cache})
                    for i in range(PREFILL, T):
                        model(ids[:, i : i + 1], **{CACHE_KW: cache})
                    rep = cache.memory_report()
                    if kind == "dynamic":
                        apart = rep["workspace_bytes"] + rep["position_bytes"] + cache.fused_report()["rope_table_bytes"]
                    else:
                        apart = rep["state_bytes"] + rep["rope_table_bytes"]
                    held = walk_tensors(cache)
                    where = (layout, scheme.name, kind)
                    assert storage_bytes(held) == rep["total_bytes"] + apart, where
                    want = plan(cfg, context=T, batch=BATCH, scheme=scheme, dtype_bytes=4)["total_bytes"]
                    assert rep["total_bytes"] == want, where
    finally:
        logging.disable(logging.NOTSET)
