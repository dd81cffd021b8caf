"""Reservations against starvation: whether a job waiting too long gets a cluster held for
it, and which. Pure.

Called by `planning.plan_cycle` (`reserve_for`, for a job that neither fits nor preempts; the
reservation is a `plans.Reservation`) and by the backlog's parking, which asks the same
questions (`is_due`, `empty_like`). A job that is admitted by its quota but has found no
room for `policy.reserveAfterSeconds` since it (re)entered the queue gets a reservation: one
cluster whose GPU models it may use are held for it. From then on, every cycle:

1. the reserved job is tried first (on any cluster; its reservation ends when it is placed);
2. while it waits, no other job is placed on the reserved models of that cluster, and no job
   preempts there for anyone else. Work already running there finishes and is not replaced,
   so the job is placed within the longest remaining run time of that work.

Small jobs *backfill* everywhere else: other clusters, and the other GPU models of the
reserved cluster — never where they would delay the reserved job. (Without run-time
estimates the broker cannot tell which small job ends in time, so the reserved pool is not
backfilled at all.)

At most `policy.maxReservations` jobs (default 1) hold one at a time, the first due in the
cycle's order first, so a reservation never drains the fleet. The cluster chosen is one the
whole gang fits when empty, not reserved by an older reservation for the same models, with
the most GPUs of those models free now (the least to wait for); then by name. A reservation
lapses when its job is no longer pending or its cluster leaves the fleet; it is made again
when due.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from broker.api import clusterchoice, gangs
from broker.api import queues as queues_api
from broker.api.queues import ReasonCode
from broker.planning import fitting, plans, quotas, snapshot


def is_due(job: snapshot.PendingJob, *, now: datetime | None, after: float | None) -> bool:
    if now is None or after is None:
        return False
    return (now - job.waiting_since).total_seconds() >= after


def empty_like(cluster: snapshot.ClusterCapacity) -> snapshot.ClusterCapacity:
    """The cluster with every GPU free: whether a gang could ever fit there."""
    models = {}
    for name, model in cluster.models.items():
        size = model.gpus_per_node or len(model.nodes_by_free) - 1
        nodes = model.total_gpus // size if size else 0
        hist = [0] * (size + 1)
        if size:
            hist[size] = nodes
        racks: dict[str, list[int]] = {}
        for rack, counts in model.racks.items():
            rack_hist = [0] * (size + 1)
            if size:
                rack_hist[size] = sum(counts)
            racks[rack] = rack_hist
        models[name] = snapshot.ModelCapacity(
            model=name,
            gpu_memory_mib=model.gpu_memory_mib,
            nodes_by_free=hist,
            shared_free_milli=0,
            largest_free_nvlink_block=max(model.largest_free_nvlink_block, size),
            racks=racks,
            gpus_per_node=model.gpus_per_node,
            total_gpus=model.total_gpus,
        )
    return snapshot.ClusterCapacity(cluster.name, cluster.healthy, models, cluster.summary_seq)


def held_models(
    reservations: Iterable[plans.Reservation], *, but: str | None = None
) -> dict[str, set[str]]:
    """cluster -> models held by the reservations (other than job `but`'s)."""
    out: dict[str, set[str]] = {}
    for item in reservations:
        if item.job_id != but:
            out.setdefault(item.cluster, set()).update(item.models)
    return out


def choose_cluster(
    fleet: snapshot.FleetSnapshot,
    request: gangs.GangRequest,
    *,
    models: frozenset[str],
    held: Mapping[str, set[str]],
    choice: clusterchoice.Choice | None = None,
) -> tuple[str, frozenset[str]] | None:
    """The cluster to reserve for `request` on `models`, and the models to hold there;
    only among the clusters its `spec.clusters` (`choice`) allows."""
    best: tuple[int, str, frozenset[str]] | None = None
    for name in sorted(fleet.clusters):
        cluster = fleet.clusters[name]
        if not cluster.healthy or not clusterchoice.allows(choice, cluster.labels):
            continue
        usable = models - held.get(name, set())
        if not usable:
            continue
        fit = fitting.fit_gang(empty_like(cluster), request, models=usable)
        if not isinstance(fit, fitting.Fit):
            continue
        hold = frozenset(m for m in usable if m in cluster.models)
        free = sum(cluster.models[m].free_gpus for m in hold)
        if best is None or (-free, name) < (best[0], best[1]):
            best = (-free, name, hold)
    if best is None:
        return None
    return best[1], best[2]


def reserve_for(
    job: snapshot.PendingJob,
    admission: quotas.Admission,
    *,
    policy: queues_api.Policy,
    fleet: snapshot.FleetSnapshot,
    reservations: dict[str, plans.Reservation],
    now: datetime | None,
) -> list[plans.Reason]:
    """Reserve for the job if it is due one and the fleet holds fewer than
    `maxReservations`: the cluster and models `choose_cluster` picks (none another job
    holds) are added to `reservations` (the cycle's, which it owns). The answer is the
    reasons to add to its wait."""
    after = policy.reserve_after_seconds
    if now is None or after is None or not is_due(job, now=now, after=after):
        return []
    if policy.max_reservations <= 0:
        return []
    if len(reservations) >= policy.max_reservations:
        return [_all_held(reservations, after=after, limit=policy.max_reservations)]
    chosen = choose_cluster(
        fleet,
        job.request,
        models=admission.admissible,
        held=held_models(reservations.values()),
        choice=job.clusters,
    )
    if chosen is None:
        return [
            plans.Reason(
                plans.FLEET,
                ReasonCode.WAITING_FOR_RESERVATION,
                f"waiting over {after:g}s, but every cluster it fits is reserved for an "
                "older job; it gets one next",
            )
        ]
    cluster, models = chosen
    reservations[job.job_id] = plans.Reservation(job.job_id, cluster, models, now)
    return [
        plans.Reason(
            cluster,
            ReasonCode.WAITING_FOR_RESERVATION,
            f"reserved for this job since {now:%H:%M:%S} (waiting over {after:g}s): "
            f"its {'/'.join(sorted(models))} GPUs take no new work until it fits",
        )
    ]


def _all_held(
    reservations: Mapping[str, plans.Reservation], *, after: float, limit: int
) -> plans.Reason:
    holders = ", ".join(sorted(reservations)) or "none"
    return plans.Reason(
        plans.FLEET,
        ReasonCode.WAITING_FOR_RESERVATION,
        f"waiting over {after:g}s; the fleet's reservations ({limit}) are held by "
        f"{holders}: it gets one after them",
    )
