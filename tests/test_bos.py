"""Beginning-of-sequence tokens in evaluation windows (``--bos``): a tokenizer that adds a BOS to a text itself
(Llama, Mistral, Gemma) had every window cut as a raw slice with no BOS at all, not even the first one (``tokenize``
drops special tokens), so the first text token became the attention sink; now ``bos="auto"`` (the default) starts
each window with the BOS, and a tokenizer that adds none (SmolLM2, Qwen2.5) keeps raw slices."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import transformers
from _bytelevel import VOCAB, byte_tokenizer, write_sentences
from _tinyllama import tiny_llama

from kvbits.evaluate.data import TextSource, make_windows, resolve_bos, tokenize


def bos_tokenizer(adds: bool = True) -> transformers.PreTrainedTokenizerFast:
    """The byte-level tokenizer with byte id 0 as its BOS, which ``tokenizer(text)`` puts first when ``adds``."""
    from tokenizers import processors

    tok = byte_tokenizer()
    bos = tok.convert_ids_to_tokens(0)
    inner = tok.backend_tokenizer
    if adds:
        inner.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=bos)


def test_make_windows_with_a_bos_puts_it_first_and_then_context_minus_one_text_tokens():
    ids = torch.arange(100, 130)
    win = make_windows(ids, 8, bos_id=1)
    assert win.shape == (4, 8)  # 30 text tokens // 7 per window
    assert win[:, 0].tolist() == [1] * 4
    assert win[:, 1:].reshape(-1).tolist() == list(range(100, 128))  # consecutive, none skipped or repeated
    assert make_windows(ids, 8).reshape(-1).tolist() == list(range(100, 124))  # without: raw slices, as before
    with pytest.raises(ValueError, match="context must be >= 2 with a BOS"):
        make_windows(ids, 1, bos_id=1)
    with pytest.raises(ValueError, match="bos_id must be a token id"):
        make_windows(ids, 8, bos_id=-1)


def test_auto_follows_what_the_tokenizer_adds_to_a_text():
    adds, none = bos_tokenizer(True), bos_tokenizer(False)
    assert adds("Hi")["input_ids"][0] == 0 and none("Hi")["input_ids"][0] != 0
    assert resolve_bos(adds, "auto") == 0
    assert resolve_bos(none, "auto") is None  # a BOS token it never adds (SmolLM2, Qwen2.5): raw slices
    assert resolve_bos(none, "always") == 0
    assert resolve_bos(adds, "never") is None
    assert resolve_bos(None, "auto") is None
    with pytest.raises(ValueError, match="needs a tokenizer with a BOS token"):
        resolve_bos(byte_tokenizer(), "always")
    with pytest.raises(ValueError, match="bos must be one of"):
        resolve_bos(adds, "yes")


def test_tokenized_text_keeps_no_bos_and_windows_get_one_each():
    text = "The old man walked down to the harbour before dawn. " * 4
    src = TextSource("t", text, hashlib.sha256(text.encode()).hexdigest())
    tok = bos_tokenizer(True)
    ids = tokenize(src, tok, use_cache=False)
    assert ids[0] != 0  # the whole text carries no BOS: the windows add it
    win = make_windows(ids, 16, 3, resolve_bos(tok, "auto"))
    assert win[:, 0].tolist() == [0, 0, 0]
    assert win[0, 1:].tolist() == ids[:15].tolist()


def test_evaluate_starts_windows_with_the_bos_records_it_and_hashes_another_run(tmp_path):
    from kvbits.evaluate import evaluate
    from kvbits.evaluate.models import LoadedModel, ModelSource
    from kvbits.report.summary import RunSummary

    text = str(write_sentences(tmp_path / "t.txt", 40))
    lm = LoadedModel(tiny_llama(), bos_tokenizer(True), ModelSource(name="tb", path="tb"), "tinybos000000000")
    assert lm.model.config.vocab_size == VOCAB
    auto = evaluate(lm, text, 16, ["int4-token"], windows=2, out_dir=tmp_path / "auto")
    never = evaluate(lm, text, 16, ["int4-token"], windows=2, out_dir=tmp_path / "never", bos="never")
    assert auto["bos"] == "always" and never["bos"] == "never"
    assert auto["fingerprint"]["tokens"] != never["fingerprint"]["tokens"]
    assert auto["results"][0]["ppl_ref"] != never["results"][0]["ppl_ref"]
    stored = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert stored["bos"] == "always" and RunSummary.from_dict(stored).bos == "always"
    assert RunSummary.from_dict({k: v for k, v in stored.items() if k != "bos"}).bos == "never"  # an old record
    # the same folder with another bos is another run: refused (not reused) without overwrite
    with pytest.raises(Exception, match="(?i)another|different|overwrite"):
        evaluate(lm, text, 16, ["int4-token"], windows=2, out_dir=tmp_path / "never", bos="always")
    # a tokenizer that adds no BOS: auto is raw slices, the hash of a run from before --bos
    plain = LoadedModel(tiny_llama(), bos_tokenizer(False), ModelSource(name="tb", path="tb"), "tinyplain0000000")
    assert evaluate(plain, text, 16, ["int4-token"], windows=1)["bos"] == "never"


def test_an_out_folder_from_before_bos_is_recomputed_when_the_tokenizer_adds_one(tmp_path):
    """A run stored before --bos (no "bos" in summary.json: raw slices) has the hash an "auto" run has; it was reused
    though the tokenizer adds a BOS (stale numbers, no BOS); now it is recomputed there, and still reused where auto
    resolves to raw slices."""
    from kvbits.evaluate import evaluate
    from kvbits.evaluate.models import LoadedModel, ModelSource

    text = str(write_sentences(tmp_path / "t.txt", 40))
    model = tiny_llama()
    for adds in (True, False):
        out = tmp_path / f"adds{adds}"
        # the old run: raw slices under the same model fingerprint (so the same request hash), then its summary
        # written as before --bos, without the "bos" field
        old = LoadedModel(model, bos_tokenizer(False), ModelSource(name="tb", path="tb"), "tinybos000000000")
        first = evaluate(old, text, 16, ["int4-token"], windows=2, out_dir=out)
        path = out / "summary.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "bos"}))
        lm = LoadedModel(model, bos_tokenizer(adds), ModelSource(name="tb", path="tb"), "tinybos000000000")
        skipped: list[dict] = []
        again = evaluate(lm, text, 16, ["int4-token"], windows=2, out_dir=out, on_skip=skipped.append)
        assert bool(skipped) is (not adds)
        assert again.get("bos", "never") == ("always" if adds else "never")
        if adds:
            assert again["results"][0]["ppl_ref"] != first["results"][0]["ppl_ref"]
            assert json.loads(path.read_text())["bos"] == "always"  # the folder now holds the run with the BOS


def _bos_model(adds: bool = True):
    from kvbits.evaluate.models import LoadedModel, ModelSource

    return LoadedModel(tiny_llama(), bos_tokenizer(adds), ModelSource(name="tb", path="tb"), "tinybos000000000")


def test_monitor_decodes_the_bos_first_and_runs_at_all(tmp_path, monkeypatch):
    """``watch`` unpacked three values of ``_load_windows``'s four (``ValueError: too many values to unpack`` on every
    call, token ids included); now it runs, and with ``bos`` (default auto) the decoded tokens start with the BOS."""
    from kvbits.evaluate import stream
    from kvbits.monitor import watch

    seen: list[torch.Tensor] = []
    real = stream.stream_hidden
    monkeypatch.setattr(stream, "stream_hidden", lambda lm, ids, *a, **k: (seen.append(ids), real(lm, ids, *a, **k)))
    text = str(write_sentences(tmp_path / "t.txt", 40))
    watch(_bos_model(), text, 24, "int4-token")
    watch(_bos_model(), text, 24, "int4-token", bos="never")
    assert seen[0][0, 0].item() == 0 and seen[1][0, 0].item() != 0
    assert seen[0][0, 1:].tolist() == seen[1][0, :23].tolist()
    with pytest.raises(ValueError, match="bos must be one of"):
        watch(_bos_model(), text, 24, "int4-token", bos="yes")


def test_speed_prompts_start_with_the_bos_and_speed_json_records_it(tmp_path):
    from kvbits.evaluate.speed import speed_eval

    text = str(write_sentences(tmp_path / "t.txt", 40))
    auto = speed_eval(_bos_model(), 32, ["int4-token"], tokens=2, warmup=1, data=text)
    never = speed_eval(_bos_model(), 32, ["int4-token"], tokens=2, warmup=1, data=text, bos="never")
    plain = speed_eval(_bos_model(False), 32, ["int4-token"], tokens=2, warmup=1, data=text)
    assert (auto["bos"], never["bos"], plain["bos"]) == ("always", "never", "never")
    assert auto["fingerprint"]["prompts"]["32x1"].endswith("+bos0")
    assert not never["fingerprint"]["prompts"]["32x1"].endswith("+bos0")


def test_calibrate_windows_start_with_the_bos_and_the_artifact_records_it(tmp_path, monkeypatch):
    import importlib

    from kvbits.calibrate import calibrate, collect_samples

    cal_mod = importlib.import_module("kvbits.calibrate.calibrate")

    text = str(write_sentences(tmp_path / "t.txt", 60))
    seen: list[torch.Tensor] = []
    real = cal_mod._windows

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out[0])
        return out

    monkeypatch.setattr(cal_mod, "_windows", spy)
    auto = calibrate(_bos_model(), text, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64)
    never = calibrate(_bos_model(), text, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64, bos="never")
    assert auto.meta["data"]["bos"] == "always" and never.meta["data"]["bos"] == "never"
    assert seen[0].shape == seen[1].shape == (2, 32)
    assert seen[0][:, 0].tolist() == [0, 0] and seen[0][0, 1:].tolist() == seen[1][0, :31].tolist()
    plain = collect_samples(_bos_model(False), text, context=32, windows=2, fisher=False, max_tokens=64)
    assert plain.data["bos"] == "never"  # a tokenizer that adds none: raw slices
    with pytest.raises(ValueError, match="bos must be one of"):
        calibrate(_bos_model(), text, "kvquant-4", context=32, windows=2, fisher=False, bos="yes")


def test_eval_warns_when_its_calibration_was_cut_with_another_bos(tmp_path, caplog):
    from kvbits.calibrate import calibrate
    from kvbits.evaluate import evaluate

    text = str(write_sentences(tmp_path / "t.txt", 60))
    other = str(write_sentences(tmp_path / "o.txt", 60, seed=1))
    never = calibrate(_bos_model(), other, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64,
                      bos="never")  # fmt: skip
    with caplog.at_level("WARNING"):
        evaluate(_bos_model(), text, 16, ["kvquant-4"], windows=1, calibration={"kvquant-4": never})
    # in words, not "windows with bos never, ... have bos always" (the flag's values read as a sentence)
    assert (
        "was fitted on windows without a BOS token (raw slices of the text), but this evaluation's windows start "
        "with the BOS token: the BOS is the attention sink" in caplog.text
    )
    assert "(calibrate again with bos='always', or evaluate with bos='never')" in caplog.text
    assert caplog.text.count("this evaluation's windows") == 1  # once, not per window
    caplog.clear()
    with caplog.at_level("WARNING"):
        evaluate(_bos_model(), text, 16, ["kvquant-4"], windows=1, calibration={"kvquant-4": never}, bos="never")
    assert "this evaluation's windows" not in caplog.text


def test_needle_trials_start_with_the_bos_record_it_and_do_not_merge_with_raw_ones(tmp_path):
    """``needle_eval`` tokenized its haystack without special tokens and cut the trials itself: no BOS whatever the
    tokenizer adds. Now ``bos="auto"`` puts it first (then a haystack one token shorter), needle.json records
    ``"bos"`` and its tokens fingerprint ``+bos<id>``, and a merge refuses to mix runs with and without a BOS."""
    import importlib

    from kvbits.evaluate.needle import build_trials
    from kvbits.evaluate.needle_run import needle_eval
    from kvbits.report.merge_needle import merge_needle

    tok = bos_tokenizer(True)
    ids = torch.tensor(tok("The old man walked down to the harbour. " * 20, add_special_tokens=False)["input_ids"])
    (raw,) = build_trials(tok, ids, 200, [0.5], seed=0)
    (with_bos,) = build_trials(tok, ids, 200, [0.5], seed=0, bos_id=0)
    assert with_bos.ids.shape == (200,) and with_bos.ids[0].item() == 0 and raw.ids[0].item() != 0
    assert with_bos.ids[with_bos.needle_at : with_bos.needle_at + with_bos.needle_len].tolist() == \
        raw.ids[raw.needle_at : raw.needle_at + raw.needle_len].tolist()  # fmt: skip
    assert with_bos.ids[with_bos.answer_start :].tolist() == raw.ids[raw.answer_start :].tolist()
    assert with_bos.haystack_len == raw.haystack_len - 1

    text = str(write_sentences(tmp_path / "t.txt", 80))
    run = importlib.import_module("kvbits.evaluate.needle_run")
    seen: list[torch.Tensor] = []
    real = run.build_trials
    run.build_trials = lambda *a, **k: [seen.append(t.ids) or t for t in real(*a, **k)]
    try:
        auto = needle_eval(_bos_model(), 200, ["int4-token"], data=text, depths=[0.5])
        never = needle_eval(_bos_model(), 200, ["int4-token"], data=text, depths=[0.5], bos="never")
    finally:
        run.build_trials = real
    assert (auto["bos"], never["bos"]) == ("always", "never")
    assert seen[0][0].item() == 0 and seen[1][0].item() != 0
    assert auto["fingerprint"]["tokens"] == never["fingerprint"]["tokens"] + "+bos0"
    with pytest.raises(ValueError, match="differ in their bos"):
        merge_needle([auto, never])
    with pytest.raises(ValueError, match="bos must be one of"):
        needle_eval(_bos_model(), 200, ["int4-token"], data=text, bos="yes")


def test_analyze_windows_start_with_the_bos_and_analysis_json_records_it(tmp_path, monkeypatch, capsys):
    """``kvbits analyze`` cut raw slices (``make_windows`` without a BOS) whatever the tokenizer adds, and had no
    ``--bos``; now its windows start with the BOS where the tokenizer adds one, and analysis.json records ``bos``."""
    from kvbits.analyze import collect
    from kvbits.cli import main
    from kvbits.evaluate import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: _bos_model())
    seen: list[torch.Tensor] = []
    real = collect.analyze
    monkeypatch.setattr(collect, "analyze", lambda model, windows, **k: (seen.append(windows), real(model, windows, **k))[1])
    text = str(write_sentences(tmp_path / "t.txt", 60))
    argv = ["analyze", "--model", "tb", "--data", text, "--context", "64", "--windows", "1", "--json"]
    runs = []
    for extra in ([], ["--bos", "never"]):
        assert main(argv + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert (runs[0]["bos"], runs[1]["bos"]) == ("always", "never")
    assert seen[0][0, 0].item() == 0 and seen[1][0, 0].item() != 0
    assert seen[0][0, 1:].tolist() == seen[1][0, :63].tolist()


def test_tune_passes_its_bos_to_every_pass_and_records_it(tmp_path, monkeypatch):
    """``tune`` took no ``bos``: its passes ran with evaluate's default whatever was asked, and ``kvbits tune`` had no
    ``--bos``. Now ``tune(bos=...)`` (``--bos``) reaches the sensitivity, round and check passes and ``meta["bos"]``
    records what ran."""
    from kvbits.cli import build_parser
    from kvbits.evaluate import runner
    from kvbits.tune import tune

    asked: list[str] = []
    real = runner.evaluate
    monkeypatch.setattr(runner, "evaluate", lambda *a, **k: (asked.append(k.get("bos", "auto")), real(*a, **k))[1])
    text = str(write_sentences(tmp_path / "t.txt", 40))
    cands = ["int2-token", "int8-token"]
    res = tune(_bos_model(), text, cands, 6.0, context=32, rounds=2, bos="never")
    assert res.meta["bos"] == "never" and len(asked) >= 3 and set(asked) == {"never"}
    assert tune(_bos_model(), text, cands, 6.0, context=32, check=False).meta["bos"] == "always"
    with pytest.raises(ValueError, match="bos must be one of"):
        tune(_bos_model(), text, cands, 6.0, context=32, bos="yes")
    args = build_parser().parse_args(["tune", "--model", "m", "--data", "t", "--candidates", "int2-token", "--candidates",
                                      "int8-token", "--budget-bits", "6", "--bos", "never"])  # fmt: skip
    assert args.bos == "never"


def test_every_command_checks_its_bos_before_the_model_loads(tmp_path, monkeypatch):
    """``calibrate`` refused a bad ``bos`` only once the weights had loaded (``_windows``), and ``"always"`` with a
    tokenizer that has no BOS was refused by every command only after its model load, though a ``LoadedModel``
    carries its tokenizer; now ``check_bos`` refuses both first, before any model load (here: a load that raises)."""
    import importlib

    from kvbits.calibrate import calibrate
    from kvbits.evaluate import evaluate, inputs, runner
    from kvbits.evaluate.needle_run import needle_eval
    from kvbits.evaluate.speed import speed_eval
    from kvbits.monitor import watch
    from kvbits.tune import tune

    def loads(*a, **k):
        raise AssertionError("the model loaded before the bos was checked")

    cal_mod = importlib.import_module("kvbits.calibrate.calibrate")
    for mod, name in ((inputs, "_load_checked_model"), (runner, "_load_checked_model"), (inputs, "_load_model"),
                      (cal_mod, "_resolve_model")):  # fmt: skip
        monkeypatch.setattr(mod, name, loads)
    text = str(write_sentences(tmp_path / "t.txt", 40))
    with pytest.raises(ValueError, match="bos must be one of"):
        calibrate(str(tmp_path / "no-such-model"), text, "kvquant-4", context=32, windows=2, fisher=False, bos="yes")
    lm = _bos_model()
    lm.tokenizer.bos_token = None  # a tokenizer without a BOS token
    assert lm.tokenizer.bos_token_id is None
    runs = [
        lambda: calibrate(lm, text, "kvquant-4", context=32, windows=2, fisher=False, bos="always"),
        lambda: evaluate(lm, text, 16, ["int4-token"], windows=1, bos="always"),
        lambda: speed_eval(lm, 32, ["int4-token"], tokens=2, warmup=1, data=text, bos="always"),
        lambda: needle_eval(lm, [64], ["int4-token"], data=text, bos="always"),
        lambda: watch(lm, text, 24, "int4-token", bos="always"),
        lambda: tune(lm, text, ["int2-token", "int8-token"], 6.0, context=32, bos="always"),
    ]
    for run in runs:
        with pytest.raises(ValueError, match="bos='always' needs a tokenizer with a BOS"):
            run()


def test_the_run_header_and_report_name_the_bos_token(tmp_path):
    """The eval header said "each starting with the BOS token" without naming it (SmolLM2-Instruct's BOS is the chat
    marker <|im_start|>); now summary.json records ``bos_token`` / ``bos_token_id`` beside ``"bos"`` (with a BOS
    only) and the header and the report's Context line name them; a record without them renders as before."""
    import io

    from rich.console import Console

    from kvbits.evaluate import evaluate
    from kvbits.report.document import build_document
    from kvbits.report.summary import RunSummary
    from kvbits.report.tables import print_summary

    text = str(write_sentences(tmp_path / "t.txt", 40))
    lm = _bos_model()
    tok = lm.tokenizer.bos_token
    s = evaluate(lm, text, 16, ["int4-token"], windows=1)
    assert (s["bos_token"], s["bos_token_id"]) == (tok, 0)
    assert "bos_token" not in evaluate(lm, text, 16, ["int4-token"], windows=1, bos="never")

    def header(summary) -> str:
        buf = io.StringIO()
        print_summary(summary, console=Console(file=buf, width=400, color_system=None))
        return buf.getvalue().splitlines()[0]

    def context_line(summary) -> str:
        blocks = build_document(RunSummary.coerce(summary), {}, {}, {}, "", 0.05, tmp_path, True)
        return next(line for line in map(repr, blocks) if "tokens per window" in line)

    assert f"each starting with the BOS token {tok} (id 0)" in header(s)
    assert f"the BOS token `{tok}` (id 0) and the next" in context_line(s)
    old = {k: v for k, v in s.items() if k not in ("bos_token", "bos_token_id")}
    assert "each starting with the BOS token;" in header(old)
    assert "(each the BOS token and the next" in context_line(old)


def test_the_bos_mismatch_warning_names_the_flags_on_the_command_line(caplog):
    """From ``kvbits eval`` the warning names ``--bos`` (the flags the user types), from Python ``bos=``."""
    from types import SimpleNamespace

    from kvbits._spelling import cli_spelling
    from kvbits.evaluate.calib_text import warn_bos_mismatch

    art = SimpleNamespace(path="runs/cal", meta={"data": {"bos": "always"}})
    with caplog.at_level("WARNING"), cli_spelling():
        assert warn_bos_mismatch("kvquant-4", art, "never")
    assert (
        "kvquant-4's calibration (runs/cal) was fitted on windows that each start with the BOS token, but this "
        "evaluation's windows have none" in caplog.text
    )
    assert "(calibrate again with --bos never, or evaluate with --bos always)" in caplog.text


def test_calibrate_summary_says_its_windows_start_with_the_bos(tmp_path, capsys):
    """``kvbits calibrate --bos always`` printed ``data NAME: 1 x 512 tokens`` as for raw slices: the summary did
    not say what calibration.json records (``"bos": "always"``), which ``kvbits eval`` then compares with its own."""
    from kvbits.calibrate import calibrate
    from kvbits.calibrate.cli import _summary

    text = str(write_sentences(tmp_path / "t.txt", 60))
    for bos, said in (("always", True), ("never", False)):
        art = calibrate(_bos_model(), text, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64, bos=bos)
        _summary(art)
        out = capsys.readouterr().out
        assert ("2 x 32 tokens (each the BOS token and context - 1 text tokens)" in out) is said, out


def test_speed_names_the_bos_token_in_speed_json_its_report_and_a_merge(tmp_path):
    """speed.json said only ``"bos": "always"`` and its report never said the prompts start with a BOS at all (nor
    which: SmolLM2-Instruct's is the chat marker <|im_start|>), and a merge dropped ``"bos"`` and mixed runs with
    and without one. Now speed.json records ``bos_token`` / ``bos_token_id`` with a BOS only, the report's Prompts
    line names them (a run without a BOS renders as before), a merge keeps them and refuses another ``bos``."""
    from kvbits.evaluate.speed import speed_eval
    from kvbits.report.merge_speed import merge_speed
    from kvbits.report.speed import speed_markdown

    text = str(write_sentences(tmp_path / "t.txt", 40))
    lm = _bos_model()
    tok = lm.tokenizer.bos_token
    auto = speed_eval(lm, 16, ["int4-token"], tokens=2, warmup=1, data=text)
    longer = speed_eval(lm, 24, ["int4-token"], tokens=2, warmup=1, data=text)
    never = speed_eval(lm, 24, ["int4-token"], tokens=2, warmup=1, data=text, bos="never")
    assert (auto["bos_token"], auto["bos_token_id"]) == (tok, 0)
    assert "bos_token" not in never and "bos_token_id" not in never
    said = f"each prompt starts with the BOS token `{tok}` (id 0)"
    assert said in speed_markdown(auto, figure=False)
    assert "BOS" not in speed_markdown(never, figure=False)
    merged = merge_speed([auto, longer])
    assert (merged["bos"], merged["bos_token"], merged["bos_token_id"]) == ("always", tok, 0)
    assert said in speed_markdown(merged, figure=False)
    with pytest.raises(ValueError, match="differ in their bos"):
        merge_speed([auto, never])


def test_needle_names_the_bos_token_in_needle_json_its_report_its_table_and_a_merge(tmp_path, capsys):
    """needle.json said only ``"bos": "always"`` and neither its report nor its printed table said the trials
    start with a BOS (nor which). Now needle.json records ``bos_token`` / ``bos_token_id`` with a BOS only, the
    report's Haystack line and the printed summary name them (a run without a BOS renders as before), and a merge
    keeps them."""
    from kvbits.evaluate.needle_cli import _print
    from kvbits.evaluate.needle_run import needle_eval
    from kvbits.report.merge_needle import merge_needle
    from kvbits.report.needle import needle_markdown

    text = str(write_sentences(tmp_path / "t.txt", 80))
    lm = _bos_model()
    tok = lm.tokenizer.bos_token
    auto = needle_eval(lm, 200, ["int4-token"], data=text, depths=[0.5])
    longer = needle_eval(lm, 240, ["int4-token"], data=text, depths=[0.5])
    never = needle_eval(lm, 200, ["int4-token"], data=text, depths=[0.5], bos="never")
    assert (auto["bos_token"], auto["bos_token_id"]) == (tok, 0)
    assert "bos_token" not in never and "bos_token_id" not in never
    said = f"each trial starts with the BOS token `{tok}` (id 0)"
    assert said in needle_markdown(auto, figure=False)
    assert "BOS" not in needle_markdown(never, figure=False)
    merged = merge_needle([auto, longer])
    assert (merged["bos"], merged["bos_token"], merged["bos_token_id"]) == ("always", tok, 0)
    assert said in needle_markdown(merged, figure=False)
    _print(auto, None)
    _print(never, None)
    out = capsys.readouterr().out
    assert out.count(f"each starting with the BOS token {tok} (id 0)") == 1


def test_monitor_records_its_bos_in_the_snapshot_and_as_an_info_gauge(tmp_path, capsys):
    """``kvbits monitor --bos`` changed what the cache saw (the BOS at position 0: the attention sink whose K/V the
    first block quantizes) but neither its snapshot (--json) nor its Prometheus text said which. Now the snapshot
    has ``"run": {"bos", "bos_token", "bos_token_id"}`` (the token with a BOS only), the exposition the info gauge
    ``kvbits_run_info{scheme, bos} 1``, every other family's name and labels as before, and the printed summary
    names the token."""
    from test_monitor import parse

    from kvbits.monitor.cli import _print
    from kvbits.monitor.watch import watch

    text = str(write_sentences(tmp_path / "t.txt", 40))
    lm = _bos_model()
    tok = lm.tokenizer.bos_token
    auto = watch(lm, text, 24, "int4-token", labels={"pod": "a"})
    never = watch(lm, text, 24, "int4-token", labels={"pod": "a"}, bos="never")
    assert auto.snapshot()["run"] == {"bos": "always", "bos_token": tok, "bos_token_id": 0}
    assert never.snapshot()["run"] == {"bos": "never"}
    m, n = parse(auto.prometheus()), parse(never.prometheus())
    assert m["kvbits_run_info"] == [({"scheme": "int4-token", "pod": "a", "bos": "always"}, 1.0)]
    assert n["kvbits_run_info"] == [({"scheme": "int4-token", "pod": "a", "bos": "never"}, 1.0)]
    for name, samples in m.items():  # no other series carries bos
        assert name == "kvbits_run_info" or all("bos" not in lab for lab, _ in samples)
    _print(auto.snapshot())
    _print(never.snapshot())
    out = capsys.readouterr().out
    assert out.count(f"the tokens started with the BOS token {tok} (id 0)") == 1
    with pytest.raises(ValueError, match="--label"):
        from kvbits.monitor.cli import _labels

        _labels(["bos=x"])


def test_the_printed_speed_summary_names_the_bos_token_plain_as_eval_does(capsys):
    """The printed speed / needle / monitor summaries showed the BOS token as a Markdown code span (```<s>``` on a
    terminal) while eval's header shows it plain; now the console gets the plain form, the reports keep theirs."""
    from kvbits.evaluate.speed_cli import _print
    from kvbits.report.fmt import bos_phrase

    run = {"bos": "always", "bos_token": "<s>", "bos_token_id": 1}
    assert bos_phrase(run) == "the BOS token `<s>` (id 1)"
    assert bos_phrase(run, markdown=False) == "the BOS token <s> (id 1)"
    _print({**run, "batches": [], "runs": [], "tokens": 2, "wall_seconds": 1.0}, None)
    out = capsys.readouterr().out
    assert "each prompt starting with the BOS token <s> (id 1)" in out, out


def test_a_reused_run_warns_as_the_live_run_did_about_its_bos(tmp_path, caplog):
    """``--out`` reusing a run whose windows started with the BOS said "30 of the 32 evaluated tokens (94%)" where
    the run itself said "30 of the 30 (100%)" (the BOS is no text token), and said nothing of a calibration cut
    without a BOS; now the reused run's warnings are the live run's."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate import evaluate

    text = str(write_sentences(tmp_path / "t.txt", 60))
    never = calibrate(_bos_model(), text, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64,
                      bos="never")  # fmt: skip
    said = []
    for _ in range(2):  # the run, then the run reused
        caplog.clear()
        skipped: list[dict] = []
        with caplog.at_level("WARNING"):
            evaluate(_bos_model(), text, 16, ["kvquant-4"], windows=2, calibration={"kvquant-4": never},
                     out_dir=tmp_path / "run", on_skip=skipped.append)  # fmt: skip
        said.append(caplog.text)
    assert skipped  # the second was reused
    for text_said in said:
        assert "30 of the 30 evaluated tokens (100%)" in text_said
        assert "was fitted on windows without a BOS token (raw slices of the text), but this evaluation's windows " \
            "start with the BOS token" in text_said  # fmt: skip


def test_needle_warns_when_its_calibration_was_cut_with_another_bos(tmp_path, caplog):
    """``kvbits needle --bos`` and ``kvbits calibrate --bos`` came from two branches: eval warned of a calibration cut
    without a BOS served to windows with one, needle (trials that start with the BOS by default) said nothing."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate.needle_run import needle_eval

    text = str(write_sentences(tmp_path / "t.txt", 80))
    other = str(write_sentences(tmp_path / "o.txt", 60, seed=1))
    never = calibrate(_bos_model(), other, "kvquant-4", context=32, windows=2, fisher=False, max_tokens=64,
                      bos="never")  # fmt: skip
    with caplog.at_level("WARNING"):
        needle_eval(_bos_model(), 200, ["kvquant-4"], data=text, depths=[0.5], calibration={"kvquant-4": never})
    assert "was fitted on windows without a BOS token (raw slices of the text), but this run's trials start with " \
        "the BOS token" in caplog.text  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING"):
        needle_eval(_bos_model(), 200, ["kvquant-4"], data=text, depths=[0.5], calibration={"kvquant-4": never},
                    bos="never")  # fmt: skip
    assert "was fitted on windows" not in caplog.text
