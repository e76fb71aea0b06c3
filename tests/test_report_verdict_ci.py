"""The verdict's CI bounds as the ΔPPL table prints them, and its flag for a scheme implausibly better than the
unquantized reference (verdict review)."""

from __future__ import annotations

from typing import Any

from kvbits.report import verdict
from kvbits.report.fmt import fmt_ci, fmt_ci_bound
from kvbits.report.tables import delta_table


def _run(deltas: list[float], cis: list[list[float]], name: str = "int2-token") -> dict[str, Any]:
    """A two-bucket run (0–1K, 1K–2K) of one quantized scheme with these bucket ΔPPLs and 95 % CIs (fractions)."""
    spans, ref = [(0, 1024), (1024, 2047)], 20.0
    buckets = [
        {"lo": lo, "hi": hi, "tokens": hi - lo, "ppl": ref * (1 + d), "ppl_ref": ref, "delta_rel": d,
         "delta_rel_ci": ci}
        for (lo, hi), d, ci in zip(spans, deltas, cis)
    ]  # fmt: skip
    worst = max(deltas)
    return {"model": "m", "data": "d", "context": 2048, "semantics": "decode", "mode": "simulate", "windows": 4,
            "results": [{"scheme": name, "avg_bits": 2.5, "ppl": ref * (1 + worst), "ppl_ref": ref,
                         "buckets": buckets}]}  # fmt: skip


def test_verdict_ci_bounds_past_100_percent_print_as_the_table_does():
    """Past 100 % the verdict printed its CI bounds with fmt_pct's one decimal (``+112.4% to +134.6%``) while the
    delta table printed ``[+112.34, +134.56]``: one shared formatter now prints both."""
    s = _run([1.2345, 2.0], [[1.12351, 1.34556], [1.9, 2.1]])
    v = verdict(s)
    assert "(+123.4%, 95% CI +112.35% to +134.56%)" in v, v
    assert "+123.4% [+112.35, +134.56]" in {c.text for row in delta_table(s).rows for c in row}


def test_ci_bound_formatter_is_the_tables():
    for lo, hi in [(-0.00001, 0.0042), (0.99996, 1.00004), (12.3456, 1e8)]:
        assert fmt_ci((lo, hi)) == f"[{fmt_ci_bound(lo)}, {fmt_ci_bound(hi)}]"
    assert fmt_ci_bound(-0.00001) == "+0.00"
    assert fmt_ci_bound(0.99996) == "+100.00"


def test_verdict_flags_a_scheme_far_below_the_reference_beyond_its_ci():
    """A quantized scheme 8 % below the unquantized reference with a CI wholly below zero (most often a broken
    comparison: another baseline, other tokens, a bypassed cache) passed with no word of warning."""
    v = verdict(_run([-0.08, -0.0205], [[-0.10, -0.06], [-0.03, -0.011]], name="int4-token"))
    assert "**int4-token** stays within 1% ΔPPL" in v, v
    assert ("Check: **int4-token** at 0–1K (-8.00%, 95% CI -10.00% to -6.00%) and 1K–2K (-2.05%, 95% CI -3.00% to "
            "-1.10%) is more than 1% below the unquantized reference beyond the 95% CI.") in v, v
    assert "judge by KL and top-1" in v


def test_verdict_does_not_flag_a_gain_within_noise_or_the_budget():
    """No flag for a gain whose CI reaches zero (noise), one within 1 % (however certain), or one without a CI."""
    for deltas, cis in [
        ([-0.03, -0.02], [[-0.06, 0.001], [-0.04, 0.0]]),  # CI reaches zero
        ([-0.009, -0.0099], [[-0.0095, -0.0085], [-0.011, -0.009]]),  # certain but within 1 %
        ([-0.05, -0.05], [None, None]),  # no CI: its noise is unknown
        ([0.002, 0.004], [[0.0, 0.004], [0.001, 0.007]]),  # an ordinary pass
    ]:
        v = verdict(_run(deltas, cis))
        assert "Check:" not in v, (deltas, v)
