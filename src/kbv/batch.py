"""Batches: many problem x candidate pairs, each record stored the moment it is finished.

A killed batch loses at most the pair in flight: ``kbv run --resume`` (or the same command again)
skips every pair whose record is already stored under the same protocol, device and versions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kbv._version import __version__
from kbv.candidates import Candidate, match_candidates
from kbv.pipeline import HarnessError, default_device, evaluate
from kbv.problems import Problem, ProblemError, load_problems
from kbv.problems._loader import check_importable
from kbv.protocol import Protocol, load_protocol
from kbv.records import Record
from kbv.worker import Worker, WorkerSpec, visible_devices

Pair = tuple[Problem, Candidate]


@dataclass
class BatchResult:
    records: list[Record] = field(default_factory=list)
    skipped: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)

    def keep(self, record: Record, candidate: Candidate, store: Any, run_id: int | None, jsonl: str | Path | None) -> None:
        """Store a finished record at once (a later crash of the batch cannot lose it)."""
        if store is not None:
            store.add_record(record, run_id=run_id, label=candidate.label, source=candidate.source)
        if jsonl:
            with open(jsonl, "a") as handle:
                handle.write(record.to_json() + "\n")
        self.records.append(record)


def probe_environment(device: str) -> dict[str, Any]:
    """What a worker sees (torch version, device name): part of every record's key."""
    with Worker(WorkerSpec(build_key="probe", device=device, role="probe", visible_devices=visible_devices(device), budget_s=120)) as worker:
        hello = worker.start()
    name = (hello.get("device") or {}).get("name") if device.startswith("cuda") else None
    if name is None:
        import platform

        name = platform.processor() or platform.machine()
    return {"device_name": name, "torch": hello.get("torch", "")}


def store_key(problem: Problem, candidate: Candidate, protocol: Protocol, env: dict[str, Any]) -> tuple[str, ...]:
    """The key a finished pair is stored under (``kbv.store.record_key`` of its record), known
    before evaluating: it is what lets a batch skip finished work on resume."""
    return (problem.source_sha256, candidate.source_sha256, protocol.sha256(), env.get("device_name", ""), __version__, env.get("torch", ""))



def run_batch(
    pairs: Iterable[Pair],
    protocol: Protocol,
    *,
    device: str | None = None,
    store: Any = None,
    run_id: int | None = None,
    force: bool = False,
    timeout_s: float | None = None,
    jsonl: str | Path | None = None,
    console: Console | None = None,
    evaluate_fn: Callable[..., Record] = evaluate,
) -> BatchResult:
    """Evaluate pairs in order, storing each record as it finishes; harness errors are logged, not fatal."""
    device = device or default_device()
    console = console or Console(stderr=True)
    pairs = list(pairs)
    env = probe_environment(device) if store is not None else {}
    result = BatchResult()
    with progress_bar(console) as progress:
        task = progress.add_task("evaluating", total=len(pairs))
        for problem, candidate in pairs:
            progress.update(task, description=f"{problem.name} x {candidate.label}/{candidate.path.name}")
            if store is not None and not force and store.has_record(store_key(problem, candidate, protocol, env)):
                result.skipped += 1
            else:
                _evaluate_one(problem, candidate, protocol, device, timeout_s, store, run_id, jsonl, result, evaluate_fn)
            progress.advance(task)
    return result


def _evaluate_one(problem: Problem, candidate: Candidate, protocol: Protocol, device: str, timeout_s: float | None, store: Any, run_id: int | None, jsonl: str | Path | None, result: BatchResult, evaluate_fn: Callable[..., Record]) -> None:
    try:
        record = evaluate_fn(problem, candidate, protocol, device, timeout_s=timeout_s)
    except (HarnessError, ProblemError) as exc:
        result.errors.append((f"{problem.name} x {candidate.path.name}", str(exc).splitlines()[0]))
        return
    result.keep(record, candidate, store, run_id, jsonl)


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def collect_pairs(problems_path: str | Path, candidates_dir: str | Path, label: str = "") -> tuple[list[Pair], list[tuple[str, str]]]:
    """Problems that load, paired with their candidates, plus (file, error) for those that do not."""
    problems, errors = load_problems(problems_path)
    usable: list[Problem] = []
    problem_errors = [(str(f), m) for f, m in errors]
    for problem in problems:
        try:
            check_importable(problem)
            usable.append(problem)
        except ProblemError as exc:
            problem_errors.append((str(problem.path), str(exc)))
    return match_candidates(usable, candidates_dir, label=label), problem_errors


def _run_pairs(args: argparse.Namespace, pairs: list[Pair], protocol: Protocol, saved_device: str | None, store: Any, run_id: int, console: Console) -> BatchResult:
    """Sequentially in this process, or on an executor (``--executor local|ray``)."""
    from kbv.execute import executor_from_args, run_pairs

    executor = executor_from_args(args)
    if executor is None:
        return run_batch(pairs, protocol, device=args.device or saved_device, store=store, run_id=run_id, force=args.force, timeout_s=args.timeout, jsonl=args.out, console=console)
    with executor:
        return run_pairs(executor, pairs, protocol, store=store, run_id=run_id, force=args.force, timeout_s=args.timeout, jsonl=args.out, console=console)


def run_command(args: argparse.Namespace) -> int:
    """``kbv run``: resolve arguments (or the interrupted run's), evaluate, summarise."""
    from kbv.store import DEFAULT_DB, Store

    db = Path(args.db or DEFAULT_DB)
    db.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    with Store(db) as store:
        previous = store.last_run(command="run", status="running") if args.resume else None
        if args.resume and previous is None:
            console.print("no interrupted run to resume in this database; starting a new run")
        saved = previous["args"] if previous else {}
        problems_path = args.problems or saved.get("problems")
        candidates_dir = args.candidates or saved.get("candidates")
        if not problems_path or not candidates_dir:
            raise ProblemError("give --problems and --candidates (or --resume with an interrupted run in --db)")
        protocol = load_protocol(args.protocol if args.protocol else saved.get("protocol", "verified"))
        pairs, problem_errors = collect_pairs(problems_path, candidates_dir, label=args.label)
        # Broken problem files are part of the run's record: the batch goes on without them.
        run_args = {"problems": str(problems_path), "candidates": str(candidates_dir), "protocol": str(args.protocol), "device": args.device, "label": args.label, "problem_errors": problem_errors}
        run_id = previous["id"] if previous else store.start_run("run", run_args, protocol)
        result = _run_pairs(args, pairs, protocol, saved.get("device"), store, run_id, console)
        store.finish_run(run_id, "finished")
        from kbv.report.terminal import render_summary

        render_summary(store.records(run_id=run_id), Console())
    for file, message in problem_errors + result.errors:
        console.print(f"[red]error[/red] {file}: {message}")
    console.print(f"{len(result.records)} evaluated, {result.skipped} already stored; results in {db}")
    return 0
