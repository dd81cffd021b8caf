"""What the planner counts: GPUs given back by a victim (the summary-only estimate), dominant
and fair shares with model weights, the per-queue views, and a running job's view."""

from __future__ import annotations

from datetime import timedelta

import pytest

from broker.api import gangs, status
from broker.planning import fairshare, holdings, preemption, quotas, snapshot, usage
from tests.builders import make_job, make_model_summary, make_summary
from tests.unit.broker.planning.sim import H100, T0, T4, config, queue


def capacity(hist: list[int]) -> snapshot.ClusterCapacity:
    summary = make_summary("c1", make_model_summary(H100, nodes_by_free=hist))
    return snapshot.ClusterCapacity.from_summary(summary, healthy=True)


def running(job_id: str, pods: list[tuple[str, int]], queue_: str = "a") -> snapshot.RunningJob:
    return snapshot.RunningJob(
        job_id=job_id,
        queue=queue_,
        priority=0,
        cluster="c1",
        gpus={H100: sum(g for _, g in pods)},
        pods=tuple(snapshot.PodSlot(n, g) for n, g in pods),
        started=T0,
    )


@pytest.mark.parametrize(
    ("hist", "others", "victim", "after"),
    [
        pytest.param(
            [2, 0, 0, 0, 0, 0, 0, 0, 0],
            [],
            [("n0", 8)],
            [1, 0, 0, 0, 0, 0, 0, 0, 1],
            id="a whole node comes back whole",
        ),
        pytest.param(
            [2, 0, 0, 0, 0, 0, 0, 0, 0],
            [("n0", 4)],
            [("n0", 4)],
            [1, 0, 0, 0, 1, 0, 0, 0, 0],
            id="a node shared with another job gets back the victim's 4 only",
        ),
        pytest.param(
            [1, 0, 0, 0, 1, 0, 0, 0, 0],
            [],
            [("n0", 4), ("n1", 4)],
            [0, 0, 0, 0, 1, 0, 0, 0, 1],
            id="a gang: each pod's node gains its GPUs",
        ),
        pytest.param(
            [0, 0, 1, 0, 0, 0, 0, 0, 0],
            [],
            [("n0", 4)],
            [0, 0, 0, 0, 0, 0, 1, 0, 0],
            id="estimate finds no such node: the fullest node that can take them",
        ),
    ],
)
def test_give_back_estimates_nodes_from_known_pods(hist, others, victim, after) -> None:
    cluster = capacity(hist)
    held: dict[str, int] = {}
    for node, gpus in others + victim:
        held[node] = held.get(node, 0) + gpus
    preemption.give_back(cluster, running("v", victim), held)
    assert cluster.models[H100].nodes_by_free == after


def ledger(queues, held: dict[str, dict[str, int]], fleet: dict[str, int]) -> quotas.Ledger:
    jobs = [
        snapshot.RunningJob(f"{q}-{m}", q, 0, "c1", {m: n})
        for q, gpus in held.items()
        for m, n in gpus.items()
    ]
    return quotas.Ledger.build(quotas.Tenancy(queues), jobs, fleet)


def test_dominant_share_weighs_models_and_queues() -> None:
    queues = config(queue("a"), queue("b"), queue("c", weight=2), modelWeights={H100: 4, T4: 1})
    book = ledger(queues, {"a": {H100: 8}, "b": {T4: 8}, "c": {H100: 8, T4: 8}}, {H100: 16, T4: 64})
    total = 4 * 16 + 1 * 64
    assert fairshare.dominant_share(book, "a") == pytest.approx(32 / total)
    assert fairshare.dominant_share(book, "b") == pytest.approx(8 / total)
    assert fairshare.dominant_share(book, "c") == pytest.approx(32 / total / 2)
    assert fairshare.dominant_share(book, "idle") == 0


def test_a_kept_dominant_share_follows_every_charge() -> None:
    queues = config(queue("a"), queue("b"), modelWeights={H100: 4, T4: 1})
    book = ledger(queues, {"a": {H100: 8}}, {H100: 16, T4: 64})
    total = 4 * 16 + 1 * 64
    assert fairshare.dominant_share(book, "a") == pytest.approx(32 / total)
    assert fairshare.dominant_share(book, "b") == 0
    book.charge("a", {H100: 4})  # placed in the cycle
    book.charge("b", {T4: 40})
    assert fairshare.dominant_share(book, "a") == pytest.approx(48 / total)
    assert fairshare.dominant_share(book, "b") == pytest.approx(40 / total)
    book.charge("a", {H100: 12}, sign=-1)  # a victim's GPUs given back
    assert fairshare.dominant_share(book, "a") == 0


def test_fair_shares_split_the_cohort_among_active_queues_by_weight() -> None:
    queues = config(queue("a"), queue("b"), queue("c", weight=2), queue("idle"))
    book = ledger(queues, {}, {H100: 96})
    shares = fairshare.fair_shares(book, ["a", "b", "c"])
    assert {q: s[H100] for q, s in shares.items()} == {"a": 24, "b": 24, "c": 48}


def test_queue_views_show_use_guarantee_fair_share_and_undeclared_queues() -> None:
    queues = config(queue("a", quotas={H100: (8, 16)}), queue("b", quotas={H100: (8, None)}))
    held = [
        running("a-1", [("n0", 8)]),
        running("a-2", [("n1", 4)]),
        running("x-1", [("n2", 2)], "x"),
    ]
    waiting = [make_job(gpus=1, queue="b").pending("b-1")]
    views = {
        v.name: v
        for v in usage.build_views(
            queues, running=held, pending=waiting, fleet_gpus={H100: 48}, preemptions={"a": 2}
        )
    }
    a = views["a"]
    assert (a.status.running_jobs, a.status.pending_jobs, a.status.preemptions) == (2, 0, 2)
    [gpus] = a.status.gpus
    assert (gpus.in_use, gpus.guaranteed, gpus.limit, gpus.fair_share) == (12, 8, 16, 16.0)
    assert views["b"].status.pending_jobs == 1 and views["b"].status.gpus[0].in_use == 0
    assert views["x"].declared is False and views["x"].status.gpus[0].in_use == 2


def test_running_view_counts_the_last_run_and_whole_gpus() -> None:
    record = status.JobRecord(id="j", tenant="t", job=make_job(gpus=2, queue="a").gang(2).build())
    for minutes, state in [(0, "Queued"), (1, "Dispatched"), (2, "Running"), (5, "Queued"),
                           (6, "Dispatched"), (7, "Running"), (9, "Running")]:  # fmt: skip
        record.record(status.JobState(state), "x", now=T0 + timedelta(minutes=minutes))
    record.status.cluster = "c1"
    record.status.pods = [
        status.PodStatus(
            name=f"p{i}", task="worker", node=f"n{i}", gpus=[status.GPUSlot(index=0),
            status.GPUSlot(index=1, milli=500)], phase=status.PodPhase.RUNNING,
        )
        for i in range(2)
    ]  # fmt: skip
    request = gangs.gang_request(record.id, record.job)
    view = holdings.running_view(
        record, request, models=None, cluster_models=[T4, H100], preempting=False
    )
    assert view.started == T0 + timedelta(minutes=7)
    assert view.gpus == {T4: 4}, "no model asked: the cluster's first model"
    assert [p.gpus for p in view.pods] == [1, 1], "a shared GPU is not whole"
    hinted = holdings.running_view(
        record, request, models={H100: 4}, cluster_models=[T4, H100], preempting=True
    )
    assert hinted.gpus == {H100: 4} and hinted.preempting


def test_holdings_kept_on_transitions_match_a_recount() -> None:
    book = holdings.Holdings()
    jobs = [
        running("a-1", [("n0", 8)]),
        running("a-2", [("n1", 4)]),
        running("b-1", [("n2", 2)], "b"),
    ]
    for job in jobs:
        book.hold(job.job_id, job.queue, job.gpus, (job.queue, 0, None))
    book.hold("a-1", "a", {H100: 8}, ("a", 0, None))  # twice: counted once
    book.release("a-2")
    book.release("never-held")
    kept = book.usage()
    recount = quotas.Usage.of([jobs[0], jobs[2]])
    assert {q: dict(g) for q, g in kept.gpus.items()} == {"a": {H100: 8}, "b": {H100: 2}}
    assert dict(kept.jobs) == dict(recount.jobs) == {"a": 1, "b": 1}
    assert kept.lowest_priority(quotas.Tenancy()) == 0
    book.reset([jobs[2]])
    assert {q: dict(g) for q, g in book.usage().gpus.items()} == {"b": {H100: 2}}
    assert "a-1" not in book and book.of("b-1") == ("b", {H100: 2})
