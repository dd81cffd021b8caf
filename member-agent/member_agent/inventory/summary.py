"""Summarise an inventory into the broker's ClusterSummary. Pure function of the Inventory.

Called by the agent's session before it reports up, by `gpufed simulate --clusters K` after
every placement, and by anything else that needs a cluster's shape without its node list.
Per GPU model: nodes_by_free[k] = ready, schedulable nodes with exactly k wholly free GPUs
(an unhealthy GPU is never free, and counts among the unavailable GPUs as a NotReady or cordoned
node's do),
the free milli on partly used GPUs (for sharing pods), the largest free NVLink block, per-rack
histograms, the largest CPU/memory headroom of a node, and per MIG profile the devices in all
and the histogram of nodes by free devices (`ModelSummary.mig`; None for a model without
MIG devices). The cluster's fragmentation uses
FGD's measure with the given expected workload (`fragmentation`).
"""

from __future__ import annotations

from broker.api.inventory import ClusterSummary, MIGSummary, ModelSummary
from member_agent.inventory import fragmentation, model

CPU_ONLY = ""  # the model name under which CPU-only nodes are summarised


def summarise(
    inventory: model.Inventory,
    *,
    seq: int = 0,
    workload: fragmentation.Workload | None = None,
) -> ClusterSummary:
    """The ClusterSummary of `inventory` (its fragmentation against `workload`)."""
    expected = workload if workload is not None else default_workload()
    per_model: dict[str, _Totals] = {}
    frag = 0.0
    for node in inventory:
        totals = per_model.get(node.model)
        if totals is None:
            totals = per_model[node.model] = _Totals()
        totals.add(node)
        if node.available and node.gpu_count:
            frag += expected.node_fragmentation(
                node.model, node.gpu_free, node.cpu_free, node.memory_free
            )
    return ClusterSummary(
        cluster=inventory.cluster,
        seq=seq,
        models=[per_model[name].build(name) for name in sorted(per_model)],
        fragmentation_milli=int(frag),
    )


class _Totals:
    """Plain accumulators (pydantic attribute writes are too slow for a per-node loop)."""

    def __init__(self) -> None:
        self.nodes = 0
        self.total_gpus = 0
        self.gpus_per_node = 0
        self.gpu_memory_mib = 0
        self.unavailable_gpus = 0
        self.free_gpus = 0
        self.shared_free_milli = 0
        self.by_free = [0] * 9
        self.racks: dict[str, list[int]] = {}
        self.nvlink_block = 0
        self.domains: dict[str, int] = {}  # multi-node NVLink domain -> whole free GPUs
        self.max_cpu = 0
        self.max_memory = 0
        self.mig: dict[str, list[int]] = {}  # profile -> [total, free, nodes by free...]

    def _add_mig(self, node: model.Node) -> None:
        for profile, count in node.mig.items():
            totals = self.mig.setdefault(profile, [0, 0])
            totals[0] += count
            if not node.available:
                continue
            free = len(node.mig_free.get(profile, ()))
            totals[1] += free
            while len(totals) <= free + 2:
                totals.append(0)
            totals[free + 2] += 1

    def add(self, node: model.Node) -> None:
        # a summary every 50 ms over every node: counts of the list's C methods, not a Python
        # loop per GPU
        if node.mig:
            self._add_mig(node)
        count = node.gpu_count
        self.nodes += 1
        self.total_gpus += count
        self.gpus_per_node = max(self.gpus_per_node, count)
        self.gpu_memory_mib = max(self.gpu_memory_mib, node.gpu_memory_mib)
        if not (node.ready and node.schedulable):
            self.unavailable_gpus += count
            return
        if node.unhealthy:
            self.unavailable_gpus += node.unhealthy_gpus
        free = node.gpu_free
        whole, shared = whole_and_shared(free)
        self.shared_free_milli += shared
        self.free_gpus += whole
        while len(self.by_free) <= whole:
            self.by_free.append(0)
        self.by_free[whole] += 1
        if node.rack:
            histogram = self.racks.get(node.rack)
            if histogram is None:
                histogram = self.racks[node.rack] = [0] * 9
            while len(histogram) <= whole:
                histogram.append(0)
            histogram[whole] += 1
        self.nvlink_block = max(self.nvlink_block, nvlink_block(node, whole))
        if node.nvlink_domain:
            self.domains[node.nvlink_domain] = self.domains.get(node.nvlink_domain, 0) + whole
        self.max_cpu = max(self.max_cpu, node.cpu_free)
        self.max_memory = max(self.max_memory, node.memory_free)

    def build(self, name: str) -> ModelSummary:
        width = self.gpus_per_node + 1  # nodes_by_free[k] for k = 0..GPUs per node
        return ModelSummary(
            model=name,
            gpu_memory_mib=self.gpu_memory_mib,
            gpus_per_node=self.gpus_per_node,
            nodes=self.nodes,
            total_gpus=self.total_gpus,
            free_gpus=self.free_gpus,
            unavailable_gpus=self.unavailable_gpus,
            nodes_by_free=self.by_free[:width],
            shared_free_milli=self.shared_free_milli,
            largest_free_nvlink_block=max([self.nvlink_block, *self.domains.values()]),
            racks={rack: histogram[:width] for rack, histogram in sorted(self.racks.items())},
            max_free_cpu_milli=self.max_cpu,
            max_free_memory_mib=self.max_memory,
            mig={
                profile: MIGSummary(total=t[0], free=t[1], nodes_by_free=t[2:])
                for profile, t in sorted(self.mig.items())
            }
            or None,
        )


def whole_and_shared(free: list[int]) -> tuple[int, int]:
    """GPUs wholly free, and the free milli of the others (each GPU's free milli is at most
    GPU_MILLI: checked, and counted one by one if not)."""
    whole = free.count(model.GPU_MILLI)
    if free and max(free) > model.GPU_MILLI:
        whole = sum(1 for milli in free if milli >= model.GPU_MILLI)
        return whole, sum(milli for milli in free if milli < model.GPU_MILLI)
    return whole, sum(free) - whole * model.GPU_MILLI


def nvlink_block(node: model.Node, whole: int) -> int:
    """Most wholly free GPUs inside one NVLink island of the node (GPU i is in island
    i // size, as `Node.island_of`); without NVLink, 1 if a GPU is wholly free (`whole` of
    them are)."""
    island, free = node.nvlink_island, node.gpu_free
    if island <= 1:
        return 1 if whole else 0
    if island >= len(free):
        return whole
    return max(
        whole_and_shared(free[start : start + island])[0] for start in range(0, len(free), island)
    )


_WORKLOAD: list[fragmentation.Workload] = []


def default_workload() -> fragmentation.Workload:
    if not _WORKLOAD:
        _WORKLOAD.append(fragmentation.default_workload())
    return _WORKLOAD[0]
