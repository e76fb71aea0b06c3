"""KVQuant ingredients, one at a time (issue 4): which part of kvquant-N helps, which hurts.

One calibration pass (Fisher-weighted, on text other than the evaluation text) is shared by every
calibrated variant: ``kvbits.calibrate.collect_samples`` once, ``fit_artifact`` per scheme. Then one
``kvbits.evaluate`` run scores all variants on the same windows (decode semantics, simulate mode).

Sets (``--set``):

- ``ladder``: cumulative, starting from uncalibrated INT4 per-token keys; pre-RoPE per-channel keys
  with dynamic ranges over 128-token blocks, then a calibrated NUQ codebook, then 1% dense-and-sparse
  outliers, then one full-precision sink token;
- ``loo``: leave one out of ``kvquant-4`` (static calibrated pre-RoPE per-channel key ranges, NUQ,
  1% outliers, 1 sink), and the static ranges at lower clipping percentiles;
- ``bits``: the ladder's best recipe and kvquant-N at 3 and 2 bits;
- ``goals``: the ladder's full recipe at 4/3/2 bits, kvquant-4, and kvquant-4 calibrated on short
  windows (``--short-context``, 512 tokens) served at the full context: the calibration mismatch.

Example (the runs recorded in BENCHMARKS.md §3)::

    PYTHONPATH=src python benchmarks/kvquant_ablation.py --set ladder --out runs/ablation-smollm2-ladder
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from kvbits.calibrate import collect_samples, fit_artifact, spec_needs_calibration
from kvbits.evaluate.models import load_model
from kvbits.evaluate.runner import evaluate
from kvbits.schemes.presets import get_scheme
from kvbits.schemes.spec import KVScheme, TensorSpec

logger = logging.getLogger("kvquant_ablation")


def _nuq(bits: int, granularity: str, *, group: int | None = None, static: bool = False,
         outliers: float = 0.0, pre_rope: bool = False) -> TensorSpec:
    return TensorSpec(kind="nuq", bits=bits, fmt=None, granularity=granularity, group_size=group,
                      static=static, outlier_frac=outliers, pre_rope=pre_rope)


def _int(bits: int, granularity: str, *, group: int | None = None, static: bool = False,
         outliers: float = 0.0, pre_rope: bool = False) -> TensorSpec:
    return TensorSpec(kind="int", bits=bits, fmt=None, granularity=granularity, group_size=group,
                      static=static, outlier_frac=outliers, pre_rope=pre_rope)


def ladder(bits: int = 4) -> list[tuple[KVScheme, float]]:
    """Cumulative ingredients with dynamic per-block key ranges; (scheme, calibration percentile)."""
    b = bits
    return [
        (get_scheme(f"int{b}-token") if b != 2 else get_scheme("int2-token"), 0.0),
        (get_scheme(f"int{b}-channel-prerope") if b in (4, 3) else
         KVScheme(f"int{b}-channel-prerope", key=_int(b, "channel", group=128, pre_rope=True),
                  value=_int(b, "token"), block=128), 0.0),
        (KVScheme(f"abl{b}-prerope+nuq", key=_nuq(b, "channel", group=128, pre_rope=True),
                  value=_nuq(b, "token"), block=128), 99.9),
        (KVScheme(f"abl{b}-prerope+nuq+outl", key=_nuq(b, "channel", group=128, outliers=0.01, pre_rope=True),
                  value=_nuq(b, "token", outliers=0.01), block=128), 99.9),
        (get_scheme(f"kvquant-{b}-block"), 99.9),  # + one sink: the whole recipe
    ]


def leave_one_out(bits: int = 4) -> list[tuple[KVScheme, float]]:
    """kvquant-N and each ingredient removed (static ranges); lower clipping percentiles."""
    b = bits
    full = get_scheme(f"kvquant-{b}")
    return [
        (full, 99.9),
        (full.replace(name=f"kvquant-{b}-p99.5"), 99.5),
        (full.replace(name=f"kvquant-{b}-p99"), 99.0),
        (full.replace(name=f"kvquant-{b}-no-nuq", key=_int(b, "channel", static=True, outliers=0.01, pre_rope=True),
                      value=_int(b, "token", outliers=0.01)), 99.9),
        (full.replace(name=f"kvquant-{b}-no-outl", key=_nuq(b, "channel", static=True, pre_rope=True),
                      value=_nuq(b, "token")), 99.9),
        (full.replace(name=f"kvquant-{b}-no-sink", sinks=0), 99.9),
        (full.replace(name=f"kvquant-{b}-token-keys", key=_nuq(b, "token", outliers=0.01, pre_rope=True)), 99.9),
    ]


def bits_set() -> list[tuple[KVScheme, float]]:
    out: list[tuple[KVScheme, float]] = []
    for b in (3, 2):
        out.append(ladder(b)[-1])
        out.append((get_scheme(f"kvquant-{b}"), 99.9))
    return out


def goals() -> list[tuple[KVScheme, float]]:
    """The ladder's full recipe at 4/3/2 bits, kvquant-4 (static ranges) and its short calibration."""
    out = [ladder(b)[-1] for b in (4, 3, 2)]
    out.append((get_scheme("kvquant-4"), 99.9))
    out.append((get_scheme("kvquant-4").replace(name=SHORT_NAME), 99.9))
    return out


SHORT_NAME = "kvquant-4-short-calibration"
SETS = {"ladder": ladder, "loo": leave_one_out, "bits": bits_set, "goals": goals}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", choices=sorted(SETS), required=True, action="append",
                   help="repeatable: the sets' schemes are scored in one run (one reference pass)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib-data", default="pride-and-prejudice")
    p.add_argument("--calib-context", type=int, default=2048)
    p.add_argument("--calib-windows", type=int, default=2)
    p.add_argument("--short-context", type=int, default=512, help="calibration window of --set goals' mismatch case")
    p.add_argument("--data", default="war-and-peace")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="run folder (artifacts under OUT/calibration/)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    schemes: list[tuple[KVScheme, float]] = []
    for name in args.set:
        schemes += [x for x in SETS[name]() if x[0].name not in {s.name for s, _ in schemes}]
    out = Path(args.out)
    lm = load_model(args.model)  # float32: the Fisher pass needs it
    calibrated = [(s, pct) for s, pct in schemes if any(spec_needs_calibration(x) for x in (s.key, s.value))]
    artifacts = {}
    if calibrated:
        t0 = time.perf_counter()
        samples = collect_samples(lm, args.calib_data, sinks=0, context=args.calib_context,
                                  windows=args.calib_windows, fisher=True)
        logger.info("collected samples in %.1f s", time.perf_counter() - t0)
        short = None
        if any(s.name == SHORT_NAME for s, _ in calibrated):
            short = collect_samples(lm, args.calib_data, sinks=0, context=args.short_context,
                                    windows=args.calib_windows, fisher=True)
        for s, pct in calibrated:
            art = fit_artifact(short if s.name == SHORT_NAME else samples, s, percentile=pct)
            folder = out / "calibration" / s.name
            art.save(folder)
            artifacts[s.name] = art
            logger.info("fitted %s (p%s): %s", s.name, pct, folder)
    summary = evaluate(lm, args.data, args.context, [s for s, _ in schemes], windows=args.windows,
                       calibration=artifacts or None, out_dir=out, dtype=args.dtype,
                       argv=[sys.executable, *sys.argv])
    rows = [{"scheme": r["scheme"], "avg_bits": r["avg_bits"],
             "delta_rel_pct": [round(100 * b["delta_rel"], 2) for b in r["buckets"]],
             "kl": r["kl"]} for r in summary["results"]]
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
