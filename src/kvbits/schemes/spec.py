"""What to quantize and how: `TensorSpec` (one of K or V) and `KVScheme` (the whole cache policy).

Both are frozen dataclasses with a JSON form carrying a `version`, so the same object can drive the
planner (bytes), the cache (real storage), the simulator (fast evaluation) and the kernels.

Granularities are named by what one scale covers, for K/V shaped ``(B, H_kv, T, D)``:

- ``token``:   one scale per (token, head) over ``D`` channels, or over groups of ``group_size``
               channels (KIVI values, FlexGen-style group-wise).
- ``channel``: one scale per (head, channel) over a group of ``group_size`` tokens (KIVI keys). The
               group is a span of *tokens*: a group of one token would be lossless-looking nonsense,
               so ``group_size >= 2`` is required. With ``static=True`` (KVQuant keys) the scale is a
               calibrated per-(head, channel) constant covering every token: no token group
               (``group_size=None``), so tokens can be flushed one at a time.
- ``head``:    one scale per head over every token and channel of a flushed block; for FP8 (which
               needs ``static=True`` here) a calibrated per-KV-head scale covering every token (vLLM's
               ``attn_head`` strategy).
- ``tensor``:  one scale per sequence over the flushed block (all heads); with ``static=True`` a
               fixed scale from calibration (FP8 with scale 1.0 is vLLM's uncalibrated default).
               FP8 has no dynamic per-tensor scale: ``kind="fp8"`` with ``tensor`` needs ``static=True``.

``group_size`` applies to integer / NUQ specs at ``token`` granularity (channels per scale, at least 2)
and dynamic ``channel`` granularity (tokens per scale, at least 2); every other spec takes ``None``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SCHEME_FORMAT_VERSION = 1

KINDS = ("float", "int", "fp8", "nuq")
GRANULARITIES = ("token", "channel", "head", "tensor")
FLOAT_BITS = (16, 32)
INT_BITS = (2, 3, 4, 8)
NUQ_BITS = (2, 3, 4)
FP8_FORMATS = ("e4m3", "e5m2")
FLOAT_FORMATS = ("fp16", "bf16", "fp32")
ROTATIONS = ("hadamard", "hadamard-vllm")  # kvbits.quant.rotate: the same Hadamard, two sign vectors
ROUNDINGS = ("nearest", "trunc")  # how a scaled value becomes an integer code (TensorSpec.rounding)
SCALE_DTYPES = ("fp16", "fp32")  # what a dynamic scale / zero-point is stored in (TensorSpec.scale_dtype)


@dataclass(frozen=True)
class TensorSpec:
    """How one of K or V is stored.

    Attributes:
        kind: ``"float"`` (kept in a float dtype), ``"int"`` (affine integer codes, bit-packed),
            ``"fp8"`` (torch float8 with a scale) or ``"nuq"`` (non-uniform codebook, calibrated).
        bits: bits per element of the codes: 16/32 for float, 2/3/4/8 for int, 8 for fp8, 2/3/4 for nuq.
        fmt: float format for ``kind="float"`` (``fp16``, ``bf16``, ``fp32``) or ``fp8`` (``e4m3``, ``e5m2``).
            None for ``int`` / ``nuq`` codes (the default ``"fp16"`` left there becomes None).
        granularity: see the module docstring (``"token"``, the default, for float specs, which have no scales).
        group_size: channels per scale group (token granularity; ``None`` = all of ``D``) or tokens per
            scale group (channel granularity; required).
        symmetric: symmetric codes (no zero-point) instead of asymmetric (scale + minimum); int and nuq only
            (float specs have no codes, FP8 codes are symmetric by construction: both keep ``False``).
        integer_zero: asymmetric integer codes whose zero-point is itself a code (GPTQ-style, vLLM's
            ``int4_per_token_head``): ``x ≈ (code - z) * scale`` with ``scale = max(range / (2**bits - 1),
            1e-6)`` and ``z = round(-min / scale)`` clamped to the codes, so the grid is anchored at 0: its
            ends may fall up to half a step inside the range (every value still within half a step), and a
            range that excludes 0 loses what lies past ``2**bits - 1`` steps from 0 (``z`` clamps; counted as
            clipped). Stored as float16 ``scale`` and ``zero = -z * scale``, the bytes of
            ``symmetric=False``; dynamic ``kind="int"`` only. A reached level may lie half a step past the
            range, so the input bound is lower: ``|x| <= 65504 / (1 + (1 + 2**-10) / (2**bits - 1))`` (61406 at
            4 bits, ``kvbits.quant.affine.integer_zero_bound``).
        rounding: how a scaled value becomes a code: ``"nearest"`` (the default), or ``"trunc"``, toward zero,
            as vLLM's ``int8_per_token_head`` write kernel stores ``clamp(x * (1 / scale))`` into an int8 cache
            (Triton's float-to-int store cast, ``cvt.rzi``): every value loses up to a whole step instead of half
            of one, always toward zero. ``"trunc"`` takes vLLM's float32 scale ``max(absmax / (2**(bits-1) - 1),
            1e-6)`` for the codes and stores it to the nearest float16, capped so the top code decodes within
            65504 (``scale_dtype="fp32"``: as it is);
            dynamic symmetric ``kind="int"`` only.
        scale_dtype: what the dynamic scales (and zero-points) are stored in: ``"fp16"`` (the default, 2 bytes
            each, rounded outward) or ``"fp32"`` (4 bytes, unrounded: ``absmax / c``, ``(max - min) / steps``),
            as vLLM's per-token-head caches (``int8_per_token_head``, ``fp8_per_token_head``) keep them; dynamic
            ``kind="int"`` (not ``integer_zero``) and dynamic ``kind="fp8"`` only. The input bound stays
            float16's (``|x| <= 65504``, ``kvbits.cache.checks``).
        static: scales come from a calibration artifact instead of the data being stored.
        outlier_frac: fraction of each vector kept in float16 in a sparse side store (dense-and-sparse).
        pre_rope: keys only: quantize before RoPE and re-apply it after dequantization.
        rotate: ``None``, or ``"hadamard"``: quantize ``x @ R`` (a fixed random-sign Walsh-Hadamard
            rotation of the head dim, ``kvbits.quant.rotate``) and rotate back after dequantization, so an
            outlier channel is spread over all channels (QuaRot); needs a power-of-two head dim, stores
            no extra bytes. ``"hadamard-vllm"``: the same with vLLM's sign vector (its
            ``int4_per_token_head`` RHT), which on some models changes the error several-fold
            (BENCHMARKS.md §23c).
        centre: quantize ``x - m`` and add ``m`` back after dequantization, ``m`` a calibrated
            per-(head, channel) mean (``kvbits calibrate``; one float16 ``(H_kv, D)`` vector per layer): a
            channel's constant offset (Qwen2's ``k_proj`` bias) then takes no part of a per-token range.
        smooth: ``None``, or an exponent ``alpha`` in ``(0, 1]``: quantize ``x / s`` and multiply by ``s``
            after dequantization, ``s_c = max |x_c - m_c| ** alpha`` calibrated per (head, channel) (``m``:
            the mean with ``centre``, else 0), so outlier channels are scaled down before a per-token range
            is taken (QServe's SmoothAttention, ``alpha`` 0.5; one float16 ``(H_kv, D)`` vector per layer).
            Order: ``(x - m) / s``, then ``rotate``, then the codes.
    """

    kind: str = "float"
    bits: int = 16
    fmt: str | None = "fp16"
    granularity: str = "token"
    group_size: int | None = None
    symmetric: bool = False
    static: bool = False
    outlier_frac: float = 0.0
    pre_rope: bool = False
    rotate: str | None = None
    centre: bool = False
    smooth: float | None = None
    integer_zero: bool = False
    rounding: str = "nearest"
    scale_dtype: str = "fp16"

    def __post_init__(self) -> None:
        self._check_types()
        if self.kind not in KINDS:
            raise ValueError(f"TensorSpec.kind must be one of {KINDS}, got {self.kind!r}")
        allowed = {"float": FLOAT_BITS, "int": INT_BITS, "fp8": (8,), "nuq": NUQ_BITS}[self.kind]
        if self.bits not in allowed:
            raise ValueError(f"TensorSpec(kind={self.kind!r}) needs bits in {allowed}, got {self.bits}")
        if self.kind == "float" and self.fmt not in FLOAT_FORMATS:
            raise ValueError(f"float TensorSpec needs fmt in {FLOAT_FORMATS}, got {self.fmt!r}")
        if self.kind == "float" and {"fp16": 16, "bf16": 16, "fp32": 32}[self.fmt] != self.bits:
            raise ValueError(f"float format {self.fmt} has {16 if self.fmt != 'fp32' else 32} bits, got bits={self.bits}")
        if self.kind == "fp8" and self.fmt not in FP8_FORMATS:
            raise ValueError(f"fp8 TensorSpec needs fmt in {FP8_FORMATS}, got {self.fmt!r}")
        if self.kind == "float" and (self.outlier_frac or self.static or self.pre_rope):
            raise ValueError(  # each would be accepted and then ignored: float K/V are stored as they come
                "a float TensorSpec stores K/V as they are: outlier_frac, static and pre_rope apply to quantized "
                f"specs, got outlier_frac={self.outlier_frac}, static={self.static}, pre_rope={self.pre_rope}"
            )
        if self.kind == "float" and (self.symmetric or self.granularity != "token"):
            raise ValueError(  # each would be accepted and then ignored: a float spec has no scales
                "a float TensorSpec stores K/V as they are: symmetric and granularity apply to quantized specs "
                f"(leave them at False and 'token'), got symmetric={self.symmetric}, granularity={self.granularity!r}"
            )
        if self.kind == "fp8" and self.symmetric:
            raise ValueError(  # it would be accepted and then ignored: FP8 codes are signed, scaled by absmax
                "an fp8 TensorSpec is symmetric by construction (signed codes, one absmax scale, no zero-point): "
                "leave symmetric=False, got symmetric=True"
            )
        if self.kind in ("int", "nuq") and self.fmt not in (None, "fp16"):  # "fp16": the dataclass default
            raise ValueError(
                f"a {self.kind} TensorSpec stores codes, not a float format: fmt must be None, got {self.fmt!r}"
            )
        if self.kind in ("int", "nuq") and self.fmt is not None:
            # the dataclass default, left unset: stored as the presets' None, so a spec that stores what a preset
            # stores equals it (calibration checks, vLLM export and preset names compare specs field by field)
            object.__setattr__(self, "fmt", None)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.group_size is not None and (
            self.kind not in ("int", "nuq") or self.granularity in ("head", "tensor")
        ):
            # group_size would be accepted and then ignored: fp8 scales are per (token, head) row or
            # per tensor, head/tensor scales cover the whole block, float specs have no scales
            raise ValueError(
                "group_size applies to int/nuq specs with granularity 'token' or 'channel'; a "
                f"kind={self.kind!r} granularity={self.granularity!r} spec needs group_size=None, "
                f"got {self.group_size}"
            )
        if self.granularity == "token" and self.group_size is not None and self.group_size < 2:
            raise ValueError(
                "per-token groups reduce over channels; group_size must be >= 2 or None (all of D): a "
                f"group of one channel is lossless and quantizes nothing, got {self.group_size}"
            )
        if self.granularity == "channel" and self.kind != "float":
            if self.static and self.group_size is not None:
                raise ValueError(
                    "a static per-channel spec uses one calibrated scale per (head, channel) for all tokens; "
                    f"group_size must be None, got {self.group_size}"
                )
            if not self.static and (self.group_size is None or self.group_size < 2):
                raise ValueError(
                    "per-channel quantization reduces over a group of tokens; group_size must be >= 2 "
                    f"(a group of one token is lossless and quantizes nothing), got {self.group_size}"
                )
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        if self.group_size == 2 and self.kind in ("int", "nuq") and not self.symmetric and not self.integer_zero:
            raise ValueError(
                "an asymmetric group of 2 is lossless and quantizes nothing (its scale and zero-point store the "
                "group's two values exactly, at more bits than float16); group_size must be >= 3 here, or the "
                f"spec symmetric, got group_size={self.group_size}"
            )
        if not 0.0 <= self.outlier_frac < 0.5:
            raise ValueError(f"outlier_frac must be in [0, 0.5), got {self.outlier_frac}")
        if self.kind == "fp8" and self.granularity not in ("token", "head", "tensor"):
            raise ValueError(f"fp8 supports granularity 'token', 'head' or 'tensor', got {self.granularity!r}")
        if self.kind == "fp8" and self.granularity in ("head", "tensor") and not self.static:
            # there is no dynamic per-tensor / per-head FP8 path: the scale would silently be the fixed 1.0
            raise ValueError(
                f"fp8 granularity {self.granularity!r} uses fixed scales (1.0 until calibrated, as vLLM's "
                "kv_cache_dtype=fp8): it needs static=True; for scales computed from the data use "
                "granularity='token' (one dynamic scale per token and head)"
            )
        if self.rotate is not None and self.rotate not in ROTATIONS:
            raise ValueError(f"rotate must be None or one of {ROTATIONS}, got {self.rotate!r}")
        if self.rotate is not None and self.kind == "float":
            raise ValueError("rotate applies to quantized specs; a float spec stores K/V exactly, rotated or not")
        if (self.centre or self.smooth is not None) and self.kind != "int":
            raise ValueError(
                f"centre / smooth apply to integer specs (kind='int'), got kind={self.kind!r}: a float spec "
                "stores K/V exactly, and FP8 / NUQ codes are not fitted to the transformed channels yet"
            )
        if self.smooth is not None and not 0.0 < self.smooth <= 1.0:
            raise ValueError(f"smooth is an exponent alpha in (0, 1] (QServe: 0.5) or None, got {self.smooth}")
        if self.integer_zero and (self.kind != "int" or self.symmetric or self.static):
            raise ValueError(
                "integer_zero applies to dynamic asymmetric integer specs (kind='int', symmetric=False, "
                f"static=False: the zero-point code is chosen from each group's range), got kind={self.kind!r}, "
                f"symmetric={self.symmetric}, static={self.static}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "trunc" and (self.kind != "int" or not self.symmetric or self.static):
            raise ValueError(
                "rounding='trunc' applies to dynamic symmetric integer specs (kind='int', symmetric=True, "
                f"static=False: vLLM's int8_per_token_head), got kind={self.kind!r}, symmetric={self.symmetric}, "
                f"static={self.static}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.scale_dtype == "fp32" and (self.kind not in ("int", "fp8") or self.static or self.integer_zero):
            raise ValueError(
                "scale_dtype='fp32' applies to dynamic integer (not integer_zero) and dynamic FP8 specs, whose "
                f"scales are computed from the data; got kind={self.kind!r}, static={self.static}, "
                f"integer_zero={self.integer_zero} (static scales live in the calibration artifact)"
            )
        if self.kind == "fp8" and self.static and self.granularity == "token":
            raise ValueError(
                "a static FP8 spec has one calibrated scale per tensor ('tensor') or per KV head ('head'); "
                "granularity 'token' computes a scale per (token, head) from the data: use static=False"
            )

    def _check_types(self) -> None:
        """``TypeError`` for fields of the wrong type (a scheme JSON may carry ``2.0`` or ``"false"``)."""
        for name in ("kind", "granularity", "rounding", "scale_dtype"):
            _require(self, name, str, "a str")
        for name in ("fmt", "rotate"):
            if getattr(self, name) is not None:
                _require(self, name, str, "a str or None")
        _require_int(self, "bits")
        if self.group_size is not None:
            _require_int(self, "group_size", "an int or None")
        for name in ("symmetric", "static", "pre_rope", "centre", "integer_zero"):
            _require(self, name, bool, "a bool (true / false)")
        if self.smooth is not None and (isinstance(self.smooth, bool) or not isinstance(self.smooth, (int, float))):
            raise TypeError(f"TensorSpec.smooth must be a number or None, got {self.smooth!r}")
        if isinstance(self.outlier_frac, bool) or not isinstance(self.outlier_frac, (int, float)):
            raise TypeError(f"TensorSpec.outlier_frac must be a number, got {self.outlier_frac!r}")

    @property
    def is_quantized(self) -> bool:
        """True unless the tensor is kept in a float dtype."""
        return self.kind != "float"

    @property
    def calibrated(self) -> bool:
        """True when parameters come from ``kvbits calibrate``: static integer/NUQ scales, NUQ codebooks,
        the channel means of ``centre`` and the factors of ``smooth``."""
        return self.kind == "nuq" or (self.static and self.kind == "int") or self.has_channel_transform

    @property
    def has_channel_transform(self) -> bool:
        """True with ``centre`` or ``smooth``: calibrated per-(head, channel) vectors applied before coding."""
        return self.centre or self.smooth is not None

    @property
    def calibratable(self) -> bool:
        """True when ``kvbits calibrate`` fits parameters for this spec: the ``calibrated`` ones, and an
        FP8 per-tensor or per-head scale (static FP8), which runs at 1.0 without an artifact (vLLM's
        uncalibrated default) and at ``absmax / fp8_max`` of the calibration data with one."""
        return self.calibrated or (self.kind == "fp8" and self.static)

    @property
    def scale_bytes(self) -> int:
        """Bytes of one dynamic scale or zero-point: 2 (float16), 4 with ``scale_dtype="fp32"``."""
        return 4 if self.scale_dtype == "fp32" else 2

    @property
    def has_zero_point(self) -> bool:
        """Asymmetric integer and NUQ codes store a zero-point (the group minimum, or ``-z * scale`` with
        ``integer_zero``) beside each scale."""
        return self.kind in ("int", "nuq") and not self.symmetric

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON types; ``rotate``, ``centre``, ``smooth``, ``integer_zero``, ``rounding`` and
        ``scale_dtype`` only when set, so specs without them keep the JSON (and the run and artifact hashes) they had before the fields existed."""
        d = dataclasses.asdict(self)
        for name, unset in (
            ("rotate", None), ("centre", False), ("smooth", None), ("integer_zero", False), ("rounding", "nearest"),
            ("scale_dtype", "fp16"),
        ):  # fmt: skip
            if d[name] == unset and type(d[name]) is type(unset):
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        if not isinstance(d, dict):
            raise TypeError(f"a TensorSpec (scheme 'key' / 'value') must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TensorSpec fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        if d.get("kind") in ("int", "nuq") and "fmt" not in d:  # codes have no float format: as the presets say it
            d = {**d, "fmt": None}
        return cls(**d)


def _require(obj: object, name: str, typ: type, what: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, typ):
        raise TypeError(f"{type(obj).__name__}.{name} must be {what}, got {value!r}")


def _require_int(obj: object, name: str, what: str = "an int") -> None:
    # bool is an int subclass: True would count as 1 bit / 1 token
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(obj).__name__}.{name} must be {what}, got {value!r}")


FP16 = TensorSpec()


@dataclass(frozen=True)
class KVScheme:
    """A whole KV-cache policy.

    Attributes:
        name: preset or user name.
        key, value: how K and V are stored.
        sinks: the first ``sinks`` tokens of each sequence are kept in full precision forever (its first cache
            slots: a left-padded row's sinks hold pads, which the caches warn about once).
        residual: at least this many most recent tokens stay in full precision.
        block: tokens are quantized ``block`` at a time, when the full-precision buffer reaches
            ``residual + block`` (so it always holds between ``residual`` and ``residual + block - 1``
            tokens once the sequence is long enough). Each block is quantized once and appended;
            history is never re-quantized.
        description, reference: for people (tables, README).
        layers: per-layer mixed precision (KVTuner-style): ``((layer_idx, scheme), ...)``, each layer
            listed stored by its own scheme (key, value, sinks, residual, block), every other layer by
            this one; ``for_layer(i)`` resolves it. The overrides carry no overrides themselves; calibrated
            sides (static scales, NUQ codebooks) are fitted per layer by its own scheme.
    """

    name: str
    key: TensorSpec = FP16
    value: TensorSpec = FP16
    sinks: int = 0
    residual: int = 0
    block: int = 1
    description: str = ""
    reference: str = ""
    version: int = field(default=SCHEME_FORMAT_VERSION)
    layers: tuple[tuple[int, KVScheme], ...] = ()

    def __post_init__(self) -> None:
        self._check_layers()
        for name in ("name", "description", "reference"):
            _require(self, name, str, "a str")
        for name in ("sinks", "residual", "block", "version"):
            _require_int(self, name)
        for name in ("key", "value"):
            _require(self, name, TensorSpec, "a TensorSpec")
        if self.sinks < 0 or self.residual < 0 or self.block < 1:
            raise ValueError(
                f"need sinks >= 0, residual >= 0, block >= 1; got sinks={self.sinks}, "
                f"residual={self.residual}, block={self.block}"
            )
        for which, spec in (("key", self.key), ("value", self.value)):
            if spec.kind != "float" and spec.granularity == "channel" and spec.group_size is not None \
                    and self.block % spec.group_size:
                raise ValueError(
                    f"{which}: per-channel groups of {spec.group_size} tokens must divide the flush block "
                    f"({self.block} tokens)"
                )
        if self.value.pre_rope:
            raise ValueError("pre_rope applies to keys only")
        if self.version != SCHEME_FORMAT_VERSION:
            raise ValueError(f"scheme format version {self.version} is not supported (this kvbits reads {SCHEME_FORMAT_VERSION})")

    def _check_layers(self) -> None:
        """``TypeError`` / ``ValueError`` for malformed per-layer overrides (``layers``)."""
        if not isinstance(self.layers, tuple):
            raise TypeError(f"KVScheme.layers must be a tuple of (layer index, KVScheme) pairs, got {self.layers!r}")
        seen: set[int] = set()
        for item in self.layers:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"KVScheme.layers entries must be (layer index, KVScheme) pairs, got {item!r}")
            idx, sub = item
            if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
                raise ValueError(f"KVScheme.layers: layer indices must be ints >= 0, got {idx!r}")
            if idx in seen:
                raise ValueError(f"KVScheme.layers: layer {idx} is listed twice")
            seen.add(idx)
            if not isinstance(sub, KVScheme):
                raise TypeError(f"KVScheme.layers: layer {idx} needs a KVScheme, got {type(sub).__name__}")
            if sub.layers:
                raise ValueError(f"KVScheme.layers: layer {idx}'s scheme {sub.name!r} has overrides of its own")

    @property
    def is_mixed(self) -> bool:
        """True when some layers are stored by another scheme (``layers``)."""
        return bool(self.layers)

    def for_layer(self, layer_idx: int) -> KVScheme:
        """The scheme layer ``layer_idx`` is stored by: its override, else this scheme without overrides."""
        for idx, sub in self.layers:
            if idx == layer_idx:
                return sub
        return dataclasses.replace(self, layers=()) if self.layers else self

    def check_layer_count(self, n_layers: int, what: str = "the model's") -> None:
        """``ValueError`` when an override names a layer ``>= n_layers`` (``what`` says whose count)."""
        beyond = [i for i, _ in self.layers if i >= n_layers]
        if len(beyond) > 8:  # a range such as 0-60000 on a 2-layer model: not 59,998 numbers in a message
            listed = f"[{beyond[0]}, {beyond[1]}, {beyond[2]}, ..., {beyond[-1]}] ({len(beyond)} layers)"
        else:
            listed = str(beyond)
        if beyond:
            raise ValueError(
                f"mixed scheme {self.name!r} overrides layers {listed}, beyond {what} {n_layers} layers"
            )

    def layer_schemes(self) -> list[KVScheme]:
        """This scheme (without overrides) and every override, in order: what some layer may be stored by."""
        return [dataclasses.replace(self, layers=()), *(sub for _, sub in self.layers)]

    @property
    def is_identity(self) -> bool:
        """True when nothing is quantized (float storage for both K and V) in any layer."""
        if self.layers:
            return all(s.is_identity for s in self.layer_schemes())
        return not (self.key.is_quantized or self.value.is_quantized)

    def needs_calibration(self) -> list[str]:
        """The sides (``"key"``, ``"value"``) whose parameters come from ``kvbits calibrate`` (static
        integer scales, NUQ codebooks: ``TensorSpec.calibrated``) rather than from the data stored; for a
        mixed scheme, those of any layer."""
        return [side for side in ("key", "value") if any(getattr(s, side).calibrated for s in self._all())]

    def calibratable(self) -> list[str]:
        """The sides ``kvbits calibrate`` fits parameters for (``TensorSpec.calibratable``): those of
        ``needs_calibration`` and static FP8 sides, whose per-tensor scale is optional (1.0 without); for a
        mixed scheme, those of any layer."""
        return [side for side in ("key", "value") if any(getattr(s, side).calibratable for s in self._all())]

    def _all(self) -> list[KVScheme]:
        return self.layer_schemes() if self.layers else [self]

    def to_dict(self) -> dict[str, Any]:
        """JSON types; ``layers`` (as ``{"<layer>": scheme dict}``) only when set, so schemes without
        overrides keep the JSON (and run and artifact hashes) they had before the field existed."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layers"}
        d["key"] = self.key.to_dict()
        d["value"] = self.value.to_dict()
        if self.layers:
            d["layers"] = {str(idx): sub.to_dict() for idx, sub in self.layers}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVScheme:
        if not isinstance(d, dict):
            raise TypeError(
                f"a KVScheme must be a JSON object with 'name', 'key', 'value', ...; got {type(d).__name__}"
            )
        d = dict(d)
        version = d.get("version", SCHEME_FORMAT_VERSION)
        if version != SCHEME_FORMAT_VERSION:
            raise ValueError(f"scheme format version {version!r} is not supported (expected {SCHEME_FORMAT_VERSION!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown KVScheme fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        d["key"] = TensorSpec.from_dict(d["key"]) if "key" in d else FP16
        d["value"] = TensorSpec.from_dict(d["value"]) if "value" in d else FP16
        if "layers" in d:
            layers = d["layers"]
            if not isinstance(layers, dict):
                raise TypeError(f"a scheme's 'layers' must be an object {{\"<layer>\": scheme}}, got {layers!r}")
            # int() also reads "1_0" (layer 10), "+1", " 1" and non-ASCII digits: a typo stored another layer
            odd = [k for k in layers if not (isinstance(k, str) and k.isascii() and k.isdigit())]
            if odd:
                raise ValueError(
                    f"scheme 'layers': keys are layer indices written in ASCII digits (e.g. \"0\", \"23\"), got {odd!r}"
                )
            d["layers"] = tuple(sorted(((int(k), cls.from_dict(v)) for k, v in layers.items()), key=lambda t: t[0]))
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> KVScheme:
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> KVScheme:
        """A copy with some fields changed (the dataclass is frozen)."""
        return dataclasses.replace(self, **changes)
