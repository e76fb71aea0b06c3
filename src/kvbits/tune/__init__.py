"""Per-layer mixed precision chosen from measured sensitivity (``kvbits tune``)."""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
    from kvbits.tune.search import (
        EXACT,
        TuneResult,
        choose_layers,
        choose_layers_by_bytes,
        layer_sensitivity,
        marginal_sensitivity,
        tune,
    )

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "EXACT": "search",
        "TuneResult": "search",
        "choose_layers": "search",
        "choose_layers_by_bytes": "search",
        "layer_sensitivity": "search",
        "marginal_sensitivity": "search",
        "tune": "search",
    },
)

__all__ = [
    "EXACT", "TuneResult", "choose_layers", "choose_layers_by_bytes", "layer_sensitivity", "marginal_sensitivity",
    "tune",
]
