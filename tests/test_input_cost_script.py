"""benchmarks/input_cost.py: one problem's draws, step by step, on the CPU."""

from __future__ import annotations

import torch
from benchmark_scripts import load_script

from kbv.problems import bundled_suite_dir

input_cost = load_script("input_cost")


def test_every_distribution_of_a_problem_is_drawn_and_timed() -> None:
    row = input_cost.profile(bundled_suite_dir() / "level1" / "1_ReLU.py", torch.device("cpu"), repeats=1)
    assert row["problem"] == "1_ReLU" and row["input_bytes"] > 0 and row["get_inputs_s"] >= 0
    assert set(row["distributions"]) == set(input_cost.DISTRIBUTIONS)
    for entry in row["distributions"].values():
        assert set(entry) == {"draw_s", "draw_unmapped_s", "upcast_s", "checksums_s"}
        assert all(seconds >= 0 for seconds in entry.values())
    assert "kernels" not in row  # the profiler's table is for a GPU
