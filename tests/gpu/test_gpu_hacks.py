"""GPU-only reward hacks (side streams, unwritten output, caching, unchecked launches, graph replay)
must be caught under ``verified`` on a CUDA device. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import gpu_batch, verified_on_gpu
from test_hack_fixtures import fixture_spec

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
HACKS = sorted((FIXTURES / "hacks").glob("*.py"))
HONEST = sorted((FIXTURES / "honest").glob("*.py"))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_HACKS = [p for p in HACKS if p.stem.startswith("gpu_")]


@pytest.mark.parametrize("path", [gpu_batch(ROOT / fixture_spec(p)["problem"], p) for p in GPU_HACKS])
def test_gpu_hack_is_caught(path: Path) -> None:
    spec = fixture_spec(path)
    record = verified_on_gpu(ROOT / spec["problem"], path)
    fails = {f.check for f in record.findings if f.severity == "fail"}
    summary = (
        f"outcome={record.outcome} "
        f"findings={[(f.check, f.severity, f.detail[:160]) for f in record.findings]} "
        f"error={record.error}"
    )
    assert record.outcome in spec["expect_outcome"], summary
    if record.outcome == "passed":  # a remembered result that earned nothing (test_hack_fixtures.py)
        assert "max_speedup" in spec, summary
        best = record.speedup.get("best")
        assert best is not None and best <= spec["max_speedup"], f"speedup {best}; {summary}"
        return
    if record.outcome == "hack_detected" and spec.get("expect_checks"):
        assert fails & set(spec["expect_checks"]), summary
    # a finding at whatever severity (side_stream_kernels: a warning until measured on the GPU)
    assert set(spec.get("expect_findings", [])) <= {f.check for f in record.findings}, summary


@pytest.mark.parametrize(
    "path",
    [
        gpu_batch(ROOT / fixture_spec(p)["problem"], p)
        for p in HONEST
        if fixture_spec(p).get("gpu_ok", True) and "cpp" not in p.stem
    ],
)
def test_honest_passes_on_gpu(path: Path) -> None:
    spec = fixture_spec(path)
    record = verified_on_gpu(ROOT / spec["problem"], path)
    fails = [(f.check, f.detail) for f in record.findings if f.severity == "fail"]
    assert record.outcome == "passed" and not fails, f"outcome={record.outcome} fails={fails}"
    # no honest fixture queues work on a stream of its own: the profiler must not say so
    streams = [f.detail for f in record.findings if f.check == "side_stream_kernels"]
    assert not streams, streams
    # where kbv's parent held the GPU, phase by phase (its copies of outputs and truths)
    peaks = record.memory.get("parent_device_peak_bytes") or {}
    probes = [v for k, v in peaks.items() if k.startswith("probe:")]
    assert {"correctness", "timing", "integrity"} <= peaks.keys() and probes, peaks
    assert peaks["correctness"] > 0 and peaks["integrity"] >= max(probes), peaks


SUITE = ROOT / "src" / "kbv" / "suite"
SUITE_GPU = sorted((SUITE / "candidates" / "hacks_gpu").glob("*.py"))


def _suite_problem(candidate: Path) -> Path:
    return next((SUITE / "problems").rglob(f"{candidate.stem}.py"))


@pytest.mark.parametrize("path", [gpu_batch(_suite_problem(p), p) for p in SUITE_GPU])
def test_bundled_gpu_candidate_meets_its_declared_expectation(path: Path) -> None:
    """The demo's GPU-only candidates: each declares what kbv must make of it (KBV_FIXTURE)."""
    spec = fixture_spec(path)
    record = verified_on_gpu(_suite_problem(path), path)
    fails = {f.check for f in record.findings if f.severity == "fail"}
    summary = (
        f"outcome={record.outcome} "
        f"findings={[(f.check, f.severity, f.detail[:160]) for f in record.findings]} "
        f"memory={record.memory}"
    )
    assert record.outcome in spec["expect_outcome"], summary
    if record.outcome == "hack_detected" and spec.get(
        "expect_checks"
    ):  # incorrect: correctness caught it first
        assert fails & set(spec["expect_checks"]), summary
    if spec.get("expect_outside_allocator_bytes"):  # the memory a raw cudaMalloc holds is in the record
        assert (record.memory.get("candidate_outside_allocator_bytes") or 0) >= spec[
            "expect_outside_allocator_bytes"
        ], summary
