"""Problems: KernelBench-format files and the bundled suite (their audit: ``kbv.problems_audit``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kbv.problems._loader import (
    Problem,
    ProblemError,
    check_importable,
    discover,
    load_module,
    load_problem,
    load_problems,
    load_source,
)

__all__ = [
    "Problem",
    "ProblemError",
    "bundled_suite_dir",
    "bundled_candidates_dir",
    "check_importable",
    "discover",
    "load_module",
    "load_problem",
    "load_source",
    "load_problems",
]


def bundled_suite_dir() -> Path:
    """The directory of kbv's own problem suite (KernelBench layout: level1/, level2/, level3/)."""
    return Path(str(resources.files("kbv") / "suite" / "problems"))


def bundled_candidates_dir() -> Path:
    """Bundled candidates used by ``kbv demo``: honest/ and hacks/, named after their problems."""
    return Path(str(resources.files("kbv") / "suite" / "candidates"))
