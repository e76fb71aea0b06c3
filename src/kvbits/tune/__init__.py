"""Per-layer mixed precision chosen from measured sensitivity (``kvbits tune``)."""

from kvbits.tune.search import (
    EXACT,
    TuneResult,
    choose_layers,
    choose_layers_by_bytes,
    layer_sensitivity,
    marginal_sensitivity,
    tune,
)

__all__ = [
    "EXACT", "TuneResult", "choose_layers", "choose_layers_by_bytes", "layer_sensitivity", "marginal_sensitivity",
    "tune",
]
