"""Candidates: files defining ``ModelNew``, matched to problems by KernelBench's run-dir naming.

The parent only reads a candidate's bytes (to hash and scan them); it never imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kbv.problems import Problem
from kbv.records import CandidateSection

_RUN_DIR_NAME = re.compile(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel$")


class CandidateError(ValueError):
    """A candidate path that cannot be read."""


@dataclass(frozen=True)
class Candidate:
    """A candidate file and the text it held when read. The worker imports ``path``; the record
    hashes, and the static checks read, ``source``. Construction checks they are the same text, so
    a record can never describe code that did not run (make one with :func:`load_candidate`, or
    from text with :func:`candidate_from_source`)."""

    path: Path
    source: str
    source_sha256: str
    label: str = ""
    sample: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if hashlib.sha256(self.source.encode()).hexdigest() != self.source_sha256:
            raise CandidateError(
                "Candidate.source_sha256 is not the hash of Candidate.source; build candidates with "
                "kbv.load_candidate(path) or kbv.candidates.candidate_from_source(text, directory)"
            )
        try:
            on_disk = self.path.read_bytes()
        except OSError as exc:
            raise CandidateError(
                f"candidate file {self.path} cannot be read ({exc.strerror or exc}); the worker runs "
                "that file, so it must exist"
            ) from exc
        if on_disk != self.source.encode():
            raise CandidateError(
                f"candidate file {self.path} does not hold Candidate.source (the worker would run "
                "other code than the record describes); use kbv.load_candidate(path)"
            )

    def ref(self) -> CandidateSection:
        """The record's ``candidate`` field."""
        return {
            "path": str(self.path),
            "source_sha256": self.source_sha256,
            "label": self.label,
            "sample": self.sample,
        }


def load_candidate(path: str | Path, label: str = "") -> Candidate:
    path = Path(path)
    if not path.exists():
        raise CandidateError(f"candidate file {path} does not exist")
    if not path.is_file():
        raise CandidateError(f"candidate {path} is not a regular file; remove it or give a .py file")
    try:
        # Bytes decoded as they are (no newline translation): the hash is of the file the worker runs.
        source = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CandidateError(
            f"candidate file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from exc
    except OSError as exc:
        raise CandidateError(
            f"candidate file {path} cannot be read ({exc.strerror or exc}); check its permissions"
        ) from exc
    match = _RUN_DIR_NAME.match(path.stem)
    return Candidate(
        path=path.resolve(),
        source=source,
        source_sha256=hashlib.sha256(source.encode()).hexdigest(),
        label=label or path.parent.name,
        sample=int(match.group(3)) if match else None,
    )


def candidate_from_source(source: str, directory: str | Path, label: str = "") -> Candidate:
    """A candidate made from text: written once to ``directory/<sha256>.py`` (read-only, named by
    its hash so equal texts share a file and extension build) and read back from there, so what
    the worker imports is the text the record hashes."""
    if not isinstance(source, str):
        raise CandidateError(f"candidate source must be text (str), not {type(source).__name__}")
    sha = hashlib.sha256(source.encode()).hexdigest()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{sha}.py"
    if not path.is_file() or path.read_bytes() != source.encode():
        partial = directory / f".{sha}.{os.getpid()}.partial"
        partial.write_bytes(source.encode())
        partial.chmod(0o444)
        os.replace(partial, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return load_candidate(path, label=label or "inline")


def _manifest_numbering(
    directory: Path, problems: list[Problem]
) -> tuple[dict[tuple[int | None, int | None], Problem], str | None]:
    """``kbv generate`` numbers problems that have no KernelBench level/id and writes the mapping
    to ``manifest.jsonl`` in the run directory; read it back, matching problems by source hash.
    Returns the numbering and, when the manifest cannot be read, why (the scan goes on without it)."""
    manifest = directory / "manifest.jsonl"
    if not manifest.is_file():
        return {}, None
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return (
            {},
            f"cannot be read ({exc}); candidates numbered by it match no problem until it is fixed "
            "or regenerated",
        )
    by_sha = {p.source_sha256: p for p in problems}
    numbering: dict[tuple[int | None, int | None], Problem] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(entry, dict):
            continue
        problem = by_sha.get(str(entry.get("source_sha256")))
        if problem is not None:
            numbering[(entry.get("level"), entry.get("problem_id"))] = problem
    return numbering, None


def problem_ref_of(file: Path) -> tuple[int | None, int | str | None]:
    """What a candidate file names its problem by: (level, id) for KernelBench's run-directory
    naming, else (None, the problem's file stem)."""
    match = _RUN_DIR_NAME.match(file.stem)
    return (int(match.group(1)), int(match.group(2))) if match else (None, file.stem)


NAMING_HINT = (
    "name candidates level_L_problem_P_sample_S_kernel.py or {problem_stem}.py after a problem in --problems"
)


@dataclass
class CandidateScan:
    """What a candidate directory holds: matched pairs, files that cannot be read, files that match
    no problem. One bad file never hides the others."""

    pairs: list[tuple[Problem, Candidate]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (file, what is wrong and what to do)
    unmatched: list[str] = field(default_factory=list)  # files named after no given problem
    files: int = 0  # candidate files seen


def scan_candidates(problems: list[Problem], directory: str | Path, label: str = "") -> CandidateScan:
    """Pair problems with candidate files in ``directory``, collecting per-file errors.

    A candidate named ``level_{L}_problem_{P}_sample_{S}_kernel.py`` matches the problem with that
    level and id; a file named after a problem's stem (``{stem}.py``) matches that problem. Raises
    :class:`CandidateError` only when ``directory`` itself is missing.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CandidateError(f"candidate directory {directory} does not exist")
    by_level_id: dict[tuple[int | None, int | None], Problem] = {(p.level, p.problem_id): p for p in problems}
    numbering, manifest_error = _manifest_numbering(directory, problems)
    by_level_id.update(numbering)
    by_stem = {p.name: p for p in problems}
    scan = CandidateScan()
    if manifest_error:
        scan.errors.append((str(directory / "manifest.jsonl"), manifest_error))
    for file in sorted(directory.glob("*.py")):
        scan.files += 1
        match = _RUN_DIR_NAME.match(file.stem)
        problem = (
            by_level_id.get((int(match.group(1)), int(match.group(2)))) if match else by_stem.get(file.stem)
        )
        if problem is None:
            scan.unmatched.append(str(file))
            continue
        try:
            scan.pairs.append((problem, load_candidate(file, label=label or directory.name)))
        except CandidateError as exc:
            scan.errors.append((str(file), str(exc)))
    return scan


def match_candidates(
    problems: list[Problem], directory: str | Path, label: str = ""
) -> list[tuple[Problem, Candidate]]:
    """The pairs of :func:`scan_candidates` (files that cannot be read are left out; ask
    ``scan_candidates`` for them and for the files that match no problem)."""
    return scan_candidates(problems, directory, label=label).pairs
