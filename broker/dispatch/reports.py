"""What agents report about the jobs the broker gave them (used by `lifecycle`).

Accepted, Rejected, JobUpdate, the jobs an agent holds when it says hello (reconcile and
fencing), and a cluster lost past its grace. Messages about an earlier attempt of a job are
stale: they change nothing, and a copy still running is cancelled, that attempt only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker.api import messages, status
from broker.api.status import JobState
from broker.dispatch import fleet as fleet_
from broker.dispatch import transitions

logger = logging.getLogger(__name__)


class AgentReports(transitions.Transitions):
    """Handlers of agent messages; the state is `Transitions`'."""

    # ---- agent messages ---------------------------------------------------------------

    def _owned(self, cluster: str, job_id: str) -> status.JobRecord | None:
        record = self.jobs.get(job_id)
        if record is None or record.status.cluster != cluster or record.status.state.terminal:
            return None
        return record

    async def accepted(self, cluster: fleet_.Cluster, message: messages.Accepted) -> None:
        async with self.lock:
            record = self._owned(cluster.name, message.job_id)
            if record is not None and transitions.is_stale(record, message.attempt):
                await self._send_cancel(
                    cluster.name, record.id, message.epoch, "Stale", attempt=message.attempt
                )
                return
            flight = cluster.inflight.get(message.job_id)
            if flight is not None:
                flight.accepted = True
            self.spans.answered(message.job_id, accepted=True)
            if record is None:
                await self._send_cancel(
                    cluster.name, message.job_id, message.epoch, "Stale", attempt=message.attempt
                )
                return
            self.meters.placements.labels(result="accepted").inc()
            record.status.pods = [
                status.PodStatus(name=p.name, task=p.task, node=p.node, gpus=p.gpus)
                for p in message.pods
            ]
            self._save_soon(record)
            if record.status.cancel_requested:
                await self._send_cancel(
                    cluster.name, record.id, message.epoch, "Cancelled", attempt=message.attempt
                )

    async def rejected(self, cluster: fleet_.Cluster, message: messages.Rejected) -> None:
        async with self.lock:
            record = self._owned(cluster.name, message.job_id)
            if record is not None and transitions.is_stale(record, message.attempt):
                return
            cluster.inflight.pop(message.job_id, None)
            self.spans.answered(message.job_id, accepted=False, reasons=message.reasons)
            if record is None or record.status.state != JobState.DISPATCHED:
                return
            self.meters.placements.labels(result="rejected").inc()
            cluster.rejected[record.id] = cluster.summary.seq if cluster.summary else 0
            reasons = [f"{cluster.name}: {r}" for r in message.reasons]
            record.status.reasons = reasons
            if record.status.cancel_requested:
                self._move(record, JobState.CANCELLED, "Cancelled", "cancelled while offered")
            else:
                self._requeue(record, "Rejected", "; ".join(reasons))
            await self.jobs.save(record)

    async def job_update(self, cluster: fleet_.Cluster, message: messages.JobUpdate) -> None:
        async with self.lock:
            record = self._owned(cluster.name, message.job_id)
            if record is None or transitions.is_stale(record, message.attempt):
                if not message.state.terminal:
                    await self._send_cancel(
                        cluster.name,
                        message.job_id,
                        message.epoch,
                        "Stale",
                        attempt=message.attempt,
                    )
                return
            await self._apply_update(
                record, message.state, message.reason, message.message, message.pods
            )

    async def _apply_update(
        self,
        record: status.JobRecord,
        state: JobState,
        reason: str,
        text: str,
        pods: Sequence[status.PodStatus],
    ) -> None:
        if pods:
            record.status.pods = list(pods)
        current = record.status.state
        if state == JobState.RUNNING and current != JobState.RUNNING:
            self._move(record, JobState.RUNNING, reason or "PodsRunning", text)
        elif state == JobState.SUCCEEDED:
            self._move(record, JobState.SUCCEEDED, reason or "Completed", text)
        elif state == JobState.FAILED:
            if (
                reason in transitions.INFRA_REASONS
                and record.status.infra_retries < transitions.MAX_INFRA_RETRIES
            ):
                record.status.infra_retries += 1
                self._requeue(record, reason, f"retrying: {text}")
            else:
                self._move(record, JobState.FAILED, reason or "Failed", text)
        elif state == JobState.CANCELLED:
            if record.status.cancel_requested:
                self._move(record, JobState.CANCELLED, "Cancelled", text or "pods deleted")
            elif record.id in self.preempting:
                self._requeue(record, transitions.PREEMPTED, self.preempting[record.id].message)
            else:
                self._requeue(record, reason or "Evicted", text or "the agent removed the job")
        elif state == JobState.QUEUED:
            self._requeue(record, reason or "Requeued", text)
        elif not pods:
            return
        self._save_soon(record)

    async def hello(self, cluster: fleet_.Cluster, hello: messages.Hello) -> None:
        """Reconcile what the agent holds with what the broker believes (fencing)."""
        async with self.lock:
            held = {job.job_id: job for job in hello.jobs}
            for job in hello.jobs:
                record = self._owned(cluster.name, job.job_id)
                if record is None or transitions.is_stale(record, job.attempt):
                    held.pop(job.job_id, None)  # not the attempt the broker runs there
                    if not job.state.terminal:
                        await self._send_cancel(
                            cluster.name, job.job_id, job.epoch, "Stale", attempt=job.attempt
                        )
                    continue
                record.status.epoch = cluster.epoch
                if record.status.cancel_requested and not job.state.terminal:
                    await self.jobs.save(record)
                    await self._send_cancel(
                        cluster.name, job.job_id, cluster.epoch, "Cancelled", attempt=job.attempt
                    )
                    continue
                if job.state in (JobState.QUEUED, JobState.DISPATCHED):
                    record.status.pods = list(job.pods) or record.status.pods
                    await self.jobs.save(record)
                    continue
                await self._apply_update(
                    record,
                    job.state,
                    job.reason or "Reconciled",
                    "state reported on reconnect",
                    job.pods,
                )
            lost = [
                r
                for r in self.jobs
                if r.status.cluster == cluster.name
                and r.status.state in (JobState.DISPATCHED, JobState.RUNNING)
                and r.id not in held
            ]
            for record in lost:
                if record.status.cancel_requested:
                    self._move(record, JobState.CANCELLED, "Cancelled", "gone from the cluster")
                elif record.id in self.preempting:
                    self._requeue(record, transitions.PREEMPTED, self.preempting[record.id].message)
                else:
                    record.status.infra_retries += 1
                    self._requeue(record, "LostByAgent", f"{cluster.name} no longer holds it")
            if lost:
                await self.jobs.save_many(lost)

    async def cluster_lost(self, name: str) -> int:
        """The cluster stayed away past its grace period: run its jobs elsewhere."""
        async with self.lock:
            moved = [
                r
                for r in self.jobs
                if r.status.cluster == name
                and r.status.state in (JobState.DISPATCHED, JobState.RUNNING)
            ]
            for record in moved:
                if record.status.cancel_requested:
                    self._move(record, JobState.CANCELLED, "Cancelled", f"{name} lost")
                else:
                    self._requeue(record, "ClusterLost", f"{name} unreachable past its grace")
            if moved:
                await self.jobs.save_many(moved)
            return len(moved)
