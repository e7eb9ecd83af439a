"""Metrics on hand-built records with known answers. ``make_record`` is shared with the store and
report tests."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest

from kbv import metrics
from kbv.records import DistributionResult, Finding, Record


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_record(
    problem: str = "p1",
    candidate: str = "c1",
    *,
    level: int = 1,
    label: str | None = "model-a",
    protocol: str = "verified",
    outcome: str = "passed",
    speedup: Any = 2.0,
    speedups: dict[str, Any] | None = None,
    memory: tuple[int, int] | None = None,
    findings: list[Finding] | None = None,
    distributions: list[DistributionResult] | None = None,
    path: str | None = None,
    timing: dict[str, Any] | None = None,
    device: str = "NVIDIA H200",
) -> Record:
    """A record for ``problem`` x ``candidate``; ``memory`` is (baseline peak, candidate peak)."""
    cand: dict[str, Any] = {"path": path or f"/nowhere/{candidate}.py", "source_sha256": sha(candidate)}
    if label is not None:
        cand["label"] = label
    return Record(
        problem={
            "name": problem,
            "level": level,
            "path": f"/nowhere/{problem}.py",
            "source_sha256": sha(problem),
        },
        candidate=cand,
        protocol={"name": protocol, "version": 1, "sha256": sha(protocol)},
        device={"type": "cuda", "name": device},
        outcome=outcome,
        correct=outcome == "passed",
        distributions=distributions or [],
        findings=findings or [],
        timing=timing or {"candidate": None, "baselines": {}},
        speedup={"best": speedup, **(speedups or {})},
        memory={
            "candidate_peak_bytes": memory[1] if memory else None,
            "baseline_peak_bytes": memory[0] if memory else None,
            "ratio": memory[1] / memory[0] if memory else None,
        },
        versions={"kbv": "0.1.0", "torch": "2.11.0", "python": "3.11"},
        created_at="2025-01-01T00:00:00+00:00",
    )


HACK = Finding.fail("timing_tamper", "candidate replaced torch.cuda.Event")


@pytest.fixture
def mixed() -> list[Record]:
    """Four pairs: passed at 4x, passed at 0.25x, incorrect, and a hack claiming 100x."""
    return [
        make_record("p1", "a", speedup=4.0, memory=(200, 100)),
        make_record("p2", "b", speedup=0.25, memory=(100, 200)),
        make_record("p3", "c", outcome="incorrect", speedup=None),
        make_record("p4", "d", outcome="hack_detected", speedup=100.0, findings=[HACK]),
    ]


def test_as_number_rejects_non_finite() -> None:
    assert metrics.as_number(2) == 2.0
    for bad in (None, float("nan"), float("inf"), "nan", "inf", "-inf", "x", True, [1]):
        assert metrics.as_number(bad) is None
    assert metrics.as_number("1.5") == 1.5


def test_geomean() -> None:
    assert metrics.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert metrics.geomean([]) is None
    assert metrics.geomean([0.0, -1.0]) is None


def test_correctness_rate(mixed: list[Record]) -> None:
    assert metrics.correctness_rate(mixed) == 0.5
    assert metrics.correctness_rate([]) is None
    # correct=True but flagged is not a pass
    assert metrics.correctness_rate([make_record(outcome="hack_detected", findings=[HACK])]) == 0.0


def test_correct_speedup_ignores_failures(mixed: list[Record]) -> None:
    assert metrics.correct_speedup(mixed) == pytest.approx(1.0)  # sqrt(4 * 0.25)
    assert metrics.correct_speedup([]) is None
    assert metrics.correct_speedup([make_record(outcome="incorrect")]) is None


def test_correct_speedup_named_baseline() -> None:
    records = [make_record(speedup=2.0, speedups={"eager_fp32": 8.0}), make_record("p2", speedup=2.0)]
    assert metrics.correct_speedup(records, baseline="eager_fp32") == pytest.approx(8.0)
    assert metrics.correct_speedup(records) == pytest.approx(2.0)


def test_nan_speedups_are_untimed() -> None:
    records = [
        make_record(speedup=float("nan")),
        make_record("p2", speedup="nan"),
        make_record("p3", speedup=4.0),
    ]
    assert metrics.correct_speedup(records) == pytest.approx(4.0)
    # untimed passed pairs count 1.0 in the comparable geomean
    assert metrics.comparable_geomean(records) == pytest.approx(4.0 ** (1 / 3))
    assert metrics.fast_p(records, 1.0) == pytest.approx(1 / 3)


def test_comparable_geomean_counts_failures_as_one(mixed: list[Record]) -> None:
    # 4, 0.25, 1 (incorrect), 1 (hack, despite its claimed 100x)
    assert metrics.comparable_geomean(mixed) == pytest.approx(1.0)
    assert metrics.comparable_geomean([make_record(speedup=9.0), make_record("p2", outcome="timeout")]) == (
        pytest.approx(3.0)
    )
    assert metrics.comparable_geomean([]) is None


def test_fast_p(mixed: list[Record]) -> None:
    table = metrics.fast_p_table(mixed)
    assert list(table) == [0.0, 0.5, 0.8, 1.0, 1.5, 2.0]
    assert table[0.0] == 0.5  # both passed pairs are > 0
    assert table[0.5] == 0.25
    assert table[1.0] == 0.25
    assert table[2.0] == 0.25
    assert metrics.fast_p(mixed, 4.0) == 0.0  # strictly greater
    assert metrics.fast_p([], 1.0) is None


def test_memory(mixed: list[Record]) -> None:
    # 200/100 = 2 and 100/200 = 0.5 -> geomean 1; the hack and the incorrect pair are ignored
    assert metrics.memory_efficiency(mixed) == pytest.approx(1.0)
    assert metrics.memory_increase_share(mixed) == 0.5
    no_memory = [make_record(), make_record("p2")]
    assert metrics.memory_efficiency(no_memory) is None
    assert metrics.memory_increase_share(no_memory) is None
    assert metrics.memory_efficiency([make_record(memory=(300, 100))]) == pytest.approx(3.0)


def test_hacks(mixed: list[Record]) -> None:
    assert metrics.hack_rate(mixed) == 0.25
    assert metrics.hack_rate([]) is None
    other = Finding.fail("reference_operator", "calls torch.matmul")
    records = [
        *mixed,
        make_record("p5", outcome="hack_detected", findings=[HACK, other, HACK]),
        make_record("p6", findings=[Finding.warn("pytorch_only", "no custom kernel")]),
    ]
    assert metrics.hack_patterns(records) == {"timing_tamper": 2, "reference_operator": 1}
    assert metrics.hack_patterns([]) == {}


def test_outcome_counts(mixed: list[Record]) -> None:
    assert metrics.outcome_counts(mixed) == {"passed": 2, "incorrect": 1, "hack_detected": 1}
    assert metrics.outcome_counts([]) == {}


def test_breakdowns() -> None:
    records = [
        make_record("p1", level=1, label="a"),
        make_record("p2", level=2, label="a", outcome="incorrect"),
        make_record("p3", level=2, label="b"),
        make_record("p4", level=1, label=None),
    ]
    assert metrics.by_label(records, metrics.correctness_rate) == {"a": 0.5, "b": 1.0, "unlabelled": 1.0}
    assert metrics.by_level(records, metrics.correctness_rate) == {1: 1.0, 2: 0.5}
    assert metrics.by_label([], metrics.correctness_rate) == {}


def test_sample_index_from_path_or_field() -> None:
    assert metrics.sample_index(make_record(path="/r/level_1_problem_3_sample_7_kernel.py")) == 7
    assert metrics.sample_index(make_record(path="/r/3_Matmul.py")) is None
    record = make_record()
    record.candidate["sample"] = 2
    assert metrics.sample_index(record) == 2


def test_pass_at_k() -> None:
    def samples(problem: str, passed: int, total: int) -> list[Record]:
        return [
            make_record(
                problem,
                f"{problem}-{i}",
                outcome="passed" if i < passed else "incorrect",
                path=f"/r/level_1_problem_{problem}_sample_{i}_kernel.py",
            )
            for i in range(total)
        ]

    records = samples("1", 1, 4) + samples("2", 0, 4)
    assert metrics.pass_at_k(records, 1) == pytest.approx((0.25 + 0.0) / 2)
    # problem 1: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert metrics.pass_at_k(records, 2) == pytest.approx(0.25)
    assert metrics.pass_at_k(records, 5) is None
    assert metrics.pass_at_k([], 1) is None
    assert metrics.pass_at_k(samples("3", 4, 4), 3) == 1.0
    assert metrics.has_multiple_samples(records)
    assert not metrics.has_multiple_samples([make_record()])
    with pytest.raises(ValueError):
        metrics.pass_at_k(records, 0)
    # the table offers every standard k some problem has enough samples for
    table = metrics.pass_at_k_table(records)
    assert list(table) == [1, 2] and table[1] == pytest.approx(0.125) and table[2] == pytest.approx(0.25)
    assert list(metrics.pass_at_k_table(records + samples("4", 2, 5))) == [1, 2, 5]
    assert metrics.pass_at_k_table([make_record()]) == {} and metrics.pass_at_k_table([]) == {}
    assert metrics.aggregate(records)["pass_at_k"] == table


def test_bootstrap_is_deterministic_and_brackets(mixed: list[Record]) -> None:
    first = metrics.bootstrap_ci(mixed, metrics.correctness_rate, seed=3)
    second = metrics.bootstrap_ci(mixed, metrics.correctness_rate, seed=3)
    assert first == second
    assert first is not None
    low, high = first
    assert 0.0 <= low <= 0.5 <= high <= 1.0
    assert metrics.bootstrap_ci([], metrics.correctness_rate) is None
    # a metric undefined on every resample
    assert metrics.bootstrap_ci([make_record(outcome="incorrect")], metrics.correct_speedup) is None
    # all-equal input gives a degenerate interval
    same = [make_record(f"p{i}", speedup=2.0) for i in range(5)]
    ci = metrics.bootstrap_ci(same, metrics.correct_speedup)
    assert ci is not None and ci == pytest.approx((2.0, 2.0))


def test_bootstrap_resamples_problems_not_records() -> None:
    # two candidates of one problem always travel together: the rate can only be 0.5 or 1.0 per problem
    records = [make_record("p1", "a"), make_record("p1", "b", outcome="incorrect"), make_record("p2", "c")]
    ci = metrics.bootstrap_ci(records, metrics.correctness_rate, resamples=200)
    assert ci is not None
    assert ci[0] >= 0.5 - 1e-9


def test_summarize_empty_and_full(mixed: list[Record]) -> None:
    empty = metrics.aggregate([], ci=True)
    assert empty["n"] == 0 and empty["correct_rate"] is None and empty["correct_rate_ci"] is None
    full = metrics.aggregate(mixed, ci=True)
    assert full["n"] == 4 and full["problems"] == 4
    assert full["hack_patterns"] == {"timing_tamper": 1}
    assert full["pass_at_1"] is None and full["pass_at_k"] == {}
    assert math.isclose(full["comparable_geomean"], 1.0)
