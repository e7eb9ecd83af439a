"""Subcommands over the results store: ``export``, ``import`` and ``report``.

``kbv.cli`` calls :func:`register` with its subparsers; each subcommand sets ``handler`` to a
function ``(args) -> int`` (0 on success, 2 for a usage error such as a missing file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kbv.store import DEFAULT_DB, DEMO_DB, Store, StoreError, default_db_to_read, missing_database


def register(subparsers: Any) -> None:
    """Add ``export``, ``import`` and ``report`` to an argparse subparsers object."""
    export = subparsers.add_parser(
        "export",
        help="write stored records as JSONL or CSV",
        description=(
            "Write the records of a results database (all, or one run's) as JSONL, one record per line "
            "in the contract's JSON format (what kbv import and kbv explain read), or as a flat CSV "
            "table, one row per record."
        ),
    )
    _db_arg(export)
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--jsonl", type=Path, metavar="FILE", help="one Record JSON object per line")
    target.add_argument("--csv", type=Path, metavar="FILE", help="a flat table, one row per record")
    export.add_argument("--run", type=int, metavar="ID", help="only the records of this run")
    export.set_defaults(handler=cmd_export)

    imp = subparsers.add_parser(
        "import",
        help="add the records of a JSONL file to the store",
        description=(
            "Add the records of a JSONL file (kbv eval --out, kbv export --jsonl) to a results "
            "database. Records already stored (same problem, candidate, protocol, device and versions) "
            "are skipped unless --force."
        ),
    )
    _db_arg(imp, reads=False)
    imp.add_argument("file", type=Path, metavar="FILE.jsonl")
    imp.add_argument("--label", help="model or candidate-set label for records that carry none")
    imp.add_argument("--force", action="store_true", help="import records already in the store again")
    imp.set_defaults(handler=cmd_import)

    report = subparsers.add_parser(
        "report",
        help="print the summary and write the HTML report",
        description=(
            "Print the leaderboard (one row per label and protocol), the outcomes, the problem errors "
            "and, when both protocols are stored, the standard-versus-verified comparison; with --html "
            "also write a self-contained HTML report with charts and every record's details."
        ),
    )
    _db_arg(report)
    report.add_argument("--html", type=Path, metavar="FILE", help="where to write the HTML report")
    report.add_argument("--run", type=int, metavar="ID", help="only the records of this run")
    report.add_argument("--title", default="kbv report", help="title of the HTML report")
    report.set_defaults(handler=cmd_report)


def _db_arg(parser: argparse.ArgumentParser, reads: bool = True) -> None:
    if not reads:  # kbv import writes: kbv run's store
        parser.add_argument(
            "--db", type=Path, default=DEFAULT_DB, help=f"results database (default: {DEFAULT_DB})"
        )
        return
    parser.add_argument(
        "--db",
        type=Path,
        default=None,
        help=f"results database (default: {DEFAULT_DB} or {DEMO_DB}, whichever was written last)",
    )


def _db_to_read(args: argparse.Namespace) -> Path:
    db: Path = args.db or default_db_to_read()
    args.db = db
    return db


def _usage_error(message: str) -> int:
    print(f"kbv: {message}", file=sys.stderr)
    return 2


def _open_existing(db: Path) -> Store | None:
    if not db.is_file():
        return None
    return Store(db)


def cmd_export(args: argparse.Namespace) -> int:
    try:
        store = _open_existing(_db_to_read(args))
    except StoreError as exc:
        return _usage_error(str(exc))
    if store is None:
        return _usage_error(missing_database(args.db))
    with store:
        if args.jsonl is not None:
            count, path = store.export_jsonl(args.jsonl, store.records(run_id=args.run)), args.jsonl
        else:  # with the record ids (kbv explain ID)
            count, path = store.export_csv(args.csv, run_id=args.run), args.csv
    print(f"wrote {count} records to {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return _usage_error(f"{args.file} does not exist")
    try:
        with Store(args.db) as store:
            imported, skipped = store.import_jsonl(args.file, label=args.label, force=args.force)
    except StoreError as exc:
        return _usage_error(str(exc))
    note = f" ({skipped} already stored, skipped; --force imports them again)" if skipped else ""
    print(f"imported {imported} records into {args.db}{note}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kbv.report import render_comparison, render_summary, split_by_protocol, write_html_report
    from kbv.report.terminal import render_record_ids

    try:
        store = _open_existing(_db_to_read(args))
    except StoreError as exc:
        return _usage_error(str(exc))
    if store is None:
        return _usage_error(missing_database(args.db))
    with store:
        # A --force re-run stores a second verdict for a key; the newest one counts.
        stored = store.records_with_ids(run_id=args.run, latest=True)
        records = [record for _, record in stored]
        sources = store.candidate_sources()
    if not records:
        where = f"run {args.run}" if args.run is not None else str(args.db)
        return _usage_error(f"no records in {where}")
    console = Console()
    render_summary(records, console)
    standard, verified = split_by_protocol(records)
    if standard and verified:
        render_comparison(standard, verified, console)
    render_record_ids(stored, args.db, console)
    if args.html is not None:
        path = write_html_report(records, args.html, title=args.title, sources=sources)
        print(f"wrote HTML report to {path}")
    return 0
