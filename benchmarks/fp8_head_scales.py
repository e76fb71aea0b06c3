"""FP8 E4M3 KV cache: one calibrated scale per layer (vLLM's ``tensor`` strategy) against one per KV
head (``attn_head``), each chosen three ways: the largest stored |x| over 448 (``amax``), and the
amax scale raised by up to 2x to the least squared error on the calibration samples, plain
(``mse``) or, for keys, without each channel's mean error over the tokens (``centred``,
``kvbits calibrate``'s default: that part shifts every logit of a query alike, which softmax ignores).

For each model: one calibration pass (``collect_samples``) on one text, six artifacts fitted from the
same samples, then ``evaluate`` on another text against the unquantized model: ``fp8-e4m3`` at scale
1.0 (vLLM's uncalibrated default), the six calibrated variants, and ``fp8-e4m3-token`` (a dynamic
scale per token and head). Per layer it records how far apart the heads' scales are
(``head_spread_db``: largest over smallest head scale). The per-head scales are exported as vLLM
loads them (``kvbits export``, strategy ``attn_head``).

FP8 is floating point: a scale moves the range (saturation at 448, subnormals below 2^-6) and the
grid phase, not the relative step. A per-head scale therefore helps where one head's values would
saturate or sink into subnormals under its layer's scale, or where each head's phase is chosen on
its own; heads whose ranges differ by less than ~2^8 get nothing from the range alone.

    PYTHONPATH=src python benchmarks/fp8_head_scales.py --out benchmarks/results/fp8_head_scales.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8_calibration import calibrate_then_eval_args, calibration_record, collect_timed, run_models

from kvbits.calibrate import fit_artifact
from kvbits.evaluate.models import load_model
from kvbits.evaluate.runner import evaluate
from kvbits.export import export_vllm
from kvbits.schemes import get_scheme

VARIANTS = {  # name -> (preset, fp8_scale)
    "fp8-tensor-amax": ("fp8-e4m3", "amax"),
    "fp8-tensor-mse": ("fp8-e4m3", "mse"),
    "fp8-tensor-centred": ("fp8-e4m3", "centred"),
    "fp8-head-amax": ("fp8-e4m3-head", "amax"),
    "fp8-head-mse": ("fp8-e4m3-head", "mse"),
    "fp8-head-centred": ("fp8-e4m3-head", "centred"),
}


def run_model(name: str, args: argparse.Namespace, work: Path) -> dict:
    model = load_model(name)
    samples, cal_s = collect_timed(model, args)
    arts = {}
    for label, (preset, how) in VARIANTS.items():
        scheme = get_scheme(preset).replace(name=label)
        arts[label] = fit_artifact(samples, scheme, fp8_scale=how)
    export = export_vllm(arts["fp8-head-centred"], work / f"vllm-head-{name}")
    summary = evaluate(
        model, args.text, args.context, ["fp8-e4m3", *(a.scheme for a in arts.values()), "fp8-e4m3-token"],
        windows=args.windows, calibration=arts, progress=False,
    )  # fmt: skip
    layers = []
    for i in range(arts["fp8-head-amax"].num_layers):
        row: dict = {"layer": i}
        for side, short in (("key", "k"), ("value", "v")):
            head = arts["fp8-head-amax"].layer_stats[i]
            row[f"{short}_absmax"] = head[f"{side}_absmax"]
            row[f"{short}_head_spread_db"] = head[f"{side}_head_spread_db"]
            for label, art in arts.items():  # the searched scales and their squared-error gain
                if label.endswith(("mse", "centred")):
                    row[f"{short}_{label}_scale"] = art.tensors[f"layers.{i}.{side}_scale"].tolist()
                    row[f"{short}_{label}_gain_db"] = art.layer_stats[i][f"{side}_mse_gain_db"]
        layers.append(row)
    return {
        "model": name,
        "kv_heads": arts["fp8-head-amax"].num_kv_heads,
        "calibration": calibration_record(args, cal_s),
        "export": {"kv_cache_scheme": export["kv_cache_scheme"], "serve": export["serve"]},
        "layers": layers,
        "eval": summary,
    }


def main() -> None:
    ap = calibrate_then_eval_args(
        __doc__, "/tmp/kvbits-fp8-head-scales", "benchmarks/results/fp8_head_scales.json"
    )
    run_models(
        ap.parse_args(),
        run_model,
        lambda r: f"{r['scheme']}: kl {r['kl']:.5f} ppl {r['ppl']:.4f} (ref {r['ppl_ref']:.4f})",
    )


if __name__ == "__main__":
    main()
