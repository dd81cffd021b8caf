"""The ClusterBackend protocol: what the agent needs from the cluster it runs in.

Implementations: `simulated.SimulatedBackend` (YAML node pools, pods that run for a while) and
`kubernetes.KubernetesBackend` (kubernetes-asyncio). The agent core never knows which.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.api import status
from member_agent.inventory import model


@dataclass(frozen=True)
class PodRequest:
    """One pod to create, bound to a node and GPUs the placement chose."""

    namespace: str
    name: str
    job_id: str
    task: str
    queue: str
    node: str
    gpus: tuple[status.GPUSlot, ...]
    cpu_milli: int
    memory_mib: int
    template: dict[str, Any]  # the task's PodTemplateSpec, as the user wrote it
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PodEvent:
    """A pod of gpufed's changed phase (or disappeared: phase DELETED)."""

    job_id: str
    name: str
    phase: status.PodPhase
    node: str = ""
    reason: str = ""  # OOMKilled, Evicted, NodeLost, Error, ...


@dataclass(frozen=True)
class InventoryChanged:
    """Nodes or foreign pods changed: the summary should be sent again."""

    reason: str = ""


BackendEvent = PodEvent | InventoryChanged


class ClusterBackend(Protocol):
    async def start(self) -> None:
        """Load nodes and pods (list, then watch in the background)."""
        ...

    async def close(self) -> None: ...

    def inventory(self) -> model.Inventory:
        """The live inventory: every node, with GPUs taken by all pods (ours and foreign)
        and by pods this backend has created, even before a watch reports them."""
        ...

    async def create_pod(self, request: PodRequest) -> None:
        """Create one pod bound to `request.node`; raises BackendError on failure."""
        ...

    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: float) -> None:
        """Delete one pod; deleting a missing pod is not an error."""
        ...

    def pods_of(self, job_id: str) -> list[status.PodStatus]:
        """gpufed's pods of one job as the backend sees them now."""
        ...

    def events(self) -> AsyncIterator[BackendEvent]:
        """Pod phase changes of gpufed's pods and inventory changes, in order."""
        ...
