"""The report's blocks (:mod:`.document`) as Markdown: GitHub tables, figures linked by relative path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvbits.report.document import Block, Code, Figure, Heading, Meta, Para, Table
from kvbits.report.inline import split_code_spans, text
from kvbits.report.tables import TableData

__all__ = ["md_cell", "to_markdown"]


def _entities(s: str) -> str:
    """``&``, ``<`` and ``>`` as entities (``&`` first): a name ``x&amp;y`` is shown as it is, not as ``x&y``."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _md_text(text: str) -> str:
    """``text`` with ``&``, ``<`` and ``>`` outside code spans as entities: names and paths from ``summary.json`` (a
    scheme JSON may name its scheme anything) are shown as they are, never rendered as HTML or read as an entity
    (``x&amp;y`` printed as ``x&y``) by viewers. A line break inside a code span is a space (as CommonMark shows it):
    a blank line in a model path ended the paragraph, and the path's ``<script>`` after it was raw HTML."""
    parts = split_code_spans(text)
    return "".join(_one_line(p) if i % 2 else _entities(p) for i, p in enumerate(parts))


def _one_line(s: str) -> str:
    return s.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def _fenced(body: str) -> str:
    """``body`` as a fenced ``bash`` block whose fence is longer than any run of backticks in it (CommonMark's rule): a
    recorded argument holding a line of three backticks closed a fixed fence, and what followed was Markdown and HTML."""
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", body)), default=0))
    return f"{fence}bash\n{body}\n{fence}"


def md_cell(s: str) -> str:
    """Plain text (a table cell, a name) as Markdown: :func:`~.inline.text`'s escapes (a backtick opens no code span,
    ``*`` no emphasis), ``&``/``<``/``>`` as entities, ``|`` escaped, a newline (which would end the row) as a space."""
    s = _entities(text(s))
    return s.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _md_table(t: TableData) -> str:
    lines = ["| " + " | ".join(md_cell(h) for h in t.headers) + " |"]
    lines.append("|" + "|".join("---:" if i in t.right else ":---" for i in range(len(t.headers))) + "|")
    for row in t.rows:
        cells = [f"**{md_cell(c.text)}**" if c.tone == "bad" and c.text else md_cell(c.text) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    return (f"*{_md_text(t.caption)}*\n\n" + out) if t.caption else out


def to_markdown(blocks: list[Block], out_dir: Path) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append("#" * b.level + " " + _md_text(b.text).replace("\n", " "))
        elif isinstance(b, Para):
            parts.append(_md_text(b.text))
        elif isinstance(b, Meta):
            parts.append("\n".join(f"- **{_md_text(k)}:** {_md_text(v)}" for k, v in b.items))
        elif isinstance(b, Table):
            parts.append(_md_table(b.data))
        elif isinstance(b, Figure):
            rel = os.path.relpath(b.path, out_dir)
            parts.append(f"![{b.alt}]({rel})\n\n*{_md_text(b.caption)}*")
        elif isinstance(b, Code):
            parts.append(_fenced(b.text))
    return "\n\n".join(parts) + "\n"
