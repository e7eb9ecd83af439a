"""Handing tensors from a worker to the trusted parent without a host round trip.

On a GPU a worker shares each tensor it hands over as a CUDA IPC handle: the handle's bytes travel
as base64 inside the JSON reply, never as a pickle, and the parent opens the handle, copies the
tensor into memory it owns and closes the handle before anything judges it (:func:`receive`).
On the CPU (and for a GPU worker's non-CUDA values) tensors go through one file in the worker's
scratch directory, read with ``torch.load(weights_only=True)`` and deleted at once.

Child side: :func:`hand_over` (bound before the candidate is imported). Parent side: :func:`receive`.
Neither side ever sends a handle *to* a worker: handles only flow from workers to the parent, so a
candidate never holds a handle to trusted memory (``docs/architecture.md``, "Outputs stay on the
device").
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
from typing import Any

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


def hand_over(values: list[Any], device: torch.device, path: str, keep: list[Any]) -> dict[str, Any]:
    """Describe ``values`` (plain copies from :func:`plain_copy`, or None) for the parent.

    CUDA tensors become IPC descriptors (``keep`` holds them alive until the parent has copied
    them: the worker clears it at its next request); everything else goes to one file at ``path``.
    """
    if device.type == "cuda" and all(
        v is None or (isinstance(v, torch.Tensor) and v.is_cuda) for v in values
    ):
        _synchronize()
        keep.extend(v for v in values if v is not None)
        return {"transport": "cuda_ipc", "items": [None if v is None else _describe_cuda(v) for v in values]}
    _save([v if v is None else v.cpu() for v in values], path)
    return {"transport": "file", "path": path, "count": len(values)}


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


def receive(description: Any, device: str) -> list[Any]:
    """The parent's own copies of the tensors a worker handed over (on ``device``); None stays None.

    Every descriptor is checked before use; a CUDA handle is opened, the tensor copied into memory
    the parent owns, and the handle closed before this returns, so nothing the worker does later
    can change what is judged. Raises :class:`HandoffError` for anything malformed.
    """
    if not isinstance(description, dict):
        raise HandoffError("the worker's outputs are not described")
    transport = description.get("transport")
    if transport == "file":
        return _from_file(description, device)
    if transport == "cuda_ipc":
        items = description.get("items")
        if not isinstance(items, list):
            raise HandoffError("the worker's CUDA hand-over has no item list")
        if not device.startswith("cuda"):
            raise HandoffError("a CUDA hand-over for a CPU evaluation")
        copies = [None if item is None else _from_cuda(item, _device_index(device)) for item in items]
        torch.cuda.synchronize(_device_index(device))  # the copies are complete before the handles close
        return copies
    raise HandoffError(f"unknown hand-over transport {transport!r}")


def _from_file(description: dict[str, Any], device: str) -> list[Any]:
    path = description.get("path")
    if not isinstance(path, str):
        raise HandoffError("the worker's hand-over names no file")
    try:
        loaded = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # written by a hostile or broken worker
        raise HandoffError(f"the worker's outputs could not be read ({exc})") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the reference's answers must not lie around for a candidate to find
    if not isinstance(loaded, list) or not all(v is None or isinstance(v, torch.Tensor) for v in loaded):
        raise HandoffError("the worker's outputs are not a list of tensors")
    return loaded


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()


def _from_cuda(item: Any, device_index: int) -> torch.Tensor:
    if isinstance(item, dict) and item.get("empty") is True:
        dtype, shape = _DTYPES.get(str(item.get("dtype"))), _ints(item.get("shape"))
        if dtype is None or shape is None or all(shape):
            raise HandoffError("malformed empty CUDA descriptor")
        return torch.empty(shape, dtype=dtype, device=f"cuda:{device_index}")
    dtype, shape, stride, offset, storage = _checked(item)
    try:
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
        view = torch.empty(0, dtype=dtype, device=f"cuda:{device_index}").set_(shared, offset, shape, stride)
        return _clone(view, memory_format=torch.contiguous_format)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise HandoffError(f"the worker's CUDA handle could not be opened ({exc})") from exc


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
