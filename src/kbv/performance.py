"""Timing and memory, orchestrated by the trusted parent.

Baselines run in trusted workers that never imported candidate code: ``eager_fp32`` and
``eager_tf32`` in the reference worker (they differ only in two global flags, which touch only CUDA:
the CPU times ``eager_fp32`` alone), ``compile`` in a
worker of its own (``torch.compile`` leaves state behind). Baseline and candidate batches alternate
(A B A B ...) so that drift cancels; every batch is bracketed by the parent's monotonic clock and by
NVML readings of clocks, temperature, power and throttling. Baseline measurements are cached under a
key of everything that could change them.

The candidate's real timed calls are checked too: in every batch the parent picks a few secret call
indices (and the batch's last call), the worker copies those calls' outputs after they returned,
outside the timed region, and hands them over after the parent's bracket closed; the parent judges
them against the reference for the same timing inputs. A wrong one withdraws the speedup and is the
``timed_call_outputs`` finding (docs/integrity-dynamic.md).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kbv import statistics as kbv_timing
from kbv import telemetry
from kbv._version import __version__
from kbv.protocol import TimingSettings
from kbv.worker import Worker, WorkerFailed, WorkerSpec, cache_root, visible_devices

BASELINE_PRECISION = {"eager_fp32": "fp32", "eager_tf32": "tf32", "compile": "compile"}
BASELINE_TIMEOUT_S = 1800.0
# What a record's memory section says when nothing was measured (the CPU, or an untimed pair).
EMPTY_MEMORY: dict[str, Any] = {"candidate_peak_bytes": None, "baseline_peak_bytes": None, "ratio": None}
#: Secret call indices per candidate batch whose outputs are kept and judged (plus the batch's last call).
KEPT_CALLS_PER_BATCH = 2
#: Bytes of one round's timed-call outputs kept on the device for ``timed_output_check`` (a round of
#: larger outputs keeps fewer calls, chosen in secret).
ROUND_KEEP_BYTES = 2 << 30
#: Trusted batches timed right after the rounds when every candidate round's gap exceeds what the
#: trusted batches known so far allow (``timing_disagreement``'s re-check, ``bracket_recheck``).
RECHECK_BATCHES = 2


class MeasureContext:
    """What measuring one pair needs from the pipeline."""

    def __init__(
        self,
        *,
        problem: Any,
        device: str,
        settings: TimingSettings,
        seeds: list[int],
        init_seed: int,
        device_info: dict[str, Any],
        torch_version: str,
        load_fields: dict[str, Any],
        keep_seed: int | None = None,
        reference_outputs: Callable[[str, int], dict[str, Any]] | None = None,
        judge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None,
        build: Callable[[], None] | None = None,
        check_round: bool = False,
        recheck_brackets: bool = False,
    ) -> None:
        """``keep_seed`` (secret, derived from the evaluation's master seed) picks the timed calls whose
        outputs are judged with ``judge(got, reference_outputs(distribution, seed))``, the pipeline's
        own operations; without all three the timed outputs are not checked. ``build`` builds both
        models with the timing parameters; ``check_round`` also keeps every call of one secret round
        (as many as fit in :data:`ROUND_KEEP_BYTES`) for ``timed_output_check``; ``recheck_brackets``
        times :data:`RECHECK_BATCHES` trusted batches after the rounds when the parent's brackets
        disagree with the candidate's samples (``timing_disagreement`` reads them)."""
        self.problem = problem
        self.device = device
        self.settings = settings
        self.seeds = seeds
        self.init_seed = init_seed
        self.device_info = device_info
        self.torch_version = torch_version
        self.load_fields = load_fields
        self.keep_seed = keep_seed
        self.reference_outputs = reference_outputs
        self.judge = judge
        self.build = build
        self.check_round = check_round
        self.recheck_brackets = recheck_brackets

    @property
    def checks_timed_outputs(self) -> bool:
        return self.keep_seed is not None and self.reference_outputs is not None and self.judge is not None


def measure_pair(
    ctx: MeasureContext, reference: Worker, subject: Worker
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (timing, speedup). Baselines come from the cache when their key matches."""
    settings = ctx.settings
    if ctx.build is None:
        raise ValueError("measure_pair needs MeasureContext.build (both models with the timing parameters)")
    ctx.build()
    names, skipped = measured_baselines(tuple(settings.baselines), ctx.device)
    cached = {name: _cache_read(ctx, name) for name in names}
    cache_checks = _check_cached(ctx, reference, cached, subject)
    to_measure = [name for name, hit in cached.items() if hit is None]
    compile_worker = _compile_worker(ctx) if "compile" in to_measure else None
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in [*to_measure, "candidate"]}
    plan = _KeepPlan(ctx)
    baseline_started = time.monotonic()
    baseline_seconds = 0.0
    try:
        for r in range(max(1, settings.rounds)):
            keep_calls = plan.calls(r)
            for name in to_measure:
                worker = compile_worker if name == "compile" else reference
                assert worker is not None
                # A baseline copies as many outputs as the candidate will (and drops them), so the
                # copies cost both sides alike in the parent's bracket.
                with _others_paused(worker, reference, subject, compile_worker):
                    rounds[name].append(
                        _timed_batch(
                            worker, ctx, BASELINE_PRECISION[name], keep_calls=keep_calls, discard=True
                        )
                    )
                baseline_seconds += rounds[name][-1]["parent_bracket_s"]
            with _others_paused(subject, reference, subject, compile_worker):
                rounds["candidate"].append(_timed_batch(subject, ctx, "native", keep_calls=keep_calls))
            if r == plan.full_round:  # this round copied every call's outputs: say so in each entry
                for name in rounds:
                    rounds[name][-1]["kept_every_call"] = True
            if keep_calls is not None:
                plan.judge(r, subject, rounds["candidate"][-1])
    finally:
        if compile_worker is not None:
            compile_worker.close()
    if compile_worker is not None:  # starting and compiling the torch.compile baseline counts too
        baseline_seconds = max(
            baseline_seconds,
            time.monotonic() - baseline_started - sum(r["parent_bracket_s"] for r in rounds["candidate"]),
        )
    baselines = {}
    for name, hit in cached.items():
        if hit is None:
            baselines[name] = _entry(rounds[name], settings, source="measured")
            if cacheable(rounds[name]):
                _cache_write(ctx, name, baselines[name])
        else:
            baselines[name] = {**hit, "source": "cache"}
        if name in cache_checks:
            baselines[name]["cache_check"] = cache_checks[name]
    recheck = _bracket_recheck(ctx, reference, subject, rounds["candidate"], baselines)
    if recheck is not None:
        baseline_seconds += sum(r["parent_bracket_s"] for r in recheck["rounds"])
    timing = {
        "baseline_seconds": baseline_seconds,
        "recipe": kbv_timing.recipe_name(settings),
        "candidate": _entry(rounds["candidate"], settings, source="measured"),
        "baselines": baselines,
    }
    if skipped:
        timing["baselines_not_measured"] = skipped
    if recheck is not None:
        timing["bracket_recheck"] = recheck
    speedup, timing["speedup_intervals"] = speedups(timing, settings)
    if ctx.checks_timed_outputs:
        timing["timed_outputs"] = checked = plan.sampled_summary()
        if ctx.check_round:
            timing["timed_round"] = plan.round_summary()
        if checked["wrong"]:  # a speedup measured on wrong outputs is no speedup
            speedup = {name: None for name in speedup}
            timing["speedup_intervals"] = {}
            timing["speedup_withdrawn"] = "wrong outputs in the timed calls (timed_call_outputs)"
    return timing, speedup


class _KeepPlan:
    """Which timed calls' outputs are kept and judged, and the verdicts.

    Every candidate batch keeps a few secret call indices and its last call (``timed_call_outputs``);
    with ``check_round`` one secret round keeps every call, or as many as fit in
    :data:`ROUND_KEEP_BYTES`, chosen in secret (``timed_output_check``). The outputs are handed over
    once the parent's bracket of the batch closed and judged at once, batch by batch, so the parent
    never holds more than one batch of them."""

    def __init__(self, ctx: MeasureContext) -> None:
        self.ctx = ctx
        self.picker = random.Random(ctx.keep_seed) if ctx.checks_timed_outputs else None
        rounds = max(1, ctx.settings.rounds)
        self.full_round = (
            self.picker.randrange(rounds) if self.picker is not None and ctx.check_round else None
        )
        self.sampled: dict[int, list[int]] = {}
        self.round_calls: list[int] = []
        self.expected: dict[int, dict[str, Any]] = {}
        self.checked, self.wrong = 0, list[dict[str, Any]]()  # sampled calls and the last call of each batch
        self.round_checked, self.round_wrong = 0, list[dict[str, Any]]()  # every kept call of the full round

    def calls(self, r: int) -> list[int] | None:
        if self.picker is None:
            return None
        repeats = self.ctx.settings.repeats
        sampled = sorted(self.picker.sample(range(repeats), min(KEPT_CALLS_PER_BATCH, repeats)))
        self.sampled[r] = sampled
        if r != self.full_round:
            return sampled
        room = max(1, ROUND_KEEP_BYTES // max(1, self._output_bytes()))
        self.round_calls = sorted(self.picker.sample(range(repeats), min(repeats, room)))
        return sorted(set(sampled) | set(self.round_calls))

    def _output_bytes(self) -> int:
        outputs = self._expected(0)["reference"]["outputs"]
        return sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))

    def _expected(self, input_set: int) -> dict[str, Any]:
        assert self.ctx.reference_outputs is not None
        input_set %= len(self.ctx.seeds)
        if input_set not in self.expected:
            self.expected[input_set] = self.ctx.reference_outputs("original", self.ctx.seeds[input_set])
        return self.expected[input_set]

    def judge(self, r: int, worker: Worker, measurement: dict[str, Any]) -> None:
        """Fetch the batch's kept outputs (after the bracket closed) and judge each one."""
        assert self.ctx.judge is not None
        n = len(measurement["device_ms"])
        outputs, types = _fetch_kept(worker)
        for i in sorted(
            set(self.sampled[r]) | (set(self.round_calls) if r == self.full_round else set()) | {n - 1}
        ):
            if i >= n:
                continue
            verdict = self._verdict(i, outputs, types)
            entry = (
                None
                if verdict.get("passed")
                else {
                    "round": r,
                    "call": i,
                    "input_set": i % len(self.ctx.seeds),
                    "max_abs_err": verdict.get("max_abs_err"),
                    "note": verdict.get("note") or "",
                }
            )
            if i in self.sampled[r] or i == n - 1:
                self.checked += 1
                if entry:
                    self.wrong.append(entry)
            if r == self.full_round and i in self.round_calls:
                self.round_checked += 1
                if entry:
                    self.round_wrong.append(entry)

    def _verdict(self, i: int, outputs: dict[int, list[Any]], types: dict[int, list[str]]) -> dict[str, Any]:
        assert self.ctx.judge is not None
        if i not in outputs or i not in types:
            return {"passed": False, "note": "the worker did not hand over this call's outputs"}
        return self.ctx.judge({"outputs": outputs[i], "types": types[i]}, self._expected(i))

    def sampled_summary(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "wrong": self.wrong,
            "per_batch": KEPT_CALLS_PER_BATCH,
            "method": (
                "secret timed-call indices + the last call of each candidate batch, judged like a "
                "correctness draw"
            ),
        }

    def round_summary(self) -> dict[str, Any]:
        return {
            "round": self.full_round,
            "checked": self.round_checked,
            "wrong": self.round_wrong,
            "of": self.ctx.settings.repeats,
            "budget_bytes": ROUND_KEEP_BYTES,
            "method": (
                "every call of one secret timing round (as many as fit the budget, chosen in secret), "
                "judged like a correctness draw"
            ),
        }


#: A cached baseline is used only while a fresh batch measured now has its median within this
#: factor of the cached median, and a measurement is cached only when its rounds' medians agree
#: within it. An earlier rule (the fresh median inside the cached samples' whole range, widened 2x)
#: let a baseline measured while the machine was busy pass: its range spanned both the busy and the
#: quiet samples, so any fresh median fitted, and the busy median (7.97 ms instead of 0.035 ms on
#: the CPU) made one pair 29.7x against eager_fp32 and 0.13x against eager_tf32, the same code there.
#: Rejecting costs only a re-measurement in interleaved rounds.
CACHE_CHECK_FACTOR = 1.5


def cache_agreement(fresh_ms: list[float], cached: dict[str, Any]) -> dict[str, Any]:
    """Whether a fresh batch's median agrees with a cached baseline's median (``cache_check``)."""
    fresh = statistics.median(fresh_ms) if fresh_ms else None
    samples = [float(x) for r in cached.get("rounds") or [] for x in r.get("device_ms") or []]
    median = statistics.median(samples) if samples else None
    low, high = (median / CACHE_CHECK_FACTOR, median * CACHE_CHECK_FACTOR) if median else (None, None)
    agrees = fresh is not None and low is not None and high is not None and low <= fresh <= high
    return {
        "fresh_median_ms": fresh,
        "cached_median_ms": median,
        "accepted_range_ms": [low, high],
        "accepted": agrees,
    }


def cacheable(rounds: list[dict[str, Any]]) -> bool:
    """A measurement is worth reusing only when its rounds agree with each other: rounds whose
    medians differ by more than ``CACHE_CHECK_FACTOR`` saw a machine that changed under them. The
    round that copied every call's output (``timed_output_check``; baselines copy as much, see
    ``_KeepPlan``) is left out of the comparison: on a tiny CPU problem the copies between calls
    alone slow that round's calls down (3 us calls measured 3x slower), on both sides alike."""
    medians = [
        statistics.median(r["device_ms"])
        for r in rounds
        if r.get("device_ms") and not r.get("kept_every_call")
    ]
    return bool(medians) and min(medians) > 0 and max(medians) / min(medians) <= CACHE_CHECK_FACTOR


def measured_baselines(names: tuple[str, ...], device: str) -> tuple[list[str], dict[str, str]]:
    """The protocol's baselines this device times, and those it leaves out with why. On the CPU
    ``eager_tf32`` runs exactly ``eager_fp32``'s code (the TF32 flags touch only CUDA matmuls and
    cuDNN), so timing it again would only add a noisy duplicate row; the protocol (and its hash)
    stays the same, the record says what was left out."""
    measured = [name for name in names if name in BASELINE_PRECISION]
    skipped: dict[str, str] = {}
    if not device.startswith("cuda") and "eager_tf32" in measured and "eager_fp32" in measured:
        measured.remove("eager_tf32")
        skipped["eager_tf32"] = (
            "same code as eager_fp32 on the CPU (the TF32 flags touch only CUDA and cuDNN)"
        )
    return measured, skipped


def _check_cached(
    ctx: MeasureContext,
    reference: Worker,
    cached: dict[str, dict[str, Any] | None],
    subject: Worker | None = None,
) -> dict[str, Any]:
    """One fresh batch per cached eager baseline; a cache entry that disagrees is dropped (set to
    None in ``cached``, so it is measured again in interleaved rounds and the cache rewritten)."""
    checks: dict[str, Any] = {}
    for name, hit in list(cached.items()):
        if hit is None or name == "compile":  # the compiled baseline needs its own worker: trusted as cached
            continue
        with _others_paused(reference, subject):
            fresh = _timed_batch(reference, ctx, BASELINE_PRECISION[name])
        checks[name] = cache_agreement(list(fresh["device_ms"]), hit)
        # Timed in this evaluation, next to the candidate's rounds: a trusted gap of this moment.
        checks[name]["batch"] = {k: fresh[k] for k in _GAP_FIELDS}
        if not checks[name]["accepted"]:
            cached[name] = None
    return checks


#: What :func:`kbv.statistics.batch_gap_ms` needs of a batch.
_GAP_FIELDS = ("parent_bracket_s", "wall_ms", "device_ms", "warmup_calls")


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
) -> dict[str, Any] | None:
    """When every candidate round's bracket leaves more unexplained than any trusted batch did, time
    :data:`RECHECK_BATCHES` trusted batches now (the candidate stopped), so that
    ``timing_disagreement`` also holds the rounds against what the machine costs an honest batch at
    this moment: cached baselines were timed at another moment, perhaps on a quieter machine. The
    candidate itself is not timed again (it could tell a re-check from a round by counting batches
    and be honest only then); its rounds, whose outputs were checked, are what is judged."""
    if not ctx.recheck_brackets:
        return None
    verdict = kbv_timing.bracket_verdict(candidate_rounds, trusted_batches(baselines), ctx.settings)
    if not verdict["disagrees"]:
        return None
    with _others_paused(reference, subject):
        batches = [_timed_batch(reference, ctx, "fp32") for _ in range(RECHECK_BATCHES)]
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
    keep_calls: list[int] | None = None,
    discard: bool = False,
) -> dict[str, Any]:
    """One timed batch in ``worker``, bracketed by the parent's clock. The worker's samples are
    checked before anything uses them: impossible ones are the worker's failure (for the candidate,
    a ``runtime_error`` outcome), never an exception inside the statistics."""
    before = telemetry.gpu_state(ctx.device)
    extra: dict[str, Any] = (
        {"keep_calls": keep_calls, "discard_kept": discard} if keep_calls is not None else {}
    )
    started = time.monotonic()
    reply = worker.request(
        "time",
        distribution="original",
        seeds=ctx.seeds,
        precision=precision,
        settings=_settings_dict(ctx.settings),
        **extra,
    )
    bracket_s = time.monotonic() - started
    after = telemetry.gpu_state(ctx.device)
    raw = reply.get("measurement")
    problem = (
        kbv_timing.invalid_samples(raw, ctx.settings)
        if isinstance(raw, dict)
        else "no measurement in the reply"
    )
    if problem is not None:
        message = (
            f"the worker reported timing samples no clock produces ({problem}); its timing cannot be used"
        )
        if worker.spec.role != "candidate":
            raise RuntimeError(f"kbv's {precision} baseline: {message}")
        raise WorkerFailed("runtime_error", message)
    assert isinstance(raw, dict)
    measurement = dict(raw)
    measurement["parent_bracket_s"] = bracket_s
    measurement["gpu_before"], measurement["gpu_after"] = before, after
    throttled = sorted({*((before or {}).get("throttled") or []), *((after or {}).get("throttled") or [])})
    measurement["throttled"] = throttled
    return measurement


def _fetch_kept(worker: Worker) -> tuple[dict[int, list[Any]], dict[int, list[str]]]:
    """The outputs the worker kept in its last batch, as the parent's own copies, by call index,
    and their type names. Malformed entries are dropped (they count as not handed over)."""
    reply = worker.request("timed_outputs", out_path=worker.new_path("timed-kept"))
    kept = _by_call(reply.get("kept"))
    flat = worker.receive_outputs(reply.get("outputs"))
    outputs: dict[int, list[Any]] = {}
    position = 0
    for index, names in kept.items():
        outputs[index] = flat[position : position + len(names)]
        position += len(names)
    if position != len(flat):
        return {}, {}
    return outputs, {i: [str(t) for t in names] for i, names in kept.items()}


def _by_call(items: Any) -> dict[int, list[Any]]:
    """``[[call index, [values]], ...]`` from a worker, as {index: values}; malformed entries are dropped."""
    found: dict[int, list[Any]] = {}
    for item in items if isinstance(items, list) else []:
        if (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], int)
            and isinstance(item[1], list)
        ):
            found.setdefault(int(item[0]), item[1])
    return found


def _settings_dict(settings: TimingSettings) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}


def _entry(rounds: list[dict[str, Any]], settings: TimingSettings, source: str) -> dict[str, Any]:
    device = [s for r in rounds for s in r["device_ms"]]
    wall = [s for r in rounds for s in r["wall_ms"]]
    summary = kbv_timing.summarize(device, resamples=settings.bootstrap_resamples)
    throttled = sum(1 for r in rounds if r.get("throttled"))
    if throttled:  # NVML named a throttle reason during a round: its samples are not at full clocks
        summary["warnings"] = [*summary.get("warnings", []), "throttled"]
    if len(rounds) > 1 and not cacheable(rounds):  # the machine changed between rounds: never cached
        summary["warnings"] = [*summary.get("warnings", []), "rounds_disagree"]
    return {
        "source": source,
        "rounds": rounds,
        "summary": summary,
        "wall_summary": kbv_timing.summarize(wall, resamples=settings.bootstrap_resamples),
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
        paired = kbv_timing.paired_speedup(base_rounds, cand_rounds, resamples=settings.bootstrap_resamples)
        result[name] = paired.get("speedup")
        intervals[name] = {k: paired.get(k) for k in ("ci95_low", "ci95_high", "per_round")}
        intervals[name]["paired"] = entry.get("source") == "measured"
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
    worker.request("load", **ctx.load_fields)
    worker.request("build", init_seed=ctx.init_seed)
    return worker


def cache_key(ctx: MeasureContext, baseline: str) -> str:
    device = {
        "name": ctx.device_info.get("name", ""),
        "driver_version": ctx.device_info.get("driver") or ctx.device_info.get("cuda_runtime") or "none",
        "capability": ctx.device_info.get("capability"),
    }
    input_spec = {
        "sizes": ctx.load_fields.get("sizes"),
        "distribution": "original",
        "input_sets": len(ctx.seeds),
    }
    versions = {"kbv": __version__, "triton": _triton_version()}
    return kbv_timing.baseline_cache_key(
        ctx.problem.source_sha256,
        input_spec,
        device,
        ctx.torch_version,
        ctx.settings,
        baseline,
        versions=versions,
    )


def _triton_version() -> str | None:
    """Triton's installed version (the workers share this environment), without importing it."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_path(ctx: MeasureContext, baseline: str) -> Path:
    return cache_root() / "baselines" / f"{cache_key(ctx, baseline)}.json"


def _cache_read(ctx: MeasureContext, baseline: str) -> dict[str, Any] | None:
    if not ctx.settings.cache_baselines:
        return None
    try:
        entry: dict[str, Any] = json.loads(_cache_path(ctx, baseline).read_text())
        entry["cache_key"] = cache_key(ctx, baseline)
        return entry
    except (OSError, ValueError):
        return None


def _cache_write(ctx: MeasureContext, baseline: str, entry: dict[str, Any]) -> None:
    if not ctx.settings.cache_baselines:
        return
    path = _cache_path(ctx, baseline)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(path)  # atomic: concurrent evaluations never read half a file


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
