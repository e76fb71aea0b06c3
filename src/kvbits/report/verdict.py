"""The verdict: one paragraph computed from a run's numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvbits.report.fmt import (
    DEFAULT_THRESHOLD,
    _ok,
    bucket_label,
    fmt_budget,
    fmt_ci_bound,
    fmt_judged,
    fmt_pos,
)
from kvbits.report.inline import text
from kvbits.report.summary import RunSummary, SchemeResult, _bucket_at

__all__ = ["IMPLAUSIBLE_GAIN", "verdict"]

IMPLAUSIBLE_GAIN = 0.01
"""A quantized scheme's bucket ΔPPL below ``-IMPLAUSIBLE_GAIN`` (1 % lower perplexity than the unquantized reference)
whose 95 % CI lies wholly below zero (the gain is larger than the CI's noise) is flagged in the verdict. Rounding
the cache adds error to every attention read; a gain that large and that certain more often means a broken comparison
(another baseline, other tokens, a cache that was bypassed) than a better cache. A bucket without a CI is not flagged:
its noise is unknown. The 1 % is the default ΔPPL budget mirrored: a gain as large as the loss that fails a scheme."""


def _join(names: list[str]) -> str:
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def _unjudged_labels(r: SchemeResult, spans: list[tuple[int, int]]) -> str:
    """``1K–2K, 4K–8K``: the run's buckets (``spans``) where ``r`` has no ΔPPL (NaN, or no such bucket)."""
    return ", ".join(bucket_label(*s) for s in spans if (b := _bucket_at(r, s)) is None or not b.judged)


def _incomplete(schemes: list[SchemeResult], thr: str, spans: list[tuple[int, int]]) -> str:
    """The sentence for schemes within ``thr`` wherever measured but with buckets without a ΔPPL: not passes."""
    one = len(schemes) == 1
    items = _join([f"**{text(r.name)}** (no ΔPPL at {_unjudged_labels(r, spans)})" for r in schemes])
    return (
        f"Not judged: {items} {'is' if one else 'are'} incomplete (ΔPPL missing or NaN in summary.json), "
        f"not {'a pass' if one else 'passes'}; {'it stays' if one else 'they stay'} within {thr} in the "
        f"buckets {'it has' if one else 'they have'}."
    )


def _implausible(r: SchemeResult, threshold: float) -> list[str]:
    """``1K–2K (-2.19%, 95% CI -4.06% to -0.40%)`` for each bucket of ``r`` below ``-IMPLAUSIBLE_GAIN`` with its
    whole 95 % CI below zero, its ΔPPL printed as the delta table prints it against ``threshold``."""
    return [
        f"{b.label} ({fmt_judged(b.delta, threshold)}, 95% CI {fmt_ci_bound(b.ci[0])}% to {fmt_ci_bound(b.ci[1])}%)"
        for b in r.buckets
        if _ok(b.delta) and b.delta < -IMPLAUSIBLE_GAIN and _ok(b.ci[0]) and _ok(b.ci[1]) and b.ci[1] < 0
    ]


def verdict(summary: RunSummary | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> str:
    """One paragraph, computed from the numbers: who stays within ``threshold`` ΔPPL in every
    position bucket, where each other scheme first exceeds it, the best bits/quality trade-off,
    and which schemes get worse along the context. Inline ``**bold**`` marks scheme names.

    A bucket whose ΔPPL is NaN (missing in ``summary.json``), or that a scheme lacks while others have it, is not
    judged: a scheme with one passes nowhere, it is named as incomplete; an infinite ΔPPL is a failure."""
    run = RunSummary.coerce(summary)
    thr = fmt_budget(threshold, sign=False)
    parts: list[str] = []
    if not run.results:
        return "The run holds no results."
    quant = [r for r in run.results if not r.is_baseline]
    for r in run.results:
        # the bucket furthest from the reference either way: a baseline 3 % below it is as wrong as 3 % above
        worst = max((b.delta for b in r.buckets if _ok(b.delta) or math.isinf(b.delta)), key=abs, default=math.nan)
        if r.is_baseline and not math.isnan(worst) and abs(worst) > 1e-4:
            parts.append(
                f"Warning: the unquantized **{text(r.name)}** differs from the reference by up to "
                f"{fmt_judged(worst, threshold)}, so the evaluation path itself adds error."
            )
    no_data = [r for r in quant if not any(b.judged for b in r.buckets)]
    judged = [r for r in quant if r not in no_data]
    failing = [r for r in judged if r.first_failure(threshold) is not None]
    spans = run.bucket_spans  # a scheme without one of the run's buckets was not judged there either
    incomplete = [r for r in judged if r not in failing and _unjudged_labels(r, spans)]
    passing = [r for r in judged if r not in failing and r not in incomplete]
    upto = f" up to {fmt_pos(run.context)} tokens" if run.context else ""
    if not quant:
        parts.append("Only unquantized schemes were evaluated; there is no quantization to judge.")
    elif passing:
        verb = "stays" if len(passing) == 1 else "stay"
        parts.append(
            f"{_join([f'**{text(r.name)}**' for r in passing])} {verb} within {thr} ΔPPL of the unquantized "
            f"reference in every position bucket{upto}."
        )
    elif judged:
        shown = "is shown to stay" if incomplete else "stays"
        parts.append(f"No quantized scheme {shown} within {thr} ΔPPL in every position bucket{upto}.")
    fails = []
    for r in failing:
        b = r.first_failure(threshold)
        assert b is not None
        # the run's first bucket, not the scheme's: one that lacks 0–1K fails "at 1K–2K", not "already in the first"
        where = f"already in the first bucket, {b.label}" if (b.lo, b.hi) == spans[0] else f"at {b.label}"
        # the bounds as the delta table prints them (two decimals past 100 % too, where fmt_pct prints one)
        ci = f", 95% CI {fmt_ci_bound(b.ci[0])}% to {fmt_ci_bound(b.ci[1])}%" if _ok(b.ci[0]) and _ok(b.ci[1]) else ""
        holes = f"; no ΔPPL at {_unjudged_labels(r, spans)}" if _unjudged_labels(r, spans) else ""
        fails.append(f"**{text(r.name)}** {where} ({fmt_judged(b.delta, threshold)}{ci}{holes})")
    if fails:
        parts.append(f"First bucket above {thr}: " + "; ".join(fails) + ".")
    if incomplete:
        parts.append(_incomplete(incomplete, thr, spans))
    better = [f"**{text(r.name)}** at {_join(at)}" for r in judged if (at := _implausible(r, threshold))]
    if better:
        parts.append(
            f"Check: {'; '.join(better)} {'is' if len(better) == 1 else 'are'} more than {fmt_budget(IMPLAUSIBLE_GAIN, sign=False)} "
            "below the unquantized reference beyond the 95% CI. Quantizing the cache rarely lowers perplexity: check the "
            "comparison (the reference pass, the same tokens, the cache in use); if it holds, this is noise of the "
            "sampled text, judge by KL and top-1."
        )
    ranked = passing or sorted(failing, key=lambda r: r.max_delta)[:1]
    with_bits = [r for r in ranked if _ok(r.avg_bits)]
    if with_bits or (ranked and not passing):  # the least damaging is named with or without its bits
        best = min(with_bits, key=lambda r: (r.avg_bits, r.max_delta)) if with_bits else ranked[0]
        if _ok(best.avg_bits):
            ratio = f" ({16 / best.avg_bits:.1f}× smaller than fp16)" if best.avg_bits > 0 else ""
            bits = f"{best.avg_bits:.2f} bits per element{ratio}"
            if _ok(best.bits_at_context) and round(best.bits_at_context, 2) != round(best.avg_bits, 2):
                bits += f" in the long run, {best.bits_at_context:.2f} at this {run.context:,}-token context"
        else:
            bits = "bits not recorded"
        # with incomplete schemes (within the budget where measured) the pick among the failing ones is not the least
        # damaging of all: say what it was picked from
        lead = ("Best bits/quality trade-off" if passing else
                f"Least damaging of the schemes above {thr}" if incomplete else "Least damaging quantized scheme")
        parts.append(
            f"{lead}: **{text(best.name)}**, {bits}, worst bucket {fmt_judged(best.max_delta, threshold)}, "
            f"overall {fmt_judged(best.delta, threshold)}."
        )
    grows = []
    for r in judged:
        vals = [b for b in r.buckets if _ok(b.delta)]
        if len(vals) >= 2:
            first, last = vals[0].delta, vals[-1].delta
            if last - first > max(threshold / 4, abs(first)):
                grows.append(
                    f"**{text(r.name)}** ({fmt_judged(first, threshold)} at {vals[0].label} → "
                    f"{fmt_judged(last, threshold)} at {vals[-1].label})"
                )
    if grows:
        parts.append("Damage grows along the context for " + ", ".join(grows) + ".")
    if no_data:
        parts.append(f"No bucket data for {_join([f'**{text(r.name)}**' for r in no_data])}.")
    return " ".join(parts)
