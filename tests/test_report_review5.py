"""Report defects of review round 5 (merged reports and the Markdown document): a model path or a recorded argument
with line breaks that made report.md render raw HTML."""

from __future__ import annotations

import pytest
from test_report import _summary, _write_run

from kvbits.report import write_report


def test_a_path_with_line_breaks_renders_no_html_in_report_md(tmp_path):
    """A model path ``x\\n\\n<script>`` in a code span: the blank line ended the paragraph and the ``<script>`` after it
    was a raw HTML block; a recorded argument holding a line of three backticks closed the command's fence and its
    ``<img onerror>`` was HTML. A code span's line break is a space now, and the fence outgrows any backticks inside."""
    markdown_it = pytest.importorskip("markdown_it")
    s = _summary()
    s["model"] = "/models/x\n\n<script>alert(1)</script>"
    argv = ["kvbits", "eval", "--model", "/m\n```\n<img src=x onerror=alert(2)>\n```"]
    run = _write_run(tmp_path / "r", s, {"argv": argv}, tokens=False)
    md = write_report(run, plots=False)["markdown"].read_text()
    html = markdown_it.MarkdownIt("commonmark").render(md)
    assert "<script>" not in html and "<img src=x" not in html
    assert "- **Model:** `/models/x  <script>alert(1)</script>`" in md  # the path shown, on one line
    assert "<img src=x onerror=alert(2)>" in html.replace("&lt;", "<").replace("&gt;", ">")  # shown as code text
