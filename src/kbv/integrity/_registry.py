"""The integrity-check registry: every reward-hack check is a small named object.

A check has a stable snake_case ``name`` (it is written into records), a ``kind`` (``static``
checks read source text in the trusted parent; ``correctness`` checks read the correctness draws'
results there; ``dynamic`` checks observe a running candidate), a
default severity, a one-paragraph ``doc`` and a function. A dynamic check also carries its place in
the run (``order``: ``timing_disagreement`` corrects the speedup before ``plausibility`` reads it),
whether it ``needs_probe`` (those that need none are made under every protocol, from what the
evaluation recorded) and whether it is made ``at_end`` of the evaluation, from what containment
found. Checks register themselves with
:func:`register_check`; the registry itself knows nothing about what a check inspects, so dynamic
checks use the same decorator with their own context type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kbv.records import Finding

#: In the order they run in an evaluation: ``static`` reads the source before anything runs,
#: ``correctness`` reads the correctness draws' results, ``dynamic`` observes the running candidate.
KINDS = ("static", "correctness", "dynamic")
SEVERITIES = ("fail", "warn", "info")
_NAME = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")

CheckFunction = Callable[[Any], "list[Finding]"]
#: The order of a check that names none: after every ordered one.
UNORDERED = 1_000_000


@dataclass(frozen=True)
class Check:
    """One registered check. ``run(context)`` returns its findings (possibly none)."""

    name: str
    kind: str
    default_severity: str
    doc: str
    func: CheckFunction
    #: Where the check runs among its kind's (lower first; ties by name).
    order: int = UNORDERED
    #: Whether the check needs live workers to probe (every dynamic one unless it says otherwise; no
    #: static one); a dynamic check that needs none is made under every protocol.
    needs_probe: bool = False
    #: Whether the check is made at the evaluation's end, from what containment found.
    at_end: bool = False

    def run(self, context: Any) -> list[Finding]:
        return list(self.func(context))


class _SeveritySource(Protocol):
    def severity_for(self, check: str, default: str) -> str: ...


_REGISTRY: dict[str, Check] = {}


def register_check(
    *,
    name: str,
    kind: str,
    default_severity: str,
    doc: str,
    order: int = UNORDERED,
    needs_probe: bool | None = None,
    at_end: bool = False,
) -> Callable[[CheckFunction], CheckFunction]:
    """Register the decorated function as the check ``name``; the function itself is returned unchanged."""
    if not _NAME.match(name):
        raise ValueError(f"check name {name!r} must be snake_case (it is stored in records)")
    if kind not in KINDS:
        raise ValueError(f"check {name!r}: kind must be one of {KINDS}, not {kind!r}")
    if default_severity not in SEVERITIES:
        raise ValueError(f"check {name!r}: default_severity must be one of {SEVERITIES}")
    if not doc.strip():
        raise ValueError(f"check {name!r} needs a doc paragraph: what it catches and why")

    probes = kind == "dynamic" if needs_probe is None else needs_probe

    def decorate(func: CheckFunction) -> CheckFunction:
        existing = _REGISTRY.get(name)
        if existing is not None and existing.func is not func:
            same_origin = (existing.func.__module__, existing.func.__qualname__) == (
                func.__module__,
                func.__qualname__,
            )
            if not same_origin:  # a module re-import may register the same function again
                raise ValueError(f"an integrity check named {name!r} is already registered")
        _REGISTRY[name] = Check(
            name, kind, default_severity, " ".join(doc.split()), func, order, probes, at_end
        )
        return func

    return decorate


def list_checks(kind: str | None = None) -> list[Check]:
    """All registered checks (of one kind, when given), sorted by name."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, not {kind!r}")
    return sorted((c for c in _REGISTRY.values() if kind is None or c.kind == kind), key=lambda c: c.name)


def ordered_checks(kind: str) -> list[Check]:
    """The checks of one kind in the order they run (``order``, then name)."""
    return sorted(list_checks(kind), key=lambda c: (c.order, c.name))


def get_check(name: str) -> Check:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none registered"
        raise KeyError(f"no integrity check named {name!r}; known checks: {known}") from None


def apply_severity(findings: Iterable[Finding], settings: _SeveritySource | None) -> list[Finding]:
    """Apply a protocol's per-check severity overrides; findings of checks set to ``off`` are dropped.

    An override replaces the severity of every finding of that check, whatever severity the check
    chose for the individual finding.
    """
    result: list[Finding] = []
    for finding in findings:
        severity = (
            finding.severity if settings is None else settings.severity_for(finding.check, finding.severity)
        )
        if severity == "off":
            continue
        if severity not in SEVERITIES:
            raise ValueError(f"severity override for {finding.check!r} must be fail, warn, info or off")
        result.append(Finding(finding.check, severity, finding.detail))
    return result
