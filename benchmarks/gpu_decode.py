"""Decode-attention speed on a GPU: the fused packed-cache Triton kernel vs fp16 SDPA.

    PYTHONPATH=src python benchmarks/gpu_decode.py   # H200, < 5 min -> benchmarks/results/gpu_decode.json
    PYTHONPATH=src python benchmarks/gpu_decode.py --smoke --device cpu   # seconds: interpreter + reference

Imports only torch, triton, transformers (5.17+, step 6 only, lazily) and kvbits (no installs on the
GPU machine). Steps:

0. (CUDA) the Triton kernels of steps 2-3b and 6 compiled on every CPU core at once (``prewarm.py``): the
   timed steps then load them from Triton's cache instead of compiling one by one inside the time budget.
1. device-to-device copy bandwidth (one large ``copy_``; CUDA events; median), counted as bytes read +
   bytes written: the practical ceiling of a memory-bound kernel (references.md, "Speed").
2. correctness of every kernel variant against a float64 reference on this GPU (flash-attention
   criterion: error <= 2x the error of plain torch at fp16); any failure aborts the run. (2b) the
   quantize-and-pack kernel against ``kvbits.quant.quantize``, bit for bit, and the time each takes to
   flush one 128-token block.
3. one decode step (``q (B, H_q, 1, D)``) for contexts 4K..128K and batch 1, 8, 32, with the KV shapes
   of Qwen2.5-0.5B (H_kv=2, H_q=14, D=64) and Llama-3-8B (H_kv=8, H_q=32, D=128):
   fp16 ``scaled_dot_product_attention`` (``enable_gqa=True``, and K/V expanded to H_q heads when that
   fits: the faster of the two is the baseline) vs the fused kernel at int8/int4/int2 (KIVI layout:
   keys per-channel in groups of 32 tokens, values per-token in groups of 32 channels, the last 128
   tokens in fp16), the same with pre-RoPE keys (``int8/int4/int2-prerope``: RoPE applied in the kernel
   from float32 half-width tables, as the cache keeps them; rows rotated in registers, and the gather
   path as ``triton-gather``), 4-bit NUQ with 1 % sparse outliers (KVQuant's codes) and FP8 e4m3 (per-token
   scales), each as a CUDA graph, L2 flushed before every rep, median of CUDA-event timings.
4. achieved bandwidth = bytes of K/V + metadata read / time, as a fraction of the copy bandwidth.
   (3b) with the time left before step 6's share: ``block_t`` x ``num_warps`` of the kernel for int4 and
   int4-prerope at 32K, batch 8 (``tuning``), to choose its defaults.
5. break-even context per scheme (shortest measured context from which the kernel beats fp16).
6. end to end: greedy decode tokens/s after a 32K-token prompt through a random-weight model shaped like
   Qwen2.5-0.5B (24 layers, H_kv=2, H_q=14, D=64; fp16): ``DynamicCache`` (SDPA) vs ``QuantizedKVCache``
   with the fused decode path (``use_fused_decode``: attention function ``kvbits_fused``; every decode
   step of every layer must be served by the kernel, else the run aborts) vs the same cache
   dequantizing into SDPA vs transformers' ``QuantizedCache`` (when one of its backends imports).
   ``QuantizedKVCache`` checks incoming K/V lazily on CUDA (``checks="auto"``, ``kvbits.cache.checks``):
   no host-device sync per decode step; the pending NaN/inf check (one sync for all layers) runs every
   64 steps and in ``memory_report()`` after the timed steps. The CPU smoke run checks eagerly.
   Memory: the bytes each cache holds on the GPU after its run (``torch.cuda.memory_allocated`` minus
   before it was made) against ``kvbits.plan`` for the same model, batch and tokens (``fused_decode=True``
   for the fused runs: pre-RoPE keys' float32 RoPE tables included, ``rope_table_bytes`` held), and what
   the cache holds beside its K/V that no plan counts (``extra_bytes``: position offsets, workspace).

Time: ``--budget-s`` (default 290 s: the issue's "one run of under 5 minutes", with room on a 15-minute device
lease for a second run): sweep combos stop starting 90 s before it (step 6's share), step 6's
runs at it; whatever did not run is listed under ``skipped`` / ``e2e[].skipped``. The JSON is rewritten
after every step and sweep combo (``"complete": false`` until the end), so a killed run keeps its figures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbits.kernels.reference import PackedStore, PackedTensor, decode_attention_reference, pack_store
from kvbits.quant import quantize
from kvbits.schemes import TensorSpec
from kvbits.schemes.accounting import outlier_count

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_decode.json"
FORMAT_VERSION = 1

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
# the same integer layouts with pre-RoPE keys (KVQuant §3.2): RoPE applied in the kernel from float32 tables
PRE_ROPE = ("int8", "int4", "int2")
ROPE_SUFFIX = "-prerope"
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # step 3's sweep (the issue's contexts and batches)
BATCHES = (1, 8, 32)
TUNE_BATCH, TUNE_CONTEXT = 8, 32768  # step 3b
KEY_GROUP = 32  # KIVI: keys per-channel over groups of 32 tokens
VALUE_GROUP = 32  # KIVI: values per-token over groups of 32 channels
RESIDUAL = 128  # KIVI: the most recent 128 tokens stay in fp16
# step 6: decode after a 32K-token prompt (the context), batches 1 and 8, 4 warm-up + 32 timed steps
E2E_CONTEXT, E2E_BATCHES, E2E_TOKENS, E2E_WARMUP = 32768, (1, 8), 32, 4


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


def _out_of_time(cfg: Config) -> bool:
    return cfg.deadline is not None and time.monotonic() > cfg.deadline


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
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
    come from HBM as they would in a real decode step.
    """
    for _ in range(cfg.warmup):
        fn()
    _sync(cfg.device)
    run, used_graph = fn, False
    if cfg.device.type == "cuda" and graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, used_graph = g.replay, True
        except Exception as exc:  # noqa: BLE001 - capture is an optimisation; eager timing is still honest
            print(f"  (CUDA graph capture failed: {type(exc).__name__}; timing eagerly)", file=sys.stderr)
            torch.cuda.synchronize()
    times = []
    for _ in range(cfg.reps):
        if flush is not None:
            flush.zero_()
        if cfg.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
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
) -> PackedTensor:
    """Random codes and metadata in the kernel layout (timing only: content does not change the work).

    ``scheme`` is a ``SCHEMES`` value; fp8 codes keep one scale per token row (``cps = D``, no zero).
    ``lazy``: every tensor a zero-stride view of one element (shapes, dtypes and alignment only: what
    compiling a launch needs, ``prewarm.py``; nothing to read).
    """
    kind, bits, outlier_frac = scheme
    if kind == "fp8":
        tps, cps = 1, D
    row, meta = (B, H, T, D * bits // 8), (B, H, T // tps, D // cps)
    k = outlier_count(D, outlier_frac)
    index_dtype = torch.uint8 if D <= 256 else torch.int16
    extra: dict = {"kind": kind, "fmt": "e4m3" if kind == "fp8" else None}
    if kind == "nuq":
        u = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
        extra["codebook"] = (u.abs() ** 1.5 * u.sign()).half().to(device)
    if lazy:
        codes, scale = _lazy(row, torch.uint8, device), _lazy(meta, torch.float16, device)
        zero = None if kind == "fp8" else _lazy(meta, torch.float16, device)
        if k:
            extra["outlier_values"] = _lazy((B, H, T, k), torch.float16, device)
            extra["outlier_index"] = _lazy((B, H, T, k), index_dtype, device)
        return PackedTensor(codes, scale, zero, bits, tps, cps, D, **extra)
    codes = torch.randint(0, 120, row, dtype=torch.uint8, device=device, generator=gen)
    scale = (torch.rand(meta, device=device, generator=gen) * 0.05 + 0.01).half()
    zero = None if kind == "fp8" else torch.randn(meta, device=device, generator=gen).half()
    if k:
        extra["outlier_values"] = torch.randn(B, H, T, k, device=device, generator=gen).half()
        idx = torch.rand(B, H, T, D, device=device, generator=gen).topk(k, dim=-1).indices
        extra["outlier_index"] = idx.to(index_dtype)
    return PackedTensor(codes, scale, zero, bits, tps, cps, D, **extra)


def _lazy(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-stride ``shape`` view of one zero element (see ``random_packed(lazy=True)``)."""
    return torch.zeros(1, dtype=dtype, device=device).expand(*shape)


def random_store(
    B: int, shape: dict, context: int, scheme: tuple[str, int, float] | None, device: torch.device,
    gen: torch.Generator, rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None, lazy: bool = False,
) -> PackedStore:  # fmt: skip
    """A KIVI-layout store of ``context`` tokens (``scheme=None``: everything in the fp16 tail);
    ``rope_tables`` (``(cos, sin)``, ``(>= context, D or D / 2)`` float32): the quantized keys are pre-RoPE.
    ``lazy``: zero-stride views only (``random_packed``)."""
    H, D = shape["H_kv"], shape["D"]
    T_f = context if scheme is None else min(context, RESIDUAL + (context - RESIDUAL) % KEY_GROUP)
    T_q = context - T_f
    if lazy:
        kf = vf = _lazy((B, H, T_f, D), torch.float16, device)
    else:
        kf = torch.randn(B, H, T_f, D, device=device, generator=gen, dtype=torch.float16)
        vf = torch.randn(B, H, T_f, D, device=device, generator=gen, dtype=torch.float16)
    key = value = None
    if T_q:
        key = random_packed(B, H, T_q, D, scheme, KEY_GROUP, 1, device, gen, lazy)
        value = random_packed(B, H, T_q, D, scheme, 1, VALUE_GROUP, device, gen, lazy)
    lens = lambda n: torch.full((B,), n, dtype=torch.int32, device=device)
    if rope_tables is None or key is None:
        return PackedStore(key, value, kf, vf, lens(T_q), lens(T_f))
    return PackedStore(key, value, kf, vf, lens(T_q), lens(T_f), *rope_tables, lens(0))


def rope_tables(positions: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables as the cache keeps them: the repeated first half, ``(positions, D / 2)``
    float32 (theta 1e6, as Qwen2.5 / long-context Llamas)."""
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    f = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv
    return f.cos().float(), f.sin().float()


# --------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------


def _spec(bits: int, gran: str, group: int | None, kind: str = "int", **kw) -> TensorSpec:
    fmt = "e4m3" if kind == "fp8" else None
    return TensorSpec(kind=kind, bits=bits, fmt=fmt, granularity=gran, group_size=group, **kw)


def _quantize(x: torch.Tensor, spec: TensorSpec) -> object:
    """``quantize`` with a non-uniform codebook for NUQ specs."""
    if spec.kind != "nuq":
        return quantize(x, spec)
    u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
    return quantize(x, spec, codebook=(u.abs() ** 1.5 * u.sign()).half().to(x.device))


def check_variants(cfg: Config, decode: Callable | None, shapes: list[str] | None = None) -> list[dict]:
    """Each kernel variant vs float64 on this device, at the KV shapes named (default all of ``SHAPES``);
    raises ``SystemExit`` on the first failure."""
    if decode is None:
        return []
    dev = cfg.device
    gen = torch.Generator().manual_seed(0)
    kivi = lambda b: {"key": _spec(b, "channel", 32), "value": _spec(b, "token", 32)}
    variants = [
        ("int8-kivi", kivi(8), {}),
        ("int4-kivi", kivi(4), {}),
        ("int2-kivi", kivi(2), {}),
        ("int4-kivi-gather", kivi(4), {"vectorized": False}),
        ("int2-token-keys", {"key": _spec(2, "token", None), "value": _spec(2, "token", None)}, {}),
        (
            "int3-symmetric",
            {"key": _spec(3, "token", 32, symmetric=True), "value": _spec(3, "token", 32)},
            {},
        ),
        ("int4-pre-rope", {**kivi(4), "rope": True}, {}),
        ("int4-pre-rope-gather", {**kivi(4), "rope": True}, {"vectorized": False}),
        ("fp16-tail-only", None, {}),
        (
            "kvquant4-block",  # pre-RoPE NUQ keys per channel, NUQ values per token, 1 % outliers
            {
                "key": _spec(4, "channel", 32, "nuq", outlier_frac=0.01),
                "value": _spec(4, "token", None, "nuq", outlier_frac=0.01),
                "rope": True,
            },
            {},
        ),
        ("fp8-e4m3", {"key": _spec(8, "token", None, "fp8"), "value": _spec(8, "token", None, "fp8")}, {}),
        ("int4-kivi-masked", {**kivi(4), "mask": True}, {}),  # left padding of a batch: slot masks
    ]
    shapes = {name: SHAPES[name] for name in (shapes or SHAPES)}
    if (
        cfg.smoke and dev.type == "cpu"
    ):  # the interpreter is slow: whole-row and gather + RoPE paths, one shape
        variants = [variants[1], variants[6], variants[8]]
        shapes = {"qwen2.5-0.5b": SHAPES["qwen2.5-0.5b"]}
    T_q, T_f = (64, 16) if cfg.smoke else (1024, 128)
    results = []
    for shape_name, shp in shapes.items():
        B, H, D, G = 3, shp["H_kv"], shp["D"], shp["H_q"] // shp["H_kv"]
        for name, specs, kw in variants:
            kq = torch.randn(B, H, T_q, D, generator=gen)
            kq[..., : D // 8] *= 6
            vq = torch.randn(B, H, T_q, D, generator=gen)
            kf = (torch.randn(B, H, T_f, D, generator=gen)).half().to(dev)
            vf = torch.randn(B, H, T_f, D, generator=gen).half().to(dev)
            ragged = {"full_lens": [T_f, T_f // 2, 1]}
            if specs is None:
                store = pack_store([], [], kf, vf, **ragged)
            else:
                rope = {}
                if specs.get("rope"):
                    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
                    f = torch.arange(T_q + T_f + 4, dtype=torch.float64)[:, None] * inv
                    emb = torch.cat([f, f], -1)
                    rope = {
                        "rope_cos": emb.cos().float().to(dev),
                        "rope_sin": emb.sin().float().to(dev),
                        "quant_pos0": [4] * B,
                    }
                masks = {}
                if specs.get("mask"):  # sequence 1 left-padded past its sinks; one more slot of sequence 0
                    qm, fm = torch.ones(B, T_q, dtype=torch.bool), torch.ones(B, T_f, dtype=torch.bool)
                    qm[1, : T_q // 8], fm[1, :4], qm[0, 3] = False, False, False
                    masks = {"quant_mask": qm.to(dev), "full_mask": fm.to(dev)}
                store = pack_store(
                    [_quantize(kq.to(dev), specs["key"])],
                    [_quantize(vq.to(dev), specs["value"])],
                    kf,
                    vf,
                    quant_lens=[T_q, T_q // 2, T_q // 4 * 3],
                    **ragged,
                    **rope,
                    **masks,
                )
            q = torch.randn(B, H * G, 1, D, generator=gen).to(dev)
            truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
            err_pt = (
                (decode_attention_reference(q.half(), store, dtype=torch.float16).double() - truth)
                .abs()
                .max()
                .item()
            )
            qh = q.half()
            poison_free_memory(dev)  # an output element the kernel does not write reads NaN: not finite, FAIL
            try:
                out = decode(qh, store, **kw)
                _sync(dev)
            except Exception as exc:  # noqa: BLE001 - a launch the device refuses: recorded, the sweep records it too
                results.append({"variant": name, "shape": shape_name, "error": _launch_error(exc), "ok": False})
                print(f"  check {shape_name:13s} {name:18s} did not launch: {results[-1]['error']}")
                continue
            err = (out.double() - truth).abs().max().item()
            ok = math.isfinite(err) and err <= 2 * err_pt + 1e-5
            results.append(
                {"variant": name, "shape": shape_name, "err": err, "err_torch_fp16": err_pt, "ok": ok}
            )
            print(
                f"  check {shape_name:13s} {name:18s} kernel err {err:.2e}  torch fp16 err {err_pt:.2e}  "
                f"{'ok' if ok else 'FAIL'}"
            )
            if not ok:
                raise SystemExit(
                    f"CORRECTNESS FAILURE: {name} on {shape_name}: kernel error {err:.3g} > 2 x torch fp16 "
                    f"error {err_pt:.3g}. Timings would be meaningless; aborting."
                )
    return results


QUANTIZE_SPECS = {  # the append path of the presets: values per token, keys per channel (block or static)
    "int4-token-g32": _spec(4, "token", 32),
    "int8-token": _spec(8, "token", None),
    "int2-channel-g32": _spec(2, "channel", 32),
    "int4-channel-g128": _spec(4, "channel", 128),
    "int4-channel-static": _spec(4, "channel", None, static=True),
    "fp8-e4m3-token": _spec(8, "token", None, "fp8"),
    # KVQuant (kvquant-4-block / kvquant-4): NUQ keys with block or static ranges, NUQ values, 1 % outliers
    "nuq4-channel-g128-outl": _spec(4, "channel", 128, "nuq", outlier_frac=0.01),
    "nuq4-channel-static-outl": _spec(4, "channel", None, "nuq", static=True, outlier_frac=0.01),
    "nuq4-token-outl": _spec(4, "token", None, "nuq", outlier_frac=0.01),
    "nuq3-channel-g128-outl": _spec(3, "channel", 128, "nuq", outlier_frac=0.01),  # kvquant-3-block keys
}


def quantize_stand_in(name: str) -> tuple[torch.Tensor, dict]:
    """CPU ``(x, kwargs)`` for ``quantize_pack_triton`` with the shapes and dtypes step 2b passes for
    ``QUANTIZE_SPECS[name]`` (its Llama-3-8B block): what compiling that launch needs (``prewarm.py``,
    ``kernel_resources.py``), not its data."""
    from kvbits.quant.nuq import uniform_codebook

    spec = QUANTIZE_SPECS[name]
    B, H, n, D = 8, 8, 128, 128
    kw: dict = {}
    if spec.static:
        kw = {"static_scale": torch.full((H, D), 0.5).half(), "static_zero": torch.full((H, D), -2.0).half()}
    if spec.kind == "nuq":
        kw["codebook"] = uniform_codebook(spec.bits)
    return torch.randn(B, H, n, D).half(), kw


def check_and_time_quantize(cfg: Config, flush: torch.Tensor | None) -> list[dict]:
    """Quantize-and-pack (``kvbits.kernels.triton_quantize``): bit-for-bit against ``kvbits.quant.quantize``
    on this device (abort on a mismatch: the cache flushes through it on CUDA), then the time to flush
    one 128-token block of a Llama-3-8B-shaped layer (B=8, H_kv=8, D=128, fp16) by each path."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    if cfg.device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    gen = torch.Generator().manual_seed(1)
    B, H, n, D = (1, 2, 128, 64) if cfg.smoke else (8, 8, 128, 128)
    out = []
    for name, spec in QUANTIZE_SPECS.items():
        x = torch.randn(B, H, n, D, generator=gen)
        x[..., :4] *= 20
        x = x.half().to(cfg.device)
        kw = {}
        if spec.static:
            lo, hi = x.float().amin(dim=(0, 2)) * 0.8, x.float().amax(dim=(0, 2)) * 0.8
            width = (hi - lo) if spec.kind == "nuq" else (hi - lo) / 15  # NUQ ranges are the range itself
            kw = {"static_scale": width.half(), "static_zero": lo.half()}
        if spec.kind == "nuq":
            u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
            kw["codebook"] = (u.abs() ** 1.5 * u.sign()).half().to(cfg.device)
        want = quantize(x, spec, **kw)
        poison_free_memory(cfg.device)  # codes or scales left unwritten hold NaN bytes: a mismatch
        got = quantize_pack_triton(x, spec, **kw)
        same = (
            torch.equal(want.data, got.data)
            and torch.equal(want.scale, got.scale)
            and (want.zero is None or torch.equal(want.zero, got.zero))
            and (want.outlier_values is None or (torch.equal(want.outlier_values, got.outlier_values)
                                                 and torch.equal(want.outlier_index, got.outlier_index)))
            and want.clipped == got.clipped
        )  # fmt: skip
        rec = {"spec": name, "shape": [B, H, n, D], "bit_exact": same}
        if not same:
            raise SystemExit(
                f"QUANTIZE KERNEL MISMATCH: {name}: Triton codes/scales differ from kvbits.quant.quantize"
            )
        if not cfg.smoke:
            # eager, as the cache flushes (no CUDA graph for either)
            tri = lambda x=x, spec=spec, kw=kw: quantize_pack_triton(x, spec, sync=False, **kw)
            ref = lambda x=x, spec=spec, kw=kw: quantize(x, spec, sync=False, **kw)
            rec["ms_triton"], _ = time_ms(tri, cfg, flush, graph=False)
            rec["ms_torch"], _ = time_ms(ref, cfg, flush, graph=False)
            rec["speedup"] = round(rec["ms_torch"] / rec["ms_triton"], 2)
        print(f"  quantize {name:22s} bit-exact {same}  " + (
            f"triton {rec['ms_triton']:.4f} ms  torch {rec['ms_torch']:.4f} ms" if not cfg.smoke else ""))  # fmt: skip
        out.append(rec)
    return out


# --------------------------------------------------------------------------------------------------
# End to end (step 6): a whole model decoding through each cache
# --------------------------------------------------------------------------------------------------

E2E_MODEL = {  # Qwen2.5-0.5B (config.json); the smoke model keeps its KV shape, not its size
    "full": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True},
    "smoke": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64},
}  # fmt: skip
# fused; kivi-4 also unfused (dequantize + SDPA). kvquant-4-block runs with uniform codebooks (no
# calibration data on the GPU machine; the codebook's values do not change the work).
E2E_KVBITS = ("int8-token", "kivi-4", "kivi-2", "kvquant-4-block", "fp8-e4m3-token")
E2E_HF = (("quanto", 4), ("quanto", 2), ("fp8", None))  # transformers QuantizedCache backends, if importable


def _e2e_model(cfg: Config, context: int, tokens: int, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Random-weight Qwen2 model (``dtype``; default fp16 on CUDA, float32 on CPU), built on the device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = E2E_MODEL["smoke" if cfg.smoke else "full"]
    config = Qwen2Config(max_position_embeddings=context + tokens + 64, **shape)
    torch.manual_seed(0)
    with cfg.device:
        model = Qwen2ForCausalLM(config)
    if dtype is None:
        dtype = torch.float16 if cfg.device.type == "cuda" else torch.float32
    model = model.to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def _hf_cache(config, backend: str, nbits: int | None):
    """transformers' ``QuantizedCache``, or the reason it cannot be built here."""
    from transformers import QuantizedCache

    kw = {} if nbits is None else {"nbits": nbits, "residual_length": RESIDUAL, "q_group_size": 64}
    try:
        if backend == "quanto":
            import optimum.quanto  # noqa: F401
        return QuantizedCache(backend=backend, config=config, **kw), None
    except (ImportError, ValueError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


@torch.no_grad()
def _decode_run(cfg: Config, model, cache, ids: torch.Tensor, tokens: int, warmup: int) -> dict:
    """Prefill ``ids`` then ``warmup + tokens`` greedy steps; times the last ``tokens`` steps."""
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = []
    for i in range(warmup + tokens):
        if i == warmup:
            _sync(cfg.device)
            t0 = time.perf_counter()
        out = model(nxt, **{kw: cache}, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(nxt)
    _sync(cfg.device)
    seconds = time.perf_counter() - t0
    B = ids.shape[0]
    return {"ms_per_step": round(1e3 * seconds / tokens, 3), "tokens_per_s": round(B * tokens / seconds, 1),
            "tokens": torch.cat(generated, 1)[:, warmup:].cpu()}  # fmt: skip


def kvbits_cache(model, scheme: str, fused: bool, checks: str = "auto"):
    """The ``QuantizedKVCache`` of one step-6 run: ``fused`` decode steps (``use_fused_decode`` on the model)
    or dequantize + SDPA; NUQ sides get uniform codebooks. Off CUDA ``fused`` forces the fused path (the
    torch reference, or Triton under ``KVBITS_KERNEL=triton``); on CUDA ``"auto"`` must pick the kernel.
    ``checks="auto"`` checks incoming K/V lazily on CUDA (no sync per step), eagerly on CPU."""
    from kvbits.cache import QuantizedKVCache

    mode = (True if model.device.type == "cpu" else "auto") if fused else False
    cache = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=mode, checks=checks)
    _install_uniform_codebooks(cache, model.config.num_hidden_layers)
    return cache


def _install_uniform_codebooks(cache, n_layers: int) -> None:
    """NUQ sides of ``cache.scheme`` get the uniform codebook (what an artifact would install)."""
    from kvbits.quant.nuq import uniform_codebook

    for side in ("key", "value"):
        spec = getattr(cache.scheme, side)
        if spec.kind == "nuq":
            for i in range(n_layers):
                cache.set_static_qparams(i, side, codebook=uniform_codebook(spec.bits))


def _allocated(cfg: Config) -> int | None:
    """Bytes the CUDA caching allocator has handed out now (``None`` off CUDA)."""
    if cfg.device.type != "cuda":
        return None
    torch.cuda.synchronize(cfg.device)
    return torch.cuda.memory_allocated(cfg.device)


def _planned_bytes(model, scheme: str, batch: int, tokens: int, fused: bool) -> int:
    """What ``kvbits.plan`` says ``batch`` sequences of ``tokens`` tokens of ``model`` take under ``scheme``
    (``fused``: with the RoPE tables fused decode keeps for pre-RoPE keys)."""
    from kvbits.plan import plan

    return plan(model.config, context=tokens, batch=batch, scheme=scheme, dtype_bytes=model.dtype.itemsize,
                fused_decode=fused)["total_bytes"]  # fmt: skip


def end_to_end(
    cfg: Config,
    context: int,
    batches: list[int],
    tokens: int,
    warmup: int,
    progress: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Step (6): decode tokens/s per cache at ``context``; raises ``SystemExit`` if the fused path was
    not taken on every decode step of every layer. On CUDA each kvbits and ``DynamicCache`` run also
    records the bytes its cache holds on the device after the run (``resident_bytes``: allocated now
    minus before the cache was made, the generated logits freed) against ``kvbits.plan``
    (``planned_bytes``), and the run's peak above that baseline (``peak_bytes``: activations included).
    Runs not started by ``cfg.deadline`` are skipped and say so; ``progress(rows)`` after each run."""
    from kvbits.cache import QuantizedKVCache, use_fused_decode

    model = _e2e_model(cfg, context, tokens)
    n_layers = model.config.num_hidden_layers
    rows = []
    for batch in batches:
        gen = torch.Generator(device=cfg.device).manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, context), device=cfg.device, generator=gen)
        runs = [("dynamic-fp16", "fp16", None)] + [("kvbits-fused", s, True) for s in E2E_KVBITS]
        runs += [("kvbits-dequant-sdpa", "kivi-4", False)] + [(f"hf-quantized-{b}", n, b) for b, n in E2E_HF]
        fp16_tps, fused_tokens = None, {}
        for name, scheme, how in runs:
            bytes_ = note = None
            if _out_of_time(cfg):
                rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                             "skipped": "time budget (--budget-s)"})  # fmt: skip
                print(f"  e2e {name:20s} skipped: time budget")
                continue
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(cfg.device)
            base = _allocated(cfg)
            if name == "dynamic-fp16":
                from transformers import DynamicCache

                model.set_attn_implementation("sdpa")
                cache = DynamicCache(config=model.config)
            elif name.startswith("kvbits"):
                if how:
                    use_fused_decode(model)
                else:
                    model.set_attn_implementation("sdpa")
                cache = kvbits_cache(model, scheme, how)
            else:
                model.set_attn_implementation("sdpa")
                cache, note = _hf_cache(model.config, how, scheme)
                scheme = f"{how}-int{scheme}" if scheme else how
                if cache is None:
                    rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                                 "skipped": note})  # fmt: skip
                    print(f"  e2e {name:20s} skipped: {note}")
                    continue
            try:
                r = _decode_run(cfg, model, cache, ids, tokens, warmup)
            except (RuntimeError, NotImplementedError) as exc:  # e.g. an HF backend failing on this device
                rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                             "skipped": f"{type(exc).__name__}: {str(exc)[:160]}"})  # fmt: skip
                print(f"  e2e {name:20s} failed: {exc}")
                continue
            mem = {"resident_bytes": None, "planned_bytes": None, "extra_bytes": None, "peak_bytes": None,
                   "rope_table_bytes": None}  # fmt: skip
            if name == "dynamic-fp16" or isinstance(cache, QuantizedKVCache):
                mem["planned_bytes"] = _planned_bytes(model, scheme, batch, context + warmup + tokens, how is True)
                if base is not None:
                    mem["resident_bytes"] = _allocated(cfg) - base
                    mem["peak_bytes"] = torch.cuda.max_memory_allocated(cfg.device) - base
            if isinstance(cache, QuantizedKVCache):
                report = cache.memory_report()
                bytes_ = report["total_bytes"]
                fr = cache.fused_report()
                # held beside the K/V, not planned: per-sequence position offsets, a dequantization workspace;
                # the float32 RoPE tables of fused pre-RoPE keys are held apart from memory_report() but planned
                mem["extra_bytes"] = report["position_bytes"] + report["workspace_bytes"]
                mem["rope_table_bytes"] = fr["rope_table_bytes"]
                want = (warmup + tokens) * n_layers if how else 0
                if fr["fused_steps"] != want or fr["fallback_steps"]:
                    raise SystemExit(f"E2E FAILURE: {name} {scheme}: {fr['fused_steps']} fused decode steps "
                                     f"(want {want}), {fr['fallback_steps']} fallbacks: {fr['layers']}")  # fmt: skip
                note = f"{fr['fused_steps']} fused steps"
                if how:
                    fused_tokens[scheme] = r["tokens"]
                elif scheme in fused_tokens:
                    note += (
                        f"; greedy tokens equal to fused: {torch.equal(fused_tokens[scheme], r['tokens'])}"
                    )
            elif name == "dynamic-fp16":
                bytes_ = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                fp16_tps = r["tokens_per_s"]
            row = {"cache": name, "scheme": scheme, "batch": batch, "context": context,
                   "ms_per_step": r["ms_per_step"], "tokens_per_s": r["tokens_per_s"],
                   "speedup_vs_fp16": round(r["tokens_per_s"] / fp16_tps, 3) if fp16_tps else None,
                   "cache_bytes": bytes_, **mem, "note": note}  # fmt: skip
            rows.append(row)
            if mem["resident_bytes"] is not None:
                print(f"  e2e {name:20s} cache on the GPU: {mem['resident_bytes'] / 2**20:.1f} MiB held, "
                      f"{mem['planned_bytes'] / 2**20:.1f} MiB planned "
                      f"({mem['resident_bytes'] / mem['planned_bytes']:.3f}x) + {(mem['extra_bytes'] or 0) / 2**20:.1f} MiB "
                      f"reported apart; run peak +{mem['peak_bytes'] / 2**20:.0f} MiB")  # fmt: skip
            print(f"  e2e {name:20s} {scheme:12s} B={batch:<3d} T={context}: {r['tokens_per_s']:9.1f} tok/s "
                  f"({r['ms_per_step']:.2f} ms/step) {note or ''}")  # fmt: skip
            del cache
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
            if progress is not None:
                progress(rows)
    model.set_attn_implementation("sdpa")
    return rows


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


def _record(
    kernel: str,
    scheme: str,
    shape: str,
    context: int,
    batch: int,
    ms: float,
    graph: bool,
    nbytes: int,
    spread: dict,
    fp16_ms: float,
    copy_gbps: float,
) -> dict:
    """One result row; ``(ms, graph, nbytes, spread)`` in the order the timing helpers return them."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": kernel, "scheme": scheme, "shape": shape, "context": context, "batch": batch, "ms": round(ms, 5),
        **spread, "gbps": round(gbps, 1), "frac_of_copy": round(gbps / copy_gbps, 3), "bytes_read": nbytes,
        "speedup_vs_fp16": round(fp16_ms / ms, 3), "cuda_graph": graph,
    }  # fmt: skip


def fp16_baselines(
    cfg: Config, q: torch.Tensor, H_kv: int, context: int, gen: torch.Generator, flush: torch.Tensor | None
) -> dict[str, tuple[float, bool, int, dict]]:
    """SDPA over fp16 K/V: ``enable_gqa=True``, and K/V expanded to ``H_q`` heads when memory allows.

    Returns ``{name: (ms, cuda_graph, bytes_read, spread)}``; the expansion itself is not timed.
    """
    B, H_q, _, D = q.shape
    G = H_q // H_kv
    k = torch.randn(B, H_kv, context, D, device=cfg.device, dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    kv_bytes = k.nbytes + v.nbytes
    out = {}
    spread: dict = {}
    ms, graph = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), cfg, flush, spread=spread)
    out["sdpa-gqa"] = (ms, graph, kv_bytes, spread)
    if kv_bytes * (G + 1) <= cfg.max_bytes:
        ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        spread = {}
        ms, graph = time_ms(lambda: F.scaled_dot_product_attention(q, ke, ve), cfg, flush, spread=spread)
        out["sdpa-expand"] = (ms, graph, kv_bytes * G, spread)
    return out


def fused_timing(
    cfg: Config,
    decode: Callable,
    q: torch.Tensor,
    shape: dict,
    context: int,
    scheme: tuple[str, int, float] | None,
    kw: dict,
    gen: torch.Generator,
    flush: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[float, bool, int, dict]:
    """(ms, cuda_graph, bytes_read, spread) of the fused path over a random KIVI-layout store (pre-RoPE keys
    with ``tables``; bytes read count K/V and metadata, not the RoPE tables, shared by every sequence and
    head)."""
    store = random_store(q.shape[0], shape, context, scheme, cfg.device, gen, tables)
    spread: dict = {}
    ms, graph = time_ms(lambda: decode(q, store, **kw), cfg, flush, spread=spread)
    return ms, graph, store.nbytes, spread


def sweep(
    cfg: Config,
    decode: Callable,
    copy_gbps: float,
    progress: Callable[[list[dict]], None] | None = None,
    skipped: list[dict] | None = None,
) -> list[dict]:
    """Step (3)-(4): every (shape, batch, context) within the memory budget, batch by batch (the
    largest batch last); ``progress(records)`` after each combo. Combos not run (memory budget, or
    past ``cfg.deadline``) are appended to ``skipped`` with the reason."""
    skipped = [] if skipped is None else skipped
    dev = cfg.device
    gen = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    records: list[dict] = []
    variants = [("fp16", None, {}, False)] + [(name, sch, {}, False) for name, sch in SCHEMES.items()]
    variants += [(name + ROPE_SUFFIX, SCHEMES[name], {}, True) for name in PRE_ROPE]
    if cfg.kernel == "triton":  # both unpacking paths for the integer codes: whole rows (default), gathers
        variants += [(name, sch, {"vectorized": False}, False) for name, sch in SCHEMES.items() if sch[0] == "int"]
        variants += [(name + ROPE_SUFFIX, SCHEMES[name], {"vectorized": False}, True) for name in PRE_ROPE]
    for batch in cfg.batches:
        for shape_name, shp in SHAPES.items():
            for context in cfg.contexts:
                if _out_of_time(cfg):
                    skipped.append({"shape": shape_name, "context": context, "batch": batch,
                                    "reason": "time budget (--budget-s)"})  # fmt: skip
                    print(f"  skip {shape_name} B={batch} T={context}: time budget")
                    continue
                kv_bytes = 2 * batch * shp["H_kv"] * context * shp["D"] * 2
                if kv_bytes > cfg.max_bytes:
                    skipped.append({"shape": shape_name, "context": context, "batch": batch,
                                    "reason": f"fp16 K/V {kv_bytes / 1e9:.1f} GB > --max-gb"})  # fmt: skip
                    print(
                        f"  skip {shape_name} B={batch} T={context}: "
                        f"fp16 K/V {kv_bytes / 1e9:.1f} GB > --max-gb"
                    )
                    continue
                q = torch.randn(
                    batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen
                )
                base = fp16_baselines(cfg, q, shp["H_kv"], context, gen, flush)
                best = min(m[0] for m in base.values())
                row = [_record(name, "fp16", shape_name, context, batch, *m, best, copy_gbps)
                       for name, m in base.items()]  # fmt: skip
                tables = rope_tables(context, shp["D"], dev)
                for scheme, sch, kw, rope in variants:
                    kernel = cfg.kernel + ("-gather" if kw.get("vectorized") is False else "")
                    try:
                        m = fused_timing(cfg, decode, q, shp, context, sch, kw, gen, flush, tables if rope else None)
                    except Exception as exc:  # noqa: BLE001 - e.g. OutOfResources: a result for this variant only
                        row.append({"kernel": kernel, "scheme": scheme, "shape": shape_name, "context": context,
                                    "batch": batch, "error": _launch_error(exc)})  # fmt: skip
                        continue
                    row.append(_record(kernel, scheme, shape_name, context, batch, *m, best, copy_gbps))
                records += row
                cells = [
                    f"{r['scheme']}{'(g)' if 'gather' in r['kernel'] else ''} "
                    + (f"{r['ms']:.4f} ms x{r['speedup_vs_fp16']:.2f}" if "ms" in r else "did not launch")
                    for r in row
                    if not r["kernel"].startswith("sdpa")
                ]
                print(
                    f"  {shape_name:13s} B={batch:<3d} T={context:<7d} fp16 {best:8.4f} ms | "
                    + " | ".join(cells)
                )
                del tables
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if progress is not None:
                    progress(records)
    return records


TUNE_BLOCK_T = (32, 64, 128)  # tokens per inner tile (decode_attention_triton's block_t)
TUNE_WARPS = (4, 8)  # num_warps
TUNE_STAGES = (1, 2, 3)  # num_stages: software-pipelining depth of the tile loop


def tune_grid(D: int) -> list[tuple[int, int, int]]:
    """``(block_t, num_warps, num_stages)`` to time at head dim ``D``: the default launch first
    (``launch_defaults``), then by how many of the three differ from it (a run cut short keeps the nearest)."""
    from kvbits.kernels.triton_decode import launch_defaults

    d = launch_defaults(D)
    default = (d["block_t"], d["num_warps"], d["num_stages"])
    grid = [(b, w, s) for b in TUNE_BLOCK_T for w in TUNE_WARPS for s in TUNE_STAGES]
    return sorted(grid, key=lambda c: sum(x != y for x, y in zip(c, default, strict=True)))


def _launch_error(exc: Exception) -> str:
    """One line for a launch that did not start (e.g. Triton's ``OutOfResources``: too much shared memory)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def tune(cfg: Config, decode: Callable, copy_gbps: float, progress: Callable[[list[dict]], None] | None = None
         ) -> list[dict]:  # fmt: skip
    """Step (3b), Triton only, while the sweep's time lasts: ``block_t`` x ``num_warps`` x ``num_stages``
    (``tune_grid``) for int4 and int4-prerope at 32K (smoke: 512), batch 8 (smoke: 1), both shapes, round
    robin so that a run cut short has the nearest neighbours of every default. Rows: shape, batch, context,
    scheme, block_t, num_warps, num_stages, ms (median; ``ms_p10``/``ms_p90``), gbps, frac_of_copy
    (``error`` instead for a launch that did not start)."""
    if cfg.kernel != "triton":
        return []
    dev = cfg.device
    gen = torch.Generator(device=dev).manual_seed(1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    batch, context = (1, 512) if cfg.smoke else (TUNE_BATCH, TUNE_CONTEXT)
    cases = []  # (shape, scheme, q, store, grid)
    for shape_name, shp in SHAPES.items():
        q = torch.randn(batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen)
        tables = rope_tables(context, shp["D"], dev)
        for scheme, rope in (("int4", False), ("int4" + ROPE_SUFFIX, True)):
            store = random_store(batch, shp, context, SCHEMES["int4"], dev, gen, tables if rope else None)
            grid = tune_grid(shp["D"])[:2] if cfg.smoke else tune_grid(shp["D"])
            cases.append((shape_name, scheme, q, store, grid))
    rows: list[dict] = []
    for i in range(max(len(c[4]) for c in cases)):
        for shape_name, scheme, q, store, grid in cases:
            if i >= len(grid):
                continue
            if _out_of_time(cfg):
                return rows
            block_t, warps, stages = grid[i]
            row = {"shape": shape_name, "batch": batch, "context": context, "scheme": scheme,
                   "block_t": block_t, "num_warps": warps, "num_stages": stages}  # fmt: skip
            run = lambda q=q, st=store, bt=block_t, nw=warps, ns=stages: decode(
                q, st, block_t=bt, num_warps=nw, num_stages=ns
            )
            spread: dict = {}
            try:
                ms, _ = time_ms(run, cfg, flush, spread=spread)
            except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses is a result, not the end of the run
                row["error"] = _launch_error(exc)
                print(f"  tune {shape_name:13s} {scheme:13s} {block_t}/{warps}/{stages}: {row['error']}")
            else:
                gbps = store.nbytes / (ms * 1e-3) / 1e9
                row.update(ms=round(ms, 5), **spread, gbps=round(gbps, 1), frac_of_copy=round(gbps / copy_gbps, 3))
                print(f"  tune {shape_name:13s} {scheme:13s} block_t={block_t:<4d} warps={warps} stages={stages}: "
                      f"{ms:.4f} ms ({100 * gbps / copy_gbps:.0f}% of copy)")  # fmt: skip
            rows.append(row)
            if progress is not None:
                progress(rows)
    return rows


def break_even(records: list[dict]) -> list[dict]:
    """Per (shape, batch, kernel, scheme): the shortest context from which every longer one beats fp16."""
    out = []
    records = [r for r in records if "ms" in r]  # launches that did not start have no time
    keys = sorted(
        {
            (r["shape"], r["batch"], r["kernel"], r["scheme"])
            for r in records
            if not r["kernel"].startswith("sdpa")
        }
    )
    for shape, batch, kernel, scheme in keys:
        rows = sorted(
            (
                r
                for r in records
                if (r["shape"], r["batch"], r["kernel"], r["scheme"]) == (shape, batch, kernel, scheme)
            ),
            key=lambda r: r["context"],
        )
        be = None
        for i, r in enumerate(rows):
            if all(x["speedup_vs_fp16"] >= 1 for x in rows[i:]):
                be = r["context"]
                break
        out.append(
            {
                "shape": shape,
                "batch": batch,
                "kernel": kernel,
                "scheme": scheme,
                "break_even_context": be,
                "max_context_measured": rows[-1]["context"] if rows else None,
            }
        )
    return out


def markdown(records: list[dict], be: list[dict], copy_gbps: float, e2e: list[dict] | None = None) -> str:
    lines = [
        f"Copy bandwidth (read + write): {copy_gbps:.0f} GB/s",
        "",
        "| shape | batch | context | kernel | scheme | ms (p10-p90) | GB/s | of copy | speed-up vs fp16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['kernel']} | {r['scheme']} | "
                         f"did not launch: {r['error']} | | | |")  # fmt: skip
            continue
        sp = "" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:.2f}x"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['kernel']} | {r['scheme']} | "
            f"{r['ms']:.4f} ({r['ms_p10']:.4f}-{r['ms_p90']:.4f}) | "
            f"{r['gbps']:.0f} | {100 * r['frac_of_copy']:.0f}% | {sp} |"
        )
    lines += ["", "| shape | batch | kernel | scheme | break-even context |", "|---|---|---|---|---|"]
    for b in be:
        ctx = b["break_even_context"]
        lines.append(
            f"| {b['shape']} | {b['batch']} | {b['kernel']} | {b['scheme']} | "
            f"{ctx if ctx is not None else '> ' + str(b['max_context_measured'])} |"
        )
    if e2e:
        head = "| cache | scheme | batch | context | tokens/s | ms/step | vs fp16 | cache bytes | GPU held / planned | note |"
        lines += ["", head, "|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e:
            if "skipped" in r:
                lines.append(
                    f"| {r['cache']} | {r['scheme']} | {r['batch']} | {r['context']} | | | | | | {r['skipped']} |"
                )
                continue
            sp = "" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:.2f}x"
            held, planned, extra = r.get("resident_bytes"), r.get("planned_bytes"), r.get("extra_bytes")
            if planned is None:
                held = ""
            else:
                held = f"- / {planned}" if held is None else f"{held} / {planned} ({held / planned:.3f}x)"
                held += f" + {extra} apart" if extra else ""
            lines.append(f"| {r['cache']} | {r['scheme']} | {r['batch']} | {r['context']} | {r['tokens_per_s']} | "
                         f"{r['ms_per_step']} | {sp} | {r['cache_bytes'] or ''} | {held} | {r['note'] or ''} |")  # fmt: skip
    return "\n".join(lines)


def _decoder(cfg: Config) -> Callable | None:
    """The quantized-path implementation to time: the Triton kernel or the torch reference."""
    if cfg.kernel == "reference":
        return lambda q, store, **kw: decode_attention_reference(q, store)
    if cfg.device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    from kvbits.kernels.triton_decode import decode_attention_triton

    return decode_attention_triton


def _prewarm(device: torch.device, timeout_s: float) -> dict:
    """Step (0): compile the kernels of steps 2-3b and 6 on every CPU core first (``prewarm.py``), so that
    the timed steps find them in Triton's cache instead of compiling one by one inside the time budget."""
    major, minor = torch.cuda.get_device_capability(device)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count  # _num_splits' target
    print(f"(0) compiling the kernels for sm_{major}{minor} on all CPU cores (prewarm.py, at most {timeout_s:.0f} s)")
    try:
        from prewarm import prewarm

        result = prewarm(f"sm_{major}{minor}", programs, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - only a head start: the steps compile what they need anyway
        result = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"  {result}")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument(
        "--kernel",
        choices=("auto", "triton", "reference"),
        default="auto",
        help="quantized path to time (auto: triton on CUDA, reference on CPU)",
    )
    p.add_argument(
        "--check",
        choices=("auto", "yes", "no"),
        default="auto",
        help="run the correctness step (auto: whenever Triton is used)",
    )
    p.add_argument("--max-gb", type=float, default=40.0, help="skip combos whose fp16 K/V exceed this")
    p.add_argument(
        "--e2e", choices=("yes", "no", "only"), default="yes", help="step 6 (only: skip steps 2-5)"
    )
    p.add_argument("--e2e-context", type=int, default=None, help="prompt tokens (default 32768; smoke 256)")
    p.add_argument(
        "--e2e-batch", type=int, action="append", default=None, help="repeatable (default 1 and 8)"
    )
    p.add_argument("--e2e-tokens", type=int, default=None, help="timed decode steps (default 32; smoke 4)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--prewarm-s",
        type=float,
        default=120.0,
        help="CUDA + Triton: compile the kernels in parallel first, for at most this long (0: off)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=290.0,
        help="wall-clock budget: sweep combos stop starting at budget - 90 s (e2e's share), e2e runs at the "
        "budget; what was skipped is listed (default 290; results are written after every combo)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; run with --device cpu (add --smoke for a quick check)")
    kernel = args.kernel if args.kernel != "auto" else ("triton" if device.type == "cuda" else "reference")
    cfg = Config(
        device=device,
        contexts=[256, 512] if args.smoke else list(CONTEXTS),
        batches=[1] if args.smoke else list(BATCHES),
        reps=1 if args.smoke else 30,
        warmup=1 if args.smoke else 5,
        max_bytes=args.max_gb * 1e9,
        smoke=args.smoke,
        kernel=kernel,
    )
    t0 = time.time()
    e2e_share = 90.0 if args.e2e != "no" else 0.0
    cfg.deadline = time.monotonic() + max(0.0, args.budget_s - e2e_share)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
    }
    if device.type == "cuda":  # the limits benchmarks/kernel_resources.py assumed for sm_90 (kvbits.kernels.aot)
        props = torch.cuda.get_device_properties(device)
        env["capability"] = f"sm_{props.major}{props.minor}"
        for key in ("multi_processor_count", "shared_memory_per_block_optin", "shared_memory_per_multiprocessor",
                    "regs_per_multiprocessor", "max_threads_per_multi_processor", "L2_cache_size"):  # fmt: skip
            env[key] = getattr(props, key, None)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    print(f"# gpu_decode: {env}")
    result = {
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "complete": False,  # True once every step ran; a killed run leaves what it had measured
        "smoke": cfg.smoke,
        "env": env,
        "budget_s": args.budget_s,
        "copy_gbps": None,
        "layout": {
            "key": f"per-channel, {KEY_GROUP}-token groups",
            "value": f"per-token, {VALUE_GROUP}-channel groups",
            "residual_fp16": RESIDUAL,
        },
        "prewarm": None,
        "checks": [],
        "quantize": [],
        "records": [],
        "skipped": [],
        "tuning": [],
        "break_even": [],
        "e2e": [],
        "seconds": None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(**fields) -> None:
        result.update(fields, seconds=round(time.time() - t0, 1))
        args.out.write_text(json.dumps(result, indent=1))

    if kernel == "triton" and device.type == "cuda" and args.prewarm_s > 0:
        save(prewarm=_prewarm(device, args.prewarm_s))
    copy_gbps = copy_bandwidth(cfg)
    save(copy_gbps=round(copy_gbps, 1))
    print(f"(1) copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    run_check = args.check == "yes" or (args.check == "auto" and env["triton"] is not None)
    records: list[dict] = []
    if run_check and args.e2e != "only":
        print("(2) correctness vs float64")
        check_cfg = Config(**{**cfg.__dict__, "kernel": "triton"})
        save(checks=check_variants(check_cfg, _decoder(check_cfg)))
        print("(2b) quantize-and-pack kernel vs kvbits.quant.quantize (bit for bit), flush time")
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        save(quantize=check_and_time_quantize(cfg, flush))
    if args.e2e != "only":
        decode = _decoder(cfg)
        print(f"(3) decode attention sweep ({kernel}), combos start until {args.budget_s - e2e_share:.0f} s")
        records = sweep(
            cfg, decode, copy_gbps, lambda rows: save(records=rows, break_even=break_even(rows)), result["skipped"]
        )
        if kernel == "triton":
            print("(3b) kernel launch parameters (block_t x num_warps), while the sweep's time lasts")
            tune(cfg, decode, copy_gbps, lambda rows: save(tuning=rows))
    be = break_even(records)
    save(records=records, break_even=be)
    e2e: list[dict] = []
    if args.e2e != "no":
        cfg.deadline = time.monotonic() + max(0.0, args.budget_s - (time.time() - t0))
        context = args.e2e_context or (256 if cfg.smoke else E2E_CONTEXT)
        batches = args.e2e_batch or ([1] if cfg.smoke else list(E2E_BATCHES))
        tokens = args.e2e_tokens or (4 if cfg.smoke else E2E_TOKENS)
        print(f"(6) end to end: decode after a {context}-token prompt, batches {batches}")
        e2e = end_to_end(cfg, context, batches, tokens, warmup=1 if cfg.smoke else E2E_WARMUP,
                         progress=lambda rows: save(e2e=rows))  # fmt: skip
    save(e2e=e2e, complete=True)
    print(markdown(records, be, copy_gbps, e2e))
    print(f"\nwrote {args.out} in {time.time() - t0:.0f} s")
    return result


if __name__ == "__main__":
    main()
