"""The HistoryStore protocol: finished jobs, kept as JSON with indexed columns, paged.

A record goes in once it is final (`put_many`: idempotent by job id, the last copy put wins)
and comes out by id (`get`) or a page at a time (`page`: newest finished first, filtered by
`query.JobQuery`, continued by an opaque token). `prune` deletes what finished before a time,
in bounded batches, each its own transaction, so writers and readers never wait on a long one.

Each store keeps one row per job: the record's JSON (exactly what the hot store holds,
`records.encode`) and the columns the lists filter, search and sort on: name, tenant, queue, state,
cluster, created, finished (`query.finished_at`), id; and one row per label of the job's
`metadata.labels` for the label selector. Errors are `broker.state.errors` types, chained to
the driver's: `TemporaryStoreError` when the same call may succeed later (a server away, a
busy file, a timeout), `StoreFullError`, `StoreReadOnlyError`, `StoreDamagedError`, else
`StoreError`; a row that does not parse is left out of a page with a warning in the log, and
`get` raises `RecordDamagedError` for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol

import pydantic

from broker.api import status
from broker.state import errors, records
from broker.state.history import query as queries

log = logging.getLogger(__name__)

MAX_PAGE = 1000  # the largest `limit` a page takes
PRUNE_BATCH = 5000  # rows deleted per transaction by `prune`
PUT_BATCH = 5000  # rows written per statement


class Page(NamedTuple):
    """One page: the records, and the token of the next page (None: this was the last)."""

    items: list[status.JobRecord]
    next: str | None


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """A finished record as the stores keep it: its JSON and the indexed columns."""

    id: str
    name: str  # metadata.name, for the text search
    tenant: str
    queue: str
    state: str
    cluster: str | None
    created_us: int
    finished_us: int
    labels: tuple[tuple[str, str], ...]
    record: str  # the JobRecord's JSON

    @classmethod
    def of(cls, record: status.JobRecord) -> HistoryRow:
        """The row of a finished record; ValueError for a job that is not finished."""
        if not record.status.state.terminal:
            raise ValueError(
                f"job {record.id} is {record.status.state}: history holds finished jobs only"
            )
        return cls(
            id=record.id,
            name=record.job.metadata.name,
            tenant=record.tenant,
            queue=record.job.spec.queue,
            state=record.status.state.value,
            cluster=record.status.cluster,
            created_us=queries.to_us(record.created),
            finished_us=queries.to_us(queries.finished_at(record)),
            labels=tuple(sorted(record.job.metadata.labels.items())),
            record=records.encode(record).decode(),
        )

    @property
    def cursor(self) -> queries.Cursor:
        return queries.Cursor(False, self.finished_us, self.id)


def last_copies(rows: Iterable[HistoryRow]) -> list[HistoryRow]:
    """`rows` with one row per job id, the last given (one statement writes a key once)."""
    return list({row.id: row for row in rows}.values())


def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"a page holds 1 to {MAX_PAGE} records, not {limit}")


def parse_rows(rows: Iterable[tuple[str, queries.Cursor]], where: str) -> list[status.JobRecord]:
    """The records of a page's rows (JSON, cursor); a row that does not parse is left out with
    a warning naming the job."""
    parsed = []
    for text, cursor in rows:
        try:
            parsed.append(status.JobRecord.model_validate_json(text))
        except pydantic.ValidationError as exc:
            log.warning(
                "history %s: job %s does not parse, left out of the list: %s",
                where,
                cursor.job_id,
                exc.errors(include_url=False)[:1],
            )
    return parsed


def parse_one(text: str, job_id: str, where: str) -> status.JobRecord:
    try:
        return status.JobRecord.model_validate_json(text)
    except pydantic.ValidationError as exc:
        raise errors.RecordDamagedError(f"history {where}: job {job_id} does not parse") from exc


def make_page(
    rows: Sequence[tuple[str, queries.Cursor]], query: queries.JobQuery, limit: int, where: str
) -> Page:
    """The page of `rows` read (JSON, cursor), `limit + 1` asked: one more than the page, to
    tell whether another follows. The token names the last row of the page, parsed or not."""
    page = rows[:limit]
    token = queries.encode(page[-1][1], query) if len(rows) > limit else None
    return Page(parse_rows(page, where), token)


class HistoryStore(Protocol):
    async def put_many(self, records: Sequence[status.JobRecord]) -> int:
        """Keep these finished records (one transaction; a job already kept is replaced);
        the number of rows written. ValueError, writing nothing, if one is not finished."""
        ...

    async def put_rows(self, rows: Sequence[HistoryRow]) -> int:
        """`put_many` of records already encoded (`HistoryRow.of`): bulk imports."""
        ...

    async def get(self, job_id: str) -> status.JobRecord | None: ...

    async def page(self, query: queries.JobQuery, *, limit: int, cont: str | None = None) -> Page:
        """Up to `limit` (1..MAX_PAGE) records `query` selects, newest finished first (oldest
        first if `query.order` says so), after the position `cont` (a token of an earlier page
        of the same query) names."""
        ...

    async def prune(self, older_than: datetime, *, batch: int = PRUNE_BATCH) -> int:
        """Delete the records that finished before `older_than`, `batch` per transaction;
        the number deleted."""
        ...

    async def count(self) -> int: ...

    async def size_bytes(self) -> int:
        """The space the history takes (SQLite: the file's pages; PostgreSQL: the tables and
        their indexes)."""
        ...

    async def close(self) -> None: ...
