"""A labelled corpus under ``standard`` and ``verified``: one row per kernel, and the counts.

After ``kbv compare --problems CORPUS/problems --candidates CORPUS/candidates --db DB`` has stored
both protocols' records (on the GPU, over as many commands as it takes), this reads the corpus's
hand-read labels (``manifest.json``: per candidate file its ``sha256`` and ``expected`` label,
``hack``, ``honest`` or ``unknown``, with the evidence) and prints, per kernel, the label, each
protocol's verdict and speedup and ``verified``'s failing findings; then the counts: labelled hacks
caught (not passed), labelled honest kernels passed, unknowns with their verdicts, and every
disagreement between ``verified`` and a label (the kernels to read again and say who is right).

    python benchmarks/corpus_compare.py --manifest .kb/cuda-l1-streams/manifest.json \\
        --db compare.sqlite --markdown table.md --json table.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kbv.metrics import speedup_of
from kbv.records import Record
from kbv.store import Store


def _latest_by_candidate(records: list[Record]) -> dict[str, Record]:
    return {str(r.candidate.get("source_sha256")): r for r in records}


def _verdict(record: Record | None) -> dict[str, Any]:
    if record is None:
        return {"outcome": None, "speedup": None, "fail_findings": []}
    return {
        "outcome": record.outcome,
        "speedup": speedup_of(record),
        "fail_findings": sorted({f.check for f in record.findings if f.severity == "fail"}),
    }


def corpus_table(manifest: dict[str, Any], standard: list[Record], verified: list[Record]) -> dict[str, Any]:
    """Rows per manifest entry (records matched by the candidate's sha256) and the counts."""
    std, ver = _latest_by_candidate(standard), _latest_by_candidate(verified)
    rows = []
    for entry in manifest["candidates"]:
        sha = entry["sha256"]
        rows.append(
            {
                "file": Path(entry["file"]).name,
                "problem": Path(entry["problem"]["file"]).stem,
                "label": entry["expected"],
                "standard": _verdict(std.get(sha)),
                "verified": _verdict(ver.get(sha)),
                "evidence": entry.get("evidence", ""),
            }
        )
    return {"rows": rows, "counts": _counts(rows)}


def _counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    run = [r for r in rows if r["verified"]["outcome"] is not None and r["standard"]["outcome"] is not None]
    hacks = [r for r in run if r["label"] == "hack"]
    honest = [r for r in run if r["label"] == "honest"]
    unknown = [r for r in run if r["label"] == "unknown"]

    def passed(row: dict[str, Any], protocol: str) -> bool:
        return row[protocol]["outcome"] == "passed"

    return {
        "kernels": len(rows),
        "evaluated_both": len(run),
        "hacks": len(hacks),
        "hacks_caught_standard": sum(not passed(r, "standard") for r in hacks),
        "hacks_caught_verified": sum(not passed(r, "verified") for r in hacks),
        "honest": len(honest),
        "honest_passed_standard": sum(passed(r, "standard") for r in honest),
        "honest_passed_verified": sum(passed(r, "verified") for r in honest),
        "unknown": len(unknown),
        "unknown_verdicts": {r["file"]: r["verified"]["outcome"] for r in unknown},
        # verified against the label: a hack it passed or an honest kernel it rejected
        "disagreements": [
            r["file"]
            for r in run
            if (r["label"] == "hack" and passed(r, "verified"))
            or (r["label"] == "honest" and not passed(r, "verified"))
        ],
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(table: dict[str, Any]) -> str:
    lines = [
        "| kernel | problem | label | standard | std speedup | verified | ver speedup "
        "| verified's fail findings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        s, v = r["standard"], r["verified"]
        lines.append(
            f"| `{r['file']}` | `{r['problem']}` | {r['label']} | {s['outcome'] or 'not run'} | "
            f"{_fmt(s['speedup'])} | {v['outcome'] or 'not run'} | {_fmt(v['speedup'])} | "
            f"{', '.join(v['fail_findings']) or '-'} |"
        )
    c = table["counts"]
    lines += [
        "",
        f"- evaluated under both protocols: {c['evaluated_both']} of {c['kernels']} kernels",
        f"- labelled hacks caught: standard {c['hacks_caught_standard']} of {c['hacks']}, "
        f"verified {c['hacks_caught_verified']} of {c['hacks']}",
        f"- labelled honest passed: standard {c['honest_passed_standard']} of {c['honest']}, "
        f"verified {c['honest_passed_verified']} of {c['honest']}",
        f"- unknowns: {c['unknown']}; verified's verdicts: "
        + (", ".join(f"`{k}` {v}" for k, v in sorted(c["unknown_verdicts"].items())) or "-"),
        "- verified disagrees with the label on: "
        + (", ".join(f"`{f}`" for f in c["disagreements"]) or "none"),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--db", type=Path, required=True, help="the store kbv compare wrote")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.db.is_file():
        parser.error(f"{args.db} does not exist: run kbv compare on the corpus with --db {args.db} first")
    manifest = json.loads(args.manifest.read_text())
    with Store(args.db) as store:
        standard = store.records(protocol="standard", latest=True)
        verified = store.records(protocol="verified", latest=True)
    table = corpus_table(manifest, standard, verified)
    text = markdown(table)
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
