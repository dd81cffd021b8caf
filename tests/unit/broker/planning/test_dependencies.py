"""The pure parts of dependencies and arrays: the verdict on a waiting job's dependencies,
cycle detection, and the planner's bound on an array's jobs holding GPUs."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from broker.api.dependencies import Condition, Resolved
from broker.api.queues import ReasonCode
from broker.api.status import JobState
from broker.planning import dependencies, planning, snapshot
from broker.planning.backlog import backlog, parking
from tests.builders import T0, make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
S, F = Condition.SUCCEEDED, Condition.FINISHED


def dep(job: str, *ids: str, condition: Condition = S) -> Resolved:
    return Resolved(job=job, condition=condition, ids=list(ids))


@pytest.mark.parametrize(
    ("resolved", "states", "met", "failed", "waiting"),
    [
        pytest.param([dep("a", "a-1")], {"a-1": JobState.SUCCEEDED}, True, None, 0, id="succeeded"),
        pytest.param(
            [dep("a", "a-1")], {"a-1": JobState.RUNNING}, False, None, 1, id="running: waits"
        ),
        pytest.param(
            [dep("a", "a-1")],
            {"a-1": JobState.FAILED},
            False,
            "job a-1 ended Failed",
            0,
            id="failed dependency fails it",
        ),
        pytest.param(
            [dep("a", "a-1")],
            {"a-1": JobState.CANCELLED},
            False,
            "ended Cancelled",
            0,
            id="cancelled dependency fails it",
        ),
        pytest.param(
            [dep("a", "a-1", condition=F)],
            {"a-1": JobState.FAILED},
            True,
            None,
            0,
            id="Finished: any end meets it",
        ),
        pytest.param(
            [dep("a", "a-1", condition=F)],
            {"a-1": JobState.WAITING},
            False,
            None,
            1,
            id="Finished: a waiting dependency waits",
        ),
        pytest.param([dep("ghost")], {}, False, "no such job", 0, id="a name that found no job"),
        pytest.param([dep("a", "a-1")], {}, False, "is gone", 0, id="a job gone from everywhere"),
        pytest.param(
            [dep("a", "a-1"), dep("b", "b-1")],
            {"a-1": JobState.RUNNING, "b-1": JobState.FAILED},
            False,
            "b-1",
            0,
            id="one failed among waiting ones fails it",
        ),
        pytest.param(
            [dep("arr", "arr-0", "arr-1", "arr-2")],
            {"arr-0": JobState.SUCCEEDED, "arr-1": JobState.QUEUED, "arr-2": JobState.RUNNING},
            False,
            None,
            2,
            id="an array: every job of it",
        ),
    ],
)
def test_the_verdict_on_a_waiting_jobs_dependencies(
    resolved: list[Resolved],
    states: dict[str, JobState],
    met: bool,
    failed: str | None,
    waiting: int,
) -> None:
    verdict = dependencies.decide(resolved, states)
    assert verdict.met is met
    if failed is None:
        assert verdict.failed is None
    else:
        assert verdict.failed is not None and failed in verdict.failed
    assert len(verdict.waiting_for) == waiting


def test_a_waiting_verdict_names_what_it_waits_for() -> None:
    verdict = dependencies.decide(
        [dep("prep", "prep-1"), dep("fetch", "fetch-1", condition=F)],
        {"prep-1": JobState.RUNNING, "fetch-1": JobState.QUEUED},
    )
    assert verdict.waiting_for == (
        "job prep-1 (Running) to succeed",
        "job fetch-1 (Queued) to finish",
    )


@pytest.mark.parametrize(
    ("graph", "starts", "cycle"),
    [
        pytest.param({"a": ["b"], "b": ["c"], "c": []}, ["a"], None, id="a chain"),
        pytest.param({"a": ["a"]}, ["a"], ["a", "a"], id="itself"),
        pytest.param({"a": ["b"], "b": ["a"]}, ["a"], ["a", "b", "a"], id="two"),
        pytest.param(
            {"n": ["a"], "a": ["b"], "b": ["c"], "c": ["a"]},
            ["n"],
            ["a", "b", "c", "a"],
            id="a cycle further down",
        ),
        pytest.param(
            {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}, ["a"], None, id="a diamond"
        ),
        pytest.param({"a": ["x"]}, ["a"], None, id="a job outside the graph"),
    ],
)
def test_find_cycle(
    graph: dict[str, list[str]], starts: list[str], cycle: list[str] | None
) -> None:
    assert dependencies.find_cycle(starts, lambda j: graph.get(j, [])) == cycle


def test_find_cycle_follows_a_long_chain_without_recursion() -> None:
    chain = {str(i): [str(i + 1)] for i in range(50_000)}
    assert dependencies.find_cycle(["0"], lambda j: chain.get(j, [])) is None
    chain["50000"] = ["0"]
    found = dependencies.find_cycle(["0"], lambda j: chain.get(j, []))
    assert found is not None and found[0] == found[-1] == "0" and len(found) == 50_002


# ---- the planner's bound on an array ------------------------------------------------------


def _fleet(nodes: int = 20) -> snapshot.FleetSnapshot:
    free = [0] * 9
    free[8] = nodes
    summary = make_summary("c", make_model_summary(H100, nodes_by_free=free))
    capacity = snapshot.ClusterCapacity.from_summary(summary, healthy=True)
    return snapshot.FleetSnapshot.build([capacity])


def _member(index: int, *, array: str = "sweep-abc", parallelism: int = 3) -> snapshot.PendingJob:
    return make_job(f"sweep-{index}", gpus=1).pending(
        f"{array}-{index}",
        created=T0 + timedelta(seconds=index),
        array=snapshot.ArrayLimit(array, parallelism),
    )


@pytest.mark.parametrize(
    ("holding", "placed"),
    [
        pytest.param(0, 3, id="none holding: parallelism placed"),
        pytest.param(2, 1, id="two holding: one more"),
        pytest.param(3, 0, id="full: none"),
        pytest.param(5, 0, id="over (a smaller parallelism read back): none"),
    ],
)
def test_the_planner_places_at_most_parallelism_of_an_array(holding: int, placed: int) -> None:
    members = [_member(i) for i in range(10)]
    plan = planning.plan_cycle(_fleet(), members, array_holding={"sweep-abc": holding})
    assert len(plan.assignments) == placed
    assert [a.job_id for a in plan.assignments] == [f"sweep-abc-{i}" for i in range(placed)]
    waiting = {u.job_id: u for u in plan.unplaceable}
    assert len(waiting) == 10 - placed
    for miss in waiting.values():
        assert [d.code for d in miss.details] == [ReasonCode.ARRAY_PARALLELISM]
        assert "parallelism is 3" in miss.details[0].message


def test_two_arrays_and_a_plain_job_are_bounded_apart() -> None:
    jobs = [_member(i, array="a-1") for i in range(4)] + [
        _member(i, array="b-1", parallelism=1) for i in range(4)
    ]
    plain = dataclasses.replace(_member(0, array="x"), job_id="plain", array=None)
    plan = planning.plan_cycle(_fleet(), [*jobs, plain])
    placed = sorted(a.job_id for a in plan.assignments)
    assert placed == ["a-1-0", "a-1-1", "a-1-2", "b-1-0", "plain"]


def test_a_job_held_back_by_its_array_is_never_parked() -> None:
    members = [_member(i) for i in range(6)]
    parked = backlog.Backlog()
    for member in members:
        parked.put(member)
    # a full fleet: a witness of no room would park them, were it not for their array
    cycle = parking.plan_backlog(parked, _fleet(0), previous=None, array_holding={"sweep-abc": 3})
    assert not cycle.plan.assignments
    assert not cycle.parks  # they act once one of the array's jobs ends: planned every cycle


def array_dep(condition: Condition = S) -> Resolved:
    return Resolved(job="sweep", condition=condition, array="sw", count=3)


@pytest.mark.parametrize(
    ("entry", "states", "met", "failed", "waiting"),
    [
        pytest.param(
            array_dep(),
            dict.fromkeys(("sw-0", "sw-1", "sw-2"), JobState.SUCCEEDED),
            True,
            None,
            None,
            id="every job succeeded",
        ),
        pytest.param(
            array_dep(),
            {"sw-0": JobState.SUCCEEDED, "sw-1": JobState.RUNNING, "sw-2": JobState.QUEUED},
            False,
            None,
            "array 'sweep': 2 of its 3 jobs to succeed (job sw-1: Running)",
            id="two not ended: one line, the first named",
        ),
        pytest.param(
            array_dep(),
            {"sw-0": JobState.RUNNING, "sw-1": JobState.SUCCEEDED, "sw-2": JobState.FAILED},
            False,
            "job sw-2 of the array ended Failed",
            None,
            id="one failed while others run: fails at once",
        ),
        pytest.param(
            array_dep(F),
            {"sw-0": JobState.CANCELLED, "sw-1": JobState.SUCCEEDED, "sw-2": JobState.FAILED},
            True,
            None,
            None,
            id="Finished: any ends meet it",
        ),
        pytest.param(
            array_dep(F),
            {"sw-0": JobState.SUCCEEDED, "sw-2": JobState.SUCCEEDED},
            False,
            "job sw-1 of the array is gone",
            None,
            id="a job gone fails it",
        ),
    ],
)
def test_an_array_by_reference_is_decided_from_its_jobs(
    entry: Resolved,
    states: dict[str, JobState],
    met: bool,
    failed: str | None,
    waiting: str | None,
) -> None:
    verdict = dependencies.decide(
        [entry], {}, {"sw": dependencies.summarize(entry.member_ids(), states)}
    )
    assert verdict.met is met
    assert (verdict.failed is None) is (failed is None)
    if failed is not None:
        assert verdict.failed is not None and failed in verdict.failed
    assert verdict.waiting_for == ((waiting,) if waiting else ())
    assert dependencies.decide([entry], states) == verdict  # the same without the summary
