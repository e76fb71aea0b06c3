"""What storing one decode step's K/V costs a fused-decode layer, with and without ``max_cache_len``.

    PYTHONPATH=src python benchmarks/append_copy.py [--tokens 32768] [--batch 1] [--heads 2] [--head-dim 64]

One full-attention layer (Qwen2.5-0.5B's KV shape by default: 2 KV heads, head dim 64) is claimed for fused
decode, so ``update`` stores the new token and returns zero-byte placeholders: what is timed is the store
alone (append, flush, no dequantization), which is all that differs between a growing cache and one with
reserved slots. Per scheme: the peak bytes a step allocates (``LiveBytes``: without a reservation a flush
concatenates the layer's whole quantized history into new storage), the median step time on this CPU, and
the bytes the fused kernel then reads from the quantized slots (``PackedTensor.nbytes`` of the used slots),
the yardstick a per-step copy should be compared with. On a GPU the copy is a device-to-device copy of that
many bytes, twice the traffic of reading them; this script does not time one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from kvbits.cache import QuantizedKVCache
from kvbits.cache import fused as fused_mod
from kvbits.evaluate.livebytes import LiveBytes
from kvbits.kernels.reference import used_slots

SCHEMES = ["int8-token", "int4-token", "fp8-e4m3-token", "int4-token-hadamard", "kivi-4", "kivi-2"]


def measure(scheme: str, reserve: bool, tokens: int, batch: int, heads: int, head_dim: int, steps: int) -> dict:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=heads * head_dim * 2, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=heads * 2, num_key_value_heads=heads,
                                   head_dim=head_dim)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, heads, tokens + steps, head_dim, generator=g).half() for _ in range(2))
    cache = QuantizedKVCache(config=cfg, scheme=scheme, fused_decode=True,
                             max_cache_len=tokens + steps if reserve else None)  # fmt: skip
    cache.update(k[:, :, :tokens], v[:, :, :tokens], 0)
    layer = cache.layers[0]
    q = torch.zeros(batch, heads * 2, 1, head_dim, dtype=torch.float16)
    if not fused_mod.claim(layer, q):
        raise SystemExit(f"{scheme}: the layer was not claimed for fused decode ({layer.fused.declined})")
    peaks, times = [], []
    for t in range(tokens, tokens + steps):
        with LiveBytes() as live:
            t0 = time.perf_counter()
            out = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
            times.append(time.perf_counter() - t0)
        assert out[0].device.type == "meta", "a claimed layer's decode step returns placeholders"
        peaks.append(live.peak)
        del out
    store = used_slots(fused_mod.packed_store(layer))
    read = store.key.nbytes + store.value.nbytes if store.key is not None else 0
    return {
        "scheme": scheme,
        "reserved": reserve,
        "peak_mib": max(peaks) / 2**20,
        "median_peak_mib": statistics.median(peaks) / 2**20,
        "step_ms": 1e3 * statistics.median(times),
        "kernel_reads_mib": read / 2**20,
        "held_mib": cache.memory_report()["total_bytes"] / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=33, help="decode steps stored (medians over them)")
    p.add_argument("--scheme", action="append", help=f"default: {', '.join(SCHEMES)}")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.tokens} tokens, batch {args.batch}, {args.heads} KV heads x "
          f"{args.head_dim}, {args.steps} decode steps, {args.threads} thread(s)")  # fmt: skip
    print(f"{'scheme':<22}{'max_cache_len':>14}{'peak MiB':>10}{'median':>8}{'step ms':>9}{'kernel reads':>14}"
          f"{'held MiB':>10}")  # fmt: skip
    for scheme in args.scheme or SCHEMES:
        for reserve in (False, True):
            r = measure(scheme, reserve, args.tokens, args.batch, args.heads, args.head_dim, args.steps)
            print(f"{scheme:<22}{'set' if reserve else '-':>14}{r['peak_mib']:>10.3f}{r['median_peak_mib']:>8.3f}"
                  f"{r['step_ms']:>9.3f}{r['kernel_reads_mib']:>11.3f} MiB{r['held_mib']:>10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
