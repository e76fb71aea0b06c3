"""The calibration of a mixed per-layer scheme composed from calibrations of the schemes its layers use.

A mixed scheme's artifact holds layer ``i``'s tensors by ``scheme.for_layer(i)`` (``artifact.py``). Each
layer's fit depends on that layer's samples and its own scheme only, so the artifact of a mix such as
``kvquant-4,0=fp16,1=kvquant-2`` can be put together from ``kvquant-4``'s and ``kvquant-2``'s artifacts of
the same model: ``kvbits tune`` does so for every mix it measures, without calibrating each one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from kvbits.calibrate.artifact import _MODEL_FIELDS, SIDES, CalibrationArtifact, load_calibration, now_utc
from kvbits.schemes.spec import KVScheme

__all__ = ["compose_artifact"]


def _describe(art: CalibrationArtifact) -> str:
    return f"{art.scheme.name!r} ({art.path or 'in memory'})"


def _fit_rank(art: CalibrationArtifact, layer: int, scheme: KVScheme) -> int | None:
    """How well ``art``'s layer ``layer`` serves ``scheme`` (a flat scheme): None when some side ``scheme``
    calibrates is stored otherwise there (``check_scheme``'s test), 0 when the layer was calibrated for
    ``scheme`` itself, 1 for the same scheme under another name, 2 for equal calibrated sides only (other
    sinks, residual or dynamic sides: the fit may differ). None too when the layer was fitted without more sinks
    than ``scheme`` keeps (``check_scheme`` refuses serving it: those tokens would clip)."""
    mine = art.scheme.for_layer(layer)
    if art.fitted_sinks(layer) > scheme.sinks:
        return None
    for side in SIDES:
        theirs = getattr(scheme, side)
        if theirs.calibratable and getattr(mine, side) != theirs:
            return None
    if mine == scheme:
        return 0
    return 1 if mine.replace(name=scheme.name, description=scheme.description) == scheme else 2


def compose_artifact(
    scheme: KVScheme | str,
    artifacts: Iterable[CalibrationArtifact | str | os.PathLike[str]]
    | Mapping[str, CalibrationArtifact | str | os.PathLike[str]],
) -> CalibrationArtifact:
    """The artifact of ``scheme`` (usually mixed per layer) built from ``artifacts`` of the same model.

    Layer ``i``'s tensors (and statistics) are those of the artifact whose layer ``i`` was calibrated with
    the same calibrated sides as ``scheme.for_layer(i)`` (``CalibrationArtifact.check_scheme``'s test), of those
    sides only (a source that also calibrated a side the layer stores with dynamic scales leaves it out); an
    artifact calibrated for that very scheme is preferred to one that only shares its calibrated sides.
    Layers with nothing to calibrate take nothing, nor do a hybrid model's convolution / linear-attention layers
    (the sources hold the same ``kv_layers``, the attention layers, and so does the result).
    ``meta["composed"]`` records the source of each layer.

    Args:
        scheme: the scheme (object, name or compact mix string) the result serves.
        artifacts: ``CalibrationArtifact`` objects or ``kvbits calibrate`` folders (a mapping: its values),
            typically one per uniform scheme the layers use.

    Raises:
        ValueError: no artifacts; artifacts of different models (fingerprint or shape) or holding different
            layers (``kv_layers``); a scheme with
            nothing to calibrate or overrides beyond the model's layers; a layer whose scheme has
            calibrated sides and no given artifact fits it, or two that fit it equally well and differ.
    """
    from kvbits.schemes.presets import get_scheme

    scheme = get_scheme(scheme)
    items = list(artifacts.values()) if isinstance(artifacts, Mapping) else list(artifacts)
    arts = [load_calibration(a) if isinstance(a, (str, os.PathLike)) else a for a in items]
    if not arts:
        raise ValueError(
            f"compose the calibration of scheme {scheme.name!r} from at least one artifact, got none"
        )
    for a in arts:
        if not isinstance(a, CalibrationArtifact):
            raise TypeError(
                f"artifacts must be CalibrationArtifact objects or folders, got {type(a).__name__}"
            )
    if not scheme.calibratable():
        raise ValueError(f"scheme {scheme.name!r} has nothing to calibrate: it takes no calibration")
    first = arts[0]
    model = first.meta["model"]
    for a in arts[1:]:
        other = a.meta["model"]
        diff = [
            f"{k}: {model.get(k)} vs {other.get(k)}"
            for k in ("fingerprint", *_MODEL_FIELDS)
            if model.get(k) != other.get(k)
        ]
        if diff:
            raise ValueError(
                f"calibrations {_describe(first)} and {_describe(a)} were made for different models "
                f"({'; '.join(diff)}); compose calibrations of one model"
            )
    n_layers = first.num_layers
    kv_layers = first.kv_layers  # every layer, or a hybrid model's attention layers: the only ones holding K/V
    other = next((a for a in arts if a.kv_layers != kv_layers), None)
    if other is not None:
        raise ValueError(
            f"calibrations {_describe(first)} and {_describe(other)} hold the K/V parameters of different layers "
            f"({kv_layers} vs {other.kv_layers} of {n_layers}); compose calibrations of one model made by one "
            "kvbits version (re-run kvbits calibrate for the older one)"
        )
    scheme.check_layer_count(n_layers, "the calibrated model's")
    tensors: dict[str, Any] = {}
    stats: list[dict[str, Any]] = []  # one row per layer in kv_layers, as the sources hold them
    layers: list[dict[str, Any] | None] = []
    fitted_sinks: list[int] = []  # per layer in kv_layers: the first tokens its parameters were fitted without
    used: list[CalibrationArtifact] = []
    for i in range(n_layers):
        sub = scheme.for_layer(i)
        if i not in kv_layers:  # a hybrid model's convolution / linear-attention layer: no K/V, nothing to take
            layers.append(None)
            continue
        if not sub.calibratable():
            stats.append({})
            layers.append(None)
            fitted_sinks.append(0)  # nothing fitted
            continue
        ranked = [(r, a) for a in arts if (r := _fit_rank(a, i, sub)) is not None]
        if not ranked:
            raise ValueError(
                f"layer {i} of scheme {scheme.name!r} is stored by {sub.name!r}, whose "
                f"{' and '.join(sub.calibratable())} need calibrated parameters, and none of the given "
                f"calibrations ({', '.join(_describe(a) for a in arts)}) was made for it; create one with "
                f"`kvbits calibrate --scheme {sub.name} --out DIR`"
            )
        best = min(r for r, _ in ranked)
        fits = [a for r, a in ranked if r == best]
        # only the sides layer i's scheme calibrates: a source's other sides (rank 2) are stored otherwise here
        sides = tuple(f"{side}_" for side in sub.calibratable())
        prefixes = tuple(f"layers.{i}.{side}" for side in sides)
        mine = {k: v for k, v in fits[0].tensors.items() if k.startswith(prefixes)}
        for a in fits[1:]:
            theirs = {k: v for k, v in a.tensors.items() if k.startswith(prefixes)}
            if theirs.keys() != mine.keys() or any(not bool((theirs[k] == v).all()) for k, v in mine.items()):
                raise ValueError(
                    f"layer {i} ({sub.name!r}) of scheme {scheme.name!r}: calibrations {_describe(fits[0])} and "
                    f"{_describe(a)} both fit it and hold different parameters; give one of them"
                )
        src = fits[0]
        tensors.update(mine)
        fitted_sinks.append(src.fitted_sinks(i))
        j = kv_layers.index(i)  # stats rows follow kv_layers
        row = src.layer_stats[j] if j < len(src.layer_stats) else {}
        stats.append({k: v for k, v in row.items() if k.startswith(sides)})
        layers.append({"from": src.scheme.name, "path": None if src.path is None else str(src.path)})
        if all(u is not src for u in used):
            used.append(src)
    if not used:  # a hybrid model whose calibrated layers are all convolution / linear-attention layers
        raise ValueError(
            f"scheme {scheme.name!r} calibrates only layers that store no K/V (the calibrated model's attention "
            f"layers are {kv_layers} of {n_layers}): it takes no calibration on this model"
        )
    data = {k: v for k, v in used[0].meta["data"].items() if all(u.meta["data"].get(k) == v for u in used)}
    data["context"] = min(u.max_calibrated_length for u in used)  # positions beyond it: beyond some layer's
    # each layer's, so check_scheme refuses serving a layer with fewer sinks than its source was fitted without
    data["excluded_sink_tokens"] = fitted_sinks[0] if len(set(fitted_sinks)) == 1 else fitted_sinks
    meta: dict[str, Any] = {
        k: used[0].meta[k]
        for k in ("percentile", "fisher", "kmeans", "dtype", "device", "fp8_scale", "tie_rope_pairs")
        if k in used[0].meta and all(u.meta.get(k) == used[0].meta[k] for u in used)
    }
    import kvbits

    meta.update(
        kvbits_version=kvbits.__version__,
        model=dict(model),
        data=data,
        created=now_utc(),
        stats=stats,
        composed={
            "sources": [
                {
                    "scheme": u.scheme.name,
                    "path": None if u.path is None else str(u.path),
                    "data": u.meta["data"],
                }
                for u in used
            ],
            "layers": layers,
        },
    )
    art = CalibrationArtifact(scheme=scheme, tensors=tensors, meta=meta)
    art.validate()
    return art
