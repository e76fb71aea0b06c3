"""``kvbits speed``: decode throughput and cache memory by scheme (thin wrapper over ``speed_eval``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvbits._argtypes import (
    FUSED_DECODE,
    add_bos_arg,
    add_calibration_arg,
    add_dtype_device,
    add_model_data_args,
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
from kvbits.evaluate.sdpa import SDPA_MODES

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  kvbits speed --model smollm2-135m --context 1k --context 4k --batch 1 --batch 4 \\
      --scheme int8-token --scheme kivi-4 --scheme kivi-2 --out runs/speed-smollm2
  kvbits speed --model qwen2.5-coder-0.5b --context 32k --batch 8 --scheme kivi-4 --device cuda --dtype float16

Each (context, batch) prefills the prompts (real text, one window per sequence) once in full precision,
loads their K/V into each cache (transformers' DynamicCache first: the baseline), then decodes
--warmup + --tokens greedy steps through it, timing each of the last --tokens on its own. kvbits decode
steps run the fused kernel where --fused-decode auto picks it (CUDA with Triton); elsewhere they
dequantize the history every step (--workspace: keep a dequantized copy instead: faster, and it holds the
float history too). CPU figures time the torch paths, not the GPU kernel.
--static: kvbits schemes decode through StaticQuantizedKVCache (fixed slabs, lengths on the device), and
transformers' StaticCache is timed as a second baseline; --graphs (with --static, on CUDA): the static caches'
decode steps are replayed from a captured CUDA graph after 2 eager steps and the captured one (warm-up); a windowed
scheme's flushing step is a graph of its own, run eagerly at its first flush and captured at its second. A hybrid
model's conv / linear-attention / Mamba states are held unquantized beside the static K/V (--static), but --graphs
refuses them (their captured replay is not verified).
--json prints the summary: {"version", "model", "data", "bos", "bos_token" and "bos_token_id" (with a BOS only),
"device", "dtype", "contexts", "batches",
"tokens", "warmup", "fused_decode", "workspace", "reserve", "static", "graphs", "baselines", "sdpa",
"kernel_settings", "tuned_launches", "layers", "schemes",
"runs": [{"cache", "path", "context", "batch", "cached_tokens", "ms_per_step", "ms_p10", "ms_p90", "ms_mean",
"tokens_per_s", "speedup", "host_ms_per_step", "step_ms", "cache_bytes", "linear_state_bytes", "workspace_bytes", "planned_bytes", "cuda_resident_bytes",
"cuda_peak_bytes", "cuda_graph_bytes", "decode", "graph", "agreement", "first_divergence", "prefill_seconds", "distinct_rows"}],
a run that raised (out of memory, a refused scheme) is recorded as {"cache", "path", "context", "batch",
"cached_tokens", "distinct_rows", "prefill_seconds", "error": {"type", "message"}} and the others go on; the
report reads its cells "failed: <type>", and the command exits 1 after writing everything (speedup and
agreement are null where the cell's DynamicCache run failed).
"fingerprint", "wall_seconds",
"peak_rss_bytes", "date", "commit", "versions"}. speedup: tokens/s over DynamicCache's at the same context
and batch. --out DIR writes speed.json (the same), report.md and speed.png.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive, parse_tokens
    from kvbits.evaluate.cli import DEVICES

    p = subparsers.add_parser(
        "speed",
        help="decode tokens/s and cache memory of each scheme against transformers' DynamicCache",
        description="Prefill real prompts, then time greedy decode steps through each scheme's real cache and "
        "through DynamicCache at each context and batch: tokens/s, step-time spread, the bytes each cache holds "
        "(against kvbits plan), and whether the greedy tokens stay the same.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="registry name (smollm2-135m, qwen2.5-coder-0.5b), .gguf file, model folder or hub id",
        data_help="the prompts: registry text (war-and-peace, wikitext2, ...) or a text file (default war-and-peace)",
        data_default="war-and-peace",
        data_path_help=DATA_PATH_HELP,
    )
    p.add_argument(
        "--context", action="append", type=parse_tokens, required=True, metavar="N",
        help="prompt tokens per sequence, e.g. 4096 or 4k; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--batch",
        action="append",
        type=_positive,
        metavar="B",
        help="sequences decoded at once; repeatable (default 1)",
    )
    p.add_argument(
        "--scheme", action="append", required=True, metavar="S",
        help="scheme preset, scheme JSON file, or peer (hf-quanto-int4); repeatable",
    )  # fmt: skip
    p.add_argument("--tokens", type=_positive, default=32, help="timed decode steps per run (default 32)")
    p.add_argument(
        "--warmup", type=bounded(int, 0), default=4, help="untimed decode steps before them (default 4)"
    )
    p.add_argument(
        "--fused-decode", choices=("auto", "on", "off"), default="auto",
        help="kvbits decode steps through the fused kernel (auto: on CUDA with Triton; on: also on CPU, through "
        "the torch reference, a correctness path; default auto)",
    )  # fmt: skip
    p.add_argument(
        "--workspace", action="store_true",
        help="without the fused path: keep a dequantized history instead of dequantizing every step",
    )  # fmt: skip
    p.add_argument(
        "--grow", action="store_true",
        help="kvbits caches grow by concatenation (a copy of the quantized history per flush) instead of "
        "reserving storage for the run's tokens (max_cache_len), as every run before the option did",
    )  # fmt: skip
    p.add_argument(
        "--static", action="store_true",
        help="kvbits schemes decode through StaticQuantizedKVCache (fixed slabs, as transformers' StaticCache, which "
        "is timed beside DynamicCache); per-token and KIVI-style schemes and static FP8",
    )  # fmt: skip
    p.add_argument(
        "--graphs", action="store_true",
        help="with --static, on CUDA: replay each static cache's decode step from one captured CUDA graph (not for "
        "hybrid models with conv / linear-attention / Mamba states)",
    )  # fmt: skip
    p.add_argument(
        "--sdpa", choices=SDPA_MODES, default=SDPA_MODES[0],
        help="SDPA's backends for the DynamicCache baseline, the dequantizing paths and the prefill (auto: torch's "
        "choice; no-cudnn: flash, memory-efficient or math, since cuDNN builds a plan for every new key length, "
        "that is, every decode step; default auto)",
    )  # fmt: skip
    add_calibration_arg(p)
    add_threads_arg(p)
    add_bos_arg(p, note=" (the prompts: the BOS and context - 1 text tokens); speed.json's \"bos\" says what ran")
    add_summary_output_args(p, "speed")
    add_dtype_device(p, DEVICES)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.scheme, peers=True)  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from kvbits.evaluate.request import check_device
    from kvbits.evaluate.speed import speed_eval

    if args.workspace and args.fused_decode == "on":
        raise ValueError(
            "--workspace keeps a dequantized history for the dequantizing path; --fused-decode on never reads it"
        )
    if args.graphs and not args.static:
        raise ValueError("--graphs replays the decode steps of the static caches: add --static")
    if args.static and (args.grow or args.workspace):
        raise ValueError(f"--static reserves every slot and holds no workspace; drop {'--grow' if args.grow else '--workspace'}")
    check_overwrite_has_out(args)
    if args.graphs and not str(args.device).startswith("cuda"):  # refused before the model loads, not after
        raise ValueError(f"--graphs replays decode steps from captured CUDA graphs: it needs --device cuda, got "
                         f"--device {args.device}")  # fmt: skip
    check_device(args.device)
    if args.out:  # refused before the model loads, not after the runs
        from kvbits.report.speed import check_speed_out

        check_speed_out(args.out, overwrite=args.overwrite)
    apply_threads(args.threads)
    with on_device(args.device):  # cuda:N current: Triton launches on the current device's stream
        summary = speed_eval(
            args.model, args.context, args.scheme, batches=args.batch or [1], tokens=args.tokens, warmup=args.warmup,
            data=args.data, calibration=args.calibration,
            fused_decode=FUSED_DECODE[args.fused_decode], workspace=args.workspace, reserve=not args.grow,
            static=args.static, graphs=args.graphs, sdpa=args.sdpa,
            data_path=args.data_path, dtype=args.dtype, device=args.device,
            progress=not (args.no_progress or args.json), bos=args.bos,
        )  # fmt: skip
    from kvbits.evaluate.speed import failed_cells
    from kvbits.report.speed import write_speed

    code = emit_summary(summary, args, write_speed, _print)
    failed = failed_cells(summary["runs"])
    if failed:  # after the summary is written: the other runs are kept, the exit status says some failed
        print(f"kvbits speed: {sum(bool(r.get('error')) for r in summary['runs'])} of {len(summary['runs'])} runs "
              f"failed: {failed} (their messages: report.md, speed.json's runs[].error)", file=sys.stderr)  # fmt: skip
        return 1
    return code


def _print(summary: dict, out: str | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvbits._console import stdout_console
    from kvbits.report.fmt import bos_phrase, fmt_bytes, fmt_float_sig, fmt_pos
    from kvbits.report.speed import held_beside

    console = stdout_console()
    for batch in summary["batches"]:
        table = Table(title=f"decode tokens/s (x DynamicCache) and cache bytes, {summary['model']}, batch {batch}, "
                      f"{summary['device']['name']}")  # fmt: skip
        table.add_column("cache")
        table.add_column("path")
        for c in summary["contexts"]:
            table.add_column(fmt_pos(c), justify="right")
        names = summary.get("baselines", ["DynamicCache"]) + [s["scheme"] for s in summary["schemes"]]
        for name in names:
            rows = {r["context"]: r for r in summary["runs"] if r["cache"] == name and r["batch"] == batch}
            cells = []
            for c in summary["contexts"]:
                r = rows.get(c)
                if r is None:
                    cells.append("n/a")
                    continue
                if r.get("error"):
                    cells.append(f"failed: {r['error']['type']}")
                    continue
                size = "" if r["cache_bytes"] is None else f", {fmt_bytes(r['cache_bytes'])}"
                size += held_beside(r)
                factor = "" if r["speedup"] is None else f" ({fmt_float_sig(r['speedup'], 2)}x)"  # None: baseline failed
                cells.append(f"{fmt_float_sig(r['tokens_per_s'], 1)}{factor}{size}")
            path = next(iter(rows.values()))["path"] if rows else ""
            table.add_row(name, path, *cells)
        console.print(table)
    bos = bos_phrase(summary, markdown=False)
    console.print(
        f"{len(summary['runs'])} runs, {summary['tokens']} timed steps each"
        + ("" if bos is None else f", each prompt starting with {escape(bos)}")
        + f"; {summary['wall_seconds']:.0f} s"
    )
    if out:
        figure = " and speed.png" if (Path(out) / "speed.png").is_file() else " (no figure)"
        console.print(f"wrote {out}/speed.json, report.md{figure}")
