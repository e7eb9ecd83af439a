"""The Ray executor: each evaluation a Ray task holding one GPU (or one CPU with ``--device cpu``).

- Compilation runs first as a CPU task on some node; the evaluation is then scheduled on that same
  node (soft node affinity) so it finds the build in that node's cache.
- A task carries the problem and candidate sources (paths need not exist on other nodes) and writes
  them to a node-local temporary directory, file names kept, before ``kbv.evaluation.evaluate`` starts
  its fresh scrubbed workers there. Ray's ``CUDA_VISIBLE_DEVICES`` pins those workers to the task's GPU.
- Results stream back with ``ray.wait``; the driver alone calls ``on_record`` and writes the store.
- A task whose worker process or node dies is resubmitted once (Ray's own retries are off, so the
  count is ours), then recorded as ``crashed``. Harness errors come back as values, not retried.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kbv.candidates import Candidate
from kbv.execute._base import (
    Executor,
    ExecutorError,
    OnRecord,
    OnStart,
    Pair,
    ShouldSkip,
    crashed_record,
    environment,
    is_harness_error,
    probe_hello,
)
from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import Record
from kbv.worker.builds import arch_list_for, compile_candidate, needs_build

ATTEMPTS = 2
MAX_CUDA_ERRORS = 3


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError('the ray executor needs Ray: pip install "kernelbench-verified[ray]"') from exc
    return ray


# --- what runs on the cluster -----------------------------------------------------------------


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _task_compile(candidate: Candidate, arch_list: str | None) -> dict[str, Any]:
    result = compile_candidate(candidate, arch_list=arch_list)
    return {"node_id": _node_id(), "compile": result.to_dict()}


def _task_evaluate(
    evaluate_fn: Callable[..., Record],
    problem: Problem,
    candidate: Candidate,
    protocol: Protocol,
    device: str,
    timeout_s: float | None,
) -> dict[str, Any]:
    import ray

    placement = {"node_id": _node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
    with tempfile.TemporaryDirectory(prefix="kbv-ray-") as tmp:
        local_problem = dataclasses.replace(
            problem, path=_write(Path(tmp) / "problem" / problem.path.name, problem.source)
        )
        local_candidate = dataclasses.replace(
            candidate, path=_write(Path(tmp) / "candidate" / candidate.path.name, candidate.source)
        )
        try:
            record = evaluate_fn(local_problem, local_candidate, protocol, device, timeout_s=timeout_s)
        except Exception as exc:
            if is_harness_error(exc):  # a value, so the driver reports it as for any executor
                return {**placement, "error": exc}
            raise
    # The record names the files the driver knows, not this node's temporary copies.
    changed = bool(record.problem.get("changed_on_disk"))  # this node's copy, rewritten meanwhile
    record.problem, record.candidate = problem.ref(), candidate.ref()
    if changed:
        record.problem["changed_on_disk"] = True
    record.device = {
        **record.device,
        "node_id": placement["node_id"],
        **({"index": placement["gpu_ids"][0]} if placement["gpu_ids"] else {}),
    }
    return {**placement, "record": record}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def _task_probe(device: str) -> dict[str, Any]:
    return probe_hello(device)


# --- the driver -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    problem: Problem
    candidate: Candidate
    attempts: list[str] = dataclasses.field(default_factory=list)


class RayExecutor(Executor):
    def __init__(
        self,
        *,
        device: str = "cuda",
        address: str | None = None,
        workers: int | None = None,
        evaluate_fn: Callable[..., Record],
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ExecutorError(f"device must be cpu or cuda, not {device!r}")
        self.ray = _import_ray()
        self.device = device
        self.address = address
        self.max_in_flight = workers
        self.evaluate_fn = evaluate_fn
        self._started_ray = False
        self._hello: dict[str, Any] | None = None
        self._remote: dict[str, Any] = {}
        self._cuda_in_row: dict[str, int] = {}
        self._suspect: dict[str, str] = {}
        self._stats: dict[str, Any] = {}

    def _connect(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = (
                {"address": self.address} if self.address else {"include_dashboard": False}
            )
            try:
                ray.init(ignore_reinit_error=True, log_to_driver=False, **kwargs)
            except ConnectionError as exc:
                raise ExecutorError(f"cannot reach the Ray cluster at {self.address}: {exc}") from exc
            self._started_ray = not self.address
        if not self._remote:
            self._remote = {
                "compile": ray.remote(_task_compile).options(num_cpus=1, max_retries=0),
                "evaluate": ray.remote(_task_evaluate),
                "probe": ray.remote(_task_probe).options(max_retries=0, **self._resources()),
            }

    def _resources(self) -> dict[str, Any]:
        return {"num_gpus": 1, "num_cpus": 1} if self.device == "cuda" else {"num_cpus": 1}

    def probe(self) -> dict[str, Any]:
        """What a worker on one of the cluster's devices sees (assumes one GPU model; see docs)."""
        if self._hello is None:
            self._connect()
            self._hello = self.ray.get(self._remote["probe"].remote(self.device))
        env = environment(self.device, self._hello)
        self.device_name = env["device_name"]
        return env

    def map(
        self,
        pairs: Iterable[Pair],
        protocol: Protocol,
        *,
        timeout_s: float | None,
        on_record: OnRecord,
        should_skip: ShouldSkip,
        on_start: OnStart | None = None,
    ) -> None:
        self._connect()
        arch_list = (
            arch_list_for(((self._hello or {}).get("device") or {}).get("capability"))
            if self.device == "cuda"
            else None
        )
        started = time.monotonic()
        waiting: list[tuple[_Job, str | None]] = []  # compiled (or nothing to compile), not yet submitted
        refs: dict[Any, tuple[str, _Job]] = {}
        for problem, candidate in pairs:
            if should_skip(problem, candidate):
                continue
            job = _Job(problem, candidate)
            if needs_build(candidate.source):
                refs[self._remote["compile"].remote(candidate, arch_list)] = ("compile", job)
            else:
                waiting.append((job, None))
        evaluations = 0
        try:
            while refs or waiting:
                evaluations += self._submit(waiting, refs, protocol, timeout_s)
                ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=1.0)
                for ref in ready:
                    kind, job = refs.pop(ref)
                    if kind == "compile":
                        waiting.append((job, self._compile_node(ref)))
                    else:
                        self._finish(ref, job, protocol, waiting, on_record)
        finally:
            for ref in refs:
                self.ray.cancel(ref, force=True)
            self._stats = {"wall_s": time.monotonic() - started, "evaluations": evaluations}

    def _submit(
        self,
        waiting: list[tuple[_Job, str | None]],
        refs: dict[Any, tuple[str, _Job]],
        protocol: Protocol,
        timeout_s: float | None,
    ) -> int:
        submitted = 0
        while waiting:
            in_flight = sum(1 for kind, _ in refs.values() if kind == "evaluate")
            if self.max_in_flight and in_flight >= self.max_in_flight:
                break
            job, node = waiting.pop(0)
            options: dict[str, Any] = {"max_retries": 0, **self._resources()}
            if node is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=True)
            device = "cuda" if self.device == "cuda" else "cpu"
            ref = (
                self._remote["evaluate"]
                .options(**options)
                .remote(self.evaluate_fn, job.problem, job.candidate, protocol, device, timeout_s)
            )
            refs[ref] = ("evaluate", job)
            submitted += 1
        return submitted

    def _compile_node(self, ref: Any) -> str | None:
        try:
            return str(self.ray.get(ref)["node_id"])
        except self.ray.exceptions.RayError:  # the build is an optimisation: evaluate anyway
            return None

    def _finish(
        self,
        ref: Any,
        job: _Job,
        protocol: Protocol,
        waiting: list[tuple[_Job, str | None]],
        on_record: OnRecord,
    ) -> None:
        try:
            out = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            job.attempts.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if len(job.attempts) < ATTEMPTS:
                waiting.insert(0, (job, None))  # anywhere Ray finds room; a dead node gets nothing
                return
            device = {"type": self.device, "name": self.device_name}
            on_record(
                job.problem,
                job.candidate,
                crashed_record(
                    job.problem,
                    job.candidate,
                    protocol,
                    device,
                    "the evaluation died twice; see attempts",
                    job.attempts,
                ),
                None,
            )
            return
        self._track_health(out)
        on_record(job.problem, job.candidate, out.get("record"), out.get("error"))

    def _track_health(self, out: dict[str, Any]) -> None:
        """Ray keeps scheduling on a GPU it believes healthy: kbv can only report suspects."""
        if not out.get("gpu_ids"):
            return
        slot = f"{out['node_id'][:12]}/gpu{out['gpu_ids'][0]}"
        record, error = out.get("record"), out.get("error")
        if ((record.error or {}).get("kind") if record else None) == "cuda_error" or (
            error is not None and "cuda_error" in str(error)
        ):
            self._cuda_in_row[slot] = self._cuda_in_row.get(slot, 0) + 1
            if self._cuda_in_row[slot] >= MAX_CUDA_ERRORS:
                self._suspect[slot] = f"{self._cuda_in_row[slot]} CUDA errors in a row"
        elif record is not None:
            self._cuda_in_row[slot] = 0

    def health(self) -> dict[str, Any]:
        return {"cuda_errors_in_row": dict(self._cuda_in_row), "removed": dict(self._suspect)}

    def stats(self) -> dict[str, Any]:
        return self._stats

    def close(self) -> None:
        if self._started_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self._started_ray = False
