"""Per-layer precision from measured sensitivity (KVTuner-style): which layers get which scheme.

1. **Sensitivity.** For every layer ``i`` and candidate scheme ``c``, the KL divergence of the model
   with only layer ``i`` stored by ``c`` (every other layer exact, float32) against the unquantized
   model, on calibration windows, in one ``kvbits.evaluate.evaluate`` run (one reference pass per window,
   one simulated pass per (layer, candidate)).
2. **Choice.** The assignment of one candidate per layer with the least *sum* of those KLs whose average
   bits stay within a budget: a multiple-choice knapsack, solved exactly by dynamic programming over
   bytes. The bits are those ``kvbits plan`` reports for the mix at the serving context (``serve_context``,
   default the tuning context): each layer priced by
   the bytes it really holds there (``kvbits.plan.plan_shape``: its own KV heads and head dim, a sliding
   window's last ``W - 1`` tokens, sinks, the residual window and any fallback in the model's dtype,
   static scales and codebooks), over the elements an fp16 cache of the model holds (``avg_bits``), so
   layers weigh by what they store. Where some layers slide, the bits depend on the context (a window
   stops growing, full layers do not): a mix within the budget at one context may exceed it at a longer one.
3. **Refine** (``rounds > 1``). The layers' errors do not add up (they compound: BENCHMARKS.md §14), so
   each further round measures the *marginal* KL of changing one layer's candidate with every other layer
   as the current mix stores it, and solves the knapsack again on those costs: sensitivity measured
   where the mix is, not around the exact model. One round costs about as much as step 1.
4. **Check.** The chosen mix is evaluated on the same windows beside the uniform candidates; every
   round's prediction and measurement are reported, and the best measured mix is kept (without the check,
   ``rounds > 1`` still measures the last round's mix, alone, to keep the best; one round without it
   measures nothing). Verifying on other text and longer contexts is ``kvbits eval``'s job.

Calibrated candidates (static scales, NUQ codebooks: ``kvquant-4``, ``kvquant-2``) take their
``kvbits calibrate`` artifacts (``calibrations``); every probe and mix that stores some layer by one of
them runs with the artifact composed from those (``kvbits.calibrate.compose_artifact``), and the result
carries the chosen mix's (``TuneResult.calibration``).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvbits.schemes import KVScheme, TensorSpec, check_unique_names, get_scheme
from kvbits.schemes.presets import mixed_scheme

logger = logging.getLogger(__name__)

__all__ = [
    "EXACT", "TuneResult", "choose_layers", "choose_layers_by_bytes", "layer_sensitivity", "marginal_sensitivity",
    "tune",
]

# every other layer while one is measured: float32 storage, exact for float32 and lower-precision models
EXACT = KVScheme(
    "exact",
    key=TensorSpec(kind="float", bits=32, fmt="fp32"),
    value=TensorSpec(kind="float", bits=32, fmt="fp32"),
    description="float32 K/V: no storage error (the background of a per-layer sensitivity run)",
)
BIT_DENOMINATOR = 1 << 20  # bits are ratios of bytes to elements: read as fractions of at most this denominator


@dataclass
class TuneResult:
    """What ``tune`` found.

    Attributes:
        scheme: the chosen mix (``KVScheme`` with per-layer overrides; the base is the candidate most layers use).
        choice: per layer, the chosen candidate's name.
        candidates: candidate names, cheapest first; ``bits``: each one's ``avg_bits`` as ``kvbits plan``
            reports it for the model at the serving context (``meta["serve_context"]`` tokens, the tuning context
            unless ``serve_context`` was given; ``meta["dtype_bytes"]``).
        sensitivity: ``(layers, candidates)`` KL in nats with only that layer stored by that candidate.
        budget_bits: the average-bits budget; ``avg_bits``: the mix's, ``kvbits plan``'s figure at the serving
            context (``<= budget_bits``).
        predicted_kl: the sum of the chosen single-layer KLs (a later round's: from its marginal KLs);
            ``measured_kl``: the mix's own KL on the same windows (None only for one round without ``check``);
            ``uniform``: ``{candidate: {"kl", "avg_bits"}}`` measured alike (``avg_bits`` as ``bits``; empty
            without ``check``).
        rounds: per round, ``{"choice", "predicted_kl", "measured_kl"}``, and where a next round was
            computed ``"marginal_sensitivity"``: the KL costs of switching one layer around this round's
            mix (``marginal_sensitivity``, shifted to 0 per layer), which the next choice solved.
        meta: model, data, context, windows (those measured: fewer than asked where the text is short), layers,
            ``serve_context`` and ``dtype_bytes`` (the bits are ``kvbits plan --context SERVE_CONTEXT --dtype-bytes
            DTYPE_BYTES``'s), seconds; ``calibrations``:
            candidate -> the folder of its artifact (``"<in memory>"`` for objects), when calibrations were given.
        calibration: the chosen mix's ``CalibrationArtifact`` (composed from the candidates' artifacts),
            or None when the mix calibrates nothing; ``save(dir)`` writes it for ``kvbits eval``.
        compare: per scheme ``tune`` was asked to compare (``compare=``: uniform schemes that are not candidates,
            e.g. one at the budget's bits), ``{"scheme", "avg_bits", "measured_kl"}`` measured beside the mix on the
            same windows (``avg_bits`` as ``bits``); empty when none was asked.
    """

    scheme: KVScheme
    choice: list[str]
    candidates: list[str]
    bits: list[float]
    sensitivity: list[list[float]]
    budget_bits: float
    avg_bits: float
    predicted_kl: float
    measured_kl: float | None = None
    uniform: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    calibration: Any = None
    compare: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme.to_dict(),
            "choice": self.choice,
            "candidates": self.candidates,
            "bits": self.bits,
            "sensitivity": self.sensitivity,
            "budget_bits": self.budget_bits,
            "avg_bits": self.avg_bits,
            "predicted_kl": self.predicted_kl,
            "measured_kl": self.measured_kl,
            "uniform": self.uniform,
            "compare": self.compare,
            "rounds": self.rounds,
            "meta": self.meta,
            "calibration": None
            if self.calibration is None
            else {
                "path": None if self.calibration.path is None else str(self.calibration.path),
                "layers": self.calibration.meta["composed"]["layers"],
            },
        }


def _fraction(x: float, *, budget: bool = False) -> Fraction:
    """The fraction a float stands for: the simplest one of denominator <= ``BIT_DENOMINATOR`` within float64's
    rounding of ``x`` (``4.333333333333333`` -> 13/3), else ``x``'s exact binary value. A ``budget`` is read as such
    a fraction only when float64 rounds it to ``x`` itself: one a few ulps above it (13/3 for ``4.333333333333332``)
    would let a mix's float ``avg_bits`` exceed the budget."""
    x = float(x)  # numpy's float32 too (Fraction takes only Python floats and rationals)
    exact = Fraction(x)
    near = exact.limit_denominator(BIT_DENOMINATOR)
    if budget:
        return near if float(near) == x else exact
    return near if abs(near - exact) <= abs(exact) * Fraction(1, 1 << 50) else exact


def _is_int(x: Any) -> bool:
    """A Python or NumPy integer (``numbers.Integral``), not a bool and not a float that equals an int."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_budget(budget_bits: Any) -> None:
    """``ValueError`` unless ``budget_bits`` is a finite real number > 0 (not a bool, a string or NaN/inf, which
    ``Fraction`` would take as 1, parse, or refuse with an ``OverflowError`` of its own)."""
    if (
        isinstance(budget_bits, bool)
        or not isinstance(budget_bits, numbers.Real)
        or not math.isfinite(budget_bits)
        or budget_bits <= 0
    ):
        raise ValueError(f"budget_bits must be a positive number, got {budget_bits!r}")


def _units(bits: list[float], budget_bits: float, n: int) -> tuple[list[int], int]:
    """The candidates' bits and the budget of ``n`` layers in exact knapsack units: each number read as the
    fraction it stands for (``4.333...`` as 13/3, a budget ``5.67`` as 567/100; denominators up to
    ``BIT_DENOMINATOR``), all over their common denominator, so no mix within the budget is lost to rounding;
    ``ValueError`` when even the cheapest candidate in every layer exceeds the budget."""
    _check_budget(budget_bits)
    if any(isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) or b <= 0 for b in bits):
        raise ValueError(f"bits must be finite numbers > 0, got {bits!r}")
    exact = [_fraction(b) for b in bits]
    budget = _fraction(budget_bits, budget=True)
    scale = math.lcm(*(f.denominator for f in exact), budget.denominator)
    units = [int(f * scale) for f in exact]
    cap = math.floor(budget * n * scale)
    if cap < n * min(units):
        raise ValueError(
            f"budget {budget_bits:g} bits is below the cheapest candidate ({min(bits):.3g} bits) in every layer"
        )
    return units, cap


def choose_layers(sensitivity: list[list[float]], bits: list[float], budget_bits: float) -> list[int]:
    """The candidate index per layer minimising ``sum_i sensitivity[i][c_i]`` subject to
    ``mean_i bits[c_i] <= budget_bits`` (exact: the bits and the budget as fractions, ``_units``). Every layer
    weighs the same here; ``tune`` prices layers by their real bytes (``choose_layers_by_bytes``).

    Args:
        sensitivity: ``(layers, candidates)`` cost of each candidate in each layer (finite, ``>= 0``).
        bits: ``(candidates,)`` average bits of each candidate.
        budget_bits: the largest allowed average.

    Raises:
        ValueError: malformed inputs, or a budget below the cheapest candidate in every layer.
    """
    n = len(sensitivity)
    _check_costs(sensitivity, len(bits))
    units, cap = _units(bits, budget_bits, n)
    return _knapsack(sensitivity, [units] * n, cap)


def choose_layers_by_bytes(
    sensitivity: list[list[float]], layer_bytes: list[list[int]], elements: int, budget_bits: float
) -> list[int]:
    """The candidate index per layer minimising ``sum_i sensitivity[i][c_i]`` subject to
    ``8 * sum_i layer_bytes[i][c_i] <= budget_bits * elements``: the mix's bits per stored element as
    ``kvbits plan`` counts them (``avg_bits``), with the budget read as the fraction it stands for
    (``_fraction``: 5.67 as 567/100), so the mix's float ``avg_bits`` never exceeds ``budget_bits``.

    Args:
        sensitivity: ``(layers, candidates)`` cost of each candidate in each layer (finite, ``>= 0``).
        layer_bytes: ``(layers, candidates)`` bytes layer ``i`` holds when stored by candidate ``c``.
        elements: the elements the budget is a mean over (``plan``'s ``elements``), ``> 0``.
        budget_bits: the largest allowed bits per element.

    Raises:
        ValueError: malformed inputs, or a budget below the cheapest candidate of every layer.
    """
    n = len(sensitivity)
    _check_costs(sensitivity, len(layer_bytes[0]) if layer_bytes else 0)
    if len(layer_bytes) != n or any(len(row) != len(layer_bytes[0]) for row in layer_bytes):
        raise ValueError(
            f"layer_bytes must be (layers={n}, candidates) like the sensitivity, got {len(layer_bytes)} rows"
        )
    if isinstance(elements, bool) or not isinstance(elements, int) or elements < 1:
        raise ValueError(f"elements must be a positive int, got {elements!r}")
    _check_budget(budget_bits)
    cap = math.floor(_fraction(budget_bits, budget=True) * elements / 8)
    least = sum(min(row) for row in layer_bytes)
    if least > cap:
        raise ValueError(
            f"budget {budget_bits:g} bits is below the cheapest mix of the candidates ({8 * least / elements:.4g} "
            "bits per element, as kvbits plan counts them)"
        )
    return _knapsack(sensitivity, layer_bytes, cap)


def _check_costs(sensitivity: list[list[float]], n_candidates: int) -> None:
    n = len(sensitivity)
    if n == 0 or not n_candidates or any(len(row) != n_candidates for row in sensitivity):
        raise ValueError(f"sensitivity must be (layers, {n_candidates} candidates), got {n} rows")
    if any(not math.isfinite(x) or x < 0 for row in sensitivity for x in row):
        raise ValueError("sensitivities must be finite and >= 0")


def _knapsack(sensitivity: list[list[float]], weights: list[list[int]], cap: int) -> list[int]:
    """The candidate per layer of least summed ``sensitivity`` whose summed integer ``weights`` stay within
    ``cap`` (ties: the fewest weight units): exact dynamic programming over the reachable weights, keeping
    only the states no lighter state matches in cost (a dominated state completes no better)."""
    inf = math.inf
    # best[u]: least cost of the layers so far using exactly u units; how[i][u]: (candidate, previous u)
    best = {0: 0.0}
    how: list[dict[int, tuple[int, int]]] = []
    for row, units in zip(sensitivity, weights):
        nxt: dict[int, float] = {}
        back: dict[int, tuple[int, int]] = {}
        for u, cost in best.items():
            for c, (w, s) in enumerate(zip(units, row)):
                v = u + w
                if v <= cap and cost + s < nxt.get(v, inf):
                    nxt[v] = cost + s
                    back[v] = (c, u)
        best, least = {}, inf
        for v in sorted(nxt):  # Pareto front: a state survives only if cheaper than every lighter one
            if nxt[v] < least:
                best[v] = least = nxt[v]
        how.append(back)
    u = min(best, key=lambda k: (best[k], k))  # least cost, then fewest units
    choice = []
    for back in reversed(how):
        c, u = back[u]
        choice.append(c)
    return choice[::-1]


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
) -> tuple[list[list[float]], dict[str, Any]]:
    """``(sensitivity (layers, candidates), evaluate's summary)``: the KL with layer ``i`` stored by
    candidate ``c`` and every other layer exact (``EXACT``), decode semantics, simulate mode, for each of
    the ``n_layers`` layers. ``model`` as ``kvbits.evaluate.evaluate`` takes it (loaded once by the caller).
    ``calibrations``: candidate name -> ``CalibrationArtifact``; a probe of a calibrated candidate runs
    with the artifact composed from them (``compose_artifact``: layer ``i``'s tensors of that candidate).
    ``skip``: layers that store no K/V (``LayerShape.attention == "none"``: a hybrid model's convolution or
    state-space layers), whose scheme changes nothing: no probe, a row of 0.0."""
    from kvbits.evaluate.runner import evaluate

    probes = [
        mixed_scheme(EXACT, {i: c}, name=f"exact,{i}={c.name}")
        for i in range(n_layers) if i not in skip for c in candidates
    ]  # fmt: skip
    layer_of = {f"exact,{i}={c.name}": i for i in range(n_layers) if i not in skip for c in candidates}
    summary = evaluate(
        model, data, context, probes, windows=windows, attn_layers=[], data_path=data_path, dtype=dtype,
        device=device, progress=progress, calibration=_composed(probes, calibrations),
        on_pass=_layer_progress(layer_of, n_layers, "sensitivity"),
    )  # fmt: skip
    kl = {r["scheme"]: r["kl"] for r in summary["results"]}
    return [
        [0.0 if i in skip else kl[f"exact,{i}={c.name}"] for c in candidates] for i in range(n_layers)
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
    ``device``, ``progress``; ``calibrations``: candidate name -> artifact, and ``skip`` (layers without K/V:
    no probe, a row of 0.0), as ``layer_sensitivity``."""
    from kvbits.evaluate.runner import evaluate

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
        on_pass=_layer_progress(layer_of, len(pick), "marginal KLs around the mix"), **run,
    )  # fmt: skip
    kl = {r["scheme"]: r["kl"] for r in summary["results"]}
    base = kl["current"]
    table = [
        [0.0 if j == pick[i] or i in skip else kl[probes[i, j].name] - base for j in range(len(candidates))]
        for i in range(len(pick))
    ]
    return [[x - min(row) for x in row] for row in table], base


def tune(
    model: Any,
    data: Any,
    candidates: list[str | KVScheme],
    budget_bits: float,
    *,
    context: int = 1024,
    windows: int = 1,
    name: str | None = None,
    data_path: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    check: bool = True,
    rounds: int = 1,
    progress: bool = False,
    calibrations: Any = None,
    dtype_bytes: int | None = None,
    serve_context: int | None = None,
    compare: list[str | KVScheme] | None = None,
) -> TuneResult:
    """Measure each layer's sensitivity to each candidate, choose a mix within ``budget_bits`` average
    bits, and (``check``) measure the mix and the uniform candidates on the same windows.

    Args:
        model: a model spec (``smollm2-135m``, a hub id, a folder, a ``.gguf``), a ``LoadedModel`` or a
            transformers causal LM (then ``data`` must be token ids).
        data: a text spec, a ``TextSource`` or token ids, as ``kvbits eval`` takes them.
        candidates: at least two flat schemes (``int8-token``, ``int4-token``, ``fp16``, ``kvquant-4``, ...).
        budget_bits: the largest average bits of the mix: ``kvbits plan``'s ``avg_bits`` of the model at
            ``serve_context`` tokens (all bytes it holds there, full-precision tokens in the model's dtype, over the
            elements an fp16 cache holds; each layer by its own KV heads, head dim and sliding window).
        context, windows: the calibration windows (tokens each, how many).
        name: the mix's name (default ``tuned-<budget>``); not a candidate's, a preset's or a mixed string of
            presets (``int4-token,0=fp16``), which its scheme JSON could not be read back as.
        rounds: 1: choose from one-layer KLs around the exact model; more: re-choose from marginal KLs
            around the previous mix (``marginal_sensitivity``) until the choice repeats or the rounds end; every
            round's mix is measured (the last one's after the rounds, also without ``check``) and the best kept.
        calibrations: ``kvbits calibrate`` artifacts of the candidates that take them: a mapping candidate
            name -> artifact or folder, or artifacts/folders matched to the candidates by the scheme each
            was calibrated for (as ``kvbits eval`` matches ``--calibration``). Required for candidates with
            static scales or NUQ codebooks (``kvquant-4``); once any is given, every candidate with
            calibrated sides (a static FP8 scale too) needs one, so that every mix can be composed.
        dtype_bytes: bytes of a full-precision K/V value in the bits (1, 2, 4 or 8): the dtype the cache will be
            served in (2 for bfloat16 / float16), which prices residual windows and sinks; default the dtype the
            passes run in (``dtype``, else the model's), which on a float32 CPU run prices them at 4.
        serve_context: the context the mix will be served at, where the budget is priced (default ``context``).
            On a model with sliding layers the bits depend on it: a mix within the budget at 1k tokens can exceed
            it at 4k (its full layers keep growing, the windows do not). Left out there, a warning says when the
            mix would exceed the budget at the model's max context.
        compare: uniform schemes to measure beside the mix on the same windows (also without ``check``), that are
            not candidates: e.g. one at the budget's bits, which the knapsack of the candidates can not pick
            (``kvquant-3`` against a ``kvquant-4`` / ``kvquant-2`` mix). Recorded in ``TuneResult.compare``; a
            warning says when one within the budget measures a lower KL than the mix. Calibrated ones take their
            artifacts through ``calibrations``, matched as the candidates'.
    """
    import time

    t0 = time.perf_counter()
    cands = [get_scheme(c) for c in candidates]
    check_unique_names([c.name for c in cands], "measured")
    if len(cands) < 2:
        raise ValueError(f"give at least two candidate schemes to choose between, got {len(cands)}")
    for c in cands:
        if c.is_mixed:
            raise ValueError(f"candidate {c.name!r}: candidates must be flat schemes (one scheme for every layer)")
    _check_name(name, cands)
    if dtype_bytes is not None:  # an int (NumPy's too), not a float equal to one (2.0 in (1, 2, 4, 8)) nor a bool
        if not _is_int(dtype_bytes) or dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8 (an int: bytes of a K/V value as served), got "
                             f"{dtype_bytes!r}")  # fmt: skip
        dtype_bytes = int(dtype_bytes)
    _check_budget(budget_bits)
    others = _compared(compare, cands, name or f"tuned-{budget_bits:g}")
    arts = _candidate_calibrations(cands, calibrations, others)
    other_arts = {s.name: arts.pop(s.name) for s in others if s.name in arts}
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if serve_context is not None:  # NumPy's ints too, as context= is taken; not a float or a bool
        if not _is_int(serve_context) or serve_context < 1:
            raise ValueError(
                f"serve_context must be a positive int (tokens the mix is served at), got {serve_context!r}"
            )
        serve_context = int(serve_context)
    priced_at = context if serve_context is None else serve_context
    if isinstance(model, str):  # loaded once for every run below
        from kvbits.evaluate.models import load_model
        from kvbits.evaluate.request import _resolve_dtype, check_device

        check_device(device)
        model = load_model(model, dtype=_resolve_dtype(dtype)[0], device=device or "cpu")
        dtype = device = None
    from kvbits.plan.planner import planned_bits

    shape = _model_shape(model, dtype)
    if dtype_bytes is not None:  # the serving dtype prices the full-precision tokens, not the passes' dtype
        shape = shape.replace(dtype_bytes=dtype_bytes)
    n_layers = shape.n_layers
    layer_bytes, elements, bits = _prices(shape, cands, priced_at)
    other_bits = [planned_bits(shape, s, priced_at) for s in others]
    order = sorted(range(len(cands)), key=lambda j: bits[j])
    cands, bits = [cands[j] for j in order], [bits[j] for j in order]
    layer_bytes = [[row[j] for j in order] for row in layer_bytes]
    # an impossible budget is refused before the sensitivity sweep
    choose_layers_by_bytes([[0.0] * len(cands)] * n_layers, layer_bytes, elements, budget_bits)
    run = {"windows": windows, "data_path": data_path, "dtype": dtype, "device": device, "progress": progress}
    run["calibrations"] = arts or None
    # a hybrid model's layers without K/V (convolution, state-space) hold no bytes and measure no KL: not probed
    skip = {i for i, layer in enumerate(shape.layers) if layer.attention == "none"}
    logger.info(
        "sensitivity: %d layer(s) x %d candidates, one pass each per window (%d window(s) of %d tokens)",
        n_layers - len(skip), len(cands), windows, context,
    )  # fmt: skip
    sens, summary = layer_sensitivity(model, data, cands, n_layers, context=context, skip=skip, **run)
    _check_measured(sens, cands, "with only")
    pick = choose_layers_by_bytes(sens, layer_bytes, elements, budget_bits)
    log: list[dict[str, Any]] = [{"pick": pick, "predicted_kl": sum(sens[i][j] for i, j in enumerate(pick))}]
    logger.info("round 1/%d: chose a mix of predicted KL %.4g", rounds, log[0]["predicted_kl"])
    for _ in range(rounds - 1):
        logger.info("round %d/%d: measuring the marginal KLs around round %d's mix", len(log) + 1, rounds, len(log))
        costs, current_kl = marginal_sensitivity(model, data, cands, pick, context=context, skip=skip, **run)
        if not math.isfinite(current_kl):
            raise ValueError(f"the KL of round {len(log)}'s mix measured {current_kl}: its passes gave non-finite "
                             "outputs (try --dtype float32, or leave the candidate at fault out)")  # fmt: skip
        _check_measured(costs, cands, "around the current mix, switching")
        log[-1]["measured_kl"] = current_kl
        log[-1]["marginal_sensitivity"] = costs  # around this round's mix, whatever the next choice
        new = choose_layers_by_bytes(costs, layer_bytes, elements, budget_bits)
        if new == pick:  # the mix is its own best answer: nothing more to measure
            logger.info("round %d/%d: the marginal KLs choose the same mix; done", len(log) + 1, rounds)
            break
        shift = sum(costs[i][pick[i]] for i in range(n_layers))  # the current mix's cost in these units
        predicted = current_kl + sum(costs[i][j] for i, j in enumerate(new)) - shift
        log.append({"pick": new, "predicted_kl": predicted})
        logger.info("round %d/%d: chose a mix of predicted KL %.4g", len(log), rounds, predicted)
        pick = new
    name = name or f"tuned-{budget_bits:g}"
    mix = _mix(cands, pick, name)
    result = TuneResult(
        scheme=mix,
        choice=[cands[j].name for j in pick],
        candidates=[c.name for c in cands],
        bits=bits,
        sensitivity=sens,
        budget_bits=float(budget_bits),
        avg_bits=planned_bits(shape, mix, priced_at),
        predicted_kl=log[-1]["predicted_kl"],
        meta={
            "model": summary["model"],
            "data": summary["data"],
            "context": context,
            "serve_context": priced_at,
            "windows": summary.get("windows", windows),  # those that ran: fewer than asked when the text is short
            "layers": n_layers,
            "dtype_bytes": shape.dtype_bytes,
            "fingerprint": summary.get("fingerprint"),
        },
    )
    # the check measures the mix beside the uniform candidates; without it, a last round's new mix (rounds > 1) is
    # measured alone (one simulated pass per window, where a round runs one per layer and candidate), so that the
    # best measured mix is kept either way: it was returned unmeasured, possibly worse than the round before it
    # (--compare too: the compared schemes are measured beside the mix, which is then measured with them)
    if check or others or ("measured_kl" not in log[-1] and len(log) > 1):
        from kvbits.evaluate.runner import evaluate

        check_run = {k: v for k, v in run.items() if k != "calibrations"}
        measured = [mix, *(cands if check else []), *others]
        # only the measured schemes' artifacts: evaluate refuses one for a scheme it does not measure (the candidates
        # are not measured without the check)
        given = {**arts, **other_arts, **(_composed([mix], arts) or {})}
        calibration = {s.name: given[s.name] for s in measured if s.name in given} or None
        logger.info("check: measuring %s on the same windows", ", ".join(s.name for s in measured))

        def measured_one(w: int, windows: int, scheme: str) -> None:
            logger.info("check: window %d/%d, %s measured", w + 1, windows, scheme)

        checked = evaluate(
            model, data, context, measured, attn_layers=[], calibration=calibration, on_pass=measured_one, **check_run
        )  # fmt: skip
        by = {r["scheme"]: r for r in checked["results"]}
        log[-1]["measured_kl"] = by[mix.name]["kl"]
        if check:
            result.uniform = {c.name: {"kl": by[c.name]["kl"], "avg_bits": b} for c, b in zip(cands, bits)}
        result.compare = [
            {"scheme": s.name, "avg_bits": b, "measured_kl": by[s.name]["kl"]} for s, b in zip(others, other_bits)
        ]
    if "measured_kl" in log[-1]:  # rounds=1 with check=False: the mix is not measured (measured_kl None)
        result.measured_kl = log[-1]["measured_kl"]
        best = min(range(len(log)), key=lambda r: log[r].get("measured_kl", math.inf))
        if best != len(log) - 1:  # a later round measured worse than an earlier mix: keep the earlier one
            logger.info("round %d's mix measured best; keeping it", best + 1)
            pick, result.measured_kl = log[best]["pick"], log[best]["measured_kl"]
            result.scheme = _mix(cands, pick, name)
            result.choice = [cands[j].name for j in pick]
            result.predicted_kl = log[best]["predicted_kl"]
            result.avg_bits = planned_bits(shape, result.scheme, priced_at)
    if arts:
        result.calibration = (_composed([result.scheme], arts) or {}).get(result.scheme.name)
        result.meta["calibrations"] = {n: str(a.path or "<in memory>") for n, a in arts.items()}
    _warn_better(result)
    result.rounds = [
        {"choice": [cands[j].name for j in r["pick"]], **{k: v for k, v in r.items() if k != "pick"}} for r in log
    ]
    result.meta["seconds"] = round(time.perf_counter() - t0, 1)
    if serve_context is None:
        _warn_beyond(shape, result.scheme, context, budget_bits)
    logger.info(
        "tuned %s: %.3f avg bits at %d tokens (budget %g), KL predicted %.4g, measured %s",
        result.scheme.name, result.avg_bits, priced_at, budget_bits, result.predicted_kl, result.measured_kl,
    )  # fmt: skip
    return result


def better_compared(result: TuneResult) -> list[dict[str, Any]]:
    """The compared schemes (``result.compare``) within the budget whose measured KL is below the mix's: a uniform
    scheme a user would rather serve than the tuned mix."""
    mix_kl = result.measured_kl
    if mix_kl is None or not math.isfinite(mix_kl):
        return []
    return [
        c for c in result.compare
        if c["avg_bits"] <= result.budget_bits and math.isfinite(c["measured_kl"]) and c["measured_kl"] < mix_kl
    ]  # fmt: skip


def _warn_better(result: TuneResult) -> None:
    """One warning per compared scheme within the budget that measured a lower KL than the mix."""
    for c in better_compared(result):
        logger.warning(
            "uniform %s (%.3f average bits, within the %g-bit budget) measured KL %.4g, below the tuned mix's %.4g "
            "(%.3f bits) on the same windows: the mix of the candidates is not the best choice at this budget; serve "
            "%s, or tune with candidates that include it",
            c["scheme"], c["avg_bits"], result.budget_bits, c["measured_kl"], result.measured_kl, result.avg_bits,
            c["scheme"],
        )  # fmt: skip


def _compared(compare: Any, cands: list[KVScheme], name: str) -> list[KVScheme]:
    """The ``compare`` schemes resolved: flat, none a candidate (already measured uniform under ``check``), none
    named as the mix or listed twice; ``ValueError`` naming the one at fault."""
    if compare is None:
        return []
    if isinstance(compare, (str, KVScheme)):
        compare = [compare]
    others = [get_scheme(c) for c in compare]
    names = [c.name for c in cands]
    for s in others:
        if s.is_mixed:
            raise ValueError(f"compare {s.name!r}: compared schemes must be flat (one scheme for every layer)")
        if s.name in names:
            raise ValueError(
                f"compare {s.name!r} is a candidate, measured uniform beside the mix already (unless --no-check); "
                "compare schemes that are not candidates"
            )
        if s.name == name:
            raise ValueError(f"compare {s.name!r} has the mix's name; choose another --name")
    check_unique_names([s.name for s in others], "compared")
    return others


def _warn_beyond(shape: Any, mix: KVScheme, context: int, budget_bits: float) -> None:
    """Log one warning when ``shape`` has sliding layers and ``mix`` holds more than ``budget_bits`` at the model's
    max context (``shape.max_context``, when known and longer than ``context``): the budget was priced at the
    tuning context, where the windows weigh more than they will once the full layers have grown."""
    from kvbits.plan.planner import planned_bits

    longest = shape.max_context
    if longest is None or longest <= context or not any(layer.attention == "sliding" for layer in shape.layers):
        return
    there = planned_bits(shape, mix, longest)
    if there > budget_bits:
        logger.warning(
            "the mix holds %.3f average bits at the model's max context (%d tokens), over the %g-bit budget priced at "
            "the tuning context (%d tokens): the model has sliding layers, whose share of the bytes shrinks as the "
            "context grows; pass the context you will serve (--serve-context, serve_context=) to price it there",
            there, longest, budget_bits, context,
        )  # fmt: skip


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
            "with `kvbits calibrate --scheme NAME --out DIR` on this model and pass the folder (CLI: "
            "--calibration DIR; Python: calibrations={'NAME': DIR})"
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
