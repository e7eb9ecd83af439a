"""One GPU, several evaluations: they share it, except while one of them times.

Evaluations on the same GPU from different processes (two ``kbv`` commands, or tests run with
pytest-xdist) used to overlap freely, so one's correctness kernels ran inside another's timed
batches: on the H200 an honest candidate's wall clock then read 1.9 ms against 0.38 ms of device
time and ``side_stream_timing`` called it a hack. Every evaluation on a GPU now holds a shared
lock on that GPU's lock file, and converts it to an exclusive one for its timing phase (baselines
and candidate), so nothing else runs on the GPU while it times. An evaluation whose copies of its
inputs and outputs would fill a large share of the GPU's memory holds it alone from its first
draw to its end (``DeviceLock.hold_alone``, ``kbv.evaluation._gpu_hold``): on the H200, six evaluations of
KernelBench's 1.6e9-element problems sharing one GPU ran one another out of memory.

The locks are ``flock`` locks on files in a directory every process on the host sees (the
system's temporary directory), keyed by the physical GPU, so they hold across users of
``CUDA_VISIBLE_DEVICES`` and across cache directories. A second file is a turnstile: a timer
waiting for its exclusive lock holds it, so evaluations arriving later wait behind the timer
instead of keeping the GPU shared forever. The kernel drops a dead process's locks.

CPU evaluations take no lock: a CPU has many cores, and kbv gives each CPU worker one thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kbv import telemetry
from kbv.worker._contain import command_line

LOCK_DIR_NAME = "kbv-device-locks"


def _lock_dir() -> Path:
    directory = Path(tempfile.gettempdir()) / LOCK_DIR_NAME
    directory.mkdir(mode=0o1777, exist_ok=True)
    return directory


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(PermissionError):
        os.chmod(path, 0o666)  # another user's kbv on this host must be able to take it too
    return fd


#: While a lock is not granted, how often the candidate's processes are searched for a hold on
#: kbv's lock files, and the longest sleep between two tries.
SUSPECT_CHECK_S = 0.5
RETRY_MAX_S = 0.02


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _files_open(pid: int, files: dict[tuple[int, int], str]) -> set[str]:
    """Which of ``files`` (by device and inode) process ``pid`` holds open."""
    held: set[str] = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return held
    for entry in entries:
        try:
            info = os.stat(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        name = files.get((info.st_dev, info.st_ino))
        if name is not None:
            held.add(name)
    return held


class DeviceLock:
    """The shared-or-exclusive hold of one evaluation on one GPU (no-op for the CPU).

    The lock files are open to every process on the host, the candidate's too (on a GPU it keeps
    the parent's uid): a candidate process that opened one and took a lock would block this
    evaluation, and every other on that GPU, for ever, in an untimed wait. ``suspects`` (the
    candidate worker's processes: ``Worker.members``) are therefore searched while a lock is not
    granted; any that holds one of the files open is killed and named (:meth:`take_tampering`,
    the finding ``device_lock_tampering``). Other evaluations' holds are waited for as always."""

    def __init__(self, device: str, suspects: Callable[[], Iterable[int]] | None = None) -> None:
        self.device = device
        self.waited_s = 0.0
        self._suspects = suspects
        self._tampering: list[dict[str, Any]] = []
        self._exclusive_depth = 0
        self._main: int | None = None
        self._gate: int | None = None
        if device.startswith("cuda"):
            key = f"cuda-{telemetry.physical_index(device)}"
            self._main = _open(_lock_dir() / f"{key}.lock")
            self._gate = _open(_lock_dir() / f"{key}.gate")

    def __enter__(self) -> DeviceLock:
        self._shared()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shared(self) -> None:
        if self._main is None or self._gate is None:
            return
        started = time.monotonic()
        self._take(self._gate, fcntl.LOCK_EX)  # behind any timer that is waiting
        try:
            self._take(self._main, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - started

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The GPU alone for the block; shared again after it. Inside a block, or after
        :meth:`hold_alone`, that holds it alone already, a nested block changes nothing."""
        if self._main is None or self._gate is None or self._exclusive_depth:
            self._exclusive_depth += 1
            try:
                yield
            finally:
                self._exclusive_depth -= 1
            return
        self._go_exclusive()
        try:
            yield
        finally:
            self._exclusive_depth = 0
            self._take(self._main, fcntl.LOCK_SH)

    def hold_alone(self) -> None:
        """The GPU alone from now until :meth:`close`: a large evaluation's hold, never handed back to
        sharing (a downgrade is not atomic: a waiting timer could take the GPU in between and this
        evaluation would wait for it with its memory still allocated). Nested :meth:`exclusive`
        blocks change nothing."""
        if self._exclusive_depth:
            return
        if self._main is None or self._gate is None:
            self._exclusive_depth = 1
            return
        self._go_exclusive()

    def _go_exclusive(self) -> None:
        """From a shared hold to an exclusive one (the files are open)."""
        assert self._main is not None and self._gate is not None
        started = time.monotonic()
        # Our shared hold goes first: a second timer waiting at the gate while still sharing would
        # keep this one waiting for ever.
        fcntl.flock(self._main, fcntl.LOCK_UN)
        self._take(self._gate, fcntl.LOCK_EX)  # newcomers queue behind this timer
        try:
            self._take(self._main, fcntl.LOCK_EX)  # waits until no one else shares the GPU
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - started
        self._exclusive_depth = 1

    def take_tampering(self) -> list[dict[str, Any]]:
        """The candidate processes killed for holding kbv's lock files since the last call."""
        found, self._tampering = self._tampering, []
        return found

    def _take(self, fd: int, mode: int) -> None:
        """``flock(fd, mode)``, waiting as long as it takes, but never for a candidate's hold."""
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        delay, next_search = 0.001, time.monotonic() + SUSPECT_CHECK_S / 10
        while True:
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if self._suspects is not None and time.monotonic() >= next_search:
                self._evict_suspects()
                next_search = time.monotonic() + SUSPECT_CHECK_S

    def _evict_suspects(self) -> None:
        files = {
            _identity(fd): name for fd, name in ((self._main, "lock"), (self._gate, "gate")) if fd is not None
        }
        try:
            suspects = list(self._suspects() if self._suspects is not None else [])
        except Exception:  # noqa: BLE001 - a worker gone meanwhile has no processes to search
            return
        for pid in suspects:
            held = _files_open(pid, files)
            if not held:
                continue
            command = command_line(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                self._tampering.append({"pid": pid, "command": command, "files": sorted(held)})

    def close(self) -> None:
        for fd in (self._main, self._gate):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the file drops its lock
        self._main = self._gate = None
