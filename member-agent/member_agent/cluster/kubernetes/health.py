"""Which GPUs of a Kubernetes node are unhealthy, from what the API shows. Pure functions on
the JSON dicts the API server sends; `state` applies them to the inventory and
`gpuhealth.HealthBook` counts the failures.

What is read (keys configurable through `HealthKeys`: `--gpu-health-taint`,
`--gpu-health-label`, `--gpu-health-condition`):

- **NVIDIA's device plugin**: `status.allocatable["nvidia.com/gpu"]` below
  `status.capacity[...]`. The kubelet drops a device the plugin marks Unhealthy (an XID error,
  a GPU fallen off the bus) from allocatable; which one is not said, only how many
  (`NodeHealth.missing`). Read on whole-GPU nodes (not on nodes of shared replicas).
- **a health taint on the Node** (node-problem-detector, NVSentinel, NVIDIA's health checks, a
  person): any effect, its key in `HealthKeys.taints` (defaults `gpufed.io/gpu-unhealthy`,
  `nvidia.com/gpu-xid`). The GPUs are the value's `gpu<i>` or `gpu-<i>` tokens (`gpu-3`,
  `gpu0.gpu5`); a value naming none (an XID code such as `79`, or nothing): every GPU of it.
- **a health condition of the Node** (node-problem-detector's and NVSentinel's way of saying
  why): its type in `HealthKeys.conditions` (default `GPUUnhealthy`) with status `True`; the
  GPUs its message names as for taints, else every GPU of the node.
- **a health label on the Node**: its key in `HealthKeys.labels` (default
  `gpufed.io/gpu-unhealthy`), any value but `false`, `none`, `healthy`, `ok`; GPUs as for
  taints.
- **a DRA device taint** in a ResourceSlice (`devices`): NoSchedule or NoExecute,
  or any effect with a key in `HealthKeys.taints` (NVIDIA's DRA driver's health taints
  `gpu.nvidia.com/xid` and `gpu.nvidia.com/gpu-lost`, effect None): that device.
- **a DRA device condition** in a ResourceClaim's `status.devices[]` (what a driver reports of
  an allocated device; `claims.sick_devices`): a condition of a
  `HealthKeys.conditions` type, status True: that device, while a claim says so.
- **the kubelet, on a pod** (`ResourceHealthStatus`, KEP-4680):
  `status.containerStatuses[].allocatedResourcesStatus[].resources[].health: Unhealthy`. The
  pod fails `GPUFailed`.

Health keys are not the taints that make a node unschedulable: a health taint takes out the
GPUs it names and leaves the node's other GPUs in use (a NoExecute one still makes the kubelet
evict the pods that do not tolerate it).

`choose_unhealthy` turns a count the device plugin gives into indices: GPUs gpufed counts free
first, then GPUs only other workloads' pods hold, then gpufed's own, each from the top. So
gpufed's pods are blamed only when the node has more GPUs in use than healthy ones, and then
the highest-indexed: the device plugin does not say which device failed (the kubelet's
`allocatedResourcesStatus` does, where the feature gate is on).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.api import jobs
from member_agent.cluster.kubernetes import objects
from member_agent.inventory import model

DEFAULT_TAINTS = (
    "gpufed.io/gpu-unhealthy",
    "nvidia.com/gpu-xid",
    "gpu.nvidia.com/xid",  # NVIDIA's DRA driver's device health taints (DeviceHealthCheck)
    "gpu.nvidia.com/gpu-lost",
)
DEFAULT_LABELS = ("gpufed.io/gpu-unhealthy",)
DEFAULT_CONDITIONS = ("GPUUnhealthy",)
_HEALTHY_VALUES = frozenset({"false", "none", "healthy", "ok"})
_GPU_TOKEN = re.compile(r"gpu-?([0-9]+)", re.IGNORECASE)
_BLOCKING = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class HealthKeys:
    """The taint and label keys, and node condition types, that say GPUs are unhealthy."""

    taints: tuple[str, ...] = DEFAULT_TAINTS
    labels: tuple[str, ...] = DEFAULT_LABELS
    conditions: tuple[str, ...] = DEFAULT_CONDITIONS


@dataclass(frozen=True)
class NodeHealth:
    """A node's unhealthy GPUs as its Node object says: those named, how many more the device
    plugin no longer offers (which ones it does not say), and why."""

    named: frozenset[int] = frozenset()
    every: bool = False  # a taint or label naming no GPU: all of the node's
    missing: int = 0
    capacity: int = 0  # nvidia.com/gpu capacity, when above the allocatable
    reasons: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.named and not self.every and not self.missing


def gpu_indices(value: str) -> frozenset[int] | None:
    """The GPUs a taint's or label's value names (`gpu-3`, `gpu0.gpu5`); None (every GPU of
    the node) when it names none."""
    named = frozenset(int(found) for found in _GPU_TOKEN.findall(value))
    return named or None


def read_node_health(raw: Mapping[str, Any], keys: HealthKeys) -> NodeHealth:
    """What a Node object says of its GPUs' health."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    state = raw.get("status") or {}
    flagged: list[tuple[str, str]] = []
    for taint in spec.get("taints") or []:
        key = str(taint.get("key") or "")
        if key in keys.taints:
            value = str(taint.get("value") or "")
            flagged.append((value, f"taint {key}={value}" if value else f"taint {key}"))
    labels = meta.get("labels") or {}
    for key in keys.labels:
        label = labels.get(key)
        if label is not None and str(label).strip().lower() not in _HEALTHY_VALUES:
            flagged.append((str(label), f"label {key}={label}"))
    for condition in state.get("conditions") or []:
        kind = str(condition.get("type") or "")
        if kind in keys.conditions and condition.get("status") == "True":
            message = str(condition.get("message") or "")
            flagged.append((message, f"condition {kind}: {message}" if message else kind))
    named: set[int] = set()
    every = False
    reasons = [why for _, why in flagged]
    for value, _ in flagged:
        found = gpu_indices(value)
        every = every or found is None
        named |= found or set()
    capacity = _count((state.get("capacity") or {}).get(jobs.GPU_RESOURCE))
    allocatable = _count((state.get("allocatable") or {}).get(jobs.GPU_RESOURCE))
    missing = 0
    if capacity > allocatable >= 0 and "allocatable" in state:
        missing = capacity - allocatable
        reasons.append(f"{jobs.GPU_RESOURCE} allocatable {allocatable} of {capacity}")
    return NodeHealth(
        named=frozenset(named),
        every=every,
        missing=missing,
        capacity=capacity if missing else 0,
        reasons=tuple(reasons),
    )


def read_node(
    raw: Mapping[str, Any], keys: objects.LabelKeys, health: HealthKeys, *, plugin: bool
) -> tuple[model.Node | None, NodeHealth]:
    """The inventory node of a Node (`objects.read_node`, its health taints left
    out, its missing GPUs counted; `plugin`: device-plugin mode) and its GPUs' health."""
    found = read_node_health(raw, health)
    node = objects.read_node(without_health_taints(raw, health), keys, device_plugin=plugin)
    if node is not None and node.labels.get(model.SHARING_LABEL) == model.SHARING_REPLICAS:
        # replicas, not GPUs: the drop is not read, the node counted as the plugin offers it
        found = dataclasses.replace(found, missing=0, capacity=0)
        read = without_health_taints(raw, health, capacity=False)
        node = objects.read_node(read, keys, device_plugin=plugin)
    return node, found


def without_health_taints(
    raw: Mapping[str, Any], keys: HealthKeys, *, capacity: bool = True
) -> Mapping[str, Any]:
    """The Node with its health taints left out (they take out GPUs, not the node) and, when
    the device plugin offers fewer GPUs than the node has (and `capacity`), its capacity as
    allocatable (the missing ones are unhealthy GPUs of the node, not GPUs it never had)."""
    spec = raw.get("spec") or {}
    state = raw.get("status") or {}
    taints = spec.get("taints") or []
    kept = [t for t in taints if t.get("key") not in keys.taints]
    has = _count((state.get("capacity") or {}).get(jobs.GPU_RESOURCE))
    allocatable = state.get("allocatable") or {}
    offered = allocatable.get(jobs.GPU_RESOURCE)
    short = capacity and offered is not None and _count(offered) < has
    if len(kept) == len(taints) and not short:
        return raw
    out = {**raw, "spec": {**spec, "taints": kept}}
    if short:
        out["status"] = {**state, "allocatable": {**allocatable, jobs.GPU_RESOURCE: str(has)}}
    return out


def device_unhealthy(device: Mapping[str, Any], taint_keys: Iterable[str]) -> str:
    """Why a ResourceSlice device is out of service ("" when it is not): a NoSchedule or
    NoExecute taint, or a health taint (`taint_keys`) of any effect."""
    health = frozenset(taint_keys)
    for taint in device.get("taints") or []:
        key = str(taint.get("key") or "")
        if taint.get("effect") in _BLOCKING or key in health:
            value = str(taint.get("value") or "")
            return f"device taint {key}={value}" if value else f"device taint {key}"
    return ""


def pod_gpu_unhealthy(status: Mapping[str, Any]) -> bool:
    """Whether the kubelet reports a device allocated to the pod Unhealthy
    (`allocatedResourcesStatus`, KEP-4680): a GPU of `nvidia.com/gpu` or of a claim."""
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in statuses:
        for resource in container.get("allocatedResourcesStatus") or []:
            name = str(resource.get("name") or "")
            if name != jobs.GPU_RESOURCE and not name.startswith(("claim:", "nvidia.com/")):
                continue
            for device in resource.get("resources") or []:
                if device.get("health") == "Unhealthy":
                    return True
    return False


def choose_unhealthy(
    health: NodeHealth, free: Sequence[int], *, ours: Iterable[int], named: Iterable[int] = ()
) -> frozenset[int]:
    """The node's unhealthy GPU indices: those named (by the Node or its devices; every one
    for `health.every`), and as many more as `health.missing` says are gone, chosen as the
    module says from the GPUs' free milli `free` and the indices gpufed's pods hold (`ours`)."""
    if health.every:
        return frozenset(range(len(free)))
    out = {i for i in (*health.named, *named) if 0 <= i < len(free)}
    held_by_us = set(ours)
    rest = [i for i in reversed(range(len(free))) if i not in out]
    ranked = sorted(
        rest,
        key=lambda i: 0 if free[i] >= model.GPU_MILLI else 1 if i not in held_by_us else 2,
    )  # stable: from the top within each group
    out.update(ranked[: max(health.missing - len(out), 0)])  # a named GPU is one missing
    return frozenset(out)


def _count(value: Any) -> int:
    try:
        return int(str(value).strip()) if value is not None else 0
    except ValueError:
        return 0
