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

This module runs those steps (``tune``) and holds their record (``TuneResult``); the pieces live beside it:
``knapsack`` (step 2's choice), ``probes`` (the sensitivities of steps 1 and 3), ``inputs`` (the name, shape,
prices and calibrations resolved before any pass) and ``compare`` (the compared schemes and the warnings).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from kvbits._argtypes import runs_on_device
from kvbits.schemes import KVScheme, check_unique_names
from kvbits.tune.compare import _compared, _warn_better, _warn_beyond, better_compared
from kvbits.tune.inputs import _candidate_calibrations, _check_name, _model_shape, _prices, tune_scheme
from kvbits.tune.knapsack import (
    BIT_DENOMINATOR,
    _check_budget,
    _is_int,
    choose_layers,
    choose_layers_by_bytes,
)
from kvbits.tune.probes import (
    EXACT,
    _check_measured,
    _composed,
    _load,
    _mix,
    layer_sensitivity,
    marginal_sensitivity,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BIT_DENOMINATOR", "EXACT", "TuneResult", "better_compared", "choose_layers", "choose_layers_by_bytes",
    "layer_sensitivity", "marginal_sensitivity", "tune",
]


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


def _warn_unconstrained(layer_bytes: list[list[int]], elements: int, budget_bits: float, context: int) -> None:
    """One warning when ``budget_bits`` is at or above the dearest mix (every layer by its dearest candidate,
    ``layer_bytes`` ``(layers, candidates)``): the budget then constrains nothing, and the sweep only picks each
    layer's least-KL candidate (a budget given in bytes or in another unit than ``kvbits plan``'s avg_bits?)."""
    dearest = 8 * sum(max(row) for row in layer_bytes) / elements
    if dearest <= budget_bits:
        logger.warning(
            "the %g-bit budget is at or above the dearest mix of the candidates (%.4g average bits at %d tokens, "
            "every layer by its dearest candidate): it constrains nothing, and each layer gets its least-KL "
            "candidate; give a budget below %.4g bits to trade bits for KL",
            budget_bits, dearest, context, dearest,
        )  # fmt: skip


@runs_on_device
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
    bos: str = "auto",
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
            elements an fp16 cache holds; each layer by its own KV heads, head dim and sliding window)). A budget at or
            above the dearest mix constrains nothing: a warning says so.
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
        bos: the windows of every pass (sensitivity, rounds, check) start with the tokenizer's BOS: ``"auto"``
            (where ``tokenizer(text)`` adds one), ``"always"`` or ``"never"``, as ``evaluate`` takes it; ``meta``'s
            ``"bos"`` says what ran (``"always"`` / ``"never"``), and evaluate warns when a candidate's calibration
            was cut with another BOS choice.
    """
    import time

    t0 = time.perf_counter()
    cands = [tune_scheme(c, "candidate") for c in candidates]
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
    from kvbits.evaluate.data import check_bos

    check_bos(bos, model)  # before the model loads
    name = name or f"tuned-{budget_bits:g}"
    others = _compared(compare, cands, name)
    arts = _candidate_calibrations(cands, calibrations, others)
    other_arts = {s.name: arts.pop(s.name) for s in others if s.name in arts}
    if not _is_int(rounds) or rounds < 1:  # NumPy's ints too, as serve_context= and dtype_bytes= take them
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    rounds = int(rounds)
    if serve_context is not None:  # NumPy's ints too, as context= is taken; not a float or a bool
        if not _is_int(serve_context) or serve_context < 1:
            raise ValueError(
                f"serve_context must be a positive int (tokens the mix is served at), got {serve_context!r}"
            )
        serve_context = int(serve_context)
    priced_at = context if serve_context is None else serve_context
    model, dtype, device = _load(model, dtype, device)  # loaded once for every run below
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
    _warn_unconstrained(layer_bytes, elements, budget_bits, priced_at)
    run = {"windows": windows, "data_path": data_path, "dtype": dtype, "device": device, "progress": progress, "bos": bos}
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
            "bos": summary.get("bos", "never"),
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
            model, data, context, measured, attn_layers=[], calibration=calibration, on_pass=measured_one,
            progress_label="kvbits tune", **check_run,
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
