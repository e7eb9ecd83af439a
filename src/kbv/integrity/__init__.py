"""Reward-hack detection: registered static, correctness and dynamic integrity checks.

``static_scan`` runs every static check over a candidate's source text in the trusted process; it
parses, never imports, and needs no torch. ``correctness_findings`` runs the checks derived from the
correctness draws' results (``kbv.integrity.correctness``). Checks are small registered objects (see
``list_checks``); a protocol's ``[integrity.severity]`` table overrides their severities through
``apply_severity``. ``docs/integrity-checks.md`` describes each check.
"""

from __future__ import annotations

from kbv.integrity import static as _static  # noqa: F401  (registers the static checks)
from kbv.integrity._registry import (
    Check,
    apply_severity,
    get_check,
    list_checks,
    register_check,
)
from kbv.integrity.correctness import correctness_findings  # registers the correctness checks
from kbv.integrity.static import StaticContext, exec_payloads
from kbv.records import Finding

__all__ = [
    "Check",
    "StaticContext",
    "apply_severity",
    "correctness_findings",
    "get_check",
    "list_checks",
    "register_check",
    "static_scan",
]

_MAX_EXEC_DEPTH = 3


def static_scan(
    candidate_source: str,
    *,
    path: str = "<candidate>",
    problem_source: str | None = None,
    problem_dtype_fp32: bool = True,
) -> list[Finding]:
    """All static findings for one candidate, at each check's default severity.

    Apply a protocol's overrides afterwards with ``apply_severity(findings, protocol.integrity)``.
    Code handed to exec/eval/compile as a foldable constant string is scanned too, and its findings
    are reported at the exec call's line.
    """
    return _scan(candidate_source, path, problem_source, problem_dtype_fp32, depth=0)


def _scan(source: str, path: str, problem_source: str | None, fp32: bool, depth: int) -> list[Finding]:
    ctx = StaticContext.build(source, path=path, problem_source=problem_source, problem_dtype_fp32=fp32)
    findings: list[Finding] = []
    for check in list_checks("static"):
        try:
            findings.extend(check.run(ctx))
        except RecursionError:
            # Nesting deep enough to exhaust the analyser is itself an evasion: never let it pass.
            detail = f"line 1: {path} -- nesting too deep to analyse; {check.name} could not clear the source"
            findings.append(Finding(check.name, "fail", detail))
    if depth < _MAX_EXEC_DEPTH and ctx.analysis is not None:
        for line, code in exec_payloads(ctx):
            _, quoted = ctx.analysis.quote(line)
            for inner in _scan(code, path, None, fp32, depth + 1):
                if inner.check in ("parse_error", "pytorch_only"):
                    continue
                detail = f"line {line}: {quoted} -- in the executed string: {inner.detail}"
                findings.append(Finding(inner.check, inner.severity, detail))
    return findings
