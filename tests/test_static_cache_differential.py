"""The static cache against an independent model of its scheme: which tokens stay in full precision (sinks, a
windowed scheme's last ``residual`` to ``residual + block - 1``), which are quantized in whole blocks, at which positions,
across prefills, decode steps, chunks, reorders, resets and steps whose host counts are off (replays).

``_static_reference.run_static_scenario`` draws a scheme ``StaticQuantizedKVCache`` holds and a random sequence of
updates and batch ops from a seed and checks the K/V returned after every update of every layer against
``_cache_reference.RefLayer`` (``kvbits.quant.quantize`` of each block alone, pre-RoPE keys un-rotated at the model's
positions). The seeds below (from a scan of seeds 0..299, all passing) cover every feature in ``FEATURES`` between them;
``test_seeds_cover_every_feature`` keeps it so. They catch a planted off-by-one in the layer's bookkeeping (the window's
flush one token late, a prefill's sink split or the window's ring slots shifted by one) on most seeds.
Reproduce a failure with ``PYTHONPATH=src:tests python -c "import _static_reference as r; r.run_static_scenario(S)"``.
"""

from __future__ import annotations

import functools

import pytest
from _static_reference import FEATURES, StaticScenario, run_static_scenario

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = (1, 2, 5, 6, 14, 17, 18, 20, 27, 31, 32, 35, 42, 43, 52, 57)


@functools.cache
def _scenario(seed: int) -> StaticScenario:
    return run_static_scenario(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_static_cache_matches_the_reference_model(seed):
    """K/V returned and materialized at the positions written, mask sizes and lengths after every update."""
    _scenario(seed)


def test_seeds_cover_every_feature():
    covered = set().union(*(_scenario(seed).features for seed in SEEDS))
    assert covered >= FEATURES, f"no seed covers {sorted(FEATURES - covered)}"
