"""``kvbits tune``: per-layer precision within an average-bits budget, from measured sensitivity (thin
wrapper over ``kvbits.tune.tune``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvbits._argtypes import (
    add_bos_arg,
    add_dtype_device,
    add_model_data_args,
    add_threads_arg,
    apply_threads,
    bounded,
    check_overwrite_has_out,
    check_scheme_args,
    on_device,
)
from kvbits._files import write_text_atomic
from kvbits._json import dumps
from kvbits.evaluate.data import DATA_PATH_HELP

__all__ = ["add_parser", "calibration_dir", "run"]

EPILOG = """\
examples:
  kvbits tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 1k --serve-context 4k \\
      --candidates int8-token --candidates int4-token --candidates int2-token --budget-bits 5 --out tuned.json
  kvbits eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --scheme tuned.json --scheme int4-token
  kvbits tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 1k --candidates fp16 \\
      --candidates kvquant-4 --candidates kvquant-2 --calibration cal/kvq4 --calibration cal/kvq2 \\
      --budget-bits 3 --out kvq3.json
  kvbits eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --scheme kvq3.json --calibration kvq3.calibration

--out writes the chosen mix as a scheme JSON (any command's --scheme takes it) and, beside it,
<out>.tune.json with the sensitivity table {"scheme" (the mix), "choice", "candidates", "bits", "sensitivity" (layers x
candidates, KL in nats with only that layer quantized), "budget_bits", "avg_bits" (kvbits plan's at
--serve-context, recorded as meta.serve_context; "bits" are the uniform candidates'), "predicted_kl",
"measured_kl", "uniform", "compare" ([{scheme, avg_bits, measured_kl}] of each --compare), "rounds", "meta",
"calibration"}; --json prints that record. --rounds 2 re-chooses from
marginal KLs measured around the first mix (the layers' errors compound; see BENCHMARKS.md §14), measures each
round's mix (the last one alone also under --no-check) and keeps the best measured.
Calibrated candidates (kvquant-*) take their `kvbits calibrate` folders (--calibration, matched by the
scheme each was calibrated for); every probe and mix runs with the calibration composed from them, and
--out writes the chosen mix's beside the scheme JSON (<out without .json>.calibration/, recorded as
"calibration" in <out>.tune.json) when the mix calibrates some layer. An --out already written by kvbits tune is
replaced (with its calibration folder, removed when the new mix calibrates no layer); an existing --out (or
<out without .json>.calibration/) without <out>.tune.json beside it is refused unless --overwrite.
--compare SCHEME (repeatable) measures a uniform scheme that is not a candidate beside the mix on the same windows
(also under --no-check, which then measures the mix too): on Qwen2.5-Coder-0.5B a kvquant-4 / kvquant-2 mix at 3.68
bits measured KL 0.0955 and uniform kvquant-3 0.0680, which the knapsack over the candidates never sees; a warning
says so when a compared scheme within the budget measures a lower KL than the mix.
Without the progress bar (--no-progress, --json) one line per probed layer, round and check pass goes to stderr.
Tune on text other than the one you evaluate on: the sensitivities are measured, not predicted.
The budget is priced at --serve-context (default --context): on a model with sliding-window layers (Gemma 2/3,
Mistral) the average bits depend on the context (the windows stop growing, the full layers do not), so a mix
within the budget at 1k tokens can exceed it at 4k; give the context you will serve at (a warning says when the
mix would exceed the budget at the model's max context and no --serve-context was given).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvbits.cli import _positive, parse_tokens
    from kvbits.evaluate.cli import DEVICES

    p = subparsers.add_parser(
        "tune",
        help="choose each layer's scheme within an average-bits budget from measured sensitivity",
        description="Measure the KL of the model with one layer at a time stored by each candidate scheme, "
        "pick the assignment with the least summed KL within --budget-bits average bits (exact knapsack; the mix's "
        "avg_bits as kvbits plan reports it at --serve-context, default --context), "
        "then measure that mix and the uniform candidates on the same windows.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_data_args(
        p,
        model_help="offline name, hub id, local folder or .gguf",
        data_help="tuning text: a registered name or a file",
        data_path_help=DATA_PATH_HELP,
    )
    p.add_argument(
        "--candidates", action="append", required=True, metavar="SCHEME",
        help="a flat scheme (one with static scales or NUQ codebooks, e.g. kvquant-4, with its --calibration); "
        "repeat (at least two)",
    )  # fmt: skip
    p.add_argument(
        "--calibration", action="append", metavar="DIR",
        help="kvbits calibrate folder of a calibrated candidate (matched by the scheme it was made for); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--compare", action="append", metavar="SCHEME",
        help="a uniform scheme that is not a candidate (e.g. one at the budget's bits: kvquant-3 beside a kvquant-4 / "
        "kvquant-2 mix), measured beside the mix on the same windows, also under --no-check (its --calibration "
        "matched as the candidates'); a warning says when one within the budget measures a lower KL; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--budget-bits", type=bounded(float, 0, lo_open=True), required=True,
        help="largest average bits of the mix: kvbits plan's avg_bits at --serve-context (every byte held, over the "
        "elements an fp16 cache holds)",
    )  # fmt: skip
    p.add_argument(
        "--dtype-bytes", type=int, choices=(1, 2, 4, 8),
        help="bytes of a full-precision K/V value as served (2: bfloat16/float16), pricing residual windows and sinks "
        "in the budget (default: those of --dtype, float32 = 4)",
    )  # fmt: skip
    p.add_argument("--context", type=parse_tokens, default=1024, help="tokens per window, e.g. 1k (default 1024)")
    p.add_argument(
        "--serve-context", type=parse_tokens,
        help="tokens the mix will be served at, where --budget-bits is priced (default --context); with sliding-window "
        "layers the average bits grow with the context",
    )  # fmt: skip
    p.add_argument("--windows", type=_positive, default=1, help="number of windows (default 1)")
    p.add_argument(
        "--rounds", type=_positive, default=1,
        help="1: choose from one-layer KLs; more: re-choose from marginal KLs around the previous mix, each "
        "round as costly as the first (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--name", help="name of the mix (default tuned-<budget>); not a candidate's, a preset's or a mix of presets"
    )
    p.add_argument("--out", help="scheme JSON to write (and <out>.tune.json with the measurements)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="write --out even where it (or its .calibration/ folder) exists and kvbits tune did not write it",
    )  # fmt: skip
    p.set_defaults(_out_kind="file")  # kvbits.cli checks it before the run as a file path, not a folder
    p.add_argument(
        "--no-check", action="store_true",
        help="skip measuring the uniform candidates and, with --rounds 1, the chosen mix (more rounds measure each "
        "round's mix, to keep the best)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the tune record as JSON")
    add_bos_arg(p, note=" (every sensitivity, round and check pass; the tune record's meta \"bos\" says what ran, "
                "and a --calibration cut with another BOS choice is warned about)")
    add_dtype_device(p, DEVICES)
    add_threads_arg(p)
    p.add_argument(
        "--no-progress", action="store_true",
        help="no progress bar: one line per probed layer, round and check pass on stderr instead (as --json)",
    )  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.candidates, role="candidate")  # torch-free: a misspelled name or a peer is refused in ~0.2 s
    check_scheme_args(args.compare, role="compare")  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from kvbits.evaluate.request import check_device
    from kvbits.tune import tune

    check_device(args.device)  # before the model loads
    check_overwrite_has_out(args)
    if args.out:  # "~/mix.json" (quoted, or --out=~/...: no shell expansion) is the home's, not a folder named "~"
        args.out = os.path.expanduser(args.out)
    if args.out and Path(args.out).suffix.lower() != ".json":
        raise ValueError(f"--out {args.out}: expected a .json path (what --scheme takes back)")
    if args.out:
        check_tune_out(args.out, overwrite=args.overwrite)  # before the passes, not after
    apply_threads(args.threads)  # before tune() loads the model
    bar = not (args.no_progress or args.json)
    with _lines_without_bar(not bar), on_device(args.device):  # cuda:N current: Triton uses the current device
        res = tune(
            args.model, args.data, args.candidates, args.budget_bits, context=args.context, windows=args.windows,
            name=args.name, data_path=args.data_path, dtype=args.dtype, device=args.device, check=not args.no_check,
            rounds=args.rounds, progress=bar, calibrations=args.calibration, dtype_bytes=args.dtype_bytes,
            serve_context=args.serve_context, compare=args.compare, bos=args.bos,
        )  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, res.scheme.to_json() + "\n")
        if res.calibration is not None:
            res.calibration.save(calibration_dir(out))
        else:  # an earlier calibrated mix's folder beside this mix would pass for its calibration
            _remove_calibration(calibration_dir(out))
        record = res.to_dict()
        write_text_atomic(_tune_record(out), dumps(record, indent=2) + "\n")
    else:
        record = res.to_dict()
    if args.json:
        sys.stdout.write(dumps(record, indent=2) + "\n")
        return 0
    _print(res, args.out)
    return 0


@contextmanager
def _lines_without_bar(on: bool) -> Iterator[None]:
    """Without the progress bar (``--no-progress``, ``--json``), ``kvbits.tune``'s INFO lines (one per probed layer,
    round and check pass) reach stderr also without ``-v``: a run of tens of minutes on a CPU said nothing until
    its end."""
    log = logging.getLogger("kvbits.tune")
    level = log.level
    if on and not log.isEnabledFor(logging.INFO):
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.setLevel(level)


def _tune_record(out: str | Path) -> Path:
    return Path(str(out) + ".tune.json")


def check_tune_out(out: str | Path, *, overwrite: bool = False) -> None:
    """``ValueError`` when ``--out`` (a scheme JSON) or its calibration folder exists but ``<out>.tune.json`` does
    not, so kvbits tune did not write them (a file of someone else's under that name), unless ``overwrite``."""
    cal = calibration_dir(out)
    there = [str(p) for p in (Path(out), cal) if p.exists()]
    if there and not _tune_record(out).is_file() and not overwrite:
        raise ValueError(
            f"{' and '.join(there)} exist(s) but {_tune_record(out)} does not: not written by kvbits tune; "
            "choose another --out or pass --overwrite"
        )


def _remove_calibration(folder: Path) -> None:
    """Remove the calibration files in ``folder`` (and ``folder`` once empty; other files are kept)."""
    from kvbits.calibrate.artifact import META_FILE, TENSORS_FILE

    gone = [n for n in (META_FILE, TENSORS_FILE) if (folder / n).is_file()]
    for name in gone:
        (folder / name).unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    if gone:
        print(f"removed the earlier mix's calibration in {folder}: this mix calibrates no layer", file=sys.stderr)


def calibration_dir(out: str | Path) -> Path:
    """Where ``--out OUT`` puts the chosen mix's calibration: ``OUT`` without ``.json``, then ``.calibration``."""
    out = str(out)
    return Path(out.removesuffix(".json") + ".calibration")


def _print(res: Any, out: str | None) -> None:
    from rich.table import Table

    from kvbits._console import stdout_console

    console = stdout_console()
    table = Table(title=f"KL with one layer quantized (nats), {res.meta['model']} on {res.meta['data']}")
    table.add_column("layer", justify="right")
    for name, bits in zip(res.candidates, res.bits):
        table.add_column(f"{name} ({bits:.2f} b)", justify="right")
    table.add_column("chosen")
    for i, row in enumerate(res.sensitivity):
        table.add_row(str(i), *(f"{x:.3g}" for x in row), res.choice[i])
    console.print(table)
    kept = next((k for k, r in enumerate(res.rounds) if r["choice"] == res.choice), 0)
    line = (
        f"{res.scheme.name}: {res.avg_bits:.3f} average bits at {res.meta['serve_context']} tokens (budget "
        f"{res.budget_bits:g}); KL predicted {res.predicted_kl:.4g} "
        + ("(sum of single-layer KLs)" if kept == 0 else f"(round {kept + 1}, from marginal KLs)")
    )
    line += ", not measured (--no-check)" if res.measured_kl is None else f", measured {res.measured_kl:.4g}"
    if res.uniform:
        line += "; uniform: " + ", ".join(f"{n} {u['kl']:.4g} at {u['avg_bits']:.2f} b" for n, u in res.uniform.items())
    console.print(line)
    if res.compare:
        from kvbits.tune.search import better_compared

        better = {c["scheme"] for c in better_compared(res)}
        console.print(
            "compared: "
            + ", ".join(
                f"{c['scheme']} {c['measured_kl']:.4g} at {c['avg_bits']:.2f} b"
                + (" (within the budget, lower KL than the mix)" if c["scheme"] in better else "")
                for c in res.compare
            )
        )
    if len(res.rounds) > 1:
        for k, r in enumerate(res.rounds, 1):
            measured = r.get("measured_kl")
            console.print(
                f"round {k}: KL predicted {r['predicted_kl']:.4g}, measured "
                + ("-" if measured is None else f"{measured:.4g}")
            )
    if out and res.calibration is not None:
        cal = calibration_dir(out)
        console.print(
            f"wrote {out}, its calibration {cal} (kvbits eval --scheme {out} --calibration {cal}) and {out}.tune.json"
        )
    elif out:
        console.print(f"wrote {out} (kvbits eval --scheme {out}) and {out}.tune.json")
    elif res.calibration is not None:
        console.print("the mix needs its composed calibration: give --out to write it beside the scheme")
