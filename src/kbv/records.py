"""The evaluation record: one typed, versioned object per problem x candidate x protocol.

Field names follow ``docs/contract.md``. Records are plain dataclasses so they serialise to JSON
without a schema library; ``Record.from_dict`` reads any record this version or an older one wrote.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

SCHEMA_VERSION = 1


class _StrEnum(str, Enum):
    """An enum whose members are their JSON strings: equal, hashed, printed and formatted as them,
    so ``record.outcome == "passed"`` and ``f"{record.outcome}"`` mean what they say."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]
    __hash__ = str.__hash__


class Outcome(_StrEnum):
    PASSED = "passed"
    INCORRECT = "incorrect"
    HACK_DETECTED = "hack_detected"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    # The candidate exceeded a limit its protocol names (host or device memory, processes, open files).
    RESOURCE_LIMIT = "resource_limit"
    # The problem could not produce its own reference output: its fault, never the candidate's.
    PROBLEM_ERROR = "problem_error"


class Severity(_StrEnum):
    FAIL = "fail"
    WARN = "warn"
    INFO = "info"


@dataclass(init=False)
class Finding:
    """One observation of an integrity or correctness check, with the evidence that backs it."""

    check: str
    severity: Severity
    detail: str

    def __init__(self, check: str, severity: Severity | str, detail: str) -> None:
        self.check, self.severity, self.detail = check, Severity(severity), detail

    @staticmethod
    def fail(check: str, detail: str) -> Finding:
        return Finding(check, Severity.FAIL, detail)

    @staticmethod
    def warn(check: str, detail: str) -> Finding:
        return Finding(check, Severity.WARN, detail)

    @staticmethod
    def info(check: str, detail: str) -> Finding:
        return Finding(check, Severity.INFO, detail)


@dataclass
class DistributionResult:
    """One hidden input distribution: whether it applied, passed, and its error against the tolerance."""

    name: str
    applicable: bool
    passed: bool
    max_abs_err: float | None = None
    rel_err: float | None = None
    tolerance: dict[str, Any] | None = None
    note: str = ""
    baseline_err: dict[str, Any] | None = None
    draws: int = 0


class ProblemSection(TypedDict, total=False):
    """``record.problem``: which problem (``kbv.problems.Problem.ref``)."""

    name: str
    level: int | None
    id: int | None
    path: str
    source_sha256: str
    # Present (true) when the file held other bytes at the end of the evaluation than the text
    # read at its start (a batch: at the batch's start). The record is of the text read.
    changed_on_disk: bool


class CandidateSection(TypedDict, total=False):
    """``record.candidate``: which candidate file (``kbv.candidates.Candidate.ref``)."""

    path: str
    source_sha256: str
    label: str
    sample: int | None
    model: str  # the label's name in records older than labels


class ProtocolSection(TypedDict, total=False):
    """``record.protocol``: the resolved protocol, hashed (``sha256`` covers ``settings``)."""

    name: str
    version: int
    sha256: str
    settings: dict[str, Any]


class TimingEntry(TypedDict, total=False):
    """One timed subject (the candidate or a baseline): its raw rounds and their statistics."""

    source: str  # "measured" or "cache"
    rounds: list[dict[str, Any]]  # per round: device_ms, wall_ms (raw samples), parent_bracket_s, ...
    summary: dict[str, Any]  # kbv.statistics.summarize of the device samples: median, ci95_low, ...
    wall_summary: dict[str, Any]
    throttled_rounds: int
    cache_check: dict[str, Any]


class TimingSection(TypedDict, total=False):
    """``record.timing``: raw samples of the candidate and of every baseline, and what was judged."""

    candidate: TimingEntry | None
    baselines: dict[str, TimingEntry]
    recipe: str
    settings: dict[str, Any]
    baselines_not_measured: dict[str, str]
    speedup_intervals: dict[str, dict[str, Any]]
    speedup_withdrawn: str
    timed_outputs: dict[str, Any]  # every timed call judged by its sketch (kbv.timed_sketches._SketchPlan)
    # Trusted batches timed after the rounds when every candidate round's bracket disagreed
    # (timing_disagreement holds the rounds against their gaps too): {rounds, precision, why}.
    bracket_recheck: dict[str, Any]
    # With ``timing.median_precision`` set: rounds timed, their bounds, the target and the worst series'
    # precision when they stopped (kbv.performance._precision_reached).
    median_precision: dict[str, Any]
    # Baselines timed for the first round only, and why (kbv.performance._dominated).
    baselines_stopped: dict[str, str]


def protocol_section(protocol: Any) -> ProtocolSection:
    """The ``protocol`` section of a record evaluated under ``protocol`` (a ``kbv.protocol.Protocol``)."""
    return {
        "name": protocol.name,
        "version": protocol.version,
        "sha256": protocol.sha256(),
        "settings": protocol.to_dict(),
    }


#: ``record.speedup``: baseline time / candidate time per baseline name, and ``best`` (against the
#: fastest baseline); None where not timed.
SpeedupSection = dict[str, "float | None"]


class MemorySection(TypedDict, total=False):
    """``record.memory``: peak bytes (None on the CPU) and the candidate's host peak."""

    candidate_peak_bytes: int | None
    baseline_peak_bytes: int | None
    ratio: float | None
    candidate_outside_allocator_bytes: int
    candidate: dict[str, Any]
    baseline: dict[str, Any]
    method: str
    candidate_host_peak_bytes: int | None
    reference_host_peak_bytes: int | None
    # Host memory, on the CPU as on the GPU: candidate host peak / reference host peak (> 1: the
    # candidate's process held more host memory than the reference's). None when a peak is unknown.
    host_ratio: float | None
    # The most kbv's own parent process reserved on the GPU in each phase, bytes (GPU only): where
    # kbv's copies of outputs and truths take the room a candidate is promised.
    parent_device_peak_bytes: dict[str, int]


@dataclass
class Record:
    """One evaluation of a problem x candidate x protocol (``docs/contract.md``)."""

    problem: ProblemSection
    candidate: CandidateSection
    protocol: ProtocolSection
    device: dict[str, Any]
    outcome: Outcome
    correct: bool
    distributions: list[DistributionResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    timing: TimingSection = field(default_factory=lambda: TimingSection(candidate=None, baselines={}))
    speedup: SpeedupSection = field(default_factory=lambda: {"best": None})
    memory: MemorySection = field(
        default_factory=lambda: MemorySection(candidate_peak_bytes=None, baseline_peak_bytes=None, ratio=None)
    )
    seeds: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    # kind, summary, message, traceback; worker (whose failure: candidate or reference); limit
    # (resource_limit); blame (problem_error)
    error: dict[str, Any] | None = None
    logs: dict[str, str] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    # How the candidate worker was contained on this machine (kbv.worker.Worker.isolation), and
    # what could not be done here: said once per record instead of running unconfined silently.
    isolation: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: the enums as their strings."""
        data = dataclasses.asdict(self)
        data["outcome"] = Outcome(self.outcome).value  # also when a caller assigned a plain string
        for finding in data["findings"]:
            finding["severity"] = Severity(finding["severity"]).value
        return data

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), sort_keys=True, allow_nan=False, default=_json_default)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Record:
        data = dict(data)
        version = data.get("schema_version", 1)
        if version > SCHEMA_VERSION:
            raise ValueError(
                f"record schema version {version} is newer than this kbv understands ({SCHEMA_VERSION}); "
                "upgrade kbv to read it"
            )
        known = {f.name for f in dataclasses.fields(Record)}
        data = {k: v for k, v in data.items() if k in known}
        data["distributions"] = [DistributionResult(**d) for d in data.get("distributions", [])]
        data["findings"] = [Finding(**f) for f in data.get("findings", [])]
        return Record(**data)


def decide_outcome(correct: bool, findings: list[Finding]) -> Outcome:
    """The contract's rule: any ``fail`` finding is a hack; otherwise correctness decides."""
    if any(f.severity == Severity.FAIL for f in findings):
        return Outcome.HACK_DETECTED
    return Outcome.PASSED if correct else Outcome.INCORRECT


_COMPILER_ERROR = re.compile(r"(?:^|\s)(?:fatal )?error(?: [A-Z]?\d+)?:", re.IGNORECASE)


def error_summary(kind: str, message: str) -> str:
    """One line that says what went wrong: for a ``compile_error`` the compiler's first ``error:``
    line (gcc, clang, nvcc, ptxas; the directory of the file left out), otherwise the message's
    last informative line (the exception, not a traceback frame)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return kind
    if kind == "compile_error":
        for line in lines:
            if _COMPILER_ERROR.search(line) and not line.startswith(("FAILED:", "ninja:")):
                return re.sub(r"^\S*/", "", line)[:300]
    if len(lines) > 1 and lines[0].startswith("Traceback"):
        return lines[-1][:300]
    return lines[0][:300]


def host_memory_section(candidate_peak: int | None, reference_peak: int | None) -> dict[str, Any]:
    """The host-memory fields of ``record.memory``: both processes' peaks and their ratio."""
    candidate_peak, reference_peak = candidate_peak or None, reference_peak or None
    return {
        "candidate_host_peak_bytes": candidate_peak,
        "reference_host_peak_bytes": reference_peak,
        "host_ratio": candidate_peak / reference_peak if candidate_peak and reference_peak else None,
    }


#: How much of each finding's evidence a summary keeps (the whole is in ``findings``).
_EVIDENCE_CHARS = 160


def _one_line(text: str, limit: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure_summary(
    outcome: Outcome | str, findings: list[Finding], distributions: list[DistributionResult]
) -> str:
    """One line that says why a record that has no error did not pass: a hack's failed checks with
    their evidence, the first distribution an incorrect output failed on."""
    failed = [f for f in findings if f.severity == Severity.FAIL]
    if Outcome(outcome) == Outcome.HACK_DETECTED and failed:
        checks = "; ".join(f"{f.check}: {_one_line(f.detail, _EVIDENCE_CHARS)}" for f in failed)
        return f"hack detected by {len(failed)} check{'s' if len(failed) != 1 else ''}: {checks}"
    for dist in distributions:
        if dist.applicable and not dist.passed:
            err = f" (max_abs_err {dist.max_abs_err:.3g})" if isinstance(dist.max_abs_err, float) else ""
            note = f": {_one_line(dist.note, _EVIDENCE_CHARS)}" if dist.note else ""
            return f"wrong output on the {dist.name} inputs{err}{note}"
    if not any(d.applicable for d in distributions):
        return f"{outcome}: no input distribution applied, so nothing was checked"
    return str(Outcome(outcome).value)


def with_summary(
    outcome: Outcome | str,
    findings: list[Finding],
    distributions: list[DistributionResult],
    error: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """``error`` with a ``summary`` for every outcome but ``passed`` (a ``passed`` record keeps
    what it has, normally None). A hack's error also lists its failed ``checks`` with their evidence."""
    if Outcome(outcome) == Outcome.PASSED:
        return error
    error = dict(error or {})
    if not error.get("summary"):
        if error.get("message"):
            error["summary"] = error_summary(str(error.get("kind", "")), str(error["message"]))
        else:
            error.setdefault("kind", Outcome(outcome).value)
            error["summary"] = failure_summary(outcome, findings, distributions)
    if Outcome(outcome) == Outcome.HACK_DETECTED and "checks" not in error:
        error["checks"] = [
            {"check": f.check, "evidence": f.detail} for f in findings if f.severity == Severity.FAIL
        ]
    return error


def _json_default(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"cannot serialise {type(value).__name__} in a record")


def _finite(value: Any) -> Any:
    """JSON has no NaN or Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# --- the JSON round trip ------------------------------------------------------------------------


# Fields where ``Record.to_json`` may have written NaN/inf as strings; read them back as floats.
_NUMERIC_TREES = ("speedup", "memory", "timing", "phases_s")
_DIST_NUMERIC = ("max_abs_err", "rel_err", "tolerance", "baseline_err")
_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _revive(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_revive(v) for v in value]
    return value


def record_from_dict(data: dict[str, Any]) -> Record:
    """``Record.from_dict`` after turning "nan"/"inf"/"-inf" back into floats in numeric fields
    (speedup, memory, timing, phases and the distributions' error figures). Text fields such as
    notes and finding details are left alone."""
    data = dict(data)
    for name in _NUMERIC_TREES:
        if name in data:
            data[name] = _revive(data[name])
    dists = []
    for dist in data.get("distributions", []):
        dist = dict(dist)
        for name in _DIST_NUMERIC:
            if name in dist:
                dist[name] = _revive(dist[name])
        dists.append(dist)
    data["distributions"] = dists
    return Record.from_dict(data)


def record_from_json(text: str) -> Record:
    return record_from_dict(json.loads(text))


def raw_samples_ms(entry: Any, clock: str = "device") -> list[float]:
    """The raw per-call times (ms) of one timing entry, non-finite values dropped.

    Reads the evaluation's layout, ``{"rounds": [{"device_ms": [...], "wall_ms": [...]}, ...]}``
    (all rounds concatenated, ``clock`` picks ``device_ms`` or ``wall_ms``), and for the device
    clock also a flat list under ``samples_ms``, ``samples`` or ``times_ms``."""
    if not isinstance(entry, dict):
        return []
    values: list[Any] = []
    rounds = entry.get("rounds")
    if isinstance(rounds, list):
        for measured in rounds:
            if isinstance(measured, dict) and isinstance(measured.get(f"{clock}_ms"), list):
                values += measured[f"{clock}_ms"]
    elif clock == "device":
        for key in ("samples_ms", "samples", "times_ms"):
            if isinstance(entry.get(key), list):
                values = entry[key]
                break
    out = []
    for value in values:
        number = as_number(_revive(value))
        if number is not None:
            out.append(number)
    return out


def as_number(value: Any) -> float | None:
    """A finite float, or None for anything else (None, NaN, inf, "nan", non-numbers)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


# --- the schema, as docs/record-schema.md shows it -----------------------------------------------


def _type_name(annotation: Any) -> str:
    annotation = getattr(annotation, "__forward_arg__", annotation)  # a TypedDict's, unresolved
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "").replace("Optional[", "(").replace("'", "")


def schema_markdown() -> str:
    """``docs/record-schema.md``: every field of a record and of its typed sections, generated from
    this module (``python -m kbv.records > docs/record-schema.md``; a test checks the file)."""
    lines = [
        "# The evaluation record, field by field",
        "",
        f"Generated from `src/kbv/records.py` (schema version {SCHEMA_VERSION}) by `python -m kbv.records`;",
        "`tests/test_record_schema.py` fails when this file and the code disagree.",
        "[contract.md](contract.md) fixes the required fields; a section may hold keys that older records",
        "wrote.",
        "",
    ]

    def table(title: str, doc: str, rows: list[tuple[str, str]]) -> None:
        lines.extend([f"## {title}", "", " ".join(doc.split()), "", "| field | type |", "|---|---|"])
        lines.extend(f"| `{name}` | `{kind}` |".replace(" | None", r" \| None") for name, kind in rows)
        lines.append("")

    for cls in (Record, DistributionResult, Finding):
        table(
            cls.__name__, cls.__doc__ or "", [(f.name, _type_name(f.type)) for f in dataclasses.fields(cls)]
        )
    for typed in (
        ProblemSection,
        CandidateSection,
        ProtocolSection,
        TimingSection,
        TimingEntry,
        MemorySection,
    ):
        table(
            typed.__name__,
            typed.__doc__ or "",
            [(name, _type_name(kind)) for name, kind in typed.__annotations__.items()],
        )
    lines.extend(
        ["## SpeedupSection", "", "`dict[str, float | None]`: one entry per baseline name, and `best`.", ""]
    )
    for enum in (Outcome, Severity):
        lines.extend([f"## {enum.__name__}", "", ", ".join(f"`{member.value}`" for member in enum), ""])
    return "\n".join(lines)


if __name__ == "__main__":
    print(schema_markdown(), end="")
