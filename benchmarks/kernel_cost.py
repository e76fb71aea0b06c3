"""The decode kernel's issue cost per token, compiled for sm_90 here, beside the H200's measured times.

    PYTHONPATH=src python benchmarks/kernel_cost.py                 # both tables (markdown), ~2 min
    PYTHONPATH=src python benchmarks/kernel_cost.py --json out.json

Table 1 sets the tile loop's instructions (``kvbits.kernels.aot.hot_loop``: per warp and tile, so
``instructions x warps / block_t`` warp-instructions per token and KV head, at most 4 issued per cycle on an
SM) beside the cycles per token and SM that ``benchmarks/results/gpu_decode.json`` measured at batch 32 and
128K (every SM busy), at the device's maximum clock. Their ratio is the issue rate the kernel reached.
Table 2 compares launches compiled here (default, the default with session 9's 2-byte scale reads
``meta32=False``, ``dequant="f16"``, 64-token tiles, ``maxnreg=128``): no
GPU timing, only what each launch would issue and how many blocks fit on an SM. BENCHMARKS.md §6 (session
10) has both. Needs a process whose kernels are compiled (``TRITON_INTERPRET`` unset).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import common
from kernel_resources import decode_rows

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_decode.json"
CPU = torch.device("cpu")
SMS, CLOCK_HZ = 132, 1.98e9  # the H200 of session 9 (device.txt: clocks.max.sm 1980 MHz; 132 SMs)
BATCH, CONTEXT = 32, 131072  # table 1's cell: the largest measured, all SMs busy
LAUNCHES = {  # table 2
    "default (f32)": {},
    "default, 2-byte scale reads (session 9)": {"meta32": False},
    "f16": {"dequant": "f16"},
    "f16, 64-token tiles": {"dequant": "f16", "block_t": 64},
    "f16, maxnreg=128": {"dequant": "f16", "maxnreg": 128},
}


def loop_cost(shape_name: str, scheme: str, batch: int, **launch) -> dict:
    """The compiled decode kernel of one launch (``kernel_resources.decode_rows``): block_t, warps, registers,
    spills, blocks per SM, tile-loop instructions, warp-instructions per token, integer-to-float conversions
    in the loop."""
    shape = common.SHAPES[shape_name]
    base = scheme.removesuffix(common.ROPE_SUFFIX)
    tables = common.rope_tables(4096, shape["D"], CPU) if scheme != base else None
    sch = common.SCHEMES[base] if base != "fp16" else None
    store = common.random_store(batch, shape, 4096, sch, CPU, torch.Generator().manual_seed(0), tables, lazy=True)
    (row,) = decode_rows("cost", scheme, shape_name, store, "sm_90", **launch)
    return {"block_t": row["block_t"], "num_warps": row["num_warps"], "registers": row["registers"],
            "spill_bytes": row["local_bytes"], "blocks_per_sm": row["blocks_per_sm"],
            "loop_instructions": row["loop_instructions"],
            "warp_instructions_per_token": row["warp_instructions_per_token"],
            "int_to_float": row["loop_int_to_float"], "sync_loads": row["loop_sync_loads"],
            "async_loads": row["loop_async_loads"]}  # fmt: skip


def issue_table(results: Path) -> list[dict]:
    """Table 1: per shape and scheme, the issue floor against the measured cycles per token and SM."""
    records = json.loads(results.read_text())["records"]
    measured = {(r["shape"], r["scheme"]): r["ms"] for r in records
                if r["kernel"] == "triton" and r["batch"] == BATCH and r["context"] == CONTEXT and "ms" in r}  # fmt: skip
    rows = []
    for (shape_name, scheme), ms in sorted(measured.items()):
        if scheme in ("fp16", "nuq4-outl"):  # the tail loop; NUQ's per-element gathers (not this model)
            continue
        cost = loop_cost(shape_name, scheme, BATCH, meta32=False)  # the code the H200 ran (session 9)
        tokens_per_sm = BATCH * common.SHAPES[shape_name]["H_kv"] * CONTEXT / SMS
        cycles = ms * 1e-3 * CLOCK_HZ / tokens_per_sm
        floor = cost["warp_instructions_per_token"] / 4
        rows.append({"shape": shape_name, "scheme": scheme, **cost, "issue_floor_cycles": round(floor, 1),
                     "measured_cycles": round(cycles, 1), "issued_per_cycle": round(4 * floor / cycles, 2)})  # fmt: skip
    return rows


def launch_table() -> list[dict]:
    """Table 2: int8/int4/int2 at both shapes, each launch of ``LAUNCHES``, compiled only."""
    return [{"shape": s, "scheme": sch, "launch": name, **loop_cost(s, sch, 8, **kw)}
            for s in common.SHAPES for sch in ("int8", "int4", "int2") for name, kw in LAUNCHES.items()]  # fmt: skip


def markdown(issue: list[dict], launches: list[dict]) -> str:
    head1 = ("| shape | scheme | block_t | regs (blocks/SM) | loop instr | warp-instr / token | issue floor "
             "(cycles / token / SM) | measured cycles / token / SM | issued per cycle |")
    head2 = ("| shape | scheme | launch | block_t | regs | spill B | blocks/SM | loop instr | warp-instr / token | "
             "int→float in loop | sync / async loads in loop |")
    out = [head1, "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['shape']} | {r['scheme']} | {r['block_t']} | {r['registers']} ({r['blocks_per_sm']}) | "
            f"{r['loop_instructions']} | {r['warp_instructions_per_token']} | {r['issue_floor_cycles']} | "
            f"{r['measured_cycles']} | {r['issued_per_cycle']} |" for r in issue]  # fmt: skip
    out += ["", head2, "|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['shape']} | {r['scheme']} | {r['launch']} | {r['block_t']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['blocks_per_sm']} | {r['loop_instructions']} | "
            f"{r['warp_instructions_per_token']} | {r['int_to_float']} | {r['sync_loads']} / {r['async_loads']} |"
            for r in launches]  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="gpu_decode.json with the measured times")
    p.add_argument("--json", type=Path, default=None, help="also write both tables here")
    args = p.parse_args(argv)
    issue, launches = issue_table(args.results), launch_table()
    if args.json is not None:
        args.json.write_text(json.dumps({"issue": issue, "launches": launches}, indent=1))
    print(markdown(issue, launches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
