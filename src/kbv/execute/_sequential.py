"""The sequential executor: one evaluation at a time in this process, the default of ``kbv run``.

While one pair is evaluated, the next pairs' workers boot (``kbv.worker.Spares``), so no process
boots during a timed batch; each evaluation still gets a fresh candidate worker. A caller that runs
one map after another (``kbv.Evaluator``, the service) keeps the spares between maps and names the
pairs waiting for its next one, so a map's first pair finds its workers booted too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from kbv.worker import Spares

#: Pairs waiting for a later map, first first, each with the protocol (and timeout) it will run under.
Upcoming = Callable[[], list[tuple[Pair, Protocol]]]


class SequentialExecutor(Executor):
    def __init__(
        self, *, device: str | None = None, evaluate_fn: Callable[..., Record] | None = None
    ) -> None:
        from kbv.evaluation import default_device, evaluate

        self.device = device or default_device()
        self.evaluate_fn = evaluate_fn or evaluate
        # Prespawned workers serve kbv's own evaluation (or a wrapper of it that says it takes them).
        self.uses_spares = self.evaluate_fn is evaluate or getattr(self.evaluate_fn, "uses_spares", False)
        # Spares kept from one map to the next (set by kbv.Evaluator): each batch of the service
        # began with a cold boot of its first pair's workers (4-7 s on an H100, six times in 33
        # evaluations, 2026-12-07), as a map's spares were closed at its end.
        self.keep_spares = False
        self._kept: Spares | None = None

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            self._kept = None

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
        upcoming: Upcoming | None = None,
    ) -> None:
        """:meth:`Executor.map`; ``upcoming`` names the pairs of the caller's next maps, whose workers
        boot ahead where this map has fewer than the spares' depth left (with ``keep_spares``)."""
        from kbv.evaluation import worker_specs

        pairs = list(pairs)
        # The workers the evaluations will ask for are those of the protocol they run, with its
        # timeout (a worker's budget is part of what a spare must match): spares made for the
        # protocol without it were never taken, and every candidate worker booted cold (~4 s an
        # evaluation on the H200) beside a growing heap of idle ones.
        protocol = protocol.with_timeout(timeout_s)
        todo = [not should_skip(problem, candidate) for problem, candidate in pairs]
        with self._spares() as spares:
            for index, (problem, candidate) in enumerate(pairs):
                if on_start is not None:
                    on_start(problem, candidate)
                # Asked again at the pair's turn: another kbv may have stored it meanwhile.
                if not todo[index] or should_skip(problem, candidate):
                    continue
                extra: dict[str, Any] = {}
                if spares is not None:
                    ahead = [(pairs[j], protocol) for j in range(index + 1, len(pairs)) if todo[j]]
                    if len(ahead) < spares.depth and upcoming is not None and self.keep_spares:
                        ahead += upcoming()
                    spares.expect(
                        [
                            list(worker_specs(p, c, run_as, self.device))
                            for (p, c), run_as in ahead[: spares.depth]
                        ]
                    )
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

    @contextlib.contextmanager
    def _spares(self) -> Iterator[Spares | None]:
        """The map's spares: none where the evaluation takes none, the kept ones (made once) with
        ``keep_spares``, else a set of its own, closed when the map ends."""
        from kbv.worker import SPARE_DEPTH, Spares

        if not self.uses_spares:
            yield None
            return
        depth = SPARE_DEPTH["cuda" if self.device.startswith("cuda") else "cpu"]
        if not self.keep_spares:
            with Spares(depth) as spares:
                yield spares
            return
        if self._kept is None:
            self._kept = Spares(depth)
        yield self._kept
