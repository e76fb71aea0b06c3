"""Run a pytest selection in several processes at once, on a machine without pytest-xdist: the device run's tests.

    python3 benchmarks/parallel_pytest.py --workers 8 --timeout-s 140 --log $OUT/cuda_tests.log -- \
        -m "not realmodel" tests/test_kernels.py -k "within_twice or meta32"

On the GPU machine nearly all of a kernel test's time is Triton compiling the kernels it launches, one after
another (session 37: 59 tests in 100 s; 136 are selected now, about 130 distinct kernel specialisations). The
machine has 16 cores and cannot install pytest-xdist, so this collects the selection once (``--collect-only``),
deals the tests out to ``--workers`` processes, all parametrisations of a test function to one worker (they share
its compiled kernels), and runs them side by side on the same GPU (correctness tests, not timings). At
``--timeout-s`` every worker still running gets SIGINT, on which pytest prints its failures and summary, and a
kill 10 s later. ``--log`` gets the collected ids, then each worker's output under a header, then one line
adding up the workers' counts, which is also printed. ``--collect-only`` stops after listing the ids.

Exit status: 0 when every worker passed (or only listed), else 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def collect(pytest_args: list[str]) -> tuple[list[str], str | None]:
    """The node ids ``pytest --collect-only -q pytest_args`` lists, and its output when it failed (a module that
    does not import: then nothing runs, as in one pytest process, and the log says why)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *pytest_args], capture_output=True, text=True, check=False)  # fmt: skip
    ids = [line.strip() for line in run.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if run.returncode not in (0, 5) or (run.returncode == 0 and not ids):  # 5: nothing collected
        return [], f"pytest --collect-only failed (exit {run.returncode}):\n{run.stdout[-4000:]}{run.stderr[-4000:]}"
    return ids, None


def deal(ids: list[str], workers: int) -> list[list[str]]:
    """``ids`` in at most ``workers`` lists, each test function's parametrisations together, the largest
    groups first to the least loaded list; each list keeps the collection order."""
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(i.split("[", 1)[0], []).append(i)
    lists: list[list[str]] = [[] for _ in range(max(1, min(workers, len(groups))))]
    for g in sorted(groups.values(), key=len, reverse=True):
        min(lists, key=len).extend(g)
    order = {i: n for n, i in enumerate(ids)}
    return [sorted(chunk, key=order.__getitem__) for chunk in lists if chunk]


def summary(outputs: list[str]) -> Counter:
    """The counts of each worker's last pytest summary line, added up."""
    total: Counter = Counter()
    for out in outputs:
        lines = [ln for ln in out.splitlines() if COUNT.search(ln) and (" in " in ln or "=" in ln)]
        if lines:
            for n, what in COUNT.findall(lines[-1]):
                total["errors" if what.startswith("error") else what] += int(n)
    return total


def _default_sigint() -> None:
    """SIGINT handled here, so that the workers start with it at its default and Python turns it into
    KeyboardInterrupt there. A job a non-interactive shell started in the background (``cmd &``) inherits SIGINT
    ignored, Python keeps it ignored, and so would the workers: they would not stop at the deadline and would be
    killed without their summaries. (A handled signal is reset to its default by ``exec``; an ignored one is not.)"""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--timeout-s", type=float, default=140.0, help="then SIGINT to every worker still running")
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--collect-only", action="store_true", help="list the selected ids in --log, run nothing")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments (files, -m, -k)")
    a = p.parse_args(argv)
    args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    t0 = time.monotonic()
    ids, failed = collect(args)
    a.log.parent.mkdir(parents=True, exist_ok=True)
    if failed:
        a.log.write_text(failed + "\n")
        print(failed.splitlines()[0])
        return 1
    with a.log.open("w") as log:
        log.write("\n".join(ids) + f"\n\n{len(ids)} tests collected\n")
    if a.collect_only or not ids:
        print(f"{len(ids)} tests collected")
        return 0
    chunks = deal(ids, a.workers)
    _default_sigint()
    # the workers' own logs in a temporary folder, not beside --log: on the device that is $OUT, which returns at
    # most 8 files; a timeout killing this script before it merges them would leave 8 more there
    tmp = Path(tempfile.mkdtemp(prefix="parallel_pytest."))
    logs = [tmp / f"{a.log.stem}.worker{n}.log" for n in range(len(chunks))]
    opts = [o for o in args if not o.endswith(".py") and "::" not in o]  # -m / -k / -p ...: the ids replace the files
    procs = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a worker killed after the SIGINT keeps what it printed
    for chunk, path in zip(chunks, logs):
        with path.open("w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                           *opts, *chunk], stdout=f, stderr=subprocess.STDOUT, env=env))  # fmt: skip
    deadline = t0 + a.timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    cut = [proc for proc in procs if proc.poll() is None]
    for proc in cut:
        proc.send_signal(signal.SIGINT)
    for proc in cut:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    outputs = [path.read_text() for path in logs]
    total = summary(outputs)
    line = (", ".join(f"{n} {what}" for what, n in sorted(total.items())) or "no summary")
    line = f"{len(chunks)} workers, {len(ids)} tests: {line}; {len(cut)} cut at {a.timeout_s:.0f} s; " \
           f"{time.monotonic() - t0:.1f} s"  # fmt: skip
    with a.log.open("a") as log:
        for n, (chunk, out, proc) in enumerate(zip(chunks, outputs, procs)):
            log.write(f"\n===== worker {n}: {len(chunk)} tests, exit {proc.returncode} =====\n{out}")
        log.write(f"\n{line}\n")
    shutil.rmtree(tmp, ignore_errors=True)
    print(line)
    return 0 if all(proc.returncode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
