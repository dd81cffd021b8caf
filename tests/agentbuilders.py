"""Builders for the agent's tests: a small simulated cluster, jobs and offers as the broker
sends them; nodes, inventories, pod shapes and gang requests for placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.api import gangs, jobs, messages
from member_agent.cluster.simulated import backend as simulated
from member_agent.inventory import model

H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# two 8-GPU H100 nodes in one rack, one 4-GPU L4 node
SMALL_CLUSTER = f"""
cluster: small
pools:
  - name: h100
    count: 2
    gpu_product: {H100}
    gpus_per_node: 8
    gpu_memory_mib: 81559
    cpu: 200
    memory: 2Ti
    nvlink_island: 8
    racks: 1
  - name: l4
    count: 1
    gpu_product: {L4}
    gpus_per_node: 4
    gpu_memory_mib: 23034
    cpu: 64
    memory: 256Gi
    racks: 1
"""


def write_cluster(directory: Path, text: str = SMALL_CLUSTER) -> Path:
    path = directory / "cluster.yaml"
    path.write_text(text)
    return path


def small_backend(directory: Path, *, start_delay: float = 0.01) -> simulated.SimulatedBackend:
    return simulated.SimulatedBackend(
        "small", simulated.load_pools(write_cluster(directory)), start_delay=start_delay
    )


def make_job(
    name: str = "train",
    *,
    gpus: int = 8,
    replicas: int = 1,
    namespace: str = "default",
    model: str | None = None,
    duration: float | None = None,
    outcome: str | None = None,
    min_member: int | None = None,
    cpu: str | None = None,
    cluster_lost: str | None = None,
    annotations: dict[str, str] | None = None,
) -> jobs.GPUJob:
    annotations = dict(annotations or {})
    if duration is not None:
        annotations[jobs.SIM_DURATION_ANNOTATION] = str(duration)
    if outcome is not None:
        annotations[jobs.SIM_OUTCOME_ANNOTATION] = outcome
    resources: dict[str, Any] = {"limits": {jobs.GPU_RESOURCE: gpus}}
    if cpu is not None:
        resources["requests"] = {"cpu": cpu}
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "x", "resources": resources}]}
    if model is not None:
        spec["nodeSelector"] = {jobs.GPU_PRODUCT_LABEL: model}
    return jobs.GPUJob.model_validate(
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "queue": "research",
                "gang": {"minMember": min_member} if min_member else {},
                **({"failurePolicy": {"clusterLost": cluster_lost}} if cluster_lost else {}),
                "tasks": [
                    {
                        "name": "worker",
                        "replicas": replicas,
                        "template": {
                            "metadata": {"labels": {"app": name}, "annotations": annotations},
                            "spec": spec,
                        },
                    }
                ],
            },
        }
    )


def make_offer(
    job_id: str, job: jobs.GPUJob, *, epoch: int = 1, attempt: int = 1
) -> messages.Offer:
    return messages.Offer(
        job_id=job_id,
        epoch=epoch,
        tenant="team",
        job=job,
        traceparent=TRACEPARENT,
        attempt=attempt,
    )


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
