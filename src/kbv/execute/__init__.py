"""Executors: many evaluations at once, on every GPU of a host (``local``) or a Ray cluster (``ray``).

An executor only schedules. Each evaluation is still ``kbv.pipeline.evaluate`` with its own fresh,
scrubbed reference and candidate worker processes; the executor decides where and when it runs and
hands every finished pair back to the driver, which alone writes the store::

    executor = make_executor("local", device="cuda", gpus="all")
    executor.map(pairs, protocol, timeout_s=None, on_record=store_it, should_skip=already_stored)

``run_pairs`` is ``kbv.batch.run_batch`` on an executor: same store keys, same resume semantics.
See docs/scale-out.md for the design.
"""

from __future__ import annotations

import abc
import argparse
import datetime as _dt
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kbv.candidates import Candidate
from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import Outcome, Record

Pair = tuple[Problem, Candidate]
OnRecord = Callable[[Problem, Candidate, "Record | None", "Exception | None"], None]
ShouldSkip = Callable[[Problem, Candidate], bool]

EXECUTORS = ("local", "ray")


class ExecutorError(RuntimeError):
    """The executor cannot run (bad --gpus, Ray missing or unreachable); the message says what to do."""


class Executor(abc.ABC):
    """Runs evaluations concurrently; ``on_record`` is always called in the caller's thread."""

    #: What a record of this executor's devices calls the device (set by ``probe``); used for the
    #: ``device`` field of records the executor writes itself (``crashed``).
    device_name: str = ""

    @abc.abstractmethod
    def map(self, pairs: Iterable[Pair], protocol: Protocol, *, timeout_s: float | None, on_record: OnRecord, should_skip: ShouldSkip) -> None:
        """Evaluate every pair not skipped; each finished pair goes to ``on_record`` exactly once.

        ``on_record(problem, candidate, record, None)`` for an evaluation (any outcome, ``crashed``
        included), ``on_record(problem, candidate, None, exc)`` for a harness error (the problem's
        reference failed, ...), exactly like the sequential path reports them.
        """

    @abc.abstractmethod
    def probe(self) -> dict[str, Any]:
        """``{"device_name", "torch"}`` as a worker on this executor's devices sees them."""

    def health(self) -> dict[str, Any]:
        """Per-slot state: evaluations, CUDA errors, slots taken out of the pool and why."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Throughput figures of the last ``map`` (busy and idle time per slot, compile results)."""
        return {}

    def close(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Release processes (and a Ray instance this executor started)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_executor(
    name: str,
    *,
    device: str | None = None,
    gpus: str | list[int] | None = None,
    workers: int | None = None,
    address: str | None = None,
    evaluate_fn: Callable[..., Record] | None = None,
) -> Executor:
    """``local`` or ``ray``. ``device`` is ``cpu`` or ``cuda`` (default: cuda when available)."""
    from kbv.pipeline import default_device, evaluate

    device = (device or default_device()).split(":", 1)[0]
    evaluate_fn = evaluate_fn or evaluate
    if name == "local":
        from kbv.execute._local import LocalExecutor

        return LocalExecutor(device=device, gpus=parse_gpus(gpus) if device == "cuda" else None, workers=workers, evaluate_fn=evaluate_fn)
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
            raise ExecutorError("CUDA_VISIBLE_DEVICES holds GPU UUIDs; give --gpus with indices instead") from exc
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ExecutorError("no CUDA GPU is visible: use --device cpu (with --workers N) or check the driver")
    return list(range(count))


def crashed_record(problem: Problem, candidate: Candidate, protocol: Protocol, device: dict[str, Any], message: str, attempts: list[str]) -> Record:
    """The record for a pair whose evaluation died twice (its process or node, not its candidate)."""
    return Record(
        problem=problem.ref(),
        candidate=candidate.ref(),
        protocol={"name": protocol.name, "version": protocol.version, "sha256": protocol.sha256(), "settings": protocol.to_dict()},
        device=device,
        outcome=Outcome.CRASHED.value,
        correct=False,
        error={"kind": "crashed", "message": message, "attempts": attempts},
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def is_harness_error(exc: BaseException) -> bool:
    """Errors the sequential path reports per pair and does not retry: they would fail again."""
    from kbv.pipeline import HarnessError
    from kbv.problems import ProblemError

    return isinstance(exc, (HarnessError, ProblemError))


# --- the command line -------------------------------------------------------------------------


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale-out")
    group.add_argument("--executor", choices=EXECUTORS, default=None, help="run pairs concurrently: local (every GPU of this host) or ray (a Ray cluster); default: one at a time")
    group.add_argument("--gpus", default=None, metavar="all|0,1,...", help="local executor: which GPUs get an evaluation slot (default: all)")
    group.add_argument("--workers", type=int, default=None, metavar="N", help="with --device cpu: concurrent evaluations (default: CPU count / 4)")
    group.add_argument("--address", default=None, metavar="RAY_ADDRESS", help="ray executor: an existing cluster (default: start a local Ray)")


def executor_from_args(args: argparse.Namespace) -> Executor | None:
    """The executor the flags ask for, or None for the sequential path."""
    name = getattr(args, "executor", None)
    if not name:
        for flag in ("gpus", "workers", "address"):
            if getattr(args, flag, None) is not None:
                raise ExecutorError(f"--{flag} needs --executor local or --executor ray")
        return None
    return make_executor(name, device=getattr(args, "device", None), gpus=args.gpus, workers=args.workers, address=args.address)


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
) -> Any:
    """``kbv.batch.run_batch`` on an executor: returns a ``BatchResult``; the store is written here only."""
    from rich.console import Console

    from kbv._version import __version__
    from kbv.batch import BatchResult, progress_bar, store_key

    console = console or Console(stderr=True)
    # What the records carry (evaluate applies the timeout; crashed records get it here), so what
    # the keys hash: a run with --timeout resumes without redoing its pairs.
    protocol = protocol.with_timeout(timeout_s)
    pairs = list(pairs)
    env = executor.probe() if store is not None else {}
    executor.device_name = env.get("device_name", executor.device_name)
    result = BatchResult(env=env)

    def key(problem: Problem, candidate: Candidate) -> tuple[str, ...]:
        return store_key(problem, candidate, protocol, env)  # the same key as run_batch: either resumes the other

    with progress_bar(console) as progress:
        task = progress.add_task("evaluating", total=len(pairs))

        def should_skip(problem: Problem, candidate: Candidate) -> bool:
            skip = store is not None and not force and store.has_record(key(problem, candidate))
            if skip:
                result.skipped += 1
                progress.advance(task)
            return skip

        def on_record(problem: Problem, candidate: Candidate, record: Record | None, exc: Exception | None) -> None:
            progress.update(task, description=f"{problem.name} x {candidate.label}/{candidate.path.name}")
            progress.advance(task)
            if record is None:
                result.errors.append((f"{problem.name} x {candidate.path.name}", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                return
            if record.outcome == Outcome.CRASHED.value and env:
                # Written by the driver, not a worker: give it the versions the key was probed
                # with, so that a crashed pair counts as finished work on resume.
                record.versions = {"kbv": __version__, "torch": env.get("torch", ""), **(record.versions or {})}
            result.keep(record, candidate, store, run_id, jsonl)

        executor.map(pairs, protocol, timeout_s=timeout_s, on_record=on_record, should_skip=should_skip)
    for slot, state in executor.health().get("removed", {}).items():
        console.print(f"[red]removed from the pool[/red] {slot}: {state}")
    return result


__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorError",
    "add_executor_arguments",
    "crashed_record",
    "executor_from_args",
    "make_executor",
    "parse_gpus",
    "run_pairs",
]
