"""Queues, tenants, quotas and priority classes: `config/queues.yaml` and `/v1/queues`.

The broker is the one source of truth for quotas. A queue belongs to a tenant and a cohort and
holds, per GPU model (the `nvidia.com/gpu.product` label, or `"*"` for every model not listed),
a guaranteed quota and a limit: the most GPUs of that model the queue may hold, borrowed ones
included. Between the guarantee and the limit a queue borrows what its cohort leaves idle, and
a queue below its guarantee reclaims it from borrowers by preemption. Priority classes name
job priorities; a job picks one with `spec.priorityClass`, else it gets its queue's.

A file or PUT that cannot work is refused (guaranteed above limit, unknown priority class); a
cohort whose guarantees exceed its GPUs is accepted with a warning (`warnings`), because
capacity changes as clusters come and go.

An allotment (`allotments` in the file) is what the fleet admin lets one tenant claim with all
its queues together: guarantees and limits per GPU model, the highest weight and priority
class, the cohorts, the images its jobs may run (`allowedImages`, which a queue may narrow:
`broker.api.images`). A tenant-admin's PUT beyond it is refused; `broker.api.allotments` says
what fits and what a tenant gets where the file declares no allotment.

The queue mode (`QueueMode`, `--queue-mode`) says what a queue name nobody declared means:
`open`, an open queue (`open_queue`); `declared`, a submit naming it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.api import images, jobs

ANY_MODEL = "*"


class QueueMode(StrEnum):
    """What a job naming an undeclared queue gets (`broker.state.registry`)."""

    OPEN = "open"  # accepted, in an open queue (no guarantee, no limit)
    DECLARED = "declared"  # refused: a job must name a declared queue of its tenant


class QueueSource(StrEnum):
    """Where a declared queue comes from (what `DELETE /v1/queues/{name}` may remove)."""

    FILE = "file"  # the queues file only: not deletable through the API
    API = "api"  # stored through `PUT /v1/queues/{name}` only
    OVERRIDE = "file+api"  # in the file, overridden by a PUT (the PUT's spec applies)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelQuota(_Model):
    guaranteed: Annotated[int, Field(ge=0)] = 0
    limit: Annotated[int | None, Field(ge=0)] = Field(
        None, description="most GPUs of the model the queue may hold, borrowed included"
    )

    @model_validator(mode="after")
    def _guarantee_within_limit(self) -> ModelQuota:
        if self.limit is not None and self.guaranteed > self.limit:
            raise ValueError(
                f"guaranteed: {self.guaranteed} is above the limit ({self.limit}); "
                "a queue cannot be guaranteed more than it may hold"
            )
        return self

    @property
    def borrowing(self) -> int | None:
        """How many GPUs above the guarantee the queue may borrow (None: no limit)."""
        return None if self.limit is None else self.limit - self.guaranteed


OPEN_QUOTA = ModelQuota()

# an allowed-images prefix, normalized (`images.check_prefix`); a list of them, bounded
ImagePrefix = Annotated[str, AfterValidator(images.check_prefix)]
ImagePrefixes = Annotated[list[ImagePrefix], Field(max_length=images.MAX_PREFIXES)]


class QueueSpec(_Model):
    """The body of `PUT /v1/queues/{name}`."""

    tenant: Annotated[str, Field(min_length=1, max_length=63)]
    cohort: Annotated[str, Field(min_length=1, max_length=63)] = "default"
    weight: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    priority_class: str | None = Field(None, alias="priorityClass")
    quotas: dict[str, ModelQuota] = Field(default_factory=dict)
    allowed_images: ImagePrefixes | None = Field(
        None,
        alias="allowedImages",
        description="image prefixes (registry host first, e.g. `nvcr.io/nvidia/`) the queue's "
        "jobs may run, within its tenant's allotment's `allowedImages`: it narrows that list, "
        "never widens it (null: the allotment's list alone; []: no image). See "
        "`broker.api.images` for the matching rules",
    )

    def quota(self, model: str) -> ModelQuota | None:
        """The quota of `model` (or the `"*"` entry); None: the queue may not use it."""
        found = self.quotas.get(model)
        return found if found is not None else self.quotas.get(ANY_MODEL)


class Queue(QueueSpec):
    name: Annotated[str, Field(min_length=1, max_length=63)]

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        return jobs.ObjectMeta._dns_label(value)


def open_queue(name: str) -> Queue:
    """A queue nobody declared: no guarantee, no limit, weight 1, cohort `default`.

    `name` is taken as the jobs have it, not validated again: a job stored before queue names
    were checked (`Team_A`) still gets a queue, never an error in a cycle or a listing."""
    return Queue.model_construct(
        name=name,
        tenant="*",
        cohort="default",
        weight=1.0,
        priority_class=None,
        quotas={ANY_MODEL: OPEN_QUOTA},
    )


class Allotment(_Model):
    """What the fleet admin lets one tenant claim with its queues, all of them together.

    A tenant-admin manages its tenant's queues within it; the admin is not bound by it."""

    tenant: Annotated[str, Field(min_length=1, max_length=63)]
    quotas: dict[str, ModelQuota] = Field(
        default_factory=dict,
        description="per GPU model (or `*`): `guaranteed`, the most the tenant's queues may be "
        "guaranteed together; `limit`, the most their limits may add up to (unset: no bound, "
        "queues without a limit included). A model not listed, with no `*`: none of it",
    )
    max_weight: Annotated[float, Field(gt=0, le=1_000_000, alias="maxWeight")] = Field(
        1.0, description="the highest weight one of its queues may have"
    )
    max_priority_class: str | None = Field(
        None,
        alias="maxPriorityClass",
        description="the highest priority class its queues may name (unset: the policy's "
        "default class; a queue naming no class always fits)",
    )
    cohorts: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=lambda: ["default"], description="the cohorts its queues may join"
    )
    allowed_images: ImagePrefixes | None = Field(
        None,
        alias="allowedImages",
        description="image prefixes (registry host first, e.g. `registry.example.com/team-a/`, "
        "`nvcr.io/nvidia/`) the tenant's jobs may run; its queues may narrow it, not widen it "
        "(null: any image; []: no image). Checked at submit and by the agent before it "
        "creates pods; see `broker.api.images` for the matching rules",
    )

    def quota(self, model: str) -> ModelQuota | None:
        """The allotment of `model` (or the `"*"` entry); None: none of it."""
        found = self.quotas.get(model)
        return found if found is not None else self.quotas.get(ANY_MODEL)


class PriorityClass(_Model):
    name: Annotated[str, Field(min_length=1, max_length=63)]
    value: int
    preempts: bool = Field(True, description="may preempt lower-priority jobs")
    min_run_seconds: Annotated[float | None, Field(ge=0, alias="minRunSeconds")] = Field(
        None, description="jobs of this class are never preempted earlier (default: policy)"
    )


class Cohort(_Model):
    name: Annotated[str, Field(min_length=1, max_length=63)]
    capacity: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="GPUs per model the cohort may use; unset: every GPU of the fleet",
    )


class Policy(_Model):
    model_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        alias="modelWeights",
        description="what one GPU of a model counts for in fair share (unlisted: 1)",
    )
    max_preemptions_per_cycle: Annotated[int, Field(ge=0, alias="maxPreemptionsPerCycle")] = 8
    min_run_seconds: Annotated[float, Field(ge=0, alias="minRunSeconds")] = 0.0
    reserve_after_seconds: Annotated[float | None, Field(ge=0, alias="reserveAfterSeconds")] = (
        Field(300.0, description="a job waiting this long gets a reservation; null: never")
    )
    max_reservations: Annotated[int, Field(ge=0, alias="maxReservations")] = Field(
        1, description="jobs holding a reservation at once (oldest waiting first)"
    )
    default_priority_class: str | None = Field(None, alias="defaultPriorityClass")

    def weight_of(self, model: str) -> float:
        return self.model_weights.get(model, self.model_weights.get(ANY_MODEL, 1.0))


class QueuesConfig(_Model):
    """`config/queues.yaml`: the whole tenancy configuration of a broker."""

    policy: Policy = Field(default_factory=Policy)
    priority_classes: list[PriorityClass] = Field(default_factory=list, alias="priorityClasses")
    cohorts: list[Cohort] = Field(default_factory=list)
    queues: list[Queue] = Field(default_factory=list)
    allotments: list[Allotment] = Field(
        default_factory=list,
        description="per tenant, what its tenant-admin may claim with its queues (a tenant "
        "not listed: what its queues in this file claim, `broker.api.allotments.derive`)",
    )

    @model_validator(mode="after")
    def _check(self) -> QueuesConfig:
        for kind, names in (
            ("priorityClasses", [c.name for c in self.priority_classes]),
            ("cohorts", [c.name for c in self.cohorts]),
            ("queues", [q.name for q in self.queues]),
            ("allotments", [a.tenant for a in self.allotments]),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{kind}: declared more than once: {', '.join(twice)}")
        known = {c.name for c in self.priority_classes}
        default = self.policy.default_priority_class
        if default is not None and default not in known:
            raise ValueError(f"policy.defaultPriorityClass: no priority class {default!r}")
        for index, queue in enumerate(self.queues):
            if queue.priority_class is not None and queue.priority_class not in known:
                raise ValueError(
                    f"queues[{index}].priorityClass: no priority class {queue.priority_class!r}"
                )
        for index, allotment in enumerate(self.allotments):
            top = allotment.max_priority_class
            if top is not None and top not in known:
                raise ValueError(f"allotments[{index}].maxPriorityClass: no priority class {top!r}")
        return self

    def allotment(self, tenant: str) -> Allotment | None:
        """The allotment the file declares for `tenant`; None: none declared."""
        for item in self.allotments:
            if item.tenant == tenant:
                return item
        return None

    def queue(self, name: str) -> Queue | None:
        for queue in self.queues:
            if queue.name == name:
                return queue
        return None

    def priority_class(self, name: str | None) -> PriorityClass | None:
        for item in self.priority_classes:
            if item.name == name:
                return item
        return None

    def cohort(self, name: str) -> Cohort | None:
        for item in self.cohorts:
            if item.name == name:
                return item
        return None

    def with_queue(self, queue: Queue) -> QueuesConfig:
        """A copy with `queue` added or replaced (validated again)."""
        queues = [q for q in self.queues if q.name != queue.name] + [queue]
        data = self.model_dump(by_alias=True)
        data["queues"] = [q.model_dump(by_alias=True) for q in sorted(queues, key=_by_name)]
        return QueuesConfig.model_validate(data)

    def warnings(self, fleet_gpus: Mapping[str, int]) -> list[str]:
        """What can work but will disappoint: cohorts guaranteeing more GPUs than they hold."""
        out = []
        cohorts = sorted({q.cohort for q in self.queues})
        for name in cohorts:
            declared = self.cohort(name)
            guaranteed: dict[str, int] = {}
            for queue in self.queues:
                if queue.cohort != name:
                    continue
                for model, quota in queue.quotas.items():
                    if model != ANY_MODEL and quota.guaranteed:
                        guaranteed[model] = guaranteed.get(model, 0) + quota.guaranteed
            for model, total in sorted(guaranteed.items()):
                if declared is not None and model in declared.capacity:
                    capacity, what = declared.capacity[model], "its declared capacity of"
                else:
                    capacity, what = fleet_gpus.get(model, 0), "the fleet's"
                if total > capacity:
                    out.append(
                        f"cohort {name}: its queues are guaranteed {total} {model} GPUs, "
                        f"more than {what} {capacity}; reclaiming cannot honour every guarantee"
                    )
        return out


def _by_name(queue: Queue) -> str:
    return queue.name


class ReasonCode(StrEnum):
    """Why a job is not placed on a cluster (`GET /v1/jobs/{id}/why`)."""

    QUOTA = "Quota"
    BORROWING_LIMIT = "BorrowingLimit"
    NO_IDLE_QUOTA = "NoIdleQuota"
    FAIR_SHARE = "FairShare"
    PRIORITY = "Priority"
    GPU_MODEL = "GPUModel"
    TOPOLOGY = "Topology"
    CAPACITY = "Capacity"
    CLUSTER_UNHEALTHY = "ClusterUnhealthy"
    REJECTED = "Rejected"
    NO_CLUSTERS = "NoClusters"
    WAITING_FOR_RESERVATION = "WaitingForReservation"
    WAITING_FOR_PREEMPTION = "WaitingForPreemption"
    MIN_RUN_TIME = "MinRunTime"
    PREEMPTION_BUDGET = "PreemptionBudget"
    PLANNING_FAILED = "PlanningFailed"  # planning it raised: set aside, see the broker's log
    CLUSTER_SELECTOR = "ClusterSelector"  # excluded by the job's spec.clusters.selector
    DEPENDENCY = "Dependency"  # Waiting: a job of its spec.dependsOn is not done yet
    ARRAY_PARALLELISM = "ArrayParallelism"  # spec.array.parallelism of its array hold GPUs
    CLUSTER_BUSY = "ClusterBusy"  # its agent has --max-offers-in-flight offers unanswered


class WhyReason(_Model):
    cluster: str = Field(description="a cluster, or `fleet` for what holds on every cluster")
    code: ReasonCode
    message: str


class WhyCluster(_Model):
    cluster: str
    codes: list[ReasonCode]
    reasons: list[str] = Field(description="plain words, in the order of `codes`")


class QueuePosition(_Model):
    """A queued job's place in line, as the leader's scheduler holds the queued jobs."""

    in_queue: int = Field(
        alias="inQueue",
        description="1 = next in its queue: 1 + the queued jobs of its queue with a higher "
        "effective priority, or the same and submitted earlier (the planner's order within "
        "a queue)",
    )
    competing: int = Field(
        description="1 = next of every queue: 1 + the queued jobs of any queue that may use "
        "one of `models` and would go first as far as the order is known now: a higher "
        "priority; at equal priority, a queue with a lower dominant share (fair share), "
        "else an earlier submission. An estimate: the planner also takes jobs within their "
        "queue's guarantee first, and shares change as jobs are placed"
    )
    models: list[str] = Field(description="the fleet's GPU models the job may use")
    gpus_ahead: int = Field(
        alias="gpusAhead", description="the GPUs the competing jobs ahead of it ask for"
    )


class WhyAnswer(_Model):
    """The answer of `GET /v1/jobs/{id}/why`."""

    id: str
    state: str
    placed: bool
    queue: str
    priority: int | None = None
    clusters: list[WhyCluster] = Field(default_factory=list)
    reasons: list[WhyReason] = Field(default_factory=list)
    message: str
    position: QueuePosition | None = Field(
        None, description="a queued job's place in line (null: not queued, or not known here)"
    )
    eta: datetime | None = Field(
        None,
        description="when it may start: once the GPUs of its models free now, and those the "
        "running jobs on them free at their declared ends (the earlier of "
        "`spec.failurePolicy.activeDeadlineSeconds` from their first start and the "
        "`gpufed.io/sim-duration` of their pods), cover its GPUs and those of the competing "
        "jobs ahead of it; GPUs only (not quotas, topology or fragmentation). Null: see "
        "`etaReason`",
    )
    eta_reason: str | None = Field(
        None,
        alias="etaReason",
        description="why `eta` (or `position`) is null for a queued job, e.g. no running job "
        "on the GPU models it needs declares when it ends",
    )


class ModelUsage(_Model):
    model: str
    in_use: int = Field(
        alias="inUse",
        description="GPUs its Dispatched and Running jobs hold, as quotas count them: a "
        "sharing pod one GPU, a pod of MIG slices the whole GPUs they fill, at least one "
        "(seven 1g slices one, two 3g slices one)",
    )
    guaranteed: int
    limit: int | None = None
    fair_share: float = Field(alias="fairShare")


class QueueStatus(_Model):
    pending_jobs: int = Field(0, alias="pendingJobs")
    running_jobs: int = Field(0, alias="runningJobs")
    dominant_share: float = Field(0.0, alias="dominantShare")
    gpus: list[ModelUsage] = Field(default_factory=list)
    preemptions: int = 0


class QueueView(_Model):
    """One queue as `GET /v1/queues[/{name}]` shows it: its spec, usage and warnings."""

    name: str
    spec: QueueSpec
    declared: bool = Field(True, description="false: not in the configuration (open queue)")
    source: QueueSource | None = Field(
        None, description="file, api or file+api (a PUT over the file's entry); null: undeclared"
    )
    status: QueueStatus = Field(default_factory=QueueStatus)
    warnings: list[str] = Field(default_factory=list)


class AllotmentUse(_Model):
    """One GPU model (or `*`) of an allotment: what the tenant's queues claim of it together."""

    model: str
    guaranteed: int = Field(description="the guarantees of the tenant's queues, added")
    allotted_guaranteed: int = Field(alias="allottedGuaranteed")
    limit: int | None = Field(
        None, description="the limits of the tenant's queues, added (null: one has no limit)"
    )
    allotted_limit: int | None = Field(None, alias="allottedLimit", description="null: no bound")


class AllotmentView(_Model):
    """A tenant's allotment as `GET /v1/queues` shows it, with what its queues claim of it."""

    tenant: str
    declared: bool = Field(
        description="true: the fleet admin declared it; false: derived from the tenant's "
        "queues in the queues file"
    )
    allotment: Allotment
    uses: list[AllotmentUse] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class QueueList(_Model):
    mode: QueueMode = Field(
        QueueMode.OPEN, description="open: undeclared queues take jobs; declared: they do not"
    )
    items: list[QueueView]
    warnings: list[str] = Field(default_factory=list)
    allotments: list[AllotmentView] = Field(
        default_factory=list,
        description="the allotments the caller may read: a tenant's token its tenant's; the "
        "admin and a fleet viewer every tenant's with a queue or an allotment",
    )
