"""A kvbits scheme as vLLM's KV-cache settings, when vLLM stores what kvbits measured.

vLLM serves one KV-cache format per engine (``--kv-cache-dtype``) and can leave chosen layers unquantized
(``--kv-cache-dtype-skip-layers 0 5``, ``CacheConfig.kv_cache_dtype_skip_layers``: those layers keep K/V in the
model's dtype). Both read from vLLM's source (``vllm/config/cache.py``) and its quantized KV cache page, whose
examples write the same forms (``--kv-cache-dtype-skip-layers 0 1 23``; ``kv_cache_dtype_skip_layers=[...]``, a list
of strings, which also takes layer-type names such as ``"sliding_window"``); vLLM was not run here. A kvbits scheme maps
onto them when every layer is either the base format or unquantized:

- base ``vllm-int4`` (Hadamard-rotated per-token INT4 with an integer zero-point) -> ``int4_per_token_head``;
- base ``vllm-int8`` (symmetric per-token INT8, float32 scales, codes rounded toward zero) -> ``int8_per_token_head``;
- base ``vllm-fp8-token`` or ``fp8-e4m3-token`` (FP8 E4M3 with a dynamic ``absmax / 448`` scale per token and head,
  float32 or float16) -> ``fp8_per_token_head`` (vLLM's codes are the nearest E4M3, ``cvt.rn``, as kvbits'; its
  scale float32, as ``vllm-fp8-token``'s);
- base ``fp8-e4m3`` / ``fp8-e4m3-head`` (static scales) -> ``fp8``: vLLM uses scale 1.0 unless the checkpoint
  carries calibrated scales (``kvbits export --calibration``), as kvbits does until calibrated; per-head scales
  also ``--attention-backend FLASH_ATTN``, the one backend that applies them (the others take each layer's largest);
- the ``*_per_token_head`` dtypes also ``--attention-backend TRITON_ATTN``, the backend vLLM's quantized KV cache
  page requires for them (``fp8_per_token_head`` also a GPU of compute capability 8.9 or more: a note says so);
- base ``fp16`` / ``bf16`` -> ``auto``;
- a layer stored as ``fp16`` or ``bf16`` -> a skipped layer;
- base ``fp16`` / ``bf16`` with layers stored in one of the formats above (``kvbits tune`` takes as base the
  candidate most layers use) -> that format, every other layer skipped: this needs the model's layer count
  (``num_layers``, ``kvbits export --scheme S --layers N``).

Anything vLLM has no setting for (sinks or a full-precision residual window, per-channel or grouped scales,
non-uniform codebooks, outliers, pre-RoPE or smoothed keys, 2- or 3-bit codes, a layer at another quantized format,
an FP8 rotation) is refused, naming each of these the scheme keeps, with what to change: flags that serve something other than what was measured
would make kvbits' figures describe the wrong cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbits.schemes import KVScheme, get_scheme

__all__ = [
    "CALCULATE_KV_SCALES_NOTE", "FNUZ_NOTE", "FP8_PER_TOKEN_HEAD_CC_NOTE", "FP8_STATIC", "PER_TOKEN_HEAD_BACKEND_NOTE",
    "VllmCacheArgs", "match_preset", "vllm_cache_args",
]

# the kvbits presets whose storage vLLM reproduces, by --kv-cache-dtype value
_FORMATS = {
    "vllm-int4": "int4_per_token_head", "vllm-int8": "int8_per_token_head", "vllm-fp8-token": "fp8_per_token_head",
    "fp8-e4m3-token": "fp8_per_token_head", "fp8-e4m3": "fp8", "fp8-e4m3-head": "fp8",
}  # fmt: skip
_UNQUANTIZED = ("fp16", "bf16")
FP8_STATIC = ("fp8-e4m3", "fp8-e4m3-head")
"""The presets whose static FP8 scales ``kvbits export --calibration`` writes (vLLM's ``fp8``)."""
CALCULATE_KV_SCALES_NOTE = (
    "do not add --calculate-kv-scales (calculate_kv_scales=True): vLLM versions that have it then compute k/v scales "
    "from the first batch it serves and skip the checkpoint's (read from vLLM's kv_cache.py, not run here), so the "
    "calibrated scales kvbits measured and exported would not be used"
)
"""Said wherever kvbits prints or writes a serve line for vLLM's static ``fp8`` cache (``vllm_cache_args``' notes,
``kvbits export --calibration``'s record): the one vLLM flag that silently discards the exported scales."""
_QUANTIZED_KVCACHE_PAGE = "docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/"
PER_TOKEN_HEAD_BACKEND_NOTE = (
    "vLLM's quantized KV cache page (" + _QUANTIZED_KVCACHE_PAGE + ") says the *_per_token_head cache dtypes need "
    "the Triton attention backend: --attention-backend TRITON_ATTN (given here; TritonAttentionBackend's name in "
    "vLLM's source, the one backend listing these dtypes; a vLLM without --attention-backend reads "
    "VLLM_ATTENTION_BACKEND=TRITON_ATTN instead)"
)
"""Said with every ``*_per_token_head`` dtype: why the settings name ``TRITON_ATTN``."""
FP8_PER_TOKEN_HEAD_CC_NOTE = (
    "fp8_per_token_head needs a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell: native FP8), per "
    "vLLM's quantized KV cache page (" + _QUANTIZED_KVCACHE_PAGE + "); on an older GPU (A100: 8.0) use "
    "int8_per_token_head (--scheme vllm-int8)"
)
FNUZ_NOTE = (
    "kvbits' FP8 scales are for OCP E4M3 (absmax / 448), the format kvbits measured; kvbits can not know the target "
    "GPU: on ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240), and vLLM's kv_cache.py (read, not run) doubles checkpoint "
    "k/v scales there (is_fp8_fnuz), which keeps the codes kvbits measured; check that your vLLM version does so "
    "before serving these scales on ROCm"
)
"""Said wherever kvbits prints or writes vLLM's static ``fp8`` cache: the exported scales assume OCP E4M3."""
# bytes per (KV head, token) of K and V together in vLLM's per-token-head caches: codes plus one inline float32 scale
# per side (its Triton backend's customize_spec), against 4D for a 16-bit layer
_PER_TOKEN_HEAD = {"int8_per_token_head": "2D + 8", "fp8_per_token_head": "2D + 8", "int4_per_token_head": "D + 8"}
_SKIP_PAGES_NOTE = (
    "skipped layers and vLLM's pages (read from vLLM's kv_cache_utils, not run): on a model whose layers are all full "
    "attention, vLLM groups them into one uniform-type KV cache group whose page is the sum of the layers' own, so "
    "each layer holds its own bytes, as kvbits plan counts them; on a model that also has sliding-window layers, "
    "vLLM must give every group one page size, and a 16-bit page (4D bytes per head and token) is not a whole "
    "multiple of a {page}-byte one, so vLLM pads the quantized pages to the 16-bit size (the savings of those "
    "layers lost) or refuses to start, depending on the attention backend; newer vLLM sources align skipped layers "
    "on any model (CacheConfig.skip_page_size_padded: the skipped layers' pages padded to the quantized layers' "
    "page, whose block size is raised to match), so the bytes per token may differ from kvbits plan's on a model "
    "of full-attention layers too: check the KV cache size vLLM logs"
)  # skip_page_size_padded: vllm-project/vllm vllm/config/cache.py at 002f10e (read, not run)


@dataclass(frozen=True)
class VllmCacheArgs:
    """vLLM's settings for a kvbits scheme: ``kv_cache_dtype``, the layers it leaves unquantized and, where only one
    backend stores what kvbits measured, ``attention_backend`` (``FLASH_ATTN`` for per-head FP8 scales,
    ``TRITON_ATTN`` for the ``*_per_token_head`` dtypes, the backend vLLM's docs name for them)."""

    scheme: str
    kv_cache_dtype: str
    skip_layers: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())
    attention_backend: str | None = None

    def cli(self) -> list[str]:
        """``vllm serve`` arguments, e.g. ``["--kv-cache-dtype", "int4_per_token_head",
        "--kv-cache-dtype-skip-layers", "0"]`` (nothing for ``auto`` with no skipped layer)."""
        out = [] if self.kv_cache_dtype == "auto" else ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.skip_layers:
            out += ["--kv-cache-dtype-skip-layers", *(str(i) for i in self.skip_layers)]
        if self.attention_backend is not None:
            out += ["--attention-backend", self.attention_backend]
        return out

    def engine_kwargs(self) -> dict[str, object]:
        """The same as ``vllm.LLM(...)`` keyword arguments (layer indices as strings, vLLM's type)."""
        kw: dict[str, object] = {"kv_cache_dtype": self.kv_cache_dtype}
        if self.skip_layers:
            kw["kv_cache_dtype_skip_layers"] = [str(i) for i in self.skip_layers]
        if self.attention_backend is not None:
            kw["attention_backend"] = self.attention_backend
        return kw

    def to_dict(self) -> dict[str, object]:
        return {
            "scheme": self.scheme, "kv_cache_dtype": self.kv_cache_dtype, "skip_layers": list(self.skip_layers),
            "attention_backend": self.attention_backend, "cli": self.cli(), "engine_kwargs": self.engine_kwargs(), "notes": list(self.notes),
        }  # fmt: skip


def _same_storage(a: KVScheme, b: KVScheme) -> bool:
    """Whether ``a`` stores K/V as ``b`` does (formats, sinks, residual window, block; names aside)."""
    return (a.key, a.value, a.sinks, a.residual, a.block) == (b.key, b.value, b.sinks, b.residual, b.block)


def match_preset(scheme: KVScheme, names: tuple[str, ...]) -> str | None:
    """The first preset of ``names`` storing K/V as ``scheme`` does (names aside), or None."""
    return next((n for n in names if _same_storage(scheme, get_scheme(n))), None)



def _quantized_layers(s: KVScheme, num_layers: int | None) -> tuple[str, list[int]] | None:
    """``(format preset, skipped layers)`` of a scheme whose base is unquantized and whose quantized overrides all
    store one vLLM format; ``None`` when it is not such a scheme; ``ValueError`` when it is but ``num_layers``,
    needed to list the skipped layers, is missing."""
    if not s.is_mixed or match_preset(s.replace(layers=()), _UNQUANTIZED) is None:
        return None
    quantized = {idx: match_preset(sub, tuple(_FORMATS)) for idx, sub in s.layers if match_preset(sub, _UNQUANTIZED) is None}
    if not quantized:
        return None
    formats = set(quantized.values())
    unserved = {idx: sub for idx, sub in s.layers if idx in quantized and quantized[idx] is None}
    if unserved:  # a format vLLM has not: say what it keeps that vLLM would lose
        sub = unserved[min(unserved)]
        why = _lacks_clause(sub)
        raise ValueError(
            f"{s.name!r} stores layers {sorted(unserved)} as {', '.join(sorted({u.name for u in unserved.values()}))}: "
            f"vLLM has no KV-cache format storing {sub.name!r}{why}; store the quantized layers in one format of "
            f"{', '.join(_FORMATS)}, the others fp16 or bf16 "
            f"(e.g. kvbits tune --candidates vllm-int4 --candidates {match_preset(s.replace(layers=()), _UNQUANTIZED)})"
        )
    if len(formats) > 1:  # more than one format vLLM has
        named = sorted({quantized[idx] or sub.name for idx, sub in s.layers if idx in quantized})
        raise ValueError(
            f"{s.name!r} stores its quantized layers as {', '.join(named)}: vLLM serves one quantized format "
            f"per engine, the other layers unquantized; keep one format of {', '.join(_FORMATS)} "
            f"(e.g. kvbits tune --candidates vllm-int4 --candidates {match_preset(s.replace(layers=()), _UNQUANTIZED)})"
        )
    (fmt,) = formats
    if num_layers is None:
        raise ValueError(
            f"{s.name!r} keeps its layers unquantized but stores layers {sorted(quantized)} as {fmt}: vLLM serves that "
            f"as {_FORMATS[fmt]} with every other layer skipped, which needs the model's layer count: give it "
            "(kvbits export --scheme S --layers N; a kvbits tune record has it as meta.layers)"
        )
    return fmt, [i for i in range(num_layers) if i not in quantized]  # num_layers checked by vllm_cache_args


def vllm_cache_args(scheme: str | KVScheme | dict, num_layers: int | None = None) -> VllmCacheArgs:
    """vLLM's KV-cache settings for ``scheme`` (a preset, scheme JSON, mixed string such as
    ``"vllm-int4,0=fp16"``, or a ``kvbits tune`` output); ``ValueError`` saying why when vLLM can not store it.

    Layers are matched by what they store, not by name: a scheme JSON equal to a preset maps as the preset.
    ``num_layers``: the model's layer count, needed (only) by an unquantized base whose overrides store one vLLM
    format (``vllm-int4`` on some layers of an ``fp16`` mix): every layer no override names is skipped. Given with any
    other scheme, an override of a layer ``>= num_layers`` is refused.
    """
    s = get_scheme(scheme)
    if num_layers is not None:  # given, it is checked whatever the base: a skipped layer past the model is a typo
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        s.check_layer_count(num_layers, "the given")
    flipped = _quantized_layers(s, num_layers)
    if flipped is not None:
        fmt, skipped = flipped
        return _with_notes(s.name, fmt, _FORMATS[fmt], skipped)
    base = s.replace(layers=()) if s.is_mixed else s
    supported = ", ".join([*_FORMATS, *_UNQUANTIZED])
    name = match_preset(base, tuple(_FORMATS) + _UNQUANTIZED)
    if name is None:
        why = _lacks_clause(base)
        what = f"the layers of {s.name!r} that no override names" if s.is_mixed else repr(s.name)
        raise ValueError(
            f"vLLM has no KV-cache format storing {what}{why}: kvbits maps only "
            f"{supported} (optionally with layers stored as fp16 or bf16); measure one of those with kvbits eval"
        )
    dtype = _FORMATS.get(name, "auto")
    skip: list[int] = []
    for idx, sub in s.layers:
        if match_preset(sub, _UNQUANTIZED):
            skip.append(idx)
        elif not _same_storage(sub, base):  # (an unquantized base's quantized layers: _quantized_layers)
            why = _lacks_clause(sub)
            raise ValueError(
                f"{s.name!r} stores layer {idx} as {sub.name!r}{why}: vLLM can only leave a layer unquantized "
                f"(--kv-cache-dtype-skip-layers) beside one {dtype} format; give that layer fp16 or bf16 "
                f"(e.g. kvbits tune --candidates {name} --candidates fp16)"
            )
    if dtype != "auto" and num_layers is not None and set(range(num_layers)) <= set(skip):
        # every layer of the model skipped: kvbits measured a 16-bit cache, which is vLLM's auto; --kv-cache-dtype
        # would still choose the engine's attention backend and page alignment by a format no layer stores
        return _with_notes(s.name, match_preset(s.for_layer(0), _UNQUANTIZED) or "fp16", "auto", [])
    return _with_notes(s.name, name, dtype, skip)


def _lacks_clause(s: KVScheme) -> str:
    """``" (<what _what_vllm_lacks says>; vLLM can not)"`` for a refusal's message, ``""`` where it says nothing."""
    lacks = _what_vllm_lacks(s)
    return f" ({'; '.join(lacks)}; vLLM can not)" if lacks else ""


def _what_vllm_lacks(s: KVScheme) -> list[str]:
    """What ``s`` (one layer's scheme) keeps that no vLLM KV-cache format stores, in words, for a refusal.

    vLLM's formats (its quantized KV cache page, docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/)
    are FP8 with a static per-tensor or per-head scale and INT4 / INT8 / FP8 with one dynamic scale per token and
    head: uniform codes of K/V after RoPE, every token quantized. Empty where the difference is finer (a zero-point,
    a rounding, a rotation's signs): the refusal's list of the presets kvbits maps says the rest."""
    out = []
    if s.sinks or s.residual:
        kept = [f"the first {s.sinks}" if s.sinks > 1 else "the first"] * bool(s.sinks)
        kept += [f"the {s.residual} most recent"] * bool(s.residual)
        out.append(f"it keeps {' and '.join(kept)} token{'s' * (s.sinks + s.residual > 1)} in full precision")
    lost: dict[str, list[str]] = {}  # what is lost -> the sides (keys, values) that lose it
    for side, spec in (("keys", s.key), ("values", s.value)):
        if spec.kind == "float":
            continue
        what = []
        if spec.kind == "nuq":
            what.append(f"on a {spec.bits}-bit non-uniform codebook")
        elif spec.kind == "int" and spec.bits not in (4, 8):
            what.append(f"at {spec.bits} bits, not 4 or 8")
        if spec.granularity == "channel":
            what.append("scaled per channel")
        elif spec.group_size is not None:
            what.append(f"scaled per group of {spec.group_size} channels")
        if spec.outlier_frac:
            what.append(f"with {spec.outlier_frac:.0%} kept as float16 outliers")
        if spec.pre_rope:
            what.append("quantized before RoPE")
        if spec.smooth is not None or spec.centre:
            what.append("centred or smoothed per channel")
        for w in what:
            lost.setdefault(w, []).append(side)
    out += [f"{' and '.join(sides)} {w}" for w, sides in lost.items()]
    if s.key.kind != s.value.kind or s.key.bits != s.value.bits:
        out.append(f"keys at {s.key.bits} bits, values at {s.value.bits}: vLLM stores both in one format")
    return out


def _with_notes(scheme: str, name: str, dtype: str, skip: list[int]) -> VllmCacheArgs:
    """``VllmCacheArgs`` of format preset ``name`` (vLLM's ``dtype``) with layers ``skip`` skipped, and its notes.

    ``skip`` holds the model's own layer indices, those of its ``model.layers.{i}`` modules: vLLM's ``Attention``
    layer compares ``str(extract_layer_index(prefix))`` with ``kv_cache_dtype_skip_layers`` (vllm-project/vllm
    ``vllm/model_executor/layers/attention/attention.py`` at 0014ca6), so on a hybrid model (Qwen3-Next, Jamba,
    LFM2) an attention layer keeps its decoder index, as kvbits numbers it, and an index with no attention module
    is ignored. With ``dtype`` ``auto`` no layer is skipped: a skipped layer becomes ``auto``, which it already is.
    """
    if dtype == "auto":
        skip = []
    notes = []
    if dtype == "fp8":
        notes.append(
            "vLLM's FP8 scales are 1.0 unless the checkpoint carries calibrated ones: kvbits calibrate --scheme "
            f"{name}, then kvbits export --calibration DIR --checkpoint MODEL --out DIR"
            + ("; per-head scales are applied by --attention-backend FLASH_ATTN only (given here: the other backends "
               "take each layer's largest head scale, a per-tensor cache kvbits did not measure)"
               if name == "fp8-e4m3-head" else "")
        )
        notes.append(CALCULATE_KV_SCALES_NOTE)
        notes.append(
            "with an fp8 cache, vLLM's FlashAttention backend also quantizes each query to FP8 at a static q_scale "
            "(read from vLLM's attention layer and kv_cache.py, not run here); kvbits calibrates and exports none, so "
            "vLLM uses k_scale or 1.0 (it logs 'Checkpoint does not provide a q scaling factor'), and kvbits' "
            "figures, taken with queries at the model's precision, leave that rounding out"
        )
    if dtype == "int4_per_token_head":
        notes.append(
            "kvbits emulates vLLM's int4_per_token_head with vLLM's own Hadamard signs and grid, at vLLM's bytes "
            "per token and head (D/2 of codes and 4 of metadata per side) but not its layout: vLLM keeps one "
            "float32 scale whose 4 low mantissa bits hold the zero-point code, kvbits a float16 scale and zero "
            "(decoded within 1 % of a step; vLLM's round-half-away ties not reproduced), as written in vLLM's "
            "ops/int4_per_token_head.py and triton_quant_kv/int4_per_token_head.py; other vLLM sources store a "
            "signed 4-bit codebook with per-group scales under the same name: check your vLLM's write kernel"
        )
    if dtype == "int8_per_token_head":
        notes.append(
            "vLLM's int8_per_token_head rounds its codes toward zero (its write kernel's float-to-int8 store) from a "
            "float32 scale, as kvbits' vllm-int8 does (same scale, same bytes; vLLM's approximate division may move "
            "a code that lies within an ulp or two of an integer)"
        )
    if dtype == "fp8_per_token_head" and name == "vllm-fp8-token":
        notes.append(
            "vLLM's fp8_per_token_head: the nearest E4M3 code under a float32 scale absmax / 448 per token and head, "
            "as kvbits' vllm-fp8-token stores it (same bytes, scale and codes; vLLM floors the scale at 1e-6, kvbits "
            "keeps a zero row's scale 0)"
        )
    elif dtype == "fp8_per_token_head":
        notes.append(
            "vLLM's fp8_per_token_head keeps each scale in float32 (16 bits per token and head more than kvbits plan "
            "counts for fp8-e4m3-token; --scheme vllm-fp8-token counts them); kvbits' float16 scale, rounded up, "
            "moves a code only where x / scale lies within 2**-10 of an E4M3 rounding boundary"
        )
    if dtype == "auto" or skip:
        notes.append("unquantized layers keep the model's dtype in vLLM (--dtype), whichever of fp16 / bf16 kvbits measured")
    if skip and dtype in _PER_TOKEN_HEAD:
        notes.append(_SKIP_PAGES_NOTE.format(page=_PER_TOKEN_HEAD[dtype]))
    if dtype in _PER_TOKEN_HEAD:
        notes.append(PER_TOKEN_HEAD_BACKEND_NOTE)
    if dtype == "fp8_per_token_head":
        notes.append(FP8_PER_TOKEN_HEAD_CC_NOTE)
    if dtype == "fp8":
        notes.append(FNUZ_NOTE)
    backend = "FLASH_ATTN" if name == "fp8-e4m3-head" else None  # as export_vllm's serve line for its scales
    if dtype in _PER_TOKEN_HEAD:
        backend = "TRITON_ATTN"  # the one backend vLLM's docs name for the *_per_token_head dtypes
    return VllmCacheArgs(scheme, dtype, tuple(sorted(skip)), tuple(notes), backend)
