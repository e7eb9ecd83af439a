"""What one evaluation carries from phase to phase: its seeds, its context (what it evaluates, what it
has found, how it holds its GPU, the reference outputs it keeps), its phase clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kbv import inputs
from kbv.candidates import Candidate
from kbv.devices import reserved_peak_since_last_mark
from kbv.evaluation.cache import ExpectedCache
from kbv.problems import Problem, ProblemError
from kbv.problems.structure import InputStructure, input_structure
from kbv.protocol import Protocol
from kbv.records import Finding
from kbv.worker import MemoryBudget

REFERENCE_TIMEOUT_S = 1800.0


# KernelBench constructs models and draws inputs from fixed seeds; the standard protocol keeps that.
STANDARD_SEED = 42


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


@dataclass
class _Found:
    """What the evaluation has found so far, for its record."""

    findings: list[Finding] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    #: Distributions whose candidate build could not take the parameters during ``__init__`` (they
    #: were loaded after it: ``kbv.child.construct``), so state it derived there is the seed's.
    loaded_after_init: list[str] = field(default_factory=list)
    # Failing draws that passed every re-run on the same inputs (see _confirm_failure).
    transients: list[dict[str, Any]] = field(default_factory=list)
    # The input distribution each protocol distribution really ran (a domain fallback, or itself).
    variants: dict[str, str] = field(default_factory=dict)
    #: The static scan running beside the workers' loading (``kbv.evaluation.static_scan.StaticScan``), until
    #: its findings are joined.
    static_scan: Any = None
    # Filled at the end of the evaluation by _end_containment.
    isolation: dict[str, Any] = field(default_factory=dict)
    host_memory: dict[str, Any] = field(default_factory=dict)
    #: The innermost phase an exception left (a harness error's message names it), "" if none did.
    failed_phase: str = ""
    #: The most kbv's parent reserved on the GPU in each phase, bytes (:func:`_peaks_within`); the
    #: phases open now, innermost last.
    parent_peaks: dict[str, int] = field(default_factory=dict)
    open_phases: list[str] = field(default_factory=list)


@dataclass
class _GpuState:
    """How the evaluation holds its GPU and what it lets its workers keep there (kbv.evaluation.budget)."""

    # How the evaluation held its GPU (_gpu_hold); "" on the CPU.
    held: str = ""
    # The GPU's memory (the reference's hello; 0 on the CPU) and the outputs' element counts (the
    # first correctness draw's): what _side_by_side weighs.
    device_total_bytes: int = 0
    output_numels: list[int] | None = None
    # Called once with the first correctness draw's expected outputs (_hold_alone_for_outputs).
    on_first_outputs: Callable[[dict[str, Any]], None] | None = None
    # The memory rule both workers are sent with every request (their ``budget``): the room the
    # reference must leave free beside what its allocator keeps (_room_for_candidate), which depends
    # on whether the correctness draws are running (``drawing``).
    budget: MemoryBudget = field(default_factory=MemoryBudget)
    drawing: bool = False


@dataclass
class _ReferenceCache:
    """The models' parameters right now and the reference's outputs computed for them."""

    parameters_mode: str = "matched_seed"
    # The reference model's state, name -> shape (its ``load`` reply): a candidate's that matches
    # it can be given the reference's parameters.
    reference_parameters: dict[str, Any] = field(default_factory=dict)
    # Which build or redraw the models hold, so reference outputs are reused only for the
    # parameters they were computed with.
    state_key: tuple[Any, ...] = ()
    expected: ExpectedCache = field(default_factory=lambda: ExpectedCache(0))
    expected_shared: bool = False  # ``expected`` is a batch's (kbv._shared_reference), kept after
    # The TF32-sensitive operators the reference's realistic baseline ran (kbv.child.tf32_ops),
    # asked for once, on its first correctness draw on the GPU; None when not (or not yet) given.
    tf32_operators: dict[str, Any] | None = None
    tf32_operators_asked: bool = False


@dataclass
class _Context:
    """One evaluation: what it evaluates (problem, candidate, protocol, device, seeds, inputs'
    invariants), and three small states it carries from phase to phase."""

    problem: Problem
    candidate: Candidate
    protocol: Protocol
    device: str
    seeds: _Seeds
    # Input invariants: a replayed record's own, else inferred once (see _structure).
    replay_structure: list[Any] | None = None
    structure: InputStructure | None = None
    # How many input elements an output element reduces at most, from the first correctness draw:
    # which of the protocol's ``long_reduction_distributions`` are drawn (kbv.evaluation.draws).
    longest_reduction: int | None = None
    found: _Found = field(default_factory=_Found)
    gpu: _GpuState = field(default_factory=_GpuState)
    cache: _ReferenceCache = field(default_factory=_ReferenceCache)


@contextlib.contextmanager
def _phase_entered(ctx: _Context, name: str, manager: Any) -> Iterator[None]:
    """``with manager``, the time its entry took counted as the phase ``name``."""
    started = time.monotonic()
    with _peaks_within(ctx, name), manager:
        ctx.found.phases[name] = ctx.found.phases.get(name, 0.0) + time.monotonic() - started
        yield


def _phase(ctx: _Context, name: str, work: Any) -> Any:
    started = time.monotonic()
    try:
        with _peaks_within(ctx, name):
            return work()
    except BaseException:
        ctx.found.failed_phase = ctx.found.failed_phase or name
        raise
    finally:
        ctx.found.phases[name] = ctx.found.phases.get(name, 0.0) + time.monotonic() - started


@contextlib.contextmanager
def _peaks_within(ctx: _Context, name: str) -> Iterator[None]:
    """Count the parent's GPU reservation while ``name`` runs toward its peak (``record.memory``'s
    ``parent_device_peak_bytes``). At each phase's start and end the peak since the last such mark
    goes to every phase open in between, so a phase inside another counts toward both. Why: which
    of kbv's copies to cut for an 80 GB card was guessed from the code; this says where the
    parent's memory goes in every GPU evaluation, also where everything fits."""
    _mark_peak(ctx)
    ctx.found.open_phases.append(name)
    try:
        yield
    finally:
        try:
            _mark_peak(ctx)
        finally:
            ctx.found.open_phases.remove(name)


def _mark_peak(ctx: _Context) -> None:
    peak = reserved_peak_since_last_mark(ctx.device)
    if peak is None:
        return
    for name in ctx.found.open_phases:
        ctx.found.parent_peaks[name] = max(ctx.found.parent_peaks.get(name, 0), peak)


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
