"""Terminal tables (rich): the leaderboard, failure modes and the protocol comparison."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kbv import metrics
from kbv.records import Record
from kbv.report.comparison import EFFECTS, compare_protocols


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def protocol_name(record: Record) -> str:
    return str(record.protocol.get("name") or record.protocol.get("sha256", "")[:12] or "?")


def leaderboard_rows(records: Sequence[Record], ci: bool = False) -> list[dict[str, Any]]:
    """One row per (label, protocol): :func:`kbv.metrics.summarize` of its records (with bootstrap
    intervals when ``ci``), sorted by protocol, then comparable geomean (best first)."""
    rows = []
    groups = metrics.group_by(records, lambda r: (metrics.label_of(r), protocol_name(r)))
    for (label, protocol), group in groups.items():
        summary = metrics.summarize(group, ci=ci)
        rows.append({"label": label, "protocol": protocol, **summary})
    rows.sort(key=lambda row: (row["protocol"], -(row["comparable_geomean"] or 0.0), row["label"]))
    return rows


def render_summary(records: Sequence[Record], console: Console | None = None) -> None:
    """Print the leaderboard (one row per label and protocol) and the failure-mode counts."""
    console = console or Console()
    if not records:
        console.print("[yellow]No records to summarise.[/yellow]")
        return
    rows = leaderboard_rows(records)
    table = Table(title="Leaderboard", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    # Names must stay readable on a narrow terminal; the numeric columns give way first.
    table.add_column("label", min_width=min(30, max(len(r["label"]) for r in rows)))
    table.add_column("protocol", min_width=min(12, max(len(r["protocol"]) for r in rows)))
    for name in ("n", "correct", "speedup", "cmp", "fast_1", "mem", "hacks"):
        table.add_column(name, justify="right", min_width=len(name))
    for row in rows:
        table.add_row(
            Text(row["label"]), Text(row["protocol"]), str(row["n"]), fmt_rate(row["correct_rate"]),
            fmt_x(row["correct_speedup"]), fmt_x(row["comparable_geomean"]), fmt_rate(row["fast_p"][1.0]),
            fmt_x(row["memory_efficiency"]), fmt_rate(row["hack_rate"]),
        )
    console.print(table)
    console.print(
        "[dim]correct: passed / all pairs; speedup: geomean over passed pairs; cmp: comparable geomean, "
        "failures count 1.0; mem: geomean baseline/kernel peak; hacks: flagged / all pairs[/dim]"
    )

    outcomes = metrics.outcome_counts(records)
    failures = Table(title="Outcomes", title_justify="left")
    failures.add_column("outcome")
    failures.add_column("pairs", justify="right")
    for outcome, count in outcomes.items():
        failures.add_row(Text(outcome), str(count))
    console.print(failures)

    patterns = metrics.hack_patterns(records)
    if patterns:
        hacks = Table(title="Hack patterns", title_justify="left")
        hacks.add_column("check (fail)")
        hacks.add_column("pairs", justify="right")
        for check, count in patterns.items():
            hacks.add_row(Text(check), str(count))
        console.print(hacks)


def render_comparison(
    standard_records: Sequence[Record], verified_records: Sequence[Record], console: Console | None = None
) -> dict[str, Any]:
    """Print the standard-versus-verified comparison and return :func:`compare_protocols`'s dict."""
    console = console or Console()
    result = compare_protocols(standard_records, verified_records)
    if not result["pairs"]:
        console.print("[yellow]No pair was evaluated under both protocols; nothing to compare.[/yellow]")
        return result
    for label, summary in result["labels"].items():
        console.print(_comparison_table(label, summary))
    if result["changed"]:
        changed = Table(title="Verdicts that changed", title_justify="left")
        for name in ("label", "problem", "candidate", "standard", "verified", "why"):
            changed.add_column(name, overflow="fold")
        for row in result["changed"]:
            cells = (row["label"], row["problem"], _short_path(row["candidate"]), row["standard_outcome"],
                     row["verified_outcome"], row["reason"])
            changed.add_row(*(Text(str(cell)) for cell in cells))
        console.print(changed)
    unmatched = result["unmatched_standard"] + result["unmatched_verified"]
    if unmatched:
        console.print(f"[dim]{unmatched} records had no counterpart under the other protocol and were left out.[/dim]")
    return result


_EFFECT_TEXT = {
    "integrity": "integrity: flagged",
    "distribution": "distribution: hidden inputs",
    "timing_other": "timing recipe, other failures",
    "baseline": "baseline: best vs eager_fp32",
}


def _comparison_table(label: str, summary: dict[str, Any]) -> Table:
    std, ver = summary["standard"], summary["verified"]
    title = Text(f"{label}: standard vs verified ({summary['pairs']} pairs)")
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("standard", justify="right")
    table.add_column("verified", justify="right")
    table.add_column("share", justify="right")
    table.add_row("correct", fmt_rate(std["correct_rate"]), fmt_rate(ver["correct_rate"]))
    table.add_row("correct speedup", fmt_x(std["correct_speedup"]), fmt_x(ver["correct_speedup"]))
    table.add_row("  vs eager_fp32", fmt_x(std["correct_speedup"]), fmt_x(ver["correct_speedup_vs_reference"]))
    table.add_row("comparable geomean", fmt_x(std["comparable_geomean"]), fmt_x(ver["comparable_geomean"]))
    table.add_row("[bold]drop (standard ÷ verified)[/bold]", "", f"[bold]÷{summary['drop']:.2f}[/bold]", "")
    counts = {"integrity": summary["counts"]["integrity"], "distribution": summary["counts"]["distribution"]}
    for effect in EFFECTS:
        share = summary["effect_shares"][effect]
        n = counts.get(effect)
        note = "" if n is None else f" ({n} pair{'' if n == 1 else 's'})"
        table.add_row(
            f"  {_EFFECT_TEXT[effect]}{note}", "", f"÷{summary['effects'][effect]:.2f}",
            "-" if share is None else f"{100 * share:.0f}%",
        )
    return table


def _short_path(path: Any) -> str:
    text = str(path or "")
    return text.rsplit("/", 1)[-1]
