"""The calibration artifact: ``DIR/calibration.safetensors`` + ``DIR/calibration.json``.

Tensors (exactly what the cache stores and ``accounting.fixed_layer_bytes`` counts), for each
layer ``i`` that holds K/V (``model.kv_layers``: every layer ``0 .. num_layers - 1`` but a hybrid model's
convolution / linear-attention / state-space layers and KV-sharing layers, which store none) and side ``s`` in ``key``/``value`` whose spec takes them (``TensorSpec.calibratable``):

- ``layers.{i}.{s}_scale``, ``layers.{i}.{s}_zero``: ``(H_kv, D)`` float16 static per-channel
  parameters (``zero`` only for asymmetric specs), in the form ``kvbits.quant.quantize`` takes them;
- ``layers.{i}.{s}_codebook``: ``(2**bits,)`` float16 sorted NUQ codebook in ``[-1, 1]``;
- ``layers.{i}.{s}_mean`` (``centre``), ``layers.{i}.{s}_factor`` (``smooth``): ``(H_kv, D)`` float16 channel
  means and smoothing factors (``> 0``): ``quantize`` codes ``(x - mean) / factor``;
- ``layers.{i}.{s}_scale`` of a static FP8 spec: float32, ``()`` the per-tensor scale or ``(H_kv,)``
  one per KV head (``x ~ fp8(x / s) * s``, as vLLM's ``k_scale`` / ``v_scale``, strategies ``tensor``
  and ``attn_head``; ``kvbits.export.vllm`` exports them).

The JSON records ``format_version``, ``kvbits_version``, the ``scheme``, the ``model`` it belongs
to (fingerprint and shape; ``kv_layers``, the layers it holds, since format 2: a format 1 artifact holds every
layer), the calibration ``data``, ``percentile``, ``fisher``, the creation date,
per-layer statistics, and the size and sha256 of the tensor file, so a truncated or altered file is
caught before use, and ``meta_sha256``, the sha256 of the JSON's own fields (canonical form, less ``created`` and
``timing_s``), so an edited field is too (an artifact written before it records none: it loads, with a logged
note). Never pickle.

Integration (cache, simulator)::

    art = load_calibration(path, model_config=model.config, scheme=scheme)
    kw = art.quantize_kwargs(i, "key")           # {'static_scale', 'static_zero', 'codebook'}
    qt = quantize(block, scheme.key, **kw)       # block: (B, H_kv, n, D) pre-RoPE keys of layer i
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbits._files import write_bytes_atomic
from kvbits._json import dumps, is_number, loads
from kvbits.quant.nuq import check_codebook
from kvbits.quant.tensor import check_static_decode
from kvbits.schemes.spec import KVScheme, TensorSpec

logger = logging.getLogger(__name__)

# 2: model.kv_layers, the layers the artifact holds (a hybrid model's attention layers); 1 (still read): every layer
ARTIFACT_FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)
TENSORS_FILE = "calibration.safetensors"
META_FILE = "calibration.json"
SIDES = ("key", "value")
_MODEL_SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
_MODEL_FIELDS = (
    "model_type",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)


def spec_needs_calibration(spec: TensorSpec) -> bool:
    """A spec needs an artifact when its scales are static (int/NUQ) or it codes with a codebook
    (``TensorSpec.calibrated``)."""
    return spec.calibrated


def spec_calibratable(spec: TensorSpec) -> bool:
    """An artifact holds parameters for this spec (``TensorSpec.calibratable``): those it needs, and
    the optional per-tensor scale of a static FP8 spec."""
    return spec.calibratable


def tensor_dtype(spec: TensorSpec) -> torch.dtype:
    """The dtype an artifact stores ``spec``'s tensors in: float32 for an FP8 scale (as the cache keeps
    it), float16 for everything else."""
    return torch.float32 if spec.kind == "fp8" else torch.float16


def expected_tensors(
    scheme: KVScheme, num_layers: int, num_kv_heads: int, head_dim: int, kv_layers: list[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an artifact for ``scheme`` on this model must hold: for layers ``kv_layers``
    (those holding K/V), or every layer ``0 .. num_layers - 1`` when None."""
    out: dict[str, tuple[int, ...]] = {}
    for i in range(num_layers) if kv_layers is None else kv_layers:
        layer_scheme = scheme.for_layer(i)  # a mixed scheme: the layer's own
        for side, spec in zip(SIDES, (layer_scheme.key, layer_scheme.value)):
            if spec.kind == "fp8" and spec.static:
                out[f"layers.{i}.{side}_scale"] = (num_kv_heads,) if spec.granularity == "head" else ()
            if spec.static and spec.kind in ("int", "nuq"):
                out[f"layers.{i}.{side}_scale"] = (num_kv_heads, head_dim)
                if spec.has_zero_point:
                    out[f"layers.{i}.{side}_zero"] = (num_kv_heads, head_dim)
            if spec.kind == "nuq":
                out[f"layers.{i}.{side}_codebook"] = (2**spec.bits,)
            if spec.centre:
                out[f"layers.{i}.{side}_mean"] = (num_kv_heads, head_dim)
            if spec.smooth is not None:
                out[f"layers.{i}.{side}_factor"] = (num_kv_heads, head_dim)
    return out


def _config_value(cfg: Any, name: str, *default: Any) -> Any:
    """``cfg``'s field ``name``: an attribute of a transformers config (``AttributeError`` when it has none, unless
    a ``default`` is given), a key of a parsed ``config.json`` (None when absent)."""
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, *default)


def model_kv_layers(config: Any) -> list[int] | None:
    """The layers of ``config`` (a transformers config or a ``config.json`` dict) that store K/V, as ``kvbits.plan``
    counts them (not a hybrid model's convolution / linear-attention / state-space layers, nor KV-sharing ones), or
    None when the planner can not read the config."""
    from kvbits.plan.config import model_shape

    try:
        layers = model_shape(config).layers
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return [i for i, layer in enumerate(layers) if layer.attention != "none"]


def _rope_params(p: Mapping[str, Any], partial: Any) -> dict[str, Any]:
    """One RoPE parameter set as the artifact records it: ``rope_theta``, ``rope_type`` (``type`` in older
    ``rope_scaling`` dicts; ``"default"`` when absent), ``partial_rotary_factor`` (1.0 when absent) and the
    scaling's other fields (``factor``, ...), numbers as floats, None fields left out."""
    out: dict[str, Any] = {"rope_type": p.get("rope_type") or p.get("type") or "default"}
    for k, v in p.items():
        if k in ("rope_type", "type") or v is None:
            continue
        out[k] = float(v) if is_number(v) else v
    prf = out.get("partial_rotary_factor", partial)
    out["partial_rotary_factor"] = 1.0 if prf is None else float(prf)
    return out


def rope_record(config: Any) -> dict[str, Any] | None:
    """The RoPE parameters of ``config`` (a text config, transformers object or ``config.json`` dict): transformers
    5's ``rope_parameters`` (per layer type when it is keyed so, Gemma 3) or the older ``rope_theta`` and
    ``rope_scaling``, as ``_rope_params`` writes them, or None when the config names no RoPE. Keys after RoPE
    (channel means and smoothing factors of a ``pre_rope=False`` key spec) depend on them; pre-RoPE keys do not."""
    partial = _config_value(config, "partial_rotary_factor", None)
    params = _config_value(config, "rope_parameters", None)
    if not isinstance(params, Mapping):
        theta, scaling = _config_value(config, "rope_theta", None), _config_value(config, "rope_scaling", None)
        if theta is None and not isinstance(scaling, Mapping):
            return None
        params = {**(scaling if isinstance(scaling, Mapping) else {}), "rope_theta": theta}
    try:
        if params and all(isinstance(v, Mapping) for v in params.values()):  # per layer type
            return {str(k): _rope_params(v, partial) for k, v in sorted(params.items())}
        return _rope_params(params, partial)
    except (TypeError, ValueError, AttributeError):  # a config we can not read: not recorded, not compared
        return None


def _rope_differs(mine: Any, theirs: Any, *, known_only: bool) -> bool:
    """Whether two ``rope_record``s differ: flat or per layer type alike (else not comparable: False); with
    ``known_only`` only the fields both record."""
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return False
    nested = [all(isinstance(v, dict) for v in r.values()) for r in (mine, theirs)]
    if nested[0] != nested[1]:
        return False
    pairs = [(mine[k], theirs[k]) for k in mine if k in theirs] if nested[0] else [(mine, theirs)]
    if nested[0] and set(mine) != set(theirs) and not known_only:
        return True
    for a, b in pairs:
        keys = set(a) & set(b) if known_only else set(a) | set(b)
        if any(a.get(k) != b.get(k) for k in keys):
            return True
    return False


def describe_model(config: Any, *, fingerprint: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The ``model`` record of an artifact from a transformers config (or a checkpoint's ``config.json``
    as a dict: a field it lacks is None).

    ``fingerprint`` is ``LoadedModel.fingerprint`` when the model came from ``load_model`` (it pins
    the weights); otherwise ``config:`` + a hash of the shape fields (it pins the architecture only).
    """
    from kvbits.calibrate.observers import config_head_dim, config_kv_heads, text_config

    def as_int(key: str) -> int | None:
        value = _config_value(cfg, key)
        return None if value is None else int(value)

    cfg = text_config(config)
    d: dict[str, Any] = {
        "model_type": _config_value(cfg, "model_type", None),
        "num_layers": as_int("num_hidden_layers"),
        "num_attention_heads": as_int("num_attention_heads"),
        "num_kv_heads": config_kv_heads(cfg),
        "head_dim": config_head_dim(cfg),
        "hidden_size": as_int("hidden_size"),
        "vocab_size": as_int("vocab_size"),
    }
    config_hash = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "fingerprint": fingerprint or f"config:{config_hash}",
        "name": name,
        "config_hash": config_hash,
        **d,
        "rope": rope_record(cfg),  # not hashed: the fingerprints of artifacts written before it stay valid
    }


_UNHASHED = ("meta_sha256", "created", "timing_s")  # the hash itself, and fields that do not change what it means


def meta_sha256(meta: Mapping[str, Any]) -> str:
    """The sha256 of ``meta`` (a parsed ``calibration.json``) less ``_UNHASHED``, as canonical JSON (sorted keys,
    no spaces, non-finite floats as ``dumps`` writes them): what ``save`` records as ``meta_sha256`` and
    ``load_calibration`` checks."""
    kept = {k: v for k, v in meta.items() if k not in _UNHASHED}
    return hashlib.sha256(dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class CalibrationArtifact:
    """Calibrated per-layer constants for one scheme on one model.

    Attributes:
        scheme: the scheme it was calibrated for (codebook sizes and static specs follow it).
        tensors: ``layers.{i}.{side}_{scale|zero|codebook}`` float16 tensors (see the module docstring).
        meta: the JSON record (model, data, percentile, fisher, per-layer ``stats``, ...).
        path: the folder it was read from or written to, if any.
        logged: what ``QuantizedKVCache`` has already warned about serving it in this process (``"length"``:
            past ``max_calibrated_length``; ``"clipping"``): each is logged once per artifact, not once per cache
            (a server makes a cache per request). Not saved.
    """

    scheme: KVScheme
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    logged: set[str] = field(default_factory=set, repr=False, compare=False)

    # ---------------------------------------------------------------------------------- facts
    @property
    def num_layers(self) -> int:
        return int(self.meta["model"]["num_layers"])

    @property
    def kv_layers(self) -> list[int]:
        """The layers it holds parameters for (ascending): a hybrid model's attention layers; every layer
        ``0 .. num_layers - 1`` for a model whose every layer attends (and a format 1 artifact)."""
        layers = self.meta["model"].get("kv_layers")
        return list(range(self.num_layers)) if layers is None else [int(i) for i in layers]

    @property
    def num_kv_heads(self) -> int:
        return int(self.meta["model"]["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.meta["model"]["head_dim"])

    @property
    def fingerprint(self) -> str:
        """The model fingerprint it was made for."""
        return str(self.meta["model"]["fingerprint"])

    @property
    def max_calibrated_length(self) -> int:
        """The longest context (tokens) the statistics were taken over; positions beyond it are
        extrapolation (pre-RoPE keys depend little on position, but warn past it)."""
        return int(self.meta["data"]["context"])

    def fitted_sinks(self, layer: int) -> int:
        """The first tokens of each window that layer ``layer``'s parameters were fitted without (the sinks the
        scheme it was calibrated for keeps exact): ``data.excluded_sink_tokens`` (one count, or one per layer of
        ``kv_layers``) where recorded, else the sinks of ``scheme.for_layer(layer)``, which ``kvbits calibrate`` always
        leaves out (an artifact fitted from samples directly may not record the count)."""
        recorded = self.meta.get("data", {}).get("excluded_sink_tokens")
        if _is_int(recorded):
            return recorded
        if isinstance(recorded, list) and len(recorded) == len(self.kv_layers) and layer in self.kv_layers:
            return int(recorded[self.kv_layers.index(layer)])
        return self.scheme.for_layer(layer).sinks

    @property
    def layer_stats(self) -> list[dict[str, Any]]:
        """Per-layer calibration statistics (clipping rates, codebook gains)."""
        return list(self.meta.get("stats", []))

    # ----------------------------------------------------------------------- what the cache calls
    def _spec(self, side: str, layer: int) -> TensorSpec:
        """The spec ``layer``'s ``side`` is stored by (a mixed scheme resolves per layer)."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        scheme = self.scheme.for_layer(layer)
        return scheme.key if side == "key" else scheme.value

    def _tensor_spec(self, name: str) -> TensorSpec:
        """The spec of tensor ``layers.{i}.{side}_{what}``."""
        layer, rest = name.split(".")[1:]
        return self._spec(rest.split("_")[0], int(layer))

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if layer not in self.kv_layers:
            raise ValueError(
                f"calibration{self._where()} holds no parameters for layer {layer}: it holds the layers that store "
                f"K/V, {self.kv_layers} (a hybrid model's convolution / linear-attention layers store none)"
            )
        return layer

    def codebook(self, layer: int, side: str) -> torch.Tensor | None:
        """NUQ codebook of ``layer``'s ``side`` (float16 ``(2**bits,)``), or None if that side is not NUQ."""
        spec = self._spec(side, self._layer(layer))
        if spec.kind != "nuq":
            return None
        return self.tensors[f"layers.{layer}.{side}_codebook"]

    def static_qparams(self, layer: int, side: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Static per-channel ``(scale, zero)`` of ``layer``'s ``side``, float16, each ``(1, H_kv, 1, D)``
        (broadcasts over any ``(B, H_kv, n, D)`` block; ``zero`` is None for symmetric specs), or None
        when that side's scales are dynamic. For NUQ, ``scale`` is the channel range and ``zero`` its
        minimum; for int, ``scale`` is the step and ``zero`` the minimum (as ``quantize`` expects). For
        a static FP8 spec: ``(scale, None)``, the float32 per-tensor scale ``()`` or per-head scales
        ``(1, H_kv, 1, 1)``."""
        spec = self._spec(side, self._layer(layer))
        if not spec.static:
            return None
        i, H, D = layer, self.num_kv_heads, self.head_dim
        if spec.kind == "fp8":
            scale = self.tensors[f"layers.{i}.{side}_scale"]
            return (scale.reshape(1, H, 1, 1) if spec.granularity == "head" else scale), None
        scale = self.tensors[f"layers.{i}.{side}_scale"].reshape(1, H, 1, D)
        zero = self.tensors.get(f"layers.{i}.{side}_zero")
        return scale, None if zero is None else zero.reshape(1, H, 1, D)

    def channel_transform(self, layer: int, side: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(mean, factor)`` of ``layer``'s ``side``, float16 ``(1, H_kv, 1, D)`` each, or None where the spec
        has no ``centre`` / ``smooth``."""
        spec = self._spec(side, self._layer(layer))
        H, D = self.num_kv_heads, self.head_dim
        mean = self.tensors[f"layers.{layer}.{side}_mean"].reshape(1, H, 1, D) if spec.centre else None
        factor = self.tensors[f"layers.{layer}.{side}_factor"].reshape(1, H, 1, D) if spec.smooth is not None else None
        return mean, factor

    def quantize_kwargs(
        self, layer: int, side: str, *, device: torch.device | str | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for ``kvbits.quant.quantize`` / ``fake_quantize`` of ``layer``'s ``side``:
        ``static_scale``, ``static_zero``, ``codebook``, ``channel_mean``, ``channel_factor`` (only those that
        side needs; moved to ``device``)."""
        out: dict[str, Any] = {}
        mean, factor = self.channel_transform(layer, side)
        if mean is not None:
            out["channel_mean"] = mean
        if factor is not None:
            out["channel_factor"] = factor
        qp = self.static_qparams(layer, side)
        if qp is not None:
            out["static_scale"] = qp[0]
            if qp[1] is not None:  # symmetric specs have no zero-point
                out["static_zero"] = qp[1]
        cb = self.codebook(layer, side)
        if cb is not None:
            out["codebook"] = cb
        if device is not None:
            out = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        return out

    # -------------------------------------------------------------------------------- checks
    def check_scheme(self, scheme: KVScheme) -> None:
        """Raise ``ValueError`` unless ``scheme`` stores K and V as this artifact was calibrated for (in
        every layer, for mixed schemes): each side ``scheme`` calibrates (``TensorSpec.calibratable``) by the spec
        the artifact's scheme has there; the artifact's other sides are not installed. A ``scheme`` that calibrates
        nothing at all is refused: the whole artifact would be ignored. So is a ``scheme`` keeping fewer sinks in a
        calibrated layer than the parameters were fitted without (``fitted_sinks``): its first tokens, attention sinks
        whose K/V are outliers, would be quantized against ranges that never saw them (they clip); more sinks are
        harmless (those tokens are kept exact)."""
        if not scheme.calibratable():
            raise ValueError(
                f"scheme {scheme.name!r} calibrates nothing (no static scales, codebooks or channel vectors); this "
                f"calibration{self._where()} (made for {self.scheme.name!r}) would be ignored; give no calibration, "
                f"or serve scheme {self.scheme.name!r}"
            )
        for i in self.kv_layers:
            where = f" layer {i}" if self.scheme.is_mixed or scheme.is_mixed else ""
            sub = scheme.for_layer(i)
            for side in SIDES:
                mine, theirs = self._spec(side, i), getattr(sub, side)
                if spec_calibratable(theirs) and mine != theirs:
                    raise ValueError(
                        f"calibration{self._where()} was made for scheme "
                        f"{self.scheme.name!r} ({side}{where}: {mine}), not for scheme {scheme.name!r} "
                        f"({side}{where}: {theirs}); re-run kvbits calibrate with this scheme"
                    )
            fitted, served = self.fitted_sinks(i), sub.sinks
            if sub.calibratable() and served < fitted:
                raise ValueError(
                    f"calibration{self._where()} (scheme {self.scheme.name!r}) was fitted without the first {fitted} "
                    f"tokens of each window{where} (the sinks it keeps exact); scheme {scheme.name!r} keeps "
                    f"{served}{where}, so positions {served}..{fitted - 1} would be quantized against ranges that never "
                    f"saw them (attention sinks are outliers: they clip); serve it with sinks >= {fitted}, or re-run "
                    "kvbits calibrate with this scheme"
                )

    def check_model(
        self, model_config: Any = None, fingerprint: str | None = None, *, known_only: bool = False
    ) -> None:
        """Raise ``ValueError`` if the artifact does not belong to this model (config shape or fingerprint).

        ``model_config``: a transformers config, or a checkpoint's ``config.json`` as a dict. ``known_only``:
        compare only the fields both sides record (an artifact fitted from samples has no ``model_type``,
        ``hidden_size``, ... ; a ``config.json`` may lack one); otherwise an unrecorded field differs.
        """
        made_for = self._made_for()
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise ValueError(
                f"calibration{self._where()} was made for {made_for}, not for the model with fingerprint "
                f"{fingerprint!r}; re-run kvbits calibrate for this model"
            )
        if model_config is not None:
            mine = self.meta["model"]
            theirs = describe_model(model_config)
            diff = [
                f"{k}: {mine.get(k)} vs {theirs[k]}"
                for k in _MODEL_FIELDS
                if mine.get(k) != theirs[k] and not (known_only and None in (mine.get(k), theirs[k]))
            ]
            if self._post_rope_keys() and _rope_differs(mine.get("rope"), theirs["rope"], known_only=known_only):
                diff.append(f"rope: {mine.get('rope')} vs {theirs['rope']} (layers {self._post_rope_keys()} hold "
                            "channel means / smoothing factors of keys after RoPE, which move with it)")  # fmt: skip
            if diff:
                raise ValueError(
                    f"calibration{self._where()} was made for {made_for}; this model differs "
                    f"({'; '.join(diff)} [artifact vs model]); re-run kvbits calibrate for this model"
                )
            self._check_kv_layers(model_kv_layers(model_config), "this model")

    def _post_rope_keys(self) -> list[int]:
        """The layers whose key parameters were fitted on keys after RoPE (channel means / smoothing factors of a
        ``pre_rope=False`` key spec): they hold only for the RoPE parameters they were calibrated with."""
        return [i for i in self.kv_layers if (k := self._spec("key", i)).has_channel_transform and not k.pre_rope]

    def _check_kv_layers(self, want: list[int] | None, what: str) -> None:
        """``ValueError`` unless the artifact holds exactly the layers ``want`` that store K/V in ``what`` (None: not
        known, then only an artifact holding every layer passes)."""
        mine = self.kv_layers
        if mine == want or (want is None and mine == list(range(self.num_layers))):
            return
        lacks = sorted(set(want or range(self.num_layers)) - set(mine))
        raise ValueError(
            f"calibration{self._where()} holds the K/V parameters of layers {mine} of {self.num_layers}; {what} "
            + (f"stores K/V in layers {want}" if want is not None else "may store K/V in every layer")
            + (f" (no parameters for attention layers {lacks})" if lacks else "")
            + "; re-run kvbits calibrate for this model"
        )

    def _where(self) -> str:
        return "" if self.path is None else f" in {self.path}"

    def _made_for(self) -> str:
        m = self.meta["model"]
        return (
            f"model {m.get('name') or m.get('model_type')!r} (fingerprint {m.get('fingerprint')}, "
            f"{m.get('model_type')}, {m.get('num_layers')} layers, {m.get('num_kv_heads')} KV heads, "
            f"head dim {m.get('head_dim')})"
        )

    def validate(self) -> None:
        """Check tensor names, shapes, dtypes and codebooks against the scheme and model shape, and that static
        scales (with their zero-points) decode the largest K/V within float16 (``check_static_decode``)."""
        where = self._where() or " (in memory)"
        expected = expected_tensors(self.scheme, self.num_layers, self.num_kv_heads, self.head_dim, self.kv_layers)
        missing = sorted(set(expected) - set(self.tensors))
        extra = sorted(set(self.tensors) - set(expected))
        if missing or extra:
            raise ValueError(
                f"calibration{where}: tensors do not match scheme {self.scheme.name!r} on a "
                f"{self.num_layers}-layer model: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}"
            )
        for name, shape in expected.items():
            t = self.tensors[name]
            spec = self._tensor_spec(name)
            dtype = tensor_dtype(spec)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"calibration{where}: {name} is {t.dtype} {tuple(t.shape)}, expected "
                    f"{str(dtype).removeprefix('torch.')} {shape}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"calibration{where}: {name} holds non-finite values")
            if name.endswith("_codebook"):
                try:
                    check_codebook(t, spec.bits)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"calibration{where}: {name}: {exc}") from None
            elif spec.kind == "fp8" and not bool((t > 0).all()):
                raise ValueError(
                    f"calibration{where}: {name} is {t.tolist()}; an FP8 scale divides, it must be > 0"
                )
            elif name.endswith("_factor") and not bool((t > 0).all()):
                raise ValueError(
                    f"calibration{where}: {name} has {int((t <= 0).sum())} factors <= 0; a smoothing factor "
                    "divides, it must be > 0"
                )
            elif name.endswith("_factor") and self.meta.get("tie_rope_pairs") and spec.pre_rope:
                D = t.shape[-1]
                if not torch.equal(t[..., : D // 2], t[..., D // 2 :]):
                    raise ValueError(
                        f"calibration{where}: {name} differs between RoPE pair channels d and d + {D // 2}, "
                        "but the artifact says tie_rope_pairs (fitted equal over each pair)"
                    )
            elif name.endswith("_scale") and bool((t < 0).any()):
                raise ValueError(
                    f"calibration{where}: {name} has {int((t < 0).sum())} negative scales; scales must be >= 0"
                )
            # A scale of 0 stays valid: a channel constant over the calibration samples has range 0 (its
            # zero-point holds the constant). Serving counts every other value such a channel receives as
            # clipped (QuantizedTensor.clipped), so the mismatch shows in the calibration report.
        for name in expected:  # with their zero-points and codebooks, checked above: levels past float16 are inf
            if name.endswith("_scale"):
                base = name.removesuffix("scale")
                try:
                    check_static_decode(self._tensor_spec(name), self.tensors[name], self.tensors.get(base + "zero"),
                                        name, self.tensors.get(base + "codebook"))  # fmt: skip
                except ValueError as exc:
                    raise ValueError(f"calibration{where}: {exc}") from None

    # ------------------------------------------------------------------------------- writing
    def save(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write ``calibration.safetensors`` then ``calibration.json`` (atomically) into ``out_dir``.

        Raises:
            ValueError: an artifact ``load_calibration`` would refuse: tensors that do not match the scheme and model
                shape (``validate``), or JSON fields it refuses (the same checks and words), or ``meta`` that is
                not JSON. Checked before anything is written: an artifact already in ``out_dir`` stays whole.
        """
        from safetensors.torch import save

        out = Path(out_dir).expanduser()
        meta = dict(self.meta)
        meta["format_version"] = ARTIFACT_FORMAT_VERSION
        meta["scheme"] = self.scheme.to_dict()
        problem = _meta_problem(meta, files=False)  # before validate(), which reads meta["model"]
        refused = "; load_calibration would refuse it as malformed"
        if problem is None:
            self.validate()
            tensors = {
                k: v.detach().to("cpu", tensor_dtype(self._tensor_spec(k))).contiguous()
                for k, v in sorted(self.tensors.items())
            }
            blob = save(
                tensors, metadata={"format": "kvbits-calibration", "format_version": str(ARTIFACT_FORMAT_VERSION)}
            )
            meta["files"] = {TENSORS_FILE: {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
            try:
                meta["meta_sha256"] = meta_sha256(loads(dumps(meta)))  # of the fields as load_calibration reads them
                text = dumps(meta, indent=1, sort_keys=True) + "\n"
            except (TypeError, ValueError) as exc:
                problem, refused = f"meta is not JSON: {exc}", ""
            else:
                problem = _meta_problem(loads(text))  # what load_calibration will read
        if problem is not None:
            raise ValueError(
                f"calibration not written to {out}: {problem}{refused}"
            )
        out.mkdir(parents=True, exist_ok=True)
        for name, content in ((TENSORS_FILE, blob), (META_FILE, text.encode())):
            write_bytes_atomic(out / name, content)
        self.meta, self.path = meta, out
        logger.info("calibration written to %s", out)
        return out


def _kvbits_version() -> str:
    import kvbits

    return str(getattr(kvbits, "__version__", "?"))


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------- loading


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _meta_problem(meta: dict[str, Any], *, files: bool = True) -> str | None:
    """What is wrong with the JSON fields the loader, the cache and the reports use, or None.

    Only the tensor file is covered by a sha256; these fields are read as they are, so an edited
    ``data.context`` of -100 would report more positions "beyond calibrated" than a window has, and a
    ``num_layers`` of 2.7 would be truncated silently, and a ``percentile`` string, a missing ``fisher`` or a short
    ``stats`` list failed later in ``kvbits calibrate``'s summary, ``compose`` or the vLLM export (or were reported
    as they stood). ``percentile`` (a number in [50, 100]) and ``fisher`` (a boolean) are required except in a
    composed artifact (``compose`` keeps them only where its sources agree); ``stats``, when present, holds one row
    of numbers per layer. ``load_calibration`` and ``CalibrationArtifact.save``
    both check with it; ``files=False``: all but the ``files`` record (``save``, before it writes that file).
    """

    def field(path: str, value: Any, want: str) -> str:
        return f"{path} must be {want}, got {value!r}"

    keys = ("scheme", "model", "data", "files") if files else ("scheme", "model", "data")
    for key in keys:
        if key not in meta:
            return f"the {key!r} field is missing"
        if not isinstance(meta[key], dict):
            return field(key, meta[key], "a JSON object")
    model, data = meta["model"], meta["data"]
    for k in _MODEL_FIELDS:
        if k not in model:
            return f"model.{k} is missing"
    for k in _MODEL_SHAPE_FIELDS:
        if not _is_int(model[k]) or model[k] < 1:
            return field(f"model.{k}", model[k], "a positive integer")
    for k in ("num_attention_heads", "hidden_size", "vocab_size"):  # None for artifacts fitted from samples
        if model[k] is not None and (not _is_int(model[k]) or model[k] < 1):
            return field(f"model.{k}", model[k], "a positive integer or null")
    for k in ("model_type", "name"):
        if model.get(k) is not None and not isinstance(model[k], str):
            return field(f"model.{k}", model[k], "a string or null")
    if model.get("rope") is not None and not isinstance(model["rope"], dict):
        return field("model.rope", model["rope"], "a JSON object (the RoPE parameters) or null")
    kv_layers = model.get("kv_layers")
    if kv_layers is not None and (
        not isinstance(kv_layers, list) or not kv_layers or not all(_is_int(i) for i in kv_layers)
        or kv_layers != sorted(set(kv_layers)) or not 0 <= kv_layers[0] <= kv_layers[-1] < model["num_layers"]
    ):  # fmt: skip
        return field("model.kv_layers", kv_layers, f"ascending distinct layer indices in [0, {model['num_layers']})")
    if not isinstance(model.get("fingerprint"), str) or not model["fingerprint"]:
        return field("model.fingerprint", model.get("fingerprint"), "a non-empty string")
    if "context" not in data:
        return "data.context is missing"
    if not _is_int(data["context"]) or data["context"] < 1:
        return field("data.context", data["context"], "a positive integer (the calibrated length in tokens)")
    for k in ("windows", "tokens"):
        if data.get(k) is not None and (not _is_int(data[k]) or data[k] < 1):
            return field(f"data.{k}", data[k], "a positive integer or null")
    if data.get("row_width") is not None and (not _is_int(data["row_width"]) or data["row_width"] < 1):
        return field("data.row_width", data["row_width"], "a positive integer (the calibrated (W, T) ids' T) or null")
    if data.get("name") is not None and not isinstance(data["name"], str):
        return field("data.name", data["name"], "a string or null")
    excluded = data.get("excluded_sink_tokens")
    n_held = model["num_layers"] if kv_layers is None else len(kv_layers)
    if excluded is not None and not (
        (_is_int(excluded) and excluded >= 0)
        or (isinstance(excluded, list) and len(excluded) == n_held and all(_is_int(n) and n >= 0 for n in excluded))
    ):
        return field("data.excluded_sink_tokens", excluded,
                     f"a non-negative integer, or {n_held} of them (one per calibrated layer)")  # fmt: skip
    record = meta["files"].get(TENSORS_FILE) if files else {"bytes": 0, "sha256": "0" * 64}
    if not isinstance(record, dict):
        return field(f"files.{TENSORS_FILE}", record, "a JSON object with bytes and sha256")
    if not _is_int(record.get("bytes")) or record["bytes"] < 0:
        return field(f"files.{TENSORS_FILE}.bytes", record.get("bytes"), "a non-negative integer")
    sha = record.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        return field(f"files.{TENSORS_FILE}.sha256", sha, "64 lowercase hex digits")
    composed = "composed" in meta  # compose keeps percentile / fisher only where all its sources agree on them
    if "percentile" in meta or not composed:
        if "percentile" not in meta:
            return "the 'percentile' field is missing"
        p = meta["percentile"]
        if not is_number(p) or not 50 <= p <= 100:
            return field("percentile", p, "a number in [50, 100]")
    if "fisher" in meta or not composed:
        if "fisher" not in meta:
            return "the 'fisher' field is missing"
        if not isinstance(meta["fisher"], bool):
            return field("fisher", meta["fisher"], "true or false")
    stats = meta.get("stats", [])
    if not isinstance(stats, list) or not all(isinstance(row, dict) for row in stats):
        return field("stats", stats, "a list of per-layer JSON objects")
    rows = model["num_layers"] if kv_layers is None else len(kv_layers)  # one per layer it holds
    if "stats" in meta and len(stats) != rows:
        held = f"model.num_layers = {rows}" if kv_layers is None else f"{rows} in model.kv_layers"
        return f"stats must hold one row per calibrated layer ({held}), got {len(stats)} rows"
    for i, row in enumerate(stats):
        for k, v in row.items():
            if not is_number(v):
                return field(f"stats[{i}].{k}", v, "a number")
    try:
        KVScheme.from_dict(meta["scheme"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"scheme: {type(exc).__name__}: {exc}"
    return None


def checked_artifact(
    artifact: Any, scheme: KVScheme, model_config: Any = None, num_layers: int | None = None
) -> CalibrationArtifact:
    """What a cache installs: ``artifact`` (a ``CalibrationArtifact``, or the folder ``kvbits calibrate`` wrote, loaded
    with ``load_calibration``), checked against ``scheme`` and, when given, the model's config and the cache's layer
    count ``num_layers`` (a cache built with ``num_layers=`` and no config).

    Raises:
        TypeError: neither an artifact nor a path.
        ValueError: an artifact made for another scheme or model (``check_scheme``, ``check_model``), or for
            another number of layers than ``num_layers``.
    """
    if isinstance(artifact, (str, os.PathLike)):
        artifact = load_calibration(artifact)
    if not callable(getattr(artifact, "check_scheme", None)):
        raise TypeError(
            "calibration must be a kvbits.calibrate.CalibrationArtifact or the folder `kvbits calibrate` "
            f"wrote, got {type(artifact).__name__}"
        )
    artifact.check_scheme(scheme)
    if model_config is not None:
        artifact.check_model(model_config)
    if num_layers is not None and artifact.num_layers != num_layers:
        raise ValueError(
            f"calibration{artifact._where()} has {artifact.num_layers} layers; this cache has {num_layers} (the "
            f"calibration was made for {artifact._made_for()}); re-run kvbits calibrate for this model"
        )
    if model_config is None:  # a cache without a config quantizes every layer it is given
        artifact._check_kv_layers(None, "a cache built without config= (it quantizes every layer)")
    return artifact


def load_calibration(
    path: str | os.PathLike[str],
    model_config: Any = None,
    fingerprint: str | None = None,
    *,
    scheme: KVScheme | str | None = None,
) -> CalibrationArtifact:
    """Read and validate a calibration folder written by ``kvbits calibrate``.

    Args:
        path: the folder (or either of its two files).
        model_config: the transformers config of the model it will be used with: shape mismatches
            (layers, KV heads, head dim, vocabulary, ...) raise.
        fingerprint: ``LoadedModel.fingerprint`` of that model: a different one raises.
        scheme: the scheme it will be used with (name or object): a different K/V storage raises.

    Raises:
        ValueError: missing, truncated or corrupt files (naming the file and the problem); a
            ``format_version`` this kvbits does not read; a model or scheme it was not made for.
    """
    from safetensors import safe_open

    d = Path(path).expanduser()
    if d.is_file() and d.name in (META_FILE, TENSORS_FILE):
        d = d.parent
    if not d.is_dir():
        raise ValueError(
            f"no calibration folder at {d} (expected {META_FILE} and {TENSORS_FILE}; "
            "create one with `kvbits calibrate`)"
        )
    meta_path, tensors_path = d / META_FILE, d / TENSORS_FILE
    if not meta_path.is_file():
        raise ValueError(
            f"{meta_path} is missing: {d} is not a complete calibration (re-run kvbits calibrate)"
        )
    try:
        meta = loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{meta_path} is not valid JSON (corrupt or truncated): {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} does not hold a JSON object")  # noqa: TRY004 - bad file content
    version = meta.get("format_version")
    if not _is_int(version) or version not in READ_FORMAT_VERSIONS:  # JSON true == 1 in Python
        newer = _is_int(version) and version > ARTIFACT_FORMAT_VERSION
        raise ValueError(
            f"{meta_path} has format_version {version!r}; this kvbits reads format_version "
            f"{' or '.join(map(str, READ_FORMAT_VERSIONS))} (written by kvbits {meta.get('kvbits_version', '?')}, read by kvbits "
            f"{_kvbits_version()}); "
            + ("upgrade kvbits to read it, or " if newer else "")
            + "re-run kvbits calibrate with this version"
        )
    problem = _meta_problem(meta)
    if problem is not None:
        raise ValueError(f"{meta_path} is malformed: {problem} (edited or corrupt? re-run kvbits calibrate)")
    art_scheme = KVScheme.from_dict(meta["scheme"])  # checked by _meta_problem
    record = meta["files"][TENSORS_FILE]
    want_bytes, want_sha = record["bytes"], record["sha256"]

    if not tensors_path.is_file():
        raise ValueError(
            f"{tensors_path} is missing (the JSON beside it describes {want_bytes} bytes of tensors)"
        )
    size = tensors_path.stat().st_size
    if size != want_bytes:
        raise ValueError(
            f"{tensors_path} is truncated or altered: {size} bytes, expected {want_bytes} "
            "(re-run kvbits calibrate)"
        )
    sha = _file_sha256(tensors_path)
    if sha != want_sha:
        raise ValueError(
            f"{tensors_path} is corrupt: sha256 {sha}, expected {want_sha} (re-run kvbits calibrate)"
        )
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(tensors_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[name] = f.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{tensors_path} is not a readable safetensors file: {exc}") from None

    art = CalibrationArtifact(scheme=art_scheme, tensors=tensors, meta=meta, path=d)
    art.validate()
    art.check_model(model_config, fingerprint)
    if scheme is not None:
        from kvbits.schemes.presets import get_scheme

        art.check_scheme(get_scheme(scheme))
    _check_meta_sha256(meta, meta_path)  # last: a field edited into something refused is named by that refusal
    return art


def _check_meta_sha256(meta: dict[str, Any], meta_path: Path) -> None:
    """``ValueError`` unless ``meta``'s fields hash to the ``meta_sha256`` it records (``meta_sha256``): a field
    edited by hand (a scheme field, a statistic, the calibrated context) was read as it stood. An artifact that
    records none (written before kvbits recorded it) is read unchecked, with a logged note."""
    recorded = meta.get("meta_sha256")
    if recorded is None:
        logger.info(
            "%s records no meta_sha256 (written by kvbits %s, before it did): its fields are read unchecked",
            meta_path,
            meta.get("kvbits_version", "?"),
        )
        return
    actual = meta_sha256(meta)
    if recorded != actual:
        raise ValueError(
            f"{meta_path} was edited after it was written: its fields hash to meta_sha256 {actual}, it records "
            f"{recorded!r} (only created and timing_s may change); re-run kvbits calibrate (or, to read an edit you "
            "made on purpose unchecked, delete its meta_sha256)"
        )
