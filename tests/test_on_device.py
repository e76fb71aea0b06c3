"""``--device cuda:N``: every command that runs a model does its model work with ``cuda:N`` the current CUDA device
(``kvbits._argtypes.on_device``). Triton launches its kernels on the current device's stream, and a bare
``torch.cuda.synchronize()`` / ``Stream()`` / ``Event`` use the current device too: with ``--device cuda:1`` and
cuda:0 current (the default), kvbits' Triton kernels were launched against cuda:0 for tensors on cuda:1. No GPU
here: ``torch.cuda.device`` is a recorder, CUDA's availability a stand-in, and each run stops where the model is
looked up. Untested on a multi-GPU machine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


def _entry_calls() -> dict[str, Any]:
    """Each public Python entry point that loads a model from a spec, called with ``device="cuda:1"``."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate import evaluate, needle_eval
    from kvbits.evaluate.speed import speed_eval
    from kvbits.monitor import watch
    from kvbits.tune import tune

    m = "smollm2-135m"
    return {
        "evaluate": lambda d: evaluate(m, "wikitext2", 1024, ["kivi-2"], device=d),
        "speed_eval": lambda d: speed_eval(m, [1024], ["kivi-2"], device=d),
        "needle_eval": lambda d: needle_eval(m, [1024], ["kivi-2"], device=d),
        "tune": lambda d: tune(m, "wikitext2", ["kivi-2", "kivi-4"], 3.0, device=d),
        "calibrate": lambda d: calibrate(m, "wikitext2", "kvquant-4", device=d),
        "watch": lambda d: watch(m, "wikitext2", 1024, "kivi-2", device=d),
    }


@pytest.mark.parametrize("entry", sorted(_entry_calls()))
def test_each_python_entry_point_makes_its_cuda_device_current(
    entry: str, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called from Python (no CLI ``on_device`` around it), ``device="cuda:1"`` is current while the model is looked
    up (then loaded and run), and the caller's current device is back afterwards; ``cpu`` makes nothing current.
    Before, only the CLI entered it: a Python caller's Triton kernels were launched against cuda:0."""
    seen: list[Any] = []

    def looked(spec: str, **_: Any) -> None:
        seen.append(recorder.current)
        raise _Looked(spec)

    monkeypatch.setattr(source, "fetch_offline_model", looked)
    call = _entry_calls()[entry]
    for device, expected in (("cuda:1", 1), ("cpu", None)):
        with pytest.raises(_Looked):
            call(device)
        assert seen[-1] == expected, (entry, device)
    assert recorder.current is None


class _OnCuda1(torch.nn.Module):
    """A module whose parameters say they live on cuda:1 (no GPU here); its forward is never reached."""

    def parameters(self, recurse: bool = True) -> Any:
        class _P:
            device = torch.device("cuda", 1)

        yield _P()


@pytest.mark.parametrize("entry", ["analyze", "stream_hidden", "calibrate"])
def test_entry_points_given_a_model_make_its_device_current(
    entry: str, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model object (no ``device`` argument): its parameters' cuda:1 is entered around the call."""
    from kvbits.analyze import analyze
    from kvbits.calibrate import calibrate
    from kvbits.evaluate import stream_hidden

    model = _OnCuda1()
    call = {
        "analyze": lambda: analyze(model, torch.zeros(1, 8, dtype=torch.long)),
        "stream_hidden": lambda: stream_hidden(model, torch.zeros(1, 8, dtype=torch.long), "kivi-2"),
        "calibrate": lambda: calibrate(model, torch.zeros(1, 8, dtype=torch.long), "kvquant-4"),
    }[entry]
    with pytest.raises(Exception):  # noqa: B017 - the stand-in model fails somewhere inside; only the device matters
        call()
    assert recorder.entered[:1] == [1] and recorder.current is None


class _FakeCuda:
    """Stand-in for ``torch.cuda``'s current device: ``set_device`` records, ``current_device`` reads it."""

    def __init__(self, current: int) -> None:
        self.current, self.set = current, []

    def set_device(self, device: Any) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        self.set.append(index)
        self.current = index

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:  # torch.cuda.device(index): current inside, restored after
        before = self.current
        self.set_device(index)
        try:
            yield
        finally:
            self.set_device(before)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_distributed_evaluate_restores_the_callers_current_cuda_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of a distributed evaluate (torchrun script, notebook) with cuda:1 current: ``Ranks.device`` makes the
    rank's device current (``cuda`` -> ``cuda:$LOCAL_RANK``, here 0; an explicit ``cuda:0``), and it stayed so after
    evaluate returned or raised; the caller's cuda:1 is current again now. No GPU here: CUDA's current device is a
    stand-in and the run stops where the model is looked up, after the device was set."""
    from kvbits.evaluate import runner
    from kvbits.evaluate.distributed import Ranks

    class TwoRanks(Ranks):  # rank 0 of 2, its collectives answered locally (every rank agrees)
        def gather(self, obj: Any) -> list[Any]:
            return [obj] * self.world

        def from_main(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    cuda = _FakeCuda(current=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda.current)
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.cuda, "device", cuda.device)  # on_device's cuda:N (runs_on_device)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(runner, "resolve_ranks", lambda distributed: TwoRanks(rank=0, world=2, backend="gloo"))

    def looked(spec: str, **_: Any) -> None:
        assert cuda.current == 0  # the rank's device, current while it runs
        raise _Looked(spec)

    monkeypatch.setattr(source, "fetch_offline_model", looked)
    with pytest.raises(_Looked):
        runner.evaluate("smollm2-135m", "wikitext2", 64, ["fp16"], device=device, distributed=True)
    assert cuda.set[0] == 0 and cuda.current == 1
