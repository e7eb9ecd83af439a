"""Parent-side dynamic checks on fake sessions (no workers): decisions from observations."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import peak_rss_rise

from kbv import wire, wire_replies
from kbv.child import probes as _probes
from kbv.integrity import dynamic
from kbv.integrity._registry import list_checks
from kbv.integrity.dynamic import outputs as outputs_mod
from kbv.protocol import VERIFIED
from kbv.worker import WorkerFailed


def _ctx(**session_fields) -> dynamic.DynamicContext:
    base = {"device": "cpu", "correct": True, "protocol": VERIFIED, "timing": {}, "speedup": {"best": None}}
    base.update(session_fields)
    return dynamic.DynamicContext(SimpleNamespace(**base))


def _observation(**candidate) -> dict:
    act = {"python_threads": 1, "os_threads": 4, "processes": 0}
    flags = dict(
        dynamic.__dict__.get("_FLAGS_EXAMPLE", {"cuda.matmul.allow_tf32": False, "cudnn.benchmark": False})
    )
    honest = {
        "types": ["torch.Tensor"],
        "aliasing": [],
        "input_checksums_before": [{"sum": 1.0, "sha": "a"}],
        "input_checksums_after": [{"sum": 1.0, "sha": "a"}],
        "activity": {"before": act, "after": act, "after_delay": act},
        "threads_started": 0,
        "threads_alive_at_return": 0,
        "flags": {"start": flags, "before_call": flags, "after_call": flags},
        "identities_changed": [],
        "harness_changed": [],
        "outputs": None,
    }
    return {
        "candidate": wire_replies.ProbeObserveReply(**{**honest, **candidate}),
        "reference": wire_replies.ProbeObserveReply(**honest),
        "delay_s": 0.02,
        "late_diff": 0.0,
        "first_tensors": [True],
    }


def _with_observation(obs: dict) -> dynamic.DynamicContext:
    ctx = _ctx()
    ctx._cache["observe"] = obs
    return ctx


def test_every_dynamic_check_is_ordered_and_documented() -> None:
    names = {c.name for c in list_checks("dynamic")}
    assert names == set(dynamic.dynamic_order())
    assert all(c.doc for c in list_checks("dynamic"))


def test_honest_observation_gives_no_findings() -> None:
    ctx = _with_observation(_observation())
    for check in (
        dynamic.check_output_type,
        dynamic.check_output_aliases_input,
        dynamic.check_input_mutation,
        dynamic.check_background_work,
        dynamic.check_global_flags,
        dynamic.check_timer_tampering,
        dynamic.check_harness_patched,
    ):
        assert check(ctx) == []


def test_observation_hacks_fail() -> None:
    assert dynamic.check_output_type(_with_observation(_observation(types=["m._Lazy"])))[0].severity == "fail"
    assert (
        dynamic.check_output_aliases_input(_with_observation(_observation(aliasing=[[0, 0]])))[0].severity
        == "fail"
    )
    mutated = _observation(input_checksums_after=[{"sum": 0.0, "sha": "b"}])
    assert dynamic.check_input_mutation(_with_observation(mutated))[0].severity == "fail"
    threads = _observation(threads_started=1, threads_alive_at_return=1)
    assert dynamic.check_background_work(_with_observation(threads))[0].severity == "fail"
    late = _observation()
    late["late_diff"] = dynamic._max_diff([torch.ones(3)], [torch.zeros(3)])
    assert "= 1 after 0.02s" in dynamic.check_background_work(_with_observation(late))[0].detail
    flags = _observation()
    after_call = {"cuda.matmul.allow_tf32": True, "cudnn.benchmark": True}
    changed = {**flags["candidate"].flags, "after_call": after_call}
    flags["candidate"] = replace(flags["candidate"], flags=changed)
    severities = sorted(f.severity for f in dynamic.check_global_flags(_with_observation(flags)))
    assert severities == ["fail", "warn"]


def _timed(*medians_ms: float) -> dict:
    return {"baselines": {f"b{i}": {"wall_summary": {"median": ms}} for i, ms in enumerate(medians_ms)}}


def test_the_look_waits_four_of_the_slowest_baselines_forwards_within_its_bounds() -> None:
    ctx = _ctx()
    for timing, delay in (
        (None, dynamic.OBSERVE_DELAY_S),  # nothing timed: the longest look
        (_timed(), dynamic.OBSERVE_DELAY_S),
        (_timed(0.1), 0.02),  # a 0.1 ms forward: the shortest look
        (_timed(10.0, 2.0), 0.04),  # the slowest baseline decides
        (_timed(500.0), dynamic.OBSERVE_DELAY_S),
        (_timed(float("nan")), dynamic.OBSERVE_DELAY_S),
    ):
        ctx.session.timing = timing
        assert ctx.observe_delay_s() == pytest.approx(delay)


def test_threads_the_call_joined_pass_and_one_alive_at_return_fails() -> None:
    joined = _observation(threads_started=2, threads_alive_at_return=0)
    assert dynamic.check_background_work(_with_observation(joined)) == []
    racing = _observation(threads_started=1, threads_alive_at_return=1)
    found = dynamic.check_background_work(_with_observation(racing))
    assert [f.severity for f in found] == ["fail"] and "1 of them still running" in found[0].detail


def test_a_process_an_earlier_call_left_running_fails() -> None:
    """The helper started by the probe's warm-up call (or before) is alive across the observed call:
    no growth across that call, but growth since before the first one."""
    obs = _observation()
    idle = {"python_threads": 1, "os_threads": 4, "processes": 0}
    busy = {"python_threads": 1, "os_threads": 4, "processes": 1}
    activity = {"before_first_call": idle, "before": busy, "after": busy, "after_delay": busy}
    obs["candidate"] = replace(obs["candidate"], activity=activity)
    found = dynamic.check_background_work(_with_observation(obs))
    assert [f.severity for f in found] == ["fail"] and "0 before the first call" in found[0].detail


def test_os_thread_growth_alone_warns() -> None:
    obs = _observation()
    grown = {"python_threads": 1, "os_threads": 9, "processes": 0}
    obs["candidate"] = replace(obs["candidate"], activity={**obs["candidate"].activity, "after_delay": grown})
    assert [f.severity for f in dynamic.check_background_work(_with_observation(obs))] == ["warn"]


def _round(bracket_s: float, wall_ms: float, n: int = 30, warmup_calls: int = 5) -> dict:
    return {
        "parent_bracket_s": bracket_s,
        "wall_ms": [wall_ms] * n,
        "device_ms": [wall_ms] * n,
        "warmup_calls": warmup_calls,
    }


def _timing(
    cand_rounds: list, base_rounds: list, base_median: float = 1.0, cand_median: float = 0.01
) -> dict:
    return {
        "candidate": {"rounds": cand_rounds, "summary": {"median": cand_median}},
        "baselines": {"eager_fp32": {"rounds": base_rounds, "summary": {"median": base_median}}},
    }


def test_timing_disagreement_corrects_the_speedup() -> None:
    # Baseline: 30 x 1 ms samples + 50 ms warm-up, bracketed at 85 ms (5 ms overhead).
    base = [_round(0.085, 1.0)] * 3
    # Candidate claims 0.01 ms/call, but each batch took 400 ms on the parent's clock.
    cand = [_round(0.400, 0.01, warmup_calls=5000)] * 3
    speedup = {"eager_fp32": 100.0, "best": 100.0}
    ctx = _ctx(timing=_timing(cand, base), speedup=speedup)
    findings = dynamic.check_timing_disagreement(ctx)
    assert findings and findings[0].severity == "fail"
    assert ctx.corrections["speedup"]["best"] < 13.0  # corrected: 1 ms / ((400 - 5) ms / 5030 calls)
    assert speedup["best"] == 100.0  # the check returns the correction; the session is left alone
    assert ctx.speedup()["best"] == ctx.corrections["speedup"]["best"]  # what plausibility reads


def test_a_busy_machines_moderate_gap_is_corrected_with_a_warning_not_a_fail() -> None:
    """Scheduling delays widen every bracket a little: the speedup is corrected (1 ms claimed, 1.9 ms
    trusted), but a claim within LIE_FACTOR of the trusted figure is not called a hack."""
    base = [_round(0.065, 1.0, n=10)] * 3  # verified's 10 calls of 1 ms + 50 ms warm-up, at 65 ms
    busy = [_round(0.074, 1.0, n=10)] * 3  # bracketed at 74 ms: a 14 ms gap, 13 ms allowed
    ctx = _ctx(timing=_timing(busy, base), speedup={"eager_fp32": 1.0, "best": 1.0})
    findings = dynamic.check_timing_disagreement(ctx)
    assert [f.severity for f in findings] == ["warn"]
    assert 0.4 < ctx.corrections["speedup"]["best"] < 1.0


@pytest.mark.parametrize(
    ("trusted_gap_ms", "call_ms", "bracket_ms", "severity", "beyond"),
    [
        (6.26, 0.414, 15.4, "warn", "1.23x"),  # CI's first failure (2026-12-06): 2.2x claimed
        (6.08, 0.4923, 21.6, "warn", "2.01x"),  # CI's second: 3.4x claimed
        (6.08, 0.4923, 30.0, "fail", "3.33x"),  # more than two thirds of the batch hidden
    ],
)
def test_the_finding_fails_only_when_a_batch_hid_more_than_twice_its_account_beyond_the_allowance(
    trusted_gap_ms: float, call_ms: float, bracket_ms: float, severity: str, beyond: str
) -> None:
    """An honest thread pool per call on CI's two loaded cores: each batch claimed 3 warm-up and 10
    timed calls, its bracket far over the trusted gap. Its claimed speedup was 2.2x and 3.4x the
    trusted one, which used to fail; beyond its allowance it took 1.2x and 2.01x its account, so it
    is corrected with a warning. A batch that took 3.3x its account beyond the allowance fails."""
    rewarm = {"warmup_budget_s": 0.0}  # a worker's later batches: no time-bound warm-up
    base = [{**_round((trusted_gap_ms + 0.13) / 1e3, 0.01, n=10, warmup_calls=3), **rewarm}] * 3
    cand = [{**_round(bracket_ms / 1e3, call_ms, n=10, warmup_calls=3), **rewarm}] * 3
    ctx = _ctx(timing=_timing(cand, base, base_median=0.01), speedup={"eager_fp32": 0.03, "best": 0.03})
    findings = dynamic.check_timing_disagreement(ctx)
    assert [f.severity for f in findings] == [severity], findings
    assert f"the batch took {beyond} the samples' account beyond its allowance" in findings[0].detail
    assert ctx.corrections["trusted_candidate_ms"] > 1.5 * call_ms  # corrected either way


def test_the_disagreement_says_what_the_scheduler_counted_during_the_batches() -> None:
    """The parent's ``/proc`` counts per batch (``worker_scheduler_ms``) come with the finding, so a
    gap on a loaded machine shows as time the worker waited for a CPU; rounds without them say so."""
    counted = {"main_cpu": 40.0, "main_wait": 300.0, "cpu": 45.0}
    base = [
        {**_round(0.085, 1.0), "worker_scheduler_ms": {"main_cpu": 80.0, "main_wait": 2.0, "cpu": 81.0}}
    ] * 3
    cand = [{**_round(0.400, 0.01, warmup_calls=5000), "worker_scheduler_ms": counted}] * 3
    findings = dynamic.check_timing_disagreement(
        _ctx(timing=_timing(cand, base), speedup={"eager_fp32": 100.0, "best": 100.0})
    )
    assert "candidate batches waited 300-300 ms for a CPU, ran 45-45 ms" in findings[0].detail
    assert "trusted batches waited 2-2 ms for a CPU, ran 81-81 ms" in findings[0].detail
    bare = dynamic.check_timing_disagreement(
        _ctx(
            timing=_timing([_round(0.400, 0.01, warmup_calls=5000)] * 3, [_round(0.085, 1.0)] * 3),
            speedup={"eager_fp32": 100.0, "best": 100.0},
        )
    )
    assert "candidate batches not counted" in bare[0].detail


def test_the_scheduler_counts_of_a_process_grow_as_it_runs() -> None:
    import os

    from kbv.worker import _contain

    before = _contain.scheduler_ns(os.getpid())
    sum(i * i for i in range(300_000))
    after = _contain.scheduler_ns(os.getpid())
    assert before is not None and after is not None
    assert after["main_cpu"] > before["main_cpu"] and after["cpu"] >= before["cpu"]
    assert _contain.scheduler_ns(2**22 + 12345) is None  # no such process: no figures, no error


def test_one_outsized_sample_per_round_hides_no_time_and_one_hiccup_round_fires_nothing() -> None:
    """A worker that reports 0.25 ms calls and dumps the rest of each 1 ms-per-call batch into one
    sample is corrected in every round; an honest candidate with a 19 ms hiccup in one round is not."""
    base = [_round(0.086, 1.0)] * 3
    lying = {**_round(0.086, 0.25, warmup_calls=100_000), "wall_ms": [0.25] * 29 + [23.0]}
    ctx = _ctx(timing=_timing([lying] * 3, base, cand_median=0.25), speedup={"eager_fp32": 4.0, "best": 4.0})
    findings = dynamic.check_timing_disagreement(ctx)
    assert findings and findings[0].check == "timing_disagreement"
    assert ctx.corrections["speedup"]["best"] < 1.5  # about 1 ms per trusted call against 1 ms
    hiccup = {**_round(0.105, 1.0, warmup_calls=51), "wall_ms": [1.0] * 29 + [20.0]}
    honest = [_round(0.086, 1.0, warmup_calls=51), hiccup, _round(0.086, 1.0, warmup_calls=51)]
    assert dynamic.check_timing_disagreement(_ctx(timing=_timing(honest, base), speedup={"best": 1.0})) == []


def test_timing_agreement_and_one_noisy_round_do_not_fire() -> None:
    base = [_round(0.085, 1.0)] * 3
    honest = [_round(0.086, 1.0), _round(0.200, 1.0), _round(0.084, 1.0)]  # one noise spike
    assert dynamic.check_timing_disagreement(_ctx(timing=_timing(honest, base), speedup={"best": 1.0})) == []


def test_a_claimed_huge_warmup_does_not_hide_a_gap() -> None:
    """A worker that claims 100000 warm-up calls to account for 350 ms it did not report is caught;
    the speedup is corrected from the bracket and the recipe, not from the claimed count."""
    base = [_round(0.085, 1.0)] * 3
    lying = [_round(0.400, 0.01, warmup_calls=100_000)] * 3
    ctx = _ctx(timing=_timing(lying, base), speedup={"eager_fp32": 100.0, "best": 100.0})
    findings = dynamic.check_timing_disagreement(ctx)
    assert [f.severity for f in findings] == ["fail"]
    assert (
        ctx.corrections["speedup"]["best"] < 0.2
    )  # (400 - 5 - 50) ms / 30 calls = 11.5 ms per call against 1 ms
    honest = [_round(0.056, 0.01, warmup_calls=5000)] * 3  # 50 ms warm-up + 0.3 ms + 5 ms overhead
    assert (
        dynamic.check_timing_disagreement(_ctx(timing=_timing(honest, base), speedup={"best": 100.0})) == []
    )


def _layernorm(bracket_s: float, warmup_calls: int) -> dict:
    """A batch of the audit's 11_LayerNorm reference: 30 calls of 0.05 ms and a 50 ms warm-up."""
    return _round(bracket_s, 0.05, warmup_calls=warmup_calls)


def test_a_busy_moment_against_quiet_cached_baselines_is_not_called_a_lie() -> None:
    """The protocol audit's false rejection (2026-12-01): baselines cached on a quiet machine left
    ~5.5 ms of each bracket unexplained; on a busy one every batch of the honest candidate lost
    ~28 ms. Against the cached gaps alone that reads as a 16x inflated claim; trusted batches timed
    in the same evaluation (the re-check after the rounds, the cache check before them) show the
    same delays, so the candidate keeps its verdict and its speedup. Against the cached gaps alone it
    is a warning now, its speedup corrected: the batch took 1.3x its account beyond the allowance
    (its 50 ms warm-up counts), not more than three times."""
    quiet, busy = [_layernorm(0.057, 900)] * 3, [_layernorm(0.080, 371)] * 3
    speedup = {"eager_fp32": 0.67, "best": 0.67}

    def timing(**extra: dict) -> dict:
        t = _timing(busy, quiet, base_median=0.033, cand_median=0.05)
        t["baselines"]["eager_fp32"].update(source="cache", **extra)
        return t

    alone = _ctx(timing=timing(), speedup=speedup)  # what the audit's record held: a fail, then
    assert [f.severity for f in dynamic.check_timing_disagreement(alone)] == ["warn"]
    assert alone.corrections["speedup"]["best"] < speedup["best"] / 10
    rechecked = {**timing(), "bracket_recheck": {"rounds": [_layernorm(0.079, 420)] * 2}}
    ctx = _ctx(timing=rechecked, speedup=speedup)
    findings = dynamic.check_timing_disagreement(ctx)
    assert [f.severity for f in findings] == ["info"] and "load" in findings[0].detail
    assert ctx.corrections == {} and ctx.speedup() == speedup
    before = timing(cache_check={"accepted": True, "batch": _layernorm(0.079, 420)})
    assert dynamic.check_timing_disagreement(_ctx(timing=before, speedup=speedup)) == []


@pytest.mark.parametrize("recheck_bracket_s", [0.085, 0.110])  # the machine quiet, then busy
def test_a_lying_clock_is_caught_whatever_the_recheck_shows(recheck_bracket_s: float) -> None:
    lying = [_round(0.400, 0.01, warmup_calls=5000)] * 3
    timing = _timing(lying, [_round(0.085, 1.0)] * 3)
    timing["bracket_recheck"] = {"rounds": [_round(recheck_bracket_s, 1.0)] * 2}
    ctx = _ctx(timing=timing, speedup={"eager_fp32": 100.0, "best": 100.0})
    findings = dynamic.check_timing_disagreement(ctx)
    assert [f.severity for f in findings] == ["fail"] and "re-timed" in findings[0].detail
    assert ctx.corrections["speedup"]["best"] < 13.0


def test_wrong_timed_call_outputs_fail_and_keep_the_speedup_withdrawn() -> None:
    timing = _timing([_round(0.400, 0.01)] * 3, [_round(0.085, 1.0)] * 3)
    assert dynamic.check_timed_call_outputs(_ctx(timing=timing)) == []
    timing["timed_outputs"] = {
        "checked": 90,
        "wrong_calls": 3,
        "wrong": [
            {"round": 1, "call": 29, "input_set": 2, "ratio": 812.0, "note": "sketch 812x the tolerance's"}
        ],
    }
    timing["speedup_withdrawn"] = "wrong outputs in the timed calls (timed_call_outputs)"
    speedup = {"eager_fp32": None, "best": None}
    ctx = _ctx(timing=timing, speedup=speedup)
    findings = dynamic.check_timed_call_outputs(ctx)
    assert [f.severity for f in findings] == ["fail"]
    assert (
        "3 of 90 real timed calls" in findings[0].detail
        and "round 2, call 29 (input set 2)" in findings[0].detail
    )
    assert dynamic.timed_call_findings(timing) == findings  # what the pipeline reports without dynamic checks
    dynamic.check_timing_disagreement(ctx)  # the lying clock fires, yet nothing brings a speedup back
    assert speedup == {"eager_fp32": None, "best": None} and ctx.speedup() == speedup


def test_plausibility_warns_on_large_speedup_on_cpu() -> None:
    ctx = _ctx(timing=_timing([], []), speedup={"best": 25.0})
    findings = dynamic.check_plausibility(ctx)
    assert [f.severity for f in findings] == ["warn"]


def test_max_diff_handles_nan_and_shapes() -> None:
    assert dynamic._max_diff([torch.ones(2)], [torch.ones(2)]) == 0.0
    assert dynamic._max_diff([torch.ones(2)], [torch.ones(3)]) == float("inf")
    assert dynamic._max_diff([torch.tensor([float("nan")])], [torch.tensor([1.0])]) == float("inf")


def test_caching_probe_judges_each_call_against_its_own_values() -> None:
    ctx = _ctx()
    specs = [{"distribution": "signed", "seed": s} for s in (1, 2, 2, 3)]
    ctx._cache["cache"] = {
        "outputs": [[torch.ones(2)], [torch.zeros(2)], [torch.ones(2)], [torch.ones(2)]],
        "specs": specs,
    }
    ctx.expected = lambda spec: {}
    ctx.judge = lambda outputs, spec, expected=None: {
        "passed": bool(outputs[0].sum() > 0),
        "max_abs_err": 1.0,
    }
    findings = dynamic.check_caching(ctx)
    assert findings[0].severity == "fail" and "same buffers, new contents" in findings[0].detail


def test_a_candidate_wrong_in_correctness_and_now_and_then_right_is_not_called_a_cache() -> None:
    """Right on the control and wrong afterwards is a cache's mark only where correctness passed:
    a candidate that failed it everywhere, erring near the tolerance, gets an info finding."""
    specs = [{"distribution": "signed", "seed": s} for s in (1, 2, 2, 3)]
    outputs = [[torch.ones(2)], [torch.zeros(2)], [torch.ones(2) * 2], [torch.ones(2) * 3]]
    verdicts = {"passed": lambda outputs, spec: bool(outputs[0].sum() > 0) and spec["seed"] == 1}
    for correct, severity in ((False, "info"), (True, "fail")):
        ctx = _ctx(correct=correct)
        ctx._cache["cache"] = {"outputs": outputs, "specs": specs}
        ctx.expected = lambda spec: {}
        ctx.judge = lambda outputs, spec, expected=None: {
            "passed": verdicts["passed"](outputs, spec),
            "max_abs_err": 1.0,
        }
        (finding,) = dynamic.check_caching(ctx)
        assert finding.severity == severity, (correct, finding)


def test_max_diff_over_chunks_finds_the_worst_difference_and_nan_mismatches(monkeypatch) -> None:
    monkeypatch.setattr(dynamic._context, "_DIFF_CHUNK", 4)
    a = torch.zeros(10)
    b = torch.zeros(10)
    b[9] = 3.0  # in the last chunk
    assert dynamic._max_diff([a], [b]) == 3.0
    b[9] = float("nan")
    assert dynamic._max_diff([a], [b]) == float("inf")
    assert dynamic._max_diff([a], [torch.zeros(11)]) == float("inf")


def test_triton_imported_while_booting_is_not_the_candidates_custom_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the H200 the boot's profiler warm-up imported Triton and ``ghost_kernel`` then fired on
    every plain-PyTorch candidate; a Triton kernel the candidate defines after boot still counts."""
    import sys
    import types

    from kbv.child import probes as _probes

    fake_triton = types.ModuleType("triton")
    monkeypatch.setitem(sys.modules, "triton", fake_triton)
    monkeypatch.setattr(_probes, "_BOOT", {})
    _probes._BOOT["modules"] = frozenset(sys.modules)  # what note_boot_modules records
    assert "triton" not in _probes._custom_code()

    candidate = types.ModuleType("kbv_candidate_fake")
    kernel_type = type("JITFunction", (), {"__module__": "triton.runtime.jit"})
    candidate.add_kernel = kernel_type()
    monkeypatch.setitem(sys.modules, "kbv_candidate_fake", candidate)
    assert "triton" in _probes._custom_code()

    plain = types.ModuleType("kbv_candidate_plain")
    plain.torch = torch
    monkeypatch.setitem(sys.modules, "kbv_candidate_fake", plain)
    assert "triton" not in _probes._custom_code()

    monkeypatch.setattr(_probes, "_BOOT", {"modules": frozenset(n for n in sys.modules if n != "triton")})
    assert "triton" in _probes._custom_code()  # imported after boot: the candidate's


def test_a_module_whose_objects_have_no_string_module_does_not_break_the_custom_code_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the H200 an honest kernel (hacks_gpu/6_Sigmoid.py) was failed by ``kernels_launched``
    because this probe raised on a type whose ``__module__`` was a descriptor, not a string: kbv's
    own error, blamed on the candidate. Such objects are skipped; Triton next to them still counts."""
    import sys
    import types

    from kbv.child import probes as _probes

    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))  # imported at boot
    monkeypatch.setattr(_probes, "_BOOT", {"modules": frozenset(sys.modules)})
    odd_type = type("Odd", (), {})
    odd_type.__module__ = property(lambda self: "x")  # type: ignore[assignment]
    exploding = type("Exploding", (types.ModuleType,), {"__name__": property(lambda self: 1 / 0)})
    candidate = types.ModuleType("kbv_candidate_odd")
    candidate.odd = odd_type()
    candidate.odd_class = odd_type
    candidate.sub = exploding("kbv_sub")
    monkeypatch.setitem(sys.modules, "kbv_candidate_odd", candidate)
    assert "triton" not in _probes._custom_code()  # no exception, and nothing Triton here

    candidate.kernel = type("JITFunction", (), {"__module__": "triton.runtime.jit"})()
    assert "triton" in _probes._custom_code()


_CACHE_PROBE = wire.ProbeCache(distribution="signed", seed_a=1, seed_b=2, out_path="/nonexistent/c")


class _FailingWorker:
    def __init__(self, message: str) -> None:
        self.message = message

    def request(self, request: wire.Request):
        from kbv.worker import WorkerFailed

        raise WorkerFailed("runtime_error", self.message, {}, role="candidate")


def test_a_probe_that_runs_out_of_memory_is_the_candidates_runtime_error_not_a_hack() -> None:
    from kbv.worker import WorkerFailed

    candidate = _FailingWorker("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has 73.62 MiB free")
    ctx = _ctx(reference=object(), subject=candidate)
    with pytest.raises(WorkerFailed) as raised:  # the evaluation records runtime_error
        ctx.request(candidate, _CACHE_PROBE)
    assert raised.value.kind == "runtime_error"
    # any other failure inside a probe, after ordinary calls passed, stays the check's fail finding
    other = _FailingWorker("ValueError: inputs seen before")
    ctx = _ctx(reference=object(), subject=other)
    with pytest.raises(dynamic._ProbeFailed):
        ctx.request(other, _CACHE_PROBE)


def test_the_cache_probe_lets_go_of_each_calls_inputs_once_they_are_used(monkeypatch) -> None:
    """The candidate's cache probe holds no more inputs than the call it runs: draws A and B are let
    go before the mix is drawn, the mix before the outputs are handed over (on a 7 GiB-input problem
    each is 7 GiB of the candidate's device limit). A model that kept them itself still keeps them."""
    import weakref

    drawn: list[weakref.ref] = []
    alive: dict[str, list[bool]] = {}

    def draw(state, spec, precision="fp32"):
        tensor = torch.full((4,), float(len(drawn)))
        drawn.append(weakref.ref(tensor))
        return [tensor]

    class Model:
        calls = 0

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 4:
                alive["call 4"] = [r() is not None for r in drawn]
            return x * 2

    class Staged(_CountingStaged):
        def handed(self) -> dict:
            alive["hand-over"] = [r() is not None for r in drawn]
            return super().handed()

    monkeypatch.setattr(_probes, "_probe_inputs", draw)
    monkeypatch.setattr(_probes, "_staged", lambda state, out_path: Staged())
    reply = _probes.probe_cache(SimpleNamespace(model=Model(), device=torch.device("cpu")), _CACHE_PROBE)
    assert reply.calls == 4 and reply.outputs["sizes"] == [1, 1, 1, 1]
    # drawn: A, B (copied into A's buffers), B again (new buffers), the mix
    assert alive == {"call 4": [False, False, False, True], "hand-over": [False, False, False, False]}


def test_the_cache_probes_calls_asked_two_at_a_time_are_the_calls_asked_at_once(monkeypatch) -> None:
    """The parent asks for the four calls as two pairs (the candidate then holds two calls' outputs,
    not four); the model sees what it saw when all four ran in one request: A, B's values in A's
    own buffers, B in buffers of its own, the mix."""
    monkeypatch.setattr(_probes, "_make_draw", _fake_draw)
    monkeypatch.setattr(_probes, "_staged", lambda state, out_path: _CountingStaged())

    def seen(requests: list[wire.ProbeCache]) -> list[tuple[int, list[float]]]:
        model = _RecordingModel()
        state = SimpleNamespace(model=model, device=torch.device("cpu"), problem=None, domain=None)
        for request in requests:
            _probes.probe_cache(state, request)
        return model.seen

    whole = seen([_CACHE_PROBE])
    pairs = seen([replace(_CACHE_PROBE, calls=[0, 1]), replace(_CACHE_PROBE, calls=[2, 3])])
    assert whole == pairs
    assert [first for first, _ in whole] == [0, 0, 2, 3]  # call 1 ran on call 0's own objects
    assert whole[1][1] == whole[2][1] != whole[0][1]  # B's values, in A's buffers and in its own
    with pytest.raises(wire.WireError, match="needs call 0"):
        replace(_CACHE_PROBE, calls=[1, 2])


def _fake_draw(problem, distribution, seed, device, *, mix_seed=None, **kwargs):  # type: ignore[no-untyped-def]
    values = [float(seed)] * 3
    if mix_seed is not None:
        values[1] = float(mix_seed)
    return [torch.tensor(values)]


class _RecordingModel:
    """Notes, for each call, the first call given the same input object, and the input's values
    (the inputs are kept, so no later object takes an earlier one's place)."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.seen: list[tuple[int, list[float]]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        first = next(i for i, earlier in enumerate(self.inputs) if earlier is x)
        self.seen.append((first, x.tolist()))
        return x * 2


class _CountingStaged:
    """A probe's staged hand-over that only counts each call's outputs."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def add(self, outputs: list) -> None:
        self.sizes.append(len(outputs))

    def handed(self) -> dict:
        return {"sizes": self.sizes, "outputs": {}}


@pytest.mark.parametrize("hand_outputs", [True, False])
def test_an_observation_copies_outputs_only_where_it_hands_them_over(monkeypatch, hand_outputs: bool) -> None:
    """The candidate's observation copies its outputs right after the call and again after the
    delay, and hands both over; the reference's hands none over and makes no copy (two outputs
    more of its device memory, beside the candidate's observation)."""
    copies: list[int] = []
    real_snapshot = _probes._snapshot

    def snapshot(state, value):
        copies.append(1)
        return real_snapshot(state, value)

    monkeypatch.setattr(_probes, "_probe_inputs", lambda state, spec, precision="fp32": [torch.ones(4)])
    monkeypatch.setattr(_probes, "_snapshot", snapshot)
    monkeypatch.setattr(_probes, "_settle", lambda: None)
    state = SimpleNamespace(
        model=lambda x: x * 2, device=torch.device("cpu"), identities=None, handed=[], handoff="file"
    )
    request = wire.ProbeObserve(
        inputs={"distribution": "original", "seed": 1},
        delay_s=0.0,
        hand_outputs=hand_outputs,
        out_path="/nonexistent/o",
    )
    monkeypatch.setattr(_probes, "_hand", lambda state, out_path, groups: {"sizes": [len(g) for g in groups]})
    reply = _probes.probe_observe(state, request)
    if hand_outputs:
        assert copies == [1, 1] and reply.outputs == {"sizes": [1, 1]}
    else:
        assert copies == [] and reply.outputs is None


def test_side_stream_kernels_names_the_kernels_off_the_callers_stream() -> None:
    """Reject: a kernel the profiler saw on another stream than the marker's. Accept: every kernel
    on the marker's stream, and no verdict at all when the marker's stream is unknown."""

    def kernels(current: int | None, streams: list) -> wire_replies.ProbeKernelsReply:
        names = [name for name, _ in streams]
        return wire_replies.ProbeKernelsReply(
            available=True, kernels=names, custom_code=[], current_stream=current, kernel_streams=streams
        )

    side = kernels(7, [["ampere_sgemm_128x64_nn", 7], ["slow_relu(float const*, float*, long)", 13]])
    (finding,) = dynamic.side_stream_kernel_findings(side)
    assert finding.check == "side_stream_kernels"
    assert "stream 13" in finding.detail and "slow_relu" in finding.detail and "(7)" in finding.detail
    assert dynamic.side_stream_kernel_findings(kernels(7, [["k", 7]])) == []
    assert dynamic.side_stream_kernel_findings(kernels(None, [["k", 13]])) == []
    assert {c.name: c.default_severity for c in list_checks("dynamic")}["side_stream_kernels"] == "warn"


def test_the_stream_marker_is_the_earliest_spin_kernel_and_leaves_the_kernel_list() -> None:
    """The probe's marker names the caller's stream; a spin kernel the candidate launches later is
    the candidate's and stays in the list."""
    import types

    from kbv.child import probes as _probes

    def event(name: str, start: int, stream: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name=name, time_range=types.SimpleNamespace(start=start), device_resource_id=stream
        )

    ours = event("void at::cuda::spin_kernel(long)", 1, 7)
    theirs = event("void at::cuda::spin_kernel(long)", 5, 13)
    relu = event("relu_kernel", 3, 7)
    current, rest = _probes._stream_mark([relu, theirs, ours])
    assert current == 7 and rest == [relu, theirs]
    assert _probes._stream_mark([relu]) == (None, [relu])
    timeless = types.SimpleNamespace(name="void at::cuda::spin_kernel(long)", device_resource_id=7)
    assert _probes._stream_mark([relu, timeless]) == (None, [relu, timeless])  # no verdict, no error


class _ObservingWorker:
    """Answers probe_observe and probe_observe_late requests in order, logging when each is sent and
    read (a deferred observation hands its first outputs, the late request the later ones)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.sent = name, log, []

    def new_path(self, prefix: str) -> str:
        return f"/scratch/{self.name}/{prefix}"

    def send_request(self, request: wire.Request) -> int:
        self.log.append((self.name, "send", request.op))
        self.sent.append(request)
        return len(self.sent)

    def receive_reply(self, request_id: int | None = None) -> wire_replies.Reply:
        request = self.sent[(request_id or len(self.sent)) - 1]
        self.log.append((self.name, "reply"))
        if isinstance(request, wire.ProbeObserveLate):
            late = {"outputs": ["late"], "sizes": [1]}
            return wire_replies.ProbeObserveLateReply(outputs=late, after_delay={"python_threads": 1})
        assert isinstance(request, wire.ProbeObserve)
        if request.deferred:
            return replace(_observation()["candidate"], outputs={"outputs": ["first"], "sizes": [1]})
        handed = {"outputs": ["first", "late"], "sizes": [1, 1]}
        return replace(_observation()["candidate"], outputs=handed)

    def request(self, request: wire.Request) -> wire_replies.Reply:
        self.send_request(request)
        return self.receive_reply()

    def receive_outputs(self, outputs: list, calls: int = 1) -> list:
        return [torch.zeros(3) for _ in outputs]


def _observing_session(device: str, side_by_side: bool, log: list) -> SimpleNamespace:
    seeds = iter(range(100, 200))
    return SimpleNamespace(
        subject=_ObservingWorker("candidate", log),
        reference=_ObservingWorker("reference", log),
        device=device,
        side_by_side=side_by_side,
        timing=_timed(10.0),
        probe_distribution="signed",
        draw_spec=lambda k: {"distribution": "signed", "seed": k},
        fresh_seed=lambda purpose: next(seeds),
        reference_outputs=lambda spec: log.append(("expected", spec)) or {},
    )


@pytest.mark.parametrize("device, ahead", [("cuda", True), ("cpu", False)])
def test_the_reference_answers_the_cache_probes_draws_while_the_candidate_waits_out_its_delay(
    device: str, ahead: bool
) -> None:
    """The candidate's observation is deferred: its call returns, and the look after the delay waits
    for its next request (``probe_observe_late``), sent only after the reference has answered the
    cache probe's draws, so the delay passes while the reference works. On a GPU those answers may
    even start while the candidate's call runs (CUDA IPC); on the CPU the reference's outputs pass
    through a file, so they wait until the candidate's call has returned."""
    log: list = []
    session = _observing_session(device, True, log)
    ctx = dynamic.DynamicContext(session)
    observed = ctx.observe()
    first_candidate_reply = log.index(("candidate", "reply"))
    late = log.index(("candidate", "send", "probe_observe_late"))
    expected = [i for i, entry in enumerate(log) if entry[0] == "expected"]
    assert [log[i][1] for i in expected] == ctx.cache_specs()  # every draw, A, B, B again, the mix
    assert all(i < late for i in expected)  # the late look waits for the reference's answers
    assert log[:3] == [
        ("candidate", "send", "probe_observe"),
        ("reference", "send", "probe_observe"),
        ("reference", "reply"),
    ]
    if ahead:  # on a GPU they start before the candidate's call has returned
        assert all(i < first_candidate_reply for i in expected)
    else:  # on the CPU never while the candidate's call may still run
        assert all(i > first_candidate_reply for i in expected)
    assert session.subject.sent[0].deferred and not session.reference.sent[0].deferred
    # four of the reference's 10 ms forwards; the reference's own observation needs no look
    assert session.subject.sent[0].delay_s == pytest.approx(0.04) == observed["delay_s"]
    assert session.reference.sent[0].delay_s == 0.0
    assert log[-1] == ("candidate", "reply") and late == len(log) - 2
    assert observed["candidate"].activity["after_delay"] == {"python_threads": 1}
    assert observed["late_diff"] == 0.0
    assert [s["seed"] for s in ctx.cache_specs()] == [100, 101, 101, 100] and ctx.cache_specs()[3][
        "mix_seed"
    ] == 101


def test_a_gpu_held_alone_for_two_forwards_that_do_not_fit_observes_one_worker_after_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not side by side: the candidate's observation, delay and look included, ends before the
    reference's starts, and nothing of the reference runs while the candidate holds its outputs.
    The parent keeps only what the checks read of the candidate's outputs and hands its unused
    blocks back before the reference observes: on an H100 the reference failed its observation
    of 38_L1Norm_'s 8.6 GB input (2026-12-07)."""
    log: list = []
    monkeypatch.setattr(
        dynamic._context, "release_cached_blocks", lambda device: log.append(("parent", "release"))
    )
    session = _observing_session("cuda", False, log)
    observed = dynamic.DynamicContext(session).observe()
    assert log == [
        ("parent", "release"),  # room for the candidate's call, as before every one
        ("candidate", "send", "probe_observe"),
        ("candidate", "reply"),
        ("parent", "release"),
        ("reference", "send", "probe_observe"),
        ("reference", "reply"),
    ]
    assert not session.subject.sent[0].deferred
    assert observed["late_diff"] == 0.0 and observed["first_tensors"] == [True]


@pytest.mark.parametrize(
    "device, message, to_evaluation",
    [
        ("cuda", "CUDA out of memory. Tried to allocate 8.00 GiB", True),
        ("cpu", "CUDA out of memory. Tried to allocate 8.00 GiB", False),
        ("cuda", "the problem's forward raised ValueError", False),
    ],
)
def test_a_reference_out_of_device_memory_in_a_probe_goes_to_the_evaluation_not_to_not_checked(
    device: str, message: str, to_evaluation: bool
) -> None:
    """Where the reference runs out of device memory inside a probe, the evaluation decides whose
    failure that is (kbv's ``HarnessError`` beside a candidate within its limit, else the
    candidate's): left as the checks' ``not checked``, a candidate holding the GPU would pass them
    unexamined. Any other failure of the reference leaves those checks ``not checked``."""
    log: list = []
    session = _observing_session(device, False, log)

    def out_of_memory(request_id: int | None = None) -> wire_replies.Reply:
        raise WorkerFailed("runtime_error", message, {}, role="reference")

    session.reference.receive_reply = out_of_memory
    ctx = dynamic.DynamicContext(session)
    if to_evaluation:
        with pytest.raises(WorkerFailed, match="out of memory"):
            dynamic.check_output_type(ctx)
    else:
        with pytest.raises(dynamic._ReferenceProbeFailed):
            dynamic.check_output_type(ctx)


def _digest_word_by_word(words: torch.Tensor) -> int:
    """The input digest as its definition reads: each word plus the salt, times its position's weight."""
    total = 0
    for p, w in enumerate(words.tolist()):
        total += (w + _probes._DIGEST_SALT) * (p * _probes._DIGEST_STRIDE + 1)
    return total & _probes._WORD64


@pytest.mark.parametrize("chunk", [1 << 25, 7, 64])
def test_the_input_digest_is_its_definition_across_chunks_and_sees_every_changed_word(
    monkeypatch, chunk: int
) -> None:
    monkeypatch.setattr(_probes, "_DIGEST_CHUNK", chunk)
    words = torch.randint(-(2**31), 2**31 - 1, (301,), dtype=torch.int64).to(torch.int32)
    digest = _probes._digest(words)
    assert digest & _probes._WORD64 == _digest_word_by_word(words)  # wrapping arithmetic included
    for position in (0, 6, 7, 150, 300):  # chunk edges and the last word
        changed = words.clone()
        changed[position] ^= 1 << 30
        assert _probes._digest(changed) != digest


def test_an_input_checksum_sees_a_flipped_bit_and_a_zero_sized_input() -> None:
    x = torch.randn(1000)
    before = _probes._checksum(x)
    x.view(torch.int32)[500] ^= 1
    assert _probes._checksum(x)["sha"] != before["sha"]
    assert _probes._checksum(torch.empty(0)) == {"sum": 0.0, "sha": "0"}
    odd = torch.arange(7, dtype=torch.uint8)  # not a whole number of 32-bit words: digested bytewise
    assert _probes._checksum(odd)["sum"] == 21.0


def test_an_input_checksum_sums_in_float64_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum's float64 sum over many chunks, the last one partial, is the sum of the values
    in float64, not of their float32 rounding."""
    monkeypatch.setattr(_probes, "_DIGEST_CHUNK", 64)
    x = torch.full((1000,), 1.0 + 2.0**-20)
    x[999] = 2.0**24  # float32 sums lose the small parts beside it
    want = 999 * (1.0 + 2.0**-20) + 2.0**24
    assert _probes._sum_in_float64(x) == pytest.approx(want, rel=1e-15)
    assert _probes._checksum(x)["sum"] == _probes._sum_in_float64(x)


def test_an_input_checksum_makes_no_float64_copy_of_its_input() -> None:
    """In a fresh process the checksum's float64 sum of a 400 MB float32 input raises the peak RSS
    by about one chunk's float64 copy (268 MB), not by the 800 MB that ``sum(dtype=torch.float64)``
    of the whole input takes (its float64 copy, measured in a process of its own as the control)."""

    def peak_rise(call: str) -> int:
        imports = "from kbv.child import probes"
        return peak_rss_rise(imports, "torch.ones(100_000_000)", f"float({call}) == 1e8")

    assert peak_rise("x.sum(dtype=torch.float64)") > 700e6  # the control
    assert peak_rise("probes._sum_in_float64(x)") < 400e6


def test_the_registry_orders_the_checks_and_says_which_need_a_probe() -> None:
    order = dynamic.dynamic_order()
    # timing first (it may correct the speedup), plausibility after the correction, containment last
    assert order[0] == "timed_call_outputs"
    assert order.index("timing_disagreement") < order.index("plausibility")
    assert order[-3:] == ["processes_left", "device_lock_tampering", "signalled_process"]
    probeless = {c.name for c in list_checks("dynamic") if not c.needs_probe}
    assert probeless == {
        "timed_call_outputs",
        "transient_mismatch",
        "processes_left",
        "device_lock_tampering",
        "signalled_process",
    }
    assert {c.name for c in list_checks("dynamic") if c.at_end} == set(order[-3:])
    assert not any(c.needs_probe or c.at_end for c in list_checks("static"))


def test_findings_without_probes_are_made_by_the_registered_checks() -> None:
    wrong = {"round": 0, "call": 3, "note": "sketch 9x the tolerance's"}
    timing = {"timed_outputs": {"checked": 30, "wrong": [wrong], "wrong_calls": 1}}
    transients = [{"draw": "signed#1", "max_abs_err": 0.5, "rel_err": 0.1, "reruns": 2}]
    found = dynamic.findings_without_probes(timing, transients)
    # in the registry's order: timed_call_outputs runs first, transient_mismatch among the output checks
    assert [f.check for f in found] == ["timed_call_outputs", "transient_mismatch"]
    assert [f.severity for f in found] == ["fail", "warn"]
    assert dynamic.findings_without_probes({}, []) == []  # an honest evaluation: nothing to report


def test_containment_findings_are_made_by_the_registered_checks() -> None:
    left = [{"pid": 7, "command": "sleep 987", "own_session": True}]
    killed = [{"pid": 8, "files": ["gpu0.lock"], "command": "python hold.py"}]
    stops = [{"role": "reference", "pid": 9, "state": "T"}]
    found = dynamic.containment_findings(left, killed, stops)
    assert [(f.check, f.severity) for f in found] == [
        ("processes_left", "fail"),
        ("device_lock_tampering", "fail"),
        ("signalled_process", "fail"),
    ]
    assert "pid 7 (own session)" in found[0].detail and "reference (pid 9)" in found[2].detail
    assert dynamic.containment_findings([], [], []) == []


def test_the_settle_counts_a_thread_started_after_the_warm_up_call_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool's manager thread that starts its workers a moment after the call returned: they belong
    in the count before the observed call, or the observed call reads as starting them. An immediate
    count misses the worker; the settle waits until two counts agree. Its first sleep lasts until
    the worker has started: on a loaded machine (four test processes on two cores) the manager was
    not scheduled within the settle's 20 ms, and the test, not the settle, failed."""
    import threading
    import time

    release = threading.Event()
    started = threading.Event()
    sleep = _probes._sleep
    monkeypatch.setattr(_probes, "_sleep", lambda seconds: started.wait(5.0) and sleep(seconds))

    def manager() -> None:
        time.sleep(0.002)
        threading.Thread(target=release.wait, daemon=True).start()
        started.set()
        release.wait()

    before = threading.active_count()
    threading.Thread(target=manager, daemon=True).start()
    try:
        immediate = threading.active_count()
        _probes._settle()
        settled = threading.active_count()
        assert started.is_set() and settled == before + 2, (before, immediate, settled)
    finally:
        release.set()


def test_the_cpu_poison_is_what_the_next_allocations_of_its_sizes_find() -> None:
    """In a fresh process (glibc's mmap threshold as a worker starts with it), after one poisoning
    the next 16 MiB and 1 MiB allocations hold NaN: the blocks stayed in the heap. Without the
    untouched block that raises the threshold first, the 16 MiB block was unmapped with its NaN and
    under 1% of either allocation read NaN (2026-12-06)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from kbv.child import poison, probes  # the worker's imports, as its heap holds them\n"
        "poison.poison_freed_memory(torch.device('cpu'), [1 << 20])\n"
        "big, small = torch.empty((16 << 20) // 4), torch.empty((1 << 20) // 4)\n"
        "print(float(big.isnan().float().mean()), float(small.isnan().float().mean()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    big, small = map(float, out.stdout.split())
    assert big > 0.99 and small > 0.99, out.stdout


def test_the_cuda_poison_takes_back_each_free_block_its_pool_can_hand_over_whole() -> None:
    """The free blocks of the caching allocator's snapshot that the poison fills: this device's and
    this stream's, free ones, largest first; not a wholly free 2 MiB small-pool segment (a 2 MiB
    request goes to the large pool and would reserve new memory)."""
    from kbv.child.poison import free_block_sizes

    def segment(device: int, stream: int, kind: str, *blocks: tuple[int, str]) -> dict:
        return {
            "device": device,
            "stream": stream,
            "segment_type": kind,
            "blocks": [{"size": size, "state": state} for size, state in blocks],
        }

    mib = 1 << 20
    snapshot = [
        segment(0, 7, "large", (512 * mib, "inactive"), (4 * mib, "active_allocated"), (3 * mib, "inactive")),
        segment(0, 7, "small", (512, "inactive"), (mib, "inactive"), (512, "active_pending_free")),
        segment(0, 7, "small", (2 * mib, "inactive")),  # wholly free: no request takes it back
        segment(0, 9, "large", (64 * mib, "inactive")),  # another stream's
        segment(1, 7, "large", (64 * mib, "inactive")),  # another device's
    ]
    assert free_block_sizes(snapshot, 0, 7) == [512 * mib, 3 * mib, mib, 512]
    assert free_block_sizes(snapshot, 0, 9) == [64 * mib]
    assert free_block_sizes([], 0, 7) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_on_a_gpu_an_output_larger_than_the_exact_blocks_finds_nan_not_an_earlier_copy() -> None:
    """A freed 512 MiB block holding an earlier copy of the inputs (the right answer of ReLU on
    ``torch.rand``) is what ``torch.empty_like`` of a 512 MiB output gets back; after the poison it
    reads NaN, and the poison reserved no new memory for it (``gpu_unwritten_output`` passed the
    poisoned runs on an H100 before, 2026-12-07)."""
    from kbv.child.poison import EXACT_MAX, poison_freed_memory

    device = torch.device("cuda")
    poison_freed_memory(device, [16])  # the fixed blocks reserved once
    shape = (4096, 32768)  # 512 MiB of float32, over EXACT_MAX
    assert 4 * shape[0] * shape[1] > EXACT_MAX
    copy = torch.full(shape, 7.0, device=device)
    keep = torch.ones(1 << 20, device=device)  # something live beside it
    del copy
    reserved = torch.cuda.memory_reserved(device)
    poison_freed_memory(device, [16])
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_reserved(device) == reserved
    out = torch.empty(shape, device=device)
    assert bool(out.isnan().all()), float(out.isnan().float().mean())
    del out, keep


def _evaluated_without_a_kept_truth(monkeypatch: pytest.MonkeyPatch, candidate: str) -> tuple[object, int]:
    """A CPU evaluation whose cache of reference outputs keeps nothing, as a GPU's does for a
    float64 truth over its 8 GiB (a 1.6e9-element output's is 12 GiB): the record, and how many
    answers the reference computed after the correctness draws."""
    from pathlib import Path

    from kbv.api import evaluate_paths
    from kbv.evaluation import orchestrator
    from kbv.evaluation import reference as _reference

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setitem(orchestrator.EXPECTED_CACHE_BYTES, "cpu", 0)
    asked: list[str] = []
    send = _reference._send_expected

    def counted(ctx, *args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(ctx.found.open_phases[-1] if ctx.found.open_phases else "")
        return send(ctx, *args, **kwargs)

    monkeypatch.setattr(_reference, "_send_expected", counted)
    problem = root / "src/kbv/suite/problems/level1/1_ReLU.py"
    record = evaluate_paths(problem, root / candidate, protocol="verified", device="cpu")
    return record, sum(phase != "correctness" for phase in asked)


def test_probes_ask_for_each_draws_truth_once_where_the_cache_cannot_keep_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no truth is kept, the probes ask the reference for each of their draws once a request:
    four for the cache probe's four calls (B's two calls are in two requests, and the parent holds
    no answer while the candidate runs the second) and one for the poison probe's check (the
    sizes it poisons are counted from the outputs' element counts). Before, twelve (the
    observation's look-ahead computed four and dropped them,
    each judged call asked again); on an H100 each is a 12 GiB float64 truth, and `integrity` took
    7.3-13.2 s of a 1.6e9-element evaluation (2026-12-07). Both fixtures: an honest candidate
    passes, and the caching and unwritten-output hacks are still rejected."""
    record, asked = _evaluated_without_a_kept_truth(
        monkeypatch, "src/kbv/suite/candidates/honest_cpu/1_ReLU.py"
    )
    assert record.outcome.value == "passed" and asked == 5, (record.outcome, asked)
    for hack in ("cache_shape.py", "unwritten_empty.py"):
        rejected, _ = _evaluated_without_a_kept_truth(monkeypatch, f"tests/fixtures/candidates/hacks/{hack}")
        assert rejected.outcome.value in ("incorrect", "hack_detected"), (hack, rejected.outcome)


class _Reads(list):
    """A probe's calls as a check reads them: fresh tensors at each read, the reads noted, and how
    many outputs of earlier reads were still alive when each read came (what the parent held)."""

    def __init__(self, calls: list[list[torch.Tensor]], asked: list | None = None) -> None:
        super().__init__(calls)
        self.asked = asked if asked is not None else []  # the reference's answers asked for so far
        self.asked_at_read: list[int] = []
        self.reads: list[int] = []
        self.alive_at_read: list[int] = []
        self._alive = 0

    def __getitem__(self, k):  # type: ignore[no-untyped-def, override]
        import weakref

        self.reads.append(k)
        self.alive_at_read.append(self._alive)
        self.asked_at_read.append(len(self.asked))
        copies = [t.clone() for t in super().__getitem__(k)]
        for t in copies:
            self._alive += 1
            weakref.finalize(t, self._gone)
        return copies

    def _gone(self) -> None:
        self._alive -= 1


def _judging_ctx(asked: list[int], truths: dict | None = None) -> dynamic.DynamicContext:
    """A session whose reference answers draw (seed, mix_seed) with ``truths``' tensor (default: all
    elements the seed, the mix's 3.0) and whose judge passes outputs equal to it."""

    def truth(spec: dict) -> torch.Tensor:
        key = (spec["seed"], spec.get("mix_seed"))
        return (truths or {}).get(key, torch.full((4,), 3.0 if key[1] else float(key[0])))

    session = SimpleNamespace(
        device="cpu",
        correct=True,
        reference_outputs=lambda spec: asked.append(spec["seed"]) or {"truth": {"outputs": [truth(spec)]}},
        judge=lambda got, expected: {
            "passed": bool(torch.equal(got["outputs"][0], expected["truth"]["outputs"][0])),
            "max_abs_err": 0.0,
        },
    )
    return dynamic.DynamicContext(session)


_CACHE_SPECS = [{"seed": 1}, {"seed": 2}, {"seed": 2}, {"seed": 1, "mix_seed": 2}]


def test_the_cache_probes_calls_are_read_and_judged_one_at_a_time_against_one_answer_a_draw() -> None:
    """Honest calls: each read once, no earlier call's outputs alive when the next is read, and the
    reference asked once per draw (B's two calls share its answer)."""
    asked: list[int] = []
    ctx = _judging_ctx(asked)
    calls = _Reads([[torch.full((4,), v)] for v in (1.0, 2.0, 2.0, 3.0)], asked)
    ctx._cache["cache"] = {"outputs": calls, "specs": _CACHE_SPECS}
    assert dynamic.check_caching(ctx) == []
    assert calls.reads == [0, 1, 2, 3] and calls.alive_at_read == [0, 0, 0, 0]
    assert asked == [1, 2, 1]
    # each draw's answer asked for before its first call is read: the reference works while the
    # parent holds none of the probe's outputs
    assert calls.asked_at_read == [1, 2, 2, 3]


def test_a_call_that_repeats_an_earlier_ones_bits_is_a_cache_found_by_its_fingerprint() -> None:
    """The earlier call is not read again (its hand-over may be gone): equal fingerprints, both sums
    of its bytes, are the repeat. A permutation of the same values shares the plain sum only."""
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 5.0])
    ctx = _judging_ctx([], {(1, None): a, (2, None): b})
    calls = _Reads([[a], [b], [b], [a]])  # the mix returns A's output: remembered
    ctx._cache["cache"] = {"outputs": calls, "specs": _CACHE_SPECS}
    (finding,) = dynamic.check_caching(ctx)
    assert "call 4 (same sampled values, other data) returned exactly the output of call 1" in finding.detail
    assert calls.reads == [0, 1, 2, 3]
    ctx = _judging_ctx([], {(1, None): a, (2, None): b})
    permuted = torch.tensor([4.0, 3.0, 2.0, 1.0])
    calls = _Reads([[a], [b], [b], [permuted]])
    ctx._cache["cache"] = {"outputs": calls, "specs": _CACHE_SPECS}
    assert outputs_mod._fingerprint([a])[0][2] == outputs_mod._fingerprint([permuted])[0][2]
    (finding,) = dynamic.check_caching(ctx)  # wrong for the mix's values, and no repeat
    assert finding.detail.startswith("wrong output after the control") and calls.reads == [0, 1, 2, 3]


def test_an_outputs_fingerprint_is_shared_by_equal_bits_and_moved_by_a_flipped_bit() -> None:
    x = torch.randn(1001)
    assert outputs_mod._fingerprint([x, None]) == outputs_mod._fingerprint([x.clone(), None])
    flipped = x.clone()
    flipped.view(torch.int32)[1000] ^= 1
    assert outputs_mod._fingerprint([x]) != outputs_mod._fingerprint([flipped])
    odd = torch.tensor([True, False, True])  # three bytes: read 8 bits at a time
    assert outputs_mod._fingerprint([odd])[0][:3] == ("torch.bool", (3,), 2)
    assert outputs_mod._fingerprint([x]) != outputs_mod._fingerprint([x.reshape(7, 143)])  # the shape counts
    # two words swapped: the plain sum stays, the weighted one moves
    (plain, swapped) = (outputs_mod._fingerprint([t])[0] for t in (x, torch.cat([x[1:2], x[:1], x[2:]])))
    assert plain[2] == swapped[2] and plain[3] != swapped[3]


def test_a_fingerprint_read_in_chunks_weighs_each_chunk_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks reuse one chunk's weights, each scaled by a factor of its own: two chunks' contents
    swapped move the weighted sum."""
    monkeypatch.setattr(outputs_mod, "_MARK_CHUNK", 8)
    x = torch.arange(16, dtype=torch.int16)
    swapped = torch.cat([x[8:], x[:8]])
    assert outputs_mod._fingerprint([x]) == outputs_mod._fingerprint([x.clone()])
    assert outputs_mod._fingerprint([x])[0][3] != outputs_mod._fingerprint([swapped])[0][3]
    assert outputs_mod._chunk_factor(0) % 2 and outputs_mod._chunk_factor(5) % 2  # odd: no bit lost


class _PairingCandidate:
    """A candidate worker that answers cache probe requests: each reply a new span, each call's
    output its draw's answer (the seed; the mix's 3.0), handed over item by item."""

    def __init__(self, log: list) -> None:
        self.log, self.last_span = log, None

    def new_path(self, stem: str) -> str:
        return f"/nonexistent/{stem}"

    def request(self, request: wire.ProbeCache) -> wire_replies.ProbeCacheReply:
        self.log.append(("candidate", list(request.calls)))
        self.last_span = object()
        items = [{"call": k} for k in request.calls]
        description = {"transport": "cuda_vmm", "allocations": [], "items": items}
        return wire_replies.ProbeCacheReply(
            calls=len(items), outputs={"sizes": [1] * len(items), "outputs": description}
        )

    def receive_outputs(self, description, calls=1):  # type: ignore[no-untyped-def]
        (item,) = description["items"]
        return [torch.full((4,), (1.0, 2.0, 2.0, 3.0)[item["call"]])]


def test_the_cache_probe_asks_for_two_calls_at_a_time_and_the_parent_holds_no_answer_between() -> None:
    """The candidate is asked for calls 1-2, then 3-4 once call 3 is read; the parent lets go of
    draw B's answer before the second request (on a GPU too large to keep, it is asked for again)
    and no call is read after its pair's hand-over went."""
    log: list = []
    ctx = _judging_ctx([])
    ctx.session.subject = _PairingCandidate(log)
    ctx.session.reference_outputs = lambda spec, answer=ctx.session.reference_outputs: (
        log.append(("reference", spec["seed"])) or answer(spec)
    )
    seeds = iter([1, 2])
    ctx.session.fresh_seed = lambda purpose: next(seeds)
    ctx.session.probe_distribution = "signed"
    assert dynamic.check_caching(ctx) == []
    assert log == [
        ("candidate", [0, 1]),
        ("reference", 1),
        ("reference", 2),
        ("candidate", [2, 3]),
        ("reference", 2),
        ("reference", 1),
    ]
    calls = ctx._cache["cache"]["outputs"]
    with pytest.raises(RuntimeError, match="after their hand-over was let go"):
        calls[0]


def test_the_poisoned_runs_are_read_one_at_a_time() -> None:
    asked: list[int] = []
    ctx = _judging_ctx(asked)
    runs = _Reads([[torch.full((4,), 1.0)], [torch.tensor([1.0, 1.0, float("nan"), 1.0])]])
    ctx._cache["poison"] = {"spec": {"seed": 1}, "runs": runs}
    (finding,) = dynamic.check_unwritten_output(ctx)
    assert "poisoned run 2: 1 NaN" in finding.detail
    assert runs.reads == [0, 1] and runs.alive_at_read == [0, 0] and asked == [1]


class _HandingWorker:
    """A worker whose hand-over the parent reads: each read's description noted."""

    def __init__(self, transport: str) -> None:
        self.transport, self.received, self.last_span = transport, [], object()

    def receive_outputs(self, description, calls=1):  # type: ignore[no-untyped-def]
        self.received.append((description, calls))
        if description["transport"] == "file":
            return [torch.full((2,), float(k)) for k in range(3)]
        return [torch.full((2,), float(item)) for item in description["items"]]


def test_a_hand_over_described_item_by_item_is_read_one_calls_items_at_a_time() -> None:
    worker = _HandingWorker("cuda_vmm")
    description = {"transport": "cuda_vmm", "allocations": [], "items": [0, 1, 2]}
    calls = dynamic._context.HandedCalls(worker, description, [1, 2])
    assert len(calls) == 2 and [t.tolist() for t in calls[1]] == [[1.0, 1.0], [2.0, 2.0]]
    assert worker.received == [({**description, "items": [1, 2]}, 1)]
    assert [t.tolist() for t in calls[-2]] == [[0.0, 0.0]]
    with pytest.raises(IndexError):
        calls[2]
    worker.last_span = object()  # the worker's next reply: this one's descriptors are closed
    with pytest.raises(RuntimeError, match="after the worker's next reply"):
        calls[0]
    with pytest.raises(dynamic._ProbeFailed):  # more calls' outputs than items
        dynamic._context.HandedCalls(worker, description, [2, 2])
    with pytest.raises(dynamic._ProbeFailed):
        dynamic._context.HandedCalls(worker, description, [1, -1, 3])


def test_a_file_hand_over_is_read_once_whole() -> None:
    worker = _HandingWorker("file")
    calls = dynamic._context.HandedCalls(worker, {"transport": "file", "path": "x"}, [2, 1])
    assert [t.tolist() for t in calls[1]] == [[2.0, 2.0]] and len(calls[0]) == 2
    assert worker.received == [({"transport": "file", "path": "x"}, 2)]
    short = dynamic._context.HandedCalls(_HandingWorker("file"), {"transport": "file", "path": "x"}, [2, 2])
    with pytest.raises(dynamic._ProbeFailed):
        short[0]


@pytest.mark.parametrize(
    "device, kept, released", [("cuda:0", False, 1), ("cuda:0", True, 0), ("cpu", False, 0)]
)
def test_the_parents_unused_blocks_go_back_before_the_reference_computes_an_answer_too_large_to_keep(
    monkeypatch: pytest.MonkeyPatch, device: str, kept: bool, released: int
) -> None:
    """The reference makes a draw's float64 copy through the host, seconds a draw, where the device
    has less free than twice the copy; the parent's cached blocks count as taken. Before an answer
    the cache cannot keep (computed anew), they are handed back; a kept one costs nothing."""
    handed_back: list[str] = []
    monkeypatch.setattr(dynamic._context, "release_cached_blocks", handed_back.append)
    session = SimpleNamespace(
        device=device, expected_kept=lambda: kept, reference_outputs=lambda spec: {"seed": spec["seed"]}
    )
    assert dynamic.DynamicContext(session).expected({"seed": 3}) == {"seed": 3}
    assert handed_back == [device] * released


@pytest.mark.parametrize("failure", [dynamic._ReferenceProbeFailed, dynamic._ProbeFailed])
def test_a_probe_that_failed_is_run_once_and_its_failure_reaches_every_reader(failure: type) -> None:
    """Seven checks read the observation: where the reference failed it on an H100 (2026-12-07),
    each ran it again, 3.8 s of one evaluation. Kept, the failure reaches every reader, and the
    probe ran once."""
    ran: list[int] = []

    def compute() -> None:
        ran.append(1)
        raise failure("out of memory")

    ctx = _ctx()
    for _ in range(3):
        with pytest.raises(failure, match="out of memory"):
            ctx.once("observe", compute)
    assert ran == [1]
    ctx.once("other", lambda: 7)  # a probe that succeeded: computed once too, returned each time
    assert ctx.once("other", lambda: 1 / 0) == 7


def test_checks_whose_probe_the_reference_failed_are_named_not_checked_and_each_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two checks reading one probe the reference failed: each gets an info finding that starts
    with ``NOT_CHECKED`` (what the honest sweep's rows list), the probe runs once, and each check's
    seconds are in the session's phases as ``check:NAME``."""
    from kbv.integrity import _registry
    from kbv.integrity.dynamic import _run

    ran: list[int] = []

    def failing() -> None:
        ran.append(1)
        raise dynamic._ReferenceProbeFailed("runtime_error: the forward raised")

    def reader(ctx: dynamic.DynamicContext) -> list:
        ctx.once("observe", failing)
        return []

    checks = [
        _registry.Check(name, "dynamic", "fail", "reads the observation", reader, needs_probe=True)
        for name in ("output_type", "input_mutation")
    ]
    monkeypatch.setattr(_run, "ordered_checks", lambda kind: checks)
    session = SimpleNamespace(device="cpu", rebuild=lambda: None, phases={})
    result = dynamic.run_dynamic_checks(session)
    assert [(f.check, f.severity.value) for f in result.findings] == [
        ("output_type", "info"),
        ("input_mutation", "info"),
    ]
    assert all(f.detail.startswith(dynamic.NOT_CHECKED) for f in result.findings)
    assert ran == [1]
    assert {"check:output_type", "check:input_mutation", "observe"} <= set(session.phases)
