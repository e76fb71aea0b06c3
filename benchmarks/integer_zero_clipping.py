"""How much an integer zero-point clips on a real model's K/V (BENCHMARKS.md §23).

vLLM's ``int4_per_token_head`` (kvbits' ``vllm-int4``) stores each token and KV head as INT4 codes with a
zero-point that is itself a code, ``z = round(-min / scale)`` clamped to ``[0, 15]``: a row whose values
all share a sign gets ``z`` clamped and loses what lies past 15 steps from 0. This runs the model once over
the evaluation window (``make_windows``, the first of ``kvbits eval --windows 1``), takes every layer's
cached K (post-RoPE) and V, and quantizes them with each spec (``kvbits.quant.quantize``, what the cache
stores): per side, the clipped fraction of elements, the fraction of (token, head) rows whose range
excludes 0 (in the basis the codes are taken in: rotated for ``vllm-int4``), the layers that clip most,
the relative squared error ``sum (x' - x)**2 / sum x**2`` over all layers, and per layer the systematic
part of the error: the RMS over (head, channel) of the error averaged over the tokens, over the RMS error
(about ``1 / sqrt(T)`` for errors independent from token to token; near 1 for an error every token shares).

Example::

    PYTHONPATH=src python benchmarks/integer_zero_clipping.py --model qwen2.5-coder-0.5b --data wikitext2 \\
        --context 4096 --out benchmarks/results/integer-zero-clipping-qwen.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from kvbits.cache.compat import cache_kwargs
from kvbits.evaluate.data import load_text, make_windows, tokenize
from kvbits.evaluate.models import load_model
from kvbits.quant import quantize
from kvbits.quant.rotate import rotate
from kvbits.schemes import get_scheme

SCHEMES = ("vllm-int4", "benchmarks/schemes/int4-token-intzero.json", "int4-token-hadamard", "int4-token")


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="war-and-peace")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--out", default=None, help="JSON file for the table")
    args = p.parse_args(argv)

    lm = load_model(args.model)
    # raw slices without a BOS (kvbits eval --bos never); the models measured here (SmolLM2, Qwen2.5) add none
    ids = make_windows(tokenize(load_text(args.data), lm.tokenizer), args.context, 1)
    cache = DynamicCache(config=lm.model.config)
    lm.model(ids, **cache_kwargs(cache, lm.model), use_cache=True)
    rows = []
    for name in SCHEMES:
        scheme = get_scheme(name)
        for side in ("key", "value"):
            spec = getattr(scheme, side)
            clipped = elements = one_signed = n_rows = 0
            err2 = norm2 = 0.0
            per_layer, systematic = [], []
            for i, layer in enumerate(cache.layers):
                x = (layer.keys if side == "key" else layer.values).float()  # (1, H_kv, T, D)
                qt = quantize(x, spec)
                c = int(qt.clipped)
                clipped, elements = clipped + c, elements + x.numel()
                e = qt.dequantize(torch.float32) - x
                err2, norm2 = err2 + e.pow(2).sum().item(), norm2 + x.pow(2).sum().item()
                systematic.append(round((e.mean(2).pow(2).mean().sqrt() / e.pow(2).mean().sqrt()).item(), 4))
                coded = rotate(x, spec.rotate) if spec.rotate else x
                lo, hi = coded.amin(-1), coded.amax(-1)
                one_signed += int(((lo > 0) | (hi < 0)).sum())
                n_rows += lo.numel()
                per_layer.append((c / x.numel(), i))
            worst = sorted(per_layer, reverse=True)[:3]
            rows.append({
                "scheme": scheme.name, "side": side, "clipped_frac": clipped / elements,
                "one_signed_rows_frac": one_signed / n_rows,
                "worst_layers": [{"layer": i, "clipped_frac": f} for f, i in worst if f > 0],
                "relative_squared_error": err2 / norm2, "systematic_error_by_layer": systematic,
            })  # fmt: skip
            r = rows[-1]
            print(
                f"{r['scheme']:22s} {side:5s} clipped {100 * r['clipped_frac']:8.4f} %  rows excluding 0 "
                f"{100 * r['one_signed_rows_frac']:7.3f} %  rel. sq. error {r['relative_squared_error']:.4f}  "
                f"systematic (layers 0-2) {systematic[:3]}  worst layers "
                + ", ".join(f"{w['layer']}: {100 * w['clipped_frac']:.3f} %" for w in r["worst_layers"])
            )
    if args.out:
        out = {"model": args.model, "data": args.data, "context": args.context, "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
