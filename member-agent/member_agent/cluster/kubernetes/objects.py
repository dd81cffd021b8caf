"""Kubernetes Nodes and Pods as gpufed reads them, and the Pod it writes. Pure functions on the
JSON dicts the API server sends (no client models: a 5,000-node list parses in milliseconds).

Node labels read (keys configurable through `LabelKeys`, defaults below):

| what | default key | set by |
|---|---|---|
| GPU model | `nvidia.com/gpu.product` | GPU Feature Discovery (GFD) |
| GPU memory (MiB) | `nvidia.com/gpu.memory` | GFD |
| physical GPUs | `nvidia.com/gpu.count` | GFD (kept in the labels; `allocatable` counts) |
| NVLink domain | `nvidia.com/gpu.clique` | GFD, on multi-node NVLink systems (GB200 NVL72) |
| rack | `gpufed.io/rack` | the platform team (no standard label exists) |
| NVLink island size | `gpufed.io/nvlink-island` | the platform team (8 on an HGX board) |
| shared replicas per GPU | `nvidia.com/gpu.replicas` | GFD, with time-slicing or MPS sharing |

GPUs are `status.allocatable["nvidia.com/gpu"]`; MIG devices are every `nvidia.com/mig-<profile>`
in `allocatable` (`mig`: names read, not hard-coded), the inventory Node's `mig`;
`mig_slices(node)` reads them back. Nodes without GPUs are in the inventory too, with
`gpu_count` 0 and model "" (CPU-only tasks of a gang can go there).

Shared GPUs with the device plugin (`read_node(..., device_plugin=True)`, the default): a node
whose allocatable has the shared resource (`LabelKeys.shared_gpu_resource`, default
`nvidia.com/gpu.shared`: time-slicing or MPS replicas with `renameByDefault`) and no
`nvidia.com/gpu` has its physical GPUs (`nvidia.com/gpu.count`, else shared replicas / replicas
per GPU) marked `model.SHARING_REPLICAS`: sharing pods only, each requesting one replica of that
resource (`build_pod`). A node whose `nvidia.com/gpu` are themselves replicas (replicas per GPU
above 1 and no renamed resource) is marked the same, its sharing pods requesting one
`nvidia.com/gpu`. Any other GPU node is `model.SHARING_NONE`: whole GPUs only, since a pod asking
part of a GPU there would be handed a whole one. A foreign pod holding shared replicas holds a
replica's share (1000 / replicas milli) of a GPU for each. In DRA mode (`devices`) the
GPUs come from ResourceSlices instead and claims share them, so none of this applies.

A node is available when its Ready condition is True, `spec.unschedulable` is false and it has
no NoSchedule/NoExecute taint outside `LabelKeys.tolerated_taints` (default `nvidia.com/gpu`,
the taint many providers put on every GPU node). Per-pod tolerations are not evaluated: a taint
either keeps gpufed off the node or is tolerated for all gpufed pods, which then carry a
matching toleration (pods are bound with `spec.nodeName`, see `backend.py`, so no scheduler
checks taints for them).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.api import jobs, status
from member_agent.cluster import base
from member_agent.cluster.kubernetes import mig as migs
from member_agent.inventory import model

logger = logging.getLogger(__name__)

JOB_LABEL = "gpufed.io/job"
GANG_LABEL = "gpufed.io/gang"
QUEUE_LABEL = "gpufed.io/queue"
TASK_LABEL = "gpufed.io/task"
GPUS_ANNOTATION = "gpufed.io/gpus"
CLAIM_ANNOTATION = "gpufed.io/claim"  # DRA mode: the ResourceClaim of a pod's GPUs
SHARING_ANNOTATION = "gpufed.io/gpu-sharing"  # timeslice (default) or mps
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"  # the device plugin's renamed shared replicas
TRACEPARENT_ANNOTATION = "traceparent"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
NODE_LOST = "NodeLost"
_JOB_META = (
    base.EPOCH_ANNOTATION,
    base.MIN_MEMBER_ANNOTATION,
    base.GANG_SIZE_ANNOTATION,
    base.TRACEPARENT_ANNOTATION,
    base.ATTEMPT_ANNOTATION,
    base.CLUSTER_LOST_ANNOTATION,
)
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]")
# reasons a pod is being torn down, from its DisruptionTarget condition
_DISRUPTIONS = {"DeletionByTaintManager": NODE_LOST}
_PHASES = {
    "Pending": status.PodPhase.PENDING,
    "Running": status.PodPhase.RUNNING,
    "Succeeded": status.PodPhase.SUCCEEDED,
    "Failed": status.PodPhase.FAILED,
}


@dataclass(frozen=True)
class LabelKeys:
    """Which node labels mean what. Defaults: see the module docstring."""

    gpu_product: str = jobs.GPU_PRODUCT_LABEL
    gpu_memory: str = "nvidia.com/gpu.memory"
    gpu_count: str = "nvidia.com/gpu.count"
    rack: str = "gpufed.io/rack"
    nvlink_domain: str = "nvidia.com/gpu.clique"
    nvlink_island: str = "gpufed.io/nvlink-island"
    tolerated_taints: tuple[str, ...] = (jobs.GPU_RESOURCE,)
    gpu_replicas: str = "nvidia.com/gpu.replicas"
    shared_gpu_resource: str = SHARED_GPU_RESOURCE  # an allocatable resource, not a label

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LabelKeys:
        """From the camelCase `labelKeys` section of the agent's config (Helm values)."""
        names = {
            "gpuProduct": "gpu_product",
            "gpuMemory": "gpu_memory",
            "gpuCount": "gpu_count",
            "rack": "rack",
            "nvlinkDomain": "nvlink_domain",
            "nvlinkIsland": "nvlink_island",
            "toleratedTaints": "tolerated_taints",
            "gpuReplicas": "gpu_replicas",
            "sharedGpuResource": "shared_gpu_resource",
        }
        unknown = sorted(set(values) - set(names) - set(names.values()))
        if unknown:
            raise ValueError(f"labelKeys: unknown keys {unknown}; known: {sorted(names)}")
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            attr = names.get(key, key)
            kwargs[attr] = tuple(value) if attr == "tolerated_taints" else str(value)
        return cls(**kwargs)


@dataclass(frozen=True)
class PodRecord:
    """What gpufed keeps of one pod: where it is, what it holds, and (for its own) its phase."""

    namespace: str
    name: str
    node: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    holds: bool  # bound to a node and not terminal: its requests are in use
    job_id: str = ""  # "" for pods gpufed did not create
    task: str = ""
    phase: status.PodPhase = status.PodPhase.PENDING
    reason: str = ""
    slots: tuple[status.GPUSlot, ...] = ()  # the GPUs placement chose (gpufed's pods)
    mig: dict[str, int] = field(default_factory=dict)  # MIG devices requested, by profile
    # the MIG devices placement chose (gpufed's pods: `gpufed.io/mig`), by profile
    mig_slots: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # gpufed's pods: the annotations a restarted agent rebuilds the job from (`base.held_job`)
    job_meta: dict[str, str] = field(default_factory=dict)
    quota_gpus: int = 0  # `nvidia.com/gpu` requested: what a ResourceQuota on it counts
    shared: bool = False  # requests the device plugin's shared replicas (`gpus` of them)
    claim: str = ""  # gpufed's pods in DRA mode: the ResourceClaim holding its GPUs
    sharing: str = ""  # gpufed's sharing pods: `gpufed.io/gpu-sharing` (timeslice, mps)
    checkpoint: str = ""  # gpufed's pods: `gpufed.io/last-checkpoint`, as the workload wrote it
    queue: str = ""  # gpufed's pods: their `gpufed.io/queue` label

    @property
    def ours(self) -> bool:
        return bool(self.job_id)

    @property
    def key(self) -> str:
        """The inventory key: the pod name for gpufed's pods (unique, as placement names them),
        namespace/name for the others."""
        return self.name if self.ours else f"{self.namespace}/{self.name}"


def parse_count(value: Any) -> int:
    """A Kubernetes integer quantity ("8", 8); anything else is 0."""
    try:
        return int(str(value).strip())
    except ValueError:
        return 0


@functools.lru_cache(maxsize=4096)  # a cluster uses few distinct quantities ("1", "8Gi")
def _parse_quantity(value: str | int | float, kind: str) -> int:
    parse = jobs.parse_cpu_milli if kind == "cpu" else jobs.parse_memory_mib
    return int(parse(value))


def _quantity(value: Any, kind: str, where: str) -> int:
    try:
        return _parse_quantity(value, kind)
    except (ValueError, TypeError):
        logger.warning("%s: cannot read %s quantity %r", where, kind, value)
        return 0


def read_node(
    raw: Mapping[str, Any], keys: LabelKeys, *, device_plugin: bool = True
) -> model.Node | None:
    """The inventory Node of a Kubernetes Node (None for an object without a name); its GPUs
    as the device plugin advertises them (`device_plugin`), or none (DRA: from slices)."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    state = raw.get("status") or {}
    name = str(meta.get("name", ""))
    labels = dict(meta.get("labels") or {})
    allocatable = state.get("allocatable") or {}
    gpus = parse_count(allocatable.get(jobs.GPU_RESOURCE, 0))
    if not name:
        return None
    gpus = _read_sharing(allocatable, labels, keys, whole=gpus) if device_plugin else 0
    mig = migs.read_allocatable(allocatable) if device_plugin else {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in state.get("conditions") or []
    )
    blocking = [
        t
        for t in spec.get("taints") or []
        if t.get("effect") in ("NoSchedule", "NoExecute")
        and t.get("key") not in keys.tolerated_taints
    ]
    return model.Node(
        name=name,
        model=labels.get(keys.gpu_product, ""),
        gpu_count=max(gpus, 0),
        gpu_memory_mib=parse_count(labels.get(keys.gpu_memory, 0)),
        cpu_milli=_quantity(allocatable.get("cpu", 0), "cpu", name),
        memory_mib=_quantity(allocatable.get("memory", 0), "memory", name),
        rack=labels.get(keys.rack, ""),
        nvlink_domain=labels.get(keys.nvlink_domain, ""),
        nvlink_island=parse_count(labels.get(keys.nvlink_island, 0)),
        ready=ready,
        schedulable=not spec.get("unschedulable", False) and not blocking,
        labels=labels,
        mig=mig,
    )


def _read_sharing(
    allocatable: Mapping[str, Any], labels: dict[str, str], keys: LabelKeys, *, whole: int
) -> int:
    """How the device plugin hands out the node's GPUs (see the module docstring): marks the
    labels, returns the node's GPU count."""
    shared = parse_count(allocatable.get(keys.shared_gpu_resource, 0))
    replicas = parse_count(labels.get(keys.gpu_replicas, 0))
    physical = parse_count(labels.get(keys.gpu_count, 0))
    if shared > 0 and whole <= 0:
        resource, gpus = keys.shared_gpu_resource, physical or shared // max(replicas, 1)
    elif whole > 0 and replicas > 1 and shared <= 0:  # nvidia.com/gpu are replicas themselves
        resource, gpus = jobs.GPU_RESOURCE, physical or whole // replicas
    else:
        if whole > 0:
            labels[model.SHARING_LABEL] = model.SHARING_NONE
            labels[model.SHARED_RESOURCE_LABEL] = keys.shared_gpu_resource
        return whole
    labels[model.SHARING_LABEL] = model.SHARING_REPLICAS
    labels[model.SHARED_RESOURCE_LABEL] = resource
    return gpus


def replica_milli(node: model.Node, keys: LabelKeys) -> int:
    """The share of a GPU one device-plugin replica is on this node (1000: not shared)."""
    replicas = parse_count(node.labels.get(keys.gpu_replicas, 0))
    return model.GPU_MILLI // replicas if replicas > 1 else model.GPU_MILLI


def replica_slots(free: list[int], milli: int, count: int) -> list[status.GPUSlot]:
    """`count` device-plugin replicas of `milli` each, each on the freest GPU left (which GPU
    the kubelet chose is not known, only that each replica is a share of one)."""
    left = list(free)
    taken: dict[int, int] = {}
    for _ in range(count):
        best = max(range(len(left)), key=lambda i: (left[i], -i), default=None)
        if best is None or left[best] < milli:
            break
        left[best] -= milli
        taken[best] = taken.get(best, 0) + milli
    return [status.GPUSlot.model_construct(index=i, milli=m) for i, m in sorted(taken.items())]


def fresh_copy(node: model.Node) -> model.Node:
    """A copy of a parsed node with everything free (for rebuilding it in the inventory)."""
    return dataclasses.replace(
        node,
        labels=dict(node.labels),
        gpu_free=[],
        cpu_free=-1,
        memory_free=-1,
        mig=dict(node.mig),
        mig_free={},
    )


def mig_slices(node: model.Node, *, free: bool = True) -> dict[str, int]:
    """MIG devices of a node by profile (e.g. "1g.10gb"): free ones, or all allocatable."""
    if not free:
        return dict(node.mig)
    return {profile: len(node.mig_free.get(profile, ())) for profile in node.mig}


def _requests_of(spec: Mapping[str, Any], shared_resource: str) -> dict[str, int]:
    """Effective requests of a pod: the sum over containers, at least the largest init
    container (as the scheduler counts them), in GPUs, shared GPU replicas, milli-CPU, MiB and
    MIG devices."""

    def one(container: Mapping[str, Any]) -> dict[str, int]:
        res = container.get("resources") or {}
        limits = res.get("limits") or {}
        requests = {**limits, **(res.get("requests") or {})}
        out: dict[str, int] = {}
        for name, qty in requests.items():
            if name in (jobs.GPU_RESOURCE, shared_resource) or name.startswith(MIG_RESOURCE_PREFIX):
                out[name] = parse_count(qty)
            elif name == "cpu":
                out[name] = _quantity(qty, "cpu", "pod")
            elif name == "memory":
                out[name] = _quantity(qty, "memory", "pod")
        return out

    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, value in one(container).items():
            total[name] = total.get(name, 0) + value
    for container in spec.get("initContainers") or []:
        for name, value in one(container).items():
            total[name] = max(total.get(name, 0), value)
    return total


def _reason_of(state: Mapping[str, Any], phase: str) -> str:
    if phase == "Unknown":
        return NODE_LOST
    if state.get("reason"):  # Evicted, NodeLost, OutOfnvidia.com/gpu, UnexpectedAdmissionError
        return str(state["reason"])
    for cond in state.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = str(cond.get("reason") or "Disrupted")
            return _DISRUPTIONS.get(reason, reason)
    if phase != "Failed":
        return ""
    found = ""
    statuses = [
        *(state.get("initContainerStatuses") or []),
        *(state.get("containerStatuses") or []),
    ]
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("reason") == "OOMKilled":
            return "OOMKilled"
        if term and not found and term.get("exitCode", 0) != 0:
            found = str(term.get("reason") or "Error")
    return found or "Failed"


def _slots_of(annotations: Mapping[str, str], gpus: int) -> tuple[status.GPUSlot, ...]:
    raw = annotations.get(GPUS_ANNOTATION, "")
    milli_raw = annotations.get(jobs.GPU_MILLI_ANNOTATION, "")
    milli = int(milli_raw) if milli_raw.isdigit() and 0 < int(milli_raw) <= 1000 else 1000
    indices = [int(p) for p in raw.split(",") if p.strip().isdigit()]
    if len(indices) != gpus:
        return ()
    return tuple(status.GPUSlot.model_construct(index=i, milli=milli) for i in indices)


def read_pod(raw: Mapping[str, Any], *, shared_resource: str = SHARED_GPU_RESOURCE) -> PodRecord:
    """What gpufed keeps of a Kubernetes Pod (any pod: its own or a foreign one). A pod of
    gpufed's holding its GPUs through a ResourceClaim (DRA) requests none: it holds the ones
    its `gpufed.io/gpus` annotation names."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    state = raw.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    phase_raw = str(state.get("phase") or "Pending")
    requests = _requests_of(spec, shared_resource)
    quota_gpus = requests.get(jobs.GPU_RESOURCE, 0)
    shared = requests.get(shared_resource, 0) if shared_resource != jobs.GPU_RESOURCE else 0
    gpus = quota_gpus + shared
    node = str(spec.get("nodeName") or "")
    phase = _PHASES.get(phase_raw, status.PodPhase.FAILED)  # Unknown: the node is lost
    job_id = str(labels.get(JOB_LABEL, ""))
    claim = str(annotations.get(CLAIM_ANNOTATION, "")) if job_id else ""
    if claim and not gpus:
        gpus = len([p for p in str(annotations.get(GPUS_ANNOTATION, "")).split(",") if p.strip()])
    mig_slots = migs.parse_slots(str(annotations.get(migs.MIG_ANNOTATION, ""))) if job_id else {}
    mig = migs.requested(requests)
    if claim and not mig:  # DRA: the claim holds them, the pod requests none
        mig = {profile: len(indices) for profile, indices in mig_slots.items()}
    return PodRecord(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name", "")),
        node=node,
        gpus=gpus,
        cpu_milli=requests.get("cpu", 0),
        memory_mib=requests.get("memory", 0),
        holds=bool(node) and phase_raw not in ("Succeeded", "Failed"),
        job_id=job_id,
        task=str(labels.get(TASK_LABEL, "")),
        phase=phase,
        reason=_reason_of(state, phase_raw),
        slots=_slots_of(annotations, gpus),
        mig=mig,
        mig_slots=mig_slots,
        job_meta={k: str(annotations[k]) for k in _JOB_META if k in annotations} if job_id else {},
        quota_gpus=quota_gpus,
        shared=shared > 0,
        claim=claim,
        sharing=str(annotations.get(SHARING_ANNOTATION, "")) if job_id else "",
        checkpoint=str(annotations.get(base.LAST_CHECKPOINT_ANNOTATION, "")) if job_id else "",
        queue=str(labels.get(QUEUE_LABEL, "")) if job_id else "",
    )


def is_sharing(request: base.PodRequest) -> bool:
    """Whether a pod to create holds part of one GPU (gpu-milli below 1000)."""
    return len(request.gpus) == 1 and request.gpus[0].milli < model.GPU_MILLI


def label_value(value: str) -> str:
    """A string made a valid label value (63 characters, alphanumeric at both ends)."""
    cleaned = _LABEL_VALUE_BAD.sub("-", value)[:63]
    return cleaned.strip("-_.")


def build_pod(
    request: base.PodRequest, keys: LabelKeys, *, shared_resource: str = ""
) -> dict[str, Any]:
    """The Pod to create: the user's template bound to the chosen node with `spec.nodeName`,
    gpufed's labels, the trace context and the chosen GPU indices as annotations. A sharing pod
    given a `shared_resource` (the device plugin's replicas on its node) requests one of it in
    place of `nvidia.com/gpu`."""
    template = copy.deepcopy(request.template)
    meta: dict[str, Any] = dict(template.get("metadata") or {})
    spec: dict[str, Any] = dict(template.get("spec") or {})
    labels = {**(meta.get("labels") or {}), **request.labels}
    labels.update(
        {
            JOB_LABEL: label_value(request.job_id),
            GANG_LABEL: label_value(request.job_id),
            QUEUE_LABEL: label_value(request.queue),
            TASK_LABEL: label_value(request.task),
        }
    )
    annotations = {**(meta.get("annotations") or {}), **request.annotations}
    annotations[GPUS_ANNOTATION] = ",".join(str(slot.index) for slot in request.gpus)
    if request.mig:
        annotations[migs.MIG_ANNOTATION] = migs.format_slots(request.mig)
    for drop in ("generateName", "resourceVersion", "uid", "creationTimestamp"):
        meta.pop(drop, None)
    meta.update(
        name=request.name, namespace=request.namespace, labels=labels, annotations=annotations
    )
    spec["nodeName"] = request.node
    if shared_resource and is_sharing(request):
        spec = migs.ask_as(spec, shared_resource)
    if request.mig:  # nvidia.com/gpu under gpufed.io/mig-profile: asked as nvidia.com/mig-<p>
        spec = migs.requesting(spec, request.mig)
    spec.setdefault("restartPolicy", "Never")  # a batch pod ends; Always would never finish
    tolerations = list(spec.get("tolerations") or [])
    tolerated = {t.get("key") for t in tolerations if t.get("operator") == "Exists"}
    for key in keys.tolerated_taints:
        if key not in tolerated:
            tolerations.append({"key": key, "operator": "Exists"})
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
