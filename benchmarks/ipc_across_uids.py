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

# --- the driver's virtual memory API, by ctypes (both sides) -------------------------------------

_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE = 1, 1, 1, 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_P, _U64, _SIZE, _INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
#: Every argument typed: an untyped 0 passed for an ``unsigned long long`` leaves the register's
#: upper half undefined.
_SIGNATURES = {
    "cuMemGetAllocationGranularity": (_P, _P, _INT),
    "cuMemCreate": (_P, _SIZE, _P, _U64),
    "cuMemAddressReserve": (_P, _SIZE, _SIZE, _U64, _U64),
    "cuMemMap": (_U64, _SIZE, _SIZE, _U64, _U64),
    "cuMemSetAccess": (_U64, _SIZE, _P, _SIZE),
    "cuMemExportToShareableHandle": (_P, _U64, _INT, _U64),
    "cuMemImportFromShareableHandle": (_P, _P, _INT),
    "cuMemUnmap": (_U64, _SIZE),
    "cuMemAddressFree": (_U64, _SIZE),
    "cuMemRelease": (_U64,),
}


def _driver() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(cu, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return cu


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} returned CUresult {result}")


def _prop(device: int) -> _Prop:
    prop = _Prop()
    prop.type, prop.requestedHandleTypes = _PINNED, _POSIX_FD
    prop.location = _Location(_ON_DEVICE, device)
    return prop


def _map(cu: ctypes.CDLL, handle: int, size: int, device: int) -> int:
    """Reserve an address range, map the allocation there, make it readable and writable."""
    ptr = ctypes.c_uint64()
    _check(
        cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), 0, 0), "reserve"
    )
    _check(cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle), 0), "map")
    access = _Access(_Location(_ON_DEVICE, device), _READ_WRITE)
    _check(cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)), "access")
    return ptr.value


def _unmap(cu: ctypes.CDLL, ptr: int, size: int, handle: int) -> None:
    _check(cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "unmap")
    _check(cu.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "address free")
    _check(cu.cuMemRelease(ctypes.c_uint64(handle)), "release")


def _bytes_at(ptr: int, size: int) -> Any:
    """A uint8 CUDA tensor viewing ``size`` bytes at ``ptr`` (no copy)."""
    import torch

    class _View:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    return torch.as_tensor(_View(), device="cuda")


def _rounded(size: int, cu: ctypes.CDLL, device: int) -> int:
    granularity = ctypes.c_size_t()
    prop = _prop(device)
    _check(cu.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0), "granularity")
    step = granularity.value
    return (size + step - 1) // step * step


def vmm_export(tensor: Any) -> tuple[int, int]:
    """Worker side: the tensor's bytes copied into a fresh exportable allocation, which stays mapped
    until the worker exits; its descriptor and the allocation's size."""
    import torch

    cu, device = _driver(), tensor.device.index or 0
    size = _rounded(tensor.numel() * tensor.element_size(), cu, device)
    handle = ctypes.c_uint64()
    prop = _prop(device)
    _check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), 0), "create")
    ptr = _map(cu, handle.value, size, device)
    _bytes_at(ptr, tensor.numel() * tensor.element_size()).copy_(
        tensor.contiguous().view(torch.uint8).flatten()
    )
    torch.cuda.synchronize()
    fd = ctypes.c_int(-1)
    _check(
        cu.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle.value), _POSIX_FD, 0),
        "export",
    )
    return fd.value, size


def vmm_import(fd: int, size: int, nbytes: int) -> Any:
    """Parent side: the worker's allocation imported, mapped, copied into the parent's own memory,
    unmapped and released; the descriptor closed."""
    import torch

    cu, device = _driver(), torch.cuda.current_device()
    handle = ctypes.c_uint64()
    try:
        _check(
            cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD), "import"
        )
    finally:
        os.close(fd)
    ptr = _map(cu, handle.value, size, device)
    copy = _bytes_at(ptr, nbytes).clone()
    torch.cuda.synchronize()
    _unmap(cu, ptr, size, handle.value)
    return copy


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
        fd, size = vmm_export(x)
        socket.send_fds(socket.socket(fileno=sock_fd), [b"fd"], [fd])
        os.close(fd)
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
