"""The backlog's live jobs in each queue's order (`Backlog.heads`), kept as jobs come, change,
park, wake and leave, give the slice `budget.select` takes over the whole list: the same
jobs, whatever the history (a cycle's slice costs O(limit) instead of O(backlog))."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.planning import snapshot
from broker.planning.backlog import backlog, budget
from tests.unit.broker.planning.backlogs import T0, JobSpec, request_of

CLASSES = {None: None, "high": 7, "low": -3, "broken": None}


def order_of(job: snapshot.PendingJob) -> backlog.Order:
    if job.priority_class == "broken":
        raise ValueError("no such priority class")
    resolved = CLASSES.get(job.priority_class)
    priority = job.priority if resolved is None else resolved
    return (-priority, job.created, job.job_id)


def pending(
    job_id: str, queue: str, age: int, priority: int, cls: str | None
) -> snapshot.PendingJob:
    _, request = request_of(JobSpec(gpus=1, queue=queue), job_id)
    return snapshot.PendingJob(
        job_id=job_id,
        queue=queue,
        priority=priority,
        priority_class=cls,
        created=T0 + timedelta(seconds=age),
        request=request,
    )


IDS = [f"j{i:02d}" for i in range(24)]
jobs = st.builds(
    pending,
    st.sampled_from(IDS),
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 6),
    st.sampled_from([0, 5, 7]),
    st.sampled_from(list(CLASSES)),
)
steps = st.one_of(
    st.tuples(st.just("put"), jobs),
    st.tuples(st.just("drop"), st.sampled_from(IDS)),
    st.tuples(st.just("park"), st.sampled_from(IDS)),
    st.tuples(st.just("wake"), st.sampled_from(IDS)),
)
WAKE = backlog.Wake(shape="one", witnesses=(), thresholds=())


def apply(parked: backlog.Backlog, step: tuple[str, object]) -> None:
    kind, what = step
    if kind == "put":
        assert isinstance(what, snapshot.PendingJob)
        parked.put(what)
    elif kind == "drop":
        assert isinstance(what, str)
        parked.drop(what)
    elif kind == "park":
        job = parked.get_live(str(what))
        if job is not None:
            parked.settle((), [backlog.Park(job, WAKE, order_of_or_own(job))])
    else:
        parked.settle([str(what)], [])


def order_of_or_own(job: snapshot.PendingJob) -> backlog.Order:
    try:
        return order_of(job)
    except ValueError:
        return (-job.priority, job.created, job.job_id)


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(steps, max_size=80),
    limit=st.integers(1, 30),
    always=st.sets(st.sampled_from(IDS), max_size=4),
)
def test_the_heads_give_the_slice_select_takes_over_every_live_job(
    history: list[tuple[str, object]], limit: int, always: set[str]
) -> None:
    parked = backlog.Backlog()
    for step in history:
        apply(parked, step)
    live = parked.live()
    assert parked.live_count() == len(live)
    # each queue's line is its live jobs, each once, in the queue's order
    heads = parked.heads(order_of)
    for queue in {job.queue for job in live} | set(heads):
        line = [order for order, _ in heads.get(queue, [])]
        mine = sorted(order_of_or_own(job) for job in live if job.queue == queue)
        assert line == mine, queue
    expected, _ = budget.select(live, limit=limit, order_of=order_of, always=always)
    first = [job for job in live if job.job_id in always]
    chosen = budget.choose(parked.heads(order_of), limit=limit, always=first)
    if len(live) <= limit:
        chosen = live  # `parking` plans them all without choosing
    assert sorted(j.job_id for j in chosen) == sorted(j.job_id for j in expected)


class Counting(backlog.Backlog):
    """A backlog that counts the entries it reads."""

    reads = 0

    def _stands(self, queue: str, band: backlog.Band, entry: backlog.Entry) -> bool:
        self.reads += 1
        return super()._stands(queue, band, entry)


def test_a_deep_queue_is_read_only_as_far_as_the_slice_goes() -> None:
    """20,000 live jobs, 10,000 gone from the front: the first slice drops the 10,000 stale
    entries once (each job that left costs one read, once), then a 50-job slice reads a few
    hundred entries, not the backlog."""
    parked = Counting()
    _, request = request_of(JobSpec(gpus=1), "any")
    for n in range(30_000):
        parked.put(
            snapshot.PendingJob(f"j{n:06d}", "abc"[n % 3], 0, T0 + timedelta(seconds=n), request)
        )
    for n in range(10_000):  # the oldest dispatched, as a busy fleet takes them
        parked.drop(f"j{n:06d}")
    parked.reads = 0
    chosen = budget.choose(parked.heads(order_of), limit=50, always=[])
    assert [job.job_id for job in chosen][:3] == ["j010002", "j010000", "j010001"]  # a, b, c
    assert len(chosen) == 50
    assert parked.reads < 10_000 + 300, parked.reads
    for _ in range(3):
        parked.reads = 0
        chosen = budget.choose(parked.heads(order_of), limit=50, always=[])
        assert len(chosen) == 50 and parked.reads < 300, parked.reads
