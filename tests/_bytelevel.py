"""A byte-level tokenizer (one token per UTF-8 byte, 256 ids) for tests whose text must survive
tokenization exactly: digits, punctuation, newlines (the word-level tokenizer of ``_wordlevel`` maps
them to ``[UNK]``). It is a real ``PreTrainedTokenizerFast``, so it can be saved beside a tiny model and
loaded by ``kvbits.evaluate.models.load_model`` from the folder."""

from __future__ import annotations

from pathlib import Path

import transformers

VOCAB = 256

SENTENCES = [
    "The old man walked down to the harbour before dawn.",
    "Nobody in the village remembered a colder winter!",
    "She asked whether the letters had arrived at last?",
    "The soldiers waited by the river for three days.",
    "A grey horse stood alone in the wet field.",
    "He wrote that the prince would return in spring.",
]


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Ids 0-255 are the bytes (GPT-2's printable byte alphabet); no merges, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def save_byte_tokenizer(path: Path) -> None:
    byte_tokenizer().save_pretrained(path)


def write_sentences(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` sentences drawn (seeded) from :data:`SENTENCES`, separated by spaces: real punctuation, so
    needles have sentence ends to move to."""
    import random

    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(SENTENCES) for _ in range(n)) + "\n")
    return path
