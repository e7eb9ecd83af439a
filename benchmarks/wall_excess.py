"""How much time a candidate's timed calls hid from the events: ``side_stream_timing`` replayed on
stored records, with the margin by which each candidate stayed under or went over its limit.

    PYTHONPATH=src python benchmarks/wall_excess.py STORE.sqlite [MORE.sqlite | RECORDS.jsonl ...]
        [--manifest cuda-l1-streams/manifest.json]

Per ``verified`` record that was timed: the candidate's device median, its largest per-round wall
minus device excess, the baselines' median excess (the check's overhead), the allowed excess of
that round and whether the check fires, and ``hidden_ms``: the candidate's excess beyond the
baselines' largest, an estimate of the time the events missed. With ``--manifest`` the rows carry
the corpus's hand-read labels, and a summary says, per label, how many fire and how much the ones
that do not hid. On the twelfth session's records: labelled side-stream hacks that do not fire
hid no more than honest kernels show (their side-stream work ends before the end event).
"""

from __future__ import annotations

import argparse
import json
import statistics as stats
from pathlib import Path
from typing import Any

from bracket_replay import records

from kbv import statistics


def _excess(rnd: dict[str, Any]) -> tuple[float, float]:
    """(device median, wall median minus device median) of one timed round."""
    device, wall = stats.median(rnd["device_ms"]), stats.median(rnd["wall_ms"])
    return device, wall - device


def replay(record: dict[str, Any]) -> dict[str, Any] | None:
    """``side_stream_timing``'s arithmetic (kbv.integrity.dynamic) on one record's rounds."""
    timing = record.get("timing") or {}
    rounds = [r for r in (timing.get("candidate") or {}).get("rounds") or [] if r.get("device_ms")]
    base = [
        _excess(r)[1]
        for entry in (timing.get("baselines") or {}).values()
        for r in (entry or {}).get("rounds") or []
        if r.get("device_ms")
    ]
    if not rounds:
        return None
    overhead = sorted(max(0.0, e) for e in base)[len(base) // 2] if base else 0.0
    checks = [
        statistics.wall_vs_device_disagreement(
            statistics.Measurement(
                recipe="replay", device_ms=r["device_ms"], wall_ms=r["wall_ms"], warmup_calls=0
            ),
            overhead,
        )
        for r in rounds
    ]
    worst = max(checks, key=lambda c: c["excess_ms"])
    return {
        "problem": record["problem"]["name"],
        "candidate": Path(record["candidate"]["path"]).name,
        "outcome": record["outcome"],
        "device_ms": worst["device_median_ms"],
        "excess_ms": worst["excess_ms"],
        "overhead_ms": overhead,
        "allowed_ms": worst["allowed_excess_ms"],
        "fires": any(c["disagrees"] for c in checks),
        "hidden_ms": worst["excess_ms"] - (max(base) if base else 0.0),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("stores", nargs="+")
    parser.add_argument("--manifest", help="a corpus manifest with hand-read labels ('expected')")
    args = parser.parse_args()
    labels: dict[str, str] = {}
    if args.manifest:
        manifest = json.loads(Path(args.manifest).read_text())
        labels = {Path(c["file"]).name: c["expected"] for c in manifest["candidates"]}
    rows = [row for path in args.stores for rec in records(path) if (row := replay(rec))]
    for row in rows:
        row["label"] = labels.get(row["candidate"], "-")
    print("| label | candidate | outcome | device ms | excess ms | allowed ms | fires | hidden ms |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: r["hidden_ms"]):
        print(
            f"| {row['label']} | {row['candidate']} | {row['outcome']} | {row['device_ms']:.4f} | "
            f"{row['excess_ms']:.4f} | {row['allowed_ms']:.4f} | {'yes' if row['fires'] else ''} | "
            f"{row['hidden_ms']:+.4f} |"
        )
    print()
    for label in sorted({r["label"] for r in rows}):
        group = [r for r in rows if r["label"] == label]
        quiet = sorted(round(r["hidden_ms"], 4) for r in group if not r["fires"])
        print(
            f"{label}: {len(group)} timed, {sum(r['fires'] for r in group)} fire; hidden ms of the "
            f"rest: {quiet[0] if quiet else '-'} to {quiet[-1] if quiet else '-'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
