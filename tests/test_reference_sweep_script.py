"""The honest sweep's resumption (benchmarks/reference_as_candidate.py): which problems it starts again."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_script

from kbv.evaluation.budget import GPU_TOO_SMALL, PARENT_RAN_OUT

sweep = load_script("reference_as_candidate")


def _rows(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps({"precision": "fp32", **row}) + "\n" for row in rows))
    return path


def test_a_problem_too_large_for_the_gpu_is_settled_and_a_rejection_starts_again(tmp_path: Path) -> None:
    """Settled: passed, or kbv's HarnessError of a GPU too small (the same GPU would say so again).
    Started again: a rejection, and any other harness error (a fix may have come since)."""
    too_small = f"HarnessError: {GPU_TOO_SMALL}: the other processes on it ... held 23.5 GiB"
    rows = _rows(
        tmp_path / "rows.jsonl",
        {"problem": "1_ok", "outcome": "passed"},
        {"problem": "37_big", "outcome": "harness_error", "error": too_small},
        {"problem": "98_wrong", "outcome": "incorrect", "error": ""},
        {"problem": "35_broken", "outcome": "harness_error", "error": "ImportError: no module named x"},
    )
    assert sweep._done(rows) == {"1_ok": 1, "37_big": 1, "98_wrong": 0, "35_broken": 0}
    # on a GPU with more memory the too-large problem is evaluated again
    assert sweep._done(rows, retry_too_small=True)["37_big"] == 0
    assert sweep._too_small({"outcome": "harness_error", "error": too_small})
    parent = f"HarnessError: {PARENT_RAN_OUT}: during correctness, with the candidate within its limits"
    assert sweep._too_small({"outcome": "harness_error", "error": parent})  # kbv's own copies, too
    claimed = {"outcome": "runtime_error", "error": f"{GPU_TOO_SMALL} (the candidate's own words)"}
    assert not sweep._too_small(claimed)


def _problem(tmp_path: Path, name: str, forward: str, inputs: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import torch\n\n"
        "class Model(torch.nn.Module):\n"
        f"    def forward(self, x):\n        return {forward}\n\n"
        f"def get_inputs():\n    return [{inputs}]\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


def test_long_reductions_are_found_from_shapes_alone(tmp_path: Path) -> None:
    """`--long-reductions` keeps the problems where `verified` draws `spiked`: a mean over 1e9
    elements is found on the meta device without allocating them; an elementwise op is left out,
    and a problem whose shapes cannot be found that way is kept."""
    mean = _problem(tmp_path, "mean", "x.mean()", "torch.rand(32768, 32768)")
    relu = _problem(tmp_path, "relu", "torch.relu(x)", "torch.rand(32768, 32768)")
    row_sum = _problem(tmp_path, "row_sum", "x.sum(dim=1)", "torch.rand(16, 255)")
    opaque = _problem(tmp_path, "opaque", "torch.tensor(x.tolist()).sum()", "torch.rand(4, 4)")
    assert sweep.reduces_long(mean, 256)
    assert not sweep.reduces_long(relu, 256)
    assert not sweep.reduces_long(row_sum, 256) and sweep.reduces_long(row_sum, 255)
    assert sweep.reduces_long(opaque, 256)
