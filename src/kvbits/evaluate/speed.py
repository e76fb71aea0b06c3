"""``speed_eval``: decode throughput and memory of each scheme's real cache against ``DynamicCache``.

For each (context, batch): ``batch`` prompts of ``context`` tokens (real text, one window per row) are
prefilled once in full precision (``DynamicCache``); the prefill's K/V are loaded into each cache with
``update`` (a quantized cache stores and flushes them as during generation), and the model then decodes
``warmup + tokens`` greedy steps through it, one token per sequence per forward, from the same first
token. Each of the last ``tokens`` steps is timed on its own (the device synchronised before and after):
the median, 10th and 90th percentile of the step time, and tokens/s = ``batch`` / median step. On CUDA also
``host_ms_per_step``: the median time until the step's Python returned, before the sync; close to the step time,
the step is bound by the host (Python and kernel launches), and the speed-ups compare host work. The
baseline is transformers' ``DynamicCache`` (the model's own layer kinds: sliding-window layers included),
which the speed-ups divide by.

How a kvbits decode step attends (``path`` in each record):

- ``fused``: the fused kernel over the packed store (``fused_decode="auto"`` picks it on CUDA with Triton;
  ``True`` forces it, on CPU through the torch reference, which dequantizes and is a correctness path, not
  a speed path). A layer's first decode step attends over real K/V and claims the layer
  (``kvbits.cache.fused``), so that step belongs in the warm-up; ``decode`` counts the layer x step
  decodes that went through the kernel and those that fell back, in all and in the timed steps, and
  ``kernel_calls`` what served them (``triton`` or ``reference``: the report says which);
- ``dequantize``: every step dequantizes the whole history, then SDPA: the memory the cache reports is
  then all it holds;
- ``workspace`` (``workspace=True``): a dequantized copy of the history is kept and appended to, so a step
  only dequantizes what was flushed since; fast, but it holds the float history too
  (``workspace_bytes``, reported apart).

Every kvbits cache reserves its quantized storage for the run's tokens (``reserve=True``, the default:
``QuantizedKVCache(max_cache_len=context + warmup + tokens)``, as a server reserves a request), so a flush
writes in place instead of copying the layer's quantized history (``kvbits.cache.store``); the bytes after
the last step are the same either way. ``reserve=False`` measures a growing cache (every run before
``reserve`` existed; their records lack the key).

SDPA's backend (``sdpa``, for the ``DynamicCache`` baseline, the dequantizing paths and the prefill): ``"auto"``
lets torch pick; ``"no-cudnn"`` leaves cuDNN's out (flash, memory-efficient or math; ``kvbits.evaluate.sdpa``). Where
SDPA picks cuDNN, every decode step through SDPA builds a cuDNN plan on the host, a cost kvbits' fused steps (no SDPA)
never pay: compare both before reading a fused speed-up as the kernel's.

Memory per run: the bytes the cache holds after the last step (``memory_report()["total_bytes"]`` for
kvbits, every K/V tensor of a ``DynamicCache``, a peer's quanto codes, scales, zero-points and residual:
``kvbits.evaluate.stream.cache_bytes``) beside what ``kvbits.plan`` says for the same tokens
(``planned_bytes``, none for a peer: they are equal unless something is wrong); a hybrid model's convolution /
linear-attention states (LFM2, Qwen3-Next: fixed per sequence, unquantized, the same in every run) are not K/V and
not in either: ``linear_state_bytes`` counts them apart (``kvbits.evaluate.stream.linear_state_bytes``, 0 for a model
whose every layer attends), and on CUDA the allocator's bytes held
by the cache after the run (``cuda_resident_bytes``; a ``graphs`` run's captured steps are freed first, and what they
held, each variant's logits and the step's inputs, is ``cuda_graph_bytes``) and its peak above the pre-cache baseline
during the decode (``cuda_peak_bytes``: activations included). Greedy tokens are compared with the baseline's:
``agreement`` (fraction of equal tokens) and ``first_divergence`` (the first step at which some row
differs; ``None``: never), both over all ``warmup + tokens`` decode steps, counted from 0 at the first warm-up
step: unlike ``step_ms`` (the timed steps only), step ``warmup`` is the first timed one.
"""

from __future__ import annotations

import datetime as _dt
import gc
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvbits._argtypes import runs_on_device
from kvbits._model import check_cache_holds, check_model_arg
from kvbits.evaluate.inputs import check_int, check_ints
from kvbits.evaluate.sdpa import check_sdpa_mode, sdpa_backends
from kvbits.evaluate.stream import (
    PeerScheme,
    cache_bytes,
    check_schemes_fit,
    linear_state_bytes,
    resolve_schemes,
)
from kvbits.schemes import check_unique_names

logger = logging.getLogger(__name__)

__all__ = ["SPEED_VERSION", "failed_cells", "speed_eval", "step_stats"]

SPEED_VERSION = 1
BASELINE = "DynamicCache"
STATIC_BASELINE = "StaticCache"  # transformers' fixed-slot float cache: the baseline of static runs
GRAPH_EAGER = 2  # decode steps run eagerly before the captured one (``kvbits.evaluate.graphs.GraphedDecode``)


def significant(x: float, digits: int) -> float:
    """``x`` rounded to ``digits`` significant digits: a ratio or rate keeps its precision however small (a slow
    run's speed-up of 0.032935 was rounded to 4 decimals, 0.0329, 1.1e-3 off; tokens/s of 0.033 to 0.03)."""
    return float(f"{x:.{digits}g}")


def step_stats(ms: Sequence[float], batch: int) -> dict[str, float]:
    """``ms_per_step`` (median), ``ms_p10``, ``ms_p90``, ``ms_mean`` of per-step times in ms, and
    ``tokens_per_s`` (``batch`` tokens per median step)."""
    if not ms:
        raise ValueError("no step times")
    if not all(math.isfinite(x) and x >= 0 for x in ms):
        raise ValueError(f"step times must be finite and >= 0, got {list(ms)}")
    t = torch.tensor(list(ms), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    med = q[1]
    return {
        "ms_per_step": round(med, 4),
        "ms_p10": round(q[0], 4),
        "ms_p90": round(q[2], 4),
        "ms_mean": round(float(t.mean()), 4),
        "tokens_per_s": significant(batch * 1e3 / med, 6) if med > 0 else math.inf,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PREFILL_WARMUP = 16  # tokens of the untimed prefill before the first timed one (one-off set-up costs)
ERROR_CHARS = 500  # a failed run's message is kept to one line of at most this many characters


def run_error(exc: BaseException) -> dict[str, str]:
    """A failed run's ``error``: ``{"type": "OutOfMemoryError", "message": ...}``, the message on one line (at most
    ``ERROR_CHARS`` characters)."""
    message = " ".join(str(exc).split()) or "(no message)"
    if len(message) > ERROR_CHARS:
        message = message[: ERROR_CHARS - 1] + "…"
    return {"type": type(exc).__name__, "message": message}


def failed_run(cache: str, path: str, cell: dict[str, Any], error: dict[str, str],
               prefill_seconds: float | None) -> dict[str, Any]:  # fmt: skip
    """The record of a run that raised: its ``cache``, ``path``, the cell (``context``, ``batch``, ``cached_tokens``,
    ``distinct_rows``), ``error`` (:func:`run_error`) and ``prefill_seconds`` (``None``: the prefill failed); no
    timings, bytes or agreement (a reader skips it, the report prints ``failed: <type>``)."""
    return {"cache": cache, "path": path, **cell, "error": error, "prefill_seconds": prefill_seconds}


def failed_cells(runs: Sequence[dict[str, Any]]) -> str:
    """The failed runs of ``runs`` as one line: ``"kivi-2 at 131072 x 1 (OutOfMemoryError), ..."``."""
    return ", ".join(f"{r['cache']} at {r['context']} x {r['batch']} ({r['error']['type']})" for r in runs
                     if r.get("error"))  # fmt: skip


def free_device(device: torch.device) -> None:
    """After a failed run: drop what it left (its cache, activations) so the next run starts clean; on CUDA the
    allocator's cached blocks go back too (``empty_cache``: an out-of-memory run leaves them fragmented)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cuda_allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _head(model: Any) -> Any:
    """The model's ``LogitHead``; ``ValueError`` for a model without an output embedding (greedy decoding
    needs logits)."""
    from kvbits.evaluate.metrics import LogitHead

    proj = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if proj is None:
        raise ValueError(f"speed_eval decodes greedily, so it needs a causal LM with an output embedding; got "
                         f"{type(model).__name__}")  # fmt: skip
    return LogitHead.from_model(model)


@torch.no_grad()
def _decode(
    model: Any, cache: Any, first: torch.Tensor, steps: int, warmup: int, on_timed: Any = None,
    position0: int | None = None, step: Any = None,
) -> tuple[torch.Tensor, list[float], list[float]]:
    """``warmup + steps`` greedy steps from ``first`` ``(B, 1)`` through ``cache``: the generated tokens
    ``(B, warmup + steps)``, the times (ms) of the last ``steps``, and of each the time (ms) until the step's
    Python returned, before the device was synchronised (``host_ms_per_step``); ``on_timed()`` is called before
    the first timed step. ``position0``: each step gets its ``cache_position`` (a ``(1,)`` tensor, as ``generate``
    passes it to a static cache), ``position0`` for the first; ``step``: what runs a step in place of ``model``
    (``GraphedDecode``, which needs them)."""
    from kvbits.cache.compat import cache_kwarg

    kw = cache_kwarg(model)
    dev = first.device
    forward = model if step is None else step
    nxt, tokens, times, host = first, [], [], []
    for i in range(warmup + steps):
        if i == warmup and on_timed is not None:
            on_timed()
        extra = {} if position0 is None else {"cache_position": torch.full((1,), position0 + i, device=dev)}
        _sync(dev)
        t0 = time.perf_counter()
        logits = forward(nxt, use_cache=True, logits_to_keep=1, **{kw: cache}, **extra).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        t_host = time.perf_counter()
        _sync(dev)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
            host.append(1e3 * (t_host - t0))
        tokens.append(nxt)
    return torch.cat(tokens, dim=1).cpu(), times, host


def host_ms_per_step(host_ms: Sequence[float], device: torch.device) -> float | None:
    """The median time a step's Python took before the device sync, on a device that runs asynchronously (CUDA):
    near the step's time, the step waits on the host (Python, launches), not on the GPU. ``None`` elsewhere (on
    the CPU every operation finishes before the Python goes on, so the two are the same by construction)."""
    if device.type != "cuda" or not host_ms:
        return None
    return step_stats(host_ms, 1)["ms_per_step"]  # the same median as the step times


def _planned(model: Any, scheme: Any, batch: int, tokens: int) -> int | None:
    """``kvbits.plan``'s K/V bytes for ``batch`` sequences of ``tokens`` tokens (None for peers): what
    ``memory_report()["total_bytes"]`` counts (not the fused path's RoPE tables)."""
    if isinstance(scheme, PeerScheme):
        return None
    from kvbits.evaluate.measures import model_dtype_bytes
    from kvbits.plan import plan

    dtype_bytes = model_dtype_bytes(model)
    return int(
        plan(model.config, context=tokens, batch=batch, scheme=scheme, dtype_bytes=dtype_bytes)["total_bytes"]
    )


def _dynamic_scheme(model: Any) -> Any:
    """What a ``DynamicCache`` stores, as a scheme the planner counts: keys and values in the model's dtype."""
    from kvbits.evaluate.measures import floating_dtype
    from kvbits.schemes.spec import KVScheme, TensorSpec

    dtype = floating_dtype(model)
    fmt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)
    if fmt is None:
        raise ValueError(f"the model's dtype must be float16, bfloat16 or float32, got {dtype or 'no floating parameter'}")
    spec = TensorSpec(kind="float", bits=32 if fmt == "fp32" else 16, fmt=fmt)
    return KVScheme(name=BASELINE, key=spec, value=spec)


def _divergence(tokens: torch.Tensor, ref: torch.Tensor) -> tuple[float, int | None]:
    """Fraction of equal tokens and the first step at which some row differs (None: none does)."""
    same = tokens == ref
    cols = (~same).any(dim=0).nonzero()
    return float(same.double().mean()), (int(cols[0]) if len(cols) else None)


def _counts(report: dict[str, Any]) -> dict[str, int]:
    return {k: int(report[k]) for k in ("fused_steps", "fallback_steps")}


def _cache_name(scheme: Any) -> str:
    """A run's ``cache``: the baseline's name (``None``: ``DynamicCache``; ``STATIC_BASELINE``), else the scheme's."""
    return BASELINE if scheme is None else scheme if scheme == STATIC_BASELINE else scheme.name


def _path(scheme: Any, fused: bool, workspace: bool, static: bool = False, graphs: bool = False) -> str:
    if scheme is None:
        return "dynamic"
    if isinstance(scheme, PeerScheme):
        return "peer"
    if static:
        path = "static-float" if scheme == STATIC_BASELINE else "static-fused" if fused else "static-dequantize"
        return path + "-graphs" if graphs else path
    if fused:
        return "fused"
    return "workspace" if workspace else "dequantize"


def _static_cache(model: Any, scheme: Any, held: int, fused: bool, calibration: Any, graphs: bool) -> Any:
    """transformers' ``StaticCache`` (``scheme`` is ``STATIC_BASELINE``) or a ``StaticQuantizedKVCache`` of ``held``
    slots per sequence; its K/V checks lazy (read by ``memory_report``) on CUDA and for a captured step (eager checks
    read the device), eager otherwise."""
    if scheme == STATIC_BASELINE:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=held)
    from kvbits.cache import StaticQuantizedKVCache

    return StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=held, fused_decode=fused,
                                  checks="lazy" if graphs else "auto", calibration=calibration)  # fmt: skip


def static_refusals(schemes: Sequence[Any], n_layers: int) -> dict[str, str]:
    """Why each kvbits scheme of ``schemes`` can not run in a ``StaticQuantizedKVCache`` of ``n_layers`` layers
    (``kvbits.cache.static_reason``, the first refused layer), by name; peers run their own caches."""
    from kvbits.cache import static_reason

    out = {}
    for s in schemes:
        if isinstance(s, PeerScheme):
            continue
        for i in range(n_layers):
            why = static_reason(s.for_layer(i))
            if why is not None:
                out[s.name] = f"layer {i}: {why}" if s.is_mixed else why
                break
    return out


def check_static_model(model: Any, schemes: Sequence[Any], held: int) -> None:
    """``ValueError`` before any run when a ``StaticQuantizedKVCache`` of ``held`` slots can not be made for ``model``
    with one of ``schemes`` (sliding or chunked layers, pre-RoPE keys under partial or length-dependent RoPE, ...):
    each is made here, which reserves nothing (the slabs come with the first update). Peers run their own caches."""
    from kvbits.cache import StaticQuantizedKVCache

    for s in schemes:
        if isinstance(s, PeerScheme):
            continue
        try:
            StaticQuantizedKVCache(config=model.config, scheme=s, max_cache_len=held)
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"static=True: {s.name!r}: {exc}") from exc


def _run_one(model, scheme, kv, first, ref_tokens, *, batch, context, tokens, warmup, calibration, fused,
             workspace, reserve=False, static=False, graphs=False) -> dict[str, Any]:  # fmt: skip
    """One cache's decode run (module docstring); ``scheme`` None is the ``DynamicCache`` baseline,
    ``STATIC_BASELINE`` transformers' ``StaticCache``; ``static``: kvbits schemes in a ``StaticQuantizedKVCache``,
    ``graphs``: its (and ``StaticCache``'s) steps replayed from one captured step."""
    import contextlib

    from transformers import DynamicCache

    from kvbits.evaluate.stream import _fused_attention, load_kv, make_cache
    from kvbits.kernels import dispatch

    dev = first.device
    base = _cuda_allocated(dev)
    held = context + warmup + tokens
    static = static and scheme is not None and not isinstance(scheme, PeerScheme)
    graphed = None
    with _fused_attention(model) if fused else contextlib.nullcontext():
        if scheme is None:
            cache = DynamicCache(config=model.config)
        elif static:
            cache = _static_cache(model, scheme, held, fused, calibration, graphs)
            if graphs:
                from kvbits.evaluate.graphs import GraphedDecode

                graphed = GraphedDecode(model, eager=GRAPH_EAGER)
        else:
            cache = make_cache(
                scheme, model, calibration=calibration, fused_decode=fused, workspace=workspace,
                max_cache_len=held if reserve else None, calibration_warnings=False,  # said once per run
            )  # fmt: skip
        load_kv(cache, kv)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        calls0 = dispatch.kernel_calls()
        before: dict[str, int] = {}
        counts = getattr(cache, "fused_report", None) if scheme is not None else None
        on_timed = None if counts is None else (lambda: before.update(_counts(counts())))
        out, times, host = _decode(model, cache, first, tokens, warmup, on_timed,
                                   position0=context if static else None, step=graphed)  # fmt: skip
    if graphed is not None and (not graphed.captured or graphed.calls != warmup + tokens):
        raise RuntimeError(f"the decode steps were not replayed from a captured step: {graphed.calls} calls, "
                           f"captured {graphed.captured}")  # fmt: skip
    rec: dict[str, Any] = {
        "cache": _cache_name(scheme),
        "path": _path(scheme, fused, workspace, static, graphs),
        "context": context,
        "batch": batch,
        "cached_tokens": held,
        **step_stats(times, batch),
        "host_ms_per_step": host_ms_per_step(host, dev),
        "step_ms": [round(x, 4) for x in times],
    }
    rec["cache_bytes"] = cache_bytes(cache)
    rec["linear_state_bytes"] = linear_state_bytes(cache)  # a hybrid model's conv / recurrent states, not K/V
    if scheme is None or scheme == STATIC_BASELINE or isinstance(scheme, PeerScheme):
        rec["workspace_bytes"] = None if isinstance(scheme, PeerScheme) else 0
        rec["decode"] = None
    else:
        rec["workspace_bytes"] = int(cache.memory_report().get("workspace_bytes", 0))  # a static cache has none
        report = cache.fused_report()
        after = _counts(report)
        rec["decode"] = {**after, **{f"timed_{k}": after[k] - before.get(k, 0) for k in after}}
        # the layers that count decode steps: a hybrid model's attention layers, not its convolution layers
        rec["decode"]["counted_layers"] = len(report["layers"])
        calls = dispatch.kernel_calls()  # the steps the host ran (warm-up included), by what attended them
        rec["decode"]["kernel_calls"] = {k: calls[k] - calls0[k] for k in calls}
    if graphed is not None:  # its replays run no Python: the layers count the other steps
        rec["graph"] = {"eager_steps": graphed.eager, "captured_steps": sorted(c - 1 for c in graphed.captured_at.values()),
                        "python_steps": graphed.calls - graphed.replays, "replayed_steps": graphed.replays}  # fmt: skip
    float_cache = scheme is None or scheme == STATIC_BASELINE
    rec["planned_bytes"] = _planned(model, _dynamic_scheme(model) if float_cache else scheme, batch, held)
    rec["cuda_resident_bytes"] = rec["cuda_peak_bytes"] = rec["cuda_graph_bytes"] = None
    if base is not None:  # the cache alive, the step's logits gone: what the cache holds on the device
        rec["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev)) - base
        if graphed is not None:  # its graphs' pool (each captured variant's logits, the step's inputs) is not the cache's
            with_graphs, graphed = _cuda_allocated(dev), None  # the last reference: the graphs are freed with it
            gc.collect()
            rec["cuda_graph_bytes"] = with_graphs - _cuda_allocated(dev)
        rec["cuda_resident_bytes"] = _cuda_allocated(dev) - base
    rec["agreement"], rec["first_divergence"] = (
        (1.0, None) if ref_tokens is None else _divergence(out, ref_tokens)
    )
    del cache
    rec["tokens"] = out
    return rec


def _check_args(schemes: list, tokens: Any, warmup: Any, fused_mode: Any, workspace: Any) -> None:
    names = [s.name for s in schemes]
    check_unique_names(names, "timed")
    for base in (BASELINE, STATIC_BASELINE):
        if base in names:
            raise ValueError(f"{base!r} is a baseline the runs are measured against; it is not a scheme name")
    check_int("tokens", tokens, 1)
    check_int("warmup", warmup, 0)
    if not isinstance(workspace, bool):
        raise TypeError(f"workspace must be True or False, got {workspace!r}")
    if workspace and fused_mode is True:
        raise ValueError("workspace=True keeps a dequantized history for the dequantizing path; fused_decode=True "
                         "never reads it")  # fmt: skip


def _check_static(static: Any, graphs: Any, reserve: bool, workspace: bool, warmup: int) -> None:
    for name, v in (("static", static), ("graphs", graphs)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    if graphs and not static:
        raise ValueError("graphs=True replays the steps of a static cache: it needs static=True")
    if static and not reserve:
        raise ValueError("static=True reserves every slot (StaticQuantizedKVCache); reserve=False asks for growing "
                         "caches")  # fmt: skip
    if static and workspace:
        raise ValueError("static=True holds no dequantized workspace; workspace=True is for QuantizedKVCache")
    if graphs and warmup < GRAPH_EAGER + 1:
        raise ValueError(f"graphs=True runs {GRAPH_EAGER} eager steps and captures the next, all untimed: warmup must "
                         f"be at least {GRAPH_EAGER + 1}, got {warmup}")  # fmt: skip


def _prompt_source(data: Any, data_path: str | None) -> Any:
    """``data`` as ``_prompts`` takes it: token ids and a ``TextSource`` as they are, a text spec (a registered text
    or a file) loaded once here (``ValueError`` / ``TypeError`` for a wrong one, before the model loads)."""
    from kvbits.evaluate.data import TextSource, load_text

    if isinstance(data, (torch.Tensor, TextSource)):
        return data
    return load_text(data, data_path)


def _prompts(
    data: Any, tokenizer: Any, context: int, batch: int, data_path: str | None, model: Any = None,
    bos: str = "never",
) -> tuple[torch.Tensor, int, str, str, int | None]:
    """``(ids (batch, context), distinct rows, data name, token fingerprint, BOS id or None)``: consecutive windows of
    the text (each starting with the BOS where ``bos`` resolves to one), repeated when it holds fewer than ``batch``
    of them (logged)."""
    from kvbits.evaluate.inputs import _load_windows

    win, name, fp, bos_id = _load_windows(data, tokenizer, context, batch, data_path, model, bos)
    distinct = int(win.shape[0])
    if distinct < batch:
        logger.warning(
            "the text holds %d window(s) of %d tokens; batch %d repeats them", distinct, context, batch
        )
        win = win.repeat((batch + distinct - 1) // distinct, 1)[:batch]
    return win, distinct, name, fp, bos_id


@runs_on_device
def speed_eval(
    model: Any,
    contexts: Sequence[int] | int,
    schemes: Sequence[str | dict | Any],
    *,
    batches: Sequence[int] | int = 1,
    tokens: int = 32,
    warmup: int = 4,
    data: Any = "war-and-peace",
    calibration: Any = None,
    fused_decode: bool | str = "auto",
    workspace: bool = False,
    reserve: bool = True,
    static: bool = False,
    graphs: bool = False,
    sdpa: str = "auto",
    data_path: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    progress: bool = False,
    bos: str = "auto",
) -> dict[str, Any]:
    """Decode throughput and cache memory of each scheme against ``DynamicCache`` (module docstring).

    Args:
        model: registry name / path (``load_model``), a ``LoadedModel`` or a transformers causal LM.
        contexts: prompt tokens per sequence, one or several; decoding starts after them.
        schemes: kvbits schemes (names, dicts, JSON paths, objects) or peers (``hf-quanto-int4``).
        batches: sequences decoded at once, one or several.
        tokens: timed decode steps per run; ``warmup``: untimed steps before them.
        data: the prompts: a registered text, a file (a ``str`` or path-like), a ``TextSource``, or token ids (a tensor ``(N,)`` or
            ``(W, context)``, for models without a tokenizer).
        calibration: ``kvbits calibrate`` artifacts or folders for calibrated schemes, as ``evaluate``.
        fused_decode: ``"auto"`` (the fused kernel on CUDA with Triton), ``True``, ``False``.
        workspace: the dequantizing path keeps a dequantized history (faster, holds more; module docstring); a run
            that ``fused_decode="auto"`` sends through the fused path (CUDA) keeps none: it would never read it.
        reserve: kvbits caches reserve quantized storage for the run's tokens (``max_cache_len``; module
            docstring); ``False``: they grow by concatenation.
        static: kvbits schemes decode through a ``StaticQuantizedKVCache`` of the run's tokens (fixed slabs, lengths
            on the device; ``ValueError`` for a scheme it does not hold, ``kvbits.cache.static_reason``), and
            transformers' ``StaticCache`` is timed as a second baseline (module docstring).
        graphs: with ``static``, the static caches' decode steps are replayed from captured CUDA graphs
            (``kvbits.evaluate.graphs``; a CUDA device, ``warmup`` of 3 or more).
        sdpa: SDPA's backends for the whole run, ``"auto"`` or ``"no-cudnn"`` (module docstring).
        data_path, dtype, device: as ``evaluate``.
        bos: ``"auto"`` (each prompt starts with the tokenizer's BOS where ``tokenizer(text)`` adds one), ``"always"``
            or ``"never"``, as ``evaluate`` takes it; the summary's ``"bos"`` says what ran (``"always"`` /
            ``"never"``; a record without it: ``"never"``), with a BOS its ``"bos_token"`` / ``"bos_token_id"`` too.
        progress: a progress bar on stderr.

    Returns:
        ``{"version", "model", "data", "bos", "bos_token" and "bos_token_id" (with a BOS only), "device": {"type", "name", "threads"}, "dtype", "contexts", "batches",
        "tokens", "warmup", "fused_decode", "workspace", "reserve", "static", "graphs", "baselines", "sdpa",
        "kernel_settings": {"kernel", "dequant",
        "autotune"} (``kvbits.kernels.dispatch.kernel_settings``), "tuned_launches": {launch key: candidate} (the
        autotuner's launches this run served, ``{}`` unless ``KVBITS_AUTOTUNE=on``), "layers", "schemes": [{"scheme",
        "avg_bits", "peer", "path", "calibration"}],
        "runs": [{"cache", "path", "context", "batch", "cached_tokens", "ms_per_step", "ms_p10", "ms_p90",
        "ms_mean", "tokens_per_s", "speedup", "host_ms_per_step", "step_ms", "cache_bytes", "linear_state_bytes", "workspace_bytes", "planned_bytes",
        "cuda_resident_bytes", "cuda_peak_bytes", "cuda_graph_bytes" (CUDA graph runs: what the captured steps held,
        freed before ``cuda_resident_bytes`` is read; else ``None``), "decode" (kvbits caches: fused and fallback steps, all and timed,
        ``counted_layers`` (the cache's layers that count them: a hybrid model's attention layers, of ``layers``),
        and ``kernel_calls``: the fused steps' ``decode_attention`` calls the host ran, warm-up included, by what
        served them, ``{"triton", "reference"}``), "graph" (graphs only: the warm-up's eager steps, the steps
        captured (0-based; one per step variant), those run in Python (eager or captured) and those replayed), "agreement", "first_divergence", "prefill_seconds"}], "fingerprint", "wall_seconds",
        "peak_rss_bytes", "date", "commit", "versions"}``; ``speedup`` is tokens/s over the ``DynamicCache`` run's at
        the same context and batch; ``baselines``: ``["DynamicCache"]``, and ``"StaticCache"`` with ``static``.
        A run that raises (``Exception``: out of memory, a scheme the model refuses; ``KeyboardInterrupt`` still
        stops everything) is recorded as ``{"cache", "path", "context", "batch", "cached_tokens", "distinct_rows",
        "prefill_seconds", "error": {"type", "message"}}`` (:func:`failed_run`; a failed prefill fails every run of
        its cell, ``prefill_seconds`` ``None``; logged at ERROR when it fails, :func:`failed_cells` lists them all),
        the device's memory is freed and the other runs go on; where the
        ``DynamicCache`` run of a cell failed, its other runs' ``speedup``, ``agreement`` and ``first_divergence``
        are ``None``. The first cell's prefill is preceded by an untimed one of ``PREFILL_WARMUP`` tokens (one-off
        set-up is timed by no cell).
    """
    check_model_arg(model, "speed_eval")
    from kvbits.cache import attention_shape
    from kvbits.cache.fused import check_mode
    from kvbits.evaluate.data import bos_record, check_bos
    from kvbits.evaluate.inputs import (
        _check_before_loading,
        _data_arg,
        _load_checked_model,
        _model_arg,
        _run_dtype,
    )
    from kvbits.evaluate.measures import (
        _mismatch,
        _peak_rss_bytes,
        _warn_mismatch,
        long_run_avg_bits,
        model_dtype_bytes,
        plan_shape_of,
    )
    from kvbits.evaluate.outputs import _git_commit, _versions
    from kvbits.evaluate.runner import _progress
    from kvbits.evaluate.stream import fuses, prefill_kv
    from kvbits.plan.config import check_context_fits

    contexts = check_ints("context", contexts, 1)
    batches = check_ints("batch", batches, 1)
    check_bos(bos, model)
    resolved = resolve_schemes(schemes)
    fused_mode = check_mode(fused_decode)
    from kvbits.kernels import autotune, dispatch

    settings = dispatch.kernel_settings()  # before any model work: a bad KVBITS_* value fails here
    launches_before = autotune.launch_counts()  # this run's tuned launches are those served after it
    _check_args(resolved, tokens, warmup, fused_mode, workspace)
    if not isinstance(reserve, bool):
        raise TypeError(f"reserve must be True or False, got {reserve!r}")
    _check_static(static, graphs, reserve, workspace, warmup)
    check_sdpa_mode(sdpa)  # before the model loads
    torch_dtype, dtype_name, calibrations = _check_before_loading(resolved, calibration, data_path, dtype, device)
    commit = _git_commit()  # the tree the run starts from (it may change while a long run goes on)
    data_spec = os.fspath(data) if isinstance(data, os.PathLike) else data
    prompts = _prompt_source(data_spec, data_path)  # a wrong text fails here, before the model loads
    model_spec = model
    model, tokenizer, model_name, model_fp = _load_checked_model(
        model, torch_dtype, device, calibrations, lambda config: check_schemes_fit(resolved, config)
    )  # a scheme the config rules out (groups not dividing head_dim) is refused before the weights load
    head = _head(model)
    check_context_fits(model.config, contexts[-1] + warmup + tokens)
    dev = next(model.parameters()).device
    n_layers, _, kv_heads, head_dim = attention_shape(model.config)
    check_cache_holds(model, "kvbits speed")
    check_schemes_fit(resolved, model.config)
    if static:
        refused = static_refusals(resolved, n_layers)
        if refused:
            raise ValueError("static=True: StaticQuantizedKVCache does not hold " + "; ".join(
                f"{name!r} ({why})" for name, why in refused.items()) + "; QuantizedKVCache serves them (static=False)")
        check_static_model(model, resolved, contexts[0] + warmup + tokens)
    if graphs:
        from transformers import StaticCache

        from kvbits.evaluate.graphs import graph_reason, state_reason

        # a hybrid model's states (the baseline StaticCache's layers: made lazily, nothing reserved), then the device
        probe = StaticCache(config=model.config, max_cache_len=contexts[0] + warmup + tokens)
        holder = f"{type(model).__name__} (held by StaticQuantizedKVCache and the StaticCache baseline)"
        why = state_reason(probe, holder) or graph_reason(dev)
        if why is not None:
            raise ValueError(f"graphs=True: {why}")
    can_fuse = fuses(model, fused_mode, dev)
    fused = {s.name: not isinstance(s, PeerScheme) and can_fuse for s in resolved}
    baselines = [BASELINE, STATIC_BASELINE] if static else [BASELINE]

    runs: list[dict[str, Any]] = []
    fps: dict[tuple[int, int], str] = {}
    data_name = "tokens"
    bos_id: int | None = None
    prefill_warm = decode_warm = False
    t_wall = time.perf_counter()
    total = len(contexts) * len(batches) * (len(baselines) + len(resolved))
    with _progress(progress, total) as bar, sdpa_backends(sdpa):
        job = bar.add_task("speed", total=total) if bar is not None else None
        for context in contexts:
            for batch in batches:
                ids, distinct, data_name, fps[(context, batch)], bos_id = _prompts(
                    prompts, tokenizer, context, batch, data_path, model, bos
                )
                caches = [None, *([STATIC_BASELINE] if static else []), *resolved]
                cell = {"context": context, "batch": batch, "cached_tokens": context + warmup + tokens,
                        "distinct_rows": distinct}  # fmt: skip

                def path_of(scheme: Any) -> str:
                    name = _cache_name(scheme)
                    ws = workspace and scheme is not None and not fused.get(name, False)  # unread by fused
                    return _path(scheme, fused.get(name, False), ws, static, graphs)

                kv = None
                try:
                    ids = ids.to(dev)
                    if not prefill_warm:  # the process's first prefill (lazy set-up, allocations) is timed by no cell
                        prefill_kv(model, ids[:, : min(context, PREFILL_WARMUP)])
                        _sync(dev)
                        prefill_warm = True
                    t0 = time.perf_counter()
                    hidden, kv = prefill_kv(model, ids)
                    # the first generated token, from the exact prefill (shared by every run)
                    with torch.no_grad():
                        first = head(hidden[:, -1]).argmax(-1, keepdim=True)
                    _sync(dev)
                    prefill_s = time.perf_counter() - t0
                    del hidden
                except Exception as exc:  # noqa: BLE001 - the prefill: every run of the cell fails with it, recorded
                    err, kv = run_error(exc), None
                    free_device(dev)
                    for scheme in caches:
                        runs.append(failed_run(_cache_name(scheme), path_of(scheme), cell, err, None))
                        if bar is not None:
                            bar.update(job, advance=1)
                    logger.error("speed: context %d, batch %d: the prefill failed (%s: %s); its %d runs are recorded "
                                 "as failed", context, batch, err["type"], err["message"], len(caches))  # fmt: skip
                    continue
                ref = None
                if not decode_warm:  # the process's first decode (allocations, lazy set-up) is timed by no run
                    try:
                        _run_one(model, None, kv, first, None, batch=batch, context=context, tokens=1, warmup=warmup,
                                 calibration=None, fused=False, workspace=False)  # fmt: skip
                        decode_warm = True
                    except Exception as exc:  # noqa: BLE001 - the baseline's own run says why; warmed at the next cell
                        logger.warning("speed: the warm-up decode at context %d, batch %d failed (%s)", context, batch,
                                       run_error(exc)["type"])  # fmt: skip
                        free_device(dev)
                for scheme in caches:
                    name = _cache_name(scheme)
                    if bar is not None:
                        bar.update(job, description=f"speed {name} {context} x {batch}")
                    try:
                        rec = _run_one(
                            model, scheme, kv, first, None if ref is None else ref["tokens"], batch=batch,
                            context=context, tokens=tokens, warmup=warmup,
                            calibration=calibrations.get(name), fused=fused.get(name, False),
                            workspace=workspace and scheme is not None and not fused.get(name, False),  # unread by fused
                            reserve=reserve, static=static, graphs=graphs,
                        )  # fmt: skip
                    except Exception as exc:  # one run, recorded; not KeyboardInterrupt, which still stops it
                        err = run_error(exc)
                        free_device(dev)
                        runs.append(failed_run(name, path_of(scheme), cell, err, round(prefill_s, 3)))
                        logger.error("speed %s: context %d, batch %d failed: %s: %s", name, context, batch,
                                     err["type"], err["message"])  # fmt: skip
                        logger.debug("speed %s: context %d, batch %d", name, context, batch, exc_info=True)
                        if bar is not None:
                            bar.update(job, advance=1)
                        continue
                    rec["prefill_seconds"] = round(prefill_s, 3)
                    rec["distinct_rows"] = distinct
                    if scheme is None:
                        ref = rec
                    if ref is None:  # the baseline failed at this cell: nothing to divide by or compare with
                        rec["speedup"] = rec["agreement"] = rec["first_divergence"] = None
                    else:
                        # from the step times: tokens/s are rounded to 0.01, 1 % of a 0.5 tokens/s CPU run
                        rec["speedup"] = (significant(ref["ms_per_step"] / rec["ms_per_step"], 4)
                                          if rec["ms_per_step"] > 0 else math.inf)  # fmt: skip
                    runs.append(rec)
                    logger.info("speed %s: context %d, batch %d: %.3f ms/step, %.1f tokens/s (%sx)", name,
                                context, batch, rec["ms_per_step"], rec["tokens_per_s"], rec["speedup"])  # fmt: skip
                    if bar is not None:
                        bar.update(job, advance=1)
                del kv
    for rec in runs:
        rec.pop("tokens", None)
    # no "N of M runs failed" line here: each failure was logged as it happened, and `kvbits speed` closes with
    # that count (after writing the report) -- logged here too, the command line said it twice
    longest = contexts[-1] + warmup + tokens
    mismatch = {s.name: _mismatch({}, calibrations.get(s.name), longest, "stream") for s in resolved}
    for name, m in mismatch.items():
        _warn_mismatch(name, m, longest)
    shape = plan_shape_of(model.config, model)
    return {
        "version": SPEED_VERSION,
        "model": _model_arg(model_spec, model_name),
        "data": "tokens" if isinstance(data, torch.Tensor) else _data_arg(data_spec, data_name),
        **bos_record(tokenizer, bos_id),  # "bos", and with a BOS its "bos_token" / "bos_token_id"
        "device": {"type": dev.type, "name": _device_name(dev), "threads": torch.get_num_threads()},
        "layers": n_layers,
        "dtype": _run_dtype(model, dtype_name),
        "contexts": contexts,
        "batches": batches,
        "tokens": tokens,
        "warmup": warmup,
        "fused_decode": fused_decode,
        "workspace": workspace,
        "reserve": reserve,
        "static": static,
        "graphs": graphs,
        "baselines": baselines,
        "sdpa": sdpa,
        "kernel_settings": settings,
        "tuned_launches": autotune.chosen_launches(since=launches_before) if settings["autotune"] == "on" else {},
        "schemes": [
            {
                "scheme": s.name,
                "avg_bits": long_run_avg_bits(s, shape, head_dim, kv_heads, n_layers, dtype_bytes=model_dtype_bytes(model)),
                "peer": isinstance(s, PeerScheme),
                "path": _path(s, fused[s.name], workspace, static, graphs),
                "calibration": mismatch[s.name],
            }
            for s in resolved
        ],
        "runs": runs,
        "fingerprint": {"model": model_fp, "prompts": {f"{c}x{b}": fp for (c, b), fp in fps.items()}},
        "wall_seconds": time.perf_counter() - t_wall,
        "peak_rss_bytes": _peak_rss_bytes(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "versions": _versions(),
    }
