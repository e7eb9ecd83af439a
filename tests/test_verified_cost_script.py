"""benchmarks/verified_cost.py: the KernelBench report's ratios."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_script

cost = load_script("verified_cost")


def _row(protocol: str, problem: str, total: float, compile_s: float = 0.0) -> dict:
    return {
        "kind": "row",
        "protocol": protocol,
        "problem": problem,
        "outcome": "passed",
        "phases_s": {"total": total, "compile": compile_s},
        "bytes": 1,
    }


def test_the_report_gives_the_ratio_of_the_medians_and_the_median_of_the_ratios(tmp_path: Path) -> None:
    """Two groups of `verified` times: the ratio of the medians falls between them, the per-problem
    ratios do not move with it. Compilation is left out of both, and a problem timed under one
    protocol only (a harness error under the other) is in neither ratio."""
    rows = [
        _row("standard", "a", 1.0),
        _row("verified", "a", 2.0, compile_s=0.5),
        _row("standard", "b", 1.0),
        _row("verified", "b", 2.0),
        _row("standard", "c", 2.0),
        _row("verified", "c", 4.0),
        _row("standard", "d", 2.0),
        _row("verified", "d", 5.0),
        _row("standard", "only", 1.0),
    ]
    batches = [
        {
            "kind": "batch",
            "protocol": p,
            "wall_s": 10.0,
            "compile_s": 0.0,
            "candidates": 4,
            "peak_rss_bytes": 1,
            "errors": [["only x candidate.py", "the GPU ran out of memory ..."]] if p == "verified" else [],
        }
        for p in ("standard", "verified")
    ]
    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + batches))
    report = cost.kernelbench_report(results, tmp_path / "report.json")
    assert report["protocols"]["verified"]["median_s"] == 3.0  # (2.0 + 4.0) / 2, compile left out of a
    # on a, b, c, d: 3.0 over 1.5; over every `standard` row (1.0 with "only") it would read 3.0
    assert report["verified_over_standard"] == 3.0 / 1.5
    assert report["protocols"]["standard"]["median_s"] == 1.0
    assert (
        report["protocols"]["verified"]["harness_errors"]
        and not report["protocols"]["standard"]["harness_errors"]
    )
    assert report["per_problem_ratio"] == {"problems": 4, "median": 2.0, "p95": 2.5}
    assert json.loads((tmp_path / "report.json").read_text())["per_problem_ratio"]["median"] == 2.0


def test_the_report_gives_the_parents_largest_gpu_reservation_per_phase_and_where() -> None:
    rows = [
        {**_row("verified", "a", 2.0), "parent_peak_bytes": {"correctness": 3 << 30, "probe:cache": 1 << 30}},
        {**_row("verified", "b", 2.0), "parent_peak_bytes": {"correctness": 2 << 30, "probe:cache": 5 << 30}},
        _row("verified", "older", 2.0),  # a row from before the figure: counts for nothing
    ]
    assert cost.parent_peak_by_phase(rows) == {
        "correctness": {"bytes": 3 << 30, "gib": 3.0, "problem": "a"},
        "probe:cache": {"bytes": 5 << 30, "gib": 5.0, "problem": "b"},
    }
    assert cost.parent_peak_by_phase([_row("standard", "a", 1.0)]) == {}
