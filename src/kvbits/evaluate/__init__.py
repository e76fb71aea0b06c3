"""Evaluation: offline models, evaluation texts, and length-aware perplexity measurement.

``evaluate(...)`` (runner) is the entry point; ``simulate`` is the one-pass decode-semantics
simulator, ``stream_hidden`` the token-by-token ground truth through the real cache;
``needle_eval(...)`` measures passkey retrieval by context length and depth (:mod:`.needle`,
:mod:`.needle_run`). Imports are lazy so that ``import kvbits.evaluate`` stays light.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["PEER_SCHEMES", "evaluate", "load_model", "load_text", "needle_eval", "simulate", "stream_hidden"]


class _Package(types.ModuleType):
    """This package's module type. Loading the submodule ``kvbits.evaluate.simulate`` (as the runner does)
    would bind that module over the function ``simulate`` of the same name: ``from kvbits.evaluate import
    simulate`` then gave a module. The binding is dropped, so the name always resolves to the function
    (the submodule stays importable by its full name and in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "simulate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name == "evaluate":
        from kvbits.evaluate.runner import evaluate

        return evaluate
    if name == "needle_eval":
        from kvbits.evaluate.needle_run import needle_eval

        return needle_eval
    if name == "simulate":
        from kvbits.evaluate.simulate import simulate

        globals()["simulate"] = simulate  # the function, bound once (see _Package)
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
