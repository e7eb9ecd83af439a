"""Kernel confinement a candidate's process applies to itself before any candidate code runs.

Two layers, both enforced by the kernel on this process and everything it starts afterwards, root
included, whatever uid the worker runs as:

- **Landlock** (Linux 5.13+): write-type file accesses (write, truncate, create, remove, rename,
  link, make devices, fifos, sockets, symlinks) are allowed only beneath the directories the parent
  names (the worker's scratch, which holds its HOME and TMPDIR, and its source's build directory),
  on its own threads' ``/proc`` files (their names) and on the device files a worker needs
  (``/dev/null`` and friends; on a GPU ``/dev/nvidia*`` and ``/dev/shm``, where CUDA and torch
  keep their IPC files). Reads are not restricted. Since ABI 6
  (Linux 6.12) its scopes keep signals and abstract unix sockets inside the candidate's own
  domain: it cannot stop, kill or connect to the reference worker, the fork server, the parent or
  another candidate, only to processes it started. Landlock also refuses ptrace, and every access
  that needs ptrace rights (``/proc/<pid>/mem``, ``process_vm_readv``, ``pidfd_getfd``), to any
  process outside that domain.
- **seccomp** (a filter on every thread, ``SECCOMP_FILTER_FLAG_TSYNC``): ``ptrace``,
  ``process_vm_readv``/``process_vm_writev``, ``pidfd_getfd``, ``kcmp``, ``process_madvise``,
  ``open_by_handle_at`` (which opens a file by handle, past any path rule), ``bpf`` and module or
  kexec loading fail with ``EPERM``, whatever Landlock does; so do the x32 ABI and foreign
  architectures' system calls, which would otherwise go around the filter.

Why ctypes over the raw system calls: no maintained Python binding of Landlock is on PyPI, and
libseccomp's Python binding is not packaged there either; the two calls and a twenty-instruction
filter are small enough to own. Everything here is standard library, so the worker runs it before
``import torch`` where it can.

Where a layer cannot be applied (an older kernel, Landlock not among the active security modules,
an ABI without signal scoping, another architecture), :func:`apply` says so; the worker reports it
in its greeting and the record's ``isolation.not_enforced`` names it.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import platform
import struct
from typing import Any

from kbv.processes import CONFINE_GPU_ENV as GPU_ENV  # "1": CUDA's device files, /dev/shm writable
from kbv.processes import CONFINE_WRITE_ENV as WRITE_ENV  # the directories it may write beneath

_SYS = {  # landlock_create_ruleset, landlock_add_rule, landlock_restrict_self, seccomp
    "x86_64": (444, 445, 446, 317),
    "aarch64": (444, 445, 446, 277),
}
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Landlock's filesystem rights (include/uapi/linux/landlock.h) and the ABI that brought each.
_WRITE_FILE = 1 << 1
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
_MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_REFER = 1 << 13  # ABI 2: rename and link across directories
_TRUNCATE = 1 << 14  # ABI 3
_WRITES_ABI1 = (
    _WRITE_FILE
    | _REMOVE_DIR
    | _REMOVE_FILE
    | _MAKE_CHAR
    | _MAKE_DIR
    | _MAKE_REG
    | _MAKE_SOCK
    | _MAKE_FIFO
    | _MAKE_BLOCK
    | _MAKE_SYM
)
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
#: The Landlock ABI that scopes signals and abstract unix sockets (Linux 6.12).
SCOPE_ABI = 6

#: Device files every worker may write: output to nowhere, and entropy it may add.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: ... and on a GPU: CUDA's device files, and /dev/shm (torch's CUDA IPC reference counters, the
#: driver's own shared files).
_GPU_PATHS = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/shm")

# seccomp: denied system calls per architecture, and the filter's constants.
_DENIED = {
    "x86_64": {
        "ptrace": 101,
        "init_module": 175,
        "delete_module": 176,
        "kexec_load": 246,
        "open_by_handle_at": 304,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "pidfd_getfd": 438,
        "process_madvise": 440,
    },
    "aarch64": {
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "ptrace": 117,
        "open_by_handle_at": 265,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "finit_module": 273,
        "bpf": 280,
        "kexec_file_load": 294,
        "pidfd_getfd": 438,
        "process_madvise": 440,
    },
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_ABS_W, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # struct landlock_path_beneath_attr is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


_applied: dict[str, Any] | None = None


def from_environment() -> dict[str, Any] | None:
    """Apply what the parent asked for in this process's environment (:data:`WRITE_ENV`), once;
    the same answer on later calls. None where nothing was asked (a trusted worker)."""
    global _applied
    if _applied is not None:
        return _applied
    value = os.environ.get(WRITE_ENV)
    if value is None:
        return None
    writable = [p for p in value.split(os.pathsep) if p]
    _applied = apply(writable, gpu=os.environ.get(GPU_ENV) == "1")
    return _applied


def apply(writable: list[str], gpu: bool = False) -> dict[str, Any]:
    """Confine this process (and what it starts later): Landlock, then seccomp. Returns what was
    enforced, ``{"landlock": str | None, "seccomp": str | None, "not_enforced": [str, ...]}``."""
    facts: dict[str, Any] = {"landlock": None, "seccomp": None, "not_enforced": []}
    machine = platform.machine()
    if machine not in _SYS:
        facts["not_enforced"].append(f"Landlock and seccomp: kbv knows no system call numbers for {machine}")
        return facts
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # both layers need it without CAP_SYS_ADMIN
        facts["not_enforced"].append(f"Landlock and seccomp: no_new_privs refused ({_errno_text()})")
        return facts
    try:
        facts["landlock"] = _landlock(libc, _SYS[machine], writable, gpu, facts["not_enforced"])
    except OSError as exc:
        facts["not_enforced"].append(f"Landlock: {exc}")
    try:
        facts["seccomp"] = _seccomp(libc, machine)
    except OSError as exc:
        facts["not_enforced"].append(f"seccomp: {exc}")
    return facts


def landlock_abi() -> int | None:
    """The kernel's Landlock ABI version, or None where Landlock is missing or off."""
    machine = platform.machine()
    if machine not in _SYS:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(_SYS[machine][0], None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION)
    return int(version) if version > 0 else None


def _landlock(libc: Any, numbers: tuple[int, ...], writable: list[str], gpu: bool, missing: list[str]) -> str:
    create, add_rule, restrict = numbers[:3]
    abi = libc.syscall(create, None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION)
    if abi <= 0:
        raise OSError(ctypes.get_errno(), f"not available on this kernel ({_errno_text()})")
    writes = _WRITES_ABI1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    scoped = _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET if abi >= SCOPE_ABI else 0
    # struct landlock_ruleset_attr grew a field per ABI: handled_access_fs, _net (4), scoped (6).
    attr = struct.pack("=QQQ", writes, 0, scoped)
    size = 24 if abi >= SCOPE_ABI else 16 if abi >= 4 else 8
    ruleset = libc.syscall(create, attr, ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset failed ({_errno_text()})")
    try:
        allowed = _allow(libc, add_rule, ruleset, writable, writes, gpu)
        if libc.syscall(restrict, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self failed ({_errno_text()})")
    finally:
        os.close(ruleset)
    if not scoped:
        missing.append(
            f"Landlock ABI {abi} does not scope signals (ABI {SCOPE_ABI}, Linux 6.12): the candidate "
            "can signal kbv's other processes (signalled_process still sees a stop)"
        )
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # Landlock binds the calling thread and what it starts, not threads already there
        missing.append(f"Landlock: {threads - 1} thread(s) started before it are not confined")
    what = "signals and abstract unix sockets scoped to its own processes; " if scoped else ""
    return f"ABI {abi}: {what}writes only beneath {', '.join(allowed)}"


def _allow(libc: Any, add_rule: int, ruleset: int, writable: list[str], writes: int, gpu: bool) -> list[str]:
    """Add a rule per writable directory (every write right) and per device (write and truncate
    only: a file takes no directory rights). Paths that do not exist are skipped."""
    file_rights = _WRITE_FILE | (writes & _TRUNCATE)
    targets = [(p, writes) for p in writable]
    targets += [(p, file_rights) for p in _DEVICES]
    # Its own threads' files (``comm``): the CUDA driver names the threads it starts with
    # pthread_setname_np, which writes /proc/self/task/<tid>/comm; refused, cuInit fails with error
    # 304 (measured on an H100, 2026-12-06: benchmarks/results/2026-12-06-h100-gpu-tests/).
    targets.append((f"/proc/{os.getpid()}/task", file_rights))
    if gpu:
        found = [p for pattern in _GPU_PATHS for p in glob.glob(pattern)]
        targets += [(p, writes if os.path.isdir(p) else file_rights) for p in found]
    allowed = []
    for path, rights in targets:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not os.path.isdir(path):
                rights &= file_rights
            rule = _PathBeneath(rights, fd)
            if libc.syscall(add_rule, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed ({_errno_text()})")
            allowed.append(path)
        finally:
            os.close(fd)
    return allowed


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: a foreign architecture's call, an x32 call or a
    denied call returns EPERM; every other call is allowed."""
    denied = sorted(_DENIED[machine].values())
    deny_at = 3 + len(denied) + 1 + (1 if machine == "x86_64" else 0)  # index of the EPERM return

    def to_deny(index: int) -> int:
        return deny_at - index - 1

    program = [(_LD_ABS_W, 0, 0, 4)]  # seccomp_data.arch
    program.append((_JEQ_K, 0, to_deny(1), _AUDIT_ARCH[machine]))
    program.append((_LD_ABS_W, 0, 0, 0))  # seccomp_data.nr
    if machine == "x86_64":
        program.append((_JGE_K, to_deny(len(program)), 0, _X32_SYSCALL_BIT))
    for number in denied:
        program.append((_JEQ_K, to_deny(len(program)), 0, number))
    program.append((_RET_K, 0, 0, _RET_ALLOW))
    program.append((_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    assert len(program) == deny_at + 1
    return program


def _seccomp(libc: Any, machine: str) -> str:
    program = seccomp_program(machine)
    filters = (_Filter * len(program))(*(_Filter(*instruction) for instruction in program))
    prog = _Program(len(program), filters)
    number = _SYS[machine][3]
    if libc.syscall(number, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), f"the filter was refused ({_errno_text()})")
    return "on every thread: " + ", ".join(sorted(_DENIED[machine])) + " fail with EPERM"


def _errno_text() -> str:
    code = ctypes.get_errno()
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
