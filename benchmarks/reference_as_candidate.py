"""The reference itself as the candidate: does every problem's own Model pass ``verified``?

Issue 12's acceptance: on the H200 the reference submitted as the candidate passes ``verified`` on
every level-1 KernelBench problem, and so does the reference with TF32 switched on inside its
``forward`` (and back off before it returns). For each problem file this writes a candidate whose
``ModelNew`` is the problem's ``Model`` under another name (``--tf32``: with the TF32 wrapper),
evaluates the pair, and appends one JSON line per evaluation to ``--out``; problems already in
``--out`` with a passing latest row are skipped, so a run cut short by a time limit resumes where
it stopped. The pairs run on kbv's sequential executor, as ``kbv run``'s do: the next problem's
workers boot while one is evaluated, so an evaluation does not start its workers cold.

    python benchmarks/reference_as_candidate.py ../shared/kernelbench/level1 --device cuda \\
        --out $OUT/reference.jsonl [--tf32] [--shard 0/2] [--budget-s 540]

Issue 39's acceptance evaluates in half precision, each problem several times on fresh seeds:
``--precision bf16 --runs 3`` (a problem is done once its latest ``--runs`` rows of that precision
passed).

A problem the GPU is too small for under ``verified`` (kbv's ``HarnessError`` saying so: its other
processes left the candidate less than its device limit) is settled too, and counted apart from the
rejections: run again on a GPU with more memory with ``--retry-too-small``.

``--long-reductions`` keeps only the problems where ``verified`` draws its long-reduction
distributions (``spiked``): an output element reduces at least ``long_reduction_min`` input
elements. The lengths come from shapes alone, the problem run on PyTorch's meta device; a problem
whose shapes cannot be found that way is kept.

Static findings that name the reference's own operators (``reference_operator``) are warnings by
design; a ``fail`` finding or an outcome other than ``passed`` is what the lead must fix or explain.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from kbv.candidates import load_candidate
from kbv.correctness import reduction_lengths
from kbv.evaluation.budget import too_small_for_gpu
from kbv.execute import make_executor
from kbv.integrity.dynamic import NOT_CHECKED
from kbv.problems import check_importable, discover, load_problem
from kbv.protocol import load_protocol
from kbv.protocol_audit._sources import uses_tf32_ops

_TF32_WRAPPER = """

_kbv_reference_forward = ModelNew.forward


def _kbv_forward_with_tf32(self, *args, **kwargs):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        return _kbv_reference_forward(self, *args, **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


ModelNew.forward = _kbv_forward_with_tf32
"""


def candidate_source(problem_source: str, tf32: bool) -> str:
    """The problem's source with ``Model`` renamed ``ModelNew`` (optionally TF32 inside forward)."""
    source = re.sub(r"\bModel\b", "ModelNew", problem_source)
    if tf32:
        source = ("import torch\n" if "import torch\n" not in source else "") + source + _TF32_WRAPPER
    return source


def _too_small(row: dict) -> bool:
    """Whether a row is kbv's failure for want of device memory, not a verdict on the candidate."""
    return row.get("outcome") == "harness_error" and too_small_for_gpu(str(row.get("error", "")))


def _done(out: Path, precision: str = "fp32", runs: int = 1, retry_too_small: bool = False) -> dict[str, int]:
    """Per problem, how many of its latest rows of ``precision`` passed in a row (at most ``runs``).
    Rows are appended, so the file keeps every earlier run; a problem whose latest row did not pass
    starts again (after a fix, or to tell a flaky verdict), except one the GPU was too small for
    (:func:`_too_small`): the same GPU would only say so again, unless ``retry_too_small``."""
    if not out.is_file():
        return {}
    passed: dict[str, int] = {}
    for line in out.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("precision", "fp32") != precision:
                continue
            if _too_small(row) and not retry_too_small:
                passed[row["problem"]] = runs
                continue
            ok = row["outcome"] == "passed"
            passed[row["problem"]] = min(runs, passed.get(row["problem"], 0) + 1) if ok else 0
    return passed


def _write(out, counts: dict, row: dict) -> None:
    if _too_small(row):
        counts["too_small"] += 1
    else:
        counts["failures"] += row["outcome"] != "passed"
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(
        f"{row['problem']}: {row['outcome']} ({row['seconds']} s) {row.get('failed') or ''} "
        f"{row.get('fail_findings') or ''}",
        flush=True,
    )


def _row(name: str, tf32: bool, record) -> dict:
    return {
        "problem": name,
        "tf32": tf32,
        "precision": record.protocol.get("settings", {}).get("precision", "fp32"),
        "outcome": record.outcome,
        "seed": record.seeds["master"],
        "failed": [
            (d.name, d.rel_err, (d.note or "")[:200])
            for d in record.distributions
            if d.applicable and not d.passed
        ],
        "fail_findings": [(f.check, f.detail[:200]) for f in record.findings if f.severity == "fail"],
        # checks kbv could not make (the reference failed the check's probe): a pass is only as good
        # as the checks it made
        "not_checked": [
            (f.check, f.detail[:200]) for f in record.findings if f.detail.startswith(NOT_CHECKED)
        ],
        "structure": record.seeds.get("structure"),
        "error": (record.error or {}).get("message", "")[:1500],
        "error_worker": (record.error or {}).get("worker"),  # which worker failed: a sweep's first question
        "phases_s": {k: round(v, 3) for k, v in record.phases_s.items()},
        "gpu": record.isolation.get("gpu"),
        "baselines": sorted((record.timing or {}).get("baselines") or {}),
        "baselines_not_measured": (record.timing or {}).get("baselines_not_measured"),
    }


def reduces_long(path: Path, minimum: int) -> bool:
    """Whether an output element of the problem at ``path`` reduces at least ``minimum`` input
    elements (:func:`kbv.correctness.reduction_lengths`), from shapes on the meta device: nothing
    is allocated, so a 1e9-element problem costs nothing. True where the shapes cannot be found."""
    try:
        spec = importlib.util.spec_from_file_location(f"_kbv_shapes_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with torch.device("meta"):
            spec.loader.exec_module(module)
            inputs = module.get_inputs()
            out = module.Model(*module.get_init_inputs())(*inputs)
    except Exception:  # noqa: BLE001 - an operator without a meta kernel: evaluate the problem
        return True
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    numels = [t.numel() for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max(reduction_lengths(numels, outputs), default=1) >= minimum


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problems", type=Path, help="a problem file or directory (e.g. KernelBench level1)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tf32", action="store_true", help="switch TF32 on inside forward (and back off)")
    ap.add_argument("--shard", default="0/1", help="i/n: evaluate every n-th problem starting at i")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no evaluation after this many seconds")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--runs", type=int, default=1, help="passing runs (fresh seeds) wanted per problem")
    ap.add_argument(
        "--retry-too-small",
        action="store_true",
        help="evaluate again the problems an earlier run's GPU was too small for (on a larger GPU)",
    )
    ap.add_argument(
        "--long-reductions",
        action="store_true",
        help="only the problems where verified draws its long-reduction distributions (spiked)",
    )
    args = ap.parse_args()
    index, count = (int(x) for x in args.shard.split("/"))
    files = [f for k, f in enumerate(discover(args.problems)) if k % count == index]
    protocol = load_protocol("verified").with_precision(args.precision)
    if args.long_reductions:
        files = [f for f in files if reduces_long(f, protocol.correctness.long_reduction_min)]
    done = _done(args.out, args.precision, args.runs, args.retry_too_small)
    todo = [f for f in files for _ in range(args.runs - done.get(f.stem, 0))]
    if args.tf32:  # where TF32 changes the numbers first: a call cut by its budget proves those
        todo.sort(key=lambda f: not uses_tf32_ops(f.read_text()))
    started = time.monotonic()
    counts = {"failures": 0, "too_small": 0, "left": 0}
    with tempfile.TemporaryDirectory(prefix="kbv-ref-cand-") as tmp, args.out.open("a") as out:
        pairs = []
        for problem_path in todo:
            candidate = Path(tmp) / f"{problem_path.stem}.py"
            candidate.write_text(candidate_source(problem_path.read_text(), args.tf32))
            try:
                problem = load_problem(problem_path)
                check_importable(problem)
            except Exception as exc:  # the problem's own failure: recorded, the run goes on
                _write(
                    out,
                    counts,
                    {
                        "problem": problem_path.stem,
                        "tf32": args.tf32,
                        "precision": args.precision,
                        "seconds": 0.0,
                        "outcome": "harness_error",
                        "error": f"{type(exc).__name__}: {exc}"[:500],
                    },
                )
                continue
            pairs.append((problem, load_candidate(candidate)))
        begun: dict[str, float] = {}

        def over_budget(problem, candidate) -> bool:  # asked at each pair's turn
            if time.monotonic() - started > args.budget_s:
                counts["left"] += 1
                return True
            begun[problem.name] = time.monotonic()
            return False

        def on_record(problem, candidate, record, exc) -> None:
            row = (
                _row(problem.path.stem, args.tf32, record)
                if record is not None
                else {
                    "problem": problem.path.stem,
                    "tf32": args.tf32,
                    "precision": args.precision,
                    "outcome": "harness_error",
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            )
            row["seconds"] = round(time.monotonic() - begun[problem.name], 1)
            _write(out, counts, row)

        # The sequential executor boots the next pairs' workers while one is evaluated (Spares).
        make_executor("sequential", device=args.device).map(
            pairs, protocol, timeout_s=args.timeout, on_record=on_record, should_skip=over_budget
        )
    if counts["left"]:
        print(f"budget reached; {counts['left']} problems left (run again to resume)")
    print(f"not passed in this call: {counts['failures']}")
    if counts["too_small"]:
        too_small = counts["too_small"]
        print(f"too large for this GPU under verified (kbv's HarnessError, not a verdict): {too_small}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
