"""Every known reward hack is rejected under ``verified``; every honest fixture passes cleanly.

Each fixture declares ``KBV_FIXTURE = {"problem": ..., "expect_outcome": [...], "expect_checks": [...]}``
(honest ones only ``problem``). A hack passes this test when its outcome is one of the allowed
ones, never "passed", and at least one expected check fired with severity ``fail`` (also when the
outcome itself, incorrect or crashed, already rejects it); a fixture that names no check is one the
outcome alone rejects (a crash, or a shortcut the error model itself finds wrong). One with
``incorrect_suffices`` is rejected by either: its outcome ``incorrect`` need name no check, because
which one sees it depends on where the allocator happens to put each draw's input.

A fixture with ``max_speedup`` is a shortcut that ``verified`` takes away instead of naming: a
remembered result never helps a timed call that runs on inputs no earlier call saw. It may be
``passed``, but then it earns nothing: its ``speedup.best`` is at most ``max_speedup`` (2: its work
is the baseline's ``torch.matmul``, so an honest copy of it measures about 1, 0.85-1.4 on two
loaded cores; a remembered result measured 38-400 under ``standard`` and ``verified`` v3,
benchmarks/results/2026-12-06-cpu-cache-fixtures/).
"""

from __future__ import annotations

import ast
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbv.api import evaluate_paths

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
HACKS = sorted((FIXTURES / "hacks").glob("*.py"))
HONEST = sorted((FIXTURES / "honest").glob("*.py"))


def fixture_spec(path: Path) -> dict:
    """The fixture's KBV_FIXTURE dict, read without importing the candidate."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "KBV_FIXTURE" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no KBV_FIXTURE")


def _evaluate(path: Path):
    spec = fixture_spec(path)
    return spec, evaluate_paths(
        ROOT / spec["problem"], path, protocol="verified", device="cpu", timeout_s=240
    )


def _params(paths: list[Path]) -> list:
    return [
        pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if fixture_spec(p).get("slow") else [])
        for p in paths
    ]


def _gpu_only(path: Path) -> bool:
    return path.stem.startswith("gpu_")


@pytest.mark.parametrize("path", _params([p for p in HACKS if not _gpu_only(p)]))
def test_hack_is_caught(path: Path) -> None:
    spec, record = _evaluate(path)
    fails = {f.check for f in record.findings if f.severity == "fail"}
    summary = (
        f"outcome={record.outcome} "
        f"findings={[(f.check, f.severity, f.detail[:120]) for f in record.findings]} "
        f"error={record.error}"
    )
    assert record.outcome in spec["expect_outcome"], summary
    _phases_within_the_evaluation(record)
    if record.outcome == "passed":  # allowed only where the shortcut earned nothing
        assert "max_speedup" in spec, summary
        best = record.speedup.get("best")
        assert best is not None and best <= spec["max_speedup"], f"speedup {best}; {summary}"
        return
    # Every outcome but passed says why where a user looks first; a hack names its failed checks.
    assert record.error and record.error.get("summary"), summary
    if record.outcome == "hack_detected":
        assert all(check in record.error["summary"] for check in fails), summary
    expected = set(spec.get("expect_checks", []))
    plainly_wrong = record.outcome == "incorrect" and spec.get("incorrect_suffices", False)
    if expected and not plainly_wrong:  # the named check fires, whatever else already rejected it
        assert fails & expected, f"none of {sorted(expected)} failed; {summary}"
    for check in spec.get("expect_warn", []):
        assert check in {f.check for f in record.findings}, f"{check} did not fire; {summary}"


def _phases_within_the_evaluation(record) -> None:
    """Every phase the record reports lies between 0 and the evaluation's total, whatever the
    candidate did to its worker's clocks (clocks_and_checker_patch slows perf_counter at import)."""
    total = record.phases_s["total"]
    for name, seconds in record.phases_s.items():
        assert 0.0 <= seconds <= total + 1e-6, (name, seconds, total)


@pytest.mark.parametrize("path", _params(HONEST))
def test_honest_passes(path: Path) -> None:
    _, record = _evaluate(path)
    _phases_within_the_evaluation(record)
    fails = [(f.check, f.detail) for f in record.findings if f.severity == "fail"]
    assert record.outcome == "passed", (
        f"outcome={record.outcome} fails={fails} error={record.error} "
        f"dists={[(d.name, d.passed, d.note) for d in record.distributions]}"
    )
    assert not fails and record.error is None


def test_fixture_inventory() -> None:
    """At least 18 CPU hack patterns and 5 honest candidates, each naming its pattern in a docstring."""
    cpu_hacks = [p for p in HACKS if not _gpu_only(p)]
    assert len(cpu_hacks) >= 18 and len(HONEST) >= 5
    for path in HACKS + HONEST:
        assert ast.get_docstring(ast.parse(path.read_text())), (
            f"{path.name} needs a docstring naming its pattern"
        )
        assert (ROOT / fixture_spec(path)["problem"]).is_file(), path.name


# An evaluation never changes its problem (``docs/isolation.md``, "How workers load problems").
RELU_PROBLEM = ROOT / "src" / "kbv" / "suite" / "problems" / "level1" / "1_ReLU.py"
REWRITE = FIXTURES / "hacks" / "rewrite_problem_file.py"
# The only files rewrite_problem_file.py will ever append to carry this line.
REWRITE_MARKER = "# kbv-test-fixture: " + "rewrite_problem_file may append here"


@pytest.fixture
def marked_problem() -> Iterator[Path]:
    """A copy of the ReLU problem with the marker the rewriting fixture looks for, in a directory
    and file that any uid may write: only what the candidate cannot learn protects it."""
    folder = Path(tempfile.mkdtemp(prefix="kbv-marked-problem-"))
    try:
        folder.chmod(0o777)
        path = folder / RELU_PROBLEM.name
        path.write_text(RELU_PROBLEM.read_text() + f"\n{REWRITE_MARKER}\n")
        path.chmod(0o666)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_candidate_cannot_rewrite_its_problem_file(marked_problem: Path) -> None:
    before = marked_problem.read_bytes()
    record = evaluate_paths(marked_problem, REWRITE, protocol="verified", device="cpu", timeout_s=240)
    assert marked_problem.read_bytes() == before, "the candidate appended to its problem file"
    assert record.outcome != "passed", record.outcome
    assert record.problem["source_sha256"] == hashlib.sha256(before).hexdigest()
    assert "changed_on_disk" not in record.problem
    # The next evaluation of the same problem judges the original text.
    honest_candidate = FIXTURES / "honest" / "relu_clamp.py"
    honest = evaluate_paths(marked_problem, honest_candidate, protocol="verified", device="cpu")
    assert honest.outcome == "passed", (honest.outcome, honest.error)
    assert marked_problem.read_bytes() == before


def test_a_candidate_that_finds_the_path_in_kbv_evals_command_line_changes_nothing(
    marked_problem: Path,
) -> None:
    """``kbv eval PROBLEM.py`` shows the path in the parent's own command line, which no worker can
    hide. Where the candidate's writes are confined (Landlock) the file stays as it was; where they
    are not, the record says the file changed, and the evaluation judged the text read first."""
    import json
    import subprocess
    import sys

    before = marked_problem.read_bytes()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kbv.cli",
            "eval",
            str(marked_problem),
            str(REWRITE),
            "--device",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert record["outcome"] != "passed"
    assert record["problem"]["source_sha256"] == hashlib.sha256(before).hexdigest()
    if "landlock" in record["isolation"].get("confinement", {}):
        assert marked_problem.read_bytes() == before, "a confined candidate appended to its problem"
    else:
        changed = marked_problem.read_bytes() != before
        assert record["problem"].get("changed_on_disk", False) == changed
