"""Bit packing of integer codes into ``uint8`` along the last dimension.

A row of ``n`` codes of ``b`` bits takes exactly ``ceil(n * b / 8)`` bytes: 2- and 4-bit codes share
bytes, 3-bit codes are packed densely (8 codes in 3 bytes; only the final partial word is padded),
8-bit codes are one byte each. Code ``i`` of a word occupies bits ``[b*i, b*(i+1))``, little-endian.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    return math.ceil(n * bits / 8)


def check_bits(bits: int) -> None:
    """``ValueError`` unless ``bits`` is a code width kvbits stores (``SUPPORTED_BITS``)."""
    # bool and float are refused by type: 2.0 == 2 would pass the membership test
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int, *, check_range: bool = True) -> torch.Tensor:
    """Pack codes ``(..., n)`` (integer dtype, values in ``[0, 2**bits)``) into ``(..., ceil(n*bits/8))`` uint8.

    ``check_range``: ``ValueError`` for codes outside ``[0, 2**bits)``, which would otherwise spill into
    their neighbours' bits (one host sync to read the extremes). ``quantize`` passes ``False``: its codes
    are clamped to the range already.
    """
    check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:  # codes are packed along the last dim: a scalar has none (IndexError before)
        raise ValueError("codes must have at least 1 dim (..., n), got a 0-dim tensor")
    if check_range and codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= 1 << bits:
            raise ValueError(f"{bits}-bit codes must be in [0, {(1 << bits) - 1}], got values in [{lo}, {hi}]")
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        return _pack_bytewise(codes, bits, n)
    lead = codes.shape[:-1]
    n_words = math.ceil(n / 8)
    c = codes.to(torch.int32)
    if n_words * 8 != n:
        c = torch.nn.functional.pad(c, (0, n_words * 8 - n))
    c = c.reshape(*lead, n_words, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(dim=-1, dtype=torch.int64)  # (..., n_words), at most 32 bits used
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)  # (..., n_words, bits)
    out = out.reshape(*lead, n_words * bits)
    return out[..., : packed_size(n, bits)].contiguous()


def _pack_bytewise(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``pack_bits`` for widths that divide 8 (2, 4): byte ``j`` gets codes ``j * 8 / bits + k`` at bit ``k * bits``,
    the bytes of the general path's little-endian 32-bit words (``_unpack_bytewise`` reads them back). In uint8
    with shifts by Python ints: no 32/64-bit copies of the codes, no shift tables built per call (a one-token
    flush of int4 took 14 kernels here, now 5)."""
    per = 8 // bits
    c = codes.to(torch.uint8)
    if n % per:  # the last byte's high codes are 0, as the general path's padded word
        c = torch.nn.functional.pad(c, (0, per - n % per))
    c = c.reshape(*codes.shape[:-1], c.shape[-1] // per, per)
    out = c[..., 0]
    for k in range(1, per):
        out = out | (c[..., k] << (k * bits))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``(..., ceil(n*bits/8))`` uint8 → codes ``(..., n)`` uint8."""
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least 1 dim (..., bytes), got a 0-dim tensor")
    if n < 0:  # (no isinstance check: n may be a symbolic int under torch.compile)
        raise ValueError(f"n (codes per row) must be >= 0, got {n!r}")
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(f"expected {packed_size(n, bits)} packed bytes for {n} {bits}-bit codes, got {packed.shape[-1]}")
    if bits == 8:
        return packed
    if 8 % bits == 0:
        return _unpack_bytewise(packed, bits, n)
    lead = packed.shape[:-1]
    n_words = math.ceil(n / 8)
    p = packed.to(torch.int64)
    full = n_words * bits
    if p.shape[-1] != full:
        p = torch.nn.functional.pad(p, (0, full - p.shape[-1]))
    p = p.reshape(*lead, n_words, bits)
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    word = (p << byte_shifts).sum(dim=-1)  # (..., n_words)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., n_words, 8)
    return codes.reshape(*lead, n_words * 8)[..., :n].to(torch.uint8)


def _unpack_bytewise(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``unpack_bits`` for widths that divide 8 (2, 4): byte ``j`` holds codes ``j * 8 / bits + k`` at bit
    ``k * bits`` (the little-endian words of ``pack_bits`` cut at byte boundaries), so the codes come out of
    uint8 shifts and masks, without widening the history to 64-bit words (the general path). Each shift is by
    a Python int: a shift by a broadcast tensor of amounts is not vectorised on CPU (2.3-2.6x slower)."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [packed & mask] + [(packed >> (k * bits)) & mask for k in range(1, per)]
    codes = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)
    return codes if codes.shape[-1] == n else codes[..., :n].contiguous()
