"""Parking: which queued jobs sit out the next cycles unplanned (Kueue's inadmissible set),
what wakes them, and the cycle that plans only the others. Pure.

Called by `jobs.scheduling.Scheduler` once per cycle (`plan_backlog`), with the queued jobs
it keeps (`backlog.Backlog`) and what parked jobs were last checked against (`Reference`).
A cycle costs O(live jobs + what changed), not O(backlog): a job that did not fit is parked,
and only a change that could admit it brings it back into the plan.

**When a job parks.** After a cycle, a job it planned parks if it was left unplaced without
acting — not assigned, no preemption for it, no reservation held or made, not set aside, no
cluster excluding it after a rejection, not waiting for victims, no `MinRunTime` or
`PreemptionBudget` reason — and, from the cycle's start usage (`quotas.Ledger`) and the
fleet the cycle left (its assumed placements taken):
1. every GPU model it may use is refused by its queue's quota, or it gets a witness on every
   cluster (`bounds`: no room for the gang there on those models, by any placement);
2. if some model is admitted and the policy preempts: it is within its queue's guarantee on
   no model (no reclaim) and, if its class preempts lower priorities, no job of a lower
   priority holds GPUs. This is the planner's own first test (`preemption.Search.may_act`):
   when it fails no victim is searched for.

**What wakes it** (`decide_wakes`, at the start of every cycle, against the `Reference`):
- the queues configuration changed, or the fleet's shape (a cluster joined, left, changed
  health or models, GPU memory, node size, racks, GPUs): every parked job wakes;
- a cluster shows as many free GPUs (or slots) of a witness's models as it needs;
- the GPUs its queue (or cohort) holds of a model fell to a `Threshold`: where its limit,
  its cohort's capacity or its guarantee no longer refuses it (or, within the guarantee,
  it could reclaim);
- a job of a lower priority than its own now holds GPUs (if its class preempts);
- it is named as a preemptor whose victims are releasing (never, but it would act);
- reservations (`decide_reservation_wakes`): once due (`reserveAfterSeconds` since it was
  queued, which time alone brings), in a cycle where fewer than `maxReservations` are held
  after the planner's phase 2 and a cluster it could fit empty has models it may use that
  none of those holds; `plan_backlog` then plans the cycle again with it;
- its record changing (requeued, cancelled, rejected somewhere): `Backlog.put`.

**Why no decision changes.** A parked job handled in the full plan would change nothing:
within a cycle a job's admitted models, its within-guarantee models and each cluster's free
nodes only shrink (charges and assumed placements), so the tests that held at the cycle's
start hold at its turn; a witness proves no fit on any subset of the models; with no
within-guarantee model and no lower priority holding GPUs `may_act` is false, so no victim
is searched for, and the budget, the victims and the ledger are untouched; a reservation
needs a free slot at its turn (slots are fixed once phase 2 is done, then only fill) and a
cluster it could fit empty with models no reservation holds (reservations only hold more).
So it assigns, charges, preempts and reserves nothing, and the other jobs see the same
snapshot, ledger, budget and reservations. Its place in the fair-share order could still
matter (head of line): the heap keys each queue by its head job, and a parked borrower
(tier 1) at the head would keep a job behind it that is within its guarantee (tier 0) from
going ahead of other queues' jobs. A chain of parked jobs ahead of a live job acts as one
entry, the largest of their keys (its queue's usage does not change while they are handled):
no larger than the live job's, it holds nothing back — always so unless the live job may be
in tier 0. So for each live job that may be, `decide_stand_ins` passes `plan_cycle` the last
parked job of each shape ahead of it in its queue (their keys differ only by the queue
order within a shape, so these make the chain's largest); they take their turn, unplanned.
Phases 1 and 2 (released preemptors, reservation holders) are never parked. What `why`
says of a parked job is its last cycle's reasons. One difference is allowed: a parked job
is not tried on a cluster, so it cannot count towards setting that cluster aside when
planning raises (`containment`: a bug, not a decision).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import queues as queues_api
from broker.api.queues import ReasonCode
from broker.planning import (
    backlog,
    bounds,
    containment,
    planning,
    quotas,
    reservation,
    snapshot,
)

# a job with one of these reasons acts or may act next cycle: it stays in the plan
ACTING = frozenset(
    {
        ReasonCode.REJECTED,
        ReasonCode.PLANNING_FAILED,
        ReasonCode.WAITING_FOR_PREEMPTION,
        ReasonCode.PREEMPTION_BUDGET,
        ReasonCode.MIN_RUN_TIME,
    }
)


@dataclass(frozen=True)
class Reference:
    """What the parked jobs were last checked against: the next cycle's changes are taken
    from here (the fleet as the cycle left it, the usage as it began)."""

    config: queues_api.QueuesConfig | None
    shape: tuple[object, ...]
    fleet: snapshot.FleetSnapshot
    usage: Mapping[backlog.UsageKey, int]
    lowest: int | None  # the lowest priority holding GPUs (None: nothing may preempt)


@dataclass
class BacklogPlan:
    plan: planning.CyclePlan
    planned: list[snapshot.PendingJob]  # the live jobs and the woken ones
    woken: set[str]
    stand_ins: list[str]  # parked jobs that took their turn in the order, unplanned
    parks: list[backlog.Park]
    reference: Reference
    rounds: int  # plan_cycle runs: 2 when a reservation slot opened for woken jobs


class Start:
    """The cycle's start as the planner's phases see it: the clusters it keeps, the models
    and GPUs of the fleet, the ledger of what each queue holds."""

    def __init__(
        self,
        fleet: snapshot.FleetSnapshot,
        *,
        tenancy: quotas.Tenancy,
        running: Sequence[snapshot.RunningJob],
        usage: quotas.Usage | None,
        now: datetime | None,
    ) -> None:
        self.tenancy = tenancy
        policy = tenancy.policy
        self.checked = {
            name: cluster
            for name, cluster in fleet.clusters.items()
            if containment.check_cluster(cluster) is None
        }
        self.fleet_models = frozenset(m for c in self.checked.values() for m in c.models)
        gpus: dict[str, int] = {}
        for cluster in self.checked.values():
            for name, capacity in cluster.models.items():
                gpus[name] = gpus.get(name, 0) + capacity.total_gpus
        self.ledger = quotas.Ledger.build(tenancy, running, gpus, usage=usage)
        self.preempts = policy.max_preemptions_per_cycle > 0
        self.reserves = (
            now is not None
            and policy.reserve_after_seconds is not None
            and policy.max_reservations > 0
        )
        self.lowest = _lowest(self.ledger, running) if self.preempts else None
        self.usage: dict[backlog.UsageKey, int] = {}
        for queue, held in self.ledger.usage.items():
            for model, count in held.items():
                if count:
                    self.usage[(backlog.QUEUE, queue, model)] = count
        for cohort, held in self.ledger.cohort_usage.items():
            for model, count in held.items():
                if count:
                    self.usage[(backlog.COHORT, cohort, model)] = count
        self.shape = shape_of(fleet, self.checked)

    def order_of(self, job: snapshot.PendingJob) -> backlog.Order:
        priority = self.tenancy.priority_of(job.queue, job.priority, job.priority_class)
        return (-priority, job.created, job.job_id)

    def may_be_within(self, job: snapshot.PendingJob) -> bool:
        """Could the job be in tier 0 (within its guarantee) in this cycle's order?"""
        try:
            models = quotas.allowed_models(job.request, self.fleet_models)
            gpus = job.request.gpus
            return any(self.ledger.check(job.queue, m, gpus) is True for m in models)
        except Exception:  # the planner orders it last (`_queue_key`): never ahead
            return False


def _lowest(ledger: quotas.Ledger, running: Sequence[snapshot.RunningJob]) -> int | None:
    """`preemption.Search.lowest_priority`: the lowest priority of the jobs holding GPUs."""
    held = ledger.held
    if held is not None and held.priorities is not None:
        return held.lowest_priority(ledger.tenancy)
    tenancy = ledger.tenancy
    return min(
        (tenancy.priority_of(j.queue, j.priority, j.priority_class) for j in running),
        default=None,
    )


def shape_of(
    fleet: snapshot.FleetSnapshot, checked: Mapping[str, snapshot.ClusterCapacity]
) -> tuple[object, ...]:
    """What of the fleet is not free capacity: a change here wakes every parked job."""
    out: list[object] = []
    for name in sorted(fleet.clusters):
        cluster = fleet.clusters[name]
        models = []
        for model_name in sorted(cluster.models):
            model = cluster.models[model_name]
            size = model.gpus_per_node or len(model.nodes_by_free) - 1
            racks = tuple(sorted((r, len(h), sum(h)) for r, h in model.racks.items()))
            models.append(
                (
                    model_name,
                    model.gpu_memory_mib,
                    model.gpus_per_node,
                    model.total_gpus,
                    len(model.nodes_by_free),
                    max(model.largest_free_nvlink_block, size),
                    racks,
                )
            )
        out.append((name, cluster.healthy, name in checked, tuple(models)))
    return tuple(out)


# ---- what wakes -------------------------------------------------------------------------


def decide_wakes(parked: backlog.Backlog, before: Reference | None, now: Reference) -> set[str]:
    """The parked jobs that what changed since `before` could admit."""
    if not parked.parked():
        return set()
    if before is None or before.config is not now.config or before.shape != now.shape:
        return set(parked.parked())
    changed: dict[str, set[str]] = {}
    for name, cluster in now.fleet.clusters.items():
        old = before.fleet.clusters.get(name)
        for model_name, model in cluster.models.items():
            was = old.models.get(model_name) if old is not None else None
            if was is None or was.nodes_by_free != model.nodes_by_free or was.racks != model.racks:
                changed.setdefault(name, set()).add(model_name)
    classes = parked.by_bounds(now.fleet, changed)
    keys = {
        key
        for key in before.usage.keys() | now.usage.keys()
        if before.usage.get(key, 0) != now.usage.get(key, 0)
    }
    classes |= parked.by_thresholds(now.usage, keys)
    if now.lowest is not None and now.lowest != before.lowest:
        classes |= parked.by_priority(now.lowest)
    return parked.members(classes)


def decide_stand_ins(
    parked: backlog.Backlog,
    planned: Sequence[snapshot.PendingJob],
    start: Start,
    *,
    woken: Collection[str] = (),
) -> list[snapshot.PendingJob]:
    """Head of line: the parked jobs that take their turn in the fair-share order (not
    planned), so that none of the planned jobs that may be within their guarantee (tier 0)
    goes before parked jobs of its queue that would hold it back. For each such job, per
    shape of its queue's parked jobs, the last one ahead of it: in a chain of parked jobs
    the heap keys of one shape differ only in the queue order, so the last of each shape
    makes the chain's largest key (which is what the chain does to the order)."""
    out: dict[str, snapshot.PendingJob] = {}
    for job in planned:
        if not parked.has_queue(job.queue) or not start.may_be_within(job):
            continue
        try:
            order = start.order_of(job)
        except Exception:  # ordered last by the planner, set aside: holds nothing back
            continue
        for job_id in parked.stand_ins(job.queue, order, skip=woken):
            if job_id not in out:
                out[job_id] = _job(parked, job_id)
    return list(out.values())


def decide_reservation_wakes(
    parked: backlog.Backlog,
    plan: planning.CyclePlan,
    planned: Sequence[snapshot.PendingJob],
    previous: Mapping[str, reservation.Reservation],
    *,
    start: Start,
    now: datetime | None,
) -> set[str]:
    """Parked jobs due for a reservation that could get one in this cycle's phase 3: fewer
    than `maxReservations` are held once phases 1 and 2 are done (the reservations kept,
    less those whose job was placed), and a cluster it could fit empty has models it may
    use that none of them holds (more reservations in phase 3 only hold more)."""
    policy = start.tenancy.policy
    after = policy.reserve_after_seconds
    if not start.reserves or now is None or after is None:
        return set()
    assigned = {a.job_id for a in plan.assignments}
    ids = {job.job_id for job in planned}
    kept = [
        r
        for r in previous.values()
        if r.job_id in ids and r.cluster in start.checked and r.job_id not in assigned
    ]
    if len(kept) >= policy.max_reservations:
        return set()
    held = reservation.held_models(kept)
    out: set[str] = set()
    for wake in parked.reservable():
        if _could_reserve(wake, parked, held, start):
            out |= parked.due(wake, now=now, after=after)
    return out


def _could_reserve(
    wake: backlog.Wake, parked: backlog.Backlog, held: Mapping[str, set[str]], start: Start
) -> bool:
    """Is there a cluster the class could fit empty on models no reservation holds?"""
    reserve = wake.reserve
    assert reserve is not None
    request = parked.sample(wake).request
    for name in sorted(reserve.clusters):
        cluster = start.checked.get(name)
        if cluster is None:
            continue
        usable = reserve.models - held.get(name, set())
        if usable == reserve.models:  # as when it parked: it could fit there empty
            return True
        if usable and bounds.could_fit_empty(cluster, request, usable):
            return True
    return False


# ---- what parks -------------------------------------------------------------------------


def decide_parks(
    plan: planning.CyclePlan,
    planned: Sequence[snapshot.PendingJob],
    *,
    fleet: snapshot.FleetSnapshot,
    start: Start,
    releasing: Sequence[snapshot.Releasing] = (),
) -> list[backlog.Park]:
    """The planned jobs that may sit out the next cycles, each with what wakes it; `fleet`
    is the fleet the cycle left (every cluster of its start, placements assumed)."""
    by_id = {job.job_id: job for job in planned}
    acting = {p.preemptor for p in plan.preemptions} | set(plan.reservations)
    acting |= {r.preemptor for r in releasing}
    acting |= {s.name for s in plan.set_aside if s.kind == containment.JOB}
    wakes: dict[tuple[object, ...], backlog.Wake | None] = {}
    out = []
    for miss in plan.unplaceable:
        job = by_id.get(miss.job_id)
        if job is None or job.excluded or job.job_id in acting:
            continue
        if any(reason.code in ACTING for reason in miss.details):
            continue
        try:
            priority = start.tenancy.priority_of(job.queue, job.priority, job.priority_class)
        except Exception:
            continue
        shape = _request_shape(job)
        key = (job.queue, job.priority_class, priority, shape)
        if key not in wakes:
            try:
                wakes[key] = _wake_of(job, priority, shape, fleet=fleet, start=start)
            except Exception:  # what the planner raises for, it sets aside: not parked
                wakes[key] = None
        wake = wakes[key]
        if wake is not None:
            out.append(backlog.Park(job, wake, (-priority, job.created, job.job_id)))
    return out


def _request_shape(job: snapshot.PendingJob) -> tuple[object, ...]:
    request = job.request
    pods = tuple((replicas, shape) for _, replicas, shape in request.tasks)
    return (pods, request.topology.nvlink, request.topology.rack)


def _wake_of(
    job: snapshot.PendingJob,
    priority: int,
    shape: tuple[object, ...],
    *,
    fleet: snapshot.FleetSnapshot,
    start: Start,
) -> backlog.Wake | None:
    """What must change for the job to act; None if it may act as things are."""
    tenancy, ledger = start.tenancy, start.ledger
    request = job.request
    gpus = request.gpus
    thresholds: set[backlog.Threshold] = set()
    models: set[str] = set()
    for model in sorted(quotas.allowed_models(request, start.fleet_models)):
        verdict = ledger.check(job.queue, model, gpus)
        if isinstance(verdict, quotas.Miss):
            thresholds |= _refusal(job.queue, model, gpus, verdict, ledger)
            continue
        if verdict is True and start.preempts:
            return None  # within its guarantee: it may reclaim
        models.add(model)
        if start.preempts:  # borrowing: within its guarantee once its queue holds less
            at_most = ledger.guaranteed(job.queue, model) - gpus
            thresholds.add(backlog.Threshold(backlog.QUEUE, job.queue, model, at_most))
    usable = frozenset(models)
    watched: int | None = None  # with no model admitted it never gets as far as preempting
    if usable and start.preempts and tenancy.preempts(job.queue, job.priority_class):
        if start.lowest is not None and start.lowest < priority:
            return None  # a lower priority holds GPUs: it may preempt
        watched = priority
    witnesses: list[bounds.Witness] = []
    if usable:
        for name in sorted(fleet.clusters):
            found = bounds.witness(fleet.clusters[name], request, usable)
            if found is None:
                return None
            witnesses.extend(found)
    reserve = None
    if start.reserves and usable:
        clusters = frozenset(
            name
            for name, cluster in fleet.clusters.items()
            if cluster.healthy and bounds.could_fit_empty(cluster, request, usable)
        )
        if clusters:
            reserve = backlog.Reservable(usable, clusters)
    return backlog.Wake(shape, tuple(witnesses), tuple(sorted(thresholds)), watched, reserve)


def _refusal(
    queue: str, model: str, gpus: int, miss: quotas.Miss, ledger: quotas.Ledger
) -> set[backlog.Threshold]:
    """The usage at which a quota refusal (`quotas.Ledger.check`) could end."""
    if miss.code == ReasonCode.BORROWING_LIMIT:
        quota = ledger.tenancy.queue(queue).quota(model)
        assert quota is not None and quota.limit is not None
        return {backlog.Threshold(backlog.QUEUE, queue, model, quota.limit - gpus)}
    if miss.code == ReasonCode.NO_IDLE_QUOTA:
        cohort = ledger.cohort_of(queue)
        capacity = ledger.cohort_capacity(cohort).get(model, 0)
        return {
            backlog.Threshold(backlog.QUEUE, queue, model, ledger.guaranteed(queue, model) - gpus),
            backlog.Threshold(backlog.COHORT, cohort, model, capacity - gpus),
        }
    return set()  # no quota for the model: only the configuration changes it


# ---- the cycle --------------------------------------------------------------------------


def plan_backlog(
    parked: backlog.Backlog,
    fleet: snapshot.FleetSnapshot,
    *,
    previous: Reference | None,
    running: Sequence[snapshot.RunningJob] = (),
    usage: quotas.Usage | None = None,
    queues: queues_api.QueuesConfig | None = None,
    reservations: Mapping[str, reservation.Reservation] | None = None,
    releasing: Sequence[snapshot.Releasing] = (),
    now: datetime | None = None,
    max_assignments: int = 10_000,
    park: bool = True,
) -> BacklogPlan:
    """One cycle over the live jobs and the parked ones a change woke: the same decisions
    as `planning.plan_cycle` over every pending job. `fleet` is not changed; `parked` is
    read only (the caller applies the outcome with `Backlog.settle`). `park=False`: plan
    every pending job and park none (the full re-plan)."""
    start = Start(fleet, tenancy=quotas.Tenancy(queues), running=running, usage=usage, now=now)
    current = Reference(queues, start.shape, fleet, start.usage, start.lowest)
    if park:
        woken = decide_wakes(parked, previous, current)
        woken |= {r.preemptor for r in releasing if parked.is_parked(r.preemptor)}
    else:
        woken = set(parked.parked())
    live = parked.live()
    held = reservations or {}
    rounds = 0
    while True:
        planned = live + [_job(parked, job_id) for job_id in sorted(woken)]
        stand_ins = decide_stand_ins(parked, planned, start, woken=woken) if park else []
        scratch = fleet.copy()
        plan = planning.plan_cycle(
            scratch,
            planned,
            running=running,
            usage=usage,
            queues=queues,
            reservations=held,
            releasing=releasing,
            now=now,
            max_assignments=max_assignments,
            stand_ins=stand_ins,
        )
        rounds += 1
        more = decide_reservation_wakes(parked, plan, planned, held, start=start, now=now)
        if not more - woken:
            break
        woken |= more
    left = snapshot.FleetSnapshot(dict(scratch.clusters))
    for name, cluster in fleet.clusters.items():
        left.clusters.setdefault(name, cluster)  # set aside this cycle: as it began
    parks = []
    if park:
        parks = decide_parks(plan, planned, fleet=left, start=start, releasing=releasing)
    reference = Reference(queues, start.shape, left, start.usage, start.lowest)
    stood = [job.job_id for job in stand_ins]
    return BacklogPlan(plan, planned, woken, stood, parks, reference, rounds)


def _job(parked: backlog.Backlog, job_id: str) -> snapshot.PendingJob:
    found = parked.park_of(job_id)
    assert found is not None
    return found.job
