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
