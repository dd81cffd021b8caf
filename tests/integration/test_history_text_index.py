"""The text index gives the answers the walk gives: SQLite's FTS5 trigram table and PostgreSQL's
pg_trgm index against the `LIKE` test over every row (`sql.py`), on a corpus made to find where
they could part (case, characters outside ASCII, pattern characters, texts shorter than a
trigram, names and ids that share a text), under filters, in both orders, page by page.

A store reads the first `walk` rows of a page first, and takes its candidates from the index
when they number `candidates` or fewer: both 0 make every page walk, a walk of 0 and a million
candidates make every page with an indexable text use the index. And a history
written before the index had one: it is built at the open, rows all kept, and a build cut
short by a kill leaves a history that opens and builds it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from broker.api import selectors
from broker.state import opening
from broker.state.history import postgres, protocol, sql
from broker.state.history import query as queries
from broker.state.history import sqlite as sqlite_history
from tests import histories
from tests.histories import BASE, State, finished

EVERY = 10**6  # candidates: the index for every indexable text
Store = sqlite_history.SqliteHistory | postgres.PostgresHistory
WALKED, INDEXED, MIXED = (0, 0), (0, EVERY), (5, 12)  # (walk, candidates)


def use(history: Store, way: tuple[int, int]) -> None:
    history.walk, history.candidates = way


# Ids are any text (names are DNS labels): the folding, pattern and quoting cases are in them.
ODD_IDS = [
    "Straße-1",
    "STRASSE-2",
    "école-3",
    "ÉCOLE-4",
    "\u212aelvin-5",  # the Kelvin sign: Unicode folds it to k, ASCII does not
    "kelvin-6",
    "İstanbul-7",
    "a%b_c\\d-8",
    'quote"d-9',
    "AbC-10",
    "x-11",
]
NAMES = ["train-llm", "sweep-lr", "eval-bert", "notebook", "a", "ab", "abc", "x-1-y", "k8s-ssl"]


def corpus(seed: int = 5) -> list[protocol.HistoryRow]:
    pick = random.Random(seed)
    records = []
    for index in range(200):
        job_id = f"job-{index:04d}-{pick.choice('abcXYZ_%')}"
        if index < len(ODD_IDS):
            job_id = ODD_IDS[index]
        records.append(
            finished(
                job_id,
                at=BASE + timedelta(seconds=pick.randint(0, 120)),
                tenant=pick.choice(["team-a", "team-b"]),
                state=pick.choice([State.SUCCEEDED, State.FAILED]),
                labels={"team": pick.choice(["x", "y"])},
                name=pick.choice(NAMES) + pick.choice(["", f"-{index}", "-llm"]),
            )
        )
    return [protocol.HistoryRow.of(record) for record in records]


def texts(rows: list[protocol.HistoryRow], seed: int = 9) -> list[str]:
    """Pieces of names and ids, their case changed at random, and texts nothing holds."""
    pick = random.Random(seed)
    found = ["ß", "SS", "ss", "é", "É", "k", "K", "i̇", "%", "_", "\\", '"', "l", "-0", "lm"]
    found += ["straße", "STRASSE", "École", "kelvin", "KELVIN", "istanbul", "%b_c\\", 'e"d']
    found += ["llm-", "-LLM", "sweep-lr", "zzz", "trainx", "ab", "abc", "ABC-1", "k8s"]
    for _ in range(30):
        row = pick.choice(rows)
        whole = pick.choice([row.name, row.id])
        start = pick.randrange(len(whole))
        piece = whole[start : start + pick.randint(1, 9)]
        found.append("".join(c.upper() if pick.random() < 0.5 else c for c in piece))
    return found


def queries_of(text: str) -> list[queries.JobQuery]:
    return [
        queries.JobQuery(text=text),
        queries.JobQuery(text=text, order=queries.Order.OLDEST),
        queries.JobQuery(text=text, tenant="team-b", state=State.FAILED),
        queries.JobQuery(text=text, labels=selectors.parse("team=x")),
        queries.JobQuery(
            text=text,
            finished_after=BASE + timedelta(seconds=20),
            finished_before=BASE + timedelta(seconds=100),
            order=queries.Order.OLDEST,
        ),
    ]


async def page_all(history: protocol.HistoryStore, query: queries.JobQuery) -> list[str]:
    return await histories.page_all(history, query, limit=7)


@pytest.fixture(
    params=[
        pytest.param("sqlite-file", id="sqlite-file"),
        pytest.param("sqlite-memory", id="sqlite-memory"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def history_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_trgm_url")
        return url
    if request.param == "sqlite-file":
        return str(tmp_path / "history.db")
    return ":memory:"


@pytest.fixture
async def history(history_url: str) -> AsyncIterator[Store]:
    opened: Store
    if history_url.startswith("postgresql://"):
        opened = await postgres.PostgresHistory.connect(history_url)
        assert opened.text_indexed
    else:
        opened = await sqlite_history.SqliteHistory.open(history_url)
    yield opened
    await opened.close()


async def test_the_index_and_the_walk_list_the_same_pages(
    history: Store,
) -> None:
    rows = corpus()
    await history.put_rows(rows[:150])
    await history.put_rows(rows[150:])
    records = {row.id: protocol.parse_one(row.record, row.id, "corpus") for row in rows}
    checked = 0
    for number, text in enumerate(texts(rows)):  # each text alone, and under one of the filters
        variants = queries_of(text)
        for query in {variants[0], variants[1 + number % (len(variants) - 1)]}:
            use(history, WALKED)
            walked = await page_all(history, query)
            use(history, INDEXED)
            indexed = await page_all(history, query)
            use(history, MIXED)
            mixed = await page_all(history, query)
            ordered = sorted(records.values(), key=queries.Cursor.of, reverse=query.newest_first)
            assert indexed == walked == mixed == [r.id for r in ordered if query.matches(r)], query
            checked += bool(walked)
    assert checked > 90  # most of them list something


async def test_a_page_past_the_candidates_walks_and_lists_the_same(
    history: Store,
) -> None:
    rows = corpus()
    await history.put_rows(rows)
    query = queries.JobQuery(text="llm")
    use(history, INDEXED)
    everything = await page_all(history, query)
    assert len(everything) > 20
    for candidates in (1, 19, len(everything) - 1, len(everything), len(everything) + 1):
        for walk in (0, 1, 8, 50):  # the walk's pages are those with 7 matches in `walk` rows
            use(history, (walk, candidates))  # the index from len(everything)
            assert await page_all(history, query) == everything


async def test_the_index_follows_updates_and_prunes(
    history: Store,
) -> None:
    await history.put_many([finished(f"job-{i}", name="train-llm", at=BASE) for i in range(5)])
    await history.put_many([finished("job-1", name="eval-bert", at=BASE)])  # renamed
    await history.put_many([finished("job-9", name="eval-bert", at=BASE + timedelta(hours=2))])
    use(history, INDEXED)

    async def found(text: str) -> list[str]:
        return await page_all(history, queries.JobQuery(text=text))

    assert await found("eval-") == ["job-9", "job-1"]
    assert await found("train") == ["job-4", "job-3", "job-2", "job-0"]
    assert await history.prune(BASE + timedelta(hours=1)) == 5
    assert await found("eval-") == ["job-9"]
    assert await found("train") == []


async def written_before_the_index(path: Path) -> list[protocol.HistoryRow]:
    """A file holding the corpus, as a broker of before the text index left it."""
    rows = corpus()
    old = await sqlite_history.SqliteHistory.open(str(path))
    await old.put_rows(rows)
    await old.close()
    drop_text_index(path)
    return rows


def drop_text_index(path: Path) -> None:
    """The file as a broker of before the text index left it."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for trigger in ("insert", "delete", "update"):
            conn.execute(f"DROP TRIGGER {sql.TEXT}_{trigger}")
        conn.execute(f"DROP TABLE {sql.TEXT}")
        conn.execute("DELETE FROM job_history_meta WHERE name = 'text_index'")
        conn.commit()


async def test_a_sqlite_history_without_the_index_gains_it_at_open(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    rows = await written_before_the_index(path)

    history = await sqlite_history.SqliteHistory.open(str(path))
    try:
        assert await history.count() == len(rows)
        for text in ["llm", "STRASSE", "kelvin", "%b_c"]:
            use(history, INDEXED)
            indexed = await page_all(history, queries.JobQuery(text=text))
            use(history, WALKED)
            assert indexed == await page_all(history, queries.JobQuery(text=text))
            assert indexed
    finally:
        await history.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"INSERT INTO {sql.TEXT} ({sql.TEXT}) VALUES ('integrity-check')")
        conn.execute("DELETE FROM job_history_meta WHERE name = 'text_index'")  # built again
        conn.commit()
    history = await sqlite_history.SqliteHistory.open(str(path))
    try:
        use(history, INDEXED)
        assert len(await page_all(history, queries.JobQuery(text="llm"))) > 20
    finally:
        await history.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"INSERT INTO {sql.TEXT} ({sql.TEXT}) VALUES ('integrity-check')")
        assert conn.execute(sql.SQLITE_TEXT_BUILT).fetchone() == (1,)


BUILDER = """
import asyncio, logging, sys, time
from broker.state.history import sqlite

class Slowly(logging.Handler):  # each line printed, then a pause: time for the kill
    def emit(self, record):
        print(record.getMessage(), flush=True)
        time.sleep(0.05)

logging.getLogger().addHandler(Slowly())
logging.getLogger().setLevel(logging.INFO)
sqlite.TEXT_BATCH = 10
sqlite.PROGRESS_SECONDS = 0.0
asyncio.run(sqlite.SqliteHistory.open(sys.argv[1]))
"""


async def test_a_build_killed_midway_leaves_a_history_that_opens(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    rows = await written_before_the_index(path)

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    builder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BUILDER, str(path), stdout=asyncio.subprocess.PIPE, env=env
    )
    assert builder.stdout is not None
    try:
        async for line in builder.stdout:  # a few batches in: the build's transaction is open
            if b" 100 of " in line:
                break
    finally:  # one kill: a second one's poll may reap the child before asyncio's watcher
        with contextlib.suppress(ProcessLookupError):
            builder.kill()
        await asyncio.wait_for(builder.wait(), 10)
    assert builder.returncode == -signal.SIGKILL
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute(sql.SQLITE_TEXT_BUILT).fetchone() is None

    began = time.monotonic()
    history = await sqlite_history.SqliteHistory.open(str(path))
    try:
        assert time.monotonic() - began < 30
        assert await history.count() == len(rows)
        use(history, INDEXED)
        indexed = await page_all(history, queries.JobQuery(text="sweep"))
        use(history, WALKED)
        assert indexed == await page_all(history, queries.JobQuery(text="sweep"))
    finally:
        await history.close()


@pytest.mark.postgres
async def test_postgres_without_pg_trgm_walks_and_says_so(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the extension cannot be had (pgserver's build has none) the open says what to do;
    the answers are the walk's."""
    history = await opening.open_history(postgres_url)
    try:
        assert isinstance(history, postgres.PostgresHistory)
        if history.text_indexed:
            pytest.skip("this server has pg_trgm")
        assert "CREATE EXTENSION pg_trgm" in caplog.text
        await history.put_many([finished("job-1", name="train-llm")])
        page = await history.page(queries.JobQuery(text="LLM"), limit=5)
        assert [record.id for record in page.items] == ["job-1"]
    finally:
        await history.close()
