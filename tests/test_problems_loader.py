from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, SUITE

from kbv.problems import (
    ProblemError,
    bundled_suite_dir,
    check_importable,
    discover,
    load_module,
    load_problem,
    load_problems,
)

BAD = ROOT / "tests" / "fixtures" / "problems_bad"


def test_bundled_suite_is_kernelbench_shaped() -> None:
    problems, errors = load_problems(bundled_suite_dir())
    assert errors == []
    assert len(problems) >= 30
    assert {p.level for p in problems} == {1, 2, 3}
    relu = next(p for p in problems if p.name == "1_ReLU")
    assert (relu.level, relu.problem_id) == (1, 1)
    assert len(relu.source_sha256) == 64


def test_kernelbench_tree_loads_unchanged(tmp_path: Path) -> None:
    tree = tmp_path / "KernelBench" / "level2"
    tree.mkdir(parents=True)
    source = (SUITE / "level1" / "1_ReLU.py").read_text().split("KBV = {")[0] + (
        "\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
        "\ndef get_inputs():\n    return [torch.rand(batch_size, dim)]\n\ndef get_init_inputs():\n"
        "    return []\n"
    )
    (tree / "17_Matmul_ReLU.py").write_text(source)
    (tree / "3_Other.py").write_text(source)
    files = discover(tmp_path / "KernelBench")
    assert [f.name for f in files] == ["3_Other.py", "17_Matmul_ReLU.py"]
    problem = load_problem(files[1])
    assert (problem.name, problem.level, problem.problem_id, problem.extras) == ("17_Matmul_ReLU", 2, 17, {})
    assert problem.sizes_for("cpu") == {}  # KernelBench files keep their own sizes


def test_size_profile_overrides_module_constants() -> None:
    problem = load_problem(SUITE / "level1" / "1_ReLU.py")
    module = load_module(problem.path, sizes=problem.sizes_for("cpu"))
    (x,) = module.get_inputs()
    assert list(x.shape) == [problem.extras["cpu_sizes"]["batch_size"], problem.extras["cpu_sizes"]["dim"]]


@pytest.mark.parametrize(
    ("name", "message"),
    [("1_NoInputs.py", "does not define get_inputs"), ("3_Syntax.py", "syntax error on line 1")],
)
def test_broken_problem_files_are_named_with_the_reason(name: str, message: str) -> None:
    with pytest.raises(ProblemError, match=message) as info:
        load_problem(BAD / name)
    assert name in str(info.value)


def test_problem_that_fails_to_import() -> None:
    problem = load_problem(BAD / "2_ImportFails.py")
    with pytest.raises(ProblemError, match="failed to import: RuntimeError: this problem file is broken"):
        check_importable(problem)


def test_directory_load_keeps_going_past_broken_files() -> None:
    problems, errors = load_problems(BAD)
    assert problems and problems[0].name == "2_ImportFails"  # parses; fails only on import
    assert sorted(Path(f).name for f, _ in errors) == ["1_NoInputs.py", "3_Syntax.py"]


def test_missing_path() -> None:
    with pytest.raises(ProblemError, match="does not exist"):
        load_problem("/no/such/problem.py")
