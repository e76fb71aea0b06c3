"""Choose the fused decode launch by timing candidates on the device it runs on (opt-in: ``KVBITS_AUTOTUNE=on``).

Why: the H200's step 3b (BENCHMARKS.md §6z, int4 in the KIVI layout at 32K, batch 8) timed 113 launches of the
decode kernel. The fastest was 1.40x faster than the default launch at Llama-3-8B's shape (``dequant="f16"``,
64-token tiles, 2 warps, 3 stages: 0.369 against 0.517 ms) and 1.46x at Qwen2.5's (``"f16"``, 128-token tiles,
4 warps, 3 stages: 0.0589 against 0.0861 ms), and the worst launches were 2-4x slower than the default: which launch
wins depends on the shape and the device, and no one default is best. This module does what ``triton.autotune`` and
vLLM's per-device kernel configs do for that: the first decode step of each *launch key* (``tune_key``: device,
Triton and kernel versions, query dtype, batch bucket, heads, head dim, context bucket, both sides' layout, and
the store's kernel variant: RoPE tables, slot masks, tail dtype, device-side lengths, word reads) runs
every candidate launch (``CANDIDATES``) on that step's own inputs, and later steps of that key take the fastest.

Nothing silently wrong: each candidate's output is compared with the default launch's on the same inputs; one that
differs by more than ``TOLERANCE_ULPS`` units in the last place of the output's dtype (at the largest output
magnitude), or gives a non-finite value where the default does not, is rejected and logged (the H200's
``dequant="f16"`` at head dim 16 was off by 2.77, §6z; launches that only change the splits or the dequantization
rounding differed from the default by at most one float16 ulp there). A candidate that fails to launch is
rejected too. A candidate must beat the default by ``MARGIN`` to be chosen, so timing noise keeps the default.

Choices persist in ``$KVBITS_CACHE/tuning/decode.json`` (default ``~/.cache/kvbits``; ``KVBITS_AUTOTUNE_FILE``
overrides), keyed by ``tune_key`` (which includes a hash of the kernels' source, so another kvbits' kernels never
reuse them) and, for a tuner of other candidates than ``CANDIDATES`` (an explicit ``KVBITS_DEQUANT`` limits them),
a hash of its candidates (``DecodeTuner.key``: a choice among some launches is not one among others); a corrupt or
foreign file is logged and replaced. While a CUDA graph is being captured, or under
``torch.compile``, nothing is timed: a key already tuned takes its choice, others the default launch.

The inputs tuned on are one decode step's, so a launch could still be wrong only on other data (another padding
pattern, a length at a split boundary). ``DecodeTuner.attend`` (what ``dispatch.decode_attention`` calls) therefore
keeps checking a chosen launch that is not the default: on the 1st, 2nd, 4th, 8th, ... call of each key in this
process (``verify_due``; the 1st only where the choice came from the file, not from tuning on that very call) it runs
the default launch too and compares. A launch that differs, or fails, is revoked: that call returns the default
launch's output, the key serves the default launch from then on, and the file records why. Calls between two checks
are not compared, so a launch wrong on rare inputs can serve a few of them before a check finds it: the checks cost
one extra launch and one device sync each, about ``log2(calls)`` per key. The candidates are launches the test suite
checks through Triton's interpreter, and ``benchmarks/device_run.sh``'s CUDA tests check them compiled.

Timing runs the kernel ``ROUNDS`` x ``INNER`` times per candidate (without flushing the L2 cache), a few milliseconds
at 32K context on an H200 plus each candidate's one-time compile.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbits._files import write_text_atomic
from kvbits._json import dumps, loads
from kvbits.kernels.reference import PackedStore, PackedTensor

logger = logging.getLogger(__name__)

__all__ = [
    "AUTOTUNE_ENV",
    "CANDIDATES",
    "Candidate",
    "DecodeTuner",
    "Tuning",
    "attend",
    "autotune_mode",
    "candidates_tag",
    "chosen_launches",
    "default_tuner",
    "launch_counts",
    "tune_key",
    "verify_due",
]

AUTOTUNE_ENV = "KVBITS_AUTOTUNE"
FILE_ENV = "KVBITS_AUTOTUNE_FILE"
MODES = ("off", "on")  # KVBITS_AUTOTUNE; the default first
FORMAT = 1
TOLERANCE_ULPS = 8  # a candidate may differ from the default launch by this many ulps of max |output|
MARGIN = 0.03  # a candidate must be this much faster than the default launch to be chosen
ROUNDS, INNER = 7, 3  # timing: ROUNDS rounds (candidates interleaved), INNER back-to-back calls per timing
MIN_CONTEXT_BUCKET = 1024


@dataclass(frozen=True)
class Candidate:
    """One launch of ``decode_attention_triton``.

    Attributes:
        name: what logs and the tuning file call it.
        dequant: ``"f32"``, ``"f16"`` or ``"fold"`` (stores a mode cannot read fall back inside the kernel's entry
            point, so a candidate may time the same code as another).
        tile: tokens per tile as a multiple of the default launch's (``None``: the default).
        num_warps, num_stages: as ``decode_attention_triton`` takes them (``None``: its defaults).
        programs_per_sm: split count aimed at this many programs per SM (``None``: the default, 2).
    """

    name: str
    dequant: str = "f32"
    tile: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    programs_per_sm: int | None = None

    def kwargs(self, head_dim: int, sms: int) -> dict[str, Any]:
        """The keyword arguments of ``decode_attention_triton`` for this launch at head dim ``head_dim`` on a
        device with ``sms`` multiprocessors (1 off CUDA)."""
        kw: dict[str, Any] = {"dequant": self.dequant}
        if self.tile is not None:
            from kvbits.kernels.triton_decode import whole_row_block_t

            kw["block_t"] = min(128, whole_row_block_t(head_dim) * self.tile)
        if self.num_warps is not None:
            kw["num_warps"] = self.num_warps
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        if self.programs_per_sm is not None:
            kw["target_programs"] = self.programs_per_sm * sms
        return kw


# the default launch first; the others from the H200's step 3b (BENCHMARKS.md §6z): its fastest launches at each
# shape, the default with more stages or more programs, and the folded-scale kernel (not yet timed on a GPU). Step
# 3b timed more programs per SM with the default launch only (1.13x and 1.35x faster); the "-p8" candidates try
# them with the fastest launches and the folded kernel, untimed so far
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("default"),
    Candidate("stages3", num_stages=3),
    Candidate("programs8", programs_per_sm=8),
    Candidate("f16", dequant="f16"),
    Candidate("f16-w2-s3", dequant="f16", num_warps=2, num_stages=3),
    Candidate("f16-tile2-s3", dequant="f16", tile=2, num_stages=3),
    Candidate("f16-tile2-w2-s3", dequant="f16", tile=2, num_warps=2, num_stages=3),
    Candidate("fold", dequant="fold"),
    Candidate("f16-tile2-s3-p8", dequant="f16", tile=2, num_stages=3, programs_per_sm=8),
    Candidate("f16-tile2-w2-s3-p8", dequant="f16", tile=2, num_warps=2, num_stages=3, programs_per_sm=8),
    Candidate("fold-p8", dequant="fold", programs_per_sm=8),
)
_BUILTIN = CANDIDATES  # what ``DecodeTuner.key`` leaves untagged (``CANDIDATES`` may be replaced, as tests do)


def candidates_tag(candidates: tuple[Candidate, ...]) -> str:
    """``""`` for the built-in ``CANDIDATES``, else ``cands-`` and 8 hex chars of a hash of ``candidates`` (in order:
    the first is the default launch)."""
    if candidates == _BUILTIN:
        return ""
    return "cands-" + hashlib.sha256(repr(candidates).encode()).hexdigest()[:8]


def autotune_mode() -> str:
    """``KVBITS_AUTOTUNE``: ``off`` (the default) or ``on``; ``ValueError`` for anything else."""
    raw = os.environ.get(AUTOTUNE_ENV, "").strip().lower() or MODES[0]
    mode = {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(raw, raw)
    if mode not in MODES:
        raise ValueError(f"{AUTOTUNE_ENV} must be one of {MODES} (or 1/0), got {raw!r}")
    return mode


@functools.cache
def _kernel_hash() -> str:
    """12 hex chars of the sha256 of the decode kernels' sources: a tuning made for other kernels is not reused."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("triton_decode.py", "triton_fold.py", "autotune.py"):
        path = here / name
        h.update(path.read_bytes() if path.exists() else name.encode())
    return h.hexdigest()[:12]


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} sm_{props.major}{props.minor} {props.multi_processor_count}sm"
    from kvbits.kernels.interpret import interpreting

    return f"{device.type}{'-interpreter' if interpreting() else ''}"


def _side(p: PackedTensor | None) -> str:
    if p is None:
        return "none"
    meta = "" if p.scale is None else str(p.scale.dtype).removeprefix("torch.")
    parts = [f"{p.kind}{p.bits}{p.fmt or ''}", f"t{p.tps}", f"c{p.cps}", f"o{p.n_outliers}", meta,
             "z" if p.zero is not None else "sym", p.rotate or "", "m" if p.channel_mean is not None else "",
             "f" if p.channel_factor is not None else ""]  # fmt: skip
    return "-".join(x for x in parts if x)


def _bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above ``max(n, floor)``."""
    return 1 << max(0, math.ceil(math.log2(max(n, floor, 1))))


def context_slots(store: PackedStore) -> int:
    """Quantized slots the kernel walks plus full-precision slots (the tail, sinks)."""
    full = store.key_full if store.key_full is not None else store.value_full
    return store.quant_slots_used + (int(full.shape[2]) if full is not None else 0)


def tune_key(q: torch.Tensor, store: PackedStore) -> str:
    """The launch key of one decode call ``q (B, H_q, 1, D)`` over ``store``: calls with the same key take the
    same launch. Batch and context are bucketed to powers of two (context from ``MIN_CONTEXT_BUCKET``). What the
    store makes the kernel specialise on is in it too (a launch was checked and timed on one such kernel): the RoPE
    tables' width (``D`` or ``D / 2``), either slot mask, the tail's dtype, and per-sequence lengths read from
    the device (``uniform_lens`` false: a static cache's graph-replayed steps, which no check ever compares), and how
    each side's float16 metadata is read as int32 words (``_words_ok``: 2 for one value per token over an odd slot
    count, which a growing per-token cache alternates with 1 step by step: another kernel variant)."""
    import triton

    from kvbits.kernels.triton_decode import _words_ok

    B, H_q, _, D = q.shape
    tail = store.key_full if store.key_full is not None else store.value_full
    parts = [
        _device_name(q.device), f"triton{triton.__version__}", f"kernels-{_kernel_hash()}",
        str(q.dtype).removeprefix("torch."), f"B{_bucket(B)}", f"Hq{H_q}", f"Hkv{store.n_kv_heads}", f"D{D}",
        f"T{_bucket(context_slots(store), MIN_CONTEXT_BUCKET)}", f"K:{_side(store.key)}", f"V:{_side(store.value)}",
        f"prerope{store.rope_cos.shape[1]}" if store.pre_rope else "",
        "padded" if store.quant_mask is not None else "", "tailmask" if store.full_mask is not None else "",
        "" if tail is None or tail.dtype == q.dtype else f"tail-{str(tail.dtype).removeprefix('torch.')}",
        "" if store.uniform_lens else "ragged", f"w{_words_ok(store.key)}{_words_ok(store.value)}",
    ]  # fmt: skip
    return "|".join(x for x in parts if x)


@dataclass
class Tuning:
    """What tuning one key found.

    Attributes:
        launch: the chosen candidate's name.
        ms: median milliseconds per call of each candidate that ran and matched the default.
        rejected: candidate name → why it was rejected (failed to launch, output off the default's).
    """

    launch: str
    ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"launch": self.launch, "ms": self.ms, "rejected": self.rejected}

    @classmethod
    def from_json(cls, d: Any) -> Tuning:
        if not isinstance(d, dict) or not isinstance(d.get("launch"), str):
            raise TypeError(f"a tuning entry must be an object with a string 'launch', got {d!r:.80}")
        ms, rejected = d.get("ms", {}), d.get("rejected", {})
        if not isinstance(ms, dict) or not isinstance(rejected, dict):
            raise TypeError("a tuning entry's 'ms' and 'rejected' must be objects")
        return cls(d["launch"], {str(k): float(v) for k, v in ms.items()}, {str(k): str(v) for k, v in rejected.items()})


def read_tunings(path: Path, quiet: bool = False) -> dict[str, Tuning]:
    """The tunings of a tuning file, by key: ``{}`` for a missing file, and (logged unless ``quiet``) for a corrupt
    one or one of another format."""
    if not path.exists():
        return {}
    try:
        raw = loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("keys"), dict):
            raise ValueError(f"expected {{'format': {FORMAT}, 'keys': {{...}}}}")
        return {str(k): Tuning.from_json(v) for k, v in raw["keys"].items()}
    except (OSError, ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError is a ValueError; RecursionError:
        # JSON nested deeper than the parser's recursion limit (a damaged file, not a reason to stop the run)
        if not quiet:
            logger.warning("ignoring the decode tuning file %s (%s); it will be rewritten", path, exc)
        return {}


Runner = Callable[..., torch.Tensor]  # (q, store, scale, **launch kwargs) -> (B, H_q, 1, D)
Timer = Callable[[Callable[[], Any]], float]  # seconds per call of a thunk


def _timer_for(device: torch.device) -> Timer:
    """Seconds per call: CUDA events around ``INNER`` calls on CUDA, ``time.perf_counter`` elsewhere."""
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(INNER):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / INNER

        return cuda_time

    def wall_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        for _ in range(INNER):
            fn()
        return (time.perf_counter() - t0) / INNER

    return wall_time


def _no_timing_now() -> bool:
    """Inside a CUDA graph capture or a ``torch.compile`` trace: kernels must not be timed or synchronised."""
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    return bool(compiling) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` is not the default launch's ``ref`` up to ``TOLERANCE_ULPS`` ulps, or ``None``."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
    o, r = out.float(), ref.float()
    bad = ~torch.isfinite(o) & torch.isfinite(r)
    if bool(bad.any()):
        return f"{int(bad.sum())} non-finite outputs where the default launch's are finite"
    fin = torch.isfinite(r)
    if not bool(fin.any()):
        return None
    scale = float(r[fin].abs().max())
    tol = TOLERANCE_ULPS * torch.finfo(ref.dtype).eps * max(scale, torch.finfo(ref.dtype).tiny)
    diff = float((o[fin] - r[fin]).abs().max())
    return None if diff <= tol else f"differs from the default launch by {diff:.3g} (tolerance {tol:.3g})"


def _verdict(launch: Callable[[], torch.Tensor], ref: torch.Tensor) -> str | None:
    """Why a candidate launch must not serve (its output is not the default launch's ``ref``, or it fails to
    launch), or ``None``."""
    try:
        return _mismatch(launch(), ref)
    except Exception as exc:  # noqa: BLE001 - any launch failure rejects the candidate, logged by the caller
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"


def verify_due(call: int) -> bool:
    """Whether a key's ``call``-th served call (from 1) compares a tuned launch with the default launch: powers of
    two, so ``n`` calls make about ``log2(n) + 1`` checks."""
    return call >= 1 and call & (call - 1) == 0


class DecodeTuner:
    """Launch choices per ``tune_key``, timed on first use and kept in memory and (``path``) on disk.

    Args:
        path: the tuning file (``None``: memory only).
        candidates: the launches to time; the first is the default, kept unless another beats it by ``margin``.
        runner: the kernel, ``runner(q, store, scale, **kwargs)`` (default ``decode_attention_triton``).
        timer: seconds per call of a thunk (default: ``_timer_for`` the query's device).
        rounds: timings per candidate (interleaved), of which the median counts.
        margin: how much faster than the default a candidate must be to be chosen.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        candidates: tuple[Candidate, ...] = CANDIDATES,
        runner: Runner | None = None,
        timer: Timer | None = None,
        rounds: int = ROUNDS,
        margin: float = MARGIN,
    ) -> None:
        if not candidates:
            raise ValueError("DecodeTuner needs at least one candidate (the default launch first)")
        names = [c.name for c in candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names must be distinct, got {names}")
        self.path = path
        self.candidates = {c.name: c for c in candidates}
        self.default = candidates[0]
        self.tag = candidates_tag(tuple(candidates))
        self.runner = runner
        self.timer = timer
        self.rounds = max(1, int(rounds))
        self.margin = margin
        self.tunings: dict[str, Tuning] = read_tunings(path) if path is not None else {}
        self.served: dict[str, str] = {}  # key -> the launch it served in this process (``chosen_launches``)
        self.calls: Counter[str] = Counter()  # key -> calls ``attend`` served in this process (``verify_due``)

    # ----------------------------------------------------------------------------------------- the file

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            on_disk = read_tunings(self.path, quiet=True)
            on_disk.update(self.tunings)  # another process's keys kept, ours win
            # a temporary name of its own per call (two tuners of one process do not write one file), removed on failure
            write_text_atomic(self.path, dumps({"format": FORMAT, "keys": {k: t.to_json() for k, t in on_disk.items()}},
                                               indent=1, sort_keys=True))  # fmt: skip (strict JSON: kvbits._json)
        except OSError as exc:
            logger.warning("could not write the decode tuning file %s (%s); choices stay in memory", self.path, exc)

    # ------------------------------------------------------------------------------------------ tuning

    def key(self, q: torch.Tensor, store: PackedStore) -> str:
        """This tuner's key of a call: ``tune_key``, tagged with ``candidates_tag`` for a tuner of other candidates
        than ``CANDIDATES`` (so tuners of different candidates sharing a file never take each other's choices)."""
        key = tune_key(q, store)
        return f"{key}|{self.tag}" if self.tag else key

    def _run(self) -> Runner:
        if self.runner is None:
            from kvbits.kernels.triton_decode import decode_attention_triton

            self.runner = decode_attention_triton
        return self.runner

    def launch_kwargs(self, q: torch.Tensor, store: PackedStore, scale: float | None = None) -> dict[str, Any]:
        """The ``decode_attention_triton`` keyword arguments for this call: the tuned launch of its key, tuning
        it now (on these inputs) if the key is new and timing is allowed, else the default launch. Nothing is
        checked after the tuning here; ``attend`` runs the launch and keeps checking it."""
        return self.kwargs_for(self._choose(q, store, scale)[1], q)

    def attend(self, q: torch.Tensor, store: PackedStore, scale: float | None = None) -> torch.Tensor:
        """Decode attention ``q (B, H_q, 1, D)`` over ``store`` → ``(B, H_q, 1, D)`` through this call's launch
        (``launch_kwargs``). A chosen launch that is not the default is compared with the default launch on the
        calls ``verify_due`` names (not during a graph capture or a compile) and revoked if it differs or fails;
        that call then returns the default launch's output."""
        key, cand, tuned_now = self._choose(q, store, scale)
        run = self._run()
        call = 0
        if key is not None:
            self.calls[key] += 1
            call = self.calls[key]
        check = (
            cand is not self.default and verify_due(call) and not (tuned_now and call == 1) and not _no_timing_now()
        )
        if not check:
            return run(q, store, scale, **self.kwargs_for(cand, q))
        ref = run(q, store, scale, **self.kwargs_for(self.default, q))
        why = _verdict(lambda: run(q, store, scale, **self.kwargs_for(cand, q)), ref)
        if why is not None:
            self._revoke(key, cand.name, f"on call {call} of this key: {why}")
        return ref

    def _choose(self, q: torch.Tensor, store: PackedStore, scale: float | None
                ) -> tuple[str | None, Candidate, bool]:  # fmt: skip
        """``(key, candidate, tuned on this call)`` for this call (``key`` ``None``: a lone default candidate)."""
        if len(self.candidates) == 1:
            return None, self.default, False
        key = self.key(q, store)
        tuning, tuned_now = self.tunings.get(key), False
        if tuning is None:
            if _no_timing_now():
                logger.debug("decode launch %s not tuned (graph capture or compile): the default launch", key)
                return key, self.default, False
            tuning, tuned_now = self.tune(q, store, scale, key=key), True
        cand = self.candidates.get(tuning.launch)
        if cand is None:  # a file written with other candidates
            logger.info("tuned launch %r of %s is not a candidate here: the default launch", tuning.launch, key)
            cand = self.default
        self.served[key] = cand.name
        return key, cand, tuned_now

    def _revoke(self, key: str, name: str, why: str) -> None:
        """Stop serving launch ``name`` for ``key``: the default launch from now on, recorded (and saved) as why."""
        tuning = self.tunings[key]
        tuning.rejected[name] = why
        tuning.launch = self.default.name
        self.served[key] = self.default.name
        logger.warning("decode launch %r revoked for %s (%s); the default launch from now on", name, key, why)
        self._save()

    def kwargs_for(self, cand: Candidate, q: torch.Tensor) -> dict[str, Any]:
        """``cand``'s keyword arguments for queries ``q (B, H_q, 1, D)`` on their device."""
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        return cand.kwargs(q.shape[-1], sms)

    def tune(self, q: torch.Tensor, store: PackedStore, scale: float | None = None, *, key: str | None = None
             ) -> Tuning:  # fmt: skip
        """Time every candidate on these inputs (each checked against the default launch's output first), record
        and persist the choice of ``key`` (default ``self.key(q, store)``), and return it.

        Raises whatever the default launch raises: it is what runs without tuning, so its failure is not a
        tuning matter."""
        key = key or self.key(q, store)
        run, timer = self._run(), self.timer or _timer_for(q.device)
        thunks: dict[str, Callable[[], torch.Tensor]] = {}
        rejected: dict[str, str] = {}
        ref = run(q, store, scale, **self.kwargs_for(self.default, q))
        for name, cand in self.candidates.items():
            kw = self.kwargs_for(cand, q)

            def thunk(kw: dict[str, Any] = kw) -> torch.Tensor:
                return run(q, store, scale, **kw)

            if cand is not self.default:
                why = _verdict(thunk, ref)
                if why is not None:
                    rejected[name] = why
                    logger.warning("decode launch %r rejected for %s: %s", name, key, why)
                    continue
            thunks[name] = thunk
        times: dict[str, list[float]] = {name: [] for name in thunks}
        for _ in range(self.rounds):
            for name, thunk in thunks.items():
                times[name].append(timer(thunk))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        best = min(ms, key=ms.__getitem__)
        launch = best if ms[best] < ms[self.default.name] * (1 - self.margin) else self.default.name
        tuning = Tuning(launch, ms, rejected)
        self.tunings[key] = tuning
        logger.info("decode launch for %s: %s (%.4g ms; default %.4g ms, %.2fx)%s", key, launch, ms[launch],
                    ms[self.default.name], ms[self.default.name] / ms[launch],
                    f"; rejected {sorted(rejected)}" if rejected else "")  # fmt: skip
        self._save()
        return tuning


def default_path() -> Path:
    """``KVBITS_AUTOTUNE_FILE``, else ``$KVBITS_CACHE/tuning/decode.json`` (default cache ``~/.cache/kvbits``)."""
    env = os.environ.get(FILE_ENV)
    if env:
        return Path(env).expanduser()
    from kvbits.evaluate.models.registry import cache_dir

    return cache_dir() / "tuning" / "decode.json"


_TUNERS: dict[tuple[Path, str | None], DecodeTuner] = {}


def default_tuner(dequant: str | None = None) -> DecodeTuner:
    """The process's tuner for ``default_path()``: all of ``CANDIDATES``, or (``dequant``, an explicit
    ``KVBITS_DEQUANT``) only those of that dequantization, led by the plain launch of it."""
    path = default_path()
    tuner = _TUNERS.get((path, dequant))
    if tuner is None:
        cands = CANDIDATES
        if dequant is not None:
            same = tuple(c for c in CANDIDATES[1:] if c.dequant == dequant and c.name != dequant)
            cands = (Candidate(dequant, dequant=dequant), *same)
        tuner = _TUNERS[(path, dequant)] = DecodeTuner(path, candidates=cands)
    return tuner


def launch_counts() -> Counter[str]:
    """Launch key → calls ``attend`` served, over this process's tuners: what ``chosen_launches(since=...)``
    compares with."""
    total: Counter[str] = Counter()
    for tuner in _TUNERS.values():
        total.update(tuner.calls)
    return total


def chosen_launches(since: Counter[str] | None = None) -> dict[str, str]:
    """Launch key → the candidate that served it (as it stands now: ``default`` after a revocation), over this
    process's tuners (keys served untuned during a graph capture are not listed). ``since``: a ``launch_counts()``
    taken before a run: only the keys ``attend`` served after it."""
    served = {k: v for tuner in _TUNERS.values() for k, v in tuner.served.items()}
    if since is None:
        return served
    now = launch_counts()
    return {k: v for k, v in served.items() if now[k] > since[k]}


def _process_tuner() -> DecodeTuner:
    """``default_tuner`` for the environment: an explicitly set ``KVBITS_DEQUANT`` limits the candidates to it."""
    from kvbits.kernels.dispatch import DEQUANT_ENV, dequant_mode

    explicit = dequant_mode() if os.environ.get(DEQUANT_ENV, "").strip() else None
    return default_tuner(explicit)


def attend(q: torch.Tensor, store: PackedStore, scale: float | None = None) -> torch.Tensor:
    """Decode attention under ``KVBITS_AUTOTUNE=on`` (``dispatch.decode_attention``): the process tuner's launch,
    kept checked against the default launch (``DecodeTuner.attend``)."""
    return _process_tuner().attend(q, store, scale)
