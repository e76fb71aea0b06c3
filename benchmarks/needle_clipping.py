"""Where along passkey trials calibrated static key ranges clip (BENCHMARKS.md §17h).

For each trial of ``kvbits needle`` (the same trials: ``build_trials`` with the seed, context, depth and
index), the model's pre-RoPE keys (``k_proj`` outputs, Llama-style attention) are compared with each
calibration's per-channel key ranges (``key_scale`` / ``key_zero``): the fraction of elements outside
the range (``|u| > 1``, what ``kvbits.quant.nuq.quantize_nuq`` clips), over every layer and KV head, per
span of the trial: the first token (a sink in full precision for kvquant-4), the haystack before the
needle, the needle, the haystack after it (question and key excluded). Each token's largest
``outlier_frac`` of elements is left out, as the dense-and-sparse outliers keep them exactly.

Example::

    PYTHONPATH=src python benchmarks/needle_clipping.py --calibration runs/calib-smollm2-kvq4 \\
        --depth 0 --depth 0.5 --trials 4 --out benchmarks/results/needle-clipping-smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvbits.calibrate import load_calibration
from kvbits.evaluate.data import load_text, tokenize
from kvbits.evaluate.models import load_model
from kvbits.evaluate.needle import build_trials
from kvbits.schemes.accounting import outlier_count


def spans(needle_at: int, needle_len: int, doc_len: int) -> dict[str, tuple[int, int]]:
    """Token ranges ``[lo, hi)`` of a trial's parts; the first token is its own span (a sink)."""
    a, b = max(needle_at, 1), needle_at + needle_len
    out = {"first token": (0, 1), "before the needle": (1, a), "needle": (a, b),
           "after the needle": (b, doc_len)}  # fmt: skip
    return {k: v for k, v in out.items() if v[1] > v[0]}


def clipped_fraction(
    keys: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, outlier_frac: float
) -> tuple[int, int]:
    """(clipped, counted) of ``keys`` ``(T, H, D)`` against ranges ``(H, D)``; the outliers ``quantize``
    keeps exactly (``outlier_count(D, outlier_frac)`` per token and head, farthest from the range's centre)
    left out."""
    half = (scale / 2).clamp_min(torch.finfo(torch.float32).tiny)
    u = (keys - (zero + scale / 2)).abs() / half  # (T, H, D)
    keep = torch.ones_like(u, dtype=torch.bool)
    n_out = outlier_count(u.shape[-1], outlier_frac)
    if n_out:
        keep.scatter_(-1, u.topk(n_out, dim=-1).indices, False)
    return int(((u > 1.0 + 1e-6) & keep).sum()), int(keep.sum())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", action="append", required=True, help="kvbits calibrate folder (repeatable)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="war-and-peace")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--depth", type=float, action="append", required=True)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the table")
    args = p.parse_args(argv)

    lm = load_model(args.model)
    cfg = lm.model.config
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    arts = {c: load_calibration(c, model_config=cfg, fingerprint=lm.fingerprint) for c in args.calibration}
    captured: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def keep(module, inputs, out):
            captured[i] = out[0].view(-1, H, D).float()  # (T, H_kv, D), before RoPE

        return keep

    layers = lm.model.model.layers
    for i, layer in enumerate(layers):
        layer.self_attn.k_proj.register_forward_hook(hook(i))
    ids = tokenize(load_text(args.data), lm.tokenizer)
    rows = []
    for depth in args.depth:
        for t in build_trials(lm.tokenizer, ids, [args.context], [depth], args.trials, seed=args.seed):
            with torch.no_grad():
                lm.model(t.ids[None, : t.doc_len])
            for path, art in arts.items():
                frac = art.scheme.key.outlier_frac or 0.0
                row = {"calibration": path, "scheme": art.scheme.name, "depth": depth, "index": t.index,
                       "key": t.key, "needle_at": t.needle_at, "spans": {}}  # fmt: skip
                for name, (lo, hi) in spans(t.needle_at, t.needle_len, t.doc_len).items():
                    c = n = 0
                    for i in range(len(layers)):
                        scale, zero = (art.tensors[f"layers.{i}.key_{x}"].float() for x in ("scale", "zero"))
                        ci, ni = clipped_fraction(captured[i][lo:hi], scale, zero, frac)
                        c, n = c + ci, n + ni
                    row["spans"][name] = {"tokens": hi - lo, "clipped": c, "elements": n, "fraction": c / n}
                rows.append(row)
                said = "  ".join(f"{k} {100 * v['fraction']:.3f}%" for k, v in row["spans"].items())
                print(f"depth {depth:4.2f} trial {t.index} ({art.scheme.name}, {Path(path).name}): {said}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "data": args.data, "context": args.context,
                                              "seed": args.seed, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
