"""The calibration report (``kvbits.report.calibration``) on inputs it met as a user would: folders recorded in
``config.json`` that no longer hold a calibration record."""

from __future__ import annotations

import json
import logging

import pytest

from kvbits.report.calibration import calibration_rows


@pytest.mark.parametrize("meta", [{"scheme": "kvquant-2"}, {"scheme": ["kvquant-2"]}, ["kvquant-2"], "kvquant-2"])
def test_a_recorded_folder_whose_calibration_json_is_not_a_record_is_named_not_found(tmp_path, caplog, meta):
    """A calibration.json whose ``scheme`` is not an object (hand-edited, another tool's file) in a folder config.json
    records made the whole report fail with AttributeError ('str' object has no attribute 'get'); it is not the
    run's artifact, so the row says the calibration folder is gone or replaced, as for any other folder."""
    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps(meta), encoding="utf-8")
    summary = {"context": 1024, "results": [{"scheme": "kvquant-2", "calibration": {"clipped_keys": 3,
                                                                                    "clipped_keys_frac": 0.002}}]}
    config = {"request": {"calibration": {"kvquant-2": "sha256:" + "a" * 64}}, "args": {"calibration": [str(cal)]}}
    with caplog.at_level(logging.WARNING, logger="kvbits.report.calibration"):
        rows = calibration_rows(summary, config, tmp_path)
    assert [r.scheme for r in rows] == ["kvquant-2"]
    assert rows[0].artifact == "sha256:aaaaaaaaaaaa (calibration folder gone or replaced)"
    assert rows[0].calibrated_length is None
    assert "none of the calibration folders it records" in caplog.text
