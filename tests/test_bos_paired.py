"""``benchmarks/bos_paired.py`` (BENCHMARKS.md §25): a ``--bos never`` and a ``--bos always`` run paired by text token."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bos_paired.py"
    spec = importlib.util.spec_from_file_location("bos_paired_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def _run(folder: Path, context: int, n_win: int, bos: bool, ref_shift: float = 0.0) -> None:
    """Per-token arrays whose values name the text token each column scores: nll_ref = text index (+ shift)."""
    cols = torch.arange(context - 1, dtype=torch.float32)
    rows = [(w * (context - 1) + cols) if bos else (w * context + cols + 1) for w in range(n_win)]
    text = torch.stack(rows)  # (W, C - 1)
    (folder / "tokens").mkdir(parents=True)
    save_file({"nll": text + 1.0, "nll_ref": text + ref_shift, "kl": text * 0 + (0.5 if bos else 0.25),
               "top1": torch.ones_like(text)}, str(folder / "tokens" / "s.safetensors"))


def test_pairs_the_same_text_tokens(tmp_path: Path) -> None:
    """Never: column i of window w scores text token w*C + i + 1; always: w*(C-1) + i. Paired on the same text
    token, the reference NLLs (the text index, plus 0.1 with the BOS) differ by exactly 0.1: a column misalignment
    gives differences of whole tokens."""
    bench = _bench()
    _run(tmp_path / "never", 16, 3, bos=False)
    _run(tmp_path / "always", 16, 3, bos=True, ref_shift=0.1)
    row = bench.compare(tmp_path / "never", tmp_path / "always")["s"]
    whole = row["1-1024"]
    # text tokens scored by both: never 1..15, 17..31, 33..47; always 0..44
    assert whole["tokens"] == 15 + 15 + 12
    mean, lo, hi = whole["ref_nll_always_minus_never"]
    assert math.isclose(mean, 0.1, abs_tol=1e-5) and hi - lo < 1e-4
    assert math.isclose(whole["dppl_never"], math.e - 1, rel_tol=1e-6)
    assert whole["kl_never"] == 0.25 and whole["kl_always"] == 0.5
    assert row["1-4"]["tokens"] == 3 * 3  # positions 1..3 of each no-BOS window
