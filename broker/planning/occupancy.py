"""What a job holding GPUs occupies, as the planner sees it (`snapshot.RunningJob`). Pure.

Called by `jobs.accounting.Accounting.running_jobs` for every Dispatched or Running job
(cached until the job changes). GPUs are counted per model: the model the broker chose at
dispatch when it still knows it (`Fit.gpus_by_model`), else inferred after a restart — the
job's only allowed model, else the first model of its cluster the job allows. Pods carry
their node and whole GPUs (what preemption gives back); a sharing pod holds no whole GPU
but counts one toward quotas; a pod of MIG slices holds no whole GPU either (preemption gives
back nothing of it) and counts the GPUs its slices fill (`quotas.gpus_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    *,
    models: Mapping[str, int] | None,
    cluster_models: Sequence[str],
    preempting: bool,
) -> snapshot.RunningJob:
    request = gangs.gang_request(record.id, record.job)
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
