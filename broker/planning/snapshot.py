"""What the planner sees: each cluster's free capacity (from its agent's summary), the queued
jobs, the jobs holding GPUs, and the preemption victims still releasing theirs.

Built by the scheduling shell (`jobs.scheduling`) from the fleet and the job book, then
changed only by `assume` inside one planning cycle, so decisions later in the cycle see
earlier ones. Copy on write: a cluster's capacity is never changed in place once it is in a
snapshot; the cycle deducts a placement on a copy of it and puts the copy in its own snapshot
(`FleetSnapshot.copy` shares the clusters), so the shell keeps one capacity per cluster from
cycle to cycle and rebuilds only what a summary or an offer changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from broker.api import clusterchoice, gangs, inventory


@dataclass
class ModelCapacity:
    model: str
    gpu_memory_mib: int
    nodes_by_free: list[int]
    shared_free_milli: int
    largest_free_nvlink_block: int
    racks: dict[str, list[int]]
    gpus_per_node: int = 8
    total_gpus: int = 0
    # MIG devices per profile: nodes_by_free[k] = nodes with exactly k of them free
    mig: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_summary(cls, summary: inventory.ModelSummary) -> ModelCapacity:
        return cls(
            model=summary.model,
            gpu_memory_mib=summary.gpu_memory_mib,
            nodes_by_free=list(summary.nodes_by_free),
            shared_free_milli=summary.shared_free_milli,
            largest_free_nvlink_block=summary.largest_free_nvlink_block,
            racks={rack: list(hist) for rack, hist in summary.racks.items()},
            gpus_per_node=summary.gpus_per_node,
            total_gpus=total_gpus_of(summary),
            mig={p: list(m.nodes_by_free) for p, m in (summary.mig or {}).items()},
        )

    def copy(self) -> ModelCapacity:
        return dataclasses.replace(
            self,
            nodes_by_free=list(self.nodes_by_free),
            racks={rack: list(hist) for rack, hist in self.racks.items()},
            mig={profile: list(hist) for profile, hist in self.mig.items()},
        )

    @property
    def free_gpus(self) -> int:
        return sum(k * n for k, n in enumerate(self.nodes_by_free))


def total_gpus_of(summary: inventory.ModelSummary) -> int:
    """A model's GPUs in a summary, free or not (0 in the summary: its nodes' GPUs)."""
    return summary.total_gpus or sum(summary.nodes_by_free) * summary.gpus_per_node


@dataclass
class ClusterCapacity:
    name: str
    healthy: bool
    models: dict[str, ModelCapacity] = field(default_factory=dict)
    summary_seq: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)  # what spec.clusters selects on
    # offers it may still be sent before its agent answers the ones out (None: any number)
    offer_slots: int | None = None
    # it failed to start jobs it accepted (`standing`): ranked after the clusters that did not
    scored_down: bool = False
    # what every cycle reads off it, kept until its histograms change (`changed`): under
    # copy on write, a cluster the shell keeps from cycle to cycle is read once, not each cycle
    _free: int | None = field(default=None, init=False, repr=False, compare=False)
    _buckets: int | None = field(default=None, init=False, repr=False, compare=False)
    checked: tuple[str | None] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_summary(cls, summary: inventory.ClusterSummary, *, healthy: bool) -> ClusterCapacity:
        return cls(
            name=summary.cluster,
            healthy=healthy,
            models={m.model: ModelCapacity.from_summary(m) for m in summary.models},
            summary_seq=summary.seq,
            labels=summary.labels,
        )

    @property
    def free_gpus(self) -> int:
        if self._free is None:
            self._free = sum(m.free_gpus for m in self.models.values())
        return self._free

    @property
    def free_buckets(self) -> int:
        """Which numbers of free GPUs its nodes have, of any model: bit k is set when some
        node has exactly k free."""
        if self._buckets is None:
            buckets = 0
            for model in self.models.values():
                for free, nodes in enumerate(model.nodes_by_free):
                    if nodes > 0:
                        buckets |= 1 << free
            self._buckets = buckets
        return self._buckets

    def changed(self) -> None:
        """Its histograms were changed in place (a scratch copy's deduction or give-back):
        what was read off them is read again."""
        self._free = self._buckets = None
        self.checked = None

    def reshaped(self, *, offer_slots: int | None, scored_down: bool) -> ClusterCapacity:
        """The same capacity (its models shared, not copied) with other offer slots and
        standing: for a copy-on-write holder, whose capacity is never changed in place."""
        out = dataclasses.replace(self, offer_slots=offer_slots, scored_down=scored_down)
        out._free, out._buckets, out.checked = self._free, self._buckets, self.checked
        return out

    def copy(self) -> ClusterCapacity:
        return ClusterCapacity(
            name=self.name,
            healthy=self.healthy,
            models={name: m.copy() for name, m in self.models.items()},
            summary_seq=self.summary_seq,
            labels=self.labels,  # never changed in a cycle: shared
            offer_slots=self.offer_slots,
            scored_down=self.scored_down,
        )


@dataclass(frozen=True)
class ArrayLimit:
    """The array a queued job is one index of, and how many of its jobs may hold GPUs."""

    array_id: str
    parallelism: int


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A queued job as the planner sees it (slotted: the scheduler keeps one per queued job)."""

    job_id: str
    queue: str
    priority: int
    created: datetime
    request: gangs.GangRequest
    excluded: frozenset[str] = frozenset()  # clusters that rejected it and have not refreshed
    priority_class: str | None = None
    queued_since: datetime | None = None  # last time it (re)entered the queue; None: created
    clusters: clusterchoice.Choice | None = None  # its spec.clusters; None: any cluster
    array: ArrayLimit | None = None  # its spec.array's bound; None: a job of no array

    @property
    def waiting_since(self) -> datetime:
        return self.queued_since or self.created


@dataclass(frozen=True)
class PodSlot:
    """A pod of a running job: its node and the whole GPUs it holds there."""

    node: str
    gpus: int


@dataclass(frozen=True)
class RunningJob:
    """A job holding GPUs (Dispatched or Running) as the planner sees it."""

    job_id: str
    queue: str
    priority: int
    cluster: str
    gpus: dict[str, int]  # GPU model -> GPUs held (a sharing pod counts one GPU)
    pods: tuple[PodSlot, ...] = ()
    started: datetime | None = None  # when it last started running; None: not running yet
    created: datetime | None = None
    priority_class: str | None = None
    preempting: bool = False  # a preemption was sent: not a victim again
    checkpointed: datetime | None = None  # its workload's last checkpoint, if it keeps one

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())


@dataclass(frozen=True)
class Releasing:
    """A preemption victim whose GPUs the preemptor waits for.

    `released` turns true once the victim's agent confirmed its pods gone and then sent a
    fresh summary: the freed GPUs are in the snapshot and the preemptor goes first.
    """

    victim: str
    preemptor: str
    cluster: str
    released: bool = False
    queue: str = ""  # the victim's queue
    gpus: dict[str, int] = field(default_factory=dict)  # GPUs it still holds (not yet stopped)


@dataclass
class FleetSnapshot:
    clusters: dict[str, ClusterCapacity]

    @classmethod
    def build(cls, clusters: Sequence[ClusterCapacity]) -> FleetSnapshot:
        return cls(clusters={c.name: c for c in clusters})

    def copy(self) -> FleetSnapshot:
        """A snapshot whose clusters may be replaced without changing this one. The clusters
        themselves are shared: a cycle never changes one in place, it replaces it with a
        changed copy (`ClusterCapacity.copy`), so copying is O(clusters), not O(racks)."""
        return FleetSnapshot(clusters=dict(self.clusters))

    def total_gpus(self) -> dict[str, int]:
        """GPUs per model over every cluster of the snapshot (free or not)."""
        out: dict[str, int] = {}
        for cluster in self.clusters.values():
            for name, model in cluster.models.items():
                out[name] = out.get(name, 0) + model.total_gpus
        return out
