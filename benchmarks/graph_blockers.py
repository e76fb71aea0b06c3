"""What keeps a decode step from being captured as one CUDA graph, per cache (CPU, no GPU needed).

    PYTHONPATH=src python benchmarks/graph_blockers.py [--layers 2] [--steps 40] [--scheme kivi-4]
        [--static-scheme int4-token] [--caches static,dynamic,kvbits-fused,kvbits-dequant,...] [--json out.json]

A CUDA graph replays the kernels of one captured step with the arguments they had then: the same sizes, the same
scalars, the same addresses, and no host work in between. A decode loop can replay one captured step only if every
step launches the same kernels with the same sizes and scalars, the data changing only in place (transformers'
``StaticCache`` with a ``cache_position`` tensor is built for that). This script decodes ``--steps`` steps of a small
Qwen2-shaped model (the e2e step's heads: 14 query heads, 2 KV heads, head dim 64) after a 256-token prompt and
records, per step (each given its ``position_ids`` and ``cache_position`` tensors, as ``generate`` passes them), every
device-launching torch operator (``TorchDispatchMode``; views and allocations apart) and
every Triton launch (the fused path's kernels, compiled for sm_90 and not run: ``host_overhead.attention_stubbed``),
each with its tensors' sizes, strides and storage offsets and its other arguments, and the host reads (``item()``: a
device sync on a GPU).

It then compares consecutive steps. ``same_sequence``: pairs of steps that launch the same operators in the same
order. ``varying``: operators whose sizes or scalars change from one step to the next, counted per step and named by
the innermost kvbits or transformers function that issued them: each is something a captured graph would replay
wrongly. Base addresses are not compared (the allocator's reuse on a CPU says little about a GPU's graph pool), so
zero here is necessary for a captured step, not sufficient.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROMPT = 256
CACHES = ("static", "dynamic", "kvbits-fused", "kvbits-dequant", "kvbits-static-fused", "kvbits-static")
# kvbits-static*: StaticQuantizedKVCache (kvbits.cache.static), fused or dequantizing, with --static-scheme


def _describe(x: Any) -> Any:
    """An argument as a launch sees it: a tensor by its sizes, strides, dtype and offset into its storage (a view
    that moves through a persistent buffer, such as a slot written at each step, changes its offset), a scalar by its
    value."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_describe(v) for v in x)
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    return type(x).__name__


def _site() -> str:
    """The innermost kvbits or transformers frame of the current stack, as ``file:function``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        for root in ("/kvbits/", "/transformers/"):
            if root in path and "graph_blockers" not in path:
                return f"{root.strip('/')}/{path.split(root, 1)[1]}:{frame.name}"
    return "?"


class StepRecorder(TorchDispatchMode):
    """Records ``(site, operator, arguments)`` of each device-launching operator, and counts host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str, Any]] = []
        self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if name.startswith("aten._local_scalar_dense"):
            self.host_reads += 1
        elif not func.is_view and not name.startswith(("aten.empty", "aten.new_empty")):
            self.ops.append((_site(), name, _describe((args, sorted((kwargs or {}).items())))))
        return func(*args, **(kwargs or {}))


def _triton_recorder(recorder: StepRecorder):
    """Patch ``JITFunction.run`` so each Triton launch lands in ``recorder.ops`` with its grid and arguments."""
    from triton.runtime.jit import JITFunction

    real = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        grid = kwargs.get("grid")
        described = {k: _describe(v) for k, v in kwargs.items() if k not in ("grid", "warmup")}
        recorder.ops.append((_site(), f"triton.{self.fn.__name__}", (_describe(args), sorted(described.items()),
                                                                        grid if not callable(grid) else "fn")))  # fmt: skip
        return real(self, *args, **kwargs)

    return mock.patch.object(JITFunction, "run", run)


def compare(steps: list[StepRecorder]) -> dict[str, Any]:
    """``same_sequence`` (consecutive pairs with the same operators in order), ``pairs``, ``varying_per_step``
    (median over the pairs with the same sequence of the operators whose arguments differ) and ``varying_sites``
    (``site operator`` -> in how many such pairs it varied), ``ops_per_step`` (median), ``host_reads`` (total)."""
    same, varying, sites = 0, [], collections.Counter()
    for a, b in itertools.pairwise(steps):
        if [(s, n) for s, n, _ in a.ops] != [(s, n) for s, n, _ in b.ops]:
            continue
        same += 1
        diff = [(s, n) for (s, n, x), (_, _, y) in zip(a.ops, b.ops) if x != y]
        varying.append(len(diff))
        sites.update({f"{s} {n}" for s, n in diff})
    counts = sorted(len(s.ops) for s in steps)
    return {
        "pairs": len(steps) - 1, "same_sequence": same,
        "varying_per_step": sorted(varying)[len(varying) // 2] if varying else None,
        "varying_sites": dict(sites.most_common()), "ops_per_step": counts[len(counts) // 2],
        "host_reads": sum(s.host_reads for s in steps),
    }  # fmt: skip


def is_fused(cache_name: str) -> bool:
    """Whether the cache's decode steps go through ``kvbits_fused`` (``use_fused_decode``)."""
    return cache_name in ("kvbits-fused", "kvbits-static-fused")


def scheme_of(cache_name: str, args: argparse.Namespace) -> str:
    """The scheme a kvbits cache runs: ``--static-scheme`` for ``StaticQuantizedKVCache``, else ``--scheme``."""
    return args.static_scheme if cache_name.startswith("kvbits-static") else args.scheme


def warm_steps(cache_name: str, scheme: str) -> int:
    """Untimed decode steps before the recorded ones: 3, and one flush block of ``scheme`` for a kvbits cache."""
    from kvbits.schemes import get_scheme

    return 3 + (get_scheme(scheme).block if cache_name.startswith("kvbits") else 0)


def build(cache_name: str, layers: int, scheme: str, tokens: int) -> tuple[Any, Any, dict[str, Any], torch.Tensor]:
    """The same model, cache and prompt at every call (seed 0): ``(model, cache, cache keyword arguments, prompt
    ids (1, PROMPT))``. The model is Qwen2-shaped with ``layers`` layers and the e2e step's heads; the cache
    (``CACHES``) holds ``tokens`` tokens (``StaticCache`` and kvbits' reserve them, as a server does)."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, StaticCache

    from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache, cache_kwargs, use_fused_decode

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    fused = is_fused(cache_name)
    if fused:
        use_fused_decode(model)
    else:
        model.set_attn_implementation("sdpa")
    if cache_name == "static":
        cache = StaticCache(config=cfg, max_cache_len=tokens)
    elif cache_name == "dynamic":
        cache = DynamicCache(config=cfg)
    elif cache_name.startswith("kvbits-static"):
        cache = StaticQuantizedKVCache(config=cfg, scheme=scheme, max_cache_len=tokens, fused_decode=fused, checks="lazy")
    else:
        cache = QuantizedKVCache(config=cfg, scheme=scheme, fused_decode=fused, checks="lazy", max_cache_len=tokens)
    return model, cache, cache_kwargs(cache, model), torch.randint(0, 256, (1, PROMPT))


def record(cache_name: str, layers: int, steps: int, scheme: str) -> dict[str, Any]:
    """Decode ``steps`` recorded steps through ``cache_name`` (``CACHES``) and compare them (``compare``)."""
    warm = warm_steps(cache_name, scheme)
    fused = is_fused(cache_name)
    model, _cache, kw, ids = build(cache_name, layers, scheme, PROMPT + warm + steps)
    recorded: list[StepRecorder] = []
    with torch.no_grad():
        nxt = model(ids, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        stub: Any = contextlib.nullcontext()
        if fused:
            import host_overhead

            stub = host_overhead.attention_stubbed(True)  # the Triton launch code, compiled for sm_90, not run
        with stub:
            for i in range(warm + steps):
                rec = StepRecorder()
                # positions as generate() passes them (else the model adds the cache's host length to an arange)
                position = torch.tensor([PROMPT + i])
                with rec, _triton_recorder(rec) if fused else contextlib.nullcontext():
                    out = model(nxt, **kw, use_cache=True, logits_to_keep=1, cache_position=position,
                                position_ids=position[None])  # fmt: skip
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                if i >= warm:
                    recorded.append(rec)
    return {"cache": cache_name, "scheme": scheme if cache_name.startswith("kvbits") else "fp32", "layers": layers,
            "steps": steps, **compare(recorded)}  # fmt: skip


def parse_args(
    doc: str, steps: int, steps_help: str, argv: list[str] | None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.Namespace, list[str]]:  # fmt: skip
    """The options this script and ``graph_replay.py`` share (``--layers --steps --scheme --caches --json``, and
    what ``extra`` adds), parsed from ``argv``; returns them and the caches named (an unknown one is a usage error).
    One torch thread."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if extra is not None:
        extra(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    p.add_argument("--scheme", default="kivi-4", help="the QuantizedKVCache runs' scheme (default kivi-4)")
    p.add_argument("--static-scheme", default="int4-token",
                   help="the StaticQuantizedKVCache runs' scheme, a per-token one (default int4-token)")
    p.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated, of {CACHES}")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args(argv)
    names = a.caches.split(",")
    bad = [n for n in names if n not in CACHES]
    if bad:
        p.error(f"unknown caches {bad}; expected some of {CACHES}")
    torch.set_num_threads(1)
    return a, names


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    a, names = parse_args(__doc__, 40, "recorded decode steps", argv)
    rows = [record(n, a.layers, a.steps, scheme_of(n, a)) for n in names]
    print(f"{a.layers} layers, {a.steps} recorded decode steps after a {PROMPT}-token prompt")
    print("| cache | ops per step | pairs with the same operators | operators varying per step | host reads |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cache']} ({r['scheme']}) | {r['ops_per_step']} | {r['same_sequence']} of {r['pairs']} | "
              f"{r['varying_per_step']} | {r['host_reads']} |")  # fmt: skip
    for r in rows:
        if r["varying_sites"]:
            print(f"\n{r['cache']}: varying operators (site, operator: pairs where it varied)")
            for site, n in r["varying_sites"].items():
                print(f"  {site}: {n}")
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
