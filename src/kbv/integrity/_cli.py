"""``kbv checks``: every integrity check with its kind, default severity, doc and fixtures.

``kbv.cli`` calls :func:`register` with its subparsers; the handler returns 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from kbv.integrity._registry import KINDS
from kbv.integrity.catalog import SCHEMA, CheckEntry, catalog

_WIDTH = 100


def register(subparsers: Any) -> None:
    """Add ``checks`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "checks",
        help="list every integrity check with its kind, default severity, doc and fixtures",
        description=(
            "List every registered integrity check (static: source scans in the parent; correctness: "
            "read from the correctness draws' results in the parent; dynamic: observations of the "
            "running candidate) with its default severity (a protocol's "
            "[integrity.severity] table overrides it), what it catches, and the fixtures that hold it "
            "to account: those it must reject, those it must report, and the honest ones every check "
            "must accept (each fixture's KBV_FIXTURE declaration)."
        ),
    )
    p.add_argument("--kind", choices=KINDS, default=None, help="only checks of this kind")
    p.add_argument("--json", action="store_true", help="one JSON document (schema kbv.checks/1)")
    p.set_defaults(handler=cmd_checks)


def cmd_checks(args: argparse.Namespace) -> int:
    entries = [e for e in catalog() if args.kind is None or e.kind == args.kind]
    if args.json:
        document = {"schema": SCHEMA, "checks": [e.to_dict() for e in entries]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    for entry in entries:
        sys.stdout.write(_describe(entry) + "\n\n")
    sys.stdout.write(f"{len(entries)} checks.\n")
    for kind in KINDS:
        accepts = next((e.accepts for e in entries if e.kind == kind), None)
        if accepts is not None:
            sys.stdout.write(f"Every {kind} check must accept these honest fixtures (no fail finding):\n")
            sys.stdout.write(_paths(accepts) + "\n")
    return 0


def _describe(entry: CheckEntry) -> str:
    lines = [f"{entry.name}  ({entry.kind}, default severity {entry.default_severity})"]
    lines += textwrap.wrap(entry.doc, _WIDTH, initial_indent="  ", subsequent_indent="  ")
    lines.append("  rejects:" + ("" if entry.rejects else " no fixture file declares it"))
    lines += [f"    {path}" for path in entry.rejects]
    if entry.reports:
        lines.append("  reports (at any severity):")
        lines += [f"    {path}" for path in entry.reports]
    return "\n".join(lines)


def _paths(paths: tuple[str, ...]) -> str:
    return "\n".join(f"  {p}" for p in paths) or "  (none found: the tests are not in this installation)"
