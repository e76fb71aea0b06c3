"""``kvbits analyze``: are there outlier channels in K and V? Per layer, with numbers, and what to do."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
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
    on_device,
)

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "mps")
"""Device types ``kvbits analyze`` runs on (checked before the model loads)."""

# kvbits.analyze.outliers' defaults, written out so that building the parser imports no torch
# (tests/test_cli_imports.py checks the two agree)
DEFAULT_THRESHOLD = 4.0
DEFAULT_LAYER_FRACTION = 0.25


_threshold = bounded(float, 1, lo_open=True, what="an outlier threshold")
_fraction = bounded(float, 0, 1, hi_open=True, what="a layer fraction")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive

    p = subparsers.add_parser(
        "analyze",
        help="find outlier channels in K (before/after RoPE) and V, per layer, and recommend a scheme",
        description="Run the model on calibration text with forward hooks and report, per layer: outlier "
        "channels (absmax > THRESHOLD x the median absmax of the head's live, non-zero channels) in pre-RoPE keys, post-RoPE keys and "
        "values; the share of the per-token quantization range they leave to ordinary channels; int4 "
        "SQNR per-token vs per-channel; and the scheme the decision flow recommends.",
        epilog="example:\n  kvbits analyze --model qwen2.5-coder-0.5b --data wikitext2 --context 512 --windows 2 "
        "--out runs/analyze-qwen",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="registry name (smollm2-135m), .gguf file, model folder or hub id",
        data_help="text: registry name, file path or hub:NAME (default wikitext2)",
        data_default="wikitext2",
    )
    add_window_args(p, context=2048, windows=2, windows_help="windows of --context tokens")
    p.add_argument(
        "--threshold",
        type=_threshold,
        default=DEFAULT_THRESHOLD,
        help="outlier rule: channel absmax > THRESHOLD x the median absmax of its head's live channels (absmax > 0; "
        f"a channel zero at every token is left out of the median) (default {DEFAULT_THRESHOLD:g})",
    )
    p.add_argument(
        "--layer-fraction",
        type=_fraction,
        default=DEFAULT_LAYER_FRACTION,
        help="recommend per-channel keys when more than this fraction of layers has key outlier channels "
        f"(default {DEFAULT_LAYER_FRACTION:g})",
    )
    p.add_argument(
        "--sample-tokens",
        type=_positive,
        default=4096,
        help="at most this many tokens per layer sampled for percentiles, ranges, SQNR and plots, in whole "
        "blocks of min(128, --context) tokens (default 4096; the JSON's sampled_tokens: how many were)",
    )
    add_bos_arg(p, note=" (the BOS's keys and values are analyzed with the text's, as a cache stores them; "
                "analysis.json's \"bos\" says what ran)")
    add_dtype_device(p, DEVICES)
    add_threads_arg(p)
    add_seed_arg(p, "sampling seed")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON instead of a table")
    p.add_argument(
        "--out", metavar="DIR", help="write analysis.json, channel_stats.safetensors and plots here"
    )
    p.add_argument(
        "--plot-layer", type=int, help="layer of the heatmap plot (default: the strongest outlier)"
    )
    p.add_argument(
        "--plot-head", type=int, help="KV head of the heatmap plot (default: the strongest outlier)"
    )
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from kvbits.analyze.collect import MIN_GROUP, analyze
    from kvbits.cli import EXIT_OK, _print_json
    from kvbits.evaluate.data import check_tokenized, load_text, make_windows, resolve_bos, tokenize
    from kvbits.evaluate.models import load_model
    from kvbits.evaluate.request import check_device

    check_device(args.device, DEVICES)  # before the model loads
    if args.context < MIN_GROUP:  # else a per-channel group of that many tokens is refused deep inside
        raise ValueError(f"--context {args.context} is too short: the analysis needs at least {MIN_GROUP} tokens "
                         "per window")  # fmt: skip
    plot = [f for f, v in (("--plot-layer", args.plot_layer), ("--plot-head", args.plot_head)) if v is not None]
    if plot and args.out is None:  # the heatmap is written to --out only: the flags would be ignored
        raise ValueError(f"{' and '.join(plot)} choose the heatmap written to --out: add --out DIR")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} exists and is not a folder; expected a folder for the outputs")
    apply_threads(args.threads)  # before the model loads
    text = load_text(args.data)  # a wrong --data fails before the model loads, not after
    with on_device(args.device):  # cuda:N current: Triton launches on the current device's stream
        lm = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
        _check_plot_args(lm.model, args)  # before the analysis and its outputs, not after
        ids = tokenize(text, lm.tokenizer)
        check_tokenized(ids, lm.tokenizer, lm.model, f"the text {text.name!r}")  # before analyze()'s forwards
        bos_id = resolve_bos(lm.tokenizer, args.bos)
        windows = make_windows(ids, args.context, args.windows, bos_id)
        logger.info("analyzing %s on %s: %d window(s) of %d tokens", lm.source.name, text.name, *windows.shape)
        sample_tokens = max(args.sample_tokens, min(128, windows.shape[1]))  # analyze() needs one whole block
        if sample_tokens != args.sample_tokens:
            logger.warning("--sample-tokens %d raised to %d: the analysis samples whole blocks of %d tokens",
                           args.sample_tokens, sample_tokens, sample_tokens)  # fmt: skip
        result = analyze(
            lm.model,
            windows,
            threshold=args.threshold,
            layer_fraction=args.layer_fraction,
            sample_tokens=sample_tokens,
            seed=args.seed,
            model_name=args.model,
            data_name=args.data,
            fingerprint=lm.fingerprint,
            keep_samples=args.out is not None,
            progress=lambda done, total: logger.info("window %d/%d done", done, total),
            bos="never" if bos_id is None else "always",
        )
    written = _write_outputs(result, args) if args.out else []
    if args.json:
        _print_json(result.to_dict())
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
        return EXIT_OK
    _print_table(result, written)
    return EXIT_OK


def _check_plot_args(model: Any, args: argparse.Namespace) -> None:
    """``--plot-layer``/``--plot-head`` against the model's attention layers and KV heads."""
    from kvbits.analyze.collect import analysis_sites

    sites = analysis_sites(model)
    layers = [s.layer_idx for s in sites]
    if args.plot_layer is not None and args.plot_layer not in layers:
        raise ValueError(f"--plot-layer must be one of the attention layers {layers}, got {args.plot_layer}")
    if args.plot_head is None:
        return
    # per layer: Gemma 4's global layers may have fewer KV heads than its sliding ones
    if args.plot_layer is not None:
        heads = next(s.num_kv_heads for s in sites if s.layer_idx == args.plot_layer)
        if not 0 <= args.plot_head < heads:
            raise ValueError(
                f"--plot-head must be a KV head of layer {args.plot_layer} in [0, {heads}), got {args.plot_head}"
            )
        return
    heads = max(s.num_kv_heads for s in sites)  # the heatmap's layer is then one that has the head
    if not 0 <= args.plot_head < heads:
        raise ValueError(f"--plot-head must be a KV head in [0, {heads}), got {args.plot_head}")


def _write_outputs(result: Any, args: argparse.Namespace) -> list[str]:
    paths = result.save(args.out)
    written = [str(p) for p in paths.values()]
    try:
        from kvbits.analyze.plots import plot_key_heatmaps, plot_layer_summary

        out = Path(args.out)
        written.append(
            str(
                plot_key_heatmaps(result, out / "key_heatmap.png", layer=args.plot_layer, head=args.plot_head)
            )
        )
        written.append(str(plot_layer_summary(result, out / "layers.png")))
    except ImportError as exc:
        logger.warning("no plots: %s", exc)
    return written


def _db(v: Any) -> str:
    """An SQNR cell: ``inf`` for an exact reconstruction (a layer of zeros, K/V the int4 grid holds), ``-`` for no
    figure (None, NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if v == math.inf else f"{v:.1f}"


def _channels(chs: list[list[int]], limit: int = 4) -> str:
    if not chs:
        return "-"
    txt = " ".join(f"h{h}:c{c}" for h, c in chs[:limit])
    return txt + (f" +{len(chs) - limit}" if len(chs) > limit else "")


def _print_table(result: Any, written: list[str]) -> None:
    from rich.table import Table

    from kvbits.cli import _console

    d = result.to_dict()
    table = Table(
        title=f"kvbits analyze: {d['model']} on {d['data']}, {d['windows']} x {d['context']} tokens",
        caption=f"outlier channel: absmax > {d['threshold']:g}x the median absmax of its KV head's live (non-zero) channels "
        f"(threshold {d['threshold']:g}); range used = median over tokens of max|x| of ordinary channels / "
        "max|x| (per-token scaling, worst head; per-channel scaling: 1); SQNR of int4 asymmetric, "
        f"per-token vs per-channel over {d['channel_group']} tokens",
    )
    for col, kw in (
        ("layer", {"justify": "right"}),
        ("K outliers pre-RoPE", {}),
        ("K outliers post-RoPE", {}),
        ("V outliers", {}),
        ("K range used", {"justify": "right"}),
        ("K pre SQNR tok/ch", {"justify": "right"}),
        ("K post SQNR tok/ch", {"justify": "right"}),
        ("V SQNR tok/ch", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    for r in d["layers"]:
        kpre, kpost, v = r["key_pre_rope"], r["key_post_rope"], r["value"]
        used = kpre["range_used_per_token"]
        table.add_row(
            str(r["layer"]),
            _channels(r["key_outlier_channels_pre_rope"]),
            _channels(r["key_outlier_channels_post_rope"]) if kpost else "n/a",
            _channels(r["value_outlier_channels"]),
            "-" if used is None or not math.isfinite(used) else f"{used:.2f}",
            f"{_db(kpre['sqnr_int4_token'])} / {_db(kpre['sqnr_int4_channel'])}",
            f"{_db(kpost['sqnr_int4_token'])} / {_db(kpost['sqnr_int4_channel'])}" if kpost else "n/a",
            f"{_db(v['sqnr_int4_token'])} / {_db(v['sqnr_int4_channel'])}",
        )
    console = _console()
    console.print(table)
    rec = d["recommendation"]
    console.print(
        f"[bold]keys:[/bold] {rec['keys']}   [bold]values:[/bold] {rec['values']}   "
        f"[bold]scheme:[/bold] {rec['scheme']}"
        + (f"   [bold]calibrated:[/bold] {rec['calibrated_scheme']}" if rec.get("calibrated_scheme") else "")
        + (f"   [bold]per-token:[/bold] {rec['per_token_scheme']}" if rec.get("per_token_scheme") else "")
    )
    console.print(rec["reason"], markup=False)
    for step in rec["next_steps"]:
        console.print(f"  next: {step}", markup=False)
    for path in written:
        console.print(f"wrote {path}", markup=False)
