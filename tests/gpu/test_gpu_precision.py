"""Half precision on the GPU: the reference as its own candidate passes ``verified`` in bf16 and
fp16, with eager in that precision as the only baseline (no TF32 outside fp32), and the long bf16
reduction accumulated in fp16 is rejected there too."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu_batch, verified_on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
LEVEL1 = ROOT / "src" / "kbv" / "suite" / "problems" / "level1"
PRECISION = ROOT / "tests" / "fixtures" / "candidates" / "precision"
LONG_ROW_SUM = ROOT / "tests" / "fixtures" / "problems_precision" / "long_row_sum.py"
REFERENCES = ["9_Softmax", "11_LayerNorm", "25_Matmul_Square", "28_Conv2d"]


def _reference_as_candidate(name: str, folder: Path | None) -> Path:
    """The problem's ``Model`` renamed ``ModelNew``, written at collection (the session's batch names
    its pairs then); without CUDA nothing is written and the test is skipped."""
    if folder is None:
        return LEVEL1 / f"{name}.py"
    candidate = folder / f"{name}.py"
    candidate.write_text((LEVEL1 / f"{name}.py").read_text().replace("class Model(", "class ModelNew("))
    return candidate


_FOLDER = Path(tempfile.mkdtemp(prefix="kbv-gpu-precision-")) if torch.cuda.is_available() else None
if _FOLDER is not None:
    atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)


def _reference_pair(name: str, precision: str) -> Any:
    candidate = _reference_as_candidate(name, _FOLDER)
    in_batch = gpu_batch(LEVEL1 / f"{name}.py", candidate, precision)
    return pytest.param(candidate, precision, marks=in_batch.marks, id=f"{name}-{precision}")


@pytest.mark.parametrize(
    ("candidate", "precision"), [_reference_pair(n, p) for n in REFERENCES for p in ("bf16", "fp16")]
)
def test_reference_passes_verified_in_half_precision_on_the_gpu(candidate: Path, precision: str) -> None:
    record = verified_on_gpu(LEVEL1 / candidate.name, candidate, precision)
    assert record.outcome == "passed", [(d.name, d.rel_err, d.note) for d in record.distributions]
    assert set(record.timing["baselines"]) == {f"eager_{precision}"}
    assert "eager_tf32" in record.timing["baselines_not_measured"]


@pytest.mark.parametrize(
    "candidate", [gpu_batch(LONG_ROW_SUM, PRECISION / "long_row_sum_fp16_accumulation.py", "bf16")]
)
def test_fp16_accumulation_of_a_long_bf16_reduction_is_rejected_on_the_gpu(candidate: Path) -> None:
    record = verified_on_gpu(LONG_ROW_SUM, candidate, "bf16")
    assert record.outcome == "incorrect"
    assert any(f.check == "below_precision" for f in record.findings)
