"""Inline Markdown of the reports' text: names from the JSON (a scheme JSON may name its scheme anything, a model
or data path may hold any character) placed in it as text or as code, and the spans read back by the renderers.

- :func:`code`: a code span that holds its text as it is, backticks included (its fence is longer than any run of
  backticks inside, CommonMark's rule);
- :func:`text`: a name as plain text outside code spans: ``\\``, `````, ``*``, ``_`` and a ``]`` before ``(`` or ``[``
  backslash-escaped, so a name ``a`b`` or ``int4-*`` opens no code span and no emphasis (two such names in one
  paragraph paired up), and ``![i](http://host/x.png)`` no image or link; a line break is a space (a blank line ended the paragraph and what
  followed, ``# heading``, was Markdown of its own);
- :func:`split_code_spans` / :func:`unescape`: what the HTML page and the terminal read back.
"""

from __future__ import annotations

import re

__all__ = ["code", "code_content", "hide_escapes", "show_escapes", "split_code_spans", "text", "unescape"]

_SPECIAL = re.compile(r"([\\`*_]|\](?=[(\[]))")  # a "]" only where a link text closes: "](" or "]["
_LINE_BREAK = re.compile(r"\r\n|[\r\n]")
_ESCAPED = re.compile(r"\\([\\`*_\]])")
# a run of n backticks (not escaped, not part of a longer run), then anything, then a run of exactly n
_CODE_SPAN = re.compile(r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def code(s: str) -> str:
    """``s`` as a Markdown code span that shows it as it is: ```a`b`` → ````` a`b `````` (no backtick inside: ```s```)."""
    runs = [len(m) for m in re.findall(r"`+", s)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or (s.startswith(" ") and s.endswith(" ") and s.strip()) else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def text(s: str) -> str:
    """``s`` as plain text in inline Markdown: ``\\``, `````, ``*``, ``_`` and a ``]`` before ``(`` or ``[``
    backslash-escaped (no link or image can close: ``[+2.05, +3.95]`` is kept as it is), each line break
    (``\\r\\n``, ``\\r``, ``\\n``) a space."""
    return _SPECIAL.sub(r"\\\1", _LINE_BREAK.sub(" ", s))


def unescape(s: str) -> str:
    """Text outside code spans with :func:`text`'s escapes undone (for a renderer that shows it as text)."""
    return _ESCAPED.sub(r"\1", s)


def hide_escapes(s: str) -> str:
    """Text outside code spans with each escaped character as ``NUL code NUL``: markup found after it (``**``,
    ``*``) is the text's own, never a name's; :func:`show_escapes` puts the characters back."""
    return _ESCAPED.sub(lambda m: f"\0{ord(m.group(1))}\0", s)


def show_escapes(s: str) -> str:
    """Undo :func:`hide_escapes`: the escaped characters as themselves."""
    return re.sub(r"\0(\d+)\0", lambda m: chr(int(m.group(1))), s)


def split_code_spans(s: str) -> list[str]:
    """``s`` cut at its inline code spans: the odd items are the spans (fences included), taken as they are by both
    renderers (Markdown and HTML); the even ones are the text around them. A backtick escaped as ``\\``` opens none."""
    parts, at = [], 0
    for m in _CODE_SPAN.finditer(s):
        parts += [s[at : m.start()], m.group(0)]
        at = m.end()
    return parts + [s[at:]]


def code_content(span: str) -> str:
    """The text of a code span from :func:`split_code_spans`: the fences stripped, and one space each side when both
    ends hold one (the padding :func:`code` adds)."""
    fence = len(span) - len(span.lstrip("`"))
    inner = span[fence:-fence]
    if len(inner) >= 2 and inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]
    return inner
