"""Host time of one decode step per cache, on a model too small to compute much (CPU, one thread).

    PYTHONPATH=src python benchmarks/host_overhead.py [--layers 24] [--steps 20]

A 24-layer Qwen2-shaped model (hidden 128, 14 query heads, 2 KV heads, head dim 64: the e2e step's heads)
decodes after a 256-token prompt through ``DynamicCache``, ``QuantizedKVCache`` dequantizing kivi-4, and the
fused path (its torch reference off CUDA). With so little arithmetic the per-step times are mostly the
Python of transformers and of each cache: a lead for the end-to-end step times of BENCHMARKS.md §6.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from kvbits.cache import QuantizedKVCache, cache_kwargs, use_fused_decode

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=a.layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, 256))

    def ms_per_step(cache, fused: bool) -> float:
        if fused:
            use_fused_decode(model)
        else:
            model.set_attn_implementation("sdpa")
        with torch.no_grad():
            kw = cache_kwargs(cache, model)
            nxt = model(ids, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for i in range(3 + a.steps):
                if i == 3:
                    t0 = time.perf_counter()
                out = model(nxt, **kw, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return 1e3 * (time.perf_counter() - t0) / a.steps

    runs = {
        "DynamicCache": (lambda: DynamicCache(config=cfg), False),
        "kvbits kivi-4, dequantize + SDPA": (lambda: QuantizedKVCache(config=cfg, scheme="kivi-4", fused_decode=False), False),
        "kvbits kivi-4, fused (torch reference)": (lambda: QuantizedKVCache(config=cfg, scheme="kivi-4", fused_decode=True), True),
    }  # fmt: skip
    for name, (make, fused) in runs.items():
        print(f"{name:40s} {ms_per_step(make(), fused):7.1f} ms/step ({a.layers} layers)")


if __name__ == "__main__":
    main()
