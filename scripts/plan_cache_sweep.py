"""Sweep: for each decoder model type in transformers' ``CONFIG_MAPPING`` (its default config), does ``kvbits plan``
accept what ``QuantizedKVCache`` / ``StaticQuantizedKVCache`` build, for the same config and scheme?

Run: ``PYTHONPATH=src python scripts/plan_cache_sweep.py [model_type ...]`` (every decoder type: ~30 s on CPU).
Prints each (model type, scheme, cache) where plan and the cache disagree: ``MISMATCH`` when plan prices a cache
that can not be built, ``plan refuses`` the other way. The static cache's own limits (sliding layers,
``static_reason``, partial rotary in fixed slabs) are skipped: plan does not know which cache will hold the K/V.
So are the differences of ``ACCEPTED`` (matched in either refusal), each for the reason it gives, and counted apart.
Exit status 1 when there is a MISMATCH.

Measured at 5e55708 with transformers 5.25: 34 mismatches and 78 ``plan refuses``; none after, with 84 accepted lines
(the 78, and 6 hybrid_sliding); 88 since ``StaticQuantizedKVCache`` holds state layers too (it builds the
K/V-less defaults of Bamba / GraniteMoeHybrid that plan refuses).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable

SCHEMES = ("int8-token", "kvquant-4", "int4-channel-prerope")
STATIC_ONLY = ("holds full-attention layers only", "cannot be stored in fixed slabs", "pre-RoPE keys in fixed slabs")
ACCEPTED = {
    # plan refuses, the cache builds: the cache is a container built from any config with layers and heads; the models
    # are refused where kvbits runs them (kvbits._model.check_causal_lm applies plan's check_causal_config)
    "is not a decoder-only causal LM": "encoder / encoder-decoder models: refused where kvbits runs a model",
    # plan refuses, the cache builds: Bamba / GraniteMoeHybrid / the Gemma 4 assistant by default have no layer that
    # caches K/V (all Mamba, or every layer reads another's KV); the cache holds only transformers' state layers
    "stores a KV cache; nothing to plan": "no K/V to quantize or price: the cache keeps only unquantized states",
    # plan accepts, QuantizedKVCache refuses: a sliding window plus a linear state in one layer (Inkling); the cache's
    # refusal names DynamicCache to serve it and plan to price its attention K/V (plan never prices the linear states,
    # of 'hybrid' layers either)
    "has type 'hybrid_sliding'": "plan prices the K/V of layers served by DynamicCache, as the refusal says",
}


def outcome(fn: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """``None`` when ``fn(*args, **kwargs)`` runs, else the refusal in one line."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the sweep records every refusal
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return None


def main(types: list[str]) -> int:
    from transformers import CONFIG_MAPPING

    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.static import StaticQuantizedKVCache
    from kvbits.plan import plan

    mismatches = accepted = 0
    for mt in types:
        try:
            cfg = CONFIG_MAPPING[mt]()
        except Exception as exc:  # noqa: BLE001
            print(f"{mt}: no default config ({type(exc).__name__})")
            continue
        for s in SCHEMES:
            p = outcome(plan, cfg, context=64, scheme=s)
            builds = {
                "dynamic": outcome(QuantizedKVCache, cfg, s),
                "static": outcome(StaticQuantizedKVCache, cfg, s, max_cache_len=64),
            }
            for kind, c in builds.items():
                if c is not None and any(k in c for k in STATIC_ONLY):
                    continue
                if (p is None) != (c is None):
                    if any(k in (p or c or "") for k in ACCEPTED):
                        accepted += 1
                        continue
                    mismatches += p is None
                    tag = "MISMATCH plan accepts" if p is None else "plan refuses, cache builds"
                    print(f"{mt} {s} [{kind}] {tag}:\n    plan:  {p}\n    cache: {c}")
    print(f"{len(types)} model types, {mismatches} mismatches (plan accepts, a cache refuses), {accepted} accepted "
          "differences (ACCEPTED)")
    return mismatches


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    transformers.logging.set_verbosity_error()
    names = sys.argv[1:] or sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
    sys.exit(1 if main([n for n in names if n in transformers.CONFIG_MAPPING]) else 0)
