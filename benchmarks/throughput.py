"""Evaluation throughput of the local executor with 1 and then 2 GPUs (candidates per hour).

    python benchmarks/throughput.py                       # GPUs 0 and 1, the bundled GPU candidates
    python benchmarks/throughput.py --gpus 2,3 --repeat 2
    python benchmarks/throughput.py --device cpu --limit 4   # a smoke test without GPUs

Each configuration starts from a cold build cache (its own KBV_CACHE_DIR), so both pay for every
compilation. Reported per configuration: wall time, candidates/hour, outcomes, the share of slot
time spent idle waiting for the compile stage, and the speedup of the second GPU over the first.
Writes ``benchmarks/results/<date>-<device>-throughput.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kbv.batch import collect_pairs
from kbv.execute import make_executor
from kbv.problems import bundled_candidates_dir, bundled_suite_dir
from kbv.protocol import load_protocol

RESULTS = Path(__file__).resolve().parent / "results"


def bundled_pairs(sets: list[str] | None, repeat: int, limit: int | None) -> list[Any]:
    root = bundled_candidates_dir()
    names = sets or sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "honest_cpu")
    pairs: list[Any] = []
    for name in names:
        found, errors = collect_pairs(bundled_suite_dir(), root / name, label=name)
        for file, message in errors:
            print(f"skipping {file}: {message}", file=sys.stderr)
        pairs.extend(found)
    pairs = pairs[:limit] if limit else pairs
    return pairs * repeat


def run_config(slots: list[int], pairs: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="kbv-throughput-cache-")
    os.environ["KBV_CACHE_DIR"] = cache  # cold cache: this configuration compiles everything itself
    if args.device == "cuda":
        executor = make_executor("local", device="cuda", gpus=slots)
    else:
        executor = make_executor("local", device="cpu", workers=len(slots))
    outcomes: dict[str, int] = {}
    errors: list[str] = []

    def on_record(problem: Any, candidate: Any, record: Any, exc: Exception | None) -> None:
        if record is None:
            errors.append(f"{problem.name} x {candidate.path.name}: {exc}")
        else:
            outcomes[str(record.outcome)] = outcomes.get(str(record.outcome), 0) + 1

    with executor:
        env = executor.probe()
        started = time.monotonic()
        executor.map(
            pairs,
            load_protocol(args.protocol),
            timeout_s=args.timeout,
            on_record=on_record,
            should_skip=lambda p, c: False,
        )
        wall = time.monotonic() - started
        stats, health = executor.stats(), executor.health()
    return {
        "slots": len(slots),
        "devices": [f"cuda:{g}" for g in slots] if args.device == "cuda" else ["cpu"] * len(slots),
        "device_name": env["device_name"],
        "torch": env["torch"],
        "pairs": len(pairs),
        "wall_s": wall,
        "candidates_per_hour": len(pairs) / wall * 3600 if wall else None,
        "outcomes": outcomes,
        "harness_errors": errors,
        "idle_compile_share": stats.get("idle_compile_share"),
        "stats": stats,
        "removed": health.get("removed", {}),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Throughput, {report['date']}",
        "",
        f"{report['device_name']}, torch {report['torch']}, kbv {report['kbv']}, "
        f"protocol `{report['protocol']}`, {report['pairs']} evaluations per configuration "
        f"({report['repeat']}x the bundled GPU candidates), cold build cache.",
        "",
        "| slots | wall (s) | candidates/hour | speedup | idle waiting for compile | outcomes |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    base = report["configs"][0]["candidates_per_hour"]
    for config in report["configs"]:
        rate = config["candidates_per_hour"]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(config["outcomes"].items()))
        lines.append(
            f"| {config['slots']} | {config['wall_s']:.0f} | {rate:.0f} | {rate / base:.2f}x | "
            f"{100 * config['idle_compile_share']:.1f}% | {outcomes} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gpus", default="0,1", help="two GPU indices: the first alone, then both (default 0,1)"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--protocol", default="standard")
    parser.add_argument(
        "--sets", nargs="*", default=None, help="bundled candidate sets (default: all but honest_cpu)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="evaluate the suite this many times per configuration"
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N pairs (smoke tests)")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    if args.device == "cuda" and len(gpus) < 2:
        parser.error("--gpus needs two indices")
    pairs = bundled_pairs(args.sets, args.repeat, args.limit)
    if not pairs:
        parser.error("no problem x candidate pairs found")
    configs: list[dict[str, Any]] = []
    for slots in (gpus[:1], gpus[:2]):
        configs.append(run_config(slots, pairs, args))
        write_report(configs, pairs, args)  # a call cut short still leaves the configurations that finished
    return 0


def write_report(configs: list[dict[str, Any]], pairs: list[Any], args: argparse.Namespace) -> None:
    from kbv._version import __version__

    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device_name": configs[0]["device_name"],
        "torch": configs[0]["torch"],
        "kbv": __version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "protocol": args.protocol,
        "repeat": args.repeat,
        "pairs": len(pairs),
        "configs": configs,
        "second_gpu_speedup": configs[1]["candidates_per_hour"] / configs[0]["candidates_per_hour"]
        if len(configs) > 1
        else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date'][:10]}-{args.device}-throughput"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"written to {args.out / stem}.json and .md", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
