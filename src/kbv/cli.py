"""The ``kbv`` command: a thin layer over the public facade.

Exit status: 0 when the command ran (whatever the verdicts), 2 for usage errors (one line on
stderr), 1 when the harness itself failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kbv._version import __version__
from kbv.devices import check_device

EXIT_OK, EXIT_HARNESS, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
kbv (KernelBench-Verified) evaluates LLM-written GPU kernels honestly: every candidate runs in an
isolated worker, is checked on hidden inputs against a float64 truth, and is timed against
realistic baselines with a clock it cannot reach.

common commands:
  kbv demo                                  bundled problems and candidates, both protocols, a report
  kbv eval PROBLEM.py CANDIDATE.py          evaluate one pair (--json for one JSON record)
  kbv run --problems DIR --candidates DIR   a batch, stored so that it resumes (kbv run --resume)
  kbv compare --problems DIR --candidates DIR   standard versus verified, per model
  kbv problems list|audit [PATH]            list problems, or flag degenerate ones
  kbv report --db PATH --html FILE          terminal summary and a self-contained HTML report
  kbv explain RECORD.json|ID [--db PATH]    one record with its findings and their evidence
  kbv checks [--json]                       every integrity check: kind, severity, doc, fixtures
"""


# kbv.demo's CPU_TIMEOUT_S and GPU_TIMEOUT_S, repeated here so that `kbv demo --help` needs no torch
# (a test keeps them equal).
_DEMO_CPU_TIMEOUT = 20.0
_DEMO_GPU_TIMEOUT = 60.0


class UsageError(Exception):
    """Bad arguments or missing files: exit 2 with one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"kbv: error: {message} (see kbv --help)\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kbv", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kbv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_eval(sub)
    _add_run(sub)
    _add_demo(sub)
    _add_compare(sub)
    _add_explain(sub)
    _add_problems(sub)
    for register in _optional_registrations():
        register(sub)
    _add_pipeline(sub)
    return parser


def _add_pipeline(sub: Any) -> None:
    """``kbv pipeline``: generate candidates with an LLM, then evaluate them as ``kbv run`` does."""
    try:
        from kbv.generate._cli import register_pipeline
    except ImportError:
        return

    def evaluate_batch(problems_path: str, candidates_dir: str, args: argparse.Namespace) -> int:
        run_args = argparse.Namespace(
            problems=problems_path,
            candidates=candidates_dir,
            protocol=args.protocol,
            device=args.device,
            timeout=args.timeout,
            precision=getattr(args, "precision", None),
            db=getattr(args, "db", None),
            label=Path(candidates_dir).name,
            resume=False,
            force=False,
            out=None,
            executor=None,
            gpus=None,
            workers=None,
            address=None,
        )
        return _cmd_run(run_args)

    def eval_flags(p: argparse.ArgumentParser) -> None:
        _common_eval_flags(p)
        p.add_argument("--db", default=None, help="results database (default kbv-results/kbv.sqlite)")

    register_pipeline(sub, evaluate_batch, add_eval_arguments=eval_flags)


def _common_eval_flags(p: argparse.ArgumentParser, resumable: bool = False) -> None:
    if resumable:  # kbv run: unset flags come from the resumed run, else from these defaults
        p.add_argument(
            "--protocol", default=None, help="standard, verified (default) or a protocol .toml file"
        )
    else:
        p.add_argument(
            "--protocol", default="verified", help="standard, verified (default) or a protocol .toml file"
        )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-candidate wall-clock limit, compilation included",
    )
    add_precision_flag(p)


PRECISION_CHOICES = ("fp32", "bf16", "fp16")  # kbv.protocol.PRECISIONS, without importing torch


def add_precision_flag(p: argparse.ArgumentParser) -> None:
    """``--precision``: the problem's floating inputs and parameters cast to it (docs/correctness.md,
    "Half precision"). ``kbv pipeline`` has it from ``kbv generate`` already: one flag for both."""
    if "--precision" in p._option_string_actions:
        return
    p.add_argument(
        "--precision",
        default=None,
        choices=PRECISION_CHOICES,
        help=(
            "evaluate in fp32, bf16 or fp16: floating inputs and parameters cast to it, the reference "
            "and baselines run in it, the tolerance from the baseline's own error in it (default: "
            "the protocol's, fp32)"
        ),
    )


def _add_eval(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate one problem x candidate pair",
        description="Evaluate one pair and print a summary (or one JSON record with --json).",
    )
    p.add_argument(
        "problem",
        nargs="?",
        help="problem file (defines Model, get_inputs, get_init_inputs); not with --replay",
    )
    p.add_argument("candidate", nargs="?", help="candidate file (defines ModelNew); not with --replay")
    _common_eval_flags(p)
    p.add_argument("--json", action="store_true", help="print exactly one JSON record on stdout")
    p.add_argument("--out", metavar="FILE.jsonl", help="also append the record to this JSONL file")
    p.add_argument(
        "--seed", type=int, default=None, help="master seed to replay a record's exact inputs (see --replay)"
    )
    p.add_argument(
        "--replay",
        metavar="RECORD.json",
        help="replay a stored record: same problem, candidate, protocol and seeds",
    )
    p.set_defaults(handler=_cmd_eval)


def _add_run(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="evaluate a batch of candidates, resumably",
        description=(
            "Evaluate every candidate in a directory against its problem. Records are stored as they finish; "
            "an interrupted batch resumes with `kbv run --resume [--db PATH]` (or by running the same "
            "command again): pairs already stored are never redone. Files that cannot be used (a broken "
            "problem, an unreadable candidate, a candidate named after no problem) are listed and saved "
            "with the run; the batch goes on."
        ),
    )
    p.add_argument(
        "--problems",
        default=None,
        help="problem file, directory or KernelBench tree (required unless --resume)",
    )
    p.add_argument(
        "--candidates",
        default=None,
        help=(
            "directory of candidates (level_L_problem_P_sample_S_kernel.py or {problem_stem}.py; "
            "required unless --resume)"
        ),
    )
    _common_eval_flags(p, resumable=True)
    p.add_argument("--db", default=None, help="results database (default kbv-results/kbv.sqlite)")
    p.add_argument(
        "--label",
        default=None,
        help="model or candidate-set name stored with the records (default: the directory name)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help=(
            "continue the latest interrupted run in --db with its saved --problems, --candidates, "
            "--protocol, --timeout and --label; any of these given pick which interrupted run (they "
            "must match it). --device, --out, --force and the scale-out flags may differ from the "
            "interrupted run's"
        ),
    )
    p.add_argument("--force", action="store_true", help="re-evaluate pairs already in the database")
    p.add_argument("--out", metavar="FILE.jsonl", help="also append every record to this JSONL file")
    from kbv.execute import add_executor_arguments

    add_executor_arguments(p)
    p.set_defaults(handler=_cmd_run)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="bundled problems and candidates under both protocols, with a report",
        description=(
            "Run the bundled suite's candidates (honest ones and known reward hacks) under the "
            "standard and verified protocols, print the comparison, and write the database and an HTML "
            "report."
        ),
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--db", default=None, help="results database (default kbv-results/demo.sqlite)")
    p.add_argument("--html", default=None, help="report path (default kbv-results/demo-report.html)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=(
            f"per-candidate wall-clock limit (default: {_DEMO_CPU_TIMEOUT:g} s on the CPU, "
            f"{_DEMO_GPU_TIMEOUT:g} s on a GPU)"
        ),
    )
    add_precision_flag(p)
    p.set_defaults(handler=_cmd_demo)


def _add_explain(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="one record in full: distributions, findings with evidence, timing",
        description=(
            "Show one record: a JSON file (as written by kbv eval --json or --out; the last line of a "
            "JSONL file) or a record id in --db."
        ),
    )
    p.add_argument("record", help="RECORD.json / RECORDS.jsonl, or a record id from the database")
    p.add_argument(
        "--db",
        default=None,
        help=(
            "results database for a record id (default: kbv-results/kbv.sqlite or "
            "kbv-results/demo.sqlite, whichever was written last)"
        ),
    )
    p.set_defaults(handler=_cmd_explain)


def _cmd_explain(args: argparse.Namespace) -> int:
    from kbv.report.explain import print_record

    print_record(_find_record(args.record, args.db))
    return EXIT_OK


def _find_record(ref: str, db: str | None) -> Any:
    from kbv.records import Record

    path = Path(ref)
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            raise UsageError(f"{path} holds no record")
        return Record.from_dict(json.loads(lines[-1]))
    if not ref.isdigit():
        raise UsageError(f"{ref} is neither a record file nor a record id")
    from kbv.store import Store, default_db_to_read, missing_database

    db_path = Path(db) if db else default_db_to_read()
    if not db_path.exists():
        raise UsageError(missing_database(db_path))
    with Store(db_path) as store:
        found = [record for record_id, record in store.records_with_ids() if record_id == int(ref)]
    if not found:
        raise UsageError(f"no record {ref} in {db_path}")
    return found[0]


def _add_compare(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="standard versus verified, side by side, per model",
        description=(
            "Evaluate the same candidates under the standard and verified protocols (pairs already "
            "stored are read, not re-run) and print, per model, the speedup under each, the drop and "
            "its decomposition, and the pairs whose verdict changed."
        ),
    )
    p.add_argument(
        "--problems", help="problem file, directory or KernelBench tree (omit to compare what --db holds)"
    )
    p.add_argument(
        "--candidates", action="append", default=[], help="candidate directory; repeat for several models"
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-candidate wall-clock limit, compilation included (default: the protocol's)",
    )
    p.add_argument(
        "--db",
        default=None,
        help=(
            "results database (default kbv-results/kbv.sqlite; without --problems the latest of it "
            "and kbv-results/demo.sqlite)"
        ),
    )
    add_precision_flag(p)
    p.set_defaults(handler=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    _check_batch_paths(args.problems, args.candidates)
    check_device(args.device)
    from rich.console import Console

    from kbv import batch
    from kbv.metrics import record_precision
    from kbv.report.terminal import render_comparison
    from kbv.store import DEFAULT_DB, Store, default_db_to_read, missing_database

    if bool(args.problems) != bool(args.candidates):
        raise UsageError("give both --problems and --candidates, or neither (to compare what --db holds)")
    # Evaluating writes to kbv run's store; comparing what is stored reads the latest one.
    db = Path(args.db) if args.db else (DEFAULT_DB if args.problems else default_db_to_read())
    if not args.problems and not db.exists():
        raise UsageError(missing_database(db) + " (or give --problems and --candidates to evaluate)")
    db.parent.mkdir(parents=True, exist_ok=True)
    # With --problems/--candidates only the records of this invocation's pairs are compared: the
    # exact store keys (problem, candidate, protocol incl. timeout, device, versions) it evaluated
    # or found already stored, never unrelated records the database happens to hold.
    mine = batch.BothProtocols()
    with Store(db) as store:
        for directory in args.candidates:
            plan = batch.plan_batch(args.problems, directory)
            both = batch.run_both_protocols(
                store,
                plan.pairs,
                command="compare",
                run_args={"problems": args.problems, "candidates": directory},
                device=args.device,
                timeout_s=args.timeout,
                precision=args.precision,
            )
            mine.keys.update(both.keys)
            for file, message in plan.problem_errors:
                sys.stderr.write(f"kbv: problem not usable: {file}: {message}\n")
            for file, message in plan.candidate_errors:
                sys.stderr.write(f"kbv: candidate not usable: {file}: {message}\n")
            for file, why in plan.unmatched:
                sys.stderr.write(f"kbv: candidate not evaluated: {file}: {why}\n")
        standard = store.records(protocol="standard", latest=True)
        verified = store.records(protocol="verified", latest=True)
    if args.candidates:
        standard = [r for r in standard if mine.is_mine(r)]
        verified = [r for r in verified if mine.is_mine(r)]
    if args.precision:
        standard = [r for r in standard if record_precision(r) == args.precision]
        verified = [r for r in verified if record_precision(r) == args.precision]
    if not standard or not verified:
        raise UsageError(f"{db} needs records under both protocols to compare")
    # Records of different precisions are never compared with each other: one board per precision.
    render_comparison(standard, verified, Console())  # one comparison per precision
    Console(stderr=True).print(f"results database: {db}", highlight=False, soft_wrap=True)
    return EXIT_OK


def _add_problems(sub: Any) -> None:
    p = sub.add_parser("problems", help="list or audit problems")
    psub = p.add_subparsers(dest="problems_command", metavar="ACTION", parser_class=_Parser)
    lp = psub.add_parser("list", help="list problems with level, id and tags")
    lp.add_argument(
        "path",
        nargs="?",
        default=None,
        help="file, directory or KernelBench tree (default: the bundled suite)",
    )
    lp.set_defaults(handler=_cmd_problems_list)
    ap = psub.add_parser(
        "audit",
        help="flag constant-output, zeros-pass, nondeterministic, domain-limited and broken problems",
        description=(
            "Run each problem's reference in a trusted worker and flag problems that cannot tell an "
            "honest kernel from a cheap trick (constant_output, zeros_pass, nondeterministic, "
            "needs_domain_rule) or cannot produce their own output (problem_error). Each result is "
            "written as soon as it is found: a line per problem above a progress bar, or with --json "
            "one JSON object per line (docs/problems-audit.md)."
        ),
    )
    ap.add_argument(
        "path",
        nargs="?",
        default=None,
        help="file, directory or KernelBench tree (default: the bundled suite)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per problem on stdout, each as it is found (docs/problems-audit.md)",
    )
    add_precision_flag(ap)
    ap.set_defaults(handler=_cmd_problems_audit)
    p.set_defaults(handler=lambda args: _fail_usage("choose an action: kbv problems list|audit [PATH]"))


def _optional_registrations() -> list[Callable[[Any], object]]:
    """Subcommands that live with their features (store and report, generate, protocol audit,
    integrity checks, the evaluation service)."""
    from kbv import _store_cli, serve
    from kbv.generate import _cli as generate_cli
    from kbv.integrity import _cli as checks_cli
    from kbv.protocol_audit import _cli as protocol_audit_cli

    return [
        _store_cli.register,
        generate_cli.register,
        protocol_audit_cli.register,
        checks_cli.register,
        serve.register,
    ]


def _fail_usage(message: str) -> int:
    raise UsageError(message)


def _check_file(path: str, what: str) -> None:
    if not Path(path).is_file():
        raise UsageError(f"{what} file {path} does not exist")


def _check_eval_args(args: argparse.Namespace) -> None:
    """Everything ``kbv eval`` can reject without importing torch, so that a typo fails at once."""
    if args.replay:
        if args.problem or args.candidate:
            raise UsageError(
                "--replay RECORD.json takes the problem and candidate from the record; give no "
                "PROBLEM/CANDIDATE"
            )
        _check_file(args.replay, "record")
    else:
        if not args.problem or not args.candidate:
            raise UsageError("kbv eval needs PROBLEM.py and CANDIDATE.py (or --replay RECORD.json)")
        _check_file(args.problem, "problem")
        _check_file(args.candidate, "candidate")
        from kbv.protocol import load_protocol

        load_protocol(args.protocol)
    check_device(args.device)
    if args.replay and args.precision:
        raise UsageError("--replay RECORD.json evaluates in the record's own precision; give no --precision")


def _cmd_eval(args: argparse.Namespace) -> int:
    _check_eval_args(args)
    from kbv import api

    if args.replay:
        record = api.evaluate_replay(args.replay, device=args.device, timeout_s=args.timeout)
    else:
        record = api.evaluate_paths(
            args.problem,
            args.candidate,
            protocol=args.protocol,
            device=args.device,
            timeout_s=args.timeout,
            master_seed=args.seed,
            precision=args.precision,
        )
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(record.to_json() + "\n")
    if args.json:
        sys.stdout.write(record.to_json() + "\n")
    else:
        from kbv.report.explain import print_record

        print_record(record)
    return EXIT_OK


def _check_batch_paths(problems: str | None, candidates: list[str]) -> None:
    """Paths a batch needs, checked before torch is imported (a typo fails in well under a second)."""
    if problems and not Path(problems).exists():
        raise UsageError(
            f"--problems {problems} does not exist (a problem file, directory or KernelBench tree)"
        )
    for directory in candidates:
        if not Path(directory).is_dir():
            raise UsageError(f"--candidates {directory} is not a directory")


def _cmd_run(args: argparse.Namespace) -> int:
    _check_batch_paths(args.problems, [args.candidates] if args.candidates else [])
    check_device(args.device)
    from kbv import batch

    try:
        return batch.run_command(args)
    except batch.RunArgumentsError as exc:
        raise UsageError(str(exc)) from exc


def _cmd_demo(args: argparse.Namespace) -> int:
    check_device(args.device)
    from kbv import demo

    return demo.run_demo(
        device=args.device, db=args.db, html=args.html, timeout_s=args.timeout, precision=args.precision
    )


def _cmd_problems_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kbv.problems import bundled_suite_dir, load_problems

    root = Path(args.path) if args.path else bundled_suite_dir()
    problems, errors = load_problems(root)
    table = Table(title=f"{len(problems)} problems in {root}")
    for column in ("level", "id", "name"):
        table.add_column(column, no_wrap=True)
    table.add_column("tags", ratio=1)  # wraps between tags; the other columns never wrap
    table.add_column("sha256", no_wrap=True)
    for p in problems:
        table.add_row(
            str(p.level or ""),
            str(p.problem_id or ""),
            p.name,
            ", ".join(p.extras.get("tags", [])),
            p.source_sha256[:12],
        )
    console = Console()
    console.print(table)
    for file, message in errors:
        console.print(f"[red]not loadable[/red] {file}: {message}")
    return EXIT_OK


def _cmd_problems_audit(args: argparse.Namespace) -> int:
    """Each problem's result is written the moment it is known: one JSON object per line with
    --json (docs/problems-audit.md), otherwise one line per problem above a progress bar."""
    if args.path and not Path(args.path).exists():
        raise UsageError(f"{args.path} does not exist (a problem file, directory or KernelBench tree)")
    check_device(args.device)
    from rich.console import Console
    from rich.markup import escape

    from kbv.evaluation import default_device
    from kbv.problems import bundled_suite_dir, load_problems
    from kbv.problems_audit import iter_audit, unloadable
    from kbv.report.terminal import progress_bar

    root = Path(args.path) if args.path else bundled_suite_dir()
    problems, errors = load_problems(root)
    device = args.device or default_device()
    results = [unloadable(file, message, device) for file, message in errors]
    if args.json:
        for r in results:
            sys.stdout.write(json.dumps(r.to_dict()) + "\n")
        for r in iter_audit(problems, device=device, precision=args.precision or "fp32"):
            results.append(r)
            sys.stdout.write(json.dumps(r.to_dict()) + "\n")
            sys.stdout.flush()
        return EXIT_OK
    console = Console()
    console.print(
        f"audit of {len(problems) + len(errors)} problems in {escape(str(root))} on {device}"
        + (f" in {args.precision}" if args.precision else ""),
        highlight=False,
    )
    for r in results:
        console.print(_audit_line(r), highlight=False)
    with progress_bar(console) as progress:  # result lines print above the bar as they come
        task = progress.add_task("auditing", total=len(problems))
        for r in iter_audit(problems, device=device, precision=args.precision or "fp32"):
            results.append(r)
            progress.console.print(_audit_line(r), highlight=False)
            progress.advance(task)
    flagged = sum(1 for r in results if r.flags)
    console.print(f"{flagged} of {len(results)} problems flagged", highlight=False)
    return EXIT_OK


def _audit_line(result: Any) -> str:
    from rich.markup import escape

    if not result.flags:
        return f"[green]ok[/green]      {escape(result.problem)}"
    evidence = "; ".join(f"{flag}: {result.notes.get(flag, '')}" for flag in result.flags)
    return f"[yellow]flagged[/yellow] {escape(result.problem)}: {escape(evidence)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    from kbv.errors import USAGE_ERRORS
    from kbv.processes import harden_process

    harden_process()  # keep this process's environment (API keys) out of the candidates' reach
    try:
        return int(handler(args))
    except UsageError as exc:
        sys.stderr.write(f"kbv: error: {exc}\n")
        return EXIT_USAGE
    except USAGE_ERRORS as exc:
        sys.stderr.write(f"kbv: error: {str(exc).splitlines()[0]}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write(
            "kbv: interrupted; finished records are stored (kbv run: continue with kbv run "
            "--resume [--db PATH])\n"
        )
        return 130
    except Exception as exc:  # the harness itself failed: say so, exit 1
        sys.stderr.write(f"kbv: harness error: {type(exc).__name__}: {exc}\n")
        if "KBV_DEBUG" in __import__("os").environ:
            raise
        return EXIT_HARNESS


if __name__ == "__main__":
    raise SystemExit(main())
