"""PostgresHistory: the history in PostgreSQL (asyncpg), for replicated brokers.

Every broker replica reads and writes the same tables; the schema is created at open, under
a transaction-scoped advisory lock so replicas starting together do not race. A put is one
transaction of a few array-bound statements (`unnest`), thousands of rows each; a prune
deletes in batches of its own transactions, and two replicas pruning at once only skip rows
the other took. Records are `json`, the text exactly as put (an operator may still query it
with `->`): `jsonb` would cost its conversion on every read, and hands back its keys
reordered, which pydantic reads several times slower than keys in its fields' order.

The text index needs the `pg_trgm` extension (PostgreSQL's contrib, in Debian's `postgresql`
package; not in every build). At open the store creates it if it may (it is a trusted
extension: the database's owner or a role with CREATE on it may) and builds the GIN index
(`sql.text_index_sql`) with its progress logged, in the schema's transaction: writers wait for
the build, and a build cut short leaves the table as it was. Without the extension a page with
a text walks its filter's index as before, and the open says once, in the log, what to run.

Errors (`errors_of`): the server away, a connection lost, a timeout, a serialization failure
or deadlock, too many connections are `TemporaryStoreError`; a full disk `StoreFullError`;
a read-only server (a standby) `StoreReadOnlyError`; corruption `StoreDamagedError`; bad
credentials or a database that does not exist are a plain (permanent) `StoreError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from broker.api import status
from broker.state import errors
from broker.state.history import protocol, sql
from broker.state.history import query as queries

log = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_TIMEOUT = 10.0
COMMAND_TIMEOUT = 30.0
POOL_SIZE = 4
SCHEMA_LOCK = 0x67707566_6564  # "gpufed": the advisory lock held while creating the schema
INDEX_TIMEOUT = 3600.0  # seconds the text index's build may take at open
PROGRESS_SECONDS = 10.0  # how often the build logs how far it is
EXTENSION = """
SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
WHERE e.extname = 'pg_trgm'
"""
PROGRESS = f"""
SELECT phase, blocks_done, blocks_total, tuples_done, tuples_total
FROM pg_stat_progress_create_index WHERE relid = '{sql.HISTORY}'::regclass
"""

UPSERT = f"""
INSERT INTO {sql.HISTORY} (id, tenant, queue, state, cluster, created, finished, record, name)
SELECT u.id, u.tenant, u.queue, u.state, u.cluster, u.created, u.finished, u.record::json, u.name
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
            $6::timestamptz[], $7::timestamptz[], $8::text[], $9::text[])
    AS u(id, tenant, queue, state, cluster, created, finished, record, name)
ON CONFLICT (id) DO UPDATE SET name = excluded.name, tenant = excluded.tenant,
    queue = excluded.queue,
    state = excluded.state, cluster = excluded.cluster, created = excluded.created,
    finished = excluded.finished, record = excluded.record
"""
INSERT_LABELS = f"""
INSERT INTO {sql.LABELS} (id, key, value, finished)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[])
"""
DELETE_LABELS = f"DELETE FROM {sql.LABELS} WHERE id = ANY($1::text[])"
PRUNE = f"""
DELETE FROM {sql.HISTORY} WHERE id IN (
    SELECT id FROM {sql.HISTORY} WHERE finished < $1 ORDER BY finished LIMIT $2
) RETURNING id
"""
SIZE = f"SELECT pg_total_relation_size('{sql.HISTORY}') + pg_total_relation_size('{sql.LABELS}')"

TEMPORARY_STATES = {"57P01", "57P02", "57P03", "53300", "53200", "40001", "40P01", "57014", "55P03"}
DAMAGED_STATES = {"XX001", "XX002"}


def errors_of(where: str, exc: BaseException) -> errors.StoreError:
    """The store's error for what asyncpg (or the socket under it) raised."""
    state = getattr(exc, "sqlstate", None)
    detail = f"postgresql history {where}: {type(exc).__name__}: {exc}"
    if isinstance(state, str):
        if state.startswith("08") or state in TEMPORARY_STATES:
            return errors.TemporaryStoreError(detail)
        if state == "53100":
            return errors.StoreFullError(detail)
        if state == "25006":
            return errors.StoreReadOnlyError(detail)
        if state in DAMAGED_STATES:
            return errors.StoreDamagedError(detail)
        return errors.StoreError(detail)
    if isinstance(exc, OSError | TimeoutError | asyncpg.exceptions.ConnectionDoesNotExistError):
        return errors.TemporaryStoreError(detail)
    return errors.StoreError(detail)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return dsn
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


class PostgresHistory:
    """The history in a PostgreSQL database; open with `await PostgresHistory.connect(dsn)`."""

    def __init__(self, pool: Any, where: str) -> None:
        self._pool = pool
        self.where = where
        self._closed = False
        self.candidates = sql.CANDIDATES  # the most rows a page takes from the text index
        self.walk = sql.WALK  # the rows a page with a text reads before asking the index
        self.text_indexed = False  # whether the text index is there (pg_trgm installed)

    @classmethod
    async def connect(cls, dsn: str, *, pool_size: int = POOL_SIZE) -> PostgresHistory:
        """The history in the database `dsn` names, its tables created if absent."""
        where = redact(dsn)
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=1,
                max_size=pool_size,
                timeout=CONNECT_TIMEOUT,
                command_timeout=COMMAND_TIMEOUT,
            )
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise errors_of(where, exc) from exc
        except ValueError as exc:  # asyncpg's reading of the DSN
            raise errors.StoreError(f"postgresql history {where}: {exc}") from exc
        history = cls(pool, where)
        try:
            await history._call(history._create_schema)
        except BaseException:
            await history.close()
            raise
        return history

    async def put_many(self, records: Sequence[status.JobRecord]) -> int:
        return await self.put_rows([protocol.HistoryRow.of(record) for record in records])

    async def put_rows(self, rows: Sequence[protocol.HistoryRow]) -> int:
        if not rows:
            return 0
        return await self._call(self._put, protocol.last_copies(rows))

    async def get(self, job_id: str) -> status.JobRecord | None:
        query = f"SELECT record::text FROM {sql.HISTORY} WHERE id = $1"
        text = await self._call(lambda conn: conn.fetchval(query, job_id))
        return None if text is None else protocol.parse_one(text, job_id, self.where)

    async def page(
        self, query: queries.JobQuery, *, limit: int, cont: str | None = None
    ) -> protocol.Page:
        protocol.check_limit(limit)
        after = queries.decode(cont, query) if cont else None
        if query.text is not None and sql.indexable(query.text) and self.text_indexed:
            found = await self._call(self._select_text, query, after, limit + 1)
        else:
            statement, params = sql.page_query(sql.POSTGRES, query, after, limit + 1)
            found = await self._call(lambda conn: conn.fetch(statement, *params))
        rows = [
            (str(text), queries.Cursor(False, queries.to_us(finished), str(job_id)))
            for text, finished, job_id in found
        ]
        return protocol.make_page(rows, query, limit, self.where)

    async def prune(self, older_than: datetime, *, batch: int = protocol.PRUNE_BATCH) -> int:
        if batch < 1:
            raise ValueError(f"prune batch: at least 1, not {batch}")
        cutoff, total = queries.from_us(queries.to_us(older_than)), 0  # aware, in UTC
        while True:
            deleted = await self._call(self._prune_batch, cutoff, batch)
            total += deleted
            if deleted < batch:
                return total

    async def count(self) -> int:
        query = f"SELECT count(*) FROM {sql.HISTORY}"
        return int(await self._call(lambda conn: conn.fetchval(query)))

    async def size_bytes(self) -> int:
        return int(await self._call(lambda conn: conn.fetchval(SIZE)))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._pool.close(), CONNECT_TIMEOUT)
        except (TimeoutError, asyncpg.InterfaceError, OSError):
            self._pool.terminate()

    # -- on a pooled connection --------------------------------------------------------------

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        if self._closed:
            raise errors.StoreError(f"postgresql history {self.where} is closed")
        try:
            async with self._pool.acquire() as conn:
                return await fn(conn, *args)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise errors_of(self.where, exc) from exc

    async def _create_schema(self, conn: Any) -> None:
        async with conn.transaction():
            await conn.execute(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")
            await conn.execute(sql.POSTGRES_SCHEMA)
            version = await conn.fetchval(
                "SELECT value FROM job_history_meta WHERE name = 'schema'"
            )
            if int(version) > sql.SCHEMA_VERSION:
                raise errors.StoreError(
                    f"postgresql history {self.where} has schema {version}, newer than this"
                    f" broker's {sql.SCHEMA_VERSION}: upgrade the broker"
                )
            if int(version) < sql.SCHEMA_VERSION:
                await conn.execute(sql.POSTGRES_UPGRADE)
            for statement in sql.INDEXES:
                await conn.execute(statement)
            self.text_indexed = await self._create_text_index(conn)

    async def _create_text_index(self, conn: Any) -> bool:
        """The text index, built if absent; False (and a log line) without pg_trgm."""
        extension_schema = await conn.fetchval(EXTENSION)
        if extension_schema is None:
            try:
                async with conn.transaction():  # a savepoint: a refusal leaves the rest
                    await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
            except asyncpg.PostgresError as exc:
                log.warning(
                    "postgresql history %s: no text index, a text search reads every row its"
                    " filters leave (%s: %s): have a superuser run `CREATE EXTENSION pg_trgm`"
                    " in this database (the package of PostgreSQL's contrib modules has it)",
                    self.where,
                    type(exc).__name__,
                    exc,
                )
                return False
            extension_schema = await conn.fetchval(EXTENSION)
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", sql.TEXT)
        if exists:
            return True
        rows = await conn.fetchval(  # -1: never analyzed
            "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = $1::regclass",
            sql.HISTORY,
        )
        log.info("postgresql history %s: building the text index (about %d rows)", self.where, rows)
        loop = asyncio.get_running_loop()
        began = loop.time()
        watching = asyncio.create_task(self._log_progress())
        try:
            await conn.execute(sql.text_index_sql(extension_schema), timeout=INDEX_TIMEOUT)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        log.info(
            "postgresql history %s: text index built in %.1f s", self.where, loop.time() - began
        )
        return True

    async def _log_progress(self) -> None:
        """How far the index's build is, every PROGRESS_SECONDS, from another connection."""
        while True:
            await asyncio.sleep(PROGRESS_SECONDS)
            try:
                async with self._pool.acquire() as conn:
                    row = await conn.fetchrow(PROGRESS)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                log.debug("postgresql history %s: index progress: %s", self.where, exc)
                continue
            if row is not None:
                log.info(
                    "postgresql history %s: text index: %s, blocks %s of %s, tuples %s of %s",
                    self.where,
                    *row,
                )

    async def _select_text(
        self, conn: Any, query: queries.JobQuery, after: queries.Cursor | None, limit: int
    ) -> list[Any]:
        """A page with a text (`sql.py`): the first `walk` rows if `limit` of them hold it,
        else the text index's candidates if they are few (and matches were too sparse in the
        walk to walk on), else the walk of every row; the walks read the index only, and the
        page is then read from the rows found by bitmap scans (the planner would otherwise
        walk the page's index for a few ids, as a LIMIT tempts it to). One snapshot."""
        only_bitmaps = "SET LOCAL enable_seqscan = off; SET LOCAL enable_indexscan = off"
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            among: list[object] | None = None
            asks = True  # whether to ask the text index
            if self.walk > 0:
                among = await self._walk(conn, query, after, limit, self.walk)
                if len(among) < limit:
                    asks = not sql.walks_on(len(among), walked=self.walk, limit=limit)
                    among = None
            if among is None and asks and self.candidates > 0:
                pattern = sql.like_pattern(queries.fold(query.text or ""))
                await conn.execute(only_bitmaps)
                found = await conn.fetch(sql.POSTGRES_TEXT_PROBE, pattern, self.candidates + 1)
                await conn.execute("RESET enable_seqscan; RESET enable_indexscan")
                among = [row[0] for row in found] if len(found) <= self.candidates else None
            if among is None:
                among = await self._walk(conn, query, after, limit, None)
            await conn.execute(only_bitmaps)
            statement, params = sql.page_query(sql.POSTGRES, query, after, limit, among=among)
            rows: list[Any] = await conn.fetch(statement, *params)
            return rows

    async def _walk(
        self,
        conn: Any,
        query: queries.JobQuery,
        after: queries.Cursor | None,
        limit: int,
        walk: int | None,
    ) -> list[object]:
        statement, params = sql.walk_query(sql.POSTGRES, query, after, limit, walk=walk)
        return [row[0] for row in await conn.fetch(statement, *params)]

    async def _put(self, conn: Any, rows: list[protocol.HistoryRow]) -> int:
        async with conn.transaction():
            for start in range(0, len(rows), protocol.PUT_BATCH):
                chunk = rows[start : start + protocol.PUT_BATCH]
                ids = [row.id for row in chunk]
                await conn.execute(
                    UPSERT,
                    ids,
                    [row.tenant for row in chunk],
                    [row.queue for row in chunk],
                    [row.state for row in chunk],
                    [row.cluster for row in chunk],
                    [queries.from_us(row.created_us) for row in chunk],
                    [queries.from_us(row.finished_us) for row in chunk],
                    [row.record for row in chunk],
                    [row.name for row in chunk],
                )
                await conn.execute(DELETE_LABELS, ids)
                labels = [(row, key, value) for row in chunk for key, value in row.labels]
                if labels:
                    await conn.execute(
                        INSERT_LABELS,
                        [row.id for row, _, _ in labels],
                        [key for _, key, _ in labels],
                        [value for _, _, value in labels],
                        [queries.from_us(row.finished_us) for row, _, _ in labels],
                    )
        return len(rows)

    async def _prune_batch(self, conn: Any, older_than: datetime, batch: int) -> int:
        async with conn.transaction():
            doomed = [row[0] for row in await conn.fetch(PRUNE, older_than, batch)]
            if doomed:
                await conn.execute(DELETE_LABELS, doomed)
        return len(doomed)
