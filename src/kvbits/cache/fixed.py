"""Calibrated parameters of one cache side: checked once when installed, named when missing, bounding the inputs.

A side's *fixed* parameters come from ``kvbits calibrate`` rather than from the data stored: static scales and
zero-points (``TensorSpec.static``), a NUQ codebook (``kind="nuq"``), channel means and smoothing factors
(``centre`` / ``smooth``). ``QuantizedKVLayer`` and ``StaticQuantizedLayer`` install them alike:

- ``checked_params``: the given tensors, validated (finite; scales ``>= 0``, FP8 ``> 0``; held by float16 when
  stored in it: no finite value overflowing, no nonzero scale or factor rounding to 0; static scales whose levels
  decode the largest K/V (``+-65504``) within float16, ``check_static_decode``, refused otherwise rather than
  clamped; codebooks sorted in ``[-1, 1]``; factors ``> 0``; shapes), cloned in the dtype they are stored in, under the names ``quantize`` takes
  (``static_scale``, ``static_zero``, ``codebook``, ``channel_mean``, ``channel_factor``). One host sync: the per-step
  path never re-checks them;
- ``check_installed_decode``: ``check_static_decode`` on what a side quantizes with once parameters given apart
  (a scale, its zero-points or a codebook installed alone) join those installed before: ``checked_params`` sees only
  the ones given together;
- ``check_param_shapes``: that installed parameters fit the side's ``(H_kv, D)`` and flush block, once both are known
  (at install with a config, else at the first update): a misfit is refused there, naming the layer, not at the first
  flush, which comes ``residual + block`` tokens into a request, part-way through an update;
- ``missing_params``: what a spec still lacks before it can quantize, in words;
- ``channel_bound``: the input bound of a side whose codes cover ``(x - mean) / factor``;
- ``install_artifact``: a calibration artifact's parameters of one layer, through its ``set_static_qparams``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvbits.quant.fp8 import static_fp8_scale
from kvbits.quant.nuq import check_codebook
from kvbits.quant.tensor import (
    SCALE_UNDERFLOW,
    check_finite,
    check_static_decode,
    check_static_scale,
    static_param_shape,
    to_float16,
)
from kvbits.schemes.spec import TensorSpec

__all__ = [
    "PARAM_NAMES",
    "calibrated_length",
    "channel_bound",
    "check_installed_decode",
    "check_param_shapes",
    "checked_params",
    "install_artifact",
    "missing_params",
]

_WORDS = {"channel_mean": "channel mean", "channel_factor": "smoothing factor"}  # in errors
PARAM_NAMES = ("static_scale", "static_zero", "codebook", "channel_mean", "channel_factor")  # quantize's arguments


def checked_params(
    spec: TensorSpec,
    what: str,
    heads: int | None,
    device: torch.device,
    *,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    factor: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The given parameters of ``spec``'s side, checked and cloned onto ``device`` (see the module docstring).

    ``scale``/``zero``: static specs, broadcastable to ``quantize``'s grouped view (static per-channel: ``(H_kv, D)``),
    stored float16 (FP8: float32, ``()`` per tensor or ``(1, H_kv, 1, 1)`` per head); ``codebook``: NUQ, float16
    ``(2**bits,)``; ``mean`` / ``factor``: ``centre`` / ``smooth`` specs, ``(H_kv, D)`` or ``(1, H_kv, 1, D)``, stored
    float16 ``(H_kv, D)``. ``heads``: ``H_kv`` as stored (``None``: not known yet, shapes checked later by use).
    ``what`` names the side in errors. ``ValueError`` / ``TypeError`` saying what was expected.
    """
    if scale is not None and not spec.static:  # FP8 per-tensor specs are static (TensorSpec)
        raise ValueError(f"{what}: spec is not static; static scales would be ignored")
    if zero is not None and not (spec.static and spec.has_zero_point):
        raise ValueError(f"{what}: zero-points need a static asymmetric int/NUQ spec; they would be ignored")
    if codebook is not None and spec.kind != "nuq":
        raise ValueError(f"{what}: a codebook needs kind='nuq', got {spec.kind!r}")
    if mean is not None and not spec.centre:
        raise ValueError(f"{what}: channel means need a centre spec; they would be ignored")
    if factor is not None and spec.smooth is None:
        raise ValueError(f"{what}: smoothing factors need a smooth spec; they would be ignored")
    named = (("scale", scale), ("zero", zero), ("codebook", codebook), ("mean", mean), ("factor", factor))
    for name, t in named:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    out: dict[str, torch.Tensor] = {}
    # cloned: the layer owns (and reports) exactly these bytes, never a view into an artifact; checked in the stored dtype
    if codebook is not None:  # checked once here: the per-step path does not re-check it (no host sync);
        # first: the scales' decode check probes it
        out["codebook"] = check_codebook(codebook.detach().to(device).clone(), spec.bits)
    # cast by to_float16: a float32 value float16 can not hold is named as given (1e6, not the inf it became), and a
    # nonzero scale that rounds to 0 (1e-9) is refused rather than collapsing its channel silently
    if zero is not None:
        zero = to_float16(zero.detach().to(device), f"{what} static zero-point").clone()
        check_finite(zero, f"{what} static zero-point")
        out["static_zero"] = zero
    if scale is not None:
        if spec.kind == "fp8":  # () per tensor, (1, H_kv, 1, 1) per head
            scale = scale.detach().to(device, torch.float32).clone()
            scale = static_fp8_scale(scale, spec.granularity, heads, f"{what} static scale")
        else:
            scale = to_float16(scale.detach().to(device), f"{what} static scale", nonzero=SCALE_UNDERFLOW).clone()
        check_static_scale(scale, f"{what} static scale", positive=spec.kind == "fp8")
        if zero is not None or not spec.has_zero_point:  # an asymmetric scale alone: its zero-points come later
            check_static_decode(spec, scale, zero, f"{what} static scale", out.get("codebook"))
        out["static_scale"] = scale
    for name, t in (("channel_mean", mean), ("channel_factor", factor)):
        if t is None:
            continue
        D = t.shape[-1] if t.dim() else 0
        if t.dim() not in (2, 4) or (heads is not None and t.numel() != heads * D):
            raise ValueError(f"{what}: {name} must be (H_kv, D) = ({heads}, D), got {tuple(t.shape)}")
        nonzero = "a smoothing factor divides: it must be > 0" if name == "channel_factor" else None
        t = to_float16(t.detach().to(device), f"{what} {_WORDS[name]}", nonzero=nonzero)
        t = t.reshape(-1, D).clone()
        if name == "channel_mean":
            check_finite(t, f"{what} {_WORDS[name]}")
        else:
            check_static_scale(t, f"{what} {_WORDS[name]}", positive=True)
        out[name] = t
    return out


def check_installed_decode(
    spec: TensorSpec,
    what: str,
    params: Mapping[str, torch.Tensor],
    installed: Mapping[str, torch.Tensor | None],
    *,
    scale_drops_zero: bool,
) -> None:
    """``check_static_decode`` (``ValueError`` naming ``what``) on the static scale, zero-points and codebook ``spec``'s
    side quantizes with once ``params`` (``checked_params``' output) replace ``installed`` (``PARAM_NAMES`` keys;
    absent or ``None``: none): a scale, its zero-points or a codebook installed alone pair with the installed others,
    which ``checked_params`` never saw (a scale of 4400 installed over zero-points of 0 decoded a key of 65504 as
    66000, inf). ``scale_drops_zero``: a scale given alone drops the installed zero-points (``QuantizedKVLayer``),
    else keeps them (``StaticQuantizedLayer``). Nothing to check until both a scale and (asymmetric) its zero-points
    are there, nor when ``checked_params`` checked the pair given together. One host sync when it checks."""
    if spec.kind not in ("int", "nuq") or not spec.static:  # FP8: a scale alone, checked by checked_params
        return
    if "static_scale" in params and ("static_zero" in params or not spec.has_zero_point):
        return  # checked together (a NUQ scale without its codebook against the entries +-1, the farthest)
    if not any(name in params for name in ("static_scale", "static_zero", "codebook")):
        return
    scale = params.get("static_scale", installed.get("static_scale"))
    if "static_scale" in params and scale_drops_zero:
        zero = params.get("static_zero")
    else:
        zero = params.get("static_zero", installed.get("static_zero"))
    if scale is None or (spec.has_zero_point and zero is None):
        return
    codebook = params.get("codebook", installed.get("codebook"))
    check_static_decode(spec, scale, zero, f"{what} static scale", codebook)


def check_param_shapes(
    spec: TensorSpec,
    what: str,
    params: Mapping[str, torch.Tensor | None],
    heads: int | None,
    head_dim: int | None,
    block: int,
) -> None:
    """``ValueError`` (naming ``what``) when the installed ``params`` (``PARAM_NAMES`` keys; absent or ``None``: none)
    of ``spec``'s side do not fit a side of ``heads`` KV heads of dim ``head_dim`` quantizing ``block`` tokens at a
    time: the shapes a flush would refuse. A no-op while ``heads`` or ``head_dim`` is unknown (``None``). Shapes only
    (a ``meta`` block): no device work, no sync."""
    if heads is None or head_dim is None:
        return
    for name in ("channel_mean", "channel_factor"):
        t = params.get(name)
        if t is not None and (t.numel() != heads * head_dim or t.shape[-1] != head_dim):
            raise ValueError(
                f"{what}: {name} must be (H_kv, D) = ({heads}, {head_dim}) for this layer, got {tuple(t.shape)}"
            )
    if spec.kind == "fp8" and spec.static:  # a per-head scale of another head count: refused here, named
        t = params.get("static_scale")
        if t is not None:
            static_fp8_scale(t, spec.granularity, heads, f"{what} static FP8 scale")
        return
    if spec.kind not in ("int", "nuq") or not spec.static:
        return
    x = torch.empty((1, heads, block, head_dim), device="meta")
    for name in ("static_scale", "static_zero"):
        t = params.get(name)
        if t is not None:
            try:
                static_param_shape(t, name, x, spec)
            except ValueError as e:
                raise ValueError(f"{what}: {e} ({heads} KV heads of dim {head_dim}, {block}-token blocks)") from None


def missing_params(spec: TensorSpec, side: str, have: Mapping[str, torch.Tensor | None]) -> list[str]:
    """What ``spec``'s side still needs before it can quantize, given the installed ``have`` (``PARAM_NAMES`` keys;
    absent or ``None``: not installed), in words (``"key static scales"``, ...). Static FP8 needs nothing (1.0)."""
    missing = []
    if spec.kind in ("int", "nuq") and spec.static and have.get("static_scale") is None:
        missing.append(f"{side} static scales")
    if spec.kind in ("int", "nuq") and spec.static and spec.has_zero_point and have.get("static_zero") is None:
        missing.append(f"{side} static zero-points")
    if spec.kind == "nuq" and have.get("codebook") is None:
        missing.append(f"{side} NUQ codebook")
    if spec.centre and have.get("channel_mean") is None:
        missing.append(f"{side} channel means")
    if spec.smooth is not None and have.get("channel_factor") is None:
        missing.append(f"{side} smoothing factors")
    return missing


def channel_bound(
    bound: float, why: str, mean: torch.Tensor | None, factor: torch.Tensor | None
) -> tuple[float, str]:
    """A side's input bound lowered for installed channel vectors: ``|(x - mean) / factor|`` stays within ``bound``
    when ``|x| <= bound * min(factor) - max |mean|`` (one host sync when there are vectors)."""
    if mean is None and factor is None:
        return bound, why
    top = 0.0 if mean is None else float(mean.float().abs().max())
    low = 1.0 if factor is None else float(factor.float().min())
    return max(0.0, bound * low - top), (
        f"{why}, and it covers (x - mean) / factor (largest |mean| {top:.4g}, smallest factor {low:.4g})"
    )


def check_calibrated_heads(layer: Any, heads: int, head_dim: int) -> None:
    """At a layer's first update, where its K/V give ``heads`` (``H_kv``) and ``head_dim``: ``ValueError`` when the
    artifact installed with ``install_artifact(..., check_heads=True)`` was calibrated on another shape. A cache
    without a config can not compare them before: a 1-head artifact's scales broadcast over any number of heads."""
    shape = getattr(layer, "calibrated_shape", None)
    if shape is None or shape[:2] == (heads, head_dim):
        return
    H, D, where = shape
    raise ValueError(
        f"calibration{where} was made for {H} KV heads of dim {D}; layer {layer.layer_idx} of this model has {heads} "
        f"KV heads of dim {head_dim}: re-run kvbits calibrate for this model, or give the cache config= to catch "
        "this before the forward pass"
    )


def calibrated_length(artifact: Any) -> int | None:
    """The longest context a calibration artifact saw (its ``max_calibrated_length``), ``None`` when there is no
    artifact or it does not say: what both caches' ``max_calibrated_length`` report."""
    longest = getattr(artifact, "max_calibrated_length", None)
    return None if longest is None else int(longest)


def install_artifact(layer: Any, artifact: Any, *, check_heads: bool = False) -> None:
    """Install ``artifact``'s parameters for ``layer`` (its ``layer_idx``): static scales and zero-points
    (``CalibrationArtifact.static_qparams``), NUQ codebooks and channel vectors, side by side, through
    ``layer.set_static_qparams`` (``QuantizedKVLayer`` or ``StaticQuantizedLayer``), for the sides the layer's own
    ``scheme`` calibrates (``TensorSpec.calibratable``; ``check_scheme`` has matched their specs): an artifact also
    calibrated for a side the layer stores with dynamic scales leaves that side as it is; sides it has none for too.

    ``ValueError`` when the artifact has no layer ``layer_idx``: a cache that learns its layers lazily (no config, no
    ``num_layers``) serving a model of more layers than the calibrated one. ``check_heads`` (a cache without a config,
    which could not check the artifact's model shape): the layer keeps the artifact's ``(H_kv, D)`` and its first
    update compares them with its K/V's (``check_calibrated_heads``)."""
    where = "" if getattr(artifact, "path", None) is None else f" in {artifact.path}"
    if not 0 <= layer.layer_idx < artifact.num_layers:
        raise ValueError(
            f"calibration{where} has {artifact.num_layers} layers; this model has at least {layer.layer_idx + 1} "
            f"(the cache is creating layer {layer.layer_idx}); re-run kvbits calibrate for this model, or give the "
            "cache config= to catch this before the forward pass"
        )
    kv_layers = getattr(artifact, "kv_layers", None)
    if kv_layers is not None and layer.layer_idx not in kv_layers:
        raise ValueError(
            f"calibration{where} holds the K/V parameters of layers {kv_layers} (a hybrid model's attention layers); "
            f"the cache quantizes layer {layer.layer_idx} too: re-run kvbits calibrate for this model, or give the "
            "cache config= to catch this before the forward pass"
        )
    if check_heads:
        layer.calibrated_shape = (artifact.num_kv_heads, artifact.head_dim, where)
    for side in ("key", "value"):
        if not getattr(layer.scheme, side).calibratable:
            continue
        qp = artifact.static_qparams(layer.layer_idx, side)
        codebook = artifact.codebook(layer.layer_idx, side)
        mean, factor = artifact.channel_transform(layer.layer_idx, side)
        if any(t is not None for t in (qp, codebook, mean, factor)):
            scale, zero = qp if qp is not None else (None, None)
            layer.set_static_qparams(side, scale, zero, codebook=codebook, mean=mean, factor=factor)
