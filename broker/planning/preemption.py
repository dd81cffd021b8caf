"""Preemption: which running gangs to stop so that a pending job fits. Pure.

Called by `planning.plan_cycle` for a job that fits nowhere but may preempt:
- **reclaim**: the job fits its queue's guarantee for a model; victims are jobs of *other*
  queues that borrow that model (hold more than their guarantee) — whatever their priority;
- **priority**: the job's priority class preempts; victims have a lower priority and belong to
  the same queue, or to a queue that borrows the model.

Victims are whole gangs, on one cluster, on a model the job may use, running for at least
their class's minimum run time and not already being preempted. Per cluster, candidates are
taken in order of least lost work — lowest priority, then the fewest seconds of work lost
(since the job's last checkpoint, when its workload keeps `gpufed.io/last-checkpoint` on its
pods, else since it started: `lost_seconds`), then shortest run time — until the job fits a
scratch copy of the cluster with the victims' GPUs given back; then every victim the fit does
not need is dropped again (last taken first). Priority stays first: a checkpoint makes a job
cheaper to stop among its peers, never a higher priority a victim before a lower one.
Clusters are visited with the most free GPUs of the job's models first (the fewest victims);
among the first four that offer a choice, the one whose victims cost least wins (highest
victim priority, then GPU-seconds of work lost, then how many) — four, not all, to bound the
search on a large fleet. Without checkpoints the work lost is the run time: the order and
the costs are what they were before checkpoints were known. A choice needing
more victims than the cycle's budget has left is not made.

Giving GPUs back from a summary-only view is an approximation: the broker knows each running
pod's node and GPUs but not the nodes' free counts. It estimates a node's free GPUs as the
model's GPUs per node less the GPUs of the pods it knows on that node, and moves that node
up the `nodes_by_free` histogram (and the first rack histogram with such a node, the rack
being unknown); if no node sits in the estimated bucket, the node with the fewest free GPUs
that can take the pod's GPUs back is used (the conservative guess).
The NVLink block is left as it is. The estimate only decides *whether* to preempt: the
preemptor is dispatched in a later cycle, from the agent's fresh summary, so a wrong
estimate never over-commits a cluster (at worst the job waits, or preempts again within the
budget).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from broker.api.queues import ReasonCode
from broker.planning import fitting, quotas, snapshot

RECLAIM = "Reclaim"
PRIORITY = "Priority"
# clusters with a valid choice compared before the cheapest is taken (bounds the search)
MAX_CLUSTERS_COMPARED = 4


@dataclass(frozen=True)
class Preemptor:
    job: snapshot.PendingJob
    priority: int
    models: frozenset[str]  # models the job's queue may take it on
    reclaim_models: frozenset[str]  # models where it fits its queue's guarantee
    preempts_lower: bool  # its priority class may preempt lower priorities


@dataclass(frozen=True)
class Victim:
    job: snapshot.RunningJob
    reason: str  # RECLAIM | PRIORITY
    priority: int
    run_seconds: float
    lost_seconds: float | None = None  # work lost by stopping it (None: its run time)

    @property
    def lost(self) -> float:
        return self.run_seconds if self.lost_seconds is None else self.lost_seconds


@dataclass(frozen=True)
class Choice:
    cluster: str
    victims: tuple[Victim, ...]

    @property
    def cost(self) -> tuple[int, float, int, str]:
        worst = max((v.priority for v in self.victims), default=0)
        lost = sum(v.lost * v.job.total_gpus for v in self.victims)
        return (worst, lost, len(self.victims), self.cluster)


@dataclass(frozen=True)
class Refusal:
    code: ReasonCode
    message: str


@dataclass(frozen=True)
class Facts:
    """What a running job is as a victim, computed once per cycle."""

    priority: int
    run_seconds: float
    min_run_seconds: float
    model: str | None
    lost_seconds: float = 0.0  # since its last checkpoint, or its start (`lost_seconds`)


@dataclass
class Search:
    """What one cycle's preemptions share: the budget, the victims taken, their releases, and
    each running job's facts, with every cluster's jobs in victim order (least lost work)."""

    tenancy: quotas.Tenancy
    ledger: quotas.Ledger
    running: Sequence[snapshot.RunningJob]  # jobs holding GPUs (read at the first search)
    now: datetime | None
    budget: int
    taken: set[str]
    releasing: dict[str, dict[str, int]]  # queue -> model -> GPUs already on their way out
    facts: dict[str, Facts] = field(default_factory=dict)
    _ordered: dict[str, list[snapshot.RunningJob]] = field(default_factory=dict)
    _lowest: list[int | None] = field(default_factory=list)
    _held: dict[str, dict[str, int]] = field(default_factory=dict)
    _by_cluster: dict[str, list[snapshot.RunningJob]] | None = None

    def on(self, cluster: str) -> list[snapshot.RunningJob]:
        if self._by_cluster is None:
            self._by_cluster = {}
            for job in self.running:
                self._by_cluster.setdefault(job.cluster, []).append(job)
        return self._by_cluster.get(cluster, [])

    def ordered(self, cluster: str) -> list[snapshot.RunningJob]:
        """The cluster's running jobs in victim order, their facts computed (once a cycle)."""
        if cluster not in self._ordered:
            tenancy = self.tenancy
            jobs = self.on(cluster)
            for job in jobs:
                self.facts[job.job_id] = Facts(
                    priority=tenancy.priority_of(job.queue, job.priority, job.priority_class),
                    run_seconds=run_seconds(job, self.now),
                    min_run_seconds=tenancy.min_run_seconds(job.queue, job.priority_class),
                    model=next(iter(job.gpus), None),
                    lost_seconds=lost_seconds(job, self.now),
                )
            self._ordered[cluster] = sorted(jobs, key=self._victim_order)
        return self._ordered[cluster]

    def lowest_priority(self) -> int | None:
        held = self.ledger.held
        if not self._lowest and held is not None and held.priorities is not None:
            self._lowest.append(held.lowest_priority(self.tenancy))
        if not self._lowest:
            tenancy = self.tenancy
            self._lowest.append(
                min(
                    (
                        tenancy.priority_of(j.queue, j.priority, j.priority_class)
                        for j in self.running
                    ),
                    default=None,
                )
            )
        return self._lowest[0]

    def _victim_order(self, job: snapshot.RunningJob) -> tuple[int, float, float, int, str]:
        facts = self.facts[job.job_id]
        return (facts.priority, facts.lost_seconds, facts.run_seconds, job.total_gpus, job.job_id)

    def held_by_node(self, cluster: str) -> dict[str, int]:
        """GPUs of the pods the broker knows on each node of `cluster` (a fresh copy)."""
        if cluster not in self._held:
            self._held[cluster] = _held_by_node(self.on(cluster))
        return dict(self._held[cluster])

    def used(self, queue: str, model: str) -> int:
        return self.ledger.used(queue, model) - self.releasing.get(queue, {}).get(model, 0)

    def borrows(self, queue: str, model: str) -> bool:
        return self.used(queue, model) > self.ledger.guaranteed(queue, model)

    def may_act(self, preemptor: Preemptor) -> bool:
        """Whether anything at all could be a victim for `preemptor` (a cheap first test)."""
        if any(
            queue != preemptor.job.queue and self.borrows(queue, model)
            for queue in self.ledger.usage
            for model in preemptor.reclaim_models
        ):
            return True
        lowest = self.lowest_priority() if preemptor.preempts_lower else None
        return lowest is not None and lowest < preemptor.priority

    def record(self, choice: Choice) -> None:
        self.budget -= len(choice.victims)
        for victim in choice.victims:
            self.taken.add(victim.job.job_id)
            held = self.releasing.setdefault(victim.job.queue, {})
            for model, count in victim.job.gpus.items():
                held[model] = held.get(model, 0) + count


def run_seconds(job: snapshot.RunningJob, now: datetime | None) -> float:
    if job.started is None or now is None:
        return 0.0
    return max(0.0, (now - job.started).total_seconds())


def lost_seconds(job: snapshot.RunningJob, now: datetime | None) -> float:
    """The work a job loses if stopped now: seconds since its last checkpoint, or since it
    started when it has none in this run (a checkpoint before the start is an earlier run's)."""
    if job.started is None or now is None:
        return 0.0
    since = job.started
    if job.checkpointed is not None and job.checkpointed > since:
        since = min(job.checkpointed, now)
    return max(0.0, (now - since).total_seconds())


def give_back(
    cluster: snapshot.ClusterCapacity, victim: snapshot.RunningJob, held: dict[str, int]
) -> None:
    """Add a victim's GPUs back to the cluster's histograms (estimate: see the module doc)."""
    cluster.changed()
    model = next((cluster.models[m] for m in victim.gpus if m in cluster.models), None)
    if model is None:
        return
    size = model.gpus_per_node or len(model.nodes_by_free) - 1
    for pod in victim.pods:
        if pod.gpus <= 0:
            continue
        estimate = min(max(size - held.get(pod.node, 0), 0), size - pod.gpus)
        moved = _raise_node(model.nodes_by_free, estimate, pod.gpus)
        if moved is not None:
            for hist in model.racks.values():
                if moved < len(hist) and hist[moved] > 0:
                    hist[moved] -= 1
                    hist[moved + pod.gpus] += 1
                    break
        held[pod.node] = held.get(pod.node, 0) - pod.gpus


def _raise_node(hist: list[int], free: int, gpus: int) -> int | None:
    """Move one node from `free` (or the nearest bucket that can take `gpus`) to free+gpus."""
    candidates = [free] + [b for b in range(len(hist) - gpus) if b != free]
    for bucket in candidates:
        if bucket >= 0 and bucket + gpus < len(hist) and hist[bucket] > 0:
            hist[bucket] -= 1
            hist[bucket + gpus] += 1
            return bucket
    return None


def _held_by_node(jobs: Sequence[snapshot.RunningJob]) -> dict[str, int]:
    held: dict[str, int] = {}
    for job in jobs:
        for pod in job.pods:
            held[pod.node] = held.get(pod.node, 0) + pod.gpus
    return held


def _classify(
    search: Search,
    preemptor: Preemptor,
    job: snapshot.RunningJob,
    facts: Facts,
    used: dict[tuple[str, str], int],
) -> Victim | None:
    """The victim `job` would be for `preemptor`, or None if it may not be preempted."""
    model = facts.model
    if model is None or model not in preemptor.models:
        return None
    held = used.get((job.queue, model))
    if held is None:
        borrowing = search.borrows(job.queue, model)
    else:
        borrowing = held > search.ledger.guaranteed(job.queue, model)
    other_queue = job.queue != preemptor.job.queue
    if model in preemptor.reclaim_models and other_queue and borrowing:
        return Victim(job, RECLAIM, facts.priority, facts.run_seconds, facts.lost_seconds)
    if (
        preemptor.preempts_lower
        and facts.priority < preemptor.priority
        and (not other_queue or borrowing)
    ):
        return Victim(job, PRIORITY, facts.priority, facts.run_seconds, facts.lost_seconds)
    return None


def _fits(
    cluster: snapshot.ClusterCapacity,
    preemptor: Preemptor,
    victims: Sequence[Victim],
    base_held: Mapping[str, int],
) -> bool:
    scratch = cluster.copy()
    held = dict(base_held)
    for victim in victims:
        give_back(scratch, victim.job, held)
    fit = fitting.fit_gang(scratch, preemptor.job.request, models=preemptor.models)
    return isinstance(fit, fitting.Fit)


def _choose_on(
    search: Search, cluster: snapshot.ClusterCapacity, preemptor: Preemptor
) -> tuple[Choice | None, int]:
    """The cheapest victims on one cluster; and how many were spared for their min run time.

    Candidates come in victim order (lowest priority, then least work lost, then shortest
    run); each is taken
    until the job fits; a queue stops being a borrower once enough of its jobs are taken.
    """
    chosen: list[Victim] = []
    used: dict[tuple[str, str], int] = {}
    too_young = 0
    scratch: snapshot.ClusterCapacity | None = None
    held: dict[str, int] = {}
    base_held: dict[str, int] = {}
    fitted = False
    for job in search.ordered(cluster.name):
        if job.preempting or job.started is None or job.job_id in search.taken:
            continue
        facts = search.facts[job.job_id]
        victim = _classify(search, preemptor, job, facts, used)
        if victim is None:
            continue
        if search.now is not None and facts.run_seconds < facts.min_run_seconds:
            too_young += 1
            continue
        if scratch is None:
            scratch = cluster.copy()
            base_held = search.held_by_node(cluster.name)
            held = dict(base_held)
        chosen.append(victim)
        for model, count in job.gpus.items():
            key = (job.queue, model)
            used[key] = used.get(key, search.used(*key)) - count
        give_back(scratch, job, held)
        fit = fitting.fit_gang(scratch, preemptor.job.request, models=preemptor.models)
        if isinstance(fit, fitting.Fit):
            fitted = True
            break
    if not fitted:
        return None, too_young
    for victim in list(reversed(chosen)):
        rest = [v for v in chosen if v is not victim]
        if rest and _fits(cluster, preemptor, rest, base_held):
            chosen = rest
    return Choice(cluster.name, tuple(chosen)), too_young


def _closest_first(
    fleet: snapshot.FleetSnapshot, clusters: Sequence[str], models: frozenset[str]
) -> list[snapshot.ClusterCapacity]:
    """Healthy clusters, most free GPUs of the models first (the fewest victims), then name."""
    found = [fleet.clusters[n] for n in clusters if n in fleet.clusters]
    healthy = [c for c in found if c.healthy]
    return sorted(
        healthy,
        key=lambda c: (-sum(m.free_gpus for n, m in c.models.items() if n in models), c.name),
    )


def choose_victims(
    search: Search,
    fleet: snapshot.FleetSnapshot,
    preemptor: Preemptor,
    *,
    clusters: Sequence[str],
) -> Choice | Refusal | None:
    """The least costly preemption that lets `preemptor` fit, on one of `clusters`.

    None when nothing may be preempted for it at all.
    """
    if not search.may_act(preemptor):
        return None
    best: Choice | None = None
    spared = 0
    found = 0
    for cluster in _closest_first(fleet, clusters, preemptor.models):
        choice, too_young = _choose_on(search, cluster, preemptor)
        spared += too_young
        if choice is None:
            continue
        found += 1
        if best is None or choice.cost < best.cost:
            best = choice
        if found >= MAX_CLUSTERS_COMPARED:
            break
    if best is None:
        if spared:
            return Refusal(
                ReasonCode.MIN_RUN_TIME,
                f"{spared} job(s) that could be preempted for it have not yet run their "
                "minimum run time",
            )
        return None
    if len(best.victims) > search.budget:
        return Refusal(
            ReasonCode.PREEMPTION_BUDGET,
            f"fitting it needs {len(best.victims)} preemption(s) on {best.cluster}; "
            f"{max(search.budget, 0)} left in this cycle's budget: next cycle",
        )
    return best
