"""Report defects of review round 3: entities in Markdown, NaN speed cells, a foreign summary.json, a threshold the CLI
refuses, an infinite ΔPPL left off the bits figure unsaid, clipping rates rounded onto the warning level."""

from __future__ import annotations


def test_an_ampersand_in_a_name_is_shown_as_it_is():
    """``<``/``>`` were entities but ``&`` was not: a scheme named ``x&amp;y`` rendered as ``x&y`` in Markdown."""
    from kvbits.report.markdown import _md_text, md_cell

    assert md_cell("x&amp;y") == "x&amp;amp;y"
    assert md_cell("a&b <c>|d") == "a&amp;b &lt;c&gt;\\|d"
    assert _md_text("R&D <b> `a&b <c>`") == "R&amp;D &lt;b&gt; `a&b <c>`"  # a code span is kept as it is
