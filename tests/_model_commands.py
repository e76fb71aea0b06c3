"""The subcommands that run a model (those with ``--dtype``), each with the arguments a run needs besides ``--model``
(shared by the ``--threads`` and ``--device cuda:N`` tests, which stop each run before the model loads)."""

from __future__ import annotations

from pathlib import Path

COMMANDS = {
    "eval": ["--data", "wikitext2", "--scheme", "kivi-2"],
    "speed": ["--context", "1k", "--scheme", "kivi-2"],
    "calibrate": ["--data", "wikitext2", "--scheme", "kvquant-4"],  # --out: command_args' tmp_path
    "analyze": ["--data", "wikitext2"],
    "monitor": ["--data", "wikitext2", "--scheme", "kivi-2"],
    "needle": ["--context", "1k", "--scheme", "kivi-2"],
    "tune": ["--data", "wikitext2", "--candidates", "kivi-2", "--candidates", "kivi-4", "--budget-bits", "3"],
}


def command_args(command: str, tmp_path: Path) -> list[str]:
    """``COMMANDS[command]``, with calibrate's required ``--out`` under ``tmp_path``."""
    extra = ["--out", str(tmp_path / "cal")] if command == "calibrate" else []
    return [*COMMANDS[command], *extra]
