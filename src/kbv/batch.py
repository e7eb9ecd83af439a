"""Batches: many problem x candidate pairs, each record stored the moment it is finished.

A killed batch loses at most the pair in flight: ``kbv run --resume`` (or the same command again)
skips every pair whose record is already stored under the same protocol, device and versions.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from kbv.candidates import NAMING_HINT, Candidate, scan_candidates
from kbv.execute import BatchResult, Pair, executor_from_args, make_executor, run_pairs
from kbv.problems import ProblemError, load_problems
from kbv.problems._loader import check_importable
from kbv.protocol import STANDARD, VERIFIED, Protocol, load_protocol
from kbv.records import Record
from kbv.store import RecordKey, pair_key, record_key
from kbv.toolchain import check_toolchain


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
    evaluate_fn: Callable[..., Record] | None = None,
) -> BatchResult:
    """Evaluate pairs in order in this process (:func:`kbv.execute.run_pairs` on the sequential
    executor), storing each record as it finishes; harness errors are listed, not fatal."""
    with make_executor("sequential", device=device, evaluate_fn=evaluate_fn) as executor:
        return run_pairs(
            executor,
            pairs,
            protocol,
            store=store,
            run_id=run_id,
            force=force,
            timeout_s=timeout_s,
            jsonl=jsonl,
            console=console,
        )


@dataclass
class BothProtocols:
    """What :func:`run_both_protocols` did: each protocol's batch, and the store keys of this
    invocation's pairs (evaluated or found stored), to keep its records apart from others'."""

    results: list[tuple[Protocol, BatchResult]] = field(default_factory=list)
    keys: set[RecordKey] = field(default_factory=set)

    def is_mine(self, record: Record) -> bool:
        return record_key(record) in self.keys


def prebuild_extensions(pairs: list[Pair], device: str | None, console: Console) -> None:
    """Build every C++/CUDA extension of ``pairs`` once, side by side, into the cache the workers
    use: left to their first evaluations, the builds would run one after another inside them."""
    from kbv.evaluation import default_device
    from kbv.worker.builds import CompileResult, known_build_failure, needs_build, prebuild

    todo = [candidate for _, candidate in pairs if needs_build(candidate.source)]
    if not todo:
        return
    # Plain lines, not a spinner: without a terminal a spinner prints nothing, and builds take
    # minutes on a small machine.
    distinct = len({c.source_sha256 for c in todo})
    console.print(
        f"building {distinct} C++/CUDA extension(s) for {len(todo)} candidate(s), cached by source hash",
        highlight=False,
        soft_wrap=True,
    )
    shown: dict[str, str] = {}  # source sha -> what became of its build
    started = time.monotonic()

    def report(candidate: Candidate, result: CompileResult) -> None:
        if candidate.source_sha256 in shown:
            return
        status = result.status
        if status == "cached" and known_build_failure(candidate.source_sha256):
            status = "failed (cached)"  # an earlier build failed: still a failure, not a success
        shown[candidate.source_sha256] = status
        console.print(
            f"  [{len(shown)}/{distinct}] {status} {candidate.label}/{candidate.path.name} "
            f"({result.seconds:.0f} s; {time.monotonic() - started:.0f} s elapsed)",
            highlight=False,
            soft_wrap=True,
        )

    prebuild(todo, device=device or default_device(), on_result=report)
    statuses = list(shown.values())
    failed = sum(1 for s in statuses if s.startswith("failed"))
    console.print(
        f"extensions: {statuses.count('built')} built, {statuses.count('cached')} cached, "
        f"{failed} failed (reported as compile_error)"
    )


def samples_note(pairs: list[Pair]) -> str:
    """What a batch of samples counts, said when some candidate files are identical (else empty):
    every file is a sample with its own record, duplicates included."""
    distinct = len({(problem.source_sha256, candidate.source_sha256) for problem, candidate in pairs})
    if distinct == len(pairs):
        return ""
    return (
        f"{len(pairs)} samples of {distinct} distinct source{'s' if distinct != 1 else ''} (every "
        "candidate file is a sample, identical files included; they share one compiled extension)"
    )


def run_both_protocols(
    store: Any,
    pairs: list[Pair],
    *,
    command: str,
    run_args: dict[str, Any],
    device: str | None,
    timeout_s: float | None,
    console: Console | None = None,
    precision: str | None = None,
) -> BothProtocols:
    """``kbv compare`` and ``kbv demo``: the same pairs (extensions built first) under ``standard``
    then ``verified``, each a run of ``command`` in ``store`` (``run_args`` saved with it, plus the
    protocol and timeout), in ``precision`` (None: fp32)."""
    both = BothProtocols()
    check_toolchain([candidate for _, candidate in pairs], device)  # before any run is opened
    prebuild_extensions(pairs, device, console or Console(stderr=True))
    for protocol in (STANDARD.with_precision(precision), VERIFIED.with_precision(precision)):
        run_id = store.start_run(
            command,
            {**run_args, "protocol": protocol.name, "timeout": timeout_s, "precision": protocol.precision},
            protocol.with_timeout(timeout_s),
        )
        result = run_batch(
            pairs, protocol, device=device, store=store, run_id=run_id, timeout_s=timeout_s, console=console
        )
        store.finish_run(run_id)
        both.results.append((protocol, result))
        # Only these pairs, on this device and these versions: a reused database may hold more.
        both.keys.update(
            pair_key(problem, candidate, protocol.with_timeout(timeout_s), result.env)
            for problem, candidate in pairs
        )
    return both


@dataclass
class BatchPlan:
    """The pairs a batch will evaluate, and every input file it will not, with why."""

    pairs: list[Pair] = field(default_factory=list)
    problem_errors: list[tuple[str, str]] = field(default_factory=list)  # (file, message)
    candidate_errors: list[tuple[str, str]] = field(default_factory=list)  # (file, message)
    unmatched: list[tuple[str, str]] = field(
        default_factory=list
    )  # (candidate file, why it has no usable problem)
    problems: int = 0  # usable problems
    candidate_files: int = 0

    def empty_reason(self, problems_path: str | Path, candidates_dir: str | Path) -> str:
        """One line saying what to check when the plan holds no pair."""
        if not self.problems and self.problem_errors:
            file, message = self.problem_errors[0]
            return (
                f"no usable problem in {problems_path}: {len(self.problem_errors)} problem file(s) "
                f"failed to load (first: {message.splitlines()[0]}); fix them or check --problems"
            )
        if not self.problems:
            return (
                f"no problem files (*.py) in {problems_path}; check --problems (a problem file, "
                "directory or KernelBench tree)"
            )
        if not self.candidate_files:
            return f"no candidate files (*.py) in {candidates_dir}; check --candidates"
        parts = []
        if self.candidate_errors:
            parts.append(
                f"{len(self.candidate_errors)} cannot be read (first: "
                f"{self.candidate_errors[0][1].splitlines()[0]})"
            )
        if self.unmatched:
            parts.append(
                f"{len(self.unmatched)} match no usable problem of the {self.problems} in "
                f"{problems_path} (e.g. {Path(self.unmatched[0][0]).name}; {NAMING_HINT}, or check "
                "--problems)"
            )
        return (
            f"none of the {self.candidate_files} candidate file(s) in {candidates_dir} can be evaluated: "
            + "; ".join(parts)
        )


def plan_batch(problems_path: str | Path, candidates_dir: str | Path, label: str = "") -> BatchPlan:
    """Problems that load, paired with their candidates; every file left out is listed with why."""
    problems, errors = load_problems(problems_path)
    plan = BatchPlan(problem_errors=[(str(f), m) for f, m in errors])
    unusable: dict[Path, str] = {}
    for problem in problems:
        try:
            check_importable(problem)
        except ProblemError as exc:
            plan.problem_errors.append((str(problem.path), str(exc)))
            unusable[problem.path] = problem.path.name
    plan.problems = len(problems) - len(unusable)
    scan = scan_candidates(problems, candidates_dir, label=label)
    plan.candidate_errors = scan.errors
    plan.candidate_files = scan.files
    for problem, candidate in scan.pairs:
        if problem.path in unusable:
            plan.unmatched.append(
                (str(candidate.path), f"its problem {unusable[problem.path]} is not usable (error above)")
            )
        else:
            plan.pairs.append((problem, candidate))
    plan.unmatched.extend((file, _why_unmatched(file, plan.problem_errors)) for file in scan.unmatched)
    return plan


def _why_unmatched(candidate_file: str, problem_errors: list[tuple[str, str]]) -> str:
    """Why a candidate has no problem: its problem file failed to load (named, error above), or
    no problem file is named like it."""
    from kbv.candidates import problem_ref_of
    from kbv.problems._loader import _id_from_name, _level_from_path

    wanted = problem_ref_of(Path(candidate_file))
    for file, _ in problem_errors:
        path = Path(file)
        if wanted in ((None, path.stem), (_level_from_path(path), _id_from_name(path.stem))):
            return f"its problem {path.name} is not usable (error above)"
    return "matches no problem"


def collect_pairs(
    problems_path: str | Path, candidates_dir: str | Path, label: str = ""
) -> tuple[list[Pair], list[tuple[str, str]]]:
    """Problems that load, paired with their candidates, plus (file, error) for those that do not
    (:func:`plan_batch` also lists the candidate files left out)."""
    plan = plan_batch(problems_path, candidates_dir, label=label)
    return plan.pairs, plan.problem_errors


def _run_pairs(
    args: argparse.Namespace,
    pairs: list[Pair],
    protocol: Protocol,
    device: str | None,
    timeout: float | None,
    store: Any,
    run_id: int,
    console: Console,
) -> BatchResult:
    """Sequentially in this process, or on an executor (``--executor local|ray``). The sequential
    path builds the extensions first, side by side (the executors have a compile stage of their own)."""
    if not getattr(args, "executor", None):
        prebuild_extensions(pairs, device, console)
    with executor_from_args(args, device=device) as executor:
        return run_pairs(
            executor,
            pairs,
            protocol,
            store=store,
            run_id=run_id,
            force=args.force,
            timeout_s=timeout,
            jsonl=args.out,
            console=console,
        )


# What identifies a run: saved with it, restored by --resume; given explicitly they pick the run.
RUN_IDENTITY = ("problems", "candidates", "protocol", "timeout", "label", "precision")
_FLAG = {
    "problems": "--problems",
    "candidates": "--candidates",
    "protocol": "--protocol",
    "timeout": "--timeout",
    "label": "--label",
    "precision": "--precision",
}


def _normalized(name: str, value: Any) -> Any:
    """A run argument in the form it is saved and compared: absolute paths, float timeouts."""
    if value is None:
        return None
    if name in ("problems", "candidates"):
        return str(Path(value).expanduser().resolve())
    if name == "protocol":
        path = Path(str(value)).expanduser()
        return str(path.resolve()) if path.suffix == ".toml" else str(value)  # as load_protocol reads it
    if name == "timeout":
        return float(value)
    return str(value)


def _explicit(args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: _normalized(name, getattr(args, name, None))
        for name in RUN_IDENTITY
        if getattr(args, name, None) is not None
    }


def _saved(run: dict[str, Any]) -> dict[str, Any]:
    args = run["args"]
    return {name: _normalized(name, args.get(name)) for name in RUN_IDENTITY}


def _run_to_resume(store: Any, explicit: dict[str, Any]) -> dict[str, Any] | None:
    """The newest unfinished ``kbv run`` whose saved arguments agree with every flag given."""
    for run in reversed(store.runs()):
        if run["command"] != "run" or run["status"] != "running":
            continue
        saved = _saved(run)
        if all(
            saved.get(name) == value or (name == "label" and not value and not saved.get(name))
            for name, value in explicit.items()
        ):
            return run
    return None


class RunArgumentsError(ValueError):
    """``kbv run`` cannot start: nothing to resume, no pair to evaluate (the CLI exits 2 with the message)."""


def _print_left_out(plan: BatchPlan, result: BatchResult, console: Console, limit: int = 10) -> None:
    for file, message in plan.problem_errors:
        console.print(
            f"[red]problem not usable[/red] {escape(file)}: {escape(message)}",
            highlight=False,
            soft_wrap=True,
        )
    for file, message in plan.candidate_errors:
        console.print(
            f"[red]candidate not usable[/red] {escape(file)}: {escape(message)}",
            highlight=False,
            soft_wrap=True,
        )
    if plan.unmatched:
        console.print(
            f"[yellow]{len(plan.unmatched)} candidate file(s) not evaluated[/yellow] "
            f"({escape(NAMING_HINT)}):",
            highlight=False,
            soft_wrap=True,
        )
        for file, why in plan.unmatched[:limit]:
            console.print(f"  {escape(file)}: {escape(why)}", highlight=False, soft_wrap=True)
        if len(plan.unmatched) > limit:
            console.print(
                f"  ... and {len(plan.unmatched) - limit} more (all are saved with the run in the database)",
                highlight=False,
                soft_wrap=True,
            )
    for what, message in result.errors:
        console.print(
            f"[red]harness error[/red] {escape(what)}: {escape(message)}", highlight=False, soft_wrap=True
        )
    if plan.problem_errors or plan.candidate_errors or result.errors:
        console.print(
            "fix the files above and run the same command again: pairs already stored are not redone",
            highlight=False,
            soft_wrap=True,
        )


def run_command(args: argparse.Namespace) -> int:
    """``kbv run``: resolve arguments (or the interrupted run's), evaluate, summarise."""
    from kbv.store import DEFAULT_DB, Store, missing_database

    db = Path(args.db or DEFAULT_DB)
    console = Console(stderr=True)
    explicit = _explicit(args)
    if args.resume and not db.exists():
        if "problems" not in explicit or "candidates" not in explicit:
            raise RunArgumentsError(f"{missing_database(db)} (--resume continues a run stored there)")
    elif not args.resume and ("problems" not in explicit or "candidates" not in explicit):
        raise RunArgumentsError(
            "kbv run needs --problems and --candidates (or --resume to continue an interrupted run)"
        )
    db.parent.mkdir(parents=True, exist_ok=True)
    with Store(db) as store:
        previous = _run_to_resume(store, explicit) if args.resume else None
        if args.resume and previous is None:
            _no_run_to_resume(explicit, db, console)
        saved = _saved(previous) if previous else {}
        settings = {name: explicit.get(name, saved.get(name)) for name in RUN_IDENTITY}
        problems_path, candidates_dir = settings["problems"], settings["candidates"]
        if not problems_path or not candidates_dir:
            raise RunArgumentsError(
                f"run {previous['id'] if previous else '?'} in {db} saved no "
                "--problems/--candidates; give them"
            )
        protocol_name = settings["protocol"] or "verified"
        timeout = settings["timeout"]
        label = settings["label"] or ""
        protocol = load_protocol(protocol_name).with_precision(settings["precision"])
        plan = plan_batch(problems_path, candidates_dir, label=label)
        if not plan.pairs:
            raise RunArgumentsError(plan.empty_reason(problems_path, candidates_dir))
        device = args.device or (previous["args"].get("device") if previous else None)
        check_toolchain([candidate for _, candidate in plan.pairs], device)  # before the run is opened
        run_id = _open_run(store, previous, plan, settings, protocol, args.device, console)
        try:
            result = _run_pairs(args, plan.pairs, protocol, device, timeout, store, run_id, console)
        except KeyboardInterrupt:
            console.print(
                "kbv: interrupted; finished records are stored. Continue with: kbv run --resume "
                f"--db {escape(str(db))}",
                highlight=False,
                soft_wrap=True,
            )
            return 130
        store.finish_run(run_id, "finished")
        from kbv.report.terminal import render_record_ids, render_summary

        stored = store.records_with_ids(run_id=run_id)
        render_summary([record for _, record in stored], Console())
        render_record_ids(stored, db, Console())
    _print_left_out(plan, result, console)
    note = samples_note(plan.pairs)
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    console.print(f"{len(result.records)} evaluated, {result.skipped} already stored; results in {db}")
    return 0


def _no_run_to_resume(explicit: dict[str, Any], db: Path, console: Console) -> None:
    """``--resume`` found no interrupted run: an error without a whole run's arguments, else a note
    that a new run starts (pairs already stored are skipped)."""
    if "problems" not in explicit or "candidates" not in explicit:
        given = " ".join(f"{_FLAG[name]} {value}" for name, value in explicit.items())
        raise RunArgumentsError(
            f"no interrupted kbv run in {db}"
            + (f" matches {given}" if given else "")
            + "; nothing to resume (give --problems and --candidates to start a run)"
        )
    console.print(
        f"no interrupted run with these arguments in {escape(str(db))}; starting a new run "
        "(pairs already stored are skipped)",
        highlight=False,
        soft_wrap=True,
    )


def _open_run(
    store: Any,
    previous: dict[str, Any] | None,
    plan: BatchPlan,
    settings: dict[str, Any],
    protocol: Any,
    device_arg: str | None,
    console: Console,
) -> Any:
    """The stored run's id: the interrupted one resumed, or a new one with the run's arguments."""
    protocol_name = settings["protocol"] or "verified"
    timeout = settings["timeout"]
    if previous:
        console.print(
            f"resuming run {previous['id']} (started {previous['started_at']}): "
            f"{escape(settings['problems'])} x {escape(settings['candidates'])}, protocol "
            f"{escape(protocol_name)}, timeout {timeout or 'default'}",
            highlight=False,
            soft_wrap=True,
        )
        return previous["id"]
    # Files left out are part of the run's record: the batch goes on without them.
    run_args = {
        "problems": settings["problems"],
        "candidates": settings["candidates"],
        "protocol": protocol_name,
        "timeout": timeout,
        "precision": settings["precision"],
        "device": device_arg,
        "label": settings["label"] or "",
        "problem_errors": plan.problem_errors,
        "candidate_errors": plan.candidate_errors,
        "unmatched_candidates": plan.unmatched,
    }
    return store.start_run("run", run_args, protocol.with_timeout(timeout))
