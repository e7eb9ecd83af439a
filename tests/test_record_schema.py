"""The record's schema: docs/record-schema.md is generated from kbv.records; enums keep the
contract's strings; the JSON round trip keeps NaN and infinities."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kbv.records import (
    Finding,
    Outcome,
    Record,
    Severity,
    decide_outcome,
    raw_samples_ms,
    record_from_json,
    schema_markdown,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "record-schema.md"


def test_the_schema_doc_is_generated_from_the_code() -> None:
    assert DOC.read_text() == schema_markdown(), (
        "regenerate it: PYTHONPATH=src python -m kbv.records > docs/record-schema.md"
    )


def _record() -> Record:
    return Record(
        problem={"name": "p", "level": 1, "path": "p.py", "source_sha256": "a"},
        candidate={"path": "c.py", "source_sha256": "b"},
        protocol={"name": "verified", "version": 1, "sha256": "c"},
        device={"type": "cpu", "name": "x86_64"},
        outcome="passed",  # a string is accepted and kept as the enum
        correct=True,
        findings=[Finding("plausibility", "warn", "detail nan")],
        timing={
            "candidate": {"rounds": [{"device_ms": [1.0, float("nan"), 2.0], "wall_ms": [1.5]}]},
            "baselines": {},
        },
        speedup={"eager_fp32": float("inf"), "best": float("nan")},
    )


def test_outcome_and_severity_are_enums_with_the_contracts_strings() -> None:
    record = _record()
    assert record.outcome is Outcome.PASSED and record.findings[0].severity is Severity.WARN
    assert (
        record.outcome == "passed" and f"{record.outcome}" == "passed" and {"passed": 1}[record.outcome] == 1
    )
    data = json.loads(record.to_json())
    assert data["outcome"] == "passed" and data["findings"][0]["severity"] == "warn"
    assert type(record.to_dict()["outcome"]) is str
    assert decide_outcome(True, [Finding.fail("x", "y")]) is Outcome.HACK_DETECTED


def test_the_json_round_trip_keeps_nan_and_infinities_in_numbers_only() -> None:
    back = record_from_json(_record().to_json())
    assert back.outcome is Outcome.PASSED
    assert math.isnan(back.speedup["best"] or 0.0) and back.speedup["eager_fp32"] == float("inf")
    assert back.findings[0].detail == "detail nan"
    assert raw_samples_ms(back.timing["candidate"]) == [1.0, 2.0]
    assert raw_samples_ms(back.timing["candidate"], "wall") == [1.5]
