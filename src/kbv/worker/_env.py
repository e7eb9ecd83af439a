"""The environment a worker process starts with: an allowlist, never the parent's secrets.

The candidate is hostile. It gets only what running PyTorch, a compiler and a GPU needs; anything
that looks like a credential is dropped even when its name is on the allowlist.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# Variables a build or a CUDA run needs. Prefix entries end in "_".
_ALLOWED = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING",
    "CC",
    "CXX",
    "MAX_JOBS",
    "TORCH_CUDA_ARCH_LIST",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
    "OPENBLAS_NUM_THREADS",
    "NVIDIA_",
    "NCCL_",
    "NVSHMEM_",
    "TORCH_SYMM_MEM_",
    "TRITON_INTERPRET",
)
#: The user name every worker sees (``USER``, ``LOGNAME``), whatever its uid.
WORKER_USER = "kbv-worker"
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


def _allowed(name: str) -> bool:
    if _SECRET.search(name):
        return False
    return any(name.startswith(a) if a.endswith("_") else name == a for a in _ALLOWED)


def scrubbed_env(
    parent: Mapping[str, str],
    *,
    home: Path,
    extensions_dir: Path,
    triton_dir: Path,
    visible_devices: str | None = None,
) -> dict[str, str]:
    """The worker's environment: allowlisted parent variables plus private cache directories."""
    env = {k: v for k, v in parent.items() if _allowed(k)}
    env["HOME"] = str(home)
    env["TMPDIR"] = str(home)
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
    env["TRITON_CACHE_DIR"] = str(triton_dir)
    # A candidate worker may run as a uid without a passwd entry (``_privileges``), where
    # ``getpass.getuser()`` raises unless these are set: torch's inductor calls it for its default
    # cache directory (under TMPDIR, so still private) when the profiler is first started.
    env["USER"] = env["LOGNAME"] = WORKER_USER
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    env.setdefault("PATH", os.defpath)
    return env


def arch_list_for(capability: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` that reproduces torch's automatic choice for one GPU model.

    With the variable unset and one visible GPU of capability X.Y, torch compiles for ``X.Y+PTX``.
    Ahead-of-time builds see no GPU, so they are told; evaluation workers are told the same, so a
    build made ahead of time and the worker's import agree on every flag and nothing is rebuilt.
    A user's own setting wins (both inherit it)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    return f"{capability}+PTX" if capability else None
