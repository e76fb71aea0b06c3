"""FP8 E4M3 KV cache with one static scale per layer and side, with and without a Hadamard rotation of
the head dim first (``fp8-e4m3-hadamard``: the cache stores ``fp8(x @ R / scale)`` and rotates back
after decoding; QuaRot's idea on vLLM's FP8 format).

A rotation spreads an outlier channel over every channel, which shrinks the largest |x| a per-tensor
scale must cover. But FP8 is floating point: its relative step does not depend on the range, so a
smaller range buys little unless values sat near 448 or in the subnormals (BENCHMARKS.md §10). This
measures whether it matters.

For each model: one calibration pass (``collect_samples``, which tracks the largest ``|x|`` and
``|x @ R|`` over every position), four artifacts from the same samples (unrotated and rotated, each
``amax`` and ``centred``), then ``evaluate`` on another text against the unquantized model: the four,
both presets at scale 1.0 (uncalibrated), and ``fp8-e4m3-token`` (a dynamic scale per token and head).
Per layer it records the largest stored |K| and |V| with and without the rotation.

    PYTHONPATH=src python benchmarks/fp8_hadamard.py --out benchmarks/results/fp8_hadamard.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from fp8_calibration import calibrate_then_eval_args, calibration_record, collect_timed, run_models

from kvbits.calibrate import fit_artifact
from kvbits.evaluate.models import load_model
from kvbits.evaluate.runner import evaluate
from kvbits.schemes import KVScheme, get_scheme, mixed_scheme

VARIANTS = {  # name -> (scheme, fp8_scale)
    "fp8-tensor-amax": ("fp8-e4m3", "amax"),
    "fp8-tensor-centred": ("fp8-e4m3", "centred"),
    "fp8-hadamard-amax": ("fp8-e4m3-hadamard", "amax"),
    "fp8-hadamard-centred": ("fp8-e4m3-hadamard", "centred"),
    # every layer rotated but layer 0, whose biased keys the rotation spreads (§19); added after the first run
    "fp8-hadamard-centred-l0plain": ("fp8-e4m3-hadamard,0=fp8-e4m3", "centred"),
    # one side rotated, the other not (§19, second addition)
    "fp8-hadamard-keys-centred": ("fp8-e4m3:key", "centred"),
    "fp8-hadamard-values-centred": ("fp8-e4m3:value", "centred"),
    # one scale per KV head (vLLM's attn_head), plain and with both sides rotated (session 19)
    "fp8-head-centred": ("fp8-e4m3-head", "centred"),
    "fp8-head-hadamard-centred": ("fp8-e4m3-head:key+value", "centred"),
}
UNCALIBRATED = ["fp8-e4m3", "fp8-e4m3-hadamard", "fp8-e4m3-token"]


def _variant(label: str) -> tuple[KVScheme, str]:
    """``VARIANTS[label]`` as a scheme: a preset, ``preset,L=other`` (layer ``L`` stored by ``other``), or
    ``preset:side`` (that side rotated; ``key+value``: both)."""
    spec, how = VARIANTS[label]
    if ":" in spec:
        base, sides = spec.split(":")
        scheme = get_scheme(base)
        rotated = {side: dataclasses.replace(getattr(scheme, side), rotate="hadamard") for side in sides.split("+")}
        return scheme.replace(**rotated), how
    base, _, layer = spec.partition(",")
    if not layer:
        return get_scheme(base), how
    idx, other = layer.split("=")
    return mixed_scheme(base, {int(idx): other}), how


def run_model(name: str, args: argparse.Namespace, work: Path) -> dict:
    model = load_model(name)
    samples, cal_s = collect_timed(model, args)
    arts = {}
    for label in args.variants:
        scheme, how = _variant(label)
        arts[label] = fit_artifact(samples, scheme.replace(name=label), fp8_scale=how)
    summary = evaluate(
        model, args.text, args.context,
        [*(UNCALIBRATED if args.uncalibrated else []), *(a.scheme for a in arts.values())],
        windows=args.windows, calibration=arts, progress=False,
    )  # fmt: skip
    layers = []
    for i in range(arts["fp8-tensor-amax"].num_layers if {"fp8-tensor-amax", "fp8-hadamard-amax"} <= arts.keys() else 0):
        row: dict = {"layer": i}
        for side, short in (("key", "k"), ("value", "v")):
            plain = arts["fp8-tensor-amax"].layer_stats[i][f"{side}_absmax"]
            rotated = arts["fp8-hadamard-amax"].layer_stats[i][f"{side}_absmax"]
            row[f"{short}_absmax"], row[f"{short}_absmax_rotated"] = plain, rotated
            row[f"{short}_range_shrink_db"] = 20 * math.log10(plain / rotated) if plain > 0 and rotated > 0 else 0.0
        layers.append(row)
    return {
        "model": name,
        "calibration": calibration_record(args, cal_s),
        "layers": layers,
        "eval": summary,
    }


def main() -> None:
    ap = calibrate_then_eval_args(__doc__, "/tmp/kvbits-fp8-hadamard", "benchmarks/results/fp8_hadamard.json")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="calibrated variants to fit and evaluate (default all)")  # fmt: skip
    ap.add_argument("--no-uncalibrated", dest="uncalibrated", action="store_false",
                    help=f"do not evaluate {', '.join(UNCALIBRATED)} at their default scales")  # fmt: skip
    run_models(
        ap.parse_args(),
        run_model,
        lambda r: f"{r['scheme']}: kl {r['kl']:.5f} ppl {r['ppl']:.4f} (ref {r['ppl_ref']:.4f})",
    )


if __name__ == "__main__":
    main()
