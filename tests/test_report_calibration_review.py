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


def test_the_calibrate_summary_does_not_print_a_small_clip_rate_as_zero(capsys):
    """`kvbits calibrate`'s per-layer table printed a clip rate of 3e-6 (high percentiles over many tokens) as
    ``0.000%``, which reads as nothing clipped; it prints ``<0.001%``, and an exact 0 stays ``0.000%``."""
    import torch

    from kvbits.calibrate.cli import _summary
    from kvbits.calibrate.fit import artifact_from_samples

    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=g) for _ in range(2)]
    art = artifact_from_samples("kvquant-4", k, k)
    art.meta["data"]["windows"] = 1
    art.meta["stats"][0]["key_clip_rate"] = 3e-6
    art.meta["stats"][1]["key_clip_rate"] = 0.0
    _summary(art)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip(" │|").startswith(("0 ", "1 "))]
    assert len(rows) == 2, rows
    assert "<0.001%" in rows[0] and "0.000%" not in rows[0], rows[0]
    assert "0.000%" in rows[1], rows[1]


@pytest.mark.parametrize(("record", "error"), [
    ({"integer_zero": 1}, r"vllm-int4: calibration\.integer_zero is a number \(1\); expected a list"),
    ({"positions_beyond_calibrated": -5}, r"calibration\.positions_beyond_calibrated is a number \(-5\); expected a whole"),
    ({"max_calibrated_length": -1}, r"calibration\.max_calibrated_length is a number \(-1\); expected a whole"),
])  # fmt: skip
def test_a_malformed_calibration_record_is_a_clear_error(record, error):
    """A record passed straight to ``calibration_row`` (not through ``RunSummary``, which names the file): a
    non-list ``integer_zero`` raised TypeError ('int' object is not iterable), a negative count was shown as
    "serves -5 ... positions beyond"; both are a ValueError naming the field."""
    from kvbits.report.calibration import calibration_row

    with pytest.raises(ValueError, match=error):
        calibration_row("vllm-int4", record, 200)
    assert calibration_row("vllm-int4", {"integer_zero": ["keys"], "positions_beyond_calibrated": 0}, 200).beyond == 0
