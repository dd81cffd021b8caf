"""What the planner sees of the fleet: each cluster's free capacity, from its agent's summary.

Built by the scheduling shell from the live sessions, then changed only by `assume` inside one
planning cycle (a scratch copy), so decisions later in the cycle see earlier ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from broker.api import inventory, jobs


@dataclass
class ModelCapacity:
    model: str
    gpu_memory_mib: int
    nodes_by_free: list[int]
    shared_free_milli: int
    largest_free_nvlink_block: int
    racks: dict[str, list[int]]

    @classmethod
    def from_summary(cls, summary: inventory.ModelSummary) -> ModelCapacity:
        return cls(
            model=summary.model,
            gpu_memory_mib=summary.gpu_memory_mib,
            nodes_by_free=list(summary.nodes_by_free),
            shared_free_milli=summary.shared_free_milli,
            largest_free_nvlink_block=summary.largest_free_nvlink_block,
            racks={rack: list(hist) for rack, hist in summary.racks.items()},
        )

    @property
    def free_gpus(self) -> int:
        return sum(k * n for k, n in enumerate(self.nodes_by_free))


@dataclass
class ClusterCapacity:
    name: str
    healthy: bool
    models: dict[str, ModelCapacity] = field(default_factory=dict)
    summary_seq: int = 0

    @classmethod
    def from_summary(cls, summary: inventory.ClusterSummary, *, healthy: bool) -> ClusterCapacity:
        return cls(
            name=summary.cluster,
            healthy=healthy,
            models={m.model: ModelCapacity.from_summary(m) for m in summary.models},
            summary_seq=summary.seq,
        )


@dataclass(frozen=True)
class PendingJob:
    """A queued job as the planner sees it."""

    job_id: str
    queue: str
    priority: int
    created: datetime
    request: jobs.GangRequest
    excluded: frozenset[str] = frozenset()  # clusters that rejected it and have not refreshed


@dataclass
class FleetSnapshot:
    clusters: dict[str, ClusterCapacity]

    @classmethod
    def build(cls, clusters: Sequence[ClusterCapacity]) -> FleetSnapshot:
        return cls(clusters={c.name: c for c in clusters})
