"""Shared by every step of ``gpu_decode.py``: the shapes and schemes, the run's configuration, CUDA-event
timing, the copy ceiling and random packed stores in the kernel layout."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from kvbits.kernels.reference import PackedStore, PackedTensor
from kvbits.schemes.accounting import outlier_count

SHAPES = {  # KV shapes of the models (config.json: num_key_value_heads, num_attention_heads, head_dim)
    "qwen2.5-0.5b": {"H_kv": 2, "H_q": 14, "D": 64},
    "llama-3-8b": {"H_kv": 8, "H_q": 32, "D": 128},
}
# scheme -> (kind, bits, fraction of channels kept as sparse outliers), in the KIVI layout below
SCHEMES = {
    "int8": ("int", 8, 0.0),
    "int4": ("int", 4, 0.0),
    "int2": ("int", 2, 0.0),
    "nuq4-outl": ("nuq", 4, 0.01),  # KVQuant-style: 4-bit codebook + 1 % dense-and-sparse outliers
    "fp8-e4m3": ("fp8", 8, 0.0),  # vLLM-style FP8 (per-token scales here)
}


def fold_reads(scheme: tuple[str, int, float]) -> bool:
    """Whether the folded-scale kernel (``kvbits.kernels.triton_fold``) reads a ``SCHEMES`` entry's stores (post-RoPE):
    integer codes without outliers."""
    return scheme[0] == "int" and scheme[2] == 0


# the same integer layouts with pre-RoPE keys (KVQuant §3.2): RoPE applied in the kernel from float32 tables
PRE_ROPE = ("int8", "int4", "int2")
ROPE_SUFFIX = "-prerope"
class TokenScheme(NamedTuple):
    """A per-token layout of the ``int*-token*`` presets timed in step 3 (``TOKEN_SCHEMES``)."""

    codes: str  # the SCHEMES key of the codes
    rotate: str | None  # both sides hold codes of x @ R (PackedTensor.rotate), or None
    channels: str | None  # keys centred / smoothed per channel: "untied", "tied" (over RoPE pairs), or None
    pre_rope: bool  # keys stored before RoPE (the kernel applies it from the float32 tables)


# the per-token layout of the int*-token presets (keys and values: one scale per token and head over all D
# channels): plain; Hadamard-rotated (the *-token-hadamard presets, kvbits.quant.rotate: the codes of x @ R;
# the decode entry points rotate q and the tail into that basis and the output back, no byte added); keys
# centred and smoothed per channel after RoPE (*-token-smooth: q scaled by the factors, the tail moved into
# the codes' basis) and before it (*-token-smooth-prerope: the kernel decodes code * factor + mean in
# registers, then applies RoPE; -tied: factors equal over RoPE pairs, folded into q, the kernel adding
# mean / factor only). Stand-in channel vectors (``channel_vectors``); the layer's vectors are not K/V bytes
# read per token. Step 3 times them at ROTATION_BATCH only: beside int4-token they show what each costs
TOKEN_SCHEMES = {
    "int4-token": TokenScheme("int4", None, None, False),
    "int4-token-hadamard": TokenScheme("int4", "hadamard", None, False),
    "int4-token-smooth": TokenScheme("int4", None, "untied", False),
    "int4-token-smooth-prerope": TokenScheme("int4", None, "untied", True),
    "int4-token-smooth-prerope-tied": TokenScheme("int4", None, "tied", True),
}
ROTATION_BATCH = 8
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # step 3's sweep (the issue's contexts and batches)
BATCHES = (1, 8, 32)
KEY_GROUP = 32  # KIVI: keys per-channel over groups of 32 tokens
VALUE_GROUP = 32  # KIVI: values per-token over groups of 32 channels
RESIDUAL = 128  # KIVI: the most recent 128 tokens stay in fp16


@dataclass
class Config:
    device: torch.device
    contexts: list[int]
    batches: list[int]
    reps: int
    warmup: int
    max_bytes: float
    smoke: bool
    kernel: str  # "triton" or "reference" for the quantized path
    deadline: float | None = None  # time.monotonic() after which no new sweep combo / e2e run starts


def rotation_batch(batches: list[int]) -> int | None:
    """The batch at which step 3 times ``TOKEN_SCHEMES``: ``ROTATION_BATCH``, or the largest of a run without
    it (smoke: its one batch)."""
    return ROTATION_BATCH if ROTATION_BATCH in batches else max(batches, default=None)


def out_of_time(cfg: Config) -> bool:
    return cfg.deadline is not None and time.monotonic() > cfg.deadline


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object],
    cfg: Config,
    flush: torch.Tensor | None,
    *,
    graph: bool = True,
    spread: dict | None = None,
) -> tuple[float, bool]:
    """Median milliseconds of ``fn()`` (CUDA graph replay when possible) and whether a graph was used;
    ``spread`` (a dict) receives the reps' 10th and 90th percentiles (``ms_p10``, ``ms_p90``): a
    difference between two variants inside that band is noise.

    The L2 cache is flushed (a large ``zero_``) before every rep, outside the timed region, so K/V
    come from HBM as they would in a real decode step. On CUDA everything runs with ``cfg.device`` current
    (``torch.cuda.device``; a no-op for ``cuda`` without an index) and its streams, events and graph capture
    are that device's: Triton launches ``fn``'s kernels on the current device's stream, and
    ``torch.cuda.graph``'s default capture stream is made once, on whichever device was current then.
    """
    if cfg.device.type != "cuda":
        return _time_ms(fn, cfg, flush, graph=graph, spread=spread)
    with torch.cuda.device(cfg.device):
        return _time_ms(fn, cfg, flush, graph=graph, spread=spread)


def _time_ms(
    fn: Callable[[], object], cfg: Config, flush: torch.Tensor | None, *, graph: bool, spread: dict | None
) -> tuple[float, bool]:
    """``time_ms``'s body, on CUDA with ``cfg.device`` current."""
    dev = cfg.device
    for _ in range(cfg.warmup):
        fn()
    sync(dev)
    run, used_graph = fn, False
    if dev.type == "cuda" and graph:
        try:
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):  # not graph's class-wide default stream (another device's)
                fn()
            run, used_graph = g.replay, True
        except Exception as exc:  # noqa: BLE001 - capture is an optimisation; eager timing is still honest
            print(f"  (CUDA graph capture failed: {type(exc).__name__}; timing eagerly)", file=sys.stderr)
            torch.cuda.synchronize(dev)
    times = []
    for _ in range(cfg.reps):
        if flush is not None:
            flush.zero_()
        if dev.type == "cuda":
            stream = torch.cuda.current_stream(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    if spread is not None:
        deciles = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
        spread.update(ms_p10=round(deciles[0], 5), ms_p90=round(deciles[-1], 5))
    return statistics.median(times), used_graph


def poison_free_memory(device: torch.device) -> None:
    """Make the memory the CUDA caching allocator hands out next hold NaN (no-op off CUDA).

    Cached blocks go back to the driver, then fresh ones of both of the allocator's pools (blocks up to
    1 MiB and larger) are filled with NaN and freed: the next allocations, the outputs and partials a
    kernel under test writes, come from them, so an element it leaves unwritten reads NaN (or, for
    integer outputs, bytes no code equals) and fails the check instead of passing on a stale value.
    """
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    blocks = [torch.full((n // 4,), float("nan"), device=device) for n in [1 << 19] * 8 + [1 << 25] * 2]
    del blocks


def copy_bandwidth(cfg: Config) -> float:
    """GB/s of a device-to-device copy, counting bytes read + bytes written."""
    n = (16 << 20) if cfg.smoke else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=cfg.device).random_()
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), cfg, None, graph=False)
    return 2 * n / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def random_packed(
    B: int,
    H: int,
    T: int,
    D: int,
    scheme: tuple[str, int, float],
    tps: int,
    cps: int,
    device: torch.device,
    gen: torch.Generator,
    lazy: bool = False,
    rotate: str | None = None,
) -> PackedTensor:
    """Random codes and metadata in the kernel layout (timing only: content does not change the work).

    ``scheme`` is a ``SCHEMES`` value; fp8 codes keep one scale per token row (``cps = D``, no zero).
    ``lazy``: every tensor a zero-stride view of one element (shapes, dtypes and alignment only: what
    compiling a launch needs, ``prewarm.py``; nothing to read). ``rotate``: the codes say they hold
    ``x @ R`` (``PackedTensor.rotate``; no byte more).
    """
    kind, bits, outlier_frac = scheme
    if kind == "fp8":
        tps, cps = 1, D
    row, meta = (B, H, T, D * bits // 8), (B, H, T // tps, D // cps)
    k = outlier_count(D, outlier_frac)
    index_dtype = torch.uint8 if D <= 256 else torch.int16
    extra: dict = {"kind": kind, "fmt": "e4m3" if kind == "fp8" else None, "rotate": rotate}
    if kind == "nuq":
        u = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
        extra["codebook"] = (u.abs() ** 1.5 * u.sign()).half().to(device)
    if lazy:
        codes, scale = lazy_view(row, torch.uint8, device), lazy_view(meta, torch.float16, device)
        zero = None if kind == "fp8" else lazy_view(meta, torch.float16, device)
        if k:
            extra["outlier_values"] = lazy_view((B, H, T, k), torch.float16, device)
            extra["outlier_index"] = lazy_view((B, H, T, k), index_dtype, device)
        return PackedTensor(codes, scale, zero, bits, tps, cps, D, **extra)
    codes = torch.randint(0, 120, row, dtype=torch.uint8, device=device, generator=gen)
    scale = (torch.rand(meta, device=device, generator=gen) * 0.05 + 0.01).half()
    zero = None if kind == "fp8" else torch.randn(meta, device=device, generator=gen).half()
    if k:
        extra["outlier_values"] = torch.randn(B, H, T, k, device=device, generator=gen).half()
        idx = torch.rand(B, H, T, D, device=device, generator=gen).topk(k, dim=-1).indices
        extra["outlier_index"] = idx.to(index_dtype)
    return PackedTensor(codes, scale, zero, bits, tps, cps, D, **extra)


def lazy_view(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-stride ``shape`` view of one zero element (see ``random_packed(lazy=True)``)."""
    return torch.zeros(1, dtype=dtype, device=device).expand(*shape)


def random_store(
    B: int, shape: dict, context: int, scheme: tuple[str, int, float] | None, device: torch.device,
    gen: torch.Generator, rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None, lazy: bool = False,
    layout: str = "kivi", rotate: str | None = None, channels: str | None = None,
) -> PackedStore:  # fmt: skip
    """A KIVI-layout store of ``context`` tokens (``scheme=None``: everything in the fp16 tail);
    ``rope_tables`` (``(cos, sin)``, ``(>= context, D or D / 2)`` float32): the quantized keys are pre-RoPE.
    ``lazy``: zero-stride views only (``random_packed``). ``layout="token"``: keys per token like the values,
    one scale per token and head over all ``D`` channels (``TOKEN_SCHEMES``), the same fp16 tail; ``rotate``:
    both quantized sides hold rotated codes (``PackedTensor.rotate``); ``channels`` (``"untied"`` /
    ``"tied"``): the quantized keys are centred and smoothed per channel (``channel_vectors``, real tensors
    even when ``lazy``: whether the factors are tied decides the kernel's path)."""
    if layout not in ("kivi", "token"):
        raise ValueError(f"layout must be 'kivi' or 'token', got {layout!r}")
    H, D = shape["H_kv"], shape["D"]
    T_f = context if scheme is None else min(context, RESIDUAL + (context - RESIDUAL) % KEY_GROUP)
    T_q = context - T_f
    if lazy:
        kf = vf = lazy_view((B, H, T_f, D), torch.float16, device)
    else:
        kf = torch.randn(B, H, T_f, D, device=device, generator=gen, dtype=torch.float16)
        vf = torch.randn(B, H, T_f, D, device=device, generator=gen, dtype=torch.float16)
    key = value = None
    if T_q:
        key_tps, key_cps, value_cps = (1, D, D) if layout == "token" else (KEY_GROUP, 1, VALUE_GROUP)
        key = random_packed(B, H, T_q, D, scheme, key_tps, key_cps, device, gen, lazy, rotate)
        value = random_packed(B, H, T_q, D, scheme, 1, value_cps, device, gen, lazy, rotate)
        if channels is not None:
            key = replace(key, **channel_vectors(H, D, channels, device))
    lens = lambda n: torch.full((B,), n, dtype=torch.int32, device=device)
    if rope_tables is None or key is None:
        return PackedStore(key, value, kf, vf, lens(T_q), lens(T_f), uniform_lens=True)
    return PackedStore(key, value, kf, vf, lens(T_q), lens(T_f), *rope_tables, lens(0), uniform_lens=True)


def channel_vectors(H: int, D: int, tie: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Stand-in ``channel_mean`` / ``channel_factor`` of centred and smoothed keys, float16 ``(H, D)``: factors
    in [0.5, 2] distinct per channel (``tie="untied"``, as ``kvbits calibrate`` fits them by default) or equal
    at channels ``d`` and ``d + D/2`` (``"tied"``, ``--tie-rope-pairs``); means ``factor - 1``."""
    if tie not in ("untied", "tied"):
        raise ValueError(f"channels must be 'untied' or 'tied', got {tie!r}")
    factor = torch.linspace(0.5, 2.0, H * D, dtype=torch.float32).reshape(H, D)
    if tie == "tied":
        factor[:, D // 2 :] = factor[:, : D // 2]
    return {"channel_mean": (factor - 1).half().to(device), "channel_factor": factor.half().to(device)}


def install_stand_ins(cache: Any, n_layers: int, H_kv: int, D: int) -> None:
    """What a calibration artifact would install in ``cache`` (a ``QuantizedKVCache``), with values that do not
    change the work: NUQ codebooks (uniform), static ranges (integer: scale 4, zero-point -2 per channel; FP8:
    one scale of 1), channel means and smoothing factors (``channel_vectors``, untied: one factor per channel,
    as ``kvbits calibrate`` fits them by default), in each of ``n_layers`` layers of ``H_kv`` heads of ``D``."""
    from kvbits.quant.nuq import uniform_codebook

    vectors = channel_vectors(H_kv, D, "untied", torch.device("cpu"))
    for side in ("key", "value"):
        spec = getattr(cache.scheme, side)
        scale = zero = None
        if spec.static and spec.kind == "fp8":  # one scale per tensor
            scale = torch.ones(())
        elif spec.static:
            scale, zero = torch.full((H_kv, D), 4.0).half(), torch.full((H_kv, D), -2.0).half()
        codebook = uniform_codebook(spec.bits) if spec.kind == "nuq" else None
        mean = vectors["channel_mean"] if spec.centre else None
        factor = vectors["channel_factor"] if spec.smooth is not None else None
        if scale is None and codebook is None and mean is None and factor is None:
            continue
        for i in range(n_layers):
            cache.set_static_qparams(i, side, scale, zero, codebook=codebook, mean=mean, factor=factor)


def rope_tables(positions: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables as the cache keeps them: the repeated first half, ``(positions, D / 2)``
    float32 (theta 1e6, as Qwen2.5 / long-context Llamas)."""
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    f = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv
    return f.cos().float(), f.sin().float()


def launch_error(exc: Exception) -> str:
    """One line for a launch that did not start (e.g. Triton's ``OutOfResources``: too much shared memory)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def guarded(step: str, fn: Callable[[], Any], failures: list[dict]) -> Any:
    """``fn()``, or ``None`` with ``{"step", "error"}`` appended to ``failures`` and printed when it raises: one
    step's failure (a kernel no GPU has run yet) must not cost the device call the steps after it."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded with its type and message, the run goes on
        failures.append({"step": step, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(f"  {step} FAILED: {type(exc).__name__}: {exc}")
        return None

