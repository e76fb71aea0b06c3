"""Monitor and fall back on a real model: per-layer flush errors online, and what a fallback policy buys.

One window of real text, decoded token by token through ``QuantizedKVCache`` (decode semantics, the
stream runner) with a ``kvbits.monitor.CacheMonitor`` attached, for each run of ``RUNS``: a scheme alone
(signals recorded, no action) and with ``FallbackPolicy`` thresholds (layers held in full precision once
a flushed block's relative error crosses them). Each run is scored against the unquantized model: KL and
perplexity by context bucket, and the cache's bytes at the end (``memory_report``), so the trade is
visible: error removed against memory spent.

    PYTHONPATH=src python benchmarks/monitor_fallback.py --context 4096 \
        --out benchmarks/results/monitor_fallback.json --prom benchmarks/results/monitor_fallback.prom
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
from _provenance import commit

from kvbits.evaluate.data import load_text, make_windows, tokenize
from kvbits.evaluate.metrics import LogitHead, bucket_records, token_metrics
from kvbits.evaluate.models import load_model
from kvbits.evaluate.stream import base_model, stream_hidden
from kvbits.monitor import CacheMonitor, FallbackPolicy

logger = logging.getLogger("monitor_fallback")


def runs(key: float, value: float) -> list[tuple[str, str, FallbackPolicy | None]]:
    """(label, scheme, policy): each scheme watched only, then kivi-2 with layer and request fallback at
    relative-error thresholds ``key`` / ``value``."""
    cut = f"K > {key} or V > {value}"
    return [
        ("kivi-4 (watch)", "kivi-4", None),
        ("kivi-2 (watch)", "kivi-2", None),
        (f"kivi-2, hold layer ({cut})", "kivi-2", FallbackPolicy(key_error=key, value_error=value)),
        (f"kivi-2, hold request ({cut})", "kivi-2", FallbackPolicy(key_error=key, value_error=value, scope="request")),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="war-and-peace")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--key-threshold", type=float, default=0.26, help="key relative error that holds a layer")
    ap.add_argument("--value-threshold", type=float, default=0.5, help="value relative error that holds a layer")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prom", type=Path, help="write the Prometheus text of the layer-fallback run here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    t_start = time.perf_counter()
    loaded = load_model(args.model)
    model = loaded.model
    # raw slices without a BOS (kvbits eval --bos never); the models measured here (SmolLM2, Qwen2.5) add none
    ids = make_windows(tokenize(load_text(args.text), loaded.tokenizer), args.context, 1)[:1]
    with torch.no_grad():
        h_ref = base_model(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
    head = LogitHead.from_model(model)
    out = {"model": args.model, "text": args.text, "context": args.context, "semantics": "decode",
           "thresholds": {"key": args.key_threshold, "value": args.value_threshold}, "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                      f"torch {torch.__version__}", "runs": []}  # fmt: skip
    for label, scheme, policy in runs(args.key_threshold, args.value_threshold):
        monitors: list[CacheMonitor] = []

        def attach(cache: object, policy: FallbackPolicy | None = policy, label: str = label,
                   monitors: list[CacheMonitor] = monitors) -> None:  # fmt: skip
            monitors.append(CacheMonitor(cache, policy, labels={"run": label}))

        t0 = time.perf_counter()
        h = stream_hidden(model, ids, scheme, fused_decode=False, on_cache=attach)[0]
        seconds = time.perf_counter() - t0
        (mon,) = monitors
        rec = token_metrics(head, h_ref[:-1], [h[:-1]], ids[0, 1:])[0]
        per_token = {k: v.numpy()[None, :] for k, v in rec.items()}
        buckets = [{"lo": b.lo, "hi": b.hi, "tokens": b.tokens, "kl": b.kl_sum / b.tokens,
                    "ppl": math.exp(b.nll_sum / b.tokens), "ppl_ref": math.exp(b.nll_ref_sum / b.tokens),
                    "top1": b.top1_sum / b.tokens} for b in bucket_records(label, per_token)]  # fmt: skip
        snap = mon.snapshot()
        errs = {side: [r["max_error"] for r in snap["signals"] if r["side"] == side] for side in ("key", "value")}
        row = {"label": label, "scheme": scheme, "policy": None if policy is None else policy.to_dict(),
               "seconds": round(seconds, 1), "kl": float(np.mean(per_token["kl"])),
               "ppl": math.exp(float(np.mean(per_token["nll"]))), "ppl_ref": math.exp(float(np.mean(per_token["nll_ref"]))),
               "total_bytes": snap["total_bytes"], "held_layers": snap["held_layers"],
               "held_at": {r["layer"]: r["held_at"] for r in snap["signals"] if r["side"] == "key" and r["held_at"] is not None},
               "max_error_by_layer": errs, "buckets": buckets,
               "events": [{k: e[k] for k in ("layer", "side", "signal", "value", "tokens", "action")} for e in snap["events"]]}  # fmt: skip
        out["runs"].append(row)
        logger.info("%s: KL %.4f, PPL %.3f (ref %.3f), %d bytes, held %s, %.0f s", label, row["kl"], row["ppl"],
                    row["ppl_ref"], row["total_bytes"], row["held_layers"], seconds)  # fmt: skip
        if args.prom is not None and "hold layer" in label:
            mon.write_prometheus(args.prom)
        mon.detach()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['seconds']} s")


if __name__ == "__main__":
    main()
