"""Output comparison with real torch computations: float64 truth, fp32 baseline, candidates."""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kbv import correctness, error_stats
from kbv.correctness import (
    baseline_error,
    check_structure,
    compare_allclose,
    compare_error_model,
    judge_distribution,
)
from kbv.inputs import make_inputs
from kbv.protocol import STANDARD, VERIFIED, CorrectnessSettings

EM = VERIFIED.correctness
AC = STANDARD.correctness
ROWS = types.SimpleNamespace(get_inputs=lambda: [torch.rand(16, 4096)])

Fn = Callable[[torch.Tensor], torch.Tensor]


def _judge(reference: Fn, candidate: Fn, distribution: str, seed: int = 7) -> tuple[bool, float, float, dict]:
    """Reference in float64 on the upcast inputs is the truth; the fp32 reference is the baseline."""
    x = make_inputs(ROWS, distribution, seed, "cpu")[0]
    x64 = make_inputs(ROWS, distribution, seed, "cpu", precision="fp64")[0]
    truth = [reference(x64)]
    baseline = [reference(x)]
    outputs = [candidate(x)]
    assert check_structure(outputs, baseline) is None
    return compare_error_model(outputs, truth, baseline_error(baseline, truth), EM)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def honest_softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x)
    return e / e.sum(dim=-1, keepdim=True)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:])


def two_pass_layer_norm(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5)


def naive_layer_norm(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = (x * x).mean(dim=-1, keepdim=True) - mean * mean
    return (x - mean) / torch.sqrt(var + 1e-5)


# ----------------------------------------------------------------------------------- structure


def test_structure_accepts_matching_outputs():
    assert check_structure([torch.zeros(2, 3)], [torch.ones(2, 3)]) is None


def test_structure_rejects_subclasses():
    class Lazy(torch.Tensor):
        pass

    lazy = torch.zeros(2, 3).as_subclass(Lazy)
    msg = check_structure([lazy], [torch.zeros(2, 3)])
    assert msg is not None and "not torch.Tensor" in msg
    msg = check_structure([torch.nn.Parameter(torch.zeros(2))], [torch.zeros(2)])
    assert msg is not None and "Parameter" in msg
    assert check_structure([[1.0, 2.0]], [torch.zeros(2)]) is not None


def test_structure_messages():
    assert "count" in (check_structure([torch.zeros(1)] * 2, [torch.zeros(1)]) or "")
    assert "list" in (check_structure(torch.zeros(1), [torch.zeros(1)]) or "")
    msg = check_structure([torch.zeros(2, 3)], [torch.zeros(3, 2)])
    assert msg is not None and "shape" in msg and "(2, 3)" in msg and "(3, 2)" in msg
    msg = check_structure([torch.zeros(2, dtype=torch.float16)], [torch.zeros(2)])
    assert msg is not None and "dtype" in msg and "float16" in msg
    msg = check_structure([torch.zeros(2, 2).to_sparse()], [torch.zeros(2, 2)])
    assert msg is not None and "layout" in msg


# ----------------------------------------------------------------------------------- allclose


def test_allclose_protocol():
    t = torch.linspace(-1, 1, 100)
    ok, max_abs, rel, tol = compare_allclose([t + 5e-5], [t], AC)
    assert ok and max_abs == pytest.approx(5e-5, rel=1e-2) and tol["mode"] == "allclose"
    ok, max_abs, _, _ = compare_allclose([t + 1e-3], [t], AC)
    assert not ok and max_abs == pytest.approx(1e-3, rel=1e-2)
    half = t.half()
    assert compare_allclose([half + 5e-3], [half], AC)[0]
    assert not compare_allclose([half + 5e-2], [half], AC)[0]
    assert not compare_allclose([torch.zeros(3)], [torch.zeros(4)], AC)[0]


def test_allclose_nan_always_fails():
    t = torch.tensor([1.0, float("nan")])
    ok, max_abs, _, _ = compare_allclose([t.clone()], [t], AC)
    assert not ok and max_abs == 0.0  # KernelBench semantics: even matching NaNs fail
    ok, max_abs, _, _ = compare_allclose([torch.tensor([float("nan"), 1.0])], [t], AC)
    assert not ok and max_abs == math.inf


def test_allclose_integers_exact():
    t = torch.arange(10)
    assert compare_allclose([t.clone()], [t], AC)[0]
    u = t.clone()
    u[3] += 1
    ok, max_abs, _, _ = compare_allclose([u], [t], AC)
    assert not ok and max_abs == 1.0


# ----------------------------------------------------------------------------------- error model


@pytest.mark.parametrize("distribution", ["original", "signed", "wide", "shifted", "blockwise"])
def test_honest_fp32_softmax_passes(distribution):
    ok, _, _, tol = _judge(softmax, honest_softmax, distribution)
    assert ok, tol


@pytest.mark.parametrize("distribution", ["original", "wide", "shifted", "blockwise"])
def test_zeros_fail_softmax(distribution):
    ok, _, rel, _ = _judge(softmax, torch.zeros_like, distribution)
    assert not ok and rel == pytest.approx(1.0)


def test_zeros_pass_the_fixed_tolerance_on_a_wide_row_but_not_the_error_model():
    wide_row = types.SimpleNamespace(get_inputs=lambda: [torch.rand(2, 393216)])
    x = make_inputs(wide_row, "original", 1, "cpu")[0]
    truth = [torch.softmax(x.double(), -1)]
    baseline = [torch.softmax(x, -1)]
    zeros = [torch.zeros_like(x)]
    assert compare_allclose(zeros, baseline, AC)[0], "the fixed-tolerance weakness this guards against"
    assert not compare_error_model(zeros, truth, baseline_error(baseline, truth), EM)[0]


@pytest.mark.parametrize("distribution", ["wide", "shifted", "blockwise"])
def test_softmax_without_max_subtraction_fails(distribution):
    x = make_inputs(ROWS, distribution, 7, "cpu")[0]
    assert not torch.isfinite(naive_softmax(x)).all()
    ok, max_abs, rel, tol = _judge(softmax, naive_softmax, distribution)
    assert not ok and max_abs == math.inf and rel == math.inf
    assert tol["outputs"][0]["nonfinite_mismatch"] > 0


def test_softmax_without_max_subtraction_passes_on_original_inputs():
    # the shortcut is invisible on KernelBench's own inputs: that is why the distributions exist
    assert _judge(softmax, naive_softmax, "original")[0]


def test_fp32_layer_norm_fails_a_fixed_1e5_but_passes_the_error_model_on_shifted():
    x = make_inputs(ROWS, "shifted", 7, "cpu")[0]
    x64 = make_inputs(ROWS, "shifted", 7, "cpu", precision="fp64")[0]
    truth = [layer_norm(x64)]
    baseline = [layer_norm(x)]
    assert float((baseline[0].double() - truth[0]).abs().max()) > 1e-5
    fixed = CorrectnessSettings(atol_fp32=1e-5, rtol_fp32=1e-5)
    assert not compare_allclose(baseline, [truth[0].float()], fixed)[0]
    err = baseline_error(baseline, truth)
    assert err["finite_match"] and err["elementwise"] > 1e-6
    assert compare_error_model(baseline, truth, err, EM)[0]
    assert compare_error_model([two_pass_layer_norm(x)], truth, err, EM)[0]


def test_naive_variance_layer_norm_fails_on_shifted():
    ok, _, rel, tol = _judge(layer_norm, naive_layer_norm, "shifted")
    assert not ok and rel > 1e-3
    out = tol["outputs"][0]
    assert out["elementwise_err"] > out["elementwise_tol"]


def test_naive_variance_passes_on_original_inputs():
    assert _judge(layer_norm, naive_layer_norm, "original")[0]


def test_identity_fails_relu_on_signed_but_not_on_original():
    assert _judge(torch.relu, lambda x: x.clone(), "original")[0], "KernelBench's inputs hide it"
    ok, _, _, _ = _judge(torch.relu, lambda x: x.clone(), "signed")
    assert not ok


def test_reduced_precision_fails_when_the_baseline_is_exact():
    ok, _, _, _ = _judge(torch.relu, lambda x: torch.relu(x).bfloat16().float(), "signed")
    assert not ok


def test_nan_position_mismatch_fails():
    truth = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64)
    baseline = [truth.float()]
    err = baseline_error(baseline, [truth])
    assert err["finite_match"]
    assert compare_error_model([truth.float()], [truth], err, EM)[0]
    moved = torch.tensor([float("nan"), 2.0, 3.0])
    ok, max_abs, rel, tol = compare_error_model([moved], [truth], err, EM)
    assert not ok and max_abs == math.inf and tol["outputs"][0]["nonfinite_mismatch"] == 2
    assert not compare_error_model([torch.tensor([1.0, 2.0, 3.0])], [truth], err, EM)[0]


def test_inf_must_be_the_same_inf():
    truth = torch.tensor([1.0, float("inf"), -2.0], dtype=torch.float64)
    err = baseline_error([truth.float()], [truth])
    assert compare_error_model([truth.float()], [truth], err, EM)[0]
    assert not compare_error_model([torch.tensor([1.0, -float("inf"), -2.0])], [truth], err, EM)[0]
    assert not compare_error_model([torch.tensor([1.0, 3e38, -2.0])], [truth], err, EM)[0]
    assert not compare_error_model([torch.tensor([float("inf"), float("inf"), -2.0])], [truth], err, EM)[0]


def test_baseline_reports_when_it_cannot_reproduce_the_truth():
    truth = torch.tensor([1e39, 1.0], dtype=torch.float64)
    err = baseline_error([truth.float()], [truth])
    assert not err["finite_match"]


def test_integer_outputs_exact():
    x = make_inputs(ROWS, "signed", 3, "cpu")[0]
    truth = [x.double().argmax(dim=-1)]
    baseline = [x.argmax(dim=-1)]
    err = baseline_error(baseline, truth)
    assert err["outputs"][0] == {"kind": "exact", "mismatches": 0}
    assert compare_error_model(baseline, truth, err, EM)[0]
    wrong = baseline[0].clone()
    wrong[0] += 1
    ok, max_abs, _, _ = compare_error_model([wrong], truth, err, EM)
    assert not ok and max_abs == 1.0
    assert not compare_error_model([baseline[0].float()], truth, err, EM)[0]


def test_all_zero_truth_uses_an_absolute_floor():
    truth = [torch.zeros(1000, dtype=torch.float64)]
    baseline = [torch.zeros(1000)]
    err = baseline_error(baseline, truth)
    assert err["elementwise"] == 0.0 and err["norm"] == 0.0
    assert err["outputs"][0]["scale"] == 1.0
    ok, _, _, _ = compare_error_model([torch.full((1000,), 1e-9)], truth, err, EM)
    assert ok
    ok, _, _, _ = compare_error_model([torch.full((1000,), 0.1)], truth, err, EM)
    assert not ok


def test_multiple_outputs_are_judged_one_by_one():
    x = make_inputs(ROWS, "signed", 5, "cpu")[0]
    truth = [torch.softmax(x.double(), -1), x.double().sum(-1)]
    baseline = [torch.softmax(x, -1), x.sum(-1)]
    err = baseline_error(baseline, truth)
    assert compare_error_model(baseline, truth, err, EM)[0]
    ok, _, _, tol = compare_error_model([baseline[0], baseline[1] * 1.01], truth, err, EM)
    assert not ok and tol["outputs"][0]["passed"] and not tol["outputs"][1]["passed"]
    assert not compare_error_model(baseline[:1], truth, err, EM)[0]
    with pytest.raises(ValueError):
        baseline_error(baseline[:1], truth)


def test_tolerance_is_a_multiple_of_the_baseline_error():
    x = make_inputs(ROWS, "wide", 2, "cpu")[0]
    truth = [x.double().cumsum(-1)]
    baseline = [x.cumsum(-1)]
    err = baseline_error(baseline, truth)
    ok, _, _, tol = compare_error_model(baseline, truth, err, EM)
    assert ok
    out = tol["outputs"][0]
    assert out["elementwise_tol"] == pytest.approx(
        max(EM.error_multiple * err["elementwise"], EM.elementwise_floor)
    )
    assert out["norm_tol"] == pytest.approx(max(EM.error_multiple * err["norm"], EM.norm_floor))


# ----------------------------------------------------------------------------------- verdicts


def _draw(passed: bool, max_abs: float, rel: float, note: str = "") -> dict:
    return {
        "passed": passed,
        "max_abs_err": max_abs,
        "rel_err": rel,
        "tolerance": {"mode": "error_model", "id": max_abs},
        "baseline_err": {"elementwise": max_abs / 10},
        "note": note,
    }


def test_judge_distribution_aggregates_draws():
    settings = CorrectnessSettings(draws_per_distribution=2)
    good = judge_distribution("wide", [_draw(True, 1e-6, 1e-7), _draw(True, 2e-6, 5e-8)], settings)
    assert good.passed and good.applicable and good.draws == 2
    assert good.max_abs_err == 2e-6 and good.rel_err == 1e-7
    assert len(good.tolerance["draws"]) == 2
    bad = judge_distribution(
        "wide", [_draw(True, 1e-6, 1e-7), _draw(False, 3.0, 0.5, "nan mismatch")], settings
    )
    assert not bad.passed and bad.max_abs_err == 3.0 and bad.rel_err == 0.5
    assert bad.tolerance["id"] == 3.0 and bad.baseline_err == {"elementwise": 0.3}
    assert "nan mismatch" in bad.note
    inf = judge_distribution("wide", [_draw(False, math.inf, math.inf)], settings)
    assert inf.max_abs_err == math.inf and "only 1 of 2" in inf.note


def test_judge_distribution_not_applicable_and_empty():
    settings = CorrectnessSettings()
    na = judge_distribution(
        "signed", [], settings, applicable=False, note="reference non-finite (log of negatives)"
    )
    assert not na.applicable and not na.passed and "log of negatives" in na.note
    empty = judge_distribution("signed", [], settings)
    assert not empty.passed and not empty.applicable and "no draws" in empty.note
    flagged = judge_distribution("signed", [{**_draw(True, 0.0, 0.0), "applicable": False}], settings)
    assert not flagged.applicable and not flagged.passed


def _masked_stats(a: torch.Tensor, t: torch.Tensor, close: tuple[float, float] | None = None) -> dict:
    """error_stats with the all-finite shortcut off: every chunk through the masked path."""
    import unittest.mock

    with unittest.mock.patch.object(error_stats, "_finite_chunk_stats", return_value=None):
        return correctness.error_stats(a, t, close)


@pytest.mark.parametrize(
    "a_dtype,t_dtype",
    [(torch.float32, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float32)],
)
def test_all_finite_shortcut_gives_the_masked_paths_statistics(monkeypatch, a_dtype, t_dtype) -> None:
    monkeypatch.setattr(error_stats, "CHUNK_ELEMENTS", 1000)  # several chunks, a short last one
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(4321, generator=g, dtype=torch.float64) * 5).to(t_dtype)
    a = (t.to(torch.float64) + 1e-3 * torch.randn(4321, generator=g, dtype=torch.float64)).to(a_dtype)
    close = (1e-4, 1e-4)
    fast, masked = correctness.error_stats(a, t, close), _masked_stats(a, t, close)
    assert fast["mismatch"] == masked["mismatch"] == 0
    assert fast["close_fail"] == masked["close_fail"] > 0
    for key in ("peak", "max_abs", "sum_sq_diff", "sum_sq_t"):
        assert fast[key] == pytest.approx(masked[key], rel=1e-12), key


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["candidate", "truth", "both"])
def test_a_chunk_with_a_non_finite_value_is_judged_by_the_masked_path(monkeypatch, bad, where) -> None:
    monkeypatch.setattr(error_stats, "CHUNK_ELEMENTS", 100)
    t = torch.linspace(-3, 3, 350, dtype=torch.float64)
    a = t.to(torch.float32) + 1e-4
    if where in ("candidate", "both"):
        a[123] = bad
    if where in ("truth", "both"):
        t[123] = bad
    got, want = correctness.error_stats(a, t), _masked_stats(a, t)
    assert got == want
    assert got["mismatch"] == (0 if where == "both" else 1)


def test_a_sum_of_squares_that_overflows_falls_back_to_the_masked_path() -> None:
    t = torch.tensor([1e200, -1e200, 3.0], dtype=torch.float64)
    a = t.clone()
    a[2] = 4.0
    assert error_stats._finite_chunk_stats(a, t) is None  # (1e200)^2 overflows
    stats = correctness.error_stats(a, t)
    assert stats["mismatch"] == 0 and stats["max_abs"] == 1.0 and stats["peak"] == 1e200


def test_a_small_cpu_comparison_runs_on_one_thread_and_the_setting_comes_back(monkeypatch) -> None:
    """The parent's comparison of CPU outputs up to ONE_THREAD_ELEMENTS runs on one intra-op thread
    (a parallel region on a loaded CPU waits for a core); larger ones keep the pool, and the pool's
    size is restored afterwards, also when the comparison raises."""
    seen: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    with correctness.one_thread_on_the_cpu([torch.zeros(8), "not a tensor"]):
        pass
    assert seen == [1, 2]
    seen.clear()
    with pytest.raises(RuntimeError), correctness.one_thread_on_the_cpu([torch.zeros(8)]):
        raise RuntimeError("a comparison that fails")
    assert seen == [1, 2]
    seen.clear()
    monkeypatch.setattr(correctness, "ONE_THREAD_ELEMENTS", 4)
    with correctness.one_thread_on_the_cpu([torch.zeros(8)]):
        pass
    with correctness.one_thread_on_the_cpu([]):
        pass
    assert seen == []  # too large for one thread, or nothing to compare
