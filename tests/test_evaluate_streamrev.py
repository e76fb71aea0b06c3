"""Review of kvbits.evaluate.metrics / stream: logit post-processing of more families, empty inputs."""

from __future__ import annotations

import pytest
import torch
import transformers
from _tinyllama import SMALL_KIVI, tiny_llama

from kvbits.evaluate import metrics as M
from kvbits.evaluate.stream import base_model, stream_hidden


def _falcon_h1() -> transformers.PreTrainedModel:
    cfg = transformers.FalconH1Config(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, lm_head_multiplier=0.25,
    )  # fmt: skip
    return transformers.FalconH1ForCausalLM(cfg).eval()


def _hyperclovax() -> transformers.PreTrainedModel:
    cfg = transformers.HyperCLOVAXConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, logits_scaling=0.25,
    )  # fmt: skip
    return transformers.HyperCLOVAXForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [_falcon_h1, _hyperclovax], ids=["falcon_h1-lm_head_multiplier", "hyperclovax"])
@torch.no_grad()
def test_logit_head_reproduces_falcon_h1_and_hyperclovax_logits(build):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier`` (left out: scale 1.0) and HyperCLOVAX by
    ``logits_scaling`` (which Granite divides by: scale 4.0 for 0.25); both were refused by the head check
    (relative difference 3 and 15), so no PPL or KL could be measured on them."""
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 96, (1, 12))
    head = M.LogitHead.from_model(model)
    assert head.scale == pytest.approx(0.25)
    hidden = base_model(model)(ids).last_hidden_state[0]
    assert M.check_logit_head(head, hidden, model(ids).logits[0], tolerance=1e-5) <= 1e-5


@pytest.mark.parametrize("shape", [(1, 0), (0, 5)])
def test_stream_hidden_refuses_empty_ids_up_front(shape):
    """No token (was: "max_cache_len must be a positive int ... got 0" from the cache) or no sequence (was: a
    reshape error inside the attention) is said as what the ids are."""
    with pytest.raises(ValueError, match=r"ids must be \(B, T\) with B >= 1 sequences of T >= 1 tokens"):
        stream_hidden(tiny_llama(), torch.zeros(shape, dtype=torch.long), SMALL_KIVI, fused_decode=False)


def test_summarize_refuses_per_token_arrays_that_are_not_windows_by_positions():
    """One window's ``(N,)`` arrays (was: "not enough values to unpack") or fields of different shapes (was: a
    NumPy broadcast error, or buckets cut at the first field's length) are said as such."""
    import numpy as np

    one = {k: np.zeros(8) for k in M.TOKEN_FIELDS}
    with pytest.raises(ValueError, match=r"must all be \(windows, positions\)"):
        M.summarize(one)
    mixed = {k: np.zeros((1, 8 if k != "kl" else 7)) for k in M.TOKEN_FIELDS}
    with pytest.raises(ValueError, match=r"must all be \(windows, positions\)"):
        M.summarize(mixed)
