"""The GPU-memory budget of one evaluation: whether it holds its GPU alone, the room the reference
leaves for the candidate, the candidate's widened limit (held in the evaluation's
``kbv.worker.MemoryBudget``, which the limit poll reads), and how many timing input sets fit."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from kbv import telemetry, wire_replies
from kbv.device_lock import DeviceLock
from kbv.devices import allocator_figures
from kbv.evaluation.context import _Context, _structure
from kbv.worker import MemoryBudget, Worker, WorkerFailed

#: An evaluation keeps about this many copies of its inputs' bytes on the GPU at once (inputs and
#: outputs in both workers, the float64 inputs and truth, the TF32 baseline's output, the parent's
#: copy of the candidate's output); when that exceeds this share of the GPU's memory it holds the
#: GPU alone from its first draw to its end, not only while it times (kbv.device_lock).
GPU_ALONE_COPIES = 12


GPU_ALONE_SHARE = 0.25


def _gpu_hold(ctx: _Context, hello: wire_replies.Hello, output_numels: list[int] | None = None) -> str:
    """How this evaluation holds its GPU, for the record's ``isolation.gpu`` ("" on the CPU): from
    its inputs before the first draw, and again with its outputs once the first draw knows them
    (``output_numels``; a convolution's output can be 100x its input)."""
    if not ctx.device.startswith("cuda"):
        return ""
    total = ctx.gpu.device_total_bytes = int((hello.device or {}).get("total_memory_bytes") or 0)
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
    if not ctx.gpu.held.startswith("alone"):
        return True
    if ctx.gpu.output_numels is None or ctx.gpu.device_total_bytes <= 0:
        return False
    return (
        GPU_ALONE_COPIES * sum(_io_bytes(ctx, ctx.gpu.output_numels))
        <= SIDE_BY_SIDE_SHARE * ctx.gpu.device_total_bytes
    )


def _io_bytes(ctx: _Context, output_numels: list[int] | None) -> tuple[int, int]:
    """(inputs, outputs) bytes as float32: the inputs as the structure draws counted them."""
    return 4 * sum(_structure(ctx).numels), 4 * sum(output_numels or [])


def _output_numels(expected: dict[str, Any]) -> list[int]:
    """Element counts of a draw's expected outputs (stand-ins under the error model)."""
    outputs = (expected.get("reference") or {}).get("outputs") or []
    return [int(o.numel()) for o in outputs if isinstance(o, torch.Tensor)]


def _hold_alone(ctx: _Context, gpu: DeviceLock, subject: Worker, hello: wire_replies.Hello) -> None:
    gpu.hold_alone()  # until the lock closes, after the workers and the parent's copies
    ctx.gpu.held += _widen_device_limit(ctx.gpu.budget, subject, hello)
    _room_for_candidate(ctx, subject)


def _room_for_candidate(ctx: _Context, subject: Worker) -> None:
    """Set what the reference worker must leave free beside the allocator cache it keeps between
    requests (the budget's ``room_bytes``, in the memory rule of every request: kbv.worker._memory):
    the candidate's device limit in force (the budget's, widened when the evaluation holds the GPU
    alone; the whole device where the candidate has none), except during the correctness draws of an
    evaluation that holds its GPU alone. There each of the reference's requests runs beside the
    candidate's draw, so what it keeps between them is no more than what its next request takes at
    the same time, and no other evaluation shares the GPU; the first request after the draws (the
    timing phase's build) hands back what the limit needs."""
    if ctx.gpu.drawing and ctx.gpu.held.startswith("alone"):
        ctx.gpu.budget.room_bytes = 0
        return
    limits = ctx.gpu.budget.limits_of(subject.spec)
    if limits is not None and limits.device_memory_gb:
        ctx.gpu.budget.room_bytes = int(float(limits.device_memory_gb) * (1 << 30))
    else:
        ctx.gpu.budget.room_bytes = ctx.gpu.device_total_bytes or None


#: How the ``HarnessError`` of :func:`_room_not_kept` begins: a sweep that resumes (the benchmarks'
#: ``reference_as_candidate.py``) tells by it a problem too large for its GPU from a rejection.
GPU_TOO_SMALL = "the GPU ran out of memory for the candidate, and not through its own use"
#: How that error begins where the trusted reference worker ran out (:func:`_starved_reference`).
REFERENCE_RAN_OUT = "the GPU ran out of memory for the reference worker, beside a candidate within its limit"
#: How the ``HarnessError`` of :func:`_parent_ran_out` begins (kbv's own copies ran the GPU out).
PARENT_RAN_OUT = "the GPU ran out of memory in kbv's parent process, and not through the candidate's use"


def too_small_for_gpu(error: str) -> bool:
    """Whether a harness error says the evaluation needs a GPU with more memory (any of its kinds)."""
    return any(start in error for start in (GPU_TOO_SMALL, REFERENCE_RAN_OUT, PARENT_RAN_OUT))


def _holders(usage: dict[int, int], roles: dict[str, list[int]]) -> str:
    """What each of kbv's processes held of the GPU, and everything else, for a reader who must
    tell which part of kbv (or which leftover process) took the room: "kbv's parent 14.7 GiB, ..."."""
    named: set[int] = set()
    parts = []
    for role, pids in roles.items():
        mine = set(pids) & usage.keys()
        named |= mine
        parts.append(f"{role} {sum(usage[p] for p in mine) / (1 << 30):.1f} GiB")
    rest = [p for p in usage if p not in named]
    parts.append(f"{len(rest)} other processes {sum(usage[p] for p in rest) / (1 << 30):.1f} GiB")
    return ", ".join(parts)


#: What closes both harness errors on a GPU that cannot keep the candidate's promised room.
_NEEDS_MORE = (
    "This problem needs a GPU with more memory under this protocol, or a smaller promise ([limits] "
    "device_memory_gb and device_memory_alone_share); this is not the candidate's failure."
)


def _room_not_kept(
    ctx: _Context,
    subject: Worker,
    failure: WorkerFailed,
    roles: dict[str, list[int]] | None = None,
    reference: Worker | None = None,
) -> str | None:
    """Why a worker's running out of device memory is kbv's failure, not the candidate's, or None.

    kbv promises the candidate its device-memory limit in force (the room the reference leaves it:
    :func:`_room_for_candidate`). When the candidate reports running out while every other process
    on the GPU (the parent, the reference, the spares, other evaluations or programs), as NVML
    counts them now, holds more than the GPU's total less that limit, the promise was not kept: an
    honest candidate within its limit would have failed too. Seven level-1 references run as
    candidates failed so on an 80 GB H100 (2026-12-06), each recorded as its ``runtime_error``. Only
    trusted figures decide (the candidate's message merely says it ran out): a candidate that
    claims to have run out on a GPU where its room was kept keeps its failure, and where NVML does
    not list the candidate's worker (pids of another namespace) nothing is decided. A helper that
    escaped the worker's tree (possible only without a cgroup: docs/integrity-dynamic.md) would
    count among the others. ``roles``: kbv's other processes by what they are (the parent, the
    reference worker, the spares), so the message says which held the room. ``reference``: its
    allocator's peak counts where its last request ran beside the failed one
    (:func:`_with_reference_peak`); where the reference itself ran out, :func:`_starved_reference`
    decides."""
    if failure.role not in ("candidate", "reference") or "out of memory" not in failure.message.lower():
        return None
    limits, total = subject.limits, ctx.gpu.device_total_bytes
    if not ctx.device.startswith("cuda") or limits is None or not limits.device_memory_gb or total <= 0:
        return None
    usage = telemetry.device_process_bytes(ctx.device)
    if usage is None:
        return None
    mine = set(subject.members())
    if not mine & usage.keys():  # NVML counts pids of another namespace: the candidate's use is unknown
        return None
    promised = float(limits.device_memory_gb) * (1 << 30)
    holders = {**(roles or {}), "the candidate": sorted(mine)}
    if failure.role == "reference":
        accounts = _where_the_room_went(ctx, usage)
        return _starved_reference(failure, usage, mine, promised, total, holders, reference, accounts)
    measured, usage = usage, _with_reference_peak(usage, reference, subject)
    at_peak = (
        " (the reference worker's figure: its peak during its request beside the candidate's)"
        if usage != measured
        else ""
    )
    others = sum(held for pid, held in usage.items() if pid not in mine)
    gib = 1 << 30
    if total - others >= promised:
        return None
    return (
        f"{GPU_TOO_SMALL}: the other processes on it (kbv's parent, reference and spare workers, "
        f"and anything else) held "
        f"{others / gib:.1f} GiB of its {total / gib:.1f} GiB, leaving {(total - others) / gib:.1f} GiB "
        f"of the {promised / gib:.1f} GiB the candidate's device-memory limit promises it "
        f"({_holders(usage, holders)}){at_peak}. {_where_the_room_went(ctx, measured)}{_NEEDS_MORE} The "
        f"candidate's worker said: {failure.message.splitlines()[0][:300]}"
    )


def _starved_reference(
    failure: WorkerFailed,
    usage: dict[int, int],
    mine: set[int],
    promised: float,
    total: int,
    holders: dict[str, list[int]],
    reference: Worker | None,
    accounts: str = "",
) -> str | None:
    """Why the trusted reference worker's running out of device memory is kbv's failure, or None.

    The candidate may hold its whole promised room while the reference computes beside it. Where
    what the reference needed (its allocator's peak in the failed request and what it then asked
    for, by its own trusted account) with kbv's parent, the spares and anything else leaves less
    than that room, no candidate within its limit could have kept the reference from running out:
    KernelBench's 45_Average_Pooling_2D with TF32 on an H100 (2026-12-07) had the reference, holding
    its 16 GiB draw, ask for 32 GiB more for the float64 copy beside a candidate of 32.7 GiB, and was
    recorded as the candidate's ``runtime_error``. Where the room fits, or the candidate holds more
    than its limit now, the candidate took what was not its own: the failure stays its."""
    gib = 1 << 30
    candidate_held = sum(usage.get(pid, 0) for pid in mine)
    if reference is None or candidate_held > promised:
        return None
    span = reference.last_span  # its failed request's: the reply that raised was read last
    peak = span.device_reserved_peak if span is not None and span.device_reserved_peak else 0
    _, held = _with_reference_at_least(usage, reference, peak)
    asked = _asked_bytes(failure.message)
    needed, reference_needed = _with_reference_at_least(usage, reference, held + asked)
    others = sum(bytes_ for pid, bytes_ in needed.items() if pid not in mine)
    if total - others >= promised:
        return None
    return (
        f"{REFERENCE_RAN_OUT}: it needed {reference_needed / gib:.1f} GiB (what it held, "
        f"{held / gib:.1f} GiB by NVML or its allocator's peak, and the "
        f"{asked / gib:.1f} GiB it then asked for); with kbv's parent, the spare workers and "
        f"anything else, the processes other than the candidate needed {others / gib:.1f} GiB "
        f"of its {total / gib:.1f} GiB, leaving {(total - others) / gib:.1f} GiB of the "
        f"{promised / gib:.1f} GiB the candidate's device-memory limit promises it, and the "
        f"candidate held {candidate_held / gib:.1f} GiB, within it "
        f"({_holders(needed, holders)}). {accounts}{_NEEDS_MORE} The reference worker said: "
        f"{failure.message.splitlines()[0][:300]}"
    )


def _where_the_room_went(ctx: _Context, usage: dict[int, int]) -> str:
    """The phase that ran out, and :func:`_parent_split`: what a reader needs to tell which of kbv's
    copies to cut next. On an H100 (2026-12-07) kbv's parent held 30.7 GiB beside a bf16 candidate
    at 1.6e9 elements, and 12 GiB of the GPU was in no listed process; which copies those were, no
    figure said."""
    return f"It ran out during {ctx.found.failed_phase or 'the evaluation'}{_parent_split(ctx, usage)}. "


def _parent_split(ctx: _Context, usage: dict[int, int]) -> str:
    """ "; of kbv's parent's figure, X GiB were tensors in use and Y GiB its allocator's cache", and
    the GPU's memory outside every process NVML lists where that is half a GiB or more; "" where
    this process has no CUDA context. Read now, after the failure."""
    figures = allocator_figures(ctx.device)
    if figures is None:
        return ""
    gib = 1 << 30
    cache = figures["reserved"] - figures["allocated"]
    said = (
        f"; of kbv's parent's figure, {figures['allocated'] / gib:.1f} GiB were tensors in use and "
        f"{cache / gib:.1f} GiB its allocator's cache"
    )
    unlisted = figures["total"] - figures["free"] - sum(usage.values())
    if unlisted >= gib // 2:
        said += f"; {unlisted / gib:.1f} GiB of the GPU were held by no process NVML lists"
    return said


#: torch's out-of-memory message: "Tried to allocate 32.00 GiB" (c10's format_size units).
_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)")
_UNIT_BYTES = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _asked_bytes(message: str) -> int:
    """The allocation a trusted worker's out-of-memory error says it asked for (0 where the message
    does not say: that can only understate what it needed)."""
    found = _ASKED.search(message)
    return int(float(found.group(1)) * _UNIT_BYTES[found.group(2)]) if found else 0


def _with_reference_peak(usage: dict[int, int], reference: Worker | None, subject: Worker) -> dict[int, int]:
    """NVML's figures, the reference worker's raised to its allocator's peak during its last request
    where that request ran beside the candidate's failed one. The reference hands its working memory
    back before it replies, and the parent reads its reply first, so by the time the candidate's
    failure arrives NVML no longer shows what the reference held beside it. The peak is the trusted
    worker's own account (a candidate's is never read) and counts its allocator's reservation only,
    not its CUDA context: it can only understate what the reference held."""
    if reference is None:
        return usage
    span, failed = reference.last_span, subject.last_span
    if span is None or failed is None or span.device_reserved_peak is None or not span.overlaps(failed):
        return usage
    return _with_reference_at_least(usage, reference, span.device_reserved_peak)[0]


def _with_reference_at_least(
    usage: dict[int, int], reference: Worker, floor: int
) -> tuple[dict[int, int], int]:
    """NVML's figures with the reference worker's raised to ``floor`` bytes where NVML shows less
    (the excess on the first of its pids), and the reference's figure then."""
    pids = [p for p in reference.members() if p in usage] or reference.members()[:1]
    now = sum(usage.get(p, 0) for p in pids)
    if not pids or floor <= now:
        return usage, now
    return {**usage, pids[0]: usage.get(pids[0], 0) + floor - now}, floor


def _parent_ran_out(ctx: _Context, subject: Worker, error: BaseException, roles: dict[str, list[int]]) -> str:
    """Why kbv's parent running out of device memory (its copies of outputs and truths, its
    judging) is kbv's failure: the candidate was within its limits (the caller checked), so an
    honest candidate would have met the same end. The message names the phase and what each
    process held, so a reader can tell which part of kbv needs the room."""
    usage = telemetry.device_process_bytes(ctx.device)
    held = _holders(usage, {**roles, "the candidate": subject.members()}) if usage else "no figures"
    limits = subject.limits
    promise = (
        f"{float(limits.device_memory_gb):.1f} GiB"
        if limits is not None and limits.device_memory_gb
        else "the whole GPU"
    )
    return (
        f"{PARENT_RAN_OUT}: during {ctx.found.failed_phase or 'the evaluation'}, with the candidate "
        f"within its limits (its device-memory limit promises it {promise} of the GPU's "
        f"{ctx.gpu.device_total_bytes / (1 << 30):.1f} GiB). On the GPU: {held}"
        f"{_parent_split(ctx, usage or {})}. "
        f"{_NEEDS_MORE} torch said: "
        f"{str(error).splitlines()[0][:300] if str(error) else type(error).__name__}"
    )


def _hold_alone_for_outputs(
    ctx: _Context, gpu: DeviceLock, subject: Worker, hello: wire_replies.Hello
) -> Callable[[dict[str, Any]], None]:
    """What the first correctness draw calls with its expected outputs: hold the GPU alone from
    then on if the outputs make the evaluation large (the inputs alone did not)."""

    def with_outputs(expected: dict[str, Any]) -> None:
        held = _gpu_hold(ctx, hello, _output_numels(expected))
        if held.startswith("alone"):
            ctx.gpu.held = held
            _hold_alone(ctx, gpu, subject, hello)

    return with_outputs


def _widen_device_limit(budget: MemoryBudget, subject: Worker, hello: wire_replies.Hello) -> str:
    """Raise the candidate's device-memory limit in the evaluation's budget (its worker's spec stays
    as launched) for an evaluation that holds its GPU alone; what was done, for the record's
    ``isolation.gpu`` ("" when nothing changed)."""
    total = int((hello.device or {}).get("total_memory_bytes") or 0)
    widened = budget.widen_device_limit(subject.spec, total)
    if widened is None:
        return ""
    before, share_gb = widened
    share = float(subject.spec.limits.device_memory_alone_share)  # the protocol's [limits]
    return (
        f"; the candidate's device-memory limit raised from {before:g} GiB to "
        f"{share_gb:.1f} GiB ({share:.0%} of the GPU, [limits] device_memory_alone_share: no other "
        "evaluation shares it)"
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
