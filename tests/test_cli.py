"""The command line: exit statuses, one-line usage errors, --json, batches that resume after kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FOUNDATION, RELU, SUITE


def kbv(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kbv.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize(
    "args",
    [
        ("eval", "/no/such/problem.py", str(FOUNDATION / "relu_plain.py")),
        ("eval", str(RELU), "/no/such/candidate.py"),
        ("eval", str(RELU), str(FOUNDATION / "relu_plain.py"), "--protocol", "fastest"),
        ("eval", str(RELU)),
        ("run", "--problems", str(SUITE)),
        ("no-such-command",),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...]) -> None:
    done = kbv(*args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("kbv: error:")
    assert done.stdout == ""


def test_eval_json_prints_exactly_one_record(tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    done = kbv("eval", str(RELU), str(FOUNDATION / "relu_plain.py"), "--protocol", "standard", "--device", "cpu", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    for field in ("schema_version", "problem", "candidate", "protocol", "device", "outcome", "correct", "distributions", "findings", "timing", "speedup", "memory", "seeds", "versions"):
        assert field in record
    assert record["outcome"] == "passed"
    assert json.loads(out.read_text().strip()) == record


def test_eval_human_summary_names_failed_distributions() -> None:
    done = kbv("eval", str(SUITE / "level1" / "1_ReLU.py"), str(FOUNDATION.parent / "verified" / "relu_identity.py"), "--device", "cpu")
    assert done.returncode == 0
    assert "incorrect" in done.stdout and "FAIL" in done.stdout and "signed" in done.stdout


def test_problems_list_shows_the_bundled_suite() -> None:
    done = kbv("problems", "list")
    assert done.returncode == 0 and "1_ReLU" in done.stdout and "3_AttentionBlock" in done.stdout


def _candidates(directory: Path, n: int) -> Path:
    directory.mkdir()
    for s in range(n):
        text = (FOUNDATION / "relu_plain.py").read_text() + f"\n# sample {s}\n"
        (directory / f"level_1_problem_1_sample_{s}_kernel.py").write_text(text)
    return directory


def _stored(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("SELECT count(*) FROM records").fetchone()[0])
        except sqlite3.OperationalError:
            return 0


def test_a_killed_batch_resumes_without_losing_or_redoing_pairs(tmp_path: Path) -> None:
    problems = tmp_path / "KernelBench" / "level1"
    problems.mkdir(parents=True)
    shutil.copy(RELU, problems / "1_ReLU.py")
    candidates = _candidates(tmp_path / "model-a", 4)
    db = tmp_path / "results.sqlite"
    args = ["run", "--problems", str(problems.parent), "--candidates", str(candidates), "--db", str(db), "--protocol", "standard", "--device", "cpu"]
    proc = subprocess.Popen([sys.executable, "-m", "kbv.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while _stored(db) < 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, workers included
    proc.wait()
    done_before = _stored(db)
    assert 1 <= done_before < 4
    resumed = kbv(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _stored(db) == 4  # nothing lost, nothing evaluated twice
    assert f"{4 - done_before} evaluated, {done_before} already stored" in resumed.stderr


def test_compare_prints_the_protocols_side_by_side(tmp_path: Path) -> None:
    problems = tmp_path / "problems" / "level1"
    problems.mkdir(parents=True)
    shutil.copy(RELU, problems / "1_ReLU.py")
    model = tmp_path / "model-b"
    model.mkdir()
    shutil.copy(FOUNDATION.parent / "verified" / "relu_identity.py", model / "1_ReLU.py")
    db = tmp_path / "cmp.sqlite"
    done = kbv("compare", "--problems", str(problems.parent), "--candidates", str(model), "--db", str(db), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "model-b" in done.stdout and "passed" in done.stdout and "incorrect" in done.stdout


def test_a_broken_problem_file_is_recorded_and_the_batch_goes_on(tmp_path: Path) -> None:
    from kbv.store import Store

    problems = tmp_path / "KernelBench" / "level1"
    problems.mkdir(parents=True)
    shutil.copy(RELU, problems / "1_ReLU.py")
    (problems / "2_Broken.py").write_text("import torch\nraise RuntimeError('broken on purpose')\n" + RELU.read_text())
    candidates = _candidates(tmp_path / "model-c", 1)
    shutil.copy(FOUNDATION / "relu_plain.py", candidates / "level_1_problem_2_sample_0_kernel.py")
    db = tmp_path / "errors.sqlite"
    done = kbv("run", "--problems", str(problems.parent), "--candidates", str(candidates), "--db", str(db), "--protocol", "standard", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "2_Broken.py" in done.stderr and "broken on purpose" in done.stderr
    with Store(db) as store:
        assert [r.outcome for r in store.records()] == ["passed"]
        (error_file, message), = store.runs()[-1]["args"]["problem_errors"]
    assert error_file.endswith("2_Broken.py") and "failed to import" in message


def test_explain_shows_a_record_from_a_file_or_the_store(tmp_path: Path) -> None:
    from kbv.records import Record
    from kbv.store import Store

    out = tmp_path / "r.jsonl"
    hack = FOUNDATION.parent / "hacks" / "tf32_flag.py"
    problem = json.loads(json.dumps(__import__("test_hack_fixtures").fixture_spec(hack)))["problem"]
    assert kbv("eval", str(Path(__file__).parents[1] / problem), str(hack), "--device", "cpu", "--out", str(out), "--json").returncode == 0
    shown = kbv("explain", str(out))
    assert shown.returncode == 0 and "global_flags" in shown.stdout and "fail" in shown.stdout
    db = tmp_path / "x.sqlite"
    with Store(db) as store:
        record_id = store.add_record(Record.from_dict(json.loads(out.read_text())))
    by_id = kbv("explain", str(record_id), "--db", str(db))
    assert by_id.returncode == 0 and "global_flags" in by_id.stdout
    assert kbv("explain", "999", "--db", str(db)).returncode == 2
