"""docs/architecture.md stays a short page (the trust model, the layout, one evaluation walked);
details live in the topic docs, and every citation of a section of it or of docs/isolation.md
names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 200
# `docs/architecture.md, "What isolation does not cover"` and the like, in docs, code and tests.
_CITATION = re.compile(
    r"""(docs/(?:architecture|isolation)\.md)`{0,2}\)?,?\s+["'](?P<section>[^"']{3,80})["']"""
)


def test_architecture_stays_short() -> None:
    lines = len(ARCHITECTURE.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"docs/architecture.md has {lines} lines (at most {MAX_LINES}): keep the trust model, the layout "
        "and one evaluation walked there, and move details to a topic doc (docs/isolation.md, "
        "docs/timing.md, docs/correctness.md, docs/integrity-dynamic.md)"
    )


def sections(doc: str) -> list[str]:
    """The headings and bold lead phrases a citation may name."""
    heads = [" ".join(line.lstrip("#").split()) for line in doc.splitlines() if line.startswith("#")]
    bold = [" ".join(text.split()).rstrip(".") for text in re.findall(r"\*\*(.+?)\*\*", doc, re.S)]
    return heads + bold


def cited(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), " ".join(m.group("section").split())) for m in _CITATION.finditer(text)]


def test_citations_are_read() -> None:
    text = "(docs/architecture.md, 'What isolation does not cover') and ``docs/isolation.md``, \"X\n  y\""
    assert cited(text) == [
        ("docs/architecture.md", "What isolation does not cover"),
        ("docs/isolation.md", "X y"),
    ]
    assert not any("Nowhere" in s for s in sections("# A\n**B.** c\n"))


def test_every_citation_names_a_section_that_exists() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    files += [*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.md")]
    missing = []
    for path in [f for f in files if f.resolve() != Path(__file__).resolve()]:  # its own fixtures aside
        for doc, section in cited(path.read_text(errors="replace")):
            if not any(section.rstrip(".") in name for name in sections((ROOT / doc).read_text())):
                missing.append(f"{path.relative_to(ROOT)} cites {doc}, {section!r}")
    assert not missing, missing
