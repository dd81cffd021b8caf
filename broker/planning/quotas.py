"""Quotas: what each queue holds per GPU model and whether it may take more. Pure.

Called by `planning.plan_cycle` (admission of every job, and its tier in the fair-share order),
by `preemption` (which queues borrow, and so may be reclaimed from) and by the scheduling
shell for the per-queue metrics and `GET /v1/queues`.

A job of `n` GPUs of model `m` in queue `q` is admitted when
- `q` has a quota for `m` (the model's entry, or `"*"`), and
- it stays within the queue's limit: `used(q, m) + n <= limit` (no limit: the cohort's), and
- either it stays within the guarantee, `used(q, m) + n <= guaranteed` (never refused for
  lack of idle quota: a guarantee is reclaimed from borrowers by preemption), or it borrows
  idle quota of the cohort. A cohort that declares a capacity for `m` lends up to it:
  `cohort_used(m) + n <= capacity`; otherwise the cohort is the whole fleet and lends what is
  free, which the fit on the clusters' summaries decides.

Usage counts Dispatched and Running jobs, a sharing pod as one whole GPU (quotas are whole
GPUs), a pod of MIG slices as the whole GPUs its slices fill, at least one (`mig.quota_gpus`:
a `1g.10gb` pod counts 1, a pod of three `3g.40gb` slices 2; why whole GPUs and not c/7 of
one: `broker.api.mig`). `gpus_of` is that count for a job: what admission checks, the ledger
charges and fair share sees; `fitting.Fit.gpus_by_model` counts the same per model for what
a dispatch holds. Preemption gives a MIG victim's quota back but no capacity (its pods hold
no whole GPU), so it never makes room for a MIG job: such a job waits for slices to free.
A cohort's capacity (also the denominator of fair share) is what it declares, else every GPU
of that model in the fleet's ready clusters. Without a queues file every queue is open (no
guarantee, no limit) and nothing is preempted or reserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.api import gangs, mig, queues
from broker.api.queues import ReasonCode
from broker.planning import snapshot

PriorityKey = tuple[str, int, str | None]

LEGACY = queues.QueuesConfig(
    policy=queues.Policy(max_preemptions_per_cycle=0, reserve_after_seconds=None)
)


class Tenancy:
    """The queues configuration, indexed for the lookups of one cycle."""

    def __init__(self, config: queues.QueuesConfig | None = None) -> None:
        self.config = config if config is not None else LEGACY
        self.policy = self.config.policy
        self._queues = {q.name: q for q in self.config.queues}
        self._classes = {c.name: c for c in self.config.priority_classes}
        self._open: dict[str, queues.Queue] = {}
        self._priorities: dict[tuple[str, int, str | None], int] = {}
        self._min_runs: dict[tuple[str, str | None], float] = {}

    def queue(self, name: str) -> queues.Queue:
        """The declared queue, or an open one (no guarantee, no limit) for any other name."""
        found = self._queues.get(name)
        if found is not None:
            return found
        if name not in self._open:
            self._open[name] = queues.open_queue(name)
        return self._open[name]

    def declared(self, name: str) -> bool:
        return name in self._queues

    def class_name(self, queue: str, spec_class: str | None) -> str | None:
        if spec_class is not None and spec_class in self._classes:
            return spec_class
        return self.queue(queue).priority_class or self.policy.default_priority_class

    def priority_of(self, queue: str, spec_priority: int, spec_class: str | None) -> int:
        """A job's effective priority: its class, else its number, else its queue's class."""
        key = (queue, spec_priority, spec_class)
        found = self._priorities.get(key)
        if found is None:
            found = self._priorities[key] = self._resolve_priority(*key)
        return found

    def _resolve_priority(self, queue: str, spec_priority: int, spec_class: str | None) -> int:
        if spec_class is not None and spec_class in self._classes:
            return self._classes[spec_class].value
        if spec_priority:
            return spec_priority
        name = self.class_name(queue, None)
        return self._classes[name].value if name in self._classes else 0

    def preempts(self, queue: str, spec_class: str | None) -> bool:
        item = self._classes.get(self.class_name(queue, spec_class) or "")
        return item.preempts if item is not None else True

    def min_run_seconds(self, queue: str, spec_class: str | None) -> float:
        key = (queue, spec_class)
        found = self._min_runs.get(key)
        if found is None:
            found = self._min_runs[key] = self._resolve_min_run(queue, spec_class)
        return found

    def _resolve_min_run(self, queue: str, spec_class: str | None) -> float:
        item = self._classes.get(self.class_name(queue, spec_class) or "")
        if item is not None and item.min_run_seconds is not None:
            return item.min_run_seconds
        return self.policy.min_run_seconds

    def weight(self, queue: str) -> float:
        return self.queue(queue).weight

    def model_weight(self, model: str) -> float:
        return self.policy.weight_of(model)


@dataclass(frozen=True)
class Miss:
    """Why a queue may not take `gpus` more GPUs of `model`."""

    model: str
    code: ReasonCode
    message: str


@dataclass(frozen=True)
class Admission:
    """The models a job may use: within its queue's guarantee, or at all (borrowing)."""

    within: frozenset[str]
    admissible: frozenset[str]
    misses: tuple[Miss, ...]

    @property
    def tier(self) -> int:
        """0: fits a guarantee (goes first); 1: borrows."""
        return 0 if self.within else 1


def gpus_of(request: gangs.GangRequest) -> int:
    """The whole GPUs a job counts toward its queue's quota: `request.gpus` (a sharing pod
    one), and for its MIG pods, which `request.gpus` leaves out, `mig.quota_gpus`."""
    mig_gpus = sum(
        replicas * mig.quota_gpus(shape.mig_profile, shape.mig_slices)
        for _, replicas, shape in request.tasks
        if shape.mig_slices
    )
    return request.gpus + mig_gpus


def allowed_models(request: gangs.GangRequest, fleet_models: Iterable[str]) -> frozenset[str]:
    """The models of the fleet any GPU pod of the job may use: those its node selection
    admits (`PodShape.admits_model`: `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt` on
    the GPU product label decide; a requirement on a label the broker does not see excludes
    nothing, the agent decides it)."""
    present = frozenset(fleet_models)
    shapes = [shape for _, _, shape in request.tasks if shape.uses_gpus]
    if any(shape.selector is not None for shape in shapes):
        return frozenset(m for m in present if any(s.admits_model(m) for s in shapes))
    wanted: set[str] = set()
    for shape in shapes:
        if not shape.models:
            return present
        wanted.update(shape.models)
    return present & wanted if wanted else present


@dataclass(frozen=True)
class Usage:
    """GPUs held per queue and model, and jobs holding them: kept up to date by the shell
    (on every transition) so that a cycle does not need to walk every running job."""

    gpus: Mapping[str, Mapping[str, int]]
    jobs: Mapping[str, int]
    # (queue, spec priority, spec class) -> jobs: their lowest effective priority, without a walk
    priorities: Mapping[PriorityKey, int] | None = None

    @classmethod
    def of(cls, running: Iterable[snapshot.RunningJob]) -> Usage:
        gpus: dict[str, dict[str, int]] = {}
        jobs: dict[str, int] = {}
        priorities: dict[PriorityKey, int] = {}
        for job in running:
            held = gpus.setdefault(job.queue, {})
            for model, count in job.gpus.items():
                held[model] = held.get(model, 0) + count
            jobs[job.queue] = jobs.get(job.queue, 0) + 1
            key = (job.queue, job.priority, job.priority_class)
            priorities[key] = priorities.get(key, 0) + 1
        return cls(gpus, jobs, priorities)

    def lowest_priority(self, tenancy: Tenancy) -> int | None:
        if self.priorities is None:
            return None
        return min(
            (tenancy.priority_of(*k) for k, n in self.priorities.items() if n > 0), default=None
        )


@dataclass
class Ledger:
    """GPUs held per queue and cohort during one cycle; charged as the planner assigns."""

    tenancy: Tenancy
    capacity: dict[str, dict[str, int]]  # cohort -> model -> GPUs it may use
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> model -> GPUs
    cohort_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    job_counts: dict[str, int] = field(default_factory=dict)  # queue -> jobs holding GPUs
    declared: dict[str, frozenset[str]] = field(default_factory=dict)  # cohort -> capped models
    held: Usage | None = None  # what the ledger started from
    # queue -> its dominant share (`fairshare.dominant_share`), until its usage changes:
    # the cycle orders its queues by it after every job it handles
    shares: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        tenancy: Tenancy,
        running: Sequence[snapshot.RunningJob],
        fleet_gpus: Mapping[str, int],
        *,
        usage: Usage | None = None,
    ) -> Ledger:
        """The ledger of a cycle: from `usage` if the shell keeps it, else from `running`."""
        held = usage if usage is not None else Usage.of(running)
        cohorts = {q.cohort for q in tenancy.config.queues} | {"default"}
        cohorts |= {tenancy.queue(queue).cohort for queue in held.gpus}
        capacity = {}
        capped = {}
        for name in cohorts:
            declared = tenancy.config.cohort(name)
            cap = dict(fleet_gpus)
            if declared is not None:
                cap.update(declared.capacity)
                capped[name] = frozenset(declared.capacity)
            capacity[name] = cap
        ledger = cls(tenancy=tenancy, capacity=capacity, declared=capped, held=held)
        for queue, gpus in held.gpus.items():
            ledger.charge(queue, gpus)
        ledger.job_counts = dict(held.jobs)
        return ledger

    def cohort_of(self, queue: str) -> str:
        return self.tenancy.queue(queue).cohort

    def cohort_capacity(self, cohort: str) -> dict[str, int]:
        if cohort not in self.capacity:
            self.capacity[cohort] = dict(self.capacity.get("default", {}))
        return self.capacity[cohort]

    def used(self, queue: str, model: str) -> int:
        return self.usage.get(queue, {}).get(model, 0)

    def guaranteed(self, queue: str, model: str) -> int:
        quota = self.tenancy.queue(queue).quota(model)
        return quota.guaranteed if quota is not None else 0

    def charge(self, queue: str, gpus: Mapping[str, int], *, sign: int = 1) -> None:
        held = self.usage.setdefault(queue, {})
        pooled = self.cohort_usage.setdefault(self.cohort_of(queue), {})
        self.shares.pop(queue, None)
        for model, count in gpus.items():
            held[model] = held.get(model, 0) + sign * count
            pooled[model] = pooled.get(model, 0) + sign * count

    def check(self, queue: str, model: str, gpus: int) -> Miss | bool:
        """True: within the guarantee; False: borrowing, allowed; a Miss: refused."""
        spec = self.tenancy.queue(queue)
        quota = spec.quota(model)
        if quota is None or quota.limit == 0:
            return Miss(
                model,
                ReasonCode.QUOTA,
                f"queue {queue} has no quota for {model} GPUs",
            )
        used = self.used(queue, model)
        if quota.limit is not None and used + gpus > quota.limit:
            return Miss(
                model,
                ReasonCode.BORROWING_LIMIT,
                f"queue {queue} holds {used} {model} GPUs and may hold at most {quota.limit} "
                f"(guaranteed {quota.guaranteed}, borrowing up to {quota.borrowing}); "
                f"this job needs {gpus} more",
            )
        if used + gpus <= quota.guaranteed:
            return True
        cohort = spec.cohort
        if model not in self.declared.get(cohort, ()):
            return False  # the cohort lends whatever the fleet has free: fitting decides
        capacity = self.cohort_capacity(cohort).get(model, 0)
        pooled = self.cohort_usage.get(cohort, {}).get(model, 0)
        if pooled + gpus > capacity:
            return Miss(
                model,
                ReasonCode.NO_IDLE_QUOTA,
                f"cohort {cohort} uses {pooled} of its {capacity} {model} GPUs: not {gpus} "
                f"idle to lend, and queue {queue} is at or above its guarantee of "
                f"{quota.guaranteed}",
            )
        return False

    def admit(
        self, queue: str, request: gangs.GangRequest, fleet_models: Iterable[str]
    ) -> Admission:
        """Which of the models the job allows its queue may take `gpus_of(request)` of."""
        within: set[str] = set()
        admissible: set[str] = set()
        misses = []
        gpus = gpus_of(request)
        for model in sorted(allowed_models(request, fleet_models)):
            verdict = self.check(queue, model, gpus)
            if isinstance(verdict, Miss):
                misses.append(verdict)
                continue
            admissible.add(model)
            if verdict:
                within.add(model)
        return Admission(frozenset(within), frozenset(admissible), tuple(misses))
