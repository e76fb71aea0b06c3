"""``--device cuda:N``: every command that runs a model does its model work with ``cuda:N`` the current CUDA device
(``kvbits._argtypes.on_device``). Triton launches its kernels on the current device's stream, and a bare
``torch.cuda.synchronize()`` / ``Stream()`` / ``Event`` use the current device too: with ``--device cuda:1`` and
cuda:0 current (the default), kvbits' Triton kernels were launched against cuda:0 for tensors on cuda:1. No GPU
here: ``torch.cuda.device`` is a recorder, CUDA's availability a stand-in, and each run stops where the model is
looked up. Untested on a multi-GPU machine."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _model_commands import COMMANDS, command_args

from kvbits import cli
from kvbits._argtypes import on_device
from kvbits.evaluate.models import source


class _Looked(Exception):
    """Raised where the model is looked up: the run stops before anything loads."""


class _Recorder:
    """Stand-in for ``torch.cuda.device``: records the indices entered; ``current`` is the one in force."""

    def __init__(self) -> None:
        self.entered: list[Any] = []
        self.stack: list[Any] = []

    def __call__(self, index: Any) -> _Recorder:
        self.entered.append(index)
        self.stack.append(index)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.stack.pop()

    @property
    def current(self) -> Any:
        return self.stack[-1] if self.stack else None


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "device", rec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return rec


@pytest.mark.parametrize("device", ["cuda:1", torch.device("cuda", 1)])
def test_on_device_makes_an_indexed_cuda_device_current(recorder: _Recorder, device: Any) -> None:
    with on_device(device):
        assert recorder.current == 1
    assert recorder.entered == [1] and recorder.current is None


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps", None, "not-a-device", "cuda:7"])
def test_on_device_is_a_no_op_elsewhere(recorder: _Recorder, device: Any) -> None:
    """cpu / mps / cuda without an index / None: nothing to make current; an unparsable string or an index past the
    visible devices: the command's ``check_device`` says what is wrong, not ``torch.cuda.device``."""
    with on_device(device):
        pass
    assert recorder.entered == []


def test_on_device_is_a_no_op_without_cuda(recorder: _Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with on_device("cuda:1"):
        pass
    assert recorder.entered == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_looks_its_model_up_with_its_cuda_device_current(
    command: str, recorder: _Recorder, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda:1``: the model is looked up (then loaded and run) with cuda:1 current; ``--device cpu``:
    nothing is made current."""
    seen: list[Any] = []

    def looked(spec: str, **_: Any) -> None:
        seen.append(recorder.current)
        raise _Looked(spec)

    monkeypatch.setattr(source, "fetch_offline_model", looked)
    args = command_args(command, tmp_path)
    for device, expected in (("cuda:1", 1), ("cpu", None)):
        with pytest.raises(_Looked):
            cli.main([command, "--model", "smollm2-135m", *args, "--device", device])
        assert seen[-1] == expected, (command, device)
    assert recorder.current is None  # left on the way out
