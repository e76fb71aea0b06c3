"""Model-free fitting: per-layer static per-channel scales and NUQ codebooks from K/V samples.

- static per-channel scales (KVQuant §3.1-3.2): the ``[100 - p, p]`` percentile range of each
  (head, channel) over the calibration tokens; entries outside it are the dense-and-sparse outliers
  (§3.5) or, beyond the outlier budget, clipped (``QuantizedTensor.clipped`` counts them);
- NUQ codebooks (§3.3): per layer and side, Fisher-weighted k-means on the normalised values the
  quantizer will code (``kvbits.quant.tensor.codebook_inputs``: same outliers, same ranges);
- FP8 per-tensor scales (static FP8, vLLM's ``k_scale`` / ``v_scale``): ``absmax / fp8_max`` of the
  stored tensor over every calibration token past the sinks (a max observer, as llm-compressor's
  ``minmax``), so the calibration data never saturates; for post-RoPE keys the absmax is taken after
  RoPE (``calibrate`` rotates the captured keys), since that is what such a cache stores. With
  ``fp8_scale="mse"`` the scale is then raised by up to 2x (``FP8_PHASES`` steps) to the one with the
  least squared error on the samples: a per-tensor scale also sets where every value falls between
  E4M3's grid points (the "phase"): on Qwen2.5-Coder-0.5B the least-error phase had 58 % less KL
  than scale 1.0 (BENCHMARKS.md §8). ``fp8_scale="centred"`` (``calibrate``'s default) searches the
  same scales but measures the keys' error without its part constant over tokens (per head and
  channel): that part shifts every attention logit of a query by the same amount, which softmax
  ignores. Plain squared error rewards rounding a large near-constant key channel well, which does not
  matter, and was unstable on Qwen2.5 (per-tensor scales 0.0225 KL, per-head 0.0350); the centred error
  gave 0.0250 and 0.0249 (BENCHMARKS.md §10). Values keep the plain squared error. The model-free
  functions here default to ``"amax"``, since only the caller knows whether its samples are the
  stored tensor.

A Hadamard-rotated side (``TensorSpec.rotate``) stores the codes of ``x @ R``, so its ranges, codebook
inputs, Fisher weights and FP8 scales are taken in that basis (the samples ``x @ R``, the gradients
``grad @ R``; ``calibrate`` tracks the largest ``|x @ R|`` over every calibration position beside
``|x|``). The squared error an FP8 scale is searched by is the same in either basis (``R`` is
orthogonal), and so is the centred one: an error constant over tokens stays constant after ``R``.

``calibrate`` (``kvbits.calibrate.calibrate``) collects the samples from a model and calls
``artifact_from_samples``; tests and tools can call it with synthetic samples.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvbits._argtypes import check_seed
from kvbits.calibrate.artifact import SIDES, CalibrationArtifact, now_utc, spec_calibratable
from kvbits.calibrate.kmeans import ITERATIONS, MAX_POINTS, check_kmeans_args, fit_codebook, weighted_mse
from kvbits.calibrate.observers import channel_percentiles
from kvbits.quant.affine import choose_qparams
from kvbits.quant.fp8 import fp8_max
from kvbits.quant.nuq import choose_nuq_params, uniform_codebook
from kvbits.quant.rotate import rotate
from kvbits.quant.tensor import codebook_inputs, quantize, to_channel_basis
from kvbits.schemes.accounting import check_scheme_head_dim
from kvbits.schemes.presets import get_scheme
from kvbits.schemes.spec import KVScheme, TensorSpec

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (stage, done, total)
FP8_SCALES = ("amax", "mse", "centred")
FP8_PHASES = 32
"""``fp8_scale="mse"`` / ``"centred"`` try ``amax / fp8_max * 2 ** (j / FP8_PHASES)`` for ``j`` in
``0 .. FP8_PHASES - 1``."""


def check_fp8_scale(fp8_scale: str) -> None:
    if fp8_scale not in FP8_SCALES:
        raise ValueError(f"fp8_scale must be one of {FP8_SCALES}, got {fp8_scale!r}")


def check_calibratable(scheme: KVScheme) -> None:
    """Raise ``ValueError`` unless every side that needs calibration is one this module can fit (in every
    layer's scheme, for a mixed scheme)."""
    if not scheme.calibratable():
        raise ValueError(
            f"scheme {scheme.name!r} has nothing to calibrate (no static int/nuq/fp8 scales, no nuq codebook); "
            "calibration is for schemes like kvquant-4 or fp8-e4m3"
        )
    for sub in scheme.layer_schemes() if scheme.is_mixed else [scheme]:
        try:
            _check_sides(sub)
        except ValueError as exc:
            raise ValueError(f"{sub.name}: {exc}" if scheme.is_mixed else str(exc)) from None


def _check_sides(scheme: KVScheme) -> None:
    for side, spec in zip(SIDES, (scheme.key, scheme.value)):
        if not spec_calibratable(spec) or spec.kind == "fp8":  # an FP8 tensor scale fits any layout
            continue
        if spec.static and spec.granularity != "channel":
            raise ValueError(
                f"{side}: static {spec.granularity!r} scales can not be calibrated yet; static scales are "
                "calibrated per channel (granularity='channel')"
            )
        if side == "key" and not spec.pre_rope and (spec.static or spec.kind == "nuq"):
            # channel means / smoothing factors alone are fitted on the keys as stored (after RoPE)
            raise ValueError(
                "key: calibration captures keys before RoPE (k_proj/k_norm outputs); post-RoPE per-channel "
                "statistics mix channel pairs by position (KVQuant §3.2). Set pre_rope=True on the key spec"
            )


# ------------------------------------------------------------------------------ per-layer fitting


def _static_params(
    spec: TensorSpec, x: torch.Tensor, percentile: float, where: str = ""
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(head, channel) ``(scale, zero)`` float16 ``(H, D)`` covering the percentile range of ``x`` (H, N, D).

    Raises:
        ValueError: a channel's range is past what a float16 scale / zero-point holds (an asymmetric minimum
            below -65504, or for NUQ a span over 65504): naming ``where`` (``layer 3 key``), the channel and
            its range, where the artifact's ``validate`` said only "holds non-finite values".
    """
    lo, hi = channel_percentiles(x, percentile)
    ends = torch.stack([lo, hi])  # (2, H, D): the range to cover, reduced over dim 0
    if spec.kind == "int":
        scale, zero = choose_qparams(ends, spec.bits, (0,), symmetric=spec.symmetric)
    else:
        scale, zero = choose_nuq_params(ends, (0,), symmetric=spec.symmetric, check=False)
    bad = ~torch.isfinite(scale[0]) if zero is None else ~(torch.isfinite(scale[0]) & torch.isfinite(zero[0]))
    if bool(bad.any()):  # calibration, once per layer and side: not a per-step path
        h, c = (int(i) for i in bad.nonzero()[0])
        f16 = torch.finfo(torch.float16).max
        raise ValueError(
            f"{where + ': ' if where else ''}static {spec.kind} scales and zero-points are float16, and "
            f"{int(bad.sum())} channel range(s) overflow them (head {h} channel {c}: [{float(lo[h, c]):.6g}, "
            f"{float(hi[h, c]):.6g}]; an asymmetric range's minimum must be >= -{f16:g}"
            + (f" and its span at most {f16:g}" if spec.kind == "nuq" else "")
            + "): the K/V samples are too large for this spec; scale them down, use a symmetric spec, or a "
            "dynamic int spec with scale_dtype='fp32'"
        )
    return scale[0], None if zero is None else zero[0]


def _refuse_non_finite(x: torch.Tensor, what: str, where: str = "") -> None:
    """``ValueError`` naming ``where`` (``layer 3 key``) and the NaN / inf counts when samples ``x`` (any shape) are
    not all finite: ``what`` (``"static scales and zero-points"``) needs finite samples. Calibration, once per layer
    and side: not a per-step path."""
    if not bool(torch.isfinite(x).all()):
        n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        raise ValueError(
            f"{where + ': ' if where else ''}samples contain non-finite values ({n_nan} NaN, {n_inf} inf); {what} "
            "need finite samples"
        )


def _trim_to_groups(x: torch.Tensor, spec: TensorSpec, where: str = "") -> torch.Tensor:
    """``x`` ``(H_kv, N, D)`` cut to whole per-channel groups of ``spec.group_size`` tokens (``ValueError`` naming
    ``where`` and ``N`` when there is not one)."""
    if spec.granularity == "channel" and spec.group_size is not None:
        n = (x.shape[1] // spec.group_size) * spec.group_size
        if n == 0:
            raise ValueError(
                f"{where + ': ' if where else ''}{spec.kind} per-channel groups of {spec.group_size} tokens need at "
                f"least {spec.group_size} sampled tokens per layer, got {x.shape[1]}; calibrate on more tokens "
                "(context, windows, max_tokens)"
            )
        return x[:, :n]
    return x


def fit_side(
    spec: TensorSpec,
    x: torch.Tensor,
    grad: torch.Tensor | None = None,
    *,
    percentile: float = 99.9,
    kmeans_points: int = MAX_POINTS,
    kmeans_iterations: int = ITERATIONS,
    seed: int = 0,
    absmax: float | Sequence[float] | torch.Tensor | None = None,
    fp8_scale: str = "amax",
    tie_rope: bool = False,
    where: str = "",
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Calibrate one side of one layer from samples ``x`` ``(H_kv, N, D)`` (and gradients like it).

    Returns ``(tensors, stats)``: tensors named ``scale``/``zero``/``codebook``/``mean``/``factor``
    (float16) as that spec needs, and statistics: ``clip_rate`` (fraction of sampled entries clipped
    against static scales, outliers excluded), for NUQ ``codebook_gain_db`` (weighted MSE of a uniform
    codebook over that of the fitted one, in dB, on the normalised values), for ``smooth``
    ``smooth_spread_db`` (``_channel_transform``). A ``centre`` / ``smooth`` spec's static ranges are
    fitted on ``(x - mean) / factor``, what it codes. ``tie_rope``: a ``pre_rope`` spec's factor is fitted
    equal over each RoPE pair (``tie_rope_pairs``), which fused decode moves into the query.

    A static FP8 spec gets ``scale``, a float32 ``absmax / fp8_max``: ``()`` per tensor, ``(H_kv,)`` per
    head (``absmax``: the largest ``|x|`` the cache will store, ``|x @ R|`` for a rotated spec; a number per tensor, ``H_kv`` numbers per
    head; default ``x``'s own, then ``x`` is taken as the stored tensor), and the statistics ``absmax``
    (the largest over heads) and, without ``absmax``, ``clip_rate`` (0: the scale covers ``x``'s
    maximum); per head also ``head_spread_db`` (largest over smallest head scale, in dB). A head whose largest
    ``|x|`` is 0 takes the layer's largest head scale (1.0 when every head is 0; logged): zeros are exact at any
    scale, and 1.0 would set the max over heads that vLLM's non-FlashAttention backends serve with. ``calibrate``
    gives ``absmax`` over every calibration position: nothing clips. ``fp8_scale="mse"`` raises each
    scale by up to 2x to the least squared error on ``x`` (which must then be samples of the stored
    tensor) and adds ``scale_step`` (the chosen ``j``; per head, the mean) and ``mse_gain_db`` (the amax
    scales' squared error over the chosen ones'); ``"centred"`` does the same with each channel's mean
    error over the ``N`` samples removed first (for keys: ``artifact_from_samples`` passes ``"mse"`` for
    values).
    """
    if x.dim() != 3:
        raise ValueError(f"samples must be (H_kv, N, D), got {tuple(x.shape)}")
    if spec.kind == "fp8":  # a rotated side: x @ R, and absmax must be the largest |x @ R|
        xr = x if spec.rotate is None else rotate(x.float(), spec.rotate)
        return _fit_fp8(spec, xr, absmax, fp8_scale, where)
    x = _trim_to_groups(x.float(), spec, where)
    grad = None if grad is None else _trim_to_groups(grad.float(), spec, where)
    tensors: dict[str, torch.Tensor] = {}
    stats: dict[str, float] = {}
    channel_kw: dict[str, torch.Tensor] = {}
    if spec.has_channel_transform:  # what follows (static ranges) is fitted on (x - mean) / factor
        channel_kw, stats = _channel_transform(spec, x, percentile, tie_rope, where)
        tensors.update({k.removeprefix("channel_"): v for k, v in channel_kw.items()})
        x = to_channel_basis(x[None], channel_kw.get("channel_mean"), channel_kw.get("channel_factor"))[0]
        if grad is not None and spec.smooth is not None:  # d loss / d(x / f) = grad * f
            grad = grad * channel_kw["channel_factor"].float()[:, None, :]
    # A rotated spec codes x @ R: its ranges, codebook inputs and Fisher weights live in that basis
    # (the gradient with respect to x @ R is grad @ R, R orthogonal). quantize / codebook_inputs rotate x
    # themselves; the percentile ranges and the gradients are rotated here.
    x_coded = x if spec.rotate is None else rotate(x, spec.rotate)
    if grad is not None and spec.rotate is not None:
        grad = rotate(grad, spec.rotate)
    kw: dict[str, Any] = {}
    if spec.static:  # a NaN / inf sample gave a NaN / inf range, refused below as a float16 overflow
        _refuse_non_finite(x, f"static {spec.kind} scales and zero-points", where)
        scale, zero = _static_params(spec, x_coded, percentile, where)
        tensors["scale"] = scale
        if zero is not None:
            tensors["zero"] = zero
        kw = {"static_scale": scale, "static_zero": zero}
    if spec.kind == "nuq":
        u, kept = codebook_inputs(x[None], spec, **kw)
        pts = u[kept]
        w = None if grad is None else grad[None][kept].square()
        cb = fit_codebook(
            pts, spec.bits, w, iterations=kmeans_iterations, max_points=kmeans_points, seed=seed
        )
        tensors["codebook"] = cb
        kw["codebook"] = cb
        pts_c = pts.clamp(-1, 1)
        mse_fit = weighted_mse(pts_c, cb, w)
        mse_uni = weighted_mse(pts_c, uniform_codebook(spec.bits), w)
        stats["codebook_gain_db"] = 10 * math.log10(mse_uni / mse_fit) if mse_fit > 0 and mse_uni > 0 else 0.0
    if spec.static:  # x is already in the centred / smoothed basis: quantize it as the identity there
        qt = quantize(x[None], _without_channel_transform(spec), validate=False, **kw)
        stats["clip_rate"] = qt.clipped / x.numel()
    return tensors, stats


SMOOTH_FLOOR = 1e-3
"""A channel's spread is floored at this fraction of its head's largest before the exponent: a channel
constant over the calibration samples would otherwise get a factor near 0 and blow up any later value."""


def _channel_transform(
    spec: TensorSpec, x: torch.Tensor, percentile: float = 99.9, tie: bool = False, where: str = ""
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``centre`` / ``smooth`` vectors of one layer's side from samples ``x`` ``(H_kv, N, D)`` float32.

    Returns ``({"channel_mean": (H_kv, D), "channel_factor": (H_kv, D)}`` (those the spec has, float16), stats)``:
    the mean over the samples; the factor ``spread ** alpha``, ``spread`` the larger of ``|x - mean|``'s
    ``100 - percentile`` and ``percentile`` percentiles over the samples (``mean`` 0 without ``centre``; as
    static ranges are taken, so a few extreme tokens do not set a channel's factor; with ``tie``, for
    ``pre_rope`` specs, the larger of each RoPE pair's: ``tie_rope_pairs``), floored at
    ``SMOOTH_FLOOR`` of the head's largest and divided by the mean factor of the layer (per-token scales
    absorb a common constant). Stats: ``smooth_spread_db``, the largest factor over the smallest, in dB
    (20 log10); ``constant_heads``, when a head's samples all equal their reference (a dead head: every
    channel's spread 0), whose factors are then 1 before that division (logged with ``where``, e.g. "layer 3
    key"): the coded head is its samples minus the reference, zero, exact at any factor. A factor is at least
    float16's smallest normal (``6.1e-5``): a live head whose spread is ``1e-9`` of the others' would round to 0.
    ``ValueError`` (naming ``where``) for no samples, non-finite samples, or a ``centre`` channel mean past float16."""
    if x.shape[1] == 0:
        raise ValueError("no samples to take channel means / smoothing factors from")
    at = f"{where}: " if where else ""
    _refuse_non_finite(x, "channel means / smoothing factors", where)  # one NaN would make every factor NaN
    out: dict[str, torch.Tensor] = {}
    stats: dict[str, float] = {}
    mean = x.double().mean(dim=1)
    if spec.centre:
        f16 = torch.finfo(torch.float16).max
        over = mean.abs() > f16
        if bool(over.any()):  # the float16 mean would be inf, and every factor of the layer NaN
            h, c = (int(i) for i in over.nonzero()[0])
            raise ValueError(
                f"{at}channel means are stored in float16, and {int(over.sum())} are beyond +-{f16:g} (head {h} "
                f"channel {c}: {float(mean[h, c]):.6g}); expected K/V within float16, as the cache stores"
            )
        out["channel_mean"] = mean.to(torch.float16)
    if spec.smooth is not None:
        ref = out["channel_mean"].double() if spec.centre else torch.zeros_like(mean)  # as the cache subtracts it
        lo, hi = channel_percentiles(x.double() - ref[:, None, :], percentile)
        spread = torch.maximum(lo.abs(), hi.abs())
        if tie and spec.pre_rope:  # one factor per RoPE pair (d, d + D/2): it commutes with RoPE (QServe's rule)
            spread = tie_rope_pairs(spread)
        top = spread.amax(dim=-1, keepdim=True)
        dead = (top <= 0).squeeze(-1)  # (H_kv,)
        if bool(dead.any()):
            heads = dead.nonzero().flatten().tolist()
            logger.warning(
                "%sKV head(s) %s: every calibration sample equals the %s (a constant head); smoothing factor "
                "1 there", f"{where}: " if where else "", heads, "channel mean" if spec.centre else "zero",
            )  # fmt: skip
            spread = torch.where(dead[:, None], torch.ones_like(spread), spread)
            top = spread.amax(dim=-1, keepdim=True)
            stats["constant_heads"] = float(len(heads))
        factor = spread.clamp_min(SMOOTH_FLOOR * top).pow(spec.smooth)
        # the floor is per head, the mean over the layer: a head far quieter than the rest would round to a float16
        # factor of 0 (x / 0 = inf when coded); float16's smallest normal keeps it live and exactly invertible
        factor = (factor / factor.mean()).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
        out["channel_factor"] = factor
        stats["smooth_spread_db"] = 20 * math.log10(float(factor.max()) / float(factor.min()))
    return out, stats


def check_tie_rope_pairs(scheme: KVScheme, tie: bool) -> None:
    """``ValueError`` when factors are to be tied over RoPE pairs but no layer of ``scheme`` has smoothed
    pre-RoPE keys (nothing to tie: the option would silently do nothing)."""
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    if tie and not any(sub.key.pre_rope and sub.key.smooth is not None for sub in subs):
        raise ValueError(
            f"tie_rope_pairs ties the smoothing factors of pre-RoPE keys, and scheme {scheme.name} has none "
            "(the int*-token-smooth-prerope presets have)"
        )


def check_options_apply(scheme: KVScheme, *, percentile: bool, fp8_scale: bool) -> None:
    """``ValueError`` for an option given (``True``) that no side of ``scheme`` would use, as it would silently do
    nothing: ``percentile`` sets static int/NUQ ranges and smoothing factors; ``fp8_scale`` static FP8 scales."""
    sides = [s for sub in (scheme.layer_schemes() if scheme.is_mixed else [scheme]) for s in (sub.key, sub.value)
             if not sub.is_identity]  # fmt: skip
    if percentile and not any(s.kind != "fp8" and (s.static or s.smooth is not None) for s in sides):
        raise ValueError(
            f"--percentile sets static int/NUQ ranges and smoothing factors, and scheme {scheme.name} has none "
            "(kvquant-4 or int4-token-smooth have)"
        )
    if fp8_scale and not any(s.kind == "fp8" and s.static for s in sides):
        raise ValueError(
            f"--fp8-scale chooses static FP8 scales, and scheme {scheme.name} has none (fp8-e4m3 has)"
        )


def tie_rope_pairs(spread: torch.Tensor) -> torch.Tensor:
    """``spread (..., D)`` with channels ``d`` and ``d + D/2`` (a rotate-half RoPE pair) both given the larger.

    A factor equal over each pair commutes with RoPE: ``RoPE(f * c) = f * RoPE(c)``, so fused decode folds it
    into the query (``q * f``) instead of decoding ``code * f`` per element before the in-kernel RoPE.
    """
    D = spread.shape[-1]
    if D % 2:
        raise ValueError(f"RoPE pairs need an even head dim, got {D}")
    top = torch.maximum(spread[..., : D // 2], spread[..., D // 2 :])
    return torch.cat([top, top], dim=-1)


def _without_channel_transform(spec: TensorSpec) -> TensorSpec:
    return dataclasses.replace(spec, centre=False, smooth=None)


def _fit_fp8(
    spec: TensorSpec,
    x: torch.Tensor,
    absmax: float | Sequence[float] | torch.Tensor | None,
    fp8_scale: str = "amax",
    where: str = "",
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The FP8 scale of one layer and side (see ``fit_side``): per tensor ``()``, per head ``(H_kv,)``."""
    check_fp8_scale(fp8_scale)
    if not spec.static:
        raise ValueError(f"only static FP8 specs take a calibrated scale, got {spec}")
    if x.numel() == 0 and absmax is None:
        raise ValueError("no samples to take an FP8 scale from")
    per_head = spec.granularity == "head"
    groups = list(x) if per_head else [x]  # (N, D) per head, or the whole (H, N, D)
    if absmax is None:
        amaxes = [float(g.abs().max()) for g in groups]
    elif per_head:
        amaxes = [float(a) for a in torch.as_tensor(absmax, dtype=torch.float64).reshape(-1)]
        if len(amaxes) != len(groups):
            raise ValueError(f"per-head FP8 calibration: {len(groups)} heads, but absmax has {len(amaxes)} values")
    else:
        amaxes = [float(absmax)]
    fits = [_fit_fp8_group(spec, g, a, fp8_scale) for g, a in zip(groups, amaxes)]
    scales = [f[0] for f in fits]
    if 0.0 in amaxes:  # stored exactly at any scale: the fallback only matters for what serving brings later
        zero = [h for h, a in enumerate(amaxes) if a == 0.0]
        live = [s for s, a in zip(scales, amaxes) if a > 0.0]
        # a dead head takes the layer's largest head scale: 1.0 would dominate the max over heads that vLLM's
        # non-FlashAttention backends serve every head at (and cover nothing the live heads need); the largest
        # live scale leaves that max as it is and clips no later value any live head would keep
        fallback = torch.stack(live).max() if live else torch.ones((), dtype=torch.float32)
        for h in zero:
            scales[h] = fallback
        logger.warning(
            "%sFP8 %s: every calibration sample is 0; scale %s there (%s)",
            f"{where}: " if where else "", f"KV head(s) {zero}" if len(amaxes) > 1 else "tensor",
            f"{float(fallback):.6g}", "the layer's largest head scale" if live else "vLLM's default",
        )  # fmt: skip
    scale = torch.stack(scales) if per_head else scales[0]
    stats: dict[str, float] = {"absmax": max(amaxes)}
    if fp8_scale in ("mse", "centred") and x.numel():
        steps = [f[1] for f in fits if f[1] is not None]
        base_err, best_err = sum(f[2] for f in fits), sum(f[3] for f in fits)
        if steps:
            stats["scale_step"] = sum(steps) / len(steps)  # per head: the mean over the heads
        stats["mse_gain_db"] = 10 * math.log10(base_err / best_err) if base_err > 0 and best_err > 0 else 0.0
    elif absmax is None:  # x is the stored tensor: how much of it the scale clips (0 with its own amax)
        lim = scale.reshape(-1, *([1] * (x.dim() - 1))) if per_head else scale
        clipped = int((x.float().abs() > lim * fp8_max(spec.fmt)).sum()) if x.numel() else 0
        stats["clip_rate"] = clipped / max(1, x.numel())
    if per_head:  # how far apart the heads' scales are: what one per-tensor scale would have to span
        stats["head_spread_db"] = 20 * math.log10(float(scale.max()) / float(scale.min()))
    return {"scale": scale}, stats


def _fit_fp8_group(
    spec: TensorSpec, x: torch.Tensor, amax: float, fp8_scale: str
) -> tuple[torch.Tensor, float | None, float, float]:
    """One FP8 scale for the samples ``x`` whose largest stored ``|x|`` is ``amax``:
    ``(scale, step, amax-scale squared error, chosen squared error)`` (``step`` and errors: ``mse`` only)."""
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"FP8 calibration: the largest |K/V| is {amax}; expected a finite value")
    if amax == 0:
        # all zeros: any scale stores them exactly; 1.0 is vLLM's default and never divides by zero
        return torch.ones((), dtype=torch.float32), None, 0.0, 0.0
    scale = torch.tensor(amax / fp8_max(spec.fmt), dtype=torch.float32)
    # float32 rounding may land a hair below amax / fp8_max: one ulp up keeps amax inside the grid
    if float(scale) * fp8_max(spec.fmt) < amax:
        scale = torch.nextafter(scale, torch.tensor(math.inf))
    if fp8_scale not in ("mse", "centred") or not x.numel():
        return scale, None, 0.0, 0.0
    return _mse_phase(spec, x, scale, centred=fp8_scale == "centred")


def _fp8_sq_error(x: torch.Tensor, scale: torch.Tensor, spec: TensorSpec, centred: bool = False) -> float:
    """Squared error of storing ``x`` ``(..., N, D)`` (``N`` tokens) as FP8 at ``scale``; ``centred``:
    without each channel's mean error over the tokens (the part softmax ignores, for keys)."""
    from kvbits.quant.fp8 import dequantize_fp8, quantize_fp8

    codes, _ = quantize_fp8(x, scale, spec.fmt)
    err = dequantize_fp8(codes, scale, torch.float64) - x.double()
    if centred:
        err = err - err.mean(dim=-2, keepdim=True)
    return float(err.square().sum())


def _mse_phase(
    spec: TensorSpec, x: torch.Tensor, base: torch.Tensor, centred: bool = False
) -> tuple[torch.Tensor, float, float, float]:
    """``base * 2 ** (j / FP8_PHASES)`` with the least squared error on ``x`` ``(..., N, D)`` (``j = 0``
    on ties; ``centred``: see ``_fp8_sq_error``): ``(scale, j, error at j = 0, error at j)``."""
    x = x.float()
    errors = [
        _fp8_sq_error(x, (base * 2.0 ** (j / FP8_PHASES)).float(), spec, centred) for j in range(FP8_PHASES)
    ]
    j = min(range(FP8_PHASES), key=lambda i: (errors[i], i))
    return (base * 2.0 ** (j / FP8_PHASES)).float(), float(j), errors[0], errors[j]


def _warn_percentile_is_the_max(
    scheme: KVScheme,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    percentile: float,
    layer_ids: Sequence[int] | None = None,
) -> None:
    """Log a WARNING when a fitted side has too few samples per channel for ``percentile`` to trim its outliers.

    ``channel_percentiles`` interpolates between order statistics at position ``q (N - 1)`` (``q = p / 100``); past
    ``N - 1.5`` that is nearer the largest sample than the second largest, so the range keeps most of the largest
    outlier: the percentile is in effect the max (99.9 over 100 tokens: 90 % of the way from the second largest to
    the max). That stops from ``N >= 1 + 50 / (100 - p)`` samples on (501 for 99.9). ``keys`` / ``values``:
    ``(H_kv, N, D)`` per entry, entry ``i`` of model layer ``layer_ids[i]`` (None: layer ``i``); only the sides whose fit reads ``percentile`` count (static int/NUQ ranges,
    smoothing factors); ``percentile=100`` asks for the max and says nothing."""
    if not 50 <= percentile < 100:  # 100: the max, as asked; outside [50, 100]: refused by the fit
        return
    layer_ids = list(range(len(keys))) if layer_ids is None else list(layer_ids)
    counts = [
        xs[i].shape[1]
        for i in range(len(keys))
        for side, xs in (("key", keys), ("value", values))
        if (spec := getattr(scheme.for_layer(layer_ids[i]), side)).kind != "fp8" and (spec.static or spec.smooth is not None)
    ]
    if not counts:
        return
    n, enough = min(counts), math.ceil(1 + 50 / (100 - percentile) - 1e-9)
    if n < enough:
        logger.warning(
            "percentile %g over %d samples per channel is in effect the max (and 100 - p the min): the range lies "
            "nearer the largest sample than the second largest, so it trims no outliers; that takes %d samples "
            "per channel (1 + 50 / (100 - p)): calibrate on more tokens, or lower the percentile",
            percentile, n, enough,
        )  # fmt: skip


def artifact_from_samples(
    scheme: KVScheme | str,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    key_grads: Sequence[torch.Tensor] | None = None,
    value_grads: Sequence[torch.Tensor] | None = None,
    percentile: float = 99.9,
    kmeans_points: int = MAX_POINTS,
    kmeans_iterations: int = ITERATIONS,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
    progress: Progress | None = None,
    key_absmax: Sequence[float | torch.Tensor] | None = None,
    value_absmax: Sequence[float | torch.Tensor] | None = None,
    fp8_scale: str = "amax",
    tie_rope_pairs: bool = False,
    layers: Sequence[int] | None = None,
) -> CalibrationArtifact:
    """Fit an artifact from per-layer samples, without a model (``calibrate`` calls this).

    Args:
        scheme: what to calibrate for.
        keys, values: one ``(H_kv, N, D)`` tensor per layer (pre-RoPE keys; sink tokens excluded),
            or ``(B, H_kv, T, D)`` blocks (flattened over ``B`` and ``T``).
        key_grads, value_grads: loss gradients like ``keys``/``values`` (Fisher weights = their
            squares), or None for unweighted k-means.
        meta: JSON fields to record (``model``, ``data``, ...); ``model`` defaults to the shape of the
            samples and ``data`` to the sample count ``tokens`` (``N``, or ``B * T``, of the first fitted side
            with samples: an uncalibrated layer's may be empty) and the calibrated ``context``
            (``max_calibrated_length``): the window length ``T`` of the fitted ``(B, H_kv, T, D)`` blocks (the
            smallest, if they differ), else ``N`` (3-D samples do not say how long their windows were; with no
            samples at all, ``meta["data"]["context"]`` is required). ``meta["model"]`` / ``meta["data"]``
            fields replace those defaults one by one (a ``data`` of ``{"name": ...}`` keeps ``context``).
        key_absmax, value_absmax: static FP8 sides only: per layer, the largest ``|K|`` / ``|V|`` the
            cache stores (per-head specs: ``H_kv`` numbers per layer; ``calibrate`` passes the maximum over
            every calibration token, post-RoPE for post-RoPE keys); default each layer's samples' own
            maximum, which takes the samples as the stored tensor (so for a post-RoPE FP8 key spec, give
            post-RoPE keys or ``key_absmax``).
        fp8_scale: ``"amax"``, ``"mse"`` or ``"centred"`` (keys by their error up to a per-channel constant,
            values by plain squared error; see ``fit_side``); with ``"mse"`` / ``"centred"`` the samples
            must be of the stored tensor (``calibrate`` passes post-RoPE key samples for post-RoPE FP8
            keys).
        tie_rope_pairs: pre-RoPE centred / smoothed keys get one factor per RoPE pair (see ``fit_side``);
            recorded as ``tie_rope_pairs`` in the artifact's JSON.
        layers: the model layer of each entry of ``keys`` (ascending): a hybrid model's attention layers, the
            only ones that store K/V (recorded as ``model.kv_layers``; the model's ``num_layers`` is
            ``meta["model"]["num_layers"]``, else ``layers[-1] + 1``). None: entry ``i`` is layer ``i`` of
            ``len(keys)``.

    Raises:
        TypeError: ``keys`` / ``values`` / gradients not a list of tensors (a single tensor is refused, not
            taken as one layer per entry), or a tensor that is not floating.
        ValueError: ``kmeans_points`` or ``kmeans_iterations`` not an int >= 1, or ``seed`` not an int in
            ``[0, 2**32 - 1]``; checked before any fitting,
            naming the layer (``keys[3] (layer 3)``): a tensor of
            neither 3 nor 4 dims; ``H_kv`` or ``D`` differing between layers, between keys and values, or
            from ``meta["model"]``'s ``num_kv_heads`` / ``head_dim`` (and ``num_layers``); a head dim the
            scheme can not store; a gradient list of another length or a gradient of another shape than its
            samples; samples of a side to fit with no tokens or with NaN / inf (gradients too); no fitted side with
            samples and no ``meta["data"]["context"]`` (the calibrated length is unknown).
    """
    scheme = get_scheme(scheme)
    check_calibratable(scheme)
    check_fp8_scale(fp8_scale)
    check_tie_rope_pairs(scheme, tie_rope_pairs)
    check_kmeans_args(kmeans_points, kmeans_iterations, ("kmeans_points", "kmeans_iterations"))
    seed = check_seed(seed)  # the layers' k-means subsamples seed torch.manual_seed with seed + i
    for name, seq in (("keys", keys), ("values", values), ("key_grads", key_grads), ("value_grads", value_grads)):
        if seq is not None and (isinstance(seq, (torch.Tensor, str, bytes)) or not isinstance(seq, Sequence)):
            what = f"a tensor of shape {tuple(seq.shape)}" if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise TypeError(
                f"{name} must be a list with one (H_kv, N, D) or (B, H_kv, T, D) tensor per layer, got {what}"
            )
    if len(keys) != len(values) or not keys:
        raise ValueError(
            f"need one key and one value sample tensor per layer, got {len(keys)} and {len(values)}"
        )

    def as_hnd(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            B, H, T, D = t.shape
            return t.transpose(0, 1).reshape(H, B * T, D)
        return t

    for name, amax in (("key_absmax", key_absmax), ("value_absmax", value_absmax)):
        if amax is not None and len(amax) != len(keys):
            raise ValueError(f"{name} needs one value per layer ({len(keys)}), got {len(amax)}")
    layer_ids, n_layers = _layer_ids(layers, len(keys), meta)
    scheme.check_layer_count(n_layers, "the samples'")
    _check_samples(
        scheme, keys, values, key_grads, value_grads,
        key_absmax=key_absmax, value_absmax=value_absmax, meta=meta, tie_rope_pairs=tie_rope_pairs,
        layer_ids=layer_ids, num_layers=n_layers,
    )  # fmt: skip
    # the samples read: those of the sides fitted (an uncalibrated layer's samples may be empty or anything)
    fitted = [
        xs[i]
        for i in range(len(keys))
        for side, xs in (("key", keys), ("value", values))
        if spec_calibratable(getattr(scheme.for_layer(layer_ids[i]), side))
    ]
    # T of each (B, H_kv, T, D) block holding tokens: the windows' length
    window_lengths = [x.shape[2] for x in fitted if x.dim() == 4 and x.shape[0] * x.shape[2] > 0]
    keys = [as_hnd(k) for k in keys]
    values = [as_hnd(v) for v in values]
    H, _, D = keys[0].shape
    # the sample count: of the first fitted side with tokens (0: static FP8 sides fitted from *_absmax alone)
    N = next((n for x in fitted if (n := x.numel() // (H * D)) > 0), 0)
    given = (meta or {}).get("data") or {}
    context = min(window_lengths) if window_lengths else N
    if not window_lengths and "context" not in given:
        if N == 0:
            raise ValueError(
                "artifact_from_samples: no samples say how long the calibration windows were (every fitted side "
                "is empty); pass meta={'data': {'context': T}}, the calibrated length in tokens"
            )
        logger.warning(
            "artifact_from_samples: (H_kv, N, D) samples do not say how long their windows were; max_calibrated_length "
            "is recorded as the sample count N = %d, which overstates it unless they are one window: pass "
            "meta={'data': {'context': T}} (or (B, H_kv, T, D) blocks)", N,
        )  # fmt: skip
    _warn_percentile_is_the_max(scheme, keys, values, percentile, layer_ids)
    tensors: dict[str, torch.Tensor] = {}
    stats: list[dict[str, float]] = []  # one row per entry of layer_ids
    for i, layer in enumerate(layer_ids):
        row: dict[str, float] = {}
        layer_scheme = scheme.for_layer(layer)  # a mixed scheme: the layer's own
        for side, spec, xs, gs in (
            ("key", layer_scheme.key, keys, key_grads),
            ("value", layer_scheme.value, values, value_grads),
        ):
            if not spec_calibratable(spec):
                continue
            g = None if gs is None else as_hnd(gs[i])
            amax = {"key": key_absmax, "value": value_absmax}[side]
            t, s = fit_side(
                spec,
                xs[i],
                g,
                percentile=percentile,
                kmeans_points=kmeans_points,
                kmeans_iterations=kmeans_iterations,
                seed=seed + layer,
                absmax=None if amax is None else amax[i],
                fp8_scale="mse" if fp8_scale == "centred" and side == "value" else fp8_scale,
                tie_rope=tie_rope_pairs,
                where=f"layer {layer} {side}",
            )
            tensors.update({f"layers.{layer}.{side}_{k}": v for k, v in t.items()})
            row.update({f"{side}_{k}": v for k, v in s.items()})
        stats.append(row)
        if progress is not None:
            progress("fit", i + 1, len(layer_ids))
    record: dict[str, Any] = {
        "kvbits_version": _kvbits_version(),
        "created": now_utc(),
        "percentile": percentile,
        "fisher": key_grads is not None or value_grads is not None,
        "kmeans": {"iterations": kmeans_iterations, "max_points": kmeans_points, "seed": seed},
        "model": {
            "fingerprint": "samples",
            "name": None,
            "model_type": None,
            "num_layers": n_layers,
            "kv_layers": layer_ids,
            "num_attention_heads": None,
            "num_kv_heads": H,
            "head_dim": D,
            "hidden_size": None,
            "vocab_size": None,
        },
        "data": {"name": "samples", "tokens": N or None, "context": context},
    }
    if tie_rope_pairs:
        record["tie_rope_pairs"] = True
    for key, value in (meta or {}).items():  # meta's "model" / "data" fields over the defaults, not instead of them
        both = isinstance(value, dict) and isinstance(record.get(key), dict)
        record[key] = {**record[key], **value} if both else value
    record["stats"] = stats
    art = CalibrationArtifact(scheme=scheme, tensors=tensors, meta=record)
    art.validate()
    return art


def _check_samples(
    scheme: KVScheme,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    key_grads: Sequence[torch.Tensor] | None = None,
    value_grads: Sequence[torch.Tensor] | None = None,
    *,
    key_absmax: Sequence[Any] | None = None,
    value_absmax: Sequence[Any] | None = None,
    meta: dict[str, Any] | None = None,
    tie_rope_pairs: bool = False,
    layer_ids: Sequence[int] | None = None,
    num_layers: int | None = None,
) -> None:
    """``TypeError`` / ``ValueError`` naming the layer for per-layer samples ``artifact_from_samples`` can not
    fit ``scheme`` from (``keys`` and ``values`` as long, one per layer).

    Every tensor: a floating ``torch.Tensor`` of 3 dims ``(H_kv, N, D)`` or 4 ``(B, H_kv, T, D)``, with the
    ``H_kv`` and ``D`` of ``keys[0]`` (the artifact has one shape: every layer, keys and values), at least
    one KV head and channel; that shape one ``scheme`` can store (``check_scheme_head_dim``; even for
    ``tie_rope_pairs``) and, where ``meta["model"]`` gives them, its ``num_kv_heads`` / ``head_dim`` /
    ``num_layers``. Gradients: one per layer, each of its samples' shape. A side that is fitted (its layer's
    spec is calibratable) needs at least one token (except a static FP8 side given its ``*_absmax``, fitted
    from that alone) and finite samples and gradients: one ``isfinite`` pass over each."""
    n_layers = len(keys)
    layer_ids = list(range(n_layers)) if layer_ids is None else list(layer_ids)
    grads = {"key": key_grads, "value": value_grads}
    absmax = {"key": key_absmax, "value": value_absmax}
    for side in SIDES:
        g = grads[side]
        if g is not None and len(g) != n_layers:
            raise ValueError(f"{side}_grads needs one gradient tensor per layer ({n_layers}), got {len(g)}")
    ref: tuple[int, int] | None = None  # (H_kv, D) of keys[0]
    for i in range(n_layers):
        layer_scheme = scheme.for_layer(layer_ids[i])
        for side, xs in (("key", keys), ("value", values)):
            arg = f"{side}s[{i}]"
            x = _check_sample_tensor(xs[i], arg, i)
            H, D = x.shape[-3], x.shape[-1]
            if H < 1 or D < 1:
                raise ValueError(f"{arg} (layer {layer_ids[i]}) has shape {tuple(x.shape)}: no KV heads or no channels")
            if ref is None:
                ref = (H, D)
            elif (H, D) != ref:
                raise ValueError(
                    f"{arg} (layer {layer_ids[i]}) has {H} KV heads of dim {D} (shape {tuple(x.shape)}), but keys[0] has "
                    f"{ref[0]} of dim {ref[1]}: every layer's keys and values need the same (H_kv, D)"
                )
            g = None if grads[side] is None else grads[side][i]
            if grads[side] is not None:
                _check_sample_tensor(g, f"{side}_grads[{i}]", i)
                if g.shape != x.shape:
                    raise ValueError(
                        f"{side}_grads[{i}] (layer {layer_ids[i]}) has shape {tuple(g.shape)}, but its samples {arg} have "
                        f"{tuple(x.shape)}: a gradient must have the shape of its samples"
                    )
            spec = getattr(layer_scheme, side)
            if not spec_calibratable(spec):
                continue  # not read
            n_tokens = x.numel() // (H * D)
            given_absmax = absmax[side] is not None and absmax[side][i] is not None
            if n_tokens == 0 and not (spec.kind == "fp8" and given_absmax):
                raise ValueError(
                    f"{arg} (layer {layer_ids[i]}) has no tokens (shape {tuple(x.shape)}); calibrating its {side}s needs at "
                    "least one sample"
                )
            for t, what in ((x, arg), (g, f"{side}_grads[{i}]")):
                if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
                    n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                    raise ValueError(
                        f"{what} (layer {layer_ids[i]}) contains non-finite values ({n_nan} NaN, {n_inf} inf); refusing to "
                        "calibrate from it"
                    )
    assert ref is not None  # keys is not empty
    H, D = ref
    check_scheme_head_dim(scheme, D)
    if tie_rope_pairs and D % 2:
        raise ValueError(f"tie_rope_pairs ties RoPE pairs of channels and needs an even head dim, got {D}")
    model = (meta or {}).get("model")
    if isinstance(model, dict):
        got = {"num_layers": n_layers if num_layers is None else num_layers, "num_kv_heads": H, "head_dim": D}
        diff = [
            f"{k} {model[k]} vs {v}"
            for k, v in got.items()
            if isinstance(model.get(k), int) and not isinstance(model.get(k), bool) and model[k] != v
        ]
        if diff:
            raise ValueError(
                f"the samples do not match meta['model'] ({'; '.join(diff)} [meta vs samples]): samples of "
                f"{n_layers} layers of {H} KV heads of dim {D} were given"
            )


def _layer_ids(layers: Sequence[int] | None, n: int, meta: dict[str, Any] | None) -> tuple[list[int], int]:
    """``(layer of each of the n sample entries, the model's layer count)`` for ``artifact_from_samples``'s
    ``layers``; ``ValueError`` unless ``n`` ascending distinct ints >= 0 below ``meta["model"]["num_layers"]``."""
    if layers is None:
        return list(range(n)), n
    ids = list(layers)
    if len(ids) != n or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or (
        ids != sorted(set(ids)) or ids[0] < 0
    ):  # fmt: skip
        raise ValueError(f"layers must be {n} ascending distinct layer indices >= 0 (one per sample entry), got {ids!r}")
    model = (meta or {}).get("model")
    total = model.get("num_layers") if isinstance(model, dict) else None
    if not isinstance(total, int) or isinstance(total, bool):
        return ids, ids[-1] + 1
    if ids[-1] >= total:
        raise ValueError(f"layers {ids} go beyond meta['model']['num_layers'] = {total}")
    return ids, total


def _check_sample_tensor(t: Any, arg: str, layer: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} (layer {layer}) must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{arg} (layer {layer}) must be a floating tensor, got {t.dtype}")
    if t.dim() not in (3, 4):
        raise ValueError(
            f"{arg} (layer {layer}) must be (H_kv, N, D) or (B, H_kv, T, D), got {t.dim()} dims: shape "
            f"{tuple(t.shape)}"
        )
    return t


def _kvbits_version() -> str:
    import kvbits

    return kvbits.__version__
