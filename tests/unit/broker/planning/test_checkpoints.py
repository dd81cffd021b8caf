"""Victim choice with checkpoints (pure): among the jobs a preemption may stop, the one that
loses the least work since its last checkpoint goes first; priority still comes before work
lost, and without checkpoints the order is what it always was (the shortest run first)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from broker.planning import preemption, snapshot
from tests.builders import make_job
from tests.unit.broker.planning.sim import H100, Cluster, Fleet, at, config, pending, queue

QUEUES = config(queue("a", quotas={H100: (0, None)}))


def victims_for_urgent(fleet: Fleet, *, now: float = 1000.0) -> list[str]:
    urgent = pending(make_job(gpus=8, queue="a").priority(100), "urgent")
    plan = fleet.plan([urgent], queues=QUEUES, now=at(now))
    return [p.job_id for p in plan.preemptions]


@pytest.mark.parametrize(
    ("jobs", "victim"),
    [
        pytest.param(
            {"young": (900, None), "old": (100, None)},
            "young",
            id="no checkpoints: the shortest run is stopped, as before",
        ),
        pytest.param(
            {"young": (900, None), "old": (100, 990)},
            "old",
            id="a checkpoint 10 s ago loses less than a run of 100 s",
        ),
        pytest.param(
            {"young": (900, 950), "old": (100, 990)},
            "old",
            id="both checkpoint: the most recent checkpoint goes",
        ),
        pytest.param(
            {"young": (900, None), "old": (100, 50)},
            "young",
            id="a checkpoint before the job's start is an earlier run's: ignored",
        ),
        pytest.param(
            {"a": (900, 990), "b": (500, 990)},
            "a",
            id="the same work lost: the shorter run, as before",
        ),
    ],
)
def test_the_victim_is_the_job_that_loses_least_work(
    jobs: dict[str, tuple[float, float | None]], victim: str
) -> None:
    fleet = Fleet.of(Cluster("c1", nodes=len(jobs)))
    for job_id, (started, checkpoint) in jobs.items():
        fleet.run(job_id, "a", "c1", [8], started_s=started, checkpoint_s=checkpoint)
    assert victims_for_urgent(fleet) == [victim]


def test_priority_comes_before_the_work_lost() -> None:
    """A higher priority job that just checkpointed is not stopped before a lower one."""
    fleet = Fleet.of(Cluster("c1", nodes=2))
    fleet.run("low", "a", "c1", [8], started_s=0, priority=0)
    fleet.run("mid", "a", "c1", [8], started_s=0, priority=10, checkpoint_s=999)
    assert victims_for_urgent(fleet) == ["low"]


def test_lost_seconds_counts_from_the_later_of_start_and_checkpoint() -> None:
    def job(started: float, checkpoint: float | None) -> snapshot.RunningJob:
        return snapshot.RunningJob(
            job_id="j",
            queue="a",
            priority=0,
            cluster="c1",
            gpus={H100: 8},
            started=at(started),
            checkpointed=at(checkpoint) if checkpoint is not None else None,
        )

    now = at(100)
    assert preemption.lost_seconds(job(40, None), now) == 60
    assert preemption.lost_seconds(job(40, 90), now) == 10
    assert preemption.lost_seconds(job(40, 10), now) == 60  # an earlier run's checkpoint
    assert preemption.lost_seconds(job(40, 130), now) == 0  # a clock ahead: nothing lost
    assert preemption.lost_seconds(job(40, 90), None) == 0
    assert preemption.lost_seconds(job(40, 90), now - timedelta(seconds=70)) == 0


def test_the_cost_of_a_choice_counts_work_lost_not_run_time() -> None:
    fleet_job = snapshot.RunningJob(
        job_id="j", queue="a", priority=0, cluster="c1", gpus={H100: 8}, started=at(0)
    )
    lost_little = preemption.Choice(
        "c1", (preemption.Victim(fleet_job, preemption.PRIORITY, 0, 1000.0, 5.0),)
    )
    lost_much = preemption.Choice(
        "c2", (preemption.Victim(fleet_job, preemption.PRIORITY, 0, 100.0, None),)
    )
    assert lost_little.cost < lost_much.cost
