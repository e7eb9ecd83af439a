"""A worker's limits, seen from the parent: its process tree measured while the parent waits on it
(``kbv.worker._contain`` reads the figures), the first limit it is over, and a stop signal kbv did
not send. ``Worker`` (``kbv.worker._process``) takes these methods from :class:`LimitWatch`."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbv import telemetry
from kbv.protocol import LimitSettings
from kbv.worker import _contain, _forkserver
from kbv.worker._memory import MemoryBudget
from kbv.worker._spec import WorkerFailed, WorkerSpec

#: Seconds between two polls of a limited worker's resources while the parent waits for it.
POLL_S = 0.1
#: Seconds between two full ``/proc`` scans for a limited worker without a cgroup (new processes
#: are found this late; the members already known are measured every POLL_S).
FULL_SCAN_S = 0.5


class LimitWatch:
    """The limit half of a worker: its attributes are set by ``Worker.__init__``."""

    spec: WorkerSpec
    budget: MemoryBudget
    scratch: Path
    _proc: subprocess.Popen[bytes] | _forkserver.ForkedProcess | None
    _cgroup: _contain.Cgroup | None
    _builds: Path
    _given: set[tuple[int, int]]
    _known: set[int]
    _last_poll: float
    _last_scan: float
    _pausing: bool
    exceeded: dict[str, Any] | None
    _awaited: Any  # ids of the requests whose replies are unread, oldest first
    _sent: dict[int, tuple[str, float]]  # request id -> (op, when sent)
    _receiving: str | None = None  # the op whose reply the parent is waiting for
    host_peak_bytes: int
    device_peak_bytes: int | None
    stopped: dict[str, Any] | None

    if TYPE_CHECKING:  # the process half's (kbv.worker._process.Worker)

        def alive(self) -> bool: ...
        def kill(self) -> int | None: ...
        def logs(self) -> dict[str, str]: ...

    @property
    def limits(self) -> LimitSettings | None:
        """The limits in force: the spec's, with the device-memory limit the parent's budget holds
        (widened where the evaluation holds its GPU alone: kbv.evaluation.budget)."""
        return self.budget.limits_of(self.spec)

    def _watch(self) -> bool:
        """``alive`` for the channel: the worker still runs and is within its limits (killed if not).

        Every worker is measured the same way (trusted ones too, without limits), so the parent's
        polling costs a candidate's timing no more than its baselines'."""
        if not self.alive():
            return False
        if self.found_stopped():
            self.kill()  # SIGKILL ends a stopped process too; its tree goes with it
            return False
        if time.monotonic() - self._last_poll < POLL_S:
            return True
        self._last_poll = time.monotonic()
        over = self.poll()
        if over is None:
            return True
        self.exceeded = {**over, "during": self.request_running()}
        self.kill()
        return False

    def request_running(self) -> str:
        """What the worker was doing when measured: the op of the request whose reply is awaited, or
        of its oldest one sent and not yet answered, else ``between requests``. A limit found
        past says where the memory went: 45_Average_Pooling_2D's candidate was over its device limit
        on an H100 and the record could not say in which of kbv's requests (2026-12-07)."""
        if self._receiving:
            return f"request {self._receiving}"
        for request_id in self._awaited:
            if request_id in self._sent:
                return f"request {self._sent[request_id][0]}"
        return "between requests"

    def poll(self) -> dict[str, Any] | None:
        """Measure the worker's tree once (peaks are kept); the first limit it is over, or None."""
        assert self._proc is not None
        limits = self.limits
        table = self._poll_table()
        members = list(table)
        usage = _contain.tree_usage(members, table, count_files=bool(limits and limits.open_files))
        usage.device_bytes = self._device_bytes(members)
        if limits is not None and limits.disk_gb:
            usage.disk_bytes = self.disk_bytes()
        self.host_peak_bytes = max(self.host_peak_bytes, usage.rss_bytes)
        if usage.device_bytes is not None:
            self.device_peak_bytes = max(self.device_peak_bytes or 0, usage.device_bytes)
        return _contain.exceeded(usage, limits) if limits is not None else None

    def _poll_table(self) -> dict[int, _contain.Proc]:
        """The worker's live processes for one poll, read as cheaply as the machine allows: the
        cgroup's members; else the members found by the last full ``/proc`` scan, which is redone
        every FULL_SCAN_S; a trusted worker (no limits) only itself."""
        assert self._proc is not None
        if self._cgroup is not None:
            known = {self._proc.pid, *self._cgroup.pids()}
        elif self.spec.limits is None:
            known = {self._proc.pid}
        elif time.monotonic() - self._last_scan >= FULL_SCAN_S:
            self._last_scan = time.monotonic()
            table = _contain.process_table()
            self._known = {self._proc.pid, *_contain.descendants(self._proc.pid, table)}
            return {p: table[p] for p in self._known if p in table}
        else:
            known = self._known
        procs = [_contain.read_proc(p) for p in known]
        return {p.pid: p for p in procs if p is not None}

    def disk_bytes(self) -> int:
        """What this worker's files take: its scratch and its build directory (Landlock keeps its
        writes there), less the files the parent gave it (:meth:`give`)."""
        return _contain.files_bytes([self.scratch, self._builds], self._given)

    def _device_bytes(self, members: list[int]) -> int | None:
        limits = self.limits
        if not self.spec.device.startswith("cuda") or not (limits and limits.device_memory_gb):
            return None
        figures = [telemetry.process_memory_bytes(self.spec.device, pid) for pid in members]
        known = [f for f in figures if f is not None]
        return sum(known) if known else None

    def found_stopped(self) -> bool:
        """Whether the worker is stopped (``T`` in ``/proc/<pid>/stat``) by a signal kbv did not
        send. A worker has no terminal (its own session), so only a stop signal puts it in that
        state; while the parent waits on it, kbv holds it running. A stopped worker never answers,
        and its budget would run out only after minutes (the reference's: half an hour), so every
        wait looks at it each poll. The first sighting is kept as :attr:`stopped`."""
        if self._pausing or self._proc is None:
            return False
        if self.stopped is not None:
            return True
        if _forkserver.process_state(self._proc.pid) != "T":
            return False
        self.stopped = {"pid": self._proc.pid, "role": self.spec.role, "state": "T (stopped)"}
        return True

    def _raise_if_stopped(self) -> None:
        """A worker found stopped: the candidate's own worker is a ``timeout`` (it stopped itself, or
        its tree did: it cannot finish); a trusted worker is ``crashed``, with the stop in
        ``details["stopped"]`` so the evaluation can name who could have sent it."""
        if self.stopped is None:
            return
        what = f"the {self.spec.role} worker (pid {self.stopped['pid']}) was found stopped (SIGSTOP)"
        if self.spec.role == "candidate":
            message = f"{what} and could not finish: a stopped worker never answers"
            kind = "timeout"
        else:
            message = f"{what} by a signal kbv did not send; it was killed"
            kind = "crashed"
        raise WorkerFailed(kind, message, {"stopped": dict(self.stopped), **self.logs()}, role=self.spec.role)

    def _raise_if_exceeded(self) -> None:
        if self.exceeded is not None:
            raise self._exceeded_failure(self.exceeded)

    def _exceeded_failure(self, over: dict[str, Any]) -> WorkerFailed:
        return WorkerFailed("resource_limit", _contain.describe_exceeded(over), {**over, **self.logs()})

    def failure_if_past_limit(self) -> WorkerFailed | None:
        """Poll once now, not at the next request: past a limit the worker is killed and its
        ``resource_limit`` failure returned, else None. For the parent that ran out of device memory
        itself, which must know whether the candidate had taken more than its limit allows."""
        if self.exceeded is None and self.alive():
            over = self.poll()
            if over is not None:
                self.exceeded = {**over, "during": self.request_running()}
                self.kill()
        return None if self.exceeded is None else self._exceeded_failure(self.exceeded)
