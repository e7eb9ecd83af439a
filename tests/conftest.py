"""Shared test set-up: a private build cache, the repository root, and the GPU marker."""

from __future__ import annotations

import functools
import os
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


def extensions_dir_of(path: Path) -> Path:
    """Where the prebuild put a source's extensions: an in-process import that builds there reuses them."""
    from kbv.candidates import load_candidate
    from kbv.worker.builds import build_dir

    return build_dir(load_candidate(path, label="prebuild").source_sha256) / "torch_extensions"


@functools.cache
def verified_on_gpu(problem: Path, candidate: Path) -> Any:
    """One `verified` evaluation on CUDA per (problem, candidate) in a test session: GPU tests that
    assert different things of the same pair share its record (each evaluation is seconds on the
    H200, and `pytest -m gpu` has a five-minute budget). Fresh secret seeds as always."""
    from kbv.api import evaluate_paths

    return evaluate_paths(problem, candidate, protocol="verified", device="cuda", timeout_s=600)
