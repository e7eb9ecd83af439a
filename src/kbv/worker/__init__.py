"""Worker processes, seen from the trusted parent.

Each worker is a fresh interpreter (``python -m kbv.child.main``) started in its own process
group with a scrubbed environment, a private home and build directory, and one end of a socket pair
as its only channel back. Its stdout and stderr go to log files that the parent keeps but never
parses. Every process it starts is tracked (``kbv.worker._contain``: a cgroup where the kernel
allows one, the worker as child subreaper, a marker in the environment) and killed with it; a
candidate worker's resources are polled against its protocol's limits while the parent waits.

Modules: the process and its channel (``_process``), its limits (``_limits``), the memory rule
sent with each request (``_memory``), the isolation report (``_isolation``), the spares pool
(``_spares``), how a worker is started and how it fails (``_spec``), and the scratch directories
(``_scratch``).
"""

from __future__ import annotations

from kbv.processes import harden_process as harden_process  # kbv.worker.harden_process, as documented
from kbv.worker._limits import FULL_SCAN_S, POLL_S
from kbv.worker._memory import CACHED_BYTES_KEPT, DEFAULT_ROOM_BYTES, MemoryBudget
from kbv.worker._process import (
    CPU_INTRA_OP_THREADS,
    ESCAPED_STOP_ROUNDS,
    ESCAPED_STOP_WAIT_S,
    LOG_TAIL_BYTES,
    Worker,
    close_all,
)
from kbv.worker._spares import SPARE_DEPTH, Spares, stopped_processes
from kbv.worker._spec import (
    WorkerFailed,
    WorkerSpec,
    cache_root,
    confinement_env,
    confinement_off,
    visible_devices,
    worker_device,
)

__all__ = [
    "CACHED_BYTES_KEPT",
    "DEFAULT_ROOM_BYTES",
    "MemoryBudget",
    "CPU_INTRA_OP_THREADS",
    "ESCAPED_STOP_ROUNDS",
    "ESCAPED_STOP_WAIT_S",
    "FULL_SCAN_S",
    "LOG_TAIL_BYTES",
    "POLL_S",
    "SPARE_DEPTH",
    "Spares",
    "Worker",
    "WorkerFailed",
    "WorkerSpec",
    "cache_root",
    "close_all",
    "confinement_env",
    "confinement_off",
    "harden_process",
    "stopped_processes",
    "visible_devices",
    "worker_device",
]
