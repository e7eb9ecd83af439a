"""The SQLite results store: round trips, resume keys, export/import, migration."""

from __future__ import annotations

import csv
import json
import math
import sqlite3
from pathlib import Path

import pytest
from test_metrics import HACK, make_record, sha

from kbv.protocol import VERIFIED
from kbv.records import DistributionResult, record_from_json
from kbv.store import SCHEMA_VERSION, Store, StoreError, record_key


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "results" / "kbv.sqlite") as s:
        yield s


def test_fresh_store_has_current_schema_and_wal(tmp_path: Path, store: Store) -> None:
    assert store.schema_version == SCHEMA_VERSION == 3
    assert store.path.exists()
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_round_trip(store: Store, tmp_path: Path) -> None:
    source = tmp_path / "cand.py"
    source.write_text("class ModelNew: pass\n")
    timing = {
        "candidate": {"samples_ms": [1.0, 1.5, float("nan")], "median_ms": 1.25},
        "baselines": {"eager_fp32": {"samples_ms": [3.0, 3.5]}},
    }
    record = make_record(
        candidate=source.read_text(),
        path=str(source),
        timing=timing,
        findings=[HACK],
        outcome="hack_detected",
        memory=(10, 20),
        distributions=[
            DistributionResult("wide", True, False, max_abs_err=float("inf"), rel_err=float("nan"))
        ],
    )
    run = store.start_run("run", {"problems": "p/"}, protocol=VERIFIED)
    rid = store.add_record(record, run, label="gpt-x")
    store.finish_run(run)

    (back,) = store.records()
    assert back.candidate["label"] == "gpt-x"
    assert back.outcome == "hack_detected" and back.findings == [HACK]
    assert math.isnan(back.timing["candidate"]["samples_ms"][2])
    assert back.distributions[0].max_abs_err == float("inf")
    assert math.isnan(back.distributions[0].rel_err)
    assert back.memory["candidate_peak_bytes"] == 20
    assert store.timing_samples(rid) == {"candidate": [1.0, 1.5], "eager_fp32": [3.0, 3.5]}
    assert store.candidate_source(sha(source.read_text())) == "class ModelNew: pass\n"
    assert store.findings(severity="fail")[0]["check_name"] == "timing_tamper"
    assert store.protocol_settings(VERIFIED.sha256())["name"] == "verified"
    (run_row,) = store.runs()
    assert run_row["status"] == "finished" and run_row["args"] == {"problems": "p/"}
    assert run_row["protocol_sha"] == VERIFIED.sha256()


def test_source_not_read_when_hash_differs(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "cand.py"
    path.write_text("changed since the evaluation")
    store.add_record(make_record(candidate="original", path=str(path)))
    assert store.candidate_source(sha("original")) is None


def test_filters_and_latest(store: Store) -> None:
    run1 = store.start_run("run")
    store.add_record(make_record("p1", "a", outcome="incorrect"), run1, label="m1")
    store.add_record(make_record("p1", "a", protocol="standard"), run1, label="m1")
    run2 = store.start_run("run", {"force": True})
    store.add_record(make_record("p1", "a"), run2, label="m1")
    store.add_record(make_record("p2", "b"), run2, label="m2")

    assert len(store.records()) == 4
    assert len(store.records(run_id=run1)) == 2
    assert [r.problem["name"] for r in store.records(label="m2")] == ["p2"]
    assert len(store.records(protocol="standard")) == 1
    assert len(store.records(protocol=sha("standard"))) == 1
    latest = store.records(protocol="verified", latest=True)
    assert [(r.problem["name"], r.outcome) for r in latest] == [("p1", "passed"), ("p2", "passed")]
    assert store.last_run()["id"] == run2
    assert store.last_run(status="running")["id"] == run2


def test_has_record_and_pending(store: Store) -> None:
    record = make_record()
    key = record_key(record)
    assert len(key) == 7 and key[3] == "NVIDIA H200" and key[4] == "0.1.0" and key[5] == "2.11.0"
    assert key.candidate_path == record.candidate["path"]
    assert not store.has_record(key)
    store.add_record(record)
    assert store.has_record(key) and store.has_record(record)
    other_device = make_record(device="NVIDIA A100")
    other_torch = make_record()
    other_torch.versions["torch"] = "2.12.0"
    assert not store.has_record(other_device)
    assert store.pending([key, record_key(other_device), record_key(other_torch)]) == [
        record_key(other_device),
        record_key(other_torch),
    ]


def test_export_import_jsonl_round_trip(store: Store, tmp_path: Path) -> None:
    records = [
        make_record("p1", "a", speedup=float("nan")),
        make_record("p2", "b", outcome="hack_detected", findings=[HACK], label="m2"),
    ]
    for r in records:
        store.add_record(r)
    out = tmp_path / "out" / "records.jsonl"
    assert store.export_jsonl(out) == 2
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["speedup"]["best"] == "nan"

    with Store(tmp_path / "other.sqlite") as other:
        assert other.import_jsonl(out) == (2, 0)
        assert other.import_jsonl(out) == (0, 2)  # already there: skipped
        assert other.import_jsonl(out, force=True) == (2, 0)
        back = other.records(run_id=other.runs()[0]["id"])
        assert [r.to_json() for r in back] == [r.to_json() for r in store.records()]
        assert math.isnan(back[0].speedup["best"])
        assert back[1].candidate["label"] == "m2"
        assert [run["command"] for run in other.runs()] == ["import"] * 3


def test_import_rejects_garbage(store: Store, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(make_record().to_json() + "\n{not json\n")
    with pytest.raises(StoreError, match="bad.jsonl:2"):
        store.import_jsonl(bad)
    assert store.runs()[-1]["status"] == "failed"


def test_export_csv(store: Store, tmp_path: Path) -> None:
    store.add_record(make_record("p1", "a", speedups={"eager_fp32": 3.0}, memory=(5, 6)), label="m1")
    store.add_record(
        make_record("p2", "b", outcome="hack_detected", findings=[HACK], speedup=None), label="m2"
    )
    out = tmp_path / "records.csv"
    assert store.export_csv(out) == 2
    rows = list(csv.DictReader(out.open()))
    assert rows[0]["label"] == "m1" and rows[0]["speedup_eager_fp32"] == "3.0"
    assert rows[0]["baseline_peak_bytes"] == "5" and rows[0]["speedup_best"] == "2.0"
    assert rows[1]["fail_checks"] == "timing_tamper" and rows[1]["speedup_best"] == ""


def test_record_from_json_leaves_text_fields_alone() -> None:
    record = make_record(distributions=[DistributionResult("original", True, True, note="nan")])
    back = record_from_json(record.to_json())
    assert back.distributions[0].note == "nan"


V1_SCHEMA = """
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started_at TEXT NOT NULL, finished_at TEXT,
    command TEXT NOT NULL, args TEXT NOT NULL DEFAULT '{}', protocol_sha TEXT, status TEXT NOT NULL DEFAULT 'running');
CREATE TABLE problems (sha TEXT PRIMARY KEY, name TEXT, level INTEGER, path TEXT);
CREATE TABLE candidates (sha TEXT PRIMARY KEY, path TEXT, source TEXT, label TEXT);
CREATE TABLE protocols (sha TEXT PRIMARY KEY, name TEXT, version INTEGER, settings TEXT);
CREATE TABLE records (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id),
    problem_sha TEXT NOT NULL, candidate_sha TEXT NOT NULL, protocol_sha TEXT NOT NULL, protocol_name TEXT,
    device_name TEXT NOT NULL, kbv_version TEXT NOT NULL, torch_version TEXT NOT NULL, outcome TEXT NOT NULL,
    correct INTEGER NOT NULL, speedup_best REAL, label TEXT, created_at TEXT, json TEXT NOT NULL);
CREATE INDEX records_run ON records(run_id);
CREATE TABLE timing_samples (record_id INTEGER NOT NULL REFERENCES records(id) ON DELETE CASCADE,
    which TEXT NOT NULL, sample_index INTEGER NOT NULL, ms REAL NOT NULL);
CREATE TABLE findings (record_id INTEGER NOT NULL REFERENCES records(id) ON DELETE CASCADE,
    check_name TEXT NOT NULL, severity TEXT NOT NULL, detail TEXT);
CREATE INDEX findings_record ON findings(record_id);
PRAGMA user_version = 1;
"""  # noqa: E501 (the version-1 schema, verbatim)


def test_migrates_version_1_file(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    record = make_record(level=3)
    key = record_key(record)
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.execute(
        "INSERT INTO records(problem_sha, candidate_sha, protocol_sha, protocol_name, device_name, "
        "kbv_version,"
        " torch_version, outcome, correct, speedup_best, label, json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (*key[:3], "verified", *key[3:6], "passed", 1, 2.0, "old", record.to_json()),
    )
    conn.commit()
    conn.close()

    with Store(path) as store:
        assert store.schema_version == 3
        assert store.has_record(key)
        assert store.records()[0].problem["level"] == 3
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT level FROM records").fetchone()[0] == 3
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"records_key", "records_label", "timing_record"} <= indexes
        conn.close()
        store.add_record(make_record("p9", level=2))
        assert len(store.records()) == 2
    with Store(path) as again:  # reopening a current file is a no-op
        assert again.schema_version == 3


def test_refuses_newer_and_foreign_files(tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite"
    sqlite3.connect(newer).execute("PRAGMA user_version = 99").connection.close()
    with pytest.raises(StoreError, match="upgrade kbv"):
        Store(newer)
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE stuff (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="not a kbv store"):
        Store(foreign)
    text = tmp_path / "text.sqlite"
    text.write_text("hello, this is not a database at all" * 100)
    with pytest.raises(StoreError, match="not a kbv results database"):
        Store(text)


def test_failed_write_rolls_back(store: Store) -> None:
    record = make_record(speedups={"eager_fp32": object()})  # fails at to_json, mid-transaction
    with pytest.raises(TypeError):
        store.add_record(record)
    assert store.records() == []
    conn = sqlite3.connect(store.path)
    assert conn.execute("SELECT count(*) FROM problems").fetchone()[0] == 0
    conn.close()
    assert store.add_record(make_record()) > 0


def test_timing_samples_from_pipeline_rounds(store: Store) -> None:
    rounds = [{"device_ms": [1.0, 2.0], "wall_ms": [1.5, 2.5]}, {"device_ms": [3.0], "wall_ms": [3.5]}]
    timing = {
        "recipe": "flush-rotate-events-median",
        "candidate": {"rounds": rounds, "summary": {"n": 3, "median": 2.0}},
        "baselines": {"eager_fp32": {"rounds": [{"device_ms": [4.0], "wall_ms": ["nan"]}], "summary": {}}},
    }
    rid = store.add_record(make_record(timing=timing))
    assert store.timing_samples(rid) == {
        "candidate": [1.0, 2.0, 3.0],
        "candidate:wall": [1.5, 2.5, 3.5],
        "eager_fp32": [4.0],
    }
