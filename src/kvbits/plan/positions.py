"""Whether a model's keys can be cached before RoPE, read from its config alone (no torch, no modeling import).

Pre-RoPE schemes (a scheme whose key side has ``pre_rope``: ``kvquant-4``, ``int4-channel-prerope``) un-rotate the
keys a model caches and rotate them back on every read, so they need a model that rotates its keys, by rotate-half
RoPE. The cache finds out by building the family's rotary module (``kvbits.quant.rope.RotaryTables.from_config``,
which imports the modeling file and torch); the planner asks :func:`pre_rope_problem`, which reads the same
config fields (:func:`no_rope_reason`, shared with ``RotaryTables``) and the family's modeling source as text.

It refuses, for a transformers config:

- families with learned absolute positions (``LEARNED_POSITIONS``: GPT-2, GPTBigCode, GPT-Neo, OPT) or ALiBi
  biases (``ALIBI_FAMILIES``: BLOOM, MPT), and every other family whose transformers modeling file names no text
  ``*RotaryEmbedding`` class (XGLM, BioGPT, CTRL, Jamba, ...): what ``RotaryTables`` refuses as "no
  ``*RotaryEmbedding`` class";
- configs of a rotary family that say this model does not rotate (Falcon ``alibi=True``, GraniteMoeHybrid without
  ``position_embedding_type="rope"``, Zamba2 without ``use_mem_rope=True``);
- families that rotate interleaved pairs (``INTERLEAVED_SINUSOID``: GPT-J, CodeGen) and those that normalise
  their keys after RoPE (``KEYS_NORMED_AFTER_ROPE``: HunYuan), which the cache refuses as well.

- families whose ``apply_rotary_pos_emb`` is not rotate-half (``NOT_ROTATE_HALF``: Cohere, GLM, Helium, ERNIE 4.5,
  Llama 4, ...), which ``RotaryTables`` refuses by this same list (and its probe of ``apply_rotary_pos_emb``
  finds for any other family);
- configs with ``rope_interleave=True`` (:func:`interleave_reason`: DeepSeek-V3, Mistral 4, Youtu, AXK1,
  GLM-4-MoE-Lite, Sarvam-MLA, whose default it is), which rotate interleaved channel pairs
  (``apply_rotary_pos_emb_interleave``) although the family's ``apply_rotary_pos_emb`` is rotate-half, so
  ``RotaryTables``' probe of the latter can not tell (it refuses them by this flag);
- configs with multi-head latent attention (``kv_lora_rank`` in any layer: DeepSeek-V2, DeepSeek-V3.2, AXK2,
  Bailing hybrid, Dots3 Note, MiniCPM3, ...; ``kvbits.plan.config.latent_attention``), whose cache holds a compressed
  latent, not K heads: ``RotaryTables`` and the caches refuse them by the same check and wording;
- configs whose RoPE parameters carry an ``mrope_section`` (multimodal RoPE, Qwen2-VL style: :func:`mrope_section`),
  and those of a family whose rotary module falls back to a default one (a Qwen2-VL config without it:
  :func:`default_mrope_section`, read from the modeling source), which the cache refuses before building tables.

Per layer, :func:`layer_rotates` tells a NoPE layer of a family that rotates (``RotaryTables.tables_for_layer`` gives
it ``rot_dim`` 0): flagged by its config (``no_rope_layers``, ``layer_rope_theta`` 0) or by a rule of its family's
attention forward (:data:`LAYER_ROTATES`: EXAONE 4 rotates only its sliding layers when ``sliding_window`` is set).

A config-only family (transformers ships its config but runs it with another family's model class: EXAONE with
``LlamaModel``) is judged by the modeling file that runs it (:func:`modeling_family`), as ``RotaryTables`` builds its
tables from that file. A family whose modeling file can not be found (a remote-code model) is not refused here: the
cache takes its tables from the loaded model (``rotary=``), which only it can check.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ALIBI_FAMILIES",
    "INTERLEAVED_SINUSOID",
    "KEYS_NORMED_AFTER_ROPE",
    "LAYER_ROTATES",
    "LEARNED_POSITIONS",
    "NON_TEXT_ROTARY",
    "NOT_ROTATE_HALF",
    "PER_LAYER_THETA",
    "default_mrope_section",
    "interleave_reason",
    "layer_rope_theta",
    "layer_rotates",
    "modeling_family",
    "mrope_section",
    "no_rope_reason",
    "pre_rope_problem",
]

LEARNED_POSITIONS = ("gpt2", "gpt_bigcode", "gpt_neo", "opt")
"""Families that add a learned absolute-position table to their inputs (no RoPE; a context beyond the table fails)."""
ALIBI_FAMILIES = ("bloom", "mpt")
"""Families that add ALiBi position biases to the attention scores (no RoPE)."""
INTERLEAVED_SINUSOID = ("gptj", "codegen")
"""Families that rotate interleaved pairs (rotate_every_two) from a fixed sinusoid table: refused by name, since
some transformers versions have a ``*RotaryEmbedding`` class for them (5.24) and others none (5.17)."""
KEYS_NORMED_AFTER_ROPE = ("hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text", "hunyuan_vl")
"""Families that normalise their keys after RoPE (``query_layernorm`` / ``key_layernorm``): their cached keys are no
rotation of a pre-RoPE key, so pre-RoPE key schemes have no frame to quantize in (kvbits.cache refuses them)."""
NOT_ROTATE_HALF = (
    "cohere", "cohere2", "cohere2_moe", "deepseek_v4", "ergo", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe_text",
    "glm", "glm4", "glm_ocr_text", "helium", "llama4_text", "nanochat",
)  # fmt: skip
"""Text model types whose ``apply_rotary_pos_emb`` is not rotate-half (``x * cos + rotate_half(x) * sin`` with
``rotate_half`` swapping the halves): interleaved channel pairs (Cohere, Helium, ERNIE 4.5: ``x[..., ::2]``; GLM and
DeepSeek-V4, which rotates its trailing channels: ``repeat_interleave``d tables; Llama 4: complex products of adjacent pairs) or the other sign (nanochat). Pre-RoPE
key schemes un-rotate rotate-half only: ``RotaryTables.from_config`` refuses these by name, the planner too; the
list is what its probe of ``apply_rotary_pos_emb`` refuses in transformers 5.25 (tests check each entry against it)."""
NON_TEXT_ROTARY = ("Vision", "Audio", "DiT", "Talker", "SaProt")
"""Tags of rotary modules of other modalities living in the same modeling file as the text model's."""


def _layer_type(text: Any, i: int) -> str | None:
    layer_types = getattr(text, "layer_types", None)
    return layer_types[i] if isinstance(layer_types, (list, tuple)) and 0 <= i < len(layer_types) else None


def _sliding_or_no_window(text: Any, i: int) -> bool:
    return getattr(text, "sliding_window", None) is None or _layer_type(text, i) == "sliding_attention"


def _sliding_with_window(text: Any, i: int) -> bool:
    return getattr(text, "sliding_window", None) is not None and _layer_type(text, i) == "sliding_attention"


def _sliding(text: Any, i: int) -> bool:
    return _layer_type(text, i) == "sliding_attention"


def _full(text: Any, i: int) -> bool:
    return _layer_type(text, i) == "full_attention"


LAYER_ROTATES: dict[str, Callable[[Any, int], bool]] = {
    # modeling_exaone4.py:234 / modeling_exaone_moe.py:185 / modeling_kolibri1.py:184 (EXAONE 4.5's text model is
    # exaone4): ``if self.sliding_window is None or self.is_sliding: ... apply_rotary_pos_emb``
    "exaone4": _sliding_or_no_window,
    "exaone_moe": _sliding_or_no_window,
    "kolibri1": _sliding_or_no_window,
    # modeling_afmoe.py:359: ``if self.is_local_attention:`` (layer_types[i] == "sliding_attention")
    "afmoe": _sliding,
    # modeling_flint.py:262/282: ``self.sliding_window = config.sliding_window if <sliding layer> else None`` and
    # ``if self.sliding_window is not None:``
    "flint": _sliding_with_window,
    # modeling_kolibri1_1.py:310: ``if self.is_sliding and not self.is_kv_shared_layer:`` (a KV-shared layer caches
    # nothing of its own); its indexed-attention layers are NoPE
    "kolibri1_1": _sliding,
    # modeling_lara_mini.py:1063: ``position_embeddings=position_embeddings if layer_type == "sliding_attention"``
    "lara_mini": _sliding,
    # modeling_olmo_hybrid.py:1036: only "full_attention" layers get position embeddings (the others are linear)
    "olmo_hybrid": _full,
}
"""Families whose attention rotates the keys of some layers only, by a rule in their modeling file rather than a
config list (each entry cites the line it mirrors, transformers 5.25): ``layer_rotates(text, i)`` for layer ``i``.
The other layers are NoPE: their cached keys are pre-RoPE keys already (tables of ``rot_dim`` 0)."""


PER_LAYER_THETA = ("granite_swa", "granitemoe_swa")
"""Families whose model builds one rotary module per distinct non-zero ``layer_rope_theta`` and hands layer ``i`` the
tables of base ``layer_rope_theta[i]`` (modeling_granite_swa.py:394 / modeling_granitemoe_swa.py:500, transformers
5.25: ``rope_parameters = {**config.rope_parameters, "rope_theta": theta}``). Muse Spark / Glimmer also carry
``layer_rope_theta`` but rotate every non-zero layer by their one global module (only ``0`` matters there)."""


def layer_rope_theta(text: Any, layer_idx: int) -> float | None:
    """The RoPE base layer ``layer_idx`` of ``text`` rotates by when its family sets it per layer
    (:data:`PER_LAYER_THETA`, ``layer_rope_theta[i]`` non-zero), else ``None`` (the config's global base)."""
    if getattr(text, "model_type", None) not in PER_LAYER_THETA:
        return None
    thetas = getattr(text, "layer_rope_theta", None)
    if not isinstance(thetas, (list, tuple)) or not 0 <= layer_idx < len(thetas) or not thetas[layer_idx]:
        return None
    return float(thetas[layer_idx])


def layer_rotates(text: Any, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` of the (text) config ``text`` rotates its keys by RoPE, for a model whose
    family rotates (``pre_rope_problem`` is ``None``): ``False`` for a layer flagged NoPE by its config
    (``no_rope_layers[i] == 0``: SmolLM3, Llama 4; ``layer_rope_theta[i] == 0``: Granite SWA, Muse Spark / Glimmer)
    or by its family's rule (:data:`LAYER_ROTATES`: EXAONE 4's global layers when ``sliding_window`` is set, ...)."""
    no_rope = getattr(text, "no_rope_layers", None)
    if isinstance(no_rope, (list, tuple)) and layer_idx < len(no_rope) and not no_rope[layer_idx]:
        return False
    thetas = getattr(text, "layer_rope_theta", None)
    if isinstance(thetas, (list, tuple)) and layer_idx < len(thetas) and not thetas[layer_idx]:
        return False
    rule = LAYER_ROTATES.get(getattr(text, "model_type", None))
    return True if rule is None else rule(text, layer_idx)


# values of a config's ``position_embedding_type`` that mean RoPE (GraniteMoeHybrid: "rope"; Evolla: "rotary")
_ROPE_EMBEDDING_TYPES = ("rope", "rotary")
_ROTARY_NAME = re.compile(r"\b(\w*RotaryEmbedding)\b")
# a rotary module's fallback section (Qwen2-VL: ``config.rope_parameters.get("mrope_section", [16, 24, 24])``)
# or per layer type (Cohere Compass: ``self.mrope_section[layer_type] = rope_params.get("mrope_section", [24, 20, 20])``)
_DEFAULT_MROPE = re.compile(
    r"self\.mrope_section(?:\[\w+\])?\s*=\s*[\w.]+\.get\(\s*[\"']mrope_section[\"']\s*,\s*(\[[\d,\s]*\])"
)


def no_rope_reason(text: Any) -> str | None:
    """Why a config whose family has a rotary module says this model does not rotate its keys, or ``None``.

    Falcon with ``alibi=True`` (Falcon-RW and the ALiBi variants) adds position biases instead,
    GraniteMoeHybrid with ``position_embedding_type`` other than ``"rope"`` (Granite 4.0-H's default ``None``:
    NoPE) builds no rotary module at all, and Zamba2 applies RoPE in its shared attention block only with
    ``use_mem_rope=True`` (its config's default is ``False``); their modeling files still define one, so without
    this check the tables would rotate keys the model never rotated (pre-RoPE keys quantized in a frame that does
    not exist). OLMo-Hybrid with ``rope_theta=None`` (its released checkpoints) builds no rotary module either: a
    ``rope_parameters`` whose ``rope_theta`` is ``None``."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params and params["rope_theta"] is None:
        return "it builds no rotary module (rope_parameters['rope_theta'] is None)"
    if getattr(text, "alibi", False) is True:
        return "it adds ALiBi position biases instead of rotating its keys (alibi=True)"
    if getattr(text, "use_mem_rope", True) is False:
        return "its shared attention block rotates no keys (use_mem_rope=False, Zamba2's default)"
    kind = getattr(text, "position_embedding_type", "rope")
    if kind not in _ROPE_EMBEDDING_TYPES:
        return f"it does not rotate its keys (position_embedding_type={kind!r}, not 'rope')"
    return None


def interleave_reason(text: Any) -> str | None:
    """Why a config's keys are rotated in interleaved channel pairs although its family's ``apply_rotary_pos_emb`` is
    rotate-half, or ``None``: ``rope_interleave=True`` (DeepSeek-V3, Mistral 4, Youtu, AXK1, GLM-4-MoE-Lite,
    Sarvam-MLA; the default of each) makes the attention call ``apply_rotary_pos_emb_interleave`` instead, which
    pairs channels ``(2i, 2i + 1)``, not ``(i, i + D_rot/2)``."""
    if getattr(text, "rope_interleave", False) is True:
        return (
            "it rotates interleaved channel pairs (rope_interleave=True: apply_rotary_pos_emb_interleave), not "
            "rotate-half"
        )
    return None


def mrope_section(text: Any) -> Any:
    """The ``mrope_section`` of multimodal RoPE (Qwen2-VL style: channel sections rotated by the time, height and
    width position axes) in ``text``'s RoPE parameters (``rope_parameters`` / ``rope_scaling``, or those of a layer
    type when they are given per layer type: Cohere Compass), else ``None``."""
    for params in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if not isinstance(params, Mapping):
            continue
        for p in (params, *(v for v in params.values() if isinstance(v, Mapping))):
            if p.get("mrope_section") is not None:
                return p["mrope_section"]
    return None


def _modeling_spec(model_type: str) -> Any:
    """The import spec of transformers' ``modeling_*`` file of ``model_type`` (found, not imported), or ``None``."""
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        name = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{name}.modeling_{name}")
    except (ImportError, ValueError, AttributeError):
        return None
    return spec if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=64)
def modeling_family(model_type: str) -> str | None:
    """The model type whose transformers modeling file runs ``model_type``'s models: ``model_type`` itself when
    transformers ships its modeling file; else, for a config-only family, the family whose model class transformers'
    auto mapping names for it (in transformers 5.25 EXAONE, InternLM3 and IQuest-Coder run ``LlamaModel``, Param2MoE
    and Sarvam-MoE ``Glm4MoeModel``); ``None`` when neither is found (a remote-code model). Found without importing
    any modeling file."""
    if _modeling_spec(model_type) is not None:
        return model_type
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    for names in (modeling_auto.MODEL_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        cls = names.get(model_type)
        if not isinstance(cls, str):
            continue
        for other, other_cls in names.items():
            if other_cls == cls and other != model_type and _modeling_spec(other) is not None:
                return other
    return None


@functools.lru_cache(maxsize=64)
def _modeling_source(model_type: str) -> str | None:
    """The text of the transformers modeling file that runs ``model_type`` (:func:`modeling_family`; read, not
    imported: the module imports torch and the family's layers); ``None`` when it can not be found."""
    family = modeling_family(model_type)
    spec = None if family is None else _modeling_spec(family)
    if spec is None:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _has_rotary_class(model_type: str) -> bool | None:
    """Whether transformers' modeling file of ``model_type`` names a text ``*RotaryEmbedding`` class; ``None`` when
    the file can not be found."""
    source = _modeling_source(model_type)
    if source is None:
        return None
    return any(not any(tag in n for tag in NON_TEXT_ROTARY) for n in _ROTARY_NAME.findall(source))


def default_mrope_section(model_type: Any) -> list[int] | None:
    """The ``mrope_section`` the rotary module of ``model_type`` falls back to when the config's RoPE parameters
    carry none (Qwen2-VL: ``[16, 24, 24]``), read from its modeling source; ``None`` when it has no such default
    (no multimodal RoPE, or none without the config's), or the file can not be found."""
    if not isinstance(model_type, str) or not model_type:
        return None
    match = _DEFAULT_MROPE.search(_modeling_source(model_type) or "")
    return None if match is None else [int(n) for n in re.findall(r"\d+", match.group(1))]


def pre_rope_problem(text: Any) -> str | None:
    """Why a model of the (text) config ``text`` can not cache its keys before RoPE, or ``None`` (it can, or this
    can not be told from a config: a plain mapping, no ``model_type``). The reason completes "model_type 'gpt2'
    ...": it does not rotate its keys, or rotates them in a way pre-RoPE keys do not support."""
    model_type = getattr(text, "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        return None
    # a config-only family (EXAONE) rotates as the family whose modeling file runs it (Llama)
    family = modeling_family(model_type)
    if family not in (None, model_type) and family in LEARNED_POSITIONS + ALIBI_FAMILIES + INTERLEAVED_SINUSOID + NOT_ROTATE_HALF:
        model_type = family
    if model_type in LEARNED_POSITIONS:
        return "does not rotate its keys: it adds learned absolute position embeddings to its inputs"
    if model_type in ALIBI_FAMILIES:
        return "does not rotate its keys: it adds ALiBi position biases to its attention scores"
    if model_type in INTERLEAVED_SINUSOID:
        return "rotates interleaved channel pairs from a fixed sinusoid table (pre-RoPE keys support rotate-half RoPE only)"
    if model_type in KEYS_NORMED_AFTER_ROPE:
        return "normalises its keys after RoPE (key_layernorm): its cached keys are no rotation of a pre-RoPE key"
    layout = None  # why its RoPE layout is not rotate-half
    if model_type in NOT_ROTATE_HALF:
        layout = (
            "applies RoPE in a layout other than rotate-half (interleaved channel pairs or another sign; pre-RoPE keys "
            "support rotate-half RoPE only)"
        )
    elif (interleaved := interleave_reason(text)) is not None:
        layout = f"applies RoPE in a layout other than rotate-half: {interleaved} (pre-RoPE keys support rotate-half RoPE only)"
    section = mrope_section(text)
    if section is None:
        section = default_mrope_section(model_type)
    if section is not None:  # first, as the cache refuses it first (GLM-OCR, ERNIE 4.5 VL: both reasons given)
        return (
            f"rotates its keys by multimodal RoPE (mrope_section {list(section)}): each channel section turns by its "
            "own position axis, so its keys have no single pre-RoPE frame" + ("" if layout is None else f"; it also {layout}")
        )
    if layout is not None:
        return layout
    from kvbits.plan.config import latent_attention, latent_attention_message  # config imports this module

    if (latent := latent_attention(text)) is not None:  # as RotaryTables and the caches refuse it
        why = "its keys rotate only their last qk_rope_head_dim channels, inside a cache that holds no K heads to un-rotate"
        return latent_attention_message(text, latent, "", "kvbits (its pre-RoPE keys and its caches)", why)
    why = no_rope_reason(text)
    if why is not None:
        return f"does not rotate its keys: {why}"
    if _has_rotary_class(model_type) is False:
        return "does not rotate its keys: its transformers modeling file defines no rotary embedding (*RotaryEmbedding)"
    return None
