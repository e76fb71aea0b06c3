"""The report's blocks (:mod:`.document`) as Markdown: GitHub tables, figures linked by relative path."""

from __future__ import annotations

import os
from pathlib import Path

from kvbits.report.document import Block, Code, Figure, Heading, Meta, Para, Table
from kvbits.report.tables import TableData

__all__ = ["to_markdown"]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(t: TableData) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in t.headers) + " |"]
    lines.append("|" + "|".join("---:" if i in t.right else ":---" for i in range(len(t.headers))) + "|")
    for row in t.rows:
        cells = [f"**{_md_cell(c.text)}**" if c.tone == "bad" and c.text else _md_cell(c.text) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    return (f"*{t.caption}*\n\n" + out) if t.caption else out


def to_markdown(blocks: list[Block], out_dir: Path) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            parts.append(b.text)
        elif isinstance(b, Meta):
            parts.append("\n".join(f"- **{k}:** {v}" for k, v in b.items))
        elif isinstance(b, Table):
            parts.append(_md_table(b.data))
        elif isinstance(b, Figure):
            rel = os.path.relpath(b.path, out_dir)
            parts.append(f"![{b.alt}]({rel})\n\n*{b.caption}*")
        elif isinstance(b, Code):
            parts.append(f"```bash\n{b.text}\n```")
    return "\n\n".join(parts) + "\n"
