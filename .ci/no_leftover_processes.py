"""CI's last step: fail when a process that a kbv worker started is still alive after the tests.

Standalone (stdlib only), so it does not trust the code it checks. A process counts as a worker's
when its environment carries kbv's worker marker (``KBV_WORKER_TAG``, inherited by every child),
or its command line or working directory lies in a worker's scratch directory (``kbv-candidate-*``,
which catches children that cleared their environment). Workers notice a dead parent within 0.1 s,
so the scan waits a few seconds for stragglers before it fails.
"""

from __future__ import annotations

import os
import sys
import time

MARKER = b"KBV_WORKER_TAG="
SCRATCH = "kbv-candidate-"
GRACE_S = 5.0


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _state(pid: str) -> str:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"


def leftovers() -> list[str]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        if int(pid) == os.getpid() or _state(pid) in ("Z", "X", "?"):
            continue
        environ = _read(f"/proc/{pid}/environ").split(b"\0")
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        marker = next((e.decode(errors="replace") for e in environ if e.startswith(MARKER)), "")
        if marker or SCRATCH in cmdline or SCRATCH in cwd:
            found.append(f"pid {pid}: {cmdline[:200]} ({marker or 'cwd ' + cwd})")
    return found


def main() -> int:
    deadline = time.monotonic() + GRACE_S
    alive = leftovers()
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = leftovers()
    if alive:
        print(f"{len(alive)} process(es) started by kbv workers outlived the tests:", file=sys.stderr)
        for line in alive:
            print("  " + line, file=sys.stderr)
        return 1
    return 0  # silent on success: the test runner's summary stays the run's last line


if __name__ == "__main__":
    sys.exit(main())
