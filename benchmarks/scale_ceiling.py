"""The upper end of float16 scales: K/V near float16's largest value through `QuantizedKVCache` (BENCHMARKS §22b).

    PYTHONPATH=src python benchmarks/scale_ceiling.py   # seconds on a CPU

For each preset that needs no calibration: a float16 block (batch 2, 2 KV heads, 300 tokens, head dim 128, Gaussian
rescaled so its largest |x| is a fraction of the side's input bound, ``kvbits.cache.checks.input_bound``) is stored,
40 single-token decode steps follow, and the values the cache returns (each update's and ``materialize``) are
counted where they are not finite. The bound is what the cache accepts; nothing accepted may come back as inf.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from transformers import LlamaConfig

from kvbits.cache import QuantizedKVCache
from kvbits.cache.checks import input_bound
from kvbits.schemes.presets import list_schemes

FRACTIONS = (0.99, 0.999, 0.9995, 1.0)


def nonfinite(scheme: str, frac: float, cfg: LlamaConfig, D: int) -> int | str:
    """Non-finite values the cache returns for K/V at ``frac`` of the scheme's input bounds (or the error)."""
    s = QuantizedKVCache(cfg, scheme).scheme
    torch.manual_seed(0)
    x = torch.randn(2, 2, 300, D)
    x = x / x.abs().amax(dim=(2, 3), keepdim=True)
    k = (x * input_bound(s.key, head_dim=D)[0] * frac).half()
    v = (x * input_bound(s.value, head_dim=D)[0] * frac).half()
    cache = QuantizedKVCache(cfg, scheme)
    try:
        bad = 0
        for i, (kk, vv) in enumerate([(k, v)] + [(k[:, :, j : j + 1], v[:, :, j : j + 1]) for j in range(40)]):
            K, V = cache.update(kk, vv, 0, {"cache_position": torch.arange(300) if i == 0 else torch.tensor([299 + i])})
            bad += int((~torch.isfinite(K)).sum() + (~torch.isfinite(V)).sum())
        mk, mv = cache.materialize(0)
        return bad + int((~torch.isfinite(mk)).sum() + (~torch.isfinite(mv)).sum())
    except ValueError as exc:
        return f"refused: {str(exc)[:60]}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    D = 128
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=64)  # fmt: skip
    print("| scheme | " + " | ".join(f"{f:g} of the bound" for f in FRACTIONS) + " |")
    print("|---|" + "---:|" * len(FRACTIONS))
    for s in list_schemes():
        if s.name in ("fp16", "bf16") or s.needs_calibration():
            continue
        print(f"| {s.name} | " + " | ".join(str(nonfinite(s.name, f, cfg, D)) for f in FRACTIONS) + " |")


if __name__ == "__main__":
    main()
