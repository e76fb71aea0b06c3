"""Greedy generation after a long prompt: does a quantized cache make the model repeat or drift?

Perplexity scores the model on the text; generation feeds the model its own tokens, so an error
in the cache can send it into a loop or onto another path that teacher-forced metrics never show.
``evaluate(..., generate=N)`` (``kvbits eval --generate N``) takes each window's tokens as the
prompt and greedily generates ``N`` new tokens with

- the unquantized model (transformers ``DynamicCache``): the reference continuation, and
- each scheme's real cache (``QuantizedKVCache``, or a peer's cache in stream mode), through
  ``model.generate(ids, cache=..., do_sample=False)``: the prompt is prefilled into the cache
  (which stores it quantized and already attends over the quantized K/V) and every new token is
  decoded through it, as a server would serve the request.

End-of-sequence tokens do not stop a continuation (``eos_token_id=[]``): every continuation has
exactly ``N`` tokens, so they compare position by position.

Measures, per continuation (:func:`rep_n`, :func:`agreement`, :func:`first_divergence`):

- ``rep-n = 1 - distinct n-grams / total n-grams`` for ``n`` in :data:`REP_NS` = (1, 2, 4) (0: no
  n-gram repeats; towards 1: a loop), for the scheme's and the reference's continuation;
- token agreement: the fraction of the ``N`` positions where the scheme generated the reference's
  token, and the first position where they differ (``N`` when they never do). After the first
  divergence the two texts are on different paths, so agreement past it is mostly chance; the
  divergence index is the sharper measure.

Each window's numbers are computed on its own and averaged over the windows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbits.cache.compat import cache_kwargs
from kvbits.evaluate.stream import PeerScheme, _fused_attention, base_model, fuses, make_cache
from kvbits.schemes.spec import KVScheme

__all__ = [
    "REP_NS",
    "agreement",
    "check_can_generate",
    "check_generate",
    "continuations",
    "first_divergence",
    "generation_log_text",
    "generation_summary",
    "greedy_continuation",
    "rep_n",
]

REP_NS = (1, 2, 4)


# ------------------------------------------------------------------------------------ measures


def rep_n(tokens: Sequence[int] | np.ndarray, n: int) -> float:
    """``1 - distinct n-grams / total n-grams`` of ``tokens`` ``(N,)`` (NaN when ``N < n``).

    ``[1, 2, 1, 2, 1]`` has the bigrams ``12 21 12 21``: 2 distinct of 4, rep-2 = 0.5.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    seq = _sequence(tokens, "tokens").tolist()
    total = len(seq) - n + 1
    if total <= 0:
        return float("nan")
    distinct = len({tuple(seq[i : i + n]) for i in range(total)})
    return 1.0 - distinct / total


def _sequence(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """``tokens`` as one sequence of token ids ``(N,)``; ``ValueError`` for a batch (flattened, its rows would run
    into each other: the n-gram across two rows counted, a divergence found at a flat index) or non-integer ids."""
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"{what} must be one continuation of token ids (N,), got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must be integer token ids, got dtype {a.dtype}")
    return a


def _pair(
    tokens: Sequence[int] | np.ndarray, ref: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    a, b = _sequence(tokens, "tokens"), _sequence(ref, "ref")
    if a.shape != b.shape:
        raise ValueError(f"continuations must have the same length, got {a.shape[0]} and {b.shape[0]}")
    return a, b


def agreement(tokens: Sequence[int] | np.ndarray, ref: Sequence[int] | np.ndarray) -> float:
    """Fraction of positions where ``tokens`` ``(N,)`` equals ``ref`` ``(N,)`` (NaN when ``N == 0``)."""
    a, b = _pair(tokens, ref)
    return float(np.mean(a == b)) if a.size else float("nan")


def first_divergence(tokens: Sequence[int] | np.ndarray, ref: Sequence[int] | np.ndarray) -> int:
    """Index of the first position where ``tokens`` ``(N,)`` and ``ref`` ``(N,)`` differ; ``N`` if none."""
    a, b = _pair(tokens, ref)
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else int(a.size)


def generation_summary(
    tokens: np.ndarray, ref: np.ndarray, *, prompt_tokens: int, seconds: float, reference_seconds: float
) -> dict[str, Any]:
    """One scheme's generation record from its continuations ``(W, N)`` and the reference's ``(W, N)``.

    Returns ``{"prompt_tokens", "new_tokens", "rep_n", "rep", "rep_ref", "agreement",
    "first_divergence", "first_divergence_mean", "seconds", "reference_seconds"}``: ``rep`` /
    ``rep_ref`` map ``str(n)`` to the mean rep-n over the windows; ``agreement`` is the mean
    fraction of positions equal to the reference; ``first_divergence`` lists, per window, the first
    position that differs (``N``: none did).
    """
    tokens, ref = np.atleast_2d(tokens), np.atleast_2d(ref)
    if tokens.ndim != 2:
        raise ValueError(f"continuations must be (windows, new tokens), got shape {tokens.shape}")
    if tokens.shape != ref.shape:
        raise ValueError(f"continuations {tokens.shape} and reference {ref.shape} differ in shape")
    div = [first_divergence(t, r) for t, r in zip(tokens, ref)]
    return {
        "prompt_tokens": int(prompt_tokens),
        "new_tokens": int(tokens.shape[1]),
        "rep_n": list(REP_NS),
        "rep": {str(n): _mean([rep_n(t, n) for t in tokens]) for n in REP_NS},
        "rep_ref": {str(n): _mean([rep_n(r, n) for r in ref]) for n in REP_NS},
        "agreement": _mean([agreement(t, r) for t, r in zip(tokens, ref)]),
        "first_divergence": div,
        "first_divergence_mean": _mean(div),
        "seconds": float(seconds),
        "reference_seconds": float(reference_seconds),
    }


def _divergence_text(div: Sequence[int]) -> str:
    """First divergences per window ``(W,)`` as the log says them: each for up to 8 windows, else min, median, max and
    the count (a 200-window run printed all 200); ``n/a`` for none."""
    if not len(div):
        return "n/a"
    if len(div) <= 8:
        return ", ".join(str(int(x)) for x in div)
    return f"min {min(div)}, median {float(np.median(div)):g}, max {max(div)} over {len(div)} windows"


def _fmt3(x: Any) -> str:
    """A mean (rep-n, agreement; None where no window has ``n`` tokens) with 3 decimals, ``n/a`` as the report says it."""
    return f"{float(x):.3f}" if isinstance(x, (int, float)) and np.isfinite(x) else "n/a"


def generation_log_text(rec: Mapping[str, Any]) -> str:
    """One line of ``kvbits eval``'s log for a generation record (:func:`generation_summary`): greedy tokens,
    agreement, first divergence (:func:`_divergence_text`), rep-4 against the reference (``n/a`` where the
    continuations are shorter than 4 tokens, not ``None``)."""
    rep, ref = rec.get("rep") or {}, rec.get("rep_ref") or {}
    return (
        f"{rec.get('new_tokens')} greedy tokens, agreement with the reference {_fmt3(rec.get('agreement'))}, "
        f"first divergence {_divergence_text(rec.get('first_divergence') or [])}, "
        f"rep-4 {_fmt3(rep.get('4'))} (reference {_fmt3(ref.get('4'))})"
    )


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean of the finite values (None entries skipped), None (JSON null) when there are none."""
    vals = [float(v) for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(vals)) if vals else None


# ------------------------------------------------------------------------------------ generating


def check_generate(generate: Any) -> int:
    """``generate`` as new tokens per window (0: off); ``ValueError`` for anything but an int >= 0."""
    if isinstance(generate, bool) or not isinstance(generate, (int, np.integer)) or generate < 0:
        raise ValueError(
            f"generate must be an int >= 0 (new tokens generated after each window; 0 = off), got {generate!r}"
        )
    return int(generate)


def check_can_generate(model: Any) -> None:
    """``ValueError`` unless ``model`` is a transformers model that generates (a ``*ForCausalLM``)."""
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise ValueError(
            f"generate > 0 needs a model with a language-model head that transformers can generate with "
            f"(a *ForCausalLM); {type(model).__name__} can not generate"
        )


@torch.no_grad()
def greedy_continuation(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any) -> torch.Tensor:
    """The ``new_tokens`` tokens ``(new_tokens,)`` greedy decoding appends to ``ids`` ``(1, T)``.

    ``cache`` (a transformers ``Cache``, empty) holds the prompt and every generated token; an
    end-of-sequence token does not stop the continuation. Plain greedy decoding: the model's own generation
    settings (``generation_config.json``: a ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``,
    ...) are set aside for the call, since transformers fills every setting a ``GenerationConfig`` leaves unset
    from them, and a repetition penalty would hide the repetition rep-n measures.
    """
    from transformers import GenerationConfig

    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"ids must be one unpadded sequence (1, T) with T >= 1, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be integer token ids, got dtype {ids.dtype}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) or new_tokens < 1:
        raise ValueError(f"new_tokens must be an int >= 1, got {new_tokens!r}")
    new_tokens = int(new_tokens)
    # no end-of-sequence token: exactly new_tokens; the pad id is never used then (nothing finishes
    # early) but generate wants one, and would take it from an end-of-sequence token
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        eos_token_id=[],
        pad_token_id=pad if isinstance(pad, int) else 0,
    )
    kw = cache_kwargs(cache, base_model(model))
    own = getattr(model, "generation_config", None)
    if own is not None:
        model.generation_config = GenerationConfig(pad_token_id=config.pad_token_id)  # nothing of its own to fill in
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kw)
    finally:
        if own is not None:
            model.generation_config = own
    if out.shape != (1, ids.shape[1] + new_tokens):
        raise RuntimeError(
            f"{type(model).__name__}.generate returned {tuple(out.shape)}, expected (1, {ids.shape[1] + new_tokens})"
        )
    return out[0, ids.shape[1] :]


@torch.no_grad()
def continuations(
    model: Any,
    ids: torch.Tensor,
    new_tokens: int,
    schemes: Sequence[KVScheme | PeerScheme],
    *,
    calibrations: Mapping[str, Any] | None = None,
    fused_decode: bool | str = "auto",
) -> tuple[list[torch.Tensor], list[float]]:
    """Greedy continuations of ``ids`` ``(1, T)``: the reference's, then one per scheme.

    Args:
        model: a transformers causal LM.
        ids: the prompt, one unpadded sequence.
        new_tokens: tokens to generate.
        schemes: kvbits schemes (a ``QuantizedKVCache`` each) or peers (their own cache).
        calibrations: scheme name -> calibration artifact, for schemes with static scales / codebooks.
        fused_decode: kvbits schemes decode through the fused kernel where this asks for it
            (``"auto"``: on CUDA with Triton, as a server would; see :mod:`.stream`).

    Returns:
        ``(tokens, seconds)``: ``1 + len(schemes)`` continuations ``(new_tokens,)`` (int64, on the
        model's device), reference first, and the seconds each took.
    """
    from transformers import DynamicCache

    from kvbits.cache.fused import check_mode

    mode = check_mode(fused_decode)
    calibrations = calibrations or {}
    t0 = time.perf_counter()
    outs = [greedy_continuation(model, ids, new_tokens, DynamicCache(config=model.config))]
    seconds = [time.perf_counter() - t0]
    for scheme in schemes:
        t0 = time.perf_counter()
        fused = not isinstance(scheme, PeerScheme) and fuses(model, mode, ids.device)
        with _fused_attention(model) if fused else contextlib.nullcontext():
            # reserved for the prompt and every new token: no copy of the quantized history per flush (same tokens)
            cache = make_cache(scheme, model, calibration=calibrations.get(scheme.name), fused_decode=fused,
                               max_cache_len=ids.shape[1] + new_tokens, calibration_warnings=False)  # fmt: skip
            outs.append(greedy_continuation(model, ids, new_tokens, cache))
        seconds.append(time.perf_counter() - t0)
    return outs, seconds
