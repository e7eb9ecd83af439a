"""The service load's figures (benchmarks/service_load.py): what its rates count."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load_script

load = load_script("service_load")


def _finished(outcome: str | None, total: float = 0.0, compile_s: float = 0.0) -> dict:
    pair = (Path("/x/1_ReLU.py"), Path("/x/1_ReLU_candidate.py"))
    if outcome is None:  # kbv's harness error: the request ends without a record
        return {
            "status": "error",
            "error": "HarnessError: the GPU ran out",
            "latency_s": 1.0,
            "finished": 2.0,
            "pair": pair,
        }
    record = {"phases_s": {"total": total, "compile": compile_s}, "error": None}
    return {
        "status": "done",
        "outcome": outcome,
        "record": record,
        "latency_s": 3.0,
        "finished": 1.0,
        "pair": pair,
    }


def test_the_rate_without_compilation_counts_verdicts_and_their_time_only() -> None:
    """Two verdicts of 3 s each (1 s of it compiling) and two harness errors, which have no record
    and so no time: 2 verdicts over 4 s, 1800 an hour, not 4 over 4 s (the errors' flattering)."""
    results = [
        _finished("passed", 3.0, 1.0),
        _finished("incorrect", 3.0, 1.0),
        _finished(None),
        _finished(None),
    ]
    figures = load.work_without_compile(results)
    assert figures["verdicts"] == 2
    assert figures["evaluation_s_without_compile"] == 4.0 and figures["compile_s_total"] == 2.0
    assert figures["evaluations_per_hour_without_compile"] == 1800.0
    assert load.work_without_compile([_finished(None)])["evaluations_per_hour_without_compile"] is None


def test_each_finished_request_is_kept_as_a_row_in_the_order_it_finished() -> None:
    rows = load.result_rows([_finished(None), _finished("passed", 3.0, 1.0)])
    assert [row["outcome"] for row in rows] == ["passed", "error"]
    assert rows[0]["phases_s"] == {"total": 3.0, "compile": 1.0}
    assert rows[1]["error"].startswith("HarnessError") and rows[1]["phases_s"] == {}
