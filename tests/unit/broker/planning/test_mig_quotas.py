"""MIG jobs against queue quotas: a pod of slices counts the whole GPUs its slices fill
(`mig.quota_gpus`), the planner admits, charges and refuses MIG jobs by it as it does
whole-GPU jobs, and preemption with MIG jobs about neither crashes nor miscounts."""

from __future__ import annotations

import pytest

from broker.api import gangs, inventory, mig
from broker.planning import fitting, holdings, planning, quotas, snapshot
from tests.builders import T0, JobBuilder, make_job, make_model_summary, make_summary
from tests.unit.broker.planning.sim import H100, codes, config, pending, queue, reasons

PROFILE = "1g.10gb"


def mig_builder(name: str, slices: int = 1, *, pods: int = 1, queue_: str = "a") -> JobBuilder:
    return (
        make_job(name, gpus=slices, queue=queue_)
        .annotate(mig.MIG_PROFILE_ANNOTATION, PROFILE)
        .gang(pods)
    )


def mig_pending(
    job_id: str, slices: int = 1, *, pods: int = 1, queue_: str = "a"
) -> snapshot.PendingJob:
    return pending(mig_builder(job_id, slices, pods=pods, queue_=queue_), job_id)


def mig_fleet(*, nodes: int = 2, whole_free: int = 0) -> snapshot.FleetSnapshot:
    """One cluster of `nodes` H100 nodes, each GPU split into 7 slices of 1g.10gb (one GPU per
    node here, 7 slices free on each) and `whole_free` whole GPUs free per node."""
    hist = [0] * 9
    hist[whole_free] = nodes
    model = make_model_summary(H100, nodes_by_free=hist)
    by_free = [0] * 8
    by_free[7] = nodes
    slices = inventory.MIGSummary(total=7 * nodes, free=7 * nodes, nodes_by_free=by_free)
    model = model.model_copy(update={"mig": {PROFILE: slices}})
    capacity = snapshot.ClusterCapacity.from_summary(make_summary("c1", model), healthy=True)
    return snapshot.FleetSnapshot.build([capacity])


def held_mig(job_id: str, queue_: str, gpus: int, *, started: bool = True) -> snapshot.RunningJob:
    """A running MIG job: its pods hold slices, no whole GPU; `gpus` toward its quota."""
    return snapshot.RunningJob(
        job_id=job_id,
        queue=queue_,
        priority=0,
        cluster="c1",
        gpus={H100: gpus},
        pods=(snapshot.PodSlot("c1-n0", 0),),
        started=T0 if started else None,
    )


# ---- the unit: whole GPUs the slices fill ----------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "slices", "gpus"),
    [
        pytest.param("1g.10gb", 0, 0, id="no slices, no GPU"),
        pytest.param("1g.10gb", 1, 1, id="one small slice is a whole GPU"),
        pytest.param("1g.10gb", 7, 1, id="seven 1g slices fill one GPU"),
        pytest.param("1g.10gb", 8, 2, id="the eighth 1g slice starts a second GPU"),
        pytest.param("2g.20gb", 3, 1, id="three 2g fit one GPU"),
        pytest.param("3g.40gb", 2, 1, id="two 3g fit one GPU"),
        pytest.param("3g.40gb", 3, 2, id="three 3g take two GPUs"),
        pytest.param("4g.40gb", 2, 2, id="one 4g per GPU"),
        pytest.param("7g.80gb", 3, 3, id="7g is a whole GPU each"),
        pytest.param("1c.3g.40gb", 2, 1, id="a compute instance counts its GPU instance"),
        pytest.param("1g.10gb+me", 1, 1, id="a suffix changes nothing"),
    ],
)
def test_quota_gpus_are_the_gpus_the_slices_fill(profile: str, slices: int, gpus: int) -> None:
    assert mig.profile_problem(profile) is None
    assert mig.quota_gpus(profile, slices) == gpus


def test_a_mig_gang_counts_per_pod_and_a_whole_gpu_job_as_before() -> None:
    request = mig_builder("m", 1, pods=3).request()
    assert request.gpus == 0  # what whole-GPU accounting saw: nothing
    assert quotas.gpus_of(request) == 3
    assert quotas.gpus_of(make_job("w", gpus=4).gang(2).request()) == 8


# ---- the pure quota decision -----------------------------------------------------------------


def ledger(limit: int | None, *, held: int = 0, guaranteed: int = 0) -> quotas.Ledger:
    tenancy = quotas.Tenancy(config(queue("a", quotas={H100: (guaranteed, limit)})))
    running = [held_mig("held", "a", held)] if held else []
    return quotas.Ledger.build(tenancy, running, {H100: 16})


def admission(book: quotas.Ledger, request: gangs.GangRequest) -> quotas.Admission:
    return book.admit("a", request, [H100])


@pytest.mark.parametrize(
    ("limit", "held", "pods", "code"),
    [
        pytest.param(2, 0, 2, None, id="two 1-slice pods within a limit of 2"),
        pytest.param(2, 1, 2, "BorrowingLimit", id="one held + two pods exceed 2"),
        pytest.param(2, 2, 1, "BorrowingLimit", id="quota exhausted by MIG jobs"),
        pytest.param(0, 0, 1, "Quota", id="no quota for the model"),
    ],
)
def test_a_mig_job_is_admitted_by_the_gpus_its_slices_fill(
    limit: int, held: int, pods: int, code: str | None
) -> None:
    request = mig_builder("m", 1, pods=pods).request()
    found = admission(ledger(limit, held=held), request)
    if code is None:
        assert found.admissible == {H100}
        assert not found.misses
    else:
        assert found.admissible == frozenset()
        assert [m.code.value for m in found.misses] == [code]


def test_the_refusal_says_what_the_mig_job_needs() -> None:
    request = mig_builder("m", 8).request()  # 8 1g slices: 2 GPUs
    [miss] = admission(ledger(4, held=3), request).misses
    assert "holds 3" in miss.message and "this job needs 2 more" in miss.message


def test_a_mig_job_within_its_guarantee_goes_in_tier_0() -> None:
    request = mig_builder("m", 1).request()
    assert admission(ledger(4, guaranteed=2), request).tier == 0
    assert admission(ledger(4, held=2, guaranteed=2), request).tier == 1


# ---- the planner: admitted, charged, refused -------------------------------------------------


def test_mig_jobs_are_charged_as_they_are_assigned_and_the_rest_held_back_with_the_reason() -> None:
    fleet = mig_fleet()
    jobs = [mig_pending(f"m{i}") for i in range(3)]
    plan = planning.plan_cycle(fleet, jobs, queues=config(queue("a", quotas={H100: (0, 2)})))
    assert [a.job_id for a in plan.assignments] == ["m0", "m1"]
    assert codes(plan, "m2") == {"fleet": {"BorrowingLimit"}}
    [why] = reasons(plan, "m2")
    assert "holds 2" in why and "at most 2" in why
    assert fleet.clusters["c1"].models[H100].mig[PROFILE][5] == 1  # the slices were assumed


def test_a_queue_exhausted_by_whole_gpus_gets_no_mig_job() -> None:
    fleet = mig_fleet(whole_free=4)
    running = [
        snapshot.RunningJob(
            job_id="w", queue="a", priority=0, cluster="c1", gpus={H100: 4},
            pods=(snapshot.PodSlot("c1-n0", 4),), started=T0,
        )
    ]  # fmt: skip
    plan = planning.plan_cycle(
        fleet,
        [mig_pending("m")],
        running=running,
        queues=config(queue("a", quotas={H100: (4, 4)})),
    )
    assert plan.assignments == []
    assert codes(plan, "m") == {"fleet": {"BorrowingLimit"}}


def test_a_mig_fit_holds_the_gpus_the_quota_counts() -> None:
    fleet = mig_fleet()
    plan = planning.plan_cycle(fleet, [mig_pending("m", 1, pods=2)])
    [assignment] = plan.assignments
    fit = fitting.Fit(assignment.cluster, assignment.takes, 0)
    assert fit.gpus_by_model == {H100: 2}  # what the dispatch holds (`Accounting.expect`)


def test_a_mig_job_held_after_a_restart_is_inferred_on_its_model() -> None:
    request = mig_builder("m", 3, pods=2).request()
    assert holdings.infer_models(request, ["Tesla-T4", H100]) == {"Tesla-T4": 2}
    selected = (
        make_job("m", gpus=1).annotate(mig.MIG_PROFILE_ANNOTATION, PROFILE).model(H100).request()
    )
    assert holdings.infer_models(selected, ["Tesla-T4", H100]) == {H100: 1}


# ---- preemption with MIG jobs about ----------------------------------------------------------


def test_reclaim_passes_over_a_mig_borrower_that_frees_no_whole_gpu() -> None:
    fleet = mig_fleet(whole_free=0)
    running = [
        held_mig("mig-b", "b", 1),
        snapshot.RunningJob(
            job_id="whole-b", queue="b", priority=0, cluster="c1", gpus={H100: 8},
            pods=(snapshot.PodSlot("c1-n1", 8),), started=T0,
        ),
    ]  # fmt: skip
    queues = config(
        queue("a", quotas={H100: (8, 8)}),
        queue("b", quotas={H100: (0, None)}),
        maxPreemptionsPerCycle=4,
    )
    plan = planning.plan_cycle(
        fleet,
        [pending(make_job("a", gpus=8, queue="a"), "a")],
        running=running,
        queues=queues,
        now=T0,
    )
    assert [p.job_id for p in plan.preemptions] == ["whole-b"]


def test_a_mig_job_that_does_not_fit_preempts_nothing() -> None:
    fleet = mig_fleet(nodes=1)
    running = [held_mig(f"b{i}", "b", 1) for i in range(7)]
    queues = config(
        queue("a", quotas={H100: (4, 4)}),
        queue("b", quotas={H100: (0, None)}),
        maxPreemptionsPerCycle=4,
    )
    fleet.clusters["c1"].models[H100].mig[PROFILE] = [1]  # every slice taken
    plan = planning.plan_cycle(fleet, [mig_pending("m")], running=running, queues=queues, now=T0)
    assert plan.assignments == [] and plan.preemptions == []
    # preemption does not make room for MIG jobs (no victim frees slices): it waits for them
    assert codes(plan, "m")["c1"] == {"Capacity"}
    assert "MIG device(s) of 1g.10gb" in reasons(plan, "m")[0]
