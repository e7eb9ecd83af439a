"""``kbv problems audit``: find problems that cannot tell an honest kernel from a cheap trick.

Each problem's reference runs in a trusted worker (no candidate code anywhere) and is probed for:
- ``constant_output``: the output does not depend on the inputs (degenerate; score nothing on it);
- ``zeros_pass``: an all-zero output passes KernelBench's ``allclose(atol=rtol=1e-4)``;
- ``nondeterministic``: two runs on identical inputs differ, so determinism checks need a tolerance;
- ``needs_domain_rule``: a hidden distribution makes the reference non-finite while the problem's
  own inputs do not, so the verified protocol falls back to a domain-preserving variant;
- ``problem_error``: the problem cannot produce its own reference output (its file does not load, or
  ``get_init_inputs``, ``Model.__init__``, ``get_inputs`` or ``forward`` raises): every evaluation
  on it would be a ``problem_error`` record. With ``precision`` bf16 or fp16 the reference runs with
  its floating inputs and parameters cast to it, and an operator without half support on the
  device, or an output that is not finite once cast, is that precision's ``problem_error``.

Results are yielded one problem at a time (:func:`iter_audit`), so that a long audit shows progress
and keeps what it found. The JSON object of one result is documented in docs/problems-audit.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kbv import wire, wire_replies
from kbv.devices import release_device_memory
from kbv.error_stats import error_stats, flat_chunks
from kbv.inputs import BASE_DISTRIBUTIONS, derive_seed, new_seed
from kbv.problems._loader import Problem
from kbv.problems.structure import describe_structure
from kbv.worker import Worker, WorkerFailed, WorkerSpec, visible_devices, worker_device

ZEROS_ATOL = ZEROS_RTOL = 1e-4
#: KernelBench's allclose in half precision (the ``standard`` protocol's atol_half/rtol_half).
ZEROS_TOL_HALF = 1e-2
#: Two outputs closer than this fraction of their scale (in float64) count as the same constant.
CONSTANT_RTOL = 1e-9
AUDIT_BUDGET_S = 900.0


#: Names and version of the JSON object one audited problem becomes (docs/problems-audit.md).
SCHEMA = "kbv.problem_audit"
SCHEMA_VERSION = 1
PROBLEM_ERROR = "problem_error"


@dataclass
class AuditResult:
    """One problem's audit. ``to_dict`` is the documented JSON object; later versions add keys (an
    ``invariants`` section, per-probe seconds) and never rename or remove one."""

    problem: str
    path: str
    flags: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    # Input invariants every hidden distribution keeps (kbv.problems.structure), one entry per input.
    structure: list[dict[str, Any]] = field(default_factory=list)
    source_sha256: str | None = None
    device: str = "cpu"
    seconds: float = 0.0
    precision: str = "fp32"

    def fail(self, message: str) -> None:
        """The problem could not produce its reference output: flagged, with the reason."""
        self.error = message
        if PROBLEM_ERROR not in self.flags:
            self.flags.append(PROBLEM_ERROR)
        self.notes[PROBLEM_ERROR] = message

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "problem": self.problem,
            "path": self.path,
            "source_sha256": self.source_sha256,
            "device": self.device,
            "flags": list(self.flags),
            "notes": dict(self.notes),
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "structure": list(self.structure),
            "precision": self.precision,
        }


def unloadable(path: str | Path, message: str, device: str = "cpu") -> AuditResult:
    """The audit result of a problem file that does not even load (syntax error, missing names)."""
    result = AuditResult(Path(path).stem, str(path), device=device)
    result.fail(message)
    return result


def audit_problem(problem: Problem, device: str = "cpu", seed: int | None = None) -> AuditResult:
    """Probe one problem's reference; never raises for a broken problem (it is reported)."""
    return audit_problems([problem], device, seed)[0]


def audit_problems(
    problems: list[Problem], device: str = "cpu", seed: int | None = None, precision: str = "fp32"
) -> list[AuditResult]:
    """Every problem's audit result, in order (see :func:`iter_audit`)."""
    return list(iter_audit(problems, device, seed, precision))


def iter_audit(
    problems: list[Problem], device: str = "cpu", seed: int | None = None, precision: str = "fp32"
) -> Iterator[AuditResult]:
    """Audit problems in one trusted worker, started again only after a problem kills it; each
    result is yielded as soon as it is known."""
    master = seed if seed is not None else new_seed()
    device_in_worker, visible = worker_device(device), visible_devices(device)
    worker: Worker | None = None
    try:
        for problem in problems:
            if worker is None or not worker.alive():
                if worker is not None:
                    worker.close()
                worker = Worker(
                    WorkerSpec(
                        build_key="audit",
                        device=device_in_worker,
                        role="reference",
                        visible_devices=visible,
                        budget_s=AUDIT_BUDGET_S,
                    )
                )
                worker.start()
            worker.remaining_s = AUDIT_BUDGET_S
            result = _audit_in(worker, problem, device, master, precision)
            release_device_memory(device)  # the parent's cache would starve the worker
            yield result
    finally:
        if worker is not None:
            worker.close()


def _audit_in(
    worker: Worker, problem: Problem, device: str, master: int, precision: str = "fp32"
) -> AuditResult:
    started = time.monotonic()
    result = AuditResult(
        problem.name,
        str(problem.path),
        source_sha256=problem.source_sha256,
        device=device,
        precision=precision,
    )
    result.structure = describe_structure(problem, device)
    device = worker_device(device)
    try:
        worker.request(
            wire.Load(
                role="reference",
                device=device,
                problem_source=problem.source,
                problem_name=problem.name,
                sizes=problem.sizes_for(device),
                domain=problem.extras.get("domain", "any"),
                init_seed=derive_seed(master, "init"),
                precision=precision,
            )
        )
        _probe(worker, result, master)
    except WorkerFailed as exc:
        result.fail(f"{exc.kind}: {exc.message.splitlines()[0] if exc.message else ''}")
    result.seconds = time.monotonic() - started
    return result


def _run(worker: Worker, distribution: str, seed: int, precision: str = "fp32") -> list[Any]:
    out_path = worker.new_path("audit")
    run = wire.Run(distribution=distribution, seed=seed, precision=precision, out_path=out_path)
    reply = wire_replies.RunReply.of(worker.request(run))
    return list(worker.receive_outputs(reply.outputs))


def _probe(worker: Worker, result: AuditResult, master: int) -> None:
    """At most two outputs are alive at a time and every comparison runs in float64 chunks: a
    KernelBench output of 1.9e9 elements is 15 GB in float64, and the parent holds its copies on
    the GPU that the worker needs too."""
    first = _run(worker, "original", derive_seed(master, "a"))
    again = _run(worker, "original", derive_seed(master, "a"))
    if not _same(first, again):
        result.flags.append("nondeterministic")
        result.notes["nondeterministic"] = (
            f"two runs on identical inputs differ by up to {_max_diff(first, again):.3g}"
        )
    del again
    tol = ZEROS_TOL_HALF if result.precision != "fp32" else ZEROS_ATOL
    zeros_pass, finite = _zeros_pass(first, tol), _finite(first)
    del first
    if (
        not finite
        and result.precision != "fp32"
        and _finite(_run(worker, "original", derive_seed(master, "a"), "fp64"))
    ):
        result.fail(
            f"the reference's output on the problem's own inputs is not finite in {result.precision}: "
            f"every {result.precision} evaluation of it would be a problem_error"
        )
        return
    if _constant_output(worker, master):
        result.flags.append("constant_output")
        result.notes["constant_output"] = (
            "outputs for original and signed inputs from different seeds agree within "
            f"{CONSTANT_RTOL:g} of their scale (float64)"
        )
    if zeros_pass:
        result.flags.append("zeros_pass")
        result.notes["zeros_pass"] = f"an all-zero output passes allclose(atol={tol}, rtol={tol})"
    if finite:
        broken = [d for d in BASE_DISTRIBUTIONS[1:] if not _finite(_run(worker, d, derive_seed(master, d)))]
        if broken:
            result.flags.append("needs_domain_rule")
            result.notes["needs_domain_rule"] = "reference not finite under: " + ", ".join(broken)


def _constant_output(worker: Worker, master: int) -> bool:
    """The float64 output for original inputs equals those for signed inputs and for original inputs
    of another seed (float64, so that an output constant up to fp32 rounding shows too)."""
    try:
        exact = _run(worker, "original", derive_seed(master, "a"), "fp64")
        for distribution, key in (("signed", "b"), ("original", "c")):
            if not _constant(exact, _run(worker, distribution, derive_seed(master, key), "fp64")):
                return False
    except WorkerFailed as exc:  # e.g. forward makes float32 tensors of its own: no float64 truth
        raise WorkerFailed(
            exc.kind, f"in float64 (the verified protocol's truth): {exc.message}", exc.details, role=exc.role
        ) from exc
    return True


def _floats(outputs: list[Any]) -> list[torch.Tensor]:
    return [o for o in outputs if isinstance(o, torch.Tensor)]


def _same(a: list[Any], b: list[Any]) -> bool:
    ta, tb = _floats(a), _floats(b)
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return False
    return all(torch.equal(x, y) for x, y in zip(ta, tb))


def _constant(a: list[Any], b: list[Any]) -> bool:
    """Equal up to ``CONSTANT_RTOL`` of the output's scale: float64 rounding, not input dependence.
    NaN and infinities must sit at the same places (the same signed infinity)."""
    ta, tb = _floats(a), _floats(b)
    if not ta or len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return False
    for x, y in zip(ta, tb):
        stats = error_stats(y, x)
        if stats["mismatch"] or stats["max_abs"] > CONSTANT_RTOL * max(stats["peak"], 1e-30):
            return False
    return True


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(
        (error_stats(x, y)["max_abs"] for x, y in zip(_floats(a), _floats(b)) if x.numel()), default=0.0
    )


def _zeros_pass(outputs: list[Any], tol: float = ZEROS_ATOL) -> bool:
    """``allclose(zeros, output, atol=tol, rtol=tol)`` for every floating output, chunk by chunk."""
    tensors = [o for o in _floats(outputs) if o.is_floating_point()]
    # |0 - o| <= atol + rtol * |o|, i.e. |o| * (1 - rtol) <= atol
    return bool(tensors) and all(
        bool((chunk.abs().double() * (1 - tol) <= tol).all()) for o in tensors for (chunk,) in flat_chunks(o)
    )


def _finite(outputs: list[Any]) -> bool:
    return all(bool(torch.isfinite(o).all()) for o in _floats(outputs) if o.is_floating_point())
