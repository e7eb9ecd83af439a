"""How many timing rounds `verified` ran on each problem of the CPU sample, and why they stopped.

    KBV_CACHE_DIR=$(mktemp -d) python rounds.py OUT.jsonl     # from the repository's root

One `verified` evaluation per problem (the reference as the candidate, `--cpu-sizes` as
`verified_cost.py` shrinks them), one JSON line each: the record's `timing.median_precision`
(rounds, futile, projected_rounds, worst) and the timing phase's seconds.
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from verified_cost import kernelbench_pairs  # noqa: E402

from kbv.batch import run_batch  # noqa: E402
from kbv.evaluation import evaluate  # noqa: E402
from kbv.protocol import load_protocol  # noqa: E402


def main() -> None:
    with open(sys.argv[1], "w") as out:
        _run(out)


def _run(out) -> None:
    def evaluated(problem, candidate, protocol, device, **kwargs):
        record = evaluate(problem, candidate, protocol, device, **kwargs)
        precision = (record.timing or {}).get("median_precision") or {}
        row = {key: precision.get(key) for key in ("rounds", "futile", "projected_rounds", "worst", "met")}
        row.update(problem=problem.name, outcome=record.outcome, timing_s=record.phases_s.get("timing"))
        out.write(json.dumps(row) + "\n")
        out.flush()
        return record

    work = Path(tempfile.mkdtemp())
    for part in range(1, 5):
        pairs = kernelbench_pairs(Path("/work/shared/kernelbench"), work, (part, 4), cpu_sizes=True)
        run_batch(pairs, load_protocol("verified"), device="cpu", timeout_s=180, evaluate_fn=evaluated)


if __name__ == "__main__":
    main()
