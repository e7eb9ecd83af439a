"""Timing and memory, orchestrated by the trusted parent.

Baselines run in trusted workers that never imported candidate code: ``eager_fp32`` and
``eager_tf32`` in the reference worker (they differ only in two global flags), ``compile`` in a
worker of its own (``torch.compile`` leaves state behind). Baseline and candidate batches alternate
(A B A B ...) so that drift cancels; every batch is bracketed by the parent's monotonic clock and by
NVML readings of clocks, temperature, power and throttling. Baseline measurements are cached under a
key of everything that could change them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kbv import telemetry
from kbv import timing as kbv_timing
from kbv.protocol import TimingSettings
from kbv.worker import Worker, WorkerSpec, cache_root, visible_devices

BASELINE_PRECISION = {"eager_fp32": "fp32", "eager_tf32": "tf32", "compile": "compile"}
BASELINE_TIMEOUT_S = 1800.0
# What a record's memory section says when nothing was measured (the CPU, or an untimed pair).
EMPTY_MEMORY: dict[str, Any] = {"candidate_peak_bytes": None, "baseline_peak_bytes": None, "ratio": None}


class MeasureContext:
    """What measuring one pair needs from the pipeline."""

    def __init__(self, *, problem: Any, device: str, settings: TimingSettings, seeds: list[int], init_seed: int, device_info: dict[str, Any], torch_version: str, load_fields: dict[str, Any]) -> None:
        self.problem = problem
        self.device = device
        self.settings = settings
        self.seeds = seeds
        self.init_seed = init_seed
        self.device_info = device_info
        self.torch_version = torch_version
        self.load_fields = load_fields


def measure_pair(ctx: MeasureContext, reference: Worker, subject: Worker) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (timing, speedup). Baselines come from the cache when their key matches."""
    settings = ctx.settings
    reference.request("build", init_seed=ctx.init_seed)
    subject.request("build", init_seed=ctx.init_seed)
    cached = {name: _cache_read(ctx, name) for name in settings.baselines if name in BASELINE_PRECISION}
    to_measure = [name for name, hit in cached.items() if hit is None]
    compile_worker = _compile_worker(ctx) if "compile" in to_measure else None
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in [*to_measure, "candidate"]}
    baseline_started = time.monotonic()
    baseline_seconds = 0.0
    try:
        for _ in range(max(1, settings.rounds)):
            for name in to_measure:
                worker = compile_worker if name == "compile" else reference
                assert worker is not None
                rounds[name].append(_timed_batch(worker, ctx, BASELINE_PRECISION[name]))
                baseline_seconds += rounds[name][-1]["parent_bracket_s"]
            rounds["candidate"].append(_timed_batch(subject, ctx, "native"))
    finally:
        if compile_worker is not None:
            compile_worker.close()
    if compile_worker is not None:  # starting and compiling the torch.compile baseline counts too
        baseline_seconds = max(baseline_seconds, time.monotonic() - baseline_started - sum(r["parent_bracket_s"] for r in rounds["candidate"]))
    baselines = {}
    for name, hit in cached.items():
        if hit is None:
            baselines[name] = _entry(rounds[name], settings, source="measured")
            _cache_write(ctx, name, baselines[name])
        else:
            baselines[name] = {**hit, "source": "cache"}
    timing = {
        "baseline_seconds": baseline_seconds,
        "recipe": kbv_timing.recipe_name(settings),
        "candidate": _entry(rounds["candidate"], settings, source="measured"),
        "baselines": baselines,
    }
    speedup, timing["speedup_intervals"] = speedups(timing, settings)
    return timing, speedup


def _timed_batch(worker: Worker, ctx: MeasureContext, precision: str) -> dict[str, Any]:
    before = telemetry.gpu_state(ctx.device)
    started = time.monotonic()
    reply = worker.request("time", distribution="original", seeds=ctx.seeds, precision=precision, settings=_settings_dict(ctx.settings))
    bracket_s = time.monotonic() - started
    after = telemetry.gpu_state(ctx.device)
    measurement = dict(reply["measurement"])
    measurement["parent_bracket_s"] = bracket_s
    measurement["gpu_before"], measurement["gpu_after"] = before, after
    throttled = sorted({*((before or {}).get("throttled") or []), *((after or {}).get("throttled") or [])})
    measurement["throttled"] = throttled
    return measurement


def _settings_dict(settings: TimingSettings) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}


def _entry(rounds: list[dict[str, Any]], settings: TimingSettings, source: str) -> dict[str, Any]:
    device = [s for r in rounds for s in r["device_ms"]]
    wall = [s for r in rounds for s in r["wall_ms"]]
    return {
        "source": source,
        "rounds": rounds,
        "summary": kbv_timing.summarize(device, resamples=settings.bootstrap_resamples),
        "wall_summary": kbv_timing.summarize(wall, resamples=settings.bootstrap_resamples),
        "throttled_rounds": sum(1 for r in rounds if r.get("throttled")),
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
    spec = WorkerSpec(build_key=f"compile-{ctx.problem.source_sha256}", device=ctx.device, role="reference", visible_devices=visible_devices(ctx.device), budget_s=BASELINE_TIMEOUT_S)
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
    input_spec = {"sizes": ctx.load_fields.get("sizes"), "distribution": "original", "input_sets": len(ctx.seeds)}
    return kbv_timing.baseline_cache_key(ctx.problem.source_sha256, input_spec, device, ctx.torch_version, ctx.settings, baseline)


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
    device_growth = max(0, int(cand.get("device_used_after", 0)) - int(cand.get("device_used_before", 0)) - int(cand.get("reserved_growth", 0)))
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
