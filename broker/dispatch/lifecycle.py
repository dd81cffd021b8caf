"""A job's life in the broker: every state transition, from submit to its final state.

All changes to job records go through `Lifecycle`, under one lock, and are written to the store
(compare-and-swap) before anything is sent to an agent. Called by the HTTP handlers (submit,
cancel), the scheduling cycle (dispatch) and the agent sessions (accepted, rejected, status).

Each dispatch is a new attempt (`status.attempts`, sent in the offer). What an agent says about
an earlier attempt of a job (the job came back to the same cluster) is stale: it changes
nothing, and a copy still running is cancelled, that attempt only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from broker.api import jobs as jobs_api
from broker.api import messages, status
from broker.api.status import JobState
from broker.dispatch import fleet as fleet_
from broker.dispatch import reports, transitions
from broker.scheduler import fitting, occupancy, planning, snapshot
from broker.state import errors

logger = logging.getLogger(__name__)


class Lifecycle(reports.AgentReports):
    """Every transition of every job: submit, cancel, preempt, dispatch, and agent reports."""

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
                attempt=transitions.attempt_of(record),
            )

    # ---- scheduling -------------------------------------------------------------------

    def pending(self) -> list[snapshot.PendingJob]:
        """The queued jobs as the planner sees them; runs every cycle, so it only looks up."""
        excluded: dict[str, set[str]] = {}
        for cluster in self.fleet.clusters.values():
            for job_id in cluster.rejected:
                excluded.setdefault(job_id, set()).add(cluster.name)
        out = []
        for job_id in self.queued:
            record = self.jobs.get(job_id)
            if record is None or record.status.cancel_requested:
                continue
            request = self.requests.get(job_id)
            if request is None:  # a job's spec never changes: parse its shapes once
                request = self.requests[job_id] = jobs_api.gang_request(job_id, record.job)
            out.append(
                snapshot.PendingJob(
                    job_id=job_id,
                    queue=record.job.spec.queue,
                    priority=record.job.spec.priority,
                    created=record.created,
                    request=request,
                    excluded=frozenset(excluded.get(job_id, ())),
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
            if (
                record is None
                or record.status.state not in transitions.HOLDING
                or not record.status.cluster
            ):
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
                    or record.status.state not in transitions.HOLDING
                    or record.status.cancel_requested
                    or record.id in self.preempting
                ):
                    continue
                self.preempting[record.id] = transitions.Preempting(
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
                    transitions.PREEMPTED,
                    attempt=transitions.attempt_of(record),
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
                attempt=transitions.attempt_of(record),
            )
            try:
                await link.send(offer)
                sent += 1
            except ConnectionError:
                logger.warning("offer of %s not sent: %s disconnected", record.id, cluster.name)
        return sent
