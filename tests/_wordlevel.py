"""Offline test fixtures shared by the CLI tests: a word-level tokenizer and random text over it.

Lets a CLI run end to end on a tiny random-weight model saved with ``save_pretrained`` (no hub).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "it",
    "that",
    "he",
    "she",
    "her",
    "his",
    "with",
    "for",
    "as",
    "on",
    "at",
    "by",
]


def save_word_tokenizer(path: Path) -> None:
    """Save a whitespace word-level tokenizer over ``WORDS`` (id 0 = ``[UNK]``) into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def write_word_text(path: Path, n_words: int, seed: int = 0) -> Path:
    """Write ``n_words`` words drawn uniformly (seeded) from ``WORDS`` to ``path``."""
    g = torch.Generator().manual_seed(seed)
    path.write_text(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n_words,), generator=g)))
    return path
