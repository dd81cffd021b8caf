"""What parks: which planned jobs may sit out the next cycles, and what wakes each
(`decide_parks`, its `backlog.Wake`: witnesses of no fit, quota thresholds, a priority).
The rules, and why no decision changes, are in `parking`'s docstring; this is their half
that runs at the end of a cycle, over its plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import clusterchoice
from broker.api.queues import ReasonCode
from broker.planning import containment, planning, quotas, reservation, snapshot
from broker.planning.backlog import backlog, bounds
from broker.planning.backlog.cyclestart import Start

# a job with one of these reasons acts or may act next cycle: it stays in the plan
ACTING = frozenset(
    {
        ReasonCode.REJECTED,
        ReasonCode.PLANNING_FAILED,
        ReasonCode.WAITING_FOR_PREEMPTION,
        ReasonCode.PREEMPTION_BUDGET,
        ReasonCode.MIN_RUN_TIME,
        ReasonCode.ARRAY_PARALLELISM,  # its array's jobs end without a summary's change
        ReasonCode.CLUSTER_BUSY,  # offers are answered without a summary's change
    }
)


def decide_parks(
    plan: planning.CyclePlan,
    planned: Sequence[snapshot.PendingJob],
    *,
    fleet: snapshot.FleetSnapshot,
    start: Start,
    releasing: Sequence[snapshot.Releasing] = (),
    now: datetime | None = None,
) -> list[backlog.Park]:
    """The planned jobs that may sit out the next cycles, each with what wakes it; `fleet`
    is the fleet the cycle left (every cluster of its start, placements assumed)."""
    by_id = {job.job_id: job for job in planned}
    acting = {p.preemptor for p in plan.preemptions} | set(plan.reservations)
    acting |= {r.preemptor for r in releasing}
    acting |= {s.name for s in plan.set_aside if s.kind == containment.JOB}
    # cohorts charged for room a preemption makes: usage its turn saw, the next cycle not
    waiting = {r.preemptor for r in releasing if not r.released}
    charged = {
        start.ledger.cohort_of(by_id[job_id].queue)
        for job_id in waiting | {p.preemptor for p in plan.preemptions}
        if job_id in by_id
    }
    verdicts: dict[tuple[object, ...], _Verdicts | None] = {}
    after = start.tenancy.policy.reserve_after_seconds
    out = []
    for miss in plan.unplaceable:
        job = by_id.get(miss.job_id)
        if job is None or job.excluded or job.job_id in acting:
            continue
        if any(reason.code in ACTING or _taken(reason) for reason in miss.details):
            continue
        if charged and start.ledger.cohort_of(job.queue) in charged:
            continue
        try:
            priority = start.tenancy.priority_of(job.queue, job.priority, job.priority_class)
        except Exception:
            continue
        shape = _request_shape(job)
        key = (job.queue, job.priority_class, priority, shape)
        if key not in verdicts:
            try:
                verdicts[key] = _wake_of(job, priority, shape, fleet=fleet, start=start)
            except Exception:  # what the planner raises for, it sets aside: not parked
                verdicts[key] = None
        found = verdicts[key]
        if found is None or found.wake is None or not _told_as_at_start(miss, found):
            continue
        due = not found.wake.timed or reservation.is_due(job, now=now, after=after)
        out.append(backlog.Park(job, found.wake, (-priority, job.created, job.job_id), due))
    return out


def _taken(reason: planning.Reason) -> bool:
    """Told that a cluster's room went to jobs ahead of it this cycle: next cycle, with
    those placed, it would be told the cluster is full: plan it once more first."""
    return reason.cluster != planning.FLEET and reason.code in (
        ReasonCode.FAIR_SHARE,
        ReasonCode.PRIORITY,
    )


def _told_as_at_start(miss: planning.Unplaceable, verdicts: _Verdicts) -> bool:
    """Were its quota reasons those of the cycle's start (not of charges made before its
    turn, which next cycle need not hold)? Else it is planned once more first."""
    quota = (ReasonCode.QUOTA, ReasonCode.BORROWING_LIMIT, ReasonCode.NO_IDLE_QUOTA)
    fleet = [r.code for r in miss.details if r.cluster == planning.FLEET]
    if Counter(code for code in fleet if code in quota) != verdicts.misses:
        return False
    return not (verdicts.within and ReasonCode.FAIR_SHARE in fleet)


def _request_shape(job: snapshot.PendingJob) -> tuple[object, ...]:
    request = job.request
    pods = tuple((replicas, shape) for _, replicas, shape in request.tasks)
    return (pods, request.topology.nvlink, request.topology.rack, job.clusters)


@dataclass(frozen=True)
class _Verdicts:
    """A job's quota verdicts at the cycle's start, and what `why` is told of them."""

    wake: backlog.Wake | None
    misses: Counter[ReasonCode]  # the fleet's quota reasons it is told, one per model
    within: bool  # within its guarantee on some model: no fair-share reason for it


def _wake_of(
    job: snapshot.PendingJob,
    priority: int,
    shape: tuple[object, ...],
    *,
    fleet: snapshot.FleetSnapshot,
    start: Start,
) -> _Verdicts:
    """What must change for the job to act (or for what `why` says of it to change); no
    wake if it may act as things are."""
    tenancy, ledger = start.tenancy, start.ledger
    request = job.request
    gpus = quotas.gpus_of(request)
    thresholds: set[backlog.Threshold] = set()
    models: set[str] = set()
    misses: Counter[ReasonCode] = Counter()
    within = False
    # the clusters its spec.clusters allows: the others excluded until their labels change
    # (`cyclestart.shape_of`); allowed nowhere, it never gets as far as preempting or reserving
    allowed = [
        name
        for name in sorted(fleet.clusters)
        if clusterchoice.allows(job.clusters, fleet.clusters[name].labels)
    ]
    for model in sorted(quotas.allowed_models(request, start.fleet_models)):
        verdict = ledger.check(job.queue, model, gpus)
        thresholds |= _thresholds(job.queue, model, gpus, verdict, ledger)
        if isinstance(verdict, quotas.Miss):
            misses[verdict.code] += 1
            continue
        if verdict is True and start.preempts and allowed:
            return _Verdicts(None, misses, True)  # within its guarantee: it may reclaim
        within = within or verdict is True
        models.add(model)
    usable = frozenset(models)
    watched: int | None = None  # with no model admitted it never gets as far as preempting
    usable_anywhere = bool(usable) and bool(allowed)
    if usable_anywhere and start.preempts and tenancy.preempts(job.queue, job.priority_class):
        if start.lowest is not None and start.lowest < priority:
            return _Verdicts(None, misses, within)  # a lower priority holds GPUs: it may preempt
        watched = priority
    witnesses: list[bounds.Witness] = []
    if usable:
        for name in allowed:
            found = bounds.witness(fleet.clusters[name], request, usable)
            if found is None:
                return _Verdicts(None, misses, within)  # it may fit there
            witnesses.extend(found)
    reserve = None
    if start.reserves and usable_anywhere:
        clusters = frozenset(
            name
            for name in allowed
            if fleet.clusters[name].healthy
            and bounds.could_fit_empty(fleet.clusters[name], request, usable)
        )
        if clusters:
            reserve = backlog.Reservable(usable, clusters)
    if usable:
        misses = Counter()  # the planner names refusals only when it admits no model
    wake = backlog.Wake(
        shape,
        tuple(witnesses),
        tuple(sorted(thresholds)),
        watched,
        reserve,
        timed=start.reserves and usable_anywhere,
        admitted=usable,
    )
    return _Verdicts(wake, misses, within)


def _thresholds(
    queue: str, model: str, gpus: int, verdict: quotas.Miss | bool, ledger: quotas.Ledger
) -> set[backlog.Threshold]:
    """The usage at which the verdict of `quotas.Ledger.check` for the model changes:
    falling, to a better one (admitted, within the guarantee: it could act, or `why`
    loses a reason); rising, to a worse one (`why` gains one). Its queue's usage first."""
    spec = ledger.tenancy.queue(queue).quota(model)
    if spec is None or spec.limit == 0:
        return set()  # no quota for the model: only the configuration changes it
    cohort = ledger.cohort_of(queue)
    capped = model in ledger.declared.get(cohort, ())
    capacity = ledger.cohort_capacity(cohort).get(model, 0)
    limit = spec.limit
    out: set[backlog.Threshold] = set()

    def queue_at(at_most: int, *, rising: bool = False) -> None:
        out.add(backlog.Threshold(backlog.QUEUE, queue, model, at_most, rising))

    def cohort_at(at_most: int, *, rising: bool = False) -> None:
        out.add(backlog.Threshold(backlog.COHORT, cohort, model, at_most, rising))

    code = verdict.code if isinstance(verdict, quotas.Miss) else None
    if code == ReasonCode.BORROWING_LIMIT:
        assert limit is not None
        queue_at(limit - gpus)  # under the limit again
    elif code == ReasonCode.NO_IDLE_QUOTA:
        queue_at(spec.guaranteed - gpus)  # within the guarantee
        cohort_at(capacity - gpus)  # the cohort lends again
        if limit is not None:
            queue_at(limit - gpus, rising=True)  # refused by the limit instead
    elif verdict is False:  # borrowing
        queue_at(spec.guaranteed - gpus)  # within the guarantee
        if limit is not None:
            queue_at(limit - gpus, rising=True)
        if capped:
            cohort_at(capacity - gpus, rising=True)
    elif verdict is True:  # within the guarantee (only parked when nothing preempts)
        queue_at(spec.guaranteed - gpus, rising=True)
    return out
