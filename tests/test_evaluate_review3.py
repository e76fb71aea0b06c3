"""Evaluation core, third review: measured numbers that were wrong (``kvbits.evaluate.metrics``, ``runner``)."""

from __future__ import annotations

import pytest
import torch

from kvbits.evaluate import metrics as M

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def test_small_kl_is_exact_not_float32_rounding():
    """The KL of two nearly equal distributions is a sum of differences of log-probabilities (~-20 each) whose
    float32 rounding does not cancel: a KL of 2.5e-7 (an identity or 8-bit scheme) came out with a median
    per-token error of 50 % (and of 2.5e-9, 13x too large). From the same float32 logits, computed in float64, it
    matches the exact KL of the distributions the model outputs."""
    torch.manual_seed(0)
    V, H, N = 4000, 64, 64
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.mul_(20)  # logits of a few tens, as a real vocabulary's
    h_ref = torch.randn(N, H)
    h = h_ref + 3e-5 * torch.randn(N, H)
    (rec,) = M.token_metrics(head, h_ref, [h], torch.randint(0, V, (N,)))
    lp_ref = torch.log_softmax(head(h_ref).double(), -1)  # the float32 logits, exactly
    lp = torch.log_softmax(head(h).double(), -1)
    exact = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    assert 1e-9 < float(exact.mean()) < 1e-6
    rel = (rec["kl"].double() - exact).abs() / exact
    assert float(rel.max()) < 1e-4, float(rel.median())


def test_kl_divergence_masked_entries_and_shapes():
    """The one KL helper (token metrics, needle scoring, the attention benchmark): entries of probability 0 in the
    reference (masked keys, ``-inf`` in both) add nothing instead of NaN; NaN log-probabilities stay NaN; shapes
    that differ are refused."""
    logits = torch.tensor([[2.0, 1.0, -float("inf")], [0.5, 0.5, 0.5]])
    lp_ref = M.exact_log_softmax(logits)
    assert lp_ref.dtype == torch.float64
    lp = M.exact_log_softmax(logits + torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, 0.2]]))
    kl = M.kl_divergence(lp_ref, lp)
    p, q = lp_ref.exp(), lp.exp()
    want = torch.stack([(p[0, :2] * (p[0, :2] / q[0, :2]).log()).sum(), (p[1] * (p[1] / q[1]).log()).sum()])
    assert torch.allclose(kl, want, rtol=1e-12) and float(M.kl_divergence(lp_ref, lp_ref).abs().max()) == 0.0
    assert torch.isnan(M.kl_divergence(lp_ref, torch.full_like(lp, float("nan")))).all()
    with pytest.raises(ValueError, match="one shape"):
        M.kl_divergence(lp_ref, lp[:1])

