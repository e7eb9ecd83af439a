"""Phase medians of the traced A/B (extract trace.tar.gz here first): per mode, each problem's phase
averaged over the repetitions, then the median over the nine problems.

    python trace_summary.py base,pipe
"""

import collections
import glob
import json
import statistics
import sys

PHASES = ("correctness", "timing", "integrity", "baseline", "total")


def main() -> None:
    modes = sys.argv[1].split(",")
    seconds: dict[str, dict[tuple[str, str], list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for mode in modes:
        for name in glob.glob(f"ab-{mode}-*.jsonl"):
            for line in open(name):
                event = json.loads(line)
                if event["what"] == "summary":
                    for phase in PHASES:
                        seconds[mode][(event["problem"], phase)].append(event["phases_s"].get(phase, 0.0))
    for phase in PHASES:
        shown = []
        for mode in modes:
            means = [statistics.mean(v) for (_, p), v in seconds[mode].items() if p == phase]
            shown.append(f"{mode} {statistics.median(means) * 1000:.0f} ms")
        print(phase, " | ".join(shown))


if __name__ == "__main__":
    main()
