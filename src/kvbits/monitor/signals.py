"""Online signals of a quantized cache, computed when a block is flushed (quantized).

The one exact error a cache can know while serving: when the oldest ``block`` tokens of the residual
window are quantized, their full-precision values are still at hand. ``flush_error`` compares them with
what the store will return, per sequence of the batch. That is the error the rest of the request will
attend over for those tokens (keys before RoPE for pre-RoPE specs, as they are stored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["ERROR_BUCKETS", "SideSignals", "flush_error", "worst_index"]

# upper bounds of the relative-error histogram (Prometheus ``le``; +Inf is added on export)
ERROR_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def flush_error(x: torch.Tensor, x_hat: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Relative Frobenius error ``||x - x_hat|| / ||x||`` per sequence: ``x``, ``x_hat`` ``(B, H, n, D)`` ->
    ``(B,)`` float32. With ``block`` (dividing ``n``): each sequence's worst block of ``block`` tokens, so a
    chunk of many blocks (a prefill's flush) reads as its blocks read one at a time (decode's flushes).

    A block of zeros reads 0 when reproduced exactly and ``inf`` otherwise; NaN anywhere gives NaN, and so does
    an infinite value in ``x`` (its relative error is undefined): the monitor reports it as a signal over every
    threshold, never as a small error. Each block is scaled by its largest ``|x|`` first, so values whose squares
    overflow float32 (``|x|`` past about 1.8e19) read their true error, not ``inf / inf``.
    """
    if x.shape != x_hat.shape or x.dim() != 4:
        raise ValueError(
            f"x and x_hat must have the same (B, H, n, D) shape, got {tuple(x.shape)} and {tuple(x_hat.shape)}"
        )
    B, H, n, D = x.shape
    nb = n // block if block is not None and 0 < block < n and n % block == 0 else 1
    xf = x.float().reshape(B, H, nb, n // nb, D)
    scale = xf.abs().amax(dim=(1, 3, 4), keepdim=True)  # (B, 1, blocks, 1, 1): the ratio does not change
    scale = torch.where((scale > 0) & scale.isfinite(), scale, torch.ones_like(scale))
    xs = xf / scale
    err = (xs - x_hat.float().reshape(xf.shape) / scale).pow(2).sum(dim=(1, 3, 4))  # (B, blocks)
    ref = xs.pow(2).sum(dim=(1, 3, 4))
    rel = (err / ref).sqrt()
    zero_ref = torch.where(err > 0, torch.full_like(err, math.inf), torch.zeros_like(err))
    out = torch.where(ref > 0, rel, zero_ref)
    # NaN in either, or inf / inf (an infinite x): not a number, which nan_to_num below would read as 0
    nan = (err.isnan() | ref.isnan() | out.isnan()).any(dim=1)
    return torch.where(nan, torch.full_like(nan, math.nan, dtype=out.dtype), out.nan_to_num(nan=0.0, posinf=math.inf).amax(dim=1))


def _severity(e: float) -> float:
    return math.inf if math.isnan(e) else e


def worst_index(errors: list[float]) -> int:
    """Index of the largest error (a NaN counts as the largest)."""
    return max(range(len(errors)), key=lambda b: _severity(errors[b]))


@dataclass
class SideSignals:
    """What one side (keys or values) of one layer flushed so far.

    Attributes:
        flushes: flushes measured (the slices of one long flush count once).
        tokens: tokens in them.
        last: the worst sequence's relative error in the last measured chunk.
        worst: the largest relative error measured (NaN and ``inf`` included: they read as the worst).
        total: sum of the finite per-sequence errors (for the histogram's ``_sum``).
        count: finite per-sequence errors measured (the histogram's ``_count``).
        buckets: finite per-sequence errors at most each ``ERROR_BUCKETS`` bound (cumulative, as Prometheus wants).
        nonfinite: per-sequence errors that were NaN or ``inf``, kept out of the histogram (one NaN in ``total``
            would leave its ``_sum``, and every mean read from it, NaN for the rest of the request).
        clipped: values saturated against static scales (calibration mismatch).
        elements: values quantized (``clipped`` is a fraction of these).
        over: consecutive measured chunks over the policy's threshold (its ``patience``).
    """

    flushes: int = 0
    tokens: int = 0
    last: float = 0.0
    worst: float = 0.0
    total: float = 0.0
    count: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * len(ERROR_BUCKETS))
    nonfinite: int = 0
    clipped: int = 0
    elements: int = 0
    over: int = 0
    _flush_errors: list[float] = field(default_factory=list, repr=False)  # per sequence: the last flush's entries

    def add(self, errors: list[float], tokens: int, clipped: int, elements: int, same_flush: bool = False) -> None:
        """Record one chunk: per-sequence ``errors``, its ``tokens``, ``clipped`` of ``elements`` values;
        ``same_flush``: a further slice of the flush recorded last (a long prefill is quantized in slices), which
        adds no flush and leaves ``last`` the worst of its slices; the histogram keeps one entry per sequence and
        flush (its worst slice), as a flush quantized at once reads each sequence at its worst block."""
        self.flushes += 0 if same_flush else 1
        self.tokens += tokens
        self.clipped += clipped
        self.elements += elements
        worst = errors[worst_index(errors)]
        self.last = worst if not same_flush or _severity(worst) > _severity(self.last) else self.last
        if _severity(worst) > _severity(self.worst):
            self.worst = worst
        if same_flush and len(self._flush_errors) == len(errors):
            # one entry per sequence and flush: a sequence's later slice replaces its entry when it is worse
            for b, (old, new) in enumerate(zip(self._flush_errors, errors, strict=True)):
                if _severity(new) > _severity(old):
                    self._histogram(old, -1)
                    self._histogram(new, 1)
                    self._flush_errors[b] = new
            return
        self._flush_errors = list(errors)
        for e in errors:
            self._histogram(e, 1)

    def _histogram(self, e: float, n: int) -> None:
        """Add (``n=1``) or take back (``n=-1``) one per-sequence error in the histogram (or ``nonfinite``)."""
        if not math.isfinite(e):
            self.nonfinite += n
            return
        self.count += n
        self.total += n * e
        for i, bound in enumerate(ERROR_BUCKETS):
            if e <= bound:
                self.buckets[i] += n
