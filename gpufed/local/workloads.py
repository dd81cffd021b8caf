"""The demo's mixed workload: training gangs, inference and dev jobs, with expected outcomes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from broker.api import jobs

H100 = "NVIDIA-H100-80GB-HBM3"
A100_SXM = "NVIDIA-A100-SXM4-80GB"
A100_PCIE = "NVIDIA-A100-PCIE-40GB"
L4 = "NVIDIA-L4"
T4 = "Tesla-T4"


@dataclass(frozen=True)
class DemoJob:
    kind: str  # training | inference | dev
    tenant: str
    document: dict[str, Any]
    expected: str  # final state: Succeeded | Failed | Cancelled
    cancel_when_running: bool = False

    @property
    def gpus(self) -> int:
        total = 0
        for task in self.document["spec"]["tasks"]:
            limits = task["template"]["spec"]["containers"][0]["resources"]["limits"]
            total += task["replicas"] * int(limits.get("nvidia.com/gpu", 0))
        return total


def _job(
    name: str,
    queue: str,
    *,
    gpus: int,
    replicas: int = 1,
    models: tuple[str, ...] = (),
    seconds: float | None = None,
    annotations: dict[str, str] | None = None,
    topology: dict[str, str] | None = None,
    priority: int = 0,
) -> dict[str, Any]:
    notes = dict(annotations or {})
    if seconds is not None:
        notes["gpufed.io/sim-duration"] = f"{seconds:.1f}"
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "nvcr.io/nvidia/pytorch:24.10-py3",
                "resources": {"limits": {"nvidia.com/gpu": gpus, "cpu": "8", "memory": "64Gi"}},
            }
        ]
    }
    pod_spec.update(jobs.model_selector(models))
    spec: dict[str, Any] = {
        "queue": queue,
        "priority": priority,
        "tasks": [
            {
                "name": "worker",
                "replicas": replicas,
                "template": {"metadata": {"annotations": notes}, "spec": pod_spec},
            }
        ],
    }
    if topology:
        spec["topology"] = topology
    return {
        "apiVersion": "gpufed.io/v1",
        "kind": "GPUJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def build(count: int = 72, *, seed: int = 7) -> list[DemoJob]:
    """About 1/6 training gangs, 1/3 inference, the rest dev jobs; a few fail or are cancelled."""
    rng = random.Random(seed)
    out: list[DemoJob] = []
    n_train = max(2, count // 6)
    n_infer = max(2, count // 3)
    n_dev = max(2, count - n_train - n_infer)
    for i in range(n_train):
        if i % 3 == 2:
            doc = _job(
                f"train-a100-{i}",
                "research",
                gpus=rng.choice([4, 8]),
                replicas=rng.choice([2, 4]),
                models=(A100_SXM,),
                seconds=rng.uniform(3, 7),
                topology={"nvlink": "required"},
            )
        else:
            rack = "required" if i % 4 == 0 else "preferred"
            doc = _job(
                f"train-h100-{i}",
                "research",
                gpus=8,
                replicas=rng.choice([2, 3, 4]),
                models=(H100,),
                seconds=rng.uniform(3, 8),
                priority=10,
                topology={"nvlink": "required", "rack": rack},
            )
        out.append(DemoJob("training", "ml-research", doc, "Succeeded"))
    for i in range(n_infer):
        cancel = i < 3
        shared = {"gpufed.io/gpu-milli": "500"} if i % 4 == 1 else {}
        doc = _job(
            f"serve-{i}",
            "inference",
            gpus=1,
            models=(L4, T4),
            seconds=None if cancel else rng.uniform(2, 6),
            annotations=shared,
        )
        out.append(
            DemoJob(
                "inference",
                "serving",
                doc,
                "Cancelled" if cancel else "Succeeded",
                cancel_when_running=cancel,
            )
        )
    for i in range(n_dev):
        fail = i < 3
        notes = {"gpufed.io/sim-outcome": "Failed:OOMKilled"} if fail else {}
        doc = _job(
            f"dev-{i}",
            "dev",
            gpus=rng.choice([1, 1, 2, 4]),
            seconds=rng.uniform(1, 4),
            annotations=notes,
        )
        out.append(DemoJob("dev", "ml-research", doc, "Failed" if fail else "Succeeded"))
    rng.shuffle(out)
    return out
