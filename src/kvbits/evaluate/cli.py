"""``kvbits eval``: damage of each scheme by context position (thin wrapper over ``runner.evaluate``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvbits._argtypes import (
    FUSED_DECODE,
    add_bos_arg,
    add_calibration_arg,
    add_dtype_device,
    add_model_data_args,
    add_seed_arg,
    add_threads_arg,
    add_window_args,
    apply_threads,
    bounded,
    check_overwrite_has_out,
    check_scheme_args,
    on_device,
)
from kvbits._json import dumps
from kvbits.evaluate.data import DATA_PATH_HELP

__all__ = ["DEVICES", "add_parser", "run"]

DEVICES = ("cpu", "cuda")
"""Device types ``kvbits eval`` runs on (``check_device`` in ``evaluate``, before the model loads)."""

EPILOG = """\
examples:
  kvbits eval --model smollm2-135m --data wikitext2 --context 8192 --windows 2 \\
      --scheme int8-token --scheme kivi-2 --scheme int2-token --out runs/smollm2-8k
  kvbits eval --model smollm2-135m --data wikitext2 --context 512 --scheme kivi-4 \\
      --scheme hf-quanto-int4 --mode stream --json

--json prints exactly: {"model", "data", "context", "semantics", "mode", "windows", "bos", "bos_token" and "bos_token_id" (with a BOS only),
"fingerprint": {"model", "tokens"}, "results": [{"scheme", "avg_bits", "bits_at_context", "ppl", "ppl_ref", "kl",
"top1", "buckets": [{"lo", "hi", "tokens", "ppl", "ppl_ref", "delta_rel", "delta_rel_ci", "kl",
"top1"}], "attn_error": [{"layer", "buckets": [{"lo", "hi", "rel_err"}]}], "attn_entropy": [{"layer",
"buckets": [{"lo", "hi", "entropy", "entropy_ref", "delta"}]}], "generation": {"prompt_tokens",
"new_tokens", "rep_n", "rep", "rep_ref", "agreement", "first_divergence", "first_divergence_mean",
"seconds", "reference_seconds"} (with --generate; null otherwise), "calibration":
{"clipped_keys", "clipped_keys_frac", "clipped_values", "clipped_values_frac" (kvbits schemes),
"integer_zero" (the sides vllm-int4's integer zero-points store, which clip where a token's range excludes 0),
"max_calibrated_length", "positions_beyond_calibrated", "generation_positions_beyond_calibrated" (with
--generate N: of the context + N positions its continuations reach), "artifact": {"id", "path", "data",
"context", "windows", "tokens"}, "calibrated_on_eval_text" (the calibration's data has the evaluated text's
sha256, or its token ids' (a file and its (N,) ids alike): its figures are flattered, a warning says so, also
when --out reuses the finished run; null where either records none),
"calibration_overlap_tokens" (evaluated tokens inside its calibration windows; null where not recorded) (with
--calibration)}, "seconds", "decode": {"fused_steps",
"fallback_steps"} (stream mode, kvbits schemes; null otherwise)}], "reference_seconds",
"wall_seconds", "world_size", "peak_rss_bytes", "run_peak_rss_bytes", "peak_cuda_bytes"}.
avg_bits: bits per element in the long run (residual window, sinks and sliding-window layers amortised away); bits_at_context: what the
cache stores per element at this --context, metadata, sinks and the full-precision window included (in the
dtype the model runs in), as `kvbits plan --model MODEL --context N --dtype-bytes B` counts it with B that dtype's
bytes (4 for the default float32; plan's own default is the config's dtype, else 2: smollm2-135m's kivi-2 at 512
tokens is 10.25 here in float32, 6.25 in plan's default table; kvbits' kivi-2 preset stores 3.0 in the long
run and, at 128 tokens, where nothing is quantized yet, 16 in bfloat16, 32 in float32); for a peer cache
(hf-quanto-int4 / hf-quanto-int2, transformers' QuantizedCache), the bytes that cache really holds once a window
is through (quanto's codes, scales, zero-points and full-precision residual of 128 tokens).
wall_seconds: the loop over the windows; world_size: the ranks that ran. peak_rss_bytes: the process's peak
resident set in bytes (getrusage ru_maxrss, model loading included; null where unavailable);
run_peak_rss_bytes: the resident peak from the loaded model to the end of the run (Linux VmHWM
reset through /proc/self/clear_refs; null elsewhere); peak_cuda_bytes: torch.cuda.max_memory_allocated
over the run with --device cuda (weights included), null on CPU.
Buckets are query positions t (predicting token t + 1): [0,1K), [1K,2K), [2K,4K), ... cut at the
context; delta_rel = PPL / PPL_ref - 1 with a 95% paired bootstrap interval over 128-token chunks
(NaN where a bucket holds one chunk: one window, at most 128 positions);
kl = mean KL(reference || scheme) in nats. attn_entropy: mean entropy (nats, mean over query heads) of
each query's attention with the quantized K/V (entropy) and with exact K/V for the same queries
(entropy_ref), delta = entropy - entropy_ref (> 0: flatter, < 0: sharper), simulate mode.
--generate N: after each window, N greedy tokens with the window as the prompt, from the unquantized
model (DynamicCache) and from each scheme's real cache; rep = {"1", "2", "4"}: rep-n = 1 - distinct
n-grams / n-grams of the continuation, mean over windows (rep_ref: the reference's); agreement: the
fraction of positions equal to the reference's token; first_divergence: per window, the first position
that differs (N: none). The continuations are written to --out/generations.jsonl.

data-parallel, torch.distributed (one process per rank, started by torchrun):
  torchrun --nproc-per-node 2 -m kvbits eval --model smollm2-135m --data war-and-peace \\
      --context 8k --windows 4 --scheme kivi-2 --out runs/smollm2-8k
With WORLD_SIZE > 1 kvbits eval starts the process group (gloo; nccl with --device cuda, each rank on
cuda:$LOCAL_RANK) and rank r evaluates the windows w with w % WORLD_SIZE == r. The numbers equal a
single process's (per-token arrays bit for bit); seconds and reference_seconds are summed over the
ranks, wall_seconds is the slowest rank's, memory peaks the largest rank's. Rank 0 alone prints,
shows progress and writes --out; the rank count is not part of the run's identity (config.json
records it), so a finished run is reused by any number of ranks. On the CPU each rank takes
cores / ranks-per-machine threads unless --threads says otherwise.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive, parse_tokens

    p = subparsers.add_parser(
        "eval",
        help="perplexity, KL and top-1 damage of KV schemes, by context position",
        description="Measure KV-cache schemes against the unquantized model, by position bucket. The "
        "reference is computed once per window and shared by all schemes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="registry name (smollm2-135m, qwen2.5-coder-0.5b), .gguf file, model folder or hub id",
        data_help="registry text (wikitext2, war-and-peace, ...) or a text file",
        data_path_help=DATA_PATH_HELP,
    )
    add_window_args(p, context=8192, windows=1)
    add_bos_arg(p, note=", the BOS not scored; the summary's \"bos\" says what ran (\"always\" / \"never\")")
    p.add_argument(
        "--scheme",
        action="append",
        required=True,
        metavar="S",
        help="scheme preset, scheme JSON file, or peer (hf-quanto-int4, hf-quanto-int2; stream mode); repeatable",
    )
    p.add_argument(
        "--mode",
        choices=("simulate", "stream"),
        default="simulate",
        help="simulate: one pass per window (fast; the default); stream: the real cache token by token (ground truth, "
        "slow: one forward per token, ~0.14 s per token and scheme for smollm2-135m on one busy CPU core, "
        "hf-quanto-int4 no slower than kvbits' fp16 there; on a loaded 2-core machine two threads were 4x slower: try "
        "--threads 1)",
    )
    p.add_argument(
        "--fused-decode",
        choices=("auto", "on", "off"),
        default="auto",
        help="stream mode: decode steps through the fused kernel over the packed cache (auto: on CUDA with "
        "Triton, as a server would run it; on: anywhere, the torch reference on CPU; off: dequantize + SDPA; "
        "default auto)",
    )
    p.add_argument(
        "--semantics",
        choices=("decode", "prefill"),
        default="decode",
        help="decode: every token generated through the cache (default); prefill: the first --prompt-len tokens "
        "prefilled in full precision, only the continuation scored",
    )
    p.add_argument(
        "--prompt-len",
        type=parse_tokens,
        help="prompt tokens (required with --semantics prefill; fewer than context - 1)",
    )
    p.add_argument(
        "--attn-layers",
        type=int,
        nargs="*",
        metavar="L",
        help="layers whose attention-output error is recorded, simulate mode only (default: 3 evenly "
        "spaced among the layers with attention; the flag with no layer after it records none)",
    )
    p.add_argument(
        "--generate",
        type=bounded(int, 0, what="a token count"),
        default=0,
        metavar="N",
        help="after scoring each window, greedily generate N tokens from it with the unquantized model and "
        "with each scheme's real cache: repetition (rep-1/2/4) and agreement with the reference continuation "
        "(default 0: off; any mode, and under torchrun)",
    )
    add_calibration_arg(p)
    p.add_argument(
        "--out",
        help="output folder (config.json, summary.json, records.jsonl, tokens/, report). A finished run of the same "
        "settings there is reused; one another kvbits version recorded, or an older output version, is "
        "recomputed (with a warning)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="recompute even if --out holds a finished or different run; also write into a non-empty folder "
        "kvbits did not write (only the files kvbits eval writes are replaced, nothing else is deleted)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (nothing else)")
    add_dtype_device(p, DEVICES)
    p.add_argument(
        "--chunk-size",
        type=_positive,
        default=256,
        help="queries per simulated attention chunk (default 256; simulate mode only, another value with "
        "--mode stream is refused)",
    )
    add_seed_arg(p, "bootstrap seed")
    add_threads_arg(p, note=" (--mode stream); under torchrun the default is cores / ranks on this machine, per rank")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.scheme, peers=True)  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from kvbits.evaluate.runner import evaluate

    if args.prompt_len is not None and args.semantics != "prefill":
        raise ValueError("--prompt-len needs --semantics prefill")
    if args.semantics == "prefill" and args.prompt_len is None:
        raise ValueError("--semantics prefill needs --prompt-len N: the prompt tokens prefilled in full precision "
                         f"(fewer than --context - 1 = {args.context - 1})")  # fmt: skip
    check_overwrite_has_out(args)
    if args.fused_decode != "auto" and args.mode != "stream":
        raise ValueError(
            f"--fused-decode {args.fused_decode} needs --mode stream (simulate never decodes through the cache)"
        )
    import torch

    from kvbits.evaluate.distributed import env_world, init_from_env

    rank, world, local_world = env_world()  # torchrun's environment; (0, 1, 1) without it
    if args.threads is not None:
        apply_threads(args.threads)
    elif world > 1 and not str(args.device).startswith("cuda"):
        # the ranks on one machine share its cores (torchrun alone would leave each rank one thread)
        torch.set_num_threads(max(1, _cores() // max(1, local_world)))
    if rank != 0:  # rank 0 speaks for the run; the others show errors only
        log = logging.getLogger("kvbits")
        log.setLevel(max(log.getEffectiveLevel(), logging.ERROR))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" once, from rank 0

    def skipped(_: dict) -> None:
        if rank == 0:
            print(
                f"kvbits eval: {args.out} already holds this run; showing it (--overwrite to redo)",
                file=sys.stderr,
            )

    # cuda:N current while the model runs (Triton launches on the current device's stream); a gloo / nccl process
    # group under torchrun, destroyed at the end (a rank's own cuda:$LOCAL_RANK is made current inside)
    with on_device(args.device), init_from_env(args.device):
        summary = evaluate(
            args.model,
            args.data,
            args.context,
            args.scheme,
            windows=args.windows,
            mode=args.mode,
            fused_decode=FUSED_DECODE[args.fused_decode],
            semantics=args.semantics,
            prompt_len=args.prompt_len,
            attn_layers=args.attn_layers,
            generate=args.generate,
            calibration=args.calibration,
            data_path=args.data_path,
            out_dir=args.out,
            overwrite=args.overwrite,
            dtype=args.dtype,
            device=args.device,
            chunk_size=args.chunk_size,
            seed=args.seed,
            bos=args.bos,
            progress=rank == 0 and not args.no_progress,
            argv=["kvbits", *sys.argv[1:]]
            if sys.argv and sys.argv[0].endswith(("kvbits", "__main__.py"))
            else None,
            on_skip=skipped,
        )
    if rank != 0:  # every rank returned the same summary: rank 0 prints it
        return 0
    if args.json:
        sys.stdout.write(dumps(summary, indent=2) + "\n")
        return 0
    try:
        from kvbits.report import print_summary
    except ImportError:
        sys.stdout.write(dumps(summary, indent=2) + "\n")
        return 0
    print_summary(summary, calibration_warnings=False)  # logged on stderr already (the runner): said once
    if args.out is not None:  # as needle and speed say where their files went
        written = [n for n in ("summary.json", "report.md", "report.html") if (Path(args.out) / n).is_file()]
        print(f"wrote {args.out}/{', '.join(written)}")
    return 0


def _cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
