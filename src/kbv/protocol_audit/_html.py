"""The audit's section of the HTML report (``kbv protocol audit --html FILE``)."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from kbv.protocol_audit._report import fmt_rate


def audit_section(summaries: list[dict[str, Any]]) -> str:
    """Protocols side by side (both rates, kill rate per kind), then the rejected controls and
    surviving mutants of each; every value escaped."""
    head = "".join(f"<th>{escape(s['protocol']['name'])} v{s['protocol']['version']}</th>" for s in summaries)
    rows = [
        _row("false-rejection rate", [fmt_rate(s["false_rejection"]) for s in summaries]),
        _row("kill rate", [fmt_rate(s["kill"]) for s in summaries]),
    ]
    for kind in sorted({k for s in summaries for k in s["by_kind"]}):
        rows.append(
            _row(
                f"kill rate: {kind}",
                [fmt_rate(s["by_kind"][kind]) if kind in s["by_kind"] else "-" for s in summaries],
            )
        )
    parts = [
        '<table id="protocol-audit"><thead><tr><th '
        f'class="l"></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    ]
    for s in summaries:
        name = f"{s['protocol']['name']} v{s['protocol']['version']}"
        items = [
            f"rejected control: {r['problem']} {r['kind']} {r['variant']} ({r['outcome']}; "
            f"{', '.join(r['caught_by'])})"
            for r in s["rejected_controls"]
        ]
        items += [
            f"surviving mutant: {r['problem']} {r['kind']} {r['variant']}" for r in s["surviving_mutants"]
        ]
        items += [f"within tolerance by design: {r['problem']} {r['kind']}" for r in s["by_design"]]
        body = "".join(f"<li>{escape(i)}</li>" for i in items) or "<li>none</li>"
        parts.append(f"<h3>{escape(name)}</h3><ul>{body}</ul>")
    return "\n".join(parts)


def _row(label: str, cells: list[str]) -> str:
    return (
        f'<tr><td class="l">{escape(label)}</td>' + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"
    )


def write_audit_html(result: Any, path: str | Path) -> Path:
    from kbv.report.html import write_html_report

    sections = [("protocol-audit", "Protocol audit", audit_section(result.summaries))]
    return write_html_report(result.records, path, title="kbv protocol audit", sections=sections)
