"""The report's blocks (:mod:`.document`) as one self-contained HTML page: inline CSS, figures
embedded as base64 PNG, ``**bold**``/``*italic*``/```code``` spans of the text rendered."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from kvbits.report.document import Block, Code, Figure, Heading, Meta, Para, Table
from kvbits.report.inline import code_content, hide_escapes, show_escapes, split_code_spans, unescape
from kvbits.report.tables import TableData

__all__ = ["to_html"]

_CSS = """
body{font:15px/1.5 -apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1f2328;
 max-width:1100px;margin:2em auto;padding:0 1.2em}
h1{font-size:1.6em;border-bottom:1px solid #d0d7de;padding-bottom:.3em}
h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #eaeef2;padding-bottom:.2em}
ul.meta{list-style:none;padding:0;color:#444}ul.meta li{margin:.1em 0}
p.verdict{background:#f6f8fa;border-left:4px solid #0969da;padding:.8em 1em}
p.warning{background:#fff8c5;border-left:4px solid #bf8700;padding:.5em 1em}
table{border-collapse:collapse;margin:.4em 0 1.2em;font-variant-numeric:tabular-nums;font-size:14px}
th,td{border:1px solid #d0d7de;padding:.3em .6em}th{background:#f6f8fa}
td.r,th.r{text-align:right}td.bad{background:#ffebe9;color:#a40e26;font-weight:600}
td.good{color:#1a7f37}td.muted{color:#8c959f}
.caption{color:#57606a;font-size:13px;margin:.2em 0}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eaeef2}
figcaption{color:#57606a;font-size:13px}
code{background:#f6f8fa;padding:.1em .3em;border-radius:4px;font-size:90%}
pre{background:#f6f8fa;padding:.8em 1em;overflow-x:auto;border-radius:6px}
"""


def _inline(text: str) -> str:
    """Escape, then render ``**bold**``, ``*italic*`` and ```code``` spans; a code span is taken as it is (a path
    ``/corpora/*/part-*.txt`` stays that, not ``/corpora/<em>/part-</em>.txt``), and a character escaped by
    :func:`~.inline.text` (a name's ``*`` or backtick) is shown, not read as markup."""
    parts = split_code_spans(text)
    codes = [f"<code>{html.escape(code_content(p), quote=False)}</code>" for p in parts[1::2]]
    # each code span as a placeholder (\x01<n>\x01, not markup, not a word character) while bold and italic are
    # rendered, so an emphasis around a code span (*see `tokens/`.*) is one <em>, not two literal asterisks
    # (a \x01 of the text itself is hidden as show_escapes' \0<code point>\0 meanwhile)
    s = "".join(
        f"\x01{i // 2}\x01" if i % 2 else hide_escapes(html.escape(p, quote=False)).replace("\x01", "\x001\x00")
        for i, p in enumerate(parts)
    )
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
    s = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", s)
    return show_escapes(re.sub("\x01(\\d+)\x01", lambda m: codes[int(m.group(1))], s))


def _cls(*names: str) -> str:
    joined = " ".join(n for n in names if n)
    return f' class="{joined}"' if joined else ""


def _html_table(t: TableData) -> str:
    head = "".join(f"<th{_cls('r' if i in t.right else '')}>{html.escape(h)}</th>" for i, h in enumerate(t.headers))
    rows = [f"<tr>{head}</tr>"]
    for row in t.rows:
        tds = "".join(
            f"<td{_cls('r' if i in t.right else '', c.tone)}>{html.escape(c.text)}</td>" for i, c in enumerate(row)
        )
        rows.append(f"<tr>{tds}</tr>")
    cap = f'<p class="caption">{_inline(t.caption)}</p>' if t.caption else ""
    return cap + "<table>" + "".join(rows) + "</table>"


def to_html(blocks: list[Block], title: str) -> str:
    body = []
    after_verdict = False
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
            after_verdict = b.text == "Verdict"
        elif isinstance(b, Para):
            cls = ' class="verdict"' if after_verdict else ' class="warning"' if b.text.startswith("Warning:") else ""
            body.append(f"<p{cls}>{_inline(b.text)}</p>")
            after_verdict = False
        elif isinstance(b, Meta):
            items = "".join(f"<li><strong>{html.escape(k)}:</strong> {_inline(v)}</li>" for k, v in b.items)
            body.append(f'<ul class="meta">{items}</ul>')
        elif isinstance(b, Table):
            body.append(_html_table(b.data))
        elif isinstance(b, Figure):
            data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
            alt = html.escape(b.alt, quote=True)
            body.append(
                f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
        elif isinstance(b, Code):
            body.append(f"<pre><code>{html.escape(b.text)}</code></pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(unescape(title))}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
