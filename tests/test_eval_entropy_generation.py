"""Attention entropy by position (simulate mode) and greedy generation after each window (``generate=N``).

Measures are checked against values computed by hand (rep-n of a known sequence, the entropy of
uniform attention ``log(n)``), the runner against its own paths (an exact identity scheme gives
delta 0 and the reference's continuation; a 2-bit cache differs more than an 8-bit one; the
continuations are those ``model.generate`` gives through the caches), and the outputs against the
run folder, the config hash, the report and the CLI. Tiny random-weight models, no network.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_evaluate import FP32, VOCAB, _llama
from test_evaluate import _qwen2 as _qwen2_layers

from kvbits.evaluate.entropy import attention_entropy
from kvbits.evaluate.generation import (
    REP_NS,
    agreement,
    check_generate,
    first_divergence,
    generation_summary,
    greedy_continuation,
    rep_n,
)
from kvbits.evaluate.outputs import OtherRunError
from kvbits.evaluate.runner import evaluate
from kvbits.evaluate.simulate import simulate

CONTEXT = 300
NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _qwen2():
    return _qwen2_layers(2)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


# ------------------------------------------------------------------------------------ by hand


def test_rep_n_by_hand():
    assert rep_n([1, 2, 1, 2, 1], 2) == 0.5  # bigrams 12 21 12 21: 2 distinct of 4
    assert rep_n([1, 2, 3, 4], 1) == 0.0
    assert rep_n([5, 5, 5, 5], 1) == 0.75  # 1 distinct of 4
    # 4-grams 1231 2312 3123 1231 2312: 3 distinct of 5
    assert rep_n(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 4) == pytest.approx(1 - 3 / 5)
    assert rep_n([7, 8, 9, 10, 11], 4) == 0.0
    assert math.isnan(rep_n([1, 2], 4))  # no 4-gram at all
    with pytest.raises(ValueError, match="positive int"):
        rep_n([1, 2], 0)


def test_agreement_and_first_divergence_by_hand():
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.75
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3 and agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert first_divergence([0, 2], [1, 2]) == 0
    with pytest.raises(ValueError, match="same length"):
        agreement([1, 2], [1, 2, 3])


def test_measures_refuse_a_batch_and_non_integer_ids():
    """The per-continuation measures take one continuation ``(N,)``. A batch was flattened: its rows ran into each
    other (rep-2 of [[1, 2], [1, 2]] was 1/3, counting the bigram 2 1 across the rows; each row alone is 0) and the
    first divergence was a flat index (3 for rows differing at position 1 of row 1). Float ids were truncated
    (rep-1 of [1.7, 1.2] was 0.5)."""
    with pytest.raises(ValueError, match=r"one continuation of token ids \(N,\), got shape \(2, 2\)"):
        rep_n([[1, 2], [1, 2]], 2)
    with pytest.raises(ValueError, match=r"\(N,\), got shape \(2, 2\)"):
        first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    with pytest.raises(ValueError, match=r"\(N,\)"):
        agreement([[1, 2]], [[1, 2]])
    with pytest.raises(ValueError, match="integer token ids, got dtype float64"):
        rep_n([1.7, 1.2], 1)
    with pytest.raises(ValueError, match=r"\(windows, new tokens\), got shape \(2, 2, 3\)"):
        generation_summary(np.zeros((2, 2, 3), int), np.zeros((2, 2, 3), int), prompt_tokens=1, seconds=0,
                           reference_seconds=0)  # fmt: skip
    assert rep_n(np.array([1, 2, 1, 2]), np.int64(2)) == pytest.approx(1 / 3)  # numpy's ints, as check_generate
    assert math.isnan(rep_n([], 1)) and first_divergence([], []) == 0  # empty: no n-gram, no divergence


def test_generation_summary_by_hand():
    ref = np.array([[1, 2, 1, 2, 1], [3, 4, 5, 6, 7]])
    out = np.array([[1, 2, 1, 2, 1], [3, 4, 9, 9, 9]])
    g = generation_summary(out, ref, prompt_tokens=100, seconds=1.5, reference_seconds=1.0)
    assert g["rep_n"] == list(REP_NS) == [1, 2, 4]
    assert g["first_divergence"] == [5, 2] and g["first_divergence_mean"] == 3.5
    assert g["agreement"] == pytest.approx((1.0 + 0.4) / 2)
    # window 0: rep-1 = 1 - 2/5, rep-2 = 1 - 2/4; window 1 (scheme): 3 4 9 9 9 -> rep-1 = 1 - 3/5
    assert g["rep"]["1"] == pytest.approx((0.6 + 0.4) / 2)
    assert g["rep_ref"]["1"] == pytest.approx((0.6 + 0) / 2)
    assert g["rep"]["2"] == pytest.approx((0.5 + 0.25) / 2)  # 34 49 99 99: 3 distinct of 4
    assert g["rep"]["4"] == 0.0  # 1212 2121 | 3499 4999: every 4-gram distinct
    assert (g["new_tokens"], g["prompt_tokens"], g["seconds"]) == (5, 100, 1.5)
    json.dumps(g, allow_nan=False)
    short = generation_summary(out[:, :2], ref[:, :2], prompt_tokens=1, seconds=0, reference_seconds=0)
    assert short["rep"]["4"] is None  # no 4-gram in 2 tokens: null, not NaN


def test_check_generate():
    assert check_generate(0) == 0 and check_generate(np.int64(5)) == 5
    for bad in (-1, True, 2.0, "8", None):
        with pytest.raises(ValueError, match="generate must be an int >= 0"):
            check_generate(bad)


# ------------------------------------------------------------------------------------ entropy


@torch.no_grad()
def test_attention_entropy_uniform_is_log_n_and_matches_explicit_softmax():
    torch.manual_seed(0)
    B, Hq, Hkv, c, L, D = 2, 4, 2, 7, 10, 8
    k = torch.randn(B, Hkv, L, D)
    offset = L - c  # query i sees keys j <= i + offset (a chunk at the end of a prefix)
    mask = torch.arange(L)[None, :] <= torch.arange(c)[:, None] + offset
    h = attention_entropy(torch.zeros(B, Hq, c, D), k, mask, scale=D**-0.5)
    expected = torch.log(torch.arange(c, dtype=torch.float32) + offset + 1)
    torch.testing.assert_close(h, expected.expand(B, c), rtol=0, atol=1e-6)
    # random queries: against softmax over K repeated per query head (query head h uses KV head h // G)
    q = torch.randn(B, Hq, c, D) * 3
    s = (q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) * D**-0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    explicit = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(1)
    for budget in (1, 37, 1 << 20):  # sub-chunks of 1 query, a few queries, all at once
        torch.testing.assert_close(attention_entropy(q, k, mask, D**-0.5, budget=budget), explicit)
    # attention on one key: entropy 0
    spike = torch.zeros(1, 1, 1, D)
    spike[..., 0] = 1e4
    keys = torch.zeros(1, 1, 3, D)
    keys[0, 0, 1, 0] = 1.0
    h_spike = attention_entropy(spike, keys, torch.ones(1, 3, dtype=torch.bool), 1.0)
    assert h_spike.item() == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="mask must be"):
        attention_entropy(q, k, mask[:, :-1], 1.0)


@torch.no_grad()
@pytest.mark.parametrize(("gap", "L"), [(20.0, 1024), (25.0, 4096)])
def test_attention_entropy_of_near_one_hot_attention_is_float64_exact(gap, L):
    """One key ``gap`` nats above ``L - 1`` others: the top key's ``p`` rounded to 1 in float32 and its ``-p log p``
    (about the others' whole mass) to 0: 0.45% (20 nats, 1,024 keys) and 3.9% (25 nats, 4,096 keys) of the entropy
    lost. Now the softmax and ``-p log p`` are float64, from the same float32 scores."""
    q = torch.ones(1, 2, 1, 1)
    k = torch.full((1, 1, L, 1), -gap)
    k[0, 0, 0, 0] = 0.0
    h = attention_entropy(q, k, torch.ones(1, L, dtype=torch.bool), 1.0)
    s = torch.zeros(L, dtype=torch.float64)
    s[1:] = -gap
    exact = torch.special.entr(torch.softmax(s, -1)).sum()
    assert h.dtype == torch.float32 and h.shape == (1, 1)
    assert float(h) == pytest.approx(float(exact), rel=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("build,window", [(_llama, None), (_qwen2, 40)], ids=["llama", "qwen2-sliding"])
def test_simulated_entropy_of_uniform_attention_is_log_of_keys_seen(build, window):
    """With every query zero the attention is uniform over the keys a query sees: log(t + 1), or
    log(min(t + 1, W)) in a sliding layer, with exact and with quantized keys alike."""
    model = copy.deepcopy(build())
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.zero_()
        if layer.self_attn.q_proj.bias is not None:
            layer.self_attn.q_proj.bias.zero_()
    T = 100
    t = torch.arange(T, dtype=torch.float32)
    with simulate(model, "int4-token", attn_layers=[0, 1], chunk_size=32) as sim:
        model.model(_ids(T, seed=1)[None])
    for layer in (0, 1):
        sliding = window is not None and model.config.layer_types[layer] == "sliding_attention"
        seen = torch.clamp(t + 1, max=window) if sliding else t + 1
        for h in (sim.attn_entropy[layer], sim.attn_entropy_ref[layer]):
            assert h.shape == (1, T)
            torch.testing.assert_close(h[0], torch.log(seen), rtol=0, atol=1e-5)
    if window is not None:
        assert model.config.layer_types == ["full_attention", "sliding_attention"]


# ------------------------------------------------------------------------------------ the runner


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One evaluation with entropy (default layers) and generation, written to a folder."""
    out = tmp_path_factory.mktemp("gen") / "run"
    model = _llama()
    ids = _ids(2 * CONTEXT, seed=7)
    summary = evaluate(model, ids, CONTEXT, [FP32, "int8-token", "int2-token"], windows=2, generate=NEW,
                       out_dir=out)  # fmt: skip
    return model, ids, summary, out


def _by_scheme(summary: dict) -> dict:
    return {r["scheme"]: r for r in summary["results"]}


def test_entropy_identity_zero_and_ordered_by_error(run):
    _, _, s, _ = run
    r = _by_scheme(s)
    for res in r.values():
        assert [e["layer"] for e in res["attn_entropy"]] == [0, 1]
        for e in res["attn_entropy"]:
            assert [(b["lo"], b["hi"]) for b in e["buckets"]] == [(0, CONTEXT - 1)]
            for b in e["buckets"]:
                assert set(b) == {"lo", "hi", "entropy", "entropy_ref", "delta"}
                assert b["delta"] == pytest.approx(b["entropy"] - b["entropy_ref"], abs=1e-9)
                assert 0 < b["entropy_ref"] <= math.log(CONTEXT)
    for layer in range(2):
        d = {n: next(e for e in r[n]["attn_entropy"] if e["layer"] == layer)["buckets"][0] for n in r}
        assert d["t-fp32"]["delta"] == 0 and d["t-fp32"]["entropy"] == d["t-fp32"]["entropy_ref"]
        assert abs(d["int2-token"]["delta"]) > 10 * abs(d["int8-token"]["delta"]) > 0


def test_generation_identity_agrees_and_two_bits_drift(run):
    _, _, s, _ = run
    r = _by_scheme(s)
    ident, g8, g2 = (r[n]["generation"] for n in ("t-fp32", "int8-token", "int2-token"))
    assert set(ident) == {"prompt_tokens", "new_tokens", "rep_n", "rep", "rep_ref", "agreement",
                          "first_divergence", "first_divergence_mean", "seconds", "reference_seconds"}  # fmt: skip
    assert (ident["prompt_tokens"], ident["new_tokens"]) == (CONTEXT, NEW)
    assert ident["agreement"] == 1.0 and ident["first_divergence"] == [NEW, NEW]
    assert ident["rep"] == ident["rep_ref"]
    assert g2["agreement"] < g8["agreement"] and min(g2["first_divergence"]) < NEW
    assert g2["rep"] != g2["rep_ref"]
    assert ident["rep_ref"] == g8["rep_ref"] == g2["rep_ref"]  # one reference continuation, shared
    assert all(g["seconds"] > 0 and g["reference_seconds"] > 0 for g in (ident, g8, g2))
    json.dumps(s, allow_nan=False)


@torch.no_grad()
def test_continuations_are_what_generate_gives_through_each_cache(run):
    """generations.jsonl holds what model.generate returns with a DynamicCache (the reference) and
    with the scheme's QuantizedKVCache, and the summary's measures are computed from them."""
    from transformers import DynamicCache

    from kvbits.cache import QuantizedKVCache

    model, ids, s, out = run
    lines = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert [(x["window"], x["scheme"]) for x in lines] == [
        (w, n) for w in range(2) for n in ("reference", "t-fp32", "int8-token", "int2-token")
    ]
    got = {(x["window"], x["scheme"]): x["tokens"] for x in lines}
    assert all(len(t) == NEW and x["text"] is None for x, t in zip(lines, got.values()))  # no tokenizer given
    for w in range(2):
        prompt = ids[w * CONTEXT : (w + 1) * CONTEXT][None]
        plain = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False
        )
        assert plain[0, CONTEXT:].tolist() == got[(w, "reference")]
        assert greedy_continuation(model, prompt, NEW, DynamicCache()).tolist() == got[(w, "reference")]
        cache = QuantizedKVCache(config=model.config, scheme="int2-token")
        assert greedy_continuation(model, prompt, NEW, cache).tolist() == got[(w, "int2-token")]
        assert cache.get_seq_length() == CONTEXT + NEW - 1  # the last token is generated, never cached
    assert got[(0, "int2-token")] != got[(0, "reference")]  # so the checks above can tell the caches apart
    g2 = _by_scheme(s)["int2-token"]["generation"]
    ref = np.array([got[(w, "reference")] for w in range(2)])
    two = np.array([got[(w, "int2-token")] for w in range(2)])
    assert g2["first_divergence"] == [first_divergence(a, b) for a, b in zip(two, ref)]
    assert g2["rep"]["4"] == pytest.approx(np.mean([rep_n(t, 4) for t in two]))


@torch.no_grad()
@pytest.mark.parametrize(
    "settings", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"suppress_tokens": "first"}]
)
def test_greedy_continuation_sets_the_models_own_generation_settings_aside(settings):
    """A model whose ``generation_config`` carries a repetition penalty (Qwen2.5-Instruct's
    generation_config.json), an n-gram ban or suppressed tokens: the continuation is still plain argmax decoding,
    and the model's settings are back afterwards. Before, transformers filled them in: rep-2 0.44 became 0.03
    with a 1.3 penalty, hiding the repetition rep-n is there to catch, for the reference and every scheme alike."""
    from transformers import DynamicCache, GenerationConfig

    from kvbits.cache.compat import cache_kwargs

    model, prompt = _llama(), _ids(24, seed=1)[None]
    cache, cur, argmax = DynamicCache(), prompt, []
    for _ in range(NEW):
        cur = model(cur, use_cache=True, **cache_kwargs(cache, model)).logits[:, -1].argmax(-1, keepdim=True)
        argmax.append(int(cur))
    assert rep_n(argmax, 2) > 0.1  # a looping continuation: what the settings would break
    if settings.get("suppress_tokens") == "first":
        settings = {"suppress_tokens": [argmax[0]]}
    own = GenerationConfig(**settings)
    model.generation_config = own
    assert greedy_continuation(model, prompt, NEW, DynamicCache()).tolist() == argmax
    assert model.generation_config is own


@torch.no_grad()
def test_greedy_continuation_refuses_bad_arguments_before_generating():
    """An empty prompt failed inside the model (``cannot reshape tensor of 0 elements``), float ids inside the
    embedding, and 2.0 new tokens generated 2."""
    from transformers import DynamicCache

    model, prompt = _llama(), _ids(12)[None]
    for ids, match in ((prompt[:, :0], r"\(1, T\) with T >= 1, got shape \(1, 0\)"),
                       (prompt.float(), "integer token ids, got dtype torch.float32")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            greedy_continuation(model, ids, 3, DynamicCache())
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
            greedy_continuation(model, prompt, bad, DynamicCache())
    assert greedy_continuation(model, prompt, np.int64(2), DynamicCache()).shape == (2,)


@torch.no_grad()
def test_greedy_continuation_goes_past_an_end_of_sequence_token_at_the_first_step():
    """The model's own end-of-sequence token, generated at the first step, does not stop the continuation."""
    from transformers import DynamicCache

    model, prompt = _llama(), _ids(12)[None]
    ref = greedy_continuation(model, prompt, 6, DynamicCache()).tolist()
    model.generation_config.eos_token_id = model.config.eos_token_id = ref[0]
    assert greedy_continuation(model, prompt, 6, DynamicCache()).tolist() == ref


def test_attention_entropy_refuses_a_float_mask():
    """An additive float mask (0 / -inf) failed in ``~mask`` (TypeError: invert of a float tensor)."""
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="mask must be bool"):
        attention_entropy(q, k, torch.zeros(2, 3), 0.5)


def test_report_shows_entropy_and_generation(run, tmp_path):
    from kvbits.report import write_report
    from kvbits.report.tables import entropy_table, generation_table

    _, _, s, out = run
    paths = write_report(out, plots=False)
    md = paths["markdown"].read_text()
    assert "## Attention entropy" in md and "## Greedy generation" in md
    assert (
        md.index("## Attention-output error")
        < md.index("## Attention entropy")
        < md.index("## Greedy generation")
    )
    assert "--generate 24" in md  # the reproduce command
    gen = generation_table(s)
    assert gen.headers == ("continuation", "rep-1", "rep-2", "rep-4", "agreement", "first divergence (of 24)")
    rows = {row[0].text: [c.text for c in row] for row in gen.rows}
    g2 = _by_scheme(s)["int2-token"]["generation"]
    assert rows["t-fp32"][4:] == ["100.00%", "24, 24"]
    assert (
        rows["int2-token"][3] == f"{g2['rep']['4']:.3f}"
        and rows["reference"][3] == f"{g2['rep_ref']['4']:.3f}"
    )
    assert rows["int2-token"][5] == ", ".join(str(x) for x in g2["first_divergence"])
    ent = entropy_table(s)
    cells = {(row[0].text, row[1].text): row[2].text for row in ent.rows}
    assert cells[("t-fp32", "0")].endswith("(0)")  # delta exactly 0
    b = _by_scheme(s)["int2-token"]["attn_entropy"][0]["buckets"][0]
    assert cells[("int2-token", "0")].startswith(f"{b['entropy']:.3f} (")
    assert "|" in paths["html"].read_text() or "<table" in paths["html"].read_text()
    assert "Greedy generation" in paths["html"].read_text()
    # a run without them (older summaries, generate=0, stream mode) has neither section
    bare = json.loads(json.dumps(s))
    for r in bare["results"]:
        r.pop("attn_entropy")
        r["generation"] = None
    d = tmp_path / "bare"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(bare))
    text = write_report(d, plots=False)["markdown"].read_text()
    assert "Attention entropy" not in text and "Greedy generation" not in text
    assert entropy_table(bare) is None and generation_table(bare) is None


def test_generate_in_stream_mode_equals_simulate_mode():
    """Generation does not depend on how the window is scored; stream mode records no entropy."""
    model, ids = _llama(), _ids(2 * 64, seed=3)
    kw = {"windows": 2, "generate": 8}
    sim = evaluate(model, ids, 64, ["int2-token"], **kw)
    st = evaluate(model, ids, 64, ["int2-token"], mode="stream", **kw)
    a, b = sim["results"][0], st["results"][0]
    for key in ("rep", "rep_ref", "agreement", "first_divergence"):
        assert a["generation"][key] == b["generation"][key]
    assert b["attn_entropy"] == [] and a["attn_entropy"]
    off = evaluate(model, ids, 64, ["int2-token"], windows=2)
    assert off["results"][0]["generation"] is None


def test_generate_is_part_of_the_run_identity(tmp_path, monkeypatch):
    from kvbits.evaluate import runner

    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    model, ids = _llama(layers=1), _ids(64, seed=4)
    out = tmp_path / "run"
    evaluate(model, ids, 64, ["int4-token"], out_dir=out)
    cfg = json.loads((out / "config.json").read_text())
    assert "generate" not in cfg["request"] and cfg["args"]["generate"] is None  # old runs keep their hash
    skipped: list = []
    evaluate(model, ids, 64, ["int4-token"], out_dir=out, generate=0, on_skip=skipped.append)
    assert len(skipped) == 1  # generate=0 is the run it was
    with pytest.raises(OtherRunError) as err:
        evaluate(model, ids, 64, ["int4-token"], out_dir=out, generate=4)
    assert err.value.differs == ["generate"]
    evaluate(model, ids, 64, ["int4-token"], out_dir=out, generate=4, overwrite=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["request"]["generate"] == 4 and cfg["args"]["generate"] == 4
    assert (out / "generations.jsonl").is_file()
    evaluate(model, ids, 64, ["int4-token"], out_dir=out, overwrite=True)  # back to no generation
    assert not (out / "generations.jsonl").exists()  # the stale continuations went with the old run


def test_bad_generate_is_refused_before_the_model_loads():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="generate must be an int >= 0"):
            evaluate("no-such-model-anywhere", _ids(64), 32, ["int4-token"], generate=bad)


def test_numpy_context_and_windows_are_taken_as_ints():
    """``evaluate(context=np.int64(32))`` was refused: "context must be an int >= 2, got np.int64(32)" (windows
    likewise), where generate, seed, chunk_size and prompt_len take numpy's ints."""
    model, ids = _llama(), _ids(64)
    out = evaluate(model, ids, np.int64(32), ["int4-token"], windows=np.int64(2), attn_layers=[], generate=2)
    assert (out["context"], out["windows"]) == (32, 2) and type(out["context"]) is int
    assert out["results"][0]["generation"]["new_tokens"] == 2


def test_generate_needs_a_model_that_generates(monkeypatch):
    from kvbits.evaluate import runner

    model = _llama(layers=1)
    monkeypatch.setattr(type(model), "can_generate", classmethod(lambda cls: False))
    with pytest.raises(ValueError, match="can not generate"):
        runner.evaluate(model, _ids(64), 32, ["int4-token"], generate=4)


def test_cli_generate_flag(capsys):
    from kvbits.cli import build_parser

    parser = build_parser(only="eval")
    base = ["eval", "--model", "m", "--data", "d", "--scheme", "int4-token"]
    assert parser.parse_args([*base, "--generate", "64"]).generate == 64
    assert parser.parse_args(base).generate == 0
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--generate", "-1"])
    assert "expected a token count >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ two ranks


def _rank(rank: int, world: int, init_file: str, work: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        s = evaluate(_llama(), _ids(3 * 64, seed=5), 64, ["int2-token"], windows=3, generate=8)
        (Path(work) / f"rank{rank}.pkl").write_bytes(pickle.dumps(s))
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_single_process_entropy_and_generation(tmp_path):
    """Windows split 2 + 1 over two gloo ranks: entropy buckets and continuations as one process's."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 180 s")
    s0, s1 = (pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2))
    alone = evaluate(_llama(), _ids(3 * 64, seed=5), 64, ["int2-token"], windows=3, generate=8)
    assert s0["world_size"] == 2
    for s in (s0, s1):
        r, a = s["results"][0], alone["results"][0]
        assert r["attn_entropy"] == a["attn_entropy"]
        g, ga = dict(r["generation"]), dict(a["generation"])
        for key in ("seconds", "reference_seconds"):
            g.pop(key), ga.pop(key)
        assert g == ga and len(g["first_divergence"]) == 3


def test_attention_entropy_edges_give_nan_empty_or_a_clear_error():
    """No queries failed in ``torch.cat([])`` ("expected a non-empty list of Tensors"); no keys gave entropy 0
    where the docstring says NaN (no distribution); keys of another head dim failed deep inside ``matmul`` and of
    another batch size broadcast silently to q's batch."""
    q, k, mask = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), torch.ones(3, 5, dtype=torch.bool)
    assert attention_entropy(q[:, :, :0], k, mask[:0], 0.5).shape == (1, 0)
    assert attention_entropy(q, k[:, :, :0], mask[:, :0], 0.5).isnan().all()
    with pytest.raises(ValueError, match="k must be"):
        attention_entropy(q, k[..., :3], mask, 0.5)
    with pytest.raises(ValueError, match="k must be"):
        attention_entropy(q.expand(2, -1, -1, -1), k, mask, 0.5)


def test_generation_past_the_calibrated_length_is_recorded_and_warned(caplog, tmp_path, monkeypatch):
    """``generate=N`` serves ``context + N`` positions through each scheme's cache, but only the window (``context``)
    was checked against the calibrated length: a window of 64 on a 64-token calibration generated 16 more tokens with
    no word. Now the record counts them and the log says so, with the ``--context`` that covers them (also when
    ``--out`` reuses the finished run)."""
    from test_evaluate import _narrow_kvquant

    from kvbits.evaluate import runner

    monkeypatch.setattr(runner, "_write_report", lambda out: None)
    model, scheme, art = _narrow_kvquant(64)
    kw = {"calibration": art, "attn_layers": [], "generate": 16, "out_dir": tmp_path / "run"}
    for _ in range(2):  # run, then reused
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvbits"):
            s = evaluate(model, _ids(64), 64, [scheme], **kw)
        cal = s["results"][0]["calibration"]
        assert cal["positions_beyond_calibrated"] == 0 and cal["generation_positions_beyond_calibrated"] == 16
        assert (
            "kvquant-4 (generation: 16 tokens after each 64-token window) serves 16 of 80 positions per window beyond "
            "the 64 tokens it was calibrated on. Calibrate with --context 80 to cover every position." in caplog.text
        )
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits"):  # within the calibrated length: nothing said, 0 recorded
        s = evaluate(model, _ids(64), 48, [scheme], calibration=art, attn_layers=[], generate=16)
    assert s["results"][0]["calibration"]["generation_positions_beyond_calibrated"] == 0
    assert "generation:" not in caplog.text


def test_the_generation_log_line_summarises_divergences_and_says_n_a_for_rep_4(caplog):
    """The log line per scheme printed every window's first divergence (``[0, 2, 1, ...]``, one per window: a long
    run's line ran to hundreds of numbers) and ``rep-4 None (reference None)`` for continuations shorter than 4 tokens;
    it now says min, median, max and the count past 8 windows, and ``n/a`` as the report does."""
    model = _llama()
    with caplog.at_level("INFO", logger="kvbits"):
        out = evaluate(model, _ids(9 * 16), 16, ["int2-token"], windows=9, attn_layers=[], generate=2)
    div = out["results"][0]["generation"]["first_divergence"]
    assert len(div) == 9
    line = next(r.getMessage() for r in caplog.records if "greedy tokens" in r.getMessage())
    assert "rep-4 n/a (reference n/a)" in line and "None" not in line, line
    assert f"first divergence min {min(div)}, median {float(np.median(div)):g}, max {max(div)} over 9 windows" in line
    from kvbits.evaluate.generation import generation_log_text

    rec = {"new_tokens": 16, "agreement": 0.5, "first_divergence": [3, 16], "rep": {"4": 0.25}, "rep_ref": {"4": 0.0}}
    assert generation_log_text(rec) == (
        "16 greedy tokens, agreement with the reference 0.500, first divergence 3, 16, rep-4 0.250 (reference 0.000)"
    )
