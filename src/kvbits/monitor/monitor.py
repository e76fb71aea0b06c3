"""``CacheMonitor``: watch a ``QuantizedKVCache`` while it serves, export what it sees, fall back when told.

Usage::

    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.25, value_error=0.25), labels={"request": "r1"})
    model.generate(**inputs, cache=cache)   # past_key_values=cache before transformers 5.24
    mon.prometheus()          # text exposition, for a scrape endpoint or write_textfile(...)
    mon.events                # thresholds crossed: layer, side, value, action (a crossing that does nothing
                              # is said once per run of consecutive crossing flushes); sequence: the batch
                              # row of a key/value_error (its worst), None for clipped_fraction and
                              # beyond_calibration, which read the whole batch

Signals (``kvbits.monitor.signals``), per layer and side, at each flush: the relative error of the block
just quantized (exact: its full-precision values are still there), values clipped against static
scales (or under integer zero-points, where a token's range excludes 0), and positions past the longest
calibrated context. A policy (``FallbackPolicy``) that sees a threshold crossed holds the layer (or every
layer, ``scope="request"``) in full precision from then on (``QuantizedKVLayer.hold_full_precision``). Cost: one dequantization of each measured block and a
read-back of a few numbers (a host sync) per flush, i.e. every ``block`` tokens per layer and side;
``sample_every`` thins it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvbits.monitor.export import (
    RESERVED_LABELS,
    MetricFamily,
    check_label_name,
    prometheus_text,
    strict_json,
    write_textfile,
)
from kvbits.monitor.policy import FallbackPolicy
from kvbits.monitor.signals import ERROR_BUCKETS, SideSignals, flush_error, worst_index

if TYPE_CHECKING:  # pragma: no cover - typing only (typing.Self is Python 3.11+; requires-python is 3.10)
    from typing_extensions import Self

logger = logging.getLogger(__name__)

__all__ = ["CacheMonitor"]

SIDES = ("key", "value")


class CacheMonitor:
    """Online signals, metrics and precision fallback for one ``QuantizedKVCache``.

    Args:
        cache: the cache to watch (its quantized layers must exist: build it with ``config=``).
        policy: thresholds and scope (``FallbackPolicy``); ``None`` only records signals.
        labels: constant labels added to every exported sample and event (``scheme`` is always there); the names
            the monitor sets itself (``export.RESERVED_LABELS``) are refused.
        on_event: called with each event dict as it happens (e.g. to forward it to a log pipeline).
        run: what the watched run fed the cache, ``kvbits.evaluate.data.bos_record``'s ``{"bos": "always" /
            "never"[, "bos_token", "bos_token_id"]}`` (``watch`` passes it): the snapshot's ``"run"`` and the
            gauge ``kvbits_run_info{bos="..."} 1``; ``None`` (the default): neither.
    """

    def __init__(
        self,
        cache: Any,
        policy: FallbackPolicy | None = None,
        *,
        labels: Mapping[str, object] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        from kvbits.cache.layer import QuantizedKVLayer
        from kvbits.cache.static import StaticQuantizedKVCache

        if policy is not None and not isinstance(policy, FallbackPolicy):
            raise TypeError(f"policy must be a FallbackPolicy or None, got {type(policy).__name__}")
        layers = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, QuantizedKVLayer)]
        if not layers:
            hint = (
                "StaticQuantizedKVCache is not supported (its replayed steps are not seen by the host): use "
                "QuantizedKVCache" if isinstance(cache, StaticQuantizedKVCache) else "pass config= to the cache"
            )
            raise ValueError(
                f"CacheMonitor needs a QuantizedKVCache with its layers built ({hint}); "
                f"got {type(cache).__name__} with no quantized layers"
            )
        if cache.scheme.is_identity:  # nothing is ever flushed or measured: a monitor that never says a word
            raise ValueError(
                f"CacheMonitor: scheme {cache.scheme.name!r} stores K/V unquantized; there is no error to monitor"
            )
        if any(layer.flushes_observed for layer in layers):  # a second monitor would silently unhook the first
            raise ValueError(
                "this cache already has a CacheMonitor attached (a cache reports its flushes to one monitor); "
                "detach() that one, or leave its with-block, first"
            )
        self.cache = cache
        self.policy = policy or FallbackPolicy()
        if self.policy.beyond_calibration and self.calibrated_length() is None:  # the signal could never fire
            logger.warning(
                "CacheMonitor: beyond_calibration is set, and the cache's calibration %s, so no layer is ever held "
                "past it: give the cache an artifact that records its max_calibrated_length (a kvbits calibrate "
                "folder), or drop beyond_calibration",
                "does not record the longest context it saw" if getattr(cache, "calibration", None) is not None
                else "is missing (no artifact installed)",
            )
        for name in labels or {}:
            check_label_name(name, " (CacheMonitor labels)", RESERVED_LABELS)
        self.labels = {"scheme": cache.scheme.name, **{k: str(v) for k, v in (labels or {}).items()}}
        self.on_event = on_event
        if run is not None and run.get("bos") not in ("always", "never"):
            raise ValueError(f"run must record \"bos\" as \"always\" or \"never\", got {dict(run)!r}")
        self.run = None if run is None else dict(run)
        self.layers = {layer.layer_idx: layer for layer in layers}
        self.signals = {(i, side): SideSignals() for i in self.layers for side in SIDES}
        self.events: list[dict[str, Any]] = []
        # events said so far, by (signal, action): monotonic (the counter kvbits_fallback_events_total), however the
        # caller trims ``events``
        self._event_counts: Counter = Counter()
        # path -> the last event appended to it (write_events): the ones after it in ``events`` are new to it
        self._events_written: dict[Path, dict[str, Any]] = {}
        self._flushes: Counter = Counter()  # every flush per (layer, side), measured or not (sampling)
        self._blocks: Counter = Counter()  # blocks quantized per (layer, side): a prefill's flush holds many
        self._values: Counter = Counter()  # values quantized per (layer, side), measured or not (clipped_estimated)
        # per (layer, side): (resets, tokens_seen) of the flush observed last, and whether it crossed already. A flush
        # past SLICE_TOKENS is quantized (and observed) in several slices within one update: they are one flush
        self._flush_at: dict[tuple[int, str], tuple[int, int] | None] = {key: None for key in self.signals}
        self._flush_crossed: dict[tuple[int, str], bool] = {key: False for key in self.signals}
        self._beyond_reported: set[int] = set()
        # signals said with action "none" in the current run of consecutive crossing flushes, per (layer, side)
        self._said: dict[tuple[int, str], set[str]] = {key: set() for key in self.signals}
        self._request = {layer.layer_idx: layer.resets for layer in layers}  # reset() count each layer was seen at
        for layer in layers:
            layer.observe_flushes(self._observe)

    # ------------------------------------------------------------------ lifecycle
    def detach(self) -> None:
        """Stop observing (the cache then costs nothing more); signals and events are kept."""
        for layer in self.layers.values():
            layer.observe_flushes(None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------------ observing
    def _observe(self, layer: Any, side: str, x: torch.Tensor, qt: Any) -> None:
        if layer.resets != self._request[layer.layer_idx]:  # cache.reset(): a new request, nothing crossed yet
            self._request[layer.layer_idx] = layer.resets
            self._beyond_reported.discard(layer.layer_idx)
            for s in SIDES:
                self.signals[layer.layer_idx, s].over = 0
                self._said[layer.layer_idx, s].clear()
        key = (layer.layer_idx, side)
        # the same update's flush, quantized in slices (SLICE_TOKENS: a long prefill): one flush, not several
        flush_at = (layer.resets, layer.tokens_seen)
        slice_of_last = self._flush_at[key] == flush_at
        self._flush_at[key] = flush_at
        if not slice_of_last:
            self._flushes[key] += 1
            self._flush_crossed[key] = False
        self._blocks[key] += x.shape[2] // layer.scheme.block
        self._values[key] += x.numel()  # shapes only: no host sync
        if x.shape[0] == 0:  # an empty batch flushed: no sequence to measure, no position to read
            return
        sig = self.signals[key]
        if (self._flushes[key] - 1) % self.policy.sample_every:
            # not measured (sampling): the position past the calibrated length is still read, from the host's count
            self._check(layer, side, sig, None, None, slice_of_last)
            return
        errors = flush_error(x, qt.dequantize(torch.float32), layer.scheme.block).tolist()  # worst block each
        clipped = int(qt.clipped)
        sig.add(errors, x.shape[2], clipped, x.numel(), same_flush=slice_of_last)
        self._check(layer, side, sig, errors, clipped / max(1, x.numel()), slice_of_last)

    def _check(
        self, layer: Any, side: str, sig: SideSignals, errors: list[float] | None, clipped_frac: float | None,
        same_flush: bool,
    ) -> None:  # fmt: skip
        """Read one chunk against the policy; ``same_flush``: a further slice of the flush read last (which counts
        towards ``patience`` once, whichever of its slices crossed). ``errors`` / ``clipped_frac`` ``None``: a flush
        not measured (``sample_every``), read for its position only (past the calibrated length: a host count, no
        device sync); one that does not cross leaves the run of crossing flushes as it was (nothing was measured)."""
        pol = self.policy
        crossed = []
        thr = pol.error_threshold(side)
        worst = worst_index(errors) if errors is not None else None
        if errors is not None and thr is not None and not errors[worst] <= thr:  # NaN crosses too
            crossed.append((f"{side}_error", errors[worst], thr))
        if clipped_frac is not None and pol.clipped_fraction is not None and clipped_frac > pol.clipped_fraction:
            crossed.append(("clipped_fraction", clipped_frac, pol.clipped_fraction))
        longest = self.calibrated_length()
        beyond = longest is not None and layer.tokens_seen > longest
        first_beyond = beyond and layer.layer_idx not in self._beyond_reported
        if first_beyond:
            self._beyond_reported.add(layer.layer_idx)
        if beyond and pol.beyond_calibration:  # every flush past it counts towards patience
            crossed.append(("beyond_calibration", float(layer.tokens_seen), float(longest)))
        elif first_beyond:
            self._event(layer, side, "beyond_calibration", float(layer.tokens_seen), float(longest), None, "none")
        key = (layer.layer_idx, side)
        said = self._said[key]
        if not crossed:
            if not same_flush and errors is not None:
                sig.over = 0
                said.clear()
            return
        if not self._flush_crossed[key]:
            self._flush_crossed[key] = True
            sig.over += 1
        action = "none"
        if layer.held_at is not None:
            action = "already_held"
        elif sig.over >= pol.patience:
            action = self._fall_back(layer)
        for signal, value, threshold in crossed:
            # past the calibrated length: said once per layer, and again when it acts
            if signal == "beyond_calibration" and not (first_beyond or action.startswith("hold")):
                continue
            # a crossing that does nothing (patience not reached, or a layer that can not be held: sliding
            # window; or one crossing again after the request was held; or a later slice of a flush whose layer was
            # held by an earlier slice, already_held) is said once per run of consecutive crossing flushes, not at
            # every flush of a long request or every slice of a long prefill
            if action in ("none", "already_held") and signal in said:
                continue
            said.add(signal)
            # the error is one sequence's (the worst); clipping and the position are the whole batch's: no sequence
            self._event(layer, side, signal, value, threshold, worst if signal == f"{side}_error" else None, action)

    def _fall_back(self, layer: Any) -> str:
        """Hold ``layer`` (or every layer) in full precision; the action's name for the event: ``"none"`` when no
        layer was held by it (a sliding-window layer, which can not be held, crossing after the request was held)."""
        if self.policy.scope == "request":
            held = [i for i, lay in self.layers.items() if lay.held_at is None and lay.hold_full_precision()]
            return "hold_request" if held else "none"
        return "hold_layer" if layer.hold_full_precision() else "none"

    def _event(self, layer: Any, side: str, signal: str, value: float, threshold: float | None,
               sequence: int | None, action: str) -> None:  # fmt: skip
        ev = {"time": time.time(), "layer": layer.layer_idx, "side": side, "signal": signal, "value": value,
              "threshold": threshold, "sequence": sequence, "tokens": layer.tokens_seen, "action": action,
              **self.labels}  # fmt: skip
        self.events.append(ev)
        self._event_counts[signal, action] += 1
        log = logger.warning if action.startswith("hold") else logger.info
        log("%s: layer %d %s %s = %.4g (threshold %s) at token %d: %s", self.labels["scheme"], layer.layer_idx,
            side, signal, value, threshold, layer.tokens_seen, action)  # fmt: skip
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # a failing sink must not stop the forward pass that flushed; said loudly
                logger.exception("CacheMonitor on_event callback failed for event %s", ev)

    def calibrated_length(self) -> int | None:
        """The longest context the cache's calibration artifact saw, or ``None`` (no artifact / unknown)."""
        return self.cache.max_calibrated_length

    # ------------------------------------------------------------------ reading
    def tokens(self) -> int:
        """Tokens the cache has seen (its longest layer)."""
        return max((layer.tokens_seen for layer in self.layers.values()), default=0)

    def held_layers(self) -> list[int]:
        """Layers held in full precision now."""
        return [i for i, layer in self.layers.items() if layer.held_at is not None]

    def snapshot(self) -> dict[str, Any]:
        """Everything the monitor knows, JSON-ready: policy, labels, per layer and side signals, held
        layers, events, the cache's tokens and bytes (``memory_report()``'s totals: ``total_bytes`` of K/V,
        ``linear_state_bytes`` of a hybrid model's states, 0 for a model whose every layer attends). ``clipped``
        counts the measured flushes only (``sample_every``); ``clipped_estimated`` scales it to every flush
        (``clipped_estimate``). A side with no
        measured flush yet has ``None`` errors (not 0: nothing was measured). ``flushes``: blocks quantized;
        ``measured``: flushes measured (a prefill's blocks, quantized at once, are one, read at its worst block)."""
        mem = self.cache.memory_report()
        rows = []
        for (i, side), s in sorted(self.signals.items()):
            rows.append({
                "layer": i, "side": side, "flushes": self._blocks[(i, side)], "measured": s.flushes,
                "tokens_measured": s.tokens, "last_error": s.last if s.flushes else None,
                "max_error": s.worst if s.flushes else None,
                "mean_error": s.total / s.count if s.count else None, "nonfinite_errors": s.nonfinite,
                "clipped": s.clipped, "clipped_estimated": self.clipped_estimate(i, side),
                "clipped_fraction": s.clipped / s.elements if s.elements else 0.0,
                "held_at": self.layers[i].held_at,
            })  # fmt: skip
        return {
            "labels": self.labels,
            "policy": self.policy.to_dict(),
            "tokens": self.tokens(),
            "total_bytes": mem["total_bytes"],
            "linear_state_bytes": mem["linear_state_bytes"],
            "held_layers": self.held_layers(),
            "calibrated_length": self.calibrated_length(),
            "signals": rows,
            "events": list(self.events),
            **({} if self.run is None else {"run": dict(self.run)}),  # what the run fed the cache (watch): its bos
        }

    def clipped_estimate(self, layer: int, side: str) -> float:
        """Values clipped in every flush of ``layer``'s ``side``, estimated: the clipped values counted in the measured
        flushes times all values quantized over those measured (``sample_every`` > 1 reads one flush in N). Scaled by
        values, not by ``sample_every``: a prefill's flush, measured first, holds many blocks, so ``clipped *
        sample_every`` would count it N times. Equal to ``clipped`` when every flush is measured; 0 before any is."""
        s, quantized = self.signals[layer, side], self._values[layer, side]
        if s.elements == quantized or not s.elements:
            return float(s.clipped)
        return s.clipped * quantized / s.elements

    def metric_families(self) -> list[MetricFamily]:
        """The metrics (Prometheus names, ``kvbits_`` prefix; labels ``layer``, ``side`` and the constant ones).
        ``kvbits_linear_state_bytes`` only for a cache holding state layers (a hybrid model), as
        ``kvbits_tokens_beyond_calibration`` only for a calibrated one."""
        base = self.labels
        f_err = MetricFamily("kvbits_flush_relative_error", "Relative error of the last measured flushed block "
                             "(worst sequence of the batch)", "gauge")  # fmt: skip
        f_max = MetricFamily(
            "kvbits_flush_relative_error_max", "Largest relative error of a flushed block", "gauge"
        )
        f_hist = MetricFamily("kvbits_flush_relative_error_per_sequence", "Relative error of each measured "
                              "flushed block and sequence", "histogram")  # fmt: skip
        f_nf = MetricFamily("kvbits_flush_nonfinite_errors_total", "Measured flushed blocks and sequences whose "
                            "relative error was NaN or inf (not in the histogram)", "counter")  # fmt: skip
        f_fl = MetricFamily("kvbits_flushes_total", "Blocks quantized", "counter")
        f_clip = MetricFamily("kvbits_clipped_values_total", "Values saturated against static scales or integer "
                              "zero-points, in the measured flushes only (sample_every > 1 skips the others)",
                              "counter")  # fmt: skip
        # a gauge, not a counter: an estimate goes down when a measured flush clips less than the ones before it
        f_clip_est = MetricFamily("kvbits_clipped_values_estimated", "Values saturated against static scales or "
                                  "integer zero-points in every flush, estimated: kvbits_clipped_values_total scaled "
                                  "by the values quantized over the values measured (equal to it when sample_every "
                                  "is 1)", "gauge")  # fmt: skip
        f_held = MetricFamily(
            "kvbits_layer_held", "1 when the layer is held in full precision (fallback)", "gauge"
        )
        for (i, side), s in sorted(self.signals.items()):
            lab = {**base, "layer": i, "side": side}
            f_fl.add(self._blocks[(i, side)], lab)
            f_clip.add(s.clipped, lab)
            f_clip_est.add(self.clipped_estimate(i, side), lab)
            if s.flushes:
                f_err.add(s.last, lab)
                f_max.add(s.worst, lab)
                for bound, n in zip(ERROR_BUCKETS, s.buckets, strict=True):
                    f_hist.add(n, {**lab, "le": repr(bound)}, "_bucket")
                f_hist.add(s.count, {**lab, "le": "+Inf"}, "_bucket")
                f_hist.add(s.total, lab, "_sum")
                f_hist.add(s.count, lab, "_count")
                f_nf.add(s.nonfinite, lab)
        for i, layer in sorted(self.layers.items()):
            f_held.add(int(layer.held_at is not None), {**base, "layer": i})
        f_ev = MetricFamily(
            "kvbits_fallback_events_total", "Thresholds crossed (the events), by signal and action", "counter"
        )
        for (signal, action), n in sorted(self._event_counts.items()):  # never down: not read from the trimmable list
            f_ev.add(n, {**base, "signal": signal, "action": action})
        mem = self.cache.memory_report()
        f_tok = MetricFamily("kvbits_cache_tokens", "Tokens seen by the cache (longest layer)", "gauge")
        f_tok.add(self.tokens(), base)
        f_bytes = MetricFamily(
            "kvbits_cache_bytes", "Bytes the cache stores (memory_report total_bytes)", "gauge"
        )
        f_bytes.add(mem["total_bytes"], base)
        fams = [f_err, f_max, f_hist, f_nf, f_fl, f_clip, f_clip_est, f_held, f_ev, f_tok, f_bytes]
        if mem["linear_layers"]:  # a hybrid model's conv / linear-attention / Mamba states: not in kvbits_cache_bytes
            f_state = MetricFamily("kvbits_linear_state_bytes", "Bytes of a hybrid model's convolution, linear-attention "
                                   "and state-space states, unquantized, outside kvbits_cache_bytes (memory_report "
                                   "linear_state_bytes)", "gauge")  # fmt: skip
            f_state.add(mem["linear_state_bytes"], base)
            fams.append(f_state)
        longest = self.calibrated_length()
        if longest is not None:
            f_cal = MetricFamily("kvbits_tokens_beyond_calibration", "Positions past the longest calibrated "
                                 "context", "gauge")  # fmt: skip
            f_cal.add(max(0, f_tok.samples[0][2] - longest), base)
            fams.append(f_cal)
        if self.run is not None:  # an info gauge: the other families' names and label sets stay as they were
            f_run = MetricFamily("kvbits_run_info", "The watched run's input: bos is \"always\" when each sequence "
                                 "started with the tokenizer's BOS token, \"never\" for raw text", "gauge")  # fmt: skip
            f_run.add(1, {**base, "bos": self.run["bos"]})
            fams.append(f_run)
        return fams

    def prometheus(self) -> str:
        """The metrics in Prometheus text exposition format."""
        return prometheus_text(self.metric_families())

    def write_prometheus(self, path: str | os.PathLike[str]) -> Path:
        """Write ``prometheus()`` atomically to ``path`` (node_exporter's textfile collector: ``*.prom``)."""
        return write_textfile(self.prometheus(), path)

    def write_events(self, path: str | os.PathLike[str]) -> Path:
        """Append the events this monitor has not yet written to ``path`` as strict JSON lines (``strict_json``: an
        infinite error is the string ``"+Inf"``), creating its missing folders as ``write_prometheus`` does: an
        exporter may call it after every step without writing an event twice, and may trim ``events`` from the
        front between calls (``events.clear()``): the ones after the event it appended last are new."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        key = path.resolve()
        last = self._events_written.get(key)
        # after the event written last (by identity, from the end: the new ones are few); not there: all are new
        start = next((i + 1 for i in range(len(self.events) - 1, -1, -1) if self.events[i] is last), 0)
        with path.open("a", encoding="utf-8") as f:
            for ev in self.events[start:]:
                f.write(strict_json(ev) + "\n")
        if self.events:
            self._events_written[key] = self.events[-1]
        return path
