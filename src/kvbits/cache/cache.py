"""`QuantizedKVCache`: a drop-in transformers ``Cache`` whose layers quantize K/V (``QuantizedKVLayer``).

Usage::

    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    out = model.generate(**inputs, cache=cache)   # past_key_values=cache before transformers 5.24
    cache.memory_report()["total_bytes"]

Decode steps can skip dequantization: with ``kvbits.cache.use_fused_decode(model)`` (the
``kvbits_fused`` attention function) they run the fused kernel over the packed store on CUDA
(``fused_decode="auto"``), or on any device with ``fused_decode=True`` (``kvbits.cache.fused``).

Built on transformers' public ``Cache`` / ``CacheLayerMixin`` API only (tested with 5.17, 5.24 and 5.25):
no private attributes, no patched modeling code. Layer types come from the model config
(``get_layer_types_and_kwargs``), so hybrid sliding/full models (Gemma 3) get sliding layers. Falcon's
``new_decoder_architecture`` (Falcon-40B/180B) before transformers 5.25 hands ``update`` its KV heads repeated
for every query head: each is stored once, as ``kvbits.plan`` counts them, and repeated back for attention
(``_head_repeat``); from 5.25 it hands them over as they are, and they are stored as they come.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache

from kvbits.cache import checks as kv_checks
from kvbits.cache.eager import run_eagerly
from kvbits.cache.fixed import calibrated_length, install_artifact
from kvbits.cache.fused import RopeTableCache, check_mode
from kvbits.cache.hybrid import HYBRID_TYPES, hybrid_layer_class, repeat_state_batch, select_state_batch
from kvbits.cache.layer import (
    QuantizedKVLayer,
    cache_batch_size,
    check_beam_idx,
    check_crop_arg,
    check_max_cache_len,
    find_position_ids,
    left_pads,
    no_positions_message,
    offload_refusal,
    padded_sinks_message,
)
from kvbits.plan.config import (
    attention_heads,
    config_value,
    latent_attention,
    latent_attention_message,
    layer_configs,
    layer_heads,
    text_config,
)

# families whose attention changes the keys after RoPE, before caching them (HunYuan: key_layernorm on the rotated
# keys); kvbits.analyze.verify refuses them for statistics and calibration, rotary_for for pre-RoPE cache schemes,
# kvbits.plan for pre-RoPE plans
from kvbits.plan.positions import KEYS_NORMED_AFTER_ROPE, default_mrope_section, mrope_section
from kvbits.schemes.presets import get_scheme, post_rope_advice
from kvbits.schemes.spec import KVScheme, TensorSpec

logger = logging.getLogger(__name__)

# the most sink slots a left-padded request adds (QuantizedKVCache._sinks_for_request): past it, the warning instead
MAX_PAD_SINKS = 4096

__all__ = ["QuantizedKVCache", "attention_shape", "layer_windows", "linear_state_bytes", "rotary_for"]

_SLIDING_TYPES = ("sliding_attention", "chunked_attention")
# layers without attention (a hybrid model's convolution, linear-attention or state-space layers): held by
# transformers' own layer (LinearAttentionLayer), as DynamicCache(config=...) holds them, not quantized
_STATE_TYPES = ("conv", "linear_attention")
COMPONENTS = ("codes", "scales", "zero_points", "outliers", "full_precision", "fixed")


def attention_shape(config: Any) -> tuple[int, int, int, int]:
    """``(num_layers, H_q, H_kv, D)`` of a (text) config; ``ValueError`` naming what is missing, or for multi-head
    latent attention (``kv_lora_rank``) or values of another head dim than the keys (``v_head_dim``), which
    ``kvbits.plan`` refuses too.

    Heads as the planner reads them (``kvbits.plan.config.attention_heads``): ``H_kv`` is
    ``num_key_value_heads`` (or ``num_kv_heads``, ...; GQA), 1 for ``multi_query`` (Falcon-7B,
    GPT-BigCode), else ``H_q`` (MHA); ``D`` is ``head_dim`` when the config sets it (Gemma, Llama 3.2),
    else ``hidden_size // H_q``. A heterogeneous config (``per_layer_config``) is read per layer: the heads are
    layer 0's (``layer_heads`` gives each layer's), and ``kv_lora_rank`` in any layer is refused.
    """
    text = text_config(config)
    name = type(text).__name__
    if isinstance(text, Mapping):  # kvbits.plan reads a config.json's dict; the cache's layers need the config object
        raise TypeError(
            f"QuantizedKVCache needs the model's transformers config (model.config, AutoConfig.from_pretrained), "
            f"got a {name}"
        )
    n_layers = config_value(text, "num_hidden_layers")
    # a heterogeneous config (Step3p7, Dots3 Note, Gemma 4) refuses global reads of its per-layer attributes
    # (AmbiguousGlobalPerLayerAttributeError): read them from each layer's config, as the planner does
    layers = layer_configs(text, int(n_layers)) if isinstance(n_layers, int) and n_layers > 0 else [text]
    missing = [a for a, cfg in (("num_hidden_layers", text), ("num_attention_heads", layers[0])) if config_value(cfg, a) is None]
    if missing:
        raise ValueError(
            f"{name} has no {' / '.join(missing)}: QuantizedKVCache needs the number of layers and attention "
            "heads of the decoder (pass num_layers= and config=None to build layers lazily instead)"
        )
    if (latent := latent_attention(text)) is not None:  # as kvbits.plan refuses it (model_shape)
        raise ValueError(latent_attention_message(text, latent, name, "QuantizedKVCache"))
    for i, cfg in enumerate(layers):
        v_dim = config_value(cfg, "v_head_dim")  # MiMo-V2-Flash: keys of 192 channels, values of 128
        if isinstance(v_dim, int) and v_dim != (d := attention_heads(cfg)[2]):  # as kvbits.plan refuses it
            raise ValueError(
                f"{name} layer {i} caches keys of head_dim {d} channels and values of v_head_dim {v_dim}: "
                "QuantizedKVCache (and the kvbits planner) store K and V heads of one head dim (MHA/GQA/MQA only)"
            )
    heads, kv_heads, head_dim = attention_heads(layers[0])
    return int(n_layers), heads, kv_heads, head_dim


def _head_repeat(text: Any, heads: int, kv_heads: int) -> int:
    """``g``: how many times the model's attention repeats each of its ``kv_heads`` K/V heads, in a row,
    before handing them to ``Cache.update`` (1: it hands them over as they are).

    transformers' Falcon with ``new_decoder_architecture`` (Falcon-40B/180B) before 5.25 broadcasts its
    ``num_kv_heads`` K/V heads to every query head before caching them (``heads / kv_heads`` copies of each,
    consecutive). The layers store one copy (what the planner counts) and check once per request that the
    groups really are copies, storing every head when they are not (``QuantizedKVLayer``'s ``head_repeat``).
    From 5.25 Falcon hands over its ``kv_heads`` heads, which the layers take as they are (``repeat`` 1).
    """
    if config_value(text, "new_decoder_architecture", default=False):
        return heads // kv_heads
    return 1


def _layer_types(text: Any, n_layers: int) -> tuple[list[str], list[dict]]:
    """Per-layer types and kwargs, through transformers' own resolver when it has one.

    5.24 returns one kwargs dict per layer, 5.17 one dict for all layers; both are normalised.
    """
    resolver = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if resolver is not None:
        types, kwargs = resolver(text)
    else:  # pragma: no cover - older transformers
        types = getattr(text, "layer_types", None)
        if types is None:
            sliding = getattr(text, "sliding_window", None)
            types = ["sliding_attention" if sliding is not None else "full_attention"] * n_layers
        kwargs = {"sliding_window": getattr(text, "sliding_window", None)}
    types = list(types)
    if isinstance(kwargs, dict):
        kwargs = [dict(kwargs) for _ in types]
    return types, list(kwargs)


def layer_windows(config: Any) -> dict[int, int | None]:
    """Each cached layer's sliding window ``W`` as ``QuantizedKVCache`` builds it from ``config`` (``_make_layer``),
    None for full attention (and for a layer type without an integer window, which the cache refuses)."""
    types, kwargs = _layer_types(text_config(config), attention_shape(config)[0])
    return {
        i: w if t in _SLIDING_TYPES and isinstance(w := kw.get("sliding_window"), int) else None
        for i, (t, kw) in enumerate(zip(types, kwargs))
    }


def rotary_for(scheme: KVScheme, config: Any, rotary: Any) -> tuple[Any, bool]:
    """RoPE tables for a scheme's pre-RoPE keys (any layer's): ``(tables, built_here)``; ``(None, False)`` when none
    are needed. ``rotary``: tables the caller made (``RotaryTables.from_model``); else built from ``config``.
    ``ValueError`` for a family that changes its keys after RoPE (``KEYS_NORMED_AFTER_ROPE``: HunYuan) or rotates
    them by multimodal RoPE (``mrope_section``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...); ``TypeError``
    for a ``rotary`` that is no ``RotaryTables``."""
    from kvbits.quant.rope import RotaryTables

    if rotary is not None and not isinstance(rotary, RotaryTables):  # else an AttributeError at the first layer built
        raise TypeError(
            f"rotary must be None or kvbits.quant.rope.RotaryTables (RotaryTables.from_model(model)), got "
            f"{type(rotary).__name__} {rotary!r}"
        )
    if not any(s.key.pre_rope and not s.is_identity for s in scheme.layer_schemes()):
        return None, False
    model_type = getattr(text_config(config), "model_type", None) if config is not None else None
    if model_type in KEYS_NORMED_AFTER_ROPE:
        raise ValueError(
            f"scheme {scheme.name!r} quantizes keys before RoPE, but model_type {model_type!r} normalises its keys after "
            "RoPE (key_layernorm): the keys it caches are no rotation of a pre-RoPE key, so un-rotating them gives "
            "no pre-RoPE frame; use a scheme with post-RoPE keys (pre_rope=False)"
        )
    section = _mrope_section(text_config(config) if config is not None else None, rotary)
    if section is None and rotary is None:  # the family's fallback (Qwen2-VL's [16, 24, 24]), before building
        section = default_mrope_section(model_type)  # tables it may not fit (a RuntimeError deep in the module)
    _refuse_mrope(scheme, model_type, section)
    if rotary is not None:
        return rotary, False
    if config is None:
        raise ValueError(
            f"scheme {scheme.name!r} quantizes keys before RoPE: pass config= (or rotary=) so the cache "
            "can un-rotate and re-rotate keys"
        )
    try:
        tables = RotaryTables.from_config(config)
    except ValueError as exc:
        raise ValueError(f"scheme {scheme.name!r} needs a model with RoPE keys: {exc}; {post_rope_advice(scheme)}") from exc
    _refuse_mrope(scheme, model_type, _mrope_section(None, tables))  # a module whose mrope_section is its default
    return tables, True


def _refuse_mrope(scheme: KVScheme, model_type: Any, section: Any) -> None:
    """``ValueError`` for pre-RoPE keys of a model with multimodal RoPE (``section``: its ``mrope_section``; ``None``:
    none, nothing to refuse)."""
    if section is None:
        return
    raise ValueError(
        f"scheme {scheme.name!r} quantizes keys before RoPE, but model_type {model_type!r} rotates its keys by "
        f"multimodal RoPE (mrope_section {list(section)}): each channel section turns by its own position axis "
        "(time, height, width), which differ within image and video tokens, while the cache un-rotates each token "
        "at one position, so their keys would be quantized in no pre-RoPE frame; use a scheme with post-RoPE keys "
        "(pre_rope=False)"
    )


def _mrope_section(text: Any, rotary: Any) -> Any:
    """The ``mrope_section`` of multimodal RoPE (Qwen2-VL style: channel sections rotated by the time, height and
    width position axes) in ``text``'s RoPE parameters or on the rotary module of ``rotary`` (``RotaryTables``),
    else ``None``."""
    section = mrope_section(text)
    if section is not None:
        return section
    return getattr(getattr(rotary, "rotary", None), "mrope_section", None)


def _state_layer(idx: int, layer_type: str, kwargs: dict) -> Any:
    """transformers' own cache layer for layer ``idx`` of ``layer_type`` (``_STATE_TYPES``: no attention, no K/V; its
    convolution / recurrent states kept in the model's dtype, as ``DynamicCache(config=...)`` keeps them);
    ``NotImplementedError`` for a transformers without such layers."""
    cls = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {}).get(layer_type)
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if cls is None or mixin is None or not issubclass(cls, mixin) or issubclass(cls, cache_utils.CacheLayerMixin):
        raise NotImplementedError(
            f"layer {idx} has type {layer_type!r} (no attention: a convolution / linear-attention / state-space "
            "layer), which this transformers' cache_utils has no layer for; QuantizedKVCache keeps such layers' "
            "states in transformers' LinearAttentionLayer (transformers 5.17 and later have it)"
        )
    return cls(number_of_states=kwargs.get("number_of_states", 1))


def _holds_state(layer: Any) -> bool:
    """``layer`` holds a convolution / linear-attention state: a ``_state_layer`` or a hybrid layer (attention too)."""
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mixin is not None and isinstance(layer, mixin)


def _is_state_layer(layer: Any) -> bool:
    """``layer`` holds a non-attention layer's states (``_state_layer``), no K/V: a state holder that is no
    attention layer (a hybrid layer is both)."""
    return _holds_state(layer) and not isinstance(layer, cache_utils.CacheLayerMixin)


def state_nbytes(layer: Any) -> int:
    """Bytes of the convolution and recurrent state tensors a ``_state_layer`` holds now (0 before its first
    update): ``number_of_states`` of each, as transformers allocates them (model dtype, not quantized).

    Counted by storage, each once: while recording its past (``activate_past_recording``, assisted decoding) a layer
    keeps views (its cropped conv state, a prefill's recorded recurrent states) that hold a larger storage alive, which
    ``numel * element_size`` undercounted (LFM2 after ``crop(-2)``: 3072 bytes reported, 10240 held)."""
    tensors = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
    for history in (getattr(layer, "recurrent_states_history", None) or {}).values():  # kept for crop (assisted)
        tensors.extend(history)
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def linear_state_bytes(cache: Any) -> int:
    """Bytes of a hybrid model's convolution / linear-attention states in ``cache`` (its ``LinearAttentionLayer``
    layers, :func:`state_nbytes` each), the same count for a ``QuantizedKVCache`` (``memory_report()``'s
    ``linear_state_bytes``) and a ``DynamicCache``; 0 for a model whose every layer attends. Not K/V: outside
    ``total_bytes`` and ``kvbits.plan``. A ``hybrid`` layer's state (Zamba, Falcon-H1: attention plus a state in one
    layer; transformers' ``LinearAttentionAndFullAttentionLayer``, kvbits' ``QuantizedHybridLayer``) counts here too,
    its K/V in ``total_bytes``."""
    return sum(state_nbytes(layer) for layer in getattr(cache, "layers", ()) if _holds_state(layer))


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` storing K/V following a ``KVScheme`` (real packed storage).

    Args:
        config: the model's config (composite configs use their text config). ``None``: layers are
            created lazily on first use, all full attention.
        scheme: preset name, dict, path to a scheme JSON or a ``KVScheme`` (``kvbits.get_scheme``).
        num_layers: number of layers (checked against the config when both are given).
        workspace: keep dequantized history per layer for faster token-by-token decoding
            (reported as ``workspace_bytes``). Results are identical bit for bit for schemes without a
            rotation; a rotated spec (``int4-token-hadamard``, ``fp8-e4m3-hadamard``) decodes and inverse-rotates
            each flush on its own, a matmul over fewer rows than the one-shot decode, so the values may differ by
            rounding, as the BLAS sums (1.8e-7..7e-7 seen in float32, about 1 ulp in float16).
        rotary: RoPE tables for ``pre_rope`` key specs (``RotaryTables.from_model(model)`` keeps the
            model's own frequency buffers); default: built from ``config`` on the K/V device.
        calibration: a ``kvbits.calibrate.CalibrationArtifact``, or the folder ``kvbits calibrate``
            wrote, for schemes with static scales or NUQ codebooks (see ``install_calibration``).
        fused_decode: decode steps through the fused kernel over the packed store, when the model's
            attention is ``kvbits_fused`` (``kvbits.cache.use_fused_decode``): ``"auto"`` (default) on
            CUDA with Triton, ``True`` on any device (CPU: the torch reference, or ``KVBITS_KERNEL``),
            ``False`` never. Results match the dequantize-then-SDPA path; see ``fused_report()``.
        checks: how incoming K/V are checked for NaN / inf / values beyond float16 scales
            (``kvbits.cache.checks``): ``"eager"``: every ``update``, before storing (a host-device sync
            per layer and step); ``"lazy"``: on the device, read back every ``check_every`` steps (one
            sync for all layers) and by ``memory_report()``, ``calibration_report()``, ``fused_report()``,
            ``materialize()`` and ``check_inputs()``, so a decode step never waits for the GPU; the error
            names the layer, side, update steps and token positions. ``"auto"`` (default): eager on CPU,
            lazy on CUDA (and other accelerators). Clipped counts are exact either way.
        check_every: update steps between lazy checks (default 64).
        max_cache_len: the longest sequence (prompt + generated tokens) to reserve quantized storage for, as
            a server reserves a request's memory up front (``None``, default: nothing reserved). Each full
            layer allocates its quantized codes and metadata for that length at its first flush and writes
            every later flush in place, where a growing cache copies the layer's whole quantized history
            at every flush (every decode step for per-token schemes); a ``workspace`` is reserved alike, for
            all ``max_cache_len`` tokens in attention's order, and each step returns views of it (no copy of
            the history; later steps overwrite them, as ``StaticCache``'s: ``materialize()`` gives copies).
            ``memory_report()`` then counts the reservation (``workspace_bytes`` too), and at
            ``max_cache_len`` tokens equals ``kvbits.plan`` at that context (a left-padded request whose sinks
            are widened reserves as many quantized slots fewer: ``plan`` with its sinks). Longer
            sequences still work: the layer logs it and grows by copying.
        calibration_warnings: ``False`` for a caller that reports calibration/serving mismatch itself, once
            per run (``kvbits eval``, ``needle``, ``speed``): the cache then logs neither warning below; the
            counts stay in ``calibration_report()``.

    Served beyond its calibration, the cache says so, once per calibration artifact (a WARNING on the
    ``kvbits.cache.cache`` logger; a server's cache per request does not repeat it, nor does ``reset()``): when
    a layer's cached tokens first pass the artifact's ``max_calibrated_length`` (one int comparison per
    ``update``), and when a layer first clips more than ``kvbits.cache.checks.CLIP_WARN_FRAC`` (0.1 %, the
    report's warning level) of its quantized keys or values against static scales (looked at after each flush
    with eager checks, where the counts are host ints, and with each lazy check, read back in its one
    transfer). ``calibration_report()`` has both per layer. vLLM's integer zero-points (``integer_zero``,
    ``vllm-int4``; no calibration) clip too, where a token's range excludes 0 (its zero-point code clamps and
    the far end of its values is lost): counted and warned about alike, in those words, once per cache.

    A forward that raises midway (a later layer's module or kernel) leaves the cache partially written, as
    transformers' ``DynamicCache`` does: the layers it updated hold the new tokens, the others do not
    (``get_seq_length()`` counts the first layer's), and a retry on the same cache fails deep in attention
    (``The size of tensor a (4) must match the size of tensor b (8)``). Call ``reset()`` (or make a new cache)
    before running the request again. ``StaticQuantizedKVCache`` refuses such a cache at the next forward.
    """

    def __init__(
        self,
        config: Any = None,
        scheme: str | dict | KVScheme = "int8-token",
        *,
        num_layers: int | None = None,
        workspace: bool = False,
        rotary: Any = None,
        calibration: Any = None,
        fused_decode: bool | str = "auto",
        checks: str = "auto",
        check_every: int = kv_checks.DEFAULT_CHECK_EVERY,
        max_cache_len: int | None = None,
        calibration_warnings: bool = True,
    ) -> None:
        self.scheme = get_scheme(scheme)
        if not isinstance(calibration_warnings, bool):
            raise TypeError(f"calibration_warnings must be True or False, got {calibration_warnings!r}")
        self.calibration_warnings = calibration_warnings
        self._max_cache_len = check_max_cache_len(max_cache_len)
        self.checks_mode = kv_checks.check_mode(checks)
        self.check_every = kv_checks.check_every_arg(check_every)
        self._input_error: str | None = None  # a failed lazy check: every update raises it until reset()
        # (B, q) position ids of the model call in progress, from kvbits.cache.positions.track_positions:
        # used by pre-RoPE keys where Cache.update brings none (transformers 5.17)
        self.position_ids_hint: torch.Tensor | None = None
        self._told_no_positions = False
        self._told_padded_sinks = False  # the warning of _sinks_for_request, once per cache
        self._pad_sinks = 0  # sink slots the current request adds to scheme.sinks (_sinks_for_request)
        self.fused_decode = check_mode(fused_decode)
        if self.fused_decode is True:  # the decode kernel's settings: refused here, not after the prefill
            from kvbits.kernels.dispatch import kernel_settings

            kernel_settings()
        self._fused_tables = RopeTableCache()
        self.workspace = bool(workspace)
        self._lazy = False
        self._config = config
        # the shape first: a config the cache can not hold at all (multi-head latent attention) says so, before
        # pre-RoPE tables are asked of its rotary module
        shape = attention_shape(config) if config is not None else None
        self._rotary, self._rotary_owned = rotary_for(self.scheme, config, rotary)
        self.calibration = None
        # tokens past which update logs, once, that the calibration is exceeded (sys.maxsize: nothing to say)
        self._warn_past = sys.maxsize
        # warnings said: the artifact's own set once one is installed (once per artifact), else this cache's
        self._logged: set[str] = set()
        self.num_key_value_heads: int | None = None
        self.head_repeat = 1  # K/V heads repeated by the model before update (Falcon new arch): stored once
        self.head_dim: int | None = None
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        layers: list = []
        if shape is not None:
            n_layers, heads, kv_heads, head_dim = shape
            self.num_key_value_heads = kv_heads
            self.head_repeat = _head_repeat(text_config(config), heads, kv_heads)
            self.head_dim = head_dim
            types, kwargs = _layer_types(text_config(config), n_layers)
            if num_layers is not None and num_layers != len(types):
                raise ValueError(f"num_layers={num_layers} but the config describes {len(types)} cached layers")
            self.scheme.check_layer_count(len(types), "the config's")
            layers = [self._make_layer(i, t, kw) for i, (t, kw) in enumerate(zip(types, kwargs))]
            fallback = [f"{layer.layer_idx} (W={layer.sliding_window})" for layer in layers
                        if isinstance(layer, QuantizedKVLayer) and layer.mode == "fallback"]
            if fallback:
                logger.info(
                    "scheme %s: residual + block - 1 exceeds the sliding window - 1 of layers %s; they keep "
                    "their window in full precision",
                    self.scheme.name, ", ".join(fallback),
                )
        elif num_layers is not None:
            self.scheme.check_layer_count(num_layers, "the cache's")  # as the config branch and the static cache
            layers = [self._make_layer(i, "full_attention", {}) for i in range(num_layers)]
        else:
            self._lazy = True
        super().__init__(layers=layers)
        if calibration is not None:
            self.install_calibration(calibration)

    def _make_layer(self, idx: int, layer_type: str, kwargs: dict) -> Any:
        cls, layer_kwargs = QuantizedKVLayer, {}
        if layer_type == "full_attention":
            window = None
        elif layer_type in _SLIDING_TYPES:
            window = kwargs.get("sliding_window")
            if not isinstance(window, int):
                raise ValueError(f"layer {idx} is {layer_type!r} but the config gives no integer window ({window!r})")
        elif layer_type == "dummy" and hasattr(cache_utils, "DummyLayer"):
            return cache_utils.DummyLayer()  # KV-sharing consumer or attention-free layer: stores nothing
        elif layer_type in _STATE_TYPES:
            return _state_layer(idx, layer_type, kwargs)
        elif layer_type in HYBRID_TYPES:
            window, cls = None, hybrid_layer_class()
            if cls is None:
                raise NotImplementedError(
                    f"layer {idx} has type {layer_type!r} (attention plus a state-space / linear-attention state: "
                    "Zamba, Falcon-H1), whose state QuantizedKVCache keeps in transformers' LinearAttentionLayer, "
                    "which this transformers' cache_utils lacks (5.17 and later have it)"
                )
            layer_kwargs = {"number_of_states": kwargs.get("number_of_states", 1)}
        elif layer_type == "hybrid_sliding":
            raise NotImplementedError(
                f"layer {idx} has type {layer_type!r}: a sliding-window attention layer that also keeps a "
                "state-space / linear-attention state, which QuantizedKVCache does not hold (it holds full-attention "
                "'hybrid' layers: Zamba, Zamba2, Falcon-H1); serve this model with DynamicCache(config=model.config), "
                "and price its attention layers with kvbits plan"
            )
        else:
            raise NotImplementedError(
                f"layer {idx} has type {layer_type!r}; QuantizedKVCache quantizes full_attention, sliding_attention, "
                f"chunked_attention and hybrid layers and keeps the states of {' and '.join(_STATE_TYPES)} layers "
                "(and of hybrid ones)"
            )
        kv_heads, repeat, head_dim = self.num_key_value_heads, self.head_repeat, self.head_dim
        if self._config is not None:  # per layer, as the planner counts them (Gemma 4: global layers differ)
            heads, kv_heads, head_dim = layer_heads(self._config, idx)
            if kv_heads == 0:  # a DeciLM block without attention (no_op / replace_with_linear) holds no KV
                if hasattr(cache_utils, "DummyLayer"):
                    return cache_utils.DummyLayer()
                kv_heads = None
            repeat = _head_repeat(text_config(self._config), heads, kv_heads or heads)
        layer = cls(
            self.scheme.for_layer(idx), layer_idx=idx, **layer_kwargs, sliding_window=window, workspace=self.workspace,
            num_key_value_heads=kv_heads, head_repeat=repeat, head_dim=head_dim,
            rotary=None if self._rotary is None else self._rotary.tables_for_layer(idx),
            fused_decode=self.fused_decode, rope_tables=self._fused_tables,
            checks=self.checks_mode, check_every=self.check_every, max_cache_len=self.max_cache_len,
        )
        if getattr(self, "calibration", None) is not None:  # lazily created layers
            self._calibrate_layer(layer)
        if layer.can_clip and not self._clipping_said:
            layer.clip_watch = self._look_at_clipping
        return layer

    def install_calibration(self, artifact: Any) -> None:
        """Install a ``kvbits.calibrate`` artifact: static scales and NUQ codebooks, layer by layer.

        Checks that it was made for this scheme (and this model's shape, when the cache has a config);
        the parameters become the layers' ``fixed`` bytes. A path is loaded with
        ``kvbits.calibrate.load_calibration``.
        """
        from kvbits.calibrate import checked_artifact

        artifact = checked_artifact(artifact, self.scheme, self._config, None if self._lazy else len(self.layers))
        self.calibration = artifact
        longest = self.max_calibrated_length
        # each warning once per artifact (artifact.logged), so a cache per request does not repeat it
        self._logged = artifact.logged
        quiet = not self.calibration_warnings
        self._warn_past = sys.maxsize if quiet or longest is None or "length" in self._logged else longest
        for layer in self._quantized_layers():
            self._calibrate_layer(layer)
            layer.clip_watch = self._look_at_clipping if layer.can_clip and not self._clipping_said else None

    def _calibrate_layer(self, layer: QuantizedKVLayer) -> None:
        install_artifact(layer, self.calibration, check_heads=self._config is None)

    def __repr__(self) -> str:
        return f"QuantizedKVCache(scheme={self.scheme.name!r}, layers={len(self.layers)}, seq={self._seq_length()})"

    def _seq_length(self) -> int:
        """Tokens cached, as an int: ``get_seq_length()`` of the first layer that is not a state layer (a hybrid
        model's layer 0 may be one, whose count transformers keeps as a tensor)."""
        idx = next((i for i, layer in enumerate(self.layers) if not _is_state_layer(layer)), None)
        return 0 if idx is None else int(self.get_seq_length(idx))

    def _state_layers(self) -> list[Any]:
        """Layers holding a linear state: those without attention and hybrid ones (``QuantizedHybridLayer``)."""
        return [layer for layer in self.layers if _holds_state(layer)]

    @run_eagerly
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V ``(B, H_kv, q, D)`` of layer ``layer_idx``; return what its attention uses.

        Runs eagerly under ``torch.compile`` (``kvbits.cache.eager.run_eagerly``: the compiled model breaks its graph
        here): the quantization is bit for bit the eager one, the layer's host integers (lengths, flush
        points) cause no recompiles, and the lazy checks' host reads and the fused path's tagged placeholders
        stay outside any graph. Costs about 0.4 us per call when not compiling.
        """
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        if layer_idx >= len(self.layers):
            if not self._lazy:
                raise ValueError(f"layer_idx {layer_idx} out of range: this cache has {len(self.layers)} layers")
            while len(self.layers) <= layer_idx:
                self.layers.append(self._make_layer(len(self.layers), "full_attention", {}))
        if self._rotary_owned and isinstance(key_states, torch.Tensor) and self._rotary.device != key_states.device:
            # cos/sin computed on the model's device, as the model computes them (bit-exact re-rotation)
            from kvbits.quant.rope import RotaryTables

            self._rotary = RotaryTables.from_config(self._config, device=key_states.device)
            self._fused_tables.clear()
            for layer in self._quantized_layers():
                layer.set_rotary(self._rotary.tables_for_layer(layer.layer_idx))
        if self._input_error is not None:
            raise ValueError(self._input_error)
        layer = self.layers[layer_idx]
        quantized = isinstance(layer, QuantizedKVLayer)
        if quantized and layer.checks.due:
            self.check_inputs()  # every layer's lazy check in one host sync, not one per layer
        if self._rotary is not None and quantized and layer.reads_positions:
            kwargs = self._with_position_ids(key_states, args, kwargs)
        if quantized and layer.tokens_seen == 0 and layer.keeps_sinks:  # a request's first update of the layer only
            self._sinks_for_request(layer, key_states, value_states, args, kwargs)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if quantized and layer.tokens_seen > self._warn_past:  # the per-step cost: one int comparison
            self._warn_beyond_calibration(layer.tokens_seen)
        return out

    def _warn_beyond_calibration(self, tokens: int) -> None:
        """Log, once per artifact (``CalibrationArtifact.logged``), that ``tokens`` cached tokens passed the
        calibrated length."""
        longest, self._warn_past = self._warn_past, sys.maxsize
        if "length" in self._logged:  # another cache serving the artifact said so since this one was made
            return
        self._logged.add("length")
        from kvbits.report.calibration import cover_advice  # once per artifact: off the per-step path

        logger.warning(
            "QuantizedKVCache (scheme %s): %d tokens cached, past the %d-token context its calibration artifact "
            "was calibrated on (max_calibrated_length): later positions are served with statistics extrapolated "
            "from shorter contexts. calibration_report() counts them per layer (positions_beyond_calibrated). "
            "%s Logged once per calibration artifact.", self.scheme.name, tokens, longest, cover_advice(None),
        )  # fmt: skip

    @property
    def _clipping_said(self) -> bool:
        """The clipping warning was logged for this artifact (without one, this cache), or is not wanted."""
        return not self.calibration_warnings or "clipping" in self._logged

    def _stop_watching_clipping(self) -> None:
        """No layer calls ``_look_at_clipping`` any more: said once, no more cost per flush."""
        for layer in self._quantized_layers():
            layer.clip_watch = None

    def _look_at_clipping(self, layer: QuantizedKVLayer | list[QuantizedKVLayer]) -> None:
        """Log, once per artifact (``CalibrationArtifact.logged``; without one, once per cache), the first of
        ``layer`` (one, after its eager flush, or the lazily checked ones) whose keys or values clipped more than
        ``CLIP_WARN_FRAC`` of their quantized elements so far. Host ints only: eager counts, or lazy ones as the
        last lazy check read them back (``InputChecks.clipped``)."""
        layers = layer if isinstance(layer, list) else [layer]
        if self._clipping_said:  # another cache serving the artifact said so since this one was made
            self._stop_watching_clipping()
            return
        for lay in layers:
            counts = lay.checks.clipped if lay.checks.lazy else lay.clipped_counts()
            if counts is None:
                continue
            totals = lay.quantized_elements()
            lay.clip_floor = (kv_checks.CLIP_WARN_FRAC * totals[0], kv_checks.CLIP_WARN_FRAC * totals[1])
            for side, n, total in zip(("keys", "values"), counts, totals):
                if total and n > kv_checks.CLIP_WARN_FRAC * total:
                    self._logged.add("clipping")
                    self._stop_watching_clipping()
                    once = "calibration artifact" if getattr(self, "calibration", None) is not None else "cache"
                    how, why = _clip_cause(getattr(lay.scheme, side[:-1]))  # keys -> scheme.key
                    logger.warning(
                        "QuantizedKVCache (scheme %s): layer %d clipped %.3f%% of its %s (%d of %d quantized values) "
                        "%s (warning level %g%%): %s calibration_report() counts clipped values per layer. Logged once "
                        "per %s.", self.scheme.name, lay.layer_idx, 100 * n / total, side, n, total, how,
                        100 * kv_checks.CLIP_WARN_FRAC, why, once,
                    )  # fmt: skip
                    return

    def _sinks_for_request(
        self, layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> None:
        """Widen the sinks of ``layer`` for this request (``QuantizedKVLayer.widen_sinks``) at its first update
        ``key_states`` / ``value_states`` ``(B, H_kv, q, D)``: decided at the first layer that keeps sinks from each
        row's left padding (``left_pads``: the position ids, ``track_positions``'s where ``Cache.update`` brings
        none), ``scheme.sinks`` + the most pads of a row, so every row's first ``scheme.sinks`` real tokens stay in
        full precision; the same count for the request's later layers. Logged (INFO) once per request with the
        slots and bytes added. One host read at that layer's prefill, none per decode step. Where it cannot tell
        (a row of one repeated position: all pads, or a chunked prefill's first chunk) or the pads pass
        ``MAX_PAD_SINKS``, the sinks stay ``scheme.sinks`` and a WARNING says so, once per cache."""
        first = next((x for x in self.layers if isinstance(x, QuantizedKVLayer) and x.keeps_sinks), None)
        if layer is first:
            self._pad_sinks = self._padded_sink_slots(layer, key_states, value_states, args, kwargs)
        layer.widen_sinks(self._pad_sinks)

    def _padded_sink_slots(
        self, layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> int:
        """The sink slots this request adds (``_sinks_for_request``): 0 for a single row, without position ids, or
        unpadded rows."""
        B, q = key_states.shape[0], key_states.shape[2]
        found = None if B < 2 or q == 0 else left_pads(args, kwargs, key_states, self.position_ids_hint)
        if found is None:
            return 0
        pads, unsure = found
        most, n_unsure, rows = torch.stack([pads.max(), unsure.sum(), ((pads > 0) | unsure).sum()]).tolist()
        if rows == 0:
            return 0
        sinks = layer.scheme.sinks
        if n_unsure or most > MAX_PAD_SINKS:
            if not self._told_padded_sinks:
                self._told_padded_sinks = True
                why = (f"{n_unsure} row(s) of this update hold one repeated position (all pads, or a chunked "
                       "prefill's first chunk), so their padding is unknown" if n_unsure else
                       f"a row is left-padded by {most}, more than the {MAX_PAD_SINKS} sink slots the cache adds")
                logger.warning(padded_sinks_message(layer.scheme.name, sinks, rows, B, why))  # fmt: skip
            return 0
        layers = [x for x in self._quantized_layers() if x.keeps_sinks]
        per_token = B * (key_states.shape[1] * key_states.shape[3] + value_states.shape[1] * value_states.shape[3])
        logger.info(
            "scheme %s: %d of the %d rows of this request are left-padded (up to %d pads): its full-precision "
            "sinks are widened from %d to %d slots per row, so every row's first %d real tokens stay exact; at most "
            "%d bytes more per layer (%d layers: %d bytes) in full precision, counted by memory_report()",
            layer.scheme.name, rows, B, most, sinks, sinks + most, sinks,
            most * per_token * key_states.element_size(), len(layers),
            most * per_token * key_states.element_size() * len(layers),
        )  # fmt: skip
        return most

    def _with_position_ids(self, key_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
        """An update of a pre-RoPE layer that reads position ids (``QuantizedKVLayer.reads_positions``: a request's
        first, a chunked prefill's later chunks): add the tracked ``position_ids`` when transformers passed none; say once (INFO) when a batch comes with none at all."""
        if find_position_ids(args, kwargs) is not None:
            return kwargs
        if self.position_ids_hint is not None:
            return {**kwargs, "position_ids": self.position_ids_hint}
        if key_states.shape[0] > 1 and not self._told_no_positions:
            self._told_no_positions = True
            logger.info(no_positions_message("QuantizedKVCache", key_states.shape[0]))
        return kwargs

    def check_inputs(self) -> None:
        """Run the pending lazy K/V checks of every layer now (one host sync per device; nothing pending:
        no sync). ``ValueError`` naming the first failed layer (and the others) if NaN, inf or values
        beyond float16 scales were stored since the last check. Reports and ``materialize`` call it;
        call it after a generation to cover its last steps. Eager layers have nothing pending."""
        layers = self._quantized_layers()
        watched = [layer for layer in layers if layer.checks.pending and layer.clip_watch is not None]
        try:
            kv_checks.run_checks(layers)
        except ValueError as exc:
            self._input_error = str(exc)
            raise
        if watched:  # lazy: their clipped counts came back with the check's maxima (no sync of their own)
            self._look_at_clipping(watched)

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Refused: ``NotImplementedError``, as ``offload(layer_idx)`` for a quantized layer
        (``QuantizedKVLayer.offload``): this cache never offloads, so transformers' prefetch (which needs the
        ``offloading=True`` stream) has nothing to bring back; it raised ``AttributeError`` here."""
        raise NotImplementedError(offload_refusal(f"prefetch({layer_idx})"))

    @property
    def batch_size(self) -> int:
        """Sequences cached, ``-1`` before the first update (transformers' ``Cache.batch_size``: it gave ``None``
        here, and raised while some layers were still empty)."""
        return cache_batch_size(self.layers)

    def reset(self) -> None:
        """Empty every layer (and forget a failed lazy K/V check). Lazy checks still pending (K/V of the steps
        since the last check: a generation's last steps) run first, one host sync per device (none when nothing
        is pending); bad K/V they find are logged (WARNING, naming the layer and steps) instead of being dropped
        unseen with the layers, as eager checks would have refused them. ``reset()`` itself never raises for them."""
        if self._input_error is None:  # an error already raised was seen: nothing new to say
            try:
                self.check_inputs()
            except ValueError as exc:
                logger.warning("QuantizedKVCache.reset(): the pending lazy K/V check failed: %s. The cache is emptied "
                               "now; the outputs of the request just reset were computed from these K/V", exc)  # fmt: skip
        self._input_error = None
        self.position_ids_hint = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end of every layer (``QuantizedKVLayer.crop``: negative = that many tokens,
        positive = keep that absolute length). All or nothing: every layer is checked before any is cropped,
        so a ``ValueError`` (tokens already quantized, or dropped by a sliding window, or more than a layer
        holds) leaves the layers agreeing on the sequence length. Full-precision sliding windows keep the tokens a
        rollback needs once ``activate_past_recording()`` was called (transformers does, for assisted decoding). ``TypeError`` unless an int (not a bool)."""
        tokens_to_remove = check_crop_arg(tokens_to_remove)
        states = self._state_layers()  # transformers' LinearAttentionLayer.crop conditions, checked before any crop
        if states and (tokens_to_remove > 0 or not all(getattr(layer, "record_past", False) for layer in states)):
            raise ValueError(
                f"crop({tokens_to_remove}): the convolution / linear-attention layers of this hybrid model can only "
                "drop a negative count of tokens, after activate_past_recording() (transformers' LinearAttentionLayer "
                "keeps no past states otherwise); nothing was cropped"
            )
        for layer in self._quantized_layers():
            layer.tokens_to_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` of every layer becomes cached row ``beam_idx[i]`` (a 1-D int64 tensor; its length
        is the new batch, which may differ from the old one, as in transformers). Checked once for all layers
        (``kvbits.cache.layer.check_beam_idx``: ``TypeError`` / ``ValueError``, indices within the cached batch,
        one host sync) before any layer changes."""
        batches = [b for b in (layer.batch_size for layer in self._quantized_layers()) if b is not None]
        check_beam_idx(beam_idx, min(batches, default=None), "QuantizedKVCache.reorder_cache")
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                layer._reorder(beam_idx)
            else:
                layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached sequence ``repeats`` times in the batch dimension: the K/V and a hybrid model's conv /
        recurrent states alike (``kvbits.cache.hybrid.map_state_batch``; transformers' ``LinearAttentionLayer`` has no
        such method: ``AttributeError``, and a ``hybrid`` layer repeated its K/V alone)."""
        for layer in self.layers:
            if _is_state_layer(layer):
                repeat_state_batch(layer, repeats)
            else:
                layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (a batch-dim index) of every layer: the K/V and the states, as
        ``batch_repeat_interleave``."""
        for layer in self.layers:
            if _is_state_layer(layer):
                select_state_batch(layer, indices)
            else:
                layer.batch_select_indices(indices)

    def set_static_qparams(
        self,
        layer_idx: int,
        side: str,
        scale: torch.Tensor | None = None,
        zero: torch.Tensor | None = None,
        *,
        codebook: torch.Tensor | None = None,
        mean: torch.Tensor | None = None,
        factor: torch.Tensor | None = None,
    ) -> None:
        """Install calibrated scales / codebook / channel means and smoothing factors of one layer (see
        ``QuantizedKVLayer.set_static_qparams``)."""
        self._layer(layer_idx).set_static_qparams(side, scale, zero, codebook=codebook, mean=mean, factor=factor)

    def _layer(self, layer_idx: int) -> QuantizedKVLayer:
        quantized = {layer.layer_idx: layer for layer in self._quantized_layers()}
        if layer_idx not in quantized:
            raise ValueError(f"layer {layer_idx} is not a quantized cache layer of this cache ({len(self.layers)} layers)")
        return quantized[layer_idx]

    # ------------------------------------------------------------------ reading
    def _quantized_layers(self) -> list[QuantizedKVLayer]:
        return [layer for layer in self.layers if isinstance(layer, QuantizedKVLayer)]

    def materialize(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V that attention in layer ``layer_idx`` would see now, ``(B, H_kv, T_visible, D)`` (heads the
        model repeats before caching, Falcon's new architecture before transformers 5.25, repeated back as
        ``update`` returns them); runs
        the lazy K/V checks first."""
        layer = self._layer(layer_idx)
        self.check_inputs()
        return layer.materialize()

    def memory_report(self) -> dict[str, Any]:
        """Real storage: every byte of every tensor the cache holds, by layer and by component.

        ``total_bytes`` sums ``nbytes`` of codes, scales, zero-points, outliers, sinks, buffers and fixed
        per-layer tensors; ``workspace_bytes`` (dequantized history, optional) and ``position_bytes``
        (pre-RoPE layers: the int64 position offset of each sequence, read from the model's position ids
        for left-padded batches; 8 bytes per sequence and layer, plus 1 while a chunked prefill may still read a
        row's offset again: ``kvbits.cache.layer.reread_offset``) are reported apart.
        ``avg_bits`` is ``8 * total_bytes / elements``, ``elements`` being what an fp16 cache holds at this length
        (``kvbits.plan``'s definition: a sliding layer counts its last ``W - 1`` tokens, though it may still hold
        more in a block partly out of its window), so ``16 / avg_bits`` is the compression against fp16 and a
        cache equals its plan in ``avg_bits`` as in ``total_bytes``. A hybrid model's layers without attention
        (convolution, linear-attention, state-space: ``linear_layers``, held in transformers' ``LinearAttentionLayer``)
        hold no K/V and no part of ``total_bytes`` (``kvbits.plan`` prices attention layers only):
        ``linear_state_bytes`` counts their convolution and recurrent state tensors apart, unquantized, in the
        model's dtype, a fixed size per sequence whatever the context. A ``hybrid`` layer (Zamba, Falcon-H1:
        ``QuantizedHybridLayer``) is in both: its K/V in ``layers`` and ``total_bytes``, its state in
        ``linear_layers`` and ``linear_state_bytes``. Runs the lazy K/V checks first.
        """
        self.check_inputs()
        components = dict.fromkeys(COMPONENTS, 0)
        layers, workspace, positions, elements, batch = [], 0, 0, 0, 0
        for layer in self._quantized_layers():
            for name, tensors in layer.components().items():
                components[name] += sum(t.numel() * t.element_size() for t in tensors)
            rep = layer.report()
            workspace += rep.pop("workspace_bytes")
            positions += rep.pop("position_bytes")
            elements += rep.pop("fp16_elements")
            batch = max(batch, rep.pop("batch"))
            layers.append(rep)
        total = sum(components.values())
        return {
            "scheme": self.scheme.name,
            "total_bytes": total,
            "components": components,
            "layers": layers,
            "seq_length": self._seq_length(),
            "batch": batch,
            "workspace_bytes": workspace,
            "position_bytes": positions,
            "linear_state_bytes": linear_state_bytes(self),
            "linear_layers": [i for i, layer in enumerate(self.layers) if _holds_state(layer)],
            "avg_bits": 8 * total / elements if elements else 0.0,
        }

    def fused_report(self) -> dict[str, Any]:
        """Fused decode per layer: claimed (decode steps skip dequantization), steps attended over the packed
        store, fallback steps (dequantized K/V, e.g. padded batches), why a layer was not claimed; and the
        bytes of the float32 RoPE tables kept for fused pre-RoPE keys (not KV storage). Runs the lazy K/V
        checks first."""
        self.check_inputs()
        rows = [
            {"layer": layer.layer_idx, "claimed": layer.fused.claimed, "steps": layer.fused.steps,
             "fallbacks": layer.fused.fallbacks, "declined": layer.fused.declined}
            for layer in self._quantized_layers()
        ]  # fmt: skip
        return {
            "mode": self.fused_decode,
            "fused_steps": sum(r["steps"] for r in rows),
            "fallback_steps": sum(r["fallbacks"] for r in rows),
            "rope_table_bytes": self._fused_tables.nbytes,
            "layers": rows,
        }

    @property
    def max_cache_len(self) -> int | None:
        """Tokens per sequence the quantized storage is reserved for (``max_cache_len=``), or ``None``.

        Read-only, as transformers' ``Cache.max_cache_len`` (a property without a setter in 5.17, where
        assigning it in ``__init__`` raised AttributeError: no cache could be made there)."""
        return self._max_cache_len

    @property
    def max_calibrated_length(self) -> int | None:
        """The longest context the installed calibration artifact saw (``None``: no artifact, or it does not say)."""
        return calibrated_length(self.calibration)

    def calibration_report(self) -> dict[str, Any]:
        """Calibration/serving mismatch, measured per layer: values clipped against their scales so far
        (``clipped_keys``, ``clipped_values``: static scales' ranges, and vLLM's integer zero-points where a
        token's range excludes 0) out of the elements quantized so far (``quantized_keys``,
        ``quantized_values``), the last position seen and, with a calibration artifact installed, how many
        positions lie beyond the longest calibrated length. Runs the lazy K/V checks first; the counts are
        exact (device counters read back here)."""
        self.check_inputs()
        longest = self.max_calibrated_length
        rows = []
        for layer in self._quantized_layers():
            ck, cv = layer.clipped()
            nk, nv = layer.quantized_elements()
            row = {
                "layer": layer.layer_idx, "clipped_keys": ck, "clipped_values": cv, "quantized_keys": nk,
                "quantized_values": nv, "max_position": layer.tokens_seen - 1,
            }  # fmt: skip
            if longest is not None:
                row["positions_beyond_calibrated"] = max(0, layer.tokens_seen - longest)
            rows.append(row)
        return {"scheme": self.scheme.name, "max_calibrated_length": longest, "layers": rows}


def _clip_cause(spec: TensorSpec) -> tuple[str, str]:
    """The clipping warning's ``(how, why)`` for a side stored by ``spec``: against static scales (the K/V served
    left the calibrated range), or under vLLM's integer zero-points (``integer_zero``, dynamic: a token whose
    values all lie on one side of 0 clamps its zero-point code and loses the far end of its range)."""
    if spec.integer_zero:
        why = (
            "a token whose range excludes 0 clamps its zero-point code to the end of the code range and loses the "
            "far end of its values (vLLM's int4_per_token_head stores the same codes; a float zero-point, as "
            "int4-token's, covers every token's range)."
        )
        return "under integer zero-points", why
    why = (
        "the K/V served lie outside the ranges those scales cover; recalibrate (`kvbits calibrate`) on data like "
        "what is served."
    )
    return "against their static scales", why
