"""benchmarks/fidelity.py: what it keeps of each run, from a fixed record (no GPU, no workers)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script

from kbv.records import Record


def _round(device_ms: list[float], sm_clock: int) -> dict:
    return {
        "device_ms": device_ms,
        "wall_ms": [x + 0.02 for x in device_ms],
        "gpu_before": {"sm_clock_mhz": sm_clock},
    }


def test_each_run_keeps_its_per_round_medians_interval_and_clock() -> None:
    record = Record(
        problem={"name": "1_ReLU"},
        candidate={"path": "1_ReLU.py"},
        protocol={"name": "fidelity"},
        device={},
        outcome="passed",
        correct=True,
        speedup={"best": 0.95},
        timing={
            "candidate": {
                "rounds": [_round([0.30, 0.29, 0.31], 1980), _round([0.28, 0.28, 0.40], 1755)],
                "summary": {"median": 0.295, "ci95_low": 0.28, "ci95_high": 0.31, "cv": 0.1},
                "wall_summary": {"median": 0.315},
            },
            "baselines": {"eager_fp32": {"rounds": [_round([0.27, 0.28, 0.29], 1980)]}},
        },
    )
    detail = load_script("fidelity")._run_detail(record)
    assert detail["candidate_round_medians_ms"] == pytest.approx([0.30, 0.28])
    assert detail["baseline_round_medians_ms"] == {"eager_fp32": pytest.approx([0.28])}
    assert detail["sm_clock_mhz"] == [1980, 1755]
    assert detail["candidate_ci95_ms"] == [0.28, 0.31]
    assert (detail["speedup_best"], detail["candidate_wall_median_ms"]) == (0.95, 0.315)


def test_a_run_without_timing_keeps_its_outcome_and_no_figures() -> None:
    record = Record(problem={}, candidate={}, protocol={}, device={}, outcome="incorrect", correct=False)
    detail = load_script("fidelity")._run_detail(record)
    assert detail["outcome"] == "incorrect"
    assert detail["candidate_median_ms"] is None and detail["candidate_round_medians_ms"] == []


def test_the_launch_check_times_a_call_through_kbvs_recipe_over_rotating_input_sets() -> None:
    """``_ncu_target.py``'s bisecting timing: each set drawn by the problem, every call on the set
    its index names, the median of the recipe's samples returned (CPU: the wall clock)."""
    import types

    import torch

    target = load_script("_ncu_target")
    problem = types.SimpleNamespace(get_inputs=lambda: [torch.randn(8, 8)])
    seen: list[int] = []

    class Recording(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(int(x.flatten()[0].item() * 1e6))
            return torch.relu(x)

    median = target.through_recipe(Recording(), problem, 3, calls=12, device="cpu")
    assert median > 0
    timed = seen[-12:]
    assert len(set(timed)) == 3  # three distinct draws, rotated
    assert timed[:3] == timed[3:6] == timed[9:12]


def test_launch_only_writes_each_class_as_it_is_measured(tmp_path, monkeypatch) -> None:
    """``--launch-only``: one launch check per chosen class, the file rewritten after each, so a
    cut run keeps the classes it measured."""
    import json
    import types

    script = load_script("fidelity")
    seen = []

    def fake_check(problem, candidate):
        seen.append(json.loads((tmp_path / "launch.json").read_text()) if seen else {})
        return {"synced_ms": 0.3, "candidate": str(candidate.path)}

    monkeypatch.setattr(script, "_launch_check", fake_check)
    chosen = [("elementwise", "honest_cuda", "1_ReLU"), ("matmul", "honest_cuda", "25_Matmul_Square")]
    pairs = [(types.SimpleNamespace(path=f"p{i}"), types.SimpleNamespace(path=f"c{i}")) for i in range(2)]
    assert script._launch_only(chosen, pairs, tmp_path / "launch.json") == 0
    assert list(seen[1]) == ["elementwise"]  # written before the second class ran
    assert json.loads((tmp_path / "launch.json").read_text())["matmul"]["candidate"] == "c1"
