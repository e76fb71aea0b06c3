"""The lower end of float16 scales: relative and absolute error of quantize -> dequantize on Gaussian blocks
scaled down from |x| ~ 1 to 1e-9 (BENCHMARKS.md §22).

    PYTHONPATH=src python benchmarks/scale_floor.py
"""

from __future__ import annotations

import torch

from kvbits.quant import quantize
from kvbits.schemes import get_scheme

SCHEMES = (("int8-token", "key"), ("int4-token", "key"), ("kivi-4", "key"), ("kivi-4", "value"))
SCALES = (1.0, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9)


def main() -> None:
    x0 = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(0))  # (B, H_kv, T, D)
    print("| scheme | side | " + " | ".join(f"{m:g}" for m in SCALES) + " |")
    print("|---|---|" + "---:|" * len(SCALES))
    for name, side in SCHEMES:
        spec = getattr(get_scheme(name), side)
        cells = []
        for m in SCALES:
            x = x0 * m
            y = quantize(x, spec).dequantize().float()
            rel = float((y - x).norm() / x.norm())
            cells.append(f"{100 * rel:.1f} % / {float((y - x).abs().max()):.1e}")
        print(f"| {name} | {side} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
