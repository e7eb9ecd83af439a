"""benchmarks/protocol_audit.py --cpu-sizes: KernelBench-style problems shrunk for a CPU rehearsal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kbv.problems import load_module, load_problem

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "protocol_audit.py"

TALL_SKINNY = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, A, B):
        return torch.matmul(A, B)

M = 16384 * 2
N = 16 * 2

def get_inputs():
    return [torch.rand(M, N), torch.rand(N, M)]

def get_init_inputs():
    return []
"""


def _module():
    spec = importlib.util.spec_from_file_location("protocol_audit_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shrunk_sizes_count_the_outputs_and_stay_under_the_limit(tmp_path: Path) -> None:
    """Two thin inputs (2 M elements) make an M x M output (1.1e9): counting inputs alone kept M at
    16384 and the rehearsal's trusted run held 12.8 GB."""
    script = _module()
    path = tmp_path / "9_Tall_skinny.py"
    path.write_text(TALL_SKINNY)
    sizes = script.shrunk_sizes(path)
    assert script._elements(path, sizes) <= script.CPU_REHEARSAL_ELEMENTS
    assert sizes["M"] < 1024 and sizes["N"] >= 4  # halved together, never below 4
    assert script._elements(path, {}) > 1000 * script.CPU_REHEARSAL_ELEMENTS  # the full size does not fit


def test_sample_copies_carry_their_cpu_sizes(tmp_path: Path) -> None:
    """The copy's KBV dict is read by the problem loader, and the sizes apply on the CPU only."""
    script = _module()
    root = tmp_path / "kb"
    (root / "level1").mkdir(parents=True)
    name = "level1/9_Tall_skinny.py"
    (root / name).write_text(TALL_SKINNY)
    script.KERNELBENCH_SAMPLE = (name,)
    copy = script.sample_dir(root, tmp_path / "work", (1, 1), cpu_sizes=True) / name
    problem = load_problem(copy)
    cpu = problem.sizes_for("cpu")
    assert cpu == script.shrunk_sizes(root / name) and problem.sizes_for("cuda") == {}
    module = load_module(copy, sizes=cpu)
    a, b = module.get_inputs()
    assert (module.Model()(a, b)).numel() <= script.CPU_REHEARSAL_ELEMENTS
