"""Builders for the broker's tests: `make_job(gpus=8).gang(4).build()`, the job as the planner
sees it queued (`.pending("j1")`), `make_summary(...)`."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from broker.api import clusterchoice, gangs, inventory, jobs
from broker.planning import snapshot

T0 = datetime(2026, 1, 1, tzinfo=UTC)  # when a pending job was created, unless told


class JobBuilder:
    def __init__(self, name: str = "job", *, gpus: int = 1, queue: str = "default") -> None:
        self.doc: dict[str, Any] = {
            "apiVersion": "gpufed.io/v1",
            "kind": "GPUJob",
            "metadata": {"name": name},
            "spec": {"queue": queue, "tasks": []},
        }
        self._task: dict[str, Any] = self._new_task("worker", gpus)
        self.doc["spec"]["tasks"].append(self._task)

    @staticmethod
    def _new_task(name: str, gpus: int) -> dict[str, Any]:
        limits: dict[str, Any] = {"nvidia.com/gpu": gpus} if gpus else {}
        return {
            "name": name,
            "replicas": 1,
            "template": {
                "metadata": {"annotations": {}},
                "spec": {
                    "containers": [
                        {"name": "main", "image": "busybox", "resources": {"limits": limits}}
                    ]
                },
            },
        }

    def gang(self, replicas: int) -> JobBuilder:
        self._task["replicas"] = replicas
        return self

    def model(self, *models: str) -> JobBuilder:
        spec = self._task["template"]["spec"]
        spec.update(jobs.model_selector(models))
        return self

    def node_affinity(self, *terms: list[dict[str, Any]]) -> JobBuilder:
        """Required node affinity of the current task: terms (ORed) of `expr`s (ANDed)."""
        required = {"nodeSelectorTerms": [{"matchExpressions": list(term)} for term in terms]}
        self._task["template"]["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
        }
        return self

    def node_selector(self, labels: dict[str, str]) -> JobBuilder:
        self._task["template"]["spec"]["nodeSelector"] = dict(labels)
        return self

    def duration(self, seconds: float) -> JobBuilder:
        return self.annotate(jobs.SIM_DURATION_ANNOTATION, str(seconds))

    def outcome(self, text: str) -> JobBuilder:
        return self.annotate(jobs.SIM_OUTCOME_ANNOTATION, text)

    def annotate(self, key: str, value: str) -> JobBuilder:
        self._task["template"]["metadata"]["annotations"][key] = value
        return self

    def shared(self, milli: int) -> JobBuilder:
        return self.annotate(jobs.GPU_MILLI_ANNOTATION, str(milli))

    def priority(self, value: int) -> JobBuilder:
        self.doc["spec"]["priority"] = value
        return self

    def topology(self, *, nvlink: str = "none", rack: str = "none") -> JobBuilder:
        self.doc["spec"]["topology"] = {"nvlink": nvlink, "rack": rack}
        return self

    def cluster_lost(self, policy: str) -> JobBuilder:
        """`spec.failurePolicy.clusterLost`: requeue or wait."""
        self.doc["spec"].setdefault("failurePolicy", {})["clusterLost"] = policy
        return self

    def failure_policy(self, **fields: Any) -> JobBuilder:
        """More of `spec.failurePolicy`, as the API spells it (backoffLimit=1, retryOn=[...])."""
        self.doc["spec"].setdefault("failurePolicy", {}).update(fields)
        return self

    def preemption(self, grace_seconds: int) -> JobBuilder:
        """`spec.preemption.gracePeriodSeconds`."""
        self.doc["spec"]["preemption"] = {"gracePeriodSeconds": grace_seconds}
        return self

    def clusters(self, **fields: Any) -> JobBuilder:
        """`spec.clusters`, as the API spells it (selector={"matchLabels": {...}}, order=[...])."""
        self.doc["spec"].setdefault("clusters", {}).update(fields)
        return self

    def ttl_after_finished(self, seconds: int) -> JobBuilder:
        self.doc["spec"]["ttlSecondsAfterFinished"] = seconds
        return self

    def priority_class(self, name: str) -> JobBuilder:
        self.doc["spec"]["priorityClass"] = name
        return self

    def min_member(self, count: int) -> JobBuilder:
        self.doc["spec"]["gang"] = {"minMember": count}
        return self

    def task(self, name: str, *, gpus: int, replicas: int = 1) -> JobBuilder:
        self._task = self._new_task(name, gpus)
        self._task["replicas"] = replicas
        self.doc["spec"]["tasks"].append(self._task)
        return self

    def document(self) -> dict[str, Any]:
        return copy.deepcopy(self.doc)

    def build(self) -> jobs.GPUJob:
        return jobs.GPUJob.model_validate(self.document())

    def request(self, job_id: str | None = None) -> gangs.GangRequest:
        return gangs.gang_request(job_id or self.doc["metadata"]["name"], self.build())

    def pending(
        self,
        job_id: str | None = None,
        *,
        created: datetime = T0,
        queued_since: datetime | None = None,
        excluded: Iterable[str] = (),
        array: snapshot.ArrayLimit | None = None,
    ) -> snapshot.PendingJob:
        """The job queued, as the planner sees it: its queue, priority (and class), its
        `spec.clusters` and its gang request as the job says."""
        job_id = job_id or self.doc["metadata"]["name"]
        job = self.build()
        return snapshot.PendingJob(
            job_id=job_id,
            queue=job.spec.queue,
            priority=job.spec.priority,
            created=created,
            request=self.request(job_id),
            excluded=frozenset(excluded),
            priority_class=job.spec.priority_class,
            queued_since=queued_since,
            clusters=clusterchoice.choice_of(job.spec.clusters),
            array=array,
        )


def make_job(name: str = "job", *, gpus: int = 1, queue: str = "default") -> JobBuilder:
    return JobBuilder(name, gpus=gpus, queue=queue)


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    """One node affinity `matchExpressions` entry (no values: none given)."""
    out: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        out["values"] = list(values)
    return out


def make_model_summary(
    model: str,
    *,
    nodes_by_free: list[int],
    gpus_per_node: int = 8,
    gpu_memory_mib: int = 81920,
    racks: dict[str, list[int]] | None = None,
    nvlink_block: int | None = None,
    shared_free_milli: int = 0,
) -> inventory.ModelSummary:
    nodes = sum(nodes_by_free)
    free = sum(k * n for k, n in enumerate(nodes_by_free))
    return inventory.ModelSummary(
        model=model,
        gpu_memory_mib=gpu_memory_mib,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        total_gpus=nodes * gpus_per_node,
        free_gpus=free,
        nodes_by_free=nodes_by_free,
        shared_free_milli=shared_free_milli,
        largest_free_nvlink_block=nvlink_block
        if nvlink_block is not None
        else max((k for k, n in enumerate(nodes_by_free) if n), default=0),
        racks=racks or {},
    )


def make_summary(
    cluster: str, *models: inventory.ModelSummary, seq: int = 1
) -> inventory.ClusterSummary:
    return inventory.ClusterSummary(cluster=cluster, seq=seq, models=list(models))
