"""A tiny fleet for planner tests: nodes with free GPUs, running jobs with pods on them.

It turns node state into the summaries the planner sees, applies a plan's assignments
(best fit, as the agent does) and preemptions, and ends jobs, so that tests can run the pure
planner over several cycles without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from broker.api import queues as api
from broker.planning import planning, snapshot
from tests.builders import T0, JobBuilder, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
T4 = "Tesla-T4"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def queue(name: str, *, tenant: str | None = None, **fields: Any) -> api.Queue:
    """queue("a", quotas={H100: (8, 16)}, weight=2): quotas are (guaranteed, limit)."""
    quotas = {
        model: {"guaranteed": g, "limit": limit}
        for model, (g, limit) in fields.pop("quotas", {"*": (0, None)}).items()
    }
    return api.Queue.model_validate(
        {"name": name, "tenant": tenant or name, "quotas": quotas, **fields}
    )


def config(
    *queues: api.Queue, classes: Sequence[api.PriorityClass] = (), **policy: Any
) -> api.QueuesConfig:
    return api.QueuesConfig(
        policy=api.Policy.model_validate(policy),
        priority_classes=list(classes),
        queues=list(queues),
    )


def pending(
    builder: JobBuilder, job_id: str, *, at_s: float = 0.0, queued_s: float | None = None
) -> snapshot.PendingJob:
    queued_since = at(queued_s) if queued_s is not None else None
    return builder.pending(job_id, created=at(at_s), queued_since=queued_since)


@dataclass
class Running:
    job_id: str
    queue: str
    cluster: str
    pods: list[tuple[str, int]]
    started: datetime
    priority: int = 0
    model: str = H100
    ends: float | None = None  # simulated end, in seconds from T0
    checkpointed: datetime | None = None  # its workload's last checkpoint

    def view(self) -> snapshot.RunningJob:
        return snapshot.RunningJob(
            job_id=self.job_id,
            queue=self.queue,
            priority=self.priority,
            cluster=self.cluster,
            gpus={self.model: sum(g for _, g in self.pods)},
            pods=tuple(snapshot.PodSlot(node, g) for node, g in self.pods),
            started=self.started,
            checkpointed=self.checkpointed,
        )


@dataclass
class Cluster:
    name: str
    nodes: int = 2
    gpus: int = 8
    model: str = H100
    free: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # what spec.clusters selects on

    def __post_init__(self) -> None:
        self.free = {f"{self.name}-n{i}": self.gpus for i in range(self.nodes)}

    def summary(self) -> Any:
        hist = [0] * (self.gpus + 1)
        for count in self.free.values():
            hist[count] += 1
        summary = make_summary(
            self.name, make_model_summary(self.model, nodes_by_free=hist, gpus_per_node=self.gpus)
        )
        return summary.model_copy(update={"labels": self.labels})

    def take(self, gpus: int, *, from_free: int | None = None) -> str:
        """Best fit: the fullest node (by name among equals) with `gpus` free."""
        nodes = sorted(
            (
                n
                for n, f in self.free.items()
                if f >= gpus and (from_free is None or f == from_free)
            ),
            key=lambda n: (self.free[n], n),
        )
        node = nodes[0]
        self.free[node] -= gpus
        return node


@dataclass
class Fleet:
    clusters: dict[str, Cluster]
    running: dict[str, Running] = field(default_factory=dict)

    @classmethod
    def of(cls, *clusters: Cluster) -> Fleet:
        return cls({c.name: c for c in clusters})

    def run(
        self,
        job_id: str,
        queue: str,
        cluster: str,
        pods: Sequence[int],
        *,
        started_s: float = 0.0,
        priority: int = 0,
        ends: float | None = None,
        nodes: Sequence[str] | None = None,
        checkpoint_s: float | None = None,
    ) -> Running:
        where = self.clusters[cluster]
        placed = []
        for index, gpus in enumerate(pods):
            if nodes is not None:
                node = nodes[index]
                where.free[node] -= gpus
                assert where.free[node] >= 0, f"{node} over-committed"
            else:
                node = where.take(gpus)
            placed.append((node, gpus))
        job = Running(job_id, queue, cluster, placed, at(started_s), priority, where.model, ends)
        job.checkpointed = at(checkpoint_s) if checkpoint_s is not None else None
        self.running[job_id] = job
        return job

    def end(self, job_id: str) -> None:
        job = self.running.pop(job_id)
        for node, gpus in job.pods:
            self.clusters[job.cluster].free[node] += gpus

    def snapshot(self) -> snapshot.FleetSnapshot:
        return snapshot.FleetSnapshot.build(
            [
                snapshot.ClusterCapacity.from_summary(c.summary(), healthy=True)
                for c in self.clusters.values()
            ]
        )

    def views(self) -> list[snapshot.RunningJob]:
        return [job.view() for job in self.running.values()]

    def plan(self, pending: Sequence[snapshot.PendingJob], **kwargs: Any) -> planning.CyclePlan:
        return planning.plan_cycle(self.snapshot(), pending, running=self.views(), **kwargs)

    def apply(
        self,
        plan: planning.CyclePlan,
        pending: Sequence[snapshot.PendingJob],
        *,
        now_s: float,
        duration: dict[str, float] | None = None,
    ) -> None:
        """Run the assignments on their clusters (best fit, like the agent)."""
        by_id = {p.job_id: p for p in pending}
        for assignment in plan.assignments:
            job = by_id[assignment.job_id]
            cluster = self.clusters[assignment.cluster]
            pods = []
            for take in assignment.takes:
                pods.append((cluster.take(take.gpus), take.gpus))
            ends = now_s + duration[job.job_id] if duration and job.job_id in duration else None
            self.running[job.job_id] = Running(
                job.job_id,
                job.queue,
                cluster.name,
                pods,
                at(now_s),
                job.priority,
                cluster.model,
                ends,
            )
        for preemption in plan.preemptions:
            if preemption.job_id in self.running:
                self.end(preemption.job_id)


def codes(plan: planning.CyclePlan, job_id: str) -> dict[str, set[str]]:
    """cluster -> reason codes of an unplaceable job."""
    out: dict[str, set[str]] = {}
    for miss in plan.unplaceable:
        if miss.job_id == job_id:
            for reason in miss.details:
                out.setdefault(reason.cluster, set()).add(reason.code.value)
    return out


def reasons(plan: planning.CyclePlan, job_id: str) -> list[str]:
    return [r for miss in plan.unplaceable if miss.job_id == job_id for r in miss.reasons]
