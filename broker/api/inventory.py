"""The GPU inventory summary an agent reports: enough for the broker to pick a cluster.

Per GPU model: how many nodes have exactly k whole GPUs free (k = 0..8), the largest free
NVLink block, per-rack shapes, and CPU/memory headroom; MIG devices per profile (`mig`,
protocol 7: how many nodes have exactly k free). The broker never sees node lists.

A summary is checked whole when it is decoded (the broker takes it from an agent it does not
trust to be bug-free): counts are non-negative and bounded, the histograms agree with the
totals and with each other (a rack's histogram is padded with zeros to the model's length,
never longer), model names are unique. What fails never reaches the planner.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.api import affinity

MAX_NAME = 253
MAX_COUNT = 10**9  # nodes, GPUs: far above any fleet
MAX_GPUS_PER_NODE = 1024
MAX_MILLI = 10**15
MAX_LABELS = 64
MAX_MIG_PER_NODE = 1024  # MIG devices of one profile on one node
MAX_MIG_PROFILES = 64
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Milli = Annotated[int, Field(ge=0, le=MAX_MILLI)]
Name = Annotated[str, Field(max_length=MAX_NAME)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MIGSummary(_Model):
    """The MIG devices of one profile on a model's nodes: nodes_by_free[k] = ready,
    schedulable nodes with exactly k of them free (k = 0 .. the most on one node)."""

    total: Count = 0
    free: Count = 0
    nodes_by_free: list[Count] = Field(default_factory=list, max_length=MAX_MIG_PER_NODE + 1)

    @model_validator(mode="after")
    def _consistent(self) -> MIGSummary:
        if self.free > self.total:
            raise ValueError("free: more free MIG devices than total")
        if sum(k * n for k, n in enumerate(self.nodes_by_free)) > self.free:
            raise ValueError("nodes_by_free: more free MIG devices than free")
        return self


class ModelSummary(_Model):
    model: Name
    gpu_memory_mib: Milli = 0
    gpus_per_node: Annotated[int, Field(ge=0, le=MAX_GPUS_PER_NODE)] = 8
    nodes: Count = 0
    total_gpus: Count = 0
    free_gpus: Count = 0
    unavailable_gpus: Count = 0
    # nodes_by_free[k] = nodes with exactly k whole GPUs free (ready, schedulable nodes)
    nodes_by_free: list[Count] = Field(default_factory=list, max_length=MAX_GPUS_PER_NODE + 1)
    # free milli-GPU on partly used GPUs, for GPU-sharing pods
    shared_free_milli: Milli = 0
    largest_free_nvlink_block: Count = 0
    # rack -> nodes_by_free histogram inside that rack
    racks: dict[Name, list[Count]] = Field(default_factory=dict, max_length=100_000)
    max_free_cpu_milli: Milli = 0
    max_free_memory_mib: Milli = 0
    # MIG devices by profile (protocol 7, only to a broker that reads it: None is left out of
    # the frame); absent: none, or an older agent
    mig: dict[Name, MIGSummary] | None = Field(None, max_length=MAX_MIG_PROFILES)

    @model_validator(mode="after")
    def _consistent(self) -> ModelSummary:
        width = len(self.nodes_by_free)
        if any(self.nodes_by_free[self.gpus_per_node + 1 :]):
            raise ValueError(
                f"nodes_by_free: nodes with more free GPUs than {self.gpus_per_node} per node"
            )
        if sum(self.nodes_by_free) > self.nodes:
            raise ValueError(
                f"nodes_by_free: counts {sum(self.nodes_by_free)} of {self.nodes} nodes"
            )
        whole = sum(k * n for k, n in enumerate(self.nodes_by_free))
        if whole > self.free_gpus:
            raise ValueError(f"nodes_by_free: {whole} free GPUs, more than free_gpus")
        if self.free_gpus + self.unavailable_gpus > self.total_gpus:
            raise ValueError("free_gpus: free and unavailable GPUs exceed total_gpus")
        if self.total_gpus > self.nodes * self.gpus_per_node:
            raise ValueError("total_gpus: more than nodes x gpus_per_node")
        if self.shared_free_milli > self.total_gpus * 1000:
            raise ValueError("shared_free_milli: more than every GPU holds")
        if self.largest_free_nvlink_block > self.free_gpus:
            raise ValueError("largest_free_nvlink_block: more than the free GPUs")
        for rack, histogram in self.racks.items():
            if len(histogram) > width:
                raise ValueError(f"racks.{rack}: longer than nodes_by_free")
            if any(n > self.nodes_by_free[k] for k, n in enumerate(histogram)):
                raise ValueError(f"racks.{rack}: more nodes than nodes_by_free")
            if len(histogram) < width:
                histogram.extend([0] * (width - len(histogram)))
        for profile, slices in (self.mig or {}).items():
            if sum(slices.nodes_by_free) > self.nodes:
                raise ValueError(f"mig.{profile}.nodes_by_free: more nodes than the model has")
        return self


class GPUHealth(_Model):
    """What the agent says of its GPUs' health (protocol 6): GPUs out of service (unhealthy,
    counted among the models' unavailable GPUs too) and the nodes it cordoned for repeated
    GPU failures."""

    unhealthy_gpus: Count = 0
    cordoned_nodes: list[Name] = Field(default_factory=list, max_length=10_000)


class ClusterSummary(_Model):
    cluster: Name
    seq: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    models: list[ModelSummary] = Field(default_factory=list, max_length=1000)
    fragmentation_milli: Milli = 0
    # the cluster's labels (`gpufed agent --cluster-label`, protocol 5): what a job's
    # spec.clusters selects on; absent (an older agent): no labels
    labels: dict[Name, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=MAX_LABELS
    )
    # protocol 6, only to a broker that reads it (None is left out of the frame): absent, an
    # older agent, which says nothing of GPU health but its unavailable GPUs
    gpu_health: GPUHealth | None = None

    @model_validator(mode="after")
    def _unique_models(self) -> ClusterSummary:
        names = [m.model for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("models: a GPU model is listed twice")
        return self

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        found = affinity.labels_problem(value)
        if found is not None:
            raise ValueError(f"labels: {found[2]}")
        return value

    def model(self, name: str) -> ModelSummary | None:
        for item in self.models:
            if item.model == name:
                return item
        return None


class MIGTotals(_Model):
    """The MIG devices of one profile on a model's nodes, as `GET /v1/clusters` shows them."""

    profile: str = Field(description="the MIG profile, such as 1g.10gb")
    total: int = Field(description="MIG devices of this profile on the model's nodes")
    free: int = Field(description="of them, free on ready, schedulable nodes")


class ModelTotals(_Model):
    model: str
    total: int
    free: int
    allocated: int
    unavailable: int
    mig: list[MIGTotals] = Field(
        default_factory=list,
        description="MIG devices per profile, by profile name (empty: none, or an agent "
        "before protocol 7)",
    )


class ClusterView(_Model):
    """One line of `GET /v1/clusters`."""

    name: str
    health: str
    connected: bool
    epoch: int
    last_seen_seconds: float | None = None
    models: list[ModelTotals] = Field(default_factory=list)
    running_jobs: int = 0
    reason: str | None = Field(None, description="why the cluster is Degraded")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="the cluster's labels, as its agent reports them: what spec.clusters "
        "selects on",
    )
    unhealthy_gpus: int = Field(
        0, description="GPUs the agent keeps out of service as unhealthy (among unavailable)"
    )
    cordoned_nodes: list[str] = Field(
        default_factory=list,
        description="nodes the agent cordoned after repeated GPU failures (--auto-cordon)",
    )
    scored_down_until: datetime | None = Field(
        None,
        description="until when other clusters are preferred to it: it failed to start jobs "
        "it accepted (absent: it is not scored down)",
    )
    scored_down_reason: str | None = Field(None, description="why it is scored down")
