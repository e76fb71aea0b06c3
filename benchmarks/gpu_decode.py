"""Decode-attention speed on a GPU: the fused packed-cache Triton kernel vs fp16 SDPA.

    PYTHONPATH=src python benchmarks/gpu_decode.py   # H200, < 5 min -> benchmarks/results/gpu_decode.json
    PYTHONPATH=src python benchmarks/gpu_decode.py --smoke --device cpu   # seconds: interpreter + reference

Imports only torch, triton, transformers (5.17+, step 6 only, lazily) and kvbits (no installs on the
GPU machine). Steps:

0. (CUDA) the Triton kernels of steps 2-3b and 6 compiled on every CPU core at once (``prewarm.py``): the
   timed steps then load them from Triton's cache instead of compiling one by one inside the time budget.
1. device-to-device copy bandwidth (one large ``copy_``; CUDA events; median), counted as bytes read +
   bytes written: the practical ceiling of a memory-bound kernel (references.md, "Speed").
2. correctness of every kernel variant against a float64 reference on this GPU (flash-attention
   criterion: error <= 2x the error of plain torch at fp16), ``dequant="f16"`` variants (``*-f16``) and
   64-token tiles (``*-bt64``) included, and Hadamard-rotated per-token int8/int4 keys and values
   (``int8-token-hadamard``, ``int4-token-hadamard``: the presets' codes of ``x @ R``; the decode entry point
   rotates q and the tail into the codes' basis and the output back), judged against attention over the
   model's K/V (rotated sides dequantized back, not through that rotation), and per-token int4 keys centred
   and smoothed per channel (``int4-token-smooth``: codes of ``(k - mean) / factor``; the entry point scales q
   and moves the key tail into that basis), and the same keys before RoPE (``int4-token-smooth-pre-rope``:
   the kernel decodes ``code * factor + mean`` in registers, then applies RoPE; ``-tied``: factors equal over
   RoPE pairs, folded into q, the kernel decoding ``code + mean / factor``), judged the same way; a
   failure is recorded
   (``checks[].ok``, ``check_failures``) and printed, and the run goes on. (2b) the
   quantize-and-pack kernel against ``kvbits.quant.quantize``, bit for bit, and the time each takes to
   flush one 128-token block. (2c) a growing and a reserved ``int8-token`` cache through 2 layers of step 6's
   model, the same greedy decode after an odd prompt: logits bit for bit (``growing_vs_reserved``).
3. one decode step (``q (B, H_q, 1, D)``) for contexts 4K..128K and batch 1, 8, 32, with the KV shapes
   of Qwen2.5-0.5B (H_kv=2, H_q=14, D=64) and Llama-3-8B (H_kv=8, H_q=32, D=128):
   fp16 ``scaled_dot_product_attention`` (``enable_gqa=True``, and K/V expanded to H_q heads when that
   fits: the faster of the two is the baseline) vs the fused kernel at int8/int4/int2 (KIVI layout:
   keys per-channel in groups of 32 tokens, values per-token in groups of 32 channels, the last 128
   tokens in fp16), the same with pre-RoPE keys (``int8/int4/int2-prerope``: RoPE applied in the kernel
   from float32 half-width tables, as the cache keeps them; rows rotated in registers, and the gather
   path as ``triton-gather``), 4-bit NUQ with 1 % sparse outliers (KVQuant's codes) and FP8 e4m3 (per-token
   scales), each as a CUDA graph, L2 flushed before every rep, median of CUDA-event timings. The integer
   schemes also with ``dequant="f16"`` (codes dequantized in float16: kernel ``triton-f16``) and through the
   folded-scale kernel (``triton-fold``). Then, apart and while the sweep's time lasts (``split_sweep``), int4
   through the default and the folded kernel at 8 programs per SM instead of 2 (``triton-p8``, ``triton-fold-p8``)
   at every cell the sweep timed, against its fp16 baselines: the split count step 3b found faster at 32K and
   batch 8, its only point. At batch 8
   only (smoke: 1), both shapes, every context: int4 with keys and values per token (one scale per token and head, the
   ``int4-token`` preset's layout) and the same Hadamard-rotated (``int4-token-hadamard``: its time includes
   rotating q and the 128-token fp16 tail in and the output back; the same bytes, ``R`` is stored nowhere):
   their difference is what the rotation costs; and with keys centred and smoothed per channel
   (``int4-token-smooth``; before RoPE ``int4-token-smooth-prerope``, the mean and factor decoded in
   registers, and ``-tied``; stand-in channel vectors, the same bytes per token): what each costs.
4. achieved bandwidth = bytes of K/V + metadata read / time, as a fraction of the copy bandwidth (``None`` where
   step 1 failed: recorded under ``failures``, and the steps after it run).
   (3b) with the time left before step 6's share: ``block_t`` x ``num_warps`` of the kernel for int4 and
   int4-prerope, and ``block_t`` x ``num_stages`` for int4 with ``dequant="f16"`` (``int4-f16``, rows'
   ``dequant``), and int4 with session 9's 2-byte scale reads (``int4-halves``: ``meta32=False``, beside
   today's int32-word reads), at 32K, batch 8 (``tuning``), to choose its defaults.
5. break-even context per scheme (shortest measured context from which the kernel beats fp16).
6. end to end: greedy decode tokens/s after a 32K-token prompt through a random-weight model shaped like
   Qwen2.5-0.5B (24 layers, H_kv=2, H_q=14, D=64; fp16): ``DynamicCache`` (SDPA, as torch picks its backend and
   without cuDNN's, which builds a graph per sequence length: ``gpu_bench.e2e``) vs ``QuantizedKVCache``
   with the fused decode path (``use_fused_decode``: attention function ``kvbits_fused``; every decode
   step of every layer must be served by the kernel, else that run records a `failure`, the
   others go on and the script exits non-zero at the end) vs the same cache
   dequantizing into SDPA vs transformers' ``QuantizedCache`` (when one of its backends imports).
   ``QuantizedKVCache`` checks incoming K/V lazily on CUDA (``checks="auto"``, ``kvbits.cache.checks``):
   no host-device sync per decode step; the pending NaN/inf check (one sync for all layers) runs every
   64 steps and in ``memory_report()`` after the timed steps. The CPU smoke run checks eagerly.
   Memory: the bytes each cache holds on the GPU after its run (``torch.cuda.memory_allocated`` minus
   before it was made; a CUDA-graph run's graphs freed first, what they held is ``graph_bytes``) against ``kvbits.plan`` for the same model, batch and tokens (``fused_decode=True``
   for the fused runs: pre-RoPE keys' float32 RoPE tables included, ``rope_table_bytes`` held), and what
   the cache holds beside its K/V that no plan counts (``extra_bytes``: position offsets, workspace).

Time: ``--budget-s`` (default 290 s: the issue's "one run of under 5 minutes", with room on a 15-minute device
lease for a second run): sweep combos stop starting 90 s before it (step 6's share), step 6's
runs at it; whatever did not run is listed under ``skipped`` / ``e2e[].skipped``. The JSON is rewritten
after every step and sweep combo (``"complete": false`` until the end), so a killed run keeps its figures.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the steps (gpu_bench/), prewarm.py: beside this file

import _provenance
from gpu_bench.checks import check_and_time_quantize, check_variants
from gpu_bench.common import (
    BATCHES,
    CONTEXTS,
    KEY_GROUP,
    RESIDUAL,
    TOKEN_SCHEMES,
    VALUE_GROUP,
    Config,
    copy_bandwidth,
    guarded,
    rotation_batch,
)
from gpu_bench.e2e import (
    E2E_BATCHES,
    E2E_CONTEXT,
    E2E_TOKENS,
    E2E_WARMUP,
    GROWING_CHECK,
    end_to_end,
    growing_vs_reserved,
    wanted_runs,
)
from gpu_bench.report import markdown
from gpu_bench.sweep import SPLIT_PROGRAMS_PER_SM, break_even, split_sweep, sweep, sweep_contexts, tune

from kvbits.kernels.reference import decode_attention_reference

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_decode.json"
FORMAT_VERSION = 1


def _decoder(cfg: Config) -> Callable | None:
    """The quantized-path implementation to time: the Triton kernel or the torch reference."""
    if cfg.kernel == "reference":
        return lambda q, store, **kw: decode_attention_reference(q, store)
    if cfg.device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    from kvbits.kernels.triton_decode import decode_attention_triton
    from kvbits.kernels.triton_fold import decode_attention_fold

    def decode(q: torch.Tensor, store: Any, dequant: str = "f32", **kw: Any) -> torch.Tensor:
        """``decode_attention_triton``; ``dequant="fold"`` straight to the folded kernel, so that a variant named
        fold never times the float32 path it would fall back to (a failure is the variant's error)."""
        if dequant == "fold":
            return decode_attention_fold(q, store, **kw)
        return decode_attention_triton(q, store, dequant=dequant, **kw)

    return decode


def _prewarm(device: torch.device, timeout_s: float, e2e: bool = True) -> dict:
    """Step (0): compile the kernels of steps 2-3b and (``e2e``) 6 on every CPU core first (``prewarm.py``), so
    that the timed steps find them in Triton's cache instead of compiling one by one inside the time budget."""
    major, minor = torch.cuda.get_device_capability(device)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count  # _num_splits' target
    print(f"(0) compiling the kernels for sm_{major}{minor} on all CPU cores (prewarm.py, at most {timeout_s:.0f} s)")
    try:
        from prewarm import jobs, prewarm

        job_list = [j for j in jobs() if e2e or j[0] != "e2e"]
        result = prewarm(f"sm_{major}{minor}", programs, job_list, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - only a head start: the steps compile what they need anyway
        result = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"  {result}")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument(
        "--kernel",
        choices=("auto", "triton", "reference"),
        default="auto",
        help="quantized path to time (auto: triton on CUDA, reference on CPU)",
    )
    p.add_argument(
        "--check",
        choices=("auto", "yes", "no"),
        default="auto",
        help="run the correctness step (auto: whenever Triton is used)",
    )
    p.add_argument("--max-gb", type=float, default=40.0, help="skip combos whose fp16 K/V exceed this")
    p.add_argument(
        "--e2e", choices=("yes", "no", "only"), default="yes", help="step 6 (only: skip steps 2-5)"
    )
    p.add_argument("--e2e-context", type=int, default=None, help="prompt tokens (default 32768; smoke 256)")
    p.add_argument(
        "--e2e-batch", type=int, action="append", default=None, help="repeatable (default 1 and 8)"
    )
    p.add_argument("--e2e-tokens", type=int, default=None, help="timed decode steps (default 32; smoke 4)")
    p.add_argument(
        "--e2e-runs", default=None, help="comma-separated step-6 runs, cache or cache:scheme (default: all but "
        "static-fp16-graphs, transformers' StaticCache decoded through CUDA graphs), e.g. "
        "dynamic-fp16,dynamic-fp16-no-cudnn,kvbits-fused:kivi-4,hf-quantized-quanto,static-fp16-graphs",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--prewarm-s",
        type=float,
        default=120.0,
        help="CUDA + Triton: compile the kernels in parallel first, for at most this long (0: off)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=290.0,
        help="wall-clock budget: sweep combos stop starting at budget - 90 s (e2e's share), e2e runs at the "
        "budget; what was skipped is listed (default 290; results are written after every combo)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; run with --device cpu (add --smoke for a quick check)")
    kernel = args.kernel if args.kernel != "auto" else ("triton" if device.type == "cuda" else "reference")
    only = args.e2e_runs.split(",") if args.e2e_runs else None
    try:
        wanted_runs(only)  # a misspelt run fails here, not after the steps before 6
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    cfg = Config(
        device=device,
        contexts=[256, 512] if args.smoke else list(CONTEXTS),
        batches=[1] if args.smoke else list(BATCHES),
        reps=1 if args.smoke else 30,
        warmup=1 if args.smoke else 5,
        max_bytes=args.max_gb * 1e9,
        smoke=args.smoke,
        kernel=kernel,
    )
    t0 = time.time()
    e2e_share = 90.0 if args.e2e != "no" else 0.0
    cfg.deadline = time.monotonic() + max(0.0, args.budget_s - e2e_share)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
    }
    if device.type == "cuda":  # the limits benchmarks/kernel_resources.py assumed for sm_90 (kvbits.kernels.aot)
        props = torch.cuda.get_device_properties(device)
        env["capability"] = f"sm_{props.major}{props.minor}"
        for key in ("multi_processor_count", "shared_memory_per_block_optin", "shared_memory_per_multiprocessor",
                    "regs_per_multiprocessor", "max_threads_per_multi_processor", "L2_cache_size"):  # fmt: skip
            env[key] = getattr(props, key, None)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    print(f"# gpu_decode: {env}")
    result = {
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": _provenance.commit(),
        "complete": False,  # True once every step ran; a killed run leaves what it had measured
        "smoke": cfg.smoke,
        "env": env,
        "budget_s": args.budget_s,
        "copy_gbps": None,
        "layout": {
            "key": f"per-channel, {KEY_GROUP}-token groups",
            "value": f"per-token, {VALUE_GROUP}-channel groups",
            "residual_fp16": RESIDUAL,
            "token_schemes": f"{', '.join(TOKEN_SCHEMES)}: keys and values per token (one scale per token and "
            f"head; -smooth: keys centred and smoothed per channel, stand-in vectors), the same fp16 tail; "
            f"batch {rotation_batch(cfg.batches)} only",
        },
        "prewarm": None,
        "checks": [],
        "check_failures": [],
        "quantize": [],
        "growing_vs_reserved": None,
        "failures": [],
        "records": [],
        "skipped": [],
        "tuning": [],
        "break_even": [],
        "e2e": [],
        "seconds": None,
    }

    def save(**fields) -> None:
        result.update(fields, seconds=round(time.time() - t0, 1))
        _provenance.write_json(args.out, result)  # atomic: a run killed during a save keeps the previous one

    save()  # the environment first: a step before the first figures (prewarm, copy bandwidth) may fail or hang
    failures: list[dict] = []  # steps that raised: recorded, and the run goes on to the next step (guarded)

    if kernel == "triton" and device.type == "cuda" and args.prewarm_s > 0:
        save(prewarm=_prewarm(device, args.prewarm_s, e2e=args.e2e != "no"))
    # guarded like the steps after it (a 4 GiB copy may not fit): without it the fractions of copy are None
    copy_gbps = guarded("(1) copy bandwidth", lambda: copy_bandwidth(cfg), failures)
    save(copy_gbps=None if copy_gbps is None else round(copy_gbps, 1), failures=failures)
    if copy_gbps is not None:
        print(f"(1) copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    run_check = args.check == "yes" or (args.check == "auto" and env["triton"] is not None)
    records: list[dict] = []
    if run_check and args.e2e != "only":
        print("(2) correctness vs float64")
        check_cfg = Config(**{**cfg.__dict__, "kernel": "triton"})
        checks = guarded("(2) checks", lambda: check_variants(check_cfg, _decoder(check_cfg)), failures)
        if checks is not None:
            save(checks=checks, check_failures=[f"{c['variant']} on {c['shape']}" for c in checks if not c["ok"]])
        print("(2b) quantize-and-pack kernel vs kvbits.quant.quantize (bit for bit), flush time")
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        quantized = guarded("(2b) quantize", lambda: check_and_time_quantize(cfg, flush), failures)
        save(quantize=quantized or [], failures=failures)
        print("(2c) a growing and a reserved cache, the same greedy decode: logits bit for bit")
        small = {"context": 37, "tokens": 2} if cfg.smoke else {}  # the interpreter: a short prompt, two steps
        grow = guarded("(2c) growing vs reserved", lambda: growing_vs_reserved(check_cfg, **{**GROWING_CHECK, **small}),
                       failures)  # fmt: skip
        save(growing_vs_reserved=grow, failures=failures)
        if grow is not None:
            print(f"  {grow['scheme']} B={grow['batch']} prompt {grow['context']}, {grow['tokens']} steps: logits "
                  f"bit-identical {grow['logits_bit_identical']} (max diff {grow['logits_max_diff']:.3g}, first at "
                  f"step {grow['first_diff_step']}), greedy tokens equal {grow['greedy_tokens_equal']}")  # fmt: skip
    # the quantized path's import (Triton, its interpreter) guarded too: its raise skipped step 6 with the sweep
    failed_before = len(failures)
    decode = guarded("(3) decoder", lambda: _decoder(cfg), failures) if args.e2e != "only" else None
    if args.e2e != "only" and len(failures) == failed_before:
        print(f"(3) decode attention sweep ({kernel}), combos start until {args.budget_s - e2e_share:.0f} s")
        # each step guarded (a raise is recorded under failures and the next step runs); the rows a step had
        # handed to its progress callback before it raised are kept (the saves below would otherwise drop them)
        timed: dict[str, list[dict]] = {"sweep": [], "split": []}
        intended = sweep_contexts(cfg)  # a context of these with no row for a key: its break-even is not read across

        def timed_so_far(step: str, before: list[dict]) -> Callable[[list[dict]], None]:
            def progress(rows: list[dict]) -> None:
                timed[step] = list(rows)
                save(records=before + timed[step], break_even=break_even(before + timed[step], intended))

            return progress

        swept = guarded("(3) sweep", lambda: sweep(cfg, decode, copy_gbps, timed_so_far("sweep", []),
                                                   result["skipped"]), failures)  # fmt: skip
        records = timed["sweep"] if swept is None else swept
        if kernel == "triton":
            print(f"(3) and int4 at {SPLIT_PROGRAMS_PER_SM} programs per SM (the default aims at 2) in every cell, "
                  "while the sweep's time lasts")  # fmt: skip
            before = records
            split = guarded("(3) split sweep", lambda: split_sweep(cfg, decode, copy_gbps, before,
                                                                   timed_so_far("split", before)), failures)  # fmt: skip
            records = before + (timed["split"] if split is None else split)
            print("(3b) kernel launch parameters (block_t x num_warps), while the sweep's time lasts")
            guarded("(3b) tuning", lambda: tune(cfg, decode, copy_gbps, lambda rows: save(tuning=list(rows))), failures)
    be = break_even(records, sweep_contexts(cfg))
    save(records=records, break_even=be, failures=failures)
    e2e: list[dict] = []
    if args.e2e != "no":
        cfg.deadline = time.monotonic() + max(0.0, args.budget_s - (time.time() - t0))
        context = args.e2e_context or (256 if cfg.smoke else E2E_CONTEXT)
        batches = args.e2e_batch or ([1] if cfg.smoke else list(E2E_BATCHES))
        tokens = args.e2e_tokens or (4 if cfg.smoke else E2E_TOKENS)
        print(f"(6) end to end: decode after a {context}-token prompt, batches {batches}")
        e2e_rows: list[dict] = []  # the rows step 6 had handed to progress, kept if it raises (building its model)

        def e2e_progress(rows: list[dict]) -> None:
            e2e_rows[:] = rows
            save(e2e=rows)

        e2e = guarded("(6) end to end", lambda: end_to_end(cfg, context, batches, tokens, warmup=1 if cfg.smoke else
                                                           E2E_WARMUP, progress=e2e_progress, only=only), failures)  # fmt: skip
        e2e = e2e_rows if e2e is None else e2e
    failures += [{"step": "(6) " + r["cache"], "error": r["failure"]} for r in e2e if "failure" in r]
    save(e2e=e2e, failures=failures, complete=True)
    print(markdown(records, be, copy_gbps, e2e))
    print(f"\nwrote {args.out} in {time.time() - t0:.0f} s")
    if failures:  # after every step ran and the figures were written
        raise SystemExit(f"{len(failures)} step(s) failed: " + "; ".join(f"{f['step']}: {f['error']}" for f in failures))
    return result


if __name__ == "__main__":
    main()
