"""The sequential executor: one evaluation at a time in this process, the default of ``kbv run``.

While one pair is evaluated, the next pairs' workers boot (``kbv.worker.Spares``), so no process
boots during a timed batch; each evaluation still gets a fresh candidate worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from kbv.execute._base import (
    Executor,
    OnRecord,
    OnStart,
    Pair,
    ShouldSkip,
    environment,
    is_harness_error,
    probe_hello,
)
from kbv.protocol import Protocol
from kbv.records import Record


class SequentialExecutor(Executor):
    def __init__(
        self, *, device: str | None = None, evaluate_fn: Callable[..., Record] | None = None
    ) -> None:
        from kbv.evaluation import default_device, evaluate

        self.device = device or default_device()
        self.evaluate_fn = evaluate_fn or evaluate
        # Prespawned workers serve kbv's own evaluation (or a wrapper of it that says it takes them).
        self.uses_spares = self.evaluate_fn is evaluate or getattr(self.evaluate_fn, "uses_spares", False)

    def probe(self) -> dict[str, Any]:
        from kbv.worker import visible_devices

        env = environment(self.device, probe_hello(self.device, visible_devices(self.device)))
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
        from kbv.evaluation import worker_specs
        from kbv.worker import SPARE_DEPTH, Spares

        pairs = list(pairs)
        # The workers the evaluations will ask for are those of the protocol they run, with its
        # timeout (a worker's budget is part of what a spare must match): spares made for the
        # protocol without it were never taken, and every candidate worker booted cold (~4 s an
        # evaluation on the H200) beside a growing heap of idle ones.
        protocol = protocol.with_timeout(timeout_s)
        todo = [not should_skip(problem, candidate) for problem, candidate in pairs]
        spares = (
            Spares(SPARE_DEPTH["cuda" if self.device.startswith("cuda") else "cpu"])
            if self.uses_spares
            else None
        )
        with spares or contextlib.nullcontext():
            for index, (problem, candidate) in enumerate(pairs):
                if on_start is not None:
                    on_start(problem, candidate)
                # Asked again at the pair's turn: another kbv may have stored it meanwhile.
                if not todo[index] or should_skip(problem, candidate):
                    continue
                extra: dict[str, Any] = {}
                if spares is not None:
                    upcoming = [pairs[j] for j in range(index + 1, len(pairs)) if todo[j]][: spares.depth]
                    spares.expect([list(worker_specs(p, c, protocol, self.device)) for p, c in upcoming])
                    extra["spares"] = spares
                try:
                    record = self.evaluate_fn(
                        problem, candidate, protocol, self.device, timeout_s=timeout_s, **extra
                    )
                except Exception as exc:
                    if not is_harness_error(exc):
                        raise
                    on_record(problem, candidate, None, exc)
                    continue
                on_record(problem, candidate, record, None)
