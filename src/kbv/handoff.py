"""Handing tensors from a worker to the trusted parent without a host round trip.

On a GPU a worker shares each tensor it hands over as a CUDA IPC handle: the handle's bytes travel
as base64 inside the JSON reply, never as a pickle, and the parent opens the handle, copies the
tensor into memory it owns and closes the handle before anything judges it (:func:`receive`).
A candidate worker under a uid of its own (``kbv.worker._privileges``) cannot be opened that way:
it copies its outputs into one allocation of the driver's virtual memory API and sends that
allocation's file descriptor beside the reply (``kbv._vmm``, transport ``cuda_vmm``).
A trusted worker on the CPU (the reference) writes their raw bytes into an anonymous memory file
(``memfd_create``, transport ``memfd``) whose descriptor travels beside the reply, described by
dtype, shape and offset: it has no path, so a candidate running beside it cannot open it
(``/proc/<pid>/fd`` of a hardened process needs ptrace rights, which Landlock, seccomp and the uid
drop take away). Elsewhere (a candidate on the CPU, a GPU worker's non-CUDA values) tensors go
through one file in the worker's scratch directory, read with ``torch.load(weights_only=True)``
and deleted at once.

Child side: :func:`hand_over` (bound before the candidate is imported). Parent side: :func:`receive`.
Neither side ever sends a handle *to* a worker: handles only flow from workers to the parent, so a
candidate never holds a handle to trusted memory. Where the parent gives a CUDA worker many bytes
(a model's redrawn parameters), the worker opens an empty inbox of its own (:func:`open_inbox`) and
the parent writes into it (:func:`fill_inbox`) (``docs/architecture.md``, "Outputs stay on the
device").
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import re
import uuid
from typing import Any, TypeGuard

import torch

#: dtypes a worker may hand over (anything else is the worker's error).
_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
#: What a torch IPC reference-counter name looks like (a POSIX shared-memory object of torch's).
_REFCOUNT_NAME = re.compile(rb"^/torch_[A-Za-z0-9_]{1,200}$")

# Bound at import, before any candidate code runs in a worker.
_clone = torch.Tensor.clone
_save = torch.save
_synchronize = torch.cuda.synchronize


class HandoffError(ValueError):
    """A worker's hand-over cannot be read (malformed descriptor, bad handle, unreadable file)."""


# ------------------------------------------------------------------------------------------------
# child side


def plain_copy(value: Any, device: torch.device, *, copy: bool = True) -> Any:
    """A plain ``torch.Tensor`` copy of an output on the worker's device (subclasses stripped), or a
    tensor of a Python number, or None. Taken right after the call returned and synchronised, so
    what is handed over is the output as the call left it. ``copy=False`` (trusted workers only:
    the parent copies what it is handed anyway) hands a contiguous output over as it is."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if type(tensor) is not torch.Tensor:
            tensor = tensor.as_subclass(torch.Tensor)
        if tensor.device != device:
            tensor = tensor.to(device)
        if not copy and tensor.is_contiguous():
            return tensor
        return _clone(tensor, memory_format=torch.contiguous_format)
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value, device=device)
    return None


#: How a worker hands tensors over (the parent says, ``Worker.handoff``): on a GPU legacy IPC handles
#: or one exported VMM allocation; on the CPU a memory file (the trusted reference) or a file.
TRANSPORTS = ("cuda_ipc", "cuda_vmm", "memfd", "file")


def hand_over_copies(device: torch.device, transport: str) -> bool:
    """Whether :func:`hand_over` copies the tensors itself (exported device memory, a candidate on
    a GPU): a copy made before it would be a second one."""
    return device.type == "cuda" and transport == "cuda_vmm"


class MemoryFile:
    """A hand-over written into an anonymous memory file, kept open until the parent's next request;
    its descriptor is sent beside the reply (:func:`fds_to_send`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def hand_over(
    values: list[Any], device: torch.device, path: str, keep: list[Any], transport: str = "cuda_ipc"
) -> dict[str, Any]:
    """Describe ``values`` (plain copies from :func:`plain_copy`, or None) for the parent.

    CUDA tensors become IPC descriptors, or (``transport="cuda_vmm"``) one exported allocation whose
    descriptor :func:`fds_to_send` lists for the reply; ``keep`` holds what is shared alive until the
    parent has copied it (the worker calls :func:`release` at its next request). Everything else
    goes to one anonymous memory file (``transport="memfd"``, a trusted worker on the CPU) or to one
    file at ``path``.
    """
    if device.type == "cuda" and all(
        v is None or (isinstance(v, torch.Tensor) and v.is_cuda) for v in values
    ):
        _synchronize()
        if transport == "cuda_vmm":
            return _export_vmm(values, device, keep)
        keep.extend(v for v in values if v is not None)
        return {"transport": "cuda_ipc", "items": [None if v is None else _describe_cuda(v) for v in values]}
    plain = [v if v is None else v.cpu() for v in values]
    if transport == "memfd":
        return _to_memory_file(plain, keep)
    _save(plain, path)
    return {"transport": "file", "path": path, "count": len(values)}


#: Every tensor in a memory file starts at a multiple of this (the largest element size, complex128).
_MEMORY_FILE_ALIGN = 16


def _to_memory_file(values: list[Any], keep: list[Any]) -> dict[str, Any]:
    """Each tensor's bytes one after another in a fresh memory file, described by dtype, shape and
    offset (a 0.5-0.7 ms ``torch.save`` and ``torch.load`` of a few small tensors cost more than
    the forward of the CPU sample's problems)."""
    name = f"kbv-handover-{uuid.uuid4().hex[:16]}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    keep.append(MemoryFile(fd))
    items: list[dict[str, Any] | None] = []
    offset = 0
    with open(fd, "wb", closefd=False) as out:
        for value in values:
            if value is None:
                items.append(None)
                continue
            padding = -offset % _MEMORY_FILE_ALIGN  # each tensor's bytes where its dtype may view them
            out.write(bytes(padding))
            offset += padding
            flat = value.contiguous().reshape(-1).view(torch.uint8)
            out.write(memoryview(flat.numpy()))
            items.append({"dtype": str(value.dtype), "shape": list(value.shape), "offset_bytes": offset})
            offset += flat.numel()
    index = len(fds_to_send(keep)) - 1
    return {"transport": "memfd", "fd_index": index, "name": name, "size": offset, "items": items}


def _export_vmm(values: list[Any], device: torch.device, keep: list[Any]) -> dict[str, Any]:
    from kbv import _vmm

    tensors = [v for v in values if v is not None]
    description: dict[str, Any] = {"transport": "cuda_vmm", "fd_index": None, "size": 0}
    offsets: list[int] = []
    if tensors:
        exported, offsets = _vmm.export(tensors, device.index if device.index is not None else 0)
        description.update(fd_index=len(fds_to_send(keep)), size=exported.size)
        keep.append(exported)
    placed = iter(zip(tensors, offsets, strict=True))
    items: list[dict[str, Any] | None] = []
    for value in values:
        if value is None:
            items.append(None)
            continue
        tensor, offset = next(placed)
        items.append({"dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset_bytes": offset})
    description["items"] = items
    return description


def fds_to_send(keep: list[Any]) -> list[int]:
    """The descriptors of the allocations exported (or memory files written) for this reply, in
    ``fd_index`` order."""
    from kbv import _vmm

    return [k.fd for k in keep if isinstance(k, (_vmm.Exported, MemoryFile))]


def release(keep: list[Any]) -> None:
    """The worker's side of a finished hand-over: exported allocations unmapped, memory files
    closed, shared tensors let go."""
    from kbv import _vmm

    for kept in keep:
        if isinstance(kept, (_vmm.Exported, MemoryFile)):
            with contextlib.suppress(Exception):  # one the candidate broke must not keep the rest
                kept.close()
    keep.clear()


def open_inbox(nbytes: int, device: torch.device, transport: str, keep: list[Any]) -> dict[str, Any]:
    """An empty allocation of at least ``nbytes`` in this worker, for the parent to fill
    (:func:`fill_inbox`), and its description for the reply. ``keep`` holds it until
    :func:`inbox_tensors` has read it; a ``cuda_vmm`` inbox's descriptor is listed by
    :func:`fds_to_send`. The parent writes into the worker's memory; nothing of the parent's is shared."""
    if device.type != "cuda":
        raise ValueError("an inbox is for CUDA workers only (a CPU worker is given a file)")
    index = device.index if device.index is not None else 0
    if transport == "cuda_vmm":
        from kbv import _vmm

        exported = _vmm.allocate(max(int(nbytes), 1), index)
        keep.append(exported)
        return {"transport": "cuda_vmm", "fd_index": len(fds_to_send(keep)) - 1, "size": exported.size}
    buffer = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
    keep.append(buffer)
    return {"transport": "cuda_ipc", "items": [_describe_cuda(buffer)]}


def inbox_tensors(
    keep: list[Any], items: list[dict[str, Any]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Views of what the parent wrote into this worker's inbox, by name (``items``: name, dtype,
    shape, offset_bytes, as :func:`inbox_layout` made them). Valid until :func:`release`."""
    from kbv import _vmm

    if len(keep) != 1:
        raise ValueError("no inbox was opened for this request")
    inbox = keep[0]
    index = device.index if device.index is not None else 0
    whole = _vmm.bytes_at(inbox.ptr, inbox.size, index) if isinstance(inbox, _vmm.Exported) else inbox
    views: dict[str, torch.Tensor] = {}
    for item in items:
        dtype, shape, offset = (
            _DTYPES[str(item["dtype"])],
            [int(n) for n in item["shape"]],
            int(item["offset_bytes"]),
        )
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        views[str(item["name"])] = whole[offset : offset + nbytes].view(dtype).reshape(shape)
    return views


def _describe_cuda(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.numel() == 0:  # nothing to share (an empty storage has no handle)
        return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "empty": True}
    storage = tensor.untyped_storage()
    (device, handle, size, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return {
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "offset": int(tensor.storage_offset()),
        "storage": {
            "device": int(device),
            "handle": _b64(handle),
            "size": int(size),
            "offset_bytes": int(offset_bytes),
            "ref_handle": _b64(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": _b64(event_handle) if event_handle else None,
            "event_sync": bool(event_sync),
        },
    }


def _b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


# ------------------------------------------------------------------------------------------------
# parent side


def receive(
    description: Any, device: str, fds: list[int] | None = None, *, bounded: bool = False
) -> list[Any]:
    """The parent's own copies of the tensors a worker handed over (on ``device``); None stays None.

    Every descriptor is checked before use; a CUDA handle (or the exported allocation behind one of
    ``fds``, the descriptors that came with the reply) is opened, the tensor copied into memory the
    parent owns, and the handle closed before this returns, so nothing the worker does later can
    change what is judged. Raises :class:`HandoffError` for anything malformed, and torch's
    ``OutOfMemoryError`` as it is where the parent has no room for its copies: torch's error is a
    ``RuntimeError``, and wrapped with the rest it made the parent's own shortage a candidate's
    ``runtime_error`` (KernelBench's 63_conv_standard_2D, honest, in its cache probe on an H100,
    2026-12-07). Whose failure that is, the caller decides (:func:`claimed_elements`).
    """
    if not isinstance(description, dict):
        raise HandoffError("the worker's outputs are not described")
    transport = description.get("transport")
    if transport == "file":
        return _from_file(description, device)
    if transport == "memfd":
        return _from_memory_file(description, fds or [], device)
    if transport == "cuda_ipc":
        items = description.get("items")
        if not isinstance(items, list):
            raise HandoffError("the worker's CUDA hand-over has no item list")
        if not device.startswith("cuda"):
            raise HandoffError("a CUDA hand-over for a CPU evaluation")
        copies = [
            None if item is None else _from_cuda(item, _device_index(device), bounded) for item in items
        ]
        torch.cuda.synchronize(_device_index(device))  # the copies are complete before the handles close
        return copies
    if transport == "cuda_vmm":
        if not device.startswith("cuda"):
            raise HandoffError("a CUDA hand-over for a CPU evaluation")
        return _from_vmm(description, fds or [], _device_index(device))
    raise HandoffError(f"unknown hand-over transport {transport!r}")


def claimed_elements(description: Any) -> int:
    """The elements a hand-over's description says it holds, summed over its items (0 for what is
    malformed: :func:`receive` refuses that anyway). Read before copying, so that the parent
    running out of room for a candidate's hand-over can tell an honest one from one that claims
    more than the outputs asked for."""
    items = description.get("items") if isinstance(description, dict) else None
    total = 0
    for item in items if isinstance(items, list) else []:
        shape = _ints(item.get("shape")) if isinstance(item, dict) else None
        if shape is not None:
            total += math.prod(shape)
    return total


def _from_file(description: dict[str, Any], device: str) -> list[Any]:
    path = description.get("path")
    if not isinstance(path, str):
        raise HandoffError("the worker's hand-over names no file")
    try:
        loaded = torch.load(path, map_location=device, weights_only=True)
    except torch.OutOfMemoryError:
        raise  # the parent's own room: never the worker's failure (see receive)
    except Exception as exc:  # written by a hostile or broken worker
        raise HandoffError(f"the worker's outputs could not be read ({exc})") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the reference's answers must not lie around for a candidate to find
    return _tensor_list(loaded)


def _from_memory_file(description: dict[str, Any], fds: list[int], device: str) -> list[Any]:
    """The parent's own tensors from a memory file's bytes: every item's dtype from the allow-list,
    its bytes inside the file, read into memory the parent owns."""
    index, size, items = description.get("fd_index"), description.get("size"), description.get("items")
    if not _count(index) or index >= len(fds):
        raise HandoffError("the worker's hand-over names no descriptor that came with its reply")
    if not _count(size) or not isinstance(items, list):
        raise HandoffError("malformed memory-file hand-over (size, items)")
    if not _is_memory_file(fds[index], description.get("name")):
        # The descriptors are the last reply's: a hand-over read after the worker's next request
        # would otherwise read another reply's bytes with this one's layout.
        raise HandoffError("the descriptor is not the memory file this hand-over names")
    data = bytearray(size)
    try:
        got = _read_into(fds[index], memoryview(data))
    except OSError as exc:
        raise HandoffError(f"the worker's outputs could not be read ({exc})") from exc
    if got != size:
        raise HandoffError(f"the worker's memory file holds {got} of the {size} bytes it described")
    whole = torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return [None if item is None else _memory_file_tensor(item, whole, device) for item in items]


def _read_into(fd: int, buffer: memoryview) -> int:
    """Bytes read from the start of ``fd`` into ``buffer``, until it is full or the file ends (one
    read returns at most about 2 GiB on Linux)."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], done)
        if n == 0:
            break
        done += n
    return done


def _placed(item: Any, what: str) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype from the allow-list, shape, byte offset, byte count) of a tensor placed in one
    allocation or file (``{"dtype", "shape", "offset_bytes"}``); anything else is malformed."""
    dtype = _DTYPES.get(str(item.get("dtype"))) if isinstance(item, dict) else None
    shape = _ints(item.get("shape")) if isinstance(item, dict) else None
    offset = item.get("offset_bytes") if isinstance(item, dict) else None
    if dtype is None or shape is None or not _count(offset):
        raise HandoffError(f"malformed {what} {str(item)[:120]}")
    return dtype, shape, offset, math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _is_memory_file(fd: int, name: Any) -> bool:
    if not isinstance(name, str) or not name.startswith("kbv-handover-"):
        return False
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target.removesuffix(" (deleted)") == f"/memfd:{name}"


def _memory_file_tensor(item: Any, whole: torch.Tensor, device: str) -> torch.Tensor:
    dtype, shape, offset, nbytes = _placed(item, "memory-file item")
    if offset + nbytes > whole.numel() or offset % _MEMORY_FILE_ALIGN:
        raise HandoffError(f"a memory-file item lies outside the file or off alignment ({item!r})")
    return whole[offset : offset + nbytes].view(dtype).reshape(shape).to(device)


def _tensor_list(loaded: Any) -> list[Any]:
    if not isinstance(loaded, list) or not all(v is None or isinstance(v, torch.Tensor) for v in loaded):
        raise HandoffError("the worker's outputs are not a list of tensors")
    return loaded


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()


def _from_cuda(item: Any, device_index: int, bounded: bool = False) -> torch.Tensor:
    if isinstance(item, dict) and item.get("empty") is True:
        dtype, shape = _DTYPES.get(str(item.get("dtype"))), _ints(item.get("shape"))
        if dtype is None or shape is None or all(shape):
            raise HandoffError("malformed empty CUDA descriptor")
        return torch.empty(shape, dtype=dtype, device=f"cuda:{device_index}")
    dtype, shape, stride, offset, storage = _checked(item)
    try:
        view = _open_cuda(storage, device_index, dtype, shape, stride, offset, bounded=bounded)
        return _clone(view, memory_format=torch.contiguous_format)
    except torch.OutOfMemoryError:
        raise  # the parent's own room: never the worker's failure (see receive)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise HandoffError(f"the worker's CUDA handle could not be opened ({exc})") from exc


def _open_cuda(
    storage: dict[str, Any],
    device_index: int,
    dtype: torch.dtype,
    shape: list[int],
    stride: list[int],
    offset: int,
    *,
    bounded: bool = False,
) -> torch.Tensor:
    """A view of a worker's shared storage (checked by :func:`_checked`); the handle closes when
    the view goes. ``bounded`` (a candidate's handle): the storage's claimed size is checked against
    the allocation the driver opened, before anything reads or writes it."""
    shared = torch.UntypedStorage._new_shared_cuda(
        device_index,
        base64.b64decode(storage["handle"], validate=True),
        storage["size"],
        storage["offset_bytes"],
        _refcount_name(storage["ref_handle"]),
        storage["ref_offset"],
        base64.b64decode(storage["event_handle"], validate=True) if storage.get("event_handle") else b"",
        storage["event_sync"],
    )
    if bounded:  # torch put the storage ``offset_bytes`` into the mapping of the handle
        inside_allocation(
            shared.data_ptr() - storage["offset_bytes"], storage["offset_bytes"], shared.nbytes()
        )
    return torch.empty(0, dtype=dtype, device=f"cuda:{device_index}").set_(shared, offset, shape, stride)


def inside_allocation(mapping: int, offset: int, nbytes: int) -> None:
    """Refuse a storage that reaches past the allocation the driver opened for its handle. A
    worker's IPC descriptor states the storage's offset and size itself, and torch maps the whole
    allocation behind the handle (at ``mapping``) without comparing them with it: a claim past its
    end would make the parent read, or write into an inbox, whatever this process has mapped next,
    its own memory included. The allocation is asked of the driver at the mapping's start, which a
    claim cannot move."""
    from kbv import _vmm

    try:
        base, size = _vmm.address_range(mapping)
    except _vmm.VmmError as exc:
        raise HandoffError(f"the worker's CUDA handle could not be bounded ({exc})") from exc
    if base != mapping or offset + nbytes > size:
        raise HandoffError(
            f"the worker's CUDA storage reaches past its allocation ({offset + nbytes} of {size} bytes)"
        )


def inbox_layout(named: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Where each tensor goes in a worker's inbox (name, dtype, shape, offset_bytes) and the bytes
    the inbox needs."""
    from kbv import _vmm

    offsets, needed = _vmm.layout([_nbytes(t) for t in named.values()], 1)
    items = [
        {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset_bytes": offset}
        for (name, t), offset in zip(named.items(), offsets, strict=True)
    ]
    return items, needed


def fill_inbox(
    description: Any, fds: list[int], named: dict[str, torch.Tensor], items: list[dict[str, Any]], device: str
) -> None:
    """Parent side: the trusted ``named`` tensors written into the inbox a worker opened
    (:func:`open_inbox`) at the offsets of ``items``. The worker's description is checked (it must hold
    every item) before anything is written; the copies are complete and the mapping closed when this
    returns. Raises :class:`HandoffError` for an inbox that cannot hold them or cannot be opened."""
    if not isinstance(description, dict) or not device.startswith("cuda"):
        raise HandoffError("the worker's inbox is not described (or the evaluation is not on CUDA)")
    needed = max((item["offset_bytes"] + _nbytes(named[item["name"]]) for item in items), default=0)
    writes = [(named[item["name"]], int(item["offset_bytes"])) for item in items]
    if description.get("transport") == "cuda_vmm":
        _fill_vmm_inbox(description, fds, writes, needed, _device_index(device))
    else:
        _fill_ipc_inbox(description, writes, needed, _device_index(device))


def _fill_vmm_inbox(
    description: dict[str, Any],
    fds: list[int],
    writes: list[tuple[torch.Tensor, int]],
    needed: int,
    index: int,
) -> None:
    claimed = {**description, "items": [{"dtype": "torch.uint8", "shape": [needed], "offset_bytes": 0}]}
    fd, size, _ = _checked_vmm(claimed, fds)
    from kbv import _vmm

    try:
        _vmm.import_writes(fd, size, writes, index)
    except (_vmm.VmmError, RuntimeError, ValueError) as exc:
        raise HandoffError(f"the worker's inbox could not be opened ({exc})") from exc


def _fill_ipc_inbox(
    description: dict[str, Any], writes: list[tuple[torch.Tensor, int]], needed: int, index: int
) -> None:
    items = description.get("items")
    if description.get("transport") != "cuda_ipc" or not isinstance(items, list) or len(items) != 1:
        raise HandoffError(f"malformed inbox description (transport {description.get('transport')!r})")
    dtype, shape, stride, offset, storage = _checked(items[0])
    if dtype != torch.uint8 or len(shape) != 1 or stride != [1] or shape[0] < needed:
        raise HandoffError(f"the worker's inbox cannot hold {needed} bytes ({dtype}, shape {shape})")
    try:
        whole = _open_cuda(storage, index, dtype, shape, stride, offset, bounded=True)
        for tensor, at in writes:
            n = _nbytes(tensor)
            if n:
                whole[at : at + n].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        torch.cuda.synchronize(index)  # the copies are complete before the handle closes
    except (RuntimeError, ValueError, TypeError) as exc:
        raise HandoffError(f"the worker's inbox could not be written ({exc})") from exc


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _from_vmm(description: dict[str, Any], fds: list[int], device_index: int) -> list[Any]:
    """The parent's copies of a ``cuda_vmm`` hand-over: one allocation (``fd_index``, ``size``), or
    several (``allocations``, each item naming its own: :class:`kbv._staged_handoff.Staged`), each
    checked as one."""
    if "allocations" not in description:
        return _from_one_vmm(description, fds, device_index)
    allocations, items = description.get("allocations"), description.get("items")
    if not isinstance(allocations, list) or not isinstance(items, list):
        raise HandoffError("malformed VMM hand-over (allocations, items)")
    for item in items:
        part = item.get("allocation") if isinstance(item, dict) else None
        if item is not None and not (_count(part) and part < len(allocations)):
            raise HandoffError(f"a VMM item names no allocation of the hand-over: {str(item)[:120]}")
    copies: list[Any] = [None] * len(items)
    for k, allocation in enumerate(allocations):
        if not isinstance(allocation, dict):
            raise HandoffError("malformed VMM hand-over (allocations, items)")
        at = [i for i, item in enumerate(items) if item is not None and item["allocation"] == k]
        one = {
            "fd_index": allocation.get("fd_index"),
            "size": allocation.get("size"),
            "items": [items[i] for i in at],
        }
        for i, copy in zip(at, _from_one_vmm(one, fds, device_index), strict=True):
            copies[i] = copy
    return copies


def _from_one_vmm(description: dict[str, Any], fds: list[int], device_index: int) -> list[Any]:
    fd, size, items = _checked_vmm(description, fds)
    present = [item for item in items if item is not None]
    if not present:
        return list(items)
    from kbv import _vmm

    try:
        copies = iter(_vmm.import_copies(fd, size, present, device_index))
    except torch.OutOfMemoryError:
        raise  # the parent's own room: never the worker's failure (see receive)
    except (_vmm.VmmError, RuntimeError, ValueError) as exc:
        raise HandoffError(f"the worker's exported device memory could not be opened ({exc})") from exc
    return [None if item is None else next(copies) for item in items]


def _checked_vmm(
    description: dict[str, Any], fds: list[int]
) -> tuple[int, int, list[tuple[torch.dtype, list[int], int] | None]]:
    """Types and bounds of a ``cuda_vmm`` hand-over: every tensor inside the allocation's claimed
    size (the driver refuses to map more than the allocation holds), its descriptor one that came
    with the reply."""
    items, size, fd_index = description.get("items"), description.get("size"), description.get("fd_index")
    if not isinstance(items, list) or not _count(size):
        raise HandoffError("malformed VMM hand-over (items, size)")
    checked: list[tuple[torch.dtype, list[int], int] | None] = []
    for item in items:
        if item is None:
            checked.append(None)
            continue
        dtype, shape, offset, nbytes = _placed(item, "VMM descriptor")
        if offset + nbytes > size:
            raise HandoffError(
                f"VMM descriptor reaches beyond its allocation ({offset + nbytes} > {size} bytes)"
            )
        checked.append((dtype, shape, offset))
    if all(item is None for item in checked):
        return -1, size, checked
    if not _count(fd_index) or fd_index >= len(fds):
        raise HandoffError(
            f"the VMM hand-over names descriptor {fd_index!r}, but {len(fds)} came with the reply"
        )
    return fds[fd_index], size, checked


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked(item: Any) -> tuple[torch.dtype, list[int], list[int], int, dict[str, Any]]:
    """Types and bounds of one descriptor: the view must lie inside the shared storage."""
    if not isinstance(item, dict) or not isinstance(item.get("storage"), dict):
        raise HandoffError("malformed CUDA descriptor")
    dtype = _DTYPES.get(str(item.get("dtype")))
    shape, stride, offset, storage = (
        _ints(item.get("shape")),
        _ints(item.get("stride")),
        item.get("offset"),
        item["storage"],
    )
    if (
        dtype is None
        or shape is None
        or stride is None
        or len(shape) != len(stride)
        or not isinstance(offset, int)
        or offset < 0
    ):
        raise HandoffError(
            f"malformed CUDA descriptor (dtype {item.get('dtype')!r}, shape {item.get('shape')!r})"
        )
    for key in ("size", "offset_bytes", "ref_offset"):
        if not isinstance(storage.get(key), int) or storage[key] < 0:
            raise HandoffError(f"malformed CUDA descriptor ({key})")
    if not isinstance(storage.get("handle"), str) or not isinstance(storage.get("ref_handle"), str):
        raise HandoffError("malformed CUDA descriptor (handle)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset - 1
    if (last + 1) * itemsize > storage["size"]:
        raise HandoffError(
            f"CUDA descriptor reaches beyond its storage ({(last + 1) * itemsize} > {storage['size']} bytes)"
        )
    return dtype, shape, stride, offset, storage


def _ints(values: Any) -> list[int] | None:
    ok = isinstance(values, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values
    )
    return list(values) if ok else None


def _refcount_name(encoded: str) -> bytes:
    name = base64.b64decode(encoded, validate=True)
    if not _REFCOUNT_NAME.match(name):
        raise HandoffError(f"CUDA descriptor names an unexpected shared-memory object {name[:40]!r}")
    return name
