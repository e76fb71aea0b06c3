"""Monitor and fall back: online signals of a quantized cache, metrics for operations, precision fallback.

``CacheMonitor(cache, FallbackPolicy(...))`` measures each block as it is quantized, exports Prometheus
text (``prometheus()``, ``write_prometheus``) and JSON (``snapshot()``, ``write_events``), and holds a
layer (or the whole request) in full precision when a threshold is crossed. ``watch`` (``kvbits monitor``)
runs it over real text before deployment.
"""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
    from kvbits.monitor.export import MetricFamily, prometheus_text, write_textfile
    from kvbits.monitor.monitor import CacheMonitor
    from kvbits.monitor.policy import FallbackPolicy
    from kvbits.monitor.signals import ERROR_BUCKETS, flush_error
    from kvbits.monitor.watch import watch

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "MetricFamily": "export",
        "prometheus_text": "export",
        "write_textfile": "export",
        "CacheMonitor": "monitor",
        "FallbackPolicy": "policy",
        "ERROR_BUCKETS": "signals",
        "flush_error": "signals",
        "watch": "watch",
    },
)

__all__ = ["ERROR_BUCKETS", "CacheMonitor", "FallbackPolicy", "MetricFamily", "flush_error", "prometheus_text",
           "watch", "write_textfile"]  # fmt: skip
