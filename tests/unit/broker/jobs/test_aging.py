"""The book's finished jobs in retiring order (`jobs.aging`) give what a pass over every
finished job would: the same jobs due, oldest finished first, at most a batch, whatever
finished, finished again, came back or was retired before."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.api import status
from broker.jobs import aging
from broker.state.history import query as queries
from tests.builders import make_job
from tests.histories import BASE

State = status.JobState
IDS = [f"j{i:02d}" for i in range(12)]


def record(job_id: str, *, at: int | None, ttl: int | None) -> status.JobRecord:
    """A job created at BASE, finished `at` seconds later (None: queued again after it ran)."""
    builder = make_job()
    if ttl is not None:
        builder.ttl_after_finished(ttl)
    made = status.JobRecord(id=job_id, tenant="t", job=builder.build(), created=BASE)
    made.record(State.QUEUED, "Submitted", now=BASE)
    if at is not None:
        made.record(State.SUCCEEDED, "Ended", now=BASE + timedelta(seconds=at))
    return made


def scanned(
    held: dict[str, status.JobRecord], *, now: int, retain: float | None, batch: int
) -> list[str]:
    """What a pass over every finished job chooses (the retirer before `aging`)."""
    aged = []
    for job in held.values():
        if not job.status.state.terminal:
            continue
        ttl = job.job.spec.ttl_seconds_after_finished
        keep = retain if ttl is None else (float(ttl) if retain is None else min(retain, ttl))
        if keep is None:
            continue
        finished = queries.finished_at(job)
        if finished < BASE + timedelta(seconds=now - keep):
            aged.append((finished, job.id))
    return [job_id for _, job_id in sorted(aged)[:batch]]


steps = st.tuples(
    st.sampled_from(IDS),
    st.sampled_from(["finish", "requeue", "retire"]),
    st.integers(0, 40),
    st.sampled_from([None, None, 0, 5, 30]),
)


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(steps, max_size=60),
    now=st.integers(0, 80),
    retain=st.sampled_from([None, 0.0, 10.0, 25.0, 3600.0]),
    batch=st.integers(1, 8),
)
def test_the_jobs_due_are_those_a_pass_over_every_finished_job_finds(
    history: list[tuple[str, str, int, int | None]],
    now: int,
    retain: float | None,
    batch: int,
) -> None:
    held: dict[str, status.JobRecord] = {}
    index = aging.Aging(held.get, lambda: sum(1 for j in held.values() if j.status.state.terminal))
    for job_id, kind, at, ttl in history:
        before = held.get(job_id)
        if kind == "retire":
            held.pop(job_id, None)
            continue
        after = record(job_id, at=at if kind == "finish" else None, ttl=ttl)
        held[job_id] = after
        index.note(before, after)  # as the book does for every change it applies
    moment = BASE + timedelta(seconds=now)
    found = [job.id for job in index.due(now=moment, retain=retain, batch=batch)]
    assert found == scanned(held, now=now, retain=retain, batch=batch)
    ttls = [
        queries.finished_at(j) + timedelta(seconds=j.job.spec.ttl_seconds_after_finished)
        for j in held.values()
        if j.status.state.terminal and j.job.spec.ttl_seconds_after_finished is not None
    ]
    assert index.next_due() == (min(ttls) if ttls else None)
    assert index.due(now=moment, retain=retain, batch=batch) == index.due(
        now=moment, retain=retain, batch=batch
    )  # a pass reads, it takes nothing away


def test_a_pass_reads_what_it_retires_not_every_finished_job() -> None:
    """10,000 finished jobs held, 20 of them past the retention: a pass reads a few dozen."""
    held: dict[str, status.JobRecord] = {}
    reads = 0

    def lookup(job_id: str) -> status.JobRecord | None:
        nonlocal reads
        reads += 1
        return held.get(job_id)

    index = aging.Aging(lookup, lambda: len(held))
    template = record("j", at=0, ttl=None)
    for n in range(10_000):
        job = template.model_copy(update={"id": f"j{n:05d}"}, deep=True)
        events = job.status.events
        events[-1] = dataclasses.replace(events[-1], time=BASE + timedelta(seconds=n))
        held[job.id] = job
        index.note(None, job)
    reads = 0
    due = index.due(now=BASE + timedelta(seconds=20 + 3600), retain=3600.0, batch=500)
    assert [job.id for job in due] == [f"j{n:05d}" for n in range(20)]
    assert reads < 100, reads
