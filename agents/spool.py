"""A crash-safe, bounded, ordered on-disk queue for whatever must reach the control plane.

Both the training hooks (step reports, events, checkpoint commits) and the node agent
(heartbeats, telemetry, exits) write here first and deliver from here, so a control-plane outage
or a crash of the process loses nothing that was appended: records come back after a reopen, in
the order they were appended, until the sender acknowledges them.

Bounding: when more than ``max_records`` are held, the oldest records whose kind is *droppable*
(for instance per-step telemetry, where a gap is tolerable) are deleted and counted per kind.
Records of other kinds (events, checkpoint commits, exits) are never dropped, so the bound can be
exceeded when nothing droppable is left; that is deliberate: losing an exit code or a checkpoint
commit is worse than a larger file.

Idempotency: ``append`` with a ``key`` that is already present is ignored. A key is only
remembered while its record is held; once acknowledged it can be appended again, which is why
the server deduplicates as well (on job, generation, rank, step).

Storage is stdlib ``sqlite3`` in WAL mode with ``synchronous=NORMAL``: a committed append
survives the process being killed; an operating-system crash may lose the last few appends.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Collection
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: ids never reused, so order survives acks
    kind TEXT NOT NULL,
    key TEXT UNIQUE,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_kind ON records (kind, id);
CREATE TABLE IF NOT EXISTS drops (kind TEXT PRIMARY KEY, count INTEGER NOT NULL);
"""


class Spool:
    """An ordered queue of JSON records on disk; safe to share between threads of one process."""

    def __init__(self, path: str | os.PathLike[str], *, max_records: int,
                 droppable_kinds: frozenset[str] = frozenset()):
        if max_records < 1:
            raise ValueError("max_records must be at least 1")
        self.path = os.fspath(path)
        self.max_records = max_records
        self.droppable_kinds = frozenset(droppable_kinds)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so an append and the drops it
        # causes are one transaction.
        self._db: sqlite3.Connection | None = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        # Counted once here and kept in memory, so append never runs COUNT(*).
        self._count = self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0]

    def append(self, kind: str, record: dict[str, Any], key: str | None = None) -> bool:
        """Queue ``record``; False when a record with the same ``key`` is already held."""
        body = json.dumps(record, allow_nan=False, separators=(",", ":"))
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                cursor = db.execute("INSERT OR IGNORE INTO records (kind, key, body) VALUES (?, ?, ?)",
                                    (kind, key, body))
                stored = cursor.rowcount == 1
                if stored:
                    self._count += 1
                    if self._count > self.max_records:
                        self._drop_oldest(db, self._count - self.max_records)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                self._count = db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
                raise
            return stored

    def peek(self, limit: int, kinds: Collection[str] | None = None) -> list[tuple[int, str, dict[str, Any]]]:
        """Up to ``limit`` held records, oldest first, as (id, kind, record); only those of ``kinds``
        when given (a lane: the records of those kinds keep their order among themselves)."""
        where, params = _kinds_clause(kinds)
        with self._lock:
            rows = self._conn().execute(
                f"SELECT id, kind, body FROM records {where} ORDER BY id LIMIT ?",  # noqa: S608 - only '?' marks
                (*params, limit)).fetchall()
        return [(row_id, kind, json.loads(body)) for row_id, kind, body in rows]

    def ack(self, upto_id: int, kinds: Collection[str] | None = None) -> None:
        """Forget every record with id <= ``upto_id`` (they were delivered); only those of ``kinds``
        when given, so that one lane's delivery never forgets another lane's records."""
        where, params = _kinds_clause(kinds)
        with self._lock:
            db = self._conn()
            removed = db.execute(f"DELETE FROM records {where} {'AND' if where else 'WHERE'} id <= ?",  # noqa: S608
                                 (*params, upto_id)).rowcount
            self._count -= removed

    @property
    def dropped(self) -> dict[str, int]:
        """How many records of each droppable kind were dropped to respect the bound, ever."""
        with self._lock:
            return dict(self._conn().execute("SELECT kind, count FROM drops").fetchall())

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"spool {self.path} is closed")
        return self._db

    def _drop_oldest(self, db: sqlite3.Connection, excess: int) -> None:
        if not self.droppable_kinds:
            return
        marks = ",".join("?" * len(self.droppable_kinds))
        victims = db.execute(
            f"SELECT id, kind FROM records WHERE kind IN ({marks}) ORDER BY id LIMIT ?",  # noqa: S608 - only '?' marks
            (*sorted(self.droppable_kinds), excess)).fetchall()
        if not victims:
            return
        per_kind: dict[str, int] = {}
        for _, kind in victims:
            per_kind[kind] = per_kind.get(kind, 0) + 1
        db.executemany("DELETE FROM records WHERE id = ?", [(row_id,) for row_id, _ in victims])
        db.executemany(
            "INSERT INTO drops (kind, count) VALUES (?, ?) "
            "ON CONFLICT(kind) DO UPDATE SET count = count + excluded.count",
            list(per_kind.items()))
        self._count -= len(victims)


def _kinds_clause(kinds: Collection[str] | None) -> tuple[str, tuple[str, ...]]:
    if kinds is None:
        return "", ()
    if not kinds:
        raise ValueError("a lane needs at least one kind")
    ordered = tuple(sorted(kinds))
    return f"WHERE kind IN ({','.join('?' * len(ordered))})", ordered
