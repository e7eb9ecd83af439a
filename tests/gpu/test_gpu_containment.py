"""Containment on a CUDA device: the device-memory limit, kernels that never run, and the uid drop.
Skipped without CUDA. Run on the GPU machine: ``pytest -q tests/gpu/test_gpu_containment.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kbv.api import evaluate_paths
from kbv.protocol import protocol_from_dict

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
RELU = ROOT / "src" / "kbv" / "suite" / "problems" / "level1" / "1_ReLU.py"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _device_limit() -> object:
    # 12 GiB: the honest ReLU's worker (4096 x 32768 inputs) measured 8426 MiB on the H200 on
    # 2026-12-01 (its CUDA context, the timing phase's input sets, and then a secret round of kept
    # outputs, since replaced by per-call sketches of a few MB); the hog takes 24 GiB.
    return protocol_from_dict(
        {"name": "device-12gib", "base": "verified", "limits": {"device_memory_gb": 12.0}}
    )


def test_device_memory_beyond_the_limit_is_resource_limit() -> None:
    record = evaluate_paths(
        RELU,
        FIXTURES / "gpu" / "device_memory_hog.py",
        protocol=_device_limit(),
        device="cuda",
        timeout_s=600,
    )
    gaps = record.isolation.get("not_enforced") or []
    if any("device memory not enforced" in g for g in gaps):
        pytest.skip(f"NVML gives no per-process figure here: {gaps}")
    assert record.outcome == "resource_limit", (record.outcome, record.error, gaps)
    assert record.error["limit"]["limit"] == "device_memory" and record.error["limit"]["figure"] > 12 << 30


def test_an_honest_candidate_passes_under_the_device_limit() -> None:
    record = evaluate_paths(
        RELU,
        FIXTURES / "foundation" / "relu_plain.py",
        protocol=_device_limit(),
        device="cuda",
        timeout_s=600,
    )
    assert record.outcome == "passed", (
        record.outcome,
        record.error,
        [(f.check, f.severity, f.detail) for f in record.findings],
    )
    assert record.memory["candidate_host_peak_bytes"]


def test_a_fallback_to_an_undefined_kernel_is_caught_on_the_gpu() -> None:
    record = evaluate_paths(
        RELU,
        FIXTURES / "hacks" / "fallback_undefined_kernel.py",
        protocol="verified",
        device="cuda",
        timeout_s=600,
    )
    fails = {f.check for f in record.findings if f.severity == "fail"}
    assert record.outcome == "hack_detected" and {"ghost_kernel", "reference_fallback"} <= fails, (
        record.findings
    )


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the uid drop applies to a root parent"
)
def test_on_the_gpu_the_candidate_runs_as_a_uid_of_its_own_and_its_outputs_still_reach_the_parent() -> None:
    """As a uid of its own the candidate cannot read the parent's environment, and its outputs reach
    the root parent as exported VMM memory (legacy CUDA IPC handles do not open across uids):
    ``read_parent_environ`` returns zeros where the read works, so correct outputs need both. Its
    verdict is ``hack_detected`` for naming ``/proc/`` (the static ``introspection`` check) and for
    nothing else; the dynamic checks saw the read refused (measured on the H200, 2026-12-02)."""
    from kbv.worker import Worker, WorkerSpec

    candidate = FIXTURES / "contain" / "read_parent_environ.py"
    probe = Worker(WorkerSpec(build_key="test-gpu-drop", device="cuda", role="candidate", budget_s=10))
    try:
        probe._command(["python", "-c", "pass"], probe.scratch)
        if probe.uid is None:
            pytest.skip(f"no uid drop on this machine: {probe._no_drop}")
    finally:
        probe.close()
    record = evaluate_paths(RELU, candidate, protocol="verified", device="cuda", timeout_s=600)
    fails = {f.check for f in record.findings if f.severity == "fail"}
    assert record.outcome == "hack_detected" and fails == {"introspection"}, (record.error, record.findings)
    assert record.correct is True, record.distributions  # not the zeros a successful read returns
    assert any("PermissionError" in f.detail for f in record.findings), record.findings
    assert record.isolation["user"].startswith("uid "), record.isolation
    assert not any("runs as root" in gap for gap in record.isolation.get("not_enforced") or [])
