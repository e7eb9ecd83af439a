"""kbv's fork server (``kbv.child.zygote``): workers forked from a process that imported torch once
are contained like fresh interpreters, and the fork server holds nothing a candidate may see."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kbv.worker import Worker, WorkerSpec, _contain, _forkserver

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def _environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        return handle.read().split(b"\0")


def _sockets(pid: int) -> list[str]:
    fds = Path(f"/proc/{pid}/fd")
    links = []
    for fd in fds.iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue
    return [link for link in links if link.startswith("socket:")]


def test_a_worker_is_forked_carries_its_marker_and_holds_only_its_own_channel() -> None:
    with Worker(WorkerSpec(build_key="test-fork", device="cpu", role="candidate", budget_s=60)) as worker:
        hello = worker.start()
        assert worker.started_as == "forked from kbv's fork server"
        assert worker.isolation["start"] == worker.started_as
        assert hello.pid == worker.pid
        # The sweep finds it (and what it forks without exec) by the marker in its exec'd environment.
        assert worker.pid in _contain.marked(worker.marker, _contain.process_table())
        # Its channel is its only socket: the fork server's is closed before anything else runs.
        assert len(_sockets(worker.pid)) == 1
        assert os.getsid(worker.pid) == worker.pid  # a session of its own, as start_new_session gave


def test_the_fork_server_holds_no_secret_of_the_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-kbv-test-secret")
    monkeypatch.setenv("KBV_TEST_PLAIN", "visible")  # not on the allowlist either
    server = _forkserver.ForkServer(_forkserver_src())
    try:
        environ = b"\0".join(_environ(server._proc.pid))
        assert b"sk-kbv-test-secret" not in environ and b"KBV_TEST_PLAIN" not in environ
        assert b"PYTHONPATH=" in environ  # it is the scrubbed worker environment, not an empty one
    finally:
        server.close()


def test_a_forked_worker_reports_its_exit_status_and_its_pid_is_reaped() -> None:
    worker = Worker(WorkerSpec(build_key="test-fork-exit", device="cpu", role="reference", budget_s=60))
    try:
        worker.start()
        pid = worker.pid
        assert pid is not None and worker.alive()
        os.kill(pid, signal.SIGKILL)
        assert worker.kill() == -signal.SIGKILL
        assert not worker.alive()
        assert not os.path.exists(f"/proc/{pid}")  # reaped by the fork server once the parent asked
    finally:
        worker.close()


def test_a_paused_forked_worker_is_stopped_and_then_runs_on() -> None:
    with Worker(
        WorkerSpec(build_key="test-fork-pause", device="cpu", role="reference", budget_s=60)
    ) as worker:
        worker.start()
        assert worker.pid is not None
        with worker.paused():
            assert set(_forkserver._thread_states(worker.pid)) <= set("Tt")
        assert not set(_forkserver._thread_states(worker.pid)) & set("Tt")  # SIGCONT: it runs on


def test_with_the_fork_server_off_a_worker_is_a_fresh_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KBV_FORK_SERVER", "0")
    with Worker(WorkerSpec(build_key="test-no-fork", device="cpu", role="reference", budget_s=60)) as worker:
        worker.start()
        assert worker.started_as == "fresh interpreter (turned off (KBV_FORK_SERVER=0))"
        with open(f"/proc/{worker.pid}/cmdline", "rb") as handle:
            assert b"kbv.child.main" in handle.read()


def _forkserver_src() -> str:
    from kbv.worker._process import _kbv_src

    return _kbv_src()


_STOPPED_WORKER_PARENT = """
import os, signal, sys, time
from pathlib import Path
from kbv.worker import Worker, WorkerSpec
worker = Worker(WorkerSpec(build_key="test-fork-stopped", device="cpu", role="reference", budget_s=120))
worker.start()
os.kill(worker.pid, signal.SIGSTOP)
Path(sys.argv[1]).write_text(str(worker.pid))
time.sleep(600)
"""


def test_a_stopped_worker_is_killed_by_the_fork_server_when_the_kbv_parent_dies(tmp_path: Path) -> None:
    """A stopped worker polls nothing, so it cannot notice its parent's death itself: the fork
    server kills what it forked when the kbv process's end of its socket closes (``kill -9``)."""
    import subprocess
    import sys

    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    parent = subprocess.Popen([sys.executable, "-c", _STOPPED_WORKER_PARENT, str(pid_file)], env=env)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text()):
            time.sleep(0.05)
        worker_pid = int(pid_file.read_text())
        _forkserver.wait_stopped(worker_pid, 5.0)  # a stop takes effect when the target next runs
        assert _forkserver.process_state(worker_pid) == "T"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _forkserver.process_state(worker_pid) not in (None, "Z"):
            time.sleep(0.05)
        assert _forkserver.process_state(worker_pid) in (None, "Z"), _forkserver.process_state(worker_pid)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_stopped_spare_and_a_stopped_fork_server_are_found_and_dealt_with() -> None:
    """The end of an evaluation looks at kbv's other processes: a spare stopped by someone else is
    closed and named, the fork server resumed and named; a spare kbv itself pauses is not named."""
    from kbv.worker import Spares, stopped_processes

    spec = WorkerSpec(build_key="test-fork-spares", device="cpu", role="reference", budget_s=60)
    with Spares() as spares:
        spares.expect([[spec, spec]])
        spares.launch_expected()
        stopped, paused = (w for ws in spares._launched.values() for w in ws)
        for worker in (stopped, paused):
            worker.wait_ready()
        server = _forkserver.fork_server(str(Path(_forkserver.__file__).resolve().parents[2]))
        assert server is not None
        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(server._proc.pid, signal.SIGSTOP)
        _forkserver.wait_stopped(stopped.pid, 5.0)
        _forkserver.wait_stopped(server._proc.pid, 5.0)
        with paused.paused():
            found = stopped_processes([], spares)
        assert sorted(s["role"] for s in found) == ["fork server", "reference"], found
        assert {s["pid"] for s in found} == {stopped.pid, server._proc.pid}
        assert _forkserver.process_state(server._proc.pid) != "T"
        assert not stopped.alive() and paused.alive()
        assert spares.take(spec) is paused
        paused.close()
