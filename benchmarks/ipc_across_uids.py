"""Can the trusted parent (root) open GPU memory that a worker under another uid hands it?

Issue 13 asks that a root parent's candidate workers drop to an unprivileged uid, and that the
output hand-over by CUDA IPC keep working across that uid. On the H200 (torch 2.11, driver 580) the
parent could not open a dropped worker's legacy CUDA IPC handle (``cudaErrorMapBufferObjectFailed``),
so on a GPU the candidate keeps the parent's uid (``kbv.worker.Worker._containment``). This script
tries each way a worker could hand over device memory, each in a fresh worker process, and writes
what happened:

- ``legacy``: ``cudaIpcGetMemHandle`` through torch's ``_share_cuda_`` (what ``kbv.handoff`` does);
- ``expandable``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in both
  processes (torch then exports the segment as a file descriptor and the receiver takes it with
  ``pidfd_getfd``, which needs ptrace rights over the worker);
- ``vmm_fd``: the worker copies the tensor into memory of its own from the driver's virtual memory
  API (``cuMemCreate`` with a POSIX file-descriptor handle) and sends that descriptor over a Unix
  socket (``SCM_RIGHTS``); the parent imports, maps, copies and unmaps it. The kernel passes the
  descriptor, so no uid check applies, and nothing flows from the parent to the worker.

Each is tried with the worker under the parent's uid (the control) and under an unprivileged uid,
dumpable and not (kbv's workers make themselves non-dumpable, which closes their ``/proc`` files
and ptrace to other users).

    python benchmarks/ipc_across_uids.py --out $OUT/ipc.json [--mib 1024]

Must run as root on a GPU machine (it starts workers under uid 64123); prints one line per try.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WORKER_UID = 64123
TRY_TIMEOUT_S = 40.0

# --- the driver's virtual memory API: kbv._vmm, what kbv's hand-over uses (both sides) -----------


def vmm_export(tensor: Any) -> tuple[Any, int]:
    """Worker side: the tensor's bytes copied into a fresh exportable allocation, which stays mapped
    while the returned object lives; that object (its ``fd`` is the descriptor) and its size."""
    from kbv import _vmm

    exported, _ = _vmm.export([tensor], tensor.device.index or 0)
    return exported, exported.size


def vmm_import(fd: int, size: int, nbytes: int) -> Any:
    """Parent side: the worker's allocation imported, mapped, copied into the parent's own memory,
    unmapped and released; the descriptor closed."""
    import torch

    from kbv import _vmm

    try:
        return _vmm.import_copies(fd, size, [(torch.uint8, [nbytes], 0)], torch.cuda.current_device())[0]
    finally:
        os.close(fd)


# --- the worker ----------------------------------------------------------------------------------


def _worker(mode: str, nbytes: int, sock_fd: int, dumpable: bool) -> None:
    import torch

    if not dumpable:  # as kbv's workers make themselves (kbv.processes.harden_process)
        zero = ctypes.c_ulong(0)
        ctypes.CDLL(None).prctl(4, zero, zero, zero, zero)  # PR_SET_DUMPABLE = 4

    x = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    reply: dict[str, Any] = {"uid": os.getuid(), "dumpable": dumpable}
    if mode in ("legacy", "expandable"):
        shared = x.untyped_storage()._share_cuda_()
        reply["share"] = [
            {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for v in shared
        ]
    else:
        exported, size = vmm_export(x)  # alive (mapped) until this function returns
        socket.send_fds(socket.socket(fileno=sock_fd), [b"fd"], [exported.fd])
        reply["size"] = size
    print(json.dumps(reply), flush=True)
    sys.stdin.readline()  # keep the memory alive until the parent has copied it


# --- the parent ----------------------------------------------------------------------------------


def _open_share(reply: dict[str, Any]) -> Any:
    import torch

    values = [base64.b64decode(v["b64"]) if isinstance(v, dict) else v for v in reply["share"]]
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = values
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle or b"", event_sync
    )
    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (size,), (1,))
    return view.clone()


def _start_worker(
    args: list[str], worker_end: socket.socket, uid: int | None, env: dict[str, str], script: Path
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), "--worker", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        pass_fds=(worker_end.fileno(),),
        user=uid,
        group=uid,
        extra_groups=[] if uid is not None else None,
    )


def _try(mode: str, uid: int | None, dumpable: bool, nbytes: int, home: Path) -> dict[str, Any]:
    import torch

    env = {**os.environ, "HOME": str(home)}
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    parent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    script = home / Path(__file__).name
    started = time.monotonic()
    result: dict[str, Any] = {
        "mode": mode,
        "worker_uid": uid if uid is not None else os.getuid(),
        "worker_dumpable": dumpable,
    }
    args = [mode, str(nbytes), str(worker_end.fileno()), "dumpable" if dumpable else "hardened"]
    try:
        proc = _start_worker(args, worker_end, uid, env, script)
    except OSError as exc:  # e.g. the interpreter is not readable by that uid
        parent_end.close()
        return {**result, "ok": False, "error": f"the worker could not start: {exc}"}
    finally:
        worker_end.close()
    watchdog = threading.Timer(TRY_TIMEOUT_S, proc.kill)  # a worker that hangs is a finding too
    watchdog.start()
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise RuntimeError(
                "the worker answered nothing: " + (proc.stderr.read() if proc.stderr else "")[-800:]
            )
        reply = json.loads(line)
        opened = time.monotonic()
        if mode == "vmm_fd":
            _, fds, _, _ = socket.recv_fds(parent_end, 16, 1)
            copy = vmm_import(fds[0], int(reply["size"]), nbytes)
        else:
            copy = _open_share(reply)
        expected = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda")
        same = bool(torch.equal(copy[:nbytes].view(torch.float32), expected))
        result.update(ok=same, open_copy_s=round(time.monotonic() - opened, 4), reported_uid=reply["uid"])
    except Exception as exc:  # what failed is the finding
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1200])
    finally:
        watchdog.cancel()
        with contextlib.suppress(OSError):  # the worker may have died
            if proc.stdin:
                proc.stdin.write("done\n")
                proc.stdin.flush()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        parent_end.close()
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def _machine() -> dict[str, Any]:
    import torch

    status = Path("/proc/self/status").read_text()
    cap_eff = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff")), 16)
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "euid": os.geteuid(),
        "cap_sys_ptrace": bool(cap_eff >> 19 & 1),
        "ptrace_scope": scope.read_text().strip() if scope.exists() else None,
        "dev_nvidia_modes": {
            p.name: oct(p.stat().st_mode & 0o777) for p in sorted(Path("/dev").glob("nvidia*"))
        },
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "dumpable")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script starts workers under another uid")
    import torch

    torch.zeros(1, device="cuda")  # the parent's context, as kbv's parent has one
    home = Path("/tmp/kbv-ipc-across-uids")
    home.mkdir(mode=0o755, exist_ok=True)
    os.chmod(home, 0o1777)
    shutil.copy(__file__, home / Path(__file__).name)
    os.chmod(home / Path(__file__).name, 0o644)
    results: dict[str, Any] = {"machine": _machine(), "mib": args.mib, "tries": []}
    print(json.dumps(results["machine"]), flush=True)
    for mode in ("legacy", "vmm_fd", "expandable"):
        for uid, dumpable in ((None, False), (WORKER_UID, True), (WORKER_UID, False)):
            row = _try(mode, uid, dumpable, args.mib << 20, home)
            results["tries"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
