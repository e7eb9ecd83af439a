"""The human summary of one record (``kbv eval`` without ``--json``, ``kbv explain``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kbv.metrics import record_precision
from kbv.records import Record, error_summary

_COLOURS = {"passed": "green", "incorrect": "red", "hack_detected": "magenta"}


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def print_record(record: Record, console: Console | None = None) -> None:
    console = console or Console()
    colour = _COLOURS.get(record.outcome, "yellow")
    console.print(
        f"[bold]{record.problem['name']}[/bold] x {record.candidate['path']}\n"
        f"protocol {record.protocol['name']} v{record.protocol['version']} "
        f"({record.protocol['sha256'][:12]}) on {record.device.get('name', record.device.get('type'))}"
        + (f", in {precision}" if (precision := record_precision(record)) != "fp32" else "")
    )
    console.print(f"outcome: [bold {colour}]{record.outcome}[/bold {colour}]   correct: {record.correct}")
    if record.outcome == "problem_error":
        console.print(
            "[yellow]the problem failed, not the candidate:[/yellow] fix the problem file; this "
            "pair counts in no model's metrics"
        )
    if record.error:
        summary = record.error.get("summary") or error_summary(
            str(record.error.get("kind", "")), str(record.error.get("message", ""))
        )
        console.print(
            f"[red]{escape(str(record.error.get('kind')))}[/red]: {escape(summary)}", highlight=False
        )
        details = str(record.error.get("message", "")).strip()
        if details and details != summary:
            console.print(escape(details[:2000]), highlight=False, style="dim")
    narrow = console.width < WIDE_COLUMNS
    if record.distributions:
        console.print(_distribution_table(record, with_notes=not narrow))
        if narrow:
            _print_notes([(d.name, d.note) for d in record.distributions], console)
    if record.findings:
        console.print(_findings_table(record))
    if record.speedup.get("best") is not None:
        console.print(_timing_table(record, with_warnings=not narrow))
        if narrow:
            _print_notes(_timing_warnings(record), console)
    memory = record.memory or {}
    peak = memory.get("candidate_peak_bytes")
    if peak is not None:
        console.print(
            f"peak memory: candidate {peak / 2**20:.1f} MiB, "
            f"baseline {(memory.get('baseline_peak_bytes') or 0) / 2**20:.1f} MiB, ratio "
            f"{_fmt(memory.get('ratio'))}"
        )
    host_peak = memory.get("candidate_host_peak_bytes")
    if host_peak is not None:
        reference = memory.get("reference_host_peak_bytes")
        ratio = memory.get("host_ratio")
        console.print(
            f"host memory peak: candidate {host_peak / 2**20:.1f} MiB"
            + (f", reference {reference / 2**20:.1f} MiB" if reference else "")
            + (f", ratio {_fmt(ratio)} (candidate / reference)" if ratio is not None else "")
        )
    for gap in (record.isolation or {}).get("not_enforced") or []:
        console.print(f"[yellow]not enforced on this machine[/yellow]: {gap}")
    held = str((record.isolation or {}).get("gpu") or "")
    if held.startswith("alone"):  # why it waited for, or kept out, other evaluations on its GPU
        console.print(f"GPU held {held}", highlight=False)
    phases = phases_line(record.phases_s)
    if phases:
        console.print(phases, highlight=False, soft_wrap=True)
    console.print(
        f"seeds: master {record.seeds.get('master')} (replay: kbv eval --replay RECORD.json, a "
        "file written by --json or --out)"
    )


#: An evaluation's phases in the order they run (probes, ``probe:NAME``, are listed apart).
PHASE_ORDER = (
    "boot",
    "reference_load",
    "compile",
    "load",
    "correctness",
    "spares",
    "baseline",
    "timing",
    "integrity",
    "close",
)


def phases_line(phases: dict[str, float]) -> str:
    """Where an evaluation's time went, from the record's ``phases_s``: the phases, then the
    seconds of each integrity probe (the first check that needs a shared probe pays for it), then
    the slowest checks (at most three, from :data:`SLOW_CHECK_S` on)."""
    if not phases:
        return ""
    main = [f"{name} {phases[name]:.1f}" for name in PHASE_ORDER if phases.get(name)]
    probes = [
        f"{name.split(':', 1)[1]} {seconds:.1f}"
        for name, seconds in phases.items()
        if name.startswith("probe:") and seconds >= 0.05
    ]
    slow = sorted(
        ((seconds, name.split(":", 1)[1]) for name, seconds in phases.items() if name.startswith("check:")),
        reverse=True,
    )
    checks = [f"{name} {seconds:.1f}" for seconds, name in slow[:3] if seconds >= SLOW_CHECK_S]
    total = f"total {phases['total']:.1f} s: " if "total" in phases else ""
    return (
        f"time: {total}"
        + ", ".join(main)
        + (f" (probes: {', '.join(probes)})" if probes else "")
        + (f" (slowest checks: {', '.join(checks)})" if checks else "")
    )


#: A check's seconds (``check:NAME``, its probes and the reference's answers it asked for included)
#: from which ``kbv explain`` names it among the slowest: where ``integrity`` went beyond the probes.
SLOW_CHECK_S = 0.5


#: Below this width free text (a distribution's note, a timing warning) is printed under its table,
#: one line per row: in a column beside five fixed ones it wrapped two or three words a line.
WIDE_COLUMNS = 110


def _print_notes(notes: list[tuple[str, str]], console: Console) -> None:
    for name, note in notes:
        if note:
            console.print(Text(f"  {name}: ", style="bold") + Text(note), soft_wrap=False)


def _distribution_table(record: Record, with_notes: bool = True) -> Table:
    table = Table(title="correctness by input distribution")
    for column in ("distribution", "result", "max err", "rel err", "tolerance"):
        table.add_column(column, no_wrap=True)
    if with_notes:  # free text wraps between words; the columns before it never wrap
        table.add_column("note", ratio=1)
    for d in record.distributions:
        result = "n/a" if not d.applicable else ("[green]pass[/green]" if d.passed else "[red]FAIL[/red]")
        cells = [d.name, result, _fmt(d.max_abs_err), _fmt(d.rel_err), _tolerance_text(d.tolerance or {})]
        table.add_row(*cells, *([Text(d.note or "")] if with_notes else []))
    return table


def _timing_warnings(record: Record) -> list[tuple[str, str]]:
    entries = [("candidate", record.timing.get("candidate") or {})]
    entries += list((record.timing.get("baselines") or {}).items())
    return [(name, ", ".join((entry.get("summary") or {}).get("warnings", []))) for name, entry in entries]


def _tolerance_text(tolerance: dict[str, Any]) -> str:
    """The tolerance in a few characters: ``8x baseline err`` (error model) or ``atol 1e-4 rtol 1e-4``."""
    if "error_multiple" in tolerance:
        return f"{_fmt(tolerance['error_multiple'])}x baseline err"
    if "atol" in tolerance or "rtol" in tolerance:
        return f"atol {_fmt(tolerance.get('atol'))} rtol {_fmt(tolerance.get('rtol'))}"
    return ", ".join(f"{k}={_fmt(v)}" for k, v in tolerance.items() if isinstance(v, (int, float)))


def _findings_table(record: Record) -> Table:
    table = Table(title="integrity findings")
    table.add_column("check", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("evidence", ratio=1)
    for f in record.findings:
        style = {"fail": "red", "warn": "yellow"}.get(f.severity, "")
        table.add_row(f.check, f"[{style}]{f.severity}[/{style}]" if style else f.severity, Text(f.detail))
    return table


def _timing_table(record: Record, with_warnings: bool = True) -> Table:
    table = Table(title=f"timing ({record.timing.get('recipe', '')})")
    for column in ("who", "median ms", "95% CI", "speedup"):
        table.add_column(column, no_wrap=True)
    if with_warnings:
        table.add_column("warnings", ratio=1)

    def row(*cells: str, warning: str = "") -> None:
        table.add_row(*cells, *([warning] if with_warnings else []))

    cand = (record.timing["candidate"] or {})["summary"]
    row("candidate", _fmt(cand["median"], ".4f"), _ci(cand), "", warning=", ".join(cand.get("warnings", [])))
    for name, entry in record.timing["baselines"].items():
        s = entry["summary"]
        row(
            name,
            _fmt(s["median"], ".4f"),
            _ci(s),
            _fmt(record.speedup.get(name), ".3f"),
            warning=", ".join(s.get("warnings", [])),
        )
    for name, why in (record.timing.get("baselines_not_measured") or {}).items():
        row(name, "-", "", "", warning=f"not timed: {why}")
    row("[bold]best baseline[/bold]", "", "", f"[bold]{_fmt(record.speedup.get('best'), '.3f')}[/bold]")
    return table


def _ci(summary: dict[str, Any]) -> str:
    low, high = summary.get("ci95_low"), summary.get("ci95_high")
    if low is None and "ci95" in summary:
        low, high = summary["ci95"]
    return f"[{_fmt(low, '.4f')}, {_fmt(high, '.4f')}]"
