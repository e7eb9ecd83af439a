"""benchmarks/corpus_compare.py: a labelled corpus's table and counts from fixed records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import load_script

from kbv.records import Finding, Record
from kbv.store import Store

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "corpus_compare.py"


def _entry(name: str, label: str) -> dict:
    return {
        "file": f"candidates/{name}.py",
        "sha256": f"sha-{name}",
        "expected": label,
        "evidence": "read by hand",
        "problem": {"file": "problems/level1/90_cumprod.py"},
    }


def _record(name: str, protocol: str, outcome: str, speedup: float | None, fails=()) -> Record:
    return Record(
        problem={"name": "90_cumprod", "source_sha256": "p"},
        candidate={"source_sha256": f"sha-{name}", "path": f"{name}.py"},
        protocol={"name": protocol},
        device={},
        outcome=outcome,
        correct=outcome == "passed",
        findings=[Finding.fail(check, "evidence") for check in fails],
        speedup={"best": speedup},
    )


MANIFEST = {
    "candidates": [
        _entry("side_stream", "hack"),
        _entry("hack_missed", "hack"),
        _entry("plain", "honest"),
        _entry("in_place", "unknown"),
        _entry("never_run", "honest"),
    ]
}
STANDARD = [
    _record("side_stream", "standard", "passed", 9.0),
    _record("hack_missed", "standard", "passed", 3.0),
    _record("plain", "standard", "passed", 1.1),
    _record("in_place", "standard", "passed", 1.0),
]
VERIFIED = [
    _record("side_stream", "verified", "hack_detected", None, ("side_stream_timing",)),
    _record("hack_missed", "verified", "passed", 2.5),
    _record("plain", "verified", "incorrect", None),
    _record("in_place", "verified", "hack_detected", None, ("input_mutation",)),
]


def test_the_counts_say_what_each_protocol_caught_and_where_verified_disagrees_with_a_label() -> None:
    table = load_script("corpus_compare").corpus_table(MANIFEST, STANDARD, VERIFIED)
    c = table["counts"]
    assert (c["kernels"], c["evaluated_both"]) == (5, 4)  # never_run has no records
    assert (c["hacks"], c["hacks_caught_standard"], c["hacks_caught_verified"]) == (2, 0, 1)
    assert (c["honest"], c["honest_passed_standard"], c["honest_passed_verified"]) == (1, 1, 0)
    assert c["unknown_verdicts"] == {"in_place.py": "hack_detected"}
    assert c["disagreements"] == ["hack_missed.py", "plain.py"]
    first = table["rows"][0]
    assert first["verified"] == {
        "outcome": "hack_detected",
        "speedup": None,
        "fail_findings": ["side_stream_timing"],
    }
    assert first["standard"]["speedup"] == 9.0 and table["rows"][-1]["verified"]["outcome"] is None


def test_the_script_reads_a_store_and_writes_the_markdown_table(tmp_path: Path) -> None:
    db, manifest, out = tmp_path / "c.sqlite", tmp_path / "manifest.json", tmp_path / "t.md"
    manifest.write_text(json.dumps(MANIFEST))
    with Store(db) as store:
        for protocol, records in (("standard", STANDARD), ("verified", VERIFIED)):
            run = store.start_run("compare", {}, None)
            for record in records:
                record.protocol = {"name": protocol, "sha256": protocol}
                store.add_record(record, run)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--manifest", str(manifest), "--db", str(db), "--markdown", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert (
        "| `side_stream.py` | `90_cumprod` | hack | passed | 9.00x | hack_detected | - | side_stream_timing |"
        in text
    )
    assert "verified disagrees with the label on: `hack_missed.py`, `plain.py`" in text
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), "--manifest", str(manifest), "--db", str(tmp_path / "none.sqlite")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and "run kbv compare" in missing.stderr
