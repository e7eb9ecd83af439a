"""What a `verified` evaluation costs, and what the TF32 baseline does to speedups.

    python benchmarks/verified_cost.py                              # on the GPU: bundled CUDA/Triton sets
    python benchmarks/verified_cost.py --device cpu --sets honest_cpu --limit 3   # smoke test

Evaluates the bundled candidates under `verified` twice with one fresh cache directory: the first
pass compiles every extension and measures every baseline, the second finds both cached. Reports
the wall time per candidate split into the pipeline's phases (compile, load, correctness, integrity,
timing, baseline), the median excluding compilation (target: at most 10 s), the second pass's
speed-up over the first (target: at least 5x), and, for the honest candidates, the speedup against
`eager_fp32` and `eager_tf32` side by side. Writes `verified-cost-<date>-<device>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kbv.batch import collect_pairs
from kbv.pipeline import evaluate
from kbv.problems import bundled_candidates_dir, bundled_suite_dir
from kbv.protocol import load_protocol

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("compile", "load", "correctness", "integrity", "timing", "baseline")


def pairs_for(sets: list[str], limit: int | None) -> list[Any]:
    found: list[Any] = []
    for name in sets:
        pairs, errors = collect_pairs(bundled_suite_dir(), bundled_candidates_dir() / name, label=name)
        for file, message in errors:
            print(f"skipping {file}: {message}", file=sys.stderr)
        found.extend(pairs)
    return found[:limit] if limit else found


def one_pass(pairs: list[Any], device: str, timeout_s: float | None) -> list[dict[str, Any]]:
    protocol = load_protocol("verified")
    rows = []
    for problem, candidate in pairs:
        started = time.monotonic()
        record = evaluate(problem, candidate, protocol, device, timeout_s=timeout_s)
        wall = time.monotonic() - started
        phases = {k: float(record.phases_s.get(k, 0.0)) for k in PHASES}
        rows.append({
            "problem": problem.name, "candidate": f"{candidate.label}/{candidate.path.name}", "outcome": record.outcome,
            "wall_s": wall, "wall_excl_compile_s": wall - phases["compile"], "phases_s": phases,
            "speedup": {k: record.speedup.get(k) for k in ("eager_fp32", "eager_tf32", "compile", "best")},
        })
        print(f"  {rows[-1]['candidate']}: {record.outcome} {wall:.1f} s "
              + " ".join(f"{k}={v:.1f}" for k, v in phases.items() if v), flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "total_s": sum(r["wall_s"] for r in rows),
        "median_excl_compile_s": statistics.median(r["wall_excl_compile_s"] for r in rows) if rows else None,
        "median_phase_s": {k: statistics.median(r["phases_s"][k] for r in rows) for k in PHASES} if rows else {},
    }


def markdown(report: dict[str, Any]) -> str:
    first, second = report["passes"][0]["summary"], report["passes"][1]["summary"]
    lines = [
        f"# Cost of a verified evaluation, {report['date']}", "",
        f"{report['device_name']}, torch {report['torch']}, kbv {report['kbv']}, {report['pairs']} candidates "
        f"({', '.join(report['sets'])}), one fresh cache for both passes.", "",
        "| pass | total (s) | median per candidate excl. compile (s) | " + " | ".join(f"median {p} (s)" for p in PHASES) + " |",
        "|---|---:|---:|" + "---:|" * len(PHASES),
    ]
    for name, s in (("first (cold)", first), ("second (cached)", second)):
        lines.append(f"| {name} | {s['total_s']:.1f} | {s['median_excl_compile_s']:.2f} | "
                     + " | ".join(f"{s['median_phase_s'][p]:.2f}" for p in PHASES) + " |")
    lines += ["", f"Second pass {report['second_pass_speedup']:.1f}x faster than the first.", "",
              "| candidate | outcome | vs eager_fp32 | vs eager_tf32 | best |", "|---|---|---:|---:|---:|"]
    for row in report["passes"][0]["rows"]:
        s = row["speedup"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {row['candidate']} | {row['outcome']} | {fmt(s['eager_fp32'])} | {fmt(s['eager_tf32'])} | {fmt(s['best'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sets", nargs="*", default=["honest_cuda", "honest_triton", "hacks_gpu"])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    pairs = pairs_for(args.sets, args.limit)
    if not pairs:
        parser.error("no problem x candidate pairs found")
    os.environ["KBV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kbv-verified-cost-")  # cold, then warm
    passes = []
    for label in ("first", "second"):
        print(f"{label} pass", flush=True)
        rows = one_pass(pairs, args.device, args.timeout)
        passes.append({"pass": label, "rows": rows, "summary": summary(rows)})
    import torch

    from kbv._version import __version__

    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "kbv": __version__, "sets": args.sets, "pairs": len(pairs), "passes": passes,
        "second_pass_speedup": passes[0]["summary"]["total_s"] / passes[1]["summary"]["total_s"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"verified-cost-{report['date'][:10]}-{args.device.split(':')[0]}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
