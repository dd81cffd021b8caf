"""Place a whole gang on an inventory snapshot: every pod or none. Pure.

Called by the agent (binding an offer), by `gpufed simulate` and by the benchmarks. The result
is a value: a GangPlacement, or Unplaceable with sorted reasons; the inventory is not changed
(the caller applies the placement when it commits to it).

This first version is a first-fit; `placement/` grows scoring policies behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.api import jobs, status
from member_agent.inventory import model


@dataclass(frozen=True)
class Unplaceable:
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class PlacedPod:
    placement: status.PodPlacement
    shape: jobs.PodShape


@dataclass(frozen=True)
class GangPlacement:
    pods: tuple[PlacedPod, ...]


def _fits(node: model.Node, shape: jobs.PodShape) -> list[status.GPUSlot] | None:
    if not node.available:
        return None
    if shape.models and node.model not in shape.models:
        return None
    if shape.min_gpu_memory_mib and node.gpu_memory_mib < shape.min_gpu_memory_mib:
        return None
    if node.cpu_free < shape.cpu_milli or node.memory_free < shape.memory_mib:
        return None
    if shape.gpus == 0:
        return []
    if shape.gpu_milli < model.GPU_MILLI:
        for index, free in enumerate(node.gpu_free):
            if free >= shape.gpu_milli:
                return [status.GPUSlot(index=index, milli=shape.gpu_milli)]
        return None
    whole = [i for i, free in enumerate(node.gpu_free) if free == model.GPU_MILLI]
    if len(whole) < shape.gpus:
        return None
    return [status.GPUSlot(index=i) for i in whole[: shape.gpus]]


def place_gang(
    inventory: model.Inventory, request: jobs.GangRequest, *, policy: str = "default"
) -> GangPlacement | Unplaceable:
    """Choose node and GPUs for every pod of `request`, or say why it cannot be done."""
    del policy
    scratch: dict[str, model.Node] = {}
    placed: list[PlacedPod] = []
    for pod_name, task, shape in request.pod_names():
        chosen = None
        for node in inventory:
            view = scratch.get(node.name, node)
            slots = _fits(view, shape)
            if slots is not None:
                chosen = (view, slots)
                break
        if chosen is None:
            return Unplaceable(reasons=(f"pod {pod_name}: no node has room for {shape}",))
        view, slots = chosen
        if view.name not in scratch:
            view = model.Node(**{**view.__dict__, "gpu_free": list(view.gpu_free)})
            scratch[view.name] = view
        for slot in slots:
            view.gpu_free[slot.index] -= slot.milli
        view.cpu_free -= shape.cpu_milli
        view.memory_free -= shape.memory_mib
        placed.append(
            PlacedPod(
                placement=status.PodPlacement(name=pod_name, task=task, node=view.name, gpus=slots),
                shape=shape,
            )
        )
    return GangPlacement(pods=tuple(placed))
