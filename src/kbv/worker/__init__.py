"""Worker processes, seen from the trusted parent.

Each worker is a fresh interpreter (``python -m kbv.worker._child``) started in its own process
group with a scrubbed environment, a private home and build directory, and one end of a socket pair
as its only channel back. Its stdout and stderr go to log files that the parent keeps but never
parses. A timeout kills the whole process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbv.worker import _channel
from kbv.worker._env import scrubbed_env

LOG_TAIL_BYTES = 16_000
#: PyTorch intra-op threads of a CPU worker, unless the user set ``OMP_NUM_THREADS``. With two
#: threads on a shared two-core machine, an op that splits its work waits at OpenMP's barrier for a
#: helper thread the scheduler has not run yet: the eager baseline of a 0.006 ms reduction took
#: 16-24 ms per call in bursts, while the candidate's single-threaded kernel was untouched, and one
#: pair read 640x. One thread per worker keeps CPU timings independent of the machine's load and
#: treats baseline and candidate alike.
CPU_INTRA_OP_THREADS = "1"


class WorkerFailed(Exception):
    """The worker did not answer a request: it timed out, crashed or reported an error.

    ``kind`` is one of ``timeout``, ``crashed``, ``compile_error``, ``import_error``,
    ``runtime_error``, ``cuda_error``. This is an outcome of the code under test, not a harness bug.
    ``role`` is the failing worker's (``reference``: the problem's own code failed; ``candidate``),
    or None when the parent raised it without a worker's answer.
    """

    def __init__(self, kind: str, message: str, details: dict[str, Any] | None = None, role: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.details = details or {}
        self.role = role

    def logs_tail(self, limit: int = 2000) -> str:
        """The end of the worker's stderr, for a message about a worker that failed to start."""
        return str(self.details.get("stderr", ""))[-limit:]


def visible_devices(device: str) -> str | None:
    """``cuda:N`` pins a worker to GPU N (``CUDA_VISIBLE_DEVICES=N``); inside it is simply ``cuda``."""
    return device.split(":", 1)[1] if device.startswith("cuda:") else None


def worker_device(device: str) -> str:
    """The device name a worker uses: ``cuda`` for any ``cuda:N`` (it sees only that GPU)."""
    return "cuda" if device.startswith("cuda") else device


def discard(path: str | Path) -> None:
    """Delete a file a worker wrote, once the parent has read it (missing is fine)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def harden_process() -> bool:
    """Make this process non-dumpable (Linux): its ``/proc/<pid>`` files (environ, mem, fd) become
    root-owned, so a candidate running as the same non-root user cannot read the parent's API keys
    or a reference worker's memory. No effect against a candidate running as root (see
    docs/architecture.md, "What isolation does not cover"). Returns whether it was applied."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


_PR_SET_DUMPABLE = 4


def cache_root() -> Path:
    """Where builds are cached: ``$KBV_CACHE_DIR`` or ``~/.cache/kbv``."""
    return Path(os.environ.get("KBV_CACHE_DIR") or Path.home() / ".cache" / "kbv")


@dataclass
class WorkerSpec:
    """How to start a worker. ``build_key`` (a source hash) selects its private build directory."""

    build_key: str
    device: str = "cpu"
    visible_devices: str | None = None
    role: str = "candidate"
    # Seconds this worker may spend answering requests (booting and compiling included); the clock
    # runs only while the parent waits on it, so a slow reference does not eat the candidate's time.
    budget_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)


class Worker:
    """One worker process and its channel. Use as a context manager; it is always killed on exit."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        _sweep_orphaned_scratch()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kbv-{spec.role}-", dir=_scratch_parent()))
        (self.scratch / _OWNER_FILE).write_text(str(os.getpid()))
        self.home = self.scratch / "home"
        self.home.mkdir()
        self.hello: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._stdout = self.scratch / "stdout.log"
        self._stderr = self.scratch / "stderr.log"
        self._counter = 0
        self.remaining_s = spec.budget_s

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> dict[str, Any]:
        """Launch the process and wait for its greeting."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting, so several workers can boot at once."""
        builds = cache_root() / "builds" / self.spec.build_key[:32]
        extensions, triton_dir = builds / "torch_extensions", builds / "triton"
        extensions.mkdir(parents=True, exist_ok=True)
        triton_dir.mkdir(parents=True, exist_ok=True)
        env = scrubbed_env(
            os.environ,
            home=self.home,
            extensions_dir=extensions,
            triton_dir=triton_dir,
            visible_devices=self.spec.visible_devices,
        )
        if self.spec.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", CPU_INTRA_OP_THREADS)
        env.update(self.spec.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_kbv_src(), env.get("PYTHONPATH", "")) if p)
        parent_end, child_end = socket.socketpair()
        with open(self._stdout, "wb") as out, open(self._stderr, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kbv.worker._child", str(child_end.fileno())],
                env=env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(child_end.fileno(),),
                start_new_session=True,  # its own process group, so a timeout kills every child
            )
        child_end.close()
        self._sock = parent_end

    def wait_ready(self) -> dict[str, Any]:
        if not self.hello:
            self.hello = self._receive()
        return self.hello

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply within the worker's remaining budget."""
        if self._sock is None:
            raise RuntimeError("worker not started")
        try:
            _channel.send(self._sock, {"op": op, **fields})
        except OSError as exc:
            self.kill()
            raise WorkerFailed("crashed", f"the worker is gone ({exc})", self.logs(), role=self.spec.role) from exc
        reply = self._receive()
        if not reply.get("ok"):
            error = reply.get("error") or {}
            kind = str(error.get("kind", "runtime_error"))
            if kind == "cuda_error":
                self.kill()
            raise WorkerFailed(kind, str(error.get("message", "")), {**error, **self.logs()}, role=self.spec.role)
        return reply

    def new_path(self, stem: str) -> str:
        """A fresh file name in this worker's scratch directory, for tensors it writes."""
        self._counter += 1
        return str(self.scratch / f"{stem}-{self._counter}.pt")

    def _receive(self) -> dict[str, Any]:
        assert self._sock is not None
        started = time.monotonic()
        try:
            return _channel.receive(self._sock, started + max(self.remaining_s, 0.0), alive=self.alive)
        except _channel.ChannelTimeout as exc:
            self.kill()
            raise WorkerFailed("timeout", "the worker did not finish before the timeout", self.logs(), role=self.spec.role) from exc
        except _channel.ChannelClosed as exc:
            code = self.kill()
            raise WorkerFailed("crashed", f"{exc} (exit status {code})", self.logs(), role=self.spec.role) from exc
        finally:
            self.remaining_s -= time.monotonic() - started

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop this worker's whole process group (SIGSTOP) while another worker is timed, then let
        it go on (SIGCONT). Between requests a worker should be idle, but threads it started (a
        candidate's background work, an OpenMP pool still spinning) would take CPU time from the
        batch being timed: on two cores a baseline measured next to such a process ran 16 ms per
        call instead of 0.006 ms. A stopped process takes none. Only call it between requests."""
        if not self.alive() or self._proc is None:
            yield
            return
        with contextlib.suppress(ProcessLookupError, PermissionError, ChildProcessError):
            os.killpg(self._proc.pid, signal.SIGSTOP)
            os.waitpid(self._proc.pid, os.WUNTRACED)  # returns once it has stopped (it stays unreaped)
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGCONT)

    def kill(self) -> int | None:
        """Kill the worker's whole process group; returns its exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self._sock is not None and self.alive():
            try:
                _channel.send(self._sock, {"op": "exit"})
                _channel.receive(self._sock, time.monotonic() + 2, alive=self.alive)
            except (OSError, _channel.ChannelClosed, _channel.ChannelTimeout):
                pass
        self.kill()
        if self._proc is not None:
            # Grandchildren the candidate left behind share the process group: kill them too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        shutil.rmtree(self.scratch, ignore_errors=True)

    def logs(self) -> dict[str, str]:
        return {"stdout": _tail(self._stdout), "stderr": _tail(self._stderr)}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _scratch_parent() -> str | None:
    """Prefer RAM-backed /dev/shm for the tensors workers hand back."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


_OWNER_FILE = ".kbv-owner"
_swept = False


def _sweep_orphaned_scratch() -> None:
    """Remove scratch directories left by a parent that was killed (``kill -9`` skips ``close``).

    Each directory names its owner's pid; one whose owner is gone is removed, once per process."""
    global _swept
    if _swept:
        return
    _swept = True
    parent = Path(_scratch_parent() or tempfile.gettempdir())
    for directory in parent.glob("kbv-*-*"):
        try:
            owner = int((directory / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if owner != os.getpid() and not _pid_alive(owner):
            shutil.rmtree(directory, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _kbv_src() -> str:
    """The directory that holds the ``kbv`` package, so workers import this very copy."""
    return str(Path(__file__).resolve().parents[2])
