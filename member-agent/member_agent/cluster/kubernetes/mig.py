"""MIG devices as the Kubernetes backend reads and writes them. Pure functions on JSON dicts.

Device-plugin mode (NVIDIA's `mixed` strategy): a node's MIG devices are every
`nvidia.com/mig-<profile>` of its `allocatable` (`read_allocatable`, names read, not
hard-coded), `model.Node.mig`. A MIG pod of gpufed's requests `nvidia.com/mig-<profile>: N` in
place of `nvidia.com/gpu` (`requesting`: what the pod template asked as `nvidia.com/gpu` under
`gpufed.io/mig-profile`), and carries the devices placement counted for it in the annotation
`gpufed.io/mig` (`<profile>=<i>,<j>`: bookkeeping, as `gpufed.io/gpus` is; the kubelet picks
the devices). Another workload's pod requesting `nvidia.com/mig-<profile>` holds that many of
the node's devices of the profile, counted from the top (`slots_for`).

DRA mode (`devices`): the devices are the driver's ResourceSlices' MIG devices; a
MIG pod's claim is allocated to exactly the ones placement chose (`claims`), and the
annotation names them by their index among the node's devices of that profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.api import jobs, mig
from member_agent.inventory import model

MIG_ANNOTATION = "gpufed.io/mig"

Slots = Mapping[str, tuple[int, ...]]


def read_allocatable(allocatable: Mapping[str, Any]) -> dict[str, int]:
    """A node's MIG devices by profile, from its allocatable `nvidia.com/mig-<profile>`."""
    out = {}
    for resource, qty in allocatable.items():
        profile = mig.profile_of(str(resource))
        if profile:
            count = _count(qty)
            if count > 0:
                out[profile] = count
    return out


def requested(requests: Mapping[str, int]) -> dict[str, int]:
    """The MIG devices by profile among a pod's effective requests."""
    return {p: n for r, n in requests.items() if (p := mig.profile_of(r)) and n > 0}


def format_slots(slots: Slots) -> str:
    return ";".join(f"{p}={','.join(map(str, slots[p]))}" for p in sorted(slots) if slots[p])


def parse_slots(text: str) -> dict[str, tuple[int, ...]]:
    """The annotation read back; what does not parse is left out."""
    out: dict[str, tuple[int, ...]] = {}
    for part in text.split(";"):
        profile, _, indices = part.strip().partition("=")
        found = tuple(int(i) for i in indices.split(",") if i.strip().isdigit())
        if profile and found and mig.profile_problem(profile) is None:
            out[profile] = found
    return out


def requesting(spec: dict[str, Any], slots: Slots) -> dict[str, Any]:
    """The pod spec asking the device plugin for its MIG devices: every container's
    `nvidia.com/gpu` asked as `nvidia.com/mig-<profile>` (one profile per pod)."""
    if len(slots) != 1:
        return spec
    return ask_as(spec, mig.resource_of(next(iter(slots))))


def ask_as(spec: dict[str, Any], resource: str) -> dict[str, Any]:
    """The spec with every container's `nvidia.com/gpu` asked as `resource` instead (a MIG
    device, the device plugin's shared replicas), its limits and requests alike."""
    out = dict(spec)
    for kind in ("initContainers", "containers"):
        if kind not in spec:
            continue
        containers = []
        for raw in spec.get(kind) or []:
            container = dict(raw)
            res = dict(container.get("resources") or {})
            for part in ("limits", "requests"):
                quantities = dict(res.get(part) or {})
                if jobs.GPU_RESOURCE in quantities:
                    quantities[resource] = quantities.pop(jobs.GPU_RESOURCE)
                    res[part] = quantities
            if res:
                container["resources"] = res
            containers.append(container)
        out[kind] = containers
    return out


def slots_for(
    node: model.Node, wanted: Mapping[str, int], chosen: Slots
) -> dict[str, tuple[int, ...]]:
    """The devices a pod holds on the node: those placement chose (`chosen`) while they are
    free, else as many as it asks of the free ones, from the top (another workload's pod: the
    device plugin chose, only the count is known)."""
    out: dict[str, tuple[int, ...]] = {}
    for profile, count in wanted.items():
        free = node.mig_free.get(profile, ())
        mine = chosen.get(profile, ())
        if mine and len(mine) == count and set(mine) <= set(free):
            out[profile] = tuple(mine)
        elif free:
            out[profile] = tuple(sorted(free[-count:]))
    return out


def fit_problem(node: model.Node, name: str, wanted: Mapping[str, int]) -> str:
    """Why a pod asking these MIG devices does not fit the node now ("" when it does)."""
    for profile, count in sorted(wanted.items()):
        free = len(node.mig_free.get(profile, ()))
        if free < count:
            return (
                f"node {node.name} has {free} MIG devices of {profile} free for {name}, "
                f"needs {count}"
            )
    return ""


def _count(value: Any) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        return 0
