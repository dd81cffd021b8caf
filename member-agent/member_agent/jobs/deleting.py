"""Deleting the pods of jobs that failed or were replaced, with the failure grace.

`handling.JobHandler` deletes the remaining pods of a gang that failed (after the pod event
that failed it, or at adoption), the pods of earlier attempts found at start, both in the
background (`spawn`), and the live pods of an attempt the broker runs again, awaited under the
handler's lock (`delete_live`). A pod the backend failed `GPUFailed` is deleted with the live
ones: it failed for its GPU, not because its workload ended, and may still run on it. A
deletion that fails is logged; each one ends with `on_change`, as the inventory changed.
`close` waits for the background deletions still running. Cancels delete with the cancel's
own grace and are not handled here.
"""

from __future__ import annotations

import asyncio
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

    async def delete_live(self, record: table.TrackedJob) -> None:
        """The job's live pods, as they are when the deletion starts (and those failed
        GPUFailed)."""
        gpu_failed = [
            pod
            for pod in record.pods.values()
            if pod.phase == status.PodPhase.FAILED and pod.reason == gpuhealth.GPU_FAILED
        ]
        await self.delete(record.job_id, record.namespace, [*record.live_pods(), *gpu_failed])

    async def delete(self, job_id: str, namespace: str, pods: Sequence[status.PodStatus]) -> None:
        if not pods:
            return
        try:
            await binding.delete_pods(
                self.backend,
                ((namespace, p.name) for p in pods),
                grace_seconds=self.grace_seconds,
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
