"""Why a gang does not fit: short, sorted, human-readable reasons. Pure.

Called by `gang.place_gang` only after every topology group failed; the reasons go back to
the broker in a rejection and to the user through `gpufed why`. It walks the filters in the
order a user thinks of them (ready nodes, GPU model, node affinity, GPU sharing, GPU memory,
GPUs or MIG devices, CPU, memory) and names the first one that leaves too few nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from member_agent.inventory import model
from member_agent.placement import filtering, indexing


def explain(
    free_index: indexing.FreeIndex,
    demands: Sequence[filtering.Demand],
    *,
    min_member: int,
    groups: Sequence[str] = (),
) -> tuple[str, ...]:
    reasons: set[str] = set()
    entries = list(free_index.entries.values())
    ready = [entry for entry in entries if entry.available]
    if not ready:
        reasons.add(f"nodes: none of {len(entries)} is ready and schedulable")
        return tuple(sorted(reasons))
    present = sorted({entry.model for entry in ready if entry.gpu_count})
    need_all = min(min_member, len(demands))
    for demand, count in Counter(demands).items():
        need = count if need_all == len(demands) else max(1, need_all - (len(demands) - count))
        reason = _explain_one(ready, demand, need=need, present=present)
        if reason:
            reasons.add(reason)
    if not reasons:
        if groups:
            reasons.add(
                f"topology: no single group holds the whole gang (tried {len(groups)}: "
                f"{', '.join(groups[:3])}{', ...' if len(groups) > 3 else ''})"
            )
        else:
            reasons.add(
                f"gang: {len(demands)} pods do not fit together (GPUs, CPU and memory combined)"
            )
    return tuple(sorted(reasons))


def _explain_one(
    ready: Sequence[indexing.Entry],
    demand: filtering.Demand,
    *,
    need: int,
    present: Sequence[str],
) -> str:
    """Why `need` pods of `demand` do not fit the ready nodes ("" when they do): first what
    no node is built for, then what no node has free."""
    nodes, reason = _nodes_built_for(ready, demand, present=present)
    return reason or _explain_room(nodes, demand, need=need)


def _nodes_built_for(
    ready: Sequence[indexing.Entry], demand: filtering.Demand, *, present: Sequence[str]
) -> tuple[list[indexing.Entry], str]:
    """The nodes whose GPU model, GPU memory, GPU count and NVLink could take the pod, or
    none and the first of these that rules every node out."""
    nodes = list(ready)
    if demand.gpus:
        nodes = [entry for entry in nodes if entry.gpu_count]
    if demand.models:
        nodes = [entry for entry in nodes if entry.model in demand.models]
        if not nodes:
            return [], (
                f"gpu model: no node of model {'|'.join(demand.models)} "
                f"(cluster has {', '.join(present) or 'no GPUs'})"
            )
    selector = demand.selector
    if selector is not None:
        nodes = [entry for entry in nodes if selector.matches(entry.labels, entry.name)]
        if not nodes:
            return [], (
                f"node affinity: no ready node{' with GPUs' if demand.gpus else ''} matches "
                f"{selector.describe()} (cluster has {', '.join(present) or 'no GPUs'})"
            )
    if nodes and demand.gpus:
        shareable = [entry for entry in nodes if filtering.sharing_allowed(entry, demand)]
        if not shareable:
            return [], _sharing_reason(nodes, demand)
        nodes = shareable
    if demand.min_gpu_memory_mib:
        largest = max((entry.gpu_memory_mib for entry in nodes), default=0)
        nodes = [entry for entry in nodes if entry.gpu_memory_mib >= demand.min_gpu_memory_mib]
        if not nodes:
            return [], (
                f"gpu memory: no node with {demand.min_gpu_memory_mib} MiB per GPU "
                f"(largest {largest} MiB)"
            )
    if demand.mig_slices:
        return _nodes_with_mig(nodes, demand)
    most = max((entry.gpu_count for entry in nodes), default=0)
    if demand.gpus and most < demand.gpus:
        return [], f"gpus: no node has {demand.gpus} GPUs (largest has {most})"
    if demand.nvlink and max((entry.island for entry in nodes), default=1) < demand.gpus:
        return [], f"nvlink: no node has an NVLink island of {demand.gpus} GPUs"
    return nodes, ""


def _nodes_with_mig(
    nodes: Sequence[indexing.Entry], demand: filtering.Demand
) -> tuple[list[indexing.Entry], str]:
    """The nodes with enough MIG devices of the pod's profile (free or not), or why none."""
    profile = demand.mig_profile
    having = [entry for entry in nodes if entry.mig.get(profile, 0)]
    if not having:
        present = sorted({p for entry in nodes for p, n in entry.mig.items() if n})
        return [], (
            f"mig: no ready node has MIG devices of profile {profile} "
            f"(cluster has {', '.join(present) or 'no MIG devices'})"
        )
    most = max(entry.mig[profile] for entry in having)
    if most < demand.mig_slices:
        return (
            [],
            f"mig: no node has {demand.mig_slices} MIG devices of {profile} (largest has {most})",
        )
    return [entry for entry in having if entry.mig[profile] >= demand.mig_slices], ""


def _sharing_reason(nodes: Sequence[indexing.Entry], demand: filtering.Demand) -> str:
    """Why no node can hand out its GPUs the way the pod asks (`filtering.sharing_allowed`)."""
    named = (entry.labels.get(model.SHARED_RESOURCE_LABEL, "") for entry in nodes)
    resource = next((name for name in named if name), "") or "a shared GPU resource"
    if demand.sharing:
        return (
            f"gpu sharing: no ready GPU node advertises {resource} (the device plugin's "
            f"shared GPU replicas): a pod of {demand.describe()} would be handed a whole GPU"
        )
    return (
        f"gpu sharing: the ready GPU nodes offer their GPUs only as {resource} replicas, "
        f"none whole for a pod of {demand.describe()}"
    )


def _explain_room(nodes: Sequence[indexing.Entry], demand: filtering.Demand, *, need: int) -> str:
    """Why the nodes built for the pod have no room for `need` of it ("" when they do)."""
    shape = demand.describe()
    with_gpus = [
        entry
        for entry in nodes
        if filtering.fits_gpus(entry, demand)
        and filtering.mig_free(entry, demand) >= demand.mig_slices
    ]
    with_cpu = [entry for entry in with_gpus if entry.cpu_free >= demand.cpu_milli]
    with_mem = [entry for entry in with_cpu if entry.mem_free >= demand.memory_mib]
    room = sum(_pods_fitting(entry, demand) for entry in with_mem)
    if room >= need:
        return ""
    plural = "s" if need > 1 else ""
    if len(with_gpus) < need and demand.mig_slices:
        return (
            f"gang: {need} pod{plural} × {shape} need {need} node{plural} with "
            f"{demand.mig_slices} {demand.mig_profile} free, {len(with_gpus)} "
            f"{'has' if len(with_gpus) == 1 else 'have'}"
        )
    if len(with_gpus) < need and demand.gpus:
        if demand.sharing:
            largest = max((entry.max_free for entry in nodes), default=0)
            return (
                f"gang: {need} pod{plural} × {shape} need a GPU with {demand.gpu_milli} milli "
                f"free each, {room} fit (largest free {largest} milli)"
            )
        return (
            f"gang: {need} pod{plural} × {shape} need {need} node{plural} with "
            f"{demand.gpus} free, {len(with_gpus)} {'has' if len(with_gpus) == 1 else 'have'}"
        )
    if len(with_cpu) < len(with_gpus) and len(with_cpu) < need:
        return (
            f"cpu: {len(with_gpus)} node(s) have the GPUs for {shape}, {len(with_cpu)} also "
            f"have {demand.cpu_milli} milli-CPU free ({need} needed)"
        )
    if len(with_mem) < need:
        return (
            f"memory: {len(with_cpu)} node(s) have GPUs and CPU for {shape}, {len(with_mem)} "
            f"also have {demand.memory_mib} MiB free ({need} needed)"
        )
    return f"gang: {need} pod{plural} × {shape} need room for {need}, the nodes hold {room}"


def _pods_fitting(entry: indexing.Entry, demand: filtering.Demand) -> int:
    """How many pods of `demand` the node could hold on its own."""
    counts = []
    if demand.cpu_milli:
        counts.append(entry.cpu_free // demand.cpu_milli)
    if demand.memory_mib:
        counts.append(entry.mem_free // demand.memory_mib)
    if demand.mig_slices:
        counts.append(filtering.mig_free(entry, demand) // demand.mig_slices)
    if demand.gpus and not demand.sharing:
        per = filtering.largest_island_block(entry) if demand.nvlink else entry.whole
        counts.append(per // demand.gpus)
    elif demand.sharing:
        counts.append(sum(free // demand.gpu_milli for free in entry.gpu_free))
    return min(counts) if counts else 1
