"""What every executor is: the interface, the pair it is given, the records it writes itself.

``kbv.execute`` builds executors and drives them (:func:`kbv.execute.run_pairs`); the executors
(``_sequential``, ``_local``, ``_ray``) import only this module of the package, so the package has no
import circle.
"""

from __future__ import annotations

import abc
import datetime as _dt
from collections.abc import Callable, Iterable
from typing import Any

from kbv.candidates import Candidate
from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import Outcome, Record, error_summary, protocol_section

Pair = tuple[Problem, Candidate]
OnStart = Callable[[Problem, Candidate], None]
OnRecord = Callable[[Problem, Candidate, "Record | None", "Exception | None"], None]
ShouldSkip = Callable[[Problem, Candidate], bool]


class ExecutorError(RuntimeError):
    """The executor cannot run (bad --gpus, Ray missing or unreachable); the message says what to do."""


class Executor(abc.ABC):
    """Runs evaluations concurrently; ``on_record`` is always called in the caller's thread."""

    #: What a record of this executor's devices calls the device (set by ``probe``); used for the
    #: ``device`` field of records the executor writes itself (``crashed``).
    device_name: str = ""

    @abc.abstractmethod
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
        """Evaluate every pair not skipped; each finished pair goes to ``on_record`` exactly once.

        ``should_skip`` may be asked more than once for a pair (the sequential executor asks again
        when the pair's turn comes); ``on_start``, where an executor calls it, says which pair
        begins, in the caller's thread.

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


def crashed_record(
    problem: Problem,
    candidate: Candidate,
    protocol: Protocol,
    device: dict[str, Any],
    message: str,
    attempts: list[str],
) -> Record:
    """The record for a pair whose evaluation died twice (its process or node, not its candidate)."""
    return Record(
        problem=problem.ref(),
        candidate=candidate.ref(),
        protocol=protocol_section(protocol),
        device=device,
        outcome=Outcome.CRASHED,
        correct=False,
        error={
            "kind": "crashed",
            "summary": error_summary("crashed", message),
            "message": message,
            "attempts": attempts,
        },
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def is_harness_error(exc: BaseException) -> bool:
    """Errors the sequential path reports per pair and does not retry: they would fail again."""
    from kbv.evaluation import HarnessError
    from kbv.problems import ProblemError

    return isinstance(exc, (HarnessError, ProblemError))


def probe_hello(device: str, visible: str | None = None) -> dict[str, Any]:
    """The hello of a probe worker on ``device`` (torch version, device name and capability), as
    the worker sent it (a plain dict: it travels to other processes and hosts)."""
    from kbv.worker import Worker, WorkerSpec

    with Worker(
        WorkerSpec(build_key="probe", device=device, role="probe", visible_devices=visible, budget_s=120)
    ) as worker:
        return worker.start().to_json()


def environment(device: str, hello: dict[str, Any]) -> dict[str, Any]:
    """The environment half of every resume key: ``{"device_name", "torch"}`` as records will say them."""
    from kbv.devices import device_name

    return {"device_name": device_name(device, hello), "torch": hello.get("torch", "")}
