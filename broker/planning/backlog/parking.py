"""Parking: which queued jobs sit out the next cycles unplanned (Kueue's inadmissible set),
what wakes them, and the cycle that plans only the others. Pure.

Called by `jobs.scheduling.Scheduler` once per cycle (`plan_backlog`), with the queued jobs
it keeps (`backlog.Backlog`) and the `Reference` the previous cycle left. A job that did not
fit is parked, and only a change that could admit it brings it back into the plan, so a
cycle costs O(live jobs + what changed), not O(backlog). The rules, stated here once
(docs/design/backlog.md walks through them):

**A job parks** (`decide_parks`) when its cycle left it unplaced without acting (not
assigned, no preemption or reservation for it, not set aside, no cluster excluding it, no
reason in `ACTING`) and, judged on the usage at the cycle's start (`Start`) and the fleet
the cycle left, it could not act next cycle either: every GPU model it may use is refused
by its quota, or the models left have no room for the gang on any cluster it allows (a
`bounds` witness per cluster); it could not preempt (within its guarantee on no model, no
lower priority holding GPUs: `preemption.Search.may_act`'s test); and what it was told is
what the next cycle would tell it. Released preemptors and reservation holders are never
parked.

**It wakes** (`decide_wakes`, `decide_reservation_wakes`) when what it was checked against
changes so that it could act or would be told otherwise: the queues configuration or the
fleet's shape (`shape_of`: every parked job wakes); room on a cluster past a witness; its
queue's or cohort's GPUs crossing a `backlog.Threshold`; a lower priority holding GPUs;
its victims releasing; a reservation made or ended on its models; becoming due for a
reservation while a slot it could take is free. A change to its record wakes it too
(`Backlog.put`).

**No decision changes.** Within a cycle a job's admitted models, its guarantee and each
cluster's free nodes only shrink, so a parked job, planned, would assign, charge, preempt and
reserve nothing, and the other jobs see the same snapshot, ledger, budget and reservations.
Only its place in the fair-share order could matter (head of line): `decide_stand_ins`
passes `plan_cycle` the parked jobs that would hold a job back, to take their turn
unplanned. What `why` says of a parked job is its last cycle's reasons. One difference is
allowed: a parked job is not tried on a cluster, so it cannot count towards setting that
cluster aside when planning raises (`containment`: a bug, not a decision).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import clusterchoice
from broker.api import queues as queues_api
from broker.api.queues import ReasonCode
from broker.planning import containment, planning, plans, quotas, reservation, snapshot
from broker.planning.backlog import backlog, bounds, budget


@dataclass
class BacklogPlan:
    plan: planning.CyclePlan
    planned: list[snapshot.PendingJob]  # the live jobs and the woken ones
    woken: set[str]
    stand_ins: list[str]  # parked jobs that took their turn in the order, unplanned
    parks: list[backlog.Park]
    reference: Reference
    rounds: int  # plan_cycle runs: 2 when a reservation slot opened for woken jobs
    deferred: int = 0  # pending jobs over the cycle's limit, left live for the next cycles


# ---- the cycle's start ------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """What the parked jobs were last checked against: the next cycle's changes are taken
    from here (the fleet as the cycle left it, the usage as it began)."""

    config: queues_api.QueuesConfig | None
    shape: tuple[object, ...]
    fleet: snapshot.FleetSnapshot
    usage: Mapping[backlog.UsageKey, int]
    lowest: int | None  # the lowest priority holding GPUs (None: nothing may preempt)
    # reservations the cycle made or ended: (cluster, models held there)
    reserved: tuple[tuple[str, frozenset[str]], ...] = ()


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
            gpus = quotas.gpus_of(job.request)
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
    """What of the fleet is not free capacity (and its clusters' labels): a change here wakes
    every parked job."""
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
        labels = tuple(sorted(cluster.labels.items()))  # what spec.clusters selects on
        out.append((name, cluster.healthy, name in checked, labels, tuple(models)))
    return tuple(out)


# ---- what parks -------------------------------------------------------------------------

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
    # (`shape_of`); allowed nowhere, it never gets as far as preempting or reserving
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


# ---- what wakes -------------------------------------------------------------------------


def decide_wakes(
    parked: backlog.Backlog,
    before: Reference | None,
    now: Reference,
    *,
    at: datetime | None = None,
    after: float | None = None,
) -> set[str]:
    """The parked jobs that what changed since `before` could admit, or whose reasons it
    changes (`at`, `after`: the time and `reserveAfterSeconds`, when reservations are on)."""
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
    for _, models in before.reserved:  # models blocked somewhere, or not any more
        # every class whose models they are, timed or not: a job told WaitingForReservation
        # after reservations were turned off still hears when the last one ends
        classes |= {wake for wake in parked.classes() if wake.admitted & models}
    woken = parked.members(classes)
    if at is not None and after is not None:
        woken |= parked.becoming_due(now=at, after=after)  # told of reservations from now on
        if before.reserved:  # told who holds them
            for wake in parked.timed():
                woken |= parked.due(wake, now=at, after=after)
    return woken


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
    previous: Mapping[str, plans.Reservation],
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


# ---- the cycle --------------------------------------------------------------------------


def plan_backlog(
    parked: backlog.Backlog,
    fleet: snapshot.FleetSnapshot,
    *,
    previous: Reference | None,
    running: Sequence[snapshot.RunningJob] = (),
    usage: quotas.Usage | None = None,
    queues: queues_api.QueuesConfig | None = None,
    reservations: Mapping[str, plans.Reservation] | None = None,
    releasing: Sequence[snapshot.Releasing] = (),
    now: datetime | None = None,
    max_assignments: int = 10_000,
    park: bool = True,
    limit: int | None = None,
    array_holding: Mapping[str, int] | None = None,
) -> BacklogPlan:
    """One cycle over the live jobs and the parked ones a change woke: the same decisions
    as `planning.plan_cycle` over every pending job. `fleet` is not changed; `parked` is
    read only (the caller applies the outcome with `Backlog.settle`). `park=False`: plan
    every pending job and park none (the full re-plan). `limit`: plan at most that many
    (`budget.select`, heads of every queue first); the others stay live (woken ones too),
    for the next cycles."""
    start = Start(fleet, tenancy=quotas.Tenancy(queues), running=running, usage=usage, now=now)
    current = Reference(queues, start.shape, fleet, start.usage, start.lowest)
    after = start.tenancy.policy.reserve_after_seconds if start.reserves else None
    if park:
        woken = decide_wakes(parked, previous, current, at=now, after=after)
        woken |= {r.preemptor for r in releasing if parked.is_parked(r.preemptor)}
    else:
        woken = set(parked.parked())
    held = reservations or {}
    always = {r.job_id for r in held.values()} | {r.preemptor for r in releasing}
    rounds = 0
    while True:
        planned, deferred = _slice(parked, woken, limit=limit, start=start, always=always)
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
            array_holding=array_holding,
        )
        rounds += 1
        more = decide_reservation_wakes(parked, plan, planned, held, start=start, now=now)
        if not more - woken or deferred:  # a slice of the backlog: the next cycles go on
            break
        woken |= more
    left = snapshot.FleetSnapshot(dict(scratch.clusters))
    for name, cluster in fleet.clusters.items():
        left.clusters.setdefault(name, cluster)  # set aside this cycle: as it began
    parks = []
    if park:
        parks = decide_parks(plan, planned, fleet=left, start=start, releasing=releasing, now=now)
    made = {(r.job_id, r.cluster, r.models) for r in plan.reservations.values()}
    had = {(r.job_id, r.cluster, r.models) for r in held.values()}
    reserved = tuple(sorted({(c, m) for _, c, m in made ^ had}, key=lambda x: (x[0], sorted(x[1]))))
    reference = Reference(queues, start.shape, left, start.usage, start.lowest, reserved)
    stood = [job.job_id for job in stand_ins]
    return BacklogPlan(plan, planned, woken, stood, parks, reference, rounds, deferred)


def _slice(
    parked: backlog.Backlog,
    woken: Collection[str],
    *,
    limit: int | None,
    start: Start,
    always: Collection[str],
) -> tuple[list[snapshot.PendingJob], int]:
    """(the jobs this cycle plans, how many pending ones it leaves for the next): the live
    jobs and the woken ones, at most `limit` of them (`budget`): read from the backlog's
    per-queue order, so a slice costs O(limit), not O(backlog)."""
    awake = [_job(parked, job_id) for job_id in sorted(woken)]
    total = parked.live_count() + len(awake)
    if limit is None or total <= limit:
        return parked.live() + awake, 0
    found = (parked.get_live(job_id) for job_id in always)
    first = [job for job in found if job is not None]
    first += [job for job in awake if job.job_id in always]
    lines = budget.merged(parked.heads(start.order_of), budget.lines(awake, start.order_of))
    planned = budget.choose(lines, limit=limit, always=first)
    return planned, total - len(planned)


def _job(parked: backlog.Backlog, job_id: str) -> snapshot.PendingJob:
    found = parked.park_of(job_id)
    assert found is not None
    return found.job
