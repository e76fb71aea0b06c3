"""The split merge of the decode kernels on a GPU, before and after session 45: two passes in 16-split chunks
against one pass in 64-split chunks (``triton_decode._reduce_kernel``), at the split counts the default launch
makes.

    PYTHONPATH=src python3 benchmarks/reduce_ab.py --out $OUT/reduce_ab.json     # H200, ~20 s
    PYTHONPATH=src python benchmarks/reduce_ab.py --smoke --device cpu           # Triton's interpreter, seconds

Why: the H200's profile of an end-to-end decode step (BENCHMARKS.md §6z, Qwen2.5-0.5B's shape, batch 1, 32K) put the
merge at 6.1 µs per layer against the decode kernel's 12. Compiled for sm_90, the old merge's two loops issue only
synchronous loads, so it waits on memory once per 16 splits, twice: 18 times at the 130-odd splits of that launch.

For each case (both KV shapes of ``gpu_decode.py`` x batch 1, 8, 32 x 4K, 32K, 128K context) the split count is the
default launch's (``_num_splits`` at 2 programs per SM, ``_chunk`` over the quantized slots and a 128-token fp16 tail)
and the partials are random (scores' maxima ~ N(0, 4) in base 2, a tenth of the splits empty as a padded or short
split leaves them). Each merge is timed as ``gpu_decode.py`` times (``gpu_bench.common.time_ms``: CUDA graph replay,
median), without flushing the L2 cache: the decode kernel has just written the partials. Both outputs are compared
with a float64 merge. Rows go to ``--out`` (``complete``: false until the end).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _provenance
from gpu_bench import common

RESULTS = Path(__file__).resolve().parent / "results" / "reduce_ab.json"
BATCHES, CONTEXTS = (1, 8, 32), (4096, 32768, 131072)


def two_pass_kernel():
    """The merge before session 45 (``_reduce_kernel`` as of 2ba4f4e), compiled here for the comparison."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_split"])
    def _reduce_two_pass(M, L, ACC, OUT, n_split, BLOCK_S: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        m_max = tl.max(tl.full([BLOCK_S], -1.0e30, tl.float32), 0)
        for s0 in range(0, n_split, BLOCK_S):
            offs = s0 + tl.arange(0, BLOCK_S)
            m_max = tl.maximum(m_max, tl.max(tl.load(M + row * n_split + offs, mask=offs < n_split, other=-1.0e30), 0))
        offs_d = tl.arange(0, D)
        num = tl.zeros([D], tl.float32)
        den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        for s0 in range(0, n_split, BLOCK_S):
            offs = s0 + tl.arange(0, BLOCK_S)
            sm = offs < n_split
            m = tl.load(M + row * n_split + offs, mask=sm, other=-1.0e30)
            w = tl.where(sm, tl.exp2(m - m_max), 0.0)
            l_s = tl.load(L + row * n_split + offs, mask=sm, other=0.0)
            a = tl.load(ACC + (row * n_split + offs)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0)
            num += tl.sum(w[:, None] * a, 0)
            den += tl.sum(w * l_s, 0)
        tl.store(OUT + row * D + offs_d, (num / den).to(OUT.dtype.element_ty))

    return _reduce_two_pass


def split_count(shape: dict, batch: int, context: int, programs: int) -> int:
    """The default launch's ``n_split`` for the KIVI store of ``context`` tokens that ``gpu_decode.py`` times
    (``common.random_store``, shapes only) with ``programs`` programs aimed at."""
    from kvbits.kernels.triton_decode import _chunk, _num_splits, whole_row_block_t

    cpu = torch.device("cpu")
    store = common.random_store(batch, shape, context, common.SCHEMES["int4"], cpu, torch.Generator(), lazy=True)
    splits, block_t = _num_splits(store, cpu, programs), whole_row_block_t(shape["D"])
    return _chunk(store.quant_slots_used, splits, block_t)[0] + _chunk(store.key_full.shape[2], splits, block_t)[0]


def partials(rows: int, n_split: int, D: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random ``m, l (rows, n_split)`` and ``acc (rows, n_split, D)`` float32, a tenth of the splits empty."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, n_split, generator=g) * 4
    l_ = torch.rand(rows, n_split, generator=g) * 9 + 1
    acc = torch.randn(rows, n_split, D, generator=g) * l_[..., None]
    empty = torch.rand(rows, n_split, generator=g) < 0.1
    empty[:, 0] = False
    m[empty], l_[empty], acc[empty] = -1.0e30, 0.0, 0.0
    return tuple(x.to(device) for x in (m, l_, acc))


def merged64(m: torch.Tensor, l_: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The float64 merge ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` → ``(rows, D)``."""
    m, l_, acc = m.double(), l_.double(), acc.double()
    w = torch.exp2(m - m.max(1, keepdim=True).values)
    return (w[..., None] * acc).sum(1) / (w * l_).sum(1, keepdim=True)


def run_case(shape_name: str, batch: int, context: int, programs: int, two_pass: Any, cfg: common.Config) -> dict:
    """Both merges of one case's partials, timed, and their errors against the float64 merge."""
    from kvbits.kernels.triton_decode import reduce_splits

    shape, device = common.SHAPES[shape_name], cfg.device
    rows, D = batch * shape["H_q"], shape["D"]
    n_split = split_count(shape, batch, context, programs)
    m, l_, acc = partials(rows, n_split, D, device)
    ref = merged64(m, l_, acc)
    out_old = torch.empty(rows, D, device=device, dtype=torch.float16)
    out_new = torch.empty_like(out_old)

    def old() -> None:
        two_pass[(rows,)](m, l_, acc, out_old, n_split, BLOCK_S=16, D=D, num_warps=4)

    def new() -> None:
        reduce_splits(m, l_, acc, out_new)

    ms_old, _ = common.time_ms(old, cfg, None)
    ms_new, _ = common.time_ms(new, cfg, None)
    return {"shape": shape_name, "batch": batch, "context": context, "rows": rows, "n_split": n_split,
            "ms_two_pass": round(ms_old, 5), "ms_one_pass": round(ms_new, 5),
            "speedup": round(ms_old / ms_new, 3) if ms_new > 0 else None,
            "max_err_two_pass": float((out_old.double() - ref).abs().max()),
            "max_err_one_pass": float((out_new.double() - ref).abs().max()),
            "outputs_equal": bool(torch.equal(out_old, out_new))}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton's interpreter)")
    p.add_argument("--smoke", action="store_true", help="two small cases: checks that the script runs")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()
    from kvbits.kernels.triton_decode import REDUCE_BLOCK_S

    two_pass = two_pass_kernel()
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 264
    cfg = common.Config(device=device, contexts=[], batches=[], reps=3 if args.smoke else 50,
                        warmup=1 if args.smoke else 5, max_bytes=0, smoke=args.smoke, kernel="triton")  # fmt: skip
    cases = [(s, b, t) for s in common.SHAPES for b in BATCHES for t in CONTEXTS]
    if args.smoke:
        cases = [("qwen2.5-0.5b", 1, 32768), ("llama-3-8b", 8, 4096)]
    result: dict[str, Any] = {
        "script": "benchmarks/reduce_ab.py", "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%d"), "commit": _provenance.commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else _provenance.host(),
        "torch": torch.__version__, "programs": programs, "block_s": {"two_pass": 16, "one_pass": REDUCE_BLOCK_S},
        "rows": [], "complete": False,
    }  # fmt: skip

    def save() -> None:
        _provenance.write_json(args.out, result)  # atomic: a run cut by its timeout keeps the last complete file

    for shape_name, batch, context in cases:
        row = run_case(shape_name, batch, context, programs, two_pass, cfg)
        result["rows"].append(row)
        save()
        print(f"{shape_name:14s} B={batch:<3d} T={context:<7d} splits {row['n_split']:4d}: two passes "
              f"{row['ms_two_pass'] * 1e3:7.2f} us, one pass {row['ms_one_pass'] * 1e3:7.2f} us ({row['speedup']}x); "
              f"max error vs float64 {row['max_err_two_pass']:.2e} / {row['max_err_one_pass']:.2e}")  # fmt: skip
    result["complete"] = True
    save()
    return result


if __name__ == "__main__":
    main()
