"""benchmarks/request_trace.py: the per-evaluation summary of its recorded events."""

from __future__ import annotations

from benchmark_scripts import load_script

trace = load_script("request_trace")


def test_the_summary_adds_up_requests_by_role_operation_and_precision_and_the_parents_own_work() -> None:
    events = [
        {
            "what": "request",
            "role": "reference",
            "op": "expected",
            "precision": "tf32",
            "wall_s": 0.5,
            "worker_s": 0.4,
            "steps_s": {"inputs": 0.1, "forward_fp64": 0.2},
        },
        {
            "what": "request",
            "role": "reference",
            "op": "expected",
            "precision": "tf32",
            "wall_s": 0.25,
            "worker_s": 0.2,
            "steps_s": {"inputs": 0.05},
        },
        {
            "what": "request",
            "role": "candidate",
            "op": "time",
            "precision": "native",
            "wall_s": 1.0,
            "worker_s": 0.9,
            "steps_s": None,
        },
        {
            "what": "request",
            "role": "candidate",
            "op": "build",
            "precision": None,
            "wall_s": 0.1,
            "worker_s": None,
        },
        {"what": "parent", "op": "receive_outputs", "role": "candidate", "wall_s": 0.03},
        {"what": "parent", "op": "compare_error_model", "role": None, "wall_s": 0.02},
    ]
    assert trace.summarise(events) == {
        "parent compare_error_model": 0.02,
        "parent receive_outputs:candidate": 0.03,
        "step reference:forward_fp64": 0.2,
        "step reference:inputs": 0.15,
        "wall candidate:build": 0.1,
        "wall candidate:time:native": 1.0,
        "wall reference:expected:tf32": 0.75,
        "worker candidate:build": 0.0,
        "worker candidate:time:native": 0.9,
        "worker reference:expected:tf32": 0.6,
    }
