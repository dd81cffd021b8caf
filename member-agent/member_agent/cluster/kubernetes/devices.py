"""ResourceSlices as gpufed reads them in DRA mode: the GPUs a DRA driver publishes, by node.
Pure functions on the JSON dicts the API server sends (`resource.k8s.io/v1` and `v1beta2`
have the same device shape), and `DeviceBook`, which keeps what the slices say now.

A slice counts when its `spec.driver` is the configured driver (`gpu.nvidia.com` by default)
and it names a node (`spec.nodeName`; slices for all nodes or a node selector publish network
devices, not a node's GPUs). Of the slices of one pool only those of the highest
`spec.pool.generation` count, as the scheduler reads them. A device is one of the node's GPUs
when its `type` attribute, if published, is `gpu` (MIG devices and VFIO devices are not). A
device with a NoSchedule or NoExecute taint, or a health taint of any effect
(`DeviceKeys.health_taints`: NVIDIA's driver's `gpu.nvidia.com/xid` and
`gpu.nvidia.com/gpu-lost` by default, see `health`), is an unhealthy GPU of the
node, as is one a claim's status gives a health condition (`DeviceBook.set_claim_health`).
What is read of it (attribute names configurable through `DeviceKeys`; an unqualified name is
also looked up in the driver's domain, as `gpu.nvidia.com/uuid`):

| what | default | NVIDIA's k8s-dra-driver-gpu |
|---|---|---|
| GPU index on the node | attribute `index`, else the name's digits | `gpu-<minor>`; no `index` |
| UUID | attribute `uuid` | `GPU-…` |
| product | attribute `productName` | `NVIDIA H100 80GB HBM3` |
| memory | capacity `memory` | e.g. `81559Mi` |
| NVLink clique | attribute `cliqueID` | not per GPU: the node's GFD label counts |

(NVIDIA's driver published `index` and `minor` until 25.8 and names GPUs `gpu-<minor>`.)

MIG devices (`type` `mig`, `DeviceKeys.mig_type`): the `profile` attribute (`1g.10gb`) and the
parent GPU, from `parentIndex` (NVIDIA's driver until 25.8), else the GPU whose `uuid` is the
device's `parentUUID`, else the name's `gpu-<minor>-mig-…`. A node's MIG devices of one profile
are numbered 0, 1, … in the order of their names (`DeviceBook.mig_devices`): the inventory's
`model.Node.mig` and the indices placement chooses. A GPU whose MIG devices are published is
never offered whole too (it counts as taken): its memory and SMs are the MIG devices'. A
tainted MIG device is never free. Claims for MIG devices ask `DeviceKeys.mig_device_class`
(`mig.nvidia.com`, the DeviceClass NVIDIA's chart installs for them).

The inventory node (`with_devices`): GPU index i is the device whose index is i; an index the
driver does not publish below the node's highest (a GPU turned into MIG devices or gone) is
counted as taken, so gpufed never places on it; a tainted device is one of the node's
unhealthy GPUs (`model.Node.unhealthy`): never free, counted unavailable, and gpufed's pods
holding it fail `GPUFailed` (`state`). The model is the node's GFD product
label when it has one (what jobs select and the broker knows), else the product with spaces
made dashes, as GFD writes it; memory is the smallest device's; the NVLink domain the clique
all the node's devices share, else the node's label.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.api import jobs
from member_agent.cluster.kubernetes import health
from member_agent.inventory import model

logger = logging.getLogger(__name__)

DEFAULT_DRIVER = "gpu.nvidia.com"
_NAME_INDEX = re.compile(r"^[A-Za-z]+-([0-9]+)$")
_MIG_PARENT = re.compile(r"^[A-Za-z]+-([0-9]+)-mig-")


@dataclass(frozen=True)
class DeviceKeys:
    """The driver, the DeviceClass claims ask for, and which attributes mean what."""

    driver: str = DEFAULT_DRIVER
    device_class: str = DEFAULT_DRIVER  # the DeviceClass NVIDIA's chart installs
    index: str = "index"
    uuid: str = "uuid"
    product: str = "productName"
    memory: str = "memory"
    clique: str = "cliqueID"
    type: str = "type"
    gpu_type: str = "gpu"
    mig_type: str = "mig"
    profile: str = "profile"
    parent_index: str = "parentIndex"
    parent_uuid: str = "parentUUID"
    mig_device_class: str = "mig.nvidia.com"
    config_api: str = "resource.nvidia.com/v1beta1"  # the apiVersion of the driver's GpuConfig
    # device taints that make a GPU unhealthy whatever their effect (not a slice attribute),
    # and the condition types that do in a claim's `status.devices` (True)
    health_taints: tuple[str, ...] = health.DEFAULT_TAINTS
    health_conditions: tuple[str, ...] = health.DEFAULT_CONDITIONS

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DeviceKeys:
        """From camelCase names (`deviceClass`, `productName`: the field, not the attribute)."""
        names = {f.name: f.name for f in dataclasses.fields(cls) if not f.name.startswith("health")}
        names.update(deviceClass="device_class", gpuType="gpu_type", configApi="config_api")
        names.update(migType="mig_type", parentIndex="parent_index", parentUuid="parent_uuid")
        names.update(migDeviceClass="mig_device_class")
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"DRA keys: unknown {unknown}; known: {sorted(names)}")
        kwargs: dict[str, Any] = {names[key]: str(value) for key, value in values.items()}
        return cls(**kwargs)


@dataclass(frozen=True)
class Device:
    """One GPU a slice publishes, and where the allocation names it (driver, pool, name)."""

    driver: str
    pool: str
    name: str
    node: str
    index: int
    uuid: str = ""
    product: str = ""
    memory_mib: int = 0
    clique: str = ""
    unhealthy: str = ""  # why the device is out of service (a taint), "" when it is not
    # a MIG device: its profile and parent GPU index (`index`: its number among the node's
    # devices of that profile, set by the book)
    profile: str = ""
    parent: int = -1
    parent_uuid: str = ""


@dataclass(frozen=True)
class Slice:
    """What gpufed keeps of one ResourceSlice."""

    name: str
    pool: str
    generation: int
    node: str
    devices: tuple[Device, ...]
    migs: tuple[Device, ...] = ()


def _names(key: str, driver: str) -> tuple[str, ...]:
    domain, slash, bare = key.partition("/")
    if not slash:
        return (key, f"{driver}/{key}")
    return (key, bare) if domain == driver else (key,)


def attribute(device: Mapping[str, Any], key: str, driver: str) -> Any:
    """An attribute's value (string, int, bool or version), or None."""
    attributes = device.get("attributes") or {}
    for name in _names(key, driver):
        value = attributes.get(name)
        if isinstance(value, Mapping):
            for kind in ("string", "int", "bool", "version"):
                if kind in value:
                    return value[kind]
    return None


def _memory_mib(device: Mapping[str, Any], keys: DeviceKeys) -> int:
    capacity = device.get("capacity") or {}
    for name in _names(keys.memory, keys.driver):
        value = capacity.get(name)
        if isinstance(value, Mapping) and "value" in value:
            try:
                return jobs.parse_memory_mib(value["value"])
            except (ValueError, TypeError):
                return 0
    return 0


def _index(device: Mapping[str, Any], keys: DeviceKeys) -> int | None:
    value = attribute(device, keys.index, keys.driver)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    found = _NAME_INDEX.match(str(device.get("name", "")))
    return int(found.group(1)) if found else None


def read_device(raw: Mapping[str, Any], keys: DeviceKeys, *, pool: str, node: str) -> Device | None:
    """One of a node's GPUs, or None for a device that is not one (or not usable now)."""
    device = raw.get("basic") or raw  # v1beta1 wrapped the fields; v1beta2 and v1 do not
    kind = attribute(device, keys.type, keys.driver)
    if kind is not None and str(kind) != keys.gpu_type:
        return None
    index = _index({**device, "name": raw.get("name", "")}, keys)
    if index is None:
        return None
    return Device(
        driver=keys.driver,
        pool=pool,
        name=str(raw.get("name", "")),
        node=node,
        index=index,
        uuid=str(attribute(device, keys.uuid, keys.driver) or ""),
        product=str(attribute(device, keys.product, keys.driver) or ""),
        memory_mib=_memory_mib(device, keys),
        clique=str(attribute(device, keys.clique, keys.driver) or ""),
        unhealthy=health.device_unhealthy(device, keys.health_taints),
    )


def read_mig(raw: Mapping[str, Any], keys: DeviceKeys, *, pool: str, node: str) -> Device | None:
    """One of a node's MIG devices, or None for a device that is not one."""
    device = raw.get("basic") or raw
    if str(attribute(device, keys.type, keys.driver)) != keys.mig_type:
        return None
    profile = str(attribute(device, keys.profile, keys.driver) or "")
    name = str(raw.get("name", ""))
    parent = attribute(device, keys.parent_index, keys.driver)
    if not isinstance(parent, int) or isinstance(parent, bool) or parent < 0:
        found = _MIG_PARENT.match(name)
        parent = int(found.group(1)) if found else -1
    if not profile:
        return None
    return Device(
        driver=keys.driver,
        pool=pool,
        name=name,
        node=node,
        index=-1,
        uuid=str(attribute(device, keys.uuid, keys.driver) or ""),
        product=str(attribute(device, keys.product, keys.driver) or ""),
        memory_mib=_memory_mib(device, keys),
        unhealthy=health.device_unhealthy(device, keys.health_taints),
        profile=profile,
        parent=parent,
        parent_uuid=str(attribute(device, keys.parent_uuid, keys.driver) or ""),
    )


def read_slice(raw: Mapping[str, Any], keys: DeviceKeys) -> Slice | None:
    """A node's slice of the configured driver, or None for any other."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    node = str(spec.get("nodeName") or "")
    if spec.get("driver") != keys.driver or not node:
        return None
    pool_spec = spec.get("pool") or {}
    pool = str(pool_spec.get("name") or node)
    raw_devices = spec.get("devices") or []
    devices = [d for d in (read_device(r, keys, pool=pool, node=node) for r in raw_devices) if d]
    by_uuid = {d.uuid: d.index for d in devices if d.uuid}
    migs = [m for m in (read_mig(r, keys, pool=pool, node=node) for r in raw_devices) if m]
    migs = [
        dataclasses.replace(m, parent=by_uuid[m.parent_uuid])
        if m.parent_uuid in by_uuid and m.parent < 0
        else m
        for m in migs
    ]
    return Slice(
        name=str(meta.get("name", "")),
        pool=pool,
        generation=int(pool_spec.get("generation") or 0),
        node=node,
        devices=tuple(devices),
        migs=tuple(migs),
    )


def model_name(product: str) -> str:
    """A product name as GFD writes it in `nvidia.com/gpu.product` (spaces made dashes)."""
    return "-".join(product.split())


def with_devices(
    node: model.Node,
    devices: Mapping[int, Device],
    migs: Mapping[str, Sequence[Device]] | None = None,
) -> model.Node:
    """The inventory node with the GPUs and MIG devices a driver publishes for it (see the
    module)."""
    if not devices and not migs:
        return node
    mig_counts = {profile: len(found) for profile, found in (migs or {}).items() if found}
    mig_free = {
        profile: tuple(d.index for d in found if not d.unhealthy)
        for profile, found in (migs or {}).items()
        if found
    }
    parents = {d.parent for found in (migs or {}).values() for d in found}
    count = max(devices) + 1 if devices else 0
    every = [*devices.values(), *(d for found in (migs or {}).values() for d in found)]
    products = sorted({d.product for d in every if d.product})
    label = node.labels.get(jobs.GPU_PRODUCT_LABEL, "")
    memory = [d.memory_mib for d in devices.values() if d.memory_mib]
    cliques = {d.clique for d in devices.values()}
    domain = cliques.pop() if len(cliques) == 1 and "" not in cliques else node.nvlink_domain
    return dataclasses.replace(
        node,
        model=label or (model_name(products[0]) if products else ""),
        gpu_count=count,
        gpu_memory_mib=min(memory) if memory else node.gpu_memory_mib,
        nvlink_domain=domain,
        labels=dict(node.labels),
        gpu_free=[
            model.GPU_MILLI if i in devices and not devices[i].unhealthy and i not in parents else 0
            for i in range(count)
        ],
        unhealthy=frozenset(i for i, d in devices.items() if d.unhealthy),
        mig=mig_counts,
        mig_free=mig_free,
    )


class DeviceBook:
    """The GPUs the slices publish now, by node and by the name an allocation gives them.
    A change is applied pool by pool: a driver updating one node's slice costs that node."""

    def __init__(self, keys: DeviceKeys) -> None:
        self.keys = keys
        self._slices: dict[str, Slice] = {}
        self._pools: dict[str, set[str]] = defaultdict(set)  # pool -> slice names
        self._pool_devices: dict[str, list[Device]] = {}  # pool -> the devices that count
        self._by_node: dict[str, dict[int, Device]] = defaultdict(dict)
        self._by_ref: dict[tuple[str, str, str], Device] = {}
        self._pool_migs: dict[str, list[Device]] = {}  # pool -> its MIG devices that count
        self._mig_by_node: dict[str, dict[str, list[Device]]] = {}  # node -> profile -> devices
        # devices a claim's status says are unhealthy (a health condition), by claim
        self._claim_health: dict[str, dict[tuple[str, str, str], str]] = {}
        self._sick: dict[tuple[str, str, str], str] = {}  # all of them

    def replace(self, items: Iterable[Mapping[str, Any]]) -> set[str]:
        """Every slice there is now; returns the nodes whose GPUs changed."""
        before = {node: self._state(node) for node in {*self._by_node, *self._mig_by_node}}
        self._slices.clear()
        self._pools.clear()
        self._pool_devices.clear()
        self._pool_migs.clear()
        self._mig_by_node.clear()
        self._by_node.clear()
        self._by_ref.clear()
        for raw in items:
            found = read_slice(raw, self.keys)
            if found is not None:
                self._slices[found.name] = found
                self._pools[found.pool].add(found.name)
        for pool in sorted(self._pools):
            self._count_pool(pool)
        nodes = set(before) | set(self._by_node) | set(self._mig_by_node)
        return {n for n in nodes if before.get(n, ({}, {})) != self._state(n)}

    def _state(self, node: str) -> tuple[dict[int, Device], dict[str, list[Device]]]:
        return dict(self._by_node.get(node, {})), dict(self._mig_by_node.get(node, {}))

    def apply(self, kind: str, raw: Mapping[str, Any]) -> set[str]:
        """One watch event; returns the nodes whose GPUs changed."""
        name = str((raw.get("metadata") or {}).get("name", ""))
        old = self._slices.pop(name, None)
        if old is not None:
            self._pools[old.pool].discard(name)
        found = None if kind == "DELETED" else read_slice(raw, self.keys)
        if found is not None:
            self._slices[name] = found
            self._pools[found.pool].add(name)
        pools = {s.pool for s in (old, found) if s is not None}
        nodes = {d.node for pool in pools for d in self._pool_devices.get(pool, ())}
        nodes |= {d.node for pool in pools for d in self._pool_migs.get(pool, ())}
        nodes |= {s.node for s in (old, found) if s is not None}
        before = {n: self._state(n) for n in nodes}
        for pool in sorted(pools):
            self._count_pool(pool)
        return {n for n in nodes if before[n] != self._state(n)}

    def mig_devices(self, node: str) -> dict[str, list[Device]]:
        """The node's MIG devices by profile, device `i` of a profile with index `i`."""
        found = self._mig_by_node.get(node, {})
        if not self._sick:
            return found
        return {
            profile: [
                dataclasses.replace(d, unhealthy=d.unhealthy or why)
                if (why := self._sick.get((d.driver, d.pool, d.name)))
                else d
                for d in devices
            ]
            for profile, devices in found.items()
        }

    def devices(self, node: str) -> dict[int, Device]:
        found = self._by_node.get(node, {})
        if not self._sick:
            return found
        return {
            index: dataclasses.replace(device, unhealthy=device.unhealthy or why)
            if (why := self._sick.get((device.driver, device.pool, device.name)))
            else device
            for index, device in found.items()
        }

    def set_claim_health(self, claim: str, sick: Mapping[tuple[str, str, str], str]) -> set[str]:
        """The devices a claim's status says are unhealthy now (with why); returns the nodes
        whose GPUs this changes."""
        before = self._claim_health.pop(claim, {})
        if sick:
            self._claim_health[claim] = dict(sick)
        if before == dict(sick):
            return set()
        self._sick = {ref: why for refs in self._claim_health.values() for ref, why in refs.items()}
        return {d.node for ref in {*before, *sick} if (d := self._by_ref.get(ref)) is not None}

    def find(self, driver: str, pool: str, name: str) -> Device | None:
        return self._by_ref.get((driver, pool, name))

    def _count_pool(self, pool: str) -> None:
        """The pool's devices again: those of its newest generation's slices."""
        for device in self._pool_devices.pop(pool, []):
            on_node = self._by_node.get(device.node, {})
            if on_node.get(device.index) is device:
                del on_node[device.index]
                if not on_node:
                    self._by_node.pop(device.node, None)
            self._by_ref.pop((device.driver, device.pool, device.name), None)
        touched = {d.node for d in self._pool_migs.get(pool, ())}
        for device in self._pool_migs.pop(pool, []):
            self._by_ref.pop((device.driver, device.pool, device.name), None)
        slices = [self._slices[n] for n in sorted(self._pools.get(pool, ()))]
        newest = max((s.generation for s in slices), default=0)
        migs = [m for one in slices if one.generation == newest for m in one.migs]
        if migs:
            self._pool_migs[pool] = migs
        for node in touched | {m.node for m in migs}:
            self._index_migs(node)
        if not slices:
            self._pools.pop(pool, None)
            return
        counted = []
        for one in slices:
            if one.generation != newest:
                continue
            for device in one.devices:
                taken = self._by_node[device.node].get(device.index)
                if taken is not None:
                    logger.warning(
                        "node %s: devices %s and %s both have GPU index %d; using %s",
                        device.node, taken.name, device.name, device.index, taken.name,
                    )  # fmt: skip
                    continue
                self._by_node[device.node][device.index] = device
                self._by_ref[(device.driver, device.pool, device.name)] = device
                counted.append(device)
        self._pool_devices[pool] = counted

    def _index_migs(self, node: str) -> None:
        """Number the node's MIG devices per profile, in the order of their names."""
        by_profile: dict[str, list[Device]] = defaultdict(list)
        for devices in self._pool_migs.values():
            for device in devices:
                if device.node == node:
                    by_profile[device.profile].append(device)
        numbered: dict[str, list[Device]] = {}
        for profile, found in sorted(by_profile.items()):
            found.sort(key=lambda d: d.name)
            numbered[profile] = [dataclasses.replace(d, index=i) for i, d in enumerate(found)]
            for device in numbered[profile]:
                self._by_ref[(device.driver, device.pool, device.name)] = device
        if numbered:
            self._mig_by_node[node] = numbered
        else:
            self._mig_by_node.pop(node, None)
