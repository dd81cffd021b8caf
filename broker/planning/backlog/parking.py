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
   when it fails no victim is searched for;
3. what it was told is what the next cycles would tell it (`why` stays fresh): not that a
   cluster's room went this cycle to jobs ahead of it (next cycle, with them placed, the
   cluster is full), and its quota reasons those of the cycle's start (not of charges made
   before its turn; none at all for the room a preemption makes for a job of its cohort,
   gone next cycle). Else it is planned once more first.

**What wakes it** (`decide_wakes`, at the start of every cycle, against the `Reference`):
- the queues configuration changed, or the fleet's shape (a cluster joined, left, changed
  health, labels or models, GPU memory, node size, racks, GPUs): every parked job wakes (a
  cluster's labels decide which clusters a job's spec.clusters allows: only the allowed
  need a witness);
- a cluster shows as many free GPUs (or slots) of a witness's models as it needs;
- the GPUs its queue (or cohort) holds of a model fell to a `Threshold`: where its limit,
  its cohort's capacity or its guarantee no longer refuses it (or, within the guarantee,
  it could reclaim);
- a job of a lower priority than its own now holds GPUs (if its class preempts);
- it is named as a preemptor whose victims are releasing (never, but it would act);
- what `why` says of it would change: its queue's (or cohort's) GPUs of a model rising past
  a `Threshold` (`rising`: the model refused, or no longer within the guarantee); a
  reservation made or ended on models it may use (blocked somewhere, or free again), and
  then, if it is due, whoever holds reservations; it becoming due for one (time alone);
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
from broker.planning import planning, quotas, reservation, snapshot
from broker.planning.backlog import backlog, bounds, budget
from broker.planning.backlog.cyclestart import Reference, Start
from broker.planning.backlog.parks import decide_parks


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
