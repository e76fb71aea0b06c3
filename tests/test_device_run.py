"""The prepared device run (``benchmarks/device_run.sh``) works here before any device time is spent on it.

A session is lent a GPU by chance, for 15 minutes, and the run is one call: a typo in the script, a failure map
that does not start, or a test the CUDA selection no longer finds (renamed, moved) would cost that session. So
the whole script runs here in its dry mode (``DEVICE_RUN_DRY=1``: ``gpu_decode.py --smoke --device cpu``, the
failure map's ``--smoke`` through Triton's interpreter, the CUDA tests collected, not run; about 25 s), and every
term of its pytest ``-k`` selection must still name a collected test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_run.sh"


def selection_terms(script: str) -> list[str]:
    """The terms of the ``-k "a or b or ..."`` expression of ``script``'s pytest call (bash joins a
    backslash-newline inside double quotes)."""
    found = re.search(r'-k "((?:[^"\\]|\\.|\\\n)*)"', script)
    assert found, "no -k selection in device_run.sh"
    expr = " ".join(found.group(1).replace("\\\n", " ").split())
    return [t.strip() for t in expr.split(" or ")]


def test_selection_terms_are_read_as_bash_reads_them():
    script = 'pytest tests/a.py -k "alpha or beta \\\n        or gamma_delta" 2>&1'
    assert selection_terms(script) == ["alpha", "beta", "gamma_delta"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_run_dry_on_cpu(tmp_path: Path):
    """Every step of the prepared run starts, writes what it says, and exits 0; its CUDA tests' selection
    collects tests, and each of its ``-k`` terms names at least one."""
    pytest.importorskip("triton", reason="the failure map and kernel checks need Triton's interpreter")
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE_RUN_DRY": "1", "OUT": str(out), "PYTHON": sys.executable}
    for name in ("PYTHONPATH", "KVBITS_KERNEL", "KVBITS_DEQUANT", "TRITON_INTERPRET", "GPU_DECODE_ARGS"):
        env.pop(name, None)
    run = subprocess.run(["bash", str(SCRIPT), "dry-commit"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    device = (out / "device.txt").read_text()
    assert "commit: dry-commit" in device and "torch op on the cpu (x.add_(1), 1 element): " in device
    assert "launch settings: " in device
    for step in ("gpu_decode exit: 0", "cuda tests exit: 0", "failure map f16 exit: 0", "failure map meta32 exit: 0"):
        assert step in run.stdout, (step, run.stdout[-3000:])

    decode = json.loads((out / "gpu_decode.json").read_text())
    assert decode["complete"] and decode["smoke"] and decode["records"]
    assert decode["commit"] == "dry-commit"  # through $KVBITS_COMMIT: the device's copy of the tree has no .git
    # a device call returns at most 8 files from $OUT (the dry run's wheels aside)
    files = [p for p in out.rglob("*") if p.is_file() and "site" not in p.relative_to(out).parts]
    assert len(files) <= 8, sorted(str(p.relative_to(out)) for p in files)
    assert decode["checks"] and all(c["ok"] for c in decode["checks"])

    for part in ("f16", "meta32"):  # the two maps, run side by side
        fmap = json.loads((out / f"failure_map_{part}.json").read_text())
        stale = [k for k, ok in fmap["tests_tables_match"].items() if not ok]
        assert not stale, f"kernel_failure_map's base cases are no longer the tests' rows {stale}"
        counts = fmap["summary"][part]
        assert counts["ok"] > 0 and counts["fail"] == counts["error"] == 0, fmap["summary"]

    log = (out / "cuda_tests.log").read_text()
    ids = [line for line in log.splitlines() if "::" in line]
    assert re.search(r"\d+ tests collected", log) and ids, log[-2000:]
    names = [i.split("::", 1)[1].lower() for i in ids]
    missing = [t for t in selection_terms(SCRIPT.read_text()) if not any(t.lower() in n for n in names)]
    assert not missing, f"device_run.sh's -k terms that select no test any more: {missing}"


def _parallel_pytest():
    import importlib.util

    path = ROOT / "benchmarks" / "parallel_pytest.py"
    spec = importlib.util.spec_from_file_location("parallel_pytest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parallel_pytest_deals_each_test_functions_cases_to_one_worker():
    pp = _parallel_pytest()
    ids = ["t.py::a[1]", "t.py::b", "t.py::a[2]", "t.py::c[x]", "t.py::c[y]", "t.py::a[3]", "t.py::d"]
    chunks = pp.deal(ids, 3)
    assert sorted(i for c in chunks for i in c) == sorted(ids) and len(chunks) == 3
    assert ["t.py::a[1]", "t.py::a[2]", "t.py::a[3]"] in chunks  # the largest group alone, in collection order
    for c in chunks:  # no test function split across workers
        for other in chunks:
            if other is not c:
                assert not {i.split("[")[0] for i in c} & {i.split("[")[0] for i in other}
    assert pp.deal(ids, 1) == [ids] and len(pp.deal(ids, 50)) == 4  # at most one worker per test function


def test_parallel_pytest_runs_workers_and_cuts_them_with_their_summaries(tmp_path: Path):
    """Workers run side by side; one still running at the deadline gets SIGINT and its pytest still reports what
    it ran; the log holds every worker's output and the added-up counts; a failure makes the exit status 1."""
    (tmp_path / "test_sample.py").write_text(
        "import time, pytest\n"
        "def test_pass():\n    pass\n"
        "@pytest.mark.parametrize('n', [1, 2, 3])\ndef test_cases(n):\n    assert n > 0\n"
        "def test_fail():\n    assert 1 == 2, 'deliberate'\n"
        "def test_slow_then_cut():\n    time.sleep(120)\n"
    )
    log = tmp_path / "out" / "tests.log"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel_pytest.py"), "--workers", "3",
                          "--timeout-s", "15", "--log", str(log), "--", "test_sample.py", "-k", "not nothing"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert "6 tests collected" in text and text.count("===== worker") == 3
    assert "deliberate" in text and "KeyboardInterrupt" in text, text  # the failure's traceback; the cut worker's report
    last = text.strip().splitlines()[-1]
    assert "3 workers, 6 tests: 1 failed, 4 passed; 1 cut at 15 s" in last, last
    assert last in run.stdout and not list(log.parent.glob("*.worker*.log"))
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel_pytest.py"), "--collect-only",
                             "--log", str(log), "--", "test_sample.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    assert listed.returncode == 0 and "6 tests collected" in listed.stdout
    assert "test_sample.py::test_fail" in log.read_text()
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    broken = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel_pytest.py"), "--log", str(log), "--",
                             "test_sample.py", "test_broken.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert broken.returncode == 1 and "pytest --collect-only failed" in broken.stdout
    assert "no_such_module_here" in log.read_text()  # the log says why nothing ran


def test_host_speed_names_launch_settings_and_times_a_triton_launch():
    """``host_speed.py``'s launch lines: the variables that slow every launch are named (``none set`` without them),
    and the Triton launch it times runs its kernel (here through the interpreter, on a CPU tensor). In a process of
    its own: a test that compiled kvbits' kernels for sm_90 earlier in the same process (``tests/test_aot.py``) leaves
    Triton unable to interpret a kernel decorated after it."""
    pytest.importorskip("triton", reason="the launch runs through Triton's interpreter")
    code = """
import os
from kvbits.kernels.interpret import enable_interpreter
enable_interpreter()
import torch, host_speed
for name in list(os.environ):
    if name.startswith(("CUDA_", "PYTORCH_", "TORCH_", "TRITON_")) and name != "TRITON_INTERPRET":
        del os.environ[name]
saved = os.environ.pop("TRITON_INTERPRET")
assert host_speed.launch_settings() == "none set", host_speed.launch_settings()
os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
assert host_speed.launch_settings() == "CUDA_LAUNCH_BLOCKING=1"
os.environ["TRITON_INTERPRET"] = saved
y = torch.zeros(1)
line = host_speed.triton_launch_us(y, 3, lambda: None)
assert line.endswith(" us") and float(line.split()[0]) > 0, line
assert y.item() == 1 + 5 * 3, y  # the warm-up call, then 5 timed loops of 3 launches, each adding 1
print("OK")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_optional_second_calls_step6_runs_exist(monkeypatch):
    """The second device call that ``device_run.sh``'s header prepares names its step-6 runs (``--e2e-runs``); a
    misspelt one would stop that call before its first step, on the device's time. Each name must be a run
    ``gpu_bench.e2e`` knows; the call exists for transformers' ``QuantizedCache`` (quanto, 4 bits), never measured,
    beside the fp16 baseline it is compared with, and a graph-replayed ``StaticQuantizedKVCache``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # not left there by another test of this process
    from gpu_bench.e2e import wanted_runs

    found = re.search(r"--e2e-runs (\S+)", SCRIPT.read_text())
    assert found, "no --e2e-runs in device_run.sh's header"
    names = found.group(1).split(",")
    wanted = wanted_runs(names)  # ValueError for an unknown cache name
    assert wanted("dynamic-fp16", "fp16") and wanted("hf-quantized-quanto", 4) and not wanted("hf-quantized-quanto", 2)
    assert wanted("kvbits-static-graphs", "kivi-4"), names


def test_a_failing_step_is_recorded_and_the_next_ones_run(monkeypatch, tmp_path: Path):
    """Step 2c (never run on a GPU) raising ended gpu_decode.py before the sweep; one fp16 baseline raising ended
    the sweep at that cell. Each is now recorded (``failures``, ``skipped``), the steps after it run, and the script
    exits non-zero once everything ran."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import sweep

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    real, calls = sweep.fp16_baselines, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected baseline")
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_decode, "growing_vs_reserved", boom)
    monkeypatch.setattr(gpu_decode, "check_variants", lambda *a, **k: [])  # (the interpreter's checks: minutes)
    monkeypatch.setattr(gpu_decode, "check_and_time_quantize", lambda *a, **k: [])
    monkeypatch.setattr(sweep, "fp16_baselines", flaky)
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: \(2c\) growing vs reserved: RuntimeError: injected"):
        gpu_decode.main(["--smoke", "--device", "cpu", "--check", "yes", "--e2e", "no", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["complete"] and d["records"] and d["growing_vs_reserved"] is None and len(d["failures"]) == 1
    assert [s["reason"] for s in d["skipped"]] == ["fp16 baseline failed: RuntimeError: injected baseline"]
    assert len({(r["shape"], r["context"]) for r in d["records"]}) == len(calls) - 1  # every other cell timed


def test_a_failing_end_to_end_run_is_recorded_and_the_next_ones_run(monkeypatch, tmp_path: Path):
    """A step-6 run whose fused path missed steps raised SystemExit: every later run (the quanto and CUDA-graph
    peers the second device call exists for) was lost. It is a ``failure`` row now; a run that raises is
    ``skipped`` with its error, and a transformers backend that failed is not tried again."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import e2e

    real = e2e._finish

    def miss(cfg, model, name, *args, **kwargs):
        if name == "kvbits-fused":
            raise e2e.E2EFailure("E2E FAILURE: kvbits-fused kivi-4: injected")
        return real(cfg, model, name, *args, **kwargs)

    monkeypatch.setattr(e2e, "_finish", miss)
    monkeypatch.setattr(e2e, "_hf_cache", lambda *a: (object(), None))  # a backend that fails on this device
    out = tmp_path / "e.json"
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: \(6\) kvbits-fused: E2E FAILURE: kvbits-fused kivi-4"):
        gpu_decode.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs",
                         "dynamic-fp16,kvbits-fused:kivi-4,kvbits-dequant-sdpa,hf-quantized-quanto", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["e2e"]
    assert [r["cache"] for r in rows] == ["dynamic-fp16", "kvbits-fused", "kvbits-dequant-sdpa"] + ["hf-quantized-quanto"] * 2
    assert "failure" in rows[1] and rows[2]["tokens_per_s"] > 0
    assert rows[3]["skipped"].startswith("AttributeError") and rows[4]["skipped"].startswith("the quanto backend failed before")


def test_pre_rope_bytes_count_the_table_rows_the_quantized_keys_reach(monkeypatch):
    """A pre-RoPE row's ``bytes_read`` counted the RoPE tables of every position of the context, but the kernel reads
    the rows of the quantized keys' positions only (the fp16 tail holds post-RoPE keys): at 4K, batch 1, Qwen2.5's
    shape, int2 codes, 1,495,040 bytes were counted where 1,462,272 are read (GB/s and ``frac_of_copy`` 2.2 % high).
    Attention over tables cut to those rows is the same, bit for bit: the rows past them are never read."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torch
    from gpu_bench.common import SCHEMES, SHAPES, random_store, rope_tables
    from gpu_bench.sweep import read_bytes

    from kvbits.kernels.reference import decode_attention_reference

    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)
    shape = SHAPES["qwen2.5-0.5b"]
    tables = rope_tables(4096, shape["D"], cpu)
    store = random_store(1, shape, 4096, SCHEMES["int2"], cpu, gen, tables, lazy=True)
    T_q = store.key.n_slots
    assert T_q == 4096 - 128 and read_bytes(store, tables) == store.nbytes + 2 * T_q * 32 * 4 == 1_462_272
    assert read_bytes(store, None) == store.nbytes  # post-RoPE keys: no tables
    small = rope_tables(256, shape["D"], cpu)
    store = random_store(1, shape, 256, SCHEMES["int4"], cpu, gen, small)
    q = torch.randn(1, shape["H_q"], 1, shape["D"], generator=gen).half()
    cut = replace(store, rope_cos=small[0][: store.key.n_slots], rope_sin=small[1][: store.key.n_slots])
    assert torch.equal(decode_attention_reference(q, store), decode_attention_reference(q, cut))


def test_end_to_end_speedups_are_taken_from_the_times_once_the_batchs_fp16_runs_are_known(monkeypatch, tmp_path: Path):
    """Step 6's speed-ups. ``dynamic-fp16``'s ``speedup_vs_best_fp16`` was taken when it was the only fp16 run yet:
    1.0 even when ``dynamic-fp16-no-cudnn``, timed after it, was twice as fast (0.5 now). And every speed-up was a
    ratio of tokens/s rounded to 0.1: §6z's kivi-4 at batch 1 (92.117 against 56.814 ms per step, 10.9 and 17.6
    tokens/s) read 1.615x where its times give 1.621x. Times stand in for the H200's here."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import e2e

    real, ms = e2e.decode_run, iter([92.117, 46.0585, 56.814])  # DynamicCache, without cuDNN, kvbits fused kivi-4

    def timed(cfg, model, cache, ids, tokens, warmup, **kwargs):
        r = real(cfg, model, cache, ids, tokens, warmup, **kwargs)
        r["ms_per_step"] = next(ms)
        r["tokens_per_s"] = round(ids.shape[0] * 1e3 / r["ms_per_step"], 1)
        return r

    monkeypatch.setattr(e2e, "decode_run", timed)
    out = tmp_path / "e.json"
    result = gpu_decode.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs",
                              "dynamic-fp16,dynamic-fp16-no-cudnn,kvbits-fused:kivi-4", "--out", str(out)])  # fmt: skip
    rows = {r["cache"]: r for r in result["e2e"]}
    assert json.loads(out.read_text())["e2e"] == json.loads(json.dumps(result["e2e"]))
    got = {c: (r["speedup_vs_fp16"], r["speedup_vs_best_fp16"]) for c, r in rows.items()}
    assert got == {"dynamic-fp16": (1.0, 0.5), "dynamic-fp16-no-cudnn": (2.0, 1.0), "kvbits-fused": (1.621, 0.811)}
    assert rows["kvbits-fused"]["tokens_per_s"] == 17.6 and rows["dynamic-fp16"]["tokens_per_s"] == 10.9
    assert all(r["speedup_vs_static_graphs"] is None for r in rows.values())  # not run


def test_a_raising_sweep_split_sweep_or_tuning_is_recorded_and_keeps_its_rows(monkeypatch, tmp_path: Path):
    """Steps 3, its split sweep and 3b were not guarded: a raise in any of them ended gpu_decode.py (the
    end-to-end step 6 never ran), contrary to device_run.sh's "a step that raises is recorded under failures and
    the next one runs". Each is now guarded, and the rows it had timed (handed to its progress callback) stay in
    the file: the final save does not replace them with []."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode

    row = {"shape": "s", "batch": 1, "context": 256, "kernel": "triton", "scheme": "int4", "error": "no launch"}

    def sweep(cfg, decode, copy_gbps, progress, skipped):
        progress([{**row, "step": "sweep"}])
        raise RuntimeError("injected sweep")

    def split_sweep(cfg, decode, copy_gbps, swept, progress):
        assert [r["step"] for r in swept] == ["sweep"]
        progress([{**row, "step": "split"}])
        raise RuntimeError("injected split")

    def tune(cfg, decode, copy_gbps, progress):
        progress([{"block_t": 64, "num_warps": 4}])
        raise RuntimeError("injected tuning")

    e2e_runs = []
    monkeypatch.setattr(gpu_decode, "_decoder", lambda cfg: None)  # the Triton branch, nothing compiled
    for name, fake in (("sweep", sweep), ("split_sweep", split_sweep), ("tune", tune)):
        monkeypatch.setattr(gpu_decode, name, fake)
    monkeypatch.setattr(gpu_decode, "end_to_end", lambda *a, **k: e2e_runs.append(1) or [])
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit, match=r"3 step\(s\) failed: \(3\) sweep: RuntimeError: injected sweep; "
                                         r"\(3\) split sweep: .*; \(3b\) tuning: RuntimeError: injected tuning"):
        gpu_decode.main(["--smoke", "--device", "cpu", "--kernel", "triton", "--check", "no", "--out", str(out)])
    d = json.loads(out.read_text())
    assert e2e_runs == [1] and d["complete"]  # step 6 ran after them
    assert [r["step"] for r in d["records"]] == ["sweep", "split"] and d["tuning"] == [{"block_t": 64, "num_warps": 4}]
    assert [f["step"] for f in d["failures"]] == ["(3) sweep", "(3) split sweep", "(3b) tuning"]


def test_a_raising_decoder_or_end_to_end_model_is_recorded_and_the_run_completes(monkeypatch, tmp_path: Path):
    """``_decoder(cfg)`` (Triton's import, its interpreter) and ``end_to_end`` itself (building its model: an
    out-of-memory at 32K) ran outside ``guarded``: either raising ended gpu_decode.py there, step 6 never ran (the
    decoder) or the JSON stayed ``"complete": false`` with no failure named. Both are recorded now and the run goes
    on to its end."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import e2e

    def boom(*args, **kwargs):
        raise ImportError("injected decoder")

    monkeypatch.setattr(gpu_decode, "_decoder", boom)
    out = tmp_path / "d.json"
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: \(3\) decoder: ImportError: injected decoder"):
        gpu_decode.main(["--smoke", "--device", "cpu", "--check", "no", "--e2e-runs", "dynamic-fp16", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["complete"] and [r["cache"] for r in d["e2e"]] == ["dynamic-fp16"] and d["e2e"][0]["tokens_per_s"] > 0

    def no_model(*args, **kwargs):
        raise RuntimeError("injected out of memory")

    monkeypatch.setattr(e2e, "e2e_model", no_model)
    with pytest.raises(SystemExit, match=r"\(6\) end to end: RuntimeError: injected out of memory"):
        gpu_decode.main(["--smoke", "--device", "cpu", "--e2e", "only", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["complete"] and d["e2e"] == [] and [f["step"] for f in d["failures"]] == ["(6) end to end"]


def test_a_run_whose_row_raises_is_a_failure_and_the_next_runs_go_on(monkeypatch, tmp_path: Path):
    """Only ``E2EFailure`` was caught while a decoded run's row was made: anything else (the lazy NaN/inf check
    raising in ``memory_report()`` after the timed steps, a plan that cannot be made) ended step 6 at that run and
    lost every run after it. It is that run's ``failure`` now, and the next runs go on."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import e2e

    real = e2e._planned_bytes

    def bad(model, scheme, batch, tokens, fused):
        if fused:
            raise ValueError("injected: the pending K/V check found inf")
        return real(model, scheme, batch, tokens, fused)

    monkeypatch.setattr(e2e, "_planned_bytes", bad)
    out = tmp_path / "e.json"
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: \(6\) kvbits-fused: E2E FAILURE: kvbits-fused kivi-4: "
                       r"its row raised ValueError"):  # fmt: skip
        gpu_decode.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs",
                         "kvbits-fused:kivi-4,kvbits-dequant-sdpa", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["e2e"]
    assert [r["cache"] for r in rows[-2:]] == ["kvbits-fused", "kvbits-dequant-sdpa"]
    assert "failure" in rows[-2] and rows[-1]["tokens_per_s"] > 0


def test_a_graph_runs_resident_bytes_are_read_after_its_graphs_are_freed(monkeypatch, tmp_path: Path):
    """``kvbits-static-graphs``' ``resident_bytes`` (allocated after the run minus before) were read while its
    ``GraphedDecode`` was alive: on CUDA each captured variant's logits ``(B, 1, V)`` sit in the graph's pool (2 x 8
    x 151936 x 2 bytes = 4.9 MB at batch 8 for kivi-4's two variants), counted as the cache's. The graphs are freed
    first now and what they held is ``graph_bytes``. Allocated bytes stand in for CUDA's here: 1000, plus 500 while a
    ``GraphedDecode`` lives."""
    import weakref

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode
    from gpu_bench import e2e, graphs

    made: list[weakref.ref] = []
    real = graphs.GraphedDecode

    def tracked(model, *args, **kwargs):
        g = real(model, *args, **kwargs)
        made.append(weakref.ref(g))
        return g

    monkeypatch.setattr(graphs, "GraphedDecode", tracked)
    monkeypatch.setattr(e2e, "_allocated", lambda cfg: 1000 + 500 * sum(r() is not None for r in made))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1600)
    out = tmp_path / "g.json"
    gpu_decode.main(["--smoke", "--device", "cpu", "--e2e", "only", "--e2e-runs", "kvbits-static-graphs:int8-token",
                     "--out", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["e2e"]
    assert made and row["tokens_per_s"] > 0 and "replayed from" in row["note"], row
    assert (row["resident_bytes"], row.get("graph_bytes"), row["peak_bytes"]) == (0, 500, 600)
