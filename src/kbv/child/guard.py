"""Guards a worker installs on itself at start-up, before any problem or candidate code is imported.

- The worker becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process its children leave
  behind (double fork, ``setsid``) is re-parented to the worker, not to init, so the parent's
  ``/proc`` sweep still finds it below the worker.
- A watchdog thread polls ``getppid()``: when the kbv process that started this worker dies
  (``kill -9`` skips every clean-up), the worker kills its own descendants and exits at once.
  ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that spawned the worker exits, and
  workers may be started from short-lived threads.

A hostile candidate runs in this process and could undo both; the parent's cgroup and its sweep of
marked processes (``kbv.worker._contain``) do not depend on them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_PR_SET_CHILD_SUBREAPER = 36
#: Seconds between two looks at the parent pid.
PARENT_POLL_S = 0.1


def install() -> None:
    _become_subreaper()
    parent = os.getppid()
    thread = threading.Thread(target=_watch_parent, args=(parent,), name="kbv-parent-watch", daemon=True)
    thread.start()


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    getppid, sleep = os.getppid, time.sleep  # bound now: the candidate may patch the os module later
    while getppid() == parent:
        sleep(PARENT_POLL_S)
    _kill_descendants()
    os._exit(70)


def _kill_descendants() -> None:
    from kbv import processes as _contain

    me = os.getpid()
    for _ in range(5):  # a process forking while being killed leaves a child behind for the next round
        pids = _contain.descendants(me, _contain.process_table())
        if not pids:
            return
        _contain.kill_pids(pids)
        time.sleep(0.01)
