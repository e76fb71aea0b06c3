"""What one layer's cache allocates while it serves: the prefill's and a decode step's peak beside the K/V it
returns (the dequantize path: no fused kernel), and a decode step's time.

    PYTHONPATH=src python benchmarks/cache_working_set.py [--tokens 32768] [--heads 2] [--head-dim 64] [--reserve]
        [--workspace]

Peaks are measured with ``kvbits.evaluate.livebytes.LiveBytes`` (every storage an op allocates inside the
call, counted until freed), so they are exact on any device. Ratios are to the bytes a step returns (both
sides' whole history in the model dtype); ``held`` is what the cache stores (``memory_report``), ``workspace``
its dequantized copy (``--workspace``: ``workspace_bytes``; with ``--reserve`` a step returns views of it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from kvbits.cache import QuantizedKVCache
from kvbits.evaluate.livebytes import LiveBytes

SCHEMES = ["int8-token", "int4-token", "int4-channel", "kivi-4", "kivi-2", "int4-token-hadamard", "fp8-e4m3"]


def measure(
    scheme: str, tokens: int, heads: int, head_dim: int, dtype: torch.dtype, reps: int, reserve: bool = False,
    workspace: bool = False,
) -> dict:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=heads * head_dim * 2, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=heads * 2, num_key_value_heads=heads,
                                   head_dim=head_dim)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, heads, tokens + reps + 1, head_dim, generator=g).to(dtype) for _ in range(2))
    cache = QuantizedKVCache(config=cfg, scheme=scheme, max_cache_len=tokens + reps + 1 if reserve else None,
                             workspace=workspace)  # fmt: skip
    with LiveBytes() as prefill:
        out = cache.update(k[:, :, :tokens], v[:, :, :tokens], 0)
        del out
    with LiveBytes() as step:
        kk, vv = cache.update(k[:, :, tokens : tokens + 1], v[:, :, tokens : tokens + 1], 0)
        returned = kk.numel() * kk.element_size() + vv.numel() * vv.element_size()  # views of a workspace too
        del kk, vv
    times = []
    for t in range(tokens + 1, tokens + 1 + reps):
        t0 = time.perf_counter()
        out = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        times.append(time.perf_counter() - t0)
        del out
    return {
        "scheme": scheme,
        "prefill_x": prefill.peak / returned,
        "step_x": step.peak / returned,
        "held_x": cache.memory_report()["total_bytes"] / returned,
        "workspace_x": cache.memory_report()["workspace_bytes"] / returned,
        "returned_mib": returned / 2**20,
        "step_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--reps", type=int, default=9, help="decode steps timed (median)")
    p.add_argument("--scheme", action="append", help=f"default: {', '.join(SCHEMES)}")
    p.add_argument("--reserve", action="store_true", help="max_cache_len = every token the run stores")
    p.add_argument("--workspace", action="store_true", help="keep a dequantized copy of the history (workspace=True)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    print(f"one layer, {a.tokens} tokens, {a.heads} KV heads x {a.head_dim}, {a.dtype}, 1 thread"
          + (", max_cache_len reserved" if a.reserve else "") + (", workspace" if a.workspace else ""))  # fmt: skip
    print("| scheme | returned MiB | prefill peak (x returned) | step peak (x) | held (x) | workspace (x) | step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for scheme in a.scheme or SCHEMES:
        r = measure(scheme, a.tokens, a.heads, a.head_dim, dtype, a.reps, a.reserve, a.workspace)
        print(f"| {r['scheme']} | {r['returned_mib']:.1f} | {r['prefill_x']:.2f} | {r['step_x']:.2f} | "
              f"{r['held_x']:.2f} | {r['workspace_x']:.2f} | {r['step_ms']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
