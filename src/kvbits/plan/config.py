"""What the planner needs to know about a model: its KV-cache shape, layer by layer, and its weights.

:func:`~kvbits.plan.sources.resolve_config` turns anything a user may hold (a transformers config,
a dict, a ``config.json``, a model folder, a ``.gguf`` file, a kvbits offline-model name, a hub id)
into a config; :func:`model_shape` reads a :class:`~kvbits.plan.shape.ModelShape` from it
(:func:`load_shape` does both):

- **KV heads** ``H_kv`` per layer: ``num_key_value_heads`` (also ``num_kv_heads``, ``n_head_kv``,
  ``multi_query_group_num``); ``multi_query=True`` means one KV head (GPT-BigCode, Falcon-7B, unless
  Falcon's ``new_decoder_architecture``); otherwise the query head count (``num_attention_heads``,
  GPT-2's ``n_head``): plain multi-head attention.
- **head dim** ``D``: an explicit ``head_dim`` when the config has one (Gemma: 256 with hidden 2304
  and 8 heads), else ``hidden_size / num_attention_heads``.
- **attention type** per layer, as transformers' own ``DynamicCache`` decides it
  (``transformers.cache_utils.get_layer_types_and_kwargs``): ``layer_types`` when present
  (``sliding_attention`` holds a window of ``sliding_window`` tokens, ``chunked_attention`` is cached
  like a window of ``attention_chunk_size``, linear-attention / SSM / MLP-only layers and layers that
  reuse another layer's KV hold nothing; any other type is refused: DeepSeek-V4's compressed attention, DSA's
  ``indexed_attention`` (it caches indexer keys too), ``reference_sliding_attention`` (it keeps the whole prompt));
  otherwise ``sliding_window``, when set, applies to every layer
  (Mistral, Qwen3-MoE: a config's ``use_sliding_window`` / ``max_window_layers`` are its class's business,
  already in its ``sliding_window`` or ``layer_types``). Raw dicts that transformers can not build get the same
  rules plus Qwen2's (``use_sliding_window``: layers ``i >= max_window_layers`` slide) and Gemma's legacy
  ``sliding_window_pattern`` (every ``pattern``-th layer is global).
- **recurrent models** (xLSTM, RWKV, Mamba: no attention layer, no KV cache) are refused.
- **encoder-decoder and encoder-only models** are refused by :func:`load_shape` (:func:`check_causal_config`): an
  encoder-decoder's decoder also holds cross-attention K/V (Whisper, T5, BART), an encoder (BERT, RoBERTa,
  DistilBERT) attends both ways and keeps no KV cache while decoding.
- **DeciLM / Nemotron-NAS** (``block_configs``): each layer's KV heads are ``num_attention_heads /
  n_heads_in_group`` of its block; ``no_op`` / ``replace_with_linear`` attention holds nothing. Their weights are
  not estimated (per-block MLP widths): pass ``weights_gib``.
- **dtype bytes** of full-precision K/V: from ``dtype`` / ``torch_dtype``, 2 when absent.
- **parameter count** (for weights memory, see :func:`estimate_params`).
- **quantized weights** (``quantization_config``: GPTQ, AWQ, bitsandbytes, FP8, MXFP4, ...; a ``.gguf`` file of
  quantized blocks, Q4_K, Q8_0, ...): their bytes are not the parameter count times the dtype bytes, so a GPU budget needs ``weights_gib`` (:func:`quantized_weights`). The
  config's KV-cache settings (``kv_cache_scheme``, vLLM's FP8 KV) do not change the plan: the scheme planned
  decides how K/V are stored (``fp8-e4m3``, ``vllm-fp8-token`` are vLLM's), full-precision tokens stay in the dtype.

transformers is imported only when a config has to be built or loaded: a plain dict with the
standard keys, or a :class:`ModelShape`, plans without it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvbits._spelling import spell
from kvbits.plan.positions import LEARNED_POSITIONS, pre_rope_problem
from kvbits.plan.shape import (
    ATTENTION_KINDS,
    ConfigLike,
    LayerShape,
    ModelShape,
    check_layer_count,
    check_window,
    dtype_bytes_of,
)
from kvbits.plan.sources import resolve_config

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_KINDS",
    "ConfigLike",
    "LayerShape",
    "ModelShape",
    "attention_heads",
    "check_causal_config",
    "dtype_bytes_of",
    "estimate_params",
    "latent_attention",
    "latent_attention_message",
    "layer_configs",
    "layer_heads",
    "load_shape",
    "max_positions",
    "model_shape",
    "quantized_weights",
    "resolve_config",
    "text_config",
    "warn_beyond_max_positions",
]

# transformers layer_types -> kvbits attention kind (see transformers.cache_utils.get_layer_types_and_kwargs)
_FULL_TYPES = {"full_attention", "attention", "hybrid"}
_SLIDING_TYPES = {"sliding_attention", "hybrid_sliding"}
# layer types transformers caches in more (or other) bytes than K/V heads of full attention or a window: refused with
# why (QuantizedKVCache refuses them too); planning them as full attention / a window under-counts what is held
_REFUSED_TYPES = {
    "indexed_attention": (
        "a sparse-attention layer (DSA) also caches its indexer's keys beside its K/V (transformers' "
        "DynamicIndexedLayer), which kvbits neither quantizes nor plans"
    ),
    "reference_sliding_attention": (
        "a reference sliding-window layer keeps every prefill token plus a window of the decoded ones "
        "(Unlimited-OCR), so its bytes depend on the prompt's length, which the planner is not given"
    ),
}
_CHUNKED_TYPES = {"chunked_attention"}
_NO_KV_TYPES = {"linear_attention", "mamba", "conv", "dummy", "moe", "mlp"}
_KNOWN_TYPES = _FULL_TYPES | _SLIDING_TYPES | _CHUNKED_TYPES | _NO_KV_TYPES

# Model types whose layers all carry a recurrent state instead of attention: no KV cache to plan.
_RECURRENT_MODEL_TYPES = {"xlstm", "rwkv", "mamba", "mamba2", "falcon_mamba"}

# Architectures whose MLP is two matrices (up, down) instead of a gated three (gate, up, down).
_UNGATED_MLP = {
    "gpt2", "gpt_bigcode", "gpt_neo", "gptj", "gpt_neox", "opt", "bloom", "falcon", "phi", "starcoder2",
    "mpt", "codegen", "biogpt", "xglm",
}  # fmt: skip

# Architectures whose ``attention_bias`` sets only the q/k/v biases: their o_proj has none (Qwen2's q/k/v biases are
# always on, with no o_proj bias). Elsewhere ``attention_bias`` biases o_proj too (Llama, Qwen3, OLMo, Gemma, ...).
_QKV_ONLY_BIAS = ("qwen2", "glm", "helium", "mimo_v2", "solar_open")


# ------------------------------------------------------------------------------ reading a config


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    """First non-None attribute (or key) of ``cfg`` among ``names``."""
    for n in names:
        if isinstance(cfg, Mapping):
            v = cfg.get(n)
        else:
            try:
                v = getattr(cfg, n, None)
            except RuntimeError as exc:
                # heterogeneous transformers configs refuse global reads of per-layer attributes
                if type(exc).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                    raise
                v = None
        if v is not None:
            return v
    return default


config_value = _get  # public name: the cache reads configs (heterogeneous ones too) as the planner does


def _int(value: Any, what: str) -> int | None:
    """``value`` of the config field ``what`` as an int (an integral float too), None when unset; ``ValueError``
    naming the field otherwise (a string, a fraction, NaN or infinity: ``int(nan)`` said only "cannot convert
    float NaN to integer", ``int(inf)`` raised ``OverflowError``). The one check of every integer field read."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
        or int(value) != value
    ):
        raise ValueError(f"config field {what} must be an integer, got {value!r}")
    return int(value)


def text_config(cfg: Any) -> Any:
    """The decoder's config of a composite (vision-language, encoder-decoder, speech) config: the one whose
    layers the KV cache holds. ``get_text_config(decoder=True)`` for transformers configs (without
    ``decoder=True`` a config holding both a ``text_encoder`` and a ``decoder`` is ambiguous and raises);
    ``text_config`` of a plain mapping with no layer count of its own; else the config itself. Every
    part of kvbits (planner, cache, RoPE tables, analyze, calibrate) reads the text config through this."""
    if isinstance(cfg, Mapping):
        if _get(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers") is None and isinstance(
            cfg.get("text_config"), Mapping
        ):
            return cfg["text_config"]
        return cfg
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text(decoder=True)
        except TypeError:
            return get_text()
    return cfg


def _keys(cfg: Any) -> list[str]:
    if isinstance(cfg, Mapping):
        return sorted(cfg)
    return sorted(k for k in vars(cfg) if not k.startswith("_")) if hasattr(cfg, "__dict__") else []


def attention_heads(cfg: Any) -> tuple[int, int, int]:
    """``(H_q, H_kv, D)`` of one layer's (text) config, read as the module docstring says.

    ``H_kv`` is the model's own KV head count; ``QuantizedKVCache`` reuses this (``attention_shape``).
    ``ValueError`` when the config has no head counts or inconsistent ones.
    """
    q = _int(_get(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads"), "num_attention_heads")
    if _get(cfg, "multi_query") is True and not _get(cfg, "new_decoder_architecture"):
        kv: int | None = 1  # GPT-BigCode, Falcon-7B: one shared KV head
    else:
        kv = _int(
            _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
            "num_key_value_heads",
        )
    if kv is None:
        kv = q
    if kv is None:
        raise ValueError(
            "config has no attention heads: expected num_key_value_heads or num_attention_heads "
            f"(or n_head / num_heads); got keys {_keys(cfg)}"
        )
    if q is None:
        q = kv
    if q < 1 or kv < 1:
        raise ValueError(
            f"attention head counts must be >= 1, got num_attention_heads={q}, num_key_value_heads={kv}"
        )
    if kv > q or q % kv:
        # grouped-query attention shares each KV head among G = H_q / H_kv query heads
        raise ValueError(
            f"num_key_value_heads must divide num_attention_heads (G = H_q / H_kv query heads per KV head), "
            f"got num_attention_heads={q}, num_key_value_heads={kv}"
        )
    head_dim = _int(_get(cfg, "head_dim"), "head_dim")
    if head_dim is None:
        hidden = _int(_get(cfg, "hidden_size", "n_embd", "d_model"), "hidden_size")
        if hidden is None:
            raise ValueError(
                f"config has neither head_dim nor hidden_size (n_embd, d_model); got keys {_keys(cfg)}"
            )
        if hidden % q:
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {q} "
                "and the config has no head_dim"
            )
        head_dim = hidden // q
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return q, kv, head_dim


def layer_configs(text: Any, n_layers: int) -> list[Any]:
    """One config per layer of a text config: ``per_layer_config`` of a heterogeneous transformers config
    (Gemma 4: a wider ``head_dim`` on its global layers), else ``text`` for every layer."""
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)[:n_layers]
    return [text] * n_layers


def latent_attention(text: Any) -> tuple[int, int] | None:
    """``(layer, kv_lora_rank)`` of the first layer of a text config with multi-head latent attention (DeepSeek-V2/V3
    style: ``kv_lora_rank`` set), ``None`` when no layer has it. Read per layer (:func:`layer_configs`): a
    heterogeneous config (Dots3 Note) keeps ``kv_lora_rank`` in each layer's config, not globally. The one check the
    caches, the planner, the K/V site search and ``kvbits.quant.rope`` refuse such a model by
    (:func:`latent_attention_message`)."""
    n_layers = _get(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    ok = isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers > 0
    for i, lc in enumerate(layer_configs(text, n_layers) if ok else [text]):
        if (rank := _get(lc, "kv_lora_rank")) is not None:
            return i, rank
    return None


def latent_attention_message(text: Any, latent: tuple[int, int], subject: str, supporter: str, why: str = "") -> str:
    """The refusal of multi-head latent attention, one wording for every site: ``subject`` (what was given: a config
    or model class; empty: the message starts at "uses", to complete one naming it) uses it, ``latent`` (:func:`latent_attention`: layer and rank) and ``text``'s model type named;
    ``why`` (optional) says what that site could not do with it; ``supporter`` names the kvbits part that supports
    MHA/GQA/MQA only."""
    layer, rank = latent
    model_type = _get(text, "model_type")
    return (
        f"{subject + ' ' if subject else ''}uses multi-head latent attention (kv_lora_rank={rank} in layer {layer}; model_type "
        f"{model_type!r}, DeepSeek-V2/V3 style), whose cache holds a compressed latent and the rotary key part, not "
        f"K/V heads of head_dim channels{'; ' + why if why else ''}; {supporter} supports MHA/GQA/MQA attention only"
    )


def layer_heads(config: Any, layer_idx: int) -> tuple[int, int, int]:
    """``(H_q, H_kv, D)`` of layer ``layer_idx`` as :func:`model_shape` counts them (:func:`attention_heads`
    of that layer's config, see :func:`layer_configs`; a DeciLM block's own ``H_kv``, 0 for a block without
    attention); ``config`` may be composite.

    Raises:
        ValueError: ``layer_idx`` is not a layer of the config, or its heads can not be read.
    """
    text = text_config(config)
    n_layers = _int(_get(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers"), "num_hidden_layers")
    if n_layers is None:
        return attention_heads(text)  # no layer count: one rule for every layer
    if not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer {layer_idx} is not a layer of the config, which has {n_layers} layers")
    if _get(text, "block_configs") is not None:  # DeciLM / Nemotron-NAS: H_kv per block, 0 where it holds no KV
        q, _, d = attention_heads(text)
        return q, _block_kv_heads(_blocks(text, n_layers)[layer_idx], layer_idx, q), d
    return attention_heads(layer_configs(text, n_layers)[layer_idx])


def max_positions(config: Any) -> int | None:
    """The context the model was trained for: its text config's ``max_position_embeddings`` (or
    ``n_positions``, ``max_sequence_length``, ``seq_length``), ``None`` when it records none.

    Raises:
        ValueError: the field is not an integer.
    """
    return _int(
        _get(text_config(config), "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
        "max_position_embeddings",
    )


def warn_beyond_max_positions(config: Any, context: int, note: str = "") -> bool:
    """Log a warning when ``context`` tokens exceed :func:`max_positions` of ``config`` (a config, or that
    limit as an int): positions beyond it are extrapolation, so what is measured there (``kvbits analyze``,
    ``calibrate``, ``eval``) is not the model's trained behaviour. ``note`` ends the message (the planner
    says its bytes are still exact).

    Returns:
        True when it warned; False within the limit or when the config records none (or an unreadable one).
    """
    if isinstance(config, int) and not isinstance(config, bool):
        max_ctx: int | None = config
    else:
        try:
            max_ctx = max_positions(config)
        except ValueError:
            return False
    if max_ctx is None or not 0 < max_ctx < context:
        return False
    logger.warning(
        "context %d exceeds the model's max_position_embeddings %d: positions beyond it are extrapolation%s",
        context, max_ctx, note,
    )  # fmt: skip
    return True


def check_context_fits(config: Any, context: int) -> None:
    """Before running a model over ``context`` tokens: ``ValueError`` when its positions come from a learned
    table (``LEARNED_POSITIONS``) shorter than ``context`` (torch's ``index out of range`` otherwise, inside
    the model); else :func:`warn_beyond_max_positions` (RoPE and ALiBi models extrapolate)."""
    model_type = str(_get(text_config(config), "model_type", default=""))
    try:
        max_ctx = max_positions(config)
    except ValueError:
        max_ctx = None
    if model_type in LEARNED_POSITIONS and max_ctx is not None and 0 < max_ctx < context:
        raise ValueError(
            f"context {context} exceeds the {max_ctx} positions of this {model_type} model's learned position "
            f"table: it has no embedding for positions past {max_ctx - 1}; use a context of at most {max_ctx}"
        )
    warn_beyond_max_positions(config, context)


def _positive_window(value: Any, what: str) -> int | None:
    """A config's window: None when unset or <= 0 (no window), ``ValueError`` for 1 (keeps no token)."""
    w = _int(value, what)
    return check_window(w, f"config field {what}") if w is not None and w > 0 else None


def _attention(
    text: Any, layer_cfg: Any, index: int, layer_types: Sequence[str] | None
) -> tuple[str, int | None]:
    """``(kind, window)`` of layer ``index``, following transformers' cache construction."""
    if layer_types is not None:
        t = layer_types[index]
        if t in _SLIDING_TYPES:
            w = _positive_window(_get(layer_cfg, "sliding_window"), "sliding_window")
            return ("sliding", w) if w else ("full", None)
        if t in _CHUNKED_TYPES:
            # transformers caches chunked-attention layers as a sliding window of the chunk size
            w = _positive_window(_get(layer_cfg, "attention_chunk_size"), "attention_chunk_size")
            return ("sliding", w) if w else ("full", None)
        if t in _NO_KV_TYPES:
            return "none", None
        return "full", None  # _FULL_TYPES: model_shape refused any other type
    window = _positive_window(_get(layer_cfg, "sliding_window"), "sliding_window")
    if not isinstance(text, Mapping):  # a transformers config: its window, when set, applies to every layer
        return ("sliding", window) if window else _chunked(layer_cfg)
    use = _get(text, "use_sliding_window")
    if window and use is False:
        window = None  # Qwen2-style configs carry a window that is switched off
    if window:
        first_sliding = _int(_get(text, "max_window_layers"), "max_window_layers")
        pattern = _int(_get(text, "sliding_window_pattern"), "sliding_window_pattern")
        if use is True and first_sliding is not None:
            # Qwen2 (transformers' Qwen2Config): layers i >= max_window_layers use the window
            return ("sliding", window) if index >= first_sliding else ("full", None)
        if pattern:
            # Gemma legacy: every `pattern`-th layer is global
            return ("sliding", window) if (index + 1) % pattern else ("full", None)
        return "sliding", window  # Mistral: the window applies to every layer
    return _chunked(layer_cfg)


def _check_layer_types(layer_types: Sequence[str]) -> None:
    """``ValueError`` naming the layer types kvbits does not know (their KV cache may be compressed, shared or
    absent: planning them as full attention could be far off), with their layers, and the known types; for a type
    of ``_REFUSED_TYPES``, what it caches beside K/V."""
    unknown: dict[str, list[int]] = {}
    for i, t in enumerate(layer_types):
        if t not in _KNOWN_TYPES:
            unknown.setdefault(t, []).append(i)

    def where(idx: list[int]) -> str:
        return f"layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx[:4]))}{', ...' if len(idx) > 4 else ''}"

    refused = [(t, idx) for t, idx in sorted(unknown.items()) if t in _REFUSED_TYPES]
    if refused:
        t, idx = refused[0]
        raise ValueError(
            f"layer_types holds {t!r} ({len(idx)} {where(idx)}): {_REFUSED_TYPES[t]}; the kvbits planner prices (and "
            "QuantizedKVCache holds) full-attention, sliding-window and chunked layers"
        )
    if unknown:
        found = "; ".join(f"{t!r} ({len(idx)} {where(idx)})" for t, idx in sorted(unknown.items()))
        raise ValueError(
            f"layer_types holds layer types unknown to kvbits, whose KV cache it can not plan: {found}; known: "
            f"{', '.join(sorted(_KNOWN_TYPES))}"
        )


def _chunked(layer_cfg: Any) -> tuple[str, int | None]:
    """A layer without a sliding window: chunked attention (cached as a window of ``attention_chunk_size``), or
    full attention."""
    chunk = _positive_window(_get(layer_cfg, "attention_chunk_size"), "attention_chunk_size")
    return ("sliding", chunk) if chunk else ("full", None)


_BLOCK_ATTENTION_UNSUPPORTED = ("window_length", "sparsify", "num_sink_tokens")


def _blocks(text: Any, n_layers: int) -> Sequence[Any]:
    """``block_configs`` of a DeciLM / Nemotron-NAS config: ``ValueError`` unless one block per layer."""
    blocks = _get(text, "block_configs")
    if isinstance(blocks, (str, bytes, Mapping)) or not isinstance(blocks, Sequence) or len(blocks) != n_layers:
        raise ValueError(f"block_configs must be a list of one block per layer ({n_layers}), got {blocks!r:.200}")
    return blocks


def _block_kv_heads(block: Any, i: int, q: int) -> int:
    """KV heads of DeciLM block ``i``: ``q / n_heads_in_group``, or 0 for ``no_op`` / ``replace_with_linear``
    attention (no KV). ``ValueError`` for a block kvbits can not plan (windowed or sink attention, a group that
    does not divide the ``q`` query heads)."""
    att = _get(block, "attention")
    if att is None:
        raise ValueError(f"block_configs[{i}] has no 'attention' entry; got {block!r:.200}")
    if _get(att, "no_op") or _get(att, "replace_with_linear"):
        return 0
    unsupported = [k for k in _BLOCK_ATTENTION_UNSUPPORTED if _get(att, k)]
    if unsupported:
        raise ValueError(
            f"block_configs[{i}].attention sets {', '.join(unsupported)}: windowed / sink attention of "
            "DeciLM blocks is not planned by kvbits (plain or no-op attention only)"
        )
    what = f"block_configs[{i}].attention.n_heads_in_group"
    group = _int(_get(att, "n_heads_in_group"), what)
    if group is None or group < 1 or q % group:
        raise ValueError(f"{what} must divide num_attention_heads ({q}), got {group!r}")
    return q // group


def _block_layers(text: Any, n_layers: int) -> list[LayerShape]:
    """The layers of a DeciLM / Nemotron-NAS config (``block_configs``, one block per layer): its attention
    is ``n_heads_in_group`` query heads per KV head (``num_key_value_heads`` is null), or none at all
    (``no_op``, ``replace_with_linear``); see :func:`_block_kv_heads`."""
    q, _, d = attention_heads(text)
    kv_heads = [_block_kv_heads(block, i, q) for i, block in enumerate(_blocks(text, n_layers))]
    return [LayerShape(kv, d) if kv else LayerShape(0, 0, "none") for kv in kv_heads]


def _moe_layer(text: Any, index: int) -> bool:
    """Whether layer ``index`` of a mixture-of-experts config has experts (others have a dense MLP): Llama 4's
    ``moe_layers`` (or ``interleave_moe_layer_step``), Qwen2/3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, DeepSeek / GLM-4-MoE's ``first_k_dense_replace`` (LFM2-MoE / AFMoE:
    ``num_dense_layers``) and ``moe_layer_freq``, Jamba's ``expert_layer_period`` and ``expert_layer_offset``."""
    moe_layers = _get(text, "moe_layers")
    if isinstance(moe_layers, Sequence) and not isinstance(moe_layers, (str, bytes)):
        return index in moe_layers
    period = _int(_get(text, "expert_layer_period"), "expert_layer_period")
    if period:  # Jamba: experts where index % period == offset, a dense MLP elsewhere
        return index % period == (_int(_get(text, "expert_layer_offset"), "expert_layer_offset") or 0)
    step = _int(_get(text, "interleave_moe_layer_step", "decoder_sparse_step"), "decoder_sparse_step") or 1
    if step > 1 and (index + 1) % step:
        return False
    if index in (_get(text, "mlp_only_layers") or ()):
        return False
    first = _int(_get(text, "first_k_dense_replace", "num_dense_layers"), "first_k_dense_replace") or 0
    freq = _int(_get(text, "moe_layer_freq"), "moe_layer_freq") or 1
    return index >= first and index % freq == 0


def _shared_expert_width(text: Any, model_type: str, inter: int, expert_inter: int) -> int:
    """MLP width of the shared expert(s) of a mixture-of-experts layer, 0 without: Qwen2-MoE's
    ``shared_expert_intermediate_size``, DeepSeek / GLM's ``n_shared_experts`` experts, Llama 4's one of
    ``intermediate_size``."""
    width = _int(_get(text, "shared_expert_intermediate_size"), "shared_expert_intermediate_size")
    if width:
        return width
    shared = _int(_get(text, "n_shared_experts"), "n_shared_experts")
    if shared:
        return shared * expert_inter
    return inter if model_type.startswith("llama4") else 0


def _mamba_mixer_params(text: Any, h: int, dt_norms: bool = True) -> int:
    """Parameters of one Mamba (v1) mixer of a hybrid config that sets ``mamba_expand`` and ``mamba_d_state``
    (Jamba, Zamba), 0 for any other config (Mamba-2 ones, with ``mamba_n_heads``: :func:`_mamba2_mixer_params`). With ``E = mamba_expand * h``, ``N`` the state size, ``R`` the dt rank
    (``"auto"``: ``ceil(h / 16)``), ``C`` the conv width: ``in_proj`` ``2*h*E``, ``conv1d`` ``E*C (+E)``, ``x_proj``
    ``E*(R + 2N)``, ``dt_proj`` ``R*E + E``, ``A_log`` ``E*N``, ``D`` ``E``, ``out_proj`` ``E*h``, and with
    ``dt_norms`` Jamba's dt/B/C norms ``R + 2N`` (Zamba's multi-head mixer has none)."""
    expand = _get(text, "mamba_expand")
    state = _int(_get(text, "mamba_d_state"), "mamba_d_state")
    if expand is None or state is None or _get(text, "mamba_n_heads", "mamba_num_heads") is not None:
        return 0
    inner = int(expand * h)
    conv = _int(_get(text, "mamba_d_conv"), "mamba_d_conv") or 4
    rank = _get(text, "mamba_dt_rank")
    rank = -(-h // 16) if rank in (None, "auto") else _int(rank, "mamba_dt_rank")
    proj_bias = 2 * inner + h if _get(text, "mamba_proj_bias") else 0  # in_proj (2E) and out_proj (h) biases
    conv_bias = inner if _get(text, "mamba_conv_bias", default=True) else 0
    return (
        2 * h * inner + inner * conv + conv_bias + inner * (rank + 2 * state) + rank * inner + inner
        + inner * state + inner + inner * h + (rank + 2 * state if dt_norms else 0) + proj_bias
    )  # fmt: skip


def _mamba2_mixer_params(text: Any, h: int, model_type: str) -> int:
    """Parameters of one Mamba-2 mixer (Bamba, Falcon-H1, Nemotron-H: a config with ``mamba_n_heads`` /
    ``mamba_num_heads``), 0 for any other config. With ``E`` the inner width (Falcon-H1's ``mamba_d_ssm``, else
    ``mamba_expand * h``, Nemotron-H's heads times ``mamba_head_dim``), ``M`` heads, ``G`` groups, ``N`` the state
    size, ``C`` the conv width and ``X = E + 2*G*N`` the conv channels: ``in_proj`` ``h*(E + X + M)``, ``conv1d``
    ``X*C (+X)``, ``dt_bias`` / ``A_log`` / ``D`` ``3*M``, the gated norm ``E`` (Falcon-H1 only with
    ``mamba_rms_norm``), ``out_proj`` ``E*h``, plus projection biases when set."""
    heads = _int(_get(text, "mamba_n_heads", "mamba_num_heads"), "mamba_n_heads")
    if not heads:
        return 0
    inner = _int(_get(text, "mamba_d_ssm"), "mamba_d_ssm")
    if inner is None and _get(text, "mamba_expand") is not None:
        inner = int(_get(text, "mamba_expand") * h)
    if inner is None:
        inner = heads * (_int(_get(text, "mamba_d_head", "mamba_head_dim"), "mamba_head_dim") or 0)
    state = _int(_get(text, "mamba_d_state", "ssm_state_size"), "mamba_d_state") or 0
    groups = _int(_get(text, "mamba_n_groups", "n_groups"), "mamba_n_groups") or 1
    conv = _int(_get(text, "mamba_d_conv", "conv_kernel"), "mamba_d_conv") or 4
    in_bias = bool(_get(text, "mamba_proj_bias", "use_bias"))
    out_bias = bool(_get(text, "projectors_bias")) if model_type == "falcon_h1" else in_bias
    conv_bias = bool(_get(text, "mamba_conv_bias", "use_conv_bias", default=True))
    norm = model_type != "falcon_h1" or bool(_get(text, "mamba_rms_norm"))
    return _mamba2_layout(h, inner, heads, groups, state, conv, conv_bias, norm, in_bias, out_bias)


def _mamba2_layout(
    h: int, inner: int, heads: int, groups: int, state: int, conv: int,
    conv_bias: bool, norm: bool, in_bias: bool, out_bias: bool,
) -> int:  # fmt: skip
    """The Mamba-2 mixer count :func:`_mamba2_mixer_params` and :func:`_zamba2_mixer_params` share, once their
    fields are read: ``X = E + 2*G*N`` conv channels, ``in_proj`` ``h*(E + X + M)`` (+ its bias), ``conv1d``
    ``X*C`` (+ ``X``), ``3*M``, the gated norm ``E`` (when ``norm``), ``out_proj`` ``E*h`` (+ ``h``)."""
    channels = inner + 2 * groups * state
    in_proj = inner + channels + heads
    return (
        h * in_proj + in_proj * in_bias + channels * conv + channels * conv_bias + 3 * heads + inner * norm
        + inner * h + h * out_bias
    )  # fmt: skip


def _zamba2_mixer_params(text: Any, h: int) -> int:
    """Parameters of one Zamba2 Mamba-2 mixer: :func:`_mamba2_mixer_params`' layout under Zamba2's names
    (``n_mamba_heads`` ``M``, ``mamba_ngroups`` ``G``, ``E = mamba_expand * h``, ``X = E + 2*G*N``): ``in_proj``
    ``h*(E + X + M)``, ``conv1d`` ``X*C + X`` (its bias is always on, whatever ``use_conv_bias``), ``dt_bias`` /
    ``A_log`` / ``D`` ``3*M``, the gated norm ``E``, ``out_proj`` ``E*h``; with ``add_bias_linear`` the two
    projections' biases."""
    heads = _int(_get(text, "n_mamba_heads"), "n_mamba_heads") or 8
    inner = int((_get(text, "mamba_expand") or 2) * h)
    state = _int(_get(text, "mamba_d_state"), "mamba_d_state") or 0
    groups = _int(_get(text, "mamba_ngroups"), "mamba_ngroups") or 1
    conv = _int(_get(text, "mamba_d_conv"), "mamba_d_conv") or 4
    bias = bool(_get(text, "add_bias_linear"))
    return _mamba2_layout(h, inner, heads, groups, state, conv, True, True, bias, bias)


def _zamba_params(
    text: Any, model_type: str, h: int, inter: int, layer_types: Sequence[str], tied: bool
) -> dict[str, int]:
    """``attention`` / ``mlp`` / ``norms`` of a Zamba or Zamba2 decoder: every layer a Mamba mixer (Zamba's multi-head
    Mamba-1, :func:`_mamba_mixer_params` without dt norms; Zamba2's Mamba-2, :func:`_zamba2_mixer_params`) and its
    norm ``h``; each ``hybrid`` layer also an ``h*h`` linear and a call of shared transformer block ``i % B`` (its
    ``i``-th hybrid layer; ``B = num_mem_blocks``, Zamba: 1): attention on ``A = attention_hidden_size`` (``2h``)
    inputs ``A*H_q*D + 2*A*H_kv*D + H_q*D*h``, a gated MLP ``3*h*I``, norms ``A + h``. Zamba2's block ``b`` also holds
    a LoRA of rank ``r = adapter_rank`` for each of its ``n_b`` hybrid layers on the MLP's gate/up ``h*r + r*2I``
    (with ``use_shared_attention_adapter`` three on q/k/v ``3*(A*r + r*A)``), with ``add_bias_linear`` the MLP's
    biases ``2I + h``. transformers ties a block's copies only under ``tied`` (``tie_word_embeddings``): then each
    block counts once, else every hybrid layer holds its own copy (block ``b``'s ``n_b`` times). The final norm ``h``."""
    n_layers = len(layer_types)
    hybrid = sum(t == "hybrid" for t in layer_types)
    zamba2 = model_type == "zamba2"
    mixer = _zamba2_mixer_params(text, h) if zamba2 else _mamba_mixer_params(text, h, dt_norms=False)
    n_blocks = (_int(_get(text, "num_mem_blocks"), "num_mem_blocks") or 1) if zamba2 else 1
    served = [len(range(b, hybrid, n_blocks)) for b in range(min(n_blocks, hybrid))]  # n_b: hybrid layers per block
    copies = [1 if tied else n for n in served]
    blocks = sum(copies)
    q, kv, d = attention_heads(text)
    width = _int(_get(text, "attention_hidden_size"), "attention_hidden_size") or 2 * h
    attention = n_layers * mixer + hybrid * h * h + blocks * (width * q * d + 2 * width * kv * d + q * d * h)
    mlp = blocks * 3 * h * inter
    if zamba2:
        rank = _int(_get(text, "adapter_rank"), "adapter_rank") or 0
        adapters = sum(c * n for c, n in zip(copies, served))
        mlp += adapters * (h * rank + rank * 2 * inter) + (blocks * (2 * inter + h) if _get(text, "add_bias_linear") else 0)
        if _get(text, "use_shared_attention_adapter"):
            attention += adapters * 3 * 2 * width * rank
    return {"attention": attention, "mlp": mlp, "norms": (n_layers + 1) * h + blocks * (width + h)}


def _short_conv_params(text: Any, h: int) -> int:
    """Parameters of one LFM2 short-convolution block (a ``conv`` layer): ``in_proj`` ``3*h*h``, a depthwise
    ``conv`` of ``conv_L_cache`` taps ``h*C``, ``out_proj`` ``h*h``; with ``conv_bias`` their ``3h + h + h`` biases."""
    taps = _int(_get(text, "conv_L_cache"), "conv_L_cache") or 3
    bias = 5 * h if _get(text, "conv_bias") else 0
    return 4 * h * h + h * taps + bias


def _gated_deltanet_params(text: Any, h: int) -> int:
    """Parameters of one Qwen3-Next linear-attention (Gated DeltaNet) layer: with ``K = linear_num_key_heads *
    linear_key_head_dim``, ``Vd = linear_num_value_heads * linear_value_head_dim``, ``M`` value heads, ``C`` the
    conv width: ``in_proj_qkvz`` ``h*(2K + 2Vd)``, ``in_proj_ba`` ``h*2M``, ``conv1d`` ``(2K + Vd)*C``,
    ``dt_bias`` / ``A_log`` ``2M``, the gated norm ``linear_value_head_dim``, ``out_proj`` ``Vd*h``."""
    k_heads = _int(_get(text, "linear_num_key_heads"), "linear_num_key_heads") or 0
    v_heads = _int(_get(text, "linear_num_value_heads"), "linear_num_value_heads") or 0
    v_dim = _int(_get(text, "linear_value_head_dim"), "linear_value_head_dim") or 0
    key = k_heads * (_int(_get(text, "linear_key_head_dim"), "linear_key_head_dim") or 0)
    value = v_heads * v_dim
    conv = _int(_get(text, "linear_conv_kernel_dim"), "linear_conv_kernel_dim") or 4
    return h * (2 * key + 2 * value) + h * 2 * v_heads + (2 * key + value) * conv + 2 * v_heads + v_dim + value * h


def _layer_type_names(text: Any, n_layers: int) -> list[str]:
    """Each layer's ``layer_types`` (Bamba / Falcon-H1: ``layers_block_type``) entry, ``""`` where the config has
    none; a Bamba dict without them: ``full_attention`` on ``attn_layer_indices``, Mamba elsewhere."""
    types = _get(text, "layer_types", "layers_block_type")
    if isinstance(types, Sequence) and not isinstance(types, (str, bytes)):
        return [str(t) for t in list(types)[:n_layers]] + [""] * max(0, n_layers - len(types))
    attn = _get(text, "attn_layer_indices")
    if isinstance(attn, Sequence) and not isinstance(attn, (str, bytes)):
        return ["full_attention" if i in attn else "mamba" for i in range(n_layers)]
    return [""] * n_layers


def _mixer_params(text: Any, model_type: str, h: int, layer_type: str) -> tuple[bool, int]:
    """``(attention, mixer)`` of one layer of type ``layer_type``: whether it holds attention weights, and the
    parameters of the token mixer beside or in place of them (:func:`_mamba2_mixer_params`,
    :func:`_short_conv_params`, :func:`_gated_deltanet_params`; 0 for none). Falcon-H1 runs attention and a
    Mamba-2 mixer side by side in every layer; Nemotron-H's ``moe`` / ``mlp`` layers hold neither."""
    if model_type == "falcon_h1":
        return True, _mamba2_mixer_params(text, h, model_type)
    if layer_type == "conv":
        return False, _short_conv_params(text, h)
    if layer_type in ("linear_attention", "mamba"):
        if model_type.startswith("qwen3_next"):
            return False, _gated_deltanet_params(text, h)
        return False, _mamba2_mixer_params(text, h, model_type)
    if layer_type in ("moe", "mlp") and model_type == "nemotron_h":
        return False, 0
    return True, 0


def _lfm2_mlp_width(text: Any, inter: int) -> int:
    """LFM2's MLP width: with ``block_auto_adjust_ff_dim``, ``2/3`` of ``intermediate_size``, times
    ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` when that multiplier is set."""
    if not _get(text, "block_auto_adjust_ff_dim", default=True):
        return inter
    inter = int(2 * inter / 3)
    mult = _get(text, "block_ffn_dim_multiplier")
    if mult is not None:
        multiple = _int(_get(text, "block_multiple_of"), "block_multiple_of") or 256
        inter = int(mult * inter)
        inter = multiple * (-(-inter // multiple))
    return inter


def _nemotron_h_mlp(text: Any, h: int, inter: int, layer_type: str) -> int:
    """MLP parameters of one Nemotron-H layer: ungated ``2*h*I`` on ``mlp`` layers; on ``moe`` layers ``E`` ungated
    experts of ``moe_intermediate_size`` on ``h`` (or ``moe_latent_size``, with its two ``h`` projections), the
    router ``E*h`` and a shared MLP of ``moe_shared_expert_intermediate_size``; nothing on other layers."""
    if layer_type == "mlp":
        return 2 * h * inter
    if layer_type != "moe":
        return 0
    experts = _int(_get(text, "n_routed_experts", "num_local_experts"), "n_routed_experts") or 0
    width = _int(_get(text, "moe_intermediate_size"), "moe_intermediate_size") or inter
    latent = _int(_get(text, "moe_latent_size"), "moe_latent_size")
    shared = _int(_get(text, "moe_shared_expert_intermediate_size"), "moe_shared_expert_intermediate_size") or 0
    return experts * 2 * (latent or h) * width + experts * h + 2 * h * shared + (2 * h * latent if latent else 0)


def _out_proj_bias(text: Any, model_type: str) -> bool:
    """Whether each attention layer's output projection has a bias: Seed-OSS's ``attention_out_bias``, else
    ``attention_bias`` except on the :data:`_QKV_ONLY_BIAS` architectures (``qkv_bias`` never biases it)."""
    out_bias = _get(text, "attention_out_bias")
    if out_bias is not None:
        return bool(out_bias)
    return bool(_get(text, "attention_bias")) and not model_type.startswith(_QKV_ONLY_BIAS)


def _learned_positions(text: Any, model_type: str) -> int:
    """Rows of a learned absolute-position table (``LEARNED_POSITIONS``, or a GPT-2-style dict without a
    ``model_type``; 0 for other models): :func:`max_positions`, OPT's plus the 2 rows it offsets by."""
    if model_type not in LEARNED_POSITIONS and (model_type or "n_embd" not in _keys(text)):
        return 0
    n = max_positions(text) or 0
    return n + 2 if n and model_type == "opt" else n


def _dtype_field(cfg: Any) -> Any:
    """``dtype`` (transformers 5) or the older ``torch_dtype``, without tripping deprecation warnings."""
    if isinstance(cfg, Mapping):
        return cfg.get("dtype") or cfg.get("torch_dtype")
    if hasattr(cfg, "dtype"):
        return cfg.dtype
    return getattr(cfg, "torch_dtype", None)


def quantized_weights(config: Any) -> str | None:
    """How ``config``'s ``quantization_config`` stores the weights (``"mxfp4"``, ``"gptq 4-bit"``, ``"gguf Q4_1/Q8_0"``),
    or None when they are floats: no ``quantization_config``, GGUF dequantized on load (``dequantize=True``: floats of
    the config's dtype), or compressed-tensors quantizing the KV cache alone (no weight ``config_groups``: what
    ``kvbits export`` writes). A ``.gguf`` file of quantized blocks gets its ``quantization_config`` from
    :func:`kvbits.plan.sources.resolve_config` (its GGML ``weight_types``)."""
    qc = _get(config, "quantization_config")
    if qc is None:
        qc = _get(text_config(config), "quantization_config")
    if hasattr(qc, "to_dict"):  # a transformers QuantizationConfigMixin, on a loaded model's config
        qc = qc.to_dict()
    if qc is None or (isinstance(qc, Mapping) and not qc):
        return None
    if not isinstance(qc, Mapping):
        return f"quantization_config {qc!r:.60}"
    method = str(qc.get("quant_method") or "unknown quant_method")
    groups = qc.get("config_groups") or {}
    if (method == "gguf" and qc.get("dequantize") is True) or (
        method == "compressed-tensors" and not any(isinstance(g, Mapping) and g.get("weights") for g in groups.values())
    ):
        return None
    types = qc.get("weight_types")
    if method == "gguf" and isinstance(types, Sequence) and not isinstance(types, str) and types:
        return f"gguf {'/'.join(map(str, types))}"
    bits = qc.get("bits") or (4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else None)
    return f"{method} {bits}-bit" if bits else method


def model_shape(config: Any, *, name: str = "", rope: bool = False) -> ModelShape:
    """Read a :class:`ModelShape` from a transformers config object or a plain mapping.

    ``rope=True``: also each full-attention layer's ``LayerShape.rope_tables``, from the model's own rotary module
    (:func:`_rope_tables`; builds it, so imports torch). Without it every layer keeps the default ``"half"``.

    Raises:
        ValueError: the config lacks layers or heads, or describes something kvbits can not plan
            (multi-head latent attention, values of another head dim than the keys: ``v_head_dim``).
    """
    if isinstance(config, ModelShape):
        return config
    text = text_config(config)
    n_layers = _int(_get(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers"), "num_hidden_layers")
    if n_layers is None or n_layers < 1:
        raise ValueError(
            f"config has no layer count: expected num_hidden_layers (or n_layer / num_layers) >= 1, "
            f"got {n_layers!r}; keys: {_keys(text)}"
        )
    check_layer_count(n_layers, "config field num_hidden_layers")  # before one LayerShape per layer is built
    model_type = _get(text, "model_type")
    if model_type in _RECURRENT_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} has no attention layers (each layer keeps a recurrent state, not a KV cache): "
            "nothing for the kvbits planner to plan"
        )
    layer_cfgs = layer_configs(text, n_layers)
    if (latent := latent_attention(text)) is not None:
        raise ValueError(latent_attention_message(text, latent, name or "the config", "the kvbits planner"))
    layer_types = _get(text, "layer_types")
    if layer_types is not None:
        if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, Sequence) or not all(
            isinstance(t, str) for t in layer_types
        ):
            raise ValueError(
                f"layer_types must be a list of strings, one per layer (e.g. 'full_attention', 'sliding_attention'), "
                f"got {layer_types!r}"
            )
        layer_types = list(layer_types)
        if len(layer_types) < n_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
        _check_layer_types(layer_types[:n_layers])
    sharing = _get(text, "kv_sharing_modes")
    if sharing is not None:
        sharing = list(sharing)
        if len(sharing) < n_layers:
            raise ValueError(f"kv_sharing_modes has {len(sharing)} entries for {n_layers} layers")
    layers = []
    for i, lc in enumerate(layer_cfgs):
        kind, window = _attention(text, lc, i, layer_types)
        if sharing is not None and sharing[i] == "reuse":
            kind, window = "none", None  # reads the KV of an earlier layer (Gemma-3n/4 KV sharing)
        _, kv, d = attention_heads(lc)
        v_dim = _int(_get(lc, "v_head_dim"), "v_head_dim")
        if kind != "none" and v_dim is not None and v_dim != d:  # MiMo-V2-Flash: keys of 192 channels, values of 128
            raise ValueError(
                f"layer {i} caches keys of head_dim {d} channels and values of v_head_dim {v_dim}: the kvbits "
                "planner (and QuantizedKVCache) count one head dim for K and V (MHA/GQA/MQA only)"
            )
        layers.append(LayerShape(kv, d, kind, window))
    if _get(text, "block_configs") is not None:  # DeciLM / Nemotron-NAS: KV heads per block
        layers = _block_layers(text, n_layers)
    if rope:
        layers = _rope_tables(config, layers)
    dtype = dtype_bytes_of(_dtype_field(text)) or dtype_bytes_of(_dtype_field(config))
    if dtype is None:
        logger.debug("config carries no known dtype; assuming 2 bytes (fp16/bf16)")
    max_ctx = max_positions(text)
    if not name:
        name = str(_get(config, "_name_or_path") or _get(text, "model_type") or "")
    problem = None if isinstance(text, Mapping) else pre_rope_problem(text)
    if problem is not None and name != model_type:  # the message names the model type whatever the model's name
        problem = f"(model_type {model_type!r}) {problem}"
    shape = ModelShape(
        tuple(layers), dtype_bytes=dtype or 2, name=name, max_context=max_ctx, weights_quantized=quantized_weights(config),
        pre_rope_problem=problem,
    )  # fmt: skip
    try:
        params = estimate_params(text, shape)
    except ValueError as exc:  # weights are optional for planning; say why they are missing
        logger.info("no parameter estimate for %s: %s", name or "this config", exc)
        params = None
    return shape.replace(params=params)


def load_shape(config: ConfigLike, *, rope: bool = False) -> ModelShape:
    """:func:`resolve_config`, :func:`check_causal_config`, then :func:`model_shape` (``rope``: see there): the
    planner's entry point for any config."""
    cfg, name = resolve_config(config)
    if not isinstance(cfg, ModelShape):
        check_causal_config(cfg)
    return model_shape(cfg, name=name, rope=rope)


def _rope_tables(config: Any, layers: list[LayerShape]) -> list[LayerShape]:
    """``layers`` with ``rope_tables`` set for the full-attention ones as ``QuantizedKVCache(fused_decode=True)``
    keeps them: from the tables the cache builds (``RotaryTables.from_config(config).tables_for_layer(i)``),
    ``"none"`` where ``kvbits.cache.fused.layout_reason`` serves pre-RoPE keys without tables (a NoPE layer:
    ``rot_dim`` 0) or declines them (partial rotary, a length-dependent rope type). Unchanged (``"half"``) when no
    tables can be built: a plain mapping (no transformers config), a family without RoPE or of another convention
    (the cache refuses pre-RoPE keys there)."""
    if isinstance(text_config(config), Mapping) or not any(layer.attention == "full" for layer in layers):
        return layers
    from kvbits.quant.rope import RotaryTables  # imports torch: only asked for by fused_decode plans

    try:
        rotary = RotaryTables.from_config(config)
        tables = [rotary.tables_for_layer(i) if layer.attention == "full" else None for i, layer in enumerate(layers)]
    except (ValueError, NotImplementedError) as exc:
        logger.debug("no RoPE tables for this config (%s): counting half-width tables", exc)
        return layers
    out = []
    for layer, t in zip(layers, tables):
        if t is not None:
            served = t.rot_dim and t.fused_reason() is None  # else no RoPE (rot_dim 0) or declined
            kind = "none" if not served else "half" if t.halves_equal else "full"
            layer = dataclasses.replace(layer, rope_tables=kind)
        out.append(layer)
    return out


SUPPORTED_MODELS = (
    "kvbits supports decoder-only causal language models (*ForCausalLM: Llama, Qwen, Gemma, GPT-2, ...; the "
    "attention layers of hybrid decoders such as LFM2 and Jamba; the language decoder of a vision-language model)"
)
"""What kvbits runs on, for the refusals of :func:`check_causal_config` and ``kvbits._model.check_causal_lm``."""


def check_causal_config(config: Any, what: str = "") -> None:
    """``ValueError`` unless ``config`` (a transformers config or a mapping) may describe a decoder-only causal LM.

    Refused: ``is_encoder_decoder`` (T5, BART, Whisper, MusicGen: the decoder's cross-attention K/V, one entry per
    encoder token, are neither planned nor quantized by kvbits), and an encoder (its text config's ``model_type`` has
    a masked-LM head in transformers: BERT, RoBERTa, DistilBERT, ...) not configured with ``is_decoder=True``: its
    attention is bidirectional, so it keeps no KV cache while decoding. ``what`` names the model in the message
    (default: the config's class, or its ``model_type``).
    """
    text = text_config(config)
    model_type = _get(text, "model_type")
    name = what or (f"model type {model_type!r}" if isinstance(config, Mapping) else type(config).__name__)
    if _get(config, "is_encoder_decoder") is True or _get(text, "is_encoder_decoder") is True:
        raise ValueError(
            f"{name} is not a decoder-only causal LM but an encoder-decoder model: its decoder also attends to the "
            f"encoder's output through cross-attention, whose K/V kvbits neither stores, quantizes nor plans; "
            f"{SUPPORTED_MODELS}"
        )
    if not isinstance(model_type, str) or _get(text, "is_decoder") is True:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ValueError(
            f"{name} is not a decoder-only causal LM but an encoder (model type {model_type!r} without "
            f"is_decoder=True): its attention is bidirectional, so it keeps no KV cache while decoding; {SUPPORTED_MODELS}"
        )


# ------------------------------------------------------------------------------ weights


def estimate_params(config: Any, shape: ModelShape | None = None) -> dict[str, int]:
    """Estimate a decoder-only model's parameter count from its config, by part.

    With ``h`` hidden size, ``V`` vocabulary, ``H_q`` query heads, per layer ``H_kv`` KV heads and
    head dim ``D``, ``I`` MLP width, ``L`` layers::

        embeddings = V*h  (+ P*h learned positions: GPT-2 and GPT-BigCode ``n_positions``, GPT-Neo and OPT
                          ``max_position_embeddings``, OPT's + 2)
        attention  = sum over layers of  h*H_q*D (q) + 2*h*H_kv*D (k, v) + H_q*D*h (o)
                     (+ q/k/v biases for Qwen2 or ``attention_bias``, + the o_proj bias h where
                     ``attention_bias`` covers it: :func:`_out_proj_bias`)
        mlp        = L * m*h*I,  m = 3 for gated MLPs (Llama, Mistral, Qwen, Gemma), 2 otherwise (GPT-2);
                     MoE: per layer with experts E*3*h*I_e + h*E router + 3*h*I_shared (shared experts), the
                     other layers a dense 3*h*I (Llama 4: ``intermediate_size_mlp``)
        norms      = (2L + 1) * h   (4L + 1 for Gemma-2/3; + 2*D per layer for q/k norms: Gemma-3, Qwen3)
        lm_head    = V*h unless ``tie_word_embeddings``

    Hybrid layers count their own token mixer in ``attention``: Jamba's Mamba, Bamba / Nemotron-H's Mamba-2 (and
    Falcon-H1's, beside attention in every layer), LFM2's short convolutions, Qwen3-Next's Gated DeltaNet
    (:func:`_mixer_params`); Nemotron-H's layers hold one block each (:func:`_nemotron_h_mlp`). Zamba / Zamba2 run
    a Mamba mixer in every layer and, on their ``hybrid`` layers, shared transformer blocks counted once (Zamba2's
    per-layer LoRA adapters apart: :func:`_zamba_params`).

    Biases of MLPs and LayerNorms are ignored (well under 1% of any real model). Vision towers of
    composite models are not counted. Exact for Llama-family models; pass ``weights_gib`` to the
    planner when the real figure is known.

    Raises:
        ValueError: the config lacks ``hidden_size`` or ``vocab_size``.
    """
    text = text_config(config)
    if _get(text, "block_configs") is not None:
        raise ValueError(
            "block_configs (DeciLM / Nemotron-NAS) give every layer its own MLP width: not estimated; pass "
            f"{spell('weights_gib', '--weights-gib')}"
        )
    shape = shape or model_shape(text)
    h = _int(_get(text, "hidden_size", "n_embd", "d_model"), "hidden_size")
    vocab = _int(_get(text, "vocab_size", "padded_vocab_size"), "vocab_size")
    if h is None or vocab is None:
        raise ValueError(
            f"estimating weights needs hidden_size and vocab_size; got hidden_size={h}, vocab_size={vocab}"
        )
    model_type = str(_get(text, "model_type", default=""))
    q_heads = _int(_get(text, "num_attention_heads", "n_head", "num_heads", "n_heads"), "num_attention_heads")
    n_layers = shape.n_layers
    embeddings = vocab * h
    embeddings += _learned_positions(text, model_type) * h
    qkv_bias = bool(_get(text, "attention_bias", "qkv_bias")) or model_type.startswith("qwen2")
    out_bias = h if _out_proj_bias(text, model_type) else 0
    attention = 0
    mamba = _mamba_mixer_params(text, h)
    layer_types = _layer_type_names(text, n_layers)
    has_attention = []
    q_factor = 2 if model_type.startswith("qwen3_next") else 1  # Qwen3-Next's q_proj also yields an output gate
    for layer, layer_type in zip(shape.layers, layer_types):
        if layer.attention == "none" and mamba:  # Jamba: a Mamba mixer in place of attention
            attention += mamba
            has_attention.append(False)
            continue
        attends, mixer = _mixer_params(text, model_type, h, layer_type)
        attention += mixer
        has_attention.append(attends)
        if not attends:
            continue
        hq = q_heads or layer.kv_heads
        d = layer.head_dim
        attention += (1 + q_factor) * h * hq * d + 2 * h * layer.kv_heads * d
        if qkv_bias:
            attention += q_factor * hq * d + 2 * layer.kv_heads * d
        attention += out_bias
    inter = _int(
        _get(text, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"), "intermediate_size"
    )
    if inter is None:
        inter = 4 * h  # GPT-2's n_inner=None
    gated = model_type not in _UNGATED_MLP and "n_embd" not in _keys(text)
    if model_type == "lfm2":
        inter = _lfm2_mlp_width(text, inter)
    experts = _int(_get(text, "num_local_experts", "num_experts", "n_routed_experts"), "num_experts")
    if model_type == "nemotron_h":  # one block per layer: Mamba-2, attention, an MLP or experts
        mlp = sum(_nemotron_h_mlp(text, h, inter, t) for t in layer_types)
    elif experts:
        expert_inter = _int(_get(text, "moe_intermediate_size"), "moe_intermediate_size") or inter
        shared_inter = _shared_expert_width(text, model_type, inter, expert_inter)
        shared_gate = h if _get(text, "shared_expert_intermediate_size") else 0  # Qwen2-MoE / Qwen3-Next: h -> 1
        moe = experts * 3 * h * expert_inter + h * experts + 3 * h * shared_inter + shared_gate
        dense_inter = _int(_get(text, "intermediate_size_mlp"), "intermediate_size_mlp") or inter  # Llama 4
        n_moe = sum(_moe_layer(text, i) for i in range(n_layers))
        mlp = n_moe * moe + (n_layers - n_moe) * 3 * h * dense_inter
    else:
        mlp = n_layers * (3 if gated else 2) * h * inter
    # Gemma-2/3 add pre/post-feedforward norms (4 per layer); Gemma-3 and Qwen3 normalise q and k per head
    # Nemotron-H: one norm per layer (its layers hold one block each)
    per_layer_norms = 4 if model_type.startswith(("gemma2", "gemma3")) else 1 if model_type == "nemotron_h" else 2
    norms = (per_layer_norms * n_layers + 1) * h
    if model_type.startswith(("gemma3", "qwen3", "olmo2", "lfm2")):  # on the layers with attention only
        norms += sum(2 * layer.head_dim for layer, attends in zip(shape.layers, has_attention) if attends)
    tied = _get(text, "tie_word_embeddings")
    if tied is None:
        tied = _get(config, "tie_word_embeddings", default=True)
    lm_head = 0 if tied else vocab * h
    if model_type in ("zamba", "zamba2"):  # shared transformer blocks beside a Mamba mixer in every layer
        return {"embeddings": embeddings, **_zamba_params(text, model_type, h, inter, layer_types, bool(tied)), "lm_head": lm_head}
    return {"embeddings": embeddings, "attention": attention, "mlp": mlp, "norms": norms, "lm_head": lm_head}
