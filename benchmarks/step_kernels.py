"""What one captured decode step of ``StaticQuantizedKVCache`` launches: a plain capture against ``GraphedDecode``'s.

    PYTHONPATH=src:benchmarks python benchmarks/step_kernels.py [--layers 2] [--kernel triton|reference]
        [--json out.json] kivi-4 kvquant-4 ...

A step captured without bookkeeping (a plain ``torch.cuda.graph``, or a ``torch.compile`` trace) must replay right
across a windowed scheme's flushes, so it quantizes the window's oldest block at every step; ``GraphedDecode``
captures the plain step and the flushing one apart (``kvbits.evaluate.graphs``), and its plain step quantizes
nothing but the token of a per-token scheme. This records one fused decode step of each cache after the prompt and one
eager step (``graph_replay.OpTape``: every torch operator, and each Triton launch as one entry), once as a plain
capture sees it and once as ``GraphedDecode`` captures its plain variant, on ``graph_blockers.build``'s Qwen2-shaped
model (the e2e step's heads: 2 KV heads, head dim 64) with stand-in codebooks (``gpu_bench.common.install_stand_ins``),
and counts the entries, those that are neither views nor allocations (each a kernel on a GPU, roughly), and the Triton
launches. ``--kernel triton`` runs kvbits' kernels through Triton's interpreter, as a GPU step launches them (the
fused decode and merge, the quantize kernel); ``reference`` runs their torch reference (more operators per launch).
A count, not a timing: what a replayed step saves on a GPU depends on each kernel's time there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch

_NOT_KERNELS = ("empty", "lift_fresh", "detach", "alias", "_unsafe_view")  # allocations and aliases: no kernel


def count(scheme: str, layers: int, bookkept: bool) -> dict[str, int]:
    """Tape entries, kernel-like entries and Triton launches of one fused decode step of ``scheme``."""
    from gpu_bench.common import install_stand_ins
    from graph_blockers import build
    from graph_replay import OpTape, as_captured, triton_on_tape

    from kvbits.evaluate.graphs import _bookkeeping

    model, cache, kw, ids = build("kvbits-static-fused", layers, scheme, 300)  # a 256-token prompt and two steps
    cfg = model.config
    install_stand_ins(cache, layers, cfg.num_key_value_heads, cfg.head_dim)
    with torch.no_grad():
        nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
        pos = torch.tensor([ids.shape[1]])
        model(nxt, **kw, use_cache=True, cache_position=pos, position_ids=pos[None])
        tape = OpTape()
        how = _bookkeeping(cache) if bookkept else as_captured()  # GraphedDecode's capture, or a plain one
        with how, tape, triton_on_tape(tape):
            model(nxt, **kw, use_cache=True, cache_position=pos + 1, position_ids=(pos + 1)[None])
    kernels = [f for f, *_ in tape.ops if not getattr(f, "is_view", False) and not str(f).startswith("triton")
               and not str(f).split(".")[1].startswith(_NOT_KERNELS)]  # fmt: skip
    return {"entries": len(tape.ops), "kernels": len(kernels) + tape.launches, "triton_launches": tape.launches,
            "host_counts": all(layer.host_counts for layer in cache.layers)}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("schemes", nargs="+")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kernel", choices=("triton", "reference"), default="triton")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.kernel == "triton":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    rows = []
    with mock.patch.dict(os.environ, {"KVBITS_KERNEL": a.kernel}):
        for scheme in a.schemes:
            plain, kept = count(scheme, a.layers, False), count(scheme, a.layers, True)
            rows.append({"scheme": scheme, "layers": a.layers, "kernel": a.kernel, "plain_capture": plain,
                         "graphed_decode": kept})  # fmt: skip
    print(f"one fused decode step, {a.layers} layers, kvbits' kernels: {a.kernel}")
    print("| scheme | plain capture: kernels (Triton launches) | GraphedDecode's plain step | fewer per layer |")
    print("|---|---:|---:|---:|")
    for r in rows:
        pl, gd = r["plain_capture"], r["graphed_decode"]
        print(f"| {r['scheme']} | {pl['kernels']} ({pl['triton_launches']}) | {gd['kernels']} ({gd['triton_launches']}) | "
              f"{(pl['kernels'] - gd['kernels']) / a.layers:g} |")  # fmt: skip
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    main()
