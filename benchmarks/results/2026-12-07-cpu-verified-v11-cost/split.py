"""Where `verified` v11 costs more than v10 on the CPU sample (extract rows.tar.gz here first).

    python split.py

Per problem, each code's `verified` and `standard` times averaged over the six repetitions; the
problems where v11 draws `spiked` (an output reducing 256 input elements or more at these sizes)
apart from the rest, whose code path differs from v10's only by the check that leaves it out.
"""

import collections
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The sample's problems with an output reducing 256 input elements or more at --cpu-sizes (by shapes
#: on the meta device, as `reference_as_candidate.py --long-reductions` finds them).
SPIKED = (
    "4_Matrix_vector_multiplication_",
    "47_Sum_reduction_over_a_dimension",
    "51_Argmax_over_a_dimension",
    "94_MSELoss",
    "95_CrossEntropyLoss",
    "100_HingeLoss",
    "14_Gemm_Divide_Sum_Scaling",
)


def averaged(code: str, protocol: str, phase: str = "total") -> dict[str, float]:
    times: dict[str, list[float]] = collections.defaultdict(list)
    for rep in "abcdef":
        for line in (HERE / f"rows-{code}-{rep}.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["kind"] == "row" and row["protocol"] == protocol:
                times[row["problem"]].append(row["phases_s"].get(phase, 0.0))
    return {problem: statistics.mean(values) for problem, values in times.items()}


def main() -> None:
    old_v, new_v = averaged("old", "verified"), averaged("new", "verified")
    old_s, new_s = averaged("old", "standard"), averaged("new", "standard")
    old_c, new_c = averaged("old", "verified", "correctness"), averaged("new", "verified", "correctness")
    rest = [p for p in old_v if p not in SPIKED]
    moved = statistics.median(new_v[p] / old_v[p] for p in rest)
    print(f"verified new/old, the {len(rest)} problems without spiked: median {moved:.3f}")
    moved = statistics.median(new_s[p] / old_s[p] for p in old_s)
    print(f"standard new/old, all {len(old_s)}: median {moved:.3f}")
    for p in SPIKED:
        print(
            f"{p}: verified {old_v[p]:.3f} -> {new_v[p]:.3f} s, "
            f"correctness {old_c[p]:.3f} -> {new_c[p]:.3f} s"
        )
    medians = statistics.median(old_v.values()), statistics.median(new_v.values())
    print(f"verified median problem: old {medians[0]:.3f} s, new {medians[1]:.3f} s")
    sums = sum(old_v.values()), sum(new_v.values()), sum(old_s.values()), sum(new_s.values())
    print(f"sums: verified {sums[0]:.2f} -> {sums[1]:.2f} s, standard {sums[2]:.2f} -> {sums[3]:.2f} s")


if __name__ == "__main__":
    main()
