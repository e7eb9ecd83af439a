"""Where an evaluation's seconds go, request by request (issue 11's profile).

    python benchmarks/request_trace.py --kernelbench DIR --problems 19_ReLU 45_Gemm_Sigmoid_LogSumExp \
        --out trace.jsonl [--protocol standard --protocol verified]

Evaluates the named problems of ``verified_cost.py``'s KernelBench sample (the reference itself as
the candidate) as one kbv batch per protocol, as ``verified_cost.py`` does, and records every
request the parent sends to a worker: its role and operation, the parent's wall seconds from send
to reply, the worker's own seconds, and for ``run``, ``expected`` and ``time`` requests the worker's steps
(inputs, forwards, the candidate's copy, the baseline's error, the hand-over, the allocator's
release; for ``time``: the input sets, the timed calls, their sketches, and warm-up with flushes
and synchronisations; each waits for the device, so the profile costs a few synchronisations per
request). It
also records the parent's own work: opening and copying handed-over outputs (``receive_outputs``),
writing a parameter inbox, and judging (``compare_*``, ``timed_reference``), each ended by a device
synchronisation. One JSON line per event,
then one summary line per evaluation: seconds per category and the record's ``phases_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verified_cost import KERNELBENCH_SAMPLE, _shrunk_copy, reference_as_candidate  # noqa: E402


class Trace:
    """Events of the evaluation in progress, written as they happen."""

    def __init__(self, out: Path) -> None:
        self.out = out.open("a")
        self.label: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []

    def add(self, **event: Any) -> None:
        event = {**self.label, **event}
        self.events.append(event)
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def install(trace: Trace) -> None:
    """Wrap the parent's side of the worker channel and the judging functions."""
    from kbv import correctness, wire, wire_replies
    from kbv.worker import Worker

    send, receive = Worker.send_request, Worker.receive_reply
    outputs, inbox = Worker.receive_outputs, Worker.fill_inbox

    def send_request(self: Worker, request: wire.Request) -> int:
        if request.op in ("run", "expected", "time"):
            request = dataclasses.replace(request, steps=True)
        sent_at = time.monotonic()
        request_id = send(self, request)
        pending = self.__dict__.setdefault("_trace_pending", {})
        pending[request_id] = (request.op, getattr(request, "precision", None), sent_at)
        return request_id

    def receive_reply(self: Worker, request_id: int | None = None) -> wire_replies.Reply:
        awaited = request_id if request_id is not None else self._awaited[0]  # the oldest, by default
        reply = receive(self, request_id)
        op, precision, sent = self.__dict__["_trace_pending"].pop(awaited)
        trace.add(
            what="request",
            role=self.spec.role,
            op=op,
            precision=precision,
            wall_s=time.monotonic() - sent,
            worker_s=reply.worker_seconds,
            steps_s=reply.steps_s,
        )
        return reply

    def timed(name: str, work: Any, role: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return work(*args, **kwargs)
            finally:
                _sync()
                who = role(args) if role else None
                trace.add(what="parent", op=name, role=who, wall_s=time.monotonic() - started)

        return wrapper

    Worker.send_request = send_request  # type: ignore[method-assign]
    Worker.receive_reply = receive_reply  # type: ignore[method-assign]
    Worker.receive_outputs = timed("receive_outputs", outputs, lambda a: a[0].spec.role)  # type: ignore[method-assign]
    Worker.fill_inbox = timed("fill_inbox", inbox, lambda a: a[0].spec.role)  # type: ignore[method-assign]
    # kbv.evaluation calls them through the module (``correctness.compare_...``): patched there.
    for name in ("compare_error_model", "compare_allclose", "timed_reference"):
        setattr(correctness, name, timed(name, getattr(correctness, name)))


def summarise(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per category: requests by role, operation and precision (worker-side), the steps of
    ``run`` requests, and the parent's own work."""
    seconds: dict[str, float] = defaultdict(float)
    for e in events:
        if e["what"] == "request":
            key = f"{e['role']}:{e['op']}" + (f":{e['precision']}" if e.get("precision") else "")
            seconds[f"worker {key}"] += e.get("worker_s") or 0.0
            seconds[f"wall {key}"] += e["wall_s"]
            for step, s in (e.get("steps_s") or {}).items():
                seconds[f"step {e['role']}:{step}"] += s
        else:
            seconds[f"parent {e['op']}" + (f":{e['role']}" if e.get("role") else "")] += e["wall_s"]
    return {k: round(v, 4) for k, v in sorted(seconds.items())}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernelbench", type=Path, required=True, help="a KernelBench tree (DIR/level1 ...)")
    parser.add_argument("--problems", nargs="+", required=True, help="file stems of the sample")
    parser.add_argument("--protocol", action="append", help="default: standard and verified")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path(".kb/trace-candidates"))
    parser.add_argument("--timeout", type=float, default=100.0)
    parser.add_argument(
        "--cpu-sizes", action="store_true", help="shrink each problem as verified_cost.py --cpu-sizes does"
    )
    args = parser.parse_args()

    from kbv.batch import run_batch
    from kbv.candidates import load_candidate
    from kbv.evaluation import evaluate
    from kbv.problems import load_problem
    from kbv.protocol import load_protocol

    levels = {stem: level for level, stem in KERNELBENCH_SAMPLE}
    unknown = [p for p in args.problems if p not in levels]
    if unknown:
        parser.error(f"not in verified_cost.py's sample: {', '.join(unknown)}")
    args.work.mkdir(parents=True, exist_ok=True)
    pairs = []
    for stem in args.problems:
        path = args.kernelbench / f"level{levels[stem]}" / f"{stem}.py"
        if args.cpu_sizes:
            shrunk = _shrunk_copy(path, args.work / f"level{levels[stem]}")
            if shrunk is None:
                parser.error(f"{stem} is too large for the CPU sample once shrunk")
            path = shrunk
        candidate = args.work / f"{stem}_candidate.py"
        candidate.write_text(reference_as_candidate(path.read_text()))
        pairs.append((load_problem(path), load_candidate(candidate, label="reference")))

    trace = Trace(args.out)
    install(trace)

    def traced(problem: Any, candidate: Any, protocol: Any, device: Any, **kwargs: Any) -> Any:
        trace.label, trace.events = {"protocol": protocol.name, "problem": problem.name}, []
        record = evaluate(problem, candidate, protocol, device, **kwargs)
        summary = {"what": "summary", "outcome": record.outcome, "phases_s": record.phases_s}
        trace.add(**summary, seconds=summarise(trace.events))
        print(
            f"{protocol.name} {problem.name}: {record.outcome} {record.phases_s.get('total', 0):.2f} s",
            flush=True,
        )
        return record

    traced.uses_spares = True  # type: ignore[attr-defined]  # workers prespawned, as in verified_cost.py

    for name in args.protocol or ["standard", "verified"]:
        with contextlib.suppress(KeyboardInterrupt):
            run_batch(
                pairs, load_protocol(name), device=args.device, timeout_s=args.timeout, evaluate_fn=traced
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
