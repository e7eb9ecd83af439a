"""benchmarks/ keeps maintained benchmarks only: each script has an entry in benchmarks/README.md,
and every results folder or file a README or doc names exists (results are renamed, never lost)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# A results name: its date, then the machine and what was measured (2026-12-03-h200-verified-cost).
_RESULT = re.compile(r"\b(20\d\d-\d\d-\d\d-(?:h200|cpu|h100)[A-Za-z0-9_.-]*?)(?=[/`'\")\s,;:*]|\.?$)")


def test_every_benchmark_script_has_a_readme_entry() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    missing = [name for name in scripts if f"`{name}`" not in readme and f"{name} " not in readme]
    assert not missing, f"benchmarks/README.md has no entry for {missing}: what it measures, how to run it"


def result_names(text: str) -> set[str]:
    """Every results folder or file named in ``text``."""
    return {match.group(1).rstrip(".") for match in _RESULT.finditer(text)}


def test_result_names_are_read_from_citations() -> None:
    text = "(`results/2026-12-03-h200-verified-cost/call5-tests.log`), 2026-12-01-cpu-summation-orders.md."
    assert result_names(text) == {"2026-12-03-h200-verified-cost", "2026-12-01-cpu-summation-orders.md"}
    assert result_names("on 2026-12-03, efc55ba") == set()


def test_every_cited_result_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARKS.glob("*.md"))]
    missing = {
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in docs
        for name in result_names(doc.read_text())
        if not (RESULTS / name).exists() and not list(RESULTS.glob(f"{name}.*"))  # name.* for json and md
    }
    assert not missing, sorted(missing)
