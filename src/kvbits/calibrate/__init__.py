"""Offline calibration: static per-channel pre-RoPE key scales and Fisher-weighted NUQ codebooks
(KVQuant), channel means and smoothing factors of centred / smoothed per-token keys (``int*-token-smooth``), and
static FP8 K/V scales per layer or per KV head (vLLM's ``k_scale`` / ``v_scale``; ``kvbits.export``).

``calibrate(model, data, scheme, out_dir=...)`` writes an artifact; ``load_calibration(dir, ...)``
reads and validates it; ``compose_artifact(mix, artifacts)`` puts a mixed per-layer scheme's together
from those of the schemes its layers use; ``CalibrationArtifact.quantize_kwargs(layer, side)`` gives what
``kvbits.quant.quantize`` needs for that layer's keys or values.
"""

from kvbits.calibrate.artifact import (
    ARTIFACT_FORMAT_VERSION,
    CalibrationArtifact,
    checked_artifact,
    load_calibration,
    spec_calibratable,
    spec_needs_calibration,
)
from kvbits.calibrate.calibrate import CalibrationSamples, calibrate, collect_samples, fit_artifact
from kvbits.calibrate.compose import compose_artifact
from kvbits.calibrate.fit import artifact_from_samples, fit_side
from kvbits.calibrate.kmeans import fit_codebook, weighted_kmeans_1d

__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "CalibrationArtifact",
    "CalibrationSamples",
    "artifact_from_samples",
    "calibrate",
    "checked_artifact",
    "collect_samples",
    "compose_artifact",
    "fit_artifact",
    "fit_codebook",
    "fit_side",
    "load_calibration",
    "spec_calibratable",
    "spec_needs_calibration",
    "weighted_kmeans_1d",
]
