"""Which cluster a job goes to is found without fitting every cluster (`_Cycle._search`:
clusters walked busiest first, a fit that leaves nothing idle ends the walk), and it must be
the cluster fitting every one and ranking them would choose. A job with `spec.clusters` is
planned by fitting every cluster (`_survey`); a selector that allows every cluster and ranks
them all alike makes the same choice, so the same jobs planned both ways must get the same
plan, cycle after cycle, over random fleets."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from broker.api import clusterchoice
from broker.planning import fitting, planning, snapshot
from tests.builders import make_job, make_model_summary, make_summary

MODELS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
ANYWHERE = clusterchoice.Choice()  # every cluster allowed, all ranked alike


def random_fleet(rng: random.Random, clusters: int) -> snapshot.FleetSnapshot:
    out = []
    for n in range(clusters):
        models = []
        for model in rng.sample(MODELS, rng.choice([1, 2])):
            racks = {}
            for rack in range(rng.randint(1, 3)):
                weights = rng.choice([[8, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 9, [1] * 8 + [6]])
                hist = [0] * 9
                for _ in range(rng.randint(0, 12)):
                    hist[rng.choices(range(9), weights)[0]] += 1
                racks[f"r{rack}"] = hist
            total = [sum(h[k] for h in racks.values()) for k in range(9)]
            models.append(make_model_summary(model, nodes_by_free=total, racks=racks))
        capacity = snapshot.ClusterCapacity.from_summary(
            make_summary(f"c{n:02d}", *models), healthy=rng.random() > 0.1
        )
        capacity.offer_slots = rng.choice([None, None, 0, 1, 3])
        capacity.scored_down = rng.random() < 0.2
        out.append(capacity)
    return snapshot.FleetSnapshot.build(out)


def random_job(rng: random.Random, n: int, clusters: int) -> snapshot.PendingJob:
    kind = rng.choice(["one", "two", "eight", "gang", "rack", "nvlink", "model"])
    builder = make_job(f"j{n}", gpus={"one": 1, "two": 2}.get(kind, rng.choice([1, 4, 8])))
    if kind in ("gang", "rack", "nvlink"):
        builder = builder.gang(rng.randint(2, 6))
    if kind == "rack":
        builder = builder.topology(rack=rng.choice(["preferred", "required"]))
    if kind == "nvlink":
        builder = builder.topology(nvlink="required")
    if kind == "model":
        builder = builder.model(rng.choice(MODELS))
    excluded = frozenset(f"c{k:02d}" for k in range(clusters) if rng.random() < 0.1)
    return snapshot.PendingJob(
        job_id=f"j{n:03d}",
        queue="default",
        priority=0,
        created=T0.replace(second=n % 60, minute=n // 60),
        request=builder.request(f"j{n:03d}"),
        excluded=excluded,
    )


def decisions(plan: planning.CyclePlan) -> tuple[object, ...]:
    return (
        sorted((a.job_id, a.cluster, a.takes) for a in plan.assignments),
        sorted((u.job_id, tuple(u.details)) for u in plan.unplaceable),
        sorted((s.kind, s.name) for s in plan.set_aside),
    )


@pytest.mark.parametrize("seed", range(40))
def test_the_search_chooses_what_fitting_every_cluster_chooses(seed: int) -> None:
    rng = random.Random(seed)
    clusters = rng.randint(1, 12)
    fleet = random_fleet(rng, clusters)
    for cycle in range(4):
        pending = [random_job(rng, 20 * cycle + n, clusters) for n in range(rng.randint(1, 20))]
        walked, surveyed = fleet.copy(), fleet.copy()
        plan = planning.plan_cycle(walked, pending)
        every = planning.plan_cycle(surveyed, [replace(j, clusters=ANYWHERE) for j in pending])
        assert decisions(plan) == decisions(every)
        assert walked.clusters == surveyed.clusters
        fleet = walked  # the next cycle on the fleet this one left


def test_a_fit_leaving_nothing_idle_on_the_busiest_cluster_ends_the_walk() -> None:
    """The busiest cluster that fits a 1-GPU job on a node with 1 free is chosen without
    fitting the others (a cluster whose fit raised would otherwise be set aside)."""
    busy = make_model_summary(MODELS[0], nodes_by_free=[0, 1, 0, 0, 0, 0, 0, 0, 1])
    roomy = make_model_summary(MODELS[0], nodes_by_free=[0] * 8 + [10])
    fleet = snapshot.FleetSnapshot.build(
        [
            snapshot.ClusterCapacity.from_summary(make_summary(name, model), healthy=True)
            for name, model in (("busy", busy), ("roomy", roomy))
        ]
    )
    fits = []
    real = fitting.fit_gang

    def counting(cluster: snapshot.ClusterCapacity, *args: object, **kwargs: object) -> object:
        fits.append(cluster.name)
        return real(cluster, *args, **kwargs)  # type: ignore[arg-type]

    job = snapshot.PendingJob("j", "default", 0, T0, make_job("j", gpus=1).request("j"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fitting, "fit_gang", counting)
        plan = planning.plan_cycle(fleet, [job])
    assert [a.cluster for a in plan.assignments] == ["busy"]
    assert fits == ["busy"]
