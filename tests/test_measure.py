"""Baseline caching and the timing section of records, through the real pipeline on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FOUNDATION, RELU

from kbv.api import evaluate_paths


@pytest.fixture()
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sources(record) -> dict[str, str]:
    return {name: entry["source"] for name, entry in record.timing["baselines"].items()}


def test_baselines_are_cached_and_any_key_change_invalidates_them(fresh_cache: Path, tmp_path: Path) -> None:
    first = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert _sources(first) == {"eager_fp32": "measured", "eager_tf32": "measured"}
    assert len(list((fresh_cache / "baselines").glob("*.json"))) == 2
    second = evaluate_paths(RELU, FOUNDATION / "relu_env_spy.py", protocol="verified", device="cpu")
    assert _sources(second) == {"eager_fp32": "cache", "eager_tf32": "cache"}
    assert second.timing["baselines"]["eager_fp32"]["summary"] == first.timing["baselines"]["eager_fp32"]["summary"]
    changed = tmp_path / "more-repeats.toml"
    changed.write_text('name = "more-repeats"\nbase = "verified"\n[timing]\nrepeats = 31\n')
    third = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol=changed, device="cpu")
    assert _sources(third) == {"eager_fp32": "measured", "eager_tf32": "measured"}


def test_caching_can_be_switched_off(fresh_cache: Path, tmp_path: Path) -> None:
    off = tmp_path / "nocache.toml"
    off.write_text('name = "nocache"\nbase = "standard"\n[timing]\ncache_baselines = false\n')
    for _ in range(2):
        record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol=off, device="cpu")
        assert _sources(record) == {"eager_fp32": "measured"}
    assert not (fresh_cache / "baselines").exists()


def test_timing_keeps_raw_samples_rounds_and_the_parent_bracket(fresh_cache: Path) -> None:
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    candidate = record.timing["candidate"]
    assert record.timing["recipe"] == "flush-rotate-events-median"
    assert len(candidate["rounds"]) == 3  # interleaved with the baselines, A B A B A B
    for r in candidate["rounds"]:
        assert r["device_ms"] and r["wall_ms"] and r["parent_bracket_s"] > sum(r["wall_ms"]) / 1000
    assert candidate["summary"]["ci95_low"] <= candidate["summary"]["median"] <= candidate["summary"]["ci95_high"]
    interval = record.timing["speedup_intervals"]["eager_fp32"]
    assert interval["paired"] and len(interval["per_round"]) == 3
    assert record.speedup["best"] == min(record.speedup["eager_fp32"], record.speedup["eager_tf32"])
    assert record.memory["candidate_peak_bytes"] is None  # no device memory to account on the CPU


@pytest.mark.parametrize("protocol", ["standard", "verified"])
def test_a_candidate_that_patches_the_clocks_and_sleeps_gets_its_real_slow_speedup(protocol: str) -> None:
    """kbv's timer holds the clock functions it captured before the candidate was imported, and the
    parent brackets every batch, so patching time.perf_counter buys nothing."""
    hack = Path(__file__).parent / "fixtures" / "candidates" / "hacks" / "timer_tampering.py"
    record = evaluate_paths(RELU, hack, protocol=protocol, device="cpu")
    if protocol == "verified":
        assert record.outcome == "hack_detected"
        assert "timer_tampering" in {f.check for f in record.findings if f.severity == "fail"}
    assert record.speedup["best"] is not None and record.speedup["best"] < 0.2  # it sleeps 1 ms per call
    assert record.timing["candidate"]["summary"]["median"] >= 1.0
