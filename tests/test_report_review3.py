"""Report defects of review round 3: entities in Markdown, NaN speed cells, a foreign summary.json, a threshold the CLI
refuses, an infinite ΔPPL left off the bits figure unsaid, clipping rates rounded onto the warning level."""

from __future__ import annotations

import json
import math

import pytest
from test_report import SCHEMES, _summary, _write_run

from kvbits.cli import main
from kvbits.report import write_report


def test_an_ampersand_in_a_name_is_shown_as_it_is():
    """``<``/``>`` were entities but ``&`` was not: a scheme named ``x&amp;y`` rendered as ``x&y`` in Markdown."""
    from kvbits.report.markdown import _md_text, md_cell

    assert md_cell("x&amp;y") == "x&amp;amp;y"
    assert md_cell("a&b <c>|d") == "a&amp;b &lt;c&gt;\\|d"
    assert _md_text("R&D <b> `a&b <c>`") == "R&amp;D &lt;b&gt; `a&b <c>`"  # a code span is kept as it is


def test_nan_speed_figures_print_as_not_available():
    """A ``speed.json`` with ``"NaN"`` timings (check_speed accepts them: a number) printed ``nan (nanx)`` and
    ``host nan``."""
    from kvbits.report.speed import _ms_cell, _speed_cell

    nan = math.nan
    assert _speed_cell({"tokens_per_s": nan, "speedup": nan}) == "n/a"
    assert _speed_cell({"tokens_per_s": 12.34, "speedup": nan}) == "12.3"
    assert _speed_cell({"tokens_per_s": 12.34, "speedup": 0.5}) == "12.3 (0.50x)"  # as before
    ms = {"ms_per_step": nan, "ms_p10": 1.0, "ms_p90": 2.0, "host_ms_per_step": nan}
    assert _ms_cell(ms) == "n/a [1.00–2.00], host n/a"
    assert _ms_cell({**ms, "ms_per_step": 1.5, "host_ms_per_step": 1.25}) == "1.50 [1.00–2.00], host 1.25"


def test_a_summary_without_eval_fields_is_refused(tmp_path, capsys):
    """``kvbits report DIR`` on a summary.json ``{"a": 1}`` exited 0 with an empty "? on ?" report; it is refused,
    naming the file and the fields it lacks. A run with no schemes (``results: []``) is still reported."""
    d = tmp_path / "foreign"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"a": 1}))
    want = r"summary.json is not a kvbits eval summary: it has no model, data, context, semantics, mode, windows, results"
    with pytest.raises(ValueError, match=want):
        write_report(d, plots=False)
    assert not (d / "report.md").exists()
    assert main(["report", str(d)]) == 2
    assert "is not a kvbits eval summary" in capsys.readouterr().err
    empty = _write_run(tmp_path / "empty", {"results": []}, tokens=False)
    assert "The run holds no results." in write_report(empty, plots=False)["markdown"].read_text()


@pytest.mark.parametrize("threshold", [True, math.inf, math.nan, -0.01])
def test_write_report_refuses_a_threshold_the_cli_refuses(tmp_path, threshold):
    """``threshold=True`` was taken as 1 (a 100 % budget) and ``inf`` judged nothing; ``--threshold`` refuses both
    (NaN and a negative one were refused already)."""
    d = _write_run(tmp_path / "run", tokens=False)
    with pytest.raises(ValueError, match=r"threshold must be a .*positive fraction"):
        write_report(d, threshold=threshold, plots=False)


def kivi2_summary_with_ppl(ppl: float) -> dict:
    """int8-token, kivi-4 and kivi-2, kivi-2's perplexity ``ppl`` (``inf``: overflowed; ``nan``: none) overall and in
    its last bucket; its other buckets are judged."""
    s = _summary({k: SCHEMES[k] for k in ("int8-token", "kivi-4", "kivi-2")})
    kivi2 = s["results"][2]
    kivi2["ppl"] = ppl
    kivi2["buckets"][-1].update(ppl=ppl, delta_rel=ppl, delta_rel_ci=None)
    return s


def _infinite_summary() -> dict:
    return kivi2_summary_with_ppl(math.inf)


def bits_figure_legend_and_report(summary: dict, tmp_path, monkeypatch) -> tuple[list[str], str]:
    """The bits-vs-ΔPPL figure's legend labels and the report.md written with that figure alone, for ``summary``."""
    pytest.importorskip("matplotlib")
    from kvbits.report import plots as plots_mod
    from kvbits.report.plots import tradeoff
    from kvbits.report.summary import RunSummary

    drawn = {}

    def keep(fig, path):
        drawn["fig"] = fig
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(tradeoff, "save_png", keep)
    tradeoff.plot_tradeoff(RunSummary.from_dict(summary), tmp_path / "bits_vs_delta.png")
    labels = [t.get_text() for t in drawn["fig"].axes[0].get_legend().get_texts()]

    def only_tradeoff(run, out, tokens, **kw):
        return {"bits_vs_delta": tradeoff.plot_tradeoff(run, out / "bits_vs_delta.png")}, {}

    monkeypatch.setattr(plots_mod, "make_plots", only_tradeoff)
    d = _write_run(tmp_path / "run", summary, tokens=False)
    return labels, write_report(d, plots=True)["markdown"].read_text()


def test_an_infinite_delta_is_named_not_left_off_the_bits_figure(tmp_path, monkeypatch):
    """A scheme whose ΔPPL is +inf had no point on the bits-vs-ΔPPL figure and nothing said so; the legend and the
    report's caption name it now."""
    pytest.importorskip("matplotlib")
    from kvbits.report.plots import tradeoff
    from kvbits.report.summary import RunSummary

    run = RunSummary.from_dict(_infinite_summary())
    assert tradeoff.infinite_points(run) == ["kivi-2 (overall and worst bucket)"]
    labels, md = bits_figure_legend_and_report(_infinite_summary(), tmp_path, monkeypatch)
    assert "ΔPPL +inf, not drawn: kivi-2 (overall and worst bucket)" in labels
    assert "(hollow). Not drawn, ΔPPL +inf: kivi-2 (overall and worst bucket).*" in md


def test_a_clipping_rate_next_to_the_warning_level_shows_the_digits_that_judge_it():
    """0.10004 % of the keys clipped (above the 0.1 % level: marked, warned) and 0.09996 % (below: not) both printed
    "0.100%", the first marked and warned as "clips 0.100% ... (warning level 0.1%)"."""
    from kvbits.report.calibration import calibration_issues, calibration_row, calibration_table

    def judged(frac: float) -> tuple[str, str, list[str]]:
        row = calibration_row("kivi-4", {"clipped_keys": 10, "clipped_keys_frac": frac, "clipped_values_frac": 0.0}, 512)
        cell = calibration_table([row]).rows[0][4]
        return cell.text, cell.tone, calibration_issues(row)

    above = judged(0.0010004)
    assert above[:2] == ("0.10004% (10)", "bad")
    assert above[2] == ["clips 0.10004% of its keys against the calibrated ranges (warning level 0.1%)"]
    assert judged(0.0009996) == ("0.09996% (10)", "good", [])
    assert judged(0.0025)[0] == "0.250% (10)"  # away from the level: three decimals as before
    assert judged(0.001)[:2] == ("0.100% (10)", "good")  # at the level exactly: not above it
