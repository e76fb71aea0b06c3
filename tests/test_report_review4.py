"""Report defects of review round 4: a NaN ΔPPL left off the bits figure unsaid, hybrid models' linear-state bytes
missing from the speed figure."""

from __future__ import annotations

import math

import pytest
from test_report import _write_run
from test_report_review3 import bits_figure_legend_and_report, kivi2_summary_with_ppl

from kvbits.report import write_report


def _nan_summary() -> dict:
    return kivi2_summary_with_ppl(math.nan)


def test_a_nan_delta_is_named_not_left_off_the_bits_figure(tmp_path, monkeypatch):
    """A scheme with bits and a NaN overall ΔPPL had no filled point on the bits-vs-ΔPPL figure and nothing said so
    (a +inf one was named); the legend and the caption name it now, as they name a +inf one."""
    pytest.importorskip("matplotlib")
    from kvbits.report.plots import tradeoff
    from kvbits.report.summary import RunSummary

    run = RunSummary.from_dict(_nan_summary())
    assert tradeoff.nan_points(run) == ["kivi-2 (overall)"]
    assert tradeoff.infinite_points(run) == []
    none_judged = _nan_summary()
    for b in none_judged["results"][2]["buckets"]:
        b.update(ppl=math.nan, delta_rel=math.nan, delta_rel_ci=None)
    assert tradeoff.nan_points(RunSummary.from_dict(none_judged)) == ["kivi-2 (overall and worst bucket)"]
    labels, md = bits_figure_legend_and_report(_nan_summary(), tmp_path, monkeypatch)
    assert "ΔPPL NaN, not drawn: kivi-2 (overall)" in labels
    assert not any(lab.startswith("ΔPPL +inf") for lab in labels)
    assert "(hollow). Not drawn, ΔPPL NaN: kivi-2 (overall).*" in md
    clean = _write_run(tmp_path / "clean", tokens=False)
    assert "Not drawn" not in write_report(clean, plots=True)["markdown"].read_text()  # nothing missing: nothing said


def test_the_speed_figure_names_a_hybrid_models_linear_states(tmp_path, monkeypatch):
    """speed.png's "cache MiB" panel drew the K/V bytes alone for a hybrid model while report.md's table adds
    "+ linear states X": the panel's title says it now ("K/V only; + linear states X"); no title where none are held."""
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from kvbits.report.fmt import fmt_bytes
    from kvbits.report.plots import figure
    from kvbits.report.speed import load_speed, plot_speed

    base = load_speed(Path(__file__).parents[1] / "benchmarks/results/speed-qwen/speed.json")
    drawn = {}

    def keep(fig, path):
        drawn["fig"] = fig
        return path

    monkeypatch.setattr(figure, "save_png", keep)

    def bytes_titles(s: dict) -> list[str]:
        plot_speed(s, tmp_path / "speed.png")
        n = len(s["batches"])
        return [ax.get_title() for ax in drawn["fig"].axes[n:2 * n]]  # the second row: the bytes panels

    plain = {**base, "runs": [{**r, "linear_state_bytes": 0} for r in base["runs"]]}
    assert bytes_titles(plain) == [""] * len(base["batches"])
    hybrid = {**base, "runs": [{**r, "linear_state_bytes": 3 << 19} for r in base["runs"]]}
    assert bytes_titles(hybrid) == [f"K/V only; + linear states {fmt_bytes(3 << 19)}"] * len(base["batches"])
    assert fmt_bytes(3 << 19) == "1.50 MiB"
    varied = {**base, "runs": [{**r, "linear_state_bytes": (i % 2 + 1) << 20} for i, r in enumerate(base["runs"])]}
    assert bytes_titles(varied)[0] == "K/V only; + linear states 1.00 MiB–2.00 MiB"


def test_the_speed_figure_draws_a_workspace_runs_held_bytes(tmp_path, monkeypatch):
    """speed.png's "cache MiB" panel drew a workspace run's K/V bytes alone (int8-token: 25.6 MiB where the cache held
    128.1 MiB with a 4x workspace), while report.md's table adds "+ workspace X": the line is the bytes held now, and
    the panel's title says the workspace is in them; the runs without one are drawn as before."""
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from kvbits.report.plots import figure
    from kvbits.report.speed import load_speed, plot_speed

    base = load_speed(Path(__file__).parents[1] / "benchmarks/results/speed-qwen/speed.json")
    name = base["schemes"][0]["scheme"]
    s = {**base, "workspace": True, "runs": [{**r, "workspace_bytes": 4 * r["cache_bytes"]} if r["cache"] == name
                                             else r for r in base["runs"]]}  # fmt: skip
    drawn = {}
    monkeypatch.setattr(figure, "save_png", lambda fig, path: drawn.update(fig=fig) or path)
    plot_speed(s, tmp_path / "speed.png")
    n, batch = len(s["batches"]), s["batches"][0]
    ax = drawn["fig"].axes[n]  # the first bytes panel
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    for cache, ys in lines.items():
        runs = [r for c in s["contexts"] for r in s["runs"] if (r["cache"], r["context"], r["batch"]) == (cache, c, batch)]
        held = [(r["cache_bytes"] + (r["workspace_bytes"] or 0)) / 2**20 for r in runs]
        assert ys == pytest.approx(held), cache
    first = next(r for r in s["runs"] if (r["cache"], r["batch"]) == (name, batch))
    assert lines[name][0] == pytest.approx(5 * first["cache_bytes"] / 2**20) and ax.get_title() == "workspace included"
    plot_speed(base, tmp_path / "speed.png")  # no workspace: no title
    assert drawn["fig"].axes[n].get_title() == ""


def test_a_signed_figure_that_rounds_to_zero_prints_without_a_minus():
    """A CI bound of -0.001 % printed as ``[-0.00, +0.20]`` (the heatmap's cells likewise), and a needle ΔNLL of
    -0.0004 nats as ``-0.000``: a sign on a figure that rounds to nothing. Now ``+0.00`` / ``+0.000``, as
    ``fmt_pct`` already printed ``+0.00%``."""
    from kvbits.report.fmt import fmt_ci, fmt_pct
    from kvbits.report.needle import _fixed

    assert fmt_ci((-1e-5, 0.002)) == "[+0.00, +0.20]"
    assert fmt_ci((-0.0, 0.0)) == "[+0.00, +0.00]"
    assert fmt_ci((-0.0001, -0.00004)) == "[-0.01, +0.00]"  # -0.01 % is a figure: it keeps its sign
    assert fmt_pct(-1e-6) == "+0.00%"
    assert _fixed(-0.0004, "+.3f") == "+0.000" and _fixed(-0.0006, "+.3f") == "-0.001"
    assert _fixed(0.25, ".2f") == "0.25" and _fixed(None, "+.3f") == "n/a"
