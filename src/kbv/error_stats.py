"""Error statistics of an output against a float64 truth: numbers, not verdicts.

Shared by the trusted parent (:mod:`kbv.correctness` judges with them) and the trusted reference
worker, which computes a draw's baseline error next to the truth it holds (``expected`` requests,
``kbv.child.main``) so that neither the baseline's outputs nor its comparison cross to the parent.
Nothing here decides whether a candidate passes; a candidate worker never asks for it. All
arithmetic is float64, chunk by chunk on the tensors' own device; only scalars come back.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "baseline_error",
    "error_stats",
    "finite_sum_sq",
    "flat_chunks",
    "float_error",
    "relative_norm",
    "truth_summary",
]


def _is_inexact(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _as_f64(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.to(torch.float64)


def _count_message(outputs: Any, expected: list) -> str | None:
    if not isinstance(outputs, (list, tuple)):
        return f"outputs must be a list of tensors, got {type(outputs).__name__}"
    if len(outputs) != len(expected):
        return f"output count mismatch: got {len(outputs)} outputs, expected {len(expected)}"
    return None


#: Elements per chunk when comparing in float64: the temporaries of one comparison stay a few
#: hundred megabytes whatever the output's size (a 1.6e9-element output would need ~50 GB at once).
CHUNK_ELEMENTS = 1 << 25


def flat_chunks(*tensors: torch.Tensor) -> Any:
    """Aligned chunks of the flattened tensors (views where the tensors are contiguous)."""
    flat = [t.reshape(-1) for t in tensors]
    n = flat[0].numel()
    for start in range(0, max(n, 1), CHUNK_ELEMENTS):
        yield [f[start : start + CHUNK_ELEMENTS] for f in flat]


def finite_sum_sq(t: torch.Tensor) -> tuple[float, int]:
    """(sum of squares over the finite positions of ``t``, number of elements), in float64 chunks."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for (chunk,) in flat_chunks(t):
        c = _as_f64(chunk)
        total += torch.where(torch.isfinite(c), c, 0.0).square().sum()
    return float(total), t.numel()


def truth_summary(truth: list[Any], seed: int, omegas: list[float]) -> list[dict[str, Any] | None]:
    """What judging a timed call's sketch needs of one draw's float64 truth, without the truth: per
    output its sketch (``kbv.sketch.sketch_tensor`` under ``seed`` and the output's ``omega``), the
    sum of squares of its finite values and its element count, and whether it is inexact (an exact,
    integer output must be matched exactly); None for an output that is not a tensor. The trusted
    reference worker computes it for every unseen timing draw (``truth_sketches`` requests)."""
    from kbv.sketch import sketch_tensor  # stdlib and torch only, like this module

    summary: list[dict[str, Any] | None] = []
    for index, t in enumerate(truth):
        if not isinstance(t, torch.Tensor):
            summary.append(None)
            continue
        inexact = _is_inexact(t)
        sum_sq, n = finite_sum_sq(t) if inexact else (0.0, t.numel())
        omega = omegas[index] if index < len(omegas) else 1.0
        summary.append(
            {"sketch": sketch_tensor(t, seed, index, omega), "sum_sq": sum_sq, "n": n, "inexact": inexact}
        )
    return summary


def finite_rms(t: Any) -> float:
    """The RMS of an inexact tensor's finite values (0 for anything else): what the sketch's map
    frequency is set from (``kbv.sketch.omega_for``)."""
    if not isinstance(t, torch.Tensor) or not _is_inexact(t) or t.numel() == 0:
        return 0.0
    sum_sq, n = finite_sum_sq(t)
    return math.sqrt(sum_sq / n)


def error_stats(a: torch.Tensor, t: torch.Tensor, close: tuple[float, float] | None = None) -> dict[str, Any]:
    """Error statistics of ``a`` against ``t``, in float64, chunk by chunk on their device.

    ``mismatch``: positions where ``a`` does not reproduce ``t``'s NaN/Inf (same NaN positions,
    same signed inf). Over positions finite in both: ``peak`` = max|t|, ``max_abs`` = max|a - t|,
    ``sum_sq_diff`` and ``sum_sq_t``. With ``close = (atol, rtol)`` also ``close_fail``: positions
    where ``torch.isclose`` (NaN never equal) is false. Only scalars leave the device."""
    device = t.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    mismatch = torch.zeros((), dtype=torch.int64, device=device)
    close_fail = torch.zeros((), dtype=torch.int64, device=device)
    peak, max_abs, sum_sq_diff, sum_sq_t = zero.clone(), zero.clone(), zero.clone(), zero.clone()
    for ac, tc in flat_chunks(a, t):
        finite = None if a.is_complex() or t.is_complex() else _finite_chunk_stats(ac, tc)
        if finite is not None:
            peak, max_abs = torch.maximum(peak, finite[0]), torch.maximum(max_abs, finite[1])
            sum_sq_diff += finite[2]
            sum_sq_t += finite[3]
            if close is not None:
                close_fail += (~torch.isclose(_as_f64(ac), _as_f64(tc), rtol=close[1], atol=close[0])).sum()
            continue
        ac, tc = _as_f64(ac), _as_f64(tc)
        t_inf = torch.isinf(tc)
        bad = (torch.isnan(ac) != torch.isnan(tc)) | (torch.isinf(ac) != t_inf) | (t_inf & (ac != tc))
        mismatch += bad.sum()
        if close is not None:
            close_fail += (~torch.isclose(ac, tc, rtol=close[1], atol=close[0], equal_nan=False)).sum()
        mask = torch.isfinite(tc) & torch.isfinite(ac)
        tf = torch.where(mask, tc, zero)
        diff = torch.where(mask, ac - tc, zero)
        if tf.numel():
            peak = torch.maximum(peak, tf.abs().max())
            max_abs = torch.maximum(max_abs, diff.abs().max())
        sum_sq_diff += (diff * diff).sum()
        sum_sq_t += (tf * tf).sum()
    return {
        "mismatch": int(mismatch),
        "close_fail": int(close_fail),
        "peak": float(peak),
        "max_abs": float(max_abs),
        "sum_sq_diff": float(sum_sq_diff),
        "sum_sq_t": float(sum_sq_t),
        "n": t.numel(),
    }


def _finite_chunk_stats(ac: torch.Tensor, tc: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(max|t|, max|a - t|, sum (a - t)^2, sum t^2) of one chunk in float64, in five passes without
    masks, when every element of both is finite; None otherwise (the caller's masked path decides).

    The two sums of squares are the test: a NaN or an infinity in ``a`` or ``t`` makes one of them
    NaN or infinite (nothing in a sum turns them finite again), and a sum that overflows only sends
    the chunk to the masked path. On the H200 the masked path's dozen float64 temporaries cost
    0.2-0.3 s a draw on a 1.6e9-element output; the common, all-finite chunk needs none of them."""
    if not tc.numel():
        return None
    # float32 against float64 is promoted element by element: no float64 copy of the candidate's chunk
    promoted = ac.is_floating_point() and torch.float64 in (ac.dtype, tc.dtype)
    diff = torch.sub(ac if promoted else _as_f64(ac), tc)
    t64 = tc if tc.dtype == torch.float64 else _as_f64(tc)
    sum_sq_diff, sum_sq_t = torch.dot(diff, diff), torch.dot(t64, t64)
    if not bool(torch.isfinite(sum_sq_diff) & torch.isfinite(sum_sq_t)):
        return None
    inf = float("inf")
    peak, max_abs = torch.linalg.vector_norm(t64, ord=inf), torch.linalg.vector_norm(diff, ord=inf)
    return peak, max_abs, sum_sq_diff, sum_sq_t


def relative_norm(stats: dict[str, Any]) -> float:
    """||a - t||_2 / ||t||_2 over finite positions, with sqrt(n) (unit absolute scale) when t is all zeros."""
    denominator = math.sqrt(stats["sum_sq_t"]) if stats["sum_sq_t"] > 0 else math.sqrt(max(stats["n"], 1))
    return math.sqrt(stats["sum_sq_diff"]) / denominator


def float_error(a: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
    """Error of ``a`` against the float64 truth ``t`` in the error model's terms (see module doc)."""
    stats = error_stats(a, t)
    scale = stats["peak"] if stats["peak"] > 0 else 1.0
    return {
        "kind": "float",
        "scale": scale,
        "max_abs": stats["max_abs"],
        "elementwise": stats["max_abs"] / scale,
        "norm": relative_norm(stats),
        "nonfinite_mismatch": stats["mismatch"],
    }


def baseline_error(baseline_outputs: list, truth_outputs: list) -> dict[str, Any]:
    """The realistic baseline's own error against the float64 truth, per output.

    For a floating output with truth ``t`` and baseline ``b`` (positions finite in both):
    ``scale = max|t|`` (1 when t is all zeros), ``elementwise = max|b - t| / scale``,
    ``norm = ||b - t||_2 / ||t||_2`` (``||t||_2`` replaced by ``sqrt(n)`` when t is all zeros).
    Integer/bool outputs record their mismatch count. ``finite_match`` is False when the baseline
    does not reproduce the truth's NaN/Inf positions: the distribution is then outside what the
    baseline itself can compute (the evaluation should try :func:`kbv.inputs.domain_fallback`).
    """
    msg = _count_message(baseline_outputs, truth_outputs)
    if msg:
        raise ValueError(f"baseline_error: {msg}")
    per_output: list[dict[str, Any]] = []
    for b, t in zip(baseline_outputs, truth_outputs, strict=True):
        if tuple(b.shape) != tuple(t.shape):
            raise ValueError(
                f"baseline_error: shape {tuple(b.shape)} differs from the truth's {tuple(t.shape)}"
            )
        if _is_inexact(t):
            per_output.append(float_error(b, t))
        else:
            per_output.append({"kind": "exact", "mismatches": int((b != t).sum())})
    floats = [o for o in per_output if o["kind"] == "float"]
    return {
        "outputs": per_output,
        "elementwise": max((o["elementwise"] for o in floats), default=0.0),
        "norm": max((o["norm"] for o in floats), default=0.0),
        "finite_match": all(o.get("nonfinite_mismatch", 0) == 0 for o in per_output),
    }
