"""Host time of one decode step per cache, on a model too small to compute much (CPU, one thread).

    PYTHONPATH=src python benchmarks/host_overhead.py [--layers 24] [--steps 20] [--launch] [--repeat 3]
        [--dtype float16] [--checks lazy|eager] [--scheme kivi-4] [--reserve] [--compile [--recompile-limit 64]]

A 24-layer Qwen2-shaped model (hidden 128, 14 query heads, 2 KV heads, head dim 64: the e2e step's heads)
decodes after a 256-token prompt and untimed steps (3, then one flush block of the scheme) through ``DynamicCache``,
``QuantizedKVCache`` dequantizing ``--scheme`` (kivi-4), and the fused path (its torch reference off CUDA). With so little arithmetic the per-step times are mostly the
Python of transformers and of each cache: a lead for the end-to-end step times of BENCHMARKS.md §6.

``--launch`` adds ``DynamicCache`` with an attention function that returns zeros, and two runs of the fused path
that isolate what a GPU step adds on the host: ``attention zeroed``
(the cache's update and ``packed_store``, then a zero output in place of the attention: every kvbits cost but the
kernel's launch) and ``Triton launch, compiled only`` (the same, through ``dispatch`` and ``decode_attention_triton``
with Triton's own launch code, inside ``kvbits.kernels.aot.compile_only("sm_90")``: each launch binds and
specialises its arguments and finds its compiled kernel, and nothing runs; the output is zeroed). Both flush
through the Triton quantize kernel, compiled only, as a GPU would (``attention_stubbed``). Their
difference is the launch path's host time per step (kvbits' argument preparation and Triton's ``JITFunction.run``,
less the driver call itself, which needs a GPU). ``--repeat`` runs the whole set that many times (medians printed).

The kvbits caches check K/V as they do on a GPU (``--checks lazy``: ``checks="auto"`` is lazy on CUDA, eager on a
CPU, where each step's eager check waits for its maxima). After its timed steps, each run decodes one more step
under a ``TorchDispatchMode`` that counts, per layer, the torch operators that would launch device work on a GPU
(views, allocations and host reads left out), and the Triton launches: each is a kernel launch, whose host cost
on a GPU (the driver call) this CPU does not see.

``--compile`` times every run through ``torch.compile(model)`` (inductor; dynamo reset before each run, 8 untimed
steps before the flush block where there are 3, no operator counts: inductor's generated code runs outside the dispatcher). The kvbits
caches' ``update`` and the fused attention run eagerly inside the compiled model (``torch.compiler.disable``), so
the model breaks its graph at each layer's cache, and each layer's attention compiles apart (its ``layer_idx`` is a
static int): past dynamo's ``recompile_limit`` (8) the later layers' frames run eagerly, with a warning.
``--recompile-limit`` raises it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ZEROS = "host_overhead_zeros"  # the attention implementation of the "DynamicCache, attention zeroed" run


def zeros_attention(module, query: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function that attends to nothing: zeros ``(B, q, H_q, D)`` for ``query``
    ``(B, H_q, q, D)``, so a ``DynamicCache`` step's host work can be timed without its attention."""
    return torch.empty_like(query).zero_().transpose(1, 2).contiguous(), None  # one kernel, as the stubs below


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched in its block: ``kernels`` (what launches device work on a GPU) and,
    apart, ``allocations`` (``empty*``), ``views`` and ``host_reads`` (``_local_scalar_dense``: ``item()``, a sync on
    a GPU); ``kernel_ops`` names each counted kernel operator."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel_ops: collections.Counter[str] = collections.Counter()
        self.allocations = self.views = self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if func.is_view:
            self.views += 1
        elif name.startswith(("aten.empty", "aten.new_empty")):
            self.allocations += 1
        elif name.startswith("aten._local_scalar_dense"):
            self.host_reads += 1
        else:
            self.kernel_ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(self.kernel_ops.values())


@contextlib.contextmanager
def triton_launches() -> Iterator[list[int]]:
    """Counts Triton kernel launches (``JITFunction.run`` calls) in the block into the yielded one-element list."""
    from triton.runtime.jit import JITFunction

    count = [0]
    real = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(self, *args, **kwargs)

    with mock.patch.object(JITFunction, "run", run):
        yield count


@contextlib.contextmanager
def attention_stubbed(launch: bool) -> Iterator[None]:
    """Fused decode steps whose attention output is zeros, and flushes through the Triton quantize kernel as on a
    GPU (``KVBITS_KERNEL=triton``), compiled for sm_90 and not run (``aot.compile_only``: the codes flushed in the
    block are never written, and never read, since the attention is zeroed and the K/V checks read the incoming
    K/V; the prompt, whose attention reads what it flushes, runs before the block, in torch).
    ``launch=False`` replaces the decode attention outright; ``launch=True`` goes through the Triton decode path,
    compiled only, then zeroes the unwritten output. The two runs differ by the decode launch path alone."""
    from kvbits.kernels import aot, dispatch

    with aot.compile_only("sm_90"), mock.patch.dict(os.environ, {dispatch.KERNEL_ENV: "triton"}):
        if not launch:
            with mock.patch.object(dispatch, "resolve_kernel", lambda q, store: "reference"), \
                    mock.patch.object(dispatch, "decode_attention_reference",
                                      lambda q, store, scale=None: torch.empty_like(q).zero_()):  # fmt: skip
                yield
            return
        import kvbits.kernels.triton_decode as td

        real = td.decode_attention_triton

        def zeroed(*args, **kwargs):  # compile_only leaves the output unwritten (torch.empty)
            return real(*args, **kwargs).zero_()

        with mock.patch.object(td, "decode_attention_triton", zeroed), \
                mock.patch.object(dispatch, "resolve_kernel", lambda q, store: "triton"):  # fmt: skip
            yield


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Print (and return) milliseconds per decode step of each run, one figure per repeat."""
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--launch", action="store_true", help="also the fused path with its attention zeroed, and "
                   "through Triton's launch code compiled for sm_90 (nothing runs)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="run the set this many times; medians")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="the model's (float16: the GPU's queries; slow arithmetic on a CPU)")  # fmt: skip
    p.add_argument("--scheme", default="kivi-4", help="the kvbits caches' scheme (default kivi-4)")
    p.add_argument("--reserve", action="store_true", help="kvbits caches reserve storage for the run's tokens "
                   "(max_cache_len, as a server and gpu_decode's step 6 do); default: they grow")  # fmt: skip
    p.add_argument("--checks", choices=("lazy", "eager"), default="lazy",
                   help="the kvbits caches' K/V checks (lazy: as checks='auto' on a GPU)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="every run through torch.compile(model) (inductor)")
    p.add_argument("--recompile-limit", type=int, default=None,
                   help="with --compile: torch._dynamo.config.recompile_limit (default: torch's, 8)")  # fmt: skip
    a = p.parse_args(argv)
    if a.recompile_limit is not None:
        if not a.compile:
            p.error("--recompile-limit goes with --compile")
        torch._dynamo.config.recompile_limit = a.recompile_limit
    from transformers import AttentionInterface, DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from kvbits.cache import QuantizedKVCache, cache_kwargs, use_fused_decode
    from kvbits.schemes import get_scheme

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=a.layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval().to(getattr(torch, a.dtype))
    ids = torch.randint(0, 256, (1, 256))

    AttentionInterface.register(ZEROS, zeros_attention)

    # untimed decode steps: 3 (compiling: 8, until the recompiles settle), then one flush block, so that the first
    # flush through a kernel (its compile, or its load from Triton's cache) is not timed
    warm = (8 if a.compile else 3) + get_scheme(a.scheme).block

    def ms_per_step(cache, fused: bool, attention: str, launch: bool, stub: Any) -> tuple[float, OpCounter, int]:
        """Milliseconds per timed step, then one more step's operators (``OpCounter``) and Triton launches. The
        prompt runs before ``stub()`` is entered: its attention reads the K/V it flushes, which a stubbed
        (compiled-only) quantize kernel would leave unwritten."""
        if fused:
            use_fused_decode(model)
        else:
            model.set_attn_implementation(attention)
        forward = model
        if a.compile:
            torch._dynamo.reset()
            forward = torch.compile(model)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            kw = cache_kwargs(cache, model)
            nxt = forward(ids, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            stack.enter_context(stub())
            for i in range(warm + a.steps):
                if i == warm:
                    t0 = time.perf_counter()
                out = forward(nxt, **kw, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ms = 1e3 * (time.perf_counter() - t0) / a.steps
            ops = OpCounter()
            if a.compile:  # inductor's kernels run outside the dispatcher: no operator counts
                return ms, ops, 0
            with ops, triton_launches() if launch else contextlib.nullcontext([0]) as launches:
                model(nxt, **kw, use_cache=True, logits_to_keep=1)
        return ms, ops, launches[0]

    def quantized(fused: bool) -> QuantizedKVCache:
        reserve = 256 + warm + a.steps + 1 if a.reserve else None  # the prompt, the warm-up, timed and counted steps
        return QuantizedKVCache(config=cfg, scheme=a.scheme, fused_decode=fused, checks=a.checks, max_cache_len=reserve)

    def fused_cache() -> QuantizedKVCache:
        return quantized(True)

    def dynamic() -> DynamicCache:
        return DynamicCache(config=cfg)

    plain = contextlib.nullcontext
    zeroed_run = f"kvbits {a.scheme}, fused, attention zeroed"
    launching = f"kvbits {a.scheme}, fused, Triton launch, compiled only"
    # name: (cache, fused decode, the attention of unfused steps, what the fused steps' attention is swapped for)
    runs = {
        "DynamicCache": (dynamic, False, "sdpa", plain),
        f"kvbits {a.scheme}, dequantize + SDPA": (lambda: quantized(False), False, "sdpa", plain),
        f"kvbits {a.scheme}, fused (torch reference)": (fused_cache, True, "sdpa", plain),
    }  # fmt: skip
    if a.launch:
        runs["DynamicCache, attention zeroed"] = (dynamic, False, ZEROS, plain)
        runs[zeroed_run] = (fused_cache, True, "sdpa", lambda: attention_stubbed(False))
        runs[launching] = (fused_cache, True, "sdpa", lambda: attention_stubbed(True))
    times: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, tuple[OpCounter, int]] = {}
    for _ in range(max(1, a.repeat)):
        for name, (make, fused, attention, stub) in runs.items():
            ms, ops, launches = ms_per_step(make(), fused, attention, name == launching, stub)
            times[name].append(ms)
            counts.setdefault(name, (ops, launches))
    compiled = f", torch.compile(model), recompile_limit {torch._dynamo.config.recompile_limit}" if a.compile else ""
    print(f"{a.layers} layers, {a.dtype}, kvbits checks {a.checks}{compiled}"
          + "; per step, then per layer and step: torch operators that launch device work on a GPU (+ Triton "
          "launches), allocations, views")  # fmt: skip
    for name, t in times.items():
        ops, launches = counts[name]
        per = [x / a.layers for x in (ops.kernels, ops.allocations, ops.views)]
        line = f"{name:52s} {statistics.median(t):7.2f} ms/step (runs {', '.join(f'{x:.2f}' for x in t)})"
        if not a.compile:
            line += (f"; ops/layer {per[0]:.1f}" + (f" + {launches / a.layers:.1f} Triton" if launches else "")
                     + f", alloc {per[1]:.1f}, views {per[2]:.1f}")  # fmt: skip
        print(line)
    if a.launch and not a.compile:
        base = counts["DynamicCache, attention zeroed"][0].kernel_ops
        extra = counts[launching][0].kernel_ops.copy()
        extra.subtract(base)
        more = ", ".join(f"{k} {v / a.layers:+.1f}" for k, v in extra.most_common() if v)
        print(f"kvbits' fused step beside DynamicCache's (attention zeroed in both), operators per layer: {more or 'none'}")
    if a.launch:
        zeroed = statistics.median(times[zeroed_run])
        launched = statistics.median(times[launching])
        print(f"launch path: {1e3 * (launched - zeroed) / a.layers:.0f} us per layer call on the host")
    return times


if __name__ == "__main__":
    main()
