"""When a job parks and what wakes it: one named case per rule (`planning.backlog.parking`), each
driven through the full re-plan and the parked backlog side by side (`backlogs.Twins`), so
every case also checks that both decide the same."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.planning import fitting, snapshot
from broker.planning.backlog import backlog, bounds
from tests.builders import make_job
from tests.unit.broker.planning.backlogs import (
    A100,
    H100,
    JobSpec,
    Outcome,
    Twins,
    World,
    differences,
)

BIG = JobSpec(gpus=8, pods=6, queue="open")  # 48 GPUs: more than any cluster has


def cycle(twins: Twins) -> Outcome:
    outcome = twins.cycle()
    assert not differences(outcome)
    return outcome


def planned(outcome: Outcome) -> set[str]:
    return {job.job_id for job in outcome.parked.planned}


def world_of(config: int, *, busy: bool = False) -> tuple[World, Twins]:
    world = World()
    world.configure(config)
    if busy:  # every node of c1 and c2 full
        for cluster in world.clusters.values():
            for node in cluster.nodes:
                node.free = 0
    return world, Twins(world)


def test_a_job_that_fits_nowhere_parks_and_a_quiet_cycle_plans_nothing() -> None:
    world, twins = world_of(0)
    big = world.submit(BIG)
    small = world.submit(JobSpec(gpus=1, queue="open"))
    first = cycle(twins)
    assert [a.job_id for a in first.full.assignments] == [small]
    assert [p.job.job_id for p in first.parked.parks] == [big]
    quiet = cycle(twins)
    assert planned(quiet) == set()
    assert quiet.full.unplaceable[0].job_id == big  # the full plan tells it the same again


@pytest.mark.parametrize(
    ("freed", "woken"),
    [
        pytest.param(1, False, id="one node free: a gang of two still cannot fit"),
        pytest.param(2, True, id="two nodes free: it could, it is planned and placed"),
    ],
)
def test_freed_capacity_wakes_only_past_the_witness(freed: int, woken: bool) -> None:
    world, twins = world_of(0, busy=True)
    gang = world.submit(JobSpec(gpus=8, pods=2, queue="open", models=(H100,)))
    [park] = cycle(twins).parked.parks
    assert [w.need for w in park.wake.witnesses if w.bound.cluster == "c1"] == [2]
    for node in range(freed):
        world.set_free("c1", node, 8)
    outcome = cycle(twins)
    assert (gang in planned(outcome)) is woken
    assert (gang in {a.job_id for a in outcome.full.assignments}) is woken


def test_a_queue_at_its_limit_parks_until_one_of_its_jobs_ends() -> None:
    world, twins = world_of(1)
    first = world.submit(JobSpec(gpus=8, queue="b", models=(H100,)))  # b: 8 H100 at most
    cycle(twins)
    second = world.submit(JobSpec(gpus=4, queue="b", models=(H100,)))
    outcome = cycle(twins)
    codes = {r.code.value for u in outcome.full.unplaceable for r in u.details}
    assert codes == {"BorrowingLimit"}
    assert [p.job.job_id for p in outcome.parked.parks] == [second]
    assert planned(cycle(twins)) == set()
    world.finish(0)
    assert first not in world.running
    outcome = cycle(twins)
    assert planned(outcome) == {second}
    assert [a.job_id for a in outcome.full.assignments] == [second]


def test_a_queue_reaching_its_limit_wakes_its_parked_job_for_what_why_says() -> None:
    """Admitted when it parked (borrowing, no room), refused once its queue holds more:
    `why` must say BorrowingLimit, not Capacity, so the rise wakes it once."""
    world, twins = world_of(2, busy=True)  # a may hold 16 H100
    gang = world.submit(JobSpec(gpus=8, pods=2, queue="a", models=(H100,)))
    first = cycle(twins)
    assert [p.job.job_id for p in first.parked.parks] == [gang]
    assert {r.code.value for r in twins.why[gang].details} == {"Capacity", "FairShare"}
    world.set_free("c1", 0, 8)  # room for one node: not for the gang
    small = world.submit(JobSpec(gpus=8, queue="a", models=(H100,)))
    assert [a.job_id for a in cycle(twins).full.assignments] == [small]
    outcome = cycle(twins)  # a holds 8 now: 8 + 16 is past its limit
    assert gang in planned(outcome)
    assert {r.code.value for r in twins.why[gang].details} == {"BorrowingLimit"}
    assert gang in twins.backlog.parked()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda w: w.configure(2), id="the queues edited"),
        pytest.param(lambda w: w.toggle("c3", "present"), id="a cluster joined"),
        pytest.param(lambda w: w.toggle("c2", "healthy"), id="a cluster's health changed"),
        pytest.param(lambda w: w.toggle("c1", "grow"), id="a cluster grew a node"),
    ],
)
def test_what_changes_the_fleet_or_the_queues_wakes_every_parked_job(change) -> None:
    world, twins = world_of(1, busy=True)
    jobs = {world.submit(JobSpec(gpus=8, pods=3, queue=q)) for q in ("a", "c", "open")}
    assert {p.job.job_id for p in cycle(twins).parked.parks} == jobs
    assert planned(cycle(twins)) == set()
    change(world)
    assert planned(cycle(twins)) >= jobs


def test_a_job_its_selector_excludes_everywhere_parks_and_a_label_change_wakes_it() -> None:
    """With room on c1 and within its queue's guarantee (it could reclaim, so it would be
    planned every cycle), a job whose spec.clusters matches no cluster's labels has nothing
    to do: it parks, and wakes once a cluster is labelled so it is allowed there."""
    world, twins = world_of(1)  # preemption and reservations on
    nowhere = world.submit(JobSpec(gpus=8, queue="a", models=(H100,), clusters="nowhere"))
    first = cycle(twins)
    assert [p.job.job_id for p in first.parked.parks] == [nowhere]
    (miss,) = first.full.unplaceable
    assert {(r.cluster, r.code.value) for r in miss.details} == {
        ("c1", "ClusterSelector"),
        ("c2", "ClusterSelector"),
    }
    assert planned(cycle(twins)) == set()
    world.clusters["c2"].labels = {"region": "mars"}  # an A100 cluster with 4-GPU H100 nodes
    outcome = cycle(twins)
    assert nowhere in outcome.parked.woken
    assert outcome.full.assignments == []  # no 8-GPU H100 node there
    # allowed somewhere and within its guarantee, it could reclaim: planned every cycle
    assert outcome.parked.parks == []
    assert planned(cycle(twins)) == {nowhere}
    world.clusters["c1"].labels = {"region": "mars"}
    outcome = cycle(twins)
    assert [(a.job_id, a.cluster) for a in outcome.full.assignments] == [(nowhere, "c1")]


def test_a_lower_priority_holding_gpus_wakes_a_job_that_may_preempt_it() -> None:
    """Nothing of the capacity it needs came free, yet it preempts: the broker's estimate of
    the GPUs a victim gives back (`preemption.give_back`) puts them on a node of 7 free."""
    world, twins = world_of(4, busy=True)  # open queues, one preemption a cycle
    world.set_free("c1", 0, 7)
    world.set_free("c1", 1, 7)
    waiting = world.submit(JobSpec(gpus=8, queue="open", models=(H100,)))
    [park] = cycle(twins).parked.parks
    assert park.wake.priority == 0  # it may preempt a lower priority; none holds GPUs yet
    low = world.submit(JobSpec(gpus=1, queue="open", klass="low", models=(H100,)))
    outcome = cycle(twins)
    assert [a.job_id for a in outcome.full.assignments] == [low]
    assert planned(outcome) == {low}
    outcome = cycle(twins)
    assert waiting in outcome.parked.woken
    assert [(p.job_id, p.preemptor) for p in outcome.full.preemptions] == [(low, waiting)]


def test_time_alone_makes_a_parked_job_due_for_a_reservation() -> None:
    world, twins = world_of(1, busy=True)  # reserveAfterSeconds 120, one reservation
    world.set_free("c1", 0, 8)
    gang = world.submit(JobSpec(gpus=8, pods=3, queue="open", models=(H100,)))
    assert [p.job.job_id for p in cycle(twins).parked.parks] == [gang]
    world.advance(60)
    assert planned(cycle(twins)) == set()
    world.advance(70)
    outcome = cycle(twins)
    assert outcome.parked.woken == {gang}  # due now: planned, and reserved
    assert set(outcome.full.reservations) == {gang}


def test_a_slot_freed_in_phase_two_wakes_a_parked_due_job_in_the_same_cycle() -> None:
    world, twins = world_of(1, busy=True)  # one reservation at most
    world.set_free("c1", 0, 8)
    holder = world.submit(JobSpec(gpus=8, pods=3, queue="open", models=(H100,)))
    waiting = world.submit(JobSpec(gpus=8, pods=4, queue="open", models=(H100,)))
    cycle(twins)
    world.advance(130)
    outcome = cycle(twins)  # both due: the first in the order holds the reservation
    assert set(outcome.full.reservations) == {holder}
    assert [p.job.job_id for p in outcome.parked.parks] == [waiting]
    assert planned(cycle(twins)) == {holder, waiting}  # told of the reservation made
    assert planned(cycle(twins)) == {holder}  # a holder is planned every cycle
    world.set_free("c1", 1, 8)
    world.set_free("c1", 2, 8)  # room for the holder (3 nodes), not for it (4)
    outcome = cycle(twins)
    assert [a.job_id for a in outcome.full.assignments] == [holder]
    assert outcome.parked.rounds == 2  # planned again: phase 2 left the slot free
    assert set(outcome.full.reservations) == {waiting}


def test_a_parked_borrower_ahead_of_a_job_within_its_guarantee_keeps_its_turn() -> None:
    """Head of line: queue a's parked head borrows (tier 1), so queue c's job of a higher
    priority goes first and takes the free node; the job behind it in queue a, within a's
    guarantee (tier 0), would go first if the parked head were left out."""
    world, twins = world_of(2, busy=True)  # no preemption
    world.set_free("c1", 0, 8)
    ahead = world.submit(JobSpec(gpus=8, pods=3, queue="a", models=(H100,)))
    assert [p.job.job_id for p in cycle(twins).parked.parks] == [ahead]
    behind = world.submit(JobSpec(gpus=1, queue="a", models=(H100,)))
    other = world.submit(JobSpec(gpus=8, queue="c", priority=5, models=(H100,)))
    outcome = cycle(twins)
    assert outcome.parked.stand_ins == [ahead]  # it takes its turn, and is not planned
    assert planned(outcome) == {behind, other}
    assert [a.job_id for a in outcome.full.assignments] == [other]
    assert behind in {u.job_id for u in outcome.parked.plan.unplaceable}


def test_every_shape_of_parked_job_ahead_keeps_its_turn() -> None:
    """The chain of parked jobs ahead of a job acts as its largest heap key: here a
    borrower's (tier 1), ahead of a job within the guarantee that does not fit (tier 0).
    Standing in the last parked job alone would put queue a's next job first."""
    world, twins = world_of(2, busy=True)  # no preemption: jobs within a guarantee park
    world.set_free("c1", 0, 7)
    borrower = world.submit(JobSpec(gpus=8, pods=2, queue="a", models=(H100,)))
    world.advance(1)
    within = world.submit(JobSpec(gpus=8, queue="a", models=(H100,)))  # no node has 8
    assert {p.job.job_id for p in cycle(twins).parked.parks} == {borrower, within}
    behind = world.submit(JobSpec(gpus=1, queue="a", models=(H100,)))
    other = world.submit(JobSpec(gpus=7, queue="c", priority=5, models=(H100,)))
    outcome = cycle(twins)
    assert sorted(outcome.parked.stand_ins) == sorted([borrower, within])
    assert [a.job_id for a in outcome.full.assignments] == [other]
    assert behind in {u.job_id for u in outcome.full.unplaceable}


def test_a_rejected_job_stays_in_the_plan_and_a_changed_job_is_live_again() -> None:
    world, twins = world_of(0, busy=True)
    gang = world.submit(JobSpec(gpus=8, pods=2, queue="open"))
    assert [p.job.job_id for p in cycle(twins).parked.parks] == [gang]
    world.reject(0, "c1")  # its record changed: planned again, and not parked while excluded
    outcome = cycle(twins)
    assert gang in planned(outcome)
    assert outcome.parked.parks == []
    world.refresh()
    assert [p.job.job_id for p in cycle(twins).parked.parks] == [gang]


def test_jobs_of_one_class_parked_in_different_cycles_hold_one_wake() -> None:
    """A class's jobs arrive over many cycles, each cycle deciding its own (equal) wake: the
    backlog keeps the first, so a queued job does not hold a copy of its own."""
    world, twins = world_of(1, busy=True)
    world.submit(JobSpec(gpus=8, pods=3, queue="a"))
    cycle(twins)
    world.submit(JobSpec(gpus=8, pods=3, queue="a"))
    cycle(twins)
    parks = [twins.backlog.park_of(job_id) for job_id in twins.backlog.parked()]
    assert len(parks) == 2 and all(p is not None for p in parks)
    first, second = (p.wake for p in parks if p is not None)
    assert first == second and first is second


def test_an_emptied_backlog_keeps_no_index() -> None:
    world, twins = world_of(1, busy=True)
    for queue in ("a", "b", "c", "open"):
        world.submit(JobSpec(gpus=8, pods=3, queue=queue))
    world.submit(JobSpec(gpus=2, pods=9, queue="a", rack="required"))
    cycle(twins)
    assert len(twins.backlog.parked()) >= 3
    for _ in range(len(world.pending)):
        world.cancel(0)
    cycle(twins)
    fresh = backlog.Backlog()
    assert vars(twins.backlog) == vars(fresh)


# ---- the bounds: a witness proves no fit, and holds while GPUs are taken -----------------


def capacity(hist: list[int], *, racks: dict[str, list[int]] | None = None, model: str = H100):
    return snapshot.ClusterCapacity(
        "c",
        True,
        {
            model: snapshot.ModelCapacity(
                model=model,
                gpu_memory_mib=81920,
                nodes_by_free=hist,
                shared_free_milli=0,
                largest_free_nvlink_block=max((f for f, n in enumerate(hist) if n), default=0),
                racks=racks or {},
                total_gpus=8 * sum(hist),
            )
        },
    )


@pytest.mark.parametrize(
    ("hist", "racks", "job", "expected"),
    [
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 0, 2],
            None,
            make_job(gpus=5).gang(3),
            (bounds.SLOTS, 5, 3),
            id="3 pods of 5 on two free nodes: one pod a node",
        ),
        pytest.param(
            [4, 0, 0, 0, 4, 0, 0, 0, 0],
            None,
            make_job(gpus=8),
            (bounds.SLOTS, 8, 1),
            id="a whole node wanted, only halves free",
        ),
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 0, 3],
            None,
            make_job(gpus=8).gang(3),
            None,
            id="it fits: no witness",
        ),
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 0, 4],
            {"r1": [0] * 8 + [2], "r2": [0] * 8 + [2]},
            make_job(gpus=8).gang(3).topology(rack="required"),
            (bounds.SLOTS, 8, 3),
            id="rack required: no rack has three free nodes",
        ),
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 0, 4],
            None,
            make_job(gpus=8).model(A100),
            (),
            id="a model it may not use: certain, nothing to watch",
        ),
    ],
)
def test_witnesses(hist, racks, job, expected) -> None:
    cluster = capacity(hist, racks=racks)
    request = job.request("j")
    found = bounds.witness(cluster, request, frozenset({H100, A100}))
    if expected is None or expected == ():
        assert found == expected
        return
    assert found is not None
    [witness] = found
    assert (witness.bound.kind, witness.bound.at, witness.need) == expected
    assert isinstance(fitting.fit_gang(cluster, request), fitting.NoFit)


hists = st.lists(st.integers(0, 4), min_size=9, max_size=9)
shapes = st.tuples(
    st.sampled_from([1, 2, 3, 4, 5, 6, 8]),
    st.integers(1, 6),
    st.sampled_from(["none", "preferred", "required"]),
    st.sampled_from([None, (2, 1), (4, 2)]),
)


@settings(max_examples=400, deadline=None)
@given(hist=hists, racked=st.booleans(), shape=shapes, taken=st.lists(st.integers(0, 8)))
def test_a_witness_is_a_proof_of_no_fit_while_gpus_are_taken(hist, racked, shape, taken) -> None:
    gpus, pods, rack, second = shape
    builder = make_job(gpus=gpus).gang(pods).topology(rack=rack)
    if second is not None:
        builder.task("other", gpus=second[0], replicas=second[1])
    request = builder.request("j")
    racks = None
    if racked:  # two racks splitting the nodes of each bucket
        racks = {"r1": [n // 2 for n in hist], "r2": [n - n // 2 for n in hist]}
    cluster = capacity(list(hist), racks=racks)
    found = bounds.witness(cluster, request, frozenset({H100}))
    if found is None:
        return
    assert isinstance(fitting.fit_gang(cluster, request, models=frozenset({H100})), fitting.NoFit)
    for bucket in taken:  # take GPUs: a node of `bucket` free loses one (the fit assumed)
        model = cluster.models[H100]
        if bucket and model.nodes_by_free[bucket]:
            model.nodes_by_free[bucket] -= 1
            model.nodes_by_free[bucket - 1] += 1
            for counts in model.racks.values():
                if counts[bucket]:
                    counts[bucket] -= 1
                    counts[bucket - 1] += 1
                    break
        for witness in found:
            assert bounds.value(cluster, witness.bound) < witness.need
        assert isinstance(fitting.fit_gang(cluster, request), fitting.NoFit)


def test_pods_of_a_fraction_of_a_gpu_are_left_out_of_the_bounds() -> None:
    request = make_job(gpus=1).shared(500).request("j")
    assert bounds.demand(request) == []
    assert bounds.witness(capacity([4] + [0] * 8), request, frozenset({H100})) is None
