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
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kbv import telemetry

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


class DeviceLock:
    """The shared-or-exclusive hold of one evaluation on one GPU (no-op for the CPU)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.waited_s = 0.0
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
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # behind any timer that is waiting
        try:
            fcntl.flock(self._main, fcntl.LOCK_SH)
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
        started = time.monotonic()
        # Our shared hold goes first: a second timer waiting at the gate while still sharing would
        # keep this one waiting for ever.
        fcntl.flock(self._main, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # newcomers queue behind this timer
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX)  # waits until no one else shares the GPU
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - started
        self._exclusive_depth = 1
        try:
            yield
        finally:
            self._exclusive_depth = 0
            fcntl.flock(self._main, fcntl.LOCK_SH)

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
        started = time.monotonic()
        fcntl.flock(self._main, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - started
        self._exclusive_depth = 1

    def close(self) -> None:
        for fd in (self._main, self._gate):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the file drops its lock
        self._main = self._gate = None
