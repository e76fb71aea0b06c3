"""``kvbits monitor``: the online signals of a scheme on real text, a fallback policy's effect, Prometheus
metrics and JSON events (thin wrapper over ``kvbits.monitor.watch``)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from kvbits._argtypes import (
    add_bos_arg,
    add_dtype_device,
    add_model_data_args,
    add_threads_arg,
    apply_threads,
    bounded,
    check_output_path,
    check_scheme_args,
    on_device,
)
from kvbits.evaluate.data import DATA_PATH_HELP
from kvbits.monitor.export import RESERVED_LABELS, check_label_name, strict_json

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  kvbits monitor --model smollm2-135m --data war-and-peace --context 2k --scheme kivi-2
  kvbits monitor --model smollm2-135m --data war-and-peace --context 2k --scheme kivi-2 \\
      --key-error 0.26 --value-error 0.5 --prom runs/kvbits.prom --events runs/events.jsonl

Signals, per layer and side, at every flush of `block` tokens: the relative error ||x - x_hat|| / ||x||
of the block just quantized (worst sequence), values clipped (against static scales, or under vllm-int4's integer
zero-points where a token's range excludes 0), positions past the calibrated context. A threshold crossed holds the layer (--scope request: every layer) in full
precision from then on. --json prints CacheMonitor.snapshot(): {"labels", "policy", "tokens",
"total_bytes", "linear_state_bytes" (a hybrid model's states, 0 without), "held_layers", "calibrated_length",
"signals": [{"layer", "side", "flushes" (blocks quantized), "measured", "tokens_measured", "last_error", "max_error",
"mean_error" (of the finite errors; null before a measured flush), "nonfinite_errors" (NaN or inf, kept out of
the mean and the histogram), "clipped" (in the measured flushes: --sample-every N counts one in N),
"clipped_estimated" (scaled to every flush by values quantized / values measured), "clipped_fraction", "held_at"}],
"events": [{"time", "layer", "side", "signal", "value", "threshold", "sequence", "tokens", "action", ...labels}],
"run": {"bos" ("always" / "never": --bos as it ran), "bos_token", "bos_token_id" (with a BOS only)}};
an event's "sequence" is the batch row of a key_error / value_error (the worst one), null for clipped_fraction and
beyond_calibration, which are read over the whole batch.
--clipped-fraction is checked at each measured flush, over the values that flush quantized (every sequence, KV head
and channel of its tokens). Schemes with one-token blocks (kvquant-4, fp8-e4m3, vllm-int4) flush one token per decode
step, so each check reads one token's values: 192 on smollm2-135m (3 KV heads x 64), where one clipped value is
0.52 % and two 1.04 %, so a threshold near the 0.1 % warning level holds a layer at the first token that clips at
all. For those, give a few clipped values' worth, e.g. 0.05 (10 of 192); the run's rate is the table's clipped
columns (the snapshot's "clipped_fraction", over every measured flush).
Prometheus (--prom): every series carries the label scheme="NAME" (the scheme's name), and layer / side (per-layer
series), signal / action (kvbits_fallback_events_total), le (histogram buckets) where they apply, plus the --label
pairs; kvbits_run_info{bos="always"} 1 (or "never") says whether the decoded tokens started with the BOS. Events and the snapshot's "labels" carry scheme and the --label pairs too. --label refuses the names
kvbits sets (scheme, layer, side, signal, action, le, bos, and the event fields time, value, threshold, sequence, tokens).
"""

_threshold = bounded(float, 0, what="a relative error")
_fraction = bounded(float, 0, 1, what="a fraction")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive, parse_tokens

    p = subparsers.add_parser(
        "monitor",
        help="online flush errors of a scheme on real text, fallback thresholds, Prometheus metrics",
        description="Decode real text through a scheme's cache token by token with kvbits.monitor attached: "
        "what a server would see, and which layers a fallback policy would hold in full precision.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="registry name, .gguf file, model folder or hub id",
        data_help="registry text (war-and-peace, ...) or a text file",
        data_path_help=DATA_PATH_HELP,
    )
    p.add_argument("--context", type=parse_tokens, default=2048, help="tokens decoded, e.g. 2048 or 2k (default 2048)")
    p.add_argument("--scheme", required=True, help="scheme preset or scheme JSON file")
    p.add_argument(
        "--calibration", metavar="DIR", help="kvbits calibrate folder (static scales / NUQ codebooks)"
    )
    p.add_argument(
        "--key-error", type=_threshold,
        help="hold when a flushed key block's relative error exceeds this (default: unset, no key-error threshold: "
        "measured and reported, never held for)",
    )  # fmt: skip
    p.add_argument(
        "--value-error", type=_threshold, help="the same for values (default: unset, no value-error threshold)"
    )
    p.add_argument(
        "--clipped-fraction", type=_fraction,
        help="hold when more of a flush's values clip than this fraction (default: unset, no clipping threshold); "
        "with one-token blocks (kvquant-4, fp8-e4m3) that is one token's values per check: see below",
    )  # fmt: skip
    p.add_argument("--beyond-calibration", action="store_true", help="hold past the calibrated context")
    p.add_argument("--scope", choices=("layer", "request"), default="layer", help="what a crossing holds (default layer)")
    p.add_argument(
        "--patience", type=_positive, default=1,
        help="consecutive crossing flushes before acting (a prefill's flush counts once; default 1)",
    )
    p.add_argument(
        "--sample-every", type=_positive, default=1,
        help="measure one flush in this many (default 1); errors and clipped values count the measured ones only "
        "(the calibrated context is checked at every flush)",
    )
    p.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="constant metric label; repeatable"
    )
    p.add_argument("--prom", metavar="FILE", help="write Prometheus text (node_exporter textfile: *.prom)")
    p.add_argument("--events", metavar="FILE", help="append the events as JSON lines")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON on stdout (nothing else)")
    add_dtype_device(p, ("cpu", "cuda"))
    add_threads_arg(p)
    add_bos_arg(p)
    return p


def _labels(pairs: list[str]) -> dict[str, str]:
    """``--label K=V`` pairs as a dict; ``ValueError`` (before any model loads) for a malformed pair or a
    name Prometheus would refuse."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--label expects KEY=VALUE, got {pair!r}")
        check_label_name(key, " (--label)", RESERVED_LABELS)
        if key in out:
            raise ValueError(f"--label {key} is given twice ({out[key]!r} and {value!r}); give each label once")
        out[key] = value
    return out


def _check_policy_applies(args: argparse.Namespace) -> None:
    """``ValueError`` (before any model loads) for a policy flag that could never fire on this run: a run that held
    nothing would read as "no layer needed holding". ``--scope request`` and ``--patience`` say how a threshold acts,
    so they need one. ``--beyond-calibration`` reads the calibrated context, which only
    ``--calibration`` gives; ``--clipped-fraction`` reads values saturated against static scales or clipped under vLLM's
    integer zero-points (``vllm-int4``: a token whose range excludes 0), which a scheme with neither (per-token, KIVI,
    dynamic FP8 scales: their ranges cover their data) never has."""
    if args.beyond_calibration and args.calibration is None:
        raise ValueError(
            "--beyond-calibration holds past the calibrated context, and there is none without --calibration DIR "
            "(a kvbits calibrate folder)"
        )
    acting = [f for f, v in (("--scope request", args.scope != "layer"), (f"--patience {args.patience}", args.patience != 1))
              if v]  # fmt: skip
    thresholds = (args.key_error, args.value_error, args.clipped_fraction)
    if acting and all(t is None for t in thresholds) and not args.beyond_calibration:
        raise ValueError(
            f"{' and '.join(acting)} say how a crossed threshold acts, and no threshold was given: add --key-error, "
            "--value-error, --clipped-fraction or --beyond-calibration (or drop them)"
        )
    if args.clipped_fraction is None:
        return
    from kvbits.evaluate.stream import PeerScheme, resolve_scheme

    scheme = resolve_scheme(args.scheme)
    if isinstance(scheme, PeerScheme):  # refused by watch(), saying why
        return
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    sides = [side for sub in subs if not sub.is_identity for side in (sub.key, sub.value)]
    if not any(side.static or side.integer_zero for side in sides):
        raise ValueError(
            f"--clipped-fraction reads values clipped against static scales or under integer zero-points, and "
            f"scheme {scheme.name} has none (its scales follow the data, so nothing clips): drop it, or watch a "
            "calibrated scheme (kvquant-4, fp8-e4m3) with --calibration, or vllm-int4"
        )


def run(args: argparse.Namespace) -> int:
    # torch-free: a misspelled name is refused in ~0.2 s, not after the imports; no peers offered (watch() refuses them)
    check_scheme_args(args.scheme)
    from kvbits.monitor.policy import FallbackPolicy
    from kvbits.monitor.watch import watch

    labels = _labels(args.label)  # everything a finished run would trip on, checked before it starts
    _check_policy_applies(args)
    check_output_path(args.prom, "--prom", "file")
    check_output_path(args.events, "--events", "file")
    policy = FallbackPolicy(
        key_error=args.key_error, value_error=args.value_error, clipped_fraction=args.clipped_fraction,
        beyond_calibration=args.beyond_calibration, scope=args.scope, patience=args.patience,
        sample_every=args.sample_every,
    )  # fmt: skip
    apply_threads(args.threads)  # before watch() loads the model
    with on_device(args.device):  # cuda:N current: Triton launches on the current device's stream
        mon = watch(args.model, args.data, args.context, args.scheme, policy, calibration=args.calibration,
                    data_path=args.data_path, dtype=args.dtype, device=args.device, labels=labels,
                    bos=args.bos)  # fmt: skip
    if args.prom:
        mon.write_prometheus(args.prom)
    if args.events:
        mon.write_events(args.events)
    snap = mon.snapshot()
    if args.json:
        sys.stdout.write(strict_json(snap, indent=2) + "\n")
        return 0
    _print(snap)
    _say_written(args.prom, args.events, len(snap["events"]))
    return 0


def _say_written(prom: str | None, events: str | None, n_events: int) -> None:
    """Name the files written, as the other commands do (``wrote ...``): ``--prom`` and ``--events`` were
    written without a word, leaving a user to guess whether and where."""
    from kvbits.cli import _console

    console = _console()
    if prom:
        console.print(f"wrote {prom} (Prometheus text)", markup=False, highlight=False)
    if events:
        console.print(f"appended {n_events} event(s) to {events} (JSON lines)", markup=False, highlight=False)


def _print(snap: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvbits.cli import _console, human_bytes
    from kvbits.report.fmt import bos_phrase

    rows: dict[int, dict[str, Any]] = {}
    for r in snap["signals"]:
        rows.setdefault(r["layer"], {"held_at": r["held_at"]})[r["side"]] = r
    # values clipped (static scales, integer zero-points): columns only when some were (other schemes never clip)
    clipped = any(r["clipped"] for r in snap["signals"])
    t = Table(title=f"{snap['labels']['scheme']}: flush relative error by layer ({snap['tokens']} tokens)")
    columns = ["layer", "K mean", "K max", "V mean", "V max", *(["K clipped", "V clipped"] if clipped else []),
               "flushes", "held from"]  # fmt: skip
    for col in columns:
        t.add_column(col, justify="right")
    if clipped:
        t.caption = (
            "clipped: values saturated against the calibration's static scales (or, under integer zero-points, past the "
            "far end of a token's range that excludes 0), in the blocks measured"
        )

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for layer, r in sorted(rows.items()):
        k, v = r["key"], r["value"]
        clips = [f"{100 * x['clipped_fraction']:.3f}%" for x in (k, v)] if clipped else []
        t.add_row(str(layer), f(k["mean_error"]), f(k["max_error"]), f(v["mean_error"]), f(v["max_error"]), *clips,
                  str(k["flushes"]), "-" if r["held_at"] is None else str(r["held_at"]))  # fmt: skip
    console = _console()
    console.print(t)
    longest = snap["calibrated_length"]
    if longest is not None and snap["tokens"] > longest:
        console.print(f"served {snap['tokens']:,} tokens, past the {longest:,} the calibration saw")
    kinds = Counter(e["signal"] for e in snap["events"])
    said = f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})" if kinds else ""
    bos = bos_phrase(snap.get("run") or {}, markdown=False)
    console.print(f"cache bytes at the end: {human_bytes(snap['total_bytes'])}; held layers: "
                  f"{snap['held_layers'] or 'none'}; events: {len(snap['events'])}{said}"
                  + ("" if bos is None else f"; the tokens started with {escape(bos)}"))  # fmt: skip
