"""The figures of this folder's README from its rows (extract rows.tar.gz here first).

    python summary.py g,h,i,j         # the repetitions to average, each alternated old/new
    python summary.py a,b,c,d,e,f DIR # the rows of another folder (extracted there), measured alike

Per code and repetition: the median `standard` and `verified` time per candidate, their ratio and
the median per-problem ratio; then, per problem averaged over the repetitions, the same two ratios.
"""

import collections
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(code: str, rep: str) -> dict[str, dict[str, dict]]:
    folder = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE
    by: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for line in (folder / f"rows-{code}-{rep}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "row":
            by[row["protocol"]][row["problem"]] = row
    return by


def total(row: dict) -> float:
    return float(row["phases_s"]["total"])


def main() -> None:
    reps = sys.argv[1].split(",")
    for code in ("old", "new"):
        loaded = {rep: rows(code, rep) for rep in reps}
        for rep, by in loaded.items():
            s = [total(r) for r in by["standard"].values()]
            v = [total(r) for r in by["verified"].values()]
            per = [total(by["verified"][p]) / total(by["standard"][p]) for p in by["verified"] if p in by["standard"]]
            print(
                f"{code} {rep}: standard {statistics.median(s):.3f} s, verified {statistics.median(v):.3f} s, "
                f"ratio of the medians {statistics.median(v) / statistics.median(s):.2f}, "
                f"per-problem median {statistics.median(per):.2f}"
            )
        problems = [p for p in loaded[reps[0]]["verified"] if all(p in loaded[r]["standard"] for r in reps)]
        s = [statistics.mean(total(loaded[r]["standard"][p]) for r in reps) for p in problems]
        v = [statistics.mean(total(loaded[r]["verified"][p]) for r in reps) for p in problems]
        print(
            f"{code}, each problem averaged: standard {statistics.median(s):.3f} s, verified "
            f"{statistics.median(v):.3f} s, ratio of the medians {statistics.median(v) / statistics.median(s):.2f}, "
            f"per-problem median {statistics.median([b / a for a, b in zip(s, v)]):.2f}"
        )


if __name__ == "__main__":
    main()
