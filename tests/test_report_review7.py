"""Names from the JSON in report.md: no link, image or block of Markdown of their own (HTML side review)."""

from __future__ import annotations

import pytest
from test_report import SCHEMES, _config, _summary, _write_run

from kvbits.report import write_report

pytest.importorskip("matplotlib")


def _render(md: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").render(md)


def test_a_name_with_link_or_image_markdown_stays_text(tmp_path):
    """``text`` escaped backticks, ``*`` and ``_`` but not ``[``: a scheme ``![i](http://host/x.png)`` was an image
    in report.md (fetched from that host by a viewer), a model ``[c](http://host)`` a link; report.html showed both
    as text. Now both show them as text."""
    img, link = "![i](http://host/x.png)", "[c](http://host)"
    s = _summary({"fp16": SCHEMES["fp16"], img: SCHEMES["kivi-2"]})
    s.update(model=link, data="/d/" + link)
    paths = write_report(_write_run(tmp_path / "run", s, _config(), tokens=False), plots=False)
    as_read = _render(paths["markdown"].read_text())
    assert "<img" not in as_read and "<a " not in as_read
    assert f"<strong>{img}</strong> already in the first bucket" in as_read
    assert f"report: {link} on /d/{link}, 8K context</h1>" in as_read
    assert f">{img}</td>" in as_read
    page = paths["html"].read_text()
    assert f"<strong>{img}</strong> already in the first bucket" in page and "<img" not in page


def test_a_line_break_in_a_name_adds_no_block_to_report_md(tmp_path):
    """A blank line in a model name or scheme name (outside code spans) ended the heading or paragraph, and what
    followed (``# All schemes pass``) was a heading of its own in report.md; a ``\\r`` cut the title. The ``date`` of
    config.json went into the list raw (``**x**`` bold). Now a line break is a space and the date is text."""
    fake = "x\n\n# All schemes pass\r\n\n- ok"
    s = _summary({"fp16": SCHEMES["fp16"], "k" + fake: SCHEMES["kivi-2"]})
    s.update(model="m" + fake, data="d\rz")
    cfg = _config()
    cfg["date"] = "**2026**\n\n# d"
    paths = write_report(_write_run(tmp_path / "run", s, cfg, tokens=False), plots=False)
    md = paths["markdown"].read_text()
    as_read = _render(md)
    assert as_read.count("<h1>") == 1 and "<h1>All schemes pass" not in as_read and "<h1>d</h1>" not in as_read
    assert "<li>ok" not in as_read
    assert "report: mx  # All schemes pass  - ok on d z, 8K context</h1>" in as_read
    assert "<strong>kx  # All schemes pass  - ok</strong> already in the first bucket" in as_read
    assert "- **Date:** \\*\\*2026\\*\\*  # d\n" in md
    page = paths["html"].read_text()
    assert "<strong>Date:</strong> **2026**  # d</li>" in page
    assert "<title>KV-cache quantization report: mx  # All schemes pass  - ok on d z, 8K context</title>" in page


def test_link_markdown_split_over_two_names_stays_text(tmp_path):
    """Two names in one verdict, ``a[b`` and ``](http://host)``, made one link of the text between them."""
    from kvbits.report.inline import text, unescape

    s = _summary({"fp16": SCHEMES["fp16"], "a[b": SCHEMES["kivi-2"], "](http://host)": SCHEMES["kivi-2"]})
    paths = write_report(_write_run(tmp_path / "run", s, _config(), tokens=False), plots=False)
    as_read = _render(paths["markdown"].read_text())
    assert "<a " not in as_read and "<strong>](http://host)</strong>" in as_read
    for name in ("a[b", "](x)", "][", "\\](x)", "[+2.05, +3.95]"):
        assert unescape(text(name)) == name
    assert text("[+2.05, +3.95]") == "[+2.05, +3.95]"  # a CI is kept as it is
