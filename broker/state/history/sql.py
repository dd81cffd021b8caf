"""The history schema and its page query, written once for SQLite and PostgreSQL.

Two tables. `job_history`: one row per finished job, its JSON and the columns lists filter
and sort on, with an index per filter ending in the sort key (`finished, id`), so a page of
any one filter is a range scan of one index that stops after `limit + 1` rows, however deep
the page (the continue token is the sort key, never an offset). `job_history_labels`: one row
per label of a job, with the job's finished time copied, indexed `(key, value, finished, id)`:
a selector `key=value` pages by that index the same way; the other requirements (`!=`, `in`,
`notin`, `key`, `!key`) are checked per row by the `(id, key)` primary key.

The text search (`JobQuery.text`) is `LIKE` (SQLite: ASCII case ignored) or `ILIKE`
(PostgreSQL, "C" collation: ASCII case ignored) of `%text%` on the `name` column and the id,
`%`, `_` and `\\` escaped; no extension (pg_trgm, FTS5) is required. No index serves a
substring, so a page with a text walks the page's index in order and tests each row until it
has `limit + 1`: quick when matches are common, a scan of every row the other filters leave
when they are rare (e2e/README.md gives the figures).

Times are microseconds since the epoch in SQLite (INTEGER) and `timestamptz` in PostgreSQL
(the same microseconds). Text columns compare bytewise in both (SQLite's BINARY, PostgreSQL's
`COLLATE "C"`): the order of ids is the code-point order `query.Cursor` sorts by in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from broker.api import affinity, selectors
from broker.state.history import query as queries

SCHEMA_VERSION = 2  # 2: the `name` column (the job's metadata.name)
HISTORY = "job_history"
LABELS = "job_history_labels"
FILTERED = ("tenant", "queue", "state", "cluster")

SQLITE_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS job_history_meta (
    name TEXT PRIMARY KEY, value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO job_history_meta (name, value) VALUES ('schema', {SCHEMA_VERSION});
CREATE TABLE IF NOT EXISTS {HISTORY} (
    id TEXT NOT NULL PRIMARY KEY,
    name TEXT NOT NULL DEFAULT '',
    tenant TEXT NOT NULL,
    queue TEXT NOT NULL,
    state TEXT NOT NULL,
    cluster TEXT,
    created INTEGER NOT NULL,   -- microseconds since the epoch, UTC
    finished INTEGER NOT NULL,  -- microseconds since the epoch, UTC
    record TEXT NOT NULL        -- the JobRecord's JSON
);
CREATE TABLE IF NOT EXISTS {LABELS} (
    id TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    finished INTEGER NOT NULL,
    PRIMARY KEY (id, key)
) WITHOUT ROWID;
"""

POSTGRES_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS job_history_meta (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO job_history_meta (name, value) VALUES ('schema', {SCHEMA_VERSION})
    ON CONFLICT (name) DO NOTHING;
CREATE TABLE IF NOT EXISTS {HISTORY} (
    id text COLLATE "C" NOT NULL PRIMARY KEY,
    name text COLLATE "C" NOT NULL DEFAULT '',
    tenant text COLLATE "C" NOT NULL,
    queue text COLLATE "C" NOT NULL,
    state text COLLATE "C" NOT NULL,
    cluster text COLLATE "C",
    created timestamptz NOT NULL,
    finished timestamptz NOT NULL,
    record json NOT NULL
);
CREATE TABLE IF NOT EXISTS {LABELS} (
    id text COLLATE "C" NOT NULL,
    key text COLLATE "C" NOT NULL,
    value text COLLATE "C" NOT NULL,
    finished timestamptz NOT NULL,
    PRIMARY KEY (id, key)
);
"""

# From schema 1: the name column, filled from each record's JSON, and the indexes made again
# with it (`INDEXES`, after this): once, at the first open by a broker of schema 2.
_OLD_INDEXES = "".join(
    f"DROP INDEX IF EXISTS {HISTORY}_{column};\n" for column in ("finished", *FILTERED)
)
SQLITE_UPGRADE = f"""
ALTER TABLE {HISTORY} ADD COLUMN name TEXT NOT NULL DEFAULT '';
UPDATE {HISTORY} SET name = coalesce(json_extract(record, '$.job.metadata.name'), '');
{_OLD_INDEXES}UPDATE job_history_meta SET value = {SCHEMA_VERSION} WHERE name = 'schema';
"""
POSTGRES_UPGRADE = f"""
ALTER TABLE {HISTORY} ADD COLUMN IF NOT EXISTS name text COLLATE "C" NOT NULL DEFAULT '';
UPDATE {HISTORY} SET name = coalesce(record->'job'->'metadata'->>'name', '');
{_OLD_INDEXES}UPDATE job_history_meta SET value = {SCHEMA_VERSION} WHERE name = 'schema';
"""

# Each index ends in `name`: a text search tests it in the index, reading a row only when it
# matches (SQLite defers the row's read), not every row it walks (a job's whole JSON each).
INDEXES = [
    f"CREATE INDEX IF NOT EXISTS {HISTORY}_finished ON {HISTORY} (finished, id, name)",
    *(
        f"CREATE INDEX IF NOT EXISTS {HISTORY}_{column} ON {HISTORY} ({column}, finished, id, name)"
        for column in FILTERED
    ),
    f"CREATE INDEX IF NOT EXISTS {LABELS}_value ON {LABELS} (key, value, finished, id)",
]


@dataclass(frozen=True)
class Dialect:
    """How a dialect writes a parameter and passes a time."""

    name: str
    placeholder: Callable[[int], str]  # the n-th parameter (from 1)
    time: Callable[[int], object]  # microseconds → the driver's value for a time column
    record: str  # the record column as the driver should return it (text)
    like: str  # the operator of a substring that ignores (ASCII) case


SQLITE = Dialect("sqlite", lambda _: "?", lambda us: us, "h.record", "LIKE")
POSTGRES = Dialect("postgresql", lambda n: f"${n}", queries.from_us, "h.record::text", "ILIKE")


def like_pattern(text: str) -> str:
    """`%text%` with the pattern characters of `text` escaped (by `\\`, `ESCAPE '\\'`)."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


@dataclass
class Statement:
    dialect: Dialect
    params: list[object] = field(default_factory=list)

    def bind(self, value: object) -> str:
        self.params.append(value)
        return self.dialect.placeholder(len(self.params))

    def bind_all(self, values: list[str]) -> str:
        return ", ".join(self.bind(value) for value in values)


def page_query(
    dialect: Dialect, query: queries.JobQuery, after: queries.Cursor | None, limit: int
) -> tuple[str, list[object]]:
    """The SELECT of one page: `limit` rows of (record, finished, id) in the query's order
    (newest finished first, or oldest), after `after` (None, or a cursor in the live section:
    from the start when newest first, nothing left when oldest first)."""
    statement = Statement(dialect)
    bind = statement.bind
    driving = _driving_label(query.labels)
    order = "l" if driving is not None else "h"  # the index the scan walks
    source = f"{HISTORY} h"
    where: list[str] = []
    if driving is not None:
        source += f" JOIN {LABELS} l ON l.id = h.id"
        where += [f"l.key = {bind(driving.key)}", f"l.value = {bind(next(iter(driving.values)))}"]
    for column in FILTERED:
        value = getattr(query, column)
        if value is not None:
            where.append(f"h.{column} = {bind(str(value))}")
    if query.finished_after is not None:
        where.append(
            f"{order}.finished >= {bind(dialect.time(queries.to_us(query.finished_after)))}"
        )
    if query.finished_before is not None:
        before = dialect.time(queries.to_us(query.finished_before))
        where.append(f"{order}.finished < {bind(before)}")
    newest = query.newest_first
    if after is not None and not after.live:
        time, job_id = bind(dialect.time(after.time_us)), bind(after.job_id)
        beyond = "<" if newest else ">"
        where.append(f"({order}.finished, {order}.id) {beyond} ({time}, {job_id})")
    elif after is not None and not newest:  # oldest first, the reader past history already
        where.append("1 = 0")
    if query.text is not None:
        pattern = like_pattern(queries.fold(query.text))
        where.append(
            f"(h.name {dialect.like} {bind(pattern)} ESCAPE '\\'"
            f" OR h.id {dialect.like} {bind(pattern)} ESCAPE '\\')"
        )
    for requirement in query.labels:
        if requirement is not driving:
            where.append(_label_clause(statement, requirement))
    direction = "DESC" if newest else "ASC"
    sql = (
        f"SELECT {dialect.record}, h.finished, h.id FROM {source}"
        f" WHERE {' AND '.join(where) or 'TRUE'}"
        f" ORDER BY {order}.finished {direction}, {order}.id {direction} LIMIT {bind(limit)}"
    )
    return sql, statement.params


def _driving_label(selector: selectors.Selector) -> affinity.Requirement | None:
    """The first `key=value` requirement: its index orders the page."""
    for requirement in selector:
        if requirement.operator is affinity.Operator.IN and len(requirement.values) == 1:
            return requirement
    return None


def _label_clause(statement: Statement, requirement: affinity.Requirement) -> str:
    operator = affinity.Operator
    probe = (
        f"SELECT 1 FROM {LABELS} x WHERE x.id = h.id AND x.key = {statement.bind(requirement.key)}"
    )
    if requirement.operator in (operator.IN, operator.NOT_IN):
        probe += f" AND x.value IN ({statement.bind_all(sorted(requirement.values))})"
    elif requirement.operator not in (operator.EXISTS, operator.DOES_NOT_EXIST):
        raise ValueError(f"a job label selector takes no {requirement.operator}")
    negated = requirement.operator in (operator.NOT_IN, operator.DOES_NOT_EXIST)
    return f"{'NOT ' if negated else ''}EXISTS ({probe})"
