"""Outlier channels, the quantization range they consume, int4 SQNR, and the resulting recommendation.

Definitions (all per layer; ``x`` is K or V shaped ``(B, H_kv, T, D)``):

- **outlier channel** ``(h, c)``: ``absmax[h, c] > threshold × median_c' absmax[h, c']``, the
  channel's largest magnitude over all tokens against the median channel of the same KV head
  (default ``threshold = 4``). The median is over the head's *live* channels (absmax > 0): a dead channel, zero
  at every token, holds nothing and needs no range, and a head of half dead channels would have a median of 0
  and every live channel an outlier (:func:`channel_median`). KVQuant (Hooper et al. 2024, §3.1, Fig. 2) shows such channels in
  pre-RoPE keys; KIVI (Liu et al. 2024, §3) is why they argue for per-channel key scales.
- **range used, per-token scaling**: one scale per (token, head) covers ``max_c |x|``. For each
  sampled (token, head), ``max |x| over non-outlier channels / max |x| over all channels``; the median
  over tokens, per head. ``0.1`` means ordinary channels use a tenth of the range: ``log2(10) ≈ 3.3``
  bits of resolution lost to the outliers. A head without outlier channels scores 1. The layer's
  figure is its worst (lowest) head.
- **range used, per-channel scaling**: each channel has its own scale, so the same ratio is 1 by
  construction; reported beside the per-token figure to make that contrast explicit.
- **SQNR** ``10 log10(Σ x² / Σ (x - x̂)²)`` in dB of int4 asymmetric fake quantization of the sample:
  per-token (one scale per token and head) vs per-channel (one scale per head and channel over
  blocks of 128 tokens, the ``int4-channel`` key spec).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import torch

from kvbits.schemes.spec import TensorSpec

DEFAULT_THRESHOLD = 4.0
DEFAULT_LAYER_FRACTION = 0.25


def check_threshold(threshold: float) -> None:
    """``ValueError`` unless ``threshold`` is a finite number > 1 (NaN compared False and found no outlier)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1 < threshold < math.inf:
        raise ValueError(f"threshold must be a finite number > 1 (a multiple of the median channel), got {threshold!r}")


def check_layer_fraction(layer_fraction: float) -> None:
    """``ValueError`` unless ``layer_fraction`` is a number in [0, 1)."""
    if isinstance(layer_fraction, bool) or not isinstance(layer_fraction, (int, float)) or not 0 <= layer_fraction < 1:
        raise ValueError(f"layer_fraction must be a number in [0, 1), got {layer_fraction!r}")


def channel_median(absmax: torch.Tensor) -> torch.Tensor:
    """``(H_kv, 1)`` float32: per head, the median absmax of its live channels (absmax > 0; the lower of the two
    middle ones for an even count, as ``torch.median``); NaN for a head whose every channel is zero.

    Args:
        absmax: ``(H_kv, D)`` largest |x| of each channel over all tokens.
    """
    a = absmax.float()
    return torch.where(a > 0, a, torch.full_like(a, math.nan)).nanmedian(dim=-1, keepdim=True).values


def outlier_channels(absmax: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> list[list[int]]:
    """``[[head, channel], ...]`` whose absmax exceeds ``threshold`` × the head's median live channel absmax
    (:func:`channel_median`; a head of zeros has none).

    Args:
        absmax: ``(H_kv, D)`` largest |x| of each channel over all tokens.
        threshold: the multiple of the median (> 1).
    """
    check_threshold(threshold)
    if absmax.dim() != 2:
        raise ValueError(f"absmax must be (H_kv, D), got shape {tuple(absmax.shape)}")
    mask = absmax.float() > threshold * channel_median(absmax)  # NaN (a head of zeros) compares False
    return [[int(h), int(c)] for h, c in mask.nonzero().tolist()]


def outlier_mask(channels: list[list[int]], n_heads: int, head_dim: int) -> torch.Tensor:
    """Bool ``(H_kv, D)`` mask of ``[[head, channel], ...]``."""
    mask = torch.zeros(n_heads, head_dim, dtype=torch.bool)
    for h, c in channels:
        mask[h, c] = True
    return mask


def range_used_per_token(sample: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per head: median over sampled tokens of ``max|x|`` over non-outlier channels / ``max|x|`` overall.

    Args:
        sample: ``(N, H_kv, T, D)`` sampled values.
        mask: ``(H_kv, D)`` outlier channels.
    """
    if sample.numel() == 0:
        return [float("nan")] * mask.shape[0]
    a = sample.float().abs()
    full = a.amax(-1)  # (N, H, T)
    rest = a.masked_fill(mask[None, :, None, :].to(a.device), 0.0).amax(-1)
    ratio = torch.where(
        full > 0, rest / full.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(full)
    )
    per_head = ratio.transpose(0, 1).reshape(mask.shape[0], -1)
    return [float(v) for v in per_head.median(dim=-1).values]


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``10 log10(Σ x² / Σ (x - x̂)²)``; ``inf`` for an exact reconstruction."""
    signal = float(x.double().pow(2).sum())
    noise = float((x.double() - x_hat.double()).pow(2).sum())
    if noise == 0:
        return float("inf")
    if signal == 0:
        return float("-inf")
    return 10 * math.log10(signal / noise)


def int_sqnr(sample: torch.Tensor, granularity: str, *, bits: int = 4, group: int = 128) -> float:
    """SQNR of int ``bits`` asymmetric fake quantization of ``sample`` ``(N, H_kv, T, D)``.

    ``granularity="token"``: one scale per (token, head) over ``D``; ``"channel"``: one scale per
    (head, channel) over ``group`` tokens (``T`` must be a multiple of ``group``).
    """
    from kvbits.quant import fake_quantize

    if sample.numel() == 0:
        return float("nan")
    if granularity == "token":
        spec = TensorSpec(kind="int", bits=bits, fmt=None, granularity="token")
    elif granularity == "channel":
        spec = TensorSpec(kind="int", bits=bits, fmt=None, granularity="channel", group_size=group)
    else:
        raise ValueError(f"granularity must be 'token' or 'channel', got {granularity!r}")
    x = sample.float()
    return sqnr_db(x, fake_quantize(x, spec))


def smeared_pairs(pre: list[list[int]], post: list[list[int]], rot_dim: int) -> list[dict[str, Any]]:
    """Pre-RoPE outlier channels whose rotation partner ``c ± D_rot/2`` is an outlier after RoPE.

    RoPE mixes channel ``c`` with ``c + D_rot/2`` (rotate-half layout), so an outlier channel's
    energy spreads over its pair: after RoPE both channels are large, and their magnitudes vary with
    position (KVQuant §3.2).
    """
    if rot_dim <= 0:
        return []
    half = rot_dim // 2
    post_set = {(h, c) for h, c in post}
    out = []
    for h, c in pre:
        if c >= rot_dim:
            continue
        partner = c + half if c < half else c - half
        if (h, partner) in post_set:
            out.append({"head": h, "channel": c, "partner": partner})
    return out


def _fmt_db(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.1f} dB"


def _figure(value: float | str | None) -> float:
    """A row's figure as a float: a number as is; ``"NaN"`` / ``"+Inf"`` / ``"-Inf"`` (how ``analysis.json`` writes a
    non-finite figure, :mod:`kvbits._json`, read by a plain JSON parser) as the float it stands for; ``None`` (how files
    written before wrote every non-finite figure) as NaN."""
    from kvbits._json import NON_FINITE

    if value is None:
        return math.nan
    if isinstance(value, str):
        if value not in NON_FINITE:
            raise ValueError(f"a figure is a string ({value[:40]!r}); expected a number, null, or one of {sorted(NON_FINITE)}")
        return NON_FINITE[value]
    return float(value)


def _mean(values: list[float | str | None]) -> float:
    """Mean of the finite values (:func:`_figure`); NaN where none is."""
    vals = [f for f in map(_figure, values) if math.isfinite(f)]
    return sum(vals) / len(vals) if vals else float("nan")


def calibration_text(data: str | None) -> str:
    """The registry text ``next_steps`` calibrates on: ``pride-and-prejudice``, or ``war-and-peace`` where ``data`` (the
    text evaluated: a registry name or a path) is Pride and Prejudice, so the calibration never saw the K/V scored."""
    from pathlib import PurePath

    from kvbits.evaluate.data import TEXTS

    first, second = "pride-and-prejudice", "war-and-peace"
    same = data is not None and (data == first or PurePath(data).name == PurePath(TEXTS[first].relpath).name)
    return second if same else first


def recommend(
    layers: list[dict[str, Any]],
    *,
    layer_fraction: float = DEFAULT_LAYER_FRACTION,
    bits: int = 4,
    threshold: float = DEFAULT_THRESHOLD,
    model: str | None = None,
    data: str | None = None,
    context: int | None = None,
    keys_rotated_unseen: bool = False,
    pre_rope_refused: str | None = None,
) -> dict[str, Any]:
    """The decision flow's answer from per-layer summaries (``Analysis.to_dict()["layers"]`` rows).

    Keys go per-channel when more than ``layer_fraction`` of layers have pre-RoPE key outlier
    channels, and pre-RoPE when per-channel SQNR is at least as good before RoPE as after it (it
    is when outlier channels are consistent, KVQuant §3.2); otherwise per-token. Values stay
    per-token (KIVI §3: per-channel values collapse). Then calibrate, then verify by length. The
    calibrated schemes named follow the same side of RoPE: ``kvquant-{bits}`` and
    ``int{bits}-token-smooth-prerope`` only when pre-RoPE keys came out better, ``int{bits}-token-smooth``
    (after RoPE) otherwise.

    ``model``, ``data``, ``context``: the analysis' own, carried into ``next_steps`` (calibrate and eval at the
    context the outliers were measured at; ``kvbits calibrate`` would otherwise take its default 2048 tokens).

    ``bits`` picks the schemes named (``int{bits}-token``, ``int{bits}-channel``, ...); the SQNR figures quoted
    are the rows' own, int4 whatever ``bits``.

    ``keys_rotated_unseen``: the model rotates its keys in a way kvbits can not reproduce (interleaved pairs), so
    the key figures are from before RoPE while the cache quantizes them after it; the reason says so. A row's own
    ``keys_rotated_unseen`` (as ``analysis.json`` writes it; absent in files written before it: False) counts too.

    ``pre_rope_refused``: why the model can not cache its keys before RoPE although kvbits reproduces its RoPE on
    text tokens (``kvbits.plan.positions.pre_rope_problem``: multimodal RoPE, Qwen2-VL / Qwen3.5 style), so no
    pre-RoPE scheme is named (the planner and the caches refuse them); a row's own ``pre_rope_refused`` counts too.

    With outlier channels, ``per_token_scheme`` names the calibrated per-token alternative for deployments
    that need one scale per token (``int{bits}-token-smooth-prerope``), calibrated and verified beside.
    """
    from kvbits.schemes import list_schemes

    if not layers:
        raise ValueError("no layers to recommend from")
    check_layer_fraction(layer_fraction)
    check_threshold(threshold)
    n = len(layers)
    keys_rotated_unseen = keys_rotated_unseen or any(r.get("keys_rotated_unseen") is True for r in layers)
    if pre_rope_refused is None:
        pre_rope_refused = next((r["pre_rope_refused"] for r in layers if r.get("pre_rope_refused")), None)
    k_pre = [r["layer"] for r in layers if r["key_outlier_channels_pre_rope"]]
    k_post = [r["layer"] for r in layers if r["key_outlier_channels_post_rope"]]
    v_out = [r["layer"] for r in layers if r["value_outlier_channels"]]
    frac = len(k_pre) / n
    pre_tok = _mean([r["key_pre_rope"]["sqnr_int4_token"] for r in layers])
    pre_ch = _mean([r["key_pre_rope"]["sqnr_int4_channel"] for r in layers])
    has_post = all(r.get("key_post_rope") for r in layers)
    post_tok = _mean([r["key_post_rope"]["sqnr_int4_token"] for r in layers]) if has_post else float("nan")
    post_ch = _mean([r["key_post_rope"]["sqnr_int4_channel"] for r in layers]) if has_post else float("nan")
    v_tok = _mean([r["value"]["sqnr_int4_token"] for r in layers])
    v_ch = _mean([r["value"]["sqnr_int4_channel"] for r in layers])
    used = [r["key_pre_rope"]["range_used_per_token"] for r in layers]
    worst = min((v for v in map(_figure, used) if not math.isnan(v)), default=float("nan"))
    names = {s.name for s in list_schemes()}
    # the schemes the answer names must run: per-token and per-channel keys at these bits
    allowed = sorted(b for b in range(1, 17) if {f"int{b}-token", f"int{b}-channel"} <= names)
    if isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"bits must be one of {allowed} (int<bits>-token and int<bits>-channel registered), got {bits!r}")

    # without RoPE statistics: the keys as the model caches them, unless its RoPE could not be reproduced
    pre = "pre-RoPE " if has_post or keys_rotated_unseen else ""
    facts = (
        f"{pre}key outlier channels (absmax > {threshold:g}x the head's median live channel) in "
        f"{len(k_pre)}/{n} layers ({frac:.0%}; rule: > {layer_fraction:.0%})"
    )
    if has_post:
        facts += f", post-RoPE in {len(k_post)}/{n}"
    facts += (
        f"; mean int4 key SQNR {pre}per-token {_fmt_db(pre_tok)} vs per-channel {_fmt_db(pre_ch)}"
    )
    if has_post:
        facts += f", post-RoPE per-token {_fmt_db(post_tok)} vs per-channel {_fmt_db(post_ch)}"
    if not math.isnan(worst) and worst < 1:
        facts += (
            f"; under per-token scaling ordinary key channels use as little as {worst:.2f} of the range "
            f"(~{math.log2(1 / max(worst, 1e-6)):.1f} bits lost)"
        )
    if frac > layer_fraction:
        # without post-RoPE statistics (no RoPE kvbits can apply: none, or interleaved pairs) no pre-RoPE scheme
        # runs on this model: keys are quantized as the model caches them
        pre_better = has_post and not (post_ch > pre_ch) and pre_rope_refused is None
        keys = "per-channel, pre-RoPE" if pre_better else "per-channel, post-RoPE" if has_post else "per-channel"
        candidates = (
            [f"int{bits}-channel-prerope", f"int{bits}-channel"] if pre_better else [f"int{bits}-channel"]
        )
        scheme = next((c for c in candidates if c in names), f"int{bits}-channel")
        reason = f"{facts}. Outlier channels dominate the per-token range, so keys get one scale per channel"
        if pre_better:
            reason += (
                f"; before RoPE the channels are consistent (per-channel SQNR {_fmt_db(pre_ch)} pre vs "
                f"{_fmt_db(post_ch)} post), so quantize keys before RoPE"
            )
        elif has_post and pre_rope_refused is not None:  # pre-RoPE keys would not run on this model
            reason += (
                f"; the model {pre_rope_refused}, so no pre-RoPE scheme (KVQuant's included) runs on it: quantize "
                f"keys after RoPE (per-channel SQNR {_fmt_db(post_ch)} post vs {_fmt_db(pre_ch)} pre)"
            )
        elif has_post:  # the measured keys say after RoPE: no pre-RoPE scheme, calibrated or not, is named
            reason += (
                f"; after RoPE the channels quantize better (per-channel SQNR {_fmt_db(post_ch)} post vs "
                f"{_fmt_db(pre_ch)} pre), so quantize keys after RoPE"
            )
        if not has_post:
            reason += (
                "; no post-RoPE statistics (the model has no RoPE that kvbits applies), so no pre-RoPE scheme "
                "(KVQuant's included) runs on it: keys are quantized as the model caches them"
            )
        if scheme != candidates[0]:
            reason += f" ({candidates[0]} is not registered yet; {scheme} quantizes post-RoPE keys meanwhile)"
        calibrated = f"kvquant-{bits}" if pre_better and f"kvquant-{bits}" in names else None  # pre-RoPE keys
        # per-token keys with the channels' bias removed before coding (BENCHMARKS §21, §17e-f), on the side of
        # RoPE the per-channel figures favour
        smooth = f"int{bits}-token-smooth-prerope" if pre_better else f"int{bits}-token-smooth"
        per_token = smooth if smooth in names else None
        if per_token:
            reason += (
                f". If keys must stay per-token (one scale per token and head, as some engines store them), "
                f"{per_token} keeps them so, centred and smoothed per channel"
                f"{' before RoPE' if pre_better else ' after RoPE' if has_post else ''} by calibrated vectors"
            )
    else:
        keys = "per-token"
        scheme = f"int{bits}-token"
        reason = f"{facts}. Few layers have outlier key channels, so per-token keys lose little"
        calibrated = per_token = None
    if keys_rotated_unseen:
        reason += (
            "; the key figures are from before RoPE, which this model applies in a layout kvbits can not reproduce "
            "(interleaved pairs), and the cache stores keys after it: verify by length with kvbits eval"
        )
    reason += (
        f". Values per-token (mean int4 value SQNR per-token {_fmt_db(v_tok)}, per-channel {_fmt_db(v_ch)}"
        + (f"; value outlier channels in {len(v_out)}/{n} layers" if v_out else "")
        + ")."
    )
    # runnable as printed: eval needs --data, and a calibrated scheme the folder calibrate writes
    m = f" --model {shlex.quote(model)}" if model else " --model MODEL"  # a path with spaces: one argument
    d = f" --data {shlex.quote(data)}" if data else " --data TEXT"
    t = f" --context {context}" if context else ""
    to_calibrate = [c for c in (calibrated, per_token) if c]
    # calibrated on another text than the one evaluated: scales and codebooks fitted to the windows eval scores
    # flatter the scheme (kvbits.evaluate.calib_text says by how much)
    cd = f" --data {calibration_text(data)}"
    why = f"calibrate (on {'another text than ' + repr(data) if data else 'a text other than the one evaluated'}, " \
        "which would flatter the calibrated scheme)"  # fmt: skip
    next_steps = [f"{why}: kvbits calibrate{m}{cd}{t} --scheme {c} --out calib-{c}" for c in to_calibrate]
    next_steps.append(
        f"verify by length: kvbits eval{m}{d}{t} --scheme {scheme}"  # each --calibration goes to the scheme it
        + "".join(f" --scheme {c}" for c in to_calibrate)  # records (not by position): listed after the schemes
        + "".join(f" --calibration calib-{c}" for c in to_calibrate)
        + (" and at longer --context lengths" if context else " at several --context lengths")
    )
    return {
        "keys": keys,
        "values": "per-token",
        "scheme": scheme,
        "calibrated_scheme": calibrated,
        "per_token_scheme": per_token,
        "reason": reason,
        "next_steps": next_steps,
        "layers_with_key_outliers_pre_rope": k_pre,
        "layers_with_key_outliers_post_rope": k_post,
        "layers_with_value_outliers": v_out,
        "layer_fraction_rule": layer_fraction,
    }
