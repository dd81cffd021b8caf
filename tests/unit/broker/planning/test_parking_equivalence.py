"""Parking changes no decision: random sequences of events — submits of every shape, size,
model, priority, queue and `spec.clusters`; jobs finishing and requeued; cancels and
rejections; nodes' free GPUs changing; clusters joining, leaving, failing, growing,
relabelled; the queues configuration edited; time passing — driven through cycles planned
twice, once over every pending job (`planning.plan_cycle`) and once over the backlog with its
parked jobs (`parking.plan_backlog`). Every cycle must dispatch, preempt, reserve and set
aside the same, and tell each job it planned the same reasons."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from tests.unit.broker.planning.backlogs import (
    A100,
    H100,
    JobSpec,
    Twins,
    World,
    differences,
    settled,
    stale,
)

specs = st.builds(
    JobSpec,
    gpus=st.sampled_from([1, 2, 4, 8, 8]),
    pods=st.sampled_from([1, 1, 2, 3, 4, 6, 8]),
    models=st.sampled_from([(), (), (H100,), (A100,), (H100, A100)]),
    rack=st.sampled_from(["none", "none", "preferred", "required"]),
    nvlink=st.sampled_from(["none", "none", "none", "required"]),
    queue=st.sampled_from(["a", "a", "b", "c", "open"]),
    priority=st.sampled_from([0, 0, 5, 10]),
    klass=st.sampled_from([None, None, "low", "high"]),
    shared=st.sampled_from([False] * 9 + [True]),
    cpu_task=st.sampled_from([False] * 9 + [True]),
    clusters=st.sampled_from(["", "", "", "", "eu", "spot", "nowhere", "order", "prefer"]),
)
clusters = st.sampled_from(["c1", "c2", "c3"])
events = st.one_of(
    st.tuples(st.just("submit"), specs),
    st.tuples(st.just("submit"), specs),
    st.tuples(st.just("submit"), specs),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("requeue"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("reject"), st.integers(0, 50), clusters),
    st.tuples(st.just("refresh")),
    st.tuples(st.just("free"), clusters, st.integers(0, 9), st.integers(0, 8)),
    st.tuples(st.just("toggle"), clusters, st.sampled_from(["present", "healthy", "grow"])),
    st.tuples(st.just("configure"), st.integers(0, 4)),
    st.tuples(st.just("relabel"), clusters, st.integers(0, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 5, 25, 70, 130, 400])),
)
histories = st.lists(st.lists(events, min_size=1, max_size=6), min_size=8, max_size=40)


def play(world: World, event: tuple[Any, ...]) -> None:
    kind, *args = event
    if kind == "submit":
        world.submit(args[0])
    elif kind == "finish":
        world.finish(args[0])
    elif kind == "requeue":
        world.requeue(args[0])
    elif kind == "cancel":
        world.cancel(args[0])
    elif kind == "reject":
        world.reject(args[0], args[1])
    elif kind == "refresh":
        world.refresh()
    elif kind == "free":
        world.set_free(*args)
    elif kind == "toggle":
        world.toggle(*args)
    elif kind == "relabel":
        world.relabel(*args)
    elif kind == "configure":
        world.configure(args[0])
    else:
        world.advance(args[0])


def replay(history: list[list[tuple[Any, ...]]], *, first: int, max_assignments: int) -> Twins:
    world = World()
    world.configure(first)
    twins = Twins(world, max_assignments=max_assignments)
    for step, batch in enumerate(history):
        for event in batch:
            play(world, event)
        outcome = twins.cycle()
        found = differences(outcome)
        assert not found, f"cycle {step}: " + "; ".join(found)
    # then nothing happens: once the full plan decides nothing new, every parked job's why
    # (its last reasons) is what the full plan tells it
    for _ in range(12):
        before = dict(twins.kept_full)
        outcome = twins.cycle()
        assert not differences(outcome)
        if settled(outcome, before) and not world.releasing:
            outcome = twins.cycle()
            found = stale(twins, outcome)
            assert not found, "settled, yet: " + "; ".join(found)
            break
    return twins


@pytest.mark.timeout(600)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    history=histories,
    first=st.integers(0, 4),
    max_assignments=st.sampled_from([10_000, 10_000, 2]),
)
def test_parked_backlog_decides_as_the_full_replan(
    history: list[list[tuple[Any, ...]]], first: int, max_assignments: int
) -> None:
    twins = replay(history, first=first, max_assignments=max_assignments)
    target(float(twins.cycles_parked), label="cycles with parked jobs")


def test_the_random_histories_do_park_jobs() -> None:
    """The property above is only worth something if jobs park in it: a backlog that does
    not fit, a few that do, and the events of every kind between cycles."""
    world = World()
    world.configure(1)
    twins = Twins(world)
    big = JobSpec(gpus=8, pods=6, queue="a")
    history: list[list[tuple[Any, ...]]] = [
        [("submit", big), ("submit", big), ("submit", JobSpec(gpus=1, queue="b"))],
        [("submit", JobSpec(gpus=4, pods=2, queue="c", models=(A100,)))],
        [("advance", 5)],
        [("free", "c1", 0, 8), ("finish", 0)],
        [("advance", 130)],
        [("toggle", "c3", "present")],
        [("configure", 3)],
        [("advance", 70), ("submit", big)],
    ]
    for batch in history:
        for event in batch:
            play(world, event)
        assert not differences(twins.cycle())
    assert twins.most_parked >= 2
    assert twins.cycles_parked >= 3


# found by the test above: a job parked while told WaitingForReservation, in the cycle that
# turned reservations off (the reservation still held), was never woken when it ended
RESERVATION_ENDS_AFTER_THEY_WERE_TURNED_OFF = [
    [("submit", JobSpec(gpus=1, queue="a"))] * 5 + [("toggle", "c1", "present")],
    [("submit", JobSpec(gpus=1, queue="a")), ("finish", 25)],
    [
        ("finish", 31),
        ("submit", JobSpec(gpus=8, pods=2, rack="required", queue="open")),
        ("refresh",),
        ("finish", 0),
    ],
    [
        ("finish", 0),
        ("finish", 17),
        ("finish", 0),
        ("submit", JobSpec(gpus=1, queue="a")),
        ("reject", 0, "c2"),
    ],
    [
        ("finish", 20),
        ("advance", 130),
        ("finish", 0),
        ("submit", JobSpec(gpus=1, queue="a")),
        ("submit", JobSpec(gpus=1, queue="a")),
        ("submit", JobSpec(gpus=1, models=(A100,), queue="a")),
    ],
    [
        ("submit", JobSpec(gpus=1, queue="a")),
        ("requeue", 0),
        ("reject", 0, "c1"),
        ("submit", JobSpec(gpus=8, pods=4, queue="a")),
        ("configure", 1),
    ],
    [("finish", 0), ("configure", 0)],
    [("submit", JobSpec(gpus=1, queue="a")), ("finish", 0)],
]


def test_a_job_told_of_a_reservation_hears_when_it_ends_after_reservations_were_off() -> None:
    replay(RESERVATION_ENDS_AFTER_THEY_WERE_TURNED_OFF, first=0, max_assignments=2)
