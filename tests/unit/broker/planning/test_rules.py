"""The tenancy rules of the pure planner, one named case each: borrow, borrowing limit,
reclaim, priority preemption, gangs preempted as a whole, minimum run time, preemption budget,
starvation reservation, fair-share order — and what `why` says in each case."""

from __future__ import annotations

import pytest

from broker.api import queues as api
from broker.planning import planning
from tests.builders import make_job
from tests.unit.broker.planning.sim import (
    H100,
    T4,
    Cluster,
    Fleet,
    at,
    codes,
    config,
    pending,
    queue,
    reasons,
)

# ---- admission: guarantee, borrowing, limits ---------------------------------------------


@pytest.mark.parametrize(
    ("holds", "quota", "gpus", "outcome"),
    [
        pytest.param(0, (8, 16), 8, "guaranteed", id="within the guarantee"),
        pytest.param(8, (8, 16), 8, "borrowing", id="borrow: above guarantee, within limit"),
        pytest.param(8, (8, 8), 8, "BorrowingLimit", id="limit equals guarantee"),
        pytest.param(12, (8, 16), 8, "BorrowingLimit", id="borrowing limit"),
        pytest.param(8, (8, None), 16, "borrowing", id="no limit: borrow all idle"),
        pytest.param(0, (0, 0), 1, "Quota", id="limit 0: no quota for the model"),
    ],
)
def test_admission_by_quota(holds, quota, gpus, outcome) -> None:
    fleet = Fleet.of(Cluster("c1", nodes=4))
    if holds:
        fleet.run("held", "a", "c1", [8] * (holds // 8) + ([holds % 8] if holds % 8 else []))
    job = pending(make_job(gpus=min(gpus, 8), queue="a").gang(max(1, gpus // 8)), "j")
    plan = fleet.plan([job], queues=config(queue("a", quotas={H100: quota})))
    if outcome in ("guaranteed", "borrowing"):
        [assignment] = plan.assignments
        assert assignment.borrowing == (outcome == "borrowing")
    else:
        assert plan.assignments == []
        assert codes(plan, "j") == {"fleet": {outcome}}


def test_model_without_quota_is_refused_and_why_names_it() -> None:
    fleet = Fleet.of(Cluster("c1", model=T4, gpus=4))
    plan = fleet.plan(
        [pending(make_job(gpus=1, queue="a"), "j")],
        queues=config(queue("a", quotas={H100: (8, 8)})),
    )
    assert plan.assignments == []
    assert reasons(plan, "j") == [f"fleet: queue a has no quota for {T4} GPUs"]


def test_declared_cohort_capacity_bounds_borrowing() -> None:
    fleet = Fleet.of(Cluster("c1", nodes=4))
    fleet.run("b-1", "b", "c1", [8])
    queues = config(
        queue("a", quotas={H100: (0, None)}, cohort="small"),
        queue("b", quotas={H100: (8, None)}, cohort="small"),
    )
    queues.cohorts.append(api.Cohort(name="small", capacity={H100: 12}))
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "j")], queues=queues)
    assert plan.assignments == []
    assert codes(plan, "j") == {"fleet": {"NoIdleQuota"}}


# ---- reclaim and priority preemption -------------------------------------------------------


def full_fleet() -> Fleet:
    """4 nodes of 8 H100, all held by queue b (guaranteed 8): b borrows 24."""
    fleet = Fleet.of(Cluster("c1", nodes=4))
    for i, started in enumerate([0, 10, 20, 30]):
        fleet.run(f"b-{i}", "b", "c1", [8], started_s=started)
    return fleet


RECLAIM_QUEUES = config(
    queue("a", quotas={H100: (16, 32)}),
    queue("b", quotas={H100: (8, 32)}),
)


def test_reclaim_preempts_the_borrower_that_lost_least_work() -> None:
    fleet = full_fleet()
    plan = fleet.plan(
        [pending(make_job(gpus=8, queue="a"), "a-1")], queues=RECLAIM_QUEUES, now=at(60)
    )
    assert plan.assignments == []
    assert [(p.job_id, p.reason) for p in plan.preemptions] == [("b-3", "Reclaim")]
    assert "reclaim the guaranteed quota of queue a" in plan.preemptions[0].message
    assert codes(plan, "a-1")["c1"] == {"Capacity", "WaitingForPreemption"}
    assert any("preempting 1 job(s) there to reclaim" in r for r in reasons(plan, "a-1"))


def test_no_reclaim_from_a_queue_within_its_guarantee() -> None:
    fleet = full_fleet()
    queues = config(queue("a", quotas={H100: (16, 32)}), queue("b", quotas={H100: (32, 32)}))
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(60))
    assert plan.preemptions == []
    assert codes(plan, "a-1") == {"c1": {"Capacity"}, "fleet": {"Capacity"}}
    assert any("no other queue borrows" in r for r in reasons(plan, "a-1"))


def test_a_borrowing_job_never_preempts_to_borrow() -> None:
    fleet = full_fleet()
    queues = config(queue("a", quotas={H100: (0, 32)}), queue("b", quotas={H100: (8, 32)}))
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(60))
    assert plan.preemptions == []
    assert "FairShare" in codes(plan, "a-1")["fleet"]


@pytest.mark.parametrize(
    ("victim_queue", "b_guarantee", "preempted"),
    [
        pytest.param("a", 0, True, id="priority preempts a lower priority job of its queue"),
        pytest.param("b", 0, True, id="priority preempts a borrower of another queue"),
        pytest.param("b", 32, False, id="priority never preempts another queue's guarantee"),
    ],
)
def test_priority_preemption(victim_queue: str, b_guarantee: int, preempted: bool) -> None:
    fleet = Fleet.of(Cluster("c1", nodes=1))
    fleet.run("low", victim_queue, "c1", [8], priority=0)
    queues = config(
        queue("a", quotas={H100: (0, None)}), queue("b", quotas={H100: (b_guarantee, None)})
    )
    urgent = pending(make_job(gpus=8, queue="a").priority(100), "urgent")
    plan = fleet.plan([urgent], queues=queues, now=at(60))
    assert [(p.job_id, p.reason) for p in plan.preemptions] == (
        [("low", "Priority")] if preempted else []
    )
    if preempted:
        assert any("preempting 1 job(s) there for its higher priority: low" in r
                   for r in reasons(plan, "urgent"))  # fmt: skip
        assert "make room for priority 100 over 0" in plan.preemptions[0].message
    else:
        assert "WaitingForPreemption" not in codes(plan, "urgent")["c1"]


def test_priority_class_decides_priority_and_may_forbid_preemption() -> None:
    classes = [
        api.PriorityClass(name="batch", value=10),
        api.PriorityClass(name="urgent-no-preempt", value=100, preempts=False),
        api.PriorityClass(name="urgent", value=100),
    ]
    queues = config(queue("a", quotas={H100: (0, None)}, priorityClass="batch"), classes=classes)
    for klass, expected in [("urgent-no-preempt", []), ("urgent", ["low"])]:
        fleet = Fleet.of(Cluster("c1", nodes=1))
        fleet.run("low", "a", "c1", [8])  # priority from the queue's class: 10
        job = make_job(gpus=8, queue="a")
        job.doc["spec"]["priorityClass"] = klass
        plan = fleet.plan([pending(job, "j")], queues=queues, now=at(60))
        assert [p.job_id for p in plan.preemptions] == expected, klass


def test_gang_is_preempted_as_a_whole() -> None:
    # n0: half of gang g (4) + x (4); n1: other half of g (4) + y (4). An 8-GPU pod needs a
    # whole node: freeing only g's pod on n0 is not possible, so g goes as a whole, with x.
    fleet = Fleet.of(Cluster("c1", nodes=2))
    fleet.run("x", "b", "c1", [4], started_s=5, nodes=["c1-n0"])
    fleet.run("y", "b", "c1", [4], started_s=0, nodes=["c1-n1"])
    fleet.run("g", "b", "c1", [4, 4], started_s=40, nodes=["c1-n0", "c1-n1"])
    queues = config(queue("a", quotas={H100: (8, 16)}), queue("b", quotas={H100: (0, 16)}))
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(60))
    assert sorted(p.job_id for p in plan.preemptions) == ["g", "x"]
    assert any("preempting 2 job(s) there to reclaim" in r for r in reasons(plan, "a-1"))
    fleet.apply(plan, [], now_s=60)
    assert fleet.clusters["c1"].free == {"c1-n0": 8, "c1-n1": 4}, "both pods of g are gone"
    again = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(61))
    assert [a.job_id for a in again.assignments] == ["a-1"]


def test_victims_least_lost_work_then_fewest() -> None:
    # c1 would lose one job of 8 GPUs x 50 s = 400 GPU-seconds; c2 two jobs of 4 GPUs that
    # ran 10 s and 45 s = 220 GPU-seconds: c2 loses less work, though it stops more jobs.
    fleet = Fleet.of(Cluster("c1", nodes=1), Cluster("c2", nodes=1))
    fleet.run("old-8", "b", "c1", [8], started_s=10)
    fleet.run("young-4a", "b", "c2", [4], started_s=50)
    fleet.run("young-4b", "b", "c2", [4], started_s=15)
    queues = config(queue("a", quotas={H100: (8, 16)}), queue("b", quotas={H100: (0, 16)}))
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(60))
    assert sorted(p.job_id for p in plan.preemptions) == ["young-4a", "young-4b"]
    assert {p.cluster for p in plan.preemptions} == {"c2"}


@pytest.mark.parametrize(
    ("now_s", "preempted", "code"),
    [
        pytest.param(30, False, "MinRunTime", id="ran 30s of its 60s minimum: spared"),
        pytest.param(61, True, None, id="ran past its minimum: preempted"),
    ],
)
def test_minimum_run_time(now_s: float, preempted: bool, code: str | None) -> None:
    fleet = Fleet.of(Cluster("c1", nodes=1))
    fleet.run("b-1", "b", "c1", [8], started_s=0)
    queues = config(
        queue("a", quotas={H100: (8, 8)}), queue("b", quotas={H100: (0, 8)}), minRunSeconds=60
    )
    plan = fleet.plan([pending(make_job(gpus=8, queue="a"), "a-1")], queues=queues, now=at(now_s))
    assert bool(plan.preemptions) == preempted
    if code:
        assert code in codes(plan, "a-1")["fleet"]
        assert any("minimum run time" in r for r in reasons(plan, "a-1"))


def test_a_preemptor_waiting_for_release_is_told_so_while_every_agent_is_busy() -> None:
    """Every cluster out of offer slots: the other jobs are told ClusterBusy unfitted, but a
    preemptor whose victims are releasing is planned: its wait is told, its room counted."""
    fleet = full_fleet()
    job = pending(make_job(gpus=8, queue="a"), "a-1")
    other = pending(make_job(gpus=8, queue="a"), "a-2", at_s=1)
    first = fleet.plan([job], queues=RECLAIM_QUEUES, now=at(60))
    [victim] = first.preemptions
    busy = fleet.snapshot()
    for cluster in busy.clusters.values():
        cluster.offer_slots = 0
    waiting = planning.plan_cycle(
        busy,
        [job, other],
        running=[v if v.job_id != victim.job_id else _preempting(v) for v in fleet.views()],
        queues=RECLAIM_QUEUES,
        releasing=[planning.snapshot.Releasing(victim.job_id, "a-1", "c1")],
        now=at(61),
    )
    assert waiting.busy and waiting.preemptions == []
    assert "WaitingForPreemption" in codes(waiting, "a-1")["c1"]
    assert codes(waiting, "a-2") == {"fleet": {"ClusterBusy"}}


def test_preemption_budget_per_cycle() -> None:
    fleet = full_fleet()
    queues = config(
        queue("a", quotas={H100: (32, 32)}),
        queue("b", quotas={H100: (0, 32)}),
        maxPreemptionsPerCycle=2,
    )
    jobs = [pending(make_job(gpus=8, queue="a"), f"a-{i}", at_s=i) for i in range(3)]
    plan = fleet.plan(jobs, queues=queues, now=at(60))
    assert len(plan.preemptions) == 2
    assert "PreemptionBudget" in codes(plan, "a-2")["fleet"]


def test_preemptor_waits_for_release_then_goes_first() -> None:
    fleet = full_fleet()
    job = pending(make_job(gpus=8, queue="a"), "a-1")
    first = fleet.plan([job], queues=RECLAIM_QUEUES, now=at(60))
    [victim] = first.preemptions
    # the Cancel is out, the agent has not confirmed: no second preemption for the same job
    releasing = [planning.snapshot.Releasing(victim.job_id, "a-1", "c1")]
    waiting = planning.plan_cycle(
        fleet.snapshot(),
        [job],
        running=[v if v.job_id != victim.job_id else _preempting(v) for v in fleet.views()],
        queues=RECLAIM_QUEUES,
        releasing=releasing,
        now=at(61),
    )
    assert waiting.preemptions == []
    assert codes(waiting, "a-1")["c1"] == {"Capacity", "WaitingForPreemption"}
    # released: the victim is requeued (pending again, as a borrower) and the GPUs are free
    fleet.end(victim.job_id)
    requeued = pending(make_job(gpus=8, queue="b"), victim.job_id, at_s=-100)
    done = fleet.plan(
        [requeued, job],
        queues=RECLAIM_QUEUES,
        releasing=[planning.snapshot.Releasing(victim.job_id, "a-1", "c1", released=True)],
        now=at(62),
    )
    assert [a.job_id for a in done.assignments] == ["a-1"]


def _preempting(view: planning.snapshot.RunningJob) -> planning.snapshot.RunningJob:
    from dataclasses import replace

    return replace(view, preempting=True)


# ---- fair share ---------------------------------------------------------------------------


def test_fair_share_order_follows_weights() -> None:
    fleet = Fleet.of(Cluster("c1", nodes=2))  # 16 GPUs
    queues = config(
        queue("a", quotas={H100: (0, None)}),
        queue("b", quotas={H100: (0, None)}),
        queue("c", quotas={H100: (0, None)}, weight=2),
    )
    jobs = [
        pending(make_job(gpus=1, queue=q), f"{q}-{i}", at_s=i if q != "a" else -100 + i)
        for q in "abc"
        for i in range(20)
    ]
    plan = fleet.plan(jobs, queues=queues)
    placed = [a.job_id[0] for a in plan.assignments]
    assert {q: placed.count(q) for q in "abc"} == {"a": 4, "b": 4, "c": 8}
    # queue a submitted everything first, yet it does not go first all the way
    assert placed[:4] != ["a"] * 4
    assert "FairShare" in codes(plan, "a-19")["fleet"]


def test_guarantee_goes_before_fair_share() -> None:
    fleet = Fleet.of(Cluster("c1", nodes=1))
    fleet.run("a-held", "a", "c1", [4])
    queues = config(queue("a", quotas={H100: (8, None)}), queue("b", quotas={H100: (0, None)}))
    jobs = [
        pending(make_job(gpus=4, queue="b"), "b-1", at_s=-5),
        pending(make_job(gpus=4, queue="a"), "a-2"),
    ]
    plan = fleet.plan(jobs, queues=queues)
    assert [a.job_id for a in plan.assignments] == ["a-2"]
    assert codes(plan, "b-1")["c1"] == {"FairShare"}


def test_model_weights_make_an_h100_count_more_than_a_t4() -> None:
    fleet = Fleet.of(Cluster("h", nodes=1), Cluster("t", nodes=2, gpus=4, model=T4))
    fleet.run("a-held", "a", "h", [4])  # 4 H100
    fleet.run("b-held", "b", "t", [4])  # 4 T4
    queues = config(
        queue("a", quotas={"*": (0, None)}),
        queue("b", quotas={"*": (0, None)}),
        modelWeights={H100: 8, T4: 1},
    )
    jobs = [
        pending(make_job(gpus=4, queue="a").model(T4), "a-1", at_s=0),
        pending(make_job(gpus=4, queue="b").model(T4), "b-1", at_s=1),
    ]
    plan = fleet.plan(jobs, queues=queues)
    assert [a.job_id for a in plan.assignments] == ["b-1"], "b holds less weighted GPU"
    unweighted = config(queue("a", quotas={"*": (0, None)}), queue("b", quotas={"*": (0, None)}))
    plan = fleet.plan(jobs, queues=unweighted)
    assert [a.job_id for a in plan.assignments] == ["a-1"], "equal shares: first come"


# ---- starvation ---------------------------------------------------------------------------


def test_starving_gang_gets_a_reservation_and_small_jobs_backfill_elsewhere() -> None:
    fleet = Fleet.of(Cluster("c1", nodes=2), Cluster("c2", nodes=1))
    fleet.run("long", "a", "c1", [4], started_s=0)  # c1: n0 has 4 free, n1 8 free
    fleet.run("other", "a", "c2", [6], started_s=0)  # c2: 2 free
    queues = config(queue("a", quotas={H100: (0, None)}), reserveAfterSeconds=300)
    gang = pending(make_job(gpus=8, queue="a").gang(2), "gang", at_s=0)
    smalls = [pending(make_job(gpus=1, queue="a"), f"s{i}", at_s=10 + i) for i in range(8)]
    early = fleet.plan([gang, *smalls], queues=queues, now=at(200))
    assert early.reservations == {}
    assert len(early.assignments) == 8, "before the wait is over small jobs fill the gaps"

    late = fleet.plan([gang, *smalls], queues=queues, now=at(400))
    assert set(late.reservations) == {"gang"}
    assert late.reservations["gang"].cluster == "c1"
    assert codes(late, "gang")["c1"] == {"Capacity", "WaitingForReservation"}
    placed = {a.job_id: a.cluster for a in late.assignments}
    assert set(placed.values()) == {"c2"} and len(placed) == 2, "backfill only on c2"
    assert codes(late, "s7")["c1"] == {"WaitingForReservation"}
    assert any("held for job gang" in r for r in reasons(late, "s7"))


def test_starving_gang_is_placed_within_bounded_time_behind_a_stream() -> None:
    """A stream of short 1-GPU jobs keeps a 2-node cluster busy; without a reservation the
    2 x 8 gang never finds two empty nodes; with one, it runs once the long job ends."""

    def simulate(reserve_after: float | None) -> float | None:
        fleet = Fleet.of(Cluster("c1", nodes=2))
        fleet.run("long", "a", "c1", [2], started_s=0, ends=30)
        queues = config(queue("a", quotas={H100: (0, None)}), reserveAfterSeconds=reserve_after)
        gang = pending(make_job(gpus=8, queue="b").gang(2), "gang", at_s=0)
        reservations: dict = {}
        stream = 0
        for tick in range(1, 120):
            now = float(tick)
            for job_id in [j for j, r in fleet.running.items() if r.ends and r.ends <= now]:
                fleet.end(job_id)
            smalls = [
                pending(make_job(gpus=1, queue="a"), f"s{stream + i}", at_s=now) for i in range(4)
            ]
            stream += 4
            waiting = ([gang] if "gang" not in fleet.running else []) + smalls
            plan = fleet.plan(waiting, queues=queues, now=at(now), reservations=reservations)
            reservations = plan.reservations
            fleet.apply(plan, waiting, now_s=now, duration={s.job_id: 3.0 for s in smalls})
            if "gang" in fleet.running:
                return now
        return None

    assert simulate(None) is None, "without reservations the gang starves"
    placed = simulate(10.0)
    assert placed is not None and placed <= 30 + 3 + 1, placed


def test_reclaim_stops_at_the_guarantee() -> None:
    # queue a is guaranteed 16: of its three 8-GPU jobs only two reclaim; the third borrows
    fleet = full_fleet()
    jobs = [pending(make_job(gpus=8, queue="a"), f"a-{i}", at_s=i) for i in range(3)]
    plan = fleet.plan(jobs, queues=RECLAIM_QUEUES, now=at(60))
    assert sorted(p.preemptor for p in plan.preemptions) == ["a-0", "a-1"]
    assert "WaitingForPreemption" not in {c for cs in codes(plan, "a-2").values() for c in cs}
