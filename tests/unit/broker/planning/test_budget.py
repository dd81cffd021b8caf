"""A cycle plans at most its budget of pending jobs, heads of every queue first
(`planning.backlog.budget`), and a deep backlog is worked through in slices: nothing is left live
for ever, and nothing is planned twice in one cycle."""

from __future__ import annotations

from datetime import timedelta

import pydantic
import pytest

from broker.planning import quotas, snapshot
from broker.planning.backlog import backlog, budget, parking
from gpufed import cli, daemons
from tests.unit.broker.planning.backlogs import T0, JobSpec, World, request_of


def pending(job_id: str, queue: str, *, age: int, priority: int = 0) -> snapshot.PendingJob:
    _, request = request_of(JobSpec(gpus=1, queue=queue), job_id)
    return snapshot.PendingJob(
        job_id=job_id,
        queue=queue,
        priority=priority,
        created=T0 + timedelta(seconds=age),
        request=request,
    )


def order_of(job: snapshot.PendingJob) -> backlog.Order:
    return (-job.priority, job.created, job.job_id)


def ids(jobs: list[snapshot.PendingJob]) -> list[str]:
    return [job.job_id for job in jobs]


def test_within_the_limit_every_job_is_planned_in_its_order() -> None:
    jobs = [pending(f"a{i}", "a", age=i) for i in range(3)]
    planned, deferred = budget.select(jobs, limit=3, order_of=order_of)
    assert ids(planned) == ["a0", "a1", "a2"]
    assert deferred == []
    planned, deferred = budget.select(jobs, limit=None, order_of=order_of)
    assert ids(planned) == ["a0", "a1", "a2"]


def test_over_the_limit_the_heads_of_every_queue_go_first_in_turn() -> None:
    # queue a: 6 jobs, b: 2, c: 1, given newest first; a3 has a higher priority
    jobs = [pending(f"a{i}", "a", age=i, priority=5 if i == 3 else 0) for i in reversed(range(6))]
    jobs += [pending(f"b{i}", "b", age=i) for i in reversed(range(2))]
    jobs += [pending("c0", "c", age=0)]
    planned, deferred = budget.select(jobs, limit=6, order_of=order_of)
    # round one: a3 (priority), b0, c0; round two: a0, b1; round three: a1
    assert sorted(ids(planned)) == ["a0", "a1", "a3", "b0", "b1", "c0"]
    assert sorted(ids(deferred)) == ["a2", "a4", "a5"]
    assert ids(planned) == [j for j in ids(jobs) if j in set(ids(planned))]  # input order kept


def test_jobs_that_must_be_planned_are_and_count_towards_the_limit() -> None:
    jobs = [pending(f"a{i}", "a", age=i) for i in range(5)]
    planned, _ = budget.select(jobs, limit=2, order_of=order_of, always={"a4"})
    assert sorted(ids(planned)) == ["a0", "a4"]
    planned, _ = budget.select(jobs, limit=1, order_of=order_of, always={"a3", "a4"})
    assert sorted(ids(planned)) == ["a3", "a4"]  # more than the limit: all of them still


def test_a_job_whose_order_cannot_be_read_goes_by_its_own_priority() -> None:
    jobs = [pending("a0", "a", age=0), pending("a1", "a", age=1, priority=9)]

    def broken(job: snapshot.PendingJob) -> backlog.Order:
        if job.job_id == "a1":
            raise ValueError("no such priority class")
        return order_of(job)

    planned, deferred = budget.select(jobs, limit=1, order_of=broken)
    assert ids(planned) == ["a1"]
    assert ids(deferred) == ["a0"]


def test_a_deep_backlog_is_planned_in_slices_until_every_job_is_placed_or_parked() -> None:
    """60 one-GPU jobs that fit and 40 gangs that fit nowhere, a limit of 15: every cycle
    plans at most 15, the fitting jobs are all placed, the gangs all parked, none live."""
    world = World()
    world.configure(0)
    fit = [world.submit(JobSpec(gpus=1, queue=q)) for q in ("a", "b", "open") for _ in range(20)]
    big = [world.submit(JobSpec(gpus=8, pods=6, queue="open")) for _ in range(40)]
    parked = backlog.Backlog()
    reference: parking.Reference | None = None
    placed: set[str] = set()
    cycles = 0
    while True:
        for job_id in [j for j in parked.ids() if j not in world.pending]:
            parked.drop(job_id)
        for job in world.pending.values():
            parked.put(job)
        views = world.views()
        cycle = parking.plan_backlog(
            parked,
            world.snapshot(),
            previous=reference,
            running=views,
            usage=quotas.Usage.of(views),
            queues=world.config,
            now=world.now,
            limit=15,
        )
        cycles += 1
        assert len(cycle.planned) <= 15
        assert len({j.job_id for j in cycle.planned}) == len(cycle.planned)
        parked.settle(cycle.woken, cycle.parks)
        reference = cycle.reference
        placed |= {a.job_id for a in cycle.plan.assignments}
        world.apply(cycle.plan)
        if not cycle.deferred and not parked.live():
            break
        assert cycles < 20, f"still {len(parked.live())} live after {cycles} cycles"
    assert placed == set(fit)
    assert set(parked.parked()) == set(big)
    assert cycles >= 100 // 15  # slices, not one cycle over the whole backlog


def test_the_broker_flag_defaults_to_the_budget_and_refuses_nonsense() -> None:
    def settings(*args: str) -> object:
        return daemons.broker_settings(cli.build_parser().parse_args(["broker", *args]))

    assert getattr(settings(), "plan_limit", None) == budget.DEFAULT_LIMIT
    assert getattr(settings("--plan-limit", "50"), "plan_limit", None) == 50
    with pytest.raises(pydantic.ValidationError, match="plan_limit"):
        settings("--plan-limit", "0")


def test_a_slow_cycle_shrinks_the_next_slice_in_proportion() -> None:
    # 500 jobs in 1 s: 2 ms each; a quarter of a second holds 125 of them
    assert budget.next_limit(500, 500, took=1.0, planned=500) == 125
    # slower still: never below the floor
    assert budget.next_limit(125, 500, took=10.0, planned=125) == budget.FLOOR


def test_a_quick_cycle_grows_the_slice_back_up_to_the_configured_limit() -> None:
    limit = budget.FLOOR
    seen = []
    for _ in range(30):
        limit = budget.next_limit(limit, 500, took=0.01, planned=limit)
        seen.append(limit)
    assert seen == sorted(seen)
    assert seen[-1] == 500
    assert budget.next_limit(500, 500, took=0.01, planned=500) == 500


def test_a_cycle_with_fewer_jobs_than_its_limit_keeps_it_unless_slow() -> None:
    assert budget.next_limit(200, 500, took=0.01, planned=10) == 200  # says nothing larger
    assert budget.next_limit(200, 500, took=0.2, planned=10) == 200  # within the target
    assert budget.next_limit(200, 500, took=0.5, planned=100) == 50  # 5 ms a job: slow
    assert budget.next_limit(600, 500, took=0.2, planned=10) == 500  # configured lowered
