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
`synchronous="FULL"` for that). One broker per database: the store holds an exclusive lock on
`<file>.lock` while open, so a second broker is refused; readers of other processes (`backup`,
`open(read_only=True)`) may read alongside it.

Faults, each its own error (`broker.state.errors`): a full disk is `StoreFullError`, a file or
connection that refuses writes `StoreReadOnlyError` — in both cases nothing of the failed
transaction is written. At open the file is checked (`PRAGMA quick_check`, linear in the
file's size) and a damaged one refused with `StoreDamagedError`, one line naming the
file and the first problem. A broker that stopped without closing the file (a crash) leaves
its `-wal` beside it; if the next open finds the file marked open but no `-wal`, commits made
after the last checkpoint may be lost (the file was copied alone): it logs a warning. Copy a
store with `backup` (`gpufed broker backup`), never the file alone.

Watchers are woken in-process on every commit; nothing polls. Leases are in memory only:
keys attached to a lease are deleted when it is revoked and when the store is next opened
(the process that held the lease is gone), never on a timer.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import errno
import fcntl
import itertools
import logging
import os
import sqlite3
import time
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
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 1), ('oldest', 1), ('open', 0);
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


CHECK_PROBLEMS = 5  # quick_check stops after this many


def store_error(path: str, exc: sqlite3.Error) -> errors.StoreError:
    """The store's error for what sqlite raised: retryable, full, read-only, damaged or other."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return errors.TemporaryStoreError(f"sqlite {path}: {exc}")
    if primary == sqlite3.SQLITE_FULL:
        return errors.StoreFullError(f"sqlite store {path} is full: {exc}")
    if primary == sqlite3.SQLITE_READONLY:
        return errors.StoreReadOnlyError(f"sqlite store {path} is read-only: {exc}")
    if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return errors.StoreDamagedError(
            f"sqlite store {path} is damaged ({exc}); restore it from a backup"
        )
    if primary == sqlite3.SQLITE_CANTOPEN:
        return errors.StoreError(f"sqlite store {path} cannot be opened: {exc}")
    return errors.StoreError(f"sqlite {path}: {exc}")


def check_integrity(conn: sqlite3.Connection, path: str) -> None:
    """StoreDamagedError naming the first problem `PRAGMA quick_check` finds, if any.

    quick_check reads every page of every table (O(size)); integrity_check would also compare
    indexes with their tables, and our tables have none beyond their keys: it would take
    longer and find nothing more.
    """
    try:
        rows = conn.execute(f"PRAGMA quick_check({CHECK_PROBLEMS})").fetchall()
    except sqlite3.DatabaseError as exc:  # some damage stops the check itself
        if not isinstance(store_error(path, exc), errors.StoreDamagedError):
            raise
        rows = [(str(exc),)]
    problems = [str(row[0]) for row in rows]
    if problems == ["ok"]:
        return
    first = " ".join(problems[0].replace("*** in database main ***", "").split())
    more = f", and {len(problems) - 1} more problems" if len(problems) > 1 else ""
    raise errors.StoreDamagedError(
        f"sqlite store {path} is damaged (quick_check: {first}{more}); restore it from a backup"
    )


def connect_reader(path: str) -> sqlite3.Connection:
    """A read-only connection to the store at `path` that neither locks a broker out nor
    checkpoints: it may read beside a running broker. On read-only media (where its `-shm`
    cannot be made) a file without a `-wal` is complete and nobody writes it: it is read as
    immutable."""
    uri = Path(path).resolve().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, isolation_level=None, timeout=0.2)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        conn.close()
        if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_CANTOPEN or os.path.exists(f"{path}-wal"):
            raise
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, isolation_level=None)
    return conn


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
        self,
        path: str,
        *,
        synchronous: str = "NORMAL",
        keep_revisions: int = KEEP_REVISIONS,
        read_only: bool = False,
    ) -> None:
        self.path = path
        self.read_only = read_only
        self._synchronous = synchronous
        self._keep_revisions = keep_revisions
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqlite")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._closed = False
        # Owned by the executor thread:
        self._conn: sqlite3.Connection | None = None
        self._lock: int | None = None  # the fd of `<file>.lock`, locked while open
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
        read_only: bool = False,
    ) -> SqliteStore:
        """Open (creating if needed) the database at `path`; `":memory:"` for a throwaway one.

        `read_only`: read an existing store without locking it, also while a broker has it
        open (writes raise StoreReadOnlyError). Raises StoreError (one line naming the file)
        when the file cannot be used: in use, damaged, read-only, not there (`read_only`).
        """
        path = os.fspath(path)
        if path != ":memory:" and not read_only:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise errors.StoreError(
                    f"sqlite store {path}: cannot create its folder: {exc.strerror}"
                ) from exc
        self = cls(
            path, synchronous=synchronous, keep_revisions=keep_revisions, read_only=read_only
        )
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
        except sqlite3.Error as exc:
            raise store_error(self.path, exc) from exc

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
        if self.read_only:
            self._connect_reader()
            return
        on_disk = self.path != ":memory:"
        wal_left = on_disk and os.path.exists(f"{self.path}-wal")
        if on_disk:
            self._take_lock()
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=0.2)
        except sqlite3.Error:
            self._release_lock()
            raise
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            if on_disk:
                started = time.perf_counter()
                check_integrity(conn, self.path)
                log.info(
                    "sqlite store %s checked in %.2f s (quick_check: ok)",
                    self.path,
                    time.perf_counter() - started,
                )
            conn.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
            if on_disk:
                self._mark_open(conn, was_open=bool(meta.get("open")), wal_left=wal_left)
        except BaseException:
            conn.close()
            self._release_lock()
            raise
        self._conn = conn
        self._revision, self._oldest = int(meta["revision"]), int(meta["oldest"])
        orphans = [row[0] for row in conn.execute("SELECT key FROM kv WHERE lease != 0")]
        if orphans:
            log.info("deleting %d keys of leases held by a previous process", len(orphans))
            self._write(compares=(), puts=(), deletes=orphans, lease=_no_lease)

    def _connect_reader(self) -> None:
        if not os.path.isfile(self.path):
            raise errors.StoreError(f"sqlite store {self.path}: no such file")
        conn = connect_reader(self.path)
        try:
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        except sqlite3.OperationalError as exc:
            conn.close()
            if "no such table" in str(exc):
                raise errors.StoreError(f"{self.path} is not a gpufed store") from exc
            raise
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._revision, self._oldest = int(meta["revision"]), int(meta["oldest"])

    def _take_lock(self) -> None:
        """Lock `<file>.lock` (one broker per database) or raise StoreError."""
        lock_path = f"{self.path}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise errors.StoreReadOnlyError(
                    f"sqlite store {self.path} is read-only: cannot create {lock_path}: "
                    f"{exc.strerror}"
                ) from exc
            raise errors.StoreError(f"sqlite store {self.path}: {lock_path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise errors.StoreError(f"{self.path} is in use by another process") from exc
        self._lock = fd

    def _release_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None

    def _mark_open(self, conn: sqlite3.Connection, *, was_open: bool, wal_left: bool) -> None:
        """Mark the file open (in the file itself, past a checkpoint); warn if the previous
        broker did not close it and its `-wal` is gone (the file was copied alone)."""
        if was_open and not wal_left:
            log.warning(
                "sqlite store %s was not closed by the broker that last had it, and its -wal"
                " file is missing: commits made after the last checkpoint may be lost (was the"
                " file copied alone? copy a store with `gpufed broker backup`)",
                self.path,
            )
        conn.execute("UPDATE meta SET value = 1 WHERE name = 'open'")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _disconnect(self) -> None:
        if self._conn is not None:
            if self._lock is not None:  # closed as it should be: the next open knows
                try:
                    self._conn.execute("UPDATE meta SET value = 0 WHERE name = 'open'")
                except sqlite3.Error as exc:
                    log.warning(
                        "sqlite store %s could not be marked closed (%s): its next open may"
                        " warn of a missing -wal, wrongly",
                        self.path,
                        exc,
                    )
            self._conn.close()  # the last connection: sqlite checkpoints and removes the -wal
            self._conn = None
        self._release_lock()

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
            compares=txn.compares, puts=txn.puts, deletes=txn.deletes, lease=txn.lease_of
        )

    def _write(
        self,
        *,
        compares: Sequence[store.Compare],
        puts: Sequence[tuple[str, bytes]],
        deletes: Sequence[str],
        lease: Callable[[str], int],
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
                    (key, value, revision, revision, lease(key)),
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
        self._write(compares=(), puts=(), deletes=keys, lease=_no_lease)


def _no_lease(key: str) -> int:
    return 0
