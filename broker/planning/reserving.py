"""Whether a job that fits nowhere now gets a reservation this cycle, and where. Pure.

Called by `planning._Cycle` for a job that neither fits nor preempts: past the policy's
`reserveAfterSeconds`, and while the fleet holds fewer than `maxReservations`, the job is given
the cluster and models `reservation.choose_cluster` picks (none another job holds), and those
models take no new work until it fits. The answer is the reasons to tell the job, with the new
reservation added to `reservations` (the cycle's, which it owns).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from broker.api import queues as queues_api
from broker.api.queues import ReasonCode
from broker.planning import plans, quotas, reservation, snapshot


def reserve_for(
    job: snapshot.PendingJob,
    admission: quotas.Admission,
    *,
    policy: queues_api.Policy,
    fleet: snapshot.FleetSnapshot,
    reservations: dict[str, reservation.Reservation],
    now: datetime | None,
) -> list[plans.Reason]:
    """Reserve for the job if it is due one; the reasons to add to its wait."""
    after = policy.reserve_after_seconds
    if now is None or after is None or not reservation.is_due(job, now=now, after=after):
        return []
    if policy.max_reservations <= 0:
        return []
    if len(reservations) >= policy.max_reservations:
        return [_all_held(reservations, after=after, limit=policy.max_reservations)]
    chosen = reservation.choose_cluster(
        fleet,
        job.request,
        models=admission.admissible,
        held=reservation.held_models(reservations.values()),
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
    reservations[job.job_id] = reservation.Reservation(job.job_id, cluster, models, now)
    return [
        plans.Reason(
            cluster,
            ReasonCode.WAITING_FOR_RESERVATION,
            f"reserved for this job since {now:%H:%M:%S} (waiting over {after:g}s): "
            f"its {'/'.join(sorted(models))} GPUs take no new work until it fits",
        )
    ]


def _all_held(
    reservations: Mapping[str, reservation.Reservation], *, after: float, limit: int
) -> plans.Reason:
    holders = ", ".join(sorted(reservations)) or "none"
    return plans.Reason(
        plans.FLEET,
        ReasonCode.WAITING_FOR_RESERVATION,
        f"waiting over {after:g}s; the fleet's reservations ({limit}) are held by "
        f"{holders}: it gets one after them",
    )
