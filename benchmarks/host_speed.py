"""How fast this machine's host is at what a decode step asks of it: a few lines for ``device.txt``.

    PYTHONPATH=src python benchmarks/host_speed.py [--calls 20000]

BENCHMARKS.md §6z found the end-to-end decode steps on the H200 bound by the host (a profiled step: 4.8–9.5 ms on
the device out of 50–90 ms of wall time), while ``benchmarks/host_overhead.py`` puts the same 24-layer step's
Python at 12–16 ms on the 2-core CPU of the development machines. These lines say which part of that gap is the
host itself: its CPU, CPU quota and load, the time of a Python function call, the time of one tiny torch operation
on the CPU (and of one over 65536 elements, which torch spreads over its threads), and of one launched on CUDA
(where there is one), asynchronously as a decode step launches its kernels (one sync at the end of each timed
loop), and of a trivial Triton kernel launched there (the host side of each of the fused step's two launches per
layer). Also the settings that make every launch slower, whatever the code: ``CUDA_LAUNCH_BLOCKING`` (each launch
waits for its kernel), torch's CUDA sync debug mode, autograd anomaly detection, and the other ``CUDA_*`` /
``PYTORCH_*`` / ``TORCH_*`` / ``TRITON_*`` variables set. Medians of 5 loops of ``--calls`` each; a line per figure,
``name: value``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable


def cpu_quota() -> str:
    """The cgroup's CPU limit (``/sys/fs/cgroup/cpu.max``: quota and period in microseconds, ``max`` = none), or
    ``n/a``: a container granted fewer CPUs than it sees runs torch's default thread count over fewer cores."""
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                return f"{f.read().strip()} ({path})"
        except OSError:
            continue
    return "n/a"


def us_per_call(fn: Callable[[], object], calls: int, sync: Callable[[], object] = lambda: None) -> float:
    """Median microseconds per call of ``fn`` over 5 loops of ``calls`` calls, ``sync()`` closing each loop."""
    fn()
    sync()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(loops)


def measure(calls: int = 20000) -> dict[str, str]:
    import torch

    from kvbits.evaluate.speed import cpu_name

    def noop() -> None:
        return None

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    out = {
        "host cpu": cpu_name(),
        "host cores": f"{os.cpu_count()} ({affinity} usable), torch threads {torch.get_num_threads()}",
        "host cpu quota": cpu_quota(),
        "host load average (1, 5, 15 min)": load,
        "python function call": f"{us_per_call(noop, calls):.3f} us",
    }
    x, big = torch.zeros(1), torch.zeros(1 << 16)
    out["torch op on the cpu (x.add_(1), 1 element)"] = f"{us_per_call(lambda: x.add_(1), calls):.2f} us"
    out["torch op on the cpu (x.add_(1), 65536 elements, torch's threads)"] = (
        f"{us_per_call(lambda: big.add_(1), max(1, calls // 10)):.2f} us"
    )
    out["launch settings"] = launch_settings()
    if torch.cuda.is_available():
        y = torch.zeros(1, device="cuda")
        sync = torch.cuda.synchronize
        out["torch op launched on cuda (y.add_(1), 1 element)"] = f"{us_per_call(lambda: y.add_(1), calls, sync):.2f} us"
        out["triton launch on cuda (a 1-element kernel, 2 arguments)"] = triton_launch_us(y, max(1, calls // 4), sync)
    return out


def launch_settings() -> str:
    """What in this process slows every launch: the variables that steer CUDA, torch and Triton, torch's sync debug
    mode and anomaly detection (``none set`` when nothing is)."""
    import torch

    prefixes = ("CUDA_", "PYTORCH_", "TORCH_", "TRITON_")
    found = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(prefixes)]
    if torch.cuda.is_available() and torch.cuda.get_sync_debug_mode():
        found.append(f"torch.cuda sync debug mode {torch.cuda.get_sync_debug_mode()}")
    if torch.is_anomaly_enabled():
        found.append("autograd anomaly detection on")
    return ", ".join(found) or "none set"


def triton_launch_us(y: object, calls: int, sync: Callable[[], object]) -> str:
    """Microseconds per launch of a trivial Triton kernel on ``y`` (CUDA), or why it could not be timed."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        return f"n/a (Triton: {exc})"

    @triton.jit
    def _bump(Y, n):
        tl.store(Y, tl.load(Y) + n)

    try:
        return f"{us_per_call(lambda: _bump[(1,)](y, 1), calls, sync):.2f} us"
    except Exception as exc:  # noqa: BLE001 - a diagnostic line: say why, the run goes on
        return f"n/a ({type(exc).__name__}: {str(exc)[:120]})"


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000, help="calls per timed loop (5 loops)")
    a = p.parse_args(argv)
    out = measure(max(1, a.calls))
    for name, value in out.items():
        print(f"{name}: {value}")
    return out


if __name__ == "__main__":
    main()
