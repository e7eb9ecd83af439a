"""The parent's side of kbv's fork server (``kbv.child.zygote``): workers without ``import torch``.

One fork server per kbv process, started on first use with the scrubbed worker environment, forks
every worker (trusted and candidate alike) on request. A worker it forked is not this process's
child, so :class:`ForkedProcess` stands in for ``subprocess.Popen``: the pid, ``poll``, ``wait``
and the exit status, which the fork server reports when asked to reap (it reaps nothing on its
own, so a pid stays reserved until the parent has seen the worker's end).

``KBV_FORK_SERVER=0`` turns it off (every worker is then a fresh interpreter, as before). When it
cannot start or dies, workers fall back to fresh interpreters, and the reason is kept in
:func:`unavailable_reason`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kbv.processes import MARKER_ENV, MARKER_SLOT
from kbv.worker._env import scrubbed_env

#: Seconds the fork server may take to import torch and say it is ready.
READY_TIMEOUT_S = 120.0
MAX_MESSAGE_BYTES = 1 << 20


class ForkServerError(RuntimeError):
    """The fork server did not start or stopped answering (workers then start as fresh interpreters)."""


class ForkServer:
    """A running ``kbv.child.zygote`` and the socket to it; thread-safe."""

    def __init__(self, kbv_src: str) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="kbv-forkserver-"))
        env = scrubbed_env(
            os.environ,
            home=self.home,
            extensions_dir=self.home / "torch_extensions",
            triton_dir=self.home / "triton",
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (kbv_src, env.get("PYTHONPATH", "")) if p)
        env[MARKER_ENV] = MARKER_SLOT  # each forked worker writes its own marker here
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = self.home / "forkserver.log"
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kbv.child.zygote", str(child_end.fileno())],
                env=env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(child_end.fileno(),),
                start_new_session=True,  # a kill of kbv's process group leaves it; it exits on EOF
            )
        child_end.close()
        self._sock = parent_end
        self._lock = threading.Lock()
        self.owner = os.getpid()
        #: Times this process was found stopped by a signal kbv did not send (and resumed).
        self.stops: list[dict[str, Any]] = []
        ready = self._read(time.monotonic() + READY_TIMEOUT_S)
        if ready.get("op") != "ready":
            self.close()
            raise ForkServerError(f"the fork server did not start: {ready}")

    def spawn(
        self,
        *,
        channel_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        env: dict[str, str],
        cwd: str,
        role: str,
        warm_probes: bool,
        uid: int | None,
        private_network: bool,
    ) -> ForkedProcess:
        request = {
            "op": "spawn",
            "env": env,
            "cwd": cwd,
            "role": role,
            "warm_probes": warm_probes,
            "uid": uid,
            "private_network": private_network,
        }
        with self._lock:
            self._write(request, [channel_fd, stdout_fd, stderr_fd])
            reply = self._read(time.monotonic() + 30.0)
        if "pid" not in reply:
            raise ForkServerError(f"the fork server could not start a worker: {reply}")
        return ForkedProcess(int(reply["pid"]), self)

    def reap(self, pid: int) -> int | None:
        """The exit status of a worker that has exited (a zombie of the fork server)."""
        with self._lock:
            self._write({"op": "reap", "pid": pid}, [])
            reply = self._read(time.monotonic() + 10.0)
        status = reply.get("status")
        return int(status) if isinstance(status, int) else None

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError, ForkServerError):
                self._write({"op": "exit"}, [])
            self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)

    def _write(self, message: dict[str, Any], fds: list[int]) -> None:
        try:
            socket.send_fds(self._sock, [json.dumps(message).encode()], fds)
        except OSError as exc:
            raise ForkServerError(f"the fork server is gone ({exc})") from exc

    def _read(self, deadline: float) -> dict[str, Any]:
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise ForkServerError("the fork server did not answer in time")
            ready, _, _ = select.select([self._sock], [], [], min(wait, 0.5))
            if ready:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    raise ForkServerError(f"the fork server exited: {self._log_tail()}")
                reply = json.loads(data)
                if not isinstance(reply, dict):
                    raise ForkServerError(f"the fork server wrote {reply!r}")
                return reply
            if not self.alive():
                raise ForkServerError(f"the fork server exited: {self._log_tail()}")
            self.resume_if_stopped()

    def resume_if_stopped(self) -> bool:
        """SIGCONT the fork server if something stopped it (kbv never does), and note it: a stopped
        fork server would answer nothing and notice nothing, the kbv parent's death included."""
        if process_state(self._proc.pid) != "T":
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._proc.pid, signal.SIGCONT)
        self.stops.append({"pid": self._proc.pid, "role": "fork server", "state": "T (stopped)"})
        return True

    def _log_tail(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


class ForkedProcess:
    """What ``Worker`` needs of ``subprocess.Popen`` for a worker the fork server forked."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        state = process_state(self.pid)
        if state is None:  # gone without the fork server's word (it died and init reaped it)
            self.returncode = -9
        elif state == "Z":
            try:
                status = self._server.reap(self.pid)
            except ForkServerError:
                status = None
            self.returncode = -9 if status is None else status
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.002)
        assert self.returncode is not None
        return self.returncode

    def wait_stopped(self, timeout: float = 2.0) -> None:
        """Return once every thread of the worker is stopped (what ``waitpid(WUNTRACED)`` gives a
        parent; this process is not the worker's parent, so it reads ``/proc``)."""
        wait_stopped(self.pid, timeout)


def wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Return once every thread of ``pid`` is stopped (or it is gone), read from ``/proc``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = _thread_states(pid)
        if not states or all(s in "TtZX" for s in states):
            return
        time.sleep(0.0005)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped, ``Z``...),
    or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0] if ")" in stat else None


def _thread_states(pid: int) -> list[str]:
    states = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as handle:
                stat = handle.read().decode(errors="replace")
        except OSError:
            continue
        if ")" in stat:
            states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


_server: ForkServer | None = None
_unavailable: str | None = None
_failed = False  # it failed to start once: do not pay its start-up timeout again
_start_lock = threading.Lock()


def fork_server(kbv_src: str) -> ForkServer | None:
    """This process's fork server, started on first use; None where it is off or cannot run."""
    global _server, _unavailable, _failed
    if os.environ.get("KBV_FORK_SERVER", "1") == "0":
        _unavailable = "turned off (KBV_FORK_SERVER=0)"
        return None
    if not sys.platform.startswith("linux"):
        _unavailable = "not on Linux"
        return None
    with _start_lock:
        if _failed:
            return None
        if _server is not None and (_server.owner != os.getpid() or not _server.alive()):
            _server = None  # a forked copy of this process, or a dead server: start another
        if _server is None:
            try:
                _server = ForkServer(kbv_src)
                _unavailable = None
            except (OSError, ForkServerError) as exc:
                _unavailable, _failed = str(exc), True
                return None
        return _server


def take_stops() -> list[dict[str, Any]]:
    """The fork server's stops seen since the last call (resumed; see :meth:`ForkServer.resume_if_stopped`),
    the one running now looked at once more."""
    server = _server
    if server is None or server.owner != os.getpid():
        return []
    with server._lock:
        server.resume_if_stopped()
        stops, server.stops = server.stops, []
    return stops


def unavailable_reason() -> str | None:
    """Why the last worker did not come from the fork server (None: it did, or none started yet)."""
    return _unavailable


@atexit.register
def _close_at_exit() -> None:
    if _server is not None and _server.owner == os.getpid():
        _server.close()
