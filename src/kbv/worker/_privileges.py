"""Candidate workers as an unprivileged user of their own, when kbv runs as root.

A candidate running as root can read every process's memory and write every cache. When the parent
is root, a candidate worker is started as a numeric uid that has no passwd entry (chosen from the
source's hash, so evaluations of the same source share it and its build directory, and no other
source does), with no supplementary groups. Its scratch and build directories are handed to that
uid; everything else it needs (the interpreter, torch, kbv, the candidate's file) must
be readable by other users, which a real probe run as that uid checks before the worker starts.

Where a step is impossible (the interpreter lives under a ``/root`` only root may enter, the build
cache is there too, ``KBV_WORKER_USER=off``), :func:`plan` says why and the worker runs as root;
``Worker.isolation`` writes that reason into the record. Not a substitute for one container per
batch: the uid still shares the machine's files that are world-readable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: Candidate uids come from [UID_BASE, UID_BASE + UID_RANGE): below 65534 (nobody), above the
#: usual ranges of system and login users; one with a passwd entry is skipped.
UID_BASE = 61000
UID_RANGE = 4000

_CHECK = (
    "import os, sys\n"
    "bad = [p for p in sys.argv[1:] if not os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0))]\n"
    "print('\\n'.join(bad))\n"
)


@dataclass(frozen=True)
class Plan:
    """How a candidate worker is started: as ``uid`` (None: as the parent), or why not."""

    uid: int | None
    reason: str | None = None


def worker_uid(build_key: str) -> int:
    """The uid of a source's workers: from its hash, skipping uids that belong to a real user."""
    start = int(hashlib.sha256(build_key.encode()).hexdigest()[:8], 16) % UID_RANGE
    for step in range(UID_RANGE):
        uid = UID_BASE + (start + step) % UID_RANGE
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError(
        f"every uid in [{UID_BASE}, {UID_BASE + UID_RANGE}) has a passwd entry; set KBV_WORKER_USER=off"
    )


def needed_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """What a worker reads: the interpreter, the standard library, site-packages, torch, kbv."""
    paths = {os.path.realpath(sys.executable)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        value = sysconfig.get_paths().get(key)
        if value and os.path.isdir(value):
            paths.add(value)
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        paths.add(os.path.dirname(spec.origin))
    paths.add(str(Path(__file__).resolve().parents[1]))  # the kbv package
    paths.update(p for p in extra if p)
    return sorted(paths)


def plan(build_key: str, readable: tuple[str, ...], writable_parents: tuple[str, ...]) -> Plan:
    """Decide how a candidate worker starts here. ``readable``: files it must read (the
    candidate's; the problem reaches it as text); ``writable_parents``: directories that hold what
    it will own (scratch, builds)."""
    if os.environ.get("KBV_WORKER_USER", "auto").lower() in ("off", "0", "no"):
        return Plan(None, "turned off (KBV_WORKER_USER=off)")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return Plan(None, None)  # not root: workers run as the parent's unprivileged user
    uid = worker_uid(build_key)
    blocked = unreachable(uid, [*needed_paths(readable), *writable_parents])
    if blocked:
        return Plan(None, f"{blocked[0]} is not reachable by other users ({_why(blocked[0])})")
    return Plan(uid)


def unreachable(uid: int, paths: list[str]) -> list[str]:
    """Paths ``uid`` cannot read (directories: cannot list and enter), checked by a real process
    running as that uid (ACLs and mount options count), the interpreter first."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHECK, *paths],
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
    except PermissionError:
        return [os.path.realpath(sys.executable)]
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"{sys.executable} ({exc})"]
    if done.returncode != 0:
        return [os.path.realpath(sys.executable)]
    return [line for line in done.stdout.splitlines() if line]


def _why(path: str) -> str:
    """The first directory on the way to ``path`` that others may not enter, for the message."""
    current = Path("/")
    for part in Path(path.split(" (")[0]).parts[1:]:
        current = current / part
        try:
            mode = current.stat().st_mode
        except OSError:
            break
        if current.is_dir() and not mode & 0o001:
            return f"{current} has mode {oct(mode & 0o777)}"
    return "permission denied"


def hand_over(uid: int, *paths: Path) -> None:
    """Give ``uid`` the directories it works in (recursively: a build left by root is reused).

    Symlinks are removed first: a candidate of an earlier evaluation of this source may have left
    one to make root (this parent, or the build lock's clean-up) act on a file elsewhere."""
    for top in paths:
        if top.is_symlink():
            top.unlink()
            top.mkdir(parents=True)
        os.chown(top, uid, uid)
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                entry = os.path.join(root, name)
                try:
                    if os.path.islink(entry):
                        os.unlink(entry)
                    else:
                        os.chown(entry, uid, uid, follow_symlinks=False)
                except FileNotFoundError:
                    continue


def start_command(uid: int, prefix: tuple[str, ...], command: list[str]) -> list[str] | None:
    """The command that starts ``command`` as ``uid`` after ``prefix`` (a namespace, which needs
    root) ran; None when the prefix is empty (``Popen(user=...)`` does it) or no setpriv exists."""
    if not prefix:
        return None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [*prefix, setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]
