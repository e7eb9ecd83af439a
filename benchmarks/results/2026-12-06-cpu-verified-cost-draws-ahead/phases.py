"""Pooled phase medians of this folder's rows (extract rows.tar.gz here first), per code and protocol:
each problem's phase averaged over the repetitions, then the median over the problems.

    python phases.py a,b,c,d,e,f [DIR]
"""

import collections
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("correctness", "correctness:parameters", "baseline", "timing", "integrity", "total")


def main() -> None:
    reps = sys.argv[1].split(",")
    folder = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE
    for code in ("old", "new"):
        per: dict[str, dict[tuple[str, str], list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        for rep in reps:
            for line in (folder / f"rows-{code}-{rep}.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["kind"] == "row":
                    for phase, seconds in row["phases_s"].items():
                        per[row["protocol"]][(row["problem"], phase)].append(seconds)
        for protocol in ("standard", "verified"):
            shown = []
            for phase in PHASES:
                means = [statistics.mean(v) for (_, p), v in per[protocol].items() if p == phase]
                if means:
                    shown.append(f"{phase} {statistics.median(means) * 1000:.0f} ms")
            print(f"{code} {protocol}: " + ", ".join(shown))


if __name__ == "__main__":
    main()
