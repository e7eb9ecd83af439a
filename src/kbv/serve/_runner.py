"""The service's worker side: queued requests to the Evaluator, finished records to the store.

One thread owns the store connection. It claims queued requests (as many as keep the executor
busy, in one batch, so candidates of one problem share the reference's work), hands them to the
:class:`kbv.Evaluator`, and writes each record with its request's ``done`` mark in one transaction.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbv._evaluator import Evaluator
from kbv.protocol import Protocol
from kbv.records import Record
from kbv.serve._queue import RequestQueue

WINDOW_S = 60.0  # what "per second" and "busy share" are averaged over


@dataclass
class Throughput:
    """Finished evaluations in the last minute: rate, outcomes, busy time of the slots."""

    slots: int
    finished: deque[tuple[float, float]] = field(default_factory=deque)  # (finished at, seconds)
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str, seconds: float) -> None:
        self.finished.append((time.monotonic(), seconds))
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self._trim()

    def _trim(self) -> None:
        while self.finished and self.finished[0][0] < time.monotonic() - WINDOW_S:
            self.finished.popleft()

    def per_second(self) -> float:
        """Over the window, or over the span of its finished evaluations while they cover less of
        it (a server just started would otherwise report a fraction of its rate)."""
        self._trim()
        if len(self.finished) >= 2:
            span = self.finished[-1][0] - self.finished[0][0]
            return (
                (len(self.finished) - 1) / max(span, 1.0)
                if span < WINDOW_S
                else len(self.finished) / WINDOW_S
            )
        return len(self.finished) / WINDOW_S

    def busy_share(self) -> float:
        """Share of the window the evaluation slots spent evaluating (finished evaluations only)."""
        self._trim()
        return min(1.0, sum(s for _, s in self.finished) / (WINDOW_S * max(1, self.slots)))


class Runner:
    def __init__(
        self,
        evaluator: Evaluator,
        requests: RequestQueue,
        db: Path,
        *,
        in_flight: int,
        protocols: dict[str, Protocol],
        on_finished: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        self.evaluator = evaluator
        self.requests = requests
        self.db = db
        self.limit = in_flight
        self.protocols = protocols  # the names requests may give, and what each is
        self.on_finished = on_finished
        self.throughput = Throughput(slots=max(1, len(evaluator.health().get("slots", {})) or 1))
        self._done: queue.Queue[tuple[dict[str, Any], Record | None, BaseException | None]] = queue.Queue()
        self._running: dict[str, dict[str, Any]] = {}
        self._wake = threading.Event()
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kbv-serve-runner", daemon=True)

    @property
    def in_flight(self) -> list[dict[str, Any]]:
        return list(self._running.values())

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Claim nothing more; wait until the evaluations in flight are stored. Whatever is still
        queued stays queued for the next start. True when everything in flight finished."""
        self._draining.set()
        self._wake.set()
        finished = self._stopped.wait(timeout_s)
        return finished

    def _loop(self) -> None:
        from kbv.store import Store

        with Store(self.db) as store:
            while True:
                self._store_finished(store)
                if self._draining.is_set() and not self._running:
                    break
                if not self._draining.is_set():
                    self._claim()
                self._wake.wait(0.2)
                self._wake.clear()
        self._stopped.set()

    def _claim(self) -> None:
        claimed = self.requests.claim(self.limit - len(self._running))
        groups: dict[tuple[str, str | None, float | None], list[tuple[dict[str, Any], Any]]] = {}
        for row in claimed:
            self._running[row["id"]] = {**row, "claimed_at": time.monotonic()}
            try:
                # The name resolved in the server's tree only, the source always taken as text
                # (never as a path on the server's disk).
                pair = (
                    self.evaluator.problem_path(row["problem"]),
                    self.evaluator.candidate_text(row["source"], label=row["label"] or "serve"),
                )
            except Exception as exc:  # checked when accepted; the problem tree changed since
                self._done.put((row, None, exc))
                continue
            groups.setdefault((row["protocol"], row["precision"], row["timeout_s"]), []).append((row, pair))
        for (protocol, precision, timeout_s), members in groups.items():
            try:
                futures = self.evaluator.submit_many(
                    [pair for _, pair in members],
                    protocol=self.protocols[protocol],
                    precision=precision,
                    timeout_s=timeout_s,
                )
            except Exception as exc:  # a problem that no longer imports: each request says so
                for row, _ in members:
                    self._done.put((row, None, exc))
                continue
            for (row, _), future in zip(members, futures):
                future.add_done_callback(self._on_done(row))

    def _on_done(self, row: dict[str, Any]) -> Callable[[Future[Record]], None]:
        return lambda future: self._finished(row, future)

    def _finished(self, row: dict[str, Any], future: Future[Record]) -> None:
        if future.cancelled():  # a drain that timed out: the request stays running, queued again at start
            return
        exc = future.exception()
        self._done.put((row, None if exc else future.result(), exc))
        self._wake.set()

    def _store_finished(self, store: Any) -> None:
        while True:
            try:
                row, record, exc = self._done.get_nowait()
            except queue.Empty:
                return
            row = self._running.pop(row["id"], row)  # with its claim time
            if record is None:
                message = str(exc).splitlines()[0] if exc and str(exc) else type(exc).__name__
                self.requests.mark_error(row["id"], f"harness error: {message}")
                outcome = "harness_error"
            else:
                outcome = str(getattr(record.outcome, "value", record.outcome))
                store.add_record(
                    record,
                    label=row["label"] or "serve",
                    source=row["source"],
                    also=lambda conn, record_id, row=row, outcome=outcome: RequestQueue.mark_done(
                        conn, row["id"], record_id, outcome
                    ),
                )
                self.throughput.add(outcome, float((record.phases_s or {}).get("total", 0.0)))
            if self.on_finished is not None:
                self.on_finished(row, outcome)
