"""The fused decode kernels on a real model's packed caches: per layer, each kernel's error against float64 attention.

Runs a GGUF model (float32, CPU) over a window of real text with a ``QuantizedKVCache`` (fused decode on), then
``--steps`` decode steps on the text's next tokens. Every fused step hands ``(query, packed store)`` to
``kvbits.kernels.decode_attention``; here each call is also attended, over the very same store, by

- float64 attention (``decode_attention_reference(..., dtype=float64)``: the truth the kernels are held to),
- float16 torch attention (dequantize to float16, then attention: the precision the issue's criterion names),
- the product kernel (``triton_decode``, float32 dequantization) and the folded-scale kernel (``triton_fold``),
  both through Triton's interpreter (the compiled PTX conversion is not what runs here: ``tests/test_aot.py``
  compiles it; the interpreter takes the same arithmetic per element),

with float16 queries and a float16 tail (the model's float32 queries and tail rounded, as a float16 model holds
them; ``half_tail``). The model's own step takes the float32 reference (``observe_fused_decode`` shows
each step's kernel inputs first), so the cache evolves as it would. Per scheme and layer: the largest error of each kernel over the steps' heads and
channels, relative to the largest output magnitude, and its ratio to float16 torch's (the issue's criterion: at most
2): of the worst errors over the steps (``*_ratio``) and, finer, the worst of the steps' own ratios (``*_step_ratio``:
both errors at one step, over the same query and store, as each random check of the tests). On a rotated store both kernels attend with ``q @ R`` kept float32 (two float16 halves per key dot; BENCHMARKS.md
§6, session 40), float16 torch with it rounded to float16. Exit status 1 if the folded kernel is above 2x float16
torch's error at any layer and step.
Real caches carry what random tests do not: Qwen2.5's outlier key channels and biases, attention sinks, values
whose magnitude differs by orders between layers.

    PYTHONPATH=src python benchmarks/fold_real_kv.py --model qwen2.5-coder-0.5b --data wikitext2 --context 2048 \\
        --out benchmarks/results/fold-real-kv-qwen-wiki-2k.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from kvbits.kernels.interpret import enable_interpreter

enable_interpreter()  # before Triton is imported: CPU tensors launch through the interpreter

from kvbits.cache import QuantizedKVCache, cache_kwargs, observe_fused_decode
from kvbits.evaluate.data import load_text, make_windows, tokenize
from kvbits.evaluate.models import load_model
from kvbits.kernels import triton_decode, triton_fold
from kvbits.kernels.reference import PackedStore, decode_attention_reference
from kvbits.schemes import get_scheme

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import commit, host

SCHEMES = ("int8-token", "int4-token", "vllm-int8", "kivi-4", "kivi-2", "int4-token-hadamard")
KERNELS = ("torch16", "product", "fold")
RATIOS = KERNELS[1:]  # the kernels held against float16 torch


def errors(q: torch.Tensor, store: PackedStore, scaling: float | None, row_keys: bool = True) -> dict[str, float]:
    """Max abs error of each of ``KERNELS`` against float64 attention over ``store`` for float16 ``q``
    ``(B, H_q, 1, D)``, and the largest output magnitude (``scale``). ``row_keys``: the product kernel's."""
    truth = decode_attention_reference(q.double(), store, scaling, dtype=torch.float64)
    outs = {
        "torch16": decode_attention_reference(q, store, scaling, dtype=torch.float16),
        "product": triton_decode.decode_attention_triton(q, store, scaling, row_keys=row_keys),
        "fold": triton_fold.decode_attention_fold(q, store, scaling),
    }
    r = {k: float((o.double() - truth).abs().max()) for k, o in outs.items()}
    return {**r, "scale": float(truth.abs().max())}


def half_tail(store: PackedStore) -> PackedStore:
    """``store`` with its full-precision tail (sinks, residual window) in float16, as a float16 model's cache holds
    it: the float32 model here leaves it float32, which every kernel rounds to float16 for its dots and float64
    attention would not (on SmolLM2's KIVI-2 cache that mismatch alone put both kernels at 2.2x float16 torch's
    error at one layer)."""
    if store.key_full is None:
        return store
    return dataclasses.replace(store, key_full=store.key_full.half(), value_full=store.value_full.half())


@torch.no_grad()
def run_scheme(model, ids: torch.Tensor, prompt: int, steps: int, name: str, row_keys: bool = True) -> list[dict]:
    """Prefill ``ids[:, :prompt]``, then ``steps`` fused decode steps; one row per layer (worst over steps)."""
    scheme = get_scheme(name)
    cache = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=True)
    worst: dict[int, dict[str, float]] = {}
    calls = [0]

    def record(layer: int, query: torch.Tensor, store: PackedStore, scaling: float | None) -> None:
        calls[0] += 1
        reason = triton_fold.fold_supported(store, query.half())
        if reason:
            raise ValueError(f"{name}: the folded kernel cannot read this store: {reason}")
        e = errors(query.half(), half_tail(store), scaling, row_keys)
        w = worst.setdefault(layer, {**dict.fromkeys(e, 0.0), **{f"{k}_step": 0.0 for k in RATIOS}})
        for k, v in e.items():
            w[k] = max(w[k], v)
        for k in RATIOS:  # this step's ratio: both errors over the very same query and store
            w[f"{k}_step"] = max(w[f"{k}_step"], e[k] / max(e["torch16"], 1e-30))

    n_layers = model.config.num_hidden_layers
    with observe_fused_decode(model, record):
        model(ids[:, :prompt], **cache_kwargs(cache, model), use_cache=True)
        for i in range(steps):
            model(ids[:, prompt + i : prompt + i + 1], **cache_kwargs(cache, model), use_cache=True)
    if calls[0] != n_layers * steps:
        raise RuntimeError(f"{name}: {calls[0]} fused layer steps, expected {n_layers} layers x {steps} steps")
    rows = []
    for layer, w in sorted(worst.items()):
        row = {"scheme": scheme.name, "layer": layer, "out_max": w["scale"]}
        for k in KERNELS:
            row[f"{k}_rel"] = w[k] / w["scale"]
        for k in RATIOS:
            row[f"{k}_ratio"] = w[k] / max(w["torch16"], 1e-30)
            row[f"{k}_step_ratio"] = w[f"{k}_step"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--data", default="wikitext2")
    p.add_argument("--context", type=int, default=2048, help="prefill tokens")
    p.add_argument("--steps", type=int, default=2, help="decode steps after the prefill (each layer's worst kept)")
    p.add_argument("--scheme", action="append", help=f"repeatable (default: {', '.join(SCHEMES)})")
    p.add_argument("--out", default=None, help="JSON file for the table")
    p.add_argument("--rounded-keys", action="store_true",
                   help="the product kernel dequantizes per-token keys and rounds them to float16 (row_keys=False), "
                   "as before session 43, instead of taking their codes into the dots")  # fmt: skip
    args = p.parse_args(argv)

    t0, rev = time.time(), commit()
    lm = load_model(args.model)
    # raw slices without a BOS (kvbits eval --bos never); the models measured here (SmolLM2, Qwen2.5) add none
    ids = make_windows(tokenize(load_text(args.data), lm.tokenizer), args.context + args.steps, 1)
    out = []
    for name in args.scheme or SCHEMES:
        rows = run_scheme(lm.model, ids, args.context, args.steps, name, row_keys=not args.rounded_keys)
        out += rows
        worst = {k: max(r[f"{k}_ratio"] for r in rows) for k in RATIOS}
        at = {k: max(rows, key=lambda r, k=k: r[f"{k}_ratio"])["layer"] for k in worst}
        step = {k: max(r[f"{k}_step_ratio"] for r in rows) for k in RATIOS}
        print(f"{rows[0]['scheme'][:24]:24s} worst ratio to float16 torch: product {worst['product']:.2f} "
              f"(layer {at['product']}), fold {worst['fold']:.2f} (layer {at['fold']}); at one step: product "
              f"{step['product']:.2f}, fold {step['fold']:.2f}; "
              f"output magnitude {min(r['out_max'] for r in rows):.3g} .. {max(r['out_max'] for r in rows):.3g}",
              flush=True)  # fmt: skip
    seconds = round(time.time() - t0, 1)
    print(f"{len(out)} layer rows in {seconds} s")
    if args.out:
        meta = {"model": args.model, "data": args.data, "context": args.context, "steps": args.steps,
                "product_row_keys": not args.rounded_keys,
                "seconds": seconds, "date": time.strftime("%Y-%m-%d"), "commit": rev, "host": host()}  # fmt: skip
        Path(args.out).write_text(json.dumps({**meta, "rows": out}, indent=1) + "\n")
    bad = [r for r in out if not r["fold_step_ratio"] <= 2]  # NaN included
    for r in bad:
        print(f"ABOVE 2x: {r['scheme']} layer {r['layer']}: fold {r['fold_step_ratio']:.2f}x float16 torch's error "
              "at one step")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
