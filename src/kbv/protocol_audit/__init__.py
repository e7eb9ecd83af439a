"""Measure a protocol itself: how often it rejects honest controls, how often it kills mutants.

``audit_protocols`` generates, per problem, honest controls and mutants from the problem's own
source (``_sources``), checks them on the trusted side (``_generate``: equivalence on the
problem's declared domain), evaluates the rest under each protocol through the normal batch
machinery (``kbv.batch.run_batch`` and the store: isolated, stored, resumable) and summarises
(``_report``). ``docs/protocol-audit.md`` describes the method and the measured figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Only torch-free modules at import: ``kbv --help`` and usage errors must not import torch
# (``kbv.cli`` registers this package's subcommand); ``_generate`` is imported where it is used.
from kbv.protocol_audit._report import Row, fmt_rate, make_row, summarize, wilson

__all__ = ["ROLES", "AuditResult", "Row", "audit_protocols", "fmt_rate", "summarize", "wilson"]

#: What the audit generates: honest controls (each must pass) and mutants (each should be rejected).
ROLES = ("control", "mutant")


@dataclass
class AuditResult:
    specs: list[Any] = field(default_factory=list)  # kbv.protocol_audit._generate.Spec
    summaries: list[dict[str, Any]] = field(default_factory=list)  # one per protocol, in order
    errors: list[tuple[str, str]] = field(default_factory=list)  # (what, message): problems or pairs left out
    records: list[Any] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)  # what the workers reported: half of every store key


def audit_protocols(
    problems: str | Path,
    protocols: Sequence[str | Path] = ("standard", "verified"),
    *,
    device: str | None = None,
    db: str | Path = "kbv-results/audit.sqlite",
    work_dir: str | Path | None = None,
    honest: str | Path | None = None,
    timeout_s: float | None = None,
    console: Any = None,
    evaluate: bool = True,
    roles: Sequence[str] = ROLES,
    precision: str = "fp32",
    kinds: Sequence[str] | None = None,
) -> AuditResult:
    """Audit each protocol on the problems under ``problems``; candidates are written under
    ``work_dir`` (default: ``audit-candidates`` next to ``db``) and every record is stored in ``db``,
    so the same call again evaluates only what is missing. ``honest``: a directory of the user's own
    honest candidates (named after their problems), counted as controls. ``evaluate=False``
    summarises what the store already holds (an audit cut short) without evaluating anything.
    ``roles`` keeps only controls or only mutants (both by default): the other rate then reads 0 of 0.
    ``kinds`` keeps only those kinds (e.g. ``zeros``, ``first_rows``; every kind by default), so that a
    slow machine can measure the kinds a claim is about on every problem instead of all on a few.

    With ``evaluate=False`` nothing runs when the store already holds an audit on ``device``'s kind:
    the environment of its records (device name, torch) and what the trusted runs found are read
    from the store file, so the report can be made on another machine, without that device."""
    from kbv.devices import check_device
    from kbv.evaluation import default_device
    from kbv.execute import make_executor
    from kbv.problems import load_problems
    from kbv.protocol import load_protocol
    from kbv.store import Store

    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"roles must be among {ROLES}, not {unknown}")
    from kbv.protocol_audit._sources import KINDS

    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:  # a misspelt kind would otherwise leave every candidate out and measure nothing
        raise ValueError(f"kinds must be among {KINDS}, not {unknown}")
    device = device or default_device()
    resolved = [load_protocol(p).with_precision(precision) for p in protocols]
    db = Path(db)
    work = Path(work_dir) if work_dir else db.parent / "audit-candidates"
    loaded, load_errors = load_problems(problems)
    result = AuditResult(errors=[(str(f), m) for f, m in load_errors])
    recorded = None if evaluate else _recorded_env(db, device)
    if recorded is None:
        check_device(device)  # a report from the store needs none; anything else needs the device
    pairs: list[tuple[Any, Any]] = []
    owners: dict[tuple[str, str], Any] = {}
    for problem in loaded:
        _add_generated(problem, device, work, db, recorded, precision, (roles, kinds), result, pairs, owners)
    if honest and "control" in roles:
        _add_honest(loaded, honest, pairs, owners)
    db.parent.mkdir(parents=True, exist_ok=True)
    with Store(db) as store:
        if evaluate:
            _evaluate(store, pairs, resolved, device, timeout_s, console, result)
        else:
            result.env = recorded or make_executor("sequential", device=device).probe()
        for protocol in resolved:
            _summarise_protocol(store, protocol, pairs, owners, device, timeout_s, result)
    return result


def _add_generated(
    problem: Any,
    device: str,
    work: Path,
    db: Path,
    recorded: dict[str, Any] | None,
    precision: str,
    wanted: tuple[Sequence[str], Sequence[str] | None],
    result: AuditResult,
    pairs: list[tuple[Any, Any]],
    owners: dict[tuple[str, str], Any],
) -> None:
    """One problem's controls and mutants: generated, checked on the trusted side, and those left to
    evaluate added to ``pairs`` (``owners`` maps each pair's key to its spec). ``wanted``: the roles
    and the kinds kept (None: every kind)."""
    from kbv.candidates import load_candidate
    from kbv.devices import release_device_memory
    from kbv.protocol_audit._generate import SpecCache, problem_specs

    try:
        specs = problem_specs(
            problem,
            device,
            work / device.split(":")[0],
            SpecCache(db),
            recorded_torch=recorded["torch"] if recorded else None,
            precision=precision,
        )
    except Exception as exc:  # a problem whose reference cannot run here: listed, the audit goes on
        result.errors.append(
            (problem.name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        )
        return
    finally:  # the trusted runs' blocks (tens of GB at KernelBench sizes) are the workers' to use
        release_device_memory(device)
    roles, kinds = wanted
    specs = [s for s in specs if s.role in roles and (kinds is None or s.kind in kinds)]
    result.specs.extend(specs)
    for spec in specs:
        if spec.status == "evaluate":
            candidate = load_candidate(spec.path, label=f"audit-{spec.role}")
            pairs.append((problem, candidate))
            owners[(problem.source_sha256, candidate.source_sha256)] = spec


def _add_honest(
    loaded: list[Any], honest: str | Path, pairs: list[tuple[Any, Any]], owners: dict[tuple[str, str], Any]
) -> None:
    """The user's own honest candidates, counted as controls."""
    from kbv.candidates import scan_candidates
    from kbv.protocol_audit._generate import Spec

    for problem, candidate in scan_candidates(loaded, honest, label="audit-honest").pairs:
        spec = Spec(
            problem.name,
            "control",
            "user",
            candidate.path.name,
            candidate.source,
            "evaluate",
            path=str(candidate.path),
        )
        pairs.append((problem, candidate))
        owners[(problem.source_sha256, candidate.source_sha256)] = spec


def _summarise_protocol(
    store: Any,
    protocol: Any,
    pairs: list[tuple[Any, Any]],
    owners: dict[tuple[str, str], Any],
    device: str,
    timeout_s: float | None,
    result: AuditResult,
) -> None:
    """One protocol's records of the audit's pairs, read from the store, and their summary."""
    from kbv.store import pair_key, record_key

    wanted = {pair_key(p, c, protocol.with_timeout(timeout_s), result.env) for p, c in pairs}
    records = [r for r in store.records(protocol=protocol.name, latest=True) if record_key(r) in wanted]
    result.records.extend(records)
    rows = [
        make_row(owners[key], r)
        for r in records
        if (key := (r.problem["source_sha256"], r.candidate["source_sha256"])) in owners
    ]
    info = {
        "name": protocol.name,
        "version": protocol.version,
        "sha256": protocol.with_timeout(timeout_s).sha256()[:12],
        "device": device,
        "precision": protocol.precision,
    }
    left_out = [s for s in result.specs if s.status != "evaluate"]
    result.summaries.append(
        {
            **summarize(info, rows, left_out),
            "rows": [r.to_dict() for r in rows],
            "pairs": len(pairs),
            "evaluated": len(rows),
        }
    )


def _recorded_env(db: Path, device: str) -> dict[str, Any] | None:
    """The environment half of the store keys (``kbv.execute.environment``) of the newest record
    the store holds from ``device``'s kind, or None (no store, or nothing from that kind)."""
    if not db.is_file():
        return None
    from kbv.store import Store

    kind = device.split(":")[0]
    with Store(db) as store:
        for record in reversed(store.records()):
            if (record.device or {}).get("type") == kind:
                return {
                    "device_name": str(record.device.get("name", "")),
                    "torch": str((record.versions or {}).get("torch", "")),
                }
    return None


def _evaluate(
    store: Any,
    pairs: list[Any],
    protocols: list[Any],
    device: str,
    timeout_s: float | None,
    console: Any,
    result: AuditResult,
) -> None:
    """One batch per problem and protocol in turn, so that an audit cut short has every protocol's
    records for the same problems (the next call evaluates only what is missing)."""
    from kbv import batch

    run_ids = [
        store.start_run("protocol-audit", {"device": device, "protocol": p.name}, p.with_timeout(timeout_s))
        for p in protocols
    ]
    by_problem: dict[str, list[Any]] = {}
    for problem, candidate in pairs:
        by_problem.setdefault(problem.source_sha256, []).append((problem, candidate))
    for group in by_problem.values():
        for protocol, run_id in zip(protocols, run_ids, strict=True):
            done = batch.run_batch(
                group,
                protocol,
                device=device,
                store=store,
                run_id=run_id,
                timeout_s=timeout_s,
                console=console,
            )
            result.errors.extend(done.errors)
            result.env = done.env
    for run_id in run_ids:
        store.finish_run(run_id)
