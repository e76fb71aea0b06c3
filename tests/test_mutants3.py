"""Tests added by mutation testing (testquality3): each one kills a mutant the suite let through."""

from __future__ import annotations

import numpy as np
import pytest

from kvbits.evaluate.metrics import attn_entropy_buckets, attn_error_buckets, bootstrap_delta_rel, summarize


def test_attn_error_buckets_average_each_bucket_over_windows_and_its_positions() -> None:
    """``attn_error_buckets`` reads ``(W, T)``: a bucket is the mean over every window of its query positions
    ``[lo, hi)``. Mutant killed: slicing the window axis (``e[lo:hi]``), which the end-to-end tests only caught by
    luck (an empty slice's NaN with fewer windows than positions); with more windows it averaged the wrong rows."""
    W, n = 1500, 1200  # more windows than positions: a slice of the wrong axis is not empty
    e = np.zeros((W, n + 1))
    e[:, :1024] = 1.0
    e[:, 1024:] = 3.0
    e[0] += 10.0  # one window off: its positions count 1 / W of every bucket
    (row,) = attn_error_buckets({5: e}, n, first=0)
    assert row["layer"] == 5
    assert [(b["lo"], b["hi"]) for b in row["buckets"]] == [(0, 1024), (1024, n)]
    assert [b["rel_err"] for b in row["buckets"]] == pytest.approx([1.0 + 10.0 / W, 3.0 + 10.0 / W])
    # scored from ``first``: the positions before it are left out of its bucket
    (row,) = attn_error_buckets({0: e}, n, first=1000)
    assert [(b["lo"], b["hi"]) for b in row["buckets"]] == [(1000, 1024), (1024, n)]
    assert [b["rel_err"] for b in row["buckets"]] == pytest.approx([1.0 + 10.0 / W, 3.0 + 10.0 / W])


def test_attn_entropy_buckets_delta_is_quantized_minus_reference() -> None:
    """``delta = entropy - entropy_ref`` per bucket (> 0: flatter with quantized K/V), with the same axes as
    ``attn_error_buckets``."""
    W, n = 1100, 1030
    e = np.full((W, n + 1), 2.0)
    r = np.full((W, n + 1), 1.5)
    e[:, 1024:] = 1.0
    (row,) = attn_entropy_buckets({1: e}, {1: r}, n)
    assert [(b["lo"], b["hi"]) for b in row["buckets"]] == [(0, 1024), (1024, n)]
    got = [[b["entropy"], b["entropy_ref"], b["delta"]] for b in row["buckets"]]
    assert np.allclose(got, [[2.0, 1.5, 0.5], [1.0, 1.5, -0.5]])


def test_summarize_draws_each_buckets_interval_from_its_own_seed() -> None:
    """Bucket ``i``'s ``delta_rel_ci`` is ``bootstrap_delta_rel`` of its differences with ``seed + i``: buckets of
    as many resampling units drawn with one seed resample the same chunk indices, so their intervals' errors move
    together (every bucket too wide or too narrow at once). Mutant killed: ``seed=seed`` for every bucket."""
    rng = np.random.default_rng(3)
    W, N = 2, 2048 + 300
    per_token = {
        "nll": rng.normal(2.0, 0.5, (W, N)),
        "nll_ref": rng.normal(2.0, 0.5, (W, N)),
        "kl": np.zeros((W, N)),
        "top1": np.ones((W, N)),
    }
    out = summarize(per_token, seed=7, resamples=200)
    d = per_token["nll"] - per_token["nll_ref"]
    assert len(out["buckets"]) == 3
    for i, b in enumerate(out["buckets"]):
        want = bootstrap_delta_rel(d[:, b["lo"] : b["hi"]], seed=7 + i, resamples=200)
        assert b["delta_rel_ci"] == pytest.approx(list(want))
