"""Step 6: greedy decode tokens/s after a long prompt through a random-weight Qwen2.5-0.5B-shaped model, per
cache (``DynamicCache``, ``QuantizedKVCache`` fused and dequantizing, transformers' ``QuantizedCache``), with
the bytes each cache holds on the GPU against ``kvbits.plan``.

``DynamicCache`` runs twice: with SDPA as torch picks its backend (``dynamic-fp16``), and with cuDNN's backend
left out (``dynamic-fp16-no-cudnn``: flash, memory-efficient or math). §6z's H200 profile put its decode SDPA on
cuDNN (``aten::_cudnn_attention_forward``), and torch builds a cuDNN graph per sequence length unless
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (pytorch/pytorch#155958): a decode step attends over one more token than the
last, so each step may build a graph on the host, a cost kvbits' fused decode steps (no SDPA) never pay. The
faster of the two is the fairer fp16 baseline (``speedup_vs_best_fp16``).

``static-fp16-graphs`` (only when ``--e2e-runs`` names it): transformers' own fast fp16 decode, a ``StaticCache``
with the decode steps through ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs; the prompt runs
eagerly). It takes the host out of the loop, which no kvbits cache can do yet (its ``update`` runs eagerly inside
a compiled model, BENCHMARKS.md §6 session 47), so it says what a host-bound kvbits step gives up. It is not
among the fp16 baselines of ``speedup_vs_best_fp16``, which compare caches under the same eager loop.

``kvbits-static-fused`` and ``kvbits-static-graphs`` (only when named, schemes ``E2E_STATIC``, or any of
``E2E_KVBITS`` named as ``cache:scheme``, e.g. ``kvbits-static-graphs:kvquant-4-block``): kvbits'
``StaticQuantizedKVCache`` (fixed slabs, lengths on the device), fused decode steps run eagerly, and the
same steps replayed from one captured CUDA graph (``gpu_bench.graphs.GraphedDecode``): kvbits' answer to
``static-fp16-graphs``. Their bytes are the slabs reserved for ``e2e_reserve`` tokens, planned at that context."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from kvbits.evaluate.sdpa import sdpa_backends

from .common import RESIDUAL, Config, install_stand_ins, out_of_time, sync

# decode after a 32K-token prompt (the context), batches 1 and 8, 4 warm-up + 32 timed steps
E2E_CONTEXT, E2E_BATCHES, E2E_TOKENS, E2E_WARMUP = 32768, (1, 8), 32, 4
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
# fused runs reserve their quantized storage for the whole run (max_cache_len, as a server reserves a request);
# these schemes also run growing (no reservation: per-token flushes copy the layer's codes at every step)
E2E_GROWING = ("int8-token",)


DYNAMIC = ("dynamic-fp16", "dynamic-fp16-no-cudnn")  # DynamicCache: SDPA's backends as torch picks them; no cuDNN
STATIC_GRAPHS = "static-fp16-graphs"  # StaticCache + torch.compile(mode="reduce-overhead"): run only when named
STATIC_KVBITS = ("kvbits-static-fused", "kvbits-static-graphs")  # StaticQuantizedKVCache: eager, one captured step
E2E_STATIC = ("int8-token", "kivi-4")  # their schemes: per-token, and KIVI's window (§6z's headline scheme)
OPT_IN = (STATIC_GRAPHS, *STATIC_KVBITS)
FP16_CACHES = (*DYNAMIC, STATIC_GRAPHS)  # transformers' caches of plain fp16 K/V (bytes: every layer's keys and values)


def e2e_reserve(context: int, tokens: int, warmup: int) -> int:
    """``max_cache_len`` of a step-6 kvbits run: the prompt, ``warmup + tokens`` steps and the profiled one."""
    return context + warmup + tokens + 1


def e2e_model(
    cfg: Config, context: int, tokens: int, dtype: torch.dtype | None = None, layers: int | None = None
) -> torch.nn.Module:
    """Random-weight Qwen2 model (``dtype``; default fp16 on CUDA, float32 on CPU), built on the device;
    ``layers``: that many decoder layers instead of the shape's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(E2E_MODEL["smoke" if cfg.smoke else "full"])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = Qwen2Config(max_position_embeddings=context + tokens + 64, **shape)
    torch.manual_seed(0)
    with cfg.device:
        model = Qwen2ForCausalLM(config)
    if dtype is None:
        dtype = torch.float16 if cfg.device.type == "cuda" else torch.float32
    model = model.to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


# step (2c): a growing cache's slot count changes parity at every step (its one-scale-per-token rows are read as words
# across half-word slabs every other step, _token_words(ODD=True)), while the reservation (e2e_reserve: 326 slots)
# reads whole words at every step, as step 6's did in §6z
GROWING_CHECK = {"scheme": "int8-token", "context": 301, "tokens": 24, "batch": 2, "layers": 2}


@torch.no_grad()
def growing_vs_reserved(cfg: Config, scheme: str = "int8-token", context: int = 301, tokens: int = 24,
                        batch: int = 2, layers: int = 2, dtype: torch.dtype | None = None,
                        checks: str = "auto") -> dict:  # fmt: skip
    """Step (2c): greedy decode of ``tokens`` steps after a ``context``-token random prompt through step 6's model
    (``layers`` of its layers), once with a growing ``QuantizedKVCache`` and once with quantized storage reserved
    for the whole run (``e2e_reserve``), both fused. The two hold the same codes in differently sized slabs, so their logits should be
    equal bit for bit: §6z's growing cache decoded other tokens than the reserved one (session 41 traced that to
    the growing cache alternating word and 2-byte scale reads; both now read words). Off CUDA the fused steps take
    the Triton interpreter when ``cfg.kernel`` is ``triton``, else the torch reference. ``dtype``: the model's
    (``e2e_model``'s default: float16 on CUDA, float32 elsewhere); ``checks``: the caches' K/V checks
    (``kvbits_cache``; ``"lazy"`` for ``prewarm``'s compile-only runs, whose outputs are never written).

    Returns ``{scheme, context, tokens, batch, layers, fused_steps (growing, reserved), greedy_tokens_equal,
    logits_bit_identical, logits_max_diff, first_diff_step}`` (``first_diff_step``: the first decode step whose
    logits differ, or ``None``)."""
    import os

    from kvbits.cache import use_fused_decode

    model = e2e_model(cfg, context, tokens, dtype=dtype, layers=layers)
    use_fused_decode(model)
    gen = torch.Generator(device=cfg.device).manual_seed(context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=cfg.device, generator=gen)
    force = cfg.device.type != "cuda" and cfg.kernel == "triton" and "KVBITS_KERNEL" not in os.environ
    if force:
        os.environ["KVBITS_KERNEL"] = "triton"
    runs = {}
    try:
        for name, reserve in (("growing", None), ("reserved", e2e_reserve(context, tokens, 0))):
            cache = kvbits_cache(model, scheme, True, checks=checks, max_cache_len=reserve)
            r = decode_run(cfg, model, cache, ids, tokens, 0, profile=False, keep_logits=True)
            runs[name] = (r["logits"], cache.fused_report()["fused_steps"])
    finally:
        if force:
            del os.environ["KVBITS_KERNEL"]
    (grow, grow_steps), (res, res_steps) = runs["growing"], runs["reserved"]
    differ = [i for i in range(tokens) if not torch.equal(grow[i], res[i])]
    return {"scheme": scheme, "context": context, "tokens": tokens, "batch": batch, "layers": layers,
            "fused_steps": [grow_steps, res_steps],
            "greedy_tokens_equal": torch.equal(grow.argmax(-1), res.argmax(-1)),
            "logits_bit_identical": not differ, "logits_max_diff": float((grow - res).abs().max()),
            "first_diff_step": differ[0] if differ else None}  # fmt: skip


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
def decode_run(
    cfg: Config, model, cache, ids: torch.Tensor, tokens: int, warmup: int, profile: bool = True,
    keep_logits: bool = False, step_model: Callable | None = None,
) -> dict:
    """Prefill ``ids`` then ``warmup + tokens`` greedy steps; times the last ``tokens`` steps; ``profile``: one
    more step under ``torch.profiler`` (``profile_step``). ``steps``: the decode steps taken in all.
    ``final_sync_ms``: how long the device sync after the last step waited. The steps are not synchronised one by
    one, so a GPU slower than the host leaves work queued there (up to the launch queue's depth) and this wait is
    long; near 0, the GPU had kept up and the steps were bound by the host.
    ``keep_logits``: also ``logits``, the timed steps' float32 logits ``(tokens, B, V)``.
    ``step_model``: what runs the decode steps (a compiled ``model``), which then get their ``cache_position``
    (a ``(1,)`` tensor, as ``generate`` passes it); default ``model``, which also runs the prompt."""
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    generated, logits = [], []
    position = ids.shape[1]

    def step(tok: torch.Tensor):
        nonlocal position
        extra = {}
        if step_model is not None:
            extra["cache_position"] = torch.full((1,), position, dtype=torch.long, device=tok.device)
        position += 1
        forward = model if step_model is None else step_model
        return forward(tok, **{kw: cache}, use_cache=True, logits_to_keep=1, **extra)

    for i in range(warmup + tokens):
        if i == warmup:
            sync(cfg.device)
            t0 = time.perf_counter()
        out = step(nxt)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(nxt)
        if keep_logits and i >= warmup:
            logits.append(out.logits[:, -1].float())
    t_host = time.perf_counter()
    sync(cfg.device)
    t_end = time.perf_counter()
    seconds = t_end - t0
    B = ids.shape[0]
    out = {"ms_per_step": round(1e3 * seconds / tokens, 3), "tokens_per_s": round(B * tokens / seconds, 1),
           "final_sync_ms": round(1e3 * (t_end - t_host), 3),
           "tokens": torch.cat(generated, 1)[:, warmup:].cpu(), "steps": warmup + tokens}  # fmt: skip
    if keep_logits:
        out["logits"] = torch.stack(logits)
    if profile:
        out["profile"] = profile_step(cfg, lambda: step(nxt))
        out["steps"] += 1
    return out


def profile_step(cfg: Config, step: Callable[[], object], top: int = 10) -> dict:
    """One decode ``step()`` under ``torch.profiler``, after the timed ones: where its time goes.

    Returns ``wall_ms`` (the step, profiler overhead included), ``device_ms`` (the sum of the kernels' own
    time on CUDA, ``None`` elsewhere) and ``top``: the ``top`` operators by self time on the device (CUDA)
    or on the CPU, each ``{name, calls, self_ms}``. The first H200 run found 27-62 ms per step where its
    sweep puts attention at <= 2.4 ms: a device total far below the wall time means the step waits on the
    host (Python, launches, synchronisations), not on the GPU. So also ``host_ms`` (the operators' own time on the
    CPU, summed) and ``top_host``: the ``top`` operators by that time, which name what the host waits on (a cuDNN
    graph built in ``aten::_cudnn_attention_forward``, a launch, a copy that synchronises).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = cfg.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(cfg.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync(cfg.device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def self_us(e) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    def host_us(e) -> float:
        return float(e.self_cpu_time_total)

    def ranked(key: Callable) -> list[dict]:
        return [{"name": e.key[:80], "calls": e.count, "self_ms": round(key(e) / 1e3, 4)}
                for e in sorted(events, key=key, reverse=True)[:top]]  # fmt: skip

    device_ms = round(sum(self_us(e) for e in events) / 1e3, 3) if cuda else None
    return {"wall_ms": round(1e3 * wall, 3), "device_ms": device_ms, "top": ranked(self_us),
            "host_ms": round(sum(host_us(e) for e in events) / 1e3, 3), "top_host": ranked(host_us)}  # fmt: skip


def kvbits_cache(model, scheme: str, fused: bool, checks: str = "auto", max_cache_len: int | None = None):
    """The ``QuantizedKVCache`` of one step-6 run: ``fused`` decode steps (``use_fused_decode`` on the model)
    or dequantize + SDPA; what an artifact would install comes from stand-ins (``install_stand_ins``). Off CUDA ``fused`` forces the fused path (the
    torch reference, or Triton under ``KVBITS_KERNEL=triton``); on CUDA ``"auto"`` must pick the kernel.
    ``checks="auto"`` checks incoming K/V lazily on CUDA (no sync per step), eagerly on CPU.
    ``max_cache_len``: reserved quantized storage (``e2e_reserve``), ``None`` for a growing cache."""
    from kvbits.cache import QuantizedKVCache

    mode = (True if model.device.type == "cpu" else "auto") if fused else False
    cache = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=mode, checks=checks,
                             max_cache_len=max_cache_len)  # fmt: skip
    c = model.config
    install_stand_ins(cache, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    return cache


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


E2E_CACHES = (*DYNAMIC, "kvbits-fused", "kvbits-fused-growing", "kvbits-dequant-sdpa", "hf-quantized-quanto",
              "hf-quantized-fp8", *OPT_IN)  # fmt: skip


class E2EFailure(RuntimeError):
    """A step-6 run that did not do what it measures (the fused path not taken on every step): recorded as the
    run's ``failure`` and printed, and step 6 goes on; ``gpu_decode.py`` exits non-zero once every step ran."""


def _static_note(name: str, cache, steps: int, graphed) -> str:
    """What a ``STATIC_KVBITS`` run did; ``E2EFailure`` unless every layer was claimed by the fused path with no
    fallback and, run eagerly, attended every decode step through it (a graph's replays run no Python: its layers
    count the eager steps and the captured one)."""
    layers = cache.layers
    fused = sum(layer.fused.steps for layer in layers)
    python_steps = steps if graphed is None else graphed.calls - graphed.replays
    if not all(layer.fused.claimed for layer in layers) or any(layer.fused.fallbacks for layer in layers) \
            or fused != python_steps * len(layers):
        raise E2EFailure(f"E2E FAILURE: {name}: {fused} fused layer steps (want {python_steps * len(layers)}), claimed "
                         f"{[layer.fused.claimed for layer in layers]}, fallbacks {[layer.fused.fallbacks for layer in layers]}")  # fmt: skip
    if graphed is None:
        return f"{fused} fused steps; StaticQuantizedKVCache"
    return (f"StaticQuantizedKVCache; {graphed.eager} eager decode steps, then {graphed.replays} of {steps - graphed.eager} "
            f"replayed from {len(graphed.captured_at)} captured step(s) (at calls {sorted(graphed.captured_at.values())})")


def wanted_runs(only: list[str] | None) -> Callable[[str, object], bool]:
    """Whether step 6 runs cache ``name`` with ``scheme``: every run without ``only``, else those it names as
    ``cache`` or ``cache:scheme`` (``kvbits-fused:kivi-4``, ``hf-quantized-quanto:2``). The ``OPT_IN`` runs
    only when named.

    Raises:
        ValueError: a cache name not in ``E2E_CACHES``."""
    bad = [o for o in only or [] if o.partition(":")[0] not in E2E_CACHES]
    if bad:
        raise ValueError(f"unknown step-6 caches {bad}; expected cache or cache:scheme, cache one of {E2E_CACHES}")

    def wanted(name: str, scheme: object) -> bool:
        if not only:
            return name not in OPT_IN
        return any(n == name and s in ("", str(scheme)) for n, _, s in (o.partition(":") for o in only))

    return wanted


def end_to_end(
    cfg: Config,
    context: int,
    batches: list[int],
    tokens: int,
    warmup: int,
    progress: Callable[[list[dict]], None] | None = None,
    only: list[str] | None = None,
) -> list[dict]:
    """Step (6): decode tokens/s per cache at ``context``; a run whose fused path was not taken on every decode
    step of every layer gets a ``failure`` instead of its figures, and the others still run. A run that raises
    gets ``skipped`` with the error; a transformers ``QuantizedCache`` backend that failed once (quanto builds a
    CUDA extension on first use) is not tried again. On CUDA each kvbits and ``DynamicCache`` run also
    records the bytes its cache holds on the device after the run (``resident_bytes``: allocated now
    minus before the cache was made, the generated logits freed; a graph run's graphs freed first, what they held
    is ``graph_bytes``) against ``kvbits.plan`` (``planned_bytes``), and the run's peak above that baseline
    (``peak_bytes``: activations included). A run whose row raises (the pending K/V check) gets a ``failure``.
    Runs not started by ``cfg.deadline`` are skipped and say so; ``progress(rows)`` after each run. ``only``:
    just these runs (``wanted_runs``; a second device call that measures transformers' ``QuantizedCache``
    peers, which come last and which a full step 6 has never reached within its budget)."""
    wanted = wanted_runs(only)
    from kvbits.cache import use_fused_decode

    model = e2e_model(cfg, context, tokens)
    n_layers = model.config.num_hidden_layers
    rows = []
    prompts, fused_by_batch = {}, {}
    for batch in batches:
        gen = torch.Generator(device=cfg.device).manual_seed(batch)
        prompts[batch] = torch.randint(
            0, model.config.vocab_size, (batch, context), device=cfg.device, generator=gen
        )
        fused_by_batch[batch] = {}
    # kvbits and DynamicCache at every batch first; transformers' QuantizedCache last (its quanto backend may
    # compile CUDA extensions on first use: it must not take the time of the runs the issue is about)
    runs = [(batch, name, scheme, how) for batch in batches for name, scheme, how in
            [(d, "fp16", None) for d in DYNAMIC] + [("kvbits-fused", s, True) for s in E2E_KVBITS]
            + [("kvbits-fused-growing", s, True) for s in E2E_GROWING]
            + [("kvbits-dequant-sdpa", "kivi-4", False)]]  # fmt: skip
    named = set(only or [])  # a static run of another scheme: only when named with it
    runs += [(batch, name, s, True) for batch in batches for name in STATIC_KVBITS for s in E2E_KVBITS
             if s in E2E_STATIC or f"{name}:{s}" in named]  # fmt: skip
    runs += [(batch, f"hf-quantized-{b}", n, b) for batch in batches for b, n in E2E_HF]
    runs += [(batch, STATIC_GRAPHS, "fp16", None) for batch in batches]  # last: its compile may take a while
    runs = [r for r in runs if wanted(r[1], r[2])]
    failed_backends: dict[str, str] = {}  # transformers QuantizedCache backend -> why its first run failed
    for batch, name, scheme, how in runs:
        ids, fused_tokens = prompts[batch], fused_by_batch[batch]
        note = None
        if name.startswith("hf-quantized") and how in failed_backends:
            rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                         "skipped": f"the {how} backend failed before: {failed_backends[how]}"})  # fmt: skip
            print(f"  e2e {name:20s} skipped: the {how} backend failed before")
            continue
        if out_of_time(cfg):
            rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                         "skipped": "time budget (--budget-s)"})  # fmt: skip
            print(f"  e2e {name:20s} skipped: time budget")
            continue
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(cfg.device)
        base = _allocated(cfg)
        cache = None
        try:  # building the cache too: a run that can not even start is a result, not the end of step 6
            step_model = None
            if name == STATIC_GRAPHS:
                from transformers import StaticCache

                model.set_attn_implementation("sdpa")
                torch._dynamo.reset()
                cache = StaticCache(config=model.config, max_cache_len=e2e_reserve(context, tokens, warmup))
                step_model = torch.compile(model, mode="reduce-overhead", fullgraph=True)
                note = "StaticCache, decode steps through torch.compile(mode='reduce-overhead'); not an eager-loop baseline"
            elif name in DYNAMIC:
                from transformers import DynamicCache

                model.set_attn_implementation("sdpa")
                cache = DynamicCache(config=model.config)
                if name == "dynamic-fp16-no-cudnn":
                    note = "SDPA without its cuDNN backend (flash, memory-efficient or math)"
            elif name in STATIC_KVBITS:
                from kvbits.cache import StaticQuantizedKVCache

                use_fused_decode(model)
                mode = True if model.device.type == "cpu" else "auto"
                cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, fused_decode=mode, checks="lazy",
                                               max_cache_len=e2e_reserve(context, tokens, warmup))  # fmt: skip
                c = model.config
                install_stand_ins(cache, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
                if name == "kvbits-static-graphs":
                    from .graphs import GraphedDecode

                    step_model = GraphedDecode(model)
            elif name.startswith("kvbits"):
                if how:
                    use_fused_decode(model)
                else:
                    model.set_attn_implementation("sdpa")
                reserve = None if name == "kvbits-fused-growing" else e2e_reserve(context, tokens, warmup)
                cache = kvbits_cache(model, scheme, how, max_cache_len=reserve)
            else:
                model.set_attn_implementation("sdpa")
                cache, note = _hf_cache(model.config, how, scheme)
                scheme = f"{how}-int{scheme}" if scheme else how
                if cache is None:
                    rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context,
                                 "skipped": note})  # fmt: skip
                    print(f"  e2e {name:20s} skipped: {note}")
                    continue
            with sdpa_backends("no-cudnn" if name == "dynamic-fp16-no-cudnn" else "auto"):
                r = decode_run(cfg, model, cache, ids, tokens, warmup, step_model=step_model)
        except Exception as exc:  # noqa: BLE001 - e.g. an HF backend failing on this device; the next runs go on
            why = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append({"cache": name, "scheme": scheme, "batch": batch, "context": context, "skipped": why})
            print(f"  e2e {name:20s} failed: {exc}")
            if name.startswith("hf-quantized"):
                failed_backends[how] = why
            del cache
            continue
        try:  # a raise while the row is made (a NaN/inf found by the pending K/V check in memory_report()) too
            graphed, held = _graph_counts(step_model), (_allocated(cfg) if step_model is not None else None)
            step_model = None  # the last reference: the graphs' pool is freed with it (_graph_bytes)
            graph_bytes = _graph_bytes(cfg, name, held)
            row = _finish(cfg, model, name, scheme, how, batch, context, cache, r, base, graphed, note,
                          fused_tokens, n_layers, graph_bytes)  # fmt: skip
        except E2EFailure as exc:
            row = {"cache": name, "scheme": scheme, "batch": batch, "context": context, "failure": str(exc)}
            print(f"  {exc}")
        except Exception as exc:  # noqa: BLE001 - the run decoded, its figures could not be read: recorded, go on
            why = f"E2E FAILURE: {name} {scheme}: its row raised {type(exc).__name__}: {str(exc)[:160]}"
            row = {"cache": name, "scheme": scheme, "batch": batch, "context": context, "failure": why}
            print(f"  {why}")
        rows.append(row)
        del cache
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(speedups(rows))
    model.set_attn_implementation("sdpa")
    return speedups(rows)


def speedups(rows: list[dict]) -> list[dict]:
    """``rows`` with each timed row's speed-ups against the runs of its batch so far: ``speedup_vs_fp16``
    (``dynamic-fp16``), ``speedup_vs_best_fp16`` (the faster of ``DYNAMIC``) and ``speedup_vs_static_graphs``
    (transformers' CUDA-graph fp16 decode, which runs last), ``None`` where that run has no time.

    Ratios of ``ms_per_step`` (at one batch the inverse ratio of tokens/s): ``tokens_per_s`` is rounded to 0.1,
    which moved §6z's kivi-4 at batch 1 from 1.621x to 1.615x. Taken once every run of the batch is known: the
    first ``DynamicCache`` run's row said 1.0x against the faster of the two even when the cuDNN-free run after
    it was twice as fast."""
    timed = [r for r in rows if "ms_per_step" in r]

    def fastest(batch: int, caches: tuple[str, ...]) -> float | None:
        ms = [r["ms_per_step"] for r in timed if r["batch"] == batch and r["cache"] in caches]
        return min(ms) if ms else None

    for r in timed:
        for key, caches in (("speedup_vs_fp16", DYNAMIC[:1]), ("speedup_vs_best_fp16", DYNAMIC),
                            ("speedup_vs_static_graphs", (STATIC_GRAPHS,))):  # fmt: skip
            ms = fastest(r["batch"], caches)
            r[key] = round(ms / r["ms_per_step"], 3) if ms else None
    return rows


def _graph_counts(step_model) -> SimpleNamespace | None:
    """A ``GraphedDecode``'s counts (``calls, replays, eager, captured_at``: what ``_static_note`` reads), kept
    while the graph runner itself is dropped before the cache's bytes are read (``_graph_bytes``); else ``None``."""
    if not hasattr(step_model, "replays"):
        return None
    return SimpleNamespace(calls=step_model.calls, replays=step_model.replays, eager=step_model.eager,
                           captured_at=dict(step_model.captured_at))  # fmt: skip


def _graph_bytes(cfg: Config, name: str, held: int | None) -> int | None:
    """Free a graph run's captured steps, once the caller has dropped its runner, and return the bytes that freed
    (``held``: allocated before; ``None`` off CUDA or for a run without graphs). A ``GraphedDecode`` holds each
    captured variant's logits ``(B, 1, V)`` in its graph's pool, torch.compile's CUDA-graph trees hold their outputs
    (``cached_tensor_outputs``) and recorded inputs: read with them alive, ``resident_bytes`` counted those as the
    cache's."""
    if held is None:
        return None
    if name == STATIC_GRAPHS:
        try:  # resets the CUDA-graph trees (their pool) with dynamo's caches
            torch._dynamo.reset()
        except Exception as exc:  # noqa: BLE001 - the run's times stand; graph_bytes then says what was freed
            print(f"  e2e {name}: torch._dynamo.reset() raised {type(exc).__name__}: {exc}; its graphs may stay counted")
    gc.collect()
    return held - _allocated(cfg)


def _finish(cfg: Config, model, name: str, scheme: str, how, batch: int, context: int, cache, r: dict, base,
            graphed, note, fused_tokens: dict, n_layers: int, graph_bytes: int | None = None) -> dict:  # fmt: skip
    """The row of a step-6 run that decoded (``r``: ``decode_run``'s figures): bytes held against the plan, what the
    fused path did (``E2EFailure`` when it did not take every step); prints it. Its speed-ups: ``speedups``.
    ``graphed``: a ``GraphedDecode`` run's counts (``_graph_counts``); a graph run's graphs are freed before its bytes
    are read, ``graph_bytes`` is what they held (``_graph_bytes``)."""
    from kvbits.cache import QuantizedKVCache

    bytes_ = None
    mem = {"resident_bytes": None, "planned_bytes": None, "extra_bytes": None, "peak_bytes": None,
           "rope_table_bytes": None}  # fmt: skip
    # planned at context + steps: a StaticQuantizedKVCache's max_cache_len too (e2e_reserve)
    if name in FP16_CACHES or name in STATIC_KVBITS or isinstance(cache, QuantizedKVCache):
        mem["planned_bytes"] = _planned_bytes(model, scheme, batch, context + r["steps"], how is True)
        if base is not None:
            mem["resident_bytes"] = _allocated(cfg) - base
            mem["peak_bytes"] = torch.cuda.max_memory_allocated(cfg.device) - base
    if name in STATIC_KVBITS:
        bytes_ = cache.memory_report()["total_bytes"]  # the slabs, reserved for every e2e_reserve slot
        note = _static_note(name, cache, r["steps"], graphed)
        if scheme in fused_tokens:
            note += f"; greedy tokens equal to kvbits-fused: {torch.equal(fused_tokens[scheme], r['tokens'])}"
    elif isinstance(cache, QuantizedKVCache):
        report = cache.memory_report()
        bytes_ = report["total_bytes"]
        fr = cache.fused_report()
        # held beside the K/V, not planned: per-sequence position offsets, a dequantization workspace;
        # the float32 RoPE tables of fused pre-RoPE keys are held apart from memory_report() but planned
        mem["extra_bytes"] = report["position_bytes"] + report["workspace_bytes"]
        mem["rope_table_bytes"] = fr["rope_table_bytes"]
        want = r["steps"] * n_layers if how else 0
        if fr["fused_steps"] != want or fr["fallback_steps"]:
            raise E2EFailure(f"E2E FAILURE: {name} {scheme}: {fr['fused_steps']} fused decode steps "
                             f"(want {want}), {fr['fallback_steps']} fallbacks: {fr['layers']}")  # fmt: skip
        note = f"{fr['fused_steps']} fused steps"
        if name == "kvbits-fused-growing":
            note += "; no reservation (max_cache_len=None)"
        if how and name == "kvbits-fused":
            fused_tokens[scheme] = r["tokens"]
        elif scheme in fused_tokens:
            note += f"; greedy tokens equal to fused: {torch.equal(fused_tokens[scheme], r['tokens'])}"
    elif name in FP16_CACHES:
        bytes_ = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    row = {"cache": name, "scheme": scheme, "batch": batch, "context": context,
           "ms_per_step": r["ms_per_step"], "tokens_per_s": r["tokens_per_s"], "final_sync_ms": r["final_sync_ms"],
           "speedup_vs_fp16": None, "speedup_vs_best_fp16": None,  # speedups(), once the batch's fp16 runs are known
           "cache_bytes": bytes_, **mem, "graph_bytes": graph_bytes, "note": note, "profile": r.get("profile")}  # fmt: skip
    if mem["resident_bytes"] is not None:
        print(f"  e2e {name:20s} cache on the GPU: {mem['resident_bytes'] / 2**20:.1f} MiB held, "
              f"{mem['planned_bytes'] / 2**20:.1f} MiB planned "
              f"({mem['resident_bytes'] / mem['planned_bytes']:.3f}x) + {(mem['extra_bytes'] or 0) / 2**20:.1f} MiB "
              f"reported apart; run peak +{mem['peak_bytes'] / 2**20:.0f} MiB"
              + ("" if graph_bytes is None else f"; its graphs held {graph_bytes / 2**20:.1f} MiB, freed first"))  # fmt: skip
    print(f"  e2e {name:20s} {scheme:12s} B={batch:<3d} T={context}: {r['tokens_per_s']:9.1f} tok/s "
          f"({r['ms_per_step']:.2f} ms/step; final sync waited {r['final_sync_ms']:.2f} ms) {note or ''}")  # fmt: skip
    if r.get("profile"):
        pr = r["profile"]
        print(f"      profiled step: {pr['wall_ms']:.2f} ms wall, device {pr['device_ms']} ms; top: "
              + ", ".join(f"{t['name']} {t['self_ms']:.3f} ms x{t['calls']}" for t in pr["top"][:5]))  # fmt: skip
        print(f"      host {pr['host_ms']:.2f} ms; top: "
              + ", ".join(f"{t['name']} {t['self_ms']:.3f} ms x{t['calls']}" for t in pr["top_host"][:5]))  # fmt: skip
    return row
