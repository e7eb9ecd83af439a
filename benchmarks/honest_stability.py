"""How often does an honest candidate fail `verified`? Each one is evaluated N times, fresh secret
seeds each time; every run that does not pass is printed with its distributions and findings.

    python benchmarks/honest_stability.py --runs 15 [--device cpu] [--set honest_cpu] [--match NAME ...]
        [--protocol verified|PATH.toml]
    python benchmarks/honest_stability.py --device cuda --runs 3 --kernelbench ../shared/kernelbench/level1

Honest kernels must pass in every run (an RL reward that rejects correct code by luck teaches the
wrong lesson). Results are written as JSON lines to --out if given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kbv.api import evaluate_paths
from kbv.candidates import load_candidate, match_candidates
from kbv.problems import load_problems
from kbv.worker.builds import prebuild

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "src" / "kbv" / "suite"
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"
#: GPU candidates for KernelBench's own files, named after them (issue 12's honest kernels).
KERNELBENCH_CANDIDATES = FIXTURES / "gpu_kernelbench"


def _fixture_pairs() -> list[tuple[Path, Path]]:
    """Honest test fixtures with the problem each declares."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_hack_fixtures import fixture_spec  # noqa: PLC0415  (the tests own the fixture format)

    pairs = [(ROOT / fixture_spec(p)["problem"], p) for p in sorted((FIXTURES / "honest").glob("*.py"))]
    level1 = SUITE / "problems" / "level1"
    for name, problem in (
        ("layernorm_two_pass", "11_LayerNorm"),
        ("softmax_max_subtracted", "9_Softmax"),
        ("matmul_blocked", "25_Matmul_Square"),
    ):
        pairs.append((level1 / f"{problem}.py", FIXTURES / "verified" / f"{name}.py"))
    return pairs


def _suite_pairs(candidate_set: str) -> list[tuple[Path, Path]]:
    problems, _ = load_problems(SUITE / "problems")
    return [
        (problem.path, candidate.path)
        for problem, candidate in match_candidates(problems, SUITE / "candidates" / candidate_set)
    ]


def _kernelbench_pairs(level_dir: Path) -> list[tuple[Path, Path]]:
    """Each candidate of KERNELBENCH_CANDIDATES (``{problem stem}__{variant}.py``) with its
    KernelBench file."""
    pairs = []
    for candidate in sorted(KERNELBENCH_CANDIDATES.glob("*.py")):
        problem = level_dir / f"{candidate.stem.split('__')[0]}.py"
        if not problem.is_file():
            raise SystemExit(
                f"{candidate.name}: no {problem} (pass the level1 directory of a KernelBench tree)"
            )
        pairs.append((problem, candidate))
    return pairs


def _prebuild_all(pairs: list[tuple[Path, Path]], device: str) -> None:
    """The C++/CUDA sources built side by side before the first run: left to their first
    evaluation, the H200 machine built them one after another inside the runs (one CUDA LayerNorm
    took most of its three runs' 111 s)."""
    started = time.monotonic()
    results = prebuild([load_candidate(c, label="prebuild") for _, c in pairs], device=device)
    built = [r for r in results if r.status != "skipped"]
    if built:
        statuses = ", ".join(sorted({r.status for r in built}))
        print(f"prebuilt {len(built)} sources in {time.monotonic() - started:.0f} s ({statuses})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--set",
        action="append",
        help="bundled candidate set(s); default honest_cpu plus the honest test fixtures",
    )
    parser.add_argument(
        "--kernelbench",
        type=Path,
        help="KernelBench level1 directory: run the gpu_kernelbench candidates only",
    )
    parser.add_argument(
        "--match", action="append", help="keep only candidates whose file name contains this (repeatable)"
    )
    parser.add_argument(
        "--protocol", default="verified", help="a built-in name or a protocol TOML (default: verified)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.kernelbench:
        pairs = _kernelbench_pairs(args.kernelbench)
    else:
        pairs = [p for s in (args.set or ["honest_cpu"]) for p in _suite_pairs(s)]
        if not args.set:
            pairs += _fixture_pairs()
    if args.match:
        pairs = [(p, c) for p, c in pairs if any(m in c.name for m in args.match)]
    _prebuild_all(pairs, args.device)
    failures = 0
    out = args.out.open("a") if args.out else None
    for problem, candidate in pairs:
        outcomes: dict[str, int] = {}
        started = time.monotonic()
        for _ in range(args.runs):
            run_started = time.monotonic()
            record = evaluate_paths(problem, candidate, protocol=args.protocol, device=args.device)
            seconds = round(time.monotonic() - run_started, 1)
            outcomes[str(record.outcome)] = outcomes.get(str(record.outcome), 0) + 1
            flagged = [(f.check, f.severity, f.detail[:160]) for f in record.findings if f.severity != "info"]
            if record.outcome != "passed" or flagged:
                failed = [(d.name, d.note) for d in record.distributions if d.applicable and not d.passed]
                print(
                    f"  {candidate.name}: {record.outcome} seed={record.seeds['master']} findings={flagged} "
                    f"dists={failed}",
                    flush=True,
                )
            if out:
                out.write(
                    json.dumps(
                        {
                            "problem": problem.name,
                            "candidate": str(candidate.relative_to(ROOT)),
                            "outcome": record.outcome,
                            "seed": record.seeds["master"],
                            "findings": flagged,
                            "seconds": seconds,
                        }
                    )
                    + "\n"
                )
                out.flush()
        failures += args.runs - outcomes.get("passed", 0)
        print(
            f"{candidate.relative_to(ROOT)} on {problem.name}: {outcomes} "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    print(f"not passed: {failures} of {len(pairs) * args.runs}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
