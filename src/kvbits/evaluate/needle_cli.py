"""``kvbits needle``: passkey retrieval by context length and depth (thin wrapper over ``needle_eval``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvbits._argtypes import (
    FUSED_DECODE,
    add_bos_arg,
    add_calibration_arg,
    add_dtype_device,
    add_model_data_args,
    add_seed_arg,
    add_summary_output_args,
    add_threads_arg,
    apply_threads,
    bounded,
    check_overwrite_has_out,
    check_scheme_args,
    emit_summary,
    on_device,
)
from kvbits.evaluate.data import DATA_PATH_HELP

__all__ = ["add_parser", "parse_depths", "run"]

EPILOG = """\
examples:
  kvbits needle --model smollm2-135m --context 2k --context 4k --context 8k --trials 2 \\
      --scheme int8-token --scheme int4-token --scheme kivi-2 --out runs/needle-smollm2
  kvbits needle --model qwen2.5-coder-0.5b --context 8k --depths 0.1,0.5,0.9 --scheme int4-token \\
      --scheme int4-channel --semantics decode --json

A trial hides "The pass key is 71432. Remember it. 71432 is the pass key." at a depth of a slice of real
text (--data, War and Peace by default), asks "What is the pass key? The pass key is" and teacher-forces
the key: it is retrieved when every key token is the argmax (exactly when greedy decoding writes the
key). --semantics prefill (default): the document is prefilled in full precision and stored in each
scheme's real cache, the question and key are decoded token by token over it; decode: every token
attends over the quantized history (the one-pass simulator, kvbits eval's semantics).
--json prints the summary: {"version", "task", "model", "data", "bos", "bos_token" and "bos_token_id" (with a BOS
only), "semantics", "dtype", "contexts", "depths",
"trials", "seed", "fingerprint", "reference": {"retrieved", "nll", "grid", "by_context"}, "results":
[{"scheme", "avg_bits", "retrieved", "kept", "gained", "token_acc", "nll", "delta_nll", "kl",
"by_context": [{"context", "trials", "retrieved", "retrieved_ref", "nll", "nll_ref", "kl",
"cache_bytes", "cache_bytes_ref"}], "grid", "calibration", "seconds", "decode"}], "records",
"reference_seconds", "wall_seconds", "peak_rss_bytes", "date", "commit", "versions"}. grid: contexts x
depths, fraction retrieved; kept: of the trials the reference retrieved, the fraction the scheme did;
gained: trials the scheme retrieved and the reference did not; calibration (with --calibration): as kvbits eval's,
with "calibrated_on_eval_text" (the calibration was fitted on the haystack's text: warned before the run) and
"calibration_overlap_tokens" (haystack tokens of the trials inside its calibration windows); dtype: the one the model ran in (--dtype, else the
model's own; kvbits eval's config.json records the --dtype asked for, null without one). --out DIR writes
needle.json (the same), report.md and needle.png.
"""


def parse_depths(text: str) -> list[float]:
    """``"0,0.25,0.5"`` -> ``[0.0, 0.25, 0.5]``; each in [0, 1], no two within the depth resolution (1e-4)."""
    from kvbits.evaluate.needle import check_depths

    parse = bounded(float, 0, 1, what="a depth")
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated depths in [0, 1], got {text!r}")
    depths = [parse(t) for t in items]
    try:
        check_depths(depths)  # depths that share a trial seed are refused before the model loads
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return depths


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive, parse_tokens
    from kvbits.evaluate.cli import DEVICES

    p = subparsers.add_parser(
        "needle",
        help="passkey retrieval by context length and needle depth, quantized caches vs the unquantized model",
        description="Hide a pass key in real text at several depths and context lengths, ask for it, and measure "
        "whether each scheme's cache still lets the model retrieve it (and the key's NLL and KL) against the "
        "unquantized model on the same trials.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="registry name (smollm2-135m, qwen2.5-coder-0.5b), .gguf file, model folder or hub id",
        data_help="the haystack: registry text (war-and-peace, wikitext2, ...) or a text file (default war-and-peace)",
        data_default="war-and-peace",
        data_path_help=DATA_PATH_HELP,
    )
    p.add_argument(
        "--context", action="append", type=parse_tokens, required=True, metavar="N",
        help="total tokens per trial, e.g. 4096 or 4k; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--depths", type=parse_depths, default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] of the haystack, comma-separated (default 0,0.25,0.5,0.75,1)",
    )  # fmt: skip
    p.add_argument("--trials", type=_positive, default=1, help="trials per context and depth (default 1)")
    p.add_argument(
        "--scheme", action="append", required=True, metavar="S",
        help="scheme preset, scheme JSON file, or peer (hf-quanto-int4, prefill semantics); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--semantics", choices=("prefill", "decode"), default="prefill",
        help="prefill: document prefilled exactly, stored in the real cache, question decoded over it (default); "
        "decode: every token attends over the quantized history (simulator)",
    )  # fmt: skip
    p.add_argument(
        "--fused-decode", choices=("auto", "on", "off"), default="auto",
        help="prefill semantics: decode steps through the fused kernel (auto: on CUDA with Triton; default auto)",
    )  # fmt: skip
    add_calibration_arg(p)
    p.add_argument("--digits", type=bounded(int, 1, 18), default=5, help="digits of the pass key (default 5)")
    p.add_argument(
        "--needle", help="needle text with {key} (default: 'The pass key is {key}. Remember it. ...')"
    )
    p.add_argument(
        "--question",
        help="question text ending with {key} (default 'What is the pass key? The pass key is {key}')",
    )
    add_seed_arg(p, "seed of the keys and haystack offsets")
    add_bos_arg(p, note=" (each trial: the BOS, then the haystack one token shorter; needle.json's \"bos\" says what "
                "ran, and runs with and without a BOS do not merge)")
    p.add_argument(
        "--chunk-size", type=_positive, default=256,
        help="queries per simulated attention chunk (default 256; --semantics decode only, another value with "
        "prefill semantics is refused)",
    )  # fmt: skip
    add_summary_output_args(p, "needle")
    add_dtype_device(p, DEVICES)
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.scheme, peers=True)  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from kvbits.evaluate.needle import NeedleTask
    from kvbits.evaluate.needle_run import needle_eval
    from kvbits.evaluate.request import check_device

    if args.fused_decode != "auto" and args.semantics != "prefill":
        raise ValueError(
            f"--fused-decode {args.fused_decode} needs --semantics prefill (decode runs the simulator)"
        )
    defaults = NeedleTask()
    task = NeedleTask(
        needle=args.needle if args.needle is not None else defaults.needle,
        question=args.question if args.question is not None else defaults.question,
        digits=args.digits,
    )
    check_overwrite_has_out(args)
    check_device(args.device)
    if args.out:  # refused before the model loads, not after the trials ran
        from kvbits.report.needle import check_needle_out

        check_needle_out(args.out, overwrite=args.overwrite)
    apply_threads(args.threads)  # before needle_eval() loads the model
    with on_device(args.device):  # cuda:N current: Triton launches on the current device's stream
        summary = needle_eval(
            args.model, args.context, args.scheme, data=args.data, depths=args.depths, trials=args.trials, task=task,
            semantics=args.semantics, calibration=args.calibration,
            fused_decode=FUSED_DECODE[args.fused_decode], data_path=args.data_path,
            dtype=args.dtype, device=args.device, chunk_size=args.chunk_size, seed=args.seed,
            progress=not (args.no_progress or args.json), bos=args.bos,
        )  # fmt: skip
    from kvbits.report.needle import write_needle

    return emit_summary(summary, args, write_needle, _print)


def _print(summary: dict, out: str | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvbits._console import stdout_console
    from kvbits.report.fmt import bos_phrase, fmt_pos
    from kvbits.report.needle import _pct, kept_cell

    console = stdout_console()
    contexts, depths = summary["contexts"], summary["depths"]
    table = Table(
        title=f"passkey retrieved, {summary['model']} on {summary['data']} ({summary['semantics']} semantics)"
    )
    table.add_column("scheme")
    table.add_column("bits", justify="right")
    for c in contexts:
        table.add_column(fmt_pos(c), justify="right")
    table.add_column("all", justify="right")
    table.add_column("kept (95% interval)", justify="right")
    table.add_column("ΔNLL key", justify="right")
    ref = summary["reference"]
    table.add_row(
        "unquantized", "", *(_pct(b["retrieved"]) for b in ref["by_context"]), _pct(ref["retrieved"]), "", ""
    )
    for r in summary["results"]:
        table.add_row(
            r["scheme"], f"{r['avg_bits']:.2f}", *(_pct(b["retrieved"]) for b in r["by_context"]), _pct(r["retrieved"]),
            kept_cell(summary, r["scheme"]), f"{r['delta_nll']:+.3f}",
        )  # fmt: skip
    console.print(table)
    bos = bos_phrase(summary, markdown=False)
    console.print(f"{len(summary['records'])} trials: {len(contexts)} context(s) x {len(depths)} depth(s) x "
                  f"{summary['trials']}" + ("" if bos is None else f", each starting with {escape(bos)}")
                  + f"; {summary['wall_seconds']:.0f} s")  # fmt: skip
    if out:
        figure = " and needle.png" if (Path(out) / "needle.png").is_file() else " (no figure)"
        console.print(f"wrote {out}/needle.json, report.md{figure}")
