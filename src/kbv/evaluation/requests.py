"""The requests the parent sends its workers for one evaluation: the load and one forward."""

from __future__ import annotations

from typing import Any

from kbv import wire, wire_replies
from kbv.evaluation.context import _Context, _structure
from kbv.worker import Worker, worker_device


def _load(ctx: _Context, role: str) -> wire.Load:
    device = worker_device(ctx.device)
    return wire.Load(
        role=role,
        device=device,
        # The text the parent read, never its path: the file may change meanwhile, and the
        # candidate worker must not learn where it lives (``docs/architecture.md``).
        problem_source=ctx.problem.source,
        sizes=ctx.problem.sizes_for(device),
        domain=ctx.problem.extras.get("domain", "any"),
        init_seed=ctx.seeds.init(ctx.protocol.correctness.distributions[0]),
        structure=_structure(ctx).applied() or None,
        precision=ctx.protocol.precision,
        candidate_path=str(ctx.candidate.path) if role == "candidate" else None,
        problem_name=None if role == "candidate" else ctx.problem.name,  # for the reference's errors
    )


def _run(
    worker: Worker,
    distribution: str,
    seed: int,
    precision: str,
    measure_memory: bool = False,
    mix_seed: int | None = None,
    record_operators: bool = False,
) -> dict[str, Any]:
    """One forward in ``worker`` on one draw; its outputs become the parent's own tensors (on the
    GPU through CUDA IPC or exported VMM memory, on the CPU through a file read once and deleted).
    ``record_operators`` (a trusted reference only) also reports the TF32-sensitive operators the
    forward ran."""
    request = _forward(worker, distribution, seed, precision, measure_memory, mix_seed, record_operators)
    return _received(worker, worker.request(request))


def _forward(
    worker: Worker,
    distribution: str,
    seed: int,
    precision: str,
    measure_memory: bool = False,
    mix_seed: int | None = None,
    record_operators: bool = False,
) -> wire.Run:
    """The ``run`` request of one draw, its outputs written into ``worker``'s own scratch."""
    return wire.Run(
        distribution=distribution,
        seed=seed,
        mix_seed=mix_seed,
        precision=precision,
        out_path=worker.new_path("out"),
        measure_memory=measure_memory,
        record_operators=record_operators,
    )


def _received(worker: Worker, reply: wire_replies.Reply) -> dict[str, Any]:
    """A ``run`` reply as the parent's own outputs, types and memory figures."""
    run = wire_replies.RunReply.of(reply)
    received = {
        "outputs": worker.receive_outputs(run.outputs),
        "types": run.types,
        "memory": run.memory,
    }
    if run.tf32_operators is not None:
        received["tf32_operators"] = run.tf32_operators
    return received
