"""The README's Python snippets run as written, one after the other in one namespace, as a reader pastes
them (real SmolLM2-135M; only the monitor's 500 new tokens are cut to 40 to keep the suite short), without
a deprecation warning."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
from test_cache import CACHE_KW

import kvbits

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced ```python blocks of ``text``, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_python_blocks_are_found() -> None:
    blocks = python_blocks("intro\n```python\na = 1\n```\ntext\n```bash\nls\n```\n```python\nb = a\n```\n")
    assert blocks == ["a = 1\n", "b = a\n"]


@pytest.mark.realmodel
def test_readme_python_snippets_run_in_order() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 3, "a README Python block was added or removed: extend this test"
    quickstart, monitor, static = blocks
    assert "max_new_tokens=500" in monitor
    monitor = monitor.replace("max_new_tokens=500", "max_new_tokens=40")
    if CACHE_KW != "cache":  # transformers before 5.24: the keyword the README's comment names for it
        quickstart, monitor, static = (b.replace("cache=cache", f"{CACHE_KW}=cache").replace(
            "cache=static", f"{CACHE_KW}=static") for b in (quickstart, monitor, static))  # fmt: skip
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(quickstart, "README quickstart", "exec"), ns)  # noqa: S102 - our own README
        first = out.getvalue()
        exec(compile(monitor, "README monitor", "exec"), ns)  # noqa: S102
        second = out.getvalue()
        exec(compile(static, "README static cache", "exec"), ns)  # noqa: S102
    # the snippets use the installed transformers' current API (`past_key_values=` is deprecated from 5.24)
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    assert not deprecated, deprecated
    lines = first.splitlines()
    assert [ln.split()[0] for ln in lines[-2:]] == ["fp16", "kivi-2"]  # the plan's rows
    assert int(lines[-2].split()[1]) == 2 * 30 * 3 * 64 * 8192 * 8 * 2  # fp16 bytes, SmolLM2 at 8K, batch 8
    held = ns["ids"].shape[1] + 40 - 1  # the monitor's fresh cache: the prompt and all new tokens but the last
    assert ns["cache"].get_seq_length() == held
    prom = second[len(first):]
    # StaticQuantizedKVCache: the slabs' bytes, printed, are kvbits.plan's at max_cache_len
    want = kvbits.plan(ns["lm"].model.config, context=ns["ids"].shape[1] + 20, scheme="int4-token")["total_bytes"]
    assert ns["static"].memory_report()["total_bytes"] == want
    assert out.getvalue()[len(second):].rstrip().endswith(f" {want}")
    assert f'kvbits_cache_tokens{{scheme="kivi-2",request="r1"}} {held}' in prom
