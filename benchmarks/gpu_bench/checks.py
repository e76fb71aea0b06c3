"""Steps 2 and 2b: every fused-decode variant against a float64 reference, and the quantize-and-pack kernel
bit for bit against ``kvbits.quant.quantize`` (and the time each takes to flush a block)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvbits.kernels.reference import materialize, pack_store
from kvbits.quant import quantize
from kvbits.schemes import TensorSpec

from .common import SHAPES, Config, launch_error, poison_free_memory, sync, time_ms


def _spec(bits: int, gran: str, group: int | None, kind: str = "int", **kw) -> TensorSpec:
    fmt = "e4m3" if kind == "fp8" else None
    return TensorSpec(kind=kind, bits=bits, fmt=fmt, granularity=gran, group_size=group, **kw)


def _quantize(x: torch.Tensor, spec: TensorSpec, tie: bool = False) -> object:
    """``quantize`` with a non-uniform codebook for NUQ specs, and for centred / smoothed specs the channel
    vectors ``kvbits calibrate`` would fit on ``x`` ``(B, H, T, D)`` (mean; spread about it ** alpha; with
    ``tie`` each RoPE pair's larger spread, as ``--tie-rope-pairs``)."""
    if spec.has_channel_transform:
        m = x.float().mean(dim=(0, 2))
        spread = (x.float() - (m if spec.centre else 0 * m)[None, :, None, :]).abs().amax(dim=(0, 2))
        if tie:  # kvbits.calibrate imports only torch and numpy beside kvbits: fine on the GPU machine
            from kvbits.calibrate.fit import tie_rope_pairs

            spread = tie_rope_pairs(spread)
        kw = {"channel_mean": m.half()} if spec.centre else {}
        if spec.smooth is not None:
            kw["channel_factor"] = spread.clamp_min(1e-3 * float(spread.max())).pow(spec.smooth).half()
        return quantize(x, spec, **kw)
    if spec.kind != "nuq":
        return quantize(x, spec)
    u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
    return quantize(x, spec, codebook=(u.abs() ** 1.5 * u.sign()).half().to(x.device))


def pre_rope_args(D: int, positions: int, B: int, dev: torch.device) -> dict:
    """``pack_store`` arguments of pre-RoPE keys for the checks: full-width rotate-half tables (theta 1e6)
    of ``positions`` rows, float32 on ``dev``, and quantized slot 0 of every sequence at position 4."""
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(positions, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([f, f], -1)
    return {"rope_cos": emb.cos().float().to(dev), "rope_sin": emb.sin().float().to(dev), "quant_pos0": [4] * B}


def plain_attention(q: torch.Tensor, store, dtype: torch.dtype) -> torch.Tensor:
    """Softmax attention of ``q (B, H_q, 1, D)`` over the store's K/V as the model sees them, computed in
    ``dtype``: ``materialize`` (rotated sides rotated back by ``dequantize_packed``, pre-RoPE keys rotated to
    their positions), then plain torch. Never through ``reference.code_basis``, so a wrong rotation of the
    query, tail or output in the decode entry points cannot hide in the truth; for a store without rotated
    sides, the same operations as ``decode_attention_reference(q, store, dtype=dtype)``."""
    B, H_q, _, D = q.shape
    H_kv = store.n_kv_heads
    k, v, mask = materialize(store, dtype)
    qg = q.reshape(B, H_kv, H_q // H_kv, D).to(dtype)
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k) * (1.0 / math.sqrt(D))
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(s, dim=-1), v)
    return out.reshape(B, H_q, 1, D).to(q.dtype)


def fp64_truth(q: torch.Tensor, store, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, float]:
    """The float64 reference output for queries ``q (B, H_q, 1, D)`` over ``store``, and torch's max error
    against it at ``dtype`` (float16 or bfloat16): the yardstick of the flash-attention criterion
    (``passes``). Both are ``plain_attention`` over the model's K/V (rotated sides dequantized back)."""
    truth = plain_attention(q.double(), store, torch.float64)
    low = plain_attention(q.to(dtype), store, dtype)
    return truth, (low.double() - truth).abs().max().item()


def passes(err: float, err_pt: float) -> bool:
    """Step 2's criterion: the kernel's error is finite and at most twice torch's at float16 (+ 1e-5)."""
    return math.isfinite(err) and err <= 2 * err_pt + 1e-5


def check_variants(cfg: Config, decode: Callable | None, shapes: list[str] | None = None) -> list[dict]:
    """Each kernel variant vs float64 on this device, at the KV shapes named (default all of ``SHAPES``):
    a row per (shape, variant) with ``ok``. A failure is printed and recorded, not raised: one wrong variant
    (the H200's first run, 2026-11-30) used to abort the run and lose every other kernel's figures."""
    if decode is None:
        return []
    dev = cfg.device
    gen = torch.Generator().manual_seed(0)
    kivi = lambda b: {"key": _spec(b, "channel", 32), "value": _spec(b, "token", 32)}
    variants = [
        ("int8-kivi", kivi(8), {}),
        ("int4-kivi", kivi(4), {}),
        ("int2-kivi", kivi(2), {}),
        ("int4-kivi-gather", kivi(4), {"vectorized": False}),
        ("int2-token-keys", {"key": _spec(2, "token", None), "value": _spec(2, "token", None)}, {}),
        (
            "int3-symmetric",
            {"key": _spec(3, "token", 32, symmetric=True), "value": _spec(3, "token", 32)},
            {},
        ),
        ("int4-pre-rope", {**kivi(4), "rope": True}, {}),
        ("int4-pre-rope-gather", {**kivi(4), "rope": True}, {"vectorized": False}),
        ("fp16-tail-only", None, {}),
        (
            "kvquant4-block",  # pre-RoPE NUQ keys per channel, NUQ values per token, 1 % outliers
            {
                "key": _spec(4, "channel", 32, "nuq", outlier_frac=0.01),
                "value": _spec(4, "token", None, "nuq", outlier_frac=0.01),
                "rope": True,
            },
            {},
        ),
        ("fp8-e4m3", {"key": _spec(8, "token", None, "fp8"), "value": _spec(8, "token", None, "fp8")}, {}),
        ("int4-kivi-masked", {**kivi(4), "mask": True}, {}),  # left padding of a batch: slot masks
    ]
    # dequant="f16" (whole-row 2/4/8-bit integer sides dequantized in float16; opt-in until checked here), and
    # 64-token tiles at every head dim (step 3b's fastest int4 launch at D = 128, which no check covered)
    f16 = {"dequant": "f16"}
    variants += [
        ("int8-kivi-f16", kivi(8), f16),
        ("int4-kivi-f16", kivi(4), f16),
        ("int2-kivi-f16", kivi(2), f16),
        ("int2-token-keys-f16", {"key": _spec(2, "token", None), "value": _spec(2, "token", None)}, f16),
        ("int4-kivi-masked-f16", {**kivi(4), "mask": True}, f16),
        ("int4-kivi-bt64", kivi(4), {"block_t": 64}),
        ("int4-kivi-f16-bt64", kivi(4), {**f16, "block_t": 64}),
        # bfloat16 queries (how Llama-3-class models are served): no device run has checked them yet
        ("int4-kivi-bf16", {**kivi(4), "qdtype": torch.bfloat16}, {}),
        ("int4-pre-rope-bf16", {**kivi(4), "rope": True, "qdtype": torch.bfloat16}, {}),
    ]
    # Hadamard-rotated sides (the int*-token-hadamard presets: per-token codes of x @ R, kvbits.quant.rotate):
    # the decode entry point rotates q and the tail into the codes' basis and the output back (code_basis),
    # judged against the model's K/V (plain_attention), so a missing or wrong rotation fails
    rot = lambda b: {"key": _spec(b, "token", None, rotate="hadamard"), "value": _spec(b, "token", None, rotate="hadamard")}
    variants += [("int8-token-hadamard", rot(8), {}), ("int4-token-hadamard", rot(4), {})]
    # keys centred and smoothed per channel (the int*-token-smooth presets: codes of (k - mean) / factor): the
    # decode entry point scales q by the factors and moves the key tail into that basis (code_basis)
    smooth = {"key": _spec(4, "token", None, centre=True, smooth=0.5), "value": _spec(4, "token", None)}
    # ... and before RoPE (int*-token-smooth-prerope): the kernel decodes code * factor + mean, then RoPE; with
    # factors tied over RoPE pairs (--tie-rope-pairs) the factor moves into q and the kernel decodes code + m / f
    variants += [("int4-token-smooth", smooth, {}), ("int4-token-smooth-pre-rope", {**smooth, "rope": True}, {}),
                 ("int4-token-smooth-pre-rope-tied", {**smooth, "rope": True, "tie": True}, {})]
    # the folded-scale kernel (kvbits.kernels.triton_fold; dequant="fold", opt-in until checked here): its inline PTX
    # code conversion runs only compiled. KIVI's groups, per-token rows (vLLM's symmetric INT8 among them), a
    # left-padded batch, rotated and smoothed sides, and the launches step 3b tunes around its default
    fold = {"dequant": "fold"}
    row = lambda b, **kw: {"key": _spec(b, "token", None, **kw), "value": _spec(b, "token", None, **kw)}
    variants += [
        ("int8-kivi-fold", kivi(8), fold),
        ("int4-kivi-fold", kivi(4), fold),
        ("int2-kivi-fold", kivi(2), fold),
        ("int4-kivi-masked-fold", {**kivi(4), "mask": True}, fold),
        ("int8-token-sym-fold", row(8, symmetric=True), fold),
        ("int4-token-fold", row(4), fold),
        ("int2-token-fold", row(2), fold),
        ("int4-token-hadamard-fold", rot(4), fold),
        ("int4-token-smooth-fold", smooth, fold),
        ("int4-kivi-fold-bt64-2w", kivi(4), {**fold, "block_t": 64, "num_warps": 2}),
        ("int4-kivi-fold-bt256-3s", kivi(4), {**fold, "block_t": 256, "num_stages": 3}),
    ]
    shapes = {name: SHAPES[name] for name in (shapes or SHAPES)}
    if cfg.smoke and dev.type == "cpu":  # the interpreter is slow: whole-row, gather + RoPE, rotated; one shape
        smoke = ("int4-kivi", "int4-pre-rope", "fp16-tail-only", "int4-token-hadamard")
        variants = [v for v in variants if v[0] in smoke]
        shapes = {"qwen2.5-0.5b": SHAPES["qwen2.5-0.5b"]}
    T_q, T_f = (64, 16) if cfg.smoke else (1024, 128)
    results = []
    for shape_name, shp in shapes.items():
        B, H, D, G = 3, shp["H_kv"], shp["D"], shp["H_q"] // shp["H_kv"]
        for name, specs, kw in variants:
            kq = torch.randn(B, H, T_q, D, generator=gen)
            kq[..., : D // 8] *= 6
            if specs is not None and specs["key"].has_channel_transform:
                kq[..., D // 8 : D // 4] += 4  # an offset band (a k_proj bias): what centred keys take out
            vq = torch.randn(B, H, T_q, D, generator=gen)
            kf = (torch.randn(B, H, T_f, D, generator=gen)).half().to(dev)
            vf = torch.randn(B, H, T_f, D, generator=gen).half().to(dev)
            ragged = {"full_lens": [T_f, T_f // 2, 1]}
            if specs is None:
                store = pack_store([], [], kf, vf, **ragged)
            else:
                rope = pre_rope_args(D, T_q + T_f + 4, B, dev) if specs.get("rope") else {}
                masks = {}
                if specs.get("mask"):  # sequence 1 left-padded past its sinks; one more slot of sequence 0
                    qm, fm = torch.ones(B, T_q, dtype=torch.bool), torch.ones(B, T_f, dtype=torch.bool)
                    qm[1, : T_q // 8], fm[1, :4], qm[0, 3] = False, False, False
                    masks = {"quant_mask": qm.to(dev), "full_mask": fm.to(dev)}
                store = pack_store(
                    [_quantize(kq.to(dev), specs["key"], specs.get("tie", False))],
                    [_quantize(vq.to(dev), specs["value"])],
                    kf,
                    vf,
                    quant_lens=[T_q, T_q // 2, T_q // 4 * 3],
                    **ragged,
                    **rope,
                    **masks,
                )
            q = torch.randn(B, H * G, 1, D, generator=gen).to(dev)
            qdt = (specs or {}).get("qdtype", torch.float16)
            truth, err_pt = fp64_truth(q, store, qdt)
            qh = q.to(qdt)
            poison_free_memory(dev)  # an output element the kernel does not write reads NaN: not finite, FAIL
            try:
                out = decode(qh, store, **kw)
                sync(dev)
            except Exception as exc:  # noqa: BLE001 - a launch the device refuses: recorded, the sweep records it too
                results.append({"variant": name, "shape": shape_name, "error": launch_error(exc), "ok": False})
                print(f"  check {shape_name:13s} {name:20s} did not launch: {results[-1]['error']}")
                continue
            err = (out.double() - truth).abs().max().item()
            ok = passes(err, err_pt)
            results.append(
                {"variant": name, "shape": shape_name, "err": err, "err_torch_fp16": err_pt, "ok": ok,
                 "query_dtype": str(qdt).removeprefix("torch.")}  # err_torch_fp16: torch at query_dtype
            )
            print(
                f"  check {shape_name:13s} {name:20s} kernel err {err:.2e}  torch {str(qdt)[6:]} err {err_pt:.2e}  "
                f"{'ok' if ok else 'FAIL'}"
            )
    failed = [f"{r['variant']} on {r['shape']}" for r in results if not r["ok"]]
    if failed:  # recorded (``checks[].ok``); the run goes on so that the other kernels' figures are not lost
        print(f"CORRECTNESS FAILURE: {', '.join(failed)}. Timings of those paths measure a wrong kernel.")
    return results


QUANTIZE_SPECS = {  # the append path of the presets: values per token, keys per channel (block or static)
    "int4-token-g32": _spec(4, "token", 32),
    "int8-token": _spec(8, "token", None),
    "int2-channel-g32": _spec(2, "channel", 32),
    "int4-channel-g128": _spec(4, "channel", 128),
    "int4-channel-static": _spec(4, "channel", None, static=True),
    "fp8-e4m3-token": _spec(8, "token", None, "fp8"),
    # KVQuant (kvquant-4-block / kvquant-4): NUQ keys with block or static ranges, NUQ values, 1 % outliers
    "nuq4-channel-g128-outl": _spec(4, "channel", 128, "nuq", outlier_frac=0.01),
    "nuq4-channel-static-outl": _spec(4, "channel", None, "nuq", static=True, outlier_frac=0.01),
    "nuq4-token-outl": _spec(4, "token", None, "nuq", outlier_frac=0.01),
    "nuq3-channel-g128-outl": _spec(3, "channel", 128, "nuq", outlier_frac=0.01),  # kvquant-3-block keys
}


def quantize_stand_in(name: str) -> tuple[torch.Tensor, dict]:
    """CPU ``(x, kwargs)`` for ``quantize_pack_triton`` with the shapes and dtypes step 2b passes for
    ``QUANTIZE_SPECS[name]`` (its Llama-3-8B block): what compiling that launch needs (``prewarm.py``,
    ``kernel_resources.py``), not its data."""
    from kvbits.quant.nuq import uniform_codebook

    spec = QUANTIZE_SPECS[name]
    B, H, n, D = 8, 8, 128, 128
    kw: dict = {}
    if spec.static:
        kw = {"static_scale": torch.full((H, D), 0.5).half(), "static_zero": torch.full((H, D), -2.0).half()}
    if spec.kind == "nuq":
        kw["codebook"] = uniform_codebook(spec.bits)
    return torch.randn(B, H, n, D).half(), kw


def _mismatch(want, got) -> dict:
    """What differs between two ``QuantizedTensor`` of one spec: counts and largest gaps per field."""

    def gap(a, b) -> dict:
        if a is None or b is None:
            return {"missing": a is None, "other_missing": b is None}
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"shape": [list(a.shape), list(b.shape)], "dtype": [str(a.dtype), str(b.dtype)]}
        d = (a.float() - b.float()).abs() if a.is_floating_point() else (a.int() - b.int()).abs()
        d = d.nan_to_num(float("inf"))
        return {"n_diff": int((d > 0).sum()), "of": a.numel(), "max": float(d.max()) if d.numel() else 0.0}

    out = {f: gap(getattr(want, f), getattr(got, f)) for f in ("data", "scale", "zero", "outlier_values", "outlier_index")
           if getattr(want, f) is not None or getattr(got, f) is not None}  # fmt: skip
    dq = (want.dequantize().float() - got.dequantize().float()).abs()
    out["dequantized_max_gap"] = float(dq.nan_to_num(float("inf")).max())
    out["clipped"] = [int(want.clipped), int(got.clipped)]
    return out


def check_and_time_quantize(cfg: Config, flush: torch.Tensor | None) -> list[dict]:
    """Quantize-and-pack (``kvbits.kernels.triton_quantize``): bit-for-bit against ``kvbits.quant.quantize``
    on this device (abort on a mismatch: the cache flushes through it on CUDA), then the time to flush
    one 128-token block of a Llama-3-8B-shaped layer (B=8, H_kv=8, D=128, fp16) by each path."""
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    if cfg.device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    gen = torch.Generator().manual_seed(1)
    B, H, n, D = (1, 2, 128, 64) if cfg.smoke else (8, 8, 128, 128)
    out = []
    for name, spec in QUANTIZE_SPECS.items():
        x = torch.randn(B, H, n, D, generator=gen)
        x[..., :4] *= 20
        x = x.half().to(cfg.device)
        kw = {}
        if spec.static:
            lo, hi = x.float().amin(dim=(0, 2)) * 0.8, x.float().amax(dim=(0, 2)) * 0.8
            width = (hi - lo) if spec.kind == "nuq" else (hi - lo) / 15  # NUQ ranges are the range itself
            kw = {"static_scale": width.half(), "static_zero": lo.half()}
        if spec.kind == "nuq":
            u = torch.linspace(-1, 1, 2**spec.bits, dtype=torch.float64)
            kw["codebook"] = (u.abs() ** 1.5 * u.sign()).half().to(cfg.device)
        want = quantize(x, spec, **kw)
        poison_free_memory(cfg.device)  # codes or scales left unwritten hold NaN bytes: a mismatch
        got = quantize_pack_triton(x, spec, **kw)
        same = (
            torch.equal(want.data, got.data)
            and torch.equal(want.scale, got.scale)
            and (want.zero is None or torch.equal(want.zero, got.zero))
            and (want.outlier_values is None or (torch.equal(want.outlier_values, got.outlier_values)
                                                 and torch.equal(want.outlier_index, got.outlier_index)))
            and want.clipped == got.clipped
        )  # fmt: skip
        rec = {"spec": name, "shape": [B, H, n, D], "bit_exact": same}
        if not same:  # recorded with what differs, not raised: the run goes on (its figures are not lost)
            rec["mismatch"] = _mismatch(want, got)
            print(f"QUANTIZE KERNEL MISMATCH: {name}: {rec['mismatch']}")
        if not cfg.smoke:
            # eager, as the cache flushes (no CUDA graph for either)
            tri = lambda x=x, spec=spec, kw=kw: quantize_pack_triton(x, spec, sync=False, **kw)
            ref = lambda x=x, spec=spec, kw=kw: quantize(x, spec, sync=False, **kw)
            rec["ms_triton"], _ = time_ms(tri, cfg, flush, graph=False)
            rec["ms_torch"], _ = time_ms(ref, cfg, flush, graph=False)
            rec["speedup"] = round(rec["ms_torch"] / rec["ms_triton"], 2)
        print(f"  quantize {name:22s} bit-exact {same}  " + (
            f"triton {rec['ms_triton']:.4f} ms  torch {rec['ms_torch']:.4f} ms" if not cfg.smoke else ""))  # fmt: skip
        out.append(rec)
    return out
