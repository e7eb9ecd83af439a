"""Terminal tables (rich): the leaderboard, failure modes and the protocol comparison."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kbv import metrics
from kbv.records import Record
from kbv.report.comparison import EFFECTS, change, compare_protocols


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def protocol_name(record: Record) -> str:
    """The protocol's name, with the precision where it is not fp32 (``verified bf16``): every
    table and chart grouped by it keeps precisions apart."""
    name = str(record.protocol.get("name") or record.protocol.get("sha256", "")[:12] or "?")
    precision = metrics.record_precision(record)
    return name if precision == "fp32" else f"{name} {precision}"


#: What separates one board from another: rows are ranked within a board, never across (a pair
#: under ``standard`` and the same pair under ``verified`` are two boards). Add a field here (and
#: to :func:`row_board`) to give each value of it its own board.
BOARD_FIELDS: tuple[str, ...] = ("protocol",)


def row_board(row: dict[str, Any]) -> tuple[Any, ...]:
    """The board a leaderboard row belongs to (:data:`BOARD_FIELDS`)."""
    return tuple(str(row.get(name, "")) for name in BOARD_FIELDS)


def leaderboard_rows(records: Sequence[Record], ci: bool = False) -> list[dict[str, Any]]:
    """One row per (label, protocol): :func:`kbv.metrics.aggregate` of its records (with bootstrap
    intervals when ``ci``), grouped by board (:func:`row_board`) and ranked within it by
    :func:`kbv.metrics.rank_key`: the share that passed, then fast_1, then the speed if deployed.
    A set that failed everything is last, whatever its speed figure."""
    rows = []
    groups = metrics.group_by(records, lambda r: (metrics.label_of(r), protocol_name(r)))
    for (label, protocol), group in groups.items():
        summary = metrics.aggregate(group, ci=ci)
        rows.append({"label": label, "protocol": protocol, **summary})
    rows.sort(key=lambda row: (row_board(row), metrics.rank_key(row), row["label"]))
    for rank, row in enumerate(rows):
        same_board = rank > 0 and row_board(rows[rank - 1]) == row_board(row)
        row["rank"] = rows[rank - 1]["rank"] + 1 if same_board else 1
    return rows


#: The leaderboard's columns: (header, what the footnote says it is, the cell of a row).
LEADERBOARD_COLUMNS: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    (
        "correct",
        "passed / all pairs (every other outcome counts as failed)",
        lambda row: fmt_rate(row["correct_rate"]),
    ),
    ("fast_1", "passed and faster than PyTorch / all pairs", lambda row: fmt_rate(row["fast_p"][1.0])),
    (
        "deployed",
        "speedup if you deploy each kernel where it passed and keep PyTorch elsewhere "
        "(geomean over all pairs, a failed pair counts 1.0x)",
        lambda row: fmt_x(row["comparable_geomean"]),
    ),
    ("speedup", "geomean over passed pairs only", lambda row: fmt_x(row["correct_speedup"])),
    (
        "mem",
        "device memory, baseline peak / kernel peak (passed pairs)",
        lambda row: fmt_x(row["memory_efficiency"]),
    ),
    (
        "host mem",
        "host memory, candidate process peak / reference process peak (passed pairs)",
        lambda row: fmt_x(row["host_memory_ratio"]),
    ),
    ("hacks", "flagged / all pairs", lambda row: fmt_rate(row["hack_rate"])),
)


def render_summary(records: Sequence[Record], console: Console | None = None) -> None:
    """Print the leaderboard (one row per label and protocol, ranked by correctness, then fast_1,
    then the speed if deployed) and the failure-mode counts: one board per precision, since a bf16
    speedup and an fp32 one are against different baselines."""
    console = console or Console()
    if not records:
        console.print("[yellow]No records to summarise.[/yellow]")
        return
    boards = metrics.split_by_precision(records)
    for precision, board in boards.items():
        if len(boards) > 1:
            console.print(f"[bold]precision {precision}[/bold]")
        _render_board(board, console)


def _render_board(records: Sequence[Record], console: Console) -> None:
    rows = leaderboard_rows(records)
    # A memory column no row has a figure for (device memory on the CPU) is left out: at 80
    # columns it would squeeze the others.
    columns = [
        column
        for column in LEADERBOARD_COLUMNS
        if column[0] not in ("mem", "host mem") or any(column[2](row) != "-" for row in rows)
    ]
    # The box draws one space between columns; a second one (padding) only where the widest row
    # still fits, so that a long label leaves every column readable at 80 columns.
    cells = [[row["label"], row["protocol"], str(row["n"])] + ["100.00x"] * len(columns) for row in rows]
    needed = sum(max(len(c[i]) for c in cells) + 2 for i in range(len(cells[0])))
    padding = (0, 1, 0, 0) if needed <= console.width else 0
    table = Table(
        title="Leaderboard (ranked by correct, then fast_1, then deployed speed)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        padding=padding,
    )
    # Names must stay readable on a narrow terminal; the numeric columns give way first.
    table.add_column("label", min_width=min(30, max(len(r["label"]) for r in rows)))
    table.add_column("protocol", min_width=min(12, max(len(r["protocol"]) for r in rows)))
    table.add_column("n", justify="right")
    for name, _, _ in columns:
        table.add_column(name, justify="right", min_width=min(len(name), 6))
    for row in rows:
        table.add_row(
            Text(row["label"]), Text(row["protocol"]), str(row["n"]), *(cell(row) for _, _, cell in columns)
        )
    console.print(table)
    legend = "; ".join(f"{name}: {meaning}" for name, meaning, _ in columns)
    console.print(
        Text(f"n: pairs, every candidate file one (identical files count apart); {legend}", style="dim")
    )
    if any(row["pass_at_k"] for row in rows):
        _render_pass_at_k(rows, console)

    outcomes = outcome_columns(records)
    failures = Table(title="Outcomes (pairs per protocol)", title_justify="left")
    failures.add_column("outcome", no_wrap=True)
    for protocol in outcomes["protocols"]:
        failures.add_column(protocol, justify="right", no_wrap=True)
    for outcome, counts in outcomes["rows"].items():
        failures.add_row(Text(outcome), *(str(counts.get(p, 0)) for p in outcomes["protocols"]))
    console.print(failures)

    _render_problem_errors(records, console)
    patterns = metrics.hack_patterns(metrics.counted(records))
    if patterns:
        hacks = Table(title="Hack patterns", title_justify="left")
        hacks.add_column("check (fail)")
        hacks.add_column("pairs", justify="right")
        for check, count in patterns.items():
            hacks.add_row(Text(check), str(count))
        console.print(hacks)


def _render_pass_at_k(rows: list[dict[str, Any]], console: Console) -> None:
    """pass@k per row, for rows with several samples per problem."""
    ks = sorted({k for row in rows for k in row["pass_at_k"]})
    table = Table(
        title="pass@k (unbiased; n = samples per problem, identical files included)", title_justify="left"
    )
    table.add_column("label")
    table.add_column("protocol")
    table.add_column("samples", justify="right")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    for row in rows:
        if row["pass_at_k"]:
            table.add_row(
                Text(row["label"]),
                Text(row["protocol"]),
                str(row["n"]),
                *(fmt_rate(row["pass_at_k"].get(k)) for k in ks),
            )
    console.print(table)


def outcome_columns(records: Sequence[Record]) -> dict[str, Any]:
    """Pairs per outcome and protocol, ``{"protocols": [...], "rows": {outcome: {protocol: n}}}``:
    a pair evaluated under two protocols is counted once under each, never pooled."""
    by_protocol = metrics.group_by(records, protocol_name)
    protocols = sorted(by_protocol)
    counts = {p: metrics.outcome_counts(by_protocol[p]) for p in protocols}
    order = list(metrics.outcome_counts(records))
    return {"protocols": protocols, "rows": {o: {p: counts[p].get(o, 0) for p in protocols} for o in order}}


def _render_problem_errors(records: Sequence[Record], console: Console) -> None:
    """Pairs whose problem could not produce its own reference output, listed apart: they are the
    problem's fault and count in no model's metrics."""
    broken = [r for r in records if metrics.is_problem_error(r)]
    if not broken:
        return
    table = Table(
        title="Problem errors (the problem's fault; not in the numbers above)", title_justify="left"
    )
    table.add_column("problem", no_wrap=True)
    table.add_column("pairs", justify="right")
    table.add_column("error", overflow="fold")
    by_problem = metrics.group_by(broken, lambda r: str(r.problem.get("name")))
    for name, group in sorted(by_problem.items()):
        message = str((group[-1].error or {}).get("message", "")).strip().splitlines()
        table.add_row(Text(name), str(len(group)), Text(message[-1] if message else ""))
    console.print(table)


def render_comparison(
    standard_records: Sequence[Record], verified_records: Sequence[Record], console: Console | None = None
) -> dict[str, Any]:
    """Print the standard-versus-verified comparison and return :func:`compare_protocols`'s dict."""
    console = console or Console()
    boards = metrics.by_precision(standard_records, verified_records)
    if len(boards) > 1:  # one comparison per precision; the last one's dict is returned
        result: dict[str, Any] = {}
        for precision, (std, ver) in boards.items():
            console.print(f"[bold]precision {precision}[/bold]")
            result = render_comparison(std, ver, console)
        return result
    result = compare_protocols(standard_records, verified_records)
    if not result["pairs"]:
        console.print("[yellow]No pair was evaluated under both protocols; nothing to compare.[/yellow]")
        return result
    for label, summary in result["labels"].items():
        console.print(_comparison_table(label, summary))
    console.print(Text(COMPARISON_NOTE, style="dim"))
    if result["changed"]:
        console.print(_changed_table(result["changed"], console.width))
    unmatched = result["unmatched_standard"] + result["unmatched_verified"]
    if unmatched:
        console.print(
            f"[dim]{unmatched} records had no counterpart under the other protocol and were left out.[/dim]"
        )
    return result


#: Below this width the changed verdicts are listed (one line per pair, the reason indented under
#: it) instead of tabled: six columns at 80 columns wrap a word or two per line.
WIDE_TABLE_COLUMNS = 120


def _changed_table(changed: list[dict[str, Any]], width: int) -> Table:
    rows = [
        (
            row["label"],
            row["problem"],
            file_name(row["candidate"]),
            row["standard_outcome"],
            row["verified_outcome"],
            row["reason"],
        )
        for row in changed
    ]
    if width >= WIDE_TABLE_COLUMNS:
        table = Table(title="Verdicts that changed", title_justify="left")
        for name in ("label", "problem", "candidate", "standard", "verified"):
            table.add_column(name, no_wrap=True)
        table.add_column("why", overflow="fold")
        for cells in rows:
            table.add_row(*(Text(str(cell)) for cell in cells))
        return table
    table = Table.grid(padding=(0, 1))
    table.title, table.title_justify = "Verdicts that changed (standard -> verified, then why)", "left"
    table.add_column(width=1, no_wrap=True)
    table.add_column(ratio=1)
    for label, problem, candidate, std, ver, why in rows:
        table.add_row("-", Text(f"{label} {problem} ({candidate}): {std} -> {ver}"))
        table.add_row("", Padding(Text(str(why), style="dim"), (0, 0, 0, 2)))
    return table


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
    table.add_row("speedup (passed pairs)", fmt_x(std["correct_speedup"]), fmt_x(ver["correct_speedup"]))
    table.add_row(
        "  vs eager_fp32", fmt_x(std["correct_speedup"]), fmt_x(ver["correct_speedup_vs_reference"])
    )
    table.add_row("speedup if deployed", fmt_x(std["comparable_geomean"]), fmt_x(ver["comparable_geomean"]))
    table.add_row(
        "[bold]change, standard -> verified[/bold]", "", f"[bold]{change(summary['drop'])}[/bold]", ""
    )
    counts = {"integrity": summary["counts"]["integrity"], "distribution": summary["counts"]["distribution"]}
    for effect in EFFECTS:
        share = summary["effect_shares"][effect]
        n = counts.get(effect)
        note = "" if n is None else f" ({n} pair{'' if n == 1 else 's'})"
        table.add_row(
            f"  {_EFFECT_TEXT[effect]}{note}",
            "",
            change(summary["effects"][effect]),
            "-" if share is None else f"{100 * share:.0f}%",
        )
    return table


COMPARISON_NOTE = (
    "speedup if deployed: each kernel where it passed, PyTorch for the rest (a failed pair counts 1.0x). "
    "share: each factor's part of the total movement, rises and drops together (0-100%, adding to 100%)."
)


def file_name(path: Any) -> str:
    """A recorded path's last component (tables name the file; the whole path is in the record)."""
    text = str(path or "")
    return text.rsplit("/", 1)[-1]


def id_ranges(ids: Sequence[int]) -> str:
    """``1-3, 7, 9-10`` for [1, 2, 3, 7, 9, 10]: record ids compactly."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = prev = None
    for i in [*ordered, None]:
        if start is not None and (i is None or prev is None or i != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(parts)


def render_record_ids(stored: Sequence[tuple[int, Record]], db: Any, console: Console | None = None) -> None:
    """Which stored record ids hold which outcome, per protocol, and how to see one in full."""
    console = console or Console()
    if not stored:
        return
    console.print(
        "record ids (see one with: kbv explain ID --db " + str(db) + "):", highlight=False, soft_wrap=True
    )
    groups: dict[tuple[str, str], list[int]] = {}
    for record_id, record in stored:
        groups.setdefault((protocol_name(record), record.outcome), []).append(record_id)
    order = {name: i for i, name in enumerate(metrics.outcome_counts([r for _, r in stored]))}
    for protocol, outcome in sorted(groups, key=lambda key: (key[0], order.get(key[1], 99))):
        console.print(
            f"  {protocol} {outcome}: {id_ranges(groups[(protocol, outcome)])}",
            highlight=False,
            soft_wrap=True,
        )


def progress_bar(console: Console) -> Progress:
    """The progress bar of batches and audits: what runs, how many of how many, time elapsed."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
