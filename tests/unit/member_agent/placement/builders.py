"""Small inventories and gang requests for the placement tests."""

from __future__ import annotations

from broker.api import gangs, jobs
from member_agent.inventory import model


def node(
    name: str,
    *,
    gpus: int = 8,
    model_name: str = "H100",
    used: dict[int, int] | None = None,
    cpu: int = 96_000,
    memory: int = 512_000,
    cpu_free: int = -1,
    memory_free: int = -1,
    gpu_memory: int = 80_000,
    rack: str = "",
    domain: str = "",
    island: int = 0,
    ready: bool = True,
    labels: dict[str, str] | None = None,
) -> model.Node:
    """A node whose GPU i has `used[i]` milli taken."""
    free = [model.GPU_MILLI] * gpus
    for index, milli in (used or {}).items():
        free[index] -= milli
    return model.Node(
        name=name,
        model=model_name,
        gpu_count=gpus,
        gpu_memory_mib=gpu_memory,
        cpu_milli=cpu,
        memory_mib=memory,
        rack=rack,
        nvlink_domain=domain,
        nvlink_island=island,
        ready=ready,
        labels=dict(labels or {}),
        gpu_free=free,
        cpu_free=cpu_free,
        memory_free=memory_free,
    )


def inventory(*nodes: model.Node) -> model.Inventory:
    inv = model.Inventory(cluster="test")
    for item in nodes:
        inv.add(item)
    return inv


def shape(
    gpus: int = 1,
    *,
    milli: int = 1000,
    models: tuple[str, ...] = (),
    cpu: int = 1000,
    memory: int = 1000,
    gpu_memory: int = 0,
) -> jobs.PodShape:
    return jobs.PodShape(
        gpus=gpus,
        gpu_milli=milli if gpus else 0,
        models=models,
        cpu_milli=cpu,
        memory_mib=memory,
        min_gpu_memory_mib=gpu_memory,
    )


def gang(
    pod_shape: jobs.PodShape,
    pods: int = 1,
    *,
    min_member: int | None = None,
    nvlink: str = "none",
    rack: str = "none",
    job_id: str = "job",
) -> gangs.GangRequest:
    return gangs.GangRequest(
        job_id=job_id,
        tasks=(("w", pods, pod_shape),),
        min_member=min_member if min_member is not None else pods,
        topology=jobs.Topology(nvlink=jobs.TopologyMode(nvlink), rack=jobs.TopologyMode(rack)),
    )
