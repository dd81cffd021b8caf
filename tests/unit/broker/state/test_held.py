"""The book's jobs in list order (`state.history.held`): as jobs come, finish and leave, a
walk from any place gives what sorting every job held would, in both directions."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.api import status
from broker.state.history import held
from broker.state.history import query as queries
from tests.builders import make_job
from tests.histories import BASE

State = status.JobState
IDS = [f"j{i:02d}" for i in range(40)]


def record(job_id: str, created: int, finished: int | None) -> status.JobRecord:
    made = status.JobRecord(
        id=job_id, tenant="t", job=make_job().build(), created=BASE + timedelta(seconds=created)
    )
    made.record(State.QUEUED, "Submitted", now=made.created)
    if finished is not None:
        made.record(State.SUCCEEDED, "Ended", now=BASE + timedelta(seconds=finished))
    return made


steps = st.tuples(
    st.sampled_from(IDS),
    st.sampled_from(["put", "put", "put", "drop"]),
    st.integers(0, 20),
    st.one_of(st.none(), st.integers(0, 20)),
)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held, "LOAD", 2)  # splits and empty chunks at a few dozen jobs


@settings(max_examples=200, deadline=None)
@given(history=st.lists(steps, max_size=120), start=st.integers(0, 45), newest=st.booleans())
def test_a_walk_gives_the_jobs_held_in_order_from_any_place(
    history: list[tuple[str, str, int, int | None]], start: int, newest: bool
) -> None:
    jobs: dict[str, status.JobRecord] = {}
    index = held.Held(jobs.get)
    for job_id, kind, created, finished in history:
        if kind == "drop":
            jobs.pop(job_id, None)
            index.drop(job_id)
        else:
            jobs[job_id] = record(job_id, created, finished)
            index.put(jobs[job_id])
    everything = sorted(((queries.Cursor.of(r), r.id) for r in jobs.values()), reverse=newest)
    assert len(index) == len(jobs)
    walked = [(key, r.id) for key, r in index.walk(newest=newest, after=None)]
    assert walked == everything
    if everything:  # from a place held, and from one between places
        mark = everything[min(start, len(everything) - 1)][0]
        assert [(k, r.id) for k, r in index.walk(newest=newest, after=mark)] == [
            item for item in everything if (item[0] < mark if newest else item[0] > mark)
        ]
    for state in (State.QUEUED, State.SUCCEEDED, State.RUNNING):  # each state apart
        mine = [item for item in everything if jobs[item[1]].status.state == state]
        assert [(k, r.id) for k, r in index.walk(newest=newest, after=None, state=state)] == mine
    between = queries.Cursor(start % 2 == 0, start * 10**6 + 1, "")
    assert [(k, r.id) for k, r in index.walk(newest=newest, after=between)] == [
        item for item in everything if (item[0] < between if newest else item[0] > between)
    ]
