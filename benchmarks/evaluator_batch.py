"""What kbv.Evaluator saves on N candidates of one problem: N separate ``evaluate_paths`` calls,
against one ``Evaluator.map`` batch without and with the shared reference work.

The candidates are one honest plain-PyTorch kernel of the problem with a different comment each (N
distinct sources, nothing to build), so every evaluation does the full work of a new candidate: a
problem listed in ``HONEST`` gets that one-line kernel, any other problem its own ``Model`` renamed
``ModelNew``. ``--cpu-sizes`` replaces the problem's ``KBV["cpu_sizes"]`` (a heavier problem on the
CPU, where the reference's float64 forward is a real share of an evaluation); the problem is then
evaluated as that text.

The three modes run ``--repeats`` times, interleaved (ABC CBA ...), so drift of a shared machine
falls on every mode alike; each mode's per-candidate time is its wall time over N, reported per run
and as the median over runs. Every request the parent sends to a reference worker is counted by
operation, with the seconds until its reply (the sequential executor runs the evaluations in this
process), so each mode says what the reference was asked per candidate. Prints a JSON object
(``--out`` writes it too).

    PYTHONPATH=$PWD/src python benchmarks/evaluator_batch.py --problem level1/1_ReLU -n 8 --device cpu
    PYTHONPATH=$PWD/src python benchmarks/evaluator_batch.py --problem level1/28_Conv2d -n 8 --repeats 2 \\
        --cpu-sizes '{"batch_size": 2, "in_channels": 32, "out_channels": 64, "height": 48, "width": 48}'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kbv
from kbv import _shared_reference, wire, wire_replies
from kbv.problems import bundled_suite_dir
from kbv.worker import Worker

#: One honest kernel per problem: plain PyTorch, the problem's own operation.
HONEST = {
    "level1/1_ReLU": "torch.relu(x)",
    "level1/2_LeakyReLU": "torch.nn.functional.leaky_relu(x, negative_slope=0.01)",
    "level1/5_GELU": "torch.nn.functional.gelu(x)",
    "level1/9_Softmax": "torch.softmax(x, dim=1)",
    "level1/25_Matmul_Square": "torch.matmul(A, B)",
}
_CPU_SIZES = re.compile(r'"cpu_sizes":\s*\{[^}]*\}')


def _source(problem: str, problem_text: str, index: int) -> str:
    if problem not in HONEST:  # the problem's own forward, as a candidate
        return f"# candidate {index}\n" + problem_text.replace("class Model(", "class ModelNew(", 1)
    args = "A, B" if problem.endswith("Matmul_Square") else "x"
    return (
        f"# candidate {index}\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n"
        f"    def __init__(self, *args, **kwargs):\n        super().__init__()\n\n"
        f"    def forward(self, {args}):\n        return {HONEST[problem]}\n"
    )


def _problem_text(problem: str, cpu_sizes: str | None) -> str:
    text = (bundled_suite_dir() / f"{problem}.py").read_text()
    if cpu_sizes is None:
        return text
    sizes = json.loads(cpu_sizes)
    if not _CPU_SIZES.search(text):
        raise SystemExit(f"{problem} has no one-line KBV['cpu_sizes'] to replace")
    return _CPU_SIZES.sub(lambda _: '"cpu_sizes": ' + json.dumps(sizes), text, count=1)


class ReferenceRequests:
    """Counts the requests the parent sends to reference workers, and the seconds to each reply."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        send, receive = Worker.send_request, Worker.receive_reply
        sent: dict[int, tuple[str, float]] = {}
        counts, seconds = self.counts, self.seconds

        def send_request(worker: Worker, request: wire.Request) -> int:
            if worker.spec.role == "reference":
                counts[request.op] += 1
                sent[id(worker)] = (request.op, time.monotonic())
            return send(worker, request)

        def receive_reply(worker: Worker, request_id: int | None = None) -> wire_replies.Reply:
            try:
                return receive(worker, request_id)
            finally:
                if (pending := sent.pop(id(worker), None)) is not None:
                    seconds[pending[0]] += time.monotonic() - pending[1]

        Worker.send_request = send_request  # type: ignore[method-assign]
        Worker.receive_reply = receive_reply  # type: ignore[method-assign]

    def take(self, n: int) -> dict[str, Any]:
        """Per candidate since the last call: requests by operation, and the seconds they took."""
        per_op = {op: round(c / n, 2) for op, c in sorted(self.counts.items())}
        found = {
            "reference_requests_per_candidate": round(sum(self.counts.values()) / n, 2),
            "reference_requests_per_candidate_by_op": per_op,
            "reference_seconds_per_candidate": round(sum(self.seconds.values()) / n, 3),
            "reference_seconds_per_candidate_by_op": {
                op: round(s / n, 3) for op, s in sorted(self.seconds.items())
            },
        }
        self.counts.clear()
        self.seconds.clear()
        return found


def _timed(label: str, run: Callable[[], list[Any]], requests: ReferenceRequests) -> dict[str, Any]:
    requests.take(1)  # nothing sent before this mode counts
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    records = run()
    wall = time.monotonic() - started
    return {
        "mode": label,
        "wall_s": round(wall, 2),
        "per_candidate_s": round(wall / len(records), 3),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "outcomes": [str(getattr(r.outcome, "value", r.outcome)) for r in records],
        "correctness_s_median": round(
            statistics.median(r.phases_s.get("correctness", 0.0) for r in records), 3
        ),
        "timing_s_median": round(statistics.median(r.phases_s.get("timing", 0.0) for r in records), 3),
        **requests.take(len(records)),
    }


def _run_mode(
    mode: str,
    args: argparse.Namespace,
    problem: Any,
    sources: list[str],
    paths: list[Path],
    requests: ReferenceRequests,
) -> dict[str, Any]:
    if mode == "separate":
        return _timed(
            f"{args.n} separate evaluate_paths calls",
            lambda: [
                kbv.evaluate_paths(problem, p, protocol=args.protocol, device=args.device) for p in paths
            ],
            requests,
        )
    share = mode == "shared"
    with kbv.Evaluator(device=args.device, protocol=args.protocol, share_reference=share) as ev:
        before = dict(_shared_reference.totals)
        loaded = ev.problem(problem)
        row = _timed(
            f"one Evaluator.map batch, shared reference {'on' if share else 'off'}",
            lambda: ev.map([(loaded, s) for s in sources]),
            requests,
        )
    # the batch's cache counts reach ``totals`` when it is dropped, at the batch's end
    row["reference_outputs_reused"] = _shared_reference.totals["hits"] - before["hits"]
    row["reference_outputs_computed"] = _shared_reference.totals["misses"] - before["misses"]
    return row


MODES = ("separate", "unshared", "shared")


def _median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = []
    for mode in MODES:
        rows = [r for r in runs if r["variant"] == mode]
        summary.append(
            {
                "mode": rows[0]["mode"],
                "runs": len(rows),
                "per_candidate_s": [r["per_candidate_s"] for r in rows],
                "per_candidate_s_median": round(statistics.median(r["per_candidate_s"] for r in rows), 3),
                "correctness_s_median": round(statistics.median(r["correctness_s_median"] for r in rows), 3),
                "reference_requests_per_candidate": statistics.median(
                    r["reference_requests_per_candidate"] for r in rows
                ),
                "reference_seconds_per_candidate_median": round(
                    statistics.median(r["reference_seconds_per_candidate"] for r in rows), 3
                ),
                "all_passed": all(o == "passed" for r in rows for o in r["outcomes"]),
            }
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--problem", default="level1/1_ReLU", help="a problem of the bundled suite")
    parser.add_argument("--cpu-sizes", default=None, help="JSON replacing the problem's KBV cpu_sizes")
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--protocol", default="verified")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()  # the code that runs (read before any rebase)
    problem_text = _problem_text(args.problem, args.cpu_sizes)
    sources = [_source(args.problem, problem_text, i) for i in range(args.n)]
    requests = ReferenceRequests()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        problem_path = Path(tmp) / "problem" / Path(args.problem).name
        problem_path = problem_path.with_suffix(".py")
        problem_path.parent.mkdir()
        problem_path.write_text(problem_text)
        os.chmod(tmp, 0o755)  # unprivileged workers read the files here (kbv.worker._privileges)
        problem_path.parent.chmod(0o755)
        paths = []
        for i, source in enumerate(sources):
            path = Path(tmp) / f"candidate_{i}.py"
            path.write_text(source)
            paths.append(path)
        # Warm-up (not counted): the problem's input structure and the baselines' timing cache.
        kbv.evaluate_paths(problem_path, paths[0], protocol=args.protocol, device=args.device)
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                row = _run_mode(mode, args, problem_path, sources, paths, requests)
                runs.append({"variant": mode, "repeat": r, **row})
                print(json.dumps(runs[-1]), flush=True)
    summary = _median_rows(runs)
    result = {
        "problem": args.problem,
        "cpu_sizes": json.loads(args.cpu_sizes) if args.cpu_sizes else None,
        "candidates": args.n,
        "repeats": args.repeats,
        "device": args.device,
        "protocol": args.protocol,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cores",
        "commit": commit,
        "summary": summary,
        "separate_over_shared": round(
            summary[0]["per_candidate_s_median"] / summary[2]["per_candidate_s_median"], 2
        ),
        "unshared_over_shared": round(
            summary[1]["per_candidate_s_median"] / summary[2]["per_candidate_s_median"], 2
        ),
        "runs": runs,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
