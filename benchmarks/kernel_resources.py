"""What each Triton kernel launch asks of an H100/H200 (sm_90), compiled here, without a GPU.

    PYTHONPATH=src python benchmarks/kernel_resources.py          # -> benchmarks/results/kernel_resources.json
    PYTHONPATH=src python benchmarks/kernel_resources.py --quick  # one launch per kind (the test suite's)

``kvbits.kernels.aot.compile_only`` turns the product's own launches into compiles for the target
(Triton's LLVM + bundled ptxas), so each row is a kernel exactly as the GPU would receive it:
registers per thread, shared memory per block, spilled (local) bytes, resident blocks per SM, the
reason it would not launch, if any, the machine code's global loads by width and tensor-core
(``HMMA``) instructions, and the instructions of the decode kernel's tile loop (``aot.hot_loop``: per
warp and tile; ``warp_instructions_per_token`` = that x warps / tile tokens: the issue cost per token
and KV head, which BENCHMARKS.md §6 sets beside the H200's decode times). Launches:

- ``cache``: every preset the fused decode path serves, its store built by ``QuantizedKVCache`` from a
  prefill (as the cache launches it), default launch (``launch_defaults``) and the gather fallback
  (``vectorized=False``), the opt-in ``dequant="f16"`` path where a side allows it and the opt-in folded-scale
  kernel (``dequant="fold"``, ``kvbits.kernels.triton_fold``) where it reads the store, at the KV
  shapes of Qwen2.5-0.5B, Llama-3-8B and Gemma-2-9B (head dim 256), float16 queries (and bfloat16 /
  float32 ones for kivi-4 and kvquant-4-block);
- ``cache-odd``: the presets with one scale per token row, after a prefill of an odd number of tokens (a
  growing cache's every other step, an odd reservation): their scales are read as words across slabs that
  alternately start in a word's middle (``_words_ok`` 2), default launch and ``dequant="f16"``;
- ``sweep``: every ``SCHEMES`` variant ``benchmarks/gpu_decode.py`` times (step 3): default, gather, f16 and fold
  launches (its per-token ``TOKEN_SCHEMES`` launch what the ``int4-token``, ``-hadamard``, ``-smooth`` and
  ``-smooth-prerope`` presets launch, which ``cache`` covers; the tied factors of ``-smooth-prerope-tied``
  come from ``kvbits calibrate --tie-rope-pairs``, not from a preset's default store);
- ``tune``: gpu_decode's step 3b grids (``sweep.TUNE_CASES``: int4 and int4-prerope, ``block_t`` x ``num_warps``
  x ``num_stages``; int4 with ``dequant="f16"``, with and without a 128-register cap, ``block_t`` x warps x
  stages; int4 with 2-byte scale reads, ``meta32=False``; int4 through the folded kernel, its tiles x warps x stages);
- ``quantize``: the quantize-and-pack kernel for gpu_decode's ``QUANTIZE_SPECS`` at D = 128.

Must run in a process whose kernels are compiled (``TRITON_INTERPRET`` unset); exits 1 if a default
launch (``cache``, ``sweep``, ``quantize``) would fail on the target, or a decode kernel would spill
registers on the default (vectorised) path or the f16 one (the opt-in folded kernel's few spills are in the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import checks, common, sweep

from kvbits.kernels.aot import LIMITS, compile_only, hot_loop, instruction_mix, resources
from kvbits.kernels.triton_decode import _words_ok, f16_ok
from kvbits.kernels.triton_fold import fold_supported

RESULTS = Path(__file__).resolve().parent / "results" / "kernel_resources.json"
DECODE_KERNELS = ("_decode_kernel", "_fold_kernel")  # the decode kernels' rows (their split reduction is not listed)
# the benchmark's KV shapes plus a head dim of 256 (Gemma-2-9B: 8 KV heads, 16 query heads) for the cache rows
SHAPES = {**common.SHAPES, "gemma-2-9b": {"H_kv": 8, "H_q": 16, "D": 256}}
CPU = torch.device("cpu")
PROMPT = 300  # prefill tokens: whole quantized blocks plus a full-precision tail for every preset


def _shape_config(shape: dict) -> Any:
    """A one-layer Llama config with ``shape``'s KV heads, query heads and head dim (rope theta 1e6)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape["H_q"] * shape["D"], num_attention_heads=shape["H_q"],
        num_key_value_heads=shape["H_kv"], head_dim=shape["D"], num_hidden_layers=1,
        intermediate_size=64, vocab_size=64, rope_theta=1e6, max_position_embeddings=4096,
    )  # fmt: skip


def cache_store(scheme_name: str, shape: dict, prompt: int = PROMPT) -> tuple[Any, str | None]:
    """``(PackedStore, None)`` of one layer after a prefill of ``prompt`` tokens, or ``(None, why the fused path
    skips it)``."""
    from kvbits.cache import QuantizedKVCache
    from kvbits.cache.fused import layout_reason, packed_store
    from kvbits.kernels.triton_decode import supported
    from kvbits.schemes import get_scheme

    scheme = get_scheme(scheme_name)
    cache = QuantizedKVCache(config=_shape_config(shape), scheme=scheme, fused_decode=True)
    common.install_stand_ins(cache, 1, shape["H_kv"], shape["D"])
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, shape["H_kv"], prompt, shape["D"], generator=gen).half() for _ in range(2))
    cache.update(k, v, 0)
    layer = cache.layers[0]
    reason = layout_reason(layer)
    if reason is None:
        store = packed_store(layer)
        reason = supported(store)
        if reason is None:
            return store, None
    return None, reason


def _row(group: str, name: str, shape: str, launch: dict, kernel: Any, arch: str) -> dict:
    r = resources(kernel)
    lim = LIMITS[arch]
    mix = instruction_mix(kernel)
    blocks = lim.blocks_per_sm(r)
    loop, ops = hot_loop(kernel)
    block_t = r.constants.get("BLOCK_T")
    per_token = round(loop * r.num_warps / block_t, 1) if loop and block_t and r.kernel in DECODE_KERNELS else None
    return {
        "group": group, "name": name, "shape": shape, **launch, "kernel": r.kernel,
        "block_t": block_t, "num_warps": r.num_warps, "num_stages": r.num_stages,
        "registers": r.registers, "shared_bytes": r.shared_bytes, "local_bytes": r.local_bytes,
        "blocks_per_sm": blocks, "warps_per_sm": blocks * r.num_warps, "fails": lim.check(r), **mix,
        "loop_instructions": loop, "warp_instructions_per_token": per_token,
        "loop_int_to_float": ops.get("I2F", 0) + ops.get("I2FP", 0),
        # synchronous global loads in the tile loop (each iteration waits a memory round trip on them) and
        # cp.async copies (prefetched by the software pipeline)
        "loop_sync_loads": ops.get("LDG", 0), "loop_async_loads": ops.get("LDGSTS", 0),
    }  # fmt: skip


def decode_rows(
    group: str,
    name: str,
    shape_name: str,
    store: Any,
    arch: str,
    dtype: torch.dtype = torch.float16,
    **launch: Any,
) -> list[dict]:
    """Rows of the decode kernel for one launch of ``decode_attention_triton`` with ``dtype`` queries (its
    split reduction is compiled too, not listed)."""
    from kvbits.kernels.triton_decode import decode_attention_triton

    shape = SHAPES[shape_name]
    q = torch.randn(store.batch, shape["H_q"], 1, shape["D"], dtype=dtype)
    if dtype != torch.float16:
        name = f"{name} ({str(dtype).removeprefix('torch.')} queries)"
    with compile_only(arch) as compiled:
        decode_attention_triton(q, store, splits=4, **launch)
    path = "gather" if launch.get("vectorized") is False else launch.get("dequant", "default").replace("f32", "default")
    if launch.get("meta32") is False:
        path += " (2-byte scale reads)"
    return [
        _row(group, name, shape_name, {"path": path}, k, arch)
        for k in compiled
        if k.name in DECODE_KERNELS
    ]


def quantize_rows(arch: str, names: list[str]) -> list[dict]:
    from kvbits.kernels.triton_quantize import quantize_pack_triton

    rows = []
    for name in names:
        x, kw = checks.quantize_stand_in(name)
        with compile_only(arch) as compiled:
            quantize_pack_triton(x, checks.QUANTIZE_SPECS[name], **kw)
        rows += [_row("quantize", name, "llama-3-8b", {"path": "default"}, k, arch) for k in compiled]
    return rows


def collect(arch: str, quick: bool) -> dict:
    from kvbits.schemes import list_schemes

    rows: list[dict] = []
    skipped: list[dict] = []
    shapes = list(common.SHAPES) if quick else list(SHAPES)
    presets = ["kivi-4", "kvquant-4-block"] if quick else [s.name for s in list_schemes()]
    for shape_name in shapes:
        for name in presets:
            store, why = cache_store(name, SHAPES[shape_name])
            if store is None:
                skipped.append({"group": "cache", "name": name, "shape": shape_name, "reason": why})
                continue
            paths = ({},) if quick else ({}, {"vectorized": False})
            if any(f16_ok(p, 32, torch.float16) for p in (store.key, store.value)) and (
                not quick or name == "kivi-4"
            ):
                paths += ({"dequant": "f16"},)  # the opt-in float16 dequantization (sides it can read)
            if fold_supported(store) is None and (not quick or name == "kivi-4"):  # (float16 queries)
                paths += ({"dequant": "fold"},)  # the opt-in folded-scale kernel (stores it reads)
            for launch in paths:
                rows += decode_rows("cache", name, shape_name, store, arch, **launch)
            if name in ("kivi-4", "kvquant-4-block"):  # models served in bfloat16 / float32
                for dtype in (torch.float32,) if quick else (torch.bfloat16, torch.float32):
                    rows += decode_rows("cache", name, shape_name, store, arch, dtype)
    if not quick:
        # an odd slot count (a growing cache's every other step): one scale per token row is read as words
        # across slabs that alternately start in a word's middle (_words_ok 2); the default launch and f16
        for shape_name in shapes:
            for name in presets:
                store, _ = cache_store(name, SHAPES[shape_name], PROMPT + 1)
                if store is None or 2 not in (_words_ok(store.key), _words_ok(store.value)):
                    continue
                paths = ({},) + (({"dequant": "f16"},) if any(f16_ok(p, 32, torch.float16)
                                                              for p in (store.key, store.value)) else ())  # fmt: skip
                for launch in paths:
                    rows += decode_rows("cache-odd", name, shape_name, store, arch, **launch)
        gen = torch.Generator().manual_seed(0)
        for shape_name, shp in common.SHAPES.items():
            tables = common.rope_tables(4096, shp["D"], CPU)
            for name, sch in common.SCHEMES.items():
                for rope in (False, True) if name in common.PRE_ROPE else (False,):
                    store = common.random_store(2, shp, 4096, sch, CPU, gen, tables if rope else None)
                    label = name + (common.ROPE_SUFFIX if rope else "")
                    paths = ({}, {"vectorized": False}, {"dequant": "f16"}) if sch[0] == "int" else ({},)
                    if common.fold_reads(sch) and not rope:
                        paths += ({"dequant": "fold"},)
                    for launch in paths:
                        rows += decode_rows("sweep", label, shape_name, store, arch, **launch)
                    if name == "int4":
                        for case, case_rope, dequant in sweep.TUNE_CASES:  # step 3b's cases of this store
                            if case_rope != rope:
                                continue
                            for block_t, warps, stages in sweep.tune_launches(shp["D"], dequant):
                                rows += decode_rows("tune", case, shape_name, store, arch, block_t=block_t,
                                                    num_warps=warps, num_stages=stages,
                                                    **sweep.TUNE_DEQUANT[dequant])  # fmt: skip
    quick_specs = ["int4-token-g32", "nuq3-channel-g128-outl"]  # per-token; NUQ, 3-bit, outliers, per-channel
    rows += quantize_rows(arch, quick_specs if quick else list(checks.QUANTIZE_SPECS))
    return {"rows": rows, "skipped": skipped}


def problems(rows: list[dict]) -> list[str]:
    """Default launches that would fail on the target, and decode kernels (the per-step hot path) that
    spill registers on the default (vectorised) path with float16 / bfloat16 queries. The quantize kernel
    runs once per flushed block, and float32 queries are not how models are served on GPUs (their exact
    products spill at D = 256, ``launch_defaults``): their spills are in the table, not here."""
    out = []
    for r in rows:
        if r["group"] == "tune":
            continue
        where = f"{r['group']} {r['name']} {r['shape']} {r['path']} ({r['kernel']})"
        hot = (
            r["kernel"] == "_decode_kernel"
            and r["path"] in ("default", "f16")
            and "float32 queries" not in r["name"]
        )
        if r["fails"]:
            out.append(f"{where}: {r['fails']}")
        elif hot and r["local_bytes"]:
            out.append(f"{where}: {r['local_bytes']} bytes of registers spilled per thread")
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| group | name | shape | path | block_t/warps/stages | regs | shared KiB | spill B | warps/SM | "
            "global loads 128/64/32/16/8-bit (async) | mma | tile loop: instr (warp-instr/token) | launches |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = "/".join(str(r[k]) if r[k] is not None else "-" for k in ("block_t", "num_warps", "num_stages"))
        lines.append(
            f"| {r['group']} | {r['name']} | {r['shape']} | {r['path']} | {cfg} | {r['registers']} | "
            f"{r['shared_bytes'] / 1024:.0f} | {r['local_bytes']} | {r['warps_per_sm']} | "
            f"{r['loads_128']}/{r['loads_64']}/{r['loads_32']}/{r['loads_16']}/{r['loads_8']} ({r['async_loads']}) | "
            f"{r['mma']} | {r['loop_instructions']} ({r['warp_instructions_per_token'] or '-'}) | "
            f"{'no: ' + r['fails'] if r['fails'] else 'yes'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", choices=sorted(LIMITS))
    p.add_argument("--quick", action="store_true", help="one launch per kind (seconds, not minutes)")
    p.add_argument(
        "--out", type=Path, default=None, help=f"JSON results (default {RESULTS}; none with --quick)"
    )
    args = p.parse_args(argv)
    t0 = time.time()
    result = collect(args.arch, args.quick)
    import triton

    from kvbits.kernels.triton_decode import launch_defaults

    result.update(
        arch=args.arch, limits=LIMITS[args.arch].name, triton=triton.__version__, torch=torch.__version__,
        defaults={D: launch_defaults(D) for D in (64, 128, 256)}, problems=problems(result["rows"]),
        seconds=round(time.time() - t0, 1), created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )  # fmt: skip
    default = RESULTS if args.arch == "sm_90" else RESULTS.with_name(f"kernel_resources_{args.arch}.json")
    out = args.out or (None if args.quick else default)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    print(markdown(result["rows"]))
    for s in result["skipped"]:
        print(f"not served by the fused path: {s['name']} ({s['shape']}): {s['reason']}")
    for msg in result["problems"]:
        print(f"PROBLEM: {msg}")
    print(
        f"{len(result['rows'])} kernels compiled for {args.arch} in {result['seconds']} s"
        + (f" -> {out}" if out else "")
    )
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
