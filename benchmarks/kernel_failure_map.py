"""Map where two CUDA-only decode-kernel test failures occur: many launch variants around each, all recorded.

    PYTHONPATH=src:tests python3 benchmarks/kernel_failure_map.py --out $OUT/failure_map.json  # CUDA
    PYTHONPATH=src:tests python3 benchmarks/kernel_failure_map.py --device cpu --smoke         # interpreter

Written after the H200 (Triton 3.6, torch 2.11; BENCHMARKS.md §6z) failed two tests of ``tests/test_kernels.py``
that Triton's interpreter on CPU passes:

1. ``test_decode_f16_dequant_shapes[D16-G1]``: ``dequant="f16"`` differs from the float32 path by up to 2.77 at
   head dim 16, one query head per KV head (2-bit keys per channel in 16-token groups, 2-bit values per token
   in groups of 16, 32-token tiles, one split). The other ``F16_SHAPES`` pass.
2. ``test_meta32_word_reads_give_the_same_output[case2]`` (D = 128, 2-bit keys per channel in 64-token groups,
   INT8 symmetric values per token in groups of 32, float16 queries, ``dequant="f16"``): ``meta32=True``
   (scales read as int32 words) is not bit-identical to ``meta32=False`` (2-byte reads).

Each variant changes one or two factors of the failing case; stores and queries are built as the tests build
them (``make_store``, seeds, ragged and left-padded batch), imported from ``tests/test_kernels.py``. Some variants
force constexprs of the launch that the host wrapper would choose (``F16_K`` / ``F16_V``: one side alone in
float16; ``K_W32`` / ``V_W32`` / ``QMASK_W32``: word reads on one side or the mask alone; ``ASM``: the
mask-and-or expression instead of inline ``lop3``) through a stand-in for ``_decode_kernel`` that edits the
launch's keyword arguments and records what was launched (a failed f16 compile falls back to float32 on
CUDA: ``launches`` then shows two entries, the first with its ``error``).

Rows (``--out`` JSON, rewritten after every variant, so a killed run keeps what it finished):

- ``f16`` rows: ``err_f16`` / ``err_f32`` (max abs error of each path against float64),
  ``err_torch_fp16`` (plain torch attention at float16 against float64), ``diff_f16_f32``; ``ok`` is the
  test's criterion (``err_f16 <= 2 err_torch_fp16 + 1e-6`` and ``diff_f16_f32 <= err_torch_fp16 + 1e-6``);
  ``where`` says which sequences, query heads and channels differ by more than ``err_torch_fp16 + 1e-6``.
- ``meta32`` rows: ``identical`` (``torch.equal`` of word reads and 2-byte reads, the test's criterion), the
  max difference, the count of differing elements and ``where`` they are, and each output's error.

Variants run in priority order (tier 1: each single factor of the failing cases, 23 variants; tier 2: the wider
sweep, 19); no variant starts after ``--budget-s`` seconds, the rest are recorded as skipped. Compiling is nearly
all of the time on CUDA: each distinct constexpr set compiles once (about 1-3 s), 32 for tier 1 and 30 for tier 2
(``new_configs`` per row, ``distinct_launch_configs`` in total); the launches and references add a few seconds. So
the default 90 s should finish tier 1, and ``--budget-s 240`` the whole map. On CPU (``--device cpu``, about a
minute for the whole map, 10 s with ``--smoke``) every row is expected to pass: the interpreter computed both
tests right.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import commit, write_json

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCE = ROOT / "src" / "kvbits" / "kernels" / "triton_decode.py"
# the launch constexprs worth recording (the rest follow from the store and the row's parameters)
FLAGS = ("G", "D", "BLOCK_T", "num_warps", "VEC_K", "VEC_V", "F16_K", "F16_V", "ASM", "K_W32", "V_W32",
         "QMASK_W32", "HAS_QMASK")  # fmt: skip


@dataclass(frozen=True)
class Side:
    """An integer quantization spec of one side: ``bits``, ``gran`` (``channel`` / ``token``), ``group``."""

    bits: int
    gran: str
    group: int | None = None
    symmetric: bool = False

    def label(self) -> str:
        g = f"g{self.group}" if self.group else "gNone"
        gran = {"channel": "ch", "token": "tok"}.get(self.gran, self.gran)
        return f"int{self.bits}-{gran}-{g}{'-sym' if self.symmetric else ''}"


@dataclass(frozen=True)
class F16Variant:
    """One launch pair (``dequant="f16"`` vs the default float32 path) around the failing D16-G1 case
    (``F16_SHAPES[0]``, which the tests now run at head dim 32: ``tables_match``)."""

    name: str
    tier: int
    D: int = 16
    G: int = 1
    key: Side = Side(2, "channel", 16)
    value: Side = Side(2, "token", 16)
    block_t: int = 32
    splits: int = 1
    num_warps: int | None = None  # None: launch_defaults (4 here)
    seed_offset: int = 0
    mask: bool = True  # the test's left-padded sequence 1 (quant_mask)
    meta32: bool = True  # of the f16 launch (the float32 one keeps the default)
    force: tuple[tuple[str, bool], ...] = ()  # constexprs forced in the f16 launch


@dataclass(frozen=True)
class Meta32Variant:
    """One launch pair (``meta32`` words vs 2-byte reads) around ``META32_CASES[2]`` (case2)."""

    name: str
    tier: int
    dequant: str = "f16"
    block_t: int = 32
    splits: int = 3
    seed_offset: int = 0
    mask: bool = True
    force_words: tuple[tuple[str, bool], ...] = ()  # constexprs forced in the meta32=True launch only
    force_both: tuple[tuple[str, bool], ...] = ()  # ... in both launches
    D: int = 128
    G: int = 2
    key: Side = Side(2, "channel", 64)
    value: Side = Side(8, "token", 32, symmetric=True)


BASE_F16 = F16Variant("base", 1)
BASE_META32 = Meta32Variant("case2", 1)
KEYS_ONLY_WORDS = (("V_W32", False), ("QMASK_W32", False))
VALUES_ONLY_WORDS = (("K_W32", False), ("QMASK_W32", False))
MASK_ONLY_WORDS = (("K_W32", False), ("V_W32", False))


def f16_variants() -> list[F16Variant]:
    """Tier 1: D16-G1 with one factor changed; tier 2: other head dims and groups, per-token keys."""
    b = BASE_F16
    v = lambda name, tier, **kw: replace(b, name=name, tier=tier, **kw)
    return [
        b,
        v("seed+1", 1, seed_offset=1),
        v("splits2", 1, splits=2),
        v("meta32-off", 1, meta32=False),
        v("asm-off", 1, force=(("ASM", False),)),
        v("f16-keys-only", 1, force=(("F16_V", False),)),
        v("f16-values-only", 1, force=(("F16_K", False),)),
        v("key-int2-ch-g32", 1, key=Side(2, "channel", 32)),
        v("key-int4-ch-g16", 1, key=Side(4, "channel", 16)),
        v("key-int8-ch-g16", 1, key=Side(8, "channel", 16)),
        v("value-int4-tok-g16", 1, value=Side(4, "token", 16)),
        v("value-int8-tok-g16", 1, value=Side(8, "token", 16)),
        v("block_t64", 1, block_t=64),
        v("warps2", 1, num_warps=2),
        v("G2", 1, G=2),
        v("D32", 1, D=32),
        v("no-mask", 1, mask=False),
        v("G4", 2, G=4),
        v("D64", 2, D=64),
        v("key-int2-tok", 2, key=Side(2, "token")),
        v("key-int8-tok", 2, key=Side(8, "token")),
        v("D32-G4", 2, D=32, G=4),
        v("D32-key-int4-ch-g16", 2, D=32, key=Side(4, "channel", 16)),
        v("D32-value-int2-tok-gNone", 2, D=32, value=Side(2, "token")),
        v("D32-f16-keys-only", 2, D=32, force=(("F16_V", False),)),
        v("D32-f16-values-only", 2, D=32, force=(("F16_K", False),)),
        v("D64-G4", 2, D=64, G=4),
    ]


def meta32_variants() -> list[Meta32Variant]:
    """Tier 1: which reads (keys, values, mask) and which dequant path; tier 2: tiles, seeds, one f16 side."""
    b = BASE_META32
    v = lambda name, tier, **kw: replace(b, name=name, tier=tier, **kw)
    return [
        b,
        v("case2-f32", 1, dequant="f32"),
        v("words-keys-only", 1, force_words=KEYS_ONLY_WORDS),
        v("words-values-only", 1, force_words=VALUES_ONLY_WORDS),
        v("words-mask-only", 1, force_words=MASK_ONLY_WORDS),
        v("asm-off", 1, force_both=(("ASM", False),)),
        v("block_t64", 2, block_t=64),
        v("f32-block_t64", 2, dequant="f32", block_t=64),
        v("f32-words-keys-only", 2, dequant="f32", force_words=KEYS_ONLY_WORDS),
        v("f32-words-values-only", 2, dequant="f32", force_words=VALUES_ONLY_WORDS),
        v("f16-keys-only", 2, force_both=(("F16_V", False),)),
        v("f16-values-only", 2, force_both=(("F16_K", False),)),
        v("no-mask", 2, mask=False),
        v("seed+1", 2, seed_offset=1),
        v("splits1", 2, splits=1),
    ]


SMOKE_F16 = ("base", "f16-keys-only")
SMOKE_META32 = ("case2", "words-keys-only")


class Launches:
    """Stands in for ``triton_decode._decode_kernel``: forces constexprs given in ``force`` (those the launch
    passes), records each launch's flags (and its exception, re-raised: the wrapper's fallback then runs as in
    production) and the distinct constexpr sets seen (compiles on CUDA)."""

    def __init__(self, kernel: Any, configs: set[tuple]) -> None:
        self.kernel, self.configs = kernel, configs
        self.force: dict[str, bool] = {}
        self.log: list[dict] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **meta: Any) -> Any:
            meta = {k: self.force.get(k, val) for k, val in meta.items()}
            entry = {k: meta[k] for k in FLAGS if k in meta}
            self.log.append(entry)
            self.configs.add(tuple(sorted(meta.items())))
            try:
                return self.kernel[grid](*args, **meta)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                raise

        return launch


@contextlib.contextmanager
def launching(td: ModuleType, configs: set[tuple]) -> Iterator[Launches]:
    """``td._decode_kernel`` replaced by a ``Launches`` for the duration."""
    kernel = td._decode_kernel
    spy = Launches(kernel, configs)
    td._decode_kernel = spy
    try:
        yield spy
    finally:
        td._decode_kernel = kernel


def call(
    td: ModuleType, spy: Launches, force: dict[str, bool], q: torch.Tensor, store: Any, **kw: Any
) -> tuple:
    """``decode_attention_triton(q, store, **kw)`` with ``force`` applied: (output, launches, seconds)."""
    spy.force, spy.log = dict(force), []
    t = time.monotonic()
    out = td.decode_attention_triton(q, store, **kw)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out, spy.log, round(time.monotonic() - t, 3)


def num(x: float) -> float | str:
    """A JSON-safe float: non-finite values as strings."""
    return x if math.isfinite(x) else str(x)


def where(a: torch.Tensor, b: torch.Tensor, tol: float) -> dict:
    """Where ``(B, H_q, 1, D)`` outputs differ by more than ``tol``: per-sequence max, heads, channels."""
    d = torch.nan_to_num((a.double() - b.double()).abs(), nan=math.inf)[:, :, 0, :]
    bad = d > tol
    return {
        "max_per_sequence": [num(float(x)) for x in d.amax(dim=(1, 2))],
        "n_over": int(bad.sum()),
        "heads": torch.nonzero(bad.any(dim=2).any(dim=0)).flatten().tolist(),
        "channels": torch.nonzero(bad.any(dim=1).any(dim=0)).flatten().tolist(),
        "argmax_b_h_d": list(map(int, torch.unravel_index(d.argmax(), d.shape))),
    }


def build(tk: ModuleType, v: F16Variant | Meta32Variant, dev: str, seed: int) -> tuple[Any, torch.Tensor]:
    """The tests' store (ragged batch, ``make_store``) and queries, ``seed`` as the test derives it."""
    ks, vs = (tk.spec(s.bits, s.gran, s.group, symmetric=s.symmetric) for s in (v.key, v.value))
    g = torch.Generator().manual_seed(seed + v.seed_offset)
    block = max(32, ks.group_size or 0) if ks.granularity == "channel" else 32  # whole key scale groups
    store = tk.make_store(g, D=v.D, key_spec=ks, value_spec=vs, T_q=192, quant_lens=[192, 70], full_lens=[40, 3],
                          block=block, device=dev)  # fmt: skip
    if v.mask:
        store.quant_mask = torch.ones(2, 192, dtype=torch.bool, device=store.device)
        store.quant_mask[1, :9] = False
    q = (torch.randn(2, 2 * v.G, 1, v.D, generator=g) * 1.5).to(dev).half()
    return store, q


def references(tk: ModuleType, q: torch.Tensor, store: Any) -> tuple[torch.Tensor, float]:
    """Float64 truth and plain torch attention's error at float16 (the tests' yardstick)."""
    truth = tk.decode_attention_reference(q.double(), store, dtype=torch.float64)
    return truth, tk.max_err(tk.decode_attention_reference(q, store, dtype=torch.float16), truth)


def run_f16(tk: ModuleType, td: ModuleType, spy: Launches, v: F16Variant, dev: str) -> dict:
    store, q = build(tk, v, dev, seed=v.D * 31 + v.G)  # test_decode_f16_dequant_shapes' seed
    truth, err_pt = references(tk, q, store)
    kw = {"splits": v.splits, "block_t": v.block_t, "num_warps": v.num_warps}
    f16_ok = [td.f16_ok(p, v.block_t, torch.float16) for p in (store.key, store.value)]
    out16, launches16, s16 = call(td, spy, dict(v.force), q, store, dequant="f16", meta32=v.meta32, **kw)
    out32, launches32, s32 = call(td, spy, {}, q, store, **kw)
    err16, err32, diff = tk.max_err(out16, truth), tk.max_err(out32, truth), tk.max_err(out16, out32)
    ok = err16 <= 2 * err_pt + 1e-6 and diff <= err_pt + 1e-6
    return {
        "ok": ok, "diff_f16_f32": num(diff), "err_f16": num(err16), "err_f32": num(err32),
        "err_torch_fp16": err_pt, "f32_ok": err32 <= 2 * err_pt + 1e-6, "f16_ok_key_value": f16_ok,
        "where": where(out16, out32, err_pt + 1e-6), "launches_f16": launches16, "launches_f32": launches32,
        "s_f16": s16, "s_f32": s32,
    }  # fmt: skip


def run_meta32(tk: ModuleType, td: ModuleType, spy: Launches, v: Meta32Variant, dev: str) -> dict:
    store, q = build(tk, v, dev, seed=v.D + v.block_t)  # test_meta32_word_reads_give_the_same_output's seed
    truth, err_pt = references(tk, q, store)
    kw = {"splits": v.splits, "block_t": v.block_t, "dequant": v.dequant}
    words, launches_w, s_w = call(td, spy, {**dict(v.force_both), **dict(v.force_words)}, q, store, **kw)
    halves, launches_h, s_h = call(td, spy, dict(v.force_both), q, store, meta32=False, **kw)
    identical = torch.equal(words, halves)
    diff = torch.nan_to_num((words.double() - halves.double()).abs(), nan=math.inf)
    err_w, err_h = tk.max_err(words, truth), tk.max_err(halves, truth)
    return {
        "ok": identical and err_w <= 2 * err_pt + 1e-6, "identical": identical, "max_diff": num(float(diff.max())),
        "n_diff": int((words != halves).sum()), "numel": words.numel(), "err_words": num(err_w),
        "err_halves": num(err_h), "err_torch_fp16": err_pt, "where": where(words, halves, 0.0),
        "launches_words": launches_w, "launches_halves": launches_h, "s_words": s_w, "s_halves": s_h,
    }  # fmt: skip


def tables_match(tk: ModuleType, f16_head_dim: int) -> dict:
    """Whether the tests' tables still hold the two failing cases this map starts from. ``F16_SHAPES[0]`` is the
    f16 case at head dim ``f16_head_dim`` (``triton_decode.F16_MIN_HEAD_DIM`` as the product sets it, before
    this map lowers it) since ``f16_ok`` declines head dim 16 (session 38); the rest of its row is the failing
    case's."""
    f16, m32 = BASE_F16, BASE_META32
    spec = lambda s: tk.spec(s.bits, s.gran, s.group, symmetric=s.symmetric)
    want_f16 = (f16_head_dim, f16.G, spec(f16.key), spec(f16.value), f16.block_t, f16.splits)
    want_m32 = (m32.D, spec(m32.key), spec(m32.value), m32.block_t, m32.dequant)
    return {
        "F16_SHAPES[0]": bool(tk.F16_SHAPES and tuple(tk.F16_SHAPES[0]) == want_f16),
        "META32_CASES[2]": bool(len(tk.META32_CASES) > 2 and tuple(tk.META32_CASES[2][:5]) == want_m32),
    }


def describe(v: F16Variant | Meta32Variant) -> dict:
    d = asdict(v)
    d["key"], d["value"] = v.key.label(), v.value.label()
    for k in ("force", "force_words", "force_both"):
        if k in d:
            d[k] = dict(getattr(v, k))
    return d


def g4(x: float | str) -> str:
    """``x`` to 4 significant digits (non-finite values are already strings)."""
    return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)


def line(group: str, row: dict) -> str:
    """One printed line per variant."""
    head = f"{group:6s} t{row['tier']} {row['name']:26s}"
    if "skipped" in row:
        return f"{head} SKIPPED ({row['skipped']})"
    if "error" in row:
        return f"{head} ERROR {row['error'][:200]}"
    r = row["result"]
    launches = r["launches_f16" if group == "f16" else "launches_words"]
    flags = " ".join(
        k for k in ("F16_K", "F16_V", "K_W32", "V_W32", "QMASK_W32") if launches and launches[-1].get(k)
    )
    verdict = "ok  " if r["ok"] else "FAIL"
    if group == "f16":
        body = (f"f16-f32={g4(r['diff_f16_f32'])} err16={g4(r['err_f16'])} err32={g4(r['err_f32'])} "
                f"torch={g4(r['err_torch_fp16'])} per-seq={[g4(x) for x in r['where']['max_per_sequence']]}")  # fmt: skip
    else:
        body = (f"identical={r['identical']} max_diff={g4(r['max_diff'])} n_diff={r['n_diff']}/{r['numel']} "
                f"err_w={g4(r['err_words'])} err_h={g4(r['err_halves'])} torch={g4(r['err_torch_fp16'])}")  # fmt: skip
    return f"{head} {verdict} {body} [{flags}] {row['s']}s"


def environment(dev: str) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": dev, "commit": commit(),
            "kernel_source_sha256": hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()[:16]}  # fmt: skip
    if dev == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        info["device_name"] = f"{platform.processor() or platform.machine()} (Triton interpreter)"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: Triton's interpreter")
    p.add_argument("--out", type=Path, default=None, help="JSON of all rows (rewritten after each variant)")
    p.add_argument(
        "--budget-s", type=float, default=90.0, help="no new variant starts after this many seconds"
    )
    p.add_argument("--smoke", action="store_true", help=f"only {SMOKE_F16 + SMOKE_META32} (the interpreter)")
    p.add_argument("--only", choices=("f16", "meta32"), default=None, help="one of the two maps")
    a = p.parse_args()
    if a.device == "cpu":
        from kvbits.kernels.interpret import enable_interpreter

        enable_interpreter()  # before triton_decode is imported: its kernels are decorated interpreted
    elif not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device (use --device cpu for the interpreter)")
    import test_kernels as tk  # tests/: make_store, spec, max_err, the tests' tables

    from kvbits.kernels import triton_decode as td

    tests_f16_head_dim = td.F16_MIN_HEAD_DIM
    td.F16_MIN_HEAD_DIM = 16  # f16_ok declines head dim 16 since session 38 (this failure): map it regardless

    t_start = time.monotonic()
    plan: list[tuple[str, F16Variant | Meta32Variant]] = []
    f16s = [("f16", v) for v in f16_variants() if a.only in (None, "f16")]
    m32s = [("meta32", v) for v in meta32_variants() if a.only in (None, "meta32")]
    for tier in (1, 2):  # both maps' tier 1 before either's tier 2
        plan += [(g, v) for g, v in f16s + m32s if v.tier == tier]
    if a.smoke:
        plan = [(g, v) for g, v in plan if v.name in (SMOKE_F16 if g == "f16" else SMOKE_META32)]
    configs: set[tuple] = set()
    report: dict[str, Any] = {
        "script": "benchmarks/kernel_failure_map.py", "argv": sys.argv[1:], **environment(a.device),
        "tests_tables_match": tables_match(tk, tests_f16_head_dim), "rows": [],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)

    def save() -> None:
        report["distinct_launch_configs"] = len(configs)
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        rows = report["rows"]
        report["summary"] = {
            g: {s: sum(1 for r in rows if r["group"] == g and r["status"] == s) for s in ("ok", "fail", "error", "skipped")}
            for g in ("f16", "meta32")
        }  # fmt: skip
        if a.out:  # atomic: the map is cut by its timeout (device_run.sh) and must keep its last complete rows
            write_json(a.out, report)

    with launching(td, configs) as spy:
        for group, v in plan:
            row: dict[str, Any] = {"group": group, **describe(v)}
            if time.monotonic() - t_start > a.budget_s:
                row.update(status="skipped", skipped=f"budget {a.budget_s:g} s")
            else:
                t, seen = time.monotonic(), len(configs)
                try:
                    result = (run_f16 if group == "f16" else run_meta32)(tk, td, spy, v, a.device)  # type: ignore[arg-type]
                    row.update(status="ok" if result["ok"] else "fail", result=result)
                except Exception as exc:  # noqa: BLE001 - recorded, the map goes on
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000],
                               traceback=traceback.format_exc()[-3000:], launches=spy.log)  # fmt: skip
                row["s"] = round(time.monotonic() - t, 2)
                row["new_configs"] = len(configs) - seen  # compiles on CUDA (most of "s" there)
            report["rows"].append(row)
            print(line(group, row), flush=True)
            save()
    save()
    print(json.dumps({"summary": report["summary"], "distinct_launch_configs": len(configs),
                      "elapsed_s": report["elapsed_s"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
