"""Prototype: calibrated per-channel key transforms before per-token quantization, measured end to end.

    PYTHONPATH=src python benchmarks/smooth_keys.py --model qwen2.5-coder-0.5b --data wikitext2 --context 4k \
        --out benchmarks/results/smooth-keys-qwen-wiki-4k.json

Per-token key quantization (one scale per token and head) fails on models whose keys carry outlier
*channels*. Besides per-channel scales (KIVI, KVQuant) and rotations (QuaRot: ``int4-token-hadamard``), two
transforms calibrated offline fit a per-token quantizer and cost one ``(H_kv, D)`` vector per layer:

- **centre**: store ``k - m`` and return ``dequant(k - m) + m``, with ``m`` the per-(head, channel) mean of
  the calibration keys. A constant vector added to every key changes every score of a query by the same
  ``q . m``, which softmax ignores: the offset costs nothing to attention but half a per-token range.
- **smooth** (QServe's SmoothAttention): store ``k / s`` and return ``dequant(k / s) * s``, with
  ``s_c = max |k_c|^alpha`` (alpha 0.5), equal on RoPE's channel pairs ``(c, c + D/2)`` so the division
  commutes with RoPE (and a serving engine could fold it into ``W_k`` and ``W_q``).

This script is a measurement, not the product: it wraps ``kvbits.evaluate.simulate``'s attention function
and ``simulated_kv`` for schemes named ``<preset>+centre`` / ``+smooth`` / ``+centre+smooth``, calibrates
``m`` and ``s`` from post-RoPE keys on another text (``--calib-data``), and runs ``kvbits.evaluate.evaluate``
(simulate mode, decode semantics) on the same windows for every variant.
"""

from __future__ import annotations

import argparse
import contextvars
import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvbits.evaluate import evaluate
from kvbits.evaluate.data import load_text, make_windows, tokenize
from kvbits.evaluate.models import load_model
from kvbits.schemes import get_scheme

sim_mod = importlib.import_module("kvbits.evaluate.simulate")  # the module (kvbits.evaluate.simulate is the function)

_LAYER: contextvars.ContextVar[int | None] = contextvars.ContextVar("smooth_layer", default=None)
_STATS: dict[int, dict[str, torch.Tensor]] = {}  # calibration: per layer, sums and maxima over tokens
_TRANSFORMS: dict[str, dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}  # scheme -> layer -> (m, s)
_CALIBRATING = [False]
_orig_attention = sim_mod._simulate_attention
_orig_kv = sim_mod.simulated_kv


def _attention(module, *args, **kwargs):
    token = _LAYER.set(getattr(module, "layer_idx", None))
    try:
        return _orig_attention(module, *args, **kwargs)
    finally:
        _LAYER.reset(token)


def _kv(scheme, key, value, lo, hi, **kw):
    """``simulated_kv`` with the key transform of ``scheme.name`` (``key`` ``(B, H_kv, T, D)``)."""
    layer = _LAYER.get()
    if _CALIBRATING[0]:
        k = key.detach().double()
        st = _STATS.setdefault(layer, {"n": 0, "sum": 0})
        st["n"] += k.shape[0] * k.shape[2]
        st["sum"] = st["sum"] + k.sum(dim=(0, 2))
        top, bottom = k.amax(dim=(0, 2)), k.amin(dim=(0, 2))
        st["max"] = torch.maximum(st["max"], top) if "max" in st else top
        st["min"] = torch.minimum(st["min"], bottom) if "min" in st else bottom
    t = _TRANSFORMS.get(scheme.name)
    if t is None:
        return _orig_kv(scheme, key, value, lo, hi, **kw)
    m, s = t[layer]
    k = key
    if m is not None:
        k = k - m[None, :, None, :].to(k)
    if s is not None:
        k = k / s[None, :, None, :].to(k)
    kq, vq = _orig_kv(scheme, k, value, lo, hi, **kw)
    if s is not None:
        kq = kq * s[None, :, None, :].to(kq)
    if m is not None:
        kq = kq + m[None, :, None, :].to(kq)
    return kq, vq


def _pair_max(x: torch.Tensor) -> torch.Tensor:
    """``(H, D)``: the larger of the two channels of each rotate-half RoPE pair ``(c, c + D/2)``, on both."""
    half = x.shape[-1] // 2
    p = torch.maximum(x[..., :half], x[..., half:])
    return torch.cat([p, p], dim=-1)


def transforms(centre: bool, smooth: bool, alpha: float) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
    out = {}
    for layer, st in _STATS.items():
        mean = st["sum"] / st["n"]
        m = mean.float() if centre else None
        if smooth:
            c = mean if centre else torch.zeros_like(mean)  # the largest distance from what is subtracted
            base = torch.maximum(st["max"] - c, c - st["min"])
            s = _pair_max(base.clamp_min(1e-6)).pow(alpha)
            s = (s / s.mean()).float()  # scale-free: only the ratios between channels matter
        else:
            s = None
        out[layer] = (m, s)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--data", default="wikitext2")
    p.add_argument("--calib-data", default="pride-and-prejudice")
    p.add_argument("--context", type=lambda s: int(s[:-1]) * 1024 if s.endswith("k") else int(s), default=4096)
    p.add_argument("--calib-context", type=int, default=2048)
    p.add_argument("--calib-windows", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--base", action="append", default=None, help="presets to vary (default int4-token)")
    p.add_argument("--variants", default="centre,smooth,centre+smooth")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    sim_mod._register()
    from transformers import AttentionInterface

    AttentionInterface.register(sim_mod.IMPLEMENTATION, _attention)
    sim_mod.simulated_kv = _kv

    t0 = time.time()
    lm = load_model(a.model)
    ids = tokenize(load_text(a.calib_data), lm.tokenizer)
    # raw slices without a BOS (kvbits eval --bos never); the models measured here (SmolLM2, Qwen2.5) add none
    wins = make_windows(ids, a.calib_context, a.calib_windows)
    _CALIBRATING[0] = True
    with torch.no_grad(), sim_mod.simulate(lm.model, "fp16"):
        for w in wins:
            lm.model(w[None])
    _CALIBRATING[0] = False
    calib_s = time.time() - t0

    schemes = []
    for base in a.base or ["int4-token"]:
        sch = get_scheme(base)
        schemes.append(sch)
        for v in a.variants.split(","):
            name = f"{base}+{v}"
            _TRANSFORMS[name] = transforms("centre" in v, "smooth" in v, a.alpha)
            schemes.append(sch.replace(name=name))
    summary = evaluate(lm, a.data, a.context, schemes, windows=1, attn_layers=[0, 12, 23] if "qwen" in a.model else None)
    rows = []
    for r in summary["results"]:
        rows.append(
            {k: r.get(k) for k in ("scheme", "avg_bits", "ppl", "ppl_ref", "kl", "top1", "buckets", "attn_error")}
            | {"delta_ppl_pct": 100 * (r["ppl"] / r["ppl_ref"] - 1)}
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    out = {
        "command": "PYTHONPATH=src python benchmarks/smooth_keys.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": a.model, "data": a.data, "context": a.context, "alpha": a.alpha,
        "calibration": {"data": a.calib_data, "context": a.calib_context, "windows": int(wins.shape[0]), "seconds": calib_s},
        "results": rows,
        "summary": summary,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    for r in rows:
        print(r["scheme"], r["delta_ppl_pct"], r["kl"], r["top1"])
    return out


if __name__ == "__main__":
    main()
