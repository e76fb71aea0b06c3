"""How fast this machine's host is at what a decode step asks of it: a few lines for ``device.txt``.

    PYTHONPATH=src python benchmarks/host_speed.py [--calls 20000]

BENCHMARKS.md §6z found the end-to-end decode steps on the H200 bound by the host (a profiled step: 4.8–9.5 ms on
the device out of 50–90 ms of wall time), while ``benchmarks/host_overhead.py`` puts the same 24-layer step's
Python at 12–16 ms on the 2-core CPU of the development machines. These lines say which part of that gap is the
host itself: its CPU, CPU quota and load, the time of a Python function call, the time of one tiny torch operation
on the CPU (and of one over 65536 elements, which torch spreads over its threads), and of one launched on CUDA
(where there is one), asynchronously as a decode step launches its kernels (one sync at the end of each timed
loop). Medians of 5 loops of ``--calls`` each; a line per figure, ``name: value``.
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
    if torch.cuda.is_available():
        y = torch.zeros(1, device="cuda")
        sync = torch.cuda.synchronize
        out["torch op launched on cuda (y.add_(1), 1 element)"] = f"{us_per_call(lambda: y.add_(1), calls, sync):.2f} us"
    return out


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
