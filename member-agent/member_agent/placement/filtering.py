"""Node feasibility: can this node take this pod at all? Pure.

Called by `gang.place_gang` for every candidate node and by `explaining` to say why nothing
fits. A node fits a pod when it is ready and schedulable, its GPU model is among the pod's
models (if any), its labels and name match the pod's node selector and required node affinity
(`broker.api.affinity`, Kubernetes semantics: terms ORed, expressions ANDed, `In`, `NotIn`,
`Exists`, `DoesNotExist`, `Gt`, `Lt`), its GPUs have enough memory, it has the CPU and memory
free, and it has `gpus` GPUs wholly free (a whole-GPU pod, all on this node, inside one NVLink
island when the pod requires NVLink) or one GPU with `gpu_milli` free (a sharing pod) or
`mig_slices` free MIG devices of its `mig_profile` (a MIG pod), and its GPUs can be had
that way (`sharing_allowed`: the device plugin's shared replicas take sharing pods only).
Preferred node affinity is not weighed (see `broker.api.affinity`).
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.api import affinity, jobs
from member_agent.inventory import model
from member_agent.placement import indexing

GPU_MILLI = indexing.GPU_MILLI


@dataclass(frozen=True, slots=True)
class Demand:
    """What one pod needs from a node, flattened for the hot loop."""

    gpus: int
    gpu_milli: int
    cpu_milli: int
    memory_mib: int
    models: tuple[str, ...] = ()
    min_gpu_memory_mib: int = 0
    nvlink: bool = False  # all GPUs inside one NVLink island
    # node selection beyond `models` (None: every node of those models)
    selector: affinity.NodeSelector | None = None
    mig_profile: str = ""  # a MIG pod: `mig_slices` MIG devices of this profile
    mig_slices: int = 0

    @property
    def sharing(self) -> bool:
        return self.gpus == 1 and 0 < self.gpu_milli < GPU_MILLI

    @property
    def gpu_total(self) -> int:
        return self.gpus * self.gpu_milli

    @property
    def key(self) -> tuple[int, int, int]:
        """What scoring depends on: GPUs, per-GPU milli, CPU."""
        return (self.gpus, self.gpu_milli, self.cpu_milli)

    def describe(self) -> str:
        if self.mig_slices:
            plural = "s" if self.mig_slices > 1 else ""
            return f"{self.mig_slices} MIG slice{plural} of {self.mig_profile}"
        if self.gpus == 0:
            return "CPU-only"
        if self.sharing:
            return f"{self.gpu_milli} milli of 1 GPU"
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"


def demand_of(shape: jobs.PodShape, *, nvlink: bool = False) -> Demand:
    gpus = shape.gpus
    milli = shape.gpu_milli if gpus else 0
    return Demand(
        gpus=gpus,
        gpu_milli=milli,
        cpu_milli=shape.cpu_milli,
        memory_mib=shape.memory_mib,
        models=tuple(shape.models),
        min_gpu_memory_mib=shape.min_gpu_memory_mib,
        nvlink=nvlink and gpus > 1,
        selector=shape.selector,
        mig_profile=shape.mig_profile,
        mig_slices=shape.mig_slices,
    )


def fits(entry: indexing.Entry, demand: Demand) -> bool:
    """Whether `entry` can take `demand` now."""
    if not entry.available:
        return False
    if demand.models and entry.model not in demand.models:
        return False
    if demand.min_gpu_memory_mib and entry.gpu_memory_mib < demand.min_gpu_memory_mib:
        return False
    if entry.cpu_free < demand.cpu_milli or entry.mem_free < demand.memory_mib:
        return False
    if not fits_gpus(entry, demand):
        return False
    if demand.mig_slices and mig_free(entry, demand) < demand.mig_slices:
        return False
    if demand.gpus and not sharing_allowed(entry, demand):
        return False
    # last: the dearest check, on the nodes with room only
    return demand.selector is None or demand.selector.matches(entry.labels, entry.name)


def fits_gpus(entry: indexing.Entry, demand: Demand) -> bool:
    gpus = demand.gpus
    if gpus == 0:
        return True
    if demand.gpu_milli < GPU_MILLI:
        return entry.max_free >= demand.gpu_milli
    if entry.whole < gpus:
        return False
    if demand.nvlink:
        return largest_island_block(entry) >= gpus
    return True


def mig_free(entry: indexing.Entry, demand: Demand) -> int:
    """Free MIG devices of the pod's profile on the node."""
    return len(entry.mig_free.get(demand.mig_profile, ()))


def mig_slots(entry: indexing.Entry, demand: Demand) -> dict[str, tuple[int, ...]]:
    """The MIG devices a MIG pod takes on the node: the lowest free indices of its profile."""
    if not demand.mig_slices:
        return {}
    return {demand.mig_profile: entry.mig_free.get(demand.mig_profile, ())[: demand.mig_slices]}


def sharing_allowed(entry: indexing.Entry, demand: Demand) -> bool:
    """Whether the node's GPUs can be had the way the pod asks (`model.SHARING_LABEL`): a
    sharing pod only where the GPUs are shared replicas, a whole-GPU pod only where they are
    not; both where the backend says nothing."""
    mode = entry.labels.get(model.SHARING_LABEL)
    return mode is None or (mode == model.SHARING_REPLICAS) == demand.sharing


def largest_island_block(entry: indexing.Entry) -> int:
    """Most wholly free GPUs inside one NVLink island of the node."""
    if entry.island <= 1:
        return 1 if entry.whole else 0
    counts: dict[int, int] = {}
    for index, milli in enumerate(entry.gpu_free):
        if milli >= GPU_MILLI:
            island = index // entry.island
            counts[island] = counts.get(island, 0) + 1
    return max(counts.values(), default=0)


def whole_slots(entry: indexing.Entry, demand: Demand) -> list[int]:
    """The lowest-index wholly free GPUs for a whole-GPU pod (inside one island if required)."""
    free = [i for i, milli in enumerate(entry.gpu_free) if milli >= GPU_MILLI]
    if not demand.nvlink or entry.island <= 1:
        return free[: demand.gpus]
    by_island: dict[int, list[int]] = {}
    for index in free:
        by_island.setdefault(index // entry.island, []).append(index)
    # the island that keeps the most whole islands free: the fullest one that still fits
    fitting = [block for block in by_island.values() if len(block) >= demand.gpus]
    best = min(fitting, key=lambda block: (len(block), block[0]))
    return best[: demand.gpus]
