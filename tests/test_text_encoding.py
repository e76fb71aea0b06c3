"""kvbits writes its text files in UTF-8 whatever the locale (``kvbits._files.write_text_atomic``); these tests hold
its reads (of its own files and of users' JSON) to UTF-8 too, so that a ``LC_ALL=C`` or cp1252 machine reads back
what another wrote."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import kvbits

_SRC = Path(kvbits.__file__).parent
_C_LOCALE = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def _text_calls_without_encoding(tree: ast.AST) -> list[int]:
    """Lines of ``x.read_text()`` / ``x.write_text(t)`` / ``open(p)`` / ``x.open("a")`` calls in text mode that do not
    name an ``encoding`` (so read or write in the locale's); a zip member (``zf.open``) is bytes, ``os.open`` a bare file
    descriptor."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in ("read_text", "write_text"):
            lines.append(node.lineno)
        elif name == "open" and not (isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in ("zf", "os")):
            mode_at = 1 if isinstance(node.func, ast.Name) else 0  # open(path, mode) / path.open(mode)
            mode = node.args[mode_at] if len(node.args) > mode_at else next(
                (k.value for k in node.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                lines.append(node.lineno)
    return lines


def test_every_text_read_and_write_in_kvbits_names_utf8() -> None:
    """12 reads (``summary.json``, ``meta.json``, a checkpoint's ``config.json``, the tuning cache, ...) and two
    writes (the events JSONL, the GGUF conversion marker) used the locale's encoding."""
    found = {}
    for path in sorted(_SRC.rglob("*.py")):
        lines = _text_calls_without_encoding(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[str(path.relative_to(_SRC))] = lines
    assert found == {}, f"text I/O without encoding='utf-8' at {found}"


def test_utf8_json_files_are_read_as_utf8_under_a_c_locale(tmp_path: Path) -> None:
    """Under ``LC_ALL=C`` a run's ``summary.json`` or a checkpoint's ``config.json`` holding 'café' was refused as
    "not valid JSON ('ascii' codec can't decode byte 0xc3 ...)"."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"model": "café"}, ensure_ascii=False), encoding="utf-8")
    code = (
        "import sys; from pathlib import Path; from kvbits.report.summary import read_json; "
        "from kvbits.export.vllm import _read_json_object; p = Path(sys.argv[1]); "
        "assert read_json(p)['model'] == 'caf\\u00e9'; assert _read_json_object(p, 'x')['model'] == 'caf\\u00e9'"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=_C_LOCALE, capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-800:]
