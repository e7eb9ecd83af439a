"""Executors: where and when evaluations run, and the one batch loop that drives them.

An executor only schedules: one pair at a time in this process (``sequential``, the default), on
every GPU of a host (``local``) or on a Ray cluster (``ray``). Each evaluation is still
``kbv.evaluation.evaluate`` with its own fresh, scrubbed reference and candidate worker processes;
the executor hands every finished pair back to :func:`run_pairs`, which alone skips stored pairs,
keeps records (store and JSONL) and shows progress::

    with make_executor("local", device="cuda", gpus="all") as executor:
        result = run_pairs(executor, pairs, protocol, store=store)

See docs/scale-out.md for the design.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
from kbv.records import Outcome, Record

EXECUTORS = ("local", "ray")


@dataclass
class BatchResult:
    records: list[Record] = field(default_factory=list)
    skipped: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    # What the workers reported (device name, torch): the environment half of every store key.
    env: dict[str, Any] = field(default_factory=dict)

    def keep(
        self, record: Record, candidate: Candidate, store: Any, run_id: int | None, jsonl: str | Path | None
    ) -> None:
        """Store a finished record at once (a later crash of the batch cannot lose it)."""
        if store is not None:
            store.add_record(record, run_id=run_id, label=candidate.label, source=candidate.source)
        if jsonl:
            with open(jsonl, "a") as handle:
                handle.write(record.to_json() + "\n")
        self.records.append(record)


def make_executor(
    name: str,
    *,
    device: str | None = None,
    gpus: str | list[int] | None = None,
    workers: int | None = None,
    address: str | None = None,
    evaluate_fn: Callable[..., Record] | None = None,
) -> Executor:
    """``sequential``, ``local`` or ``ray``. ``device`` is ``cpu`` or ``cuda`` (default: cuda when
    available); the sequential executor keeps ``cuda:N``."""
    from kbv.evaluation import default_device, evaluate

    if name == "sequential":
        from kbv.execute._sequential import SequentialExecutor

        return SequentialExecutor(device=device, evaluate_fn=evaluate_fn)
    device = (device or default_device()).split(":", 1)[0]
    evaluate_fn = evaluate_fn or evaluate
    if name == "local":
        from kbv.execute._local import LocalExecutor

        return LocalExecutor(
            device=device,
            gpus=parse_gpus(gpus) if device == "cuda" else None,
            workers=workers,
            evaluate_fn=evaluate_fn,
        )
    if name == "ray":
        from kbv.execute._ray import RayExecutor

        return RayExecutor(device=device, address=address, workers=workers, evaluate_fn=evaluate_fn)
    raise ExecutorError(f"unknown executor {name!r}: use one of {', '.join(EXECUTORS)}")


def parse_gpus(spec: str | list[int] | None) -> list[int]:
    """``all`` (default), ``0,1,...`` or a list: physical GPU indices, as ``cuda:N`` means to a worker."""
    if isinstance(spec, list):
        return spec
    if spec is None or spec == "all":
        return _all_gpus()
    try:
        gpus = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError as exc:
        raise ExecutorError(f"--gpus takes 'all' or indices like 0,1 (got {spec!r})") from exc
    if not gpus or len(set(gpus)) != len(gpus):
        raise ExecutorError(f"--gpus needs distinct GPU indices (got {spec!r})")
    return gpus


def _all_gpus() -> list[int]:
    # A worker's CUDA_VISIBLE_DEVICES replaces the parent's, so "cuda:N" names physical GPU N:
    # honour a mask the user set on kbv itself.
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None and mask.strip():
        try:
            return [int(p) for p in mask.split(",") if p.strip()]
        except ValueError as exc:
            raise ExecutorError(
                "CUDA_VISIBLE_DEVICES holds GPU UUIDs; give --gpus with indices instead"
            ) from exc
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ExecutorError("no CUDA GPU is visible: use --device cpu (with --workers N) or check the driver")
    return list(range(count))


# --- the command line -------------------------------------------------------------------------


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale-out")
    group.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=None,
        help=(
            "run pairs concurrently: local (every GPU of this host) or ray (a Ray cluster); default: "
            "one at a time"
        ),
    )
    group.add_argument(
        "--gpus",
        default=None,
        metavar="all|0,1,...",
        help="local executor: which GPUs get an evaluation slot (default: all)",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="with --device cpu: concurrent evaluations (default: CPU count / 4)",
    )
    group.add_argument(
        "--address",
        default=None,
        metavar="RAY_ADDRESS",
        help="ray executor: an existing cluster (default: start a local Ray)",
    )


def executor_from_args(args: argparse.Namespace, device: str | None = None) -> Executor:
    """The executor the flags ask for; without ``--executor`` the sequential one, on ``device``
    (a resumed run's) or else ``--device``."""
    name = getattr(args, "executor", None)
    if not name:
        for flag in ("gpus", "workers", "address"):
            if getattr(args, flag, None) is not None:
                raise ExecutorError(f"--{flag} needs --executor local or --executor ray")
        return make_executor("sequential", device=device or getattr(args, "device", None))
    return make_executor(
        name, device=getattr(args, "device", None), gpus=args.gpus, workers=args.workers, address=args.address
    )


def run_pairs(
    executor: Executor,
    pairs: Iterable[Pair],
    protocol: Protocol,
    *,
    store: Any = None,
    run_id: int | None = None,
    force: bool = False,
    timeout_s: float | None = None,
    jsonl: str | Path | None = None,
    console: Any = None,
) -> BatchResult:
    """The batch loop: evaluate ``pairs`` on ``executor``, skipping pairs already stored (unless
    ``force``), keeping each record the moment it is finished; harness errors are listed in the
    result, not fatal. The store is written here only."""
    from rich.console import Console

    from kbv.report.terminal import progress_bar
    from kbv.store import RecordKey, pair_key
    from kbv.toolchain import check_toolchain

    pairs = list(pairs)
    # Before any worker starts: a missing compiler must not be scored as every C++ candidate failing.
    check_toolchain([candidate for _, candidate in pairs], getattr(executor, "device", None))
    console = console or Console(stderr=True)
    # What the records carry (evaluate applies the timeout; crashed records get it here), so what
    # the keys hash: a run with --timeout resumes without redoing its pairs.
    protocol = protocol.with_timeout(timeout_s)
    env = executor.probe() if store is not None else {}
    executor.device_name = env.get("device_name", executor.device_name)
    result = BatchResult(env=env)

    def key(problem: Problem, candidate: Candidate) -> RecordKey:
        return pair_key(problem, candidate, protocol, env)  # what record_key of its record will be

    with progress_bar(console) as progress:
        task = progress.add_task("evaluating", total=len(pairs))

        def should_skip(problem: Problem, candidate: Candidate) -> bool:
            skip = store is not None and not force and store.has_record(key(problem, candidate))
            if skip:
                result.skipped += 1
                progress.advance(task)
            return skip

        def on_start(problem: Problem, candidate: Candidate) -> None:
            progress.update(task, description=f"{problem.name} x {candidate.label}/{candidate.path.name}")

        def on_record(
            problem: Problem, candidate: Candidate, record: Record | None, exc: Exception | None
        ) -> None:
            on_start(problem, candidate)
            progress.advance(task)
            if record is None:
                result.errors.append(_harness_error(problem, candidate, exc))
                return
            _stamp_crashed_versions(record, env)
            _note_problem_change(problem, record, warned, console)
            result.keep(record, candidate, store, run_id, jsonl)

        warned: set[Path] = set()
        executor.map(
            pairs,
            protocol,
            timeout_s=timeout_s,
            on_record=on_record,
            should_skip=should_skip,
            on_start=on_start,
        )
    for slot, state in executor.health().get("removed", {}).items():
        console.print(f"[red]removed from the pool[/red] {slot}: {state}")
    return result


def _harness_error(problem: Problem, candidate: Candidate, exc: Exception | None) -> tuple[str, str]:
    """A pair the harness could not evaluate, as the batch result lists it: the pair and the first
    line of the error."""
    return (
        f"{problem.name} x {candidate.path.name}",
        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
    )


def _stamp_crashed_versions(record: Record, env: dict[str, Any]) -> None:
    """A crashed record is written by the driver, not a worker: give it the versions the key was
    probed with, so that a crashed pair counts as finished work on resume."""
    if record.outcome != Outcome.CRASHED.value or not env:
        return
    from kbv._version import __version__

    record.versions = {
        "kbv": __version__,
        "torch": env.get("torch", ""),
        **(record.versions or {}),
    }


def _note_problem_change(problem: Problem, record: Record, warned: set[Path], console: Any) -> None:
    """A problem file that changed on disk during the batch: its records say so, and the batch warns
    once per file. Every pair of the batch still evaluates the text read when the batch started, so
    its records stay comparable (and a candidate that rewrote the file changed nothing judged)."""
    if not problem.changed_on_disk():
        return
    record.problem["changed_on_disk"] = True
    if problem.path in warned:
        return
    warned.add(problem.path)
    console.print(
        f"[yellow]warning[/yellow] problem file {problem.path} changed on disk during the batch; "
        f"every pair keeps evaluating the text read at the start (sha256 {problem.source_sha256[:12]}). "
        "Run the batch again to evaluate the new text."
    )


__all__ = [
    "EXECUTORS",
    "BatchResult",
    "Executor",
    "ExecutorError",
    "OnRecord",
    "OnStart",
    "Pair",
    "ShouldSkip",
    "add_executor_arguments",
    "crashed_record",
    "environment",
    "is_harness_error",
    "probe_hello",
    "executor_from_args",
    "make_executor",
    "parse_gpus",
    "run_pairs",
]
