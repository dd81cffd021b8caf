"""Finished jobs for the history tests: `finished("job-1", at=..., labels=...)`, `population()`,
and `page_all`, a query's every page read through."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from broker.api import status
from broker.state.history import protocol
from broker.state.history import query as queries
from tests.builders import make_job

BASE = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
State = status.JobState
NAMES = ["train-llm", "sweep-lr", "eval-bert", "notebook"]


def finished(
    job_id: str,
    *,
    at: datetime = BASE,
    tenant: str = "team-a",
    queue: str = "default",
    state: status.JobState = State.SUCCEEDED,
    cluster: str | None = "c1",
    labels: dict[str, str] | None = None,
    name: str | None = None,
) -> status.JobRecord:
    """A finished job: queued 10 minutes before `at`, running on `cluster` (None: never
    dispatched), ended `state` at `at`; named `name` (None: the builder's)."""
    builder = make_job(queue=queue)
    builder.doc["metadata"]["labels"] = dict(labels or {})
    if name is not None:
        builder.doc["metadata"]["name"] = name
    created = at - timedelta(minutes=10)
    record = status.JobRecord(id=job_id, tenant=tenant, job=builder.build(), created=created)
    record.record(State.QUEUED, "Submitted", now=created)
    if cluster is not None:
        record.status.cluster = cluster
        record.record(State.RUNNING, "Started", now=created + timedelta(minutes=1))
    record.record(state, "Ended", now=at)
    return record


def population(count: int = 240, *, seed: int = 12) -> list[status.JobRecord]:
    """Jobs of every kind, many finishing in the same second (ties broken by id)."""
    pick = random.Random(seed)
    made = []
    for index in range(count):
        labels = {}
        if pick.random() < 0.7:
            labels["team"] = pick.choice(["x", "y"])
        if pick.random() < 0.6:
            labels["tier"] = pick.choice(["gold", "silver", ""])
        if pick.random() < 0.2:
            labels["canary"] = "true"
        made.append(
            finished(
                f"job-{index:04d}-{pick.choice('abcXYZ_')}",
                at=BASE + timedelta(seconds=pick.randint(0, 90)),
                tenant=pick.choice(["team-a", "team-b"]),
                queue=pick.choice(["q1", "q2", "q3"]),
                state=pick.choice([State.SUCCEEDED, State.FAILED, State.CANCELLED]),
                cluster=pick.choice(["c1", "c2", None]),
                labels=labels,
                name=pick.choice(NAMES),
            )
        )
    return made


async def page_all(
    history: protocol.HistoryStore, query: queries.JobQuery, *, limit: int
) -> list[str]:
    listed: list[str] = []
    token = None
    for _ in range(10_000):
        page = await history.page(query, limit=limit, cont=token)
        assert len(page.items) <= limit
        listed += [record.id for record in page.items]
        if page.next is None:
            return listed
        assert len(page.items) == limit  # only the last page is short
        token = page.next
    raise AssertionError("the pages never ended")
