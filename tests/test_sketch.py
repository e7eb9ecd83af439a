"""Sketches of timed calls (kbv.sketch) and their judge (kbv.correctness.judge_sketch), on the CPU;
the same code on CUDA is checked against the CPU's at the end (gpu marker)."""

from __future__ import annotations

import math

import pytest
import torch

from kbv import correctness, sketch
from kbv.protocol import CorrectnessSettings

SEED = 12345


def _direct(t: torch.Tensor, seed: int, omega: float) -> torch.Tensor:
    """The definition, in float64 with no chunks: u_j^T exp(i omega X) v_l for every pair."""
    flat = t.reshape(-1).double().cpu()
    n = flat.numel()
    u, v, cols = sketch._basis(seed, 0, n, torch.device("cpu"))
    rows = n // cols
    out = []
    for part in (torch.cos, torch.sin):
        mat = torch.zeros((rows + 1) * cols, dtype=torch.float64)
        mat[:n] = part(omega * flat)
        out.append((u.T @ mat.view(rows + 1, cols) @ v).reshape(-1))
    return torch.stack(out)


def _as_tensor(entry: dict) -> torch.Tensor:
    return torch.tensor([entry["re"], entry["im"]], dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 3, 100, 8192, 10007])
def test_a_sketch_is_its_definition_in_any_chunking_and_either_float_width(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = torch.randn(n)
    want = _direct(t, SEED, 2.0)
    exact = _as_tensor(sketch.sketch_tensor(t.double(), SEED, 0, 2.0))
    assert torch.allclose(exact, want, rtol=0, atol=1e-12 * n)  # float64 map: rounding only
    fp32 = _as_tensor(sketch.sketch_tensor(t, SEED, 0, 2.0))
    allowed = sketch.FEATURE_ROUNDING * math.sqrt(2 * n)  # float32 cosine and sine
    assert float((fp32 - want).abs().max()) < allowed
    monkeypatch.setattr(sketch, "CHUNK_ELEMENTS", 7)  # one row per chunk, leftovers included
    assert torch.allclose(_as_tensor(sketch.sketch_tensor(t, SEED, 0, 2.0)), fp32, rtol=0, atol=1e-12 * n)


def test_the_map_moves_no_element_further_than_omega_times_its_error() -> None:
    a, t, omega = torch.randn(5000, dtype=torch.float64), torch.randn(5000, dtype=torch.float64), 4.0
    phi = lambda x: torch.polar(torch.ones_like(x), omega * x)  # noqa: E731
    assert bool(((phi(a) - phi(t)).abs() <= omega * (a - t).abs() + 1e-12).all())


def test_omega_is_a_power_of_two_near_two_radians_at_the_rms() -> None:
    assert sketch.omega_for(1.0) == 2.0 and sketch.omega_for(0.0) == 1.0 and sketch.omega_for(math.nan) == 1.0
    for rms in (1e-6, 3e-3, 0.7, 5.0, 1e4):
        w = sketch.omega_for(rms)
        assert math.log2(w).is_integer() and 1.4 <= w * rms <= 2.9


def test_sketch_outputs_names_type_dtype_and_shape_and_leaves_the_output_alone() -> None:
    out = torch.randn(3, 4)
    kept = out.clone()
    (entry,) = sketch.sketch_outputs([out], {"seed": 1, "omega": [2.0]}, torch.device("cpu"))
    assert entry["type"] == "torch.Tensor" and entry["dtype"] == "torch.float32" and entry["shape"] == [3, 4]
    assert len(entry["re"]) == len(entry["im"]) == sketch.PROJECTIONS and "nonfinite" not in entry
    assert torch.equal(out, kept)
    none, number = sketch.sketch_outputs([None, 2.5], {"seed": 1, "omega": [1.0, 1.0]}, torch.device("cpu"))
    assert none == {"type": "builtins.NoneType"} and number["type"] == "builtins.float"


# ------------------------------------------------------------------------------------------------
# The judge


def _settings(**kw: object) -> CorrectnessSettings:
    return CorrectnessSettings(**{"mode": "error_model", **kw})  # type: ignore[arg-type]


def _expected(truth: torch.Tensor, base_norm: float = 1e-7) -> dict:
    """The pipeline's expected dict under the error model, for one output."""
    like = torch.empty(truth.shape, dtype=torch.float32 if truth.is_floating_point() else truth.dtype)
    return {
        "reference": {"outputs": [like]},
        "truth": {"outputs": [truth]},
        "baseline_err": {"outputs": [{"kind": "float", "elementwise": base_norm, "norm": base_norm}]},
    }


def _judge(got: torch.Tensor, truth: torch.Tensor, seed: int = SEED) -> dict:
    reference = correctness.timed_reference(_expected(truth), _settings())
    omegas = [sketch.omega_for(reference["rms"][0]) if truth.is_floating_point() else 1.0]
    target = [sketch.sketch_tensor(truth, seed, 0, omegas[0])]
    entries = sketch.sketch_outputs([got], {"seed": seed, "omega": omegas}, torch.device("cpu"))
    return correctness.judge_sketch(entries, target, reference, omegas)


def _truth(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def test_an_honest_output_passes_far_below_the_limit() -> None:
    truth = _truth(64, 256)
    verdict = _judge(truth.float(), truth)  # fp32 rounding of the truth: an honest kernel's error
    assert verdict["passed"] and verdict["ratio"] < 0.2, verdict


@pytest.mark.parametrize("shape", ["spread", "one_element", "one_row"])
def test_errors_at_the_correctness_bound_never_fail(shape: str) -> None:
    """An output exactly at the error model's L2 bound, its error spread, in one element or in one
    row (the worst case for the projections), over many bases: never judged wrong."""
    torch.manual_seed(0)
    truth = _truth(32, 128)
    reference = correctness.timed_reference(_expected(truth), _settings())
    bound = reference["tolerances"][0]
    worst = 0.0
    for seed in range(300):
        error = torch.zeros_like(truth)
        if shape == "spread":
            error = torch.randn_like(truth)
        elif shape == "one_element":
            error.view(-1)[seed % truth.numel()] = 1.0
        else:
            error[seed % 32] = torch.randn(128, dtype=torch.float64)
        got = truth + error * (bound / float(error.norm()))
        omegas = [sketch.omega_for(reference["rms"][0])]
        target = [sketch.sketch_tensor(truth, seed, 0, omegas[0])]
        entries = [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": [32, 128]}]
        entries[0].update(sketch.sketch_tensor(got, seed, 0, omegas[0]))  # float64: the error exactly
        verdict = correctness.judge_sketch(entries, target, reference, omegas)
        assert verdict["passed"], (seed, verdict)
        worst = max(worst, verdict["ratio"])
    assert worst < correctness.SKETCH_LIMIT


@pytest.mark.parametrize(
    "wrong",
    ["zeros", "other_input_set", "one_row_zero", "half_precision_noise", "scaled"],
)
def test_wrong_outputs_fail(wrong: str) -> None:
    torch.manual_seed(1)
    truth = _truth(64, 256)
    got = {
        "zeros": lambda: torch.zeros_like(truth),
        "other_input_set": lambda: _truth(64, 256),  # an output cached from another call's inputs
        "one_row_zero": lambda: torch.cat([truth[:-1], torch.zeros_like(truth[-1:])]),  # work skipped
        "half_precision_noise": lambda: truth * (1 + 1e-3 * torch.randn_like(truth)),  # fp16-level error
        "scaled": lambda: truth * 1.01,
    }[wrong]()
    verdict = _judge(got.float(), truth)
    assert not verdict["passed"] and verdict["ratio"] > correctness.SKETCH_LIMIT, verdict
    assert "tolerance" in verdict["note"]


def test_an_unseen_draws_summary_judges_as_its_truth_would() -> None:
    """The reference worker's summary of an unseen timing draw (its truth's sketch, sum of squares
    and count, never the truth) gives the tolerance the truth itself gives, passes an honest output
    and fails one remembered from another draw."""
    from kbv.error_stats import truth_summary

    torch.manual_seed(2)
    truth, other = _truth(64, 256), _truth(64, 256)
    expected = _expected(truth)
    settings = _settings()
    direct = correctness.timed_reference(expected, settings, [256])
    omegas = [sketch.omega_for(direct["rms"][0])]
    summary = truth_summary([truth], SEED, omegas)
    targets, reference = correctness.unseen_reference(
        summary, expected["reference"]["outputs"], expected["baseline_err"], settings, [256]
    )
    assert reference["tolerances"] == pytest.approx(direct["tolerances"], rel=1e-12)
    assert reference["rms"] == pytest.approx(direct["rms"], rel=1e-12)
    assert targets == [sketch.sketch_tensor(truth, SEED, 0, omegas[0])]
    spec = {"seed": SEED, "omega": omegas}
    honest = sketch.sketch_outputs([truth.float()], spec, torch.device("cpu"))
    remembered = sketch.sketch_outputs([other.float()], spec, torch.device("cpu"))
    assert correctness.judge_sketch(honest, targets, reference, omegas)["passed"]
    assert not correctness.judge_sketch(remembered, targets, reference, omegas)["passed"]
    with pytest.raises(ValueError, match="error_model"):
        correctness.unseen_reference(summary, [], {}, _settings(mode="allclose"))


def test_allclose_bound_maps_to_l2_and_nan_never_matches() -> None:
    reference_out = torch.rand(16, 64)
    expected = {"reference": {"outputs": [reference_out]}}
    settings = _settings(mode="allclose", atol_fp32=1e-4, rtol_fp32=1e-4)
    ref = correctness.timed_reference(expected, settings)
    assert ref["tolerances"][0] == pytest.approx(float((1e-4 + 1e-4 * reference_out.double()).norm()))
    omegas = [sketch.omega_for(ref["rms"][0])]
    target = [sketch.sketch_tensor(reference_out, 3, 0, omegas[0])]

    def judge(got: torch.Tensor) -> dict:
        return correctness.judge_sketch(
            sketch.sketch_outputs([got], {"seed": 3, "omega": omegas}, torch.device("cpu")),
            target,
            ref,
            omegas,
        )

    assert judge(reference_out + 5e-5)["passed"]
    assert not judge(reference_out + 1e-2)["passed"]
    with_nan = reference_out.clone()
    with_nan[0, 0] = math.nan
    assert "NaN" in judge(with_nan)["note"]


def test_non_finite_values_must_sit_where_the_truths_do() -> None:
    truth = _truth(8, 64)
    truth[1, 2], truth[3, 4] = math.nan, math.inf
    same = truth.float()
    assert _judge(same, truth)["passed"]
    moved = same.clone()
    moved[1, 2], moved[1, 3] = 0.0, math.nan  # as many NaN, elsewhere
    assert "other positions" in _judge(moved, truth)["note"]
    flipped = same.clone()
    flipped[3, 4] = -math.inf
    assert not _judge(flipped, truth)["passed"]
    finite = same.clone()
    finite[1, 2] = 0.0
    assert "nan values where the reference has 1" in _judge(finite, truth)["note"]


def test_exact_outputs_must_match_exactly() -> None:
    truth = torch.randint(0, 1000, (4, 50))
    assert _judge(truth.clone(), truth)["passed"]
    off = truth.clone()
    off[2, 7] += 1
    assert not _judge(off, truth)["passed"]


def test_structure_and_malformed_entries_are_wrong_outputs_not_errors() -> None:
    truth = _truth(4, 8)
    reference = correctness.timed_reference(_expected(truth), _settings())
    omegas = [sketch.omega_for(reference["rms"][0])]
    target = [sketch.sketch_tensor(truth, 1, 0, omegas[0])]
    good = sketch.sketch_outputs([truth.float()], {"seed": 1, "omega": omegas}, torch.device("cpu"))[0]
    cases = {
        "no sketch": None,
        "count mismatch": [good, good],
        "is not torch.Tensor": [{**good, "type": "mymodule.LazyTensor"}],
        "dtype mismatch": [{**good, "dtype": "torch.float16"}],
        "shape mismatch": [{**good, "shape": [8, 4]}],
        "malformed sketch": [{**good, "re": good["re"][:-1]}],
    }
    cases["malformed sketch, nan"] = [{**good, "im": [math.nan] * sketch.PROJECTIONS}]
    for expect, got in cases.items():
        verdict = correctness.judge_sketch(got, target, reference, omegas)
        assert not verdict["passed"] and expect.split(",")[0] in verdict["note"], (expect, verdict)
    assert correctness.judge_sketch([good], target, reference, omegas)["passed"]


# ------------------------------------------------------------------------------------------------
# CUDA: the worker sketches on the device, the parent too; both must be the CPU's sketch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_cuda_sketches_are_the_cpus(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    t = (torch.randn(1000, 777) * 3).to(dtype)
    cpu = _as_tensor(sketch.sketch_tensor(t, SEED, 0, 0.5))
    cuda = _as_tensor(sketch.sketch_tensor(t.cuda(), SEED, 0, 0.5))
    n = t.numel()
    assert float((cpu - cuda).abs().max()) < 2 * sketch.FEATURE_ROUNDING * math.sqrt(2 * n) + 1e-12 * n


@pytest.mark.gpu
def test_cuda_judge_passes_honest_and_fails_wrong_outputs() -> None:
    torch.manual_seed(4)
    truth = torch.randn(2048, 4096, dtype=torch.float64, device="cuda")
    reference = correctness.timed_reference(_expected(truth), _settings())
    omegas = [sketch.omega_for(reference["rms"][0])]
    target = [sketch.sketch_tensor(truth, 9, 0, omegas[0])]
    spec = {"seed": 9, "omega": omegas}
    device = torch.device("cuda")
    honest = correctness.judge_sketch(
        sketch.sketch_outputs([truth.float()], spec, device), target, reference, omegas
    )
    assert honest["passed"] and honest["ratio"] < 0.2, honest
    wrong = truth.float()
    wrong[-1] = 0
    assert not correctness.judge_sketch(
        sketch.sketch_outputs([wrong], spec, device), target, reference, omegas
    )["passed"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sketch.sketch_outputs([truth.float()], spec, device)
    assert torch.cuda.max_memory_allocated() - before < 200 << 20  # chunked: temporaries stay small


# -- the fused Triton kernel (kbv._sketch_kernel) ---------------------------------------------------

_FUSED_CHECK = r"""
import math, sys, torch
from kbv import sketch, _sketch_kernel
worst = 0.0
for n, dtype in [(1, torch.float32), (3, torch.float32), (1000, torch.float32), (4096, torch.float16),
                 (70001, torch.bfloat16), (300000, torch.float32)]:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    u, v, cols = sketch._basis(11, 0, n, x.device)
    omega = sketch.omega_for(float(x.float().pow(2).mean().sqrt()))
    exact = sketch._project(x, u, v, cols, omega, exact=True)
    fused = _sketch_kernel.project(x, u, v, cols, omega)
    allowance = sketch.FEATURE_ROUNDING * math.sqrt(2 * n)
    worst = max(worst, float((fused - exact).pow(2).mean().sqrt()) / allowance)
    wrong = x.clone(); wrong[n // 2] += 1.0  # one element moved: the sketch moves with it
    if n > 1:
        assert float((_sketch_kernel.project(wrong, u, v, cols, omega) - fused).abs().max()) > 100 * allowance
print(worst)
"""


def test_the_fused_kernel_gives_the_torch_paths_projections_under_the_interpreter() -> None:
    """The Triton kernel, run by Triton's interpreter on the CPU, against the float64 map: within a
    tenth of the rounding the judge allows for a float32 map, at sizes with and without a leftover
    row, for float32, float16 and bfloat16 outputs; and one changed element changes its sketch."""
    pytest.importorskip("triton", reason="Triton is not installed (the GPU image has it)")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_fused_kernel_gives_the_torch_paths_projections(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from kbv import _sketch_kernel

    for n in (1, 1000, 777 * 1000 + 3, 1 << 26):
        x = (torch.randn(n, device="cuda") * 3).to(dtype)
        u, v, cols = sketch._basis(11, 0, n, x.device)
        omega = sketch.omega_for(float(x.float().pow(2).mean().sqrt()))
        exact = sketch._project(x, u, v, cols, omega, exact=True)
        fused = _sketch_kernel.project(x, u, v, cols, omega)
        allowance = sketch.FEATURE_ROUNDING * math.sqrt(2 * n)
        assert float((fused - exact).pow(2).mean().sqrt()) < 0.1 * allowance, (n, dtype)


def test_the_fused_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """Triton compiles ahead of time for a target it is told (sm_90a here), so a kernel that would
    not build on the H200 fails on the CPU first."""
    triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU image has it)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kbv import _sketch_kernel

    signature = {
        "x_ptr": "*fp32", "u_ptr": "*fp64", "v_ptr": "*fp64", "part_ptr": "*fp64",
        "n": "i64", "cols": "i32", "rows_total": "i32", "omega": "fp32",
        **dict.fromkeys(("BLOCK_C", "ROWS", "VECTORS", "INTERPRETED"), "constexpr"),
    }  # fmt: skip
    constants = {
        "BLOCK_C": _sketch_kernel.BLOCK_COLS,
        "ROWS": _sketch_kernel.ROWS_PER_PROGRAM,
        "VECTORS": sketch.VECTORS,
        "INTERPRETED": False,
    }
    source = ASTSource(fn=_sketch_kernel._sketch_part, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert "fma.rn.f64" in ptx and "cos.approx" not in ptx  # float64 sums; libdevice, not approximations


def test_a_fused_kernel_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched on, the fused kernel is first held against the torch path on a check tensor, once
    per device: one that gives other projections (or raises) is never used; the torch path is."""
    from types import SimpleNamespace

    calls: list[int] = []

    def wrong(flat, u, v, cols, omega):
        calls.append(flat.numel())
        return torch.zeros((2, sketch.PROJECTIONS), dtype=torch.float64)

    monkeypatch.setattr(sketch, "_FUSED", SimpleNamespace(project=wrong))
    monkeypatch.setattr(sketch, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(sketch, "_FUSED_AGREES", {})
    t = torch.randn(300, 70)
    got = sketch.sketch_tensor(t, SEED, 0, 0.5)
    monkeypatch.setattr(sketch, "_FUSED", None)
    assert got == sketch.sketch_tensor(t, SEED, 0, 0.5)  # the torch path's, exactly
    assert calls == [sketch.FUSED_CHECK_ELEMENTS]  # the check ran once; the output never went through


_FUSED_IN_USE = r"""
import torch
from kbv import sketch, _sketch_kernel
t = torch.randn(300, 70)
plain = sketch.sketch_tensor(t, 5, 0, 0.5)
sketch._FUSED, sketch.FUSED_DEVICES = _sketch_kernel, ("cpu",)
fused = sketch.sketch_tensor(t, 5, 0, 0.5)
assert sketch._FUSED_AGREES == {"cpu:0": True}, sketch._FUSED_AGREES
print(max(abs(a - b) for key in ("re", "im") for a, b in zip(fused[key], plain[key])))
"""


def test_a_fused_kernel_that_agrees_sketches_outputs_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (the GPU image has it)")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _FUSED_IN_USE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    n = 300 * 70
    assert 0 < float(done.stdout.strip().splitlines()[-1]) < 0.1 * sketch.FEATURE_ROUNDING * math.sqrt(2 * n)
