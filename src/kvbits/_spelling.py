"""How a message names a setting: as the caller gave it (``overwrite=True`` from Python, ``--overwrite`` from the
``kvbits`` command line).

The library's checks raise the same message for both callers; they used to name both spellings
("overwrite=True (--overwrite)", "pass weights_gib=... (CLI --weights-gib)"), so a user who typed ``--gpu-mem``
read about ``gpu_mem_gib``. :func:`kvbits.cli.main` runs every subcommand inside :func:`cli_spelling`, and the
messages ask :func:`spell` which to print.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_CLI: ContextVar[bool] = ContextVar("kvbits_cli_spelling", default=False)


def spell(api: str, flag: str) -> str:
    """``api`` (``"overwrite=True"``) for a Python caller, ``flag`` (``"--overwrite"``) inside :func:`cli_spelling`."""
    return flag if _CLI.get() else api


@contextmanager
def cli_spelling() -> Iterator[None]:
    """Within it (the ``kvbits`` command line), :func:`spell` names command-line flags."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)
