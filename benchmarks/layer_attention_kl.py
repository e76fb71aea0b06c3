"""What quantized keys do to one layer's attention, with the model's own queries (BENCHMARKS.md §23, §24).

Runs the model once over the evaluation window (``make_windows``, the first of ``kvbits eval --windows 1``),
records the post-RoPE queries and keys that the chosen layers hand to attention (a registered transformers
attention function that then calls SDPA), and for each scheme replaces the keys by what the scheme stores
(``kvbits.quant.quantize`` over the whole window: the cache's codes for per-token schemes; per-channel blocks
are taken from token 0, no residual window). For every ``--stride``-th query from position 256 it compares
the attention distribution over the keys the query sees (values are not involved):

- ``kl``: KL(exact || quantized) in nats, mean over query heads and sampled queries;
- ``logit_rms``: RMS over the visible keys of the logit error after removing its mean over those keys (a
  shift shared by every key cancels in the softmax), mean over heads and queries;
- ``logit_slope``: the least-squares slope of the quantized logits on the exact ones over the visible keys (both
  centred on their mean over those keys), mean over heads and queries: below 1 the quantized keys compress a
  query's logits (a flatter attention, as from a higher temperature), above 1 they stretch them;
- ``entropy`` exact and quantized (nats), and ``argmax_agree``: the fraction of (head, query) whose most
  attended key is the same.

Example::

    PYTHONPATH=src python benchmarks/layer_attention_kl.py --model qwen2.5-coder-0.5b --data wikitext2 \\
        --context 4096 --layers 0 1 12 --out benchmarks/results/layer-attention-kl-qwen-wiki-4k.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbits.cache.compat import cache_kwargs
from kvbits.evaluate.data import load_text, make_windows, tokenize
from kvbits.evaluate.metrics import exact_log_softmax, kl_divergence
from kvbits.evaluate.models import load_model
from kvbits.quant import quantize
from kvbits.schemes import get_scheme

SCHEMES = (
    "vllm-int4", "int4-token-hadamard", "benchmarks/schemes/int4-token-intzero.json", "int4-token",
    "int8-token-hadamard", "int4-channel",
)  # fmt: skip


def attention_logprobs(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64 log-probabilities ``(H, S, T)`` (of the float32 logits, ``exact_log_softmax``: a small KL is lost
    to float32 rounding) of queries ``q`` ``(H, T, D)`` at positions ``rows`` ``(S,)`` over the causal prefix of
    keys ``k`` ``(H_kv, T, D)`` (``-inf`` past each query); query head ``h`` reads KV head ``h // (H / H_kv)``."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    logits = (q[:, rows] @ k.transpose(-1, -2)) * scaling
    visible = torch.arange(k.shape[1])[None, :] <= rows[:, None]
    return exact_log_softmax(logits.masked_fill(~visible, -math.inf)), logits, visible


def compare(q: torch.Tensor, k: torch.Tensor, kq: torch.Tensor, rows: torch.Tensor, scaling: float) -> dict:
    """The figures of the module docstring for exact keys ``k`` against quantized ``kq`` (both ``(H_kv, T, D)``)."""
    p0, l0, visible = attention_logprobs(q, k, rows, scaling)
    p1, l1, _ = attention_logprobs(q, kq, rows, scaling)
    kl = kl_divergence(p0, p1)  # masked keys: probability 0 in both, no term
    n = visible.sum(-1)

    def centre(x: torch.Tensor) -> torch.Tensor:  # x less its mean over the keys each query sees; 0 elsewhere
        x = x.masked_fill(~visible, 0)
        return (x - x.sum(-1, keepdim=True) / n[:, None]).masked_fill(~visible, 0)

    centred = centre(l1 - l0)
    c0, c1 = centre(l0), centre(l1)
    slope = (c0 * c1).sum(-1) / c0.pow(2).sum(-1).clamp_min(1e-30)
    entropy = [-(p.exp() * p).masked_fill(~visible, 0).sum(-1).mean().item() for p in (p0, p1)]
    return {
        "kl": kl.mean().item(), "logit_rms": (centred.pow(2).sum(-1) / n).sqrt().mean().item(),
        "logit_slope": slope.mean().item(),
        "entropy_exact": entropy[0], "entropy_quantized": entropy[1],
        "argmax_agree": (p0.argmax(-1) == p1.argmax(-1)).float().mean().item(),
    }  # fmt: skip


@torch.no_grad()
def record_attention(model, ids: torch.Tensor, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """One forward of ``ids`` ``(1, T)``; for each of ``layers``: its post-RoPE queries ``(H, T, D)``, keys
    ``(H_kv, T, D)`` (float32) and softmax scaling, as handed to attention (which then runs as SDPA)."""
    taps: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def tap(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module.layer_idx in layers:
            taps[module.layer_idx] = (query[0].float(), key[0].float(), scaling or query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("kvbits_layer_tap", tap)
    before = model.config._attn_implementation
    model.set_attn_implementation("kvbits_layer_tap")
    try:
        model(ids, **cache_kwargs(DynamicCache(config=model.config), model), use_cache=True)
    finally:
        model.set_attn_implementation(before)
    missing = sorted(set(layers) - set(taps))
    if missing:
        raise ValueError(f"layers {missing} were not seen (the model has {model.config.num_hidden_layers})")
    return taps


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--data", default="wikitext2")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 12])
    p.add_argument("--scheme", action="append", help=f"repeatable (default: {', '.join(SCHEMES)})")
    p.add_argument("--stride", type=int, default=97, help="query positions sampled: 256, 256+stride, ...")
    p.add_argument("--out", default=None, help="JSON file for the table")
    args = p.parse_args(argv)

    lm = load_model(args.model)
    ids = make_windows(tokenize(load_text(args.data), lm.tokenizer), args.context, 1)
    taps = record_attention(lm.model, ids, args.layers)
    rows = torch.arange(256, ids.shape[1], args.stride)
    out = []
    for name in args.scheme or SCHEMES:
        spec = get_scheme(name).key
        for layer in args.layers:
            q, k, scaling = taps[layer]
            kq = quantize(k[None], spec).dequantize(torch.float32)[0]
            r = {"scheme": get_scheme(name).name, "layer": layer, **compare(q, k, kq, rows, scaling)}
            out.append(r)
            print(
                f"{r['scheme'][:28]:28s} layer {layer:2d}  KL {r['kl']:8.3f}  logit error {r['logit_rms']:7.2f}  "
                f"slope {r['logit_slope']:.4f}  "
                f"entropy {r['entropy_exact']:.2f} -> {r['entropy_quantized']:.2f}  argmax agree {r['argmax_agree']:.2f}"
            )
    if args.out:
        meta = {"model": args.model, "data": args.data, "context": args.context, "queries": len(rows)}
        Path(args.out).write_text(json.dumps({**meta, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
