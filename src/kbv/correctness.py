"""Output comparison: structure, KernelBench's fixed tolerance, and kbv's error model.

Runs only in the trusted parent process; never imported by the worker before candidate code.
``docs/correctness.md`` gives the formulas and the reasons. Every dict returned here is plain JSON
data (floats, ints, strings, lists), ready for a record.

Conventions: outputs are lists of tensors (a single-output problem is a 1-list). All arithmetic is
done in float64 on the tensors' own device; only scalars come back to the host.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kbv.error_stats import (
    _as_f64,
    _count_message,
    _is_inexact,
    baseline_error,
    error_stats,
    finite_sum_sq,
    flat_chunks,
    float_error,
    relative_norm,
)
from kbv.protocol import CorrectnessSettings
from kbv.records import DistributionResult
from kbv.sketch import FEATURE_ROUNDING, PROJECTIONS

__all__ = [
    "baseline_error",
    "one_thread_on_the_cpu",
    "check_structure",
    "compare_allclose",
    "compare_error_model",
    "judge_distribution",
    "reduction_floor",
    "reduction_lengths",
]

_HALF = (torch.float16, torch.bfloat16)
#: Unit roundoff of float32 (2**-24): half an ulp of 1.
FP32_UNIT_ROUNDOFF = 2.0**-24


#: Up to this many elements a CPU comparison runs on one thread (:func:`one_thread_on_the_cpu`).
ONE_THREAD_ELEMENTS = 1 << 24


@contextlib.contextmanager
def one_thread_on_the_cpu(*tensor_lists: Sequence[Any]) -> Iterator[None]:
    """The parent's comparison of CPU tensors of at most :data:`ONE_THREAD_ELEMENTS` elements in all
    runs on one intra-op thread (the setting is restored after). A parallel region waits for every
    thread of PyTorch's pool, and on a CPU shared with the workers and other jobs one of them often
    waits for a core: a comparison of 400k elements took a median 46-105 ms on two threads and 17 ms
    on one on two loaded cores (load 4.3; the work itself is well under a millisecond when a core is
    free). A few passes over a few million elements gain little from a second thread; the
    comparison and its result are the same either way."""
    tensors = [t for group in tensor_lists for t in group if isinstance(t, torch.Tensor)]
    small = sum(t.numel() for t in tensors) <= ONE_THREAD_ELEMENTS
    threads = torch.get_num_threads()
    if not tensors or threads == 1 or not small or any(t.device.type != "cpu" for t in tensors):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def stand_in(value: Any) -> Any:
    """A tensor's dtype and shape without its memory (on the meta device); anything else as it is.
    What judging needs of a reference output that is not kept."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def check_structure(outputs: Any, expected: list) -> str | None:
    """None when ``outputs`` match ``expected`` in count, exact type, layout, shape and dtype.

    Otherwise a one-line message naming the first difference. Tensor subclasses are rejected
    (``type(out) is torch.Tensor``): a subclass can run its work lazily when the checker touches it.
    """
    msg = _count_message(outputs, expected)
    if msg:
        return msg
    for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
        if type(out) is not torch.Tensor:
            return f"output {i}: type {type(out).__module__}.{type(out).__qualname__} is not torch.Tensor"
        if out.layout != torch.strided:
            return f"output {i}: layout {out.layout} is not torch.strided"
        if out.is_meta:
            return f"output {i}: a meta tensor has no data"
        if tuple(out.shape) != tuple(exp.shape):
            return f"output {i}: shape mismatch: got {tuple(out.shape)}, expected {tuple(exp.shape)}"
        if out.dtype != exp.dtype:
            return f"output {i}: dtype mismatch: got {out.dtype}, expected {exp.dtype}"
    return None


def compare_allclose(
    outputs: list, expected: list, settings: CorrectnessSettings
) -> tuple[bool, float, float, dict[str, Any]]:
    """KernelBench's check: ``torch.allclose(out, exp, atol, rtol)`` per output, NaN never equal.

    Tolerances: ``atol_fp32``/``rtol_fp32`` for float32/float64, ``atol_half``/``rtol_half`` for
    float16/bfloat16; integer and bool outputs must be equal. Returns (passed, max_abs_err, rel_err,
    tolerance) where max_abs_err is max |out - exp| and rel_err is max over outputs of
    ||out - exp||_2 / ||exp||_2, both over positions finite in both (inf when the non-finite
    positions differ).
    """
    msg = check_structure(outputs, expected)
    if msg:
        return False, math.inf, math.inf, {"mode": "allclose", "error": msg}
    passed = True
    max_abs = 0.0
    rel = 0.0
    per_output: list[dict[str, Any]] = []
    for out, exp in zip(outputs, expected, strict=True):
        if not _is_inexact(exp):
            mismatches = int((out != exp).sum())
            ok = mismatches == 0
            passed &= ok
            if not ok:
                max_abs = (
                    math.inf
                    if exp.dtype == torch.bool
                    else max(max_abs, float((out.to(torch.float64) - exp.to(torch.float64)).abs().max()))
                )
                rel = max(rel, mismatches / max(exp.numel(), 1))
            per_output.append({"kind": "exact", "dtype": str(exp.dtype), "mismatches": mismatches})
            continue
        atol, rtol = (
            (settings.atol_half, settings.rtol_half)
            if exp.dtype in _HALF
            else (settings.atol_fp32, settings.rtol_fp32)
        )
        stats = error_stats(out, exp, close=(atol, rtol))
        ok = stats["close_fail"] == 0
        passed &= ok
        err_abs, err_rel = (
            (math.inf, math.inf) if stats["mismatch"] else (stats["max_abs"], relative_norm(stats))
        )
        max_abs = max(max_abs, err_abs)
        rel = max(rel, err_rel)
        per_output.append(
            {"kind": "float", "dtype": str(exp.dtype), "atol": atol, "rtol": rtol, "passed": ok}
        )
    tol = {"mode": "allclose", "atol": settings.atol_fp32, "rtol": settings.rtol_fp32, "outputs": per_output}
    return passed, max_abs, rel, tol


def reduction_lengths(input_numels: Sequence[int], outputs: Sequence[Any]) -> list[int]:
    """Per output, how many input elements each of its elements reduces at most, from shapes alone:
    the largest floating input's element count over the output's (at least 1). A mean over 1e9
    elements is 1e9; a row sum of a (B, D) input is D; an elementwise op is 1."""
    largest = max((int(n) for n in input_numels), default=0)
    lengths = []
    for out in outputs:
        numel = out.numel() if isinstance(out, torch.Tensor) else 1
        lengths.append(max(1, largest // max(numel, 1)))
    return lengths


def reduction_floor(length: int, settings: CorrectnessSettings) -> float:
    """The relative error an honest float32 reduction of ``length`` terms may make in an order of its
    own: one float32 partial sum per ``reduction_block`` elements, the partials added one after
    another into one value (atomics), whose worst case is ``2**-24`` per addition. That is
    ``2**-24 * ceil(length / reduction_block)``, capped at ``reduction_floor_cap``; 0 when
    ``reduction_block`` is 0 (off). docs/correctness.md has the measurements behind it."""
    block = int(settings.reduction_block)
    if block <= 0 or length <= 1:
        return 0.0
    return min(settings.reduction_floor_cap, FP32_UNIT_ROUNDOFF * math.ceil(length / block))


def compare_error_model(
    outputs: list,
    truth_outputs: list,
    baseline_err: dict[str, Any],
    settings: CorrectnessSettings,
    reduction_lengths: Sequence[int] | None = None,
) -> tuple[bool, float, float, dict[str, Any]]:
    """kbv's check: the candidate may be ``error_multiple`` times as wrong as the baseline, no more.

    For each floating output (terms as in :func:`baseline_error`, with the candidate ``a``):
    passes when the NaN/Inf positions equal the truth's (an inf must be the same inf), and
    ``max|a - t| / scale <= max(error_multiple * baseline elementwise, elementwise_floor)`` and
    ``||a - t|| / ||t|| <= max(error_multiple * baseline norm, norm_floor)``. Integer/bool outputs
    must equal the truth exactly. With ``reduction_lengths`` (one per output, see
    :func:`reduction_lengths`) both floors of an output are raised to :func:`reduction_floor` of its
    length, so another honest summation order is not mistaken for a wrong kernel.
    Returns (passed, max_abs_err, rel_err, tolerance): max_abs_err is
    the largest unscaled |a - t|, rel_err the largest relative norm error (inf on a NaN/Inf
    mismatch); tolerance holds the per-output limits and scaled errors.
    """
    base_outputs = baseline_err.get("outputs", [])
    msg = _count_message(outputs, truth_outputs)
    if msg is None and len(base_outputs) != len(truth_outputs):
        msg = f"baseline error covers {len(base_outputs)} outputs, the truth has {len(truth_outputs)}"
    tol: dict[str, Any] = {
        "mode": "error_model",
        "error_multiple": settings.error_multiple,
        "elementwise_floor": settings.elementwise_floor,
        "norm_floor": settings.norm_floor,
    }
    if msg:
        return False, math.inf, math.inf, {**tol, "error": msg}
    passed = True
    max_abs = 0.0
    rel = 0.0
    per_output: list[dict[str, Any]] = []
    for i, (out, truth, base) in enumerate(zip(outputs, truth_outputs, base_outputs, strict=True)):
        if type(out) is not torch.Tensor or tuple(out.shape) != tuple(truth.shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return False, math.inf, math.inf, {**tol, "error": f"output {i}: {got} does not match the truth"}
        if not _is_inexact(truth):
            if _is_inexact(out):
                return (
                    False,
                    math.inf,
                    math.inf,
                    {**tol, "error": f"output {i}: floating output, exact expected"},
                )
            mismatches = int((out != truth).sum())
            passed &= mismatches == 0
            if mismatches:
                max_abs = max(max_abs, float((out.to(torch.float64) - truth.to(torch.float64)).abs().max()))
                rel = max(rel, mismatches / max(truth.numel(), 1))
            per_output.append({"kind": "exact", "mismatches": mismatches, "passed": mismatches == 0})
            continue
        length = (
            int(reduction_lengths[i]) if reduction_lengths is not None and i < len(reduction_lengths) else 1
        )
        entry, out_abs, out_rel = _float_output_judged(out, truth, base, length, settings)
        passed &= entry["passed"]
        max_abs, rel = max(max_abs, out_abs), max(rel, out_rel)
        per_output.append(entry)
    return passed, max_abs, rel, {**tol, "outputs": per_output}


def _float_output_judged(
    out: torch.Tensor, truth: torch.Tensor, base: dict[str, Any], length: int, settings: CorrectnessSettings
) -> tuple[dict[str, Any], float, float]:
    """One floating output under the error model: its tolerance entry, its largest unscaled
    |a - t| and its relative norm error (both inf on a NaN/Inf mismatch)."""
    err = float_error(out, truth)
    elem_tol, norm_tol = _error_model_limits(base, length, settings)
    ok = err["nonfinite_mismatch"] == 0 and err["elementwise"] <= elem_tol and err["norm"] <= norm_tol
    entry = {
        "kind": "float",
        "scale": err["scale"],
        "elementwise_err": err["elementwise"],
        "elementwise_tol": elem_tol,
        "norm_err": err["norm"],
        "norm_tol": norm_tol,
        "reduction_length": length,
        "reduction_floor": reduction_floor(length, settings),
        "nonfinite_mismatch": err["nonfinite_mismatch"],
        "passed": ok,
    }
    if err["nonfinite_mismatch"]:
        return entry, math.inf, math.inf
    return entry, err["max_abs"], err["norm"]


def _error_model_limits(
    base: dict[str, Any], length: int, settings: CorrectnessSettings
) -> tuple[float, float]:
    """(elementwise, norm) limits of one floating output under the error model (scaled errors)."""
    floor = reduction_floor(length, settings)
    elem_tol = max(
        settings.error_multiple * float(base.get("elementwise", 0.0)), settings.elementwise_floor, floor
    )
    norm_tol = max(settings.error_multiple * float(base.get("norm", 0.0)), settings.norm_floor, floor)
    return elem_tol, norm_tol


# ------------------------------------------------------------------------------------------------
# Sketches of timed calls (kbv.sketch): every timed call judged without keeping its outputs

#: A timed call's output passes when its sketch differs from the reference's by at most this many
#: times what an output at the correctness check's L2 bound would give on average (the RMS over the
#: projections of the mapped difference, divided by ``omega`` x the L2 bound). For an honest output
#: at the bound the mean square over the projections has expectation at most 1; in the worst case
#: (the whole error in one element, or any rank-one error) the ratio is the square root of a product
#: of two independent chi-square(8)/8 variables, which 40 million draws never took above 4 (above 3:
#: 2.5e-5 of them). Honest candidates measured 0.22 at most (docs/integrity-dynamic.md).
SKETCH_LIMIT = 4.0
#: Rounding of the projections (float64 sums over every element, in the worker and in the parent),
#: per element: it keeps the limit above zero for exact (integer) outputs, whose L2 bound is 0.
SKETCH_ROUNDING = 1e-12
#: Non-finite positions must match: their projections (sums of 0/1 masks) may differ by rounding only.
_MASK_ROUNDING = 1e-9


def _allclose_l2(reference: torch.Tensor, atol: float, rtol: float) -> float:
    """The L2 norm of ``atol + rtol |reference|`` over its finite positions: no output that passes
    ``allclose`` differs from the reference by more than this in L2."""
    total = torch.zeros((), dtype=torch.float64, device=reference.device)
    for (chunk,) in flat_chunks(reference):
        c = _as_f64(chunk)
        total += torch.where(torch.isfinite(c), atol + rtol * c.abs(), 0.0).square().sum()
    return math.sqrt(float(total))


def timed_reference(
    expected: dict[str, Any], settings: CorrectnessSettings, reduction_lengths: Sequence[int] | None = None
) -> dict[str, Any]:
    """What judging a timed call's sketch needs from one draw's expected outputs (the evaluation's
    ``expected``: ``truth`` and ``baseline_err`` under the error model, ``reference`` otherwise):
    ``targets`` (the tensors whose sketches a right output must match), ``like`` (dtype and shape a
    candidate's output must have), ``tolerances`` (per output, the L2 distance from the target that
    the correctness check accepts: the norm limit x ||t|| under the error model, the L2 norm of
    ``atol + rtol |ref|`` under ``allclose``; 0 for an exact output), ``rms`` per output (0 for an
    exact one) and ``nan_equal`` (whether a NaN may match a NaN: not under ``allclose``)."""
    like = list(expected["reference"]["outputs"])
    error_model = settings.mode == "error_model"
    targets = list(expected["truth"]["outputs"]) if error_model else list(like)
    base = (expected.get("baseline_err") or {}).get("outputs") or []
    tolerances: list[float] = []
    rms: list[float] = []
    for i, target in enumerate(targets):
        if not isinstance(target, torch.Tensor) or not _is_inexact(target):
            tolerances.append(0.0)
            rms.append(0.0)
            continue
        sum_sq, n = finite_sum_sq(target)
        rms.append(math.sqrt(sum_sq / n) if n else 0.0)
        if error_model:
            length = (
                int(reduction_lengths[i])
                if reduction_lengths is not None and i < len(reduction_lengths)
                else 1
            )
            _, norm_tol = _error_model_limits(base[i] if i < len(base) else {}, length, settings)
            # the error model's relative norm: ||a - t|| / ||t||, with sqrt(n) for an all-zero truth
            tolerances.append(norm_tol * (math.sqrt(sum_sq) if sum_sq > 0 else math.sqrt(max(n, 1))))
        else:
            atol, rtol = (
                (settings.atol_half, settings.rtol_half)
                if target.dtype in _HALF
                else (settings.atol_fp32, settings.rtol_fp32)
            )
            tolerances.append(_allclose_l2(target, atol, rtol))
    return {"targets": targets, "like": like, "tolerances": tolerances, "rms": rms, "nan_equal": error_model}


def described_like(described: Any) -> Any:
    """A meta tensor of the shape and dtype a trusted worker described (``[shape, "float32"]``), or
    None (an output that is no tensor): what judging needs of an output the parent never held."""
    if described is None:
        return None
    shape, name = described
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the reference worker described an output of unknown dtype {name!r}")
    return torch.empty([int(n) for n in shape], dtype=dtype, device="meta")


def unseen_reference(
    summary: list[Any],
    like: list[Any],
    baseline_err: dict[str, Any],
    settings: CorrectnessSettings,
    reduction_lengths: Sequence[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`timed_reference` for an unseen timing draw whose truth the parent never held: from the
    reference worker's summary of it (``kbv.error_stats.truth_summary``: per output its sketch, the
    sum of squares and count of its finite values) and the error model's norm limit of the
    baseline's error measured on the phase's first unseen draw (the draws are of one distribution).
    Returns (the target sketches, the judging data :func:`judge_sketch` reads)."""
    if settings.mode != "error_model":
        raise ValueError("unseen_reference needs correctness.mode = error_model (the norm limit)")
    base = baseline_err.get("outputs") or []
    targets: list[dict[str, Any]] = []
    tolerances: list[float] = []
    rms: list[float] = []
    for i, entry in enumerate(summary):
        if not isinstance(entry, dict):
            targets.append({})
            tolerances.append(0.0)
            rms.append(0.0)
            continue
        targets.append(entry["sketch"])
        sum_sq, n = float(entry["sum_sq"]), int(entry["n"])
        if not entry.get("inexact"):
            tolerances.append(0.0)
            rms.append(0.0)
            continue
        rms.append(math.sqrt(sum_sq / n) if n else 0.0)
        length = (
            int(reduction_lengths[i]) if reduction_lengths is not None and i < len(reduction_lengths) else 1
        )
        _, norm_tol = _error_model_limits(base[i] if i < len(base) else {}, length, settings)
        tolerances.append(norm_tol * (math.sqrt(sum_sq) if sum_sq > 0 else math.sqrt(max(n, 1))))
    return targets, {"like": list(like), "tolerances": tolerances, "rms": rms, "nan_equal": True}


def _floats(value: Any, n: int) -> list[float] | None:
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value):
        return None
    return [float(x) for x in value]


def _nonfinite_problem(
    got: Any, target: dict[str, Any] | None, projections: int, nan_equal: bool
) -> str | None:
    """Why the non-finite values of an output's sketch do not match the target's, or None."""
    want = target or {"nan": 0, "posinf": 0, "neginf": 0}
    have = got if got is not None else {"nan": 0, "posinf": 0, "neginf": 0}
    if not isinstance(have, dict):
        return "malformed description of non-finite values"
    if have.get("nan") and not nan_equal:
        return f"{have.get('nan')} NaN values (allclose never accepts a NaN)"
    for kind in ("nan", "posinf", "neginf"):
        if have.get(kind, 0) != want.get(kind, 0):
            return f"{have.get(kind, 0)} {kind} values where the reference has {want.get(kind, 0)}"
        if not want.get(kind):
            continue
        at, want_at = _floats(have.get(f"{kind}_at"), projections), want[f"{kind}_at"]
        limit = _MASK_ROUNDING * max(1, int(want[kind]))
        if at is None or any(abs(a - b) > limit for a, b in zip(at, want_at, strict=True)):
            return f"{kind} values at other positions than the reference's"
    return None


def judge_sketch(
    got: Any, target_sketches: list[dict[str, Any]], reference: dict[str, Any], omegas: Sequence[float]
) -> dict[str, Any]:
    """Judge one timed call from the worker's sketch of its outputs (``kbv.sketch.sketch_outputs``)
    against the sketches of the reference's ``targets`` (same seed and ``omegas``), with
    ``reference`` from :func:`timed_reference`.

    Structure first (count, exact type ``torch.Tensor``, dtype, shape); then non-finite values must
    match; then per output ``ratio = sqrt(mean_k |got_k - target_k|^2) / (omega x tolerance +
    FEATURE_ROUNDING x sqrt(2n) + SKETCH_ROUNDING x n)`` (the second term for the worker's float32
    cosine and sine), and the call passes when every ratio is at most :data:`SKETCH_LIMIT`.
    Anything malformed (a hostile worker's reply) is a wrong output, never an exception. Returns
    ``{"passed", "ratio" (the largest; None when structure failed), "note"}``."""
    like = reference["like"]
    if not isinstance(got, list) or not all(isinstance(e, dict) for e in got):
        return {
            "passed": False,
            "ratio": None,
            "note": "the worker reported no sketch of this call's outputs",
        }
    if len(got) != len(like):
        return {
            "passed": False,
            "ratio": None,
            "note": f"output count mismatch: got {len(got)} outputs, expected {len(like)}",
        }
    worst = 0.0
    for i, (entry, exp, target) in enumerate(zip(got, like, target_sketches, strict=True)):
        if not isinstance(exp, torch.Tensor):  # the reference's own output is no tensor: nothing to judge
            continue
        if entry.get("type") != "torch.Tensor":
            return {
                "passed": False,
                "ratio": None,
                "note": f"output {i}: type {entry.get('type')} is not torch.Tensor",
            }
        if entry.get("dtype") != str(exp.dtype):
            return {
                "passed": False,
                "ratio": None,
                "note": f"output {i}: dtype mismatch: got {entry.get('dtype')}, expected {exp.dtype}",
            }
        if entry.get("shape") != list(exp.shape):
            return {
                "passed": False,
                "ratio": None,
                "note": f"output {i}: shape mismatch: got {entry.get('shape')}, expected {list(exp.shape)}",
            }
        re, im = _floats(entry.get("re"), PROJECTIONS), _floats(entry.get("im"), PROJECTIONS)
        if re is None or im is None:
            return {"passed": False, "ratio": None, "note": f"output {i}: malformed sketch"}
        problem = _nonfinite_problem(
            entry.get("nonfinite"), target.get("nonfinite"), PROJECTIONS, reference["nan_equal"]
        )
        if problem:
            return {"passed": False, "ratio": math.inf, "note": f"output {i}: {problem}"}
        squares = [
            (a - b) ** 2 + (c - d) ** 2 for a, b, c, d in zip(re, target["re"], im, target["im"], strict=True)
        ]
        spread = math.sqrt(sum(squares) / PROJECTIONS)
        n = math.prod(exp.shape) * (2 if exp.is_complex() else 1)
        scale = (
            float(omegas[i]) * float(reference["tolerances"][i])
            + FEATURE_ROUNDING * math.sqrt(2 * max(1, n))
            + SKETCH_ROUNDING * max(1, n)
        )
        worst = max(worst, spread / scale)
    passed = worst <= SKETCH_LIMIT
    note = "" if passed else f"sketch {worst:.3g}x the tolerance's (limit {SKETCH_LIMIT:g})"
    return {"passed": passed, "ratio": worst, "note": note}


def _worst(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if v is not None]
    if not nums:
        return None
    return math.inf if any(math.isnan(v) for v in nums) else max(nums)


def judge_distribution(
    name: str,
    draws: list[dict[str, Any]],
    settings: CorrectnessSettings,
    *,
    applicable: bool | None = None,
    note: str | None = None,
) -> DistributionResult:
    """Aggregate the draws of one distribution into its record entry.

    Each draw is a dict with ``passed``, ``max_abs_err``, ``rel_err``, ``tolerance``,
    ``baseline_err`` and ``note`` (and optionally ``applicable``). The distribution passes only if
    it is applicable, has at least one draw and every draw passed; errors are the worst over draws;
    tolerance and baseline_err are those of the first failing draw (else the last draw), with a
    compact per-draw summary under ``tolerance["draws"]``. A distribution that is not applicable
    (``applicable=False``, or any draw saying so) has ``passed=False`` and must be skipped when
    deciding ``correct``; its note says why.
    """
    notes = [str(d.get("note") or "") for d in draws]
    if note:
        notes.insert(0, note)
    if applicable is None:
        applicable = bool(draws) and all(d.get("applicable", True) for d in draws)
        if not draws:
            notes.insert(0, "no draws were run")
    if applicable and len(draws) < settings.draws_per_distribution:
        notes.append(f"only {len(draws)} of {settings.draws_per_distribution} draws ran")
    unique_notes = list(dict.fromkeys(n for n in notes if n))
    failing = [d for d in draws if not d.get("passed")]
    chosen = failing[0] if failing else (draws[-1] if draws else None)
    tolerance: dict[str, Any] | None = None
    if chosen is not None:
        tolerance = dict(chosen.get("tolerance") or {})
        tolerance["draws"] = [
            {
                "passed": bool(d.get("passed")),
                "max_abs_err": d.get("max_abs_err"),
                "rel_err": d.get("rel_err"),
            }
            for d in draws
        ]
    return DistributionResult(
        name=name,
        applicable=bool(applicable),
        passed=bool(applicable) and bool(draws) and not failing,
        max_abs_err=_worst([d.get("max_abs_err") for d in draws]),
        rel_err=_worst([d.get("rel_err") for d in draws]),
        tolerance=tolerance,
        note="; ".join(unique_notes),
        baseline_err=chosen.get("baseline_err") if chosen is not None else None,
        draws=len(draws),
    )
