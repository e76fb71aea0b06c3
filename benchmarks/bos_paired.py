"""Paired comparison of a ``kvbits eval --bos never`` run with a ``--bos always`` run of the same text and context.

    PYTHONPATH=src python benchmarks/bos_paired.py benchmarks/results/smollm2-wiki-1k-bos-never \
        benchmarks/results/smollm2-wiki-1k-bos-always [--json OUT]

Needs both folders' per-token arrays (``tokens/<scheme>.safetensors``, written by ``kvbits eval``, not committed).
Without a BOS, window ``w`` is text tokens ``w*C .. w*C + C - 1`` and array column ``i`` scores text token
``w*C + i + 1``; with one, window ``w`` is the BOS then text tokens ``w*(C-1) ..``, and column ``i`` scores text
token ``w*(C-1) + i``. Only text tokens both runs score are compared (paired), bucketed by their position in the
no-BOS window; a 95 % CI of the mean paired difference from a normal approximation over tokens.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

BUCKETS = ((1, 4), (4, 16), (16, 128), (128, 512), (512, 1024))


def _by_text_token(folder: Path, scheme: str, bos: bool) -> dict[str, dict[int, float]]:
    """Per-token arrays of one scheme keyed by text-token index, plus ``pos`` (position of the target in its window)."""
    arrays = load_file(str(folder / "tokens" / f"{scheme}.safetensors"))
    n_win, n_col = arrays["nll"].shape  # (W, C - 1)
    context = n_col + 1
    out: dict[str, dict[int, float]] = {k: {} for k in ("nll", "nll_ref", "kl", "pos")}
    for w in range(n_win):
        for i in range(n_col):
            t = w * (context - 1) + i if bos else w * context + i + 1
            for k in ("nll", "nll_ref", "kl"):
                out[k][t] = float(arrays[k][w, i])
            out["pos"][t] = float(i + 1)
    return out


def _mean_ci(x: torch.Tensor) -> list[float]:
    m = float(x.mean())
    half = 1.96 * float(x.std()) / math.sqrt(x.numel()) if x.numel() > 1 else float("nan")
    return [m, m - half, m + half]


def compare(never: Path, always: Path) -> dict[str, Any]:
    """Paired figures per scheme and position bucket (see the module docstring)."""
    schemes = sorted(p.stem for p in (never / "tokens").glob("*.safetensors"))
    rows: dict[str, Any] = {}
    for s in schemes:
        a, b = _by_text_token(never, s, False), _by_text_token(always, s, True)
        common = sorted(set(a["nll"]) & set(b["nll"]))
        row: dict[str, Any] = {}
        for lo, hi in ((1, 1024),) + BUCKETS:
            ts = [t for t in common if lo <= a["pos"][t] < hi]
            if not ts:
                continue

            def col(d: dict[str, dict[int, float]], k: str, ts: list[int] = ts) -> torch.Tensor:
                return torch.tensor([d[k][t] for t in ts], dtype=torch.float64)

            r_n, r_a = col(a, "nll_ref"), col(b, "nll_ref")
            q_n, q_a = col(a, "nll"), col(b, "nll")
            row[f"{lo}-{hi}"] = {
                "tokens": len(ts),
                "ref_ppl_never": math.exp(float(r_n.mean())),
                "ref_ppl_always": math.exp(float(r_a.mean())),
                "ref_nll_always_minus_never": _mean_ci(r_a - r_n),
                "dppl_never": math.exp(float((q_n - r_n).mean())) - 1,
                "dppl_always": math.exp(float((q_a - r_a).mean())) - 1,
                "kl_never": float(col(a, "kl").mean()),
                "kl_always": float(col(b, "kl").mean()),
                "kl_always_minus_never": _mean_ci(col(b, "kl") - col(a, "kl")),
            }
        rows[s] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("never", type=Path)
    ap.add_argument("always", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    rows = compare(args.never, args.always)
    for s, row in rows.items():
        print(s)
        for b, r in row.items():
            d = r["ref_nll_always_minus_never"]
            k = r["kl_always_minus_never"]
            print(f"  {b:>9} n={r['tokens']:5d} refPPL {r['ref_ppl_never']:8.2f}/{r['ref_ppl_always']:8.2f} "
                  f"dNLLref {d[0]:+.4f} [{d[1]:+.4f},{d[2]:+.4f}]  dPPL {r['dppl_never']:+.2%}/{r['dppl_always']:+.2%} "
                  f"KL {r['kl_never']:.4f}/{r['kl_always']:.4f} dKL {k[0]:+.4f} [{k[1]:+.4f},{k[2]:+.4f}]")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
