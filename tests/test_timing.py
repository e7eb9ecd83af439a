"""Tests for the timing recipe (kbv.child.timing) and its statistics (kbv.statistics): the recipe
runs against a fake clock, so every count and order is exact."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch

from kbv import statistics
from kbv.baseline_cache import baseline_cache_key
from kbv.child import timing
from kbv.child.timing import (
    Clock,
    CpuTimer,
    make_l2_flush,
    make_timer,
    measure,
    snapshot_identities,
    verify_identities,
)
from kbv.protocol import TimingSettings
from kbv.samples import Measurement
from kbv.statistics import (
    bracket_check,
    paired_speedup,
    quality_warnings,
    summarize,
    wall_vs_device_disagreement,
)

# Durations are binary fractions, so sums on the fake clock are exact.
CALL_S = 1 / 64  # 15.625 ms
FLUSH_S = 1 / 8

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class FakeClock(Clock):
    """Time moves only when someone advances it."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class LoggingTimer(CpuTimer):
    """A CPU timer over a fake clock that logs the harness's timer operations in order."""

    def __init__(self, clock: FakeClock, log: list[str]) -> None:
        super().__init__(clock)
        self.log = log

    def record(self, mark: Any) -> None:
        self.log.append("record")
        super().record(mark)


class GraphFakeTimer(CpuTimer):
    """Implements capture() so the graph regime's control flow runs on the CPU."""

    def __init__(self, clock: FakeClock, log: list[str]) -> None:
        super().__init__(clock)
        self.log = log

    def capture(self, fn):  # type: ignore[no-untyped-def]
        self.log.append("capture")
        fn()  # capturing runs the function once, like torch.cuda.graph

        def replay() -> None:
            self.log.append("replay")
            fn()

        return replay


def settings(**changes: Any) -> TimingSettings:
    base = TimingSettings(warmup_calls=0, warmup_seconds=0.0, repeats=10, max_seconds=100.0)
    return replace(base, **changes)


def make_fn(clock: FakeClock, log: list[Any] | None = None, seconds: float = CALL_S):
    def fn(k: int) -> None:
        if log is not None:
            log.append(k)
        clock.advance(seconds)

    return fn


# ------------------------------------------------------------------------------------------
# The recipe on a fake clock
# ------------------------------------------------------------------------------------------


def test_warmup_by_count() -> None:
    clock = FakeClock()
    calls: list[int] = []
    m = measure(
        make_fn(clock, calls),
        settings=settings(warmup_calls=5, repeats=3),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert m.warmup_calls == 5
    assert len(calls) == 5 + 3
    assert len(m.device_ms) == 3


def test_warmup_by_time_budget() -> None:
    clock = FakeClock()
    # One call minimum, but 4 calls of 1/64 s are needed to spend 1/16 s.
    m = measure(
        make_fn(clock),
        settings=settings(warmup_calls=1, warmup_seconds=4 * CALL_S, repeats=2),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert m.warmup_calls == 4


def test_warmup_count_wins_when_larger_than_time_budget() -> None:
    clock = FakeClock()
    m = measure(
        make_fn(clock),
        settings=settings(warmup_calls=7, warmup_seconds=CALL_S, repeats=1),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert m.warmup_calls == 7


def test_warmup_is_capped_when_clock_does_not_advance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "MAX_WARMUP_CALLS", 50)
    clock = FakeClock()
    m = measure(
        make_fn(clock, seconds=0.0),
        settings=settings(warmup_seconds=1.0, repeats=1),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert m.warmup_calls == 50


def test_samples_are_exact_on_fake_clock() -> None:
    clock = FakeClock()
    m = measure(make_fn(clock), settings=settings(repeats=6), n_input_sets=1, timer=CpuTimer(clock))
    assert m.device_ms == [CALL_S * 1e3] * 6
    assert m.wall_ms == [CALL_S * 1e3] * 6
    assert m.timer == "cpu"
    assert m.total_wall_s == pytest.approx(6 * CALL_S)


def test_repeats_bounded_by_max_seconds() -> None:
    clock = FakeClock()
    # Calls start at 0, 1/4, 2/4, 3/4 s; at 1 s the budget is spent, so the 5th never starts.
    m = measure(
        make_fn(clock, seconds=0.25),
        settings=settings(repeats=100, max_seconds=1.0),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert len(m.device_ms) == 4


def test_at_least_one_timed_call_even_if_budget_is_tiny() -> None:
    clock = FakeClock()
    m = measure(
        make_fn(clock, seconds=2.0),
        settings=settings(repeats=5, max_seconds=0.001),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert len(m.device_ms) == 1


def test_repeats_reached_when_budget_allows() -> None:
    clock = FakeClock()
    m = measure(
        make_fn(clock), settings=settings(repeats=12, max_seconds=10.0), n_input_sets=1, timer=CpuTimer(clock)
    )
    assert len(m.device_ms) == 12


def test_rotation_order_over_input_sets() -> None:
    clock = FakeClock()
    calls: list[int] = []
    m = measure(
        make_fn(clock, calls),
        settings=settings(warmup_calls=4, repeats=5),
        n_input_sets=3,
        timer=CpuTimer(clock),
    )
    assert calls == [0, 1, 2, 0] + [0, 1, 2, 0, 1]
    assert m.n_input_sets == 3


def test_flush_once_per_timed_call_and_outside_timed_region() -> None:
    clock = FakeClock()
    log: list[Any] = []

    def flush() -> None:
        log.append("flush")
        clock.advance(FLUSH_S)

    m = measure(
        make_fn(clock, log),
        settings=settings(warmup_calls=2, repeats=4, l2_flush=True),
        n_input_sets=2,
        timer=LoggingTimer(clock, log),
        flush=flush,
    )
    assert log.count("flush") == 4
    timed = log[2:]  # after the two warm-up calls: flush, record, call, record, per timed call
    assert timed == ["flush", "record", 0, "record", "flush", "record", 1, "record"] * 2
    # The flush advanced the clock by 125 ms each time, yet no sample includes it.
    assert m.device_ms == [CALL_S * 1e3] * 4
    assert m.wall_ms == [CALL_S * 1e3] * 4
    assert m.l2_flush is True


def test_flush_not_called_when_setting_off() -> None:
    clock = FakeClock()
    flushed: list[int] = []
    m = measure(
        make_fn(clock),
        settings=settings(repeats=3, l2_flush=False),
        n_input_sets=1,
        timer=CpuTimer(clock),
        flush=lambda: flushed.append(1),
    )
    assert flushed == []
    assert m.l2_flush is False


def test_flush_time_counts_toward_max_seconds() -> None:
    clock = FakeClock()

    def flush() -> None:
        clock.advance(0.25)

    m = measure(
        make_fn(clock, seconds=0.25),
        settings=settings(repeats=100, max_seconds=1.0, l2_flush=True),
        n_input_sets=1,
        timer=CpuTimer(clock),
        flush=flush,
    )
    assert len(m.device_ms) == 2


def test_on_sample_receives_each_timed_call() -> None:
    clock = FakeClock()
    seen: list[tuple[int, float, float]] = []
    measure(
        make_fn(clock),
        settings=settings(warmup_calls=3, repeats=3),
        n_input_sets=1,
        timer=CpuTimer(clock),
        on_sample=lambda i, d, w: seen.append((i, d, w)),
    )
    assert seen == [(i, CALL_S * 1e3, CALL_S * 1e3) for i in range(3)]


def test_unseen_inputs_give_each_timed_call_a_set_made_outside_the_timed_region() -> None:
    """With ``unseen``, the warm-up rotates over the kept sets and timed call ``i`` runs on the set
    ``unseen(i)`` makes just before it: the making is outside the samples (and before the flush)."""
    clock = FakeClock()
    log: list[Any] = []

    def unseen(i: int):  # type: ignore[no-untyped-def]
        log.append(f"draw{i}")
        clock.advance(FLUSH_S)  # a draw slower than the call: none of it may reach a sample

        def run() -> None:
            log.append(f"unseen{i}")
            clock.advance(CALL_S)

        return run

    m = measure(
        make_fn(clock, log),
        settings=settings(warmup_calls=4, repeats=3, l2_flush=True),
        n_input_sets=3,
        timer=LoggingTimer(clock, log),
        flush=lambda: log.append("flush"),
        unseen=unseen,
    )
    assert log[:4] == [0, 1, 2, 0]  # the warm-up: kept sets only
    for i in range(3):
        assert log[4 + 5 * i : 9 + 5 * i] == [f"draw{i}", "flush", "record", f"unseen{i}", "record"]
    assert m.device_ms == [CALL_S * 1e3] * 3 and m.wall_ms == [CALL_S * 1e3] * 3


def test_each_unseen_set_is_released_before_the_next_is_made() -> None:
    """One unseen set in memory at a time (a KernelBench-size set is gigabytes on the GPU)."""
    import weakref

    class Inputs:
        pass

    alive: list[weakref.ref] = []

    def unseen(i: int):  # type: ignore[no-untyped-def]
        assert all(ref() is None for ref in alive), f"call {i}: an earlier set is still held"
        inputs = Inputs()
        alive.append(weakref.ref(inputs))
        return lambda: inputs

    measure(
        make_fn(FakeClock()),
        settings=settings(repeats=4),
        n_input_sets=1,
        timer=CpuTimer(FakeClock()),
        unseen=unseen,
    )
    assert len(alive) == 4


def test_unseen_inputs_and_cuda_graphs_do_not_go_together() -> None:
    with pytest.raises(ValueError, match="unseen_inputs"):
        measure(
            make_fn(FakeClock()),
            settings=settings(cuda_graph=True),
            n_input_sets=1,
            timer=CpuTimer(FakeClock()),
            unseen=lambda i: lambda: None,
        )


def test_measure_rejects_bad_arguments() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="n_input_sets"):
        measure(make_fn(clock), settings=settings(), n_input_sets=0, timer=CpuTimer(clock))
    with pytest.raises(ValueError, match="repeats"):
        measure(make_fn(clock), settings=settings(repeats=0), n_input_sets=1, timer=CpuTimer(clock))


def test_exceptions_from_fn_propagate() -> None:
    def boom(k: int) -> None:
        raise RuntimeError("candidate crashed")

    with pytest.raises(RuntimeError, match="candidate crashed"):
        measure(boom, settings=settings(), n_input_sets=1, timer=CpuTimer(FakeClock()))


def test_side_stream_work_shows_in_wall_not_device() -> None:
    """A fake device: fn enqueues 5 ms on a side stream; only a device-wide sync waits for it."""
    clock = FakeClock()

    class SideStreamTimer(CpuTimer):
        pending = 0.0

        def synchronize(self) -> None:
            clock.advance(self.pending)
            self.pending = 0.0

    timer = SideStreamTimer(clock)

    def cheat(k: int) -> None:
        clock.advance(1 / 1024)  # the launch on the host
        timer.pending += 5 / 1024  # the work, on another stream

    m = measure(cheat, settings=settings(repeats=10), n_input_sets=1, timer=timer)
    assert m.device_ms == [1e3 / 1024] * 10
    assert m.wall_ms == [6e3 / 1024] * 10
    assert wall_vs_device_disagreement(m, overhead_ms=0.01)["disagrees"] is True


def test_graph_regime_captures_each_set_and_times_replays() -> None:
    clock = FakeClock()
    log: list[Any] = []
    m = measure(
        make_fn(clock, log),
        settings=settings(recipe="r", cuda_graph=True, warmup_calls=1, repeats=4),
        n_input_sets=3,
        timer=GraphFakeTimer(clock, log),
    )
    assert m.recipe == "r+graph"
    # eager warm-up covers all 3 sets though warmup_calls is 1; then one capture per set
    assert log[:9] == [0, 1, 2, "capture", 0, "capture", 1, "capture", 2]
    # replay warm-up (1 call) then 4 timed replays, rotating sets
    assert log[9:] == ["replay", 0] + ["replay", 0, "replay", 1, "replay", 2, "replay", 0]
    assert m.warmup_calls == 3 + 1
    assert m.device_ms == [CALL_S * 1e3] * 4


def test_graph_regime_needs_cuda_timer() -> None:
    clock = FakeClock()
    with pytest.raises(NotImplementedError, match="cuda_graph"):
        measure(make_fn(clock), settings=settings(cuda_graph=True), n_input_sets=1, timer=CpuTimer(clock))


def test_recipe_name_without_graph() -> None:
    clock = FakeClock()
    m = measure(
        make_fn(clock),
        settings=settings(recipe="flush-rotate-events-median"),
        n_input_sets=1,
        timer=CpuTimer(clock),
    )
    assert m.recipe == "flush-rotate-events-median"


def test_real_clock_cpu_measure_of_small_torch_op() -> None:
    a = [torch.randn(64, 64) for _ in range(2)]
    b = torch.randn(64, 64)
    out = torch.empty(64, 64)

    def fn(k: int) -> None:
        torch.mm(a[k], b, out=out)

    s = TimingSettings(warmup_calls=3, warmup_seconds=0.01, repeats=20, max_seconds=2.0)
    m = measure(fn, settings=s, n_input_sets=2, timer=make_timer("cpu"), flush=make_l2_flush("cpu"))
    assert 1 <= len(m.device_ms) == len(m.wall_ms) <= 20
    assert m.warmup_calls >= 3
    assert all(0 < x < 1000 for x in m.device_ms + m.wall_ms)
    assert m.total_wall_s > 0
    assert summarize(m.device_ms)["median"] > 0


def test_make_l2_flush_and_timer_on_cpu() -> None:
    assert make_l2_flush("cpu") is None
    assert isinstance(make_timer("cpu"), CpuTimer)
    assert isinstance(make_timer(None), CpuTimer)


# ------------------------------------------------------------------------------------------
# Measurement records
# ------------------------------------------------------------------------------------------


def test_measurement_round_trip_through_json() -> None:
    m = Measurement(
        recipe="events-median+graph",
        device_ms=[0.5, 0.25],
        wall_ms=[0.75, 0.5],
        warmup_calls=7,
        n_input_sets=3,
        l2_flush=True,
        total_wall_s=1.5,
        timer="cuda-events",
    )
    data = json.loads(json.dumps(m.to_dict()))
    assert Measurement.from_dict(data) == m


def test_measurement_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown Measurement fields"):
        Measurement.from_dict({"recipe": "x", "bogus": 1})


# ------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------


def test_summarize_known_samples() -> None:
    s = summarize([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 5.0, 5.0])
    assert s["n"] == 11
    assert s["median"] == 5.0
    assert s["mean"] == pytest.approx(5.0)
    assert (s["min"], s["max"]) == (1.0, 9.0)
    assert s["iqr"] == pytest.approx(3.0)
    assert s["ci95_low"] <= s["median"] <= s["ci95_high"]
    assert s["ci95_low"] < s["ci95_high"]
    assert s["cv"] == pytest.approx(s["stdev"] / s["mean"])
    json.dumps(s)


def test_summarize_constant_samples_have_zero_width_ci() -> None:
    s = summarize([1.25] * 30)
    assert s["ci95_low"] == s["ci95_high"] == s["median"] == 1.25
    assert s["stdev"] == 0.0 and s["cv"] == 0.0
    assert s["warnings"] == []


def test_summarize_is_reproducible_by_seed() -> None:
    samples = [1.0, 1.1, 0.9, 1.3, 1.05, 0.95, 1.2, 1.0, 0.97, 1.02]
    assert summarize(samples, seed=3) == summarize(samples, seed=3)
    assert summarize(samples, resamples=200)["resamples"] == 200


def test_summarize_ci_narrows_with_more_samples() -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    few = summarize(list(1.0 + 0.1 * rng.standard_normal(10)))
    many = summarize(list(1.0 + 0.1 * rng.standard_normal(1000)))
    assert many["ci95_high"] - many["ci95_low"] < few["ci95_high"] - few["ci95_low"]


def test_summarize_empty_and_single() -> None:
    empty = summarize([])
    assert empty["n"] == 0 and empty["median"] is None and empty["warnings"] == ["no_samples"]
    one = summarize([2.0])
    assert one["median"] == one["ci95_low"] == one["ci95_high"] == 2.0
    assert "few_samples" in one["warnings"]


def test_summarize_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])


@pytest.mark.parametrize(
    ("kwargs", "warning"),
    [
        ({"n": statistics.MIN_SAMPLES - 1}, "few_samples"),
        ({"cv": statistics.NOISY_CV * 1.01}, "noisy"),
        (
            {"median": statistics.OVERHEAD_DOMINATED_MS * 0.99, "maximum": statistics.OVERHEAD_DOMINATED_MS},
            "overhead_dominated",
        ),
        ({"maximum": statistics.OUTLIER_FACTOR * 1.01}, "outliers"),
    ],
)
def test_warning_fires_past_its_threshold(kwargs: dict[str, float], warning: str) -> None:
    args = {"n": 30, "median": 1.0, "cv": 0.01, "maximum": 1.1, **kwargs}
    assert quality_warnings(**args) == [warning]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": statistics.MIN_SAMPLES},
        {"cv": statistics.NOISY_CV},
        {"median": statistics.OVERHEAD_DOMINATED_MS, "maximum": statistics.OVERHEAD_DOMINATED_MS},
        {"maximum": statistics.OUTLIER_FACTOR},
    ],
)
def test_warning_silent_at_its_threshold(kwargs: dict[str, float]) -> None:
    args = {"n": 30, "median": 1.0, "cv": 0.01, "maximum": 1.1, **kwargs}
    assert quality_warnings(**args) == []  # type: ignore[arg-type]


def test_summarize_attaches_warnings() -> None:
    assert "outliers" in summarize([1.0] * 19 + [3.5])["warnings"]
    assert "noisy" in summarize([1.0, 2.0] * 10)["warnings"]
    assert summarize([0.005] * 20)["warnings"] == ["overhead_dominated"]
    assert summarize([1.0] * 5)["warnings"] == ["few_samples"]


def test_paired_speedup_constant_ratio() -> None:
    r = paired_speedup([[2.0, 2.0, 2.0]] * 3, [[1.0, 1.0, 1.0]] * 3, resamples=200)
    assert r["speedup"] == 2.0
    assert r["ci95_low"] == r["ci95_high"] == 2.0
    assert r["per_round"] == [2.0, 2.0, 2.0]
    assert r["n_rounds"] == 3


def test_paired_speedup_pairing_cancels_drift_between_rounds() -> None:
    # The machine got 2x slower in round 2 for both sides: the ratio is 2 in every round.
    r = paired_speedup([[2.0, 2.0], [4.0, 4.0]], [[1.0, 1.0], [2.0, 2.0]], resamples=500, seed=1)
    assert r["per_round"] == [2.0, 2.0]
    assert r["speedup"] == pytest.approx(2.0)
    assert r["ci95_low"] == pytest.approx(2.0) and r["ci95_high"] == pytest.approx(2.0)
    assert r["baseline_median"] == 3.0 and r["candidate_median"] == 1.5


def test_paired_speedup_interval_contains_estimate() -> None:
    base = [[10.0, 10.5, 9.5, 10.2], [10.1, 9.9, 10.4, 9.8]]
    cand = [[5.0, 5.5, 4.8, 5.1], [5.2, 4.9, 5.0, 5.3]]
    r = paired_speedup(base, cand, resamples=500)
    assert r["ci95_low"] <= r["speedup"] <= r["ci95_high"]
    assert 1.8 < r["speedup"] < 2.2
    assert r["ci95_low"] < r["ci95_high"]
    assert paired_speedup(base, cand, resamples=500) == r


def test_paired_speedup_rejects_unpaired_rounds() -> None:
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        paired_speedup([[1.0], [1.0]], [[1.0]])
    with pytest.raises(ValueError, match="at least one sample"):
        paired_speedup([[1.0], []], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="positive"):
        paired_speedup([[0.0]], [[1.0]])


def test_wall_vs_device_thresholds() -> None:
    def m(device: float, wall: float) -> Measurement:
        return Measurement(recipe="x", device_ms=[device] * 10, wall_ms=[wall] * 10)

    allowed = max(0.02, statistics.WALL_DEVICE_REL_TOLERANCE * 1.0) + statistics.WALL_DEVICE_SLACK_MS
    assert wall_vs_device_disagreement(m(1.0, 1.0 + allowed * 0.99), overhead_ms=0.02)["disagrees"] is False
    assert wall_vs_device_disagreement(m(1.0, 1.0 + allowed * 1.01), overhead_ms=0.02)["disagrees"] is True
    # honest tiny kernel: the wall clock pays the sync overhead and nothing more
    honest = wall_vs_device_disagreement(m(0.004, 0.03), overhead_ms=0.03)
    assert honest["disagrees"] is False
    # side stream: the event fires at once, the device-wide sync waits 2 ms
    cheat = wall_vs_device_disagreement(m(0.005, 2.0), overhead_ms=0.03)
    assert cheat["disagrees"] is True and cheat["ratio"] == pytest.approx(400.0)


def test_bracket_check_flags_under_reporting_worker() -> None:
    """End to end: the worker's clock was patched to run 50x slow; the parent's clock was not."""
    parent = FakeClock()

    class LyingClock(Clock):
        def now(self) -> float:
            return parent.now() / 50

    n, overhead_ms = 30, 20.0
    t0 = parent.now()
    parent.advance(overhead_ms / 2e3)  # channel + spawn costs before ...
    m = measure(
        make_fn(parent, seconds=0.05),
        settings=settings(repeats=n),
        n_input_sets=1,
        timer=CpuTimer(LyingClock()),
    )
    parent.advance(overhead_ms / 2e3)  # ... and after
    bracket_ms = (parent.now() - t0) * 1e3
    assert m.wall_ms == pytest.approx([1.0] * n)
    r = bracket_check(sum(m.wall_ms), bracket_ms, overhead_ms, n_calls=n)
    assert r["disagrees"] is True
    assert r["trusted_per_call_ms"] == pytest.approx(50.0)


def test_bracket_check_accepts_honest_worker() -> None:
    parent = FakeClock()
    n, overhead_ms = 30, 20.0
    t0 = parent.now()
    parent.advance(0.021)  # a little more overhead than expected: within the slack
    m = measure(
        make_fn(parent, seconds=0.05), settings=settings(repeats=n), n_input_sets=1, timer=CpuTimer(parent)
    )
    bracket_ms = (parent.now() - t0) * 1e3
    r = bracket_check(sum(m.wall_ms), bracket_ms, overhead_ms, n_calls=n)
    assert r["disagrees"] is False and r["overreports"] is False
    assert r["trusted_per_call_ms"] == pytest.approx(50.0, rel=0.01)


def test_bracket_check_thresholds_and_overreport() -> None:
    allowed = 10.0 + statistics.BRACKET_SLACK_ABS_MS + statistics.BRACKET_SLACK_REL * 100.0
    assert bracket_check(100.0, 100.0 + allowed * 0.99, 10.0)["disagrees"] is False
    assert bracket_check(100.0, 100.0 + allowed * 1.01, 10.0)["disagrees"] is True
    impossible = bracket_check(100.0, 50.0, 10.0)
    assert impossible["overreports"] is True and impossible["disagrees"] is False
    with pytest.raises(ValueError, match="n_calls"):
        bracket_check(1.0, 1.0, 0.0, n_calls=0)


# ------------------------------------------------------------------------------------------
# Identity snapshot
# ------------------------------------------------------------------------------------------


def test_identities_unchanged_without_patching() -> None:
    snap = snapshot_identities()
    assert snap["time.perf_counter"] == id(time.perf_counter)
    assert verify_identities(snap) == []


def test_identities_detect_patched_perf_counter_and_timer_keeps_real_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = CpuTimer()  # constructed before the "candidate" patches time
    snap = snapshot_identities()
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    assert verify_identities(snap) == ["time.perf_counter"]
    first = timer.now()
    time.sleep(0.001)
    assert timer.now() > first > 0.0  # the timer still reads the real clock


def test_identities_detect_patched_cuda_event_and_own_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The statistics are no longer in the worker (kbv.statistics runs in the parent); the recipe is.
    snap = snapshot_identities()
    monkeypatch.setattr(torch.cuda.Event, "elapsed_time", lambda self, end: 0.001)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "measure", lambda *a, **k: {})
    assert verify_identities(snap) == [
        "kbv.child.timing.measure",
        "torch.cuda.Event.elapsed_time",
        "torch.cuda.synchronize",
    ]
    monkeypatch.undo()
    assert verify_identities(snap) == []


def test_identities_detect_removed_function(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = snapshot_identities()
    monkeypatch.delattr(time, "monotonic")
    assert verify_identities(snap) == ["time.monotonic"]


@pytest.mark.parametrize("calls_s", [0.001, 0.03])  # time-bound and count-bound warm-ups
def test_honest_warmup_fits_the_recipe_bound_and_the_trusted_per_call_time(calls_s: float) -> None:
    """On a fake clock, an honest batch's real warm-up never exceeds warmup_bound_ms, the account
    covers the bracket, and trusted_per_call_ms recovers the call time without the worker's count."""
    clock = FakeClock()
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)
    m = measure(make_fn(clock, seconds=calls_s), settings=s, n_input_sets=1, timer=CpuTimer(clock))
    warmup_ms = m.total_wall_s * 1e3 - sum(m.wall_ms)
    assert warmup_ms <= statistics.warmup_bound_ms(s, max(m.wall_ms)) + 1e-9
    assert statistics.accounted_batch_ms(m.wall_ms, m.warmup_calls, s) == pytest.approx(
        m.total_wall_s * 1e3, rel=0.05
    )
    assert statistics.trusted_per_call_ms(m.total_wall_s * 1e3, 0.0, len(m.wall_ms), s) == pytest.approx(
        calls_s * 1e3, rel=0.05
    )


def _lying_batch(claimed_ms: float, outsized_ms: float) -> list[float]:
    """29 samples at the claimed per-call time and one that carries the rest of the batch."""
    return [claimed_ms] * 29 + [outsized_ms]


def test_one_outsized_sample_cannot_account_for_the_bracket() -> None:
    """30 calls of 1 ms, a 50 ms warm-up and 5 ms of overhead: an 86 ms bracket. A worker reporting
    0.25 ms per call (a 4x lie) and one sample of 23 ms (the rest) once fit: the sample counted 20
    medians and stretched the warm-up bound by 4 x 20 medians. Now a sample counts at most
    SAMPLE_CAP medians and the warm-up bound uses the median: the bracket disagrees."""
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)
    bracket, overhead = 50.0 + 1.0 + 30.0 + 5.0, 5.0
    lying = _lying_batch(0.25, 23.0)
    accounted = statistics.accounted_batch_ms(lying, 100_000, s)
    assert accounted == pytest.approx(29 * 0.25 + statistics.SAMPLE_CAP * 0.25 + 50.0 + 4 * 0.25)
    assert statistics.bracket_check(accounted, bracket, overhead)["disagrees"]
    old = 29 * 0.25 + 20 * 0.25 + min(100_000 * 0.25, 50.0 + 4 * 20 * 0.25)  # the former account
    assert not statistics.bracket_check(old, bracket, overhead)["disagrees"]
    # What still passes: a claim the slack (2 ms + 10 %) hides, with or without the outsized sample.
    for claimed in (0.62, 0.7):
        assert not statistics.bracket_check(
            statistics.accounted_batch_ms(_lying_batch(claimed, 30.0), 100_000, s), bracket, overhead
        )["disagrees"]


def test_honest_noisy_samples_agree_with_the_bracket() -> None:
    """Samples that jitter (log-normal, 30 %) and the odd 2.5x call, with the warm-up the recipe
    really makes, never disagree with a bracket that holds exactly them plus the overhead."""
    import random

    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)
    rng = random.Random(5)
    for _ in range(500):
        call = rng.choice([0.01, 0.3, 1.0, 20.0])
        wall = [call * rng.lognormvariate(0.0, 0.3) for _ in range(30)]
        for i in rng.sample(range(30), 2):
            wall[i] *= 2.5
        warm_calls = max(3, int(50.0 / call) + 1)
        warm_ms = max(50.0, 3 * call) + call  # the call that crosses the budget
        bracket = sum(wall) + warm_ms + 5.0
        accounted = statistics.accounted_batch_ms(wall, warm_calls, s)
        assert not statistics.bracket_check(accounted, bracket, 5.0)["disagrees"], (call, wall)


def test_an_honest_hiccup_beyond_the_cap_is_a_gap_in_its_own_round_only() -> None:
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)
    wall = [1.0] * 29 + [20.0]  # the scheduler took 19 ms from one call
    result = statistics.bracket_check(statistics.accounted_batch_ms(wall, 51, s), 51.0 + 49.0 + 5.0, 5.0)
    assert result["disagrees"]  # the price of not believing outsized samples; rounds decide (integrity)


def test_bracket_verdict_takes_the_largest_trusted_gap_and_needs_every_round() -> None:
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)

    def batch(bracket_ms: float) -> dict:  # 30 x 1 ms + the 50 ms warm-up: 80 ms accounted
        return {"parent_bracket_s": bracket_ms / 1e3, "wall_ms": [1.0] * 30, "warmup_calls": 50}

    assert statistics.batch_gap_ms(batch(85.0), s) == pytest.approx(5.0)
    trusted = [batch(83.0), batch(85.0), {"wall_ms": [1.0]}]  # a batch without a bracket is skipped
    verdict = statistics.bracket_verdict([batch(100.0)] * 3, trusted, s)
    assert verdict["overhead_ms"] == pytest.approx(5.0) and verdict["disagrees"]  # 20 > 5 + 2 + 8 ms
    assert verdict["rounds"][0]["allowed_gap_ms"] == pytest.approx(15.0)
    one_spike = statistics.bracket_verdict([batch(100.0), batch(86.0), batch(100.0)], trusted, s)
    assert not one_spike["disagrees"]
    busy_now = statistics.bracket_verdict([batch(100.0)] * 3, [*trusted, batch(97.0)], s)
    assert busy_now["overhead_ms"] == pytest.approx(17.0) and not busy_now["disagrees"]
    assert statistics.bracket_verdict([batch(500.0)] * 3, [], s) == {
        "overhead_ms": None,
        "rounds": [],
        "disagrees": False,
    }  # nothing trusted to compare with: no verdict


def test_a_claimed_warmup_count_cannot_stretch_the_account() -> None:
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)
    wall = [0.01] * 30
    honest = statistics.accounted_batch_ms(wall, 5000, s)  # 5000 x 0.01 ms = the 50 ms budget
    lying = statistics.accounted_batch_ms(wall, 100_000, s)  # claims 1 s of warm-up
    bound = statistics.warmup_bound_ms(s, 0.01)
    assert honest == pytest.approx(0.3 + 50.0)
    assert lying == pytest.approx(0.3 + bound) and bound == pytest.approx(50.0 + 4 * 0.01)
    graph = replace(s, cuda_graph=True)
    assert statistics.warmup_bound_ms(graph, 0.01, n_input_sets=3) > 2 * 50.0  # two warm-ups, three captures


def test_a_later_batch_is_credited_only_the_warmup_it_was_asked_for() -> None:
    """A worker's later batches warm up by ``warmup_calls`` alone (``rewarm_seconds`` 0): the bracket
    check credits such a batch the warm-up it was asked for (``warmup_budget_s``, the parent's), so
    a candidate cannot hide 50 ms of work in a warm-up it never had to run."""
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=10, rewarm_seconds=0.0)
    assert statistics.warmup_budget_s(s, first_batch=True) == 0.05
    assert statistics.warmup_budget_s(s, first_batch=False) == 0.0
    assert statistics.warmup_budget_s(replace(s, rewarm_seconds=-1.0), first_batch=False) == 0.05

    def batch(bracket_ms: float, budget: float | None) -> dict:  # 10 calls of 1 ms, 3 warm-up calls
        found = {"parent_bracket_s": bracket_ms / 1e3, "wall_ms": [1.0] * 10, "warmup_calls": 3}
        return found if budget is None else {**found, "warmup_budget_s": budget}

    # the first batch is credited its 50 ms budget, a later one 3 calls (the bound: 4 medians)
    assert statistics.batch_gap_ms(batch(61.0, 0.05), s) == pytest.approx(1.0)
    assert statistics.batch_gap_ms(batch(14.0, 0.0), s) == pytest.approx(1.0)
    # a batch stored before the field was timed with warmup_seconds
    assert statistics.batch_gap_ms(batch(61.0, None), s) == pytest.approx(1.0)
    # 45 ms hidden in a later round: a gap, where the first round's budget would have covered it
    trusted = [batch(61.0, 0.05), batch(14.0, 0.0)]
    hiding = statistics.bracket_verdict([batch(58.0, 0.0)] * 3, trusted, s)
    assert hiding["disagrees"] and hiding["rounds"][0]["trusted_per_call_ms"] > 4.0
    assert not statistics.bracket_verdict([batch(14.0, 0.0)] * 3, trusted, s)["disagrees"]


def test_median_precision_is_the_relative_half_width_of_the_median_interval() -> None:
    assert statistics.median_precision([2.0] * 10) == 0.0
    assert statistics.median_precision([]) == float("inf")
    noisy = [1.0, 3.0, 0.5, 2.5, 1.5, 4.0, 0.8, 2.2, 1.1, 3.3]
    stable = [1.0, 1.001, 0.999, 1.0005, 0.9995] * 2
    assert statistics.median_precision(noisy) > 0.2 > 0.002 > statistics.median_precision(stable)
    # the interval narrows with more samples of the same spread
    assert statistics.median_precision(noisy * 9) < statistics.median_precision(noisy)


def test_unpaired_speedup_pools_rounds_of_either_count() -> None:
    r = statistics.unpaired_speedup([[2.0, 2.0]] * 3, [[1.0, 1.0]] * 5, resamples=200)
    assert r["speedup"] == 2.0 and r["ci95_low"] == r["ci95_high"] == 2.0
    assert r["per_round"] == [] and r["n_rounds"] == 5
    base = [[10.0, 10.5, 9.5], [10.1, 9.9, 10.4], [10.3, 9.7, 10.0]]
    cand = [[5.0, 5.5, 4.8], [5.2, 4.9, 5.0]]
    noisy = statistics.unpaired_speedup(base, cand, resamples=300)
    assert (
        noisy["ci95_low"] <= noisy["speedup"] <= noisy["ci95_high"] and noisy["ci95_low"] < noisy["ci95_high"]
    )
    assert statistics.unpaired_speedup(base, cand, resamples=300) == noisy  # seeded
    with pytest.raises(ValueError, match="at least one round"):
        statistics.unpaired_speedup([], [[1.0]])
    with pytest.raises(ValueError, match="positive"):
        statistics.unpaired_speedup([[1.0]], [[0.0]])


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"device_ms": [1.0, 0.0], "wall_ms": [1.0, 1.0]}, "device_ms\\[1\\] = 0.0"),
        ({"device_ms": [1.0, -1.0], "wall_ms": [1.0, 1.0]}, "positive"),
        ({"device_ms": [1.0, float("nan")], "wall_ms": [1.0, 1.0]}, "finite"),
        ({"device_ms": [1.0], "wall_ms": [float("inf")]}, "wall_ms"),
        ({"device_ms": [], "wall_ms": []}, "expected 1..30"),
        ({"device_ms": [1.0] * 31, "wall_ms": [1.0] * 31}, "expected 1..30"),
        ({"device_ms": [1.0], "wall_ms": [1.0], "warmup_calls": -5}, "warmup_calls"),
        ({"device_ms": "1.0", "wall_ms": [1.0]}, "lists"),
    ],
)
def test_invalid_samples_names_what_no_clock_produces(bad: dict[str, Any], reason: str) -> None:
    problem = statistics.invalid_samples({"warmup_calls": 3, **bad}, settings(repeats=30))
    assert problem is not None and re.search(reason, problem), problem
    assert (
        statistics.invalid_samples(
            {"device_ms": [0.5], "wall_ms": [0.6], "warmup_calls": 3}, settings(repeats=30)
        )
        is None
    )


# ------------------------------------------------------------------------------------------
# Baseline cache key
# ------------------------------------------------------------------------------------------

KEY_ARGS: dict[str, Any] = {
    "problem_sha": "abc123",
    "input_spec": {"shapes": [[16, 16]], "dtype": "float32", "distribution": "original"},
    "device": {"name": "NVIDIA H200", "driver_version": "580.65", "cuda": "13.0"},
    "torch_version": "2.11.0+cu130",
    "timing_settings": TimingSettings(),
    "baseline_name": "eager_fp32",
    "versions": {"kbv": "0.1.0", "triton": "3.5.0"},
}

KEY_CHANGES: dict[str, Any] = {
    "problem_sha": "abc124",
    "input_spec": {"shapes": [[16, 32]], "dtype": "float32", "distribution": "original"},
    "device": {"name": "NVIDIA H200", "driver_version": "580.82", "cuda": "13.0"},
    "torch_version": "2.11.1+cu130",
    "timing_settings": TimingSettings(l2_flush=True),
    "baseline_name": "eager_tf32",
    "versions": {"kbv": "0.2.0", "triton": "3.5.0"},
}


def test_cache_key_is_stable() -> None:
    key = baseline_cache_key(**KEY_ARGS)
    assert len(key) == 64
    assert baseline_cache_key(**KEY_ARGS) == key
    reordered = {**KEY_ARGS, "input_spec": dict(reversed(list(KEY_ARGS["input_spec"].items())))}
    assert baseline_cache_key(**reordered) == key
    as_dict = {**KEY_ARGS, "timing_settings": asdict(KEY_ARGS["timing_settings"])}
    assert baseline_cache_key(**as_dict) == key


@pytest.mark.parametrize("component", sorted(KEY_CHANGES))
def test_cache_key_changes_with_each_component(component: str) -> None:
    assert baseline_cache_key(**{**KEY_ARGS, component: KEY_CHANGES[component]}) != baseline_cache_key(
        **KEY_ARGS
    )


def test_cache_key_changes_with_device_name() -> None:
    other = {**KEY_ARGS, "device": {**KEY_ARGS["device"], "name": "NVIDIA H100"}}
    assert baseline_cache_key(**other) != baseline_cache_key(**KEY_ARGS)


def test_cache_key_changes_with_triton_version_and_its_presence() -> None:
    newer = {**KEY_ARGS, "versions": {**KEY_ARGS["versions"], "triton": "3.6.0"}}
    absent = {**KEY_ARGS, "versions": {**KEY_ARGS["versions"], "triton": None}}
    keys = {baseline_cache_key(**KEY_ARGS), baseline_cache_key(**newer), baseline_cache_key(**absent)}
    assert len(keys) == 3


def test_cache_key_requires_device_name_and_driver() -> None:
    with pytest.raises(ValueError, match="driver_version"):
        baseline_cache_key(**{**KEY_ARGS, "device": {"name": "NVIDIA H200"}})


# ------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
def test_cuda_measure_events_flush_and_graph() -> None:
    from kbv.child.timing import CudaTimer

    dev = torch.device("cuda")
    timer = CudaTimer(dev)
    flush = make_l2_flush(dev)
    assert flush is not None
    a = [torch.randn(1024, 1024, device=dev) for _ in range(3)]
    out = torch.empty(1024, 1024, device=dev)

    def fn(k: int) -> None:
        torch.mm(a[k], a[k], out=out)

    s = TimingSettings(
        recipe="r", warmup_calls=3, warmup_seconds=0.01, repeats=20, max_seconds=2.0, l2_flush=True
    )
    m = measure(fn, settings=s, n_input_sets=3, timer=timer, flush=flush)
    assert m.timer == "cuda-events" and len(m.device_ms) == 20
    assert all(0 < d < 100 for d in m.device_ms)
    assert all(w > 0 for w in m.wall_ms)
    assert wall_vs_device_disagreement(m, overhead_ms=0.05)["disagrees"] is False

    g = measure(fn, settings=replace(s, cuda_graph=True), n_input_sets=3, timer=timer, flush=flush)
    assert g.recipe == "r+graph" and len(g.device_ms) == 20
    assert all(0 < d < 100 for d in g.device_ms)


@needs_cuda
@pytest.mark.gpu
def test_cuda_side_stream_is_caught() -> None:
    from kbv.child.timing import CudaTimer

    dev = torch.device("cuda")
    timer = CudaTimer(dev)
    side = torch.cuda.Stream(dev)
    x = torch.randn(4096, 4096, device=dev)
    out = torch.empty_like(x)

    def cheat(k: int) -> None:
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(5):
                torch.mm(x, x, out=out)

    m = measure(cheat, settings=TimingSettings(repeats=10), n_input_sets=1, timer=timer)
    assert wall_vs_device_disagreement(m, overhead_ms=0.05)["disagrees"] is True


def test_time_the_worker_waited_for_a_cpu_is_not_counted_against_it() -> None:
    """A loaded machine: the candidate's main thread waited 46 ms for a CPU in each batch, and a
    trusted batch of the moment waited 40 ms of its 125. The wait is the machine's (the parent read
    it from /proc), so the rounds agree. A wait its own helper threads caused (CPU they ran
    meanwhile) earns nothing; so does a wait beyond the share of its bracket any trusted batch
    waited (a worker pinned to a busy CPU); a batch without counts is judged as before."""
    s = settings(warmup_calls=3, warmup_seconds=0.05, repeats=30)

    def batch(bracket_ms: float, counted: dict | None = None) -> dict:  # 80 ms accounted
        found = {"parent_bracket_s": bracket_ms / 1e3, "wall_ms": [1.0] * 30, "warmup_calls": 50}
        return {**found, "worker_scheduler_ms": counted} if counted is not None else found

    quiet = batch(87.0, {"main_wait": 2.0, "main_cpu": 80.0, "cpu": 80.0})
    busy = batch(125.0, {"main_wait": 40.0, "main_cpu": 80.0, "cpu": 80.0})
    assert statistics.batch_gap_ms(quiet, s) == statistics.batch_gap_ms(busy, s) == pytest.approx(5.0)
    loaded = {"main_wait": 46.0, "main_cpu": 80.0, "cpu": 83.0}
    assert statistics.machine_wait_ms(loaded) == 0.0  # a dict of counts is not a batch
    assert statistics.machine_wait_ms(batch(131.0, loaded)) == pytest.approx(43.0)
    waited = statistics.bracket_verdict([batch(131.0, loaded)] * 3, [quiet, busy], s)
    assert not waited["disagrees"]
    assert waited["rounds"][0]["machine_wait_ms"] == pytest.approx(40.0 / 125.0 * 131.0)  # capped
    assert waited["rounds"][0]["parent_bracket_ms"] == pytest.approx(131.0)
    # the trusted batches met a quiet machine: a long wait is not believed
    assert statistics.bracket_verdict([batch(131.0, loaded)] * 3, [quiet], s)["disagrees"]
    helped = {"main_wait": 46.0, "main_cpu": 40.0, "cpu": 90.0}  # its own threads ran 50 ms meanwhile
    assert statistics.bracket_verdict([batch(131.0, helped)] * 3, [quiet, busy], s)["disagrees"]
    assert statistics.bracket_verdict([batch(131.0)] * 3, [quiet, busy], s)["disagrees"]
    broken = {"main_wait": float("nan"), "main_cpu": 1.0, "cpu": 1.0}
    assert statistics.machine_wait_ms(batch(131.0, broken)) == 0.0


def _looped_ratio_interval(base: list, cand: list, resamples: int, seed: int) -> tuple[float, float]:
    """The two-level bootstrap written as a plain loop (rounds drawn together, then samples within)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base_a, cand_a = [np.asarray(r) for r in base], [np.asarray(r) for r in cand]
    ratios = []
    for _ in range(resamples):
        rounds = rng.integers(0, len(base_a), len(base_a))
        b = np.concatenate([base_a[r][rng.integers(0, base_a[r].size, base_a[r].size)] for r in rounds])
        c = np.concatenate([cand_a[r][rng.integers(0, cand_a[r].size, cand_a[r].size)] for r in rounds])
        ratios.append(np.median(b) / np.median(c))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


@pytest.mark.parametrize("sizes", [(10, 10, 10), (10, 7, 30, 3)])
def test_the_vectorised_bootstrap_agrees_with_the_plain_loop(sizes: tuple[int, ...]) -> None:
    """Rounds of equal and of unequal sizes (a batch cut by ``max_seconds``): the interval is the
    loop's, up to resampling noise."""
    import numpy as np

    rng = np.random.default_rng(5)
    base = [list(2.0 + 0.2 * rng.standard_normal(n) + 0.1 * i) for i, n in enumerate(sizes)]
    cand = [list(1.0 + 0.1 * rng.standard_normal(n) + 0.05 * i) for i, n in enumerate(sizes)]
    fast = paired_speedup(base, cand, resamples=4000, seed=3)
    low, high = _looped_ratio_interval(base, cand, resamples=4000, seed=9)
    assert fast["ci95_low"] == pytest.approx(low, rel=0.01) and fast["ci95_high"] == pytest.approx(
        high, rel=0.01
    )
    assert fast["ci95_low"] < fast["speedup"] < fast["ci95_high"]
