"""Timing fidelity on the GPU: run-to-run spread of speedups, and events versus Nsight Compute.

    python benchmarks/fidelity.py --out benchmarks/results/fidelity [--runs 5] [--ncu] [--launch-check]
        [--classes elementwise ...] [--resume] [--launch-only]

For one honest candidate per bundled problem class, five independent evaluations (baseline cache
off, so every run measures its baselines anew) give the spread max/min - 1 of ``speedup.best``;
the target is <= 2% for kernels of 100 us or more. With ``--ncu``, three kernels are also timed by
``ncu --clock-control none`` and compared with kbv's event-timed median (target: within 3%). With
``--launch-check``, each class's call is also timed in a process of its own after a device sync (as
kbv's recipe does) and behind a spin kernel that hides the host path, which says how much of the
event time is the launch path. Every record goes to ``OUT/records.jsonl`` as it finishes, and each
run's per-round medians, interval and SM clock to ``fidelity.json``, so that a spread can be traced
to its cause afterwards; ``--resume`` keeps the classes ``fidelity.json`` already holds.
``--launch-only`` runs the launch check alone (``launch.json``).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kbv.candidates import load_candidate
from kbv.evaluation import evaluate
from kbv.problems import bundled_candidates_dir, bundled_suite_dir, check_importable, load_problem
from kbv.protocol import load_protocol
from kbv.worker.builds import prebuild

CLASSES = [
    ("elementwise", "honest_cuda", "1_ReLU"),
    ("softmax-wide", "honest_cuda", "8_Softmax_WideRow"),
    ("softmax", "honest_triton", "9_Softmax"),
    ("normalization", "honest_cuda", "11_LayerNorm"),
    ("matmul", "honest_cuda", "25_Matmul_Square"),
]
NCU_CASES = ["1_ReLU", "8_Softmax_WideRow", "11_LayerNorm"]
PROTOCOL = """name = "fidelity"
base = "verified"
[correctness]
distributions = ["original"]
draws_per_distribution = 1
[timing]
cache_baselines = false
[integrity]
static = false
dynamic = false
"""


def fidelity_protocol():
    """:data:`PROTOCOL`, loaded (through a file, as a user's protocol is)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
        handle.write(PROTOCOL)
    return load_protocol(handle.name)


def _pair(candidate_set: str, stem: str):
    problem = load_problem(next(bundled_suite_dir().rglob(f"{stem}.py")))
    check_importable(problem)
    return problem, load_candidate(
        bundled_candidates_dir() / candidate_set / f"{stem}.py", label=candidate_set
    )


def _ncu_ms(problem_path: Path, candidate_path: Path) -> float | None:
    command = [
        "ncu",
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "--metrics",
        "gpu__time_duration.sum",
        "--csv",
        "--page",
        "raw",
        sys.executable,
        str(Path(__file__).with_name("_ncu_target.py")),
        str(problem_path),
        str(candidate_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    rows = [line for line in done.stdout.splitlines() if line.startswith('"')]
    if len(rows) < 3:
        print(done.stdout[-2000:], done.stderr[-2000:], flush=True)
        return None
    table = list(csv.DictReader(io.StringIO("\n".join([rows[0], *rows[2:]]))))
    unit = rows[1].split(",")[list(table[0].keys()).index("gpu__time_duration.sum")].strip('"')
    scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "ns": 1e-6, "us": 1e-3, "ms": 1.0}.get(
        unit, 1e-6
    )
    return sum(float(r["gpu__time_duration.sum"].replace(",", "")) for r in table) * scale


def _prebuild(pairs: list) -> None:
    """Every CUDA source built side by side first (a fresh machine built each inside its first
    evaluation, one after another: about a minute apiece), with the arch list the worker uses."""
    started = time.monotonic()
    results = prebuild([candidate for _, candidate in pairs], device="cuda", workers=len(pairs))
    statuses = ", ".join(f"{Path(c.path).name}: {r.status}" for (_, c), r in zip(pairs, results, strict=True))
    print(f"prebuilt in {time.monotonic() - started:.0f} s ({statuses})", flush=True)


def _run_detail(record) -> dict:
    """What one evaluation's timing says beyond its median, to tell a per-run offset from noise:
    per-round medians of the candidate and each baseline, the within-run interval, the SM clock."""
    timing = record.timing or {}

    def per_round(side: dict) -> list[float]:
        return [statistics.median(r["device_ms"]) for r in side.get("rounds", []) if r.get("device_ms")]

    candidate = timing.get("candidate") or {}
    summary = candidate.get("summary") or {}
    return {
        "outcome": record.outcome,
        "speedup_best": record.speedup.get("best"),
        "candidate_median_ms": summary.get("median"),
        "candidate_ci95_ms": [summary.get("ci95_low"), summary.get("ci95_high")],
        "candidate_cv": summary.get("cv"),
        "candidate_round_medians_ms": per_round(candidate),
        "candidate_wall_median_ms": (candidate.get("wall_summary") or {}).get("median"),
        "baseline_round_medians_ms": {
            name: per_round(side) for name, side in (timing.get("baselines") or {}).items()
        },
        "sm_clock_mhz": [
            (r.get("gpu_before") or {}).get("sm_clock_mhz") for r in candidate.get("rounds", [])
        ],
    }


def prebuilt_env(candidate) -> dict[str, str]:
    """This process's environment with the build directories and arch list kbv's worker uses for
    ``candidate``, so a plain process loads the prebuilt extension instead of building it again
    (a minute on a fresh machine: a launch check that did not built ReLU's in its own process)."""
    import os

    from kbv import telemetry
    from kbv.worker.builds import arch_list_for, build_dir

    builds = build_dir(candidate.source_sha256)
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = str(builds / "torch_extensions")
    env["TRITON_CACHE_DIR"] = str(builds / "triton")
    arch = arch_list_for(telemetry.compute_capability("cuda"))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    return env


def _launch_check(problem, candidate, calls: int = 200) -> dict | None:
    """The same call timed after a device sync (kbv's way) and behind a spin kernel that hides its
    host path (``_ncu_target.py --launch-check``): how much of the event time is the launch path."""
    target = str(Path(__file__).with_name("_ncu_target.py"))
    command = [sys.executable, target, str(problem.path), str(candidate.path), "--launch-check", str(calls)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=prebuilt_env(candidate))
    if done.returncode != 0:
        print(done.stderr[-2000:], flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/fidelity")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument(
        "--launch-check", action="store_true", help="per class, event time with and without the launch path"
    )
    parser.add_argument("--classes", nargs="+", choices=[c for c, _, _ in CLASSES], help="only these classes")
    parser.add_argument("--resume", action="store_true", help="keep the classes in OUT/fidelity.json")
    parser.add_argument(
        "--launch-only",
        action="store_true",
        help="only the launch check of each class, into OUT/launch.json (no evaluations, no ncu)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    protocol = fidelity_protocol()
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "classes": [],
    }
    if args.resume and (out / "fidelity.json").is_file():
        results["classes"] = json.loads((out / "fidelity.json").read_text())["classes"]
    done = set() if args.launch_only else {e["class"] for e in results["classes"]}
    chosen = [c for c in CLASSES if c[0] not in done and (not args.classes or c[0] in args.classes)]
    pairs = [_pair(candidate_set, stem) for _, candidate_set, stem in chosen]
    if pairs:  # a resumed run may have nothing left to build
        _prebuild(pairs)
    if args.launch_only:
        return _launch_only(chosen, pairs, out / "launch.json")
    for (klass, candidate_set, stem), (problem, candidate) in zip(chosen, pairs, strict=True):
        runs = []
        for _ in range(args.runs):
            record = evaluate(problem, candidate, protocol, "cuda")
            with (out / "records.jsonl").open("a") as stream:  # every record, for a later diagnosis
                stream.write(record.to_json() + "\n")
            runs.append(_run_detail(record))
        best = [r["speedup_best"] for r in runs]
        medians = [r["candidate_median_ms"] for r in runs if r["candidate_median_ms"] is not None]
        entry = {
            "class": klass,
            "candidate": f"{candidate_set}/{stem}",
            "outcomes": [r["outcome"] for r in runs],
            "speedup_best": best,
            "candidate_median_ms": medians,
            "spread": (max(best) / min(best) - 1) if all(isinstance(b, float) for b in best) else None,
            "runs": runs,
        }
        if args.launch_check:
            entry["launch_check"] = _launch_check(problem, candidate)
        if args.ncu and stem in NCU_CASES and medians:
            ncu = _ncu_ms(problem.path, candidate.path)
            entry["ncu_ms"] = ncu
            entry["event_vs_ncu"] = (sorted(medians)[len(medians) // 2] / ncu - 1) if ncu else None
        results["classes"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "runs"}), flush=True)
        # after each class: a run cut by its time limit keeps what it measured
        (out / "fidelity.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Timing fidelity ({results['date']}, {results['gpu']}, torch {results['torch']})",
        "",
        "| class | candidate | median ms (runs) | speedup.best (runs) | spread | ncu ms | events vs ncu "
        "| launch path ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in results["classes"]:
        launch = (e.get("launch_check") or {}).get("launch_path_ms")
        lines.append(
            f"| {e['class']} | {e['candidate']} | "
            f"{', '.join(f'{m:.4f}' for m in e['candidate_median_ms'])} | "
            f"{', '.join(f'{b:.3f}' if b else '-' for b in e['speedup_best'])} | {_pct(e['spread'])} | "
            f"{e.get('ncu_ms', '-') if e.get('ncu_ms') is None else format(e['ncu_ms'], '.4f')} | "
            f"{_pct(e.get('event_vs_ncu'))} | {'-' if launch is None else format(launch, '.4f')} |"
        )
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _launch_only(chosen: list, pairs: list, path: Path) -> int:
    """Each class's launch check alone, written after each class: a few seconds a class, for
    bisecting where an evaluation's samples exceed the synced call (the per-run evaluations take
    a minute or more a class)."""
    checks = {}
    for (klass, _, _), (problem, candidate) in zip(chosen, pairs, strict=True):
        checks[klass] = _launch_check(problem, candidate)
        print(json.dumps({klass: checks[klass]}), flush=True)
        path.write_text(json.dumps(checks, indent=2))
    return 0


def _pct(value) -> str:
    return f"{value * 100:+.2f}%" if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    raise SystemExit(main())
