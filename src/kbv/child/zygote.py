"""kbv's fork server: ``python -m kbv.child.zygote FD``.

Starting a worker as a fresh interpreter costs seconds of ``import torch`` (3-5 s on the H200 host,
more when eight boot at once), and that is most of a ``standard`` evaluation. This process pays
the imports once; every worker is then a ``fork`` of it that applies its own containment and
becomes ``kbv.child.main`` (a fresh process per worker, as before: only the imports are shared).

What keeps it safe to fork from:
- It is started with the scrubbed worker environment (no credential ever enters its memory, so a
  forked candidate finds none), loads no problem and no candidate, and never initialises CUDA (a
  CUDA context does not survive ``fork``; each worker makes its own after the fork).
- The forked child closes the fork server's socket and every descriptor but its own channel and
  logs before it runs anything else, starts its own session, takes its environment, working
  directory, network namespace and uid from the request, then boots like a fresh worker.
- It only forks: it decides nothing and reads nothing a worker wrote. Requests come from the kbv
  parent alone (a socket pair nobody else holds); it exits when the parent's end closes, and kills
  every worker it forked that is still there (and their descendants) first: a worker polls its
  parent and exits when it goes, but a stopped worker (SIGSTOP) polls nothing.

Protocol (``SOCK_SEQPACKET``, one JSON object per message, descriptors by ``SCM_RIGHTS``):
``{"op": "spawn", ...}`` with the fds (channel, stdout, stderr) answers ``{"pid": N}``;
``{"op": "reap", "pid": N}`` answers ``{"pid": N, "status": S}`` (the exit code, negative for a
signal, as ``subprocess`` reports it) once that child has exited; ``{"op": "exit"}`` ends it.
Children are reaped only when the parent asks, so a pid cannot be reused while the parent still
holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import traceback
import warnings
from typing import Any

from kbv.processes import MARKER_ENV, MARKER_SLOT

MAX_MESSAGE_BYTES = 1 << 20


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _preload()
    _send(sock, {"op": "ready", "pid": os.getpid()})
    forked: set[int] = set()  # workers not reaped yet: their pids (and process groups) are still theirs
    try:
        _serve(sock, forked)
    finally:
        _kill_forked(forked)
        sock.close()


def _serve(sock: socket.socket, forked: set[int]) -> None:
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 8)
        except OSError:
            break
        if not message:  # the parent's end closed: the parent is gone
            break
        request = json.loads(message)
        op = request.get("op")
        if op == "spawn":
            reply = _spawn(sock, request, fds)
            if "pid" in reply:
                forked.add(int(reply["pid"]))
            _send(sock, reply)
        elif op == "reap":
            for extra in fds:
                os.close(extra)
            forked.discard(int(request["pid"]))
            _send(sock, _reap(int(request["pid"])))
        else:
            break


def _kill_forked(forked: set[int]) -> None:
    """SIGKILL every worker not reaped yet, its descendants first (a worker is their subreaper, so
    they are below it while it lives), then its process group. SIGKILL ends a stopped process too,
    so nothing is left stopped when the kbv parent is gone. Pids not reaped are still this
    process's children, so none of them (or their groups) can belong to anyone else."""
    from kbv.processes import descendants, kill_pids, process_table

    live = [pid for pid in forked if _unreaped(pid)]
    for _ in range(5):  # a process forking while its siblings are killed leaves one for the next round
        table = process_table()
        below = [p for pid in live for p in descendants(pid, table)]
        if not below:
            break
        kill_pids(below)
    for pid in live:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def _unreaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)  # still running (or stopped)
    except ChildProcessError:
        return False


def _preload() -> None:
    """Import what every worker imports while booting, without touching CUDA."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # fork with BLAS threads: see _spawn
    import torch  # noqa: F401
    import torch.profiler  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    import kbv.child.main  # noqa: F401
    import kbv.child.probes  # noqa: F401


def _spawn(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    if len(fds) != 3:
        for extra in fds:
            os.close(extra)
        return {"error": f"spawn needs 3 descriptors (channel, stdout, stderr), got {len(fds)}"}
    sys.stdout.flush()
    sys.stderr.flush()
    # A BLAS pool's threads do not follow a fork (only the calling thread does); the libraries
    # reinitialise them in the child through their own fork handlers.
    pid = os.fork()
    if pid == 0:
        _become_worker(sock, request, fds)  # never returns
    for extra in fds:
        os.close(extra)
    return {"pid": pid}


def _reap(pid: int) -> dict[str, Any]:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return {"pid": pid, "status": None}
    return {"pid": pid, "status": os.waitstatus_to_exitcode(status)}


def _become_worker(server: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: contain this process as the request says, then run the worker."""
    code = 1
    try:
        server.close()  # the worker must not reach the fork server
        channel = _own_descriptors(*fds)
        os.setsid()  # its own session and process group, as ``start_new_session`` gave
        os.chdir(request["cwd"])
        _write_marker(request["env"].get(MARKER_ENV, ""))
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # computed from the fork server's TMPDIR, if anything asked already
        if request.get("private_network"):
            _unshare_network()  # needs root: done before the uid is dropped
        uid = request.get("uid")
        if uid is not None:
            os.setgroups([])
            os.setgid(int(uid))
            os.setuid(int(uid))
        from kbv.child import confine

        confine.from_environment()  # a candidate's Landlock and seccomp, while this is its only thread
        _fresh_process_state()
        from kbv.child import main as worker

        worker.run(channel, str(request["role"]), bool(request.get("warm_probes")))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


_CLONE_NEWNET = 0x40000000


def _unshare_network() -> None:
    """A network namespace of its own (``unshare(CLONE_NEWNET)``; ``os.unshare`` is Python 3.12+)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNET) failed: {os.strerror(errno)}")


def _write_marker(marker: str) -> None:
    """Put this worker's marker where the parent's sweep reads it: ``/proc/<pid>/environ`` shows the
    environment block the fork server was started with, so its slot (:data:`MARKER_SLOT`) is
    overwritten in place. Processes the candidate forks without ``exec`` then carry the marker too,
    as they did when every worker was a fresh interpreter."""
    import ctypes

    value = marker.encode()
    if not value or len(value) > len(MARKER_SLOT):
        return
    needle = f"{MARKER_ENV}={MARKER_SLOT}".encode()
    libc = ctypes.CDLL(None)
    entries = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    index = 0
    while entries[index]:
        address = entries[index]
        if ctypes.string_at(address) == needle:
            start = address + len(MARKER_ENV) + 1
            ctypes.memmove(start, value + b"\0" * (len(MARKER_SLOT) - len(value)), len(MARKER_SLOT))
            return
        index += 1


def _own_descriptors(channel: int, stdout: int, stderr: int) -> int:
    """Keep only stdin (``/dev/null``), the logs as 1 and 2, and the channel; returns its number."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    keep = 3
    if channel != keep:
        os.dup2(channel, keep)
    os.closerange(keep + 1, _max_fd())
    return keep


def _max_fd() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def _fresh_process_state() -> None:
    """What a fresh interpreter would not share with its siblings: random states, thread counts."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))  # the pool's size was read when the fork server imported


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
