"""Progress of ``kvbits eval --mode stream`` where stderr is not a terminal (a log file, a pipe, CI)."""

from __future__ import annotations

import pytest
import torch
from _bytelevel import VOCAB
from _tinyllama import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_progress_to_a_file_says_each_pass_while_the_run_goes_on(capsys):
    """rich draws its bar on a terminal only: to a log file it printed nothing until the run ended, and a stream-mode
    run (SmolLM2-135M, 512 tokens: ~70 s per scheme and window on one busy CPU core, minutes with two threads) looked
    hung. Each window's reference and scheme passes are now said as they start, one plain line each."""
    from kvbits.evaluate import evaluate

    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(0))
    seen: list[str] = []
    evaluate(tiny_llama(), ids, 40, ["int8-token", "fp16"], windows=2, mode="stream", attn_layers=[],
             progress=True, on_pass=lambda w, W, name: seen.append(capsys.readouterr().err))  # fmt: skip
    # read while the run went on: after window 1's int8-token pass, its start and the reference's were said
    assert "kvbits eval: window 1/2: reference" in seen[0]
    assert "kvbits eval: window 1/2: int8-token (40/" in seen[0]
    assert "kvbits eval: window 1/2: fp16" in seen[1]
    assert "window 2/2: fp16" in seen[3]
