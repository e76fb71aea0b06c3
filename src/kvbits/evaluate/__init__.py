"""Evaluation: offline models, evaluation texts, and length-aware perplexity measurement.

``evaluate(...)`` (runner) is the entry point; ``simulate`` is the one-pass decode-semantics
simulator, ``stream_hidden`` the token-by-token ground truth through the real cache;
``needle_eval(...)`` measures passkey retrieval by context length and depth (:mod:`.needle`,
:mod:`.needle_run`). Imports are lazy so that ``import kvbits.evaluate`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PEER_SCHEMES", "evaluate", "load_model", "load_text", "needle_eval", "simulate", "stream_hidden"]


def __getattr__(name: str) -> Any:
    if name == "evaluate":
        from kvbits.evaluate.runner import evaluate

        return evaluate
    if name == "needle_eval":
        from kvbits.evaluate.needle_run import needle_eval

        return needle_eval
    if name == "simulate":
        from kvbits.evaluate.simulate import simulate

        return simulate
    if name in ("stream_hidden", "PEER_SCHEMES"):
        from kvbits.evaluate import stream

        return getattr(stream, name)
    if name == "load_model":
        from kvbits.evaluate.models import load_model

        return load_model
    if name == "load_text":
        from kvbits.evaluate.data import load_text

        return load_text
    raise AttributeError(f"module 'kvbits.evaluate' has no attribute {name!r}")
