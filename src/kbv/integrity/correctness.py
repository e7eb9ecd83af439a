"""Checks derived from the correctness results (kind ``correctness``): made in the trusted parent
right after the correctness draws, under every protocol, from what the draws found
(:func:`correctness_findings`). A protocol's ``[integrity.severity]`` table applies to them as to
every check (``apply_severity``).

Evaluations in bf16 and fp16: what a failed tolerance says about precision. In a bf16 or fp16
evaluation (``Protocol.precision``) 16-bit compute is the precision asked for, not a hack, and the
static TF32/half-precision rules (``precision_cast``) are fp32's alone. What goes below the
evaluated precision (fp8, or fp16 accumulation of a long bf16 reduction) is caught by the error
model's tolerance, which is derived from the eager baseline's own error in that precision; the
``below_precision`` check then names what errors of that size point to, so the record says more
than "incorrect". It is ``info``: the outcome is already ``incorrect``. docs/correctness.md, "Half
precision".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kbv.integrity._registry import get_check, list_checks, register_check
from kbv.records import DistributionResult, Finding


@dataclass(frozen=True)
class CorrectnessContext:
    """What the ``correctness`` checks read: the evaluated precision, the draws' results per
    distribution and the candidate's source text."""

    precision: str
    results: tuple[DistributionResult, ...]
    candidate_source: str = ""


def correctness_findings(
    precision: str, results: Sequence[DistributionResult], candidate_source: str = ""
) -> list[Finding]:
    """Every ``correctness`` check's findings on the draws' results, at its default severity (apply
    a protocol's overrides afterwards with ``apply_severity``)."""
    ctx = CorrectnessContext(precision, tuple(results), candidate_source)
    return [finding for check in list_checks("correctness") for finding in check.run(ctx)]


#: Source text that computes below bf16/fp16: fp8 dtypes, their CUDA types and PTX formats.
_FP8 = re.compile(r"float8\w*|\bfp8\w*|__nv_fp8\w*|\be4m3\w*|\be5m2\w*|CUDA_R_8F\w*", re.IGNORECASE)
#: fp16 in a bf16 evaluation: fewer exponent bits (overflow past 65504) and, accumulated, an error
#: that grows with the reduction's length.
_FP16 = re.compile(r"\bfloat16\b|\.half\(\)|\bhalf\b|__half\w*|\bkHalf\b|CUDA_R_16F\b")


@register_check(
    name="below_precision",
    kind="correctness",
    default_severity="info",
    doc="""A bf16 or fp16 evaluation whose outputs missed the error model's tolerance by a finite
    error (a structural failure, a shape or dtype, says nothing about precision). The tolerance
    comes from eager PyTorch's own error in that precision, so errors of this size point to
    computing below it: fp8, or a long reduction accumulated in fp16 (or in the evaluated precision)
    instead of float32. The finding names the worst output's error against its tolerance and the
    fp8 or float16 names the source uses. It is info: the outcome is already incorrect, and this
    says why. Made from the correctness results under every protocol; never in fp32.""",
)
def check_below_precision(ctx: CorrectnessContext) -> list[Finding]:
    """The ``below_precision`` finding of a bf16 or fp16 evaluation whose outputs missed the error
    model's tolerance by a finite error (none in fp32, none when every distribution passed)."""
    precision = ctx.precision
    if precision == "fp32":
        return []
    missed = [r for r in ctx.results if r.applicable and not r.passed and _finite_miss(r)]
    if not missed:
        return []
    first = missed[0]
    where = _worst_output(first.tolerance or {})
    detail = (
        f"the outputs under {first.name} err by {where} in a {precision} evaluation, where the "
        f"tolerance comes from eager PyTorch's own error in {precision}: errors of this size point to "
        f"computing below {precision} (fp8, or a long reduction accumulated in fp16 or {precision} "
        "instead of float32)"
    )
    named = _named_in_source(precision, ctx.candidate_source)
    if named:
        detail += f"; the source uses {named}"
    return [Finding("below_precision", get_check("below_precision").default_severity, detail)]


def _finite_miss(result: DistributionResult) -> bool:
    tolerance = result.tolerance or {}
    if tolerance.get("mode") not in ("error_model", "allclose") or "error" in tolerance:
        return False  # a structural failure (shape, dtype) says nothing about precision
    rel = result.rel_err
    return rel is not None and rel == rel and rel != float("inf")


def _worst_output(tolerance: dict[str, Any]) -> str:
    """``norm 3.1e-02 against a tolerance of 9.0e-03`` for the output that missed most."""
    worst = ""
    worst_ratio = -1.0
    for output in tolerance.get("outputs") or []:
        if output.get("kind") != "float" or output.get("passed", True):
            continue
        err, tol = output.get("norm_err"), output.get("norm_tol")
        numbers = isinstance(err, (int, float)) and isinstance(tol, (int, float)) and tol > 0
        ratio = err / tol if numbers else -1.0
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = f"a relative norm of {err:.2g} against a tolerance of {tol:.2g}"
    return worst or "more than the tolerance"


def _named_in_source(precision: str, source: str) -> str:
    names = []
    if _FP8.search(source):
        names.append("fp8")
    if precision == "bf16" and _FP16.search(source):
        names.append("float16")
    return " and ".join(names)
