"""``kvbits.kernels.autotune``: the decode launch chosen by timing, checked against the default launch's output.

Most tests drive ``DecodeTuner`` with a stand-in kernel and timer (what each launch returns and how long it takes are
set by the test); two run the real kernel through Triton's interpreter, one of them through ``dispatch``.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_kernels import DEVICE, KIVI4_KEYS, KIVI4_VALUES, make_store, needs_triton

from kvbits.kernels import autotune, dispatch
from kvbits.kernels.autotune import CANDIDATES, Candidate, DecodeTuner, tune_key
from kvbits.kernels.reference import decode_attention_reference
from kvbits.schemes import TensorSpec

try:
    from kvbits.kernels import triton_decode  # the interpreter is enabled by test_kernels
except ImportError:  # Triton not installed (needs_triton skips)
    triton_decode = None
pytestmark = needs_triton


def store_and_query(T: int = 64, B: int = 1, H_kv: int = 2, G: int = 2, D: int = 64, seed: int = 0,
                    dtype: torch.dtype = torch.float16, keys: TensorSpec = KIVI4_KEYS):  # fmt: skip
    """A KIVI-layout int4 store of ``T`` quantized tokens (+ 8 float16 ones; ``test_kernels.make_store``) and a query
    ``(B, G * H_kv, 1, D)``."""
    g = torch.Generator().manual_seed(seed)
    store = make_store(g, B=B, H_kv=H_kv, D=D, T_q=T, T_f=8, key_spec=keys, value_spec=KIVI4_VALUES)
    q = torch.randn(B, G * H_kv, 1, D, generator=g).to(dtype).to(DEVICE)
    return store, q


class StandIn:
    """A kernel whose launches return the reference output (``wrong``: + 1; ``nan``: NaN; ``fails``: raise) and a
    timer that reports ``ms[launch name]`` for the launch its thunk ran."""

    def __init__(self, ms: dict[str, float], wrong=(), nan=(), fails=(), D: int = 64) -> None:
        self.ms, self.wrong, self.nan, self.fails = ms, set(wrong), set(nan), set(fails)
        self.names = {json.dumps(c.kwargs(D, 1), sort_keys=True): c.name for c in CANDIDATES}
        self.calls: list[str] = []
        self.timed: list[str] = []

    def __call__(self, q, store, scale=None, **kw) -> torch.Tensor:
        name = self.names[json.dumps(kw, sort_keys=True)]
        self.calls.append(name)
        if name in self.fails:
            raise RuntimeError("out of resources: shared memory")
        out = decode_attention_reference(q, store, scale).to(q.dtype)
        if name in self.wrong:
            out = out + 1
        if name in self.nan:
            out = out.clone()
            out[0, 0, 0, 0] = float("nan")
        return out

    def timer(self, thunk) -> float:
        thunk()
        self.timed.append(self.calls[-1])
        return self.ms[self.calls[-1]] / 1e3


def times(**fast: float) -> dict[str, float]:
    """1 ms for every candidate, except those given."""
    return {c.name: fast.get(c.name.replace("-", "_"), 1.0) for c in CANDIDATES}


def test_the_fastest_launch_that_matches_the_default_is_chosen(caplog):
    store, q = store_and_query()
    fake = StandIn(times(f16_tile2_w2_s3=0.3, fold=0.2, f16=0.5, stages3=0.1), wrong={"fold"}, nan={"stages3"},
                   fails={"programs8"})  # fmt: skip
    tuner = DecodeTuner(None, runner=fake, timer=fake.timer, rounds=3)
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.autotune"):
        tuning = tuner.tune(q, store)
    assert tuning.launch == "f16-tile2-w2-s3"
    assert set(tuning.rejected) == {"fold", "stages3", "programs8"}
    assert "differs from the default launch by 1" in tuning.rejected["fold"]
    assert "non-finite" in tuning.rejected["stages3"]
    assert "RuntimeError: out of resources" in tuning.rejected["programs8"]
    assert {"fold", "stages3", "programs8"} <= {r.message.split("'")[1] for r in caplog.records}
    assert "fold" not in fake.timed and "stages3" not in fake.timed  # rejected launches are never timed
    assert fake.timed.count("default") == 3 and tuning.ms["f16-tile2-w2-s3"] == pytest.approx(0.3)
    kw = tuner.launch_kwargs(q, store)  # the key is tuned: no more launches or timings
    n_calls = len(fake.calls)
    assert kw == {"dequant": "f16", "block_t": 128, "num_warps": 2, "num_stages": 3}
    assert tuner.launch_kwargs(q, store) == kw and len(fake.calls) == n_calls


def test_a_launch_within_the_margin_keeps_the_default():
    store, q = store_and_query()
    fake = StandIn(times(f16=0.98))
    assert DecodeTuner(None, runner=fake, timer=fake.timer).tune(q, store).launch == "default"
    fake = StandIn(times(f16=0.95))
    assert DecodeTuner(None, runner=fake, timer=fake.timer).tune(q, store).launch == "f16"


def test_a_failing_default_launch_is_raised_not_tuned_around():
    store, q = store_and_query()
    fake = StandIn(times(), fails={"default"})
    with pytest.raises(RuntimeError, match="out of resources"):
        DecodeTuner(None, runner=fake, timer=fake.timer).tune(q, store)


def test_choices_persist_and_a_corrupt_file_is_replaced(tmp_path, caplog):
    path = tmp_path / "tuning" / "decode.json"
    store, q = store_and_query()
    fake = StandIn(times(f16_w2_s3=0.4))
    DecodeTuner(path, runner=fake, timer=fake.timer).tune(q, store)
    saved = json.loads(path.read_text())
    assert saved["format"] == autotune.FORMAT and saved["keys"][tune_key(q, store)]["launch"] == "f16-w2-s3"

    def no_timing(thunk):
        raise AssertionError("a tuned key must not be timed again")

    again = DecodeTuner(path, runner=fake, timer=no_timing)  # a new process: the file's choice
    assert again.launch_kwargs(q, store) == {"dequant": "f16", "num_warps": 2, "num_stages": 3}

    path.write_text('{"format": 1, "keys": {"x": {"launch": 3}}}')  # corrupt: the entry's launch is not a string
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.autotune"):
        fresh = DecodeTuner(path, runner=fake, timer=fake.timer)
    assert fresh.tunings == {} and "ignoring the decode tuning file" in caplog.text
    path.write_text("{not json")
    assert DecodeTuner(path, runner=fake, timer=fake.timer).tunings == {}
    fresh.tune(q, store)  # rewritten whole
    assert list(json.loads(path.read_text())["keys"]) == [tune_key(q, store)]


def test_a_deeply_nested_file_and_a_folder_in_its_place_do_not_stop_tuning(tmp_path, caplog):
    """JSON nested past the parser's recursion limit raised RecursionError out of the tuner's constructor; a folder
    where the file goes left ``decode.json.<pid>.tmp`` behind at every save. Both are logged and tuning goes on."""
    store, q = store_and_query()
    fake = StandIn(times())
    path = tmp_path / "decode.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.autotune"):
        assert DecodeTuner(path, runner=fake, timer=fake.timer).tunings == {}
    assert "ignoring the decode tuning file" in caplog.text
    folder = tmp_path / "taken" / "decode.json"
    folder.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.autotune"):
        DecodeTuner(folder, runner=fake, timer=fake.timer).tune(q, store)
    assert "could not write the decode tuning file" in caplog.text
    assert [p.name for p in folder.parent.iterdir()] == ["decode.json"]  # no tmp file left


def test_another_process_keys_are_kept_when_saving(tmp_path):
    path = tmp_path / "decode.json"
    (s1, q1), (s2, q2) = store_and_query(T=64), store_and_query(T=64, D=32)
    a, b = StandIn(times()), StandIn(times(), D=32)
    ta, tb = DecodeTuner(path, runner=a, timer=a.timer), DecodeTuner(path, runner=b, timer=b.timer)
    ta.tune(q1, s1)
    tb.tune(q2, s2)  # tb loaded the file before ta wrote it
    assert set(json.loads(path.read_text())["keys"]) == {tune_key(q1, s1), tune_key(q2, s2)}


def test_keys_bucket_batch_and_context_and_tell_layouts_apart():
    s1, q1 = store_and_query(T=1120)
    s2, q2 = store_and_query(T=2016)
    s3, q3 = store_and_query(T=2048)  # + 8 tail tokens: past 2048
    assert tune_key(q1, s1) == tune_key(q2, s2) != tune_key(q3, s3)
    assert "T2048" in tune_key(q2, s2) and "T4096" in tune_key(q3, s3)
    s4, q4 = store_and_query(B=3)
    s5, q5 = store_and_query(B=4)
    assert tune_key(q4, s4) == tune_key(q5, s5)
    s6, q6 = store_and_query(keys=KIVI4_VALUES)  # per-token keys: another kernel specialisation
    s7, q7 = store_and_query(dtype=torch.bfloat16)
    assert len({tune_key(q5, s5), tune_key(q6, s6), tune_key(q7, s7), tune_key(q1, s1)}) == 4


def test_keys_tell_apart_what_the_kernel_specialises_on():
    """The kernel compiles another variant for a tail-only padding mask, full- or half-width RoPE tables, a tail of
    another dtype than the query and lengths read from the device (a static cache's store); the key named none of
    them, so a launch checked and timed on one variant served the others (a static cache's graph-replayed steps are
    never checked). Each now makes its own key."""
    import dataclasses

    store, q = store_and_query()
    B, D, T_f = q.shape[0], q.shape[-1], store.key_full.shape[2]
    tables = torch.ones(64, D), torch.ones(64, D // 2)
    pos0 = torch.zeros(B, dtype=torch.int32)
    variants = [
        store,
        dataclasses.replace(store, full_mask=torch.ones(B, T_f, dtype=torch.bool)),
        dataclasses.replace(store, rope_cos=tables[0], rope_sin=tables[0], quant_pos0=pos0),
        dataclasses.replace(store, rope_cos=tables[1], rope_sin=tables[1], quant_pos0=pos0),
        dataclasses.replace(store, key_full=store.key_full.float(), value_full=store.value_full.float()),
        dataclasses.replace(store, uniform_lens=not store.uniform_lens),
    ]
    assert len({tune_key(q, s) for s in variants}) == len(variants)
    assert tune_key(q, dataclasses.replace(store)) == tune_key(q, store)


def test_keys_tell_apart_per_token_scales_over_an_odd_slot_count():
    """Per-token float16 scales over an odd number of slots are read as int32 words by another kernel variant
    (``K_W32``/``V_W32`` 2, against 1 over an even count), which a growing per-token cache alternates step by
    step; both had one key (1120 and 1121 slots: one ``T2048`` key), so a launch checked and timed on one
    variant served the other unchecked until a ``verify_due`` call. Each now has its own key."""
    from kvbits.kernels.triton_decode import _words_ok
    from kvbits.schemes import get_scheme

    per_token = get_scheme("int4-token").key  # one float16 scale per token and head: scales (B, H, T, 1)
    (even, q), (odd, _) = store_and_query(T=1120, keys=per_token), store_and_query(T=1121, keys=per_token)
    assert (_words_ok(even.key), _words_ok(odd.key)) == (1, 2)
    assert tune_key(q, even) != tune_key(q, odd)
    assert tune_key(q, even) == tune_key(q, store_and_query(T=1122, keys=per_token)[0])  # same variant, one key


def test_nothing_is_timed_while_a_graph_is_captured(monkeypatch):
    store, q = store_and_query()
    fake = StandIn(times(f16=0.1))
    tuner = DecodeTuner(None, runner=fake, timer=fake.timer)
    monkeypatch.setattr(autotune, "_no_timing_now", lambda: True)
    assert tuner.launch_kwargs(q, store) == {"dequant": "f32"} and fake.calls == [] and tuner.tunings == {}
    monkeypatch.setattr(autotune, "_no_timing_now", lambda: False)
    assert tuner.launch_kwargs(q, store) == {"dequant": "f16"}
    monkeypatch.setattr(autotune, "_no_timing_now", lambda: True)
    assert tuner.launch_kwargs(q, store) == {"dequant": "f16"}  # tuned before the capture: its choice


def test_a_tuned_launch_is_checked_again_and_revoked_when_it_differs(tmp_path, caplog):
    """``attend`` compares a chosen launch with the default launch on later calls (``verify_due``): one that goes
    wrong is revoked on the next check, that call returns the default launch's output, later calls take the default
    launch, and the file says why."""
    path = tmp_path / "decode.json"
    store, q = store_and_query()
    ref = decode_attention_reference(q, store).to(q.dtype)
    fake = StandIn(times(f16=0.5))
    tuner = DecodeTuner(path, runner=fake, timer=fake.timer, rounds=1)
    assert torch.equal(tuner.attend(q, store), ref)  # call 1 tunes (every candidate checked on these inputs)
    assert tuner.tunings[tune_key(q, store)].launch == "f16" and fake.calls[-1] == "f16"
    n = len(fake.calls)
    fake.wrong.add("f16")  # wrong from now on, as on other inputs
    with caplog.at_level(logging.WARNING, logger="kvbits.kernels.autotune"):
        out = tuner.attend(q, store)  # call 2: checked
    assert fake.calls[n:] == ["default", "f16"] and torch.equal(out, ref)
    assert "revoked" in caplog.text
    entry = json.loads(path.read_text())["keys"][tune_key(q, store)]
    assert entry["launch"] == "default" and entry["rejected"]["f16"].startswith("on call 2 of this key: differs")
    assert autotune.DecodeTuner(path, runner=fake, timer=fake.timer).launch_kwargs(q, store) == {"dequant": "f32"}
    n = len(fake.calls)
    assert torch.equal(tuner.attend(q, store), ref) and fake.calls[n:] == ["default"]  # no more checks
    assert tuner.served[tune_key(q, store)] == "default"


def test_a_tuned_launch_that_fails_later_is_revoked():
    store, q = store_and_query()
    fake = StandIn(times(f16=0.5))
    tuner = DecodeTuner(None, runner=fake, timer=fake.timer, rounds=1)
    tuner.attend(q, store)
    fake.fails.add("f16")
    assert torch.equal(tuner.attend(q, store), decode_attention_reference(q, store).to(q.dtype))
    assert "failed: RuntimeError: out of resources" in tuner.tunings[tune_key(q, store)].rejected["f16"]


def test_checks_fall_on_powers_of_two_and_not_during_a_capture(tmp_path, monkeypatch):
    """64 calls after the tuning call check 6 times (calls 2, 4, ..., 64); a choice read from the file is checked on
    its first call too; nothing is compared while a graph is captured."""
    assert [n for n in range(1, 70) if autotune.verify_due(n)] == [1, 2, 4, 8, 16, 32, 64]
    path = tmp_path / "decode.json"
    store, q = store_and_query()
    fake = StandIn(times(f16=0.5))
    tuner = DecodeTuner(path, runner=fake, timer=fake.timer, rounds=1)
    tuner.attend(q, store)
    n = len(fake.calls)
    for _ in range(63):
        tuner.attend(q, store)
    assert fake.calls[n:].count("default") == 6 and fake.calls[n:].count("f16") == 63

    again = DecodeTuner(path, runner=fake, timer=fake.timer)  # another process: the file's choice
    n = len(fake.calls)
    again.attend(q, store)
    assert fake.calls[n:] == ["default", "f16"]
    monkeypatch.setattr(autotune, "_no_timing_now", lambda: True)
    n = len(fake.calls)
    again.attend(q, store)  # call 2, due, but inside a capture: the launch alone
    assert fake.calls[n:] == ["f16"]


def test_chosen_launches_since_a_mark(monkeypatch):
    """``chosen_launches(since=launch_counts())`` lists the keys served after the mark, not the process's earlier
    ones (``kvbits speed`` records its own run's launches)."""
    (s1, q1), (s2, q2) = store_and_query(T=64), store_and_query(T=64, D=32)
    fake1, fake2 = StandIn(times(f16=0.5)), StandIn(times(), D=32)
    t1 = DecodeTuner(None, runner=fake1, timer=fake1.timer, rounds=1)
    t2 = DecodeTuner(None, runner=fake2, timer=fake2.timer, rounds=1)
    monkeypatch.setattr(autotune, "_TUNERS", {("a", None): t1, ("b", None): t2})
    t1.attend(q1, s1)
    mark = autotune.launch_counts()
    t2.attend(q2, s2)
    assert autotune.chosen_launches() == {tune_key(q1, s1): "f16", tune_key(q2, s2): "default"}
    assert autotune.chosen_launches(since=mark) == {tune_key(q2, s2): "default"}
    t1.attend(q1, s1)
    assert set(autotune.chosen_launches(since=mark)) == {tune_key(q1, s1), tune_key(q2, s2)}


def test_candidate_launches():
    by = {c.name: c for c in CANDIDATES}
    assert CANDIDATES[0] == Candidate("default")
    assert by["f16-tile2-w2-s3"].kwargs(128, 132) == {"dequant": "f16", "block_t": 64, "num_warps": 2,
                                                      "num_stages": 3}  # fmt: skip
    assert by["f16-tile2-s3"].kwargs(64, 132)["block_t"] == 128 and by["f16-tile2-s3"].kwargs(256, 1)["block_t"] == 64
    assert by["programs8"].kwargs(64, 132) == {"dequant": "f32", "target_programs": 1056}
    assert by["f16-tile2-w2-s3-p8"].kwargs(128, 132) == {**by["f16-tile2-w2-s3"].kwargs(128, 132), "target_programs": 1056}
    assert by["fold-p8"].kwargs(64, 132) == {"dequant": "fold", "target_programs": 1056}
    assert len({json.dumps(c.kwargs(64, 1), sort_keys=True) for c in CANDIDATES}) == len(CANDIDATES)  # all distinct
    with pytest.raises(ValueError, match="distinct"):
        DecodeTuner(None, candidates=(Candidate("a"), Candidate("a", num_stages=3)))


def test_the_environment_switch(monkeypatch):
    for raw, mode in (("", "off"), ("0", "off"), ("on", "on"), ("1", "on"), ("TRUE", "on")):
        monkeypatch.setenv(autotune.AUTOTUNE_ENV, raw)
        assert autotune.autotune_mode() == mode
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "fast")
    with pytest.raises(ValueError, match="KVBITS_AUTOTUNE must be one of"):
        autotune.autotune_mode()


def test_the_real_kernel_tuned_through_dispatch(monkeypatch, tmp_path):
    """Three of the real candidates through Triton's interpreter (compiled on CUDA): the decode step's output is the
    default launch's up to the tolerance, the choice is written, and an explicit ``KVBITS_DEQUANT`` limits the
    candidates to its own launches."""
    path = tmp_path / "decode.json"
    monkeypatch.setenv(dispatch.KERNEL_ENV, "triton")
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "on")
    monkeypatch.setenv(autotune.FILE_ENV, str(path))
    monkeypatch.delenv(dispatch.DEQUANT_ENV, raising=False)
    by = {c.name: c for c in CANDIDATES}
    monkeypatch.setattr(autotune, "CANDIDATES", (by["default"], by["stages3"], by["f16-w2-s3"]))
    monkeypatch.setattr(autotune, "ROUNDS", 1)
    monkeypatch.setattr(autotune, "_TUNERS", {})
    store, q = store_and_query()
    out = dispatch.decode_attention(q, store)
    default = triton_decode.decode_attention_triton(q, store)
    assert autotune._mismatch(out, default) is None
    assert (out.float() - decode_attention_reference(q, store)).abs().max() < 0.01
    (entry,) = json.loads(path.read_text())["keys"].values()
    assert set(entry["ms"]) == {"default", "stages3", "f16-w2-s3"} and entry["rejected"] == {}

    monkeypatch.setenv(dispatch.DEQUANT_ENV, "f16")
    tuner = autotune.default_tuner("f16")
    assert [c.name for c in tuner.candidates.values()] == ["f16", "f16-w2-s3"]
    assert tuner.candidates["f16"].kwargs(64, 1) == {"dequant": "f16"}


def test_the_prepared_gpu_benchmark_runs_here(tmp_path):
    """``benchmarks/autotune_decode.py --smoke`` on the CPU: a row per case with the tuner's choice and the timings."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import autotune_decode

    out = tmp_path / "autotune.json"
    result = autotune_decode.main(["--smoke", "--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] and saved == json.loads(json.dumps(result))
    assert [(r["shape"], r["layout"]) for r in saved["rows"]] == [("qwen2.5-0.5b", "kivi"), ("qwen2.5-0.5b", "token")]
    for row in saved["rows"]:
        assert set(row["tuner_ms"]) | set(row["rejected"]) == set(autotune_decode.SMOKE_CANDIDATES)
        assert row["launch"] in row["tuner_ms"]
        assert row["tuned_vs_default"] == pytest.approx(row["ms_default"] / row["ms_tuned"], rel=1e-2)
        assert (row["launch"] == "default") == (row["ms_tuned"] == row["ms_default"])


def test_the_prepared_gpu_benchmark_records_a_failing_case_and_goes_on(tmp_path, monkeypatch):
    """``autotune_decode.py`` ran each case and its prewarm unguarded: one case whose default launch raised (a launch
    no GPU had run, out of memory) ended the script there, and the cases after it were never timed. Now a case that
    raises is recorded under ``failures`` (as ``gpu_decode.py`` records its steps), the next case runs, and the script
    exits non-zero after the last save; a prewarm that raises is recorded under ``prewarm`` (``{"error"}``)."""
    import sys
    import types
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import autotune_decode

    def run_case(case: dict, *_args, **_kw) -> dict:
        if case["layout"] == "kivi":
            raise RuntimeError("default launch failed")
        return {**case, "launch": "default"}

    monkeypatch.setattr(autotune_decode, "run_case", run_case)
    out = tmp_path / "autotune.json"
    with pytest.raises(SystemExit, match="1 case.*failed.*kivi.*RuntimeError: default launch failed"):
        autotune_decode.main(["--smoke", "--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] and [r["layout"] for r in saved["rows"]] == ["token"]
    assert saved["failures"] == [{"step": "qwen2.5-0.5b kivi B=1 T=160", "error": "RuntimeError: default launch failed"}]

    def broken(*_args, **_kw):
        raise OSError("no workers")

    monkeypatch.setitem(sys.modules, "prewarm", types.SimpleNamespace(prewarm=broken))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d: (9, 0))
    assert autotune_decode._prewarm(torch.device("cuda"), [], 1.0) == {"error": "OSError: no workers"}


def test_tuners_of_other_candidates_do_not_share_choices(tmp_path):
    """A tuner of other candidates (``default_tuner(dequant)``, an explicit ``KVBITS_DEQUANT``) and one of all of
    ``CANDIDATES`` share the tuning file; they shared its keys too, so each took the other's choice as its own. Before,
    a ``KVBITS_DEQUANT=fold`` process's choice (``fold``, its own default, timed only against ``fold-p8``) was served
    by a later unrestricted process for the key without any timing, 3.3x slower than its default launch here (1.0
    against 0.3 ms). Now each candidate set keys its own choices (``DecodeTuner.key``); ``CANDIDATES``' keys are
    ``tune_key``'s."""
    path = tmp_path / "decode.json"
    store, q = store_and_query()
    fake = StandIn(times(default=0.3, fold=1.0, fold_p8=1.0))
    fold_only = DecodeTuner(path, candidates=(Candidate("fold", dequant="fold"), CANDIDATES[-1]), runner=fake,
                            timer=fake.timer, rounds=1)  # fmt: skip
    fold_only.attend(q, store)
    assert fold_only.served == {fold_only.key(q, store): "fold"} and fold_only.key(q, store) != tune_key(q, store)
    full = DecodeTuner(path, runner=fake, timer=fake.timer, rounds=1)
    n = len(fake.timed)
    full.attend(q, store)
    assert set(fake.timed[n:]) == {c.name for c in CANDIDATES}  # tuned its own candidates
    assert full.served == {tune_key(q, store): "default"} and full.key(q, store) == tune_key(q, store)
    assert set(json.loads(path.read_text())["keys"]) == {tune_key(q, store), fold_only.key(q, store)}
    assert autotune.candidates_tag(CANDIDATES) == "" != autotune.candidates_tag(CANDIDATES[:3])
