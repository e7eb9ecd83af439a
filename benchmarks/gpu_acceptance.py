"""GPU acceptance run: bundled CUDA and Triton candidates, GPU fixtures, and the TF32 case.

Run on a CUDA machine from the repository root::

    python benchmarks/gpu_acceptance.py --out benchmarks/results/gpu_acceptance

It pre-builds every extension in parallel (the build cache is shared with the evaluation workers),
evaluates each candidate under `verified` (and `standard` for the illegal-access batch), and writes
every record as JSONL plus a markdown summary with the date, GPU and torch version.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import sys
import time
from pathlib import Path

import torch

from kbv.batch import run_batch
from kbv.candidates import load_candidate
from kbv.problems import (
    bundled_candidates_dir,
    bundled_suite_dir,
    check_importable,
    load_module,
    load_problem,
)
from kbv.protocol import STANDARD, VERIFIED
from kbv.worker.builds import prebuild

ROOT = Path(__file__).resolve().parents[1]
GPU_FIXTURES = ROOT / "tests" / "fixtures" / "candidates" / "gpu"
FOUNDATION = ROOT / "tests" / "fixtures" / "candidates" / "foundation"


def _problem(stem: str):
    path = next(bundled_suite_dir().rglob(f"{stem}.py"))
    problem = load_problem(path)
    check_importable(problem)
    return problem


def _pairs() -> list[tuple]:
    pairs = []
    for name in ("honest_cuda", "honest_triton"):
        for file in sorted((bundled_candidates_dir() / name).glob("*.py")):
            pairs.append((_problem(file.stem), load_candidate(file, label=name)))
    pairs.append(
        (
            _problem("1_Linear_GELU_LayerNorm"),
            load_candidate(GPU_FIXTURES / "linear_gelu_ln_triton_tf32.py", label="gpu_fixtures"),
        )
    )
    pairs.append(
        (_problem("1_ReLU"), load_candidate(GPU_FIXTURES / "relu_raw_cudamalloc.py", label="gpu_fixtures"))
    )
    return pairs


def _build_snapshots(candidates: list) -> dict[str, dict]:
    """Each prebuilt source's build.ninja, ninja log and file times, to explain a later rebuild."""
    from compile_once import _snapshot  # benchmarks/ is on sys.path when this script runs

    from kbv.worker.builds import build_dir

    return {c.source_sha256: _snapshot(build_dir(c.source_sha256)) for c in candidates}


def _explain_rebuild(record, before: dict[str, dict]) -> None:
    """When a worker's compile phase took long although the source was prebuilt, print what changed."""
    from compile_once import _snapshot

    from kbv.worker.builds import build_dir

    sha = record.candidate.get("source_sha256") or ""
    if (record.phases_s.get("compile") or 0.0) < 5.0 or sha not in before:
        return
    old, new = before[sha], _snapshot(build_dir(sha))
    print(
        f"  REBUILT {Path(record.candidate['path']).name}: compile {record.phases_s['compile']:.1f} s",
        flush=True,
    )
    for line in difflib.unified_diff(
        old["ninja"].splitlines(), new["ninja"].splitlines(), "prebuild", "worker", lineterm="", n=0
    ):
        print(f"    ninja| {line[:200]} ...", flush=True)
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
            print(
                f"    ninja| {'+' if line[0] == '+' else '-'} words only here: "
                f"{_unique_words(line, old, new)}"
            )
    print(f"    log before: {old['ninja_log'][-6:]}", flush=True)
    print(f"    log after:  {new['ninja_log'][-6:]}", flush=True)
    changed = {k: (old["files"].get(k), v) for k, v in new["files"].items() if old["files"].get(k) != v}
    print(f"    files changed: {json.dumps(changed)[:1500]}", flush=True)


def _unique_words(line: str, old: dict, new: dict) -> list[str]:
    """The words of a changed build.ninja line that the other side's same line lacks (the flags)."""
    key = line[1:].split("=", 1)[0].strip()
    other = new if line[0] == "-" else old
    twin = next((x for x in other["ninja"].splitlines() if x.split("=", 1)[0].strip() == key), "")
    return [w for w in line[1:].split() if w not in set(twin.split())]


def _prebuild(candidates: list) -> list[dict]:
    started = time.monotonic()
    # The arch list as the evaluation worker decides it (a hard-coded "X.Y+PTX" once disagreed with
    # the worker, and every prebuilt source was built again inside its evaluation, ~60 s each).
    results = prebuild(candidates, device="cuda", workers=12)
    print(f"pre-built {len(candidates)} candidates in {time.monotonic() - started:.0f} s", flush=True)
    for candidate, result in zip(candidates, results):
        print(f"  {Path(candidate.path).name}: {result.status} in {result.seconds:.0f} s", flush=True)
    return [r.to_dict() for r in results]


def _tf32_rejected_by_fixed_tolerance() -> dict:
    """Does PyTorch's own TF32 output fail allclose(1e-3) against the float64 truth?"""
    problem = _problem("1_Linear_GELU_LayerNorm")
    module = load_module(problem.path)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda()
    with torch.device("cuda"):
        (x,) = module.get_inputs()
    torch.backends.cuda.matmul.allow_tf32 = True
    with torch.no_grad():
        tf32 = model(x)
        truth = model.double()(x.double())
    torch.backends.cuda.matmul.allow_tf32 = False
    return {
        "problem": problem.name,
        "tf32_allclose_1e-3": bool(torch.allclose(tf32.double(), truth, atol=1e-3, rtol=1e-3)),
        "tf32_max_abs_err": float((tf32.double() - truth).abs().max()),
    }


def _row(record) -> str:
    fails = ",".join(f.check for f in record.findings if f.severity == "fail") or "-"
    warns = ",".join(f.check for f in record.findings if f.severity == "warn") or "-"
    mem = record.memory or {}
    peak = mem.get("candidate_peak_bytes")
    base = mem.get("baseline_peak_bytes")
    speed = record.speedup or {}
    return (
        f"| {record.problem['name']} | "
        f"{record.candidate.get('label')}/{Path(record.candidate['path']).name} | "
        f"{record.protocol['name']} | {record.outcome} | {_fmt(speed.get('eager_fp32'))} | "
        f"{_fmt(speed.get('eager_tf32'))} | "
        f"{_fmt(speed.get('best'))} | {_mib(peak)} | {_mib(base)} | {fails} | {warns} |"
    )


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _mib(value) -> str:
    return f"{value / 2**20:.0f}" if isinstance(value, (int, float)) else "-"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/gpu_acceptance")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = [
        f"date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"gpu: {torch.cuda.get_device_name(0)}",
        f"torch: {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}",
    ]
    print("\n".join(header), flush=True)
    pairs = _pairs()
    illegal = [
        (_problem("1_ReLU"), load_candidate(GPU_FIXTURES / "relu_illegal_access.py", label="gpu_fixtures")),
        (_problem("1_ReLU"), load_candidate(FOUNDATION / "relu_plain.py", label="gpu_fixtures")),
    ]
    builds = _prebuild([c for _, c in pairs + illegal])
    snapshots = _build_snapshots([c for _, c in pairs + illegal])
    tf32 = _tf32_rejected_by_fixed_tolerance()
    print(json.dumps(tf32), flush=True)
    jsonl = out / "records.jsonl"
    jsonl.unlink(missing_ok=True)
    batch = run_batch(illegal, STANDARD, device="cuda", jsonl=jsonl)
    records = list(batch.records)
    for record in batch.records:
        print(_row(record), f"phases={ {k: round(v, 1) for k, v in record.phases_s.items()} }", flush=True)
        _explain_rebuild(record, snapshots)
    # One batch, as kbv run evaluates: the next pairs' workers boot while one is evaluated. Each
    # pair alone booted its own (5-7.6 s of a 9-12 s evaluation on an H100, 2026-12-07). The batch
    # appends each record to the JSONL as it finishes: a cut-short run keeps what finished.
    batch = run_batch(pairs, VERIFIED, device="cuda", jsonl=jsonl)
    for record in batch.records:
        records.append(record)
        print(_row(record), f"phases={ {k: round(v, 1) for k, v in record.phases_s.items()} }", flush=True)
        _explain_rebuild(record, snapshots)
    for error in batch.errors:
        print(f"harness error: {error}", flush=True)
    table = [
        "| problem | candidate | protocol | outcome | vs eager_fp32 | vs eager_tf32 | best | cand MiB "
        "| base MiB | fail findings | warn findings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in records],
    ]
    builds_text = "\n".join(
        f"- {b['source_sha256'][:12]}: {b['status']} in {b['seconds']:.0f} s {b['message'][:200]}"
        for b in builds
    )
    (out / "summary.md").write_text(
        "# GPU acceptance run\n\n"
        + "\n".join(f"- {h}" for h in header)
        + "\n\n"
        + "\n".join(table)
        + f"\n\nTF32 against the float64 truth: `{json.dumps(tf32)}`\n\nBuilds:\n{builds_text}\n"
    )
    print(f"wrote {out}/records.jsonl and {out}/summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
