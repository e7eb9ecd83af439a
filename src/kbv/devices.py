"""Which devices kbv can evaluate on here: a device that is not there is the user's error.

Checked before any worker starts, so ``--device cuda`` on a machine without a GPU (or ``--device
tpu``) is one line and exit status 2, not a traceback from a worker or a harness error per pair.
torch is imported only when a CUDA device is asked for.
"""

from __future__ import annotations

from typing import Any

HINT = "use cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """A device name kbv does not know, or a CUDA device this machine does not have."""


def check_device(device: str | None) -> None:
    """Raise :class:`DeviceError` unless ``device`` is None (the default), ``cpu``, or a CUDA device
    that exists here (``cuda`` or ``cuda:N``)."""
    if device is None or device == "cpu":
        return
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise DeviceError(f"unknown device {device!r}; {HINT}")
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device {device}: no CUDA GPU is visible on this machine (torch "
            f"{torch.__version__}); use --device cpu"
        )
    count = torch.cuda.device_count()
    if device.startswith("cuda:") and int(device[5:]) >= count:
        raise DeviceError(
            f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )


def release_device_memory(device: str) -> None:
    """Hand this process's GPU memory back to the workers: tensors caught in reference cycles
    (closures, tracebacks) and the allocator's cache. Measured on the H200: without it a parent
    kept 104 GB cached after 25 KernelBench problems and the next worker ran out. CPU: nothing."""
    if not device.startswith("cuda"):
        return
    import gc

    import torch

    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def release_cached_blocks(device: str) -> None:
    """Hand the allocator's unused cached blocks back (no collection: cheap, for between phases).
    The parent's blocks from the correctness draws would otherwise stay reserved while the
    workers time and probe with the inputs they keep. CPU: nothing."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def allocator_figures(device: str) -> dict[str, int] | None:
    """This process's view of ``device``: its allocator's bytes in tensors (``allocated``) and
    reserved with its cache (``reserved``), and the driver's ``free`` and ``total``. None on the
    CPU or before this process has a CUDA context (asking would make one)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    try:  # read while a failure is being explained: a context in an error state gives no figures
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    except RuntimeError:
        return None
    return {"allocated": int(allocated), "reserved": int(reserved), "free": int(free), "total": int(total)}


def reserved_peak_since_last_mark(device: str) -> int | None:
    """The most this process's allocator reserved on ``device`` since the previous call, the peak
    then reset (host-side counters: no synchronisation). None on the CPU or before this process has
    a CUDA context. Nothing else in the parent reads the peak counters, so resetting them here
    spoils no other figure."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    peak = int(torch.cuda.max_memory_reserved(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def cpu_name() -> str:
    """What a record calls this machine's CPU (``device.name``)."""
    import platform

    return platform.processor() or platform.machine()


def device_name(device: str, hello: dict[str, Any]) -> str:
    """The one rule for a record's ``device.name``: the GPU's name as a worker on ``device`` reports
    it in its hello, else (the CPU, or a worker that named no GPU) :func:`cpu_name`. Records and
    resume keys must agree on it, or a resumed batch redoes its stored pairs."""
    name = (hello.get("device") or {}).get("name") if device.startswith("cuda") else None
    return name or cpu_name()
