"""Candidates: files defining ``ModelNew``, matched to problems by KernelBench's run-dir naming.

The parent only reads a candidate's bytes (to hash and scan them); it never imports them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kbv.problems import Problem

_RUN_DIR_NAME = re.compile(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel$")


class CandidateError(ValueError):
    """A candidate path that cannot be read."""


@dataclass(frozen=True)
class Candidate:
    path: Path
    source: str
    source_sha256: str
    label: str = ""
    sample: int | None = None

    def ref(self) -> dict[str, Any]:
        """The record's ``candidate`` field."""
        return {"path": str(self.path), "source_sha256": self.source_sha256, "label": self.label, "sample": self.sample}


def load_candidate(path: str | Path, label: str = "") -> Candidate:
    path = Path(path)
    if not path.is_file():
        raise CandidateError(f"candidate file {path} does not exist")
    try:
        source = path.read_text()
    except UnicodeDecodeError as exc:
        raise CandidateError(f"candidate file {path} is not UTF-8 text") from exc
    match = _RUN_DIR_NAME.match(path.stem)
    return Candidate(
        path=path.resolve(),
        source=source,
        source_sha256=hashlib.sha256(source.encode()).hexdigest(),
        label=label or path.parent.name,
        sample=int(match.group(3)) if match else None,
    )


def _manifest_numbering(directory: Path, problems: list[Problem]) -> dict[tuple[int | None, int | None], Problem]:
    """``kbv generate`` numbers problems that have no KernelBench level/id and writes the mapping
    to ``manifest.jsonl`` in the run directory; read it back, matching problems by source hash."""
    manifest = directory / "manifest.jsonl"
    if not manifest.is_file():
        return {}
    by_sha = {p.source_sha256: p for p in problems}
    numbering: dict[tuple[int | None, int | None], Problem] = {}
    for line in manifest.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        problem = by_sha.get(str(entry.get("source_sha256")))
        if problem is not None:
            numbering[(entry.get("level"), entry.get("problem_id"))] = problem
    return numbering


def match_candidates(problems: list[Problem], directory: str | Path, label: str = "") -> list[tuple[Problem, Candidate]]:
    """Pair problems with candidate files in ``directory``.

    A candidate named ``level_{L}_problem_{P}_sample_{S}_kernel.py`` matches the problem with that
    level and id; a file named after a problem's stem (``{stem}.py``) matches that problem.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CandidateError(f"candidate directory {directory} does not exist")
    by_level_id = {(p.level, p.problem_id): p for p in problems}
    by_level_id.update(_manifest_numbering(directory, problems))
    by_stem = {p.name: p for p in problems}
    pairs: list[tuple[Problem, Candidate]] = []
    for file in sorted(directory.glob("*.py")):
        match = _RUN_DIR_NAME.match(file.stem)
        problem = by_level_id.get((int(match.group(1)), int(match.group(2)))) if match else by_stem.get(file.stem)
        if problem is not None:
            pairs.append((problem, load_candidate(file, label=label or directory.name)))
    return pairs
