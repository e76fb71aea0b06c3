"""Steps 3-5: one decode step of fp16 SDPA and of the fused kernel per scheme over contexts and batches
(bandwidth as a fraction of the copy ceiling), the kernel's launch parameters (3b), and the break-even
context per scheme."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvbits.evaluate.sdpa import sdpa_backends

from .common import (
    PRE_ROPE,
    ROPE_SUFFIX,
    SCHEMES,
    SHAPES,
    TOKEN_SCHEMES,
    Config,
    fold_reads,
    launch_error,
    out_of_time,
    random_store,
    rope_tables,
    rotation_batch,
    time_ms,
)

TUNE_BATCH, TUNE_CONTEXT = 8, 32768  # step 3b
ROUNDED_KEYS = "int4-token"  # the per-token layout also timed with its keys rounded (row_keys=False)


def _record(
    kernel: str,
    scheme: str,
    shape: str,
    context: int,
    batch: int,
    ms: float,
    graph: bool,
    nbytes: int,
    spread: dict,
    fp16_ms: float,
    copy_gbps: float | None,
) -> dict:
    """One result row; ``(ms, graph, nbytes, spread)`` in the order the timing helpers return them;
    ``frac_of_copy`` is ``None`` without a copy bandwidth (step 1 failed)."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": kernel, "scheme": scheme, "shape": shape, "context": context, "batch": batch, "ms": round(ms, 5),
        **spread, "gbps": round(gbps, 1), "frac_of_copy": frac_of_copy(gbps, copy_gbps), "bytes_read": nbytes,
        "speedup_vs_fp16": round(fp16_ms / ms, 3), "fp16_ms": round(fp16_ms, 5), "cuda_graph": graph,
    }  # fmt: skip


def frac_of_copy(gbps: float, copy_gbps: float | None) -> float | None:
    """``gbps`` as a fraction of the copy bandwidth (3 decimals), ``None`` without one (step 1 failed)."""
    return None if not copy_gbps else round(gbps / copy_gbps, 3)


def fp16_baselines(
    cfg: Config, q: torch.Tensor, H_kv: int, context: int, gen: torch.Generator, flush: torch.Tensor | None
) -> dict[str, tuple[float, bool, int, dict]]:
    """SDPA over fp16 K/V: ``enable_gqa=True`` with the backend torch picks (``sdpa-gqa``) and with cuDNN's left out
    (``sdpa-gqa-no-cudnn``: §6z's profile found cuDNN serving SDPA's decode steps on the H200; the faster of the
    two is the baseline), and K/V expanded to ``H_q`` heads when memory allows.

    Returns ``{name: (ms, cuda_graph, bytes_read, spread)}``; the expansion itself is not timed.
    """
    B, H_q, _, D = q.shape
    G = H_q // H_kv
    k = torch.randn(B, H_kv, context, D, device=cfg.device, dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    kv_bytes = k.nbytes + v.nbytes
    out = {}
    spread: dict = {}
    ms, graph = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), cfg, flush, spread=spread)
    out["sdpa-gqa"] = (ms, graph, kv_bytes, spread)
    spread = {}
    with sdpa_backends("no-cudnn"):  # the graph captures the backend chosen here; its replays need no flag
        ms, graph = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), cfg, flush,
                            spread=spread)  # fmt: skip
    out["sdpa-gqa-no-cudnn"] = (ms, graph, kv_bytes, spread)
    if kv_bytes * (G + 1) <= cfg.max_bytes:
        ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        spread = {}
        ms, graph = time_ms(lambda: F.scaled_dot_product_attention(q, ke, ve), cfg, flush, spread=spread)
        out["sdpa-expand"] = (ms, graph, kv_bytes * G, spread)
    return out


def fused_timing(
    cfg: Config,
    decode: Callable,
    q: torch.Tensor,
    shape: dict,
    context: int,
    scheme: tuple[str, int, float] | None,
    kw: dict,
    gen: torch.Generator,
    flush: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_kw: dict | None = None,
) -> tuple[float, bool, int, dict]:
    """(ms, cuda_graph, bytes_read, spread) of the fused path over a random KIVI-layout store (pre-RoPE keys
    with ``tables``; bytes read count K/V, metadata and, for pre-RoPE keys, the RoPE tables: ``read_bytes``).
    ``store_kw``: ``random_store``'s ``layout`` / ``rotate`` / ``channels`` (``TOKEN_SCHEMES``); a rotated store's
    time includes rotating q and the tail into the codes' basis and the output back (``decode`` does it),
    and its bytes are the same as unrotated (``R`` is rebuilt per process, stored nowhere)."""
    store = random_store(q.shape[0], shape, context, scheme, cfg.device, gen, tables, **(store_kw or {}))
    spread: dict = {}
    kw = launch_kwargs(kw, cfg.device)
    ms, graph = time_ms(lambda: decode(q, store, **kw), cfg, flush, spread=spread)
    return ms, graph, read_bytes(store, tables), spread


def read_bytes(store, tables: tuple[torch.Tensor, torch.Tensor] | None) -> int:
    """Bytes one decode step reads: the store's K/V and metadata (``PackedStore.nbytes``: codes, scales, zero-points,
    codebooks, outliers, the fp16 tail) and, for pre-RoPE keys, the rows of the float32 RoPE tables the quantized
    keys' positions reach (``random_store``'s first quantized slot sits at position 0: rows ``[0, T_q)``; the fp16
    tail is post-RoPE and reads none). The tables are shared by every sequence and head, but at batch 1 of Qwen2.5's
    shape they are larger than an int4 store at 32K (8.4 MB against 5.3 MB): left out, GB/s and the fraction of the
    copy bandwidth read 2.6x low there; counted for every position of the context, 2.2 % high at 4K (int2)."""
    if tables is None or not store.pre_rope:
        return store.nbytes
    rows = store.quant_slots_used
    return store.nbytes + sum(min(rows, t.shape[0]) * t[0].nbytes for t in tables)


# step 3's split counts (``split_sweep``): int4 at this many programs per SM, beside the default's 2 (kernels "triton-p8" and
# "triton-fold-p8"); §6z's step 3b timed 8 programs per SM 1.13x (Llama-3-8B's shape) and 1.35x (Qwen2.5's) faster
# than the default at 32K and batch 8, its only point: every cell of the sweep says where the default should change
SPLIT_PROGRAMS_PER_SM = 8
SPLIT_SCHEME = "int4"
SPLIT_PATHS = ({}, {"dequant": "fold"})  # the default kernel and the folded one
KERNEL_MARKS = {"gather": "(g)", "f16": "(h)", "fold": "(f)", "rounded-keys": "(r)"}  # the progress line's marks


def variant_kernel(kernel: str, kw: dict) -> str:
    """The ``kernel`` of a sweep record: ``kernel`` for the default launch, ``-gather`` for the per-element
    path (``vectorized=False``), ``-f16`` for float16 dequantization (``dequant="f16"``), ``-fold`` for the
    folded-scale kernel (``dequant="fold"``), ``-rounded-keys`` for per-token keys dequantized and rounded to
    float16 instead of entering the dots as codes (``row_keys=False``); then ``-p<N>`` for a launch that aims at
    ``N`` programs per SM (``programs_per_sm``, see ``launch_kwargs``) instead of the default 2."""
    if kw.get("vectorized") is False:
        name = kernel + "-gather"
    elif kw.get("row_keys") is False:
        name = kernel + "-rounded-keys"
    else:
        name = kernel + {"f16": "-f16", "fold": "-fold"}.get(kw.get("dequant", ""), "")
    return name if kw.get("programs_per_sm") is None else f"{name}-p{kw['programs_per_sm']}"


def launch_kwargs(kw: dict, device: torch.device) -> dict:
    """A variant's keyword arguments for ``decode``: ``programs_per_sm`` becomes ``target_programs``, that many
    programs per SM of ``device`` (per program elsewhere, as step 3b counts them: 1 SM off CUDA)."""
    kw = dict(kw)
    per_sm = kw.pop("programs_per_sm", None)
    if per_sm is not None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        kw["target_programs"] = per_sm * sms
    return kw


def variant_row(
    cfg: Config, decode: Callable, q: torch.Tensor, shape_name: str, shape: dict, context: int, batch: int,
    gen: torch.Generator, flush: torch.Tensor | None, fp16_ms: float, copy_gbps: float | None, scheme: str,
    sch: tuple[str, int, float] | None, kw: dict, tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_kw: dict | None = None,
) -> dict:  # fmt: skip
    """One fused variant of one sweep cell (``fused_timing``) as a record against ``fp16_ms``, or, for a launch that
    did not start (e.g. ``OutOfResources``), a row with its ``error``: a result for this variant only."""
    kernel = variant_kernel(cfg.kernel, kw)
    try:
        m = fused_timing(cfg, decode, q, shape, context, sch, kw, gen, flush, tables, store_kw)
    except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses is a result, not the end of the run
        return {"kernel": kernel, "scheme": scheme, "shape": shape_name, "context": context, "batch": batch,
                "error": launch_error(exc)}  # fmt: skip
    return _record(kernel, scheme, shape_name, context, batch, *m, fp16_ms, copy_gbps)


def _timing(r: dict) -> str:
    """A row's time and speed-up on the progress line, or that it did not launch."""
    return f"{r['ms']:.4f} ms x{r['speedup_vs_fp16']:.2f}" if "ms" in r else "did not launch"


def _fp16_kv_bytes(shp: dict, batch: int, context: int) -> int:
    """The fp16 K and V of one (shape, batch, context) cell, against ``cfg.max_bytes``."""
    return 2 * batch * shp["H_kv"] * context * shp["D"] * 2


def sweep_contexts(cfg: Config) -> dict[tuple[str, int], list[int]]:
    """Per (shape, batch): the contexts ``sweep`` means to time, ``cfg.contexts`` within the memory budget
    (``--max-gb``; above it a cell is outside the sweep, not missing from it). For ``break_even``: a context here
    without a row for a key (its fp16 baseline failed, the time budget cut it) was not measured."""
    return {
        (shape_name, batch): [c for c in cfg.contexts if _fp16_kv_bytes(shp, batch, c) <= cfg.max_bytes]
        for batch in cfg.batches
        for shape_name, shp in SHAPES.items()
    }


def sweep(
    cfg: Config,
    decode: Callable,
    copy_gbps: float | None,
    progress: Callable[[list[dict]], None] | None = None,
    skipped: list[dict] | None = None,
) -> list[dict]:
    """Step (3)-(4): every (shape, batch, context) within the memory budget, batch by batch (the
    largest batch last); ``progress(records)`` after each combo. Combos not run (memory budget, or
    past ``cfg.deadline``) are appended to ``skipped`` with the reason.

    Two passes, so that the time budget never cuts the cells issue 5 asks for short: first fp16 SDPA and the fused
    kernel's default launch at every cell (the integer/NUQ/FP8 schemes, and pre-RoPE keys: ``PRIMARY``), then, while
    the budget lasts, the other kernel paths at the same cells (Triton's gathered unpacking, float16 dequantization,
    the folded-scale kernel) and the per-token layouts (``TOKEN_SCHEMES``: plain, Hadamard-rotated, centred /
    smoothed keys) at one batch (``rotation_batch``: 8, smoke 1). A cell the second pass does not reach is listed in
    ``skipped`` with ``"pass": "other kernel paths"``."""
    skipped = [] if skipped is None else skipped
    dev = cfg.device
    gen = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    records: list[dict] = []
    # (scheme, SCHEMES value, decode kwargs, pre-RoPE keys, random_store kwargs)
    primary = [("fp16", None, {}, False, {})] + [(name, sch, {}, False, {}) for name, sch in SCHEMES.items()]
    primary += [(name + ROPE_SUFFIX, SCHEMES[name], {}, True, {}) for name in PRE_ROPE]
    others = []
    if cfg.kernel == "triton":  # both unpacking paths for the integer codes: whole rows (default), gathers
        others += [(name, sch, {"vectorized": False}, False, {}) for name, sch in SCHEMES.items() if sch[0] == "int"]
        others += [(name + ROPE_SUFFIX, SCHEMES[name], {"vectorized": False}, True, {}) for name in PRE_ROPE]
        # and the integer codes dequantized in float16 (``dequant="f16"``; kernel "triton-f16")
        others += [(name, sch, {"dequant": "f16"}, False, {}) for name, sch in SCHEMES.items() if sch[0] == "int"]
        # and the folded-scale kernel (``dequant="fold"``, kvbits.kernels.triton_fold; kernel "triton-fold")
        others += [(name, sch, {"dequant": "fold"}, False, {}) for name, sch in SCHEMES.items() if fold_reads(sch)]
    # per-token keys and values: plain, Hadamard-rotated, keys centred / smoothed (post- and pre-RoPE), default
    # launch: at one batch only
    token_variants = [(name, SCHEMES[ts.codes], {}, ts.pre_rope,
                       {"layout": "token", "rotate": ts.rotate, "channels": ts.channels})
                      for name, ts in TOKEN_SCHEMES.items()]  # fmt: skip
    if cfg.kernel == "triton":  # the folded-scale kernel on the per-token layouts it reads (not pre-RoPE)
        token_variants += [(name, SCHEMES[ts.codes], {"dequant": "fold"}, False,
                            {"layout": "token", "rotate": ts.rotate, "channels": ts.channels})
                           for name, ts in TOKEN_SCHEMES.items() if not ts.pre_rope]  # fmt: skip
        # and per-token INT4 keys dequantized and rounded to float16 (the kernel before K_ROWS): what K_ROWS costs
        ts = TOKEN_SCHEMES[ROUNDED_KEYS]
        token_variants.append((ROUNDED_KEYS, SCHEMES[ts.codes], {"row_keys": False}, False,
                               {"layout": "token", "rotate": ts.rotate, "channels": ts.channels}))  # fmt: skip
    token_batch = rotation_batch(cfg.batches)
    cells: list[tuple[str, int, int, float]] = []  # (shape, batch, context, fastest fp16 ms) the first pass timed

    def run_cell(
        shape_name: str, batch: int, context: int, best: float, variants: list, base: dict, q: torch.Tensor | None
    ) -> None:
        shp = SHAPES[shape_name]
        if q is None:
            q = torch.randn(batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen)
        row = [_record(name, "fp16", shape_name, context, batch, *m, best, copy_gbps) for name, m in base.items()]
        tables = rope_tables(context, shp["D"], dev)
        cell = (cfg, decode, q, shape_name, shp, context, batch, gen, flush, best, copy_gbps)
        row += [variant_row(*cell, scheme, sch, kw, tables if rope else None, store_kw)
                for scheme, sch, kw, rope, store_kw in variants]  # fmt: skip
        records.extend(row)
        shown = [
            f"{r['scheme']}{KERNEL_MARKS.get(r['kernel'].partition('-')[2], '')} {_timing(r)}"
            for r in row
            if not r["kernel"].startswith("sdpa")
        ]
        print(f"  {shape_name:13s} B={batch:<3d} T={context:<7d} fp16 {best:8.4f} ms | " + " | ".join(shown))
        del tables
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(records)

    for batch in cfg.batches:
        for shape_name, shp in SHAPES.items():
            for context in cfg.contexts:
                if out_of_time(cfg):
                    skipped.append({"shape": shape_name, "context": context, "batch": batch,
                                    "reason": "time budget (--budget-s)"})  # fmt: skip
                    print(f"  skip {shape_name} B={batch} T={context}: time budget")
                    continue
                kv_bytes = _fp16_kv_bytes(shp, batch, context)
                if kv_bytes > cfg.max_bytes:
                    skipped.append({"shape": shape_name, "context": context, "batch": batch,
                                    "reason": f"fp16 K/V {kv_bytes / 1e9:.1f} GB > --max-gb"})  # fmt: skip
                    print(
                        f"  skip {shape_name} B={batch} T={context}: "
                        f"fp16 K/V {kv_bytes / 1e9:.1f} GB > --max-gb"
                    )
                    continue
                q = torch.randn(
                    batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen
                )
                try:
                    base = fp16_baselines(cfg, q, shp["H_kv"], context, gen, flush)
                except Exception as exc:  # noqa: BLE001 - no baseline, no speed-up: the cell is skipped, the sweep goes on
                    skipped.append({"shape": shape_name, "context": context, "batch": batch,
                                    "reason": f"fp16 baseline failed: {launch_error(exc)}"})  # fmt: skip
                    print(f"  skip {shape_name} B={batch} T={context}: fp16 baseline failed: {launch_error(exc)}")
                    continue
                best = min(m[0] for m in base.values())
                cells.append((shape_name, batch, context, best))
                run_cell(shape_name, batch, context, best, primary, base, q)
    for shape_name, batch, context, best in cells:  # the second pass, in the first one's order
        variants = others + (token_variants if batch == token_batch else [])
        if not variants:
            continue
        if out_of_time(cfg):
            skipped.append({"shape": shape_name, "context": context, "batch": batch, "pass": "other kernel paths",
                            "reason": "time budget (--budget-s)"})  # fmt: skip
            print(f"  skip the other kernel paths at {shape_name} B={batch} T={context}: time budget")
            continue
        run_cell(shape_name, batch, context, best, variants, {}, None)
    return records


def split_sweep(
    cfg: Config, decode: Callable, copy_gbps: float | None, records: list[dict],
    progress: Callable[[list[dict]], None] | None = None,
) -> list[dict]:  # fmt: skip
    """Step (3)'s split counts, Triton only, after the sweep and while its time lasts: ``SPLIT_SCHEME`` at
    ``SPLIT_PROGRAMS_PER_SM`` programs per SM through the default and the folded kernel (``SPLIT_PATHS``; kernels ``triton-p8`` and
    ``triton-fold-p8``, as ``variant_kernel`` names them), at every (shape, batch, context) of ``records`` in the
    sweep's order, against the fastest fp16 SDPA the sweep timed there. Rows as the sweep's (``error`` for a launch
    that did not start); ``progress(rows)`` after each cell. Apart from the sweep, so that these rows never cut its
    own cells short. Split counts are not specialised (``do_not_specialize``): the sweep's kernels serve them."""
    if cfg.kernel != "triton":
        return []
    fp16: dict[tuple[str, int, int], float] = {}  # (shape, batch, context) -> the fastest fp16 SDPA
    for r in records:
        if r["kernel"].startswith("sdpa") and "ms" in r:
            cell = (r["shape"], r["batch"], r["context"])
            fp16[cell] = min(fp16.get(cell, float("inf")), r["ms"])
    dev = cfg.device
    gen = torch.Generator(device=dev).manual_seed(2)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    rows: list[dict] = []
    for (shape_name, batch, context), fp16_ms in fp16.items():  # dicts keep the sweep's order
        if out_of_time(cfg):
            print(f"  split counts: stopped before {shape_name} B={batch} T={context}: time budget")
            break
        shp = SHAPES[shape_name]
        q = torch.randn(batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen)
        cell = (cfg, decode, q, shape_name, shp, context, batch, gen, flush, fp16_ms, copy_gbps)
        new = [variant_row(*cell, SPLIT_SCHEME, SCHEMES[SPLIT_SCHEME], {**path, "programs_per_sm": SPLIT_PROGRAMS_PER_SM})
               for path in SPLIT_PATHS]  # fmt: skip
        rows += new
        print(f"  {shape_name:13s} B={batch:<3d} T={context:<7d} {SPLIT_SCHEME}: "
              + " | ".join(f"{r['kernel']} {_timing(r)}" for r in new))  # fmt: skip
        del q
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(rows)
    return rows


TUNE_BLOCK_T = (32, 64, 128)  # tokens per inner tile (decode_attention_triton's block_t)
TUNE_WARPS = (4, 8)  # num_warps
TUNE_STAGES = (1, 2, 3)  # num_stages: software-pipelining depth of the tile loop
TUNE_PROGRAMS_PER_SM = (8, 32)  # split counts beyond the default 2 programs per SM (decode's target_programs)


def _nearest_first(default: tuple, block_ts: tuple[int, ...], warps: tuple[int, ...],
                   stages: tuple[int, ...]) -> list[tuple]:  # fmt: skip
    """The launches ``block_ts`` x ``warps`` x ``stages`` but ``default``, by how many of the three parameters differ
    from it (a run cut short keeps the nearest)."""
    grid = [(b, w, s) for b in block_ts for w in warps for s in stages if (b, w, s) != default]
    return sorted(grid, key=lambda c: sum(x != y for x, y in zip(c, default, strict=True)))


def _default_then_nearest(D: int, warps: tuple[int, ...], stages: tuple[int, ...]) -> tuple[tuple, list[tuple]]:
    """The default launch ``(block_t, num_warps, num_stages)`` at head dim ``D`` (``launch_defaults``) and the
    other launches of ``TUNE_BLOCK_T`` x ``warps`` x ``stages``, nearest first (``_nearest_first``)."""
    from kvbits.kernels.triton_decode import launch_defaults

    d = launch_defaults(D)
    default = (d["block_t"], d["num_warps"], d["num_stages"])
    return default, _nearest_first(default, TUNE_BLOCK_T, warps, stages)


def _with_split_counts(default: tuple, grid: list[tuple]) -> list[tuple[int, int, int, int | None]]:
    """The default launch (``None``: the default split count, 2 programs per SM), the default at the other split
    counts (``TUNE_PROGRAMS_PER_SM``), then ``grid`` at the default split count."""
    return [(*default, None)] + [(*default, p) for p in TUNE_PROGRAMS_PER_SM] + [(*c, None) for c in grid]


def tune_grid(D: int) -> list[tuple[int, int, int, int | None]]:
    """``(block_t, num_warps, num_stages, programs_per_sm)`` to time at head dim ``D``: the default launch
    first (``None``: the default split count, 2 programs per SM), then the default with other split counts
    (``TUNE_PROGRAMS_PER_SM``: on the H200 the kernel was bound by its per-tile cost, not bandwidth), then
    ``TUNE_BLOCK_T`` x ``TUNE_WARPS`` x ``TUNE_STAGES`` nearest first (``_default_then_nearest``)."""
    return _with_split_counts(*_default_then_nearest(D, TUNE_WARPS, TUNE_STAGES))


TUNE_F16_WARPS = (2, 4)  # dequant="f16": block_t x num_warps x num_stages (2 warps: fewer cross-warp steps)
TUNE_F16_STAGES = (2, 3)
TUNE_R128_LAUNCHES = 3  # "f16-r128" (128-register cap): the first launches of the f16 grid only


def tune_grid_f16(D: int) -> list[tuple[int, int, int, int | None]]:
    """``tune_grid``'s rows for ``dequant="f16"`` at head dim ``D``: the default launch first, then
    ``TUNE_BLOCK_T`` x ``TUNE_F16_WARPS`` x ``TUNE_F16_STAGES``, nearest first; the default split count only.
    Compiled for sm_90, 2-warp launches issue 10-20 % fewer instructions per token (fewer cross-warp
    reductions) at half the resident warps (BENCHMARKS.md §6, session 10)."""
    default, grid = _default_then_nearest(D, TUNE_F16_WARPS, TUNE_F16_STAGES)
    return [(*c, None) for c in [default, *grid]]


# step 3b's dequantization settings: the decode keyword arguments of each. "f16-r128" caps registers at 128
# per thread: at Llama-3-8B's shape the f16 path takes 160 (3 blocks per SM) where the default takes 128 (4).
# "f32-halves" is session 9's code (2-byte scale reads, synchronous in the tile loop) beside today's default
# (int32 words that cp.async prefetches, meta32), at the default launch and the 64-token tile session 9 found fastest
TUNE_DEQUANT = {"f32": {}, "f16": {"dequant": "f16"}, "f16-r128": {"dequant": "f16", "maxnreg": 128},
                "f32-halves": {"meta32": False}, "fold": {"dequant": "fold"}}  # fmt: skip
TUNE_FOLD_BLOCK_T = (64, 128, 256)  # the folded kernel's grid: its default launch (triton_fold.fold_defaults) first
TUNE_FOLD_WARPS = (2, 4)
TUNE_FOLD_STAGES = (2, 3)
TUNE_HALVES_LAUNCHES = 2  # "f32-halves": the first launches of the f32 grid's block_t axis


def tune_grid_fold(D: int) -> list[tuple[int, int, int, int | None]]:
    """The folded kernel's rows (int4 codes): its default launch, the default with ``TUNE_PROGRAMS_PER_SM``, then
    ``TUNE_FOLD_BLOCK_T`` x ``TUNE_FOLD_WARPS`` x ``TUNE_FOLD_STAGES``, nearest first."""
    from kvbits.kernels.triton_fold import fold_defaults

    d = fold_defaults(D, 4, 4, 1)
    default = (d["block_t"], d["num_warps"], d["num_stages"])
    return _with_split_counts(default, _nearest_first(default, TUNE_FOLD_BLOCK_T, TUNE_FOLD_WARPS, TUNE_FOLD_STAGES))


def tune_grid_for(D: int, dequant: str) -> list[tuple[int, int, int, int | None]]:
    """Step 3b's grid of one ``TUNE_DEQUANT`` setting at head dim ``D``."""
    if dequant == "fold":
        return tune_grid_fold(D)
    if dequant == "f32":
        return tune_grid(D)
    if dequant == "f32-halves":  # the default launch, then the default with 64-token tiles
        (default, *_), launches = tune_grid(D), _default_then_nearest(D, TUNE_WARPS, TUNE_STAGES)[1]
        tiles = [c for c in launches if c[1:] == default[1:3] and c[0] == 64]
        return [default, *[(*c, None) for c in tiles]][:TUNE_HALVES_LAUNCHES]
    grid = tune_grid_f16(D)
    return grid[:TUNE_R128_LAUNCHES] if dequant == "f16-r128" else grid


def tune_launches(D: int, dequant: str = "f32") -> list[tuple[int, int, int]]:
    """The distinct compiled launches of ``tune_grid_for(D, dequant)`` (split counts compile nothing new), in
    its order."""
    return list(dict.fromkeys(c[:3] for c in tune_grid_for(D, dequant)))


TUNE_CASES = (  # step 3b's cases per shape: (scheme, pre-RoPE keys, TUNE_DEQUANT key); the int4 codes of SCHEMES
    ("int4", False, "f32"),
    ("int4" + ROPE_SUFFIX, True, "f32"),
    ("int4-f16", False, "f16"),
    ("int4-f16-r128", False, "f16-r128"),
    ("int4-halves", False, "f32-halves"),
    ("int4-fold", False, "fold"),
)


def tune(cfg: Config, decode: Callable, copy_gbps: float | None, progress: Callable[[list[dict]], None] | None = None
         ) -> list[dict]:  # fmt: skip
    """Step (3b), Triton only, while the sweep's time lasts: ``block_t`` x ``num_warps`` x ``num_stages``
    (``tune_grid``) for int4 and int4-prerope, and ``block_t`` x ``num_warps`` x ``num_stages``
    (``tune_grid_f16``) for int4 dequantized in float16 (``int4-f16``; ``int4-f16-r128`` at its nearest
    launches with 128 registers at most), at 32K (smoke: 512), batch 8 (smoke: 1), both shapes
    (``TUNE_CASES``, ``TUNE_DEQUANT``), round robin so that a run cut short has the nearest neighbours of every
    default. Rows: shape, batch, context, scheme, dequant, block_t, num_warps, num_stages, programs_per_sm,
    max_diff_vs_default (the largest gap from the default launch's output on the same inputs, computed once
    per case: the default float32-dequantizing launch, for the f16 rows too), ms (median; ``ms_p10``/``ms_p90``), gbps,
    frac_of_copy (``error`` instead for a launch that did not start)."""
    if cfg.kernel != "triton":
        return []
    dev = cfg.device
    gen = torch.Generator(device=dev).manual_seed(1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    batch, context = (1, 512) if cfg.smoke else (TUNE_BATCH, TUNE_CONTEXT)
    cases = []  # (shape, scheme, dequant, q, store, grid, bytes read)
    for shape_name, shp in SHAPES.items():
        q = torch.randn(batch, shp["H_q"], 1, shp["D"], device=dev, dtype=torch.float16, generator=gen)
        tables = rope_tables(context, shp["D"], dev)
        for scheme, rope, dequant in TUNE_CASES:
            store = random_store(batch, shp, context, SCHEMES["int4"], dev, gen, tables if rope else None)
            grid = tune_grid_for(shp["D"], dequant)
            cases.append((shape_name, scheme, dequant, q, store, grid[:2] if cfg.smoke else grid,
                          read_bytes(store, tables if rope else None)))  # fmt: skip
    rows: list[dict] = []
    defaults: dict[int, torch.Tensor] = {}  # case index -> the default launch's output (one launch per case)
    for i in range(max(len(c[5]) for c in cases)):
        for j, (shape_name, scheme, dequant, q, store, grid, nbytes) in enumerate(cases):
            if i >= len(grid):
                continue
            if out_of_time(cfg):
                return rows
            block_t, warps, stages, per_sm = grid[i]
            row = {"shape": shape_name, "batch": batch, "context": context, "scheme": scheme, "dequant": dequant,
                   "block_t": block_t, "num_warps": warps, "num_stages": stages, "programs_per_sm": per_sm}  # fmt: skip
            launch = launch_kwargs({"block_t": block_t, "num_warps": warps, "num_stages": stages,
                                    **TUNE_DEQUANT[dequant], "programs_per_sm": per_sm}, dev)  # fmt: skip
            run = lambda q=q, st=store, kw=launch: decode(q, st, **kw)
            spread: dict = {}
            try:
                # every launch's output against the default launch's (which step 2 checked against float64):
                # a launch that computes something else (the 16-token miscompile of the first H200 run) shows
                if j not in defaults:
                    defaults[j] = decode(q, store).float()
                row["max_diff_vs_default"] = float((run().float() - defaults[j]).abs().max())
                ms, _ = time_ms(run, cfg, flush, spread=spread)
            except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses is a result, not the end of the run
                row["error"] = launch_error(exc)
                print(f"  tune {shape_name:13s} {scheme:13s} {block_t}/{warps}/{stages}: {row['error']}")
            else:
                gbps = nbytes / (ms * 1e-3) / 1e9
                frac = frac_of_copy(gbps, copy_gbps)
                row.update(ms=round(ms, 5), **spread, gbps=round(gbps, 1), frac_of_copy=frac)
                print(f"  tune {shape_name:13s} {scheme:13s} block_t={block_t:<4d} warps={warps} stages={stages}: "
                      f"{ms:.4f} ms ({'?' if frac is None else f'{100 * frac:.0f}'}% of copy)")  # fmt: skip
            rows.append(row)
            if progress is not None:
                progress(rows)
    return rows


def _beats_fp16(r: dict) -> bool:
    """Whether a timed row is at least as fast as its cell's fp16 SDPA, from the times themselves: the 3-decimal
    ``speedup_vs_fp16`` reads 1.0 for a row up to 0.05 % slower. Records from before ``fp16_ms`` use the ratio."""
    if "fp16_ms" in r:
        return r["ms"] <= r["fp16_ms"]
    return r["speedup_vs_fp16"] >= 1


def break_even(records: list[dict], contexts: dict[tuple[str, int], list[int]] | None = None) -> list[dict]:
    """Per (shape, batch, kernel, scheme) with a timed row: the shortest context from which every longer one beats
    fp16 (``break_even_context``; ``None`` when the longest measured one does not: the table's "> max measured").

    A launch that did not start (a row with ``error``, no ``ms``; its contexts under ``not_launched``) has no time,
    nor has a context of ``contexts[(shape, batch)]`` (``sweep_contexts``: the sweep's intended contexts) with no
    row for the key at all (its fp16 baseline failed, the time budget cut it; under ``not_run``): a break-even
    that would span one (above the longest measured context that loses to fp16, or above every context when none
    loses) is unknown: ``break_even_context`` ``None`` and ``break_even_measured`` ``False`` (before, such rows
    were dropped and the break-even was read across them). Without ``contexts`` (the records alone) ``not_run`` is
    empty: only the contexts with a row are seen."""
    out = []
    failed = [r for r in records if "ms" not in r]  # launches that did not start have no time
    everything = records
    records = [r for r in records if "ms" in r]
    keys = sorted(
        {
            (r["shape"], r["batch"], r["kernel"], r["scheme"])
            for r in records
            if not r["kernel"].startswith("sdpa")
        }
    )
    for shape, batch, kernel, scheme in keys:
        rows = sorted(
            (
                r
                for r in records
                if (r["shape"], r["batch"], r["kernel"], r["scheme"]) == (shape, batch, kernel, scheme)
            ),
            key=lambda r: r["context"],
        )
        be = None
        for i, r in enumerate(rows):
            if all(_beats_fp16(x) for x in rows[i:]):
                be = r["context"]
                break
        not_launched = sorted({
            r["context"] for r in failed if (r["shape"], r["batch"], r["kernel"], r["scheme"]) == (shape, batch, kernel, scheme)
        })  # fmt: skip
        seen = {
            r["context"] for r in everything if (r["shape"], r["batch"], r["kernel"], r["scheme"]) == (shape, batch, kernel, scheme)
        }  # fmt: skip
        not_run = sorted(set((contexts or {}).get((shape, batch), ())) - seen)
        losing = [r["context"] for r in rows if not _beats_fp16(r)]
        spanned = [c for c in not_launched + not_run if not losing or c > max(losing)]
        measured = be is None or not spanned  # no break-even ("> max measured") stays true across a gap above
        out.append(
            {
                "shape": shape,
                "batch": batch,
                "kernel": kernel,
                "scheme": scheme,
                "break_even_context": be if measured else None,
                "break_even_measured": measured,
                "max_context_measured": rows[-1]["context"] if rows else None,
                "not_launched": not_launched,
                "not_run": not_run,
            }
        )
    return out
