"""Monitor and fall back: online signals of a quantized cache, metrics for operations, precision fallback.

``CacheMonitor(cache, FallbackPolicy(...))`` measures each block as it is quantized, exports Prometheus
text (``prometheus()``, ``write_prometheus``) and JSON (``snapshot()``, ``write_events``), and holds a
layer (or the whole request) in full precision when a threshold is crossed. ``watch`` (``kvbits monitor``)
runs it over real text before deployment.
"""

from kvbits.monitor.export import MetricFamily, prometheus_text, write_textfile
from kvbits.monitor.monitor import CacheMonitor
from kvbits.monitor.policy import FallbackPolicy
from kvbits.monitor.signals import ERROR_BUCKETS, flush_error
from kvbits.monitor.watch import watch

__all__ = ["ERROR_BUCKETS", "CacheMonitor", "FallbackPolicy", "MetricFamily", "flush_error", "prometheus_text",
           "watch", "write_textfile"]  # fmt: skip
