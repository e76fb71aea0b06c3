"""Passkey retrieval ("needle in a haystack") by context length and depth: the task and its scoring.

Perplexity averages over every token; retrieval asks for one fact, stated once, far back in the
context. A key the cache no longer matches to its query loses that fact while the average perplexity
barely moves. The task is the passkey retrieval of Mohtashami & Jaggi 2023 ("Landmark Attention"),
the one KVQuant reports for long contexts, with real text as the haystack (as in Kamradt's "needle in a
haystack") instead of a repeated filler sentence:

- **haystack**: a slice of real text (by default *War and Peace*), starting at a seeded offset;
- **needle**: ``"The pass key is 71432. Remember it. 71432 is the pass key."`` (a seeded key of
  ``digits`` digits), inserted at ``depth`` (0: the start of the haystack, 1: its end), moved back to
  the end of the nearest sentence within :data:`SNAP_TOKENS` tokens: after ``.``, ``!`` or ``?`` (and
  a closing quote), a line break after one, or a paragraph break; a line break alone is not a sentence
  end (Gutenberg texts wrap their lines mid-sentence), nor is a title's period (``Mr.``, ``Dr.``), and
  a needle never splits a CRLF. When the text after the needle starts without a space or line break,
  one is put between them (a line break as the haystack writes it, ``\r\n`` or ``\n``; it takes the
  place of the haystack's last tokens);
- **question**: ``"What is the pass key? The pass key is "`` followed by the key itself.

The trial is built in token ids, so it has exactly ``context`` tokens: haystack, needle, question, key.

**Scoring, exact, without a generate loop.** The key's tokens are teacher-forced after the question.
The model *retrieves* the key when the argmax at every key position is the key's next token: greedy
decoding emits the key exactly then (it emits each key token given the earlier ones iff that token is
the argmax), so this is greedy retrieval, computed from one pass. Also recorded per trial: the fraction
of key tokens that are the argmax, the key's mean NLL per token (nats), and KL(reference || scheme) at
the key positions. :func:`build_trials` and :func:`score_key` are here; the loop over models, schemes
and semantics is :mod:`kvbits.evaluate.needle_run`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvbits._argtypes import check_seed
from kvbits.evaluate.inputs import check_ints
from kvbits.evaluate.metrics import kl_divergence

__all__ = [
    "DEFAULT_DEPTHS",
    "SNAP_TOKENS",
    "NeedleTask",
    "Trial",
    "build_trials",
    "check_contexts",
    "check_depths",
    "check_seed",
    "min_context",
    "score_key",
]

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SNAP_TOKENS = 48  # how far back a needle moves to sit after a sentence end
MIN_HAYSTACK = 16  # tokens of haystack a trial must have at least
DEPTH_RESOLUTION = 1e-4  # a trial's seed holds round(depth / DEPTH_RESOLUTION): closer depths share their trials
_SENTENCE_END = re.compile(r"""[.!?]["'’”]?$""")  # the text before a needle ends with one...
_LOOKBACK = 8  # ...in its last tokens (a sentence end, closing quote and line breaks; a title before it)
# ...unless the period is a title's ("Mr. Darcy"): 23 of 108 Pride and Prejudice trials sat after one
_ABBREVIATION = re.compile(r"(?<![A-Za-z])(?:Mr|Mrs|Ms|Messrs|Dr|St|Mt|Prof|Rev|Capt|Col|Gen|Lt|Sgt|Mme|Mlle)\.$")


@dataclass(frozen=True)
class NeedleTask:
    """What is hidden and what is asked; ``{key}`` marks where the key goes.

    Attributes:
        needle: the sentence(s) hidden in the haystack; must contain ``{key}``.
        question: asked after the haystack; must end with ``{key}`` (the answer, teacher-forced and
            scored), and contain it only there.
        digits: the key's length in decimal digits (1-18); its first digit is never 0.
    """

    needle: str = "The pass key is {key}. Remember it. {key} is the pass key."
    question: str = "What is the pass key? The pass key is {key}"
    digits: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.needle, str) or "{key}" not in self.needle:
            raise ValueError(f"needle must be a string containing '{{key}}', got {self.needle!r}")
        if not isinstance(self.question, str) or not self.question.endswith("{key}"):
            raise ValueError(
                f"question must be a string ending with '{{key}}' (the scored answer), got {self.question!r}"
            )
        if self.question.count("{key}") != 1:
            raise ValueError(f"question must contain '{{key}}' once, at its end, got {self.question!r}")
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"digits must be an int in [1, 18], got {self.digits!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def needle_text(self, key: str) -> str:
        """The needle as inserted: one space before it, so it reads as a new sentence."""
        return " " + self.needle.replace("{key}", key)

    def question_text(self, key: str) -> str:
        """The question and the key, after a blank line."""
        return "\n\n" + self.question.replace("{key}", key)


@dataclass(frozen=True)
class Trial:
    """One retrieval trial: ``ids`` ``(context,)`` = [BOS] + haystack[:at] + needle + haystack[at:] + question + key
    (the BOS first where ``build_trials`` was given a ``bos_id``; ``bos`` says so).

    When ``haystack[at:]`` starts without whitespace, a space or line break comes first, and the
    haystack's last tokens make room for it (``needle_len`` and ``doc_len`` are unchanged by it).

    Attributes:
        context: total tokens.
        depth: the depth asked for; ``depth_actual``: ``needle_at / haystack tokens`` after snapping.
        index: the trial's number within its (context, depth) cell.
        key: the key's digits.
        offset: where the haystack starts in the text's token ids.
        needle_at: index of the needle's first token in ``ids``; ``needle_len``: its tokens.
        doc_len: tokens before the question (the BOS, haystack and needle: what a prefill stores).
        answer_start: index of the key's first token; the key is ``ids[answer_start:]``.
        bos: whether ``ids`` starts with a BOS token (then the haystack has ``doc_len - needle_len - 1`` tokens).
    """

    context: int
    depth: float
    depth_actual: float
    index: int
    key: str
    offset: int
    needle_at: int
    needle_len: int
    doc_len: int
    answer_start: int
    ids: torch.Tensor
    bos: bool = False

    @property
    def haystack_len(self) -> int:
        """Tokens of the text in the trial (the haystack without the needle and the BOS)."""
        return self.doc_len - self.needle_len - int(self.bos)

    def record(self) -> dict[str, Any]:
        """The trial without its ids (JSON)."""
        return {
            "context": self.context, "depth": self.depth, "depth_actual": self.depth_actual,
            "index": self.index, "key": self.key, "offset": self.offset, "needle_at": self.needle_at,
            "needle_len": self.needle_len, "doc_len": self.doc_len, "answer_start": self.answer_start,
        }  # fmt: skip


# ------------------------------------------------------------------------------------ validation


def check_contexts(contexts: Sequence[int] | int) -> list[int]:
    """Distinct positive token counts, ascending; ``ValueError`` otherwise."""
    return check_ints("context", contexts, 1)


def check_depths(depths: Sequence[float]) -> list[float]:
    """Distinct finite depths in [0, 1], ascending (``-0.0`` as ``0.0``); ``ValueError`` otherwise.

    Two depths that round to the same multiple of :data:`DEPTH_RESOLUTION` are refused: a trial's key and
    offset are seeded by the rounded depth (:func:`_rng`), so they would repeat the same trials (a duplicate
    counted twice). The seeding stays as it is, so committed runs keep their trials."""
    try:
        items = list(depths)
    except TypeError:
        raise ValueError(f"depths must be a list of numbers in [0, 1], got {depths!r}") from None
    if not items:
        raise ValueError("depths must name at least one depth in [0, 1]")
    out = []
    for d in items:
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating, np.integer)):
            raise TypeError(f"each depth must be a number in [0, 1], got {d!r}")
        if not math.isfinite(float(d)) or not 0.0 <= float(d) <= 1.0:
            raise ValueError(
                f"each depth must be in [0, 1] (0: start of the haystack, 1: its end), got {d!r}"
            )
        out.append(float(d) + 0.0)  # -0.0 is depth 0 (the report printed a "-0" column, the JSON -0.0)
    out = sorted(set(out))
    for a, b in itertools.pairwise(out):
        if _depth_word(a) == _depth_word(b):
            raise ValueError(
                f"depths {a!r} and {b!r} round to the same multiple of the depth resolution 1e-4: a trial's key "
                "and haystack offset are seeded by the rounded depth, so both would run the same trials; "
                "drop one or space them further apart"
            )
    return out


# ------------------------------------------------------------------------------------ building


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def _split_answer(tokenizer: Any, qa: list[int], key: str) -> int:
    """Index in ``qa`` (question + key tokens) of the first token that carries the key: the largest
    ``k`` whose tail ``qa[k:]`` still decodes to text containing the whole key."""
    for k in range(len(qa) - 1, -1, -1):
        if key in tokenizer.decode(qa[k:]):
            return k
    raise ValueError(
        f"the tokenizer's decoding of the question does not contain the key {key!r}: "
        f"{tokenizer.decode(qa)!r}; use a question whose key survives tokenization"
    )


def _fixed_tokens(tokenizer: Any, task: NeedleTask, key: str) -> tuple[list[int], list[int], int]:
    """``(needle ids, question + key ids, index of the key's first token in the latter)``."""
    needle = _encode(tokenizer, task.needle_text(key))
    if key not in tokenizer.decode(needle):
        raise ValueError(
            f"the tokenizer's decoding of the needle lost the key {key!r}: {tokenizer.decode(needle)!r}"
        )
    qa = _encode(tokenizer, task.question_text(key))
    return needle, qa, _split_answer(tokenizer, qa, key)


def min_context(tokenizer: Any, task: NeedleTask | None = None) -> int:
    """The shortest context a trial fits in: needle, question and key (for a key of the task's
    length), plus :data:`MIN_HAYSTACK` tokens of haystack."""
    task = task or NeedleTask()
    key = "9" * task.digits
    needle, qa, _ = _fixed_tokens(tokenizer, task, key)
    return len(needle) + len(qa) + MIN_HAYSTACK


def _ends_sentence(before: str) -> bool:
    """Whether ``before`` (the text before a place in the haystack) ends a sentence: ``.``, ``!`` or ``?`` (and a closing quote),
    optionally followed by spaces and line breaks, or a paragraph break (two line breaks). A single
    line break after other text is a wrapped line, not a sentence end; nor is the period of a title
    (``Mr.``, ``Mrs.``, ``Dr.``, ``St.``: :data:`_ABBREVIATION`)."""
    text = before.rstrip(" \t")
    body = text.rstrip()
    if text != body and text[len(body):].count("\n") >= 2:
        return True
    return bool(_SENTENCE_END.search(body)) and not _ABBREVIATION.search(body)


def _splits_line_end(tokenizer: Any, hay: list[int], at: int) -> bool:
    """Whether ``at`` falls between the ``\r`` and the ``\n`` of a CRLF line end (a tokenizer that
    gives each its own token): a needle there would leave a bare ``\r`` before it."""
    if at <= 0 or at >= len(hay):
        return False
    return tokenizer.decode(hay[at - 1 : at]).endswith("\r") and _text_after(
        tokenizer, hay[at - 1 : at], hay[at : at + 1]
    ).startswith("\n")


def _snap(tokenizer: Any, hay: list[int], at: int) -> int:
    """``at`` moved back to just after a sentence end within ``SNAP_TOKENS`` tokens (unchanged at the
    ends of the haystack, or when no sentence ends there: then one token back if it splits a CRLF)."""
    if at <= 0 or at >= len(hay):
        return at
    for j in range(at, max(0, at - SNAP_TOKENS), -1):
        if _ends_sentence(tokenizer.decode(hay[max(0, j - _LOOKBACK) : j])) and not _splits_line_end(tokenizer, hay, j):
            return j
    return at - 1 if _splits_line_end(tokenizer, hay, at) else at


def _text_after(tokenizer: Any, left: list[int], right: list[int]) -> str:
    """The text ``right`` adds after ``left``: decoded together, as a SentencePiece tokenizer drops the
    leading space of the first token it decodes."""
    return tokenizer.decode(left + right).removeprefix(tokenizer.decode(left))


def _separator(tokenizer: Any, hay: list[int], at: int, needle: list[int]) -> list[int]:
    """The tokens of a line break (after a line break, the haystack's own: ``\r\n`` after ``\r\n``) or
    a space (elsewhere) to put between the needle and ``hay[at:]`` when that starts without whitespace,
    so that the needle's last sentence is not glued to the next word; none at the end of the haystack
    or when it starts with whitespace. A separator takes the place of the haystack's last tokens, so it
    is at most ``len(hay) - at`` tokens: one that does not fit whole gives way to the next candidate (a
    2-token ``\r\n`` cut to its ``\r`` left a bare carriage return after a needle 1 token from the end)."""
    if at >= len(hay) or _text_after(tokenizer, needle[-1:], hay[at : at + 1])[:1].isspace():
        return []
    before = tokenizer.decode(hay[max(0, at - _LOOKBACK) : at]).rstrip(" \t")
    line = "\r\n" if before.endswith("\r\n") else "\n"
    for sep in (line, " ") if before.endswith("\n") else (" ", line):
        ids = _encode(tokenizer, sep)
        if ids and len(ids) <= len(hay) - at:
            return ids
    return []


def _rng(seed: int, context: int, depth: float, index: int) -> np.random.Generator:
    """One generator per trial cell: adding a context or a depth changes no other trial. ``seed`` is one 32-bit word
    of the entropy (``check_seed``: ``[0, 2**32 - 1]``): a mask to 32 bits gave ``-1`` the trials of ``2**32 - 1``
    and ``2**32`` those of 0, and a larger seed unmasked would span two words, whose entropy can equal another
    (seed, context, depth, index)'s."""
    return np.random.default_rng([int(seed), int(context), _depth_word(depth), int(index)])


def _depth_word(depth: float) -> int:
    """The depth in the trial seed: ``round(depth * 10000)`` (as committed runs were seeded)."""
    return round(depth * 10000)


def build_trials(
    tokenizer: Any,
    text_ids: torch.Tensor,
    contexts: Sequence[int] | int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 1,
    *,
    task: NeedleTask | None = None,
    seed: int = 0,
    bos_id: int | None = None,
) -> list[Trial]:
    """Every (context, depth, index) trial, contexts outermost.

    Args:
        tokenizer: the model's tokenizer (``__call__(text, add_special_tokens=False)`` and ``decode``).
        text_ids: the haystack text's token ids ``(N,)`` (``kvbits.evaluate.data.tokenize``).
        contexts: total tokens per trial.
        depths: where the needle goes, in [0, 1] of the haystack.
        trials: trials per (context, depth): each with its own key and haystack offset.
        task: needle and question templates (default :class:`NeedleTask`).
        seed: keys and offsets come from ``(seed, context, depth, index)``; an int in ``[0, 2**32 - 1]``.
        bos_id: the token each trial starts with (``kvbits.evaluate.data.resolve_bos``), then the haystack, one
            token shorter; None (the default): the haystack first.

    Raises:
        ValueError: a context too short for the task, a text shorter than a haystack, bad arguments.
    """
    task = task or NeedleTask()
    contexts = check_contexts(contexts)
    depths = check_depths(depths)
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 1:
        raise ValueError(f"trials must be a positive int (trials per context and depth), got {trials!r}")
    seed = check_seed(seed)
    if bos_id is not None and (isinstance(bos_id, bool) or not isinstance(bos_id, (int, np.integer)) or bos_id < 0):
        raise ValueError(f"bos_id must be a token id (an int >= 0) or None, got {bos_id!r}")
    head = [] if bos_id is None else [int(bos_id)]
    if (
        not isinstance(text_ids, torch.Tensor)
        or text_ids.dim() != 1
        or text_ids.dtype not in (torch.int64, torch.int32)
    ):
        raise ValueError(
            f"text_ids must be a 1-D integer tensor of token ids, got "
            f"{type(text_ids).__name__} {tuple(getattr(text_ids, 'shape', ()))} {getattr(text_ids, 'dtype', '')}"
        )
    shortest = min_context(tokenizer, task) + len(head)
    if contexts[0] < shortest:
        raise ValueError(
            f"context {contexts[0]} is too short for the retrieval task: {'the BOS, ' if head else ''}needle, "
            f"question and key take {shortest - MIN_HAYSTACK} tokens and the haystack at least {MIN_HAYSTACK}; use a context of at least {shortest}"
        )
    text = text_ids.long()
    n_text = int(text.numel())
    out = []
    for context in contexts:
        for depth in depths:
            for index in range(int(trials)):
                rng = _rng(seed, context, depth, index)
                key = str(int(rng.integers(10 ** (task.digits - 1), 10**task.digits)))
                needle, qa, k = _fixed_tokens(tokenizer, task, key)
                n_hay = context - len(head) - len(needle) - len(qa)
                if n_hay < 1:  # this key tokenized longer than the one min_context measured
                    raise ValueError(
                        f"context {context} leaves no haystack for key {key!r} (needle and question take "
                        f"{len(needle) + len(qa)} tokens); use a longer context"
                    )
                if n_hay > n_text:
                    raise ValueError(
                        f"the text has {n_text} tokens; a {context}-token trial needs a haystack of {n_hay}: use a "
                        "longer text or a shorter context"
                    )
                offset = int(rng.integers(0, n_text - n_hay + 1))
                hay = text[offset : offset + n_hay].tolist()
                at = _snap(tokenizer, hay, round(depth * n_hay))
                rest = (_separator(tokenizer, hay, at, needle) + hay[at:])[: n_hay - at]
                ids = torch.tensor(head + hay[:at] + needle + rest + qa, dtype=torch.long)
                assert ids.numel() == context  # internal: lengths were computed to fit
                doc_len = len(head) + n_hay + len(needle)
                out.append(Trial(
                    context=context, depth=depth, depth_actual=at / n_hay, index=index, key=key, offset=offset,
                    needle_at=len(head) + at, needle_len=len(needle), doc_len=doc_len, answer_start=doc_len + k,
                    ids=ids, bos=bool(head),
                ))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------ scoring


def score_key(
    logprobs: torch.Tensor, targets: torch.Tensor, logprobs_ref: torch.Tensor | None = None
) -> dict[str, Any]:
    """Retrieval measures of one trial from the log-probabilities at the key positions.

    Args:
        logprobs: ``(K, V)`` log-softmax at the ``K`` positions that predict the key's tokens.
        targets: ``(K,)`` the key's tokens.
        logprobs_ref: the reference's ``(K, V)``, for the KL; None for the reference itself.

    Returns:
        ``{"retrieved": every argmax is the key token (greedy decoding emits the key), "token_acc":
        fraction of key tokens that are the argmax, "nll": mean NLL of the key tokens in nats,
        "pred": the argmax tokens}`` and, with ``logprobs_ref``, ``"kl"``: mean KL(reference || this)
        over the key positions, nats.

    Raises:
        ValueError: mismatched shapes, targets that are not token ids of the vocabulary (float, out of
            ``[0, V)``: ``gather`` failed on them inside, on CUDA with a device assert), or non-finite
            log-probabilities (NaN/inf logits upstream).
    """
    if (
        logprobs.dim() != 2
        or targets.dim() != 1
        or logprobs.shape[0] != targets.shape[0]
        or targets.numel() == 0
    ):
        raise ValueError(
            f"logprobs must be (K, V) and targets (K,) with K >= 1, got {tuple(logprobs.shape)} and {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be the key's token ids (an integer tensor), got dtype {targets.dtype}")
    if int(targets.min()) < 0 or int(targets.max()) >= logprobs.shape[1]:
        raise ValueError(
            f"targets must be token ids in [0, {logprobs.shape[1]}) (the vocabulary of logprobs), got "
            f"{targets.tolist()}: a tokenizer and a model of different vocabularies?"
        )
    lp = logprobs.double()
    if not torch.isfinite(lp).all():
        raise ValueError(
            "log-probabilities at the key positions are not finite (NaN or inf logits): the run is broken"
        )
    pred = lp.argmax(-1)
    hit = pred == targets.to(pred.device)
    out: dict[str, Any] = {
        "retrieved": bool(hit.all()),
        "token_acc": float(hit.double().mean()),
        "nll": float(-lp.gather(-1, targets.to(pred.device)[:, None]).mean()),
        "pred": [int(t) for t in pred.tolist()],
    }
    if logprobs_ref is not None:
        ref = logprobs_ref.double()
        if ref.shape != lp.shape:
            raise ValueError(f"reference log-probabilities {tuple(ref.shape)} differ from {tuple(lp.shape)}")
        out["kl"] = float(kl_divergence(ref, lp).mean())
    return out
