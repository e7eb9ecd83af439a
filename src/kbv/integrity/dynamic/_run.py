"""Running the dynamic checks: every finding is made by a registered check, in the registry's order.

Three moments make them. With the protocol's dynamic checks on, :func:`run_dynamic_checks` runs every
check not made at the end against the live session; without them, :func:`findings_without_probes`
runs the checks that need no probe against what the evaluation recorded. At the evaluation's end,
:func:`containment_findings` runs the ``at_end`` checks against what containment found.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kbv import wire
from kbv.integrity._registry import Check, ordered_checks
from kbv.integrity.dynamic._context import (
    NOT_CHECKED,
    DynamicContext,
    _finding,
    _ProbeFailed,
    _ReferenceProbeFailed,
    count_seconds,
)
from kbv.integrity.dynamic.containment import ContainmentContext
from kbv.records import Finding

#: Checks that read a probe's outputs: the probe is released after the last of them has run.
_PROBE_READERS = {"cache": ("caching_probe",), "poison": ("unwritten_output", "nondeterminism")}


@dataclass
class DynamicResult:
    """The dynamic checks' findings, and their corrections (:attr:`DynamicContext.corrections`)."""

    findings: list[Finding]
    corrections: dict[str, Any]


@dataclass(frozen=True)
class Recorded:
    """What the checks that need no probe read when no session runs: the evaluation's records."""

    timing: dict[str, Any] | None
    transients: list[dict[str, Any]]


def dynamic_order() -> list[str]:
    """Every dynamic check's name, in the order the checks run."""
    return [c.name for c in ordered_checks("dynamic")]


def run_dynamic_checks(session: Any) -> DynamicResult:
    """Run every dynamic check but those made at the end against a live session, in the registry's
    order; return their findings and the corrections they make (the caller applies them: a corrected
    speedup replaces its own).

    Both workers are rebuilt first with the same seed, so the candidate and the reference hold the
    same parameters. A candidate that raises inside a probe (after passing the same kind of call
    before) gets a fail finding for that check; a crash or timeout propagates to the evaluation.
    """
    session.rebuild()
    ctx = DynamicContext(session)
    if ctx.on_cuda:  # the two slow probes (the profiler's start-up, FlopCounterMode) run side by side
        spec = ctx.draw(0)
        both: dict[str, tuple[Any, wire.Request]] = {
            "kernels": (session.subject, wire.ProbeKernels(inputs=spec))
        }
        if session.correct:
            both["flops"] = (session.reference, wire.ProbeFlops(inputs=spec))
        ctx.concurrently(both)
    checks = [c for c in ordered_checks("dynamic") if not c.at_end]
    names = [c.name for c in checks]
    last_reader = {
        probe: [n for n in names if n in readers][-1]
        for probe, readers in _PROBE_READERS.items()
        if any(n in readers for n in names)
    }
    findings: list[Finding] = []
    failed_probes: set[str] = set()
    for check in checks:
        started = time.monotonic()
        try:
            findings.extend(check.run(ctx))
        except _ReferenceProbeFailed as exc:
            detail = f"{NOT_CHECKED}: the reference failed this check's probe ({exc})"
            findings.append(_finding(check.name, detail, "info"))
        except _ProbeFailed as exc:
            message = str(exc)
            if message in failed_probes:
                continue
            failed_probes.add(message)
            detail = f"the candidate failed inside this check's probe after passing ordinary calls: {message}"
            findings.append(_finding(check.name, detail, "fail"))
        finally:
            for probe in [p for p, reader in last_reader.items() if reader == check.name]:
                ctx.release(probe)
            # its probes and the reference's answers it asked for included: where ``integrity``
            # goes beyond the probes' own calls, such as judging their outputs
            count_seconds(session, f"check:{check.name}", time.monotonic() - started)
    return DynamicResult(findings, dict(ctx.corrections))


def findings_without_probes(timing: dict[str, Any] | None, transients: list[dict[str, Any]]) -> list[Finding]:
    """Without the dynamic checks, what needs no probe still counts: the checks that need none (draws
    whose failure did not repeat, wrong outputs of the real timed calls), at their default severity."""
    return _run(_checks(needs_probe=False, at_end=False), Recorded(timing, list(transients)))


def containment_findings(
    left: list[dict[str, Any]], lock_killed: list[dict[str, Any]], stops: list[dict[str, Any]]
) -> list[Finding]:
    """The evaluation's end, under every protocol: the ``at_end`` checks on what containment found
    (processes left running, lock holders killed, kbv's processes found stopped)."""
    return _run(_checks(at_end=True), ContainmentContext(list(left), list(lock_killed), list(stops)))


def _checks(*, at_end: bool, needs_probe: bool | None = None) -> list[Check]:
    return [
        c
        for c in ordered_checks("dynamic")
        if c.at_end == at_end and (needs_probe is None or c.needs_probe == needs_probe)
    ]


def _run(checks: list[Check], context: Any) -> list[Finding]:
    findings: list[Finding] = []
    for check in checks:
        findings.extend(check.run(context))
    return findings
