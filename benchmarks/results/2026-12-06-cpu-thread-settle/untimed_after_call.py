"""What a thread pool started per call leaves after it returns, on the CPU: the share of calls that
return with more threads alive than they started with, the per-call sample, and the cost of the same
untimed work after each call (a 64 x 64 matmul), against torch.relu; each with the call's end
waiting until the process's thread count is back to where it started (settle, at most 50 ms: what
kbv's CPU timer did at 83f4e8f, reverted in b50cc4d) and without. Run from the repository root:
    python benchmarks/results/2026-12-06-cpu-thread-settle/untimed_after_call.py [REPS]
"""

import importlib.util
import os
import statistics
import sys
import time

import torch

FIXTURE = "tests/fixtures/candidates/honest/relu_thread_pool.py"
CALLS = 200
SETTLE_LIMIT_S = 0.05


def threads() -> int:
    with open("/proc/self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[17])


def wait_for_threads(before: int, end: float) -> float:
    """Wait until the call's extra threads have gone (at most SETTLE_LIMIT_S after ``end``); the new end."""
    while time.perf_counter() - end < SETTLE_LIMIT_S and threads() > before:
        os.sched_yield()
    return time.perf_counter()


def _pool() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("pool", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModelNew()


def batch(fn, x: torch.Tensor, settle: bool) -> tuple[float, float, float]:
    samples, grown, started = [], 0, time.perf_counter()
    for _ in range(CALLS):
        before = threads()
        t0 = time.perf_counter()
        fn(x)
        t1 = time.perf_counter()  # stamped before the count is read, as the timer did
        left = threads() > before
        grown += left
        if settle and left:
            t1 = wait_for_threads(before, t1)
        samples.append((t1 - t0) * 1e3)
        torch.randn(64, 64) @ torch.randn(64, 64)  # the same untimed work after every call
    untimed = (time.perf_counter() - started) * 1e3 - sum(samples)
    return untimed / CALLS, statistics.median(samples), grown / CALLS


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    pool, x = _pool(), torch.randn(16, 16384)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} OpenMP threads, {CALLS} calls a batch")
    for rep in range(reps):
        for name, fn in (("pool", pool), ("torch.relu", torch.relu)):
            for settle in (False, True):
                untimed, median, grown = batch(fn, x, settle)
                print(
                    f"rep {rep} {name:10s} settle={settle!s:5s} untimed {untimed:.3f} ms/call, "
                    f"median sample {median:.3f} ms, returned with more threads {grown:.0%}"
                )


if __name__ == "__main__":
    main()
