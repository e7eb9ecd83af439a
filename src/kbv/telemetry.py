"""GPU telemetry from NVML, read by the trusted parent (no CUDA context, nothing the candidate touches).

Optional: without ``nvidia-ml-py`` (``pip install 'kernelbench-verified[gpu]'``) or without a GPU,
every function returns None and records say so.
"""

from __future__ import annotations

import functools
import os
from typing import Any

# Throttle reasons that mean the measurement ran slower than the GPU can (NVML's bit values).
_BAD_THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}


@functools.lru_cache(maxsize=1)
def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no GPU: telemetry is simply absent
        return None


def physical_index(device: str) -> int:
    """The NVML index of ``cuda`` / ``cuda:N`` as the parent sees it (respecting CUDA_VISIBLE_DEVICES)."""
    logical = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if logical < len(ids) and ids[logical].isdigit():
            return int(ids[logical])
    return logical


def gpu_state(device: str) -> dict[str, Any] | None:
    """Clocks, temperature, power and throttle reasons of one GPU right now."""
    nvml = _nvml()
    if nvml is None or not device.startswith("cuda"):
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(physical_index(device))
        reasons = int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        return {
            "sm_clock_mhz": int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
            "temperature_c": int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "throttle_reasons": reasons,
            "throttled": [name for bit, name in _BAD_THROTTLE_BITS.items() if reasons & bit],
        }
    except Exception as exc:  # a query NVML does not support on this GPU: keep going, say why
        return {"error": str(exc)}


def process_memory_bytes(device: str, pid: int | None) -> int | None:
    """Device memory NVML attributes to ``pid`` (every allocation, not only PyTorch's)."""
    return None if pid is None else (device_process_bytes(device) or {}).get(pid)


def device_process_bytes(device: str) -> dict[int, int] | None:
    """Device memory NVML attributes to each process on ``device`` (pid: bytes), or None where
    per-process accounting is unavailable."""
    nvml = _nvml()
    if nvml is None or not device.startswith("cuda"):
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(physical_index(device))
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # per-process accounting is unavailable in some containers
        return None
    found = {int(p.pid): int(p.usedGpuMemory) for p in running if p.usedGpuMemory is not None}
    return found or None


def driver_version() -> str | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None


def compute_capability(device: str) -> str | None:
    """``"9.0"`` for an H100/H200: the GPU's compute capability from NVML (no CUDA context made)."""
    nvml = _nvml()
    if nvml is None or not device.startswith("cuda"):
        return None
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(
            nvml.nvmlDeviceGetHandleByIndex(physical_index(device))
        )
        return f"{int(major)}.{int(minor)}"
    except Exception:  # an NVML without the query: the worker's torch decides, as before
        return None
