"""Where an evaluation's device memory goes: every process's GPU memory over one evaluation, by phase.

The reference submitted as the candidate ran out of the H200's 140 GB on KernelBench's largest
level-1 problems (``34_InstanceNorm``, 7.5 GB of input) once its own limit was lifted: NVML showed
the parent process holding 51-75 GB. This runs one evaluation of the reference as the candidate and
samples, every ``--interval`` seconds, NVML's per-process figure for the parent and each worker
(named by role), and the parent's PyTorch allocator (allocated, reserved, peak), labelled with the
evaluation's phase at that moment. One JSON line per sample to ``--out``, then a summary per phase.

    python benchmarks/device_memory_trace.py .kb/kb250/level1/34_InstanceNorm.py --out $OUT/mem.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_as_candidate import candidate_source  # noqa: E402

from kbv import evaluation, telemetry  # noqa: E402
from kbv.candidates import load_candidate  # noqa: E402
from kbv.problems import load_problem  # noqa: E402
from kbv.protocol import load_protocol  # noqa: E402
from kbv.worker import Worker  # noqa: E402

_phases: list[str] = []
_roles: dict[int, str] = {}


def _traced_phase(original: Any) -> Any:
    def phase(ctx: Any, name: str, work: Any) -> Any:
        _phases.append(name)
        try:
            return original(ctx, name, work)
        finally:
            _phases.pop()

    return phase


def _traced_launch(original: Any) -> Any:
    def launch(self: Worker) -> None:
        original(self)
        if self.pid is not None:
            _roles[self.pid] = self.spec.role

    return launch


def _per_process(device: str) -> dict[str, int]:
    nvml = telemetry._nvml()
    if nvml is None:
        return {}
    handle = nvml.nvmlDeviceGetHandleByIndex(telemetry.physical_index(device))
    named = {}
    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        role = "parent" if proc.pid == os.getpid() else _roles.get(proc.pid, f"pid {proc.pid}")
        named[f"{role} ({proc.pid})"] = int(proc.usedGpuMemory or 0)
    return named


def _sample(device: str, started: float) -> dict[str, Any]:
    return {
        "t": round(time.monotonic() - started, 2),
        "phase": "/".join(_phases) or "-",
        "nvml": _per_process(device),
        "parent_allocated": torch.cuda.memory_allocated(),
        "parent_reserved": torch.cuda.memory_reserved(),
        "parent_peak": torch.cuda.max_memory_allocated(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--tf32", action="store_true")
    args = ap.parse_args()
    evaluation._phase = _traced_phase(evaluation._phase)
    Worker.launch = _traced_launch(Worker.launch)  # type: ignore[method-assign]
    stop = threading.Event()
    rows: list[dict[str, Any]] = []
    started = time.monotonic()

    def sampler() -> None:
        with args.out.open("w") as out:
            while not stop.is_set():
                row = _sample(args.device, started)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                stop.wait(args.interval)

    with tempfile.TemporaryDirectory() as tmp:
        candidate_path = Path(tmp) / f"{args.problem.stem}.py"
        candidate_path.write_text(candidate_source(args.problem.read_text(), args.tf32))
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        record = evaluation.evaluate(
            load_problem(args.problem), load_candidate(candidate_path), load_protocol("verified"), args.device
        )
        stop.set()
        thread.join()
    print(f"{args.problem.stem}: {record.outcome} {(record.error or {}).get('message', '')[:300]}")
    print("phases_s", {k: round(v, 2) for k, v in record.phases_s.items()})
    print("memory", record.memory)
    peaks: dict[str, dict[str, int]] = {}
    for row in rows:
        by_role = peaks.setdefault(row["phase"], {})
        for name, used in row["nvml"].items():
            role = name.split(" (")[0]
            by_role[role] = max(by_role.get(role, 0), used)
        by_role["parent_allocated"] = max(by_role.get("parent_allocated", 0), row["parent_allocated"])
        by_role["parent_reserved"] = max(by_role.get("parent_reserved", 0), row["parent_reserved"])
    for phase, by_role in peaks.items():
        print(phase, {k: f"{v / 2**30:.1f} GiB" for k, v in sorted(by_role.items())})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
