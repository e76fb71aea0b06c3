"""Time the torch dequantization of one cache layer side, before and after session 17's changes.

    PYTHONPATH=src python benchmarks/dequant_speed.py [--tokens 4096] [--batch 1] [--scheme kivi-4]

One SmolLM2-shaped layer side (batch x 3 KV heads x tokens x 64 channels) quantized by the scheme's key and
value specs; medians of 30 calls on one thread:

- unpacking 2/4-bit codes: the former path (every byte widened to int64 words, the path 3-bit codes still
  take) against ``kvbits.quant.pack.unpack_bits`` (uint8 shifts by Python ints, then a stack);
- the affine step: ``q * scale + zero`` out of place against ``dequantize_affine`` (in place on the
  float32 copy of the codes);
- the whole history as ``KVStore.materialize`` builds it (the side plus a 100-token float buffer): decoded
  apart then concatenated (sessions 17 and before) against decoded straight into one preallocated tensor
  (``QuantizedTensor.dequantize(out=)``, session 18).

Every pair is checked equal bit for bit before it is timed. BENCHMARKS.md §18c, §18e.
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def _median_ms(fn, reps: int = 30) -> tuple[float, torch.Tensor]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[reps // 2], out


def _word_unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The former ``unpack_bits`` for every width: bytes widened to int64 words, codes shifted out of them."""
    lead, n_words = packed.shape[:-1], math.ceil(n / 8)
    p = packed.to(torch.int64)
    if p.shape[-1] != n_words * bits:
        p = torch.nn.functional.pad(p, (0, n_words * bits - p.shape[-1]))
    word = (p.reshape(*lead, n_words, bits) << (torch.arange(bits, dtype=torch.int64) * 8)).sum(dim=-1)
    codes = (word.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, n_words * 8)[..., :n].to(torch.uint8)


def main() -> None:
    from kvbits.quant.affine import dequantize_affine
    from kvbits.quant.pack import unpack_bits
    from kvbits.quant.tensor import _group, quantize
    from kvbits.schemes.presets import get_scheme

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--scheme", default="kivi-4")
    a = p.parse_args()
    torch.set_num_threads(1)
    scheme = get_scheme(a.scheme)
    x = torch.randn(a.batch, 3, a.tokens, 64, generator=torch.Generator().manual_seed(0))
    buffer = torch.randn(a.batch, 3, 100, 64, generator=torch.Generator().manual_seed(1))
    for side in ("key", "value"):
        spec = getattr(scheme, side)
        if spec.kind != "int" or spec.bits not in (2, 4):
            print(f"{side}: {spec.kind} {spec.bits}-bit codes: not a 2/4-bit integer side, skipped")
            continue
        qt = quantize(x, spec)
        old_u, c_old = _median_ms(lambda qt=qt, b=spec.bits: _word_unpack(qt.data, b, 64))
        new_u, c_new = _median_ms(lambda qt=qt, b=spec.bits: unpack_bits(qt.data, b, 64))
        assert torch.equal(c_old, c_new)
        g = _group(c_new, spec)
        old_a, d_old = _median_ms(lambda g=g, qt=qt: g.float() * qt.scale.float() + qt.zero.float())
        new_a, d_new = _median_ms(lambda g=g, qt=qt, b=spec.bits: dequantize_affine(g, qt.scale, qt.zero, b, torch.float32))
        assert torch.equal(d_old, d_new)
        print(f"{side} ({spec.granularity}, {spec.bits}-bit, {tuple(x.shape)}): unpack {old_u:.3f} -> {new_u:.3f} ms, "
              f"affine {old_a:.3f} -> {new_a:.3f} ms, both {old_u + old_a:.3f} -> {new_u + new_a:.3f} ms")  # fmt: skip
        old_h, h_old = _median_ms(lambda qt=qt: torch.cat([qt.dequantize(torch.float32), buffer], dim=2))
        new_h, h_new = _median_ms(lambda qt=qt: _into_one(qt, buffer))
        assert torch.equal(h_old, h_new)
        print(f"    history + {buffer.shape[2]}-token buffer: decode then cat {old_h:.3f} ms -> decoded in place "
              f"{new_h:.3f} ms ({old_h / new_h:.2f}x)")  # fmt: skip


def _into_one(qt, buffer: torch.Tensor) -> torch.Tensor:
    """What ``KVStore.materialize`` does now: one tensor, the codes decoded into their place, the buffer copied."""
    B, H, n, D = qt.shape
    out = torch.empty(B, H, n + buffer.shape[2], D)
    qt.dequantize(torch.float32, out=out[:, :, :n])
    out[:, :, n:].copy_(buffer)
    return out


if __name__ == "__main__":
    main()
