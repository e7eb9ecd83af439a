"""What kbv.Evaluator saves on N candidates of one problem: N separate ``evaluate_paths`` calls,
against one ``Evaluator.map`` batch without and with the shared reference work.

The candidates are one honest plain-PyTorch kernel of the problem with a different comment each (N
distinct sources, nothing to build), so every evaluation does the full work of a new candidate.
The three modes run one after the other on the same machine; each mode's per-candidate time is
its wall time over N. Prints a JSON object (``--out`` writes it too).

    PYTHONPATH=$PWD/src python benchmarks/evaluator_batch.py --problem level1/1_ReLU -n 8 --device cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import kbv
from kbv import _shared_reference
from kbv.problems import bundled_suite_dir

#: One honest kernel per problem: plain PyTorch, the problem's own operation.
HONEST = {
    "level1/1_ReLU": "torch.relu(x)",
    "level1/2_LeakyReLU": "torch.nn.functional.leaky_relu(x, negative_slope=0.01)",
    "level1/5_GELU": "torch.nn.functional.gelu(x)",
    "level1/9_Softmax": "torch.softmax(x, dim=1)",
    "level1/25_Matmul_Square": None,  # two inputs: see _source
}


def _source(problem: str, index: int) -> str:
    body = "torch.matmul(A, B)" if problem.endswith("Matmul_Square") else HONEST[problem]
    args = "A, B" if problem.endswith("Matmul_Square") else "x"
    return (
        f"# candidate {index}\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n"
        f"    def __init__(self, *args, **kwargs):\n        super().__init__()\n\n"
        f"    def forward(self, {args}):\n        return {body}\n"
    )


def _timed(label: str, run: Any) -> dict[str, Any]:
    started = time.monotonic()
    records = run()
    wall = time.monotonic() - started
    return {
        "mode": label,
        "wall_s": round(wall, 2),
        "per_candidate_s": round(wall / len(records), 3),
        "outcomes": [str(getattr(r.outcome, "value", r.outcome)) for r in records],
        "correctness_s_median": sorted(r.phases_s.get("correctness", 0.0) for r in records)[len(records) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="level1/1_ReLU", choices=sorted(HONEST))
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--protocol", default="verified")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()  # the code that runs (read before any rebase)
    sources = [_source(args.problem, i) for i in range(args.n)]
    problem_path = bundled_suite_dir() / f"{args.problem}.py"
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, source in enumerate(sources):
            path = Path(tmp) / f"candidate_{i}.py"
            path.write_text(source)
            paths.append(path)
        # Warm-up (not counted): the problem's input structure and the baselines' timing cache.
        kbv.evaluate_paths(problem_path, paths[0], protocol=args.protocol, device=args.device)
        rows = [
            _timed(
                f"{args.n} separate evaluate_paths calls",
                lambda: [kbv.evaluate_paths(problem_path, p, protocol=args.protocol, device=args.device) for p in paths],
            )
        ]
        for share in (False, True):
            with kbv.Evaluator(device=args.device, protocol=args.protocol, share_reference=share) as ev:
                before = dict(_shared_reference.totals)
                row = _timed(
                    f"one Evaluator.map batch, shared reference {'on' if share else 'off'}",
                    lambda ev=ev: ev.map([(args.problem, s) for s in sources]),
                )
                row["reference_outputs_reused"] = _shared_reference.totals["hits"] - before["hits"]
                row["reference_outputs_computed"] = _shared_reference.totals["misses"] - before["misses"]
                rows.append(row)
    result = {
        "problem": args.problem,
        "candidates": args.n,
        "device": args.device,
        "protocol": args.protocol,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "commit": commit,
        "rows": rows,
        "separate_over_shared": round(rows[0]["per_candidate_s"] / rows[2]["per_candidate_s"], 2),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
