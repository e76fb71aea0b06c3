"""``benchmarks/rotation_seed_eval.py`` (BENCHMARKS.md §23c): ``kvbits eval`` under another Hadamard sign seed."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from kvbits.quant import quantize, rotate
from kvbits.schemes import get_scheme


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "rotation_seed_eval.py"
    spec = importlib.util.spec_from_file_location("rotation_seed_eval_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def restore_seed(monkeypatch):
    monkeypatch.setattr(rotate, "SIGN_SEED", rotate.SIGN_SEED)  # put back at teardown
    yield
    rotate._matrix.cache_clear()


def test_seed_replaces_the_signs_and_passes_the_eval_arguments(monkeypatch, restore_seed):
    bench = _load()
    before = rotate.rotation_matrix(64).clone()
    seen = []
    monkeypatch.setattr(bench, "kvbits_main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["3", "--model", "m", "--scheme", "vllm-int4"]) == 0
    assert seen == [["eval", "--model", "m", "--scheme", "vllm-int4"]]
    after = rotate.rotation_matrix(64)
    assert rotate.SIGN_SEED == 3
    # another orthogonal matrix: the same Hadamard rows up to sign, some signs flipped
    torch.testing.assert_close(after @ after.T, torch.eye(64), atol=1e-5, rtol=0)
    torch.testing.assert_close(after.abs(), before.abs())
    assert not torch.equal(after, before)


def test_a_rotated_scheme_stores_other_codes_under_another_seed(monkeypatch, restore_seed):
    """kvbits' signs (``rotate="hadamard"``: §23c's integer zero-point file and int4-token-hadamard) change;
    vLLM's (``"hadamard-vllm"``, the vllm-int4 preset) are vLLM's whatever the seed."""
    bench = _load()
    monkeypatch.setattr(bench, "kvbits_main", lambda argv: 0)
    x = torch.randn(1, 2, 16, 64, generator=torch.Generator().manual_seed(0))
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "schemes" / "int4-token-hadamard-intzero.json"
    ours, theirs = get_scheme(str(path)).key, get_scheme("vllm-int4").key
    assert (ours.rotate, theirs.rotate) == ("hadamard", "hadamard-vllm")
    assert dataclasses.replace(ours, rotate="hadamard-vllm") == theirs  # the same format otherwise
    q0, v0 = (quantize(x, s).dequantize(torch.float32) for s in (ours, theirs))
    bench.main(["1"])
    q1, v1 = (quantize(x, s).dequantize(torch.float32) for s in (ours, theirs))
    assert not torch.equal(q0, q1)
    assert torch.equal(v0, v1)
    # both are a 4-bit reconstruction of the same x: errors of the same size, not identical
    e0, e1 = (q0 - x).pow(2).mean(), (q1 - x).pow(2).mean()
    assert 0.5 < float(e0 / e1) < 2.0


def test_a_seed_is_required():
    bench = _load()
    with pytest.raises(SystemExit, match="usage"):
        bench.main(["--model", "m"])
    with pytest.raises(SystemExit, match="usage"):
        bench.main([])
