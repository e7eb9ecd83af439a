"""One evaluation, end to end: problem x candidate x protocol -> Record.

The parent owns seeds, comparison, statistics and the verdict. It starts a reference worker (which
only ever loads the problem) and a candidate worker (which loads the candidate), sends them per-call
seeds, and judges what comes back."""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from kbv import inputs, performance, wire_replies
from kbv.candidates import Candidate
from kbv.device_lock import DeviceLock
from kbv.devices import check_device, release_cached_blocks, release_device_memory
from kbv.evaluation.budget import (
    _gpu_hold,
    _hold_alone,
    _hold_alone_for_outputs,
    _parent_ran_out,
    _room_for_candidate,
    _room_not_kept,
    _side_by_side,
    timing_input_sets,
)
from kbv.evaluation.cache import EXPECTED_CACHE_BYTES, ExpectedCache
from kbv.evaluation.context import (
    REFERENCE_TIMEOUT_S,
    STANDARD_SEED,
    HarnessError,
    _Context,
    _peaks_within,
    _phase,
    _phase_entered,
    _Seeds,
    _structure,
    default_device,
)
from kbv.evaluation.draws import _build_for_timing, _build_pair, _check_correctness, _judge_draw
from kbv.evaluation.records import (
    _device_info,
    _empty_timing,
    _failure_record,
    _problem_error_record,
    _record,
)
from kbv.evaluation.reference import _reference_outputs, _timed_reference
from kbv.evaluation.requests import _load, _run
from kbv.evaluation.static_scan import StaticScan, static_findings_joined
from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import DistributionResult, Finding, Record, decide_outcome, host_memory_section
from kbv.worker import (
    Spares,
    Worker,
    WorkerFailed,
    WorkerSpec,
    close_all,
    stopped_processes,
    visible_devices,
)


def evaluate(
    problem: Problem,
    candidate: Candidate,
    protocol: Protocol,
    device: str | None = None,
    *,
    timeout_s: float | None = None,
    master_seed: int | None = None,
    spares: Spares | None = None,
    structure: list[Any] | None = None,
    shared: Any = None,
) -> Record:
    """Evaluate one pair. Candidate failures are outcomes in the record; harness failures raise,
    and so does a device this machine does not have (:class:`kbv.devices.DeviceError`).

    ``structure`` replays a record's input invariants (``record.seeds["structure"]``) instead of
    inferring them again.
    ``spares`` (a batch's) supplies workers launched ahead of time and launches the next pair's
    while this one checks correctness (never while it times).
    ``shared`` (a :class:`kbv._shared_reference.SharedReference`) gives the batch's master seed and
    reuses the reference outputs of the batch's earlier candidates of this problem."""
    started = time.monotonic()
    device = device or default_device()
    # A GPU this machine lacks is the caller's error (DeviceError), never each problem's: without
    # it every pair came back problem_error ("CudaTimer needs a CUDA device").
    check_device(device)
    protocol = protocol.with_timeout(timeout_s)
    fixed = not protocol.correctness.secret_seeds  # a replay of a fixed-seed record is fixed too
    if shared is not None and master_seed is None and not fixed:
        master_seed = shared.master_seed
    seeds = _Seeds(
        master=master_seed if master_seed is not None else (STANDARD_SEED if fixed else inputs.new_seed()),
        fixed=fixed,
        timing_nonce=0 if fixed else inputs.new_seed(),
    )
    ctx = _Context(problem, candidate, protocol, device, seeds, replay_structure=structure)
    ctx.cache.expected = ExpectedCache(EXPECTED_CACHE_BYTES["cuda" if device.startswith("cuda") else "cpu"])
    if shared is not None and not fixed:
        from kbv import _shared_reference

        if _shared_reference.shares(device):
            cache = ctx.cache
            cache.expected = _shared_reference.expected_cache(
                shared, problem, protocol, device, cache.expected
            )
            cache.expected_shared = True
    # The static scan reads only source text: it runs in the parent while the workers load (where
    # the parent only waits), and its findings join before anything decides an outcome.
    ctx.found.static_scan = StaticScan(ctx) if ctx.protocol.integrity.static else None
    try:
        return _evaluate_in_workers(ctx, spares or Spares(), started)
    finally:
        with contextlib.suppress(Exception):  # a harness failure leaves no scan running
            static_findings_joined(ctx)
        _release_device_memory(ctx)


def _release_device_memory(ctx: _Context) -> None:
    """Hand the evaluation's device memory back: the reference outputs it kept, then whatever
    :func:`kbv.devices.release_device_memory` frees, for the next evaluation's workers."""
    if not ctx.cache.expected_shared:  # a batch's shared outputs are dropped at the batch's end
        ctx.cache.expected.clear()
    release_device_memory(ctx.device)


def _evaluate_in_workers(ctx: _Context, spares: Spares, started: float) -> Record:
    problem, candidate, protocol, device = ctx.problem, ctx.candidate, ctx.protocol, ctx.device
    reference, subject = (spares.take(spec) for spec in worker_specs(problem, candidate, protocol, device))
    reference.budget = subject.budget = ctx.gpu.budget  # what each may keep cached: the evaluation decides
    # The candidate's processes are searched (and killed) if they hold kbv's lock files open.
    gpu_lock = DeviceLock(device, suspects=subject.members)
    with gpu_lock as gpu, contextlib.ExitStack() as before_unlock, reference, subject:
        # The parent's copies are freed after the workers have closed and before the GPU is handed on.
        before_unlock.callback(_release_device_memory, ctx)
        reference.launch()
        subject.launch()
        # the next evaluation's workers boot while this one loads and checks correctness
        spares.launch_expected()
        try:
            ref_hello = _start_reference(ctx, reference)
        except WorkerFailed as failure:  # no candidate code has run yet: the problem's own failure
            if failure.details.get("stopped"):  # ... unless something stopped it: not the problem's
                return _failure_record(ctx, reference.hello, failure)
            return _problem_error_record(ctx, reference.hello, failure)
        ctx.gpu.held = _gpu_hold(ctx, ref_hello)
        _room_for_candidate(ctx, subject)
        if ctx.gpu.held.startswith("alone"):
            _hold_alone(ctx, gpu, subject, ref_hello)
        elif ctx.gpu.held:
            ctx.gpu.on_first_outputs = _hold_alone_for_outputs(ctx, gpu, subject, ref_hello)
        try:
            _phase(ctx, "load", lambda: _load_candidate(ctx, subject))
            results = _phase(ctx, "correctness", lambda: _check_correctness(ctx, reference, subject))
            ctx.found.findings.extend(_correctness_findings(ctx, results))
            correct = all(r.passed for r in results if r.applicable) and any(r.applicable for r in results)
            timing, speedup, memory = _empty_timing()
            release_cached_blocks(ctx.device)  # the draws' blocks, for the workers' timing inputs
            if correct:
                # Nothing else runs on this GPU while it times (kbv.device_lock), and no spare boots:
                # those still booting are stopped for the phase ("spares": the time their stop took).
                with gpu.exclusive(), _phase_entered(ctx, "spares", spares.quiet()):
                    timing, speedup, memory = _phase(
                        ctx, "timing", lambda: _measure(ctx, ref_hello, reference, subject)
                    )
                phases = ctx.found.phases
                phases["timing"] -= phases.get("baseline", 0.0)  # timing = the candidate's share
            if gpu.waited_s:
                ctx.found.phases["device_wait"] = gpu.waited_s
            if ctx.protocol.integrity.dynamic:
                _phase(
                    ctx,
                    "integrity",
                    lambda: _dynamic_findings(ctx, reference, subject, correct, timing, speedup),
                )
            else:
                ctx.found.findings.extend(_findings_without_probes(ctx, timing))
        except torch.OutOfMemoryError as error:  # the parent's own copies found no room
            ctx.found.phases["total"] = time.monotonic() - started
            past = subject.failure_if_past_limit()  # a candidate past its limit took the room
            if past is None:
                past = _oversized_handover(ctx, subject)
            if past is None:
                said = _parent_ran_out(ctx, subject, error, _kbv_processes(reference, spares))
                _end_containment(ctx, reference, subject, gpu, spares)
                # The finished frames' tensors (outputs and truths, GBs) go now: the device memory
                # must be free for the next evaluation's workers, not wait on the error's readers.
                traceback.clear_frames(error.__traceback__)
                raise HarnessError(said) from error
            return _ended_by_failure(ctx, ref_hello, (reference, subject), gpu, spares, past)
        except WorkerFailed as failure:
            ctx.found.phases["total"] = time.monotonic() - started
            return _ended_by_failure(ctx, ref_hello, (reference, subject), gpu, spares, failure)
        _end_containment(ctx, reference, subject, gpu, spares)
        closing = time.monotonic()
        close_all((subject, reference))  # side by side (the ``with`` then has nothing left to close)
    ctx.found.phases["close"] = time.monotonic() - closing  # the workers' exit and the scratch clean-up
    ctx.found.phases["total"] = time.monotonic() - started  # closing the workers included
    static_findings_joined(ctx)
    outcome = decide_outcome(correct, ctx.found.findings)
    return _record(ctx, ref_hello, outcome, correct, results, timing, speedup, memory)


def worker_specs(
    problem: Problem, candidate: Candidate, protocol: Protocol, device: str
) -> tuple[WorkerSpec, WorkerSpec]:
    """The reference's and the candidate's worker for one evaluation (``protocol`` with its timeout)."""
    warm = bool(
        protocol.integrity.dynamic
    )  # both alike: their timed calls run in processes prepared the same way
    return (
        WorkerSpec(
            build_key=problem.source_sha256,
            device=device,
            role="reference",
            visible_devices=visible_devices(device),
            budget_s=REFERENCE_TIMEOUT_S,
            warm_probes=warm,
        ),
        WorkerSpec(
            build_key=candidate.source_sha256,
            device=device,
            role="candidate",
            visible_devices=visible_devices(device),
            budget_s=protocol.timeout_s,
            limits=protocol.limits,
            readable=(str(candidate.path),),  # the problem arrives as text in its load request
            warm_probes=warm,
        ),
    )


def _ended_by_failure(
    ctx: _Context,
    ref_hello: wire_replies.Hello,
    workers: tuple[Worker, Worker],
    gpu: DeviceLock,
    spares: Spares,
    failure: WorkerFailed,
) -> Record:
    """The record of an evaluation a worker's failure ended (the problem's or the candidate's), or
    kbv's ``HarnessError`` where the candidate ran out of the device memory kbv promised it."""
    reference, subject = workers
    # before the workers' ends free their memory
    short = _room_not_kept(ctx, subject, failure, _kbv_processes(reference, spares), reference)
    _end_containment(ctx, reference, subject, gpu, spares, failure)
    if short is not None:
        # The frames the failure left (a draw's outputs and float64 truth) go now, as for the
        # parent's own out-of-memory error: held by the error, they kept 20 GiB of the GPU into
        # the next evaluation on an H100 (2026-12-07, 36_RMSNorm_ then 47_Sum).
        traceback.clear_frames(failure.__traceback__)
        raise HarnessError(short) from failure
    if _problem_failed(failure):
        return _problem_error_record(ctx, ref_hello, failure)
    return _failure_record(ctx, ref_hello, failure)


def _oversized_handover(ctx: _Context, subject: Worker) -> WorkerFailed | None:
    """The candidate's failure where the parent ran out copying a hand-over that claimed more
    elements than its calls' outputs hold (the reference's, as the first correctness draw counted
    them): an honest candidate hands over no more, so the parent's shortage was made by the
    candidate, and must not earn it a harness error in place of a verdict. None otherwise, and
    before any output count is known."""
    claimed, calls = subject.last_handover
    honest = calls * sum(ctx.gpu.output_numels or [])
    if not honest or claimed <= honest:
        return None
    message = (
        f"the candidate handed over {claimed:,} elements for {calls} call(s) whose outputs hold "
        f"{honest:,}, and kbv's parent had no room to copy them"
    )
    return WorkerFailed("runtime_error", message, subject.logs(), role="candidate")


def _kbv_processes(reference: Worker, spares: Spares) -> dict[str, list[int]]:
    """kbv's own processes on the evaluation's GPU by what they are, for a message on its memory."""
    return {
        "kbv's parent": [os.getpid()],
        "the reference worker": reference.members(),
        "the spare workers": spares.members(),
    }


def _end_containment(
    ctx: _Context,
    reference: Worker,
    subject: Worker,
    gpu: DeviceLock,
    spares: Spares | None = None,
    failure: WorkerFailed | None = None,
) -> None:
    """Processes the candidate left running (killed now, reported), candidate processes killed for
    holding kbv's GPU lock files, kbv's processes found stopped by a signal kbv did not send (the
    trusted worker whose stop ended the evaluation, if one did), host memory peaks, isolation."""
    from kbv import integrity
    from kbv.integrity.dynamic import containment_findings

    stops = stopped_processes([reference], spares)
    if failure is not None and failure.role != "candidate" and failure.details.get("stopped"):
        stops.insert(0, dict(failure.details["stopped"]))
    reference.finish()  # the problem's leftovers are killed, never blamed on the candidate
    found = containment_findings(subject.finish(), gpu.take_tampering(), stops)
    ctx.found.findings.extend(integrity.apply_severity(found, ctx.protocol.integrity))
    ctx.found.isolation = {**subject.isolation, **({"gpu": ctx.gpu.held} if ctx.gpu.held else {})}
    ctx.found.host_memory = host_memory_section(subject.host_peak_bytes, reference.host_peak_bytes)


@dataclass
class Session:
    """What dynamic integrity checks get: both workers and the parent's trusted operations.

    Probes that need "some hidden inputs" use the correctness draws of ``probe_distribution``
    (``draw_spec(k)``), whose parameters ``rebuild`` restores, so their reference outputs (the
    baseline's and the float64 truth) are the ones correctness already computed."""

    reference: Worker
    subject: Worker
    protocol: Protocol
    device: str
    correct: bool
    timing: dict[str, Any]
    speedup: dict[str, Any]
    fresh_seed: Any  # (purpose: str) -> int, a new secret seed for probes
    probe_distribution: str
    draw_spec: Any  # (k: int) -> {"distribution", "seed"}: correctness draw k of the probe distribution
    reference_outputs: Any  # (spec) -> {"reference", "truth", "baseline"}, computed once per spec
    reference_runs: Any  # (spec, precision, repeats) -> [outputs, ...], fresh runs
    judge: Any  # (candidate_outputs, reference_outputs) -> {"passed", "max_abs_err", ..., "note"}
    rebuild: Any  # () -> None: rebuild both models with the probe distribution's parameters
    transients: list[dict[str, Any]] = field(default_factory=list)  # draws whose failure did not repeat
    phases: dict[str, float] = field(default_factory=dict)  # seconds per probe, added to the record
    # (name) -> a context manager that counts the parent's GPU reservation toward the probe's peak
    within_phase: Any = contextlib.nullcontext
    # () -> whether the evaluation's cache keeps a draw's reference answers (not a truth too large)
    expected_kept: Any = lambda: True
    # () -> the outputs' element counts the first correctness draw found, or None before it
    output_numels: Any = lambda: None
    # Whether both workers may run a probe's forward at once: not where the evaluation holds its GPU
    # alone and two forwards would not fit beside each other (_side_by_side).
    side_by_side: bool = True


def _correctness_findings(ctx: _Context, results: list[DistributionResult]) -> list[Finding]:
    """The checks derived from the correctness draws' results (``below_precision``), under every
    protocol, at the protocol's severity."""
    from kbv import integrity

    found = integrity.correctness_findings(ctx.protocol.precision, results, ctx.candidate.source)
    return integrity.apply_severity(found, ctx.protocol.integrity)


def _findings_without_probes(ctx: _Context, timing: dict[str, Any]) -> list[Finding]:
    """Without the dynamic checks, what needs no probe still counts (at the protocol's severity):
    draws whose failure did not repeat, and wrong outputs of the real timed calls."""
    from kbv import integrity
    from kbv.integrity import dynamic

    found = dynamic.findings_without_probes(timing, ctx.found.transients)
    return integrity.apply_severity(found, ctx.protocol.integrity)


def _dynamic_findings(
    ctx: _Context,
    reference: Worker,
    subject: Worker,
    correct: bool,
    timing: dict[str, Any],
    speedup: dict[str, Any],
) -> None:
    from kbv import integrity
    from kbv.integrity import dynamic

    counter = iter(range(1 << 30))
    base = _probe_base(ctx)
    variant = ctx.found.variants.get(base, base)

    def spec_outputs(spec: dict[str, Any]) -> dict[str, Any]:
        return _reference_outputs(
            ctx, reference, spec["distribution"], int(spec["seed"]), mix_seed=spec.get("mix_seed")
        )

    def runs(spec: dict[str, Any], precision: str, repeats: int) -> list[list[Any]]:
        return [
            _run(
                reference, spec["distribution"], int(spec["seed"]), precision, mix_seed=spec.get("mix_seed")
            )["outputs"]
            for _ in range(repeats)
        ]

    session = Session(
        reference=reference,
        subject=subject,
        protocol=ctx.protocol,
        device=ctx.device,
        correct=correct,
        timing=timing,
        speedup=speedup,
        fresh_seed=lambda purpose: inputs.derive_seed(ctx.seeds.master, "probe", purpose, next(counter)),
        probe_distribution=variant,
        draw_spec=lambda k: {"distribution": variant, "seed": ctx.seeds.draw(base, k)},
        reference_outputs=spec_outputs,
        reference_runs=runs,
        judge=lambda got, expected: _judge_draw(ctx, got, expected),
        rebuild=lambda: _build_pair(ctx, reference, subject, base),
        transients=ctx.found.transients,
        side_by_side=_side_by_side(ctx),
        within_phase=lambda name: _peaks_within(ctx, f"probe:{name}"),
        expected_kept=lambda: _expected_kept(ctx),
        output_numels=lambda: ctx.gpu.output_numels,
    )
    try:
        result = dynamic.run_dynamic_checks(session)
        ctx.found.findings.extend(integrity.apply_severity(result.findings, ctx.protocol.integrity))
        speedup.update(result.corrections.get("speedup") or {})  # the record's speedup is the trusted one
    finally:
        ctx.found.phases.update({_probe_phase(name): seconds for name, seconds in session.phases.items()})


def _probe_phase(name: str) -> str:
    """A dynamic session's phase as the record names it: a check's seconds (``check:NAME``, its
    probes' included) as they are, a probe's as ``probe:NAME``."""
    return name if name.startswith("check:") else f"probe:{name}"


def _expected_kept(ctx: _Context) -> bool:
    """Whether the evaluation's cache of reference outputs keeps a draw's answers: its float64
    truth (8 bytes an output element, as the first correctness draw counted them) within the
    cache's budget. Unknown counts keep."""
    truth_bytes = 8 * sum(ctx.gpu.output_numels or [])
    return truth_bytes <= ctx.cache.expected.budget_bytes


def _probe_base(ctx: _Context) -> str:
    """The correctness distribution whose draws the probes reuse: ``signed`` where it ran (signs
    matter: identity-on-ReLU must not pass a probe), else the protocol's first distribution."""
    distributions = ctx.protocol.correctness.distributions
    return "signed" if "signed" in ctx.found.variants else distributions[0]


def _start_reference(ctx: _Context, reference: Worker) -> wire_replies.Hello:
    """Boot the reference worker and load the problem (import, ``get_init_inputs``, ``Model(...)``).
    A failure here raises ``WorkerFailed`` with role ``reference``: ``evaluate`` records it as the
    problem's (``problem_error``). A worker that does not even boot is kbv's failure."""
    try:
        hello = _phase(ctx, "boot", reference.wait_ready)  # a spare is up already: ~0
    except WorkerFailed as exc:
        raise HarnessError(
            f"the reference worker did not start ({exc.kind}): {exc.message}\n{exc.logs_tail()}"
        ) from exc
    reply = _phase(ctx, "reference_load", lambda: reference.request(_load(ctx, "reference")))
    ctx.cache.reference_parameters = wire_replies.LoadReply.of(reply).parameters
    return hello


def _problem_failed(failure: WorkerFailed) -> bool:
    """Whether a failure during the evaluation is the problem's own: its code raised in the
    reference worker (``get_inputs`` or ``forward`` on some input). A reference that was killed,
    timed out or ran out of memory while the candidate ran could have been starved by the candidate,
    so that stays the candidate's outcome (where the GPU could not hold the reference beside the
    candidate's promised room, ``_room_not_kept`` has made it kbv's ``HarnessError`` before)."""
    if failure.role != "reference" or failure.kind not in ("runtime_error", "import_error", "compile_error"):
        return False
    return "out of memory" not in failure.message.lower()


def _load_candidate(ctx: _Context, subject: Worker) -> None:
    from kbv.worker.builds import build_lock, known_build_failure

    message = known_build_failure(ctx.candidate.source_sha256)
    if message is not None:  # built (and failed) ahead of time by the compile stage
        raise WorkerFailed("compile_error", message)
    subject.wait_ready()
    with build_lock(ctx.candidate.source_sha256):  # importing the candidate may build its extensions
        started = time.monotonic()
        reply = wire_replies.LoadReply.of(subject.request(_load(ctx, "candidate")))
        bracket_s = time.monotonic() - started
    ctx.found.phases["compile"] = _compile_seconds(reply.worker_seconds, bracket_s)
    ref_params = ctx.cache.reference_parameters
    same = bool(ref_params) and reply.parameters == ref_params
    ctx.cache.parameters_mode = (
        "state_dict" if same and ctx.protocol.correctness.redraw_parameters else "matched_seed"
    )


def _measure(
    ctx: _Context, hello: wire_replies.Hello, reference: Worker, subject: Worker
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    settings = ctx.protocol.timing
    mctx = performance.MeasureContext(
        problem=ctx.problem,
        device=ctx.device,
        settings=settings,
        seeds=[
            ctx.seeds.timing(k) for k in range(timing_input_sets(settings.input_sets, _structure(ctx).numels))
        ],
        init_seed=ctx.seeds.init("original"),
        device_info=_device_info(ctx, hello),
        torch_version=hello.torch,
        load=_load(ctx, "reference"),
        sketch_seed=inputs.derive_seed(ctx.seeds.master, "timed-sketch"),
        timed_reference=lambda seed: _timed_reference(ctx, reference, seed),
        build=lambda: _build_for_timing(ctx, reference, subject),
        recheck_brackets=_checks_brackets(ctx.protocol),  # timing_disagreement reads the re-check
        tf32_operators=ctx.cache.tf32_operators,
        precision=ctx.protocol.precision,
        unseen_seeds=lambda r: ctx.seeds.unseen(r, settings.repeats),
        unseen_judge=performance.UnseenJudge(ctx.protocol.correctness, tuple(_structure(ctx).numels)),
    )
    timing, speedup = performance.measure_pair(mctx, reference, subject)
    timing, speedup = performance.named_for_precision(timing, speedup, ctx.protocol.precision)
    timing["input_sets"] = len(mctx.seeds)
    ctx.found.phases["baseline"] = timing.pop("baseline_seconds", 0.0)
    memory = performance.measure_memory(ctx.device, reference, subject, _run, ctx.seeds.timing(0))
    return timing, speedup, memory


def _checks_brackets(protocol: Protocol) -> bool:
    integrity = protocol.integrity
    return integrity.dynamic and integrity.severity_for("timing_disagreement", "fail") != "off"


def _compile_seconds(reported: Any, bracket_s: float) -> float:
    """The compile phase: the worker's own time for importing the candidate (which builds its
    extensions), held within the parent's bracket of that request. The candidate's code ran in
    between and may have patched the worker's clock (a perf_counter slowed 1000x at import gave a
    compile phase of -12,545 s), so the worker's word counts only between 0 and the bracket."""
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or not math.isfinite(reported):
        return bracket_s
    return min(max(0.0, float(reported)), bracket_s)
