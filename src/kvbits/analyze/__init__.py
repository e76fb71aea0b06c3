"""Analyze: are there outlier channels in K and V, before and after RoPE? Per layer, with numbers.

``analyze(model, windows)`` runs a stock transformers model on calibration windows with forward
hooks (``collect``), keeps streaming per-channel statistics (``stats``), finds outlier channels and
the quantization range they consume, compares int4 per-token and per-channel key SQNR
(``outliers``), and recommends a scheme following the decision flow. ``plots`` draws KVQuant-style
channel-magnitude heatmaps (matplotlib, optional). CLI: ``kvbits analyze``.
"""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
    from kvbits.analyze.collect import (
        ANALYSIS_VERSION,
        Analysis,
        LayerAnalysis,
        analysis_sites,
        analyze,
        attention_sites,
        kv_hooks,
    )
    from kvbits.analyze.outliers import (
        DEFAULT_LAYER_FRACTION,
        DEFAULT_THRESHOLD,
        int_sqnr,
        outlier_channels,
        range_used_per_token,
        recommend,
        sqnr_db,
    )
    from kvbits.analyze.stats import BlockReservoir, ChannelStats, TensorReport

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "ANALYSIS_VERSION": "collect",
        "Analysis": "collect",
        "LayerAnalysis": "collect",
        "analysis_sites": "collect",
        "analyze": "collect",
        "attention_sites": "collect",
        "kv_hooks": "collect",
        "DEFAULT_LAYER_FRACTION": "outliers",
        "DEFAULT_THRESHOLD": "outliers",
        "int_sqnr": "outliers",
        "outlier_channels": "outliers",
        "range_used_per_token": "outliers",
        "recommend": "outliers",
        "sqnr_db": "outliers",
        "BlockReservoir": "stats",
        "ChannelStats": "stats",
        "TensorReport": "stats",
    },
)

__all__ = [
    "ANALYSIS_VERSION",
    "DEFAULT_LAYER_FRACTION",
    "DEFAULT_THRESHOLD",
    "Analysis",
    "BlockReservoir",
    "ChannelStats",
    "LayerAnalysis",
    "TensorReport",
    "analysis_sites",
    "analyze",
    "attention_sites",
    "int_sqnr",
    "kv_hooks",
    "outlier_channels",
    "range_used_per_token",
    "recommend",
    "sqnr_db",
]
