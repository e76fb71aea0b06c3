"""The decode autotuner (``kvbits.kernels.autotune``, ``KVBITS_AUTOTUNE=on``) on a GPU: which launch it picks per
case, and that launch's time beside the default launch's and fp16 SDPA's, timed as ``gpu_decode.py`` times
(``gpu_bench.common.time_ms``: CUDA graph replay, L2 flushed before every rep, median).

    PYTHONPATH=src python3 benchmarks/autotune_decode.py --out $OUT/autotune_decode.json   # H200, < 4 min
    PYTHONPATH=src python benchmarks/autotune_decode.py --smoke --device cpu   # Triton's interpreter, ~20 s

Cases: both KV shapes of ``gpu_decode.py`` (Qwen2.5-0.5B, Llama-3-8B) x int4 in the KIVI layout and per token
(``int4-token``: one scale per token and head, keys entering the dots as codes) x batch 1 and 8 x 32K and 128K
context, random data (not zero-stride views: the tuner compares each candidate's output with the default
launch's). On CUDA, every candidate launch of every case is first compiled on all CPU cores at once
(``prewarm.py``'s ``autotune`` jobs, ``--prewarm-s``), so the tuner's first call finds them in Triton's cache.
Each case: a fresh ``DecodeTuner`` (no tuning file) tunes on the case's inputs (its own quick timings, ``tuner_ms``),
then the default launch, the chosen one and SDPA are timed. Rows go to ``--out`` after every case (``complete``:
false until the end); cases not started by ``--budget-s`` are listed under ``skipped``. A case that raises (its
default launch failing, out of memory) is recorded under ``failures`` (``{"step", "error"}``, as ``gpu_decode.py``
records its steps) and the next case runs; so does a prewarm that raises (under ``prewarm``: ``{"error"}``). The
script exits non-zero after the last save when any case failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _provenance
from gpu_bench import common
from gpu_bench.sweep import fp16_baselines

from kvbits.kernels import autotune

RESULTS = Path(__file__).resolve().parent / "results" / "autotune_decode.json"
CASES = [(shape, layout) for shape in common.SHAPES for layout in ("kivi", "token")]
BATCHES, CONTEXTS = (1, 8), (32768, 131072)
SMOKE_CANDIDATES = ("default", "f16", "fold")


def make_case(shape_name: str, layout: str, batch: int, context: int, device: torch.device, seed: int = 0,
              lazy: bool = False) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """``(q (B, H_q, 1, D) float16, store)``: random int4 codes and scales in ``layout`` (``common.random_store``;
    ``lazy``: zero-stride views, the shapes without the memory, for compiling)."""
    shape = common.SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    store = common.random_store(batch, shape, context, common.SCHEMES["int4"], device, gen, lazy=lazy, layout=layout)
    q = torch.randn(batch, shape["H_q"], 1, shape["D"], device=device, dtype=torch.float16, generator=gen)
    return q, store


def autotune_jobs(cases: list[tuple[str, str]], batches: tuple[int, ...], contexts: tuple[int, ...],
                  names: tuple[str, ...]) -> list[tuple]:  # fmt: skip
    """``prewarm.py`` jobs: every candidate launch of every case."""
    return [("autotune", shape, layout, b, t, name) for shape, layout in cases for b in batches for t in contexts
            for name in names]  # fmt: skip


def run_case(case: dict, candidates: tuple, cfg: common.Config, flush: torch.Tensor | None, rounds: int) -> dict:
    """Tune one case with a fresh ``DecodeTuner``, then time the default launch, the chosen one and fp16 SDPA."""
    from kvbits.kernels.triton_decode import decode_attention_triton

    device = cfg.device
    q, store = make_case(case["shape"], case["layout"], case["batch"], case["context"], device)
    tuner = autotune.DecodeTuner(None, candidates=candidates, rounds=rounds)
    tuning = tuner.tune(q, store)
    kw = tuner.kwargs_for(tuner.candidates[tuning.launch], q)
    default_kw = tuner.kwargs_for(tuner.default, q)
    ms_default, _ = common.time_ms(lambda: decode_attention_triton(q, store, **default_kw), cfg, flush)
    ms_tuned = ms_default
    if kw != default_kw:
        ms_tuned, _ = common.time_ms(lambda: decode_attention_triton(q, store, **kw), cfg, flush)
    base = fp16_baselines(cfg, q, store.n_kv_heads, case["context"], torch.Generator(device=device).manual_seed(1),
                          flush)  # fmt: skip
    ms_fp16 = min(v[0] for v in base.values())
    row = {**case, "launch": tuning.launch, "launch_kwargs": kw, "tuner_ms": tuning.ms, "rejected": tuning.rejected,
           "ms_default": round(ms_default, 5), "ms_tuned": round(ms_tuned, 5),
           "tuned_vs_default": round(ms_default / ms_tuned, 3), "ms_fp16_sdpa": round(ms_fp16, 5),
           "default_vs_fp16": round(ms_fp16 / ms_default, 3), "tuned_vs_fp16": round(ms_fp16 / ms_tuned, 3),
           "store_bytes": store.nbytes}  # fmt: skip
    print(f"{case['shape']:13} {case['layout']:5} B={case['batch']:<2} T={case['context']:<6} {tuning.launch:16} "
          f"default {ms_default:.4f} ms, tuned {ms_tuned:.4f} ms ({row['tuned_vs_default']}x), fp16 SDPA "
          f"{ms_fp16:.4f} ms (tuned {row['tuned_vs_fp16']}x of it); rejected {sorted(tuning.rejected)}",
          flush=True)  # fmt: skip
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, three candidates: checks that the script runs")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton's interpreter)")
    p.add_argument("--budget-s", type=float, default=200.0, help="no case starts after this (default 200)")
    p.add_argument("--prewarm-s", type=float, default=100.0, help="CUDA: compile the candidates first (0: off)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    names = SMOKE_CANDIDATES if args.smoke else tuple(c.name for c in autotune.CANDIDATES)
    candidates = tuple(c for c in autotune.CANDIDATES if c.name in names)
    batches, contexts = ((1,), (160,)) if args.smoke else (BATCHES, CONTEXTS)
    cases = CASES[:2] if args.smoke else CASES  # smoke: Qwen2.5's shape, both layouts
    cfg = common.Config(device=device, contexts=list(contexts), batches=list(batches), reps=3 if args.smoke else 25,
                        warmup=1 if args.smoke else 3, max_bytes=40e9, smoke=args.smoke, kernel="triton")  # fmt: skip
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    result: dict[str, Any] = {
        "script": "benchmarks/autotune_decode.py", "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%d"), "commit": _provenance.commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else _provenance.host(),
        "torch": torch.__version__, "candidates": list(names), "margin": autotune.MARGIN,
        "tolerance_ulps": autotune.TOLERANCE_ULPS, "rows": [], "skipped": [], "failures": [], "complete": False,
    }  # fmt: skip

    def save() -> None:
        _provenance.write_json(args.out, result)  # atomic: a run cut by its timeout keeps the last complete file

    if device.type == "cuda" and args.prewarm_s > 0:
        result["prewarm"] = _prewarm(device, autotune_jobs(cases, batches, contexts, names), args.prewarm_s)
        print(f"prewarm: {result['prewarm']}", flush=True)
    save()
    rounds = 3 if args.smoke else 7
    for shape_name, layout in cases:
        for batch in batches:
            for context in contexts:
                case = {"shape": shape_name, "layout": layout, "scheme": "int4", "batch": batch, "context": context}
                if time.monotonic() - t0 > args.budget_s:
                    result["skipped"].append(case)
                    continue
                step = f"{shape_name} {layout} B={batch} T={context}"
                row = common.guarded(step, lambda case=case: run_case(case, candidates, cfg, flush, rounds),
                                     result["failures"])  # fmt: skip
                if row is not None:
                    result["rows"].append(row)
                save()
    result["complete"] = True
    result["seconds"] = round(time.monotonic() - t0, 1)
    save()
    if result["failures"]:  # after every case ran and the rows were written
        raise SystemExit(f"{len(result['failures'])} case(s) failed: "
                         + "; ".join(f"{f['step']}: {f['error']}" for f in result["failures"]))  # fmt: skip
    return result


def _prewarm(device: torch.device, job_list: list[tuple], timeout_s: float) -> dict:
    """Compile ``job_list`` on every CPU core first (``prewarm.py``); only a head start: an error is returned as
    ``{"error"}`` (the cases compile what they need anyway), not raised."""
    try:
        import prewarm

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        cap = torch.cuda.get_device_capability(device)
        return prewarm.prewarm(f"sm_{cap[0]}{cap[1]}", 2 * sms, job_list, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - as gpu_decode.py's _prewarm
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


if __name__ == "__main__":
    main()
