"""Shared test set-up: a private build cache, the repository root, and the GPU marker."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "src" / "kbv" / "suite" / "problems"
FOUNDATION = ROOT / "tests" / "fixtures" / "candidates" / "foundation"
RELU = SUITE / "level1" / "1_ReLU.py"


def pytest_configure(config: pytest.Config) -> None:
    # One build cache per test session so CI compiles each source once.
    if "KBV_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["KBV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kbv-test-cache-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Sources the GPU tests import that build CUDA extensions at import time, in the order the tests
#: need them (the builds run six at a time beside the tests: on the H200 `gpu_illegal_launch` waited
#: 58 s for its build while it was queued behind the suite's candidates, needed only at the end).
_GPU_BUILDS = (
    ROOT / "tests" / "fixtures" / "candidates" / "hacks",
    ROOT / "tests" / "fixtures" / "candidates" / "gpu",
    ROOT / "src" / "kbv" / "suite" / "candidates" / "hacks_gpu",
    ROOT / "src" / "kbv" / "suite" / "candidates" / "honest_cuda",
)


@pytest.fixture(scope="session", autouse=True)
def _gpu_sources_prebuilt(request: pytest.FixtureRequest) -> None:
    """On a GPU run, build every CUDA source the collected GPU tests use once, side by side, while the tests
    run: built one after another inside the tests, eight builds of 40-70 s each took the whole
    5-minute budget on the H200, and waiting for all of them first took 150 s. The build cache is
    the one evaluation workers read (``kbv.worker.builds``), and an evaluation that needs a source
    still being built waits for it on the source's build lock, so no test builds anything and
    tests that need no build do not wait."""
    if not any("gpu" in item.keywords for item in request.session.items):
        return
    import torch

    if not torch.cuda.is_available():
        return
    from concurrent.futures import ThreadPoolExecutor

    from kbv import telemetry
    from kbv.candidates import load_candidate
    from kbv.worker.builds import arch_list_for, compile_candidate, needs_build

    # Only what a collected test names (its parameter id is the source's stem, or folder/stem): one
    # GPU test run alone spent 36 s of its teardown waiting for six builds no test of it used.
    ids = {item.callspec.id for item in request.session.items if hasattr(item, "callspec")}
    sources = [
        p
        for d in _GPU_BUILDS
        for p in sorted(d.glob("*.py"))
        if (p.stem in ids or f"{p.parent.name}/{p.stem}" in ids) and needs_build(p.read_text())
    ]
    arch = arch_list_for(telemetry.compute_capability("cuda:0"))
    # Six at a time (two compiler processes each) leave cores to the tests that time kernels
    # meanwhile; an evaluation that needs a source waits on its build lock while it builds.
    pool = ThreadPoolExecutor(max_workers=6, thread_name_prefix="kbv-test-prebuild")
    futures = [
        pool.submit(lambda p: compile_candidate(load_candidate(p, label="prebuild"), arch_list=arch), path)
        for path in sources
    ]

    def wait_for_builds() -> None:
        # Builds no test is left to use are not started: a run of five GPU tests otherwise spent
        # 88 s of its teardown building every other source. Those running are waited for (their
        # compilers must not outlive the session), and a build that failed still fails the run.
        pool.shutdown(wait=True, cancel_futures=True)
        for future in futures:
            if not future.cancelled():
                future.result()

    request.addfinalizer(wait_for_builds)


def peak_rss_rise(imports: str, tensor: str, check: str) -> int:
    """Bytes by which ``check`` (a Python expression that must be true) raises the peak resident
    memory of a fresh process that ran ``imports`` and made ``x = tensor`` first: what a CPU test
    can see of a temporary as large as its input. A process of its own, so no earlier test's peak
    hides it."""
    import subprocess
    import sys

    script = (
        f"import resource, torch\n{imports}\n"
        "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        f"x = {tensor}\n"
        "start = peak()\n"
        f"assert {check}\n"
        "print(peak() - start)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    return int(run.stdout)


def extensions_dir_of(path: Path) -> Path:
    """Where the prebuild put a source's extensions: an in-process import that builds there reuses them."""
    from kbv.candidates import load_candidate
    from kbv.worker.builds import build_dir

    return build_dir(load_candidate(path, label="prebuild").source_sha256) / "torch_extensions"


@contextlib.contextmanager
def reference_worker(
    name: str, problem: Path, sizes: dict | None = None, device: str = "cpu"
) -> Iterator[Any]:
    """A started trusted reference worker on ``device`` with ``problem`` loaded (and its model built)."""
    from kbv import wire
    from kbv.worker import Worker, WorkerSpec

    spec = WorkerSpec(build_key=f"test-{name}", device=device, role="reference", budget_s=120.0)
    with Worker(spec) as worker:
        worker.start()
        worker.request(
            wire.Load(
                role="reference",
                device=device,
                problem_source=problem.read_text(),
                sizes=sizes or {},
                init_seed=1,
            )
        )
        yield worker


def load_relu_candidate(worker: Any, candidate: Path) -> Any:
    """Start a CPU candidate ``worker`` and load ``candidate`` against a small 1_ReLU (2 x 8); the
    worker's reply to the load."""
    from kbv import wire

    worker.start()
    return worker.request(
        wire.Load(
            role="candidate",
            device="cpu",
            problem_source=RELU.read_text(),
            sizes={"batch_size": 2, "dim": 8},
            candidate_path=str(candidate),
            init_seed=1,
        )
    )


#: The limit of one evaluation of the GPU batch, as `pytest --timeout` limits one test on the GPU
#: machine (benchmarks/gpu_steps.sh): a hanging candidate ends as `timeout`, not as a stuck batch.
GPU_BATCH_PAIR_TIMEOUT_S = 150
#: The limit of an evaluation outside the batch (KernelBench-size problems among them).
GPU_SINGLE_TIMEOUT_S = 600
#: The pytest-timeout of a test marked ``gpu_batch``: the first of them runs the whole batch.
GPU_BATCH_TEST_TIMEOUT_S = 1200

#: (problem, candidate, precision) of the selected ``gpu_batch`` tests, in collection order; then
#: what each gave (a record, or the harness's error text). Precision None is the protocol's own.
_gpu_batch_pairs: list[tuple[Path, Path, str | None]] = []
_gpu_results: dict[tuple[Path, Path, str | None], Any] = {}


def gpu_batch(problem: Path, candidate: Path, precision: str | None = None, *, id: str | None = None) -> Any:
    """A parameter for a GPU test that asserts on ``verified_on_gpu(problem, candidate, precision)``:
    the session evaluates every selected such pair of one precision in one batch, as a user's batch
    runs."""
    return pytest.param(
        candidate,
        marks=[
            pytest.mark.gpu_batch(problem, candidate, precision),
            pytest.mark.timeout(GPU_BATCH_TEST_TIMEOUT_S),
        ],
        id=id or candidate.stem,
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    # A test that asserts on several pairs carries one ``gpu_batch`` mark for each.
    for item in session.items:
        for marker in item.iter_markers("gpu_batch"):
            precision = marker.args[2] if len(marker.args) > 2 else None
            pair = (Path(marker.args[0]), Path(marker.args[1]), precision)
            if pair not in _gpu_batch_pairs:
                _gpu_batch_pairs.append(pair)


def verified_on_gpu(problem: Path, candidate: Path, precision: str | None = None) -> Any:
    """The `verified` record of (problem, candidate) on CUDA in ``precision`` (None: the protocol's
    own), evaluated once per test session: GPU tests that assert different things of one pair share
    its record. The first test that asks for a pair of the ``gpu_batch`` tests evaluates all of them
    of its precision in one batch (the next pairs' workers boot while one is evaluated: about 4 s an
    evaluation in a batch on the H200 against 9 s alone, and `pytest -m gpu` has a five-minute
    budget); any other pair is evaluated alone. Fresh secret seeds as always; each pair still gets
    fresh workers."""
    key = (Path(problem), Path(candidate), precision)
    if key not in _gpu_results:
        batched = key in _gpu_batch_pairs and not os.environ.get("PYTEST_XDIST_WORKER")
        if batched:
            pending = [p for p in _gpu_batch_pairs if p not in _gpu_results and p[2] == precision]
            _gpu_results.update(_evaluate_on_gpu(pending, timeout_s=GPU_BATCH_PAIR_TIMEOUT_S))
        else:
            _gpu_results.update(_evaluate_on_gpu([key], timeout_s=GPU_SINGLE_TIMEOUT_S))
    result = _gpu_results[key]
    if isinstance(result, str):
        pytest.fail(f"the harness failed on {key[1].name} against {key[0].name}: {result}")
    return result


def _evaluate_on_gpu(
    pairs: list[tuple[Path, Path, str | None]], *, timeout_s: float, device: str = "cuda"
) -> dict[tuple[Path, Path, str | None], Any]:
    """One batch under `verified` of pairs of one precision; per pair its record, or the batch's
    harness errors as text."""
    from rich.console import Console

    from kbv.batch import run_batch
    from kbv.candidates import load_candidate
    from kbv.problems import check_importable, load_problem
    from kbv.protocol import load_protocol

    precisions = {p[2] for p in pairs}
    if len(precisions) != 1:
        raise ValueError(f"one batch runs one precision; these pairs ask for {sorted(map(str, precisions))}")
    (precision,) = precisions
    loaded = []
    for problem_path, candidate_path, _ in pairs:
        problem = load_problem(problem_path)
        check_importable(problem)
        loaded.append((problem, load_candidate(candidate_path)))
    result = run_batch(
        loaded,
        load_protocol("verified").with_precision(precision),
        device=device,
        timeout_s=timeout_s,
        console=Console(quiet=True),
    )
    by_paths = {_resolved((Path(r.problem["path"]), Path(r.candidate["path"]))): r for r in result.records}
    errors = "; ".join(f"{what}: {why}" for what, why in result.errors) or "no record came back"
    return {pair: by_paths.get(_resolved(pair[:2]), errors) for pair in pairs}


def _resolved(pair: tuple[Path, Path]) -> tuple[Path, Path]:
    return (pair[0].resolve(), pair[1].resolve())
