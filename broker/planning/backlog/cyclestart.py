"""A cycle's start as parking sees it: the `Start` (the clusters the cycle keeps, the fleet's
models, the ledger of what every queue holds, the lowest priority holding GPUs) and the
`Reference` a cycle leaves for the next one to find what changed (`parking.decide_wakes`).
`shape_of` is what of the fleet is not free capacity: when it changes, every parked job
wakes. Pure data over a snapshot; the rules that use it are `parking`'s and `parks`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import queues as queues_api
from broker.planning import containment, quotas, snapshot
from broker.planning.backlog import backlog


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
