"""``kvbits report``: several evaluations of the same model, text and setting merged into one report (and a
single run's report written again). Merging two runs must give what evaluating their schemes together gives;
runs that did not measure against the same reference must be refused."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _tinyllama import SMALL_KIVI, tiny_llama

from kvbits.cli import build_parser, main
from kvbits.evaluate import evaluate
from kvbits.report import RunSummary, write_report
from kvbits.report.merge import merge_runs

CONTEXT = 96
A = ["int8-token", "int4-token"]
B = [SMALL_KIVI.name]  # KIVI-2 with 8-token blocks behind a 16-token window
NUMBERS = ("avg_bits", "ppl", "ppl_ref", "kl", "top1", "buckets", "attn_error", "attn_entropy", "generation")


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2 * CONTEXT,), generator=g)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs ``a`` (A), ``b`` (B), ``ab`` (A + B together), each with 3 greedy tokens after each window; ``c``
    at another context, ``d`` on other tokens, ``e`` (int2-token) as ``b``, ``g`` generating 5 tokens."""
    root = tmp_path_factory.mktemp("merge")
    model = tiny_llama(seed=3)
    ids = _ids(1)
    kw = {"windows": 2, "attn_layers": [1], "generate": 3}
    evaluate(model, ids, CONTEXT, A, out_dir=root / "a", **kw)
    evaluate(model, ids, CONTEXT, [SMALL_KIVI], out_dir=root / "b", **kw)
    evaluate(model, ids, CONTEXT, [*A, SMALL_KIVI], out_dir=root / "ab", **kw)
    evaluate(model, ids, CONTEXT // 2, [SMALL_KIVI], out_dir=root / "c", **kw)
    evaluate(model, _ids(2), CONTEXT, [SMALL_KIVI], out_dir=root / "d", **kw)
    evaluate(model, ids, CONTEXT, ["int2-token"], out_dir=root / "e", **kw)
    evaluate(model, ids, CONTEXT, ["int3-token"], out_dir=root / "g", **{**kw, "generate": 5})
    return root


def _untimed(x):
    """``x`` without its timings (``seconds``, ``reference_seconds``), the one thing two runs may differ in."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not k.endswith("seconds")}
    return [_untimed(v) for v in x] if isinstance(x, list) else x


def _numbers(summary: dict) -> list[dict]:
    return [_untimed({k: r.get(k) for k in ("scheme", *NUMBERS)}) for r in summary["results"]]


def test_merging_equals_evaluating_together(runs, tmp_path):
    from safetensors.numpy import load_file

    out = merge_runs([runs / "a", runs / "b"], tmp_path / "m")
    merged = json.loads((out / "summary.json").read_text())
    together = json.loads((runs / "ab" / "summary.json").read_text())
    assert [r["scheme"] for r in merged["results"]] == A + B
    assert _numbers(merged) == _numbers(together)  # the same numbers, to the last bit
    for key in ("model", "data", "context", "windows", "semantics", "mode", "fingerprint"):
        assert merged[key] == together[key]
    assert _untimed(merged["merged_from"]) == [
        {"path": str(runs / "a"), "schemes": A, "world_size": 1},
        {"path": str(runs / "b"), "schemes": B, "world_size": 1},
    ]
    assert merged["world_size"] == together["world_size"] == 1
    for name in A + B:
        got, want = (
            load_file(str(out / "tokens" / f"{name}.safetensors")),
            load_file(str(runs / "ab" / "tokens" / f"{name}.safetensors")),
        )
        assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    records = (out / "records.jsonl").read_text().splitlines()
    assert sorted(records) == sorted((runs / "ab" / "records.jsonl").read_text().splitlines())
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (runs / "ab" / "generations.jsonl").read_text().splitlines()]
    key = lambda r: (r["scheme"], r["window"])
    assert sorted(gens, key=key) == sorted(want, key=key)  # the reference once, each scheme's continuations
    assert not (out / "DONE").exists()  # never taken for a kvbits eval run

    paths = write_report(out, plots=False)
    md = paths["markdown"].read_text()
    assert "## Runs merged" in md and "2 evaluations merged" in md
    for name in A + B:
        assert f"| {name} " in md or f"**{name}**" in md
    lines = md.split("## How to reproduce")[1].split("```bash")[1].split("```")[0].strip().splitlines()
    assert len(lines) == 3 and lines[-1] == shlex.join(
        ["kvbits", "report", str(runs / "a"), str(runs / "b"), "--out", str(out)]
    )
    args = build_parser(only="report").parse_args(shlex.split(lines[-1])[1:])
    assert args.runs == [str(runs / "a"), str(runs / "b")] and args.out == str(out)
    assert RunSummary.load(out).ppl_ref == RunSummary.load(runs / "ab").ppl_ref


def test_seconds_of_runs_on_other_rank_counts_are_labelled_per_run(runs, tmp_path):
    """Runs evaluated on 2 ranks and on 1 merge (the numbers are a single process's), but their seconds are summed
    over their own ranks. Before, the merge kept the first run's world_size, so the Overall caption said "Seconds are
    summed over the 2 ranks" of every scheme, the 1-rank run's too (and nothing at all in the other order)."""
    from kvbits.report.tables import overall_table

    for name, ranks in (("a", 2), ("b", 1)):
        shutil.copytree(runs / name, tmp_path / name)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "world_size": ranks}))
    caption = overall_table(RunSummary.load(merge_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "m"))).caption
    assert "summed over the 2 ranks that split the windows" not in caption
    assert caption.endswith("seconds are summed over each run's: 2 for int4-token and the reference pass; "
                            f"1 for {SMALL_KIVI.name}.".replace("int4-token", ", ".join(A)))  # fmt: skip
    caption = overall_table(RunSummary.load(merge_runs([tmp_path / "b", tmp_path / "a"], tmp_path / "n"))).caption
    assert caption.endswith(f"1 for {SMALL_KIVI.name} and the reference pass; 2 for {', '.join(A)}.")
    nested = merge_runs([tmp_path / "m", runs / "e"], tmp_path / "o")  # an earlier such merge, merged again
    assert overall_table(RunSummary.load(nested)).caption.endswith(
        f"several for {', '.join(A + B)} and the reference pass; 1 for int2-token."
    )


def test_runs_that_measured_something_else_are_refused(runs, tmp_path):
    out = tmp_path / "m"
    with pytest.raises(ValueError, match="differ in context: 96 .* 48"):
        merge_runs([runs / "a", runs / "c"], out)
    with pytest.raises(ValueError, match="tokens .* fingerprint"):
        merge_runs([runs / "a", runs / "d"], out)
    with pytest.raises(ValueError, match="'int8-token' is in both"):
        merge_runs([runs / "a", runs / "ab"], out)
    with pytest.raises(ValueError, match="new_tokens: 3 .* 5"):
        merge_runs([runs / "a", runs / "g"], out)
    with pytest.raises(ValueError, match="at least two"):
        merge_runs([runs / "a"], out)
    with pytest.raises(ValueError, match="named twice"):
        merge_runs([runs / "a", runs / "a"], out)
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        merge_runs([runs / "a", tmp_path], out)
    assert not out.exists()  # nothing written for a refused merge

    # a reference 0.05 % away (another device or dtype would do it): refused, naming both runs
    moved = tmp_path / "moved"
    shutil.copytree(runs / "b", moved)
    summary = json.loads((moved / "summary.json").read_text())
    for r in summary["results"]:
        for b in r["buckets"]:
            b["ppl_ref"] *= 1.0005
    (moved / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="reference differs .* 0.050%"):
        merge_runs([runs / "a", moved], out)
    bare = json.loads(json.dumps(summary))
    for r in bare["results"]:
        r.pop("ppl_ref")
        r["buckets"] = []
    (moved / "summary.json").write_text(json.dumps(bare))
    with pytest.raises(ValueError, match="records no reference perplexity"):
        merge_runs([runs / "a", moved], out)
    summary["fingerprint"].pop("tokens")
    (moved / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="records no tokens fingerprint"):
        merge_runs([runs / "a", moved], out)
    # as kvbits eval --dtype records them; None: a run given a model name without --dtype (a model object's run
    # records the dtype it ran in, float32 here)
    for run, dtype in (("a", "float32"), ("b", "bfloat16"), ("a", None), ("e", None)):
        cfg = json.loads((runs / run / "config.json").read_text())
        shutil.copytree(runs / run, tmp_path / f"{run}-{dtype}", ignore=shutil.ignore_patterns("config.json"))
        cfg["request"]["dtype"] = dtype
        (tmp_path / f"{run}-{dtype}" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="differ in dtype: 'float32' .* 'bfloat16'"):
        merge_runs([tmp_path / "a-float32", tmp_path / "b-bfloat16"], out)
    merge_runs([tmp_path / "a-None", tmp_path / "b-bfloat16"], out)  # None: the model's own dtype, as loaded
    assert out.is_dir()  # (a bfloat16 reference would differ, and the reference check refuses that)
    # a merged folder's settings are its runs': merging it with a run of another dtype is refused as the runs are
    bf16 = merge_runs([tmp_path / "b-bfloat16", tmp_path / "e-None"], tmp_path / "merged-bf16")
    with pytest.raises(ValueError, match="differ in dtype: 'bfloat16' .* 'float32'"):
        merge_runs([bf16, tmp_path / "a-float32"], tmp_path / "merged-again")


def test_output_folder_rules(runs, tmp_path):
    with pytest.raises(ValueError, match="one of the runs"):
        merge_runs([runs / "a", runs / "b"], runs / "b")
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no merged kvbits report"):
        merge_runs([runs / "a", runs / "b"], foreign)
    merge_runs([runs / "a", runs / "b"], foreign, overwrite=True)
    assert (foreign / "mine.txt").read_text() == "keep me"
    # merged over an eval run: its DONE goes, so kvbits eval does not return the merge as that run
    run = shutil.copytree(runs / "e", tmp_path / "was-a-run")
    merge_runs([runs / "a", runs / "b"], run, overwrite=True)
    assert not (run / "DONE").exists()
    # a folder an earlier merge wrote is merged into again, and keeps nothing of the earlier merge's schemes
    out = merge_runs([runs / "a", runs / "b"], tmp_path / "m")
    merge_runs([runs / "b", runs / "e"], out)
    assert [r["scheme"] for r in json.loads((out / "summary.json").read_text())["results"]] == [
        SMALL_KIVI.name,
        "int2-token",
    ]
    assert sorted(p.stem for p in (out / "tokens").glob("*.safetensors")) == sorted(
        ["int2-token", SMALL_KIVI.name]
    )
    assert len((out / "records.jsonl").read_text().splitlines()) == sum(
        len((runs / r / "records.jsonl").read_text().splitlines()) for r in ("b", "e")
    )


def test_cli_rerenders_one_run_and_merges_several(runs, tmp_path, capsys):
    single = tmp_path / "single"
    shutil.copytree(runs / "ab", single)
    (single / "report.md").unlink()
    assert main(["report", str(single), "--no-plots"]) == 0
    strict = (single / "report.md").read_text()
    assert "kvbits report" not in strict.split("## How to reproduce")[1]  # a single run keeps its own command
    assert main(["report", str(single), "--no-plots", "--threshold", "1000000"]) == 0
    lenient = (single / "report.md").read_text()
    assert (
        lenient.split("## Verdict")[1][:400] != strict.split("## Verdict")[1][:400]
    )  # the budget changes the verdict
    capsys.readouterr()
    assert (
        main(
            ["report", str(runs / "a"), str(runs / "b"), "--out", str(tmp_path / "m"), "--no-plots", "--json"]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["merged_from"] == [str(runs / "a"), str(runs / "b")] and set(record["files"]) == {
        "markdown",
        "html",
    }
    assert main(["report", str(runs / "a"), str(runs / "b")]) == 2  # no --out
    assert "needs --out" in capsys.readouterr().err
    assert main(["report", str(runs / "a"), "--out", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    # --overwrite (merging into a non-empty --out) was accepted with one run and did nothing
    assert main(["report", str(runs / "a"), "--overwrite"]) == 2
    assert "--overwrite is for merging" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # argparse: a usage error
        main(["report", str(runs / "a"), "--threshold", "-1"])
    assert bad.value.code == 2 and "percentage > 0" in capsys.readouterr().err


def test_calibration_of_a_merged_run_comes_from_each_runs_config(tmp_path):
    """Older runs name their calibration only in config.json: a merged folder finds it under merged_from."""
    from kvbits.report.calibration import calibration_rows

    summary = {
        "context": 4096,
        "results": [{"scheme": "int8-token", "buckets": []}, {"scheme": "kvquant-4", "buckets": []}],
    }
    sub = {"request": {"calibration": {"kvquant-4": "sha256:" + "ab" * 32}}, "args": {"calibration": []}}
    merged = {"merged_from": [{"path": "a", "schemes": ["int8-token"], "config": {}},
                              {"path": "b", "schemes": ["kvquant-4"], "config": sub}]}  # fmt: skip
    rows = calibration_rows(summary, merged)
    assert [(r.scheme, r.artifact) for r in rows] == [("kvquant-4", "sha256:abababababab")]
    assert calibration_rows(summary, {"merged_from": [{"path": "a", "config": {}}]}) == []


def test_needle_and_speed_folders_are_written_again(tmp_path, capsys):
    """Committed needle and speed runs: report.md comes back byte for byte from the JSON."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name, command in (("needle-qwen-prefill", "needle"), ("needle-qwen-all", "needle"), ("speed-qwen", "speed")):
        run = tmp_path / name
        shutil.copytree(results / name, run)
        want = (run / "report.md").read_text()
        (run / "report.md").unlink()
        assert main(["report", str(run)]) == 0
        assert (run / "report.md").read_text() == want
        assert main(["report", str(run), "--threshold", "2"]) == 2
        assert f"holds a kvbits {command} run" in capsys.readouterr().err
        hint = f"{command} runs merge with each other"
        with pytest.raises(FileNotFoundError, match=f"kvbits {command} run: {hint}"):
            merge_runs([run, run.parent / "other"], tmp_path / "m")
    # a speed.json without a field it needs: a one-line error (it was a KeyError traceback)
    summary = json.loads((tmp_path / "speed-qwen" / "speed.json").read_text())
    for r in summary["runs"]:
        del r["ms_per_step"]
    (tmp_path / "speed-qwen" / "speed.json").write_text(json.dumps(summary))
    assert main(["report", str(tmp_path / "speed-qwen")]) == 2
    assert f"{tmp_path / 'speed-qwen' / 'speed.json'}: runs[0].ms_per_step is missing" in capsys.readouterr().err


def test_merged_report_names_each_runs_reference_seconds(runs, tmp_path):
    """Each merged run made its own reference pass; the merged summary keeps the first's. Before, the Overall
    caption said "The unquantized reference pass took 12.0 s." with nothing of the other run's 90.0 s (a run on
    another machine), as if one pass of the merged table; now it says whose it is and lists each run's."""
    from kvbits.report.tables import overall_table

    for name, ref_s in (("a", 12.0), ("b", 90.0)):
        shutil.copytree(runs / name, tmp_path / name)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "reference_seconds": ref_s}))
    out = merge_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    merged = json.loads((out / "summary.json").read_text())
    assert merged["reference_seconds"] == 12.0
    assert [m["reference_seconds"] for m in merged["merged_from"]] == [12.0, 90.0]
    caption = overall_table(RunSummary.load(out)).caption
    assert ("The unquantized reference pass took 12.0 s in the first merged run (each run made its own: "
            "12.0, 90.0 s).") in caption  # fmt: skip
    assert "took 12.0 s." not in caption
    # a single run's caption is unchanged
    assert "The unquantized reference pass took 90.0 s." in overall_table(RunSummary.load(tmp_path / "b")).caption


def _as_version(src, dst, version: int):
    """A copy of run ``src`` as kvbits eval output ``version`` wrote it (``config.json``'s and its request's)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["version"] = cfg["request"]["version"] = version
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_merging_float32_kl_runs_with_float64_ones_is_labelled(runs, tmp_path, caplog):
    """Output version 2 computes KL from float64 log-probabilities, version 1 (the committed results) from float32,
    which overstates a KL below ~1e-5 by tens of percent. Before, ``kvbits report A B`` merged a version-1 and a
    version-2 run into one KL table without a word; now the merge logs a warning and the report names the
    schemes (and runs) whose KL is float32. Version-1 runs still merge with each other, their report saying so."""
    import logging

    v1 = _as_version(runs / "b", tmp_path / "b-v1", 1)
    v2 = runs / "a"  # what this kvbits writes
    with caplog.at_level(logging.WARNING, logger="kvbits.report.merge"):
        out = merge_runs([v2, v1], tmp_path / "mixed")
    assert "float32 log-probabilities" in caplog.text and str(v1) in caplog.text
    paths = write_report(out, plots=False)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    kl = md.split("## KL divergence")[1].split("## Overall")[0]
    warning = kl.split("Warning:")[1].split("\n")[0]
    assert f"`{v1}` (version 1)" in warning and str(v2) not in warning
    assert f"**{SMALL_KIVI.name}**" in warning and all(n not in warning for n in A)
    assert '<p class="warning">Warning: the KL of' in page

    nested = merge_runs([out, runs / "e"], tmp_path / "nested")  # the version-1 run inside an earlier merge
    assert f"`{v1}` (version 1)" in write_report(nested, plots=False)["markdown"].read_text()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbits.report.merge"):
        old = merge_runs([_as_version(runs / "a", tmp_path / "a-v1", 1), v1], tmp_path / "old")
    assert "float32 log-probabilities" not in caplog.text  # all version 1: one precision, as the committed merges
    md = write_report(old, plots=False)["markdown"].read_text()
    assert "*KL computed from float32 log-probabilities" in md and "Warning: the KL" not in md
    single = write_report(v1, plots=False)["markdown"].read_text()  # a version-1 run alone says it too
    assert "*KL computed from float32 log-probabilities" in single
    current = write_report(merge_runs([v2, runs / "b"], tmp_path / "new"), plots=False)["markdown"].read_text()
    assert "float32 log-probabilities" not in current


def test_calibration_folder_recorded_relative_to_the_project_is_found_from_the_run_folder(tmp_path, monkeypatch, caplog):
    """An older run records its calibration folder as given (``runs/<name>``, relative to where it was evaluated):
    the report finds it from the run folder whatever the working directory, and says so where it is nowhere."""
    from kvbits.report.calibration import calibration_rows

    sha = "cd" * 32
    runs = tmp_path / "proj" / "runs"
    (runs / "eval").mkdir(parents=True)
    (runs / "cal-kv4").mkdir()
    meta = {"scheme": {"name": "kvquant-4"}, "files": {"calibration.safetensors": {"sha256": sha}},
            "data": {"name": "pride-and-prejudice", "context": 2048, "windows": 2}}  # fmt: skip
    (runs / "cal-kv4" / "calibration.json").write_text(json.dumps(meta))
    summary = {"context": 8192, "results": [{"scheme": "kvquant-4", "buckets": []}]}
    config = {"request": {"calibration": {"kvquant-4": f"sha256:{sha}"}}, "args": {"calibration": ["runs/cal-kv4"]}}
    monkeypatch.chdir(tmp_path)  # not the project folder the run was evaluated from
    for run_dir in (runs / "eval", Path("proj/runs/eval")):
        (row,) = calibration_rows(summary, config, run_dir)
        assert (row.artifact, row.calibrated_length, row.beyond) == ("cal-kv4 (sha256:cdcdcdcdcdcd)", 2048, 6144)
    moved = tmp_path / "results"  # a results folder copied with its calibrations beside it
    moved.mkdir()
    (runs / "eval").rename(moved / "eval")
    (runs / "cal-kv4").rename(moved / "cal-kv4")
    assert calibration_rows(summary, config, moved / "eval")[0].calibrated_length == 2048
    meta["files"]["calibration.safetensors"]["sha256"] = "ef" * 32  # the folder now holds another calibration
    (moved / "cal-kv4" / "calibration.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="kvbits.report.calibration"):
        (row,) = calibration_rows(summary, config, moved / "eval")
    assert row.artifact == "sha256:cdcdcdcdcdcd (calibration folder gone or replaced)" and row.calibrated_length is None
    assert "none of the calibration folders it records (runs/cal-kv4) holds it" in caplog.text
