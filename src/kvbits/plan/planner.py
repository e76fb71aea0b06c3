"""KV-cache memory and concurrency for a model, a context length, a batch and one or more schemes.

Every byte comes from :func:`kvbits.schemes.layer_bytes`, the formula the cache's
``memory_report()`` is tested against; this module only sums it over layers and derives ratios.

Definitions (``T`` = context, ``B`` = batch, per layer ``l``: ``H_l`` KV heads, head dim ``D_l``):

- ``total_bytes``: K + V bytes of all layers holding ``B`` sequences of ``T`` tokens each: codes,
  scales, zero-points, outliers, full-precision tokens (sinks, residual window, not-yet-flushed
  buffer, in the model dtype ``dtype_bytes``) and per-layer constants (static scales, codebooks).
  Static scales count in the shapes ``kvbits calibrate`` writes: ``(H_kv, D)`` per channel, one float32 per tensor
  or per KV head for FP8. An integer / NUQ spec with static scales at ``token`` or ``head`` granularity counts one
  scale (and zero-point) per KV head, at ``tensor`` one per layer: ``kvbits calibrate`` makes none of these, and the
  cache stores whatever broadcastable shape ``set_static_qparams`` is given (a ``(H_kv, 1, D)`` one holds ``D``
  times the bytes counted here), so for such a spec ``fixed`` is what per-head / per-tensor scales take.
  Sliding-window layers hold at most their window (``token_split(..., sliding_window=W)``).
  A ``QuantizedKVCache(max_cache_len=T)`` holds the quantized part of this from its first flush on (reserved
  slots) and exactly this at ``T`` tokens. A ``StaticQuantizedKVCache`` also holds each static scale (and
  zero-point) a second time in the kernels' layout, one row per sequence (static FP8: float32 per head; KVQuant's
  key ranges: float16 ``(H_kv, D)`` scale and zero-point), ``B`` times a layer's static scale bytes beyond
  ``total_bytes``: the kernels address those rows by the batch (``kvbits.cache.static``).
- ``bytes_per_token``: ``total_bytes / (T * B)``.
- ``elements``: what an fp16 cache of the same model stores at ``T``:
  ``sum_l 2 * B * stored_l * H_l * D_l`` with ``stored_l = T`` for full layers and
  ``min(T, W - 1)`` for sliding ones.
- ``fp16_bytes``: ``2 * elements``, the fp16 cache of the same model at the same context.
- ``avg_bits``: ``8 * total_bytes / elements``, bits per cached element with all metadata included
  (16 for fp16; it tends to :func:`kvbits.schemes.average_bits` as ``T`` grows).
- ``compression``: ``fp16_bytes / total_bytes`` (= ``16 / avg_bits``).
- ``rope_table_bytes`` (``fused_decode=True``, pre-RoPE keys in a format the fused kernel reads): the
  float32 cos/sin tables fused decode keeps on the device to rotate keys in the kernel, once per model
  (not per sequence), at their grown size for the positions the quantized keys reach
  (:func:`kvbits.schemes.accounting.rope_table_bytes`; half width: rotate-half RoPE over the whole head).
  None for layers without RoPE (SmolLM3's NoPE layers) and layers whose pre-RoPE keys the fused path declines
  (partial rotary, ``dynamic`` / ``longrope`` rope, rotated pre-RoPE keys, centred values): read from the model's
  rotary module (``LayerShape.rope_tables``) when planning from a config; a :class:`ModelShape` says it per layer.
  It is added to ``total_bytes`` (and, with ``fused_decode``, ``components["rope_tables"]``); an upper bound of what the cache
  holds, reached unless the tables last grew at fewer positions. 0 otherwise.
- ``step_bytes``: what one step allocates beside the held bytes, at least: the K and V of the largest
  layer for ``B`` sequences of ``T`` tokens in the model dtype, ``2 * B * T * max_l(H_l * D_l) *
  dtype_bytes``. Every scheme's cache hands attention that much from each layer in turn at a prefill of
  ``T`` tokens (sliding layers too: the prompt's queries need all its keys), and from each full layer at
  every decode step without the fused kernel (``fused_decode`` decode steps return none; a sliding
  layer's step returns at most ``W`` tokens; with ``workspace=True`` and ``max_cache_len`` a step returns
  views of the workspace, which holds a dequantized copy of every layer: ``workspace_bytes``, not here).
  ``DynamicCache`` allocates it too, growing a layer by concatenation, and so does kvbits' fp16 cache. Scheme-independent. A quantized scheme's step allocates
  more: float32 working copies of a slice (``kvbits.cache.store.SLICE_TOKENS`` tokens) and, when it
  flushes, a copy of the layer's codes (none with ``QuantizedKVCache(max_cache_len=...)``, which writes
  flushes into reserved slots). Measured (``benchmarks/cache_working_set.py``, BENCHMARKS.md
  §18f): 1.2-1.8x this at 32K tokens; below one slice (4,096 tokens) up to 4x at a decode step and 5.8x at a
  prefill (Hadamard). Not in ``total_bytes`` nor in ``max_concurrency``: it is what ``reserve_gib`` is for.
  Falcon's ``new_decoder_architecture`` (40B/180B) before transformers 5.25 repeats each KV head for its
  query heads before the cache sees it; kvbits stores one copy but returns the repeats, ``H_q / H_kv``
  times this.

With a GPU budget (``gpu_mem_gib``, GiB = 2**30 bytes):

- ``weights_bytes``: ``weights_gib`` when given, else the config's parameter estimate
  (:func:`kvbits.plan.config.estimate_params`) times the model dtype bytes; required for a config whose
  ``quantization_config`` quantizes the weights or a ``.gguf`` file of quantized blocks (``ModelShape.weights_quantized``).
- ``kv_bytes_per_request``: the most bytes one more sequence adds at any length up to ``T``:
  ``total_bytes`` at batch 1 minus the per-layer constants, which exist once however many sequences there
  are, at its peak over ``1..T`` (a flush makes the bytes drop, so just before one a sequence may hold more
  than at ``T``; :func:`kvbits.plan.limits.max_concurrency`).
- ``max_concurrency``: the most sequences that fit at every length up to ``T``,
  ``min_t floor((gpu - weights - reserve - fixed_t) / request_t)`` over ``t <= T``, at least 0, where
  ``reserve`` (``reserve_gib``, default 0) stands for activations, CUDA context and fragmentation, and
  ``fixed_t`` is the per-layer constants and the RoPE tables. ``fits``: ``max_concurrency >= B``, which
  holds exactly when ``max_context >= T``.
- ``max_context``: the longest context ``B`` sequences can grow to, fitting at every length on the way
  (a flush makes the bytes drop, so the first length that does not fit decides;
  :func:`kvbits.plan.limits.max_context`); None when every length fits (layers that all slide).
  Independent of ``T``; it may be beyond the model's ``max_position_embeddings``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

from kvbits._spelling import spell
from kvbits.plan.config import latent_attention, load_shape, text_config, warn_beyond_max_positions
from kvbits.plan.limits import LIMIT, fused_rope_table_bytes, max_concurrency, max_context
from kvbits.plan.positions import pre_rope_problem
from kvbits.plan.shape import ConfigLike, ModelShape, _check_dtype_bytes
from kvbits.schemes import KVScheme, average_bits, check_unique_names, get_scheme, layer_bytes, token_split
from kvbits.schemes.accounting import sliding_falls_back
from kvbits.schemes.presets import post_rope_advice

logger = logging.getLogger(__name__)

GIB = 1 << 30

DEFAULT_SCHEMES: tuple[str, ...] = ("fp16", "fp8-e4m3", "int8-token", "int4-token", "kivi-4", "kivi-2")
"""The schemes the CLI compares when none is named."""

SchemeLike = Union[str, KVScheme, dict]  # noqa: UP007

_FP16 = "fp16"


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _context(value: Any) -> int:
    """A context to plan: a positive int of at most ``LIMIT`` (2**40) tokens, the bound the max-context search
    stops at too; ``ValueError`` beyond it (``--context 99999999999999999999k`` planned 1.0e23 tokens silently)."""
    value = _positive_int(value, "context")
    if value > LIMIT:
        raise ValueError(
            f"context must be at most 2**40 = {LIMIT:,} tokens (the longest kvbits plans, as its max-context "
            f"search), got {value:,}"
        )
    return value


def _as_list(value: Any) -> tuple[list[Any], bool]:
    """``(items, was_a_list)``: a list/tuple stays a list, anything else becomes one item."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("expected at least one value, got an empty list")
        return list(value), True
    return [value], False


def _check_distinct(specs: list[Any], schemes: list[KVScheme]) -> None:
    """``ValueError`` when two of ``specs`` resolve to the same scheme name: results are reported (and
    told apart) by name, so a repeat would print two identical rows, and is most likely a typo for
    another scheme. Two spellings of one name count (``"fp16"`` and a ``fp16.json`` file, which
    ``get_scheme`` only accepts when it stores K/V as the preset does)."""
    first: dict[str, tuple[Any, KVScheme]] = {}
    how: dict[str, str] = {}  # the first repeated name -> its two spellings, when they differ
    for spec, s in zip(specs, schemes):
        if s.name not in first:
            first[s.name] = (spec, s)
            continue
        given = [_spelling(first[s.name][0]), _spelling(spec)]
        if _storage(first[s.name][1]) != _storage(s):
            raise ValueError(
                f"two different schemes are named {s.name!r} (given as {given[0]} and {given[1]}); plans are "
                "reported by scheme name: rename one of them"
            )
        if given[0] != given[1]:
            how[s.name] = " and ".join(given)
        break  # check_unique_names names this first repeat
    check_unique_names([s.name for s in schemes], "planned", how)


def _storage(s: KVScheme) -> KVScheme:
    """``s`` less what does not change how K/V are stored (its and its overrides' description, reference)."""
    layers = tuple((i, _storage(sub)) for i, sub in s.layers)
    return s.replace(description="", reference="", layers=layers)


def _spelling(spec: Any) -> str:
    """How a scheme was given, for messages: a name or path as typed, else the kind of object."""
    if isinstance(spec, str):
        return repr(spec)
    if isinstance(spec, KVScheme):
        return f"KVScheme {spec.name!r}"
    return f"a {type(spec).__name__}"


def check_pre_rope(shape: ModelShape, scheme: KVScheme) -> None:
    """``ValueError`` when ``scheme`` quantizes keys before RoPE (a layer's key side has ``pre_rope``) on a model
    that can not cache them so (``shape.pre_rope_problem``: it does not rotate its keys, GPT-2, BLOOM, Falcon with
    ``alibi=True``, ...): ``QuantizedKVCache`` and ``StaticQuantizedKVCache`` refuse such a scheme, so its bytes
    would describe a cache that can not be built (and ``fused_decode`` would add RoPE tables the model never has)."""
    _refuse_pre_rope(scheme, shape.name, shape.pre_rope_problem)


def check_pre_rope_config(scheme: KVScheme, config: Any) -> None:
    """:func:`check_pre_rope` for a loaded model's config (``kvbits.plan.positions.pre_rope_problem`` of its text
    config): what ``kvbits eval`` (both modes), ``speed``, ``needle`` and ``calibrate`` check before their first
    forward pass, so that a pre-RoPE scheme on a model that rotates no keys (Falcon ``alibi=True``, Zamba2 without
    ``use_mem_rope``, Zamba) is refused with the planner's message, not by the cache after the reference ran."""
    text = text_config(config) if config is not None else None
    if text is None or isinstance(text, Mapping):
        return
    # multi-head latent attention: the caches refuse post-RoPE schemes as well, so advising one would mislead
    advice = "no kvbits cache holds it, with pre- or post-RoPE keys" if latent_attention(text) is not None else None
    _refuse_pre_rope(scheme, getattr(text, "model_type", None), pre_rope_problem(text), advice)


def _refuse_pre_rope(scheme: KVScheme, name: str | None, problem: str | None, advice: str | None = None) -> None:
    """``ValueError`` when ``scheme`` has pre-RoPE keys and ``problem`` (``pre_rope_problem``'s reason) is set;
    ``advice`` (default: :func:`post_rope_advice`) ends the message."""
    if problem is None:
        return
    if any(s.key.pre_rope and not s.is_identity for s in scheme.layer_schemes()):
        model = f" {name!r}" if name else ""
        raise ValueError(
            f"scheme {scheme.name!r} quantizes keys before RoPE, but the model{model} {problem}; "
            f"the cache refuses it there: {advice or post_rope_advice(scheme)}"
        )


MAX_GIB = 1 << 30
"""The largest memory amount taken, in GiB (1 EiB): far beyond any GPU or node, and small enough that the
byte counts stay finite (``1e308`` GiB overflowed a float)."""


def _non_negative_gib(value: Any, what: str) -> int:
    """``value`` GiB in bytes, for a number in ``[0, MAX_GIB]``; ``ValueError`` naming ``what`` otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{what} must be a finite number of GiB >= 0, got {value!r}")
    if value > MAX_GIB:
        raise ValueError(
            f"{what} must be at most {MAX_GIB} GiB (1 EiB; a number of GiB, not of bytes), got {value!r}"
        )
    return round(float(value) * GIB)  # a Python float, so round() gives an int (numpy floats too)


def plan(
    config: ConfigLike,
    context: int | Sequence[int] | None = None,
    batch: int = 1,
    scheme: SchemeLike | Sequence[SchemeLike] = "fp16",
    gpu_mem_gib: float | None = None,
    dtype_bytes: int | None = None,
    *,
    weights_gib: float | None = None,
    reserve_gib: float = 0.0,
    fused_decode: bool = False,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Plan the KV-cache memory of a model for one or more schemes and context lengths.

    Args:
        config: a transformers config, a dict, a path to ``config.json`` / a model folder / a
            ``.gguf`` file, a kvbits offline model name, a hub id, or a :class:`ModelShape`
            (``ModelShape.from_dims(layers, kv_heads, head_dim)`` to plan without a config).
        context: tokens per sequence ``T`` (at most 2**40), or a list of them; default the config's
            ``max_position_embeddings``.
        batch: sequences ``B`` held at once, all of length ``T``.
        scheme: a preset name, a scheme JSON path, a dict or a ``KVScheme``, or a list of them.
        gpu_mem_gib: GPU memory in GiB; adds weights, ``max_concurrency`` and ``fits``.
        dtype_bytes: bytes per element of the model dtype, used for full-precision tokens (sinks,
            residual window, unflushed buffer) and weights; default from the config's dtype, else 2.
        weights_gib: weights memory in GiB, overriding the estimate from the config (with ``gpu_mem_gib`` only).
        reserve_gib: GPU memory kept free for activations and the runtime, in GiB (with ``gpu_mem_gib`` only, at most
            it). Weights and reserve beyond ``gpu_mem_gib`` are planned (nothing fits: ``max_concurrency`` 0) with a
            warning saying so.
        fused_decode: the cache decodes through the fused kernel (``kvbits.cache.use_fused_decode`` on
            CUDA): pre-RoPE schemes then also hold RoPE tables (``rope_table_bytes``; a config is read with
            ``load_shape(config, rope=True)``, which builds its rotary module).

    Returns:
        One dict (see the module docstring for each field) when ``scheme`` and ``context`` are
        single values; a list of dicts when either is a list or tuple, ordered by context, then by
        scheme in the order given.

    Raises:
        ValueError: unknown scheme (the message lists the presets), bad numbers, a config without
            heads or layers, a scheme the cache can not store at the model's head dim (per-token groups
            that do not divide it), ``gpu_mem_gib`` without any way to know the weights, ``weights_gib`` or a
            non-zero ``reserve_gib`` without ``gpu_mem_gib``, ``reserve_gib`` above ``gpu_mem_gib``, a pre-RoPE scheme on a model that does not rotate
            its keys (:func:`check_pre_rope`: the cache refuses it), or a scheme
            listed twice (two spellings that resolve to one scheme name count: plans are told apart by
            name).

    Example:
        >>> from kvbits.plan import ModelShape, plan
        >>> plan(ModelShape.from_dims(32, 32, 128), context=32768, batch=8)["total_bytes"]
        137438953472
    """
    if not isinstance(fused_decode, bool):  # "auto" (as the cache takes) or "no" would count as True
        raise TypeError(
            f"fused_decode must be True or False (whether decoding goes through the fused kernel), got "
            f"{fused_decode!r}"
        )
    shape = load_shape(config, rope=fused_decode)
    if dtype_bytes is not None:
        _check_dtype_bytes(dtype_bytes)
        shape = shape.replace(dtype_bytes=dtype_bytes)
    batch = _positive_int(batch, "batch")
    if context is None:
        if shape.max_context is None:
            raise ValueError("context is required: the config has no max_position_embeddings to default to")
        if shape.max_context < 1:
            raise ValueError(
                f"context is required: the config's max_position_embeddings ({shape.max_context}) is not a "
                "context length to default to"
            )
        context = shape.max_context
    contexts, many_contexts = _as_list(context)
    contexts = [_context(c) for c in contexts]
    repeated = sorted({c for c in contexts if contexts.count(c) > 1})
    if repeated:
        raise ValueError(
            f"context {repeated[0]} is listed twice ({list(contexts)}); each context is planned once, so name "
            "each only once (a repeat is most likely a typo for another length)"
        )
    if shape.max_context is not None:
        for c in contexts:  # the bytes are still exact; whether the model works there is another question
            warn_beyond_max_positions(shape.max_context, c, " (the bytes are planned all the same)")
    scheme_specs, many_schemes = _as_list(scheme)
    schemes = [get_scheme(s) for s in scheme_specs]
    _check_distinct(scheme_specs, schemes)
    for s in schemes:
        check_pre_rope(shape, s)

    budget = None
    if gpu_mem_gib is not None:
        budget = _budget(shape, gpu_mem_gib, weights_gib, reserve_gib)
    else:  # they only enter the GPU budget: the plan would ignore them without a word (the CLI refuses them too)
        given = [f"{name}={value!r}" for name, value, unset in (("weights_gib", weights_gib, None),
                 ("reserve_gib", reserve_gib, 0)) if value is not None and value != unset]  # fmt: skip
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{' and '.join(given)} {verb} to the GPU budget alone: pass gpu_mem_gib as well")

    budgets = [budget] * len(schemes)
    if budget is not None:  # max_context does not depend on the context planned: once per scheme
        budgets = [{**budget, "max_context": _max_context(shape, s, batch, budget, fused_decode)} for s in schemes]
    results = [
        plan_shape(shape, s, context=t, batch=batch, budget=b, fused_decode=fused_decode)
        for t in contexts
        for s, b in zip(schemes, budgets)
    ]
    return results if (many_contexts or many_schemes) else results[0]


def _budget(
    shape: ModelShape, gpu_mem_gib: float, weights_gib: float | None, reserve_gib: float
) -> dict[str, int]:
    gpu = _non_negative_gib(gpu_mem_gib, "gpu_mem_gib")
    reserve = _non_negative_gib(reserve_gib, "reserve_gib")
    if reserve > gpu:  # memory kept free on the GPU can not exceed the GPU: most likely the two were swapped
        raise ValueError(
            f"{spell('reserve_gib', '--reserve-gib')} ({reserve_gib:g} GiB) is memory kept free on the GPU, so it "
            f"must be at most {spell('gpu_mem_gib', '--gpu-mem')} ({gpu_mem_gib:g} GiB); were the two swapped?"
        )
    if weights_gib is not None:
        weights = _non_negative_gib(weights_gib, "weights_gib")
        source = "given"
    elif shape.weights_quantized is not None:
        dequantized = (
            f"; dequantized on load, {shape.n_params * 2 / GIB:.3g} GiB in 16-bit floats, "
            f"{shape.n_params * 4 / GIB:.3g} GiB in float32"
        ) if shape.n_params else ""  # fmt: skip
        raise ValueError(
            f"{spell('gpu_mem_gib', '--gpu-mem')} needs the weights' size, and this config's weights are quantized "
            f"({shape.weights_quantized}): not {shape.dtype_bytes} bytes per parameter as the estimate counts; pass "
            f"{spell('weights_gib=...', '--weights-gib')}: kept quantized on the GPU, about the checkpoint's size{dequantized}"
        )
    elif shape.n_params is not None:
        weights = shape.n_params * shape.dtype_bytes
        source = "estimated"
    else:
        raise ValueError(
            f"{spell('gpu_mem_gib', '--gpu-mem')} needs the weights' size: this model shape carries no parameter "
            "estimate (planned from dimensions; from a config whose layers, KV heads or head dim were overridden, which "
            "the estimate no longer describes; or from a config it can not be estimated from, which -v logs); pass "
            f"{spell('weights_gib=...', '--weights-gib')}"
        )
    if weights + reserve > gpu:  # a real answer (the model does not fit), but say why every concurrency is 0
        logger.warning(
            "the weights (%.3g GiB, %s) and the reserve (%.3g GiB) exceed gpu_mem_gib (%.3g GiB) by %.3g GiB: no "
            "room is left for the KV cache, so max_concurrency and max_context are 0",
            weights / GIB, source, reserve / GIB, gpu / GIB, (weights + reserve - gpu) / GIB,
        )  # fmt: skip
    return {
        "gpu_mem_bytes": gpu,
        "weights_bytes": weights,
        "reserve_bytes": reserve,
        "weights_source": source,
    }  # type: ignore[dict-item]


def _max_context(
    shape: ModelShape, scheme: KVScheme, batch: int, budget: dict[str, Any], fused_decode: bool
) -> int | None:
    free = budget["gpu_mem_bytes"] - budget["weights_bytes"] - budget["reserve_bytes"]
    return max_context(shape, scheme, batch=batch, free_bytes=free, fused_decode=fused_decode)


def long_run_bits(shape: ModelShape, scheme: SchemeLike) -> float:
    """The bits per element ``plan_shape``'s ``avg_bits`` tends to as the context grows without bound: each
    full-attention layer's :func:`~kvbits.schemes.average_bits` (its own scheme, KV heads and head dim) weighted by
    its elements per token (``H_l * D_l``). Sliding-window layers hold a bounded number of tokens, so their share
    vanishes in the limit. A model whose every layer slides never grows: its layers are weighted alike, each at its
    quantized store's bits, or at the model dtype's when the layer keeps its window in full precision
    (``sliding_falls_back``). A model without sliding layers or per-layer shapes gets ``average_bits(scheme, D, H,
    n_layers)``."""
    scheme = get_scheme(scheme)
    scheme.check_layer_count(len(shape.layers))
    check_pre_rope(shape, scheme)
    kept = [(i, layer) for i, layer in enumerate(shape.layers) if layer.attention != "none"]
    if not kept:
        raise ValueError("none of the model's layers stores a KV cache; it has no bits per element")
    growing = [(i, layer) for i, layer in kept if layer.attention == "full"] or kept
    weighted = total = 0.0
    for i, layer in growing:
        s = scheme.for_layer(i)
        if layer.window is not None and not s.is_identity and sliding_falls_back(s, layer.window):
            bits = 8.0 * shape.dtype_bytes
        else:
            bits = average_bits(s, head_dim=layer.head_dim, n_heads=layer.kv_heads)
        weighted += bits * layer.kv_heads * layer.head_dim
        total += layer.kv_heads * layer.head_dim
    return weighted / total


def planned_bits(shape: ModelShape, scheme: SchemeLike, context: int) -> float:
    """``plan_shape``'s ``avg_bits`` of ``scheme`` on ``shape`` at ``context`` tokens, one sequence: the bits per
    element the cache stores there, metadata, sinks and the full-precision window included (in ``shape``'s dtype, as
    ``kvbits plan MODEL --context N`` counts them). :func:`long_run_bits` is its limit as the context grows."""
    return float(plan_shape(shape, scheme, context=context)["avg_bits"])


def plan_shape(
    shape: ModelShape,
    scheme: SchemeLike,
    *,
    context: int,
    batch: int = 1,
    budget: dict[str, Any] | None = None,
    fused_decode: bool = False,
) -> dict[str, Any]:
    """One plan: ``shape`` holding ``batch`` sequences of ``context`` tokens under ``scheme``.

    ``budget`` (``gpu_mem_bytes``, ``weights_bytes``, ``reserve_bytes``) adds the concurrency
    fields; its optional ``max_context`` is taken as computed (:func:`plan` computes it once per scheme). :func:`plan` is the friendlier entry point.
    """
    scheme = get_scheme(scheme)
    fp16 = get_scheme(_FP16)
    context = _context(context)
    batch = _positive_int(batch, "batch")
    totals = {"key": 0, "value": 0, "full": 0, "quantized": 0, "fixed": 0}
    elements = 0
    step = 0
    per_layer = []
    scheme.check_layer_count(len(shape.layers))
    check_pre_rope(shape, scheme)
    for i, layer in enumerate(shape.layers):
        layer_scheme = scheme.for_layer(i)
        row: dict[str, Any] = {
            "layer": i,
            "attention": layer.attention,
            "window": layer.window,
            "kv_heads": layer.kv_heads,
            "head_dim": layer.head_dim,
        }
        if layer.attention == "none":
            row.update(tokens=None, key=0, value=0, full=0, quantized=0, fixed=0, total_bytes=0, fp16_bytes=0)
            per_layer.append(row)
            continue
        kw = {
            "n_heads": layer.kv_heads,
            "head_dim": layer.head_dim,
            "full_dtype_bytes": shape.dtype_bytes,
            "sliding_window": layer.window,
        }
        b = layer_bytes(layer_scheme, context, batch=batch, **kw)
        split = token_split(layer_scheme, context, layer.window)
        stored_fp16 = token_split(fp16, context, layer.window).stored
        layer_elements = 2 * batch * stored_fp16 * layer.kv_heads * layer.head_dim
        elements += layer_elements
        step = max(step, 2 * batch * context * layer.kv_heads * layer.head_dim * shape.dtype_bytes)
        for k in totals:
            totals[k] += b[k]
        row.update(
            tokens={
                "sink": split.sink,
                "quantized": split.quantized,
                "full": split.full,
                "dropped": split.dropped,
            },
            key=b["key"],
            value=b["value"],
            full=b["full"],
            quantized=b["quantized"],
            fixed=b["fixed"],
            total_bytes=b["key"] + b["value"],
            fp16_bytes=2 * layer_elements,
        )
        per_layer.append(row)
    layers = [(scheme.for_layer(i), layer) for i, layer in enumerate(shape.layers)]
    rope_tables = fused_rope_table_bytes(layers, context) if fused_decode else 0
    total = totals["key"] + totals["value"] + rope_tables
    assert total == totals["full"] + totals["quantized"] + totals["fixed"] + rope_tables, (
        "layer_bytes breakdown must add up"
    )
    fp16_bytes = 2 * elements
    out: dict[str, Any] = {
        "scheme": scheme.name,
        "model": shape.name,
        "context": context,
        "batch": batch,
        "dtype_bytes": shape.dtype_bytes,
        "total_bytes": total,
        "bytes_per_token": total / (context * batch),
        "avg_bits": 8 * total / elements,
        "compression": fp16_bytes / total,
        "fp16_bytes": fp16_bytes,
        "elements": elements,
        "key_bytes": totals["key"],
        "value_bytes": totals["value"],
        "components": {"full": totals["full"], "quantized": totals["quantized"], "fixed": totals["fixed"]},
        "rope_table_bytes": rope_tables,
        "step_bytes": step,
        "per_layer": per_layer,
    }
    if fused_decode:
        out["components"]["rope_tables"] = rope_tables
    if budget is not None:
        free = budget["gpu_mem_bytes"] - budget["weights_bytes"] - budget["reserve_bytes"]
        # the peak over every length up to the context: the bytes just before a flush exceed those after it
        per_request, max_conc = max_concurrency(shape, scheme, context, free_bytes=free, fused_decode=fused_decode)
        out.update(
            gpu_mem_bytes=budget["gpu_mem_bytes"],
            weights_bytes=budget["weights_bytes"],
            weights_source=budget.get("weights_source", "given"),
            reserve_bytes=budget["reserve_bytes"],
            kv_bytes_per_request=per_request,
            max_concurrency=int(max_conc),
            fits=bool(max_conc >= batch),
            max_context=(
                budget["max_context"] if "max_context" in budget
                else _max_context(shape, scheme, batch, budget, fused_decode)
            ),
        )  # fmt: skip
    return out
