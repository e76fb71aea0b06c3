"""The dynamic cache against an independent model of its scheme: which tokens stay in full precision (sinks, the
last residual window), which are quantized in whole blocks, and the bytes held, across appends and batch ops.

``_cache_reference.run_scenario`` draws a random scheme and a random sequence of updates, crops, reorders,
batch repeats / selects and holds from a seed, and checks the cache after every update of every layer. The seeds
below were picked (from a scan of seeds 0..99; seeds 0..399 all pass) to cover every feature in ``FEATURES`` between them:
per-token and per-channel-block int codes, FP8, NUQ, static scales, centre / smooth, outliers, Hadamard
rotation, integer zero-points, fp32 scales, pre-RoPE keys (with a left-padded batch's position ids), a mixed
scheme, a sliding layer that quantizes and one that falls back, a ``max_cache_len`` reservation outgrown, a
workspace, a hold, Falcon-style repeated heads and lazy checks; ``test_seeds_cover_every_feature`` keeps it so.
Reproduce a failure with ``PYTHONPATH=src:tests python -c "import _cache_reference as r; r.run_scenario(SEED)"``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _cache_reference import FEATURES, Scenario, run_scenario

from kvbits.cache import QuantizedKVCache
from kvbits.schemes.spec import KVScheme, TensorSpec

pytestmark = pytest.mark.usefixtures("one_thread")

INT4 = TensorSpec(kind="int", bits=4, fmt=None, granularity="token")
SEEDS = (10, 25, 27, 28, 34, 70, 72, 84, 95, 97)


@functools.cache
def _scenario(seed: int) -> Scenario:
    return run_scenario(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_cache_matches_the_reference_model(seed):
    """K/V returned and materialized, token split, walked bytes and plan bytes after every update."""
    _scenario(seed)


def test_seeds_cover_every_feature():
    covered = set().union(*(_scenario(seed).features for seed in SEEDS))
    assert covered == FEATURES, f"no seed covers {sorted(FEATURES - covered)}"


def test_held_layer_split_counts_sinks_filled_after_the_hold():
    """A layer held before its sinks are complete still fills them (``update`` does), and ``expected_split`` says so:
    it counted those tokens as buffer (sink 2, full 1 where the layer holds 3 sinks)."""
    cache = QuantizedKVCache(scheme=KVScheme("s4", key=INT4, value=INT4, sinks=4, residual=2, block=2), num_layers=1)
    layer = cache.layers[0]
    cache.update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), 0)
    assert layer.hold_full_precision()
    for _ in range(5):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    rep = layer.report()
    split = layer.expected_split()
    assert (rep["sink_tokens"], rep["quantized_tokens"], rep["full_tokens"]) == (4, 0, 3)
    assert (split.sink, split.quantized, split.full) == (4, 0, 3)
