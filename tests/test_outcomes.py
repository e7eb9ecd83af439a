"""Every outcome of the contract, produced by a fixture through the whole pipeline on the CPU."""

from __future__ import annotations

import time

import pytest
from conftest import FOUNDATION, RELU

from kbv.api import evaluate_paths
from kbv.records import Record


def _eval(name: str, protocol: str = "standard", timeout_s: float | None = 120) -> Record:
    return evaluate_paths(RELU, FOUNDATION / name, protocol=protocol, device="cpu", timeout_s=timeout_s)


def test_honest_plain_candidate_passes_with_a_speedup() -> None:
    record = _eval("relu_plain.py")
    assert record.outcome == "passed" and record.correct
    assert [d.name for d in record.distributions] == ["original"]
    assert record.distributions[0].passed
    assert record.speedup["eager_fp32"] > 0 and record.speedup["best"] == record.speedup["eager_fp32"]
    assert len(record.timing["candidate"]["rounds"][0]["device_ms"]) > 0
    # the parent's /proc counts during each batch (a diagnostic for bracket gaps)
    assert set(record.timing["candidate"]["rounds"][0]["worker_scheduler_ms"]) == {
        "main_cpu",
        "main_wait",
        "cpu",
    }
    assert record.protocol["sha256"] and record.seeds["master"] == 42
    assert record.versions["torch"] and record.device["type"] == "cpu"
    # host memory on the CPU: both processes' peaks and their ratio
    memory = record.memory
    assert memory["candidate_host_peak_bytes"] > 0 and memory["reference_host_peak_bytes"] > 0
    ratio = memory["candidate_host_peak_bytes"] / memory["reference_host_peak_bytes"]
    assert memory["host_ratio"] == pytest.approx(ratio)
    assert record.error is None  # passed: nothing to explain


@pytest.mark.slow
def test_honest_cpp_candidate_passes_verified() -> None:
    record = _eval("relu_cpp.py", protocol="verified", timeout_s=300)
    assert record.outcome == "passed", record.to_json()
    assert isinstance(record.speedup["best"], float)
    assert {d.name for d in record.distributions if d.applicable and d.passed} >= {
        "original",
        "signed",
        "wide",
        "shifted",
        "blockwise",
    }
    assert not [f for f in record.findings if f.severity == "fail"]


@pytest.mark.slow
def test_a_build_killed_midway_does_not_hang_later_evaluations() -> None:
    """torch leaves its build ``lock`` file behind when a build is killed; the next import would wait
    on it forever. kbv clears it under its own build lock, so the evaluation passes. The stale file
    is planted under that lock too, as a killed build leaves it: planted beside another test's
    evaluation of the same source (the honest relu_cpp fixture, on the other xdist worker), it made
    that evaluation's import wait on it until its timeout."""
    from kbv.candidates import load_candidate
    from kbv.worker.builds import build_dir, build_lock

    sha = load_candidate(FOUNDATION / "relu_cpp.py").source_sha256
    stale = build_dir(sha) / "torch_extensions" / "kbv_fixture_relu_cpp" / "lock"
    with build_lock(sha):
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.touch()
    record = _eval("relu_cpp.py", timeout_s=300)
    assert record.outcome == "passed", record.error
    assert not stale.exists()


def test_build_lock_clears_stale_torch_locks_and_excludes_other_holders(tmp_path, monkeypatch) -> None:
    import fcntl

    from kbv.worker.builds import build_dir, build_lock

    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path))
    stale = build_dir("ab" * 32) / "torch_extensions" / "ext" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    with build_lock("ab" * 32):
        assert not stale.exists()
        with (
            open(build_dir("ab" * 32) / ".lock", "a") as other,
            pytest.raises(BlockingIOError),
        ):  # another holder
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(build_dir("ab" * 32) / ".lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again once released


def test_wrong_candidate_is_incorrect() -> None:
    record = _eval("relu_wrong.py")
    assert record.outcome == "incorrect" and not record.correct
    assert record.error["summary"].startswith("wrong output on the original inputs (max_abs_err")
    assert record.distributions[0].max_abs_err > 1e-4
    assert record.speedup["best"] is None  # incorrect kernels are not timed


def test_wrong_shape_is_incorrect_with_the_reason() -> None:
    record = _eval("relu_wrong_shape.py")
    assert record.outcome == "incorrect"
    assert "shape" in record.distributions[0].note


def test_hanging_candidate_times_out_on_time() -> None:
    started = time.monotonic()
    record = _eval("relu_hang.py", timeout_s=15)
    assert record.outcome == "timeout"
    assert time.monotonic() - started < 15 + 20  # the timeout plus worker start-up, not more


def test_fake_record_then_os_exit_is_crashed_never_passed() -> None:
    record = _eval("relu_exit_fake.py")
    assert record.outcome == "crashed"
    assert '"outcome": "passed"' in record.logs["stdout"]


def test_signal_death_is_crashed() -> None:
    assert _eval("relu_segfault.py").outcome == "crashed"


def test_exception_in_forward_is_runtime_error_with_traceback() -> None:
    record = _eval("relu_raises.py")
    assert record.outcome == "runtime_error"
    assert record.error and "ValueError" in record.error["traceback"]
    assert record.error["worker"] == "candidate"


def test_import_failure_is_runtime_error_of_kind_import() -> None:
    record = _eval("relu_import_error.py")
    assert record.outcome == "runtime_error" and record.error["kind"] == "import_error"
    assert "kbv_no_such_module_anywhere" in record.error["message"]


def test_cpp_that_does_not_compile_is_compile_error_with_the_compiler_message() -> None:
    record = _eval("relu_cpp_broken.py", timeout_s=240)
    assert record.outcome == "compile_error"
    assert "undeclared_function" in record.error["message"]


def test_api_key_in_parent_is_invisible_to_the_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-should-not-leak")
    monkeypatch.setenv("KBV_TEST_SECRET", "nope")
    assert _eval("relu_env_spy.py").outcome == "passed"


def test_record_round_trips_through_json() -> None:
    import json

    record = _eval("relu_plain.py")
    again = Record.from_dict(json.loads(record.to_json()))
    assert again.outcome == record.outcome and again.distributions == record.distributions


def test_a_build_that_failed_ahead_of_time_is_a_compile_error_without_rebuilding() -> None:
    from kbv.candidates import load_candidate
    from kbv.worker.builds import compile_candidate

    candidate = load_candidate(FOUNDATION / "relu_cpp_broken.py")
    assert compile_candidate(candidate).status == "failed"
    started = time.monotonic()
    record = _eval("relu_cpp_broken.py", timeout_s=5)  # far less than a build takes
    assert record.outcome == "compile_error" and "undeclared_function" in record.error["message"]
    assert time.monotonic() - started < 30
