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


def test_a_merge_of_a_merge_reproduces_with_the_commands_that_ran(tmp_path):
    """Merging a merged folder ``m`` (of ``a`` and ``b``) with ``c``: "How to reproduce" gave ``kvbits eval`` of all
    ``m``'s schemes ``--out m``, a command that never ran; it gives ``a``'s and ``b``'s commands and the ``kvbits
    report a b --out m`` that made ``m`` now."""
    from test_report import SCHEMES

    from kvbits.report.merge import merge_runs

    def run(name: str, keys: list[str]):
        argv = ["kvbits", "eval", *(x for k in keys for x in ("--scheme", k)), "--out", str(tmp_path / name)]
        return _write_run(tmp_path / name, _summary({k: SCHEMES[k] for k in keys}), {"argv": argv}, tokens=False)

    a, b, c = run("a", ["fp16", "int8-token"]), run("b", ["kivi-4"]), run("c", ["kivi-2"])
    m = merge_runs([a, b], tmp_path / "m")
    md = write_report(merge_runs([m, c], tmp_path / "mm"), plots=False)["markdown"].read_text()
    block = md[md.index("## How to reproduce"):].split("\n")[3:8]
    assert block == [
        f"kvbits eval --scheme fp16 --scheme int8-token --out {a}",
        f"kvbits eval --scheme kivi-4 --out {b}",
        f"kvbits report {a} {b} --out {m}",
        f"kvbits eval --scheme kivi-2 --out {c}",
        f"kvbits report {m} {c} --out {tmp_path / 'mm'}",
    ]
