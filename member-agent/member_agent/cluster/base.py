"""The ClusterBackend protocol: what the agent needs from the cluster it runs in.

Implementations: `simulated.backend.SimulatedBackend` (YAML node pools, pods that run for a
while) and `kubernetes.backend.KubernetesBackend` (kubernetes-asyncio). The agent core never
knows which.

Every pod gpufed creates carries, besides its labels, the annotations a restarted agent needs
to rebuild the job from its pods (`held_job` reads them back): the epoch of the offer that
created it, the job's attempt, the gang's `minMember` and its size, and its `clusterLost`
policy (whether a fence stops it). `held_jobs()` lists what a backend found.

Preemption: the agent writes `gpufed.io/preemption-notice` (the deadline, RFC 3339) on the
pods (`annotate_pod`) before it deletes them with the grace period; a workload may keep
`gpufed.io/last-checkpoint` current on its pods, which a backend reports in its pod events
(`PodEvent.checkpoint`) whenever it changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from broker.api import status
from member_agent.cluster import gpuhealth
from member_agent.inventory import model

EPOCH_ANNOTATION = "gpufed.io/epoch"
ATTEMPT_ANNOTATION = "gpufed.io/attempt"
MIN_MEMBER_ANNOTATION = "gpufed.io/min-member"
GANG_SIZE_ANNOTATION = "gpufed.io/gang-size"
CLUSTER_LOST_ANNOTATION = "gpufed.io/cluster-lost"  # the job's failurePolicy.clusterLost
TRACEPARENT_ANNOTATION = "traceparent"
# written by the agent before a preemption deletes the pod: the deadline (RFC 3339)
PREEMPTION_NOTICE_ANNOTATION = "gpufed.io/preemption-notice"
# kept current by a workload that checkpoints: when it last did (RFC 3339)
LAST_CHECKPOINT_ANNOTATION = "gpufed.io/last-checkpoint"


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
    # a MIG pod's devices: profile -> MIG device indices on the node (`model.Node.mig`)
    mig: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PodEvent:
    """A pod of gpufed's changed phase (or disappeared: phase DELETED)."""

    job_id: str
    name: str
    phase: status.PodPhase
    node: str = ""
    reason: str = ""  # OOMKilled, Evicted, NodeLost, Error, ...
    checkpoint: str = ""  # its `gpufed.io/last-checkpoint` annotation, as written


@dataclass(frozen=True)
class InventoryChanged:
    """Nodes or foreign pods changed: the summary should be sent again."""

    reason: str = ""


BackendEvent = PodEvent | InventoryChanged


@dataclass(frozen=True)
class HeldJob:
    """A job whose pods a backend found in the cluster (at start: the agent adopts it)."""

    job_id: str
    namespace: str
    epoch: int  # of the offer that created the pods (0: not recorded)
    min_member: int
    gang_size: int  # pods the gang was created with (0: not recorded)
    gpus: int  # GPUs its pods request (a shared-GPU pod counts one)
    pods: tuple[status.PodStatus, ...]
    traceparent: str | None = None
    attempt: int = 1  # of the pod whose annotations were read (1: not recorded)
    cluster_lost: str = "requeue"  # spec.failurePolicy.clusterLost (requeue: not recorded)
    queue: str = ""  # the job's queue, from its pods' `gpufed.io/queue` label ("": none)


def rfc3339(at: datetime) -> str:
    """A time as the annotations hold it: RFC 3339 in UTC, to the millisecond (`...Z`)."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def read_time(text: str) -> datetime | None:
    """An annotation's RFC 3339 time (a workload's: `Z` or an offset; no zone: UTC); None if
    it is not one."""
    try:
        at = datetime.fromisoformat(text.strip().replace("z", "Z"))
    except ValueError:
        return None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _whole(value: str | None) -> int:
    return int(value) if value is not None and value.strip().isdigit() else 0


def held_job(
    job_id: str,
    namespace: str,
    annotations: Mapping[str, str],
    pods: Iterable[status.PodStatus],
    *,
    gpus: int,
    queue: str = "",
) -> HeldJob:
    """A HeldJob from one of its pods' annotations and all its pods. Pods of an agent that
    wrote no such annotations: every pod found is needed, the epoch and size are unknown."""
    found = tuple(sorted(pods, key=lambda pod: pod.name))
    min_member = _whole(annotations.get(MIN_MEMBER_ANNOTATION)) or len(found)
    return HeldJob(
        job_id=job_id,
        namespace=namespace,
        epoch=_whole(annotations.get(EPOCH_ANNOTATION)),
        min_member=min_member,
        gang_size=_whole(annotations.get(GANG_SIZE_ANNOTATION)),
        gpus=gpus,
        pods=found,
        traceparent=annotations.get(TRACEPARENT_ANNOTATION) or None,
        attempt=_whole(annotations.get(ATTEMPT_ANNOTATION)) or 1,
        cluster_lost=annotations.get(CLUSTER_LOST_ANNOTATION) or "requeue",
        queue=queue,
    )


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
        """Delete one pod; deleting a missing pod is not an error. Its GPUs stay taken until
        it is gone: through its grace period, unless it exits sooner (then a DELETED event)."""
        ...

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Add (or overwrite) annotations of one pod; a missing pod is not an error."""
        ...

    def pods_of(self, job_id: str) -> list[status.PodStatus]:
        """gpufed's pods of one job as the backend sees them now."""
        ...

    def events(self) -> AsyncIterator[BackendEvent]:
        """Pod phase changes of gpufed's pods and inventory changes, in order."""
        ...

    def held_jobs(self) -> dict[str, HeldJob]:
        """gpufed's jobs whose pods are in the cluster now, by job id (after `start`: the
        jobs a restarted agent finds)."""
        ...

    def gpu_quotas(self, namespace: str) -> list[model.GPUQuota]:
        """The GPU quotas of a namespace the cluster enforces, with their use now."""
        ...

    def gpu_health(self) -> gpuhealth.HealthBook:
        """Unhealthy GPUs, GPU failures, gangs failed and nodes cordoned for them (what
        `/metrics` shows)."""
        ...
