"""Compile-only checks of the Triton kernels for GPUs that are not here (``kvbits.kernels.aot``).

Triton compiles for sm_90 / sm_80 / sm_89 on this CPU machine (LLVM + its bundled ptxas); each compiled kernel's
registers, shared memory and spills say whether the GPU would launch it and how many fit on an SM. The
compiles run in a subprocess: this test session runs Triton through its interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbits.kernels.aot import LIMITS, KernelResources

ROOT = Path(__file__).resolve().parents[1]


def res(regs: int, shared: int, warps: int = 4) -> KernelResources:
    return KernelResources("k", warps, 2, shared, regs, 0, {})


def test_occupancy_arithmetic():
    """Blocks per SM are limited by registers (granted per warp in units of 256), shared memory (plus the
    1 KiB the runtime reserves per block) and threads, as the CUDA occupancy calculator counts them."""
    h = LIMITS["sm_90"]
    assert h.blocks_per_sm(res(128, 0)) == 4  # 65536 / (128 * 32 * 4)
    assert h.blocks_per_sm(res(255, 0)) == 2  # 255 -> 256 per thread: 32768 per block
    assert h.blocks_per_sm(res(168, 0)) == 3  # 168 * 32 = 5376 per warp: 21504 per block
    assert h.blocks_per_sm(res(32, 100 * 1024)) == 2  # shared: 233472 // (102400 + 1024)
    assert h.blocks_per_sm(res(16, 0, warps=4)) == 16  # threads: 2048 / 128
    assert h.check(res(128, 108544)) is None
    assert "shared memory 288768 B > 232448 B" in h.check(res(255, 288768))
    assert LIMITS["sm_80"].check(res(128, 174080)) is not None  # fits a Hopper block, not an A100's
    assert LIMITS["sm_89"].blocks_per_sm(res(32, 0, warps=16)) == 3  # Ada: 1536 threads per SM (Hopper: 4)
    assert LIMITS["sm_90"].blocks_per_sm(res(32, 0, warps=16)) == 4


def test_sass_is_disassembled_once_per_cubin(monkeypatch):
    """``instruction_mix`` and ``hot_loop`` share one ``cuobjdump -sass`` per distinct cubin (~0.7 s each); a
    failed disassembly raises instead of reading as a kernel without loads."""
    from types import SimpleNamespace

    from kvbits.kernels import aot

    calls = []
    text = "        /*0000*/  LDG.E.128 R0, [R2.64] ;\n        /*0010*/  BRA 0x0 ;\n"

    def fake(kernel, option):
        calls.append((kernel.asm["cubin"], option))
        ok = kernel.asm["cubin"] != b"bad"
        return subprocess.CompletedProcess([], 0 if ok else 1, text if ok else "", "" if ok else "no cubin")

    monkeypatch.setattr(aot, "_cuobjdump", fake)
    monkeypatch.setattr(aot, "_SASS", {})
    a, b = (SimpleNamespace(name="k", asm={"cubin": c}) for c in (b"one", b"two"))
    assert aot.instruction_mix(a)["loads_128"] == 1 and aot.hot_loop(a) == (2, {"LDG": 1, "BRA": 1})
    aot.hot_loop(b)
    assert calls == [(b"one", "-sass"), (b"two", "-sass")]
    with pytest.raises(RuntimeError, match="cuobjdump -sass failed"):
        aot.hot_loop(SimpleNamespace(name="k", asm={"cubin": b"bad"}))


def _run(code: str, timeout: int = 300, cache: Path | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` with compiled Triton kernels (``cache``: a Triton cache folder of its own)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                          timeout=timeout)  # fmt: skip


def _compile_launch(launch: str) -> dict:
    code = f"""
import json, torch, kernel_resources as kr
from gpu_bench import common
shp = common.SHAPES["llama-3-8b"]
tables = common.rope_tables(4096, shp["D"], torch.device("cpu"))
store = common.random_store(2, shp, 4096, common.SCHEMES["int4"], torch.device("cpu"), torch.Generator().manual_seed(0), tables)
print(json.dumps(kr.decode_rows("t", "int4-prerope", "llama-3-8b", store, "sm_90", {launch})))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def test_triton_default_pipeline_would_not_launch_on_hopper():
    """The launch that motivated the defaults: pre-RoPE keys on the gather path, 64-token tiles, Triton's
    default 3-stage pipeline at D = 128 need 282 KiB of shared memory; an H100/H200 block gets 227 KiB."""
    row = _compile_launch("vectorized=False, block_t=64, num_stages=3")
    assert row["shared_bytes"] == 288768 and "shared memory" in row["fails"] and row["blocks_per_sm"] == 0


# sm_90 (the H200 the benchmark runs on) in the default suite; Ampere and Ada (30 s each) in `make test-all`
ARCHS = ["sm_90", pytest.param("sm_80", marks=pytest.mark.slow), pytest.param("sm_89", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch", ARCHS)
def test_default_launches_fit_hopper_ampere_and_ada(tmp_path, arch: str):
    """Every kind of default launch (decode kernel over stores the cache builds: KIVI and pre-RoPE NUQ with
    outliers at both head dims, float16 and float32 queries, KIVI through the opt-in f16 path and folded kernel;
    the quantize kernel) compiles for the arch, fits, and spills no registers (the folded kernel's KIVI at
    D = 128: at most 32 bytes). The quick run includes the NUQ quantize kernel, which once compiled
    only under the interpreter. The machine code is what a memory-bound decode wants: pipelined 128-bit
    loads and tensor-core MMAs (none with float32 queries, whose exact products use the CUDA cores)."""
    path = tmp_path / f"{arch}.json"
    out = _run(f"import kernel_resources as kr; raise SystemExit(kr.main(['--quick', '--arch', '{arch}', '--out', '{path}']))")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["problems"] == [] and "PROBLEM" not in out.stdout
    rows = data["rows"]
    decode = [r for r in rows if r["group"] == "cache"]
    # kivi-4 at both shapes: default, f16 and the folded kernel; float32 queries; kvquant-4-block default and float32
    assert len(decode) == 12 and sum(r["kernel"] == "_quantize_kernel" for r in rows) == 2
    assert sum(r["kernel"] == "_fold_kernel" for r in decode) == 2
    # the opt-in folded kernel's KIVI at D = 128 spills since its keys' q * s takes two dots (session 39;
    # tests/test_fold.py's real-cache check), more since its key scale rows are read whole (session 44): 16 bytes on
    # sm_90 and sm_89, 24 on sm_80. A few bytes, not the default path
    fold_d128 = [r for r in decode if r["kernel"] == "_fold_kernel" and r["shape"] == "llama-3-8b"]
    assert all(r["fails"] is None and r["local_bytes"] == 0 for r in decode if r not in fold_d128)
    assert all(r["fails"] is None and r["local_bytes"] <= 32 for r in fold_d128)
    assert all(r["loads_128"] > 0 and r["async_loads"] > 0 for r in decode)
    assert all((r["mma"] == 0) == ("float32 queries" in r["name"]) for r in decode)


def test_gather_fallback_fits_at_head_dim_128():
    """The pre-RoPE gather fallback at D = 128 (which spilled with Triton's defaults) fits on sm_90 and spills
    no registers, with half tiles."""
    row = _compile_launch("vectorized=False")
    assert row["fails"] is None and row["local_bytes"] == 0 and row["blocks_per_sm"] >= 2
    assert (row["block_t"], row["num_warps"], row["num_stages"]) == (16, 4, 2)  # per-element: half tiles
    assert row["loads_8"] > 0  # the gather path reads codes byte by byte


def test_prewarm_compiles_what_the_gpu_sweep_then_launches(tmp_path):
    """``benchmarks/prewarm.py`` fills Triton's on-disk cache in worker processes from zero-stride stores;
    the benchmark's own sweep (real tensors, every batch and context given, this process) then finds every
    kernel it launches there (the ``dequant="f16"`` and ``dequant="fold"`` variants included, and the per-token
    layouts at batch 8: plain, Hadamard-rotated, centred / smoothed keys, and plain with its keys rounded), and so
    does ``split_sweep`` at its other split counts: no new cache entry, i.e. nothing left to compile in the timed
    run."""
    code = """
import functools, os, torch, prewarm
from gpu_bench import common, sweep
from kvbits.kernels.aot import compile_only
from kvbits.kernels.triton_decode import decode_attention_triton
cache = os.environ["TRITON_CACHE_DIR"]
variants = {"fp16", "int4", *common.TOKEN_SCHEMES}
job_list = [j for j in prewarm.jobs(tune=False) if j[0] == "sweep" and j[1] == "qwen2.5-0.5b" and j[2] in variants]
r = prewarm.prewarm("sm_90", 264, job_list, processes=2, timeout_s=300)
# default, gather and f16 paths; per-token: plain, rotated, smoothed (post-RoPE, pre-RoPE untied and tied); the
# folded kernel on int4 and the three per-token layouts it reads (plain, rotated, smoothed post-RoPE); the plain
# per-token layout with its keys rounded (row_keys=False)
assert r["done"] == len(job_list) == 6 + 5 + 1 + 3 + 1 and not r["failed"], r
before = set(os.listdir(cache))
sweep.SHAPES = {"qwen2.5-0.5b": common.SHAPES["qwen2.5-0.5b"]}
sweep.SCHEMES = {"int4": common.SCHEMES["int4"]}
sweep.PRE_ROPE = ("int4",)
cfg = common.Config(device=torch.device("cpu"), contexts=[4096, 8192], batches=[1, 8], reps=1, warmup=0,
                max_bytes=1e12, smoke=False, kernel="triton")
with compile_only("sm_90") as launched:
    records = sweep.sweep(cfg, functools.partial(decode_attention_triton, target_programs=264), copy_gbps=1.0)
    # and int4 at 8 programs per SM through the default and the folded kernel in every cell (other split counts)
    split = sweep.split_sweep(cfg, functools.partial(decode_attention_triton, target_programs=264), 1.0, records)
# per combo 3 fp16 SDPA baselines (GQA, GQA without cuDNN, expanded) and 7 kernel rows; batch 8: the per-token
# layouts too (the rotated one's split query is a launch of its own)
assert len(records) == 4 * (3 + 7) + 2 * (5 + 3 + 1) and len(launched) > 0, (len(records), len(launched))
assert sorted(r["kernel"] for r in split) == ["triton-fold-p8"] * 4 + ["triton-p8"] * 4, split
assert sum(r["kernel"] == "triton-rounded-keys" for r in records) == 2, records  # row_keys=False
assert sum(r["kernel"] == "triton-f16" for r in records) == 4, records  # dequant="f16" launched too
assert sum(r["kernel"] == "triton-fold" for r in records) == 4 + 2 * 3, records  # and dequant="fold"
print("NEW", len(set(os.listdir(cache)) - before), "OF", len(before))
"""
    out = _run(code, timeout=400, cache=tmp_path / "triton")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    new, total = (int(x) for x in out.stdout.split("NEW ")[1].split(" OF "))
    assert new == 0 and total > 5


def test_prewarm_covers_step_6_and_decode_compiles_once_per_run(tmp_path):
    """Step 6's prewarm job (``prewarm.e2e_launches``: the benchmark's own cache and decode loop, the
    prefill's attention left out) fills Triton's cache with every kernel of the same run with the real
    prefill: nothing left to compile. The residual window grows by one slot per step (its length is
    divisible by 16 on some steps, not others), yet the decode kernel compiles once: the slot counts are
    not specialised."""
    code = """
import os, prewarm
from kvbits.kernels.aot import compile_only
cache = os.environ["TRITON_CACHE_DIR"]
job = ("e2e", "kivi-2", 2, 300, 20, 2)
r = prewarm.prewarm("sm_90", 264, [job], processes=1, timeout_s=300)
assert r["done"] == 1 and not r["failed"], r
before = set(os.listdir(cache))
with compile_only("sm_90") as launched:
    prewarm.e2e_launches(*job[1:], programs=264, stub_prefill=False)
names = sorted({id(k): k.name for k in launched}.values())
print("NEW", len(set(os.listdir(cache)) - before), "OF", len(before), "LAUNCHES", len(launched), "KERNELS", ",".join(names))
"""
    out = _run(code, timeout=400, cache=tmp_path / "triton")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    new, total = (int(x) for x in line.split("NEW ")[1].split(" LAUNCHES")[0].split(" OF "))
    launches = int(line.split("LAUNCHES ")[1].split()[0])
    kernels = line.split("KERNELS ")[1].split(",")
    assert new == 0 and total >= 4, line
    # 2 layers x 22 decode steps x (decode + reduce), plus the quantize launches of prefill and flushes
    assert launches >= 2 * 22 * 2, line
    assert kernels.count("_decode_kernel") == 1 and kernels.count("_reduce_kernel") == 1, line
    assert kernels.count("_quantize_kernel") >= 2, line  # keys per channel, values per token


def test_prewarm_covers_step_2c(tmp_path):
    """Step 2c's prewarm jobs (a growing and a reserved ``int8-token`` cache at that step's sizes) fill Triton's
    cache with every kernel the step then launches (float16 queries, as on the GPU): nothing left to compile
    there."""
    code = """
import os, torch, prewarm
from gpu_bench import common, e2e
from kvbits.kernels.aot import compile_only
cache = os.environ["TRITON_CACHE_DIR"]
jobs = [j for j in prewarm.jobs(tune=False) if j[0] == "growing"]
assert len(jobs) == 2, jobs
r = prewarm.prewarm("sm_90", 264, jobs, processes=1, timeout_s=300)
assert r["done"] == 2 and not r["failed"], r
before = set(os.listdir(cache))
os.environ["KVBITS_KERNEL"] = "triton"
from kvbits.cache import QuantizedKVCache
QuantizedKVCache.check_inputs = lambda self: None  # compile-only: no kernel output is written, the K/V are garbage
cfg = common.Config(device=torch.device("cpu"), contexts=[], batches=[], reps=1, warmup=0, max_bytes=0.0, smoke=True,
                    kernel="triton")
with compile_only("sm_90") as launched:
    e2e.growing_vs_reserved(cfg, **e2e.GROWING_CHECK, dtype=torch.float16, checks="lazy")
print("NEW", len(set(os.listdir(cache)) - before), "OF", len(before), "LAUNCHES", len(launched))
"""
    out = _run(code, timeout=600, cache=tmp_path / "triton")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    new, total = (int(x) for x in line.split("NEW ")[1].split(" LAUNCHES")[0].split(" OF "))
    launches = int(line.split("LAUNCHES ")[1])
    assert new == 0 and total >= 3, line
    assert launches >= 2 * 2 * 24 * 2, line  # 2 caches x 2 layers x 24 steps x (decode + reduce), and the flushes


def test_decode_compiles_once_as_a_context_grows():
    """Serving from a short prompt: the split count grows with the context (a split per tile until the
    device's target), the slot counts with every token; none is specialised, so the decode and reduce
    kernels compile once for all of these lengths (split counts 4 to 134 here)."""
    code = """
import torch
from gpu_bench import common
from kvbits.kernels.aot import compile_only
from kvbits.kernels.triton_decode import decode_attention_triton
shp, cpu = common.SHAPES["qwen2.5-0.5b"], torch.device("cpu")
with compile_only("sm_90") as launched:
    for context in (300, 1000, 3000, 9001, 20000, 40000):
        store = common.random_store(1, shp, context, common.SCHEMES["int4"], cpu, torch.Generator(), lazy=True)
        decode_attention_triton(torch.zeros(1, shp["H_q"], 1, shp["D"], dtype=torch.float16), store,
                                target_programs=264)
print("LAUNCHES", len(launched), "KERNELS", ",".join(sorted({id(k): k.name for k in launched}.values())))
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.split()[1] == "12", line  # 6 contexts x (decode + reduce)
    assert line.split("KERNELS ")[1].split(",") == ["_decode_kernel", "_reduce_kernel"], line


def test_host_overhead_times_the_launch_path_without_running_it():
    """``benchmarks/host_overhead.py --launch``: the fused steps go through Triton's launch code compiled for sm_90
    (the decode, reduce and, for the flushes, quantize kernels compiled, nothing run), their zeroed output keeps the
    model finite, and the attention-zeroed run flushes alike but skips the decode launch path. Its operator count holds what a fused decode
    step launches on a GPU beyond a ``DynamicCache`` step (both attentions zeroed), per layer: kivi-4 adds the lazy
    K/V check's two maxima, the two length vectors of ``packed_store`` and two Triton kernels; reserved int8-token,
    which flushes its new token at every step, adds only the quantize kernel of each side, which writes the codes,
    scales and zero-points straight into the reserved slots (no copies, no clip counter: dynamic ranges clip nothing).
    A change that adds device work to the step shows here."""
    code = """
import host_overhead
from unittest import mock
from kvbits.kernels import aot
seen = []
real = aot.compile_only
def counting(arch):
    cm = real(arch)
    class Wrap:
        def __enter__(self):
            self.launched = cm.__enter__()
            return self.launched
        def __exit__(self, *exc):
            seen.append(sorted({k.name for k in self.launched}))
            return cm.__exit__(*exc)
    return Wrap()
with mock.patch.object(aot, "compile_only", counting):
    times = host_overhead.main(["--layers", "2", "--steps", "2", "--launch"])
    print("TIMES", len(times), all(len(t) == 1 and t[0] > 0 for t in times.values()))
    print("LAUNCHED", seen)
    host_overhead.main(["--layers", "2", "--steps", "2", "--launch", "--scheme", "int8-token", "--reserve"])
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "TIMES 6 True" in lines, out.stdout[-2000:]
    # both stubbed runs flush through the Triton quantize kernel, compiled only (KVBITS_KERNEL=triton, as on a GPU);
    # only the launch run reaches the decode and reduce kernels
    assert "LAUNCHED [['_quantize_kernel'], ['_decode_kernel', '_quantize_kernel', '_reduce_kernel']]" in lines, \
        out.stdout[-2000:]
    assert any(line.startswith("launch path: ") for line in lines)
    extra = [line for line in lines if line.startswith("kvbits' fused step beside DynamicCache's")]
    assert len(extra) == 2, out.stdout[-2000:]
    assert extra[0].endswith(": aten.linalg_vector_norm.out +2.0, aten.full.default +2.0"), out.stdout[-2000:]
    assert extra[1].endswith(": aten.linalg_vector_norm.out +2.0, aten.full.default +2.0"), out.stdout[-2000:]
    for scheme, triton in (("kivi-4", 2), ("int8-token", 4)):  # + the quantize kernel of each side
        launching = [line for line in lines if line.startswith(f"kvbits {scheme}, fused, Triton launch, compiled only")]
        assert launching and f"+ {triton}.0 Triton" in launching[0], out.stdout[-2000:]



def test_host_overhead_stubbed_runs_stay_finite_past_a_lazy_check():
    """The stubbed runs' compiled-only quantize kernel writes nothing, so ``host_overhead.py`` runs the prompt (whose
    attention reads the K/V it flushes) before the stubs: with the prompt inside them, a run of more than 64 update
    steps had the lazy K/V check find the NaN that unwritten codes and scales had put into every later layer. One
    untimed flush block precedes the timed steps, so the first flush through a kernel is not timed."""
    code = """
import host_overhead
times = host_overhead.main(["--layers", "2", "--steps", "62", "--launch"])
print("TIMES", len(times), all(t[0] > 0 for t in times.values()))
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "TIMES 6 True" in out.stdout.splitlines(), out.stdout[-2000:]


def test_graph_blockers_name_what_changes_between_decode_steps(tmp_path):
    """``benchmarks/graph_blockers.py`` compares consecutive decode steps' operators and Triton launches (compiled for
    sm_90, not run): ``StaticCache`` launches the same work with the same arguments at every step, ``DynamicCache``
    grows its ``torch.cat``, and kvbits' fused step names its per-step changes: the buffer's append, the tail length
    in ``packed_store`` and the decode kernel, the lazy check's table row, and for a per-token scheme the quantize
    kernel's slot (a view whose storage offset moves). ``StaticQuantizedKVCache``'s steps, fused or not, change
    nothing from one to the next."""
    out_kivi, out_token = tmp_path / "kivi.json", tmp_path / "token.json"
    code = f"""
import graph_blockers
graph_blockers.main(["--layers", "1", "--steps", "6", "--json", {str(out_kivi)!r}])
graph_blockers.main(["--layers", "1", "--steps", "4", "--scheme", "int8-token", "--caches", "kvbits-fused",
                     "--json", {str(out_token)!r}])
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["cache"]: r for r in json.loads(out_kivi.read_text())}
    assert rows["static"]["same_sequence"] == rows["static"]["pairs"] == 5
    assert rows["static"]["varying_per_step"] == 0 and rows["static"]["host_reads"] == 0
    assert "transformers/cache_utils.py:update aten.cat.default" in rows["dynamic"]["varying_sites"]
    fused = rows["kvbits-fused"]
    assert fused["same_sequence"] == 5 and fused["host_reads"] == 0
    assert set(fused["varying_sites"]) == {
        "kvbits/cache/store.py:append_buffer aten.cat.default",
        "kvbits/cache/fused.py:packed_store aten.full.default",
        "kvbits/kernels/triton_decode.py:decode_attention_triton triton._decode_kernel",
        "kvbits/cache/checks.py:write_maxima aten.linalg_vector_norm.out",
    }, fused["varying_sites"]
    (token,) = json.loads(out_token.read_text())
    assert "kvbits/kernels/triton_quantize.py:quantize_pack_triton triton._quantize_kernel" in token["varying_sites"]
    for name in ("kvbits-static-fused", "kvbits-static"):  # StaticQuantizedKVCache: nothing varies, Triton launches included
        row = rows[name]
        assert row["scheme"] == "int4-token" and row["same_sequence"] == row["pairs"] == 5, row
        assert row["varying_per_step"] == 0 and row["host_reads"] == 0 and not row["varying_sites"], row
    assert rows["kvbits-static-fused"]["ops_per_step"] > 0


def test_graph_replay_emulation_tells_a_replayable_step_from_one_that_is_not(tmp_path):
    """``benchmarks/graph_replay.py`` records one decode step's operators with their tensors and replays them as a
    CUDA graph would (after writing the next token and position into the recorded inputs), beside eager decoding.
    ``StaticCache`` replays bit for bit at every step; ``DynamicCache``'s replay attends over the history it was
    recorded with, wrong from the first replayed step. kvbits' steps (kivi-4, fused through the torch reference, and
    dequantizing) read no host value in a step, as a capture requires, and do not replay: their appends and
    lengths are host sizes (``graph_blockers``). ``StaticQuantizedKVCache`` (fused, through the torch reference or
    Triton's kernels, and dequantizing) replays bit for bit, KIVI-4's flushes included."""
    out_json, out_triton, out_kivi = tmp_path / "replay.json", tmp_path / "triton.json", tmp_path / "kivi.json"
    code = f"""
import graph_replay
graph_replay.main(["--layers", "1", "--steps", "3", "--json", {str(out_json)!r}])
graph_replay.main(["--layers", "1", "--steps", "2", "--scheme", "int8-token", "--static-scheme", "int8-token",
                   "--caches", "kvbits-fused,kvbits-static-fused", "--kernel", "triton", "--json", {str(out_triton)!r}])
# KIVI-4 in fixed slabs: 30 replays from step 36 cross the flush at 320 tokens (a 256-token prompt)
graph_replay.main(["--layers", "1", "--steps", "30", "--static-scheme", "kivi-4", "--caches", "kvbits-static-fused",
                   "--json", {str(out_kivi)!r}])
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["cache"]: r for r in json.loads(out_json.read_text())}
    # the fused step as a GPU launches it: Triton's kernels
    triton_row, static_triton = json.loads(out_triton.read_text())
    assert triton_row["triton_launches"] > 0 and triton_row["host_reads"] == 0, triton_row
    assert triton_row["first_wrong_step"] == 1, triton_row
    # StaticQuantizedKVCache: its recorded step, Triton's launches included, replays bit for bit
    assert static_triton["cache"] == "kvbits-static-fused" and static_triton["triton_launches"] > 0, static_triton
    assert static_triton["first_wrong_step"] is None and static_triton["max_logit_diff"] == 0.0, static_triton
    for name in ("kvbits-static-fused", "kvbits-static"):
        assert rows[name]["first_wrong_step"] is None and rows[name]["max_logit_diff"] == 0.0, rows[name]
    (kivi,) = json.loads(out_kivi.read_text())  # a windowed scheme: its flush replayed from the same step
    assert kivi["scheme"] == "kivi-4" and kivi["host_reads"] == 0 and kivi["first_wrong_step"] is None, kivi
    assert rows["static"]["first_wrong_step"] is None and rows["static"]["max_logit_diff"] == 0.0
    assert rows["dynamic"]["first_wrong_step"] == 1 and rows["dynamic"]["max_logit_diff"] > 1e-3
    assert all(r["tape_ops"] > 50 and r["host_reads"] == 0 for r in rows.values()), rows
    for name in ("kvbits-fused", "kvbits-dequant"):
        assert rows[name]["first_wrong_step"] == 1, rows[name]


def test_graph_replay_reruns_operators_and_triton_launches_on_their_recorded_tensors():
    """The emulation itself: a replayed tape reads its inputs' new contents, an operator's fresh result reaches the
    tensor it returned when recorded (which a later entry reads), and a Triton launch (interpreted) runs again on
    its recorded arguments; a host read is counted."""
    code = """
from kvbits.kernels.interpret import enable_interpreter
enable_interpreter()
import torch, triton, triton.language as tl
from graph_replay import OpTape, replay, triton_on_tape

@triton.jit
def plus_one(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n) + 1.0, mask=i < n)

x, y = torch.zeros(8), torch.empty(8)
tape = OpTape()
with tape, triton_on_tape(tape):
    z = x * 2
    plus_one[(1,)](z, y, 8, BLOCK=8)
    seen = int(z.sum().item())
assert y.tolist() == [1.0] * 8 and seen == 0 and tape.launches == 1 and tape.host_reads == 1
x.fill_(3.0)
replay(tape)
assert z.tolist() == [6.0] * 8 and y.tolist() == [7.0] * 8, (z, y)
print("OK")
"""
    out = _run(code)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

def test_f16_dequant_compiles_without_int_to_float_conversions():
    """``dequant="f16"`` compiled for sm_90 (its inline ``lop3`` included, which the interpreter never runs):
    it launches without spills, its tile loop converts no integer to float (the magic-number codes) and
    issues fewer instructions per token than the default float32 path, at both benchmark shapes and 8, 4
    and 2 bits; ``maxnreg=128`` keeps at least the default's blocks per SM. Neither path's tile loop waits on
    a synchronous global load (``LDG``): scales and zero-points come as int32 words that ``cp.async``
    prefetches (``meta32``), where the 2-byte reads (``meta32=False``, checked at int4) left such loads in the
    loop."""
    code = """
import json, torch
from gpu_bench import common
from kvbits.kernels.aot import LIMITS, compile_only, hot_loop, resources
from kvbits.kernels.triton_decode import decode_attention_triton
rows = []
for shape_name, shp in common.SHAPES.items():
    for sch in ("int8", "int4", "int2"):
        store = common.random_store(2, shp, 4096, common.SCHEMES[sch], torch.device("cpu"), torch.Generator().manual_seed(0),
                                    lazy=True)
        q = torch.zeros(2, shp["H_q"], 1, shp["D"], dtype=torch.float16)
        paths = [("f32", {}), ("f16", {"dequant": "f16"}), ("r128", {"dequant": "f16", "maxnreg": 128})]
        if sch == "int4":  # the 2-byte reads kept for comparison: one width (each SASS dump takes ~0.7 s)
            paths += [("halves", {"meta32": False}), ("f16-halves", {"dequant": "f16", "meta32": False})]
        for label, kw in paths:
            with compile_only("sm_90") as ks:
                decode_attention_triton(q, store, splits=4, **kw)
            k = ks[0]
            r = resources(k)
            n, ops = hot_loop(k)
            asm = k.asm["ptx"].count("lop3.b32") if "f16" in label or label == "r128" else 0
            rows.append(dict(shape=shape_name, scheme=sch, path=label, per_token=n * r.num_warps / r.constants["BLOCK_T"],
                             conv=ops.get("I2F", 0) + ops.get("I2FP", 0), spill=r.local_bytes, lop3=asm,
                             sync_loads=ops.get("LDG", 0), async_loads=ops.get("LDGSTS", 0),
                             blocks=LIMITS["sm_90"].blocks_per_sm(r), fails=LIMITS["sm_90"].check(r)))
print(json.dumps(rows))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    by = {(r["shape"], r["scheme"], r["path"]): r for r in rows}
    assert len(by) == 2 * (3 * 3 + 2)
    for (shape, scheme, path), r in by.items():
        assert r["fails"] is None, r
        if path in ("halves", "f16-halves"):  # session 9's reads: synchronous 2-byte loads in the loop
            assert r["sync_loads"] > 0, r
            continue
        assert r["sync_loads"] == 0 and r["async_loads"] > 0, r
        if path == "f32":
            assert r["conv"] > 0  # the default path converts every code (I2FP)
            continue
        assert r["conv"] == 0 and r["lop3"] > 0, r
        assert r["per_token"] < 0.9 * by[(shape, scheme, "f32")]["per_token"], (r, by[(shape, scheme, "f32")])
        if path == "f16":
            assert r["spill"] == 0, r
        else:
            assert r["blocks"] >= by[(shape, scheme, "f32")]["blocks"], r


def test_kernel_cost_sets_the_issue_floor_beside_a_measured_time(tmp_path):
    """``benchmarks/kernel_cost.py``: from one measured record (the H200's Llama int4 cell at batch 32,
    128K), the cycles per token and SM, the compiled tile loop's issue floor and the issue rate between them."""
    results = tmp_path / "gpu_decode.json"
    results.write_text(json.dumps({"records": [
        {"kernel": "triton", "scheme": "int4", "shape": "llama-3-8b", "batch": 32, "context": 131072, "ms": 6.1923},
        {"kernel": "triton", "scheme": "int4", "shape": "llama-3-8b", "batch": 8, "context": 131072, "ms": 1.0},
    ]}))  # fmt: skip
    out = _run(f"import json, kernel_cost as kc; print(json.dumps(kc.issue_table(__import__('pathlib').Path('{results}'))))")
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["measured_cycles"] == round(6.1923e-3 * 1.98e9 / (32 * 8 * 131072 / 132), 1) == 48.2
    assert row["issue_floor_cycles"] == round(row["warp_instructions_per_token"] / 4, 1)
    assert row["warp_instructions_per_token"] == round(row["loop_instructions"] * 4 / row["block_t"], 1)
    assert 0 < row["issued_per_cycle"] < 4 and row["int_to_float"] > 0


def test_every_preset_builds_its_cache_store_for_the_resource_rows(monkeypatch):
    """``benchmarks/kernel_resources.py`` builds each preset's store through ``QuantizedKVCache`` with what a
    calibration installs: every preset gets a store or a reason the fused path skips it, none raises (the
    full run stopped at the centred / smoothed presets, whose channel vectors it did not install)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_resources as kr
    from gpu_bench import common

    from kvbits.schemes import list_schemes

    monkeypatch.setattr(kr, "PROMPT", 40)
    served = {}
    for s in list_schemes():
        store, why = kr.cache_store(s.name, common.SHAPES["qwen2.5-0.5b"])
        assert (store is None) != (why is None), s.name
        served[s.name] = store
    for name in ("int4-token-smooth", "int4-token-smooth-prerope", "kivi-4", "kvquant-4-block"):
        assert served[name] is not None, name
    assert served["int4-token-smooth-prerope"].key.channel_factor is not None


VLLM_INT8_WRITE = '''
import re, sys, torch, triton, triton.language as tl
from kvbits.kernels.aot import compile_only


@triton.jit
def vllm_int8_write(x_ptr, out_ptr, D: tl.constexpr):
    """The quantize-and-store of vLLM's int8_per_token_head write kernel (``_reshape_cache_per_token_head``),
    restated for one (token, head) row: a float32 value stored into an int8 cache."""
    offs = tl.arange(0, D)
    x = tl.load(x_ptr + offs).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)) / 127.0, 1e-6)
    q = tl.clamp(x * (1.0 / scale), -128.0, 127.0)
    tl.store(out_ptr + offs, q)


with compile_only("sm_90") as compiled:
    vllm_int8_write[(1,)](torch.zeros(128, dtype=torch.float16), torch.zeros(128, dtype=torch.int8), D=128)
print(" ".join(sorted(set(re.findall(r"cvt\\.[a-z0-9.]+\\.f32", compiled[0].asm["ptx"])))))
'''


def test_triton_stores_float_into_int8_by_truncating(tmp_path):
    """Why ``vllm-int8`` rounds its codes toward zero (``TensorSpec(rounding="trunc")``): vLLM's int8 write
    stores a float32 ``clamp(x * (1 / scale))`` into an int8 pointer with no rounding of its own, and Triton
    compiles that store cast for sm_90 as ``cvt.rzi`` (round toward zero), not ``cvt.rni`` (nearest)."""
    src = tmp_path / "vllm_int8_write.py"
    src.write_text(VLLM_INT8_WRITE)
    out = _run(f"import runpy; runpy.run_path({str(src)!r}, run_name='__main__')")
    assert out.returncode == 0, out.stderr[-3000:]
    cvts = out.stdout.split()
    assert any(c.startswith("cvt.rzi.s") for c in cvts) and not any(c.startswith("cvt.rni.s") for c in cvts), cvts


def test_fold_kernel_compiles_keys_scaled_over_fewer_than_16_tokens():
    """``fold_supported`` accepts keys scaled per channel over 8, 4 or 2 tokens, whose batched score dot is
    ``(R, TPS, W) @ (R, W, N)``: an ``M`` side under 16, under the MMA's. Triton 3.6 compiles it for sm_90 (it pads
    the side), so those stores are kept, not refused: each launch fits, at D = 64 INT4 without spills (D = 128 INT2
    over 2 tokens spills 2 KB: 64 scale rows per tile)."""
    code = """
import json, torch
from kvbits.kernels.aot import LIMITS, compile_only, resources
from kvbits.kernels.reference import pack_store
from kvbits.kernels.triton_fold import decode_attention_fold, fold_supported
from kvbits.quant import quantize
from kvbits.schemes import TensorSpec
rows = []
for tps in (8, 4, 2):
    g = torch.Generator().manual_seed(tps)
    k, v = torch.randn(2, 2, 64, 64, generator=g), torch.randn(2, 2, 64, 64, generator=g)
    ks = TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=tps, symmetric=tps == 2)
    vs = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=32)
    store = pack_store([quantize(k[:, :, a:a + 32], ks) for a in (0, 32)], [quantize(v[:, :, a:a + 32], vs) for a in (0, 32)])
    q = torch.zeros(2, 4, 1, 64, dtype=torch.float16)
    with compile_only("sm_90") as compiled:
        decode_attention_fold(q, store)
    r = resources(compiled[0])
    rows.append(dict(tps=tps, why=fold_supported(store, q), name=r.kernel, K_TPS=r.constants["K_TPS"],
                     spill=r.local_bytes, fails=LIMITS["sm_90"].check(r)))
print(json.dumps(rows))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["tps"] for r in rows] == [r["K_TPS"] for r in rows] == [8, 4, 2]
    for r in rows:
        assert r["why"] is None and r["name"] == "_fold_kernel" and r["fails"] is None and r["spill"] == 0, r


def test_fold_kernel_compiles_leaner_than_the_dequantizing_paths():
    """The folded-scale kernel (``triton_fold``) compiled for sm_90 with its inline PTX (which the interpreter
    never runs: ptxas assembles it here): at both benchmark shapes and 8, 4 and 2 bits, on the layouts it serves,
    it launches without spills (KIVI at D = 128: a few hundred bytes), converts no integer to float in its tile loop
    (the byte-permute conversion) and issues fewer instructions per token than the product kernel's float32 path
    (at Llama-3-8B's shape under 0.6 of them on per-token rows, 0.7 on KIVI's: BENCHMARKS.md §6, sessions 38-39);
    at head dims 16 to 256 its default launch fits."""
    code = """
import json, torch
from gpu_bench import common
from kvbits.kernels.aot import LIMITS, compile_only, hot_loop, resources
from kvbits.kernels.reference import PackedStore
from kvbits.kernels.triton_decode import decode_attention_triton
rows = []
def compiled(q, store, **kw):
    with compile_only("sm_90") as ks:
        decode_attention_triton(q, store, **kw)
    k = [c for c in ks if "reduce" not in c.name][0]
    r = resources(k)
    n, ops = hot_loop(k)
    return dict(name=k.name, per_token=n * r.num_warps / r.constants["BLOCK_T"], spill=r.local_bytes,
                conv=ops.get("I2F", 0) + ops.get("I2FP", 0), prmt=k.asm["ptx"].count("prmt.b32"),
                fails=LIMITS["sm_90"].check(r))
for shape_name, shp in common.SHAPES.items():
    for sch in ("int8", "int4", "int2"):
        for layout in ("token", "kivi"):
            store = common.random_store(8, shp, 32768, common.SCHEMES[sch], torch.device("cpu"),
                                        torch.Generator().manual_seed(0), lazy=True, layout=layout)
            q = torch.zeros(8, shp["H_q"], 1, shp["D"], dtype=torch.float16)
            for path, kw in (("f32", {}), ("fold", {"dequant": "fold"})):
                rows.append(dict(shape=shape_name, scheme=sch + "-" + layout, path=path, **compiled(q, store, **kw)))
for D in (16, 32, 256):
    shp = dict(H_kv=2, H_q=4, D=D)
    store = common.random_store(2, shp, 4096, common.SCHEMES["int8"], torch.device("cpu"), torch.Generator().manual_seed(0),
                                lazy=True, layout="token")
    rows.append(dict(shape=f"D{D}", scheme="int8", path="fold",
                     **compiled(torch.zeros(2, 4, 1, D, dtype=torch.float16), store, dequant="fold")))
print(json.dumps(rows))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    by = {(r["shape"], r["scheme"], r["path"]): r for r in rows}
    assert len(by) == 2 * 3 * 2 * 2 + 3
    for (shape, scheme, path), r in by.items():
        assert r["fails"] is None, r
        # KIVI's groups at D = 128 spill at the default 128-token tile, more since the keys' q * s is split in two
        # float16 halves (INT8 352 bytes, INT4 and INT2 8; 64-token tiles spill 56 / 8 / 0 at 70 / 67 / 79
        # warp-instructions per token against 52 / 46 / 53); everything else fits its registers
        kivi_d128 = path == "fold" and shape == "llama-3-8b" and scheme.endswith("kivi")
        assert r["spill"] == 0 or (kivi_d128 and r["spill"] <= 384), r
        if path != "fold":
            continue
        assert r["name"] == "_fold_kernel" and r["prmt"] > 0 and r["conv"] == 0, r
        if shape.startswith("D"):
            continue
        ratio = r["per_token"] / by[(shape, scheme, "f32")]["per_token"]
        # KIVI at Llama-3-8B's shape: 0.65 / 0.60 / 0.67 since the keys' q * s takes two dots (session 39)
        assert ratio < (0.6 if shape == "llama-3-8b" and scheme.endswith("token") else 0.7 if shape == "llama-3-8b"
                        else 1.0), (r, ratio)  # fmt: skip


def test_step_kernels_counts_what_graphed_decode_leaves_out(tmp_path):
    """``benchmarks/step_kernels.py``: one fused decode step of ``StaticQuantizedKVCache`` as a plain capture records
    it (the window's oldest block quantized at every step, the host's counts turned off) and as ``GraphedDecode``
    captures its plain variant (nothing quantized but a per-token scheme's token, the counts kept). KIVI-4's plain
    variant launches fewer kernels; ``int8-token``'s is the same step either way."""
    out_json = tmp_path / "kernels.json"
    code = f"""
import step_kernels
step_kernels.main(["kivi-4", "int8-token", "--layers", "1", "--kernel", "reference", "--json", {str(out_json)!r}])
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    kivi, int8 = json.loads(out_json.read_text())
    assert not kivi["plain_capture"]["host_counts"] and kivi["graphed_decode"]["host_counts"]
    assert kivi["graphed_decode"]["kernels"] < kivi["plain_capture"]["kernels"], kivi
    assert int8["graphed_decode"]["kernels"] == int8["plain_capture"]["kernels"] > 0, int8
    assert "| kivi-4 |" in out.stdout
