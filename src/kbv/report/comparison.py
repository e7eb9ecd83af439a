"""The standard-versus-verified comparison: how much of a claimed speedup survives, and why not.

Pairs are matched by (problem source sha, candidate source sha, device name): a record from one
device is never paired with a record from another. Per label, the drop from the
standard protocol's comparable geomean to the verified protocol's is split into four factors that
multiply to the total (each is a ratio of geometric means over the matched pairs, applied in
this order, every failed pair counting 1.0):

1. integrity:    pairs flagged under verified (a ``fail`` finding) fall to 1.0;
2. distribution: pairs that verified judged incorrect on some input distribution fall to 1.0;
3. timing/other: the remaining pairs take verified's status and its speedup against the same
   baseline as standard (``eager_fp32``): other failures (timeouts, crashes), pairs that only
   pass under verified, and the change of timing recipe (L2 flush, unseen inputs for every timed call, ...);
4. baseline:     verified's speedup against its best baseline instead of ``eager_fp32``.

A factor above 1 is a drop (the standard number was that many times too optimistic); a factor
below 1 is a rise (verified found the kernels faster, or passed what standard failed), and reports
label it so (:func:`change`): "rise x1.72", never "drop /0.58".

Each factor's *share* is its part of the total movement, rises and drops together:
``|log f| / sum of |log f|`` over the four factors. Shares lie in 0-100% and add up to 100%; the
direction of each factor is said next to it. (A share of the net change, ``log f / log total``,
falls outside 0-100% as soon as one factor drops while another rises.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kbv.metrics import (
    comparable_geomean,
    correct_speedup,
    correctness_rate,
    counted,
    eager_baseline,
    geomean,
    is_flagged,
    is_passed,
    label_of,
    record_precision,
    speedup_of,
)
from kbv.records import Outcome, Record, Severity, error_summary

REFERENCE_BASELINE = "eager_fp32"
"""The baseline the standard protocol times against (KernelBench's eager PyTorch in fp32); in a
bf16 or fp16 evaluation, eager PyTorch in that precision (``eager_bf16``, ``eager_fp16``)."""


def _eager(record: Record) -> str:
    return REFERENCE_BASELINE if record_precision(record) == "fp32" else eager_baseline(record)


EFFECTS = ("integrity", "distribution", "timing_other", "baseline")

PairKey = tuple[str, str, str, str, str]


#: Below this relative difference from 1 a factor is "no change" rather than a rise or a drop.
UNCHANGED = 0.005


def pair_key(record: Record) -> PairKey:
    """(problem source sha, candidate source sha, device name, precision, candidate file): what
    makes a standard and a verified record the same pair. The device and the precision are part of
    it, so a CPU record never meets a GPU one, nor a bf16 record an fp32 one; the file too, so two
    samples with identical sources stay two pairs."""
    return (
        str(record.problem.get("source_sha256", "")),
        str(record.candidate.get("source_sha256", "")),
        str((record.device or {}).get("name", "")),
        record_precision(record),
        str(record.candidate.get("path", "")),
    )


def direction(factor: float) -> str:
    """``drop`` (standard / verified above 1), ``rise`` (below 1) or ``none``."""
    if factor > 1.0 + UNCHANGED:
        return "drop"
    if factor < 1.0 - UNCHANGED:
        return "rise"
    return "none"


def change(factor: float) -> str:
    """A standard / verified factor in words a reader cannot misread: ``drop ÷1.72`` (verified is
    1.72 times lower), ``rise ×1.72`` (verified is 1.72 times higher) or ``no change``."""
    kind = direction(factor)
    if kind == "drop":
        return f"drop ÷{factor:.2f}"
    if kind == "rise":
        return f"rise ×{1.0 / factor:.2f}"
    return "no change"


def split_by_protocol(records: Sequence[Record]) -> tuple[list[Record], list[Record]]:
    """(standard, verified) records by protocol name; records of other protocols are dropped."""
    standard = [r for r in records if r.protocol.get("name") == "standard"]
    verified = [r for r in records if r.protocol.get("name") == "verified"]
    return standard, verified


def first_failing_distribution(record: Record) -> str | None:
    for dist in record.distributions:
        if dist.applicable and not dist.passed:
            return dist.name
    return None


def failed_on_distribution(record: Record) -> bool:
    return record.outcome == Outcome.INCORRECT.value and first_failing_distribution(record) is not None


def verdict_reason(record: Record) -> str:
    """Why a record did not pass, in one line: the first ``fail`` finding, else the first failing
    distribution, else the error message, else the outcome."""
    if is_passed(record):
        return "passed"
    for finding in record.findings:
        if finding.severity == Severity.FAIL.value:
            return f"{finding.check}: {finding.detail}"
    name = first_failing_distribution(record)
    if name is not None:
        dist = next(d for d in record.distributions if d.name == name)
        err = f" (max_abs_err {dist.max_abs_err:.3g})" if isinstance(dist.max_abs_err, float) else ""
        note = f": {dist.note}" if dist.note else ""
        return f"distribution {name} failed{err}{note}"
    error = record.error or {}
    message = error.get("summary") or (
        error_summary(str(error.get("kind", "")), error["message"])
        if error.get("message")
        else error.get("type")
    )
    return f"{record.outcome}: {message}" if message else record.outcome


def _stage_values(std: Record, ver: Record) -> list[float]:
    """The pair's value after each stage: [standard, +integrity, +distribution, +timing, +baseline]."""
    v0 = (speedup_of(std) or 1.0) if is_passed(std) and not is_flagged(std) else 1.0
    v1 = 1.0 if is_flagged(ver) else v0
    v2 = 1.0 if failed_on_distribution(ver) else v1
    if is_passed(ver) and not is_flagged(ver):
        v4 = speedup_of(ver) or 1.0
        v3 = speedup_of(ver, _eager(ver)) or v4
    else:
        v3 = v4 = 1.0
    return [v0, v1, v2, v3, v4]


def _label_summary(pairs: list[tuple[Record, Record]]) -> dict[str, Any]:
    std = [s for s, _ in pairs]
    ver = [v for _, v in pairs]
    stages = [_stage_values(s, v) for s, v in pairs]
    means = [geomean(values[i] for values in stages) or 1.0 for i in range(5)]
    effects = {name: means[i] / means[i + 1] for i, name in enumerate(EFFECTS)}
    passed_std = [(s, v) for s, v in pairs if is_passed(s)]
    return {
        "pairs": len(pairs),
        "standard": {
            "correct_rate": correctness_rate(std),
            "correct_speedup": correct_speedup(std),
            "comparable_geomean": comparable_geomean(std),
        },
        "verified": {
            "correct_rate": correctness_rate(ver),
            "correct_speedup": correct_speedup(ver),
            "correct_speedup_vs_reference": correct_speedup(ver, _eager(ver[0]) if ver else None),
            "comparable_geomean": comparable_geomean(ver),
        },
        "drop": means[0] / means[4],
        "change": direction(means[0] / means[4]),
        "effects": effects,
        "effect_directions": {name: direction(f) for name, f in effects.items()},
        "effect_shares": _shares(effects),
        "counts": {
            "integrity": sum(1 for _, v in passed_std if is_flagged(v)),
            "distribution": sum(1 for _, v in passed_std if not is_flagged(v) and failed_on_distribution(v)),
            "other_failures": sum(
                1
                for _, v in passed_std
                if not is_passed(v) and not is_flagged(v) and not failed_on_distribution(v)
            ),
            "only_verified_passed": sum(1 for s, v in pairs if not is_passed(s) and is_passed(v)),
        },
    }


def _shares(effects: dict[str, float]) -> dict[str, float | None]:
    """Each effect's share of the total movement, rises and drops together, in log space:
    ``|log f| / sum |log f|``, so every share lies in [0, 1] and they add up to 1 (None for all
    when nothing moved)."""
    total = sum(abs(math.log(f)) for f in effects.values())
    if total < 1e-12:
        return {name: None for name in effects}
    return {name: abs(math.log(f)) / total for name, f in effects.items()}


def _changed(std: Record, ver: Record) -> dict[str, Any]:
    if not is_passed(ver):
        reason = verdict_reason(ver)
    else:
        reason = f"passes under verified; standard said {verdict_reason(std)}"
    return {
        "label": label_of(ver),
        "problem": ver.problem.get("name"),
        "level": ver.problem.get("level"),
        "candidate": ver.candidate.get("path"),
        "standard_outcome": std.outcome,
        "verified_outcome": ver.outcome,
        "standard_speedup": speedup_of(std),
        "verified_speedup": speedup_of(ver),
        "reason": reason,
    }


def _board_label(record: Record, several_precisions: bool) -> str:
    """The record's label, with its precision where the records compared hold several."""
    return f"{label_of(record)} ({record_precision(record)})" if several_precisions else label_of(record)


def compare_protocols(
    standard_records: Sequence[Record], verified_records: Sequence[Record]
) -> dict[str, Any]:
    """Match records of the two protocols by :func:`pair_key` (problem sha, candidate sha, device,
    precision, file) and explain the difference.

    Returns a plain dict::

        {"pairs": int, "unmatched_standard": int, "unmatched_verified": int,
         "overall": <summary>, "labels": {label: <summary>},
         "changed": [{label, problem, level, candidate, standard_outcome, verified_outcome,
                      standard_speedup, verified_speedup, reason}, ...]}

    where a summary holds ``pairs``, per-protocol ``correct_rate``/``correct_speedup``/
    ``comparable_geomean``, ``drop`` (standard comparable / verified comparable; below 1 a rise)
    and its ``change`` (``drop``, ``rise`` or ``none``), ``effects`` (the four factors of the module
    docstring, multiplying to ``drop``) with their ``effect_directions``, ``effect_shares`` (each
    factor's share of the total movement, in 0-1) and ``counts`` of pairs behind each effect.
    When a key appears more than once in one list the last record wins. The label is taken from
    the verified record. Problem errors (``problem_error``) are left out before matching."""
    # A problem error is the problem's fault, not the model's: such pairs are not compared.
    std_by_key = {pair_key(r): r for r in counted(standard_records)}
    ver_by_key = {pair_key(r): r for r in counted(verified_records)}
    keys = [k for k in ver_by_key if k in std_by_key]
    pairs = [(std_by_key[k], ver_by_key[k]) for k in keys]
    by_label: dict[str, list[tuple[Record, Record]]] = {}
    precisions = {record_precision(v) for _, v in pairs}
    for pair in pairs:
        by_label.setdefault(_board_label(pair[1], len(precisions) > 1), []).append(pair)
    changed = [_changed(s, v) for s, v in pairs if s.outcome != v.outcome]
    changed.sort(key=lambda c: (c["label"], str(c["problem"]), str(c["candidate"])))
    return {
        "pairs": len(pairs),
        "unmatched_standard": len(set(std_by_key) - set(keys)),
        "unmatched_verified": len(set(ver_by_key) - set(keys)),
        # one precision's pairs only: a bf16 and an fp32 speedup are against different baselines
        "overall": _label_summary(pairs) if pairs and len(precisions) == 1 else None,
        "labels": {label: _label_summary(by_label[label]) for label in sorted(by_label)},
        "changed": changed,
    }
