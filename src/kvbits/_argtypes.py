"""argparse pieces shared by the ``kvbits`` subcommands: ``type=`` validators for numbers within bounds,
and the ``--dtype``/``--device`` of the commands that load a model.

``bounded(int, 1)`` accepts integers >= 1; ``bounded(float, 0, 1, hi_open=True, what="a fraction")``
accepts ``0 <= x < 1``. A rejected value raises ``argparse.ArgumentTypeError`` whose message says
what was expected, so argparse prints ``argument --windows: expected an integer >= 1, got '0'``.
Floats must be finite (``nan`` and ``inf`` are refused).

``MODEL_DTYPES`` and ``add_dtype_device`` give the commands that load a model (``analyze``,
``calibrate``, ``eval``, ``monitor``, ``tune``) the same ``--dtype`` choices and ``--device`` help; each
command checks its device with ``kvbits.evaluate.request.check_device`` before the model loads.
``add_model_data_args`` adds their ``--model`` / ``--data`` (/ ``--data-path``), and
``add_window_args`` the ``--context`` / ``--windows`` of those that cut the text into windows; the help
texts stay each command's own. ``FUSED_DECODE`` maps ``--fused-decode auto|on|off`` to the library's
``fused_decode`` values; ``add_calibration_arg`` adds the ``--calibration`` of the evaluating commands;
``add_summary_output_args`` adds ``--out`` / ``--overwrite`` / ``--json`` to the commands that write a summary
folder and print a table, and ``emit_summary`` ends them; ``check_overwrite_has_out`` refuses an ``--overwrite``
given without the ``--out`` it applies to. ``add_seed_arg`` gives every seeded command the same
``--seed`` bound, ``[0, SEED_MAX]``, and ``check_seed`` the same bound to the Python entry points that take a seed.
``add_threads_arg`` gives every command that runs a model the same ``--threads`` (torch's intra-op threads on the
CPU), and ``apply_threads`` sets it, before the model loads. ``on_device`` makes a ``--device cuda:N`` the current CUDA
device while the command's model runs (Triton launches on the current device's stream); ``runs_on_device`` does the
same around a public Python entry point (``evaluate``, ``speed_eval``, ...), from its ``device`` or its model's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from kvbits._json import dumps

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "FUSED_DECODE",
    "MODEL_DTYPES",
    "SEED_MAX",
    "add_bos_arg",
    "add_calibration_arg",
    "add_dtype_device",
    "add_model_data_args",
    "add_seed_arg",
    "add_summary_output_args",
    "add_threads_arg",
    "add_window_args",
    "apply_threads",
    "bounded",
    "check_output_path",
    "check_overwrite_has_out",
    "check_scheme_args",
    "check_seed",
    "emit_summary",
    "model_device",
    "on_device",
    "runs_on_device",
]

FUSED_DECODE: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
"""``--fused-decode`` choices -> the ``fused_decode`` argument of ``QuantizedKVCache`` and the evaluators."""

MODEL_DTYPES = ("float32", "bfloat16", "float16")
"""``--dtype`` of every command that loads a model: torch dtype names (``getattr(torch, name)``)."""

DTYPE_HELP = (
    "model dtype (default float32). bfloat16 and float16 halve the weights' memory; float16 keeps more "
    "mantissa bits but its range ends at 65504, so a model with larger activations overflows to inf/NaN "
    "(bfloat16 has float32's range)"
)


def _fmt(x: float) -> str:
    # an int bound in full: "{:g}" turned 2**32 - 1 into "4.29497e+09", a bound the message did not state
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_fmt(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_fmt(hi)}"
    return ""


def bounded(
    kind: type[int | float],
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str | None = None,
) -> Callable[[str], int | float]:
    """An argparse type converting text to ``kind`` (``int`` or ``float``) within ``[lo, hi]``.

    Args:
        kind: ``int`` or ``float``.
        lo, hi: bounds (None: unbounded on that side), inclusive unless ``lo_open`` / ``hi_open``.
        what: the expected value in words (default ``"an integer"`` / ``"a number"``), used in the
            error message: ``expected {what} {range}, got '...'``.
    """
    if kind not in (int, float):
        raise TypeError(f"kind must be int or float, got {kind!r}")
    noun = what or ("an integer" if kind is int else "a number")
    span = _range(lo, hi, lo_open, hi_open)
    expected = f"{noun} {span}".strip()

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {expected} (a finite number), got {text!r}")
        too_low = lo is not None and (value <= lo if lo_open else value < lo)
        too_high = hi is not None and (value >= hi if hi_open else value > hi)
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


SEED_MAX = 2**32 - 1
"""The largest ``--seed``: numpy's legacy bound. Below it every seed is its own (the needle masked seeds to 32 bits,
so ``-1`` and ``2**32 - 1`` gave the same trials; ``random.Random`` seeds with ``abs``, so analyze's ``-1`` was its
``1``), and ``calibrate``'s per-layer seeds ``seed + i`` stay within torch's 64-bit ``manual_seed``."""


def add_seed_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--seed`` (an integer in ``[0, SEED_MAX]``, default 0); ``what`` says what it seeds, in the help."""
    parser.add_argument(
        "--seed", type=bounded(int, 0, SEED_MAX), default=0, help=f"{what} (an integer in [0, 2**32 - 1]; default 0)"
    )


def check_seed(seed: Any) -> int:
    """``seed`` as an int in ``[0, SEED_MAX]`` (a Python or NumPy integer, not a bool); ``ValueError`` otherwise:
    the bound of ``add_seed_arg``'s ``--seed``, for the library's functions that take a seed."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an int in [0, {SEED_MAX}], got {seed!r}")
    return int(seed)


THREADS_HELP = (
    "torch intra-op threads on CPU (default: torch's, one per core); fewer, even 1, is often faster on a machine other "
    "jobs share, and for token-by-token decoding, whose per-token matmuls are tiny"
)


def add_threads_arg(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Add ``--threads`` (an integer >= 1; default None: torch's own count) to a command that runs a model; the command
    calls ``apply_threads(args.threads)`` before the model loads. ``note`` is appended to the help."""
    parser.add_argument("--threads", type=bounded(int, 1), help=THREADS_HELP + note)


BOS_HELP = (
    "start each window with the tokenizer's BOS token: auto (the default) where the tokenizer adds one to a text "
    "itself (Llama, Mistral, Gemma; SmolLM2 and Qwen2.5 add none), always, never (raw slices of the text); with a "
    "BOS a window is the BOS and context - 1 text tokens"
)


def add_bos_arg(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Add ``--bos {auto,always,never}`` (default auto) to a command that cuts a text into windows or prompts; the
    command passes ``args.bos`` to its entry point, which resolves it (``resolve_bos``). ``note`` is appended to the
    help (what the command records, what the BOS means there)."""
    parser.add_argument("--bos", choices=("auto", "always", "never"), default="auto", help=BOS_HELP + note)


def apply_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)``: the intra-op threads of the CPU's matmuls; None leaves torch's default (the
    cores, or ``OMP_NUM_THREADS``). Called once, before the model loads, so its loading and every pass use it."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)


def add_dtype_device(parser: argparse.ArgumentParser, devices: tuple[str, ...], note: str = "") -> None:
    """Add ``--dtype`` (``MODEL_DTYPES``, default float32) and ``--device`` (default cpu) to ``parser``.

    ``devices`` are the device types the command runs on (``"cpu"``, ``"cuda"``, ``"mps"``), named in
    the help; ``"cuda"`` also admits ``cuda:N``. ``--device`` is free text here: the command checks it
    with ``check_device(args.device, devices)``, which also says when CUDA or MPS is not available.
    ``note`` is appended to the ``--dtype`` help.
    """
    names = [d for t in devices for d in ((t, f"{t}:N") if t == "cuda" else (t,))]
    parser.add_argument("--dtype", choices=MODEL_DTYPES, default="float32", help=DTYPE_HELP + note)
    parser.add_argument(
        "--device",
        default="cpu",
        help=f"torch device: {', '.join(names[:-1])} or {names[-1]} (default cpu); checked before the model loads",
    )


@contextlib.contextmanager
def on_device(device: str | Any | None) -> Iterator[None]:
    """Run the block with ``device`` the current CUDA device when it is ``cuda:N`` (``torch.cuda.device(N)``).

    Triton launches its kernels on the current CUDA device's stream, and ``torch.cuda.synchronize()`` /
    ``Stream()`` / ``Event`` default to that device too: a model on ``cuda:1`` while ``cuda:0`` is current would
    have its Triton kernels launched against cuda:0. A no-op for ``cpu``, ``mps``, ``cuda`` without an index
    (already the current device), None, and a device this torch can not use (a string torch does not parse, CUDA
    not available, an index past the visible devices): the command's ``check_device`` reports those with a clear
    message, inside the block where it runs there (on every rank alike under torchrun). Entered once around a
    command's model work, so no per-step cost.
    """
    import torch

    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError, ValueError):
        dev = None
    index = dev.index if dev is not None and dev.type == "cuda" else None
    if index is None or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        yield
        return
    with torch.cuda.device(index):
        yield


def model_device(model: Any) -> Any:
    """The device of ``model``'s first parameter: a torch module, or an object holding one as ``.model`` (a
    ``LoadedModel``); None for anything else (a model spec string) or a module without parameters."""
    import torch

    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if not isinstance(module, torch.nn.Module):
        return None
    first = next(module.parameters(), None)
    return first.device if first is not None else None


def runs_on_device(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public entry point that takes ``model`` (and maybe ``device``): its whole call runs inside
    ``on_device(device)``, or ``on_device(<model's device>)`` when ``device`` is None or absent.

    So a Python caller with a model on ``cuda:1`` gets its Triton kernels launched on cuda:1's stream, as the CLI
    commands (which also enter ``on_device(args.device)``) do. Idempotent when the device is already current, a
    no-op on CPU / MPS / ``cuda`` without an index; the previous current device is restored on the way out. Arguments
    the signature does not bind are left for the call itself to refuse (its own TypeError)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return fn(*args, **kwargs)
        device = bound.get("device")
        if device is None:
            device = model_device(bound.get("model"))
        with on_device(device):
            return fn(*args, **kwargs)

    return wrapper


def add_model_data_args(
    parser: argparse.ArgumentParser,
    *,
    model_help: str,
    data_help: str,
    data_default: str | None = None,
    data_path_help: str | None = None,
) -> None:
    """Add ``--model`` (required), ``--data`` and, when ``data_path_help`` is given, ``--data-path``.

    ``--data`` is required unless ``data_default`` names the text used without it. The parsed
    ``args.model``, ``args.data`` and ``args.data_path`` are the model and text specs of
    ``kvbits.evaluate`` (``load_model``, ``load_text``); each command words their help for its use.
    """
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--data", required=data_default is None, default=data_default, help=data_help)
    if data_path_help is not None:
        parser.add_argument("--data-path", help=data_path_help)


def add_window_args(
    parser: argparse.ArgumentParser, *, context: int, windows: int, windows_help: str = "number of windows"
) -> None:
    """Add ``--context`` (tokens per window, ``kvbits.cli.parse_tokens``: ``8k`` works) and ``--windows``
    (an integer >= 1) with these defaults.

    ``context`` is a multiple of 1024, shown in the help both ways (``e.g. 8192 or 8k``);
    ``windows_help`` is followed by ``(default N)``.
    """
    from kvbits.cli import _positive, parse_tokens  # on use: kvbits.cli imports this module

    if context < 1024 or context % 1024:
        raise ValueError(f"context must be a positive multiple of 1024, got {context}")
    parser.add_argument(
        "--context",
        type=parse_tokens,
        default=context,
        help=f"tokens per window, e.g. {context} or {context // 1024}k (default {context})",
    )
    parser.add_argument(
        "--windows", type=_positive, default=windows, help=f"{windows_help} (default {windows})"
    )


def add_calibration_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--calibration DIR`` (repeatable): the ``kvbits calibrate`` folders of calibrated schemes, each matched to
    a scheme by the scheme name its artifact records (``kvbits.evaluate.inputs._calibrations``), not by position."""
    parser.add_argument(
        "--calibration", action="append", metavar="DIR",
        help="kvbits calibrate folder for a scheme with static scales / NUQ codebooks (kvquant-*); repeatable: each "
             "folder goes to the --scheme it was calibrated for (the scheme name it records), in any order, not by "
             "position",
    )  # fmt: skip


def add_summary_output_args(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``--out`` (a folder for ``<command>.json``, ``report.md`` and ``<command>.png``: the files of
    ``kvbits.report.render.write_json_report``), ``--overwrite`` and ``--json``, which ``emit_summary`` reads."""
    files = f"{command}.json, report.md, {command}.png"
    parser.add_argument("--out", help=f"output folder ({files})")
    parser.add_argument(
        "--overwrite", action="store_true",
        help=f"write into a non-empty folder that holds no {command} run (only {files} are replaced)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (nothing else)")


PEERS: dict[str, tuple[int, str]] = {
    "hf-quanto-int4": (4, "transformers QuantizedCache, quanto int4, residual 128, groups of 64"),
    "hf-quanto-int2": (2, "transformers QuantizedCache, quanto int2, residual 128, groups of 64"),
}
"""name -> (code width, description) of each comparison peer, torch-free: ``kvbits.evaluate.stream.PEER_SCHEMES``
is built from it, and ``tune_peer_refusal`` explains a peer without importing that module."""

PEER_NAMES = tuple(PEERS)
"""The names of ``kvbits.evaluate.stream.PEER_SCHEMES`` (transformers' ``QuantizedCache`` peers), without importing
that module (torch): the names ``check_scheme_args`` lets through to the command that resolves them."""


def tune_peer_refusal(spec: str, role: str) -> str:
    """What ``kvbits tune`` says of a comparison peer's name ``spec`` (a key of ``PEERS``) given as a ``role``
    (``"candidate"``, ``"compare"``): what a peer is, why tune can not mix it, and what to pass instead. The one text
    of both ``check_scheme_args(..., role=...)`` (before the imports) and ``kvbits.tune.inputs.tune_scheme``."""
    nbits, description = PEERS[spec]
    return (
        f"{role} {spec!r} is a comparison peer ({description}), not a kvbits scheme: tune measures each "
        "layer stored by each scheme alone and mixes them per layer, which a third-party cache of the whole "
        f"model can not be; pass a kvbits preset instead (e.g. int{nbits}-token or kivi-{nbits}; "
        f"kvbits schemes lists them), and measure {spec} beside the tuned mix with "
        f"kvbits eval --mode stream --scheme {spec} --scheme MIX.json"
    )


def check_scheme_args(specs: Any, *, peers: bool = False, role: str | None = None) -> None:
    """``get_scheme`` of each string in ``specs`` (the ``--scheme`` / ``--candidates`` / ``--compare`` values; None:
    nothing), before a command imports torch: an unknown preset name (with the did-you-mean hint), a scheme JSON that
    does not exist or does not parse, a mixed string of an unknown preset are refused in ~0.2 s, not after 4-8 s of
    imports. The command resolves the schemes again, as before; with ``peers``, a peer name (``PEER_NAMES``) is left
    to it and a refusal lists the peers as ``resolve_scheme``'s does (only for the commands that run peers: eval,
    speed, needle; monitor, export, calibrate and tune refuse them, so their refusals do not offer them); with ``role`` (``kvbits tune``'s
    ``"candidate"`` / ``"compare"``), a peer name is refused with ``tune_peer_refusal``'s message; with neither, a peer
    is left to the command (its own message says what a peer is and why it is refused)."""
    if specs is None:
        return
    from kvbits.schemes import get_scheme  # torch-free

    for spec in [specs] if isinstance(specs, str) else specs:
        if isinstance(spec, str) and spec in PEER_NAMES and role is not None and not peers:
            raise ValueError(tune_peer_refusal(spec, role))
        if not isinstance(spec, str) or spec in PEER_NAMES:
            continue
        try:
            get_scheme(spec)
        except ValueError as exc:
            if not peers:
                raise
            raise ValueError(f"{exc}; peers (stream mode only): {', '.join(PEER_NAMES)}") from None


def check_overwrite_has_out(args: argparse.Namespace) -> None:
    """``ValueError`` for ``--overwrite`` without ``--out``: it governs what the run writes into ``--out``, and with no
    ``--out`` nothing is written, so the flag would be accepted and ignored (a run the user meant to save, shown and
    lost)."""
    if getattr(args, "overwrite", False) and getattr(args, "out", None) is None:
        raise ValueError("--overwrite replaces what --out holds, and no --out was given (nothing is written without "
                         "it): add --out, or drop --overwrite")  # fmt: skip


def emit_summary(
    summary: dict[str, Any],
    args: argparse.Namespace,
    write: Callable[..., Any],
    show: Callable[[dict[str, Any], str | None], None],
) -> int:
    """The end of a command that makes one summary: ``write(summary, args.out, overwrite=args.overwrite)``
    with ``--out``; then the summary as JSON on stdout with ``--json`` (nothing else), else ``show(summary,
    args.out)``. Returns the exit code, 0."""
    if args.out:
        write(summary, args.out, overwrite=args.overwrite)
    if args.json:
        sys.stdout.write(dumps(summary, indent=2) + "\n")
        return 0
    show(summary, args.out)
    return 0


def check_output_path(path: str | os.PathLike[str] | None, flag: str, kind: str = "folder") -> None:
    """``ValueError`` before a run when its output can not be written: ``path`` is empty (a shell variable left
    unset), or (a ``kind`` of "folder" or "file") exists as the other kind, or its nearest existing ancestor is not a folder this process can
    write (missing folders are created on write). None: nothing to check. What a finished run would
    otherwise trip on after minutes or hours of work."""
    if path is None:
        return
    if kind not in ("folder", "file"):
        raise ValueError(f"kind must be 'folder' or 'file', got {kind!r}")
    if not os.fspath(path).strip():  # "--out $DIR" with DIR unset: Path("") is the working folder, or nothing written
        raise ValueError(f"{flag} is empty; expected a {kind} path")
    p = Path(path).expanduser()
    if kind == "folder" and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    if kind == "file" and p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file path")
    parent = p if kind == "folder" else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: can not write there ({parent} is a file, not a folder)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: can not write there (no write permission in {parent})")
