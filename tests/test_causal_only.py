"""kvbits runs on decoder-only causal LMs: encoders (BERT, RoBERTa, DistilBERT) and encoder-decoders (T5, BART,
Whisper, MusicGen) are refused by one shared check (``kvbits.plan.config.check_causal_config`` on a config,
``kvbits._model.check_causal_lm`` on a model) at every entry point, naming the class and what is supported.

Before, ``kvbits plan`` planned a KV cache for BERT and planned Whisper's decoder without its cross-attention
K/V; ``kvbits speed`` / ``monitor`` ran a bidirectional BERT (exit 0); ``eval`` / ``needle`` / ``tune`` refused it
because "the logits kvbits computes ... differ"; ``evaluate`` ran ``BartForCausalLM`` (a decoder without its
encoder) to the end; ``analyze`` / ``calibrate`` blamed "fused QKV projections".
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _bytelevel import save_byte_tokenizer, write_sentences

from kvbits.analyze.sites import attention_sites
from kvbits.cli import main
from kvbits.evaluate import evaluate
from kvbits.evaluate.simulate import simulate
from kvbits.evaluate.speed import speed_eval
from kvbits.plan import load_shape, model_shape, plan

REFUSED = r"is not a decoder-only causal LM.*kvbits supports decoder-only causal language models"
SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
BART = {
    "vocab_size": 64, "d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
}  # fmt: skip


def _musicgen() -> transformers.MusicgenConfig:
    decoder = transformers.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64
    )
    return transformers.MusicgenConfig(
        text_encoder=transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16).to_dict(),
        audio_encoder=transformers.EncodecConfig().to_dict(),
        decoder=decoder.to_dict(),
    )


NOT_CAUSAL_CONFIGS = {
    "bert": lambda: transformers.BertConfig(**SMALL),
    "roberta": lambda: transformers.RobertaConfig(**SMALL),
    "distilbert": lambda: transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=32),
    "t5": lambda: transformers.T5Config(d_model=32, d_ff=32, num_layers=2, num_heads=2, d_kv=16),
    "bart": lambda: transformers.BartConfig(**BART),
    "whisper": lambda: transformers.WhisperConfig(**BART, max_source_positions=16, num_mel_bins=8),
    "musicgen": _musicgen,
    "bert-dict": lambda: {"model_type": "bert", **SMALL},
}


@pytest.mark.parametrize("make", NOT_CAUSAL_CONFIGS.values(), ids=NOT_CAUSAL_CONFIGS.keys())
def test_plan_refuses_encoders_and_encoder_decoders(make):
    """Planned before: BERT as if it had a KV cache, Whisper / T5 / MusicGen without their cross-attention K/V
    (Whisper-large-v3 at 448 tokens: ~73 MB of ~319 MB)."""
    with pytest.raises(ValueError, match=REFUSED):
        plan(make(), context=1024)


CAUSAL_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL),  # is_decoder False, yet causal
    "bert-decoder": lambda: transformers.BertConfig(**SMALL, is_decoder=True),
    "lfm2": lambda: transformers.Lfm2Config(**SMALL, num_key_value_heads=1),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2),
}


@pytest.mark.parametrize("make", CAUSAL_CONFIGS.values(), ids=CAUSAL_CONFIGS.keys())
def test_plan_still_plans_causal_decoders(make):
    assert load_shape(make()).n_layers == 2


def test_musicgen_decoder_is_still_read_by_model_shape():
    """``model_shape`` reads the decoder of a composite config (calibrate's model record); only planning it as the
    whole KV cache is refused."""
    assert model_shape(_musicgen()).n_layers == 3


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertLMHeadModel(transformers.BertConfig(**SMALL)).eval()


def _bart_decoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BartForCausalLM(transformers.BartConfig(**BART)).eval()


def _bart() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(**BART)).eval()


NOT_CAUSAL_MODELS = {"bert": _bert, "bart-decoder": _bart_decoder, "bart": _bart}


@pytest.mark.parametrize("make", NOT_CAUSAL_MODELS.values(), ids=NOT_CAUSAL_MODELS.keys())
def test_python_entry_points_refuse_models_that_are_not_causal_decoders(make):
    """``evaluate`` ran ``BartForCausalLM`` (cross-attention skipped: the decoder without its encoder) and
    ``BartForConditionalGeneration`` to the end; ``simulate`` patched a BERT."""
    model = make()
    ids = torch.randint(0, 64, (1, 32))
    name = type(model).__name__
    calls = {
        "evaluate": lambda: evaluate(model, ids, 32, ["int4-token"]),
        "speed_eval": lambda: speed_eval(model, 32, ["int4-token"], tokens=2, warmup=0, data=ids),
        "simulate": lambda: simulate(model, "int4-token").__enter__(),
        "": lambda: attention_sites(model),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=f"^{where + ': ' if where else ''}{name} {REFUSED}"):
            call()


def test_the_check_accepts_causal_and_hybrid_decoders():
    from kvbits._model import check_causal_lm

    for cfg in (transformers.LlamaConfig(**SMALL), transformers.GPTNeoXConfig(**SMALL),
                transformers.Lfm2Config(**SMALL, num_key_value_heads=1), transformers.BertConfig(**SMALL, is_decoder=True)):  # fmt: skip
        check_causal_lm(transformers.AutoModelForCausalLM.from_config(cfg))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    made = {
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)),
        "whisper": transformers.WhisperForConditionalGeneration(
            transformers.WhisperConfig(**BART, max_source_positions=16, num_mel_bins=8, pad_token_id=0)
        ),
    }
    for name, model in made.items():
        model.save_pretrained(root / name)
        save_byte_tokenizer(root / name)
    return root, write_sentences(root / "text.txt", 40)


@pytest.mark.parametrize("model", ["bert", "whisper"])
@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--context", "1k"],
        ["speed", "--context", "32", "--scheme", "int4-token", "--tokens", "2", "--warmup", "0"],
        ["monitor", "--context", "32", "--scheme", "kivi-2"],
        ["eval", "--context", "32", "--scheme", "int4-token"],
    ],
    ids=lambda c: c[0],
)
def test_cli_refuses_an_encoder_or_encoder_decoder_folder(folders, capsys, model, command):
    """``kvbits speed`` and ``monitor`` ran a BERT folder (exit 0) and reported figures for a model without a KV
    cache in decoding; ``eval`` refused it with "the logits kvbits computes ... differ"; all four ran Whisper's
    decoder without its encoder (or planned it without its cross-attention K/V)."""
    root, text = folders
    data = [] if command[0] == "plan" else ["--data", str(text)]
    status = main([command[0], "--model", str(root / model), *data, *command[1:]])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits {command[0]}: error:" in err, err
    assert "not a decoder-only causal LM" in err and "logits kvbits computes" not in err
