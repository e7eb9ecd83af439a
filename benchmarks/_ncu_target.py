"""Runs one candidate's forward call inside a profiler range, for Nsight Compute to time.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python benchmarks/_ncu_target.py PROBLEM.py CANDIDATE.py

With ``--launch-check N`` it runs no profiler range and prints one JSON line instead: the median of
N calls timed by CUDA events two ways, each after an L2 flush:
- ``synced_ms``: the device synchronised before the start event, as kbv's recipe does, so the
  call's host path (Python, the binding, allocation, launch) runs inside the timed region;
- ``covered_ms``: a spin kernel (``torch.cuda._sleep``) queued before the start event, long enough
  for the host to queue the call behind it, so the events hold only the call's device work.
Their difference is the host launch path that kbv's event samples include (fidelity.py). Two more
medians time the same call through kbv's own recipe (``kbv.child.timing.measure`` with its L2 flush,
each call's output kept as the worker keeps it), with one input set and with three: on the H200
(2026-12-02, benchmarks/results/2026-12-02-h200-fidelity-and-demo/) an evaluation's samples ran
23-29 us above ``synced_ms`` for two kernels, and these say
whether the recipe itself or the rotation of input sets adds it (``recipe_1set_ms``,
``recipe_3sets_ms``).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import torch

from kbv.problems import load_module

#: Spin cycles queued before the start event in the covered timing: about 0.5 ms at the H200's
#: 1.98 GHz, far more than a forward's host path (tens of microseconds).
COVER_CYCLES = 1_000_000


def _load(problem_path: str, candidate_path: str):
    problem = load_module(problem_path)
    spec = importlib.util.spec_from_file_location("ncu_candidate", candidate_path)
    assert spec and spec.loader
    candidate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(candidate)
    torch.manual_seed(0)
    model = candidate.ModelNew(*problem.get_init_inputs()).cuda().eval()
    with torch.device("cuda"):
        inputs = problem.get_inputs()
    return problem, model, inputs


def profile_one_call(problem_path: str, candidate_path: str) -> None:
    _, model, inputs = _load(problem_path, candidate_path)
    with torch.no_grad():
        for _ in range(3):
            model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def launch_check(problem_path: str, candidate_path: str, calls: int) -> dict[str, float]:
    problem, model, inputs = _load(problem_path, candidate_path)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    scratch = torch.empty(2 * l2 // 4, dtype=torch.float32, device="cuda")
    timed = {"synced_ms": [], "covered_ms": []}
    with torch.no_grad():
        for _ in range(10):
            model(*inputs)
        for _ in range(calls):
            for way in timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                scratch.fill_(1.0)
                torch.cuda.synchronize()
                if way == "covered_ms":
                    torch.cuda._sleep(COVER_CYCLES)
                start.record()
                model(*inputs)
                end.record()
                torch.cuda.synchronize()
                timed[way].append(start.elapsed_time(end))
    result = {way: statistics.median(samples) for way, samples in timed.items()}
    result["launch_path_ms"] = result["synced_ms"] - result["covered_ms"]
    for name, sets in (("recipe_1set_ms", 1), ("recipe_3sets_ms", 3)):
        result[name] = through_recipe(model, problem, sets, calls)
    return result


def through_recipe(
    model, problem, n_sets: int, calls: int, device: str = "cuda", input_sets: list | None = None
) -> float:
    """The median of ``calls`` samples of kbv's recipe over ``n_sets`` input sets, drawn as the
    problem draws them (or ``input_sets`` as given), each call's output kept until its set comes
    round again (as the worker's ``_time`` does)."""
    from kbv.child import timing as kbv_timing
    from kbv.protocol import TimingSettings

    if input_sets is None:
        input_sets = []
        for seed in range(n_sets):
            torch.manual_seed(seed)
            with torch.device(device):
                input_sets.append(problem.get_inputs())
    n_sets = len(input_sets)
    last: list = [None] * n_sets

    def call(k: int) -> None:
        last[k] = model(*input_sets[k])

    settings = TimingSettings(
        repeats=calls, warmup_calls=10, max_seconds=60.0, l2_flush=True, input_sets=n_sets
    )
    with torch.no_grad():
        measurement = kbv_timing.measure(
            call,
            settings=settings,
            n_input_sets=n_sets,
            timer=kbv_timing.make_timer(device),
            flush=kbv_timing.make_l2_flush(device),
        )
    return statistics.median(measurement.device_ms)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[3] == "--launch-check":
        print(json.dumps(launch_check(sys.argv[1], sys.argv[2], int(sys.argv[4]))), flush=True)
    else:
        profile_one_call(sys.argv[1], sys.argv[2])
