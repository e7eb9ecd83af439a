"""Baseline caching and the timing section of records, through the real pipeline on the CPU."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FOUNDATION, RELU

from kbv import baseline_cache, correctness, sketch, wire, wire_replies
from kbv import performance as measure
from kbv import statistics as kbv_statistics
from kbv.api import evaluate_paths
from kbv.protocol import CorrectnessSettings, TimingSettings
from kbv.worker import WorkerFailed


@pytest.fixture()
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sources(record) -> dict[str, str]:
    return {name: entry["source"] for name, entry in record.timing["baselines"].items()}


def test_baselines_are_cached_and_any_key_change_invalidates_them(
    fresh_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache's keys are under test here, not its noise checks (3 us calls on a busy 2-core
    # machine differ by more than 1.5x from batch to batch): those have their own tests below.
    monkeypatch.setattr(baseline_cache, "CACHE_CHECK_FACTOR", 1e6)
    first = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert _sources(first) == {"eager_fp32": "measured"}
    assert len(list((fresh_cache / "baselines").glob("*.json"))) == 1  # no eager_tf32 on the CPU
    second = evaluate_paths(RELU, FOUNDATION / "relu_env_spy.py", protocol="verified", device="cpu")
    assert _sources(second) == {"eager_fp32": "cache"}
    fresh = second.timing["baselines"]["eager_fp32"]["cache_check"]["batch"]  # a trusted gap of this moment
    assert fresh["parent_bracket_s"] * 1e3 > sum(fresh["wall_ms"]) and fresh["warmup_calls"] >= 3
    assert (
        second.timing["baselines"]["eager_fp32"]["summary"]
        == first.timing["baselines"]["eager_fp32"]["summary"]
    )
    changed = tmp_path / "more-repeats.toml"
    changed.write_text('name = "more-repeats"\nbase = "verified"\n[timing]\nrepeats = 31\n')
    third = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol=changed, device="cpu")
    assert _sources(third) == {"eager_fp32": "measured"}


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
    assert record.timing["recipe"] == "flush-unseen-events-median"
    # interleaved with the baselines, A B A B A B, then more pairs while a median is imprecise
    precision = record.timing["median_precision"]
    assert 3 <= len(candidate["rounds"]) == precision["rounds"] <= 9
    assert precision["met"] == (precision["worst"] <= 0.02)
    assert precision["met"] or precision["rounds"] == 9 or precision["futile"]
    for r in candidate["rounds"]:
        assert r["device_ms"] and r["wall_ms"] and r["parent_bracket_s"] > sum(r["wall_ms"]) / 1000
        assert len(r["device_ms"]) <= 10
    # the first batch warms up for warmup_seconds, the later ones by warmup_calls alone
    assert [r["warmup_budget_s"] for r in candidate["rounds"]] == [0.05] + [0.0] * (
        len(candidate["rounds"]) - 1
    )
    assert (
        candidate["summary"]["ci95_low"]
        <= candidate["summary"]["median"]
        <= candidate["summary"]["ci95_high"]
    )
    interval = record.timing["speedup_intervals"]["eager_fp32"]
    assert interval["paired"] and len(interval["per_round"]) == len(candidate["rounds"])
    assert record.speedup["best"] == record.speedup["eager_fp32"] and "eager_tf32" not in record.speedup
    assert "eager_tf32" in record.timing["baselines_not_measured"]  # the same code as eager_fp32 on the CPU
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


def test_a_candidate_honest_only_on_the_calls_it_thinks_are_checked_is_caught_on_the_others(
    fresh_cache: Path,
) -> None:
    """read_timed_picks.py looks for the checked calls' indices in its own worker's ``time`` request
    and is honest on those (and on the batch's last call) only; no request names a call any more,
    so it returns the previous call's output on nearly every timed call, and the calls judged (three
    a round, picked after the batch from a secret, and the phase's first draw) find it."""
    hack = Path(__file__).parent / "fixtures" / "candidates" / "hacks" / "read_timed_picks.py"
    record = evaluate_paths(RELU, hack, protocol="verified", device="cpu")
    assert record.outcome == "hack_detected"
    (finding,) = [f for f in record.findings if f.check == "timed_call_outputs"]
    assert finding.severity == "fail" and "real timed calls returned wrong outputs" in finding.detail
    assert "input set" in finding.detail and "tolerance" in finding.detail  # the evidence: where, how far
    checked = record.timing["timed_outputs"]
    rounds = record.timing["candidate"]["rounds"]
    assert checked["timed_calls"] == sum(len(r["device_ms"]) for r in rounds)
    assert checked["checked"] == sum(len(calls) for calls in checked["judged_calls"].values())
    assert len(checked["judged_calls"]) == len(rounds)
    assert 3 * len(rounds) <= checked["checked"] <= 3 * len(rounds) + 1
    assert checked["wrong_calls"] >= 1
    assert record.speedup["best"] is None and record.timing["speedup_withdrawn"]


# ------------------------------------------------------------------------------------------
# The parent's side of a timed batch, with fake workers (no processes)
# ------------------------------------------------------------------------------------------


class _FakeWorker:
    """Answers ``time`` with a canned measurement and, when the request asks for sketches, the
    sketches of canned outputs: ``outputs(i)`` is what timed call ``i`` returned (None: no sketch)."""

    def __init__(self, tmp_path: Path, role: str, device_ms: list, outputs=None) -> None:
        self.spec = SimpleNamespace(role=role, device="cpu")
        self.tmp_path, self.device_ms, self.outputs = tmp_path, device_ms, outputs
        self.requests: list[wire.Request] = []

    def scheduler_ns(self) -> None:  # no process to read: the batch records no counts
        return None

    def request(self, request: wire.Request):
        self.requests.append(request)
        measurement = {
            "recipe": "r",
            "device_ms": self.device_ms,
            "wall_ms": list(self.device_ms),
            "warmup_calls": 3,
        }
        sketches = None
        if isinstance(request, wire.Time) and request.sketch is not None and self.outputs is not None:
            sketches = [
                sketch.sketch_outputs([self.outputs(i)], request.sketch, torch.device("cpu"))
                for i in range(len(self.device_ms))
                if self.outputs(i) is not None
            ]
        return wire_replies.TimeReply(measurement=measurement, sketches=sketches)


def _mctx(**extra) -> measure.MeasureContext:
    problem = SimpleNamespace(source_sha256="abc")
    return measure.MeasureContext(
        problem=problem,
        device="cpu",
        settings=TimingSettings(repeats=4, input_sets=2),
        seeds=[11, 22],
        init_seed=1,
        device_info={"name": "cpu"},
        torch_version="2.x",
        load=wire.Load(role="reference", device="cpu", problem_source="", init_seed=1),
        **extra,
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_an_impossible_candidate_sample_is_the_candidates_runtime_error(tmp_path: Path, bad: float) -> None:
    worker = _FakeWorker(tmp_path, "candidate", [1.0, bad, 1.0])
    with pytest.raises(WorkerFailed) as failed:
        measure._timed_batch(worker, _mctx(), "native")
    assert failed.value.kind == "runtime_error" and "no clock produces" in failed.value.message


def test_an_impossible_baseline_sample_is_a_harness_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="baseline"):
        measure._timed_batch(_FakeWorker(tmp_path, "reference", [0.0]), _mctx(), "fp32")


#: The truth of each timing input set (seed 11 and 22), as the pipeline's expected outputs hold it.
_TRUTHS = {
    11: torch.linspace(-1.0, 1.0, 64, dtype=torch.float64),
    22: torch.linspace(3.0, -2.0, 64, dtype=torch.float64),
}


def _timed_reference(asked: list[int]):
    def timed_reference(seed: int) -> dict:
        asked.append(seed)
        truth = _TRUTHS[seed]
        expected = {
            "reference": {"outputs": [torch.empty(64, device="meta")]},
            "truth": {"outputs": [truth]},
            "baseline_err": {"outputs": [{"kind": "float", "elementwise": 1e-7, "norm": 1e-7}]},
        }
        return correctness.timed_reference(expected, CorrectnessSettings(mode="error_model"))

    return timed_reference


def test_one_timing_input_sets_reference_is_held_at_a_time() -> None:
    """The reference's tensors of one timing input set are dropped before the next set's are
    computed (all sets at once held 56 GB in the parent on the H200 for an 8.5 GB output)."""
    import weakref

    held: list[weakref.ref] = []
    alive_when_asked: list[int] = []

    def timed_reference(seed: int) -> dict:
        alive_when_asked.append(sum(ref() is not None for ref in held))
        truth = _TRUTHS[seed].clone()  # the plan's only reference to it, as from a worker
        held.append(weakref.ref(truth))
        expected = {
            "reference": {"outputs": [torch.empty(64, device="meta")]},
            "truth": {"outputs": [truth]},
            "baseline_err": {"outputs": [{"kind": "float", "elementwise": 1e-7, "norm": 1e-7}]},
        }
        return correctness.timed_reference(expected, CorrectnessSettings(mode="error_model"))

    plan = measure._SketchPlan(_mctx(sketch_seed=7, timed_reference=timed_reference))
    assert alive_when_asked == [0, 0]
    assert len(plan.targets) == len(plan.round_seeds) and all(len(t) == 2 for t in plan.targets)
    assert plan.omegas == [sketch.omega_for(float(_TRUTHS[11].pow(2).mean().sqrt()))]  # the first set's


def test_every_timed_call_is_judged_against_its_own_input_set(tmp_path: Path) -> None:
    """Call i used input set i % 2; call 3 returns input set 0's answer (a cached output): it alone
    is wrong."""
    asked: list[int] = []
    ctx = _mctx(sketch_seed=7, timed_reference=_timed_reference(asked))
    plan = measure._SketchPlan(ctx)
    assert sorted(asked) == [11, 22]  # once per timing input set, before any batch
    right = lambda i: _TRUTHS[[11, 22][i % 2]].float()  # noqa: E731
    worker = _FakeWorker(tmp_path, "candidate", [1.0] * 4, outputs=lambda i: right(0) if i == 3 else right(i))
    batch = measure._timed_batch(worker, ctx, "native", sketch=plan.spec(0))
    plan.judge(0, batch)
    assert "sketches" not in batch  # the record keeps the samples, not the sketches
    summary = plan.summary()
    assert summary["checked"] == 4 and summary["wrong_calls"] == 1
    (wrong,) = summary["wrong"]
    assert (wrong["round"], wrong["call"], wrong["input_set"]) == (0, 3, 1) and wrong["ratio"] > 1e3
    assert summary["max_ratio"] < 0.1 and summary["limit"] == correctness.SKETCH_LIMIT
    silent = _FakeWorker(tmp_path, "candidate", [1.0] * 4, outputs=lambda i: right(i) if i < 2 else None)
    plan.judge(0, measure._timed_batch(silent, ctx, "native", sketch=plan.spec(0)))
    notes = [(w["call"], w["note"]) for w in plan.summary()["wrong"][1:]]
    assert notes == [(i, "the worker reported no sketch of this call's outputs") for i in (2, 3)]


def test_the_request_names_no_call_and_is_the_same_for_the_candidate_and_the_baselines(
    tmp_path: Path, fresh_cache: Path
) -> None:
    """What the candidate's worker is asked to do in a round is exactly what the baseline's worker is
    asked (but for the precision): a seed and the map's frequencies, no call index. Each round has
    its own seed."""
    ctx = _mctx(sketch_seed=99, timed_reference=_timed_reference([]), build=lambda: None)
    ctx.settings = TimingSettings(repeats=4, input_sets=2, rounds=3, cache_baselines=False)
    right = lambda i: _TRUTHS[[11, 22][i % 2]].float()  # noqa: E731
    reference = _FakeWorker(tmp_path, "reference", [1.0] * 4, outputs=right)
    candidate = _FakeWorker(tmp_path, "candidate", [1.0] * 4, outputs=right)
    for worker in (reference, candidate):
        worker.paused = contextlib.nullcontext  # type: ignore[attr-defined]
    timing, speedup = measure.measure_pair(ctx, reference, candidate)  # type: ignore[arg-type]
    to_candidate = [r for r in candidate.requests if isinstance(r, wire.Time)]
    to_reference = [r for r in reference.requests if isinstance(r, wire.Time)]
    assert len(to_candidate) == len(to_reference) == 3
    for cand, base in zip(to_candidate, to_reference, strict=True):
        assert cand.sketch is not None and set(cand.sketch) == {"seed", "omega"}
        assert cand.unseen_seeds is None
        assert replace(cand, precision="") == replace(base, precision="")
    assert len({r.sketch["seed"] for r in to_candidate if r.sketch}) == 3
    assert timing["timed_outputs"]["checked"] == 12 and not timing["timed_outputs"]["wrong"]
    calibration = timing["timed_outputs"]["baselines"]["eager_fp32"]
    assert calibration["checked"] == 12 and calibration["wrong"] == 0 and calibration["max_ratio"] < 0.1
    assert speedup["best"] is not None


def test_cache_key_names_the_kbv_and_triton_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _mctx()
    key = baseline_cache.key_for(ctx, "eager_fp32")
    monkeypatch.setattr(baseline_cache, "__version__", "9.9.9")
    assert baseline_cache.key_for(ctx, "eager_fp32") != key
    monkeypatch.undo()
    monkeypatch.setattr(baseline_cache, "_triton_version", lambda: "0.0.1-test")
    assert baseline_cache.key_for(ctx, "eager_fp32") != key


class _PausableWorker(_FakeWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paused_batches = 0

    @contextlib.contextmanager
    def paused(self):
        self.paused_batches += 1
        yield


def _batch(bracket_s: float) -> dict:  # 4 calls of 1 ms + the 50 ms warm-up: 54 ms accounted
    return {"parent_bracket_s": bracket_s, "wall_ms": [1.0] * 4, "device_ms": [1.0] * 4, "warmup_calls": 3}


def test_disagreeing_rounds_get_trusted_batches_timed_beside_them_and_agreeing_ones_none(
    tmp_path: Path,
) -> None:
    """The re-check times trusted batches in the reference worker with the candidate stopped, only
    when every candidate round left more of its bracket unexplained than any trusted batch did
    (the cache check's fresh batch counts as one); the candidate itself is never timed again."""
    ctx = _mctx(recheck_brackets=True)
    cached = {"eager_fp32": {"source": "cache", "rounds": [_batch(0.060)] * 3}}
    reference = _PausableWorker(tmp_path, "reference", [1.0] * 4)
    subject = _PausableWorker(tmp_path, "candidate", [1.0] * 4)
    assert measure._bracket_recheck(ctx, reference, subject, [_batch(0.062)] * 3, cached) is None
    assert reference.requests == []
    recheck = measure._bracket_recheck(ctx, reference, subject, [_batch(0.500)] * 3, cached)
    assert recheck is not None and len(recheck["rounds"]) == measure.RECHECK_BATCHES
    assert [r.op for r in reference.requests] == ["time"] * measure.RECHECK_BATCHES
    assert all(getattr(r, "precision", None) == "fp32" for r in reference.requests)
    assert subject.requests == [] and subject.paused_batches == 1
    assert all(r["parent_bracket_s"] >= 0 and r["wall_ms"] == [1.0] * 4 for r in recheck["rounds"])
    busy_check = {"eager_fp32": {**cached["eager_fp32"], "cache_check": {"batch": _batch(0.100)}}}
    assert measure.trusted_batches(busy_check)[-1] == _batch(0.100)
    assert measure._bracket_recheck(ctx, reference, subject, [_batch(0.095)] * 3, busy_check) is None
    off = _mctx()  # the protocol does not run timing_disagreement: nothing to re-check for
    assert measure._bracket_recheck(off, reference, subject, [_batch(0.500)] * 3, cached) is None


def test_a_machine_that_gets_busy_after_the_cache_check_does_not_reject_an_honest_candidate(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit's false rejection, through real workers: the baseline is cached on a quiet machine,
    then from the candidate's first timed batch on every batch waits 200 ms more inside the parent's
    bracket (the machine got busy after the cache check). Held against the cached gaps every round
    reads as a >100x lie; the re-check's trusted batches wait as long, so the candidate passes with
    an info finding and its measured speedup."""
    import time

    from kbv.worker import Worker

    # the cached entry is used whatever the noise
    monkeypatch.setattr(baseline_cache, "CACHE_CHECK_FACTOR", 1e6)
    evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    real, busy = Worker.request, [False]

    def request(self: Worker, request: wire.Request):
        if isinstance(request, wire.Time):
            busy[0] = busy[0] or self.spec.role == "candidate"
            if busy[0]:
                time.sleep(0.2)
        return real(self, request)

    monkeypatch.setattr(Worker, "request", request)
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert _sources(record) == {"eager_fp32": "cache"}
    found = [f for f in record.findings if f.check == "timing_disagreement"]
    assert record.outcome == "passed" and [f.severity for f in found] == ["info"], found
    assert len(record.timing["bracket_recheck"]["rounds"]) == measure.RECHECK_BATCHES
    assert record.speedup["best"] == record.speedup["eager_fp32"] > 0.2  # the measured one, uncorrected


def test_a_throttled_round_is_named_in_the_timing_warnings() -> None:
    from kbv.performance import _entry
    from kbv.protocol import TimingSettings

    settings = TimingSettings(bootstrap_resamples=50)
    calm = {"device_ms": [1.0] * 10, "wall_ms": [1.1] * 10, "throttled": []}
    hot = {**calm, "throttled": ["hw_thermal_slowdown"]}
    assert "throttled" not in _entry([calm, calm], settings, "measured")["summary"]["warnings"]
    entry = _entry([calm, hot], settings, "measured")
    assert "throttled" in entry["summary"]["warnings"] and entry["throttled_rounds"] == 1


def test_a_cached_baseline_that_a_fresh_batch_contradicts_is_measured_again(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A baseline cached while the machine was busy (or edited on disk by a candidate) must not
    inflate later speedups: here every cached sample is made 100x slower. (The factor is widened to
    10x and every measurement cached, so that batch-to-batch noise of 3 us calls on a busy 2-core
    machine cannot decide the test: the 100x edit is what must be caught.)"""
    import json

    monkeypatch.setattr(baseline_cache, "CACHE_CHECK_FACTOR", 10.0)
    monkeypatch.setattr(baseline_cache, "cacheable", lambda rounds: True)

    evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    for path in (fresh_cache / "baselines").glob("*.json"):
        entry = json.loads(path.read_text())
        for r in entry["rounds"]:
            r["device_ms"] = [x * 100 for x in r["device_ms"]]
        entry["summary"]["median"] *= 100
        path.write_text(json.dumps(entry))
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert _sources(record) == {"eager_fp32": "measured"}
    check = record.timing["baselines"]["eager_fp32"]["cache_check"]
    assert check["accepted"] is False and check["fresh_median_ms"] < check["accepted_range_ms"][0]
    assert record.speedup["best"] < 10
    again = evaluate_paths(
        RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu"
    )  # rewritten: usable again
    assert _sources(again) == {"eager_fp32": "cache"}
    assert again.timing["baselines"]["eager_fp32"]["cache_check"]["accepted"] is True


def _cached(*round_medians: float) -> dict:
    return {"rounds": [{"device_ms": [m] * 10} for m in round_medians]}


def test_a_busy_cached_baseline_is_rejected_although_its_range_spans_the_fresh_median() -> None:
    """The 29.7x / 0.13x pair: a baseline cached while the machine was busy (two rounds at 8 ms,
    one quiet round at 0.035 ms) has a range that holds any quiet fresh median; the old rule (fresh
    median inside the samples' range widened 2x) accepted it and used the busy median 7.97 ms."""
    busy = _cached(7.97, 8.1, 0.035)
    check = baseline_cache.cache_agreement([0.035, 0.036, 0.034], busy)
    assert check["accepted"] is False and check["cached_median_ms"] == pytest.approx(7.97)
    quiet = _cached(0.035, 0.036, 0.034)
    assert baseline_cache.cache_agreement([0.037, 0.036, 0.038], quiet)["accepted"] is True
    assert baseline_cache.cache_agreement([], quiet)["accepted"] is False


def test_only_a_measurement_whose_rounds_agree_is_cached() -> None:
    assert baseline_cache.cacheable(_cached(0.035, 0.036, 0.034)["rounds"])
    assert not baseline_cache.cacheable(_cached(7.97, 8.1, 0.035)["rounds"])
    assert not baseline_cache.cacheable([])


def test_the_cpu_times_eager_tf32_not_at_all_and_the_gpu_times_both() -> None:
    both = ("eager_fp32", "eager_tf32")
    names, skipped = measure.measured_baselines(both, "cpu")
    assert names == ["eager_fp32"] and "same code" in skipped["eager_tf32"]
    assert measure.measured_baselines(both, "cuda:1") == (["eager_fp32", "eager_tf32"], {})
    assert measure.measured_baselines(("eager_tf32",), "cpu") == (
        ["eager_tf32"],
        {},
    )  # alone it is the baseline


def test_timing_input_sets_shrink_only_for_inputs_too_large_to_rotate() -> None:
    from kbv.evaluation import TIMING_SETS_BYTES, timing_input_sets

    assert timing_input_sets(3, [4096 * 4096, 4096 * 4096]) == 3  # 128 MiB per set
    assert timing_input_sets(3, [1_600_000_000]) == 1  # 6.4 GB in + 6.4 GB out per set
    assert timing_input_sets(3, [TIMING_SETS_BYTES // 16]) == 2  # two sets of a quarter each fit
    assert timing_input_sets(3, []) == 3  # no floating input: nothing to size


def _series(*rounds: list[float]) -> list[dict]:
    return [{"device_ms": list(r)} for r in rounds]


def test_rounds_go_on_until_every_timed_series_is_precise_or_max_rounds() -> None:
    s = TimingSettings(repeats=10, rounds=3, max_rounds=9, median_precision=0.02)
    stable, noisy = [1.0, 1.001, 0.999] * 3 + [1.0], [1.0, 3.0, 0.5, 2.5, 1.5, 4.0, 0.8, 2.2, 1.1, 3.3]
    # fewer than ``rounds``: always another
    assert measure._another_round(
        s, {"candidate": _series(stable, stable), "eager_fp32": _series(stable, stable)}
    )
    three = {"candidate": _series(stable, stable, stable), "eager_fp32": _series(stable, stable, stable)}
    assert not measure._another_round(s, three)  # all precise after three
    noisy_baseline = {**three, "eager_fp32": _series(noisy, noisy, noisy)}
    assert measure._another_round(s, noisy_baseline)  # a noisy baseline asks for more
    nine = {"candidate": _series(*[noisy] * 9)}
    assert not measure._another_round(s, nine)  # but never beyond max_rounds
    assert not measure._another_round(TimingSettings(rounds=3), {"candidate": _series(noisy, noisy, noisy)})
    reached = measure._precision_reached(s, noisy_baseline)
    assert reached["rounds"] == 3 and not reached["met"] and reached["worst"] > 0.02


def _spread(width: float) -> list[float]:
    return [1 - width + 2 * width * i / 9 for i in range(10)]


def test_rounds_stop_once_the_precision_target_is_out_of_reach() -> None:
    """``stop_when_futile``: after ``rounds``, a worst half-width h projects r * (h / p)**2 rounds to
    reach the target p; more than ``max_rounds`` and no round is added. Within reach, or without the
    setting, the rounds go on as before, and the record says why they stopped."""
    futile = TimingSettings(repeats=10, rounds=3, max_rounds=9, median_precision=0.02, stop_when_futile=True)
    patient = replace(futile, stop_when_futile=False)
    near, far = _spread(0.08), _spread(0.2)
    near_h = kbv_statistics.median_precision(near * 3)
    far_h = kbv_statistics.median_precision(far * 3)
    assert near_h > 0.02 and 3 * (near_h / 0.02) ** 2 <= 9 < 3 * (far_h / 0.02) ** 2
    within = {"candidate": _series(near, near, near)}
    out_of_reach = {"candidate": _series(near, near, near), "eager_fp32": _series(far, far, far)}
    assert measure._another_round(futile, within)  # the target is still within reach
    assert not measure._another_round(futile, out_of_reach)  # the worst series cannot reach it
    assert measure._another_round(patient, out_of_reach)  # without the setting: up to max_rounds
    assert measure._another_round(futile, {"candidate": _series(far, far)})  # never before ``rounds``
    reached = measure._precision_reached(futile, out_of_reach)
    assert reached["futile"] and not reached["met"] and reached["rounds"] == 3
    assert reached["projected_rounds"] > 9
    assert not measure._precision_reached(futile, {"candidate": _series(*[far] * 9)})["futile"]
    assert "futile" not in measure._precision_reached(patient, out_of_reach)


def _bracketed(bracket_ms: float) -> dict:
    """A batch of ten 1 ms calls, no warm-up, that the parent bracketed at ``bracket_ms``."""
    return {
        "device_ms": [1.0] * 10,
        "wall_ms": [1.0] * 10,
        "warmup_calls": 0,
        "warmup_budget_s": 0.0,
        "parent_bracket_s": bracket_ms / 1e3,
    }


def test_the_futility_stop_waits_while_every_round_disagrees_with_the_bracket() -> None:
    """``timing_disagreement`` fails only when every round disagrees, so while every candidate round
    so far has disagreed, the rounds a futile precision would skip are timed: more chances for an
    honest candidate's noise to agree, and more trusted batches for its allowance. Once one round
    agrees the check cannot fail, and the futility stop applies as to any candidate."""
    futile = TimingSettings(repeats=10, rounds=3, max_rounds=9, median_precision=0.02, stop_when_futile=True)
    trusted = [_bracketed(11.0)] * 3
    agreeing = {"candidate": [_bracketed(11.0)] * 3, "eager_fp32": trusted}
    one_off = {"candidate": [_bracketed(11.0), _bracketed(40.0), _bracketed(11.0)], "eager_fp32": trusted}
    every_round = {"candidate": [_bracketed(40.0)] * 3, "eager_fp32": trusted}
    assert measure._bracket_settled(futile, agreeing, {})  # every round within the allowance
    assert measure._bracket_settled(futile, one_off, {})  # one round 29 ms over, two agree: settled
    assert not measure._bracket_settled(futile, every_round, {})  # every round 29 ms over
    # a cached baseline's fresh check batch is a trusted batch too
    checked = {"eager_fp32": {"accepted": True, "batch": _bracketed(11.0)}}
    assert not measure._bracket_settled(futile, {"candidate": [_bracketed(40.0)] * 3}, checked)
    far = _spread(0.2)
    out_of_reach = {"candidate": _series(far, far, far)}
    assert not measure._another_round(futile, out_of_reach, bracket_settled=True)
    assert measure._another_round(futile, out_of_reach, bracket_settled=False)
    assert not measure._another_round(futile, {"candidate": _series(*[far] * 9)}, bracket_settled=False)


def test_a_round_that_agrees_keeps_agreeing_as_trusted_batches_are_added() -> None:
    """Why one agreeing round settles the bracket: its allowance is the trusted batches' largest gap,
    which more trusted batches can only widen."""
    settings = TimingSettings(repeats=10, rounds=3, max_rounds=9, median_precision=0.02)
    rounds = [_bracketed(12.5), _bracketed(40.0)]
    few = kbv_statistics.bracket_verdict(rounds, [_bracketed(11.0)], settings)
    more = kbv_statistics.bracket_verdict(
        rounds, [_bracketed(11.0), _bracketed(9.0), _bracketed(14.0)], settings
    )
    assert [r["disagrees"] for r in few["rounds"]] == [False, True]
    assert not more["rounds"][0]["disagrees"] and more["overhead_ms"] >= few["overhead_ms"]


def test_a_cached_baseline_pairs_with_a_candidate_timed_for_more_rounds() -> None:
    s = TimingSettings(repeats=3, rounds=3, max_rounds=9, median_precision=0.02, bootstrap_resamples=200)
    cached = {"source": "cache", "rounds": _series([2.0, 2.0, 2.0], [2.0, 2.1, 2.0], [2.0, 1.9, 2.0])}
    measured = {"source": "measured", "rounds": _series(*[[4.0, 4.0, 4.0]] * 5)}
    timing = {
        "candidate": {"rounds": _series(*[[1.0, 1.0, 1.0]] * 5)},
        "baselines": {"eager_fp32": cached, "eager_tf32": measured},
    }
    speedup, intervals = measure.speedups(timing, s)
    assert speedup == {"eager_fp32": 2.0, "eager_tf32": 4.0, "best": 2.0}
    assert intervals["eager_fp32"]["per_round"] == [] and not intervals["eager_fp32"]["paired"]
    assert intervals["eager_tf32"]["per_round"] == [4.0] * 5 and intervals["eager_tf32"]["paired"]


def test_a_round_beyond_the_first_ones_gets_the_references_sketches_when_it_starts(tmp_path: Path) -> None:
    """Rounds timed only until precise are sketched when they start, from the reference's outputs
    asked for again; each has a seed of its own, so a sketch replayed from an earlier round is
    wrong there."""
    asked: list[int] = []
    settings = TimingSettings(repeats=4, input_sets=2, rounds=1, max_rounds=3, median_precision=0.02)
    ctx = _mctx(sketch_seed=7, timed_reference=_timed_reference(asked))
    ctx.settings = settings
    plan = measure._SketchPlan(ctx)
    assert len(plan.round_seeds) == 3 and len(set(plan.round_seeds)) == 3
    assert len(plan.targets) == 1 and sorted(asked) == [11, 22]
    right = lambda i: _TRUTHS[[11, 22][i % 2]].float()  # noqa: E731
    spec = plan.spec(2)  # rounds 1 and 2 sketched now, one reference per input set asked again
    assert (
        len(plan.targets) == 3 and sorted(asked) == [11, 11, 22, 22] and spec["seed"] == plan.round_seeds[2]
    )
    plan.judge(
        2,
        measure._timed_batch(
            _FakeWorker(tmp_path, "candidate", [1.0] * 4, outputs=right), ctx, "native", sketch=spec
        ),
    )
    assert plan.summary()["wrong_calls"] == 0
    # sketches taken under round 0's seed do not pass as round 1's
    replayed = _FakeWorker(tmp_path, "candidate", [1.0] * 4, outputs=right)
    batch = measure._timed_batch(replayed, ctx, "native", sketch=plan.spec(0))
    plan.judge(1, batch)
    assert plan.summary()["wrong_calls"] == 4


def test_a_baseline_much_slower_than_another_after_the_first_round_is_timed_no_further() -> None:
    s = TimingSettings(repeats=3, rounds=3, dominated_factor=1.5)
    first = {"eager_fp32": _series([10.0, 10.2, 9.9]), "eager_tf32": _series([4.0, 4.1, 3.9])}
    stopped = measure._dominated(s, first)
    assert set(stopped) == {"eager_fp32"} and "eager_tf32" in stopped["eager_fp32"]
    close = {"eager_fp32": _series([5.0, 5.1, 4.9]), "eager_tf32": _series([4.0, 4.1, 3.9])}
    assert measure._dominated(s, close) == {}  # 1.25x: either could be the best, both go on
    assert measure._dominated(TimingSettings(rounds=3), first) == {}  # off unless the protocol sets it
    assert (
        measure._dominated(s, {"eager_fp32": first["eager_fp32"]}) == {}
    )  # one baseline: nothing to compare
    # its one round against the candidate's three: unpaired, the best is the one still timed
    timing = {
        "candidate": {"rounds": _series(*[[2.0, 2.0, 2.0]] * 3)},
        "baselines": {
            "eager_fp32": {"source": "measured", "rounds": first["eager_fp32"]},
            "eager_tf32": {"source": "measured", "rounds": _series(*[[4.0, 4.0, 4.0]] * 3)},
        },
    }
    speedup, intervals = measure.speedups(timing, TimingSettings(bootstrap_resamples=100))
    assert speedup["best"] == speedup["eager_tf32"] == 2.0 and speedup["eager_fp32"] > 4.9
    assert not intervals["eager_fp32"]["paired"] and intervals["eager_tf32"]["paired"]


class _PrecisionWorker(_FakeWorker):
    """A fake worker whose batches take ``ms[precision]`` per call; it can be paused."""

    def __init__(self, tmp_path: Path, role: str, ms: dict[str, float]) -> None:
        super().__init__(tmp_path, role, [1.0] * 3)
        self.ms = ms

    def request(self, request):
        self.device_ms = [self.ms[request.precision]] * 3
        return super().request(request)

    @contextlib.contextmanager
    def paused(self):
        yield


def test_the_rounds_time_the_fp32_baseline_once_when_tf32_is_much_faster(tmp_path: Path) -> None:
    reference = _PrecisionWorker(tmp_path, "reference", {"fp32": 10.0, "tf32": 4.0})
    subject = _PrecisionWorker(tmp_path, "candidate", {"native": 4.0})
    ctx = _mctx(build=lambda: None)
    ctx.device = "cuda"  # both eager baselines are timed there (no account of the reference's operators)
    ctx.settings = TimingSettings(
        repeats=3,
        rounds=3,
        baselines=("eager_fp32", "eager_tf32"),
        dominated_factor=1.5,
        cache_baselines=False,
        bootstrap_resamples=100,
    )
    timing, speedup = measure.measure_pair(ctx, reference, subject)  # type: ignore[arg-type]
    asked = [r.precision for r in reference.requests if isinstance(r, wire.Time)]
    assert asked == ["fp32", "tf32", "tf32", "tf32"]
    assert (
        len(timing["baselines"]["eager_fp32"]["rounds"]) == 1 and "eager_fp32" in timing["baselines_stopped"]
    )
    assert len(timing["baselines"]["eager_tf32"]["rounds"]) == len(timing["candidate"]["rounds"]) == 3
    assert speedup == {"eager_fp32": 2.5, "eager_tf32": 1.0, "best": 1.0}
