"""Would a captured decode step replay correctly? A CUDA graph's replay, emulated on the CPU, per cache.

    PYTHONPATH=src:benchmarks python benchmarks/graph_replay.py [--layers 2] [--steps 12] [--scheme kivi-4]
        [--static-scheme int4-token] [--caches static,dynamic,kvbits-fused,kvbits-dequant,...]
        [--kernel reference|triton] [--json out.json]

A CUDA graph records the kernels one step launches, with their arguments and the addresses of every tensor they
read and write, and replays exactly those: no Python runs, the sizes and scalars are the captured ones, and what
changes between steps must change in the tensors' contents (a decode loop copies the next token and its position
into the captured inputs before each replay). ``graph_blockers.py`` lists the operators whose arguments differ
between consecutive steps, which a replay would get wrong: a necessary condition. This script checks the outcome.

``OpTape`` records every torch operator of one decode step (``TorchDispatchMode``) with its tensors themselves, and
``replay`` runs the tape again as a graph would: each operator on the same tensors, its fresh result copied into
the tensors it returned the first time (an operator's outputs keep their addresses in a graph's memory pool);
views and allocations are not rerun (they alias or are the recorded memory), in-place operators write where they
wrote. The decode loop then prefills and decodes eagerly (3 steps, and one flush block of a kvbits scheme), records
one step with its token, ``position_ids`` and ``cache_position`` in tensors of their own, and replays that tape for
the next ``--steps`` steps after writing each step's token and position into them. The same model, prompt and tokens
decode eagerly beside it; ``first_wrong_step`` is the first step whose logits differ from the eager step's, the
recorded step counted 0 and the replays from 1 (``None``: every one equal, bit for bit), with the largest difference. Host reads during the recorded step (``item()``:
a device sync on a GPU, which a capture refuses) are counted. kvbits' kernels run their torch reference by default;
``--kernel triton`` runs Triton's kernels through its interpreter instead (slow), as a GPU step launches them (the
fused decode and merge, the flushes' quantize kernel): each launch is a tape entry (``TritonLaunch``), rerun on its
recorded arguments and grid.

The emulation is sufficient for what it sees: a cache that replays wrongly here would replay wrongly as a graph. A
tape that replays right here can still fail on a GPU (a kernel outside torch's dispatcher, an allocation the graph's
pool places elsewhere), so equality here is necessary, not sufficient, for a capturable step.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from graph_blockers import PROMPT, build, parse_args, scheme_of, warm_steps
from torch.utils._python_dispatch import TorchDispatchMode


class OpTape(TorchDispatchMode):
    """Records ``(operator, args, kwargs, outputs)`` of every operator in its block, with the tensors themselves,
    and counts host reads (``_local_scalar_dense``). Triton launches land on it too, as ``TritonLaunch`` entries,
    while ``triton_on_tape`` is active; the operators Triton's interpreter runs inside a launch (its copies of the
    arguments) are part of the launch, not entries of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.host_reads = 0
        self.depth = 0  # > 0 inside a Triton launch
        self.launches = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth:
            return out
        if str(func).startswith("aten._local_scalar_dense"):
            self.host_reads += 1
        self.ops.append((func, args, kwargs, out))
        return out


class TritonLaunch:
    """A tape entry for one Triton launch: replayed by running the same kernel on the same arguments and grid."""

    is_view = False

    def __init__(self, kernel: Any, run: Callable[..., Any]) -> None:
        self.kernel, self.run = kernel, run

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.run(self.kernel, *args, **kwargs)

    def __str__(self) -> str:
        return f"triton.{self.kernel.__name__}"


@contextlib.contextmanager
def triton_on_tape(tape: OpTape) -> Iterator[None]:
    """Record the Triton launches of the block on ``tape`` (kernels run through Triton's interpreter; nothing to
    record without Triton)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        yield
        return

    real = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        tape.depth += 1
        try:
            out = real(self, *args, **kwargs)
        finally:
            tape.depth -= 1
        if not tape.depth and not kwargs.get("warmup"):
            tape.ops.append((TritonLaunch(self, real), args, kwargs, None))
            tape.launches += 1
        return out

    with mock.patch.object(InterpretedFunction, "run", run):
        yield


def _write_back(recorded: Any, fresh: Any) -> None:
    """Copy ``fresh`` (a rerun operator's result) into ``recorded`` (what it returned on the tape), tensor by tensor;
    a result that is the recorded tensor's memory (an in-place or ``out=`` operator) is left as it is, and so is a
    Triton launch's (it wrote into its arguments)."""
    if recorded is None:
        return
    if isinstance(recorded, torch.Tensor):
        if not isinstance(fresh, torch.Tensor) or fresh.shape != recorded.shape:
            raise RuntimeError(f"a replayed operator returned {type(fresh).__name__} "
                               f"{getattr(fresh, 'shape', '')} where the tape holds {tuple(recorded.shape)}")  # fmt: skip
        if fresh.data_ptr() != recorded.data_ptr() or fresh.stride() != recorded.stride():
            recorded.copy_(fresh)
    elif isinstance(recorded, (list, tuple)):
        for r, f in zip(recorded, fresh, strict=True):
            _write_back(r, f)


def replay(tape: OpTape) -> None:
    """Run ``tape``'s operators again as a CUDA graph replays its kernels (see the module docstring)."""
    for func, args, kwargs, out in tape.ops:
        name = str(func)
        if func.is_view or name.startswith(("aten.empty", "aten.new_empty", "aten._local_scalar_dense")):
            continue  # aliases of recorded memory, the recorded memory itself, a host read (its value is baked)
        _write_back(out, func(*args, **kwargs))


def as_captured() -> Any:
    """What a CUDA capture tells the code it runs (``torch.cuda.is_current_stream_capturing()`` is true): transformers'
    mask code then builds a padding mask without reading it back (``is_tracing``), and ``StaticQuantizedKVCache``
    stops trusting its host counts, as under ``torch.cuda.graph``."""
    return mock.patch("torch.cuda.is_current_stream_capturing", return_value=True)


def tape_capture(step: Any, device: torch.device | None = None) -> tuple[torch.Tensor, Any]:
    """``kvbits.evaluate.graphs``' capture for the CPU: record ``step()`` on a tape (the recording runs it, Triton
    launches included) and return its logits and the tape's replay; ``RuntimeError`` if the step read a host value,
    which a CUDA capture refuses. ``device`` (the step's, as ``GraphedDecode`` passes it) changes nothing here."""
    tape = OpTape()
    with tape, triton_on_tape(tape), as_captured():
        logits = step()
    if tape.host_reads:
        raise RuntimeError(f"the captured decode step read {tape.host_reads} host values (a CUDA capture refuses them)")
    return logits, lambda: replay(tape)


@contextlib.contextmanager
def emulated_graphs() -> Iterator[None]:
    """Inside, ``kvbits.evaluate.graphs`` captures CPU decode steps with ``tape_capture`` (tests, CPU smoke runs)."""
    from kvbits.evaluate import graphs

    with mock.patch.dict(graphs.CAPTURES, {"cpu": tape_capture}):
        yield


def check(cache_name: str, layers: int, steps: int, scheme: str, kernel: str = "reference") -> dict[str, Any]:
    """Replay one recorded decode step of ``cache_name`` for ``steps`` steps beside eager decoding (see above).
    ``kernel="triton"``: kvbits' kernels (fused decode, flushes) through Triton's interpreter, as a GPU step
    launches them (``enable_interpreter`` first); ``"reference"``: their torch reference, as on a CPU."""
    kvbits = cache_name.startswith("kvbits")
    with mock.patch.dict(os.environ, {"KVBITS_KERNEL": "triton"} if kvbits and kernel == "triton" else {}):
        row = _replayed_beside_eager(cache_name, layers, steps, scheme)
    return {**row, "kernel": kernel if kvbits else None}


def _replayed_beside_eager(cache_name: str, layers: int, steps: int, scheme: str) -> dict[str, Any]:
    warm = warm_steps(cache_name, scheme)
    tokens = torch.randint(0, 256, (warm + 1 + steps,), generator=torch.Generator().manual_seed(1))
    logits: dict[str, list[torch.Tensor]] = {}
    tape = OpTape()
    for mode in ("eager", "replay"):
        model, _cache, kw, ids = build(cache_name, layers, scheme, PROMPT + warm + 1 + steps)
        token = torch.zeros(1, 1, dtype=torch.long)  # the captured inputs: written before each step
        position = torch.zeros(1, dtype=torch.long)
        got = logits[mode] = []
        with torch.no_grad():
            model(ids, **kw, use_cache=True, logits_to_keep=1)
            recorded = None
            for i in range(warm + 1 + steps):
                token.fill_(int(tokens[i]))
                position.fill_(PROMPT + i)
                if mode == "replay" and i > warm:
                    replay(tape)
                    got.append(recorded.clone())
                    continue
                args = {"use_cache": True, "logits_to_keep": 1, "cache_position": position, "position_ids": position[None]}
                if mode == "replay" and i == warm:
                    with tape, triton_on_tape(tape), as_captured():
                        out = model(token, **kw, **args)
                    recorded = out.logits
                else:
                    out = model(token, **kw, **args)
                if i >= warm:
                    got.append(out.logits.clone())
    first, worst = None, 0.0
    for i, (a, b) in enumerate(zip(logits["eager"], logits["replay"], strict=True)):
        diff = float((a - b).abs().max())
        if diff and first is None:
            first = i
        worst = max(worst, diff)
    return {"cache": cache_name, "scheme": scheme if cache_name.startswith("kvbits") else "fp32", "layers": layers,
            "replayed_steps": steps,
            "tape_ops": len(tape.ops), "triton_launches": tape.launches, "host_reads": tape.host_reads,
            "first_wrong_step": first, "max_logit_diff": worst}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    a, names = parse_args(__doc__, 12, "replayed decode steps", argv, extra=_kernel_option)
    if a.kernel == "triton":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    rows = [check(n, a.layers, a.steps, scheme_of(n, a), a.kernel) for n in names]
    print(f"{a.layers} layers, one decode step recorded after a {PROMPT}-token prompt and replayed {a.steps} times")
    print("| cache | kvbits' kernels | operators on the tape (Triton launches) | host reads | first wrong step "
          "(replays from 1) | largest logit difference |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        wrong = "none" if r["first_wrong_step"] is None else r["first_wrong_step"]
        print(f"| {r['cache']} ({r['scheme']}) | {r['kernel'] or ''} | {r['tape_ops']} ({r['triton_launches']}) | "
              f"{r['host_reads']} | {wrong} | {r['max_logit_diff']:.3g} |")  # fmt: skip
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


def _kernel_option(p: Any) -> None:
    p.add_argument("--kernel", choices=("reference", "triton"), default="reference",
                   help="kvbits' kernels: the torch reference (default) or Triton's, through its interpreter, as a "
                   "GPU step launches them (slow)")  # fmt: skip


if __name__ == "__main__":
    main()
