"""Containment of a worker's process tree, seen from the trusted parent.

A candidate may start processes in a session of their own (``setsid``), double-fork them away from
its worker, or allocate until the machine swaps. Everything here works from outside the candidate's
process, so nothing the candidate does in its own interpreter undoes it:

- a cgroup (v2) per worker where the kernel lets this process create one: every process the worker
  starts stays in it whatever session or group it makes, and ``cgroup.kill`` ends them at once;
- the worker is a child subreaper (``kbv.child.guard``), so orphans of its children stay its
  descendants in ``/proc``, and every worker carries a marker in its environment
  (:data:`MARKER_ENV`) that its children inherit; the parent's sweep at close kills all three sets
  (cgroup members, ``/proc`` descendants, marked processes);
- limits (host memory, processes, open files) are polled by the parent while it waits for a reply,
  and the open-files limit is also a hard ``RLIMIT_NOFILE`` set on the worker before it loads any
  candidate code.

What cannot be done on a machine (no writable cgroup, no ``/proc`` of other users) is reported by
:func:`capabilities` and written into every record, never silently skipped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kbv.processes import MARKER_ENV as MARKER_ENV  # ``<owner pid>:<worker tag>``; children inherit it
from kbv.processes import Proc, kill_pids, process_table
from kbv.processes import descendants as descendants  # the parent's callers read them here too
from kbv.processes import read_proc as read_proc

_CGROUP_PREFIX = "kbv-"


def marked(marker: str, table: dict[int, Proc]) -> list[int]:
    """Pids whose environment carries ``MARKER_ENV=marker`` (those whose environ this process may read)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for pid in table:
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def open_files(pid: int) -> int | None:
    """Open descriptors of one process, or None when its ``/proc/<pid>/fd`` is closed to us."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def scheduler_ns(pid: int, members: list[int] | None = None) -> dict[str, int] | None:
    """What the kernel's scheduler counted (nanoseconds), or None where ``/proc`` does not say:
    ``main_cpu`` and ``main_wait``, the time the main thread of ``pid`` spent on a CPU and runnable
    but waiting for one (``/proc/<pid>/schedstat``), and ``cpu``, the CPU time of ``pid`` and of
    ``members`` (the worker's other processes): each process's CPU clock, which keeps the time of
    its threads that have exited, plus the children it has reaped (``stat``, in clock ticks). Read
    by the parent around a timed batch: a gap in the batch's bracket is then told apart as the
    worker waiting for a CPU (a loaded machine) or its processes computing outside its samples."""
    try:
        with open(f"/proc/{pid}/schedstat") as handle:
            on_cpu, waiting = (int(x) for x in handle.read().split()[:2])
    except (OSError, ValueError):
        return None
    total = sum(_process_cpu_ns(p) for p in {pid, *(members or [])})
    return {"main_cpu": on_cpu, "main_wait": waiting, "cpu": max(total, on_cpu)}


def _process_cpu_ns(pid: int) -> int:
    """A process's CPU time (all its threads, live or exited) and its reaped children's; 0 where it
    is gone or closed to us."""
    try:
        own = time.clock_gettime_ns(((~pid) << 3) | 2)  # the process's CPU clock (CPUCLOCK_SCHED)
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        reaped = (int(fields[13]) + int(fields[14])) * 1_000_000_000 // _CLOCK_TICKS  # cutime, cstime
    except (OSError, ValueError, IndexError, AttributeError):
        return 0
    return own + reaped


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int) -> int | None:
    """The kernel's high-water mark of one process's resident memory (``VmHWM``)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ------------------------------------------------------------------------------------------------
# cgroup v2


def _cgroup2_root() -> Path | None:
    """Where a cgroup2 hierarchy is mounted: ``/sys/fs/cgroup`` (unified) or ``.../unified`` (hybrid)."""
    for candidate in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (candidate / "cgroup.procs").is_file() and (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


def _own_cgroup2(root: Path) -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return root / line[3:].lstrip("/")
    except OSError:
        return None
    return None


class Cgroup:
    """A cgroup (v2) of one worker. :meth:`create` returns None where the kernel does not allow it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def create(tag: str) -> Cgroup | None:
        root = _cgroup2_root()
        home = _own_cgroup2(root) if root else None
        if home is None:
            return None
        path = home / f"{_CGROUP_PREFIX}{os.getpid()}-{tag}"
        try:
            path.mkdir()
        except OSError:
            return None
        return Cgroup(path)

    def add(self, pid: int) -> bool:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> None:
        """Kill every member: ``cgroup.kill`` (Linux 5.14+) does it atomically; else one by one until
        empty."""
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        for _ in range(50):
            members = self.pids()
            if not members:
                return
            kill_pids(members)
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for _ in range(100):  # members leave the cgroup only once they have been reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)


def sweep_orphaned_cgroups(owner_alive: Any) -> None:
    """Kill and remove worker cgroups whose owning kbv process is gone (``kill -9`` skips ``close``)."""
    root = _cgroup2_root()
    home = _own_cgroup2(root) if root else None
    if home is None or not home.is_dir():
        return
    for path in home.glob(f"{_CGROUP_PREFIX}*-*"):
        try:
            owner = int(path.name[len(_CGROUP_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not owner_alive(owner):
            Cgroup(path).remove()


def sweep_orphaned_marked(owner_alive: Any) -> list[int]:
    """Kill processes carrying a worker marker whose owning kbv process is gone; returns their pids."""
    table = process_table()
    orphans = []
    for pid in table:
        marker = _marker_of(pid)
        if marker is None:
            continue
        try:
            owner = int(marker.split(":", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not owner_alive(owner):
            orphans.append(pid)
    kill_pids(orphans)
    return orphans


def _marker_of(pid: int) -> str | None:
    prefix = f"{MARKER_ENV}=".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            for item in handle.read().split(b"\0"):
                if item.startswith(prefix):
                    return item[len(prefix) :].decode(errors="replace")
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------------------------
# Limits


def set_open_files_limit(pid: int, limit: int) -> bool:
    """A hard ``RLIMIT_NOFILE`` on a started worker (its children inherit it). Root can raise it
    again (CAP_SYS_RESOURCE), which is why the parent also counts open files while it waits."""
    if limit <= 0 or not hasattr(resource, "prlimit"):
        return False
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        value = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (value, value))
        resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # no core dumps of candidate memory
        return True
    except (OSError, ValueError):
        return False


def disk_limit_bytes(limits: Any) -> int:
    return int(limits.disk_gb * (1 << 30))


def set_file_size_limit(pid: int, limit_bytes: int) -> bool:
    """A hard ``RLIMIT_FSIZE`` on a started worker (its children inherit it): no file it writes
    grows past ``limit_bytes`` (Python ignores SIGXFSZ, so the write fails with EFBIG; a compiled
    program is killed by it). One file only: the parent's poll sums them (:func:`files_bytes`)."""
    if limit_bytes <= 0 or not hasattr(resource, "prlimit"):
        return False
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        value = limit_bytes if hard == resource.RLIM_INFINITY else min(limit_bytes, hard)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (value, value))
        return True
    except (OSError, ValueError):
        return False


def files_bytes(roots: list[Path], skip: set[tuple[int, int]]) -> int:
    """Bytes the files beneath ``roots`` occupy (allocated blocks, so a sparse file counts what it
    holds), each inode once, symlinks not followed, files whose (device, inode) is in ``skip`` (what
    the parent put there) left out."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(r) for r in roots]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (info.st_dev, info.st_ino)
            if key in seen or key in skip:
                continue
            seen.add(key)
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                total += info.st_blocks * 512
    return total


def is_file_size_error(error: dict[str, Any]) -> bool:
    """A worker's error report that is the hard ``RLIMIT_FSIZE`` refusing a write (EFBIG)."""
    message = str(error.get("message", ""))
    return "[Errno 27]" in message or "File too large" in message


def file_size_exceeded(limits: Any, measured: int | None) -> dict[str, Any]:
    """The ``exceeded`` record of a write the kernel refused at the file-size limit: the figure is
    what the candidate's files took when the parent looked, at least one byte past the limit."""
    allowed = disk_limit_bytes(limits)
    over = {"limit": "disk", "figure": max(allowed + 1, measured or 0), "allowed": allowed, "unit": "bytes"}
    return {
        **over,
        "message": f"{describe_exceeded(over)} (the kernel refused to grow a file past the limit)",
    }


@dataclass
class Usage:
    """What the parent measured of one worker's tree in one poll."""

    processes: int
    rss_bytes: int
    open_files: int | None
    device_bytes: int | None = None
    disk_bytes: int | None = None


def tree_usage(members: list[int], table: dict[int, Proc], count_files: bool) -> Usage:
    rss = sum(table[p].rss_bytes for p in members if p in table)
    files: int | None = None
    if count_files:
        counts = [open_files(p) for p in members if p in table]
        known = [c for c in counts if c is not None]
        files = max(known) if known else None  # RLIMIT_NOFILE is per process: compare the largest
    return Usage(processes=len([p for p in members if p in table]), rss_bytes=rss, open_files=files)


def exceeded(usage: Usage, limits: Any) -> dict[str, Any] | None:
    """The first limit ``usage`` is over, as ``{limit, figure, allowed, unit}``; None when within all.

    ``limits`` is a :class:`kbv.protocol.LimitSettings`; a limit of 0 is off."""
    host = int(limits.host_memory_gb * (1 << 30))
    device = int(limits.device_memory_gb * (1 << 30))
    checks = (
        ("host_memory", usage.rss_bytes, host, "bytes"),
        ("device_memory", usage.device_bytes, device, "bytes"),
        ("disk", usage.disk_bytes, disk_limit_bytes(limits), "bytes"),
        ("processes", usage.processes, int(limits.processes), "processes"),
        ("open_files", usage.open_files, int(limits.open_files), "descriptors"),
    )
    for name, figure, allowed, unit in checks:
        if allowed > 0 and figure is not None and figure > allowed:
            return {"limit": name, "figure": int(figure), "allowed": allowed, "unit": unit}
    return None


def is_open_files_error(error: dict[str, Any]) -> bool:
    """A worker's error report that is the hard ``RLIMIT_NOFILE`` refusing a descriptor (EMFILE)."""
    return "[Errno 24]" in str(error.get("message", "")) or "Too many open files" in str(
        error.get("message", "")
    )


def open_files_exceeded(limits: Any) -> dict[str, Any]:
    """The ``exceeded`` record of an open-files refusal (the kernel refused descriptor ``allowed + 1``)."""
    allowed = int(limits.open_files)
    over = {"limit": "open_files", "figure": allowed + 1, "allowed": allowed, "unit": "descriptors"}
    return {
        **over,
        "message": f"{describe_exceeded(over)} (the kernel refused the descriptor beyond the limit)",
    }


def describe_exceeded(over: dict[str, Any]) -> str:
    """What a limit found past says: the figure, the limit and, where the poll knew it, what the
    worker was doing then (``during``: ``request OP`` or ``between requests``)."""
    during = f" ({over['during']})" if over.get("during") else ""
    if over["unit"] == "bytes":
        return (
            f"{over['limit']} limit exceeded: {over['figure'] / (1 << 20):.1f} MiB used, "
            f"{over['allowed'] / (1 << 20):.1f} MiB allowed{during}"
        )
    figure = f"{over['figure']} {over['unit']}"
    return f"{over['limit']} limit exceeded: {figure}, {over['allowed']} allowed{during}"


@functools.lru_cache(maxsize=1)
def network_namespace() -> tuple[tuple[str, ...], str | None]:
    """A command prefix that starts a worker in a private network namespace (only a loopback that is
    down: no network, not even the parent's localhost), or ``((), reason)`` where that is impossible.

    ``unshare`` execs the worker in place, so the pid the parent holds is the worker's own.
    ``KBV_WORKER_NETNS=0`` turns it off."""
    if os.environ.get("KBV_WORKER_NETNS", "1") == "0":
        return (), "turned off (KBV_WORKER_NETNS=0)"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return (), "needs root (kbv does not use unprivileged user namespaces)"
    tool = shutil.which("unshare")
    if tool is None:
        return (), "no unshare(1) on this machine"
    try:
        ok = subprocess.run([tool, "--net", "--", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return ((tool, "--net", "--"), None) if ok else ((), "the kernel refused a network namespace")


def capabilities() -> dict[str, Any]:
    """What containment this machine allows, for the record's ``isolation`` section."""
    root = _cgroup2_root()
    home = _own_cgroup2(root) if root else None
    writable = bool(home and os.access(home, os.W_OK))
    return {
        "cgroup": "v2" if writable else None,
        "proc_visible": os.path.isdir("/proc/self"),
        "as_root": os.geteuid() == 0 if hasattr(os, "geteuid") else False,
    }
