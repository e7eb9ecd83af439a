"""The audit's numbers: false-rejection rate on controls, kill rate on mutants, Wilson intervals.

Pure functions over (spec, record) pairs: no worker, no store, so the numbers are testable from a
fixed set of records.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kbv.protocol_audit._sources import PERTURBATION
from kbv.records import Record

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (None without trials): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes."""
    if n <= 0:
        return None
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Row:
    """One evaluated control or mutant: its generator's description and its record's verdict."""

    problem: str
    role: str
    kind: str
    variant: str
    outcome: str
    verdict: str  # controls: "passed" / "rejected"; mutants: "killed" / "by_design" / "missed"
    caught_by: list[str]
    errors: list[dict[str, Any]]  # failing (controls) or all (mutants) distributions, with errors

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def classify(role: str, kind: str, record: Record) -> str:
    passed = record.outcome == "passed"
    if role == "control":
        return "passed" if passed else "rejected"
    if not passed:
        return "killed"
    return "by_design" if by_design(kind, record) else "missed"


def by_design(kind: str, record: Record) -> bool:
    """A passing mutant whose perturbation the protocol's own stated tolerance admits on every
    applicable distribution: a reduced-precision output within ``error_multiple`` times a TF32
    baseline's error, or within a reduction floor. ``allclose`` states ``rtol`` as its relative
    tolerance (its ``atol`` is what lets tiny outputs pass, a miss).

    A distribution on which the mutant's output equals the truth exactly shows no perturbation (an
    output of zeros, as a ReLU after a large negative shift gives on ``[0, 1)`` inputs: a relative
    perturbation of zero is zero), so its tolerance, however tight, neither admits nor refuses it.
    At least one distribution must show the perturbation and admit it."""
    size = PERTURBATION.get(kind)
    if size is None:
        return False
    shown = [d for d in record.distributions if d.applicable and not _exact(d)]
    limits = [_relative_limit(d.tolerance or {}) for d in shown]
    return bool(limits) and all(limit is not None and limit >= size for limit in limits)


def _exact(distribution: Any) -> bool:
    return distribution.max_abs_err == 0.0 and distribution.rel_err == 0.0


def _relative_limit(tolerance: dict[str, Any]) -> float | None:
    if tolerance.get("mode") == "allclose":
        return float(tolerance.get("rtol", 0.0))
    floats = [o for o in tolerance.get("outputs", []) if o.get("kind") == "float"]
    return min(float(o["norm_tol"]) for o in floats) if floats else None


def caught_by(record: Record) -> list[str]:
    """What rejected a record: its failing checks, else its failing distributions, else its outcome."""
    checks = sorted({f.check for f in record.findings if f.severity == "fail"})
    if checks:
        return checks
    if record.outcome == "incorrect":
        failing = [d.name for d in record.distributions if d.applicable and not d.passed]
        return failing or ["structure"]
    return [] if record.outcome == "passed" else [record.outcome]


def distribution_errors(record: Record, failing_only: bool) -> list[dict[str, Any]]:
    return [
        {
            "name": d.name,
            "passed": d.passed,
            "max_abs_err": d.max_abs_err,
            "rel_err": d.rel_err,
            "note": d.note,
        }
        for d in record.distributions
        if d.applicable and (not failing_only or not d.passed)
    ]


def make_row(spec: Any, record: Record) -> Row:
    verdict = classify(spec.role, spec.kind, record)
    return Row(
        problem=spec.problem,
        role=spec.role,
        kind=spec.kind,
        variant=spec.variant,
        outcome=record.outcome,
        verdict=verdict,
        caught_by=caught_by(record),
        errors=distribution_errors(record, failing_only=spec.role == "control"),
    )


def rate(count: int, n: int) -> dict[str, Any]:
    interval = wilson(count, n)
    return {
        "count": count,
        "n": n,
        "rate": count / n if n else None,
        "ci95": list(interval) if interval else None,
    }


def summarize(protocol: dict[str, Any], rows: Sequence[Row], left_out: Sequence[Any] = ()) -> dict[str, Any]:
    """One protocol's audit: both rates with Wilson intervals, per mutant kind and per catcher, the
    worst problems and every surviving mutant and rejected control."""
    controls = [r for r in rows if r.role == "control"]
    mutants = [r for r in rows if r.role == "mutant"]
    judged = [r for r in mutants if r.verdict != "by_design"]
    rejected = [r for r in controls if r.verdict == "rejected"]
    return {
        "protocol": protocol,
        "false_rejection": rate(len(rejected), len(controls)),
        "kill": rate(sum(r.verdict == "killed" for r in judged), len(judged)),
        "by_kind": _by_kind(mutants),
        "caught_by": dict(
            Counter(c for r in mutants if r.verdict == "killed" for c in r.caught_by).most_common()
        ),
        "by_design": [r.to_dict() for r in mutants if r.verdict == "by_design"],
        "rejected_controls": [r.to_dict() for r in rejected],
        "surviving_mutants": [r.to_dict() for r in mutants if r.verdict == "missed"],
        "worst_problems": _worst(rows),
        "left_out": Counter(f"{s.role}:{s.status}" for s in left_out),
    }


def _by_kind(mutants: Sequence[Row]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in mutants:
        groups[r.kind].append(r)
    out = {}
    for kind, group in sorted(groups.items()):
        judged = [r for r in group if r.verdict != "by_design"]
        out[kind] = {
            **rate(sum(r.verdict == "killed" for r in judged), len(judged)),
            "by_design": len(group) - len(judged),
            "caught_by": dict(
                Counter(c for r in judged if r.verdict == "killed" for c in r.caught_by).most_common()
            ),
        }
    return out


def _worst(rows: Sequence[Row], limit: int = 5) -> list[dict[str, Any]]:
    """Problems with the most rejected controls, then the most surviving mutants."""
    score: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        score[r.problem][0] += r.verdict == "rejected"
        score[r.problem][1] += r.verdict == "missed"
    ranked = sorted(
        ((p, s) for p, s in score.items() if any(s)), key=lambda item: (-item[1][0], -item[1][1], item[0])
    )
    return [{"problem": p, "rejected_controls": s[0], "surviving_mutants": s[1]} for p, s in ranked[:limit]]


def fmt_rate(entry: dict[str, Any]) -> str:
    """``0.0% (0/80, 95% CI 0.0-4.6%)``."""
    if not entry["n"]:
        return "- (0 evaluated)"
    low, high = entry["ci95"]
    return (
        f"{100 * entry['rate']:.1f}% ({entry['count']}/{entry['n']}, 95% CI "
        f"{100 * low:.1f}-{100 * high:.1f}%)"
    )
