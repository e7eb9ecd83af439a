"""The honest sweep's resumption (benchmarks/reference_as_candidate.py): which problems it starts again."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_script

from kbv.evaluation.budget import GPU_TOO_SMALL, PARENT_RAN_OUT

sweep = load_script("reference_as_candidate")


def _rows(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps({"precision": "fp32", **row}) + "\n" for row in rows))
    return path


def test_a_problem_too_large_for_the_gpu_is_settled_and_a_rejection_starts_again(tmp_path: Path) -> None:
    """Settled: passed, or kbv's HarnessError of a GPU too small (the same GPU would say so again).
    Started again: a rejection, and any other harness error (a fix may have come since)."""
    too_small = f"HarnessError: {GPU_TOO_SMALL}: the other processes on it ... held 23.5 GiB"
    rows = _rows(
        tmp_path / "rows.jsonl",
        {"problem": "1_ok", "outcome": "passed"},
        {"problem": "37_big", "outcome": "harness_error", "error": too_small},
        {"problem": "98_wrong", "outcome": "incorrect", "error": ""},
        {"problem": "35_broken", "outcome": "harness_error", "error": "ImportError: no module named x"},
    )
    assert sweep._done(rows) == {"1_ok": 1, "37_big": 1, "98_wrong": 0, "35_broken": 0}
    # on a GPU with more memory the too-large problem is evaluated again
    assert sweep._done(rows, retry_too_small=True)["37_big"] == 0
    assert sweep._too_small({"outcome": "harness_error", "error": too_small})
    parent = f"HarnessError: {PARENT_RAN_OUT}: during correctness, with the candidate within its limits"
    assert sweep._too_small({"outcome": "harness_error", "error": parent})  # kbv's own copies, too
    claimed = {"outcome": "runtime_error", "error": f"{GPU_TOO_SMALL} (the candidate's own words)"}
    assert not sweep._too_small(claimed)
