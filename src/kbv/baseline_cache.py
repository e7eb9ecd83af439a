"""The baseline cache: one key for everything a cached baseline timing depends on, and the entries.

A baseline (``eager_fp32``, ``eager_tf32``, ``compile``) measured once for a problem, device,
software and timing settings is reused by later evaluations, but only while a fresh batch timed now
agrees with it (:func:`cache_agreement`) and only when its own rounds agreed (:func:`cacheable`).
The key is built here alone (:func:`baseline_cache_key`, of the parts :func:`key_for` takes from a
measurement's context); entries live under ``kbv.worker.cache_root()/baselines``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbv import sketch as kbv_sketch
from kbv._version import __version__
from kbv.protocol import TimingSettings
from kbv.worker import cache_root

if TYPE_CHECKING:
    from kbv.measure_context import MeasureContext

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
    medians differ by more than ``CACHE_CHECK_FACTOR`` saw a machine that changed under them. (Every
    round sketches every call alike, so no round is set apart any more, as the one round that once
    copied every call's outputs was.)"""
    medians = [statistics.median(r["device_ms"]) for r in rounds if r.get("device_ms")]
    return bool(medians) and min(medians) > 0 and max(medians) / min(medians) <= CACHE_CHECK_FACTOR


def baseline_cache_key(
    problem_sha: str,
    input_spec: dict[str, Any],
    device: dict[str, Any],
    torch_version: str,
    timing_settings: TimingSettings | dict[str, Any],
    baseline_name: str,
    versions: dict[str, Any] | None = None,
) -> str:
    """sha256 of the canonical JSON of everything a cached baseline timing depends on.

    ``device`` must name the GPU (``name``) and the driver (``driver_version``); other keys (CUDA
    version, clocks, MIG profile) are included as given. Every timing setting is included, even
    those that do not change a baseline's samples: a needless cache miss costs a re-measurement,
    a wrong hit costs a wrong speedup. ``versions`` names the other software the measurement ran on
    (``kbv``, whose timing recipe may change between releases, and ``triton`` when importable, which
    the compiled baseline generates kernels with).
    """
    missing = [k for k in ("name", "driver_version") if k not in device]
    if missing:
        raise ValueError(
            f"baseline_cache_key: device needs {missing}; pass e.g. "
            "{'name': 'NVIDIA H200', 'driver_version': '580.65'}"
        )
    settings = (
        dataclasses.asdict(timing_settings)
        if isinstance(timing_settings, TimingSettings)
        else dict(timing_settings)
    )
    payload = {
        "problem_sha": problem_sha,
        "input_spec": input_spec,
        "device": device,
        "torch_version": torch_version,
        "timing_settings": settings,
        "baseline": baseline_name,
        "versions": dict(versions or {}),
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def key_for(ctx: MeasureContext, baseline: str) -> str:
    """The cache key of one baseline measured for ``ctx`` (:func:`baseline_cache_key` of its parts)."""
    device = {
        "name": ctx.device_info.get("name", ""),
        "driver_version": ctx.device_info.get("driver") or ctx.device_info.get("cuda_runtime") or "none",
        "capability": ctx.device_info.get("capability"),
    }
    input_spec = {
        "sizes": ctx.load.sizes,
        "distribution": "original",
        "input_sets": len(ctx.seeds),
    }
    if ctx.precision != "fp32":
        input_spec["precision"] = ctx.precision
    versions: dict[str, Any] = {"kbv": __version__, "triton": _triton_version()}
    if ctx.checks_timed_outputs:  # the sketches lengthen every batch's bracket (not its samples)
        versions["timed_call_sketch"] = f"{kbv_sketch.VECTORS}x{kbv_sketch.VECTORS}-v1"
    return baseline_cache_key(
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


def _path(ctx: MeasureContext, baseline: str) -> Path:
    return cache_root() / "baselines" / f"{key_for(ctx, baseline)}.json"


def read(ctx: MeasureContext, baseline: str) -> dict[str, Any] | None:
    if not ctx.settings.cache_baselines:
        return None
    try:
        entry: dict[str, Any] = json.loads(_path(ctx, baseline).read_text())
        entry["cache_key"] = key_for(ctx, baseline)
        return entry
    except (OSError, ValueError):
        return None


def write(ctx: MeasureContext, baseline: str, entry: dict[str, Any]) -> None:
    if not ctx.settings.cache_baselines:
        return
    path = _path(ctx, baseline)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(path)  # atomic: concurrent evaluations never read half a file
