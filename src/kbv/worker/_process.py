"""One worker process and its channel, seen from the trusted parent (``kbv.worker``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kbv import channel as _channel
from kbv import telemetry, wire, wire_replies
from kbv.processes import tree_pids
from kbv.worker import _contain, _forkserver, _privileges, _scratch
from kbv.worker._env import arch_list_for, scrubbed_env
from kbv.worker._isolation import IsolationReport
from kbv.worker._limits import POLL_S, LimitWatch
from kbv.worker._memory import MemoryBudget
from kbv.worker._spec import WorkerFailed, WorkerSpec, cache_root, confinement_env

LOG_TAIL_BYTES = 16_000


@dataclasses.dataclass(frozen=True)
class RequestSpan:
    """One request as the parent saw it: when it was sent and its reply read (monotonic seconds),
    and the worker's own account of its allocator's peak (``device_reserved_peak``: trusted only
    from a trusted worker)."""

    sent_at: float
    replied_at: float
    device_reserved_peak: int | None

    def overlaps(self, other: RequestSpan) -> bool:
        return self.sent_at < other.replied_at and other.sent_at < self.replied_at


#: PyTorch intra-op threads of a CPU worker, unless the user set ``OMP_NUM_THREADS``. With two threads
#: on a shared two-core machine, an op waits at OpenMP's barrier for a helper thread not yet run: the
#: eager baseline of a 0.006 ms reduction took 16-24 ms per call in bursts (one pair read 640x). One
#: thread per worker keeps CPU timings independent of the load and treats baseline and candidate alike.
CPU_INTRA_OP_THREADS = "1"


class Worker(LimitWatch, IsolationReport):
    """One worker process and its channel. Use as a context manager; it is always killed on exit."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        _scratch.sweep_orphaned_scratch()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kbv-{spec.role}-", dir=_scratch.scratch_parent()))
        (self.scratch / _scratch.OWNER_FILE).write_text(str(os.getpid()))
        self.home = self.scratch / "home"
        self.home.mkdir()
        #: The worker's greeting, once read (:meth:`wait_ready`).
        self.hello: wire_replies.Hello | None = None
        #: What decides the memory rule sent with every request: the evaluation's, once it binds it.
        self.budget = MemoryBudget()
        self._proc: subprocess.Popen[bytes] | _forkserver.ForkedProcess | None = None
        #: How the process started: forked from kbv's fork server, or a fresh interpreter (and why).
        self.started_as = ""
        self._sock: socket.socket | None = None
        self._stdout = self.scratch / "stdout.log"
        self._stderr = self.scratch / "stderr.log"
        self._counter = 0
        #: The last request id sent, and the ids whose replies are still to be read, oldest first.
        self._last_id = 0
        self._awaited: deque[int] = deque()
        #: Each request whose reply is unread: its op (the reply's kind) and when sent (:attr:`last_span`).
        self._sent: dict[int, tuple[str, float]] = {}
        #: Replies read while a later request's was awaited, by request id (:meth:`receive_reply`).
        self._unread: dict[int, wire_replies.Reply] = {}
        #: The span of the last request whose reply was read, a failed one's too (:class:`RequestSpan`).
        self.last_span: RequestSpan | None = None
        self.remaining_s = spec.budget_s
        self._tag = uuid.uuid4().hex[:12]
        self._cgroup: _contain.Cgroup | None = None
        self._last_poll = 0.0
        self._last_scan = 0.0
        self._known: set[int] = set()
        #: The limit the worker was killed for ({limit, figure, allowed, unit}), if any.
        self.exceeded: dict[str, Any] | None = None
        #: Largest resident memory of the worker's process tree the parent saw, and of the device.
        self.host_peak_bytes = 0
        self.device_peak_bytes: int | None = None
        #: The uid a candidate worker runs as (None: the parent's), and why not where root could not drop.
        self.uid: int | None = None
        self._no_drop: str | None = None
        #: The build directory (``launch``), and (device, inode) of the files :meth:`give` put in
        #: the scratch: the parent's, not counted against the candidate's disk limit.
        self._builds = cache_root() / "builds" / spec.build_key[:32]
        self._given: set[tuple[int, int]] = set()
        #: Descriptors of exported device memory that came with the last reply (``kbv.handoff``).
        self._fds: list[int] = []
        #: The last hand-over read: the elements it claimed, for how many calls' outputs.
        self.last_handover: tuple[int, int] = (0, 1)
        self._private_net = False
        self._exit_asked = False  # an ``exit`` request sent, its reply not read yet
        self._closed = False
        #: Set while kbv itself holds this worker stopped (:meth:`paused`): a stop seen then is ours.
        self._pausing = False
        #: The worker found stopped (state ``T``) by a signal kbv did not send: {pid, role, state}.
        self.stopped: dict[str, Any] | None = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> wire_replies.Hello:
        """Launch the process and wait for its greeting."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting, so several workers can boot at once (again: no-op)."""
        if self._proc is not None:
            return
        builds = self._builds = cache_root() / "builds" / self.spec.build_key[:32]
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
        arch = (
            arch_list_for(telemetry.compute_capability(self.spec.device))
            if self.spec.device.startswith("cuda")
            else None
        )
        if arch:  # the flags an ahead-of-time build used (kbv.worker.builds): its build is reused
            env["TORCH_CUDA_ARCH_LIST"] = arch
        if self.spec.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", CPU_INTRA_OP_THREADS)
        env.update(self.spec.extra_env)
        if self.spec.role == "candidate":
            env.update(confinement_env((self.scratch, builds), gpu=self.spec.device.startswith("cuda")))
        env[_contain.MARKER_ENV] = self.marker
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_kbv_src(), env.get("PYTHONPATH", "")) if p)
        parent_end, child_end = socket.socketpair()
        child = [
            sys.executable,
            "-m",
            "kbv.child.main",
            str(child_end.fileno()),
            self.spec.role,
            *(["probes"] if self.spec.warm_probes else []),
        ]
        with open(self._stdout, "wb") as out, open(self._stderr, "wb") as err:
            self._proc = self._fork(env, builds, child_end.fileno(), out.fileno(), err.fileno())
            if self._proc is None:
                argv, user = self._command(child, builds)
                self._proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.home,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(child_end.fileno(),),
                    start_new_session=True,  # its own process group, so a timeout kills every child
                    user=user,
                    group=user,
                    extra_groups=[] if user is not None else None,
                )
        child_end.close()
        self._sock = parent_end
        self._contain_started()

    def wait_ready(self) -> wire_replies.Hello:
        """The worker's greeting, read once. It is sent before any problem or candidate code runs
        in the worker, so a malformed one is kbv's error (:class:`kbv.wire.WireError`)."""
        if self.hello is None:
            self.hello = wire_replies.parse_hello(self._receive())
        return self.hello

    def request(self, request: wire.Request) -> wire_replies.Reply:
        """Send one request (its kind's :mod:`kbv.wire` dataclass) and wait for its reply within the
        worker's remaining budget."""
        return self.receive_reply(self.send_request(request))

    def send_request(self, request: wire.Request) -> int:
        """The first half of :meth:`request`: two workers can then work at once. Returns the
        request's id, whose reply :meth:`receive_reply` awaits."""
        if self._sock is None:
            raise RuntimeError("worker not started")
        added: dict[str, Any] = {}
        if request.memory is None:
            added["memory"] = self.budget.rule(self.spec.role)
        if isinstance(request, wire.Load) and request.handoff is None:
            added["handoff"] = self.handoff
        envelope = self._envelope(dataclasses.replace(request, **added) if added else request)
        try:
            _channel.send(self._sock, envelope.to_json())
        except OSError as exc:
            self.kill()
            raise WorkerFailed(
                "crashed", f"the worker is gone ({exc})", self.logs(), role=self.spec.role
            ) from exc
        return envelope.id

    def _envelope(self, request: wire.Request) -> wire.Envelope:
        """``request`` with the next id; its reply is awaited after any still unread."""
        self._last_id += 1
        envelope = wire.Envelope(self._last_id, request)
        self._awaited.append(envelope.id)
        self._sent[envelope.id] = (request.op, time.monotonic())
        return envelope

    def receive_reply(self, request_id: int | None = None) -> wire_replies.Reply:
        """The reply to the request ``request_id`` (default: the oldest whose reply is unread), as
        its kind's :mod:`kbv.wire_replies` dataclass. The replies of requests sent before it are
        read first, in order, and kept for their own :meth:`receive_reply`; a failed one raises when
        read."""
        if request_id is not None and request_id in self._unread:
            return self._unread.pop(request_id)
        if not self._awaited or (request_id is not None and request_id not in self._awaited):
            raise wire.WireError(f"a reply was awaited for no request sent ({request_id})")
        while True:
            awaited = self._awaited.popleft()
            # (an id without an entry is a mixed-up one: wire.check_reply refuses its reply below)
            op, sent_at = self._sent.pop(awaited, ("", time.monotonic()))
            self._receiving = op  # what a limit found past while waiting is charged to
            try:
                message = self._receive()
            finally:
                self._receiving = None  # a failed read too: a later poll is not charged to it
            wire.check_reply(message, awaited)
            reply = self._parsed(op, message)
            self.last_span = RequestSpan(sent_at, time.monotonic(), reply.device_reserved_peak)
            self._raise_if_failed(reply)
            if request_id is None or awaited == request_id:
                return reply
            self._unread[awaited] = reply

    def _parsed(self, op: str, message: dict[str, Any]) -> wire_replies.Reply:
        """``message`` as the reply to an ``op`` request. A candidate worker runs the candidate's
        code, which can write what it likes to the channel: its malformed reply is its failure
        (``runtime_error``). A trusted worker's is kbv's own error (:class:`kbv.wire.WireError`)."""
        try:
            return wire_replies.parse(op, message)
        except wire.WireError as exc:
            if self.spec.role != "candidate":
                raise
            raise WorkerFailed(
                "runtime_error", f"the worker's reply is malformed: {exc}", self.logs(), role=self.spec.role
            ) from exc

    def _raise_if_failed(self, reply: wire_replies.Reply) -> None:
        if not isinstance(reply, wire_replies.Failed):
            return
        error = reply.error
        kind = str(error.get("kind", "runtime_error"))
        if kind == "cuda_error":
            self.kill()
        limits = self.spec.limits
        over = None
        if limits is not None and _contain.is_open_files_error(error):
            over = _contain.open_files_exceeded(limits)
        elif limits is not None and limits.disk_gb and _contain.is_file_size_error(error):
            over = _contain.file_size_exceeded(limits, self.disk_bytes())
        if over is not None:
            kind, error = "resource_limit", {**error, **over}
            self.exceeded = {k: error[k] for k in ("limit", "figure", "allowed", "unit")}
            self.kill()  # the evaluation ends here, as for a limit the parent's poll caught
        raise WorkerFailed(kind, str(error.get("message", "")), {**error, **self.logs()}, role=self.spec.role)

    def receive_outputs(self, description: Any, calls: int = 1) -> list[Any]:
        """The parent's own copies of ``calls`` calls' outputs a reply handed over, on the device.
        Something unreadable is the worker's failure; the parent with no room for its copies raises
        torch's ``OutOfMemoryError`` (:attr:`last_handover`: what the worker claimed)."""
        from kbv import (
            handoff as _handoff,  # torch: not needed before a worker has answered (fast usage errors)
        )

        self.last_handover = (_handoff.claimed_elements(description), max(1, calls))
        try:
            # A candidate's IPC descriptor is bounded by the allocation the driver opened.
            bounded = self.spec.role == "candidate"
            return _handoff.receive(description, self.spec.device, self._fds, bounded=bounded)
        except _handoff.HandoffError as exc:
            raise WorkerFailed("runtime_error", str(exc), self.logs()) from exc

    def fill_inbox(self, description: Any, named: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Write trusted tensors into the inbox this worker's last reply opened (``kbv.handoff``). An
        inbox that cannot hold them or cannot be opened is the worker's failure."""
        from kbv import handoff as _handoff

        try:
            _handoff.fill_inbox(description, self._fds, named, items, self.spec.device)
        except _handoff.HandoffError as exc:
            raise WorkerFailed("runtime_error", str(exc), self.logs()) from exc

    def new_path(self, stem: str) -> str:
        """A fresh file name in this worker's scratch directory, for tensors it writes."""
        self._counter += 1
        return str(self.scratch / f"{stem}-{self._counter}.pt")

    def give(self, path: str) -> str:
        """Copy a file the parent or a trusted worker wrote into this worker's scratch, under a fresh
        name it cannot have prepared (no symlink planted there redirects the write), readable by
        the worker's own uid; returns the new path."""
        target = self.scratch / f"given-{uuid.uuid4().hex}.pt"
        try:
            # A hard link, not a copy, where both scratch directories share a filesystem (/dev/shm):
            # a GEMM's parameters are 256 MB per distribution. link() makes a fresh name (it fails
            # on one that exists) and does not follow a symlink; what the worker may later write
            # into that file, no trusted process reads again.
            os.link(path, target)
            os.chmod(target, 0o644)
            self._note_given(target)
            return str(target)
        except OSError:
            target.unlink(missing_ok=True)  # another filesystem, or links refused here: copy
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with open(path, "rb") as source, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out)
        self._note_given(target)
        return str(target)

    def _note_given(self, target: Path) -> None:
        info = os.stat(target, follow_symlinks=False)
        self._given.add((info.st_dev, info.st_ino))

    @property
    def handoff(self) -> str:
        """How this worker hands tensors over. On a GPU a worker under another uid exports VMM
        memory, because the parent cannot open its legacy IPC handles (``kbv._vmm``). On the CPU the
        trusted reference writes an anonymous memory file, which a candidate running beside it
        cannot open (``kbv.handoff``); a candidate writes a file in its own scratch."""
        if not self.spec.device.startswith("cuda"):
            trusted = self.spec.role == "reference"
            return "memfd" if trusted and _channel.memfd_available() else "file"
        return "cuda_vmm" if self.uid is not None else "cuda_ipc"

    def _receive(self) -> dict[str, Any]:
        assert self._sock is not None
        started = time.monotonic()
        _channel.close_fds(self._fds)  # the last reply's outputs were copied (or never will be)
        try:
            reply = _channel.receive(
                self._sock,
                started + max(self.remaining_s, 0.0),
                alive=self._watch,
                poll_s=POLL_S,
                fds=self._fds,
            )
            self._raise_if_exceeded()  # a reply that raced the kill does not undo the limit
            return reply
        except _channel.ChannelTimeout as exc:
            self.kill()
            raise WorkerFailed(
                "timeout", "the worker did not finish before the timeout", self.logs(), role=self.spec.role
            ) from exc
        except _channel.ChannelClosed as exc:
            code = self.kill()
            self._raise_if_exceeded()
            self._raise_if_stopped()
            raise WorkerFailed(
                "crashed", f"{exc} (exit status {code})", self.logs(), role=self.spec.role
            ) from exc
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
        call instead of 0.006 ms. A stopped process takes none. Only call it between requests.

        A candidate's processes that left the group (their own session, a double fork) are found
        as :meth:`members` finds them and stopped one by one: a helper in a session of its own
        would otherwise burn CPU, or launch GPU work, while the baselines are timed and make the
        candidate look faster. Kernels such a process queued before it stopped still run."""
        if not self.alive() or self._proc is None:
            yield
            return
        self._pausing = True
        with contextlib.suppress(ProcessLookupError, PermissionError, ChildProcessError):
            os.killpg(self._proc.pid, signal.SIGSTOP)
            if isinstance(self._proc, _forkserver.ForkedProcess):
                self._proc.wait_stopped()
            else:
                os.waitpid(self._proc.pid, os.WUNTRACED)  # returns once it has stopped (it stays unreaped)
        escaped: list[int] = []  # filled as they stop, so an interruption still lets them go on
        try:
            if self.spec.role == "candidate":
                self._stop_escaped(escaped)
            yield
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGCONT)
            for pid in escaped:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            self._pausing = False

    def _stop_escaped(self, stopped: list[int]) -> None:
        """SIGSTOP every member of this worker outside its process group, adding each to
        ``stopped``. Rounds repeat because a member may fork between the scan and its stop; the
        wait for them to stop shares one deadline (a process that cannot stop costs it once)."""
        assert self._proc is not None
        deadline = time.monotonic() + ESCAPED_STOP_WAIT_S
        for _ in range(ESCAPED_STOP_ROUNDS):
            fresh = [p for p in self.members() if p not in stopped and not _in_group(p, self._proc.pid)]
            if not fresh:
                break
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            for pid in fresh:
                _forkserver.wait_stopped(pid, max(0.0, deadline - time.monotonic()))

    def kill(self) -> int | None:
        """Kill the worker and every process it started (see :meth:`_kill_tree`); returns its exit status."""
        if self._proc is None:
            return None
        self._kill_tree()
        return self._reap()

    def _reap(self) -> int | None:
        assert self._proc is not None
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        close_all([self])

    def _ask_exit(self) -> None:
        """Ask a live worker to exit (its reply is read by :meth:`_await_exit`)."""
        self._exit_asked = False
        if self._sock is not None and self.alive():
            try:
                _channel.send(self._sock, self._envelope(wire.Exit()).to_json())
                self._exit_asked = True
            except OSError:
                pass

    def _await_exit(self) -> None:
        if self._exit_asked and self._sock is not None:
            self._exit_asked = False
            with contextlib.suppress(OSError, _channel.ChannelClosed, _channel.ChannelTimeout):
                _channel.receive(self._sock, time.monotonic() + 2, alive=self.alive)

    def _clean_up(self) -> None:
        self._closed = True
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        _channel.close_fds(self._fds)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def logs(self) -> dict[str, str]:
        return {"stdout": _tail(self._stdout), "stderr": _tail(self._stderr)}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def scheduler_ns(self) -> dict[str, int] | None:
        """The kernel's scheduler counts for this worker (``_contain.scheduler_ns``): its main
        thread, and every thread of every process of its tree and its cgroup. Read around every
        timed batch, so from the tree's own ``children`` files (``kbv.processes.tree_pids``), not
        :meth:`members`' scan of every process on the machine (3 ms a call, 14 calls in a
        ``verified`` evaluation on the CPU). The worker is a child subreaper: whatever its tree
        starts stays below it, double-forked or not; a process only the environment marker finds
        was started from outside the tree, and the sweep at close still finds and kills it."""
        if self._proc is None:
            return None
        pid = self._proc.pid
        tree = tree_pids(pid)
        if tree is None:
            return _contain.scheduler_ns(pid, [p for p in self.members() if p != pid])
        grouped = self._cgroup.pids() if self._cgroup else []
        return _contain.scheduler_ns(pid, sorted({*tree, *grouped} - {pid}))

    # -- containment ------------------------------------------------------------------------------
    @property
    def marker(self) -> str:
        """This worker's value of ``KBV_WORKER_TAG``: the owner's pid and a tag of its own."""
        return f"{os.getpid()}:{self._tag}"

    def members(self) -> list[int]:
        """Every live process of this worker: itself, its cgroup, its /proc descendants, marked ones."""
        if self._proc is None:
            return []
        table = _contain.process_table()
        found = {self._proc.pid} if self._proc.pid in table else set()
        found.update(p for p in (self._cgroup.pids() if self._cgroup else []) if p in table)
        found.update(_contain.descendants(self._proc.pid, table))
        found.update(_contain.marked(self.marker, table))
        return sorted(found)

    def finish(self) -> list[dict[str, Any]]:
        """End of the evaluation: kill whatever the worker started that still runs, and say what it was.

        Returns ``{pid, command, own_session}`` per process (``own_session``: it left the worker's
        session, i.e. it made an effort to escape). The worker itself keeps running until ``close``."""
        if self._proc is None:
            return []
        worker = self._proc.pid
        session = _session_of(worker)
        left = []
        for pid in self.members():
            if pid == worker:
                continue
            left.append(
                {
                    "pid": pid,
                    "command": _contain.command_line(pid),
                    "own_session": _session_of(pid) not in (session, None),
                }
            )
        peak = _contain.peak_rss_bytes(worker)
        if peak:
            self.host_peak_bytes = max(self.host_peak_bytes, peak)
        for _ in range(5):
            rest = [p for p in self.members() if p != worker]
            if not rest:
                break
            _contain.kill_pids(rest)
            time.sleep(0.01)
        return left

    def _namespace_prefix(self) -> tuple[str, ...]:
        """Candidate workers start in a private network namespace where the machine allows one."""
        return _contain.network_namespace()[0] if self.spec.role == "candidate" else ()

    def _fork(
        self, env: dict[str, str], builds: Path, channel: int, stdout: int, stderr: int
    ) -> _forkserver.ForkedProcess | None:
        """The worker forked from kbv's fork server (torch already imported there), contained as
        :meth:`_command` would start it: its own session, network namespace and uid. None where the
        fork server is off or failed: the caller starts a fresh interpreter."""
        server = _forkserver.fork_server(_kbv_src())
        if server is None:
            self.started_as = f"fresh interpreter ({_forkserver.unavailable_reason()})"
            return None
        prefix, uid = self._containment(builds)
        try:
            process = server.spawn(
                channel_fd=channel,
                stdout_fd=stdout,
                stderr_fd=stderr,
                env=env,
                cwd=str(self.home),
                role=self.spec.role,
                warm_probes=self.spec.warm_probes,
                uid=uid,
                private_network=bool(prefix),
            )
        except _forkserver.ForkServerError as exc:
            self.started_as = f"fresh interpreter ({exc})"
            return None
        self.started_as = "forked from kbv's fork server"
        return process

    def _command(self, command: list[str], builds: Path) -> tuple[list[str], int | None]:
        """The argv that starts a worker, and the uid ``Popen`` should switch to (None: keep ours).

        A candidate worker of a root parent drops to the uid of its source (``_privileges``), after
        its network namespace is made (that step needs root): ``unshare`` then ``setpriv``."""
        prefix, uid = self._containment(builds)
        if uid is None:
            return [*prefix, *command], None
        wrapped = _privileges.start_command(uid, prefix, command)
        if wrapped is not None:
            return wrapped, None
        self._private_net = False  # without setpriv the uid wins over the namespace (isolation says so)
        return command, uid

    def _containment(self, builds: Path) -> tuple[tuple[str, ...], int | None]:
        """The network-namespace prefix a candidate worker starts under (empty: none here) and the uid
        it drops to (None: the parent's); hands the worker's directories to that uid."""
        prefix = self._namespace_prefix()
        if self.spec.role != "candidate":
            return prefix, None
        # On a GPU a dropped worker hands outputs over as exported VMM memory (``handoff``): the
        # parent cannot open its legacy CUDA IPC handles (measured on the H200, driver 580).
        plan = _privileges.plan(
            self.spec.build_key, self.spec.readable, (str(self.scratch.parent), str(builds.parent))
        )
        self._no_drop = plan.reason
        self._private_net = bool(prefix)
        if plan.uid is None:
            return prefix, None
        _privileges.hand_over(plan.uid, self.scratch, builds)
        self.uid = plan.uid
        return prefix, plan.uid

    def _contain_started(self) -> None:
        """Right after the process started, before any candidate code runs (that waits for ``load``)."""
        assert self._proc is not None
        if self.spec.role == "candidate":
            self._cgroup = _contain.Cgroup.create(self._tag)
            if self._cgroup is not None and not self._cgroup.add(self._proc.pid):
                self._cgroup.remove()
                self._cgroup = None
        if self.spec.limits is not None:
            _contain.set_open_files_limit(self._proc.pid, int(self.spec.limits.open_files))
            _contain.set_file_size_limit(self._proc.pid, _contain.disk_limit_bytes(self.spec.limits))

    def _kill_tree(self) -> None:
        """SIGKILL the worker's cgroup, descendants and marked processes, then the worker and its group.

        Descendants go first, while the worker (their subreaper) still holds the orphans; rounds
        repeat because a process may fork while its siblings are being killed."""
        assert self._proc is not None
        worker = self._proc.pid
        if self._cgroup is not None:
            self._cgroup.kill()
        for _ in range(5):
            others = [p for p in self.members() if p != worker]
            if not others:
                break
            _contain.kill_pids(others)
            time.sleep(0.01)
        for kill in (os.killpg, os.kill):  # the group: children sharing it outlive a dead leader
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(worker, signal.SIGKILL)
        _contain.kill_pids([p for p in self.members() if p != worker])


#: Scans for a paused candidate's processes outside its group (:meth:`Worker.paused`).
ESCAPED_STOP_ROUNDS = 3
#: Seconds a pause waits, in all, for those processes to show as stopped.
ESCAPED_STOP_WAIT_S = 1.0


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except OSError:
        return True  # gone: nothing to stop


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def close_all(workers: Iterable[Worker]) -> None:
    """Close several workers side by side: each is asked to exit and killed before any is waited
    for, so their processes (a CUDA context each) end at once instead of one after the other."""
    workers = [w for w in workers if not w._closed]
    for worker in workers:
        worker._ask_exit()
    for worker in workers:
        worker._await_exit()
    started = [w for w in workers if w._proc is not None]
    for worker in started:
        worker._kill_tree()
    for worker in started:
        worker._reap()
    for worker in workers:
        worker._clean_up()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _kbv_src() -> str:
    """The directory that holds the ``kbv`` package, so workers import this very copy."""
    return str(Path(__file__).resolve().parents[2])
