"""Calibrated FP8 KV-cache scales in the format vLLM loads (compressed-tensors ``kv_cache_scheme``).

vLLM's FP8 KV cache (``--kv-cache-dtype fp8``) stores ``fp8_e4m3(k / k_scale)`` with float32 scales
for keys and for values, one per layer (strategy ``tensor``) or one per KV head of each layer
(strategy ``attn_head``); without scales in the checkpoint it uses 1.0 (and logs "Using KV cache
scaling factor 1.0 for fp8_e4m3"). It reads calibrated scales from the checkpoint as llm-compressor
writes them:

- tensors ``{attention module}.k_scale`` and ``.v_scale`` (``model.layers.{i}.self_attn.k_scale``),
  float32, ``(1,)`` per tensor or ``(H_kv, 1, 1)`` per head (vLLM maps them to
  ``...self_attn.attn.k_scale`` and flattens per-head scales to ``(H_kv,)``);
- ``config.json`` ``quantization_config`` with ``quant_method: compressed-tensors`` and a
  ``kv_cache_scheme`` ``{num_bits: 8, type: float, strategy: tensor | attn_head, dynamic: false,
  symmetric: true}`` (vLLM's ``CompressedTensorsKVCacheMethod`` accepts exactly this: 8-bit float,
  symmetric, tensor or per-head strategy).

vLLM 0.33 (read from its source, not run here) applies per-head scales in its FlashAttention backend
(``--attention-backend FLASH_ATTN``: the cache write and the kernel's per-head descale); the other
backends take each layer's largest head scale, a per-tensor scale.

The scales are a kvbits ``fp8-e4m3`` (or ``fp8-e4m3-head``) calibration (``kvbits calibrate --scheme
fp8-e4m3``): per layer (and head), the largest post-RoPE ``|K|`` and ``|V|`` over every calibration
token, over 448, raised to the least-error grid phase by default (``--fp8-scale centred``). They mean the
same thing in both: kvbits' FP8 cache quantizes as vLLM does (divide by the scale, round to nearest,
saturate at 448), so ``kvbits eval --scheme fp8-e4m3 --calibration DIR`` measures what vLLM will
store. The scales are for OCP E4M3 (max 448); on ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240) and its
``kv_cache.py`` (read, not run) doubles checkpoint scales there, keeping the same codes: kvbits can not know the
target GPU, so the export's notes say so (``FNUZ_NOTE``).

What is not exported: vLLM's kv-cache method also loads ``{module}.q_scale`` and ``.prob_scale`` (its
``BaseKVCacheMethod.create_weights``, ``vllm/model_executor/layers/quantization/kv_cache.py``). With an FP8
cache, an attention backend that takes FP8 queries (FlashAttention, ``supports_quant_query_input``) has the
attention layer quantize each query to E4M3 at the static ``q_scale`` before the kernel
(``vllm/model_executor/layers/attention/attention.py``, ``query_quant``). kvbits calibrates no query range, so
the export writes no ``q_scale``: vLLM logs "Checkpoint does not provide a q scaling factor" and quantizes
queries at ``k_scale`` or 1.0 (depending on its version; ``prob_scale`` stays 1.0, used by FP8 attention
kernels only). kvbits keeps queries in the model's precision, so on such a backend (the one that applies
per-head scales) vLLM adds a query rounding error kvbits' figures do not include; a query above
``448 * q_scale`` saturates.

A hybrid model's calibration (LFM2, Qwen3-Next, ...: ``model.kv_layers`` names its attention layers) exports the
scales of its attention layers only, each under that layer's index in the whole model
(``model.layers.3.self_attn.k_scale`` for layer 3, the second attention layer of a conv / attention / conv /
attention stack): transformers and vLLM both build every layer under ``model.layers.{i}`` (vLLM's ``make_layers``)
and give a layer's attention module that index, and vLLM's ``maybe_remap_kv_scale_name`` maps the name to
``model.layers.3.self_attn.attn.k_scale`` (its Qwen3-Next ``load_weights``). The convolution / linear-attention
layers store no K/V and get no scale. vLLM loads them only where its model class builds the attention layer with the
quantization config (Qwen3-Next does); its Jamba and LFM2 classes, as read, build it without one, so those layers
have no ``k_scale`` parameter and such a checkpoint may fail to load there: the export says so in the log.

``export_vllm(artifact, out_dir)`` writes ``kv_cache_scales.safetensors`` and
``quantization_config.json`` (and ``kvbits_export.json``, the provenance). With ``checkpoint=DIR`` (a
Hugging Face checkpoint folder) ``out_dir`` becomes a checkpoint vLLM can serve, and ``DIR`` is left
untouched: its files are linked (symlinks, no copy of the weights), ``config.json`` is written with
the ``kv_cache_scheme`` added, and ``model.safetensors.index.json``, when there is one, with the
scale names added (vLLM loads only the files the index names). Such a checkpoint declares
compressed-tensors quantization: transformers then needs the ``compressed-tensors`` package to load it.
The files are staged in a hidden folder inside ``out_dir`` and moved in at the end: an export that fails
leaves ``out_dir`` as it was (a previous export's files put back), never a partial export.
A re-export into the same ``out_dir`` replaces the links an earlier export made (its ``kvbits_export.json``
names them) and removes those it does not make again (the shards of a checkpoint since re-saved, an index it no
longer has); weights or an index it did not make are refused, by name (vLLM would load them too).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvbits._files import atomic_path, write_text_atomic
from kvbits._json import describe, dumps, json_object, loads, mapping
from kvbits.calibrate.artifact import META_FILE, CalibrationArtifact, load_calibration, now_utc
from kvbits.plan.config import text_config
from kvbits.schemes import KVScheme

logger = logging.getLogger(__name__)

__all__ = ["KV_CACHE_SCHEME", "SCALES_FILE", "export_vllm", "kv_cache_scheme", "quantization_config", "vllm_scales"]

SCALES_FILE = "kv_cache_scales.safetensors"
CONFIG_FILE = "quantization_config.json"
RECORD_FILE = "kvbits_export.json"
DEFAULT_MODULE = "model.layers.{i}.self_attn"
KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}
"""compressed-tensors ``QuantizationArgs`` of a static per-tensor FP8 KV cache, as vLLM validates it."""
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}  # kvbits granularity -> compressed-tensors strategy


def kv_cache_scheme(strategy: str = "tensor") -> dict[str, Any]:
    """``KV_CACHE_SCHEME`` with ``strategy`` ``"tensor"`` or ``"attn_head"`` (one scale per KV head)."""
    if strategy not in STRATEGIES.values():
        raise ValueError(f"strategy must be one of {tuple(STRATEGIES.values())}, got {strategy!r}")
    return {**KV_CACHE_SCHEME, "strategy": strategy}


def _strategy(art: CalibrationArtifact) -> str:
    return STRATEGIES[art.scheme.key.granularity]


def check_exportable(art: CalibrationArtifact) -> None:
    """``ValueError`` unless ``art`` holds what vLLM's FP8 cache can use: static E4M3 scales for keys and
    values, both per tensor or both per head (one ``kv_cache_scheme``), keys after RoPE (vLLM caches
    rotated keys), taken over every token (``fitted_sinks`` 0 in every layer: vLLM stores the sinks in
    FP8 too; a scheme that keeps sinks is exportable when its scales were fitted over every token)."""
    scheme = art.scheme
    if scheme.is_mixed:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} mixes schemes per layer; vLLM's kv_cache_scheme is one scheme "
            f"for every layer: calibrate a uniform FP8 scheme (fp8-e4m3){_skip_hint(scheme, art.num_layers)}"
        )
    for side in ("key", "value"):
        spec = getattr(scheme, side)
        if spec.kind != "fp8" or not spec.static or spec.granularity not in STRATEGIES:
            how = f"{'static' if spec.static else 'dynamic'} {spec.bits}-bit {spec.kind} per {spec.granularity}"
            raise ValueError(
                f"calibration of scheme {scheme.name!r}: vLLM loads static per-tensor or per-head FP8 scales; "
                f"its {side}s are {how}. Calibrate an FP8 scheme: kvbits calibrate --scheme fp8-e4m3"
            )
        if spec.fmt != "e4m3":
            raise ValueError(
                f"calibration of scheme {scheme.name!r}: vLLM's fp8_e5m2 cache takes no scales; only E4M3 "
                f"scales can be exported (the {side} spec is {spec.fmt})"
            )
    if scheme.key.granularity != scheme.value.granularity:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} scales keys per {scheme.key.granularity} and values per "
            f"{scheme.value.granularity}; vLLM's kv_cache_scheme has one strategy for both"
        )
    rotated = [side for side in ("key", "value") if getattr(scheme, side).rotate is not None]
    if rotated:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} scales {' and '.join(rotated)} after a "
            f"{getattr(scheme, rotated[0]).rotate} rotation; vLLM stores K/V unrotated, whose range differs: "
            "calibrate an unrotated FP8 scheme (fp8-e4m3)"
        )
    if scheme.key.pre_rope:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} scales keys before RoPE; vLLM caches keys after RoPE, "
            "whose range differs: calibrate a post-RoPE scheme (fp8-e4m3)"
        )
    # what the scales were fitted without (data.excluded_sink_tokens), not the scheme's sinks: a calibration fitted
    # over every token (composed into a scheme with sinks) holds the range vLLM stores; export_vllm warns for it
    fitted = max((art.fitted_sinks(i) for i in art.kv_layers), default=0)
    if fitted:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} takes its FP8 scales without the first {fitted} token(s) "
            "of each window (its sinks, kept in full precision); vLLM's FP8 cache stores those tokens too, at the "
            "exported scale, so their larger |K|/|V| would saturate: calibrate without sinks (fp8-e4m3)"
        )
    kept = [side for side in ("key", "value") if getattr(scheme, side).outlier_frac]
    if kept:
        raise ValueError(
            f"calibration of scheme {scheme.name!r} keeps a fraction of its {' and '.join(kept)}s in float16 "
            "(outliers); "
            "vLLM stores every value in FP8, so kvbits' measurements would not describe its cache: calibrate "
            "without outliers (fp8-e4m3)"
        )


# model types whose vLLM class (vllm/model_executor/models/jamba.py, lfm2.py, as read) builds its attention layers'
# ``Attention`` without ``quant_config``: no k_scale / v_scale parameter for a checkpoint's scales to load into
_NO_VLLM_KV_SCALES = frozenset({"jamba", "lfm2"})


def _skip_hint(scheme: KVScheme, num_layers: int) -> str:
    """For a mix vLLM serves as one FP8 format with some layers unquantized (``fp8-e4m3,0=fp16``, or an fp16 base
    with FP8 layers, ``fp16,1=fp8-e4m3``, as kvbits tune writes when most layers stay fp16): how to export and
    serve it (that FP8 format calibrated uniformly, the other layers skipped); else nothing. ``num_layers``: the
    model's layer count (the calibration's), which an fp16 base needs to list its skipped layers."""
    from kvbits.export.vllm_flags import FP8_STATIC, match_preset, vllm_cache_args

    try:
        args = vllm_cache_args(scheme, num_layers)
    except ValueError:
        return ""
    stored = [match_preset(scheme.replace(layers=()), FP8_STATIC)]
    stored += [match_preset(sub, FP8_STATIC) for _, sub in scheme.layers]
    base = next((name for name in stored if name is not None), None)
    if base is None or args.kv_cache_dtype != "fp8" or not args.skip_layers:
        return ""
    return (
        f"; vLLM serves this mix as {base} with layers {list(args.skip_layers)} unquantized: calibrate "
        f"{base}, export it, and serve with {' '.join(args.cli())}"
    )


def _template_names(template: str, layers: list[int]) -> list[str]:
    """``template`` formatted for each of ``layers``; ``ValueError`` unless its only field is ``{i}``
    (a format spec such as ``{i:02d}`` is fine; ``{{i}}`` is a literal brace, not a field)."""
    try:
        parsed = list(string.Formatter().parse(template))
        fields = [f for _, f, _, _ in parsed if f is not None]
        nested = [string.Formatter().parse(spec) for _, _, spec, _ in parsed if spec]  # {i:{w}}
        fields += [f for spec in nested for _, f, _, _ in spec if f is not None]
    except ValueError as exc:
        raise ValueError(f"module template {template!r} is not a valid format string: {exc}") from None
    other = sorted({f for f in fields if f != "i"})
    if "i" not in fields or other:
        extra = f" and no other field (it has {', '.join('{' + f + '}' for f in other)})" if other else ""
        raise ValueError(
            f"module template must contain the field '{{i}}' (the layer index){extra}, got {template!r}; "
            "e.g. model.layers.{i}.self_attn"
        )
    try:
        return [template.format(i=i) for i in layers]
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"module template {template!r} can not format a layer index: {exc}") from None


def _module_names(art: CalibrationArtifact, module_template: str | None) -> list[str]:
    """One attention module name per layer the artifact holds (``art.kv_layers``: every layer, or a hybrid model's
    attention layers): ``module_template`` formatted at each such layer's index in the whole model (as vLLM and
    transformers number a hybrid model's layers: ``model.layers.3.self_attn`` is layer 3, whatever the layers
    before it are), else the names calibration recorded, else ``DEFAULT_MODULE``. ``ValueError`` on a bad template,
    recorded names that are not one non-empty string per layer held (an edited or corrupt file: not replaced by the
    default silently), or names that are not unique (layers would share, and overwrite, one pair of scale tensors)."""
    layers = art.kv_layers
    n = len(layers)
    recorded = art.meta["model"].get("attention_modules")
    if module_template is None and recorded is not None:
        if not isinstance(recorded, list) or len(recorded) != n or not all(isinstance(x, str) and x for x in recorded):
            what = f"a list of {len(recorded)} entries" if isinstance(recorded, list) else describe(recorded)
            held = "one per layer" if n == art.num_layers else f"one per attention layer {layers}"
            raise ValueError(
                f"attention_modules recorded in {_meta_file(art)} is {what}; expected a list of "
                f"{n} module names ({held}, as kvbits calibrate writes it): the file was edited or is "
                "corrupt; pass --module-template (e.g. 'model.layers.{i}.self_attn') to name the modules"
            )
        names, source = list(recorded), f"attention_modules recorded in {_meta_file(art)}"
    else:
        template = DEFAULT_MODULE if module_template is None else module_template
        names, source = _template_names(template, layers), f"module template {template!r}"
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(
            f"the {source} name the {n} layers with only {len(set(names))} distinct modules "
            f"(repeated: {dup[:3]}); each layer needs its own k_scale/v_scale: pass a module template "
            "with {i}, e.g. --module-template 'model.layers.{i}.self_attn'"
        )
    return names


def _meta_file(art: CalibrationArtifact) -> str:
    """Where ``art``'s metadata lives, for error messages."""
    return "the calibration" if art.path is None else str(Path(art.path) / META_FILE)


def vllm_scales(art: CalibrationArtifact, module_template: str | None = None) -> dict[str, torch.Tensor]:
    """``{module}.k_scale`` / ``.v_scale`` -> float32 tensors, one pair per layer that stores K/V (a hybrid model's
    attention layers only: its convolution / linear-attention layers have no k_scale in vLLM): ``(1,)`` per tensor,
    ``(H_kv, 1, 1)`` per head (llm-compressor's layout; vLLM flattens it).

    Module names come from the artifact (``calibrate`` records the attention modules' qualified
    names) or ``module_template`` (default ``model.layers.{i}.self_attn``). ``ValueError`` for an artifact
    vLLM can not use (``check_exportable``) or whose tensors do not match its scheme and model
    (``CalibrationArtifact.validate``: an artifact built or edited in memory with a NaN, zero or misshapen scale).
    """
    check_exportable(art)
    art.validate()  # load_calibration validates what it reads; an artifact built or edited in memory was not
    out: dict[str, torch.Tensor] = {}
    for i, name in zip(art.kv_layers, _module_names(art, module_template), strict=True):
        for side, short in (("key", "k"), ("value", "v")):
            qp = art.static_qparams(i, side)
            assert qp is not None  # check_exportable: static
            shape = (art.num_kv_heads, 1, 1) if art.scheme.key.granularity == "head" else (1,)
            out[f"{name}.{short}_scale"] = qp[0].detach().to("cpu", torch.float32).reshape(shape).clone()
    return out


def quantization_config(strategy: str = "tensor") -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint whose only quantization is the FP8 KV cache."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(strategy),
    }


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "kvbits"})


def _merged_config(config: dict[str, Any], where: Path, strategy: str) -> dict[str, Any]:
    """``config`` with the FP8 ``kv_cache_scheme``; an existing compressed-tensors config keeps its
    weight groups, any other quantization method is refused (vLLM reads one ``quant_method``)."""
    out = dict(config)
    qc = out.get("quantization_config")
    want = kv_cache_scheme(strategy)
    if qc is None:
        out["quantization_config"] = quantization_config(strategy)
        return out
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(
            f"{where} already has quantization_config with quant_method {method!r}; vLLM reads the KV-cache "
            "scheme from a compressed-tensors config only. Add the scales with that tool, or export to a "
            "separate folder (no checkpoint) and merge by hand"
        )
    old = qc.get("kv_cache_scheme")
    if old not in (None, want) and (not isinstance(old, dict) or {k: old.get(k) for k in want} != want):
        raise ValueError(f"{where} already has a different kv_cache_scheme {old!r}; refusing to replace it")
    out["quantization_config"] = {**qc, "kv_cache_scheme": want}
    return out


def _servable(
    checkpoint: Path, out: Path, scales: dict[str, torch.Tensor], art: CalibrationArtifact
) -> tuple[dict[str, Any], dict[str, Path], dict[str, list[str]]]:
    """What makes ``out`` a copy of ``checkpoint`` (links) with the scales, checked, nothing written:
    ``({file name: JSON object to write}, {link name: target}, {"linked": [...], "written": [...]})``.
    ``ValueError`` for a checkpoint the scales can not join, or an ``out`` holding other files under its names."""
    cfg_path = checkpoint / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{checkpoint} is not a Hugging Face checkpoint folder (no config.json)")
    config = _read_json_object(cfg_path, "a Hugging Face model config")
    _check_config(config, art, cfg_path)
    index_path = checkpoint / "model.safetensors.index.json"
    index = None
    if index_path.is_file():
        index = _read_json_object(index_path, 'a safetensors index {"weight_map": {tensor: file}}')
        mapping(index.get("weight_map", {}), f"{index_path}: weight_map", "an object {tensor name: file}")
        held = _held_scales({n: f for n, f in index.get("weight_map", {}).items() if f != SCALES_FILE})
        clash = sorted(n for n in scales if n in held)
        if clash:
            raise ValueError(
                f"{index_path} already maps {_held_names(clash, held)} to another file; refusing to shadow them"
            )
        tensors = set(index.get("weight_map", {}))
    elif not list(checkpoint.glob("*.safetensors")):
        raise ValueError(
            f"{checkpoint} holds no *.safetensors weights; vLLM would not load the scales beside them"
        )
    else:
        # no index: vLLM loads every *.safetensors file, so a scale already in one would be loaded twice
        # (whichever file it reads last wins)
        names = _safetensors_names(checkpoint)
        held = _held_scales(names)
        clash = sorted(n for n in scales if n in held)
        if clash:
            raise ValueError(
                f"{held[clash[0]][1]} already holds {_held_names(clash, held)}; vLLM loads every *.safetensors file "
                "of a checkpoint without an index, so the exported scales would shadow them or be shadowed: refusing"
            )
        tensors = set(names)
    if (checkpoint / SCALES_FILE).exists():
        raise ValueError(f"{checkpoint} already holds {SCALES_FILE}; export from the original checkpoint")
    _check_modules(scales, tensors, checkpoint)
    merged = _merged_config(config, cfg_path, _strategy(art))  # refusals before anything is written
    written = {cfg_path.name: merged}
    if index is not None:
        index.setdefault("weight_map", {}).update(dict.fromkeys(scales, SCALES_FILE))
        written[index_path.name] = index
    sources = [src for src in sorted(checkpoint.iterdir())
               if src.name not in written and src.name not in (SCALES_FILE, CONFIG_FILE, RECORD_FILE)]  # fmt: skip
    linked, ours = _previous_export(out)
    for src in sources:  # every clash refused before anything is written: a refusal leaves --out as it was
        dst = out / src.name
        if (dst.is_symlink() or dst.exists()) and not (dst.is_symlink() and (dst.name in linked or _same(dst, src))):
            raise ValueError(
                f"{dst} exists and is not a link to {src} (nor one an earlier export made); export into an empty folder"
            )
    links = {src.name: src.resolve() for src in sources if not _same(out / src.name, src)}
    names = {src.name for src in sources} | set(written) | {SCALES_FILE, CONFIG_FILE, RECORD_FILE}
    present = sorted(out.iterdir()) if out.is_dir() else []
    stale = sorted(p.name for p in present if p.name not in names and (p.is_symlink() or p.is_file())
                   and (p.name in ours or _WEIGHT_FILE.search(p.name)))  # fmt: skip
    foreign = [name for name in stale if name not in ours]
    if foreign:
        raise ValueError(
            f"{out} holds {foreign[:3]}{' ...' if len(foreign) > 3 else ''}, which {checkpoint} does not and no "
            "earlier export here made; vLLM would load them (or an index naming other files) with this checkpoint: "
            "remove them or export into an empty folder"
        )
    return written, links, {
        "linked": [src.name for src in sources], "written": [*written, SCALES_FILE], "removed": stale,
    }  # fmt: skip


# files of a checkpoint folder vLLM's loader reads (weights, their index): one left over in --out would be loaded
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth)$|\.index\.json$")


def _same(dst: Path, src: Path) -> bool:
    """Whether ``dst`` is a link resolving to ``src`` (the link an earlier export of ``src`` made)."""
    return dst.is_symlink() and dst.resolve() == src.resolve()


def _previous_export(out: Path) -> tuple[set[str], set[str]]:
    """The names an earlier ``--checkpoint`` export into ``out`` linked, and those it linked or wrote, from its
    ``kvbits_export.json`` (empty sets when there is none, or it is not such a record: nothing is then taken as
    ours). A re-export replaces those links and removes those of them it does not make again: a checkpoint
    re-saved with other shards, or another checkpoint, left the old shards' links (dangling, or loaded beside
    the new weights) and an index naming them."""
    try:
        record = loads((out / RECORD_FILE).read_text(encoding="utf-8"))
        files = record["checkpoint"]
        linked = {n for n in files["linked"] if isinstance(n, str) and n == Path(n).name}
        written = {n for n in files["written"] if isinstance(n, str) and n == Path(n).name}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return set(), set()
    linked = {n for n in linked if (out / n).is_symlink()}  # a file of the user's under a linked name stays
    return linked, linked | written


def _install(
    out: Path, scales: dict[str, torch.Tensor], jsons: dict[str, Any], links: dict[str, Path], remove: list[str]
) -> None:
    """Write into ``out`` all or nothing: ``links`` (``{name: target}``), ``scales`` as ``SCALES_FILE`` and
    ``jsons`` (``{name: object}``, written in that order, after the scales) are first made in a hidden staging
    folder inside ``out``, then moved in, and ``remove`` (an earlier export's files this one does not make again)
    moved out; when any step fails, what was moved in is taken out again and the files
    it replaced (a previous export's) are put back, so a failure leaves ``out`` as it was: no partial export a
    user (or vLLM) could load."""
    folders = [name for name in [*links, SCALES_FILE, *jsons] if (out / name).is_dir() and not (out / name).is_symlink()]
    if folders:
        raise ValueError(f"{out / folders[0]} is a folder; the export writes a file of that name: export elsewhere")
    stage = Path(tempfile.mkdtemp(prefix=".kvbits-export.", dir=out))
    moved: list[tuple[Path, Path | None]] = []  # (destination, where what it held before waits, or None)
    try:
        for name, target in links.items():
            (stage / name).symlink_to(target)
        _save_tensors(stage / SCALES_FILE, scales)
        for name, obj in jsons.items():
            write_text_atomic(stage / name, dumps(obj, indent=2) + "\n")
        for name in [*links, SCALES_FILE, *jsons]:  # links first, the config naming the scales after them
            dst, backup = out / name, None
            if dst.is_symlink() or dst.exists():
                backup = stage / f".old.{name}"
                os.replace(dst, backup)
            moved.append((dst, backup))
            os.replace(stage / name, dst)
        for name in remove:
            backup = stage / f".old.{name}"
            os.replace(out / name, backup)
            moved.append((out / name, backup))
    except BaseException:
        for dst, backup in reversed(moved):
            dst.unlink(missing_ok=True)  # the new file, or nothing when its move failed (or it was removed)
            if backup is not None:
                os.replace(backup, dst)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# checkpoint tensor names vLLM loads into an attention layer's k_scale / v_scale (its get_cache_scale and
# maybe_remap_kv_scale_name), most specific first, with the exported name each stands for
_SCALE_ALIASES = (
    (re.compile(r"\.attn\.([kv])_scale$"), (r".\1_scale",)),  # vLLM's own parameter name
    (re.compile(r"\.([kv])_proj\.output_scale$"), (r".\1_scale",)),  # older llm-compressor checkpoints
    (re.compile(r"\.(?:[kv]|qkv)_proj\.([kv])_scale$"), (r".\1_scale",)),  # ModelOpt, fused QKV
    (re.compile(r"\.kv_scale$"), (".k_scale", ".v_scale")),  # the deprecated single scale, loaded as both
    (re.compile(r"\.([kv])_scale$"), (r".\1_scale",)),  # as exported (llm-compressor's current names)
)


def _held_scales(tensors: dict[str, str]) -> dict[str, tuple[str, str]]:
    """``{exported scale name: (tensor, file)}`` of the ``tensors`` (``{name: file}``) vLLM would load into that
    scale's parameter: the K/V scales a checkpoint already carries, under any of the names vLLM maps."""
    held: dict[str, tuple[str, str]] = {}
    for name, file in tensors.items():
        for pattern, targets in _SCALE_ALIASES:
            if pattern.search(name):
                for target in targets:
                    held.setdefault(pattern.sub(target, name), (name, file))
                break
    return held


def _held_names(clash: list[str], held: dict[str, tuple[str, str]]) -> str:
    """The checkpoint's tensors behind (up to three of) the exported names ``clash``, as a list."""
    found = [repr(held[n][0]) + ("" if held[n][0] == n else f" (vLLM loads it as {n!r})") for n in clash[:3]]
    return f"[{', '.join(found)}]"


def _safetensors_names(checkpoint: Path) -> dict[str, str]:
    """``{tensor name: file name}`` over the ``*.safetensors`` files of ``checkpoint`` (their headers only)."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(dict.fromkeys(f.keys(), path.name))
        except Exception as exc:  # safetensors raises its own SafetensorError (no public base class)
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    return names


def _check_modules(scales: dict[str, torch.Tensor], tensors: set[str], checkpoint: Path) -> None:
    """``ValueError`` unless each module a scale names (``{module}.k_scale``) is an attention module of the
    checkpoint, one with a ``k_proj`` (as calibration requires): vLLM loads ``{module}.k_scale`` into
    ``{module}.attn.k_scale``, skips a scale of no such parameter (a warning) and serves that layer at scale 1.0."""
    modules = sorted({n.rsplit(".", 1)[0] for n in scales})
    prefixes = {t.rsplit(".", i)[0] for t in tensors for i in range(1, t.count(".") + 1)}
    missing = [m for m in modules if m not in prefixes]
    if missing:
        near = sorted(p for p in prefixes if p.endswith(missing[0].rsplit(".", 1)[-1]))[:3]
        raise ValueError(
            f"{len(missing)} of {len(modules)} attention modules the scales are named for are not in {checkpoint} "
            f"(e.g. {missing[0]!r}); vLLM would skip those scales and serve at scale 1.0. Modules of the checkpoint "
            f"ending alike: {near or 'none'}; set --module-template to the checkpoint's names"
        )
    other = [m for m in modules if f"{m}.k_proj" not in prefixes]
    if other:
        attention = sorted(p.rsplit(".", 1)[0] for p in prefixes if p.endswith(".k_proj"))[:3]
        raise ValueError(
            f"{len(other)} of {len(modules)} modules the scales are named for are in {checkpoint} but are not attention "
            f"modules (e.g. {other[0]!r} has no k_proj); vLLM would skip those scales and serve at scale 1.0. "
            f"Attention modules of the checkpoint: {attention or 'none'}; set --module-template to their names"
        )


def _check_out_outside(checkpoint: Path, out: Path) -> None:
    """``ValueError`` when ``out`` is ``checkpoint`` or inside it (after resolving links): the checkpoint
    is promised untouched, and linking its files into a folder within it would link that folder into
    itself."""
    ck, dst = checkpoint.resolve(), out.resolve()
    if dst == ck:
        raise ValueError(
            f"the output folder must differ from the checkpoint ({checkpoint}), which is left untouched"
        )
    if dst.is_relative_to(ck):
        raise ValueError(
            f"the output folder {out} is inside the checkpoint {checkpoint}, which is left untouched; "
            "choose an --out outside it"
        )


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    """``path`` parsed as a JSON object; ``ValueError`` naming ``path`` and ``what`` it should hold."""
    try:
        obj = loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({what} expected): {exc}") from None
    return dict(json_object(obj, path, what))


def _number_or_list(t: torch.Tensor) -> float | list[float]:
    """A per-tensor scale as a number, per-head scales as a list (the export record)."""
    return float(t) if t.numel() == 1 else [float(v) for v in t.reshape(-1)]


def _check_config(config: dict[str, Any], art: CalibrationArtifact, where: Path) -> None:
    """``ValueError`` naming ``where`` unless the checkpoint's ``config`` (its parsed ``config.json``) describes
    the model ``art`` was calibrated on: the layers and KV heads, then every other field the artifact records
    (``model_type``, ``num_attention_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``; those it records as
    None, as an artifact fitted from samples does, are not compared)."""
    text = _text_config(config)
    layers = text.get("num_hidden_layers")
    kv_key = "num_key_value_heads" if "num_key_value_heads" in text else "num_attention_heads"
    kv = text.get(kv_key)
    for key, value in (("num_hidden_layers", layers), (kv_key, kv)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {key} is {describe(value)}; expected a positive whole number")
    if layers is not None and layers != art.num_layers:
        raise ValueError(f"{where}: {layers} layers, the calibration has {art.num_layers}; wrong model?")
    if kv is not None and kv != art.num_kv_heads:
        raise ValueError(f"{where}: {kv} KV heads, the calibration has {art.num_kv_heads}; wrong model?")
    try:
        art.check_model(text, known_only=True)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields of a checkpoint's parsed ``config.json`` as transformers (and vLLM) read them: the
    config transformers builds from it, defaults filled in. A composite model's nested ``text_config`` is saved
    as its difference from the text model's defaults (llava-hf/llava-1.5-7b-hf's names no layer or head count:
    Llama's 32 and 32). Where transformers can not build it (a model type it does not know, a field of the wrong
    type), the JSON's own ``text_config`` or the config itself, checked as written."""
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(**config)
    except Exception:  # noqa: BLE001 - unknown model_type (ValueError), strict validation (huggingface_hub errors)
        text = config.get("text_config")
        return text if isinstance(text, dict) else config
    return dict(text_config(full).to_dict())


def export_vllm(
    calibration: CalibrationArtifact | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    module_template: str | None = None,
) -> dict[str, Any]:
    """Write ``calibration``'s FP8 scales as vLLM loads them; returns the export record.

    Args:
        calibration: an ``fp8-e4m3`` calibration artifact or its folder.
        out_dir: folder for ``kv_cache_scales.safetensors``, ``quantization_config.json`` (the block to
            put in ``config.json``) and ``kvbits_export.json``.
        checkpoint: a Hugging Face checkpoint folder (left untouched): ``out_dir`` becomes that checkpoint
            with the scales, ready for ``vllm serve`` (see the module docstring); its ``config.json`` must
            describe the calibrated model (layers, KV heads, and each of ``model_type``, attention heads, head
            dim, hidden size, vocabulary the calibration records). Only that config is compared: the weights are
            not (the calibration's fingerprint hashes the weights it was loaded from, a GGUF file or a hub id,
            which a folder of safetensors need not match, and hashing a large checkpoint is not cheap), so a
            checkpoint of the same architecture with other weights (a fine-tune) is accepted; its |K|/|V| ranges,
            and so the right scales, may differ. The log says so.
        module_template: attention module names, e.g. ``model.language_model.layers.{i}.self_attn``;
            default the names calibration recorded, else ``model.layers.{i}.self_attn``.

    Raises:
        ValueError: a calibration vLLM can not use (not static per-tensor E4M3, pre-RoPE keys, scales that
            leave sink tokens out, ``fitted_sinks``), module names that are not one per layer (a template without an ``{i}`` field, or with other fields),
            a checkpoint of another shape, one already quantized by another method, one whose
            ``config.json`` or index is not the JSON object expected, or an ``out_dir`` inside it; without
            ``checkpoint``, an ``out_dir`` holding a ``config.json`` (a checkpoint, or an earlier export with
            ``checkpoint``, whose ``kv_cache_scheme`` the new scales need not match).
    """
    art = calibration if isinstance(calibration, CalibrationArtifact) else load_calibration(calibration)
    scales = vllm_scales(art, module_template)
    if art.scheme.residual or art.scheme.block > 1:  # scales fitted without sinks are refused (check_exportable)
        # a block > 1 also keeps the newest tokens (up to residual + block - 1) in full precision until it fills
        logger.warning(
            "scheme %r keeps up to %d most recent tokens in full precision (residual %d, block %d); vLLM's FP8 "
            "cache quantizes every token, so measure it as fp8-e4m3 (no window) before relying on kvbits' figures",
            art.scheme.name,
            art.scheme.residual + art.scheme.block - 1,
            art.scheme.residual,
            art.scheme.block,
        )
    if art.scheme.sinks:  # fitted over every token (check_exportable), but kvbits' figures kept the sinks exact
        logger.warning(
            "scheme %r keeps its first %d token(s) in full precision, which vLLM's FP8 cache quantizes (the scales "
            "were fitted over every token, so they hold those tokens' range); measure it as fp8-e4m3 (no sinks) "
            "before relying on kvbits' figures",
            art.scheme.name,
            art.scheme.sinks,
        )
    model_type = art.meta["model"].get("model_type")
    if model_type in _NO_VLLM_KV_SCALES:
        logger.warning(
            "model type %r: vLLM's implementation (as of the sources kvbits was checked against) builds its attention "
            "layers without the quantization config, so it has no k_scale / v_scale parameters to load these scales "
            "into: it may refuse the checkpoint or serve its FP8 cache at scale 1.0; check with your vLLM version",
            model_type,
        )
    stats = art.layer_stats
    strategy = _strategy(art)
    # per-head scales reach vLLM's FlashAttention backend only; the others use each layer's largest
    from kvbits.export.vllm_flags import CALCULATE_KV_SCALES_NOTE, FNUZ_NOTE

    serve_flags = " --attention-backend FLASH_ATTN" if strategy == "attn_head" else ""
    record: dict[str, Any] = {
        "format": "vllm-compressed-tensors-kv-cache",
        "created": now_utc(),
        "calibration": {
            "path": None if art.path is None else str(art.path),
            "scheme": art.scheme.name,
            "model": art.meta["model"].get("name") or art.meta["model"].get("model_type"),
            "fingerprint": art.fingerprint,
            "data": art.meta["data"].get("name"),
            "context": art.max_calibrated_length,
            "windows": art.meta["data"].get("windows"),
        },
        "kv_cache_scheme": kv_cache_scheme(strategy),
        "layers": [  # stats: one row per layer held (art.kv_layers), in that order
            {
                "layer": layer,
                "k_scale": _number_or_list(scales[f"{name}.k_scale"]),
                "v_scale": _number_or_list(scales[f"{name}.v_scale"]),
                "k_absmax": stats[j].get("key_absmax") if j < len(stats) else None,
                "v_absmax": stats[j].get("value_absmax") if j < len(stats) else None,
                "module": name,
            }
            for j, (layer, name) in enumerate(zip(art.kv_layers, _module_names(art, module_template), strict=True))
        ],
        "serve": f"vllm serve <checkpoint> --kv-cache-dtype fp8{serve_flags}",
        "notes": [CALCULATE_KV_SCALES_NOTE, FNUZ_NOTE],
    }
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a folder")
    ck = None if checkpoint is None else Path(checkpoint).expanduser()
    if ck is not None:
        _check_out_outside(ck, out)  # before mkdir: nothing is created inside the checkpoint
    elif (out / "config.json").exists():
        # a checkpoint (a previous --checkpoint export, or a model folder): the scales would replace those its
        # config.json's kv_cache_scheme (strategy) and index describe, leaving a servable-looking folder that
        # does not match them
        raise ValueError(
            f"{out} holds a config.json (a model checkpoint, or an earlier export with --checkpoint); scales "
            "written there without --checkpoint would not match its quantization_config: pass --checkpoint "
            "(the original checkpoint) to update it, or export to another folder"
        )
    record["out_dir"] = str(out)
    written: dict[str, Any] = {}
    links: dict[str, Path] = {}
    if ck is not None:
        written, links, files = _servable(ck, out, scales, art)  # checks only: nothing is written yet
        record["checkpoint"] = {"path": str(ck), **files}
        record["serve"] = f"vllm serve {out} --kv-cache-dtype fp8{serve_flags}"
        logger.info(
            "%s: its config.json matches the calibration's model (layers, KV heads and the shape fields the "
            "calibration records); its weights are not compared with those calibrated (fingerprint %s): the scales "
            "fit only if they are the same weights, not a fine-tune of the same architecture",
            ck,
            art.fingerprint,
        )
    jsons = {CONFIG_FILE: {"quantization_config": quantization_config(strategy)}, **written, RECORD_FILE: record}
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _install(out, scales, jsons, links, record.get("checkpoint", {}).get("removed", []))
    except BaseException:
        if created and not any(out.iterdir()):  # a failed export leaves no empty --out behind
            out.rmdir()
        raise
    logger.info("exported %d layers' FP8 K/V scales for vLLM", len(art.kv_layers))
    return record
