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
