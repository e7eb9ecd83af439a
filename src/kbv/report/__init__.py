"""Reports over stored records: rich terminal tables and one self-contained HTML file.

The HTML writer needs the ``report`` extra (matplotlib, jinja2); it is imported on first use so the
terminal tables work without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kbv.report.comparison import compare_protocols, split_by_protocol, verdict_reason
from kbv.report.terminal import render_comparison, render_summary

__all__ = [
    "compare_protocols",
    "render_comparison",
    "render_summary",
    "split_by_protocol",
    "verdict_reason",
    "write_html_report",
]


def write_html_report(records: Any, path: str | Path, title: str = "kbv report", **kwargs: Any) -> Path:
    """Write the HTML report; see :func:`kbv.report.html.write_html_report`."""
    from kbv.report.html import write_html_report as _write

    return _write(records, path, title=title, **kwargs)
