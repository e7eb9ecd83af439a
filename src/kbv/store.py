"""The results store: one SQLite file holding runs, problems, candidates, protocols and records.

Each record is kept whole (``Record.to_json()``) next to indexed columns for querying, with its raw
timing samples and findings in their own tables. Writes are one transaction per record in WAL
mode, so an interrupted batch loses at most the record in flight and resumes with
:meth:`Store.has_record` / :meth:`Store.pending`.

The schema version lives in ``PRAGMA user_version``; :data:`MIGRATIONS` upgrades older files in
place when they are opened.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from kbv._version import __version__
from kbv.metrics import fail_findings, label_of, sample_index, speedup_of
from kbv.protocol import Protocol
from kbv.records import Record, as_number, raw_samples_ms, record_from_json

DEFAULT_DB = Path("kbv-results") / "kbv.sqlite"
DEMO_DB = Path("kbv-results") / "demo.sqlite"
"""Where ``kbv run`` and ``kbv demo`` write by default (commands that only read pick between them:
:func:`default_db_to_read`)."""


def missing_database(db: str | Path) -> str:
    """The one wording of "there is no database there", for every command that reads one."""
    return f"no results database at {db}; run kbv demo or kbv run first, or pass --db PATH"


def _written_at(path: Path) -> float:
    """When a store was last written: the file or its write-ahead log, whichever is newer."""
    wal = path.with_name(path.name + "-wal")
    return max(p.stat().st_mtime for p in (path, wal) if p.exists())


def default_db_to_read() -> Path:
    """The database ``kbv report``, ``export``, ``explain`` and ``compare`` read without ``--db``:
    of ``kbv run``'s and ``kbv demo``'s default stores, the one written last (so that ``kbv report``
    right after ``kbv demo`` reports the demo); ``kbv run``'s when neither exists."""
    existing = [p for p in (DEFAULT_DB, DEMO_DB) if p.is_file()]
    return max(existing, key=_written_at) if existing else DEFAULT_DB


class RecordKey(NamedTuple):
    """What makes two evaluations the same work item: a batch skips a pair whose key is stored.

    The candidate's file is part of it: two samples with identical sources are two samples (each
    keeps its own record, and pass@k counts both); they still share one compiled extension, which
    the build cache keys by source hash."""

    problem_sha: str
    candidate_sha: str
    protocol_sha: str
    device_name: str
    kbv_version: str
    torch_version: str
    candidate_path: str


_SCHEMA_V1 = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    command TEXT NOT NULL,
    args TEXT NOT NULL DEFAULT '{}',
    protocol_sha TEXT,
    status TEXT NOT NULL DEFAULT 'running'
);
CREATE TABLE problems (
    sha TEXT PRIMARY KEY,
    name TEXT,
    level INTEGER,
    path TEXT
);
CREATE TABLE candidates (
    sha TEXT PRIMARY KEY,
    path TEXT,
    source TEXT,
    label TEXT
);
CREATE TABLE protocols (
    sha TEXT PRIMARY KEY,
    name TEXT,
    version INTEGER,
    settings TEXT
);
CREATE TABLE records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER REFERENCES runs(id),
    problem_sha TEXT NOT NULL,
    candidate_sha TEXT NOT NULL,
    protocol_sha TEXT NOT NULL,
    protocol_name TEXT,
    device_name TEXT NOT NULL,
    kbv_version TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    outcome TEXT NOT NULL,
    correct INTEGER NOT NULL,
    speedup_best REAL,
    label TEXT,
    created_at TEXT,
    json TEXT NOT NULL
);
CREATE INDEX records_run ON records(run_id);
CREATE TABLE timing_samples (
    record_id INTEGER NOT NULL REFERENCES records(id) ON DELETE CASCADE,
    which TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    ms REAL NOT NULL
);
CREATE TABLE findings (
    record_id INTEGER NOT NULL REFERENCES records(id) ON DELETE CASCADE,
    check_name TEXT NOT NULL,
    severity TEXT NOT NULL,
    detail TEXT
);
CREATE INDEX findings_record ON findings(record_id);
"""


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    """v2: a ``level`` column on records (backfilled from the stored JSON), the resume-key index
    that makes ``has_record`` fast on large stores, and indexes for per-label/protocol queries."""
    conn.execute("ALTER TABLE records ADD COLUMN level INTEGER")
    conn.execute("UPDATE records SET level = json_extract(json, '$.problem.level')")
    conn.execute(
        "CREATE INDEX records_key ON records(problem_sha, candidate_sha, protocol_sha, device_name,"
        " kbv_version, torch_version)"
    )
    conn.execute("CREATE INDEX records_label ON records(label, protocol_sha)")
    conn.execute("CREATE INDEX timing_record ON timing_samples(record_id)")


def _migrate_2_to_3(conn: sqlite3.Connection) -> None:
    """v3: the candidate's file in the resume key (``candidate_path``, backfilled from the stored
    JSON). Before it, identical candidate files shared one record and a batch skipped the
    duplicates as "already stored"; now each sample has its own (a resumed batch evaluates the
    duplicates an older version skipped)."""
    conn.execute("ALTER TABLE records ADD COLUMN candidate_path TEXT NOT NULL DEFAULT ''")
    conn.execute("UPDATE records SET candidate_path = coalesce(json_extract(json, '$.candidate.path'), '')")
    conn.execute("DROP INDEX IF EXISTS records_key")
    conn.execute(
        "CREATE INDEX records_key ON records(problem_sha, candidate_sha, protocol_sha, device_name,"
        " kbv_version, torch_version, candidate_path)"
    )


Migration = Callable[[sqlite3.Connection], None]

MIGRATIONS: list[tuple[int, Migration]] = [(2, _migrate_1_to_2), (3, _migrate_2_to_3)]
"""(target version, function) pairs applied in order to files older than the target."""

SCHEMA_VERSION = MIGRATIONS[-1][0]


class StoreError(RuntimeError):
    """The file is not a kbv store this version can read; the message says what to do."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def record_key(record: Record) -> RecordKey:
    """The key of a finished evaluation (used to skip finished pairs on resume)."""
    versions = record.versions or {}
    return RecordKey(
        str(record.problem.get("source_sha256", "")),
        str(record.candidate.get("source_sha256", "")),
        str(record.protocol.get("sha256", "")),
        str((record.device or {}).get("name", "")),
        str(versions.get("kbv", "")),
        str(versions.get("torch", "")),
        str(record.candidate.get("path", "")),
    )


def pair_key(problem: Any, candidate: Any, protocol: Protocol, env: dict[str, Any]) -> RecordKey:
    """The :func:`record_key` a pair's record will have, known before evaluating it.

    ``protocol`` must be the one the record will carry, its timeout applied
    (``protocol.with_timeout``, as ``evaluate`` does); ``env`` is ``kbv.execute.environment``: the
    device name and torch version a worker reports, under the one rule of ``kbv.devices.device_name``."""
    return RecordKey(
        problem.source_sha256,
        candidate.source_sha256,
        protocol.sha256(),
        env.get("device_name", ""),
        __version__,
        env.get("torch", ""),
        str(candidate.path),
    )


def _timing_samples(record: Record) -> Iterator[tuple[str, int, float]]:
    """(which, index, ms) for the raw samples in ``record.timing``: the candidate's under
    ``"candidate"``, each baseline's under its name, and the parent-visible wall-clock samples
    under ``"<name>:wall"``. Summary-only timings yield nothing."""
    timing = record.timing or {}
    entries: list[tuple[str, Any]] = [("candidate", timing.get("candidate"))]
    entries += list((timing.get("baselines") or {}).items())
    for which, entry in entries:
        for clock, suffix in (("device", ""), ("wall", ":wall")):
            for index, ms in enumerate(raw_samples_ms(entry, clock)):
                yield which + suffix, index, ms


def _read_candidate_source(record: Record) -> str | None:
    """The candidate's source from its path, only if the file still has the recorded hash."""
    path = Path(str(record.candidate.get("path", "")))
    try:
        data = path.read_bytes()
    except OSError:
        return None
    expected = record.candidate.get("source_sha256")
    if expected and hashlib.sha256(data).hexdigest() != expected:
        return None
    return data.decode("utf-8", errors="replace")


class Store:
    """A kbv results database. Use as a context manager or call :meth:`close`.

    >>> with Store("kbv-results/kbv.sqlite") as store:          # doctest: +SKIP
    ...     run = store.start_run("run", {"problems": "p/"})
    ...     store.add_record(record, run, label="gpt-x")
    ...     store.finish_run(run)
    """

    def __init__(self, path: str | Path = DEFAULT_DB, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA foreign_keys = ON")
        try:
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(f"{self.path} is not a kbv results database ({exc}); pass another --db") from exc

    # -- lifecycle

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has store schema {version}, newer than this kbv ({SCHEMA_VERSION}); upgrade kbv"
            )
        if version == SCHEMA_VERSION:
            return
        with self._transaction() as conn:
            if version == 0:
                if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                    raise StoreError(f"{self.path} is an SQLite file but not a kbv store; pass another --db")
                for statement in _SCHEMA_V1.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                version = 1
            for target, migrate in MIGRATIONS:
                if version < target:
                    migrate(conn)
                    version = target
            conn.execute(f"PRAGMA user_version = {int(version)}")

    # -- runs

    def start_run(self, command: str, args: dict[str, Any] | None = None, protocol: Any = None) -> int:
        """Open a run (status ``running``) and return its id. ``protocol`` may be a
        :class:`~kbv.protocol.Protocol`, whose settings are stored under their hash."""
        sha = self.add_protocol(protocol) if protocol is not None else None
        with self._transaction() as conn:
            cur = conn.execute(
                "INSERT INTO runs(started_at, command, args, protocol_sha, status) VALUES (?, ?, "
                "?, ?, 'running')",
                (now_iso(), command, json.dumps(args or {}, sort_keys=True, default=str), sha),
            )
            return int(cur.lastrowid or 0)

    def finish_run(self, run_id: int, status: str = "finished") -> None:
        """Close a run with ``status`` (``finished``, ``interrupted``, ``failed``)."""
        with self._transaction() as conn:
            conn.execute(
                "UPDATE runs SET finished_at = ?, status = ? WHERE id = ?", (now_iso(), status, run_id)
            )

    def runs(self) -> list[dict[str, Any]]:
        rows = self._conn.execute("SELECT * FROM runs ORDER BY id").fetchall()
        return [{**dict(row), "args": json.loads(row["args"] or "{}")} for row in rows]

    def last_run(self, command: str | None = None, status: str | None = None) -> dict[str, Any] | None:
        """The newest run, optionally of one command and/or status (e.g. an interrupted one to resume)."""
        runs = [
            r
            for r in self.runs()
            if (command is None or r["command"] == command) and (status is None or r["status"] == status)
        ]
        return runs[-1] if runs else None

    def add_protocol(self, protocol: Any) -> str:
        """Store a protocol's settings under its hash (a Protocol, or a record's protocol dict)."""
        if hasattr(protocol, "sha256") and callable(protocol.sha256):
            sha, name, version, settings = (
                protocol.sha256(),
                protocol.name,
                protocol.version,
                protocol.to_dict(),
            )
        else:
            sha = str(protocol["sha256"])
            name, version, settings = protocol.get("name"), protocol.get("version"), protocol.get("settings")
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO protocols(sha, name, version, settings) VALUES (?, ?, ?, ?) ON CONFLICT(sha) DO"
                " UPDATE SET settings = coalesce(protocols.settings, excluded.settings)",
                (sha, name, version, json.dumps(settings, sort_keys=True) if settings is not None else None),
            )
        return sha

    def protocol_settings(self, sha: str) -> dict[str, Any] | None:
        row = self._conn.execute("SELECT settings FROM protocols WHERE sha = ?", (sha,)).fetchone()
        return json.loads(row["settings"]) if row and row["settings"] else None

    # -- records

    def add_record(
        self,
        record: Record,
        run_id: int | None = None,
        label: str | None = None,
        source: str | None = None,
        also: Callable[[sqlite3.Connection, int], None] | None = None,
    ) -> int:
        """Store one record in one transaction and return its id.

        ``also(connection, record_id)`` runs inside that transaction: what it writes is committed
        with the record or not at all (``kbv serve`` marks the request the record answers).

        ``label`` is the model or candidate-set name (default: ``record.candidate["label"]``); it is
        written into the stored record's ``candidate["label"]``. ``source`` is the candidate's code;
        when omitted it is read from ``candidate["path"]`` if that file still has the recorded hash."""
        label = label or record.candidate.get("label") or None
        candidate = dict(record.candidate)
        if label:
            candidate["label"] = label
        stored = Record.from_dict({**record.to_dict(), "candidate": candidate})
        key = record_key(stored)
        if source is None:
            source = _read_candidate_source(stored)
        with self._transaction() as conn:
            _insert_pair_parts(conn, stored, key, source, label)
            record_id = _insert_record_row(conn, stored, key, run_id, label)
            _insert_record_details(conn, stored, record_id)
            if also is not None:
                also(conn, record_id)
        return record_id

    def has_record(self, key: RecordKey | Record) -> bool:
        """Whether a record with this key (see :func:`record_key`) is stored, in any run."""
        if isinstance(key, Record):
            key = record_key(key)
        row = self._conn.execute(
            "SELECT 1 FROM records WHERE problem_sha = ? AND candidate_sha = ? AND protocol_sha = ?"
            " AND device_name = ? AND kbv_version = ? AND torch_version = ? AND candidate_path = ?"
            " LIMIT 1",
            tuple(key),
        ).fetchone()
        return row is not None

    def pending(self, keys: Iterable[RecordKey]) -> list[RecordKey]:
        """The keys, in order, that have no stored record yet: the work left when resuming."""
        return [k for k in keys if not self.has_record(k)]

    def records(
        self,
        run_id: int | None = None,
        label: str | None = None,
        protocol: str | None = None,
        latest: bool = False,
    ) -> list[Record]:
        """Stored records in insertion order, filtered by run, label and protocol (a protocol name
        or sha). With ``latest=True`` only the newest record of each key is kept (a ``--force``
        re-run replaces the earlier verdict)."""
        return [record for _, record in self.records_with_ids(run_id, label, protocol, latest)]

    def records_with_ids(
        self,
        run_id: int | None = None,
        label: str | None = None,
        protocol: str | None = None,
        latest: bool = False,
    ) -> list[tuple[int, Record]]:
        where: list[str] = []
        params: list[Any] = []
        if run_id is not None:
            where.append("run_id = ?")
            params.append(run_id)
        if label is not None:
            where.append("label = ?")
            params.append(label)
        if protocol is not None:
            where.append("(protocol_sha = ? OR protocol_name = ?)")
            params += [protocol, protocol]
        sql = (
            "SELECT id, json FROM records"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY id"
        )
        rows = [(int(row["id"]), record_from_json(row["json"])) for row in self._conn.execute(sql, params)]
        if latest:
            newest: dict[RecordKey, tuple[int, Record]] = {}
            for row in rows:
                newest.pop(record_key(row[1]), None)
                newest[record_key(row[1])] = row
            rows = sorted(newest.values(), key=lambda r: r[0])
        return rows

    def candidate_source(self, sha: str) -> str | None:
        row = self._conn.execute("SELECT source FROM candidates WHERE sha = ?", (sha,)).fetchone()
        return row["source"] if row else None

    def candidate_sources(self) -> dict[str, str]:
        rows = self._conn.execute("SELECT sha, source FROM candidates WHERE source IS NOT NULL")
        return {row["sha"]: row["source"] for row in rows}

    def timing_samples(self, record_id: int) -> dict[str, list[float]]:
        """Raw samples of one stored record: {which: [ms, ...]} (``candidate`` and each baseline)."""
        out: dict[str, list[float]] = {}
        rows = self._conn.execute(
            "SELECT which, ms FROM timing_samples WHERE record_id = ? ORDER BY which, sample_index",
            (record_id,),
        )
        for row in rows:
            out.setdefault(row["which"], []).append(row["ms"])
        return out

    def findings(self, check: str | None = None, severity: str | None = None) -> list[dict[str, Any]]:
        """Stored findings joined with their record's label and outcome, for hack-pattern queries."""
        sql = (
            "SELECT f.record_id, f.check_name AS check_name, f.severity, f.detail, r.label, r.outcome"
            " FROM findings f JOIN records r ON r.id = f.record_id WHERE 1=1"
        )
        params: list[Any] = []
        if check is not None:
            sql += " AND f.check_name = ?"
            params.append(check)
        if severity is not None:
            sql += " AND f.severity = ?"
            params.append(severity)
        return [dict(row) for row in self._conn.execute(sql + " ORDER BY f.record_id", params)]

    # -- export / import

    def export_jsonl(self, path: str | Path, records: Sequence[Record] | None = None) -> int:
        """Write one ``Record.to_json()`` line per record (default: all); return the count."""
        records = self.records() if records is None else records
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            for record in records:
                fh.write(record.to_json() + "\n")
        return len(records)

    def export_csv(
        self, path: str | Path, records: Sequence[Record] | None = None, run_id: int | None = None
    ) -> int:
        """Write a flat table, one row per record, with a ``speedup_<baseline>`` column for every
        baseline seen; return the count. ``record_id`` is the id ``kbv explain ID`` takes (empty for
        ``records`` given by the caller, which carry no id); ``run_id`` keeps one run's records."""
        if records is None:
            with_ids: list[tuple[int | None, Record]] = list(self.records_with_ids(run_id=run_id))
        else:
            with_ids = [(None, r) for r in records]
        records = [r for _, r in with_ids]
        baselines = sorted({b for r in records for b in (r.speedup or {}) if b != "best"})
        columns = [
            "record_id",
            "label",
            "problem",
            "level",
            "problem_sha256",
            "candidate_path",
            "candidate_sha256",
            "sample",
            "protocol",
            "protocol_sha256",
            "device",
            "outcome",
            "correct",
            "speedup_best",
            *(f"speedup_{b}" for b in baselines),
            "candidate_peak_bytes",
            "baseline_peak_bytes",
            "candidate_host_peak_bytes",
            "reference_host_peak_bytes",
            "host_ratio",
            "fail_checks",
            "kbv_version",
            "torch_version",
            "created_at",
        ]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            for record_id, r in with_ids:
                memory = r.memory or {}
                row = {
                    "record_id": record_id,
                    "label": label_of(r),
                    "problem": r.problem.get("name"),
                    "level": r.problem.get("level"),
                    "problem_sha256": r.problem.get("source_sha256"),
                    "candidate_path": r.candidate.get("path"),
                    "candidate_sha256": r.candidate.get("source_sha256"),
                    "sample": sample_index(r),
                    "protocol": r.protocol.get("name"),
                    "protocol_sha256": r.protocol.get("sha256"),
                    "device": (r.device or {}).get("name"),
                    "outcome": r.outcome,
                    "correct": bool(r.correct),
                    "speedup_best": as_number((r.speedup or {}).get("best")),
                    "candidate_peak_bytes": memory.get("candidate_peak_bytes"),
                    "baseline_peak_bytes": memory.get("baseline_peak_bytes"),
                    "candidate_host_peak_bytes": memory.get("candidate_host_peak_bytes"),
                    "reference_host_peak_bytes": memory.get("reference_host_peak_bytes"),
                    "host_ratio": as_number(memory.get("host_ratio")),
                    "fail_checks": ";".join(fail_findings(r)),
                    "kbv_version": (r.versions or {}).get("kbv"),
                    "torch_version": (r.versions or {}).get("torch"),
                    "created_at": r.created_at,
                }
                row.update({f"speedup_{b}": as_number(r.speedup.get(b)) for b in baselines})
                writer.writerow(row)
        return len(records)

    def import_jsonl(
        self, path: str | Path, label: str | None = None, force: bool = False
    ) -> tuple[int, int]:
        """Add the records of a JSONL file under a new ``import`` run. Records whose key is
        already stored are skipped unless ``force``. Returns (imported, skipped)."""
        path = Path(path)
        run_id = self.start_run("import", {"file": str(path), "label": label, "force": force})
        imported = skipped = 0
        try:
            with path.open(encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = record_from_json(line)
                    except (ValueError, TypeError, KeyError) as exc:
                        raise StoreError(f"{path}:{number}: not a kbv record ({exc})") from exc
                    if not force and self.has_record(record):
                        skipped += 1
                        continue
                    self.add_record(record, run_id, label)
                    imported += 1
        except BaseException:
            self.finish_run(run_id, "failed")
            raise
        self.finish_run(run_id)
        return imported, skipped


def _insert_pair_parts(
    conn: sqlite3.Connection, stored: Record, key: RecordKey, source: str | None, label: str | None
) -> None:
    """The problem, candidate and protocol rows a record points to; rows already there keep what
    they hold (a candidate's source or label is only filled in where it was missing)."""
    problem, candidate = stored.problem, stored.candidate
    conn.execute(
        "INSERT OR IGNORE INTO problems(sha, name, level, path) VALUES (?, ?, ?, ?)",
        (key[0], problem.get("name"), problem.get("level"), problem.get("path")),
    )
    conn.execute(
        "INSERT INTO candidates(sha, path, source, label) VALUES (?, ?, ?, ?) ON "
        "CONFLICT(sha) DO UPDATE"
        " SET source = coalesce(candidates.source, excluded.source),"
        " label = coalesce(candidates.label, excluded.label)",
        (key[1], candidate.get("path"), source, label),
    )
    conn.execute(
        "INSERT INTO protocols(sha, name, version, settings) VALUES (?, ?, ?, ?) ON CONFLICT(sha) DO NOTHING",
        (
            key[2],
            stored.protocol.get("name"),
            stored.protocol.get("version"),
            json.dumps(stored.protocol["settings"], sort_keys=True)
            if stored.protocol.get("settings")
            else None,
        ),
    )


def _insert_record_row(
    conn: sqlite3.Connection, stored: Record, key: RecordKey, run_id: int | None, label: str | None
) -> int:
    """The record's own row (its indexed columns and its JSON); returns its id."""
    cur = conn.execute(
        "INSERT INTO records(run_id, problem_sha, candidate_sha, protocol_sha, "
        "protocol_name, device_name, kbv_version, torch_version, outcome, correct, "
        "speedup_best, label, created_at, level, json, candidate_path)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            run_id,
            *key[:3],
            stored.protocol.get("name"),
            key[3],
            key[4],
            key[5],
            stored.outcome,
            int(bool(stored.correct)),
            speedup_of(stored),
            label,
            stored.created_at or now_iso(),
            stored.problem.get("level"),
            stored.to_json(),
            key.candidate_path,
        ),
    )
    return int(cur.lastrowid or 0)


def _insert_record_details(conn: sqlite3.Connection, stored: Record, record_id: int) -> None:
    """The record's timing samples and findings, one row each, for queries across records."""
    conn.executemany(
        "INSERT INTO timing_samples(record_id, which, sample_index, ms) VALUES (?, ?, ?, ?)",
        [(record_id, which, i, ms) for which, i, ms in _timing_samples(stored)],
    )
    conn.executemany(
        "INSERT INTO findings(record_id, check_name, severity, detail) VALUES (?, ?, ?, ?)",
        [(record_id, f.check, f.severity, f.detail) for f in stored.findings],
    )
