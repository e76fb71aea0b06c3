"""``--threads``: every subcommand that runs a model takes the same option (``kvbits._argtypes.add_threads_arg``), and
its value reaches ``torch.set_num_threads`` before the model loads. Only eval and speed had it: calibrate, analyze,
monitor, needle and tune refused ``--threads 3`` (``unrecognized arguments``), leaving ``OMP_NUM_THREADS`` to guess."""

from __future__ import annotations

import argparse

import pytest
import torch
from _model_commands import COMMANDS, command_args

from kvbits import cli
from kvbits._argtypes import THREADS_HELP, apply_threads

MODEL = "/nonexistent/kvbits-threads-test-model"  # never loaded: the thread setting stops each run first


class _Set(Exception):
    """Raised by the stand-in ``torch.set_num_threads``: the run stops where the thread count is set."""


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_that_runs_a_model_takes_threads() -> None:
    """The commands with ``--dtype`` (those that load a model) are exactly those with ``--threads``, one option:
    same type (an integer >= 1), default (None: torch's) and help."""
    commands = _subparsers()
    running = sorted(n for n, p in commands.items() if any("--dtype" in a.option_strings for a in p._actions))
    assert running == sorted(COMMANDS)
    for name in running:
        (action,) = (a for a in commands[name]._actions if "--threads" in a.option_strings)
        assert action.default is None, name
        assert action.help is not None and action.help.startswith(THREADS_HELP), name
        assert action.type("3") == 3
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 1, got '0'"):
            action.type("0")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_threads_reaches_torch_before_the_model_loads(
    command: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--threads 3`` calls ``torch.set_num_threads(3)`` before the (nonexistent) model is looked up: the stand-in
    raises, so a run that loaded the model first would end in the model's error instead."""

    def stop(n: int) -> None:
        raise _Set(n)

    monkeypatch.setattr(torch, "set_num_threads", stop)
    with pytest.raises(_Set) as caught:
        cli.main([command, "--model", MODEL, *command_args(command, tmp_path), "--threads", "3"])
    assert caught.value.args == (3,)


def test_apply_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """None leaves torch's count alone; a number sets it."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    apply_threads(None)
    assert calls == []
    apply_threads(2)
    assert calls == [2]
