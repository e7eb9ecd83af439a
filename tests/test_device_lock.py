"""Evaluations share a GPU except while one times (kbv.device_lock). flock locks taken through
separate open files conflict within one process too, so threads stand in for processes."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from kbv import wire_replies
from kbv.device_lock import DeviceLock


@pytest.fixture(autouse=True)
def _private_lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _hello(total_memory_bytes: int) -> wire_replies.Hello:
    """A reference worker's greeting on a GPU of ``total_memory_bytes``."""
    device = {"type": "cuda", "total_memory_bytes": total_memory_bytes}
    return wire_replies.Hello(
        pid=1, python="3", torch="2", cuda_available=True, intra_op_threads=1, device=device
    )


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


def test_a_nested_exclusive_block_keeps_the_gpu_alone_until_the_outer_one_ends() -> None:
    """A large evaluation holds the GPU alone throughout; its timing phase's own exclusive block,
    nested inside, must not hand the GPU back when it ends."""
    holder = DeviceLock("cuda:5").__enter__()
    newcomer_in = threading.Event()

    def newcomer() -> None:
        late = DeviceLock("cuda:5").__enter__()
        newcomer_in.set()
        late.close()

    with holder.exclusive():
        with holder.exclusive():  # the timing phase
            pass
        joining = _start(newcomer)
        time.sleep(0.2)
        assert not newcomer_in.is_set()  # still alone after the nested block
    joining.join(5)
    assert newcomer_in.is_set()  # the outer block's end lets it in
    holder.close()
    # hold_alone: alone until close, whatever is nested
    holder = DeviceLock("cuda:5").__enter__()
    newcomer_in.clear()
    holder.hold_alone()
    with holder.exclusive():
        pass
    joining = _start(newcomer)
    time.sleep(0.2)
    assert not newcomer_in.is_set()
    holder.close()
    joining.join(5)
    assert newcomer_in.is_set()


def test_an_evaluation_holds_the_gpu_alone_when_its_copies_would_fill_a_quarter_of_it() -> None:
    from types import SimpleNamespace

    from kbv import evaluation
    from kbv.problems.structure import InputStructure

    def hold(device: str, numels: list[int]) -> str:
        ctx = SimpleNamespace(
            device=device, structure=InputStructure(invariants=[], numels=numels), gpu=evaluation._GpuState()
        )
        return evaluation._gpu_hold(ctx, _hello(140 * 10**9))

    assert hold("cuda", [4096 * 393216]).startswith("alone")  # KernelBench's 1.6e9-element ReLU
    assert hold("cuda:1", [4096 * 4096, 4096 * 4096]).startswith("shared")  # a 4096 x 4096 matmul
    assert hold("cpu", [4096 * 393216]) == ""


def test_both_observations_run_at_once_unless_the_gpu_held_alone_has_no_room_for_them() -> None:
    """Alone for a 1e9-element loss (8.6 GB of inputs), the two workers' observations still run side
    by side; for KernelBench's 1.6e9-element ReLU (6.4 GB in, 6.4 GB out) one after the other; and
    before the first draw told the outputs' sizes, one after the other too."""
    from types import SimpleNamespace

    from kbv import evaluation
    from kbv.problems.structure import InputStructure

    hello = _hello(143771 * (1 << 20))

    def side_by_side(inputs: list[int], outputs: list[int] | None) -> bool:
        ctx = SimpleNamespace(
            device="cuda",
            structure=InputStructure(invariants=[], numels=inputs),
            gpu=evaluation._GpuState(output_numels=outputs),
        )
        ctx.gpu.held = evaluation._gpu_hold(ctx, hello)
        return evaluation._side_by_side(ctx)  # type: ignore[arg-type]

    loss = [32768 * 32768] * 2
    relu = [4096 * 393216]
    assert side_by_side([4096 * 4096] * 2, None)  # shared: always
    assert side_by_side(loss, [1]) and not side_by_side(loss, None)
    assert not side_by_side(relu, relu)


def test_an_evaluation_whose_outputs_are_large_holds_the_gpu_alone_from_its_first_draw() -> None:
    """KernelBench's 63_conv_standard_2D has a small input and an 8.5 GB output: its inputs alone
    left it sharing the GPU, where it ran out of memory beside another evaluation. The first draw's
    outputs decide again; a small output leaves it shared."""
    from types import SimpleNamespace

    import torch

    from kbv import evaluation
    from kbv.problems.structure import InputStructure
    from kbv.protocol import LimitSettings
    from kbv.worker import MemoryBudget, WorkerSpec

    class Lock:
        alone = 0

        def hold_alone(self) -> None:
            self.alone += 1

    hello = _hello(143771 * (1 << 20))
    conv_input, conv_output = 16 * 3 * 1024 * 1024, 16 * 128 * 1022 * 1022

    def after_first_draw(output_numel: int) -> tuple[str, int, float]:
        ctx = SimpleNamespace(
            device="cuda",
            structure=InputStructure(invariants=[], numels=[conv_input]),
            gpu=evaluation._GpuState(budget=MemoryBudget()),
        )
        ctx.gpu.held = evaluation._gpu_hold(ctx, hello)
        assert ctx.gpu.held.startswith("shared")
        spec = WorkerSpec(build_key="x", limits=LimitSettings())
        lock, subject = Lock(), SimpleNamespace(spec=spec)
        hook = evaluation._hold_alone_for_outputs(ctx, lock, subject, hello)
        hook({"reference": {"outputs": [torch.empty(output_numel, device="meta")]}})
        assert subject.spec is spec and spec.limits == LimitSettings()  # the budget widens, not the spec
        return ctx.gpu.held, lock.alone, ctx.gpu.budget.limits_of(spec).device_memory_gb

    held, alone, limit = after_first_draw(conv_output)
    assert held.startswith("alone for the first correctness draw on") and "GB of outputs" in held
    assert alone == 1 and limit > 64 and "limit raised" in held
    assert after_first_draw(conv_input) == ("shared with other evaluations outside the timing phase", 0, 64.0)


def test_a_candidate_alone_on_its_gpu_may_use_most_of_it_but_not_more() -> None:
    """The device-memory limit protects the evaluations that share a GPU; one that holds the GPU
    alone lets its candidate use 75% of it (the reference itself used 72 GB on a 7.5 GB-input
    KernelBench problem), never less than the protocol's figure, and says so."""
    from dataclasses import replace
    from types import SimpleNamespace

    from kbv import evaluation
    from kbv.protocol import LimitSettings
    from kbv.worker import MemoryBudget, WorkerSpec

    def widened(limits: LimitSettings | None, total: int) -> tuple[str, object]:
        spec = WorkerSpec(build_key="x", device="cuda", limits=limits)
        subject, budget = SimpleNamespace(spec=spec), MemoryBudget()
        said = evaluation._widen_device_limit(budget, subject, _hello(total))
        assert subject.spec is spec and spec.limits is limits  # the worker's spec stays as launched
        return said, budget.limits_of(spec)

    h200 = 143771 * (1 << 20)
    said, limits = widened(LimitSettings(), h200)
    assert limits.device_memory_gb == round(0.75 * h200 / (1 << 30), 1) > 72e9 / (1 << 30)  # type: ignore[attr-defined]
    assert limits.host_memory_gb == LimitSettings().host_memory_gb  # type: ignore[attr-defined]
    assert "raised from 64 GiB" in said
    small_gpu = 40 * (1 << 30)  # 75% of it is below the protocol's 64 GiB: the protocol's figure stays
    assert widened(LimitSettings(), small_gpu) == ("", LimitSettings())
    off = replace(LimitSettings(), device_memory_gb=0.0)  # a limit turned off stays off
    assert widened(off, h200) == ("", off)
    assert widened(None, h200) == ("", None)  # a trusted worker has no limits
    kept = replace(LimitSettings(), device_memory_alone_share=0.0)  # a protocol that keeps its figure
    assert widened(kept, h200) == ("", kept)


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, seconds: float):
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_candidate_process_holding_the_gpu_lock_is_killed_and_named() -> None:
    """A candidate that takes kbv's gate lock would block every evaluation on its GPU for ever;
    the waiting evaluation kills it (it is one of the candidate's processes) and names it."""
    DeviceLock("cuda:6").close()  # makes the lock files
    gate = Path(tempfile.gettempdir()) / "kbv-device-locks" / "cuda-6.gate"
    squatter = _holder(gate, 600)
    started = time.monotonic()
    with DeviceLock("cuda:6", suspects=lambda: [squatter.pid]) as lock:
        assert time.monotonic() - started < 5
        killed = lock.take_tampering()
    assert squatter.wait(5) != 0
    assert [k["pid"] for k in killed] == [squatter.pid] and killed[0]["files"] == ["gate"]
    from kbv.integrity.dynamic import lock_tampering_findings

    (finding,) = lock_tampering_findings(killed)
    assert finding.check == "device_lock_tampering" and finding.severity == "fail"


def test_another_evaluations_hold_is_waited_for_not_killed() -> None:
    DeviceLock("cuda:8").close()
    gate = Path(tempfile.gettempdir()) / "kbv-device-locks" / "cuda-8.gate"
    other = _holder(gate, 1.0)  # not one of this evaluation's candidate processes
    started = time.monotonic()
    with DeviceLock("cuda:8", suspects=lambda: []) as lock:
        assert time.monotonic() - started >= 0.8  # it waited for the other hold to end
        assert lock.take_tampering() == []
    assert other.wait(5) == 0
