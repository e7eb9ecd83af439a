"""Runs one candidate's forward call inside a profiler range, for Nsight Compute to time.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python benchmarks/_ncu_target.py PROBLEM.py CANDIDATE.py
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from kbv.problems import load_module


def main(problem_path: str, candidate_path: str) -> None:
    problem = load_module(problem_path)
    spec = importlib.util.spec_from_file_location("ncu_candidate", candidate_path)
    assert spec and spec.loader
    candidate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(candidate)
    torch.manual_seed(0)
    model = candidate.ModelNew(*problem.get_init_inputs()).cuda().eval()
    with torch.device("cuda"):
        inputs = problem.get_inputs()
    with torch.no_grad():
        for _ in range(3):
            model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
