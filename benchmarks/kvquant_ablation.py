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
  windows (``--short-context``, 512 tokens) served at the full context: the calibration mismatch;
- ``edges``: kvquant-4 with the static key ranges taken from the whole calibration range (percentile 100:
  nothing the calibration saw is clipped), with 4 or 32 first tokens in full precision, and
  ``kvquant-4-block`` (key ranges per 128-token block, from the tokens themselves).

``--task needle`` scores the schemes by passkey retrieval (``kvbits.evaluate.needle_eval``, prefill
semantics, War and Peace haystack) at ``--context`` and ``--depths`` with ``--trials`` trials per cell
instead of perplexity; it writes ``needle.json`` / ``report.md`` / ``needle.png`` to ``--out``.

Example (the runs recorded in BENCHMARKS.md §3 and §17h)::

    PYTHONPATH=src python benchmarks/kvquant_ablation.py --set ladder --out runs/ablation-smollm2-ladder
    PYTHONPATH=src python benchmarks/kvquant_ablation.py --set loo --set edges --calib-sinks scheme \
        --task needle --context 2048 --depths 0 --trials 4 --out runs/needle-smollm2-kvquant-depth0
    PYTHONPATH=src python benchmarks/kvquant_ablation.py --set loo --set edges --calib-sinks scheme \
        --only kvquant-4 --only kvquant-4-p100 --only kvquant-4-sinks4 --only kvquant-4-sinks32 \
        --only kvquant-4-no-nuq --only kvquant-4-no-outl --only kvquant-4-no-sink --only kvquant-4-block \
        --task needle --context 2048 --depths 0 --trials 16 --out runs/needle-smollm2-kvquant-depth0-16
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


def edges() -> list[tuple[KVScheme, float]]:
    """kvquant-4 with unclipped calibration ranges; with more first tokens in full precision."""
    full = get_scheme("kvquant-4")
    return [
        (full.replace(name="kvquant-4-p100"), 100.0),
        (full.replace(name="kvquant-4-sinks4", sinks=4), 99.9),
        (full.replace(name="kvquant-4-sinks32", sinks=32), 99.9),
        (get_scheme("kvquant-4-block"), 99.9),  # key ranges per 128-token block, not calibrated: none clipped
    ]


SHORT_NAME = "kvquant-4-short-calibration"
SETS = {"ladder": ladder, "loo": leave_one_out, "bits": bits_set, "goals": goals, "edges": edges}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", choices=sorted(SETS), required=True, action="append",
                   help="repeatable: the sets' schemes are scored in one run (one reference pass)")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="repeatable: score only these of the sets' schemes")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib-data", default="pride-and-prejudice")
    p.add_argument("--calib-context", type=int, default=2048)
    p.add_argument("--calib-windows", type=int, default=2)
    p.add_argument("--short-context", type=int, default=512, help="calibration window of --set goals' mismatch case")
    p.add_argument("--calib-sinks", choices=("none", "scheme"), default="none",
                   help="none: one sample pass for all schemes, every token sampled (the runs of BENCHMARKS.md "
                        "§3); scheme: a pass per sink count, the first `sinks` tokens of each window left out, "
                        "as `kvbits calibrate` samples for the scheme")
    p.add_argument("--task", choices=("ppl", "needle"), default="ppl",
                   help="ppl: perplexity / KL by position (evaluate); needle: passkey retrieval (needle_eval)")
    p.add_argument("--data", default="war-and-peace")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="--task needle: needle depths, comma-separated")
    p.add_argument("--trials", type=int, default=1, help="--task needle: trials per depth")
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
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s, _ in schemes})
        if unknown:
            p.error(f"--only {', '.join(unknown)}: not in the sets chosen ({', '.join(s.name for s, _ in schemes)})")
        schemes = [x for x in schemes if x[0].name in args.only]
    out = Path(args.out)
    lm = load_model(args.model)  # float32: the Fisher pass needs it
    calibrated = [(s, pct) for s, pct in schemes if any(spec_needs_calibration(x) for x in (s.key, s.value))]
    artifacts = {}
    if calibrated:
        passes = {}  # (context, sinks) -> samples: one pass each
        for s, pct in calibrated:
            key = (args.short_context if s.name == SHORT_NAME else args.calib_context,
                   s.sinks if args.calib_sinks == "scheme" else 0)  # fmt: skip
            if key not in passes:
                t0 = time.perf_counter()
                passes[key] = collect_samples(lm, args.calib_data, sinks=key[1], context=key[0],
                                              windows=args.calib_windows, fisher=True)  # fmt: skip
                logger.info("collected samples (context %d, %d sinks left out) in %.1f s", *key,
                            time.perf_counter() - t0)  # fmt: skip
            art = fit_artifact(passes[key], s, percentile=pct)
            folder = out / "calibration" / s.name
            art.save(folder)
            artifacts[s.name] = art
            logger.info("fitted %s (p%s): %s", s.name, pct, folder)
    if args.task == "needle":
        return _needle(lm, [s for s, _ in schemes], artifacts, args, out)
    summary = evaluate(lm, args.data, args.context, [s for s, _ in schemes], windows=args.windows,
                       calibration=artifacts or None, out_dir=out, dtype=args.dtype,
                       argv=[sys.executable, *sys.argv])
    rows = [{"scheme": r["scheme"], "avg_bits": r["avg_bits"],
             "delta_rel_pct": [round(100 * b["delta_rel"], 2) for b in r["buckets"]],
             "kl": r["kl"]} for r in summary["results"]]
    print(json.dumps(rows, indent=1))
    return 0


def _needle(lm, schemes: list[KVScheme], artifacts: dict, args: argparse.Namespace, out: Path) -> int:
    """Passkey retrieval of ``schemes`` (prefill semantics, as ``kvbits needle``); writes needle.json."""
    from kvbits.evaluate import needle_eval
    from kvbits.report.needle import write_needle

    depths = [float(d) for d in args.depths.split(",")]
    summary = needle_eval(lm, [args.context], schemes, data=args.data, depths=depths, trials=args.trials,
                          calibration=list(artifacts.values()) or None, dtype=args.dtype)
    write_needle(summary, out, overwrite=True)  # beside OUT/calibration/, which stays
    for r in summary["results"]:
        print(f"{r['scheme']:28s} kept {r['kept']:.3f}  retrieved {r['retrieved']:.3f}  "
              f"dNLL {r['delta_nll']:+.3f}  KL {r['kl']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
