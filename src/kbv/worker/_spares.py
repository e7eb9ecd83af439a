"""Workers started ahead of the evaluations that will use them (``Spares``), and the stop signals
kbv did not send, found across workers, spares and the fork server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from kbv.worker import _forkserver
from kbv.worker._process import Worker
from kbv.worker._spec import WorkerSpec


def _spec_key(spec: WorkerSpec) -> tuple[Any, ...]:
    return (
        spec.build_key,
        spec.device,
        spec.visible_devices,
        spec.role,
        spec.budget_s,
        tuple(sorted(spec.extra_env.items())),
        spec.limits,
        tuple(spec.readable),
        spec.warm_probes,
    )


def stopped_processes(workers: Iterable[Worker], spares: Spares | None = None) -> list[dict[str, Any]]:
    """kbv's processes found stopped by a signal kbv did not send: ``workers`` (those not paused by
    kbv now), ``spares``' workers (closed) and the fork server (resumed). Evidence for
    ``signalled_process``, each ``{pid, role, state}``."""
    found = [dict(w.stopped or {}) for w in workers if w.alive() and w.found_stopped()]
    if spares is not None:
        found.extend(spares.take_stops())
    return found + _forkserver.take_stops()


class Spares:
    """Workers started ahead of the evaluations that will use them, so that start-up (Python, torch,
    the CUDA context) is off the critical path. A batch names the workers of the next pairs; each
    evaluation, once its own are launched, launches those of the next ``depth`` pairs that are not
    launched yet, so a spare has about ``depth`` evaluations to boot in. (They were launched in
    waves, ``depth`` pairs at once when the next pair's were not up: a short evaluation then waited
    for the wave it had just launched. On the H200 the audit's ``verified`` batches, mostly mutants
    that fail in 1.5-4 s, paid 2-5 s of ``boot`` every few evaluations.) A booting process must
    never share the GPU or the CPU with a timed batch: the evaluation stops every spare that may
    still be booting for its timing phase (:meth:`quiet`) and lets them go on after it, so their
    boot overlaps the work before and after the timing instead of being waited for. (It was waited
    for: on the H200 a wave of four pairs' ``verified`` workers, each warming the profiler while it
    boots, held two evaluations of 25 for 5 s each.)

    A spare has loaded no problem and no candidate; each evaluation still gets fresh workers."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = max(1, depth)
        self._launched: dict[tuple[Any, ...], list[Worker]] = {}
        self._next: list[list[WorkerSpec]] = []
        self._stops: list[dict[str, Any]] = []

    def __enter__(self) -> Spares:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expect(self, pairs: list[list[WorkerSpec]]) -> None:
        """The workers of the next evaluations, in order, one list per evaluation (launched by
        :meth:`launch_expected`; only the first ``depth`` count)."""
        self._next = [list(specs) for specs in pairs[: self.depth]]

    def take(self, spec: WorkerSpec) -> Worker:
        """A launched spare matching ``spec`` that is still alive, or a new (not yet launched)
        worker: a spare that died while booting is closed, and the evaluation starts its own."""
        ready = self._launched.get(_spec_key(spec), [])
        while ready:
            worker = ready.pop(0)
            if worker.alive() and not worker.found_stopped():
                return worker
            worker.close()  # dead, or stopped by something kbv did not start: never handed on
        return Worker(spec)

    def take_stops(self) -> list[dict[str, Any]]:
        """Spares found stopped by a signal kbv did not send, since the last call (each is closed:
        a spare kbv did not stop is never stopped between evaluations)."""
        for workers in self._launched.values():
            for worker in list(workers):
                if worker.alive() and worker.found_stopped():
                    self._stops.append(dict(worker.stopped or {}))
                    workers.remove(worker)
                    worker.close()
        stops, self._stops = self._stops, []
        return stops

    def launch_expected(self) -> None:
        """Launch every worker of the next ``depth`` evaluations that is not launched yet (in steady
        state one pair's). Spares that none of the next evaluations wants (their pair was skipped)
        are closed first: an idle worker holds a CUDA context and host memory until the batch ends."""
        self._close_unwanted()
        wanted: dict[tuple[Any, ...], int] = {}
        for specs in self._next:
            for spec in specs:
                key = _spec_key(spec)
                wanted[key] = wanted.get(key, 0) + 1
                if len(self._launched.get(key, [])) < wanted[key]:
                    worker = Worker(spec)
                    worker.launch()
                    self._launched.setdefault(key, []).append(worker)
        self._next = []

    def _close_unwanted(self) -> None:
        wanted: dict[tuple[Any, ...], int] = {}
        for specs in self._next:
            for spec in specs:
                wanted[_spec_key(spec)] = wanted.get(_spec_key(spec), 0) + 1
        for key, workers in self._launched.items():
            while len(workers) > wanted.get(key, 0):
                workers.pop().close()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Every launched spare whose greeting has not been read (it may still be booting) is
        stopped for the duration (:meth:`Worker.paused`, which returns once each has stopped) and
        goes on afterwards. A stopped process queues no GPU work and takes no CPU time, like a spare
        that has booted and waits for its first request."""
        with contextlib.ExitStack() as stack:
            for workers in self._launched.values():
                for worker in workers:
                    if worker.hello is None:
                        stack.enter_context(worker.paused())
            yield

    def members(self) -> list[int]:
        """The live processes of every launched spare (what they hold of a GPU is counted by pid)."""
        return sorted({pid for workers in self._launched.values() for w in workers for pid in w.members()})

    def close(self) -> None:
        for workers in self._launched.values():
            for worker in workers:
                worker.close()
        self._launched.clear()


#: Pairs whose workers are kept launched ahead: a GPU host has the cores and the memory for
#: several idle or booting workers (each holds a CUDA context, ~0.6 GB of device memory), the 2-core
#: CPU machine does not.
SPARE_DEPTH = {"cuda": 4, "cpu": 1}
