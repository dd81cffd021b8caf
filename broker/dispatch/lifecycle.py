"""A job's life in the broker: every state transition, from submit to its final state.

All changes to job records go through `Lifecycle`, under one lock, and are written to the store
(compare-and-swap) before anything is sent to an agent. Called by the HTTP handlers (submit,
cancel), the scheduling cycle (dispatch) and the agent sessions (accepted, rejected, status).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from broker.api import jobs as jobs_api
from broker.api import messages, status
from broker.api.status import JobState
from broker.dispatch import fleet as fleet_
from broker.scheduler import fitting, planning, snapshot
from broker.state import errors, records
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)

# reasons a gang failed that are not the workload's fault: the job is retried elsewhere
INFRA_REASONS = frozenset({"NodeLost", "Evicted", "PodDeleted", "ClusterLost", "LostByAgent"})
MAX_INFRA_RETRIES = 3


class Lifecycle:
    def __init__(
        self,
        jobs: records.JobRecords,
        fleet: fleet_.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        cancel_grace_seconds: float = 30.0,
    ) -> None:
        self.jobs = jobs
        self.fleet = fleet
        self.meters = meters
        self.cancel_grace = cancel_grace_seconds
        self.lock = asyncio.Lock()
        self.queued: set[str] = {r.id for r in jobs if r.status.state == JobState.QUEUED}
        self.why: dict[str, tuple[str, ...]] = {}
        self.wakeup = asyncio.Event()
        self.spans = jobspans.JobSpans()
        self.flush_needed = asyncio.Event()

    # ---- transitions ------------------------------------------------------------------

    def _move(self, record: status.JobRecord, state: JobState, reason: str, msg: str = "") -> None:
        before = record.status.state
        queued_at = record.status.events[-1].time if record.status.events else record.created
        record.record(state, reason, msg)
        now = record.status.events[-1].time
        if state == JobState.DISPATCHED:
            self.spans.dispatched(record, queued_at=queued_at, now=now)
        elif state.terminal:
            self.spans.finished(record, now=now)
        if state == JobState.QUEUED:
            self.queued.add(record.id)
            self.wakeup.set()
        else:
            self.queued.discard(record.id)
            self.why.pop(record.id, None)
        if state.terminal:
            self.meters.jobs_finished.labels(state=state.value).inc()
        if state == JobState.RUNNING and before != JobState.RUNNING:
            started = record.event_time(JobState.QUEUED) or record.created
            latency = (record.status.events[-1].time - started).total_seconds()
            self.meters.submit_to_running.observe(latency)

    def _requeue(self, record: status.JobRecord, reason: str, msg: str) -> None:
        record.status.cluster = None
        record.status.pods = []
        self._move(record, JobState.QUEUED, reason, msg)

    async def submit(self, record: status.JobRecord) -> status.JobRecord:
        record.record(JobState.QUEUED, "Submitted", "accepted by the broker")
        stored = await self.jobs.create(record)
        if stored is record:
            self.queued.add(record.id)
            self.meters.jobs_submitted.labels(queue=record.job.spec.queue).inc()
            self.wakeup.set()
        return stored

    async def cancel(self, record: status.JobRecord, *, reason: str = "Cancelled") -> None:
        async with self.lock:
            state = record.status.state
            if state.terminal or record.status.cancel_requested:
                return
            if state == JobState.QUEUED:
                self._move(record, JobState.CANCELLED, reason, "cancelled while queued")
                await self.jobs.save(record)
                return
            record.status.cancel_requested = True
            record.record(state, "CancelRequested", "waiting for the agent to delete the pods")
            await self.jobs.save(record)
            await self._send_cancel(record.status.cluster, record.id, record.status.epoch, reason)

    async def _send_cancel(
        self, cluster_name: str | None, job_id: str, epoch: int, reason: str
    ) -> None:
        if cluster_name is None:
            return
        cluster = self.fleet.clusters.get(cluster_name)
        if cluster is None or cluster.link is None:
            return
        message = messages.Cancel(
            job_id=job_id, epoch=epoch, reason=reason, grace_seconds=self.cancel_grace
        )
        try:
            await cluster.link.send(message)
        except ConnectionError:
            logger.warning("cancel of %s not sent: %s disconnected", job_id, cluster_name)

    # ---- scheduling -------------------------------------------------------------------

    def pending(self) -> list[snapshot.PendingJob]:
        out = []
        for job_id in self.queued:
            record = self.jobs.get(job_id)
            if record is None or record.status.cancel_requested:
                continue
            out.append(
                snapshot.PendingJob(
                    job_id=job_id,
                    queue=record.job.spec.queue,
                    priority=record.job.spec.priority,
                    created=record.created,
                    request=jobs_api.gang_request(job_id, record.job),
                    excluded=self.fleet.excluded_for(job_id),
                )
            )
        return out

    async def dispatch(self, plan: planning.CyclePlan) -> int:
        """Commit a cycle's plan (Dispatched) and send the offers. Returns offers sent."""
        now = status.utcnow()
        for miss in plan.unplaceable:
            self.why[miss.job_id] = miss.reasons
            self.spans.waiting(miss.job_id, miss.reasons, now=now)
        async with self.lock:
            chosen: list[tuple[status.JobRecord, planning.Assignment, fleet_.Cluster]] = []
            for assignment in plan.assignments:
                record = self.jobs.get(assignment.job_id)
                cluster = self.fleet.clusters.get(assignment.cluster)
                if record is None or record.status.state != JobState.QUEUED or cluster is None:
                    continue
                record.status.cluster = cluster.name
                record.status.epoch = cluster.epoch
                record.status.attempts += 1
                record.status.reasons = []
                self._move(record, JobState.DISPATCHED, "Dispatched", f"offered to {cluster.name}")
                chosen.append((record, assignment, cluster))
            if not chosen:
                return 0
            try:
                await self.jobs.save_many([r for r, _, _ in chosen])
            except errors.StoreError as exc:
                logger.warning("dispatch commit failed, jobs stay queued: %s", exc)
                for record, _, _ in chosen:
                    self.queued.add(record.id)
                self.wakeup.set()
                return 0
            for record, assignment, cluster in chosen:
                cluster.inflight[record.id] = fleet_.InFlight(
                    fit=fitting.Fit(cluster.name, assignment.takes, leftover=0)
                )
        sent = 0
        for record, _, cluster in chosen:
            link = cluster.link
            if link is None:
                continue
            dispatched = record.event_time(JobState.DISPATCHED)
            if dispatched is not None:
                self.meters.submit_to_dispatch.observe(
                    (dispatched - record.created).total_seconds()
                )
            offer = messages.Offer(
                job_id=record.id,
                epoch=record.status.epoch,
                tenant=record.tenant,
                job=record.job,
                traceparent=self.spans.offer_traceparent(record),
            )
            try:
                await link.send(offer)
                sent += 1
            except ConnectionError:
                logger.warning("offer of %s not sent: %s disconnected", record.id, cluster.name)
        return sent

    # ---- agent messages ---------------------------------------------------------------

    def _owned(self, cluster: str, job_id: str) -> status.JobRecord | None:
        record = self.jobs.get(job_id)
        if record is None or record.status.cluster != cluster or record.status.state.terminal:
            return None
        return record

    async def accepted(self, cluster: fleet_.Cluster, message: messages.Accepted) -> None:
        async with self.lock:
            record = self._owned(cluster.name, message.job_id)
            flight = cluster.inflight.get(message.job_id)
            if flight is not None:
                flight.accepted = True
            self.spans.answered(message.job_id, accepted=True)
            if record is None:
                await self._send_cancel(cluster.name, message.job_id, message.epoch, "Stale")
                return
            self.meters.placements.labels(result="accepted").inc()
            record.status.pods = [
                status.PodStatus(name=p.name, task=p.task, node=p.node, gpus=p.gpus)
                for p in message.pods
            ]
            self._save_soon(record)
            if record.status.cancel_requested:
                await self._send_cancel(cluster.name, record.id, message.epoch, "Cancelled")

    async def rejected(self, cluster: fleet_.Cluster, message: messages.Rejected) -> None:
        async with self.lock:
            cluster.inflight.pop(message.job_id, None)
            self.spans.answered(message.job_id, accepted=False, reasons=message.reasons)
            record = self._owned(cluster.name, message.job_id)
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
            if record is None:
                if not message.state.terminal:
                    await self._send_cancel(cluster.name, message.job_id, message.epoch, "Stale")
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
            if reason in INFRA_REASONS and record.status.infra_retries < MAX_INFRA_RETRIES:
                record.status.infra_retries += 1
                self._requeue(record, reason, f"retrying: {text}")
            else:
                self._move(record, JobState.FAILED, reason or "Failed", text)
        elif state == JobState.CANCELLED:
            if record.status.cancel_requested:
                self._move(record, JobState.CANCELLED, "Cancelled", text or "pods deleted")
            else:
                self._requeue(record, reason or "Evicted", text or "the agent removed the job")
        elif state == JobState.QUEUED:
            self._requeue(record, reason or "Requeued", text)
        elif not pods:
            return
        self._save_soon(record)

    def _save_soon(self, record: status.JobRecord) -> None:
        self.jobs.save_soon(record)
        self.flush_needed.set()

    async def run_flusher(self, *, gather_seconds: float = 0.002) -> None:
        """Group commit of what agents report: one transaction for many updates."""
        while True:
            await self.flush_needed.wait()
            self.flush_needed.clear()
            await asyncio.sleep(gather_seconds)
            async with self.lock:
                try:
                    await self.jobs.flush()
                except errors.StoreError as exc:
                    logger.warning("group commit of %d jobs failed: %s", self.jobs.dirty, exc)
                    self.flush_needed.set()
                    await asyncio.sleep(0.5)

    async def hello(self, cluster: fleet_.Cluster, hello: messages.Hello) -> None:
        """Reconcile what the agent holds with what the broker believes (fencing)."""
        async with self.lock:
            held = {job.job_id: job for job in hello.jobs}
            for job in hello.jobs:
                record = self._owned(cluster.name, job.job_id)
                if record is None:
                    if not job.state.terminal:
                        await self._send_cancel(cluster.name, job.job_id, job.epoch, "Stale")
                    continue
                record.status.epoch = cluster.epoch
                if record.status.cancel_requested and not job.state.terminal:
                    await self.jobs.save(record)
                    await self._send_cancel(cluster.name, job.job_id, cluster.epoch, "Cancelled")
                    continue
                if job.state in (JobState.QUEUED, JobState.DISPATCHED):
                    record.status.pods = list(job.pods) or record.status.pods
                    await self.jobs.save(record)
                    continue
                await self._apply_update(
                    record, job.state, "Reconciled", "state reported on reconnect", job.pods
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
