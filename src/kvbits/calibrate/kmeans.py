"""Weighted 1-D k-means for NUQ codebooks (KVQuant §3.3: sensitivity-weighted non-uniform datatype).

KVQuant fits one codebook per layer (and per K/V) by k-means on normalised calibration activations,
each point weighted by its diagonal Fisher information, so the centroids go where quantization
error costs the loss most. Here the points are the normalised values ``u ∈ [-1, 1]`` that
``kvbits.quant.quantize`` codes (outliers removed, clipped values clamped) and the weights are
squared gradients (or 1 without Fisher).

Squared gradients are very heavy-tailed (a few tokens carry most of the weight), which breaks the
textbook recipe in two ways, both handled here:

- a *uniform* subsample misses the heavy points, so the fit optimises the wrong objective: points
  are instead drawn with probability proportional to their weight (with replacement, then weight
  1), an unbiased and low-variance estimate of the weighted objective;
- weighted-quantile starts put several centroids on one heavy point, and Lloyd's algorithm never
  moves a centroid that owns no points: empty clusters are re-seeded at the point with the largest
  weighted error, and Lloyd runs from three starts (weighted quantiles, plain quantiles, the
  uniform grid), keeping the best. Starting from the uniform grid, the result is never worse than
  a uniform codebook on the fitted points.

Deterministic: the subsample uses a seeded generator; Lloyd's updates have no randomness.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvbits.quant.nuq import CODEBOOK_DTYPE, uniform_codebook

logger = logging.getLogger(__name__)

MAX_POINTS = 200_000
ITERATIONS = 20
_MULTINOMIAL_MAX = 2**24  # torch.multinomial's category limit


def check_kmeans_args(max_points: Any, iterations: Any, names: tuple[str, str] = ("max_points", "iterations")) -> None:
    """``ValueError`` unless ``max_points`` (points a codebook is fitted on) and ``iterations`` (Lloyd iterations per
    start) are ints >= 1; ``names`` are the caller's names for them (``calibrate``: ``kmeans_points``,
    ``kmeans_iterations``). Checked before any fitting: 0 points would fail deep inside the fit, and a negative count
    would silently drop points from the end (``x[idx][:n]``)."""
    for name, value, what in (
        (names[0], max_points, "points per codebook fit"),
        (names[1], iterations, "Lloyd iterations"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 ({what}), got {value!r}")


def subsample(
    x: torch.Tensor, w: torch.Tensor | None, max_points: int = MAX_POINTS, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """At most ``max_points`` of the flattened ``x``, seeded.

    Unweighted: a uniform sample without replacement. Weighted: ``max_points`` draws with
    probability proportional to ``w`` (with replacement) returned with weight 1, so
    ``mean(err(sample))`` estimates ``sum(w err) / sum(w)`` without being dominated by which heavy
    points a uniform sample happened to catch.
    """
    x = x.reshape(-1).contiguous()
    w = None if w is None else w.reshape(-1).contiguous()
    if x.numel() <= max_points:
        return x, w
    g = torch.Generator().manual_seed(seed)
    if w is None or float(w.double().sum()) <= 0:
        idx = torch.randperm(x.numel(), generator=g)[:max_points].to(x.device)
        return x[idx], None if w is None else torch.ones(max_points, dtype=w.dtype, device=w.device)
    if x.numel() > _MULTINOMIAL_MAX:
        # past multinomial's category limit: inverse-CDF draws over every point. (A uniform thinning to the limit
        # first could drop every point with weight: a few heavy gradients among 2**26 points crashed multinomial.)
        cdf = torch.cumsum(w.double().cpu(), 0)
        r = torch.rand(max_points, generator=g, dtype=torch.float64) * cdf[-1]
        idx = torch.searchsorted(cdf, r, right=True).clamp_max(x.numel() - 1).to(x.device)
    else:
        idx = torch.multinomial(w.double().cpu(), max_points, replacement=True, generator=g).to(x.device)
    return x[idx], torch.ones(max_points, dtype=w.dtype, device=w.device)


def _assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (sorted ascending) for every point; ties go to the lower one."""
    return torch.bucketize(x, (centroids[1:] + centroids[:-1]) / 2)


def weighted_quantiles(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Weighted quantiles of 1-D ``x`` at levels ``q`` in ``[0, 1]`` (left-continuous inverse CDF)."""
    order = torch.argsort(x)
    xs, ws = x[order], w[order].double()
    cdf = torch.cumsum(ws, 0)
    cdf = cdf / cdf[-1]
    idx = torch.searchsorted(cdf, q.double().clamp(0, 1)).clamp_max(x.numel() - 1)
    return xs[idx]


def _objective(x: torch.Tensor, wd: torch.Tensor, c: torch.Tensor) -> float:
    return float((wd * (x - c[_assign(x, c)]).double() ** 2).sum())


def _lloyd(xs: torch.Tensor, ws: torch.Tensor, c: torch.Tensor, iterations: int) -> tuple[torch.Tensor, int]:
    """Weighted Lloyd iterations from sorted ``c`` over sorted points ``xs`` (weights ``ws``).

    In 1-D every cluster is a contiguous run of the sorted points, so an iteration is a search for
    the ``k - 1`` boundaries and differences of prefix sums: ``O(k log n)`` instead of ``O(n)``.
    A centroid left without weight is re-seeded at the point with the largest weighted error.
    """
    k, n = c.numel(), xs.numel()
    zero = torch.zeros(1, dtype=torch.float64)
    W = torch.cat([zero, torch.cumsum(ws, 0)])
    S = torch.cat([zero, torch.cumsum(ws * xs.double(), 0)])
    prev, it = None, 0
    for it in range(iterations):
        # points <= a midpoint go to the lower centroid (as `_assign` and `quantize_nuq` do)
        cuts = torch.searchsorted(xs, ((c[1:] + c[:-1]) / 2).contiguous(), right=True)
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.full((1,), n)])
        if prev is not None and torch.equal(bounds, prev):
            break
        prev = bounds
        wsum = W[bounds[1:]] - W[bounds[:-1]]
        xsum = S[bounds[1:]] - S[bounds[:-1]]
        empty = wsum <= 0
        c = torch.where(empty, c.double(), xsum / wsum.clamp_min(1e-300)).float()
        if bool(empty.any()):
            owner = torch.repeat_interleave(torch.arange(k), bounds[1:] - bounds[:-1])
            err = ws * (xs - c[owner]).double() ** 2
            for j in torch.nonzero(empty).flatten().tolist():
                i = int(torch.argmax(err))
                if float(err[i]) <= 0:
                    break  # every point already sits on a centroid
                c[j] = xs[i]
                err[xs == xs[i]] = 0
        c = torch.sort(c).values
    return c, it + 1


def weighted_kmeans_1d(
    x: torch.Tensor,
    k: int,
    w: torch.Tensor | None = None,
    *,
    iterations: int = ITERATIONS,
    max_points: int = MAX_POINTS,
    seed: int = 0,
    starts: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """Centroids (float32, ``(k,)``, sorted) minimising ``sum_i w_i (x_i - c(x_i))**2`` over 1-D ``x``.

    Args:
        x: points, any shape (flattened); finite.
        k: number of centroids (``2**bits``).
        w: non-negative weights like ``x`` (None: all 1); an all-zero weight vector counts as uniform.
        iterations: Lloyd iterations at most per start (stops early when assignments settle).
        max_points: points used, drawn as in :func:`subsample` when there are more.
        seed: subsample seed.
        starts: extra initial centroid sets (``(k,)`` each), e.g. a reference codebook to improve on.

    Runs Lloyd from weighted quantiles ``(j + 0.5) / k``, plain quantiles, the uniform grid over
    ``[min x, max x]`` and ``starts``, and returns the result with the lowest weighted error: never
    worse, on the fitted points, than any of the starts.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    check_kmeans_args(max_points, iterations)
    if x.numel() == 0:
        raise ValueError("weighted_kmeans_1d needs at least one point")
    x = x.detach().float().reshape(-1)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("k-means points must be finite")
    if w is not None:
        w = w.detach().float().reshape(-1)
        if w.shape != x.shape:
            raise ValueError(f"weights must match the points: {tuple(w.shape)} vs {tuple(x.shape)}")
        if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
            raise ValueError("k-means weights must be finite and non-negative")
    x, w = subsample(x, w, max_points, seed)
    wd = torch.ones_like(x, dtype=torch.float64) if w is None else w.double()
    total = float(wd.sum())
    wd = torch.ones_like(wd) if total <= 0 else wd * (wd.numel() / total)  # mean 1: squared grads ~1e-12
    levels = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    inits = {
        "weighted-quantiles": weighted_quantiles(x, wd.float(), levels),
        "quantiles": weighted_quantiles(x, torch.ones_like(x), levels),
        "uniform": torch.linspace(float(x.min()), float(x.max()), k),
    }
    for i, c0 in enumerate(starts):
        if c0.shape != (k,):
            raise ValueError(f"start {i} must have shape ({k},), got {tuple(c0.shape)}")
        inits[f"start-{i}"] = c0.detach().float().cpu()
    order = torch.argsort(x)
    xs, ws = x[order].contiguous(), wd[order].contiguous()
    best: tuple[float, torch.Tensor, str, int] | None = None
    for name, c0 in inits.items():
        c, iters = _lloyd(xs, ws, torch.sort(c0.float()).values, iterations)
        obj = _objective(x, wd, c)
        if best is None or obj < best[0]:
            best = (obj, c, name, iters)
    assert best is not None
    logger.debug("k-means: %d points, k=%d, best start %s (%d iterations)", x.numel(), k, best[2], best[3])
    return best[1]


def _distinct(c: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Sorted ``c`` with repeated centroids moved to unused levels of the uniform grid of ``2 k + 1`` points over
    ``[lo, hi]``, each to the grid level farthest from every level kept or placed so far (greedy farthest-point:
    the fill-ins split the largest gaps instead of bunching together). Degenerate data (all zeros, fewer distinct
    points than centroids) left copies of one centroid: wasted levels, and data served later decoded to fewer
    values. A copy holds no point of its own, so moving it never raises the weighted error."""
    values = sorted(set(c.tolist()))
    k = c.numel()
    if len(values) == k:
        return torch.sort(c).values
    grid = torch.linspace(lo, hi, 2 * k + 1, dtype=torch.float64)
    dist = (grid[:, None] - torch.tensor(values, dtype=torch.float64)[None, :]).abs().amin(dim=1)
    while len(values) < k:  # a level already taken has distance 0 and is never picked while others are free
        g = float(grid[int(torch.argmax(dist))])  # ties: the lowest level
        values.append(g)
        dist = torch.minimum(dist, (grid - g).abs())
    return torch.tensor(sorted(values), dtype=torch.float32)


def weighted_mse(x: torch.Tensor, codebook: torch.Tensor, w: torch.Tensor | None = None) -> float:
    """``sum w (x - nearest(x))**2 / sum w`` for 1-D points against a sorted codebook."""
    x = x.reshape(-1).float().contiguous()
    c = codebook.float().to(x.device)
    err = (x - c[_assign(x, c)]) ** 2
    if w is None:
        return float(err.mean())
    w = w.reshape(-1).double()
    total = float(w.sum())
    return float(err.mean()) if total <= 0 else float((err.double() * w).sum() / total)


def fit_codebook(
    u: torch.Tensor,
    bits: int,
    w: torch.Tensor | None = None,
    *,
    iterations: int = ITERATIONS,
    max_points: int = MAX_POINTS,
    seed: int = 0,
) -> torch.Tensor:
    """A NUQ codebook: float16 ``(2**bits,)``, sorted, in ``[-1, 1]``, from normalised values ``u``.

    ``u`` is clamped to ``[-1, 1]`` first: values a static range clips are coded as the range end.
    The uniform codebook is one of the starts, so on the fitted points the result is never worse
    than it (up to float16 rounding of the entries).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits must be in [1, 8], got {bits}")
    c = weighted_kmeans_1d(
        u.clamp(-1, 1),
        2**bits,
        w,
        iterations=iterations,
        max_points=max_points,
        seed=seed,
        starts=(uniform_codebook(bits).float(),),
    )
    # distinct as stored (float16 merges close centroids too), on a grid float16 holds exactly
    return _distinct(c.clamp(-1, 1).to(CODEBOOK_DTYPE).float(), -1.0, 1.0).to(CODEBOOK_DTYPE)
