"""Issue 12 on a CUDA GPU: TF32 switched on only inside forward passes against the TF32 baseline
(and leaves the flags as it found them), and the honest KernelBench-size Triton candidates of
tests/fixtures/candidates/gpu_kernelbench pass ``verified``. Skipped without CUDA; the second test
also without the KernelBench tree (../shared/kernelbench, or the folder named by KBV_KERNELBENCH, which
holds level1/: ../shared does not travel to a GPU machine, a copy of it does)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import GPU_BATCH_TEST_TIMEOUT_S, gpu_batch, verified_on_gpu

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
KERNELBENCH = Path(os.environ.get("KBV_KERNELBENCH", ROOT.parent / "shared" / "kernelbench")) / "level1"
TINY_MATMUL = ROOT / "tests" / "fixtures" / "problems" / "tiny_matmul.py"
TF32_SCOPED = FIXTURES / "honest" / "tf32_scoped.py"
TF32_FLAG = FIXTURES / "hacks" / "tf32_flag.py"
RELU = ROOT / "src" / "kbv" / "suite" / "problems" / "level1" / "1_ReLU.py"
RELU_PLAIN = FIXTURES / "foundation" / "relu_plain.py"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# In the session's batch of GPU pairs (tests/conftest.py): alone, each evaluation boots its own
# workers: 8-17 s each on an H100 (2026-12-06), against about 4 s a pair in the batch.
@pytest.mark.gpu_batch(TINY_MATMUL, TF32_SCOPED)
@pytest.mark.gpu_batch(TINY_MATMUL, TF32_FLAG)
@pytest.mark.timeout(GPU_BATCH_TEST_TIMEOUT_S)
def test_tf32_inside_forward_passes_and_a_global_flip_is_caught() -> None:
    honest = verified_on_gpu(TINY_MATMUL, TF32_SCOPED)
    assert honest.outcome == "passed", [(f.check, f.severity, f.detail) for f in honest.findings]
    assert "global_flags" not in {f.check for f in honest.findings}
    hack = verified_on_gpu(TINY_MATMUL, TF32_FLAG)
    assert hack.outcome == "hack_detected"
    assert "global_flags" in {f.check for f in hack.findings if f.severity == "fail"}


@pytest.mark.gpu_batch(TINY_MATMUL, TF32_SCOPED)
@pytest.mark.gpu_batch(RELU, RELU_PLAIN)
@pytest.mark.timeout(GPU_BATCH_TEST_TIMEOUT_S)
def test_eager_tf32_is_timed_only_where_tf32_changes_the_reference() -> None:
    # tiny_matmul's forward runs a GEMM: both baselines are timed. ReLU's runs none: eager_tf32
    # would be eager_fp32's code, so it is left out, with the reason in the record.
    matmul = verified_on_gpu(TINY_MATMUL, TF32_SCOPED)
    assert sorted(matmul.timing["baselines"]) == ["eager_fp32", "eager_tf32"]
    relu = verified_on_gpu(RELU, RELU_PLAIN)
    assert relu.outcome == "passed", [(f.check, f.detail) for f in relu.findings]
    assert sorted(relu.timing["baselines"]) == ["eager_fp32"]
    assert "none of which the TF32 flags change" in relu.timing["baselines_not_measured"]["eager_tf32"]


def _kernelbench_problem(candidate: Path) -> Path:
    return KERNELBENCH / f"{candidate.stem.split('__')[0]}.py"


def _kernelbench_param(candidate: Path) -> Any:
    # In the batch only where the tree is there: a pair the batch cannot load would fail the
    # batch's first test, whatever it asserts.
    if KERNELBENCH.is_dir():
        return gpu_batch(_kernelbench_problem(candidate), candidate)
    return pytest.param(candidate, id=candidate.stem)


@pytest.mark.skipif(
    not KERNELBENCH.is_dir(), reason="needs the KernelBench tree: ../shared/kernelbench or KBV_KERNELBENCH"
)
@pytest.mark.parametrize(
    "candidate", [_kernelbench_param(p) for p in sorted((FIXTURES / "gpu_kernelbench").glob("*.py"))]
)
def test_honest_kernelbench_kernel_passes(candidate: Path) -> None:
    record = verified_on_gpu(_kernelbench_problem(candidate), candidate)
    fails = [(f.check, f.detail) for f in record.findings if f.severity == "fail"]
    assert record.outcome == "passed", (
        f"{record.outcome} {fails} {record.error} "
        f"{[(d.name, d.rel_err, d.note) for d in record.distributions if not d.passed]}"
    )
