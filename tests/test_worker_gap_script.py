"""benchmarks/worker_gap.py: its in-worker timing on the CPU (the same requests an evaluation sends)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from benchmark_scripts import load_script

from kbv.candidates import load_candidate
from kbv.problems import load_problem

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def pair_and_protocol(tmp_path):
    script = load_script("worker_gap")
    fidelity = load_script("fidelity")
    problem = load_problem(FIXTURES / "problems" / "tiny_linear_relu.py")
    candidate = load_candidate(FIXTURES / "candidates" / "honest" / "linear_relu_fused.py")
    return script, problem, candidate, fidelity.fidelity_protocol()


def test_time_only_workers_time_both_roles_and_say_how_they_started(pair_and_protocol) -> None:
    script, problem, candidate, protocol = pair_and_protocol
    forked = script._worker_time_only(problem, candidate, protocol, 5, device="cpu")
    assert forked["eager_ms"] > 0 and forked["candidate_ms"] > 0
    fresh = script._fork_server_off(
        lambda: script._worker_time_only(problem, candidate, protocol, 5, device="cpu")
    )()
    assert fresh["reference_started_as"].startswith("fresh interpreter")
    assert fresh["candidate_started_as"].startswith("fresh interpreter")
    assert "KBV_FORK_SERVER" not in os.environ  # put back for the evaluations after it


def test_the_recipe_times_the_input_sets_it_is_given() -> None:
    import torch

    target = load_script("_ncu_target")
    given = [[torch.full((4,), 2.0)]]
    seen: list[float] = []

    class Recording(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(float(x[0]))
            return x

    never = type("NoDraws", (), {"get_inputs": staticmethod(lambda: pytest.fail("drew inputs"))})
    assert target.through_recipe(Recording(), never, 3, calls=4, device="cpu", input_sets=given) > 0
    assert set(seen) == {2.0}


def test_history_times_both_roles_after_every_stage_in_the_same_two_workers(pair_and_protocol) -> None:
    script, problem, candidate, protocol = pair_and_protocol
    lines = script._worker_history(problem, candidate, protocol, 5, device="cpu")
    assert [line["stage"] for line in lines] == list(script.HISTORY_STAGES)
    assert all(line["candidate_ms"] > 0 and line["eager_ms"] > 0 for line in lines)
