"""Deleting the pods of jobs that failed or were replaced, with the failure grace.

`handling.JobHandler` deletes the remaining pods of a gang that failed (after the pod event
that failed it, or at adoption), the pods of earlier attempts found at start, both in the
background (`spawn`), and the live pods of an attempt the broker runs again, awaited under the
handler's lock (`delete_live`). A pod the backend failed `GPUFailed` is deleted with the live
ones: it failed for its GPU, not because its workload ended, and may still run on it. A
deletion that fails is logged; each one ends with `on_change`, as the inventory changed.
`close` waits for the background deletions still running. Cancels delete with the cancel's
own grace and are not handled here.

The pods of a finished job stay for their logs, as a Kubernetes Job's do, until
`--finished-pods-ttl` after the broker acknowledged its final report: the handler `schedule`s
them when its table forgets the job, and `sweep` (once a second, from the session's heartbeat
too) deletes those due, one job after another in a single background task, so that a burst of
thousands finished at once does not become thousands of concurrent API calls. Without it,
every pod the agent ever created would stay in the cluster (Kubernetes' terminated-pod
collection starts only past 12,500 of them, cluster-wide) and, in the simulated backend, in
memory.
A pod already gone counts as deleted; the schedule is the agent's memory only: after a
restart, finished jobs are adopted from their pods, reported, and scheduled again.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from broker.api import status
from member_agent.binding import binding
from member_agent.cluster import base, gpuhealth
from member_agent.jobs import table

logger = logging.getLogger(__name__)


class Deleter:
    def __init__(
        self,
        backend: base.ClusterBackend,
        *,
        grace_seconds: float,
        on_change: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.grace_seconds = grace_seconds
        self.on_change = on_change
        self._tasks: set[asyncio.Task[None]] = set()
        # (due, order, job id, namespace, pods): finished jobs' pods, soonest first
        self._finished: list[tuple[float, int, str, str, list[status.PodStatus]]] = []
        self._order = itertools.count()
        self._sweeping: asyncio.Task[None] | None = None

    @property
    def finished_waiting(self) -> int:
        """Finished jobs whose pods are scheduled for deletion and not deleted yet."""
        return len(self._finished)

    def schedule(self, record: table.TrackedJob, *, due: float) -> None:
        """Delete the pods of `record` (a finished job the table forgot) at `due`."""
        pods = [p for p in record.pods.values() if p.phase != status.PodPhase.DELETED]
        if pods:
            item = (due, next(self._order), record.job_id, record.namespace, pods)
            heapq.heappush(self._finished, item)

    def sweep(self, now: float) -> int:
        """Start deleting the finished jobs' pods due by `now` (unless the last sweep is
        still at it); returns how many jobs."""
        if self._sweeping is not None and not self._sweeping.done():
            return 0
        due = []
        while self._finished and self._finished[0][0] <= now:
            _, _, job_id, namespace, pods = heapq.heappop(self._finished)
            due.append((job_id, namespace, pods))
        if due:
            self._sweeping = asyncio.get_running_loop().create_task(self._delete_finished(due))
            self._tasks.add(self._sweeping)
            self._sweeping.add_done_callback(self._tasks.discard)
        return len(due)

    async def _delete_finished(
        self, due: Sequence[tuple[str, str, list[status.PodStatus]]]
    ) -> None:
        for job_id, namespace, pods in due:  # one job after another
            await self.delete(job_id, namespace, pods, grace_seconds=0)

    async def delete_live(self, record: table.TrackedJob) -> None:
        """The job's live pods, as they are when the deletion starts (and those failed
        GPUFailed)."""
        gpu_failed = [
            pod
            for pod in record.pods.values()
            if pod.phase == status.PodPhase.FAILED and pod.reason == gpuhealth.GPU_FAILED
        ]
        await self.delete(record.job_id, record.namespace, [*record.live_pods(), *gpu_failed])

    async def delete(
        self,
        job_id: str,
        namespace: str,
        pods: Sequence[status.PodStatus],
        *,
        grace_seconds: float | None = None,
    ) -> None:
        """Delete `pods` with `grace_seconds` (None: the failure grace); a failure is logged
        (`binding.delete_pods` names each pod it could not delete)."""
        if not pods:
            return
        try:
            await binding.delete_pods(
                self.backend,
                ((namespace, p.name) for p in pods),
                grace_seconds=self.grace_seconds if grace_seconds is None else grace_seconds,
            )
        except Exception:
            logger.exception("deleting %d pods of job %s", len(pods), job_id)
        self.on_change()

    def spawn(self, deletion: Coroutine[Any, Any, None]) -> None:
        """Run a deletion (`delete`, `delete_live`) in the background."""
        task = asyncio.get_running_loop().create_task(deletion)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for the background deletions still running."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
