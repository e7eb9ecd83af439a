from __future__ import annotations

import inspect
import io
import shutil
from pathlib import Path

import pytest
from conftest import FOUNDATION, ROOT, SUITE
from rich.console import Console

from kbv.batch import run_batch
from kbv.candidates import load_candidate
from kbv.evaluation import evaluate
from kbv.problems import (
    ProblemError,
    bundled_suite_dir,
    check_importable,
    discover,
    load_module,
    load_problem,
    load_problems,
    load_source,
)
from kbv.protocol import load_protocol

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


def test_a_problem_is_loaded_from_the_text_read_and_its_module_names_no_path(tmp_path: Path) -> None:
    path = tmp_path / "1_ReLU.py"
    shutil.copy(SUITE / "level1" / "1_ReLU.py", path)
    problem = load_problem(path)
    path.write_text("raise RuntimeError('not the text that was read')\n")
    module = problem.load(problem.sizes_for("cpu"))  # the file's new text would raise
    assert not hasattr(module, "__file__")
    code_file = module.Model.forward.__code__.co_filename
    assert str(tmp_path) not in code_file and "1_ReLU" not in code_file
    assert "def forward" in inspect.getsource(module.Model.forward)  # tracebacks still show lines
    assert problem.changed_on_disk() and problem.ref_checked()["changed_on_disk"] is True
    assert "changed_on_disk" not in problem.ref()


def test_an_unchanged_problem_is_not_reported_changed() -> None:
    problem = load_problem(SUITE / "level1" / "1_ReLU.py")
    assert not problem.changed_on_disk() and "changed_on_disk" not in problem.ref_checked()


def test_a_problem_text_that_fails_names_the_problem_not_a_path() -> None:
    with pytest.raises(ProblemError, match="problem 7_X has a syntax error on line 1"):
        load_source("def (", label="7_X")
    with pytest.raises(ProblemError, match="problem 7_X failed to import: ZeroDivisionError"):
        load_source("x = 1 / 0\n", label="7_X")
    with pytest.raises(ProblemError, match="size override 'nope' names no module constant"):
        load_source("a = 1\n", sizes={"nope": 2}, label="7_X")


_NEW_REFERENCE = """
class Model(Model):
    def forward(self, x):
        return torch.where(x > 0, x, 0.5 * x) + 1e-3
"""


def test_a_batch_that_sees_its_problem_change_warns_and_keeps_the_text_it_read(tmp_path: Path) -> None:
    path = tmp_path / "1_ReLU.py"
    original = (SUITE / "level1" / "1_ReLU.py").read_text()
    path.write_text(original)
    problem = load_problem(path)
    pairs = [(problem, load_candidate(FOUNDATION / name)) for name in ("relu_plain.py", "relu_wrong.py")]

    def evaluate_after_an_edit(problem, candidate, protocol, device, *, timeout_s=None):
        if path.read_text() == original:  # the file changes while the batch runs
            path.write_text(original + _NEW_REFERENCE)
        return evaluate(problem, candidate, protocol, device, timeout_s=timeout_s)

    out = io.StringIO()
    result = run_batch(
        pairs,
        load_protocol("standard"),
        device="cpu",
        console=Console(file=out, width=300),
        evaluate_fn=evaluate_after_an_edit,
    )
    plain, wrong = result.records
    # Both pairs judged the text read at the start: ReLU is right, relu_wrong wrong; the new text
    # (whose reference is relu_wrong's function) would have judged them the other way round.
    assert (plain.outcome, wrong.outcome) == ("passed", "incorrect")
    assert all(r.problem["changed_on_disk"] is True for r in result.records)
    assert all(r.problem["source_sha256"] == problem.source_sha256 for r in result.records)
    assert out.getvalue().count("changed on disk during the batch") == 1, out.getvalue()
