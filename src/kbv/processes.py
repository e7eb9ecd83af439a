"""Process helpers both sides of the boundary use: the ``/proc`` table, killing a set of pids, and
making a process non-dumpable.

The parent's containment (``kbv.worker._contain``) and the worker's own guard (``kbv.child.guard``)
both walk the table, so it lives here, beside neither; stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass

#: Environment variable every worker carries (``<owner pid>:<worker tag>``); children inherit it,
#: and the parent's sweep finds them by it in ``/proc/<pid>/environ``.
MARKER_ENV = "KBV_WORKER_TAG"
#: The fork server's value of MARKER_ENV: room that a forked worker overwrites with its own marker
#: in place, because ``/proc/<pid>/environ`` shows the block a process was exec'd with, not
#: ``os.environ`` (``kbv.child.zygote``). Not a marker itself: it names no owner pid.
MARKER_SLOT = "-" * 48

#: Set by the parent in a candidate worker's (and an ahead-of-time build's) environment: the
#: directories it may write beneath, ``os.pathsep``-separated (``kbv.child.confine``, Landlock).
CONFINE_WRITE_ENV = "KBV_CONFINE_WRITE"
#: ``1`` where that process may use a GPU (CUDA's device files and ``/dev/shm`` become writable).
CONFINE_GPU_ENV = "KBV_CONFINE_GPU"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class Proc:
    """One live (non-zombie) process as ``/proc`` shows it."""

    pid: int
    ppid: int
    session: int
    rss_bytes: int


def process_table() -> dict[int, Proc]:
    """Every live process this one can see, zombies excluded (they hold no memory and do no work)."""
    table: dict[int, Proc] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return table
    for entry in entries:
        proc = read_proc(int(entry))
        if proc is not None:
            table[proc.pid] = proc
    return table


def read_proc(pid: int) -> Proc | None:
    """One process from ``/proc/<pid>/stat``; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is the state (field 3 of stat(5)); ppid is field 4, the session id 6, rss (pages) 24.
    if fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[1]), int(fields[3]), int(fields[21]) * _PAGE)


def descendants(root: int, table: dict[int, Proc]) -> list[int]:
    """Pids below ``root`` in the parent-child tree (``root`` itself excluded)."""
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        nxt = [c for pid in frontier for c in children.get(pid, []) if c != root and c not in found]
        found.extend(nxt)
        frontier = nxt
    return found


def tree_pids(root: int) -> list[int] | None:
    """Live pids below ``root`` (itself excluded), read from each thread's
    ``/proc/<pid>/task/<tid>/children`` down the tree: the files of the tree alone, where
    :func:`descendants` needs every process's ``stat``. None where the kernel publishes no such
    file (``CONFIG_PROC_CHILDREN``), a file of the tree is closed to this process, or ``root`` is
    gone; the caller then scans the table (a member left out would hide its CPU time)."""
    found: list[int] = []
    frontier = [root]
    while frontier:
        nxt: list[int] = []
        for pid in frontier:
            try:
                threads = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                if pid == root:
                    return None
                continue  # exited since its parent listed it
            except OSError:
                return None
            for tid in threads:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children") as handle:
                        nxt.extend(int(child) for child in handle.read().split())
                except FileNotFoundError:
                    if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                        return None  # the thread is there, its children file is not
                    continue  # the thread or its process exited since the listing
                except (OSError, ValueError):
                    return None
        frontier = [c for c in dict.fromkeys(nxt) if c != root and c not in found]
        found.extend(frontier)
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


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
