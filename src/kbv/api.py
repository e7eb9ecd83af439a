"""Path-level entry points used by the CLI and by scripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kbv.candidates import CandidateError, load_candidate
from kbv.devices import check_device
from kbv.evaluation import evaluate
from kbv.problems import check_importable, load_problem
from kbv.protocol import Protocol, load_protocol, protocol_from_dict
from kbv.records import Record
from kbv.toolchain import check_toolchain


def evaluate_paths(
    problem_path: str | Path,
    candidate_path: str | Path,
    *,
    protocol: str | Path | Protocol = "verified",
    device: str | None = None,
    timeout_s: float | None = None,
    master_seed: int | None = None,
    structure: list[Any] | None = None,
    precision: str | None = None,
) -> Record:
    """Evaluate one problem file against one candidate file (``structure``: input invariants to
    use instead of inferring them, as a replay does; ``precision``: fp32, bf16 or fp16, None for the
    protocol's own, fp32 unless its file says otherwise)."""
    resolved = resolve_protocol(protocol, precision)
    problem = load_problem(problem_path)
    check_importable(problem)
    candidate = load_candidate(candidate_path)
    check_toolchain([candidate], device)  # a missing compiler is the machine's fault, not a verdict
    return evaluate(
        problem,
        candidate,
        resolved,
        device,
        timeout_s=timeout_s,
        master_seed=master_seed,
        structure=structure,
    )


def resolve_protocol(protocol: str | Path | Protocol, precision: str | None = None) -> Protocol:
    """``protocol`` (a name, a .toml file or a Protocol) evaluated in ``precision`` (None: its own)."""
    return load_protocol(protocol).with_precision(precision)


def evaluate_replay(
    record_path: str | Path, *, device: str | None = None, timeout_s: float | None = None
) -> Record:
    """Re-run a stored record with its own protocol settings and master seed: the same inputs again."""
    path = Path(record_path)
    if not path.is_file():
        raise FileNotFoundError(f"record file {path} does not exist")
    text = path.read_text().strip().splitlines()
    if not text:
        raise CandidateError(f"record file {path} is empty")
    data: dict[str, Any] = json.loads(text[-1])
    settings = dict(data["protocol"]["settings"])
    protocol = protocol_from_dict(
        {k: v for k, v in settings.items() if k in ("name", "version", "timeout_s", "precision")}
        | {
            "base": data["protocol"]["name"]
            if data["protocol"]["name"] in ("standard", "verified")
            else "verified",
            **{k: settings[k] for k in ("correctness", "timing", "integrity") if k in settings},
        }
    )
    device = device or data["device"].get("type")
    check_device(device)  # a CUDA record replayed where there is no GPU: the user's error, before any worker
    return evaluate_paths(
        data["problem"]["path"],
        data["candidate"]["path"],
        protocol=protocol,
        device=device,
        timeout_s=timeout_s,
        master_seed=int(data["seeds"]["master"]),
        structure=data["seeds"].get("structure"),  # older records have none: inferred again
    )
