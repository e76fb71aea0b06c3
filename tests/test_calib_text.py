"""A calibration evaluated on its own calibration data: ``kvbits eval`` / ``evaluate`` said nothing, so a calibrated
scheme scored on the very windows its scales and codebooks were fitted to looked better than it is. Now a warning
says so (once per calibration, with the tokens shared), each result records ``calibrated_on_eval_text`` and
``calibration_overlap_tokens``, and artifacts without the records still load. Tiny random-weight Llama."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _wordlevel import save_word_tokenizer, write_word_text
from test_evaluate import _ids, _llama

from kvbits.calibrate import calibrate, load_calibration
from kvbits.evaluate import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")

WARN = "was fitted on the evaluated text"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARN in r.getMessage()]


def _record(summary: dict) -> dict:
    return summary["results"][0]["calibration"]


@pytest.fixture(scope="module")
def model():
    return _llama()


@pytest.fixture(scope="module")
def calibrated(model):
    """kvquant-2 calibrated on 256 token ids: 2 windows of 32 tokens, at 0 and at 224."""
    ids = _ids(256)[0]
    art = calibrate(model, ids, "kvquant-2", context=32, windows=2, fisher=False)
    return ids, art


def test_evaluating_on_the_calibration_ids_warns_once_and_is_recorded(model, calibrated, caplog):
    ids, art = calibrated
    assert art.meta["data"]["starts"] == [0, 224]
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    rec = _record(s)
    assert rec["calibrated_on_eval_text"] is True
    assert rec["calibration_overlap_tokens"] == 32  # the first evaluated window is the first calibration window
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "kvquant-2's calibration" in warned[0] and "32 of the 64 evaluated tokens (50%)" in warned[0]
    assert "calibrate on another text" in warned[0] and "PPL 38.71" in warned[0]  # the measured effect, stated


def test_other_ids_neither_warn_nor_count(model, calibrated, caplog):
    _, art = calibrated
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, _ids(256, seed=1)[0], 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    assert _warnings(caplog) == []
    assert _record(s)["calibrated_on_eval_text"] is False and _record(s)["calibration_overlap_tokens"] == 0


def test_a_slice_of_the_calibration_ids_is_other_content(model, calibrated, caplog):
    """Ids 32 .. 223 (between the two calibration windows) hash apart from the 256 calibrated on: not the same data,
    no warning (the check is by content, as the text file's bytes)."""
    ids, art = calibrated
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids[32:224].clone(), 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is False  # other content: another hash
    assert _warnings(caplog) == []


def test_2d_ids_record_the_rows_calibrated_on(model, caplog):
    rows = _ids(4 * 32).reshape(4, 32)
    art = calibrate(model, rows, "kvquant-2", context=32, windows=2, fisher=False)
    assert art.meta["data"]["rows"] == [0, 3]
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, rows, 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 32
    assert len(_warnings(caplog)) == 1


def test_an_artifact_without_the_records_loads_and_is_not_judged(model, calibrated, tmp_path, caplog):
    """Artifacts written before (or fitted from samples) may record no data hash or windows: they load, the result
    says null, and nothing is claimed."""
    ids, art = calibrated
    art.save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "calibration.json"
    import json

    meta = json.loads(meta_path.read_text())
    for key in ("sha256", "starts", "rows"):
        meta["data"].pop(key, None)
    del meta["meta_sha256"]  # written before that was recorded too
    meta_path.write_text(json.dumps(meta))
    old = load_calibration(tmp_path / "cal")
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=old, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is None and _record(s)["calibration_overlap_tokens"] is None
    assert _warnings(caplog) == []
    # the hash kept, the starts gone: the same text is said, the overlap not counted
    meta["data"]["sha256"] = art.meta["data"]["sha256"]
    meta_path.write_text(json.dumps(meta))
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=load_calibration(tmp_path / "cal"),
                     attn_layers=[])  # fmt: skip
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] is None
    assert len(_warnings(caplog)) == 1 and "does not record which of its tokens" in _warnings(caplog)[0]


def test_text_by_path_compares_the_file_and_its_token_ranges(tmp_path, monkeypatch, caplog):
    """A model folder with a tokenizer and a text file, as `kvbits eval --data FILE`: the same file warns and counts
    its shared tokens; another file does not."""
    from test_calibrate import tiny_llama

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    tiny_llama().save_pretrained(folder)
    book, other = write_word_text(tmp_path / "book.txt", 600), write_word_text(tmp_path / "other.txt", 600, seed=1)
    art = calibrate(str(folder), str(book), "kvquant-2", context=64, windows=3, fisher=False)
    starts = art.meta["data"]["starts"]
    assert starts[0] == 0 and len(starts) == 3
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(str(folder), str(book), 64, ["kvquant-2"], windows=1, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 64
    assert len(_warnings(caplog)) == 1 and "64 of the 64 evaluated tokens (100%)" in _warnings(caplog)[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(str(folder), str(other), 64, ["kvquant-2"], windows=1, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is False and _warnings(caplog) == []


def _overlap(record: dict, tokens_2d: bool, windows: int, context: int, spans=None) -> int | None:
    """``eval_text_record``'s overlap for an artifact calibrated on the evaluated text with ``record``'s windows."""
    from kvbits.evaluate.calib_text import eval_text_record

    art = SimpleNamespace(meta={"data": {**record, "sha256": "same", "tokenizer": "tok"}})
    rec = eval_text_record(art, "same", "tok", tokens_2d=tokens_2d, windows=windows, context=context, spans=spans)
    assert rec["calibrated_on_eval_text"] is True
    return rec["calibration_overlap_tokens"]


def test_overlap_counts_each_calibration_window_once():
    record = {"context": 100, "starts": [0, 150, 400]}
    assert _overlap(record, False, windows=2, context=100) == 100 + 50  # [0, 200) meets [0, 100) and [150, 250)
    assert _overlap(record, False, windows=1, context=50) == 50
    assert _overlap({"context": 100, "starts": None}, False, windows=1, context=50) is None
    assert _overlap({"context": 32, "rows": [0, 3]}, True, windows=2, context=16) == 16
    # spans (kvbits needle's haystacks): each counted on its own, [50, 150) and [0, 10) against [0, 100), [150, 250)
    assert _overlap({"context": 100, "starts": [0, 150]}, False, 0, 0, spans=[(50, 100), (0, 10)]) == 50 + 10


def test_the_report_marks_a_calibration_on_the_evaluated_text():
    from kvbits.report.calibration import (
        calibration_issues,
        calibration_row,
        calibration_table,
        calibration_warnings,
    )

    record = {"max_calibrated_length": 512, "positions_beyond_calibrated": 0, "calibrated_on_eval_text": True,
              "calibration_overlap_tokens": 512, "artifact": {"id": "sha256:ab", "data": "wikitext2"}}  # fmt: skip
    row = calibration_row("kvquant-2", record, 512)
    said = ("Warning: **kvquant-2** was calibrated on the evaluated text (512 of the evaluated tokens lie in its "
            "calibration windows), so its figures flatter it.")  # fmt: skip
    assert calibration_warnings([row]) == [said]
    assert calibration_issues(row) == []  # kvbits eval said it before the run: not again after it
    cell = calibration_table([row]).rows[0][2]
    assert cell.text == "wikitext2 (the evaluated text)" and cell.tone == "bad"
    for flag in (False, None):  # another text, or a run from before the record: nothing said
        other = calibration_row("kvquant-2", {**record, "calibrated_on_eval_text": flag}, 512)
        assert calibration_warnings([other]) == [] and calibration_table([other]).rows[0][2].text == "wikitext2"


def test_a_reused_run_warns_as_the_run_did_and_an_older_summary_gets_the_record(model, calibrated, tmp_path, caplog):
    """``--out`` holding the finished run: it was reused without a word, and a summary written before the record
    lacked it. Now the reuse warns from the stored record, and recomputes it from the hashes where it is absent."""
    import json

    ids, art = calibrated
    out = tmp_path / "run"
    evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[], out_dir=out)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[], out_dir=out)
    assert len(_warnings(caplog)) == 1 and "32 of the 64 evaluated tokens (50%)" in _warnings(caplog)[0]
    assert _record(s)["calibrated_on_eval_text"] is True
    summary = json.loads((out / "summary.json").read_text())
    for key in ("calibrated_on_eval_text", "calibration_overlap_tokens"):  # as a run from before the record
        summary["results"][0]["calibration"].pop(key)
    (out / "summary.json").write_text(json.dumps(summary))
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[], out_dir=out)
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 32
    assert len(_warnings(caplog)) == 1


def _word_model(tmp_path, monkeypatch):
    from test_calibrate import tiny_llama

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    tiny_llama().save_pretrained(folder)
    return folder, write_word_text(tmp_path / "book.txt", 600)


def test_a_text_file_and_its_token_ids_are_the_same_text(tmp_path, monkeypatch, caplog):
    """Calibrated on a file and evaluated on its token ids (or the reverse): the hashes (file bytes, int64 ids)
    differed, so nothing was said. The artifact now records its text's token-id hash, and an evaluation of a file
    hashes its ids against an artifact fitted on ids: the same text, with the shared tokens counted."""
    from kvbits.evaluate.data import load_text, tokenize
    from kvbits.evaluate.models import load_model

    folder, book = _word_model(tmp_path, monkeypatch)
    ids = tokenize(load_text(str(book)), load_model(str(folder)).tokenizer)
    on_file = calibrate(str(folder), str(book), "kvquant-2", context=64, windows=3, fisher=False)
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(str(folder), ids, 64, ["kvquant-2"], windows=1, calibration=on_file, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 64
    assert len(_warnings(caplog)) == 1
    on_ids = calibrate(str(folder), ids, "kvquant-2", context=64, windows=3, fisher=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(str(folder), str(book), 64, ["kvquant-2"], windows=1, calibration=on_ids, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 64
    assert len(_warnings(caplog)) == 1
    caplog.clear()  # (W, T) windows of those ids are other bytes: not caught (documented in calib_text)
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(str(folder), ids[:128].reshape(2, 64), 64, ["kvquant-2"], windows=1, calibration=on_file,
                     attn_layers=[])  # fmt: skip
    assert _record(s)["calibrated_on_eval_text"] is False


def test_needle_warns_when_the_haystack_text_was_calibrated_on(tmp_path, monkeypatch, caplog):
    """``kvbits needle --calibration`` scored NLL and KL on a haystack cut from the calibration text without a word.
    Now it warns before the run and records it per scheme, counting the haystack tokens in calibration windows."""
    from _bytelevel import byte_tokenizer, write_sentences
    from _tinyllama import tiny_llama

    from kvbits.evaluate.models import LoadedModel, ModelSource
    from kvbits.evaluate.needle_run import needle_eval

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    tok = byte_tokenizer()
    lm = LoadedModel(tiny_llama(), tok, ModelSource(name="tiny-bytes", path="tiny-bytes"), "tinybytes0000000")
    book, other = write_sentences(tmp_path / "hay.txt", 400), write_sentences(tmp_path / "other.txt", 400, seed=1)
    art = calibrate(lm, str(book), "kvquant-2", context=64, windows=40, fisher=False)
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = needle_eval(lm, 300, ["kvquant-2"], data=str(book), depths=[0.5], calibration=art)
    rec = s["results"][0]["calibration"]
    assert rec["calibrated_on_eval_text"] is True and rec["calibration_overlap_tokens"] > 0
    warned = _warnings(caplog)
    assert len(warned) == 1 and "haystack tokens of the trials" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = needle_eval(lm, 300, ["kvquant-2"], data=str(other), depths=[0.5], calibration=art)
    assert s["results"][0]["calibration"]["calibrated_on_eval_text"] is False and _warnings(caplog) == []


def test_a_tuned_mix_is_judged_by_each_source_calibration(model, calibrated, caplog):
    """``compose_artifact`` keeps in its ``meta["data"]`` only what its sources agree on: a mix whose layer 1 was
    calibrated on the evaluated ids and the rest on other ids recorded no hash, so it said null and did not warn;
    two sources on the same ids with other contexts counted the shorter one's windows only (32 of the 64 tokens the
    64-token source saw). Now each source's record is read, the tokens the union of theirs."""
    from kvbits.calibrate import compose_artifact

    ids, kv2 = calibrated  # windows [0, 32) and [224, 256) of ids
    kv4 = calibrate(model, _ids(256, seed=1)[0], "kvquant-4", context=32, windows=2, fisher=False)
    mix = "kvquant-4,1=kvquant-2"
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids, 32, [mix], windows=2, calibration=compose_artifact(mix, [kv4, kv2]), attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 32
    assert len(_warnings(caplog)) == 1
    long4 = calibrate(model, ids, "kvquant-4", context=64, windows=1, fisher=False)  # [0, 64)
    short2 = calibrate(model, ids, "kvquant-2", context=32, windows=1, fisher=False)  # [0, 32)
    s = evaluate(model, ids, 64, [mix], windows=2, calibration=compose_artifact(mix, [long4, short2]), attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 64
    # the union: [0, 64) and [32, 96) against [0, 128) share 96 tokens, not 64 + 64
    from kvbits.evaluate.calib_text import eval_text_record

    art = type("A", (), {"meta": {"composed": {"sources": [
        {"data": {"sha256": "x", "tokenizer": None, "context": 64, "starts": [0]}},
        {"data": {"sha256": "x", "tokenizer": None, "context": 64, "starts": [32]}},
        {"data": {"sha256": "y", "tokenizer": None, "context": 64, "starts": [0]}},
    ]}}})()  # fmt: skip
    rec = eval_text_record(art, "x", None, tokens_2d=False, windows=2, context=64)
    assert rec == {"calibrated_on_eval_text": True, "calibration_overlap_tokens": 96}


def test_2d_ids_reshaped_from_the_calibrated_ids_count_their_overlap(model, calibrated, caplog):
    """``(W, T)`` windows reshaped from the ``(N,)`` ids calibrated on have their bytes: marked as the calibration
    text, but the overlap was null ("does not record which of its tokens"), as the record has ``starts``, not
    ``rows``. Row ``r`` is tokens ``r * T ..`` of the same sequence: counted now, as for the ``(N,)`` ids."""
    ids, art = calibrated  # calibration windows at 0 and 224, 32 tokens
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids.reshape(8, 32), 32, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 32
    assert "32 of the 64 evaluated tokens" in _warnings(caplog)[0]
    s = evaluate(model, ids.reshape(8, 32), 32, ["kvquant-2"], windows=8, calibration=art, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 64  # rows 0 and 7 are the two calibration windows


def test_2d_calibration_ids_count_their_overlap_in_any_shape_of_the_same_bytes(model, caplog):
    """A calibration on ``(W, T)`` ids recorded its ``rows`` but not ``T``: the same bytes evaluated as ``(2, 64)``
    counted row 3 at ``3 * 64`` (32 shared tokens said where 64 are), as ``(N,)`` not at all (null). ``row_width``
    now places row ``r`` at tokens ``[r * T, r * T + context)`` of the flat sequence, whatever the evaluated shape."""
    ids = _ids(4 * 32).reshape(4, 32)
    art = calibrate(model, ids, "kvquant-2", context=32, windows=2, fisher=False)
    assert art.meta["data"]["rows"] == [0, 3] and art.meta["data"]["row_width"] == 32
    s = evaluate(model, ids.reshape(2, 64), 64, ["kvquant-2"], windows=2, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 64
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(model, ids.reshape(-1), 32, ["kvquant-2"], windows=4, calibration=art, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 64
    assert "64 of the 128 evaluated tokens" in _warnings(caplog)[0]
    s = evaluate(model, ids.reshape(8, 16), 16, ["kvquant-2"], windows=3, calibration=art, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 32  # [0, 48) meets row 0's [0, 32), not row 3's [96, 128)
    # rows wider than the calibrated context: row r's first 32 of its 64 tokens, at r * 64
    wide = _ids(4 * 64).reshape(4, 64)
    art = calibrate(model, wide, "kvquant-2", context=32, windows=2, fisher=False)
    assert art.meta["data"]["row_width"] == 64
    s = evaluate(model, wide.reshape(-1), 32, ["kvquant-2"], windows=8, calibration=art, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 64  # [0, 32) and [192, 224)


def test_1d_calibration_ids_count_their_overlap_as_rows_of_another_width(model, calibrated):
    """``(N,)`` ids calibrated on (``starts`` 0 and 224, 32 tokens) evaluated as ``(16, 16)`` rows of the same bytes:
    row ``i`` is tokens ``[16 i, 16 i + 16)``."""
    ids, art = calibrated
    s = evaluate(model, ids.reshape(16, 16), 16, ["kvquant-2"], windows=16, calibration=art, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 64
    s = evaluate(model, ids.reshape(16, 16), 16, ["kvquant-2"], windows=15, calibration=art, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 48  # [0, 240): row 15 [240, 256) left out


def test_an_artifact_without_the_row_width_loads_and_counts_as_before(model, tmp_path):
    """Artifacts written before ``data.row_width`` load; their ``rows`` count as the same shape (row ``r`` at
    ``r * context``) and not at all for ``(N,)`` ids, as before. A bad ``row_width`` is refused on load."""
    import json

    ids = _ids(4 * 32).reshape(4, 32)
    art = calibrate(model, ids, "kvquant-2", context=32, windows=2, fisher=False)
    assert art.meta["data"]["row_width"] == 32
    art.save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "calibration.json"
    meta = json.loads(meta_path.read_text())
    del meta["data"]["row_width"], meta["meta_sha256"]
    meta_path.write_text(json.dumps(meta))
    old = load_calibration(tmp_path / "cal")
    s = evaluate(model, ids, 32, ["kvquant-2"], windows=4, calibration=old, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 64
    s = evaluate(model, ids.reshape(2, 64), 64, ["kvquant-2"], windows=2, calibration=old, attn_layers=[])
    assert _record(s)["calibration_overlap_tokens"] == 32  # rows 0 and 3 at r * 64: row 3 past the 2 windows
    s = evaluate(model, ids.reshape(-1), 32, ["kvquant-2"], windows=4, calibration=old, attn_layers=[])
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] is None
    for bad in (0, "32", 2.5):
        meta["data"]["row_width"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(ValueError, match="data.row_width"):
            load_calibration(tmp_path / "cal")


def test_a_text_file_and_its_token_ids_calibrated_as_rows_are_the_same_text():
    """A text evaluated whose token ids are the ``(W, T)`` ids calibrated on (their bytes): the same text, its
    overlap counted by ``row_width``; without ``row_width`` (an older artifact) not judged the same, as before."""
    from kvbits.evaluate.calib_text import _needs_ids_hash, eval_text_record

    data = {"sha256": "ids", "tokenizer": None, "context": 32, "starts": None, "rows": [0, 3], "row_width": 32}
    art = type("A", (), {"meta": {"data": data}, "path": None})()
    assert _needs_ids_hash({"s": art}, "text")
    rec = eval_text_record(art, "text", "tok", tokens_2d=False, windows=4, context=32, ids_sha256="ids")
    assert rec == {"calibrated_on_eval_text": True, "calibration_overlap_tokens": 64}
    del data["row_width"]
    assert not _needs_ids_hash({"s": art}, "text")
    rec = eval_text_record(art, "text", "tok", tokens_2d=False, windows=4, context=32, ids_sha256="ids")
    assert rec == {"calibrated_on_eval_text": False, "calibration_overlap_tokens": 0}


def test_windows_with_a_bos_count_the_overlap_in_the_text_they_score(model, calibrated, caplog):
    """With a BOS each window is the BOS and 31 text tokens: 8 windows score ids [0, 248), not [0, 256), so the
    calibration windows [0, 32) and [224, 256) share 32 + 24 tokens with them (was 64 of 256)."""
    from kvbits.evaluate.models import LoadedModel, ModelSource

    ids, art = calibrated
    lm = LoadedModel(model, SimpleNamespace(bos_token_id=0), ModelSource(name="t", path="t"), "t000000000000000")
    with caplog.at_level("WARNING", logger="kvbits.evaluate"):
        s = evaluate(lm, ids, 32, ["kvquant-2"], windows=8, calibration=art, attn_layers=[], bos="always")
    assert s["bos"] == "always"
    assert _record(s)["calibrated_on_eval_text"] is True and _record(s)["calibration_overlap_tokens"] == 56
    assert "56 of the 248 evaluated tokens" in _warnings(caplog)[0]
