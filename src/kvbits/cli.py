"""The ``kvbits`` command line: one thin subcommand per stage, no logic the Python API lacks.

Subcommands come from a registry (:data:`COMMANDS`). Each entry is either an object or the dotted
path of a module providing::

    def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser: ...
    def run(args: argparse.Namespace) -> int | None: ...   # exit status, None = 0

``add_parser`` must add a subparser named like its registry key. A module that does not exist yet
(``kvbits.evaluate.cli`` before anyone wrote it) is left out; an import error *inside* an existing
module is raised, never hidden. Output: rich tables for people, ``--json`` for scripts (JSON alone
on stdout; logs and errors go to stderr).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbits._argtypes import bounded, check_output_path
from kvbits._json import dumps
from kvbits._spelling import cli_spelling

logger = logging.getLogger("kvbits.cli")

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C
# 128 + SIGPIPE: what a shell reports for `cat`, `git log` or `yes` whose reader (`| head -1`) closed early. Not 0:
# the output was cut, and `set -o pipefail` scripts should know; not 1: nothing failed, and nothing is printed.
EXIT_BROKEN_PIPE = 141


@dataclass(frozen=True)
class Command:
    """A built-in subcommand: the same two functions a command module provides."""

    add_parser: Callable[[Any], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int | None]


# ------------------------------------------------------------------------------ formatting helpers


def human_bytes(n: float) -> str:
    """``137438953472`` -> ``"128.00 GiB"`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_tokens(text: str) -> int:
    """A token count: ``32768``, ``32_768``, ``32k`` (= 32768) or ``1m`` (= 1048576)."""
    s = text.strip().lower().replace(",", "").replace("_", "")
    mult = 1
    if s.endswith("k"):
        s, mult = s[:-1], 1024
    elif s.endswith("m"):
        s, mult = s[:-1], 1024 * 1024
    try:
        value = int(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 32768 or 32k, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token count must be >= 1, got {text!r}")
    return value


_positive = bounded(int, 1)
_gib = bounded(float, 0, what="a number of GiB")


def _console() -> Any:
    from kvbits._console import stdout_console

    return stdout_console()


def _print_json(data: Any) -> None:
    sys.stdout.write(dumps(data, indent=2) + "\n")


def _spec_str(spec: Any) -> str:
    """``TensorSpec`` -> ``"int2 asym per-channel g32"``, ``"fp8-e4m3 per-tensor static"``, ``"fp16"``."""
    kind = getattr(spec, "kind", "float")
    if kind == "float":
        return str(spec.fmt)
    parts = [f"fp8-{spec.fmt}" if kind == "fp8" else f"{kind}{spec.bits}"]
    if kind in ("int", "nuq"):
        parts.append("sym" if getattr(spec, "symmetric", False) else "asym")
        if getattr(spec, "integer_zero", False):
            parts.append("int-zero")
        if getattr(spec, "rounding", "nearest") != "nearest":
            parts.append(spec.rounding)
    if getattr(spec, "scale_dtype", "fp16") != "fp16":
        parts.append(f"{spec.scale_dtype}-scales")
    parts.append(f"per-{spec.granularity}")
    if getattr(spec, "group_size", None):
        parts.append(f"g{spec.group_size}")
    if getattr(spec, "static", False):
        parts.append("static")
    if getattr(spec, "outlier_frac", 0.0):
        parts.append(f"+{spec.outlier_frac:.1%} outliers")
    if getattr(spec, "pre_rope", False):
        parts.append("pre-RoPE")
    if getattr(spec, "centre", False):
        parts.append("+centred")
    if getattr(spec, "smooth", None) is not None:
        parts.append(f"+smooth{spec.smooth:g}")
    if getattr(spec, "rotate", None):
        parts.append(f"+{spec.rotate}")
    return " ".join(parts)


def _paper_label(url: str) -> str:
    """A short rich link: ``arXiv:2402.02750`` for arXiv, the host name for other pages."""
    if not url:
        return ""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    label = (
        f"arXiv:{parsed.path.rsplit('/', 1)[-1]}"
        if parsed.netloc.endswith("arxiv.org")
        else parsed.netloc or url
    )
    return f"[link={url}]{label}[/link]"


# ------------------------------------------------------------------------------ kvbits schemes


def _schemes_add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "schemes",
        help="list the scheme presets with their average bits",
        description="Every registered KV-cache scheme: key and value storage, sinks, residual window, "
        "flush block, asymptotic average bits per element (metadata included), and its paper.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument(
        "--head-dim", type=_positive, default=128, help="head dim D for the average bits (default 128)"
    )
    p.add_argument(
        "--kv-heads",
        type=_positive,
        default=8,
        help="KV heads, for per-head/per-tensor scale counts (default 8)",
    )
    return p


def _schemes_run(args: argparse.Namespace) -> int:
    from kvbits.schemes import average_bits, list_schemes

    rows = []
    for s in list_schemes():
        d = s.to_dict()
        d["key_summary"] = _spec_str(s.key)
        d["value_summary"] = _spec_str(s.value)
        try:
            d["average_bits"] = average_bits(s, head_dim=args.head_dim, n_heads=args.kv_heads)
        except ValueError as exc:  # e.g. groups of 32 channels at head dim 80: listed, not counted
            d["average_bits"], d["unsupported"] = None, str(exc)
        rows.append(d)
    if args.json:
        _print_json(rows)
        return EXIT_OK
    from rich.table import Table

    unsupported = [r["name"] for r in rows if r["average_bits"] is None]
    caption = (
        f"n/a: {', '.join(unsupported)} can not store head dim {args.head_dim} (per-token groups must divide it; "
        "Hadamard rotations need a power of two)"
        if unsupported
        else None
    )
    from kvbits._console import prose_width

    console = _console()
    table = Table(
        title=f"kvbits schemes (average bits at head dim {args.head_dim}, metadata included)", caption=caption
    )
    for col, kw in (
        ("scheme", {"style": "bold", "no_wrap": True}),
        ("key", {}),
        ("value", {}),
        ("sinks", {"justify": "right"}),
        ("residual", {"justify": "right"}),
        ("block", {"justify": "right"}),
        ("avg bits", {"justify": "right"}),
        ("description", {"ratio": 3, "max_width": prose_width(console)}),
        ("paper", {"no_wrap": True}),
    ):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(
            r["name"],
            r["key_summary"],
            r["value_summary"],
            str(r["sinks"]),
            str(r["residual"]),
            str(r["block"]),
            "n/a" if r["average_bits"] is None else f"{r['average_bits']:.2f}",
            r["description"],
            _paper_label(r["reference"]),
        )
    console.print(table)
    return EXIT_OK


# ------------------------------------------------------------------------------ kvbits plan


def _plan_add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.plan.planner import DEFAULT_SCHEMES

    p = subparsers.add_parser(
        "plan",
        help="KV-cache memory and concurrency for a model, context and batch",
        description="Exact KV-cache bytes (codes, scales, zero-points, outliers, full-precision tokens) "
        "for each scheme, from a model config or from bare dimensions. Sizes are binary (GiB = 2^30 bytes).",
        epilog="examples:\n"
        "  kvbits plan --layers 32 --kv-heads 32 --head-dim 128 --context 32768 --batch 8 --scheme fp16\n"
        "  kvbits plan --config path/to/config.json --context 8k --context 32k --gpu-mem 80\n"
        "  kvbits plan --config smollm2-135m --scheme kivi-2 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("model (a config, or dimensions; dimensions also override a config)")
    src.add_argument(
        "--config",
        "--model",
        dest="config",
        metavar="X",
        help="config.json, model folder, .gguf file, kvbits offline model name, or hub id",
    )
    src.add_argument("--layers", type=_positive, help="number of decoder layers")
    src.add_argument("--kv-heads", type=_positive, help="KV heads per layer")
    src.add_argument("--head-dim", type=_positive, help="channels per head")
    src.add_argument(
        "--dtype-bytes", type=int, choices=(1, 2, 4, 8), help="model dtype bytes (default: config, else 2)"
    )
    src.add_argument(
        "--sliding-window", type=_positive, help="window of every layer (dimensions only, Mistral-style)"
    )
    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--context",
        action="append",
        type=parse_tokens,
        metavar="T",
        help="tokens per sequence, e.g. 32768 or 32k, at most 2**40; repeat for several (default: the model's max)",
    )
    wl.add_argument("--batch", type=_positive, default=1, help="sequences held at once (default 1)")
    wl.add_argument(
        "--fused-decode",
        action="store_true",
        help="decoding through the fused GPU kernel: pre-RoPE schemes also hold its RoPE tables (once per model)",
    )
    wl.add_argument(
        "--scheme",
        action="append",
        metavar="S",
        help=f"preset name or scheme JSON; repeat for several (default: {', '.join(DEFAULT_SCHEMES)})",
    )
    gpu = p.add_argument_group("GPU budget")
    gpu.add_argument("--gpu-mem", type=_gib, metavar="GIB", help="GPU memory in GiB: adds max concurrency and max context")
    gpu.add_argument(
        "--weights-gib", type=_gib, metavar="GIB",
        help="weights memory (default: estimated from the config; required for quantized weights: a quantization_config, "
        "a GGUF of quantized blocks)",
    )
    gpu.add_argument(
        "--reserve-gib", type=_gib, metavar="GIB", help="memory kept free, at most --gpu-mem (default 0)"
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON list of plans instead of a table")
    out.add_argument("--per-layer", action="store_true", help="include the per-layer breakdown")
    return p


def _plan_shape(args: argparse.Namespace) -> Any:
    from kvbits.plan import ModelShape, load_shape

    if args.config is not None:
        if args.sliding_window is not None:
            raise ValueError(
                "--sliding-window applies to planning from dimensions; the config decides its windows"
            )
        shape = load_shape(args.config, rope=args.fused_decode)  # the RoPE tables fused decode keeps
        return shape.with_overrides(
            layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes
        )
    missing = [
        f"--{n.replace('_', '-')}" for n in ("layers", "kv_heads", "head_dim") if getattr(args, n) is None
    ]
    if missing:
        raise ValueError(
            f"give --config, or all of --layers, --kv-heads and --head-dim (missing {', '.join(missing)})"
        )
    return ModelShape.from_dims(
        args.layers,
        args.kv_heads,
        args.head_dim,
        dtype_bytes=args.dtype_bytes or 2,
        sliding_window=args.sliding_window,
        name="custom",
    )


def _default_schemes(shape: Any) -> list[str]:
    """``DEFAULT_SCHEMES`` less those that can not store the model's head dims, each skipped with a note
    on stderr (a scheme named with ``--scheme`` is planned or refused with the reason instead)."""
    from kvbits.plan import DEFAULT_SCHEMES
    from kvbits.schemes import get_scheme
    from kvbits.schemes.accounting import check_scheme_head_dim

    dims = sorted({layer.head_dim for layer in shape.layers if layer.attention != "none"})
    keep = []
    for name in DEFAULT_SCHEMES:
        try:
            for d in dims:
                check_scheme_head_dim(get_scheme(name), d)
        except ValueError as exc:
            print(f"kvbits plan: note: skipping {name}: {exc}", file=sys.stderr)
            continue
        keep.append(name)
    return keep


def _plan_run(args: argparse.Namespace) -> int:
    from kvbits.plan import plan

    given = [flag for flag, value in (("--weights-gib", args.weights_gib), ("--reserve-gib", args.reserve_gib))
             if value is not None]  # fmt: skip
    if given and args.gpu_mem is None:  # they only enter the GPU budget: the plan would ignore them without a word
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{' and '.join(given)} {verb} to the GPU budget alone: add --gpu-mem GIB")
    if args.scheme:  # an unknown name or a bad scheme file is refused before the config is read (~10 s for a GGUF)
        from kvbits.schemes import get_scheme

        for spec in args.scheme:
            get_scheme(spec)
    shape = _plan_shape(args)
    if not args.context and shape.max_context is None:  # plan() would speak of "the config", which there may be none of
        source = "a config without max_position_embeddings" if args.config is not None else "dimensions"
        raise ValueError(f"--context is required when planning from {source} (no max context to default to); "
                         "e.g. --context 32k")  # fmt: skip
    results = plan(
        shape,
        context=list(args.context) if args.context else None,
        batch=args.batch,
        scheme=list(args.scheme or _default_schemes(shape)),
        gpu_mem_gib=args.gpu_mem,
        weights_gib=args.weights_gib,
        reserve_gib=args.reserve_gib or 0.0,
        fused_decode=args.fused_decode,
    )
    assert isinstance(results, list)
    if args.json:
        if not args.per_layer:
            results = [{k: v for k, v in r.items() if k != "per_layer"} for r in results]
        _print_json(results)
        return EXIT_OK
    _print_plan_table(shape, results, args)
    return EXIT_OK


def _print_plan_table(shape: Any, results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.table import Table

    gpu = args.gpu_mem is not None
    title = f"KV cache: {shape.name or 'model'}, batch {args.batch}"
    caption = shape.describe()
    if gpu:
        r0 = results[0]
        caption += (
            f"\nGPU {human_bytes(r0['gpu_mem_bytes'])}, weights {human_bytes(r0['weights_bytes'])} "
            f"({r0['weights_source']}), reserve {human_bytes(r0['reserve_bytes'])}"
        )
        trained = shape.max_context  # None: planned from dimensions, no max_position_embeddings to compare with
        beyond = list(dict.fromkeys(  # max context does not depend on --context: name each scheme once, not per context
            r["scheme"] for r in results
            if trained is not None and (r["max_context"] is None or r["max_context"] > trained)
        ))  # fmt: skip
        if beyond:
            caption += (
                f"\nmax context: the longest the batch can grow to in memory, fitting at every length; beyond the "
                f"model's max_position_embeddings ({shape.max_context:,}) for {', '.join(beyond)}"
            )
    top = max(results, key=lambda r: r["context"])
    caption += (
        f"\nnot counted: a step also allocates at least {human_bytes(top['step_bytes'])} at {top['context']:,} "
        "tokens (one layer's K/V in the model dtype: every prefill, and decode steps without the fused kernel)"
    )
    if gpu and top["reserve_bytes"] < top["step_bytes"]:
        need = top["step_bytes"] / 2**30
        caption += f"; the reserve is below it: pass --reserve-gib {need:.3g} or more to keep room for it"
    tables = {r["scheme"]: r["rope_table_bytes"] for r in results if r.get("rope_table_bytes")}
    if tables:
        caption += "\nincluded, once per model: RoPE tables of fused pre-RoPE decode (" + ", ".join(
            f"{name} {human_bytes(n)}" for name, n in tables.items()
        ) + ")"
    table = Table(title=title, caption=caption)
    table.add_column("scheme", style="bold", no_wrap=True)
    for col in ("context", "bytes/token", "KV total", "total bytes", "avg bits", "vs fp16"):
        table.add_column(col, justify="right", no_wrap=True)
    if gpu:
        for col in ("per request", "max concurrency", "fits", f"max context @{args.batch}"):
            table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        row = [
            r["scheme"],
            f"{r['context']:,}",
            human_bytes(r["bytes_per_token"]),
            human_bytes(r["total_bytes"]),
            f"{r['total_bytes']:,}",
            f"{r['avg_bits']:.2f}",
            f"{r['compression']:.2f}x",
        ]
        if gpu:
            row += [
                human_bytes(r["kv_bytes_per_request"]),
                f"{r['max_concurrency']:,}",
                "[green]yes[/green]" if r["fits"] else "[red]no[/red]",
                "unbounded" if r["max_context"] is None else f"{r['max_context']:,}",
            ]
        table.add_row(*row)
    console = _console()
    console.print(table)
    if args.per_layer:
        for r in results:
            lt = Table(title=f"{r['scheme']} at {r['context']:,} tokens, per layer")
            for col in (
                "layer",
                "attention",
                "KV heads",
                "head dim",
                "sink",
                "quantized",
                "full",
                "dropped",
                "bytes",
            ):
                lt.add_column(col, justify="right")
            for row in r["per_layer"]:
                tok = row["tokens"] or {}
                lt.add_row(
                    str(row["layer"]),
                    row["attention"] + (f" W={row['window']}" if row["window"] else ""),
                    str(row["kv_heads"]),
                    str(row["head_dim"]),
                    *(f"{tok.get(k, 0):,}" for k in ("sink", "quantized", "full", "dropped")),
                    human_bytes(row["total_bytes"]),
                )
            console.print(lt)


# ------------------------------------------------------------------------------ registry and main

COMMANDS: dict[str, Command | str] = {
    "schemes": Command(_schemes_add_parser, _schemes_run),
    "plan": Command(_plan_add_parser, _plan_run),
    "analyze": "kvbits.analyze.cli",
    "calibrate": "kvbits.calibrate.cli",
    "tune": "kvbits.tune.cli",
    "eval": "kvbits.evaluate.cli",
    "needle": "kvbits.evaluate.needle_cli",
    "speed": "kvbits.evaluate.speed_cli",
    "report": "kvbits.report.cli",
    "monitor": "kvbits.monitor.cli",
    "export": "kvbits.export.cli",
}
"""Subcommands in the order of the decision flow. Add one by adding its module path here."""


def _is_missing(exc: ModuleNotFoundError, module: str) -> bool:
    """True when ``exc`` says ``module`` itself (or a package above it) does not exist."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def load_command(entry: Command | str) -> Any | None:
    """The command object of a registry entry, or None when its module does not exist (yet)."""
    if not isinstance(entry, str):
        return entry
    try:
        module = importlib.import_module(entry)
    except ModuleNotFoundError as exc:
        if _is_missing(exc, entry):
            logger.debug("subcommand module %s is not available; skipping it", entry)
            return None
        raise
    for attr in ("add_parser", "run"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(
                f"subcommand module {entry} must define add_parser(subparsers) and run(args); no {attr}()"
            )
    return module


def requested_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it is a registered one.

    Global options take no value, so the first token that is not an option names the command.
    """
    for token in argv:
        if not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every available subcommand, or with ``only`` that one.

    ``main`` imports just the module of the command being run, so ``kvbits plan`` never pays for
    the imports of ``kvbits eval`` (torch, transformers) and a broken module breaks only itself.
    """
    from kvbits import __version__

    parser = argparse.ArgumentParser(
        prog="kvbits",
        description="Quantize the KV cache of transformers models, and prove it.",
    )
    parser.add_argument("--version", action="version", version=f"kvbits {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv: debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if only is not None and name != only:
            continue
        command = load_command(entry)
        if command is None:
            continue
        sub = command.add_parser(subparsers) or subparsers.choices.get(name)
        if sub is None:
            raise TypeError(f"subcommand {name!r}: add_parser() added no parser named {name!r}")
        sub.set_defaults(_run=command.run)
    return parser


class _StderrHandler(logging.StreamHandler):
    """kvbits' log lines (``kvbits: WARNING: ...``) on ``sys.stderr`` as it is at each record (callers and tests
    may swap it after the handler is made)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("kvbits: %(levelname)s: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it: always sys.stderr instead
        pass


def setup_logging(verbose: int) -> None:
    """Log kvbits' own records to stderr at WARNING (``-v``: INFO, ``-vv``: DEBUG).

    Only the ``kvbits`` logger gets a handler: a handler on the root logger (``logging.basicConfig``) printed
    every library's records a second time, prefixed ``kvbits:`` (each huggingface_hub retry of a mistyped model
    name twice), since those libraries print through their own handlers already.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    log = logging.getLogger("kvbits")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        log.addHandler(_StderrHandler())
    log.setLevel(level)


def quiet_library_progress() -> None:
    """No transformers / huggingface_hub progress bars (transformers' "Loading weights" bar on every model
    load): for ``--no-progress``, ``--json`` and a stderr that is not a terminal (a log file, CI)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is first imported
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 usage error: bad arguments or input,
    a path given that does not exist; 130 interrupted with Ctrl-C, one line on stderr and no traceback; 141 stdout
    closed early, ``kvbits plan ... | head -1``: nothing on stderr, as ``cat`` or ``git`` would)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows now, not in the interpreter's exit flush ("Exception ignored")
        return status
    except KeyboardInterrupt:
        command = requested_command(argv)
        print(f"kvbits{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at the null device, so that what is still buffered for a closed pipe is
    dropped at exit without another ``BrokenPipeError`` (the recipe of Python's docs, 'Note on SIGPIPE')."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced by an object with no descriptor (a test's)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _unknown_option(sub: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The first ``--flag`` in ``argv`` (the tokens after the command) that ``sub`` does not define, nor
    abbreviates, with a ``did you mean`` for a near one; None when every option is known.

    argparse reported such a typo only after the required options (``kvbits eval --contxt 5``: "the following
    arguments are required: --model, --data, --scheme", the typo not named), and then from the top-level parser
    (``kvbits: error: unrecognized arguments``, with ``kvbits``'s usage instead of the command's).
    """
    known = [o for o in sub._option_string_actions if o.startswith("--")]
    for token in argv:
        if token == "--":
            break
        if not token.startswith("--") or len(token) < 3 or " " in token:  # argparse: a positional or a value
            continue
        name = token.split("=", 1)[0]
        if name in known or (sub.allow_abbrev and any(o.startswith(name) for o in known)):
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return f"unrecognized argument {name}" + (f" (did you mean {near[0]}?)" if near else "")
    return None


def _unknown_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The message for a first non-option token of ``argv`` that names no subcommand of ``parser``, with a
    ``did you mean`` for a near one; None when it names one, or there is none.

    argparse listed the valid commands but suggested none (``kvbits evall``: "invalid choice: 'evall' (choose
    from ...)"), where a mistyped flag already got its near one.
    """
    token = next((t for t in argv if not t.startswith("-")), None)
    choices = list(parser._subparsers._group_actions[0].choices) if parser._subparsers else []
    if token is None or token in choices:
        return None
    listed = ", ".join(repr(c) for c in choices)
    near = difflib.get_close_matches(token, choices, n=1, cutoff=0.6)
    return f"argument COMMAND: invalid choice: {token!r} (choose from {listed})" + (
        f" (did you mean {near[0]}?)" if near else ""
    )


def _main(argv: list[str]) -> int:
    command = requested_command(argv)
    parser = build_parser(only=command)
    if command is None:
        unknown_command = _unknown_command(parser, argv)
        if unknown_command is not None:
            parser.error(unknown_command)
    sub = parser._subparsers._group_actions[0].choices.get(command) if parser._subparsers and command else None
    if isinstance(sub, argparse.ArgumentParser):
        unknown = _unknown_option(sub, argv[argv.index(command) + 1 :])
        if unknown is not None:
            sub.error(unknown)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if getattr(args, "no_progress", False) or getattr(args, "json", False) or not sys.stderr.isatty():
        quiet_library_progress()
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        # an --out that can not be written fails now, not after the run (tune's --out is a file)
        check_output_path(getattr(args, "out", None), "--out", getattr(args, "_out_kind", "folder"))
        with cli_spelling():  # the library's messages name the flags the user typed, not the Python arguments
            status = run(args)
    except BrokenPipeError:
        raise  # stdout closed early: main() ends quietly, this is no error of the command's
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as exc:
        logger.debug("details", exc_info=True)
        print(f"kvbits {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, RuntimeError) as exc:
        logger.debug("details", exc_info=True)
        print(f"kvbits {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if status is None else int(status)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
