"""Plan one scheduling cycle: which cluster runs each pending job, which running jobs are
preempted for it, which jobs hold reservations, and why the rest wait. Pure.

Called by `jobs.scheduling.Scheduler` once per cycle with a snapshot of the fleet, the queued
jobs, the jobs holding GPUs and the queues configuration; the simulator and the benchmarks call
it the same way. No await, no clock, no I/O (`now` is an input): same inputs, same plan.

Phases:
0. the ledger: GPUs held per queue and model (`quotas`), the cohorts' capacities;
1. preemptors whose victims have released their GPUs (a fresh summary shows them free) go
   first, so the room made for them is theirs;
2. jobs holding a reservation (`reservation`) go next; the models they hold on their cluster
   are closed to every other job of the cycle;
3. the rest, head of queue by head of queue in fair-share order (`fairshare.QueueOrder`):
   jobs within their queue's guarantee first, then the queue with the lowest dominant share;
   within a queue, priority then submission time. Each job: admission by quota, then the
   whole gang fitted on every cluster from its summary (`fitting.fit_gang`, on the models
   its queue may take) that its `spec.clusters` selector allows (`clusterchoice`), the best
   fit chosen (its `order`, its `preferred` score, then the tightest) and *assumed* in the
   snapshot and charged to the queue, so later decisions in the cycle see it;
4. a job that fits nowhere may preempt (`preemption`: reclaim a guarantee, or a higher
   priority), within the cycle's budget; it is dispatched in a later cycle, once the victims
   are gone. Else, past `reserveAfterSeconds`, it gets a reservation. Either way it is a
   value with its reasons per cluster, each with a code (`ReasonCode`) and plain words.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from datetime import datetime

from broker.api import clusterchoice
from broker.api import queues as queues_api
from broker.api.queues import ReasonCode
from broker.planning import (
    containment,
    fairshare,
    fitting,
    plans,
    preemption,
    quotas,
    reservation,
    snapshot,
)

# the plan's values live in `plans`; their names here too, as `planning.Reason` is read
FLEET = plans.FLEET
ROOM_CODES = plans.ROOM_CODES
Reason = plans.Reason
Assignment = plans.Assignment
Unplaceable = plans.Unplaceable
Preemption = plans.Preemption
CyclePlan = plans.CyclePlan
preemption_of = plans.preemption_of

# a job's turn when no cluster may be sent an offer: one reason for all of them, planned no
# further (on a deep backlog every cycle's slice would otherwise be fitted in vain)
EVERY_CLUSTER_BUSY = Reason(
    FLEET,
    ReasonCode.CLUSTER_BUSY,
    "every cluster's agent has as many offers unanswered as the broker sends at once "
    "(--max-offers-in-flight); more go once one answers",
)


def plan_cycle(
    fleet: snapshot.FleetSnapshot,
    pending: Sequence[snapshot.PendingJob],
    *,
    running: Sequence[snapshot.RunningJob] = (),
    usage: quotas.Usage | None = None,
    queues: queues_api.QueuesConfig | None = None,
    reservations: Mapping[str, plans.Reservation] | None = None,
    releasing: Sequence[snapshot.Releasing] = (),
    now: datetime | None = None,
    max_assignments: int = 10_000,
    stand_ins: Sequence[snapshot.PendingJob] = (),
    array_holding: Mapping[str, int] | None = None,
) -> CyclePlan:
    """Decide one cycle. The fleet snapshot is changed (assumed placements).

    Without `queues` every queue is open and nothing is preempted or reserved; without `now`
    no time-based rule applies (no reservations, no minimum run time). With `usage` (kept by
    the shell) `running` is read only when a preemption is searched for, so it may be lazy.
    `stand_ins` take their turn in the fair-share order (phase 3) and are not planned: parked
    jobs (`parking`) whose place in their queue could hold a job behind them back.
    `array_holding`: per array id, how many of its jobs hold GPUs (Dispatched or Running);
    a job of an array with `parallelism` of them holding (or assigned in this cycle) waits
    (`ArrayParallelism`), before any quota, fit, preemption or reservation.
    """
    cycle = _Cycle(
        fleet,
        pending,
        running=running,
        usage=usage,
        tenancy=quotas.Tenancy(queues),
        releasing=releasing,
        now=now,
        max_assignments=max_assignments,
        stand_ins=stand_ins,
    )
    cycle.array_holding = dict(array_holding or {})
    cycle.run(reservations or {})
    cycle.plan.busy = cycle.busy()
    return cycle.plan


class _Cycle:
    def __init__(
        self,
        fleet: snapshot.FleetSnapshot,
        pending: Sequence[snapshot.PendingJob],
        *,
        running: Sequence[snapshot.RunningJob],
        usage: quotas.Usage | None,
        tenancy: quotas.Tenancy,
        releasing: Sequence[snapshot.Releasing],
        now: datetime | None,
        max_assignments: int,
        stand_ins: Sequence[snapshot.PendingJob] = (),
    ) -> None:
        self.plan = CyclePlan()
        self.fleet = fleet
        # clusters that may still be sent an offer this cycle (offer slots left, or no limit)
        self.open = {
            name
            for name, cluster in fleet.clusters.items()
            if cluster.offer_slots is None or cluster.offer_slots > 0
        }
        self.by_room: list[tuple[int, int, str]] = []  # built once the broken are set aside
        for name in sorted(fleet.clusters):
            problem = containment.check_cluster(fleet.clusters[name])
            if problem is not None:
                self._set_aside_cluster(name, problem)
        self.pristine = fleet.copy()
        # the clusters in the order `_rank` puts them for a job of no `spec.clusters`, the
        # fit aside: (scored down, free GPUs, name); kept as placements are assumed
        self.by_room = sorted(
            (int(c.scored_down), c.free_gpus, name) for name, c in fleet.clusters.items()
        )
        self.strikes = containment.Strikes()
        self.broken: dict[str, str] = {}  # job id -> why computing its order raised
        self.pending = {job.job_id: job for job in pending}
        self.stand_ins = {job.job_id: job for job in stand_ins if job.job_id not in self.pending}
        self.tenancy = tenancy
        self.policy = tenancy.policy
        self.now = now
        self.max_assignments = max_assignments
        self.ledger = quotas.Ledger.build(tenancy, running, fleet.total_gpus(), usage=usage)
        self.fleet_models = frozenset(m for c in fleet.clusters.values() for m in c.models)
        self.search = preemption.Search(
            tenancy=tenancy,
            ledger=self.ledger,
            running=running,
            now=now,
            budget=self.policy.max_preemptions_per_cycle,
            taken=set(),
            releasing={},
        )
        # GPUs of victims not yet stopped: their queues no longer count them as borrowed
        stopping = [(r.queue, r.gpus) for r in releasing if r.gpus]
        if usage is None and not stopping:
            stopping = [(job.queue, job.gpus) for job in running if job.preempting]
        for queue, gpus in stopping:
            held = self.search.releasing.setdefault(queue, {})
            for model, count in gpus.items():
                held[model] = held.get(model, 0) + count
        self.waiting: dict[str, set[str]] = {}
        released: set[str] = set()
        for item in releasing:
            if item.released:
                released.add(item.preemptor)
            else:
                self.waiting.setdefault(item.preemptor, set()).add(item.cluster)
        self.nominated = sorted(
            (self.pending[p] for p in released - set(self.waiting) if p in self.pending),
            key=self._in_queue_order,
        )
        self.taken_by: dict[str, set[str]] = {}
        self.reservations: dict[str, plans.Reservation] = {}
        self.array_holding: dict[str, int] = {}  # array id -> its jobs holding GPUs

    # ---- the phases -------------------------------------------------------------------

    def run(self, previous: Mapping[str, plans.Reservation]) -> None:
        kept = sorted(
            (
                r
                for r in previous.values()
                if r.job_id in self.pending and r.cluster in self.fleet.clusters
            ),
            key=lambda r: (r.since, r.job_id),
        )
        self.reservations = {r.job_id: r for r in kept}
        self.plan.reservations = self.reservations
        handled: set[str] = set()
        for job in self.nominated:
            handled.add(job.job_id)
            if not self._handle(job):
                return
        for item in kept:
            if item.job_id in handled:
                continue
            handled.add(item.job_id)
            if not self._handle(self.pending[item.job_id]):
                return
        by_queue: dict[str, list[snapshot.PendingJob]] = {}
        for waiting in self.pending.values():
            if waiting.job_id not in handled:
                by_queue.setdefault(waiting.queue, []).append(waiting)
        for stand_in in self.stand_ins.values():
            by_queue.setdefault(stand_in.queue, []).append(stand_in)
        order = fairshare.QueueOrder(by_queue, key=self._queue_key, priority=self._priority)
        while (head := order.pop()) is not None:
            if not self._handle(head):
                return
            order.advance(head.queue)

    def _handle(self, job: snapshot.PendingJob) -> bool:
        """Place or explain one job; False once the cycle may assign no more. A job whose
        planning raises is set aside (`containment`); the cycle goes on."""
        if len(self.plan.assignments) >= self.max_assignments:
            return False
        if job.job_id in self.stand_ins:
            return True  # its turn taken; nothing of it planned
        if self.busy() and job.job_id not in self.waiting and job.job_id not in self.reservations:
            # what it would be told on every cluster, said without fitting it (a preemptor
            # or a reservation's holder is planned: its room is counted, its wait told)
            self.plan.unplaceable.append(Unplaceable.of(job.job_id, [EVERY_CLUSTER_BUSY]))
            return True
        broken = self.broken.get(job.job_id)
        if broken is not None:
            self._set_aside_job(job.job_id, broken)
            return True
        try:
            placed = self._place(job)
        except Exception as exc:
            self._set_aside_job(job.job_id, containment.describe(exc))
            return True
        if placed:
            self.reservations.pop(job.job_id, None)
        return True

    def _set_aside_job(self, job_id: str, reason: str) -> None:
        self.plan.set_aside.append(containment.SetAside(containment.JOB, job_id, reason))
        self.plan.preemptions = [p for p in self.plan.preemptions if p.preemptor != job_id]
        self.plan.unplaceable = [u for u in self.plan.unplaceable if u.job_id != job_id]
        message = f"planning this job failed ({reason}); it is set aside until the next cycle"
        failed = Reason(FLEET, ReasonCode.PLANNING_FAILED, message)
        self.plan.unplaceable.append(Unplaceable.of(job_id, [failed]))

    def _set_aside_cluster(self, name: str, reason: str) -> None:
        self.plan.set_aside.append(containment.SetAside(containment.CLUSTER, name, reason))
        cluster = self.fleet.clusters.pop(name, None)
        self.open.discard(name)
        if cluster is not None:
            self._reorder(name, cluster, None)

    def _reorder(
        self,
        name: str,
        before: snapshot.ClusterCapacity,
        after: snapshot.ClusterCapacity | None,
    ) -> None:
        """Keep `by_room` in order as a cluster's capacity is replaced (or set aside)."""
        old = (int(before.scored_down), before.free_gpus, name)
        at = bisect.bisect_left(self.by_room, old)
        if at < len(self.by_room) and self.by_room[at] == old:
            del self.by_room[at]
        if after is not None:
            bisect.insort(self.by_room, (int(after.scored_down), after.free_gpus, name))

    def busy(self) -> bool:
        """Every cluster's agent is out of offer slots: no job can go this cycle."""
        return bool(self.fleet.clusters) and not self.open

    def _priority(self, job: snapshot.PendingJob) -> int:
        try:
            return self.tenancy.priority_of(job.queue, job.priority, job.priority_class)
        except Exception as exc:  # ordered last, then set aside when its turn comes
            self.broken.setdefault(job.job_id, containment.describe(exc))
            return -(2**63)

    def _in_queue_order(self, job: snapshot.PendingJob) -> tuple[int, datetime, str]:
        return fairshare.order_in_queue(job, self._priority(job))

    def _queue_key(self, head: snapshot.PendingJob) -> tuple[int, float]:
        try:
            gpus = quotas.gpus_of(head.request)
            within = any(
                self.ledger.check(head.queue, model, gpus) is True
                for model in quotas.allowed_models(head.request, self.fleet_models)
            )
            return (0 if within else 1, fairshare.dominant_share(self.ledger, head.queue))
        except Exception as exc:  # ordered last, then set aside when its turn comes
            self.broken.setdefault(head.job_id, containment.describe(exc))
            return (2, float("inf"))

    # ---- one job ----------------------------------------------------------------------

    def _blocked(self, cluster: str, job_id: str) -> tuple[frozenset[str], str | None]:
        """Models of `cluster` held for another job's reservation, and the oldest holder."""
        models: set[str] = set()
        holder = None
        for item in self.reservations.values():
            if item.cluster == cluster and item.job_id != job_id:
                models |= item.models
                holder = holder or item.job_id
        return frozenset(models), holder

    def _array_full(self, job: snapshot.PendingJob) -> bool:
        """Does the job's array hold GPUs with as many jobs as its parallelism? Then the job
        waits, explained (`ArrayParallelism`): it neither fits, preempts nor reserves."""
        limit = job.array
        if limit is None:
            return False
        holding = self.array_holding.get(limit.array_id, 0)
        if holding < limit.parallelism:
            return False
        message = (
            f"{holding} jobs of its array {limit.array_id} hold GPUs, its parallelism is "
            f"{limit.parallelism}: it waits until one of them ends"
        )
        reason = Reason(FLEET, ReasonCode.ARRAY_PARALLELISM, message)
        self.plan.unplaceable.append(Unplaceable.of(job.job_id, [reason]))
        return True

    def _place(self, job: snapshot.PendingJob) -> bool:
        if self._array_full(job):
            return False
        admission = self.ledger.admit(job.queue, job.request, self.fleet_models)
        reasons: list[Reason] = []
        if not admission.admissible and admission.misses:
            reasons = [Reason(FLEET, m.code, m.message) for m in admission.misses]
            self.plan.unplaceable.append(Unplaceable.of(job.job_id, reasons))
            return False
        tried: dict[str, fitting.Fit | Reason] = {}
        best = self._search(job, admission, tried) if job.clusters is None else None
        if best is None:
            best = self._survey(job, admission, tried, reasons)
        if best is not None:
            self._assign(job, best, admission)
            return True
        if not self.fleet.clusters:
            reasons.append(Reason(FLEET, ReasonCode.NO_CLUSTERS, "no member cluster is connected"))
        reasons = self._explain_taken(job, reasons, admission)
        reasons += self._make_room(job, reasons, admission)
        self.plan.unplaceable.append(Unplaceable.of(job.job_id, reasons))
        return False

    def _search(
        self,
        job: snapshot.PendingJob,
        admission: quotas.Admission,
        tried: dict[str, fitting.Fit | Reason],
    ) -> fitting.Fit | None:
        """The cluster `_survey` would choose for a job of no `spec.clusters`, found without
        fitting every cluster: the clusters are walked in the order of `_rank` less the fit
        (`self.by_room`: standing, then the busiest), and a cluster is fitted only if it has
        a node on which the gang's largest pod would leave less idle than the best fit so far
        (`fitting.could_leave_less`, one test of the free GPUs its nodes have); a fit that
        leaves nothing idle ends the walk, as no later cluster can rank before it.
        None if the job fits nowhere (every cluster tried is in `tried`, for `_survey`)."""
        best: fitting.Fit | None = None
        best_key: tuple[int, int, int, str] | None = None
        largest = fitting.largest_whole_pod(job.request)
        for scored_down, free, name in list(self.by_room):
            if best_key is not None and (scored_down > best_key[0] or best_key[1] == 0):
                break  # every cluster from here ranks after the best
            if name in job.excluded or name not in self.open:
                continue  # not offered the job: `_survey` says why, if it must
            cluster = self.fleet.clusters.get(name)
            if cluster is None:
                continue  # set aside during this job's walk
            if best_key is not None and not fitting.could_leave_less(cluster, largest, best_key[1]):
                continue  # no fit here leaves less idle, and it is not busier
            result = tried[name] = self._try(job, name, admission)
            if isinstance(result, fitting.Fit):
                key = (scored_down, result.leftover, free, name)
                if best_key is None or key < best_key:
                    best, best_key = result, key
        return best

    def _survey(
        self,
        job: snapshot.PendingJob,
        admission: quotas.Admission,
        tried: Mapping[str, fitting.Fit | Reason],
        reasons: list[Reason],
    ) -> fitting.Fit | None:
        """Every cluster, in name order: the best fit by `_rank`, and a reason for each
        cluster where the job does not fit (appended to `reasons`). `tried`: the clusters
        `_search` already fitted, not fitted again."""
        best: fitting.Fit | None = None
        for name in sorted(self.fleet.clusters.keys() | tried.keys()):
            result = tried.get(name)
            if result is None:
                result = self._try(job, name, admission)
            if isinstance(result, Reason):
                reasons.append(result)
            elif best is None or self._rank(job, result) < self._rank(job, best):
                best = result
        return best

    def _try(
        self, job: snapshot.PendingJob, name: str, admission: quotas.Admission
    ) -> fitting.Fit | Reason:
        """The job's best fit on one cluster, or why it has none there."""
        cluster = self.fleet.clusters[name]
        if not clusterchoice.allows(job.clusters, cluster.labels):
            assert job.clusters is not None
            message = job.clusters.describe_exclusion(cluster.labels)
            return Reason(name, ReasonCode.CLUSTER_SELECTOR, message)
        if name in job.excluded:
            return Reason(
                name,
                ReasonCode.REJECTED,
                "turned the job down (Rejected, or OfferTimeout: its offer unanswered); "
                "waiting for a fresh summary",
            )
        if cluster.offer_slots is not None and cluster.offer_slots <= 0:
            return Reason(
                name,
                ReasonCode.CLUSTER_BUSY,
                "its agent has as many offers unanswered as the broker sends at once "
                "(--max-offers-in-flight); more go once it answers",
            )
        blocked, holder = self._blocked(name, job.job_id)
        models = admission.admissible - blocked
        if blocked and not models and admission.admissible & cluster.models.keys():
            held = self.reservations[holder] if holder else None
            since = f" since {held.since:%H:%M:%S}" if held else ""
            return Reason(
                name,
                ReasonCode.WAITING_FOR_RESERVATION,
                f"its {'/'.join(sorted(blocked))} GPUs are held for job {holder}, "
                f"reserved{since}; other jobs go elsewhere until it runs",
            )
        try:
            result = fitting.fit_gang(cluster, job.request, models=models)
        except Exception as exc:
            reason = containment.describe(exc)
            if self.strikes.add(name, job.job_id):
                self._set_aside_cluster(name, reason)
            return Reason(name, ReasonCode.PLANNING_FAILED, f"planning here failed: {reason}")
        if isinstance(result, fitting.NoFit):
            return Reason(name, result.code, result.reason)
        return result

    def _rank(self, job: snapshot.PendingJob, fit: fitting.Fit) -> tuple[int, ...]:
        """The job's `spec.clusters` first (its `order`, then its `preferred` score), then
        a cluster not scored down for failing to start jobs (`standing`), then the tightest
        fit (fewest whole GPUs left idle on the nodes it breaks into), then the busiest
        cluster (keeps the emptiest whole for big gangs); the name breaks ties."""
        cluster = self.fleet.clusters[fit.cluster]
        chosen = job.clusters.rank(fit.cluster, cluster.labels) if job.clusters else (0, 0)
        return (*chosen, int(cluster.scored_down), fit.leftover, cluster.free_gpus)

    def _assign(
        self, job: snapshot.PendingJob, fit: fitting.Fit, admission: quotas.Admission
    ) -> None:
        # deducted on a copy, swapped in once whole: a deduction that raises changes nothing
        cluster = self.fleet.clusters[fit.cluster].copy()
        fitting.assume(cluster, fit)
        if cluster.offer_slots is not None:
            cluster.offer_slots -= 1
            if cluster.offer_slots <= 0:
                self.open.discard(fit.cluster)
        before = self.fleet.clusters[fit.cluster]
        self._reorder(fit.cluster, before, cluster)
        self.fleet.clusters[fit.cluster] = cluster
        gpus = fit.gpus_by_model
        borrowing = any(model not in admission.within for model in gpus)
        self.ledger.charge(job.queue, gpus)
        self.ledger.job_counts[job.queue] = self.ledger.job_counts.get(job.queue, 0) + 1
        self.taken_by.setdefault(fit.cluster, set()).add(job.queue)
        if job.array is not None:
            array_id = job.array.array_id
            self.array_holding[array_id] = self.array_holding.get(array_id, 0) + 1
        self.plan.assignments.append(Assignment(job.job_id, fit.cluster, fit.takes, borrowing))

    def _explain_taken(
        self, job: snapshot.PendingJob, reasons: list[Reason], admission: quotas.Admission
    ) -> list[Reason]:
        """A cluster that had room before this cycle's placements: say who took it."""
        out = []
        for reason in reasons:
            takers = self.taken_by.get(reason.cluster)
            if reason.code != ReasonCode.CAPACITY or not takers:
                out.append(reason)
                continue
            blocked, _ = self._blocked(reason.cluster, job.job_id)
            before = self.pristine.clusters[reason.cluster]
            fit = fitting.fit_gang(before, job.request, models=admission.admissible - blocked)
            if not isinstance(fit, fitting.Fit):
                out.append(reason)
                continue
            others = sorted(takers - {job.queue})
            if others:
                out.append(
                    Reason(
                        reason.cluster,
                        ReasonCode.FAIR_SHARE,
                        "its free GPUs went this cycle to jobs ahead in the fair-share order "
                        f"(queues {', '.join(others)}: within their guarantee or with a lower "
                        "share)",
                    )
                )
            else:
                out.append(
                    Reason(
                        reason.cluster,
                        ReasonCode.PRIORITY,
                        f"its free GPUs went this cycle to jobs of queue {job.queue} with a "
                        "higher priority or submitted earlier",
                    )
                )
        return out

    def _make_room(
        self, job: snapshot.PendingJob, reasons: list[Reason], admission: quotas.Admission
    ) -> list[Reason]:
        """Preempt for the job, or reserve for it, or say why neither; the reasons to add."""
        out: list[Reason] = []
        own = self.reservations.get(job.job_id)
        if own is not None:
            out.append(
                Reason(
                    own.cluster,
                    ReasonCode.WAITING_FOR_RESERVATION,
                    f"reserved for this job since {own.since:%H:%M:%S}: its "
                    f"{'/'.join(sorted(own.models))} GPUs take no new work until it fits",
                )
            )
        if job.job_id in self.waiting:
            # the room being made is its: count it, so its queue's next jobs do not reclaim it
            models = sorted(admission.within or admission.admissible)
            if models:
                self.ledger.charge(job.queue, {models[0]: quotas.gpus_of(job.request)})
            for cluster in sorted(self.waiting[job.job_id]):
                out.append(
                    Reason(
                        cluster,
                        ReasonCode.WAITING_FOR_PREEMPTION,
                        "jobs preempted for it are releasing their GPUs; it goes first once "
                        "the cluster reports them free",
                    )
                )
            return out
        room = [r.cluster for r in reasons if r.code in ROOM_CODES and r.cluster != FLEET]
        if not room or not admission.admissible:
            return out
        acted = self._preempt(job, room, admission, out)
        if acted:
            return out
        if admission.tier == 1 and self.tenancy.config.queues:
            share = fairshare.dominant_share(self.ledger, job.queue)
            out.append(
                Reason(
                    FLEET,
                    ReasonCode.FAIR_SHARE,
                    f"queue {job.queue} is at or above its guarantee (dominant share "
                    f"{share:.2f}, weight {self.tenancy.weight(job.queue):g}): this job "
                    "borrows idle GPUs only, after jobs within their guarantee and queues "
                    "with a lower share, and does not preempt to borrow",
                )
            )
        if own is None:
            out += reservation.reserve_for(
                job,
                admission,
                policy=self.policy,
                fleet=self.fleet,
                reservations=self.reservations,
                now=self.now,
            )
        return out

    def _preempt(
        self,
        job: snapshot.PendingJob,
        room: Sequence[str],
        admission: quotas.Admission,
        out: list[Reason],
    ) -> bool:
        if self.policy.max_preemptions_per_cycle <= 0:
            return False
        preemptor = preemption.Preemptor(
            job=job,
            priority=self._priority(job),
            models=admission.admissible,
            reclaim_models=admission.within,
            preempts_lower=self.tenancy.preempts(job.queue, job.priority_class),
        )
        clusters = [c for c in room if not self._blocked(c, job.job_id)[0]]
        if self.search.budget <= 0:
            if self.search.may_act(preemptor):
                out.append(
                    Reason(
                        FLEET,
                        ReasonCode.PREEMPTION_BUDGET,
                        f"this cycle's preemption budget "
                        f"({self.policy.max_preemptions_per_cycle}) is spent; it may "
                        "preempt next cycle",
                    )
                )
            return False
        outcome = preemption.choose_victims(self.search, self.fleet, preemptor, clusters=clusters)
        if isinstance(outcome, preemption.Refusal):
            out.append(Reason(FLEET, outcome.code, outcome.message))
            return False
        if outcome is None:
            if admission.within:
                out.append(
                    Reason(
                        FLEET,
                        ReasonCode.CAPACITY,
                        f"queue {job.queue} is within its guarantee for this job, but no "
                        "other queue borrows GPUs it could reclaim and no lower-priority job "
                        "may be preempted for it",
                    )
                )
            return False
        self.search.record(outcome)
        model = next(iter(outcome.victims[0].job.gpus))
        self.ledger.charge(job.queue, {model: quotas.gpus_of(job.request)})
        names = []
        for victim in outcome.victims:
            why = (
                f"reclaim the guaranteed quota of queue {job.queue}"
                if victim.reason == preemption.RECLAIM
                else f"make room for priority {preemptor.priority} over {victim.priority}"
            )
            self.plan.preemptions.append(
                preemption_of(victim, preemptor=job.job_id, cluster=outcome.cluster, why=why)
            )
            names.append(victim.job.job_id)
        kinds = {v.reason for v in outcome.victims}
        purpose = (
            f"to reclaim the guaranteed quota of queue {job.queue}"
            if kinds == {preemption.RECLAIM}
            else "for its higher priority"
            if kinds == {preemption.PRIORITY}
            else f"to reclaim queue {job.queue}'s guarantee and for its higher priority"
        )
        out.append(
            Reason(
                outcome.cluster,
                ReasonCode.WAITING_FOR_PREEMPTION,
                f"preempting {len(names)} job(s) there {purpose}: {', '.join(names)}; it is "
                "placed once their GPUs are free",
            )
        )
        return True
