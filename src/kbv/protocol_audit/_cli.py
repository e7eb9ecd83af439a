"""``kbv protocol audit``: registered by ``kbv.cli`` like the other feature subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kbv.protocol_audit._report import fmt_rate


def register(sub: Any) -> None:
    p = sub.add_parser(
        "protocol", help="measure a protocol: false rejections of honest controls, kill rate on mutants"
    )
    psub = p.add_subparsers(dest="protocol_command", metavar="ACTION")
    ap = psub.add_parser(
        "audit",
        help="evaluate generated honest controls and mutants of each problem under each protocol",
        description=(
            "Generate honest controls (the reference as ModelNew, TF32 inside forward, reordered "
            "reductions) and mutants (zeros, a constant, an input, sampled subsets, a dropped "
            "operation, identity for ReLU, a cached output, bf16/fp16, x(1+1e-2)) from each problem, "
            "evaluate them under each protocol as a stored, resumable batch, and print the "
            "false-rejection rate and the kill rate with Wilson 95%% intervals (docs/protocol-audit.md)."
        ),
    )
    ap.add_argument("--problems", required=True, help="problem file, directory or KernelBench tree")
    ap.add_argument(
        "--protocol",
        action="append",
        default=None,
        help="standard, verified or FILE.toml; repeat to compare (default: standard and verified)",
    )
    ap.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    ap.add_argument(
        "--honest",
        default=None,
        metavar="DIR",
        help="your own honest candidates ({problem_stem}.py), counted as controls",
    )
    ap.add_argument(
        "--db",
        default="kbv-results/audit.sqlite",
        help="results database (default kbv-results/audit.sqlite); the same command again resumes",
    )
    ap.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="per-candidate wall-clock limit"
    )
    ap.add_argument(
        "--html", default=None, metavar="FILE", help="also write the HTML report with the audit section"
    )
    ap.add_argument(
        "--only",
        choices=("controls", "mutants"),
        default=None,
        help="evaluate only the honest controls (false-rejection rate) or only the mutants (kill rate)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help=(
            "evaluate nothing: summarise what --db already holds (an audit cut short); needs no GPU "
            "when --db holds an audit from --device's kind"
        ),
    )
    ap.add_argument(
        "--json", action="store_true", help="one JSON object per protocol on stdout (rates, kinds, rows)"
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help=(
            "audit the protocols in this precision: controls and mutants judged with inputs and "
            "parameters cast to it, the precision mutants those below it (default fp32)"
        ),
    )
    ap.set_defaults(handler=_cmd_audit)
    p.set_defaults(handler=_need_action)


class _Usage(ValueError):
    pass


def _need_action(args: argparse.Namespace) -> int:
    sys.stderr.write("kbv: error: choose an action: kbv protocol audit --problems PATH\n")
    return 2


def _cmd_audit(args: argparse.Namespace) -> int:
    from kbv.devices import check_device
    from kbv.protocol import load_protocol

    if not Path(args.problems).exists():
        sys.stderr.write(
            f"kbv: error: --problems {args.problems} does not exist (a problem file, directory or "
            "KernelBench tree)\n"
        )
        return 2
    if args.honest and not Path(args.honest).is_dir():
        sys.stderr.write(f"kbv: error: --honest {args.honest} is not a directory\n")
        return 2
    protocols = args.protocol or ["standard", "verified"]
    for spec in protocols:
        load_protocol(spec)  # an unknown protocol fails here, before any worker (exit 2)
    if not args.report_only:  # a report from the store runs nothing: audit_protocols checks when it must
        check_device(args.device)
    from rich.console import Console

    from kbv.protocol_audit import audit_protocols

    result = audit_protocols(
        args.problems,
        protocols,
        device=args.device,
        db=args.db,
        honest=args.honest,
        timeout_s=args.timeout,
        console=Console(stderr=True),
        evaluate=not args.report_only,
        roles={"controls": ("control",), "mutants": ("mutant",)}.get(args.only, ("control", "mutant")),
        precision=args.precision,
    )
    if args.json:
        for summary in result.summaries:
            sys.stdout.write(json.dumps(summary, default=list) + "\n")
    else:
        render(result.summaries, Console())
    for what, message in result.errors:
        sys.stderr.write(f"kbv: left out: {what}: {message}\n")
    if args.report_only:
        sys.stderr.write(
            f"records of {result.env.get('device_name') or '?'} with torch {result.env.get('torch') or '?'}\n"
        )
    if args.html:
        from kbv.protocol_audit._html import write_audit_html

        path = write_audit_html(result, args.html)
        sys.stderr.write(f"HTML report: {path}\n")
    sys.stderr.write(f"results database: {args.db} (the same command again evaluates only what is missing)\n")
    return 0


def render(summaries: list[dict[str, Any]], console: Any) -> None:
    """Protocols side by side: both rates, kill rate per mutant kind, then what survived."""
    from rich.table import Table

    table = Table(title="protocol audit")
    table.add_column("")
    for s in summaries:
        precision = s["protocol"].get("precision", "fp32")
        table.add_column(
            f"{s['protocol']['name']} v{s['protocol']['version']} ({s['protocol']['device']}"
            + (f", {precision})" if precision != "fp32" else ")")
        )
    table.add_row("false-rejection rate", *[fmt_rate(s["false_rejection"]) for s in summaries])
    table.add_row("kill rate", *[fmt_rate(s["kill"]) for s in summaries])
    kinds = sorted({k for s in summaries for k in s["by_kind"]})
    for kind in kinds:
        cells = []
        for s in summaries:
            entry = s["by_kind"].get(kind)
            cells.append(
                "-"
                if entry is None
                else fmt_rate(entry) + (f"; {entry['by_design']} by design" if entry["by_design"] else "")
            )
        table.add_row(f"  {kind}", *cells)
    console.print(table)
    for s in summaries:
        name = f"{s['protocol']['name']} v{s['protocol']['version']}"
        if s["evaluated"] < s["pairs"]:
            console.print(
                f"[yellow]{name}: {s['evaluated']} of {s['pairs']} candidates stored[/yellow]; the "
                "same command without --report-only evaluates the rest",
                highlight=False,
            )
        caught = ", ".join(f"{k} {v}" for k, v in list(s["caught_by"].items())[:8])
        console.print(f"[bold]{name}[/bold] caught by: {caught or '-'}", highlight=False)
        for r in s["rejected_controls"]:
            errors = "; ".join(f"{e['name']} rel {e['rel_err']}" for e in r["errors"]) or ", ".join(
                r["caught_by"]
            )
            console.print(
                f"  [red]rejected control[/red] {r['problem']} {r['kind']} {r['variant']}: "
                f"{r['outcome']} ({errors})",
                highlight=False,
            )
        for r in s["surviving_mutants"]:
            console.print(
                f"  [yellow]surviving mutant[/yellow] {r['problem']} {r['kind']} {r['variant']}",
                highlight=False,
            )
        for r in s["by_design"]:
            console.print(f"  within tolerance by design: {r['problem']} {r['kind']}", highlight=False)
        worst = ", ".join(
            f"{w['problem']} ({w['rejected_controls']} rejected, {w['surviving_mutants']} surviving)"
            for w in s["worst_problems"]
        )
        console.print(f"  worst problems: {worst or '-'}", highlight=False)
        left = ", ".join(f"{k} {v}" for k, v in sorted(s["left_out"].items()))
        console.print(f"  left out before evaluation: {left or '-'}", highlight=False)
