"""``tune``'s inputs resolved before any pass: the mix's name, the model's shape and the candidates' prices as
``kvbits plan`` counts them, and the candidates' calibration artifacts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbits._argtypes import PEER_NAMES, tune_peer_refusal
from kvbits._spelling import spell
from kvbits.schemes import KVScheme, get_scheme


def tune_scheme(spec: Any, role: str) -> KVScheme:
    """``get_scheme(spec)``, but a comparison peer's name (``hf-quanto-int4``: transformers' ``QuantizedCache``, which
    ``kvbits eval`` measures beside kvbits schemes) is refused saying what it is and what to pass instead, not as an
    "unknown scheme". ``role`` (``"candidate"``, ``"compare"``) starts the message."""
    if isinstance(spec, str) and spec in PEER_NAMES:
        raise ValueError(tune_peer_refusal(spec, role))
    return get_scheme(spec)


def _check_name(name: Any, cands: list[KVScheme]) -> None:
    """``ValueError`` (before any pass) for a mix name its scheme JSON could not be read back under, or that
    the check run could not tell apart: a candidate's name, a preset's, or a mixed scheme string of presets
    (``get_scheme`` refuses a file so named that stores K/V otherwise)."""
    from kvbits.schemes.presets import _builtin

    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string (the mix's scheme name), got {name!r}")
    if name in [c.name for c in cands]:
        raise ValueError(
            f"name {name!r} is a candidate's: the mix is measured beside the candidates, by name; choose another"
        )
    if _builtin(name) is not None:
        what = "a kvbits preset" if "," not in name else "a mixed scheme of kvbits presets"
        raise ValueError(
            f"name {name!r} is the name of {what}: the tuned mix's scheme JSON would be refused when read back "
            f"(it stores K/V otherwise); choose another, e.g. {name.replace(',', '_').replace('=', '-') + '-tuned'!r}"
        )


def _model_shape(model: Any, dtype: Any) -> Any:
    """The planner's ``ModelShape`` of ``model`` (a ``LoadedModel`` or a transformers model), its
    ``dtype_bytes`` those of the dtype the passes run in: ``dtype`` when given, else the model's own as
    ``kvbits eval`` reads it (its first *floating* parameter's, ``_floating_bytes``: an integer buffer or quantized
    weight registered first priced a float32 model's full-precision tokens at 1 byte); the config's where the
    model has no floating parameter."""
    from kvbits.evaluate.measures import _floating_bytes
    from kvbits.evaluate.request import _resolve_dtype
    from kvbits.plan.config import load_shape

    module = getattr(model, "model", model)
    torch_dtype = _resolve_dtype(dtype)[0]
    size = _floating_bytes(module) if torch_dtype is None else torch_dtype.itemsize
    shape = load_shape(module.config)
    return shape if size is None else shape.replace(dtype_bytes=size)


def _prices(shape: Any, cands: list[KVScheme], context: int) -> tuple[list[list[int]], int, list[float]]:
    """``(layer_bytes (layers, candidates), elements, bits (candidates,))`` at ``context`` tokens, one
    sequence, as ``kvbits plan`` counts them (``plan_shape``): the bytes layer ``i`` holds stored by each
    candidate (key + value, fixed bytes included), the elements of an fp16 cache of the model, and each
    candidate's ``avg_bits`` when it stores every layer."""
    from kvbits.plan.planner import plan_shape

    plans = [plan_shape(shape, c, context=context) for c in cands]
    elements = plans[0]["elements"]
    layer_bytes = [[p["per_layer"][i]["total_bytes"] for p in plans] for i in range(shape.n_layers)]
    return layer_bytes, elements, [p["avg_bits"] for p in plans]


def _candidate_calibrations(
    cands: list[KVScheme], calibrations: Any, others: Sequence[KVScheme] = ()
) -> dict[str, Any]:
    """Candidate (or compared scheme, ``others``) name -> its artifact (``kvbits eval``'s matching:
    ``_calibrations``), each checked against its scheme; ``ValueError`` for a scheme that needs one and has none, or
    (once any candidate has one) for a candidate with optional calibrated sides and none, whose layers no mix could
    then be composed with."""
    from kvbits.evaluate.inputs import _calibrations

    schemes, compared = [*cands, *others], {o.name for o in others}
    arts = _calibrations(calibrations, schemes)
    for c in schemes:
        if c.name in arts:
            arts[c.name].check_scheme(c)
    missing = [c for c in schemes if c.needs_calibration() and c.name not in arts]
    if missing:
        raise ValueError(
            ", ".join(
                f"{'compared scheme' if c.name in compared else 'candidate'} {c.name!r} ({' and '.join(c.needs_calibration())})"
                for c in missing
            )
            + " needs calibrated parameters (static scales or NUQ codebooks) and none were given: create them "
            "with `kvbits calibrate --scheme NAME --out DIR` on this model and pass the folder ("
            + spell("calibrations={'NAME': DIR}", "--calibration DIR")
            + ")"
        )
    mixed = [c.name for c in cands if c.name in arts]
    optional = [c.name for c in cands if c.calibratable() and c.name not in arts] if mixed else []
    if optional:
        raise ValueError(
            f"candidate {', '.join(map(repr, optional))} has calibrated sides (a static FP8 scale) and no "
            f"calibration, while {', '.join(map(repr, mixed))} has one: a mix of both needs both; create it with "
            "`kvbits calibrate --scheme NAME --out DIR` and pass it too"
        )
    return arts
