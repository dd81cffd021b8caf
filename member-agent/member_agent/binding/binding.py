"""Create a gang's pods all-or-nothing, delete pods with a grace period, annotate them.

The session calls `build_requests` with the placement `placement.gang.place_gang` chose, then
`create_gang`: every pod is created through the ClusterBackend, or, if one create fails, the
ones created are deleted again, and so are the ones whose create may have been applied though
it failed (a lost answer), by name; then BindingError is raised. Nothing here decides where a
pod goes. The backend makes each create idempotent and retries it before it fails (see
`kubernetes.writing`), and a delete of a missing pod is done.

Each pod carries what an agent restarted later needs to rebuild the job from its pods alone
(`base.held_job` reads it back): the labels `gpufed.io/job` and `gpufed.io/task`, and the
annotations `gpufed.io/epoch` (the offer's), `gpufed.io/attempt` (the offer's attempt: the
pods of a job run again are its latest attempt's, and their names say so too, see
`gangs.pod_name`), `gpufed.io/min-member`, `gpufed.io/gang-size`, `gpufed.io/cluster-lost` (the
job's `failurePolicy.clusterLost`: whether the agent's fence stops it) and the W3C `traceparent`.
A job of an array (its `gpufed.io/array-index` label, `api.arrays`) gives every container of
its pods the environment variable `GPUFED_ARRAY_INDEX` with its index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from broker.api import arrays, jobs
from member_agent.cluster import base, errors
from member_agent.placement import gang

logger = logging.getLogger(__name__)

JOB_LABEL = "gpufed.io/job"
GANG_LABEL = "gpufed.io/gang"
QUEUE_LABEL = "gpufed.io/queue"
TASK_LABEL = "gpufed.io/task"
TRACEPARENT_ANNOTATION = base.TRACEPARENT_ANNOTATION
DEFAULT_CONCURRENCY = 32


class BindingError(Exception):
    """A gang could not be created; the pods that were or may have been created before the
    failure were deleted."""

    def __init__(
        self,
        message: str,
        *,
        rolled_back: Sequence[str] = (),
        leftovers: Sequence[str] = (),
        unsure: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.rolled_back = tuple(rolled_back)  # created, then deleted again
        self.leftovers = tuple(leftovers)  # created (or maybe), and deleting them failed
        self.unsure = tuple(unsure)  # their create's outcome unknown: deleted by name


def build_requests(
    job_id: str,
    job: jobs.GPUJob,
    placement: gang.GangPlacement,
    *,
    traceparent: str | None = None,
    epoch: int | None = None,
    attempt: int = 1,
) -> list[base.PodRequest]:
    """One PodRequest per placed pod: gpufed's labels, the trace context and what a restarted
    agent needs (epoch, attempt, minMember, gang size) on top of the task's own template
    metadata."""
    total = sum(task.replicas for task in job.spec.tasks)
    gang_meta = {
        base.MIN_MEMBER_ANNOTATION: str(job.spec.gang.min_member or total),
        base.GANG_SIZE_ANNOTATION: str(total),
        base.ATTEMPT_ANNOTATION: str(attempt),
        base.CLUSTER_LOST_ANNOTATION: job.spec.cluster_lost.value,
    }
    if epoch is not None:
        gang_meta[base.EPOCH_ANNOTATION] = str(epoch)
    templates: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, str]]] = {}
    index = arrays.index_of(job.metadata.labels)
    for task in job.spec.tasks:
        parsed = task.template.model()  # the template is kept as JSON: parse it once here
        template = parsed.model_dump(by_alias=True, exclude_none=True, mode="json")
        if index is not None:
            _set_env(template, arrays.INDEX_ENV, str(index))
        labels = {
            **parsed.metadata.labels,
            JOB_LABEL: job_id,
            GANG_LABEL: job_id,
            QUEUE_LABEL: job.spec.queue,
            TASK_LABEL: task.name,
        }
        annotations = {**parsed.metadata.annotations, **gang_meta}
        if traceparent:
            annotations[TRACEPARENT_ANNOTATION] = traceparent
        templates[task.name] = (template, labels, annotations)
    requests = []
    for placed in placement.pods:
        pod = placed.placement
        template, labels, annotations = templates[pod.task]
        requests.append(
            base.PodRequest(
                namespace=job.metadata.namespace,
                name=pod.name,
                job_id=job_id,
                task=pod.task,
                queue=job.spec.queue,
                node=pod.node,
                gpus=tuple(pod.gpus),
                cpu_milli=placed.shape.cpu_milli,
                memory_mib=placed.shape.memory_mib,
                template=template,
                labels=labels,
                annotations=annotations,
                mig=placed.mig,
            )
        )
    return requests


def _set_env(template: dict[str, Any], name: str, value: str) -> None:
    """Set `name=value` in the environment of every container (and init container) of the
    pod template, over a value of that name the template gave."""
    spec = template.get("spec")
    if not isinstance(spec, dict):
        return
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if not isinstance(container, dict):
                continue
            env = [
                e
                for e in container.get("env") or []
                if not (isinstance(e, dict) and e.get("name") == name)
            ]
            env.append({"name": name, "value": value})
            container["env"] = env


async def create_gang(
    backend: base.ClusterBackend,
    requests: Sequence[base.PodRequest],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    rollback_grace_seconds: float = 0.0,
) -> None:
    """Create every pod, up to `concurrency` at a time; on any failure (or cancellation)
    delete what may exist and raise BindingError from the backend's error.

    What is deleted: every pod whose create returned, and every pod whose create may have
    been applied without saying so (it failed with a TemporaryBackendError, anything that is
    not a BackendError, or was cancelled in flight: the API server may have stored it and the
    answer been lost), by name, a missing one counting as deleted. A create that failed with a
    PermanentBackendError left nothing of its own: the name may be another pod's, and that pod
    is left alone. The backend retries a single request before it fails (`retrying`)."""
    created: list[base.PodRequest] = []
    unsure: list[base.PodRequest] = []  # may exist: the create's outcome is not known
    failures: list[tuple[base.PodRequest, BaseException]] = []
    pending: Iterator[base.PodRequest] = iter(requests)

    async def create_some() -> None:
        for request in pending:
            if failures:
                return
            try:
                await backend.create_pod(request)
            except errors.PermanentBackendError as exc:
                failures.append((request, exc))
                return
            except Exception as exc:
                unsure.append(request)
                failures.append((request, exc))
                return
            except BaseException:
                unsure.append(request)
                raise
            created.append(request)

    try:
        workers = min(concurrency, len(requests))
        if workers <= 1:
            await create_some()
        else:
            await asyncio.gather(*(create_some() for _ in range(workers)))
    except BaseException:
        await _roll_back(backend, [*created, *unsure], grace_seconds=rollback_grace_seconds)
        raise
    if not failures:
        return
    leftovers = await _roll_back(backend, [*created, *unsure], grace_seconds=rollback_grace_seconds)
    failed, first = failures[0]
    if isinstance(first, errors.RefusedError):
        message = f"pod {failed.namespace}/{failed.name} refused: {first.detail}"
    else:
        message = f"creating {len(requests)} pods failed after {len(created)}: {first}"
    if leftovers:
        message += f"; rollback left {len(leftovers)} pods: {', '.join(leftovers[:5])}"
    kept = set(leftovers)
    rolled_back = [r.name for r in created if r.name not in kept]
    raise BindingError(
        message,
        rolled_back=rolled_back,
        leftovers=leftovers,
        unsure=[r.name for r in unsure if r.name not in kept],
    ) from first


async def _roll_back(
    backend: base.ClusterBackend, pods: Sequence[base.PodRequest], *, grace_seconds: float
) -> list[str]:
    if not pods:
        return []
    logger.info("rolling back %d pods of %s", len(pods), pods[0].job_id)
    return await delete_pods(
        backend, ((r.namespace, r.name) for r in pods), grace_seconds=grace_seconds
    )


async def delete_pods(
    backend: base.ClusterBackend,
    pods: Iterable[tuple[str, str]],
    *,
    grace_seconds: float,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> list[str]:
    """Delete pods (namespace, name), up to `concurrency` at a time. Returns the names that
    could not be deleted; a missing pod counts as deleted."""
    failed: list[str] = []
    todo = list(pods)
    pending = iter(todo)

    async def delete_some() -> None:
        for namespace, name in pending:
            try:
                await backend.delete_pod(namespace, name, grace_seconds=grace_seconds)
            except errors.BackendError as exc:
                logger.warning("deleting pod %s/%s failed: %s", namespace, name, exc)
                failed.append(name)

    workers = min(concurrency, len(todo))
    if workers <= 1:
        await delete_some()
    else:
        await asyncio.gather(*(delete_some() for _ in range(workers)))
    return failed


async def annotate_pods(
    backend: base.ClusterBackend,
    pods: Iterable[tuple[str, str]],
    annotations: Mapping[str, str],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> list[str]:
    """Add `annotations` to pods (namespace, name), up to `concurrency` at a time. Returns the
    names that could not be annotated; a missing pod counts as done."""
    failed: list[str] = []
    todo = list(pods)
    pending = iter(todo)

    async def annotate_some() -> None:
        for namespace, name in pending:
            try:
                await backend.annotate_pod(namespace, name, annotations)
            except errors.BackendError as exc:
                logger.warning("annotating pod %s/%s failed: %s", namespace, name, exc)
                failed.append(name)

    workers = min(concurrency, len(todo))
    if workers <= 1:
        await annotate_some()
    else:
        await asyncio.gather(*(annotate_some() for _ in range(workers)))
    return failed
