"""Report inputs that are not what a healthy run writes: non-finite numbers in ``summary.json`` (judged
honestly by the verdict, shown in the tables) and hand-corrupted ``summary.json`` / ``needle.json`` (a
``ValueError`` naming the file and the field, which ``kvbits report`` prints as one line, exit status 2).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvbits.cli import main
from kvbits.report import RunSummary, verdict, write_report
from kvbits.report.needle import READS_VERSION, load_needle, write_needle
from kvbits.report.tables import delta_table

SPANS = [(0, 1024), (1024, 2047)]
PPL_REF = [30.0, 26.0]


def _result(name: str, bits: float, deltas: list[float]) -> dict[str, Any]:
    """One scheme as the runner writes it; a delta of NaN / inf gives that PPL too."""
    buckets = [
        {"lo": lo, "hi": hi, "tokens": hi - lo, "ppl": ref * (1 + d), "ppl_ref": ref, "delta_rel": d,
         "delta_rel_ci": [d - 0.01, d + 0.01], "kl": 0.1, "top1": 0.9}
        for (lo, hi), d, ref in zip(SPANS, deltas, PPL_REF)
    ]  # fmt: skip
    attn = [{"layer": 0, "buckets": [{"lo": lo, "hi": hi, "rel_err": 0.01} for lo, hi in SPANS]}]
    return {"scheme": name, "avg_bits": bits, "ppl": 28.0 * (1 + deltas[0]), "ppl_ref": 28.0, "kl": 0.1,
            "top1": 0.9, "buckets": buckets, "attn_error": attn, "seconds": 1.0}  # fmt: skip


def _summary(**schemes: tuple[float, list[float]]) -> dict[str, Any]:
    schemes = schemes or {"fp16": (16.0, [0.0, 0.0]), "int4-token": (4.5, [0.12, 0.18]),
                          "kivi-2": (3.0, [0.16, 0.19])}  # fmt: skip
    return {
        "model": "smollm2-135m", "data": "war-and-peace", "context": 2048, "semantics": "decode",
        "mode": "simulate", "windows": 1, "fingerprint": {"model": "0123456789abcdef", "tokens": "fedcba9876543210"},
        "results": [_result(n, b, d) for n, (b, d) in schemes.items()], "reference_seconds": 1.0,
    }  # fmt: skip


def _write(d: Path, summary: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "summary.json").write_text(json.dumps(summary))  # NaN and Infinity as Python's json writes them
    return d


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["report", *argv])
    out, err = capsys.readouterr()
    return status, out, err


# ------------------------------------------------------------------------------- non-finite ΔPPL


def test_nan_bucket_is_incomplete_not_a_pass(tmp_path, capsys, caplog):
    """The audit's case: a NaN bucket read as n/a in the table, yet the verdict called the scheme within
    20% in every bucket."""
    s = _summary()
    s["results"][2]["buckets"][1].update(ppl=math.nan, delta_rel=math.nan)
    v = verdict(s, threshold=0.2)
    assert "**int4-token** stays within 20% ΔPPL" in v
    assert "kivi-2" not in v.split("Not judged")[0]  # not among the passing schemes
    assert ("Not judged: **kivi-2** (no ΔPPL at 1K–2K) is incomplete (ΔPPL missing or NaN in summary.json), "
            "not a pass; it stays within 20% in the buckets it has.") in v  # fmt: skip
    assert "Best bits/quality trade-off: **int4-token**" in v  # not the incomplete, cheaper kivi-2
    d = _write(tmp_path / "run", s)
    with caplog.at_level(logging.WARNING, logger="kvbits.report"):
        status, out, err = _cli(capsys, str(d), "--threshold", "20", "--no-plots")
    assert status == 0 and "Traceback" not in err
    assert "kivi-2 (no ΔPPL at 1K–2K) is incomplete" in " ".join(out.split())
    md = (d / "report.md").read_text()
    assert v in md
    assert "| kivi-2 | 3.00 | +16.00% [+15.00, +17.00] | n/a [+18.00, +20.00] |" in md
    assert any(
        "summary.json" in r.getMessage() and "kivi-2 has no ΔPPL" in r.getMessage() and "1K–2K" in r.getMessage()
        for r in caplog.records
    )


def test_only_incomplete_schemes_pass_nowhere():
    s = _summary(fp16=(16.0, [0.0, 0.0]), kivi=(3.0, [0.001, math.nan]))
    v = verdict(s)
    assert v.startswith("No quantized scheme is shown to stay within 1% ΔPPL in every position bucket")
    assert "Not judged: **kivi** (no ΔPPL at 1K–2K)" in v
    assert "trade-off" not in v and "Least damaging" not in v


def test_a_scheme_without_one_of_the_runs_buckets_is_not_a_pass():
    """A scheme whose summary lacks a bucket the others have (a cut or hand-merged summary.json) was called within
    the budget "in every position bucket up to 2K tokens" and named the best trade-off, though the table shows
    n/a there: it is incomplete, as with a NaN bucket."""
    s = _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [0.002, 0.004]), b=(3.0, [0.001, 0.5]))
    del s["results"][2]["buckets"][1]  # b has no 1K-2K bucket (where it would fail)
    v = verdict(s)
    assert v.startswith("**a** stays within 1% ΔPPL") and "Not judged: **b** (no ΔPPL at 1K–2K)" in v
    assert "Best bits/quality trade-off: **a**" in v


def test_missing_delta_is_derived_from_the_ppls_else_not_judged():
    s = _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [0.005, 0.005]), b=(3.0, [0.005, 0.005]))
    del s["results"][1]["buckets"][1]["delta_rel"]  # the PPLs still give it: judged
    s["results"][2]["buckets"][1].update(delta_rel=None, ppl=None)  # nothing gives it
    run = RunSummary.from_dict(s)
    a, b = run.results[1], run.results[2]
    assert math.isclose(a.buckets[1].delta, 0.005) and not a.unjudged
    assert [x.label for x in b.unjudged] == ["1K–2K"] and b.first_failure(0.01) is None
    v = verdict(run)
    assert "**a** stays within 1%" in v and "Not judged: **b** (no ΔPPL at 1K–2K)" in v


def test_infinite_delta_is_a_failure(tmp_path, capsys):
    s = _summary()
    s["results"][1]["buckets"][1].update(ppl=math.inf, delta_rel=math.inf)
    run = RunSummary.from_dict(s)
    r = run.results[1]
    assert r.first_failure(0.2) is r.buckets[1] and r.max_delta == math.inf
    v = verdict(run, threshold=0.2)
    assert "**kivi-2** stays within 20%" in v and "int4-token** stays" not in v
    assert "First bucket above 20%: **int4-token** at 1K–2K (+inf%" in v
    row = next(row for row in delta_table(run, 0.2).rows if row[0].text == "int4-token")
    assert row[3].text.startswith("+inf%") and row[3].tone == "bad"
    d = _write(tmp_path / "run", s)
    status, _, err = _cli(capsys, str(d), "--threshold", "20", "--no-plots")
    assert status == 0 and "Traceback" not in err
    md = (d / "report.md").read_text()
    assert "| int4-token | 4.50 | +12.00% [+11.00, +13.00] | **+inf% [+17.00, +19.00]** |" in md
    assert "| int4-token | 33.600 | inf |" in md  # the PPL table says inf, not n/a



def _strict(text: str) -> Any:
    """``text`` parsed as strict JSON (RFC 8259): bare NaN / Infinity, which jq and JSON.parse reject, fail."""

    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def test_eval_writes_non_finite_numbers_as_strict_json_the_report_reads_back(tmp_path, capsys):
    """summary.json and records.jsonl as kvbits eval writes them (``_write_outputs``): an infinite PPL and a NaN
    bucket are the strings "+Inf" / "NaN" (kvbits._json.dumps), not Python's bare tokens, and kvbits report
    reads them back as those numbers: the same report as from a file with bare tokens (written before)."""
    from kvbits.evaluate.metrics import BucketRecord
    from kvbits.evaluate.outputs import _write_outputs

    s = _summary()
    s["results"][1]["buckets"][1].update(ppl=math.inf, delta_rel=math.inf)
    s["results"][2]["buckets"][1].update(ppl=math.nan, delta_rel=math.nan)
    strict = tmp_path / "strict"
    strict.mkdir()
    record = BucketRecord("kivi-2", 0, 0, 1024, 1024, nll_sum=math.inf, nll_ref_sum=1.0, kl_sum=math.nan, top1_sum=1.0)
    _write_outputs(strict, "hash", s, [record], {}, {})
    written = _strict((strict / "summary.json").read_text())
    assert written["results"][1]["buckets"][1]["ppl"] == "+Inf" and written["results"][2]["buckets"][1]["ppl"] == "NaN"
    line = _strict((strict / "records.jsonl").read_text())
    assert line["nll_sum"] == "+Inf" and line["kl_sum"] == "NaN"
    bare = _write(tmp_path / "bare", s)
    for d in (strict, bare):
        status, _, err = _cli(capsys, str(d), "--threshold", "20", "--no-plots")
        assert status == 0 and "Traceback" not in err
    md = (strict / "report.md").read_text()
    assert md == (bare / "report.md").read_text().replace(str(bare), str(strict))
    assert "| int4-token | 33.600 | inf |" in md and "| kivi-2 | 3.00 | +16.00% [+15.00, +17.00] | n/a" in md
    run = RunSummary.load(strict)
    assert run.results[1].buckets[1].ppl == math.inf and math.isnan(run.results[2].buckets[1].ppl)


def test_infinite_ppl_without_delta_fails_and_minus_inf_is_not_judged():
    s = _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [0.005, 0.005]), b=(3.0, [0.005, 0.005]))
    s["results"][1]["buckets"][1].update(ppl=math.inf, delta_rel=None)
    s["results"][2]["buckets"][1].update(delta_rel=-math.inf)  # impossible (PPL >= 0): not a measurement
    run = RunSummary.from_dict(s)
    assert run.results[1].buckets[1].delta == math.inf and run.results[1].first_failure() is not None
    assert math.isnan(run.results[2].buckets[1].delta) and run.results[2].unjudged
    v = verdict(run)
    assert "**a** at 1K–2K (+inf%" in v and "Not judged: **b**" in v


def test_baseline_with_infinite_delta_warns():
    s = _summary(fp16=(16.0, [0.0, math.inf]), a=(4.0, [0.005, 0.005]))
    assert "Warning: the unquantized **fp16** differs from the reference by up to +inf%" in verdict(s)


def test_failing_scheme_names_its_unjudged_buckets():
    s = _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [math.nan, 0.05]))
    assert "**a** at 1K–2K (+5.00%, 95% CI +4.00% to +6.00%; no ΔPPL at 0–1K)" in verdict(s)


def test_figures_draw_with_non_finite_buckets(tmp_path):
    pytest.importorskip("matplotlib")
    s = _summary()
    s["results"][1]["buckets"][1].update(ppl=math.inf, delta_rel=math.inf)
    s["results"][2]["buckets"][0].update(ppl=math.nan, delta_rel=math.nan)
    paths = write_report(_write(tmp_path / "run", s), strict=True)
    assert "delta_heatmap" in paths and "ppl_vs_position" in paths


# -------------------------------------------------------------------------- corrupted summary.json


def _del(*path: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        node = s
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s.__setitem__(key, value)


def _entropy_without_lo(s: dict[str, Any]) -> None:
    s["results"][1]["attn_entropy"] = [{"layer": 0, "buckets": [{"hi": 1024, "entropy": 1.0}]}]


def _lo_text(s: dict[str, Any]) -> None:
    s["results"][2]["buckets"][0]["lo"] = "abc"


def _calibration(**record: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["results"][1].__setitem__("calibration", {"clipped_keys": 3, **record})


SUMMARY_CORRUPTIONS = {
    "bucket without lo": (_del("results", 1, "buckets", 0, "lo"), r"results\[1\]\.buckets\[0\]\.lo is missing"),
    "attn bucket without lo": (
        _del("results", 1, "attn_error", 0, "buckets", 0, "lo"),
        r"results\[1\]\.attn_error\[0\]\.buckets\[0\]\.lo is missing",
    ),
    "entropy bucket without lo": (_entropy_without_lo, r"results\[1\]\.attn_entropy\[0\]\.buckets\[0\]\.lo is missing"),
    "lo not a number": (_lo_text, r"results\[2\]\.buckets\[0\]\.lo is a string \('abc'\); expected a whole number"),
    "results of strings": (_set("results", ["x"]), r"results\[0\] is a string \('x'\); expected a scheme result"),
    "results a string": (_set("results", "x"), r"results is a string \('x'\); expected a list"),
    "fingerprint a string": (_set("fingerprint", "abc"), r"fingerprint is a string \('abc'\); expected an object"),
    # a TypeError deep in the calibration table; "serves -5 positions per window beyond" in the report
    "integer_zero a number": (
        _calibration(integer_zero=1), r"results\[1\]\.calibration\.integer_zero is a number \(1\); expected a list"
    ),
    "negative positions beyond": (
        _calibration(max_calibrated_length=100, positions_beyond_calibrated=-5),
        r"results\[1\]\.calibration\.positions_beyond_calibrated is a number \(-5\); expected a whole number >= 0",
    ),
}


@pytest.mark.parametrize("case", list(SUMMARY_CORRUPTIONS))
def test_corrupted_summary_is_one_clear_error(tmp_path, capsys, case):
    edit, field = SUMMARY_CORRUPTIONS[case]
    s = _summary()
    edit(s)
    d = _write(tmp_path / "run", s)
    with pytest.raises(ValueError, match=re.escape(str(d / "summary.json")) + ": " + field):
        RunSummary.load(d)
    status, _, err = _cli(capsys, str(d), "--no-plots")
    assert status == 2
    assert err.count("\n") == 1 and err.startswith(f"kvbits report: error: {d / 'summary.json'}: ")
    assert re.search(field, err) and "Traceback" not in err


def test_summary_that_is_not_an_object(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text("[1, 2]")
    status, _, err = _cli(capsys, str(d), "--no-plots")
    assert status == 2 and f"{d / 'summary.json'} holds a list; expected a kvbits eval summary" in err


def test_merging_a_corrupted_summary_names_it(tmp_path, capsys):
    good = _write(tmp_path / "a", _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [0.005, 0.005])))
    bad_summary = _summary(fp16=(16.0, [0.0, 0.0]), b=(3.0, [0.005, 0.005]))
    del bad_summary["results"][1]["buckets"][1]["lo"]
    bad = _write(tmp_path / "b", bad_summary)
    status, _, err = _cli(capsys, str(good), str(bad), "--out", str(tmp_path / "m"))
    assert status == 2 and f"{bad / 'summary.json'}: results[1].buckets[1].lo is missing" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ('{"scheme": "reference", "window": 0, "tokens": [1, 2]}\n{"scheme": "a", "win',
         "line 2, is not valid JSON (Unterminated string"),
        ('{"scheme": "reference", "tokens": [1, 2]}\n', "line 1: window is missing; expected a whole number >= 0"),
        ('[1, 2]\n', "line 1, holds a list; expected a greedy continuation (a JSON object)"),
    ],
)
def test_merging_a_corrupted_generations_file_names_it(tmp_path, capsys, lines, error):
    """A cut or hand-edited generations.jsonl is one error naming the file and the line. Before, a cut line printed
    json's bare "Unterminated string starting at: line 1 column 26 (char 25)" (no file), and a reference row without
    its window a KeyError ('window') traceback."""
    a = _write(tmp_path / "a", _summary(fp16=(16.0, [0.0, 0.0]), a=(4.0, [0.005, 0.005])))
    b = _write(tmp_path / "b", _summary(b=(3.0, [0.005, 0.005])))
    (a / "generations.jsonl").write_text(lines)
    status, _, err = _cli(capsys, str(a), str(b), "--out", str(tmp_path / "m"))
    assert status == 2 and err.startswith(f"kvbits report: error: {a / 'generations.jsonl'}, {error}")
    assert err.count("\n") == 1 and not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- corrupted needle.json


def _needle(version: int = READS_VERSION) -> dict[str, Any]:
    """A two-context, two-depth, one-trial needle summary as ``kvbits needle`` writes it (one scheme)."""
    contexts, depths = [1024, 2048], [0.0, 1.0]
    records = [
        {"context": c, "depth": dp, "depth_actual": dp, "index": 0, "key": "12345",
         "reference": {"retrieved": True, "nll": 0.01, "cache_bytes": 1000},
         "schemes": {"int4-token": {"retrieved": c == 1024, "nll": 0.5, "kl": 0.1, "token_acc": 0.8,
                                     "cache_bytes": 300}}}
        for c in contexts for dp in depths
    ]  # fmt: skip
    by_context = [{"context": c, "trials": 2, "retrieved": 1.0 if c == 1024 else 0.0, "retrieved_ref": 1.0,
                   "nll": 0.5, "nll_ref": 0.01, "kl": 0.1, "cache_bytes": 300, "cache_bytes_ref": 1000}
                  for c in contexts]  # fmt: skip
    return {
        "version": version, "task": {"needle": "The pass key is {key}.", "question": "The pass key is", "digits": 5},
        "model": "smollm2-135m", "data": "war-and-peace", "semantics": "prefill", "contexts": contexts,
        "depths": depths, "trials": 1, "seed": 0, "fingerprint": {"model": "0123", "tokens": "4567"},
        "reference": {"retrieved": 1.0, "nll": 0.01, "grid": [[1.0, 1.0], [1.0, 1.0]], "by_context": []},
        "results": [{"scheme": "int4-token", "avg_bits": 4.5, "retrieved": 0.5, "kept": 0.5, "delta_nll": 0.49,
                     "kl": 0.1, "by_context": by_context, "grid": [[1.0, 1.0], [0.0, 0.0]], "seconds": 2.0}],
        "records": records, "reference_seconds": 1.0, "date": "2026-01-01", "commit": {"sha": "abc"},
    }  # fmt: skip


def _needle_run(d: Path, summary: dict[str, Any]) -> Path:
    write_needle(_needle(), d)  # a real needle folder, then its needle.json replaced
    (d / "needle.json").write_text(json.dumps(summary))
    return d


def test_needle_report_version_matches_the_writer():
    needle_run = pytest.importorskip("kvbits.evaluate.needle_run")
    assert needle_run.NEEDLE_VERSION == READS_VERSION


def test_valid_needle_json_rewrites_with_null_means(tmp_path, capsys):
    s = _needle()
    s["results"][0].update(delta_nll=None, kl=None)  # a mean over no finite value is null (evaluate._mean)
    d = _needle_run(tmp_path / "needle", s)
    assert load_needle(d / "needle.json") == s
    status, out, err = _cli(capsys, str(d))
    assert status == 0 and err == "" and "report:" in out
    assert "| int4-token | 4.50 | 50% (2/4) | 50% (2/4; 15–85%) | n/a | n/a | 2.0 |" in (d / "report.md").read_text()


def test_a_pipe_in_a_scheme_name_is_escaped_in_the_needle_and_speed_tables():
    """A scheme JSON may name its scheme anything; the eval report escaped ``|`` in table cells, but the needle and
    speed tables wrote the name raw, so ``a|b`` split its row into one cell too many."""
    from kvbits.report.needle import needle_markdown
    from kvbits.report.speed import speed_markdown

    s = json.loads(json.dumps(_needle()).replace('"int4-token"', '"a|b"'))
    md = needle_markdown(s, figure=False)
    assert "| a\\|b |" in md and "| a|b |" not in md
    whole = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/speed-qwen/speed.json").read_text())
    name = whole["runs"][-1]["cache"]
    md = speed_markdown(json.loads(json.dumps(whole).replace(f'"{name}"', '"a|b"')), figure=False)
    assert "| a\\|b |" in md and "| a|b |" not in md


def _grid_short(s: dict[str, Any]) -> None:
    s["results"][0]["grid"] = [[1.0, 1.0]]


def _bits_text(s: dict[str, Any]) -> None:
    s["results"][0]["avg_bits"] = "4.5"


def _scheme_score_text(s: dict[str, Any]) -> None:
    s["records"][2]["schemes"]["int4-token"] = "yes"


def _context_text(s: dict[str, Any]) -> None:
    s["contexts"][1] = "2k"


def _by_context_reversed(s: dict[str, Any]) -> None:
    s["results"][0]["by_context"].reverse()  # the By context table put 2K's numbers under 1K


def _by_context_short(s: dict[str, Any]) -> None:
    s["results"][0]["by_context"].pop()  # the table's row was one cell short


def _trial_without_scheme(s: dict[str, Any]) -> None:
    del s["records"][1]["schemes"]["int4-token"]  # the overall table raised KeyError('int4-token')


def _stray_trial(**at: Any) -> Any:
    """A trial moved off the run's grid (a hand edit): it counted in the overall figures but in no grid cell."""
    return lambda s: s["records"][3].update(at)


NEEDLE_CORRUPTIONS = {
    "no reference": (_del("reference"), "reference is missing; expected an object"),
    "no records": (_del("records"), "records is missing; expected a list"),
    "no contexts": (_del("contexts"), "contexts is missing; expected a list"),
    "contexts a string": (_set("contexts", "4k"), "contexts is a string ('4k'); expected a list"),
    "a context a string": (_context_text, "contexts[1] is a string ('2k'); expected a whole number >= 0"),
    "version 9": (_set("version", 9), "version is 9; this kvbits reads needle.json version 1"),
    "no version": (_del("version"), "version is missing; expected a whole number"),
    "grid of the wrong shape": (_grid_short, "results[0].grid is not 2 × 2 (contexts × depths)"),
    "avg bits a string": (_bits_text, "results[0].avg_bits is a string ('4.5'); expected a number"),
    "scheme score a string": (_scheme_score_text, "records[2].schemes.int4-token is a string ('yes'); expected an object"),
    "by_context out of order": (_by_context_reversed, "results[0].by_context[0].context is 2048; expected 1024"),
    "by_context short": (_by_context_short, "results[0].by_context has 1 entries; expected one per context (2)"),
    "trial without a scheme": (_trial_without_scheme, "records[1].schemes has no 'int4-token' (a scheme of results)"),
    "trial at a context off the run": (_stray_trial(context=4096), "records[3] is at context 4096, depth 1.0: not"),
    "trial at a depth off the run": (_stray_trial(depth=0.5), "records[3] is at context 2048, depth 0.5: not"),
}


@pytest.mark.parametrize("case", list(NEEDLE_CORRUPTIONS))
def test_corrupted_needle_json_is_one_clear_error(tmp_path, capsys, case):
    edit, field = NEEDLE_CORRUPTIONS[case]
    s = _needle()
    edit(s)
    d = _needle_run(tmp_path / "needle", s)
    before = (d / "report.md").read_text()
    with pytest.raises(ValueError, match=re.escape(f"{d / 'needle.json'}: {field}")):
        load_needle(d / "needle.json")
    status, _, err = _cli(capsys, str(d))
    assert status == 2 and err == f"kvbits report: error: {d / 'needle.json'}: {field}" + err.split(field, 1)[1]
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (d / "report.md").read_text() == before and json.loads((d / "needle.json").read_text()) == s  # untouched


def test_merging_a_corrupted_needle_run_names_it(tmp_path, capsys):
    a = _needle_run(tmp_path / "a", _needle())
    b = _needle_run(tmp_path / "b", _needle(version=9))
    status, _, err = _cli(capsys, str(a), str(b), "--out", str(tmp_path / "m"))
    assert status == 2 and f"{b / 'needle.json'}: version is 9" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (_del("records", 0, "schemes", "int4-token", "nll"), "records[0].schemes.int4-token.nll is missing"),
        (_del("records", 2, "schemes", "int4-token", "token_acc"), "records[2].schemes.int4-token.token_acc is missing"),
        (lambda s: s["records"][1]["reference"].update(nll=None), "records[1].reference.nll is null; expected a number"),
    ],
)
def test_merging_needle_trials_without_their_scores_names_them(tmp_path, capsys, corrupt, field):
    """The merge computes every figure again from the trials' scores, which the report itself does not read. Before,
    a trial without a scheme's nll (or token_acc) was a KeyError ('nll') traceback, and a null reference nll printed
    "unsupported operand type(s) for -: 'NoneType' and 'float'", naming neither file nor field."""
    a = _needle_run(tmp_path / "a", _needle())
    second = _needle()
    for rec in second["records"]:
        rec["index"] = 1  # other trials of the same cells: the two runs merge
    assert _cli(capsys, str(a), str(_needle_run(tmp_path / "b", second)), "--out", str(tmp_path / "ok"))[0] == 0
    corrupt(second)
    b = _needle_run(tmp_path / "b", second)
    status, _, err = _cli(capsys, str(a), str(b), "--out", str(tmp_path / "m"))
    assert status == 2 and err.startswith(f"kvbits report: error: {b / 'needle.json'}: {field}")
    assert err.count("\n") == 1 and not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- corrupted speed.json


def _speed_halves(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The committed Qwen speed run cut into two runs of one context each (written with ``write_speed``); the
    second's summary is returned for the test to corrupt."""
    from kvbits.report.speed import write_speed

    whole = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/speed-qwen/speed.json").read_text())
    halves = []
    for i, context in enumerate(whole["contexts"]):
        part = {**whole, "contexts": [context], "runs": [r for r in whole["runs"] if r["context"] == context]}
        halves.append((write_speed(part, tmp_path / f"s{i}"), part))
    (a, _), (b, summary) = halves
    return a, b, summary


def _bad_scheme_entry(s: dict[str, Any]) -> None:
    s["schemes"][0] = "int8-token"


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (_del("runs", 1, "tokens_per_s"), "runs[1].tokens_per_s is missing; expected a number"),
        (_bad_scheme_entry, "schemes[0] is a string ('int8-token'); expected an object"),
        (_set("batches", "1"), "batches is a string ('1'); expected a list"),
        (_del("runs", 0, "context"), "runs[0].context is missing; expected a whole number >= 0"),
    ],
)
def test_merging_a_corrupted_speed_run_names_it(tmp_path, capsys, corrupt, field):
    """A speed.json with a field missing or of another kind is refused before the merge writes anything. Before,
    merging it raised a KeyError ('tokens_per_s') or AttributeError traceback from the report, after speed.json and
    speed.png had been written into --out; rewriting one such folder said ``KeyError: 'tokens_per_s'``."""
    a, b, summary = _speed_halves(tmp_path)
    corrupt(summary)
    (b / "speed.json").write_text(json.dumps(summary))
    status, _, err = _cli(capsys, str(a), str(b), "--out", str(tmp_path / "m"))
    assert status == 2 and err == f"kvbits report: error: {b / 'speed.json'}: {field}\n"
    assert not (tmp_path / "m").exists()
    before = (b / "report.md").read_text()
    status, _, err = _cli(capsys, str(b))  # written again alone: the same one-line error, nothing rewritten
    assert status == 2 and err == f"kvbits report: error: {b / 'speed.json'}: {field}\n"
    assert (b / "report.md").read_text() == before


def test_a_zero_time_step_is_strict_json_and_reads_back_as_infinite_tokens_per_s(tmp_path, capsys):
    """step_stats gives a zero median step infinite tokens/s; speed.json (write_speed) and --json
    (emit_summary) write it as "+Inf", not the bare Infinity that jq and JSON.parse reject, and load_speed and
    kvbits report read it back as inf."""
    import argparse

    from kvbits._argtypes import emit_summary
    from kvbits.evaluate.speed import step_stats
    from kvbits.report.speed import load_speed, speed_markdown, write_speed

    whole = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/speed-qwen/speed.json").read_text())
    zero = step_stats([0.0, 0.0, 0.0], batch=1)
    assert zero["tokens_per_s"] == math.inf
    whole["runs"][1].update(zero, speedup=math.inf)
    out = write_speed(whole, tmp_path / "run")
    written = _strict((out / "speed.json").read_text())
    assert written["runs"][1]["tokens_per_s"] == "+Inf" and written["runs"][1]["speedup"] == "+Inf"
    back = load_speed(out / "speed.json")
    assert back["runs"][1]["tokens_per_s"] == math.inf and back["runs"] == whole["runs"]
    assert speed_markdown(back) == speed_markdown(whole)
    status, _, err = _cli(capsys, str(out))
    assert status == 0 and "Traceback" not in err
    args = argparse.Namespace(out=None, json=True, overwrite=False)
    assert emit_summary(whole, args, write_speed, lambda *_: None) == 0
    assert _strict(capsys.readouterr().out)["runs"][1]["tokens_per_s"] == "+Inf"


# ------------------------------------------------------------------------------- output versions


def test_eval_run_of_a_newer_output_version_is_refused_naming_both(tmp_path, capsys):
    """A ``config.json`` recording an output version newer than this kvbits's (a newer kvbits wrote it) was read
    silently as the current format (report written, status 0); now refused by ``kvbits report`` (status 2) and by
    ``merge_runs``, naming both versions. The version this kvbits writes still reads."""
    from kvbits.evaluate.request import OUTPUT_VERSION
    from kvbits.report.merge import merge_runs

    assert OUTPUT_VERSION == 2  # report.inputs.READS_VERSION mirrors it (that module does not import torch)
    new, cur = _write(tmp_path / "new", _summary()), _write(tmp_path / "cur", _summary())
    (new / "config.json").write_text(json.dumps({"version": OUTPUT_VERSION + 1}))
    (cur / "config.json").write_text(json.dumps({"version": OUTPUT_VERSION}))
    status, _, err = _cli(capsys, str(new))
    assert status == 2
    assert f"output version {OUTPUT_VERSION + 1} is newer than this kvbits reads (output version {OUTPUT_VERSION})" \
        in err
    assert not (new / "report.md").exists()
    with pytest.raises(ValueError, match=f"output version {OUTPUT_VERSION + 1} is newer"):
        merge_runs([cur, new], tmp_path / "merged")
    assert _cli(capsys, str(cur))[0] == 0
