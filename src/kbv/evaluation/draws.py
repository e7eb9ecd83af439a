"""The correctness draws: both models built per distribution, each draw run by both workers and
judged by the parent, a failing draw confirmed by re-runs."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

from kbv import correctness, wire, wire_replies
from kbv.channel import memfd_available
from kbv.devices import release_cached_blocks
from kbv.evaluation import reference as _reference
from kbv.evaluation.budget import _output_numels, _room_for_candidate, _room_not_kept
from kbv.evaluation.context import _Context, _phase, _structure
from kbv.evaluation.requests import _forward, _received, _run
from kbv.records import DistributionResult
from kbv.worker import Worker, WorkerFailed


def _check_correctness(ctx: _Context, reference: Worker, subject: Worker) -> list[DistributionResult]:
    ctx.gpu.drawing = draws_overlap(ctx.device)
    _room_for_candidate(ctx, subject)
    try:
        # On a GPU the candidate's build is not waited for: its reply is read after the first draw's
        # reference work, so loading the parameters overlaps it (requests are answered in order).
        return _check_distributions(ctx, reference, subject, wait=not ctx.gpu.drawing)
    finally:
        ctx.gpu.drawing = False
        _room_for_candidate(ctx, subject)


def _check_distributions(
    ctx: _Context, reference: Worker, subject: Worker, wait: bool
) -> list[DistributionResult]:
    settings = ctx.protocol.correctness
    results: list[DistributionResult] = []
    for distribution in settings.distributions:
        unneeded = _without_long_reduction(ctx, distribution)
        if unneeded is not None:
            results.append(unneeded)
            continue
        # A part of the correctness phase, kept apart: parameters redrawn by the reference and given
        # to the candidate (``_redrawn_state``).
        pending = _phase(
            ctx,
            "correctness:parameters",
            lambda d=distribution: _build_pair(ctx, reference, subject, d, wait=wait),
        )
        results.append(_check_distribution(ctx, reference, subject, distribution))
        if pending is not None:  # (its reply was read before the first draw's, and kept for its id)
            _note_build(ctx, subject.receive_reply(pending))
    return results


def _without_long_reduction(ctx: _Context, distribution: str) -> DistributionResult | None:
    """A distribution drawn only for long reductions, not applicable where the first draw's outputs
    reduce fewer input elements (nothing is built or drawn for it); None where it is drawn. Before
    any draw the length is not known, and the distribution is drawn."""
    settings = ctx.protocol.correctness
    longest = ctx.longest_reduction
    if distribution not in settings.long_reduction_distributions or longest is None:
        return None
    if longest >= settings.long_reduction_min:
        return None
    note = (
        f"drawn only where an output element reduces at least {settings.long_reduction_min} input "
        f"elements; here at most {longest}: not counted"
    )
    return DistributionResult(distribution, applicable=False, passed=False, note=note, draws=0)


def _longest_reduction(ctx: _Context, expected: dict[str, Any]) -> int:
    """How many input elements an output element of this problem reduces at most (1 when none)."""
    outputs = (expected.get("truth") or expected.get("reference") or {}).get("outputs") or []
    return max(correctness.reduction_lengths(_structure(ctx).numels, outputs), default=1)


def _note_build(ctx: _Context, reply: wire_replies.Reply) -> None:
    """Where the candidate's model had its parameters loaded after ``__init__``, the record says so."""
    if wire_replies.BuildReply.of(reply).parameters == "state_dict_after_init":
        distribution = ctx.cache.state_key[1] if len(ctx.cache.state_key) > 1 else "?"
        if distribution not in ctx.found.loaded_after_init:
            ctx.found.loaded_after_init.append(str(distribution))


def _build_pair(
    ctx: _Context, reference: Worker, subject: Worker, distribution: str, *, wait: bool = True
) -> int | None:
    """Both models with the parameters of ``distribution`` (the same seed gives the same values,
    so the dynamic checks can rebuild a correctness distribution's models and reuse its draws).
    ``wait=False`` sends the candidate's build without waiting and returns its request id, whose
    reply the caller awaits (``Worker.receive_reply``)."""
    init_seed = ctx.seeds.init(distribution)
    reference.request(wire.Build(init_seed=init_seed))
    build = wire.Build(init_seed=init_seed)
    if ctx.cache.parameters_mode == "state_dict":
        build = _redrawn_state(ctx, reference, subject, distribution, build)
    ctx.cache.state_key = ("distribution", distribution, init_seed, ctx.cache.parameters_mode)
    if not wait:
        return subject.send_request(build)
    _note_build(ctx, subject.request(build))
    return None


def _redrawn_state(
    ctx: _Context, reference: Worker, subject: Worker, distribution: str, build: wire.Build
) -> wire.Build:
    """The reference's parameters redrawn for ``distribution``, delivered to the candidate; ``build``
    naming them. On a GPU they stay on the device: the reference hands them to the
    parent, the candidate opens an empty inbox of its own and the parent writes them into it (a file
    cost 4-5 s per distribution for an MLP's 2.7 GB on the H200, 27 s of a 51 s evaluation).
    Elsewhere they go through a file, given into the candidate's scratch."""
    out_path = reference.new_path("params")
    seed = ctx.seeds.params(distribution)
    if not ctx.device.startswith("cuda"):
        reference.request(wire.Redraw(distribution=distribution, seed=seed, out_path=out_path))
        return replace(build, state_path=subject.give(out_path))  # a copy its own uid may read
    from kbv import handoff

    redraw = wire.Redraw(distribution=distribution, seed=seed, out_path=out_path, hand_over=True)
    reply = wire_replies.RedrawReply.of(reference.request(redraw))
    if reply.names is None or reply.outputs is None:
        raise wire.WireError("the reference's redraw reply hands no parameters over")
    named = dict(zip(reply.names, reference.receive_outputs(reply.outputs), strict=True))
    items, needed = handoff.inbox_layout(named)
    opened = wire_replies.InboxReply.of(subject.request(wire.Inbox(nbytes=needed)))
    subject.fill_inbox(opened.inbox, named, items)
    return replace(build, state_inbox=items)


def _build_for_timing(ctx: _Context, reference: Worker, subject: Worker) -> None:
    """Both models with the timing (and dynamic-check) parameters: the ``original`` init seed."""
    init_seed = ctx.seeds.init("original")
    reference.request(wire.Build(init_seed=init_seed))
    subject.request(wire.Build(init_seed=init_seed))
    ctx.cache.state_key = ("init", init_seed)


def _check_distribution(
    ctx: _Context, reference: Worker, subject: Worker, distribution: str
) -> DistributionResult:
    settings = ctx.protocol.correctness
    draws: list[dict[str, Any]] = []
    variant = distribution
    expected: dict[str, Any] | None = None
    ahead: _Ahead | None = None
    for k in range(settings.draws_per_distribution):
        seed = ctx.seeds.draw(distribution, k)
        # The last draw's tensors go before this draw's arrive: held across the next draw, its
        # float64 truth, baseline and candidate outputs doubled the parent's share of the GPU (on
        # the H200 51 GB of a 7.5 GB-input problem, which then ran out of memory).
        expected = outputs = None
        if ahead is not None:  # asked for while the previous draw was judged
            outputs, first = ahead.answers(ctx, reference, subject)
            ahead = None
            expected, used = _reference._usable_reference(ctx, reference, variant, seed, first=first)
        elif ctx.gpu.drawing:
            # The candidate runs its draw while the reference computes the baseline and the truth of
            # the same draw: two processes, so the draw costs the slower side, not the sum. Nothing
            # passes between them; the parent judges once both have answered. Outputs None: the
            # candidate's draw is run again below, alone.
            expected, used, outputs = _side_by_side(
                ctx, (reference, subject), variant, seed, f"{distribution} draw {k}"
            )
        else:
            expected, used = _reference._usable_reference(ctx, reference, variant, seed)
        if expected is None:
            note = (
                f"the reference is not finite under {distribution} nor any domain-preserving variant "
                "of it; not counted"
            )
            return DistributionResult(
                distribution, applicable=False, passed=False, note=note, draws=len(draws)
            )
        if outputs is None or used != variant:  # (again where the reference fell back to a variant)
            outputs = _run(subject, used, seed, "native")
        variant = used
        if ctx.gpu.output_numels is None:
            ctx.gpu.output_numels = _output_numels(expected)
        if ctx.longest_reduction is None:
            ctx.longest_reduction = _longest_reduction(ctx, expected)
        if ctx.gpu.on_first_outputs is not None:
            hook, ctx.gpu.on_first_outputs = ctx.gpu.on_first_outputs, None
            hook(expected)
        if k + 1 < settings.draws_per_distribution and draws_ahead(ctx):
            ahead = _Ahead.ask(ctx, reference, subject, variant, ctx.seeds.draw(distribution, k + 1))
        judged = _judge_draw(ctx, outputs, expected)
        if not judged["passed"]:
            if ahead is not None:  # re-runs on quiet workers; a transient's next draw is asked anew
                ahead.drop(ctx, reference, subject)
                ahead = None
            # The failing draw's truth and outputs go before a re-run's arrive: kept, the parent
            # held them beside the re-run's float64 truth (63_conv_standard_2D's first_rows mutant
            # at bf16 on an H100: 20.0 GiB in use and 15.9 more asked for, 2026-12-08).
            expected = outputs = None
            _release_if_alone(ctx)
            judged = _confirm_failure(
                ctx, reference, subject, f"{distribution} draw {k}", variant, seed, judged
            )
        draws.append(judged)
        # What the allocator cached for this draw's truth and comparison goes back before the
        # reference computes the next truth: kept, the parent held 30 GB reserved beside a
        # reference needing 25 GB for a 6.4 GB-input draw, and an 80 GB H100 ran out
        # (results/2026-12-06-h100-service-bf16-memory/).
        expected = outputs = None
        _release_if_alone(ctx)
        if not draws[-1]["passed"]:
            break
    result = correctness.judge_distribution(distribution, draws, settings)
    ctx.found.variants[distribution] = variant
    if variant != distribution:
        note = f"reference not finite on {distribution}; used the domain-preserving variant {variant}"
        result.note = (note + "; " + result.note).strip("; ")
    return result


def _side_by_side(
    ctx: _Context, workers: tuple[Worker, Worker], variant: str, seed: int, label: str
) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None]:
    """One draw with the candidate's run beside the reference's answer: (the reference's expected,
    the variant it used, the candidate's outputs). Where either worker ran out of device memory in
    room the other processes held (:func:`kbv.evaluation.budget._room_not_kept`: kbv's, with a
    candidate within its limit) on a GPU the evaluation holds alone, the draws go one after the
    other from here on (:func:`_draws_apart`): a reference that ran out is asked again once the
    candidate has answered, and the candidate's outputs are None, for the caller to run its draw
    again, alone. Beside the other's peak an honest worker finds no room that it would have once
    the other has answered: on an H100 36_RMSNorm_'s candidate had 17.4 GiB beside a reference of
    28.9 GiB (35.9 at its peak) and the parent's copy of the float64 truth, where one after the
    other would leave it about 44 (2026-12-07,
    benchmarks/results/2026-12-07-h100-probe-reads-cost-tf32/); 45_Average_Pooling_2D's reference
    asked for 32 GiB beside a candidate of 16.6. Overlapping saves the candidate's seconds on every
    draw, so the draws stay side by side until that happens."""
    reference, subject = workers
    run = subject.send_request(_forward(subject, variant, seed, "native"))
    try:
        expected, used = _reference._usable_reference(ctx, reference, variant, seed)
    except WorkerFailed as failure:
        if not _room_was_kbvs(ctx, workers, failure):
            raise
        try:  # its outputs are not read: it runs the draw again
            subject.receive_reply(run)
        except WorkerFailed:
            if not subject.alive():  # (a CUDA error ends its worker): that failure is its own
                raise
        _draws_apart(ctx, workers, label, "the reference")
        if ctx.cache.tf32_operators is None:  # a failed request's record of them is asked for again
            ctx.cache.tf32_operators_asked = False
        expected, used = _reference._usable_reference(ctx, reference, variant, seed)
        return expected, used, None
    if expected is not None and ctx.gpu.output_numels is None:  # before the candidate's
        ctx.gpu.output_numels = _output_numels(expected)  # hand-over is copied (_oversized_handover)
    try:
        outputs = _received(subject, subject.receive_reply(run))  # (a pending build's reply first)
    except WorkerFailed as failure:
        if not _room_was_kbvs(ctx, workers, failure):
            raise
        _draws_apart(ctx, workers, label, "the candidate")
        return expected, used, None
    return expected, used, outputs


def _room_was_kbvs(ctx: _Context, workers: tuple[Worker, Worker], failure: WorkerFailed) -> bool:
    """Whether a worker's failure beside the other's draw is running out of device memory that
    kbv's processes held, on a GPU the evaluation holds alone (another evaluation's share is not
    kbv's to take back), with both workers still running (one the parent ended, after a CUDA error
    or past a limit, keeps the failure that ended it)."""
    reference, subject = workers
    if not (ctx.gpu.held.startswith("alone") and reference.alive() and subject.alive()):
        return False
    return _room_not_kept(ctx, subject, failure, reference=reference) is not None


def _draws_apart(ctx: _Context, workers: tuple[Worker, Worker], label: str, who: str) -> None:
    """The rest of the correctness draws one after the other. The reference may keep no more cached
    than the candidate's room allows (:func:`_room_for_candidate`), and both workers apply that rule
    now and let go of what they handed over (``release``), as the parent hands its cached blocks
    back: what the reference kept beside the candidate's draw (its hand-over, and the working
    memory that the rule of the side-by-side draws lets it keep) would otherwise still be there
    when the draw is done again. The record's ``isolation.gpu`` says from which draw."""
    subject = workers[1]
    ctx.gpu.drawing = False
    _room_for_candidate(ctx, subject)
    release_cached_blocks(ctx.device)
    for worker in workers:
        worker.request(wire.Release())
    ctx.gpu.held += (
        f"; the correctness draws one after the other from {label} on ({who} ran out of device "
        "memory beside the other worker's draw, in room kbv's processes held)"
    )


def draws_ahead(ctx: _Context) -> bool:
    """Whether a distribution's next draw is asked for before the parent judges this one: the
    candidate runs it and the reference computes its truth while the parent copies and judges this
    draw's outputs (docs/correctness.md gives what it saved on the CPU sample). Under the error
    model, where the draws overlap, and on the CPU only: on a GPU the next draw's outputs would be
    made while this draw's truth and outputs are still held, up to twice the parent's share of
    device memory. Both draws' outputs are in the parent's memory before the next request goes: a
    worker releases what it handed over when its next request arrives, and nothing the parent
    decides reaches either worker before it has judged."""
    return (
        ctx.protocol.correctness.mode == "error_model"
        and not ctx.device.startswith("cuda")
        and draws_overlap(ctx.device)
    )


class _Ahead:
    """A correctness draw asked for ahead: the candidate's ``run`` and the reference's ``expected``
    of one draw, sent while the previous draw is judged."""

    def __init__(self, run: int, asked: _reference._Asked) -> None:
        self.run, self.asked = run, asked

    @classmethod
    def ask(cls, ctx: _Context, reference: Worker, subject: Worker, variant: str, seed: int) -> _Ahead:
        run = subject.send_request(_forward(subject, variant, seed, "native"))
        return cls(run, _reference._send_expected(ctx, reference, variant, seed))

    def answers(
        self, ctx: _Context, reference: Worker, subject: Worker
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the candidate's outputs, the reference's expected), both in the parent's memory."""
        expected = _reference._expected_reply(ctx, reference, self.asked)
        return _received(subject, subject.receive_reply(self.run)), expected

    def drop(self, ctx: _Context, reference: Worker, subject: Worker) -> None:
        """Read both replies and keep nothing, so the workers are quiet before a failing draw's
        re-runs. A failure in either is not counted here: the draw was never judged, and what it
        says again comes back with the next request that worker gets (a dead worker fails that)."""
        with contextlib.suppress(WorkerFailed):
            _reference._expected_reply(ctx, reference, self.asked)
        with contextlib.suppress(WorkerFailed):
            _received(subject, subject.receive_reply(self.run))


def draws_overlap(device: str) -> bool:
    """Whether the candidate runs a correctness draw while the reference computes it. On a GPU the
    reference's outputs reach the parent by CUDA IPC; on the CPU through an anonymous memory file
    whose descriptor only the parent receives (``kbv.handoff``, transport ``memfd``). Neither has a
    path a candidate running beside it could open. Where the system has no memory files the
    reference writes a file in its scratch, which a candidate of the same uid could read
    half-written (the ``steal_reference_outputs`` fixture did): there the draws stay one after the
    other, the parent reading and deleting each file before the candidate is asked."""
    return device.startswith("cuda") or memfd_available()


def _confirm_failure(
    ctx: _Context,
    reference: Worker,
    subject: Worker,
    label: str,
    variant: str,
    seed: int,
    first: dict[str, Any],
) -> dict[str, Any]:
    """Re-run a failing draw (reference and candidate, same inputs) before it counts.

    A failure counts when any re-run fails too. One that no re-run repeats is a transient: the
    draw passes on the re-runs' verdict and the ``transient_mismatch`` check reports it, because a
    candidate that answers the same inputs differently is either racy or exposed to one in the
    runtime (PyTorch's CPU kernels have been seen to give a wrong first call in a new thread pool).
    """
    reruns = ctx.protocol.correctness.confirm_reruns
    if first.get("tolerance") is None:  # a structural failure (shape, dtype, type) is deterministic
        return first
    judged = first
    for _ in range(reruns):
        expected = _reference._reference_outputs(ctx, reference, variant, seed, fresh=True)
        judged = _judge_draw(ctx, _run(subject, variant, seed, "native"), expected)
        del expected  # before the next re-run's truth arrives
        _release_if_alone(ctx)
        if not judged["passed"]:
            note = f"failed again on a re-run of the same inputs ({label})"
            return {**first, "note": "; ".join(n for n in (first.get("note"), note) if n)}
    if reruns:
        ctx.found.transients.append(
            {
                "draw": label,
                "max_abs_err": first.get("max_abs_err"),
                "rel_err": first.get("rel_err"),
                "reruns": reruns,
            }
        )
    return judged


def _release_if_alone(ctx: _Context) -> None:
    """The parent's cached blocks go back where the evaluation holds its GPU alone, for the next
    truth; a shared GPU keeps them (another evaluation's room is not the parent's to plan)."""
    if ctx.gpu.held.startswith("alone"):
        release_cached_blocks(ctx.device)


def _judge_draw(ctx: _Context, got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    with correctness.one_thread_on_the_cpu(got["outputs"]):
        return _judged(ctx, got, expected)


def _judged(ctx: _Context, got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    settings = ctx.protocol.correctness
    reference = expected["reference"]["outputs"]
    problem = _structure_problem(got, reference)
    if problem:
        return {"passed": False, "max_abs_err": None, "rel_err": None, "tolerance": None, "note": problem}
    if settings.mode == "error_model":
        base_err = expected["baseline_err"]
        lengths = correctness.reduction_lengths(_structure(ctx).numels, expected["truth"]["outputs"])
        passed, max_err, rel_err, tol = correctness.compare_error_model(
            got["outputs"], expected["truth"]["outputs"], base_err, settings, lengths
        )
        return {
            "passed": passed,
            "max_abs_err": max_err,
            "rel_err": rel_err,
            "tolerance": tol,
            "baseline_err": base_err,
            "note": "",
        }
    passed, max_err, rel_err, tol = correctness.compare_allclose(got["outputs"], reference, settings)
    return {"passed": passed, "max_abs_err": max_err, "rel_err": rel_err, "tolerance": tol, "note": ""}


def _structure_problem(got: dict[str, Any], reference: list[Any]) -> str | None:
    not_tensors = [t for t in got["types"] if t != "torch.Tensor"]
    if not_tensors:
        return f"output type is {not_tensors[0]}, not torch.Tensor"
    return correctness.check_structure(got["outputs"], reference)
