"""Executors on the CPU: the local pool and Ray give the sequential path's outcomes; crashes retry.

The real-evaluation tests use tiny problems and plain-PyTorch candidates (no compiler). Fake
``evaluate`` functions live at module level so the spawned host processes can import them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import FOUNDATION, RELU, SUITE

from kbv.batch import run_batch
from kbv.candidates import load_candidate
from kbv.execute import BatchResult, crashed_record, make_executor, run_pairs
from kbv.problems import load_problem
from kbv.protocol import protocol_from_dict
from kbv.records import Record
from kbv.worker.builds import CompileStage, compile_candidate

FAST = protocol_from_dict(
    {
        "name": "execute-test",
        "base": "standard",
        "correctness": {"draws_per_distribution": 1},
        "timing": {"repeats": 3, "warmup_calls": 1, "warmup_seconds": 0.0, "bootstrap_resamples": 10},
    }
)

CANDIDATES = {
    "1_ReLU.py": (
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
        "        return torch.relu(x)\n"
    ),
    "6_Sigmoid.py": (
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
        "        return torch.sigmoid(x) * 2.0\n"
    ),
    "7_Tanh.py": (
        "import torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
        "        raise RuntimeError('not implemented')\n"
    ),
}


def _pairs(directory: Path) -> list:
    directory.mkdir(parents=True, exist_ok=True)
    pairs = []
    for name, source in CANDIDATES.items():
        (directory / name).write_text(source)
        pairs.append((load_problem(SUITE / "level1" / name), load_candidate(directory / name, label="t")))
    return pairs


def _outcomes(records: list[Record]) -> dict[tuple[str, str], tuple[str, str | None]]:
    return {
        (r.problem["name"], Path(r.candidate["path"]).name): (r.outcome, (r.error or {}).get("kind"))
        for r in records
    }


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict]:
    pairs = _pairs(tmp_path_factory.mktemp("candidates"))
    sequential = run_batch(pairs, FAST, device="cpu")
    assert not sequential.errors
    expected = _outcomes(sequential.records)
    assert {o for o, _ in expected.values()} == {"passed", "incorrect", "runtime_error"}
    return pairs, expected


def test_local_executor_matches_sequential(batch: tuple[list, dict]) -> None:
    pairs, expected = batch
    with make_executor("local", device="cpu", workers=2) as executor:
        result = run_pairs(executor, pairs, FAST)
        stats = executor.stats()
    assert not result.errors
    assert _outcomes(result.records) == expected
    assert sum(s["evaluations"] for s in stats["slots"].values()) == len(pairs)


def test_ray_executor_matches_sequential(batch: tuple[list, dict]) -> None:
    try:
        import ray
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail('CI must run the Ray executor test: install "kernelbench-verified[ray]"')
        pytest.skip('Ray is not installed (pip install "kernelbench-verified[ray]"); CI runs this test')
    pairs, expected = batch
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with make_executor("ray", device="cpu") as executor:
            result = run_pairs(executor, pairs, FAST)
    finally:
        ray.shutdown()
    assert not result.errors
    assert _outcomes(result.records) == expected
    # Records name the driver's files, not the node-local copies the task evaluated.
    assert {r.candidate["path"] for r in result.records} == {str(c.path) for _, c in pairs}


# --- crashes and health, with fake evaluations (no workers, fast) ------------------------------


def _fake_record(problem, candidate, protocol, device: str, kind: str | None = None) -> Record:
    record = crashed_record(
        problem, candidate, protocol, {"type": device.split(":")[0], "name": "fake", "index": device}, "", []
    )
    record.outcome, record.correct, record.error = (
        ("runtime_error", False, {"kind": kind}) if kind else ("passed", True, None)
    )
    return record


def dying_evaluate(problem, candidate, protocol, device, *, timeout_s=None):
    """Kills its own host process: once for 6_Sigmoid, every time for 7_Tanh."""
    marker = Path(os.environ["KBV_TEST_MARKERS"]) / candidate.path.name
    if candidate.path.name == "7_Tanh.py" or not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return _fake_record(problem, candidate, protocol, device)


def test_killed_worker_is_retried_then_crashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _pairs(tmp_path / "candidates")
    monkeypatch.setenv("KBV_TEST_MARKERS", str(tmp_path))
    seen: list[tuple[str, Record | None, Exception | None]] = []
    with make_executor("local", device="cpu", workers=2, evaluate_fn=dying_evaluate) as executor:
        executor.map(
            pairs,
            FAST,
            timeout_s=None,
            on_record=lambda p, c, r, e: seen.append((c.path.name, r, e)),
            should_skip=lambda p, c: False,
        )
    by_name = {name: record for name, record, _ in seen}
    assert sorted(by_name) == sorted(CANDIDATES) and len(seen) == len(CANDIDATES)
    assert by_name["1_ReLU.py"].outcome == "passed"
    assert by_name["6_Sigmoid.py"].outcome == "passed"  # died once, retried on the other slot
    crashed = by_name["7_Tanh.py"]
    assert crashed.outcome == "crashed" and len(crashed.error["attempts"]) == 2
    assert {a.split(":")[0] for a in crashed.error["attempts"]} == {"cpu-worker-0", "cpu-worker-1"}


def cuda_error_on_gpu1(problem, candidate, protocol, device, *, timeout_s=None):
    if device == "cuda:0":
        time.sleep(0.3)  # a slow healthy GPU, so the failing one certainly gets work
    return _fake_record(
        problem, candidate, protocol, device, kind="cuda_error" if device == "cuda:1" else None
    )


def test_gpu_with_repeated_cuda_errors_leaves_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    pairs = _pairs(tmp_path / "candidates") * 4
    records: list[Record] = []
    executor = make_executor("local", device="cuda", gpus="0,1", evaluate_fn=cuda_error_on_gpu1)
    executor._hello = {}  # no GPU here to probe; the fake evaluation needs none
    with executor:
        executor.map(
            pairs,
            FAST,
            timeout_s=None,
            on_record=lambda p, c, r, e: records.append(r),
            should_skip=lambda p, c: False,
        )
        health = executor.health()
    assert len(records) == len(pairs)
    on_gpu1 = [r for r in records if r.device["index"] == "cuda:1"]
    assert len(on_gpu1) <= 3 and "cuda:1" in health["removed"] and "cuda:0" not in health["removed"]


def test_skipped_pairs_are_not_evaluated(tmp_path: Path) -> None:
    pairs = _pairs(tmp_path / "candidates")
    seen: list[str] = []
    with make_executor("local", device="cpu", workers=1, evaluate_fn=cuda_error_on_gpu1) as executor:
        executor.map(
            pairs,
            FAST,
            timeout_s=None,
            on_record=lambda p, c, r, e: seen.append(c.path.name),
            should_skip=lambda p, c: c.path.name != "1_ReLU.py",
        )
    assert seen == ["1_ReLU.py"]


# --- the compile stage ---------------------------------------------------------------------------

COUNTING_SOURCE = """\
# built with torch.utils.cpp_extension in real candidates; here the import only counts itself
import time
with open({counter!r}, "a") as handle:
    handle.write("x")
time.sleep(1.0)

class ModelNew:
    pass
"""


def test_concurrent_compiles_of_one_source_build_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    # The counting import writes outside its build directory, which confinement refuses (the
    # build's own confinement is tested in tests/test_containment.py); this test is about the lock.
    monkeypatch.setenv("KBV_CONFINE", "0")
    counter = tmp_path / "imports.txt"
    path = tmp_path / "1_ReLU.py"
    path.write_text(COUNTING_SOURCE.format(counter=str(counter)))
    candidate = load_candidate(path)
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(compile_candidate(candidate).status)) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["built", "cached", "cached", "cached"]
    assert counter.read_text() == "x"
    stage = CompileStage(2)
    assert stage.submit(candidate) is stage.submit(candidate)
    assert stage.submit(candidate).result().status == "cached"
    stage.close()
    assert counter.read_text() == "x"


def test_prebuild_builds_each_source_once_and_answers_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripts' up-front build: one result per candidate in the order given, a source without an
    extension skipped, a repeated source built once, and a second prebuild finding everything cached."""
    from kbv.worker.builds import prebuild

    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KBV_CONFINE", "0")  # the counters lie outside the build directory
    counters = [tmp_path / "a.txt", tmp_path / "b.txt"]
    built = []
    for name, counter in zip(("1_ReLU.py", "6_Sigmoid.py"), counters, strict=True):
        (tmp_path / name).write_text(COUNTING_SOURCE.format(counter=str(counter)))
        built.append(load_candidate(tmp_path / name))
    (tmp_path / "7_Tanh.py").write_text(CANDIDATES["1_ReLU.py"])
    plain = load_candidate(tmp_path / "7_Tanh.py")
    first = prebuild([built[0], plain, built[1], built[0]], workers=2)
    assert [r.status for r in first] == ["built", "skipped", "built", "built"]
    assert first[0] is first[3]  # one build, answered twice
    assert [r.source_sha256 for r in first[:3]] == [c.source_sha256 for c in (built[0], plain, built[1])]
    assert [r.status for r in prebuild([built[1], built[0]])] == ["cached", "cached"]
    assert [c.read_text() for c in counters] == ["x", "x"]


def test_prebuild_runs_one_wave_of_builds_within_half_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default width: every build at once when there are few, never more than half the cores
    nor ``MAX_PARALLEL_BUILDS``, and at least one build on a one-core machine."""
    from kbv.worker import builds

    monkeypatch.setattr(builds.os, "cpu_count", lambda: 16)
    assert [builds.default_build_workers(n) for n in (0, 1, 7, 8, 30)] == [1, 1, 7, 8, 8]
    monkeypatch.setattr(builds.os, "cpu_count", lambda: 2)
    assert builds.default_build_workers(7) == 1
    monkeypatch.setattr(builds.os, "cpu_count", lambda: None)
    assert builds.default_build_workers(7) == 1


def test_compare_and_demo_build_extensions_before_the_first_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_both_protocols`` (``kbv compare``, ``kbv demo``) builds every extension up front, so no
    build runs one after another inside the evaluations."""
    from rich.console import Console

    from kbv import batch

    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    # The counting import writes outside its build directory, which confinement refuses.
    monkeypatch.setenv("KBV_CONFINE", "0")
    counter = tmp_path / "built.txt"
    (tmp_path / "1_ReLU.py").write_text(COUNTING_SOURCE.format(counter=str(counter)))
    pair = (load_problem(SUITE / "level1" / "1_ReLU.py"), load_candidate(tmp_path / "1_ReLU.py"))
    built_before_evaluating = []
    monkeypatch.setattr(
        batch, "run_batch", lambda *a, **k: built_before_evaluating.append(counter.exists()) or BatchResult()
    )

    class _Store:
        def start_run(self, *args: object) -> int:
            return 1

        def finish_run(self, run_id: int) -> None:
            pass

    console = Console(record=True, width=200)
    batch.run_both_protocols(
        _Store(), [pair], command="compare", run_args={}, device="cpu", timeout_s=None, console=console
    )
    assert built_before_evaluating == [True, True]
    assert counter.read_text() == "x"
    assert "extensions: 1 built, 0 cached, 0 failed" in console.export_text()


def test_kbv_run_builds_extensions_first_on_the_sequential_path_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kbv run`` without ``--executor`` builds up front as ``kbv compare`` does; with one, the
    executor's own compile stage builds (no second, serial pass in front of it)."""
    import argparse

    from rich.console import Console

    from kbv import batch

    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    # The counting import writes outside its build directory, which confinement refuses.
    monkeypatch.setenv("KBV_CONFINE", "0")
    counter = tmp_path / "built.txt"
    (tmp_path / "1_ReLU.py").write_text(COUNTING_SOURCE.format(counter=str(counter)))
    pairs = [(load_problem(SUITE / "level1" / "1_ReLU.py"), load_candidate(tmp_path / "1_ReLU.py"))]
    seen = []
    monkeypatch.setattr(batch, "run_pairs", lambda *a, **k: seen.append(counter.exists()) or BatchResult())
    monkeypatch.setattr(
        batch, "executor_from_args", lambda *a, **k: make_executor("sequential", device="cpu")
    )
    args = argparse.Namespace(executor="local", force=False, out=None)
    batch._run_pairs(args, pairs, FAST, "cpu", None, None, 1, Console(width=200))
    args.executor = None
    batch._run_pairs(args, pairs, FAST, "cpu", None, None, 1, Console(width=200))
    assert seen == [False, True]


def test_a_build_from_another_torch_installation_is_not_taken_for_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same torch version in another environment has other header paths, and torch's own check
    then rebuilds inside the evaluation, under its timeout; the compile stage must build it first."""
    import torch

    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    # The counting import writes outside its build directory, which confinement refuses (the
    # build's own confinement is tested in tests/test_containment.py); this test is about the lock.
    monkeypatch.setenv("KBV_CONFINE", "0")
    counter = tmp_path / "imports.txt"
    path = tmp_path / "1_ReLU.py"
    marked = "from torch.utils import cpp_extension  # noqa: F401 (needs_build reads this)\n"
    path.write_text(marked + COUNTING_SOURCE.format(counter=str(counter)))
    candidate = load_candidate(path)
    assert compile_candidate(candidate).status == "built"
    assert compile_candidate(candidate).status == "cached"
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert compile_candidate(candidate).status == "built"
    assert counter.read_text() == "xx"


CPP_SOURCE = """\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_ext = load_inline(
    name="kbv_execute_test_relu",
    cpp_sources="torch::Tensor relu_fw(torch::Tensor x) { return x.clamp_min(0); }",
    functions=["relu_fw"],
)

class ModelNew(nn.Module):
    def forward(self, x):
        return _ext.relu_fw(x)
"""


@pytest.mark.slow
def test_prebuilt_extension_is_reused_by_the_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "1_ReLU.py"
    path.write_text(CPP_SOURCE)
    candidate = load_candidate(path)
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(compile_candidate(candidate).status)) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["built", "cached"], results
    built = list((tmp_path / "cache" / "builds").rglob("*.so"))
    assert len(built) == 1
    before = built[0].stat().st_mtime_ns
    from kbv.evaluation import evaluate

    record = evaluate(load_problem(SUITE / "level1" / "1_ReLU.py"), candidate, FAST, "cpu")
    assert record.outcome == "passed"
    assert built[0].stat().st_mtime_ns == before  # the worker found the build ready


# --- resume keys: a batch with a timeout, sequential or on an executor, skips what is stored ------

FAKE_TORCH = "fake-torch"


def _cpu_name() -> str:
    import platform

    return platform.processor() or platform.machine()


def keyed_evaluate(problem, candidate, protocol, device, *, timeout_s=None):
    """As ``evaluate`` does: the record's protocol carries the timeout; 7_Tanh kills its host."""
    from kbv._version import __version__

    if candidate.path.name == "7_Tanh.py" and os.environ.get("KBV_TEST_KILL_TANH"):
        os.kill(os.getpid(), signal.SIGKILL)
    record = crashed_record(
        problem, candidate, protocol.with_timeout(timeout_s), {"type": "cpu", "name": _cpu_name()}, "", []
    )
    record.outcome, record.correct, record.versions = (
        "passed",
        True,
        {"kbv": __version__, "torch": FAKE_TORCH},
    )
    return record


def test_a_batch_with_a_timeout_resumes_without_redoing_pairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kbv.execute._sequential
    from kbv.store import Store

    monkeypatch.setattr(
        kbv.execute._sequential, "probe_hello", lambda device, visible=None: {"torch": FAKE_TORCH}
    )
    pairs = _pairs(tmp_path / "candidates")
    with Store(tmp_path / "keys.sqlite") as store:
        first = run_batch(pairs, FAST, device="cpu", store=store, timeout_s=60, evaluate_fn=keyed_evaluate)
        again = run_batch(pairs, FAST, device="cpu", store=store, timeout_s=60, evaluate_fn=keyed_evaluate)
        assert (len(first.records), first.skipped) == (3, 0)
        assert (len(again.records), again.skipped) == (0, 3)
        forced = run_batch(
            pairs, FAST, device="cpu", store=store, timeout_s=60, evaluate_fn=keyed_evaluate, force=True
        )
        assert (len(forced.records), forced.skipped) == (3, 0)  # --force evaluates stored pairs again
        # The executor path uses the same keys: it resumes what the sequential path stored, and a
        # pair whose evaluation died twice (crashed) counts as finished work too.
        monkeypatch.setenv("KBV_TEST_KILL_TANH", "1")
        for timeout_s, expected in ((60, (0, 3)), (30, (3, 0)), (30, (0, 3))):
            executor = make_executor("local", device="cpu", workers=2, evaluate_fn=keyed_evaluate)
            executor._hello = {"torch": FAKE_TORCH}  # what the probe of a real worker would say here
            with executor:
                result = run_pairs(executor, pairs, FAST, store=store, timeout_s=timeout_s)
            assert (len(result.records), result.skipped) == expected, timeout_s
        outcomes = {
            (Path(r.candidate["path"]).name, r.protocol["settings"]["timeout_s"]): r.outcome
            for r in store.records()
        }
    assert outcomes[("7_Tanh.py", 30.0)] == "crashed" and outcomes[("7_Tanh.py", 60.0)] == "passed"
    assert len(outcomes) == 6


def test_the_sequential_executor_hands_each_next_evaluation_its_spares_when_a_timeout_is_given() -> None:
    """A worker's budget is the protocol's timeout, so spares must be made for the protocol with the
    timeout the evaluations run under; made without it, no candidate spare was ever taken (each
    candidate worker booted cold) and the untaken ones stayed alive until the batch ended."""
    from kbv.evaluation import worker_specs
    from kbv.protocol import STANDARD
    from kbv.worker import Spares

    problem = load_problem(SUITE / "level1" / "1_ReLU.py")
    pairs = [
        (problem, load_candidate(FOUNDATION / name))
        for name in ("relu_plain.py", "identity.py", "relu_plain.py")
    ]
    launched_ahead: list[tuple[bool, bool]] = []
    idle_after: list[int] = []

    def fake_evaluate(problem, candidate, protocol, device, *, timeout_s=None, spares: Spares) -> None:
        protocol = protocol.with_timeout(timeout_s)  # as kbv.evaluation.evaluate does
        workers = [spares.take(spec) for spec in worker_specs(problem, candidate, protocol, device)]
        launched_ahead.append(tuple(w.pid is not None for w in workers))
        spares.launch_expected()
        idle_after.append(sum(len(w) for w in spares._launched.values()))
        for worker in workers:
            worker.close()

    fake_evaluate.uses_spares = True  # type: ignore[attr-defined]
    executor = make_executor("sequential", device="cpu", evaluate_fn=fake_evaluate)
    executor.map(pairs, STANDARD, timeout_s=37.0, on_record=lambda *a: None, should_skip=lambda p, c: False)
    # The first pair boots its own; each later pair finds both its workers launched ahead.
    assert launched_ahead == [(False, False), (True, True), (True, True)]
    assert idle_after == [2, 2, 0]  # only the next pair's workers wait; none is left over


def test_spares_that_no_coming_evaluation_wants_are_closed() -> None:
    from kbv.worker import Spares, WorkerSpec

    kept = WorkerSpec(build_key="test-kept", device="cpu", role="reference", budget_s=60)
    dropped = WorkerSpec(build_key="test-dropped", device="cpu", role="reference", budget_s=60)
    with Spares(depth=2) as spares:
        spares.expect([[kept], [dropped]])
        spares.launch_expected()
        orphan = spares._launched[next(k for k in spares._launched if k[0] == "test-dropped")][0]
        spares.expect([[kept]])  # the pair that wanted ``dropped`` was skipped
        spares.launch_expected()
        assert orphan.pid is not None and not orphan.alive()
        assert [k[0] for k, w in spares._launched.items() if w] == ["test-kept"]


def test_the_gpu_tests_batch_gives_each_pair_its_own_record() -> None:
    """The GPU tests' shared batch (tests/conftest.py), run on the CPU: records come back keyed by
    the pairs as the tests name them (a path with ``..`` in it included), in a different order from
    the batch's, each with its own verdict."""
    import conftest

    relative = FOUNDATION / ".." / "foundation" / "identity.py"
    pairs = [(RELU, FOUNDATION / "relu_plain.py", None), (RELU, relative, None)]
    results = conftest._evaluate_on_gpu(pairs, timeout_s=240, device="cpu")
    assert set(results) == set(pairs)
    assert results[pairs[0]].outcome == "passed"
    assert results[pairs[1]].outcome == "hack_detected"  # it returns its input
    assert results[pairs[0]].candidate["path"].endswith("relu_plain.py")
    assert results[pairs[0]].protocol["settings"].get("precision", "fp32") == "fp32"


def test_the_gpu_tests_batch_evaluates_in_the_pairs_precision() -> None:
    """A half-precision batch of the GPU tests (tests/conftest.py) runs the protocol in that
    precision, and one batch never mixes precisions."""
    import conftest

    pair = (RELU, FOUNDATION / "relu_plain.py", "bf16")
    record = conftest._evaluate_on_gpu([pair], timeout_s=240, device="cpu")[pair]
    assert record.outcome == "passed", record.error
    assert record.protocol["settings"]["precision"] == "bf16"
    with pytest.raises(ValueError, match="one batch runs one precision"):
        conftest._evaluate_on_gpu(
            [pair, (RELU, FOUNDATION / "relu_plain.py", None)], timeout_s=240, device="cpu"
        )
