"""What a run measures besides the metrics: calibration/serving mismatch and peak memory."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

from kvbits.evaluate.request import _calibration_id

logger = logging.getLogger(__name__)

__all__: list[str] = []


def add_counts(into: dict[str, int], counts: Mapping[str, int]) -> None:
    """Add ``counts`` to ``into`` key by key (clipping or decode-step counters of windows, trials or ranks)."""
    for key, n in counts.items():
        into[key] = into.get(key, 0) + int(n)


def add_clipping(into: dict[str, int], cache: Any) -> None:
    """Add what a real ``QuantizedKVCache`` or ``StaticQuantizedKVCache`` clipped (``calibration_report()``, summed over
    layers) to ``into``,
    in the simulator's form: ``keys`` / ``values`` (values clipped against their scales) and ``keys_elements`` /
    ``values_elements`` (elements quantized). A peer's cache (no ``calibration_report``) adds nothing."""
    report = getattr(cache, "calibration_report", None)
    if report is None:
        return
    for row in report()["layers"]:
        for side in ("keys", "values"):
            add_counts(into, {side: row[f"clipped_{side}"], side + "_elements": row[f"quantized_{side}"]})


def _mismatch(clipped: dict[str, int], artifact: Any, context: int, mode: str, scheme: Any = None) -> dict[str, Any]:
    """Calibration/serving mismatch, measured: values clipped by their scales (simulate mode: the
    simulator's counts; stream mode: the real caches', ``add_clipping``; none for a peer) and positions
    beyond the longest calibrated length (with a calibration artifact). ``scheme`` (a ``KVScheme``): its sides
    stored under vLLM's integer zero-points in some layer (``vllm-int4``), which clip where a token's range
    excludes 0, are listed as ``integer_zero`` (``["keys", "values"]``), so the report says why they clipped."""
    out: dict[str, Any] = {}
    if mode == "simulate" or clipped:
        for side in ("keys", "values"):
            n, total = clipped.get(side, 0), clipped.get(side + "_elements", 0)
            out[f"clipped_{side}"] = n
            out[f"clipped_{side}_frac"] = n / total if total else 0.0
        sides = _integer_zero_sides(scheme)
        if sides:
            out["integer_zero"] = sides
    if artifact is not None:
        longest = int(artifact.max_calibrated_length)
        out["max_calibrated_length"] = longest
        out["positions_beyond_calibrated"] = max(0, context - longest)
        out["artifact"] = _artifact_record(artifact)
    return out


def _integer_zero_sides(scheme: Any) -> list[str]:
    """``"keys"`` / ``"values"``: the sides some layer of ``scheme`` (a ``KVScheme``; anything else: none) stores
    under integer zero-points (``TensorSpec.integer_zero``)."""
    from kvbits.schemes.spec import KVScheme

    if not isinstance(scheme, KVScheme):
        return []
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    return [side + "s" for side in ("key", "value") if any(getattr(s, side).integer_zero for s in subs)]


def plan_shape_of(config: Any, model: Any = None) -> Any:
    """``kvbits plan``'s shape of the model (``kvbits.plan.config.load_shape``), read once per run for its
    ``avg_bits`` (and eval's ``bits_at_context``), or None where the planner does not read the config (said in the log).

    ``model``: the loaded model, whose parameters' element size replaces the config's dtype bytes (the cache keeps
    sinks and its full-precision window in the dtype the model runs in, as ``kvbits speed``'s ``planned_bytes``
    counts them). The config's dtype does not follow a cast (``model.to(torch.float32)``, ``evaluate(dtype=...)`` on a
    model object) and is absent from a config built in Python (then 2 bytes): kivi-2 on a float32 model at 300 tokens
    was reported at 9.07 bits while its cache held 16.5."""
    from kvbits.plan.config import load_shape

    try:
        shape = load_shape(config)
    except (ValueError, TypeError) as e:
        logger.info("kvbits plan does not read this config (%s): avg_bits counts its layers alike, no bits_at_context", e)
        return None
    size = _floating_bytes(model) if model is not None else None
    if size is not None and size != shape.dtype_bytes:
        shape = shape.replace(dtype_bytes=size)
    return shape


def model_dtype_bytes(model: Any) -> int:
    """Bytes per element of the dtype ``model`` runs in (its first floating parameter's; 2 where it has none)."""
    size = _floating_bytes(model)
    return 2 if size is None else size


def floating_dtype(model: Any) -> torch.dtype | None:
    """The dtype ``model`` runs in: its first *floating* parameter's, None where it has none.

    Not ``next(model.parameters()).dtype``: an integer parameter registered first (a quantized weight, an index
    table) made a float32 model read as int8 (recorded dtype, logit-head tolerance, planned bytes). Every place that
    asks for the model's dtype or element size reads it here."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), None)


def _floating_bytes(model: Any) -> int | None:
    """Element size of ``model``'s first floating parameter (``floating_dtype``), None where it has none."""
    dtype = floating_dtype(model)
    return None if dtype is None else dtype.itemsize


def long_run_avg_bits(
    scheme: Any, shape: Any, head_dim: int, kv_heads: int, n_layers: int, *, dtype_bytes: int | None = None
) -> float:
    """A result's ``avg_bits``: a peer cache's own figure (``PeerScheme.bits`` of the K/V's ``dtype_bytes``, the
    model's, :func:`model_dtype_bytes`: quanto keeps its scales and zero-points in it; ``shape``'s where not given,
    float16 where neither is: int4 was reported at 4.5 bits on a float32 model whose quanto cache held 5.0); for a
    kvbits scheme the bits per element its cache tends
    to as the context grows (``kvbits.plan.long_run_bits`` of the model's ``shape``, :func:`plan_shape_of`: only
    full-attention layers grow, each weighted by its own heads and head dim), or ``average_bits`` over ``n_layers``
    layers of ``kv_heads`` heads of ``head_dim`` where ``shape`` is None (``kvbits plan`` does not read the config)."""
    from kvbits.evaluate.stream import PeerScheme
    from kvbits.plan.planner import long_run_bits
    from kvbits.schemes.accounting import average_bits

    if isinstance(scheme, PeerScheme):
        if dtype_bytes is None:
            dtype_bytes = shape.dtype_bytes if shape is not None else 2
        return scheme.bits(dtype_bytes)
    if shape is None:
        return average_bits(scheme, head_dim=head_dim, n_heads=kv_heads, n_layers=n_layers)
    return long_run_bits(shape, scheme)


def _with_generation(record: dict[str, Any], context: int, generate: int) -> dict[str, Any]:
    """``record`` (``_mismatch``) with ``generation_positions_beyond_calibrated``: ``B`` of the ``context + generate``
    positions a run that generates ``generate`` tokens after each window of ``context`` serves (``evaluate(generate=N)``)
    lie past its calibrated length. ``record`` as it is without generation or a calibrated length."""
    longest = record.get("max_calibrated_length")
    if not generate or not isinstance(longest, int):
        return record
    return {**record, "generation_positions_beyond_calibrated": max(0, int(context) + int(generate) - longest)}


def _warn_mismatch(scheme: str, record: dict[str, Any], context: int) -> None:
    """Log what the report flags in a scheme's calibration record (``_mismatch``), in its words:
    positions served beyond the calibrated length, and clipping above the report's warning level, so
    a terminal run (no ``--out``, no report) says it too. With generation (``_with_generation``), the positions
    its continuations reach past the calibrated length are said the same way, with the ``--context`` that covers
    prompt and continuation."""
    from kvbits.report.calibration import (
        calibration_advice,
        calibration_issues,
        calibration_row,
        generation_warning,
    )

    row = calibration_row(scheme, record, context)
    issues = calibration_issues(row)
    if issues:
        advice = calibration_advice(row)  # the report's advice too
        logger.warning("%s %s.%s", scheme, "; ".join(issues), f" {advice}" if advice else "")
    gen = generation_warning(row)  # the report's words too
    if gen:
        logger.warning("%s %s", scheme, gen)


def _warn_unquantized(model: Any, scheme: Any, context: int) -> bool:
    """Log a warning when ``scheme`` (a kvbits scheme) quantizes nothing that a window of ``context`` tokens
    scores (``quantized_keys_seen`` is 0: its sinks and full-precision window hold every key the predictions
    attend to): the run would report the unquantized model's PPL and KL under the scheme's name and average bits.
    Returns whether it warned."""
    from kvbits.evaluate.simulate import first_quantizing_context, quantized_keys_seen

    if quantized_keys_seen(model, scheme, context) > 0:
        return False
    need = first_quantizing_context(model, scheme)
    longer = (
        f"the shortest context at which it quantizes anything is {need}"
        if need is not None
        else "it quantizes nothing at any context on this model (every layer's sliding window is shorter than its "
        "full-precision buffer)"
    )
    kept = "" if scheme.is_mixed else (
        f" (it keeps {scheme.sinks} sink token(s) and the last {scheme.residual} token(s) in full precision, flushing "
        f"{scheme.block} at a time)"
    )  # fmt: skip
    logger.warning(
        "%s quantizes no key or value that a window of %d tokens scores%s: its PPL, KL and top-1 are the unquantized "
        "model's, not the scheme's; %s",
        scheme.name, context, kept, longer,
    )  # fmt: skip
    return True


def _warn_length_dependent_rope(model: Any, context: int, mode: str) -> bool:
    """Log a warning when ``model``'s RoPE tables depend on the forward's length (``dynamic``, ``longrope``) and a
    window of ``context`` tokens runs past the frame ``W`` they are constant over (``RotaryTables.frame``: the
    original context). One forward over the window (the reference and ``simulate``) rotates every key with the
    tables of ``context`` tokens; decoding token by token (``stream``, and generation) rotates each key with those
    of the length it was decoded at, so the two differ without any quantization: on a tiny Llama with ``dynamic``
    RoPE (``W`` 32, 80 tokens, float64) an ``fp16`` stream's hidden states were 1.6e-3 (median, relative) from the
    reference, against 2.2e-2 for ``int4-token``, and the simulator's ``fp16`` 4e-5. Returns whether it warned."""
    from kvbits._model import attention_modules
    from kvbits.quant.rope import RotaryTables

    try:
        tables = RotaryTables.from_model(model)
        frames = {tables.tables_for_layer(m.layer_idx).frame for m in attention_modules(model)}
    except (NotImplementedError, ValueError, TypeError, AttributeError, KeyError, RuntimeError) as e:  # no RoPE read
        logger.debug("RoPE tables not read (%s): no length-dependent RoPE warning", e)
        return False
    frames.discard(None)
    if not frames or context <= min(frames):
        return False
    logger.warning(
        "%s's RoPE (%s) changes its frequencies with the forward's length past %d tokens, and windows are %d: the "
        "reference and mode='simulate' rotate every key with the tables of one %d-token forward, token-by-token "
        "decoding (mode='stream', generation) with those of the length each key was decoded at, so %s",
        type(model).__name__, tables.rope_type, min(frames), context, context,
        "stream-mode PPL and KL include that difference for any scheme, fp16 too (compare with an fp16 run)"
        if mode == "stream"
        else "the simulated runs measure quantization against a prefill of the window, not what generation past "
        "the original context decodes",
    )  # fmt: skip
    return True


def _artifact_record(art: Any) -> dict[str, Any]:
    """Which calibration served a scheme: its id (as in ``config.json``), folder, and the data it saw."""
    data = (getattr(art, "meta", None) or {}).get("data") or {}
    path = getattr(art, "path", None)
    rec: dict[str, Any] = {"id": _calibration_id(art), "path": None if path is None else str(path)}
    for key in ("name", "context", "windows", "tokens"):
        if isinstance(data, dict) and data.get(key) is not None:
            rec["data" if key == "name" else key] = data[key]
    return rec


# the largest process peak a high-water-mark reset (_reset_peak_rss) lowered: Linux's reset also lowers getrusage's
# ru_maxrss, so a second evaluation in one process read a peak without the first's (414 MiB after a 909 MiB one)
_PEAK_BEFORE_RESETS = 0


def _peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes since it started (``getrusage``, and the peaks a
    ``_reset_peak_rss`` lowered it from), or None where the platform does not report it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    try:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (OSError, ValueError):
        return None
    if peak <= 0:
        return None
    peak = peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
    return max(peak, _PEAK_BEFORE_RESETS)


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _vm_hwm_bytes() -> int | None:
    """Linux: ``VmHWM`` (the resident high-water mark, resettable) in bytes, or None elsewhere."""
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> int | None:
    """Start measuring the run's own resident peak: record the process peak so far, then reset the
    Linux high-water mark (``echo 5 > /proc/self/clear_refs``) to the current resident set.

    Returns the process peak before the reset, or None when the reset is unavailable (then
    ``_run_peak_rss_bytes`` reports None and only the process peak is known).
    """
    global _PEAK_BEFORE_RESETS
    before = _peak_rss_bytes()
    if _vm_hwm_bytes() is None:
        return None
    _PEAK_BEFORE_RESETS = max(_PEAK_BEFORE_RESETS, before or 0)
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    return before


def _run_peak_rss_bytes(reset: int | None) -> int | None:
    """Resident peak since ``_reset_peak_rss`` (the weights already resident included, the loading
    excluded), or None when no reset happened."""
    return None if reset is None else _vm_hwm_bytes()


def _peak_cuda_bytes(dev: torch.device) -> int | None:
    """Peak bytes allocated by torch on ``dev`` since its peak was last reset, or None off CUDA."""
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(dev))
