"""Localise a fused-decode correctness failure on the GPU: one store, many launch variants.

    PYTHONPATH=src python benchmarks/kernel_diag.py --out diag.json     # CUDA; ~1-2 min (compiles)
    PYTHONPATH=src python benchmarks/kernel_diag.py --device cpu --small  # interpreter, same code paths

Written after the H200's first run (2026-11-30, commit 068924c) failed step 2 of ``gpu_decode.py`` on one
variant only: ``kvquant4-block`` (NUQ 4-bit keys per channel in 32-token groups, pre-RoPE, NUQ values per
token, 1 % sparse outliers: 2 per row at D = 128) at the Llama-3-8B shape (H_kv = 8, G = 4, D = 128):
kernel error 5.73 against float64 while torch at fp16 errs 0.006; the same variant passed at D = 64
(1 outlier per row, 32-token tiles), and the Triton interpreter on CPU passes it at D = 128. That variant
is the only one that reaches the whole-row (``_load_rows``) path with 16-token tiles and with two
outliers per row. Each line below changes one of those factors; the dequantization kernels test the
row loader alone. Every result is recorded (no abort): ``err`` is the max abs error against float64,
``err_torch_fp16`` torch's at fp16, ``ok`` the flash-attention criterion (err <= 2 x torch's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench.checks import _quantize, _spec, fp64_truth, passes, pre_rope_args

from kvbits.kernels.reference import dequantize_packed, pack_store


def build(dev, B, H, G, D, T_q, T_f, key, value, rope: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kq = torch.randn(B, H, T_q, D, generator=gen)
    kq[..., : D // 8] *= 6
    vq = torch.randn(B, H, T_q, D, generator=gen)
    kf = torch.randn(B, H, T_f, D, generator=gen).half().to(dev)
    vf = torch.randn(B, H, T_f, D, generator=gen).half().to(dev)
    extra = pre_rope_args(D, T_q + T_f + 4, B, dev) if rope else {}
    store = pack_store([_quantize(kq.to(dev), key)], [_quantize(vq.to(dev), value)], kf, vf,
                       quant_lens=[T_q, T_q // 2, T_q // 4 * 3][:B], full_lens=[T_f, T_f // 2, 1][:B], **extra)  # fmt: skip
    q = torch.randn(B, H * G, 1, D, generator=gen).to(dev)
    return store, q


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="short contexts (the interpreter is slow)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget-s", type=float, default=150.0, help="no new case starts after this")
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    from kvbits.kernels.triton_decode import decode_attention_triton, dequantize_packed_triton

    B, H, G, D = 3, 8, 4, 128
    T_q, T_f = (64, 16) if a.small else (1024, 128)
    nuq_k = lambda f: _spec(4, "channel", 32, "nuq", outlier_frac=f)
    nuq_v = lambda f: _spec(4, "token", None, "nuq", outlier_frac=f)
    int_k = lambda f: _spec(4, "channel", 32, outlier_frac=f)
    int_v = lambda f: _spec(4, "token", 32, outlier_frac=f)
    stores = {  # name: (key spec, value spec, pre-RoPE keys)
        "kvq-rope": (nuq_k(0.01), nuq_v(0.01), True),
        "kvq-norope": (nuq_k(0.01), nuq_v(0.01), False),
        "kvq-rope-1outl": (nuq_k(0.005), nuq_v(0.005), True),
        "nuq-rope-0outl": (nuq_k(0.0), nuq_v(0.0), True),
        "int4-rope-outl": (int_k(0.01), int_v(0.01), True),
        "int4-norope-outl": (int_k(0.01), int_v(0.01), False),
        "int4-rope": (int_k(0.0), int_v(0.0), True),
        "nuq-k-outl-int-v": (nuq_k(0.01), int_v(0.0), True),
        "int-k-nuq-v-outl": (int_k(0.0), nuq_v(0.01), True),
    }
    cases = [  # (store, launch kwargs)
        ("kvq-rope", {}),
        ("kvq-rope", {"vectorized": False}),
        ("kvq-rope", {"block_t": 32}),
        ("kvq-rope", {"num_stages": 1}),
        ("kvq-rope", {"num_warps": 8}),
        ("kvq-norope", {}),
        ("kvq-rope-1outl", {}),
        ("nuq-rope-0outl", {"block_t": 16}),
        ("int4-rope-outl", {}),
        ("int4-norope-outl", {}),
        ("int4-rope", {"block_t": 16}),
        ("nuq-k-outl-int-v", {}),
        ("int-k-nuq-v-outl", {}),
        ("kvq-rope", {"splits": 1}),
    ]
    built: dict = {}
    rows: list[dict] = []
    t0 = time.time()

    def save() -> None:
        if a.out:
            a.out.write_text(json.dumps({"device": str(torch.cuda.get_device_name(dev)) if dev.type == "cuda"
                                         else "cpu", "rows": rows}, indent=1))  # fmt: skip

    # the row loader alone: dequantize each side of the failing store through the kernels' helpers
    store, _ = build(dev, B, H, G, D, T_q, T_f, *stores["kvq-rope"])
    built["kvq-rope"] = store, _
    for side in ("key", "value"):
        pt = getattr(store, side)
        want = dequantize_packed(pt, torch.float32)
        for bt, vec in ((16, True), (32, True), (16, False)):
            t1 = time.time()
            got = dequantize_packed_triton(pt, block_t=bt, vectorized=vec)
            err = (got - want).abs().max().item()
            bad = ((got - want).abs() > 1e-3).nonzero()
            rows.append({"case": f"dequant-{side}", "block_t": bt, "vectorized": vec, "err": err,
                         "n_bad": int(bad.shape[0]), "first_bad": bad[:4].tolist(), "s": round(time.time() - t1, 1)})  # fmt: skip
            print(rows[-1], flush=True)
            save()
    for name, kw in cases:
        if time.time() - t0 > a.budget_s:
            rows.append({"case": name, "launch": kw, "skipped": "budget"})
            continue
        if name not in built:
            built[name] = build(dev, B, H, G, D, T_q, T_f, *stores[name])
        store, q = built[name]
        truth, err_pt = fp64_truth(q, store)
        t1 = time.time()
        try:
            out = decode_attention_triton(q.half(), store, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            e = (out.double() - truth).abs()
            err = e.max().item()
            per_b = e.amax(dim=(1, 2, 3)).tolist()
            ok = passes(err, err_pt)
            rows.append({"case": name, "launch": kw, "err": err, "err_torch_fp16": err_pt, "ok": ok,
                         "err_per_sequence": per_b, "s": round(time.time() - t1, 1)})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded
            rows.append({"case": name, "launch": kw, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(rows[-1], flush=True)
        save()
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
