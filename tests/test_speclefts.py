"""Scheme-argument left-overs: long names in errors, head-dim refusals before the weights load, sinks past the
context, and the scheme parsing of ``kvbits tune`` / ``kvbits monitor``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("spec", ["x" * 100_000, "q" * 100_000 + ".json", "int4-token,0=" + "z" * 100_000])
def test_a_long_unknown_scheme_name_is_cut_in_the_error(spec):
    """An unknown scheme of 100,000 characters was echoed whole (an error of 100,684 characters; a mixed one
    twice, 200,142; a 100,000-character .json name raised OSError "File name too long"): the name is now cut to
    ``SHOWN_CHARS`` with its length said."""
    from kvbits.schemes import get_scheme

    with pytest.raises(ValueError) as err:
        get_scheme(spec)
    assert len(str(err.value)) < 1200
    assert f"({len(spec)} characters)" in str(err.value)


def test_a_typo_keeps_its_suggestion():
    from kvbits.schemes import get_scheme

    with pytest.raises(ValueError, match=r"unknown scheme 'kivi2' \(did you mean 'kivi-2'\?\)"):
        get_scheme("kivi2")


def test_a_scheme_the_config_rules_out_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """kivi-2's values are grouped in 32 channels, the tiny Llama's head_dim is 16: evaluate refused it only after
    loading the weights (smollm2-135m, a group of 48 on head_dim 64: load_model 4.1 s under cProfile before the
    refusal, 0.8 s now). The config, read first, now refuses it."""
    import transformers

    from kvbits.evaluate import evaluate

    folder = tmp_path / "model"
    _tiny_llama().save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="scheme 'kivi-2' can not store head_dim 16: values"):
        evaluate(str(folder), ids, 64, ["int8-token", "kivi-2"], attn_layers=[])


@pytest.mark.parametrize("command", ["speed", "needle"])
def test_speed_and_needle_refuse_a_scheme_the_config_rules_out_before_the_weights_load(tmp_path, monkeypatch, command):
    """``kvbits speed`` and ``kvbits needle`` loaded the weights before refusing kivi-2 (values grouped in 32
    channels) on a head_dim of 16, which eval already refused from the config alone: they now pass it the same
    check, so the weights never load."""
    import transformers

    from kvbits.evaluate import needle_eval
    from kvbits.evaluate.speed import speed_eval

    folder = tmp_path / "model"
    _tiny_llama().save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(ValueError, match="scheme 'kivi-2' can not store head_dim 16: values"):
        if command == "speed":
            speed_eval(str(folder), [64], ["int8-token", "kivi-2"], tokens=4, data=str(text))
        else:
            needle_eval(str(folder), [256], ["int8-token", "kivi-2"], data=str(text))


def test_monitor_refuses_a_scheme_the_config_rules_out_before_the_weights_load(tmp_path, monkeypatch):
    """``watch`` (``kvbits monitor``) was the one model-running entry point not given eval's ``check_config``: kivi-2
    (values grouped in 32 channels) on a head_dim of 16 loaded the weights and was refused by the cache at its first
    update ("layer 0: ... group_size must be one of [2, 4, 8, 16]"). The config now refuses it, as eval's."""
    import transformers

    from kvbits.monitor import watch

    folder = tmp_path / "model"
    _tiny_llama().save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="scheme 'kivi-2' can not store head_dim 16: values"):
        watch(str(folder), ids, 64, "kivi-2")


def test_monitor_refuses_a_scheme_a_loaded_model_rules_out_from_its_config():
    """A model passed loaded (no config read first) is checked on its config before any decode step."""
    from kvbits.monitor import watch

    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="scheme 'kivi-2' can not store head_dim 16: values"):
        watch(_tiny_llama(), ids, 64, "kivi-2")


@pytest.mark.parametrize(
    "flags, role, peer",
    [
        (["--candidates", "hf-quanto-int4"], "candidate", "hf-quanto-int4"),
        (["--candidates", "int2-token", "--compare", "hf-quanto-int2"], "compare", "hf-quanto-int2"),
    ],
)
def test_tune_says_a_comparison_peer_is_not_a_scheme_it_can_mix(capsys, monkeypatch, flags, role, peer):
    """``kvbits tune --candidates hf-quanto-int4`` said "unknown scheme 'hf-quanto-int4'" (and listed the presets),
    though eval knows it as a comparison peer: it now says what the name is, why tune can not use it and what to
    pass instead, before the model loads."""
    from kvbits.cli import main
    from kvbits.tune import search

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(search, "_load", no_model)
    argv = ["tune", "--model", "smollm2-135m", "--data", "wikitext-2", "--context", "64", "--budget-bits", "6",
            "--candidates", "int8-token", *flags]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{role} {peer!r} is a comparison peer (transformers QuantizedCache" in err, err
    assert "unknown scheme" not in err and "pass a kvbits preset instead" in err and "--mode stream" in err, err
