"""Half precision on the GPU: the reference as its own candidate passes ``verified`` in bf16 and
fp16, with eager in that precision as the only baseline (no TF32 outside fp32), and the long bf16
reduction accumulated in fp16 is rejected there too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kbv.api import evaluate_paths

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
LEVEL1 = ROOT / "src" / "kbv" / "suite" / "problems" / "level1"
PRECISION = ROOT / "tests" / "fixtures" / "candidates" / "precision"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["9_Softmax", "11_LayerNorm", "25_Matmul_Square", "28_Conv2d"])
def test_reference_passes_verified_in_half_precision_on_the_gpu(
    tmp_path: Path, name: str, precision: str
) -> None:
    problem = LEVEL1 / f"{name}.py"
    candidate = tmp_path / f"{name}.py"
    candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
    record = evaluate_paths(problem, candidate, protocol="verified", device="cuda", precision=precision)
    assert record.outcome == "passed", [(d.name, d.rel_err, d.note) for d in record.distributions]
    assert set(record.timing["baselines"]) == {f"eager_{precision}"}
    assert "eager_tf32" in record.timing["baselines_not_measured"]


def test_fp16_accumulation_of_a_long_bf16_reduction_is_rejected_on_the_gpu() -> None:
    problem = ROOT / "tests" / "fixtures" / "problems_precision" / "long_row_sum.py"
    record = evaluate_paths(
        problem, PRECISION / "long_row_sum_fp16_accumulation.py", device="cuda", precision="bf16"
    )
    assert record.outcome == "incorrect"
    assert any(f.check == "below_precision" for f in record.findings)
