"""The timing recipe, run inside the worker: clocks, timers, the L2 flush, the timed loop, and the
identity snapshot of every timing-relevant function.

The candidate worker runs hostile code. It constructs a timer *before* importing the candidate,
so the timer holds references to the real ``time.perf_counter``, ``torch.cuda.Event``,
``torch.cuda.synchronize`` ... and a later monkey-patch of those names does not reach it. It also
takes :func:`snapshot_identities` then, and :func:`verify_identities` afterwards reports which
names the candidate replaced. None of this stops a determined candidate (it shares the process and
can find the timer with ``gc``); it raises the bar, and the real defence is in the trusted parent,
which never imports candidate code: every statistic is computed there from the raw samples, and
each timed batch is bracketed by the parent's own clock (``kbv.statistics``).

The recipe keeps raw per-call samples (a :class:`~kbv.samples.Measurement`); statistics are
derived later. Everything is testable on the CPU: a :class:`Clock` is injectable, and
:class:`CpuTimer` uses it as both the wall and the device clock.

Import discipline: stdlib, torch, :mod:`kbv.protocol` and :mod:`kbv.samples` only (the worker
imports this module before the candidate), and nothing from ``torch.cuda`` is touched at import
time.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kbv.protocol import TimingSettings
from kbv.samples import Measurement, recipe_name

# --------------------------------------------------------------------------------------------
# Named thresholds. Each is written into a warning's meaning; change them here, nowhere else.
# --------------------------------------------------------------------------------------------

#: Warm-up stops after this many calls even if the time budget is not spent (guards against a
#: clock that does not advance).
MAX_WARMUP_CALLS = 100_000
#: If ``L2_cache_size`` is missing from the device properties, assume this many bytes of L2.
FALLBACK_L2_BYTES = 50 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# Clocks and timers
# --------------------------------------------------------------------------------------------


class Clock(ABC):
    """A monotonic wall clock in seconds. Tests inject a fake one."""

    @abstractmethod
    def now(self) -> float: ...


class WallClock(Clock):
    """``time.perf_counter``, as it was when this clock was constructed."""

    def __init__(self) -> None:
        self._perf_counter = time.perf_counter

    def now(self) -> float:
        return self._perf_counter()


class DeviceTimer(ABC):
    """A wall clock plus a device timer, with a device-wide synchronisation.

    The recipe uses it like this for every timed call::

        start, end = timer.new_marks()          # allocated outside the timed region
        timer.synchronize(); w0 = timer.now()
        timer.record(start); fn(); timer.record(end)
        timer.synchronize(); w1 = timer.now()
        device_ms = timer.elapsed_ms(start, end); wall_ms = (w1 - w0) * 1e3
    """

    #: Short name written into measurements ("cpu", "cuda-events").
    name: str = "timer"

    @abstractmethod
    def now(self) -> float:
        """Wall-clock seconds (monotonic)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until all work on the device (every stream) has finished."""

    @abstractmethod
    def new_marks(self) -> tuple[Any, Any]:
        """A fresh (start, end) pair of device-time markers."""

    @abstractmethod
    def record(self, mark: Any) -> None:
        """Record ``mark`` now, on the device's timed stream."""

    @abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Device time between two recorded markers, in ms; call after :meth:`synchronize`."""

    def capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        """Capture ``fn`` into a replayable graph and return the replay; CUDA only."""
        raise NotImplementedError(
            f"the cuda_graph timing regime needs a CUDA timer, not {self.name!r}; "
            "set timing.cuda_graph = false or run on a GPU"
        )


@dataclass
class _CpuMark:
    t: float | None = None


class CpuTimer(DeviceTimer):
    """On the CPU the device timer is the wall clock; work is synchronous, so syncing is a no-op."""

    name = "cpu"

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock if clock is not None else WallClock()

    def now(self) -> float:
        return self._clock.now()

    def synchronize(self) -> None:
        return None

    def new_marks(self) -> tuple[_CpuMark, _CpuMark]:
        return _CpuMark(), _CpuMark()

    def record(self, mark: _CpuMark) -> None:
        mark.t = self._clock.now()

    def elapsed_ms(self, start: _CpuMark, end: _CpuMark) -> float:
        if start.t is None or end.t is None:
            raise RuntimeError("elapsed_ms needs two recorded marks")
        return (end.t - start.t) * 1e3


class CudaTimer(DeviceTimer):
    """CUDA events on one stream for device time; ``torch.cuda.synchronize`` plus the wall clock
    for the device-wide time.

    Every torch function it calls is looked up once, here. Construct it before the candidate is
    imported. The events are recorded on the stream that was current at construction (or the
    ``stream`` given), not on whatever stream is current later, so a candidate that switches the
    current stream and leaves it switched does not move the harness's events.
    """

    name = "cuda-events"

    def __init__(
        self, device: torch.device | str | int | None = None, stream: Any = None, clock: Clock | None = None
    ) -> None:
        cuda = torch.cuda
        if not cuda.is_available():
            raise RuntimeError("CudaTimer needs a CUDA device; use CpuTimer on the CPU")
        self.device = torch.device("cuda", cuda.current_device()) if device is None else torch.device(device)
        self._clock = clock if clock is not None else WallClock()
        self._event_cls = cuda.Event
        self._record = cuda.Event.record
        self._elapsed = cuda.Event.elapsed_time
        self._synchronize = cuda.synchronize
        self._graph_cls = cuda.CUDAGraph
        self._graph_ctx = cuda.graph
        self._stream_ctx = cuda.stream
        self._synchronize(self.device)  # initialise CUDA now, not inside the first timed call
        self._stream = stream if stream is not None else cuda.current_stream(self.device)

    def now(self) -> float:
        return self._clock.now()

    def synchronize(self) -> None:
        self._synchronize(self.device)

    def new_marks(self) -> tuple[Any, Any]:
        return self._event_cls(enable_timing=True), self._event_cls(enable_timing=True)

    def record(self, mark: Any) -> None:
        self._record(mark, self._stream)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._elapsed(start, end))

    def capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        """Capture one call of ``fn`` into a CUDA graph; replays run on the timed stream.

        ``fn`` must have run eagerly before (the recipe's warm-up does that), so lazy
        initialisation (cuBLAS handles, allocator growth, autotuning) is not captured.
        """
        graph = self._graph_cls()
        self.synchronize()
        with self._graph_ctx(graph):
            fn()
        self.synchronize()
        stream, stream_ctx = self._stream, self._stream_ctx

        def replay() -> None:
            with stream_ctx(stream):
                graph.replay()

        return replay


def make_timer(device: torch.device | str | int | None = None) -> DeviceTimer:
    """A :class:`CudaTimer` for a CUDA device, else a :class:`CpuTimer`."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaTimer(device)
    return CpuTimer()


def make_l2_flush(device: torch.device | str | int) -> Callable[[], None] | None:
    """A function that evicts the L2 cache by zeroing a buffer of twice its size; None on CPU.

    Call it outside the timed region; the recipe synchronises after it, so its kernel never
    overlaps a timed call. ``zero_`` is bound now, before the candidate can patch it.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(dev)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
    buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=dev)
    zero = torch.Tensor.zero_

    def flush() -> None:
        zero(buffer)

    return flush


# --------------------------------------------------------------------------------------------
# Identity snapshot of the timing functions
# --------------------------------------------------------------------------------------------

_TIME_NAMES = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "sleep")
_CUDA_NAMES = (
    "Event",
    "synchronize",
    "current_stream",
    "Stream",
    "stream",
    "graph",
    "CUDAGraph",
    "device",
    "_lazy_init",
)
_EVENT_METHODS = ("record", "elapsed_time", "synchronize", "query", "wait")
# The statistics are not here: the parent computes them (kbv.statistics), out of the candidate's reach.
_OWN_NAMES = ("measure", "make_l2_flush", "Measurement", "CudaTimer", "CpuTimer", "WallClock")
# Holding the objects keeps their ids from being reused by a replacement after they are freed.
_PINNED: list[object] = []


def _identity_targets() -> dict[str, object]:
    targets: dict[str, object] = {}
    for name in _TIME_NAMES:
        targets[f"time.{name}"] = getattr(time, name, None)
    cuda = torch.cuda
    for name in _CUDA_NAMES:
        targets[f"torch.cuda.{name}"] = getattr(cuda, name, None)
    event_cls = getattr(cuda, "Event", None)
    for name in _EVENT_METHODS:
        targets[f"torch.cuda.Event.{name}"] = getattr(event_cls, name, None)
    targets["torch._C._cuda_synchronize"] = getattr(torch._C, "_cuda_synchronize", None)
    targets["torch.Tensor.zero_"] = torch.Tensor.zero_
    own = sys.modules[__name__]
    for name in _OWN_NAMES:
        targets[f"{__name__}.{name}"] = getattr(own, name, None)
    return targets


def snapshot_identities() -> dict[str, int]:
    """``id()`` of every timing-relevant function, keyed by dotted name (0 = absent).

    Take it in the worker before importing the candidate; compare with :func:`verify_identities`.
    """
    targets = _identity_targets()
    _PINNED.extend(obj for obj in targets.values() if obj is not None)
    return {name: (0 if obj is None else id(obj)) for name, obj in targets.items()}


def verify_identities(snapshot: dict[str, int]) -> list[str]:
    """Names whose function was replaced (or added or removed) since ``snapshot`` was taken."""
    current = {name: (0 if obj is None else id(obj)) for name, obj in _identity_targets().items()}
    names = set(snapshot) | set(current)
    return sorted(name for name in names if snapshot.get(name) != current.get(name))


# --------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------


def measure(
    fn: Callable[[int], object],
    *,
    settings: TimingSettings,
    n_input_sets: int,
    timer: DeviceTimer,
    flush: Callable[[], object] | None = None,
    on_sample: Callable[[int, float, float], object] | None = None,
    unseen: Callable[[int], Callable[[], object]] | None = None,
) -> Measurement:
    """Time ``fn(set_index)`` under ``settings``; return the raw samples.

    1. Warm-up: calls rotate over the input sets until at least ``settings.warmup_calls`` calls
       were made AND ``settings.warmup_seconds`` have passed (capped at :data:`MAX_WARMUP_CALLS`).
    2. With ``settings.cuda_graph``, the eager warm-up covers every input set at least once; then
       one call per set is captured into a CUDA graph, and the graphs' replays are warmed up the
       same way and timed instead of ``fn`` (regime ``<recipe>+graph``); ``warmup_calls`` in the
       result counts both warm-ups.
    3. Timed calls: up to ``settings.repeats``, call ``i`` on set ``i % n_input_sets``; no new call
       starts once the timed phase has used ``settings.max_seconds`` (at least one call is timed).
       Before each, outside the timed region, ``flush()`` runs when ``settings.l2_flush`` is set
       and a flush was supplied, and the device is synchronised. Each call yields a device-timer
       sample (events on the timed stream) and a wall sample (device-wide sync before and after,
       wall clock around); the wall one also sees work on other streams.

    With ``unseen`` (``settings.unseen_inputs``), timed call ``i`` runs ``unseen(i)()`` instead:
    ``unseen(i)`` makes the call's own input set, which no earlier call saw, before the flush and
    outside the timed region, and returns the call to time; the warm-up still rotates over the
    ``n_input_sets`` sets ``fn`` takes, which are never timed. A CUDA graph replays the inputs it
    was captured with, so the two do not go together.

    ``on_sample(i, device_ms, wall_ms)`` is called after each timed call (outside the region).
    Exceptions from ``fn`` propagate: a failing candidate is the caller's outcome to record.
    """
    if unseen is not None and settings.cuda_graph:
        raise ValueError(
            "timing.cuda_graph replays the inputs it captured, so every timed call cannot get unseen "
            "inputs: set timing.unseen_inputs = false for the graph regime"
        )
    if n_input_sets < 1:
        raise ValueError(f"n_input_sets must be >= 1, not {n_input_sets}")
    if settings.repeats < 1:
        raise ValueError(f"timing.repeats must be >= 1, not {settings.repeats}")
    started = timer.now()
    call = fn
    if settings.cuda_graph:
        # Every set runs eagerly at least once before its capture (lazy init must not be captured).
        warmed = _warm_up(fn, settings, n_input_sets, timer, min_calls=n_input_sets)
        replays = [timer.capture(_bind(fn, k)) for k in range(n_input_sets)]

        def call(k: int) -> object:
            return replays[k]()

        warmed += _warm_up(call, settings, n_input_sets, timer)
    else:
        warmed = _warm_up(fn, settings, n_input_sets, timer)
    use_flush = flush if settings.l2_flush else None
    prepare = unseen if unseen is not None else _rotation(call, n_input_sets)
    device_ms, wall_ms = _timed_calls(prepare, settings, timer, use_flush, on_sample)
    return Measurement(
        recipe=recipe_name(settings),
        device_ms=device_ms,
        wall_ms=wall_ms,
        warmup_calls=warmed,
        n_input_sets=n_input_sets,
        l2_flush=use_flush is not None,
        total_wall_s=timer.now() - started,
        timer=timer.name,
    )


def _bind(fn: Callable[[int], object], k: int) -> Callable[[], object]:
    return lambda: fn(k)


def _rotation(fn: Callable[[int], object], n_input_sets: int) -> Callable[[int], Callable[[], object]]:
    """Timed call ``i`` on kept set ``i % n_input_sets``."""
    return lambda i: _bind(fn, i % n_input_sets)


def _warm_up(
    fn: Callable[[int], object],
    settings: TimingSettings,
    n_input_sets: int,
    timer: DeviceTimer,
    min_calls: int = 0,
) -> int:
    start = timer.now()
    calls = 0
    at_least = max(settings.warmup_calls, min_calls)
    while calls < MAX_WARMUP_CALLS:
        if calls >= at_least and timer.now() - start >= settings.warmup_seconds:
            break
        fn(calls % n_input_sets)
        calls += 1
        timer.synchronize()  # so the time budget counts finished work, not queued launches
    return calls


def _timed_calls(
    prepare: Callable[[int], Callable[[], object]],
    settings: TimingSettings,
    timer: DeviceTimer,
    flush: Callable[[], object] | None,
    on_sample: Callable[[int, float, float], object] | None,
) -> tuple[list[float], list[float]]:
    device_ms: list[float] = []
    wall_ms: list[float] = []
    phase_start = timer.now()
    for i in range(settings.repeats):
        if i > 0 and timer.now() - phase_start >= settings.max_seconds:
            break
        run = prepare(i)  # the call's inputs, made outside the timed region (before the flush)
        start, end = timer.new_marks()
        if flush is not None:
            flush()
        timer.synchronize()
        w0 = timer.now()
        timer.record(start)
        run()
        timer.record(end)
        timer.synchronize()
        w1 = timer.now()
        device_ms.append(timer.elapsed_ms(start, end))
        wall_ms.append((w1 - w0) * 1e3)
        if on_sample is not None:
            on_sample(i, device_ms[-1], wall_ms[-1])
        del run  # an unseen set goes before the next is made: one set in memory at a time, not two
    return device_ms, wall_ms


# --------------------------------------------------------------------------------------------
# Statistics (pure functions over raw samples; run them in the trusted parent)
