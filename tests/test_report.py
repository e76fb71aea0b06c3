"""Report layer: summary.json (+ config.json, + per-token arrays) → report.md, report.html, PNGs.

A synthetic run is built in ``tmp_path`` with known numbers, so every assertion checks a value the
report must have computed or copied exactly: the table rows, the first bucket above 1 % of a scheme
built to fail at 4K, the best trade-off, a self-contained HTML page.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from kvbits.report import RunSummary, bucket_table, print_summary, verdict, write_report
from kvbits.report import plots as report_plots
from kvbits.report.plots import running_mean
from kvbits.report.render import reproduce_command
from kvbits.report.tables import delta_table, fmt_pct, overall_table

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONTEXT = 8192
# as the runner writes them: query positions t (predicting t + 1); an 8K window has 8191 of them
SPANS = [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8191)]
PPL_REF = [20.0, 16.0, 14.0, 13.0]
# scheme: (avg bits, ΔPPL per bucket as fractions). int4-token is built to cross 1 % at 4K-8K only,
# kivi-2 fails from the first bucket, kivi-4 is the cheapest scheme that always stays within 1 %.
SCHEMES = {
    "fp16": (16.0, [0.0, 0.0, 0.0, 0.0]),
    "int8-token": (8.5, [0.0005, 0.0006, 0.0008, 0.0010]),
    "kivi-4": (5.0, [0.001, 0.002, 0.003, 0.005]),
    "int4-token": (4.5, [0.002, 0.004, 0.008, 0.016]),
    "kivi-2": (3.0, [0.03, 0.05, 0.08, 0.12]),
}
EXPECTED_FIGURES = {"ppl_vs_position", "delta_heatmap", "kl_by_bucket", "bits_vs_delta", "attn_error"}


def _ci(d: float) -> list[float]:
    return [d - 0.3 * d - 0.0005, d + 0.3 * d + 0.0005] if d else [0.0, 0.0]


def _result(name: str, bits: float, deltas: list[float], spans=SPANS, layers=(0, 14, 29)) -> dict:
    buckets = []
    for (lo, hi), d, ref in zip(spans, deltas, PPL_REF):
        buckets.append({
            "lo": lo, "hi": hi, "tokens": 2 * (hi - lo), "ppl": ref * (1 + d), "ppl_ref": ref,
            "delta_rel": d, "delta_rel_ci": _ci(d), "kl": 0.5 * d, "top1": 1 - 2 * d,
        })
    mean_d = float(np.mean(deltas))
    attn = [
        {"layer": layer, "buckets": [{"lo": lo, "hi": hi, "rel_err": 0.0 if bits >= 16 else 2.0 ** -bits * (1 + i)}
                                     for i, (lo, hi) in enumerate(spans)]}
        for layer in layers
    ]
    return {"scheme": name, "avg_bits": bits, "ppl": 15.0 * (1 + mean_d), "ppl_ref": 15.0, "kl": 0.5 * mean_d,
            "top1": 1 - 2 * mean_d, "buckets": buckets, "attn_error": attn, "seconds": 12.5}


def _summary(schemes=SCHEMES, context=CONTEXT, spans=SPANS) -> dict:
    return {
        "model": "smollm2-135m", "data": "war-and-peace", "context": context, "semantics": "decode",
        "mode": "simulate", "windows": 2, "fingerprint": {"model": "0123456789abcdef", "tokens": "fedcba9876543210"},
        "results": [_result(n, b, d[: len(spans)], spans) for n, (b, d) in schemes.items()],
        "reference_seconds": 10.0,
    }


def _tokens(path: Path, deltas: list[float], seed: int) -> None:
    """Per-token arrays whose mean NLL difference in each bucket gives that bucket's ΔPPL."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    n = CONTEXT - 1
    pos = np.arange(n)  # entry t = query position t, the positions the buckets count
    ref = np.log(15.0) + rng.normal(0, 1.0, (2, n))
    shift = np.zeros(n)
    for (lo, hi), d in zip(SPANS, deltas):
        shift[(pos >= lo) & (pos < hi)] = math.log1p(d or 0.0)
    nll = ref + shift + (rng.normal(0, 0.01, (2, n)) if any(deltas) else 0.0)  # fp16: exactly the reference
    save_file({
        "nll": nll.astype(np.float32), "nll_ref": ref.astype(np.float32),
        "kl": np.abs(nll - ref).astype(np.float32), "top1": np.ones((2, n), np.float32),
    }, str(path))


def _config() -> dict:
    """config.json as ``kvbits.evaluate.runner.evaluate`` writes it when called from Python."""
    return {
        "version": 1, "config_hash": "0" * 16,
        "args": {"model": "smollm2-135m", "data": "war-and-peace", "context": 8192, "windows": 2,
                 "schemes": list(SCHEMES), "mode": "simulate", "semantics": "decode", "prompt_len": None,
                 "attn_layers": [0, 14, 29], "dtype": "float32", "device": None, "data_path": None},
        "argv": None, "versions": {"kvbits": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0"},
        "commit": {"sha": "abc1234def5678", "dirty": True}, "date": "2026-01-02T03:04:05+00:00",
    }


def _write_run(d: Path, summary: dict | None = None, config: dict | None = None, tokens: bool = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    summary = summary or _summary()
    (d / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if tokens:
        (d / "tokens").mkdir()
        for i, r in enumerate(summary["results"]):
            _tokens(d / "tokens" / f"{r['scheme']}.safetensors", [b["delta_rel"] for b in r["buckets"]], i)
    return d


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    d = _write_run(tmp_path_factory.mktemp("run"), config=_config())
    return d, write_report(d, strict=True)


def _row(md: str, first_cell: str, table_heading: str) -> str:
    """The Markdown table row starting with ``first_cell`` after the caption containing ``table_heading``."""
    section = md[md.index(table_heading):]
    m = re.search(rf"^\| {re.escape(first_cell)} \|.*$", section, re.MULTILINE)
    assert m, f"no row {first_cell!r} after {table_heading!r}"
    return m.group(0)


# ---------------------------------------------------------------------------------------- files


def test_write_report_writes_every_file(full_run):
    d, paths = full_run
    assert set(paths) == {"markdown", "html"} | EXPECTED_FIGURES
    for key in EXPECTED_FIGURES:
        assert paths[key] == d / f"{key}.png"
        assert paths[key].read_bytes()[:8] == PNG_MAGIC
    assert paths["markdown"] == d / "report.md" and paths["html"] == d / "report.html"
    assert not list(d.glob("*.tmp*")), "temporary files left behind"


def test_markdown_tables_hold_the_numbers(full_run):
    md = full_run[1]["markdown"].read_text()
    assert md.startswith("# KV-cache quantization report: smollm2-135m on war-and-peace, 8K context")
    assert "| scheme | bits | 0–1K | 1K–2K | 2K–4K | 4K–8K |" in md
    # ΔPPL table: the one failing cell (4K-8K, +1.60 %) is bold, the others are not
    assert _row(md, "int4-token", "ΔPPL by position") == (
        "| int4-token | 4.50 | +0.20% [+0.09, +0.31] | +0.40% [+0.23, +0.57] | +0.80% [+0.51, +1.09] "
        "| **+1.60% [+1.07, +2.13]** |"
    )
    assert _row(md, "fp16", "ΔPPL by position") == (
        "| fp16 | 16.00 | +0.00% [+0.00, +0.00] | +0.00% [+0.00, +0.00] | +0.00% [+0.00, +0.00] "
        "| +0.00% [+0.00, +0.00] |"
    )
    # overall: PPL 15 * (1 + mean Δ) = 15 * 1.07 for kivi-2
    assert _row(md, "kivi-2", "Whole context") == (
        "| kivi-2 | 3.00 | 16.050 | 15.000 | **+7.00%** | 0.0350 | 86.00% | 12.5 |"
    )
    assert _row(md, "kivi-4", "Mean KL") == "| kivi-4 | 5.00e-04 | 0.0010 | 0.0015 | 0.0025 |"
    assert _row(md, "int8-token", "Top-1 agreement") == "| int8-token | 99.90% | 99.88% | 99.84% | 99.80% |"
    assert _row(md, "reference", "Perplexity by position") == "| reference | 20.000 | 16.000 | 14.000 | 13.000 |"
    assert _row(md, "kivi-2", "attention output") == "| kivi-2 | 0 | 0.1250 | 0.2500 | 0.3750 | 0.5000 |"
    assert "reference pass took 10.0 s" in md
    for key in EXPECTED_FIGURES:
        assert f"]({key}.png)" in md


def test_report_header_and_reproduce_line(full_run):
    md = full_run[1]["markdown"].read_text()
    for text in ("fingerprint `0123456789abcdef`", "2026-01-02T03:04:05+00:00", "`abc1234def5678 (dirty tree)`",
                 "torch 2.13.0", "`decode`, `simulate` mode", "8192 tokens per window, 2 window(s)"):
        assert text in md
    d = full_run[0]
    assert (
        "kvbits eval --model smollm2-135m --data war-and-peace --context 8192 --windows 2 --scheme fp16 "
        "--scheme int8-token --scheme kivi-4 --scheme int4-token --scheme kivi-2 --mode simulate "
        f"--semantics decode --attn-layers 0 14 29 --dtype float32 --out {d}\n"
    ) in md


def test_html_is_standalone(full_run):
    page = full_run[1]["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert page.count("data:image/png;base64,") == len(EXPECTED_FIGURES)
    srcs = re.findall(r'src="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in page and "<script" not in page
    assert '<td class="r bad">+1.60% [+1.07, +2.13]</td>' in page
    assert "<strong>int4-token</strong> at 4K–8K" in page


# ---------------------------------------------------------------------------------------- verdict


def test_verdict_names_first_failing_bucket_and_best_tradeoff():
    v = verdict(_summary())
    assert "**int8-token** and **kivi-4** stay within 1% ΔPPL" in v
    assert "**int4-token** at 4K–8K (+1.60%, 95% CI +1.07% to +2.13%)" in v
    assert "**kivi-2** already in the first bucket, 0–1K (+3.00%" in v
    assert "Best bits/quality trade-off: **kivi-4**, 5.00 bits per element (3.2× smaller than fp16)" in v
    assert "**int4-token** (+0.20% at 0–1K → +1.60% at 4K–8K)" in v
    assert "fp16" not in v.split("First bucket")[0].split("stay within")[0]  # baseline is not "passing"
    # a stricter budget moves int4-token's first failure earlier
    assert "**int4-token** at 2K–4K (+0.80%" in verdict(_summary(), threshold=0.005)


def test_bits_at_the_context_are_shown_beside_the_long_run_bits():
    """A run records ``bits_at_context`` (what the cache stores at its context, full-precision window included)
    beside the long-run ``avg_bits``. Before, the report showed the long-run figure alone: kivi-2 at 64 tokens read
    "3.00 bits (5.3× smaller)" with nothing quantized yet. Older runs without it read n/a, and the verdict is
    unchanged where both agree. Runs from before the field keep their table (no column)."""
    s = _summary()
    for r in s["results"]:
        r["bits_at_context"] = r["avg_bits"] + (0.38 if r["scheme"] == "kivi-4" else 0.0)
    v = verdict(s)
    assert "**kivi-4**, 5.00 bits per element (3.2× smaller than fp16) in the long run, 5.38 at this 8,192-token " \
           "context" in v
    o = overall_table(s)
    assert o.headers[1:3] == ("avg bits", "bits at context")
    row = next(r for r in o.rows if r[0].text == "kivi-4")
    assert [c.text for c in row[1:3]] == ["5.00", "5.38"]
    assert "bits at context: what the cache stores" in o.caption
    old = overall_table(_summary())  # a run from before the field
    assert "bits at context" not in old.headers and "bits at context" not in old.caption
    s["results"][0]["bits_at_context"] = None  # a peer cache's row in a new run
    assert overall_table(s).rows[0][2].text == "n/a"
    assert "in the long run" not in verdict(_summary())


def test_bits_at_context_caption_says_which_plan_dtype_it_matches():
    """The caption called bits at context "kvbits plan's avg_bits", but plan's default table counts a GGUF model in
    2-byte elements while eval runs float32: smollm2-135m's kivi-2 at 512 tokens read 10.25 in the report and 6.25
    in `kvbits plan --model smollm2-135m --context 512` (10.25 with --dtype-bytes 4). The caption says so now."""
    s = _summary()
    for r in s["results"]:
        r["bits_at_context"] = r["avg_bits"]
    caption = overall_table(s).caption
    assert "in the dtype the model ran in" in caption and "--dtype-bytes" in caption, caption


def test_verdict_in_report(full_run):
    md = full_run[1]["markdown"].read_text()
    assert verdict(RunSummary.load(full_run[0])) in md


def test_verdict_when_nothing_passes_and_baseline_drifts():
    s = _summary({"fp16": (16.0, [0.0, 0.002, 0.0, 0.0]), "kivi-2": (3.0, [0.03, 0.05, 0.08, 0.12]),
                  "int2-token": (2.5, [0.5, 0.6, 0.7, 0.9])})
    v = verdict(s)
    assert "No quantized scheme stays within 1%" in v
    assert "Least damaging quantized scheme: **kivi-2**" in v
    assert "Warning: the unquantized **fp16** differs from the reference by up to +0.20%" in v


def test_a_budget_is_named_as_it_is_applied(tmp_path):
    """``--threshold 0.5`` (the CLI's own example) was printed as a 0 % budget and 2.5 % as 2 %: the verdict,
    captions and figures named a budget they did not apply. The heatmap's colours follow the budget too."""
    v = verdict(_summary(), threshold=0.005)
    assert "stay within 0.5% ΔPPL" in v and "First bucket above 0.5%" in v
    assert "First bucket above 2.5%: **kivi-2** already in the first bucket, 0–1K (+3.00%" in verdict(_summary(), threshold=0.025)
    assert delta_table(_summary(), threshold=0.005).caption.endswith("above +0.5% marked.")
    md = write_report(_write_run(tmp_path / "run"), threshold=0.005, strict=True)["markdown"].read_text()
    assert "the dotted red line is the 0.5% budget" in md and "above +0.5% marked" in md


@pytest.mark.parametrize(("threshold", "labels"), [
    (0.01, ["0.1%", "0.5%", "1%", "2%", "5%", "10%"]),
    (0.005, ["0.05%", "0.25%", "0.5%", "1%", "2.5%", "5%"]),
    (0.02, ["0.2%", "1%", "2%", "4%", "10%", "20%"]),
])  # fmt: skip
def test_heatmap_colour_bar_labels_its_colour_boundaries(tmp_path, monkeypatch, threshold, labels):
    """The heatmap's colours follow the budget, so its colour bar must label the boundaries at that budget. Before,
    it labelled the 1 % budget's values wherever they fell: at a 0.5 % budget "5%" and "10%" sat on the same
    boundary (both at 0.857 of the bar) and at 2 % the 0.2 % boundary read "0.1%"."""
    from kvbits.report.plots import heatmap

    figures = []
    monkeypatch.setattr(heatmap, "save_png", lambda fig, path: figures.append(fig) or path)
    heatmap.plot_delta_heatmap(RunSummary.from_dict(_summary()), tmp_path / "h.png", threshold=threshold)
    bar = figures[0].axes[1]._colorbar
    figures[0].canvas.draw()
    assert [t.get_text() for t in bar.ax.get_yticklabels()] == labels
    assert np.allclose(bar.ax.get_yticks(), bar._boundaries[1:-1])  # each label on a colour boundary


def test_the_heatmap_colours_a_bucket_as_the_verdict_judges_it(tmp_path, monkeypatch):
    """A ΔPPL exactly at the budget is within it for the verdict and the tables (a bucket fails *above* it), but the
    heatmap's colour bins hold [lo, hi) and put it in the first colour beyond the budget (#fee08b): a scheme the
    verdict says "stays within 1%" was drawn failing in three buckets. Just above the budget is beyond, as before."""
    from matplotlib.colors import to_hex

    from kvbits.report.plots import heatmap

    figures = []
    monkeypatch.setattr(heatmap, "save_png", lambda fig, path: figures.append(fig) or path)
    s = _summary({"at": (4.0, [0.005, 0.01, 0.01, 0.01]), "over": (4.0, [0.005, 0.0100001, 0.02, 0.2])})
    assert verdict(s).startswith("**at** stays within 1% ΔPPL")
    heatmap.plot_delta_heatmap(RunSummary.from_dict(s), tmp_path / "h.png")
    im = figures[0].axes[0].images[0]
    colours = [[to_hex(c) for c in row] for row in im.to_rgba(im.get_array())]
    assert colours == [["#d9ef8b"] * 4, ["#d9ef8b", "#fee08b", "#fc8d59", "#b30000"]]


def test_a_baseline_below_the_reference_is_warned_about_too():
    """The warning looked at the largest signed bucket ΔPPL: fp16 3 % *below* the reference went unsaid."""
    for deltas, shown in (([0.0, -0.03, 0.0, 0.0], "-3.00%"), ([0.00005, -0.03, 0.0, 0.0], "-3.00%"),
                          ([0.0, 0.03, -0.01, 0.0], "+3.00%")):  # fmt: skip
        v = verdict(_summary({"fp16": (16.0, deltas), "kivi-4": SCHEMES["kivi-4"]}))
        assert f"Warning: the unquantized **fp16** differs from the reference by up to {shown}" in v, deltas


def test_names_are_text_not_markup(tmp_path):
    """Names from summary.json went to rich as markup: a data path with ``[/tmp]`` raised MarkupError after the
    report was written, ``llama-[instruct]`` showed as ``llama-``. In Markdown, ``<``/``>`` outside code spans are
    entities (a scheme JSON may name its scheme anything); in HTML, a code span is kept as it is."""
    from rich.console import Console

    from kvbits.report.html_page import _inline
    from kvbits.report.markdown import _md_text, md_cell

    s = _summary({"fp16": SCHEMES["fp16"], "k[/]": SCHEMES["kivi-4"], "int4-[bold]g32": SCHEMES["int4-token"]})
    s.update(model="llama-[instruct]", data="/corpora/[/tmp]/book.txt")
    con = Console(record=True, width=250, color_system=None)
    print_summary(s, con)
    text = con.export_text()
    for name in ("llama-[instruct]", "/corpora/[/tmp]/book.txt", "k[/]", "int4-[bold]g32"):
        assert name in text, name
    assert _md_text("a <img src=x> `b <c>` d") == "a &lt;img src=x&gt; `b <c>` d"
    assert md_cell("x|y\nz") == "x\\|y z"
    assert _inline("- `/corpora/*/part-*.txt` *it*") == "- <code>/corpora/*/part-*.txt</code> <em>it</em>"


def test_html_italic_around_a_code_span():
    """An italic note holding a code span (*No per-token arrays in `tokens/` ...*, the float32-KL note) was split
    at the code span and its ``*`` shown literally in report.html; a literal ``\\x01`` in a name is kept."""
    from kvbits.report.html_page import _inline

    assert _inline("*No arrays in `tokens/`: bucket means.*") == "<em>No arrays in <code>tokens/</code>: bucket means.</em>"
    assert _inline("**a `b*` c** *d*") == "<strong>a <code>b*</code> c</strong> <em>d</em>"
    assert _inline("x\x010\x01 `c`") == "x\x010\x01 <code>c</code>"


# ---------------------------------------------------------------------------------------- terminal


def test_bucket_table_and_print_summary():
    from rich.console import Console

    con = Console(record=True, width=200, color_system=None)
    con.print(bucket_table(_summary()))
    text = con.export_text()
    for s in ("4K–8K", "int4-token", "+1.60%", "[+1.07, +2.13]", "99.84%"):
        assert s in text
    con = Console(record=True, width=200, color_system=None)
    print_summary(_summary(), con)
    text = con.export_text()
    assert "kivi-4" in text and "16.050" in text and "First bucket above 1%" in text
    assert "**" not in text  # bold marks became styles
    assert "peak memory" not in text  # not recorded in this summary


def test_print_summary_never_cuts_a_figure(capsys, monkeypatch):
    """``kvbits eval`` piped to a log or run in CI (stdout not a terminal) printed its tables at rich's default 80
    columns: a long scheme name was cut to "kvquant-in…" and the table squeezed. Now a pipe's lines are as long as
    their content, and a narrow terminal folds a cell that does not fit onto the next line, never cutting it."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    name = "kvquant-int2-long-name-g32"
    s = _summary({"fp16": SCHEMES["fp16"], name: SCHEMES["kivi-2"], "int4-token": SCHEMES["int4-token"]})
    print_summary(s)
    out = capsys.readouterr().out
    assert "…" not in out and f"│ {name} │" in out and "[+8.35, +15.65]" in out  # its 4K–8K CI on one line
    monkeypatch.setenv("FORCE_COLOR", "1")  # a 50-column terminal: fitted to it, nothing cut
    monkeypatch.setenv("COLUMNS", "50")
    print_summary(s)
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in _plain(out).splitlines()) <= 50


def _plain(text: str) -> str:
    """``text`` without ANSI escape sequences."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_peak_memory_in_header_and_terminal(tmp_path):
    s = _summary({k: SCHEMES[k] for k in ("fp16", "kivi-2")})
    s.update(peak_rss_bytes=int(1.5 * 2**30), peak_cuda_bytes=None)
    md = write_report(_write_run(tmp_path / "cpu", s, tokens=False), plots=False)["markdown"].read_text()
    assert "- **Peak memory:** 1.50 GiB resident (process peak)\n" in md
    s.update(peak_cuda_bytes=3 * 2**29)
    paths = write_report(_write_run(tmp_path / "cuda", s, tokens=False), plots=False)
    line = "1.50 GiB resident (process peak), 1.50 GiB CUDA allocated (run peak)"
    assert f"- **Peak memory:** {line}" in paths["markdown"].read_text()
    assert f"<strong>Peak memory:</strong> {line}</li>" in paths["html"].read_text()
    from rich.console import Console

    con = Console(record=True, width=300, color_system=None)
    print_summary(s, con)
    assert f"peak memory {line}" in con.export_text()
    assert "Peak memory" not in write_report(
        _write_run(tmp_path / "old", _summary(), tokens=False), plots=False
    )["markdown"].read_text()
    s.update(run_peak_rss_bytes=2**30, peak_cuda_bytes=None)
    md = write_report(_write_run(tmp_path / "run", s, tokens=False), plots=False)["markdown"].read_text()
    assert "- **Peak memory:** 1.00 GiB resident (run peak, model loaded), 1.50 GiB resident (process peak)\n" in md
    s.update(run_peak_rss_bytes=int(1.5 * 2**30) - 1000)  # the same printed figure: said once
    md = write_report(_write_run(tmp_path / "same", s, tokens=False), plots=False)["markdown"].read_text()
    assert "- **Peak memory:** 1.50 GiB resident (run peak, model loaded; also the process peak)\n" in md


# ---------------------------------------------------------------------------------------- edge cases


def _nan_summary() -> dict:
    s = _summary()
    r = s["results"][3]  # int4-token: holes everywhere
    r["buckets"][1].update(delta_rel=None, delta_rel_ci=None, kl=float("nan"), top1=None, ppl=None)
    r["buckets"][2].pop("delta_rel_ci")
    r["avg_bits"] = None
    r["kl"] = float("nan")
    s["results"][1]["attn_error"] = []
    del s["results"][2]["seconds"]
    s["reference_seconds"] = None
    return s


EDGE_CASES = {
    "fp16 only": (_summary({"fp16": SCHEMES["fp16"]}), True),
    "single bucket": (_summary({k: SCHEMES[k] for k in ("fp16", "kivi-2")}, context=1000, spans=[(0, 999)]), False),
    "nan and missing": (_nan_summary(), True),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases_do_not_crash(tmp_path, case):
    summary, tokens = EDGE_CASES[case]
    d = _write_run(tmp_path / "run", summary, tokens=tokens)  # no config.json, maybe no tokens/
    paths = write_report(d, strict=True)
    md = paths["markdown"].read_text()
    assert set(paths) - {"markdown", "html"} == EXPECTED_FIGURES
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert "## Verdict" in md and "kvbits eval --model smollm2-135m" in md
    if case == "fp16 only":
        assert "Only unquantized schemes were evaluated" in md
        assert "| fp16 | 0 | 0 | 0 | 0 |" in md  # KL row: zeros print as 0, the log plot skipped them
    if case == "single bucket":
        assert "| kivi-2 | 3.00 | **+3.00% [+2.05, +3.95]** |" in md
        assert "**kivi-2** already in the first bucket, 0–999 (+3.00%" in md
        assert md.startswith("# KV-cache quantization report: smollm2-135m on war-and-peace, 1000-token context")
    if case == "nan and missing":
        assert "| int4-token | n/a | +0.20% [+0.09, +0.31] | n/a | +0.80% | **+1.60% [+1.07, +2.13]** |" in md
        assert "**int4-token** at 4K–8K" in md
        cells = _row(md, "int4-token", "Whole context").split(" | ")
        assert cells[1] == "n/a" and cells[5] == "n/a"  # avg bits None, KL NaN
        assert "| kivi-4 | 5.00 | 15.041 | 15.000 | +0.28% | 0.0014 | 99.45% | n/a |" in md  # no seconds
        assert "reference pass took" not in md


def test_run_without_attention_error(tmp_path):
    s = _summary()
    for r in s["results"]:
        r.pop("attn_error")
    d = _write_run(tmp_path / "run", s, tokens=False)
    assert report_plots.plot_attn_error(RunSummary.load(d), d / "attn.png") is None
    assert not (d / "attn.png").exists()
    paths = write_report(d, plots=False)
    assert set(paths) == {"markdown", "html"}
    md = paths["markdown"].read_text()
    assert "## Attention-output error\n\nNot measured in this run." in md
    assert "![" not in md


def test_empty_results_and_missing_summary(tmp_path):
    d = _write_run(tmp_path / "empty", {"model": "m", "results": []}, tokens=False)
    paths = write_report(d, strict=True)
    assert "The run holds no results." in paths["markdown"].read_text()
    with pytest.raises(FileNotFoundError, match="summary.json"):
        write_report(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="threshold"):
        write_report(d, threshold=0)
    (d / "summary.json").write_text('{"model": "m", "results": [')  # cut short
    with pytest.raises(ValueError, match=r"summary.json is not valid JSON .* interrupted"):
        write_report(d)


def test_without_matplotlib(tmp_path, monkeypatch):
    def missing():
        raise ImportError(report_plots.INSTALL_HINT)

    monkeypatch.setattr(report_plots, "require_matplotlib", missing)
    d = _write_run(tmp_path / "run", tokens=False)
    paths = write_report(d)
    assert set(paths) == {"markdown", "html"}
    assert "pip install 'kvbits[plot]'" in paths["markdown"].read_text()
    assert "data:image/png" not in paths["html"].read_text()
    with pytest.raises(ImportError, match="kvbits\\[plot\\]"):
        write_report(d, plots=True)
    assert set(write_report(d, plots=False)) == {"markdown", "html"}


def test_figures_not_drawn_this_time_are_removed(tmp_path, monkeypatch):
    """``kvbits eval --overwrite`` (or ``kvbits report`` again) without matplotlib rewrote report.md and report.html
    but left the five PNGs of the earlier report beside them, to pass for this run's figures; so did ``--no-plots``
    and a figure that failed this time. A figure not drawn now is removed; other files in the folder are kept."""

    def missing():
        raise ImportError(report_plots.INSTALL_HINT)

    d = _write_run(tmp_path / "run", tokens=False)
    (d / "notes.png").write_bytes(PNG_MAGIC)
    for patch, kwargs, left in (
        (("plot_kl", lambda *a, **k: 1 / 0), {}, EXPECTED_FIGURES - {"kl_by_bucket"}),
        (None, {"plots": False}, set()),
        (("require_matplotlib", missing), {}, set()),
    ):
        assert EXPECTED_FIGURES <= set(write_report(d, strict=True))
        with monkeypatch.context() as m:
            if patch:
                m.setattr(report_plots, *patch)
            write_report(d, **kwargs)
        assert {p.stem for p in d.glob("*.png")} == left | {"notes"}


def test_failed_figure_is_reported_not_fatal(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    def cheap(*args, **kwargs):  # the other figures are not under test here
        path = next(a for a in args if isinstance(a, Path))
        path.write_bytes(PNG_MAGIC)
        return path

    for name in ("plot_ppl_position", "plot_delta_heatmap", "plot_tradeoff", "plot_attn_error"):
        monkeypatch.setattr(report_plots, name, cheap)
    monkeypatch.setattr(report_plots, "plot_kl", broken)
    d = _write_run(tmp_path / "run", tokens=False)
    paths = write_report(d)
    assert set(paths) - {"markdown", "html"} == EXPECTED_FIGURES - {"kl_by_bucket"}
    assert "`kl_by_bucket.png` could not be drawn: RuntimeError: boom" in paths["markdown"].read_text()
    with pytest.raises(RuntimeError, match="boom"):
        write_report(d, strict=True)


# ---------------------------------------------------------------------------------------- pieces


def test_split_modules_keep_the_public_names():
    """render and plots were split into modules with one job; the old import paths still work."""
    from kvbits.report import render
    from kvbits.report.plots import figure

    for name in render.__all__:
        assert callable(getattr(render, name)), name
    for name in report_plots.__all__:
        assert hasattr(report_plots, name), name
    assert report_plots.running_mean is figure.running_mean
    assert report_plots.INSTALL_HINT == figure.INSTALL_HINT
    assert set(report_plots.PLOT_FILES) == EXPECTED_FIGURES


def test_running_mean_matches_convolution_and_skips_nan():
    x = np.random.default_rng(0).normal(size=50)
    centre, m = running_mean(x, 8)
    np.testing.assert_allclose(m, np.convolve(x, np.ones(8) / 8, mode="valid"))
    assert centre[0] == 3.5 and len(m) == 43
    x[10] = np.nan
    _, m = running_mean(x, 4)
    np.testing.assert_allclose(m[7], np.mean(x[[7, 8, 9]]))
    assert np.isfinite(m).all()
    _, m = running_mean(x[:3], 256)  # window clipped to the data
    assert m.shape == (1,)


def test_reproduce_command_prefers_recorded_command():
    run = RunSummary.from_dict(_summary())
    assert reproduce_command({"command": "kvbits eval --x 1"}, run) == "kvbits eval --x 1"
    argv = ["/usr/bin/kvbits", "eval", "--model", "a b"]
    assert reproduce_command({"argv": argv, "args": {"model": "x"}}, run) == "kvbits eval --model 'a b'"
    assert reproduce_command({}, run, "out").endswith("--scheme int4-token --scheme kivi-2 --mode simulate --semantics decode --out out")
    no_attn = {"args": {"model": "m", "schemes": ["kivi-2"], "attn_layers": [], "prompt_len": None}}
    assert reproduce_command(no_attn, run) == "kvbits eval --model m --scheme kivi-2 --attn-layers"


def test_reproduce_command_parses_with_the_eval_cli(tmp_path):
    """The rebuilt command line is one `kvbits eval` accepts, with the same settings."""
    import shlex

    pytest.importorskip("kvbits.evaluate.cli")
    from kvbits.cli import build_parser

    line = reproduce_command(_config(), RunSummary.from_dict(_summary()), tmp_path / "out")
    args = build_parser(only="eval").parse_args(shlex.split(line)[1:])
    assert (args.model, args.data, args.context, args.windows) == ("smollm2-135m", "war-and-peace", 8192, 2)
    assert args.scheme == list(SCHEMES) and args.attn_layers == [0, 14, 29] and args.out == str(tmp_path / "out")


def test_reproduce_command_repeats_calibration_flags():
    pytest.importorskip("kvbits.evaluate.cli")
    import shlex

    from kvbits.cli import build_parser

    config = _config()
    config["args"].update(calibration=["cal/a", "cal/b"], chunk_size=128, seed=7, fused_decode="off")
    line = reproduce_command(config, RunSummary.from_dict(_summary()))
    assert "--calibration cal/a --calibration cal/b" in line
    args = build_parser(only="eval").parse_args(shlex.split(line)[1:])
    assert args.calibration == ["cal/a", "cal/b"]
    assert (args.chunk_size, args.seed, args.fused_decode) == (128, 7, "off")


def test_tables_are_consistent_with_formatting():
    t = delta_table(_summary())
    assert t.headers[2:] == ("0–1K", "1K–2K", "2K–4K", "4K–8K")
    tones = [c.tone for c in t.rows[3][2:]]
    assert tones == ["good", "good", "good", "bad"]
    o = overall_table(_summary())
    assert [c.text for c in o.rows[0]][:5] == ["fp16", "16.00", "15.000", "15.000", "+0.00%"]
    assert fmt_pct(float("nan")) == "n/a" and fmt_pct(1.5) == "+150.0%"
    assert fmt_pct(-1e-6) == "+0.00%" and fmt_pct(-0.0001) == "-0.01%"


def test_corrupt_or_partial_token_files_are_skipped(tmp_path):
    from kvbits.report.render import load_token_arrays

    d = _write_run(tmp_path / "run", _summary({k: SCHEMES[k] for k in ("fp16", "kivi-2")}))
    (d / "tokens" / "kivi-2.safetensors").write_bytes(b"not a safetensors file")
    tokens = load_token_arrays(d, ["fp16", "kivi-2", "int8-token"])
    assert set(tokens) == {"fp16"} and tokens["fp16"]["nll"].shape == (2, CONTEXT - 1)
    assert load_token_arrays(tmp_path / "no-such-run", ["fp16"]) == {}


# ---------------------------------------------------------------------------------------- calibration

_NO_CLIP = {"clipped_keys": 0, "clipped_keys_frac": 0.0, "clipped_values": 0, "clipped_values_frac": 0.0}


def _calibrated_summary() -> dict:
    """kivi-4 as a calibrated scheme served past its 512-token calibration, clipping 0.25 % of keys;
    int8-token with the all-zero clipping record every simulate-mode scheme carries."""
    s = _summary({k: SCHEMES[k] for k in ("int8-token", "kivi-4")})
    s["results"][0]["calibration"] = dict(_NO_CLIP)
    s["results"][1]["calibration"] = {
        "clipped_keys": 2500, "clipped_keys_frac": 0.0025, "clipped_values": 10, "clipped_values_frac": 1e-5,
        "max_calibrated_length": 512, "positions_beyond_calibrated": 7680,
        "artifact": {"id": "sha256:" + "ab" * 32, "path": "runs/calib-kivi-512", "data": "pride-and-prejudice",
                     "context": 512, "windows": 2, "tokens": 1024},
    }
    return s


def test_calibration_section_shows_artifact_clipping_and_warnings(tmp_path):
    d = _write_run(tmp_path / "run", _calibrated_summary(), config=_config(), tokens=False)
    paths = write_report(d, plots=False)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    section = md[md.index("## Calibration"):md.index("## How to reproduce")]
    assert "*Clipped* is the fraction" in section and "beyond calibrated" in section
    assert _row(md, "kivi-4", "Calibration served per scheme") == (
        "| kivi-4 | calib-kivi-512 (sha256:abababababab) | pride-and-prejudice, 2 windows of 512 tokens | 512 "
        "| **0.250% (2,500)** | 0.001% (10) | **7,680 of 8,192** |"
    )
    assert "| int8-token |" not in section  # no artifact, nothing clipped: not a calibrated scheme
    assert (
        "Warning: **kivi-4** serves 7,680 of 8,192 positions per window beyond the 512 tokens it was "
        "calibrated on; clips 0.250% of its keys against the calibrated ranges (warning level 0.1%)."
    ) in section
    assert "values against" not in section  # 0.001 % of the values is below the warning level
    assert "<h2>Calibration</h2>" in page and '<td class="r bad">0.250% (2,500)</td>' in page
    assert '<p class="warning">Warning: <strong>kivi-4</strong> serves 7,680' in page


def test_a_few_clipped_elements_never_print_as_zero_percent():
    """3 clipped values of 15M (2e-7) printed as "0.000% (3)": a clipping rate shown as none beside its count."""
    from kvbits.report.calibration import calibration_row, calibration_table

    row = calibration_row("kivi-4", {"clipped_keys": 0, "clipped_keys_frac": 0.0, "clipped_values": 3,
                                     "clipped_values_frac": 2e-7, "max_calibrated_length": 512}, 512)
    cells = [c.text for c in calibration_table([row]).rows[0]]
    assert cells[4:6] == ["0", "<0.001% (3)"]


def test_calibration_warning_ends_with_the_advice_eval_logs(tmp_path, caplog):
    """The report said how many positions a scheme served past its calibrated length but not what to do, where
    ``kvbits eval``'s log added 'Calibrate with --context N to cover every position.': the report's warning (Markdown,
    HTML, terminal) ends with the same sentence now, naming the run's context; a record without the run's context
    advises the calibrated length plus the positions beyond it (eval's log said '--context 0')."""
    from rich.console import Console

    from kvbits.evaluate.measures import _warn_mismatch
    from kvbits.report.calibration import calibration_row, calibration_warnings

    advice = "Calibrate with --context 8192 to cover every position."
    md = write_report(_write_run(tmp_path / "run", _calibrated_summary(), config=_config(), tokens=False),
                      plots=False)["markdown"].read_text()  # fmt: skip
    assert "(warning level 0.1%). " + advice + "\n" in md
    con = Console(record=True, width=400, color_system=None)
    print_summary(_calibrated_summary(), con)
    assert "(warning level 0.1%). " + advice in con.export_text()
    with caplog.at_level("WARNING", logger="kvbits"):
        for context in (8192, 0):
            _warn_mismatch("kivi-4", _calibrated_summary()["results"][1]["calibration"], context)
    assert caplog.text.count(advice) == 2 and "--context 0" not in caplog.text
    within = calibration_row("x", {"max_calibrated_length": 512, "positions_beyond_calibrated": 0,
                                   "clipped_keys_frac": 0.01}, 512)  # fmt: skip
    assert "Calibrate" not in calibration_warnings([within])[0]  # clipping alone: no --context advice
    from kvbits.report.calibration import cover_advice  # the one sentence the caches' warnings say too

    assert cover_advice(8192) == advice


def test_generation_past_the_calibrated_length_is_warned_in_the_report_as_in_the_log(tmp_path, caplog):
    """``kvbits eval --generate N`` records ``generation_positions_beyond_calibrated`` and logs a warning, but the
    report (Markdown, terminal) said nothing of it: it now says the log's sentence, with the ``--context`` that
    covers the window and its continuation. A record without the key (runs from before it) renders as before."""
    from rich.console import Console

    from kvbits.evaluate.measures import _warn_mismatch

    s = _calibrated_summary()
    cal = s["results"][1]["calibration"]
    cal.update(max_calibrated_length=8192, positions_beyond_calibrated=0, generation_positions_beyond_calibrated=64)
    said = (
        "(generation: 64 tokens after each 8,192-token window) serves 64 of 8,256 positions per window beyond the "
        "8,192 tokens it was calibrated on. Calibrate with --context 8256 to cover every position."
    )
    md = write_report(_write_run(tmp_path / "run", s, config=_config(), tokens=False), plots=False)["markdown"]
    assert f"Warning: **kivi-4** {said}\n" in md.read_text()
    con = Console(record=True, width=400, color_system=None)
    print_summary(s, con)
    assert f"Warning: kivi-4 {said}" in con.export_text()
    with caplog.at_level("WARNING", logger="kvbits"):
        _warn_mismatch("kivi-4", cal, 8192)
    assert f"kivi-4 {said}" in caplog.text  # the same words
    from kvbits.report.calibration import calibration_row, generation_warning

    no_context = generation_warning(calibration_row("kivi-4", cal, 0))  # a record without the run's context
    assert no_context == "(generation) " + said[said.index(")") + 2:]
    old = _calibrated_summary()  # no key: unchanged
    before = write_report(_write_run(tmp_path / "old", old, config=_config(), tokens=False), plots=False)["markdown"]
    assert "generation:" not in before.read_text()
    cal["generation_positions_beyond_calibrated"] = 0
    md = write_report(_write_run(tmp_path / "within", s, config=_config(), tokens=False), plots=False)["markdown"]
    assert "generation:" not in md.read_text()


def test_print_summary_shows_calibration_warnings():
    from rich.console import Console

    con = Console(record=True, width=300, color_system=None)
    print_summary(_calibrated_summary(), con)
    text = con.export_text()
    assert (
        "Warning: kivi-4 serves 7,680 of 8,192 positions per window beyond the 512 tokens it was calibrated on; "
        "clips 0.250% of its keys"
    ) in text
    con = Console(record=True, width=300, color_system=None)
    print_summary(_summary(), con)
    assert "Warning" not in con.export_text()


def test_calibration_without_mismatch_has_no_warning(tmp_path):
    s = _calibrated_summary()
    s["results"][1]["calibration"].update(positions_beyond_calibrated=0, clipped_keys=0, clipped_keys_frac=0.0)
    md = write_report(_write_run(tmp_path / "run", s, tokens=False), plots=False)["markdown"].read_text()
    assert "## Calibration" in md and "| 0 | 0.001% (10) | 0 of 8,192 |" in md
    assert "Warning:" not in md


def test_no_calibration_section_without_calibrated_schemes(full_run, tmp_path):
    assert "Calibration" not in full_run[1]["markdown"].read_text()
    s = _calibrated_summary()
    s["results"][1]["calibration"] = dict(_NO_CLIP)  # simulate mode records zeros for every scheme
    paths = write_report(_write_run(tmp_path / "run", s, tokens=False), plots=False)
    assert "Calibration" not in paths["markdown"].read_text() and "Calibration" not in paths["html"].read_text()


def test_calibration_from_config_for_older_runs(tmp_path):
    """A summary without calibration records (an older run): the artifact comes from config.json and
    its folder's calibration.json; clipping was not measured; positions beyond follow from the context."""
    art = tmp_path / "calib"
    art.mkdir()
    sha = "cd" * 32
    (art / "calibration.json").write_text(json.dumps({
        "scheme": {"name": "kivi-4"}, "data": {"name": "moby-dick", "context": 2048, "windows": 3},
        "files": {"calibration.safetensors": {"sha256": sha}},
    }))
    config = _config()
    config["request"] = {"calibration": {"kivi-4": f"sha256:{sha}"}}
    config["args"]["calibration"] = [str(art)]
    d = _write_run(tmp_path / "run", _summary({k: SCHEMES[k] for k in ("int8-token", "kivi-4")}), config=config,
                   tokens=False)
    md = write_report(d, plots=False)["markdown"].read_text()
    assert _row(md, "kivi-4", "Calibration served per scheme") == (
        "| kivi-4 | calib (sha256:cdcdcdcdcdcd) | moby-dick, 3 windows of 2048 tokens | 2,048 | n/a | n/a "
        "| **6,144 of 8,192** |"
    )
    assert "Warning: **kivi-4** serves 6,144 of 8,192 positions" in md
    # the folder now holds another calibration: only the recorded id is shown, and that the folder is not its
    config["request"]["calibration"]["kivi-4"] = "sha256:" + "ef" * 32
    (d / "config.json").write_text(json.dumps(config))
    md = write_report(d, plots=False)["markdown"].read_text()
    assert "| kivi-4 | sha256:efefefefefef (calibration folder gone or replaced) | n/a | n/a | n/a | n/a | n/a |" in md


def test_stream_decode_path_is_reported(tmp_path):
    """A stream run says how each kvbits scheme's decode steps were attended; simulate runs say nothing."""
    s = _summary({k: SCHEMES[k] for k in ("fp16", "kivi-2")})
    s["results"][0]["decode"] = {"fused_steps": 0, "fallback_steps": 0}
    s["results"][1]["decode"] = {"fused_steps": 4140, "fallback_steps": 12}
    md = write_report(_write_run(tmp_path / "stream", s, tokens=False), plots=False)["markdown"].read_text()
    assert "*Decode path (stream mode):* **fp16**: dequantized K/V + SDPA (no fused decode); **kivi-2**: " in md
    assert "4,140 layer-steps through the fused kernel over the packed cache, 12 over dequantized K/V" in md
    md = write_report(_write_run(tmp_path / "sim", _summary(), tokens=False), plots=False)["markdown"].read_text()
    assert "Decode path" not in md


def test_the_least_damaging_scheme_is_named_without_its_bits():
    """Every scheme failing and the least damaging one with no bits recorded: the sentence vanished."""
    s = _summary({"fp16": SCHEMES["fp16"], "custom": (16.0, [0.02, 0.03, 0.04, 0.05]), "kivi-2": SCHEMES["kivi-2"]})
    s["results"][1]["avg_bits"] = None
    v = verdict(s)
    assert "Least damaging quantized scheme: **custom**, bits not recorded, worst bucket +5.00%" in v


def test_speed_report_says_larger_for_a_cache_holding_more():
    """A cache holding twice DynamicCache's bytes (a StaticCache, a reservation) read "(0.50x smaller)"."""
    from kvbits.report.speed import _bytes_cell

    base = {"cache_bytes": 48107520}
    assert _bytes_cell({"cache_bytes": 96215040}, base) == "91.76 MiB (2.00x larger)"
    assert _bytes_cell({"cache_bytes": 24053760}, base) == "22.94 MiB (2.00x smaller)"
    assert _bytes_cell(base, base) == "45.88 MiB"


def test_speed_report_says_about_the_same_size_within_half_a_percent():
    """A StaticCache holding DynamicCache's bytes read "45.88 MiB (1.00x smaller)" (speed-smollm2-static's report),
    and one 0.3 % larger "(1.00x larger)": a factor that rounds to 1.00 says nothing either way."""
    from kvbits.report.speed import _bytes_cell

    base = {"cache_bytes": 48107520}
    assert _bytes_cell({"cache_bytes": 48107520}, base) == "45.88 MiB (the same size)"
    assert _bytes_cell({"cache_bytes": 48251842}, base) == "46.02 MiB (about the same size)"  # 0.3 % larger
    assert _bytes_cell({"cache_bytes": 47963197}, base) == "45.74 MiB (about the same size)"  # 0.3 % smaller
    assert _bytes_cell({"cache_bytes": 48400000}, base) == "46.16 MiB (1.01x larger)"  # 0.6 %: a factor again


def test_speed_report_ratio_counts_a_workspace():
    """A --workspace run's cell read "14.75 KiB (2.37x smaller) + workspace 35.00 KiB" (t-kivi against a 35.00 KiB
    DynamicCache): the cache held 49.75 KiB, 1.42x more than the baseline, as speed.png drew it. The factor is now of
    all the cache holds, its workspace included; linear states (the same in every cache) stay out of it."""
    from kvbits.report.speed import _bytes_cell

    base = {"cache_bytes": 35840, "workspace_bytes": 0}
    r = {"cache_bytes": 15104, "planned_bytes": 15104, "workspace_bytes": 35840}
    assert _bytes_cell(r, base) == "14.75 KiB + workspace 35.00 KiB (1.42x larger)"
    small = {**r, "workspace_bytes": 2048, "linear_state_bytes": 1 << 20}
    assert _bytes_cell(small, base) == "14.75 KiB + workspace 2.00 KiB (2.09x smaller) + linear states 1.00 MiB"
    assert _bytes_cell({**r, "workspace_bytes": 0}, base) == "14.75 KiB (2.37x smaller)"


def test_speed_report_of_an_empty_cache_has_no_ratio():
    """A cache of 0 bytes (check_speed accepts it) raised ZeroDivisionError in the report's bytes column."""
    from kvbits.report.speed import _bytes_cell

    assert _bytes_cell({"cache_bytes": 0}, {"cache_bytes": 48107520}) == "0 B"
    assert _bytes_cell({"cache_bytes": 48107520}, {"cache_bytes": 0}) == "45.88 MiB"


def test_an_agreement_short_of_all_never_prints_as_all():
    """Top-1 agreement with one token in 32,766 differing (a near-lossless scheme over a 16K-32K bucket of two
    windows, 0.99997) printed "100.00%", as the unquantized model's; a speed run whose greedy tokens matched 99.6 %
    printed "100%, from step 250". They stop one last digit short now; exact values print as before."""
    from kvbits.report.speed import _agree_cell
    from kvbits.report.tables import metric_table

    summary = _summary()
    bucket = summary["results"][1]["buckets"][3]
    bucket["top1"] = 1 - 1 / 32766
    summary["results"][1]["buckets"][0]["top1"] = 1 / 32766
    row = next(r for r in metric_table(summary, "top1").rows if r[0].text == "int8-token")
    assert [c.text for c in row[1:]] == ["0.01%", "99.88%", "99.84%", "99.99%"]
    assert [c.text for c in metric_table(summary, "top1").rows[0][1:]] == ["100.00%"] * 4  # fp16: exactly all
    assert _agree_cell({"agreement": 0.996, "first_divergence": 250}) == "99%, from step 250"
    assert _agree_cell({"agreement": 1.0, "first_divergence": None}) == "100%"
    assert _agree_cell({"agreement": 0.5, "first_divergence": 2}) == "50%, from step 2"


def test_a_delta_next_to_the_budget_shows_the_digits_that_judge_it(tmp_path, monkeypatch):
    """A bucket at +1.004 % fails a 1 % budget, one at +0.99996 % passes; both printed "+1.00%" (the verdict's
    "First bucket above 1%: ... (+1.00%" and "worst bucket +1.00%", the tables' cells, the heatmap), so the report
    named a failure at the budget itself. Digits are added until the figure is on its side of the budget."""
    from kvbits.report.plots import heatmap

    s = _summary({"fp16": SCHEMES["fp16"], "x": (4.0, [0.002, 0.01004, 0.02, 0.03]),
                  "y": (5.0, [0.001, 0.002, 0.0099996, 0.003])})
    v = verdict(s)
    assert "First bucket above 1%: **x** at 1K–2K (+1.004%, 95% CI" in v
    assert "Best bits/quality trade-off: **y**, 5.00 bits per element (3.2× smaller than fp16), worst bucket +0.99996%" in v
    rows = {r[0].text: r for r in delta_table(s).rows}
    assert (rows["x"][3].text.split()[0], rows["x"][3].tone) == ("+1.004%", "bad")
    assert (rows["y"][4].text.split()[0], rows["y"][4].tone) == ("+0.99996%", "good")
    assert rows["x"][4].text.split()[0] == "+2.00%" and rows["y"][2].text.split()[0] == "+0.10%"  # as before
    s2 = _summary({"z": (4.0, [0.0101, 0.0099, 0.01, 0.01])})  # overall +1.00 % exactly: within, as printed
    assert [c.text.split()[0] for c in delta_table(s2, threshold=0.01).rows[0][2:]] == [
        "+1.01%", "+0.99%", "+1.00%", "+1.00%"]
    assert [c.text.split()[0] for c in delta_table(s, threshold=0.02).rows[1][2:]] == [
        "+0.20%", "+1.00%", "+2.00%", "+3.00%"]  # at a 2 % budget, +1.004 % is far from it: two decimals
    texts: list[str] = []
    monkeypatch.setattr(heatmap, "save_png", lambda fig, path: texts.extend(
        t.get_text() for ax in fig.axes for t in ax.texts) or path)
    heatmap.plot_delta_heatmap(RunSummary.coerce(s), tmp_path / "h.png")
    assert any(t.startswith("+1.004%\n") for t in texts) and any(t.startswith("+0.99996%\n") for t in texts)


def test_the_position_figure_names_the_running_mean_it_drew(tmp_path, monkeypatch):
    """A 512-token run (511 scored positions) is smoothed over 511 // 4 = 127 tokens, not the 256 asked for, but the
    title said "256-token running mean". It names the length drawn; 8K windows keep 256."""
    from kvbits.report.plots import position

    figs: list = []
    monkeypatch.setattr(position, "save_png", lambda fig, path: figs.append(fig) or path)
    rng = np.random.default_rng(0)
    for context, spans, k in ((512, [(0, 256), (256, 511)], 127), (CONTEXT, SPANS, 256)):
        run = RunSummary.coerce(_summary({n: SCHEMES[n] for n in ("fp16", "kivi-2")}, context=context, spans=spans))
        ref = rng.normal(2.5, 1.0, (2, context - 1))
        tokens = {r.name: {"nll": ref + 0.01 * i, "nll_ref": ref} for i, r in enumerate(run.results)}
        position.plot_ppl_position(run, tokens, tmp_path / "p.png", smooth=256)
        ax = figs[-1].axes[0]
        assert ax.get_title() == f"Perplexity ({k}-token running mean, averaged over windows)"
        assert len(ax.get_lines()[0].get_xdata()) == context - 1 - k + 1  # the mean drawn is k tokens long


def test_needle_and_speed_reports_show_names_as_text(tmp_path):
    """The eval report shows names from its JSON as text (``<``/``>`` as entities, ``|`` escaped in tables); the
    needle and speed reports put the model, haystack, device, needle text and scheme names in their heading, lists
    and "Runs merged" table raw: a scheme ``int4|<b>`` added a column to that table and rendered ``<b>`` as markup."""
    from kvbits.report.document import split_code_spans
    from kvbits.report.needle import load_needle, needle_markdown
    from kvbits.report.speed import load_speed, speed_markdown

    def markup(md: str) -> bool:  # a tag outside code spans (which show their text as it is)
        return any(tag in "".join(split_code_spans(md)[::2]) for tag in ("<b>", "<i>"))

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    s = load_needle(results / "needle-qwen-prefill" / "needle.json")
    old, new = s["results"][1]["scheme"], "int4|<b>"  # int4-token: it loses trials, so "Trials lost" names it
    s["results"][1]["scheme"] = new
    for rec in s["records"]:
        rec["schemes"][new] = rec["schemes"].pop(old)
    s.update(model="qwen<b>", data="/texts/<b>.txt")
    s["task"]["needle"] = "<i>The pass key is {key}.</i>"
    s["merged_from"] = [{"path": f"/runs/a|{i}", "contexts": [c], "depths": [0.0], "trials": 1, "schemes": [new]}
                        for i, c in enumerate((4096, 8192))]
    md = needle_markdown(s, figure=False)
    assert not markup(md)
    assert md.startswith("# Passkey retrieval: qwen&lt;b&gt; on /texts/&lt;b&gt;.txt\n")
    assert "- **int4\\|&lt;b&gt;** (7): " in md
    merged = md[md.index("## Runs merged"):].splitlines()
    rows = [line for line in merged if line.startswith("| `")]
    assert len(rows) == 2 and all(re.sub(r"\\\|", "", r).count("|") == merged[2].count("|") for r in rows)
    assert rows[0].startswith("| `/runs/a\\|0` | 4K | 0 | 1 | int4\\|&lt;b&gt; |")

    sp = load_speed(results / "speed-smollm2" / "speed.json")
    sp["model"], sp["device"]["name"] = "smol<b>", "cpu <b>"
    md = speed_markdown(sp, figure=False)
    assert not markup(md) and md.startswith("# Decode speed: smol&lt;b&gt; on cpu &lt;b&gt;\n")


def test_backticks_and_stars_in_names_stay_text(tmp_path):
    """A model ``org/mod`el`` went into a code span as ```org/mod`el``` : the span closed at the name's backtick, and
    the next one (the fingerprint's) opened a span over the text between. In the verdict two scheme names with a
    backtick (``x`<b>y``, ``p`q*``) paired up into one code span, its ``**`` shown as asterisks, the bold elsewhere.
    Checked as CommonMark (markdown-it) reads report.md, and as report.html and the terminal show them."""
    from markdown_it import MarkdownIt
    from rich.console import Console

    from kvbits.report.speed import load_speed, speed_markdown

    s = _summary({"fp16": SCHEMES["fp16"], "x`<b>y": SCHEMES["kivi-4"], "p`q*": SCHEMES["kivi-2"]})
    s.update(model="org/mod`el", data="/data/`a.txt")
    paths = write_report(_write_run(tmp_path / "run", s, _config(), tokens=False), plots=False)
    as_read = MarkdownIt("commonmark").enable("table").render(paths["markdown"].read_text())
    for page in (as_read, paths["html"].read_text()):
        assert "<strong>Model:</strong> <code>org/mod`el</code> (fingerprint <code>0123456789abcdef</code>)" in page
        assert "<code>/data/`a.txt</code>" in page and "report: org/mod`el on /data/`a.txt, 8K context</h1>" in page
        assert "<strong>x`&lt;b&gt;y</strong> stays within 1%" in page
        assert "<strong>p`q*</strong> already in the first bucket" in page
    assert ">x`&lt;b&gt;y</td>" in as_read and ">p`q*</td>" in as_read
    con = Console(record=True, width=400, color_system=None)
    print_summary(s, con)
    shown = con.export_text()
    assert "x`<b>y stays within 1%" in shown and "p`q* already in the first bucket" in shown

    sp = load_speed(Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "speed-smollm2" / "speed.json")
    sp["model"] = "smol`lm"
    assert "<strong>Model:</strong> <code>smol`lm</code>" in MarkdownIt("commonmark").render(speed_markdown(sp, figure=False))


def test_scheme_names_are_shown_as_they_are_in_the_figures(tmp_path, monkeypatch):
    """A scheme JSON may name its scheme anything: ``_int4`` was left out of every legend (matplotlib drops labels
    starting with ``_``), ``k$4$v2`` was typeset as mathtext (shown ``k4v2``) and ``k$\\bad$`` raised in the
    mathtext parser, costing the figure (``strict``: the report)."""
    from matplotlib import cbook

    from kvbits.report.plots import kl, position

    names = ["fp16", "_int4", "k$4$v2", "k$\\bad$"]
    presets = (SCHEMES[k] for k in ("fp16", "kivi-4", "kivi-2", "int4-token"))
    s = RunSummary.from_dict(_summary(dict(zip(names, presets))))
    figs = []
    with monkeypatch.context() as m:
        for mod in (kl, position):
            m.setattr(mod, "save_png", lambda fig, path: (figs.append(fig), fig.canvas.draw(), path)[-1])
        kl.plot_kl(s, tmp_path / "kl.png")
        position.plot_ppl_position(s, None, tmp_path / "pos.png")
    for fig in figs:
        legends = fig.legends or [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        shown = [t.get_text() for lg in legends for t in lg.get_texts()]
        assert not any(cbook.is_math_text(t) for t in shown), shown
        plain = [t.replace("\u200b", "").replace("\\$", "$").removesuffix(" (all zero)") for t in shown]
        assert set(names) <= set(plain), plain
    d = _write_run(tmp_path / "run", _summary({"k$\\bad$": SCHEMES["kivi-2"]}), tokens=False)
    assert {"kl_by_bucket", "delta_heatmap", "bits_vs_delta"} <= set(write_report(d, strict=True))


def test_every_quantized_scheme_has_its_own_colour():
    """The 12-colour palette was cycled: with 14 quantized schemes s12 was drawn in s0's colour and s13 in s1's,
    lines the legend could not tell apart. Up to 12 the palette is kept (the committed figures' colours)."""
    from kvbits.report.plots.figure import BASELINE_COLOR, PALETTE, scheme_colors

    many = {"fp16": SCHEMES["fp16"], **{f"s{i}": (2.0 + 0.3 * i, [0.01, 0.02, 0.03, 0.04]) for i in range(14)}}
    colors = scheme_colors(RunSummary.from_dict(_summary(many)))
    assert colors["fp16"] == BASELINE_COLOR
    quantized = [colors[f"s{i}"] for i in range(14)]
    assert len(set(quantized)) == 14 and BASELINE_COLOR not in quantized
    assert [scheme_colors(RunSummary.from_dict(_summary()))[k] for k in list(SCHEMES)[1:]] == list(PALETTE[:4])


def test_an_infinite_kl_is_named_on_the_log_plot_not_passed_for_missing(tmp_path, monkeypatch):
    """A KL of +inf (printed ``inf`` in the tables) was masked from the log axis like a missing value: a scheme whose
    KL was +inf in every bucket was labelled "(no data)", one +inf bucket vanished from its line without a word."""
    from kvbits.report.plots import kl

    s = _summary({k: SCHEMES[k] for k in ("fp16", "kivi-4", "kivi-2")})
    for b in s["results"][2]["buckets"]:
        b["kl"] = math.inf
    s["results"][1]["buckets"][3]["kl"] = math.inf
    figs = []
    monkeypatch.setattr(kl, "save_png", lambda fig, path: (figs.append(fig), path)[-1])
    kl.plot_kl(RunSummary.from_dict(s), tmp_path / "kl.png")
    shown = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert shown == ["fp16 (all zero)", "kivi-4 (+inf at 1 of 4, not drawn)", "kivi-2 (+inf, not drawn)"]


def test_eval_cli_says_calibration_warnings_once_on_stderr(monkeypatch, capsys):
    """kvbits eval logged the clipping / beyond-calibration warning on stderr (the runner's ``_warn_mismatch``) and
    printed it again on stdout under the summary: once now, on stderr."""
    from kvbits.cli import main
    from kvbits.evaluate import runner
    from kvbits.evaluate.measures import _warn_mismatch

    def fake_evaluate(*args, **kwargs):
        s = _calibrated_summary()
        for r in s["results"]:
            _warn_mismatch(r["scheme"], r["calibration"], s["context"])
        return s

    monkeypatch.setattr(runner, "evaluate", fake_evaluate)
    assert main(["eval", "--model", "m", "--data", "d", "--context", "8192", "--scheme", "kivi-4"]) == 0
    out, err = capsys.readouterr()
    said = "kivi-4 serves 7,680 of 8,192 positions per window beyond the 512 tokens it was calibrated on"
    assert said not in out and "Warning" not in out
    assert err.count(said) == 1 and "clips 0.250% of its keys" in err


def test_the_agreement_caption_says_its_steps_count_the_warm_up():
    """``first_divergence`` counts every decode step from 0, the ``warmup`` untimed ones first, while ``step_ms``
    holds the timed ones only; the caption said "the first step where some sequence differs", so "from step 5"
    (a 4-step warm-up) read as the 6th timed step when it is the 2nd. It says how the steps are counted now."""
    from kvbits.report.speed import load_speed, speed_markdown

    sp = load_speed(Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "speed-smollm2" / "speed.json")
    sp["warmup"], sp["tokens"] = 3, 16
    md = speed_markdown(sp, figure=False)
    assert ("over all 3 warm-up and 16 timed steps, counted from 0 at the first warm-up step (step 3 is the first "
            "timed one)") in md
