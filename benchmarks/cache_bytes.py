"""What a ``QuantizedKVCache`` really holds, against what ``kvbits.plan`` says (CPU; predicts the GPU figure).

    PYTHONPATH=src python benchmarks/cache_bytes.py [--context 32768] [--steps 600] [--batch 1] [--schemes S ...]

For the Qwen2.5-0.5B KV shape (24 layers, 2 KV heads, head dim 64) and each scheme of
``gpu_decode.py``'s end-to-end step, plus the centred / smoothed per-token keys (stand-in channel vectors
installed; calibrated ones weigh the same): prefill ``--context`` random fp16 tokens, decode ``--steps`` more
one at a time (so blocks are flushed during decode too), then compare

- ``planned``: ``kvbits.plan`` for the same shape, batch and tokens (the K/V);
- ``reported``: ``memory_report()["total_bytes"]`` (the K/V);
- ``storages``: bytes of the distinct tensor storages reachable from the cache, minus the RoPE tables;
- ``rope_tables``: the float32 cos/sin tables the fused decode path keeps for pre-RoPE keys
  (``fused_report()["rope_table_bytes"]``, not in ``memory_report()``);
- ``planned_fused``: ``kvbits.plan(..., fused_decode=True)``: the K/V plus those tables;
- ``cuda_est``: everything the cache pins (tables included) rounded up to the CUDA caching allocator's
  512-byte blocks (``torch.cuda.memory_allocated`` counts those), to compare with ``planned_fused``.

Decode steps run as under ``kvbits_fused`` (each layer claimed: ``update`` returns placeholders instead of
dequantizing the history, and the packed store the kernel would read is built after the last step), so
the figures are those of the fused serving path and a step costs O(1) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench.common import install_stand_ins

from kvbits.cache import QuantizedKVCache, fused
from kvbits.plan import plan

SCHEMES = ("int8-token", "kivi-4", "kivi-2", "kvquant-4-block", "fp8-e4m3-token", "int4-token-smooth",
           "int4-token-smooth-prerope")
SHAPE = {"vocab_size": 1000, "hidden_size": 896, "intermediate_size": 128, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip


def held_storages(root: object) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of every tensor storage reachable from ``root`` (kvbits objects, containers)."""
    found: dict[int, int] = {}
    seen: set[int] = set()

    def visit(obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.nbytes():
                found[s.data_ptr()] = s.nbytes()
        elif isinstance(obj, (list, tuple, set)):
            for x in obj:
                visit(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x)
        elif hasattr(obj, "__dict__") and (type(obj).__module__.startswith("kvbits") or obj is root):
            for x in vars(obj).values():
                visit(x)

    visit(root)
    return found


def measure(scheme: str, context: int, steps: int, batch: int) -> dict:
    config = Qwen2Config(max_position_embeddings=context + steps + 64, **SHAPE)
    cache = QuantizedKVCache(config=config, scheme=scheme, fused_decode=True)
    n_layers, H, D = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    install_stand_ins(cache, n_layers, H, D)  # codebooks, channel vectors: calibrated ones weigh the same
    gen = torch.Generator().manual_seed(0)
    for layer in range(n_layers):
        k = torch.randn(batch, H, context, D, generator=gen).half()
        cache.update(k, k.clone(), layer)
        if not fused.claim(cache.layers[layer], torch.zeros(batch, SHAPE["num_attention_heads"], 1, D)):
            raise SystemExit(f"{scheme}: layer {layer} not claimed for fused decode: {cache.layers[layer].fused}")
    for _ in range(steps):
        for layer in range(n_layers):
            k = torch.randn(batch, H, 1, D, generator=gen).half()
            cache.update(k, k.clone(), layer)
    tokens = context + steps
    planned = plan(config, context=tokens, batch=batch, scheme=scheme, dtype_bytes=2)["total_bytes"]
    planned_fused = plan(config, context=tokens, batch=batch, scheme=scheme, dtype_bytes=2, fused_decode=True)[
        "total_bytes"
    ]
    for layer in cache.layers:
        fused.packed_store(layer)  # what the kernel reads next step (builds the RoPE tables of pre-RoPE keys)
    report = cache.memory_report()
    rope = cache.fused_report()["rope_table_bytes"]
    storages = held_storages(cache)
    return {
        "scheme": scheme,
        "batch": batch,
        "tokens": tokens,
        "planned": planned,
        "reported": report["total_bytes"],
        "position_bytes": report["position_bytes"],
        "storages": sum(storages.values()) - rope,  # the tables are reachable too: shown in their column
        "n_storages": len(storages),
        "rope_tables": rope,
        "planned_fused": planned_fused,
        "cuda_est": sum(-(-n // 512) * 512 for n in storages.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), metavar="SCHEME", help="presets (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    t0 = time.time()
    rows = [measure(s, args.context, args.steps, args.batch) for s in args.schemes]
    print("| scheme | tokens | planned K/V | reported K/V | held K/V storages | RoPE tables held | "
          "planned, fused decode | CUDA 512-B blocks of all (est.) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['tokens']} | {r['planned']:,} | {r['reported']:,} | {r['storages']:,} "
              f"({r['n_storages']}) | {r['rope_tables']:,} | {r['planned_fused']:,} | "
              f"{r['cuda_est']:,} ({r['cuda_est'] / r['planned_fused']:.4f}x) |")  # fmt: skip
    print(f"\n{time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
