"""One list over the jobs in memory and the history (`listing.page_jobs`), on an SQLite history:
the order of `query.py`, each job once, a job retired between two pages neither lost nor
listed twice, filters the same on both sides."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

import pytest

from broker.api import errors as api_errors
from broker.api import selectors, status
from broker.state import opening
from broker.state.history import listing, protocol
from broker.state.history import query as queries
from broker.state.history.held import Held
from tests.builders import make_job
from tests.histories import BASE, finished

State = status.JobState


def live(job_id: str, *, minutes: int, state: status.JobState = State.QUEUED) -> status.JobRecord:
    builder = make_job(queue="q1")
    builder.doc["metadata"]["labels"] = {"team": "x"}
    created = BASE + timedelta(minutes=minutes)
    record = status.JobRecord(id=job_id, tenant="team-a", job=builder.build(), created=created)
    record.record(State.QUEUED, "Submitted", now=created)
    if state is not State.QUEUED:
        record.status.cluster = "c1"
        record.record(state, "Started", now=created + timedelta(seconds=1))
    return record


@pytest.fixture
async def history() -> AsyncIterator[protocol.HistoryStore]:
    opened = await opening.open_history("sqlite://:memory:")
    yield opened
    await opened.close()


def book() -> list[status.JobRecord]:
    """What a book holds: live jobs, and finished ones not yet retired."""
    held = [live(f"live-{i}", minutes=100 + i) for i in range(4)]
    held += [live(f"run-{i}", minutes=50 + i, state=State.RUNNING) for i in range(3)]
    held += [
        finished(f"recent-{i}", at=BASE + timedelta(minutes=30 + i), queue="q1") for i in range(4)
    ]
    return held


def retired() -> list[status.JobRecord]:
    return [finished(f"old-{i:02d}", at=BASE + timedelta(minutes=i), queue="q1") for i in range(12)]


async def list_all(
    held: Sequence[status.JobRecord],
    history: protocol.HistoryStore | None,
    query: queries.JobQuery,
    *,
    limit: int,
) -> list[str]:
    listed: list[str] = []
    token = None
    while True:
        page = await listing.page_jobs(Held.of(held), history, query, limit=limit, cont=token)
        listed += [record.id for record in page.items]
        if page.next is None:
            return listed
        token = page.next


def ordered(records: Sequence[status.JobRecord], query: queries.JobQuery) -> list[str]:
    unique = {record.id: record for record in records}.values()
    chosen = [record for record in unique if query.matches(record)]
    in_order = sorted(chosen, key=queries.Cursor.of, reverse=query.newest_first)
    return [record.id for record in in_order]


@pytest.mark.parametrize("limit", [1, 3, 7, 100])
@pytest.mark.parametrize(
    "query",
    [
        queries.JobQuery(),
        queries.JobQuery(state=State.RUNNING),
        queries.JobQuery(state=State.SUCCEEDED),
        queries.JobQuery(labels=selectors.parse("team=x")),
        queries.JobQuery(finished_after=BASE + timedelta(minutes=5)),
        queries.JobQuery(text="-1"),
        queries.JobQuery(text="OLD-0", queue="q1"),
        queries.JobQuery(order=queries.Order.OLDEST),
        queries.JobQuery(order=queries.Order.OLDEST, text="e"),
        queries.JobQuery(order=queries.Order.OLDEST, state=State.RUNNING),
    ],
    ids=[
        "all",
        "running",
        "succeeded",
        "label",
        "window",
        "text",
        "text+queue",
        "oldest",
        "oldest+text",
        "oldest+running",
    ],
)
async def test_live_jobs_first_then_finished_ones_each_once(
    history: protocol.HistoryStore, query: queries.JobQuery, limit: int
) -> None:
    held = book()
    old = retired()
    await history.put_many([*old, held[-1]])  # one retired, still in the book

    listed = await list_all(held, history, query, limit=limit)

    assert listed == ordered([*held, *old], query)
    if query == queries.JobQuery():
        assert listed[:4] == ["live-3", "live-2", "live-1", "live-0"]
        assert listed[7:11] == ["recent-3", "recent-2", "recent-1", "recent-0"]
        assert listed[-1] == "old-00"
    if query == queries.JobQuery(order=queries.Order.OLDEST):
        assert listed[0] == "old-00"
        assert listed[-4:] == ["live-0", "live-1", "live-2", "live-3"]


async def test_a_job_retired_between_two_pages_is_listed_once(
    history: protocol.HistoryStore,
) -> None:
    held = book()
    await history.put_many(retired())
    query = queries.JobQuery()
    first = await listing.page_jobs(Held.of(held), history, query, limit=9)
    assert [record.id for record in first.items][-2:] == ["recent-3", "recent-2"]

    moving = [record for record in held if record.id in ("recent-2", "recent-0")]
    await history.put_many(moving)  # retired: into history, then out of the book
    held = [record for record in held if record not in moving]
    rest = []
    token = first.next
    while token is not None:
        page = await listing.page_jobs(Held.of(held), history, query, limit=9, cont=token)
        rest += [record.id for record in page.items]
        token = page.next

    assert rest == ["recent-1", "recent-0", *(f"old-{i:02d}" for i in range(11, -1, -1))]


async def test_without_a_history_the_book_alone_is_listed() -> None:
    held = book()

    assert await list_all(held, None, queries.JobQuery(), limit=2) == ordered(
        held, queries.JobQuery()
    )


async def test_a_token_of_another_query_is_refused(history: protocol.HistoryStore) -> None:
    page = await listing.page_jobs(Held.of(book()), history, queries.JobQuery(), limit=2)
    assert page.next is not None

    with pytest.raises(api_errors.Malformed, match="another query"):
        await listing.page_jobs(
            Held.of(book()), history, queries.JobQuery(queue="q1"), limit=2, cont=page.next
        )
