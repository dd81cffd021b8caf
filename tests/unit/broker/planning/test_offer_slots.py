"""At most `--max-offers-in-flight` offers are out unanswered to one agent: the planner gives
a cluster no more jobs than its `offer_slots`, the others go to the next cluster that fits
or wait, told ClusterBusy, live (never parked: answers come without a summary's change)."""

from __future__ import annotations

from broker.api.queues import ReasonCode
from broker.planning import planning, snapshot
from broker.planning.backlog import backlog, parking
from tests.builders import T0, make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"


def fleet(slots: dict[str, int | None]) -> snapshot.FleetSnapshot:
    """`tight` has one node of 8 free GPUs (the tightest fit for 1-GPU jobs, chosen first),
    `roomy` ten; each with its `slots`."""
    out = []
    for name, nodes in (("tight", 1), ("roomy", 10)):
        summary = make_summary(name, make_model_summary(H100, nodes_by_free=[0] * 8 + [nodes]))
        capacity = snapshot.ClusterCapacity.from_summary(summary, healthy=True)
        capacity.offer_slots = slots[name]
        out.append(capacity)
    return snapshot.FleetSnapshot.build(out)


def jobs(count: int) -> list[snapshot.PendingJob]:
    return [make_job(f"j{n}", gpus=1).pending(created=T0.replace(second=n)) for n in range(count)]


def placed(plan: planning.CyclePlan) -> dict[str, int]:
    out: dict[str, int] = {}
    for assignment in plan.assignments:
        out[assignment.cluster] = out.get(assignment.cluster, 0) + 1
    return out


def test_without_slots_every_job_goes_to_the_tightest_fit() -> None:
    plan = planning.plan_cycle(fleet({"tight": None, "roomy": None}), jobs(6))
    assert placed(plan) == {"tight": 6}


def test_a_cluster_takes_no_more_jobs_than_its_slots_the_rest_go_elsewhere() -> None:
    plan = planning.plan_cycle(fleet({"tight": 2, "roomy": None}), jobs(6))
    assert placed(plan) == {"tight": 2, "roomy": 4}


def test_with_every_slot_taken_the_rest_wait_told_cluster_busy_and_stay_live() -> None:
    """Once no cluster may be sent an offer, the rest of the cycle's jobs are told so, for
    the whole fleet, without being fitted anywhere; the plan says the fleet is busy (the
    scheduler then waits for an answer instead of planning its next slice at once)."""
    pending = jobs(6)
    plan = planning.plan_cycle(fleet({"tight": 2, "roomy": 1}), pending)
    assert placed(plan) == {"tight": 2, "roomy": 1}
    assert plan.busy
    assert len(plan.unplaceable) == 3
    for miss in plan.unplaceable:
        assert [(r.cluster, r.code) for r in miss.details] == [
            (planning.FLEET, ReasonCode.CLUSTER_BUSY)
        ]
    parked = backlog.Backlog()
    for job in pending:
        parked.put(job)
    cycle = parking.plan_backlog(parked, fleet({"tight": 2, "roomy": 1}), previous=None, now=T0)
    assert cycle.parks == []  # they wait for answers, which come without a summary's change


def test_a_fleet_with_a_slot_left_is_not_busy_and_a_job_that_fits_nowhere_is_told_why() -> None:
    big = make_job("big", gpus=8).gang(20).pending()
    plan = planning.plan_cycle(fleet({"tight": 0, "roomy": 2}), [big, *jobs(1)])
    assert not plan.busy  # roomy has a slot left
    assert placed(plan) == {"roomy": 1}
    (miss,) = plan.unplaceable
    assert miss.job_id == "big"
    codes = {(r.cluster, r.code) for r in miss.details}
    assert ("tight", ReasonCode.CLUSTER_BUSY) in codes
    assert ("roomy", ReasonCode.CLUSTER_BUSY) not in codes  # fitted there, and did not fit
