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


def _stored_run(out, request: dict) -> None:
    """A finished ``kvbits eval`` folder of ``request`` as ``outputs`` writes it."""
    import json

    from kvbits.evaluate.request import config_hash

    out.mkdir()
    chash = config_hash(request)
    (out / "config.json").write_text(json.dumps({"config_hash": chash, "request": request}))
    (out / "summary.json").write_text(json.dumps({"results": [{"scheme": "int8-token", "kl": 1.2e-6}]}))
    (out / "DONE").write_text(chash + "\n")


def test_a_run_from_before_float64_kl_is_recomputed_not_reused(tmp_path, caplog):
    """A finished run of output version 1 took its KL from float32 log-probabilities; the same request now is
    recomputed in its folder (logged) instead of served from it. A run of a newer version is still refused, and
    one that differs in anything else too."""
    from kvbits.evaluate.outputs import OtherRunError, _check_out_dir
    from kvbits.evaluate.request import OUTPUT_VERSION, config_hash

    request = {"version": OUTPUT_VERSION, "model": "m", "data": "d", "context": 256, "schemes": ["int8-token"]}
    chash = config_hash(request)
    _stored_run(tmp_path / "v1", {**request, "version": 1})
    with caplog.at_level("WARNING", logger="kvbits.evaluate.outputs"):
        assert _check_out_dir(tmp_path / "v1", chash, False, request) is None
    assert "older kvbits (output version 1" in caplog.text
    _stored_run(tmp_path / "same", request)
    assert _check_out_dir(tmp_path / "same", chash, False, request)["results"][0]["kl"] == 1.2e-6
    _stored_run(tmp_path / "newer", {**request, "version": OUTPUT_VERSION + 1})
    with pytest.raises(OtherRunError, match="differs in version"):
        _check_out_dir(tmp_path / "newer", chash, False, request)
    _stored_run(tmp_path / "other", {**request, "version": 1, "context": 512})
    with pytest.raises(OtherRunError, match="differs in context, version"):
        _check_out_dir(tmp_path / "other", chash, False, request)


def test_a_corrupt_done_file_is_refused_as_another_run_not_a_decode_error(tmp_path):
    """A ``DONE`` holding bytes that are not UTF-8 (a torn or foreign file) stopped ``kvbits eval`` with a bare
    ``UnicodeDecodeError`` from ``read_text``; it is now a run of unknown configuration: refused, naming the folder
    and ``--overwrite``, and replaced with ``overwrite``."""
    from kvbits.evaluate.outputs import OtherRunError, _check_out_dir

    (tmp_path / "DONE").write_bytes(b"\xff\xfe\x00torn")
    with pytest.raises(OtherRunError, match="config hash unreadable.*overwrite=True"):
        _check_out_dir(tmp_path, "abc", False, {})
    assert _check_out_dir(tmp_path, "abc", True, {}) is None


def test_a_run_from_another_kvbits_version_is_recomputed_not_reused(tmp_path, caplog):
    """The config hash holds no kvbits version, so a finished run computed by another kvbits (whose quantizers
    may have changed) was served as this run's result without a word. A run whose ``config.json`` records
    another ``versions.kvbits`` is now recomputed (logged, naming both versions); one of this version, or one
    that records none, is reused as before."""
    import json

    from kvbits import __version__
    from kvbits.evaluate.outputs import _check_out_dir
    from kvbits.evaluate.request import OUTPUT_VERSION, config_hash

    request = {"version": OUTPUT_VERSION, "model": "m", "data": "d", "context": 256, "schemes": ["int8-token"]}
    chash = config_hash(request)
    for name, version in (("old", "0.0.1"), ("same", __version__)):
        _stored_run(tmp_path / name, request)
        cfg = tmp_path / name / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "versions": {"kvbits": version}}))
    with caplog.at_level("WARNING", logger="kvbits.evaluate.outputs"):
        assert _check_out_dir(tmp_path / "old", chash, False, request) is None
    assert f"kvbits 0.0.1, this is kvbits {__version__}" in caplog.text and "recomputing" in caplog.text
    assert _check_out_dir(tmp_path / "same", chash, False, request)["results"][0]["kl"] == 1.2e-6
    _stored_run(tmp_path / "unrecorded", request)
    assert _check_out_dir(tmp_path / "unrecorded", chash, False, request) is not None
