"""The repository speaks of the project, not of how it was worked on.

A figure is cited by its date and results folder (``benchmarks/results/2026-12-03-h200-verified-cost/``),
never by the period of work that measured it (its number or ordinal, or "this" one). "Session" as
a Unix process session (``setsid``, ``start_new_session``, a worker's session, a profiler session)
is a different word and stays.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src", "tests", "docs", "benchmarks")
# Written text only: logs, JSON rows and env captures under benchmarks/results are raw outputs.
SUFFIXES = {".py", ".md", ".sh", ".toml", ".rst", ".cfg"}

_ORDINALS = (
    "second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|"
    r"twenty-\w+|thirty-\w+|\d+(?:st|nd|rd|th)"
)
NARRATION = re.compile(
    "|".join(
        (
            r"\bsessions?[ _-]?\d+",  # the word, then a number (space, underscore, dash or nothing)
            rf"\b(?:{_ORDINALS})\s+sessions?\b",  # an ordinal, in words or digits, then the word
            r"\bthe first sessions?\b",  # (a profiler's "first session in a process" is not one)
            r"\b(?:this|that|next|previous|last|earlier|later|same|other|each|every)\s+(?:work\s+)?sessions?\b",
            r"\bsessions?\s+(?:ago|before|after)\b",
            r"\bwork(?:ing)?[ -]sessions?\b",
            r"\bsession's\s+(?:first|last|own|\d+|device|changes|code|end|start|HEAD)\b",
            r"\b(?:before|after|during|since) the session\b(?!')",
        )
    ),
    re.IGNORECASE,
)


def narration_in(text: str) -> list[str]:
    """Every phrase in ``text`` that names a period of work."""
    return [match.group(0) for match in NARRATION.finditer(text)]


#: The phrases the test must reject, built from one word so that the repository's own text names no
#: period of work, this file's included.
_W = "session"
REJECTED = [
    f"Recorded in {_W} 18 on the H200.",
    f"the twentieth {_W}'s cost sample",
    f"benchmarks/results/gpu-2026-12-02-{_W}15/",
    f"measured this {_W}, not re-run",
    f"29 of the {_W}'s 30 device minutes",
    f"Before this {_W}'s fixes the benchmark showed",
    f"shared with two other {_W}s",
    f"{_W.title()}-20 H200 results",
]


@pytest.mark.parametrize("text", REJECTED)
def test_work_session_narration_is_rejected(text: str) -> None:
    assert narration_in(text), text


@pytest.mark.parametrize(
    "text",
    [
        "Every worker runs kbv.child.main in a new session (its own process group).",
        "subprocess.Popen(cmd, start_new_session=True)",
        "A helper that left the worker's session (setsid) made an effort to escape.",
        "one that started a session of its own is stopped one by one",
        "Start the profiler once: its first session in a process costs seconds.",
        "The speedups as the checks so far leave them (else the session's).",
        "Measured on the H200 (2026-12-03, benchmarks/results/2026-12-03-h200-verified-cost/).",
        "session = Session(subject, reference)",
    ],
)
def test_process_sessions_and_dated_citations_are_accepted(text: str) -> None:
    assert not narration_in(text), narration_in(text)


def _scanned_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SCANNED:
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in SUFFIXES]
    return [p for p in files if p.is_file()]


def test_the_repository_does_not_narrate_its_work_sessions() -> None:
    found = []
    for path in _scanned_files():
        text = path.read_text(errors="replace")
        for match in NARRATION.finditer(text):  # the whole text: a phrase may wrap onto the next line
            number = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, (
        "Cite a measurement by its date and results folder, not by the period of work that made it:\n"
        + "\n".join(found)
    )
