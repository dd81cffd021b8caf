"""The agent's GPU inventory: nodes, their GPUs and what is free on each. Pure data.

Backends (simulated, kubernetes) build it; placement reads it and `apply`/`release` change it;
`summary.summarise` turns it into the broker's ClusterSummary. A GPU is 1000 milli; a
whole-GPU pod takes 1000 on each of its GPUs, a sharing pod part of one GPU. An unhealthy GPU
(`Node.unhealthy`, set by a backend from what the cluster says of its devices, see
`cluster.gpuhealth`) has nothing free, whatever holds it: the summary counts it unavailable and
placement never chooses it; a pod already on it keeps its record, so releasing that pod does not
make the GPU free. MIG devices (`Node.mig`, by profile) are counted apart from the GPUs: a
node's GPUs are its whole GPUs, its MIG devices the slices of GPUs in MIG mode; slice `i` of
a profile is the backend's i-th device of that profile (a device name in DRA mode, a count
only with the device plugin), and a pod of MIG slices holds indices of one profile
(`Inventory.apply(..., mig=...)`). `GPUQuota` is the
namespace side of the same GPUs: a backend reports it (`ClusterBackend.gpu_quotas`), the limits
check (`placement.limits`) reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from broker.api import jobs, status

GPU_MILLI = 1000

# What a backend may say about how a node's GPUs can be shared (inventory labels, set by the
# Kubernetes backend in device-plugin mode; absent: whole and shared pods alike, as on the
# simulated backend and with DRA claims). `replicas`: the GPUs are the device plugin's
# time-slicing or MPS replicas, advertised as the resource in SHARED_RESOURCE_LABEL, so only
# sharing pods go there; `none`: whole GPUs only, a sharing pod would be handed a whole GPU.
SHARING_LABEL = "gpufed.io/gpu-sharing"
SHARING_REPLICAS = "replicas"
SHARING_NONE = "none"
SHARED_RESOURCE_LABEL = "gpufed.io/gpu-shared-resource"


@dataclass
class Node:
    name: str
    model: str
    gpu_count: int
    gpu_memory_mib: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    rack: str = ""
    # multi-node NVLink domain (e.g. one NVL72 rack); "" when NVLink stays inside the node
    nvlink_domain: str = ""
    # GPUs per NVLink island inside the node (8 on an HGX board; 0 or 1: no NVLink)
    nvlink_island: int = 0
    ready: bool = True
    schedulable: bool = True
    # the node's labels, as placement matches node selectors and affinity on them; the GPU
    # product label always says `model` (what the broker knows the node by)
    labels: dict[str, str] = field(default_factory=dict)
    # free milli per GPU index; set from gpu_count when left empty
    gpu_free: list[int] = field(default_factory=list)
    cpu_free: int = -1
    memory_free: int = -1
    # GPU indices out of service (unhealthy): never free, counted unavailable
    unhealthy: frozenset[int] = frozenset()
    # MIG devices by profile ("1g.10gb": 7), and the indices of the free ones by profile
    # (set from `mig` when left empty)
    mig: dict[str, int] = field(default_factory=dict)
    mig_free: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model and self.labels.get(jobs.GPU_PRODUCT_LABEL) != self.model:
            self.labels = {**self.labels, jobs.GPU_PRODUCT_LABEL: self.model}
        if not self.gpu_free:
            self.gpu_free = [0 if i in self.unhealthy else GPU_MILLI for i in range(self.gpu_count)]
        if not self.mig_free and self.mig:
            self.mig_free = {profile: tuple(range(n)) for profile, n in self.mig.items()}
        if self.cpu_free < 0:
            self.cpu_free = self.cpu_milli
        if self.memory_free < 0:
            self.memory_free = self.memory_mib

    @property
    def available(self) -> bool:
        return self.ready and self.schedulable

    @property
    def whole_free(self) -> int:
        """GPUs with nothing on them."""
        return sum(1 for m in self.gpu_free if m == GPU_MILLI)

    @property
    def free_milli(self) -> int:
        return sum(self.gpu_free)

    def island_of(self, index: int) -> int:
        size = self.nvlink_island if self.nvlink_island > 1 else 1
        return index // size

    @property
    def unhealthy_gpus(self) -> int:
        """GPUs of the node out of service (indices beyond its count do not count)."""
        return sum(1 for i in self.unhealthy if 0 <= i < self.gpu_count)


@dataclass
class Inventory:
    """All nodes of one cluster, by name. Mutated only through its methods (`touch` after
    changing a node's fields in place): each names the nodes it changed, for the kept summary
    (`tallies.KeptSummary`, which reads `take_touched`)."""

    cluster: str
    nodes: dict[str, Node] = field(default_factory=dict)
    # pods placed: pod name -> placement (what release gives back)
    pods: dict[str, tuple[status.PodPlacement, int, int]] = field(default_factory=dict)
    # MIG slices held: pod name -> (node, profile -> slice indices)
    mig_pods: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = field(default_factory=dict)
    # nodes changed since `take_touched` (None: all of them, as after `clear`)
    _touched: set[str] | None = field(default=None, init=False, repr=False, compare=False)

    def add(self, node: Node) -> None:
        self.nodes[node.name] = node
        self.touch(node.name)

    def remove(self, name: str) -> None:
        """The node leaves the inventory (what its pods hold stays recorded, as `release`
        finds no node for them)."""
        self.nodes.pop(name, None)
        self.touch(name)

    def touch(self, name: str) -> None:
        """The node `name` changed (or came, or went)."""
        if self._touched is not None:
            self._touched.add(name)

    def take_touched(self) -> set[str] | None:
        """The nodes changed since the last call, and forget them (None: every node, on the
        first call and after `clear`)."""
        touched, self._touched = self._touched, set()
        return touched

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def apply(
        self,
        pod: status.PodPlacement,
        *,
        cpu_milli: int = 0,
        memory_mib: int = 0,
        held: bool = False,
        mig: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Take the pod's GPUs, MIG slices (`mig`: profile -> indices), CPU and memory on its
        node. A new pod is refused an unhealthy GPU; one the cluster already `held` there is
        recorded (the GPU has nothing to take)."""
        node = self.nodes[pod.node]
        for profile, indices in (mig or {}).items():
            free = node.mig_free.get(profile, ())
            taken = [i for i in indices if i not in free]
            if taken:
                raise ValueError(
                    f"{pod.name}: MIG {profile} slice(s) {taken} of {node.name} are not free"
                )
        for slot in pod.gpus:
            if slot.index in node.unhealthy and not held:
                raise ValueError(f"{pod.name}: GPU {slot.index} of {node.name} is unhealthy")
            if slot.index not in node.unhealthy and node.gpu_free[slot.index] < slot.milli:
                raise ValueError(
                    f"{pod.name}: GPU {slot.index} of {node.name} has "
                    f"{node.gpu_free[slot.index]} milli free, needs {slot.milli}"
                )
        for slot in pod.gpus:
            if slot.index not in node.unhealthy:  # a pod on an unhealthy GPU: recorded only
                node.gpu_free[slot.index] -= slot.milli
        node.cpu_free -= cpu_milli
        node.memory_free -= memory_mib
        self.touch(node.name)
        self.pods[pod.name] = (pod, cpu_milli, memory_mib)
        if mig:
            held_mig = {profile: tuple(indices) for profile, indices in mig.items() if indices}
            for profile, indices in held_mig.items():
                left = set(node.mig_free.get(profile, ())) - set(indices)
                node.mig_free[profile] = tuple(sorted(left))
            self.mig_pods[pod.name] = (node.name, held_mig)

    def release(self, pod_name: str) -> None:
        """Give back what a pod held; unknown pods are ignored (release is idempotent)."""
        self._release_mig(pod_name)
        held = self.pods.pop(pod_name, None)
        if held is None:
            return
        pod, cpu, mem = held
        node = self.nodes.get(pod.node)
        if node is None:
            return
        for slot in pod.gpus:
            if slot.index not in node.unhealthy and slot.index < len(node.gpu_free):
                node.gpu_free[slot.index] = min(GPU_MILLI, node.gpu_free[slot.index] + slot.milli)
        node.cpu_free += cpu
        node.memory_free += mem
        self.touch(node.name)

    def _release_mig(self, pod_name: str) -> None:
        held = self.mig_pods.pop(pod_name, None)
        node = self.nodes.get(held[0]) if held else None
        if held is None or node is None:
            return
        for profile, indices in held[1].items():
            back = {i for i in indices if 0 <= i < node.mig.get(profile, 0)}
            node.mig_free[profile] = tuple(sorted(set(node.mig_free.get(profile, ())) | back))
        self.touch(node.name)

    def clear(self) -> None:
        """No nodes, no pods (a backend rebuilding the inventory)."""
        self.nodes.clear()
        self.pods.clear()
        self.mig_pods.clear()
        self._touched = None

    def set_unhealthy(self, name: str, indices: Iterable[int]) -> frozenset[int]:
        """Make `indices` the node's unhealthy GPUs (an empty set: all healthy again): those
        have nothing free, the others what the pods placed there leave. Returns the GPUs that
        were healthy before and are not now."""
        node = self.nodes[name]
        out = frozenset(i for i in indices if 0 <= i < len(node.gpu_free))
        before = node.unhealthy
        free = [GPU_MILLI] * len(node.gpu_free)
        for pod, _, _ in self.pods.values():
            if pod.node == name:
                for slot in pod.gpus:
                    if 0 <= slot.index < len(free):
                        free[slot.index] -= slot.milli
        node.unhealthy = out
        node.gpu_free = [0 if i in out else max(milli, 0) for i, milli in enumerate(free)]
        self.touch(name)
        return out - before

    def apply_all(self, pods: Iterable[tuple[status.PodPlacement, int, int]]) -> None:
        for pod, cpu, mem in pods:
            self.apply(pod, cpu_milli=cpu, memory_mib=mem)


@dataclass(frozen=True)
class GPUQuota:
    """A namespace's GPU quota (a Kubernetes ResourceQuota's `requests.nvidia.com/gpu` or
    `limits.nvidia.com/gpu`) with what is used of it now."""

    namespace: str
    name: str
    resource: str
    hard: int
    used: int

    @property
    def room(self) -> int:
        return max(self.hard - self.used, 0)
