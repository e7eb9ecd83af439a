"""How a worker is started (``WorkerSpec``), where it runs, and how its failure reaches the parent
(``WorkerFailed``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbv.processes import CONFINE_GPU_ENV, CONFINE_WRITE_ENV


class WorkerFailed(Exception):
    """The worker did not answer a request: it timed out, crashed or reported an error.

    ``kind`` is one of ``timeout``, ``crashed``, ``compile_error``, ``import_error``,
    ``runtime_error``, ``cuda_error``, ``resource_limit`` (``details["limit"]`` says which). This is an
    outcome of the code under test, not a harness bug.
    ``role`` is the failing worker's (``reference``: the problem's own code failed; ``candidate``),
    or None when the parent raised it without a worker's answer.
    """

    def __init__(
        self, kind: str, message: str, details: dict[str, Any] | None = None, role: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.details = details or {}
        self.role = role

    def logs_tail(self, limit: int = 2000) -> str:
        """The end of the worker's stderr, for a message about a worker that failed to start."""
        return str(self.details.get("stderr", ""))[-limit:]


def visible_devices(device: str) -> str | None:
    """``cuda:N`` pins a worker to GPU N (``CUDA_VISIBLE_DEVICES=N``); inside it is simply ``cuda``."""
    return device.split(":", 1)[1] if device.startswith("cuda:") else None


def worker_device(device: str) -> str:
    """The device name a worker uses: ``cuda`` for any ``cuda:N`` (it sees only that GPU)."""
    return "cuda" if device.startswith("cuda") else device


def confinement_env(writable: Iterable[Path | str], gpu: bool) -> dict[str, str]:
    """What a process running candidate code needs in its environment to confine itself with
    Landlock and seccomp (``kbv.child.confine``) before that code runs: the directories it may write
    beneath. Empty where ``KBV_CONFINE=0`` turns that off (``Worker.isolation`` says so)."""
    if confinement_off():
        return {}
    return {
        CONFINE_WRITE_ENV: os.pathsep.join(str(p) for p in writable),
        CONFINE_GPU_ENV: "1" if gpu else "0",
    }


def confinement_off() -> bool:
    return os.environ.get("KBV_CONFINE", "1").lower() in ("0", "off", "no")


def cache_root() -> Path:
    """Where builds are cached: ``$KBV_CACHE_DIR`` or ``~/.cache/kbv``."""
    return Path(os.environ.get("KBV_CACHE_DIR") or Path.home() / ".cache" / "kbv")


@dataclass
class WorkerSpec:
    """How to start a worker. ``build_key`` (a source hash) selects its private build directory."""

    build_key: str
    device: str = "cpu"
    visible_devices: str | None = None
    role: str = "candidate"
    # Seconds this worker may spend answering requests (booting and compiling included); the clock
    # runs only while the parent waits on it, so a slow reference does not eat the candidate's time.
    budget_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # A kbv.protocol.LimitSettings polled while the parent waits (None: no limits, trusted workers).
    limits: Any = None
    # Files a candidate worker must read (its candidate; the problem comes as text): checked before it
    # drops to its own uid.
    readable: tuple[str, ...] = ()
    # Take the profiler's (and the reference's FLOP counter's) first use while booting, for the
    # dynamic probes: seconds per worker, so only where a protocol runs them (``verified``).
    warm_probes: bool = False
