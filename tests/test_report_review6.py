"""Report defects of review round 6 (reading a run as a user): a ``speed.json`` of another version rendered as if
its fields meant what this kvbits's do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_speed_json_of_another_version_is_refused_naming_it(tmp_path):
    """``check_speed`` checked that ``version`` is a whole number, not which: a ``speed.json`` of version 7 (a newer
    kvbits) was rendered silently, where a needle.json of another version is refused. It is refused now, naming the
    version read and the one this kvbits reads."""
    from kvbits.report.speed import READS_VERSION, check_speed, load_speed

    s = load_speed(RESULTS / "speed-qwen" / "speed.json")
    assert s["version"] == READS_VERSION  # the committed files still read
    path = tmp_path / "speed.json"
    path.write_text(json.dumps({**s, "version": READS_VERSION + 1}))
    with pytest.raises(ValueError, match=rf"version is {READS_VERSION + 1}; this kvbits reads speed.json version 1"):
        load_speed(path)
    with pytest.raises(ValueError, match="speed.json version"):
        check_speed({**s, "version": 0}, "speed.json")


def test_speed_report_version_matches_the_writer():
    speed = pytest.importorskip("kvbits.evaluate.speed")
    from kvbits.report.speed import READS_VERSION

    assert speed.SPEED_VERSION == READS_VERSION


def test_verdict_says_first_bucket_only_for_the_runs_first_bucket():
    """A scheme without the run's first bucket (0–1K) that fails at 1K–2K was said to fail "already in the first
    bucket, 1K–2K", beside "no ΔPPL at 0–1K"; it fails "at 1K–2K" now. A failure in the run's first bucket still
    reads "already in the first bucket"."""
    from kvbits.report.verdict import verdict

    def b(lo: int, hi: int, d: float) -> dict[str, float]:
        return {"lo": lo, "hi": hi, "delta_rel": d}

    s = {"model": "m", "data": "d", "context": 2048, "results": [
        {"scheme": "int8-token", "avg_bits": 8.5, "buckets": [b(0, 1024, 0.001), b(1024, 2047, 0.002)]},
        {"scheme": "int4-token", "avg_bits": 4.5, "buckets": [b(1024, 2047, 0.05)]},
    ]}  # fmt: skip
    text = verdict(s)
    assert "**int4-token** at 1K–2K (+5.00%; no ΔPPL at 0–1K)" in text
    assert "already in the first bucket" not in text
    s["results"][1]["buckets"] = [b(0, 1024, 0.05), b(1024, 2047, 0.05)]
    assert "**int4-token** already in the first bucket, 0–1K (+5.00%)" in verdict(s)
