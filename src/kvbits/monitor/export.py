"""Metrics in the formats operations teams scrape: Prometheus text exposition (0.0.4) and JSON.

``prometheus_text(families)`` renders metric families; ``write_textfile`` writes them atomically for
node_exporter's textfile collector (``--collector.textfile.directory``), the usual way a batch or
sidecar process hands metrics to Prometheus without serving HTTP. ``strict_json`` writes events and
snapshots as strict JSON (RFC 8259), non-finite numbers spelled as Prometheus spells them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvbits._files import write_text_atomic
from kvbits._json import dumps

__all__ = [
    "EVENT_FIELDS",
    "MONITOR_LABELS",
    "RESERVED_LABELS",
    "MetricFamily",
    "check_label_name",
    "prometheus_text",
    "strict_json",
    "write_textfile",
]

TYPES = ("gauge", "counter", "histogram")


@dataclass
class MetricFamily:
    """One metric: ``name``, ``help``, ``type`` and its samples ``(suffix, labels, value)``; ``suffix`` is
    ``""`` or, for histograms, ``"_bucket"`` / ``"_sum"`` / ``"_count"``."""

    name: str
    help: str
    type: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"metric type must be one of {TYPES}, got {self.type!r}")
        name = self.name
        if not name or not all((c.isascii() and c.isalnum()) or c in "_:" for c in name) or name[0].isdigit():
            raise ValueError(f"invalid Prometheus metric name {name!r}: expected ASCII letters, digits, _ and :, "
                             "not starting with a digit")  # fmt: skip

    def add(self, value: float, labels: Mapping[str, object] | None = None, suffix: str = "") -> None:
        self.samples.append((suffix, {k: str(v) for k, v in (labels or {}).items()}, float(value)))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v == int(v) and abs(v) < 2**53 else repr(v)


MONITOR_LABELS = ("scheme", "layer", "side", "signal", "action", "le", "bos")
"""Labels ``CacheMonitor`` sets itself (``le``: histogram buckets; ``bos``: ``kvbits_run_info``'s, with ``run=``);
a constant label of the same name would replace them (the scheme, which layer, which signal) in its metrics and
events."""
EVENT_FIELDS = ("time", "value", "threshold", "sequence", "tokens")
"""The fields of a ``CacheMonitor`` event besides its labels (each event carries the constant labels too);
``sequence``: the batch row of a ``key_error`` / ``value_error`` event (the worst), ``None`` for the signals read
over the whole batch (``clipped_fraction``, ``beyond_calibration``)."""
RESERVED_LABELS = MONITOR_LABELS + EVENT_FIELDS
"""What a ``CacheMonitor``'s constant labels (``labels=``, ``kvbits monitor --label``) may not be named."""


def strict_json(obj: object, indent: int | None = None) -> str:
    """``obj`` as strict JSON: a non-finite float becomes the string ``"+Inf"``, ``"-Inf"`` or ``"NaN"`` (the
    exposition format's spelling), not Python's bare ``Infinity`` / ``NaN`` tokens, which jq, Go's
    ``encoding/json`` and ``JSON.parse`` reject (an error of a zero block that was not reproduced exactly is
    ``inf``, ``kvbits.monitor.signals.flush_error``)."""
    return dumps(obj, indent=indent)


def check_label_name(name: str, where: str = "", reserved: tuple[str, ...] = ()) -> None:
    """``ValueError`` unless ``name`` is a valid Prometheus label name (``[a-zA-Z_][a-zA-Z0-9_]*``, not starting
    with ``__``, which Prometheus keeps for itself) and not one of ``reserved`` (names the caller sets itself)."""
    if not isinstance(name, str):
        raise TypeError(f"a Prometheus label name must be a str{where}, got {type(name).__name__} {name!r}")
    if not name or not all((c.isascii() and c.isalnum()) or c == "_" for c in name) or name[0].isdigit():
        raise ValueError(
            f"invalid Prometheus label name {name!r}{where}: expected letters, digits and _, not starting with a digit"
        )
    if name.startswith("__"):
        raise ValueError(f"invalid Prometheus label name {name!r}{where}: names starting with __ are Prometheus' own")
    if name in reserved:
        raise ValueError(
            f"label name {name!r}{where} is set by kvbits itself (reserved: {', '.join(reserved)}); choose another name"
        )


def prometheus_text(families: Iterable[MetricFamily]) -> str:
    """The text exposition format: ``# HELP`` / ``# TYPE`` lines, then one line per sample. ``ValueError`` for a
    family name given twice or two samples of one series (same suffix and labels): Prometheus' parser refuses a
    second ``TYPE`` line for a name, and its scrape drops a second sample of a series as a duplicate."""
    lines = []
    names: set[str] = set()
    for fam in families:
        if fam.name in names:
            raise ValueError(f"metric family {fam.name!r} is given twice; each name may appear once")
        names.add(fam.name)
        series: set[tuple[str, frozenset[tuple[str, str]]]] = set()
        for suffix, labels, _value in fam.samples:
            key = (suffix, frozenset(labels.items()))
            if key in series:
                raise ValueError(f"metric {fam.name}{suffix} has two samples with labels {labels}; each series may "
                                 "appear once")  # fmt: skip
            series.add(key)
        lines.append(f"# HELP {fam.name} {fam.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        lines.append(f"# TYPE {fam.name} {fam.type}")
        for suffix, labels, value in fam.samples:
            for k in labels:
                check_label_name(k, f" in {fam.name}")
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(
                f"{fam.name}{suffix}{{{lab}}} {_number(value)}"
                if lab
                else f"{fam.name}{suffix} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def write_textfile(text: str, path: str | os.PathLike[str]) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file in the same folder, then a rename), so a
    collector never reads half a file, in UTF-8 (the exposition format's encoding) whatever the locale. The name
    should end in ``.prom`` for node_exporter."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # readable by a collector running as another user; the temporary name does not end in .prom
    return write_text_atomic(path, text)
