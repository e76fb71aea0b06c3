"""Sensitivity probes: the KL of the model with one layer's storage changed, measured by ``kvbits.evaluate``.

``layer_sensitivity``: each layer by each candidate with every other layer exact (``EXACT``);
``marginal_sensitivity``: each layer switched to each candidate with every other layer as the current mix stores
it. Both run in one ``evaluate`` run (one reference pass per window, one simulated pass per probe) and log one
line per probed layer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from kvbits.schemes import KVScheme, TensorSpec
from kvbits.schemes.presets import mixed_scheme
from kvbits.tune.knapsack import _is_int

logger = logging.getLogger(__name__)

__all__ = ["EXACT", "layer_sensitivity", "marginal_sensitivity"]

# every other layer while one is measured: float32 storage, exact for float32 and lower-precision models
EXACT = KVScheme(
    "exact",
    key=TensorSpec(kind="float", bits=32, fmt="fp32"),
    value=TensorSpec(kind="float", bits=32, fmt="fp32"),
    description="float32 K/V: no storage error (the background of a per-layer sensitivity run)",
)


def _load(model: Any, dtype: str | None, device: str | None) -> tuple[Any, str | None, str | None]:
    """``(model, dtype, device)``: a registry name / path loaded here, once, in ``dtype`` on ``device``, which are
    then spent (None: the loaded model runs as loaded); anything else as given."""
    if not isinstance(model, str):
        return model, dtype, device
    from kvbits.evaluate.models import load_model
    from kvbits.evaluate.request import _resolve_dtype, check_device

    check_device(device)
    return load_model(model, dtype=_resolve_dtype(dtype)[0], device=device or "cpu"), None, None


def _loaded(model: Any, run: dict[str, Any]) -> tuple[Any, int]:
    """``(model, its layer count)``: a registry name / path loaded here, once, as ``tune`` loads it (``_load``:
    ``run``'s ``dtype`` / ``device`` apply to the load and are then cleared, since they are spent), so that a table
    length can be checked against the model before any pass; the count is the planner's (``load_shape`` of the
    config), what ``tune`` sizes ``n_layers`` / ``pick`` by."""
    from kvbits.plan.config import load_shape

    if isinstance(model, str):
        model, run["dtype"], run["device"] = _load(model, run.get("dtype"), run.get("device"))
    return model, load_shape(getattr(model, "model", model).config).n_layers


def _check_layer_count(given: int, layers: int, what: str) -> None:
    """``ValueError`` unless ``given`` (the table length asked for; ``what`` says how) is the model's ``layers``."""
    if given != layers:
        raise ValueError(f"{what} {given} layer(s), but the model has {layers}: one per model layer expected "
                         "(a shorter table left the last layers out, silently)")  # fmt: skip


def layer_sensitivity(
    model: Any,
    data: Any,
    candidates: list[KVScheme],
    n_layers: int,
    *,
    context: int,
    windows: int = 1,
    data_path: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = False,
    calibrations: Mapping[str, Any] | None = None,
    skip: Collection[int] = (),
    bos: str = "auto",
) -> tuple[list[list[float]], dict[str, Any]]:
    """``(sensitivity (layers, candidates), evaluate's summary)``: the KL with layer ``i`` stored by
    candidate ``c`` and every other layer exact (``EXACT``), decode semantics, simulate mode, for each of
    the ``n_layers`` layers. ``model`` as ``kvbits.evaluate.evaluate`` takes it (loaded once by the caller).
    ``calibrations``: candidate name -> ``CalibrationArtifact``; a probe of a calibrated candidate runs
    with the artifact composed from them (``compose_artifact``: layer ``i``'s tensors of that candidate).
    ``skip``: layers that store no K/V (``LayerShape.attention == "none"``: a hybrid model's convolution or
    state-space layers), whose scheme changes nothing: no probe, a row of 0.0. ``n_layers`` must be the model's
    layer count (``ValueError`` otherwise, before any pass: a smaller one returned a table missing the last
    layers). ``bos``: the windows' BOS, as ``evaluate`` takes it."""
    from kvbits.evaluate.runner import evaluate

    loaded = {"dtype": dtype, "device": device}
    model, layers = _loaded(model, loaded)
    dtype, device = loaded["dtype"], loaded["device"]
    _check_layer_count(n_layers, layers, "n_layers asks for")
    probes = {
        (i, j): mixed_scheme(EXACT, {i: c}, name=f"exact,{i}={c.name}")
        for i in range(n_layers) if i not in skip for j, c in enumerate(candidates)
    }  # fmt: skip
    layer_of = {p.name: i for (i, _), p in probes.items()}
    schemes = list(probes.values())
    summary = evaluate(
        model, data, context, schemes, windows=windows, attn_layers=[], data_path=data_path, dtype=dtype,
        device=device, progress=progress, calibration=_composed(schemes, calibrations), bos=bos,
        on_pass=_layer_progress(layer_of, n_layers, "sensitivity"), progress_label="kvbits tune",
    )  # fmt: skip
    kl = {r["scheme"]: r["kl"] for r in summary["results"]}
    return [
        [0.0 if i in skip else kl[probes[i, j].name] for j in range(len(candidates))] for i in range(n_layers)
    ], summary


def _layer_progress(layer_of: Mapping[str, int], n_layers: int, what: str) -> Callable[[int, int, str], None]:
    """``evaluate``'s ``on_pass`` for a sweep of per-layer probes (``layer_of``: probe name -> its layer, in the
    order the probes run): one INFO line each time a layer's last probe is through a window, so that a run without
    the progress bar (``--no-progress``, ``--json``: tens of minutes on a CPU) shows it is alive."""
    import time

    closing = {name: i for i, name in {i: name for name, i in layer_of.items()}.items()}  # layer's last probe
    probed = len(closing)
    t0 = time.perf_counter()
    done = 0

    def on_pass(w: int, windows: int, name: str) -> None:
        nonlocal done
        i = closing.get(name)
        if i is None:
            return
        done += 1
        logger.info(
            "%s: window %d/%d, layer %d/%d probed (%d/%d layer passes), %.0f s",
            what, w + 1, windows, i, n_layers - 1, done, probed * windows, time.perf_counter() - t0,
        )  # fmt: skip

    return on_pass


def _composed(schemes: list[KVScheme], calibrations: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Scheme name -> its artifact composed from ``calibrations`` (candidate name -> artifact), for each of
    ``schemes`` that calibrates something; None when no calibrations were given."""
    if not calibrations:
        return None
    from kvbits.calibrate import compose_artifact

    return {s.name: compose_artifact(s, calibrations) for s in schemes if s.calibratable()} or None


def _mix(candidates: list[KVScheme], pick: list[int], name: str) -> KVScheme:
    """The scheme storing layer ``i`` by ``candidates[pick[i]]``; its base is the candidate most layers use."""
    counts = [pick.count(j) for j in range(len(candidates))]
    base = max(range(len(candidates)), key=lambda j: (counts[j], -j))
    return mixed_scheme(candidates[base], {i: candidates[j] for i, j in enumerate(pick) if j != base}, name=name)


def marginal_sensitivity(
    model: Any,
    data: Any,
    candidates: list[KVScheme],
    pick: list[int],
    *,
    context: int,
    skip: Collection[int] = (),
    **run: Any,
) -> tuple[list[list[float]], float]:
    """``(costs (layers, candidates), KL of the current mix)``: for each layer ``i`` and candidate ``c``, the
    KL of the current mix (layer ``i`` by ``candidates[pick[i]]``) with layer ``i`` switched to ``c``, minus
    the current mix's KL, shifted per layer so its least entry is 0 (one candidate per layer is chosen, so a
    per-layer constant changes no choice). ``run``: ``evaluate``'s ``windows``, ``data_path``, ``dtype``,
    ``device``, ``progress``, ``bos``; ``calibrations``: candidate name -> artifact, and ``skip`` (layers without K/V:
    no probe, a row of 0.0), as ``layer_sensitivity``. ``pick``: ``(layers,)`` the current mix's candidate index
    per layer, each in ``0..len(candidates) - 1``, one per model layer (``ValueError`` otherwise, before any
    pass)."""
    from kvbits.evaluate.runner import evaluate

    # before any pass: a negative index stored the layer by a candidate from the end, silently (its row then had no
    # 0.0 for the current storage), one past the end failed deep inside with an IndexError
    if len(pick) == 0 or any(not _is_int(j) or not 0 <= j < len(candidates) for j in pick):
        raise ValueError(
            f"pick must list one candidate index per layer, each in 0..{len(candidates) - 1}, got {list(pick)!r}"
        )
    model, layers = _loaded(model, run)
    _check_layer_count(len(pick), layers, "pick lists")
    current = _mix(candidates, pick, "current")
    probes = {
        (i, j): _mix(candidates, [j if k == i else p for k, p in enumerate(pick)], f"around,{i}={c.name}")
        for i in range(len(pick)) if i not in skip for j, c in enumerate(candidates) if j != pick[i]
    }  # fmt: skip
    calibrations = run.pop("calibrations", None)
    mixes = [current, *probes.values()]
    layer_of = {p.name: i for (i, _), p in probes.items()}
    summary = evaluate(
        model, data, context, mixes, attn_layers=[], calibration=_composed(mixes, calibrations),
        on_pass=_layer_progress(layer_of, len(pick), "marginal KLs around the mix"), progress_label="kvbits tune",
        **run,
    )  # fmt: skip
    kl = {r["scheme"]: r["kl"] for r in summary["results"]}
    base = kl["current"]
    table = [
        [0.0 if j == pick[i] or i in skip else kl[probes[i, j].name] - base for j in range(len(candidates))]
        for i in range(len(pick))
    ]
    return [[x - min(row) for x in row] for row in table], base



def _check_measured(table: list[list[float]], cands: list[KVScheme], what: str) -> None:
    """``ValueError`` naming the first non-finite KL of a measured ``(rows, candidates)`` table: a NaN or inf in a
    probe's outputs, which the knapsack can not weigh (``_check_costs`` would only say that some entry is bad)."""
    for i, row in enumerate(table):
        for j, x in enumerate(row):
            if not math.isfinite(x):
                raise ValueError(
                    f"the KL measured {what} layer {i} stored by {cands[j].name!r} is {x}: its passes gave "
                    "non-finite outputs (try --dtype float32, or leave that candidate out)"
                )
