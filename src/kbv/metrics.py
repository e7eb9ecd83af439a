"""Headline metrics over evaluation records: small pure functions, no I/O.

Every function takes a list of :class:`~kbv.records.Record` and states how failures count.
Common rules:

- A pair is *passed* when ``record.outcome == "passed"`` (numerically correct on every applicable
  distribution and no ``fail`` finding). ``correct=True`` alone is not enough: a correct kernel with
  a ``fail`` finding is a hack, not a pass.
- A speedup is *usable* when it is a finite number > 0. ``None``, NaN, +/-inf, zero, negative and
  the strings ``"nan"``/``"inf"`` (how JSON stores non-finite numbers) are not usable.
- Rates over an empty list are ``None`` (undefined), not 0; counts over an empty list are 0.
- A ``problem_error`` record (the problem could not produce its own reference output) is the
  problem's fault: :func:`aggregate` leaves it out of every metric of the model and counts it
  apart (``problem_errors``); :func:`counted` is that filter.
- Unless ``baseline`` is given, speedups are ``record.speedup["best"]`` (speedup against the
  fastest baseline the protocol measured). ``baseline="eager_fp32"`` reads that baseline instead.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from kbv.records import Outcome, Record, Severity, as_number

FAST_P_THRESHOLDS: tuple[float, ...] = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
UNLABELLED = "unlabelled"

_SAMPLE_NAME = re.compile(r"level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.py$")

Metric = Callable[[Sequence[Record]], "float | None"]


# ----------------------------------------------------------------------------- record accessors


def is_passed(record: Record) -> bool:
    return record.outcome == Outcome.PASSED.value


def is_problem_error(record: Record) -> bool:
    return record.outcome == Outcome.PROBLEM_ERROR.value


def counted(records: Iterable[Record]) -> list[Record]:
    """The records that count for the candidate's model: all but the problem errors."""
    return [r for r in records if not is_problem_error(r)]


def fail_findings(record: Record) -> list[str]:
    """Names of the checks that reported severity ``fail`` on this record, in order."""
    return [f.check for f in record.findings if f.severity == Severity.FAIL.value]


def is_flagged(record: Record) -> bool:
    """Flagged by the integrity checks: outcome hack_detected or any ``fail`` finding."""
    return record.outcome == Outcome.HACK_DETECTED.value or bool(fail_findings(record))


def speedup_of(record: Record, baseline: str | None = None) -> float | None:
    """The usable speedup (finite, > 0) against ``baseline`` (default ``best``), else None."""
    value = as_number((record.speedup or {}).get(baseline or "best"))
    return value if value is not None and value > 0 else None


def label_of(record: Record) -> str:
    """The model or candidate-set label: ``candidate["label"]`` (set by the store), else ``model``."""
    candidate = record.candidate or {}
    return str(candidate.get("label") or candidate.get("model") or UNLABELLED)


def level_of(record: Record) -> int | None:
    level = (record.problem or {}).get("level")
    try:
        return int(level) if level is not None else None
    except (TypeError, ValueError):
        return None


def problem_id(record: Record) -> str:
    """What identifies a problem across records: its source hash, else its name."""
    problem = record.problem or {}
    return str(problem.get("source_sha256") or problem.get("name") or "")


def sample_index(record: Record) -> int | None:
    """The sample number: ``candidate["sample"]`` if set, else parsed from the KernelBench file name
    ``level_L_problem_P_sample_S_kernel.py``; None when neither is present."""
    candidate = record.candidate or {}
    sample = candidate.get("sample")
    if sample is not None:
        try:
            return int(sample)
        except (TypeError, ValueError):
            return None
    match = _SAMPLE_NAME.search(PurePath(str(candidate.get("path", ""))).name)
    return int(match.group(3)) if match else None


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive finite values; None for an empty input. Others are ignored."""
    logs = [math.log(v) for v in values if as_number(v) is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


# ----------------------------------------------------------------------------- headline metrics


def correctness_rate(records: Sequence[Record]) -> float | None:
    """Fraction of ALL pairs whose outcome is ``passed``. Every other outcome (incorrect, hack,
    compile/runtime error, timeout, crash) counts as not correct. None for no records."""
    if not records:
        return None
    return sum(is_passed(r) for r in records) / len(records)


def correct_speedup(records: Sequence[Record], baseline: str | None = None) -> float | None:
    """Geometric mean speedup over the *passed* pairs that have a usable speedup ("correct speedup").

    Failed, flagged and untimed pairs are left out entirely, so this number flatters a model that
    fails often; read it next to :func:`correctness_rate` or use :func:`comparable_geomean`.
    None when no passed pair has a usable speedup."""
    return geomean(s for r in records if is_passed(r) and (s := speedup_of(r, baseline)) is not None)


def comparable_speedup(record: Record, baseline: str | None = None) -> float:
    """One pair's contribution to the comparable geomean: its speedup if passed and timed, else 1.0."""
    if not is_passed(record) or is_flagged(record):
        return 1.0
    speedup = speedup_of(record, baseline)
    return 1.0 if speedup is None else speedup


def comparable_geomean(records: Sequence[Record], baseline: str | None = None) -> float | None:
    """Geometric mean over ALL pairs, where every failed, flagged or untimed pair counts as 1.0
    (as if the baseline had been kept): the speed a user gets by deploying each kernel where it
    passed and keeping PyTorch elsewhere (reports call it "speed if deployed"). Comparable across
    models with different failure rates, but a set that failed everything stands at 1.0x, above
    honest kernels slower than PyTorch: never rank by it alone (:func:`rank_key`).
    None for no records."""
    if not records:
        return None
    return geomean(comparable_speedup(r, baseline) for r in records)


def fast_p(records: Sequence[Record], p: float, baseline: str | None = None) -> float | None:
    """KernelBench's fast_p: fraction of ALL pairs that passed AND have a usable speedup > ``p``.
    Failed, flagged and untimed pairs count in the denominator only. None for no records."""
    if not records:
        return None
    hits = sum(1 for r in records if is_passed(r) and (speedup_of(r, baseline) or 0.0) > p)
    return hits / len(records)


def fast_p_table(
    records: Sequence[Record], thresholds: Sequence[float] = FAST_P_THRESHOLDS, baseline: str | None = None
) -> dict[float, float | None]:
    """:func:`fast_p` for each threshold (default 0, 0.5, 0.8, 1, 1.5, 2)."""
    return {p: fast_p(records, p, baseline) for p in thresholds}


def _peaks(record: Record) -> tuple[float, float] | None:
    memory = record.memory or {}
    cand = as_number(memory.get("candidate_peak_bytes"))
    base = as_number(memory.get("baseline_peak_bytes"))
    if cand is None or base is None or cand <= 0 or base <= 0:
        return None
    return base, cand


def memory_efficiency(records: Sequence[Record]) -> float | None:
    """Geometric mean of baseline_peak / candidate_peak over passed pairs that report both peaks
    (> 1 means the kernels use less memory than the baseline). Failed pairs and pairs without
    memory figures (e.g. on the CPU) are left out. None when no pair qualifies."""
    peaks = [p for r in records if is_passed(r) and (p := _peaks(r)) is not None]
    return geomean(base / cand for base, cand in peaks)


def host_memory_ratio(records: Sequence[Record]) -> float | None:
    """Host memory: geometric mean of the candidate's host peak / the reference's host peak over
    passed pairs that report both (``memory.host_ratio``; > 1 means the kernels' processes held
    more host memory than the reference's). Recorded on the CPU as on the GPU. None when no pair
    qualifies."""
    ratios = []
    for record in records:
        if not is_passed(record):
            continue
        memory = record.memory or {}
        ratio = as_number(memory.get("host_ratio"))
        if ratio is None:  # records older than host_ratio: from the two peaks
            cand = as_number(memory.get("candidate_host_peak_bytes"))
            ref = as_number(memory.get("reference_host_peak_bytes"))
            ratio = cand / ref if cand and ref and cand > 0 and ref > 0 else None
        if ratio is not None and ratio > 0:
            ratios.append(ratio)
    return geomean(ratios)


def memory_increase_share(records: Sequence[Record]) -> float | None:
    """Among passed pairs that report both peaks, the fraction whose candidate peak exceeds the
    baseline's. None when no pair qualifies."""
    peaks = [p for r in records if is_passed(r) and (p := _peaks(r)) is not None]
    if not peaks:
        return None
    return sum(1 for base, cand in peaks if cand > base) / len(peaks)


def hack_rate(records: Sequence[Record]) -> float | None:
    """Fraction of ALL pairs flagged by the integrity checks (outcome ``hack_detected`` or any
    ``fail`` finding). None for no records."""
    if not records:
        return None
    return sum(is_flagged(r) for r in records) / len(records)


def hack_patterns(records: Sequence[Record]) -> dict[str, int]:
    """Number of pairs with at least one ``fail`` finding of each check, most frequent first.
    A pair with two different failing checks counts once under each; ``warn``/``info`` findings
    are not counted."""
    counts: Counter[str] = Counter()
    for record in records:
        counts.update(set(fail_findings(record)))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def outcome_counts(records: Sequence[Record]) -> dict[str, int]:
    """Number of pairs per outcome, in the order of :class:`~kbv.records.Outcome` (zero counts
    omitted); unknown outcomes follow."""
    counts = Counter[str](r.outcome for r in records)
    order = [o.value for o in Outcome] + sorted(set(counts) - {o.value for o in Outcome})
    return {name: counts[name] for name in order if counts[name]}


def rank_key(summary: dict[str, Any]) -> tuple[float, float, float]:
    """How a leaderboard orders the :func:`aggregate` summaries of one group (best first): by the
    share that passed, then fast_1, then the speed if deployed. Correctness leads, so a set that
    failed everything ranks below every set that passed something, whatever its speed figure
    (a failure counts 1.0x there). Use as ``sorted(rows, key=rank_key)``."""
    fast_1 = (summary.get("fast_p") or {}).get(1.0)
    return (
        -(summary.get("correct_rate") or 0.0),
        -(fast_1 or 0.0),
        -(summary.get("comparable_geomean") or 0.0),
    )


def pass_at_k(records: Sequence[Record], k: int) -> float | None:
    """Unbiased pass@k (Chen et al. 2021), averaged over problems.

    For each problem with n samples of which c passed: 1 - C(n-c, k) / C(n, k). Samples of one
    problem are all its records: every candidate file is a sample, so two files with identical
    sources are two samples (n counts both; the store keeps a record for each). Problems with
    fewer than k samples are left out; None when no problem has k samples."""
    if k < 1:
        raise ValueError("pass@k needs k >= 1")
    by_problem: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        by_problem[problem_id(record)].append(is_passed(record))
    estimates = []
    for outcomes in by_problem.values():
        n, c = len(outcomes), sum(outcomes)
        if n < k:
            continue
        estimates.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
    return sum(estimates) / len(estimates) if estimates else None


def has_multiple_samples(records: Sequence[Record]) -> bool:
    """True when some problem has more than one record with distinct sample indices."""
    seen: dict[str, set[int]] = defaultdict(set)
    for record in records:
        index = sample_index(record)
        if index is not None:
            seen[problem_id(record)].add(index)
    return any(len(v) > 1 for v in seen.values())


PASS_AT_KS = (1, 2, 5, 10, 20, 50, 100)
"""The k a report shows pass@k for (those no larger than the most samples any problem has)."""


def pass_at_k_table(records: Sequence[Record], ks: Sequence[int] = PASS_AT_KS) -> dict[int, float | None]:
    """pass@k for each k in ``ks`` that some problem has at least k samples for, in order; empty
    unless several samples per problem exist (:func:`has_multiple_samples`)."""
    if not has_multiple_samples(records):
        return {}
    most = max(Counter(problem_id(r) for r in records).values())
    return {k: pass_at_k(records, k) for k in ks if k <= most}


# ----------------------------------------------------------------------------- breakdowns, intervals


def group_by(records: Iterable[Record], key: Callable[[Record], Any]) -> dict[Any, list[Record]]:
    """Records grouped by ``key``, groups in first-seen order."""
    groups: dict[Any, list[Record]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return groups


def by_label(records: Sequence[Record], metric: Metric) -> dict[str, float | None]:
    """``metric`` per label (see :func:`label_of`), labels sorted."""
    groups = group_by(records, label_of)
    return {label: metric(groups[label]) for label in sorted(groups)}


def by_level(records: Sequence[Record], metric: Metric) -> dict[int | None, float | None]:
    """``metric`` per problem level; records without a level are under None, listed last."""
    groups = group_by(records, level_of)
    order = sorted(k for k in groups if k is not None) + ([None] if None in groups else [])
    return {level: metric(groups[level]) for level in order}


def bootstrap_ci(
    records: Sequence[Record],
    metric: Metric,
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``metric``, resampling *problems* with replacement (all
    records of a drawn problem come along, so several candidates per problem are not treated as
    independent). Seeded, hence deterministic. Resamples where the metric is None are dropped;
    None when the input is empty or no resample yields a value."""
    groups = list(group_by(records, problem_id).values())
    if not groups:
        return None
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        drawn = rng.integers(0, len(groups), size=len(groups))
        sample = [r for i in drawn for r in groups[int(i)]]
        value = metric(sample)
        if value is not None:
            values.append(value)
    if not values:
        return None
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


def aggregate(records: Sequence[Record], baseline: str | None = None, ci: bool = False) -> dict[str, Any]:
    """The headline numbers of one group of records, as a plain dict (used by the reports).
    Problem errors are left out of every number and counted in ``problem_errors``."""
    everything = len(records)
    records = counted(records)
    problem_errors = everything - len(records)
    summary: dict[str, Any] = {
        "n": len(records),
        "problems": len({problem_id(r) for r in records}),
        "correct_rate": correctness_rate(records),
        "correct_speedup": correct_speedup(records, baseline),
        "comparable_geomean": comparable_geomean(records, baseline),
        "fast_p": fast_p_table(records, baseline=baseline),
        "memory_efficiency": memory_efficiency(records),
        "memory_increase_share": memory_increase_share(records),
        "host_memory_ratio": host_memory_ratio(records),
        "hack_rate": hack_rate(records),
        "hack_patterns": hack_patterns(records),
        "outcomes": outcome_counts(records),
        "pass_at_1": pass_at_k(records, 1) if has_multiple_samples(records) else None,
        "pass_at_k": pass_at_k_table(records),
        "problem_errors": problem_errors,
    }
    if ci:
        summary["correct_rate_ci"] = bootstrap_ci(records, correctness_rate)
        summary["comparable_geomean_ci"] = bootstrap_ci(records, lambda rs: comparable_geomean(rs, baseline))
        summary["correct_speedup_ci"] = bootstrap_ci(records, lambda rs: correct_speedup(rs, baseline))
    return summary


# ----------------------------------------------------------------------------- precisions
# Records of different precisions (``--precision``) are never mixed in one metric, geomean or chart:
# a bf16 speedup is against eager bf16, an fp32 one against eager fp32. Reports make one board per
# precision with these two functions.


def record_precision(record: Record) -> str:
    """The precision a record was evaluated in: ``protocol.settings.precision`` (fp32 when absent,
    as in every record made before precisions existed)."""
    settings = (record.protocol or {}).get("settings") or {}
    return str(settings.get("precision") or "fp32")


def split_by_precision(records: Iterable[Record]) -> dict[str, list[Record]]:
    """The records grouped by precision, fp32 first, then bf16, then fp16 (then any other)."""
    groups: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        groups[record_precision(record)].append(record)
    order = {"fp32": 0, "bf16": 1, "fp16": 2}
    return {p: groups[p] for p in sorted(groups, key=lambda p: (order.get(p, 3), p))}


def by_precision(
    standard: Sequence[Record], verified: Sequence[Record]
) -> dict[str, tuple[list[Record], list[Record]]]:
    """Two protocols' records paired by precision, for one comparison per precision."""
    left, right = split_by_precision(standard), split_by_precision(verified)
    names = [p for p in {**left, **right}]
    return {p: (left.get(p, []), right.get(p, [])) for p in names}


def eager_baseline(record: Record) -> str:
    """The name of the eager baseline of a record's precision: ``eager_fp32``, ``eager_bf16``, ..."""
    return f"eager_{record_precision(record)}"
