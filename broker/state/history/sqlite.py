"""SqliteHistory: the embedded history, a file of its own beside the broker's store.

A file apart (`history.db` beside `broker.db`, `opening.default_history_url`), so the hot
store stays small and quick to check and back up, and a history of millions of rows never
slows its open. WAL mode with synchronous=NORMAL: a write returns once sqlite committed it,
and survives a crash of the process.

Every write runs on one dedicated thread that owns the writing connection (writes are
serialised, as sqlite serialises them anyway); reads run on a small pool of threads with
connections of their own, which in WAL mode read alongside a write without waiting for it,
so a list never queues behind a retirement. `:memory:` (unit tests) reads on the writer.
The event loop never blocks on sqlite.

The page caches (64 MiB the writer's, 16 MiB each reader's) are what keeps puts and pages
quick while the history is busy; once it has had nothing to do for `IDLE_SECONDS`, every
connection gives its cache back (`PRAGMA shrink_memory`, and the broker's collector trims the
freed pages back to the system): up to 96 MiB that a broker holding only its live jobs
would otherwise keep for good once the history has grown past them.

The text index (`sql.SQLITE_TEXT`) is built at the first open of a history that lacks it, in
one transaction with its progress logged: a broker stopped midway leaves the history as it
was, and the next open builds it again.

The planner's statistics are refreshed (`ANALYZE`, sampled, so cheap) at open and
whenever the history has doubled since, so it picks the index of the most selective filter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TypeVar

from broker.api import status
from broker.state import errors
from broker.state import sqlite as sqlite_store
from broker.state.history import protocol, sql
from broker.state.history import query as queries

log = logging.getLogger(__name__)

T = TypeVar("T")

READERS = 2
BUSY_TIMEOUT = 5.0  # seconds a connection waits for another process's lock
ANALYSIS_LIMIT = 1000  # rows sampled per index by ANALYZE
ANALYZE_FLOOR = 1000  # rows put before the first refresh of the statistics
WRITER_CACHE_KIB = 65536  # the writer's page cache: its indexes' hot pages, for the insert rate
READER_CACHE_KIB = 16384
IDLE_SECONDS = 10.0  # no put or read for this long: the connections' caches are given back
SHRINK_WAIT_SECONDS = 5.0  # how long a reader thread waits for the others to shrink theirs
TEXT_BATCH = 50_000  # rowids a statement of the text index's build covers
PROGRESS_SECONDS = 5.0  # how often the build logs how far it is

UPSERT = (
    f"INSERT INTO {sql.HISTORY}"
    " (id, name, tenant, queue, state, cluster, created, finished, record)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET name = excluded.name,"
    " tenant = excluded.tenant, queue = excluded.queue, state = excluded.state,"
    " cluster = excluded.cluster,"
    " created = excluded.created, finished = excluded.finished, record = excluded.record"
)
INSERT_LABEL = f"INSERT INTO {sql.LABELS} (id, key, value, finished) VALUES (?, ?, ?, ?)"
DOOMED = f"SELECT id FROM {sql.HISTORY} WHERE finished < ? ORDER BY finished LIMIT ?"


class SqliteHistory:
    """The history in an SQLite file (or `:memory:`); open with `await SqliteHistory.open`."""

    def __init__(
        self,
        path: str,
        *,
        readers: int,
        synchronous: str,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.path = path
        self.candidates = sql.CANDIDATES  # the most rows a page takes from the text index
        self.walk = sql.WALK  # the rows a page with a text reads before asking the index
        self._synchronous = synchronous
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="history-w")
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        if path != ":memory:" and readers > 0:
            self._readers = concurrent.futures.ThreadPoolExecutor(
                readers, thread_name_prefix="history-r"
            )
        self._conn: sqlite3.Connection | None = None
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._analyzed_rows = 0
        self._put_since_analyze = 0
        self._closed = False
        self.idle_seconds = idle_seconds
        self.shrinks = 0  # times the caches were given back
        self._used_at = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._shrinking: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        path: str,
        *,
        readers: int = READERS,
        synchronous: str = "NORMAL",
        idle_seconds: float = IDLE_SECONDS,
    ) -> SqliteHistory:
        """The history at `path`, created if absent; StoreError naming the file if not."""
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous: OFF, NORMAL, FULL or EXTRA, not {synchronous!r}")
        history = cls(
            path,
            readers=readers,
            synchronous=synchronous.upper(),
            idle_seconds=idle_seconds,
        )
        try:
            await history._write(history._connect)
        except BaseException:
            await history.close()
            raise
        return history

    async def put_many(self, records: Sequence[status.JobRecord]) -> int:
        rows = [protocol.HistoryRow.of(record) for record in records]
        return await self.put_rows(rows)

    async def put_rows(self, rows: Sequence[protocol.HistoryRow]) -> int:
        if not rows:
            return 0
        return await self._write(self._put, protocol.last_copies(rows))

    async def get(self, job_id: str) -> status.JobRecord | None:
        text = await self._read(self._get, job_id)
        return None if text is None else protocol.parse_one(text, job_id, self.path)

    async def page(
        self, query: queries.JobQuery, *, limit: int, cont: str | None = None
    ) -> protocol.Page:
        protocol.check_limit(limit)
        after = queries.decode(cont, query) if cont else None
        if query.text is not None and sql.indexable(query.text):
            rows = await self._read(self._select_text, query, after, limit + 1)
        else:
            statement, params = sql.page_query(sql.SQLITE, query, after, limit + 1)
            rows = await self._read(self._select, statement, params)
        return protocol.make_page(rows, query, limit, self.path)

    async def prune(self, older_than: datetime, *, batch: int = protocol.PRUNE_BATCH) -> int:
        if batch < 1:
            raise ValueError(f"prune batch: at least 1, not {batch}")
        cutoff, total = queries.to_us(older_than), 0
        while True:
            deleted = await self._write(self._prune_batch, cutoff, batch)
            total += deleted
            if deleted < batch:
                return total

    async def count(self) -> int:
        return await self._read(self._count)

    async def size_bytes(self) -> int:
        return await self._read(self._size)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._shrinking is not None:
            await asyncio.gather(self._shrinking, return_exceptions=True)
        loop = asyncio.get_running_loop()
        if self._readers is not None:
            await loop.run_in_executor(None, self._readers.shutdown)
            for conn in self._reader_conns:
                conn.close()
        await loop.run_in_executor(self._writer, self._disconnect)
        self._writer.shutdown(wait=False)

    # -- event loop side ---------------------------------------------------------------------

    async def _write(self, fn: Callable[..., T], *args: object) -> T:
        return await self._run(self._writer, fn, *args)

    async def _read(self, fn: Callable[..., T], *args: object) -> T:
        if self._readers is None:
            return await self._run(self._writer, fn, *args)
        return await self._run(self._readers, fn, *args)

    async def _run(
        self, executor: concurrent.futures.Executor, fn: Callable[..., T], *args: object
    ) -> T:
        if self._closed:
            raise errors.StoreError(f"sqlite history {self.path} is closed")
        loop = asyncio.get_running_loop()
        self._used_at = loop.time()  # the clock of the idle timer
        if self._idle_timer is None:
            self._idle_timer = loop.call_later(self.idle_seconds, self._when_idle)
        try:
            return await loop.run_in_executor(executor, fn, *args)
        except sqlite3.Error as exc:
            raise sqlite_store.store_error(self.path, exc) from exc

    def _when_idle(self) -> None:
        """The idle timer (one armed while the history is used): looks again later while it
        still is, and gives the caches back once it has not been for `idle_seconds`."""
        self._idle_timer = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        left = self._used_at + self.idle_seconds - loop.time()
        if left > 0:
            self._idle_timer = loop.call_later(left, self._when_idle)
        elif self._shrinking is None or self._shrinking.done():
            self._shrinking = loop.create_task(self._shrink(), name="history-shrink")

    async def _shrink(self) -> None:
        """Every connection's page cache given back (each on its own thread). Never raises:
        a cache kept is memory, not an error."""
        loop = asyncio.get_running_loop()
        try:
            shrinking = [loop.run_in_executor(self._writer, self._shrink_writer)]
            if self._readers is not None:
                with self._reader_lock:
                    threads = len(self._reader_conns)
                barrier = threading.Barrier(threads) if threads else None
                shrinking += [
                    loop.run_in_executor(self._readers, self._shrink_reader, barrier)
                    for _ in range(threads)
                ]
            await asyncio.gather(*shrinking)
            self.shrinks += 1
        except Exception as exc:  # sqlite3.Error, a pool shut down by close
            log.debug("sqlite history %s: giving its caches back failed: %s", self.path, exc)

    # -- writer thread -----------------------------------------------------------------------

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise errors.StoreError(f"sqlite history {self.path} is not open")
        return self._conn

    def _connect(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
            conn.executescript(f"BEGIN IMMEDIATE; {sql.SQLITE_SCHEMA} COMMIT;")
            (version,) = conn.execute(
                "SELECT value FROM job_history_meta WHERE name = 'schema'"
            ).fetchone()
            if int(version) > sql.SCHEMA_VERSION:
                raise errors.StoreError(
                    f"sqlite history {self.path} has schema {version}, newer than this"
                    f" broker's {sql.SCHEMA_VERSION}: upgrade the broker"
                )
            if int(version) < sql.SCHEMA_VERSION:
                log.info("sqlite history %s: schema %s, upgrading", self.path, version)
                conn.executescript(f"BEGIN IMMEDIATE; {sql.SQLITE_UPGRADE} COMMIT;")
            for statement in sql.INDEXES:
                conn.execute(statement)
            if conn.execute(sql.SQLITE_TEXT_BUILT).fetchone() is None:
                self._build_text_index(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._analyze()

    def _build_text_index(self, conn: sqlite3.Connection) -> None:
        """The text index and its triggers, filled with every row, in one transaction."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in sql.SQLITE_TEXT:
                conn.execute(statement)
            conn.execute(sql.SQLITE_TEXT_EMPTIED)
            (rows,) = conn.execute(f"SELECT count(*) FROM {sql.HISTORY}").fetchone()
            low, high = conn.execute(f"SELECT min(rowid), max(rowid) FROM {sql.HISTORY}").fetchone()
            began = logged = time.monotonic()
            if rows > TEXT_BATCH:
                log.info("sqlite history %s: building the text index of %d rows", self.path, rows)
            done = 0
            for start in range(low or 0, (high or 0) + 1, TEXT_BATCH):
                done += conn.execute(sql.SQLITE_TEXT_FILL, (start, start + TEXT_BATCH)).rowcount
                if time.monotonic() - logged >= PROGRESS_SECONDS:
                    logged = time.monotonic()
                    log.info("sqlite history %s: text index: %d of %d rows", self.path, done, rows)
            conn.execute(sql.SQLITE_TEXT_DONE)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if rows > TEXT_BATCH:
            log.info(
                "sqlite history %s: text index of %d rows built in %.1f s",
                self.path,
                done,
                time.monotonic() - began,
            )

    def _disconnect(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute("PRAGMA optimize")
            except sqlite3.Error as exc:  # a read-only file: the statistics stay as they were
                log.debug("sqlite history %s: PRAGMA optimize: %s", self.path, exc)
            self._conn.close()
            self._conn = None

    def _shrink_writer(self) -> None:
        if self._conn is not None:
            self._conn.execute("PRAGMA shrink_memory")

    def _analyze(self) -> None:
        db = self._db
        db.execute(f"PRAGMA analysis_limit = {ANALYSIS_LIMIT}")
        db.execute("ANALYZE")
        (self._analyzed_rows,) = db.execute(f"SELECT count(*) FROM {sql.HISTORY}").fetchone()
        self._put_since_analyze = 0

    def _put(self, rows: list[protocol.HistoryRow]) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                UPSERT,
                [
                    (
                        r.id,
                        r.name,
                        r.tenant,
                        r.queue,
                        r.state,
                        r.cluster,
                        r.created_us,
                        r.finished_us,
                        r.record,
                    )
                    for r in rows
                ],
            )
            db.executemany(f"DELETE FROM {sql.LABELS} WHERE id = ?", [(r.id,) for r in rows])
            db.executemany(
                INSERT_LABEL,
                [(r.id, key, value, r.finished_us) for r in rows for key, value in r.labels],
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._put_since_analyze += len(rows)
        if self._put_since_analyze > max(ANALYZE_FLOOR, self._analyzed_rows):
            self._analyze()
        return len(rows)

    def _prune_batch(self, cutoff: int, batch: int) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            doomed = [row[0] for row in db.execute(DOOMED, (cutoff, batch))]
            keys = [(job_id,) for job_id in doomed]
            db.executemany(f"DELETE FROM {sql.LABELS} WHERE id = ?", keys)
            db.executemany(f"DELETE FROM {sql.HISTORY} WHERE id = ?", keys)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return len(doomed)

    # -- reader threads (or the writer's, in memory) -----------------------------------------

    def _reader(self) -> sqlite3.Connection:
        if self._readers is None:
            return self._db
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self.path, isolation_level=None, timeout=BUSY_TIMEOUT, check_same_thread=False
            )
            conn.execute("PRAGMA query_only = 1")
            conn.execute(f"PRAGMA cache_size = -{READER_CACHE_KIB}")
            self._local.conn = conn
            with self._reader_lock:
                self._reader_conns.append(conn)
        return conn

    def _shrink_reader(self, barrier: threading.Barrier | None) -> None:
        """This reader thread's cache given back; then it waits for the others (`barrier`:
        one task per reader thread, each thread holding one until all have run)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.execute("PRAGMA shrink_memory")
        if barrier is not None:  # broken: a thread busy reading, whose cache waits
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(SHRINK_WAIT_SECONDS)

    def _get(self, job_id: str) -> str | None:
        row = (
            self._reader()
            .execute(f"SELECT record FROM {sql.HISTORY} WHERE id = ?", (job_id,))
            .fetchone()
        )
        return None if row is None else str(row[0])

    def _select(self, statement: str, params: list[object]) -> list[tuple[str, queries.Cursor]]:
        rows = self._reader().execute(statement, params).fetchall()
        return [
            (str(text), queries.Cursor(False, int(us), str(job_id))) for text, us, job_id in rows
        ]

    def _select_text(
        self, query: queries.JobQuery, after: queries.Cursor | None, limit: int
    ) -> list[tuple[str, queries.Cursor]]:
        """A page with a text (`sql.py`): the first `walk` rows if `limit` of them hold it,
        else the text index's candidates if they are few (and matches were too sparse in the
        walk to walk on), else the whole walk; one snapshot."""
        conn = self._reader()
        conn.execute("BEGIN")
        try:
            among: list[object] | None = None
            asks = True  # whether to ask the text index
            if self.walk > 0:
                statement, params = sql.walk_query(sql.SQLITE, query, after, limit, walk=self.walk)
                among = [key for (key,) in conn.execute(statement, params)]
                if len(among) < limit:
                    asks = not sql.walks_on(len(among), walked=self.walk, limit=limit)
                    among = None
            if among is None and asks and self.candidates > 0:
                probe = (sql.fts_query(queries.fold(query.text or "")), self.candidates + 1)
                found = conn.execute(sql.SQLITE_TEXT_PROBE, probe).fetchall()
                among = [rowid for (rowid,) in found] if len(found) <= self.candidates else None
            statement, params = sql.page_query(sql.SQLITE, query, after, limit, among=among)
            return self._select(statement, params)
        finally:
            conn.execute("COMMIT")

    def _count(self) -> int:
        (count,) = self._reader().execute(f"SELECT count(*) FROM {sql.HISTORY}").fetchone()
        return int(count)

    def _size(self) -> int:
        conn = self._reader()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        return int(pages) * int(page_size)
