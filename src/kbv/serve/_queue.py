"""The service's request queue: a table of the results database, beside the records it produces.

Every accepted request is a row before the server answers ``202``; a request's record and its
``done`` mark are written in one transaction (``Store.add_record(also=...)``). So a server killed
at any moment and started again finds each request either finished, with exactly one record, or
not, and evaluates those again (``requeue_unfinished``): every accepted request is finished exactly
once. The bearer token is never written here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS serve_requests (
    id TEXT PRIMARY KEY,
    idempotency_key TEXT UNIQUE,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,
    problem TEXT NOT NULL,
    source TEXT NOT NULL,
    protocol TEXT NOT NULL,
    precision TEXT,
    timeout_s REAL,
    label TEXT,
    record_id INTEGER,
    outcome TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    started_at TEXT,
    finished_at TEXT
);
CREATE INDEX IF NOT EXISTS serve_requests_status ON serve_requests(status, created_at);
"""

STATUSES = ("queued", "running", "done", "error")
UNFINISHED = ("queued", "running")


class IdempotencyConflict(ValueError):
    """An idempotency key already names a request with other contents."""


@dataclass(frozen=True)
class NewRequest:
    problem: str
    source: str
    protocol: str
    precision: str | None
    timeout_s: float | None
    label: str
    idempotency_key: str | None = None

    def fingerprint(self) -> str:
        fields = [self.problem, self.source, self.protocol, self.precision, self.timeout_s, self.label]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class RequestQueue:
    """The ``serve_requests`` table of ``db`` (a kbv store, created by :class:`kbv.store.Store`
    first). A short-lived connection per call, so any thread may use it."""

    def __init__(self, db: str | Path) -> None:
        self.db = Path(db)
        with self._connect() as conn:
            conn.executescript(SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(str(self.db), timeout=30.0, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            yield conn
        finally:
            conn.close()

    def add(self, requests: list[NewRequest], bound: int) -> list[tuple[str, bool]] | None:
        """Queue ``requests`` together, all or none: ``[(id, created)]`` (``created`` False where an
        idempotency key named an earlier request), or ``None`` when the new ones would take the
        unfinished requests past ``bound``. Raises :class:`IdempotencyConflict`."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = self._add(conn, requests, bound)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT" if result is not None else "ROLLBACK")
            return result

    def _add(
        self, conn: sqlite3.Connection, requests: list[NewRequest], bound: int
    ) -> list[tuple[str, bool]] | None:
        result: list[tuple[str, bool]] = []
        fresh: list[tuple[str, NewRequest]] = []
        for request in requests:
            known = None
            if request.idempotency_key is not None:
                known = conn.execute(
                    "SELECT id, fingerprint FROM serve_requests WHERE idempotency_key = ?",
                    (request.idempotency_key,),
                ).fetchone()
            if known is not None:
                if known["fingerprint"] != request.fingerprint():
                    raise IdempotencyConflict(
                        f"idempotency key {request.idempotency_key!r} already names request "
                        f"{known['id']} with other contents; use a new key"
                    )
                result.append((str(known["id"]), False))
                continue
            request_id = uuid.uuid4().hex
            fresh.append((request_id, request))
            result.append((request_id, True))
        if fresh and self._unfinished(conn) + len(fresh) > bound:
            return None
        now = _now()
        conn.executemany(
            "INSERT INTO serve_requests(id, idempotency_key, fingerprint, status, problem, source, "
            "protocol, precision, timeout_s, label, created_at)"
            " VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    request_id,
                    r.idempotency_key,
                    r.fingerprint(),
                    r.problem,
                    r.source,
                    r.protocol,
                    r.precision,
                    r.timeout_s,
                    r.label,
                    now,
                )
                for request_id, r in fresh
            ],
        )
        return result

    @staticmethod
    def _unfinished(conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT count(*) FROM serve_requests WHERE status IN ('queued', 'running')")
        return int(row.fetchone()[0])

    def counts(self) -> dict[str, int]:
        with self._connect() as conn:
            rows = conn.execute("SELECT status, count(*) AS n FROM serve_requests GROUP BY status").fetchall()
        found = {str(r["status"]): int(r["n"]) for r in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def requeue_unfinished(self) -> int:
        """At start: requests a killed server was evaluating go back to the queue (their records
        were never committed, so they have none)."""
        with self._connect() as conn:
            cur = conn.execute(
                "UPDATE serve_requests SET status = 'queued', started_at = NULL WHERE status = 'running'"
            )
            return int(cur.rowcount)

    def claim(self, limit: int) -> list[dict[str, Any]]:
        """The oldest ``limit`` queued requests, marked running."""
        if limit <= 0:
            return []
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(
                "SELECT * FROM serve_requests WHERE status = 'queued' ORDER BY created_at, rowid LIMIT ?",
                (limit,),
            ).fetchall()
            conn.executemany(
                "UPDATE serve_requests SET status = 'running', started_at = ?, attempts = attempts + 1 "
                "WHERE id = ?",
                [(_now(), row["id"]) for row in rows],
            )
            conn.execute("COMMIT")
        return [dict(row) for row in rows]

    @staticmethod
    def mark_done(conn: sqlite3.Connection, request_id: str, record_id: int, outcome: str) -> None:
        """Inside the record's transaction (``Store.add_record(also=...)``)."""
        conn.execute(
            "UPDATE serve_requests SET status = 'done', record_id = ?, outcome = ?, finished_at = ? "
            "WHERE id = ? AND status = 'running'",
            (record_id, outcome, _now(), request_id),
        )

    def mark_error(self, request_id: str, message: str) -> None:
        """A harness error (kbv's or the problem's own failure): finished, with no record."""
        with self._connect() as conn:
            conn.execute(
                "UPDATE serve_requests SET status = 'error', error = ?, finished_at = ? WHERE id = ?",
                (message, _now(), request_id),
            )

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM serve_requests WHERE id = ?", (request_id,)).fetchone()
            if row is None:
                return None
            return self._view(conn, row, with_record=True)

    def list(self, status: str | None, limit: int, after: str | None = None) -> list[dict[str, Any]]:
        where, params = [], []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if after is not None:
            where.append("rowid > (SELECT rowid FROM serve_requests WHERE id = ?)")
            params.append(after)
        sql = (
            "SELECT * FROM serve_requests"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY rowid LIMIT ?"
        )
        with self._connect() as conn:
            rows = conn.execute(sql, [*params, limit]).fetchall()
            return [self._view(conn, row, with_record=False) for row in rows]

    @staticmethod
    def _view(conn: sqlite3.Connection, row: sqlite3.Row, with_record: bool) -> dict[str, Any]:
        view: dict[str, Any] = {
            "id": row["id"],
            "status": row["status"],
            "problem": row["problem"],
            "protocol": row["protocol"],
            "precision": row["precision"],
            "label": row["label"],
            "source_sha256": hashlib.sha256(row["source"].encode()).hexdigest(),
            "outcome": row["outcome"],
            "record_id": row["record_id"],
            "error": row["error"],
            "created_at": row["created_at"],
            "finished_at": row["finished_at"],
        }
        if with_record and row["record_id"] is not None:
            found = conn.execute("SELECT json FROM records WHERE id = ?", (row["record_id"],)).fetchone()
            # The stored text is the contract's JSON (NaN and Inf as strings): served as it is.
            view["record"] = json.loads(found["json"]) if found else None
        return view
