"""One conformance suite for every HistoryStore: SQLite on a file and in memory, PostgreSQL on a
real server (tests/postgresserver.py: pgserver, or Debian's binaries; never a mock).

What the broker relies on: finished records kept whole and idempotently by id, pages newest
finished first under every filter exactly as `JobQuery.matches` says (the same test the book
applies to the jobs in memory, so a list across both agrees), continue tokens stable while
jobs are added, pruning in batches, and errors as `broker.state.errors` types. Store-specific
behaviour (a file that is not a database, a server that is not there) is at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path

import pytest

from broker.api import errors as api_errors
from broker.api import selectors, status
from broker.state import errors, opening
from broker.state.history import protocol
from broker.state.history import query as queries
from tests.histories import BASE, finished, page_all, population

State = status.JobState


@pytest.fixture(
    params=[
        pytest.param("sqlite-file", id="sqlite-file"),
        pytest.param("sqlite-memory", id="sqlite-memory"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def history_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        return url
    if request.param == "sqlite-file":
        return f"sqlite:///{tmp_path / 'history.db'}"
    return "sqlite://:memory:"


@pytest.fixture
async def history(history_url: str) -> AsyncIterator[protocol.HistoryStore]:
    opened = await opening.open_history(history_url)
    yield opened
    await opened.close()


def expected(records: Sequence[status.JobRecord], query: queries.JobQuery) -> list[str]:
    ordered = sorted(records, key=queries.Cursor.of, reverse=query.newest_first)
    return [record.id for record in ordered if query.matches(record)]


async def test_a_record_comes_back_whole_and_an_unknown_id_is_none(
    history: protocol.HistoryStore,
) -> None:
    record = finished("job-1", labels={"team": "x"})
    record.status.reasons = ["spare"]

    assert await history.put_many([record]) == 1

    assert await history.get("job-1") == record
    assert await history.get("job-2") is None
    assert await history.count() == 1
    assert await history.size_bytes() > 0


async def test_put_is_idempotent_by_id_and_the_last_copy_wins(
    history: protocol.HistoryStore,
) -> None:
    first = finished("job-1", labels={"team": "x"}, state=State.FAILED)
    await history.put_many([first])
    await history.put_many([first])
    again = finished("job-1", labels={"team": "y"}, at=BASE + timedelta(seconds=5))

    await history.put_many([again, finished("job-2")])

    assert await history.count() == 2
    assert await history.get("job-1") == again
    by_label = await history.page(queries.JobQuery(labels=selectors.parse("team=x")), limit=10)
    assert by_label.items == []
    by_label = await history.page(queries.JobQuery(labels=selectors.parse("team=y")), limit=10)
    assert [record.id for record in by_label.items] == ["job-1"]
    # One batch naming a job twice keeps the later copy.
    await history.put_many([first, again, first])
    assert await history.get("job-1") == first


async def test_a_job_not_finished_is_refused_and_nothing_of_its_batch_is_written(
    history: protocol.HistoryStore,
) -> None:
    running = finished("job-2")
    running.status.state = State.RUNNING

    with pytest.raises(ValueError, match="job-2 is Running"):
        await history.put_many([finished("job-1"), running])

    assert await history.count() == 0
    assert await history.put_many([]) == 0


@pytest.mark.parametrize(
    ("label", "query"),
    [
        ("everything", queries.JobQuery()),
        ("tenant", queries.JobQuery(tenant="team-a")),
        ("queue", queries.JobQuery(queue="q2")),
        ("state", queries.JobQuery(state=State.FAILED)),
        ("cluster", queries.JobQuery(cluster="c2")),
        ("label =", queries.JobQuery(labels=selectors.parse("tier=gold"))),
        ("label = empty", queries.JobQuery(labels=selectors.parse("tier="))),
        ("label !=", queries.JobQuery(labels=selectors.parse("tier!=gold"))),
        ("label in", queries.JobQuery(labels=selectors.parse("tier in (gold, silver)"))),
        ("label notin", queries.JobQuery(labels=selectors.parse("tier notin (gold)"))),
        ("label exists", queries.JobQuery(labels=selectors.parse("canary"))),
        ("label absent", queries.JobQuery(labels=selectors.parse("!canary"))),
        ("labels", queries.JobQuery(labels=selectors.parse("tier=gold,team=x,!canary"))),
        (
            "window",
            queries.JobQuery(
                finished_after=BASE + timedelta(seconds=30),
                finished_before=BASE + timedelta(seconds=60),
            ),
        ),
        ("from", queries.JobQuery(finished_after=BASE + timedelta(seconds=80))),
        ("until", queries.JobQuery(finished_before=BASE + timedelta(seconds=10))),
        (
            "all at once",
            queries.JobQuery(
                tenant="team-b",
                queue="q1",
                state=State.SUCCEEDED,
                labels=selectors.parse("team=y,!canary"),
                finished_after=BASE + timedelta(seconds=5),
                finished_before=BASE + timedelta(seconds=85),
            ),
        ),
        ("nothing", queries.JobQuery(queue="nope")),
        ("text in names", queries.JobQuery(text="sweep")),
        ("text in ids", queries.JobQuery(text="-00")),
        ("text, case ignored", queries.JobQuery(text="TRAIN-")),
        (
            "text and filters",
            queries.JobQuery(
                text="l", queue="q1", state=State.FAILED, labels=selectors.parse("team=x")
            ),
        ),
        ("oldest first", queries.JobQuery(order=queries.Order.OLDEST)),
        (
            "oldest first by a label, with a text",
            queries.JobQuery(
                order=queries.Order.OLDEST, text="-", labels=selectors.parse("team=y")
            ),
        ),
        (
            "oldest first, filtered",
            queries.JobQuery(
                order=queries.Order.OLDEST,
                tenant="team-b",
                text="e",
                labels=selectors.parse("tier in (gold, silver)"),
                finished_before=BASE + timedelta(seconds=70),
            ),
        ),
    ],
)
async def test_pages_list_what_the_query_matches_newest_finished_first(
    history: protocol.HistoryStore, label: str, query: queries.JobQuery
) -> None:
    records = population()
    await history.put_many(records[:100])
    await history.put_many(records[100:])
    want = expected(records, query)
    assert want or label == "nothing"

    assert await page_all(history, query, limit=7) == want
    assert await page_all(history, query, limit=protocol.MAX_PAGE) == want
    if len(want) >= 2:  # exactly a page's worth left: no next token, no empty page
        assert await page_all(history, query, limit=len(want)) == want


async def test_a_text_matching_nothing_lists_nothing(history: protocol.HistoryStore) -> None:
    await history.put_many([finished(f"job-{i}", name="train-llm") for i in range(5)])

    for text in ["sweep", "train-llm-x", "job-5", "%%", " "]:
        page = await history.page(queries.JobQuery(text=text), limit=10)
        assert page == protocol.Page([], None)


async def test_the_text_is_a_substring_not_a_pattern(history: protocol.HistoryStore) -> None:
    ids = ["a%b", "a_b", "a\\b", "axb", "ab", "a%%b", "A_B"]
    await history.put_many([finished(job_id) for job_id in ids])

    async def found(text: str) -> set[str]:
        page = await history.page(queries.JobQuery(text=text), limit=50)
        return {record.id for record in page.items}

    assert await found("%") == {"a%b", "a%%b"}
    assert await found("_") == {"a_b", "A_B"}
    assert await found("\\") == {"a\\b"}
    assert await found("a_b") == {"a_b", "A_B"}  # not axb
    assert await found("a%b") == {"a%b"}  # not a%%b, not ab
    assert await found("\\b") == {"a\\b"}
    assert await found("a\\%") == set()  # the backslash no escape of the client's


async def test_a_text_pages_through_its_matches_with_continue(
    history: protocol.HistoryStore,
) -> None:
    records = population()
    await history.put_many(records)
    query = queries.JobQuery(text="eval")
    first = await history.page(query, limit=5)
    assert first.next is not None
    with pytest.raises(api_errors.Malformed, match="another query"):  # the text is part of it
        await history.page(queries.JobQuery(text="train"), limit=5, cont=first.next)
    with pytest.raises(api_errors.Malformed, match="another query"):  # and so is the order
        oldest = queries.JobQuery(text="eval", order=queries.Order.OLDEST)
        await history.page(oldest, limit=5, cont=first.next)
    # the case of the text is not: EVAL and eval are one query
    again = await history.page(queries.JobQuery(text="EVAL"), limit=5, cont=first.next)

    rest = await page_all_from(history, query, first.next, limit=5)

    assert [record.id for record in again.items] == rest[:5]
    assert [record.id for record in first.items] + rest == expected(records, query)
    assert all("eval" in record.job.metadata.name for record in first.items)


async def test_oldest_first_a_token_of_the_live_section_has_nothing_left(
    history: protocol.HistoryStore,
) -> None:
    await history.put_many([finished(f"job-{i}", at=BASE + timedelta(seconds=i)) for i in range(3)])
    query = queries.JobQuery(order=queries.Order.OLDEST)
    token = queries.encode(queries.Cursor(True, queries.to_us(BASE), "queued-job"), query)

    assert await history.page(query, limit=10, cont=token) == protocol.Page([], None)
    assert [r.id for r in (await history.page(query, limit=10)).items] == [
        "job-0",
        "job-1",
        "job-2",
    ]


async def test_ties_are_broken_by_id_in_code_point_order(history: protocol.HistoryStore) -> None:
    ids = ["job-a", "job-B", "job-_", "job-é", "job-Z", "job-ab", "job-a0", "job-" + "\u4e2d"]
    await history.put_many([finished(job_id) for job_id in ids])

    assert await page_all(history, queries.JobQuery(), limit=3) == sorted(ids, reverse=True)


async def test_a_token_is_stable_while_jobs_are_added(history: protocol.HistoryStore) -> None:
    old = [finished(f"old-{i:03d}", at=BASE + timedelta(seconds=i // 3)) for i in range(60)]
    await history.put_many(old)
    query = queries.JobQuery()
    first = await history.page(query, limit=10)
    assert first.next is not None
    cursor = queries.Cursor.of(first.items[-1])
    # Newer jobs land ahead of the reader; older ones, and ties behind its cursor, after it.
    newer = [finished(f"new-{i}", at=BASE + timedelta(hours=1)) for i in range(5)]
    behind = [finished(f"late-{i}", at=BASE - timedelta(hours=1)) for i in range(5)]
    at_cursor = queries.from_us(cursor.time_us)
    behind.append(finished("old-/", at=at_cursor))  # a tie, its id below the cursor's
    newer.append(finished(cursor.job_id + "z", at=at_cursor))  # a tie above it
    await history.put_many([*newer, *behind, old[0]])  # and a job already listed, put again

    rest = await page_all_from(history, query, first.next, limit=10)

    listed = [record.id for record in first.items] + rest
    assert len(listed) == len(set(listed))
    assert set(listed) == {record.id for record in old} | {record.id for record in behind}


async def page_all_from(
    history: protocol.HistoryStore, query: queries.JobQuery, token: str, *, limit: int
) -> list[str]:
    listed: list[str] = []
    next_token: str | None = token
    while next_token is not None:
        page = await history.page(query, limit=limit, cont=next_token)
        listed += [record.id for record in page.items]
        next_token = page.next
    return listed


async def test_a_token_of_another_query_or_none_of_ours_is_refused(
    history: protocol.HistoryStore,
) -> None:
    await history.put_many([finished(f"job-{i}") for i in range(5)])
    page = await history.page(queries.JobQuery(queue="default"), limit=2)
    assert page.next is not None

    with pytest.raises(api_errors.Malformed, match="another query") as refused:
        await history.page(queries.JobQuery(queue="other"), limit=2, cont=page.next)
    assert refused.value.field == "continue"
    for garbage in ["x", "e30", "!!!", "eyJ2IjoxfQ", "A" * 2000]:
        with pytest.raises(api_errors.Malformed):
            await history.page(queries.JobQuery(queue="default"), limit=2, cont=garbage)
    for limit in (0, protocol.MAX_PAGE + 1):
        with pytest.raises(ValueError, match="a page holds"):
            await history.page(queries.JobQuery(), limit=limit)


async def test_a_token_from_the_live_section_starts_history_from_its_newest(
    history: protocol.HistoryStore,
) -> None:
    await history.put_many([finished(f"job-{i}", at=BASE + timedelta(seconds=i)) for i in range(3)])
    live = queries.Cursor(True, queries.to_us(BASE), "queued-job")
    token = queries.encode(live, queries.JobQuery())

    page = await history.page(queries.JobQuery(), limit=10, cont=token)

    assert [record.id for record in page.items] == ["job-2", "job-1", "job-0"]


async def test_prune_deletes_what_finished_before_in_batches(
    history: protocol.HistoryStore,
) -> None:
    records = [
        finished(f"job-{i:02d}", at=BASE + timedelta(minutes=i), labels={"team": "x"})
        for i in range(20)
    ]
    await history.put_many(records)

    assert await history.prune(BASE + timedelta(minutes=7), batch=3) == 7
    assert await history.prune(BASE + timedelta(minutes=7), batch=3) == 0

    assert await history.count() == 13
    assert await history.get("job-06") is None
    assert await history.get("job-07") is not None
    by_label = await page_all(history, queries.JobQuery(labels=selectors.parse("team=x")), limit=5)
    assert by_label == [f"job-{i:02d}" for i in range(19, 6, -1)]
    await history.put_many(records[:1])  # a pruned job put again is kept again
    assert await history.count() == 14
    with pytest.raises(ValueError, match="batch"):
        await history.prune(BASE, batch=0)


async def test_reads_run_beside_writes(history: protocol.HistoryStore) -> None:
    async def write(batch: int) -> None:
        await history.put_many(
            [finished(f"w{batch}-{i}", at=BASE + timedelta(seconds=i)) for i in range(50)]
        )

    async def read() -> int:
        page = await history.page(queries.JobQuery(), limit=20)
        return len(page.items)

    await write(0)
    results = await asyncio.gather(*(write(b) for b in range(1, 5)), *(read() for _ in range(8)))

    assert all(count == 20 for count in results[4:])
    assert await history.count() == 250


async def test_a_closed_store_refuses_calls(history_url: str) -> None:
    opened = await opening.open_history(history_url)
    await opened.close()
    await opened.close()  # twice is fine

    with pytest.raises(errors.StoreError, match="closed"):
        await opened.get("job-1")


async def test_what_is_kept_survives_closing_and_opening_again(
    history_url: str,
) -> None:
    if history_url == "sqlite://:memory:":
        pytest.skip("an in-memory history ends with its store")
    opened = await opening.open_history(history_url)
    try:
        await opened.put_many([finished("job-1")])
    finally:
        await opened.close()

    reopened = await opening.open_history(history_url)
    try:
        assert [record.id for record in (await reopened.page(queries.JobQuery(), limit=5)).items]
        assert await reopened.count() == 1
    finally:
        await reopened.close()


# -- each store's own faults ------------------------------------------------------------------


def test_history_urls_are_read_or_refused() -> None:
    assert opening.default_history_url("sqlite:////var/lib/gpufed/broker.db") == (
        "sqlite:////var/lib/gpufed/history.db"
    )
    assert opening.default_history_url("sqlite:///history.db") == "sqlite:///history-history.db"
    assert opening.default_history_url("sqlite://:memory:") == "sqlite://:memory:"
    assert opening.default_history_url("etcd://127.0.0.1:2379") is None


async def test_an_unknown_history_url_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported history URL"):
        await opening.open_history("mysql://somewhere/db")


async def test_a_sqlite_file_that_is_not_a_database_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    path.write_bytes(b"this is not a database, not at all" * 200)

    with pytest.raises(errors.StoreDamagedError, match=r"history\.db") as refused:
        await opening.open_history(f"sqlite:///{path}")
    assert refused.value.__cause__ is not None


async def test_a_sqlite_file_in_no_folder_cannot_be_opened(tmp_path: Path) -> None:
    with pytest.raises(errors.StoreError, match="cannot be opened") as refused:
        await opening.open_history(f"sqlite:///{tmp_path / 'nowhere' / 'history.db'}")
    assert not isinstance(refused.value, errors.TemporaryStoreError)
    assert refused.value.__cause__ is not None


async def test_a_postgres_server_not_there_is_a_temporary_error() -> None:
    with pytest.raises(errors.TemporaryStoreError, match="postgresql history") as refused:
        await opening.open_history("postgresql://gpufed:secret@127.0.0.1:1/gpufed")
    assert "secret" not in str(refused.value)
    assert refused.value.__cause__ is not None


@pytest.mark.postgres
async def test_a_postgres_database_that_does_not_exist_is_a_permanent_error(
    postgres_url: str,
) -> None:
    url = postgres_url.replace("/postgres?", "/no_such_database?", 1)
    assert url != postgres_url

    with pytest.raises(errors.StoreError, match="no_such_database") as refused:
        await opening.open_history(url)
    assert not isinstance(refused.value, errors.TemporaryStoreError)


async def test_a_sqlite_history_of_schema_1_gains_names_at_open(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    url = f"sqlite:///{path}"
    opened = await opening.open_history(url)
    await opened.put_many([finished("job-1", name="train-llm"), finished("job-2", name="eval")])
    await opened.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:  # back to what schema 1 was
        for trigger in ("insert", "delete", "update"):  # it had no text index either
            conn.execute(f"DROP TRIGGER job_history_text_{trigger}")
        conn.execute("DROP TABLE job_history_text")
        conn.execute("DELETE FROM job_history_meta WHERE name = 'text_index'")
        for index in ("finished", "tenant", "queue", "state", "cluster"):
            conn.execute(f"DROP INDEX job_history_{index}")
        conn.execute("ALTER TABLE job_history DROP COLUMN name")
        conn.execute("UPDATE job_history_meta SET value = 1 WHERE name = 'schema'")
        conn.commit()

    reopened = await opening.open_history(url)
    try:
        page = await reopened.page(queries.JobQuery(text="TRAIN"), limit=5)
        assert [record.id for record in page.items] == ["job-1"]
    finally:
        await reopened.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute(
            "SELECT value FROM job_history_meta WHERE name = 'schema'"
        ).fetchone() == (2,)
        (indexed,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'job_history_tenant'"
        ).fetchone()
        assert indexed.endswith("(tenant, finished, id, name)")
