"""Builders for the agent's tests: small clusters, jobs and offers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.api import jobs, messages
from member_agent.cluster.simulated import backend as simulated

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
