"""Ahead-of-time compilation: build a candidate's extensions before a GPU slot needs them.

A build runs ``kbv.child.build`` in a fresh process with the worker's scrubbed environment
and the very ``TORCH_EXTENSIONS_DIR`` / ``TRITON_CACHE_DIR`` that ``kbv.worker.Worker`` gives the
candidate worker (``cache_root()/builds/<source sha[:32]>``), so the evaluation worker later finds
the build done and ninja has nothing to do.

The cache is keyed by source hash (the directory) and toolchain (a marker file per toolchain inside
it). An exclusive ``flock`` on ``<build dir>/.lock`` makes concurrent compilations of one source,
from threads, processes or two ``kbv`` commands on one host, build it once: the first holder builds
and writes the marker, the others wait and then find the marker.

Only extensions built at import time (``torch.utils.cpp_extension.load_inline`` at module level, as
KernelBench candidates do) are prebuilt. Triton compiles on first launch and needs the GPU; it is
left to the evaluation worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from kbv import telemetry
from kbv.candidates import Candidate
from kbv.worker._env import arch_list_for, scrubbed_env
from kbv.worker._process import _kbv_src
from kbv.worker._spec import cache_root, confinement_env

__all__ = [
    "CompileResult",
    "CompileStage",
    "arch_list_for",
    "build_dir",
    "build_lock",
    "compile_candidate",
    "known_build_failure",
    "needs_build",
    "prebuild",
]

BUILD_TIMEOUT_S = 900.0


@dataclass
class CompileResult:
    """What the compile stage did for one candidate source."""

    source_sha256: str
    status: str  # "built" | "cached" | "failed" | "skipped" (nothing built at import time)
    seconds: float = 0.0
    message: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def needs_build(source: str) -> bool:
    """Whether importing the source may build a C++/CUDA extension (worth doing ahead of time)."""
    return "cpp_extension" in source or "load_inline" in source


def build_dir(source_sha256: str) -> Path:
    """Must match ``Worker.launch``: ``cache_root()/builds/<build_key[:32]>``."""
    return cache_root() / "builds" / source_sha256[:32]


def toolchain(arch_list: str | None) -> dict[str, str]:
    """What, besides the source, decides the built binary. Read without initialising CUDA."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        # torch's headers are where it is installed: the same version in another environment gives
        # other include paths, and torch's own build check then rebuilds inside the evaluation (a
        # demo in a second virtualenv timed out its three C++ candidates there, "cached" here).
        "torch_dir": os.path.dirname(torch.__file__),
        "cuda": str(torch.version.cuda),
        "arch_list": arch_list or "",
        "cuda_home": os.environ.get("CUDA_HOME", ""),
        "cxx": os.environ.get("CXX", ""),
        "cc": os.environ.get("CC", ""),
    }


def compile_candidate(
    candidate: Candidate, *, arch_list: str | None = None, timeout_s: float = BUILD_TIMEOUT_S
) -> CompileResult:
    """Build the candidate's import-time extensions into the shared cache, at most once per toolchain."""
    sha = candidate.source_sha256
    if not needs_build(candidate.source):
        return CompileResult(sha, "skipped")
    directory = build_dir(sha)
    extensions, triton_dir = directory / "torch_extensions", directory / "triton"
    extensions.mkdir(parents=True, exist_ok=True)
    triton_dir.mkdir(parents=True, exist_ok=True)
    tools = toolchain(arch_list)
    marker = directory / f".kbv-built-{_digest(tools)}.json"
    started = time.monotonic()
    with build_lock(sha):
        if marker.exists():
            return CompileResult(sha, "cached", time.monotonic() - started)
        ok, message = _run_build_child(candidate, extensions, triton_dir, arch_list, timeout_s)
        result = CompileResult(sha, "built" if ok else "failed", time.monotonic() - started, message)
        # A failed build is remembered too: the evaluation worker will retry it and report it.
        marker.write_text(json.dumps({"toolchain": tools, **result.to_dict()}))
        return result


@contextlib.contextmanager
def build_lock(source_sha256: str) -> Iterator[None]:
    """Hold the source's build directory exclusively (``flock`` on ``<build dir>/.lock``), across
    threads, processes and ``kbv`` commands on one host, and clear stale torch build locks in it.

    ``torch.utils.cpp_extension`` guards a build with an empty ``lock`` file that it deletes when
    done; a build killed midway (a timeout kills the worker's process group) leaves it behind, and
    every later import of that source then waits on it forever. Builds of one source happen under
    this lock (the compile stage, and the evaluation worker's import), so while we hold it any such
    file is stale. Released when the file closes, also if we die."""
    directory = build_dir(source_sha256)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in (directory / "torch_extensions").glob("*/lock"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def known_build_failure(source_sha256: str) -> str | None:
    """The compiler's message when the compile stage already failed to build this source with this
    torch and Python: the evaluation then reports ``compile_error`` without building it again."""
    import torch

    for marker in sorted(build_dir(source_sha256).glob(".kbv-built-*.json")):
        try:
            entry = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        tools = entry.get("toolchain", {})
        same = tools.get("torch") == torch.__version__ and tools.get("python") == platform.python_version()
        message = str(entry.get("message", ""))
        if same and entry.get("status") == "failed" and "Error building extension" in message:
            return message
    return None


def _run_build_child(
    candidate: Candidate, extensions: Path, triton_dir: Path, arch_list: str | None, timeout_s: float
) -> tuple[bool, str]:
    home = Path(tempfile.mkdtemp(prefix="kbv-build-"))
    try:
        env = scrubbed_env(
            os.environ, home=home, extensions_dir=extensions, triton_dir=triton_dir, visible_devices=""
        )
        if arch_list:
            env["TORCH_CUDA_ARCH_LIST"] = arch_list
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_kbv_src(), env.get("PYTHONPATH", "")) if p)
        env.update(confinement_env((home, extensions.parent), gpu=False))  # it runs the candidate's import
        source = home / candidate.path.name  # the bytes that were hashed, not whatever is on disk now
        source.write_text(candidate.source)
        log = home / "build.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kbv.child.build", str(source)],
                env=env,
                cwd=home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_group(proc.pid)
                proc.wait()
        tail = log.read_bytes()[-2000:].decode(errors="replace")
        if code is None:
            return False, f"build timed out after {timeout_s:.0f} s"
        return code == 0, "" if code == 0 else tail
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def prebuild(
    candidates: list[Candidate],
    *,
    device: str = "cpu",
    workers: int | None = None,
    on_result: Callable[[Candidate, CompileResult], None] | None = None,
) -> list[CompileResult]:
    """Build every candidate's import-time extensions side by side, before any evaluation starts,
    with the arch list the evaluation worker will use on ``device``; one result per candidate, in
    order (sources without an extension are ``skipped``).

    A batch that leaves each build to its first evaluation builds them one after another inside the
    timed run (about a minute apiece on the H200 machine); this is the up-front alternative for
    scripts that evaluate a fixed list. ``workers`` defaults to :func:`default_build_workers`.
    ``on_result`` is called (in this thread) for each build as it finishes, in the order they
    finish: a batch prints its build progress with it, terminal or not.
    """
    arch = arch_list_for(telemetry.compute_capability(device)) if device.startswith("cuda") else None
    stage = CompileStage(workers or default_build_workers(len(candidates)), arch_list=arch)
    try:
        futures = [stage.submit(candidate) for candidate in candidates]
        if on_result is not None:
            owners = {id(f): c for c, f in zip(candidates, futures, strict=True)}
            for future in as_completed(set(futures)):
                on_result(owners[id(future)], future.result())
        return [future.result() for future in futures]
    finally:
        stage.close()


#: A ``load_inline`` build compiles two translation units (the C++ binding and the CUDA source), so
#: it keeps up to two cores busy: half the cores at once, and no more than eight, keeps a shared
#: machine usable while a batch builds.
MAX_PARALLEL_BUILDS = 8


def default_build_workers(builds: int) -> int:
    """As many builds at once as there are builds, up to half the cores and ``MAX_PARALLEL_BUILDS``:
    the demo's seven CUDA sources took 139 s four at a time on a cold H200 machine (two waves of
    about 70 s), where one wave suffices."""
    return max(1, min(builds, (os.cpu_count() or 2) // 2, MAX_PARALLEL_BUILDS))


class CompileStage:
    """A pool of build processes in front of the GPU stage; one build per distinct source."""

    def __init__(
        self, workers: int, *, arch_list: str | None = None, timeout_s: float = BUILD_TIMEOUT_S
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kbv-compile")
        self._arch_list = arch_list
        self._timeout_s = timeout_s
        self._futures: dict[str, Future[CompileResult]] = {}
        self._lock = threading.Lock()

    def submit(self, candidate: Candidate) -> Future[CompileResult]:
        with self._lock:
            future = self._futures.get(candidate.source_sha256)
            if future is None:
                if needs_build(candidate.source):
                    future = self._pool.submit(self._compile, candidate)
                else:
                    future = Future()
                    future.set_result(CompileResult(candidate.source_sha256, "skipped"))
                self._futures[candidate.source_sha256] = future
            return future

    def _compile(self, candidate: Candidate) -> CompileResult:
        try:
            return compile_candidate(candidate, arch_list=self._arch_list, timeout_s=self._timeout_s)
        except OSError as exc:  # the cache is unwritable: the evaluation worker builds instead
            return CompileResult(candidate.source_sha256, "failed", message=str(exc))

    def results(self) -> list[CompileResult]:
        with self._lock:
            return [f.result() for f in self._futures.values() if f.done()]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
