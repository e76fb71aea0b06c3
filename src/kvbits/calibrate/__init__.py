"""Offline calibration: static per-channel pre-RoPE key scales and Fisher-weighted NUQ codebooks
(KVQuant), channel means and smoothing factors of centred / smoothed per-token keys (``int*-token-smooth``), and
static FP8 K/V scales per layer or per KV head (vLLM's ``k_scale`` / ``v_scale``; ``kvbits.export``).

``calibrate(model, data, scheme, out_dir=...)`` writes an artifact; ``load_calibration(dir, ...)``
reads and validates it; ``compose_artifact(mix, artifacts)`` puts a mixed per-layer scheme's together
from those of the schemes its layers use; ``CalibrationArtifact.quantize_kwargs(layer, side)`` gives what
``kvbits.quant.quantize`` needs for that layer's keys or values.
"""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
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

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "ARTIFACT_FORMAT_VERSION": "artifact",
        "CalibrationArtifact": "artifact",
        "checked_artifact": "artifact",
        "load_calibration": "artifact",
        "spec_calibratable": "artifact",
        "spec_needs_calibration": "artifact",
        "CalibrationSamples": "calibrate",
        "calibrate": "calibrate",
        "collect_samples": "calibrate",
        "fit_artifact": "calibrate",
        "compose_artifact": "compose",
        "artifact_from_samples": "fit",
        "fit_side": "fit",
        "fit_codebook": "kmeans",
        "weighted_kmeans_1d": "kmeans",
    },
)

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
