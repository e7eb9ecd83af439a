"""Evaluations share a GPU except while one times (kbv.device_lock). flock locks taken through
separate open files conflict within one process too, so threads stand in for processes."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from kbv.device_lock import DeviceLock


@pytest.fixture(autouse=True)
def _private_lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _start(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_timing_waits_for_every_sharer_and_newcomers_wait_for_the_timer() -> None:
    first, timer = DeviceLock("cuda:7").__enter__(), DeviceLock("cuda:7").__enter__()
    events: list[str] = []
    timing_started, newcomer_in = threading.Event(), threading.Event()

    def time_it() -> None:
        with timer.exclusive():
            timing_started.set()
            events.append("timing")
            time.sleep(0.2)
            events.append("timing done")

    def newcomer() -> None:
        late = DeviceLock("cuda:7").__enter__()
        events.append("newcomer")
        newcomer_in.set()
        late.close()

    timing = _start(time_it)
    time.sleep(0.2)
    assert not timing_started.is_set()  # the first evaluation still shares the GPU
    joining = _start(newcomer)
    time.sleep(0.2)
    assert not newcomer_in.is_set()  # it queues behind the waiting timer
    first.close()
    timing.join(5)
    joining.join(5)
    assert events == ["timing", "timing done", "newcomer"]
    assert timer.waited_s >= 0.2
    timer.close()


def test_two_timers_do_not_deadlock_and_sharers_overlap() -> None:
    a, b = DeviceLock("cuda:3").__enter__(), DeviceLock("cuda:3").__enter__()  # both share at once
    order: list[str] = []

    def time_with(lock: DeviceLock, name: str) -> None:
        with lock.exclusive():
            order.append(name)
            time.sleep(0.05)
            order.append(name)
        lock.close()  # the evaluation ends: the other one, still waiting, can time now

    threads = [_start(lambda: time_with(a, "a")), _start(lambda: time_with(b, "b"))]
    for thread in threads:
        thread.join(5)
    assert sorted(order) == ["a", "a", "b", "b"] and order[0] == order[1]  # one after the other


def test_the_cpu_takes_no_lock() -> None:
    with DeviceLock("cpu") as lock, lock.exclusive(), DeviceLock("cpu"):
        pass
    assert lock.waited_s == 0.0
    assert not list(Path(tempfile.gettempdir()).glob("kbv-device-locks/*"))
