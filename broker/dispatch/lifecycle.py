"""A job's life in the broker: every state transition, from submit to its final state.

All changes to job records go through `Lifecycle`, under one lock, and are written to the store
(compare-and-swap) before anything is sent to an agent. Called by the HTTP handlers (submit,
cancel), the scheduling cycle (dispatch) and the agent sessions (accepted, rejected, status).

Each dispatch is a new attempt (`status.attempts`, sent in the offer). What an agent says about
an earlier attempt of a job (the job came back to the same cluster) is stale: it changes
nothing, and a copy still running is cancelled, that attempt only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from broker.api import jobs as jobs_api
from broker.api import messages, status
from broker.api.status import JobState
from broker.dispatch import fleet as fleet_
from broker.scheduler import fitting, holdings, occupancy, planning, quotas, snapshot
from broker.state import errors, records
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)

# reasons a gang failed that are not the workload's fault: the job is retried elsewhere
INFRA_REASONS = frozenset({"NodeLost", "Evicted", "PodDeleted", "ClusterLost", "LostByAgent"})
MAX_INFRA_RETRIES = 3
# states in which a job holds GPUs on a cluster (what quotas count)
HOLDING = frozenset({JobState.DISPATCHED, JobState.RUNNING})
PREEMPTED = "Preempted"


@dataclass
class Preempting:
    """A victim the broker asked its agent to stop, until its GPUs show free in a summary."""

    preemptor: str
    cluster: str
    reason: str
    message: str
    since: float  # monotonic
    confirmed: bool = False  # the agent reported the job gone
    summary_at: object | None = None  # the cluster's summary when it did
    handed: bool = False  # reported released to one planning cycle


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
        # tenancy: jobs holding GPUs, victims being preempted, why-reasons with their codes
        self.active: set[str] = {r.id for r in jobs if r.status.state in HOLDING}
        self.preempting: dict[str, Preempting] = {}
        self.preemptions: Counter[str] = Counter()  # victim's queue -> jobs preempted
        self.why_details: dict[str, tuple[planning.Reason, ...]] = {}
        self._models_of: dict[str, dict[str, int]] = {}
        self._views: dict[str, tuple[tuple[object, ...], snapshot.RunningJob]] = {}
        self.preempt_timeout = 2 * cancel_grace_seconds + 30.0
        # GPUs held per queue and model, kept on every transition (see `usage`)
        self.holdings = holdings.Holdings()
        for record in jobs:
            if record.status.state in HOLDING:
                self._hold(record)

    # ---- transitions ------------------------------------------------------------------

    def _move(self, record: status.JobRecord, state: JobState, reason: str, msg: str = "") -> None:
        before = record.status.state
        queued_at = record.status.events[-1].time if record.status.events else record.created
        record.record(state, reason, msg)
        now = record.status.events[-1].time
        logger.info(
            "job %s: %s -> %s (%s)",
            record.id,
            before.value,
            state.value,
            reason,
            extra={
                "job_id": record.id,
                "cluster": record.status.cluster or "",
                "trace_id": record.trace_id or "",
                "state": state.value,
            },
        )
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
        self._track(record, state)

    def _track(self, record: status.JobRecord, state: JobState) -> None:
        """Keep the jobs holding GPUs and their usage; a victim leaving them has stopped."""
        if state in HOLDING:
            self.active.add(record.id)
            self._hold(record)
            return
        self.active.discard(record.id)
        self._unhold(record.id)
        self._models_of.pop(record.id, None)
        if state != JobState.QUEUED:
            self.why_details.pop(record.id, None)
        entry = self.preempting.get(record.id)
        if entry is not None and not entry.confirmed:
            entry.confirmed = True
            cluster = self.fleet.clusters.get(entry.cluster)
            entry.summary_at = cluster.summary if cluster is not None else None

    def _hold(self, record: status.JobRecord) -> None:
        if record.id in self.holdings:
            return
        gpus = self._models_of.get(record.id)
        if gpus is None:
            cluster = self.fleet.clusters.get(record.status.cluster or "")
            summary = cluster.summary if cluster is not None else None
            gpus = occupancy.infer_models(
                jobs_api.gang_request(record.id, record.job),
                [m.model for m in summary.models] if summary else [],
            )
        spec = record.job.spec
        key = (spec.queue, spec.priority, spec.priority_class)
        self.holdings.hold(record.id, spec.queue, gpus, key)

    def _unhold(self, job_id: str) -> None:
        self.holdings.release(job_id)

    def usage(self) -> quotas.Usage:
        """GPUs held per queue and model (Dispatched and Running jobs), without a walk."""
        return self.holdings.usage()

    def resync_usage(self) -> None:
        """Recount the usage from the jobs themselves (models inferred from fresh summaries;
        store conflicts that put records back): the scheduler calls it every few seconds."""
        self.holdings.reset(self.running_jobs())

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
            await self._send_cancel(
                record.status.cluster,
                record.id,
                record.status.epoch,
                reason,
                attempt=_attempt(record),
            )

    async def _send_cancel(
        self, cluster_name: str | None, job_id: str, epoch: int, reason: str, *, attempt: int
    ) -> None:
        if cluster_name is None:
            return
        cluster = self.fleet.clusters.get(cluster_name)
        if cluster is None or cluster.link is None:
            return
        message = messages.Cancel(
            job_id=job_id,
            epoch=epoch,
            reason=reason,
            grace_seconds=self.cancel_grace,
            attempt=attempt,
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
                    priority_class=record.job.spec.priority_class,
                    queued_since=record.status.events[-1].time if record.status.events else None,
                )
            )
        return out

    def running_jobs(self) -> list[snapshot.RunningJob]:
        """The jobs holding GPUs (Dispatched, Running), as the planner sees them."""
        out = []
        for job_id in self.active:
            record = self.jobs.get(job_id)
            if record is None or record.status.state not in HOLDING or not record.status.cluster:
                continue
            preempting = job_id in self.preempting
            key = (
                record.status.state,
                record.status.cluster,
                len(record.status.events),
                len(record.status.pods),
                preempting,
            )
            cached = self._views.get(job_id)
            if cached is None or cached[0] != key:
                cluster = self.fleet.clusters.get(record.status.cluster)
                summary = cluster.summary if cluster is not None else None
                view = occupancy.running_view(
                    record,
                    models=self._models_of.get(job_id),
                    cluster_models=[m.model for m in summary.models] if summary else [],
                    preempting=preempting,
                )
                cached = (key, view)
                self._views[job_id] = cached
            out.append(cached[1])
        if len(self._views) > 2 * len(self.active) + 64:
            self._views = {k: v for k, v in self._views.items() if k in self.active}
        return out

    def releasing(self) -> list[snapshot.Releasing]:
        """Victims whose GPUs their preemptors wait for; `released` once a summary newer than
        the agent's confirmation arrived (reported to one cycle, then forgotten)."""
        now = time.monotonic()
        out = []
        for victim, entry in list(self.preempting.items()):
            cluster = self.fleet.clusters.get(entry.cluster)
            if entry.handed or cluster is None or cluster.lost:
                del self.preempting[victim]
                continue
            if now - entry.since > self.preempt_timeout:
                logger.warning("preemption of %s not confirmed in time: forgotten", victim)
                del self.preempting[victim]
                continue
            released = (
                entry.confirmed
                and cluster.summary is not None
                and cluster.summary is not entry.summary_at
            )
            entry.handed = released
            held = self.holdings.of(victim)
            out.append(
                snapshot.Releasing(
                    victim,
                    entry.preemptor,
                    entry.cluster,
                    released,
                    queue=held[0] if held else "",
                    gpus=dict(held[1]) if held and not entry.confirmed else {},
                )
            )
        return out

    async def preempt(self, preemptions: Sequence[planning.Preemption]) -> int:
        """Stop a cycle's victims: a Cancel (reason Preempted, with the grace period) to their
        agents; each goes back to the queue when its agent reports it cancelled."""
        if not preemptions:
            return 0
        async with self.lock:
            chosen: list[tuple[status.JobRecord, planning.Preemption]] = []
            for item in preemptions:
                record = self.jobs.get(item.job_id)
                if (
                    record is None
                    or record.status.cluster != item.cluster
                    or record.status.state not in HOLDING
                    or record.status.cancel_requested
                    or record.id in self.preempting
                ):
                    continue
                self.preempting[record.id] = Preempting(
                    preemptor=item.preemptor,
                    cluster=item.cluster,
                    reason=item.reason,
                    message=item.message,
                    since=time.monotonic(),
                )
                record.record(record.status.state, "Preempting", item.message)
                chosen.append((record, item))
            if not chosen:
                return 0
            try:
                await self.jobs.save_many([r for r, _ in chosen])
            except errors.StoreError as exc:
                logger.warning("preemption commit failed, victims keep running: %s", exc)
                for record, _ in chosen:
                    self.preempting.pop(record.id, None)
                return 0
            for record, item in chosen:
                queue = record.job.spec.queue
                self.preemptions[queue] += 1
                self.meters.preemptions.labels(queue=queue, reason=item.reason).inc()
                await self._send_cancel(
                    record.status.cluster,
                    record.id,
                    record.status.epoch,
                    PREEMPTED,
                    attempt=_attempt(record),
                )
        return len(chosen)

    async def dispatch(self, plan: planning.CyclePlan) -> int:
        """Commit a cycle's plan (Dispatched) and send the offers. Returns offers sent."""
        now = status.utcnow()
        for miss in plan.unplaceable:
            self.why[miss.job_id] = miss.reasons
            self.why_details[miss.job_id] = miss.details
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
                taken = fitting.Fit(cluster.name, assignment.takes, leftover=0).gpus_by_model
                self._models_of[record.id] = taken
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
                    self.active.discard(record.id)
                    self._unhold(record.id)
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
                attempt=_attempt(record),
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
            if record is not None and _stale(record, message.attempt):
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
            if record is not None and _stale(record, message.attempt):
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
            if record is None or _stale(record, message.attempt):
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
            if reason in INFRA_REASONS and record.status.infra_retries < MAX_INFRA_RETRIES:
                record.status.infra_retries += 1
                self._requeue(record, reason, f"retrying: {text}")
            else:
                self._move(record, JobState.FAILED, reason or "Failed", text)
        elif state == JobState.CANCELLED:
            if record.status.cancel_requested:
                self._move(record, JobState.CANCELLED, "Cancelled", text or "pods deleted")
            elif record.id in self.preempting:
                self._requeue(record, PREEMPTED, self.preempting[record.id].message)
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
                if record is None or _stale(record, job.attempt):
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
                    self._requeue(record, PREEMPTED, self.preempting[record.id].message)
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


def _attempt(record: status.JobRecord) -> int:
    """The attempt of the job's latest dispatch, as the agent is told it."""
    return max(record.status.attempts, 1)


def _stale(record: status.JobRecord, attempt: int) -> bool:
    """A message about an attempt before the job's latest dispatch: it changes nothing."""
    return attempt < record.status.attempts
