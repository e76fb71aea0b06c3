"""No kernel reads (or writes) past the end of a tensor it is given.

A masked lane's value never reaches the output, so output tests can not see an out-of-bounds read; on a GPU
it reads whatever lies after the tensor, and faults ("illegal memory access") where nothing is mapped. Here
every tensor of the store is ``fenced`` (``tests/_fence.py``: it ends just before a page no access is allowed
to) and both kernels run through Triton's interpreter, which reads host memory at the kernel's addresses:
a read past an end is a segmentation fault. What the kernels' host code allocates (split partials, outputs, the
quantize kernel's codes and scales) is fenced too, so writes past an end fault as well. The kernels run in a
subprocess (``python tests/test_bounds.py CASE``), forced onto the CPU, which prints each launch before it
starts, so a fault names the launch.

Each decode layout runs the product kernel at tiles of 32, 64 and 128 tokens (the device run's step 3b) over
splits that end mid-tile or hold no tile, its gather and f16 paths, and the folded kernel at 64-, 128- and
256-token tiles, with scales read as words and as 2-byte values; rotated and smoothed stores have the query and
tails ``code_basis`` moves into the codes' basis fenced as well.

The reserved case (``quant_used`` below ``T_q``, with a left-padded row) also holds each kernel's first launch to
the reference (``_matches_the_reference``): a kernel dropping the slot mask of a reserved store stays finite and
in bounds, and gave 0.41 off there.

Found this way (session 41): the padding mask's int32-word reads (``_mask_words``) read whole tiles, up to
``BLOCK_T - 4`` bytes past the last sequence's row when the slot count is not a multiple of the tile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (name, sides and slot count): slot counts that are multiples of 4 (word reads of the padding mask) and of
# the key groups but not of the 64-token tile, odd ones (one scale per token read as words across slabs);
# every layout family
BOUNDS_CASES = {
    "int8-token-t100": {"key": ("int", 8, "token", None), "value": ("int", 8, "token", None), "T_q": 100},
    "int8-token-t101": {"key": ("int", 8, "token", None), "value": ("int", 8, "token", None), "T_q": 101},
    "int2-token-t99": {"key": ("int", 2, "token", None), "value": ("int", 2, "token", None), "T_q": 99},
    "int4-token-g16-t100": {"key": ("int", 4, "token", 16), "value": ("int", 4, "token", 16), "T_q": 100},
    "int4-kivi-t160": {"key": ("int", 4, "channel", 32), "value": ("int", 4, "token", 32), "T_q": 160},
    "int2-channel16-t80": {"key": ("int", 2, "channel", 16), "value": ("int", 2, "token", None), "T_q": 80},
    "int3-token-t100": {"key": ("int", 3, "token", 32), "value": ("int", 3, "token", None), "T_q": 100},
    "nuq4-outliers-t160": {"key": ("nuq", 4, "channel", 32), "value": ("nuq", 4, "token", None), "T_q": 160,
                           "outliers": True},
    "fp8-token-t100": {"key": ("fp8", 8, "token", None), "value": ("fp8", 8, "token", None), "T_q": 100},
    "int4-kivi-prerope-t160": {"key": ("int", 4, "channel", 32), "value": ("int", 4, "token", 32), "T_q": 160,
                               "rope": True},
    "int8-token-d128-t100": {"key": ("int", 8, "token", None), "value": ("int", 8, "token", None), "T_q": 100,
                             "D": 128},
    "int4-token-reserved-101-of-131": {"key": ("int", 4, "token", None), "value": ("int", 4, "token", None),
                                       "T_q": 131, "used": 101},
    # rotated sides (the query split into two float16 halves, the tails rotated in, the output rotated out), keys
    # centred and smoothed per channel, and both: the launches of the *-hadamard and *-smooth presets
    "int4-token-hadamard-t101": {"key": ("int", 4, "token", None), "value": ("int", 4, "token", None),
                                 "T_q": 101, "rotate": True},
    "int4-token-smooth-t99": {"key": ("int", 4, "token", None), "value": ("int", 4, "token", None), "T_q": 99,
                              "smooth": True},
    "int8-token-smooth-hadamard-g1-t100": {"key": ("int", 8, "token", None), "value": ("int", 8, "token", None),
                                           "T_q": 100, "smooth": True, "rotate": True, "G": 1},
    # bfloat16 queries (the product kernel only), eight query heads per KV head
    "int4-kivi-bf16-g8-t96": {"key": ("int", 4, "channel", 32), "value": ("int", 4, "token", 32), "T_q": 96,
                              "G": 8, "dtype": "bfloat16"},
}

# (block_t, splits) of each kernel: tiles of every size the device run's step 3b launches (32-128; the folded
# kernel's 64-256), a split count that leaves splits without a whole tile and one that leaves some empty
PRODUCT_LAUNCHES = ((64, 2), (32, 3), (128, 8))
FOLD_LAUNCHES = ((None, 2), (64, 3), (256, 1))

# the quantize-and-pack kernel, reading fenced new tokens (B = 2, H_kv = 2, n, D = 64) and writing into fenced
# outputs: (name, (kind, bits, granularity, group size), n, static ranges)
QUANTIZE_CASES = {
    "quantize-int8-token-n37": (("int", 8, "token", None), 37, False),
    "quantize-int4-token-g32-n37": (("int", 4, "token", 32), 37, False),
    "quantize-int3-token-n37": (("int", 3, "token", None), 37, False),
    "quantize-int2-channel-g32-n64": (("int", 2, "channel", 32), 64, False),
    "quantize-int4-channel-static-n37": (("int", 4, "channel", None), 37, True),
    "quantize-nuq3-channel-g32-outl-n64": (("nuq", 3, "channel", 32), 64, False),
    "quantize-fp8-token-n37": (("fp8", 8, "token", None), 37, False),
}
CASES = [*BOUNDS_CASES, *QUANTIZE_CASES]


@pytest.mark.parametrize("case", CASES)
def test_kernels_read_nothing_past_a_tensor(case: str):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{HERE}"}
    env.pop("KVBITS_KERNEL", None)
    run = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, env=env, timeout=600,
                         check=False)  # fmt: skip
    if "Triton is not importable" in run.stdout:
        pytest.skip(run.stdout.strip())
    launches = [line for line in run.stdout.splitlines() if line.startswith("launch ")]
    assert run.returncode == 0, (
        f"{case}: exit {run.returncode}{' (a read past a tensor end)' if run.returncode == -11 else ''} during "
        f"{launches[-1] if launches else '?'}\n"
        f"{run.stderr[-2000:]}"
    )
    assert launches and run.stdout.rstrip().endswith("done"), run.stdout


def _spec(kind: str, bits: int, gran: str, group: int | None, outliers: bool, static: bool = False):
    from kvbits.schemes import TensorSpec

    fmt = "e4m3" if kind == "fp8" else None
    return TensorSpec(kind=kind, bits=bits, fmt=fmt, granularity=gran, group_size=group, static=static,
                      outlier_frac=0.03 if outliers else 0.0)  # fmt: skip


class _FencedAllocations:
    """Stands in for the ``torch`` module of a kernel's host code: what it allocates with ``empty``,
    ``empty_like`` or ``zeros`` is ``fenced``, so the kernel's stores past an output's end fault too."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        from _fence import fenced

        real = getattr(self._torch, name)
        if name in ("empty", "empty_like", "zeros"):
            return lambda *a, **kw: fenced(real(*a, **kw))
        return real


@contextmanager
def _fenced_allocations(*modules: Any) -> Iterator[None]:
    """Within it, what the host code of ``modules`` allocates is fenced (``_FencedAllocations``), and so is what
    their ``code_basis`` returns (a rotated / smoothed store's ``q'`` and its tails moved into the codes' basis)."""
    import torch
    from _fence import fence_store, fenced

    def basis(*args: Any, **kwargs: Any) -> Any:
        q, store, out_rotate = code_basis(*args, **kwargs)
        return fenced(q), fence_store(store), out_rotate

    code_basis = modules[0].code_basis
    for m in modules:
        m.torch, m.code_basis = _FencedAllocations(torch), basis
    try:
        yield
    finally:
        for m in modules:
            m.torch, m.code_basis = torch, code_basis


def quantize_main(case: str) -> int:
    """One quantize case: fenced input and outputs; the codes must equal the torch reference's."""
    import torch
    from _fence import fenced

    from kvbits.kernels import triton_quantize
    from kvbits.quant import quantize

    (kind, bits, gran, group), n, static = QUANTIZE_CASES[case]
    spec = _spec(kind, bits, gran, group, outliers="outl" in case, static=static)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, 2, n, 64, generator=g).half()
    kw: dict = {}
    if static:
        kw = {"static_scale": torch.full((2, 64), 0.4).half(), "static_zero": torch.full((2, 64), -3.0).half()}
    if kind == "nuq":
        u = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
        kw["codebook"] = (u.abs() ** 1.5 * u.sign()).half()
    assert triton_quantize.supported(x, spec) is None, triton_quantize.supported(x, spec)
    want = quantize(x, spec, **kw)
    triton_quantize.torch = _FencedAllocations(torch)
    print(f"launch {case}", flush=True)
    got = triton_quantize.quantize_pack_triton(fenced(x), spec, **kw)
    assert torch.equal(got.data, want.data), case
    print("done", flush=True)
    return 0


def _matches_the_reference(q: Any, store: Any, out: Any, kernel: str) -> None:
    """A reserved, left-padded store: the kernel's ``out (B, H_q, 1, D)`` is the reference's (within twice the
    error of torch in ``q``'s dtype, as ``test_kernels`` holds the kernels), and the pads change it."""
    import torch

    from kvbits.kernels.reference import decode_attention_reference

    truth = decode_attention_reference(q.double(), store, dtype=torch.float64)
    err = float((out.double() - truth).abs().max())
    err_pt = float((decode_attention_reference(q, store, dtype=q.dtype).double() - truth).abs().max())
    assert err <= 2 * err_pt + 1e-6, f"{kernel}: error {err:.3g} > 2 x torch's {err_pt:.3g}"
    unmasked = decode_attention_reference(q.double(), replace(store, quant_mask=None), dtype=torch.float64)
    assert float((out.double() - unmasked).abs().max()) > 0.1, f"{kernel}: the pads changed nothing"


def main(case: str) -> int:
    """Runs one case's launches on fenced stores; prints ``launch ...`` before each and ``done`` at the end."""
    import torch

    try:
        import test_kernels  # enables Triton's interpreter on a CPU-only process
    except ImportError as exc:
        print(f"Triton is not importable: {exc}")
        return 0
    if test_kernels.triton_decode is None:
        print(f"Triton is not importable: {test_kernels.TRITON_SKIP}")
        return 0
    if case in QUANTIZE_CASES:
        return quantize_main(case)
    from _fence import fence_store
    from _fence import fenced as fenced_tensor

    from kvbits.kernels import triton_decode, triton_fold
    from kvbits.kernels.reference import word_rows
    from kvbits.kernels.triton_decode import f16_ok

    c = BOUNDS_CASES[case]
    outl = bool(c.get("outliers"))
    ks, vs = _spec(*c["key"], outl), _spec(*c["value"], outl)
    T_q, D, B, H_kv, G = c["T_q"], c.get("D", 64), 2, 2, c.get("G", 3)
    g = torch.Generator().manual_seed(T_q)
    block = 4 if ks.granularity == "token" else max(32, ks.group_size or 0)
    used = c.get("used", T_q)  # a reservation: T_q slots, the first `used` written (the rest never read)
    if c.get("rotate") or c.get("smooth"):  # channel vectors from all keys: test_kernels.extras
        rot = "hadamard" if c.get("rotate") else None
        ks = replace(ks, rotate=rot, centre=bool(c.get("smooth")), smooth=0.5 if c.get("smooth") else None)
        vs = replace(vs, rotate=rot)
    store = test_kernels.make_store(g, B=B, H_kv=H_kv, D=D, key_spec=ks, value_spec=vs, T_q=T_q, T_f=13,
                                    quant_lens=[used // 2 + 1, used], full_lens=[5, 13], block=block,
                                    rope=bool(c.get("rope")))  # fmt: skip
    if used < T_q:
        store.quant_used = used
    mask = torch.ones(B, T_q, dtype=torch.bool)
    mask[1, :9] = False  # sequence 1 left-padded
    store.quant_mask = word_rows(mask)  # as pack_store and the cache hold it: rows of whole words
    store.full_mask = torch.ones(B, 13, dtype=torch.bool)
    store.full_mask[1, 0] = False  # the last row is the longest: its tiles end at the tensors' ends
    dtype = getattr(torch, c.get("dtype", "float16"))
    q = (torch.randn(B, H_kv * G, 1, D, generator=g) * 1.5).to(dtype)
    fenced, fq = fence_store(store), fenced_tensor(q)
    # the partial outputs and the output the host code allocates are fenced too (reads and writes); the first
    # launch of each kernel also runs on the unfenced store: the fenced one's output must be its, bit for bit
    launches = [(f"product block_t={t} splits={n}", {"block_t": t, "splits": n}) for t, n in PRODUCT_LAUNCHES]
    launches.append(("product gather", {"block_t": 64, "splits": 2, "vectorized": False}))
    if dtype == torch.float16 and any(f16_ok(p, 64, dtype) for p in (store.key, store.value)):
        launches.append(("product f16", {"block_t": 64, "splits": 2, "dequant": "f16"}))
    want = triton_decode.decode_attention_triton(q, store, **launches[0][1])
    if used < T_q:
        _matches_the_reference(q, store, want, "product")
    for name, kw in launches:
        with _fenced_allocations(triton_decode):
            print(f"launch {name}", flush=True)
            out = triton_decode.decode_attention_triton(fq, fenced, **kw)
        assert torch.isfinite(out).all() and (kw != launches[0][1] or torch.equal(out, want)), name
    if triton_fold.fold_supported(store, q) is None:
        want = triton_fold.decode_attention_fold(q, store, splits=FOLD_LAUNCHES[0][1])
        if used < T_q:
            _matches_the_reference(q, store, want, "fold")
        for (t, n), meta32 in [*((launch, False) for launch in FOLD_LAUNCHES), (FOLD_LAUNCHES[0], True)]:
            with _fenced_allocations(triton_decode, triton_fold):
                print(f"launch fold block_t={t} splits={n} meta32={meta32}", flush=True)
                out = triton_fold.decode_attention_fold(fq, fenced, block_t=t, splits=n, meta32=meta32)
            first = (t, n, meta32) == (*FOLD_LAUNCHES[0], False)
            assert torch.isfinite(out).all() and (not first or torch.equal(out, want)), (t, n, meta32)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main(sys.argv[1]))
