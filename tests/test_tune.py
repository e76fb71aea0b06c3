"""``kvbits tune``: the exact knapsack against brute force, the sensitivity table against evaluate's own
runs, the chosen mix within its budget and usable by every command, bad input refused."""

from __future__ import annotations

import itertools
import json
import random
from unittest import mock

import pytest
import torch
from test_evaluate import VOCAB, _llama

from kvbits.cli import main
from kvbits.evaluate.runner import evaluate
from kvbits.plan import plan
from kvbits.schemes import KVScheme, get_scheme, mixed_scheme
from kvbits.tune import EXACT, choose_layers, choose_layers_by_bytes, tune

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_choose_layers_is_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(60):
        layers, cands = rng.randint(1, 5), rng.randint(2, 4)
        bits = sorted(rng.choice([2.25, 2.5, 3.25, 4.25, 4.5, 5.0, 8.5, 16.0]) for _ in range(cands))
        sens = [[rng.random() ** 3 for _ in range(cands)] for _ in range(layers)]
        budget = rng.uniform(min(bits), max(bits) + 0.5)
        pick = choose_layers(sens, bits, budget)
        assert sum(bits[c] for c in pick) / layers <= budget + 1e-9
        best = min(
            sum(sens[i][c] for i, c in enumerate(combo))
            for combo in itertools.product(range(cands), repeat=layers)
            if sum(bits[c] for c in combo) / layers <= budget + 1e-9
        )
        assert sum(sens[i][c] for i, c in enumerate(pick)) == pytest.approx(best, abs=1e-12)


def test_choose_layers_is_exact_for_bits_that_are_not_hundredths():
    """Head dim 96 (Phi-3's): int4-token stores 4.333... bits, int8-token 8.333... The knapsack rounded bits up to
    1/100 and the budget down, so it missed the mix int8, int4, int4 (5.667 bits) within a budget of 5.67 and
    refused a budget of 4.335 as 'below the cheapest candidate (4.33 bits)'."""
    from kvbits.schemes import average_bits, get_scheme

    bits = [average_bits(get_scheme(s), head_dim=96, n_heads=8) for s in ("int4-token", "int8-token")]
    assert bits == [pytest.approx(13 / 3), pytest.approx(25 / 3)]
    assert choose_layers([[1.0, 0.0], [0.5, 0.0], [0.5, 0.0]], bits, 5.67) == [1, 0, 0]
    assert choose_layers([[1.0, 0.0], [0.5, 0.0], [0.5, 0.0]], bits, 17 / 3) == [1, 0, 0]  # exactly the mix's
    assert choose_layers([[1.0, 0.0]] * 3, bits, 17 / 3 - 1e-9) == [0, 0, 0]  # a hair under it
    assert choose_layers([[0.0, 0.0]] * 32, bits, 4.335) == [0] * 32
    rng = random.Random(1)  # and against brute force, at thirds and random budgets
    for _ in range(40):
        layers = rng.randint(1, 5)
        sens = [[rng.random() ** 3 for _ in bits] for _ in range(layers)]
        budget = rng.uniform(min(bits), max(bits))
        pick = choose_layers(sens, bits, budget)
        assert sum(bits[c] for c in pick) / layers <= budget + 1e-12
        best = min(sum(sens[i][c] for i, c in enumerate(combo)) for combo in itertools.product(range(2), repeat=layers)
                   if sum(bits[c] for c in combo) / layers <= budget)  # fmt: skip
        assert sum(sens[i][c] for i, c in enumerate(pick)) == pytest.approx(best, abs=1e-12)


def test_choose_layers_by_bytes_is_the_brute_force_optimum():
    """Layers of different bytes (sliding, other heads): the least summed cost within 8 * bytes <= budget *
    elements, as brute force finds it (the knapsack keeps only undominated states: none of them is lost)."""
    rng = random.Random(2)
    for _ in range(80):
        layers, cands = rng.randint(1, 6), rng.randint(2, 4)
        sizes = [[rng.randint(1, 400) for _ in range(cands)] for _ in range(layers)]
        sens = [[rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(cands)] for _ in range(layers)]
        elements = rng.randint(50, 500)
        combos = list(itertools.product(range(cands), repeat=layers))
        spent = {c: 8 * sum(sizes[i][j] for i, j in enumerate(c)) for c in combos}
        budget = rng.choice([spent[rng.choice(combos)] / elements, rng.uniform(1, 64)])
        fit = [c for c in combos if spent[c] <= budget * elements]
        if not fit:
            with pytest.raises(ValueError, match="below the cheapest mix"):
                choose_layers_by_bytes(sens, sizes, elements, budget)
            continue
        pick = tuple(choose_layers_by_bytes(sens, sizes, elements, budget))
        assert spent[pick] <= budget * elements
        best = min(sum(sens[i][j] for i, j in enumerate(c)) for c in fit)
        assert sum(sens[i][j] for i, j in enumerate(pick)) == pytest.approx(best, abs=1e-12)


def test_choose_layers_by_bytes_refuses_negative_bytes_and_takes_numpy_ints():
    """Negative byte counts ended in 'min() arg is an empty sequence' from inside the knapsack; now they are refused
    by name. NumPy ints (bytes, elements) are taken, as tune's other integer arguments are (elements=np.int64(100)
    was refused as 'must be a positive int')."""
    import numpy as np

    with pytest.raises(ValueError, match="layer_bytes must be ints >= 0"):
        choose_layers_by_bytes([[1.0, 0.0], [1.0, 0.0]], [[10, 30], [-100, -50]], 10, 3.0)
    with pytest.raises(ValueError, match="layer_bytes must be ints >= 0"):
        choose_layers_by_bytes([[1.0, 0.0]], [[10.5, 20]], 100, 3.0)
    sizes = [[np.int64(10), np.int64(20)]]
    assert choose_layers_by_bytes([[1.0, 0.0]], sizes, np.int64(100), 1.6) == [1]  # 8 * 20 <= 1.6 * 100
    assert choose_layers_by_bytes([[1.0, 0.0]], sizes, 100, 1.5) == [0]

def test_choose_layers_by_bytes_keeps_a_budget_just_under_a_simple_fraction():
    """A budget one ulp under float(13/3) (4.333333333333332) was read as 13/3 (within 2**-50 of it): the mix of
    exactly 13/3 bits was chosen, its float avg_bits 4.333333333333333 above the budget. Now the budget is read as
    13/3 only when it is float(13/3) itself."""
    import math

    sens, sizes = [[1.0, 0.0]] * 3, [[4, 5], [4, 5], [4, 4]]  # 24 elements: avg_bits = bytes / 3
    under = math.nextafter(13 / 3, 0)
    for budget, bytes_ in ((under, 12), (13 / 3, 13)):
        pick = choose_layers_by_bytes(sens, sizes, 24, budget)
        spent = sum(sizes[i][j] for i, j in enumerate(pick))
        assert spent == bytes_ and 8 * spent / 24 <= budget


def test_choose_layers_refuses_what_it_can_not_solve():
    with pytest.raises(ValueError, match="below the cheapest candidate"):
        choose_layers([[1.0, 0.0]], [4.5, 8.5], 4.0)
    with pytest.raises(ValueError, match=r"must be \(layers, 2 candidates\)"):
        choose_layers([[1.0, 0.0, 2.0]], [4.5, 8.5], 9.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        choose_layers([[float("nan"), 0.0]], [4.5, 8.5], 9.0)
    assert choose_layers([[1.0, 0.0], [1.0, 0.0]], [4.5, 8.5], 8.5) == [1, 1]  # room for everything


def test_choose_layers_checks_the_budget_and_bits():
    """A NaN, infinite, bool or string budget (or NaN/inf bits) is a ValueError naming it. Before: inf raised
    Fraction's OverflowError, NaN its 'cannot convert NaN to integer ratio', True was a budget of 1 bit and '4'
    was parsed as 4 bits; numpy's float32 budget, a valid one, raised Fraction's TypeError."""
    np = pytest.importorskip("numpy")
    for bad in (float("nan"), float("inf"), -1.0, 0, True, "4"):
        with pytest.raises(ValueError, match="budget_bits must be a positive number"):
            choose_layers([[0.1, 0.0]], [2.0, 4.0], bad)
        with pytest.raises(ValueError, match="budget_bits must be a positive number"):
            choose_layers_by_bytes([[0.1, 0.0]], [[10, 20]], 80, bad)
    for bits in ([float("nan"), 4.0], [float("inf"), 4.0]):
        with pytest.raises(ValueError, match="bits must be finite numbers > 0"):
            choose_layers([[0.1, 0.0]], bits, 4.0)
    assert choose_layers([[0.1, 0.0]], [2.0, 4.0], np.float32(4.5)) == [1]
    assert choose_layers_by_bytes([[0.1, 0.0]], [[10, 20]], 80, np.float32(4.5)) == [1]


@torch.no_grad()
def test_tune_measures_each_layer_and_keeps_the_budget():
    """Each sensitivity entry is the KL evaluate() gives for that one-layer mix; the mix stays within the
    budget, spends its bits where the KL is, and its measured KL is the mix's own evaluate() KL."""
    model, ids = _llama(layers=3), _ids(300)
    res = tune(model, ids, ["int8-token", "int2-token", "int4-token"], 4.0, context=128, windows=2)
    assert res.candidates == ["int2-token", "int4-token", "int8-token"]  # cheapest first
    assert res.bits == [plan(model.config, 128, scheme=n, dtype_bytes=4)["avg_bits"] for n in res.candidates]
    probe = evaluate(model, ids, 128, [mixed_scheme(EXACT, {1: "int2-token"})], windows=2, attn_layers=[])
    assert res.sensitivity[1][0] == pytest.approx(probe["results"][0]["kl"], rel=1e-6)
    assert all(row[0] > row[1] > row[2] >= 0 for row in res.sensitivity)  # fewer bits, more damage
    assert res.avg_bits <= 4.0 and res.avg_bits == plan(model.config, 128, scheme=res.scheme, dtype_bytes=4)["avg_bits"]
    for i, c in enumerate(res.choice):
        assert res.scheme.for_layer(i).key == get_scheme(c).key
    assert len(set(res.choice)) > 1  # a 4-bit budget between 2.5 and 8.5 is spent unevenly here
    assert res.predicted_kl == pytest.approx(
        sum(res.sensitivity[i][res.candidates.index(c)] for i, c in enumerate(res.choice))
    )
    again = evaluate(model, ids, 128, [res.scheme], windows=2, attn_layers=[])
    assert res.measured_kl == pytest.approx(again["results"][0]["kl"], rel=1e-6)
    assert res.uniform["int2-token"]["kl"] > res.measured_kl > res.uniform["int8-token"]["kl"]
    assert KVScheme.from_json(res.scheme.to_json()) == res.scheme


def _gemma2_sliding():
    """A tiny Gemma2: layer 0 full attention, layer 1 sliding (W=32), float32."""
    import transformers
    from test_evaluate import VOCAB

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=32, max_position_embeddings=4096,
        layer_types=["full_attention", "sliding_attention"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return transformers.Gemma2ForCausalLM(cfg).eval()


@torch.no_grad()
def test_tune_budget_is_the_bits_plan_reports_at_the_tuning_context():
    """The budget holds the mix's real bytes at the tuning context: TuneResult.avg_bits (and each candidate's
    bits) is kvbits plan's avg_bits there, <= the budget. Before, each candidate was priced by its asymptotic
    bits and layers weighed alike: on a Gemma2 whose layer 1 slides (W=32) a 7.0-bit budget at 512 tokens
    chose int8 for layer 0 and int2 for layer 1, reported 7.0 bits and held 9.657 (plan); with kivi-2 (its
    128-token fp32 residual priced 0) a 3.0-bit budget at 256 tokens chose kivi-2 everywhere, reported 3.0
    and held 17.5 bits."""
    model = _gemma2_sliding()
    res = tune(model, _ids(600), ["int2-token", "int8-token"], 7.0, context=512, check=False)
    planned = plan(model.config, 512, scheme=res.scheme, dtype_bytes=4)["avg_bits"]
    assert res.avg_bits == planned <= 7.0 and res.meta["dtype_bytes"] == 4
    assert res.bits == [plan(model.config, 512, scheme=n, dtype_bytes=4)["avg_bits"] for n in res.candidates]
    assert res.choice == ["int2-token", "int8-token"]  # int8 on the 31 tokens of the sliding layer is what fits
    llama = _llama(layers=3)
    res = tune(llama, _ids(400), ["int2-token", "kivi-2", "int8-token"], 3.0, context=256, check=False)
    assert res.bits[res.candidates.index("kivi-2")] == 17.5  # 128 of 256 tokens in float32
    assert res.avg_bits == plan(llama.config, 256, scheme=res.scheme, dtype_bytes=4)["avg_bits"] <= 3.0
    # served in bfloat16 (dtype_bytes=2, --dtype-bytes 2): kivi-2's float residual is priced at 2 bytes a value,
    # as kvbits plan --dtype-bytes 2 counts it, although the passes ran in float32
    res = tune(llama, _ids(400), ["int2-token", "kivi-2", "int8-token"], 10.0, context=256, check=False, dtype_bytes=2)
    assert res.bits[res.candidates.index("kivi-2")] == 9.5 and res.meta["dtype_bytes"] == 2
    assert res.avg_bits == plan(llama.config, 256, scheme=res.scheme, dtype_bytes=2)["avg_bits"] <= 10.0
    with pytest.raises(ValueError, match="dtype_bytes must be 1, 2, 4 or 8"):
        tune(llama, _ids(400), ["int2-token", "int8-token"], 10.0, context=256, check=False, dtype_bytes=3)


def test_tune_reads_the_models_dtype_as_evaluate_does():
    """tune read the model's dtype from its first parameter, evaluate from its first floating one: on a float32
    model whose first parameter is an int8 (a quantized weight, an integer buffer) tune priced kivi-2's 128
    full-precision tokens at 1 byte a value (8.0 bits at 128 tokens) where kvbits eval counted 4 (32.0 bits)."""
    from kvbits.evaluate.measures import plan_shape_of

    model = _llama(layers=2)
    int8 = torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    model.model.register_parameter("qweight", int8)
    assert next(model.model.parameters()).dtype == torch.int8
    res = tune(model, _ids(200), ["kivi-2", "int8-token"], 40.0, context=128, check=False)
    assert res.meta["dtype_bytes"] == plan_shape_of(model.config, model).dtype_bytes == 4
    assert res.bits[res.candidates.index("kivi-2")] == plan(model.config, 128, scheme="kivi-2", dtype_bytes=4)["avg_bits"]



def test_tune_prices_the_budget_at_the_serving_context(caplog):
    """serve_context= (--serve-context) prices the budget where the mix is served. Before, the bits were counted at
    the tuning context only: on the Gemma2 whose layer 1 slides (W=32) a mix within 8.1 bits at 64 tokens (int8 on
    the full layer 0) held 9.657 bits at 512 and 9.955 at 4096, silently. The default (the tuning context) is
    unchanged and now warns once that the mix exceeds the budget at the model's max context."""
    import logging

    model = _gemma2_sliding()
    table = [[1.0, 0.0], [0.5, 0.0]]  # int8 on layer 0 first, then on layer 1
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, {"model": "m", "data": "d"}))
    cands = ["int2-token", "int8-token"]
    with swept, caplog.at_level(logging.WARNING, logger="kvbits.tune"):
        res = tune(model, None, cands, 8.1, context=64, check=False)
    assert res.choice == ["int8-token", "int2-token"] and res.meta["serve_context"] == 64
    assert res.avg_bits == plan(model.config, 64, scheme=res.scheme, dtype_bytes=4)["avg_bits"] <= 8.1
    assert plan(model.config, 4096, scheme=res.scheme, dtype_bytes=4)["avg_bits"] > 9.9  # what it holds served
    warned = [r.getMessage() for r in caplog.records if "max context" in r.getMessage()]
    assert len(warned) == 1 and "9.955 average bits" in warned[0] and "serve_context=" in warned[0], warned
    caplog.clear()
    with swept, caplog.at_level(logging.WARNING, logger="kvbits.tune"):
        res = tune(model, None, cands, 8.1, context=64, check=False, serve_context=512)
    assert res.meta["serve_context"] == 512 and res.meta["context"] == 64
    assert res.avg_bits == plan(model.config, 512, scheme=res.scheme, dtype_bytes=4)["avg_bits"] <= 8.1
    assert res.bits == [plan(model.config, 512, scheme=n, dtype_bytes=4)["avg_bits"] for n in res.candidates]
    assert res.choice == ["int2-token", "int8-token"]  # int8 fits only on the sliding layer's 31 tokens at 512
    assert not [r for r in caplog.records if "max context" in r.getMessage()]  # priced where served: no warning
    with pytest.raises(ValueError, match="serve_context must be a positive int"):
        tune(model, None, cands, 8.1, context=64, check=False, serve_context=0)

def test_tune_reports_avg_bits_within_an_exactly_met_budget():
    """A budget exactly met by the mix (k int8 layers among n int4, head dim 96: 4.333 and 8.333 bits) is
    kept to in the reported avg_bits too. Before, avg_bits was a float mean of the layers' bits and exceeded
    the budget by 1 ulp for 233 of 496 such budgets (n=2, k=1: 6.333333333333334 > 6.333333333333333)."""
    from fractions import Fraction

    from transformers import LlamaConfig, LlamaForCausalLM

    over = []
    for n in (2, 5, 6, 7):
        cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=n,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=96)  # fmt: skip
        model = LlamaForCausalLM(cfg)
        for k in range(1, n):
            budget = float(Fraction(k * 25 + (n - k) * 13, 3 * n))
            table = [[1.0, 0.0]] * k + [[0.0, 0.0]] * (n - k)
            summary = {"model": "m", "data": "d"}
            with mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, summary)):
                res = tune(model, None, ["int4-token", "int8-token"], budget, context=128, check=False)
            assert res.choice == ["int8-token"] * k + ["int4-token"] * (n - k)
            if res.avg_bits > budget:
                over.append((n, k, budget, res.avg_bits))
    assert not over


def test_tune_names_a_non_finite_sensitivity():
    """A probe whose passes went NaN (a KL of nan in the sweep) ended the run with 'sensitivities must be finite
    and >= 0', naming neither the layer nor the candidate; now both are named."""
    model = _llama(layers=3)
    table = [[0.1, 0.0], [float("nan"), 0.0], [0.2, 0.0]]
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, {"model": "m", "data": "d"}))
    with swept, pytest.raises(ValueError, match="layer 1 stored by 'int4-token' is nan"):
        tune(model, None, ["int4-token", "int8-token"], 6.0, context=128, check=False)


def test_tune_refuses_a_name_its_json_could_not_be_read_back_as():
    """name= is checked before any pass: a candidate's name (before: ValueError 'listed twice' after the whole
    sweep), a preset's ('fp16') or a mixed string of presets ('int8-token,0=fp16') (before: accepted, and the
    scheme JSON written was refused on read-back) are refused; another name is kept."""
    model, ids = _llama(), _ids(200)
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", side_effect=AssertionError("swept"))
    for name, match in (("int4-token", "is a candidate's"), ("fp16", "name of a kvbits preset"),
                        ("int8-token,0=fp16", "mixed scheme of kvbits presets"), ("", "non-empty string")):  # fmt: skip
        with swept, pytest.raises(ValueError, match=match):
            tune(model, ids, ["int2-token", "int4-token"], 4.5, context=64, name=name)
    res = tune(model, ids, ["int2-token", "int4-token"], 4.5, context=64, name="int4,0=mine", check=False)
    assert get_scheme(res.scheme.to_dict()).name == "int4,0=mine"


def test_tune_refuses_bad_candidates_and_budgets():
    model, ids = _llama(), _ids(200)
    for cands, match in ((["int4-token"], "at least two"), (["int4-token", "kvquant-4"], "kvbits calibrate"),
                         (["int4-token", "int4-token,0=fp16"], "flat schemes"),
                         (["int4-token", "int8-token", "int4-token"], "'int4-token' is listed twice")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            tune(model, ids, cands, 5.0, context=64)
    with pytest.raises(ValueError, match="positive number"):
        tune(model, ids, ["int4-token", "int8-token"], float("nan"), context=64)
    with pytest.raises(ValueError, match="below the cheapest"):
        tune(model, ids, ["int4-token", "int8-token"], 2.0, context=64, check=False)
    # refused before the sensitivity sweep: it would run a forward pass per layer and candidate
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", side_effect=AssertionError("swept"))
    with swept, pytest.raises(ValueError, match="below the cheapest"):
        tune(model, ids, ["int4-token", "int8-token"], 2.0, context=64, check=False)


def test_cli_tune_writes_a_scheme_every_command_reads(tmp_path, capsys, monkeypatch):
    """kvbits tune --out writes the mix as a scheme JSON (plan reads it) and the measurements beside it."""
    from kvbits import tune as tune_pkg

    model = _llama()
    real = tune_pkg.tune

    def on_tiny(_model, _data, *a, **kw):  # the CLI loads models by name; hand it the tiny one
        return real(model, _ids(200), *a, **kw)

    monkeypatch.setattr(tune_pkg, "tune", on_tiny)
    out = tmp_path / "mix.json"
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "64", "--candidates", "int8-token",
            "--candidates", "int2-token", "--budget-bits", "6", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "average bits at 64 tokens (budget 6)" in capsys.readouterr().out
    scheme = get_scheme(str(out))
    record = json.loads((tmp_path / "mix.json.tune.json").read_text())
    assert [get_scheme(c).key for c in record["choice"]] == [scheme.for_layer(i).key for i in range(2)]
    assert len(record["sensitivity"]) == 2 and record["avg_bits"] <= 6
    # the record's keys are those `kvbits tune --help` lists (it left out "scheme")
    import re

    from kvbits.tune.cli import EPILOG

    listed = EPILOG.split("sensitivity table", 1)[1].split("--json prints that record")[0]
    assert set(record) == set(re.findall(r'\{?"(\w+)"(?: \([^)]*\))?[,}]', listed)), listed
    assert main(["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--context", "100",
                 "--scheme", str(out)]) == 0  # fmt: skip
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--budget-bits", "0", "--out", str(out)])
    (tmp_path / "d.json").mkdir()
    for bad, msg in ((tmp_path / "mix.txt", "expected a .json path"), (tmp_path / "d.json", "is a folder")):
        assert main([*argv[:-2], "--out", str(bad)]) != 0  # refused before the model loads
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "mix.txt").exists()
    assert main([*argv[:-2], "--dtype-bytes", "2", "--json", "--no-check"]) == 0  # the serving dtype prices tokens
    assert json.loads(capsys.readouterr().out)["meta"]["dtype_bytes"] == 2
    assert record["meta"]["serve_context"] == 64  # priced at --context unless --serve-context is given
    assert main([*argv[:-2], "--serve-context", "1k", "--json", "--no-check"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert served["meta"]["serve_context"] == 1024 and served["meta"]["context"] == 64


@torch.no_grad()
def test_refinement_rounds_measure_around_the_mix_and_keep_the_best():
    """rounds=2: the second round's costs are the mix's marginal KLs (checked against evaluate() of one
    switched layer), each round's mix is measured, and the kept mix is the best measured one."""
    from kvbits.tune import marginal_sensitivity

    model, ids = _llama(layers=3), _ids(300)
    one = tune(model, ids, ["int8-token", "int2-token", "int4-token"], 4.0, context=128, windows=2)
    two = tune(model, ids, ["int8-token", "int2-token", "int4-token"], 4.0, context=128, windows=2, rounds=2)
    assert two.rounds[0]["choice"] == one.choice and two.rounds[0]["measured_kl"] == pytest.approx(one.measured_kl)
    assert all(r["measured_kl"] >= two.measured_kl for r in two.rounds if "measured_kl" in r)
    assert two.avg_bits <= 4.0 + 1e-9
    pick = [one.candidates.index(c) for c in one.choice]
    cands = [get_scheme(c) for c in one.candidates]
    costs, current = marginal_sensitivity(model, ids, cands, pick, context=128, windows=2)
    assert current == pytest.approx(one.measured_kl, rel=1e-6)
    for got, want in zip(two.rounds[0]["marginal_sensitivity"], costs):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert all(min(row) == 0 for row in costs)  # shifted per layer
    i, j = 0, (pick[0] + 1) % 3  # switch layer 0 alone and measure it directly
    switched = mixed_scheme(cands[pick[1]], {k: cands[j if k == i else p] for k, p in enumerate(pick)})
    kl = evaluate(model, ids, 128, [switched], windows=2, attn_layers=[])["results"][0]["kl"]
    row = costs[0]
    assert row[j] - row[pick[0]] == pytest.approx(kl - current, rel=1e-5, abs=1e-9)
    with pytest.raises(ValueError, match="rounds must be"):
        tune(model, ids, ["int8-token", "int2-token"], 4.0, context=128, rounds=0)


def test_sensitivity_tables_of_another_layer_count_are_refused_before_any_pass():
    """On a 2-layer model, layer_sensitivity(n_layers=1) and marginal_sensitivity(pick=[0]) returned a 1-row table,
    silently (3 failed only inside, on a mixed scheme's override); both now refuse, naming the model's count,
    before any pass."""
    from kvbits.evaluate import runner
    from kvbits.tune import layer_sensitivity, marginal_sensitivity

    model, ids = _llama(), _ids(200)
    cands = [get_scheme("int2-token"), get_scheme("int4-token")]
    with mock.patch.object(runner, "evaluate", side_effect=AssertionError("measured")):
        for n in (1, 3):
            with pytest.raises(ValueError, match=rf"n_layers asks for {n} layer\(s\), but the model has 2"):
                layer_sensitivity(model, ids, cands, n, context=64)
            with pytest.raises(ValueError, match=rf"pick lists {n} layer\(s\), but the model has 2"):
                marginal_sensitivity(model, ids, cands, [0] * n, context=64)


def test_marginal_sensitivity_refuses_a_pick_out_of_range():
    """A pick index of -1 stored the layer by the last candidate and measured around that, silently (its row had no
    0.0 for the current storage); one past the end failed inside with an IndexError. Both are refused before any
    pass. And tune takes NumPy-int rounds (rounds=np.int64(1) was refused while serve_context= took NumPy ints)."""
    import numpy as np

    from kvbits.evaluate import runner
    from kvbits.tune import marginal_sensitivity

    model, ids = _llama(), _ids(200)
    cands = [get_scheme("int2-token"), get_scheme("int4-token")]
    with mock.patch.object(runner, "evaluate", side_effect=AssertionError("measured")):
        for pick in ([-1, 0], [2, 0], [0, 1.0], []):
            with pytest.raises(ValueError, match=r"pick must list one candidate index per layer, each in 0\.\.1"):
                marginal_sensitivity(model, ids, cands, pick, context=64)
    table = [[1.0, 0.0], [0.0, 0.0]]
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, {"model": "m", "data": "d"}))
    with swept:
        res = tune(model, ids, ["int2-token", "int4-token"], 4.5, context=64, rounds=np.int64(1), check=False)
    assert res.choice == ["int4-token", "int2-token"]

@torch.no_grad()
def test_refinement_rounds_without_the_check_measure_the_last_mix(capsys):
    """rounds=2 with check=False (--no-check) returned the second round's mix unmeasured (measured_kl None, no
    "measured_kl" in its round) although the first round's was measured and may be the better one: the best
    measured mix was kept only with the check (here the returned mix measured KL 0.00188, the first round's
    0.00032). Now the last round's new mix is measured alone (no uniform
    candidates) and the best is kept; the printout says which round predicted the kept mix's KL."""
    from kvbits.tune import cli as tune_cli
    from kvbits.tune import search

    model, ids = _llama(layers=2), _ids(200)
    real = search.marginal_sensitivity

    def swapped(*a, **kw):  # costs that make the next round swap int2 and int8 between the two layers
        current, pick = real(*a, **kw)[1], a[3]
        return [[0.0 if j != pick[i] else 1.0 for j in range(2)] for i in range(2)], current

    with mock.patch.object(search, "marginal_sensitivity", swapped):
        res = tune(model, ids, ["int2-token", "int8-token"], 6.0, context=128, rounds=2, check=False)
    assert len(res.rounds) == 2 and res.rounds[0]["choice"] == res.rounds[1]["choice"][::-1]
    kls = [r["measured_kl"] for r in res.rounds]
    mixes = [mixed_scheme(get_scheme(r["choice"][0]), {1: r["choice"][1]}) for r in res.rounds]
    assert kls[1] == pytest.approx(evaluate(model, ids, 128, [mixes[1]], attn_layers=[])["results"][0]["kl"], rel=1e-6)
    best = min(range(2), key=kls.__getitem__)
    assert res.measured_kl == kls[best] and res.choice == res.rounds[best]["choice"] and res.uniform == {}
    capsys.readouterr()
    tune_cli._print(res, None)
    out = capsys.readouterr().out
    assert f"measured {res.measured_kl:.4g}" in out and "uniform" not in out
    assert ("sum of single-layer KLs" in out) == (best == 0) and ("round 2, from marginal KLs" in out) == (best == 1)
    one = tune(model, ids, ["int2-token", "int8-token"], 6.0, context=128, check=False)  # one round: not measured
    assert one.measured_kl is None and "measured_kl" not in one.rounds[0]
    tune_cli._print(one, None)
    assert "not measured (--no-check)" in capsys.readouterr().out


# ------------------------------------------------------------------------------ calibrated candidates
CALIBRATED = ["fp16", "kvquant-4", "kvquant-2"]


def test_cli_tune_out_replaces_only_its_own_files(tmp_path, capsys, monkeypatch):
    """A tune --out over an earlier calibrated tune's left <out>.calibration/ beside a mix that calibrates no layer
    (a stale folder the epilog's `eval --calibration` would pick up); now it is removed. An existing --out that
    kvbits tune did not write (no <out>.tune.json) was silently overwritten; now refused unless --overwrite."""
    from kvbits import tune as tune_pkg
    from kvbits.tune.cli import calibration_dir

    model = _llama()
    real = tune_pkg.tune
    monkeypatch.setattr(tune_pkg, "tune", lambda _m, _d, *a, **kw: real(model, _ids(200), *a, **kw))
    out = tmp_path / "mix.json"
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "64", "--candidates", "int8-token",
            "--candidates", "int2-token", "--budget-bits", "6", "--no-check", "--out", str(out)]  # fmt: skip
    out.write_text('{"not": "a tune output"}\n')
    assert main(argv) == 2 and "not written by kvbits tune" in capsys.readouterr().err
    assert out.read_text() == '{"not": "a tune output"}\n'
    cal = calibration_dir(out)
    cal.mkdir()
    for name in ("calibration.json", "calibration.safetensors"):
        (cal / name).write_text("from an earlier calibrated mix")
    assert main([*argv, "--overwrite"]) == 0
    assert not cal.exists() and get_scheme(str(out)).is_mixed
    assert json.loads((tmp_path / "mix.json.tune.json").read_text())["calibration"] is None
    capsys.readouterr()
    assert main(argv) == 0  # its own earlier output: replaced without --overwrite


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A 3-layer tiny Llama, its token ids, and kvquant-4 / kvquant-2 calibrations of it (objects, saved)."""
    from kvbits.calibrate import calibrate

    model, ids = _llama(layers=3), _ids(300)
    root = tmp_path_factory.mktemp("tune-cal")
    arts = {
        n: calibrate(model, ids, n, context=128, windows=2, fisher=False, kmeans_iterations=4, out_dir=str(root / n))
        for n in CALIBRATED[1:]
    }
    return model, ids, arts


def _calibrate_like(model, ids, scheme):
    """An independent calibration of ``scheme`` itself (mixes are fitted per layer by their own scheme)."""
    from kvbits.calibrate import calibrate

    return calibrate(model, ids, scheme, context=128, windows=2, fisher=False, kmeans_iterations=4)


@torch.no_grad()
def test_tune_mixes_calibrated_candidates(calibrated):
    """Each probe of a calibrated candidate runs with layer i's own tensors of that candidate: its KL equals
    evaluate()'s with the probe calibrated directly; the mix's measured KL equals evaluate()'s with the mix
    calibrated directly, and the uniform ones with their own artifacts; the result carries the mix's
    composed artifact, each layer's tensors those of its candidate's calibration."""
    model, ids, arts = calibrated
    res = tune(model, ids, CALIBRATED, 5.0, context=128, windows=2, calibrations=arts)
    assert res.candidates == ["kvquant-2", "kvquant-4", "fp16"]
    for i, name in ((1, "kvquant-2"), (2, "kvquant-4")):  # layers past 0: layer 0's tensors would not do
        probe = mixed_scheme(EXACT, {i: name})
        direct = evaluate(model, ids, 128, [probe], windows=2, attn_layers=[],
                          calibration=_calibrate_like(model, ids, probe))  # fmt: skip
        assert res.sensitivity[i][res.candidates.index(name)] == pytest.approx(direct["results"][0]["kl"], rel=1e-6)
    assert all(row[0] > row[1] > row[2] >= 0 for row in res.sensitivity)
    assert res.avg_bits <= 5.0 + 1e-9 and {"kvquant-4", "kvquant-2"} <= set(res.choice)
    again = evaluate(model, ids, 128, [res.scheme], windows=2, attn_layers=[],
                     calibration=_calibrate_like(model, ids, res.scheme))  # fmt: skip
    assert res.measured_kl == pytest.approx(again["results"][0]["kl"], rel=1e-6)
    uniform = evaluate(model, ids, 128, ["kvquant-2"], windows=2, attn_layers=[], calibration=arts["kvquant-2"])
    assert res.uniform["kvquant-2"]["kl"] == pytest.approx(uniform["results"][0]["kl"], rel=1e-6)
    cal = res.calibration
    cal.check_scheme(res.scheme)
    for i, name in enumerate(res.choice):
        assert res.to_dict()["calibration"]["layers"][i]["from"] == name
        if name == "fp16":
            assert not any(n.startswith(f"layers.{i}.") for n in cal.tensors)
            continue
        mine = {n: t for n, t in cal.tensors.items() if n.startswith(f"layers.{i}.")}
        assert mine and all(torch.equal(t, arts[name].tensors[n]) for n, t in mine.items())
    assert res.meta["calibrations"] == {n: str(a.path) for n, a in arts.items()}
    two = tune(model, ids, CALIBRATED, 5.0, context=128, windows=2, calibrations=arts, rounds=2)  # mixes composed
    assert two.rounds[0]["measured_kl"] == pytest.approx(res.measured_kl, rel=1e-6) and two.calibration is not None
    uncal = tune(model, ids, ["int8-token", "int4-token"], 6.0, context=128, check=False)
    assert uncal.calibration is None and uncal.to_dict()["calibration"] is None


@torch.no_grad()
def test_refinement_rounds_without_the_check_measure_a_calibrated_mix(calibrated):
    """rounds=2 with check=False (--no-check) and calibrated candidates: the last round's new mix, measured alone,
    was handed every candidate's calibration besides its own, and evaluate refused the run after all the rounds
    had run ("calibration given for kvquant-2, kvquant-4, which is not among the schemes evaluated (tuned-5)").
    Now only the measured schemes' artifacts are passed; the mix measures as evaluate() measures it."""
    from kvbits.tune import search

    model, ids, arts = calibrated
    real = search.marginal_sensitivity

    def flipped(*a, **kw):  # costs that make the next round move every layer off its current candidate
        current, pick = real(*a, **kw)[1], a[3]
        return [[0.0 if j != pick[i] else 1.0 for j in range(2)] for i in range(3)], current

    with mock.patch.object(search, "marginal_sensitivity", flipped):
        res = tune(model, ids, CALIBRATED[1:], 5.0, context=128, windows=2, rounds=2, check=False, calibrations=arts)
    assert len(res.rounds) == 2 and all("measured_kl" in r for r in res.rounds) and res.uniform == {}
    last = _mix_of(res.rounds[1]["choice"])
    want = evaluate(model, ids, 128, [last], windows=2, attn_layers=[], calibration=_calibrate_like(model, ids, last))
    assert res.rounds[1]["measured_kl"] == pytest.approx(want["results"][0]["kl"], rel=1e-6)


def _mix_of(choice: list[str]) -> KVScheme:
    return mixed_scheme(get_scheme(choice[0]), {i: c for i, c in enumerate(choice) if i}, name="last")


def test_tune_refuses_calibrated_candidates_without_calibration(calibrated, monkeypatch):
    """A calibrated candidate with no calibration, or one with optional calibrated sides beside given ones,
    is refused before any pass; a calibration of another scheme, or for no candidate, too."""
    from kvbits.evaluate import runner

    model, ids, arts = calibrated

    def no_pass(*a, **kw):
        raise AssertionError("a pass ran before the refusal")

    monkeypatch.setattr(runner, "evaluate", no_pass)
    with pytest.raises(ValueError, match=r"candidate 'kvquant-2' \(key and value\) needs calibrated .*kvbits calibrate"):
        tune(model, ids, CALIBRATED, 5.0, context=128, calibrations={"kvquant-4": arts["kvquant-4"]})
    with pytest.raises(ValueError, match="'fp8-e4m3' has calibrated sides .* and no calibration"):
        tune(model, ids, ["fp8-e4m3", "kvquant-4"], 8.0, context=128, calibrations=[arts["kvquant-4"]])
    with pytest.raises(ValueError, match="not among the schemes evaluated"):
        tune(model, ids, ["int4-token", "kvquant-4"], 8.0, context=128, calibrations=list(arts.values()))
    with pytest.raises(ValueError, match="re-run kvbits calibrate"):
        tune(model, ids, ["int4-token", "kvquant-4"], 8.0, context=128, calibrations={"kvquant-4": arts["kvquant-2"]})


def test_cli_tune_writes_the_mixs_calibration_for_eval(calibrated, tmp_path, capsys, monkeypatch):
    """--calibration DIR (matched by the scheme each was made for) reaches tune; --out writes the mix's
    composed calibration beside the scheme JSON, the record says where, and evaluate() takes the two as
    kvbits eval --scheme OUT --calibration DIR would, measuring the KL tune measured."""
    from kvbits import tune as tune_pkg
    from kvbits.calibrate import load_calibration
    from kvbits.tune.cli import calibration_dir

    model, ids, arts = calibrated
    real = tune_pkg.tune
    monkeypatch.setattr(tune_pkg, "tune", lambda _m, _d, *a, **kw: real(model, ids, *a, **kw))
    out = tmp_path / "kvq.json"
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "128", "--windows", "2", "--budget-bits", "5",
            *(x for n in CALIBRATED for x in ("--candidates", n)),
            *(x for a in arts.values() for x in ("--calibration", str(a.path))), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    folder = tmp_path / "kvq.calibration"
    assert calibration_dir(out) == folder and calibration_dir("mix") == calibration_dir("mix.json")
    assert "--calibration" in " ".join(capsys.readouterr().out.split())
    record = json.loads((tmp_path / "kvq.json.tune.json").read_text())
    assert record["calibration"]["path"] == str(folder)
    scheme = get_scheme(str(out))
    art = load_calibration(folder, model_config=model.config, scheme=scheme)
    assert [x and x["from"] for x in art.meta["composed"]["layers"]] == record["choice"]
    kl = evaluate(model, ids, 128, [str(out)], windows=2, attn_layers=[], calibration=str(folder))["results"][0]["kl"]
    assert kl == pytest.approx(record["measured_kl"], rel=1e-6)


def _strict(text: str) -> object:
    """``text`` parsed as strict JSON (RFC 8259): bare NaN / Infinity, which jq and JSON.parse reject, fail."""

    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def test_cli_tune_writes_a_non_finite_kl_as_strict_json(tmp_path, capsys, monkeypatch):
    """A NaN measured KL (a mix whose check pass gave non-finite outputs) is written, in <out>.tune.json and by
    --json, as the string "NaN" (kvbits._json.dumps), not Python's bare NaN token; kvbits._json.loads reads it
    back as NaN."""
    import math

    from kvbits import _json
    from kvbits import tune as tune_pkg

    model = _llama()
    real = tune_pkg.tune

    def nan_kl(_model, _data, *a, **kw):
        res = real(model, _ids(200), *a, **kw)
        res.measured_kl = math.nan
        res.uniform = {"int8-token": {"kl": math.inf, "avg_bits": 8.0}}
        return res

    monkeypatch.setattr(tune_pkg, "tune", nan_kl)
    out = tmp_path / "mix.json"
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "64", "--candidates", "int8-token",
            "--candidates", "int2-token", "--budget-bits", "6", "--no-check", "--out", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    for text in (capsys.readouterr().out, (tmp_path / "mix.json.tune.json").read_text()):
        record = _strict(text)
        assert record["measured_kl"] == "NaN" and record["uniform"]["int8-token"]["kl"] == "+Inf"
        back = _json.loads(text)
        assert math.isnan(back["measured_kl"]) and back["uniform"]["int8-token"]["kl"] == math.inf


@torch.no_grad()
def test_tune_records_the_windows_it_measured():
    """meta["windows"] was the count asked for: 8 windows of 128 tokens on a 300-token text were recorded as 8
    while evaluate measured the 2 the text holds (and said so); now the windows measured."""
    res = tune(_llama(layers=2), _ids(300), ["int2-token", "int8-token"], 6.0, context=128, windows=8, check=False)
    assert res.meta["windows"] == 2


@torch.no_grad()
def test_tune_probes_only_the_layers_that_store_kv():
    """A hybrid model (LFM2: convolution layers 0 and 2) was probed in every layer: a pass per candidate for each
    convolution layer, which stores no K/V and measured KL 0 (half of the sweep's passes here, 10 of 16 layers on
    LFM2-1.2B). Now those layers are not probed (rows of 0.0), in the marginal rounds either; the choice is alike."""
    from test_evaluate_review import _lfm2

    from kvbits.evaluate import runner

    model, ids = _lfm2(), _ids(200)
    seen: list[str] = []
    real = runner.evaluate

    def spy(model, data, context, schemes, *a, **kw):
        seen.extend(s.name for s in schemes)
        return real(model, data, context, schemes, *a, **kw)

    with mock.patch.object(runner, "evaluate", spy):
        res = tune(model, ids, ["int2-token", "int4-token", "int8-token"], 5.0, context=64, rounds=2, check=False)
    probed = {int(n.split(",")[1].split("=")[0]) for n in seen if n.startswith(("exact,", "around,"))}
    assert probed == {1, 3}
    assert res.sensitivity[0] == res.sensitivity[2] == [0.0, 0.0, 0.0]
    assert all(x > 0 for i in (1, 3) for x in res.sensitivity[i])
    assert res.avg_bits <= 5.0


def test_tune_takes_dtype_bytes_and_serve_context_as_ints_only():
    """``dtype_bytes=2.0`` passed the ``in (1, 2, 4, 8)`` check (2.0 == 2) and went on as a float
    (``meta["dtype_bytes"]`` 2.0), ``True`` for serve_context was refused but a NumPy ``serve_context`` (what a sweep
    over ``np.arange`` gives) was refused as 'must be a positive int'. Now ints, NumPy's included, are taken and
    recorded as Python ints; floats and bools are refused saying what is expected."""
    import numpy as np

    llama = _llama(layers=2)
    table = [[1.0, 0.0], [0.5, 0.0]]
    swept = mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, {"model": "m", "data": "d"}))
    cands = ["int2-token", "int8-token"]
    with swept:
        res = tune(llama, None, cands, 6.0, context=64, check=False, dtype_bytes=np.int64(2),
                   serve_context=np.int64(128))  # fmt: skip
    assert res.meta["serve_context"] == 128 and type(res.meta["serve_context"]) is int
    assert res.meta["dtype_bytes"] == 2 and type(res.meta["dtype_bytes"]) is int
    for bad in (2.0, True):
        with swept, pytest.raises(ValueError, match=r"dtype_bytes must be 1, 2, 4 or 8 \(an int"):
            tune(llama, None, cands, 6.0, context=64, check=False, dtype_bytes=bad)
    for bad in (128.0, True):
        with swept, pytest.raises(ValueError, match="serve_context must be a positive int"):
            tune(llama, None, cands, 6.0, context=64, check=False, serve_context=bad)


# ------------------------------------------------------------------------------ --compare and progress lines
@torch.no_grad()
def test_tune_compares_uniform_schemes_that_are_not_candidates(caplog):
    """tune measured its mix and the uniform candidates, never a uniform scheme at the budget's bits that is not a
    candidate (on Qwen2.5-Coder-0.5B a kvquant-4/kvquant-2 mix at 3.68 bits measured KL 0.0955, uniform kvquant-3
    0.0680). compare= measures each beside the mix on the same windows (also without the check, which then measures
    the mix too), records {scheme, avg_bits, measured_kl} and warns when one within the budget beats the mix: here
    int4-token (5 bits) measures KL 1.9e-4 against the int8/int2 mix's 4.8e-4 at 6 bits."""
    import logging

    from kvbits.tune.search import better_compared

    model, ids = _llama(layers=2), _ids(200)
    with caplog.at_level(logging.WARNING, logger="kvbits.tune"):
        res = tune(model, ids, ["int8-token", "int2-token"], 6.0, context=64, check=False,
                   compare=["int4-token", "int3-token"])  # fmt: skip
    assert res.uniform == {} and res.measured_kl is not None  # no check: the mix measured for the comparison only
    assert [c["scheme"] for c in res.compare] == ["int4-token", "int3-token"]
    kls = evaluate(model, ids, 64, ["int4-token", "int3-token", res.scheme], attn_layers=[])["results"]
    for c, r in zip(res.compare, kls):
        assert set(c) == {"scheme", "avg_bits", "measured_kl"}
        assert c["measured_kl"] == pytest.approx(r["kl"], rel=1e-6)
        assert c["avg_bits"] == plan(model.config, 64, scheme=c["scheme"], dtype_bytes=4)["avg_bits"]
    assert res.measured_kl == pytest.approx(kls[2]["kl"], rel=1e-6)
    better = [c["scheme"] for c in better_compared(res)]
    assert "int4-token" in better  # 5 bits, within the 6-bit budget, and the lower KL
    assert better == [c["scheme"] for c in res.compare if c["measured_kl"] < res.measured_kl]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "below the tuned mix" in
              r.getMessage()]  # fmt: skip
    assert len(warned) == len(better) and "uniform int4-token (5.000 average bits" in warned[0]
    assert res.to_dict()["compare"] == res.compare
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbits.tune"):  # over the budget: measured, no warning
        over = tune(model, ids, ["int8-token", "int2-token"], 4.5, context=64, check=False, compare=["int4-token"])
    assert over.compare[0]["avg_bits"] > 4.5 and better_compared(over) == []
    assert not [r for r in caplog.records if "below the tuned mix" in r.getMessage()]
    for bad, msg in ((["int8-token"], "is a candidate"), (["int4-token", "int4-token"], "listed twice"),
                     (["int4-token,0=fp16"], "must be flat")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            tune(model, ids, ["int8-token", "int2-token"], 6.0, context=64, compare=bad)


def test_cli_tune_compare_and_progress_lines(tmp_path, capsys, monkeypatch):
    """--compare reaches tune, <out>.tune.json records "compare" and the console names the compared scheme that
    beats the mix. With --no-progress tune said nothing on stderr until the end (about 30 minutes on a loaded CPU);
    now one INFO line per probed layer and check pass, without -v, and the logger's level is restored after."""
    import logging

    from kvbits import tune as tune_pkg

    model = _llama()
    real = tune_pkg.tune
    monkeypatch.setattr(tune_pkg, "tune", lambda _m, _d, *a, **kw: real(model, _ids(200), *a, **kw))
    out = tmp_path / "mix.json"
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "64", "--candidates", "int8-token",
            "--candidates", "int2-token", "--budget-bits", "6", "--compare", "int4-token", "--compare", "int3-token",
            "--no-progress", "--out", str(out)]  # fmt: skip
    level = logging.getLogger("kvbits.tune").level
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert logging.getLogger("kvbits.tune").level == level
    for layer in (0, 1):
        assert f"sensitivity: window 1/1, layer {layer}/1 probed" in captured.err
    assert "check: window 1/1, int3-token measured" in captured.err
    record = json.loads((tmp_path / "mix.json.tune.json").read_text())
    assert [c["scheme"] for c in record["compare"]] == ["int4-token", "int3-token"]
    assert all(set(c) == {"scheme", "avg_bits", "measured_kl"} for c in record["compare"])
    assert "compared: int4-token" in captured.out
    if record["compare"][0]["measured_kl"] < record["measured_kl"]:
        assert "(within the budget, lower KL than the mix)" in captured.out and "below the tuned mix" in captured.err
    assert main([*argv, "--json"]) == 0
    assert [c["scheme"] for c in json.loads(capsys.readouterr().out)["compare"]] == ["int4-token", "int3-token"]


@torch.no_grad()
def test_tune_compares_a_calibrated_scheme_beside_a_calibrated_mix(calibrated):
    """The case --compare is for: kvquant-3 beside a kvquant-4 / kvquant-2 mix, its calibration matched among the
    candidates' by the scheme it was made for, measured as evaluate() measures it with that calibration; without
    its calibration it is refused before any pass, named as a compared scheme."""
    model, ids, arts = calibrated
    kvq3 = _calibrate_like(model, ids, "kvquant-3")
    with pytest.raises(ValueError, match=r"compared scheme 'kvquant-3' \(key and value\) needs calibrated"):
        tune(model, ids, CALIBRATED[1:], 3.7, context=128, calibrations=list(arts.values()), compare=["kvquant-3"])
    res = tune(model, ids, CALIBRATED[1:], 3.7, context=128, windows=2, check=False,
               calibrations=[*arts.values(), kvq3], compare=["kvquant-3"])  # fmt: skip
    want = evaluate(model, ids, 128, ["kvquant-3"], windows=2, attn_layers=[], calibration=kvq3)["results"][0]["kl"]
    assert res.compare[0]["scheme"] == "kvquant-3" and res.compare[0]["measured_kl"] == pytest.approx(want, rel=1e-6)
    assert set(res.meta["calibrations"]) == {"kvquant-4", "kvquant-2"}  # the mix's candidates' only


def test_tune_warns_when_the_budget_constrains_nothing(caplog):
    """A budget at or above the dearest mix (every layer int8-token: 9 bits here) constrains nothing: the sweep then
    only picks each layer's least-KL candidate. Before, a 50-bit budget (say, one given in bytes) ran the whole sweep
    and reported 'budget 50' without a word; now one warning names the dearest mix's bits. A budget below it: none."""
    import logging

    model = _llama(layers=3)
    table = [[0.3, 0.1, 0.0]] * 3
    cands = ["int2-token", "int4-token", "int8-token"]
    for budget, warned in ((50.0, True), (9.0, True), (8.9, False)):
        swept = mock.patch("kvbits.tune.search.layer_sensitivity", return_value=(table, {"model": "m", "data": "d"}))
        caplog.clear()
        with swept, caplog.at_level(logging.WARNING, logger="kvbits.tune"):
            res = tune(model, None, cands, budget, context=64, check=False)
        lines = [r.getMessage() for r in caplog.records if "constrains nothing" in r.getMessage()]
        assert len(lines) == int(warned), (budget, lines)
        if warned:
            assert "9 average bits at 64 tokens" in lines[0] and res.choice == ["int8-token"] * 3


def test_cli_tune_progress_lines_name_kvbits_tune(tmp_path, capsys, monkeypatch):
    """With the bar on and stderr not a terminal (a log file), the plain stage lines of tune's passes said
    ``kvbits eval: window 1/1: exact,0=int8-token ...`` although the user ran ``kvbits tune``; they now name it."""
    from kvbits import tune as tune_pkg

    model = _llama()
    real = tune_pkg.tune
    monkeypatch.setattr(tune_pkg, "tune", lambda _m, _d, *a, **kw: real(model, _ids(200), *a, **kw))
    argv = ["tune", "--model", "tiny", "--data", "tiny", "--context", "64", "--candidates", "int8-token",
            "--candidates", "int2-token", "--budget-bits", "6", "--out", str(tmp_path / "mix.json")]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "kvbits tune: window 1/1: exact,0=int8-token (" in err
    assert "kvbits eval:" not in err
