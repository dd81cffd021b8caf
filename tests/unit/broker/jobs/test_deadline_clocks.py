"""Active deadlines counted on one replica's clock: a replica that learns of a job's first start
from another replica's commit counts from when it learned it, not from the other host's time
stamp, so a leader whose clock runs ahead of the old leader's does not fail jobs early by the
difference (`jobs.deadlines.local_deadline`, a fake clock)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from broker.api import status
from broker.jobs import book, deadlines
from broker.state import sqlite
from broker.telemetry import metrics
from tests.unit.broker.jobs import test_failure_policy as policy

State = status.JobState
NOW = datetime(2026, 12, 7, 12, 0, 0, tzinfo=status.utcnow().tzinfo)
LIMIT = 60  # activeDeadlineSeconds
SKEW = timedelta(seconds=30)


def record(*, started: datetime | None, deadline: int | None = LIMIT) -> status.JobRecord:
    builder = policy.job(activeDeadlineSeconds=deadline) if deadline else policy.job()
    out = status.JobRecord(id="j1", tenant="team-a", job=builder.build())
    out.record(State.QUEUED, "Submitted", now=NOW - timedelta(minutes=5))
    out.record(State.DISPATCHED, "Dispatched", now=NOW - timedelta(minutes=4))
    if started is not None:
        out.record(State.RUNNING, "Running", now=started)
    return out


def change(
    started: datetime | None, *, live: bool, remote: bool, deadline: int | None = LIMIT
) -> book.Change:
    before = record(started=None, deadline=deadline) if live else None
    return book.Change(before, record(started=started, deadline=deadline), remote=remote)


def finished(state: State) -> book.Change:
    after = record(started=NOW)
    after.record(state, "End", now=NOW)
    return book.Change(record(started=NOW), after, remote=True)


def cancelling() -> book.Change:
    after = record(started=NOW)
    after.status.cancel_requested = True
    return book.Change(record(started=NOW), after)


@pytest.mark.parametrize(
    ("given", "known", "expected"),
    [
        pytest.param(
            change(NOW, live=True, remote=False),
            None,
            NOW + timedelta(seconds=LIMIT),
            id="recorded here: from its own time stamp",
        ),
        pytest.param(
            change(NOW - SKEW, live=True, remote=True),
            None,
            NOW + timedelta(seconds=LIMIT),
            id="another replica's start, its clock 30 s behind: from now, not 30 s early",
        ),
        pytest.param(
            change(NOW + SKEW, live=True, remote=True),
            None,
            NOW + timedelta(seconds=LIMIT),
            id="another replica's start, its clock 30 s ahead: from now, not 30 s late",
        ),
        pytest.param(
            change(NOW - timedelta(seconds=50), live=False, remote=False),
            None,
            NOW + timedelta(seconds=10),
            id="loaded already started: from the stored time",
        ),
        pytest.param(
            change(NOW - timedelta(seconds=50), live=False, remote=True),
            None,
            NOW + timedelta(seconds=10),
            id="first seen already started: from the stored time",
        ),
        pytest.param(
            change(NOW - SKEW, live=True, remote=True),
            NOW - timedelta(seconds=5),
            NOW - timedelta(seconds=5),
            id="a deadline set before is kept",
        ),
        pytest.param(change(None, live=True, remote=True), None, None, id="not started: none"),
        pytest.param(
            change(NOW, live=True, remote=True, deadline=None), None, None, id="no deadline"
        ),
        pytest.param(finished(State.SUCCEEDED), NOW, None, id="finished: none"),
        pytest.param(cancelling(), NOW, None, id="being cancelled: none"),
    ],
)
def test_a_deadline_is_counted_on_this_replicas_clock(
    given: book.Change, known: datetime | None, expected: datetime | None
) -> None:
    assert deadlines.local_deadline(given, now=NOW, known=known) == expected


@pytest.fixture
async def leader(tmp_path: Path) -> AsyncIterator[policy.Broker]:
    backing = await sqlite.SqliteStore.open(str(tmp_path / "broker.db"))
    try:
        yield await policy.Broker(backing).start()
    finally:
        await backing.close()


async def test_a_new_leader_whose_clock_runs_ahead_does_not_fail_a_job_early(
    leader: policy.Broker,
) -> None:
    """The old leader, its clock 30 s behind this replica's, stamped the first start; this
    replica learned of it from the watch at once. Leading now, it fails the job once 60 s have
    passed on its own clock since, not once its clock reads the stamp + 60 s (30 s early)."""
    jobs = leader.jobs.book
    await leader.submit(policy.job(activeDeadlineSeconds=LIMIT))
    await leader.dispatch()
    before = leader.record()
    draft = book.draft_of(before)
    draft.record(State.RUNNING, "Running", now=status.utcnow() - SKEW)  # the old leader's clock
    async with jobs.lock:
        await jobs.commit([draft])
    after = leader.record()

    follower = deadlines.Deadlines(jobs, leader.clusters, meters=metrics.BrokerMetrics())
    learned = status.utcnow()
    follower(book.Change(before, after, remote=True))

    assert await follower.expire_once(now=learned + timedelta(seconds=LIMIT / 2 + 1)) == 0
    assert leader.record().status.state == State.RUNNING
    assert await follower.expire_once(now=learned + timedelta(seconds=LIMIT + 1)) == 1
    assert leader.record().status.events[-1].reason == "DeadlineExceeded"
