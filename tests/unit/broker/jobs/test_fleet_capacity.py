"""A cluster's capacity for planning (`fleet.Cluster.capacity`): its summary less every offer
in flight. Kept between cycles and deducted only for offers sent since, it must read as if
built whole each time, whatever comes and goes."""

from __future__ import annotations

import copy
import random
from datetime import UTC, datetime

from broker.api import gangs, messages
from broker.jobs import fleet
from broker.planning import fitting, planning, snapshot
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"


def summary(seq: int, free_nodes: int) -> messages.Summary:
    hist = [0] * 8 + [free_nodes]
    racks = {"r1": [0] * 8 + [free_nodes // 2], "r2": [0] * 8 + [free_nodes - free_nodes // 2]}
    model = make_model_summary(H100, nodes_by_free=hist, racks=racks)
    return messages.Summary(summary=make_summary("east", model, seq=seq), full=True)


def offer(gpus: int, rack: str | None = None) -> fleet.InFlight:
    return fleet.InFlight(fit=fitting.Fit("east", (fitting.Take(H100, rack, 8, gpus),), 8 - gpus))


def whole(cluster: fleet.Cluster) -> snapshot.ClusterCapacity:
    """What the capacity is: the summary's, every offer deducted in the order sent."""
    assert cluster.summary is not None
    built = snapshot.ClusterCapacity.from_summary(cluster.summary, healthy=True)
    for flight in cluster.inflight.values():
        fitting.assume(built, flight.fit)
    return built


def test_the_kept_capacity_reads_as_if_built_whole_each_cycle() -> None:
    rng = random.Random(7)
    cluster = fleet.Cluster(name="east")
    cluster.apply_summary(summary(1, 40))
    seq, n = 1, 0
    handed: list[tuple[snapshot.ClusterCapacity, snapshot.ClusterCapacity]] = []
    for _ in range(600):
        step = rng.random()
        if step < 0.45:  # an offer sent
            n += 1
            cluster.inflight[f"j{n}"] = offer(rng.choice([1, 2, 4, 8]), rng.choice([None, "r1"]))
        elif step < 0.55 and cluster.inflight:  # an offer rejected or timed out
            cluster.inflight.pop(rng.choice(list(cluster.inflight)))
        elif step < 0.6 and cluster.inflight:  # withdrawn once a summary showed it
            del cluster.inflight[rng.choice(list(cluster.inflight))]
        elif step < 0.7 and cluster.inflight:  # the same job offered again, another fit
            cluster.inflight[rng.choice(list(cluster.inflight))] = offer(rng.choice([1, 8]))
        elif step < 0.8 and cluster.inflight:  # accepted: left out once a summary shows it
            cluster.accept(rng.choice(list(cluster.inflight)))
        elif step < 0.87:
            seq += 1
            cluster.apply_summary(summary(seq, rng.randint(5, 40)))
        elif step < 0.9:
            cluster.forget_offers()  # the session ended
        given = cluster.capacity()
        assert given == whole(cluster)
        handed.append((given, copy.deepcopy(given)))
        unanswered = sum(not f.accepted for f in cluster.inflight.values())
        assert cluster.inflight.unanswered == unanswered  # counted, not walked
        if step >= 0.8 and step < 0.87:
            assert not any(f.accepted for f in cluster.inflight.values())  # shown in it now
    # copy on write: a capacity once handed to a cycle is never changed afterwards
    assert all(given == as_given for given, as_given in handed)
    assert len({id(given) for given, _ in handed}) < len(handed)  # unchanged: the same one


def test_a_cycle_placing_on_it_changes_no_later_cycle() -> None:
    cluster = fleet.Cluster(name="east")
    cluster.apply_summary(summary(1, 4))
    cluster.inflight["a"] = offer(8)
    fleet_view = snapshot.FleetSnapshot.build([cluster.capacity(offer_slots=1)])
    job = make_job("b", gpus=8).build()
    pending = snapshot.PendingJob("b", "q", 0, datetime(2026, 1, 1, tzinfo=UTC),
                                  gangs.gang_request("b", job))  # fmt: skip
    plan = planning.plan_cycle(fleet_view, [pending])
    assert [a.cluster for a in plan.assignments] == ["east"]
    assert fleet_view.clusters["east"].models[H100].nodes_by_free[8] == 2  # its copy, changed
    assert cluster.capacity(offer_slots=1) == whole(cluster).reshaped(
        offer_slots=1, scored_down=False
    )
    assert cluster.capacity().models[H100].nodes_by_free[8] == 3


def test_the_fleet_total_is_the_snapshot_total_without_building_capacity() -> None:
    clusters = fleet.Fleet()
    for name, free in (("east", 40), ("west", 3)):
        cluster = fleet.Cluster(name=name, link=object(), last_seen=1.0)  # type: ignore[arg-type]
        model = make_model_summary(H100, nodes_by_free=[0] * 8 + [free])
        cluster.summary = make_summary(name, model)
        cluster.inflight["j"] = offer(8)  # offers in flight take free GPUs, not total ones
        clusters.clusters[name] = cluster
    clusters.clusters["gone"] = fleet.Cluster(name="gone")  # no summary: not planned
    assert clusters.total_gpus(now=1.0) == clusters.snapshot(now=1.0).total_gpus()
    assert clusters.total_gpus(now=1.0) == {H100: 43 * 8}
