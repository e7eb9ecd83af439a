"""Device memory handed across users: the CUDA driver's virtual memory API, by ctypes.

A legacy CUDA IPC handle (``cudaIpcGetMemHandle``, what torch's ``_share_cuda_`` makes) does not
open in a process of another uid: measured on the H200 (driver 580), the root parent's open of a
dropped candidate worker's handle fails with ``cudaErrorMapBufferObjectFailed``, and so does torch's
expandable-segment IPC. An allocation made by ``cuMemCreate`` with a POSIX file-descriptor handle
type does cross: the worker exports it as a file descriptor, the kernel passes that descriptor over
the Unix socket (``SCM_RIGHTS``), and no uid check applies to it
(``benchmarks/results/2026-12-02-h200-uid-handover-and-compare/ipc.json``).

Worker side: :func:`export` copies tensors into one such allocation and returns an
:class:`Exported` that keeps it mapped until closed. Parent side: :func:`import_copies` imports a
descriptor, maps it, copies each described tensor into memory of its own, then unmaps and releases
it. The other way, :func:`allocate` gives a worker an empty allocation (an inbox) that the parent
fills with :func:`import_writes`: the parent writes into the worker's memory; no handle to the
parent's memory ever reaches a worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE = 1, 1, 1, 3
#: Each tensor starts on this boundary inside the allocation (any dtype's alignment).
ALIGN = 256


class VmmError(RuntimeError):
    """A driver call of the virtual memory API failed."""


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
    "cuMemGetAddressRange_v2": (_P, _P, _U64),
}


@functools.cache
def _driver() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(cu, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return cu


#: CUDA_ERROR_OUT_OF_MEMORY: named in the message, so a failed hand-over reads as what it is (a
#: probe that runs out of memory is the candidate's runtime error, not a hack: kbv.integrity.dynamic).
_OUT_OF_MEMORY = 2


def _check(result: int, what: str) -> None:
    if result == _OUT_OF_MEMORY:
        raise VmmError(f"{what} returned CUresult {result} (out of memory)")
    if result != 0:
        raise VmmError(f"{what} returned CUresult {result}")


def _prop(device: int) -> _Prop:
    prop = _Prop()
    prop.type, prop.requestedHandleTypes = _PINNED, _POSIX_FD
    prop.location = _Location(_ON_DEVICE, device)
    return prop


def granularity(device: int) -> int:
    step = ctypes.c_size_t()
    prop = _prop(device)
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(step), ctypes.byref(prop), 0), "granularity")
    return int(step.value)


def _map(handle: int, size: int, device: int) -> int:
    """Reserve an address range, map the allocation there, make it readable and writable."""
    cu, ptr = _driver(), ctypes.c_uint64()
    _check(
        cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), 0, 0), "reserve"
    )
    result = cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle), 0)
    if result != 0:
        cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
        _check(result, "map")
    access = _Access(_Location(_ON_DEVICE, device), _READ_WRITE)
    result = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
    if result != 0:
        _unmap(ptr.value, size)
        _check(result, "access")
    return int(ptr.value)


def _unmap(ptr: int, size: int) -> None:
    cu = _driver()
    cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    cu.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size))


def address_range(ptr: int) -> tuple[int, int]:
    """The base and size of the device allocation that holds ``ptr`` in this process (one imported
    from another process's IPC handle included), from the driver, not from what a worker claims."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(
        _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
        "address range",
    )
    return int(base.value), int(size.value)


def bytes_at(ptr: int, size: int, device: int) -> torch.Tensor:
    """A uint8 CUDA tensor viewing ``size`` bytes at ``ptr`` (no copy)."""

    class _View:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    return torch.as_tensor(_View(), device=f"cuda:{device}")


def layout(nbytes: list[int], step: int) -> tuple[list[int], int]:
    """Each tensor's byte offset inside one allocation (``ALIGN``-aligned) and the allocation's size
    (a multiple of the driver's granularity ``step``, at least one step)."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, max(step, (end + step - 1) // step * step)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Exported:
    """A worker's allocation holding handed-over tensors, mapped until :meth:`close`; ``fd`` is the
    descriptor to send (the worker's own copy, closed with it)."""

    fd: int
    size: int
    ptr: int
    handle: int
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):  # the candidate may have closed it; the memory still goes
            os.close(self.fd)
        _unmap(self.ptr, self.size)
        _driver().cuMemRelease(ctypes.c_uint64(self.handle))

    def __del__(self) -> None:
        # Interpreter shutdown may have torn the driver binding down already; the process exit
        # releases the allocation then.
        with contextlib.suppress(Exception):
            self.close()


def allocate(size: int, device: int) -> Exported:
    """Worker side: a fresh exportable allocation of at least ``size`` bytes on ``device`` (rounded up
    to the driver's granularity), mapped read-write in this process, with its descriptor."""
    cu = _driver()
    step = granularity(device)
    size = max(step, (size + step - 1) // step * step)
    handle = ctypes.c_uint64()
    prop = _prop(device)
    _check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), 0), "create")
    try:
        ptr = _map(handle.value, size, device)
    except VmmError:
        cu.cuMemRelease(handle)
        raise
    fd = ctypes.c_int(-1)
    result = cu.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle.value), _POSIX_FD, 0)
    if result != 0:
        _unmap(ptr, size)
        cu.cuMemRelease(handle)
        _check(result, "export")
    return Exported(fd=fd.value, size=size, ptr=ptr, handle=handle.value)


def export(tensors: list[torch.Tensor], device: int) -> tuple[Exported, list[int]]:
    """Worker side: the tensors' bytes copied, one after another, into a fresh exportable allocation
    on ``device``; the allocation and each tensor's offset in it. The caller synchronises first."""
    nbytes = [t.numel() * t.element_size() for t in tensors]
    offsets, size = layout(nbytes, 1)
    exported = allocate(size, device)
    try:
        for tensor, offset, n in zip(tensors, offsets, nbytes, strict=True):
            if n:
                bytes_at(exported.ptr + offset, n, device).copy_(_as_bytes(tensor))
        torch.cuda.synchronize(device)
    except BaseException:
        exported.close()
        raise
    return exported, offsets


@contextlib.contextmanager
def imported(fd: int, size: int, device: int) -> Iterator[int]:
    """Parent side: the allocation behind ``fd`` imported and mapped (``size`` bytes: the driver
    refuses a mapping larger than the allocation); yields its address, then unmaps and releases it.
    The descriptor stays the caller's to close."""
    cu, handle = _driver(), ctypes.c_uint64()
    _check(cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD), "import")
    try:
        ptr = _map(handle.value, size, device)
        try:
            yield ptr
            torch.cuda.synchronize(device)  # the copies are complete before the mapping goes
        except BaseException:
            with contextlib.suppress(Exception):  # the copies queued so far end before the unmap
                torch.cuda.synchronize(device)
            raise
        finally:
            _unmap(ptr, size)
    finally:
        cu.cuMemRelease(handle)


def import_copies(
    fd: int, size: int, items: list[tuple[torch.dtype, list[int], int]], device: int
) -> list[Any]:
    """Parent side: each ``(dtype, shape, offset)`` of the allocation behind ``fd`` copied into a new
    tensor the parent owns (:func:`imported`). The caller has checked that every item lies inside
    ``size``."""
    copies = []
    with imported(fd, size, device) as ptr:
        for dtype, shape, offset in items:
            out = torch.empty(shape, dtype=dtype, device=f"cuda:{device}")
            n = out.numel() * out.element_size()
            if n:
                out.reshape(-1).view(torch.uint8).copy_(bytes_at(ptr + offset, n, device))
            copies.append(out)
    return copies


def import_writes(fd: int, size: int, items: list[tuple[torch.Tensor, int]], device: int) -> None:
    """Parent side: each ``(tensor, offset)`` written into the allocation behind ``fd`` (a worker's
    inbox, :func:`allocate`). The caller has checked that every item lies inside ``size``."""
    with imported(fd, size, device) as ptr:
        for tensor, offset in items:
            n = tensor.numel() * tensor.element_size()
            if n:
                bytes_at(ptr + offset, n, device).copy_(_as_bytes(tensor))
