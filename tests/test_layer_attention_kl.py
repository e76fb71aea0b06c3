"""``benchmarks/layer_attention_kl.py`` (BENCHMARKS.md §23b): the attention figures and the query/key tap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbits.quant import quantize
from kvbits.schemes import get_scheme


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "layer_attention_kl.py"
    spec = importlib.util.spec_from_file_location("layer_attention_kl_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


bench = _load()
SYM8 = Path(__file__).resolve().parents[1] / "benchmarks" / "schemes" / "int8-token-sym.json"  # rounded to nearest
g = torch.Generator().manual_seed(0)
Q, K = torch.randn(4, 300, 16, generator=g), torch.randn(2, 300, 16, generator=g)
ROWS = torch.arange(256, 300, 7)


def test_exact_keys_give_zero_error():
    r = bench.compare(Q, K, K.clone(), ROWS, 0.25)
    assert r["kl"] == pytest.approx(0, abs=1e-6) and r["logit_rms"] == pytest.approx(0, abs=1e-6)
    assert r["argmax_agree"] == 1 and r["entropy_exact"] == pytest.approx(r["entropy_quantized"])


def test_an_error_every_key_shares_cancels_but_a_varying_one_does_not():
    """A vector added to every key shifts all of a query's logits equally: no KL, no centred error."""
    shifted = bench.compare(Q, K, K + 3 * torch.randn(2, 1, 16, generator=g), ROWS, 0.25)
    assert shifted["kl"] == pytest.approx(0, abs=1e-5) and shifted["logit_rms"] == pytest.approx(0, abs=1e-4)
    noisy = bench.compare(Q, K, K + 0.5 * torch.randn(K.shape, generator=g), ROWS, 0.25)
    assert noisy["kl"] > 1e-3 and noisy["logit_rms"] > 0.05 and noisy["argmax_agree"] < 1


def test_kl_matches_a_direct_computation():
    kq = quantize(K[None], get_scheme("int2-token").key).dequantize(torch.float32)[0]
    r = bench.compare(Q, K, kq, ROWS, 0.25)
    want = []
    for h in range(4):
        for t in ROWS.tolist():
            p = torch.softmax(Q[h, t] @ K[h // 2, : t + 1].T * 0.25, -1)
            lq = torch.log_softmax(Q[h, t] @ kq[h // 2, : t + 1].T * 0.25, -1)
            want.append((p * (p.log() - lq)).sum())
    assert r["kl"] == pytest.approx(torch.stack(want).mean().item(), rel=1e-4)


def test_record_attention_taps_the_cached_keys():
    """The keys recorded are the ones the cache stores (post-RoPE); queries have the query heads; the
    model's own attention implementation is restored afterwards."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (1, 20), generator=g)
    taps = bench.record_attention(model, ids, [1])
    q, k, scaling = taps[1]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert q.shape == (4, 20, 8) and scaling == pytest.approx(8**-0.5)
    assert torch.equal(k, out.past_key_values.layers[1].keys[0].float())
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"layers \[5\] were not seen"):
        bench.record_attention(model, ids, [5])


def test_logit_slope_reads_a_compression_of_the_logits():
    """Keys scaled by 0.9 give every query's logits a slope of exactly 0.9 (a flatter attention); noise added
    to the keys leaves the slope near 1; truncated INT8 codes (vllm-int8) compress the logits, rounded ones
    do not (BENCHMARKS.md §24)."""
    assert bench.compare(Q, K, K.clone(), ROWS, 0.25)["logit_slope"] == pytest.approx(1.0, abs=1e-6)
    scaled = bench.compare(Q, K, 0.9 * K, ROWS, 0.25)
    assert scaled["logit_slope"] == pytest.approx(0.9, abs=1e-5) and scaled["entropy_quantized"] > scaled["entropy_exact"]
    noisy = bench.compare(Q, K, K + 0.3 * torch.randn(K.shape, generator=g), ROWS, 0.25)
    assert abs(noisy["logit_slope"] - 1) < 0.05
    # queries that attend to their own keys (as a model's do): truncation shrinks exactly those logits
    kk = torch.randn(2, 300, 16, generator=g)
    qq = kk.repeat_interleave(2, 0).roll(1, 1) + 0.5 * torch.randn(4, 300, 16, generator=g)
    slopes = {
        name: bench.compare(qq, kk, quantize(kk[None], get_scheme(name).key).dequantize(torch.float32)[0], ROWS,
                            0.25)["logit_slope"]
        for name in ("vllm-int8", str(SYM8))
    }  # fmt: skip
    assert slopes["vllm-int8"] < 0.999 and abs(slopes[str(SYM8)] - 1) < 5e-4, slopes


def test_small_kl_is_not_float32_rounding():
    """A KL of keys stored in fp16 (~4e-7 nats) is a sum over ~1K keys of differences of log-probabilities whose
    float32 rounding does not cancel: float32 log_softmax put it 4.7 % low. Now it is the exact KL of the float32
    logits (the benchmark's ``logits``), computed in float64."""
    gen = torch.Generator().manual_seed(1)
    q, k = 2 * torch.randn(4, 2048, 32, generator=gen), 2 * torch.randn(2, 2048, 32, generator=gen)
    rows = torch.arange(256, 2048, 61)
    kq = k.half().float()
    r = bench.compare(q, k, kq, rows, 32**-0.5)
    _, l0, visible = bench.attention_logprobs(q, k, rows, 32**-0.5)
    _, l1, _ = bench.attention_logprobs(q, kq, rows, 32**-0.5)
    lp0, lp1 = (x.double().masked_fill(~visible, -float("inf")).log_softmax(-1) for x in (l0, l1))
    exact = (lp0.exp() * (lp0 - lp1)).masked_fill(~visible, 0).sum(-1).mean().item()
    assert 1e-8 < exact < 1e-5
    assert r["kl"] == pytest.approx(exact, rel=1e-6)
