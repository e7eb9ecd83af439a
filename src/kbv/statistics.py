"""Timing statistics, computed in the trusted parent from the raw samples a worker reports.

:func:`summarize` and :func:`paired_speedup` derive every statistic with bootstrap confidence
intervals; :func:`wall_vs_device_disagreement` compares the two clocks a worker reports; and
:func:`bracket_check` compares the worker's samples with the parent's own clock, which the
candidate cannot reach. Quality warnings carry named thresholds (module constants). The recipe
that takes the samples runs in the worker: ``kbv.child.timing``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kbv.protocol import TimingSettings
from kbv.samples import Measurement as Measurement  # what a worker's timed run reports
from kbv.samples import recipe_name as recipe_name

# --------------------------------------------------------------------------------------------
# Named thresholds. Each is written into a warning's meaning; change them here, nowhere else.
# --------------------------------------------------------------------------------------------

#: "noisy": the coefficient of variation (stdev / mean) of the samples exceeds this.
NOISY_CV = 0.10
#: "overhead_dominated": the median is below this (ms). Each sample holds the call's host path
#: (docs/timing.md, "Why the launch path stays inside the timed region"): 9-38 us on the H200 for
#: bundled CUDA kernels, 121 us for a Triton one (2026-12-02). Below 60 us a CUDA kernel's path is
#: about half the sample or more, so the figure says more about the launch path than the kernel. It
#: was 20 us, a guess from the launch alone, before the path was measured.
OVERHEAD_DOMINATED_MS = 0.06
#: "few_samples": fewer samples than this (the time budget cut the run short).
MIN_SAMPLES = 10
#: "outliers": the largest sample exceeds this multiple of the median.
OUTLIER_FACTOR = 3.0

#: wall_vs_device_disagreement: the wall clock may exceed the device timer by the measured
#: per-call overhead or by this fraction of the device time, whichever is larger ...
WALL_DEVICE_REL_TOLERANCE = 0.5
#: ... plus this absolute slack (ms), which absorbs the two synchronisations and the clock reads.
#: On an H200 (torch 2.11) an empty call measured wall - device = 0.010 ms and 256..4096 matmuls
#: 0.009..0.030 ms, while 3 side-stream 4096 matmuls measured 7.96 ms.
WALL_DEVICE_SLACK_MS = 0.05

#: bracket_check: the parent's bracket may exceed the worker's reported total by the expected
#: overhead plus this absolute slack (ms: process scheduling, the private channel's latency) ...
BRACKET_SLACK_ABS_MS = 2.0
#: ... plus this fraction of the reported total (timer granularity and jitter that grow with the
#: batch). An under-report smaller than this fraction goes unnoticed; that is the price of no
#: false alarms.
BRACKET_SLACK_REL = 0.10
#: Bootstrap resamples are drawn in chunks of at most this many elements, to bound memory.
_BOOTSTRAP_CHUNK_ELEMENTS = 2_000_000


# --------------------------------------------------------------------------------------------


def _as_array(samples: Sequence[float]) -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError("timing samples must be finite numbers")
    return arr


def _bootstrap_medians(arr: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    n = arr.size
    per_chunk = max(1, _BOOTSTRAP_CHUNK_ELEMENTS // n)
    out = np.empty(resamples)
    for lo in range(0, resamples, per_chunk):
        hi = min(resamples, lo + per_chunk)
        idx = rng.integers(0, n, size=(hi - lo, n))
        out[lo:hi] = np.median(arr[idx], axis=1)
    return out


def quality_warnings(n: int, median: float, cv: float, maximum: float) -> list[str]:
    """Named warnings for a sample set; each compares against one module-level threshold."""
    found = []
    if n < MIN_SAMPLES:
        found.append("few_samples")
    if cv > NOISY_CV:
        found.append("noisy")
    if median < OVERHEAD_DOMINATED_MS:
        found.append("overhead_dominated")
    if maximum > OUTLIER_FACTOR * median:
        found.append("outliers")
    return found


def summarize(samples_ms: Sequence[float], *, resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Descriptive statistics of raw samples (ms), a bootstrap CI of the median, and warnings.

    The CI is a percentile bootstrap: ``resamples`` resamples with replacement from a generator
    seeded with ``seed`` (so a record can be recomputed exactly), 2.5th and 97.5th percentiles of
    the resampled medians. ``stdev`` is the sample standard deviation (ddof=1); ``cv`` is
    stdev / mean. Warnings: ``few_samples`` (n < MIN_SAMPLES), ``noisy`` (cv > NOISY_CV),
    ``overhead_dominated`` (median < OVERHEAD_DOMINATED_MS), ``outliers`` (max > OUTLIER_FACTOR x
    median). No samples gives None statistics and the warning ``no_samples``.
    """
    arr = _as_array(samples_ms)
    n = int(arr.size)
    if n == 0:
        empty: dict[str, Any] = dict.fromkeys(
            ("median", "mean", "min", "max", "stdev", "iqr", "cv", "ci95_low", "ci95_high")
        )
        return {
            "n": 0,
            **empty,
            "n_outliers": 0,
            "resamples": resamples,
            "seed": seed,
            "warnings": ["no_samples"],
        }
    median = float(np.median(arr))
    mean = float(arr.mean())
    stdev = float(arr.std(ddof=1)) if n > 1 else 0.0
    q25, q75 = np.percentile(arr, [25, 75])
    cv = stdev / mean if mean > 0 else 0.0
    boot = _bootstrap_medians(arr, resamples, np.random.default_rng(seed))
    ci_low, ci_high = np.percentile(boot, [2.5, 97.5])
    return {
        "n": n,
        "median": median,
        "mean": mean,
        "min": float(arr.min()),
        "max": float(arr.max()),
        "stdev": stdev,
        "iqr": float(q75 - q25),
        "cv": cv,
        "ci95_low": float(ci_low),
        "ci95_high": float(ci_high),
        "n_outliers": int(np.sum(arr > OUTLIER_FACTOR * median)),
        "resamples": resamples,
        "seed": seed,
        "warnings": quality_warnings(n, median, cv, float(arr.max())),
    }


def paired_speedup(
    baseline_rounds: Sequence[Sequence[float]],
    candidate_rounds: Sequence[Sequence[float]],
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Speedup of the candidate over the baseline from interleaved rounds (A B A B ...).

    Round ``r`` of the baseline and round ``r`` of the candidate were measured back to back, so
    they share the machine's state (clocks, temperature, neighbours); the bootstrap keeps them
    paired. ``speedup`` = median(all baseline samples) / median(all candidate samples). The 95%
    interval is a two-level percentile bootstrap: draw rounds with replacement (the same round
    indices for both sides), then samples with replacement within each drawn round, and take the
    ratio of pooled medians. With one round only the sample level varies. ``per_round`` holds each
    round's own median ratio; a spread among them shows drift the pooled number hides.
    """
    base, cand = _ratio_rounds(baseline_rounds, candidate_rounds)
    if len(base) != len(cand):
        raise ValueError(
            f"paired_speedup needs the same, non-zero number of rounds on both sides; "
            f"got {len(base)} baseline and {len(cand)} candidate rounds"
        )
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), size=(resamples, len(base)))
    boot = _two_level_medians(base, picks, rng) / _two_level_medians(cand, picks, rng)
    per_round = [float(np.median(b) / np.median(c)) for b, c in zip(base, cand, strict=True)]
    return _ratio_result(base, cand, boot, per_round, resamples, seed)


def unpaired_speedup(
    baseline_rounds: Sequence[Sequence[float]],
    candidate_rounds: Sequence[Sequence[float]],
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """:func:`paired_speedup` for rounds that were not measured side by side and need not be as many
    (a cached baseline against a candidate timed until precise): the bootstrap draws each side's
    rounds on its own, then samples within each drawn round. ``per_round`` is empty."""
    base, cand = _ratio_rounds(baseline_rounds, candidate_rounds)
    rng = np.random.default_rng(seed)
    base_picks = rng.integers(0, len(base), size=(resamples, len(base)))
    cand_picks = rng.integers(0, len(cand), size=(resamples, len(cand)))
    boot = _two_level_medians(base, base_picks, rng) / _two_level_medians(cand, cand_picks, rng)
    return _ratio_result(base, cand, boot, [], resamples, seed)


def _ratio_rounds(
    baseline_rounds: Sequence[Sequence[float]], candidate_rounds: Sequence[Sequence[float]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    base = [_as_array(r) for r in baseline_rounds]
    cand = [_as_array(r) for r in candidate_rounds]
    if not base or not cand:
        raise ValueError("a speedup needs at least one round on each side")
    if any(r.size == 0 for r in base + cand):
        raise ValueError("every round needs at least one sample")
    if any(np.any(r <= 0) for r in base + cand):
        raise ValueError("timing samples must be positive to form a speedup")
    return base, cand


def _two_level_medians(rounds: list[np.ndarray], picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per resample (a row of ``picks``: the rounds drawn), the median of as many samples drawn with
    replacement within each drawn round as it holds, pooled. Vectorised: rounds of unequal sizes are
    padded with NaN, which the median leaves out."""
    sizes = np.array([r.size for r in rounds])
    width = int(sizes.max())
    padded = np.full((len(rounds), width), np.nan)
    for i, r in enumerate(rounds):
        padded[i, : r.size] = r
    out = np.empty(picks.shape[0])
    per_chunk = max(1, _BOOTSTRAP_CHUNK_ELEMENTS // (picks.shape[1] * width))
    for lo in range(0, picks.shape[0], per_chunk):
        chosen = picks[lo : lo + per_chunk]
        n = sizes[chosen][..., None]  # samples of each drawn round
        within = np.minimum((rng.random((*chosen.shape, width)) * n).astype(np.int64), width - 1)
        values = padded[chosen[..., None], within]
        if np.all(sizes == width):
            out[lo : lo + per_chunk] = np.median(values.reshape(len(chosen), -1), axis=1)
        else:
            values = np.where(np.arange(width) < n, values, np.nan)
            out[lo : lo + per_chunk] = np.nanmedian(values.reshape(len(chosen), -1), axis=1)
    return out


def _ratio_result(
    base: list[np.ndarray],
    cand: list[np.ndarray],
    boot: np.ndarray,
    per_round: list[float],
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    base_median = float(np.median(np.concatenate(base)))
    cand_median = float(np.median(np.concatenate(cand)))
    low, high = np.percentile(boot, [2.5, 97.5])
    return {
        "speedup": base_median / cand_median,
        "ci95_low": float(low),
        "ci95_high": float(high),
        "per_round": per_round,
        "baseline_median": base_median,
        "candidate_median": cand_median,
        "n_rounds": len(cand),
        "resamples": resamples,
        "seed": seed,
    }


def wall_vs_device_disagreement(measurement: Measurement, overhead_ms: float) -> dict[str, Any]:
    """Compare the device-wide wall clock with the device timer; flag work the events missed.

    The events are recorded on the timed stream, so work the candidate enqueues on another stream
    (or a background thread launches) lies outside them: the end event fires early and the device
    time looks small. The wall samples synchronise the whole device before and after, so they
    include that work. An honest call's wall time exceeds its device time only by fixed overhead
    (``overhead_ms``: what the caller measured for an empty call, i.e. sync and launch costs).
    ``disagrees`` when median(wall) - median(device) > max(overhead_ms, WALL_DEVICE_REL_TOLERANCE
    x median(device)) + WALL_DEVICE_SLACK_MS; the relative term tolerates host-side launch gaps
    that grow with the call. On the CPU the two clocks are the same, so this never fires there.
    """
    if not measurement.device_ms or not measurement.wall_ms:
        raise ValueError("wall_vs_device_disagreement needs a measurement with samples")
    device = float(np.median(measurement.device_ms))
    wall = float(np.median(measurement.wall_ms))
    allowed = max(overhead_ms, WALL_DEVICE_REL_TOLERANCE * device) + WALL_DEVICE_SLACK_MS
    excess = wall - device
    return {
        "device_median_ms": device,
        "wall_median_ms": wall,
        "ratio": wall / device if device > 0 else math.inf,
        "excess_ms": excess,
        "allowed_excess_ms": allowed,
        "disagrees": bool(excess > allowed),
    }


def bracket_check(
    reported_total_ms: float, parent_bracket_ms: float, expected_overhead_ms: float, *, n_calls: int = 1
) -> dict[str, Any]:
    """Compare the worker's reported total with the trusted parent's own bracket of the batch.

    The parent reads its monotonic clock before it asks the worker to run a timed batch and after
    the result arrives. Whatever the worker reports (the sum of its per-call wall samples, say),
    real time passed in between, and the candidate cannot touch the parent's clock. An honest
    worker's report falls short of the bracket only by the batch's untimed work
    (``expected_overhead_ms``: warm-up, flushes, syncs, the channel), up to a slack of
    BRACKET_SLACK_ABS_MS + BRACKET_SLACK_REL x reported_total_ms. A larger gap means the worker
    under-reported (its clock or stats were tampered with): ``disagrees``. A report larger than
    the bracket by more than the absolute slack is impossible: ``overreports``.

    ``trusted_per_call_ms`` = (bracket - expected overhead) / n_calls, an upper-bound estimate of a
    call's time that needs no trust in the worker; use it instead of the report when they disagree.
    """
    if n_calls < 1:
        raise ValueError(f"n_calls must be >= 1, not {n_calls}")
    gap = parent_bracket_ms - reported_total_ms
    allowed = expected_overhead_ms + BRACKET_SLACK_ABS_MS + BRACKET_SLACK_REL * reported_total_ms
    return {
        "reported_total_ms": reported_total_ms,
        "parent_bracket_ms": parent_bracket_ms,
        "gap_ms": gap,
        "allowed_gap_ms": allowed,
        "trusted_per_call_ms": max(0.0, parent_bracket_ms - expected_overhead_ms) / n_calls,
        "disagrees": bool(gap > allowed),
        "overreports": bool(-gap > BRACKET_SLACK_ABS_MS),
    }


def warmup_bound_ms(settings: TimingSettings, call_ms: float, n_input_sets: int = 1) -> float:
    """The longest an honest warm-up under ``settings`` lasts, from the recipe, not the worker's word.

    :func:`_warm_up` stops at the first check after ``settings.warmup_calls`` calls were made and
    ``settings.warmup_seconds`` passed, so it lasts at most warmup_seconds + (warmup_calls + 1) x a
    call. With ``cuda_graph`` there are two warm-ups (eager, covering every input set, then
    replays) and one capture per input set. ``call_ms`` is the time of a call: the batch's median
    sample in :func:`accounted_batch_ms` (the largest sample once stood here, so one outsized sample
    stretched the warm-up it may account for by four times itself).
    """
    largest = max(0.0, float(call_ms))
    budget_ms = settings.warmup_seconds * 1e3
    bound = budget_ms + (settings.warmup_calls + 1) * largest
    if settings.cuda_graph:
        eager = budget_ms + (max(settings.warmup_calls, n_input_sets) + 1) * largest
        bound += eager + n_input_sets * largest
    return bound


def accounted_batch_ms(
    wall_ms: Sequence[float], claimed_warmup_calls: int, settings: TimingSettings, n_input_sets: int = 1
) -> float:
    """How much of a timed batch the worker's report accounts for: the timed samples plus the warm-up.

    The warm-up the worker implies (its claimed number of warm-up calls x its median sample, at
    least the recipe's ``warmup_seconds``) is accepted only up to :func:`warmup_bound_ms` of the
    median: a worker that claims 100000 warm-up calls cannot stretch its account to cover a gap in
    the parent's bracket. Each sample counts at most :data:`SAMPLE_CAP` times the median, so what the
    report accounts for is what its median (the speedup's figure) can explain: time hidden in
    outsized samples (29 calls of 0.25 ms and one of 25 ms, for 30 calls of 1 ms) stays a gap.
    """
    wall = [float(x) for x in wall_ms]
    if not wall:
        return 0.0
    median = float(np.median(wall))
    capped = [min(x, SAMPLE_CAP * median) for x in wall]
    claimed = max(settings.warmup_seconds * 1e3, max(0, int(claimed_warmup_calls)) * median)
    return sum(capped) + min(claimed, warmup_bound_ms(settings, median, n_input_sets))


#: A sample beyond this multiple of its batch's median counts only as this multiple when the
#: worker's report is held against the parent's bracket: the ``outliers`` threshold
#: (:data:`OUTLIER_FACTOR`). The speedup is the median's, so a report may account for the bracket only
#: with samples its median explains: with at most half the samples above the median, outsized
#: samples raise the account to at most (1 + SAMPLE_CAP) / 2 times what the median claims, and one
#: of them by SAMPLE_CAP - 1 medians. It was 20 (and the warm-up bound took the largest capped
#: sample), which let one outsized sample account for about 100 medians and a 30-call batch claim
#: about 4 times its true speed (tests/test_timing.py). An honest hiccup beyond it is a gap in its
#: round only; the check fires when every round disagrees.
SAMPLE_CAP = OUTLIER_FACTOR


def trusted_per_call_ms(
    bracket_ms: float, overhead_ms: float, n_timed: int, settings: TimingSettings
) -> float:
    """A call's time from the parent's bracket and the recipe alone (no worker-reported count).

    The bracket minus the expected overhead (``B``) holds the warm-up and ``n_timed`` calls of time
    ``T``. The warm-up is either time-bound (it lasts ``warmup_seconds``: T = (B - warmup_seconds) /
    n_timed) or count-bound (``warmup_calls`` calls: T = B / (warmup_calls + n_timed)); for an honest
    batch the smaller of the two is its per-call time. ``n_timed`` is capped at ``settings.repeats``.
    """
    budget = max(0.0, float(bracket_ms) - float(overhead_ms))
    n = max(1, min(int(n_timed), settings.repeats))
    estimates = [budget / (settings.warmup_calls + n)]
    if budget > settings.warmup_seconds * 1e3:
        estimates.append((budget - settings.warmup_seconds * 1e3) / n)
    return min(estimates)


def batch_gap_ms(measurement: dict[str, Any], settings: TimingSettings) -> float:
    """The part of the parent's bracket of one timed batch that the worker's samples leave
    unexplained: ``parent_bracket_s`` minus :func:`accounted_batch_ms` minus
    :func:`machine_wait_ms`. A trusted batch's gap is what an honest batch loses, at that moment,
    to untimed work (the channel, input rotation, kept output copies) and to scheduling delays the
    counts do not show."""
    bracket_ms = float(measurement["parent_bracket_s"]) * 1e3
    return bracket_ms - _accounted(measurement, settings) - machine_wait_ms(measurement)


def machine_wait_ms(measurement: dict[str, Any]) -> float:
    """Time of a batch the worker's main thread spent runnable but waiting for a CPU, less the CPU
    time its own other threads and processes took meanwhile (``worker_scheduler_ms``, counted by
    the kernel and read by the parent; 0 without them).

    On an overloaded machine this is the bulk of a batch's gap: an honest hinge loss's batches on two
    cores shared by two test runs waited 46-56 ms of a 92 ms bracket, where the trusted batches of the
    same moment waited 2-40 ms, and ``timing_disagreement`` called it a lie. It is not time the
    worker can have spent computing: its main thread was not running, and what its own helpers ran
    (which could make the main thread wait on a CPU they share) is taken off. A worker can still
    make its main thread wait without helpers (pinned to a CPU that other processes keep busy), so
    :func:`bracket_verdict` credits a candidate's batch at most the largest share of its bracket
    that a trusted batch waited: under-reporting then hides at most what the machine's load, as
    honest batches met it, explains, and nothing on an idle machine."""
    counted = measurement.get("worker_scheduler_ms")
    if not isinstance(counted, dict):
        return 0.0
    try:
        wait, main, every = (float(counted[k]) for k in ("main_wait", "main_cpu", "cpu"))
    except (KeyError, TypeError, ValueError):
        return 0.0
    if not all(math.isfinite(x) and x >= 0 for x in (wait, main, every)):
        return 0.0
    return max(0.0, wait - max(0.0, every - main))


def _accounted(measurement: dict[str, Any], settings: TimingSettings) -> float:
    wall = [float(x) for x in measurement.get("wall_ms") or []]
    claimed_warmup = int(measurement.get("warmup_calls", 0) or 0)
    return accounted_batch_ms(
        wall, claimed_warmup, batch_settings(measurement, settings), max(1, settings.input_sets)
    )


def batch_settings(measurement: dict[str, Any], settings: TimingSettings) -> TimingSettings:
    """The settings one batch was timed under: the protocol's, with the warm-up budget the parent
    asked for that batch (``warmup_budget_s``, written by the parent: a worker's later batches warm
    up for ``rewarm_seconds``). A batch without it (cached before the field) had ``warmup_seconds``."""
    budget = measurement.get("warmup_budget_s")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not math.isfinite(budget):
        return settings
    return dataclasses.replace(settings, warmup_seconds=max(0.0, float(budget)))


def warmup_budget_s(settings: TimingSettings, first_batch: bool) -> float:
    """The warm-up budget of a worker's batch: ``warmup_seconds`` for its first batch of a precision
    in an evaluation, ``rewarm_seconds`` (where set) for the later ones: the model, its inputs and
    the GPU's clocks were warm already, and ``warmup_calls`` calls still run."""
    if first_batch or settings.rewarm_seconds < 0:
        return settings.warmup_seconds
    return min(settings.warmup_seconds, settings.rewarm_seconds)


def median_precision(samples_ms: Sequence[float], resamples: int = 1000, seed: int = 0) -> float:
    """Half the width of the bootstrap 95% interval of the samples' median, relative to the median
    (``inf`` for no samples or a median of 0): what ``TimingSettings.median_precision`` is held against."""
    arr = _as_array(samples_ms)
    if arr.size == 0:
        return math.inf
    median = float(np.median(arr))
    if median <= 0:
        return math.inf
    low, high = np.percentile(_bootstrap_medians(arr, resamples, np.random.default_rng(seed)), [2.5, 97.5])
    return float(high - low) / 2 / median


def bracket_verdict(
    candidate_rounds: Sequence[dict[str, Any]],
    trusted_rounds: Sequence[dict[str, Any]],
    settings: TimingSettings,
) -> dict[str, Any]:
    """Every candidate batch against the parent's bracket (:func:`bracket_check`), the expected
    overhead being the largest gap (:func:`batch_gap_ms`) of the trusted batches: baseline batches
    of the same recipe, timed in workers that never imported candidate code. ``rounds`` holds each
    candidate round's check with its ``trusted_per_call_ms``; ``disagrees`` only when every round
    disagrees (a lying clock lies in every round, a noise spike hits one) and there was a trusted
    batch to compare with (``overhead_ms`` is None without one)."""
    bracketed = [r for r in trusted_rounds if "parent_bracket_s" in r]
    gaps = [batch_gap_ms(r, settings) for r in bracketed]
    if not gaps or not candidate_rounds:
        return {"overhead_ms": None, "rounds": [], "disagrees": False}
    overhead = max(0.0, max(gaps))
    # A candidate batch's wait counts up to the largest share of its bracket a trusted batch waited:
    # the load the machine showed honest batches, not whatever a worker pinned to a busy CPU waits.
    load = max(machine_wait_ms(r) / max(float(r["parent_bracket_s"]) * 1e3, 1e-9) for r in bracketed)
    results = []
    for r in candidate_rounds:
        bracket_ms = float(r["parent_bracket_s"]) * 1e3
        waited = min(machine_wait_ms(r), load * bracket_ms)  # not the worker's time
        result = bracket_check(_accounted(r, settings), bracket_ms - waited, overhead)
        result["parent_bracket_ms"], result["machine_wait_ms"] = bracket_ms, waited
        # The per-call time from the bracket and the recipe alone: the worker's warm-up count is its word.
        result["trusted_per_call_ms"] = trusted_per_call_ms(
            bracket_ms - waited, overhead, len(r.get("wall_ms") or []), batch_settings(r, settings)
        )
        results.append(result)
    return {"overhead_ms": overhead, "rounds": results, "disagrees": all(r["disagrees"] for r in results)}


def invalid_samples(measurement: dict[str, Any], settings: TimingSettings) -> str | None:
    """Why a worker-reported measurement cannot have come from the recipe's clocks, or None.

    Samples must be finite and positive (a call takes time), there must be 1..``settings.repeats``
    of each kind and as many wall samples as device samples, and the warm-up count must be a
    non-negative integer. The parent checks this before any statistic, so a hostile worker's zero
    or NaN becomes the candidate's outcome instead of an exception in the statistics.
    """
    device, wall = measurement.get("device_ms"), measurement.get("wall_ms")
    if not isinstance(device, list) or not isinstance(wall, list):
        return "device_ms and wall_ms must be lists of samples"
    if not 1 <= len(device) <= settings.repeats or len(wall) != len(device):
        return (
            f"{len(device)} device and {len(wall)} wall samples (expected 1..{settings.repeats} of "
            "each, as many of both)"
        )
    for kind, samples in (("device_ms", device), ("wall_ms", wall)):
        for i, x in enumerate(samples):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                return f"{kind}[{i}] = {x!r}: a timed call takes a finite, positive time"
    warm = measurement.get("warmup_calls", 0)
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        return f"warmup_calls = {warm!r} is not a non-negative integer"
    return None
