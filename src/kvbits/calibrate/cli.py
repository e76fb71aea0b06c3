"""``kvbits calibrate``: fit static key scales and NUQ codebooks for a scheme, write the artifact.

kvbits calibrate --model smollm2-135m --data pride-and-prejudice --scheme kvquant-4 --out cal/
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvbits._argtypes import (
    add_bos_arg,
    add_dtype_device,
    add_model_data_args,
    add_seed_arg,
    add_threads_arg,
    add_window_args,
    apply_threads,
    bounded,
    check_scheme_args,
    on_device,
)
from kvbits._json import dumps
from kvbits.cli import _positive

DEVICES = ("cpu", "cuda", "mps")
"""Device types ``kvbits calibrate`` runs on: ``kvbits.calibrate.calibrate.DEVICES``, written out so that building
the parser imports no torch (tests/test_cli_imports.py checks the two agree)."""

_percentile = bounded(float, 50, 100, what="a percentile")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="calibrate static key scales and NUQ codebooks (KVQuant) or FP8 per-tensor/per-head scales for a scheme",
        description="Run the model over a few windows of calibration text, capture pre-RoPE keys and values "
        "(and their loss gradients), and fit per-channel key ranges and Fisher-weighted non-uniform "
        "codebooks; for static FP8 schemes (fp8-e4m3; fp8-e4m3-head: one per KV head), per-layer K/V scales "
        "absmax / 448 over every calibration token (post-RoPE keys after RoPE), raised to the least-error "
        "grid phase (--fp8-scale centred), as vLLM's k_scale / v_scale (kvbits export --format vllm). "
        "Writes DIR/calibration.safetensors and DIR/calibration.json (a DIR already holding a calibration is "
        "refused unless --overwrite).",
    )
    add_model_data_args(
        p,
        model_help="model: registry name (smollm2-135m), .gguf file, model folder or hub id",
        data_help="calibration text: registry name (pride-and-prejudice) or file path",
    )
    p.add_argument(
        "--scheme", required=True, help="scheme to calibrate for (kvquant-4, kvquant-3, fp8-e4m3, ... or a JSON file)"
    )
    p.add_argument(
        "--out", required=True,
        help="output folder; one that already holds a calibration is refused unless --overwrite",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace the calibration --out holds (calibration.json and calibration.safetensors only)",
    )  # fmt: skip
    add_window_args(p, context=2048, windows=4, windows_help="calibration windows")
    p.add_argument(
        "--percentile",
        type=_percentile,
        default=None,
        help="per-channel range [100-P, P] for static int/NUQ scales and smoothing factors (default 99.9)",
    )
    p.add_argument(
        "--no-fisher", action="store_true", help="unweighted k-means (forward passes only, faster)"
    )
    p.add_argument(
        "--fp8-scale",
        choices=("centred", "mse", "amax"),
        default=None,
        help="static FP8 scales: centred (default) = the amax scale raised by up to 2x to the least squared "
        "error on the sampled tokens, keys measured without each channel's mean error (a shift of all of a "
        "query's logits, which softmax ignores); mse = plain squared error for keys too; amax = largest |x| "
        "/ fp8 max (llm-compressor's minmax)",
    )
    p.add_argument(
        "--tie-rope-pairs",
        action="store_true",
        help="pre-RoPE smoothed keys (int*-token-smooth-prerope): one smoothing factor per RoPE pair (channels d "
        "and d + D/2), which fused decode folds into the query (fewer kernel registers); costs some quality "
        "(BENCHMARKS.md section 21)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive,
        default=8192,
        help="tokens sampled per layer over all windows (bounds memory; default 8192)",
    )
    add_seed_arg(p, "sampling seed")
    add_dtype_device(
        p,
        DEVICES,
        note=". Only the passes run in it (in half precision the Fisher pass rounds the loss gradients): "
        "the samples are fitted in float32 on the CPU; the artifact records the dtype and device",
    )
    p.add_argument(
        "--json", action="store_true", help="print the artifact's JSON record instead of a summary"
    )
    add_threads_arg(p)
    add_bos_arg(p, note="; calibration.json's data \"bos\" says what ran, and kvbits eval warns when its windows differ")
    return p


def _summary(art: Any, shown_layers: int = 3) -> None:
    from rich.table import Table

    from kvbits._console import stdout_console
    from kvbits.calibrate.fit import FP8_PHASES

    console = stdout_console()
    m, d = art.meta["model"], art.meta["data"]
    console.print(f"[bold]calibration written to[/bold] {art.path}")
    console.print(
        f"scheme {art.scheme.name} | model {m.get('name') or m['model_type']} (fingerprint {m['fingerprint']}) | "
        f"data {d['name']}: {d['windows']} x {d['context']} tokens"
        f"{' (each the BOS token and context - 1 text tokens)' if d.get('bos') == 'always' else ''} | percentile {art.meta['percentile']} | "
        f"Fisher {'on' if art.meta['fisher'] else 'off'} | "
        f"{'smoothing factors tied over RoPE pairs | ' if art.meta.get('tie_rope_pairs') else ''}"
        f"{art.meta.get('dtype', '?')} on "
        f"{art.meta.get('device', '?')} | {art.meta.get('timing_s', {}).get('total', '?')} s"
    )
    stats = art.layer_stats
    cols = sorted({k for row in stats for k in row})
    # the caption explains the columns this scheme's statistics have, and only those
    stepped = any(c.endswith("scale_step") for c in cols)  # --fp8-scale centred / mse: the scale is raised
    meaning = {
        "clip_rate": "clip rate: entries beyond the calibrated range after outliers",
        "codebook_gain_db": "gain: weighted MSE of a uniform codebook over the fitted one",
        "absmax": "absmax: largest |x| stored, FP8 scale = absmax / fp8 max"
        + (f" x 2^(step / {FP8_PHASES})" if stepped else ""),
        "scale_step": "step: the phase of least squared error on the samples",
        "mse_gain_db": "mse gain: squared error at step 0 (absmax / fp8 max) over that at the chosen step",
    }
    said = [text for suffix, text in meaning.items() if any(c.endswith(suffix) for c in cols)]
    table = Table(title="per-layer calibration" + (f" ({'; '.join(said)})" if said else ""))
    table.add_column("layer", justify="right")
    for c in cols:
        table.add_column(c.replace("_db", "").replace("_", " "), justify="right")
    kv_layers = art.kv_layers  # stats: one row per layer the artifact holds (a hybrid model's attention layers)
    for i, row in enumerate(stats):
        table.add_row(
            str(kv_layers[i]) if i < len(kv_layers) else str(i),
            *(
                (
                    "-"
                    if c not in row
                    else _clip_rate(row[c])
                    if c.endswith("clip_rate")
                    else f"{row[c]:.4g}"
                    if c.endswith(("absmax", "scale_step"))
                    else f"{row[c]:+.2f} dB"
                )
                for c in cols
            ),
        )
    console.print(table)
    n = len(kv_layers)
    picks = sorted({kv_layers[0], kv_layers[n // 2], kv_layers[n - 1]})[:shown_layers]
    for side in ("key", "value"):
        for i in picks:
            cb = art.codebook(i, side)
            if cb is not None:
                console.print(
                    f"layer {i:>3} {side:<5} codebook: " + " ".join(f"{v:+.3f}" for v in cb.float().tolist())
                )


def _clip_rate(rate: float) -> str:
    """A layer's clip rate as a percentage with 3 decimals; one that rounds to 0 but is not is ``<0.001%``, not
    ``0.000%`` (which reads as nothing clipped), as the calibration report writes it."""
    text = f"{rate:.3%}"
    return "<0.001%" if rate > 0 and float(text[:-1]) == 0 else text


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.scheme)  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbits.calibrate.calibrate import calibrate, check_calibrate_args, fisher_weights
    from kvbits.calibrate.fit import check_options_apply, check_tie_rope_pairs
    from kvbits.evaluate.data import load_text
    from kvbits.evaluate.models import load_model
    from kvbits.evaluate.request import DTYPES

    # before the model loads: the scheme, the window sizes, the output folder, the dtype and the device
    scheme = check_calibrate_args(args.scheme, args.context, args.windows, args.out, dtype=args.dtype,
                                  device=args.device, overwrite=args.overwrite)  # fmt: skip
    check_tie_rope_pairs(scheme, args.tie_rope_pairs)
    # the options given; calibrate's own defaults stand for the others
    given = {k: v for k, v in (("percentile", args.percentile), ("fp8_scale", args.fp8_scale)) if v is not None}
    check_options_apply(scheme, percentile="percentile" in given, fp8_scale="fp8_scale" in given)

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=True,
        console=_stderr_console(),
    )
    tasks: dict[str, Any] = {}
    backward = not args.no_fisher and fisher_weights(scheme)  # calibrate skips it where nothing uses it

    def report(stage: str, done: int, total: int) -> None:
        label = {
            "windows": "forward+backward windows" if backward else "forward windows",
            "fit": "fitting layers",
        }.get(stage, stage)
        if stage not in tasks:
            tasks[stage] = progress.add_task(label, total=total)
        progress.update(tasks[stage], completed=done)

    apply_threads(args.threads)  # before the model loads
    text = load_text(args.data)  # a wrong --data fails before the model loads, not after
    with progress, on_device(args.device):  # cuda:N current: Triton launches on the current device's stream
        t = progress.add_task(f"loading {args.model}", total=None)
        loaded = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
        progress.remove_task(t)
        art = calibrate(
            loaded,
            text,
            args.scheme,
            context=args.context,
            windows=args.windows,
            fisher=not args.no_fisher,
            out_dir=args.out,
            max_tokens=args.max_tokens,
            seed=args.seed,
            progress=report,
            tie_rope_pairs=args.tie_rope_pairs,
            overwrite=args.overwrite,
            bos=args.bos,
            **given,
        )
    if args.json:
        sys.stdout.write(dumps({"path": str(art.path), **art.meta}, indent=2) + "\n")
    else:
        _summary(art)
    return 0


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)
