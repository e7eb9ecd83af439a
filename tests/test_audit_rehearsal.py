"""benchmarks/protocol_audit.py --cpu-sizes: KernelBench-style problems shrunk for a CPU rehearsal."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load_script

from kbv.problems import load_module, load_problem

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


BIAS_FROM_CHANNELS = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, channels, bias_shape):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        return x + self.bias

batch_size = 128
channels = 4096
bias_shape = (channels, 1)  # computed at import: an override after import would leave it at 4096

def get_inputs():
    return [torch.rand(batch_size, channels, 1)]

def get_init_inputs():
    return [channels, bias_shape]
"""


def test_shrunk_sizes_count_the_outputs_and_stay_under_the_limit() -> None:
    """Two thin inputs (2 M elements) make an M x M output (1.1e9): counting inputs alone kept M at
    16384 and the rehearsal's trusted run held 12.8 GB."""
    script = load_script("protocol_audit")
    sizes = script.shrunk_sizes(TALL_SKINNY)
    assert script._elements(script.with_constants(TALL_SKINNY, sizes)) <= script.CPU_REHEARSAL_ELEMENTS
    assert sizes["M"] < 1024 and sizes["N"] >= 4  # halved together, never below 4
    assert script._elements(TALL_SKINNY) > 1000 * script.CPU_REHEARSAL_ELEMENTS  # full size does not fit


def test_a_shape_computed_at_import_follows_the_shrunk_constant() -> None:
    """The sizes go into the source, shapes with them: three sample problems (a bias shape from
    ``out_channels``; targets broadcast along ``input_shape``, which must equal ``batch_size``)
    could not run when only the integers were overridden after import."""
    script = load_script("protocol_audit")
    sizes = script.shrunk_sizes(BIAS_FROM_CHANNELS)
    shrunk = script.with_constants(BIAS_FROM_CHANNELS, sizes)
    assert f"channels = {sizes['channels']}\n" in shrunk
    module = script._load(shrunk)
    assert module.bias_shape == (module.channels, 1)  # the shape kept pace with its constant
    (x,) = module.get_inputs()
    out = module.Model(*module.get_init_inputs())(x)
    assert out.shape == (sizes["batch_size"], sizes["channels"], 1)


def test_sample_copies_are_shrunk_in_their_source(tmp_path: Path) -> None:
    """The copy is a plain problem file: its own constants are small, nothing is overridden."""
    script = load_script("protocol_audit")
    root = tmp_path / "kb"
    (root / "level1").mkdir(parents=True)
    name = "level1/9_Tall_skinny.py"
    (root / name).write_text(TALL_SKINNY)
    script.KERNELBENCH_SAMPLE = (name,)
    copy = script.sample_dir(root, tmp_path / "work", (1, 1), cpu_sizes=True) / name
    problem = load_problem(copy)
    assert problem.sizes_for("cpu") == {} and copy.read_text().startswith("# kbv: shrunk")
    module = load_module(copy)
    a, b = module.get_inputs()
    assert (module.Model()(a, b)).numel() <= script.CPU_REHEARSAL_ELEMENTS


HINGE_LIKE = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(torch.clamp(1 - predictions * targets, min=0))

batch_size = 32768
input_shape = (32768,)
dim = 1

def get_inputs():
    return [torch.rand(batch_size, *input_shape), torch.randint(0, 2, (batch_size,)).float() * 2 - 1]

def get_init_inputs():
    return []
"""


def test_a_shape_tuple_shrinks_with_the_integers_it_must_equal() -> None:
    """The targets (batch,) broadcast along input_shape's dimension: halving batch_size alone broke
    the shrunk problem (8 against 32768); a tuple of integers is halved with them."""
    script = load_script("protocol_audit")
    sizes = script.shrunk_sizes(HINGE_LIKE)
    assert sizes["input_shape"] == (sizes["batch_size"],) and "dim" not in sizes  # 1 stays 1
    module = script._load(script.with_constants(HINGE_LIKE, sizes))
    assert module.Model()(*module.get_inputs()).ndim == 0


def test_parts_run_one_after_another_in_one_process_and_a_failing_part_names_where_to_go_on(
    tmp_path: Path, monkeypatch
) -> None:
    """``--parts 2-4/20`` audits parts 2, 3 and 4 in turn in one process. A part that raises stops
    the process (its CUDA context may be broken) with the status PART_FAILED + K, from which the
    caller goes on at K + 1 in a fresh one; bad spans are usage errors."""
    import argparse

    import pytest

    script = load_script("protocol_audit")
    assert script.parse_parts("2-4/20") == [(2, 20), (3, 20), (4, 20)]
    assert script.parse_parts("7/20") == [(7, 20)]
    for bad in ("0-2/20", "3-21/20", "4-2/20", "a-b/20"):
        with pytest.raises(argparse.ArgumentTypeError):
            script.parse_parts(bad)
    seen = []

    def audit_part(args, part):
        seen.append(part)
        if part == (3, 20):
            raise RuntimeError("out of memory")

    monkeypatch.setattr(script, "_audit_part", audit_part)
    common = ["--kernelbench", str(tmp_path), "--db", str(tmp_path / "a.sqlite")]
    assert script.main([*common, "--parts", "2-4/20"]) == script.PART_FAILED + 3
    assert seen == [(2, 20), (3, 20)]
    seen.clear()
    assert script.main([*common, "--parts", "4-5/20"]) == 0 and seen == [(4, 20), (5, 20)]


def test_the_benchmark_writes_the_html_report_with_the_audit_section(tmp_path: Path, monkeypatch) -> None:
    """``--html`` (the GPU runbook's report step) writes the HTML report with the audit's section
    beside the terminal table and the JSON summaries."""
    import kbv.protocol_audit as audit

    script = load_script("protocol_audit")
    monkeypatch.setattr(audit, "audit_protocols", lambda *a, **k: audit.AuditResult())
    html = tmp_path / "audit.html"
    assert script.main(["--db", str(tmp_path / "a.sqlite"), "--report", "--html", str(html)]) == 0
    assert 'id="protocol-audit"' in html.read_text()
