"""Prototype (issue 5): a lean decode kernel over a *split-packed* layout, checked on CPU, its tile loop
counted in sm_90 machine code beside the product kernel's.

Why. The H200 run (BENCHMARKS.md §6) found the product kernel (``kvbits.kernels.triton_decode``) latency- and
issue-bound: 6-20 % of the copy bandwidth at int4, every tile iteration about 3 µs whatever it reads, about
10 instructions per code (session 10). Much of that is layout work, not arithmetic: codes packed
little-endian along ``D`` (``kvbits.quant.pack``: channel ``c`` in byte ``c // P``) are unpacked into channel
order with ``tl.interleave`` / ``tl.join`` and reshapes, the key tile is transposed for ``q @ k``, and every
code gets its own scale multiply-add.

What this prototype changes, and only for the formats it covers (2/4/8-bit integer codes, no outliers, no
pre-RoPE keys, float16 queries):

- **Split packing**: byte ``i`` of a row holds channels ``i, i + W, ..., i + (P-1) W`` (``P = 8 / bits`` codes
  per byte, ``W = D / P``) instead of ``P i .. P i + P - 1``. Code part ``k`` of a loaded byte tile is then
  channels ``k W .. k W + W - 1`` in order: a shift and a mask, with no interleave, join or reshape, and the
  attention splits into ``P`` dots of width ``W`` (``q @ k = sum_k q[:, part k] @ k[part k]``).
- **Exact float16 codes**: ``(code | 0x6400)`` read as float16 is ``1024 + code``; one subtraction gives the
  code exactly (FasterTransformer / Marlin's conversion), no integer-to-float instruction.
- **Scales folded out of the tiles**: per-token keys ``k = c s_t + z_t`` give scores
  ``s_t (q . c) + z_t sum(q)``, a multiply-add per score (``G x BLOCK_T``) instead of one per code
  (``D x BLOCK_T``); per-channel keys (one row of ``D`` scales per group of tokens) fold into the query,
  ``(q * s) . c + q . z``, once per group; per-token values ``v = c s_t + z_t`` fold into the probabilities,
  ``(p * s_t) @ c + (p . z) 1``.

Same bytes as the product's layout (only the order of codes within a row changes), so a cache could store it;
nothing in the product uses it. Session 38's ``kvbits.kernels.triton_fold`` took its folding further without the
split packing (kvbits' own rows, codes as the dots' row operand, four codes per register converted in inline PTX),
and it is that kernel the device run times. ``--check`` runs the kernel (CUDA, else Triton's interpreter) against a
float64 reference; ``--sass`` compiles it and the product kernel for sm_90 on this CPU (no GPU needed) and
prints each tile loop's instructions per token.

    PYTHONPATH=src python benchmarks/lean_decode.py --check
    PYTHONPATH=src python benchmarks/lean_decode.py --sass [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qwen2.5-0.5b": {"H_kv": 2, "H_q": 14, "D": 64}, "llama-3-8b": {"H_kv": 8, "H_q": 32, "D": 128}}
KEY_GROUP = 32  # per-channel keys: one scale row per 32 tokens (KIVI)


# ------------------------------------------------------------------------------------------- layout (torch)


def pack_split(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(..., D)`` uint8 in ``[0, 2**bits)`` → split-packed rows ``(..., D * bits / 8)`` uint8: byte ``i``
    holds channel ``i + k W`` at bits ``[k bits, (k + 1) bits)``, ``W = D * bits / 8``."""
    P, D = 8 // bits, codes.shape[-1]
    W = D // P
    out = torch.zeros(*codes.shape[:-1], W, dtype=torch.uint8, device=codes.device)
    for k in range(P):
        out |= codes[..., k * W : (k + 1) * W] << (k * bits)
    return out


def unpack_split(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_split``."""
    P, mask = 8 // bits, (1 << bits) - 1
    return torch.cat([(rows >> (k * bits)) & mask for k in range(P)], dim=-1)


def random_store(B: int, H: int, T: int, D: int, bits: int, keys: str, gen: torch.Generator) -> dict:
    """Random codes and float16 scales/zero-points of ``T`` quantized slots: values per token; keys per token
    (``keys="token"``) or per channel over ``KEY_GROUP`` tokens (``"channel"``). Codes ``(B, H, T, D)``."""
    hi = 1 << bits
    kc = torch.randint(0, hi, (B, H, T, D), generator=gen, dtype=torch.uint8)
    vc = torch.randint(0, hi, (B, H, T, D), generator=gen, dtype=torch.uint8)
    k_rows = T if keys == "token" else T // KEY_GROUP
    k_cols = 1 if keys == "token" else D
    ks = (torch.rand(B, H, k_rows, k_cols, generator=gen) * 0.2 / hi + 0.5 / hi).half()
    kz = (torch.rand(B, H, k_rows, k_cols, generator=gen) - 0.75).half()
    vs = (torch.rand(B, H, T, 1, generator=gen) * 0.2 / hi + 0.5 / hi).half()
    vz = (torch.rand(B, H, T, 1, generator=gen) - 0.75).half()
    return {"kc": kc, "ks": ks, "kz": kz, "vc": vc, "vs": vs, "vz": vz, "bits": bits, "keys": keys}


def dequantize(st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 K, V ``(B, H, T, D)`` of a store."""
    ks, kz = st["ks"].double(), st["kz"].double()
    if st["keys"] == "channel":
        ks = ks.repeat_interleave(KEY_GROUP, dim=2)
        kz = kz.repeat_interleave(KEY_GROUP, dim=2)
    k = st["kc"].double() * ks + kz
    v = st["vc"].double() * st["vs"].double() + st["vz"].double()
    return k, v


def reference(q: torch.Tensor, st: dict, dtype: torch.dtype) -> torch.Tensor:
    """Attention of ``q (B, H_q, 1, D)`` over the dequantized store in ``dtype`` (GQA by repetition)."""
    k, v = dequantize(st)
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).to(dtype), v.repeat_interleave(G, 1).to(dtype)
    s = (q.to(dtype) @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.double(), -1).to(dtype) @ v


# ------------------------------------------------------------------------------------------- the kernel


def _kernels():
    """The Triton kernel (defined on first use, after the interpreter is chosen)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _part(b, k: tl.constexpr, BITS: tl.constexpr):
        """Code part ``k`` of a split-packed byte tile as exact float16 codes."""
        c = (b.to(tl.int16) >> (k * BITS)) & ((1 << BITS) - 1)
        return (c | 0x6400).to(tl.float16, bitcast=True) - 1024.0

    @triton.jit
    def _scores(q0, q1, q2, q3, kb, BITS: tl.constexpr):
        """``sum_k q_k @ part_k(kb)``: ``q_k (G_PAD, W)`` float16, ``kb (W, BLOCK_T)`` bytes → float32."""
        P: tl.constexpr = 8 // BITS
        s = tl.dot(q0, _part(kb, 0, BITS))
        if P > 1:
            s += tl.dot(q1, _part(kb, 1, BITS))
        if P > 2:
            s += tl.dot(q2, _part(kb, 2, BITS))
            s += tl.dot(q3, _part(kb, 3, BITS))
        return s

    @triton.jit
    def _lean_kernel(
        Q, M_OUT, L_OUT, ACC_OUT, KC, KS, KZ, VC, VS, VZ,
        qk_scale, H_kv, T, chunk, n_split, K_SROWS,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr,
        K_CHANNEL: tl.constexpr, KG: tl.constexpr,
    ):  # fmt: skip
        """Grid ``(B * H_kv, n_split)``. Split-packed codes ``(B * H_kv, T, W)``; values per token (scale and
        zero ``(B * H_kv, T)``); keys per token (same) or per channel (``(B * H_kv, T / KG, D)``,
        ``BLOCK_T == KG``). Writes the same partials as the product kernel (``M/L (B*H_q, n_split)``,
        ``ACC (B*H_q, n_split, D)``), reduced by its ``_reduce_kernel`` (``reduce_splits``)."""
        P: tl.constexpr = 8 // BITS
        W: tl.constexpr = D // P
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // H_kv
        h = pid_bh % H_kv
        offs_g = tl.arange(0, G_PAD)
        offs_w = tl.arange(0, W)
        offs_t = tl.arange(0, BLOCK_T)
        gmask = offs_g < G
        row = b * (H_kv * G) + h * G + offs_g
        qp = Q + row[:, None] * D + offs_w[None, :]
        q0 = tl.load(qp, mask=gmask[:, None], other=0.0)
        q1 = q0
        q2 = q0
        q3 = q0
        if P > 1:
            q1 = tl.load(qp + W, mask=gmask[:, None], other=0.0)
        if P > 2:
            q2 = tl.load(qp + 2 * W, mask=gmask[:, None], other=0.0)
            q3 = tl.load(qp + 3 * W, mask=gmask[:, None], other=0.0)
        qsum = tl.sum(q0.to(tl.float32), 1)
        if P > 1:
            qsum += tl.sum(q1.to(tl.float32), 1)
        if P > 2:
            qsum += tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1)
        m_i = tl.full([G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        a0 = tl.zeros([G_PAD, W], tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        az = tl.zeros([G_PAD], tl.float32)  # sum_t p_t z_t: the values' zero-points, added to every channel
        bh = pid_bh.to(tl.int64)
        kc = KC + bh * T * W
        vc = VC + bh * T * W
        start = pid_s * chunk
        end = tl.minimum(start + chunk, T)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + offs_t
            valid = t < end
            kb = tl.load(kc + t[None, :] * W + offs_w[:, None], mask=valid[None, :], other=0)  # (W, BLOCK_T)
            if K_CHANNEL:  # one scale row per KG tokens: fold it into the query, once per tile
                srow = KS + (bh * K_SROWS + t0 // KG) * D + offs_w
                zrow = KZ + (bh * K_SROWS + t0 // KG) * D + offs_w
                s0 = tl.load(srow)
                z0 = tl.load(zrow)
                k0 = (q0 * s0[None, :]).to(tl.float16)
                qz = tl.sum(q0.to(tl.float32) * z0[None, :].to(tl.float32), 1)
                k1 = k0
                k2 = k0
                k3 = k0
                if P > 1:
                    s1 = tl.load(srow + W)
                    z1 = tl.load(zrow + W)
                    k1 = (q1 * s1[None, :]).to(tl.float16)
                    qz += tl.sum(q1.to(tl.float32) * z1[None, :].to(tl.float32), 1)
                if P > 2:
                    s2 = tl.load(srow + 2 * W)
                    z2 = tl.load(zrow + 2 * W)
                    s3 = tl.load(srow + 3 * W)
                    z3 = tl.load(zrow + 3 * W)
                    k2 = (q2 * s2[None, :]).to(tl.float16)
                    k3 = (q3 * s3[None, :]).to(tl.float16)
                    qz += tl.sum(q2.to(tl.float32) * z2[None, :].to(tl.float32), 1)
                    qz += tl.sum(q3.to(tl.float32) * z3[None, :].to(tl.float32), 1)
                s = _scores(k0, k1, k2, k3, kb, BITS) + qz[:, None]
            else:  # one scale per token: s_t (q . c) + z_t sum(q)
                ks = tl.load(KS + bh * T + t, mask=valid, other=0.0).to(tl.float32)
                kz = tl.load(KZ + bh * T + t, mask=valid, other=0.0).to(tl.float32)
                s = _scores(q0, q1, q2, q3, kb, BITS) * ks[None, :] + qsum[:, None] * kz[None, :]
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            vs = tl.load(VS + bh * T + t, mask=valid, other=0.0).to(tl.float32)
            vz = tl.load(VZ + bh * T + t, mask=valid, other=0.0).to(tl.float32)
            az = az * alpha + tl.sum(p * vz[None, :], 1)
            ps = (p * vs[None, :]).to(tl.float16)  # the values' scales folded into the probabilities
            vb = tl.load(vc + t[:, None] * W + offs_w[None, :], mask=valid[:, None], other=0)  # (BLOCK_T, W)
            a0 = a0 * alpha[:, None] + tl.dot(ps, _part(vb, 0, BITS))
            if P > 1:
                a1 = a1 * alpha[:, None] + tl.dot(ps, _part(vb, 1, BITS))
            if P > 2:
                a2 = a2 * alpha[:, None] + tl.dot(ps, _part(vb, 2, BITS))
                a3 = a3 * alpha[:, None] + tl.dot(ps, _part(vb, 3, BITS))
        out = row * n_split + pid_s
        tl.store(M_OUT + out, m_i, mask=gmask)
        tl.store(L_OUT + out, l_i, mask=gmask)
        acc = ACC_OUT + out[:, None] * D + offs_w[None, :]
        tl.store(acc, a0 + az[:, None], mask=gmask[:, None])
        if P > 1:
            tl.store(acc + W, a1 + az[:, None], mask=gmask[:, None])
        if P > 2:
            tl.store(acc + 2 * W, a2 + az[:, None], mask=gmask[:, None])
            tl.store(acc + 3 * W, a3 + az[:, None], mask=gmask[:, None])

    # the kernels find their helpers as module globals (Triton resolves names in the function's globals)
    globals().update(_part=_part, _scores=_scores)
    return _lean_kernel


_KERNEL = None


def lean_decode(
    q: torch.Tensor, st: dict, *, splits: int = 4, block_t: int = 32, num_warps: int = 4, num_stages: int = 2
) -> torch.Tensor:
    """``q (B, H_q, 1, D)`` float16 over a store (``random_store``; codes split-packed here) →
    ``(B, H_q, 1, D)`` float16. Per-channel keys need ``block_t == KEY_GROUP``."""
    global _KERNEL
    from kvbits.kernels.triton_decode import LOG2E, _chunk, reduce_splits

    if _KERNEL is None:
        _KERNEL = _kernels()
    B, H_q, _, D = q.shape
    _, H, T, _ = st["kc"].shape
    G = H_q // H
    if st["keys"] == "channel" and block_t != KEY_GROUP:
        raise ValueError(f"per-channel keys need block_t == {KEY_GROUP}, got {block_t}")
    bits = st["bits"]
    kc = st.setdefault("kc_split", pack_split(st["kc"], bits).to(q.device))
    vc = st.setdefault("vc_split", pack_split(st["vc"], bits).to(q.device))
    n_split, chunk = _chunk(T, splits, block_t)
    dev = q.device
    m = torch.empty(B * H_q, n_split, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H_q, n_split, D, device=dev, dtype=torch.float32)
    out = torch.empty(B * H_q, D, device=dev, dtype=q.dtype)
    ks, kz = st["ks"].to(dev), st["kz"].to(dev)
    _KERNEL[(B * H, n_split)](
        q.reshape(B * H_q, D).contiguous(), m, l_, acc, kc, ks, kz, vc, st["vs"].to(dev), st["vz"].to(dev),
        LOG2E / math.sqrt(D), H, T, chunk, n_split, ks.shape[2],
        G=G, G_PAD=max(16, triton_pow2(G)), D=D, BLOCK_T=block_t, BITS=bits,
        K_CHANNEL=st["keys"] == "channel", KG=KEY_GROUP, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return reduce_splits(m, l_, acc, out).reshape(B, H_q, 1, D)


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------------- checks


def check(device: torch.device) -> list[dict]:
    """The kernel against float64 attention over the same dequantized store, beside torch's float16 error."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape_name, shape in SHAPES.items():
        for bits in (8, 4, 2):
            for keys in ("token", "channel"):
                B, T = 2, 256
                st = random_store(B, shape["H_kv"], T, shape["D"], bits, keys, gen)
                q = (4 * torch.randn(B, shape["H_q"], 1, shape["D"], generator=gen)).half()  # peaked attention
                truth = reference(q, st, torch.float64)
                got = lean_decode(q.to(device), st).double().cpu()
                torch16 = reference(q, st, torch.float32).half().double()  # float16 result of float32 math
                err, ref_err = float((got - truth).abs().max()), float((torch16 - truth).abs().max())
                rows.append({"shape": shape_name, "bits": bits, "keys": keys, "max_err": err,
                             "torch_fp16_err": ref_err, "ok": err <= 2 * ref_err})  # fmt: skip
                print(f"{shape_name:13s} int{bits} keys per {keys:7s} max err {err:.2e} (torch fp16 {ref_err:.2e})"
                      f" {'ok' if rows[-1]['ok'] else 'FAIL'}", flush=True)  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------- sm_90 code


def sass_rows(arch: str = "sm_90") -> list[dict]:
    """The lean kernel's and the product kernel's tile loops compiled for ``arch``: instructions per warp and
    tile, warp-instructions per token and KV head, registers, blocks per SM."""
    from gpu_bench import common
    from kernel_resources import decode_rows

    from kvbits.kernels.aot import compile_only

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernels()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape_name, shape in SHAPES.items():
        for bits in (8, 4, 2):
            for keys in ("token", "channel"):
                st = random_store(2, shape["H_kv"], 4096, shape["D"], bits, keys, gen)
                q = torch.randn(2, shape["H_q"], 1, shape["D"]).half()
                launches = [(32, 4)] if keys == "channel" else [(32, 4), (64, 4), (128, 4), (128, 8)]
                for block_t, warps in launches:
                    with compile_only(arch) as compiled:
                        lean_decode(q, st, block_t=block_t, num_warps=warps)
                    (k,) = [c for c in compiled if c.name == "_lean_kernel"]
                    rows.append(_row("lean", shape_name, bits, keys, block_t, warps, k, arch))
                # the product kernel on the same format (its own layout): default path and dequant="f16"
                scheme = common.SCHEMES[f"int{bits}"]
                layout = "token" if keys == "token" else "kivi"
                store = common.random_store(2, shape, 4096 + common.RESIDUAL, scheme, torch.device("cpu"),
                                            torch.Generator().manual_seed(0), lazy=True, layout=layout)  # fmt: skip
                for path, launch in (("product", {}), ("product f16", {"dequant": "f16"})):
                    for r in decode_rows("lean", f"int{bits}", shape_name, store, arch, **launch):
                        rows.append({"kernel": path, "shape": shape_name, "bits": bits,
                                     "keys": keys if keys == "token" else "channel (values g32)",
                                     "block_t": r["block_t"], "num_warps": r["num_warps"], "registers": r["registers"],
                                     "spill_bytes": r["local_bytes"], "blocks_per_sm": r["blocks_per_sm"],
                                     "loop_instructions": r["loop_instructions"],
                                     "warp_instructions_per_token": r["warp_instructions_per_token"]})  # fmt: skip
    return rows


def _row(kernel: str, shape: str, bits: int, keys: str, block_t: int, warps: int, k, arch: str) -> dict:
    from kvbits.kernels.aot import LIMITS, hot_loop, resources

    r = resources(k)
    n, ops = hot_loop(k)
    return {"kernel": kernel, "shape": shape, "bits": bits, "keys": keys, "block_t": block_t, "num_warps": warps,
            "registers": r.registers, "spill_bytes": r.local_bytes, "blocks_per_sm": LIMITS[arch].blocks_per_sm(r),
            "loop_instructions": n, "warp_instructions_per_token": round(n * warps / block_t, 1),
            "loop_ops": dict(list(ops.items())[:12])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="run the kernel against float64 (CUDA, else interpreter)")
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 here and count the tile loops")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    result: dict = {}
    if args.check:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            from kvbits.kernels.interpret import enable_interpreter

            enable_interpreter()
        result["check"] = check(device)
    if args.sass:
        from kvbits.kernels.interpret import interpreting

        if interpreting():
            raise SystemExit("--sass needs compiled kernels: run it in its own process without --check")
        result["sass"] = rows = sass_rows()
        print("| kernel | shape | bits | keys | block_t | warps | regs | spill | blocks/SM | loop instr | warp-instr/token |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kernel']} | {r['shape']} | {r['bits']} | {r['keys']} | {r['block_t']} | {r['num_warps']} | "
                  f"{r['registers']} | {r['spill_bytes']} | {r['blocks_per_sm']} | {r['loop_instructions']} | "
                  f"{r['warp_instructions_per_token']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(r["ok"] for r in result.get("check", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
