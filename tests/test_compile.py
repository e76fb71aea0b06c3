"""``QuantizedKVCache`` under ``torch.compile``: the cache's ``update`` and the ``kvbits_fused`` attention run
eagerly (``torch.compiler.disable``), the model around them compiles.

Before, dynamo traced into the cache: the fused decode path crashed inside ``kvbits.kernels.reference`` (a
symbolic shape compared as a constant), and the unfused path compiled kvbits' quantizer into the model's graphs,
whose codes then followed inductor's arithmetic instead of ``kvbits.quant``'s.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _tinyllama import SMALL_KIVI, tiny_llama

import kvbits
from kvbits.cache import QuantizedKVCache, cache_kwargs, use_fused_decode

KVBITS_SOURCE = str(Path(kvbits.__file__).parent)
# the layer's length queries, which transformers' mask code calls inside the compiled model (integer arithmetic on
# the layer's host counts, as DynamicCache's own; under transformers 5.17 with a symbolic query length)
LENGTH_QUERIES = {"get_mask_sizes", "get_seq_length", "get_max_length"}
STEPS = 20  # SMALL_KIVI flushes 8-token blocks behind a 16-token window: flushes happen within these steps


def decode(forward: Callable, model: torch.nn.Module, fused: bool) -> tuple[torch.Tensor, QuantizedKVCache]:
    """Logits ``(STEPS, 1, V)`` of greedy decode steps after a 40-token prompt (batch 1), and the cache."""
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = QuantizedKVCache(model.config, SMALL_KIVI, fused_decode=fused)
    kw = cache_kwargs(cache, model)
    logits = []
    with torch.no_grad():
        out = forward(input_ids=ids, **kw, use_cache=True)
        for _ in range(STEPS):
            out = forward(input_ids=out.logits[:, -1:].argmax(-1), **kw, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fused", [False, True], ids=["dequantize", "fused"])
def test_compiled_model_keeps_the_cache_eager(fused: bool):
    """Compiled with a backend that records dynamo's graphs and runs them as traced: the decode is the eager
    one, bit for bit (logits and every stored K/V), the fused steps stay fused, and no graph holds an
    operation from kvbits' source but the layers' length queries (the cache and the fused attention ran outside
    them)."""
    model = tiny_llama()
    if fused:
        use_fused_decode(model)
    want, eager_cache = decode(model.forward, model, fused)
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    got, cache = decode(torch.compile(model.forward, backend=recording), model, fused)
    assert graphs, "dynamo compiled nothing: the test no longer looks at a compiled model"
    traced = sorted({
        line.strip() for gm in graphs for node in gm.graph.nodes
        for line in (node.meta.get("stack_trace") or "").splitlines()
        if KVBITS_SOURCE in line and line.rsplit(" in ", 1)[-1].strip() not in LENGTH_QUERIES
    })  # fmt: skip
    assert not traced, f"dynamo traced kvbits code into the model's graphs: {traced[:5]}"
    assert torch.equal(got, want)
    for layer in range(model.config.num_hidden_layers):
        for a, b in zip(cache.materialize(layer), eager_cache.materialize(layer)):
            assert torch.equal(a, b)
    assert cache.memory_report()["total_bytes"] == eager_cache.memory_report()["total_bytes"]
    fused_steps = cache.fused_report()["fused_steps"]
    assert fused_steps == (STEPS * model.config.num_hidden_layers if fused else 0)
    assert fused_steps == eager_cache.fused_report()["fused_steps"]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_inductor_compiled_fused_decode():
    """The default backend (inductor, CPU code generated and compiled): every decode step fused, logits within
    float rounding of the eager model's (inductor's K/V differ from eager's in the last bits, and the quantizer
    sees those)."""
    model = tiny_llama()
    use_fused_decode(model)
    want, _ = decode(model.forward, model, True)
    got, cache = decode(torch.compile(model), model, True)
    assert cache.fused_report()["fused_steps"] == STEPS * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_host_overhead_times_compiled_runs(capsys, monkeypatch):
    """``benchmarks/host_overhead.py --compile``: every run through ``torch.compile(model)``, times without
    operator counts (inductor's kernels bypass the dispatcher the counter watches), the recompile limit recorded;
    ``--recompile-limit`` without ``--compile`` is refused."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import host_overhead

    limit = torch._dynamo.config.recompile_limit
    try:  # (monkeypatch's undo leaves dynamo's config without the option: restored by hand)
        times = host_overhead.main(["--layers", "1", "--steps", "1", "--compile", "--recompile-limit", "16"])
    finally:
        torch._dynamo.config.recompile_limit = limit
    assert len(times) == 3 and all(len(t) == 1 and t[0] > 0 for t in times.values())
    out = capsys.readouterr().out
    assert "torch.compile(model), recompile_limit 16" in out
    assert "ops/layer" not in out
    with pytest.raises(SystemExit):
        host_overhead.main(["--recompile-limit", "16"])


def test_fullgraph_compile_says_why_it_cannot():
    """``fullgraph=True`` cannot break the graph at the cache: dynamo's error carries kvbits' reason and the remedy
    (torch's own hint says to remove the ``torch.compiler.disable`` call)."""
    from kvbits.cache.eager import EAGER_REASON

    model = tiny_llama()
    cache = QuantizedKVCache(model.config, SMALL_KIVI)
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), pytest.raises(Exception, match="compile the model without fullgraph=True") as err:
        torch.compile(model, fullgraph=True)(input_ids=ids, **cache_kwargs(cache, model), use_cache=True)
    assert EAGER_REASON in str(err.value)


def static_steps(step: Callable, model: torch.nn.Module, cache) -> torch.Tensor:
    """Logits ``(STEPS - 1, 1, V)`` of greedy decode steps through ``step`` (the model, or it compiled) after a 40-token
    prompt run by the model into ``cache`` (a ``StaticQuantizedKVCache``), each step given its position tensors as
    ``generate`` passes them."""
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    kw = cache_kwargs(cache, model)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, **kw, use_cache=True)
        for i in range(STEPS - 1):
            pos = torch.tensor([40 + i])
            out = step(input_ids=out.logits[:, -1:].argmax(-1), **kw, use_cache=True, cache_position=pos,
                       position_ids=pos[None])  # fmt: skip
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def _static_cache(model: Any, kind: str, max_cache_len: int) -> Any:
    """A ``StaticQuantizedKVCache`` of ``kind``: ``int4-token``; ``kivi``: KIVI's recipe at head dim 16, a 4-token
    window, flushes of 4 tokens (4 of them in the steps); ``kivi-prerope``: the same with keys quantized before RoPE
    (un-rotated and rotated back on the device); ``kvquant-4``: KVQuant's calibrated recipe (static pre-RoPE key
    ranges, NUQ codebooks, 1 % outliers, a sink), parameters installed as an artifact would."""
    from test_fused_cache import install

    from kvbits.cache import StaticQuantizedKVCache
    from kvbits.schemes import KVScheme, TensorSpec, get_scheme

    scheme: Any = kind
    if kind.startswith("kivi"):
        key = TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=4, pre_rope=kind == "kivi-prerope")
        scheme = KVScheme(f"{kind}-tiny", key=key, value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"),
                          residual=4, block=4)  # fmt: skip
    cache = StaticQuantizedKVCache(model.config, scheme, max_cache_len=max_cache_len)
    cfg = model.config
    install(cache, get_scheme(scheme), n_layers=cfg.num_hidden_layers, H_kv=cfg.num_key_value_heads,
            D=cfg.hidden_size // cfg.num_attention_heads)  # fmt: skip
    return cache


@pytest.mark.parametrize("kind", ["int4-token", "kivi", "kivi-prerope", "kvquant-4"])
def test_static_quantized_cache_compiles_whole_without_recompiles(kind: str):
    """``StaticQuantizedKVCache`` (``kvbits.cache.static``) is traced, not run eagerly: a decode step with SDPA over
    its dequantized slabs compiles as one graph (``fullgraph=True``), once for all steps (its lengths are device
    tensors, so nothing the graph guards on changes; a windowed scheme's flushes, pre-RoPE keys' rotations and
    KVQuant's calibrated quantizer included), with the logits of the eager steps."""
    from torch._dynamo.testing import CompileCounter

    model = tiny_llama()
    logits = {}
    counter = CompileCounter()
    for mode in ("eager", "compiled"):
        cache = _static_cache(model, kind, 40 + STEPS)
        step = model.forward if mode == "eager" else torch.compile(model.forward, fullgraph=True, backend=counter)
        logits[mode] = static_steps(step, model, cache)
        assert cache.layers[0].tokens_written == (40 + STEPS - 1 if mode == "eager" else 40)  # not counted when traced
        assert cache.layers[0].host_counts == (mode == "eager")  # so later eager steps quantize blocks at every step
    assert counter.frame_count == 1, counter.frame_count
    torch.testing.assert_close(logits["compiled"], logits["eager"], atol=1e-5, rtol=0)


def test_static_quantized_cache_under_compile_with_fused_attention():
    """A model routed through ``kvbits_fused`` and compiled (``fullgraph=False``, as transformers' ``generate`` compiles
    decode steps on CUDA when the cache is compileable): the traced cache returns the K/V themselves, untagged, so the
    eager ``kvbits_fused`` call between graphs attends over them with SDPA; the logits are those of eager fused steps
    (within float noise), and the slabs and counters are marked as static addresses for CUDA graphs."""
    from kvbits.cache import StaticQuantizedKVCache

    model = tiny_llama()
    use_fused_decode(model)
    logits = {}
    try:
        for mode in ("eager", "compiled"):
            cache = StaticQuantizedKVCache(model.config, "int4-token", max_cache_len=40 + STEPS, fused_decode=True)
            step = model.forward if mode == "eager" else torch.compile(model.forward, backend="eager")
            logits[mode] = static_steps(step, model, cache)
            steps = [layer.fused.steps for layer in cache.layers]
            assert steps == ([STEPS - 1] * 2 if mode == "eager" else [0, 0]), (mode, steps)
            from torch._dynamo.utils import get_static_address_type

            assert all(get_static_address_type(t) is not None for t in cache.layers[0].tensors())
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits["compiled"], logits["eager"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["int4-token", "kivi", "kivi-prerope", "kvquant-4"])
def test_generate_compiles_its_decode_steps_with_the_static_cache_itself(kind: str):
    """transformers' ``generate`` compiles its decode steps by itself when the cache is compileable (on CUDA; here
    ``CompileConfig._compile_all_devices``, with a counting backend in place of inductor and CUDA graphs, and
    ``fullgraph=True``, stricter than its default): with a ``StaticQuantizedKVCache`` every decode step runs through one
    compiled frame, and the greedy tokens and logits are those ``generate`` decodes eagerly through the same cache."""
    from transformers import CompileConfig

    model = tiny_llama()  # the KIVI schemes flush 4 tokens at a time during the decode
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(3))
    frames: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        frames.append(gm)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    out = {}
    for mode in ("eager", "compiled"):
        cache = _static_cache(model, kind, 40 + STEPS)
        extra = {"compile_config": config} if mode == "compiled" else {"disable_compile": True}
        with torch.no_grad():
            out[mode] = model.generate(ids, **cache_kwargs(cache, model), max_new_tokens=STEPS, do_sample=False,
                                       pad_token_id=0, output_logits=True, return_dict_in_generate=True, **extra)  # fmt: skip
    assert len(frames) == 1, [len(f.graph.nodes) for f in frames]  # the prompt runs eagerly, every decode step here
    assert torch.equal(out["compiled"].sequences, out["eager"].sequences)
    torch.testing.assert_close(torch.stack(out["compiled"].logits), torch.stack(out["eager"].logits), atol=1e-5, rtol=0)
