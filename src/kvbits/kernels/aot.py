"""Compile the Triton kernels for a GPU that is not here: registers, shared memory and spills per launch.

Triton lowers a kernel to PTX with LLVM and assembles it with the ``ptxas`` it ships; neither needs a
GPU. ``compile_only(arch)`` makes Triton's active driver name that target and turns every kernel launch
into a compile (``JITFunction.run(warmup=True)``), so the product's own launch code
(``decode_attention_triton``, ``quantize_pack_triton``) compiles exactly the specialisations it would
launch, from CPU tensors, and nothing runs. ``resources`` reads what the GPU would have to grant each
compiled kernel (``cuobjdump --dump-resource-usage`` on the cubin, Triton's ``metadata.shared``);
``DeviceLimits.check`` says whether a launch would fail (Triton raises ``OutOfResources`` when the
shared memory exceeds the device's per-block maximum) and how many blocks fit on one SM;
``instruction_mix`` counts the machine code's global loads by width and its tensor-core instructions.

Usage (a process whose kernels are compiled, not interpreted: ``TRITON_INTERPRET`` unset)::

    with compile_only("sm_90") as compiled:
        decode_attention_triton(q, store)        # CPU tensors; outputs are left unwritten
    for k in compiled:
        print(resources(k), LIMITS["sm_90"].check(resources(k)))

``benchmarks/kernel_resources.py`` does this for every configuration the cache and the GPU benchmark launch.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LIMITS",
    "DeviceLimits",
    "KernelResources",
    "compile_only",
    "compiling",
    "hot_loop",
    "instruction_mix",
    "resources",
    "sass",
]

_COMPILING = 0  # compile_only blocks entered and not yet left


@dataclass(frozen=True)
class DeviceLimits:
    """Per-SM and per-block limits of one GPU architecture (CUDA C Programming Guide, compute capabilities).

    ``max_shared_per_block`` is the opt-in maximum Triton compares ``metadata.shared`` with; the CUDA
    runtime reserves ``reserved_shared_per_block`` more per resident block.
    """

    name: str
    capability: int
    max_shared_per_block: int
    shared_per_sm: int
    reserved_shared_per_block: int = 1024
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    reg_alloc_unit: int = 256  # registers are granted per warp in units of 256

    def blocks_per_sm(self, r: KernelResources) -> int:
        """Resident blocks per SM (occupancy) allowed by registers, shared memory and threads."""
        threads = 32 * r.num_warps
        regs_per_warp = -(-max(r.registers, 1) * 32 // self.reg_alloc_unit) * self.reg_alloc_unit
        by_regs = self.regs_per_sm // (regs_per_warp * r.num_warps)
        by_shared = self.shared_per_sm // (r.shared_bytes + self.reserved_shared_per_block)
        return max(0, min(by_regs, by_shared, self.max_threads_per_sm // threads, self.max_blocks_per_sm))

    def check(self, r: KernelResources) -> str | None:
        """Why a launch of this kernel would fail on the device (``None``: it would launch)."""
        if r.shared_bytes > self.max_shared_per_block:
            return (
                f"shared memory {r.shared_bytes} B > {self.max_shared_per_block} B per block on {self.name}"
            )
        if r.registers > self.max_regs_per_thread:
            return f"{r.registers} registers per thread > {self.max_regs_per_thread}"
        if self.blocks_per_sm(r) < 1:
            return f"not one block of {r.num_warps} warps fits an SM of {self.name}"
        return None


LIMITS = {
    # H100 / H200 (Hopper): 227 KB opt-in shared memory per block, 228 KB per SM
    "sm_90": DeviceLimits("sm_90 (H100/H200)", 90, 232448, 233472),
    # A100 (Ampere): 163 KB per block, 164 KB per SM
    "sm_80": DeviceLimits("sm_80 (A100)", 80, 166912, 167936),
    # L4 / L40S / RTX 4090 (Ada): 99 KB per block, 100 KB per SM, 1536 threads and 24 blocks per SM
    "sm_89": DeviceLimits(
        "sm_89 (L4/L40S)", 89, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=24
    ),
}


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel asks of the GPU.

    Attributes:
        kernel: the Triton function's name.
        num_warps, num_stages: launch options it was compiled with.
        shared_bytes: dynamic shared memory per block (Triton's ``metadata.shared``).
        registers: registers per thread (ptxas, from the cubin).
        local_bytes: per-thread local memory (register spills and stack; 0 is what a hot kernel wants).
        constants: the kernel's constexpr arguments, for telling specialisations apart.
    """

    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    local_bytes: int
    constants: dict[str, Any]


class _CompileOnlyDriver:
    """The part of Triton's driver interface that compiling (not launching) a kernel uses."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> str:
        return f"compile-only:{self.target.arch}"

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def is_active(self) -> bool:
        return True


def compiling() -> bool:
    """Whether Triton launches only compile now (inside ``compile_only``), so CPU tensors are fine."""
    return _COMPILING > 0


@contextlib.contextmanager
def compile_only(arch: str = "sm_90") -> Iterator[list[Any]]:
    """Within the block, Triton kernel launches compile for ``arch`` and run nothing.

    Yields the list the compiled kernels (Triton ``CompiledKernel``) are appended to, one per launch.

    Raises:
        ValueError: an unknown ``arch`` (see ``LIMITS``).
        RuntimeError: Triton runs kernels through its interpreter in this process (``TRITON_INTERPRET=1``).
    """
    if arch not in LIMITS:
        raise ValueError(f"arch must be one of {sorted(LIMITS)}, got {arch!r}")
    from kvbits.kernels.interpret import interpreting

    if interpreting():
        raise RuntimeError(
            "compile_only needs compiled kernels; unset TRITON_INTERPRET (use a fresh process)"
        )
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", LIMITS[arch].capability, 32)
    compiled: list[Any] = []
    original_run = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    global _COMPILING
    previous = driver._active  # not ``driver.active``: that would create the default driver (needs a GPU)
    driver.set_active(_CompileOnlyDriver(target))
    JITFunction.run = run
    _COMPILING += 1
    try:
        yield compiled
    finally:
        _COMPILING -= 1
        JITFunction.run = original_run
        driver._active = previous


_SASS: dict[str, str] = {}  # sha256 of a cubin -> its SASS text (the most recent _SASS_KEEP kernels)
_SASS_KEEP = 64


def sass(kernel: Any) -> str:
    """The kernel's SASS (``cuobjdump -sass`` on its cubin), disassembled once per distinct cubin.

    Disassembling takes ~0.7 s a kernel; ``instruction_mix`` and ``hot_loop`` both read it.

    Raises:
        RuntimeError: ``cuobjdump`` failed.
    """
    key = hashlib.sha256(kernel.asm["cubin"]).hexdigest()
    if key not in _SASS:
        out = _cuobjdump(kernel, "-sass")
        if out.returncode != 0:
            raise RuntimeError(f"cuobjdump -sass failed for {kernel.name}: {out.stderr[-300:]}")
        if len(_SASS) >= _SASS_KEEP:
            _SASS.pop(next(iter(_SASS)))
        _SASS[key] = out.stdout
    return _SASS[key]


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _cuobjdump(kernel: Any, option: str) -> subprocess.CompletedProcess:
    """``cuobjdump <option>`` (the one shipped with Triton's CUDA backend) on the kernel's cubin."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, option, f.name], capture_output=True, text=True, check=False
        )


def resources(kernel: Any) -> KernelResources:
    """Registers, shared and local memory of a kernel compiled by ``compile_only``.

    Raises:
        RuntimeError: ``cuobjdump`` (shipped with Triton's CUDA backend) is missing or reports no usage.
    """
    out = _cuobjdump(kernel, "--dump-resource-usage")
    m = _USAGE.search(out.stdout)
    if m is None:
        raise RuntimeError(
            f"cuobjdump gave no resource usage for {kernel.name}: {out.stdout[-300:]}{out.stderr[-300:]}"
        )
    regs, stack, _static_shared, local = (int(g) for g in m.groups())
    md = kernel.metadata
    constants = {
        (k[0] if isinstance(k, tuple) else k): v
        for k, v in getattr(kernel.src, "constants", {}).items()
        if isinstance(v, int | bool | str)
    }
    names = kernel.src.fn.arg_names
    constants = {names[k] if isinstance(k, int) else k: v for k, v in constants.items()}
    return KernelResources(
        kernel=md.name,
        num_warps=md.num_warps,
        num_stages=md.num_stages,
        shared_bytes=md.shared,
        registers=regs,
        local_bytes=stack + local,
        constants=constants,
    )


_SASS_OP = re.compile(r"\b(LDG(?:STS)?(?:\.[A-Z0-9]+)*|HMMA(?:\.[A-Z0-9]+)*)\b")


def instruction_mix(kernel: Any) -> dict[str, int]:
    """Global loads and tensor-core instructions in the kernel's SASS (``cuobjdump -sass``).

    Returns ``{"loads_128": ..., "loads_64": ..., "loads_32": ..., "loads_16": ..., "loads_8": ...,
    "async_loads": ..., "mma": ...}``: static instruction counts (not executions) of ``LDG``/``LDGSTS`` by
    access width (``LDGSTS``, the asynchronous global-to-shared copies of a pipelined loop, also counted
    in ``async_loads``) and of ``HMMA``. Wide loads are what a memory-bound kernel wants on its hot path.
    """
    text = sass(kernel)
    mix = {
        "loads_128": 0,
        "loads_64": 0,
        "loads_32": 0,
        "loads_16": 0,
        "loads_8": 0,
        "async_loads": 0,
        "mma": 0,
    }
    for op in _SASS_OP.findall(text):
        if op.startswith("HMMA"):
            mix["mma"] += 1
            continue
        parts = op.split(".")
        width = next((int(p) for p in parts if p in ("128", "64")), None)
        if width is None:
            width = (
                8 if ("U8" in parts or "S8" in parts) else 16 if ("U16" in parts or "S16" in parts) else 32
            )
        mix[f"loads_{width}"] += 1
        mix["async_loads"] += op.startswith("LDGSTS")
    return mix


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_BACK_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


def sass_loops(sass_text: str) -> list[tuple[int, Counter]]:
    """``(instructions, opcode counts)`` of each loop body in SASS text: the instructions from a backward
    branch's target to the branch, in program order (a nested loop is also counted in its outer one)."""
    code = [(int(a, 16), text) for a, text in _SASS_LINE.findall(sass_text)]
    loops = []
    for addr, text in code:
        m = _BACK_BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in code if lo <= a <= addr]
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append((len(body), ops))
    return loops


def hot_loop(kernel: Any) -> tuple[int, dict[str, int]]:
    """Instructions and opcode counts of the first loop in the kernel's SASS (``cuobjdump -sass``).

    In ``_decode_kernel`` that is the loop over quantized tiles (the full-precision tail's loop comes
    after it): one iteration per tile and warp, so ``instructions * num_warps / BLOCK_T`` is the warp
    instructions an SM issues per token and KV head (BENCHMARKS.md §6 sets it beside the H200's decode
    times). ``(0, {})`` for a kernel without a loop.
    """
    loops = sass_loops(sass(kernel))
    if not loops:
        return 0, {}
    n, ops = loops[0]
    return n, dict(ops.most_common())
