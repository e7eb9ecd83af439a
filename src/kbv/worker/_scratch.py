"""Workers' scratch directories: where they are made, and the sweep of those a killed parent left."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kbv.worker import _contain


def scratch_parent() -> str | None:
    """Prefer RAM-backed /dev/shm for the tensors workers hand back."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


OWNER_FILE = ".kbv-owner"
_swept = False


def sweep_orphaned_scratch() -> None:
    """Remove scratch directories left by a parent that was killed (``kill -9`` skips ``close``).

    Each directory names its owner's pid; one whose owner is gone is removed, once per process."""
    global _swept
    if _swept:
        return
    _swept = True
    _contain.sweep_orphaned_cgroups(pid_alive)
    _contain.sweep_orphaned_marked(pid_alive)
    parent = Path(scratch_parent() or tempfile.gettempdir())
    for directory in parent.glob("kbv-*-*"):
        try:
            owner = int((directory / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if owner != os.getpid() and not pid_alive(owner):
            shutil.rmtree(directory, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
