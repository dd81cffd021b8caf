"""How many pending jobs one cycle plans: a budget, heads of every queue first.

Called by `parking.plan_backlog` (the slice: `lines`, `merged`, `choose`) and by the
scheduling shell (`next_limit`, `DEFAULT_LIMIT`). A cycle over every job of a deep backlog
— the first cycle after a start or a failover, or every job woken at once by a cluster that
joined — would hold the event loop while the leader's lease, the agents' reports and the API
wait on it. A cycle therefore plans at most `limit` of them (`select`); the rest stay live,
planned by the next cycles, so a deep backlog is worked through in slices and nothing is
left behind.

Which ones: the jobs that must be planned (`always`: reservation holders, preemptors whose
victims are releasing), then the heads of every queue in turn, one at a time, each queue
in its own order (priority, then submission time: the order `planning` takes a queue's
jobs in). A queue's deferred jobs are all behind its planned ones, so within a queue no job
goes ahead of one before it; across queues the fair-share order decides among the heads
the cycle holds, as Kueue's scheduler does with one head per ClusterQueue per cycle. What
a deferred job is told is what it was last told (or that it waits for the next cycle).
With no more pending jobs than the limit, every one is planned: nothing changes at all.

The limit adapts (`next_limit`): a cycle whose planning held the loop past `TARGET_SECONDS`
makes the next slice smaller in proportion, down to `FLOOR`, and quick cycles grow it back
to the configured `--plan-limit`. What a job costs to plan grows with the fleet, the gangs
and how loaded the machine is; the lease and the agents' heartbeats do not wait for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from broker.planning import snapshot
from broker.planning.backlog import backlog

DEFAULT_LIMIT = 500  # jobs planned per cycle: about half a second at worst (large gangs)


def select(
    pending: Sequence[snapshot.PendingJob],
    *,
    limit: int | None,
    order_of: Callable[[snapshot.PendingJob], backlog.Order],
    always: Collection[str] = (),
) -> tuple[list[snapshot.PendingJob], list[snapshot.PendingJob]]:
    """(planned, deferred): at most `limit` jobs to plan (more only if `always` holds more),
    in `pending`'s order, and the rest. `order_of` gives a job's place in its queue (a job
    whose priority cannot be read goes by its own field: the planner sets it aside)."""
    if limit is None or len(pending) <= limit:
        return list(pending), []
    chosen = {job.job_id for job in choose(lines(pending, order_of), limit=limit, always=[
        job for job in pending if job.job_id in always
    ])}  # fmt: skip
    planned = [job for job in pending if job.job_id in chosen]
    deferred = [job for job in pending if job.job_id not in chosen]
    return planned, deferred


Line = Iterable[tuple[backlog.Order, snapshot.PendingJob]]  # a queue's jobs, in its order


def lines(
    pending: Iterable[snapshot.PendingJob],
    order_of: Callable[[snapshot.PendingJob], backlog.Order],
) -> dict[str, Line]:
    """`pending` by queue, each in its queue's order (`order_of`; a job whose priority
    cannot be read goes by its own field)."""
    out: dict[str, list[tuple[backlog.Order, snapshot.PendingJob]]] = {}
    for job in pending:
        try:
            order = order_of(job)
        except Exception:  # the planner raises for it too, and sets it aside
            order = (-job.priority, job.created, job.job_id)
        out.setdefault(job.queue, []).append((order, job))
    for line in out.values():
        line.sort(key=_order)
    return dict(out)


def choose(
    queues: Mapping[str, Line], *, limit: int, always: Sequence[snapshot.PendingJob] = ()
) -> list[snapshot.PendingJob]:
    """`always`, then the heads of every queue (`queues`: each queue's jobs in its order,
    read lazily) one at a time in turn, queue by queue by name, until `limit` are chosen:
    reading a queue costs what it gives, so a deep backlog costs the slice, not its size."""
    chosen = {job.job_id: job for job in always}
    heads = {queue: iter(line) for queue, line in queues.items()}
    turn = sorted(heads)
    while turn and len(chosen) < limit:
        still = []
        for queue in turn:
            if len(chosen) >= limit:
                break
            for _, job in heads[queue]:
                if job.job_id not in chosen:
                    chosen[job.job_id] = job
                    still.append(queue)
                    break
        turn = still
    return list(chosen.values())


def merged(*queues: Mapping[str, Line]) -> dict[str, Line]:
    """The queues' lines, merged queue by queue (each line in its queue's order)."""
    out: dict[str, list[Line]] = {}
    for each in queues:
        for queue, line in each.items():
            out.setdefault(queue, []).append(line)
    return {
        queue: parts[0] if len(parts) == 1 else heapq.merge(*parts, key=_order)
        for queue, parts in out.items()
    }


def _order(item: tuple[backlog.Order, snapshot.PendingJob]) -> backlog.Order:
    return item[0]


# the slice a cycle aims at: the leader's lease is renewed every 1.7 s and steps down 4 s
# after the last renewal; agents are taken for silent after 3 heartbeats
TARGET_SECONDS = 0.25
FLOOR = 50  # jobs a cycle plans at least, however slow planning is


def next_limit(current: int, configured: int, *, took: float, planned: int) -> int:
    """The limit of the next cycle, from how long this one's `planned` jobs took: shrunk in
    proportion when planning held the loop past `TARGET_SECONDS` (a loaded machine, large
    gangs, a large fleet), grown back by a quarter while it takes under half of that; never
    above `configured`, never below `FLOOR`. A cycle that planned fewer than its limit says
    nothing about a larger one unless it was slow."""
    if took > TARGET_SECONDS and planned:
        per_job = took / planned
        return max(FLOOR, min(configured, int(TARGET_SECONDS / per_job)))
    if took < TARGET_SECONDS / 2 and planned >= current:
        return min(configured, max(current + 1, int(current * 1.25)))
    return min(current, configured)
