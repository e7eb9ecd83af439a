"""Containment checks, made at the evaluation's end under every protocol: processes the candidate
left running, candidate processes killed for holding kbv's GPU lock files, and kbv's processes found
stopped by a signal kbv did not send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kbv.integrity._registry import register_check
from kbv.integrity.dynamic._context import _finding
from kbv.records import Finding


@dataclass(frozen=True)
class ContainmentContext:
    """What the evaluation's end found: the containment checks read it, the parent gathers it."""

    #: Processes the candidate left running, found and killed by ``Worker.finish``.
    left: list[dict[str, Any]] = field(default_factory=list)
    #: Candidate processes a ``DeviceLock`` killed for holding kbv's lock files.
    lock_killed: list[dict[str, Any]] = field(default_factory=list)
    #: kbv's processes found stopped by a signal kbv did not send (role, pid, state).
    stops: list[dict[str, Any]] = field(default_factory=list)


@register_check(
    name="processes_left",
    order=190,
    needs_probe=False,
    at_end=True,
    kind="dynamic",
    default_severity="fail",
    doc="""Processes the candidate started that still run when its evaluation ends: members of the
    worker's cgroup, /proc descendants of the worker (a child subreaper, so orphans stay below it)
    and processes carrying the worker's marker variable. kbv kills them and names each (pid and
    command line). One that left the worker's session (setsid, start_new_session) made an effort to
    outlive its worker and fails; one still in the worker's session (a helper pool the candidate did
    not shut down) is a warning. Reported under every protocol.""",
)
def check_processes_left(ctx: ContainmentContext) -> list[Finding]:
    return left_behind_findings(ctx.left)


@register_check(
    name="device_lock_tampering",
    order=200,
    needs_probe=False,
    at_end=True,
    kind="dynamic",
    default_severity="fail",
    doc="""A process of the candidate held one of kbv's GPU lock files open (kbv.device_lock): with
    a lock taken on it, every evaluation on that GPU would wait for ever, this one included, before
    anything could time out. While a lock is not granted, kbv searches the candidate worker's
    processes for the files and kills any that holds one; each is named here (pid, command line,
    which file). Other evaluations' holds are waited for as always. Reported under every
    protocol.""",
)
def check_device_lock_tampering(ctx: ContainmentContext) -> list[Finding]:
    return lock_tampering_findings(ctx.lock_killed)


@register_check(
    name="signalled_process",
    order=210,
    needs_probe=False,
    at_end=True,
    kind="dynamic",
    default_severity="fail",
    doc="""A process of kbv's was found stopped by a signal kbv did not send while the candidate's
    evaluation ran: the reference worker, a spare worker, or the fork server (state T in
    /proc/<pid>/stat; a worker has no terminal, so only a stop signal puts it there, and kbv's own
    pauses are known). Every wait on a worker looks at it each poll (0.1 s), so a stopped worker ends
    the evaluation at once instead of after its budget; the end of each evaluation looks at the
    reference, the spares and the fork server. The stopped workers are killed, the fork server is
    resumed, and each is named (pid, role). Where Landlock scopes signals (docs/architecture.md) a
    candidate cannot send them; this is what remains where it cannot. A stop sent by a process that
    is not the candidate's (a user's shell) is blamed on the candidate of the evaluation that found
    it. Reported under every protocol.""",
)
def check_signalled_process(ctx: ContainmentContext) -> list[Finding]:
    return signalled_findings(ctx.stops)


def signalled_findings(stops: list[dict[str, Any]]) -> list[Finding]:
    """The ``signalled_process`` finding for kbv's processes found stopped (none when empty)."""
    if not stops:
        return []
    shown = "; ".join(
        f"{stop.get('role', '?')} (pid {stop.get('pid', '?')}): {stop.get('state', 'T')}"
        for stop in stops[:5]
    )
    return [
        _finding(
            "signalled_process",
            f"{len(stops)} of kbv's processes were found stopped by a signal kbv did not send while "
            f"the candidate ran (stopped workers killed, the fork server resumed): {shown}",
            "fail",
        )
    ]


def lock_tampering_findings(killed: list[dict[str, Any]]) -> list[Finding]:
    """The ``device_lock_tampering`` finding for the candidate processes a DeviceLock killed."""
    if not killed:
        return []
    shown = "; ".join(
        f"pid {p['pid']} held kbv's {'/'.join(p['files'])} file: {p['command'][:120]}" for p in killed[:5]
    )
    return [
        _finding(
            "device_lock_tampering",
            f"{len(killed)} candidate process(es) held kbv's GPU lock files open and were killed: {shown}",
            "fail",
        )
    ]


def left_behind_findings(left: list[dict[str, Any]]) -> list[Finding]:
    """The ``processes_left`` finding for what ``Worker.finish`` found and killed (none when empty)."""
    if not left:
        return []
    escaped = [p for p in left if p.get("own_session")]
    shown = "; ".join(
        f"pid {p['pid']}{' (own session)' if p.get('own_session') else ''}: {p['command'][:120]}"
        for p in left[:5]
    )
    detail = (
        f"{len(left)} process(es) the candidate started were still running at the end of its "
        f"evaluation (killed): {shown}"
    )
    return [_finding("processes_left", detail, "fail" if escaped else "warn")]
