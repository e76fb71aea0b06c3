"""FP8 E4M3 KV cache, vLLM-style: scale 1.0 (vLLM's uncalibrated default) against calibrated scales.

For each model: ``kvbits calibrate --scheme fp8-e4m3`` on one text (the calibration set), then
``kvbits eval`` on another (the evaluation set) of ``fp8-e4m3`` at scale 1.0, the same scheme with the
calibrated per-layer scales, and ``fp8-e4m3-token`` (one dynamic scale per token and head: what a
per-tensor scale can at best approach). Each is scored against the unquantized model: KL and
perplexity by context bucket, values clipped (saturated at 448 x scale), and the calibrated scales
are exported as vLLM loads them (``kvbits export``). The largest post-RoPE |K| and |V| of each layer
say where scale 1.0 saturates (above 448) or wastes E4M3's range (small values fall into
subnormals below 2^-6 = 0.0156).

Controls, since a per-tensor scale also moves where every value falls between E4M3's grid points:
``-mse``: the calibrated scales raised by up to 2x to the least squared error on the calibration
samples (``kvbits calibrate --fp8-scale mse``); the calibrated scales rounded up to a power of two (``-pow2``: the grid of scale 1.0, shifted by whole
binades) and constant scales ``CONTROLS`` (no range information at all). Their spread is the noise
band of "which scale" on this text: a calibration is worth something only outside it.

    PYTHONPATH=src python benchmarks/fp8_calibration.py --out benchmarks/results/fp8_calibration.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _provenance import commit, write_results

from kvbits.calibrate import CalibrationArtifact, collect_samples, fit_artifact
from kvbits.evaluate.models import load_model
from kvbits.evaluate.runner import evaluate
from kvbits.export import export_vllm
from kvbits.schemes import KVScheme, get_scheme

CALIBRATED = "fp8-e4m3-cal"
CONTROLS = (0.5, 1.25)


def _variant(
    art: CalibrationArtifact, name: str, f: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[KVScheme, CalibrationArtifact]:
    """``(scheme, artifact)``: ``art`` under another scheme name with its scales mapped through ``f``."""
    import copy

    out = copy.deepcopy(art)
    out.scheme = art.scheme.replace(name=name)
    out.tensors = {k: f(v) for k, v in art.tensors.items()}
    out.validate()
    return out.scheme, out


def collect_timed(model, args: argparse.Namespace):
    """``collect_samples`` on ``args``' calibration text, context and windows (no Fisher pass):
    ``(samples, seconds)``."""
    t0 = time.perf_counter()
    samples = collect_samples(
        model, args.calibration_text, context=args.calibration_context, windows=args.calibration_windows,
        fisher=False,
    )  # fmt: skip
    return samples, time.perf_counter() - t0


def calibration_record(args: argparse.Namespace, seconds: float) -> dict:
    """What a result records of its calibration: text, context, windows and ``seconds`` taken."""
    return {
        "text": args.calibration_text,
        "context": args.calibration_context,
        "windows": args.calibration_windows,
        "seconds": round(seconds, 1),
    }


def run_model(name: str, args: argparse.Namespace, work: Path) -> dict:
    model = load_model(name)
    scheme = get_scheme("fp8-e4m3").replace(name=CALIBRATED)
    t0 = time.perf_counter()
    samples = collect_samples(
        model, args.calibration_text, context=args.calibration_context, windows=args.calibration_windows,
        fisher=False,
    )  # fmt: skip
    art = fit_artifact(samples, scheme, fp8_scale="amax")
    art.save(work / f"cal-{name}")
    cal_s = time.perf_counter() - t0
    mse_scheme = scheme.replace(name=f"{CALIBRATED}-mse")
    mse = fit_artifact(samples, mse_scheme, fp8_scale="mse")
    export = export_vllm(art, work / f"vllm-{name}")
    variants = {CALIBRATED: (scheme, art), mse_scheme.name: (mse_scheme, mse)}
    variants[f"{CALIBRATED}-pow2"] = _variant(
        art, f"{CALIBRATED}-pow2", lambda t: torch.exp2(torch.ceil(torch.log2(t)))
    )
    for c in CONTROLS:
        variants[f"fp8-e4m3-const{c:g}"] = _variant(
            art, f"fp8-e4m3-const{c:g}", lambda t, c=c: torch.full_like(t, c)
        )
    summary = evaluate(
        model, args.text, args.context, ["fp8-e4m3", *(v[0] for v in variants.values()), "fp8-e4m3-token"],
        windows=args.windows, calibration={k: v[1] for k, v in variants.items()}, progress=False,
    )  # fmt: skip
    stats = art.layer_stats
    return {
        "model": name,
        "calibration": calibration_record(args, cal_s),
        "layers": [
            {
                "layer": i,
                "key_absmax": r["key_absmax"],
                "value_absmax": r["value_absmax"],
                "k_scale": export["layers"][i]["k_scale"],
                "v_scale": export["layers"][i]["v_scale"],
                "mse": mse.layer_stats[i],
            }
            for i, r in enumerate(stats)
        ],
        "eval": summary,
    }


def calibrate_then_eval_args(doc: str | None, work: str, out: str) -> argparse.ArgumentParser:
    """The arguments of a calibrate-on-one-text, evaluate-on-another benchmark (this one and
    ``fp8_head_scales.py``): models, evaluation and calibration text/context/windows, folders."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--text", default="war-and-peace")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--calibration-text", default="pride-and-prejudice")
    ap.add_argument("--calibration-context", type=int, default=4096)
    ap.add_argument("--calibration-windows", type=int, default=4)
    ap.add_argument("--work", default=work)
    ap.add_argument("--out", default=out)
    return ap


def run_models(
    args: argparse.Namespace, run_model: Callable[[str, argparse.Namespace, Path], dict], line: Callable[[dict], str]
) -> None:
    """``run_model`` for each of ``args.models``, each evaluated scheme logged as ``line(result)``;
    the records written to ``args.out`` with date, commit and host."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger(Path(sys.argv[0]).stem)  # the script that runs
    rev = commit()  # the code that runs: HEAD may move during a long run
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.models:
        records.append(run_model(name, args, work))
        for r in records[-1]["eval"]["results"]:
            log.info("%s %s", name, line(r))
    write_results(args.out, args, records, rev)
    log.info("wrote %s", args.out)


def main() -> None:
    ap = calibrate_then_eval_args(__doc__, "/tmp/kvbits-fp8-calibration", "benchmarks/results/fp8_calibration.json")
    run_models(ap.parse_args(), run_model, lambda r: (
        f"{r['scheme']}: kl {r['kl']:.5f} ppl {r['ppl']:.4f} (ref {r['ppl_ref']:.4f}) clipped K "
        f"{r['calibration'].get('clipped_keys_frac')} V {r['calibration'].get('clipped_values_frac')}"
    ))  # fmt: skip


if __name__ == "__main__":
    main()
