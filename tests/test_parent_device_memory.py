"""What the parent holds on the GPU at KernelBench sizes: an evaluation that holds its GPU alone
hands back each correctness draw's blocks before the next draw, and the parent's whole-output
checks run in chunks, so no temporary is as large as a float64 truth (an 80 GB H100 ran out of
memory in the parent and beside it: results/2026-12-06-h100-service-bf16-memory/)."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import peak_rss_rise

from kbv import error_stats
from kbv.evaluation import draws
from kbv.evaluation.budget import GPU_TOO_SMALL
from kbv.evaluation.context import _Found, _GpuState, _ReferenceCache
from kbv.evaluation.reference import _all_finite
from kbv.integrity.dynamic.outputs import (
    REPEAT_ULPS,
    _apart_by_less_than_output_ulps,
    _bitwise_equal,
    _nan_where_finite,
    _uniform,
)
from kbv.protocol import VERIFIED
from kbv.worker import WorkerFailed


class _Output:
    """Stands for a draw's device tensors: the test sees whether the parent still holds it."""


def _draw_loop(monkeypatch: pytest.MonkeyPatch, held: str) -> tuple[list[bool], int]:
    """Run one distribution's draws with stub workers; for every release of cached blocks, whether
    the draw's expected outputs were already dropped by then, and the number of draws."""
    alive: list[weakref.ref[_Output]] = []
    released: list[bool] = []

    def usable_reference(ctx: Any, reference: Any, variant: str, seed: int) -> tuple[dict, str]:
        output = _Output()
        alive.append(weakref.ref(output))
        return {"reference": {"outputs": [output]}}, variant

    def release(device: str) -> None:
        gc.collect()
        released.append(alive[-1]() is None)

    monkeypatch.setattr(draws._reference, "_usable_reference", usable_reference)
    monkeypatch.setattr(draws, "_run", lambda *a, **k: {"outputs": [_Output()]})
    monkeypatch.setattr(draws, "_judge_draw", lambda ctx, got, expected: {"passed": True})
    monkeypatch.setattr(draws, "_output_numels", lambda expected: [1])
    monkeypatch.setattr(draws, "release_cached_blocks", release)
    monkeypatch.setattr(draws, "draws_overlap", lambda device: False)  # one stub worker at a time
    ctx = SimpleNamespace(
        protocol=VERIFIED,
        seeds=SimpleNamespace(draw=lambda distribution, k: 1000 + k),
        device="cpu",
        gpu=_GpuState(held=held),
        found=_Found(),
        longest_reduction=1,  # known, as after a problem's first draw
    )
    result = draws._check_distribution(ctx, None, None, "original")  # type: ignore[arg-type]
    assert result.passed
    return released, VERIFIED.correctness.draws_per_distribution


def test_a_gpu_held_alone_gets_each_draws_blocks_back_once_the_parent_let_go(monkeypatch):
    released, draws_made = _draw_loop(monkeypatch, "alone for the whole evaluation: 6.4 GB of inputs")
    assert len(released) == draws_made
    assert all(released), "the draw's outputs were still held when the blocks were released"


def test_a_shared_gpu_keeps_the_allocators_blocks_between_draws(monkeypatch):
    released, _ = _draw_loop(monkeypatch, "shared with other evaluations outside the timing phase")
    assert released == []


def test_a_failing_draws_truth_and_outputs_are_gone_before_a_re_run_asks_for_its_truth(monkeypatch):
    """A draw that fails is run again; each re-run's float64 truth arrives once the parent has let
    go of the failing draw's truth and outputs and of the last re-run's, and the allocator's blocks
    went back first where the GPU is held alone. Kept, the parent held two truths of a
    2.1e9-element output at once (an H100 ran out, 2026-12-08)."""
    alive: list[weakref.ref[_Output]] = []
    seen_at_re_runs: list[list[bool]] = []
    released: list[str] = []

    def held() -> _Output:
        output = _Output()
        alive.append(weakref.ref(output))
        return output

    def re_run_truth(ctx: Any, reference: Any, variant: str, seed: int, fresh: bool) -> dict:
        gc.collect()
        seen_at_re_runs.append([ref() is not None for ref in alive])
        return {"reference": {"outputs": [held()]}}

    def first_truth(ctx: Any, reference: Any, variant: str, seed: int) -> tuple[dict, str]:
        return {"reference": {"outputs": [held()]}}, variant

    verdicts = iter([False] + [True] * 8)  # the first draw fails, its re-runs pass: a transient
    monkeypatch.setattr(draws._reference, "_usable_reference", first_truth)
    monkeypatch.setattr(draws._reference, "_reference_outputs", re_run_truth)
    monkeypatch.setattr(draws, "_run", lambda *a, **k: {"outputs": [held()]})
    monkeypatch.setattr(
        draws, "_judge_draw", lambda ctx, got, expected: {"passed": next(verdicts), "tolerance": {}}
    )
    monkeypatch.setattr(draws, "_output_numels", lambda expected: [1])
    monkeypatch.setattr(draws, "release_cached_blocks", released.append)
    monkeypatch.setattr(draws, "draws_overlap", lambda device: False)
    ctx = SimpleNamespace(
        protocol=VERIFIED,
        seeds=SimpleNamespace(draw=lambda distribution, k: 1000 + k),
        device="cuda",
        gpu=_GpuState(held="alone for the whole evaluation: 17.2 GB of inputs"),
        found=_Found(),
        longest_reduction=1,
    )
    result = draws._check_distribution(ctx, None, None, "original")  # type: ignore[arg-type]
    assert result.passed and len(ctx.found.transients) == 1
    assert len(seen_at_re_runs) == VERIFIED.correctness.confirm_reruns >= 2
    assert not any(any(kept) for kept in seen_at_re_runs), "a truth or output was held into a re-run"
    # once before the re-runs, after each re-run, and after each of the distribution's draws
    reruns, draws_made = VERIFIED.correctness.confirm_reruns, VERIFIED.correctness.draws_per_distribution
    assert len(released) == 1 + reruns + draws_made


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(error_stats, "CHUNK_ELEMENTS", 7)


def test_nan_where_the_truth_is_finite_is_counted_across_chunks(small_chunks):
    truth = torch.linspace(-1, 1, 50, dtype=torch.float64).reshape(5, 10)
    truth[0, 0] = math.nan  # NaN in both: not a finding
    got = truth.to(torch.float32).clone()
    got[0, 0] = math.nan
    assert _nan_where_finite([got], [truth]) == 0  # accept
    got[4, 9] = got[2, 3] = got[1, 0] = math.nan  # in three different chunks of 7
    assert _nan_where_finite([got], [truth]) == 3  # reject


def test_a_non_finite_output_is_found_in_any_chunk(small_chunks):
    finite = torch.arange(50, dtype=torch.float64).reshape(5, 10)
    assert _all_finite([finite])  # accept
    for position in (0, 23, 49):
        bad = finite.clone()
        bad.view(-1)[position] = math.inf
        assert not _all_finite([bad]), position  # reject, whichever chunk holds it


def test_the_cache_probes_uniform_and_equal_outputs_are_judged_across_chunks(small_chunks):
    """The cache probe's whole-output tests read a chunk at a time and still see every element."""
    flat = torch.full((5, 10), 3.0)
    assert _uniform([flat])  # accept
    truth = torch.linspace(-1, 1, 50, dtype=torch.float64).reshape(5, 10)
    assert _bitwise_equal([truth], [truth.clone()])  # accept
    for position in (0, 23, 49):  # reject, whichever chunk differs
        other, bumped = flat.clone(), truth.clone()
        other.view(-1)[position] = 4.0
        bumped.view(-1)[position] += 2.0**-40
        assert not _uniform([other]), position
        assert not _bitwise_equal([truth], [bumped]), position


def test_two_truths_within_a_few_output_ulps_are_one_answer_in_every_chunk(small_chunks):
    """Truths that a bf16 output cannot tell apart (under REPEAT_ULPS of bf16 at the element's
    magnitude, or at the truth's RMS near zero) are one answer; one element further apart, or a NaN
    against a number, in any chunk, makes them two."""
    out = [torch.zeros(50, dtype=torch.bfloat16)]
    x = torch.linspace(1, 2, 50, dtype=torch.float64)
    x[10], x[20] = 0.0, math.nan
    unit = REPEAT_ULPS * torch.finfo(torch.bfloat16).eps
    near = x * (1 + unit / 2)
    near[10] = unit / 2  # near zero: judged at the truth's RMS, not at its own magnitude
    assert _apart_by_less_than_output_ulps(out, [x], [near])  # accept
    for position in (0, 23, 49):
        far = near.clone()
        far[position] *= 1 + 4 * unit
        assert not _apart_by_less_than_output_ulps(out, [x], [far]), position  # reject
    number = near.clone()
    number[20] = 1.5
    assert not _apart_by_less_than_output_ulps(out, [x], [number])  # a NaN against a number


def test_the_uniform_output_test_makes_no_temporary_of_the_outputs_size() -> None:
    """In a fresh process, telling whether a 400 MB output holds one value raises the peak RSS by
    about one chunk's bool temporary (34 MB), not by the 400 MB that ``x == x[0]`` of the whole
    output makes (measured in a process of its own as the control). On a GPU ``torch.equal`` makes
    the same temporary, which the CPU's does not: that half is shown by the chunked test above."""

    def peak_rise(call: str) -> int:
        imports = "from kbv.integrity.dynamic.outputs import _uniform"
        return peak_rss_rise(imports, "torch.zeros(400_000_000, dtype=torch.uint8)", call)

    assert peak_rise("bool((x == x.reshape(-1)[0]).all())") > 350e6  # the control
    assert peak_rise("_uniform([x])") < 150e6


class _Worker:
    """A stub worker that answers every request at once and notes what it was asked."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def request(self, request: Any) -> str:
        self.log.append(f"{self.name}:{type(request).__name__}")
        return "reply"

    def send_request(self, request: Any) -> str:
        self.log.append(f"{self.name}:{type(request).__name__}")
        return "id"

    def receive_reply(self, request_id: str) -> str:
        return "reply"


def _probe_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from kbv import wire
    from kbv.integrity.dynamic import _context

    log: list[str] = []
    monkeypatch.setattr(_context, "release_cached_blocks", lambda device: log.append(f"release:{device}"))
    candidate, reference = _Worker(log, "candidate"), _Worker(log, "reference")
    session = SimpleNamespace(device="cuda:0", subject=candidate, reference=reference)
    ctx = _context.DynamicContext(session)
    spec = {"distribution": "normal", "seed": 1}
    ctx.request(session.reference, wire.ProbeFlops(inputs=spec))
    ctx.request(session.subject, wire.ProbeCalls(inputs=spec))
    ctx.concurrently(
        {
            "kernels": (session.subject, wire.ProbeKernels(inputs=spec)),
            "flops": (session.reference, wire.ProbeFlops(inputs=spec)),
        }
    )
    return log


def test_the_parent_hands_its_cached_blocks_back_before_each_probe_of_the_candidate(monkeypatch):
    log = _probe_log(monkeypatch)
    # a release right before each request to the candidate, on its device; none before the reference's
    assert log == [
        "reference:ProbeFlops",
        "release:cuda:0",
        "candidate:ProbeCalls",
        "release:cuda:0",
        "candidate:ProbeKernels",
        "reference:ProbeFlops",
    ]


def test_the_parents_peak_reservation_is_counted_toward_every_phase_open_while_it_was_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peaks since the last mark (a fake allocator's) go to the phases open between the marks: an
    inner phase's peak counts toward the outer one, a later phase's does not count toward an
    earlier one, and nothing is recorded where there is no CUDA context (None)."""
    from kbv.evaluation import context

    peaks = iter([5, 7, 30, 12, 9, 40, 3, 8])
    monkeypatch.setattr(context, "reserved_peak_since_last_mark", lambda device: next(peaks))
    ctx = SimpleNamespace(found=_Found(), device="cuda")
    # marks: correctness starts (5, nothing open), probe starts (7: correctness), probe ends (30:
    # both), correctness ends (12: correctness); integrity starts (9: nothing), ends (40: integrity)
    context._phase(ctx, "correctness", lambda: context._phase(ctx, "probe:cache", lambda: None))
    with context._phase_entered(ctx, "integrity", contextlib.nullcontext()):
        pass
    assert ctx.found.parent_peaks == {"correctness": 30, "probe:cache": 30, "integrity": 40}
    assert ctx.found.open_phases == []
    # a failing phase still closes its count, and the phase that failed is named
    with pytest.raises(RuntimeError):
        context._phase(ctx, "timing", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    assert ctx.found.failed_phase == "timing" and ctx.found.open_phases == []

    monkeypatch.setattr(context, "reserved_peak_since_last_mark", lambda device: None)
    cpu = SimpleNamespace(found=_Found(), device="cpu")
    context._phase(cpu, "correctness", lambda: None)
    assert cpu.found.parent_peaks == {}


class _OutOfRoomOnce:
    """A candidate worker whose first draw beside the reference runs out of device memory (or, where
    the reference is the one, answers it)."""

    def __init__(self, fails: bool, ended: bool = False) -> None:
        self.sent, self.fails, self.ended = 0, fails, ended
        self.ops: list[str] = []

    def send_request(self, request: Any) -> int:
        self.sent += 1
        return self.sent

    def request(self, request: Any) -> Any:
        self.ops.append(request.op)

    def receive_reply(self, request_id: int) -> Any:
        if self.fails:
            raise WorkerFailed(
                "runtime_error", "create returned CUresult 2 (out of memory)", role="candidate"
            )
        return None

    def new_path(self, stem: str) -> str:
        return stem

    def alive(self) -> bool:
        return not self.ended


def _overlapped_loop(
    monkeypatch: pytest.MonkeyPatch,
    held: str,
    kbv_held_the_room: bool,
    who: str = "candidate",
    ended: bool = False,
) -> SimpleNamespace:
    """One distribution's draws side by side with stub workers, the first draw of ``who`` running
    out of device memory; what the loop did: the draws run alone, the releases, the context."""
    alone_runs: list[int] = []
    released: list[str] = []
    asked: list[int] = []

    def usable_reference(ctx: Any, ref: Any, variant: str, seed: int) -> tuple[dict, str]:
        asked.append(seed)
        if who == "reference" and len(asked) == 1:
            raise WorkerFailed(
                "runtime_error", "CUDA out of memory. Tried to allocate 32.00 GiB", role="reference"
            )
        return {}, variant

    monkeypatch.setattr(draws._reference, "_usable_reference", usable_reference)
    monkeypatch.setattr(draws, "_received", lambda worker, reply: {})
    monkeypatch.setattr(draws, "_run", lambda worker, variant, seed, precision: alone_runs.append(seed) or {})
    monkeypatch.setattr(draws, "_judge_draw", lambda ctx, got, expected: {"passed": True})
    monkeypatch.setattr(draws, "_output_numels", lambda expected: [1])
    monkeypatch.setattr(draws, "release_cached_blocks", released.append)
    monkeypatch.setattr(draws, "_room_for_candidate", lambda ctx, subject: None)
    reason = GPU_TOO_SMALL if kbv_held_the_room else None
    monkeypatch.setattr(draws, "_room_not_kept", lambda ctx, subject, failure, reference=None: reason)
    ctx = SimpleNamespace(
        protocol=VERIFIED,
        seeds=SimpleNamespace(draw=lambda distribution, k: 1000 + k),
        device="cuda",
        gpu=_GpuState(held=held, drawing=True),
        found=_Found(),
        cache=_ReferenceCache(tf32_operators_asked=True),
        longest_reduction=1,
    )
    subject = _OutOfRoomOnce(fails=who == "candidate", ended=ended)
    reference = SimpleNamespace(ops=[])
    reference.request = lambda request: reference.ops.append(request.op)
    reference.alive = lambda: True
    result = draws._check_distribution(ctx, reference, subject, "original")  # type: ignore[arg-type]
    return SimpleNamespace(
        result=result,
        alone_runs=alone_runs,
        released=released,
        ctx=ctx,
        subject=subject,
        reference=reference,
        asked=asked,
    )


@pytest.mark.parametrize("who", ["candidate", "reference"])
def test_a_worker_out_of_room_beside_the_others_draw_runs_it_again_alone(monkeypatch, who):
    """Where kbv's processes held the room (the other worker at its peak beside the draw), the draw
    is run again one worker after the other, and the rest follow so."""
    done = _overlapped_loop(monkeypatch, "alone for the whole evaluation: 7.6 GB of inputs", True, who)
    per_distribution = VERIFIED.correctness.draws_per_distribution
    assert done.result.passed
    assert done.subject.sent == 1, "only the first draw ran side by side"
    assert done.alone_runs == [1000 + k for k in range(per_distribution)]
    assert done.asked == [1000] * (who == "reference") + [1000 + k for k in range(per_distribution)]
    assert done.ctx.gpu.drawing is False
    assert f"one after the other from original draw 0 on (the {who} ran out" in done.ctx.gpu.held
    assert done.ctx.gpu.held.startswith("alone")
    assert done.released, "the parent kept its cached blocks for the draw run again"
    assert done.reference.ops == ["release"] == done.subject.ops, "a worker kept what it held beside the draw"
    assert done.ctx.cache.tf32_operators_asked is (who == "candidate"), "asked again after a failed request"


@pytest.mark.parametrize("who", ["candidate", "reference"])
def test_a_worker_out_of_room_of_the_candidates_own_use_keeps_its_failure(monkeypatch, who):
    with pytest.raises(WorkerFailed, match="out of memory"):
        _overlapped_loop(monkeypatch, "alone for the whole evaluation: 7.6 GB of inputs", False, who)


def test_a_shared_gpu_does_not_run_a_draw_again(monkeypatch):
    """Beside other evaluations the room may be theirs: the decision stays the orchestrator's."""
    with pytest.raises(WorkerFailed, match="out of memory"):
        _overlapped_loop(monkeypatch, "shared with other evaluations outside the timing phase", True)


def test_a_candidate_whose_worker_was_ended_keeps_that_failure(monkeypatch):
    """A worker the parent ended (a CUDA error, a limit) cannot run the draw again."""
    with pytest.raises(WorkerFailed, match="out of memory"):
        _overlapped_loop(monkeypatch, "alone for the whole evaluation: 7.6 GB of inputs", True, ended=True)
