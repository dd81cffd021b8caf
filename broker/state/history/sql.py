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
`%`, `_` and `\\` escaped: that test decides every answer. A trigram index of the name and the
id finds the candidates when it can: SQLite's FTS5 `trigram` table `job_history_text` (its
rowids the rows', kept by triggers; VACUUM keeps the rowids of a table with indexes, though
SQLite does not promise it: deleting the meta row `text_index` has the index built again at
the next open), PostgreSQL's `pg_trgm` GIN index (`text_index_sql`; none without the
extension). A page with a text (of a trigram or more, `INDEXED_TEXT`) takes, in one snapshot:

1. the first `WALK` rows of its filters' index in order (`walk_query`; a column filter's index
   alone, each ends in `name`), if `limit + 1` of them hold the text: a common text costs a
   short walk; if fewer do but enough that the rest are within `WALK_ON` rows at that density
   (`walks_on`), 3;
2. else the rows the text index finds (`SQLITE_TEXT_PROBE`, `POSTGRES_TEXT_PROBE`), if they
   are `CANDIDATES` or fewer: filtered, sorted and cut (`page_query(among=...)`), a rare text
   costs its matches (and the index's lists of its trigrams), not the history;
3. else the walk of every row its filters leave, until `limit + 1` hold the text: a text found
   more than `CANDIDATES` times but less than once in `WALK / (limit + 1)` rows, and so a walk
   of some `rows * (limit + 1) / CANDIDATES` rows at most, on average (matches bunched far from
   where the page starts cost the walk to them).

A shorter text, or no text index, takes 3 at once. Every way gives the same rows: the index
only narrows where the `LIKE` looks (FTS5 folds case as Unicode does, wider than ASCII, never
narrower; pg_trgm folds with the database's locale, the same for every locale but a Turkish
one, where `I` is not `i`).

Times are microseconds since the epoch in SQLite (INTEGER) and `timestamptz` in PostgreSQL
(the same microseconds). Text columns compare bytewise in both (SQLite's BINARY, PostgreSQL's
`COLLATE "C"`): the order of ids is the code-point order `query.Cursor` sorts by in Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from broker.api import affinity, selectors
from broker.state.history import query as queries

SCHEMA_VERSION = 2  # 2: the `name` column (the job's metadata.name)
HISTORY = "job_history"
LABELS = "job_history_labels"
TEXT = "job_history_text"  # the trigram index of name and id (a table in SQLite)
INDEXED_TEXT = 3  # the shortest text the trigram index can look up
CANDIDATES = 2000  # the most rows the text index may find for a page to sort them itself
WALK = 2000  # the rows a page with a text reads in order before it asks the text index
WALK_ON = 40_000  # the most rows a page walks on instead of asking the index, by the density
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
# with it (`INDEXES`, after this): once, at the first open by a broker of schema 2 (before the
# text index is built: its triggers are not there yet to follow the names filled in).
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

# The text index, SQLite's: contentless (it keeps the trigrams, not the text; a row's words
# are taken out again by the triggers, which know them). Its meta row `text_index` says it
# holds every row: written in the transaction that built it, so a build cut short is made
# again at the next open, from nothing. A broker of before the index keeps it as it writes
# (the triggers are the file's). There is no schema change: the version stays.
SQLITE_TEXT = [
    f"CREATE VIRTUAL TABLE IF NOT EXISTS {TEXT} USING fts5("
    "name, id, content='', tokenize='trigram')",
    f"""CREATE TRIGGER IF NOT EXISTS {TEXT}_insert AFTER INSERT ON {HISTORY} BEGIN
    INSERT INTO {TEXT} (rowid, name, id) VALUES (new.rowid, new.name, new.id);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS {TEXT}_delete AFTER DELETE ON {HISTORY} BEGIN
    INSERT INTO {TEXT} ({TEXT}, rowid, name, id) VALUES ('delete', old.rowid, old.name, old.id);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS {TEXT}_update AFTER UPDATE OF name, id ON {HISTORY} BEGIN
    INSERT INTO {TEXT} ({TEXT}, rowid, name, id) VALUES ('delete', old.rowid, old.name, old.id);
    INSERT INTO {TEXT} (rowid, name, id) VALUES (new.rowid, new.name, new.id);
END""",
]
SQLITE_TEXT_BUILT = "SELECT value FROM job_history_meta WHERE name = 'text_index'"
SQLITE_TEXT_EMPTIED = f"INSERT INTO {TEXT} ({TEXT}) VALUES ('delete-all')"
SQLITE_TEXT_FILL = (
    f"INSERT INTO {TEXT} (rowid, name, id)"
    f" SELECT rowid, name, id FROM {HISTORY} WHERE rowid >= ? AND rowid < ?"
)
SQLITE_TEXT_DONE = "INSERT OR REPLACE INTO job_history_meta (name, value) VALUES ('text_index', 1)"
SQLITE_TEXT_PROBE = f"SELECT rowid FROM {TEXT} WHERE {TEXT} MATCH ? LIMIT ?"


# One text of both: one list of rows per trigram to read, not two (a job's id often holds
# its name). A text across the two is a candidate the LIKE then refuses.
INDEXED = "name || ' ' || id"
POSTGRES_TEXT_PROBE = f"SELECT id FROM {HISTORY} WHERE ({INDEXED}) ILIKE $1 ESCAPE '\\' LIMIT $2"


def text_index_sql(extension_schema: str) -> str:
    """PostgreSQL's text index, with pg_trgm's operator class from the schema it is in."""
    quoted = extension_schema.replace('"', '""')
    opclass = f'"{quoted}".gin_trgm_ops'
    return f"CREATE INDEX IF NOT EXISTS {TEXT} ON {HISTORY} USING gin (({INDEXED}) {opclass})"


def fts_query(text: str) -> str:
    """The FTS5 query of the rows that may hold `text` (`indexable`): each of its trigrams
    that do not overlap (from the start, and the last), all in a row. A superset of the rows
    holding it, as the phrase of every trigram would find (exactly, but at a cost in each
    common trigram's list of rows); the `LIKE` decides."""
    starts = sorted(
        {*range(0, len(text) - INDEXED_TEXT + 1, INDEXED_TEXT), len(text) - INDEXED_TEXT}
    )
    trigrams = dict.fromkeys(text[start : start + INDEXED_TEXT] for start in starts)
    return " AND ".join('"' + trigram.replace('"', '""') + '"' for trigram in trigrams)


def indexable(text: str) -> bool:
    """Whether the trigram index can look `text` up (it has a trigram)."""
    return len(text) >= INDEXED_TEXT


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
    key: str  # what names a row for `among`
    searched: str  # a text column as the LIKE tests it (`{}`: its name)
    among: str  # the rows a text index found (`{}`: the parameter)
    candidates: Callable[[Sequence[object]], object]  # found rows → the `among` parameter


# PostgreSQL's LIKE tests `h.name || ''`, which the trigram index cannot serve: the planner
# is kept to the walk of the filter's index, or to the rows the index found (`among`).
SQLITE = Dialect(
    "sqlite",
    lambda _: "?",
    lambda us: us,
    "h.record",
    "LIKE",
    "h.rowid",
    "h.{}",
    "h.rowid IN (SELECT value FROM json_each({}))",
    lambda found: json.dumps(list(found)),
)
POSTGRES = Dialect(
    "postgresql",
    lambda n: f"${n}",
    queries.from_us,
    "h.record::text",
    "ILIKE",
    "h.id",
    "(h.{} || '')",
    "h.id = ANY({}::text[])",
    list,
)


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
    dialect: Dialect,
    query: queries.JobQuery,
    after: queries.Cursor | None,
    limit: int,
    *,
    among: Sequence[object] | None = None,
) -> tuple[str, list[object]]:
    """The SELECT of one page: `limit` rows of (record, finished, id) in the query's order
    (newest finished first, or oldest), after `after` (None, or a cursor in the live section:
    from the start when newest first, nothing left when oldest first). `among`: every row
    that can hold the query's text, by `Dialect.key` (found by the text index or a bounded
    walk); None to walk the page's index instead."""
    statement = Statement(dialect)
    source, where, order = _filtered(statement, query, after)
    if query.text is not None:
        if among is not None:
            where.append(dialect.among.format(statement.bind(dialect.candidates(among))))
        name, job_id = dialect.searched.format("name"), dialect.searched.format("id")
        where.append(_text_clause(statement, query.text, name, job_id))
    direction = "DESC" if query.newest_first else "ASC"
    sql = (
        f"SELECT {dialect.record}, h.finished, h.id FROM {source}"
        f" WHERE {' AND '.join(where) or 'TRUE'}"
        f" ORDER BY {order}.finished {direction}, {order}.id {direction}"
        f" LIMIT {statement.bind(limit)}"
    )
    return sql, statement.params


def walks_on(found: int, *, walked: int, limit: int) -> bool:
    """Whether a page whose first `walked` rows held `found` matches of `limit` should walk on
    rather than ask the text index: at that density, the rest are within `WALK_ON` rows."""
    return found * WALK_ON >= limit * walked


def walk_query(
    dialect: Dialect,
    query: queries.JobQuery,
    after: queries.Cursor | None,
    limit: int,
    *,
    walk: int | None,
) -> tuple[str, list[object]]:
    """The keys (`Dialect.key`) of up to `limit` rows holding the query's text among the
    first `walk` rows of the page (every filter but the text; None: all of them): when there
    are `limit`, or the walk had no bound, they are the page's rows. The walk reads the
    page's index only (each ends in `name`), not the rows."""
    statement = Statement(dialect)
    source, where, order = _filtered(statement, query, after)
    direction = "DESC" if query.newest_first else "ASC"
    walked = (
        f"SELECT {dialect.key} AS k, h.name AS name, h.id AS id, {order}.finished AS f,"
        f" {order}.id AS i FROM {source} WHERE {' AND '.join(where) or 'TRUE'}"
        f" ORDER BY {order}.finished {direction}, {order}.id {direction}"
        + (" OFFSET 0" if walk is None else f" LIMIT {statement.bind(walk)}")
    )
    sql = (
        f"SELECT w.k FROM ({walked}) w"
        f" WHERE {_text_clause(statement, query.text or '', 'w.name', 'w.id')}"
        f" ORDER BY w.f {direction}, w.i {direction} LIMIT {statement.bind(limit)}"
    )
    return sql, statement.params


def _filtered(
    statement: Statement, query: queries.JobQuery, after: queries.Cursor | None
) -> tuple[str, list[str], str]:
    """The FROM of a page, its WHERE but the text, and the table whose index orders it."""
    bind, dialect = statement.bind, statement.dialect
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
    for requirement in query.labels:
        if requirement is not driving:
            where.append(_label_clause(statement, requirement))
    return source, where, order


def _text_clause(statement: Statement, text: str, name: str, job_id: str) -> str:
    pattern = like_pattern(queries.fold(text))
    like = statement.dialect.like
    return (
        f"({name} {like} {statement.bind(pattern)} ESCAPE '\\'"
        f" OR {job_id} {like} {statement.bind(pattern)} ESCAPE '\\')"
    )


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
