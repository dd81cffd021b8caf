"""What the jobs holding GPUs hold: each job as the planner sees it (`running_view`), and what
each queue holds, kept as jobs move rather than counted every cycle (`Holdings`). Pure data.

Owned by `jobs.accounting.Accounting`. It calls `running_view` for every Dispatched or
Running job (cached until the job changes). GPUs are counted per model: the model the broker
chose at dispatch when it still knows it (`Fit.gpus_by_model`), else inferred after a restart
(`infer_models`) — the job's only allowed model, else the first model of its cluster the job
allows. Pods carry their node and whole GPUs (what preemption gives back); a sharing pod
holds no whole GPU but counts one toward quotas; a pod of MIG slices holds no whole GPU
either (preemption gives back nothing of it) and counts the GPUs its slices fill
(`quotas.gpus_of`).

It calls `Holdings.hold` when a job starts holding GPUs (Dispatched) and `release` when it
stops (requeued, finished), and `reset` every few seconds from the jobs themselves (GPU
models inferred from fresh summaries, records put back after a store conflict). The
scheduling shell hands `usage()` to `planning.plan_cycle`, so a cycle costs O(queues), not
O(running jobs), until a preemption has to look at the jobs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from broker.api import gangs, status
from broker.planning import quotas, snapshot

WHOLE_GPU_MILLI = 1000


def infer_models(request: gangs.GangRequest, cluster_models: Sequence[str]) -> dict[str, int]:
    shapes = [shape for _, _, shape in request.tasks if shape.uses_gpus]
    allowed = sorted({m for shape in shapes for m in shape.models})
    usable = [m for m in cluster_models if any(shape.admits_model(m) for shape in shapes)]
    model = usable[0] if usable else (allowed[0] if allowed else "unknown")
    return {model: quotas.gpus_of(request)}


def running_view(
    record: status.JobRecord,
    request: gangs.GangRequest,
    *,
    models: Mapping[str, int] | None,
    cluster_models: Sequence[str],
    preempting: bool,
) -> snapshot.RunningJob:
    pods = tuple(
        snapshot.PodSlot(
            node=pod.node, gpus=sum(1 for slot in pod.gpus if slot.milli >= WHOLE_GPU_MILLI)
        )
        for pod in record.status.pods
        if pod.phase not in (status.PodPhase.DELETED, status.PodPhase.SUCCEEDED)
    )
    started = None  # the first event of its last unbroken run of Running events
    if record.status.state == status.JobState.RUNNING:
        for event in reversed(record.status.events):
            if event.state == status.JobState.RUNNING:
                started = event.time
            elif started is not None:
                break
    return snapshot.RunningJob(
        job_id=record.id,
        queue=record.job.spec.queue,
        priority=record.job.spec.priority,
        cluster=record.status.cluster or "",
        gpus=dict(models) if models else infer_models(request, cluster_models),
        pods=pods,
        started=started,
        created=record.created,
        priority_class=record.job.spec.priority_class,
        preempting=preempting,
        checkpointed=record.status.last_checkpoint,
    )


class Holdings:
    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._jobs: dict[str, tuple[str, dict[str, int], quotas.PriorityKey]] = {}
        self._gpus: dict[str, dict[str, int]] = {}
        self._holders: Counter[str] = Counter()
        self._priorities: Counter[quotas.PriorityKey] = Counter()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def hold(
        self, job_id: str, queue: str, gpus: Mapping[str, int], key: quotas.PriorityKey
    ) -> None:
        if job_id in self._jobs:
            return
        self._jobs[job_id] = (queue, dict(gpus), key)
        self._holders[queue] += 1
        self._priorities[key] += 1
        held = self._gpus.setdefault(queue, {})
        for model, count in gpus.items():
            held[model] = held.get(model, 0) + count

    def release(self, job_id: str) -> None:
        found = self._jobs.pop(job_id, None)
        if found is None:
            return
        queue, gpus, key = found
        self._holders[queue] -= 1
        self._priorities[key] -= 1
        held = self._gpus.get(queue, {})
        for model, count in gpus.items():
            held[model] = held.get(model, 0) - count

    def of(self, job_id: str) -> tuple[str, dict[str, int]] | None:
        """The queue and GPUs a job holds."""
        found = self._jobs.get(job_id)
        return (found[0], dict(found[1])) if found else None

    def usage(self) -> quotas.Usage:
        return quotas.Usage(self._gpus, self._holders, self._priorities)

    def reset(self, views: Iterable[snapshot.RunningJob]) -> None:
        """Count again from the jobs holding GPUs."""
        self._clear()
        for view in views:
            key = (view.queue, view.priority, view.priority_class)
            self.hold(view.job_id, view.queue, view.gpus, key)
