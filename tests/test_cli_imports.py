"""Building the ``kvbits`` parser (``--help``, an argument error) imports no torch: it answered after 3-8 s of imports
(torch, transformers, ``torch._dynamo``) and now answers in ~0.2 s. The command modules import their machinery in
``run``; the stage packages export their names lazily (``kvbits._lazy``)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "torch._dynamo", "transformers", "numpy", "triton", "matplotlib")


def _loaded_after(code: str) -> list[str]:
    script = code + f"\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    return [m for m in out.stdout.rstrip("\n").rsplit("\n", 1)[-1].split(",") if m]


def test_building_every_parser_imports_no_torch() -> None:
    assert _loaded_after("from kvbits.cli import build_parser\nbuild_parser()") == []


def test_help_and_argument_errors_import_no_torch() -> None:
    code = (
        "import contextlib, io\nfrom kvbits.cli import main\n"
        "for argv in (['--help'], ['calibrate', '--percentile', '5'], ['analyze', '--help'], ['tune', '--bogus']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n            main(argv)\n        except SystemExit:\n            pass"
    )
    assert _loaded_after(code) == []


def test_cli_copies_of_library_constants_agree() -> None:
    from kvbits.analyze import cli as analyze_cli
    from kvbits.analyze import outliers
    from kvbits.calibrate import cli as calibrate_cli

    calibrate_module = importlib.import_module("kvbits.calibrate.calibrate")  # the module, not the function
    assert calibrate_cli.DEVICES == calibrate_module.DEVICES
    assert analyze_cli.DEFAULT_THRESHOLD == outliers.DEFAULT_THRESHOLD
    assert analyze_cli.DEFAULT_LAYER_FRACTION == outliers.DEFAULT_LAYER_FRACTION


def test_lazy_exports_keep_functions_over_same_named_submodules() -> None:
    """``kvbits.calibrate.calibrate`` / ``kvbits.monitor.watch`` / ``kvbits.report.verdict`` are both a submodule and
    the function the package exports: the package attribute stays the function, whichever is imported first."""
    import types

    for package, name in (("kvbits.calibrate", "calibrate"), ("kvbits.monitor", "watch"), ("kvbits.report", "verdict")):
        importlib.import_module(f"{package}.{name}")  # the submodule first
        value = getattr(importlib.import_module(package), name)
        assert callable(value) and not isinstance(value, types.ModuleType), (package, name)
        assert value.__module__ == f"{package}.{name}"
