"""The local executor: one evaluation slot per GPU of this host, fed by an ahead-of-time compile stage.

Shape (docs/scale-out.md has the why)::

    driver thread ── pairs ──> compile stage (CPU processes, builds into the shared cache)
         ^                          │ futures
         │ on_record                v
    results queue <── slot threads: one per GPU (or per CPU worker), each owning one warm
                      "host" process (spawn) that runs kbv.evaluation.evaluate, which starts the
                      fresh scrubbed reference and candidate workers pinned to that GPU

- A slot takes the first pending pair whose compilation has finished, so a GPU does not wait on a
  compile while compiled work is queued; it waits only when nothing compiled is left.
- One slot per GPU and a host-wide ``flock`` per GPU: a GPU never runs two evaluations (hence two
  timed measurements) at once, not even from two ``kbv`` commands.
- A host process that dies, or an evaluation that raises an unexpected exception, sends the pair
  back to the queue for another slot; the second failure becomes a ``crashed`` record.
- ``max_cuda_errors`` CUDA errors in a row on one GPU take it out of the pool (``health()``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from kbv.candidates import Candidate
from kbv.devices import cpu_name
from kbv.execute._base import (
    Executor,
    ExecutorError,
    OnRecord,
    OnStart,
    Pair,
    ShouldSkip,
    crashed_record,
    environment,
    is_harness_error,
    probe_hello,
)
from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import Record
from kbv.worker import cache_root
from kbv.worker.builds import CompileResult, CompileStage, arch_list_for, needs_build

MAX_CUDA_ERRORS = 3
ATTEMPTS = 2  # the first try and one retry elsewhere
# Beyond the evaluation's own budgets (reference 1800 s + the candidate's): a host this late is hung.
HOST_GRACE_S = 1800.0 + 600.0


@dataclass
class _Job:
    problem: Problem
    candidate: Candidate
    compiled: Future[CompileResult]
    attempts: list[str] = field(default_factory=list)
    tried: set[int] = field(default_factory=set)


@dataclass
class _Slot:
    index: int
    device: str  # "cuda:N" (physical GPU N) or "cpu"
    host: ProcessPoolExecutor | None = None
    evaluations: int = 0
    cuda_errors_in_row: int = 0
    cuda_errors: int = 0
    removed: str | None = None
    busy_s: float = 0.0
    wait_compile_s: float = 0.0
    wait_other_s: float = 0.0

    @property
    def label(self) -> str:
        return self.device if self.device.startswith("cuda") else f"cpu-worker-{self.index}"

    def start_host(self) -> ProcessPoolExecutor:
        if self.host is None:
            self.host = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self.host

    def kill_host(self) -> None:
        """SIGKILL the host process (its evaluation's workers notice the closed channel and exit)."""
        host, self.host = self.host, None
        if host is None:
            return
        for process in list(getattr(host, "_processes", {}).values()):
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.kill(process.pid, signal.SIGKILL)
        host.shutdown(wait=False, cancel_futures=True)


def _host_evaluate(
    evaluate_fn: Callable[..., Record],
    problem: Problem,
    candidate: Candidate,
    protocol: Protocol,
    device: str,
    timeout_s: float | None,
) -> Record:
    """Runs in a slot's host process."""
    return evaluate_fn(problem, candidate, protocol, device, timeout_s=timeout_s)


class _HostDied(Exception):
    pass


class LocalExecutor(Executor):
    def __init__(
        self,
        *,
        device: str = "cuda",
        gpus: list[int] | None = None,
        workers: int | None = None,
        evaluate_fn: Callable[..., Record],
        compile_workers: int | None = None,
        max_cuda_errors: int = MAX_CUDA_ERRORS,
    ) -> None:
        cpus = os.cpu_count() or 2
        if device == "cuda":
            if not gpus:
                raise ExecutorError("the local executor on cuda needs at least one GPU (--gpus)")
            self.slots = [_Slot(i, f"cuda:{gpu}") for i, gpu in enumerate(gpus)]
        elif device == "cpu":
            self.slots = [_Slot(i, "cpu") for i in range(max(1, workers or cpus // 4))]
        else:
            raise ExecutorError(f"device must be cpu or cuda, not {device!r}")
        self.device = device
        self.evaluate_fn = evaluate_fn
        # Leave CPUs to the timed evaluations: compilation shares the host with them.
        self.compile_workers = compile_workers or max(1, min(16, cpus - 2 * len(self.slots)))
        self.max_cuda_errors = max_cuda_errors
        self.device_name = cpu_name() if device == "cpu" else ""
        self._hello: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._in_flight = 0
        self._stop = False
        self._results: queue.Queue[tuple[Problem, Candidate, Record | None, Exception | None]] = queue.Queue()
        self._stats: dict[str, Any] = {}

    # --- probing -------------------------------------------------------------------------------

    def _probe_hello(self) -> dict[str, Any]:
        if self._hello is None:
            device = self.slots[0].device
            visible = device.split(":", 1)[1] if ":" in device else None
            self._hello = probe_hello(device, visible)
        return self._hello

    def probe(self) -> dict[str, Any]:
        """What a worker on the first slot's device sees (``kbv.execute.environment``)."""
        env = environment(self.device, self._probe_hello())
        self.device_name = env["device_name"]
        return env

    def _arch_list(self) -> str | None:
        if self.device != "cuda":
            return None
        return arch_list_for((self._probe_hello().get("device") or {}).get("capability"))

    # --- map -----------------------------------------------------------------------------------

    def map(
        self,
        pairs: Iterable[Pair],
        protocol: Protocol,
        *,
        timeout_s: float | None,
        on_record: OnRecord,
        should_skip: ShouldSkip,
        on_start: OnStart | None = None,
    ) -> None:
        stage = CompileStage(self.compile_workers, arch_list=self._arch_list())
        jobs = [_Job(p, c, stage.submit(c)) for p, c in pairs if not should_skip(p, c)]
        for job in jobs:
            job.compiled.add_done_callback(lambda _: self._notify())
        _announce_builds(jobs)
        self._pending, self._in_flight, self._stop = deque(jobs), 0, False
        started = time.monotonic()
        threads = [
            threading.Thread(
                target=self._slot_loop,
                args=(slot, protocol, timeout_s),
                name=f"kbv-{slot.label}",
                daemon=True,
            )
            for slot in self.slots
            if not slot.removed
        ]
        for thread in threads:
            thread.start()
        try:
            self._deliver(len(jobs), on_record, threads)
        finally:
            self._stop = True
            self._notify()
            if any(t.is_alive() for t in threads):  # interrupted or on_record raised: end work now
                for slot in self.slots:
                    slot.kill_host()
            for thread in threads:
                thread.join(timeout=30)
            stage.close()
            self._stats = self._collect_stats(time.monotonic() - started, stage.results())

    def _deliver(self, total: int, on_record: OnRecord, threads: list[threading.Thread]) -> None:
        delivered = 0
        while delivered < total:
            try:
                item = self._results.get(timeout=0.5)
            except queue.Empty:
                self._fail_if_no_slots()
                if not any(t.is_alive() for t in threads) and self._results.empty():
                    raise ExecutorError(
                        f"every evaluation slot stopped with {total - delivered} pairs unfinished"
                    ) from None
                continue
            on_record(*item)
            delivered += 1

    def _fail_if_no_slots(self) -> None:
        with self._cond:
            if any(s.removed is None for s in self.slots) or not self._pending:
                return
            reasons = "; ".join(f"{s.label}: {s.removed}" for s in self.slots)
            while self._pending:
                job = self._pending.popleft()
                self._results.put(
                    (
                        job.problem,
                        job.candidate,
                        None,
                        ExecutorError(f"no device left in the pool ({reasons})"),
                    )
                )

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- slots ---------------------------------------------------------------------------------

    def _slot_loop(self, slot: _Slot, protocol: Protocol, timeout_s: float | None) -> None:
        try:
            while (job := self._take(slot)) is not None:
                self._run_job(slot, job, protocol, timeout_s)
        finally:
            slot.kill_host()

    def _take(self, slot: _Slot) -> _Job | None:
        with self._cond:
            while True:
                if self._stop or slot.removed:
                    return None
                job = self._pick(slot)
                if job is not None:
                    self._pending.remove(job)
                    self._in_flight += 1
                    return job
                if not self._pending and self._in_flight == 0:
                    return None
                # Idle: waiting for a compile if a pending pair is only held back by its build.
                waiting_for_compile = any(not j.compiled.done() for j in self._pending)
                waited = time.monotonic()
                self._cond.wait(timeout=1.0)
                if waiting_for_compile:
                    slot.wait_compile_s += time.monotonic() - waited
                else:
                    slot.wait_other_s += time.monotonic() - waited

    def _pick(self, slot: _Slot) -> _Job | None:
        live = [s.index for s in self.slots if s.removed is None]
        for job in self._pending:
            elsewhere = any(i not in job.tried for i in live if i != slot.index)
            if job.compiled.done() and (slot.index not in job.tried or not elsewhere):
                return job
        return None

    def _run_job(self, slot: _Slot, job: _Job, protocol: Protocol, timeout_s: float | None) -> None:
        record: Record | None = None
        error: Exception | None = None
        failure: str | None = None
        started = time.monotonic()
        try:
            with _gpu_lock(slot.device):
                record = self._call(slot, job, protocol, timeout_s)
        except _HostDied as exc:
            failure = f"{slot.label}: the evaluation process died ({exc})"
        except Exception as exc:
            if is_harness_error(exc) or self._stop:
                error = exc
            else:
                failure = f"{slot.label}: {type(exc).__name__}: {exc}"
        finally:
            slot.busy_s += time.monotonic() - started
            slot.evaluations += 1
        with self._cond:
            if failure is not None and not self._stop:
                job.attempts.append(failure)
                job.tried.add(slot.index)
                if len(job.attempts) < ATTEMPTS:
                    self._pending.appendleft(job)
                else:
                    record = crashed_record(
                        job.problem,
                        job.candidate,
                        protocol,
                        self._device_info(slot),
                        "the evaluation died twice; see attempts",
                        job.attempts,
                    )
            if record is not None or error is not None:
                self._results.put((job.problem, job.candidate, record, error))
                self._track_health(slot, record, error)
            self._in_flight -= 1
            self._cond.notify_all()

    def _call(self, slot: _Slot, job: _Job, protocol: Protocol, timeout_s: float | None) -> Record:
        host = slot.start_host()
        try:
            future = host.submit(
                _host_evaluate, self.evaluate_fn, job.problem, job.candidate, protocol, slot.device, timeout_s
            )
        except (BrokenProcessPool, RuntimeError) as exc:  # the host is already gone
            slot.kill_host()
            raise _HostDied(str(exc)) from exc
        limit = HOST_GRACE_S + (timeout_s if timeout_s is not None else protocol.timeout_s)
        try:
            return future.result(timeout=limit)
        except BrokenProcessPool as exc:
            slot.kill_host()
            raise _HostDied("it exited or was killed") from exc
        except TimeoutError as exc:
            slot.kill_host()
            raise _HostDied(f"no answer after {limit:.0f} s; killed") from exc

    def _device_info(self, slot: _Slot) -> dict[str, Any]:
        if slot.device.startswith("cuda"):
            return {"type": "cuda", "name": self.device_name, "index": slot.device.split(":", 1)[1]}
        return {"type": "cpu", "name": self.device_name}

    def _track_health(self, slot: _Slot, record: Record | None, error: Exception | None) -> None:
        """Consecutive CUDA errors on one GPU (a candidate's or the trusted reference's) retire it."""
        if not slot.device.startswith("cuda"):
            return
        kind = (record.error or {}).get("kind") if record is not None else None
        if kind == "cuda_error" or (error is not None and "cuda_error" in str(error)):
            slot.cuda_errors += 1
            slot.cuda_errors_in_row += 1
            if slot.cuda_errors_in_row >= self.max_cuda_errors and slot.removed is None:
                slot.removed = (
                    f"{slot.cuda_errors_in_row} CUDA errors in a row (last: {job_label(record, error)})"
                )
        elif record is not None:
            slot.cuda_errors_in_row = 0

    # --- reporting -----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "slots": {
                s.label: {
                    "evaluations": s.evaluations,
                    "cuda_errors": s.cuda_errors,
                    "cuda_errors_in_row": s.cuda_errors_in_row,
                    "removed": s.removed,
                }
                for s in self.slots
            },
            "removed": {s.label: s.removed for s in self.slots if s.removed},
        }

    def stats(self) -> dict[str, Any]:
        return self._stats

    def _collect_stats(self, wall_s: float, compiled: list[CompileResult]) -> dict[str, Any]:
        slots = {
            s.label: {
                "busy_s": s.busy_s,
                "wait_compile_s": s.wait_compile_s,
                "wait_other_s": s.wait_other_s,
                "evaluations": s.evaluations,
            }
            for s in self.slots
        }
        statuses: dict[str, int] = {}
        for result in compiled:
            statuses[result.status] = statuses.get(result.status, 0) + 1
        return {
            "wall_s": wall_s,
            "slots": slots,
            "idle_compile_share": sum(s.wait_compile_s for s in self.slots) / (wall_s * len(self.slots))
            if wall_s
            else 0.0,
            "compile": {
                "workers": self.compile_workers,
                "statuses": statuses,
                "seconds": sum(r.seconds for r in compiled),
            },
        }

    def close(self) -> None:
        for slot in self.slots:
            slot.kill_host()


def job_label(record: Record | None, error: Exception | None) -> str:
    if record is not None:
        return f"{record.problem.get('name')} x {record.candidate.get('path')}"
    return str(error).splitlines()[0] if error else ""


@contextlib.contextmanager
def _gpu_lock(device: str) -> Iterator[None]:
    """Host-wide: one evaluation per GPU across every kbv process on this machine."""
    if not device.startswith("cuda"):
        yield
        return
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"gpu-{device.split(':', 1)[1]}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _announce_builds(jobs: list[_Job]) -> None:
    """One line on stderr per extension build as it finishes (terminal or not): builds take minutes
    on a small machine, and a batch must not look hung meanwhile."""
    by_future: dict[int, _Job] = {}
    for job in jobs:  # duplicate sources share one build (one future): announced once
        by_future.setdefault(id(job.compiled), job)
    building = list(by_future.values())
    total = sum(1 for j in building if needs_build(j.candidate.source))
    if not total:
        return
    sys.stderr.write(f"building {total} C++/CUDA extension(s), cached by source hash\n")
    sys.stderr.flush()
    finished = itertools.count(1)

    def announce(job: _Job, future: Future[CompileResult]) -> None:
        result = future.result()
        if result.status == "skipped":
            return
        sys.stderr.write(
            f"  [{next(finished)}/{total}] {result.status} {job.candidate.label}/{job.candidate.path.name}"
            f" ({result.seconds:.0f} s)\n"
        )
        sys.stderr.flush()

    for job in building:
        job.compiled.add_done_callback(functools.partial(announce, job))
