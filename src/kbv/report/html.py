"""The self-contained HTML report: one file, inline CSS, figures as base64 PNG, no network at all.

Needs the ``report`` extra (``pip install 'kernelbench-verified[report]'``: matplotlib, jinja2).
"""

from __future__ import annotations

import base64
import datetime as _dt
import io
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kbv import metrics
from kbv._version import __version__
from kbv.records import Record, raw_samples_ms
from kbv.report.comparison import EFFECTS, change, compare_protocols, split_by_protocol, verdict_reason
from kbv.report.terminal import (
    file_name,
    fmt_rate,
    fmt_x,
    leaderboard_rows,
    outcome_columns,
    protocol_name,
)

_OUTCOME_COLOURS = {
    "passed": "#2e7d32",
    "incorrect": "#f9a825",
    "hack_detected": "#c62828",
    "compile_error": "#6a1b9a",
    "runtime_error": "#8e24aa",
    "timeout": "#455a64",
    "crashed": "#000000",
    "resource_limit": "#bf360c",
    "problem_error": "#bdbdbd",
}


def _require_extras() -> tuple[Any, Any]:
    try:
        import jinja2
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            f"the HTML report needs matplotlib and jinja2 ({exc.name} is missing): "
            "pip install 'kernelbench-verified[report]'"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return jinja2, plt


def write_html_report(
    records: Sequence[Record],
    path: str | Path,
    title: str = "kbv report",
    sources: Mapping[str, str] | None = None,
    sections: Sequence[tuple[str, str, str]] = (),
) -> Path:
    """Write one self-contained HTML file summarising ``records`` and return its path.

    ``sources`` maps candidate source sha256 to source text (e.g. ``Store.candidate_sources()``);
    a candidate missing from it is read from its recorded path when that file still exists.
    ``sections``: (anchor, heading, HTML body) of extra sections shown first, such as the protocol
    audit's (the caller escapes the body)."""
    jinja2, plt = _require_extras()
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("kbv.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(rate=fmt_rate, x=fmt_x, file_name=file_name, change=change)
    records = list(records)
    context = {**_context(records, title, dict(sources or {}), plt), "sections": list(sections)}
    html = env.get_template("report.html.j2").render(**context)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path


def _context(records: list[Record], title: str, sources: dict[str, str], plt: Any) -> dict[str, Any]:
    standard, verified = split_by_protocol(records)
    comparison = compare_protocols(standard, verified) if standard and verified else None
    rows = leaderboard_rows(records, ci=True)
    levels = _level_rows(records)
    return {
        "title": title,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "kbv_version": __version__,
        "n_records": len(records),
        "n_problems": len({metrics.problem_id(r) for r in records}),
        "labels": sorted({metrics.label_of(r) for r in records}),
        "protocols": sorted({protocol_name(r) for r in records}),
        "devices": sorted({str((r.device or {}).get("name", "?")) for r in records}),
        "leaderboard": rows,
        "fast_p_thresholds": metrics.FAST_P_THRESHOLDS,
        "levels": levels,
        "pass_at_ks": _pass_at_ks(rows),
        "level_pass_at_ks": _pass_at_ks(levels),
        "outcomes": metrics.outcome_counts(records),
        "outcome_columns": outcome_columns(records),
        "problem_errors": [r for r in records if metrics.is_problem_error(r)],
        "hack_patterns": metrics.hack_patterns(records),
        "comparison": comparison,
        "effects": EFFECTS,
        "figures": _figures(records, rows, comparison, plt),
        "problems": _drilldown(records, sources),
    }


def _level_rows(records: list[Record]) -> list[dict[str, Any]]:
    """One row per (label, protocol, level): models are never mixed in one row."""
    groups = metrics.group_by(records, lambda r: (metrics.label_of(r), protocol_name(r), metrics.level_of(r)))
    rows = [
        {
            "label": label,
            "protocol": protocol,
            "level": "-" if level is None else level,
            **metrics.aggregate(group),
        }
        for (label, protocol, level), group in groups.items()
    ]
    return sorted(rows, key=lambda r: (r["label"], r["protocol"], str(r["level"])))


def _pass_at_ks(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """The k that some row has pass@k for (empty when no group has several samples per problem)."""
    return sorted({k for row in rows for k in row.get("pass_at_k", {})})


# ----------------------------------------------------------------------------- figures


def _png(fig: Any, plt: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _colours(labels: Sequence[str], plt: Any) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def _figures(records: list[Record], rows: list[dict[str, Any]], comparison: Any, plt: Any) -> dict[str, str]:
    labels = sorted({metrics.label_of(r) for r in records})
    colours = _colours(labels, plt)
    figures = {
        "problem_scatter": _png(_problem_scatter_figure(records, colours, plt), plt),
        "distributions": _speedup_boxes(records, labels, plt),
        "outcomes": _outcome_bars(records, plt),
    }
    scatter = _speed_memory_figure(rows, colours, plt)
    if scatter is not None:  # without any memory figure (the CPU) the chart would say nothing
        figures["scatter"] = _png(scatter, plt)
    if metrics.hack_patterns(records):
        figures["hacks"] = _hack_bars(records, plt)
    if comparison and comparison["labels"]:
        figures["comparison"] = _comparison_bars(comparison, plt)
    return figures


_MARKERS = ["o", "s", "^", "D", "v"]


def _speed_memory_figure(rows: list[dict[str, Any]], colours: dict[str, Any], plt: Any) -> Any:
    """Comparable geomean against memory efficiency, one point per label and protocol, named in
    a legend (point labels written next to the points overlap as soon as two rows are close).
    None when no row has a memory figure."""
    if all(row["memory_efficiency"] is None for row in rows):
        return None
    # A set with no passed pair stands at 1.0x (failures count 1.0x): drawn, it would look faster
    # than honest kernels slower than PyTorch. Its row in the leaderboard says 0% instead.
    rows = [row for row in rows if row["correct_rate"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    missing_memory = False
    protocols = sorted({row["protocol"] for row in rows})
    for row in rows:
        x = row["comparable_geomean"] or 1.0
        y = row["memory_efficiency"]
        missing_memory |= y is None
        marker = _MARKERS[protocols.index(row["protocol"]) % len(_MARKERS)]
        ax.scatter(
            [x],
            [y or 1.0],
            s=90,
            color=colours[row["label"]],
            marker=marker,
            facecolors="none" if y is None else colours[row["label"]],
            linewidths=1.8,
            label=f"{row['label']} ({row['protocol']})",
        )
    xs = [row["comparable_geomean"] or 1.0 for row in rows] + [1.0]
    ys = [row["memory_efficiency"] or 1.0 for row in rows] + [1.0]
    ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    ax.set_ylim(min(ys) / 1.3, max(ys) * 1.3)
    _reference_lines(ax)
    _log_axes(ax, "x", "y")
    ax.set_xlabel("speed if deployed (each kernel where it passed, PyTorch elsewhere)")
    ax.set_ylabel("memory efficiency (baseline peak / kernel peak)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    title = "Speed versus memory, per label and protocol (sets with no passed pair left out)"
    if missing_memory:
        title += "\n(hollow: no memory figures recorded, drawn at 1.0)"
    ax.set_title(title, fontsize=10)
    return fig


def _log_axes(ax: Any, *axes: str, narrow: bool = False) -> None:
    """Log scale with ticks written as plain multipliers (0.5x, 1x, 2x) instead of powers of ten.
    ``narrow`` (a panel a few inches wide) keeps to 1, 2 and 5 per decade, so tick labels never touch."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for name in axes:
        axis = ax.xaxis if name == "x" else ax.yaxis
        (ax.set_xscale if name == "x" else ax.set_yscale)("log")
        low, high = ax.get_xlim() if name == "x" else ax.get_ylim()
        span = high / max(low, 1e-12)
        subs = (
            (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
            if span < 30 and not narrow
            else ((1.0, 2.0, 5.0) if span < 300 else (1.0,))
        )
        axis.set_major_locator(LogLocator(base=10, subs=subs))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        axis.set_minor_formatter(NullFormatter())


def _reference_lines(ax: Any) -> None:
    ax.axvline(1.0, color="#999", lw=0.8, ls="--")
    ax.axhline(1.0, color="#999", lw=0.8, ls="--")


def _problem_points(records: list[Record]) -> dict[str, dict[str, list[tuple[float, float | None]]]]:
    """Passed pairs with a speedup, {protocol: {label: [(speedup, baseline/kernel peak or None)]}}:
    protocols are never mixed (a pair that passes ``standard`` may be a hack ``verified`` catches)."""
    points: dict[str, dict[str, list[tuple[float, float | None]]]] = {}
    for record in records:
        speedup = metrics.speedup_of(record)
        if not metrics.is_passed(record) or speedup is None:
            continue
        mem = record.memory or {}
        base = metrics.as_number(mem.get("baseline_peak_bytes"))
        cand = metrics.as_number(mem.get("candidate_peak_bytes"))
        ratio = base / cand if base and cand else None
        points.setdefault(protocol_name(record), {}).setdefault(metrics.label_of(record), []).append(
            (speedup, ratio)
        )
    return points


def _problem_scatter_figure(records: list[Record], colours: dict[str, Any], plt: Any) -> Any:
    """One panel per protocol. With memory figures: speedup against baseline/kernel peak; without
    (the CPU): speedup per label, one row per label."""
    points = _problem_points(records)
    protocols = sorted(points) or ["-"]
    with_memory = any(
        ratio is not None for by_label in points.values() for pts in by_label.values() for _, ratio in pts
    )
    labels = sorted(colours)
    fig, axes = plt.subplots(
        # One x range for every panel: the same speedup sits at the same place under each protocol.
        1,
        len(protocols),
        figsize=(4.2 * len(protocols) + 1.2, 3.8),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for ax, protocol in zip(axes[0], protocols, strict=True):
        for label, pts in sorted(points.get(protocol, {}).items()):
            xs = [x for x, _ in pts]
            if with_memory:
                ys = [y or 1.0 for _, y in pts]
            else:  # a strip per label, points spread a little so that equal speedups stay visible
                ys = [labels.index(label) + 0.25 * ((j * 0.618) % 1 - 0.5) for j in range(len(pts))]
            ax.scatter(xs, ys, s=28, alpha=0.75, color=colours[label], label=label)
        ax.axvline(1.0, color="#999", lw=0.8, ls="--")
        if points.get(protocol):
            _log_axes(ax, "x", narrow=True)
        else:
            ax.text(0.5, 0.5, "no passed pair with a speedup", ha="center", transform=ax.transAxes)
        ax.set_xlabel("speedup against the best baseline")
        ax.set_title(f"passed under {protocol}", fontsize=10)
    first = axes[0][0]
    if with_memory:
        first.axhline(1.0, color="#999", lw=0.8, ls="--")
        first.set_yscale("log")
        _log_axes(first, "y")
        first.set_ylabel("baseline peak / kernel peak (1.0 if unknown)")
        handles, names = first.get_legend_handles_labels()
        if handles:
            fig.legend(
                handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.95), frameon=False
            )
    else:
        first.set_yticks(range(len(labels)), labels, fontsize=8)
        first.set_ylim(-0.6, len(labels) - 0.4)
        first.invert_yaxis()
    fig.suptitle(
        "Passed pairs, one point per problem x candidate, per protocol"
        + ("" if with_memory else " (no memory figures)"),
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _speedup_boxes(records: list[Record], labels: list[str], plt: Any) -> str:
    data, names = [], []
    for label in labels:
        for protocol in sorted({protocol_name(r) for r in records}):
            values = [
                s
                for r in records
                if metrics.label_of(r) == label
                and protocol_name(r) == protocol
                and metrics.is_passed(r)
                and (s := metrics.speedup_of(r)) is not None
            ]
            if values:
                data.append(values)
                names.append(f"{label}\n{protocol}")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(data) + 2), 4.2))
    if data:
        ax.boxplot(data, showfliers=False)
        for i, values in enumerate(data, 1):
            offsets = [i + 0.16 * ((j * 0.618) % 1 - 0.5) for j in range(len(values))]
            ax.scatter(offsets, values, s=12, alpha=0.6, color="#1565c0", zorder=3)
        ax.set_xticks(range(1, len(names) + 1), names, fontsize=8)
        ax.axhline(1.0, color="#999", lw=0.8, ls="--")
        _log_axes(ax, "y")
    else:
        ax.text(0.5, 0.5, "no passed pair with a speedup", ha="center", transform=ax.transAxes)
    ax.set_ylabel("speedup (passed pairs)")
    ax.set_title("Speedup distribution per label and protocol", fontsize=10)
    return _png(fig, plt)


def _outcome_rows(records: list[Record]) -> dict[str, dict[str, int]]:
    """Outcome counts per "label · protocol": the same pairs under two protocols are two rows,
    never pooled (the terminal's Outcomes table counts the same way)."""
    groups = metrics.group_by(records, lambda r: f"{metrics.label_of(r)} · {protocol_name(r)}")
    return {name: metrics.outcome_counts(groups[name]) for name in sorted(groups)}


def _outcome_bars(records: list[Record], plt: Any) -> str:
    rows = _outcome_rows(records)
    names = list(rows)
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(names) + 1.4))
    outcomes = list(metrics.outcome_counts(records))
    left = [0] * len(names)
    for outcome in outcomes:
        widths = [rows[name].get(outcome, 0) for name in names]
        ax.barh(names, widths, left=left, label=outcome, color=_OUTCOME_COLOURS.get(outcome, "#90a4ae"))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("pairs")
    _integer_ticks(ax)
    ax.invert_yaxis()
    if outcomes:  # a report of no records (an audit summarised before any evaluation) has no bars
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Outcomes per label and protocol", fontsize=10)
    return _png(fig, plt)


def _integer_ticks(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _hack_bars(records: list[Record], plt: Any) -> str:
    patterns = metrics.hack_patterns(records)
    fig, ax = plt.subplots(figsize=(5.5, 0.35 * len(patterns) + 1.2))
    ax.barh(list(patterns), list(patterns.values()), color="#c62828", height=0.6)
    _integer_ticks(ax)
    ax.invert_yaxis()
    ax.set_xlabel("pairs with a fail finding")
    ax.set_title("Hack patterns", fontsize=10)
    return _png(fig, plt)


def _comparison_bars(comparison: dict[str, Any], plt: Any) -> str:
    return _png(_comparison_figure(comparison, plt), plt)


def _comparison_figure(comparison: dict[str, Any], plt: Any) -> Any:
    """Two panels per label, both protocols side by side. Left, what leads: the share of pairs
    that passed. Right: the speed if deployed, drawn only for a set with some passed pair (a set
    whose every pair failed stands at 1.0x, which would look faster than honest kernels slower
    than PyTorch); such a set is marked "none passed" instead. Labels are ordered by their
    verified correctness, best first; each panel's title says how it counts."""
    labels = sorted(
        comparison["labels"],
        key=lambda lb: (-(comparison["labels"][lb]["verified"]["correct_rate"] or 0.0), lb),
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9.0, 2.6 * len(labels) + 3), 4.2))
    xs = list(range(len(labels)))
    for offset, protocol, colour in ((-0.2, "standard", "#90caf9"), (0.2, "verified", "#1565c0")):
        summaries = [comparison["labels"][lb][protocol] for lb in labels]
        rates = [100.0 * (s["correct_rate"] or 0.0) for s in summaries]
        bars = left.bar([x + offset for x in xs], rates, width=0.4, label=protocol, color=colour)
        left.bar_label(bars, labels=[f"{r:.0f}%" for r in rates], fontsize=7, padding=2)
        for x, summary in zip(xs, summaries, strict=True):
            if summary["correct_rate"]:
                # From 1.0x (PyTorch kept everywhere) to the figure: a set that changes nothing
                # has no bar, and kernels slower than PyTorch go down.
                value = summary["comparable_geomean"] or 1.0
                bar = right.bar([x + offset], [value - 1.0], bottom=1.0, width=0.4, color=colour)
                right.bar_label(
                    bar,
                    labels=[f"{value:.2f}x\n{fmt_rate(summary['correct_rate'])} passed"],
                    fontsize=7,
                    padding=2,
                )
            else:
                right.text(
                    x + offset, 1.0, "none\npassed", ha="center", va="bottom", fontsize=7, color="#c62828"
                )
    left.set_ylim(0, 115)
    left.set_ylabel("pairs that passed (%)")
    left.set_title("Passed: share of all pairs\n(every other outcome counts as failed)", fontsize=9)
    left.legend(fontsize=8, loc="upper right")
    right.axhline(1.0, color="#555", lw=1.0)
    values = [
        comparison["labels"][lb][p]["comparable_geomean"] or 1.0
        for lb in labels
        for p in ("standard", "verified")
    ]
    right.set_ylim(min(values + [1.0]) / 1.35, max(values + [1.0]) * 1.35)
    _log_axes(right, "y")
    right.set_ylabel("speedup if deployed (1x = PyTorch everywhere)")
    right.set_title(
        "Speed if deployed: each kernel where it passed,\nPyTorch elsewhere (a failed pair counts 1.0x)",
        fontsize=9,
    )
    for ax in (left, right):
        ax.set_xticks(xs, labels, fontsize=8)
    fig.suptitle("The same kernels under both protocols", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- drill-down


def _timing_rows(record: Record) -> list[dict[str, Any]]:
    """Per timed subject: sample count, median/min/max (from the stored summary when there is one,
    else from the raw samples) and the summary's remaining scalars (CI, cv, warnings, ...)."""
    timing = record.timing or {}
    entries = [("candidate", timing.get("candidate"))] + sorted((timing.get("baselines") or {}).items())
    rows = []
    for which, entry in entries:
        if not isinstance(entry, dict):
            continue
        samples = raw_samples_ms(entry)
        raw_summary = entry.get("summary")
        summary: dict[str, Any] = raw_summary if isinstance(raw_summary, dict) else {}
        flat = {k: v for k, v in entry.items() if not isinstance(v, (list, dict))}
        extras = {**flat, **summary}
        stats = {
            "n": summary.get("n", len(samples)),
            "median": metrics.as_number(summary.get("median"))
            if summary
            else (statistics.median(samples) if samples else None),
            "min": metrics.as_number(summary.get("min")) if summary else (min(samples) if samples else None),
            "max": metrics.as_number(summary.get("max")) if summary else (max(samples) if samples else None),
        }
        shown = {
            k: v for k, v in extras.items() if k not in ("n", "median", "min", "max", "resamples", "seed")
        }
        rows.append(
            {
                "which": which,
                **stats,
                "summary": ", ".join(
                    f"{k}={_short(v)}" for k, v in sorted(shown.items()) if v not in (None, [], "")
                ),
            }
        )
    return rows


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _source_for(record: Record, sources: dict[str, str]) -> str | None:
    sha = str(record.candidate.get("source_sha256", ""))
    if sha in sources:
        return sources[sha]
    path = Path(str(record.candidate.get("path", "")))
    try:
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
    except OSError:
        return None


def problem_order(level: int, name: str) -> tuple[int, int, str]:
    """Problems in their numeric order within a level (1, 2, 11, not 1, 11, 2): by the number a
    KernelBench name starts with (``11_LayerNorm``), then the name."""
    number = re.match(r"\d+", name)
    return (level, int(number.group()) if number else 1 << 30, name)


def _drilldown(records: list[Record], sources: dict[str, str]) -> list[dict[str, Any]]:
    groups = metrics.group_by(records, lambda r: (metrics.level_of(r) or 0, str(r.problem.get("name", "?"))))
    problems = []
    for (level, name), group in sorted(groups.items(), key=lambda item: problem_order(*item[0])):
        items = []
        for record in sorted(
            group, key=lambda r: (metrics.label_of(r), protocol_name(r), str(r.candidate.get("path")))
        ):
            items.append(
                {
                    "label": metrics.label_of(record),
                    "protocol": protocol_name(record),
                    "candidate": Path(str(record.candidate.get("path", "?"))).name,
                    "candidate_path": str(record.candidate.get("path", "")),
                    "outcome": record.outcome,
                    "colour": _OUTCOME_COLOURS.get(record.outcome, "#90a4ae"),
                    "reason": None if metrics.is_passed(record) else verdict_reason(record),
                    "speedup": {k: metrics.as_number(v) for k, v in sorted((record.speedup or {}).items())},
                    "passed": metrics.is_passed(record),
                    "distributions": record.distributions,
                    "findings": record.findings,
                    "timing": _timing_rows(record),
                    "memory": record.memory or {},
                    "host_ratio": metrics.as_number((record.memory or {}).get("host_ratio")),
                    "error": record.error,
                    "device": (record.device or {}).get("name", "?"),
                    "source": _source_for(record, sources),
                }
            )
        problems.append({"level": level, "name": name, "items": items})
    return problems
