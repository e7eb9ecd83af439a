"""Issue 12 on a CUDA GPU: TF32 switched on only inside forward passes against the TF32 baseline
(and leaves the flags as it found them), and the honest KernelBench-size Triton candidates of
tests/fixtures/candidates/gpu_kernelbench pass ``verified``. Skipped without CUDA; the second test
also without the KernelBench tree (../shared/kernelbench, or the folder named by KBV_KERNELBENCH, which
holds level1/: ../shared does not travel to a GPU machine, a copy of it does)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import verified_on_gpu

from kbv.api import evaluate_paths

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
KERNELBENCH = Path(os.environ.get("KBV_KERNELBENCH", ROOT.parent / "shared" / "kernelbench")) / "level1"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tf32_inside_forward_passes_and_a_global_flip_is_caught() -> None:
    problem = ROOT / "tests" / "fixtures" / "problems" / "tiny_matmul.py"
    honest = verified_on_gpu(problem, FIXTURES / "honest" / "tf32_scoped.py")
    assert honest.outcome == "passed", [(f.check, f.severity, f.detail) for f in honest.findings]
    assert "global_flags" not in {f.check for f in honest.findings}
    hack = evaluate_paths(
        problem, FIXTURES / "hacks" / "tf32_flag.py", protocol="verified", device="cuda", timeout_s=600
    )
    assert hack.outcome == "hack_detected"
    assert "global_flags" in {f.check for f in hack.findings if f.severity == "fail"}


def test_eager_tf32_is_timed_only_where_tf32_changes_the_reference() -> None:
    # tiny_matmul's forward runs a GEMM: both baselines are timed. ReLU's runs none: eager_tf32
    # would be eager_fp32's code, so it is left out, with the reason in the record.
    matmul = verified_on_gpu(
        ROOT / "tests" / "fixtures" / "problems" / "tiny_matmul.py", FIXTURES / "honest" / "tf32_scoped.py"
    )
    assert sorted(matmul.timing["baselines"]) == ["eager_fp32", "eager_tf32"]
    relu = evaluate_paths(
        ROOT / "src" / "kbv" / "suite" / "problems" / "level1" / "1_ReLU.py",
        FIXTURES / "foundation" / "relu_plain.py",
        protocol="verified",
        device="cuda",
        timeout_s=600,
    )
    assert relu.outcome == "passed", [(f.check, f.detail) for f in relu.findings]
    assert sorted(relu.timing["baselines"]) == ["eager_fp32"]
    assert "none of which the TF32 flags change" in relu.timing["baselines_not_measured"]["eager_tf32"]


@pytest.mark.skipif(
    not KERNELBENCH.is_dir(), reason="needs the KernelBench tree: ../shared/kernelbench or KBV_KERNELBENCH"
)
@pytest.mark.parametrize(
    "candidate", sorted((FIXTURES / "gpu_kernelbench").glob("*.py")), ids=lambda p: p.stem
)
def test_honest_kernelbench_kernel_passes(candidate: Path) -> None:
    problem = KERNELBENCH / f"{candidate.stem.split('__')[0]}.py"
    record = evaluate_paths(problem, candidate, protocol="verified", device="cuda", timeout_s=600)
    fails = [(f.check, f.detail) for f in record.findings if f.severity == "fail"]
    assert record.outcome == "passed", (
        f"{record.outcome} {fails} {record.error} "
        f"{[(d.name, d.rel_err, d.note) for d in record.distributions if not d.passed]}"
    )
