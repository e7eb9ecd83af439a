"""The evaluation record: one typed, versioned object per problem x candidate x protocol.

Field names follow ``docs/contract.md``. Records are plain dataclasses so they serialise to JSON
without a schema library; ``Record.from_dict`` reads any record this version or an older one wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

SCHEMA_VERSION = 1


class Outcome(str, Enum):
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


class Severity(str, Enum):
    FAIL = "fail"
    WARN = "warn"
    INFO = "info"


@dataclass
class Finding:
    """One observation of an integrity or correctness check, with the evidence that backs it."""

    check: str
    severity: str
    detail: str

    @staticmethod
    def fail(check: str, detail: str) -> Finding:
        return Finding(check, Severity.FAIL.value, detail)

    @staticmethod
    def warn(check: str, detail: str) -> Finding:
        return Finding(check, Severity.WARN.value, detail)

    @staticmethod
    def info(check: str, detail: str) -> Finding:
        return Finding(check, Severity.INFO.value, detail)


@dataclass
class DistributionResult:
    name: str
    applicable: bool
    passed: bool
    max_abs_err: float | None = None
    rel_err: float | None = None
    tolerance: dict[str, Any] | None = None
    note: str = ""
    baseline_err: dict[str, Any] | None = None
    draws: int = 0


@dataclass
class Record:
    problem: dict[str, Any]
    candidate: dict[str, Any]
    protocol: dict[str, Any]
    device: dict[str, Any]
    outcome: str
    correct: bool
    distributions: list[DistributionResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=lambda: {"candidate": None, "baselines": {}})
    speedup: dict[str, float | None] = field(default_factory=lambda: {"best": None})
    memory: dict[str, Any] = field(
        default_factory=lambda: {"candidate_peak_bytes": None, "baseline_peak_bytes": None, "ratio": None}
    )
    seeds: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    logs: dict[str, str] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    # How the candidate worker was contained on this machine (kbv.worker.Worker.isolation), and
    # what could not be done here: said once per record instead of running unconfined silently.
    isolation: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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


def decide_outcome(correct: bool, findings: list[Finding]) -> str:
    """The contract's rule: any ``fail`` finding is a hack; otherwise correctness decides."""
    if any(f.severity == Severity.FAIL.value for f in findings):
        return Outcome.HACK_DETECTED.value
    return Outcome.PASSED.value if correct else Outcome.INCORRECT.value


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
