"""SqliteStore: the embedded single-replica store, durable on disk.

It keeps etcd's model so the same code runs on both: one global revision bumped by every
write transaction, create/mod revisions per key, compare-and-swap transactions, and a change
log (`changes`) that a watch reads from any revision it still holds. The log keeps the last
`keep_revisions` revisions (at least that many changes); a watch from further back raises
CompactedError.

Every sqlite call runs on one dedicated thread (a single-worker executor) that owns the
connection, so the event loop never blocks and calls are serialised. The database is in WAL
mode with synchronous=NORMAL: a commit returns only after sqlite committed it, and survives a
crash of the process (an OS crash or power cut may lose the last commits; pass
`synchronous="FULL"` for that). The file is locked exclusively: one process per database.

Watchers are woken in-process on every commit; nothing polls. Leases are in memory only:
keys attached to a lease are deleted when it is revoked and when the store is next opened
(the process that held the lease is gone), never on a timer.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import itertools
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from broker.state import errors, store

log = logging.getLogger(__name__)

T = TypeVar("T")

KEEP_REVISIONS = 100_000
COMPACT_EVERY = 1_000
WATCH_BATCH_REVISIONS = 1_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 1), ('oldest', 1);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    create_revision INTEGER NOT NULL,
    mod_revision INTEGER NOT NULL,
    lease INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS changes (
    revision INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT NOT NULL,
    type TEXT NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (revision, seq)
) WITHOUT ROWID;
"""


def end_of_prefix(prefix: str) -> str | None:
    """The smallest key greater than every key starting with `prefix`; None: no bound."""
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if code <= 0x10FFFF:
            chars[-1] = chr(0xE000 if 0xD800 <= code <= 0xDFFF else code)
            return "".join(chars)
        chars.pop()
    return None


def build_range_clause(prefix: str) -> tuple[str, tuple[str, ...]]:
    """SQL condition and parameters selecting the keys under `prefix`."""
    end = end_of_prefix(prefix)
    if end is None:
        return "key >= ?", (prefix,)
    return "key >= ? AND key < ?", (prefix, end)


class SqliteStore(store.Shortcuts):
    """The Store on one sqlite file (or `:memory:`); create it with `await SqliteStore.open()`."""

    def __init__(
        self, path: str, *, synchronous: str = "NORMAL", keep_revisions: int = KEEP_REVISIONS
    ) -> None:
        self.path = path
        self._synchronous = synchronous
        self._keep_revisions = keep_revisions
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqlite")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._closed = False
        # Owned by the executor thread:
        self._conn: sqlite3.Connection | None = None
        self._revision = 0
        self._oldest = 0
        self._leases: dict[int, int] = {}
        self._lease_ids = itertools.count(1)

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        keep_revisions: int = KEEP_REVISIONS,
    ) -> SqliteStore:
        """Open (creating if needed) the database at `path`; `":memory:"` for a throwaway one."""
        path = os.fspath(path)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self = cls(path, synchronous=synchronous, keep_revisions=keep_revisions)
        self._loop = asyncio.get_running_loop()
        try:
            await self._run(self._connect)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        return self

    # -- the Store protocol ------------------------------------------------------------------

    async def get(self, key: str) -> store.Entry | None:
        return await self._run(self._read_entry, key)

    async def list(self, prefix: str) -> tuple[list[store.Entry], int]:
        return await self._run(self._read_range, prefix)

    async def commit(self, txn: store.Txn) -> int:
        store.check_txn(txn)
        return await self._run(self._apply_txn, txn)

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[store.WatchEvent]:
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, not {start_revision}")
        return self._follow_changes(prefix, start_revision)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_watchers()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._disconnect)
        self._executor.shutdown(wait=True)

    # -- DurableStore extras -----------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        return await self._run(self._grant_lease, ttl)

    async def keep_alive(self, lease: int) -> int:
        return await self._run(self._refresh_lease, lease)

    async def revoke_lease(self, lease: int) -> None:
        await self._run(self._revoke_lease, lease)

    async def compact(self, revision: int) -> None:
        await self._run(self._compact, revision)

    # -- event loop side ---------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed:
            raise errors.StoreError(f"sqlite store {self.path} is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise errors.TemporaryStoreError(f"sqlite {self.path}: {exc}") from exc
            raise errors.StoreError(f"sqlite {self.path}: {exc}") from exc
        except sqlite3.Error as exc:
            raise errors.StoreError(f"sqlite {self.path}: {exc}") from exc

    def _wake_watchers(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _follow_changes(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[store.WatchEvent]:
        next_revision = start_revision
        while not self._closed:
            changed = self._changed  # taken before the read: a later commit sets it
            events, next_revision = await self._run(self._read_changes, prefix, next_revision)
            for event in events:
                yield event
            if not events:
                await changed.wait()

    # -- executor thread side ----------------------------------------------------------------

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise errors.StoreError(f"sqlite store {self.path} is not open")
        return self._conn

    def _connect(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0.2)
        try:
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")
        except sqlite3.OperationalError as exc:
            conn.close()
            if "locked" in str(exc):
                raise errors.StoreError(f"{self.path} is in use by another process") from exc
            raise
        self._conn = conn
        meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        self._revision, self._oldest = int(meta["revision"]), int(meta["oldest"])
        orphans = [row[0] for row in conn.execute("SELECT key FROM kv WHERE lease != 0")]
        if orphans:
            log.info("deleting %d keys of leases held by a previous process", len(orphans))
            self._write(compares=(), puts=(), deletes=orphans, lease=0)

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _read_entry(self, key: str) -> store.Entry | None:
        row = self._db.execute(
            "SELECT key, value, mod_revision, create_revision FROM kv WHERE key = ?", (key,)
        ).fetchone()
        return None if row is None else store.Entry(row[0], bytes(row[1]), row[2], row[3])

    def _read_range(self, prefix: str) -> tuple[builtins.list[store.Entry], int]:
        clause, params = build_range_clause(prefix)
        rows = self._db.execute(
            f"SELECT key, value, mod_revision, create_revision FROM kv WHERE {clause} ORDER BY key",
            params,
        ).fetchall()
        entries = [store.Entry(row[0], bytes(row[1]), row[2], row[3]) for row in rows]
        return entries, self._revision

    def _read_changes(self, prefix: str, start: int) -> tuple[builtins.list[store.WatchEvent], int]:
        """Events under `prefix` in revisions [start, start + batch); and the next start."""
        if start < self._oldest:
            raise errors.CompactedError(
                f"revision {start} is compacted; the change log starts at {self._oldest}"
            )
        last = min(self._revision, start + WATCH_BATCH_REVISIONS - 1)
        if last < start:
            return [], start
        clause, params = build_range_clause(prefix)
        rows = self._db.execute(
            "SELECT revision, key, type, value FROM changes"
            f" WHERE revision BETWEEN ? AND ? AND {clause} ORDER BY revision, seq",
            (start, last, *params),
        ).fetchall()
        events = [
            store.WatchEvent(store.EventType(row[2]), row[1], bytes(row[3]), row[0]) for row in rows
        ]
        return events, last + 1

    def _apply_txn(self, txn: store.Txn) -> int:
        if txn.lease is not None and txn.puts and txn.lease not in self._leases:
            raise errors.LeaseExpiredError(f"lease {txn.lease} does not exist")
        return self._write(
            compares=txn.compares, puts=txn.puts, deletes=txn.deletes, lease=txn.lease or 0
        )

    def _write(
        self,
        *,
        compares: Sequence[store.Compare],
        puts: Sequence[tuple[str, bytes]],
        deletes: Sequence[str],
        lease: int,
    ) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            failed = {}
            for compare in compares:
                row = db.execute(
                    "SELECT mod_revision FROM kv WHERE key = ?", (compare.key,)
                ).fetchone()
                current = 0 if row is None else int(row[0])
                if current != compare.mod_revision:
                    failed[compare.key] = current
            if failed:
                raise errors.ConflictError(
                    f"compare failed (key: current revision): {failed}", revisions=failed
                )
            revision = self._revision + 1
            changes: builtins.list[tuple[int, int, str, str, bytes]] = []
            for key, value in puts:
                db.execute(
                    "INSERT INTO kv (key, value, create_revision, mod_revision, lease)"
                    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET"
                    " value = excluded.value, mod_revision = excluded.mod_revision,"
                    " lease = excluded.lease",
                    (key, value, revision, revision, lease),
                )
                changes.append((revision, len(changes), key, store.EventType.PUT.value, value))
            for key in deletes:
                if db.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount:
                    changes.append((revision, len(changes), key, store.EventType.DELETE.value, b""))
            if not changes:
                db.execute("ROLLBACK")
                return self._revision
            db.executemany("INSERT INTO changes VALUES (?, ?, ?, ?, ?)", changes)
            db.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (revision,))
            oldest = self._oldest
            if revision % COMPACT_EVERY == 0:
                oldest = self._trim_log(revision - self._keep_revisions + 1)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._revision, self._oldest = revision, oldest
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_watchers)
        return revision

    def _trim_log(self, oldest: int) -> int:
        """Within a write transaction: drop changes before revision `oldest`; the new oldest."""
        if oldest <= self._oldest:
            return self._oldest
        self._db.execute("DELETE FROM changes WHERE revision < ?", (oldest,))
        self._db.execute("UPDATE meta SET value = ? WHERE name = 'oldest'", (oldest,))
        return oldest

    def _compact(self, revision: int) -> None:
        if revision > self._revision:
            raise ValueError(f"cannot compact at {revision}, beyond revision {self._revision}")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            oldest = self._trim_log(revision)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._oldest = oldest

    def _grant_lease(self, ttl: int) -> int:
        lease = next(self._lease_ids)
        self._leases[lease] = ttl
        return lease

    def _refresh_lease(self, lease: int) -> int:
        if lease not in self._leases:
            raise errors.LeaseExpiredError(f"lease {lease} does not exist")
        return self._leases[lease]

    def _revoke_lease(self, lease: int) -> None:
        if self._leases.pop(lease, None) is None:
            return
        keys = [row[0] for row in self._db.execute("SELECT key FROM kv WHERE lease = ?", (lease,))]
        self._write(compares=(), puts=(), deletes=keys, lease=0)
