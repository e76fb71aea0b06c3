"""Compile ``gpu_decode.py``'s Triton kernels before it times them, on every CPU core at once.

Triton compiles a kernel the first time a launch brings a new specialisation, one after another, and keeps
the result in its on-disk cache (``~/.triton/cache``, or ``TRITON_CACHE_DIR``) under a key made of the
kernel's source, its specialisation (argument types, pointer alignment, integers equal to 1 or divisible
by 16, constexprs), its options, the target and the Triton/ptxas versions: nothing of the process.
``prewarm(arch)`` compiles, in worker processes under ``kvbits.kernels.aot.compile_only`` (nothing runs on
the GPU), the launches the benchmark is about to make, so that its timed steps find them in that cache
instead of spending the run's time budget compiling:

- ``sweep``: each decode variant at each KV shape (default launch, gather path, float16 dequantization), at
  every batch and context of the sweep (zero-stride stores: shapes and alignment without the memory; a
  worker compiles each distinct specialisation once); the per-token layouts at ``ROTATION_BATCH``: plain
  (``int4-token``), Hadamard-rotated (``int4-token-hadamard``: the query enters float32, split in the kernel,
  ``Q_SPLIT``, and the output is reduced into float32 and rotated back), and the centred / smoothed keys, post-
  and pre-RoPE, untied and tied;
- ``tune``: step 3b's grids (``sweep.tune_launches``, float32 and float16 dequantization) at its batch and
  context;
- ``check``: step 2's correctness variants, per shape (the worker returns the reference's output so the
  step's own accuracy gate passes while it compiles);
- ``quantize``: step 2b's append layouts at its Llama-3-8B block shape;
- ``growing``: step 2c's growing and reserved caches (``e2e_launches`` at that step's sizes, no warm-up steps);
- ``e2e``: step 6's fused runs, one per scheme and batch: ``e2e_launches`` drives the benchmark's own
  cache and decode loop through a model with step 6's KV shape, in float16 as on the GPU (2 layers: the
  others launch the same kernels), its prefill attention left out (see there).

Decode launches split the context over ``target_programs`` programs (2 per SM of the device): the
parent passes the device's number, since the split counts reach the kernels too. Workers are spawned
(the parent may hold a CUDA context); a job that fails only loses its head start: the benchmark compiles
it when it gets there.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

Job = tuple  # ("sweep", shape, variant, rope, path) | ("tune", shape, rope, dequant, block_t, warps, stages)
#              | ("check", shape) | ("quantize", spec name) | ("e2e", scheme, batch, context, tokens, warmup[, reserve])
#              | ("growing", scheme, batch, context, tokens, reserve)  (step 2c)
#              | ("autotune", shape, layout, batch, context, candidate name)  (autotune_decode.py)
# path: None (default launch), False (gather path, vectorized=False), "f16" (dequant="f16"), "fold" (dequant="fold")
#       or "rounded" (row_keys=False: per-token keys dequantized and rounded, not K_ROWS);
# dequant: a sweep.TUNE_DEQUANT key ("f32", "f16", "f16-r128", "f32-halves"; sweep.TUNE_CASES)
SWEEP_PATHS: dict[Any, dict[str, Any]] = {None: {}, False: {"vectorized": False}, "f16": {"dequant": "f16"},
                                          "fold": {"dequant": "fold"}, "rounded": {"row_keys": False}}


def jobs(tune: bool = True) -> list[Job]:
    """Every launch group of the benchmark's steps 2, 2b, 2c, 3, (``tune``) 3b and 6, longest first."""
    from gpu_bench import checks, common, e2e, sweep

    out: list[Job] = [("check", shape) for shape in common.SHAPES]  # check_variants' variants: start these first
    # the per-token layouts (the rotated one's split query is another specialisation than the plain one's)
    token = [(name, ts.pre_rope) for name, ts in common.TOKEN_SCHEMES.items()]
    for shape in common.SHAPES:
        out.append(("sweep", shape, "fp16", False, None))
        for name, sch in common.SCHEMES.items():
            out.append(("sweep", shape, name, False, None))
            if sch[0] == "int":
                out += [("sweep", shape, name, False, False), ("sweep", shape, name, False, "f16")]
            if common.fold_reads(sch):
                out.append(("sweep", shape, name, False, "fold"))
        for name in common.PRE_ROPE:
            out += [("sweep", shape, name, True, None), ("sweep", shape, name, True, False)]
        out += [("sweep", shape, name, rope, None) for name, rope in token]
        out += [("sweep", shape, name, False, "fold") for name, ts in common.TOKEN_SCHEMES.items() if not ts.pre_rope]
        out.append(("sweep", shape, sweep.ROUNDED_KEYS, False, "rounded"))
    out += [("quantize", name) for name in checks.QUANTIZE_SPECS]
    # step 2c (a growing and a reserved cache, the same decode): step 6's run at its own sizes
    g = e2e.GROWING_CHECK
    out += [("growing", g["scheme"], g["batch"], g["context"], g["tokens"], reserve) for reserve in (False, True)]
    out += [("e2e", scheme, batch, e2e.E2E_CONTEXT, e2e.E2E_TOKENS, e2e.E2E_WARMUP)
            for batch in e2e.E2E_BATCHES for scheme in e2e.E2E_KVBITS]  # fmt: skip
    out += [("e2e", scheme, batch, e2e.E2E_CONTEXT, e2e.E2E_TOKENS, e2e.E2E_WARMUP, False)
            for batch in e2e.E2E_BATCHES for scheme in e2e.E2E_GROWING]  # fmt: skip
    if tune:
        for shape in common.SHAPES:  # round robin over step 3b's cases, as it times them: nearest first
            cases = [[("tune", shape, rope, dequant, *launch)
                      for launch in sweep.tune_launches(common.SHAPES[shape]["D"], dequant)]
                     for _scheme, rope, dequant in sweep.TUNE_CASES]  # fmt: skip
            out += [c[i] for i in range(max(map(len, cases))) for c in cases if i < len(c)]
    return out


def _run_job(job: Job, programs: int) -> None:
    """One job's launches, on CPU tensors, inside ``compile_only`` (set up by the caller); decode launches
    aim at ``programs`` programs (``decode_attention_triton(target_programs=...)``), as on the device."""
    import torch
    from gpu_bench import checks, common, sweep

    from kvbits.kernels.reference import decode_attention_reference
    from kvbits.kernels.triton_decode import decode_attention_triton

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    kind = job[0]
    if kind in ("sweep", "tune"):
        shape = common.SHAPES[job[1]]
        store_kw: dict[str, Any] = {}
        if kind == "sweep":
            name, rope, path = job[2], job[3], job[4]
            kw: dict[str, Any] = dict(SWEEP_PATHS[path])
            combos = [(b, t) for b in common.BATCHES for t in common.CONTEXTS]
            if name in common.TOKEN_SCHEMES:  # per-token layout (rotated: code_basis around the same kernel)
                ts = common.TOKEN_SCHEMES[name]
                scheme = common.SCHEMES[ts.codes]
                store_kw = {"layout": "token", "rotate": ts.rotate, "channels": ts.channels}
                combos = [(common.ROTATION_BATCH, t) for t in common.CONTEXTS]
            else:
                scheme = None if name == "fp16" else common.SCHEMES[name]
        else:
            rope, dequant, (block_t, warps, stages) = job[2], job[3], job[4:]
            scheme, kw = common.SCHEMES["int4"], {"block_t": block_t, "num_warps": warps, "num_stages": stages}
            kw.update(sweep.TUNE_DEQUANT[dequant])  # as sweep.tune passes it
            combos = [(sweep.TUNE_BATCH, sweep.TUNE_CONTEXT)]
        for batch, context in combos:  # the same specialisation compiles once (Triton's in-process cache)
            tables = common.lazy_view((context, shape["D"] // 2), torch.float32, cpu) if rope else None
            store = common.random_store(batch, shape, context, scheme, cpu, gen, (tables, tables) if rope else None,
                                        lazy=True, **store_kw)  # fmt: skip
            q = torch.zeros(batch, shape["H_q"], 1, shape["D"], dtype=torch.float16)
            decode_attention_triton(q, store, target_programs=programs, **kw)
    elif kind == "check":
        cfg = common.Config(device=cpu, contexts=[], batches=[], reps=1, warmup=0, max_bytes=0.0, smoke=False,
                            kernel="triton")  # fmt: skip

        def compile_then_reference(q: torch.Tensor, store: Any, **kw: Any) -> torch.Tensor:
            decode_attention_triton(q, store, target_programs=programs, **kw)  # compiled, not run
            return decode_attention_reference(q, store)

        checks.check_variants(cfg, compile_then_reference, shapes=[job[1]])
    elif kind == "autotune":  # autotune_decode.py: one candidate launch of one case (real stores: random data)
        from autotune_decode import make_case

        from kvbits.kernels import autotune

        shape, layout, batch, context, name = job[1:]
        (cand,) = [c for c in autotune.CANDIDATES if c.name == name]
        q, store = make_case(shape, layout, batch, context, cpu, lazy=True)
        decode_attention_triton(q, store, **{"target_programs": programs, **cand.kwargs(q.shape[-1], programs // 2)})
    elif kind == "quantize":
        from kvbits.kernels.triton_quantize import quantize_pack_triton

        x, kw = checks.quantize_stand_in(job[1])
        quantize_pack_triton(x, checks.QUANTIZE_SPECS[job[1]], **kw)
    elif kind == "e2e":
        e2e_launches(*job[1:], programs=programs)
    elif kind == "growing":  # step 2c: no warm-up steps
        scheme, batch, context, tokens, reserve = job[1:]
        e2e_launches(scheme, batch, context, tokens, 0, reserve, programs=programs)
    else:
        raise ValueError(f"unknown prewarm job {job!r}")


def e2e_launches(scheme: str, batch: int, context: int, tokens: int, warmup: int, reserve: bool = True, *,
                 programs: int, stub_prefill: bool = True) -> None:  # fmt: skip
    """Step 6's fused run of ``scheme`` at ``batch`` on CPU tensors, for ``compile_only``: the benchmark's
    own ``kvbits_cache`` and ``decode_run`` (prefill of ``context`` tokens, ``warmup + tokens`` decode
    steps) through a float16 model with step 6's KV shape, settings resolved as on CUDA (the Triton
    kernels, ``KVBITS_KERNEL=triton``; lazy K/V checks; splits aimed at ``programs`` programs).

    ``stub_prefill``: the prefill's attention (SDPA over ``context`` tokens, quadratic on a CPU) returns
    zeros; it launches no Triton kernel, and the cache still stores the whole prompt (a test checks that
    the compiled kernels are the same either way). Outputs of the kernels are never written (nothing
    runs), so the tokens are meaningless; only the launches count.
    """
    import torch
    from gpu_bench import common, e2e
    from transformers import AttentionInterface

    import kvbits.kernels.triton_decode as td
    from kvbits.cache import use_fused_decode
    from kvbits.kernels.dispatch import KERNEL_ENV

    num_splits = td._num_splits
    sdpa = AttentionInterface._global_mapping["sdpa"]
    kernel_env = os.environ.get(KERNEL_ENV)

    def zeros_for_prefill(module, query, key, value, attention_mask, **kw):  # (B, q, H_q, D), as SDPA's
        if query.shape[2] == 1:
            return sdpa(module, query, key, value, attention_mask, **kw)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    os.environ[KERNEL_ENV] = "triton"
    td._num_splits = lambda store, device, target: num_splits(store, device, target or programs)
    if stub_prefill:
        AttentionInterface._global_mapping["sdpa"] = zeros_for_prefill
    try:
        # smoke: the model of step 6's CPU run, with step 6's KV shape in 2 layers
        cfg = common.Config(device=torch.device("cpu"), contexts=[], batches=[], reps=1, warmup=0, max_bytes=0.0,
                            smoke=True, kernel="triton")  # fmt: skip
        model = e2e.e2e_model(cfg, context, tokens, dtype=torch.float16)
        use_fused_decode(model)
        # the run's reservation (e2e_reserve): the kernels see the same slot counts as in step 6
        max_cache_len = e2e.e2e_reserve(context, tokens, warmup) if reserve else None
        cache = e2e.kvbits_cache(model, scheme, fused=True, checks="lazy", max_cache_len=max_cache_len)
        ids = torch.zeros(batch, context, dtype=torch.long)
        e2e.decode_run(cfg, model, cache, ids, tokens, warmup, profile=False)
    finally:
        td._num_splits = num_splits
        AttentionInterface._global_mapping["sdpa"] = sdpa
        if kernel_env is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = kernel_env


def _work(task: tuple[str, int, Job]) -> tuple[Job, float, str | None]:
    """Worker: compile one job's launches for ``(arch, programs, job)``; ``(job, seconds, error or None)``."""
    import contextlib
    import io

    from kvbits.kernels.aot import compile_only

    arch, programs, job = task
    t0 = time.monotonic()
    try:
        with compile_only(arch), contextlib.redirect_stdout(io.StringIO()):
            _run_job(job, programs)
    except Exception as exc:  # noqa: BLE001 - reported; the benchmark compiles this job itself later
        return job, time.monotonic() - t0, f"{type(exc).__name__}: {str(exc)[:200]}"
    return job, time.monotonic() - t0, None


def prewarm(arch: str, programs: int, job_list: list[Job] | None = None, processes: int | None = None,
            timeout_s: float = 120.0) -> dict:  # fmt: skip
    """Compile ``job_list`` (default ``jobs()``) for ``arch`` (``"sm_90"``) with decode launches aimed at
    ``programs`` programs (2 per SM of the device) in ``processes`` spawned workers (default: the CPU
    count, at most 16) within ``timeout_s``; returns ``{"arch", "jobs", "done", "failed", "seconds"}``
    (``failed``: ``[(job, error)]``; jobs not done by the timeout are abandoned, not failed)."""
    from kvbits.kernels.aot import LIMITS

    if arch not in LIMITS:
        return {"arch": arch, "jobs": 0, "done": 0, "failed": [], "seconds": 0.0,
                "skipped": f"no limits for {arch} in kvbits.kernels.aot"}  # fmt: skip
    job_list = jobs() if job_list is None else job_list
    processes = processes or min(16, os.cpu_count() or 1)
    t0 = time.monotonic()
    done, failed = 0, []
    env_interp = os.environ.pop("TRITON_INTERPRET", None)  # workers compile; they inherit the environment
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(processes)
    try:
        results = pool.imap_unordered(_work, [(arch, programs, job) for job in job_list])
        for _ in job_list:
            job, _seconds, error = results.next(timeout=max(0.1, t0 + timeout_s - time.monotonic()))
            done += error is None
            if error is not None:
                failed.append((list(job), error))
    except multiprocessing.TimeoutError:
        pass  # what is compiled is in the cache; the benchmark compiles the rest itself
    finally:
        pool.terminate()
        pool.join()
        if env_interp is not None:
            os.environ["TRITON_INTERPRET"] = env_interp
    return {"arch": arch, "jobs": len(job_list), "done": done, "failed": failed,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
