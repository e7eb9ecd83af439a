"""One evaluation, end to end: problem x candidate x protocol -> Record.

The parent (this module) owns seeds, comparison, statistics and the verdict. It starts a reference
worker (which only ever loads the problem) and a candidate worker (which loads the candidate), sends
them per-call seeds, and judges what comes back.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from kbv import correctness, inputs, performance
from kbv._version import __version__
from kbv.candidates import Candidate
from kbv.device_lock import DeviceLock
from kbv.devices import check_device, cpu_name, release_cached_blocks, release_device_memory
from kbv.precision import below_precision_findings
from kbv.problems import Problem, ProblemError
from kbv.problems.structure import InputStructure, input_structure
from kbv.protocol import Protocol
from kbv.records import (
    DistributionResult,
    Finding,
    MemorySection,
    Outcome,
    Record,
    Severity,
    TimingSection,
    decide_outcome,
    error_summary,
    host_memory_section,
    protocol_section,
    with_summary,
)
from kbv.worker import (
    Spares,
    Worker,
    WorkerFailed,
    WorkerSpec,
    close_all,
    stopped_processes,
    visible_devices,
    worker_device,
)

REFERENCE_TIMEOUT_S = 1800.0
# KernelBench constructs models and draws inputs from fixed seeds; the standard protocol keeps that.
STANDARD_SEED = 42
_ERROR_OUTCOME = {
    "compile_error": Outcome.COMPILE_ERROR,
    "import_error": Outcome.RUNTIME_ERROR,
    "runtime_error": Outcome.RUNTIME_ERROR,
    "cuda_error": Outcome.RUNTIME_ERROR,
    "timeout": Outcome.TIMEOUT,
    "crashed": Outcome.CRASHED,
    "resource_limit": Outcome.RESOURCE_LIMIT,
}


class HarnessError(RuntimeError):
    """kbv itself (or the problem's reference) failed; not an outcome of the candidate."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class _Seeds:
    """Seeds for one evaluation. ``master`` is secret until the record is written."""

    master: int
    fixed: bool
    # The unseen timing draws' own secret (``unseen``): candidates of one problem in one batch share
    # their master seed (kbv.Evaluator), and a result one of them kept where it outlives its
    # evaluation (its build directory is reused by the same source) must not find the next one's
    # timed inputs. Written into the record (``seeds.unseen_timing_nonce``); 0 with fixed seeds.
    timing_nonce: int = 0

    def init(self, distribution: str) -> int:
        return STANDARD_SEED if self.fixed else inputs.derive_seed(self.master, "init", distribution)

    def draw(self, distribution: str, k: int) -> int:
        return STANDARD_SEED + k if self.fixed else inputs.derive_seed(self.master, "draw", distribution, k)

    def params(self, distribution: str) -> int:
        return inputs.derive_seed(self.master, "params", distribution)

    def timing(self, k: int) -> int:
        return STANDARD_SEED + 1000 + k if self.fixed else inputs.derive_seed(self.master, "timing", k)

    def unseen(self, r: int, repeats: int) -> list[int]:
        """One seed per timed call of round ``r`` (``timing.unseen_inputs``), none of them another
        round's, a warm-up set's or a correctness draw's."""
        if self.fixed:
            return [STANDARD_SEED + 100_000 + r * repeats + i for i in range(repeats)]
        return [
            inputs.derive_seed(self.master, "unseen-timing", self.timing_nonce, r, i) for i in range(repeats)
        ]


class ExpectedCache:
    """Reference outputs per (parameters, distribution, seed): the inputs, the realistic baseline's
    outputs and the float64 truth of a draw are computed once per evaluation and reused by every
    check that needs them. Bounded in bytes (least recently used out first); never shared between
    evaluations, since they depend on the evaluation's secret seeds."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[Any, ...], tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def put(self, key: tuple[Any, ...], value: dict[str, Any]) -> None:
        size = _nbytes(value)
        if size > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        self._bytes += size - (old[1] if old else 0)
        self._entries[key] = (value, size)
        while self._bytes > self.budget_bytes and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _nbytes(expected: dict[str, Any]) -> int:
    seen: dict[int, int] = {}
    for part in expected.values():
        for t in part.get("outputs") or []:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


#: Bytes of reference outputs an evaluation keeps for reuse (on the evaluation's device).
#: Measured on the H200: with 24 GB, a 1.6e9-element problem (the reference's float64 run, the
#: candidate's copies and the parent's cache together) ran out of the GPU's 139 GB.
EXPECTED_CACHE_BYTES = {"cuda": 8 << 30, "cpu": 1 << 30}


@dataclass
class _Context:
    problem: Problem
    candidate: Candidate
    protocol: Protocol
    device: str
    seeds: _Seeds
    findings: list[Finding] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    parameters_mode: str = "matched_seed"
    #: Distributions whose candidate build could not take the parameters during ``__init__`` (they
    #: were loaded after it: ``kbv.child.construct``), so state it derived there is the seed's.
    loaded_after_init: list[str] = field(default_factory=list)
    #: A candidate ``build`` was sent without waiting for its reply (``_build_pair(wait=False)``).
    build_pending: bool = False
    # Failing draws that passed every re-run on the same inputs (see _confirm_failure).
    transients: list[dict[str, Any]] = field(default_factory=list)
    # The models' parameters right now (which build/redraw), so reference outputs are reused only
    # for the parameters they were computed with.
    state_key: tuple[Any, ...] = ()
    expected: ExpectedCache = field(default_factory=lambda: ExpectedCache(0))
    expected_shared: bool = False  # ``expected`` is a batch's (kbv._shared_reference), kept after
    # The input distribution each protocol distribution really ran (a domain fallback, or itself).
    variants: dict[str, str] = field(default_factory=dict)
    # How the evaluation held its GPU (_gpu_hold); "" on the CPU.
    gpu_held: str = ""
    # The GPU's memory (the reference's hello; 0 on the CPU) and the outputs' element counts (the
    # first correctness draw's): what _side_by_side weighs.
    device_total_bytes: int = 0
    output_numels: list[int] | None = None
    # Called once with the first correctness draw's expected outputs (_hold_alone_for_outputs).
    on_first_outputs: Callable[[dict[str, Any]], None] | None = None
    # Filled at the end of the evaluation by _end_containment.
    isolation: dict[str, Any] = field(default_factory=dict)
    host_memory: dict[str, Any] = field(default_factory=dict)
    # Input invariants: a replayed record's own, else inferred once (see _structure).
    replay_structure: list[Any] | None = None
    structure: InputStructure | None = None
    # The TF32-sensitive operators the reference's realistic baseline ran (kbv.child.tf32_ops),
    # asked for once, on its first correctness draw on the GPU; None when not (or not yet) given.
    tf32_operators: dict[str, Any] | None = None
    tf32_operators_asked: bool = False
    # The fields sent with every request to the reference worker (its ``request_fields``): the
    # room it must leave free beside what its allocator keeps (_room_for_candidate), which depends
    # on whether the correctness draws are running (``drawing``).
    reference_fields: dict[str, Any] | None = None
    drawing: bool = False


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
    ctx.expected = ExpectedCache(EXPECTED_CACHE_BYTES["cuda" if device.startswith("cuda") else "cpu"])
    if shared is not None and not fixed:
        from kbv import _shared_reference

        if _shared_reference.shares(device):
            ctx.expected = _shared_reference.expected_cache(shared, problem, protocol, device, ctx.expected)
            ctx.expected_shared = True
    ctx.findings.extend(_static_findings(ctx))
    try:
        return _evaluate_in_workers(ctx, spares or Spares(), started)
    finally:
        _release_device_memory(ctx)


def _release_device_memory(ctx: _Context) -> None:
    """Hand the evaluation's device memory back: the reference outputs it kept, then whatever
    :func:`kbv.devices.release_device_memory` frees, for the next evaluation's workers."""
    if not ctx.expected_shared:  # a batch's shared outputs are dropped at the batch's end
        ctx.expected.clear()
    release_device_memory(ctx.device)


def _evaluate_in_workers(ctx: _Context, spares: Spares, started: float) -> Record:
    problem, candidate, protocol, device = ctx.problem, ctx.candidate, ctx.protocol, ctx.device
    reference, subject = (spares.take(spec) for spec in worker_specs(problem, candidate, protocol, device))
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
        ctx.gpu_held = _gpu_hold(ctx, ref_hello)
        ctx.reference_fields = reference.request_fields
        _room_for_candidate(ctx, subject)
        if ctx.gpu_held.startswith("alone"):
            _hold_alone(ctx, gpu, subject, ref_hello)
        elif ctx.gpu_held:
            ctx.on_first_outputs = _hold_alone_for_outputs(ctx, gpu, subject, ref_hello)
        try:
            _phase(ctx, "load", lambda: _load_candidate(ctx, subject, reference))
            results = _phase(ctx, "correctness", lambda: _check_correctness(ctx, reference, subject))
            ctx.findings.extend(
                below_precision_findings(ctx.protocol.precision, results, ctx.candidate.source)
            )
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
                ctx.phases["timing"] -= ctx.phases.get("baseline", 0.0)  # timing = the candidate's share
            if gpu.waited_s:
                ctx.phases["device_wait"] = gpu.waited_s
            if ctx.protocol.integrity.dynamic:
                _phase(
                    ctx,
                    "integrity",
                    lambda: _dynamic_findings(ctx, reference, subject, correct, timing, speedup, gpu),
                )
            else:
                ctx.findings.extend(_findings_without_probes(ctx, timing))
        except WorkerFailed as failure:
            ctx.phases["total"] = time.monotonic() - started
            _end_containment(ctx, reference, subject, gpu, spares, failure)
            if _problem_failed(failure):
                return _problem_error_record(ctx, ref_hello, failure)
            return _failure_record(ctx, ref_hello, failure)
        _end_containment(ctx, reference, subject, gpu, spares)
        closing = time.monotonic()
        close_all((subject, reference))  # side by side (the ``with`` then has nothing left to close)
    ctx.phases["close"] = time.monotonic() - closing  # the workers' exit and the scratch clean-up
    ctx.phases["total"] = time.monotonic() - started  # closing the workers included
    outcome = decide_outcome(correct, ctx.findings)
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
    ctx.findings.extend(integrity.apply_severity(found, ctx.protocol.integrity))
    ctx.isolation = {**subject.isolation, **({"gpu": ctx.gpu_held} if ctx.gpu_held else {})}
    ctx.host_memory = host_memory_section(subject.host_peak_bytes, reference.host_peak_bytes)


@contextlib.contextmanager
def _phase_entered(ctx: _Context, name: str, manager: Any) -> Iterator[None]:
    """``with manager``, the time its entry took counted as the phase ``name``."""
    started = time.monotonic()
    with manager:
        ctx.phases[name] = ctx.phases.get(name, 0.0) + time.monotonic() - started
        yield


def _phase(ctx: _Context, name: str, work: Any) -> Any:
    started = time.monotonic()
    try:
        return work()
    finally:
        ctx.phases[name] = ctx.phases.get(name, 0.0) + time.monotonic() - started


def _static_findings(ctx: _Context) -> list[Finding]:
    if not ctx.protocol.integrity.static:
        return []
    from kbv import integrity

    started = time.monotonic()
    findings = integrity.static_scan(
        ctx.candidate.source,
        path=str(ctx.candidate.path),
        problem_source=ctx.problem.source,
        # 16-bit compute is the precision of a bf16 or fp16 evaluation, not a hack; what goes below
        # it is caught by the tolerance (below_precision_findings); TF32 rules are fp32's alone.
        problem_dtype_fp32=ctx.protocol.precision == "fp32",
    )
    ctx.phases["integrity"] = time.monotonic() - started
    return integrity.apply_severity(findings, ctx.protocol.integrity)


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
    device_lock: Any = None  # the evaluation's DeviceLock: candidate processes killed for holding it
    # Whether both workers may run a probe's forward at once: not where the evaluation holds its GPU
    # alone and two forwards would not fit beside each other (_side_by_side).
    side_by_side: bool = True


def _findings_without_probes(ctx: _Context, timing: dict[str, Any]) -> list[Finding]:
    """Without the dynamic checks, what needs no probe still counts (at the protocol's severity):
    draws whose failure did not repeat, and wrong outputs of the real timed calls."""
    from kbv import integrity
    from kbv.integrity import dynamic

    found = dynamic.findings_without_probes(timing, ctx.transients)
    return integrity.apply_severity(found, ctx.protocol.integrity)


def _dynamic_findings(
    ctx: _Context,
    reference: Worker,
    subject: Worker,
    correct: bool,
    timing: dict[str, Any],
    speedup: dict[str, Any],
    gpu: DeviceLock | None = None,
) -> None:
    from kbv import integrity
    from kbv.integrity import dynamic

    counter = iter(range(1 << 30))
    base = _probe_base(ctx)
    variant = ctx.variants.get(base, base)

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
        transients=ctx.transients,
        device_lock=gpu,
        side_by_side=_side_by_side(ctx),
    )
    try:
        result = dynamic.run_dynamic_checks(session)
        ctx.findings.extend(integrity.apply_severity(result.findings, ctx.protocol.integrity))
        speedup.update(result.corrections.get("speedup") or {})  # the record's speedup is the trusted one
    finally:
        ctx.phases.update({f"probe:{name}": seconds for name, seconds in session.phases.items()})


def _probe_base(ctx: _Context) -> str:
    """The correctness distribution whose draws the probes reuse: ``signed`` where it ran (signs
    matter: identity-on-ReLU must not pass a probe), else the protocol's first distribution."""
    distributions = ctx.protocol.correctness.distributions
    return "signed" if "signed" in ctx.variants else distributions[0]


def _start_reference(ctx: _Context, reference: Worker) -> dict[str, Any]:
    """Boot the reference worker and load the problem (import, ``get_init_inputs``, ``Model(...)``).
    A failure here raises ``WorkerFailed`` with role ``reference``: ``evaluate`` records it as the
    problem's (``problem_error``). A worker that does not even boot is kbv's failure."""
    try:
        hello = _phase(ctx, "boot", reference.wait_ready)  # a spare is up already: ~0
    except WorkerFailed as exc:
        raise HarnessError(
            f"the reference worker did not start ({exc.kind}): {exc.message}\n{exc.logs_tail()}"
        ) from exc
    reply = _phase(ctx, "reference_load", lambda: reference.request("load", **_load_fields(ctx, "reference")))
    hello["parameters"] = reply["parameters"]
    return hello


#: An evaluation keeps about this many copies of its inputs' bytes on the GPU at once (inputs and
#: outputs in both workers, the float64 inputs and truth, the TF32 baseline's output, the parent's
#: copy of the candidate's output); when that exceeds this share of the GPU's memory it holds the
#: GPU alone from its first draw to its end, not only while it times (kbv.device_lock).
GPU_ALONE_COPIES = 12
GPU_ALONE_SHARE = 0.25


def _gpu_hold(ctx: _Context, hello: dict[str, Any], output_numels: list[int] | None = None) -> str:
    """How this evaluation holds its GPU, for the record's ``isolation.gpu`` ("" on the CPU): from
    its inputs before the first draw, and again with its outputs once the first draw knows them
    (``output_numels``; a convolution's output can be 100x its input)."""
    if not ctx.device.startswith("cuda"):
        return ""
    total = ctx.device_total_bytes = int((hello.get("device") or {}).get("total_memory_bytes") or 0)
    inputs, outputs = _io_bytes(ctx, output_numels)
    if total and GPU_ALONE_COPIES * (inputs + outputs) > GPU_ALONE_SHARE * total:
        since = "the whole evaluation" if output_numels is None else "the first correctness draw on"
        sizes = f"{inputs / 1e9:.1f} GB of inputs"
        if outputs:
            sizes += f" and {outputs / 1e9:.1f} GB of outputs"
        return (
            f"alone for {since}: {sizes}, about {GPU_ALONE_COPIES}x that on the GPU with the "
            f"evaluation's copies, more than {GPU_ALONE_SHARE:.0%} of its {total / 1e9:.0f} GB"
        )
    return "shared with other evaluations outside the timing phase"


#: An evaluation that holds its GPU alone still runs both workers' observations at once (and the
#: reference's answers to the cache probe's draws beside the candidate's delay) when its
#: GPU_ALONE_COPIES copies of inputs and outputs fit in this share of the GPU: each observation
#: holds fewer copies than a correctness draw does. On the H200 that is up to 8.6 GB of inputs and
#: outputs (a 1e9-element loss); one after the other, the observations of such a problem took
#: 0.55-0.74 s of a 3.4-5.1 s ``verified`` evaluation.
SIDE_BY_SIDE_SHARE = 0.75


def _side_by_side(ctx: _Context) -> bool:
    """Whether both workers may run a probe's forward at once (``Session.side_by_side``)."""
    if not ctx.gpu_held.startswith("alone"):
        return True
    if ctx.output_numels is None or ctx.device_total_bytes <= 0:
        return False
    return (
        GPU_ALONE_COPIES * sum(_io_bytes(ctx, ctx.output_numels))
        <= SIDE_BY_SIDE_SHARE * ctx.device_total_bytes
    )


def _io_bytes(ctx: _Context, output_numels: list[int] | None) -> tuple[int, int]:
    """(inputs, outputs) bytes as float32: the inputs as the structure draws counted them."""
    return 4 * sum(_structure(ctx).numels), 4 * sum(output_numels or [])


def _output_numels(expected: dict[str, Any]) -> list[int]:
    """Element counts of a draw's expected outputs (stand-ins under the error model)."""
    outputs = (expected.get("reference") or {}).get("outputs") or []
    return [int(o.numel()) for o in outputs if isinstance(o, torch.Tensor)]


def _hold_alone(ctx: _Context, gpu: DeviceLock, subject: Worker, hello: dict[str, Any]) -> None:
    gpu.hold_alone()  # until the lock closes, after the workers and the parent's copies
    ctx.gpu_held += _widen_device_limit(subject, hello)
    _room_for_candidate(ctx, subject)


def _room_for_candidate(ctx: _Context, subject: Worker) -> None:
    """Tell the reference worker what it must leave free beside the allocator cache it keeps between
    requests (``room_bytes``, kbv.child.main): the candidate's device limit as it stands now (widened
    when the evaluation holds the GPU alone; the whole device where the candidate has none), except
    during the correctness draws of an evaluation that holds its GPU alone. There each of the
    reference's requests runs beside the candidate's draw, so what it keeps between them is no more
    than what its next request takes at the same time, and no other evaluation shares the GPU; the
    first request after the draws (the timing phase's build) hands back what the limit needs."""
    fields = ctx.reference_fields
    if fields is None:
        return
    if ctx.drawing and ctx.gpu_held.startswith("alone"):
        fields["room_bytes"] = 0
        return
    limits = subject.spec.limits
    if limits is not None and limits.device_memory_gb:
        fields["room_bytes"] = int(float(limits.device_memory_gb) * (1 << 30))
    else:
        fields["room_bytes"] = ctx.device_total_bytes or None


def _hold_alone_for_outputs(
    ctx: _Context, gpu: DeviceLock, subject: Worker, hello: dict[str, Any]
) -> Callable[[dict[str, Any]], None]:
    """What the first correctness draw calls with its expected outputs: hold the GPU alone from
    then on if the outputs make the evaluation large (the inputs alone did not)."""

    def with_outputs(expected: dict[str, Any]) -> None:
        held = _gpu_hold(ctx, hello, _output_numels(expected))
        if held.startswith("alone"):
            ctx.gpu_held = held
            _hold_alone(ctx, gpu, subject, hello)

    return with_outputs


def _widen_device_limit(subject: Worker, hello: dict[str, Any]) -> str:
    """Raise the candidate worker's device-memory limit for an evaluation that holds its GPU alone;
    what was done, for the record's ``isolation.gpu`` ("" when nothing changed)."""
    limits = subject.spec.limits
    total = int((hello.get("device") or {}).get("total_memory_bytes") or 0)
    if limits is None or not limits.device_memory_gb or not total:
        return ""
    share = float(limits.device_memory_alone_share)  # the protocol's [limits]
    widened = share * total / (1 << 30)
    if widened <= limits.device_memory_gb:
        return ""
    subject.spec = replace(subject.spec, limits=replace(limits, device_memory_gb=round(widened, 1)))
    return (
        f"; the candidate's device-memory limit raised from {limits.device_memory_gb:g} GiB to "
        f"{widened:.1f} GiB ({share:.0%} of the GPU, [limits] device_memory_alone_share: no other "
        "evaluation shares it)"
    )


def _problem_failed(failure: WorkerFailed) -> bool:
    """Whether a failure during the evaluation is the problem's own: its code raised in the
    reference worker (``get_inputs`` or ``forward`` on some input). A reference that was killed,
    timed out or ran out of memory while the candidate ran could have been starved by the candidate,
    so that stays the candidate's outcome."""
    if failure.role != "reference" or failure.kind not in ("runtime_error", "import_error", "compile_error"):
        return False
    return "out of memory" not in failure.message.lower()


def _load_fields(ctx: _Context, role: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "role": role,
        "device": worker_device(ctx.device),
        # The text the parent read, never its path: the file may change meanwhile, and the
        # candidate worker must not learn where it lives (``docs/architecture.md``).
        "problem_source": ctx.problem.source,
        "sizes": ctx.problem.sizes_for(worker_device(ctx.device)),
        "domain": ctx.problem.extras.get("domain", "any"),
        "init_seed": ctx.seeds.init(ctx.protocol.correctness.distributions[0]),
        "structure": _structure(ctx).applied() or None,
    }
    if ctx.protocol.precision != "fp32":  # (fp32 loads as before: the baseline cache keys read these)
        fields["precision"] = ctx.protocol.precision
    if role == "candidate":
        fields["candidate_path"] = str(ctx.candidate.path)
    else:
        fields["problem_name"] = ctx.problem.name  # for the reference's error messages
    return fields


def _structure(ctx: _Context) -> InputStructure:
    """The problem's input invariants, the same for both workers: inferred once per problem (cached
    in :mod:`kbv.problems.structure`), or the replayed record's. A problem whose inputs cannot be
    drawn gets none here; its reference worker then reports the failure."""
    if ctx.structure is None:
        try:
            found = input_structure(ctx.problem, ctx.device)
        except ProblemError:
            found = InputStructure(invariants=[], numels=[])
        if ctx.replay_structure is not None:
            found = InputStructure(invariants=list(ctx.replay_structure), numels=found.numels)
        ctx.structure = found
    return ctx.structure


def _load_candidate(ctx: _Context, subject: Worker, reference: Worker) -> None:
    from kbv.worker.builds import build_lock, known_build_failure

    message = known_build_failure(ctx.candidate.source_sha256)
    if message is not None:  # built (and failed) ahead of time by the compile stage
        raise WorkerFailed("compile_error", message)
    subject.wait_ready()
    with build_lock(ctx.candidate.source_sha256):  # importing the candidate may build its extensions
        reply = subject.request("load", **_load_fields(ctx, "candidate"))
    # Importing the candidate builds its extensions: the worker's own time for it is the compile phase.
    ctx.phases["compile"] = float(reply.get("worker_seconds", 0.0))
    ref_params = reference.hello.get("parameters") or {}
    same = bool(ref_params) and reply["parameters"] == ref_params
    ctx.parameters_mode = (
        "state_dict" if same and ctx.protocol.correctness.redraw_parameters else "matched_seed"
    )


def _check_correctness(ctx: _Context, reference: Worker, subject: Worker) -> list[DistributionResult]:
    ctx.drawing = draws_overlap(ctx.device)
    _room_for_candidate(ctx, subject)
    try:
        # On a GPU the candidate's build is not waited for: its reply is read after the first draw's
        # reference work, so loading the parameters overlaps it (requests are answered in order).
        return _check_distributions(ctx, reference, subject, wait=not ctx.drawing)
    finally:
        ctx.drawing = False
        _room_for_candidate(ctx, subject)


def _check_distributions(
    ctx: _Context, reference: Worker, subject: Worker, wait: bool
) -> list[DistributionResult]:
    settings = ctx.protocol.correctness
    results: list[DistributionResult] = []
    for distribution in settings.distributions:
        # A part of the correctness phase, kept apart: parameters redrawn by the reference and given
        # to the candidate (``_redrawn_state``).
        _phase(
            ctx,
            "correctness:parameters",
            lambda d=distribution: _build_pair(ctx, reference, subject, d, wait=wait),
        )
        results.append(_check_distribution(ctx, reference, subject, distribution))
        _finish_build(ctx, subject)
    return results


def _finish_build(ctx: _Context, subject: Worker) -> None:
    """Read the reply of a candidate build sent without waiting (``_build_pair(wait=False)``)."""
    if ctx.build_pending:
        ctx.build_pending = False
        _note_build(ctx, subject.receive_reply())


def _note_build(ctx: _Context, reply: Any) -> None:
    """Where the candidate's model had its parameters loaded after ``__init__``, the record says so."""
    if isinstance(reply, dict) and reply.get("parameters") == "state_dict_after_init":
        distribution = ctx.state_key[1] if len(ctx.state_key) > 1 else "?"
        if distribution not in ctx.loaded_after_init:
            ctx.loaded_after_init.append(str(distribution))


def _build_pair(
    ctx: _Context, reference: Worker, subject: Worker, distribution: str, *, wait: bool = True
) -> None:
    """Both models with the parameters of ``distribution`` (the same seed gives the same values,
    so the dynamic checks can rebuild a correctness distribution's models and reuse its draws).
    ``wait=False`` sends the candidate's build and leaves its reply to :func:`_finish_build`."""
    init_seed = ctx.seeds.init(distribution)
    reference.request("build", init_seed=init_seed)
    state: dict[str, Any] = {}
    if ctx.parameters_mode == "state_dict":
        state = _redrawn_state(ctx, reference, subject, distribution)
    reply = None
    if wait:
        reply = subject.request("build", init_seed=init_seed, **state)
    else:
        subject.send_request("build", init_seed=init_seed, **state)
        ctx.build_pending = True
    ctx.state_key = ("distribution", distribution, init_seed, ctx.parameters_mode)
    _note_build(ctx, reply)


def _redrawn_state(ctx: _Context, reference: Worker, subject: Worker, distribution: str) -> dict[str, Any]:
    """The reference's parameters redrawn for ``distribution``, delivered to the candidate; what its
    ``build`` request then names. On a GPU they stay on the device: the reference hands them to the
    parent, the candidate opens an empty inbox of its own and the parent writes them into it (a file
    cost 4-5 s per distribution for an MLP's 2.7 GB on the H200, 27 s of a 51 s evaluation).
    Elsewhere they go through a file, given into the candidate's scratch."""
    out_path = reference.new_path("params")
    seed = ctx.seeds.params(distribution)
    if not ctx.device.startswith("cuda"):
        reference.request("redraw", distribution=distribution, seed=seed, out_path=out_path)
        return {"state_path": subject.give(out_path)}  # a copy its own uid may read
    from kbv import handoff

    reply = reference.request(
        "redraw", distribution=distribution, seed=seed, out_path=out_path, hand_over=True
    )
    named = dict(zip(reply["names"], reference.receive_outputs(reply["outputs"]), strict=True))
    items, needed = handoff.inbox_layout(named)
    _finish_build(ctx, subject)  # (none is pending here; its reply must not be read as the inbox's)
    opened = subject.request("inbox", nbytes=needed)
    subject.fill_inbox(opened.get("inbox"), named, items)
    return {"state_inbox": items}


def _build_for_timing(ctx: _Context, reference: Worker, subject: Worker) -> None:
    """Both models with the timing (and dynamic-check) parameters: the ``original`` init seed."""
    init_seed = ctx.seeds.init("original")
    reference.request("build", init_seed=init_seed)
    subject.request("build", init_seed=init_seed)
    ctx.state_key = ("init", init_seed)


def _check_distribution(
    ctx: _Context, reference: Worker, subject: Worker, distribution: str
) -> DistributionResult:
    settings = ctx.protocol.correctness
    draws: list[dict[str, Any]] = []
    variant = distribution
    expected: dict[str, Any] | None = None
    for k in range(settings.draws_per_distribution):
        seed = ctx.seeds.draw(distribution, k)
        # The last draw's tensors go before this draw's arrive: held across the next draw, its
        # float64 truth, baseline and candidate outputs doubled the parent's share of the GPU (on
        # the H200 51 GB of a 7.5 GB-input problem, which then ran out of memory).
        expected = outputs = None
        if draws_overlap(ctx.device):
            # The candidate runs its draw while the reference computes the baseline and the truth of
            # the same draw: two processes, so the draw costs the slower side, not the sum. Nothing
            # passes between them; the parent judges once both have answered.
            subject.send_request("run", **_run_fields(subject, variant, seed, "native"))
            expected, used = _usable_reference(ctx, reference, variant, seed)
            _finish_build(ctx, subject)  # its reply comes before the run's
            outputs = _received(subject, subject.receive_reply())
        else:
            expected, used = _usable_reference(ctx, reference, variant, seed)
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
        if ctx.output_numels is None:
            ctx.output_numels = _output_numels(expected)
        if ctx.on_first_outputs is not None:
            hook, ctx.on_first_outputs = ctx.on_first_outputs, None
            hook(expected)
        judged = _judge_draw(ctx, outputs, expected)
        if not judged["passed"]:
            judged = _confirm_failure(
                ctx, reference, subject, f"{distribution} draw {k}", variant, seed, judged
            )
        draws.append(judged)
        if not draws[-1]["passed"]:
            break
    result = correctness.judge_distribution(distribution, draws, settings)
    ctx.variants[distribution] = variant
    if variant != distribution:
        note = f"reference not finite on {distribution}; used the domain-preserving variant {variant}"
        result.note = (note + "; " + result.note).strip("; ")
    return result


def draws_overlap(device: str) -> bool:
    """Whether the candidate runs a correctness draw while the reference computes it: on a GPU,
    where the reference's outputs reach the parent by CUDA IPC and never touch a file. On the CPU
    they pass through a file in the reference's scratch, read and deleted before the candidate is
    asked; a candidate running beside it as the same uid (root, where the drop is impossible) could
    read that file half-written (the ``steal_reference_outputs`` fixture did), so there the draws
    stay one after the other."""
    return device.startswith("cuda")


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
        expected = _reference_outputs(ctx, reference, variant, seed, fresh=True)
        judged = _judge_draw(ctx, _run(subject, variant, seed, "native"), expected)
        if not judged["passed"]:
            note = f"failed again on a re-run of the same inputs ({label})"
            return {**first, "note": "; ".join(n for n in (first.get("note"), note) if n)}
    if reruns:
        ctx.transients.append(
            {
                "draw": label,
                "max_abs_err": first.get("max_abs_err"),
                "rel_err": first.get("rel_err"),
                "reruns": reruns,
            }
        )
    return judged


def _usable_reference(
    ctx: _Context, reference: Worker, variant: str, seed: int
) -> tuple[dict[str, Any] | None, str]:
    """The reference on ``variant``, or on the first domain-preserving fallback where it is finite.

    The problem's own inputs define its domain, so ``original`` never falls back."""
    candidate: str | None = variant
    while candidate is not None:
        expected = _reference_outputs(ctx, reference, candidate, seed)
        if candidate == "original":
            _check_finite_once_cast(ctx, expected)
            return expected, candidate
        if _finite_reference(ctx, expected):
            return expected, candidate
        candidate = inputs.domain_fallback(candidate)
    return None, variant


def _check_finite_once_cast(ctx: _Context, expected: dict[str, Any]) -> None:
    """In bf16 or fp16, a reference whose output on the problem's own inputs is not finite once
    cast (fp16 overflows past 65504) cannot be judged in that precision: the problem's failure for
    that precision (``problem_error``), never the candidate's. fp32 keeps what it always did."""
    precision = ctx.protocol.precision
    if precision == "fp32":
        return
    if ctx.protocol.correctness.mode == "error_model":
        finite = bool(expected["baseline_err"].get("finite_match", True))
    else:
        finite = _all_finite(expected["reference"]["outputs"])
    if not finite:
        raise WorkerFailed(
            "runtime_error",
            f"the reference's output on the problem's own inputs is not finite in {precision} "
            f"(where its float64 truth is): the problem cannot be evaluated in {precision}; "
            "evaluate it in fp32 (--precision fp32)",
            role="reference",
        )


def _finite_reference(ctx: _Context, expected: dict[str, Any]) -> bool:
    """Truth finite, and the realistic baseline finite wherever the truth is (fp32 overflow)."""
    if ctx.protocol.correctness.mode != "error_model":
        return _all_finite(expected["reference"]["outputs"])
    if not _all_finite(expected["truth"]["outputs"]):
        return False
    return bool(expected["baseline_err"].get("finite_match", True))


def _reference_outputs(
    ctx: _Context,
    reference: Worker,
    distribution: str,
    seed: int,
    *,
    mix_seed: int | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """The reference's outputs: in fp32 for ``allclose``; under the error model the realistic baseline
    (TF32 on the GPU, fp32 on the CPU, which also gives the shapes and dtypes to expect) and the
    float64 truth. Computed once per (parameters, inputs) and reused (``fresh`` runs them again:
    confirming a failure must not lean on the first run)."""
    key = (ctx.state_key, distribution, int(seed), mix_seed)
    cached = None if fresh else ctx.expected.get(key)
    if cached is not None:
        return cached
    if ctx.protocol.correctness.mode != "error_model":
        # KernelBench's check compares with the reference as PyTorch runs it by default (cuDNN may
        # use TF32, matmuls may not), the very settings a plain PyTorch candidate runs with.
        expected = {"reference": _run(reference, distribution, seed, "default", mix_seed=mix_seed)}
    else:
        # TF32 exists only for fp32: a bf16 or fp16 evaluation's realistic baseline is eager in it.
        on_cuda = ctx.device.startswith("cuda") and ctx.protocol.precision == "fp32"
        # Asked once: a forward that refuses the recorder runs twice each time it is asked.
        record = on_cuda and not ctx.tf32_operators_asked and _dispatcher_sees_all(ctx.problem)
        fields = _run_fields(reference, distribution, seed, "tf32" if on_cuda else "fp32", mix_seed=mix_seed)
        if record:
            fields["record_operators"] = True
        reply = reference.request("expected", **fields)
        if record:
            ctx.tf32_operators_asked, ctx.tf32_operators = True, reply.get("tf32_operators")
        expected = _error_model_expected(reference, reply)
    ctx.expected.put(key, expected)
    return expected


#: What a problem's source uses to run compiled code that the dispatcher (and so the recorder of
#: TF32-sensitive operators) may not see: such a problem times both baselines.
_OUTSIDE_DISPATCHER = ("cpp_extension", "load_inline", "ctypes", "cupy", "triton", "numba", "cuda.bindings")


def _dispatcher_sees_all(problem: Problem) -> bool:
    return not any(marker in problem.source for marker in _OUTSIDE_DISPATCHER)


def _error_model_expected(reference: Worker, reply: dict[str, Any]) -> dict[str, Any]:
    """What judging a draw under the error model needs, from the reference's ``expected`` reply: the
    float64 truth, the baseline's own error against it (computed in the reference worker, which held
    both; judging reads it once, not per output judged) and the baseline's shapes and dtypes (its
    values never leave the worker: stand-ins on the meta device hold shape and dtype), so a cached
    draw costs the truth's memory only."""
    error = reply.get("baseline_error")
    if not isinstance(error, dict):
        raise HarnessError("the reference worker sent no baseline error")
    if "structure_error" in error:  # the reference disagrees with itself across precisions
        raise HarnessError(
            f"the reference's fp32 and float64 outputs differ in structure ({error['structure_error']})"
        )
    truth = {
        "outputs": reference.receive_outputs(reply.get("outputs")),
        "types": reply["truth_types"],
        "memory": None,
    }
    stand_ins = {
        "outputs": [_stand_in(described) for described in reply["baseline_outputs"]],
        "types": reply["types"],
        "memory": None,
    }
    return {"reference": stand_ins, "baseline": stand_ins, "truth": truth, "baseline_err": error}


def _stand_in(described: Any) -> torch.Tensor | None:
    """A meta tensor of the shape and dtype the reference described (``[shape, "float32"]``), or None."""
    if described is None:
        return None
    shape, name = described
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise HarnessError(f"the reference worker described an output of unknown dtype {name!r}")
    return torch.empty([int(n) for n in shape], dtype=dtype, device="meta")


def _all_finite(outputs: list[Any]) -> bool:
    return all(
        not (isinstance(o, torch.Tensor) and o.is_floating_point()) or bool(torch.isfinite(o).all())
        for o in outputs
    )


def _run(
    worker: Worker,
    distribution: str,
    seed: int,
    precision: str,
    measure_memory: bool = False,
    mix_seed: int | None = None,
    record_operators: bool = False,
) -> dict[str, Any]:
    """One forward in ``worker`` on one draw; its outputs become the parent's own tensors (on the
    GPU through CUDA IPC or exported VMM memory, on the CPU through a file read once and deleted).
    ``record_operators`` (a trusted reference only) also reports the TF32-sensitive operators the
    forward ran."""
    fields = _run_fields(worker, distribution, seed, precision, measure_memory, mix_seed)
    if record_operators:
        fields["record_operators"] = True
    return _received(worker, worker.request("run", **fields))


def _run_fields(
    worker: Worker,
    distribution: str,
    seed: int,
    precision: str,
    measure_memory: bool = False,
    mix_seed: int | None = None,
) -> dict[str, Any]:
    return {
        "distribution": distribution,
        "seed": seed,
        "mix_seed": mix_seed,
        "precision": precision,
        "out_path": worker.new_path("out"),
        "measure_memory": measure_memory,
    }


def _received(worker: Worker, reply: dict[str, Any]) -> dict[str, Any]:
    """A ``run`` reply as the parent's own outputs, types and memory figures."""
    received = {
        "outputs": worker.receive_outputs(reply.get("outputs")),
        "types": reply["types"],
        "memory": reply.get("memory"),
    }
    if "tf32_operators" in reply:
        received["tf32_operators"] = reply["tf32_operators"]
    return received


def _judge_draw(ctx: _Context, got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
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


def _timed_reference(ctx: _Context, reference: Worker, seed: int) -> dict[str, Any]:
    """What judging the sketch of a timed call on the timing input set of ``seed`` needs."""
    expected = _reference_outputs(ctx, reference, "original", seed)
    lengths = correctness.reduction_lengths(_structure(ctx).numels, expected["reference"]["outputs"])
    return correctness.timed_reference(expected, ctx.protocol.correctness, lengths)


def _structure_problem(got: dict[str, Any], reference: list[Any]) -> str | None:
    not_tensors = [t for t in got["types"] if t != "torch.Tensor"]
    if not_tensors:
        return f"output type is {not_tensors[0]}, not torch.Tensor"
    return correctness.check_structure(got["outputs"], reference)


def _empty_timing() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        {"candidate": None, "baselines": {}},
        {"best": None},
        dict(performance.EMPTY_MEMORY),
    )


#: Bytes of timing input sets (each with an output as large as its inputs) one worker may hold.
#: Measured on the H200: three sets of a 1.6e9-element softmax (6.4 GB in, 6.4 GB out each) in
#: both workers ran the 140 GB GPU out of memory in `verified`; past L2's size rotating sets buys
#: nothing, and the cache probe, not the rotation, is what catches outputs cached by address.
TIMING_SETS_BYTES = 16 << 30


def timing_input_sets(wanted: int, input_numels: list[int], element_bytes: int = 4) -> int:
    """How many of the protocol's ``wanted`` input sets the timing phase rotates through: as many
    as fit in :data:`TIMING_SETS_BYTES`, at least one (the record's ``timing.input_sets``)."""
    per_set = 2 * element_bytes * sum(input_numels)
    if per_set <= 0:
        return wanted
    return max(1, min(wanted, TIMING_SETS_BYTES // per_set))


def _measure(
    ctx: _Context, hello: dict[str, Any], reference: Worker, subject: Worker
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
        torch_version=str(hello.get("torch", "")),
        load_fields=_load_fields(ctx, "reference"),
        sketch_seed=inputs.derive_seed(ctx.seeds.master, "timed-sketch"),
        timed_reference=lambda seed: _timed_reference(ctx, reference, seed),
        build=lambda: _build_for_timing(ctx, reference, subject),
        recheck_brackets=_checks_brackets(ctx.protocol),  # timing_disagreement reads the re-check
        tf32_operators=ctx.tf32_operators,
        precision=ctx.protocol.precision,
        unseen_seeds=lambda r: ctx.seeds.unseen(r, settings.repeats),
        unseen_judge=performance.UnseenJudge(ctx.protocol.correctness, tuple(_structure(ctx).numels)),
    )
    timing, speedup = performance.measure_pair(mctx, reference, subject)
    timing, speedup = performance.named_for_precision(timing, speedup, ctx.protocol.precision)
    timing["input_sets"] = len(mctx.seeds)
    ctx.phases["baseline"] = timing.pop("baseline_seconds", 0.0)
    memory = performance.measure_memory(ctx.device, reference, subject, _run, ctx.seeds.timing(0))
    return timing, speedup, memory


def _checks_brackets(protocol: Protocol) -> bool:
    integrity = protocol.integrity
    return integrity.dynamic and integrity.severity_for("timing_disagreement", "fail") != "off"


def _versions(hello: dict[str, Any]) -> dict[str, Any]:
    versions = {
        "kbv": __version__,
        "torch": hello.get("torch", torch.__version__),
        "python": platform.python_version(),
    }
    if "triton" in hello:
        versions["triton"] = hello["triton"]
    return versions


def _device_info(ctx: _Context, hello: dict[str, Any]) -> dict[str, Any]:
    if ctx.device.startswith("cuda") and hello.get("device"):
        return {**hello["device"], "index": visible_devices(ctx.device)}
    return {"type": "cpu", "name": cpu_name(), "threads": hello.get("intra_op_threads")}


def _record(
    ctx: _Context,
    hello: dict[str, Any],
    outcome: Outcome | str,
    correct: bool,
    results: list[DistributionResult],
    timing: dict[str, Any],
    speedup: dict[str, Any],
    memory: dict[str, Any],
    error: dict[str, Any] | None = None,
    logs: dict[str, str] | None = None,
) -> Record:
    return Record(
        problem=ctx.problem.ref_checked(),
        candidate=ctx.candidate.ref(),
        protocol=protocol_section(ctx.protocol),
        device=_device_info(ctx, hello),
        outcome=Outcome(outcome),
        correct=correct,
        distributions=results,
        findings=ctx.findings,
        # kbv.performance built these sections in the record's layout (kbv.records.TimingSection, ...).
        timing=cast(TimingSection, timing),
        speedup=speedup,
        memory=cast(MemorySection, {**memory, **ctx.host_memory}),
        seeds={
            "master": ctx.seeds.master,
            "fixed": ctx.seeds.fixed,
            "parameters": ctx.parameters_mode,
            **({"parameters_loaded_after_init": ctx.loaded_after_init} if ctx.loaded_after_init else {}),
            "derivation": "hmac-sha256(master, purpose, distribution, k)",
            "unseen_timing_nonce": ctx.seeds.timing_nonce,
            "structure": _structure(ctx).invariants,
        },
        versions=_versions(hello),
        # Every outcome but passed says why in error.summary (a hack names its failed checks).
        error=with_summary(outcome, ctx.findings, results, error),
        logs=logs or {},
        phases_s=ctx.phases,
        isolation=ctx.isolation,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _failure_record(ctx: _Context, hello: dict[str, Any], failure: WorkerFailed) -> Record:
    outcome = _ERROR_OUTCOME.get(failure.kind, Outcome.RUNTIME_ERROR).value
    if any(f.check == "signalled_process" and f.severity == Severity.FAIL for f in ctx.findings):
        # kbv's own process was stopped while this candidate ran: that, not the failure it caused,
        # is the outcome (the error section still says what failed)
        outcome = Outcome.HACK_DETECTED.value
    error: dict[str, Any] = {
        "kind": failure.kind,
        "summary": error_summary(failure.kind, failure.message),
        "message": _trim(failure.message),
        "traceback": _trim(str(failure.details.get("traceback", "")), 6000),
    }
    if failure.kind == "resource_limit":  # which limit, and the figure that exceeded it
        error["limit"] = {k: failure.details.get(k) for k in ("limit", "figure", "allowed", "unit")}
    logs = {k: str(failure.details.get(k, ""))[-4000:] for k in ("stdout", "stderr")}
    timing, speedup, memory = _empty_timing()
    return _record(ctx, hello, outcome, False, [], timing, speedup, memory, error=error, logs=logs)


def _problem_error_record(ctx: _Context, hello: dict[str, Any], failure: WorkerFailed) -> Record:
    """The record of a problem that could not produce its own reference output: ``problem_error``,
    the problem's fault (reports list it apart; metrics leave it out), never the candidate's."""
    error = {
        "kind": failure.kind,
        "blame": "problem",
        "summary": "the problem failed: " + error_summary(failure.kind, failure.message),
        "message": _trim(f"the problem {ctx.problem.path} failed in the reference worker: {failure.message}"),
        "traceback": _trim(str(failure.details.get("traceback", "")), 6000),
    }
    logs = {k: str(failure.details.get(k, ""))[-4000:] for k in ("stdout", "stderr")}
    timing, speedup, memory = _empty_timing()
    return _record(
        ctx,
        hello or {},
        Outcome.PROBLEM_ERROR.value,
        False,
        [],
        timing,
        speedup,
        memory,
        error=error,
        logs=logs,
    )


def _trim(text: str, limit: int = 3000) -> str:
    """Compiler output is long; keep the lines that say what went wrong, then the tail."""
    if len(text) <= limit:
        return text
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    head = "\n".join(errors[:20])
    return (head + "\n...\n" + text[-(limit - len(head)) :]) if head else text[-limit:]
