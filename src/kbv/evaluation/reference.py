"""The reference's outputs for a draw: computed once per (parameters, inputs), finite or moved to a
domain-preserving variant, and what judging under the error model needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kbv import correctness, inputs, wire, wire_replies
from kbv.error_stats import flat_chunks
from kbv.evaluation.context import HarnessError, _Context, _structure
from kbv.evaluation.requests import _run
from kbv.problems import Problem
from kbv.worker import Worker, WorkerFailed


def _usable_reference(
    ctx: _Context, reference: Worker, variant: str, seed: int, first: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """The reference on ``variant`` (``first``, where it was asked for ahead), or on the first
    domain-preserving fallback where it is finite.

    The problem's own inputs define its domain, so ``original`` never falls back."""
    candidate: str | None = variant
    while candidate is not None:
        if first is not None and candidate == variant:
            expected = first
        else:
            expected = _reference_outputs(ctx, reference, candidate, seed)
        if candidate == "original":
            _check_finite_once_cast(ctx, expected)
            return expected, candidate
        if _finite_reference(ctx, expected):
            return expected, candidate
        candidate = inputs.domain_fallback(candidate)
    return None, variant


def _check_finite_once_cast(ctx: _Context, expected: dict[str, Any]) -> None:
    """In bf16 or fp16, a reference whose output on the problem's own inputs is not finite once
    cast (fp16 overflows past 65504) cannot be judged in that precision: the problem's failure for
    that precision (``problem_error``), never the candidate's. fp32 keeps what it always did."""
    precision = ctx.protocol.precision
    if precision == "fp32":
        return
    if ctx.protocol.correctness.mode == "error_model":
        finite = bool(expected["baseline_err"].get("finite_match", True))
    else:
        finite = _all_finite(expected["reference"]["outputs"])
    if not finite:
        raise WorkerFailed(
            "runtime_error",
            f"the reference's output on the problem's own inputs is not finite in {precision} "
            f"(where its float64 truth is): the problem cannot be evaluated in {precision}; "
            "evaluate it in fp32 (--precision fp32)",
            role="reference",
        )


def _finite_reference(ctx: _Context, expected: dict[str, Any]) -> bool:
    """Truth finite, and the realistic baseline finite wherever the truth is (fp32 overflow)."""
    if ctx.protocol.correctness.mode != "error_model":
        return _all_finite(expected["reference"]["outputs"])
    if not _all_finite(expected["truth"]["outputs"]):
        return False
    return bool(expected["baseline_err"].get("finite_match", True))


def _reference_outputs(
    ctx: _Context,
    reference: Worker,
    distribution: str,
    seed: int,
    *,
    mix_seed: int | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """The reference's outputs: in fp32 for ``allclose``; under the error model the realistic baseline
    (TF32 on the GPU, fp32 on the CPU, which also gives the shapes and dtypes to expect) and the
    float64 truth. Computed once per (parameters, inputs) and reused (``fresh`` runs them again:
    confirming a failure must not lean on the first run)."""
    key = _expected_key(ctx, distribution, seed, mix_seed)
    cached = None if fresh else ctx.cache.expected.get(key)
    if cached is not None:
        return cached
    if ctx.protocol.correctness.mode == "error_model":
        return _expected_reply(ctx, reference, _send_expected(ctx, reference, distribution, seed, mix_seed))
    # KernelBench's check compares with the reference as PyTorch runs it by default (cuDNN may
    # use TF32, matmuls may not), the very settings a plain PyTorch candidate runs with.
    expected = {"reference": _run(reference, distribution, seed, "default", mix_seed=mix_seed)}
    ctx.cache.expected.put(key, expected)
    return expected


def _expected_key(ctx: _Context, distribution: str, seed: int, mix_seed: int | None) -> tuple[Any, ...]:
    """A draw's key in the evaluation's cache of reference outputs: the parameters, then the inputs."""
    return (ctx.cache.state_key, distribution, int(seed), mix_seed)


@dataclass(frozen=True)
class _Asked:
    """An ``expected`` request sent and not yet answered: its cache key, id and whether it asked
    for the TF32-sensitive operators."""

    key: tuple[Any, ...]
    request_id: int
    record: bool


def _send_expected(
    ctx: _Context, reference: Worker, distribution: str, seed: int, mix_seed: int | None = None
) -> _Asked:
    """The first half of an error-model draw's reference (:func:`_expected_reply` reads it): the
    realistic baseline (TF32 on the GPU, fp32 on the CPU) and the float64 truth, asked for."""
    # TF32 exists only for fp32: a bf16 or fp16 evaluation's realistic baseline is eager in it.
    on_cuda = ctx.device.startswith("cuda") and ctx.protocol.precision == "fp32"
    # Asked once: a forward that refuses the recorder runs twice each time it is asked.
    record = on_cuda and not ctx.cache.tf32_operators_asked and _dispatcher_sees_all(ctx.problem)
    if record:
        ctx.cache.tf32_operators_asked = True
    request = wire.Expected(
        distribution=distribution,
        seed=seed,
        mix_seed=mix_seed,
        precision="tf32" if on_cuda else "fp32",
        out_path=reference.new_path("out"),
        record_operators=record,
    )
    key = _expected_key(ctx, distribution, seed, mix_seed)
    return _Asked(key, reference.send_request(request), record)


def _expected_reply(ctx: _Context, reference: Worker, asked: _Asked) -> dict[str, Any]:
    """The reference's answer to ``asked``, its truth copied into the parent's memory, and cached."""
    reply = wire_replies.ExpectedReply.of(reference.receive_reply(asked.request_id))
    if asked.record:
        ctx.cache.tf32_operators = reply.tf32_operators
    if reply.upcast_on_host and reference.last_span is not None:
        # Seconds a draw each on an H100 where the device is short of room: the record says so
        # (phases_s "reference:upcast_on_host"), where it would otherwise read as slow judging.
        span = reference.last_span.replied_at - reference.last_span.sent_at
        phases = ctx.found.phases
        phases["reference:upcast_on_host"] = phases.get("reference:upcast_on_host", 0.0) + span
    expected = _error_model_expected(reference, reply)
    ctx.cache.expected.put(asked.key, expected)
    return expected


#: What a problem's source uses to run compiled code that the dispatcher (and so the recorder of
#: TF32-sensitive operators) may not see: such a problem times both baselines.
_OUTSIDE_DISPATCHER = ("cpp_extension", "load_inline", "ctypes", "cupy", "triton", "numba", "cuda.bindings")


def _dispatcher_sees_all(problem: Problem) -> bool:
    return not any(marker in problem.source for marker in _OUTSIDE_DISPATCHER)


def _error_model_expected(reference: Worker, reply: wire_replies.ExpectedReply) -> dict[str, Any]:
    """What judging a draw under the error model needs, from the reference's ``expected`` reply: the
    float64 truth, the baseline's own error against it (computed in the reference worker, which held
    both; judging reads it once, not per output judged) and the baseline's shapes and dtypes (its
    values never leave the worker: stand-ins on the meta device hold shape and dtype), so a cached
    draw costs the truth's memory only."""
    error = reply.baseline_error
    if "structure_error" in error:  # the reference disagrees with itself across precisions
        raise HarnessError(
            f"the reference's fp32 and float64 outputs differ in structure ({error['structure_error']})"
        )
    truth = {
        "outputs": reference.receive_outputs(reply.outputs),
        "types": reply.truth_types,
        "memory": None,
    }
    stand_ins = {
        "outputs": [_stand_in(described) for described in reply.baseline_outputs],
        "types": reply.types,
        "memory": None,
    }
    return {"reference": stand_ins, "baseline": stand_ins, "truth": truth, "baseline_err": error}


def _stand_in(described: Any) -> torch.Tensor | None:
    """``correctness.described_like``; an unknown dtype is the trusted worker's fault, so the harness's."""
    try:
        return correctness.described_like(described)
    except ValueError as error:
        raise HarnessError(str(error)) from error


def _all_finite(outputs: list[Any]) -> bool:
    """Every floating output finite, checked in chunks: ``isfinite`` of a whole float64 truth makes
    a temporary as large as the truth, which an 80 GB GPU beside the workers has no room for."""
    return all(
        not (isinstance(o, torch.Tensor) and o.is_floating_point())
        or all(bool(torch.isfinite(chunk).all()) for (chunk,) in flat_chunks(o))
        for o in outputs
    )


def _timed_reference(ctx: _Context, reference: Worker, seed: int) -> dict[str, Any]:
    """What judging the sketch of a timed call on the timing input set of ``seed`` needs."""
    expected = _reference_outputs(ctx, reference, "original", seed)
    lengths = correctness.reduction_lengths(_structure(ctx).numels, expected["reference"]["outputs"])
    return correctness.timed_reference(expected, ctx.protocol.correctness, lengths)
