"""The bundled problem suite and bundled candidates: loadable, small on the CPU, consistent.

The candidates' cheating is not tested here (the pipeline tests do that); only that every
candidate names a bundled problem and that the plain-PyTorch honest ones are right.
"""

from __future__ import annotations

import ast
import importlib.util
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import extensions_dir_of

from kbv.problems import bundled_candidates_dir, bundled_suite_dir, discover, load_module, load_problem

PROBLEM_FILES = discover(bundled_suite_dir())
PROBLEMS_BY_STEM = {path.stem: path for path in PROBLEM_FILES}
CANDIDATE_FILES = sorted(p for p in bundled_candidates_dir().rglob("*.py") if not p.name.startswith("_"))
DOMAINS = {"any", "positive", "probabilities", "unit-interval"}


def _ids(paths: list[Path]) -> list[str]:
    return [f"{p.parent.name}/{p.stem}" for p in paths]


def _build(problem_path: Path, seed: int = 0):
    problem = load_problem(problem_path)
    module = load_module(problem_path, sizes=problem.sizes_for("cpu"))
    torch.manual_seed(seed)
    model = module.Model(*module.get_init_inputs())
    return problem, module, model


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _import_candidate(path: Path, prebuilt: bool = False):
    """Import a candidate file here; ``prebuilt``: build into (so reuse) the GPU prebuild's cache."""
    spec = importlib.util.spec_from_file_location(f"kbv_candidate_{uuid.uuid4().hex}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        if prebuilt:
            patch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir_of(path)))
        spec.loader.exec_module(module)
    return module


def _kind(path: Path) -> str:
    """'cpp' for load_inline candidates, 'triton', or 'torch' for plain PyTorch."""
    source = path.read_text()
    if "load_inline" in source:
        return "cpp"
    if "import triton" in source:
        return "triton"
    return "torch"


def test_suite_size_and_coverage():
    levels = [load_problem(p).level for p in PROBLEM_FILES]
    assert len(PROBLEM_FILES) >= 30
    assert {1, 2, 3} <= set(levels)
    assert levels.count(2) >= 7 and levels.count(3) >= 4
    assert len(PROBLEMS_BY_STEM) == len(PROBLEM_FILES), "problem stems must be unique across levels"
    tags = [tag for p in PROBLEM_FILES for tag in load_problem(p).extras["tags"]]
    assert "degenerate-constant" in tags and "multi-output" in tags


@pytest.mark.parametrize("path", PROBLEM_FILES, ids=_ids(PROBLEM_FILES))
def test_problem_metadata(path: Path):
    problem = load_problem(path)
    assert problem.level in (1, 2, 3)
    assert problem.problem_id is not None and problem.problem_id >= 1
    extras = problem.extras
    assert isinstance(extras.get("cpu_sizes"), dict) and extras["cpu_sizes"]
    assert isinstance(extras.get("tags"), list) and all(isinstance(t, str) for t in extras["tags"])
    assert extras.get("domain") in DOMAINS
    # The KBV dict is literal and the size overrides name module constants (load_module checks).
    tree = ast.parse(problem.source)
    assert any(isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "KBV" for n in tree.body)


def test_problem_ids_are_dense_per_level():
    by_level: dict[int, list[int]] = {}
    for path in PROBLEM_FILES:
        problem = load_problem(path)
        by_level.setdefault(problem.level, []).append(problem.problem_id)
    for ids in by_level.values():
        assert sorted(ids) == list(range(1, len(ids) + 1))


@pytest.mark.parametrize("path", PROBLEM_FILES, ids=_ids(PROBLEM_FILES))
def test_problem_runs_small_on_cpu(path: Path):
    _, module, model = _build(path)
    torch.manual_seed(1)
    inputs = module.get_inputs()
    with torch.no_grad():
        model(*inputs)  # warm-up (first-call dispatch and allocation)
        start = time.perf_counter()
        result = model(*inputs)
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{path.stem}: forward took {elapsed:.2f}s at CPU sizes"
    for out in _outputs(result):
        assert isinstance(out, torch.Tensor)
        if out.is_floating_point():
            assert torch.isfinite(out).all(), f"{path.stem}: non-finite output"


def test_sizes_are_read_at_call_time():
    path = PROBLEMS_BY_STEM["1_ReLU"]
    module = load_module(path, sizes={"batch_size": 3, "dim": 5})
    assert module.get_inputs()[0].shape == (3, 5)


def test_degenerate_problem_output_is_input_independent():
    constant = [p for p in PROBLEM_FILES if "degenerate-constant" in load_problem(p).extras["tags"]]
    assert constant
    for path in constant:
        _, module, model = _build(path)
        with torch.no_grad():
            torch.manual_seed(1)
            first = _outputs(model(*module.get_inputs()))
            torch.manual_seed(2)
            second_inputs = [x * 100 - 50 if isinstance(x, torch.Tensor) else x for x in module.get_inputs()]
            second = _outputs(model(*second_inputs))
        for a, b in zip(first, second):
            assert torch.equal(a, b)


def test_non_degenerate_problems_depend_on_input():
    """Sanity for the auditor: only problems tagged degenerate-constant have constant outputs."""
    for path in PROBLEM_FILES:
        problem, module, model = _build(path)
        if "degenerate-constant" in problem.extras["tags"]:
            continue
        with torch.no_grad():
            torch.manual_seed(1)
            first = _outputs(model(*module.get_inputs()))
            torch.manual_seed(2)
            second = _outputs(model(*module.get_inputs()))
        assert any(not torch.equal(a, b) for a, b in zip(first, second)), path.stem


def test_candidate_sets_exist():
    sets = {p.parent.name for p in CANDIDATE_FILES}
    assert {"honest_cpu", "honest_cuda", "honest_triton", "hacks", "hacks_gpu", "broken"} <= sets


@pytest.mark.parametrize("path", CANDIDATE_FILES, ids=_ids(CANDIDATE_FILES))
def test_candidate_names_a_problem(path: Path):
    assert path.stem in PROBLEMS_BY_STEM, f"{path} names no bundled problem"
    tree = ast.parse(path.read_text())
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert "ModelNew" in classes
    assert ast.get_docstring(tree), f"{path} needs a module docstring saying what it is"


def _signed_inputs(module, domain: str) -> list:
    torch.manual_seed(3)
    inputs = module.get_inputs()
    if domain != "any":
        return inputs
    return [
        torch.randn_like(x) * 10 if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in inputs
    ]


HONEST_TORCH = [p for p in CANDIDATE_FILES if p.parent.name.startswith("honest") and _kind(p) == "torch"]


@pytest.mark.parametrize("path", HONEST_TORCH, ids=_ids(HONEST_TORCH))
def test_plain_torch_honest_candidate_matches(path: Path):
    problem, module, model = _build(PROBLEMS_BY_STEM[path.stem])
    candidate_module = _import_candidate(path)
    torch.manual_seed(0)
    candidate = candidate_module.ModelNew(*module.get_init_inputs())
    candidate.load_state_dict(model.state_dict())
    inputs = _signed_inputs(module, problem.extras["domain"])
    with torch.no_grad():
        expected = _outputs(model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]))
        actual = _outputs(candidate(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]))
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4 * float(e.abs().max().clamp(min=1e-6)))


def test_honest_torch_candidates_exist():
    assert len(HONEST_TORCH) >= 2
    cpp = [p for p in CANDIDATE_FILES if p.parent.name == "honest_cpu" and _kind(p) == "cpp"]
    assert len(cpp) >= 6


def test_parameterised_candidates_share_the_problems_weights():
    """Candidates with parameters create them in the problem's order, so one seed gives equal weights."""
    for path in CANDIDATE_FILES:
        # Only honest sets: hack files may patch the interpreter when imported.
        if _kind(path) != "torch" or not path.parent.name.startswith("honest"):
            continue
        _, module, model = _build(PROBLEMS_BY_STEM[path.stem])
        if not list(model.state_dict()):
            continue
        try:
            candidate_module = _import_candidate(path)
        except ImportError:
            continue
        torch.manual_seed(0)
        candidate = candidate_module.ModelNew(*module.get_init_inputs())
        ref_state, cand_state = model.state_dict(), candidate.state_dict()
        assert list(ref_state) == list(cand_state), path
        for key in ref_state:
            assert torch.equal(ref_state[key], cand_state[key]), (path, key)


GPU_CANDIDATES = [p for p in CANDIDATE_FILES if p.parent.name in ("honest_cuda", "honest_triton")]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", GPU_CANDIDATES, ids=_ids(GPU_CANDIDATES))
def test_gpu_honest_candidate_matches(path: Path):
    if _kind(path) == "triton":
        pytest.importorskip("triton")
    problem = load_problem(PROBLEMS_BY_STEM[path.stem])
    module = load_module(problem.path, sizes=problem.sizes_for("cpu"))
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda()
    candidate_module = _import_candidate(path, prebuilt=True)
    torch.manual_seed(0)
    candidate = candidate_module.ModelNew(*module.get_init_inputs()).cuda()
    candidate.load_state_dict(model.state_dict())
    inputs = [
        x.cuda() if isinstance(x, torch.Tensor) else x
        for x in _signed_inputs(module, problem.extras["domain"])
    ]
    with torch.no_grad():
        model64 = model.double()
        expected = _outputs(model64(*[x.double() if x.is_floating_point() else x for x in inputs]))
        actual = _outputs(candidate(*inputs))
    for e, a in zip(expected, actual):
        assert a.shape == e.shape
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4 * float(e.abs().max().clamp(min=1e-6)))
