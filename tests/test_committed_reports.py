"""The committed reports under benchmarks/results are what the current renderer writes from their committed JSON
(``benchmarks/regen_reports.py``): a change to the renderer's wording shows here, and is committed with the reports
written again (``PYTHONPATH=src python benchmarks/regen_reports.py``), so they cannot drift apart unseen."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def regen():
    spec = importlib.util.spec_from_file_location("regen_reports", ROOT / "benchmarks" / "regen_reports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", [
    "qwen-wiki-4k",  # an eval run of output version 1 (float32-KL note), figures drawn from per-token arrays
    "qwen-wiki-4k-all",  # merged evals: runs table, report.html, calibration folders found among the results
    "smollm2-wp-8k-kvquant",  # a run from before summary.json recorded the artifact: its committed folder names it
    "needle-qwen-all",  # a needle run with its figure
    "speed-smollm2-into",  # a speed run whose speed.png was never committed: not linked
])  # fmt: skip
def test_committed_report_is_rendered_again_unchanged(regen, name):
    folder = RESULTS / name
    texts = regen.render(folder)
    assert set(texts) == {"report.md"} | ({"report.html"} if (folder / "report.html").is_file() else set())
    for file, text in texts.items():
        committed = (folder / file).read_text(encoding="utf-8")
        removed, added = regen.number_changes(committed, text)
        assert text == committed, f"{name}/{file} is stale (numbers removed {removed}, added {added}): run benchmarks/regen_reports.py"


def test_every_committed_report_is_current_and_links_only_committed_figures(regen, capsys):
    """All of them (about a second): none stale, and no report.md links a figure its folder lacks."""
    assert regen.main(["--check"]) == 0, capsys.readouterr().out
    folders = regen.committed_reports()
    assert len(folders) >= 90
    for folder in folders:
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (folder / "report.md").read_text(encoding="utf-8")):
            assert (folder / link).is_file(), f"{folder.name}/report.md links {link}, which is not there"


def test_number_changes_lists_numbers_not_wording(regen):
    removed, added = regen.number_changes("ΔPPL 1.25% at 4K, 3.44 GiB, 3.44 GiB", "ΔPPL now 1.25% at 4K; 3.44 GiB (t + 1)")
    assert sorted(removed.elements()) == ["3.44"] and sorted(added.elements()) == ["1"]
    assert regen.number_changes("a 0.5 b", "the 0.5, c") == ({}, {})
