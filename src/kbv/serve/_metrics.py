"""Prometheus metrics of ``kbv serve`` (``/metrics``), in a registry of the server's own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kbv.serve._queue import RequestQueue


class Metrics:
    def __init__(self, requests: RequestQueue, runner: Any) -> None:
        self.registry = CollectorRegistry()
        self._runner = runner
        Gauge(
            "kbv_serve_queue_depth", "Accepted requests not yet evaluating", registry=self.registry
        ).set_function(lambda: requests.counts()["queued"])
        Gauge(
            "kbv_serve_in_flight", "Requests handed to the evaluator, not yet stored", registry=self.registry
        ).set_function(lambda: len(runner.in_flight))
        Gauge(
            "kbv_serve_evaluations_per_second",
            "Evaluations finished per second over the last minute",
            registry=self.registry,
        ).set_function(lambda: runner.throughput.per_second())
        Gauge(
            "kbv_serve_compile_backlog",
            "Requests in flight whose candidate builds a C++/CUDA extension (the compile stage's work)",
            registry=self.registry,
        ).set_function(self._compile_backlog)
        Gauge(
            "kbv_serve_device_busy_share",
            "Share of the last minute the evaluation slots (GPUs, or CPU workers) spent evaluating",
            registry=self.registry,
        ).set_function(lambda: runner.throughput.busy_share())
        self.outcomes = Counter(
            "kbv_serve_evaluations", "Finished evaluations by outcome", ["outcome"], registry=self.registry
        )
        self.accepted_total = Counter(
            "kbv_serve_accepted", "Requests accepted into the queue", registry=self.registry
        )
        self.rejected_total = Counter(
            "kbv_serve_rejected", "Requests refused, by HTTP status", ["status"], registry=self.registry
        )
        self.latency = Histogram(
            "kbv_serve_latency_seconds",
            "From a request's claim to its stored record",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )

    def _compile_backlog(self) -> int:
        from kbv.worker.builds import needs_build

        return sum(1 for row in self._runner.in_flight if needs_build(row["source"]))

    def accepted(self, count: int) -> None:
        self.accepted_total.inc(count)

    def rejected(self, status: int) -> None:
        self.rejected_total.labels(status=str(status)).inc()

    def finished(self, outcome: str, seconds: float) -> None:
        self.outcomes.labels(outcome=outcome).inc()
        self.latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
