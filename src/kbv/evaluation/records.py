"""The record of one evaluation: assembled from its context, for a verdict, a candidate's failure
or the problem's own."""

from __future__ import annotations

import datetime as _dt
import platform
from typing import Any, cast

import torch

from kbv import performance, wire_replies
from kbv._version import __version__
from kbv.devices import cpu_name
from kbv.evaluation.context import _Context, _structure
from kbv.evaluation.static_scan import static_findings_joined
from kbv.records import (
    DistributionResult,
    MemorySection,
    Outcome,
    Record,
    Severity,
    TimingSection,
    error_summary,
    protocol_section,
    with_summary,
)
from kbv.worker import WorkerFailed, visible_devices

_ERROR_OUTCOME = {
    "compile_error": Outcome.COMPILE_ERROR,
    "import_error": Outcome.RUNTIME_ERROR,
    "runtime_error": Outcome.RUNTIME_ERROR,
    "cuda_error": Outcome.RUNTIME_ERROR,
    "timeout": Outcome.TIMEOUT,
    "crashed": Outcome.CRASHED,
    "resource_limit": Outcome.RESOURCE_LIMIT,
}


def _empty_timing() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        {"candidate": None, "baselines": {}},
        {"best": None},
        dict(performance.EMPTY_MEMORY),
    )


def _versions(hello: wire_replies.Hello | None) -> dict[str, Any]:
    versions = {
        "kbv": __version__,
        "torch": hello.torch if hello is not None else torch.__version__,
        "python": platform.python_version(),
    }
    if hello is not None and hello.triton is not None:
        versions["triton"] = hello.triton
    return versions


def _device_info(ctx: _Context, hello: wire_replies.Hello | None) -> dict[str, Any]:
    if ctx.device.startswith("cuda") and hello is not None and hello.device:
        return {**hello.device, "index": visible_devices(ctx.device)}
    threads = hello.intra_op_threads if hello is not None else None
    return {"type": "cpu", "name": cpu_name(), "threads": threads}


def _record(
    ctx: _Context,
    hello: wire_replies.Hello | None,
    outcome: Outcome | str,
    correct: bool,
    results: list[DistributionResult],
    timing: dict[str, Any],
    speedup: dict[str, Any],
    memory: dict[str, Any],
    error: dict[str, Any] | None = None,
    logs: dict[str, str] | None = None,
) -> Record:
    static_findings_joined(ctx)  # (every record's findings hold the static scan's)
    return Record(
        problem=ctx.problem.ref_checked(),
        candidate=ctx.candidate.ref(),
        protocol=protocol_section(ctx.protocol),
        device=_device_info(ctx, hello),
        outcome=Outcome(outcome),
        correct=correct,
        distributions=results,
        findings=ctx.found.findings,
        # kbv.performance built these sections in the record's layout (kbv.records.TimingSection, ...).
        timing=cast(TimingSection, timing),
        speedup=speedup,
        memory=cast(MemorySection, {**memory, **ctx.found.host_memory, **_parent_peaks(ctx)}),
        seeds={
            "master": ctx.seeds.master,
            "fixed": ctx.seeds.fixed,
            "parameters": ctx.cache.parameters_mode,
            **({"parameters_loaded_after_init": late} if (late := ctx.found.loaded_after_init) else {}),
            "derivation": "hmac-sha256(master, purpose, distribution, k)",
            "unseen_timing_nonce": ctx.seeds.timing_nonce,
            "structure": _structure(ctx).invariants,
        },
        versions=_versions(hello),
        # Every outcome but passed says why in error.summary (a hack names its failed checks).
        error=with_summary(outcome, ctx.found.findings, results, error),
        logs=logs or {},
        phases_s=ctx.found.phases,
        isolation=ctx.found.isolation,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _parent_peaks(ctx: _Context) -> dict[str, Any]:
    """``parent_device_peak_bytes``: the most kbv's parent reserved on the GPU in each phase
    (``kbv.evaluation.context._peaks_within``); nothing on the CPU."""
    return {"parent_device_peak_bytes": dict(ctx.found.parent_peaks)} if ctx.found.parent_peaks else {}


def _failure_record(ctx: _Context, hello: wire_replies.Hello | None, failure: WorkerFailed) -> Record:
    static_findings_joined(ctx)
    outcome = _ERROR_OUTCOME.get(failure.kind, Outcome.RUNTIME_ERROR).value
    if any(f.check == "signalled_process" and f.severity == Severity.FAIL for f in ctx.found.findings):
        # kbv's own process was stopped while this candidate ran: that, not the failure it caused,
        # is the outcome (the error section still says what failed)
        outcome = Outcome.HACK_DETECTED.value
    error: dict[str, Any] = {
        "kind": failure.kind,
        "summary": error_summary(failure.kind, failure.message),
        "message": _trim(failure.message),
        "traceback": _trim(str(failure.details.get("traceback", "")), 6000),
    }
    if failure.role:  # a candidate's outcome can come from the reference's failure beside it
        error["worker"] = failure.role
    if failure.kind == "resource_limit":  # which limit, the figure that exceeded it, and when
        error["limit"] = {k: failure.details.get(k) for k in ("limit", "figure", "allowed", "unit")}
        if failure.details.get("during"):
            error["limit"]["during"] = failure.details["during"]
    logs = {k: str(failure.details.get(k, ""))[-4000:] for k in ("stdout", "stderr")}
    timing, speedup, memory = _empty_timing()
    return _record(ctx, hello, outcome, False, [], timing, speedup, memory, error=error, logs=logs)


def _problem_error_record(ctx: _Context, hello: wire_replies.Hello | None, failure: WorkerFailed) -> Record:
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
        hello,
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
