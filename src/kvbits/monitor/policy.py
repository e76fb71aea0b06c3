"""When to fall back to full precision, and for what: a layer or the whole request."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SCOPES", "FallbackPolicy"]

SCOPES = ("layer", "request")


def _threshold(name: str, value: float | None) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)  # numpy's float32 too, as float64 (a float) always was
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")


@dataclass(frozen=True)
class FallbackPolicy:
    """Thresholds on the flush signals (``kvbits.monitor.signals``) and what crossing one does.

    Attributes:
        key_error: hold when a flushed key block's relative error (worst sequence) exceeds this.
        value_error: the same for values.
        clipped_fraction: hold when more than this fraction of a flushed block's values saturated against
            static (calibrated) scales: the data left the calibrated range; or, under vLLM's integer zero-points
            (``vllm-int4``), lay past the far end of a token's range that excludes 0.
        beyond_calibration: hold when a flush happens past the longest calibrated context (the cache's
            ``calibration_report()``); always reported as an event either way.
        scope: ``"layer"``: hold the layer that crossed (``QuantizedKVLayer.hold_full_precision``);
            ``"request"``: hold every layer of the cache (the whole batch it serves).
        patience: consecutive measured flushes over a threshold, per layer and side, before acting. A decode
            flush quantizes one block; a prefill's flush quantizes many at once and counts once (read at its
            worst block), as ``sample_every`` counts it once: ``clipped_fraction`` and ``beyond_calibration``
            are read per flush, not per block.
        sample_every: measure one flush in this many per layer and side (1: all). Each measurement
            dequantizes the block once and reads a few numbers back to the host. ``beyond_calibration`` reads
            every flush however it is sampled (a position count the host keeps: no measurement, no sync).

    ``None`` thresholds are off; a policy with none only records signals (``CacheMonitor`` without a policy
    does the same).
    """

    key_error: float | None = None
    value_error: float | None = None
    clipped_fraction: float | None = None
    beyond_calibration: bool = False
    scope: str = "layer"
    patience: int = 1
    sample_every: int = 1

    def __post_init__(self) -> None:
        for name in ("key_error", "value_error", "clipped_fraction"):
            value = getattr(self, name)
            _threshold(name, value)
            if value is not None:  # a Python float: numpy's float32 is no JSON number (snapshot(), write_events)
                object.__setattr__(self, name, float(value))
        if self.clipped_fraction is not None and self.clipped_fraction > 1:
            raise ValueError(f"clipped_fraction is a fraction in [0, 1], got {self.clipped_fraction}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        for name in ("patience", "sample_every"):
            v = getattr(self, name)
            # numpy's int64 too, as a Python int (JSON-ready), as the thresholds take numpy's floats
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.beyond_calibration, bool):
            raise TypeError(f"beyond_calibration must be a bool, got {self.beyond_calibration!r}")

    def error_threshold(self, side: str) -> float | None:
        """``key_error`` or ``value_error``."""
        return self.key_error if side == "key" else self.value_error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
