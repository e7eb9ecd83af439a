"""A candidate that runs out of device memory where kbv did not keep the room its limit promises is
kbv's failure (``HarnessError``), never the candidate's ``runtime_error``; one whose room was kept
keeps its failure, whatever it says."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RELU, load_relu_candidate, reference_worker

from kbv import evaluation, telemetry, wire
from kbv.evaluation.budget import (
    GPU_TOO_SMALL,
    PARENT_RAN_OUT,
    REFERENCE_RAN_OUT,
    _asked_bytes,
    _parent_ran_out,
    too_small_for_gpu,
)
from kbv.evaluation.context import _Found
from kbv.protocol import LimitSettings
from kbv.worker import MemoryBudget, Worker, WorkerFailed, WorkerSpec
from kbv.worker._process import RequestSpan

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
# The H100 of 2026-12-06 (79.18 GiB): 37_FrobeniusNorm's candidate (pid 30) ran out holding
# 49.72 GiB beside kbv's parent (10), reference (11) and three spares (12-14).
H100_TOTAL = int(79.18 * GIB)
H100_USAGE = {10: 14.69, 11: 7.71, 12: 0.72, 13: 0.62, 14: 0.72, 30: 49.72}
KBV_PROCESSES = {"kbv's parent": [10], "the reference worker": [11], "the spare workers": [12, 13, 14]}
OOM = "CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total capacity of 79.18 GiB"
# KernelBench's 45_Average_Pooling_2D with TF32 on an H100 (2026-12-07): the reference worker (pid
# 11), holding its 16 GiB float32 draw, asked for 32 GiB more for the float64 copy while the
# candidate (pid 30) held 32.74 GiB of its 64 GiB; torch's message in the reference named the others.
REFERENCE_OOM = (
    "CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacity of 79.18 GiB of "
    "which 23.20 GiB is free. Including non-PyTorch memory, this process has 16.71 GiB memory in use."
)
BESIDE_THE_REFERENCE = {10: 1.22, 11: 16.71, 12: 0.72, 13: 0.62, 14: 0.72, 30: 32.74}


def _case(monkeypatch: pytest.MonkeyPatch, usage: dict[int, float] | None, limit_gb: float = 59.4):
    monkeypatch.setattr(
        telemetry,
        "device_process_bytes",
        lambda device: None if usage is None else {pid: int(gb * GIB) for pid, gb in usage.items()},
    )
    gpu = evaluation._GpuState(held="alone", device_total_bytes=H100_TOTAL, budget=MemoryBudget())
    ctx = SimpleNamespace(gpu=gpu, device="cuda", found=_Found())
    subject = SimpleNamespace(limits=LimitSettings(device_memory_gb=limit_gb), members=lambda: [30, 31])
    return ctx, subject


def test_an_oom_where_kbvs_processes_left_less_than_the_promised_room_is_kbvs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctx, subject = _case(monkeypatch, H100_USAGE)
    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES)
    assert said is not None
    assert "held 24.5 GiB of its 79.2 GiB, leaving 54.7 GiB of the 59.4 GiB" in said
    assert "not the candidate's failure" in said and "Tried to allocate 7.00 GiB" in said
    # which of kbv's processes held the room, so the next reader knows what to cut
    assert (
        "kbv's parent 14.7 GiB, the reference worker 7.7 GiB, the spare workers 2.1 GiB, "
        "the candidate 49.7 GiB, 0 other processes 0.0 GiB" in said
    )
    assert too_small_for_gpu(said)


def test_an_oom_where_the_room_was_kept_stays_the_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same failure beside a lighter kbv (10 GiB held), a lower limit, no way to count, no limit,
    or NVML's pids from another namespace (the candidate's own use unknown): the candidate's
    failure, as before."""
    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    light = {10: 4.0, 11: 6.0, 30: 70.0}
    elsewhere = {pid + 1000: gb for pid, gb in H100_USAGE.items()}  # NVML's pids of another namespace
    cases = ((light, 59.4), (H100_USAGE, 40.0), (None, 59.4), (H100_USAGE, 0.0), (elsewhere, 59.4))
    for usage, limit_gb in cases:
        ctx, subject = _case(monkeypatch, usage, limit_gb)
        assert evaluation._room_not_kept(ctx, subject, failure) is None, (usage, limit_gb)


def test_only_a_workers_out_of_memory_on_a_gpu_is_looked_at(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, subject = _case(monkeypatch, H100_USAGE)
    others = [
        WorkerFailed("runtime_error", "index out of range", role="candidate"),
        WorkerFailed("runtime_error", "index out of range", role="reference"),  # the problem's
        WorkerFailed("runtime_error", OOM),  # no worker named: not a worker's room to weigh
        WorkerFailed("timeout", "no answer in 120 s", role="candidate"),
    ]
    for failure in others:
        assert evaluation._room_not_kept(ctx, subject, failure) is None, failure.message
    ctx.device = "cpu"
    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    assert evaluation._room_not_kept(ctx, subject, failure) is None


def test_an_evaluation_whose_room_was_not_kept_raises_and_records_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through a real evaluation (CPU, the room check forced): the candidate's out-of-memory error
    ends it as a ``HarnessError``, not a record."""
    from kbv import HarnessError, evaluate_paths
    from kbv.evaluation import orchestrator

    candidate = tmp_path / "oom.py"
    candidate.write_text(
        "import torch\n\n"
        "class ModelNew(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        f"        raise RuntimeError({OOM!r})\n"
    )
    said = f"{GPU_TOO_SMALL}: the other processes on it held 70 GiB"
    monkeypatch.setattr(orchestrator, "_room_not_kept", lambda *args: said)
    with pytest.raises(HarnessError, match="not through its own use") as raised:
        problem = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
        evaluate_paths(problem, candidate, protocol="verified", device="cpu")
    # the frames the worker's failure left hold none of the draw's tensors: the parent's device
    # memory is free for the next evaluation, not kept by the error (20 GiB on an H100)
    tb = raised.value.__cause__.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert len(frames) > 1 and all(frame.f_locals == {} for frame in frames[1:]), [
        (f.f_code.co_name, sorted(f.f_locals)) for f in frames
    ]


def test_a_reference_running_out_is_weighed_before_it_is_the_candidates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through a real evaluation (CPU): the reference worker's out-of-memory error reaches the room
    check, whose verdict (forced here) ends the evaluation as a ``HarnessError``; without it the
    failure stays the candidate's, since a candidate past its limit can starve the reference."""
    from kbv import HarnessError, evaluate_paths
    from kbv.evaluation import orchestrator

    problem = tmp_path / "starved.py"
    problem.write_text(
        (ROOT / "src/kbv/suite/problems/level1/1_ReLU.py")
        .read_text()
        .replace("return torch.relu(x)", f"raise RuntimeError({REFERENCE_OOM!r})")
    )
    assert REFERENCE_OOM in problem.read_text()
    honest = ROOT / "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    record = evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert record.outcome.value == "runtime_error"
    assert record.error is not None and record.error["worker"] == "reference"  # whose failure it was
    seen: list[WorkerFailed] = []

    def kbvs(ctx, subject, failure, *rest):  # type: ignore[no-untyped-def]
        seen.append(failure)
        return f"{REFERENCE_RAN_OUT}: it needed 48.7 GiB"

    monkeypatch.setattr(orchestrator, "_room_not_kept", kbvs)
    with pytest.raises(HarnessError, match="beside a candidate within its limit"):
        evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert [f.role for f in seen] == ["reference"] and "Tried to allocate 32.00 GiB" in seen[0].message


PARENT_OOM = "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 79.18 GiB"


def test_the_parents_own_out_of_memory_says_where_and_who_held_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The figures of 39_L2Norm_ on an H100 (2026-12-07): the parent ran out judging a draw while
    two workers held 40.7 and 8.6 GiB; torch's message did not say which was which, this one does."""
    ctx, subject = _case(monkeypatch, {10: 24.7, 11: 40.71, 30: 8.61, 99: 0.5})
    ctx.found = _Found(failed_phase="correctness")
    said = _parent_ran_out(ctx, subject, torch.OutOfMemoryError(PARENT_OOM), KBV_PROCESSES)
    assert said.startswith(PARENT_RAN_OUT) and too_small_for_gpu(said)
    assert "during correctness" in said and "promises it 59.4 GiB of the GPU's 79.2 GiB" in said
    assert "kbv's parent 24.7 GiB, the reference worker 40.7 GiB, the spare workers 0.0 GiB" in said
    assert "the candidate 8.6 GiB, 1 other processes 0.5 GiB" in said
    assert "not the candidate's failure" in said and "Tried to allocate 256.00 MiB" in said
    assert not too_small_for_gpu("CUDA out of memory (the candidate's own words)")


# 21_Sigmoid's `first_rows` mutant at bf16 on an H100 (2026-12-07): NVML listed 61.6 GiB of the
# 79.2 in kbv's processes and the candidate, and torch saw 5.5 GiB free: 12.1 GiB in no listed one.
SIGMOID_USAGE = {10: 30.66, 11: 27.7, 12: 0.9, 13: 0.85, 14: 0.85, 30: 0.6}
PARENT_SPLIT = {"allocated": int(24.0 * GIB), "reserved": int(30.0 * GIB), "free": int(5.53 * GIB)}


def test_kbvs_out_of_memory_errors_say_the_phase_and_what_the_parents_figure_and_the_gpu_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next cut needs to know which copies took the room: the phase that ran out, the parent's
    tensors against its allocator's cache, and memory no listed process holds (figures read after
    the failure); without a CUDA context in the parent, the phase alone."""
    from kbv.evaluation import budget

    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    ctx, subject = _case(monkeypatch, SIGMOID_USAGE, limit_gb=64.0)
    ctx.found = _Found(failed_phase="integrity")
    monkeypatch.setattr(budget, "allocator_figures", lambda device: {**PARENT_SPLIT, "total": H100_TOTAL})
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES)
    assert said is not None and said.startswith(GPU_TOO_SMALL)
    assert "It ran out during integrity; of kbv's parent's figure, 24.0 GiB were tensors in use and " in said
    assert "6.0 GiB its allocator's cache; 12.1 GiB of the GPU were held by no process NVML lists." in said
    # everything accounted for: no unlisted figure
    listed = {**PARENT_SPLIT, "free": H100_TOTAL - int(sum(SIGMOID_USAGE.values()) * GIB)}
    monkeypatch.setattr(budget, "allocator_figures", lambda device: {**listed, "total": H100_TOTAL})
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES)
    assert said is not None and "allocator's cache." in said and "no process NVML lists" not in said
    monkeypatch.setattr(budget, "allocator_figures", lambda device: None)
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES)
    assert said is not None and "It ran out during integrity. This problem needs" in said
    # the reference's and the parent's own out-of-memory errors carry the same figures
    monkeypatch.setattr(budget, "allocator_figures", lambda device: {**PARENT_SPLIT, "total": H100_TOTAL})
    ctx, subject = _case(monkeypatch, BESIDE_THE_REFERENCE, limit_gb=64.0)
    starved = WorkerFailed("runtime_error", REFERENCE_OOM, role="reference")
    said = evaluation._room_not_kept(ctx, subject, starved, KBV_PROCESSES, _reference_failed())
    assert said is not None and "It ran out during the evaluation; of kbv's parent's figure, 24.0" in said
    said = _parent_ran_out(ctx, subject, torch.OutOfMemoryError(PARENT_OOM), KBV_PROCESSES)
    assert "were tensors in use and 6.0 GiB its allocator's cache" in said


def _parent_out_of_memory_in_correctness(
    monkeypatch: pytest.MonkeyPatch, candidate_over: dict[str, object] | None
) -> None:
    """The parent's judging raises torch's out-of-memory error; ``candidate_over``: the limit the
    candidate's worker is past at that moment (its poll's answer), or None."""
    from kbv.evaluation import orchestrator

    def judging_runs_out(ctx, reference, subject):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(type(subject), "poll", lambda self: candidate_over if self is subject else None)
        raise torch.OutOfMemoryError(PARENT_OOM)

    monkeypatch.setattr(orchestrator, "_check_correctness", judging_runs_out)


def test_an_evaluation_whose_parent_runs_out_raises_kbvs_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real evaluation (CPU): the parent's own out-of-memory error is a ``HarnessError``
    naming the phase, which a batch records for the pair before it goes on to the next
    (``is_harness_error``). As torch's own error it stopped the whole TF32 sweep at 39_L2Norm_ on
    an H100 (2026-12-07)."""
    from kbv import HarnessError, evaluate_paths
    from kbv.execute._base import is_harness_error

    _parent_out_of_memory_in_correctness(monkeypatch, None)
    problem = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
    honest = ROOT / "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    with pytest.raises(HarnessError, match="during correctness") as raised:
        evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert too_small_for_gpu(str(raised.value)) and is_harness_error(raised.value)
    cause = raised.value.__cause__
    assert isinstance(cause, torch.OutOfMemoryError)
    # the frames it left hold no tensors now (their locals are cleared): the memory is free at once
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert frames[-1].f_code.co_name == "judging_runs_out" and frames[-1].f_locals == {}


def test_a_candidate_past_its_limit_when_the_parent_runs_out_is_its_resource_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same out-of-memory error while the candidate's worker is past its device limit: the
    room was the candidate's to lose, so the record is its ``resource_limit``, not kbv's error."""
    from kbv import evaluate_paths

    over = {"limit": "device_memory", "figure": 70 * GIB, "allowed": 64 * GIB, "unit": "bytes"}
    _parent_out_of_memory_in_correctness(monkeypatch, over)
    problem = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
    honest = ROOT / "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    record = evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert record.outcome.value == "resource_limit"
    assert record.error["summary"].startswith("device_memory limit exceeded: 71680.0 MiB used")


def _parent_out_of_memory_copying_the_candidates_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's copy of the candidate's hand-over raises torch's out-of-memory error, as the
    copies of KernelBench's 63_conv_standard_2D did in its cache probe on an H100 (2026-12-07)."""
    from kbv import handoff

    receive = handoff.receive

    def no_room_for_the_candidates(description, device, fds=None, *, bounded=False):  # type: ignore[no-untyped-def]
        if bounded:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return receive(description, device, fds, bounded=bounded)

    monkeypatch.setattr(handoff, "receive", no_room_for_the_candidates)


def test_the_parent_running_out_copying_an_honest_hand_over_is_kbvs_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An honest candidate's outputs, no more elements than the reference's: the parent's own
    shortage, kbv's ``HarnessError``. Wrapped as the hand-over's failure it was the honest
    candidate's ``runtime_error``."""
    from kbv import HarnessError, evaluate_paths

    _parent_out_of_memory_copying_the_candidates_outputs(monkeypatch)
    problem = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
    honest = ROOT / "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    with pytest.raises(HarnessError, match="during correctness") as raised:
        evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert str(raised.value).startswith(PARENT_RAN_OUT)


def test_the_parent_running_out_copying_an_oversized_hand_over_is_the_candidates_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hand-over that claims more elements than the outputs hold made the parent's shortage: the
    candidate's ``runtime_error``, never a harness error in place of its verdict."""
    from kbv import evaluate_paths, handoff

    _parent_out_of_memory_copying_the_candidates_outputs(monkeypatch)
    monkeypatch.setattr(handoff, "claimed_elements", lambda description: 10**12)
    problem = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
    honest = ROOT / "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    record = evaluate_paths(problem, honest, protocol="verified", device="cpu")
    assert record.outcome.value == "runtime_error"
    assert "handed over 1,000,000,000,000 elements for 1 call(s)" in record.error["message"]


def test_a_probes_hand_over_may_hold_each_of_its_calls_outputs() -> None:
    """The cache probe hands four calls' outputs over at once: up to four times the outputs'
    elements is honest, one more is not; before any output count is known, nothing is decided."""
    from kbv.evaluation.orchestrator import _oversized_handover

    ctx = SimpleNamespace(gpu=evaluation._GpuState(output_numels=[100, 20]))
    subject = SimpleNamespace(logs=lambda: {}, last_handover=(480, 4))
    assert _oversized_handover(ctx, subject) is None
    subject.last_handover = (481, 4)
    failure = _oversized_handover(ctx, subject)
    assert failure is not None and failure.kind == "runtime_error" and failure.role == "candidate"
    assert "out of memory" not in failure.message  # not weighed again as the room's
    ctx.gpu.output_numels = None
    assert _oversized_handover(ctx, subject) is None


def test_nvml_per_process_figures_are_read_per_pid_and_absent_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = [SimpleNamespace(pid=10, usedGpuMemory=5 * GIB), SimpleNamespace(pid=11, usedGpuMemory=None)]
    fake = SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: running,
    )
    monkeypatch.setattr(telemetry, "_nvml", lambda: fake)
    assert telemetry.device_process_bytes("cuda:0") == {10: 5 * GIB}  # no figure, no entry
    assert telemetry.process_memory_bytes("cuda:0", 10) == 5 * GIB  # what the limit poll reads
    assert telemetry.process_memory_bytes("cuda:0", 11) is None
    assert telemetry.device_process_bytes("cpu") is None
    running.clear()
    assert telemetry.device_process_bytes("cuda:0") is None  # nothing counted: nothing to decide on


# A candidate (pid 30) that runs out in its first draw beside a reference computing the same draw's
# truth (32.2 GiB at its peak): when its failure reaches the parent, the reference has handed its
# working memory back (1.5 GiB left), so NVML alone shows the room as kept.
AFTER_THE_DRAW = {10: 1.22, 11: 1.5, 12: 0.65, 13: 0.65, 14: 0.65, 30: 16.71}


def _reference(last_span: RequestSpan | None) -> SimpleNamespace:
    return SimpleNamespace(last_span=last_span, members=lambda: [11])


def test_the_references_peak_beside_the_failed_draw_counts_against_the_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    failed = RequestSpan(sent_at=10.0, replied_at=11.2, device_reserved_peak=None)
    beside = RequestSpan(sent_at=10.01, replied_at=11.0, device_reserved_peak=int(32.2 * GIB))
    ctx, subject = _case(monkeypatch, AFTER_THE_DRAW, limit_gb=64.0)
    subject.last_span = failed
    reference = _reference(beside)
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES, reference)
    assert said is not None and "held 35.4 GiB of its 79.2 GiB" in said  # 1.22 + 32.2 + 3 x 0.65
    assert (
        "the reference worker 32.2 GiB" in said
        and "its peak during its request beside the candidate's" in said
    )
    # NVML's figures alone, as before: the room looks kept, and the failure was the candidate's
    assert evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES) is None


def test_a_reference_peak_that_did_not_run_beside_the_failure_does_not_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failure = WorkerFailed("runtime_error", OOM, role="candidate")
    failed = RequestSpan(sent_at=10.0, replied_at=11.2, device_reserved_peak=None)
    ctx, subject = _case(monkeypatch, AFTER_THE_DRAW, limit_gb=64.0)
    subject.last_span = failed
    earlier = RequestSpan(sent_at=8.0, replied_at=9.5, device_reserved_peak=int(32.2 * GIB))
    unmeasured = RequestSpan(sent_at=10.01, replied_at=11.0, device_reserved_peak=None)  # off the GPU
    for span in (earlier, unmeasured, None):
        reference = _reference(span)
        assert evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES, reference) is None, span


def test_a_worker_notes_each_requests_span_as_the_parent_saw_it(tmp_path: Path) -> None:
    """The span of a real worker's request, its failed ones too (on the CPU no peak is reported)."""
    honest = tmp_path / "relu.py"
    honest.write_text("import torch\n\n\nclass ModelNew(torch.nn.ReLU):\n    pass\n")
    spec = WorkerSpec(build_key="test-spans", device="cpu", role="candidate", budget_s=60.0)
    with Worker(spec) as worker:
        load_relu_candidate(worker, honest)
        before = time.monotonic()
        worker.request(
            wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
        )
        span = worker.last_span
        assert span is not None and before <= span.sent_at <= span.replied_at <= time.monotonic()
        assert span.device_reserved_peak is None
        with pytest.raises(WorkerFailed):
            worker.request(
                wire.Run(distribution="no such", seed=3, precision="native", out_path=worker.new_path("o"))
            )
        assert worker.last_span is not None and worker.last_span.sent_at > span.replied_at


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_workers_reply_says_its_allocators_peak_during_the_request() -> None:
    """What the room rule reads of the reference: its allocator's peak covers the request's own work
    (a 1 GiB input and output here), whatever it handed back before replying."""
    with reference_worker("peak", RELU, {"batch_size": 256, "dim": 1 << 20}, device="cuda") as worker:
        worker.request(
            wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
        )
        span = worker.last_span
        assert span is not None and span.device_reserved_peak is not None
        assert span.device_reserved_peak >= 256 * (1 << 20) * 4  # at least the output's bytes


def _reference_failed(peak_gib: float = 16.0) -> SimpleNamespace:
    """The reference worker, its failed request's span carrying its allocator's peak."""
    return _reference(RequestSpan(sent_at=10.0, replied_at=10.6, device_reserved_peak=int(peak_gib * GIB)))


def test_a_reference_that_ran_out_beside_a_candidate_within_its_limit_is_kbvs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where what the reference needed, with kbv's other processes, leaves less than the candidate's
    promised room, an honest candidate could not have avoided it: kbv's error, not the candidate's
    ``runtime_error`` (which 45_Average_Pooling_2D was given)."""
    failure = WorkerFailed("runtime_error", REFERENCE_OOM, role="reference")
    ctx, subject = _case(monkeypatch, BESIDE_THE_REFERENCE, limit_gb=64.0)
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES, _reference_failed())
    assert said is not None and said.startswith(REFERENCE_RAN_OUT) and too_small_for_gpu(said)
    # 16.71 held + 32.00 asked; with the parent's 1.22 and the spares' 2.06: 52.0 of 79.2
    assert "it needed 48.7 GiB (what it held, 16.7 GiB by NVML or its allocator's peak, and the 32.0" in said
    assert "needed 52.0 GiB of its 79.2 GiB, leaving 27.2 GiB of the 64.0 GiB" in said
    assert "the candidate held 32.7 GiB, within it" in said and "the reference worker 48.7 GiB" in said
    assert "not the candidate's failure" in said and "Tried to allocate 32.00 GiB" in said
    # the reference's peak counts where NVML shows less (its working memory handed back)
    handed_back = {**BESIDE_THE_REFERENCE, 11: 1.5}
    ctx, subject = _case(monkeypatch, handed_back, limit_gb=64.0)
    said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES, _reference_failed(16.0))
    assert said is not None and "what it held, 16.0 GiB by NVML or its allocator's peak" in said


def test_a_reference_that_ran_out_where_the_room_fitted_stays_the_candidates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The candidate past its limit, a GPU with room for both (a lower promise), no reference to ask,
    or no figures: the candidate's failure, as before."""
    failure = WorkerFailed("runtime_error", REFERENCE_OOM, role="reference")
    past_its_limit = {**BESIDE_THE_REFERENCE, 30: 70.0}
    cases = (
        (past_its_limit, 64.0, _reference_failed()),
        ({**BESIDE_THE_REFERENCE, 30: 10.0}, 20.0, _reference_failed()),
        (BESIDE_THE_REFERENCE, 64.0, None),
        (None, 64.0, _reference_failed()),
    )
    for usage, limit_gb, reference in cases:
        ctx, subject = _case(monkeypatch, usage, limit_gb)
        said = evaluation._room_not_kept(ctx, subject, failure, KBV_PROCESSES, reference)
        assert said is None, (usage, limit_gb, reference)


def test_the_size_a_trusted_worker_asked_for_is_read_from_torchs_message() -> None:
    assert _asked_bytes(REFERENCE_OOM) == 32 * GIB
    assert _asked_bytes("CUDA out of memory. Tried to allocate 256.00 MiB.") == 256 << 20
    assert _asked_bytes("CUDA out of memory. Tried to allocate 512 bytes.") == 512
    assert _asked_bytes("out of memory") == 0  # nothing said: nothing added


def test_the_parents_allocator_figures_are_absent_on_the_cpu() -> None:
    from kbv.devices import allocator_figures

    assert allocator_figures("cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_parents_allocator_figures_tell_tensors_from_cache_on_a_gpu() -> None:
    from kbv.devices import allocator_figures

    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    figures = allocator_figures("cuda")
    assert figures is not None and figures["allocated"] >= held.numel()
    assert figures["allocated"] <= figures["reserved"] and figures["free"] < figures["total"]
    del held
    cached = allocator_figures("cuda")
    assert cached is not None and cached["reserved"] - cached["allocated"] >= 256 << 20
