"""Replay ``timing_disagreement`` on stored records: what it decided, and what the rule before the
same-moment trusted batches (2026-12-01: the baselines' rounds as the only trusted batches, no cache
check batch, no re-check) decides on the same rounds.

    PYTHONPATH=src python benchmarks/bracket_replay.py STORE.sqlite [MORE.sqlite | RECORDS.jsonl ...]

Prints, over the ``verified`` records that were timed, the pairs (old rule, the record's finding),
every record the old rule would have flagged with its gap, allowed gap and inflation, and how often
the re-check ran and what it cost. The old rule's speedup inflation is the claimed speedup (the
candidate's median against each baseline's) over the one from the bracket (the check's arithmetic).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import Counter
from collections.abc import Iterator
from typing import Any

from kbv import statistics
from kbv.protocol import timing_settings_from_dict


def records(path: str) -> Iterator[dict[str, Any]]:
    """The ``verified`` records of a results store or a JSONL file."""
    if path.endswith(".jsonl"):
        with open(path) as fh:
            found = [json.loads(line) for line in fh if line.strip()]
    else:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        found = [json.loads(js) for (js,) in db.execute("select json from records")]
    yield from (r for r in found if r["protocol"]["name"] == "verified")


def old_rule(timing: dict[str, Any], settings: Any) -> tuple[str, dict[str, Any] | None]:
    """The severity the rule before 2026-12-01 gives these rounds ("none", "warn", "fail")."""
    trusted = [r for e in timing["baselines"].values() for r in e.get("rounds") or []]
    verdict = statistics.bracket_verdict(timing["candidate"]["rounds"], trusted, settings)
    if not verdict["disagrees"]:
        return "none", None
    worst = min(verdict["rounds"], key=lambda r: r["gap_ms"])
    per_call = worst["trusted_per_call_ms"]
    medians = [e["summary"]["median"] for e in timing["baselines"].values() if e["summary"].get("median")]
    corrected = min(m / per_call for m in medians) if medians and per_call > 0 else None
    claimed = min(m / timing["candidate"]["summary"]["median"] for m in medians) if medians else None
    inflation = claimed / corrected if claimed and corrected else None
    worst["inflation"] = inflation
    return ("fail" if inflation is None or inflation > 2.0 else "warn"), worst


def main(paths: list[str]) -> int:
    pairs: Counter[str] = Counter()
    flagged, recheck_s = [], []
    for path in paths:
        for rec in records(path):
            timing = rec.get("timing") or {}
            if not (timing.get("candidate") or {}).get("rounds"):
                pairs["not timed"] += 1
                continue
            settings = timing_settings_from_dict(rec["protocol"]["settings"]["timing"])
            found = [f["severity"] for f in rec["findings"] if f["check"] == "timing_disagreement"]
            old, worst = old_rule(timing, settings)
            pairs[f"old rule {old}, record {found[0] if found else 'none'}"] += 1
            if worst is not None:
                flagged.append((rec["problem"]["name"], rec["candidate"]["path"].rsplit("/", 1)[-1], worst))
            if timing.get("bracket_recheck"):
                recheck_s.append(sum(r["parent_bracket_s"] for r in timing["bracket_recheck"]["rounds"]))
    for key, n in sorted(pairs.items()):
        print(f"{key}: {n}")
    for problem, candidate, w in flagged:
        print(
            f"  old rule flags {problem} {candidate}: gap {w['gap_ms']:.1f} ms, allowed "
            f"{w['allowed_gap_ms']:.1f} ms, inflation {w['inflation'] or float('nan'):.1f}x"
        )
    if recheck_s:
        print(f"re-checks: {len(recheck_s)}, {min(recheck_s):.3f}-{max(recheck_s):.3f} s each")
    else:
        print("re-checks: 0")
    return 0


if __name__ == "__main__":
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("stores", nargs="+", help="results stores (.sqlite) or record files (.jsonl)")
    raise SystemExit(main(parser.parse_args().stores))
