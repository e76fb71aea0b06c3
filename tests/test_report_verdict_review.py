"""The verdict's numbers as the ΔPPL table prints them, and its wording with incomplete schemes (summaryrev review)."""

from __future__ import annotations

import math
from typing import Any

from kvbits.report import verdict
from kvbits.report.tables import delta_table


def _summary(schemes: dict[str, tuple[float, list[float], list[list[float]] | None]]) -> dict[str, Any]:
    """A two-bucket run (0–1K, 1K–2K); per scheme ``(bits, deltas, cis)`` (NaN delta: no PPL either)."""
    spans, ref = [(0, 1024), (1024, 2047)], 20.0
    results = []
    for name, (bits, deltas, cis) in schemes.items():
        buckets = [
            {"lo": lo, "hi": hi, "tokens": hi - lo, "ppl": ref * (1 + d), "ppl_ref": ref, "delta_rel": d,
             "delta_rel_ci": cis[i] if cis else None}
            for i, ((lo, hi), d) in enumerate(zip(spans, deltas))
        ]  # fmt: skip
        worst = max((d for d in deltas if not math.isnan(d)), default=math.nan)
        results.append({"scheme": name, "avg_bits": bits, "ppl": ref * (1 + worst), "ppl_ref": ref, "buckets": buckets})
    return {"model": "m", "data": "d", "context": 2048, "semantics": "decode", "mode": "simulate", "windows": 4,
            "results": results}  # fmt: skip


def _cells(s: dict[str, Any]) -> set[str]:
    return {c.text for row in delta_table(s).rows for c in row}


def test_growth_sentence_prints_bucket_deltas_as_the_table_does():
    """A first bucket of +0.99996 % (within the 1 % budget) read "+1.00%" in "Damage grows along the context", a
    figure the table (+0.99996%) did not show and one that reads as the budget itself."""
    s = _summary({"k2": (2.0, [0.0099996, 0.5], None)})
    v = verdict(s)
    assert "Damage grows along the context for **k2** (+0.99996% at 0–1K → +50.00% at 1K–2K)" in v, v
    assert "+0.99996%" in _cells(s)


def test_baseline_warning_prints_its_delta_as_the_table_does():
    s = _summary({"fp16": (16.0, [0.0, 0.0100004], None), "k8": (8.0, [0.0, 0.0], None)})
    v = verdict(s)
    assert "differs from the reference by up to +1.00004%" in v, v
    assert "+1.00004%" in _cells(s)


def test_least_damaging_names_what_it_was_picked_from_when_a_scheme_is_incomplete():
    """A scheme within budget where measured but with a bucket missing is not a pass, so the failing scheme the
    verdict then names was called "Least damaging quantized scheme" although the incomplete one did less damage."""
    s = _summary({"k4": (4.0, [0.001, math.nan], None), "k2": (2.0, [0.5, 0.6], None)})
    v = verdict(s)
    assert "Not judged: **k4**" in v
    assert "Least damaging quantized scheme" not in v, v
    assert "Least damaging of the schemes above 1%: **k2**" in v, v
    # without an incomplete scheme the failing pick is the least damaging of all, and says so
    v = verdict(_summary({"k4": (4.0, [0.02, 0.03], None), "k2": (2.0, [0.5, 0.6], None)}))
    assert "Least damaging quantized scheme: **k4**" in v, v
