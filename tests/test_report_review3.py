"""Report defects of review round 3: entities in Markdown, NaN speed cells, a foreign summary.json, a threshold the CLI
refuses, an infinite ΔPPL left off the bits figure unsaid, clipping rates rounded onto the warning level."""

from __future__ import annotations

import math


def test_an_ampersand_in_a_name_is_shown_as_it_is():
    """``<``/``>`` were entities but ``&`` was not: a scheme named ``x&amp;y`` rendered as ``x&y`` in Markdown."""
    from kvbits.report.markdown import _md_text, md_cell

    assert md_cell("x&amp;y") == "x&amp;amp;y"
    assert md_cell("a&b <c>|d") == "a&amp;b &lt;c&gt;\\|d"
    assert _md_text("R&D <b> `a&b <c>`") == "R&amp;D &lt;b&gt; `a&b <c>`"  # a code span is kept as it is


def test_nan_speed_figures_print_as_not_available():
    """A ``speed.json`` with ``"NaN"`` timings (check_speed accepts them: a number) printed ``nan (nanx)`` and
    ``host nan``."""
    from kvbits.report.speed import _ms_cell, _speed_cell

    nan = math.nan
    assert _speed_cell({"tokens_per_s": nan, "speedup": nan}) == "n/a"
    assert _speed_cell({"tokens_per_s": 12.34, "speedup": nan}) == "12.3"
    assert _speed_cell({"tokens_per_s": 12.34, "speedup": 0.5}) == "12.3 (0.50x)"  # as before
    ms = {"ms_per_step": nan, "ms_p10": 1.0, "ms_p90": 2.0, "host_ms_per_step": nan}
    assert _ms_cell(ms) == "n/a [1.00–2.00], host n/a"
    assert _ms_cell({**ms, "ms_per_step": 1.5, "host_ms_per_step": 1.25}) == "1.50 [1.00–2.00], host 1.25"
