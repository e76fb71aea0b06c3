"""Streaming statistics of K or V, one layer at a time, without holding every token.

``ChannelStats`` accumulates, per (KV head, channel), over every token it is shown: the absolute
maximum, and the first four moments (float64 sums of powers, shifted by the first tokens' mean for
numerical stability) from which mean, std and kurtosis follow. Statistics that need the values
themselves (percentiles, per-token ranges, SQNR, plots) are computed on a *sample*: whole blocks of
``block`` consecutive tokens, drawn uniformly from every block seen by reservoir sampling
(``BlockReservoir``, Vitter's algorithm R). One reservoir decides for all layers and tensors, so the
samples of pre-RoPE keys, post-RoPE keys and values hold the same tokens. A window of ``T`` tokens
offers ``ceil(T / block)`` blocks; the last one ends at its last token (overlapping the one before
when ``block`` does not divide ``T``), so every position can enter the sample. When the data has no
more blocks than the sample holds, the sample is all of it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from kvbits.quant.checks import FP16_MAX

SAMPLE_DTYPE = torch.float16  # the sample's storage; its rounding (~1e-3 relative) is far below int4 noise
MOMENT_CHUNK = 2048  # tokens whose float64 powers ChannelStats.update holds at once


@dataclass
class BlockReservoir:
    """Uniform sample of at most ``capacity`` blocks out of a stream of blocks (algorithm R).

    ``offer(n)`` announces ``n`` new blocks and returns which of them enter the sample and where:
    a list of ``(slot, index_in_this_offer)``. The same plan is applied to every layer.
    """

    capacity: int
    seed: int = 0
    seen: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"sample capacity must be >= 1 block, got {self.capacity}")
        self._rng = random.Random(self.seed)

    @property
    def size(self) -> int:
        """Blocks held so far."""
        return min(self.seen, self.capacity)

    def offer(self, n: int) -> list[tuple[int, int]]:
        plan: dict[int, int] = {}
        for i in range(n):
            if self.seen < self.capacity:
                plan[self.seen] = i
            else:
                j = self._rng.randrange(self.seen + 1)
                if j < self.capacity:
                    plan[j] = i  # a later block replacing the same slot wins, as in the serial algorithm
            self.seen += 1
        return sorted(plan.items())


class NonFiniteKV(ValueError):
    """NaN / inf in the K/V a layer produced (``ChannelStats.update``)."""


class KVBeyondFloat16(ValueError):
    """K/V a layer produced beyond float16's range (``ChannelStats.update``): the sample (float16) would hold inf,
    and kvbits' quantizers, whose scales are float16, refuse such K/V (``kvbits.quant.checks.check_kv``)."""


def blocks_in(tokens: int, block: int) -> int:
    """Sample blocks a window of ``tokens`` offers: ``ceil(tokens / block)``, the last ending at its last token."""
    return -(-tokens // block)


@dataclass
class ChannelStats:
    """Per-(head, channel) running statistics of one tensor of one layer, plus its block sample.

    Attributes:
        n_heads, head_dim: ``H_kv`` and ``D``.
        capacity: sample blocks; block: tokens per sample block.
    """

    n_heads: int
    head_dim: int
    capacity: int
    block: int
    label: str = "tensor"  # for messages: "layer 3 value"
    count: int = 0
    absmax: torch.Tensor | None = None
    _shift: torch.Tensor | None = None
    _sums: torch.Tensor | None = None  # (4, H, D) float64: sums of (x - shift)^k, k = 1..4
    sample: torch.Tensor | None = None  # (capacity, H, block, D) SAMPLE_DTYPE
    positions: torch.Tensor | None = None  # (capacity,) first position of each sample block

    def update(self, x: torch.Tensor, plan: list[tuple[int, int]] = ()) -> None:
        """Add ``x`` ``(B, H_kv, T, D)``; ``plan`` (from ``BlockReservoir.offer``) names the blocks to keep.

        Block ``i`` of ``plan`` is ``x[i // n_b, :, t0 : t0 + block]`` with ``n_b = ceil(T / block)`` and
        ``t0 = min((i % n_b) * block, T - block)`` (:func:`blocks_in`). ``ValueError`` for NaN / inf in ``x``:
        they would turn the statistics to NaN, and a NaN median finds no outlier channel; ``KVBeyondFloat16`` (a
        ``ValueError``) for ``|x|`` beyond float16's range: the float16 sample would hold inf.
        """
        B, H, T, D = x.shape
        if (H, D) != (self.n_heads, self.head_dim):
            raise ValueError(f"expected (B, {self.n_heads}, T, {self.head_dim}), got {tuple(x.shape)}")
        xf = x.detach().float()
        amax = xf.abs().amax(dim=(0, 2))
        top = float(amax.max())  # one host sync per layer and window (analysis only); NaN / inf propagate
        if not math.isfinite(top):
            bad = ~torch.isfinite(xf)
            first = int(bad.nonzero()[0, 2])
            raise NonFiniteKV(
                f"{self.label}: {int(bad.sum())} non-finite values (NaN / inf) in the model's K/V, the first at "
                f"position {first}; expected finite activations (a float16 overflow? try --dtype float32 or bfloat16)"
            )
        if top > FP16_MAX:
            first = int((xf.abs() > FP16_MAX).nonzero()[0, 2])
            raise KVBeyondFloat16(
                f"{self.label}: |x| up to {top:.4g} (the first beyond {FP16_MAX:g} at position {first}); expected K/V "
                "within float16's range: kvbits stores quantization scales in float16 and can not quantize these"
            )
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        if self._shift is None:
            self._shift = xf[:, :, :MOMENT_CHUNK].double().mean(dim=(0, 2))  # any value near the mean steadies the sums
            self._sums = torch.zeros(4, H, D, dtype=torch.float64, device=x.device)
        # float64 powers over MOMENT_CHUNK tokens at a time: over the whole window they held three float64 copies
        # of x (a 32K-token window of 8 x 128: 774 MiB beside its 128 MiB)
        for t0 in range(0, T, MOMENT_CHUNK):
            y = xf[:, :, t0 : t0 + MOMENT_CHUNK].double() - self._shift[None, :, None, :]
            p = y.clone()
            for k in range(4):
                self._sums[k] += p.sum(dim=(0, 2))
                if k < 3:
                    p.mul_(y)
            del y, p
        self.count += B * T
        if plan:
            if self.sample is None:
                self.sample = torch.zeros(
                    self.capacity, H, self.block, D, dtype=SAMPLE_DTYPE, device=x.device
                )
                self.positions = torch.zeros(self.capacity, dtype=torch.long)
            n_b = blocks_in(T, self.block)
            for slot, i in plan:
                b, t0 = divmod(i, n_b)
                t0 = min(t0 * self.block, T - self.block)
                self.sample[slot] = xf[b, :, t0 : t0 + self.block].to(SAMPLE_DTYPE)
                self.positions[slot] = t0

    # ------------------------------------------------------------------------------- results

    def _central(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, variance, fourth central moment), each (H, D) float64."""
        if self.count == 0:
            raise ValueError("no data was collected")
        m1, m2, m3, m4 = (self._sums[k] / self.count for k in range(4))
        mean = self._shift + m1
        var = (m2 - m1**2).clamp_min(0.0)
        mu4 = m4 - 4 * m1 * m3 + 6 * m1**2 * m2 - 3 * m1**4
        return mean, var, mu4.clamp_min(0.0)

    @property
    def mean(self) -> torch.Tensor:
        return self._central()[0].float()

    @property
    def std(self) -> torch.Tensor:
        return self._central()[1].sqrt().float()

    @property
    def kurtosis(self) -> torch.Tensor:
        """Pearson kurtosis ``E[(x-μ)^4] / σ^4`` per (head, channel): 3 for a Gaussian, 1.8 for uniform.

        A constant channel (σ = 0) reports 0.
        """
        _, var, mu4 = self._central()
        return torch.where(var > 0, mu4 / var.clamp_min(1e-300) ** 2, torch.zeros_like(var)).float()

    def sampled(self, n_blocks: int) -> torch.Tensor:
        """The sample as float32 ``(n_blocks, H, block, D)`` (the first ``n_blocks`` slots are filled)."""
        if self.sample is None or n_blocks == 0:
            return torch.zeros(0, self.n_heads, self.block, self.head_dim)
        return self.sample[:n_blocks].float()

    def percentiles(self, n_blocks: int, qs: tuple[float, ...] = (0.01, 0.99)) -> torch.Tensor:
        """Quantiles per (head, channel) over the sampled tokens: ``(len(qs), H, D)``."""
        s = self.sampled(n_blocks)
        if s.numel() == 0:
            return torch.full((len(qs), self.n_heads, self.head_dim), float("nan"))
        flat = s.permute(1, 3, 0, 2).reshape(self.n_heads, self.head_dim, -1)
        # q on the sample's device: torch.quantile refuses a CPU q for a CUDA input (kvbits analyze --device cuda)
        return torch.quantile(flat, torch.tensor(qs, device=flat.device), dim=-1)

    def token_ranges(self, n_blocks: int) -> torch.Tensor:
        """``max - min`` over the ``D`` channels of each sampled (token, head): ``(n_blocks, H, block)``."""
        s = self.sampled(n_blocks)
        return s.amax(-1) - s.amin(-1)


@dataclass
class TensorReport:
    """Final statistics of one tensor (pre-RoPE keys, post-RoPE keys or values) of one layer.

    Per-(head, channel) tensors are ``(H_kv, D)`` float32 over all tokens seen, except ``p1``/``p99``
    (over the sample). Scalars are defined in :mod:`kvbits.analyze.outliers`.
    """

    absmax: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    p1: torch.Tensor
    p99: torch.Tensor
    kurtosis: torch.Tensor
    outliers: list[list[int]]
    range_used_by_head: list[float]
    token_range_median: float
    sqnr_token: float
    sqnr_channel: float
    n_tokens: int

    @classmethod
    def from_stats(cls, stats: ChannelStats, n_blocks: int, threshold: float, bits: int = 4) -> TensorReport:
        from kvbits.analyze.outliers import int_sqnr, outlier_channels, outlier_mask, range_used_per_token

        sample = stats.sampled(n_blocks)
        outliers = outlier_channels(stats.absmax, threshold)
        mask = outlier_mask(outliers, stats.n_heads, stats.head_dim)
        p = stats.percentiles(n_blocks)
        ranges = stats.token_ranges(n_blocks)
        return cls(
            absmax=stats.absmax.float().cpu(),
            mean=stats.mean.cpu(),
            std=stats.std.cpu(),
            p1=p[0].cpu(),
            p99=p[1].cpu(),
            kurtosis=stats.kurtosis.cpu(),
            outliers=outliers,
            range_used_by_head=range_used_per_token(sample, mask),
            token_range_median=float(ranges.median()) if ranges.numel() else float("nan"),
            sqnr_token=int_sqnr(sample, "token", bits=bits),
            sqnr_channel=int_sqnr(sample, "channel", bits=bits, group=stats.block),
            n_tokens=stats.count,
        )

    @property
    def range_used_per_token(self) -> float:
        """The worst head's median fraction of the per-token range used by non-outlier channels."""
        vals = [v for v in self.range_used_by_head if not math.isnan(v)]
        return min(vals) if vals else float("nan")

    def summary(self) -> dict[str, float | int | list[float]]:
        """The JSON figures of this tensor (see ``kvbits.analyze.outliers`` for definitions)."""
        used = self.range_used_per_token
        return {
            "absmax_max": float(self.absmax.max()),
            "absmax_median": float(self.absmax.median()),
            "kurtosis_mean": float(self.kurtosis.mean()),
            "kurtosis_max": float(self.kurtosis.max()),
            "n_outlier_channels": len(self.outliers),
            "range_used_per_token": used,
            "range_used_per_token_by_head": self.range_used_by_head,
            "range_used_per_channel": 1.0,
            # ordinary channels left no range at all (used 0): every bit lost, not "unknown"
            "bits_lost_per_token": math.log2(1 / used) if used > 0 else math.inf if used == 0 else math.nan,
            "token_range_median": self.token_range_median,
            "sqnr_int4_token": self.sqnr_token,
            "sqnr_int4_channel": self.sqnr_channel,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-(head, channel) statistics, for a safetensors file."""
        return {k: getattr(self, k).contiguous() for k in ("absmax", "mean", "std", "p1", "p99", "kurtosis")}
