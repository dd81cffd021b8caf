"""The GPU inventory summary an agent reports: enough for the broker to pick a cluster.

Per GPU model: how many nodes have exactly k whole GPUs free (k = 0..8), the largest free
NVLink block, per-rack shapes, and CPU/memory headroom. The broker never sees node lists.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSummary(_Model):
    model: str
    gpu_memory_mib: int = 0
    gpus_per_node: int = 8
    nodes: int = 0
    total_gpus: int = 0
    free_gpus: int = 0
    unavailable_gpus: int = 0
    # nodes_by_free[k] = nodes with exactly k whole GPUs free (ready, schedulable nodes)
    nodes_by_free: list[int] = Field(default_factory=list)
    # free milli-GPU on partly used GPUs, for GPU-sharing pods
    shared_free_milli: int = 0
    largest_free_nvlink_block: int = 0
    # rack -> nodes_by_free histogram inside that rack
    racks: dict[str, list[int]] = Field(default_factory=dict)
    max_free_cpu_milli: int = 0
    max_free_memory_mib: int = 0


class ClusterSummary(_Model):
    cluster: str
    seq: int = 0
    models: list[ModelSummary] = Field(default_factory=list)
    fragmentation_milli: int = 0

    def model(self, name: str) -> ModelSummary | None:
        for item in self.models:
            if item.model == name:
                return item
        return None


class ModelTotals(_Model):
    model: str
    total: int
    free: int
    allocated: int
    unavailable: int


class ClusterView(_Model):
    """One line of `GET /v1/clusters`."""

    name: str
    health: str
    connected: bool
    epoch: int
    last_seen_seconds: float | None = None
    models: list[ModelTotals] = Field(default_factory=list)
    running_jobs: int = 0
