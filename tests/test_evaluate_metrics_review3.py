"""Review of kvbits.evaluate.metrics: confidence intervals and aggregation against independent float64 sums."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbits.evaluate import metrics as M


def test_a_bucket_of_one_resampling_unit_has_no_interval_not_a_zero_width_one():
    """One window whose last bucket holds <= 128 positions is one bootstrap unit: every resample is that unit,
    and the interval collapsed onto the point estimate ([3.98 %, 3.98 %] for a ΔPPL with a 5.6 % standard
    error). It is NaN (the report prints "CI n/a"); the other buckets keep theirs."""
    rng = np.random.default_rng(0)
    W, N = 1, 1099  # buckets [0, 1024) (8 chunks) and [1024, 1099) (one chunk of 75)
    nll_ref = rng.uniform(1, 4, (W, N))
    nll = nll_ref + rng.normal(0.05, 0.5, (W, N))
    per = {"nll": nll, "nll_ref": nll_ref, "kl": np.zeros((W, N)), "top1": np.ones((W, N))}
    full, tail = M.summarize(per)["buckets"]
    assert (tail["lo"], tail["hi"], tail["tokens"]) == (1024, 1099, 75)
    assert tail["delta_rel"] == pytest.approx(math.expm1((nll - nll_ref)[0, 1024:].mean()))
    assert all(math.isnan(x) for x in tail["delta_rel_ci"])
    lo, hi = full["delta_rel_ci"]
    assert lo < full["delta_rel"] < hi
    # two windows of the same short bucket: two units, an interval
    assert all(math.isfinite(x) for x in M.bootstrap_delta_rel(rng.normal(0, 1, (2, 75))))
    assert all(math.isnan(x) for x in M.bootstrap_delta_rel(rng.normal(0, 1, (1, 128))))
