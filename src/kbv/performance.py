"""Timing and memory, orchestrated by the trusted parent.

Baselines run in trusted workers that never imported candidate code: ``eager_fp32`` and
``eager_tf32`` in the reference worker (they differ only in two global flags, which touch only CUDA:
the CPU times ``eager_fp32`` alone), ``compile`` in a
worker of its own (``torch.compile`` leaves state behind). Baseline and candidate batches alternate
(A B A B ...) so that drift cancels; every batch is bracketed by the parent's monotonic clock and by
NVML readings of clocks, temperature, power and throttling. Baseline measurements are cached under a
key of everything that could change them (``kbv.baseline_cache``).

The candidate's real timed calls are checked too, every one of them: the worker reduces each timed
call's outputs to a sketch (``kbv.sketch``) right after the call returned, outside the timed region,
and the parent judges every sketch against the reference's for the same timing inputs
(``kbv.timed_sketches``). A wrong one withdraws the speedup and is the ``timed_call_outputs``
finding (docs/integrity-dynamic.md).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from kbv import baseline_cache, telemetry, wire, wire_replies
from kbv import statistics as kbv_statistics
from kbv.measure_context import MeasureContext
from kbv.measure_context import UnseenJudge as UnseenJudge  # what the evaluation builds a context with
from kbv.protocol import TimingSettings
from kbv.timed_sketches import _plan_for, _SketchPlan
from kbv.worker import Worker, WorkerFailed, WorkerSpec, visible_devices

BASELINE_PRECISION = {"eager_fp32": "fp32", "eager_tf32": "tf32", "compile": "compile"}
BASELINE_TIMEOUT_S = 1800.0
# What a record's memory section says when nothing was measured (the CPU, or an untimed pair).
EMPTY_MEMORY: dict[str, Any] = {"candidate_peak_bytes": None, "baseline_peak_bytes": None, "ratio": None}
#: Trusted batches timed right after the rounds when every candidate round's gap exceeds what the
#: trusted batches known so far allow (``timing_disagreement``'s re-check, ``bracket_recheck``).
RECHECK_BATCHES = 2


def measure_pair(
    ctx: MeasureContext, reference: Worker, subject: Worker
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (timing, speedup). Baselines come from the cache when their key matches."""
    settings = ctx.settings
    if ctx.build is None:
        raise ValueError("measure_pair needs MeasureContext.build (both models with the timing parameters)")
    ctx.build()
    names, skipped = measured_baselines(
        tuple(settings.baselines), ctx.device, ctx.tf32_operators, ctx.precision
    )
    plan = _plan_for(ctx, reference)
    warmups = _Warmups(settings)
    cached = {name: baseline_cache.read(ctx, name) for name in names}
    cache_checks = _check_cached(ctx, reference, cached, subject, plan, warmups)
    to_measure = [name for name, hit in cached.items() if hit is None]
    compile_worker = _compile_worker(ctx) if "compile" in to_measure else None
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in [*to_measure, "candidate"]}
    active = list(to_measure)  # the baselines still timed (see _dominated)
    stopped: dict[str, str] = {}
    baseline_started = time.monotonic()
    baseline_seconds = 0.0
    try:
        while _rounds_go_on(settings, rounds, active, cache_checks):
            r = len(rounds["candidate"])
            spec = plan.spec(r) if plan is not None else None
            for name in active:
                worker = compile_worker if name == "compile" else reference
                assert worker is not None
                precision = BASELINE_PRECISION[name]
                # A baseline sketches every timed call as the candidate does (the same request but
                # for the precision), so the sketches cost both sides alike in the parent's bracket.
                with _others_paused(worker, reference, subject, compile_worker):
                    batch = _timed_batch(
                        worker, ctx, precision, spec, warmups.budget(worker, precision), ctx.unseen_for(r)
                    )
                rounds[name].append(batch)
                baseline_seconds += batch["parent_bracket_s"]
                if plan is not None:
                    plan.calibrate(name, r, batch)
            with _others_paused(subject, reference, subject, compile_worker):
                batch = _timed_batch(
                    subject, ctx, "native", spec, warmups.budget(subject, "native"), ctx.unseen_for(r)
                )
            rounds["candidate"].append(batch)
            if plan is not None:
                plan.judge(r, batch)
            if r == 0:
                stopped = _dominated(settings, {name: rounds[name] for name in active})
                active = [name for name in active if name not in stopped]
    finally:
        if compile_worker is not None:
            compile_worker.close()
    if compile_worker is not None:  # starting and compiling the torch.compile baseline counts too
        baseline_seconds = max(
            baseline_seconds,
            time.monotonic() - baseline_started - sum(r["parent_bracket_s"] for r in rounds["candidate"]),
        )
    baselines = _baseline_entries(ctx, cached, rounds, cache_checks)
    recheck = _bracket_recheck(ctx, reference, subject, rounds["candidate"], baselines, plan, warmups)
    if recheck is not None:
        baseline_seconds += sum(r["parent_bracket_s"] for r in recheck["rounds"])
    timing = {
        "baseline_seconds": baseline_seconds,
        "recipe": kbv_statistics.recipe_name(settings),
        "candidate": _entry(rounds["candidate"], settings, source="measured"),
        "baselines": baselines,
    }
    if settings.median_precision > 0:
        timing["median_precision"] = _precision_reached(
            settings, {name: rounds[name] for name in [*active, "candidate"]}
        )
    if stopped:
        timing["baselines_stopped"] = stopped
    if skipped:
        timing["baselines_not_measured"] = skipped
    if recheck is not None:
        timing["bracket_recheck"] = recheck
    return timing, _speedups_judged(timing, settings, plan)


def _baseline_entries(
    ctx: MeasureContext,
    cached: dict[str, dict[str, Any] | None],
    rounds: dict[str, list[dict[str, Any]]],
    cache_checks: dict[str, Any],
) -> dict[str, Any]:
    """Each baseline's timing entry: measured now (and cached when its rounds agree) or a cache hit."""
    baselines = {}
    for name, hit in cached.items():
        if hit is None:
            baselines[name] = _entry(rounds[name], ctx.settings, source="measured")
            if baseline_cache.cacheable(rounds[name]):
                baseline_cache.write(ctx, name, baselines[name])
        else:
            baselines[name] = {**hit, "source": "cache"}
        if name in cache_checks:
            baselines[name]["cache_check"] = cache_checks[name]
    return baselines


def _speedups_judged(
    timing: dict[str, Any], settings: TimingSettings, plan: _SketchPlan | None
) -> dict[str, Any]:
    """The speedups, with their intervals and the timed calls' judgement written into ``timing``."""
    speedup, timing["speedup_intervals"] = speedups(timing, settings)
    if plan is not None:
        timing["timed_outputs"] = checked = plan.summary()
        if checked["wrong"]:  # a speedup measured on wrong outputs is no speedup
            speedup = {name: None for name in speedup}
            timing["speedup_intervals"] = {}
            timing["speedup_withdrawn"] = "wrong outputs in the timed calls (timed_call_outputs)"
    return speedup


def _rounds_go_on(
    settings: TimingSettings,
    rounds: dict[str, list[dict[str, Any]]],
    active: list[str],
    cache_checks: dict[str, Any],
) -> bool:
    """:func:`_another_round` over the series still timed (the candidate and ``active`` baselines),
    with every trusted batch timed so far weighed by :func:`_bracket_settled`."""
    still_timed = {name: rounds[name] for name in [*active, "candidate"]}
    return _another_round(settings, still_timed, _bracket_settled(settings, rounds, cache_checks))


def _another_round(
    settings: TimingSettings, rounds: dict[str, list[dict[str, Any]]], bracket_settled: bool = True
) -> bool:
    """Whether the rounds go on: until ``rounds`` were timed, then, with ``median_precision`` set, while a
    series timed in this evaluation has a median less precise than that, ``max_rounds`` allows, and
    (with ``stop_when_futile``) the target is still within reach of ``max_rounds`` (:func:`_futile`)
    or every candidate round so far disagreed with the parent's bracket (``bracket_settled`` False).
    Cached baselines are not timed again, so only the candidate's precision counts beside them."""
    done = len(rounds["candidate"])
    if done < max(1, settings.rounds):
        return True
    if settings.median_precision <= 0 or done >= settings.max_rounds:
        return False
    worst = _worst_precision(settings, rounds)
    return worst > settings.median_precision and not (bracket_settled and _futile(settings, done, worst))


def _bracket_settled(
    settings: TimingSettings, rounds: dict[str, list[dict[str, Any]]], cache_checks: dict[str, Any]
) -> bool:
    """Whether the parent's bracket can no longer fail the candidate: some candidate round so far
    agrees with it, against the trusted batches timed so far (:func:`kbv.statistics.bracket_verdict`),
    or there is no trusted batch to hold the rounds against. ``timing_disagreement`` fails a candidate
    only when every round disagrees, and a round that agrees keeps agreeing as trusted batches are
    added (its allowance is their largest gap), so only while every round has disagreed do more
    rounds matter: they give an honest candidate's noise chances to agree and its allowance more
    trusted batches (on a loaded machine three rounds were too few: an honest ``std::thread`` row sum
    rejected in a CI run of verified v6), while a lying clock disagrees in every round and is judged
    on all of them. Once one round agrees, the futility stop applies as to any candidate (on the CPU
    sample, five of 29 honest references were timed for all nine rounds after one round of noise,
    2026-12-06)."""
    trusted = [batch for name, series in rounds.items() if name != "candidate" for batch in series]
    trusted += [c["batch"] for c in cache_checks.values() if isinstance(c, dict) and "batch" in c]
    verdict = kbv_statistics.bracket_verdict(rounds["candidate"], trusted, settings)
    return not verdict["disagrees"]


def _projected_rounds(settings: TimingSettings, done: int, worst: float) -> float:
    """Rounds the worst series would need for its median to come within ``median_precision``: its
    interval's half-width narrows about as 1/sqrt(samples), so ``done * (worst / target)**2``."""
    return done * (worst / settings.median_precision) ** 2 if math.isfinite(worst) else math.inf


def _futile(settings: TimingSettings, done: int, worst: float) -> bool:
    """Whether more rounds cannot be expected to reach the target within ``max_rounds``
    (``stop_when_futile``): on two shared CPU cores no median came within 2% in 9 rounds, and the
    rounds past the third only repeated the checks (benchmarks/results/2026-12-06-cpu-verified-cost-cut/)."""
    return settings.stop_when_futile and _projected_rounds(settings, done, worst) > settings.max_rounds


def _dominated(settings: TimingSettings, first: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """The baselines to time no further after the first round, with why: those whose median is at
    least ``dominated_factor`` times the fastest one's (at least two timed; 0 stops none). Such a
    baseline cannot be the best one, which is the speedup the verdict reads; its own speedup comes
    from its first round (docs/timing.md, "Rounds until precise")."""
    if settings.dominated_factor <= 0 or len(first) < 2:
        return {}
    medians = {name: statistics.median(batches[0]["device_ms"]) for name, batches in first.items()}
    fastest = min(medians, key=lambda name: medians[name])
    return {
        name: (
            f"timed for one round: its median {median:.4g} ms was {median / medians[fastest]:.2f}x "
            f"{fastest}'s {medians[fastest]:.4g} ms (at least {settings.dominated_factor}x), so it "
            "cannot be the best baseline"
        )
        for name, median in medians.items()
        if name != fastest and median >= settings.dominated_factor * medians[fastest]
    }


def _worst_precision(settings: TimingSettings, rounds: dict[str, list[dict[str, Any]]]) -> float:
    return max(
        kbv_statistics.median_precision(
            [x for batch in series for x in batch["device_ms"]], resamples=settings.bootstrap_resamples
        )
        for series in rounds.values()
    )


def _precision_reached(settings: TimingSettings, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the record says of the rounds timed until precise (``timing.median_precision``); with
    ``stop_when_futile``, ``futile`` says whether the rounds stopped short of ``max_rounds`` because
    the target was out of reach, and ``projected_rounds`` what reaching it would have taken."""
    worst = _worst_precision(settings, rounds)
    done = len(rounds["candidate"])
    reached: dict[str, Any] = {
        "rounds": done,
        "min_rounds": max(1, settings.rounds),
        "max_rounds": max(settings.rounds, settings.max_rounds),
        "target": settings.median_precision,
        "worst": worst,
        "met": worst <= settings.median_precision,
    }
    if settings.stop_when_futile:
        projected = _projected_rounds(settings, done, worst)
        reached["projected_rounds"] = round(projected, 1) if math.isfinite(projected) else None
        reached["futile"] = worst > settings.median_precision and done < settings.max_rounds
    return reached


class _Warmups:
    """The warm-up budget of each batch: ``warmup_seconds`` for a worker's first batch of a precision
    in this evaluation, ``rewarm_seconds`` for its later ones (:func:`kbv.statistics.warmup_budget_s`)."""

    def __init__(self, settings: TimingSettings) -> None:
        self.settings = settings
        self.seen: set[tuple[int, str]] = set()

    def budget(self, worker: Worker, precision: str) -> float:
        key = (id(worker), precision)
        first = key not in self.seen
        self.seen.add(key)
        return kbv_statistics.warmup_budget_s(self.settings, first)


def measured_baselines(
    names: tuple[str, ...],
    device: str,
    tf32_operators: dict[str, Any] | None = None,
    precision: str = "fp32",
) -> tuple[list[str], dict[str, str]]:
    """The protocol's baselines this device times, and those it leaves out with why.

    ``eager_tf32`` runs exactly ``eager_fp32``'s code where the TF32 flags change nothing: on the
    CPU (they touch only CUDA matmuls and cuDNN), and on the GPU when the trusted reference's forward
    ran no TF32-sensitive operator (``tf32_operators``, see :mod:`kbv.child.tf32_ops`). Timing it
    there would only add a noisy duplicate row (and ``best``, the smaller of two draws of one
    speedup, would lean low); the protocol (and its hash) stays the same, the record says what was
    left out and why."""
    measured = [name for name in names if name in BASELINE_PRECISION]
    skipped: dict[str, str] = {}
    if precision != "fp32" and "eager_tf32" in measured:
        measured.remove("eager_tf32")
        skipped["eager_tf32"] = (
            f"TF32 exists only for fp32 inputs: a {precision} evaluation times eager PyTorch in {precision}"
        )
    if "eager_tf32" in measured and "eager_fp32" in measured:
        reason = _same_code_as_fp32(device, tf32_operators)
        if reason:
            measured.remove("eager_tf32")
            skipped["eager_tf32"] = reason
    return measured, skipped


def named_for_precision(
    timing: dict[str, Any], speedup: dict[str, Any], precision: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The record's names for a bf16 or fp16 evaluation's baselines: ``eager_fp32`` (the reference
    as PyTorch runs it on the evaluation's inputs and parameters) is ``eager_bf16`` or
    ``eager_fp16`` there, so no record calls a half-precision measurement fp32."""
    if precision == "fp32":
        return timing, speedup
    eager = f"eager_{precision}"

    def renamed(section: Any) -> Any:
        if not isinstance(section, dict):
            return section
        return {(eager if key == "eager_fp32" else key): value for key, value in section.items()}

    timing = dict(timing)
    for key in ("baselines", "speedup_intervals", "baselines_stopped", "baselines_not_measured"):
        if key in timing:
            timing[key] = renamed(timing[key])
    return timing, renamed(speedup)


def _same_code_as_fp32(device: str, tf32_operators: dict[str, Any] | None) -> str:
    """Why ``eager_tf32`` would time ``eager_fp32``'s code, or "" when it might not."""
    if not device.startswith("cuda"):
        return "same code as eager_fp32 on the CPU (the TF32 flags touch only CUDA and cuDNN)"
    if tf32_operators is None or tf32_operators.get("sensitive") != [] or not tf32_operators.get("operators"):
        return ""
    return (
        "same code as eager_fp32: the reference's forward ran "
        f"{tf32_operators.get('operators', 0)} operators, none of which the TF32 flags change "
        "(no GEMM, cuDNN convolution or RNN; recorded in the reference worker)"
    )


def _check_cached(
    ctx: MeasureContext,
    reference: Worker,
    cached: dict[str, dict[str, Any] | None],
    subject: Worker | None = None,
    plan: _SketchPlan | None = None,
    warmups: _Warmups | None = None,
) -> dict[str, Any]:
    """One fresh batch per cached eager baseline; a cache entry that disagrees is dropped (set to
    None in ``cached``, so it is measured again in interleaved rounds and the cache rewritten). The
    batch sketches its calls like the batches the entry was measured with (the sketches are dropped)."""
    checks: dict[str, Any] = {}
    for name, hit in list(cached.items()):
        if hit is None or name == "compile":  # the compiled baseline needs its own worker: trusted as cached
            continue
        precision = BASELINE_PRECISION[name]
        with _others_paused(reference, subject):
            fresh = _timed_batch(
                reference,
                ctx,
                precision,
                plan.spec(0) if plan else None,
                warmups.budget(reference, precision) if warmups else None,
                ctx.unseen_for(0),
            )
        fresh.pop("sketches", None)
        checks[name] = baseline_cache.cache_agreement(list(fresh["device_ms"]), hit)
        # Timed in this evaluation, next to the candidate's rounds: a trusted gap of this moment.
        checks[name]["batch"] = {k: fresh[k] for k in _GAP_FIELDS}
        if not checks[name]["accepted"]:
            cached[name] = None
    return checks


#: What :func:`kbv.statistics.batch_gap_ms` needs of a batch, and what the scheduler counted during it.
_GAP_FIELDS = (
    "parent_bracket_s",
    "wall_ms",
    "device_ms",
    "warmup_calls",
    "warmup_budget_s",
    "worker_scheduler_ms",
)


def trusted_batches(baselines: dict[str, Any]) -> list[dict[str, Any]]:
    """Every trusted timed batch of a timing section's baselines, each with the parent's bracket:
    their rounds (measured now or cached) and the fresh batch each cache check timed now."""
    found = []
    for entry in baselines.values():
        found += [r for r in entry.get("rounds") or [] if "parent_bracket_s" in r]
        batch = (entry.get("cache_check") or {}).get("batch")
        if isinstance(batch, dict) and "parent_bracket_s" in batch:
            found.append(batch)
    return found


def _bracket_recheck(
    ctx: MeasureContext,
    reference: Worker,
    subject: Worker,
    candidate_rounds: list[dict[str, Any]],
    baselines: dict[str, Any],
    plan: _SketchPlan | None = None,
    warmups: _Warmups | None = None,
) -> dict[str, Any] | None:
    """When every candidate round's bracket leaves more unexplained than any trusted batch did, time
    :data:`RECHECK_BATCHES` trusted batches now (the candidate stopped; they sketch their calls as
    every round did, so their gaps hold the same untimed work), so that
    ``timing_disagreement`` also holds the rounds against what the machine costs an honest batch at
    this moment: cached baselines were timed at another moment, perhaps on a quieter machine. The
    candidate itself is not timed again (it could tell a re-check from a round by counting batches
    and be honest only then); its rounds, whose outputs were checked, are what is judged."""
    if not ctx.recheck_brackets:
        return None
    verdict = kbv_statistics.bracket_verdict(candidate_rounds, trusted_batches(baselines), ctx.settings)
    if not verdict["disagrees"]:
        return None
    with _others_paused(reference, subject):
        last = len(candidate_rounds) - 1
        spec = plan.spec(last) if plan is not None else None
        batches = [
            _timed_batch(
                reference,
                ctx,
                "fp32",
                spec,
                warmups.budget(reference, "fp32") if warmups else None,
                ctx.unseen_for(last),
            )
            for _ in range(RECHECK_BATCHES)
        ]
    return {
        "rounds": [{k: b[k] for k in _GAP_FIELDS} for b in batches],
        "precision": "fp32",
        "why": "every candidate round's bracket gap exceeded the trusted batches' before the re-check",
    }


@contextlib.contextmanager
def _others_paused(timed: Worker, *workers: Worker | None) -> Iterator[None]:
    """Every worker but the one being timed is stopped for the batch (``Worker.paused``): a
    candidate's leftover threads cannot slow the baseline down, nor the reference's the candidate."""
    with contextlib.ExitStack() as stack:
        for worker in workers:
            if worker is not None and worker is not timed:
                stack.enter_context(worker.paused())
        yield


def _timed_batch(
    worker: Worker,
    ctx: MeasureContext,
    precision: str,
    sketch: dict[str, Any] | None = None,
    warmup_s: float | None = None,
    unseen: list[int] | None = None,
) -> dict[str, Any]:
    """One timed batch in ``worker``, bracketed by the parent's clock. The worker's samples are
    checked before anything uses them: impossible ones are the worker's failure (for the candidate,
    a ``runtime_error`` outcome), never an exception inside the statistics. With ``sketch`` (a
    round's :meth:`_SketchPlan.spec`) every timed call is sketched and the reply's sketches are under
    ``sketches`` in the result, for the plan to judge and remove. ``warmup_s`` is the batch's warm-up
    budget (default ``warmup_seconds``); the result keeps it as ``warmup_budget_s``, which the bracket
    check reads (:func:`kbv.statistics.batch_settings`). ``unseen`` (the round's seeds under
    ``timing.unseen_inputs``) gives each timed call a draw of its own."""
    budget = ctx.settings.warmup_seconds if warmup_s is None else float(warmup_s)
    before = telemetry.gpu_state(ctx.device)
    request = wire.Time(
        distribution="original",
        seeds=ctx.seeds,
        precision=precision,
        settings={**_settings_dict(ctx.settings), "warmup_seconds": budget},
        sketch=sketch,
        unseen_seeds=unseen,
    )
    scheduled = worker.scheduler_ns()
    started = time.monotonic()
    reply = wire_replies.TimeReply.of(worker.request(request))
    bracket_s = time.monotonic() - started
    scheduled_after = worker.scheduler_ns()
    after = telemetry.gpu_state(ctx.device)
    raw = reply.measurement
    problem = kbv_statistics.invalid_samples(raw, ctx.settings)
    if problem is not None:
        message = (
            f"the worker reported timing samples no clock produces ({problem}); its timing cannot be used"
        )
        if worker.spec.role != "candidate":
            raise RuntimeError(f"kbv's {precision} baseline: {message}")
        raise WorkerFailed("runtime_error", message)
    measurement = dict(raw)
    measurement["parent_bracket_s"] = bracket_s
    measurement["warmup_budget_s"] = budget
    measurement["worker_scheduler_ms"] = _scheduler_ms(scheduled, scheduled_after)
    measurement["gpu_before"], measurement["gpu_after"] = before, after
    throttled = sorted({*((before or {}).get("throttled") or []), *((after or {}).get("throttled") or [])})
    measurement["throttled"] = throttled
    if sketch is not None:
        measurement["sketches"] = reply.sketches
    return measurement


def _scheduler_ms(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float] | None:
    """What the kernel counted for the worker during a batch's bracket, in ms: its main thread on a
    CPU and waiting for one, and its whole tree's CPU time. Read by the parent from ``/proc``, never
    the worker's word; ``timing_disagreement`` takes the machine's share of the wait off the batch's
    gap (:func:`kbv.statistics.machine_wait_ms`)."""
    if before is None or after is None:
        return None
    return {key: round((after[key] - before[key]) / 1e6, 3) for key in before if key in after}


def _settings_dict(settings: TimingSettings) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}


def _entry(rounds: list[dict[str, Any]], settings: TimingSettings, source: str) -> dict[str, Any]:
    device = [s for r in rounds for s in r["device_ms"]]
    wall = [s for r in rounds for s in r["wall_ms"]]
    summary = kbv_statistics.summarize(device, resamples=settings.bootstrap_resamples)
    throttled = sum(1 for r in rounds if r.get("throttled"))
    if throttled:  # NVML named a throttle reason during a round: its samples are not at full clocks
        summary["warnings"] = [*summary.get("warnings", []), "throttled"]
    # the machine changed between rounds: never cached
    if len(rounds) > 1 and not baseline_cache.cacheable(rounds):
        summary["warnings"] = [*summary.get("warnings", []), "rounds_disagree"]
    return {
        "source": source,
        "rounds": rounds,
        "summary": summary,
        "wall_summary": kbv_statistics.summarize(wall, resamples=settings.bootstrap_resamples),
        "throttled_rounds": throttled,
    }


def speedups(timing: dict[str, Any], settings: TimingSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """Speedup per baseline (baseline median / candidate median) with ``best`` against the fastest
    baseline (the smallest speedup), and each speedup's bootstrap interval over paired rounds."""
    candidate = timing["candidate"]
    cand_rounds = [r["device_ms"] for r in candidate["rounds"]]
    result: dict[str, Any] = {}
    intervals: dict[str, Any] = {}
    for name, entry in timing["baselines"].items():
        base_rounds = [r["device_ms"] for r in entry["rounds"]]
        # a cached baseline's rounds were timed at another moment, perhaps as many as the candidate's
        paired_rounds = len(base_rounds) == len(cand_rounds)
        ratio = kbv_statistics.paired_speedup if paired_rounds else kbv_statistics.unpaired_speedup
        paired = ratio(base_rounds, cand_rounds, resamples=settings.bootstrap_resamples)
        result[name] = paired.get("speedup")
        intervals[name] = {k: paired.get(k) for k in ("ci95_low", "ci95_high", "per_round")}
        intervals[name]["paired"] = entry.get("source") == "measured" and len(base_rounds) == len(cand_rounds)
    finite = [v for v in result.values() if v is not None]
    result["best"] = min(finite) if finite else None
    return result, intervals


def _compile_worker(ctx: MeasureContext) -> Worker:
    spec = WorkerSpec(
        build_key=f"compile-{ctx.problem.source_sha256}",
        device=ctx.device,
        role="reference",
        visible_devices=visible_devices(ctx.device),
        budget_s=BASELINE_TIMEOUT_S,
    )
    worker = Worker(spec)
    worker.start()
    worker.request(ctx.load)
    worker.request(wire.Build(init_seed=ctx.init_seed))
    return worker


def measure_memory(device: str, reference: Worker, subject: Worker, run: Any, seed: int) -> dict[str, Any]:
    """Peak device memory of one forward call in each worker, PyTorch's allocator and beyond it.

    ``candidate_peak_bytes`` is the allocator's peak plus whatever the candidate's process holds
    outside PyTorch's allocator (raw cudaMalloc in an extension, workspaces it keeps) beyond what
    the baseline's process holds outside it: NVML's per-process figure minus PyTorch's reserved
    bytes, read by the parent. A transient raw allocation freed inside the call is not visible.
    """
    if not device.startswith("cuda"):
        return dict(EMPTY_MEMORY)
    base = run(reference, "original", seed, "fp32", measure_memory=True)["memory"]
    base["process_bytes"] = telemetry.process_memory_bytes(device, reference.pid)
    cand = run(subject, "original", seed, "native", measure_memory=True)["memory"]
    cand["process_bytes"] = telemetry.process_memory_bytes(device, subject.pid)
    outside = max(0, _outside_allocator(cand) - _outside_allocator(base))
    device_growth = max(
        0,
        int(cand.get("device_used_after", 0))
        - int(cand.get("device_used_before", 0))
        - int(cand.get("reserved_growth", 0)),
    )
    cand_peak = int(cand.get("allocator_peak", 0)) + max(outside, device_growth)
    base_peak = int(base.get("allocator_peak", 0))
    return {
        "candidate_peak_bytes": cand_peak,
        "baseline_peak_bytes": base_peak,
        "ratio": cand_peak / base_peak if base_peak else None,
        "candidate_outside_allocator_bytes": max(outside, device_growth),
        "candidate": cand,
        "baseline": base,
        "method": "allocator peak + NVML per-process bytes outside the allocator (beyond the baseline's)",
    }


def _outside_allocator(memory: dict[str, Any]) -> int:
    process = memory.get("process_bytes")
    if process is None:
        return 0
    return max(0, int(process) - int(memory.get("reserved_now", 0)))
