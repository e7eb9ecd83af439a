"""What a `verified` evaluation costs, and what the TF32 baseline does to speedups.

    python benchmarks/verified_cost.py                              # on the GPU: bundled CUDA/Triton sets
    python benchmarks/verified_cost.py --device cpu --sets honest_cpu --limit 3   # smoke test
    python benchmarks/verified_cost.py --kernelbench DIR --results rows.jsonl [--part 1/2]
    python benchmarks/verified_cost.py --kernelbench DIR --results rows.jsonl --device cpu --cpu-sizes

KernelBench mode: the reference itself submitted as the candidate (``Model`` renamed ``ModelNew``)
on the fixed sample :data:`KERNELBENCH_SAMPLE` (20 level-1, 8 level-2, 4 level-3 problems without
helper classes) of a KernelBench tree (``DIR/level1`` ...), evaluated under ``standard`` and then
``verified`` as two kbv batches (workers prespawned as in ``kbv run``). Every finished evaluation is
appended to ``--results`` at once; a second command with the same file skips what is there, so the
sample can be split over several commands (``--part K/N``) and resumed. ``--report`` reads the file
and writes the summary: per protocol and phase the median and p95 per candidate, the batch's wall
time per candidate, and the peak resident memory of all kbv processes (sampled every 100 ms)
against the largest problem's input plus output bytes. The figures are a problem's first
candidate's: run it with no baselines of the sample cached (``gpu_steps.sh``'s cost steps empty
``$KBV_CACHE_DIR/baselines`` first), or the rows that find theirs cached show ``baseline`` 0.

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
from kbv.evaluation import evaluate
from kbv.problems import bundled_candidates_dir, bundled_suite_dir
from kbv.protocol import load_protocol

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("compile", "load", "correctness", "integrity", "timing", "baseline")


#: The fixed KernelBench sample (level, file stem): no helper classes, so renaming Model is enough.
KERNELBENCH_SAMPLE: tuple[tuple[int, str], ...] = (
    (1, "1_Square_matrix_multiplication_"),
    (1, "4_Matrix_vector_multiplication_"),
    (1, "9_Tall_skinny_matrix_multiplication_"),
    (1, "15_Matmul_for_lower_triangular_matrices"),
    (1, "19_ReLU"),
    (1, "21_Sigmoid"),
    (1, "23_Softmax"),
    (1, "26_GELU_"),
    (1, "33_BatchNorm"),
    (1, "36_RMSNorm_"),
    (1, "40_LayerNorm"),
    (1, "42_Max_Pooling_2D"),
    (1, "47_Sum_reduction_over_a_dimension"),
    (1, "51_Argmax_over_a_dimension"),
    (1, "63_conv_standard_2D__square_input__square_kernel"),
    (1, "89_cumsum"),
    (1, "94_MSELoss"),
    (1, "95_CrossEntropyLoss"),
    (1, "97_ScaledDotProductAttention"),
    (1, "100_HingeLoss"),
    (2, "12_Gemm_Multiply_LeakyReLU"),
    (2, "14_Gemm_Divide_Sum_Scaling"),
    (2, "1_Conv2D_ReLU_BiasAdd"),
    (2, "17_Conv2d_InstanceNorm_Divide"),
    (2, "29_Matmul_Mish_Mish"),
    (2, "33_Gemm_Scale_BatchNorm"),
    (2, "40_Matmul_Scaling_ResidualAdd"),
    (2, "45_Gemm_Sigmoid_LogSumExp"),
    (3, "1_MLP"),
    (3, "2_ShallowWideMLP"),
    (3, "3_DeepNarrowMLP"),
    (3, "31_VisionAttention"),
)
PROTOCOLS = ("standard", "verified")


def reference_as_candidate(source: str) -> str:
    """The problem's own ``Model`` as the candidate's ``ModelNew`` (every use of the name)."""
    import re

    return re.sub(r"\bModel\b", "ModelNew", source)


def kernelbench_pairs(root: Path, work: Path, part: tuple[int, int], cpu_sizes: bool = False) -> list[Any]:
    """The part's problems with the reference as the candidate. ``cpu_sizes`` shrinks each problem's
    size constants as the protocol audit's CPU rehearsal does (``protocol_audit.shrunk_sizes``), so
    the sample runs on a few CPU cores: the CPU sample of ``verified`` over ``standard``. A problem
    the shrinking cannot bring under the rehearsal's element bound is left out, with a note (the
    level-3 MLPs: their layer widths are a list, which it does not shrink; 2_ShallowWideMLP would
    still hold 1e9 parameters)."""
    from kbv.candidates import load_candidate
    from kbv.problems import load_problem

    k, n = part
    chosen = [entry for i, entry in enumerate(KERNELBENCH_SAMPLE) if i % n == k - 1]
    work.mkdir(parents=True, exist_ok=True)
    pairs = []
    for level, stem in chosen:
        path = root / f"level{level}" / f"{stem}.py"
        if cpu_sizes:
            shrunk = _shrunk_copy(path, work / f"level{level}")
            if shrunk is None:
                print(f"left out of the CPU sample: level{level}/{stem} (too large once shrunk)", flush=True)
                continue
            path = shrunk
        candidate = work / f"level_{level}_problem_{stem.split('_')[0]}_sample_0_kernel.py"
        candidate.write_text(reference_as_candidate(path.read_text()))
        pairs.append((load_problem(path), load_candidate(candidate, label="reference")))
    return pairs


def _shrunk_copy(path: Path, folder: Path) -> Path | None:
    """A copy of a KernelBench problem shrunk for the CPU (the protocol audit's rehearsal sizes), or
    None where it still holds more than the rehearsal's element bound."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from protocol_audit import CPU_REHEARSAL_ELEMENTS, _elements, shrunk_sizes, with_constants

    source = path.read_text()
    sizes = shrunk_sizes(source)
    shrunk = f"# kbv: shrunk for the CPU sample: {sizes}\n" + with_constants(source, sizes)
    if _elements(shrunk) > CPU_REHEARSAL_ELEMENTS:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / path.name
    copy.write_text(shrunk)
    return copy


class MemorySampler:
    """Peak resident memory of this process and all its descendants together, every ``period_s``."""

    def __init__(self, period_s: float = 0.1) -> None:
        import threading

        self.period_s, self.peak_bytes, self._stop = period_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(os.getpid()))


def tree_rss_bytes(root: int) -> int:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree}
        tree |= frontier
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm") as handle:
                total += int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def problem_bytes(path: Path) -> int | None:
    """Input plus output bytes of one problem at its own sizes, on the meta device (no memory)."""
    import torch

    from kbv.problems import load_module

    try:
        module = load_module(path)
        with torch.device("meta"):
            inputs = module.get_inputs()
            model = module.Model(*module.get_init_inputs())
            outputs = model(*inputs)
    except Exception:  # an operator without a meta kernel: the figure is unknown, say so
        return None
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return sum(t.numel() * t.element_size() for t in [*inputs, *outputs] if isinstance(t, torch.Tensor))


def run_kernelbench(args: argparse.Namespace) -> int:
    from kbv.batch import run_batch

    done = set()
    if args.results.exists():
        done = {
            (r["protocol"], r["problem"])
            for r in map(json.loads, args.results.read_text().splitlines())
            if r.get("kind") == "row"
        }
    pairs = kernelbench_pairs(args.kernelbench, args.work, args.part, cpu_sizes=args.cpu_sizes)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for name in PROTOCOLS:
        todo = [(p, c) for p, c in pairs if (name, p.name) not in done]
        if not todo:
            continue
        protocol = load_protocol(name)
        started = time.monotonic()
        with MemorySampler() as memory:
            result = run_batch(
                todo,
                protocol,
                device=args.device,
                timeout_s=args.timeout,
                evaluate_fn=_appending(args.results, name),
            )
        wall = time.monotonic() - started
        compile_s = sum(float(r.phases_s.get("compile", 0.0)) for r in result.records)
        batch = {
            "kind": "batch",
            "protocol": name,
            "part": list(args.part),
            "candidates": len(todo),
            "wall_s": wall,
            "compile_s": compile_s,
            "peak_rss_bytes": memory.peak_bytes,
            "errors": result.errors,
        }
        with open(args.results, "a") as handle:
            handle.write(json.dumps(batch) + "\n")
        print(
            f"{name}: {len(todo)} candidates in {wall:.1f} s "
            f"({(wall - compile_s) / max(1, len(todo)):.2f} s each excl. compile), "
            f"peak RSS {memory.peak_bytes / 2**30:.2f} GiB",
            flush=True,
        )
    return 0


def _appending(results: Path, protocol: str) -> Any:
    """``evaluate`` that appends each finished row to the results file the moment it is done."""
    import functools

    from kbv.evaluation import evaluate

    @functools.wraps(evaluate)
    def run(problem: Any, candidate: Any, protocol_obj: Any, device: Any, **kwargs: Any) -> Any:
        record = evaluate(problem, candidate, protocol_obj, device, **kwargs)
        row = {
            "kind": "row",
            "protocol": protocol,
            "problem": problem.name,
            "outcome": record.outcome,
            "phases_s": record.phases_s,
            "speedup": record.speedup.get("best"),
            "failed": [d.name for d in record.distributions if d.applicable and not d.passed],
            "findings": [
                f"{f.check}:{f.severity}: {f.detail[:300]}" for f in record.findings if f.severity != "info"
            ],
            "error": (record.error or {}).get("message", "")[-600:] if record.error else None,
            "bytes": problem_bytes(problem.path),
            # kbv's parent's most reserved GPU memory per phase (GPU only): where its copies go
            "parent_peak_bytes": record.memory.get("parent_device_peak_bytes") or {},
            # how the evaluation held its GPU, and from which correctness draw on the workers took
            # turns (kbv.evaluation.draws._side_by_side)
            "gpu": record.isolation.get("gpu"),
        }
        with open(results, "a") as handle:
            handle.write(json.dumps(row, default=str) + "\n")
        print(
            f"  {protocol} {problem.name}: {record.outcome} {record.phases_s.get('total', 0):.1f} s "
            + " ".join(f"{k}={v:.1f}" for k, v in record.phases_s.items() if v >= 0.05 and k != "total"),
            flush=True,
        )
        return record

    run.uses_spares = True  # type: ignore[attr-defined]
    return run


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def kernelbench_report(results: Path, out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    report: dict[str, Any] = {"protocols": {}, "rows": [r for r in rows if r["kind"] == "row"]}
    largest = max((r.get("bytes") or 0 for r in report["rows"]), default=0)
    for name in PROTOCOLS:
        mine = [r for r in report["rows"] if r["protocol"] == name]
        batches = [b for b in rows if b["kind"] == "batch" and b["protocol"] == name]
        totals = [
            float(r["phases_s"].get("total", 0.0)) - float(r["phases_s"].get("compile", 0.0)) for r in mine
        ]
        phases = sorted({k for r in mine for k in r["phases_s"]})
        wall = sum(b["wall_s"] - b["compile_s"] for b in batches)
        report["protocols"][name] = {
            "candidates": len(mine),
            "outcomes": {
                o: sum(r["outcome"] == o for r in mine) for o in sorted({r["outcome"] for r in mine})
            },
            "median_s": statistics.median(totals) if totals else None,
            "p95_s": percentile(totals, 0.95),
            "batch_wall_per_candidate_s": wall / max(1, sum(b["candidates"] for b in batches)),
            "phase_median_s": {
                k: statistics.median(float(r["phases_s"].get(k, 0.0)) for r in mine) for k in phases
            },
            "phase_p95_s": {
                k: percentile([float(r["phases_s"].get(k, 0.0)) for r in mine], 0.95) for k in phases
            },
            "peak_rss_bytes": max((b["peak_rss_bytes"] for b in batches), default=0),
            # pairs that gave no row: the harness failed (on an 80 GB card, a problem too large
            # for it under `verified`), so they are in neither the medians nor the ratios
            "harness_errors": [str(e)[:300] for b in batches for e in b.get("errors", [])],
            "parent_peak_by_phase": parent_peak_by_phase(mine),
        }
    report["largest_problem_bytes"] = largest
    report["verified_over_standard"] = ratio_of_medians(report["rows"])
    report["per_problem_ratio"] = per_problem_ratio(report["rows"])
    out.write_text(json.dumps(report, indent=2, default=str))
    return report


def parent_peak_by_phase(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per phase, the most kbv's parent reserved on the GPU over the rows, GiB, and the problem
    where it did (rows without the figure, the CPU's and older ones, count for nothing)."""
    most: dict[str, dict[str, Any]] = {}
    for r in rows:
        for phase, peak in (r.get("parent_peak_bytes") or {}).items():
            if peak > most.get(phase, {}).get("bytes", -1):
                most[phase] = {"bytes": peak, "gib": round(peak / 2**30, 2), "problem": r["problem"]}
    return dict(sorted(most.items()))


def _timed_by_both(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per problem both protocols timed, each protocol's time without compilation."""
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        phases = r["phases_s"]
        total = float(phases.get("total", 0.0)) - float(phases.get("compile", 0.0))
        totals.setdefault(r["problem"], {})[r["protocol"]] = total
    return [t for t in totals.values() if "standard" in t and "verified" in t]


def ratio_of_medians(rows: list[dict[str, Any]]) -> float | None:
    """``verified``'s median over ``standard``'s, on the problems both timed: a problem one protocol
    could not evaluate (too large for the GPU under ``verified``) would otherwise move one median
    and not the other (on an H100 on 2026-12-06, 1.77x over every `standard` row against 2.11x on
    the 23 problems both timed)."""
    both = _timed_by_both(rows)
    standard = statistics.median(t["standard"] for t in both) if both else 0.0
    return statistics.median(t["verified"] for t in both) / standard if standard else None


def per_problem_ratio(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``verified`` over ``standard`` problem by problem (compilation excluded), for the problems
    both timed: its median beside the issue's ratio of the medians, which on a sample whose
    ``verified`` times fall in two groups hangs on the one or two problems at the groups' edges
    (results/2026-12-03-h200-verified-v3-cost/)."""
    ratios = sorted(t["verified"] / t["standard"] for t in _timed_by_both(rows) if t["standard"])
    return {
        "problems": len(ratios),
        "median": statistics.median(ratios) if ratios else None,
        "p95": percentile(ratios, 0.95),
    }


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
        rows.append(
            {
                "problem": problem.name,
                "candidate": f"{candidate.label}/{candidate.path.name}",
                "outcome": record.outcome,
                "wall_s": wall,
                "wall_excl_compile_s": wall - phases["compile"],
                "phases_s": phases,
                "speedup": {
                    k: record.speedup.get(k) for k in ("eager_fp32", "eager_tf32", "compile", "best")
                },
            }
        )
        print(
            f"  {rows[-1]['candidate']}: {record.outcome} {wall:.1f} s "
            + " ".join(f"{k}={v:.1f}" for k, v in phases.items() if v),
            flush=True,
        )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "total_s": sum(r["wall_s"] for r in rows),
        "median_excl_compile_s": statistics.median(r["wall_excl_compile_s"] for r in rows) if rows else None,
        "median_phase_s": {k: statistics.median(r["phases_s"][k] for r in rows) for k in PHASES}
        if rows
        else {},
    }


def markdown(report: dict[str, Any]) -> str:
    first, second = report["passes"][0]["summary"], report["passes"][1]["summary"]
    lines = [
        f"# Cost of a verified evaluation, {report['date']}",
        "",
        f"{report['device_name']}, torch {report['torch']}, kbv {report['kbv']}, "
        f"{report['pairs']} candidates "
        f"({', '.join(report['sets'])}), one fresh cache for both passes.",
        "",
        "| pass | total (s) | median per candidate excl. compile (s) | "
        + " | ".join(f"median {p} (s)" for p in PHASES)
        + " |",
        "|---|---:|---:|" + "---:|" * len(PHASES),
    ]
    for name, s in (("first (cold)", first), ("second (cached)", second)):
        lines.append(
            f"| {name} | {s['total_s']:.1f} | {s['median_excl_compile_s']:.2f} | "
            + " | ".join(f"{s['median_phase_s'][p]:.2f}" for p in PHASES)
            + " |"
        )
    lines += [
        "",
        f"Second pass {report['second_pass_speedup']:.1f}x faster than the first.",
        "",
        "| candidate | outcome | vs eager_fp32 | vs eager_tf32 | best |",
        "|---|---|---:|---:|---:|",
    ]
    for row in report["passes"][0]["rows"]:
        s = row["speedup"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(
            f"| {row['candidate']} | {row['outcome']} | {fmt(s['eager_fp32'])} | "
            f"{fmt(s['eager_tf32'])} | {fmt(s['best'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sets", nargs="*", default=["honest_cuda", "honest_triton", "hacks_gpu"])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--kernelbench", type=Path, default=None, help="a KernelBench tree (level1/, level2/, level3/)"
    )
    parser.add_argument(
        "--results", type=Path, default=None, help="KernelBench mode: the rows file (appended, resumed)"
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kbv-kb-candidates")
    parser.add_argument(
        "--part",
        type=lambda t: tuple(int(x) for x in t.split("/")),
        default=(1, 1),
        help="K/N: every N-th problem from the K-th",
    )
    parser.add_argument(
        "--report", type=Path, default=None, help="KernelBench mode: write the summary of --results here"
    )
    parser.add_argument(
        "--cpu-sizes",
        action="store_true",
        help="KernelBench mode: shrink each problem for the CPU (the protocol audit's rehearsal sizes)",
    )
    args = parser.parse_args()
    if args.report:
        print(json.dumps(kernelbench_report(args.results, args.report)["protocols"], indent=2))
        return 0
    if args.kernelbench:
        if args.results is None:
            parser.error("--kernelbench needs --results FILE")
        return run_kernelbench(args)
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
        "torch": torch.__version__,
        "kbv": __version__,
        "sets": args.sets,
        "pairs": len(pairs),
        "passes": passes,
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
