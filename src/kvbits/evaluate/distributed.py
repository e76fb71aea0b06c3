"""Data-parallel evaluation over ``torch.distributed``: which windows a rank evaluates, and how the
ranks' results become one.

``evaluate`` runs on every rank of an initialized process group (``torchrun``; ``kvbits eval``
initializes one itself when ``WORLD_SIZE`` > 1). Rank ``r`` of ``n`` evaluates the windows
``w % n == r``; the per-window math is unchanged, so the combined per-token arrays are bit-identical
to a single-process run's and so is every number derived from them. The combination is one
``all_reduce`` SUM per array, over the float32 bits seen as int32: each window's row is non-zero on
its owner only, so the integer sum *is* the owner's bit pattern (a float sum would turn ``-0.0``
into ``0.0``). Counters and timings travel with ``all_gather_object``.

Failures: each phase of the run ends with an agreement step (one ``all_gather_object`` of every
rank's outcome), so an exception on one rank is raised on every rank (the failing rank raises its
own, the others :class:`RankFailed`) instead of leaving them waiting in a collective. A rank that
dies outright (killed, segfault) is not seen this way; ``torchrun`` stops the others then. Neither is a
``KeyboardInterrupt`` (or ``SystemExit``) on one rank, by choice: sharing it would mean waiting in a collective
until every other rank finished its phase (hours for a rank mid-window), so the interrupted rank leaves at once and
the others are stopped as for a rank that died (``torchrun`` stops them; Ctrl-C under ``torchrun`` reaches every
rank anyway). The argument checks run inside agreement steps too: a rank given a bad argument of its own raises it,
the others :class:`RankFailed` ("failed while checking its arguments"). Ranks given
different runs (arguments, token ids, weights or text content; a rank's own ``device`` and ``data_path``
aside) are refused on every rank before any window (:meth:`Ranks.check_same`), not combined.

No home-made cluster: the process group is torch's, created by ``torchrun`` / the caller (or
``kvbits eval`` from torchrun's environment, :func:`init_from_env`).

Shutdown: ``torch.distributed.nn.functional`` takes ``group.WORLD`` as a default argument when it
is imported, and transformers imports it. Imported after ``init_process_group``, those defaults hold
the group, so ``destroy_process_group()`` cannot free it: gloo's worker threads outlive it, and one
that releases a collective's tensors during interpreter shutdown aborts the process ("terminate
called without an active exception", SIGABRT, after the results were written). This module imports
it first, so a program that imports kvbits before initializing the group is safe;
:func:`resolve_ranks` warns when the group is already caught.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

if torch.distributed.is_available():
    import torch.distributed.nn  # before any process group exists (module docstring)

__all__ = ["RankFailed", "Ranks", "init_from_env", "kept_cuda_device", "resolve_ranks"]

logger = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """Another rank of a distributed evaluation raised; this rank stops too (its message says which
    rank and what it raised)."""


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (``all_gather_object``), else a ``RuntimeError`` with its text:
    an exception that fails to pickle on the sending rank would leave the others waiting."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure: fall back to the text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the evaluation: ``rank`` of ``world`` (``world == 1``: alone, every
    method is a no-op); ``backend``: the default process group's (``"gloo"``, ``"nccl"``)."""

    rank: int = 0
    world: int = 1
    backend: str | None = None

    @property
    def main(self) -> bool:
        """Rank 0: the one that reads and writes ``out_dir``, shows progress and logs the results."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def windows(self, total: int) -> list[int]:
        """The windows this rank evaluates: ``w % world == rank`` (none when ``total <= rank``)."""
        return list(range(self.rank, total, self.world))

    def _collective_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only, on the device this rank set (torch.cuda.set_device)
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``[obj]`` alone); picklable objects only."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run on rank 0 only, its result (or its exception) on every rank."""
        if not self.active:
            return fn(*args, **kwargs)
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.main:
            try:
                box[0] = ("ok", fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised everywhere
                box[0] = ("error", _portable(exc))
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    @contextmanager
    def agree(self, what: str) -> Iterator[None]:
        """Run the ``with`` body on every rank, then compare outcomes: an exception on any rank is
        raised on all of them (its own on the failing rank, :class:`RankFailed` elsewhere). ``Exception`` only:
        a ``KeyboardInterrupt`` / ``SystemExit`` leaves this rank at once, without a collective (module docstring)."""
        if not self.active:
            yield
            return
        try:
            yield
        except Exception as exc:
            self.gather(f"{type(exc).__name__}: {exc}")
            raise
        failed = [(r, msg) for r, msg in enumerate(self.gather(None)) if msg is not None]
        if failed:
            r, msg = failed[0]
            raise RankFailed(f"rank {r} of {self.world} failed while {what}: {msg}")

    def check_same(self, what: str, value: dict[str, Any]) -> None:
        """``ValueError`` on every rank unless every rank holds the same ``value`` (a JSON-able dict): the ranks
        combine their windows into one run, so a rank called with other arguments or inputs (its own token ids,
        weights or text file) would be summed in silently, or abort gloo with arrays of another size. The message
        names the first differing rank and keys."""
        if not self.active:
            return
        values = self.gather(value)
        for r, other in enumerate(values):
            if other != values[0]:
                keys = sorted(k for k in {*values[0], *other} if values[0].get(k) != other.get(k))
                raise ValueError(
                    f"rank {r} of {self.world} was given another {what} than rank 0 (differing: {', '.join(keys)}): "
                    "every rank must evaluate the same model, data and arguments"
                )

    def assemble(self, array: np.ndarray) -> None:
        """In place: every rank's rows of ``array`` (zeros where a rank computed nothing) combined
        into the whole, bit for bit (``all_reduce`` SUM over the bits as integers)."""
        if not self.active or array.size == 0:
            return
        import torch.distributed as dist

        if not array.flags.c_contiguous:
            raise ValueError("assemble needs a C-contiguous array")
        as_int = {4: torch.int32, 8: torch.int64}[array.itemsize]
        bits = torch.from_numpy(array.reshape(-1)).view(as_int)  # shares the numpy memory
        dev = self._collective_device()
        if dev.type == "cpu":
            dist.all_reduce(bits)
        else:
            moved = bits.to(dev)
            dist.all_reduce(moved)
            bits.copy_(moved.cpu())

    def device(self, device: str | None) -> str | None:
        """The device this rank loads the model on: ``"cuda"`` (no index) becomes
        ``cuda:$LOCAL_RANK`` (``rank % device_count`` without it) and is made current, as torchrun
        scripts do; an explicit ``cuda:N``, ``"cpu"`` and None are kept. Made current for the caller's whole run:
        ``evaluate`` restores the device that was current before it on return (:func:`kept_cuda_device`)."""
        if not self.active or device is None:
            return device
        dev = torch.device(device)
        if dev.type != "cuda":
            return device
        if dev.index is None:
            local = os.environ.get("LOCAL_RANK")
            index = int(local) if local is not None else self.rank % max(1, torch.cuda.device_count())
            dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        return str(dev)


@contextmanager
def kept_cuda_device() -> Iterator[None]:
    """Make the caller's current CUDA device current again on the way out (returned or raised): a rank's
    :meth:`Ranks.device` (and :func:`init_from_env`) make its device current, as torchrun scripts do, which in a
    process that goes on (a torchrun script that evaluates and then runs its own collectives or kernels on the device
    it chose, a notebook) would otherwise stay changed. CUDA not initialized before: its default device, 0, is restored
    where something made another current. Never initializes CUDA itself; once per run, no per-step cost."""
    before = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        restore = 0 if before is None else before
        if torch.cuda.is_initialized() and torch.cuda.current_device() != restore:
            torch.cuda.set_device(restore)


def _warn_if_group_is_caught() -> None:
    """Log a warning when ``torch.distributed.nn.functional``'s default arguments hold the current
    default process group (it was imported after ``init_process_group``; module docstring)."""
    import sys

    import torch.distributed as dist

    functional = sys.modules.get("torch.distributed.nn.functional")
    defaults = getattr(getattr(functional, "broadcast", None), "__defaults__", None) or ()
    if dist.group.WORLD is not None and any(d is dist.group.WORLD for d in defaults):
        logger.warning(
            "torch.distributed.nn was imported after init_process_group (transformers imports it): its "
            "default arguments keep the process group alive after destroy_process_group(), and gloo can "
            "then abort at interpreter exit (SIGABRT) after the results are written. Import kvbits or "
            "transformers before init_process_group."
        )


def resolve_ranks(distributed: bool | None) -> Ranks:
    """``distributed=None``: data-parallel when a default process group is initialized with more
    than one rank; ``True``: the group must be initialized (one rank is allowed); ``False``: alone,
    whatever the group (every rank evaluates everything)."""
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    if distributed is False or (distributed is None and not ready):
        return Ranks()
    if not ready:
        raise ValueError(
            "distributed=True needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    _warn_if_group_is_caught()
    world = dist.get_world_size()
    if distributed is None and world == 1:
        return Ranks()
    return Ranks(rank=dist.get_rank(), world=world, backend=str(dist.get_backend()))


def env_world() -> tuple[int, int, int]:
    """``(rank, world size, local world size)`` from torchrun's environment (``(0, 1, 1)`` without)."""
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_WORLD_SIZE", None)):
        raw = os.environ.get(name) or default or str(values["WORLD_SIZE"])
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it)") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_WORLD_SIZE"]
    if world > 1 and not os.environ.get("RANK"):  # rank 0 by default: every such process claimed rank 0
        raise ValueError(
            f"environment variable WORLD_SIZE={world} without RANK: expected both (torchrun sets them; left over "
            "from another job? unset WORLD_SIZE and LOCAL_WORLD_SIZE to run alone)"
        )
    if world < 1 or not 0 <= rank < world or not 1 <= local <= world:
        raise ValueError(
            f"environment variables RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}: expected "
            "0 <= RANK < WORLD_SIZE and 1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE (left over from another job? unset them "
            "to run alone)"
        )
    return rank, world, local


_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
RENDEZVOUS_TIMEOUT_ENV = "KVBITS_RENDEZVOUS_TIMEOUT_S"
_RENDEZVOUS_TIMEOUT_S = 600.0


def rendezvous_timeout_s() -> float:
    """Seconds the ranks wait for each other to start (``$KVBITS_RENDEZVOUS_TIMEOUT_S``, default 600):
    short, unlike the collectives' 24 h, so that a ``WORLD_SIZE`` left over from another job fails
    instead of waiting a day for ranks that will never come."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if raw is None or raw == "":
        return _RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def _check_master_env(world: int) -> None:
    """``ValueError`` unless ``MASTER_ADDR`` is set and ``MASTER_PORT`` is a port number (1..65535): torch's
    ``env://`` said only "environment variable MASTER_ADDR expected, but not set", or for a port that is not a
    number, "invalid literal for int() with base 10: 'abc'"."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    problems = []
    if not addr:
        problems.append("MASTER_ADDR is not set")
    if not port:
        problems.append("MASTER_PORT is not set")
    elif not (port.strip().isdigit() and 1 <= int(port) <= 65535):
        problems.append(f"MASTER_PORT={port!r} is not a port number (1..65535)")
    if problems:
        raise ValueError(
            f"WORLD_SIZE={world}: {' and '.join(problems)}; expected the address and port of rank 0 (torchrun sets "
            "them). Left over from another job? Unset WORLD_SIZE, RANK, LOCAL_WORLD_SIZE to run alone"
        )


def _rendezvous(world: int) -> tuple[Any, int, int]:
    """torch's ``env://`` rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``;
    torchrun's agent store where torchrun set one), waiting at most :func:`rendezvous_timeout_s` for
    the other ranks. Returns ``(store, rank, world size)``."""
    import torch.distributed as dist

    timeout = rendezvous_timeout_s()
    _check_master_env(world)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    logger.info("waiting up to %.0f s for %d ranks at %s", timeout, world, where)
    try:
        return next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise RuntimeError(
            f"the {world} ranks of WORLD_SIZE={world} did not all join at {where} within {timeout:.0f} s "
            f"({type(exc).__name__}: {exc}). Left over from another job? Unset WORLD_SIZE, RANK, "
            f"LOCAL_WORLD_SIZE to run alone; under torchrun every rank must start (set "
            f"{RENDEZVOUS_TIMEOUT_ENV} to wait longer)"
        ) from exc


@contextmanager
def init_from_env(device: str | None) -> Iterator[bool]:
    """For ``kvbits eval`` under torchrun: with ``WORLD_SIZE`` > 1 and no process group yet,
    initialize one from the environment (``nccl`` for a CUDA ``device``, ``gloo`` otherwise),
    make ``cuda:$LOCAL_RANK`` current for NCCL, and destroy the group on the way out. Yields whether
    it created the group (False: alone, or the caller's group is used as it is)."""
    import torch.distributed as dist

    _, world, _ = env_world()
    if world <= 1 or not dist.is_available() or dist.is_initialized():
        yield False
        return
    cuda = str(device).startswith("cuda")
    with kept_cuda_device():  # cuda:$LOCAL_RANK current for the group's life only
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store, rank, world = _rendezvous(world)
        # once every rank is here, a rank may wait for another for about one window (hours for long
        # stream-mode windows on a CPU)
        store.set_timeout(_COLLECTIVE_TIMEOUT)
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=_COLLECTIVE_TIMEOUT
        )
        try:
            yield True
        finally:
            dist.destroy_process_group()
